"""What each CLI command does, as plain functions returning exit code and output text.

``cli.py`` only parses arguments and prints; tests call these directly too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from guardlint.contracts import ConfigError, all_contracts

from . import explain as _explain, output
from .config import Settings, UsageError, load_settings
from .runner import lint_paths, rules_for, with_options

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    stdout: str = ""
    stderr: str = ""


def _split(values: Sequence[str]) -> list[str]:
    """``("GL1,GL2", "GL3")`` -> ``["GL1", "GL2", "GL3"]``: options repeat and take comma lists."""
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def run_check(paths: Sequence[str], *, select: Sequence[str] = (), ignore: Sequence[str] = (),
              exclude: Sequence[str] = (), fmt: str = "text", statistics: bool = False,
              exit_zero: bool = False, strict: bool = False, config: Optional[str] = None,
              stdin: Optional[bytes] = None, stdin_filename: Optional[str] = None,
              cwd: Optional[Path] = None, jobs: Optional[int] = None) -> Outcome:
    paths = list(paths) or ["."]
    try:
        settings = load_settings(paths, config, cwd=cwd)
        settings = with_options(settings, _split(select), _split(ignore), _split(exclude))
        report = lint_paths(paths, settings, strict=strict, stdin=stdin, stdin_filename=stdin_filename,
                            jobs=jobs)
    except (ConfigError, UsageError) as e:
        return Outcome(EXIT_USAGE, stderr=f"guardlint: error: {e}\n")
    findings = report.findings
    code = EXIT_FINDINGS if findings and not exit_zero else EXIT_CLEAN
    if fmt == "json":
        out = (json.dumps(output.statistics(findings), indent=2) + "\n") if statistics \
            else output.as_json(findings)
    elif fmt == "sarif":
        out = output.sarif(findings, rules_for(settings).contracts)
    elif fmt == "github":
        out = output.github(findings)
    elif statistics:
        out = output.statistics_text(findings)
    else:
        out = output.text(findings)
    err = output.summary(findings) + "\n" if fmt == "text" else ""
    return Outcome(code, out, err)


def _settings_for_catalog(config: Optional[str], cwd: Optional[Path]) -> Settings:
    return load_settings((), config, cwd=cwd)


def run_explain(code: str, *, config: Optional[str] = None, cwd: Optional[Path] = None) -> Outcome:
    try:
        settings = _settings_for_catalog(config, cwd)
    except ConfigError as e:
        return Outcome(EXIT_USAGE, stderr=f"guardlint: error: {e}\n")
    contracts = {c.code: c for c in (*all_contracts(), *settings.contracts)}
    contract = contracts.get(code.strip().upper())
    if contract is None:
        return Outcome(EXIT_USAGE, stderr=f"guardlint: error: unknown rule code {code!r}; known codes: "
                                          f"{', '.join(sorted(contracts))}\n")
    return Outcome(EXIT_CLEAN, _explain.explain(contract))


def run_rules(*, fmt: str = "text", config: Optional[str] = None, cwd: Optional[Path] = None) -> Outcome:
    try:
        settings = _settings_for_catalog(config, cwd)
    except ConfigError as e:
        return Outcome(EXIT_USAGE, stderr=f"guardlint: error: {e}\n")
    contracts = (*all_contracts(), *settings.contracts)
    text = _explain.rules_json(contracts) if fmt == "json" else _explain.rules_text(contracts)
    return Outcome(EXIT_CLEAN, text)
