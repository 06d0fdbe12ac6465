"""Callee summaries: what a function of the scanned tree does with its parameters, for the calls that reach it.

Per function: the parameters it reads on the host (``.item()``, ``.tolist()``, ``int()`` of them, directly or
through its own callees, to a fixed point), the keywords it forwards to a callee, those it requires (raises
or asserts when None) and those it never reads. ``sketch`` takes a file's facts from its CPython tree;
``build`` resolves calls to their definitions across the tree, once per run, for GL104 to ask at a call.
"""
# Demand first. The roots are the calls of per-layer code (GL104's places) that may pass metadata (an
# argument that may derive from a sequence-length name, as the tree pre-filter judges it); only the
# functions they reach are sketched, and only those whose text, or a callee's, holds a host read are read
# exactly: their source is parsed with libcst and walked by the value model (``values.py``) with every
# parameter taken for a device tensor. So the cost follows the calls made from per-layer code, not the
# size of the tree: the roots' files are sketched by the workers that parse them anyway, and a run parses
# besides the modules the calls resolve to (an ast parse each) and the few functions on a path to a read.
# Resolution is by facts, never by a name alone: ``self.m()`` is the method of the enclosing class or of
# its bases defined in the tree, ``f()`` a module-level def of the file or what an import of it names,
# ``m.f()`` the def in the module ``m`` is bound to (absolute and relative imports; a module is a file
# under the package root of the file that imports it, so a src/ layout works). ``T[key]()``, ``T.get(key)()``
# and ``fn()`` after ``fn = T[key]`` reach every function entry of ``T``, a module-level dict display (in the
# file or imported), each named in the path. ``self.attn()`` where a method of the class stores a constructor
# call in ``self.attn`` runs that class's forward (or each method its CustomOp forward dispatches to), and
# ``blk()`` in ``for blk in self.blocks`` the forward of the class ``self.blocks`` holds a list of: "held"
# modules, whose reads count only for values the caller makes on the device (``host_sync``). A module the tree
# does not hold is read from where its files would import it (``engine_defs.find``: a copy above them, else the
# installed engine; the catalog's ``PINNED_HOST_READS`` where neither is found), and ``torch.ops.<ns>.<name>()``
# reaches the def registered as that op. Any other name bound in the calling function, a class (a
# constructor), anything else: no summary, no finding.
# A read on a path taken only when another parameter is None (``bounds if bounds is not None else
# cu.tolist()``) is the callee's fallback: a call that passes that parameter is not reported.
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from itertools import accumulate, takewhile
from typing import Any, Callable, Optional

from guardlint.contracts import catalog

from .engine_defs import (catalog_label, class_forward_targets, engine_of, find, forward_targets,
                          imports_of)
from .kernel_facts import call_lines, holds_a_call, kernels_of, offset_params
from .kernel_facts import may_call as may_call_kernel
from .patterns import INSTALLS, PATTERNS, is_layer_class, is_seqlen_name
from .registries import may_register, registered
from .prefilter import HOST_SYNC, _NO_TAINT, _derives, _dotted, _loops_over_layers, _tainted

# A host read in a function's text: what GL104 reads (``host_sync._host_read``) and no more (``x.float()``
# is not one).
# (and a bare copy to the host, ``.cpu()``, ``.to("cpu")``: it waits for the device as a read does).
_READ = re.compile(rb"\.(?:item|tolist|cpu)\(\s*\)|\.to\((?:[^()]|\([^()]*\))*?[\"']cpu\b"
                   rb"|(?<![\w.])(?:int|float|bool)\(")
# The truth of a tensor, as GL104 reads it (``host_sync._tensor_truth``).
_TRUTH = re.compile(rb"\.(?:any|all)\(\s*\)")
# Functions followed from the roots in one run at most: a bound, not a budget (a tree's per-layer code
# reaches a few hundred).
MAX_FUNCTIONS = 5000
# Imports followed from one name (``from pkg import f`` where pkg's __init__ imports f in turn).
_MAX_HOPS = 8
# Files from this size on are checked in chunks (``chunks.MIN_BYTES``), without a sketch.
_LARGE = 512 * 1024

# ("self", class qualname, method) | ("name", name) | ("attr", dotted base, name) | ("table", name): every
# function entry of the module-level dict ``name`` (``TABLE[key](...)``, ``TABLE.get(key)(...)``, ``fn = TABLE[key]``)
Ref = tuple


# -- facts of one file (CPython's tree) ------------------------------------------------------------------
@dataclass
class FuncFacts:
    qualname: str
    line: int
    lines: tuple  # (first line, decorators included; last line)
    params: tuple  # positional parameters in order
    keywords: frozenset  # the parameters a caller may name (all but a bound ``self``)
    kwargs: Optional[str]  # the ``**`` parameter
    bound: int  # leading parameters a call through an instance fills (``self``, ``cls``): 1 or 0
    reads_text: bool  # its text holds a host read
    calls: dict  # callee as written (``self.m``, ``f``, ``mod.f``) -> Ref, for the calls of its own body
    forwards: frozenset  # parameters passed on to a callee under their own name (``**`` for **kwargs)
    requires: frozenset  # parameters it raises or asserts on when None
    ignores: frozenset  # parameters its body never names
    # parameters it hands, as it was given them, to a callee the summaries cannot follow and that is no
    # torch or builtin function (``_NOT_KERNELS``): a kernel, which needs them on the device
    kernel: frozenset = frozenset()
    # callee as written -> (the parameter each positional argument passes as given, or None; keyword ->
    # parameter): how its parameters reach its callees' (for ``kernel`` across calls)
    passes: dict = field(default_factory=dict)
    # calls of its own body with an argument that may derive from metadata (the pre-filter's taint): the
    # held modules (``self.attn(...)``) followed from it are those it calls so
    metadata_calls: frozenset = frozenset()


@dataclass(frozen=True)
class Root:
    """A call in per-layer code: the def it is in (``scope``), the callee as written, its Ref, the arguments
    (positions, keywords) that may hold metadata, and those it passes a value other than None."""

    scope: str
    callee: str
    ref: Ref
    positions: tuple
    keywords: tuple
    given: tuple  # positions (ints) and keywords (names)
    at: tuple  # line and column (1-based) of the call
    # of ``positions`` and ``keywords``, those that pass a parameter of the def it never stores to: through a
    # held module such an argument is its caller's fact (``Callee.held``), so no reason to check the call
    passed_on: tuple = ()
    # a call whose result the def hands to a layer-loop call (``m = self.compute_max(cu)``, then ``blk(x, m)``):
    # not a read, a value; the run asks whether its definition returns a device value derived from what it
    # is handed (``Returns``)
    value: bool = False


@dataclass
class FileFacts:
    path: str
    module: Optional[str]
    package: Optional[str]  # where relative imports start
    names: dict  # module-level name -> ("def",) | ("class",) | ("module", m) | ("from", m, attr) | ("typevar",)
    #   | ("other",)
    classes: dict  # class qualname -> (bases as written, {method: parameters a call through self binds})
    functions: dict = field(default_factory=dict)  # qualname -> FuncFacts, those sketched so far
    roots: list = field(default_factory=list)
    # class qualname -> its ``_members``, for the classes whose held modules this file's roots call (read
    # where the file is parsed anyway, so the run need not parse it again)
    members: dict = field(default_factory=dict)
    plain: set = field(default_factory=set)  # classes whose own forward dispatches to nothing (no CustomOp)
    ops: dict = field(default_factory=dict)  # custom op name -> the def registered as it (``torch.ops.ns.<name>``)
    places: list = field(default_factory=list)  # qualnames of its per-layer places (a layer forward, a registered def)
    # (def name, module a def-local import takes it from or None, line, target as written) of each def the file
    # installs as a layer class's forward (``Qwen2VLAttention.forward = patched``): ``reach.py`` follows them
    installs: list = field(default_factory=list)
    # qualname -> (first line, decorators included; last line) of each class and def ``_index`` saw: where the run
    # reads one def or class of a file a worker sketched without parsing the whole file again (``_segment``)
    spans: dict = field(default_factory=dict)


def sketch(tree: ast.Module, data: bytes, path: str, module: Optional[str], is_package: bool) -> FileFacts:
    """The facts of a file: its module-level names and classes, its roots and the functions of the file
    they reach."""
    s = _Sketch(tree, data, path, module, is_package)
    s.roots(tree.body, [], None, [], None, False)
    s.close()
    return s.facts


def sketch_source(data: bytes, path: str, module: Optional[str], is_package: bool) -> Optional[FileFacts]:
    """``sketch`` of a file no rule parses: None where CPython cannot parse it, or it is checked in chunks."""
    if len(data) >= _LARGE:
        return None
    try:
        tree = ast.parse(data, filename=path)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return sketch(tree, data, path, module, is_package)


class _Sketch:
    def __init__(self, tree: ast.Module, data: bytes, path: str, module: Optional[str], is_package: bool,
                 facts: Optional[FileFacts] = None):
        package = module if is_package else (module.rpartition(".")[0] or None) if module else None
        self.data = data
        self._body = tree.body
        self._targets: dict = {}  # id(class) -> the methods its forward dispatches to
        self._tables: dict = {}  # (id(def), name) -> the table the name is bound to from there
        self._loops: dict = {}  # (id(def), name) -> X where the name is the element of a loop over self.X
        self.defs: dict = {}  # qualname -> (def, its class's qualname or None)
        self.class_nodes: dict = {}  # class qualname -> its node
        self._bindings: dict = {}
        self._taints: dict = {}
        self._kernel_names: Optional[tuple] = None
        self._registered_defs: Optional[dict] = None
        self._module_name, self._is_package = module, is_package
        self._starts: Optional[list] = None
        self.facts = facts or FileFacts(path, module, package, {}, {})
        if facts is None:
            self._names(tree.body)
        self._index(tree.body, "", None)
        if facts is None and INSTALLS.search(data):
            self.facts.installs.extend(_installs(tree, self._absolute, self.facts.spans))

    def _names(self, body) -> None:
        """Module-level bindings in order, the last one winning (through top-level if/try blocks)."""
        names = self.facts.names
        for node in body:
            t = type(node)
            if t is ast.FunctionDef or t is ast.AsyncFunctionDef or t is ast.ClassDef:
                names[node.name] = ("class",) if t is ast.ClassDef else ("def",)
            elif t is ast.Import:
                for a in node.names:
                    names[a.asname or a.name.split(".")[0]] = ("module", a.name if a.asname else a.name.split(".")[0])
            elif t is ast.ImportFrom:
                base = self._absolute(node.module, node.level)
                for a in node.names:
                    if a.name != "*":
                        names[a.asname or a.name] = ("from", base, a.name) if base else ("other",)
            elif t is ast.If or t is ast.Try:
                for block in (node.body, *getattr(node, "handlers", ()), node.orelse, getattr(node, "finalbody", ())):
                    self._names(block.body if type(block) is ast.ExceptHandler else block)
            elif t is ast.Assign or t is ast.AnnAssign or t is ast.AugAssign:
                for sub in ast.walk(node):
                    if type(sub) is ast.Name and type(sub.ctx) is ast.Store:
                        names[sub.id] = ("other",)
                if t is ast.Assign and len(node.targets) == 1 and type(node.targets[0]) is ast.Name \
                        and type(node.value) is ast.Call and _dotted(node.value.func) in ("TypeVar", "typing.TypeVar"):
                    names[node.targets[0].id] = ("typevar",)  # ``ImplT = TypeVar("ImplT")``: reach.py's generics
                target = node.targets[0] if t is ast.Assign and len(node.targets) == 1 else \
                    node.target if t is ast.AnnAssign else None
                if type(target) is ast.Name and type(node.value) is ast.Dict:
                    entries = _entries(node.value.keys, node.value.values)
                    if entries:
                        names[target.id] = ("table", entries)
                elif type(target) is ast.Subscript and type(target.value) is ast.Name \
                        and names.get(target.value.id, ("",))[0] == "table":  # TABLE["key"] = f
                    added = _entries([target.slice], [node.value])
                    if added:
                        names[target.value.id] = ("table", names[target.value.id][1] + added)

    def _absolute(self, module: Optional[str], level: int) -> Optional[str]:
        if not level:
            return module
        package = self.facts.package
        for _ in range(level - 1):
            package = package.rpartition(".")[0] if package else None
        if not package:
            return None
        return f"{package}.{module}" if module else package

    def _index(self, body, prefix: str, cls: Optional[str]) -> None:
        for node in body:
            t = type(node)
            if t is ast.ClassDef:
                qual = prefix + node.name
                methods = {item.name: 0 if any(_dotted(d) == "staticmethod" for d in item.decorator_list) else 1
                           for item in node.body if type(item) in (ast.FunctionDef, ast.AsyncFunctionDef)}
                self.facts.classes.setdefault(qual, (tuple(filter(None, map(_base, node.bases))), methods))
                self.class_nodes.setdefault(qual, node)
                self.facts.spans.setdefault(qual, _lines_of(node))
                forward = next((i for i in node.body if type(i) is ast.FunctionDef and i.name == "forward"), None)
                if forward is not None and not _may_dispatch(forward):
                    self.facts.plain.add(qual)
                self._index(node.body, qual + ".", qual)
            elif t is ast.FunctionDef or t is ast.AsyncFunctionDef:
                self.defs[prefix + node.name] = (node, cls)
                self.facts.spans[prefix + node.name] = _lines_of(node)
                if cls is None:
                    for name in _custom_op_names(node):
                        self.facts.ops.setdefault(name, prefix + node.name)
            elif t is ast.Expr and type(node.value) is ast.Call and cls is None:
                registered = _registered_op(node.value)  # direct_register_custom_op(op_name=..., op_func=f)
                if registered is not None:
                    self.facts.ops.setdefault(*registered)

    # -- the roots -------------------------------------------------------------------------------------
    def roots(self, body, scope: list, owner, funcs: list, method, context: bool) -> None:
        """``owner``: (name, qualname or None, node) of the class whose body this is; ``funcs``: enclosing defs,
        innermost last; ``method``: (name of self, class qualname) of the innermost enclosing method;
        ``context``: this runs per layer (as GL104's visitor decides)."""
        for node in body:
            t = type(node)
            if t is ast.ClassDef:
                qual = ".".join([*scope, node.name]) if not funcs else None
                self.roots(node.body, [*scope, node.name], (node.name, qual, node), funcs, method, context)
                continue
            if t is ast.FunctionDef or t is ast.AsyncFunctionDef:
                if owner is not None and owner[1] is not None and not funcs and self._layer_def(owner, node) \
                        and self._opens(owner[2]):
                    self.facts.places.append(f"{owner[1]}.{node.name}")
                elif not funcs and not scope and node.name in self._registered():
                    self.facts.places.append(node.name)
                if not self._names_metadata(node):
                    continue  # no argument of a call in it can derive from metadata
                inner = method
                if owner is not None:
                    first = (node.args.posonlyargs + node.args.args)[:1]
                    bound = owner[1] is not None and self.facts.classes[owner[1]][1].get(node.name)
                    inner = (first[0].arg, owner[1]) if first and bound else None
                layer = owner is not None and self._layer_def(owner, node)
                layer = layer or node.name in self._registered()
                self.roots(node.body, [*scope, node.name], None, [*funcs, node], inner, context or layer)
                continue
            inner_context = context or ((t is ast.For or t is ast.AsyncFor) and _loops_over_layers(node.iter))
            for _, value in ast.iter_fields(node):
                if type(value) is list and value and isinstance(value[0], (ast.stmt, ast.excepthandler,
                                                                           ast.match_case)):
                    for block in ([value] if isinstance(value[0], ast.stmt) else [h.body for h in value]):
                        self.roots(block, scope, None, funcs, method, inner_context)
                elif inner_context:
                    for item in value if type(value) is list else (value,):
                        if isinstance(item, ast.AST):
                            self._calls_in(item, scope, funcs, method)

    def _opens(self, cls: ast.ClassDef) -> bool:
        """The class calls a member that something else than a constructor of this file's classes (or of a package
        outside the tree and the pinned engines) may have made: a typed factory's, an annotation's, a class of
        another module of the tree. Only such a layer can reach code bound at run time (``reach.py``)."""
        key = (id(cls), "opens")
        if key in self._targets:
            return self._targets[key]
        top = (self._module_name or "").split(".")[0]
        opened: set = set()
        called: set = set()
        method: Any
        n: Any
        for method in cls.body:
            if type(method) not in (ast.FunctionDef, ast.AsyncFunctionDef):
                continue
            first = (method.args.posonlyargs + method.args.args)[:1]
            this = first[0].arg if first else None
            for n in ast.walk(method):
                t = type(n)
                if t is ast.Assign or t is ast.AnnAssign:
                    for target in n.targets if t is ast.Assign else [n.target]:
                        if type(target) is ast.Attribute and type(target.value) is ast.Name \
                                and target.value.id == this and (t is ast.AnnAssign or self._open_value(n.value, top)):
                            opened.add(target.attr)
                elif t is ast.Call:
                    func = n.func.value if type(n.func) is ast.Attribute else None
                    member = func if type(func) is ast.Attribute else n.func
                    if type(member) is ast.Attribute and type(member.value) is ast.Name and member.value.id == this:
                        called.add(member.attr)
        self._targets[key] = bool(opened & called)
        return self._targets[key]

    def _open_value(self, value: Any, top: str) -> bool:
        """``value`` may make an object whose class another fact than its own text tells (``_opens``)."""
        if type(value) is not ast.Call:
            return False
        dotted = _dotted(value.func)
        if dotted is None:
            return True  # T[key](...), f()(...)
        binding = self.facts.names.get(dotted.split(".")[0])
        if binding == ("class",):
            return False
        if binding is not None and binding[0] in ("module", "from"):
            return binding[1].split(".")[0] == top or engine_of(binding[1]) is not None
        return True  # a parameter, a local, self.<member>, a def of this file

    def _layer_def(self, owner: tuple, node: Any) -> bool:
        """``node`` is the forward (or a method its forward dispatches to) of the layer class ``owner``."""
        return (node.name == "forward" or node.name.startswith("forward_")) \
            and is_layer_class(owner[0], [b for b in map(_dotted, owner[2].bases) if b]) \
            and (node.name == "forward" or node.name in self._dispatched(owner))

    def _calls_in(self, expr: ast.AST, scope: list, funcs: list, method) -> None:
        taint = None
        for node in ast.walk(expr):
            if type(node) is not ast.Call or type(node.func) not in _CALLEE_FORMS:
                continue
            taint = taint or self._taint(funcs[-1] if funcs else None)
            args = list(takewhile(_not_starred, node.args))
            positions = tuple(i for i, arg in enumerate(args) if _derives(arg, taint))
            keywords = tuple(k.arg for k in node.keywords if k.arg and _derives(k.value, taint))
            ref = self._ref(node.func, funcs, method) if positions or keywords else None
            callee = callee_text(node.func)
            if ref is not None and callee is not None and ref[0] == "each" and funcs:
                made = self._value_roots(funcs[-1], node, scope, method)
                positions = tuple(sorted({*positions, *(i for i, a in enumerate(args) if _name_of(a) in made)}))
                keywords = tuple(k.arg for k in node.keywords if k.arg and (
                    k.arg in keywords or _name_of(k.value) in made))
            if ref is not None and callee is not None:
                given = tuple(i for i, a in enumerate(args) if not _is_none(a)) \
                    + tuple(k.arg for k in node.keywords if k.arg and not _is_none(k.value))
                fixed = self._fixed_params(funcs[-1]) if funcs else frozenset()
                passed_on = tuple(i for i in positions if _name_of(args[i]) in fixed) \
                    + tuple(k.arg for k in node.keywords if k.arg in keywords and type(k.value) is ast.Name
                            and k.value.id in fixed)
                self.facts.roots.append(Root(".".join(scope), callee, ref, positions, keywords, given,
                                             (node.lineno, node.col_offset + 1), passed_on))

    def _taint(self, func) -> Callable:
        """What ``_derives`` asks of ``func`` (the prefilter's ``_tainted``), once a def."""
        key = id(func)
        if key not in self._taints:
            kernels, lines = self._kernels()
            seeds = offset_params(func, kernels) if func is not None and holds_a_call(func, lines) else frozenset()
            value = _tainted(func, seeds) if func is not None else _NO_TAINT
            self._taints[key] = lambda: value
        return self._taints[key]

    def _registered(self) -> dict:
        """The defs this file registers in an attention registry (``registries``): per-layer places."""
        if self._registered_defs is None:
            self._registered_defs = registered(ast.Module(body=self._body, type_ignores=[])) \
                if may_register(self.data) else {}
        return self._registered_defs

    def _kernels(self) -> tuple:
        """The known varlen kernels this file's imports bind (``kernel_facts``) and the lines of their calls, once
        a file."""
        if self._kernel_names is None:
            kernels = kernels_of(self._body, self._module_name, self._is_package) if may_call_kernel(self.data) \
                else {}
            self._kernel_names = (kernels, call_lines(ast.Module(body=self._body, type_ignores=[]), kernels))
        return self._kernel_names

    def _names_metadata(self, func) -> bool:
        """The text of ``func`` holds a GL104 needle: only then can a value in it derive from metadata."""
        start, end = _span(self._lines(), func.lineno, func.end_lineno or func.lineno)
        spec = PATTERNS[HOST_SYNC]
        return spec.needle_pattern is None or spec.needle_pattern.search(self.data, start, end) is not None \
            or any(self.data.find(n, start, end) != -1 for n in spec.more_needles)

    def _lines(self) -> list:
        if self._starts is None:
            self._starts = _line_starts(self.data)
        return self._starts

    def _ref(self, func: Any, funcs: list, method) -> Optional[Ref]:
        table = _table_lookup(func)
        if table is not None:
            return None if any(table in self._bound(f) for f in funcs) else ("table", table)
        t = type(func)
        if t is ast.Name:
            member = self._loop_member(funcs[-1], func.id, method[0]) if funcs and method is not None else None
            if member is not None:  # ``for blk in self.blocks: blk(...)``
                return ("each", method[1], member)
            if any(func.id in self._bound(f) for f in funcs):
                # ``fn = TABLE[key]`` and nothing else binds fn: a call of fn is a call of an entry
                table = self._bound_table(funcs[-1], func.id) if funcs else None
                return ("table", table) if table is not None and not any(
                    table in self._bound(f) for f in funcs) else None
            return ("name", func.id)
        base = _dotted(func.value) if t is ast.Attribute else None
        if base is None:
            return None
        if method is not None and base == method[0]:
            return ("self", method[1], func.attr)
        if any(base.split(".")[0] in self._bound(f) for f in funcs):
            return None
        return ("attr", base, func.attr)

    def _value_roots(self, func: Any, call: ast.Call, scope: list, method) -> set:
        """The calls of ``func`` whose result alone is assigned to a name the layer-loop call ``call`` hands
        on (``m = self.compute_max(cu)``), as value roots (once per def); the names so assigned."""
        handed = {a.id for a in (*call.args, *(k.value for k in call.keywords)) if type(a) is ast.Name}
        key = (id(func), "values")
        done = self._loops.setdefault(key, {})
        taint = self._taint(func)
        made: set = set()
        for node in ast.walk(func):
            if type(node) is not ast.Assign or len(node.targets) != 1 or type(node.targets[0]) is not ast.Name \
                    or node.targets[0].id not in handed or type(node.value) is not ast.Call or node.value is call:
                continue
            if id(node) in done:
                if done[id(node)]:
                    made.add(node.targets[0].id)
                continue
            done[id(node)] = False
            value = node.value
            ref = self._ref(value.func, [func], method) if type(value.func) in _CALLEE_FORMS else None
            callee = callee_text(value.func)
            args = list(takewhile(_not_starred, value.args))
            positions = tuple(i for i, arg in enumerate(args) if _derives(arg, taint))
            keywords = tuple(k.arg for k in value.keywords if k.arg and _derives(k.value, taint))
            if ref is not None and callee is not None and (positions or keywords):
                self.facts.roots.append(Root(".".join(scope), callee, ref, positions, keywords, (),
                                             (value.lineno, value.col_offset + 1), (), True))
                done[id(node)] = True
                made.add(node.targets[0].id)
        return made

    def _fixed_params(self, func: Any) -> frozenset:
        """The parameters of ``func`` its body stores to nowhere but where they are None (the body of
        ``if p is None:``): what they hold when given is what the caller gave."""
        key = (id(func), "")
        if key not in self._loops:
            a = func.args
            params = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
            stores = [n for n in ast.walk(func) if type(n) is ast.Name and type(n.ctx) is not ast.Load]
            defaults = set()
            n: Any
            for n in ast.walk(func):
                test = n.test if type(n) is ast.If else None
                if type(test) is ast.Compare and type(test.left) is ast.Name and len(test.ops) == 1 \
                        and type(test.ops[0]) is ast.Is and _is_none(test.comparators[0]):
                    defaults |= {id(m) for stmt in n.body for m in ast.walk(stmt)
                                 if type(m) is ast.Name and m.id == test.left.id}
            self._loops[key] = frozenset(params - {n.id for n in stores if id(n) not in defaults})
        return self._loops[key]

    def _loop_member(self, func: Any, name: str, this: str) -> Optional[str]:
        """``_loop_member``, once per def and name."""
        key = (id(func), name)
        if key not in self._loops:
            self._loops[key] = _loop_member(func, name, this) if name in self._bound(func) else None
        return self._loops[key]

    def _bound_table(self, func: Any, name: str) -> Optional[str]:
        """``_bound_to_table``, once per def and name."""
        key = (id(func), name)
        if key not in self._tables:
            self._tables[key] = _bound_to_table(func, name)
        return self._tables[key]

    def _bound(self, func: Any) -> frozenset:
        """Names ``func`` binds (parameters, assignments, imports, inner defs): they hide the module's."""
        got = self._bindings.get(id(func))
        if got is None:
            a = func.args
            names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None}
            declared = set()
            node: Any
            for node in ast.walk(func):
                t = type(node)
                if t is ast.Name and type(node.ctx) is not ast.Load:
                    names.add(node.id)
                elif (t is ast.FunctionDef or t is ast.AsyncFunctionDef or t is ast.ClassDef) and node is not func:
                    names.add(node.name)
                elif t is ast.Import or t is ast.ImportFrom:
                    names.update((al.asname or al.name).split(".")[0] for al in node.names)
                elif t is ast.ExceptHandler and node.name:
                    names.add(node.name)
                elif t is ast.Global:
                    declared.update(node.names)
            got = self._bindings[id(func)] = frozenset(names - declared)
        return got

    def _dispatched(self, owner: tuple) -> frozenset:
        """The methods a call of the top-level class ``owner`` runs in place of its forward, where that
        forward dispatches (``engine_defs.forward_targets``, read from the definitions the file reaches)."""
        node = owner[2]
        if id(node) not in self._targets:
            from . import engine_defs

            got = None
            if owner[1] is not None and "." not in owner[1]:
                classes = {c.name: c for c in self._body if type(c) is ast.ClassDef}
                got = engine_defs.forward_targets(node, classes, engine_defs.imports_of(self._body),
                                                  self.facts.module, self.facts.module == self.facts.package,
                                                  self.facts.path)
            self._targets[id(node)] = got or frozenset()
        return self._targets[id(node)]

    # -- functions -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Sketches the functions of this file its roots reach without leaving it (``build`` goes on), and
        reads the members of the classes whose held modules the roots call (and of the file's classes those
        hold, in turn)."""
        owners = [r.ref[1] for r in self.facts.roots if r.ref[0] in ("self", "each")]
        while owners:
            cls = owners.pop()
            if cls in self.facts.members or cls not in self.class_nodes:
                continue
            got = self.facts.members[cls] = _members(self.class_nodes[cls])
            owners.extend(written for made in got.values() for _, written in made if written in self.class_nodes)
        todo = [r.ref for r in self.facts.roots]
        seen: set = set()
        while todo:
            ref = todo.pop()
            local = self._local(ref)
            for qual in [local] if local is not None else self._held_local(ref):
                if qual not in seen:
                    seen.add(qual)
                    fn = self.function(qual)
                    todo.extend(fn.calls.values() if fn is not None else ())

    def _held_local(self, ref: Ref) -> list:
        """The forwards of this file's classes that a held module of ``ref`` runs, where a class of this file
        constructs it and defines a forward that dispatches to nothing (the run reads the rest)."""
        if ref[0] not in ("self", "each") or ref[1] not in self.facts.members:
            return []
        kind = "one" if ref[0] == "self" else "each"
        made = self.facts.members[ref[1]].get(ref[2], ())
        return [f"{written}.forward" for k, written in made
                if k == kind and written in self.facts.plain and f"{written}.forward" in self.defs]

    def _local(self, ref: Ref) -> Optional[str]:
        if ref[0] == "table":
            return None  # (its entries are sketched when the run resolves them)
        if ref[0] == "name":
            return ref[1] if self.facts.names.get(ref[1]) == ("def",) else None
        cls, seen = ref[1] if ref[0] == "self" else None, set()
        while cls in self.facts.classes and cls not in seen:
            seen.add(cls)
            bases, methods = self.facts.classes[cls]
            if ref[2] in methods:
                return f"{cls}.{ref[2]}"
            cls = next((b for b in bases if b in self.facts.classes), None)
        return None

    def function(self, qual: str) -> Optional[FuncFacts]:
        got = self.facts.functions.get(qual)
        if got is not None or qual not in self.defs:
            return got
        node, cls = self.defs[qual]
        a = node.args
        positional = tuple(p.arg for p in (*a.posonlyargs, *a.args))
        bound = self.facts.classes[cls][1].get(node.name, 0) if cls is not None else 0
        method = (positional[0], cls) if bound and positional else None
        params = frozenset(positional[bound:]) | {p.arg for p in a.kwonlyargs}
        calls: dict = {}
        forwards: set = set()
        used: set = set()
        kernel: set = set()
        passes: dict = {}
        fixed = self._fixed_params(node) & params
        metadata_calls: set = set()
        taint = self._taint(node)
        for sub in _own_nodes(node):
            t = type(sub)
            if t is ast.Name:
                used.add(sub.id)
            elif t is ast.Call:
                ref = self._ref(sub.func, [node], method)
                text = callee_text(sub.func)
                if ref is not None and text is not None:
                    calls[text] = ref
                    if any(_derives(a, taint) for a in (*sub.args, *(k.value for k in sub.keywords))):
                        metadata_calls.add(text)
                    passes[text] = (tuple(a.id if type(a) is ast.Name and a.id in fixed else None
                                          for a in takewhile(_not_starred, sub.args)),
                                    {k.arg: k.value.id for k in sub.keywords
                                     if k.arg and type(k.value) is ast.Name and k.value.id in fixed})
                elif ref is None and (_dotted(sub.func) or "").split(".", 1)[0] not in _NOT_KERNELS | {""}:
                    kernel.update(a.id for a in (*sub.args, *(k.value for k in sub.keywords))
                                  if type(a) is ast.Name and a.id in fixed)
                for k in sub.keywords:
                    name = k.value.id if type(k.value) is ast.Name else None
                    if k.arg is None and a.kwarg is not None and name == a.kwarg.arg:
                        forwards.add("**")
                    elif k.arg in params and name == k.arg:
                        forwards.add(k.arg)
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        last = node.end_lineno or node.lineno
        reads = _READ.search(self.data, *_span(self._lines(), node.lineno, last)) is not None
        fn = self.facts.functions[qual] = FuncFacts(
            qual, node.lineno, (first, last), positional, params, a.kwarg.arg if a.kwarg else None, bound, reads,
            calls, frozenset(forwards), frozenset(_required(node) & params), params - used, frozenset(kernel), passes,
            frozenset(metadata_calls))
        return fn


_CALLEE_FORMS = (ast.Name, ast.Attribute, ast.Subscript, ast.Call)  # f(), m.f(), T[key](), T.get(key)()


def _lines_of(node: Any) -> tuple:
    """(first line, decorators included; last line) of a def or class."""
    return (min([node.lineno, *(d.lineno for d in node.decorator_list)]), node.end_lineno or node.lineno)


def _segment(data: bytes, span: tuple) -> Optional[Any]:
    """The def or class whose lines ``span`` gives, parsed alone, its line numbers those of the file (None where
    its text does not parse alone)."""
    starts = _line_starts(data)
    if span[1] >= len(starts):
        return None
    text = data[starts[span[0] - 1]:starts[span[1]]]
    indented = text[:1] in (b" ", b"\t")
    try:
        module: Any = ast.parse(b"if 1:\n" + text if indented else text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    node: Any = module.body[0].body[0] if indented else module.body[0]
    ast.increment_lineno(node, span[0] - 1 - indented)
    return node


def _installs(tree: ast.Module, absolute: Callable, spans: dict) -> list:
    """(def name, module a def-local import takes it from or None, line, target as written, qualname of a def nested
    in a def or None) of each def the module installs as the forward of a layer: of a layer class (``Cls.forward =
    f``, ``mod.Cls.forward = f``, ``setattr(Cls, "forward", f)``), or of an object reached from the element of a loop
    over layers (``for layer in model.layers: impl = layer.attn.impl; impl.forward = ...``); ``f`` a name, or
    wrapped in ``types.MethodType(f, ...)`` / ``functools.partial(f, ...)``. The lines of a nested def so installed
    go to ``spans`` (the walk reads it from there)."""
    walk = _InstallWalk(absolute, spans)
    walk.body(tree.body, {}, set(), {}, "", False)
    return walk.out


class _InstallWalk:
    def __init__(self, absolute: Callable, spans: dict):
        self.absolute, self.spans = absolute, spans
        self.out: list = []

    def body(self, stmts, imports: dict, layers: set, nested: dict, scope: str, in_def: bool) -> None:
        """``layers``: names bound to a layer (or to what is reached from one) here; ``nested``: name -> (qualname,
        lines) of the defs this def defines so far."""
        layers = set(layers)
        for node in stmts:
            t = type(node)
            if t is ast.FunctionDef or t is ast.AsyncFunctionDef:
                qual = f"{scope}.{node.name}" if scope else node.name
                if in_def:
                    nested[node.name] = (qual, _lines_of(node))
                local = dict(imports)
                for sub in ast.walk(node):
                    if type(sub) is ast.ImportFrom:
                        base = self.absolute(sub.module, sub.level)
                        for a in sub.names:
                            if base:
                                local[a.asname or a.name] = (base, a.name)
                self.body(node.body, local, set(), {}, qual, True)
                continue
            if t is ast.ClassDef:
                self.body(node.body, imports, set(), {}, f"{scope}.{node.name}" if scope else node.name, False)
                continue
            if (t is ast.For or t is ast.AsyncFor) and _loops_over_layers(node.iter):
                self.body(node.body, imports, layers | {n.id for n in ast.walk(node.target) if type(n) is ast.Name},
                          nested, scope, in_def)
                self.body(node.orelse, imports, layers, nested, scope, in_def)
                continue
            if t is ast.Assign and len(node.targets) == 1 and type(node.targets[0]) is ast.Name \
                    and (_dotted(node.value) or "").split(".")[0] in layers:
                layers.add(node.targets[0].id)
            self._install(node, imports, layers, nested)
            for _, value in ast.iter_fields(node):
                if type(value) is list and value and isinstance(value[0], ast.stmt):
                    self.body(value, imports, layers, nested, scope, in_def)
                elif type(value) is list and value and type(value[0]) is ast.ExceptHandler:
                    for h in value:
                        self.body(h.body, imports, layers, nested, scope, in_def)

    def _install(self, node: Any, imports: dict, layers: set, nested: dict) -> None:
        t = type(node)
        target = value = None
        if t is ast.Assign and len(node.targets) == 1 and type(node.targets[0]) is ast.Attribute \
                and node.targets[0].attr == "forward":
            target, value = _dotted(node.targets[0].value), node.value
        elif t is ast.Expr and type(node.value) is ast.Call and _dotted(node.value.func) == "setattr" \
                and len(node.value.args) == 3 and type(node.value.args[1]) is ast.Constant \
                and node.value.args[1].value == "forward":
            target, value = _dotted(node.value.args[0]), node.value.args[2]
        if target is None or not (is_layer_class(target.rpartition(".")[2]) or target.split(".")[0] in layers):
            return
        if type(value) is ast.Call and value.args and (_dotted(value.func) or "").rpartition(".")[2] in (
                "MethodType", "partial"):
            value = value.args[0]
        if type(value) is not ast.Name:
            return
        if value.id in nested:
            qual, lines = nested[value.id]
            self.spans.setdefault(qual, lines)
            self.out.append((value.id, None, node.lineno, f"{target}.forward", qual))
            return
        module = imports.get(value.id, (None,))[0]
        name = imports[value.id][1] if module is not None else value.id
        self.out.append((name, module, node.lineno, f"{target}.forward", None))


_CONTAINERS = ("ModuleList", "Sequential")  # torch.nn containers whose elements a loop over them calls


def _base(node: Any) -> Optional[str]:
    """A class's base as written, a generic one by its class (``AttentionImpl`` of ``AttentionImpl[Meta]``)."""
    return _dotted(node.value if type(node) is ast.Subscript else node)


def _may_dispatch(forward: Any) -> bool:
    """A forward whose body (docstring aside) is one ``return <receiver>.<attribute>(...)``: it may call the
    method its instance picked (``engine_defs._dispatch`` decides)."""
    body = [b for b in forward.body if not (type(b) is ast.Expr and type(b.value) is ast.Constant)]
    return len(body) == 1 and type(body[0]) is ast.Return and type(body[0].value) is ast.Call \
        and type(body[0].value.func) is ast.Attribute


def _name_of(node: Any) -> Optional[str]:
    return node.id if type(node) is ast.Name else None


def _loop_member(func: Any, name: str, this: str) -> Optional[str]:
    """``X`` where ``name`` is bound in ``func`` only as the element of a loop over ``self.X`` (``for blk in
    self.blocks``, ``for i, blk in enumerate(self.blocks)``), ``this`` being the method's ``self``."""
    found, stores = None, 0
    node: Any
    for node in ast.walk(func):
        t = type(node)
        if t is ast.Name and node.id == name and type(node.ctx) is not ast.Load:
            stores += 1
        elif (t is ast.For or t is ast.AsyncFor) and found is None:
            target, it = node.target, node.iter
            if type(it) is ast.Call and _dotted(it.func) == "enumerate" and len(it.args) == 1 \
                    and type(target) is ast.Tuple and len(target.elts) == 2:
                target, it = target.elts[1], it.args[0]
            if type(target) is ast.Name and target.id == name and type(it) is ast.Attribute \
                    and type(it.value) is ast.Name and it.value.id == this:
                found = it.attr
    return found if stores == 1 else None


def _constructed(value: Any) -> Optional[tuple]:
    """(kind, constructor as written) of a value stored in an attribute: ``Cls(...)`` -> ("one", "Cls");
    ``[Cls(...) for ...]``, ``[Cls(...), ...]`` or either in ``nn.ModuleList(...)`` -> ("each", "Cls")."""
    t = type(value)
    if t is ast.Call:
        name = _dotted(value.func)
        if name is None:
            return None
        if name.rpartition(".")[2] in _CONTAINERS and len(value.args) == 1 and not value.keywords:
            inner = _constructed(value.args[0])
            return ("each", inner[1]) if inner is not None and inner[0] == "each" else None
        return ("one", name)
    if t is ast.ListComp and type(value.elt) is ast.Call:
        name = _dotted(value.elt.func)
        return ("each", name) if name is not None else None
    if t is ast.List and value.elts and all(type(e) is ast.Call for e in value.elts):
        names = {_dotted(e.func) for e in value.elts}
        return ("each", names.pop()) if len(names) == 1 and None not in names else None
    return None


def _members(cls: ast.ClassDef) -> dict:
    """``FileFacts.members`` of one class: the constructor calls its methods store in ``self.<attribute>``
    (every one where branches store different ones)."""
    out: dict = {}
    item: Any
    for item in cls.body:
        if type(item) not in (ast.FunctionDef, ast.AsyncFunctionDef):
            continue
        params = item.args.posonlyargs + item.args.args
        if not params or any(_dotted(d) in ("staticmethod", "classmethod") for d in item.decorator_list):
            continue
        this = params[0].arg
        for node in ast.walk(item):
            if type(node) is ast.Assign and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif type(node) is ast.AnnAssign and node.value is not None:
                target, value = node.target, node.value
            else:
                continue
            if type(target) is ast.Attribute and type(target.value) is ast.Name and target.value.id == this:
                made = _constructed(value)
                if made is not None:
                    out.setdefault(target.attr, set()).add(made)
    return {k: frozenset(v) for k, v in out.items()}


def _registered_op(call: ast.Call) -> Optional[tuple]:
    """(op name, def name) of a module-level registration naming both by keyword, as vLLM's
    ``direct_register_custom_op(op_name="x", op_func=x, ...)`` does."""
    got = {k.arg: k.value for k in call.keywords if k.arg in ("op_name", "op_func")}
    name, func = got.get("op_name"), got.get("op_func")
    if type(name) is ast.Constant and isinstance(name.value, str) and type(func) is ast.Name:
        return name.value, func.id
    return None


def _custom_op_names(func: Any) -> list:
    """The op names a def is registered as by its decorators: ``@torch.library.custom_op("ns::name", ...)``
    (or ``@custom_op(...)``)."""
    out = []
    for d in func.decorator_list:
        if type(d) is ast.Call and (_dotted(d.func) or "").rpartition(".")[2] == "custom_op" and d.args \
                and type(d.args[0]) is ast.Constant and isinstance(d.args[0].value, str):
            out.append(d.args[0].value.rpartition("::")[2])
    return out


def _entries(keys, values) -> tuple:
    """The function entries of a dict display (or of ``TABLE[key] = value``): ((key as written, Ref), ...) for
    the values that name a function (``f``, ``mod.f``)."""
    out = []
    for key, value in zip(keys, values):
        text = repr(key.value) if type(key) is ast.Constant else "..."
        name = _dotted(value) if type(value) in (ast.Name, ast.Attribute) else None
        if name is not None:
            base, _, attr = name.rpartition(".")
            out.append((text, ("attr", base, attr) if base else ("name", name)))
    return tuple(out)


def _table_lookup(func) -> Optional[str]:
    """``T`` of a callee ``T[key]`` or ``T.get(key, ...)`` where T is a plain name."""
    t = type(func)
    if t is ast.Subscript and type(func.value) is ast.Name:
        return func.value.id
    if t is ast.Call and type(func.func) is ast.Attribute and func.func.attr == "get" \
            and type(func.func.value) is ast.Name and func.args:
        return func.func.value.id
    return None


def _bound_to_table(func, name: str) -> Optional[str]:
    """``T`` where every binding of ``name`` in ``func`` (its own body) is ``name = T[key]`` or ``name =
    T.get(key)``, one T; None for a parameter or anything else."""
    a = func.args
    if name in {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None}:
        return None
    tables, stores, assigned = set(), 0, 0
    for node in _own_nodes(func):
        t = type(node)
        if t is ast.Assign and any(type(x) is ast.Name and x.id == name for x in node.targets):
            assigned += 1
            tables.add(_table_lookup(node.value) if len(node.targets) == 1 else None)
        elif t is ast.Name and type(node.ctx) is not ast.Load and node.id == name:
            stores += 1
    return tables.pop() if stores == assigned and len(tables) == 1 else None


def callee_text(func) -> Optional[str]:
    """A callee as written, the key of a call in the summaries' tables: ``f``, ``self.m``, ``mod.f``, and
    ``T[]`` for ``T[key]`` and ``T.get(key)`` (``host_sync.callee_text`` says the same of libcst's nodes)."""
    table = _table_lookup(func)
    return f"{table}[]" if table is not None else _dotted(func)


def _line_starts(data: bytes) -> list:
    """Offsets of the lines as CPython numbers them (``\\n``, ``\\r\\n`` and ``\\r`` end one), and the end."""
    return [0, *accumulate(map(len, data.splitlines(keepends=True)))]


def _span(starts: list, first: int, last: int) -> tuple:
    """The offsets of lines ``first`` to ``last`` (1-based, inclusive)."""
    return starts[min(first - 1, len(starts) - 1)], starts[min(last, len(starts) - 1)]


def _own_nodes(func):
    """The nodes of ``func``'s body, not those of the functions, lambdas and classes defined in it."""
    stack = list(func.body)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(c for c in ast.iter_child_nodes(node)
                     if type(c) not in (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))


def _required(func) -> set:
    """Names ``func`` refuses when None: ``if p is None: raise ...`` (alone or in an ``or``) and ``assert p
    is not None`` or ``assert p`` (alone or in an ``and``), anywhere in its own body."""
    out: set = set()
    for node in _own_nodes(func):
        t = type(node)
        if t is ast.If and any(type(s) is ast.Raise for s in node.body):
            test = node.test
            for part in test.values if type(test) is ast.BoolOp and type(test.op) is ast.Or else [test]:
                if type(part) is ast.Compare and type(part.ops[0]) is ast.Is and len(part.ops) == 1 \
                        and type(part.left) is ast.Name and _is_none(part.comparators[0]):
                    out.add(part.left.id)
        elif t is ast.Assert:
            test = node.test
            for part in test.values if type(test) is ast.BoolOp and type(test.op) is ast.And else [test]:
                if type(part) is ast.Name:
                    out.add(part.id)
                elif type(part) is ast.Compare and type(part.ops[0]) is ast.IsNot and len(part.ops) == 1 \
                        and type(part.left) is ast.Name and _is_none(part.comparators[0]):
                    out.add(part.left.id)
    return out


def _is_none(node) -> bool:
    return type(node) is ast.Constant and node.value is None


def _not_starred(node) -> bool:
    return type(node) is not ast.Starred


# -- summaries across the tree -----------------------------------------------------------------------
@dataclass(frozen=True)
class Read:
    """How a parameter is read on the host: ``kind`` (``.item()``, ``int()``...), the functions from the
    summarised one down to the read, each (name, path, line of its call of the next or of the read, and the
    table entry it was reached as: ``VL_VISION_ATTENTION_FUNCTIONS['flash_attention_2']``, or ""), and the
    parameters whose passing (not None) spares the read (it is on a path taken when they are None)."""

    kind: str
    path: tuple
    unless: frozenset = frozenset()
    held: bool = False  # the path goes through a module a caller holds (``Callee.held``)
    # the read is inside the engine's own allowance for a sync (``with gpu_sync_allowed():``): known to its
    # maintainers, so a caller that passes on what it was given is not reported, one that makes the device
    # value is
    allowed: bool = False

    def via(self) -> str:
        return " -> ".join(f"`{name}()`{f' (as {entry})' if entry else ''} in {path}:{line}"
                           for name, path, line, entry in self.path)


@dataclass(frozen=True)
class Summary:
    name: str
    path: str
    line: int
    params: tuple  # positional, in order
    keywords: frozenset
    kwargs: Optional[str]
    reads: dict  # parameter (or a keyword that **kwargs takes and passes on) -> Read
    forwards: frozenset
    requires: frozenset
    ignores: frozenset
    source: str = ""  # where the function is not the tree's: the label of the engine source it was read from
    # parameters it (or a callee) hands to a kernel the summaries cannot follow: it needs them on the device,
    # so a host read of one on another path is its own cost, which no caller can spare
    uses: frozenset = frozenset()


@dataclass(frozen=True)
class Returns:
    """What a call's definition returns: a device value derived from the arguments it binds to ``params``
    (of the definition's ``all_params``, the first ``skip`` bound by the call form itself)."""

    all_params: tuple
    skip: int
    params: frozenset

    def bind(self, args) -> list:
        """The arguments (libcst ``Arg``s) of a call that fill the returned parameters."""
        out = []
        at: Optional[int] = self.skip
        for arg in args:
            if arg.keyword is not None:
                if arg.keyword.value in self.params:
                    out.append(arg.value)
            elif arg.star:
                at = None
            elif at is not None:
                if at < len(self.all_params) and self.all_params[at] in self.params:
                    out.append(arg.value)
                at += 1
        return out


@dataclass(frozen=True)
class Callee:
    """What a call resolves to: its definition's summary, the leading parameters the call form binds
    itself (``self`` of ``self.m(...)``), and the table entry the call reaches it as (``T['key']``, or "")."""

    summary: Summary
    skip: int
    entry: str = ""
    # reached through a module the caller holds (``self.attn(...)``): only an argument the calling function
    # makes counts, not a parameter it passes on (that value's device is its caller's fact, judged there)
    held: bool = False
    # a held module's forward in the scanned tree: a per-layer place GL104 checks itself, where a parameter
    # named as metadata is taken for device metadata (``values.seed``): its reads of one are reported there,
    # and only those beyond a module it holds in turn (``Read.held``) are this call's
    deep: bool = False

    def bind(self, args) -> dict:
        """The parameter each argument of a call (libcst ``Arg``s) fills -> the argument's value; positions
        past a ``*args`` are not known."""
        s, out = self.summary, {}
        at: Optional[int] = self.skip
        for arg in args:
            if arg.keyword is not None:
                name = arg.keyword.value
                if name in s.keywords or (s.kwargs is not None and name in s.reads):
                    out[name] = arg.value
            elif arg.star:
                at = None if arg.star == "*" else at
            elif at is not None:
                if at < len(s.params):
                    out[s.params[at]] = arg.value
                at += 1
        return out


class Summaries:
    """The summaries of the functions that the roots of ``facts`` reach, across the files ``files``."""

    def __init__(self, facts: list, files, read: Callable[[str], bytes], read_all: Optional[Callable] = None):
        self._files = {os.path.normpath(p): p for p in files}
        self._read = read
        # ``read_facts`` of each (file's bytes, FuncFacts), in order (the run's workers may do it)
        self._read_all = read_all or (lambda items: [read_facts(*item) for item in items])
        self._by_path = {os.path.normpath(f.path): f for f in facts}
        self._by_module = {f.module: f for f in facts if f.module}
        self._sketches: dict = {}  # normalised path -> _Sketch of a file parsed here
        self._package_roots: dict = {}  # folders where a top-level package of the tree lies
        # A module of an engine the tree does not hold is read where the tree's files would import it from
        # (``engine_defs.find``: a copy above them, else the installed package), never imported.
        self._near = next((f.path for f in facts), None)
        self.labels: dict = {}  # path of an engine file read here -> its source's label
        self._member_cache: dict = {}  # (path, class qualname) -> _members of it
        self._beside: set = set()  # (folder, class name) whose files ``read_beside`` read
        self._texts: dict = {}  # normalised path -> bytes, of the files ``read_beside`` looked through
        self._parts: dict = {}  # normalised path -> a sketch read in parts (``_sketch_of``)
        self._catalog: dict = {}  # catalog label -> FileFacts standing for the pinned layers it describes
        self._pinned_reads: dict = {}  # (catalog label, method) -> its reads, as the catalog pins them
        for f in facts:
            if f.module:
                root = os.path.dirname(os.path.normpath(f.path))
                for _ in range(f.module.count(".") + (f.module == f.package)):
                    root = os.path.dirname(root)
                self._package_roots[root] = None

    # -- resolution ------------------------------------------------------------------------------------
    def module(self, name: str) -> Optional[FileFacts]:
        """The facts of the module ``name`` where it is a file of the tree."""
        if name not in self._by_module:
            self._by_module[name] = None
            rel = name.replace(".", os.sep)
            for root in self._package_roots:
                for candidate, package in ((rel + ".py", False), (os.path.join(rel, "__init__.py"), True)):
                    path = os.path.normpath(os.path.join(root, candidate))
                    if path in self._files and self._by_module[name] is None:
                        self._by_module[name] = self._by_path.get(path) or self._parse(path, name, package)
            if self._by_module[name] is None and engine_of(name) is not None:
                source = find(name, self._near)
                if source is not None:
                    path = os.path.normpath(source.path)
                    got = self._by_path.get(path) or self._parse(
                        path, name, os.path.basename(path) == "__init__.py")
                    if got is not None:
                        self.labels[source.path] = source.label
                        self._by_module[name] = got
        return self._by_module[name]

    def _parse(self, path: str, module: Optional[str], package: bool, facts: Optional[FileFacts] = None):
        try:
            data = self._read(self._files.get(path, path))
            tree = ast.parse(data)
        except (SyntaxError, ValueError, OSError, RecursionError, MemoryError):
            return None
        s = self._sketches[path] = _Sketch(tree, data, self._files.get(path, path), module, package, facts)
        self._by_path.setdefault(path, s.facts)
        return s.facts

    def function(self, f: FileFacts, qual: str) -> Optional[FuncFacts]:
        if qual not in f.functions and f.path not in self._catalog:
            path = os.path.normpath(f.path)
            if path not in self._sketches and self._parse(path, f.module, f.module == f.package, f) is None:
                return None
            return self._sketches[path].function(qual)
        return f.functions[qual]

    def resolve_all(self, f: FileFacts, ref: Ref) -> list:
        """[(file facts, qualname, parameters the call form binds, table entry or "")] of the defs ``ref``
        reaches from ``f``: one, or each function entry of a table."""
        if ref[0] != "table":
            got = self.resolve(f, ref)
            if got is None and ref[0] in ("self", "each"):
                return self._instance(f, ref[1], ref[2], "one" if ref[0] == "self" else "each")
            return [(*got, "")] if got is not None else []
        table = self._table(f, ref[1], 0)
        if table is None:
            return []
        owner, name, entries = table
        out = []
        for key, entry in entries:
            got = self.resolve(owner, entry)
            if got is not None:
                out.append((*got, f"{name}[{key}]"))
        return out

    def _table(self, f: FileFacts, name: str, hops: int) -> Optional[tuple]:
        """(file facts, name, entries) of the module-level table ``name`` is bound to in ``f``, through
        imports of it."""
        binding = f.names.get(name)
        if binding is not None and binding[0] == "table":
            return f, name, binding[1]
        if binding is not None and binding[0] == "from" and hops < _MAX_HOPS:
            target = self.module(binding[1])
            return self._table(target, binding[2], hops + 1) if target is not None else None
        return None

    def resolve(self, f: FileFacts, ref: Ref) -> Optional[tuple]:
        """(file facts, qualname, parameters the call form binds) of the def ``ref`` reaches from ``f``."""
        if ref[0] in ("table", "each"):
            return None
        if ref[0] == "self":
            return self._method(f, ref[1], ref[2], set())
        if ref[0] == "name":
            return self._named(f, ref[1], "def", 0)
        if ref[1].startswith("torch.ops.") and ref[1].count(".") == 2 and f.names.get("torch") == ("module", "torch"):
            return self._op(f, ref[2])
        if ref[2] == "apply" and "." not in ref[1]:
            function = self._autograd_forward(f, ref[1])
            if function is not None:
                return function
        target = self._module_of(f, ref[1])
        return self._named(target, ref[2], "def", 0) if target is not None else None

    def _autograd_forward(self, f: FileFacts, name: str) -> Optional[tuple]:
        """``Cls.apply(...)`` of a ``torch.autograd.Function`` the tree defines runs ``Cls.forward(ctx, ...)``: that
        def, its first parameter filled by the call form."""
        found = self._named(f, name, "class", 0)
        if found is None:
            return None
        owner, cls = found
        bases = owner.classes.get(cls, ((), {}))[0]
        if not any(b in ("torch.autograd.Function", "autograd.Function", "Function") for b in bases):
            return None
        method = self._method(owner, cls, "forward", set())
        return (method[0], method[1], 1) if method is not None else None

    def _named(self, f: FileFacts, name: str, kind: str, hops: int) -> Optional[tuple]:
        """The def (``kind`` "def") or class ("class") ``name`` is bound to in ``f``'s module, through its
        imports of it."""
        binding = f.names.get(name)
        if binding == (kind,):
            return (f, name, 0) if kind == "def" else (f, name)
        if binding is not None and binding[0] == "from" and hops < _MAX_HOPS \
                and self.module(f"{binding[1]}.{binding[2]}") is None:
            target = self.module(binding[1])
            return self._named(target, binding[2], kind, hops + 1) if target is not None else None
        return None

    def _module_of(self, f: FileFacts, dotted: str) -> Optional[FileFacts]:
        first, _, rest = dotted.partition(".")
        binding = f.names.get(first)
        if binding is None or binding[0] not in ("module", "from"):
            return None
        base = binding[1] if binding[0] == "module" else f"{binding[1]}.{binding[2]}"
        return self.module(f"{base}.{rest}" if rest else base)

    def _op(self, f: FileFacts, name: str) -> Optional[tuple]:
        """The def registered as the custom op ``name`` (``torch.ops.<ns>.<name>(...)``): in the calling
        module first, else in a module read so far that registers it (the one name, whatever the namespace)."""
        for owner in (f, *self._by_path.values()):
            if owner is not None and name in owner.ops:
                return self._named(owner, owner.ops[name], "def", 0)
        return None

    def _class_of(self, f: FileFacts, written: str) -> Optional[tuple]:
        """(file facts, class qualname) of a class as ``f`` writes its name (``Cls``, ``mod.Cls``)."""
        if written in f.classes:
            return f, written
        owner, _, short = written.rpartition(".")
        if owner:
            module = self._module_of(f, owner)
            return self._named(module, short, "class", 0) if module is not None else None
        return self._named(f, written, "class", 0)

    def _members(self, f: FileFacts, cls: str) -> dict:
        """{attribute: frozenset of (kind, constructor as written)} of the class ``cls`` of ``f``: what its
        methods store in ``self.<attribute>``, ``("one", "Cls")`` for ``Cls(...)``, ``("each", "Cls")`` for a
        list of them (``nn.ModuleList([Cls(...) for _ in ...])``); only constructor calls; read once a class."""
        if cls in f.members:
            return f.members[cls]
        key = (f.path, cls)
        if key not in self._member_cache:
            path = os.path.normpath(f.path)
            if path not in self._sketches:
                self._parse(path, f.module, f.module == f.package, f)
            sketch = self._sketches.get(path)
            node = sketch.class_nodes.get(cls) if sketch is not None else None
            self._member_cache[key] = _members(node) if node is not None else {}
        return self._member_cache[key]

    def _pinned(self, f: FileFacts, written: str) -> Optional[tuple]:
        """The catalog's picture of an engine layer no source of which is found (``PINNED_HOST_READS``), as a
        target: (file facts standing for the catalog, the method, 1, "")."""
        first, _, rest = written.partition(".")
        binding = f.names.get(first)
        if binding is None or binding[0] not in ("from", "module"):
            return None
        base = f"{binding[1]}.{binding[2]}" if binding[0] == "from" else binding[1]
        qual = f"{base}.{rest}" if rest else base
        qual = catalog.REEXPORTS.get(qual, qual)
        fact = catalog.PINNED_HOST_READS.get(qual)
        if fact is None or engine_of(qual) is None or find(qual.rpartition(".")[0], self._near) is not None:
            return None
        label = catalog_label(qual)
        facts = self._catalog.get(label)
        if facts is None:
            facts = self._catalog[label] = FileFacts(label, None, None, {}, {})
            self.labels[label] = label
        cls = qual.rpartition(".")[2]
        method = f"{cls}.{fact['method']}"
        if method not in facts.functions:
            params = ("self", *fact["params"])
            facts.functions[method] = FuncFacts(method, 0, (0, 0), params, frozenset(params[1:]), None, 1, False, {},
                                                frozenset(), frozenset(), frozenset(), frozenset(fact["uses"]))
            self._pinned_reads[(label, method)] = {
                p: Read(kind, ((name, path, line, ""),), frozenset(), False, True)
                for p, (kind, name, path, line) in fact["reads"].items()}
        return facts, method, 1, ""

    def _dispatch_targets(self, f: FileFacts, cls: str) -> Optional[frozenset]:
        """The methods a call of an instance of ``cls`` runs in place of its forward where that forward
        dispatches (``engine_defs.forward_targets``), read from this run's tree of its file."""
        if cls in f.plain:
            return frozenset()
        path = os.path.normpath(f.path)
        if path not in self._sketches:
            self._parse(path, f.module, f.module == f.package, f)
        sketch = self._sketches.get(path)
        node = sketch.class_nodes.get(cls) if sketch is not None else None
        if sketch is None or node is None or "." in cls:
            return class_forward_targets(f"{f.module}.{cls}", f.path) if f.module else None
        key = (path, cls, "dispatch")
        if key not in self._member_cache:
            classes = {c.name: c for c in sketch._body if type(c) is ast.ClassDef}
            self._member_cache[key] = forward_targets(node, classes, imports_of(sketch._body), f.module,
                                                      f.module == f.package, f.path)
        return self._member_cache[key]

    def _instance(self, f: FileFacts, cls: str, attr: str, kind: str) -> list:
        """The methods a call of the module held in ``self.<attr>`` runs (``kind`` "one": the instance
        itself; "each": an element of the container), where the class's methods store a constructor call
        there: the constructed class's ``forward``, or, where that forward dispatches to a method the
        instance picks (vLLM's CustomOp, ``engine_defs.class_forward_targets``), each of those."""
        out: list = []
        seen: set = set()
        here: Optional[tuple] = (f, cls)
        while here is not None and (here[0].path, here[1]) not in seen:
            seen.add((here[0].path, here[1]))
            owner, name = here
            made = self._members(owner, name).get(attr)
            if made:
                for k, written in sorted(made):
                    found = self._class_of(owner, written) if k == kind else None
                    if found is None:
                        pinned = self._pinned(owner, written) if k == kind else None
                        if pinned is not None:
                            out.append(pinned)
                        continue
                    tf, tcls = found
                    targets = self._dispatch_targets(tf, tcls)
                    for method in sorted(targets) if targets else ("forward",):
                        got = self._method(tf, tcls, method, set())
                        if got is not None:
                            out.append((*got, ""))
                return out
            bases = owner.classes.get(name, ((), {}))[0]
            here = next(filter(None, (self._class_of(owner, b) for b in bases)), None)
        return out

    def _method(self, f: FileFacts, cls: str, name: str, seen: set) -> Optional[tuple]:
        if (f.path, cls) in seen or cls not in f.classes:
            return None
        seen.add((f.path, cls))
        bases, methods = f.classes[cls]
        if name in methods:
            return (f, f"{cls}.{name}", methods[name])
        for base in bases:
            owner, _, short = base.rpartition(".")
            if base in f.classes:
                found: Optional[tuple] = (f, base)
            elif owner:
                module = self._module_of(f, owner)
                found = self._named(module, short, "class", 0) if module is not None else None
            else:
                found = self._named(f, base, "class", 0)
            got = self._method(found[0], found[1], name, seen) if found else None
            if got is not None:
                return got
        return None

    # -- what ``reach.py`` asks ------------------------------------------------------------------------
    def facts_by_path(self) -> list:
        """The facts of every file read so far."""
        return [f for f in self._by_path.values() if f is not None]

    def tree_files(self) -> dict:
        """The scanned tree's files (normalised path -> path as given)."""
        return self._files

    def _sketch_of(self, f: FileFacts) -> Optional[_Sketch]:
        """The file's sketch, parsed here; for a file a worker sketched, one whose defs and classes are read one at a
        time as ``def_node`` and ``class_node`` ask (``_segment``): a walk through a few methods of a large module
        does not parse all of it again."""
        path = os.path.normpath(f.path)
        if path in self._sketches or f.path in self._catalog:
            return self._sketches.get(path)
        if f.spans and path not in self._parts:
            try:
                data = self._read(self._files.get(path, f.path))
            except OSError:
                return None
            self._parts[path] = _Sketch(ast.Module(body=[], type_ignores=[]), data, f.path, f.module,
                                        f.module == f.package, f)
        if path in self._parts:
            return self._parts[path]
        self._parse(path, f.module, f.module == f.package, f)
        return self._sketches.get(path)

    def _read_part(self, f: FileFacts, sketch: _Sketch, qual: str) -> None:
        """Reads the def or class ``qual`` into a sketch of parts (``_sketch_of``), or a def nested in a def that a
        whole sketch does not index (an installed forward, ``_installs``)."""
        if qual not in f.spans or qual in sketch.defs or qual in sketch.class_nodes:
            return
        node = _segment(sketch.data, f.spans[qual])
        if type(node) is ast.ClassDef:
            sketch.class_nodes[qual] = node
        elif node is not None and type(node) in (ast.FunctionDef, ast.AsyncFunctionDef) \
                and node.name == qual.rpartition(".")[2]:
            owner = qual.rpartition(".")[0]
            sketch.defs[qual] = (node, owner if owner in f.classes else None)

    def def_node(self, f: FileFacts, qual: str) -> Optional[tuple]:
        """(the def's CPython node, its class's qualname or None)."""
        sketch = self._sketch_of(f)
        if sketch is None:
            return None
        self._read_part(f, sketch, qual)
        return sketch.defs.get(qual)

    def may_report(self, f: FileFacts, qual: str) -> bool:
        """The text of the def ``qual`` holds what GL104 can report in per-layer code: a host read, the truth of a
        tensor (``.any()``, ``.all()``), a varlen kernel's call."""
        from .patterns import KERNEL_NAMES

        got = self.def_node(f, qual)
        sketch = self._sketch_of(f)
        if sketch is None or got is None:
            return False
        start, end = _span(sketch._lines(), got[0].lineno, got[0].end_lineno or got[0].lineno)
        return _READ.search(sketch.data, start, end) is not None \
            or _TRUTH.search(sketch.data, start, end) is not None \
            or any(sketch.data.find(name, start, end) != -1 for name in KERNEL_NAMES)

    def call_ref(self, f: FileFacts, qual: str, call: ast.Call) -> Optional[Ref]:
        """The Ref of a call in the def ``qual`` of ``f`` (as ``FuncFacts.calls`` holds it, without the rest of the
        def's facts)."""
        got = self.def_node(f, qual)
        sketch = self._sketch_of(f)
        if sketch is None or got is None or type(call.func) not in _CALLEE_FORMS:
            return None
        node, cls = got
        positional = [p.arg for p in (*node.args.posonlyargs, *node.args.args)]
        bound = f.classes[cls][1].get(node.name, 0) if cls is not None and cls in f.classes else 0
        return sketch._ref(call.func, [node], (positional[0], cls) if bound and positional else None)

    def def_node_by_key(self, key: tuple) -> Optional[tuple]:
        """``def_node`` of (normalised path, qualname), for a file read so far."""
        f = self._by_path.get(key[0])
        return self.def_node(f, key[1]) if f is not None else None

    def class_node(self, f: FileFacts, cls: str) -> Optional[ast.ClassDef]:
        sketch = self._sketch_of(f)
        if sketch is None:
            return None
        self._read_part(f, sketch, cls)
        return sketch.class_nodes.get(cls)

    def method_of(self, f: FileFacts, cls: str, name: str) -> Optional[tuple]:
        """(file facts, qualname) of the method ``name`` an instance of ``cls`` runs (its own or a base's)."""
        got = self._method(f, cls, name, set())
        return (got[0], got[1]) if got is not None else None

    def call_methods(self, f: FileFacts, cls: str) -> tuple:
        """The methods a call of an instance of ``cls`` runs: its forward, or each method that forward dispatches
        to (vLLM's CustomOp, ``_dispatch_targets``)."""
        targets = self._dispatch_targets(f, cls)
        return tuple(sorted(targets)) if targets else ("forward",)

    def class_of(self, f: FileFacts, written: str) -> Optional[tuple]:
        return self._class_of(f, written)

    def named_class(self, f: FileFacts, name: str) -> Optional[tuple]:
        return self._named(f, name, "class", 0)

    def read_beside(self, folder: str, name: bytes) -> None:
        """Reads the tree's files under ``folder`` (at any depth) with a class header naming ``name`` (a class's)
        among its bases, once a folder and name."""
        from .discovery import module_name_for

        if (folder, name) in self._beside:
            return
        self._beside.add((folder, name))
        prefix = folder + os.sep
        word = re.compile(rb"class\s+\w+\s*\([^)]*\b" + re.escape(name) + rb"\b")  # a class derived from it
        for path in list(self._files):
            if not path.startswith(prefix) or path in self._by_path:
                continue
            data = self._texts.get(path)
            if data is None:
                try:
                    data = self._texts[path] = self._read(self._files[path])
                except OSError:
                    continue
            if word.search(data):
                module, package = module_name_for(self._files[path])
                self._parse(path, module, package)

    # -- the summaries ---------------------------------------------------------------------------------
    def tables(self, bindings: bool = True) -> dict:
        """Per file path (as given), its table: (the def a root is in, the callee as written) -> Callee, for
        the roots whose definition reads on the host a parameter the call may fill with metadata, and the
        places of those roots ({(line, column)})."""
        roots: list = []
        graph: dict = {}  # key (path, qualname) -> [(callee as written, key, skip)]
        funcs: dict = {}  # key -> (FileFacts, FuncFacts)
        values: list = []  # value roots: resolved only for a def that has a site (below)
        for f in list(self._by_path.values()):
            for root in f.roots:
                if root.value:
                    values.append((f, root))
                    continue
                if len(root.passed_on) == len(root.positions) + len(root.keywords) and self._held(f, root.ref):
                    continue  # a held module handed only what the def was given: its caller's fact
                targets = self.resolve_all(f, root.ref)
                if targets:
                    roots.append((f, root, targets))
        todo = [target for _, _, targets in roots for target in targets]
        while todo and len(funcs) < MAX_FUNCTIONS:
            tf, qual, _, _ = todo.pop()
            key = (tf.path, qual)
            fn = self.function(tf, qual) if key not in funcs else None
            if fn is None:
                continue
            funcs[key] = (tf, fn)
            edges = graph[key] = []
            for text, ref in fn.calls.items():
                held = self._held(tf, ref)
                if held and text not in fn.metadata_calls:
                    continue  # a module it hands no metadata (``self.norm(x)``)
                for target in self.resolve_all(tf, ref):
                    edges.append((text, (target[0].path, target[1]), target[2], target[3], held))
                    todo.append(target)
        exact = _callers({k for k, (_, fn) in funcs.items() if fn.reads_text or k in self._pinned_reads}, graph)
        summaries = self._exact({k: funcs[k] for k in exact}, graph, _kernel_uses(funcs, graph))
        out: dict = {}
        for f, root, targets in roots:
            found = []
            held = self._held(f, root.ref)
            for tf, qual, skip, entry in targets:
                s = summaries.get((tf.path, qual))
                if s is None:
                    continue
                named = {s.params[i + skip] if isinstance(i, int) and i + skip < len(s.params) else i
                         for i in root.given}
                own = [i for i in root.positions if not (held and i in root.passed_on)]
                hot = {s.params[i + skip] for i in own if i + skip < len(s.params)} \
                    | {k for k in root.keywords if not (held and k in root.passed_on)}
                deep = held and os.path.normpath(tf.path) in self._files
                if any(p in s.reads and not s.reads[p].unless & named and not reported_there(deep, p, s.reads[p])
                       for p in hot):
                    found.append(Callee(s, skip, entry, held, deep))
            if found:
                table, sites = out.setdefault(f.path, ({}, set()))
                table[(root.scope, root.callee)] = tuple(found)
                sites.add(root.at)
        self._returns(values, out)
        if not bindings:
            return out
        from .reach import Reach

        for path, places in Reach(self).contexts().items():
            table, sites = out.setdefault(path, ({}, set()))
            for qual, (why, given, absent) in places.items():
                table[("layer", qual)] = why
                table[("given", qual)] = given
                table[("absent", qual)] = absent
                sites.add(("layer", qual))
        return out

    def _returns(self, values: list, out: dict) -> None:
        """What the definitions of the value roots return (``Returns``), for the defs where a call is checked
        (a site): a device value derived from which parameters, read from each definition alone."""
        wanted = []
        for f, root in values:
            if f.path in out and any(len(k) == 2 and k[0] == root.scope for k in out[f.path][0]):
                for tf, qual, skip, _ in self.resolve_all(f, root.ref)[:1]:
                    fn = self.function(tf, qual)
                    if fn is not None:
                        wanted.append((f, root, tf, fn, skip))
        found = self._read_all([(self._read(tf.path), fn) for _, _, tf, fn, _ in wanted]) if wanted else []
        for (f, root, _, fn, skip), got in zip(wanted, found):
            if got is not None and got[2]:
                out[f.path][0][("=", root.scope, root.callee)] = Returns(fn.params, skip, got[2])

    def _checked_place(self, f: FileFacts, fn: FuncFacts) -> bool:
        """``fn`` is the forward of a layer class of the scanned tree: a per-layer place GL104 checks."""
        cls, _, name = fn.qualname.rpartition(".")
        if name != "forward" or not cls or os.path.normpath(f.path) not in self._files:
            return False
        bases = f.classes.get(cls, ((), {}))[0]
        return is_layer_class(cls.rpartition(".")[2], list(bases))

    def _label(self, path: str, reads: dict) -> str:
        """The engine source a summary was judged against: its own file's, else the first engine file on a
        path to one of its reads; "" where every function is the tree's."""
        if path in self.labels:
            return self.labels[path]
        return next((self.labels[p] for r in reads.values() for _, p, _, _ in r.path if p in self.labels), "")

    def _held(self, f: FileFacts, ref: Ref) -> bool:
        """``ref`` calls a module the caller holds (``self.attn(...)``, an element of ``self.blocks``), not a
        method or function."""
        return ref[0] == "each" or (ref[0] == "self" and self.resolve(f, ref) is None)

    def _exact(self, funcs: dict, graph: dict, uses: dict) -> dict:
        """The summaries of ``funcs`` (those with a path to a host read) from the value model, to a fixed
        point over their calls: a read reaches the caller whose parameter the call passes to it."""
        reads, calls = {}, {}
        keys = [k for k in funcs if k not in self._pinned_reads]
        reads.update({k: dict(v) for k, v in self._pinned_reads.items() if k in funcs})
        found = self._read_all([(self._read(funcs[k][0].path), funcs[k][1]) for k in keys]) if keys else []
        for key, got in zip(keys, found):
            f, fn = funcs[key]
            if got is not None:
                reads[key] = {p: Read(kind, ((fn.qualname, f.path, at, ""),), unless, False, allowed)
                              for p, (kind, unless, at, allowed) in got[0].items()}
                targets: dict = {}
                for text, t, skip, entry, held in graph.get(key, ()):
                    if t in funcs:
                        targets.setdefault(text, []).append((t, skip, entry, held))
                calls[key] = [(target, *c[1:]) for c in got[1] for target in targets.get(c[0], ())]
        changed = True
        while changed:
            changed = False
            for key, made in calls.items():
                fn = funcs[key][1]
                for (target, skip, entry, held), guard, positional, keywords, splat, at in made:
                    tfn = funcs[target][1]
                    place = held and self._checked_place(*funcs[target])
                    for q, read in list(reads.get(target, {}).items()):
                        if place and is_seqlen_name(q):
                            continue  # reported at that layer's forward, where q is taken for device metadata
                        if entry:  # the path names the table entry the call reached
                            read = Read(read.kind, ((*read.path[0][:3], entry), *read.path[1:]), read.unless,
                                        read.held, read.allowed)
                        if held:
                            read = Read(read.kind, read.path, read.unless, True, read.allowed)
                        new = _through(q, read, (fn.qualname, funcs[key][0].path, at, ""), guard,
                                       splat and fn.kwargs is not None, fn.keywords, tfn, skip, positional, keywords)
                        if new is not None:
                            source, new = new
                            old = reads[key].get(source)
                            if old is None or _better(new, old):
                                reads[key][source] = new
                                changed = True
        return {key: Summary(fn.qualname, f.path, fn.line, fn.params, fn.keywords, fn.kwargs, reads[key],
                             fn.forwards, fn.requires, fn.ignores, self._label(f.path, reads[key]),
                             frozenset(uses.get(key, ())))
                for key, (f, fn) in funcs.items() if key in reads}


def _better(new: Read, old: Read) -> bool:
    """Whether ``new`` is the read to keep for a parameter over ``old``: one no argument spares, then one not
    through a held module, then (for output that does not depend on the order the tree was walked in) the
    shorter path, then the first in the order of its places."""
    def rank(r: Read) -> tuple:
        return (bool(r.unless), r.held, len(r.path), tuple((p, line, name) for name, p, line, _ in r.path))

    return rank(new) < rank(old)


def _kernel_uses(funcs: dict, graph: dict) -> dict:
    """Per function key, the parameters it needs on the device: those it hands to a kernel
    (``FuncFacts.kernel``), and, to a fixed point, those it passes as given to a callee that needs them."""
    uses = {key: set(fn.kernel) for key, (_, fn) in funcs.items()}
    changed = True
    while changed:
        changed = False
        for key, edges in graph.items():
            fn = funcs[key][1]
            for text, target, skip, _, _ in edges:
                if target not in funcs or not uses.get(target):
                    continue
                positional, keywords = fn.passes.get(text, ((), {}))
                tparams = funcs[target][1].params
                for q in uses[target]:
                    at = tparams.index(q) - skip if q in tparams[skip:] else len(positional)
                    p = positional[at] if at < len(positional) else keywords.get(q)
                    if p and p not in uses[key]:
                        uses[key].add(p)
                        changed = True
    return uses


def reported_there(deep: bool, param: str, read: Read) -> bool:
    """``Callee.deep``'s test: the held forward's own check reports this read of ``param``."""
    return deep and not read.held and is_seqlen_name(param)


def _through(q: str, read: Read, hop: tuple, guard: frozenset, splat: bool, own: frozenset, target: FuncFacts,
             skip: int, positional: list, keywords: dict) -> Optional[tuple]:
    """(the caller's parameter, its Read) where a call of ``target`` passes that parameter to ``q``, which
    ``target`` reads as ``read``; None where it passes none, or passes what spares the read. Arguments are
    (parameter of the caller they carry, what is passed: None for None, a parameter's name, or "")."""
    def given(name: str) -> Optional[tuple]:
        at = target.params.index(name) - skip if name in target.params[skip:] else len(positional)
        return positional[at] if at < len(positional) else keywords.get(name)

    arg = given(q)
    if arg is not None:
        source = arg[0]
    elif splat and q not in own and (q in target.keywords or target.kwargs):
        source = q  # a keyword the caller's **kwargs takes and passes on
    else:
        return None
    if not source:
        return None
    unless = set(guard) | (arg[2] if arg is not None and len(arg) > 2 else set())
    for u in read.unless:
        passed = given(u)
        if passed is None and splat and u not in own:
            unless.add(u)  # unless the caller's own caller passes it
        elif passed is not None and passed[1] == "":
            return None  # the call passes a value: no read
        elif passed is not None and passed[1]:
            unless.add(passed[1])
    return source, Read(read.kind, (hop, *read.path), frozenset(unless), read.held, read.allowed)


def read_facts(data: bytes, fn: FuncFacts) -> Optional[tuple]:
    """What the value model says of ``fn`` (of the file ``data``) with each parameter taken for a device
    tensor: ({parameter: (how it is read on the host, the parameters whose None-branch the read is on, the
    line)}, [(callee as written, those parameters for the call, its positional arguments, its keywords,
    whether it passes **kwargs on, the line)]), arguments as ``_through`` takes them; None where its text
    does not parse alone.
    Calls under a test of prepared metadata are left out, as GL104 leaves them (GL109 reports the callers
    that pass none)."""
    import libcst as cst
    from libcst.metadata import PositionProvider

    from .host_sync import _prepared, _stored, _tests_metadata, bare_copy, callee_text, host_copy
    from .names import dotted, is_none
    from .patterns import CASTS, SYNC_METHODS
    from .values import DEVICE, UNKNOWN_VALUE, Value, Values, join
    from .walk import children

    start, end = _span(_line_starts(data), *fn.lines)
    try:
        segment = data[start:end].decode("utf-8")
        indented = segment[:1] in (" ", "\t")  # a method: under an ``if`` its indentation parses
        module = cst.parse_module("if 1:\n" + segment if indented else segment)
        node: Any = module.body[0]
        node = node.body.body[0] if indented else node
        positions = cst.MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    except Exception:  # another encoding, a def sharing its line with other code
        return None

    def line(n) -> int:  # in the file
        return fn.lines[0] + positions[n].start.line - 1 - indented
    params = fn.keywords
    try:
        model = Values(node, _prepared, lambda name: Value(DEVICE, name) if name in params else UNKNOWN_VALUE)
    except (RecursionError, AttributeError):  # (not a def)
        return None

    defaulted = _defaulted(node, params)

    def argument(expr) -> tuple:
        v = model.of(expr)
        passed = None if is_none(expr) else expr.value if isinstance(expr, cst.Name) and expr.value in params else ""
        source = v.source if v.device and v.source in params else None
        if source and isinstance(expr, cst.Name) and expr.value in defaulted and source != expr.value:
            # ``if max_seqlen is None: max_seqlen = f(cu_seqlens)``: cu_seqlens reaches here only when the
            # caller passes no max_seqlen
            return (source, passed, frozenset({expr.value}))
        return (source, passed)

    direct: dict = {}
    calls = []
    returned: set = set()
    stack: list = [(node.body, False, frozenset(), False)]  # (children are pushed reversed: source order)
    while stack:
        n, fallback, guard, allowed = stack.pop()
        if isinstance(n, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            continue
        fallback = fallback or (isinstance(n, cst.If) and _tests_metadata(n.test))
        if isinstance(n, cst.Return) and n.value is not None and not is_none(n.value):
            v = model.of(n.value)
            stores = _stored(node, n.value.value) if isinstance(n.value, cst.Name) else None
            others = [e for e in stores or () if not is_none(e)]
            if others and len(others) < len(stores or ()):  # ``m = None; if ...: m = f(cu); return m``
                v = model.of(others[0])
                for e in others[1:]:
                    v = join(v, model.of(e))
            if v.where == DEVICE and v.source in params:
                returned.add(v.source)
        allowed = allowed or (isinstance(n, cst.With) and any(
            isinstance(i.item, cst.Call) and (dotted(i.item.func) or "").rpartition(".")[2] in SYNC_ALLOWED
            for i in n.items))
        if isinstance(n, cst.Call) and not fallback:
            f, args = n.func, n.args
            kind, read = None, None
            if isinstance(f, cst.Attribute) and f.attr.value in SYNC_METHODS and not args:
                read, copy = host_copy(f.value)  # ``t.cpu().tolist()`` reads ``t``
                kind = f"{copy}.{f.attr.value}()"
            elif isinstance(f, cst.Name) and f.value in CASTS and len(args) == 1 and not args[0].star \
                    and args[0].keyword is None:
                kind, read = f"{f.value}()", args[0].value
            else:
                copied = bare_copy(n)  # ``return cu.cpu()``: the copy waits for the device, read or not
                if copied is not None:
                    read, kind = copied
            got = argument(read) if read is not None else (None,)
            source, spared = got[0], guard | (got[2] if len(got) > 2 else frozenset())
            if source and (source not in direct or (direct[source][1] and not spared)):
                direct[source] = (kind, spared, line(n), allowed)
            text = callee_text(f)
            if text in fn.calls:
                positional, keywords, splat, starred = [], {}, False, False
                for arg in args:
                    if arg.keyword is not None:
                        keywords[arg.keyword.value] = argument(arg.value)
                    elif arg.star == "**":
                        splat = splat or (isinstance(arg.value, cst.Name) and arg.value.value == fn.kwargs)
                    elif arg.star or starred:
                        starred = True
                    else:
                        positional.append(argument(arg.value))
                calls.append((text, guard, positional, keywords, splat, line(n)))
        stack.extend((child, fallback, guard | extra, allowed)
                     for child, extra in reversed(_branches(n, params, children)))
    return direct, calls, frozenset(returned)


# Callees that are no kernel: torch's and numpy's generic functions and Python's builtins. A parameter handed to
# any other callee the summaries cannot follow (``flash_attn_varlen_func(..., cu_seqlens_q=cu_seqlens)``, an
# extension's op) is a parameter the code needs on the device (``Summary.uses``).
# Context managers by which an engine marks a host sync as allowed (vLLM's ``gpu_sync_allowed()``, which its sync
# checker honours).
SYNC_ALLOWED = frozenset({"gpu_sync_allowed"})
_NOT_KERNELS = frozenset({"torch", "F", "nn", "np", "numpy", "math", "einops", "rearrange", "len", "int", "float",
                          "bool", "max", "min", "sum", "list", "tuple", "dict", "set", "range", "enumerate", "zip",
                          "isinstance", "print", "str", "repr", "getattr", "hasattr", "sorted", "abs", "any", "all",
                          "super", "type", "iter", "next", "map", "filter", "round", "logger", "warnings"})


def _branches(node, params: frozenset, children) -> list:
    """``node``'s children, each with the parameters whose being None leads there: the body of ``if p is
    None``, the else of ``if p is not None`` (and of ``x if p is not None else y``), what follows ``if p is
    not None: return ...`` in its block, the right of ``p or y``."""
    import libcst as cst

    if isinstance(node, (cst.If, cst.IfExp)):
        p, branch = _none_branch(node.test, params)
        parts = [(node.test, ""), (node.body, "body"), (node.orelse, "orelse")]
        return [(child, frozenset({p}) if p and branch == which else frozenset()) for child, which in parts
                if child is not None]
    if isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.Or) \
            and isinstance(node.left, cst.Name) and node.left.value in params:
        return [(node.left, frozenset()), (node.right, frozenset({node.left.value}))]
    if isinstance(node, cst.IndentedBlock):
        out: list = []
        after: frozenset = frozenset()
        for stmt in node.body:
            out.append((stmt, after))
            if isinstance(stmt, cst.If) and stmt.orelse is None and _leaves(stmt.body):
                p, branch = _none_branch(stmt.test, params)
                after = after | {p} if p and branch == "orelse" else after
        return out
    return [(child, frozenset()) for child in children(node)]


def defaulted_params(func) -> frozenset:
    """``_defaulted`` of a libcst def over all its parameters."""
    p = func.params
    return _defaulted(func, frozenset(x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)))


def _defaulted(func, params: frozenset) -> frozenset:
    """The parameters of ``func`` (a libcst def) that its body stores to only where they are None: in the
    body of ``if p is None:`` (or the else of ``if p is not None:``), and those it stores to nowhere are left
    out. A value read from such a name after the store derives from the store only when the caller passed
    None."""
    import libcst as cst

    from .names import stored_names
    from .walk import children

    stores: dict = {}  # parameter -> stored to outside its own None branch
    stack: list = [(func.body, frozenset())]
    while stack:
        node, none = stack.pop()
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            continue
        for t in stored_names(node):
            if t.value in params:
                stores[t.value] = stores.get(t.value, False) or t.value not in none
        for child, extra in _branches(node, params, children):
            stack.append((child, none | extra))
    return frozenset(p for p, outside in stores.items() if not outside)


def _leaves(block) -> bool:
    """The block ends in a ``return`` or ``raise``."""
    import libcst as cst

    last = block.body[-1] if getattr(block, "body", None) else None
    if isinstance(last, cst.SimpleStatementLine):
        last = last.body[-1]
    return isinstance(last, (cst.Return, cst.Raise))


def _none_branch(test, params: frozenset) -> tuple:
    """(p, "body") where the body of ``if test`` runs when the parameter p is None (``p is None``, ``not
    p``), (p, "orelse") where its else does (``p is not None``, ``p``); within ``and``/``or``, the first
    such part (the path is then one that a missing p leads to, if not the only one)."""
    import libcst as cst

    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        p, branch = _none_branch(test.expression, params)
        return (p, "orelse" if branch == "body" else "body") if p else (None, "")
    if isinstance(test, cst.Name) and test.value in params:
        return test.value, "orelse"
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and isinstance(test.left, cst.Name) \
            and test.left.value in params and isinstance(test.comparisons[0].comparator, cst.Name) \
            and test.comparisons[0].comparator.value == "None":
        op = test.comparisons[0].operator
        if isinstance(op, (cst.Is, cst.IsNot)):
            return test.left.value, "body" if isinstance(op, cst.Is) else "orelse"
    if isinstance(test, cst.BooleanOperation):
        for part in (test.left, test.right):
            p, branch = _none_branch(part, params)
            if p:
                return p, branch
    return None, ""


def _callers(seeds: set, graph: dict) -> set:
    """``seeds`` and every function with a path of calls to one of them."""
    callers: dict = {}
    for key, edges in graph.items():
        for _, target, *_ in edges:
            callers.setdefault(target, set()).add(key)
    out, todo = set(seeds), list(seeds)
    while todo:
        for caller in callers.get(todo.pop(), ()):
            if caller not in out:
                out.add(caller)
                todo.append(caller)
    return out


def build(facts: list, files, read: Callable[[str], bytes], read_all: Optional[Callable] = None,
          bindings: bool = True) -> dict:
    """Per file path (as given): the table GL104 asks at its per-layer calls, and the places of those calls
    (``Summaries.tables``). ``read``: a file's bytes; ``read_all``: ``read_facts`` over a list (libcst's
    part, which a run's worker processes may take)."""
    if not any(f.roots or bindings and (f.installs or f.places) for f in facts):
        return {}
    return Summaries(facts, files, read, read_all).tables(bindings)
