"""A read-only libcst traversal that runs several visitors in one pass, in source order.

Visitors define ``visit_<Node>`` / ``leave_<Node>`` as with libcst; children are visited in source
order (a test of the engine checks it against libcst's own visitor).
"""
# libcst's own ``visit`` rebuilds every node and visits every whitespace and punctuation token: for a
# read-only lint that is ~10x this walk (0.83 s against 0.09 s on 28 files of torch.nn.modules), as
# much as the parse itself.
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import libcst as cst

# Fields that hold only whitespace, comments or punctuation: never a name, a call or a statement.
_SKIP = frozenset({
    "asynchronous", "colon", "comma", "comment", "conversion", "default_indent", "default_newline",
    "dot", "empty_lines", "encoding", "end", "equal", "first_colon", "first_line", "footer",
    "has_trailing_newline", "header", "indent", "last_line", "lbrace", "lbracket", "leading_lines",
    "leading_whitespace", "lines_after_decorators", "lpar", "newline", "operator", "posonly_ind",
    "rbrace", "rbracket", "relative", "rpar", "second_colon", "semicolon", "separator", "star", "start",
    "trailing_comma", "trailing_whitespace",
})
# Node classes whose dataclass field order is not their source order.
_ORDER = {
    "Arg": ("keyword", "value"),
    "ClassDef": ("decorators", "name", "type_parameters", "bases", "keywords", "body"),
    "ExceptHandler": ("type", "name", "body"),
    "ExceptStarHandler": ("type", "name", "body"),
    "FunctionDef": ("decorators", "name", "type_parameters", "params", "returns", "body"),
    "IfExp": ("body", "test", "orelse"),
    "ImportFrom": ("module", "names"),
    "LazyImportFrom": ("module", "names"),
    "MatchCase": ("pattern", "guard", "body"),
    "Parameters": ("posonly_params", "params", "star_arg", "kwonly_params", "star_kwarg"),
    "Slice": ("lower", "upper", "step"),
    "TypeAlias": ("name", "type_parameters", "value"),
}


def child_fields(cls: type) -> tuple[str, ...]:
    """Names of ``cls``'s fields that can hold child nodes, in source order."""
    names = [f.name for f in dataclasses.fields(cls)
             if f.name not in _SKIP and not f.name.startswith("whitespace")]
    order = _ORDER.get(cls.__name__)
    if order:
        names = [n for n in order if n in names] + [n for n in names if n not in order]
    return tuple(names)


_CSTNode = cst.CSTNode
_FIELDS: dict[type, tuple[str, ...]] = {}


def children(node: cst.CSTNode) -> list:
    """``node.children`` without punctuation and whitespace, in source order; libcst's own property
    rebuilds the node through a visitor on every access (most of GL104's time on a large module)."""
    fields = _FIELDS.get(type(node))
    if fields is None:
        fields = _FIELDS[type(node)] = child_fields(type(node))
    out = []
    for name in fields:
        value = getattr(node, name)
        if isinstance(value, _CSTNode):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(item for item in value if isinstance(item, _CSTNode))
    return out
_Entry = tuple  # (enter callbacks, leave callbacks, child field names)


class Walker:
    """Runs ``visitors`` over a tree in one pre-order pass (recursive: callers catch RecursionError)."""

    def __init__(self, visitors: Sequence[object]):
        self._visitors = tuple(visitors)
        self._table: dict[type, _Entry] = {}

    def _entry(self, cls: type) -> _Entry:
        name = cls.__name__
        enters: list[Callable] = []
        leaves: list[Callable] = []
        for v in self._visitors:
            f = getattr(v, "visit_" + name, None)
            if f is not None:
                enters.append(f)
            f = getattr(v, "leave_" + name, None)
            if f is not None:
                leaves.append(f)
        entry = (tuple(enters), tuple(reversed(leaves)), child_fields(cls))
        self._table[cls] = entry
        return entry

    def walk(self, node: cst.CSTNode) -> None:
        enters, leaves, fields = self._table.get(type(node)) or self._entry(type(node))
        for f in enters:
            f(node)
        walk = self.walk
        for name in fields:
            value = getattr(node, name)
            if isinstance(value, _CSTNode):
                walk(value)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, _CSTNode):
                        walk(item)
        for f in leaves:
            f(node)
