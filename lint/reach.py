"""Per-layer code bound at run time: the defs that per-layer places run through an object whose class the tree picks
while it runs, for GL104 to check as per-layer code.

A layer's forward (``summaries``' places: a layer class's forward, a def registered in an attention registry) that
calls a method of ``self.<member>``, where the member is built by a typed factory (``self.impl = self.backend.
get_impl_cls()(...)`` with ``get_impl_cls() -> type[AttentionImpl]``, or ``self.x: Base = make(...)``), runs the
method of whichever subclass of that base the run picked: each subclass defined in the tree that overrides it
(class hierarchy analysis), and, in those classes, each override of what ``self.<m>()`` calls there. A def a module
installs as a layer class's forward (``Qwen2VLAttention.forward = patched``) runs in place of that forward. The
defs so reached, and what they call in turn (methods, functions of the tree, imports made inside a def), run once
per layer: each becomes a per-layer place of its own, with the path that reaches it, and GL104 reports its reads
where they are. Defs reached only through calls the tree binds statically are not places here: the callee
summaries already report those at their calls.

Types come from facts, never from names: annotations of the member, of a local, of a parameter; return annotations
of the factory (a method of the typed receiver, a function the module imports); ``type[X]`` is the class X, its
call an instance of X. A member whose type is not told is not followed.
"""
from __future__ import annotations

import ast
import os
from collections import deque
from typing import Any, Optional

from .prefilter import _dotted
from .summaries import callee_text

# Defs visited from the places in one run at most (a bound, not a budget).
MAX_VISITED = 4000
# Hops of a type's evaluation (a member assigned from another member's factory, and so on).
_MAX_DEPTH = 6
_OPTIONAL = ("Optional", "typing.Optional")
_UNION = ("Union", "typing.Union")
_TYPE = ("type", "Type", "typing.Type")


class Reach:
    """The defs run per layer through run-time bindings, over the files ``summaries`` reads."""

    def __init__(self, summaries: Any):
        self.s = summaries
        self._subclasses: dict = {}  # (path, class) -> [(FileFacts, class)], its direct subclasses
        self._member_types: dict = {}  # (path, class, member) -> list of types (in progress: [])

    # -- the walk ---------------------------------------------------------------------------------------
    def contexts(self) -> dict:
        """{path as given: {qualname: ((why it runs per layer, the path), the parameters every call that binds it
        passes, those none passes)}} of
        the defs bound at run time, each with the shortest path from a per-layer place that reaches it."""
        todo: deque = deque()
        for f in list(self.s.facts_by_path()):
            for qual in f.places:
                todo.append((f, qual, (qual,), False, None, None, None))
            for name, module, line, target in f.installs:
                got = self._installed(f, name, module)
                if got is not None:
                    hop = f"{target} = {name} ({os.path.basename(f.path)}:{line})"
                    todo.append((got[0], got[1], (hop, got[1]), True, None, None, None))
        seen: dict = {}
        first: dict = {}  # key of a def bound at run time -> (FileFacts, qualname, its shortest path)
        incoming: dict = {}  # that key -> [(the caller's key, the call)], the calls that bind it
        while todo and len(seen) < MAX_VISITED:
            f, qual, trail, bound, caller, call, recv = todo.popleft()
            key = (os.path.normpath(f.path), qual)
            if bound:
                incoming.setdefault(key, []).append((caller, call, trail))
            # (a method is walked once per class its instance is known as: ``self.m()`` there depends on it)
            visit = (key, (os.path.normpath(recv[0].path), recv[1]) if recv is not None else None)
            if visit in seen and (seen[visit] or not bound):
                continue
            seen[visit] = bound
            if bound and key not in first:
                first[key] = (f, qual, trail)
            for (tf, tqual), how, c, trecv in self._callees(f, qual, bound, recv):
                step = (f"{how}: {tqual}",) if how is not None else (tqual,)
                todo.append((tf, tqual, trail + step, bound or how is not None, key, c, trecv))
        given = self._given_everywhere(incoming, first)
        absent = self._absent_everywhere(incoming, first)
        out: dict = {}
        trails: dict = {}
        for key, (f, qual, trail) in first.items():
            trail = self._best_trail(key, incoming, first, given, trails, set()) or trail
            if key[0] in self.s.tree_files():
                out.setdefault(f.path, {})[qual] = ((f"{qual}, which runs once per layer",
                                                      f"{qual} runs once per layer: {' -> '.join(trail)}"),
                                                     given.get(key) or frozenset(), absent.get(key) or frozenset())
        return out

    def _best_trail(self, key: tuple, incoming: dict, first: dict, given: dict, trails: dict, visiting: set) -> tuple:
        """The path shown for a bound def: back from it, at each def through the binding call that passes the most
        (the path a read that needs an argument is on), up to the first def not bound at run time."""
        if key in trails:
            return trails[key]
        edges = incoming.get(key) or []
        if not edges or key in visiting:
            return ()
        visiting.add(key)
        f, qual, _ = first[key]
        caller, call, trail = min(edges, key=lambda e: (-len(self._passed(e[0], e[1], (f, qual), given)), len(e[2])))
        head = self._best_trail(caller, incoming, first, given, trails, visiting) if caller in first else ()
        visiting.discard(key)
        trails[key] = (*head, trail[-1]) if head else trail
        return trails[key]

    def _given_everywhere(self, incoming: dict, first: dict) -> dict:
        """Per def bound at run time, the parameters every call that binds it passes a value (not None): a read the
        def makes only when one of them is None (``host if host is not None else cu.tolist()``) is not made per
        layer. An argument that is a parameter of a caller bound at run time counts where that caller's own calls
        pass it (to a fixed point, from "all")."""
        return self._everywhere(incoming, first, True)

    def _absent_everywhere(self, incoming: dict, first: dict) -> dict:
        """Per def bound at run time, the parameters no call that binds it passes (or passes None): what the def
        does only when one is given (after ``if cu_seqlens is None: return ...``) is not done per layer."""
        return self._everywhere(incoming, first, False)

    def _everywhere(self, incoming: dict, first: dict, given: bool) -> dict:
        out: dict = {key: None for key in incoming}  # None: every parameter (the fixed point's start)
        for _ in range(8):
            changed = False
            for key, edges in incoming.items():
                new = None
                for caller, call in self._binding_calls(edges, incoming, set()):
                    got = self._passed(caller, call, first[key], out, given)
                    new = got if new is None else new & got
                new = new or frozenset()
                if new != out[key]:
                    out[key], changed = new, True
            if not changed:
                break
        return out

    def _binding_calls(self, edges: list, incoming: dict, seen: set) -> list:
        """[(caller, call)] of ``edges``, where a caller only hands on what it was given (``self.forward_native(*args,
        **kwargs)`` in a def of ``(self, *args, **kwargs)``: vLLM's CustomOp.forward_oot), the calls that bind that
        caller in its place."""
        out = []
        for caller, call, _ in edges:
            node = self.s.def_node_by_key(caller) if caller is not None and call is not None else None
            if node is not None and _forwards_all(node[0], call) and caller not in seen and incoming.get(caller):
                out.extend(self._binding_calls(incoming[caller], incoming, seen | {caller}))
            else:
                out.append((caller, call))
        return out

    def _passed(self, caller: Optional[tuple], call: Any, target: tuple, known: dict, given: bool = True) -> frozenset:
        """The parameters of ``target`` the call passes a value (``given``), else those it leaves out or passes
        None. A caller's parameter handed on counts as the caller's own calls have it (``known``, where the caller is
        bound at run time: None for all); elsewhere it counts as a value."""
        if call is None or caller is None:
            return frozenset()  # installed: the engine's call, not seen here
        got = self.s.def_node(target[0], target[1])
        caller_node = self.s.def_node_by_key(caller)
        if got is None or caller_node is None:
            return frozenset()
        node, cls = got
        a = node.args
        params = [p.arg for p in (*a.posonlyargs, *a.args)]
        skip = 1 if cls is not None and not any(_dotted(d) == "staticmethod" for d in node.decorator_list) else 0
        c = caller_node[0].args
        own = {p.arg for p in (*c.posonlyargs, *c.args, *c.kwonlyargs)}
        theirs = known.get(caller, frozenset()) if caller in known else None

        def value(arg: Any) -> bool:  # a value, not None
            if type(arg) is ast.Constant and arg.value is None:
                return False
            if type(arg) is ast.Name and arg.id in own and caller in known:
                return theirs is None or arg.id in theirs if given else not (theirs is None or arg.id in theirs)
            return True

        passed: dict = {}
        for i, arg in enumerate(call.args):
            if type(arg) is ast.Starred:
                return frozenset()  # *args: what it holds is not told
            if skip + i < len(params):
                passed[params[skip + i]] = arg
        for k in call.keywords:
            if k.arg is None:
                return frozenset()  # **kwargs: what it holds is not told
            passed[k.arg] = k.value
        if given:
            return frozenset(p for p, arg in passed.items() if value(arg))
        every = {*params[skip:], *(p.arg for p in a.kwonlyargs)}
        return frozenset(p for p in every if p not in passed or not value(passed[p]))

    def _callees(self, f: Any, qual: str, bound: bool, recv: Optional[tuple]) -> list:
        """[((FileFacts, qualname), how or None, the call, the class its instance is known as or None)]: the defs a
        call in ``qual`` reaches; ``how`` names the run-time binding a call goes through (None: bound statically).
        ``bound``: ``qual`` is itself bound at run time (its plain calls of the tree's functions are followed too,
        and ``self.m()`` reaches every override of m in the subclasses of ``recv``, the class ``self`` is known as:
        the method's own class where None)."""
        got = self.s.def_node(f, qual)
        if got is None:
            return []
        node, cls = got
        fn = self.s.function(f, qual)
        calls = fn.calls if fn is not None else {}
        out: list = []
        this = _self_name(node) if cls is not None else None
        local = _local_imports(node) if bound else {}
        for call in _own_calls(node):
            func = call.func
            receiver = func.value if type(func) is ast.Attribute else None
            if this is not None and type(receiver) is ast.Name and receiver.id == this:
                # self.m(...), or self.module(...)
                # (every override only where the class self is known as came from a binding: a base's method
                # reached through a module held statically is not told which subclass it runs for)
                targets = self._self_calls(recv or (f, cls), func.attr, bound and recv is not None) \
                    or self._held(f, cls, func.attr)
            elif this is not None and type(receiver) is ast.Attribute and type(receiver.value) is ast.Name \
                    and receiver.value.id == this:  # self.member.m(...)
                targets = self._member_calls(f, cls, receiver.attr, func.attr)
            elif type(func) is ast.Name and func.id in local:  # imported inside the def
                target = self._imported(f, *local[func.id])
                targets = [(target, None, None)] if target is not None else []
            else:
                ref = calls.get(callee_text(func))
                if ref is None or not (ref[0] == "each" or bound and ref[0] in ("name", "attr", "table")):
                    continue
                targets = [((t[0], t[1]), None, None) for t in self.s.resolve_all(f, ref)]
            out.extend((target, how, call, trecv) for target, how, trecv in targets)
        return out

    def _held(self, f: Any, cls: str, member: str) -> list:
        """``self.<member>(...)``: the forward of the module the member holds, built by a constructor the class
        calls (bound statically), else by a typed factory (bound at run time: each subclass's forward too)."""
        return self._member_calls(f, cls, member, None) \
            or [((t[0], t[1]), None, None) for t in self.s.resolve_all(f, ("self", cls, member))]

    def _self_calls(self, recv: tuple, name: str, bound: bool) -> list:
        """``self.<name>()`` where ``self`` is known as the class ``recv``: the method an instance of it runs; where
        the call is bound at run time, each override of it in the subclasses of ``recv`` too (the instance may be any
        of them), each with the class it is then known as."""
        out = []
        got = self.s.method_of(recv[0], recv[1], name)
        if got is not None:
            out.append(((got[0], got[1]), None, recv))
        if bound:
            for sf, scls in self._all_subclasses(*recv):
                own = self.s.own_method(sf, scls, name)
                if own is not None:
                    out.append(((sf, own), None, (sf, scls)))
        return out

    def _member_calls(self, f: Any, cls: str, member: str, name: Optional[str]) -> list:
        """``self.<member>.<name>()`` (``name`` None: ``self.<member>(...)``, the methods an instance call runs):
        through a member of a told type, that method of the type, and, where the type is open (a typed factory's, an
        annotation's), each override of it in the type's subclasses, as run-time bound calls."""
        out = []
        for kind, (tf, tcls) in self.member_type(f, cls, member, 0):
            if kind == "cls":
                continue
            how = f"self.{member} (whichever {tcls.rpartition('.')[2]} the run picks)" if kind == "inst" else None
            for method in (name,) if name is not None else self.s.call_methods(tf, tcls):
                got = self.s.method_of(tf, tcls, method)
                if got is not None:
                    out.append(((got[0], got[1]), how, (tf, tcls)))
            if kind == "exact":
                continue  # built by its constructor: that class's method, bound statically
            for sf, scls in self._all_subclasses(tf, tcls):
                for method in (name,) if name is not None else self.s.call_methods(sf, scls):
                    own = self.s.own_method(sf, scls, method)
                    if own is not None:
                        out.append(((sf, own), how, (sf, scls)))
        return out

    def _installed(self, f: Any, name: str, module: Optional[str]) -> Optional[tuple]:
        if module is not None:
            return self._imported(f, module, name)
        got = self.s.resolve(f, ("name", name))
        return (got[0], got[1]) if got is not None else None

    def _imported(self, f: Any, module: str, name: str) -> Optional[tuple]:
        target = self.s.module(module)
        if target is None:
            return None
        got = self.s.resolve(target, ("name", name))
        return (got[0], got[1]) if got is not None else None

    # -- the class hierarchy ----------------------------------------------------------------------------
    def _all_subclasses(self, f: Any, cls: str) -> list:
        """The classes derived from ``cls`` (of ``f``), at any remove, among the files read so far and the tree's
        files under ``f``'s folder that name it (a base's implementations usually sit beside it or below)."""
        out: list = []
        todo, seen = [(f, cls)], {(os.path.normpath(f.path), cls)}
        while todo:
            for sf, scls in self._direct_subclasses(*todo.pop()):
                key = (os.path.normpath(sf.path), scls)
                if key not in seen:
                    seen.add(key)
                    out.append((sf, scls))
                    todo.append((sf, scls))
        return out

    def _direct_subclasses(self, f: Any, cls: str) -> list:
        key = (os.path.normpath(f.path), cls)
        if key not in self._subclasses:
            name = cls.rpartition(".")[2]
            self.s.read_beside(os.path.dirname(key[0]), name.encode())
            found = []
            for ff in list(self.s.facts_by_path()):
                for sub, (bases, _) in list(ff.classes.items()):
                    # the base as written ends with the class's name, and resolves to that very class
                    if any(b.rpartition(".")[2] == name and self._is(self.s.class_of(ff, b), key) for b in bases):
                        found.append((ff, sub))
            self._subclasses[key] = found
        return self._subclasses[key]

    @staticmethod
    def _is(found: Optional[tuple], key: tuple) -> bool:
        return found is not None and (os.path.normpath(found[0].path), found[1]) == key

    # -- types ------------------------------------------------------------------------------------------
    def member_type(self, f: Any, cls: str, member: str, depth: int) -> list:
        """[(kind, (FileFacts, class))]: what ``self.<member>`` holds, as the methods of ``cls`` (or of its bases)
        store it, where a fact tells: "exact" (an instance its class's constructor made), "inst" (an instance of
        the class or of a subclass: a typed factory's, an annotation's) or "cls" (the class itself, ``type[X]``)."""
        key = (os.path.normpath(f.path), cls, member)
        if key in self._member_types:
            return self._member_types[key]
        self._member_types[key] = []
        out: list = []
        for owner, name in self._mro(f, cls):
            node = self.s.class_node(owner, name)
            if node is None:
                continue
            for method in node.body:
                if type(method) not in (ast.FunctionDef, ast.AsyncFunctionDef):
                    continue
                this = _self_name(method)
                for stmt in ast.walk(method):
                    value = annotation = None
                    if type(stmt) is ast.Assign and any(_is_member(t, this, member) for t in stmt.targets):
                        value = stmt.value
                    elif type(stmt) is ast.AnnAssign and _is_member(stmt.target, this, member):
                        annotation = stmt.annotation
                    else:
                        continue
                    types = self._annotation(owner, annotation) if annotation is not None else \
                        self._expr(owner, value, method, name, depth + 1)
                    out.extend(t for t in types if t not in out)
            if out:
                break
        self._member_types[key] = out
        return out

    def _mro(self, f: Any, cls: str) -> list:
        out: list = []
        todo, seen = [(f, cls)], set()
        while todo and len(out) < 16:
            owner, name = todo.pop(0)
            if (owner.path, name) in seen:
                continue
            seen.add((owner.path, name))
            out.append((owner, name))
            for base in owner.classes.get(name, ((), {}))[0]:
                found = self.s.class_of(owner, base)
                if found is not None:
                    todo.append(found)
        return out

    def _expr(self, f: Any, expr: Any, method: Any, cls: str, depth: int) -> list:
        if depth > _MAX_DEPTH or expr is None:
            return []
        t = type(expr)
        if t is ast.Call:
            return [("exact" if kind == "class" else "inst", c)
                    for kind, c in self._callee_types(f, expr.func, method, cls, depth) if kind in ("cls", "class")] \
                + self._returns(f, expr.func, method, cls, depth)
        if t is ast.Attribute and type(expr.value) is ast.Name and expr.value.id == _self_name(method):
            return self.member_type(f, cls, expr.attr, depth)
        if t is ast.Name:
            return self._local(f, expr.id, method, cls, depth)
        return []

    def _callee_types(self, f: Any, func: Any, method: Any, cls: str, depth: int) -> list:
        """The types of what a call's callee is: ``Cls`` itself ("class": its call makes exactly a Cls), a member or
        local holding ``type[X]`` ("cls": its call makes an X or a subclass)."""
        if type(func) is ast.Name:
            if func.id in _bound_names(method):
                return self._local(f, func.id, method, cls, depth)
            found = self.s.named_class(f, func.id)
            return [("class", found)] if found is not None else []
        if type(func) is ast.Attribute and type(func.value) is ast.Name and func.value.id == _self_name(method):
            return self.member_type(f, cls, func.attr, depth)
        dotted = _dotted(func)
        if dotted is not None and dotted.split(".")[0] not in _bound_names(method):
            found = self.s.class_of(f, dotted)
            return [("class", found)] if found is not None else []
        return []

    def _returns(self, f: Any, func: Any, method: Any, cls: str, depth: int) -> list:
        """The types a call returns by its callee's return annotation: a function the module binds, or a method of
        a receiver of a told type (``self.backend.get_impl_cls()``)."""
        if type(func) is ast.Name and func.id not in _bound_names(method):
            got = self.s.resolve(f, ("name", func.id))
            return self._returned(got[0], got[1]) if got is not None else []
        if type(func) is not ast.Attribute:
            return []
        out: list = []
        for _, (rf, rcls) in self._expr(f, func.value, method, cls, depth + 1):
            got = self.s.method_of(rf, rcls, func.attr)
            if got is not None:
                out.extend(self._returned(got[0], got[1]))
        if not out:
            dotted = _dotted(func.value)
            if dotted is not None and dotted.split(".")[0] not in _bound_names(method):
                got = self.s.resolve(f, ("attr", dotted, func.attr))
                if got is not None:
                    out.extend(self._returned(got[0], got[1]))
        return out

    def _returned(self, f: Any, qual: str) -> list:
        got = self.s.def_node(f, qual)
        if got is None or got[0].returns is None:
            return []
        return self._annotation(f, got[0].returns)

    def _local(self, f: Any, name: str, method: Any, cls: str, depth: int) -> list:
        """A local's types: its parameter annotation, else its one assignment in ``method``."""
        a = method.args
        for p in (*a.posonlyargs, *a.args, *a.kwonlyargs):
            if p.arg == name:
                return self._annotation(f, p.annotation) if p.annotation is not None else []
        values = [s.value for s in ast.walk(method) if type(s) is ast.Assign and len(s.targets) == 1
                  and type(s.targets[0]) is ast.Name and s.targets[0].id == name]
        annotated = [s.annotation for s in ast.walk(method) if type(s) is ast.AnnAssign
                     and type(s.target) is ast.Name and s.target.id == name]
        if annotated:
            return self._annotation(f, annotated[0])
        return self._expr(f, values[0], method, cls, depth + 1) if len(values) == 1 else []

    def _annotation(self, f: Any, node: Any) -> list:
        """``X`` -> an instance of X, ``type[X]`` -> the class X; through ``Optional``, ``Union``, ``X | None`` and
        string annotations."""
        t = type(node)
        if t is ast.Constant and isinstance(node.value, str):
            try:
                return self._annotation(f, ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return []
        if t is ast.BinOp and type(node.op) is ast.BitOr:
            return self._annotation(f, node.left) + self._annotation(f, node.right)
        if t is ast.Subscript:
            base = _dotted(node.value)
            inner = node.slice
            if base in _OPTIONAL:
                return self._annotation(f, inner)
            if base in _UNION and type(inner) is ast.Tuple:
                return [x for e in inner.elts for x in self._annotation(f, e)]
            if base in _TYPE:
                return [("cls", c) for _, c in self._annotation(f, inner)]
            return []
        dotted = _dotted(node)
        if dotted is None or dotted == "None":
            return []
        found = self.s.class_of(f, dotted)
        return [("inst", found)] if found is not None else []


def _forwards_all(func: Any, call: Any) -> bool:
    """``func`` takes nothing but ``*args`` / ``**kwargs`` (after self) and ``call`` hands on exactly those."""
    a = func.args
    if a.kwonlyargs or len(a.posonlyargs) + len(a.args) > 1 or (a.vararg is None and a.kwarg is None):
        return False
    starred = [x.value.id for x in call.args if type(x) is ast.Starred and type(x.value) is ast.Name]
    splat = [k.value.id for k in call.keywords if k.arg is None and type(k.value) is ast.Name]
    return len(call.args) == len(starred) and len(call.keywords) == len(splat) \
        and starred == ([a.vararg.arg] if a.vararg else []) and splat == ([a.kwarg.arg] if a.kwarg else [])


def _self_name(func: Any) -> Optional[str]:
    args = (*func.args.posonlyargs, *func.args.args)
    return args[0].arg if args else None


def _is_member(target: Any, this: Optional[str], member: str) -> bool:
    return type(target) is ast.Attribute and target.attr == member and type(target.value) is ast.Name \
        and target.value.id == this


def _bound_names(func: Any) -> set:
    a = func.args
    names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None}
    names.update(n.id for n in ast.walk(func) if type(n) is ast.Name and type(n.ctx) is ast.Store)
    return names


def _own_calls(func: Any) -> list:
    """The calls of ``func``'s own body (not of defs, classes or lambdas inside it)."""
    out, todo = [], list(func.body)
    while todo:
        node = todo.pop()
        t = type(node)
        if t in (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda):
            continue
        if t is ast.Call:
            out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _local_imports(func: Any) -> dict:
    """{name: (module, name)} of ``from module import name`` statements in ``func``'s body (absolute ones)."""
    out = {}
    for node in ast.walk(func):
        if type(node) is ast.ImportFrom and node.level == 0 and node.module:
            for a in node.names:
                out[a.asname or a.name] = (node.module, a.name)
    return out

