"""Fixes across functions: a per-layer call's metadata built once, where the layer loop runs, and passed down.

A call in a layer's method (``Block.forward`` calling the attention layer) cannot derive its metadata in
place without a host read per layer. ``plan`` follows the call graph of the file up to the one function that
runs the layer loop (``for blk in self.blocks: blk(...)``), through direct calls of submodules
(``self.attn(...)``) and of the class's own methods, and writes:

- before that loop, once: ``<param> = <the derivation, over the owner's own expressions>`` (or, when the
  owner already takes ``<param>``, the same under ``if <param> is None:``);
- a keyword parameter ``<param>=None`` on every function on the path down, and ``<param>=<param>`` at every
  call on it, the target call included.

A caller outside the file keeps working: the new parameters default to None, and the target gets None, which
it takes as before (no metadata: it derives what it needs itself, as it did). Where there is no single loop
owner (no caller in the file, two callers, recursion) or a value the derivation needs is not passed down as a
parameter, there is no fix and the reason says which.

Everything here reads the file's ``ast`` (positions) and text; it never imports the scanned code.
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

from guardlint.contracts.catalog import EncoderMetadataHoist

from .findings import Edit

_MAX_DEPTH = 4  # calls between the loop owner and the target call's function


@dataclass(frozen=True)
class Hoisted:
    """The edits of a hoisted fix (the import, if any, is the caller's to add) and what they do."""

    edits: tuple[Edit, ...]
    message: str
    owner: str  # ``Encoder.forward``: where the metadata is built


@dataclass(frozen=True)
class Refused:
    """Why there is no hoisted fix: a sentence, and a few words for a finding's line (``short``)."""

    reason: str
    short: str = "no single loop owner"


_Function = Union[ast.FunctionDef, ast.AsyncFunctionDef]


@dataclass(frozen=True)
class _Site:
    function: _Function  # the caller
    call: ast.Call
    loop: Optional[ast.For]  # the loop over the layers, when the call is made in one


class Hoister:
    """The call graph of one module, for ``plan``."""

    def __init__(self, tree: ast.Module, text: str) -> None:
        self.tree = tree
        self.lines = text.splitlines(keepends=True)
        # The parents of statements (definitions included), not of every expression: a whole-tree map took
        # most of a finding's time on large model files. An expression's function is found by its span.
        self.parent: dict[int, ast.AST] = {}
        self.functions: list[_Function] = []
        self._statements(tree.body, tree)
        self.classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        self._holders: dict[str, tuple[dict, dict]] = {}
        self._assigned: Optional[list] = None

    def _statements(self, body: list, parent: ast.AST) -> None:
        for stmt in body:
            self.parent[id(stmt)] = parent
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.append(stmt)
            for name in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, name, None)
                if isinstance(inner, list):
                    self._statements(inner, stmt)
            for handler in getattr(stmt, "handlers", ()):
                self.parent[id(handler)] = stmt
                self._statements(handler.body, handler)
            for case in getattr(stmt, "cases", ()):
                self.parent[id(case)] = stmt
                self._statements(case.body, case)

    # -- positions: ast gives UTF-8 byte columns, edits want characters (1-based) ---------------------------
    def _col(self, line: int, byte_col: int) -> int:
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return len(text.encode("utf-8")[:byte_col].decode("utf-8", "replace")) + 1

    def _start(self, node: ast.AST) -> tuple[int, int]:
        return node.lineno, self._col(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def _end(self, node: ast.AST) -> tuple[int, int]:
        line = node.end_lineno  # type: ignore[attr-defined]
        return line, self._col(line, node.end_col_offset)  # type: ignore[attr-defined]

    def _insert(self, at: tuple[int, int], content: str) -> Edit:
        return Edit(at[0], at[1], at[0], at[1], content)

    # -- the call graph ---------------------------------------------------------------------------------
    def find_call(self, line: int, column: int, end_line: int, end_column: int) -> Optional[ast.Call]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and node.lineno == line and node.end_lineno == end_line \
                    and self._start(node)[1] == column and self._end(node)[1] == end_column:
                return node
        return None

    def enclosing(self, node: ast.AST) -> tuple[Optional[_Function], Optional[ast.ClassDef]]:
        """The function a node is in and, when that function is a method, its class."""
        current = self.parent.get(id(node))
        if current is None and not isinstance(node, ast.stmt):  # an expression: the innermost function around it
            start = (node.lineno, node.col_offset)  # type: ignore[attr-defined]
            end = (node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
            around = [f for f in self.functions if (f.lineno, f.col_offset) <= start
                      and end <= (f.end_lineno, f.end_col_offset)]
            current = max(around, key=lambda f: (f.lineno, f.col_offset)) if around else None
        while current is not None and not isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef)):
            current = self.parent.get(id(current))
        if current is None:
            return None, None
        owner = self.parent.get(id(current))
        return current, owner if isinstance(owner, ast.ClassDef) else None

    def _holders_of(self, cls: ast.ClassDef) -> tuple[dict, dict]:
        """Attributes of other classes' instances that hold ``cls`` instances: (single: attr -> holder class
        names, containers: attr -> holder class names), from ``self.<attr> = Cls(...)`` and from
        ``self.<attr> = nn.ModuleList([Cls(...) for ...])`` and the like."""
        got = self._holders.get(cls.name)
        if got is not None:
            return got
        single: dict[str, set] = {}
        many: dict[str, set] = {}
        for holder, attr, direct, called in self._self_assignments():
            if direct == cls.name:
                single.setdefault(attr, set()).add(holder)
            elif cls.name in called:
                many.setdefault(attr, set()).add(holder)
        self._holders[cls.name] = (single, many)
        return single, many

    def _self_assignments(self) -> list:
        """Every ``self.<attr> = value`` of the file's classes, once: (class name, attr, the name the value calls
        when it is a call, every name called inside the value)."""
        if self._assigned is None:
            self._assigned = []
            for holder in self.classes:
                for stmt in _statements_in(holder.body):
                    if not isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                        continue
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    value = stmt.value
                    if value is None or len(targets) != 1:
                        continue
                    attr = _self_attribute(targets[0])
                    if attr is None:
                        continue
                    direct = _called_name(value) if isinstance(value, ast.Call) else None
                    called = {_called_name(n) for n in ast.walk(value) if isinstance(n, ast.Call)}
                    self._assigned.append((holder.name, attr, direct, called))
        return self._assigned

    def callers(self, fn: _Function, cls: ast.ClassDef) -> list[_Site]:
        """Where this file calls method ``fn`` of ``cls``: through an attribute holding an instance
        (``self.attn(...)`` for forward, ``self.attn.m(...)``), in a loop over an attribute holding
        instances (``for blk in self.blocks: blk(...)``), or from another method of the class
        (``self.m(...)``)."""
        single, many = self._holders_of(cls)
        sites: list[_Site] = []
        by_name = {c.name: c for c in self.classes}
        for holder_name in sorted(set().union(*single.values(), *many.values()) | {cls.name}):
            holder = by_name.get(holder_name)
            if holder is None:
                continue
            for method in holder.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in _walk_body(method.body):
                    if isinstance(node, ast.For):
                        attr = _iterated_attribute(node.iter)
                        if attr is not None and holder_name in many.get(attr, ()):
                            names = _loop_names(node.target)
                            for inner in _walk_body(node.body):
                                if isinstance(inner, ast.Call) and _calls_instance(inner.func, names, fn.name):
                                    sites.append(_Site(method, inner, node))
                    elif isinstance(node, ast.Call):
                        f = node.func
                        if isinstance(f, ast.Attribute):
                            attr = _self_attribute(f)
                            if attr is not None and holder_name in single.get(attr, ()) and fn.name == "forward":
                                sites.append(_Site(method, node, None))  # self.attn(...)
                            elif attr == fn.name and holder is cls and method is not fn:
                                sites.append(_Site(method, node, None))  # self.m(...) within the class
                            elif attr is None and f.attr == fn.name and isinstance(f.value, ast.Attribute):
                                inner_attr = _self_attribute(f.value)
                                if inner_attr is not None and holder_name in single.get(inner_attr, ()):
                                    sites.append(_Site(method, node, None))  # self.attn.m(...)
        return sites

    # -- the fix --------------------------------------------------------------------------------------
    def path(self, call: ast.Call) -> Union[tuple[_Function, list[_Site]], Refused]:
        """The call's function and the calls above it up to the one that runs in the layer loop (last), or why
        there is no single such path."""
        fn, cls = self.enclosing(call)
        if fn is None or cls is None:
            return Refused("the call is not in a method of a class of this file", "not in a method")
        path: list[_Site] = []
        current, current_cls = fn, cls
        seen = {id(fn)}
        while True:
            sites = self.callers(current, current_cls)
            label = f"{current_cls.name}.{current.name}"
            if not sites:
                return Refused(f"nothing in this file calls {label}: the loop over the layers is elsewhere",
                               "no layer loop in this file")
            owners = sorted({self._label(s.function) for s in sites})
            if len(sites) > 1:
                where = " and ".join(owners) if len(owners) > 1 else f"{owners[0]} ({len(sites)} calls)"
                return Refused(f"{label} is called from {where}: no single loop owner", "no single loop owner")
            site = sites[0]
            if id(site.function) in seen:
                return Refused(f"{label} is reached again from itself (recursion)", "recursion")
            seen.add(id(site.function))
            path.append(site)
            if site.loop is not None:
                break
            if len(path) > _MAX_DEPTH:
                return Refused(f"more than {_MAX_DEPTH} calls between {label} and a layer loop")
            current = site.function
            _, found = self.enclosing(site.call)
            if found is None:
                return Refused(f"{site.function.name} is not a method")
            current_cls = found
        return fn, path

    def plan(self, call: ast.Call, param: str, template: str, sources: dict[str, str]) -> Union[Hoisted, Refused]:
        """``param=<template>`` built once at the loop owner and passed down to ``call``. ``sources``: the
        template's placeholders and the names the target call passes for them (each must be a parameter
        of the call's function, passed down from the owner)."""
        found = self.path(call)
        if isinstance(found, Refused):
            return found
        fn, path = found
        owner_site = path[-1]
        owner_fn = owner_site.function
        owner_label = self._label(owner_fn)
        loop = owner_site.loop
        assert loop is not None

        # The template's values, from the target call's arguments up through the path to the owner.
        chain: list[tuple[_Function, ast.Call]] = [(fn, call)] + [(s.function, s.call) for s in path]
        owner_values: dict[str, str] = {}
        for placeholder, name in sources.items():
            expr = self._passed_up(chain, name, loop)
            if isinstance(expr, Refused):
                return Refused(f"{placeholder} {expr.reason}", f"{placeholder} not passed down")
            owner_values[placeholder] = expr
        try:
            built = template.format(**owner_values)
        except (KeyError, IndexError, ValueError):
            return Refused(f"the derivation template ({template!r}) cannot be filled")

        # Parameters on the way down (every function below the owner) and the keyword at every call.
        below = [fn] + [s.function for s in path[:-1]]
        down = self._pass_down(below, call, path, param, Refused("").short)
        if isinstance(down, Refused):
            return down
        edits: list[Edit] = down
        # The metadata, once, before the loop.
        if _assigned(owner_fn, param):
            return Refused(f"{param} already names a value in {owner_label}")
        indent = self._indent_of(loop)
        if indent is None:
            return Refused("the layer loop does not start its line")
        nl = _newline(self.lines[loop.lineno - 1])
        if _has_param(owner_fn, param):
            step = _indent_step(indent, self.lines)
            text = f"{indent}if {param} is None:{nl}{indent}{step}{param} = {built}{nl}"
        else:
            text = f"{indent}{param} = {built}{nl}"
        edits.append(Edit(loop.lineno, 1, loop.lineno, 1, text))
        names = " -> ".join([owner_label] + [self._label(f) for f in reversed(below)])
        message = (f"Build {param} = {built} once in {owner_label}, before its layer loop, and pass it down "
                   f"({names}) to the call")
        return Hoisted(tuple(sorted(edits)), message, owner_label)

    def plan_encoder_metadata(self, call: ast.Call, spec: EncoderMetadataHoist, call_params: Sequence[str], *,
                              file: Optional[str] = None, sync_allowed: bool = False) -> Union[Hoisted, Refused]:
        """``spec.param`` built once at the loop owner with the engine's own helpers, from the attention layer of the
        first block and a host copy of the offsets the loop passes down; under the backend that reads them (the
        helper's answer is not None) the values of ``spec.rebuilt`` the loop passes down are rebuilt as well, and
        the value tensor is made contiguous at the call where it is not already. The width the offsets use under
        FP8 comes from ``spec.width_helper``, called in the owner's ``__init__``. ``call_params``: the target's
        positional parameters (how the call's arguments are found); ``file``: the file's path (its neighbours may
        capture the tower in a CUDA graph); ``sync_allowed``: the host copy is written inside
        ``spec.sync_allowed``'s context (the caller has found the engine defines it)."""
        param, param_template = spec.param
        found = self.path(call)
        if isinstance(found, Refused):
            return found
        fn, path = found
        owner_site = path[-1]
        owner_fn, loop = owner_site.function, owner_site.loop
        assert loop is not None
        owner_cls = self.parent.get(id(owner_fn))
        target_label = self._label(fn)
        owner_label = self._label(owner_fn)
        value = _call_argument(call, "value", call_params)
        if value is None:  # the offsets written below describe v's layout: it must be seen
            return Refused("the call's value tensor is not among its arguments", "value not found")
        contiguous_at = self._contiguous_at(fn, value, call)

        # A tower that builds the engine's metadata already (vLLM's prepare_encoder_metadata) hands its blocks offsets
        # in the helper's default layout, where v is a view into the fused qkv projection at three times q's stride.
        builder = _helper_caller(owner_cls, spec) if isinstance(owner_cls, ast.ClassDef) else None
        if builder is not None:
            v_is = f"makes v contiguous (line {contiguous_at})" if contiguous_at else \
                "passes a v that cannot be shown to be such a view"
            where = f"{owner_cls.name}.{builder}"  # type: ignore[union-attr]
            return Refused(f"{where} builds {param} with {spec.helper_class}'s helpers and the layer loop does not "
                           f"pass it, but the cu_seqlens it builds address v at three times q's stride "
                           f"(a view into a fused qkv projection) and {target_label} {v_is}: passed on, {param} "
                           f"would let the kernel read v at wrong offsets", "owner's offsets do not fit v")

        chain = self._layer_chain(fn, call, path, loop)
        if isinstance(chain, Refused):
            return chain
        # What the call passes for the values rebuilt, carried down from the owner as parameters, read by nothing else.
        levels: list[tuple[_Function, ast.Call]] = [(fn, call)] + [(s.function, s.call) for s in path[:-1]]
        owner_names: dict[str, str] = {}
        for name, _ in spec.rebuilt:
            arg = _call_argument(call, name, call_params)
            if not isinstance(arg, ast.Name):
                what = "passes no " + name if arg is None else f"passes {name} as `{_segment(self.lines, arg)}`"
                return Refused(f"the call {what}, not a value passed down from the layer loop",
                               f"{name} not passed down")
            carried = self._carried(levels, owner_site, arg.id, loop)
            if isinstance(carried, Refused):
                return Refused(f"{name} {carried.reason}", f"{name} {carried.short}")
            owner_names[name] = carried
        cu = owner_names.get("cu_seqlens", "")
        host = f"{cu}_cpu"

        # New names in the owner, and the names the fix needs at the top of the file (the helpers it imports
        # itself must not be local names where it calls them).
        width_name = spec.width_helper[1]
        sync_name = spec.sync_allowed[1]
        for taken in (spec.layer, host, param) + ((sync_name,) if sync_allowed else ()):
            if _has_param(owner_fn, taken) or _assigned(owner_fn, taken):
                return Refused(f"{taken} already names a value in {owner_label}", "name taken")
        for module_name in (spec.helper_class, "torch"):
            if module_name not in _module_names(self.tree):
                return Refused(f"{module_name} is not imported at the top of this file", f"no {module_name} import")

        # The tower must not run inside the engine's CUDA graph capture: the host copy would be an error there (and
        # any host value a graph keeps is wrong for the next batch).
        captured = self._captured(owner_cls, spec, file) if isinstance(owner_cls, ast.ClassDef) else None
        if captured is not None:
            return captured

        # The FP8 width, kept by the owner from its __init__ (where the engine's config is set).
        init = self._width_edit(owner_cls, loop, chain, spec)
        if isinstance(init, Refused):
            return init

        below = [fn] + [s.function for s in path[:-1]]
        down = self._pass_down(below, call, path, param, "name taken")
        if isinstance(down, Refused):
            return down
        edits: list[Edit] = [init, *down]
        if contiguous_at is None:
            parts = list(call.args) + [k.value for k in call.keywords]
            if parts and max(parts, key=lambda n: (n.end_lineno, n.end_col_offset)) is value:
                return Refused("the value tensor is the call's last argument", "value passed last")
            text = ast.get_source_segment("".join(self.lines), value) or ""
            simple = isinstance(value, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
            (l0, c0), (l1, c1) = self._start(value), self._end(value)
            edits.append(Edit(l0, c0, l1, c1, spec.value.format(value=text if simple else f"({text})")))

        indent = self._indent_of(loop)
        if indent is None:
            return Refused("the layer loop does not start its line")
        nl = _newline(self.lines[loop.lineno - 1])
        inner = self._indent_of(loop.body[0]) or ""
        step = inner[len(indent):] if inner.startswith(indent) and len(inner) > len(indent) \
            else _indent_step(indent, self.lines)
        fill = {"layer": spec.layer, "host": host, "cu": cu, "width": f"self.{spec.width}"}
        read = f"{host} = {spec.host.format(**fill)}"
        built = [("", f"with {sync_name}():"), (step, read)] if sync_allowed else [("", read)]
        built.append(("", f"{param} = {param_template.format(**fill)}"))
        if _may_be_none(owner_fn, cu, loop):  # a caller may pass no offsets: the layers then take their own path
            lines = [(indent, f"{spec.layer} = {chain}"), (indent, f"{param} = None"),
                     (indent, f"if {cu} is not None:")] + [(indent + step + more, line) for more, line in built]
        else:
            lines = [(indent, f"{spec.layer} = {chain}")] + [(indent + more, line) for more, line in built]
        lines.append((indent, f"if {param} is not None:"))
        lines += [(indent + step, f"{owner_names[name]} = {template.format(**fill)}")
                  for name, template in spec.rebuilt]
        text = "".join(_wrapped(line, at, step, nl) for at, line in lines)
        edits.append(Edit(loop.lineno, 1, loop.lineno, 1, text))
        compiled = self._compiled_edits(below, param, spec)
        if isinstance(compiled, Refused):
            return compiled
        edits += compiled
        names = " -> ".join([owner_label] + [self._label(f) for f in reversed(below)])
        also = " and ".join(name for name, _ in spec.rebuilt)
        made = "; v made contiguous at the call" if contiguous_at is None else ""
        owner_name = owner_cls.name if isinstance(owner_cls, ast.ClassDef) else owner_label
        marked = f"; the host copy in {sync_name}()" if sync_allowed else ""
        message = (f"Build {param} once in {owner_label}, before its layer loop, with {spec.helper_class}'s own "
                   f"helpers (where the backend reads it, also {also} as it reads them{made}; the FP8 width from "
                   f"{width_name} in {owner_name}.__init__{marked}), and pass it down ({names}) to the call")
        return Hoisted(tuple(sorted(edits)), message, owner_label)

    def _width_edit(self, owner_cls: Optional[ast.AST], loop: ast.For, chain: str,
                    spec: EncoderMetadataHoist) -> Union[Edit, Refused]:
        """``self.<spec.width> = <spec.width_helper>`` in the owner's ``__init__``, just after the statement that builds
        the layers the loop runs over (the helper reads the engine's config, which is set only while the model is
        built; the layer it is asked about exists from there)."""
        _, helper, _, template = spec.width_helper
        if not isinstance(owner_cls, ast.ClassDef):
            return Refused("the layer loop is not in a method of a class", "no owner class")
        init = next((f for f in owner_cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and f.name == "__init__"), None)
        if init is None:
            return Refused(f"{owner_cls.name} has no __init__ of its own, where {helper} must run (it reads the "
                           f"engine's config, which is set only while the model is built)", "no __init__ in the owner")
        taken = any(_self_attribute(n) == spec.width for n in ast.walk(owner_cls)) or any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == spec.width for n in owner_cls.body)
        if taken:
            return Refused(f"self.{spec.width} already names a value in {owner_cls.name}", "name taken")
        if _has_param(init, helper) or _assigned(init, helper):
            return Refused(f"{helper} already names a value in {owner_cls.name}.__init__", "name taken")
        attr = _iterated_attribute(loop.iter)
        builds = [stmt for stmt in init.body if any(
            isinstance(n, (ast.Assign, ast.AnnAssign)) and any(
                _self_attribute(t) == attr for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
            for n in ast.walk(stmt))]
        if not builds:
            return Refused(f"{owner_cls.name}.__init__ does not build self.{attr}, after which {helper} can ask its "
                           f"first layer", "layers not built in __init__")
        after = builds[-1]
        if not isinstance(after, (ast.Assign, ast.AnnAssign, ast.With)):  # a branch may leave it unbuilt
            return Refused(f"{owner_cls.name}.__init__ builds self.{attr} in a branch or a loop (line {after.lineno}), "
                           f"after which it may not exist", "layers not built in __init__")
        indent = self._indent_of(after)
        end = after.end_lineno or after.lineno
        if indent is None:
            return Refused(f"the statement that builds self.{attr} in {owner_cls.name}.__init__ does not start "
                           f"its line", "layers not built in __init__")
        if end >= len(self.lines):
            return Refused(f"the statement that builds self.{attr} in {owner_cls.name}.__init__ ends the file",
                           "layers not built in __init__")
        nl = _newline(self.lines[end - 1])
        outer = self._indent_of(init) or ""
        step = indent[len(outer):] if indent.startswith(outer) and len(indent) > len(outer) \
            else _indent_step(indent, self.lines)
        line = f"self.{spec.width} = {template.format(layer=chain)}"
        return Edit(end + 1, 1, end + 1, 1, _wrapped(line, indent, step, nl))

    def _compiled_edits(self, below: Sequence[_Function], param: str,
                        spec: EncoderMetadataHoist) -> Union[list[Edit], Refused]:
        """``"<param>": 0`` added to the dynamic dimensions of every compiled forward on the way down that gets the new
        parameter (the engine's compiler marks only the inputs named there as of dynamic size, so a tensor whose
        length follows the batch would be compiled for the first batch's)."""
        decorator, keyword = spec.compiled
        edits: list[Edit] = []
        for f in below:
            cls = self.parent.get(id(f))
            if f.name != "forward" or not isinstance(cls, ast.ClassDef):
                continue
            for d in cls.decorator_list:
                if not isinstance(d, ast.Call) or _called_name(d) != decorator:
                    continue
                dims = next((k.value for k in d.keywords if k.arg == keyword), None)
                if not isinstance(dims, ast.Dict) or not dims.keys or any(
                        not (isinstance(k, ast.Constant) and isinstance(k.value, str)) for k in dims.keys):
                    return Refused(f"{cls.name}.forward is compiled (@{decorator}) without a {keyword} dict that "
                                   f"the fix can add {param} to", "compiled without dims")
                if any(k.value == param for k in dims.keys):  # type: ignore[union-attr]
                    continue
                first = ast.get_source_segment("".join(self.lines), dims.keys[0]) or '"'  # type: ignore[arg-type]
                quote = "'" if first.startswith("'") else '"'
                edits.append(self._after(self._end(dims.values[-1]), f"{quote}{param}{quote}: 0"))
        return edits

    def _captured(self, owner_cls: ast.ClassDef, spec: EncoderMetadataHoist,
                  path: Optional[str]) -> Optional[Refused]:
        """Why no fix, where the engine runs the owner inside a CUDA graph capture: a class defines
        ``spec.capture_hook`` and what it calls there (through ``self``'s attributes, then every module those hold)
        reaches the owner's class. The class is looked for in this file and in the files beside it that import
        from it."""
        here = _ClassFile(self.tree, self.classes, {})
        found = _capture_in(here, here, owner_cls, spec.capture_hook)
        where = ""
        if found is None and path and path != "-":
            stem = os.path.splitext(os.path.basename(path))[0]
            for other_path, tree in _neighbours(path, spec.capture_hook, stem):
                imported = _imported_from(tree, stem, os.path.basename(os.path.dirname(os.path.abspath(path))))
                if not imported:
                    continue
                classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
                found = _capture_in(_ClassFile(tree, classes, imported), here, owner_cls, spec.capture_hook)
                if found is not None:
                    where = f" in {os.path.basename(other_path)}"
                    break
        if found is None:
            return None
        hook_cls = found
        label = f"{hook_cls.name}.{spec.capture_hook}{where}"
        own = {m.name for m in owner_cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
        hooks = {m.name for m in hook_cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
        seam = next((f"{owner_cls.name}.{m}" for m in spec.capture_seams if m in own), None) or \
            next((f"{hook_cls.name}.{m}{where}" for m in spec.capture_seams if m in hooks), None)
        param = spec.param[0]
        build = f"build {param} in {seam}, outside the capture" if seam else \
            f"build {param} where the graph's inputs are prepared, outside the capture"
        return Refused(f"the tower is captured in a CUDA graph ({label}), where the host copy of the offsets is "
                       f"an error and a host value would be kept for every later batch: {build}",
                       "tower captured in a CUDA graph")

    def _layer_chain(self, fn: _Function, call: ast.Call, path: Sequence[_Site], loop: ast.For) -> Union[str, Refused]:
        """The attention layer the call is made on, as the loop owner reaches it in the first block:
        ``self.blocks[0].attn.attn`` (the loop's attribute, then the attribute each call on the way down is made
        through). The layer must be built in its class (``self.attn = MMEncoderAttention(...)``) with as many k/v
        heads as q heads (the helper's offsets give q, k and o one stride)."""
        attr = _iterated_attribute(loop.iter)
        if attr is None:
            return Refused("the layer loop does not run over an attribute of self", "no layer list")
        chain = f"self.{attr}[0]"
        for i in range(len(path) - 2, -1, -1):
            site = path[i]
            callee = path[i - 1].function if i else fn
            if self.parent.get(id(callee)) is self.parent.get(id(site.function)):
                continue  # self.m(...): a method of the same layer
            hop = _through(site.call.func)
            if hop is None:
                return Refused(f"{self._label(site.function)} does not call the layer below through self",
                               "layer not reached")
            chain += hop
        target = _self_attribute(call.func)
        cls = self.enclosing(call)[1]
        built = [stmt.value for stmt in ast.walk(cls) if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                 and _self_attribute(stmt.targets[0]) == target] if target and cls is not None else []
        if len(built) != 1 or not isinstance(built[0], ast.Call):
            return Refused(f"the attention layer of {self._label(fn)} is not built once in its class "
                           f"(self.<name> = {_called_name(call) or '...'}(...))", "layer not built in its class")
        make = built[0]
        kv = next((k.value for k in make.keywords if k.arg == "num_kv_heads"),
                  make.args[3] if len(make.args) > 3 else None)
        heads = next((k.value for k in make.keywords if k.arg == "num_heads"), make.args[0] if make.args else None)
        if kv is not None and not (isinstance(kv, ast.Constant) and kv.value is None) and \
                (heads is None or ast.dump(kv) != ast.dump(heads)):
            return Refused(f"{self._label(fn)}'s layer has num_kv_heads={_segment(self.lines, kv)}: k and v are "
                           f"narrower than q, and the helper's offsets give q, k and o one stride", "grouped k/v heads")
        return f"{chain}.{target}"

    def _carried(self, levels: Sequence[tuple[_Function, ast.Call]], owner_site: _Site, name: str,
                 loop: ast.For) -> Union[str, Refused]:
        """The owner's name for the value the target call passes as ``name``: a parameter of each function below,
        passed on unchanged and read by nothing but the call on the way down, and in the owner a plain name read
        after the loop starts only where the loop passes it down (the fix rebinds it there)."""
        chain = list(levels) + [(owner_site.function, owner_site.call)]
        owner_expr = self._passed_up(chain, name, loop)
        if isinstance(owner_expr, Refused):
            return owner_expr
        if not owner_expr.isidentifier():
            return Refused(f"reaches the layers as `{owner_expr}`, which the fix cannot rebind", "not a name")
        current = name
        for i, (f, c) in enumerate(levels):
            stray = _stray_read(f, current, c)
            if stray is not None:
                return Refused(f"is also read in {self._label(f)} (line {stray}), where the rebuilt value would reach "
                               f"it", "read on the way down")
            if i + 1 < len(levels):
                arg = _argument_for(levels[i + 1][1], f, current)
                assert isinstance(arg, ast.Name)  # _passed_up checked it
                current = arg.id
        owner = owner_site.function
        for node in _walk_body(owner.body):
            if isinstance(node, ast.Name) and node.id == owner_expr and isinstance(node.ctx, ast.Load) \
                    and node.lineno >= loop.lineno and not _is_argument(owner_site.call, node):
                return Refused(f"is read again in {self._label(owner)} (line {node.lineno}) after its layer loop "
                               f"starts, where the rebuilt value would reach it", "read after the loop")
        return owner_expr

    def _contiguous_at(self, fn: _Function, expr: ast.AST, call: ast.Call, depth: int = 0) -> Optional[int]:
        """The line where ``expr`` (the value tensor the call passes) is made contiguous, when it is: ``x.contiguous()``
        itself, ``.unsqueeze(...)`` of such a tensor, or a name last assigned one before the call (also through a
        tuple of them, or a generator over them: ``q, k, v = (t.contiguous() for t in (q, k, v))``)."""
        if depth > 8:
            return None
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            if expr.func.attr == "contiguous" and not expr.args:
                return expr.lineno
            if expr.func.attr == "unsqueeze":
                return self._contiguous_at(fn, expr.func.value, call, depth + 1)
            return None
        if not isinstance(expr, ast.Name):
            return None
        # The last assignment before the call, a statement of the function's own body (one in a branch or a loop
        # may not be the one that ran).
        last: Optional[ast.Assign] = None
        for node in _walk_body(fn.body):
            if not (isinstance(node, ast.stmt) and node.lineno < call.lineno and _assigned_in(node, expr.id)) \
                    or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if not isinstance(node, ast.Assign) or len(node.targets) != 1 or not any(s is node for s in fn.body):
                if isinstance(node, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
                    continue  # the statements inside are looked at themselves
                return None
            if last is None or node.lineno > last.lineno:
                last = node
        if last is None:
            return None
        target, value = last.targets[0], last.value
        if isinstance(target, ast.Name):
            return self._contiguous_at(fn, value, call, depth + 1)
        if isinstance(target, (ast.Tuple, ast.List)):
            index = next((i for i, t in enumerate(target.elts) if isinstance(t, ast.Name) and t.id == expr.id), None)
            if index is None:
                return None
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                return self._contiguous_at(fn, value.elts[index], call, depth + 1)
            if isinstance(value, (ast.GeneratorExp, ast.ListComp)) and len(value.generators) == 1:
                element = value.elt
                while isinstance(element, ast.Call) and isinstance(element.func, ast.Attribute) \
                        and element.func.attr == "unsqueeze":
                    element = element.func.value
                if isinstance(element, ast.Call) and isinstance(element.func, ast.Attribute) \
                        and element.func.attr == "contiguous" and not element.args:
                    return element.lineno
        return None

    def _label(self, f: _Function) -> str:
        cls = self.parent.get(id(f))
        return f"{cls.name}.{f.name}" if isinstance(cls, ast.ClassDef) else f.name

    def _passed_up(self, chain: Sequence[tuple[_Function, ast.Call]], name: str, loop: ast.For) -> Union[str, Refused]:
        """The owner's expression for the value the target call passes as ``name``."""
        current = name
        for i, (f, c) in enumerate(chain):
            last = i == len(chain) - 1
            if i == 0:
                # The target call's own function: the value must be its parameter, never rebound.
                if not _has_param(f, current):
                    return Refused("is computed there, not passed down", "computed in the layer")
                if _assigned(f, current):
                    return Refused("is reassigned there", "reassigned in the layer")
                continue
            # ``c`` calls chain[i - 1]'s function: the argument it binds to ``current``.
            callee = chain[i - 1][0]
            expr = _argument_for(c, callee, current)
            if expr is None:
                return Refused(f"is not passed to {self._label(callee)} by {self._label(f)}", "not passed down")
            if last:
                text = _reevaluable(expr)
                if text is None:
                    return Refused(f"is passed to the layers as `{_segment(self.lines, expr)}`, which cannot be "
                                   f"evaluated once before the loop", "not a name")
                root = _root_name(expr)
                if root in _loop_names(loop.target) or any(_assigned_in(stmt, root) for stmt in loop.body):
                    return Refused(f"changes inside the layer loop of {self._label(f)}", "changes in the loop")
                return text
            if not isinstance(expr, ast.Name) or not _has_param(f, expr.id) or _assigned(f, expr.id):
                return Refused(f"reaches {self._label(callee)} from {self._label(f)} as something other than its own "
                               f"parameter", "not passed down")
            current = expr.id
        return Refused("has no owner", "not passed down")

    def _pass_down(self, below: list, call: ast.Call, path: Sequence[_Site], param: str,
                   taken: str) -> Union[list[Edit], Refused]:
        """A ``param=None`` parameter on every function ``below`` the owner and ``param=param`` at every call on
        the way (the target ``call`` and the path's); ``taken``: the short reason where a function already uses
        the name otherwise."""
        edits: list[Edit] = []
        for f in below:
            problem = _name_taken(f, param)
            if problem:
                return Refused(f"{param} {problem} in {f.name}", taken)
            if not _has_param(f, param):
                added = self._param_edit(f, param)
                if isinstance(added, Refused):
                    return added
                edits.append(added)
        for c in [call] + [s.call for s in path]:
            passed = self._keyword_edit(c, param)
            if isinstance(passed, Refused):
                return passed
            if passed is not None:
                edits.append(passed)
        return edits

    def _param_edit(self, f: _Function, param: str) -> Union[Edit, Refused]:
        args = f.args
        if args.kwarg is not None:
            line, col = self._start(args.kwarg)
            text = self.lines[line - 1]
            at = text.rfind("**", 0, col - 1)
            if at < 0:
                return Refused(f"the ** of {f.name}'s signature could not be located")
            if not text[:at].strip():  # one parameter a line: the new one gets its own
                return self._insert((line, at + 1), f"{param}=None,{_newline(text)}{text[:at]}")
            return self._insert((line, at + 1), f"{param}=None, ")
        ordered: list[tuple[ast.AST, Optional[ast.AST]]] = []
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        ordered += list(zip(positional, defaults))
        if args.vararg is not None:
            ordered.append((args.vararg, None))
        ordered += list(zip(args.kwonlyargs, args.kw_defaults))
        if not ordered:
            return Refused(f"{f.name} takes no parameters")
        last, default = ordered[-1]
        if last in args.posonlyargs and not args.args and args.vararg is None and not args.kwonlyargs:
            return Refused(f"{f.name} takes positional-only parameters")
        return self._after(self._end(default if default is not None else last), f"{param}=None")

    def _keyword_edit(self, c: ast.Call, param: str) -> Union[Edit, Refused, None]:
        for k in c.keywords:
            if k.arg == param:
                if isinstance(k.value, ast.Constant) and k.value.value is None:
                    (l0, c0), (l1, c1) = self._start(k.value), self._end(k.value)
                    return Edit(l0, c0, l1, c1, param)
                if isinstance(k.value, ast.Name) and k.value.id == param:
                    return None
                return Refused(f"a call on the way passes {param}= already")
        parts: list[ast.AST] = list(c.args) + list(c.keywords)
        if parts:
            last = max(parts, key=lambda n: (n.end_lineno, n.end_col_offset))  # type: ignore[attr-defined]
            return self._after(self._end(last), f"{param}={param}")
        line, col = self._end(c)
        return self._insert((line, col - 1), f"{param}={param}")

    def _after(self, end: tuple[int, int], item: str) -> Edit:
        """``item`` added after the list element that ends at ``end``: on a line of its own when the list is
        written one element a line with a trailing comma (``x,`` then the line break), else ``, item``."""
        line, col = end
        text = self.lines[line - 1]
        rest = text[col - 1:]
        after = rest.lstrip(" \t")[1:].strip(" \t\r\n")
        if rest.lstrip(" \t").startswith(",") and (not after or after.startswith("#")) and line < len(self.lines):
            indent = text[: len(text) - len(text.lstrip(" \t"))]
            if after:  # a comment ends the line: it stays with the element it follows, the new one goes below
                return self._insert((line, len(text.rstrip("\r\n")) + 1), f"{_newline(text)}{indent}{item},")
            comma = col - 1 + (len(rest) - len(rest.lstrip(" \t"))) + 1  # just after the trailing comma
            return self._insert((line, comma + 1), f"{_newline(text)}{indent}{item},")
        return self._insert(end, f", {item}")

    def _indent_of(self, stmt: ast.stmt) -> Optional[str]:
        text = self.lines[stmt.lineno - 1]
        head = text[: self._col(stmt.lineno, stmt.col_offset) - 1]
        return head if not head.strip() else None


# -- helpers on ast nodes ------------------------------------------------------------------------------
def _self_attribute(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


_WIDTH = 88  # the line length the engines' own formatter keeps; longer assignments the fix writes are wrapped


def _wrapped(line: str, indent: str, step: str, nl: str) -> str:
    """``line`` (``name = call(...)``) at ``indent``, its call's arguments on lines of their own when it is long:
    all on one line inside the parentheses when they fit, else one a line, as the engines' formatter writes them."""
    if len(indent) + len(line) <= _WIDTH:
        return f"{indent}{line}{nl}"
    try:
        stmt = ast.parse(line).body[0]
    except (SyntaxError, IndexError):
        return f"{indent}{line}{nl}"
    if not isinstance(stmt, ast.Assign) or not isinstance(stmt.value, ast.Call):
        return f"{indent}{line}{nl}"
    call = stmt.value
    head = line[: call.func.end_col_offset]
    parts = [ast.get_source_segment(line, a) or "" for a in call.args]
    parts += [f"{k.arg}={ast.get_source_segment(line, k.value)}" if k.arg
              else f"**{ast.get_source_segment(line, k.value)}"
              for k in call.keywords]
    inside = indent + step
    if len(inside) + len(", ".join(parts)) <= _WIDTH:
        return f"{indent}{head}({nl}{inside}{', '.join(parts)}{nl}{indent}){nl}"
    values = [None] * len(call.args) + [k.value for k in call.keywords]

    def one(part: str, value: Optional[ast.AST]) -> str:
        # A keyword whose value is an operation too long for its line: the value in parentheses, a line lower.
        if len(inside) + len(part) + 1 > _WIDTH and isinstance(value, (ast.BoolOp, ast.BinOp)) and "=" in part:
            keyword, _, rest = part.partition("=")
            return f"{inside}{keyword}=({nl}{inside}{step}{rest}{nl}{inside}),{nl}"
        return f"{inside}{part},{nl}"
    return f"{indent}{head}({nl}" + "".join(one(p, v) for p, v in zip(parts, values)) + f"{indent}){nl}"


def _may_be_none(f: _Function, name: str, loop: ast.For) -> bool:
    """Whether ``name`` may be None where the layer loop starts: a parameter that defaults to None, neither
    rebound nor refused when None (``if name is None: raise``, ``assert name is not None``) before the loop."""
    a = f.args
    positional = a.posonlyargs + a.args
    defaults = dict(zip([p.arg for p in positional[len(positional) - len(a.defaults):]], a.defaults))
    defaults.update((p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None)
    default = defaults.get(name)
    if not (isinstance(default, ast.Constant) and default.value is None):
        return False
    for stmt in f.body:
        if stmt.lineno >= loop.lineno:
            break
        if _assigned_in(stmt, name):
            return False
        test = stmt.test if isinstance(stmt, (ast.If, ast.Assert)) else None
        if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == name \
                and len(test.ops) == 1 and isinstance(test.comparators[0], ast.Constant) \
                and test.comparators[0].value is None:
            if isinstance(stmt, ast.Assert) and isinstance(test.ops[0], ast.IsNot):
                return False
            if isinstance(stmt, ast.If) and isinstance(test.ops[0], ast.Is) \
                    and any(isinstance(n, ast.Raise) for n in stmt.body):
                return False
    return True


def _call_argument(call: ast.Call, name: str, params: Sequence[str]) -> Optional[ast.AST]:
    """The expression a call of a target with positional parameters ``params`` passes for ``name``."""
    for k in call.keywords:
        if k.arg == name:
            return k.value
    if name not in params or any(isinstance(a, ast.Starred) for a in call.args):
        return None
    index = list(params).index(name)
    return call.args[index] if index < len(call.args) else None


def _through(func: ast.AST) -> Optional[str]:
    """How a call on the way down reaches the layer below from ``self``: ``.attn`` for ``self.attn(...)`` and
    ``self.attn.m(...)``; None for anything else (a method of the same class is no hop: the caller tells)."""
    attr = _self_attribute(func)
    if attr is not None:
        return f".{attr}"
    if isinstance(func, ast.Attribute):
        inner = _self_attribute(func.value)
        if inner is not None:
            return f".{inner}"
    return None


def _is_argument(call: ast.Call, node: ast.AST) -> bool:
    return any(a is node for a in call.args) or any(k.value is node for k in call.keywords)


def _stray_read(f: _Function, name: str, call: ast.Call) -> Optional[int]:
    """The line of a read of ``name`` in ``f`` other than as an argument of ``call`` or in an ``is None`` test."""
    tested = set()
    for node in _walk_body(f.body):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)) \
                and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None:
            tested.add(id(node.left))
    for node in _walk_body(f.body):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load) \
                and id(node) not in tested and not _is_argument(call, node):
            return node.lineno
    return None


def _helper_caller(cls: ast.ClassDef, spec: EncoderMetadataHoist) -> Optional[str]:
    """The method of ``cls`` that calls one of the engine's helpers (``MMEncoderAttention.maybe_compute_seq_lens``)."""
    for method in cls.body:
        if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(method):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in spec.helpers and isinstance(node.func.value, ast.Name) \
                        and node.func.value.id == spec.helper_class:
                    return method.name
    return None


class _ClassFile:
    """The classes of one file by name, and the names it imports from the file being fixed (alias -> class name)."""

    def __init__(self, tree: ast.Module, classes: Sequence[ast.ClassDef], imported: dict) -> None:
        self.tree = tree
        self.classes = {c.name: c for c in classes}
        self.imported = imported
        self._held: dict[int, dict[str, list]] = {}

    def held(self, cls: ast.ClassDef, here: "_ClassFile") -> dict[str, list]:
        """``self.<attr> = ...`` of ``cls``: attr -> the classes (with their files) the value calls."""
        got = self._held.get(id(cls))
        if got is None:
            got = {}
            for node in ast.walk(cls):
                if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    attr = _self_attribute(target)
                    if attr is None:
                        continue
                    for call in ast.walk(node.value):
                        name = _called_name(call) if isinstance(call, ast.Call) else None
                        found = self.resolve(name, here) if name else None
                        if found is not None:
                            got.setdefault(attr, []).append(found)
            self._held[id(cls)] = got
        return got

    def resolve(self, name: str, here: "_ClassFile") -> Optional[tuple["_ClassFile", ast.ClassDef]]:
        if name in self.classes:
            return self, self.classes[name]
        original = self.imported.get(name)
        if original is not None and original in here.classes:
            return here, here.classes[original]
        return None


_REACHED = 256  # classes followed from a capture hook


def _capture_in(hook_file: _ClassFile, here: _ClassFile, owner: ast.ClassDef, hook: str) -> Optional[ast.ClassDef]:
    """The class of ``hook_file`` whose ``hook`` method reaches ``owner`` (a class of ``here``): it calls a module
    through ``self``'s attributes (``self.visual(...)``, ``self.vision_tower.vision_model.encoder(...)``, also
    through a local name bound to such a chain, and in the class's own methods it calls), and the owner is that
    module's class or a class it holds, at any depth."""
    for cls in hook_file.classes.values():
        chains = _hook_chains(cls, hook)
        if chains is None:
            continue
        start: list[tuple[_ClassFile, ast.ClassDef]] = []
        for chain in chains:
            current = [(hook_file, cls)]
            reached = 0
            for attr in chain:
                after = [found for f, c in current for found in f.held(c, here).get(attr, [])]
                if not after:
                    break
                current, reached = after, reached + 1
            if reached:  # at least one attribute reached a module (a method of the class itself is followed as code)
                start += current
        seen: set = set()
        queue = list(start)
        while queue and len(seen) < _REACHED:
            f, c = queue.pop()
            if id(c) in seen:
                continue
            seen.add(id(c))
            if c is owner:
                return cls
            queue += [found for held in f.held(c, here).values() for found in held]
    return None


def _hook_chains(cls: ast.ClassDef, hook: str) -> Optional[list[list[str]]]:
    """The attribute chains through ``self`` that ``cls.<hook>`` calls (``self.a.b(...)`` gives ["a", "b"]), and
    those of the methods of ``cls`` it calls (``self.m(...)``), a few levels down; None where ``cls`` has no
    ``hook``."""
    methods = {m.name: m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if hook not in methods:
        return None
    chains: list[list[str]] = []
    todo, seen = [(methods[hook], 0)], {hook}
    while todo:
        fn, depth = todo.pop()
        aliases: dict[str, list[str]] = {}
        for node in _walk_body(fn.body):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                chain = _self_chain(node.value, aliases)
                if chain:
                    aliases[node.targets[0].id] = chain
            elif isinstance(node, ast.Call):
                chain = _self_chain(node.func, aliases)
                if not chain:
                    continue
                if len(chain) == 1 and chain[0] in methods and chain[0] not in seen and depth < _MAX_DEPTH:
                    seen.add(chain[0])
                    todo.append((methods[chain[0]], depth + 1))
                chains.append(chain)
    return chains


def _self_chain(expr: ast.AST, aliases: dict) -> Optional[list[str]]:
    """``self.a.b`` -> ["a", "b"]; a local name bound to such a chain continues it."""
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        if expr.id == "self":
            return list(reversed(parts))
        if expr.id in aliases:
            return aliases[expr.id] + list(reversed(parts))
    return None


def _imported_from(tree: ast.Module, stem: str, package: str) -> dict:
    """What a module imports from the module ``stem`` beside it (``from .stem import A as B``, or an absolute
    ``from <...>.<package>.stem import A``): bound name -> the name there."""
    names: dict = {}
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        stmt = stack.pop()
        if isinstance(stmt, ast.ImportFrom) and stmt.module:
            parts = stmt.module.split(".")
            beside = (stmt.level == 1 and parts == [stem]) or \
                (stmt.level == 0 and len(parts) >= 2 and parts[-1] == stem and parts[-2] == package)
            if beside:
                names.update((a.asname or a.name, a.name) for a in stmt.names if a.name != "*")
        elif isinstance(stmt, ast.If):
            stack.extend(stmt.body + stmt.orelse)
        elif isinstance(stmt, ast.Try):
            stack.extend(stmt.body + stmt.orelse + stmt.finalbody + [s for h in stmt.handlers for s in h.body])
    return names


_NEIGHBOURS: dict = {}  # (path, words) -> (mtime, size, tree or None): files beside a fixed one that name them


def _neighbours(path: str, hook: str, stem: str) -> list[tuple[str, ast.Module]]:
    """The parsed modules in the directory of ``path`` (itself aside) whose text names ``hook`` and ``stem`` (the
    module of ``path``: a file that does not name it cannot import from it)."""
    here = os.path.abspath(path)
    folder = os.path.dirname(here)
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = []
    for name in names:
        other = os.path.join(folder, name)
        if not name.endswith(".py") or other == here:
            continue
        try:
            st = os.stat(other)
        except OSError:
            continue
        key = (other, hook, stem)
        got = _NEIGHBOURS.get(key)
        if got is None or got[:2] != (st.st_mtime_ns, st.st_size):
            tree = None
            try:
                with open(other, "rb") as f:
                    data = f.read()
                if hook.encode() in data and stem.encode() in data:
                    tree = ast.parse(data, filename=other)
            except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
                tree = None
            if len(_NEIGHBOURS) > 4096:
                _NEIGHBOURS.clear()
            got = _NEIGHBOURS[key] = (st.st_mtime_ns, st.st_size, tree)
        if got[2] is not None:
            found.append((other, got[2]))
    return found


_ENGINE_TREES: dict = {}  # path -> (mtime, size, tree or None): engine sources asked about, parsed once a process


def _engine_tree(path: str) -> Optional[ast.Module]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    got = _ENGINE_TREES.get(path)
    if got is None or got[:2] != (st.st_mtime_ns, st.st_size):
        try:
            with open(path, "rb") as f:
                tree: Optional[ast.Module] = ast.parse(f.read(), filename=path)
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
            tree = None
        if len(_ENGINE_TREES) > 256:
            _ENGINE_TREES.clear()
        got = _ENGINE_TREES[path] = (st.st_mtime_ns, st.st_size, tree)
    return got[2]


def _statements_in(body: list) -> Iterator[ast.stmt]:
    """Every statement in ``body``, nested blocks and definitions included (expressions are not entered)."""
    for stmt in body:
        yield stmt
        for name in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, name, None)
            if isinstance(inner, list):
                yield from _statements_in(inner)
        for handler in getattr(stmt, "handlers", ()):
            yield from _statements_in(handler.body)
        for case in getattr(stmt, "cases", ()):
            yield from _statements_in(case.body)


def function_parameters(path: str, name: str) -> Optional[tuple]:
    """The positional parameters of the top-level function ``name`` in the source at ``path`` (None: no such
    function; an empty tuple where it is bound otherwise, by an import or an assignment)."""
    tree = _engine_tree(path)
    if tree is None:
        return None
    fn = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name),
              None)
    if fn is not None:
        return tuple(p.arg for p in fn.args.posonlyargs + fn.args.args)
    return () if name in _module_names(tree) else None


def _module_names(tree: ast.Module) -> set:
    """Names bound at the top of a module (imports, definitions, assignments; also in its if/try blocks)."""
    names: set = set()
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        stmt = stack.pop()
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(stmt, ast.If):
            stack.extend(stmt.body + stmt.orelse)
        elif isinstance(stmt, ast.Try):
            stack.extend(stmt.body + stmt.orelse + stmt.finalbody + [s for h in stmt.handlers for s in h.body])
    return names


_ATTRIBUTES: dict = {}  # (path, class) -> (mtime, size, attributes): a tree's findings share one read of the engine


def instance_attributes(path: str, cls: str) -> Optional[frozenset]:
    """The attributes ``cls.__init__`` in the source at ``path`` sets on ``self`` (None: no such class or method)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    got = _ATTRIBUTES.get((path, cls))
    if got is not None and got[:2] == (st.st_mtime_ns, st.st_size):
        return got[2]
    if len(_ATTRIBUTES) > 64:
        _ATTRIBUTES.clear()
    found = _instance_attributes(path, cls)
    _ATTRIBUTES[(path, cls)] = (st.st_mtime_ns, st.st_size, found)
    return found


def _instance_attributes(path: str, cls: str) -> Optional[frozenset]:
    tree = _engine_tree(path)
    if tree is None:
        return None
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None) \
        if node is not None else None
    if init is None:
        return None
    return frozenset(a for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                     for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                     if (a := _self_attribute(t)) is not None)


def _called_name(call: ast.Call) -> Optional[str]:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute):
        return f.attr
    return None


def _iterated_attribute(node: ast.AST) -> Optional[str]:
    """``self.blocks``, ``self.blocks[a:b]``, ``enumerate(self.blocks)``, ``zip(self.blocks, ...)``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("enumerate", "zip") \
            and node.args:
        return _iterated_attribute(node.args[0])
    if isinstance(node, ast.Subscript):
        return _iterated_attribute(node.value)
    return _self_attribute(node)


def _loop_names(target: ast.AST) -> set:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _calls_instance(func: ast.AST, names: set, method: str) -> bool:
    if isinstance(func, ast.Name):
        return func.id in names and method == "forward"
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in names \
        and func.attr == method


def _walk_body(body: Sequence[ast.stmt]) -> Iterator[ast.AST]:
    """The nodes of a body, not of functions, classes or lambdas defined inside it."""
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        for child in reversed(list(ast.iter_child_nodes(node))):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.append(child)


def _params(f: _Function) -> list[str]:
    a = f.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    if a.vararg is not None:
        names.append(a.vararg.arg)
    if a.kwarg is not None:
        names.append(a.kwarg.arg)
    return names


def _has_param(f: _Function, name: str) -> bool:
    return name in _params(f)


def _assigned_in(node: ast.AST, name: str) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, (ast.Store, ast.Del)):
            return True
    return False


def _assigned(f: _Function, name: str) -> bool:
    return any(_assigned_in(stmt, name) for stmt in f.body)


def _name_taken(f: _Function, name: str) -> str:
    if not _has_param(f, name) and _assigned(f, name):
        return "already names a local value"
    return ""


def _argument_for(call: ast.Call, callee: _Function, name: str) -> Optional[ast.AST]:
    """The expression ``call`` binds to parameter ``name`` of ``callee`` (a method: ``self`` is bound)."""
    for k in call.keywords:
        if k.arg == name:
            return k.value
    positional = [p.arg for p in callee.args.posonlyargs + callee.args.args][1:]  # without self
    if name not in positional:
        return None
    index = positional.index(name)
    args = call.args
    if any(isinstance(a, ast.Starred) for a in args[: index + 1]):
        return None
    return args[index] if index < len(args) else None


def _reevaluable(expr: ast.AST) -> Optional[str]:
    """The text of a name or attribute chain (evaluating it again gives the same value), else None."""
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = _reevaluable(expr.value)
        return None if inner is None else f"{inner}.{expr.attr}"
    return None


def _root_name(expr: ast.AST) -> str:
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) else ""


def _segment(lines: Sequence[str], node: ast.AST) -> str:
    text = ast.get_source_segment("".join(lines), node) or "?"
    text = " ".join(text.split())
    return text if len(text) <= 40 else text[:37] + "..."


def _newline(line: str) -> str:
    for nl in ("\r\n", "\n", "\r"):
        if line.endswith(nl):
            return nl
    return "\n"


def _indent_step(indent: str, lines: Sequence[str]) -> str:
    """One level of indentation as the file writes it (tabs, or the smallest step of spaces seen)."""
    if "\t" in indent:
        return "\t"
    widths = sorted({len(m.group(0)) for line in lines if (m := re.match(r" +", line))})
    steps = [b - a for a, b in zip(widths, widths[1:]) if b > a]
    return " " * (min(steps + widths[:1]) if widths else 4)
