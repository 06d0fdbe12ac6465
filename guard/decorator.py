"""``guard(contract, **rename)``: enforce catalog (or user) contracts on any function at call time.

The binding (where each contract argument sits in the function's signature) is computed once, at
decoration. A call that meets its contracts costs a few ``is None`` tests; one that does not gets the
missing values derived (named derivations, cached) or a coded ``GuardError`` naming the argument.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any, Callable, Iterable, Optional, ParamSpec, Sequence, TypeVar, Union

from guardlint.contracts import Contract, Derivation, get as get_contract

from . import _cache, _state
from ._codegen import accesses, make_wrapper
from .derive import Context, deriver
from .errors import GuardError, describe
from .validate import check_lora, check_varlen, prefetch

# For type checkers: a guarded function keeps its signature.
_P = ParamSpec("_P")
_R = TypeVar("_R")

class Param:
    """Where one contract argument goes in the guarded function's signature."""

    __slots__ = ("name", "param", "accepted")

    def __init__(self, name: str, param: str, accepted: bool) -> None:
        self.name = name          # the contract's name for it
        self.param = param        # the function's parameter name
        self.accepted = accepted  # can the function receive it (named parameter or **kwargs)?


def qualified_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def bind(fn: Callable, names: Iterable[str], rename: dict, *, function: Optional[str] = None,
         must_accept: Iterable[str] = ()) -> dict[str, Param]:
    """Locate ``names`` (after ``rename``) in ``fn``'s signature, once. Raises GuardError GL001 when a
    rename points nowhere or a name in ``must_accept`` cannot be passed to ``fn``."""
    function = function or qualified_name(fn)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise GuardError("GL002", argument="fn", function=function, expected="a function with a signature",
                         got=f"{type(fn).__name__} ({exc})") from None
    var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    names = list(dict.fromkeys(names))
    for key, target in rename.items():
        if key not in names:
            raise GuardError("GL002", argument=key, function=function,
                             expected=f"one of the contract's arguments ({', '.join(names)})",
                             got=f"rename {key}={target!r}",
                             fix="rename maps the contract's argument names to the function's parameter names")
        if not isinstance(target, str) or (target not in sig.parameters and not var_kw):
            raise GuardError("GL002", argument=key, function=function,
                             expected=f"a parameter of {function}{sig}", got=f"rename {key}={target!r}",
                             fix="name an existing parameter, or give the function **kwargs")
    out = {}
    for name in names:
        param = rename.get(name, name)
        p = sig.parameters.get(param)
        if p is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            out[name] = Param(name, param, var_kw)
        else:
            out[name] = Param(name, param, True)
    for name in must_accept:
        if not out[name].accepted:
            raise GuardError("GL002", argument=name, function=function,
                             expected=f"a parameter {rename.get(name, name)!r} (or **kwargs) to receive it",
                             got=f"signature {function}{sig}",
                             fix=f"add `{rename.get(name, name)}=None` to the signature, give it **kwargs, or "
                                 f"map the name with guard(..., {name}='<your parameter>')")
    return out


def _resolve(contract: Union[str, Contract, Sequence[Union[str, Contract]]]) -> tuple:
    if isinstance(contract, (str, Contract)):
        items = [contract]
    else:
        try:
            items = list(contract)
        except TypeError:
            raise GuardError("GL002", argument="contract", expected="a rule code, a Contract or a list of them",
                             got=describe(contract), fix='Decorate with @guard("GL101") or @guard(["GL101", '
                             '"GL102"]), or with a Contract object.') from None
    if not items:
        raise GuardError("GL002", argument="contract", expected="a rule code, a Contract or a list of them",
                         got="an empty list")
    out = []
    for item in items:
        if isinstance(item, str):
            try:
                item = get_contract(item)
            except KeyError as exc:
                raise GuardError("GL002", argument="contract", expected="a known rule code",
                                 got=repr(item), fix=str(exc.args[0])) from None
        if not isinstance(item, Contract):
            raise GuardError("GL002", argument="contract", expected="a rule code or a Contract",
                             got=describe(item))
        if not item.require:
            raise GuardError("GL002", argument="contract", expected="a contract with required arguments "
                             "(kind 'call')", got=f"{item.code} ({item.kind})")
        out.append(item)
    return tuple(out)


# Strict-mode value checks, by contract code: what the catalog's runtime contracts (GL103, GL204)
# say about values that are present.
def _check_vision(function: str, values: dict) -> None:
    check_varlen(function, q=values.get("q"), cu_seqlens=values.get("cu_seqlens"),
                 sequence_lengths=values.get("sequence_lengths"), max_seqlen=values.get("max_seqlen"),
                 metadata=values.get("forward_metadata"), layout="cudnn")


def _check_lora_fields(function: str, values: dict) -> None:
    check_lora(function, seg_indptr=values.get("seg_indptr"), num_segments=values.get("num_segments"),
               weight_indices=values.get("weight_indices"), seg_lens=values.get("seg_lens"),
               max_len=values.get("max_len"), prefix="")


VALIDATORS = {"GL101": _check_vision, "GL102": _check_vision, "GL201": _check_lora_fields}
VALIDATED = {
    "GL101": ("q", "cu_seqlens", "sequence_lengths", "max_seqlen", "forward_metadata"),
    "GL102": ("q", "cu_seqlens", "sequence_lengths", "max_seqlen", "forward_metadata"),
    "GL201": ("seg_indptr", "num_segments", "weight_indices", "seg_lens", "max_len"),
}


class _Guard:
    """The per-function state behind one ``guard(...)`` wrapper."""

    def __init__(self, fn: Callable, contracts: tuple, rename: dict) -> None:
        self.fn = fn
        self.function = qualified_name(fn)
        self.contracts = contracts
        # Only what the contracts, their derivations and their value checks read travels to the hook.
        names: list = []
        for c in contracts:
            names += [n for g in c.require for n in g]
            for d in c.derivations:
                names += [d.target, *d.sources]
            names += VALIDATED.get(c.code, ())
        self.params = bind(fn, names, rename, function=self.function)
        self.names = tuple(self.params)
        sig = inspect.signature(fn).parameters
        self.named = {n for n, p in self.params.items() if p.param in sig}
        self.derivations: dict[str, tuple[Derivation, Callable, Context]] = {}
        for c in contracts:
            for d in c.derivations:
                impl = deriver(d)
                if impl is not None and d.target not in self.derivations:
                    self.derivations[d.target] = (d, impl, Context(self.function, c.code, params={
                        n: p.param for n, p in self.params.items()}))
        # Groups the function can receive; a contract with none of them cannot be enforced here.
        self.groups = []
        for c in contracts:
            usable = tuple(g for g in c.require if all(self.params[n].accepted for n in g))
            if not usable:
                wanted = " or ".join("+".join(g) for g in c.require)
                raise GuardError("GL002", argument=c.require[0][0], function=self.function,
                                 expected=f"parameters (or **kwargs) for {wanted} ({c.code})",
                                 got=f"signature {self.function}{inspect.signature(fn)}",
                                 fix="add the parameters with default None, give the function **kwargs, "
                                     "or map names with guard(..., name='parameter')")
            self.groups.append(usable)
        self.validators = tuple(dict.fromkeys(VALIDATORS[c.code] for c in contracts if c.code in VALIDATORS))
        self.plans: dict = {}  # which names are present -> what to derive (or which contract fails)

    def fast_expression(self) -> str:
        """True when every contract has a group whose arguments are all passed and not None."""
        return " and ".join(
            "(" + " or ".join("(" + " and ".join(f"{{{n}}} is not None" for n in g) + ")" for g in groups) + ")"
            for groups in self.groups)

    def make_hook(self) -> Callable:
        """The slow path, as a closure over this guard's state (no attribute lookups per call)."""
        plans, names, validators, function = self.plans, self.names, self.validators, self.function
        counters, note_cached, note_derived, STRICT = _state.counters, _state.note_cached, _state.note_derived, \
            _state.STRICT

        def hook(mode: int, present: tuple, *args: Any) -> Sequence:
            """``present``: which of ``names`` were passed and not None (computed by the wrapper)."""
            if not _cache.enabled:
                _cache.new_call()
            vals: Sequence[Any] = args
            plan = plans.get(present)
            if plan is None:
                plan = plans[present] = self._steps(self._plan(frozenset(n for n, p in zip(names, present) if p)))
            if type(plan) is int:
                raise self._unmet_error(plan, dict(zip(names, vals)))
            if plan:
                vals = filled = list(vals)
                if mode == STRICT:
                    prefetch(*vals)
                for index, d, impl, ctx, pick, q_index in plan:
                    before = counters.host_reads
                    value, fresh = impl(d, ctx, pick(vals), None if q_index is None else vals[q_index])
                    if fresh:
                        note_derived(function, self.params[d.target].param, d.name, d.sources, fresh=True,
                                     host_read=counters.host_reads > before)
                    else:
                        note_cached(d.name)
                    filled[index] = value
            if mode == STRICT:
                values = dict(zip(names, vals))
                for check in validators:
                    check(function, values)
            return vals

        return hook

    def _steps(self, plan):
        """A plan of names as ready-to-run steps: (slot, derivation, implementation, context, source
        picker, slot of q)."""
        if type(plan) is int:
            return plan
        slot = {n: i for i, n in enumerate(self.names)}
        q_index = slot.get("q")
        steps = []
        for name in plan:
            d, impl, ctx = self.derivations[name]
            idx = tuple(slot[s] for s in d.sources)
            pick = operator.itemgetter(*idx) if len(idx) > 1 else (lambda v, i=idx[0]: (v[i],))
            steps.append((slot[name], d, impl, ctx, pick, q_index))
        return tuple(steps)

    def _plan(self, present: frozenset):
        """Names to derive, in order, so that every contract is met (preferring the group that meets the
        most contracts, then one the function names as parameters over one that would go through
        ``**kwargs``, then the fewest host reads, then catalog order); or the index of a contract that
        cannot be met."""
        have = set(present)
        plan: list = []
        while True:
            unmet = [i for i in range(len(self.contracts)) if not self._met(i, have)]
            if not unmet:
                return tuple(plan)
            best = None
            for i in unmet:
                for rank, group in enumerate(self.groups[i]):
                    missing = [n for n in group if n not in have]
                    steps = [self.derivations[n] for n in missing if n in self.derivations]
                    if len(steps) < len(missing) or any(s not in have for st in steps for s in st[0].sources):
                        continue
                    after = have | set(group)
                    key = (-sum(self._met(j, after) for j in unmet), sum(n not in self.named for n in missing),
                           sum(st[0].host_read for st in steps), i, rank)
                    if best is None or key < best[0]:
                        best = (key, missing)
            if best is None:
                return unmet[0]
            plan += best[1]
            have.update(best[1])

    def _met(self, i: int, present: set) -> bool:
        return any(all(n in present for n in g) for g in self.groups[i])

    def _unmet_error(self, i: int, values: dict) -> GuardError:
        c = self.contracts[i]
        # The catalog lists the prepared form first and the specific value last: name the specific one.
        group = self.groups[i][-1]
        name = next((n for n in group if values.get(n) is None), group[0])
        sources = sorted({s for g in self.groups[i] for n in g if n in self.derivations
                          for s in self.derivations[n][0].sources})
        missing_sources = [s for s in sources if values.get(s) is None]
        got = "None (or not passed)"
        if missing_sources:
            got += f"; nothing to derive it from ({', '.join(missing_sources)} missing too)"
        return GuardError(c.code, argument=self.params[name].param, function=self.function,
                          expected=f"{c.requirement_text()} passed and not None", got=got,
                          detail=c.diagnosis.message)


def guard(contract: Union[str, Contract, Sequence[Union[str, Contract]]],
          **rename: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorate a function, method or ``nn.Module.forward`` with one or more contracts.

    ``contract`` is a rule code (``"GL101"``), a ``Contract`` or a list (``guard(["GL101", "GL102"])``);
    ``rename`` maps the contract's argument names to the function's parameters
    (``@guard("GL101", cu_seqlens="cu", sequence_lengths="lens")``). A keyword passed as None counts as
    missing. Derived values are passed in the argument's own slot, so the function must be able to take
    them: a named parameter or ``**kwargs`` (checked at decoration: GuardError GL001 otherwise). Mode
    ``off`` calls the function directly; ``strict`` also validates the values of the varlen (GL103) and
    LoRA (GL204) contracts.
    """
    contracts = _resolve(contract)

    def decorate(fn: Callable) -> Callable:
        g = _Guard(fn, contracts, dict(rename))
        wrapper = make_wrapper(fn, accesses(fn, g.params), g.names, g.make_hook(), fast=g.fast_expression(),
                               presence=True)
        wrapper.__guardlint__ = g
        return wrapper

    return decorate
