"""``guardlint explain CODE`` and ``guardlint rules``: the catalog's diagnosis text in ruff's sections.

The engine's error pages say What it means / When it happens / Solutions / Example fix; ruff's rule
pages say What it does / Why is this bad? / Example / Use instead / Fix safety. Both are kept here.
"""
from __future__ import annotations

import json
import textwrap
from typing import Sequence

from guardlint.contracts import Contract


def _wrap(text: str, width: int = 100) -> str:
    indent = "  " if text.startswith("- ") else ""
    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent)) if text else ""


def _code_block(code: str) -> str:
    return "```python\n" + code.rstrip("\n") + "\n```"


def explain(c: Contract) -> str:
    d = c.diagnosis
    out = [f"# {c.code} {c.name}", "",
           f"Kind: {c.kind}. Severity: {c.severity}." + ("" if c.linted else " Raised at runtime by the guard "
                                                         "and kernels; the linter does not report it."), ""]
    if c.targets:
        out += ["Applies to: " + ", ".join(f"{t.qualname} ({t.kind})" for t in c.targets), ""]
    out += ["## What it does", _wrap(f"{c.summary}. Message: \"{d.message}\""), "",
            "## Why is this bad?", _wrap(d.what_it_means), "", _wrap(d.when_it_happens), ""]
    if c.require:
        out += ["Requires, each passed and not None: " + c.requirement_text(), ""]
    if d.solutions:
        out += ["## Solutions", *[_wrap(f"- {s}") for s in d.solutions], ""]
    if c.derivations:
        out += ["## Derivations"]
        out += [_wrap(f"- {dv.target} = {dv.template}" + (f" ({dv.note})" if dv.note else "")) for dv in c.derivations]
        out += [""]
    bad = c.examples_of("bad")
    if bad:
        out += ["## Example", _code_block(bad[0].without_markers()), ""]
    use = c.examples_of("fixed") or c.examples_of("good")
    if use:
        out += ["## Use instead", _code_block(use[0].code), ""]
    for note in c.notes:
        out += [_wrap(f"Note: {note}"), ""]
    out += ["## Fix safety", _wrap(d.fix_safety or "No automatic fix.")]
    return "\n".join(out).rstrip() + "\n"


def rules_rows(contracts: Sequence[Contract]) -> list[dict]:
    return [{"code": c.code, "name": c.name, "kind": c.kind, "severity": c.severity, "linted": c.linted,
             "summary": c.summary, "targets": [t.qualname for t in c.targets],
             "user_defined": c.user_defined} for c in contracts]


def rules_text(contracts: Sequence[Contract]) -> str:
    rows = rules_rows(contracts)
    wc = max(len(r["code"]) for r in rows)
    wn = max(len(r["name"]) for r in rows)
    wk = max(len(r["kind"]) for r in rows)
    return "".join(f"{r['code']:<{wc}}  {r['name']:<{wn}}  {r['kind']:<{wk}}  {r['summary']}\n" for r in rows)


def rules_json(contracts: Sequence[Contract]) -> str:
    return json.dumps(rules_rows(contracts), indent=2) + "\n"
