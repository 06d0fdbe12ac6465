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
from dataclasses import dataclass
from typing import Callable, Optional

from guardlint.contracts import Contract, get as _builtin_contract

from . import suppress
from .findings import Edit, FileResult, Finding, Fix
from .patterns import PATTERNS
from .rules import REPLACE_FUNCTIONS, RuleSet

# libcst and the modules built on it are imported on first need (``_load_cst``): importing libcst
# costs ~0.4 s, more than checking a file, and most files never get past the pre-filters.
cst = fixes = Binding = ClassInfo = FuncInfo = Resolver = Scope = dotted = is_none = None
Walker = _layer_loop = None


def _load_cst() -> None:
    global cst, fixes, Binding, ClassInfo, FuncInfo, Resolver, Scope, dotted, is_none, Walker, _layer_loop
    global Collector
    if cst is not None:
        return
    import libcst

    from . import fixes as _fixes, host_sync, names, scopes, walk

    fixes, Walker, _layer_loop = _fixes, walk.Walker, host_sync._layer_loop
    Collector = scopes.Collector
    Binding, ClassInfo, FuncInfo, Resolver, Scope = (names.Binding, names.ClassInfo, names.FuncInfo,
                                                     names.Resolver, names.Scope)
    dotted, is_none = names.dotted, names.is_none
    cst = libcst


# What moved out of this module stays importable from it; the names load with libcst, on first use.
_MOVED = ("Collector",)


def __getattr__(name: str):
    if name in _MOVED:
        _load_cst()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAX_BYTES = 10 * 1024 * 1024
_NEWLINE = re.compile(r"\r\n|\r|\n")


@dataclass
class RawFinding:
    node: cst.Call
    contract: Contract
    message: str
    severity: str
    # Index into ``node.args`` when the finding is about one argument (reported at that argument).
    arg: Optional[int] = None
    # What a fixer needs: how the call was checked ("call", "replace", "positional"; None: no fix),
    # its bound arguments, where it is made (scope, seq) and how it is named in messages.
    how: Optional[str] = None
    bound: Optional["BoundArgs"] = None
    scope: Optional[Scope] = None
    seq: int = 0
    label: str = ""
    indent: str = ""
    qual: str = ""  # the target the callee resolved to (derivations are chosen by it)
    per_layer: str = ""  # why the call runs once per layer ("" when it does not, as far as is known)


# -- checking: calls against contracts ---------------------------------------------------------------
@dataclass
class BoundArgs:
    """A call's arguments bound to parameter names (by keyword, and by position through ``params``)."""

    values: dict
    positional: int = 0
    star: bool = False
    double_star: bool = False

    @property
    def splat(self) -> str:
        return " and ".join(s for s, on in (("*args", self.star), ("**kwargs", self.double_star)) if on)

    def present(self) -> set[str]:
        return {k for k, v in self.values.items() if not is_none(v)}

    def explicit_none(self) -> set[str]:
        return {k for k, v in self.values.items() if is_none(v)}


def bind_args(call: cst.Call, params: tuple[str, ...]) -> BoundArgs:
    bound = BoundArgs({})
    index = 0
    for arg in call.args:
        if arg.star == "*":
            bound.star = True
        elif arg.star == "**":
            bound.double_star = True
        elif arg.keyword is not None:
            bound.values[arg.keyword.value] = arg.value
        else:
            bound.positional += 1
            # After *args the position of what follows is unknown.
            if not bound.star and index < len(params):
                bound.values[params[index]] = arg.value
            index += 1
    return bound


def _alternatives(groups) -> str:
    items = ["+".join(g) for g in groups]
    if len(items) == 1:
        return f"does not pass {items[0]}"
    if len(items) == 2:
        return f"passes neither {items[0]} nor {items[1]}"
    return "passes none of " + ", ".join(items[:-1]) + f" or {items[-1]}"


def _none_note(names) -> str:
    if not names:
        return ""
    verb = "counts" if len(names) == 1 else "count"
    return f" ({', '.join(f'{n}=None' for n in names)} {verb} as missing)"


def _stem(message: str) -> str:
    """A diagnosis message as the head of a longer one (``... or seg_lens.`` -> ``... or seg_lens``)."""
    return message.rstrip(" .")


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def _code(node: cst.CSTNode) -> str:
    if isinstance(node, (cst.Integer, cst.Float, cst.Name)):
        return node.value
    return cst.Module([]).code_for_node(node)


def _literal_equal(node: cst.BaseExpression, literal: str) -> bool:
    text = _code(node).strip()
    try:
        a, b = ast.literal_eval(text), ast.literal_eval(literal)
        return type(a) is type(b) and a == b
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text == literal.strip()


class Checker:
    def __init__(self, rules: RuleSet, collector: Collector, strict: bool = False):
        _load_cst()
        self.rules = rules
        self.c = collector
        self.strict = strict
        known = {*rules.by_callee, *rules.by_instance, *REPLACE_FUNCTIONS}
        self.resolver = Resolver(collector.module, rules.by_instance, known)
        # Only calls whose last name is one of these can reach a contract; the rest are not resolved.
        names = {q.rsplit(".", 1)[-1] for q in known} | {"forward"}
        self._attr_names: set[str] = set()
        for scope_bindings in self._all_bindings():
            names.update(n for n, bs in scope_bindings.items()
                         if any(b.kind == "call" or (b.kind == "import" and b.value in known) for b in bs))
        self._names = names

    def _all_bindings(self):
        seen = set()
        for _, scope, _, _, _ in self.c.sites:
            s = scope
            while s is not None and id(s) not in seen:
                seen.add(id(s))
                yield s.bindings
                if isinstance(s.info, ClassInfo):
                    self._attr_names.update(s.info.attrs)
                s = s.parent

    def run(self) -> list[RawFinding]:
        out: list[RawFinding] = []
        names = self._names
        for node, scope, seq, func, indent in self.c.sites:
            f = node.func
            last = f.attr.value if isinstance(f, cst.Attribute) else f.value if isinstance(f, cst.Name) else None
            if last is not None and last not in names and last not in self._attr_names:
                continue
            ref = self.resolver.resolve(f, scope, seq)
            if ref is None:
                continue
            if ref.kind == "qual":
                if ref.qual in REPLACE_FUNCTIONS and self.rules.replace_contracts:
                    first = len(out)
                    self._check_replace(node, scope, seq, out)
                    for r in out[first:]:
                        r.indent = indent
                contracts = self.rules.by_callee.get(ref.qual, ())
                label = ref.qual.rsplit(".", 1)[-1] + "(...)"
            elif ref.kind == "inst" and ref.method in ("", "forward"):
                contracts = self.rules.by_instance.get(ref.qual, ())
                short = ref.qual.rsplit(".", 1)[-1].replace("[]", "[...]")
                label = f"{short}.forward(...)" if ref.method else f"{short}(...)"
            else:
                continue
            if not contracts:
                continue
            guarded = ref.guarded or self.resolver.inside_guarded(func)
            first = len(out)
            qual = self.rules.canonical.get(ref.qual, ref.qual)  # per-target data is keyed by the target's name
            for contract in contracts:
                self._check(contract, node, scope, seq, label, guarded, out, qual)
            for r in out[first:]:
                r.indent = indent
                r.qual = qual
                r.per_layer = self.c.per_layer.get(id(node), "")
        return out

    def _check(self, c: Contract, node, scope, seq, label, guarded, out, qual: str = "") -> None:
        bound = bind_args(node, c.params_for(qual))
        target = c.target(qual)
        if target is not None and target.when_passed and not set(target.when_passed) <= bound.present():
            return
        diag = _stem(c.diagnosis.message)
        if c.kind == "call":
            if guarded:  # the guard derives what is missing at runtime
                return
            missing = self._missing(c, self._present(c, bound, scope, seq), node, scope, seq)
            if missing is None:
                return
            if bound.star or bound.double_star:
                self._unknown(c, node, label, bound, out)
                return
            nones = [n for g in c.require for n in g if _top(n) in bound.explicit_none()]
            out.append(RawFinding(node, c, f"{diag}: {label} {_alternatives(c.require)}"
                                  f"{_none_note(list(dict.fromkeys(nones)))}", c.severity,
                                  how="call", bound=bound, scope=scope, seq=seq, label=label))
        elif c.kind == "positional":
            if bound.positional:
                n = bound.positional
                out.append(RawFinding(node, c, f"{diag}: {label} passes {n} positional argument"
                                      f"{'s' if n != 1 else ''}", c.severity,
                                      how="positional", bound=bound, scope=scope, seq=seq, label=label))
            elif bound.star:
                self._unknown(c, node, label, bound, out)
        elif c.kind == "value":
            for name, literal in c.forbidden_values:
                value = bound.values.get(name)
                if value is not None and _literal_equal(value, literal):
                    if c.satisfied_by_later_assignment and self._overwritten(node, scope, seq, name, literal):
                        continue
                    arg = next(i for i, a in enumerate(node.args) if a.value is value)
                    out.append(RawFinding(node, c, f"{diag}: {label} passes {name}={literal}", c.severity, arg))

    def _present(self, c: Contract, bound: BoundArgs, scope, seq) -> set[str]:
        """Names passed and not None; an attribute path (``forward_metadata.packed_indptrs``) counts as
        present unless its object is provably built without it (``METADATA_BUILDERS``)."""
        present = bound.present()
        paths = {n for g in c.require for n in g if "." in n and _top(n) in present}
        for path in paths:
            top, attr = path.split(".", 1)
            fields = self._built_fields(bound.values[top], scope, seq)
            if fields is None or attr in fields:
                present.add(path)
        return present

    def _built_fields(self, expr, scope, seq) -> Optional[set]:
        """The fields a metadata value certainly has, when it is built by a known builder in this
        function (``meta = prepare_...(...)`` before the call, or inline); None when unknown."""
        from guardlint.contracts.catalog import METADATA_BUILDERS

        call = expr if isinstance(expr, cst.Call) else None
        if isinstance(expr, cst.Name):
            b = self.resolver.lookup(scope, expr.value, seq)
            fn = scope.function_scope()
            binds = fn.bindings.get(expr.value, [])
            if b is None or b.kind != "call" or len(b.value) < 4 or len(binds) != 1:
                return None  # rebound (a branch per backend) or not built here: trusted
            call, s, sq = b.value[3], b.value[1], b.value[2]
            scope, seq = s, sq
        if call is None:
            return None
        ref = self.resolver.resolve(call.func, scope, seq)
        if ref is None or ref.kind != "qual" or ref.qual not in METADATA_BUILDERS:
            return None
        if any(a.star for a in call.args):
            return None
        fields = set(METADATA_BUILDERS[ref.qual])
        fields.update(a.keyword.value for a in call.args if a.keyword is not None and not is_none(a.value))
        return fields

    def _overwritten(self, node, scope: Scope, seq: int, name: str, literal: str) -> bool:
        """The record built by ``node`` is kept (``self.buf = C(...)`` / ``x = C(...)``) and its field
        ``name`` is stored with another value: in any method of the class for ``self.buf``, later in the
        function for a local name (directly or through ``alias = self.buf``)."""
        target = self.c.assigned.get(id(node))
        if target is None:
            return False
        fn = scope.function_scope()
        owner = fn.info.def_scope.info if isinstance(fn.info, FuncInfo) else None
        for cls, store_fn, sq, obj, attr, value in self.c.stores:
            if attr != name or obj != target or is_none(value) or _literal_equal(value, literal):
                continue
            if target.startswith("self.") and isinstance(owner, ClassInfo) and cls is owner:
                return True
            if store_fn is fn and sq > seq:
                return True
        return False

    def _missing(self, c: Contract, present: set[str], node, scope, seq):
        items = {n for g in c.require for n in g if n in present or ("." not in n and _top(n) in present)}
        missing = c.missing_groups(items)
        if missing is not None and c.satisfied_by_later_assignment:
            later = self._stored_later(node, scope, seq)
            if later:
                items |= {n for g in c.require for n in g if _top(n) in later}
                missing = c.missing_groups(items)
        return missing

    def _stored_later(self, node, scope: Scope, seq: int) -> set[str]:
        """Attributes set to a non-None value on the call's result, later in the same function."""
        target = self.c.assigned.get(id(node))
        if target is None:
            return set()
        return {attr for sq, obj, attr, none, _ in scope.function_scope().attr_stores
                if obj == target and sq > seq and not none}

    def _unknown(self, c: Contract, node, label, bound: BoundArgs, out) -> None:
        if self.strict:
            out.append(RawFinding(node, c, f"{_stem(c.diagnosis.message)}: {label} could not be checked: "
                                  f"it passes {bound.splat}", "warning"))

    def _check_replace(self, node: cst.Call, scope, seq, out) -> None:
        """``dataclasses.replace(obj, max_len=None, seg_lens=None)`` empties every group of a contract."""
        if any(arg.star for arg in node.args):
            return
        nones = {arg.keyword.value for arg in node.args if arg.keyword is not None and is_none(arg.value)}
        label = (dotted(node.func) or "replace").rsplit(".", 1)[-1] + "(...)"
        for c in self.rules.replace_contracts:
            if not c.require or not all(any(_top(n) in nones for n in g) for g in c.require):
                continue
            later = self._stored_later(node, scope, seq)
            if later and c.missing_groups({n for g in c.require for n in g if _top(n) in later}) is None:
                continue
            named = list(dict.fromkeys(n for g in c.require for n in g if _top(n) in nones))
            out.append(RawFinding(node, c, f"{_stem(c.diagnosis.message)}: {label} sets "
                                  + " and ".join(f"{n}=None" for n in named), c.severity,
                                  how="replace", scope=scope, seq=seq, label=label))


# -- positions -------------------------------------------------------------------------------------
def _ast_dotted(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _positions(module: cst.Module, tree: Optional[ast.AST], calls: list, raw: list, data: bytes):
    """(line, column, end_line, end_column, call_line, call_range) of each finding: 1-based, end
    exclusive, columns in characters; the range of the argument a finding is about, else of the call;
    ``call_range`` is the call's (line, column, end_line, end_column), parentheses around it excluded."""
    if tree is not None:
        found = _positions_from_ast(module, tree, calls, raw, data)
        if found is not None:
            return found
    from libcst.metadata import MetadataWrapper, PositionProvider

    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    out = []
    for r in raw:
        call = positions[r.node]
        p = call if r.arg is None else positions[r.node.args[r.arg]]
        out.append((p.start.line, p.start.column + 1, p.end.line, p.end.column + 1, call.start.line,
                    (call.start.line, call.start.column + 1, call.end.line, call.end.column + 1)))
    return out


def _positions_from_ast(module, tree, calls, raw, data):
    # Pre-order of a tree whose children are in source order is the order of start positions,
    # an enclosing call before the calls it starts with (``f(x)(y)``): sort CPython's calls so.
    acalls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    if len(acalls) != len(calls):
        return None
    acalls.sort(key=lambda n: (n.lineno, n.col_offset, -n.end_lineno, -n.end_col_offset))
    index = {id(n): i for i, n in enumerate(calls)}
    lines = _NEWLINE.split(data.decode(module.encoding))
    out = []
    for r in raw:
        if id(r.node) not in index:  # not a call (GL104's ``if seq_lens:``): libcst's positions
            return None
        a = acalls[index[id(r.node)]]
        if _ast_dotted(a.func) != dotted(r.node.func):
            return None
        p = a
        if r.arg is not None:
            # CPython keeps positional and keyword arguments apart; in source order they are libcst's.
            args = sorted([*a.args, *a.keywords], key=lambda n: (n.lineno, n.col_offset))
            if len(args) != len(r.node.args):
                return None
            p = args[r.arg]
        out.append((p.lineno, _column(lines, p.lineno, p.col_offset),
                    p.end_lineno, _column(lines, p.end_lineno, p.end_col_offset), a.lineno,
                    (a.lineno, _column(lines, a.lineno, a.col_offset),
                     a.end_lineno, _column(lines, a.end_lineno, a.end_col_offset))))
    return out


def _column(lines: list[str], lineno: int, byte_offset: int) -> int:
    """CPython counts columns in UTF-8 bytes; findings count characters."""
    line = lines[lineno - 1] if 0 < lineno <= len(lines) else ""
    if line.isascii():
        return byte_offset + 1
    return len(line.encode("utf-8")[:byte_offset].decode("utf-8", errors="ignore")) + 1


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

    positions = _positions(module, tree, collector.calls, raw, data)
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
