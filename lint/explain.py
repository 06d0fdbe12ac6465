"""``guardlint explain CODE`` and ``guardlint rules``: a rule's page in ruff's layout, from the catalog.

The catalog's diagnosis follows the engines' error pages (what it means, when it happens, solutions,
example fix); a page maps it onto ruff's sections: What it does, Why is this bad?, Example / Use instead,
Fix safety, Options and References. ``docs/rules.md`` is every page in one file (``rules_markdown``).
"""
from __future__ import annotations

import json
import re
import textwrap
from typing import Sequence

from guardlint._version import __version__
from guardlint.contracts import Contract
from guardlint.contracts.model import Target

# A derivation's template names the call's own arguments as ``{name}``: on the page, the names alone.
_PLACEHOLDER = re.compile(r"\{(\w+)\}")
# A summary that is a clause ("X is read back ..."), not a thing: "Checks for cases where ...".
_VERB = re.compile(r" (?:is|are|was|were|would) ")
_PROJECTS = {"vllm": "vLLM"}
# The project's repository (pyproject.toml's [project.urls]); the rules page of this release there is SARIF's
# helpUri of a rule, with the rule's anchor.
REPOSITORY = "https://github.com/guardlint/guardlint"
DOCS_URL = f"{REPOSITORY}/blob/v{__version__}/docs/rules.md"


def _wrap(text: str, width: int = 100) -> str:
    indent = "  " if text.startswith("- ") else ""
    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent)) if text else ""


def _code_block(code: str) -> str:
    return "```python\n" + code.rstrip("\n") + "\n```"


def _name(m: re.Match) -> str:
    return m.group(1)


def _checks_for(c: Contract) -> str:
    """The summary as ruff's first sentence: "Checks for <a thing>" or "Checks for cases where <a clause>"."""
    summary = c.summary.rstrip(".")
    if c.user_defined:
        return f"Checks for calls that do not meet a contract of your configuration: {summary}."
    first = summary.split(" ", 1)[0]
    # "A", "Varlen", "Metadata" start a sentence; "LoRABatchInfo", "ViT" are names.
    if first[:1].isupper() and (len(first) == 1 or first[1:].islower()):
        summary = summary[0].lower() + summary[1:]
    head = summary.split(":", 1)[0]
    where = "cases where " if _VERB.search(f" {head} ") else ""
    when = "" if c.linted else ", at runtime,"
    return f"Checks{when} for {where}{summary}."


def _target(t: Target) -> str:
    package = t.qualname.split(".", 1)[0]
    name = f"{_PROJECTS.get(package, package)}'s `{t.short_name}`"
    if t.qualname.endswith("[]"):
        return f"instances of the backends in {name} (a backend picked by configuration)"
    if t.kind == "instance":
        return f"{name} instances (called directly or through `.forward`)"
    if t.kind == "class":
        return f"{name} (constructed)"
    return name


def _requirement(c: Contract) -> str:
    groups = [" and ".join(f"`{n}`" for n in g) for g in c.require]
    each = ", each" if any(len(g) > 1 for g in c.require) else ""
    return f"A call is fine when it passes {' or '.join(groups)}{each} with a value other than `None`."


def _fix_availability(c: Contract) -> str:
    if c.fix_safety == "safe":
        return "Fix is sometimes available."
    if c.fix_safety == "unsafe":
        return "Fix is sometimes available (an unsafe fix: applied with `--unsafe-fixes`)."
    return "Fix is not available."


def explain(c: Contract) -> str:
    d = c.diagnosis
    out = [f"# {c.name} ({c.code})", "", _fix_availability(c), ""]
    if not c.linted:
        out += ["Raised at runtime by the guard and kernels; the linter does not report it.", ""]
    out += ["## What it does", _wrap(_checks_for(c)), ""]
    if c.targets:
        out += ["It applies to calls of:", *[_wrap(f"- {_target(t)}") for t in c.targets], ""]
    if c.require:
        out += [_wrap(_requirement(c)), ""]
    if c.linted and c.kind != "file" and not c.user_defined:
        # The finding's line names the call and what it lacks; the problem in the kernel's words is here
        # (and in the finding's note).
        out += [_wrap(f"The problem in one line: \"{d.message}\""), ""]
    else:
        out += [_wrap(f"{'Reported' if c.linted else 'Raised'} as: \"{d.message}\""), ""]
    out += [_wrap(note) + "\n" for note in c.notes]
    out += ["## Why is this bad?", _wrap(d.what_it_means), "", _wrap(d.when_it_happens), ""]
    if d.solutions:
        out += ["To fix it:", *[_wrap(f"- {s}") for s in d.solutions], ""]
    bad = c.examples_of("bad")
    if bad:
        out += ["## Example", _code_block(bad[0].without_markers()), ""]
    use = c.examples_of("fixed") or c.examples_of("good")
    if use:
        out += ["Use instead:" if bad else "## Example", _code_block(use[0].code), ""]
    out += ["## Fix safety", _wrap(d.fix_safety or "No automatic fix."), ""]
    if c.derivations:
        out += ["How a missing value is derived (the fix writes it; the guard computes it at runtime):"]
        out += [_wrap(f"- `{dv.target} = {_PLACEHOLDER.sub(_name, dv.template)}`" + (f": {dv.note}" if dv.note else ""))
                for dv in c.derivations]
        out += [""]
    if c.linted and c.code != "GL000":
        out += ["## Options",
                _wrap(f"- `select`, `ignore` and `per-file-ignores` in `[tool.guardlint]` of `pyproject.toml` "
                      f"(or `--select` / `--ignore`) turn {c.code} (or by name, `{c.name}`) on and off."),
                _wrap(f"- `# guardlint: ignore[{c.code}]` or `# noqa: {c.code}` on a finding's line "
                      "suppresses it.")]
        if c.kind in ("call", "positional"):
            out += [_wrap("- `--strict` also reports the calls that cannot be checked because they pass "
                          "`*args` or `**kwargs`.")]
        out += [""]
    if c.targets:
        out += ["## References", *[f"- `{t.qualname.removesuffix('[]')}`" for t in c.targets], ""]
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


# -- docs/rules.md ------------------------------------------------------------------------------------
def anchor(c: Contract) -> str:
    """The rule's anchor on the rules page: GitHub's slug of its heading ``GL101 missing-sequence-lengths``."""
    return f"{c.code}-{c.name}".lower()


def rule_url(c: Contract) -> str:
    return f"{DOCS_URL}#{anchor(c)}"


def _section(c: Contract) -> str:
    """``explain``'s page one heading level down, under a heading that gives the anchor."""
    lines = explain(c).splitlines()
    out = [f"## {c.code} {c.name}"]
    fenced = False
    for line in lines[1:]:
        if line.startswith("```"):
            fenced = not fenced
        out.append("#" + line if line.startswith("#") and not fenced else line)
    return "\n".join(out).rstrip() + "\n"


def rules_markdown(contracts: Sequence[Contract] = ()) -> str:
    """``docs/rules.md``: an index, then each rule's ``guardlint explain`` page (the built-in catalog when
    ``contracts`` is empty). A test keeps the committed file equal to this."""
    from guardlint.contracts import all_contracts

    contracts = tuple(contracts) or all_contracts()
    out = ["# guardlint rules", "",
           "<!-- generated by python -m guardlint.lint.explain > docs/rules.md; do not edit -->", "",
           "`guardlint explain CODE` (or the rule's name) prints one of these pages.", "",
           "| code | name | summary |", "|---|---|---|"]
    out += [f"| [{c.code}](#{anchor(c)}) | `{c.name}` | {c.summary.replace('|', chr(92) + '|')} |" for c in contracts]
    return "\n".join(out) + "\n\n" + "\n".join(_section(c) for c in contracts)


if __name__ == "__main__":
    print(rules_markdown(), end="")
