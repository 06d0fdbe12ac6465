"""Lint rules generated from the contract catalog: which qualified names to watch and what each needs.

Nothing here is specific to one contract: a new contract of kind call, positional or value is one
catalog (or config) entry and needs no lint code. Plain data, no libcst; pickled to worker processes.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Iterable, Optional

from guardlint.contracts import Contract, all_contracts

from .patterns import PATTERNS, PatternSpec

CALL_KINDS = ("call", "positional", "value")
# dataclasses.replace(obj, field=None, ...) rebuilds a dataclass target: contracts with
# satisfied_by_later_assignment (mutable batch-info records) are checked on it too.
REPLACE_FUNCTIONS = ("dataclasses.replace",)


@dataclass(frozen=True)
class RuleSet:
    """Contracts indexed by the qualified names whose calls they constrain."""

    contracts: tuple[Contract, ...]
    # Function targets (direct call) and class targets (construction).
    by_callee: dict[str, tuple[Contract, ...]] = field(default_factory=dict)
    # Instance targets: calls of instances and of their .forward.
    by_instance: dict[str, tuple[Contract, ...]] = field(default_factory=dict)
    replace_contracts: tuple[Contract, ...] = ()
    patterns: tuple[Contract, ...] = ()
    # Textual pre-filter: a file is parsed only if it contains one of ``needles`` (target names),
    # or what one of the pattern rules needs.
    needles: tuple[bytes, ...] = ()
    # Fields of ``replace_contracts``: a file needs one of them and the word ``replace`` (the callee's
    # own name or the name it is imported under) to hold such a call.
    field_needles: tuple[bytes, ...] = ()
    pattern_specs: tuple[PatternSpec, ...] = ()
    # Other names of a target (``guardlint.kernels.X`` for ``guardlint.kernels.<submodule>.X``) -> the
    # target's own qualname, which per-target data (derivations, params) is keyed by.
    canonical: dict[str, str] = field(default_factory=dict)

    @property
    def codes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.code for c in self.contracts))

    def contract(self, code: str) -> Optional[Contract]:
        for c in self.contracts:
            if c.code == code:
                return c
        return None

    def may_match(self, data: bytes) -> bool:
        """False when ``data`` cannot contain anything these rules report (checked before parsing)."""
        for n in self.needles:
            if n in data:
                return True
        if b"replace" in data and any(n in data for n in self.field_needles):
            return True
        return any(spec.may_match(data) for spec in self.pattern_specs)


KERNELS_PACKAGE = "guardlint.kernels"


@functools.lru_cache(maxsize=1)
def _kernel_exports() -> dict[str, str]:
    """``guardlint.kernels``' lazy re-exports (name -> submodule), read from its source: the linter
    does not execute the package it lints for (its submodules import torch)."""
    try:
        spec = importlib.util.find_spec(KERNELS_PACKAGE)
        if spec is None or spec.origin is None:
            return {}
        with open(spec.origin, "rb") as f:
            tree = ast.parse(f.read())
    except (ImportError, OSError, SyntaxError, ValueError):
        return {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets) and node.value is not None:
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    return {}
                return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}
    return {}


def aliases(qualname: str) -> tuple[str, ...]:
    """Other qualified names of the same object: ``guardlint.kernels.X`` is re-exported from
    ``guardlint.kernels.<submodule>.X`` (and the other way round); an engine's re-exports are listed
    in the catalog (``REEXPORTS``)."""
    from guardlint.contracts.catalog import REEXPORTS

    engine = tuple(alias for alias, target in REEXPORTS.items() if target == qualname)
    if engine:
        return engine
    prefix = KERNELS_PACKAGE + "."
    if not qualname.startswith(prefix):
        return ()
    rest = qualname[len(prefix):]
    exports = _kernel_exports()
    if "." in rest:
        sub, name = rest.rsplit(".", 1)
        return (prefix + name,) if exports.get(name) == sub else ()
    module = exports.get(rest)
    return (f"{prefix}{module}.{rest}",) if module else ()


def build_rules(extra: Iterable[Contract] = (), *, builtin: Optional[Iterable[Contract]] = None) -> RuleSet:
    """Rules for the built-in catalog plus ``extra`` (user contracts); runtime kinds are left out."""
    contracts = tuple(c for c in (*(all_contracts() if builtin is None else builtin), *extra) if c.linted)
    by_callee: dict[str, list[Contract]] = {}
    by_instance: dict[str, list[Contract]] = {}
    needles: dict[bytes, None] = {}
    field_needles: dict[bytes, None] = {}
    replace: list[Contract] = []
    patterns: list[Contract] = []
    specs = []
    canonical: dict[str, str] = {}
    for c in contracts:
        if c.kind in CALL_KINDS:
            for t in c.targets:
                index = by_instance if t.kind == "instance" else by_callee
                for name in (t.qualname, *aliases(t.qualname)):
                    if c not in index.setdefault(name, []):
                        index[name].append(c)
                    if name != t.qualname:
                        canonical.setdefault(name, t.qualname)
                needles[t.short_name.encode()] = None
            if c.satisfied_by_later_assignment and c.kind == "call":
                replace.append(c)
                # replace(x, f=None, ...) must name the fields; one name per group is enough to look for.
                for group in c.require:
                    field_needles[group[0].split(".")[0].encode()] = None
        elif c.kind == "pattern":
            spec = PATTERNS.get(c.code)
            if spec is None:
                raise ValueError(f"contract {c.code} has kind 'pattern' but no visitor is registered "
                                 f"in guardlint.lint.patterns.PATTERNS")
            patterns.append(c)
            specs.append(spec)
    return RuleSet(
        contracts=contracts,
        by_callee={k: tuple(v) for k, v in by_callee.items()},
        by_instance={k: tuple(v) for k, v in by_instance.items()},
        replace_contracts=tuple(replace),
        patterns=tuple(patterns),
        needles=tuple(needles),
        field_needles=tuple(n for n in field_needles if n not in needles),
        pattern_specs=tuple(specs),
        canonical=canonical,
    )
