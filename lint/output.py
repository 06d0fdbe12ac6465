"""Output formats: text (``path:line:col: CODE message``), full (text with the source line, notes and
fix), JSON, SARIF 2.1.0 and GitHub annotations.

Findings go to stdout (or ``--output-file``) in every format so it stays parseable; the summary goes to
stderr. Colour is for text and full on a terminal only (the caller decides).
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import PurePath
from typing import Callable, Iterable, Optional, Sequence

from guardlint._version import __version__
from guardlint.contracts import Contract, get as builtin_contract

from .findings import Finding

SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"


# ANSI styles as ruff uses them: the path bold, the code red for an error and yellow for a warning.
BOLD, RED, YELLOW, RESET = "\033[1m", "\033[31m", "\033[33m", "\033[0m"
# A warning says so after the code (and after ruff's ``[*]``), so that ``path:line:col: CODE `` stays what
# tools parse; an error, like every ruff finding, carries no word.
WARNING = "warning: "


def _headline(f: Finding, unsafe_fixes: bool, color: bool) -> str:
    fixable = "[*] " if f.fixable(unsafe_fixes) else ""
    warning = WARNING if f.severity == "warning" else ""
    if not color:
        return f"{f.path}:{f.line}:{f.column}: {f.code} {fixable}{warning}{f.message}"
    tint = BOLD + (RED if f.severity == "error" else YELLOW)
    warning = f"{YELLOW}{warning}{RESET}" if warning else ""
    return f"{BOLD}{f.path}{RESET}:{f.line}:{f.column}: {tint}{f.code}{RESET} {fixable}{warning}{f.message}"


def text(findings: Sequence[Finding], unsafe_fixes: bool = False, color: bool = False) -> str:
    """One line a finding; ``[*]`` after the code marks a fix that ``--fix`` applies with these options
    (as ruff does: an unsafe fix is marked only under ``--unsafe-fixes``), then ``warning:`` for a
    warning."""
    return "".join(_headline(f, unsafe_fixes, color) + "\n" for f in findings)


# -- full: the line, the source under it, the notes and the fix -----------------------------------------
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # CPython's line numbering
TAB_WIDTH = 4


def source_lines(data: bytes) -> list[str]:
    """``data``'s lines as a reader sees them: decoded by its PEP 263 cookie or BOM (undecodable bytes
    replaced), split where CPython counts lines."""
    import io
    import tokenize

    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:
        encoding = "utf-8"
    try:
        text_ = data.decode(encoding, errors="replace")
    except LookupError:
        text_ = data.decode("utf-8", errors="replace")
    return _LINE_BREAK.split(text_.removeprefix("\ufeff"))


def _snippet(f: Finding, line: str, color: bool) -> tuple[str, str]:
    """The source line (tabs expanded) and the underline of ``column..end_column`` under it; a span over
    several lines is underlined to the end of its first."""
    shown = line.expandtabs(TAB_WIDTH)
    start = min(max(f.column - 1, 0), len(line))
    if f.end_line == f.line and f.end_column > f.column:
        end = min(f.end_column - 1, len(line))
    elif f.end_line > f.line:
        end = len(line.rstrip())
    else:  # a point (a file's problem has no span)
        end = start + 1
    offset = len(line[:start].expandtabs(TAB_WIDTH))
    width = max(len(line[:max(end, start)].expandtabs(TAB_WIDTH)) - offset, 1)
    carets = "^" * width + f" {f.code}"
    if color:
        carets = BOLD + (RED if f.severity == "error" else YELLOW) + carets + RESET
    return shown.rstrip(), " " * offset + carets


def full(findings: Sequence[Finding], unsafe_fixes: bool = False, color: bool = False,
         lines_of: Optional[Callable[[str], Optional[list[str]]]] = None) -> str:
    """ruff's ``full`` format: each finding's line, then its source line under a gutter with the span
    underlined, its note (``= note:``, a line each) and its fix (``= help:``); a blank line after each.
    ``lines_of(path)``: the file's lines as ``source_lines`` gives them, None when unreadable."""
    out = []
    for f in findings:
        out.append(_headline(f, unsafe_fixes, color))
        lines = lines_of(f.path) if lines_of is not None else None
        pad = " " * (len(str(f.line)) + 1)
        if lines is not None and 0 < f.line <= len(lines):
            source, underline = _snippet(f, lines[f.line - 1], color)
            out += [f"{pad}|", f"{f.line} | {source}".rstrip(), f"{pad}| {underline}", f"{pad}|"]
        out += [f"{pad}= note: {note}" for note in f.note.splitlines() if note]
        if f.fix is not None:
            hidden = "" if f.fixable(unsafe_fixes) else " (an unsafe fix: --unsafe-fixes applies it)"
            out.append(f"{pad}= help: {f.fix.message}{hidden}")
        out.append("")
    return "".join(line + "\n" for line in out)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def fix_hint(findings: Sequence[Finding], unsafe_fixes: bool) -> str:
    """ruff's second summary line: how many findings ``--fix`` would fix, and how many fixes only
    ``--unsafe-fixes`` enables; empty when there are none."""
    now = sum(1 for f in findings if f.fixable(unsafe_fixes))
    hidden = 0 if unsafe_fixes else sum(1 for f in findings if f.fix is not None and not f.fixable(False))
    hidden_text = f"{hidden} hidden fix{'es' if hidden != 1 else ''} can be enabled with the `--unsafe-fixes` option"
    if now:
        return f"[*] {now} fixable with the `--fix` option" + (f" ({hidden_text})" if hidden else "") + "."
    if hidden:
        return f"No fixes available ({hidden_text})."
    return ""


def summary(findings: Sequence[Finding], unsafe_fixes: bool = False, fixed: int = 0) -> str:
    """The stderr summary: ``Found N findings.`` (after fixes: ``(F fixed, R remaining)``), then the
    fix hint."""
    if fixed:
        head = f"Found {_plural(len(findings) + fixed, 'finding')} ({fixed} fixed, {len(findings)} remaining)."
    else:
        head = f"Found {_plural(len(findings), 'finding')}." if findings else "All checks passed."
    hint = fix_hint(findings, unsafe_fixes)
    return head + ("\n" + hint if hint else "")


def as_json(findings: Sequence[Finding]) -> str:
    """``json.dumps`` of the findings' dicts with ``indent=2``, one finding at a time: for 56k findings
    the list of dicts and the encoder's pieces of the whole took 300 MB."""
    import json
    from json.encoder import encode_basestring_ascii

    if not findings:
        return "[]\n"
    items = []
    for f in findings:
        d = f.to_dict()
        try:
            items.append(_indented(d, "\n  ", encode_basestring_ascii))
        except _NotPlain:
            # A JSON text holds no line break but those of the indentation: one level more for an item.
            items.append(json.dumps(d, indent=2).replace("\n", "\n  "))
    return "[\n  " + ",\n  ".join(items) + "\n]\n"


class _NotPlain(Exception):
    pass


def _indented(value, newline: str, encode_basestring_ascii) -> str:
    """``json.dumps(value, indent=2)`` for dicts, lists, strings, ints and None (the rest raises
    ``_NotPlain``); ``newline``: a line break and the indentation of ``value``'s own level. The C string
    encoder (``json.encoder.encode_basestring_ascii``) does the escaping; ``json.dumps`` with an indent runs
    its pure-Python encoder."""
    t = type(value)
    if t is str:
        return encode_basestring_ascii(value)
    if t is int:
        return int.__repr__(value)
    if value is None:
        return "null"
    inner = newline + "  "
    if t is dict:
        if not value:
            return "{}"
        parts = []
        for key, item in value.items():
            if type(key) is not str:
                raise _NotPlain
            parts.append(encode_basestring_ascii(key) + ": " + _indented(item, inner, encode_basestring_ascii))
        return "{" + inner + ("," + inner).join(parts) + newline + "}"
    if t is list:
        if not value:
            return "[]"
        return "[" + inner + ("," + inner).join([_indented(item, inner, encode_basestring_ascii)
                                                 for item in value]) + newline + "]"
    raise _NotPlain


def statistics(findings: Sequence[Finding], unsafe_fixes: bool = False) -> list[dict]:
    """Counts per code, most frequent first; ``fixable``: how many ``--fix`` fixes with these options,
    ``unsafe_fixes``: how many have an unsafe fix."""
    counts = Counter(f.code for f in findings)
    names = {f.code: f.name for f in findings}
    fixable = Counter(f.code for f in findings if f.fixable(unsafe_fixes))
    unsafe = Counter(f.code for f in findings if f.fix is not None and f.fix.applicability == "unsafe")
    # A code's findings are warnings unless one of them is an error (a call that cannot be checked is a
    # warning of an error rule, with --strict).
    errors = {f.code for f in findings if f.severity == "error"}
    return [{"code": code, "name": names[code], "count": n, "fixable": fixable[code], "unsafe_fixes": unsafe[code],
             "severity": "error" if code in errors else "warning"}
            for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def statistics_text(findings: Sequence[Finding], unsafe_fixes: bool = False) -> str:
    """``count<TAB>code<TAB>name``; when some code is fixable with these options, the name column
    starts with ``[*]`` (fixable) or ``[ ]`` (not), as in ruff."""
    rows = statistics(findings, unsafe_fixes)
    if not rows:
        return ""
    width = max(len(str(r["count"])) for r in rows)
    marks = any(r["fixable"] for r in rows)

    def mark(r) -> str:
        return ("[*] " if r["fixable"] else "[ ] ") if marks else ""

    return "".join(f"{r['count']:>{width}}\t{r['code']}\t{mark(r)}{r['name']}\n" for r in rows)


# -- GitHub workflow commands -----------------------------------------------------------------------
def _gh_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_property(s: str) -> str:
    return _gh_data(s).replace(":", "%3A").replace(",", "%2C")


def github(findings: Sequence[Finding]) -> str:
    out = []
    for f in findings:
        level = "error" if f.severity == "error" else "warning"
        props = [f"file={_gh_property(f.path)}", f"line={f.line}", f"col={f.column}"]
        if f.end_line:
            props += [f"endLine={f.end_line}", f"endColumn={f.end_column}"]
        props.append(f"title={_gh_property(f.code)}")
        out.append(f"::{level} {','.join(props)}::{_gh_data(f.message)}\n")
    return "".join(out)


# -- SARIF 2.1.0 ----------------------------------------------------------------------------------------
def _rule(c: Contract) -> dict:
    d = c.diagnosis
    help_text = "Solutions:\n" + "\n".join(f"- {s}" for s in d.solutions) if d.solutions else d.message
    rule = {
        "id": c.code,
        "name": c.name,
        "shortDescription": {"text": c.summary},
        "fullDescription": {"text": f"{d.what_it_means} {d.when_it_happens}".strip()},
        "help": {"text": help_text, "markdown": help_text},
        "defaultConfiguration": {"level": "error" if c.severity == "error" else "warning"},
        "properties": {"kind": c.kind, "fixSafety": c.fix_safety},
    }
    uri = None if c.user_defined else help_uri(c.code, c.name)
    if uri is not None:
        rule["helpUri"] = uri
    return rule


def help_uri(code: str, name: str = "") -> Optional[str]:
    """The page of a built-in rule in the docs (SARIF's ``helpUri``, an editor's link on the code); None
    for a contract of the user's configuration (a GL001 of another name, or a code of its own)."""
    try:
        c = builtin_contract(code)
    except KeyError:
        return None
    if name and name != c.name:
        return None
    from .explain import rule_url

    return rule_url(c)


def _uri(path: str) -> str:
    p = PurePath(path)
    if p.is_absolute():
        from pathlib import Path

        return Path(path).as_uri()
    return p.as_posix()


def sarif(findings: Sequence[Finding], contracts: Iterable[Contract]) -> str:
    rules: dict[str, Contract] = {"GL000": builtin_contract("GL000")}
    for c in contracts:
        rules.setdefault(c.code, c)
    for f in findings:  # a finding always has its rule
        if f.code not in rules:
            rules[f.code] = builtin_contract(f.code)
    ordered = sorted(rules.values(), key=lambda c: c.code)
    index = {c.code: i for i, c in enumerate(ordered)}
    results = []
    for f in findings:
        region = {"startLine": f.line, "startColumn": f.column}
        if f.end_line:
            region.update(endLine=f.end_line, endColumn=max(f.end_column, 1))
        result = {
            "ruleId": f.code,
            "ruleIndex": index[f.code],
            "level": "error" if f.severity == "error" else "warning",
            "message": {"text": f.message},
            "locations": [{"physicalLocation": {
                "artifactLocation": {"uri": _uri(f.path)},
                "region": region,
            }}],
        }
        if f.note:
            result["properties"] = {"note": f.note}
        results.append(result)
    log = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "guardlint",
                "version": __version__,
                "semanticVersion": __version__,
                "rules": [_rule(c) for c in ordered],
            }},
            "columnKind": "unicodeCodePoints",
            "results": results,
        }],
    }
    import json

    return json.dumps(log, indent=2) + "\n"


# -- --output-file --------------------------------------------------------------------------------------
def write_atomic(path: str, data: str) -> None:
    """Write ``data`` to ``path`` in one step (a temporary file beside it, then ``os.replace``): a reader,
    such as a CI step that uploads the report, never sees half of it. A new file gets the mode the umask
    gives; an existing one keeps its own."""
    import os
    import stat
    import tempfile

    target = os.path.realpath(path)
    folder = os.path.dirname(target) or "."
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".guardlint-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
