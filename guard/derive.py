"""The runtime side of the catalog's named derivations (``Derivation.name``).

Each takes the call's bound values and returns the derived value and whether it was freshly computed
(False: served from the cache). Host reads go through ``metadata.read_host``: one per tensor version.
"""
from __future__ import annotations

import builtins
from typing import Any, Callable, Optional

import torch

from guardlint.contracts import Derivation

from ._cache import MISS, cache
from .errors import GuardError
from .metadata import (_upload, check_index_tensor, check_prefix_sums, host_sequence, is_compiling, prepare,
                       read_host, token_offsets)


class Context:
    """Where a derivation runs: the guarded function's name and the contract's code."""

    __slots__ = ("function", "code", "prefix")

    def __init__(self, function: str, code: str, prefix: str = "") -> None:
        self.function = function
        self.code = code
        self.prefix = prefix  # how errors name the arguments, e.g. "batch_info." for LoRA fields

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


def _target_device(values: dict, source: Any) -> torch.device:
    if isinstance(source, torch.Tensor):
        return source.device
    q = values.get("q")
    return q.device if isinstance(q, torch.Tensor) else torch.device("cpu")


def _host_offsets(values: dict, d: Derivation, ctx: Context) -> tuple:
    """Token offsets of the derivation's first source, on the host (one cached read for a tensor)."""
    src = values[d.sources[0]]
    name = ctx.prefix + d.sources[0]
    if isinstance(src, torch.Tensor):
        check_index_tensor(src, name, ctx.function, code=ctx.invalid_code)
        host = read_host(src, name, ctx.function)
    else:
        host = host_sequence(src, name, ctx.function, code=ctx.invalid_code)
    q = values.get("q")
    if ctx.code.startswith("GL1") and getattr(q, "shape", None) is not None and len(q.shape) >= 1:
        hd = 1
        for dim in q.shape[1:]:
            hd *= int(dim)
        return token_offsets(host, layout=ctx.layout, total_tokens=int(q.shape[0]), elements_per_token=hd,
                             argument=name, function=ctx.function)
    return host


def diff(values: dict, d: Derivation, ctx: Context) -> tuple:
    """``src[1:] - src[:-1]`` as int32, on the device; no host read."""
    src = values[d.sources[0]]
    name = ctx.prefix + d.sources[0]
    compiling = is_compiling()
    if isinstance(src, torch.Tensor):
        check_index_tensor(src, name, ctx.function, code=ctx.invalid_code)
        if not compiling:
            hit = cache.get(src, "diff")
            if hit is not MISS:
                return hit, False
        out = (src[1:] - src[:-1]).to(torch.int32)
        if not compiling:
            cache.put(src, "diff", out)
        return out, True
    host = host_sequence(src, name, ctx.function, code=ctx.invalid_code)
    device = _target_device(values, src)
    key = ("diff", host, device)
    hit = cache.get_host(key)
    if hit is not MISS:
        return hit, False
    out = _upload([host[i + 1] - host[i] for i in range(len(host) - 1)], device)
    cache.put_host(key, out)
    return out, True


def _memo(values: dict, d: Derivation, ctx: Context, tag: tuple, compute: Callable[[], Any]) -> tuple:
    """``compute()`` once per version of the first source tensor (or per host contents)."""
    src = values[d.sources[0]]
    if is_compiling():
        return compute(), True
    if isinstance(src, torch.Tensor):
        hit = cache.get(src, tag)
        if hit is not MISS:
            return hit, False
        value = compute()
        cache.put(src, tag, value)
        return value, True
    key = tag + (host_sequence(src, ctx.prefix + d.sources[0], ctx.function, code=ctx.invalid_code),)
    hit = cache.get_host(key)
    if hit is not MISS:
        return hit, False
    value = compute()
    cache.put_host(key, value)
    return value, True


def _q_shape(values: dict) -> tuple:
    shape = getattr(values.get("q"), "shape", None)
    return tuple(shape) if shape is not None else None


def _longest(offsets: tuple, count: int) -> int:
    # max() without default=: torch.compile traces this when a compiled call derives.
    return max([offsets[i + 1] - offsets[i] for i in range(count)] or [0])


def max_of_diff(values: dict, d: Derivation, ctx: Context) -> tuple:
    """The longest sequence as a Python int: one host read per cu_seqlens version."""
    def compute() -> int:
        offsets = _host_offsets(values, d, ctx)
        check_prefix_sums(offsets, ctx.prefix + d.sources[0], ctx.function, code=ctx.invalid_code)
        return _longest(offsets, len(offsets) - 1)

    return _memo(values, d, ctx, ("max_of_diff", ctx.layout, _q_shape(values)), compute)


def max_of_live_diff(values: dict, d: Derivation, ctx: Context) -> tuple:
    """The longest live segment (the first ``num_segments``) as a Python int."""
    name = ctx.prefix + d.sources[0]
    live = values.get(d.sources[1]) if len(d.sources) > 1 else None

    def compute() -> int:
        host = _host_offsets(values, d, ctx)
        n = len(host) - 1 if live is None else live
        if type(n) is not int or not 0 <= n <= len(host) - 1:
            raise GuardError(ctx.invalid_code, argument=ctx.prefix + d.sources[1], function=ctx.function,
                             expected=f"an int in [0, {len(host) - 1}] (live segments of {name})",
                             got=repr(n) if type(n) is int else type(n).__name__)
        host = host[:n + 1]
        check_prefix_sums(host, name, ctx.function, code=ctx.invalid_code)
        return _longest(host, n)

    return _memo(values, d, ctx, ("max_of_live_diff", live if type(live) is int else None), compute)


def prepare_varlen_cudnn(values: dict, d: Derivation, ctx: Context) -> tuple:
    """The engine's cuDNN plan: packed element indptrs, padded lengths, bucketed max (cached)."""
    cu, q = values[d.sources[0]], values.get(d.sources[1])
    if isinstance(cu, torch.Tensor) and not is_compiling():
        # prepare()'s own cache lookup, without its call and argument checks
        hit = cache.get(cu, ("meta", "cudnn", True, getattr(q, "shape", None), getattr(q, "device", None)))
        if hit is not MISS:
            return hit, False
    return prepare(values[d.sources[0]], values.get(d.sources[1]), layout="cudnn", bucket=True,
                   function=ctx.function, argument=d.sources[0])


def compile_template(d: Derivation) -> Callable[[dict, Derivation, Context], tuple]:
    """A user contract's ``derive`` template, evaluated as the Python expression it is (it comes from the
    project's own configuration, like the code it guards). Not cached: its cost is unknown."""
    source = d.template.format(**{s: s for s in d.sources})
    code = compile(source, f"<guardlint derive {d.target}>", "eval")
    scope = {"torch": torch, "__builtins__": builtins}

    def template(values: dict, d: Derivation, ctx: Context) -> tuple:
        return eval(code, scope, {s: values[s] for s in d.sources}), True

    return template


DERIVERS: dict[str, Callable[[dict, Derivation, Context], tuple]] = {
    "diff": diff,
    "max_of_diff": max_of_diff,
    "max_of_live_diff": max_of_live_diff,
    "prepare_varlen_cudnn": prepare_varlen_cudnn,
}


def deriver(d: Derivation) -> Optional[Callable[[dict, Derivation, Context], tuple]]:
    if d.name == "template":
        return compile_template(d)
    return DERIVERS.get(d.name)
