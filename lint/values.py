"""Where a value lives, host or device, within one function: def-use over its statements in order.

``Values(func)`` walks a libcst ``FunctionDef`` once and records, at each use of a name, what it holds: a
location (device, host or unknown; a union where branches disagree) and the sequence-length metadata it
derives from. Rules ask ``of(expr)`` for any expression in the function. Never imports torch.
"""
# Sound enough, not exact: branches (if/else, try, match) merge by union, loops are walked again until the
# values at their head stop changing (three walks at most), a name bound on one path only keeps that
# path's value, and nested functions, classes and lambdas are their own worlds (their names are unknown
# here). Values come from facts first (torch.tensor(host_list) is on the host, .cuda() on the device, a
# slice of a device tensor on the device); names are the seeds and the fallback: a parameter, attribute or
# unknown value named like metadata (``is_seqlen_name``) is device metadata as a hint.
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import libcst as cst

from .names import dotted
from .patterns import (DECLARED_CONTAINERS, DECLARED_HOST_TYPES, KEEP_METHODS, SAME_TENSOR_ATTRS, TORCH_COPIES,
                       TORCH_JOIN, TORCH_KEEP, is_seqlen_name)
from .walk import children

DEVICE, HOST, UNKNOWN = 1, 2, 4


@dataclass(frozen=True)
class Value:
    """``where``: a union of DEVICE, HOST and UNKNOWN; ``source``: the metadata name the value derives
    from (``spans`` from ``cu_seqlens``); ``items``: the elements of a host container when they are not
    host data themselves (a tuple of device tensors); None for host data all the way down."""

    where: int
    source: Optional[str] = None
    items: Optional["Value"] = None

    @property
    def device(self) -> bool:
        """It may live on the device."""
        return bool(self.where & DEVICE)

    @property
    def host(self) -> bool:
        """It lives on the host, whatever path led here."""
        return self.where == HOST


HOST_VALUE = Value(HOST)
UNKNOWN_VALUE = Value(UNKNOWN)
# What the names hold at a point of the walk (a name or a tracked ``self.x`` -> its Value); None where
# the point cannot be reached (after return, raise, break or continue).
Env = Optional[dict]
# A value, or the parts of a display or of zip/enumerate, for unpacking targets position by position.
Shape = Union[Value, tuple]

_MAX_DEPTH = 3


def _depth(v: Optional[Value]) -> int:
    n = 0
    while v is not None:
        v, n = v.items, n + 1
    return n


def _host_items(v: Value) -> Optional[Value]:
    if not v.where & HOST:
        return None
    return v.items if v.items is not None else HOST_VALUE


def _on_host_unless(test: Any) -> list:
    """The names an ``if`` test, when false, proves on the host: ``x.device.type != "cpu"``, ``not x.is_cpu``, and
    either side of an ``or`` (a false ``or`` has both sides false)."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.Or):
        return _on_host_unless(test.left) + _on_host_unless(test.right)
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not) \
            and isinstance(test.expression, cst.Attribute) and test.expression.attr.value == "is_cpu" \
            and isinstance(test.expression.value, cst.Name):
        return [test.expression.value.value]
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1 \
            and isinstance(test.comparisons[0].operator, cst.NotEqual) \
            and isinstance(test.comparisons[0].comparator, cst.SimpleString) \
            and test.comparisons[0].comparator.evaluated_value == "cpu":
        left = test.left
        if isinstance(left, cst.Attribute) and left.attr.value == "type" and isinstance(left.value, cst.Attribute) \
                and left.value.attr.value == "device" and isinstance(left.value.value, cst.Name):
            return [left.value.value.value]
    return []


def _make(where: int, source: Optional[str], items: Optional[Value]) -> Value:
    if not where & (DEVICE | UNKNOWN):
        source = None  # a host copy is no longer the device metadata
    if not where & HOST or items == HOST_VALUE:
        items = None
    elif items is not None and _depth(items) > _MAX_DEPTH:
        items = UNKNOWN_VALUE
    return Value(where, source, items)


def join(a: Optional[Value], b: Optional[Value]) -> Value:
    """What a name holds after two paths meet: either value."""
    if a is None:
        return b if b is not None else UNKNOWN_VALUE
    if b is None or a == b:
        return a
    source = a.source if a.device and a.source else b.source if b.device and b.source else a.source or b.source
    ia, ib = _host_items(a), _host_items(b)
    items = join(ia, ib) if ia is not None and ib is not None else ia or ib
    return _make(a.where | b.where, source, items)


def element(v: Value) -> Value:
    """An element of ``v``: a row of a device tensor is on the device, an element of host data is host."""
    out: Optional[Value] = None
    if v.where & DEVICE:
        out = Value(DEVICE, v.source)
    if v.where & HOST:
        out = join(out, v.items or HOST_VALUE)
    if v.where & UNKNOWN:
        out = join(out, Value(UNKNOWN, v.source))
    return out or UNKNOWN_VALUE


def combine(a: Value, b: Value) -> Value:
    """The result of an operation on both (arithmetic, comparison): a device operand makes it a device
    tensor, host operands a host one; with an unknown operand, unknown."""
    where = 0
    if a.where & DEVICE or b.where & DEVICE:
        where |= DEVICE
    if a.where & HOST and b.where & HOST:
        where |= HOST
    if (a.where & UNKNOWN and b.where & (HOST | UNKNOWN)) or (b.where & UNKNOWN and a.where & (HOST | UNKNOWN)):
        where |= UNKNOWN
    source = next((v.source for v in (a, b) if v.source and v.where & (DEVICE | UNKNOWN)), None)
    ia, ib = _host_items(a), _host_items(b)  # [q] + [k]: a host list of device tensors
    items = join(ia, ib) if ia is not None and ib is not None else None
    return _make(where, source, items)


def _members(annotation: cst.BaseExpression) -> list:
    if isinstance(annotation, cst.BinaryOperation) and isinstance(annotation.operator, cst.BitOr):
        return _members(annotation.left) + _members(annotation.right)
    return [annotation]


def _declared_union(members: list) -> Optional[Value]:
    """A union's value: each member's where all are known; where some member is host data besides ``None``
    (``torch.Tensor | Sequence[int]``) and another is not known, host or unknown: the callers may pass
    either, so nothing shows the value on the device (a name does not make it so); None where the only
    known member is ``None`` (``Optional[torch.Tensor]``: the name seeds it)."""
    flat = [m for a in members for m in _members(a)]
    values = [declared_value(a) for a in flat]
    if not values:
        return None
    if all(v is not None for v in values):
        out: Optional[Value] = None
        for v in values:
            out = join(out, v)
        return out
    hosts = [v for a, v in zip(flat, values) if v is not None and not (isinstance(a, cst.Name) and a.value == "None")]
    return _make(HOST | UNKNOWN, None, UNKNOWN_VALUE) if hosts else None


def seed(name: str) -> Value:
    """What a name holds when nothing in the function says: metadata (as named) on the device, else
    unknown."""
    if name in ("None", "True", "False"):
        return HOST_VALUE
    return Value(DEVICE, name) if is_seqlen_name(name) else UNKNOWN_VALUE


def declared_value(annotation: cst.BaseExpression) -> Optional[Value]:
    """What a declared type says a name holds: host data for ints, lists of ints, numpy arrays, a host
    container of unknown elements for a bare ``list``; None where the type does not say (a tensor may
    be on either side)."""
    if isinstance(annotation, cst.BinaryOperation) and isinstance(annotation.operator, cst.BitOr):
        return _declared_union([annotation.left, annotation.right])
    if isinstance(annotation, (cst.Name, cst.Attribute)):
        name = dotted(annotation)
        last = name.rsplit(".", 1)[-1] if name else None
        if last in DECLARED_HOST_TYPES:
            return HOST_VALUE
        if last in DECLARED_CONTAINERS:
            return _make(HOST, None, UNKNOWN_VALUE)
        return None
    if not isinstance(annotation, cst.Subscript):
        return None
    name = dotted(annotation.value)
    last = name.rsplit(".", 1)[-1] if name else None
    args = [el.slice.value for el in annotation.slice if isinstance(el.slice, cst.Index)]
    if last == "Annotated":
        return declared_value(args[0]) if args else None
    if last in ("Optional", "Union"):
        return _declared_union(args)
    if last == "NDArray" or last == "ndarray":
        return HOST_VALUE
    if last in DECLARED_CONTAINERS:
        items: Optional[Value] = None
        for a in args:
            if isinstance(a, cst.Ellipsis):
                continue
            v = declared_value(a)
            items = join(items, v if v is not None else UNKNOWN_VALUE)
        return _make(HOST, None, items if items is not None else UNKNOWN_VALUE)
    return None


def _shape_value(shape: Shape) -> Value:
    if isinstance(shape, Value):
        return shape
    items: Optional[Value] = None
    for part in shape:
        items = join(items, _shape_value(part))
    return _make(HOST, None, items)


def _join_shapes(a: Optional[Shape], b: Shape) -> Shape:
    if a is None:
        return b
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_join_shapes(x, y) for x, y in zip(a, b))
    return join(_shape_value(a), _shape_value(b))


def join_envs(*envs: Env) -> Env:
    live = [e for e in envs if e is not None]
    if not live:
        return None
    out = dict(live[0])
    for env in live[1:]:
        if env is out:
            continue
        for key, v in env.items():
            old = out.get(key)
            out[key] = v if old is None else join(old, v)
    return out


# -- what operations do --------------------------------------------------------------------------------
# Reading these gives host values, whatever the tensor's device.
_HOST_ATTRS = frozenset({"shape", "ndim", "device", "dtype", "requires_grad", "layout", "itemsize", "nbytes"})
# Methods whose result is host data whatever the receiver's device (``.cpu()``, ``.tolist()``: a copy).
_HOST_METHODS = frozenset({"cpu", "numpy", "tolist", "item", "size", "numel", "dim", "ndimension", "nelement",
                           "element_size", "data_ptr", "stride", "storage_offset", "get_device",
                           "is_contiguous", "is_floating_point", "__len__"})
# Made on the host unless a device is named.
_TORCH_FACTORIES = frozenset({"tensor", "as_tensor", "asarray", "from_numpy", "arange", "range", "zeros", "ones",
                              "empty", "full", "linspace", "logspace", "eye", "rand", "randn", "randint",
                              "randperm", "empty_strided", "frombuffer"})
_TORCH_LIKE = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
                         "randint_like"})
_TORCH_HOST = frozenset({"device", "Size", "numel", "is_tensor", "is_floating_point", "finfo", "iinfo",
                         "get_default_dtype", "is_grad_enabled"})
_TORCH_MODULES = ("torch.", "torch.nn.functional.", "F.", "torch.special.", "torch.linalg.")
_HOST_MODULES = ("np.", "numpy.", "math.", "itertools.", "operator.")
_HOST_BUILTINS = frozenset({"len", "int", "float", "bool", "str", "repr", "isinstance", "issubclass", "hasattr",
                            "callable", "id", "hash", "print", "format", "range", "ord", "chr", "divmod"})
_CONTAINER_BUILTINS = frozenset({"list", "tuple", "sorted", "reversed", "set", "frozenset"})
_NEW_METHODS = frozenset({"new_tensor", "new_zeros", "new_ones", "new_full", "new_empty"})


def _string(node: cst.BaseExpression) -> Optional[str]:
    if isinstance(node, cst.SimpleString):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def _is_cpu(text: str) -> bool:
    return text == "cpu" or text.startswith("cpu:")


class Values:
    """The values of one function's names at each of their uses (see the module's docstring).

    ``assume(test)``: True or False where the asker takes an ``if`` test's outcome as given (the branch
    not taken is still walked, but its values do not flow past the ``if``); None elsewhere.
    ``param_seed(name)``: what a parameter without a declared host type holds on entry (default:
    ``seed``); a callee's summary asks "if this parameter were a device tensor" (``summaries.py``)."""

    def __init__(self, func: cst.FunctionDef, assume: Optional[Callable[[cst.BaseExpression], Optional[bool]]] = None,
                 param_seed: Callable[[str], Value] = seed,
                 returns: Optional[Callable[[cst.Call], Optional[list]]] = None):
        self._assume = assume
        # ``returns(call)``: the arguments of a call whose definition returns a device value derived from
        # them (the callee summaries' ``Returns``), or None where nothing is known of it
        self._returns = returns
        self._uses: dict[int, Value] = {}
        self._scoped: set[str] = set()  # global and nonlocal names: not this function's to follow
        self._loops: list[tuple[list, list]] = []  # (envs at break, envs at continue) per enclosing loop
        # Parameters declared a host container (``cu_seqlens: list[torch.Tensor] | None``) and the ones of those the
        # walk found as an operand of ``-`` (``cu_seqlens[1:] - cu_seqlens[:-1]``): a list or tuple there raises
        # TypeError, so the code itself says the parameter holds no container, whatever its annotation declares
        # (keye's vision attention in aphrodite 0.24). The walk is then made again without that declaration.
        self._containers: set = set()
        self._subtracted: set = set()
        p = func.params
        for _ in range(2):
            env: dict = {}
            for param in (*p.posonly_params, *p.params, *p.kwonly_params):
                name = param.name.value
                declared = declared_value(param.annotation.annotation) if param.annotation is not None else None
                if declared is not None and declared.items is not None:
                    if name in self._subtracted:
                        declared = None
                    else:
                        self._containers.add(name)
                env[name] = declared or param_seed(name)
            for star in (p.star_arg, p.star_kwarg):
                if isinstance(star, cst.Param):
                    env[star.name.value] = _make(HOST, None, UNKNOWN_VALUE)
            self._block(func.body, env)
            if not self._subtracted & self._containers:
                break
            self._containers -= self._subtracted
            self._uses, self._scoped, self._loops = {}, set(), []

    # -- questions -------------------------------------------------------------------------------------
    def of(self, expr: cst.BaseExpression) -> Value:
        """What ``expr`` (an expression of the function) holds where it is evaluated."""
        return self._value(expr, None)

    def at(self, node: cst.CSTNode) -> Optional[Value]:
        """What the name (or tracked attribute, ``self.x``) ``node`` held at this use; None when the walk
        did not reach it (dead code, a nested function or lambda)."""
        return self._uses.get(id(node))

    # -- statements ------------------------------------------------------------------------------------
    def _block(self, block: cst.CSTNode, env: Env) -> Env:
        for stmt in getattr(block, "body", ()):
            if env is None:
                break
            env = self._stmt(stmt, env)
        return env

    # The dispatchers below test ``type(node) is ...`` (faster than isinstance chains, which mypy would
    # follow): their nodes are typed Any.
    def _stmt(self, stmt: Any, env: dict) -> Env:
        t = type(stmt)
        if t is cst.SimpleStatementLine:
            out: Env = env
            for small in stmt.body:
                if out is None:
                    break
                out = self._small(small, out)
            return out
        if t is cst.If:
            self._value(stmt.test, env)
            then = self._block(stmt.body, dict(env))
            orelse = stmt.orelse
            if isinstance(orelse, cst.If):
                other = self._stmt(orelse, dict(env))
            elif isinstance(orelse, cst.Else):
                other = self._block(orelse.body, dict(env))
            else:
                other = env
            taken = self._assume(stmt.test) if self._assume is not None else None
            if taken is not None and (then if taken else other) is not None:
                return then if taken else other
            if then is None and other is env and env is not None:
                # ``if x.device.type != "cpu": return``: past it, x is on the host
                host = [name for name in _on_host_unless(stmt.test) if name in env]
                if host:
                    other = dict(env)
                    for name in host:
                        other[name] = HOST_VALUE
            return join_envs(then, other)  # (an assumed branch that ends leaves the other to go on)
        if t is cst.For:
            items = self._elements(stmt.iter, env)
            return self._loop(stmt, env, lambda inner: self._bind(stmt.target, items, inner))
        if t is cst.While:
            return self._loop(stmt, env, lambda inner: self._value(stmt.test, inner))
        if t is cst.Try or t is getattr(cst, "TryStar", None):
            return self._try(stmt, env)
        if t is cst.With:
            for item in stmt.items:
                self._value(item.item, env)
                if item.asname is not None:
                    self._bind(item.asname.name, UNKNOWN_VALUE, env)
            return self._block(stmt.body, env)
        if t is cst.FunctionDef or t is cst.ClassDef:
            self._bind(stmt.name, UNKNOWN_VALUE, env)
            return env
        if t is cst.Match:
            self._value(stmt.subject, env)
            ends: list[Env] = [env]
            for case in stmt.cases:
                inner = dict(env)
                for node in _walk(case.pattern):
                    if isinstance(node, (cst.MatchAs, cst.MatchStar)) and node.name is not None:
                        self._bind(node.name, UNKNOWN_VALUE, inner)
                if case.guard is not None:
                    self._value(case.guard, inner)
                ends.append(self._block(case.body, inner))
            return join_envs(*ends)
        return self._small(stmt, env)  # a statement of a one-line suite (``if x: y = z``)

    def _loop(self, stmt, env: dict, enter) -> Env:
        """A for or while loop: its body walked again, from the values at its head joined with those at
        the end of the body (and at ``continue``), until they stop changing."""
        head: dict = env
        breaks: list = []
        for _ in range(3):
            inner = dict(head)
            enter(inner)
            self._loops.append(([], []))
            end = self._block(stmt.body, inner)
            breaks, continues = self._loops.pop()
            joined = join_envs(head, end, *continues)
            assert joined is not None
            if joined == head:
                break
            head = joined
        after = self._block(stmt.orelse.body, dict(head)) if stmt.orelse is not None else head
        return join_envs(after, *breaks)

    def _try(self, stmt, env: dict) -> Env:
        body = self._block(stmt.body, dict(env))
        # An exception may come from anywhere in the body: a handler sees the values before or after it.
        raised = join_envs(env, body)
        ends = []
        for handler in stmt.handlers:
            inner = dict(raised) if raised is not None else dict(env)
            if handler.type is not None:
                self._value(handler.type, inner)
            if handler.name is not None:
                self._bind(handler.name.name, UNKNOWN_VALUE, inner)
            ends.append(self._block(handler.body, inner))
        if stmt.orelse is not None and body is not None:
            body = self._block(stmt.orelse.body, body)
        out = join_envs(body, *ends)
        if stmt.finalbody is not None:
            final = self._block(stmt.finalbody.body, dict(out if out is not None else raised or env))
            return final if out is not None else None
        return out

    def _small(self, small: Any, env: dict) -> Env:
        t = type(small)
        if t is cst.Expr:
            self._value(small.value, env)
        elif t is cst.Assign:
            shape = self._shape(small.value, env)
            for target in small.targets:
                self._bind(target.target, shape, env)
        elif t is cst.AnnAssign:
            if small.value is not None:
                shape = self._shape(small.value, env)
                if isinstance(shape, Value) and shape.where == UNKNOWN:
                    shape = declared_value(small.annotation.annotation) or shape
                self._bind(small.target, shape, env)
        elif t is cst.AugAssign:
            old = self._value(small.target, env)
            new = combine(old, self._value(small.value, env))
            if isinstance(small.target, (cst.Name, cst.Attribute)):
                self._bind(small.target, new, env)
        elif t is cst.Return:
            if small.value is not None:
                self._value(small.value, env)
            return None
        elif t is cst.Raise:
            for part in (small.exc, small.cause):
                if part is not None:
                    self._value(getattr(part, "item", part), env)
            return None
        elif t is cst.Break or t is cst.Continue:
            if self._loops:
                self._loops[-1][0 if t is cst.Break else 1].append(env)
            return None
        elif t is cst.Assert:
            self._value(small.test, env)
            if small.msg is not None:
                self._value(small.msg, env)
        elif t is cst.Del:
            targets = [small.target]
            while targets:
                target = targets.pop()
                if isinstance(target, cst.Name):
                    env.pop(target.value, None)
                    _forget(env, target.value)
                elif isinstance(target, (cst.Tuple, cst.List)):
                    targets.extend(e.value for e in target.elements)
                else:
                    self._value(target, env)
        elif t is cst.Global or t is cst.Nonlocal:
            for item in small.names:
                self._scoped.add(item.name.value)
                env[item.name.value] = UNKNOWN_VALUE
        elif t is cst.Import or t is cst.ImportFrom:
            names = small.names
            if not isinstance(names, cst.ImportStar):
                for alias in names:
                    bound = alias.asname.name if alias.asname is not None else alias.name
                    while isinstance(bound, cst.Attribute):  # import a.b binds a
                        bound = bound.value
                    if isinstance(bound, cst.Name):
                        self._bind(bound, UNKNOWN_VALUE, env)
        return env

    # -- bindings --------------------------------------------------------------------------------------
    def _bind(self, target: cst.CSTNode, shape: Shape, env: dict) -> None:
        if isinstance(target, cst.Name):
            name = target.value
            if name in self._scoped:
                return
            value = _shape_value(shape)
            if value.where == UNKNOWN and is_seqlen_name(name):
                value = Value(DEVICE, name)  # named like metadata, nothing known: the hint
            env[name] = value
            _forget(env, name)
        elif isinstance(target, cst.Attribute):
            self._value(target.value, env)
            key = dotted(target)
            if key is not None:
                value = _shape_value(shape)
                if value.where == UNKNOWN and is_seqlen_name(target.attr.value):
                    value = Value(DEVICE, target.attr.value)
                env[key] = value
                _forget(env, key)
        elif isinstance(target, (cst.Tuple, cst.List)):
            elements = target.elements
            starred = any(isinstance(e, cst.StarredElement) for e in elements)
            if isinstance(shape, tuple) and not starred and len(shape) == len(elements):
                for el, part in zip(elements, shape):
                    self._bind(el.value, part, env)
                return
            each = element(_shape_value(shape))
            for el in elements:
                if isinstance(el, cst.StarredElement):
                    self._bind(el.value, _make(HOST, None, each), env)
                else:
                    self._bind(el.value, each, env)
        elif isinstance(target, cst.StarredElement):
            self._bind(target.value, _make(HOST, None, element(_shape_value(shape))), env)
        elif isinstance(target, cst.Subscript):
            self._value(target, env)  # x[i] = v: x stays where it is

    def _shape(self, expr: cst.BaseExpression, env: Env) -> Shape:
        """``expr``'s value, or its parts when it is a tuple or list display (for unpacking)."""
        if isinstance(expr, (cst.Tuple, cst.List)) and not any(isinstance(e, cst.StarredElement)
                                                               for e in expr.elements):
            return tuple(self._shape(e.value, env) for e in expr.elements)
        return self._value(expr, env)

    def _elements(self, iterable: cst.BaseExpression, env: Env) -> Shape:
        """What a ``for`` over ``iterable`` binds at each step."""
        if isinstance(iterable, cst.Call) and isinstance(iterable.func, cst.Name) \
                and not any(a.star or a.keyword for a in iterable.args):
            name, args = iterable.func.value, [a.value for a in iterable.args]
            if name == "enumerate" and len(args) == 1:
                return (HOST_VALUE, self._elements(args[0], env))
            if name == "zip" and args:
                return tuple(self._elements(a, env) for a in args)
            if name in ("reversed", "sorted", "list", "tuple", "iter") and len(args) == 1:
                return self._elements(args[0], env)
        if isinstance(iterable, (cst.Tuple, cst.List, cst.Set)) and iterable.elements \
                and not any(isinstance(e, cst.StarredElement) for e in iterable.elements):
            out: Optional[Shape] = None
            for e in iterable.elements:
                out = _join_shapes(out, self._shape(e.value, env))
            assert out is not None
            return out
        return element(self._value(iterable, env))

    # -- expressions -----------------------------------------------------------------------------------
    def _value(self, node: Any, env: Env) -> Value:
        """``node``'s value; with ``env`` (the walk) the names read are looked up there and recorded,
        without (a question) the recorded values are used."""
        t = type(node)
        if t is cst.Name:
            return self._name(node, env)
        if t is cst.Attribute:
            return self._attribute(node, env)
        if t is cst.Call:
            return self._call(node, env)
        if t is cst.Subscript:
            return self._subscript(node, env)
        if t is cst.BinaryOperation:
            if self._containers and type(node.operator) is cst.Subtract:
                for side in (node.left, node.right):
                    while type(side) is cst.Subscript:
                        side = side.value
                    # (still the declared container there: not rebound to a tensor made from it)
                    if type(side) is cst.Name and side.value in self._containers and env is not None \
                            and (held := env.get(side.value)) is not None and held.host and held.items is not None:
                        self._subtracted.add(side.value)
            return combine(self._value(node.left, env), self._value(node.right, env))
        if t is cst.UnaryOperation:
            v = self._value(node.expression, env)
            return HOST_VALUE if isinstance(node.operator, cst.Not) else v
        if t is cst.BooleanOperation:
            return join(self._value(node.left, env), self._value(node.right, env))
        if t is cst.Comparison:
            v = self._value(node.left, env)
            for c in node.comparisons:
                v = combine(v, self._value(c.comparator, env))
            if all(isinstance(c.operator, (cst.Is, cst.IsNot, cst.In, cst.NotIn)) for c in node.comparisons):
                return HOST_VALUE  # a Python bool
            return _make(v.where, v.source, None)
        if t is cst.IfExp:
            self._value(node.test, env)
            return join(self._value(node.body, env), self._value(node.orelse, env))
        if t in _LITERALS:
            return HOST_VALUE
        if t is cst.Tuple or t is cst.List or t is cst.Set:
            items: Optional[Value] = None
            for e in node.elements:
                v = self._value(e.value, env)
                items = join(items, element(v) if isinstance(e, cst.StarredElement) else v)
            return _make(HOST, None, items)
        if t is cst.Dict:
            items = None
            for e in node.elements:
                if isinstance(e, cst.DictElement):
                    self._value(e.key, env)
                    items = join(items, self._value(e.value, env))
                else:
                    self._value(e.value, env)
                    items = join(items, UNKNOWN_VALUE)
            return _make(HOST, None, items)
        if t in _COMPREHENSIONS:
            return self._comprehension(node, env)
        if t is cst.NamedExpr:
            v = self._value(node.value, env)
            if env is not None:
                self._bind(node.target, v, env)
            return v
        if t is cst.Lambda:
            return UNKNOWN_VALUE  # its body runs elsewhere, with its own names
        if t is cst.FormattedString or t is cst.ConcatenatedString:
            self._each(node, env)
            return HOST_VALUE
        self._each(node, env)
        return UNKNOWN_VALUE

    def _each(self, node: cst.CSTNode, env: Env) -> None:
        """Every expression in ``node`` (their names are recorded)."""
        for child in children(node):
            if isinstance(child, cst.BaseExpression):
                self._value(child, env)
            elif not isinstance(child, (cst.Lambda, cst.FunctionDef, cst.ClassDef)):
                self._each(child, env)

    def _name(self, node: cst.Name, env: Env) -> Value:
        if env is None:
            v = self._uses.get(id(node))
            return v if v is not None else seed(node.value)
        v = env.get(node.value)
        if v is None:
            v = seed(node.value)
        self._uses[id(node)] = v
        return v

    def _attribute(self, node: cst.Attribute, env: Env) -> Value:
        # ``self.x`` assigned earlier in the function: what was assigned.
        if env is None:
            v = self._uses.get(id(node))
            if v is not None:
                return v
        elif isinstance(node.value, (cst.Name, cst.Attribute)):
            key = dotted(node)
            if key is not None and key in env:
                self._value(node.value, env)
                v = env[key]
                self._uses[id(node)] = v
                return v
        base = self._value(node.value, env)
        attr = node.attr.value
        if attr in _HOST_ATTRS or attr.startswith("is_"):
            return HOST_VALUE
        if attr in SAME_TENSOR_ATTRS:
            return base
        if is_seqlen_name(attr):
            return Value(DEVICE, attr)
        if base.where == HOST and base.items is None:
            return HOST_VALUE  # an attribute of host data (a CPU tensor's, an int's)
        return UNKNOWN_VALUE

    def _subscript(self, node: cst.Subscript, env: Env) -> Value:
        base = self._value(node.value, env)
        sliced = False
        for el in node.slice:
            index = el.slice
            if isinstance(index, cst.Slice):
                sliced = True
                for part in (index.lower, index.upper, index.step):
                    if part is not None:
                        self._value(part, env)
            elif isinstance(index, cst.Index):
                self._value(index.value, env)
        return base if sliced else element(base)

    def _comprehension(self, node, env: Env) -> Value:
        inner = dict(env) if env is not None else None
        comp = node.for_in
        while comp is not None:
            items = self._elements(comp.iter, inner)
            if inner is not None:
                self._bind(comp.target, items, inner)
            for cond in comp.ifs:
                self._value(cond.test, inner)
            comp = comp.inner_for_in
        if isinstance(node, cst.DictComp):
            self._value(node.key, inner)
            elt = self._value(node.value, inner)
        else:
            elt = self._value(node.elt, inner)
        return _make(HOST, None, elt)

    def _call(self, node: cst.Call, env: Env) -> Value:
        func = node.func
        positional: list[Value] = []
        keywords: dict[str, cst.BaseExpression] = {}
        if isinstance(func, cst.Attribute):
            qual = dotted(func) if isinstance(func.value, (cst.Name, cst.Attribute)) else None
            module = qual is not None and qual.startswith(_TORCH_MODULES + _HOST_MODULES)
            receiver = UNKNOWN_VALUE if module else self._value(func.value, env)
        else:
            qual, module, receiver = None, False, UNKNOWN_VALUE
            if not isinstance(func, cst.Name):
                self._value(func, env)
        for arg in node.args:
            v = self._value(arg.value, env)
            if arg.keyword is not None:
                keywords[arg.keyword.value] = arg.value
            elif not arg.star:
                positional.append(v)
            else:
                positional.append(element(v) if arg.star == "*" else UNKNOWN_VALUE)
        returned = self._returns(node) if self._returns is not None else None
        if returned:
            out: Optional[Value] = None
            for expr in returned:
                out = join(out, self._value(expr, env))
            if out is not None and out.where == DEVICE:
                return Value(DEVICE, out.source)
        if isinstance(func, cst.Name):
            return self._builtin(func.value, node, positional, env)
        if not isinstance(func, cst.Attribute):
            return UNKNOWN_VALUE
        if module and qual is not None:
            return self._module_call(qual, positional, keywords, env)
        return self._method(receiver, func.attr.value, node, positional, keywords, env)

    def _builtin(self, name: str, node: cst.Call, args: list[Value], env: Env) -> Value:
        if name in _HOST_BUILTINS:
            return HOST_VALUE
        if name in _CONTAINER_BUILTINS:
            return _make(HOST, None, element(args[0]) if args else None)
        if name in ("max", "min", "sum") and args:
            if len(args) == 1:  # over the elements: a device tensor's are 0-d device tensors
                v = element(args[0])
                return combine(v, HOST_VALUE) if name == "sum" else v
            out = args[0]
            for v in args[1:]:
                out = join(out, v)
            return out
        if name in ("abs", "round") and len(args) == 1:
            return _make(args[0].where, args[0].source, None)
        if name == "getattr" and len(node.args) >= 2:
            attr = _string(node.args[1].value)
            if attr is not None and is_seqlen_name(attr):
                return Value(DEVICE, attr)
        return UNKNOWN_VALUE

    def _module_call(self, qual: str, args: list[Value], keywords: dict, env: Env) -> Value:
        if qual.startswith(_HOST_MODULES):
            return HOST_VALUE  # numpy, math: host data
        name = qual.rsplit(".", 1)[1]
        prefix = qual[: -len(name) - 1]
        if prefix not in ("torch", "torch.nn.functional", "F", "torch.special", "torch.linalg"):
            return UNKNOWN_VALUE  # torch.cuda.*, torch.distributed.*, torch.ops.*: not tensor math here
        if name in _TORCH_HOST:
            return HOST_VALUE
        device = self._device_keyword(keywords, env)
        if name in _TORCH_FACTORIES:
            if device is not None:
                return Value(device)
            data = args[0] if args and name in TORCH_COPIES else None
            if data is not None and data.device:  # a copy of a device tensor stays on its device
                where = data.where & (DEVICE | HOST) | (HOST if data.where & UNKNOWN else 0)
                return _make(where, data.source, None)
            return HOST_VALUE  # from Python data (or from what is not known to be a device tensor)
        if name in _TORCH_LIKE:
            if device is not None:
                return Value(device)
            return _make(args[0].where, None, None) if args else UNKNOWN_VALUE
        if name in TORCH_JOIN and args:
            each = element(args[0])  # torch.cat([a, b]): where its tensors are
            return _make(each.where, each.source, None)
        if name in TORCH_KEEP and args:
            out = args[0]
            for v in args[1:]:
                if v.where & DEVICE:
                    out = combine(out, v)
            return _make(out.where, out.source, None)
        return UNKNOWN_VALUE

    def _device_keyword(self, keywords: dict, env: Env) -> Optional[int]:
        """Where ``device=`` puts a new tensor: None when not given (or None)."""
        node = keywords.get("device")
        if node is None or (isinstance(node, cst.Name) and node.value == "None"):
            return None
        return self._device_of(node, env)

    def _device_of(self, node: cst.BaseExpression, env: Env) -> int:
        """Where a device argument (``"cpu"``, ``torch.device("cuda")``, ``x.device``, ``device``) points:
        anything but the CPU is the device; ``x.device`` is where ``x`` is."""
        text = _string(node)
        if text is None and isinstance(node, cst.Call) and dotted(node.func) == "torch.device" and node.args:
            text = _string(node.args[0].value)
        if text is not None:
            return HOST if _is_cpu(text) else DEVICE
        if isinstance(node, cst.Attribute) and node.attr.value == "device":
            if self._value(node.value, env).where == HOST:
                return HOST
        return DEVICE

    def _method(self, receiver: Value, method: str, node: cst.Call, args: list[Value], keywords: dict,
                env: Env) -> Value:
        if method in _HOST_METHODS:
            return HOST_VALUE
        if method == "cuda":
            return _make(DEVICE, receiver.source, None)
        if method == "to":
            return self._to(receiver, node, keywords, env)
        if method in _NEW_METHODS:
            device = self._device_keyword(keywords, env)
            return Value(device) if device is not None else _make(receiver.where, None, None)
        if receiver.where == HOST:
            if method in ("pop", "get", "__getitem__"):
                return element(receiver)
            if method == "copy":
                return receiver
            if method == "pin_memory" or receiver.items is None:
                return HOST_VALUE  # a CPU tensor's results, a Python value's
            return UNKNOWN_VALUE
        if method in KEEP_METHODS:
            return _make(receiver.where, receiver.source, None)
        return UNKNOWN_VALUE

    def _to(self, receiver: Value, node: cst.Call, keywords: dict, env: Env) -> Value:
        """``x.to("cpu")`` is on the host, ``x.to("cuda")``, ``x.to(device)`` and ``x.to(device=...)`` on
        the device, ``x.to(torch.int32)`` where ``x`` is, ``x.to(y)`` where ``y`` is."""
        where: Optional[int] = None
        if "device" in keywords:
            where = self._device_keyword(keywords, env)
        else:
            first = next((a.value for a in node.args if a.keyword is None and not a.star), None)
            if first is not None:
                where = self._to_target(first, env)
        if where is None:
            return _make(receiver.where, receiver.source, None)
        return _make(where, receiver.source if where & DEVICE else None, None)

    def _to_target(self, arg: cst.BaseExpression, env: Env) -> Optional[int]:
        """Where ``.to(arg)`` moves a tensor; None: it stays (a dtype)."""
        if _string(arg) is not None or (isinstance(arg, cst.Call) and dotted(arg.func) == "torch.device"):
            return self._device_of(arg, env)
        if isinstance(arg, cst.Attribute):
            if arg.attr.value == "device":
                return self._device_of(arg, env)
            return None  # torch.int32, self.dtype
        if isinstance(arg, cst.Name):
            lowered = arg.value.lower()
            if "dtype" in lowered:
                return None
            if "device" in lowered or lowered in ("dev", "cuda"):
                return DEVICE
            v = self._value(arg, None) if env is None else env.get(arg.value)
            if v is not None and v.where in (DEVICE, HOST):
                return v.where  # x.to(other): where the other tensor is
        return None


_LITERALS = frozenset({cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.Ellipsis})
_COMPREHENSIONS = frozenset({cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp})


def _forget(env: dict, name: str) -> None:
    """``name`` was bound again: the attributes tracked under it (``name.x``) are no longer known."""
    prefix = name + "."
    for key in [k for k in env if k.startswith(prefix)]:
        del env[key]


def _walk(node: cst.CSTNode):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(children(n))
