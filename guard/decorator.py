"""``guard(contract, **rename)``: enforce catalog (or user) contracts on any function at call time.

The binding (where each contract argument sits in the function's signature) is computed once, at
decoration. A call that meets its contracts costs a few ``is None`` tests; one that does not gets the
missing values derived (named derivations, cached) or a coded ``GuardError`` naming the argument.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from guardlint.contracts import Contract, get as get_contract

from . import _state
from .derive import Context, deriver
from .errors import GuardError, describe
from .validate import check_lora, check_varlen

NOT_POSITIONAL = sys.maxsize  # an index no call reaches: the value is looked up in kwargs


class Param:
    """Where one contract argument sits in the guarded function's signature."""

    __slots__ = ("name", "param", "index", "default", "accepted")

    def __init__(self, name: str, param: str, index: int, default: Any, accepted: bool) -> None:
        self.name = name          # the contract's name for it
        self.param = param        # the function's parameter name
        self.index = index        # positional index, or NOT_POSITIONAL
        self.default = default    # the signature's default (None when it has none)
        self.accepted = accepted  # can the function receive it (named parameter or **kwargs)?

    def get(self, args: Sequence, kwargs: dict) -> Any:
        return args[self.index] if self.index < len(args) else kwargs.get(self.param, self.default)

    def put(self, args: list, kwargs: dict, value: Any) -> None:
        if self.index < len(args):
            args[self.index] = value
        else:
            kwargs[self.param] = value


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
        raise GuardError("GL001", argument="fn", function=function, expected="a function with a signature",
                         got=f"{type(fn).__name__} ({exc})") from None
    params = list(sig.parameters.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    positions = {p.name: i for i, p in enumerate(params) if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)}
    names = list(dict.fromkeys(names))
    for key, target in rename.items():
        if key not in names:
            raise GuardError("GL001", argument=key, function=function,
                             expected=f"one of the contract's arguments ({', '.join(names)})",
                             got=f"rename {key}={target!r}",
                             fix="rename maps the contract's argument names to the function's parameter names")
        if not isinstance(target, str) or (target not in sig.parameters and not var_kw):
            raise GuardError("GL001", argument=key, function=function,
                             expected=f"a parameter of {function}{sig}", got=f"rename {key}={target!r}",
                             fix="name an existing parameter, or give the function **kwargs")
    out = {}
    for name in names:
        param = rename.get(name, name)
        p = sig.parameters.get(param)
        if p is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            out[name] = Param(name, param, NOT_POSITIONAL, None, var_kw)
            continue
        default = None if p.default is p.empty else p.default
        out[name] = Param(name, param, positions.get(param, NOT_POSITIONAL), default, True)
    for name in must_accept:
        if not out[name].accepted:
            raise GuardError("GL001", argument=name, function=function,
                             expected=f"a parameter {rename.get(name, name)!r} (or **kwargs) to receive it",
                             got=f"signature {function}{sig}",
                             fix=f"add `{rename.get(name, name)}=None` to the signature, give it **kwargs, or "
                                 f"map the name with guard(..., {name}='<your parameter>')")
    return out


def _resolve(contract: Union[str, Contract, Sequence[Union[str, Contract]]]) -> tuple:
    items = [contract] if isinstance(contract, (str, Contract)) else list(contract)
    if not items:
        raise GuardError("GL001", argument="contract", expected="a rule code, a Contract or a list of them",
                         got="an empty list")
    out = []
    for item in items:
        if isinstance(item, str):
            try:
                item = get_contract(item)
            except KeyError as exc:
                raise GuardError("GL001", argument="contract", expected="a known rule code",
                                 got=repr(item), fix=str(exc.args[0])) from None
        if not isinstance(item, Contract):
            raise GuardError("GL001", argument="contract", expected="a rule code or a Contract",
                             got=describe(item))
        if not item.require:
            raise GuardError("GL001", argument="contract", expected="a contract with required arguments "
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


class _Guard:
    """The per-function state behind one ``guard(...)`` wrapper."""

    def __init__(self, fn: Callable, contracts: tuple, rename: dict) -> None:
        self.fn = fn
        self.function = qualified_name(fn)
        self.contracts = contracts
        names: list = []
        for c in contracts:
            names += list(c.params) + [n for g in c.require for n in g]
            for d in c.derivations:
                names += [d.target, *d.sources]
        self.params = bind(fn, names, rename, function=self.function)
        self.derivations = {}
        for c in contracts:
            for d in c.derivations:
                impl = deriver(d)
                if impl is not None and d.target not in self.derivations:
                    self.derivations[d.target] = (d, impl, Context(self.function, c.code))
        # Groups the function can receive; a contract with none of them cannot be enforced here.
        self.groups = []
        for c in contracts:
            usable = tuple(g for g in c.require if all(self.params[n].accepted for n in g))
            if not usable:
                wanted = " or ".join("+".join(g) for g in c.require)
                raise GuardError("GL001", argument=c.require[0][0], function=self.function,
                                 expected=f"parameters (or **kwargs) for {wanted} ({c.code})",
                                 got=f"signature {self.function}{inspect.signature(fn)}",
                                 fix="add the parameters with default None, give the function **kwargs, "
                                     "or map names with guard(..., name='parameter')")
            self.groups.append(usable)
        self.checks = tuple(tuple(tuple((self.params[n].index, self.params[n].param, self.params[n].default)
                                        for n in g) for g in groups) for groups in self.groups)
        self.validators = tuple(dict.fromkeys(VALIDATORS[c.code] for c in contracts if c.code in VALIDATORS))

    def values(self, args: Sequence, kwargs: dict) -> dict:
        return {name: p.get(args, kwargs) for name, p in self.params.items()}

    def validate(self, args: Sequence, kwargs: dict) -> None:
        values = self.values(args, kwargs)
        for check in self.validators:
            check(self.function, values)

    def complete(self, args: tuple, kwargs: dict) -> tuple:
        """Derive what the unmet contracts miss; return the call's new (args, kwargs)."""
        values = self.values(args, kwargs)
        present = {n for n, v in values.items() if v is not None}
        args = list(args)
        while True:
            unmet = [i for i, c in enumerate(self.contracts) if not self._met(i, present)]
            if not unmet:
                return tuple(args), kwargs
            best = None
            for i in unmet:
                for rank, group in enumerate(self.groups[i]):
                    missing = [n for n in group if n not in present]
                    plan = [self.derivations.get(n) for n in missing]
                    if any(p is None or any(s not in present for s in p[0].sources) for p in plan):
                        continue
                    after = present | set(group)
                    satisfied = sum(self._met(j, after) for j in unmet)
                    reads = sum(p[0].host_read for p in plan)
                    key = (-satisfied, reads, i, rank)
                    if best is None or key < best[0]:
                        best = (key, missing, plan)
            if best is None:
                raise self._unmet_error(unmet[0], values)
            for name, (d, impl, ctx) in zip(best[1], best[2]):
                before = _state.counters.host_reads
                value, fresh = impl(values, d, ctx)
                _state.note_derived(self.function, name, d.name, d.sources, fresh=fresh,
                                    host_read=_state.counters.host_reads > before)
                values[name] = value
                present.add(name)
                self.params[name].put(args, kwargs, value)

    def _met(self, i: int, present: set) -> bool:
        return any(all(n in present for n in g) for g in self.groups[i])

    def _unmet_error(self, i: int, values: dict) -> GuardError:
        c = self.contracts[i]
        # The catalog lists the prepared form first and the specific value last: name the specific one.
        group = self.groups[i][-1]
        name = next(n for n in group if values.get(n) is None)
        sources = sorted({s for g in self.groups[i] for n in g if n in self.derivations
                          for s in self.derivations[n][0].sources})
        missing_sources = [s for s in sources if values.get(s) is None]
        got = "None (or not passed)"
        if sources:
            got += f"; nothing to derive it from ({', '.join(missing_sources)} missing too)"
        return GuardError(c.code, argument=self.params[name].param, function=self.function,
                          expected=f"{c.requirement_text()} passed and not None", got=got,
                          detail=c.diagnosis.message)


def guard(contract: Union[str, Contract, Sequence[Union[str, Contract]]], **rename: str):
    """Decorate a function, method or ``nn.Module.forward`` with one or more contracts.

    ``contract`` is a rule code (``"GL101"``), a ``Contract`` or a list (``guard(["GL101", "GL102"])``);
    ``rename`` maps the contract's argument names to the function's parameters
    (``@guard("GL101", cu_seqlens="cu", sequence_lengths="lens")``). A keyword passed as None counts as
    missing. Derived values are passed as keywords (or in their positional slot when the caller used
    it), so the function must accept them: a named parameter or ``**kwargs`` (checked at decoration,
    GuardError GL001 otherwise). Mode ``off`` calls the function directly; ``strict`` also validates
    the values of the varlen (GL103) and LoRA (GL204) contracts.
    """
    contracts = _resolve(contract)

    def decorate(fn: Callable) -> Callable:
        g = _Guard(fn, contracts, dict(rename))
        checks = g.checks
        complete = g.complete
        validate = g.validate

        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            mode = _state.current
            if not mode:
                return fn(*args, **kwargs)
            n = len(args)
            for groups in checks:
                for group in groups:
                    for index, param, default in group:
                        if (args[index] if index < n else kwargs.get(param, default)) is None:
                            break
                    else:
                        break  # this group is fully present: the contract is met
                else:
                    args, kwargs = complete(args, kwargs)
                    break
            if mode == _state.STRICT:
                validate(args, kwargs)
            return fn(*args, **kwargs)

        guarded.__guardlint__ = g
        return guarded

    return decorate
