"""Which definition a call of an engine reaches: the engine's source as this tree or this environment has it.

A call is judged by the module the file would import: a copy in the scanned tree (a fork or a vendored
engine, in a directory above the file), else the installed package (found by path on ``sys.path``, never
imported), else the catalog's pinned knowledge. Sources are read with ``ast`` once a run; every answer
names the source it came from (``./sglang (this tree)``, ``sglang 0.5.23 (installed)``,
``catalog: sglang 0.5.23``).
"""
# Facts read from a source: whether a module defines a name, a method's parameters, a dataclass's fields, a
# backend table's entries, which keywords a method takes (a parameter, or a key read from its **kwargs), and,
# for a layer that calls a backend from such a table, which keywords spare a backend a host read: the backend
# reads the device (``.item()``, ``.tolist()``, ``.cpu()``, in its body or a helper of its module) only on the
# path where the keyword's value is absent (``if forward_metadata is not None: ... else: <read>``, or the value
# handed to a helper that reads when it is None).
from __future__ import annotations

import ast
import os
import re
import sys
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from guardlint.contracts import catalog

from .patterns import SYNC_METHODS

_READS = (*SYNC_METHODS, "cpu")  # calls with no arguments that copy a device value to the host
_DEPTH = 4  # helpers followed from a backend's forward
_Function = Union[ast.FunctionDef, ast.AsyncFunctionDef]


@dataclass(frozen=True)
class Source:
    """A module's source file and how a finding names it."""

    path: str
    label: str


@dataclass(frozen=True)
class Judgement:
    """What a target's definition says about a call: ``takes``, the keywords (of those asked about) whose
    value it uses (None: it cannot be told); ``params``, its positional parameters in order (None: the
    catalog's); ``reachable``, False when the call cannot reach the target at all (a backend table without
    it); ``label``, the source judged against."""

    label: str
    takes: Optional[frozenset] = None
    params: Optional[tuple] = None
    reachable: bool = True


def engine_of(qualname: str) -> Optional[str]:
    """The engine a qualified name belongs to (its top-level package), when the catalog pins one."""
    top = qualname.split(".", 1)[0]
    return top if top in catalog.PINNED else None


def catalog_label(qualname: str) -> str:
    top = qualname.split(".", 1)[0]
    return f"catalog: {top} {catalog.PINNED[top]}" if top in catalog.PINNED else "catalog"


# -- finding a module's source -------------------------------------------------------------------------
def _relative(path: str) -> str:
    here = os.getcwd()
    if path == here or path.startswith(here.rstrip(os.sep) + os.sep):
        return "./" + os.path.relpath(path, here).replace(os.sep, "/")
    return path


def _module_file(base: str, parts: list[str]) -> Optional[str]:
    """``<base>/a/b/c.py`` or ``<base>/a/b/c/__init__.py`` for module ``a.b.c``, when it is a file."""
    stem = os.path.join(base, *parts)
    for candidate in (stem + ".py", os.path.join(stem, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


_INSTALLED: dict = {}  # (sys.path, package) -> [(directory holding the package, its version)]


def _installed_bases(top: str) -> list:
    key = (tuple(sys.path), top)
    got = _INSTALLED.get(key)
    if got is None:
        got = []
        for entry in sys.path:
            base = os.path.abspath(entry or os.curdir)
            if os.path.isdir(os.path.join(base, top)):
                got.append((base, _version(base, top)))
        if not got:
            # An editable or namespace install is not a folder on sys.path: ask for the top-level package's
            # location only (finding a submodule would import its parents).
            import importlib.util

            try:
                spec = importlib.util.find_spec(top)
            except (ImportError, ValueError):
                spec = None
            for location in (spec.submodule_search_locations or ()) if spec is not None else ():
                base = os.path.dirname(location)
                got.append((base, _version(base, top)))
        _INSTALLED[key] = got
    return got


def _version(base: str, top: str) -> str:
    """The installed distribution's version, from its ``.dist-info`` beside it or the package's version.py."""
    try:
        for name in os.listdir(base):
            if name.endswith(".dist-info") and name.lower().startswith(top.lower() + "-"):
                return name[len(top) + 1: -len(".dist-info")]
    except OSError:
        pass
    try:
        with open(os.path.join(base, top, "version.py"), encoding="utf-8", errors="replace") as f:
            m = re.search(r"""^__version__\s*=\s*["']([^"']+)""", f.read(), re.MULTILINE)
        return m.group(1) if m else ""
    except OSError:
        return ""


def find(module: str, near: Optional[str]) -> Optional[Source]:
    """The source of ``module`` as the file ``near`` would import it: a copy in a directory above the file
    first, then the installed package's; None when neither is found."""
    parts = module.split(".")
    if near and near != "-":
        here = os.path.dirname(os.path.abspath(near))
        while True:
            found = _module_file(here, parts)
            if found is not None:
                return Source(found, f"{_relative(os.path.join(here, parts[0]))} (this tree)")
            parent = os.path.dirname(here)
            if parent == here:
                break
            here = parent
    for base, version in _installed_bases(parts[0]):
        found = _module_file(base, parts)
        if found is not None:
            return Source(found, f"{parts[0]} {version} (installed)" if version else f"{parts[0]} (installed)")
    return None


# -- reading a source ----------------------------------------------------------------------------------
class _Module:
    """A module's top-level definitions, read once."""

    def __init__(self, tree: ast.Module):
        self.defined: set[str] = set()
        self.classes: dict[str, ast.ClassDef] = {}
        self.functions: dict[str, _Function] = {}
        self.tables: dict[str, dict[str, str]] = {}
        self.open = False  # a star import or a module __getattr__: any name may be defined
        self.memo: dict = {}  # (class, keyword) -> whether the keyword spares its forward a host read
        self.imports = imports_of(tree.body)
        for stmt in _top_level(tree.body):
            if isinstance(stmt, ast.ClassDef):
                self.classes[stmt.name] = stmt
                self.defined.add(stmt.name)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[stmt.name] = stmt
                self.defined.add(stmt.name)
                self.open |= stmt.name == "__getattr__"
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for alias in stmt.names:
                    if alias.name == "*":
                        self.open = True
                    else:
                        self.defined.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            self.defined.add(name.id)
                    self._table(target, stmt.value)

    def _table(self, target: ast.AST, value: Optional[ast.AST]) -> None:
        """``TABLE = {"key": Class, ...}`` and ``TABLE["key"] = Class``: string keys to class names."""
        if isinstance(target, ast.Name) and isinstance(value, ast.Dict):
            self.tables[target.id] = {k.value: v.id for k, v in zip(value.keys, value.values)
                                      if isinstance(k, ast.Constant) and isinstance(k.value, str)
                                      and isinstance(v, ast.Name)}
        elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) \
                and target.value.id in self.tables and isinstance(target.slice, ast.Constant) \
                and isinstance(target.slice.value, str) and isinstance(value, ast.Name):
            self.tables[target.value.id][target.slice.value] = value.id

    def defines(self, name: str) -> bool:
        return name in self.defined or self.open

    def method(self, cls: str, name: str) -> Optional[_Function]:
        node = self.classes.get(cls)
        if node is None:
            return None
        return next((s for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and s.name == name), None)


def _top_level(body: list) -> Iterable[ast.stmt]:
    """Statements run at import: the body, and the bodies of its ``if``/``try``/``with`` blocks."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from _top_level(stmt.body)
            yield from _top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody, *(h.body for h in stmt.handlers)):
                yield from _top_level(block)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from _top_level(stmt.body)


_PARSED: dict = {}  # path -> (mtime, size, _Module or None)


def _read(source: Source) -> Optional[_Module]:
    try:
        st = os.stat(source.path)
    except OSError:
        return None
    got = _PARSED.get(source.path)
    if got is not None and got[:2] == (st.st_mtime_ns, st.st_size):
        return got[2]
    try:
        with open(source.path, "rb") as f:
            module: Optional[_Module] = _Module(ast.parse(f.read(), filename=source.path))
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        module = None
    if len(_PARSED) > 256:
        _PARSED.clear()
    _PARSED[source.path] = (st.st_mtime_ns, st.st_size, module)
    return module


def _load(module: str, near: Optional[str]) -> tuple[Optional[_Module], Optional[Source]]:
    source = find(module, near)
    if source is None:
        return None, None
    return _read(source), source


def defines(module: str, name: str, near: Optional[str]) -> tuple[Optional[bool], str]:
    """Whether ``module``, as the file ``near`` would import it, defines ``name``, and the source judged
    against; ``(None, <catalog label>)`` when no source is found (or it does not parse)."""
    parsed, source = _load(module, near)
    if parsed is None or source is None:
        return None, catalog_label(module)
    return parsed.defines(name), source.label


# -- what a function takes -------------------------------------------------------------------------------
def _positional(fn: _Function) -> tuple:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args]
    return tuple(names[1:] if names and names[0] in ("self", "cls") else names)


def _kwargs_name(fn: _Function) -> Optional[str]:
    return fn.args.kwarg.arg if fn.args.kwarg is not None else None


def _key_read(node: ast.AST, kwargs: Optional[str], keyword: str) -> bool:
    """``kwargs["k"]``, ``kwargs.get("k", ...)``, ``kwargs.pop("k", ...)`` or ``"k" in kwargs``."""
    if kwargs is None:
        return False
    if isinstance(node, ast.Subscript):
        return _is_name(node.value, kwargs) and _is_str(node.slice, keyword)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop"):
        return _is_name(node.func.value, kwargs) and bool(node.args) and _is_str(node.args[0], keyword)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
        return _is_str(node.left, keyword) and _is_name(node.comparators[0], kwargs)
    return False


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _is_str(node: ast.AST, value: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == value


def _passes_kwargs(fn: _Function) -> bool:
    """The function hands its ``**kwargs`` on whole to a call (what it takes is then the callee's)."""
    kwargs = _kwargs_name(fn)
    return kwargs is not None and any(
        isinstance(n, ast.Call) and any(k.arg is None and _is_name(k.value, kwargs) for k in n.keywords)
        for n in ast.walk(fn))


def takes(fn: _Function, keyword: str) -> bool:
    """Whether ``fn`` uses a ``keyword=`` argument: a parameter of that name, a key read from its
    ``**kwargs``, or its ``**kwargs`` handed on whole."""
    a = fn.args
    if keyword in [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]:
        return True
    kwargs = _kwargs_name(fn)
    return any(_key_read(n, kwargs, keyword) for n in ast.walk(fn)) or _passes_kwargs(fn)


# -- which keywords spare a backend a host read ----------------------------------------------------------
class _Spares:
    """Whether a method reads the host only where a keyword's value is absent (see the module's comment)."""

    def __init__(self, module: _Module, cls: Optional[ast.ClassDef]):
        self.module = module
        self.cls = cls
        self._reads: dict[int, bool] = {}

    def _callee(self, call: ast.Call) -> Optional[_Function]:
        f = call.func
        if isinstance(f, ast.Name):
            return self.module.functions.get(f.id)
        if isinstance(f, ast.Attribute) and _is_name(f.value, "self") and self.cls is not None:
            return self.module.method(self.cls.name, f.attr)
        return None

    def reads(self, node: ast.AST, depth: int = 0) -> bool:
        """A host read in ``node``, or in a helper of the module (or a method of the class) it calls."""
        for n in ast.walk(node):
            if not isinstance(n, ast.Call):
                continue
            if isinstance(n.func, ast.Attribute) and n.func.attr in _READS and not n.args and not n.keywords:
                return True
            callee = self._callee(n)
            if callee is not None and depth < _DEPTH:
                key = id(callee)
                if key not in self._reads:
                    self._reads[key] = False  # recursion: no read found through itself
                    self._reads[key] = self.reads(callee, depth + 1)
                if self._reads[key]:
                    return True
        return False

    def spared(self, fn: _Function, keyword: str, names: Optional[set] = None, depth: int = 0) -> bool:
        """``fn`` reads the host where the value of ``keyword`` (its parameter, or a key of its ``**kwargs``;
        ``names``: the parameter it arrives in, for a helper) is absent."""
        kwargs = _kwargs_name(fn) if names is None else None
        if names is None:
            a = fn.args
            names = {keyword} if keyword in [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs] else set()
            # ``value = kwargs.get("max_seqlen")``: the local holds the keyword's value.
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) \
                        and _holds(n.value, names, kwargs, keyword):
                    names.add(n.targets[0].id)
        if not names and kwargs is None:
            return False
        walk = _Walk(self, names, kwargs, keyword, depth)
        return walk.block(fn.body, False)


def _holds(expr: Optional[ast.AST], names: set, kwargs: Optional[str], keyword: str) -> bool:
    """``expr`` is the keyword's value: one of ``names``, a read of its key, or ``a if <test> else b`` of those."""
    if expr is None:
        return False
    if isinstance(expr, ast.Name):
        return expr.id in names
    if isinstance(expr, ast.IfExp):
        return _holds(expr.body, names, kwargs, keyword) or _holds(expr.orelse, names, kwargs, keyword)
    return _key_read(expr, kwargs, keyword) and not isinstance(expr, ast.Compare)


class _Walk:
    def __init__(self, spares: _Spares, names: set, kwargs: Optional[str], keyword: str, depth: int):
        self.s = spares
        self.names = names
        self.kwargs = kwargs
        self.keyword = keyword
        self.depth = depth

    def _given(self, test: ast.AST) -> Optional[bool]:
        """True when ``if test:`` runs its body only with the value given, False when only without it,
        None when the test is not about it."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = self._given(test.operand)
            return None if inner is None else not inner
        if isinstance(test, ast.BoolOp):
            sides = [self._given(v) for v in test.values]
            if isinstance(test.op, ast.And) and True in sides:
                return True
            if isinstance(test.op, ast.Or) and False in sides:
                return False
            return None
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            op, right = test.ops[0], test.comparators[0]
            if _key_read(test, self.kwargs, self.keyword):
                return isinstance(op, ast.In)
            if isinstance(right, ast.Constant) and right.value is None and self._value(test.left, True):
                if isinstance(op, (ast.IsNot, ast.NotEq)):
                    return True
                if isinstance(op, (ast.Is, ast.Eq)):
                    return False
            return None
        # The truth of the value itself (not of an attribute: ``if max_seqlen.is_cuda:`` tests no presence).
        return True if self._value(test) else None

    def _value(self, expr: ast.AST, attributes: bool = False) -> bool:
        """The value itself or, with ``attributes``, an attribute of it (``forward_metadata.packed_indptrs``)."""
        while attributes and isinstance(expr, ast.Attribute):
            expr = expr.value
        return _holds(expr, self.names, self.kwargs, self.keyword)

    def block(self, stmts: list, absent: bool) -> bool:
        for stmt in stmts:
            if isinstance(stmt, ast.If):
                given = self._given(stmt.test)
                if given is None:
                    if self.expression(stmt.test, absent) or self.block(stmt.body, absent) \
                            or self.block(stmt.orelse, absent):
                        return True
                    continue
                if self.block(stmt.body, absent or not given) or self.block(stmt.orelse, absent or given):
                    return True
                # ``if value is not None: return ...``: what follows runs without it.
                if given and stmt.body and isinstance(stmt.body[-1], (ast.Return, ast.Raise)):
                    absent = True
                continue
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            inner = [getattr(stmt, name) for name in ("body", "orelse", "finalbody") if hasattr(stmt, name)]
            inner += [h.body for h in getattr(stmt, "handlers", ())]
            heads = [v for k, v in ast.iter_fields(stmt) if k not in ("body", "orelse", "finalbody", "handlers")]
            for head in heads:
                for node in head if isinstance(head, list) else [head]:
                    if isinstance(node, ast.AST) and self.expression(node, absent):
                        return True
            if any(self.block(b, absent) for b in inner):
                return True
        return False

    def expression(self, node: ast.AST, absent: bool) -> bool:
        if absent and self.s.reads(node):
            return True
        # The value handed to a helper that reads where it is None (``resolve_max_seqlen(cu, max_seqlen)``).
        for n in ast.walk(node):
            if not isinstance(n, ast.Call) or self.depth >= _DEPTH:
                continue
            callee = self.s._callee(n)
            if callee is None:
                continue
            params = [p.arg for p in callee.args.posonlyargs + callee.args.args]
            if isinstance(n.func, ast.Attribute) and params:
                params = params[1:]
            names = set()
            for i, arg in enumerate(n.args):
                if i < len(params) and _holds(arg, self.names, self.kwargs, self.keyword):
                    names.add(params[i])
            for k in n.keywords:
                if k.arg is not None and _holds(k.value, self.names, self.kwargs, self.keyword):
                    names.add(k.arg)
            if names and self.s.spared(callee, self.keyword, names, self.depth + 1):
                return True
        return False


# -- judging a call --------------------------------------------------------------------------------------
def _layer(module: _Module, cls: str, keywords: tuple, backends: Optional[frozenset],
           table: str) -> Optional[frozenset]:
    """The keywords (of ``keywords``) that spare a host read per call of layer ``cls``: the layer's own
    (it reads where the value is absent), or, for those it passes on to its backend, the backend's, over the
    backends the call may reach (``backends``: keys of the table; None: any). None when the layer's
    ``forward`` is not in this source."""
    forward = module.method(cls, "forward")
    if forward is None:
        return None
    node = module.classes[cls]
    spares = _Spares(module, node)
    own = {k for k in keywords if takes(forward, k) and spares.spared(forward, k)}
    entries = module.tables.get(table)
    calls = _backend_calls(node, forward, table)
    if entries is None or not calls:
        # No backend table, or none called: what the layer takes is all that can be told.
        return frozenset(k for k in keywords if takes(forward, k))
    passed = {k for k in keywords if takes(forward, k)
              and any(any(kw.arg in (k, None) for kw in c.keywords) for c in calls)}
    reached = [v for key, v in entries.items() if backends is None or key in backends]
    for name in reached:
        own |= {k for k in passed if _backend_spared(module, name, k)}
    return frozenset(own)


def _backend_spared(module: _Module, name: str, keyword: str) -> bool:
    """Whether ``keyword`` spares backend class ``name``'s forward a host read (one defined elsewhere is trusted
    to use what it is given)."""
    key = (name, keyword)
    if key not in module.memo:
        backend = module.method(name, "forward")
        module.memo[key] = backend is None or (
            takes(backend, keyword) and _Spares(module, module.classes.get(name)).spared(backend, keyword))
    return module.memo[key]


def _backend_calls(cls: ast.ClassDef, forward: _Function, table: str) -> list:
    """Calls in ``forward`` of an attribute set from the table (``self.qkv_backend = TABLE[key](...)``)."""
    attrs: set = set()
    for n in ast.walk(cls):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Subscript) \
                and _is_name(n.value.func.value, table):
            attrs.update(t.attr for t in n.targets if isinstance(t, ast.Attribute) and _is_name(t.value, "self"))
    calls = []
    for n in ast.walk(forward):
        if isinstance(n, ast.Call):
            f = n.func
            if isinstance(f, ast.Attribute) and f.attr == "forward":
                f = f.value
            if isinstance(f, ast.Attribute) and _is_name(f.value, "self") and f.attr in attrs:
                calls.append(n)
    return calls


def backend_keys(table: str, near: Optional[str]) -> tuple[Optional[frozenset], str]:
    """The keys of a backend table (``module.TABLE``) as this tree or environment defines it."""
    module, name = table.rsplit(".", 1)
    parsed, source = _load(module, near)
    if parsed is None or source is None or name not in parsed.tables:
        return None, catalog_label(table)
    return frozenset(parsed.tables[name]), source.label


def _fields(node: ast.ClassDef) -> Optional[tuple]:
    """A dataclass's fields in order (annotated names of its body, ClassVar aside); None for another class."""
    if not any((_is_name(d, "dataclass") or (isinstance(d, ast.Attribute) and d.attr == "dataclass")
                or (isinstance(d, ast.Call) and (_is_name(d.func, "dataclass")
                                                or (isinstance(d.func, ast.Attribute) and d.func.attr == "dataclass"))))
               for d in node.decorator_list):
        return None
    return tuple(s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                 and "ClassVar" not in ast.dump(s.annotation))


_JUDGED: dict = {}


def judge(qualname: str, kind: str, keywords: Iterable[str], near: Optional[str],
          backends: Optional[frozenset] = None) -> Optional[Judgement]:
    """What the definition of engine target ``qualname`` (a ``Target``'s) that the file ``near`` reaches says
    of a call's ``keywords``; None for a target of no pinned engine. ``backends``: for a layer that picks a
    backend from a table (``catalog.LAYER_BACKENDS``), the keys its construction allows (None: any)."""
    if engine_of(qualname) is None:
        return None
    keywords = tuple(keywords)
    module_name, name = qualname.removesuffix("[]").rsplit(".", 1)
    source = find(module_name, near)
    key = (source, qualname, kind, keywords, backends)
    got = _JUDGED.get(key)
    if got is not None and (source is None or _PARSED.get(source.path, (None,))[0] == _mtime(source.path)):
        return got
    got = _judge(qualname, kind, keywords, source, backends, module_name, name)
    if len(_JUDGED) > 4096:
        _JUDGED.clear()
    _JUDGED[key] = got
    return got


def _mtime(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _judge(qualname, kind, keywords, source, backends, module_name, name) -> Judgement:
    fallback = _catalog(qualname, keywords, backends)
    parsed = _read(source) if source is not None else None
    if parsed is None or source is None:
        return fallback
    label = source.label
    if qualname.endswith("[]"):
        # A backend picked by configuration: a candidate of the target only where the table holds its class.
        entries = parsed.tables.get(name)
        mapped = catalog.REGISTRIES.get(qualname[:-2], {})
        if entries is None:
            return fallback
        classes = {entries[k] for k in mapped if k in entries}
        if not classes:
            return Judgement(label, reachable=False)
        found = [parsed.method(c, "forward") for c in classes]
        methods = [m for m in found if m is not None]
        if len(methods) != len(found):
            return fallback
        return Judgement(label, frozenset(k for k in keywords if any(takes(m, k) for m in methods)),
                         _positional(methods[0]) if len(methods) == 1 else None)
    if name not in parsed.classes and name not in parsed.functions:
        return fallback
    layer = catalog.LAYER_BACKENDS.get(qualname)
    if layer is not None:
        got = _layer(parsed, name, keywords, backends, layer[1].rsplit(".", 1)[1])
        forward = parsed.method(name, "forward")
        return fallback if got is None or forward is None else Judgement(label, got, _positional(forward))
    if kind == "instance":
        forward = parsed.method(name, "forward")
        found = [forward] if forward is not None else \
            [parsed.method(name, m) for m in catalog.CALLED_METHODS.get(qualname, ())]
        methods = [m for m in found if m is not None]
        if not methods or len(methods) != len(found):
            return fallback  # inherited from elsewhere: the catalog's picture stands
        return Judgement(label, frozenset(k for k in keywords if any(takes(m, k) for m in methods)),
                         _positional(methods[0]) if len({_positional(m) for m in methods}) == 1 else None)
    if kind == "class":
        node = parsed.classes.get(name)
        fields = _fields(node) if node is not None else None
        if fields is not None:
            return Judgement(label, frozenset(k for k in keywords if k in fields), fields)
        init = parsed.method(name, "__init__") if node is not None else None
        if init is None:
            return fallback
        return Judgement(label, frozenset(k for k in keywords if takes(init, k)), _positional(init))
    fn = parsed.functions.get(name)
    if fn is None:
        return fallback
    return Judgement(label, frozenset(k for k in keywords if takes(fn, k)), _positional(fn))


def _catalog(qualname: str, keywords: tuple, backends: Optional[frozenset]) -> Judgement:
    """The catalog's pinned picture: a layer's backends spared by each keyword (``LAYER_BACKENDS``); any other
    target takes what the contract names."""
    label = catalog_label(qualname)
    layer = catalog.LAYER_BACKENDS.get(qualname)
    if layer is None:
        return Judgement(label)
    spared_by = layer[2]
    reached = [k for k in spared_by if backends is None or k in backends]
    return Judgement(label, frozenset(k for k in keywords if any(k in spared_by[b] for b in reached)))


def clear() -> None:
    """Forget every source read (a long-running server after files changed; tests)."""
    _PARSED.clear()
    _JUDGED.clear()
    _INSTALLED.clear()
    _TARGETS.clear()


def parameters(qualname: str, method: str, near: Optional[str]) -> Optional[tuple]:
    """The positional parameters (``self`` aside) of ``method`` of class ``qualname`` in the source the file
    ``near`` reaches; None where that source or method is not found."""
    module_name, name = qualname.rsplit(".", 1)
    parsed, _ = _load(module_name, near)
    fn = parsed.method(name, method) if parsed is not None else None
    return _positional(fn) if fn is not None else None


# -- which methods a layer's forward runs ----------------------------------------------------------------
# vLLM's CustomOp (``vllm/model_executor/custom_op.py`` of 0.33.0): ``forward`` calls ``self._forward_method``,
# which ``__init__`` sets from ``dispatch_forward``, one of these by platform. The pinned picture, used where
# no source of the class is found (vllm-ascend scanned without vLLM installed); a source found is read instead.
# The method a CustomOp runs on the CPU platform, where every tensor is a host tensor: a read there waits for
# no device, so it is no place of a per-layer host sync (and no target a per-layer call reaches one through).
HOST_PLATFORM_METHODS = frozenset({"forward_cpu"})
PINNED_DISPATCH = {
    "vllm.model_executor.custom_op.CustomOp": frozenset({
        "forward_native", "forward_cuda", "forward_hip", "forward_xpu", "forward_tpu", "forward_oot"}),
}
_BASES_DEPTH = 12  # classes followed up a hierarchy


def imports_of(body: list) -> dict:
    """The names a module's top-level imports bind -> (module, level, attribute or None): ``import a.b as c``
    binds c to ("a.b", 0, None), ``import a.b`` a to ("a", 0, None), ``from ..x import y as z`` z to ("x", 2, "y")."""
    out: dict = {}
    for stmt in _top_level(body):
        if isinstance(stmt, ast.Import):
            for a in stmt.names:
                out[a.asname or a.name.split(".")[0]] = (a.name if a.asname else a.name.split(".")[0], 0, None)
        elif isinstance(stmt, ast.ImportFrom):
            for a in stmt.names:
                if a.name != "*":
                    out[a.asname or a.name] = (stmt.module or "", stmt.level, a.name)
    return out


def qualify(dotted: str, imports: dict, module: Optional[str], is_package: bool = False) -> Optional[str]:
    """The qualified name ``dotted`` (a base class as written) stands for through the module's imports;
    None where its first name is not imported (or a relative import cannot be placed: ``module`` unknown)."""
    first, _, rest = dotted.partition(".")
    binding = imports.get(first)
    if binding is None:
        return None
    base, level, attr = binding
    if level:
        if not module:
            return None
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(level - 1):
            package = package.rpartition(".")[0]
        if not package:
            return None
        base = f"{package}.{base}" if base else package
    name = f"{base}.{attr}" if attr else base
    return f"{name}.{rest}" if rest else name


def _dotted(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _own_methods(cls: ast.ClassDef) -> dict:
    return {s.name: s for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _dispatch(cls: ast.ClassDef, methods: dict) -> frozenset:
    """The methods a ``forward`` of ``cls`` that only calls an instance attribute (``return
    self._forward_method(*args, **kwargs)``) runs: the attributes of ``self`` named (not called) where that
    attribute is set, directly or in what the method called there returns (``self._forward_method =
    self.dispatch_forward()``, which returns ``self.forward_cuda``, ``self.maybe_compile(self.forward_native)``...),
    but the CPU platform's (``HOST_PLATFORM_METHODS``). Empty for any other forward."""
    forward = methods["forward"]
    body = [s for s in forward.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    params = forward.args.posonlyargs + forward.args.args
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.Call) \
            or not params:
        return frozenset()
    this, func = params[0].arg, body[0].value.func
    if not (isinstance(func, ast.Attribute) and _is_name(func.value, this)) or func.attr in methods:
        return frozenset()
    attr, found = func.attr, set()
    for method in methods.values():
        this = _first(method)
        for node in ast.walk(method):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == attr
                                                    and _is_name(t.value, this) for t in node.targets):
                found |= _named_methods(node.value, this)
                if isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute) \
                        and _is_name(node.value.func.value, this) and node.value.func.attr in methods:
                    picker = methods[node.value.func.attr]  # set from what a method returns
                    for ret in ast.walk(picker):
                        if isinstance(ret, ast.Return) and ret.value is not None:
                            found |= _named_methods(ret.value, _first(picker))
    return frozenset(found - {"forward"} - HOST_PLATFORM_METHODS)


def _first(fn: _Function) -> str:
    params = fn.args.posonlyargs + fn.args.args
    return params[0].arg if params else ""


def _named_methods(expr: ast.AST, this: str) -> set:
    """Attributes of the instance (``this``) named in ``expr`` without being called there: the methods a
    subclass may define (``forward_oot``) as well as the class's own."""
    called = {id(n.func) for n in ast.walk(expr) if isinstance(n, ast.Call)}
    return {n.attr for n in ast.walk(expr) if isinstance(n, ast.Attribute) and _is_name(n.value, this)
            and id(n) not in called}


def forward_targets(cls: ast.ClassDef, classes: dict, imports: dict, module: Optional[str], is_package: bool,
                    near: Optional[str], depth: int = 0) -> Optional[frozenset]:
    """The methods that an instance call of ``cls`` runs in place of ``forward``, where the ``forward`` it runs
    (its own, or the first one up its bases) dispatches to one of them (vLLM's CustomOp): empty where that
    forward is an ordinary one, None where it cannot be told (a base not found). ``classes``: the module's
    top-level classes by name; ``imports``: ``imports_of`` its body; ``near``: its file."""
    methods = _own_methods(cls)
    if "forward" in methods:
        return _dispatch(cls, methods)
    if depth >= _BASES_DEPTH:
        return None
    for base in cls.bases:
        name = _dotted(base)
        if name is None:
            continue
        if name in classes and classes[name] is not cls:
            got = forward_targets(classes[name], classes, imports, module, is_package, near, depth + 1)
        else:
            qual = qualify(name, imports, module, is_package)
            got = class_forward_targets(qual, near, depth + 1) if qual else None
        if got is not None:
            return got
    return None


_TARGETS: dict = {}


def class_forward_targets(qualname: str, near: Optional[str], depth: int = 0) -> Optional[frozenset]:
    """``forward_targets`` of the class ``qualname`` as the file ``near`` reaches it (a copy in the tree, the
    installed package, then the pinned picture: ``PINNED_DISPATCH``, and the catalog's classes whose calls run
    the platform's method, ``catalog.CALLED_METHODS``)."""
    key = (qualname, os.path.dirname(near) if near else None)
    if key in _TARGETS:
        return _TARGETS[key]
    _TARGETS[key] = None  # (a cycle of imports: not known)
    module, _, name = qualname.rpartition(".")
    got = None
    parsed, source = _load(module, near) if module and depth < _BASES_DEPTH else (None, None)
    if parsed is not None and source is not None:
        package = os.path.basename(source.path) == "__init__.py"
        if name in parsed.classes:
            got = forward_targets(parsed.classes[name], parsed.classes, parsed.imports, module, package,
                                  source.path, depth)
        elif name in parsed.imports:  # re-exported
            qual = qualify(name, parsed.imports, module, package)
            got = class_forward_targets(qual, source.path, depth + 1) if qual else None
    if got is None:
        pinned = catalog.REEXPORTS.get(qualname, qualname)
        got = PINNED_DISPATCH.get(pinned)
        if got is None and pinned in catalog.CALLED_METHODS:
            got = PINNED_DISPATCH["vllm.model_executor.custom_op.CustomOp"]
    if len(_TARGETS) > 4096:
        _TARGETS.clear()
    _TARGETS[key] = got
    return got
