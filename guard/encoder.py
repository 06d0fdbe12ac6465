"""``guard_mm_encoder``: vLLM's multimodal encoder attention on its FlashInfer (cuDNN) backend.

vLLM's ``flashinfer_wrapper`` asserts ``sequence_lengths is not None`` and ``max_seqlen is not None``
(its issue 42787): a model that forgets to pass them dies there. It wants ``cu_seqlens`` as element
offsets in two sections ``[qko | v]`` (v addressed in v's own token stride), ``sequence_lengths``
zero-padded to the batch bucket, and ``max_seqlen`` as a host tensor (it calls ``.item()``), bucketed.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, ParamSpec, TypeVar, cast, overload

import torch

from guardlint.contracts import get as get_contract

from . import _cache, _state
from ._cache import MISS, cache
from ._codegen import Guarded
from .decorator import qualified_name
from .errors import GuardError, describe
from .metadata import (VLLM_SEQLEN_BUCKETS, bucket_max_seqlen, check_index_tensor, is_compiling, prepare,
                       read_host)

GL101, GL102 = get_contract("GL101"), get_contract("GL102")


@functools.lru_cache(maxsize=64)
def _host_scalar(value: int) -> torch.Tensor:
    """The max as vLLM passes it: an int32 host tensor (``.item()`` of it is no device sync)."""
    return torch.tensor(value, dtype=torch.int32)


def _tokens(t: torch.Tensor) -> tuple:
    """(T, H*D) of a ``(T, H, D)`` or ``(B, S, H, D)`` tensor."""
    return math.prod(t.shape[:-2]), t.shape[-2] * t.shape[-1]


def _plan(query: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, function: str) -> tuple:
    """(cu_seqlens, sequence_lengths, max_seqlen, the true longest sequence) for the wrapper, from token offsets
    ``(B+1,)`` or the engine's own two-section element offsets; one host read per cu_seqlens version."""
    T, HD = _tokens(query)
    v_stride = int(value.stride(-3))
    tag = ("vllm-encoder", T, HD, v_stride, query.device)
    if not is_compiling():
        hit = cache.get(cu, tag)
        if hit is not MISS:
            _state.note_cached(GL101.derivation("sequence_lengths").name)
            return hit
    check_index_tensor(cu, "cu_seqlens", function)
    host = read_host(cu, "cu_seqlens", function)
    n = len(host)
    if host[-1] == T or n < 2 or n % 2:
        # Token offsets: the whole vLLM plan (two sections, padded lengths, bucketed max).
        meta, _ = prepare(host, _Shape(T, HD, query.device), layout="vllm", bucket=True, function=function,
                          v=value)
        out = (meta.packed_indptrs, meta.sequence_lengths.view(-1), _host_scalar(meta.flashinfer_max_seqlen),
               meta.max_seqlen)
    else:
        qko = host[:n // 2]
        if qko[-1] != T * HD or any(x % HD for x in qko):
            raise GuardError("GL107", argument="cu_seqlens", function=function,
                             expected=f"token offsets ending at T={T}, or vLLM's element offsets [qko | v] whose "
                                      f"qko section ends at T*H*D={T * HD}",
                             got=f"{describe(cu)} whose first half ends at {qko[-1]}")
        lengths = [(qko[i + 1] - qko[i]) // HD for i in range(len(qko) - 1)]
        if min(lengths, default=0) < 0:
            raise GuardError("GL103", argument="cu_seqlens", function=function,
                             expected="non-decreasing element offsets", got="a decrease in the qko section")
        seq = torch.tensor(lengths, dtype=torch.int32).to(query.device, non_blocking=True)
        longest = max(lengths, default=0)
        out = (cu, seq, _host_scalar(bucket_max_seqlen(longest, VLLM_SEQLEN_BUCKETS)), longest)
    _state.note_derived(function, "sequence_lengths", GL101.derivation("sequence_lengths").name,
                        ("cu_seqlens",), fresh=True, host_read=True)
    if not is_compiling():
        cache.put(cu, tag, out)
    return out


class _Shape:
    """What ``prepare`` needs of q: the packed ``(T, H*D)`` shape and the device."""

    __slots__ = ("shape", "device")

    def __init__(self, T: int, HD: int, device: torch.device) -> None:
        self.shape = torch.Size((T, HD))
        self.device = device


# For type checkers: a guarded function keeps its signature.
_P = ParamSpec("_P")
_R = TypeVar("_R")


@overload
def guard_mm_encoder(fn: Callable[_P, _R]) -> Callable[_P, _R]: ...
@overload
def guard_mm_encoder(fn: None = None) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...
def guard_mm_encoder(fn: Optional[Callable] = None):
    """Guard vLLM's ``MMEncoderAttention._forward_flashinfer(self, query, key, value, cu_seqlens=None,
    max_seqlen=None, sequence_lengths=None)`` (or any function with those parameter names).

    With ``sequence_lengths`` or ``max_seqlen`` None and ``cu_seqlens`` given, the call gets them
    derived from ``cu_seqlens``: token offsets ``(B+1,)`` become the whole plan vLLM's own
    ``maybe_recompute_cu_seqlens`` / ``maybe_compute_seq_lens`` / ``compute_max_seqlen`` would build
    (element offsets ``[qko | v]``, padded lengths, bucketed max as a host tensor); the engine's element
    offsets keep their values and get the lengths and max they describe. One host read per cu_seqlens
    version (cached), none per layer. Values the caller passed are never replaced.
    """
    if fn is None:
        return guard_mm_encoder
    function = qualified_name(fn)

    @functools.wraps(fn)
    def wrapper(self: Any, query: Any, key: Any, value: Any, cu_seqlens: Any = None, max_seqlen: Any = None,
                sequence_lengths: Any = None, *args: Any, **kwargs: Any) -> Any:
        if _state.current and (sequence_lengths is None or max_seqlen is None):
            if not _cache.enabled:
                _cache.new_call()
            if not isinstance(cu_seqlens, torch.Tensor):
                code, name = (GL101, "sequence_lengths") if sequence_lengths is None else (GL102, "max_seqlen")
                raise GuardError(code.code, argument=name, function=function,
                                 expected=f"{name} passed (MMEncoderAttention.maybe_compute_seq_lens / "
                                          "compute_max_seqlen once per forward), or cu_seqlens to derive it from",
                                 got=f"None, and cu_seqlens is {describe(cu_seqlens)}",
                                 detail=code.diagnosis.message)
            for name, t in (("query", query), ("value", value)):
                if not isinstance(t, torch.Tensor) or t.dim() not in (3, 4):
                    raise GuardError("GL106", argument=name, function=function,
                                     expected="a tensor (total_tokens, num_heads, head_dim) or (B, S, H, D)",
                                     got=describe(t))
            if cu_seqlens.is_meta:
                raise GuardError("GL103", argument="cu_seqlens", function=function,
                                 expected="a tensor with values (not on the meta device)", got=describe(cu_seqlens))
            cu, seq, mx, longest = _plan(query, value, cu_seqlens, function)
            if max_seqlen is not None:
                # The caller's max beside a derived plan: the read that made the plan knows the true one.
                given = max_seqlen
                if isinstance(given, torch.Tensor) and given.numel() == 1 and given.is_cpu and not (
                        given.dtype.is_floating_point or given.dtype.is_complex):
                    given = int(given.item())  # vLLM passes it as a host tensor: no sync
                if type(given) is int and given < longest:
                    raise GuardError("GL103", argument="max_seqlen", function=function,
                                     expected="at least the longest sequence of cu_seqlens",
                                     got="a shorter max_seqlen",
                                     detail="A short max_seqlen makes the kernel skip the tail of longer sequences.",
                                     fix="Compute max_seqlen from these cu_seqlens (compute_max_seqlen, once per "
                                         "forward), or leave it out and let the guard derive it.")
            cu_seqlens = cu
            sequence_lengths = seq if sequence_lengths is None else sequence_lengths
            max_seqlen = mx if max_seqlen is None else max_seqlen
        return fn(self, query, key, value, cu_seqlens, max_seqlen, sequence_lengths, *args, **kwargs)

    guarded = cast(Guarded, wrapper)  # functools.wraps' type has no attributes of its own
    guarded.__guardlint__ = ("mm_encoder", None)
    return guarded
