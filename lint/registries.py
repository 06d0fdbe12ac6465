"""Per-layer code bound at run time through an attention registry (``catalog.ATTENTION_REGISTRIES``).

transformers' attention modules look their implementation up in ``ALL_ATTENTION_FUNCTIONS`` at every forward and
call it, so a function a file registers there (``ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = fn``, ``= partial(fn,
...)``, ``AttentionInterface.register("name", fn)``, with the registry imported from transformers, at any depth)
runs once per attention layer, and so does what it defines inside (a closure it builds and calls). GL104 takes
those defs for per-layer code: the textual pre-filter by ``may_register``, the tree pre-filter and the visitor by
``registered`` on CPython's tree.
"""
from __future__ import annotations

import ast
import re
from typing import Optional

from guardlint.contracts import catalog

_NAMES = frozenset(n for names in catalog.ATTENTION_REGISTRIES.values() for n in names)
_ALT = b"|".join(sorted(n.encode() for n in _NAMES))
# A registration as text (a superset of what ``registered`` finds).
_TEXT = re.compile(rb"(?:" + _ALT + rb")\s*(?:\[[^\]\n]*\]\s*=(?!=)|\.\s*register\s*\()")


def may_register(data: bytes) -> bool:
    return any(n.encode() in data for n in _NAMES) and _TEXT.search(data) is not None


def _function(expr: ast.AST) -> Optional[str]:
    """The def a registered value names: ``fn``, or the function of ``partial(fn, ...)``."""
    from .engine_defs import _dotted  # (here: patterns imports this module, and engine_defs imports patterns)

    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Call) and (_dotted(expr.func) or "").rsplit(".", 1)[-1] == "partial" and expr.args:
        return _function(expr.args[0])
    return None


def registered(tree: Optional[ast.AST]) -> dict:
    """Name of a def -> (registry, line of its registration), for the functions ``tree`` registers in an attention
    registry it imports from the package that defines it."""
    if tree is None:
        return {}
    from .engine_defs import _dotted

    local: set = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level:
            package = (node.module or "").split(".", 1)[0]
            local.update(a.asname or a.name for a in node.names
                         if a.name in catalog.ATTENTION_REGISTRIES.get(package, ()))

    def registry(expr: ast.AST) -> Optional[str]:
        name = _dotted(expr)
        if name is None:
            return None
        if name in local:
            return name
        first, _, last = name.partition(".")
        return name if last.rsplit(".", 1)[-1] in catalog.ATTENTION_REGISTRIES.get(first, ()) else None

    out: dict = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Subscript):
                    where = registry(target.value)
                    fn = _function(node.value) if where else None
                    if fn:
                        out.setdefault(fn, (where, node.lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register" \
                and len(node.args) >= 2:
            where = registry(node.func.value)
            fn = _function(node.args[1]) if where else None
            if fn:
                out.setdefault(fn, (where, node.lineno))
    return out
