"""GL104 per-layer-host-sync: a device-to-host read of sequence-length metadata in code run per layer.

Per layer means the ``forward`` of a class named ``*Block``, ``*Layer`` or ``*Attention`` (any case),
or the body of a ``for`` loop over something named like layers or blocks. The vocabulary (which names
hold metadata, which calls read back) lives in ``patterns.py`` beside the pre-filter's needles.
"""
from __future__ import annotations

from typing import Callable, Optional

import libcst as cst

from guardlint.contracts import Contract

from .names import dotted
from .patterns import LAYER_LOOP_NAME, PER_LAYER_CLASS_SUFFIXES, SYNC_METHODS, is_seqlen_name


def _names_in(expr: cst.CSTNode):
    """Names and attribute names read in an expression (small subtrees only)."""
    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Name):
            yield node.value
        elif isinstance(node, cst.Attribute):
            yield node.attr.value
            stack.append(node.value)
        elif isinstance(node, (cst.Subscript, cst.Call, cst.BinaryOperation, cst.UnaryOperation)):
            stack.extend(node.children)
        elif isinstance(node, (cst.SubscriptElement, cst.Index, cst.Slice, cst.Arg)):
            stack.extend(node.children)


def _metadata_name(expr: cst.CSTNode) -> Optional[str]:
    for name in _names_in(expr):
        if is_seqlen_name(name):
            return name
    return None


def _layer_loop(iterable: cst.BaseExpression) -> Optional[str]:
    for name in _names_in(iterable):
        if LAYER_LOOP_NAME.search(name):
            return dotted(iterable) or name
    return None


class PerLayerHostSync:
    def __init__(self, contract: Contract, report: Callable[[cst.Call, str], None]):
        self.contract = contract
        self.report = report
        self._classes: list[Optional[str]] = []  # enclosing class names; None for a def in between
        self._contexts: list[Optional[str]] = []  # why the code here runs per layer
        self._inside_report = 0  # depth of calls nested in an already reported one

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.append(node.name.value)

    def leave_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        owner = self._classes[-1] if self._classes else None
        context = None
        if node.name.value == "forward" and owner and owner.lower().endswith(PER_LAYER_CLASS_SUFFIXES):
            context = f"{owner}.forward, which runs once per layer"
        self._contexts.append(context)
        self._classes.append(None)

    def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._contexts.pop()
        self._classes.pop()

    def visit_For(self, node: cst.For) -> None:
        loop = _layer_loop(node.iter)
        self._contexts.append(f"a loop over {loop}" if loop else None)

    def leave_For(self, node: cst.For) -> None:
        self._contexts.pop()

    def visit_Call(self, node: cst.Call) -> None:
        if self._inside_report:
            self._inside_report += 1
            return
        context = next((c for c in reversed(self._contexts) if c), None)
        if context is None:
            return
        what = self._host_read(node)
        if what is not None:
            self.report(node, f"{self.contract.diagnosis.message}: {what} inside {context}")
            self._inside_report = 1

    def leave_Call(self, node: cst.Call) -> None:
        if self._inside_report:
            self._inside_report -= 1

    @staticmethod
    def _host_read(node: cst.Call) -> Optional[str]:
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value in SYNC_METHODS and not node.args:
            name = _metadata_name(func.value)
            if name:
                return f".{func.attr.value}() on {name}"
        if isinstance(func, cst.Name) and func.value == "int" and len(node.args) == 1:
            inner = node.args[0].value
            if isinstance(inner, cst.Call):
                f = inner.func
                is_max = (isinstance(f, cst.Attribute) and f.attr.value == "max")
                if is_max:
                    name = _metadata_name(inner)
                    if name:
                        return f"int(....max()) on {name}"
        return None
