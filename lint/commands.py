"""What each CLI command does, as plain functions returning exit code and output text.

``cli.py`` only parses arguments and prints; tests call these directly too.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

from guardlint.contracts import ConfigError, Contract, all_contracts

from .findings import EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE, FORMATS, Outcome

if TYPE_CHECKING:
    from .config import Settings

# The runner, output formats, diffs, rule texts and diagnosis are imported by the commands that use
# them: a pre-commit run of one clean file needs no rule text, ``diagnose`` no runner.

__all__ = ["EXIT_CLEAN", "EXIT_FINDINGS", "EXIT_USAGE", "FORMATS", "Outcome", "run_check", "run_diagnose",
           "run_explain", "run_rules"]
_TEXT_FORMATS = ("text", "concise", "full")


def _split(values: Sequence[str]) -> list[str]:
    """``("GL1,GL2", "GL3")`` -> ``["GL1", "GL2", "GL3"]``: options repeat and take comma lists."""
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def run_check(paths: Sequence[str], *, select: Sequence[str] = (), ignore: Sequence[str] = (),
              exclude: Sequence[str] = (), fmt: str = "text", statistics: bool = False,
              exit_zero: bool = False, strict: bool = False, config: Optional[str] = None,
              stdin: Optional[bytes] = None, stdin_filename: Optional[str] = None,
              cwd: Optional[Path] = None, jobs: Optional[int] = None, fix: bool = False, diff: bool = False,
              unsafe_fixes: bool = False, respect_gitignore: Optional[bool] = None,
              follow_bindings: Optional[bool] = None, progress: Optional[Callable[[int, int], None]] = None,
              color: bool = False, output_file: Optional[str] = None) -> Outcome:
    """``guardlint check``. With ``fix`` the fixes are written and what remains is reported; with
    ``diff`` they are printed as a unified diff and nothing is written.

    A named path that does not exist is reported (exit 2 at the end) and every other one is still
    linted; a named path that is not checked (excluded, not Python) is reported as skipped.
    ``output_file`` takes what would go to stdout (the findings, the diff), written atomically and
    never in colour; ``color`` styles the text formats."""
    if fmt not in FORMATS:
        return Outcome(EXIT_USAGE, stderr=f"guardlint: error: --output-format: {fmt!r} is not one of "
                                          f"{', '.join(FORMATS)}\n")
    if fix and diff:
        return Outcome(EXIT_USAGE, stderr="guardlint: error: --fix and --diff cannot be used together "
                                          "(--diff shows the fixes without writing them; --fix writes them)\n")
    from .config import UsageError, load_settings
    from .runner import lint_paths, rules_for, with_options

    paths = list(paths) or ["."]
    try:
        settings = load_settings(paths, config, cwd=cwd)
        settings = with_options(settings, _split(select), _split(ignore), _split(exclude))
        if respect_gitignore is not None:
            settings = dataclasses.replace(settings, respect_gitignore=respect_gitignore)
        if follow_bindings is not None:
            settings = dataclasses.replace(settings, follow_bindings=follow_bindings)
        report = lint_paths(paths, settings, strict=strict, stdin=stdin, stdin_filename=stdin_filename,
                            jobs=jobs, fix="apply" if fix else "diff" if diff else None,
                            unsafe_fixes=unsafe_fixes, progress=progress)
    except (ConfigError, UsageError) as e:
        return Outcome(EXIT_USAGE, stderr=f"guardlint: error: {e}\n")
    notes = "".join(f"guardlint: skipped {path}: {why}\n" for path, why in report.skipped)
    notes += "".join(f"guardlint: error: {path}: no such file or directory\n" for path in report.missing)
    findings = report.findings
    failed = bool(findings) or (diff and report.fixed > 0)
    code = EXIT_FINDINGS if failed and not exit_zero else EXIT_CLEAN
    if report.missing:
        code = EXIT_USAGE
    from . import output

    color = color and not output_file and fmt in _TEXT_FORMATS
    if diff:
        from .fixer import unified_diff

        out = "".join(unified_diff(c.path, c.before, c.after) for c in report.changes if c.changed)
        return _to_file(Outcome(code, out, notes + _diff_summary(report.fixed, findings, unsafe_fixes) + "\n"),
                        output_file)
    if fmt == "json":
        import json

        out = (json.dumps(output.statistics(findings, unsafe_fixes), indent=2) + "\n") if statistics \
            else output.as_json(findings)
    elif fmt == "sarif":
        out = output.sarif(findings, rules_for(settings).contracts)
    elif fmt == "github":
        out = output.github(findings)
    elif statistics:
        out = output.statistics_text(findings, unsafe_fixes)
    elif fmt == "full":
        out = output.full(findings, unsafe_fixes, color, _lines_of(report, paths, stdin, stdin_filename))
    else:
        out = output.text(findings, unsafe_fixes, color)
    if fmt not in _TEXT_FORMATS or report.files == 0:  # nothing checked: "All checks passed" would be a lie
        err = ""
    else:
        err = output.summary(findings, unsafe_fixes, report.fixed) + "\n"
    err = notes + err
    fixed_stdin = [c for c in report.changes if c.stdin] if fix else []
    if fix and "-" in paths:
        # As ruff does: the fixed source goes to stdout, the findings to stderr (or --output-file). The
        # bytes as they are: a latin-1 file stays latin-1 and a BOM stays, whatever stdout's encoding is.
        source = next((c.after for c in fixed_stdin), stdin or b"")
        if output_file:
            return _to_file(Outcome(code, out, err), output_file, keep=source)
        return Outcome(code, source, out + err)
    return _to_file(Outcome(code, out, err), output_file)


def _to_file(outcome: Outcome, output_file: Optional[str], keep: Union[str, bytes] = "") -> Outcome:
    """``outcome`` with its stdout written to ``output_file`` instead (``keep``: what stdout still gets)."""
    if not output_file:
        return outcome
    from . import output

    text = outcome.stdout.decode("utf-8", "replace") if isinstance(outcome.stdout, bytes) else outcome.stdout
    try:
        output.write_atomic(output_file, text)
    except OSError as e:
        return Outcome(EXIT_USAGE, keep, outcome.stderr + f"guardlint: error: --output-file: {output_file}: "
                                                          f"{e.strerror or e}\n")
    return Outcome(outcome.exit_code, keep, outcome.stderr)


def _lines_of(report, paths: Sequence[str], stdin: Optional[bytes], stdin_filename: Optional[str]):
    """The lines of each file a finding is in, for ``full``: as fixed when fixes were applied, the input
    for stdin, else as read now."""
    from . import output
    from .runner import read_source

    current = {c.path: c.after for c in report.changes}
    if "-" in paths:
        current.setdefault(stdin_filename or "-", stdin or b"")
    cache: dict[str, Optional[list[str]]] = {}

    def lines_of(path: str) -> Optional[list[str]]:
        if path not in cache:
            data = current.get(path)
            if data is None:
                try:
                    data = read_source(path)
                except OSError:
                    cache[path] = None
                    return None
            cache[path] = output.source_lines(data)
        return cache[path]

    return lines_of


def _diff_summary(fixed: int, remaining: Sequence, unsafe_fixes: bool) -> str:
    from . import output

    head = f"Would fix {fixed} finding{'s' if fixed != 1 else ''}" if fixed else "No fixes would be applied"
    if remaining:
        head += f" ({len(remaining)} would remain)"
    hint = output.fix_hint(remaining, unsafe_fixes)
    return head + "." + ("\n" + hint if hint and not hint.startswith("[*]") else "")


def _settings_for_catalog(config: Optional[str], cwd: Optional[Path]) -> Settings:
    from .config import load_settings

    return load_settings((), config, cwd=cwd)


def run_explain(code: str, *, config: Optional[str] = None, cwd: Optional[Path] = None) -> Outcome:
    from . import explain as _explain

    try:
        settings = _settings_for_catalog(config, cwd)
    except ConfigError as e:
        return Outcome(EXIT_USAGE, stderr=f"guardlint: error: {e}\n")
    known = (*all_contracts(), *settings.contracts)
    contracts = {c.code: c for c in known}
    # A rule's name works as its code does (``guardlint explain missing-max-seqlen``); a name of the
    # configuration's own contracts picks that contract among those sharing GL001.
    by_name = {c.name.lower(): c for c in reversed(known)}
    contract = by_name.get(code.strip().lower()) or contracts.get(code.strip().upper())
    if contract is None:
        return Outcome(EXIT_USAGE, stderr=f"guardlint: error: unknown rule {code!r}; known codes: "
                                          f"{', '.join(sorted(contracts))} (or a rule's name: guardlint rules)\n")
    return Outcome(EXIT_CLEAN, _explain.explain(contract))


def run_diagnose(data: Union[bytes, str], *, fmt: str = "text",
                 contracts: Optional[Sequence[Contract]] = None) -> Outcome:
    """``guardlint diagnose``: exit 0 with the answer when a rule matches, 1 when none does."""
    from . import diagnose_output
    from .diagnose import diagnose

    result = diagnose(data, contracts)
    out = diagnose_output.as_json(result) if fmt == "json" else diagnose_output.as_text(result)
    return Outcome(EXIT_CLEAN if result.contract is not None else EXIT_FINDINGS, out)


def run_rules(*, fmt: str = "text", config: Optional[str] = None, cwd: Optional[Path] = None) -> Outcome:
    from . import explain as _explain

    try:
        settings = _settings_for_catalog(config, cwd)
    except ConfigError as e:
        return Outcome(EXIT_USAGE, stderr=f"guardlint: error: {e}\n")
    contracts = (*all_contracts(), *settings.contracts)
    text = _explain.rules_json(contracts) if fmt == "json" else _explain.rules_text(contracts)
    return Outcome(EXIT_CLEAN, text)
