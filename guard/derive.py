"""The runtime side of the catalog's named derivations (``Derivation.name``).

Each takes the derivation's source values (and the call's q, for devices and shapes) and returns the
derived value and whether it was freshly computed (False: served from the cache). Host reads go
through ``metadata.read_host``: one per tensor version.
"""
from __future__ import annotations

import builtins
from typing import Any, Callable, Optional

import torch

from guardlint.contracts import Derivation

from ._cache import MISS, cache
from .errors import GuardError
from .metadata import (INT32_MAX, _upload, check_index_tensor, check_prefix_sums, host_sequence, is_compiling, prepare,
                       read_host, token_offsets)


class Context:
    """Where a derivation runs: the guarded function's name and the contract's code."""

    __slots__ = ("function", "code", "prefix", "params")

    def __init__(self, function: str, code: str, prefix: str = "", params: Optional[dict] = None) -> None:
        self.function = function
        self.code = code
        self.prefix = prefix  # how errors name the arguments, e.g. "batch_info." for LoRA fields
        self.params = params or {}  # contract name -> the function's parameter name (a renamed argument)

    def arg(self, name: str) -> str:
        """How errors name the contract argument ``name``: as the guarded function calls it."""
        return self.prefix + self.params.get(name, name)

    @property
    def invalid_code(self) -> str:
        """The code for present-but-invalid sources: GL103 for varlen, GL204 for LoRA."""
        if self.code.startswith("GL1"):
            return "GL103"
        if self.code.startswith("GL2"):
            return "GL204"
        return self.code

    @property
    def layout(self) -> str:
        # GL101/GL102 describe the cuDNN vision path, where cu_seqlens may be packed element indptrs.
        return "cudnn" if self.code in ("GL101", "GL102") else "tokens"


def _host_offsets(d: Derivation, ctx: Context, src: Any, q: Any) -> tuple:
    """Token offsets of the derivation's first source, on the host (one cached read for a tensor)."""
    name = ctx.arg(d.sources[0])
    if isinstance(src, torch.Tensor):
        check_index_tensor(src, name, ctx.function, code=ctx.invalid_code)
        host = read_host(src, name, ctx.function, code=ctx.invalid_code)
    else:
        host = host_sequence(src, name, ctx.function, code=ctx.invalid_code)
    if ctx.code.startswith("GL1") and getattr(q, "shape", None) is not None and len(q.shape) >= 1:
        hd = 1
        for dim in q.shape[1:]:
            hd *= int(dim)
        return token_offsets(host, layout=ctx.layout, total_tokens=int(q.shape[0]), elements_per_token=hd,
                             argument=name, function=ctx.function)
    return host


def diff(d: Derivation, ctx: Context, src: tuple, q: Any) -> tuple:
    """``src[1:] - src[:-1]`` as int32, on the device; no host read."""
    offsets = src[0]
    name = ctx.arg(d.sources[0])
    compiling = is_compiling()
    # Varlen offsets are live end to end: where their values cost no device read, lengths that would come out
    # negative are refused as the ready decorators refuse them (LoRA's seg_indptr has stale entries past
    # num_segments, which this derivation does not know of; strict mode checks those).
    varlen = ctx.code.startswith("GL1")
    if isinstance(offsets, torch.Tensor):
        check_index_tensor(offsets, name, ctx.function, code=ctx.invalid_code)
        if not compiling:
            hit = cache.get(offsets, "diff")
            if hit is not MISS:
                return hit, False
        if varlen and offsets.is_cpu and not compiling:
            host = read_host(offsets, name, ctx.function, counted=False, code=ctx.invalid_code)
            check_prefix_sums(host, name, ctx.function, code=ctx.invalid_code)
        out = (offsets[1:] - offsets[:-1]).to(torch.int32)
        if not compiling:
            cache.put(offsets, "diff", out)
        return out, True
    host = host_sequence(offsets, name, ctx.function, code=ctx.invalid_code)
    if varlen:
        check_prefix_sums(host, name, ctx.function, code=ctx.invalid_code)
    if any(not -INT32_MAX <= x <= INT32_MAX for x in host):
        raise GuardError(ctx.invalid_code, argument=name, function=ctx.function, expected="offsets that fit int32",
                         got=f"an entry outside [-{INT32_MAX}, {INT32_MAX}]")
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    key = ("diff", host, device)
    hit = cache.get_host(key)
    if hit is not MISS:
        return hit, False
    out = _upload([host[i + 1] - host[i] for i in range(len(host) - 1)], device)
    cache.put_host(key, out)
    return out, True


def _memo(d: Derivation, ctx: Context, source: Any, tag: tuple, compute: Callable[[], Any]) -> tuple:
    """``compute()`` once per version of the source tensor (or per host contents)."""
    if is_compiling():
        return compute(), True
    if isinstance(source, torch.Tensor):
        hit = cache.get(source, tag)
        if hit is not MISS:
            return hit, False
        value = compute()
        cache.put(source, tag, value)
        return value, True
    key = tag + (host_sequence(source, ctx.arg(d.sources[0]), ctx.function, code=ctx.invalid_code),)
    hit = cache.get_host(key)
    if hit is not MISS:
        return hit, False
    value = compute()
    cache.put_host(key, value)
    return value, True


def _longest(offsets: tuple, count: int) -> int:
    # max() without default=: torch.compile traces this when a compiled call derives.
    return max([offsets[i + 1] - offsets[i] for i in range(count)] or [0])


def max_of_diff(d: Derivation, ctx: Context, src: tuple, q: Any) -> tuple:
    """The longest sequence as a Python int: one host read per cu_seqlens version."""
    def compute() -> int:
        offsets = _host_offsets(d, ctx, src[0], q)
        check_prefix_sums(offsets, ctx.arg(d.sources[0]), ctx.function, code=ctx.invalid_code)
        return _longest(offsets, len(offsets) - 1)

    shape = getattr(q, "shape", None)
    return _memo(d, ctx, src[0], ("max_of_diff", ctx.layout, None if shape is None else tuple(shape)), compute)


def max_of_live_diff(d: Derivation, ctx: Context, src: tuple, q: Any) -> tuple:
    """The longest live segment (the first ``num_segments``) as a Python int."""
    name = ctx.arg(d.sources[0])
    live = src[1] if len(src) > 1 else None

    def compute() -> int:
        host = _host_offsets(d, ctx, src[0], q)
        n = len(host) - 1 if live is None else live
        if type(n) is not int or not 0 <= n <= len(host) - 1:
            raise GuardError(ctx.invalid_code, argument=ctx.arg(d.sources[1]), function=ctx.function,
                             expected=f"an int in [0, {len(host) - 1}] (live segments of {name})",
                             got=repr(n) if type(n) is int else type(n).__name__)
        host = host[:n + 1]
        check_prefix_sums(host, name, ctx.function, code=ctx.invalid_code)
        return _longest(host, n)

    return _memo(d, ctx, src[0], ("max_of_live_diff", live if type(live) is int else None), compute)


def prepare_varlen_cudnn(d: Derivation, ctx: Context, src: tuple, q: Any) -> tuple:
    """The engine's cuDNN plan: packed element indptrs, padded lengths, bucketed max (cached)."""
    cu, q = src
    if isinstance(cu, torch.Tensor) and not is_compiling():
        # prepare()'s own cache lookup, without its call and argument checks
        hit = cache.get(cu, ("meta", "cudnn", True, getattr(q, "shape", None), getattr(q, "device", None)))
        if hit is not MISS:
            return hit, False
    return prepare(cu, q, layout="cudnn", bucket=True, function=ctx.function, argument=ctx.arg(d.sources[0]))


def compile_template(d: Derivation) -> Callable:
    """A user contract's ``derive`` template, evaluated as the Python expression it is (it comes from the
    project's own configuration, like the code it guards). Not cached: its cost is unknown."""
    source = d.template.format(**{s: s for s in d.sources})
    code = compile(source, f"<guardlint derive {d.target}>", "eval")
    scope = {"torch": torch, "__builtins__": builtins}

    def template(d: Derivation, ctx: Context, src: tuple, q: Any) -> tuple:
        return eval(code, scope, dict(zip(d.sources, src))), True

    return template


# Each takes (derivation, context, source values in ``d.sources`` order, the call's q or None) and
# returns (value, freshly computed?).
DERIVERS: dict[str, Callable[[Derivation, Context, tuple, Any], tuple]] = {
    "diff": diff,
    "max_of_diff": max_of_diff,
    "max_of_live_diff": max_of_live_diff,
    "prepare_varlen_cudnn": prepare_varlen_cudnn,
}


def deriver(d: Derivation) -> Optional[Callable[[Derivation, Context, tuple, Any], tuple]]:
    if d.name == "template":
        return compile_template(d)
    return DERIVERS.get(d.name)
