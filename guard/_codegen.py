"""Wrappers with the guarded function's own signature, generated once at decoration.

A ``*args, **kwargs`` wrapper re-packs every call (~0.25 µs on a small CPU, the whole budget of mode
``off``). A wrapper with the exact signature holds each argument in a local, so mode ``off`` is one
global load and a call, and the "contract met" test is one generated boolean expression. Everything
else lives in ordinary Python (the hook); the generated code is only this skeleton.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional, Protocol, Sequence

from . import _state
from .errors import GuardError

PREFIX = "_guardlint_"


class Guarded(Protocol):
    """A guarded function: called as the original, and marked with what guards it (``__guardlint__``, read
    by the integrations to leave an already guarded function alone)."""

    __guardlint__: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class Access:
    """How the generated code reads and writes one contract argument."""

    __slots__ = ("name", "param", "local", "varkw")

    def __init__(self, name: str, param: str, local: bool, varkw: Optional[str]) -> None:
        self.name = name
        self.param = param
        self.local = local  # a named parameter: a local variable of the wrapper
        self.varkw = varkw  # else the **kwargs dict it travels in (None: the function cannot take it)

    @property
    def read(self) -> str:
        if self.local:
            return self.param
        if self.varkw is not None:
            return f"{self.varkw}.get({self.param!r})"
        return "None"


def accesses(fn: Callable, params: dict) -> dict:
    """``Access`` for each contract name, from ``bind()``'s ``{name: Param}``."""
    sig = inspect.signature(fn)
    varkw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    out = {}
    for name, p in params.items():
        sp = sig.parameters.get(p.param)
        local = sp is not None and sp.kind not in (sp.VAR_POSITIONAL, sp.VAR_KEYWORD)
        out[name] = Access(name, p.param, local, None if local else varkw)
    return out


def make_wrapper(fn: Callable, access: dict, names: Sequence[str], hook: Callable,
                 fast: Optional[str] = None, env: Optional[dict] = None, presence: bool = False,
                 reset: Sequence[str] = (), prepared: Optional[tuple] = None) -> Guarded:
    """A wrapper of ``fn`` with its signature: mode off calls through; in derive mode, when ``fast``
    (a Python expression with ``{name}`` placeholders for contract arguments) is true, it calls through;
    otherwise ``hook(mode, *values)`` returns the values of ``names`` to call with. With ``presence``,
    the hook also gets, second, a tuple saying which of the values are not None. ``reset``: named parameters
    set to False on entry whatever the caller passed (flags only the hook may set, such as
    ``max_seqlen_verified``). ``prepared``: (condition, {name: expression}): in derive mode, when the condition
    holds, those arguments are set to those expressions and the function is called, without the hook (the
    prepared-metadata path, which must stay under a microsecond)."""
    sig = inspect.signature(fn)
    for p in sig.parameters.values():
        if p.name.startswith(PREFIX):
            raise GuardError("GL002", argument=p.name, function=getattr(fn, "__qualname__", None),
                             expected=f"parameter names that do not start with {PREFIX!r}",
                             got=f"a parameter named {p.name!r}", fix="rename the parameter")
    ns: dict = {f"{PREFIX}fn": fn, f"{PREFIX}state": _state, f"{PREFIX}hook": hook}
    ns.update({f"{PREFIX}{k}": v for k, v in (env or {}).items()})
    head, call = [], []
    seen_kwonly = False
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        default = ""
        if p.default is not p.empty:
            ns[f"{PREFIX}d{i}"] = p.default
            default = f"={PREFIX}d{i}"
        if p.kind is p.POSITIONAL_ONLY:
            head.append(p.name + default)
            call.append(p.name)
            if i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY:
                head.append("/")
        elif p.kind is p.POSITIONAL_OR_KEYWORD:
            head.append(p.name + default)
            call.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            head.append("*" + p.name)
            call.append("*" + p.name)
            seen_kwonly = True
        elif p.kind is p.KEYWORD_ONLY:
            if not seen_kwonly:
                head.append("*")
                seen_kwonly = True
            head.append(p.name + default)
            call.append(f"{p.name}={p.name}")
        else:
            head.append("**" + p.name)
            call.append("**" + p.name)
    call_src = f"{PREFIX}fn({', '.join(call)})"
    reads = ", ".join(access[n].read for n in names)
    targets, writes = [], []
    for i, n in enumerate(names):
        a = access[n]
        if a.local:
            targets.append(a.param)
        else:
            targets.append(f"{PREFIX}t{i}")
            if a.varkw is not None:
                writes.append(f"    if {PREFIX}t{i} is not None:\n        {a.varkw}[{a.param!r}] = {PREFIX}t{i}")
    lines = [f"def {PREFIX}wrapper({', '.join(head)}):"]
    lines += [f"    {name} = False" for name in reset]
    lines += [
        f"    {PREFIX}mode = {PREFIX}state.current",
        f"    if not {PREFIX}mode:",
        f"        return {call_src}",
    ]
    reads_of = {n: access[n].read for n in access}
    if prepared:
        condition, assigns = prepared
        lines.append(f"    if {PREFIX}mode == {_state.DERIVE} and ({condition.format(**reads_of)}):")
        for name, expression in assigns.items():
            a = access[name]
            value = expression.format(**reads_of)
            if a.local:
                lines.append(f"        {a.param} = {value}")
            elif a.varkw is not None:
                lines.append(f"        {a.varkw}[{a.param!r}] = {value}")
        lines.append(f"        return {call_src}")
    if fast:
        expr = fast.format(**reads_of)
        lines += [f"    if {PREFIX}mode == {_state.DERIVE} and ({expr}):",
                  f"        return {call_src}"]
    if presence:
        flags = "".join(f"{access[n].read} is not None, " for n in names)
        reads = f"({flags}), {reads}"
    lines.append(f"    ({', '.join(targets)},) = {PREFIX}hook({PREFIX}mode, {reads})")
    lines += writes
    lines.append(f"    return {call_src}")
    source = "\n".join(lines) + "\n"
    code = compile(source, f"<guardlint wrapper of {getattr(fn, '__qualname__', fn)}>", "exec")
    exec(code, ns)
    wrapper = ns[f"{PREFIX}wrapper"]
    functools.update_wrapper(wrapper, fn)
    wrapper.__guardlint_source__ = source
    return wrapper
