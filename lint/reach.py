"""Per-layer code bound at run time: the defs that per-layer places run through an object whose class the tree picks
while it runs, for GL104 to check as per-layer code.

A layer's forward (``summaries``' places: a layer class's forward, a def registered in an attention registry) that
calls ``self.<member>`` or a method of it, handing it metadata, where the member is built by a typed factory
(``self.impl = self.backend.get_impl_cls()(...)`` with ``get_impl_cls() -> type[AttentionImpl]``, ``self.x: Base =
make(...)``, a parameter ``attn_cls: type[Base]``), runs the method of whichever subclass of that base the run
picked: the method each subclass defined in the tree runs (its own or the one it inherits; class hierarchy
analysis), with ``self`` known as that subclass, so that ``self.<m>()`` there reaches that class's m. A def a module
installs as a layer class's forward (``Qwen2VLAttention.forward = patched``) runs in place of that forward. The
defs so reached, and what they call in turn with what they were given (methods, functions of the tree, imports made
inside a def), run once per layer: each becomes a per-layer place of its own, with the path that reaches it, and
GL104 reports its reads where they are. The binding calls' arguments are facts there: what every binding call
passes, or none passes, spares the reads made only without it, or only with it (``host_sync``). Defs reached only
through calls the tree binds statically are not places here: the callee summaries already report those at their
calls.

Types come from facts, never from names: annotations of the member, of a local, of a parameter; return annotations
of the factory (a method of the typed receiver, a function the module imports); ``type[X]`` is the class X, its
call an instance of X or of a subclass; ``Cls(...)`` is exactly a Cls. A member whose type is not told is not
followed, nor is a binding handed no metadata (a linear layer's ``quant_method.apply(self, x)``).
"""
from __future__ import annotations

import ast
import os
from collections import deque
from typing import Any, Optional

from .patterns import is_seqlen_name
from .prefilter import _dotted

# Defs visited from the places in one run at most (a bound, not a budget).
MAX_VISITED = 4000
# Modules a layer holds, followed down from a per-layer place before any binding at run time (a model's block
# holds its attention layer, which holds the impl the run picks: one hop).
MAX_HELD_HOPS = 2
# Calls followed from the def a binding reaches (the impl's method, its helpers, theirs: vllm-omni's masked
# FLASH_ATTN path reads five calls down from the impl's base forward).
MAX_BOUND_DEPTH = 6
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
        self._class_stores: dict = {}  # id(class node) -> ``_stores``
        self._def_locals: dict = {}  # id(def node) -> ``_locals``
        self._def_carried: dict = {}  # id(def node) -> ``_carried``

    # -- the walk ---------------------------------------------------------------------------------------
    def contexts(self) -> dict:
        """{path as given: {qualname: ((why it runs per layer, the path), the parameters every call that binds it
        passes, those none passes)}} of the defs bound at run time that hold a read, each with a path from a
        per-layer place that reaches it (``_best_trail``)."""
        todo: deque = deque()
        for f in list(self.s.facts_by_path()):
            for qual in f.places:
                todo.append((f, qual, (qual,), False, None, None, None, 0))
            for name, module, line, target, nested in f.installs:
                got = (f, nested) if nested is not None else self._installed(f, name, module)
                if got is not None:
                    hop = f"{target} = {name} ({os.path.basename(f.path)}:{line})"
                    todo.append((got[0], got[1], (hop, got[1]), True, None, None, None, 1))
        seen: dict = {}
        first: dict = {}  # key of a def bound at run time -> (FileFacts, qualname, its shortest path)
        incoming: dict = {}  # that key -> [(the caller's key, the call, the path)], the calls that bind it
        while todo and len(seen) < MAX_VISITED:
            f, qual, trail, bound, caller, call, recv, hops = todo.popleft()
            key = (os.path.normpath(f.path), qual)
            if bound:
                incoming.setdefault(key, []).append((caller, call, trail))
            # (a method is walked once per class its instance is known as: ``self.m()`` there depends on it)
            visit = (key, (os.path.normpath(recv[0].path), recv[1], recv[2]) if recv is not None else None)
            if visit in seen and (seen[visit] or not bound):
                continue
            seen[visit] = bound
            if bound and key not in first:
                first[key] = (f, qual, trail)
            for (tf, tqual), how, c, trecv, held in self._callees(f, qual, bound, recv):
                if held and how is None and not bound and hops >= MAX_HELD_HOPS \
                        or bound and hops >= MAX_BOUND_DEPTH:
                    continue
                step = (f"{how}: {tqual}",) if how is not None else (tqual,)
                # (before the binding: modules held; after it: calls made since)
                todo.append((tf, tqual, trail + step, bound or how is not None, key, c, trecv,
                             hops + 1 if bound else 1 if how is not None else hops + held))
        given = self._given_everywhere(incoming, first)
        absent = self._absent_everywhere(incoming, first)
        out: dict = {}
        trails: dict = {}
        for key, (f, qual, trail) in first.items():
            trail = self._best_trail(key, incoming, first, given, trails, set()) or trail
            if key[0] in self.s.tree_files() and self.s.may_report(f, qual):
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
        those that hand on what it was given). ``recv``: (file facts, class, open) that ``self`` is known as there
        (``_self_calls``); the method's own class, exactly, where None."""
        got = self.s.def_node(f, qual)
        if got is None:
            return []
        node, cls = got
        out: list = []
        this = _self_name(node) if cls is not None else None
        local = _local_imports(node) if bound else {}
        carried = self._carried(node) if bound else None
        for call in _own_calls(node):
            if carried is not None and not _hands(call, carried):
                continue  # bound per layer, but hands the callee nothing of what it was given
            func = call.func
            receiver = func.value if type(func) is ast.Attribute else None
            held = False
            if this is not None and type(receiver) is ast.Name and receiver.id == this:
                # self.m(...), or self.module(...)
                targets = self._self_calls(recv or (f, cls, False), func.attr)
                held = not targets
                known = recv or (f, cls, False)
                targets = targets or self._held(f, cls, func.attr, _hands_metadata(call)) \
                    or self._stored_functions(known[0], known[1], func.attr)
            elif this is not None and type(receiver) is ast.Attribute and type(receiver.value) is ast.Name \
                    and receiver.value.id == this:  # self.member.m(...)
                targets = self._member_calls(f, cls, receiver.attr, func.attr, _hands_metadata(call))
            elif type(func) is ast.Name and func.id in local:  # imported inside the def
                target = self._imported(f, *local[func.id])
                targets = [(target, None, None)] if target is not None else []
            else:
                ref = self.s.call_ref(f, qual, call)
                if ref is None or not (ref[0] == "each" or bound and ref[0] in ("name", "attr", "table")):
                    continue
                held = ref[0] == "each"
                targets = [((t[0], t[1]), None, None) for t in self.s.resolve_all(f, ref)]
            out.extend((target, how, call, trecv, held) for target, how, trecv in targets)
        return out

    def _held(self, f: Any, cls: str, member: str, metadata: bool) -> list:
        """``self.<member>(...)``: the forward of the module the member holds, built by a constructor the class
        calls (bound statically), else by a typed factory (bound at run time: each subclass's forward too)."""
        return self._member_calls(f, cls, member, None, metadata) \
            or [((t[0], t[1]), None, None) for t in self.s.resolve_all(f, ("self", cls, member))]

    def _self_calls(self, recv: tuple, name: str) -> list:
        """``self.<name>()`` where ``self`` is known as ``recv`` (file facts, class, open): the method an instance of
        that class runs; where the class is open (a binding's base: the instance may be of any subclass), each
        override of it in the subclasses too, each with the class it is then known as (exactly)."""
        out = []
        got = self.s.method_of(recv[0], recv[1], name)
        if got is not None:
            out.append(((got[0], got[1]), None, recv))
        if recv[2]:
            for sf, scls in self._all_subclasses(recv[0], recv[1]):
                got = self.s.method_of(sf, scls, name)  # its own, or the one it inherits, run for it
                if got is not None:
                    out.append(((got[0], got[1]), None, (sf, scls, False)))
        return out

    def _member_calls(self, f: Any, cls: str, member: str, name: Optional[str], metadata: bool) -> list:
        """``self.<member>.<name>()`` (``name`` None: ``self.<member>(...)``, the methods an instance call runs):
        through a member of a told type, that method of the type, and, where the type is open (a typed factory's, an
        annotation's) and the call hands it metadata (``metadata``: ``_hands_metadata``), each override of it in the
        type's subclasses, as run-time bound calls. (A call handing none, a linear layer's ``quant_method.apply(self,
        x)``, gives its impls nothing a per-layer read of metadata could read: not followed, at no cost.)"""
        out = []
        for kind, (tf, tcls) in self.member_type(f, cls, member, 0):
            if kind == "cls" or kind == "inst" and not metadata:
                continue
            how = f"self.{member} (whichever {tcls.rpartition('.')[2]} the run picks)" if kind == "inst" else None
            for method in (name,) if name is not None else self.s.call_methods(tf, tcls):
                got = self.s.method_of(tf, tcls, method)
                if got is not None:
                    out.append(((got[0], got[1]), how, (tf, tcls, kind == "inst")))
            if kind == "exact":
                continue  # built by its constructor: that class's method, bound statically
            for sf, scls in self._all_subclasses(tf, tcls):
                for method in (name,) if name is not None else self.s.call_methods(sf, scls):
                    got = self.s.method_of(sf, scls, method)  # its own, or the one it inherits, run for it
                    if got is not None:
                        out.append(((got[0], got[1]), how, (sf, scls, False)))
        return out

    def _stored_functions(self, f: Any, cls: str, member: str) -> list:
        """``self.<member>(...)`` where the class's methods store a function in the member (``from kernels import
        fwd; self.fwd = fwd`` in ``__init__``, lmdeploy's dlinfer impls): that function, bound statically."""
        out: list = []
        for owner, name in self._mro(f, cls):
            node = self.s.class_node(owner, name)
            for _, value, method in self._stores(node).get(member, ()) if node is not None else ():
                if type(value) is not ast.Name:
                    continue
                local = _local_imports(method)
                if value.id in local:
                    target = self._imported(owner, *local[value.id])
                elif value.id not in self._locals(method)[2]:
                    target = self._installed(owner, value.id, None)
                else:
                    target = None
                if target is not None and (target, None, None) not in out:
                    out.append((target, None, None))
            if out:
                break
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
            for annotation, value, method in self._stores(node).get(member, ()) if node is not None else ():
                types = self._annotation(owner, annotation) if annotation is not None else \
                    self._expr(owner, value, method, name, depth + 1)
                out.extend(t for t in types if t not in out)
            if out:
                break
        self._member_types[key] = out
        return out

    def _carried(self, func: Any) -> frozenset:
        """The names of ``func`` that hold what its callers hand it: its parameters (``self`` aside, whose members a
        layer builds once) and the locals assigned from an expression naming one, to a fixed point."""
        got = self._def_carried.get(id(func))
        if got is None:
            a = func.args
            names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None}
            this = _self_name(func) if (a.posonlyargs or a.args) else None
            names.discard(this or "")
            nodes: list[Any] = list(ast.walk(func))
            assigns = [(n.targets if type(n) is ast.Assign else [n.target], n.value) for n in nodes
                       if type(n) in (ast.Assign, ast.AnnAssign, ast.AugAssign) and n.value is not None]
            changed = True
            while changed:
                changed = False
                for targets, value in assigns:
                    if any(type(m) is ast.Name and m.id in names for m in ast.walk(value)):
                        for target in targets:
                            for m in ast.walk(target):
                                if type(m) is ast.Name and m.id not in names:
                                    names.add(m.id)
                                    changed = True
            got = self._def_carried[id(func)] = frozenset(names)
        return got

    def _stores(self, node: ast.ClassDef) -> dict:
        """{member: [(annotation or None, value or None, the method)]} of what the class's methods store in
        ``self.<member>`` (one walk a class)."""
        got = self._class_stores.get(id(node))
        if got is None:
            got = self._class_stores[id(node)] = {}
            for method in node.body:
                if type(method) not in (ast.FunctionDef, ast.AsyncFunctionDef):
                    continue
                this = _self_name(method)
                stmt: Any
                for stmt in ast.walk(method):
                    t = type(stmt)
                    if t is ast.Assign:
                        for target in stmt.targets:
                            if _is_member(target, this):
                                got.setdefault(target.attr, []).append((None, stmt.value, method))
                    elif t is ast.AnnAssign and _is_member(stmt.target, this):
                        got.setdefault(stmt.target.attr, []).append((stmt.annotation, None, method))
        return got

    def _locals(self, func: Any) -> tuple:
        """({local: [values assigned to it alone]}, {local: annotation}, every name the def binds) (one walk a
        def)."""
        got = self._def_locals.get(id(func))
        if got is None:
            values: dict = {}
            annotated: dict = {}
            a = func.args
            names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None}
            n: Any
            for n in ast.walk(func):
                t = type(n)
                if t is ast.Name and type(n.ctx) is ast.Store:
                    names.add(n.id)
                elif t is ast.Assign and len(n.targets) == 1 and type(n.targets[0]) is ast.Name:
                    values.setdefault(n.targets[0].id, []).append(n.value)
                elif t is ast.AnnAssign and type(n.target) is ast.Name:
                    annotated.setdefault(n.target.id, n.annotation)
            got = self._def_locals[id(func)] = (values, annotated, names)
        return got

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
                + self._returns(f, expr, method, cls, depth)
        if t is ast.Attribute and type(expr.value) is ast.Name and expr.value.id == _self_name(method):
            return self.member_type(f, cls, expr.attr, depth)
        if t is ast.Name:
            return self._local(f, expr.id, method, cls, depth)
        return []

    def _callee_types(self, f: Any, func: Any, method: Any, cls: str, depth: int) -> list:
        """The types of what a call's callee is: ``Cls`` itself ("class": its call makes exactly a Cls), a member or
        local holding ``type[X]`` ("cls": its call makes an X or a subclass)."""
        if type(func) is ast.Name:
            if func.id in self._locals(method)[2]:
                return self._local(f, func.id, method, cls, depth)
            found = self.s.named_class(f, func.id)
            return [("class", found)] if found is not None else []
        if type(func) is ast.Attribute and type(func.value) is ast.Name and func.value.id == _self_name(method):
            return self.member_type(f, cls, func.attr, depth)
        dotted = _dotted(func)
        if dotted is not None and dotted.split(".")[0] not in self._locals(method)[2]:
            found = self.s.class_of(f, dotted)
            return [("class", found)] if found is not None else []
        return []

    def _returns(self, f: Any, call: ast.Call, method: Any, cls: str, depth: int) -> list:
        """The types a call returns by its callee's return annotation: a function the module binds, or a method of
        a receiver of a told type (``self.backend.get_impl_cls()``)."""
        func = call.func
        site = (f, call, method, cls, depth)
        if type(func) is ast.Name and func.id not in self._locals(method)[2]:
            got = self.s.resolve(f, ("name", func.id))
            return self._returned(got[0], got[1], site) if got is not None else []
        if type(func) is not ast.Attribute:
            return []
        out: list = []
        for _, (rf, rcls) in self._expr(f, func.value, method, cls, depth + 1):
            got = self.s.method_of(rf, rcls, func.attr)
            if got is not None:
                out.extend(self._returned(got[0], got[1], site))
        if not out:
            dotted = _dotted(func.value)
            if dotted is not None and dotted.split(".")[0] not in self._locals(method)[2]:
                got = self.s.resolve(f, ("attr", dotted, func.attr))
                if got is not None:
                    out.extend(self._returned(got[0], got[1], site))
        return out

    def _returned(self, f: Any, qual: str, site: tuple) -> list:
        got = self.s.def_node(f, qual)
        if got is None or got[0].returns is None:
            return []
        returns = got[0].returns
        if type(returns) is ast.Name and f.names.get(returns.id) == ("typevar",):
            return self._bound_typevar(f, got[0], returns.id, site)
        return self._annotation(f, returns)

    def _bound_typevar(self, f: Any, node: Any, var: str, site: tuple) -> list:
        """A def that returns its type variable (``def build_op(cls, spec: BuildSpec[ImplT]) -> ImplT``): the type the
        call's argument for that parameter fills in, as its class declares it (``class FlashAttentionBuildSpec(
        BuildSpec[FlashAttentionImpl])``: an instance of FlashAttentionImpl or of a subclass)."""
        caller, call, method, cls, depth = site
        a = node.args
        params = [*a.posonlyargs, *a.args]
        skip = 1 if params and params[0].arg in ("self", "cls") else 0
        out: list = []
        for i, p in enumerate([*params, *a.kwonlyargs]):
            ann = p.annotation
            if type(ann) is not ast.Subscript:
                continue
            slots = ann.slice.elts if type(ann.slice) is ast.Tuple else [ann.slice]
            at = next((j for j, e in enumerate(slots) if type(e) is ast.Name and e.id == var), None)
            generic = _dotted(ann.value)
            if at is None or generic is None:
                continue
            arg = next((k.value for k in call.keywords if k.arg == p.arg), None)
            if arg is None and i < len(params) and 0 <= i - skip < len(call.args):
                arg = call.args[i - skip]
            if arg is None or type(arg) is ast.Starred:
                continue
            for _, (af, acls) in self._expr(caller, arg, method, cls, depth + 1):
                for owner, name in self._mro(af, acls):
                    klass = self.s.class_node(owner, name)
                    for base in klass.bases if klass is not None else ():
                        if type(base) is not ast.Subscript or \
                                (_dotted(base.value) or "").rsplit(".", 1)[-1] != generic.rsplit(".", 1)[-1]:
                            continue
                        filled = base.slice.elts if type(base.slice) is ast.Tuple else [base.slice]
                        if at < len(filled):
                            out.extend(t for t in self._annotation(owner, filled[at]) if t not in out)
        return out

    def _local(self, f: Any, name: str, method: Any, cls: str, depth: int) -> list:
        """A local's types: its parameter annotation, else its one assignment in ``method``."""
        a = method.args
        for p in (*a.posonlyargs, *a.args, *a.kwonlyargs):
            if p.arg == name:
                return self._annotation(f, p.annotation) if p.annotation is not None else []
        assigned, annotated, _ = self._locals(method)
        if name in annotated:
            return self._annotation(f, annotated[name])
        values = assigned.get(name, ())
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


def _is_member(target: Any, this: Optional[str]) -> bool:
    return type(target) is ast.Attribute and type(target.value) is ast.Name and target.value.id == this


def _hands_metadata(call: ast.Call) -> bool:
    """An argument of ``call`` names sequence metadata: a length or offsets name (``is_seqlen_name``), or an object
    or mask that holds them (``attn_metadata``, ``attention_mask``)."""
    return any(type(m) is ast.Name and (is_seqlen_name(m.id) or "metadata" in m.id or "mask" in m.id)
               or type(m) is ast.keyword and m.arg is not None and is_seqlen_name(m.arg)
               for arg in (*call.args, *call.keywords) for m in ast.walk(arg))


def _hands(call: ast.Call, carried: frozenset) -> bool:
    """An argument of ``call`` names one of ``carried``."""
    return any(type(m) is ast.Name and m.id in carried
               for arg in (*call.args, *(k.value for k in call.keywords)) for m in ast.walk(arg))


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

