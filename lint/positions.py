"""Where findings are: positions of calls and arguments from CPython's tree (matched to libcst's calls
in source order), or from libcst's PositionProvider when the trees do not line up. Lines are 1-based,
columns 1-based in characters, ends exclusive.
"""
from __future__ import annotations

import ast
import re
from array import array
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

import libcst as cst

from .names import dotted

if TYPE_CHECKING:
    from .checker import RawFinding

# Line breaks as CPython numbers lines (\r\n, \r and \n end a line; \f does not).
LINE_BREAK = re.compile(r"\r\n|\r|\n")
# (line, column, end_line, end_column, call_line, call_range) of a finding: the range of the argument it
# is about, else of the call; ``call_range`` is the call's (line, column, end_line, end_column),
# parentheses around it excluded.
Position = tuple[int, int, int, int, int, tuple[int, int, int, int]]


def _ast_dotted(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def positions_from_cst(module: cst.Module, raw: Sequence[RawFinding]) -> list[Position]:
    """The positions of ``raw``'s findings by libcst's PositionProvider (~2.5x the parse): for files
    whose CPython tree is missing or does not line up with libcst's."""
    from libcst.metadata import MetadataWrapper, PositionProvider

    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    out = []
    for r in raw:
        call = positions[r.node]
        p = call if r.arg is None else positions[r.node.args[r.arg]]
        out.append((p.start.line, p.start.column + 1, p.end.line, p.end.column + 1, call.start.line,
                    (call.start.line, call.start.column + 1, call.end.line, call.end.column + 1)))
    return out


def positions_from_ast(module: cst.Module, tree: ast.AST, calls: Sequence[cst.Call], raw: Sequence[RawFinding],
                       data: bytes) -> Optional[list[Position]]:
    """The positions of ``raw``'s findings from CPython's tree (``calls``: libcst's calls in source
    order); None when the two trees' calls do not line up or a finding is not on a call."""
    # Pre-order of a tree whose children are in source order is the order of start positions,
    # an enclosing call before the calls it starts with (``f(x)(y)``): sort CPython's calls so.
    acalls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    if len(acalls) != len(calls):
        return None
    acalls.sort(key=lambda n: (n.lineno, n.col_offset, -n.end_lineno, -n.end_col_offset))
    index = {id(n): i for i, n in enumerate(calls)}
    lines = LINE_BREAK.split(data.decode(module.encoding))
    out = []
    for r in raw:
        if id(r.node) not in index:  # not a call (GL104's ``if seq_lens:``): libcst's positions
            return None
        a = acalls[index[id(r.node)]]
        if _ast_dotted(a.func) != dotted(r.node.func):
            return None
        p = a
        if r.arg is not None:
            # CPython keeps positional and keyword arguments apart; in source order they are libcst's.
            args = sorted([*a.args, *a.keywords], key=lambda n: (n.lineno, n.col_offset))
            if len(args) != len(r.node.args):
                return None
            p = args[r.arg]
        out.append((p.lineno, column(lines, p.lineno, p.col_offset),
                    p.end_lineno, column(lines, p.end_lineno, p.end_col_offset), a.lineno,
                    (a.lineno, column(lines, a.lineno, a.col_offset),
                     a.end_lineno, column(lines, a.end_lineno, a.end_col_offset))))
    return out


# A call of CPython's tree as ``positions_from_spans`` needs it, so that the tree need not be kept: its
# dotted callee (or None) and, in an array (a 5 MB module has 28k calls), its (line, col_offset,
# end_line, end_col_offset) then those of its arguments in source order.
CallSpan = tuple[Optional[str], array]


def call_spans(roots: Sequence[ast.AST]) -> list[CallSpan]:
    """The calls under ``roots`` (consecutive top-level statements), in ``positions_from_ast``'s order."""
    acalls = []
    stack = list(roots)
    call, AST = ast.Call, ast.AST
    while stack:  # ast.walk's nodes, in another order (the sort gives them theirs)
        node = stack.pop()
        if type(node) is call:
            acalls.append(node)
        for name in node._fields:
            value = getattr(node, name, None)
            if type(value) is list:
                stack.extend([v for v in value if isinstance(v, AST)])
            elif isinstance(value, AST):
                stack.append(value)
    acalls.sort(key=lambda n: (n.lineno, n.col_offset, -n.end_lineno, -n.end_col_offset))
    names: dict = {}
    out = []
    for a in acalls:
        numbers: list = [a.lineno, a.col_offset, a.end_lineno, a.end_col_offset]
        for n in sorted([*a.args, *a.keywords], key=lambda n: (n.lineno, n.col_offset)):
            numbers += (n.lineno, n.col_offset, n.end_lineno, n.end_col_offset)
        name = _ast_dotted(a.func)
        out.append((names.setdefault(name, name), array("q", numbers)))
    return out


class Lines(Protocol):
    """A file's lines by index (a list, or lines cut from the text when asked for)."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> str: ...


def positions_from_spans(spans: Sequence[CallSpan], calls: Sequence[cst.Call], raw: Sequence[RawFinding],
                         lines: Lines) -> Optional[list[Position]]:
    """``positions_from_ast`` from ``call_spans`` of the statements that hold ``calls`` (``lines``: the
    file's lines, decoded)."""
    if len(spans) != len(calls):
        return None
    index = {id(n): i for i, n in enumerate(calls)}
    out = []
    for r in raw:
        i = index.get(id(r.node))
        if i is None:
            return None
        name, numbers = spans[i]
        if name != dotted(r.node.func):
            return None
        a = numbers[:4]
        p = a
        if r.arg is not None:
            if (len(numbers) - 4) // 4 != len(r.node.args):
                return None
            p = numbers[4 + 4 * r.arg: 8 + 4 * r.arg]
        out.append((p[0], column(lines, p[0], p[1]), p[2], column(lines, p[2], p[3]), a[0],
                    (a[0], column(lines, a[0], a[1]), a[2], column(lines, a[2], a[3]))))
    return out


def column(lines: list[str], lineno: int, byte_offset: int) -> int:
    """CPython counts columns in UTF-8 bytes; findings count characters."""
    line = lines[lineno - 1] if 0 < lineno <= len(lines) else ""
    if line.isascii():
        return byte_offset + 1
    return len(line.encode("utf-8")[:byte_offset].decode("utf-8", errors="ignore")) + 1
