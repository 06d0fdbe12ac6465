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
import re
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

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
        self.parent: dict[int, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[id(child)] = node
        self.classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        self._holders: dict[str, tuple[dict, dict]] = {}

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
        for holder in self.classes:
            for stmt in ast.walk(holder):
                if not isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                    continue
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                value = stmt.value
                if value is None or len(targets) != 1:
                    continue
                attr = _self_attribute(targets[0])
                if attr is None:
                    continue
                if isinstance(value, ast.Call) and _called_name(value) == cls.name:
                    single.setdefault(attr, set()).add(holder.name)
                elif any(isinstance(n, ast.Call) and _called_name(n) == cls.name for n in ast.walk(value)):
                    many.setdefault(attr, set()).add(holder.name)
        self._holders[cls.name] = (single, many)
        return single, many

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
    def plan(self, call: ast.Call, param: str, template: str, sources: dict[str, str]) -> Union[Hoisted, Refused]:
        """``param=<template>`` built once at the loop owner and passed down to ``call``. ``sources``: the
        template's placeholders and the names the target call passes for them (each must be a parameter
        of the call's function, passed down from the owner)."""
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
        owner_site = path[-1]
        owner_fn = owner_site.function
        owner_cls = self.enclosing(owner_site.call)[1]
        owner_label = f"{owner_cls.name}.{owner_fn.name}"  # type: ignore[union-attr]
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

        edits: list[Edit] = []
        # Parameters on the way down (every function below the owner) and the keyword at every call.
        below = [fn] + [s.function for s in path[:-1]]
        for f in below:
            problem = _name_taken(f, param)
            if problem:
                return Refused(f"{param} {problem} in {f.name}")
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
                    return Refused("is computed there, not passed down")
                if _assigned(f, current):
                    return Refused("is reassigned there")
                continue
            # ``c`` calls chain[i - 1]'s function: the argument it binds to ``current``.
            callee = chain[i - 1][0]
            expr = _argument_for(c, callee, current)
            if expr is None:
                return Refused(f"is not passed to {self._label(callee)} by {self._label(f)}")
            if last:
                text = _reevaluable(expr)
                if text is None:
                    return Refused(f"is passed to the layers as `{_segment(self.lines, expr)}`, which cannot be "
                                   f"evaluated once before the loop")
                root = _root_name(expr)
                if root in _loop_names(loop.target) or any(_assigned_in(stmt, root) for stmt in loop.body):
                    return Refused(f"changes inside the layer loop of {self._label(f)}")
                return text
            if not isinstance(expr, ast.Name) or not _has_param(f, expr.id) or _assigned(f, expr.id):
                return Refused(f"reaches {self._label(callee)} from {self._label(f)} as something other than its own "
                               f"parameter")
            current = expr.id
        return Refused("has no owner")

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
        if rest.lstrip(" \t").startswith(",") and not rest.lstrip(" \t")[1:].strip(" \t\r\n") \
                and line < len(self.lines):
            indent = text[: len(text) - len(text.lstrip(" \t"))]
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
