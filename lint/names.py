"""Scopes and bindings of one file: resolves a call's callee to a qualified import name.

Filled during the one walk that also finds the calls (``scopes.Collector``), resolved per call after.
"""
# Why an import table of our own and not libcst's QualifiedNameProvider: the provider is exact but
# costs 4-8x the libcst parse (scope analysis of every name), against ~0.1-0.2x for this table plus
# the checks, on the same files (bench/lint_speed.py, bench/results/lint_speed.md). The targets only
# need a file's imports (module- and function-level, aliases, relative and star imports), the names
# that shadow them (def, class, assignment, parameter, loop/with/except targets, global) and the
# instances made from targets (attn = C(), self.attn = C()).
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union, cast

import libcst as cst


class FuncInfo:
    """A ``def``: its decorators (resolved after the walk) and the enclosing function."""

    __slots__ = ("name", "decorators", "def_scope", "def_seq", "parent", "qualname", "_guarded")

    def __init__(self, name, decorators, def_scope, def_seq, parent, qualname):
        self.name = name
        self.decorators = decorators
        self.def_scope = def_scope
        self.def_seq = def_seq
        self.parent: Optional[FuncInfo] = parent
        self.qualname: Optional[str] = qualname
        self._guarded: Optional[bool] = None


class ClassInfo:
    """A ``class``: what each ``self.<attr> = <call>`` stored, across all its methods."""

    __slots__ = ("name", "qualname", "attrs")

    def __init__(self, name: str, qualname: Optional[str]):
        self.name = name
        self.qualname = qualname
        # attr -> (callee, scope, seq, the call) of each ``self.<attr> = <call>``
        self.attrs: dict[str, list[tuple[cst.BaseExpression, "Scope", int, cst.Call]]] = {}


@dataclass
class Binding:
    """``kind``: import (value: qualname), def (FuncInfo/ClassInfo), call (``x = f(...)``; value:
    (callee expression, scope, seq)), self (the method's first parameter; value: ClassInfo), local."""

    seq: int
    kind: str
    value: object = None


@dataclass(eq=False)
class Scope:
    kind: str  # module | class | function | lambda | comp
    parent: Optional["Scope"]
    info: Union[FuncInfo, ClassInfo, None] = None
    bindings: dict[str, list[Binding]] = field(default_factory=dict)
    global_names: set[str] = field(default_factory=set)
    nonlocal_names: set[str] = field(default_factory=set)
    star_modules: list[str] = field(default_factory=list)
    # (seq, dotted object, attribute, value is None, value) for ``obj.attr = value`` in this function.
    attr_stores: list[tuple] = field(default_factory=list)
    # ``name = a.b`` in this function: name -> the dotted expressions it was bound to (aliases of a record).
    aliases: dict[str, list[str]] = field(default_factory=dict)

    def function_scope(self) -> "Scope":
        """The scope whose statements run together: comprehensions and lambdas belong to it."""
        s = self
        while s.kind in ("comp", "lambda") and s.parent is not None:
            s = s.parent
        return s


@dataclass(frozen=True)
class Ref:
    """What a callee expression is: ``qual`` (an import or a module-level def of this file, with its
    qualified name), ``inst`` (an instance of class ``qual``; ``method`` is the attribute called on
    it, '' for the instance itself) or ``self`` (a method's self, of class ``cls``)."""

    kind: str
    qual: str = ""
    method: str = ""
    guarded: bool = False
    cls: Optional[ClassInfo] = None


def dotted(expr: cst.BaseExpression) -> Optional[str]:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(expr, cst.Attribute):
        parts.append(expr.attr.value)
        expr = expr.value
    if isinstance(expr, cst.Name):
        parts.append(expr.value)
        return ".".join(reversed(parts))
    return None


def stored_names(node: cst.CSTNode) -> list:
    """The names ``node`` itself stores to, if it is a binding: an assignment's target, an augmented or
    annotated one (with a value), a loop's or comprehension's target, ``with ... as``/``except ... as`` names and
    ``:=`` (tuple and starred targets unpacked); [] for any other node."""
    targets: list = []
    if isinstance(node, cst.AssignTarget):
        targets.append(node.target)
    elif isinstance(node, cst.AugAssign) or (isinstance(node, cst.AnnAssign) and node.value is not None):
        targets.append(node.target)
    elif isinstance(node, (cst.For, cst.CompFor)):
        targets.append(node.target)
    elif isinstance(node, cst.AsName):
        targets.append(node.name)
    elif isinstance(node, cst.NamedExpr):
        targets.append(node.target)
    out: list = []
    while targets:
        t = targets.pop()
        if isinstance(t, cst.Name):
            out.append(t)
        elif isinstance(t, (cst.Tuple, cst.List)):
            targets.extend(e.value for e in t.elements)
        elif isinstance(t, cst.StarredElement):
            targets.append(t.value)
    return out


def is_none(expr: Optional[cst.BaseExpression]) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "None"


GUARD_PACKAGE = "guardlint.guard"
_MAX_DEPTH = 8  # x = f(); y = x; ... chains longer than this are not followed


class Resolver:
    """Resolves callee expressions against the scopes filled by ``scopes.Collector``."""

    def __init__(self, module: Scope, instance_targets, known_targets):
        self.module = module
        self.instance_targets = instance_targets
        self.known_targets = known_targets

    # -- names ---------------------------------------------------------------------------------
    def lookup(self, scope: Scope, name: str, seq: int) -> Optional[Binding]:
        s: Optional[Scope] = scope
        direct = True  # still in the scope (or comprehension) where the name is used
        while s is not None:
            if s.kind == "class" and not direct:
                s = s.parent
                continue
            if name in s.global_names:
                s, direct = self.module, False
            elif name in s.nonlocal_names:
                s, direct = s.parent, False
                continue
            binds = s.bindings.get(name)
            if binds:
                if direct:
                    before = [b for b in binds if b.seq < seq]
                    return before[-1] if before else binds[-1]
                # A function body runs after its enclosing scope has finished binding.
                return binds[-1]
            if s.kind != "comp":
                direct = False
            s = s.parent
        return None

    def resolve(self, expr: cst.BaseExpression, scope: Scope, seq: int, depth: int = 0) -> Optional[Ref]:
        if depth > _MAX_DEPTH:
            return None
        if isinstance(expr, cst.Name):
            return self._resolve_name(expr.value, scope, seq, depth)
        if isinstance(expr, cst.Attribute):
            base = self.resolve(expr.value, scope, seq, depth + 1)
            if base is None:
                return None
            attr = expr.attr.value
            if base.kind == "qual":
                return Ref("qual", f"{base.qual}.{attr}")
            if base.kind == "inst" and not base.method:
                return Ref("inst", base.qual, method=attr)
            if base.kind == "self" and base.cls is not None:
                for value, s, sq, _ in base.cls.attrs.get(attr, ()):
                    made = self._instance_made_by(value, s, sq, depth + 1)
                    if made is not None:
                        return made
            return None
        if isinstance(expr, cst.Call):
            return self._instance_made_by(expr.func, scope, seq, depth + 1)
        if isinstance(expr, cst.Subscript):
            return self._registry_entry(expr, scope, seq, depth + 1)
        return None

    def _registry_entry(self, expr: cst.Subscript, scope, seq, depth) -> Optional[Ref]:
        """``TABLE[key]`` of a dict of classes the catalog knows (``REGISTRIES``): a constant key is the
        class it maps to (None when it names no target); any other key may be any of them (``TABLE[]``)."""
        base = self.resolve(expr.value, scope, seq, depth)
        if base is None or base.kind != "qual" or len(expr.slice) != 1:
            return None
        from guardlint.contracts.catalog import REGISTRIES

        table = REGISTRIES.get(base.qual)
        if table is None:
            return None
        index = expr.slice[0].slice
        if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
            key = index.value.evaluated_value  # bytes for b"...": no class is registered under one
            mapped = table.get(key) if isinstance(key, str) else None
            return Ref("qual", mapped) if mapped else None
        return Ref("qual", base.qual + "[]")

    def _instance_made_by(self, callee, scope, seq, depth) -> Optional[Ref]:
        ref = self.resolve(callee, scope, seq, depth)
        if ref is not None and ref.kind == "qual" and ref.qual in self.instance_targets:
            return Ref("inst", ref.qual)
        return None

    def _resolve_name(self, name: str, scope: Scope, seq: int, depth: int) -> Optional[Ref]:
        b = self.lookup(scope, name, seq)
        if b is None:
            # ``from m import *``: the name may come from any of them; only a known target counts.
            for m in self.module.star_modules:
                q = f"{m}.{name}"
                if q in self.known_targets:
                    return Ref("qual", q)
            return None
        if b.kind == "import":
            return Ref("qual", cast(str, b.value))
        if b.kind == "def":
            info = cast(Union[FuncInfo, ClassInfo], b.value)
            if info.qualname is None:
                return None
            return Ref("qual", info.qualname, guarded=isinstance(info, FuncInfo) and self.guarded(info))
        if b.kind == "call":
            callee, s, sq = cast(tuple, b.value)[:3]
            return self._instance_made_by(callee, s, sq, depth + 1)
        if b.kind == "self":
            return Ref("self", cls=cast(ClassInfo, b.value))
        return None

    # -- the guard --------------------------------------------------------------------------------
    def guarded(self, info: FuncInfo) -> bool:
        """True when ``info`` is decorated with a decorator from ``guardlint.guard``."""
        if info._guarded is None:
            info._guarded = False
            for dec in info.decorators:
                callee = dec.func if isinstance(dec, cst.Call) else dec
                ref = self.resolve(callee, info.def_scope, info.def_seq)
                if ref is not None and ref.kind == "qual" and (
                        ref.qual == GUARD_PACKAGE or ref.qual.startswith(GUARD_PACKAGE + ".")):
                    info._guarded = True
                    break
        return info._guarded

    def inside_guarded(self, info: Optional[FuncInfo]) -> bool:
        while info is not None:
            if self.guarded(info):
                return True
            info = info.parent
        return False
