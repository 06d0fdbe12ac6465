"""How ``guardlint diagnose`` shows its answer: text in the sections of the engine errors' pages (what it
means, when it happens, solutions, example fix) or JSON with the same content: the solutions of the engine
the error came from, the example pair chosen by the modules the traceback runs through, no text twice.
"""
from __future__ import annotations

import json
import re
import textwrap
from typing import Optional, Sequence

from guardlint.contracts import Contract, all_contracts
from guardlint.contracts.model import Example

from .diagnose import DiagnoseResult, run_command
from .frames import ENGINES

_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", re.M)


def _imports(code: str) -> set:
    return {a or b for a, b in _IMPORT.findall(code)}


def _tops(example: Example) -> set:
    return {m.split(".")[0] for m in _imports(example.code)}


def _example(contract: Contract, files: Sequence[str] = (), engine: Optional[str] = None,
             own: bool = False) -> Optional[dict]:
    """A bad example and its fix. Where the contract has several, the bad one whose imports the traceback
    runs through (the engine's module or guardlint's kernels), and the fixed or good one closest to it.
    For a known engine, never another engine's; where the answer gives that engine's own solutions
    (``own``), only the engine's examples or none: guardlint's or another API's fix is no fix there."""
    bad = contract.examples_of("bad")
    after = contract.examples_of("fixed") + contract.examples_of("good")
    if engine:
        others = set(ENGINES) - {engine}

        def keep(example: Example) -> bool:
            tops = _tops(example)
            return not tops & others and (not own or engine in tops)

        bad, after = tuple(filter(keep, bad)), tuple(filter(keep, after))
        if own and not bad:
            return None
    if not bad and not after:
        return None

    def seen(example) -> int:
        tops = _tops(example) - {"torch"}
        return sum(1 for top in tops if any(re.search(rf"\b{re.escape(top)}\b", f) for f in files))

    chosen = max(bad, key=seen) if bad else None  # max keeps the first of equals: catalog order
    fixed: Optional[Example]
    if chosen is not None and after:
        near = _imports(chosen.code)
        fixed = max(after, key=lambda e: (len(near & _imports(e.code)), e.kind == "fixed"))
    else:
        fixed = after[0] if after else None
    return {"bad": chosen.without_markers() if chosen else None, "fixed": fixed.code if fixed else None}


def as_dict(result: DiagnoseResult) -> dict:
    c = result.contract
    out = {
        "code": result.code,
        "name": c.name if c else None,
        "summary": result.summary,
        "kind": c.kind if c else None,
        "message": result.message,
        "exception": result.exception_type,
        "evidence": result.evidence,
        "frame": result.frame.as_dict() if result.frame else None,
        "fix": result.fix,
        "solutions": list(result.solutions),
        "command": result.command,
        "prevent": result.prevention,
        "matches": list(result.matches),
        "related": list(result.related),
        "engine": result.engine,
        "raised_at": result.raised_at.as_dict() if result.raised_at else None,
        "possible": result.confirm is not None,
        "confirm": result.confirm,
        "also": [{"code": code, "name": _name(code)[len(code) + 2:-1] or None, "message": message, "fix": fix}
                 for code, message, fix in result.also],
    }
    if c is not None:
        d = c.diagnosis
        # The solutions shown, as in the text: for a known engine, its own only.
        out["diagnosis"] = {"message": d.message, "what_it_means": d.what_it_means,
                            "when_it_happens": d.when_it_happens, "solutions": list(result.solutions),
                            "fix_safety": d.fix_safety}
        out["example"] = _example(c, result.files, result.engine, result.engine_name is not None)
        out["explain"] = f"guardlint explain {c.code}"
    return out


def as_json(result: DiagnoseResult) -> str:
    return json.dumps(as_dict(result), indent=2) + "\n"


def _wrap(text: str, indent: str = "  ") -> list:
    bullet = text.startswith("- ")
    return textwrap.wrap(text[2:] if bullet else text, 100, initial_indent=indent + ("- " if bullet else ""),
                         subsequent_indent=indent + ("  " if bullet else "")) or [indent.rstrip()]


def _code_block(code: str, title: str) -> list:
    return [f"  {title}:", "  ```python", *(("  " + line).rstrip() for line in code.rstrip("\n").split("\n")),
            "  ```"]


def _name(code: str) -> str:
    return next((f"{code} ({c.name})" for c in all_contracts() if c.code == code), code)


def as_text(result: DiagnoseResult) -> str:
    if result.contract is None:
        out = ["No guardlint rule matches this error." if result.message or result.related
               else "No guardlint rule matches this input: it holds no error message guardlint knows."]
        if result.message:
            out.append(f"  error: {result.message}")
        if result.frame:
            out.append(f"  where: {result.frame.location()}")
        if result.related:
            out += ["", f"The code it quotes from your frames matches {', '.join(map(_name, result.related))}:",
                    f"  {result.lint_command or 'guardlint explain ' + result.related[0]}"]
        out += ["", "`guardlint rules` lists the errors guardlint knows; `guardlint explain CODE` shows one."]
        return "\n".join(out) + "\n"
    c, d = result.contract, result.contract.diagnosis
    out = [f"{c.code} {c.name}: {result.summary}"]
    if result.message:
        out.append(f"  error: {result.message}")
    if result.frame:
        out.append(f"  where: {result.frame.location()}")
        if result.frame.source:
            out.append(f"         {result.frame.source}")
    else:
        out.append("  where: no frame of your own code in the input")
    if result.raised_at:
        out.append(f"  raised: {result.raised_at.location()}")
        if result.raised_at.source:
            out.append(f"          {result.raised_at.source}")
    if result.confirm:
        out += ["", f"Possibly {c.code}: confirm it", *_wrap(result.confirm)]
    out += ["", "What it means", *_wrap(d.what_it_means), "", "When it happens", *_wrap(d.when_it_happens)]
    solutions = result.solutions
    if result.guard_fix and result.guard_fix not in solutions:
        out += ["", "Fix (from the error)", *_wrap(result.guard_fix)]
    if solutions:
        title = f"Solutions ({result.engine_name})" if result.engine_name else "Solutions"
        out += ["", title, *[line for s in solutions for line in _wrap(f"- {s}")]]
    example = _example(c, result.files, result.engine, result.engine_name is not None)
    if example:
        out += ["", "Example fix"]
        if example["bad"]:
            out += _code_block(example["bad"], "before")
        if example["fixed"]:
            out += _code_block(example["fixed"], "after")
    if not c.linted:
        out += ["", "Prevent it", *_wrap(f"{c.code} is raised at runtime only, so no static check finds it; "
                                         "the solutions above prevent it.")]
        command = run_command(c, result.program)
        if command:
            out.append(f"  {command}")
    if result.lint_command:
        out += ["", "Find the same pattern elsewhere", f"  {result.lint_command}"]
    if result.related:
        out += ["", f"The code of your frames matches {', '.join(map(_name, result.related))}."]
    if result.also:
        out += ["", "Also in the input"]
        shown = {*solutions, result.guard_fix}
        for code, message, fix in result.also:
            out += _wrap(f"- {_name(code)}: {message}")
            if fix:
                # Two errors of one engine often share its fix: it is printed once.
                out += _wrap("fix: as above" if fix in shown else f"fix: {fix}", "    ")
                shown.add(fix)
    quoted = {code for code, _, _ in result.also}
    others = [code for code in result.matches
              if code != c.code and code not in result.related and code not in quoted]
    if others:
        out += ["", f"Also matched: {', '.join(map(_name, others))}."]
    out += ["", f"More: guardlint explain {c.code}"]
    return "\n".join(out) + "\n"
