"""Output formats: text (``path:line:col: CODE message``), JSON, SARIF 2.1.0 and GitHub annotations.

Findings go to stdout in every format so it stays parseable; the summary line goes to stderr.
"""
from __future__ import annotations

from collections import Counter
from pathlib import PurePath
from typing import Iterable, Sequence

from guardlint._version import __version__
from guardlint.contracts import Contract, get as builtin_contract

from .findings import Finding

SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"


def text(findings: Sequence[Finding], unsafe_fixes: bool = False) -> str:
    """One line a finding; ``[*]`` after the code marks a fix that ``--fix`` applies with these options
    (as ruff does: an unsafe fix is marked only under ``--unsafe-fixes``)."""
    return "".join(f"{f.path}:{f.line}:{f.column}: {f.code} {'[*] ' if f.fixable(unsafe_fixes) else ''}"
                   f"{f.message}\n" for f in findings)


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
    return [{"code": code, "name": names[code], "count": n, "fixable": fixable[code], "unsafe_fixes": unsafe[code]}
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
    return {
        "id": c.code,
        "name": c.name,
        "shortDescription": {"text": c.summary},
        "fullDescription": {"text": f"{d.what_it_means} {d.when_it_happens}".strip()},
        "help": {"text": help_text, "markdown": help_text},
        "defaultConfiguration": {"level": "error" if c.severity == "error" else "warning"},
        "properties": {"kind": c.kind, "fixSafety": c.fix_safety},
    }


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
        results.append({
            "ruleId": f.code,
            "ruleIndex": index[f.code],
            "level": "error" if f.severity == "error" else "warning",
            "message": {"text": f.message},
            "locations": [{"physicalLocation": {
                "artifactLocation": {"uri": _uri(f.path)},
                "region": region,
            }}],
        })
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
