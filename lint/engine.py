"""The lint engine for one file: parse with libcst, walk once, resolve callees, check the contracts.

Returns findings with positions and suppressions applied; a problem of the file is a GL000 finding.
"""
# Files are parsed by CPython's ``ast`` first: it is ~6-10x cheaper than libcst, gives CPython's own
# syntax-error messages, refuses the deeply nested input that crashes libcst's native parser (a
# segfault would end the whole run), and its call positions spare libcst's PositionProvider, which
# costs ~2.5x the parse (positions agree exactly: 27k calls of 127 site-packages files compared).
from __future__ import annotations

import ast
import bisect
import gc
import importlib
import re
from typing import Callable, Optional

from guardlint.contracts import Contract, get as _builtin_contract

from . import suppress
from .findings import Edit, FileResult, Finding, Fix
from .patterns import PATTERNS
from .rules import RuleSet

# libcst and the modules built on it are imported on first need (``_load_cst``): importing libcst
# costs ~0.4 s, more than checking a file, and most files never get past the pre-filters.
cst = fixes = Binding = ClassInfo = FuncInfo = Resolver = Scope = dotted = is_none = None
Walker = _layer_loop = None


def _load_cst() -> None:
    global cst, fixes, Binding, ClassInfo, FuncInfo, Resolver, Scope, dotted, is_none, Walker, _layer_loop
    global Collector, BoundArgs, bind_args, Checker, RawFinding, _positions_from_ast, _positions_from_cst
    if cst is not None:
        return
    import libcst

    from . import checker, fixes as _fixes, host_sync, names, positions, scopes, walk

    fixes, Walker, _layer_loop = _fixes, walk.Walker, host_sync._layer_loop
    Collector = scopes.Collector
    BoundArgs, bind_args, Checker = checker.BoundArgs, checker.bind_args, checker.Checker
    RawFinding = checker.RawFinding
    _positions_from_ast, _positions_from_cst = positions.positions_from_ast, positions.positions_from_cst
    Binding, ClassInfo, FuncInfo, Resolver, Scope = (names.Binding, names.ClassInfo, names.FuncInfo,
                                                     names.Resolver, names.Scope)
    dotted, is_none = names.dotted, names.is_none
    cst = libcst


# What moved out of this module stays importable from it; the names load with libcst, on first use.
_MOVED = ("Collector", "BoundArgs", "bind_args", "Checker", "RawFinding", "_positions_from_ast",
          "_positions_from_cst")


def __getattr__(name: str):
    if name in _MOVED:
        _load_cst()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAX_BYTES = 10 * 1024 * 1024
_NEWLINE = re.compile(r"\r\n|\r|\n")


# -- one file --------------------------------------------------------------------------------------
def file_error(path: str, detail: str, line: Optional[int] = 1, column: Optional[int] = 1) -> FileResult:
    c = _builtin_contract("GL000")
    line = max(int(line or 1), 1)
    column = max(int(column or 1), 1)
    f = Finding(path, line, column, c.code, f"{c.diagnosis.message}: {detail}", c.name, c.severity,
                line, column)
    return FileResult(path, [f])


def _too_nested(e: SyntaxError) -> bool:
    msg = str(e.msg or "")
    return "too many nested" in msg or "too complex" in msg or "too many statically nested" in msg


def _pattern_visitor(contract: Contract, report: Callable):
    module, cls = PATTERNS[contract.code].visitor.split(":")
    return getattr(importlib.import_module(f"guardlint.lint.{module}"), cls)(contract, report)


def syntax_check(data: bytes, path: str) -> FileResult:
    """GL000 for a file that no rule can match but that does not parse either (files are only fully
    checked when the pre-filter finds a target name in them; syntax errors are reported everywhere)."""
    if len(data) > MAX_BYTES:
        return FileResult(path, [])
    # The tree is dropped at once and holds no cycles: the collector passes that its allocations
    # would trigger are pure cost (~15% of this function on the sglang tree).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        ast.parse(data, filename=path)
    except SyntaxError as e:
        if _too_nested(e):
            return file_error(path, e.msg, e.lineno, e.offset)
        _load_cst()
        try:  # syntax newer than this Python's (libcst knows it) is no error of the file
            cst.parse_module(data)
            return FileResult(path, [])
        except Exception:
            return file_error(path, str(e.msg), e.lineno, e.offset)
    except ValueError as e:  # null bytes
        return file_error(path, str(e))
    except (RecursionError, MemoryError):
        # Too deep for the ast module but maybe not for the compiler: nothing to report when no rule
        # could match anyway.
        return FileResult(path, [])
    finally:
        if was_enabled:
            gc.enable()
    return FileResult(path, [])


def check_source(data: bytes, path: str, rules: RuleSet, *, strict: bool = False,
                 module_name: Optional[str] = None, is_package: bool = False,
                 keep_module: bool = False, prefilter: bool = False) -> FileResult:
    """Findings of one file's bytes (PEP 263 cookies and a UTF-8 BOM are honoured).

    ``module_name`` (dotted, from the file's package) resolves relative imports and makes this
    file's own module-level definitions targets when their qualified name is one. Never raises for
    a problem of the file: those are GL000 findings. With ``prefilter``, a file whose CPython tree
    holds nothing a rule could report is not given to libcst (``prefilter.py``); ``parsed`` is then
    False.
    """
    try:
        return _check_source(data, path, rules, strict, module_name, is_package, keep_module, prefilter)
    except RecursionError:
        return file_error(path, "nested too deeply to check")
    except MemoryError:
        return file_error(path, "out of memory while checking")
    except Exception as e:  # a bug of ours must not end the run for every other file
        return file_error(path, f"internal error while checking ({type(e).__name__}: {e}); "
                                f"the file was not checked")


def _check_source(data, path, rules, strict, module_name, is_package, keep_module, prefilter) -> FileResult:
    if len(data) > MAX_BYTES:
        return file_error(path, f"file too large to check ({len(data) / 1e6:.1f} MB; the limit is "
                                f"{MAX_BYTES // (1024 * 1024)} MB)")
    tree = None
    syntax_error: Optional[SyntaxError] = None
    # As in syntax_check: the tree holds no cycles, so collector passes during the parse are pure
    # cost, and most files past the textual filter end here when the tree pre-filter drops them.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        tree = ast.parse(data, filename=path)
    except SyntaxError as e:
        if _too_nested(e):
            return file_error(path, e.msg, e.lineno, e.offset)
        syntax_error = e
    except (RecursionError, MemoryError):
        return file_error(path, "nested too deeply to parse")
    except ValueError as e:  # null bytes
        return file_error(path, str(e))
    finally:
        if was_enabled:
            gc.enable()
    if prefilter and tree is not None:
        from .prefilter import tree_filter

        if not tree_filter(rules).may_report(tree, data):
            return FileResult(path, [])
    _load_cst()
    # libcst's parse allocates a node object per token and per grammar rule and makes no cycles: the
    # collector passes it triggers cost ~10% of the parse (65 files of sglang 0.5.23: 2.26 -> 2.04 s).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        module = cst.parse_module(data)
    except Exception as e:  # ParserSyntaxError, decoding errors, unknown encodings
        if syntax_error is not None:
            return file_error(path, syntax_error.msg, syntax_error.lineno, syntax_error.offset)
        if tree is not None:  # CPython reads it: a limit of libcst's parser, not an error of the file
            detail = e.message.strip().splitlines()[0] if isinstance(e, cst.ParserSyntaxError) else str(e)
            return file_error(path, f"valid Python that the checker's parser cannot read ({detail}); "
                                    f"the file was not checked")
        if isinstance(e, cst.ParserSyntaxError):
            return file_error(path, e.message.strip().splitlines()[0], e.raw_line, e.raw_column + 1)
        return file_error(path, f"{type(e).__name__}: {e}")
    finally:
        if was_enabled:
            gc.enable()

    collector = Collector(module_name, is_package)
    collector.default_indent = module.default_indent
    raw: list[RawFinding] = []
    visitors: list[object] = [collector]
    for contract in rules.patterns:
        visitors.append(_pattern_visitor(
            contract, lambda node, message, c=contract: raw.append(RawFinding(node, c, message, c.severity))))
    Walker(visitors).walk(module)
    raw.extend(Checker(rules, collector, strict).run())
    result = FileResult(path, [], parsed=True, module=module if keep_module else None)
    if not raw:
        return result

    positions = _positions_from_ast(module, tree, collector.calls, raw, data) if tree is not None else None
    if positions is None:
        positions = _positions_from_cst(module, raw)
    table = suppress.suppressions(data) if suppress.may_suppress(data) else None
    fixer = _Fixer(module, tree, data, Resolver(collector.module, {}, ()))
    seen = set()
    for r, (line, col, end_line, end_col, call_line, call_range) in sorted(zip(raw, positions),
                                                                           key=lambda x: x[1][:5]):
        code = r.contract.code
        # A multi-line call is suppressed on its first line or on the finding's own lines.
        if table and suppress.is_suppressed(table, code, (line, end_line, call_line)):
            continue
        key = (line, col, code, r.message)
        if key in seen:
            continue
        seen.add(key)
        fix, why = fixer.fix(r, call_range)
        message = f"{r.message}; no safe fix: {why}" if why else r.message
        result.findings.append(Finding(path, line, col, code, message, r.contract.name, r.severity,
                                       end_line, end_col, fix))
        if keep_module:
            result.nodes.append(r.node)
    return result


# -- fixes -------------------------------------------------------------------------------------------
class _Fixer:
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
            # Line starts by CPython's line numbering (\\r\\n, \\r and \\n end a line; \\f does not).
            self._starts = [0, *(m.end() for m in _NEWLINE.finditer(self._text))]
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
    breaks = list(_NEWLINE.finditer(text))
    if not breaks:
        return line, col + len(text)
    return line + len(breaks), len(text) - breaks[-1].end() + 1
