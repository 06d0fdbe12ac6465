"""Second-stage pre-filter: CPython's ``ast`` tree of a file decides whether libcst must see it.

The textual pre-filter (``RuleSet.may_match``) passes files that merely mention a trigger word; this
one looks at the tree every file gets anyway and sends a file to the libcst check only when it holds
something a rule could report. It may over-approximate (send a file that ends up clean), never drop
one with findings (``tests/test_lint_prefilter.py`` runs the engine with and without it).
"""
# What each rule needs to report, and what is looked for here:
# - call/positional/value contracts: a callee that resolves to a target. The resolver only follows
#   names, attributes, imports (with aliases) and instances made by a target's constructor, so the
#   target's short name is a Name, an Attribute, or part of an import somewhere in the file.
# - dataclasses.replace(..., max_len=None, ...): a keyword named like a field of such a contract
#   (the callee is not looked at, so an aliased replace is covered).
# - GL104: .item()/.tolist() without arguments, or int(...) of one argument, whose expression reads a
#   sequence-length name, under a per-layer forward or a loop over layers (host_sync's contexts).
# A guard decorator only removes findings, so a file without any of the above has none either way.
from __future__ import annotations

import ast
from dataclasses import dataclass

from .patterns import LAYER_LOOP_NAME, PATTERNS, PER_LAYER_CLASS_SUFFIXES, SYNC_METHODS, is_seqlen_name
from .rules import RuleSet

HOST_SYNC = "GL104"


@dataclass(frozen=True)
class TreeFilter:
    """``names``: short names of targets; ``fields``: keywords of ``replace`` calls that can empty a
    contract; ``host_sync``: GL104 is selected; ``opaque``: a pattern rule this filter does not know
    (its files always go to libcst)."""

    names: frozenset
    fields: frozenset
    host_sync: bool
    opaque: bool

    @classmethod
    def from_rules(cls, rules: RuleSet) -> "TreeFilter":
        names = {q.rsplit(".", 1)[-1].removesuffix("[]") for q in (*rules.by_callee, *rules.by_instance)}
        fields = {n.split(".", 1)[0] for c in rules.replace_contracts for g in c.require for n in g}
        codes = {c.code for c in rules.patterns}
        return cls(frozenset(names), frozenset(fields), HOST_SYNC in codes, bool(codes - {HOST_SYNC}))

    def may_report(self, tree: ast.AST, data: bytes) -> bool:
        """False only when no rule can report anything in the file whose tree is ``tree``."""
        if self.opaque:
            return True
        # Only what the bytes mention can be in the tree: most files need one kind of check at most.
        names = {n for n in self.names if n.encode() in data}
        fields = {n for n in self.fields if n.encode() in data}
        host_sync = self.host_sync and any(n in data for n in PATTERNS[HOST_SYNC].needles)
        if not (names or fields or host_sync):
            return False
        suspects = []
        for node in ast.walk(tree):
            t = type(node)
            if t is ast.Name:
                if node.id in names:
                    return True
            elif t is ast.Attribute:
                if node.attr in names:
                    return True
            elif t is ast.keyword:
                if node.arg in fields:
                    return True
            elif t is ast.Call:
                if host_sync and _host_read(node):
                    suspects.append(node)
            elif t is ast.Import or t is ast.ImportFrom:
                if names and _imports_name(node, names):
                    return True
        if suspects:
            # A module-level helper that reads the host makes its callers suspects too (host_sync).
            found = {id(n) for n in suspects}
            helpers = {d.name for d in getattr(tree, "body", ()) if type(d) is ast.FunctionDef
                       and any(id(n) in found for n in ast.walk(d))}
            if helpers:
                suspects.extend(n for n in ast.walk(tree) if type(n) is ast.Call
                                and type(n.func) is ast.Name and n.func.id in helpers)
        return bool(suspects) and _any_inside_context(tree, suspects)


def _imports_name(node, names: set) -> bool:
    parts = set(node.module.split(".")) if getattr(node, "module", None) else set()
    for alias in node.names:
        parts.update(alias.name.split("."))
    return not parts.isdisjoint(names)


def _reads_seqlen(expr: ast.AST) -> bool:
    for node in ast.walk(expr):
        t = type(node)
        if t is ast.Name:
            name = node.id
        elif t is ast.Attribute:
            name = node.attr
        elif t is ast.keyword:
            name = node.arg
        else:
            continue
        if name and is_seqlen_name(name):
            return True
    return False


def _host_read(call: ast.Call) -> bool:
    """Could GL104's visitor report this call (context aside)?"""
    func = call.func
    if type(func) is ast.Attribute:
        if func.attr in ("any", "all") and not call.args and not call.keywords:
            return True  # ``if (a > b).any():`` (host_sync looks at the if)
        return func.attr in SYNC_METHODS and not call.args and not call.keywords \
            and _reads_seqlen(func.value)
    if type(func) is ast.Name and func.id == "int" and len(call.args) + len(call.keywords) == 1:
        return _reads_seqlen(call)
    return False


def _any_inside_context(tree: ast.AST, calls: list) -> bool:
    """Is one of ``calls`` in code that runs per layer, as ``host_sync`` decides it: under the
    ``forward`` of a class named like a block, layer or attention, or a loop over layers/blocks."""
    wanted = {id(c) for c in calls}
    stack: list = [(tree, None)]  # (node, the class whose body it is directly in)
    while stack:
        node, owner = stack.pop()
        t = type(node)
        if t is ast.ClassDef:
            inner = node.name
        elif t is ast.FunctionDef or t is ast.AsyncFunctionDef:
            if node.name == "forward" and owner and owner.lower().endswith(PER_LAYER_CLASS_SUFFIXES) \
                    and any(id(n) in wanted for n in ast.walk(node)):
                return True
            inner = None
        elif (t is ast.For or t is ast.AsyncFor) and _loops_over_layers(node.iter):
            if any(id(n) in wanted for n in ast.walk(node)):
                return True
            inner = owner
        else:
            inner = owner
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))
    return False


def _loops_over_layers(iterable: ast.AST) -> bool:
    for node in ast.walk(iterable):
        t = type(node)
        name = node.id if t is ast.Name else node.attr if t is ast.Attribute else \
            node.arg if t is ast.keyword else None
        if name and LAYER_LOOP_NAME.search(name):
            return True
    return False


_FILTERS: dict = {}


def tree_filter(rules: RuleSet) -> TreeFilter:
    """The filter of ``rules``, built once per rule set (one per worker process)."""
    cached = _FILTERS.get(id(rules))
    if cached is None or cached[0] is not rules:
        cached = (rules, TreeFilter.from_rules(rules))
        _FILTERS.clear()
        _FILTERS[id(rules)] = cached
    return cached[1]
