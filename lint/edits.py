"""From a finding's fix plan (``fixes.py``, on libcst nodes) to text edits of its file: the smallest
edit of the call's source, and the import lines the fix needs, placed where they run before the call.
``fixer.py`` applies the edits.
"""
from __future__ import annotations

import ast
import bisect
from typing import TYPE_CHECKING, Optional

import libcst as cst

from . import fixes
from .findings import Edit, Fix
from .names import Resolver, Scope
from .positions import LINE_BREAK

if TYPE_CHECKING:
    from .checker import RawFinding


class EditBuilder:
    """Turns a finding's fix plan (``fixes.py``, on libcst nodes) into text edits of this file."""

    def __init__(self, module: cst.Module, tree: Optional[ast.Module], data: bytes, resolver: Resolver):
        self.module = module
        self.tree = tree
        self.data = data
        self.resolver = resolver
        self._text: Optional[str] = None
        self._starts: list[int] = []
        self._import_line: Optional[int] = None
        self._stmt_lines: tuple[list[int], list[int]] = ([], [])

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self.data.decode(self.module.encoding)
            # Line starts by CPython's line numbering (``LINE_BREAK``).
            self._starts = [0, *(m.end() for m in LINE_BREAK.finditer(self._text))]
        return self._text

    def offset(self, line: int, column: int) -> Optional[int]:
        text = self.text
        if not 0 < line <= len(self._starts):
            return None
        return min(self._starts[line - 1] + column - 1, len(text))

    def fix(self, r: RawFinding, call_range) -> tuple[Optional[Fix], str]:
        """(fix, "") or (None, why there is none; "" when the contract has no automatic fix)."""
        if r.how is None or r.contract.fix_safety == "none":
            return None, ""

        def can_import(module: str, name: str) -> Optional[str]:
            b = self.resolver.lookup(r.scope, name, r.seq) if r.scope is not None else None
            if b is None:
                return None
            if b.kind == "import" and b.value == f"{module}.{name}":
                return ""
            return f"{name} already names something else here, so {module}.{name} cannot be imported"

        def in_scope(name: str) -> bool:
            """A value of this name bound in the call's own function before it (not an import)."""
            if r.scope is None:
                return False
            fn = r.scope.function_scope()
            binds = [b for b in fn.bindings.get(name, []) if b.seq < r.seq]
            return fn.kind == "function" and bool(binds) and all(b.kind in ("local", "call") for b in binds)

        if r.how == "call":
            plan = fixes.plan_call(r.contract, r.node, r.bound.values, can_import, r.qual, in_scope,
                                   r.per_layer)
        elif r.how == "replace":
            plan = fixes.plan_replace(r.contract, r.node, can_import)
        else:
            plan = fixes.plan_positional(r.contract, r.node, r.label, r.qual)
        if plan is None:
            return None, ""
        if isinstance(plan, fixes.NoFix):
            return None, plan.reason
        if self.tree is None:
            return None, "this Python does not parse the file, so a fixed file could not be checked"
        edit = self._call_edit(r.node, plan.new_call, call_range, r.indent)
        if edit is None:
            return None, "the call's source could not be located exactly"
        edits = [edit]
        if plan.imports:
            edits.append(self._import_edit(plan.imports, call_range[0], _runs_at_import(r.scope)))
        message = plan.message
        if plan.imports:
            message += "; import " + ", ".join(f"{m}.{n}" for m, n in plan.imports)
        return Fix(r.contract.fix_safety, message, tuple(sorted(edits)), plan.imports), ""

    def _call_edit(self, old: cst.Call, new: cst.Call, call_range, indent: str) -> Optional[Edit]:
        """The smallest edit that turns the call's text into the new call's (parentheses around the
        call are not part of its range). The old call's rendering must equal its source exactly."""
        before = self._render(old.with_changes(lpar=(), rpar=()), indent)
        after = self._render(new.with_changes(lpar=(), rpar=()), indent)
        if before is None or after is None:
            return None
        line, col, end_line, end_col = call_range
        start_at, end_at = self.offset(line, col), self.offset(end_line, end_col)
        if start_at is None or end_at is None or self.text[start_at:end_at] != before:
            return None
        start = 0
        limit = min(len(before), len(after))
        while start < limit and before[start] == after[start]:
            start += 1
        end = 0
        while end < limit - start and before[-1 - end] == after[-1 - end]:
            end += 1
        l0, c0 = _advance(line, col, before[:start])
        l1, c1 = _advance(line, col, before[: len(before) - end])
        return Edit(l0, c0, l1, c1, after[start: len(after) - end])

    def _render(self, node: cst.CSTNode, indent: str) -> Optional[str]:
        """``node``'s code inside a block indented by ``indent`` (``Module.code_for_node`` renders
        at the left margin, which drops the indentation of continuation lines)."""
        try:
            from libcst._nodes.internal import CodegenState
        except ImportError:  # a libcst without it: only calls at the left margin can be fixed
            return self.module.code_for_node(node) if not indent else None
        state = CodegenState(default_indent=self.module.default_indent,
                             default_newline=self.module.default_newline, indent_tokens=[indent])
        node._codegen(state)
        return "".join(state.tokens)

    def _import_layout(self) -> tuple[int, tuple[list[int], list[int]]]:
        """The line new imports go before, and the top-level statements' first and last lines."""
        body = self.tree.body
        last_import = None
        for stmt in body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                last_import = stmt
        if last_import is not None:
            line = last_import.end_lineno + 1
        elif body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            line = body[0].end_lineno + 1
        elif body:
            line = _first_line(body[0])
        else:
            line = len(self._starts) + 1 if self.text is not None else 1
        return line, ([_first_line(stmt) for stmt in body], [stmt.end_lineno for stmt in body])

    def _import_edit(self, imports, call_line: int, at_import: bool) -> Edit:
        """``from m import n`` lines after the last top-level import (after the docstring when there
        is none), or before the statement of a module-level call that runs earlier than that."""
        nl = self.module.default_newline
        text = "".join(f"from {m} import {n}{nl}" for m, n in imports)
        # Once per file, not per finding: a file with thousands of fixable calls made this quadratic.
        if self._import_line is None:
            self._import_line, self._stmt_lines = self._import_layout()
        line = self._import_line
        if at_import and self._stmt_lines:
            firsts, ends = self._stmt_lines
            i = bisect.bisect_right(firsts, call_line) - 1
            if i >= 0 and call_line <= ends[i] and firsts[i] < line:
                line = firsts[i]
        n_lines = len(self._starts) if self.text is not None else 0
        if line > n_lines:  # after a last line without a line break
            last = len(self.text) - self._starts[-1] + 1
            return Edit(n_lines, last, n_lines, last, nl + text[: -len(nl)])
        return Edit(line, 1, line, 1, text)


def _first_line(stmt: ast.stmt) -> int:
    decorators = getattr(stmt, "decorator_list", None)
    return min([stmt.lineno, *(d.lineno for d in decorators)]) if decorators else stmt.lineno


def _runs_at_import(scope: Optional[Scope]) -> bool:
    """True when code in ``scope`` runs while the module is imported (not inside a def or lambda)."""
    s = scope
    while s is not None:
        if s.kind in ("function", "lambda"):
            return False
        s = s.parent
    return True


def _advance(line: int, col: int, text: str) -> tuple[int, int]:
    """The position after ``text`` written from (line, col)."""
    breaks = list(LINE_BREAK.finditer(text))
    if not breaks:
        return line, col + len(text)
    return line + len(breaks), len(text) - breaks[-1].end() + 1
