"""The contract model: what a kernel needs, how to derive it, and what to tell a user who forgot it.

Plain Python (no torch, no libcst): the runtime guard, the linter and ``guardlint explain`` all read it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional, Tuple

Severity = Literal["error", "warning"]
# How a contract is enforced:
#   "call"       a callable needs any-of groups of arguments (linter + guard)
#   "positional" a callable must not get positional arguments (linter)
#   "value"      a keyword must not be a given literal (linter) / value (guard)
#   "pattern"    a code pattern, found by a dedicated lint visitor
#   "runtime"    raised by the guard or kernels only; the linter never reports it
#   "file"       a file-level problem found by the linter itself
Kind = Literal["call", "positional", "value", "pattern", "runtime", "file"]
FixSafety = Literal["safe", "unsafe", "none"]

EXPECT_MARKER = re.compile(r"\s*# expect: (?P<codes>GL\d{3}(?:\s*,\s*GL\d{3})*)\s*$")


@dataclass(frozen=True)
class Derivation:
    """``target`` can be computed from ``sources``.

    ``name`` selects the runtime implementation in ``guardlint.guard``; ``template`` is the Python
    expression the linter's fix writes, with ``{source}`` placeholders filled by the call's own argument
    expressions; ``imports`` are ``(module, name)`` pairs the template needs. ``host_read`` says whether
    computing it on device tensors costs a device-to-host copy (a sync).
    """

    target: str
    sources: Tuple[str, ...]
    name: str
    template: str
    imports: Tuple[Tuple[str, str], ...] = ()
    host_read: bool = False
    note: str = ""
    # Qualified names of the targets this derivation is written for (empty: all of the contract's):
    # a call of an engine's class is fixed with the engine's own helper, ours with ours.
    for_targets: Tuple[str, ...] = ()
    # The runtime caches the result per tensor version: layers sharing one input cost one host read, so
    # the fix may go into a per-layer forward.
    cached: bool = False

    def applies_to(self, qualname: Optional[str]) -> bool:
        return not self.for_targets or qualname is None or qualname in self.for_targets


@dataclass(frozen=True)
class Example:
    """A snippet that shows the contract. In ``bad`` snippets, the offending line ends with
    ``# expect: GLxxx[, GLyyy]``; ``fixed`` is ``bad`` after ``guardlint --fix --unsafe-fixes`` (markers
    removed). ``runnable`` snippets only need torch and guardlint and are also executed under the guard."""

    kind: Literal["bad", "good", "fixed"]
    code: str
    runnable: bool = False

    def expected(self) -> list[tuple[int, str]]:
        """(1-based line, code) pairs the linter must report for this snippet."""
        found = []
        for lineno, line in enumerate(self.code.splitlines(), start=1):
            m = EXPECT_MARKER.search(line)
            if m:
                for code in m.group("codes").split(","):
                    found.append((lineno, code.strip()))
        return found

    def without_markers(self) -> str:
        lines = self.code.splitlines(keepends=True)
        out = []
        for line in lines:
            m = EXPECT_MARKER.search(line.rstrip("\r\n"))
            if m:
                nl = line[len(line.rstrip("\r\n")):]
                line = line.rstrip("\r\n")[: m.start()] + nl
            out.append(line)
        return "".join(out)


@dataclass(frozen=True)
class Diagnosis:
    """The text a user sees. Section names follow the engine's error pages; ``guardlint explain`` maps
    them onto ruff's (What it does / Why is this bad? / Example / Use instead / Fix safety)."""

    message: str
    what_it_means: str
    when_it_happens: str
    solutions: Tuple[str, ...]
    fix_safety: str = ""
    # A few words that head a finding's line where its facts alone (the call, what it lacks) do not say
    # what is wrong (GL104: "host sync per layer"); the long text stays on the rule's page.
    headline: str = ""
    # Regular expressions that recognise this problem in an error message or traceback
    # (``guardlint diagnose``). Errors raised by guardlint itself are recognised by their code.
    patterns: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Target:
    """A callable a contract applies to.

    ``qualname`` is the fully qualified import name. ``kind``: ``function`` (called directly),
    ``class`` (constructed), ``instance`` (a class whose *instances* are called, directly or through
    ``.forward``; the contract's parameters are then the instance call's). A qualname ending in ``[]``
    names a dict of classes: instances made by ``DICT[key](...)`` with a key that is not a constant
    (a backend picked by configuration) are candidates of every class in it.

    ``params`` replaces the contract's parameter order for this target (engines differ); with
    ``when_passed``, the contract applies only to calls that pass each of these names and not None.
    ``message`` replaces the diagnosis message for this target's calls where its engine fails in other
    words than the contract's seed error."""

    qualname: str
    kind: Literal["function", "class", "instance"] = "function"
    params: Tuple[str, ...] = ()
    when_passed: Tuple[str, ...] = ()
    message: str = ""

    @property
    def short_name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1].removesuffix("[]")

    @property
    def module(self) -> str:
        return self.qualname.rsplit(".", 1)[0] if "." in self.qualname else ""


@dataclass(frozen=True)
class Contract:
    code: str
    name: str
    summary: str
    kind: Kind
    diagnosis: Diagnosis
    severity: Severity = "error"
    targets: Tuple[Target, ...] = ()
    # Parameter order for binding positional arguments; names not listed are keyword-only.
    params: Tuple[str, ...] = ()
    # Any-of groups: the contract is met when, for some group, every name in it is passed and not None.
    require: Tuple[Tuple[str, ...], ...] = ()
    derivations: Tuple[Derivation, ...] = ()
    # kind == "value": keyword -> literal source text that is forbidden (e.g. {"max_len": "0"}).
    forbidden_values: Tuple[Tuple[str, str], ...] = ()
    fix_safety: FixSafety = "none"
    examples: Tuple[Example, ...] = ()
    # Filled for contracts declared in a user's [tool.guardlint] configuration.
    user_defined: bool = False
    # GL201: a later ``var.<field> = <not None>`` in the same function satisfies the contract; GL203: a
    # store of the field on the record (``self.buf.max_len = ...`` or through a local alias, in any method
    # of the class that keeps it) before the record is used.
    satisfied_by_later_assignment: bool = False
    # kind == "call": the fix writes every one of these (in order) that is missing, not only one group
    # (GL201: the engines' Triton kernels need max_len even when seg_lens is given).
    fix_writes: Tuple[str, ...] = ()
    # kind == "call": the names a finding's line says are missing (empty: every name of ``require``); the
    # other groups are alternatives that the rule's page lists (GL101's line names sequence_lengths, its
    # page forward_metadata too), so that a line stays short enough to read.
    subject: Tuple[str, ...] = ()
    # Extra notes for the linter (e.g. dataclasses.replace handling); free text shown by explain.
    notes: Tuple[str, ...] = field(default=())

    # -- helpers shared by both enforcers -------------------------------------------------------------
    @property
    def linted(self) -> bool:
        return self.kind in ("call", "positional", "value", "pattern", "file")

    def missing_groups(self, present: set[str]) -> Optional[Tuple[str, ...]]:
        """None when some any-of group is fully present; else the names of the smallest group's gaps."""
        if not self.require:
            return None
        best: Optional[Tuple[str, ...]] = None
        for group in self.require:
            gaps = tuple(n for n in group if n not in present)
            if not gaps:
                return None
            if best is None or len(gaps) < len(best):
                best = gaps
        return best

    def params_for(self, qualname: str) -> Tuple[str, ...]:
        for t in self.targets:
            if t.params and qualname in (t.qualname, t.qualname.removesuffix("[]")):
                return t.params
        return self.params

    def target(self, qualname: str) -> Optional[Target]:
        for t in self.targets:
            if qualname == t.qualname:
                return t
        return None

    def requirement_text(self) -> str:
        return " or ".join("+".join(g) for g in self.require)

    def derivation_for(self, target: str) -> Optional[Derivation]:
        for d in self.derivations:
            if d.target == target:
                return d
        return None

    def derivation(self, target: str) -> Derivation:
        """``derivation_for`` where the catalog defines one (the guard's own lookups): KeyError otherwise."""
        d = self.derivation_for(target)
        if d is None:
            raise KeyError(f"{self.code} has no derivation of {target}")
        return d

    def examples_of(self, kind: str) -> Tuple[Example, ...]:
        return tuple(e for e in self.examples if e.kind == kind)

    def matches_error(self, text: str) -> bool:
        if re.search(rf"\b{self.code}\b", text):
            return True
        return any(re.search(p, text) for p in self.diagnosis.patterns)
