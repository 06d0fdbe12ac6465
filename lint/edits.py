"""From a finding's fix plan (``fixes.py``, on libcst nodes) to text edits of its file: the smallest
edit of the call's source, and the import lines the fix needs, placed where they run before the call.
``fixer.py`` applies the edits.
"""
from __future__ import annotations

import ast
import bisect
import os
from typing import TYPE_CHECKING, Optional

import libcst as cst

from . import engine_defs, fixes, hoist
from .findings import MESSAGE_WIDTH, NO_FIX, Edit, Fix
from .names import Resolver, Scope
from .positions import LINE_BREAK

if TYPE_CHECKING:
    from .checker import RawFinding


_PARTS_AGREE = True  # checked at the end of this module
_SPACE, _NAME, _COMMA, _EQUAL = cst.SimpleWhitespace, cst.Name, cst.Comma, cst.AssignEqual


class EditBuilder:
    """Turns a finding's fix plan (``fixes.py``, on libcst nodes) into text edits of this file."""

    def __init__(self, module: cst.Module, tree: Optional[ast.Module], data: bytes, resolver: Resolver, *,
                 text: Optional[str] = None, layout: Optional[tuple[int, tuple[list[int], list[int], list]]] = None):
        """``text`` (``data`` decoded) and ``layout`` (what ``import_layout`` gives) may be passed when
        the caller has them; with ``layout`` the tree is not needed. A file checked in chunks sets
        ``module`` to the chunk whose findings are fixed (its default indentation and newline)."""
        self.module = module
        self.tree = tree
        self.data = data
        self.resolver = resolver
        self.parsed = tree is not None or layout is not None
        self._text: Optional[str] = None
        self._starts: list[int] = []
        self._import_line: Optional[int] = None
        self._stmt_lines: tuple[list[int], list[int], list] = ([], [], [])
        # Renderings of the parts of calls (``_render_call``), for one module and indentation.
        self._parts: dict[str, dict] = {}
        self._parts_of: Optional[cst.Module] = None
        if text is not None:
            self._text = text
            self._starts = [0, *(m.end() for m in LINE_BREAK.finditer(text))]
        if layout is not None:
            self._import_line, self._stmt_lines = layout
        self.path: Optional[str] = None  # the file's path, where the fixes look for the engine's own source
        self._hoister: Optional[hoist.Hoister] = None

    def release(self) -> None:
        """Forget the module (and the renderings of its parts): a file checked in chunks is done with it."""
        self.module = None
        self._hoister = None
        self._parts.clear()
        self._parts_of = None

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
            if b is not None and b.kind == "import" and b.value == f"{module}.{name}":
                return ""
            if b is not None:
                return f"{name} already names something else here, so {module}.{name} cannot be imported"
            # An engine's helper: the module this file would import must define it (a fork may not).
            defined, source = engine_defs.defines(module, name, self.path) if engine_defs.engine_of(module) \
                else (None, "")
            if defined is False:
                return f"helper not in this {module.split('.')[0]}\n{module} as {source} does not define {name}, " \
                       f"so the fixed file would not import."
            return None

        def in_scope(name: str) -> bool:
            """A value of this name bound in the call's own function before it (not an import)."""
            if r.scope is None:
                return False
            fn = r.scope.function_scope()
            binds = [b for b in fn.bindings.get(name, []) if b.seq < r.seq]
            return fn.kind == "function" and bool(binds) and all(b.kind in ("local", "call") for b in binds)

        if r.how == "call":
            plan = fixes.plan_call(r.contract, r.node, r.bound.values, can_import, r.qual, in_scope,
                                   r.per_layer, r.takes, r.judged)
        elif r.how == "replace":
            plan = fixes.plan_replace(r.contract, r.node, can_import)
        else:
            plan = fixes.plan_positional(r.contract, r.node, r.label, r.qual, r.params)
        if plan is None:
            return None, ""
        if isinstance(plan, fixes.NoFix):
            if plan.hoist is not None:
                return self._hoisted(r, plan, call_range, can_import)
            if plan.helpers is not None:
                return self._hoisted_helpers(r, plan, call_range, can_import)
            return None, plan.reason
        if not self.parsed:
            return None, "this Python does not parse the file, so a fixed file could not be checked"
        edit = self._call_edit(r.node, plan.new_call, call_range, r.indent)
        if edit is None:
            return None, "the call's source could not be located exactly"
        edits = [edit]
        if plan.imports:
            edits.extend(self._import_edits(plan.imports, call_range[0], _runs_at_import(r.scope)))
        message = plan.message
        if plan.imports:
            message += "; import " + ", ".join(f"{m}.{n}" for m, n in plan.imports)
        return Fix(r.contract.fix_safety, message, tuple(sorted(edits)), plan.imports), ""

    def _hoisted(self, r: RawFinding, plan: fixes.NoFix, call_range, can_import) -> tuple[Optional[Fix], str]:
        """The per-layer derivation ``plan.hoist`` built once where the layer loop runs and passed down
        (``hoist.py``), or why not: the per-layer reason, then what stopped the hoist."""
        d = plan.hoist
        assert d is not None
        head, _, instead = plan.reason.partition("\n")

        # The line keeps the per-layer reason where the message still fits a line, else it gets the few words of
        # what stopped the fix across functions; the note says both whole.
        fits = len(r.message) + len(NO_FIX) + len(head) <= MESSAGE_WIDTH

        def refused(why: str, short: str = "") -> tuple[None, str]:
            line = head if fits or not short else short
            return None, f"{line}\n" + (f"{instead} " if instead else "") + \
                f"It is not built where the layer loop runs: {why}."

        if self.tree is None or not self.parsed:
            return refused("this file is checked in parts, so the functions above the call are not followed")
        sources = {}
        for name in fixes.placeholders(d.template):
            expr = r.bound.values.get(name) if r.bound is not None else None
            if expr is None or not isinstance(expr, cst.Name) or expr.value == "None":
                return refused(f"{name} is not passed to the call as a plain name", f"{name} not passed")
            sources[name] = expr.value
        if self._hoister is None:
            self._hoister = hoist.Hoister(self.tree, self.text)
        node = self._hoister.find_call(*call_range)
        if node is None:
            return refused("the call's source could not be located exactly")
        got = self._hoister.plan(node, d.target, d.template, sources)
        if isinstance(got, hoist.Refused):
            return refused(got.reason, got.short)
        for module, name in d.imports:
            defined, source = engine_defs.defines(module, name, self.path)
            if defined is False:
                return refused(f"{module} as {source} does not define {name}",
                               f"helper not in this {module.split('.')[0]}")
        imports = fixes._imports_for([(d.target, d, "")], can_import)
        if isinstance(imports, fixes.NoFix):
            return refused(imports.reason)
        edits = list(got.edits)
        message = got.message + " (a host read once per forward)"
        if imports:
            edits.extend(self._import_edits(imports, call_range[0], False))
            message += "; import " + ", ".join(f"{m}.{n}" for m, n in imports)
        return Fix("unsafe", message, tuple(sorted(edits)), imports), ""

    def _hoisted_helpers(self, r: RawFinding, plan: fixes.NoFix, call_range, can_import) -> tuple[Optional[Fix], str]:
        """The engine's own helpers (``plan.helpers``, vLLM's MMEncoderAttention classmethods) run once where the
        layer loop runs and what they build passed down (``hoist.Hoister.plan_encoder_metadata``), or why not: a
        few words on the finding's line, the whole reason in its note."""
        spec = plan.helpers
        assert spec is not None
        _, _, instead = plan.reason.partition("\n")

        def refused(why: str, short: str) -> tuple[None, str]:
            return None, f"{short}\n" + (f"{instead} " if instead else "") + \
                f"It is not built where the layer loop runs: {why}."

        if self.tree is None or not self.parsed:
            return refused("this file is checked in parts, so the functions above the call are not followed",
                           "file checked in parts")
        # The helpers and the layer's attributes as the engine this file imports defines them (the catalog's
        # pinned release where its source is not found).
        module, cls = r.qual.rsplit(".", 1)
        top = module.split(".")[0]
        source = engine_defs.find(module, self.path)
        label = source.label if source is not None else engine_defs.catalog_label(module)
        for method, params in spec.helpers.items():
            got = engine_defs.parameters(r.qual, method, self.path)
            if got is None:
                if engine_defs.defines(module, cls, self.path)[0]:
                    return refused(f"{cls} as {label} has no {method}", f"helper not in this {top}")
            elif tuple(got[: len(params)]) != params:
                return refused(f"{cls}.{method} as {label} takes ({', '.join(got)}), not ({', '.join(params)})",
                               f"helper differs in this {top}")
        attributes = hoist.instance_attributes(source.path, cls) if source is not None else None
        missing = [a for a in spec.attributes if attributes is not None and a not in attributes]
        if missing:
            return refused(f"{cls}.__init__ as {label} sets no self.{missing[0]}", f"layer attribute not in this {top}")
        # The module-level helpers, from the same engine as the layer's class: the FP8 width (required) and the mark
        # on a deliberate host read (written where that engine has it).
        width_module, width_name, width_params, _ = spec.width_helper
        width = _engine_function(width_module, width_name, module, source)
        if width is False:
            return refused(f"{width_module} as {label} does not define {width_name}", f"helper not in this {top}")
        if width and width[: len(width_params)] != width_params:  # () where the name is bound by an import there
            return refused(f"{width_name} as {label} takes ({', '.join(width)}), not ({', '.join(width_params)})",
                           f"helper differs in this {top}")
        imports: list[tuple[str, str]] = []
        why = can_import(width_module, width_name)
        if why:
            head, _, rest = why.partition("\n")
            return refused(rest.rstrip(".") if rest else why, head if rest else "name taken")
        if why is None:
            imports.append((width_module, width_name))
        sync_module, sync_name = spec.sync_allowed
        sync = _engine_function(sync_module, sync_name, module, source) is not False
        if sync:
            why = can_import(sync_module, sync_name)
            sync = not why  # "" where the file imports it already, None where it can
            if why is None:
                imports.append((sync_module, sync_name))
        if self._hoister is None:
            self._hoister = hoist.Hoister(self.tree, self.text)
        node = self._hoister.find_call(*call_range)
        if node is None:
            return refused("the call's source could not be located exactly", "call not located")
        got_plan = self._hoister.plan_encoder_metadata(node, spec, r.params or r.contract.params_for(r.qual),
                                                       file=self.path, sync_allowed=sync)
        if isinstance(got_plan, hoist.Refused):
            return refused(got_plan.reason, got_plan.short)
        edits = list(got_plan.edits)
        message = got_plan.message
        if imports:
            edits.extend(self._import_edits(imports, call_range[0], False))
            message += "; import " + ", ".join(f"{m}.{n}" for m, n in imports)
        return Fix("unsafe", message + " (a host read once per forward)", tuple(sorted(edits)), tuple(imports)), ""

    def _call_edit(self, old: cst.Call, new: cst.Call, call_range, indent: str) -> Optional[Edit]:
        """The smallest edit that turns the call's text into the new call's (parentheses around the
        call are not part of its range). The old call's rendering must equal its source exactly."""
        before = self._render_call(old, indent)
        after = self._render_call(new, indent)
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

    def _render_call(self, call: cst.Call, indent: str) -> Optional[str]:
        """``_render`` of ``call`` without the parentheses around it, from renderings of its arguments
        and their values that are kept while the module is: a fixed call shares all but its new arguments
        with the call, and a derived value is shared by every call it is written into (rendering whole
        calls was half of the check of a module of many fixable calls)."""
        if not _PARTS_AGREE:
            return self._render(call.with_changes(lpar=(), rpar=()), indent)
        if self._parts_of is not self.module:
            self._parts.clear()
            self._parts_of = self.module
        from libcst._nodes.internal import CodegenState

        state = CodegenState(default_indent=self.module.default_indent,
                             default_newline=self.module.default_newline, indent_tokens=[indent])
        tokens = state.tokens
        # id(node) -> (node, its code); the node is kept with it, so that its id is not reused meanwhile.
        kept = self._parts.setdefault(indent, {})

        def code(node: cst.CSTNode) -> str:
            t = type(node)
            # The nodes that most arguments are made of, as libcst writes them.
            if t is _SPACE:
                return node.value
            if t is _NAME and not node.lpar:
                return node.value
            if (t is _COMMA or t is _EQUAL) and type(node.whitespace_before) is _SPACE \
                    and type(node.whitespace_after) is _SPACE:
                return node.whitespace_before.value + ("," if t is _COMMA else "=") + node.whitespace_after.value
            node._codegen(state)
            text = "".join(tokens)
            tokens.clear()
            return text

        def value(node: cst.CSTNode) -> str:
            if type(node) is _NAME and not node.lpar:
                return node.value
            got = kept.get(id(node))
            if got is None or got[0] is not node:
                got = kept[id(node)] = (node, code(node))
            return got[1]

        def arg(node: cst.Arg, default_comma: bool) -> str:
            key = (id(node), default_comma)
            got = kept.get(key)
            if got is None or got[0] is not node:
                got = kept[key] = (node, _arg_code(node, default_comma, code, value))
            return got[1]

        last = len(call.args) - 1
        return "".join([code(call.func), code(call.whitespace_after_func), "(", code(call.whitespace_before_args),
                        *(arg(a, i != last) for i, a in enumerate(call.args)), ")"])

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

    def _import_layout(self) -> tuple[int, tuple[list[int], list[int], list]]:
        return import_layout(self.tree.body, len(self._starts) + 1 if self.text is not None else 1)

    def _import_edits(self, imports, call_line: int, at_import: bool) -> list[Edit]:
        """``from m import n`` lines where an import sorter would put them: among the file's top-level absolute
        ``from`` imports of m's top package, in module order (the file's own order kept, as isort and ruff
        keep it); else as ``_import_edit`` places them."""
        at: dict[int, list] = {}
        rest = []
        for m, n in imports:
            line = self._sorted_import_line(m)
            if line is None or (at_import and line > call_line):  # a module-level call runs before it
                rest.append((m, n))
            else:
                at.setdefault(line, []).append((m, n))
        nl = self.module.default_newline
        edits = [Edit(line, 1, line, 1, "".join(f"from {m} import {n}{nl}" for m, n in group))
                 for line, group in sorted(at.items())]
        if rest:
            edits.append(self._import_edit(rest, call_line, at_import))
        return edits

    def _sorted_import_line(self, module: str) -> Optional[int]:
        """The line before which ``from module import ...`` sorts among the top-level absolute ``from`` imports of
        its top package (after the last of them when it sorts last), or None when the file has none."""
        if module.startswith("."):
            return None
        if self._import_line is None:
            self._import_line, self._stmt_lines = self._import_layout()
        top = module.split(".")[0]
        same = [(m, first, last) for m, first, last in self._stmt_lines[2] if m.split(".")[0] == top]
        if not same:
            return None
        key = module.lower()
        later = next((first for m, first, _ in same if m.lower() > key), None)
        if later is not None:
            return later
        end = same[-1][2]
        n_lines = len(self._starts) if self.text is not None else 0
        return end + 1 if end < n_lines else None  # a last line without a line break: _import_edit's case

    def _import_edit(self, imports, call_line: int, at_import: bool) -> Edit:
        """``from m import n`` lines after the last top-level import (after the docstring when there
        is none), or before the statement of a module-level call that runs earlier than that."""
        nl = self.module.default_newline
        text = "".join(f"from {m} import {n}{nl}" for m, n in imports)
        # Once per file, not per finding: a file with thousands of fixable calls made this quadratic.
        if self._import_line is None:
            self._import_line, self._stmt_lines = self._import_layout()
        line = self._import_line
        if at_import and self._stmt_lines[0]:
            firsts, ends, _ = self._stmt_lines
            i = bisect.bisect_right(firsts, call_line) - 1
            if i >= 0 and call_line <= ends[i] and firsts[i] < line:
                line = firsts[i]
        n_lines = len(self._starts) if self.text is not None else 0
        if line > n_lines:  # after a last line without a line break
            last = len(self.text) - self._starts[-1] + 1
            return Edit(n_lines, last, n_lines, last, nl + text[: -len(nl)])
        return Edit(line, 1, line, 1, text)


def _engine_function(module: str, name: str, beside: str, source: Optional[engine_defs.Source]):
    """The positional parameters of function ``name`` in ``module`` of the engine whose module ``beside`` is at
    ``source`` (an empty tuple where the name is bound there otherwise); False where that engine has no such module
    or name; None where the engine's source is not found (the catalog's pinned release is trusted)."""
    if source is None:
        return None
    parts = beside.split(".")
    path = os.path.normpath(source.path)
    tails = [os.path.join(*parts) + ".py", os.path.join(*parts, "__init__.py")]
    tail = next((t for t in tails if path.endswith(os.sep + t)), None)
    if tail is None:
        return None
    base = path[: -len(tail)]
    stem = os.path.join(base, *module.split("."))
    found = next((p for p in (stem + ".py", os.path.join(stem, "__init__.py")) if os.path.isfile(p)), None)
    got = hoist.function_parameters(found, name) if found is not None else None
    if got is None:
        return False
    return tuple(p for p in got if p not in ("self", "cls"))


def _arg_code(arg: cst.Arg, default_comma: bool, code, value) -> str:
    """``Arg._codegen`` (libcst): its parts rendered by ``code``, its value by ``value``."""
    parts = [arg.star, code(arg.whitespace_after_star)]
    if arg.keyword is not None:
        parts.append(code(arg.keyword))
    equal = arg.equal
    if equal is cst.MaybeSentinel.DEFAULT and arg.keyword is not None:
        parts.append(" = ")
    elif isinstance(equal, cst.AssignEqual):
        parts.append(code(equal))
    parts.append(value(arg.value))
    comma = arg.comma
    if comma is cst.MaybeSentinel.DEFAULT and default_comma:
        parts.append(", ")
    elif isinstance(comma, cst.Comma):
        parts.append(code(comma))
    parts.append(code(arg.whitespace_after_arg))
    return "".join(parts)


def _parts_agree() -> bool:
    """Whether ``EditBuilder._render_call`` renders calls as this libcst does (it copies libcst's code
    generation of calls and arguments); if not, calls are rendered whole."""
    from libcst._nodes.internal import CodegenState

    def whole(node) -> str:
        state = CodegenState(default_indent="    ", default_newline="\n", indent_tokens=["  "])
        node._codegen(state)
        return "".join(state.tokens)

    builder = EditBuilder(cst.Module([]), None, b"", None)
    samples = ["f(a, *b, c=d, **e, g = h,)", "o.m (\n  x,  # c\n  y=1\n)", "f()", "g(x)(y, z)",
               "(f)(\n    a,\n    b\n)", "f( (a) , b =(c),d= e ,)", "f(x\n, y)"]
    try:
        for text in samples:
            call = cst.parse_expression(text)
            extra = cst.Arg(value=cst.Name("n"), keyword=cst.Name("k"))
            for c in (call, call.with_changes(args=[*call.args, extra])):
                if builder._render_call(c, "  ") != whole(c.with_changes(lpar=(), rpar=())):
                    return False
    except Exception:
        return False
    return True


class Layout:
    """``import_layout`` of a module's body given as consecutive runs of statements (``add``)."""

    def __init__(self):
        self.docstring_end: Optional[int] = None  # the end line of a first statement that is a docstring
        self.last_import_end: Optional[int] = None
        self.firsts: list[int] = []
        self.ends: list[int] = []
        self.froms: list[tuple[str, int, int]] = []  # top-level absolute ``from m import``: (m, first, last line)

    def add(self, body) -> None:
        for stmt in body:
            if not self.firsts and _is_docstring(stmt):
                self.docstring_end = stmt.end_lineno
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                self.last_import_end = stmt.end_lineno
            if isinstance(stmt, ast.ImportFrom) and not stmt.level and stmt.module:
                self.froms.append((stmt.module, stmt.lineno, stmt.end_lineno or stmt.lineno))
            self.firsts.append(_first_line(stmt))
            self.ends.append(stmt.end_lineno)

    def result(self, after_last_line: int) -> tuple[int, tuple[list[int], list[int], list]]:
        if self.last_import_end is not None:
            line = self.last_import_end + 1
        elif self.docstring_end is not None:
            line = self.docstring_end + 1
        elif self.firsts:
            line = self.firsts[0]
        else:
            line = after_last_line
        return line, (self.firsts, self.ends, self.froms)


def import_layout(body, after_last_line: int) -> tuple[int, tuple[list[int], list[int], list]]:
    """The line new imports go before (after the last top-level import, else after the docstring, else
    before the first statement; ``after_last_line`` in an empty module), and the top-level statements'
    first and last lines, and its top-level absolute ``from`` imports (module, first and last line)."""
    layout = Layout()
    layout.add(body)
    return layout.result(after_last_line)


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


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


_PARTS_AGREE = _parts_agree()
