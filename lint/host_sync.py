"""GL104 per-layer-host-sync: a device-to-host read of sequence-length metadata in code run per layer.

The vocabulary (which names hold metadata, which calls read back) lives in ``patterns.py`` beside the
pre-filter's needles; where a read's receiver lives (host or device, derived from which metadata) is the
value model's answer (``values.py``), names the fallback where it does not know.
"""
# Per layer means the ``forward`` of a class named ``*Block``, ``*Layer`` or ``*Attention`` (any case) or derived
# from a class named so, the methods such a forward dispatches to where it only calls the one its instance picked
# (vLLM's CustomOp: ``forward_oot``, ``forward_cuda``...; read from the definition the class reaches,
# ``engine_defs.forward_targets``), or the body of a ``for`` loop over something named like layers or blocks.
# Reads are ``.item()``, ``.tolist()`` and ``int(t.max())`` of sequence-length metadata, a bare copy of it to
# the host (``t.cpu()``, ``t.to("cpu")``: the copy waits for the device, whether or not the copy is read; a
# ``non_blocking=True`` one does not), ``.any()``/``.all()`` of a tensor tested by ``if``/``while``,
# and calls of a same-module helper that does one of those but a copy (whether a copy in a helper copies device
# data depends on what the call passes: the callee summaries below judge it). A class whose ``__init__``
# refuses to run off the CPU holds host tensors only: nothing there is a device sync. A helper called in the
# fallback branch of a prepared-metadata test (``if forward_metadata is not None: ... else: helper(...)``) is
# reported at the callers that pass no metadata instead (GL109).
# A receiver the value model shows to be a device value derived from metadata is reported under its own
# name (``spans (from cu_seqlens)``), one it shows to be on the host is not, whatever its name; the value
# map of a function is built the first time one of its reads needs it.
# A call of a function of the scanned tree is a read when the function's summary (``summaries.py``, given
# as ``callees``) says it reads on the host the parameter that a device value derived from metadata fills
# at the call; the finding names the path to the read.
from __future__ import annotations

import ast
import os
import re
from typing import Any, Callable, Optional

import libcst as cst

from guardlint.contracts import Contract

from .findings import MESSAGE_WIDTH, message, per_layer_place
from .names import dotted, is_none, stored_names
from .patterns import CASTS, LAYER_LOOP_NAME, SYNC_METHODS, is_layer_class, is_seqlen_name
from .summaries import reported_there, defaulted_params
from .values import DEVICE, UNKNOWN_VALUE, Value, Values, join, seed
from .walk import children

# The value map of a function when its reads need it: None where it cannot be built (too deep to walk).
ValuesOf = Callable[[], Optional[Values]]


def _names_in(expr: cst.CSTNode, everywhere: bool = False):
    """Names and attribute names read in an expression: through subscripts, calls and arithmetic only,
    or, ``everywhere``, through every child (a test's whole condition)."""
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Name):
            yield node.value
        elif everywhere:
            stack.extend(children(node))
        elif isinstance(node, cst.Attribute):
            yield node.attr.value
            stack.append(node.value)
        elif isinstance(node, (cst.Subscript, cst.Call, cst.BinaryOperation, cst.UnaryOperation)):
            stack.extend(children(node))
        elif isinstance(node, (cst.SubscriptElement, cst.Index, cst.Slice, cst.Arg)):
            stack.extend(children(node))


def _metadata_name(expr: cst.CSTNode) -> Optional[str]:
    for name in _names_in(expr):
        if is_seqlen_name(name):
            return name
    return None


def _loop_index(node: cst.For) -> Optional[str]:
    """``i`` of ``for i, layer in enumerate(...)`` or ``for i in range(...)``."""
    func = dotted(node.iter.func) if isinstance(node.iter, cst.Call) else None
    target = node.target
    if func == "enumerate" and isinstance(target, cst.Tuple) and target.elements \
            and isinstance(target.elements[0].value, cst.Name):
        return target.elements[0].value.value
    if func == "range" and isinstance(target, cst.Name):
        return target.value
    return None


def _tests_index(test: cst.BaseExpression, index: str) -> bool:
    """``i == k`` (either side; ``and`` with anything else): true for one value of ``i`` at most."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _tests_index(test.left, index) or _tests_index(test.right, index)
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1
            and isinstance(test.comparisons[0].operator, cst.Equal)):
        return False
    sides = (test.left, test.comparisons[0].comparator)
    return any(isinstance(a, cst.Name) and a.value == index for a in sides) \
        and not all(isinstance(a, cst.Name) and a.value == index for a in sides)


def _layer_loop(iterable: cst.BaseExpression) -> Optional[str]:
    for name in _names_in(iterable):
        if LAYER_LOOP_NAME.search(name):
            return dotted(iterable) or name
    return None


class PerLayerHostSync:
    def __init__(self, contract: Contract, report: Callable[..., None]):
        self.contract = contract
        self._report = report
        self._classes: list[Optional[cst.ClassDef]] = []  # enclosing classes; None for a def in between
        self._contexts: list[Optional[str]] = []  # why the code here runs per layer
        self._inside_report = 0  # depth of calls nested in an already reported one
        self._funcs: list[list] = []  # enclosing defs, innermost last: [def, its value map once built]
        # (qualname of the enclosing def, callee as written) -> summaries.Callee, for calls whose definition
        # reads a parameter on the host (summaries.py); empty where the run built none.
        self.callees: dict = {}
        self.path = ""  # the file's, as shown (the place of a callee is said relative to it)
        self._scope: list[str] = []  # names of the enclosing classes and defs
        self._indices: list[Optional[str]] = []  # the index name of each enclosing for loop over layers
        self._once: set[int] = set()  # ids of bodies that run at most once per loop (``if i == k:``)
        # The known varlen kernels the file's imports bind, and per def the parameters that are device metadata
        # because it hands what derives from them to a kernel's offsets (``kernel_facts.file_facts``).
        self.kernels: dict = {}
        self.kernel_seeds: dict = {}
        self.kernel_unpacked: dict = {}  # def qualname -> ``kernel_facts.unpacked_ints``
        # Defs the file registers in an attention registry (``registries.registered``): per-layer code.
        self.registered: dict = {}
        self._unevaluated: set[int] = set()  # ids of calls in assert messages (run only when the assert fails)
        self._spares: list = []  # per enclosing def, the parameters every call binding it passes (reach.py), or None
        self._paths: list = []  # per enclosing def, the path that binds it per layer at run time (reach.py), or None

    def report(self, node: cst.CSTNode, message: str, note: str = "") -> None:
        # In a def bound per layer at run time, the note gives the path that binds it (``reach.py``).
        bound = next((n for n in reversed(self._paths) if n is not None), None) if self._paths else None
        self._report(node, message, "\n".join(filter(None, (note, bound))))

    def _message(self, what: str, context: str) -> str:
        # The headline says "per layer"; the line names the read and where it is.
        return message(f"{what} inside {per_layer_place(context)}", self.contract.diagnosis.headline)

    def visit_Module(self, node: cst.Module) -> None:
        self._module = node
        self.begin_chunk(module_helpers(node.body, {}))

    def begin_chunk(self, helpers: dict[str, str]) -> None:
        """Before a walk of top-level statements without their module (``chunks.py``): ``helpers`` are
        the module's helpers (``module_helpers`` of its whole body)."""
        self._helpers = helpers
        self._fallback = 0

    def _spare(self, test: cst.BaseExpression, body: cst.CSTNode, orelse: Optional[cst.CSTNode]) -> None:
        """In a def bound per layer at run time, the branch of ``if p is None`` (``x if p is not None else ...``)
        taken only when a parameter every binding call passes is None runs on no such call: its calls and tests are
        not evaluated there."""
        spared = self._spares[-1] if self._spares else None
        name, is_none_test = _none_test(test) if spared else (None, None)
        if name not in (spared or ()):
            return
        branch = body if is_none_test else orelse
        if branch is not None:
            self._unevaluated.update(id(n) for n in _subtree(branch))

    def _skip_after_early_exits(self, func: cst.FunctionDef, absent: frozenset) -> None:
        """After ``if p is None: return ...`` (or ``raise``) at the top of ``func``'s body, where no call binding it
        passes ``p``, nothing runs: its nodes are not evaluated."""
        if not absent or not isinstance(func.body, cst.IndentedBlock):
            return
        body = func.body.body
        for i, stmt in enumerate(body):
            if not isinstance(stmt, cst.If):
                continue
            name, is_none_test = _none_test(stmt.test)
            if name in absent and is_none_test and _exits(stmt.body):
                self._unevaluated.update(id(n) for later in body[i + 1:] for n in _subtree(later))
                if stmt.orelse is not None:
                    self._unevaluated.update(id(n) for n in _subtree(stmt.orelse))
                return

    def visit_IfExp(self, node: cst.IfExp) -> None:
        self._spare(node.test, node.body, node.orelse)

    def visit_If(self, node: cst.If) -> None:
        self._spare(node.test, node.body, node.orelse)
        index = next((i for i in reversed(self._indices) if i is not None), None) if self._indices else None
        if index is not None and _tests_index(node.test, index):
            self._once.add(id(node.body))
        if _tests_metadata(node.test):
            self._fallback += 1
        self._truth(node.test, "if")

    def visit_While(self, node: cst.While) -> None:
        self._truth(node.test, "while")

    def _truth(self, test: cst.BaseExpression, keyword: str) -> None:
        """``if (a > b).any():``, ``if seq_lens:``, ``while cu_seqlens[i] < n:`` - the truth of a tensor."""
        context = self._context()
        if not context or id(test) in self._unevaluated:
            return
        if isinstance(test, cst.Call):
            what = _tensor_truth(test, self._values)
        else:  # in the fallback branch of a prepared-metadata test the callers are reported (GL109)
            what = None if getattr(self, "_fallback", 0) else _metadata_truth(test, keyword, self._values)
        if what:
            self.report(test, self._message(what, context))

    def leave_If(self, node: cst.If) -> None:
        if _tests_metadata(node.test):
            self._fallback -= 1

    def _context(self) -> Optional[str]:
        return next((c or None for c in reversed(self._contexts) if c is not None), None)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._scope.append(node.name.value)
        if _host_only(node):
            self._classes.append(None)
            self._contexts.append(None)
            self._host_class = getattr(self, "_host_class", 0) + 1
            return
        self._classes.append(node)

    def leave_ClassDef(self, node: cst.ClassDef) -> None:
        self._scope.pop()
        self._classes.pop()
        if _host_only(node):
            self._contexts.pop()
            self._host_class -= 1

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        owner = self._classes[-1] if self._classes else None
        context = spared = path = None
        name = node.name.value
        if owner is not None and (name == "forward" or name.startswith("forward_")) \
                and not getattr(self, "_host_class", 0) \
                and is_layer_class(owner.name.value, [b for b in map(_base_name, owner.bases) if b]) \
                and (name == "forward" or name in self._dispatched(owner)):
            context = f"{owner.name.value}.{name}, which runs once per layer"
        elif name in self.registered:
            registry, line = self.registered[name]
            context = f"{name}(), registered in {registry} (line {line}), which a model calls once per layer"
        elif self.callees and ("layer", ".".join((*self._scope, name))) in self.callees:
            qual = ".".join((*self._scope, name))
            context, path = self.callees[("layer", qual)]  # bound at run time (reach.py)
            # What every call binding it passes: the def's reads made only when one of those is None are not; what
            # none passes: what it does only once one of those is given is not done.
            spared = self.callees.get(("given", qual), frozenset())
            self._skip_after_early_exits(node, self.callees.get(("absent", qual), frozenset()))
        self._contexts.append(context)
        self._spares.append(spared)
        self._paths.append(path)
        self._classes.append(None)
        self._funcs.append([node, None])
        self._scope.append(node.name.value)

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._spares.pop()
        self._paths.pop()
        self._scope.pop()
        self._contexts.pop()
        self._classes.pop()
        self._funcs.pop()

    def _dispatched(self, owner: cst.ClassDef) -> frozenset:
        """The methods a call of an instance of ``owner`` (a top-level class) runs in place of its forward,
        when that forward dispatches to one (``engine_defs.forward_targets``: its own, the tree's or the
        installed engine's definition, the pinned picture)."""
        cache = self.__dict__.setdefault("_dispatch", {})
        if id(owner) not in cache:
            cache[id(owner)] = _forward_targets(getattr(self, "_module", None), owner, self.path or None,
                                                self.__dict__.setdefault("_ast", []))
        return cache[id(owner)]

    def _values(self) -> Optional[Values]:
        """The value map of the innermost enclosing def (None at module level)."""
        if not self._funcs:
            return None
        entry = self._funcs[-1]
        if entry[1] is None:
            scope = ".".join(self._scope)
            returns = {text: r for (kind, where, text), r in (
                (k, v) for k, v in (self.callees or {}).items() if len(k) == 3) if kind == "=" and where == scope}
            entry[1] = _build(entry[0], (lambda call: _returned(returns, call)) if returns else None,
                              self.kernel_seeds.get(scope, frozenset()))
        return entry[1] or None

    def visit_For(self, node: cst.For) -> None:
        loop = _layer_loop(node.iter)
        self._contexts.append(f"a loop over {loop}" if loop else None)
        self._indices.append(_loop_index(node) if loop else None)

    def leave_For(self, node: cst.For) -> None:
        self._contexts.pop()
        self._indices.pop()

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self._block(node, 1)

    def leave_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self._block(node, -1)

    def visit_SimpleStatementSuite(self, node: cst.SimpleStatementSuite) -> None:
        self._block(node, 1)

    def leave_SimpleStatementSuite(self, node: cst.SimpleStatementSuite) -> None:
        self._block(node, -1)

    def _block(self, node: cst.BaseSuite, step: int) -> None:
        # The body of ``if i == k:`` inside ``for i, layer in enumerate(self.layers)`` runs at most once per
        # loop, not once per layer: "" in the contexts stops the search for a per-layer context there.
        if id(node) not in self._once:
            return
        if step > 0:
            self._contexts.append("")
        else:
            self._contexts.pop()

    def visit_Assert(self, node: cst.Assert) -> None:
        # An assert's message is evaluated only when the assert fails: no read in it runs per layer.
        if node.msg is not None:
            stack: list = [node.msg]
            while stack:
                n = stack.pop()
                if isinstance(n, cst.Call):
                    self._unevaluated.add(id(n))
                stack.extend(children(n))

    def visit_Call(self, node: cst.Call) -> None:
        if self._inside_report:
            self._inside_report += 1
            return
        if id(node) in self._unevaluated:
            return
        context = self._context()
        if context is None:
            return
        if getattr(self, "_fallback", 0):
            return
        what = self._host_read(node, self._values)
        if what is None and self.kernels:
            found = self._kernel_int(node)
            if found is not None:
                self.report(node, self._message(found[0], context), found[1])
                self._inside_report = 1
                return
        if what is None and isinstance(node.func, cst.Name) and node.func.value in getattr(self, "_helpers", {}) \
                and not self._fallback and ("layer", node.func.value) not in (self.callees or {}):
            # (a helper bound per layer at run time is a place of its own: its reads are reported there)
            what = f"{node.func.value}(...), which reads {self._helpers[node.func.value]}"
        if what is None and self.callees:
            found = self._callee_read(node, context)
            if found is not None:
                self.report(node, *found)
                self._inside_report = 1
                return
        if what is not None:
            self.report(node, self._message(what, context))
            self._inside_report = 1

    def leave_Call(self, node: cst.Call) -> None:
        if self._inside_report:
            self._inside_report -= 1

    def _callee_read(self, node: cst.Call, context: str) -> Optional[tuple[str, str]]:
        """(message, note) of a call whose definition reads on the host the parameter that a device value
        derived from metadata fills here (the callee's summary, ``summaries.py``): the message names the
        function that reads, as precisely as the line has room for; the note, the whole path. A read the
        callee skips when another argument is passed (not None) is not this call's. A call of a table's
        entry (``T[key](...)``) may reach each function entry of it: the first that reads is named."""
        text = callee_text(node.func)
        callees = self.callees.get((".".join(self._scope), text))
        model = self._values() if callees is not None else None
        if callees is None or model is None:
            return None
        for callee in callees:
            found = self._reads_through(node, context, callee, model, text)
            if found is not None:
                return found
        return None

    def _reads_through(self, node: cst.Call, context: str, callee, model: Values, text) -> Optional[tuple[str, str]]:
        passed = callee.bind(node.args)
        for param, arg in passed.items():
            read = callee.summary.reads.get(param)
            if read is None or any(u in passed and not is_none(passed[u]) for u in read.unless) \
                    or reported_there(callee.deep, param, read):
                continue
            v = model.of(arg)
            held = callee.held or read.held
            if read.allowed and self._passed_on(arg):
                continue  # a sync the engine allows, on what this def was given: its caller's to judge
            # Through a module the layer holds, the engine's code decides: a value the layer makes on the
            # device (whatever its name) that the callee reads on the host, unless the callee also hands that
            # parameter to a kernel (it needs it on the device: the read is its own, no caller spares it).
            if not v.device or (held and (self._passed_on(arg) or param in callee.summary.uses)):
                continue
            w = self._unless_none(arg, model, v) if held else v
            if held and not (w.where == DEVICE and (self._by_fact(arg) or not w.source
                                                    or self._handed_as_is(w.source, passed, callee))):
                # on the device by a fact: so even with no parameter taken for device metadata by its name
                # (``device=``, ``.cuda()``, ``.to(self.device)``), or derived from a tensor the same call
                # hands, as the def was given it, to a kernel (``cu_seqlens``, which FlashAttention reads on the
                # device)
                continue
            if not v.source and not held:
                continue
            shown = _metadata_name(arg) or _derived(model, arg) or v.source \
                or (arg.value if isinstance(arg, cst.Name) else param)
            written = f"{text[:-2]}[...]" if text and text.endswith("[]") else text
            short = f"{written}(...) reads {shown}"
            name, path, line, _ = read.path[-1]
            name = name.rsplit(".", 1)[-1]
            here = os.path.dirname(self.path)
            places = (path, os.path.relpath(path, here) if here else path, os.path.basename(path))
            texts = [f"{short} with {read.kind} via `{name}()` in {p}:{line}" for p in places]
            for what in (*texts, f"{short} with {read.kind} via `{name}()`", f"{short} with {read.kind}", short):
                message = self._message(what, context)
                if len(message) <= MESSAGE_WIDTH:
                    break
            entry = f" (as {callee.entry})" if callee.entry else ""
            source = f" (judged against {callee.summary.source})" if callee.summary.source else ""
            note = f"{callee.summary.name}(){entry}{source} reads its {param} on the host ({read.kind}): {read.via()}."
            return message, note
        return None

    def _kernel_int(self, node: cst.Call) -> Optional[tuple[str, str]]:
        """(message, note) of a call of a known varlen kernel (``kernel_facts``) that hands a device tensor of
        metadata to one of its int parameters, which its binding converts on the host at every call."""
        found = self.kernels.get(dotted(node.func) or "")
        if found is None:
            return None
        model = self._values()
        if model is None:
            return None
        qualified, entry = found
        positional = []
        for a in node.args:
            if a.star or a.keyword is not None:
                break
            positional.append(a.value)
        keywords = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        unpacked = self.kernel_unpacked.get(".".join(self._scope), {})
        for position, param in entry["ints"]:
            arg = keywords.get(param, positional[position] if position < len(positional) else None)
            if arg is None:
                continue
            v = model.of(arg)
            kernel = qualified.rsplit(".", 1)[1]
            beside = unpacked.get((param, arg.value)) if isinstance(arg, cst.Name) else None
            if beside is not None and isinstance(arg, cst.Name) and not v.host:
                helper, offsets = beside
                note = (f"{helper}() returns it beside the offsets this call hands {kernel} as {offsets}, derived "
                        f"from the same tensor through ops that keep it where it is: the kernel reads the offsets on "
                        f"the device, so this is a 0-d device tensor, and {qualified} takes {param} as a Python int: "
                        f"converted on the host, a device read at every call. Pass an int computed once per forward "
                        f"from host lengths.")
                return f"{arg.value} (from {helper}()), a device tensor, as {kernel}'s int {param}", note
            if v.where != DEVICE or not v.source:
                continue
            name = _metadata_name(arg) or (arg.value if isinstance(arg, cst.Name) else v.source)
            origin = f" (from {v.source})" if v.source != name else ""
            note = (f"{qualified} takes {param} as a Python int: a device tensor handed there is converted on the "
                    f"host, a device read at every call. Pass an int computed once per forward from host lengths.")
            return f"{name}{origin}, a device tensor, as {kernel}'s int {param}", note
        return None

    def _by_fact(self, arg: cst.BaseExpression) -> bool:
        """``arg`` is on the device by what the def does, not by a name: the value model of the def with no
        parameter seeded as device metadata still finds it there."""
        entry = self._funcs[-1] if getattr(self, "_funcs", None) else None
        if entry is None:
            return False
        facts = self.__dict__.setdefault("_fact_models", {})
        if id(entry[0]) not in facts:
            model = self._values()
            seeds = self.kernel_seeds.get(".".join(self._scope), frozenset())
            try:
                # (a parameter the def hands, derived, to a kernel's offsets is on the device by that fact)
                facts[id(entry[0])] = Values(entry[0], _prepared,
                                             param_seed=lambda name: Value(DEVICE, name) if name in seeds
                                             else UNKNOWN_VALUE,
                                             returns=model._returns if model is not None else None)
            except RecursionError:
                facts[id(entry[0])] = None
        got = facts[id(entry[0])]
        if got is None:
            return False
        w = self._unless_none(arg, got, got.of(arg))
        return w.where == DEVICE

    def _handed_as_is(self, source: str, passed: dict, callee) -> bool:
        """The call hands ``source``, a parameter the def never rebinds, to a parameter the callee needs on
        the device (``Summary.uses``)."""
        func = self._funcs[-1][0] if getattr(self, "_funcs", None) else None
        if func is None or source in _rebound(func):
            return False
        return any(q in callee.summary.uses and isinstance(a, cst.Name) and a.value == source
                   for q, a in passed.items())

    def _unless_none(self, arg: cst.BaseExpression, model: Values, v):
        """What ``arg`` holds when it is not None: for a name the def also sets to None
        (``m = None; if cu is not None: m = ...``), the values of its other assignments; else ``v``."""
        func = self._funcs[-1][0] if getattr(self, "_funcs", None) else None
        if not isinstance(arg, cst.Name) or func is None:
            return v
        values = _stored(func, arg.value)
        others = [e for e in values or () if not is_none(e)]
        if not values or len(others) == len(values) or not others:
            return v
        out = model.of(others[0])
        for e in others[1:]:
            out = join(out, model.of(e))
        return out

    def _passed_on(self, arg: cst.BaseExpression) -> bool:
        """``arg`` holds what the enclosing def was given, not a value it makes: a parameter it does not
        rebind (or rebinds only where it is None), or a name every assignment of which stores None, a
        parameter or an attribute of one (``cu_seqlens = meta.cu_seqlens``)."""
        func = self._funcs[-1][0] if getattr(self, "_funcs", None) else None
        if not isinstance(arg, cst.Name) or func is None:
            return False
        p = func.params
        params = {x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)}
        name = arg.value
        if name in params and (name not in _rebound(func) or name in defaulted_params(func)):
            return True
        values = _stored(func, name)
        return values is not None and bool(values) and all(_given(v, params) for v in values)

    @staticmethod
    def _host_read(node: cst.Call, values: Optional[ValuesOf] = None, copies: bool = True) -> Optional[str]:
        """What ``node`` reads back to the host, judged by ``values`` (the enclosing def's value map)
        first and by names where it does not know; with ``copies``, a bare copy to the host too."""
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value in SYNC_METHODS and not node.args:
            source, copy = host_copy(func.value)
            name = _judge(source, values, _metadata_name)
            if name:
                return f"{copy}.{func.attr.value}() on {name}"
        copied = bare_copy(node) if copies else None
        if copied is not None:
            name = _judge(copied[0], values, _metadata_name)
            if name:
                return f"{copied[1]} on {name}"
        if isinstance(func, cst.Name) and func.value in CASTS and len(node.args) == 1:
            inner = node.args[0].value
            if isinstance(inner, cst.Call):
                f = inner.func
                is_max = (isinstance(f, cst.Attribute) and f.attr.value == "max")
                if is_max and func.value == "int":
                    name = _judge(inner, values, _metadata_name)
                    if name:
                        return f"int(....max()) on {name}"
            if node.args[0].star:
                return None
            name = _judge(inner, values, _device_value)
            if name:
                return f"{func.value}() of {name}"
        return None


# Calls that copy a tensor to the host (or keep it where it is) on the way to a read: in
# ``cu_seqlens.cpu().tolist()`` the read copies ``cu_seqlens`` back, wherever the copy's result lives.
_COPY_METHODS = ("cpu", "numpy", "detach", "contiguous")


def host_copy(expr: cst.BaseExpression) -> tuple[cst.BaseExpression, str]:
    """(the tensor that ``expr`` copies to the host, the copy as written): ``t.cpu()``, ``t.detach().cpu()``,
    ``t.cpu().numpy()``, ``t.to("cpu")`` and ``t.to(device="cpu")`` give (t, ".cpu()"...); anything else
    (``expr``, ""). A read of the copy (``.tolist()``, ``.item()``) is a read of ``t``: a device-to-host sync
    when ``t`` lives on the device, none when it is already host data (the value model says which). A
    ``non_blocking=True`` copy is not followed: what reads it is the code's own business."""
    original, parts, moved = expr, [], False
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        name = expr.func.attr.value
        if name in _COPY_METHODS and not expr.args:
            moved = moved or name in ("cpu", "numpy")
        elif name == "to" and _to_host(expr):
            moved = True
        else:
            break
        parts.append(f".{name}()" if name != "to" else '.to("cpu")')
        expr = expr.func.value
    if not moved:
        return original, ""
    return expr, "".join(reversed(parts))


def bare_copy(node: cst.Call) -> Optional[tuple[cst.BaseExpression, str]]:
    """(the tensor copied, the copy as written) where ``node`` copies a tensor to the host and waits for it:
    ``t.cpu()``, ``t.to("cpu")``, ``t.to(device="cpu")``, ``t.to(torch.device("cpu"), torch.int32)``; None
    for anything else, a ``non_blocking=True`` copy among them. (``t.numpy()`` copies nothing: of a device
    tensor it raises.)"""
    func = node.func
    if not isinstance(func, cst.Attribute):
        return None
    if func.attr.value == "cpu" and not any(a.keyword is None for a in node.args):
        return func.value, ".cpu()"
    if func.attr.value == "to" and _to_host(node):
        return func.value, '.to("cpu")'
    return None


def _to_host(call: cst.Call) -> bool:
    """``x.to(...)`` moves ``x`` to the CPU (its device, positional or ``device=``, is the CPU) and waits: no
    ``non_blocking`` other than False, no ``copy``/``memory_format`` argument past the third position."""
    device, positional = None, 0
    for arg in call.args:
        if arg.star:
            return False
        if arg.keyword is None:
            positional += 1
            if positional == 1:
                device = arg.value
            elif positional > 2:  # .to(device, dtype, non_blocking)
                return False
        elif arg.keyword.value == "device":
            device = arg.value
        elif arg.keyword.value == "non_blocking" and not (isinstance(arg.value, cst.Name)
                                                          and arg.value.value == "False"):
            return False
    return device is not None and _is_cpu(device)


def _is_cpu(value: cst.BaseExpression) -> bool:
    """``"cpu"``, ``"cpu:0"`` or ``torch.device("cpu")``."""
    if isinstance(value, cst.Call) and dotted(value.func) in ("torch.device", "device") and len(value.args) == 1:
        value = value.args[0].value
    return isinstance(value, cst.SimpleString) and value.evaluated_value in ("cpu", "cpu:0")


def _table_lookup(func: cst.BaseExpression) -> Optional[str]:
    """``T`` of a callee ``T[key]`` or ``T.get(key, ...)`` where T is a plain name."""
    if isinstance(func, cst.Subscript) and isinstance(func.value, cst.Name):
        return func.value.value
    if isinstance(func, cst.Call) and isinstance(func.func, cst.Attribute) and func.func.attr.value == "get" \
            and isinstance(func.func.value, cst.Name) and func.args:
        return func.func.value.value
    return None


def callee_text(func: cst.BaseExpression) -> Optional[str]:
    """A callee as written, as the summaries' tables key it (``summaries.callee_text``): ``f``, ``self.m``,
    ``T[]`` for ``T[key]`` and ``T.get(key)``."""
    table = _table_lookup(func)
    return f"{table}[]" if table is not None else dotted(func)


def _base_name(base: cst.Arg) -> Optional[str]:
    """A base class as written (``MMEncoderAttention``, ``layers.Attention``); None for a keyword (metaclass=)."""
    return dotted(base.value) if base.keyword is None and not base.star else None


def _forward_targets(module: Optional[cst.Module], owner: cst.ClassDef, near: Optional[str], parsed: list) -> frozenset:
    """``engine_defs.forward_targets`` of ``owner``, a top-level class of ``module`` (its CPython tree is made
    once, into ``parsed``, for the first class that asks); empty for a nested class or without the module
    (a chunk of a large file)."""
    if module is None or not any(s is owner for s in module.body):
        return frozenset()
    from . import engine_defs

    if not parsed:
        try:
            parsed.append(ast.parse(module.code))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            parsed.append(None)
    tree = parsed[0]
    if tree is None:
        return frozenset()
    classes = {s.name: s for s in tree.body if isinstance(s, ast.ClassDef)}
    node = classes.get(owner.name.value)
    if node is None:
        return frozenset()
    got = engine_defs.forward_targets(node, classes, engine_defs.imports_of(tree.body), None, False, near)
    return got or frozenset()


def _rebound(func: cst.FunctionDef) -> frozenset:
    """The names ``func``'s own body stores to (``names.stored_names``), nested defs and classes left out."""
    out: set = set()
    stack: list = [func.body]
    while stack:
        node = stack.pop()
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            continue
        out.update(n.value for n in stored_names(node))
        stack.extend(children(node))
    return frozenset(out)


def _stored(func: cst.FunctionDef, name: str) -> Optional[list]:
    """The values ``func``'s own body assigns to ``name`` (``a, b = x, y`` pairwise); None where one is
    stored otherwise (an augmented assignment, a loop or ``with`` target, an unpacked call)."""
    out: list = []
    stack: list = [func.body]
    while stack:
        node = stack.pop()
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            continue
        if isinstance(node, cst.Assign):
            for target in node.targets:
                t, v = target.target, node.value
                if isinstance(t, cst.Name) and t.value == name:
                    out.append(v)
                elif isinstance(t, (cst.Tuple, cst.List)) and any(
                        isinstance(e.value, cst.Name) and e.value.value == name for e in t.elements):
                    if not isinstance(v, (cst.Tuple, cst.List)) or len(v.elements) != len(t.elements):
                        return None
                    out.extend(ve.value for te, ve in zip(t.elements, v.elements)
                               if isinstance(te.value, cst.Name) and te.value.value == name)
        elif isinstance(node, cst.AnnAssign) and isinstance(node.target, cst.Name) and node.target.value == name:
            if node.value is not None:
                out.append(node.value)
        elif isinstance(node, (cst.AugAssign, cst.For, cst.AsName, cst.NamedExpr)) and name in _rebound_in(node):
            return None
        stack.extend(children(node))
    return out


def _rebound_in(node: cst.CSTNode) -> frozenset:
    target = getattr(node, "target", None) or getattr(node, "name", None)
    return frozenset(_names_in(target, everywhere=True)) if target is not None else frozenset()


def _given(value: cst.BaseExpression, params: set) -> bool:
    """None, a parameter, or an attribute chain off one."""
    if is_none(value):
        return True
    while isinstance(value, cst.Attribute):
        value = value.value
    return isinstance(value, cst.Name) and value.value in params


def _build(func: cst.FunctionDef, returns=None, seeds: frozenset = frozenset()):
    """``Values(func)``, or False where the walk is too deep for the interpreter's stack. Past a test of
    prepared metadata (``if forward_metadata is not None:``) values are those of the prepared branch:
    the fallback branch runs for callers that pass no metadata, and those are reported (GL109).
    ``returns``: what the callee summaries know of the values some calls return (``summaries.Returns``);
    ``seeds``: parameters that are device metadata by a fact (``kernel_facts.offset_params``), whatever their
    names."""
    try:
        if seeds:
            return Values(func, _prepared, returns=returns,
                          param_seed=lambda name: Value(DEVICE, name) if name in seeds else seed(name))
        return Values(func, _prepared, returns=returns)
    except RecursionError:
        return False


def _returned(returns: dict, call: cst.Call) -> Optional[list]:
    """The arguments of ``call`` its definition's device result derives from, where the summaries know."""
    got = returns.get(callee_text(call.func))
    return got.bind(call.args) if got is not None else None


def _prepared(test: cst.BaseExpression) -> Optional[bool]:
    """Whether the prepared-metadata branch of ``if test:`` is its body (True) or its else (False)."""
    negated = False
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        test, negated = test.expression, True
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1 \
            and isinstance(test.comparisons[0].operator, (cst.Is, cst.IsNot)) \
            and isinstance(test.comparisons[0].comparator, cst.Name) and test.comparisons[0].comparator.value == "None":
        negated ^= isinstance(test.comparisons[0].operator, cst.Is)
        test = test.left
    name = dotted(test) if isinstance(test, (cst.Name, cst.Attribute)) else None
    if name is None or "metadata" not in name.rsplit(".", 1)[-1]:
        return None
    return not negated


def _judge(expr: cst.BaseExpression, values: Optional[ValuesOf], by_name: Callable) -> Optional[str]:
    """The metadata whose device value reading ``expr`` copies to the host, as the finding names it: a
    device value derived from metadata is, a host value is not (whatever the names); where the value
    model does not know (or there is none), ``by_name(expr)`` decides as before it."""
    model = values() if values is not None else None
    if model is not None:
        v = model.of(expr)
        if v.device and v.source:
            return by_name(expr) or _derived(model, expr) or v.source
        if v.host:
            return None
    return by_name(expr)


def _derived(model: Values, expr: cst.BaseExpression) -> Optional[str]:
    """The first name in ``expr`` (in source order, through subscripts, calls and arithmetic) holding a
    device value derived from metadata: ``spans (from cu_seqlens)``, or the metadata's own name."""
    stack: list[cst.CSTNode] = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, (cst.Name, cst.Attribute)):
            v = model.at(node)
            if v is not None and v.device and v.source:
                name = node.value if isinstance(node, cst.Name) else node.attr.value
                return name if name == v.source or is_seqlen_name(name) else f"{name} (from {v.source})"
            if isinstance(node, cst.Attribute):
                stack.append(node.value)
        elif isinstance(node, _THROUGH):
            stack.extend(reversed(children(node)))
    return None


_THROUGH = (cst.Subscript, cst.Call, cst.BinaryOperation, cst.UnaryOperation, cst.Comparison, cst.ComparisonTarget,
            cst.BooleanOperation, cst.SubscriptElement, cst.Index, cst.Slice, cst.Arg)


def module_helpers(body, helpers: dict[str, str], may_read: Optional[list[bool]] = None) -> dict[str, str]:
    """``helpers`` updated with the module-level functions of ``body`` (top-level statements, in order)
    that read the host: name -> what they read (the last such definition of a name wins). ``may_read``:
    for each function of ``body`` in order, False when its text names no read (``READ_WORDS``)."""
    defs = [stmt for stmt in body if isinstance(stmt, cst.FunctionDef)]
    if may_read is None or len(may_read) != len(defs):
        may_read = [True] * len(defs)
    for stmt, maybe in zip(defs, may_read):
        what = _first_read(stmt) if maybe else None
        if what:
            helpers[stmt.name.value] = what
    return helpers


# A helper's host read (``_host_read`` without copies) is a call of one of these names: a function whose text
# has none of them as a word reads nothing.
READ_WORDS = re.compile(r"\b(?:" + "|".join((*SYNC_METHODS, *CASTS)) + r")\b")


def _first_read(func: cst.FunctionDef) -> Optional[str]:
    """A host read in ``func``'s body, each judged with the value map of its innermost def."""
    maps: dict[int, object] = {}

    def values_of(owner: cst.FunctionDef) -> ValuesOf:
        def get() -> Optional[Values]:
            if id(owner) not in maps:
                maps[id(owner)] = _build(owner)
            return maps[id(owner)] or None  # type: ignore[return-value]
        return get

    stack: list[tuple[cst.CSTNode, cst.FunctionDef]] = [(func.body, func)]
    while stack:
        node, owner = stack.pop()
        if isinstance(node, cst.Call):
            # (A bare copy makes no helper: whether the call hands it device data is the callee summaries'
            # question, ``summaries.py``, which a helper's callers are not asked.)
            what = PerLayerHostSync._host_read(node, values_of(owner), copies=False)
            if what:
                return what
        inner = node if isinstance(node, cst.FunctionDef) else owner
        stack.extend((child, inner) for child in children(node))
    return None


def _tests_metadata(test: cst.BaseExpression) -> bool:
    """``if forward_metadata is not None`` / ``if metadata ...``: the else branch is the fallback."""
    if isinstance(test, cst.Call):
        return False
    return any("metadata" in name for name in _names_in(test, everywhere=True))


_TRUTH_METHODS = ("any", "all")


def _tensor_truth(test: cst.Call, values: Optional[ValuesOf] = None) -> Optional[str]:
    """``if (a > b).any():`` - the truth of a tensor is a device-to-host read (not of a host tensor)."""
    func = test.func
    if isinstance(func, cst.Attribute) and func.attr.value in _TRUTH_METHODS and not test.args:
        base = func.value
        if isinstance(base, cst.Comparison) or (isinstance(base, cst.Name) and not base.value.endswith(HOST_NAMES)):
            model = values() if values is not None else None
            if model is not None and model.of(base).host:
                return None
            return f"if (...).{func.attr.value}() (the truth of a tensor)"
    return None


HOST_NAMES = ("_cpu", "_host", "_list", "_np")
# Reading these gives host values whatever the tensor's device: len(t), t.shape, t.size(), t.numel() ...
_HOST_ATTRS = ("shape", "ndim", "device", "dtype", "requires_grad")
_HOST_METHODS = ("size", "numel", "dim", "cpu", "numpy")


def _device_value(expr: cst.BaseExpression) -> Optional[str]:
    """The sequence-length name whose device value ``expr`` reads, when nothing in it proves the value
    is a host one: a host-named variable, ``.cpu()``, shapes and sizes, ``len(...)`` are host values, and
    a ``.item()``/``.tolist()`` inside is reported as itself."""
    stack = [expr]
    found = None
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Name):
            if is_seqlen_name(node.value):
                found = found or node.value
        elif isinstance(node, cst.Attribute):
            if node.attr.value in _HOST_ATTRS or node.attr.value.startswith("is_"):  # t.is_npu
                continue
            if is_seqlen_name(node.attr.value):
                found = found or node.attr.value
            stack.append(node.value)
        elif isinstance(node, cst.Call):
            f = node.func
            if isinstance(f, cst.Name) and f.value in ("len", "list", "tuple", "range"):
                continue
            if isinstance(f, cst.Attribute) and (f.attr.value in _HOST_METHODS or f.attr.value.startswith("is_")):
                if f.attr.value in ("cpu", "numpy"):
                    return None
                continue
            if isinstance(f, cst.Attribute) and f.attr.value in SYNC_METHODS:
                return None
            stack.extend(children(node))
        elif isinstance(node, (cst.Subscript, cst.BinaryOperation, cst.UnaryOperation, cst.SubscriptElement,
                               cst.Index, cst.Slice, cst.Arg)):
            stack.extend(children(node))
    return found


def _metadata_truth(test: cst.BaseExpression, keyword: str = "if", values: Optional[ValuesOf] = None) -> Optional[str]:
    """``if seq_lens:``, ``if not cu_seqlens[0]:``, ``if seg_lens[i] > 0:`` - a tensor of lengths tested
    for truth; ``is None`` tests and host values (see ``_judge``) are not reads."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        test = test.expression
    if isinstance(test, cst.BooleanOperation):
        return _metadata_truth(test.left, keyword, values) or _metadata_truth(test.right, keyword, values)
    if isinstance(test, cst.Comparison):
        if any(isinstance(c.operator, (cst.Is, cst.IsNot, cst.In, cst.NotIn)) for c in test.comparisons):
            return None
        name = None
        for operand in (test.left, *(c.comparator for c in test.comparisons)):
            name = _operand(operand, values)
            if name:
                break
        return f"{keyword} ... {name} ... (the truth of a tensor)" if name else None
    if isinstance(test, (cst.Name, cst.Attribute, cst.Subscript)):
        name = _judge(test, values, _device_value)
        return f"{keyword} {name} (the truth of a tensor)" if name else None
    return None


def _operand(node: cst.BaseExpression, values: Optional[ValuesOf]) -> Optional[str]:
    """The metadata an operand of a tested comparison reads: names, attributes and subscripts by the
    value model then by names; calls and arithmetic (``spans.max() > n``) by the value model alone."""
    if isinstance(node, (cst.Name, cst.Attribute, cst.Subscript)):
        return _judge(node, values, _device_value)
    if isinstance(node, (cst.Call, cst.BinaryOperation, cst.UnaryOperation)):
        return _judge(node, values, _no_name)
    return None


def _no_name(expr: cst.BaseExpression) -> None:
    return None


def _host_only(node: cst.ClassDef) -> bool:
    """A class whose ``__init__`` raises unless on the CPU (``if not _is_cpu ...: raise``)."""
    for stmt in getattr(node.body, "body", ()):
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
            for inner in getattr(stmt.body, "body", ()):
                if not isinstance(inner, cst.If):
                    continue
                names = [n.lower() for n in _names_in(inner.test, everywhere=True)]
                if any("cpu" in n for n in names) and any(isinstance(b, cst.Raise) for b in _statements(inner.body)) \
                        and not any(other in n for n in names for other in ("cuda", "hip", "xpu", "npu", "musa")):
                    return True
    return False


def _statements(block):
    for stmt in getattr(block, "body", ()):
        if isinstance(stmt, cst.SimpleStatementLine):
            yield from stmt.body
        else:
            yield stmt


def _subtree(node: cst.CSTNode) -> list:
    """``node`` and every node under it."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(n.children)
    return out


def _none_test(test: cst.BaseExpression) -> tuple:
    """(p, True) for ``p is None``, (p, False) for ``p is not None``, (None, None) for any other test."""
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and isinstance(test.left, cst.Name) \
            and is_none(test.comparisons[0].comparator):
        op = test.comparisons[0].operator
        if isinstance(op, (cst.Is, cst.IsNot)):
            return test.left.value, isinstance(op, cst.Is)
    return None, None


def _exits(block: cst.BaseSuite) -> bool:
    """The block ends in ``return`` or ``raise``."""
    body = block.body if isinstance(block, cst.IndentedBlock) else [block]
    last: Any = body[-1] if body else None
    if isinstance(last, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
        last = last.body[-1] if last.body else None
    return isinstance(last, (cst.Return, cst.Raise))
