"""Ready decorators for the kernels: ``guard_varlen``, ``guard_cudnn_vision`` and ``guard_lora``.

Each is the catalog's contract (GL101/GL102, GL201/GL203/GL204) specialised for one kernel family, so
its fast path is a few attribute loads: a prepared call adds well under a microsecond.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import operator
from typing import Any, Callable, Optional, ParamSpec, TypeVar, overload

import torch

from guardlint.contracts import get as get_contract

from . import _state
from ._cache import MISS, IdentityCache, cache
from ._codegen import accesses, make_wrapper
from .decorator import bind, qualified_name
from .derive import Context, DERIVERS
from .errors import GuardError, describe
from .metadata import (VarlenMetadata, bucket_batch_size, bucket_max_seqlen, check_index_tensor, is_compiling,
                       prepare, read_host)
from .validate import check_lora, check_plan_source, check_varlen, prefetch

GL101, GL102, GL201 = get_contract("GL101"), get_contract("GL102"), get_contract("GL201")
# Derivation names for stats and events come from the catalog, not from here.
SEQ_DERIVATION = GL101.derivation("sequence_lengths").name
MAX_DERIVATION = GL102.derivation("max_seqlen").name
# The catalog may list several ways to build forward_metadata (the engine's own helper first, for the
# linter's fixes); the guard runs the one it implements.
META_DERIVATION = next(d for d in GL101.derivations if d.target == "forward_metadata" and d.name in DERIVERS)
SEG_LENS_DERIVATION = GL201.derivation("seg_lens")
MAX_LEN_DERIVATION = next(d for d in GL201.derivations if d.target == "max_len" and d.name in DERIVERS)


# For type checkers: a guarded function keeps its signature, with or without decorator options.
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _decorator(build: Callable, fn: Optional[Callable], options: dict):
    """Allow both ``@guard_x`` and ``@guard_x(option=...)``."""
    if fn is not None:
        return build(fn, **options)
    return lambda f: build(f, **options)


# -- varlen attention -------------------------------------------------------------------------------

def _no_values(argument: str, value: Any, function: str, code: str) -> GuardError:
    """A metadata tensor on the meta device: shapes only, nothing to derive from or to run with."""
    return GuardError(code, argument=argument, function=function,
                      expected="a tensor with values on the data's device (not on the meta device)",
                      got=describe(value),
                      fix="Build the metadata on the device of the data; under a meta-device trace, pass "
                          "prepared metadata (or sequence_lengths and max_seqlen) instead.")


@overload
def guard_varlen(fn: Callable[_P, _R], **rename: str) -> Callable[_P, _R]: ...
@overload
def guard_varlen(fn: None = None, **rename: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...
def guard_varlen(fn: Optional[Callable] = None, **rename: str):
    """Guard ``varlen_attention(q, k, v, cu_seqlens, *, sequence_lengths=None, max_seqlen=None,
    metadata=None, ...)``.

    Afterwards the function always gets ``max_seqlen`` (a Python int) and ``sequence_lengths`` (int32,
    on q's device), and a tensor ``cu_seqlens``: taken from ``metadata`` when one was given (values the
    caller passed explicitly win), else derived from ``cu_seqlens`` with one host read per distinct
    tensor version (none for a host list). ``metadata`` itself is passed only when the caller gave one.

    Metadata and cu_seqlens together: the metadata is used only when it was prepared from this very
    cu_seqlens (its own ``cu_seqlens`` tensor, the tensor ``prepare_varlen_metadata`` was given and
    unchanged since, or equal offsets when the caller's cu_seqlens is on the host); otherwise GL103 in
    every mode but off, on every backend. No device read decides it. Duck-typed metadata without a
    ``cu_seqlens`` field counts as explicit values.
    Strict mode validates values (GL103/GL107). ``rename`` maps these names to other parameter names.
    """
    return _decorator(_build_varlen, fn, rename)


def _build_varlen(fn: Callable, **rename: str) -> Callable:
    function = qualified_name(fn)
    names = ("q", "cu_seqlens", "sequence_lengths", "max_seqlen", "metadata")
    p = bind(fn, names, rename, function=function, must_accept=("q", "cu_seqlens", "sequence_lengths", "max_seqlen"))
    nC, nS, nX = p["cu_seqlens"].param, p["sequence_lengths"].param, p["max_seqlen"].param
    nQ = p["q"].param
    Tensor = torch.Tensor

    def hook(mode: int, q: Any, cu: Any, seq: Any, mx: Any, meta: Any) -> tuple:
        if isinstance(q, Tensor) and q.dim() != 3:
            raise GuardError("GL106", argument=nQ, function=function,
                             expected="a 3-D tensor (total_tokens, num_heads, head_dim)", got=describe(q),
                             fix="Flatten (B, S, H, D) to (B*S, H, D) with q.reshape(-1, H, D) and pass cu_seqlens "
                                 "for the packed sequences.")
        if isinstance(cu, Tensor) and cu.device.type == "meta":
            raise _no_values(nC, cu, function, "GL103")
        if meta is not None and cu is not None and getattr(meta, "cu_seqlens", None) is not None:
            check_plan_source(function, meta, cu, nC)
        if type(meta) is VarlenMetadata:
            plan = meta
        else:
            plan = None
            if meta is not None:
                # Any object with the same fields serves (the engines' own metadata: true lengths are
                # seq_lens there, sequence_lengths the padded ones); missing ones are derived below.
                if seq is None:
                    seq = getattr(meta, "seq_lens", None)
                    if seq is None and getattr(meta, "packed_indptrs", None) is None:
                        seq = getattr(meta, "sequence_lengths", None)
                mx = getattr(meta, "max_seqlen", None) if mx is None else mx
                cu = getattr(meta, "cu_seqlens", None) if cu is None else cu
            if seq is None or mx is None or (cu is not None and not isinstance(cu, Tensor)):
                if cu is None:
                    code, name = (GL101, nS) if seq is None else (GL102, nX)
                    raise GuardError(code.code, argument=name, function=function,
                                     expected="sequence_lengths and max_seqlen, or metadata=prepare_varlen_metadata("
                                              "cu_seqlens, q), or cu_seqlens to derive them from",
                                     got="None, and cu_seqlens is None too")
                hit: Any = MISS  # a VarlenMetadata when cached
                if isinstance(cu, Tensor) and not is_compiling():
                    # prepare()'s own cache lookup, without its call and argument checks
                    hit = cache.get(cu, ("meta", "tokens", False, getattr(q, "shape", None),
                                         getattr(q, "device", None)))
                fresh = False
                if hit is not MISS:
                    plan = hit
                else:
                    if mode == _state.STRICT:
                        prefetch(cu, seq)
                    before = _state.counters.host_reads
                    plan, fresh = prepare(cu, q, layout="tokens", function=function, argument=nC)
                if fresh:
                    if seq is None:
                        _state.note_derived(function, nS, SEQ_DERIVATION, (nC,), fresh=True, host_read=False)
                    if mx is None:
                        _state.note_derived(function, nX, MAX_DERIVATION, (nC,), fresh=True,
                                            host_read=_state.counters.host_reads > before)
                elif seq is None and mx is None:
                    _state.note_cached(SEQ_DERIVATION, MAX_DERIVATION)
                else:
                    _state.note_cached(SEQ_DERIVATION if seq is None else MAX_DERIVATION)
        if plan is not None:
            if seq is None:
                seq = plan.seq_lens
            if mx is None:
                mx = plan.max_seqlen
            if cu is None or not isinstance(cu, Tensor):
                cu = plan.cu_seqlens
        if mode == _state.STRICT:
            check_varlen(function, q=q, cu_seqlens=cu, sequence_lengths=seq, max_seqlen=mx, metadata=plan)
        return q, cu, seq, mx, meta

    fast = ("{metadata} is None and {sequence_lengths} is not None and {max_seqlen} is not None "
            "and isinstance({cu_seqlens}, _guardlint_Tensor)")
    wrapper = make_wrapper(fn, accesses(fn, p), names, hook, fast=fast, env={"Tensor": Tensor})
    wrapper.__guardlint__ = ("varlen", p)
    return wrapper


# -- cuDNN vision attention -------------------------------------------------------------------------

@overload
def guard_cudnn_vision(fn: Callable[_P, _R], **rename: str) -> Callable[_P, _R]: ...
@overload
def guard_cudnn_vision(fn: None = None, **rename: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...
def guard_cudnn_vision(fn: Optional[Callable] = None, **rename: str):
    """Guard ``cudnn_vision_attention(q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None,
    forward_metadata=None, **kwargs)`` (contracts GL101 + GL102), or the engine's own
    ``VisionFlashInferAttention.forward`` (sglang 0.5.23, and 0.5.10 whose forward has no
    ``forward_metadata``).

    Afterwards the function gets what the engine's cuDNN backend reads:

    - a function with a ``forward_metadata`` parameter gets a metadata object with ``packed_indptrs``,
      the padded ``sequence_lengths`` and ``flashinfer_max_seqlen``: the caller's when it has them; one
      re-planned from it when it lacks them (a ``VarlenMetadata`` of another layout: from its host
      offsets; the engine's ``VisionAttentionMetadata`` from ``prepare_vision_attention_metadata``:
      filled in on the device from its ``cu_seqlens`` and host ``max_seqlen``, the engine's own class,
      no read); or ``prepare_varlen_metadata(cu_seqlens, q, layout="cudnn", bucket=True)``;
    - a function without one (sglang 0.5.10) gets ``cu_seqlens`` as packed element indptrs and
      ``sequence_lengths``/``max_seqlen`` in kwargs, from the same plan.

    ``sequence_lengths`` and ``max_seqlen`` the caller passed in kwargs pass through untouched. Each
    plan is cached per cu_seqlens version: one host read per forward, none per layer. cu_seqlens may be
    token offsets or the engine's packed element indptrs. Strict mode validates values (GL103/GL107).
    """
    return _decorator(_build_cudnn, fn, rename)


class _Packed:
    """What planning needs of a ``(bsz, seq_len, H, D)`` q: the shape and device of its packed
    ``(bsz * seq_len, H, D)`` view, without making one (a copy when q is not contiguous)."""

    __slots__ = ("shape", "device")

    def __init__(self, q: torch.Tensor) -> None:
        self.shape = torch.Size((q.shape[0] * q.shape[1], *q.shape[2:]))
        self.device = q.device


def _fill_cudnn(fm: Any, q: Any, function: str, argument: str) -> Any:
    """The engine's metadata without cuDNN fields (``prepare_vision_attention_metadata``): a copy with
    ``packed_indptrs`` ``[qk | v | o]``, padded ``sequence_lengths`` ``(Bp, 1, 1, 1)`` and bucketed
    ``flashinfer_max_seqlen``, built on the device from ``cu_seqlens`` and the host ``max_seqlen``
    (no read), cached per cu_seqlens version. Returns the caller's class (a dataclass copy)."""
    cu = getattr(fm, "cu_seqlens", None)
    mx = getattr(fm, "max_seqlen", None)
    if not isinstance(cu, torch.Tensor) or isinstance(mx, bool) or not isinstance(mx, int):
        raise GuardError("GL107", argument=argument, function=function,
                         expected="forward_metadata with packed_indptrs (the cuDNN backend's element offsets), "
                                  "or with cu_seqlens (a tensor) and max_seqlen (an int) to build them from",
                         got=f"{type(fm).__name__} with cu_seqlens={describe(cu)}, max_seqlen={describe(mx)}",
                         fix="build it once per forward with prepare_flashinfer_cudnn_vision_attention_metadata("
                             "cu_seqlens, device, elem_per_token=H*D) or prepare_varlen_metadata(cu_seqlens, q, "
                             "layout=\"cudnn\", bucket=True)")
    check_index_tensor(cu, argument + ".cu_seqlens", function)
    HD = math.prod(int(d) for d in q.shape[1:])
    tag = ("engine-cudnn", type(fm), HD, mx, q.device)
    if not is_compiling():
        filled = cache.get(cu, tag)
        if filled is not MISS and filled.__dict__.keys() == fm.__dict__.keys() and all(
                getattr(filled, k) is v for k, v in fm.__dict__.items()
                if k not in ("packed_indptrs", "sequence_lengths", "flashinfer_max_seqlen")):
            _state.note_cached(META_DERIVATION.name)
            return filled
    B = cu.numel() - 1
    Bp = bucket_batch_size(B)
    cu32 = cu.to(device=q.device, dtype=torch.int32)
    padded = torch.cat([cu32, cu32[-1:].expand(Bp - B)])
    section = padded * HD
    lengths = padded[1:] - padded[:-1]
    changes = {"packed_indptrs": torch.cat([section] * 3), "sequence_lengths": lengths.view(Bp, 1, 1, 1),
               "flashinfer_max_seqlen": bucket_max_seqlen(mx)}
    filled = _info_copy(fm, **changes)
    _state.note_derived(function, argument, META_DERIVATION.name, (argument + ".cu_seqlens",), fresh=True,
                        host_read=False)
    if not is_compiling():
        cache.put(cu, tag, filled)
    return filled


def _build_cudnn(fn: Callable, **rename: str) -> Callable:
    function = qualified_name(fn)
    names = ("q", "cu_seqlens", "forward_metadata", "sequence_lengths", "max_seqlen")
    p = bind(fn, names, rename, function=function, must_accept=("q", "cu_seqlens", "forward_metadata"))
    nF, nS, nX = p["forward_metadata"].param, p["sequence_lengths"].param, p["max_seqlen"].param
    # sglang 0.5.10's backend has no forward_metadata parameter: it reads packed indptrs from
    # cu_seqlens and sequence_lengths/max_seqlen from kwargs, so the plan is handed over that way.
    as_kwargs = nF not in inspect.signature(fn).parameters
    context = Context(function, GL101.code)
    derive_meta = DERIVERS[META_DERIVATION.name]

    def hook(mode: int, q: Any, cu: Any, fm: Any, seq: Any, mx: Any) -> tuple:
        packed_q = _Packed(q) if getattr(q, "ndim", 3) == 4 else q
        if fm is None and (seq is None or mx is None):
            if cu is None:
                code, name = (GL101, nS) if seq is None else (GL102, nX)
                raise GuardError(code.code, argument=name, function=function,
                                 expected=f"{code.requirement_text()} passed and not None, or cu_seqlens "
                                          "to derive forward_metadata from",
                                 got="None, and cu_seqlens is None too", detail=code.diagnosis.message)
            fm = MISS
            if isinstance(cu, torch.Tensor) and not is_compiling():
                fm = cache.get(cu, ("meta", "cudnn", True, getattr(packed_q, "shape", None),
                                    getattr(packed_q, "device", None)))
            fresh = False
            if fm is MISS:
                if mode == _state.STRICT:
                    prefetch(cu, seq)
                before = _state.counters.host_reads
                fm, fresh = derive_meta(META_DERIVATION, context, (cu, packed_q), packed_q)
            if fresh:
                _state.note_derived(function, nF, META_DERIVATION.name, META_DERIVATION.sources, fresh=True,
                                    host_read=_state.counters.host_reads > before)
            else:
                _state.note_cached(META_DERIVATION.name)
        elif type(fm) is VarlenMetadata and fm.layout != "cudnn":
            # Prepared for other kernels: re-plan from its host offsets (no read).
            fm, fresh = prepare(fm.host_cu_seqlens, packed_q, layout="cudnn", bucket=True, function=function,
                                argument=nF)
            if fresh:
                _state.note_derived(function, nF, META_DERIVATION.name, (nF,), fresh=True, host_read=False)
            else:
                _state.note_cached(META_DERIVATION.name)
        elif fm is not None and getattr(fm, "packed_indptrs", None) is None:
            fm = _fill_cudnn(fm, packed_q, function, nF)
        if mode == _state.STRICT:
            if fm is not None:
                check_varlen(function, q=packed_q, cu_seqlens=cu, metadata=fm, layout="cudnn")
            else:
                check_varlen(function, q=packed_q, cu_seqlens=cu, sequence_lengths=seq, max_seqlen=mx, layout="cudnn")
        if as_kwargs and fm is not None:
            return q, fm.packed_indptrs, None, fm.sequence_lengths, fm.flashinfer_max_seqlen
        return q, cu, fm, seq, mx

    if as_kwargs:
        fast = "{sequence_lengths} is not None and {max_seqlen} is not None and {forward_metadata} is None"
    else:
        fast = ("({forward_metadata} is not None and ({forward_metadata}.__class__ is not _guardlint_VM "
                "or {forward_metadata}.layout == 'cudnn') and {forward_metadata}.packed_indptrs is not None) "
                "or ({forward_metadata} is None and {sequence_lengths} is not None and {max_seqlen} is not None)")
    wrapper = make_wrapper(fn, accesses(fn, p), names, hook, fast=fast, env={"VM": VarlenMetadata})
    wrapper.__guardlint__ = ("cudnn_vision", p)
    return wrapper


# -- segmented LoRA ---------------------------------------------------------------------------------

@overload
def guard_lora(fn: Callable[_P, _R], *, batch_info: str = ..., x: Optional[str] = ..., weights: Optional[str] = ...,
               rank_dim: Optional[int] = ..., rank_stack: int = ..., reads: tuple = ...) -> Callable[_P, _R]: ...
@overload
def guard_lora(fn: None = None, *, batch_info: str = ..., x: Optional[str] = ..., weights: Optional[str] = ...,
               rank_dim: Optional[int] = ..., rank_stack: int = ...,
               reads: tuple = ...) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]: ...
def guard_lora(fn: Optional[Callable] = None, *, batch_info: str = "batch_info", x: Optional[str] = None,
               weights: Optional[str] = "weights", rank_dim: Optional[int] = None, rank_stack: int = 1,
               reads: tuple = ("seg_lens", "max_len")):
    """Guard a segmented LoRA kernel ``kernel(x, weights, batch_info, ...)``.

    ``batch_info`` is duck-typed (fields ``use_cuda_graph, bs, num_segments, seg_indptr, weight_indices,
    lora_ranks, scalings, max_len, seg_lens, permutation``). With both ``max_len`` and ``seg_lens`` None
    the kernel gets a ``dataclasses.replace`` copy (the caller's object is never mutated) with
    ``seg_lens = seg_indptr[1:] - seg_indptr[:-1]`` and ``max_len`` = the longest of the first
    ``num_segments`` segments (CUDA-graph buffers are longer than the live batch), cached per seg_indptr
    version. ``seg_lens`` alone: ``max_len`` is derived (one read, cached). ``max_len`` alone passes.
    ``max_len == 0`` with tokens present: GL203 in strict mode, re-derived in derive mode.

    Options: ``batch_info``/``x``/``weights`` name the parameters (``x`` defaults to the first one, whose
    ``shape[0]`` is the token count); ``rank_dim``: the dimension of ``weights`` that holds the stored
    rank (e.g. 2 for an expand stack ``(num_slots, N, r)``, 1 for a shrink stack ``(num_slots, r, K)``),
    divided by ``rank_stack`` for stacked projections (3 for a fused qkv shrink): strict mode then checks
    ``lora_ranks`` of the used slots against it. Strict mode also checks seg_indptr, weight_indices (in
    ``[0, weights.shape[0])``), seg_lens and max_len over the live segments (GL204).

    ``reads`` names the fields the kernel reads of ``seg_lens`` and ``max_len``: only those are derived.
    A kernel that sizes its grid from the token count (the bundled ones: ``reads=("seg_lens",)``) gets
    ``seg_lens`` (a device op, no read) and no ``max_len``, so the guard adds no host read and works
    under CUDA graph capture.
    """
    if not isinstance(reads, (tuple, list)) or not set(reads) <= {"seg_lens", "max_len"}:
        raise GuardError("GL002", argument="reads", function=None, expected='a tuple of "seg_lens" and/or "max_len"',
                         got=repr(reads))
    return _decorator(_build_lora, fn, dict(batch_info=batch_info, x=x, weights=weights, rank_dim=rank_dim,
                                            rank_stack=rank_stack, reads=tuple(reads)))


def _info_copy(info: Any, **changes: Any) -> Any:
    if dataclasses.is_dataclass(info) and not isinstance(info, type):
        return dataclasses.replace(info, **changes)
    out = copy.copy(info)
    for name, value in changes.items():
        setattr(out, name, value)
    return out


def _snapshot(info: Any) -> Optional[tuple]:
    """The identity of every field of ``info`` and the version of its seg_indptr: when all are the same
    at the next call, the copy made then is still right."""
    fields = getattr(info, "__dict__", None)
    if fields is None:
        return None
    seg_indptr = info.seg_indptr
    version = (seg_indptr._version, seg_indptr.data_ptr()) if isinstance(seg_indptr, torch.Tensor) else None
    return tuple(fields.values()), version


class _Copies:
    """Completed copies of LoRA batch infos, so 60 layers x several kernels make one copy, not hundreds.
    Keyed on the caller's object (weakly: an entry dies with it) and checked against a snapshot."""

    def __init__(self, capacity: int = 16) -> None:
        # hold=False: an info that takes no weakref (__slots__ without __weakref__) is copied at every call
        self.entries = IdentityCache(capacity, hold=False)

    def get(self, info: Any) -> Any:
        entry = self.entries.get((info,))
        if entry is MISS:
            return None
        (fields, version), completed = entry
        now = info.__dict__
        if len(now) != len(fields) or not all(map(operator.is_, now.values(), fields)):
            return None
        seg_indptr = info.seg_indptr
        if version is not None and (seg_indptr._version, seg_indptr.data_ptr()) != version:
            return None
        return completed

    def put(self, info: Any, snapshot: Optional[tuple], completed: Any) -> None:
        if snapshot is not None:
            self.entries.put((info,), None, (snapshot, completed))

    def clear(self) -> None:
        self.entries.clear()


copies = _Copies()


def _build_lora(fn: Callable, *, batch_info: str, x: Optional[str], weights: Optional[str],
                rank_dim: Optional[int], rank_stack: int, reads: tuple = ("seg_lens", "max_len")) -> Callable:
    function = qualified_name(fn)
    first = next(iter(inspect.signature(fn).parameters), None)
    x = x or first
    if x is None:
        raise GuardError("GL002", argument="x", function=function, expected="a kernel taking x first",
                         got="a function without parameters")
    rename = {"batch_info": batch_info, "x": x}
    if weights is not None:
        rename["weights"] = weights
    p = bind(fn, ("x", "weights", "batch_info"), {k: v for k, v in rename.items() if k != v},
             function=function, must_accept=("batch_info",))
    has_weights = weights is not None and p["weights"].accepted and (
        p["weights"].param in inspect.signature(fn).parameters)
    if rank_dim is not None and (type(rank_dim) is not int or not has_weights):
        raise GuardError("GL002", argument="rank_dim", function=function,
                         expected="an int dimension of the kernel's weights parameter", got=repr(rank_dim))
    if type(rank_stack) is not int or rank_stack < 1:
        raise GuardError("GL002", argument="rank_stack", function=function, expected="an int >= 1",
                         got=repr(rank_stack))
    nB = p["batch_info"].param
    context = Context(function, GL201.code, prefix=nB + ".")
    derive_seg_lens = DERIVERS[SEG_LENS_DERIVATION.name]
    derive_max_len = DERIVERS[MAX_LEN_DERIVATION.name]

    def complete(info: Any, x_value: Any, mode: int) -> Any:
        seg_indptr = info.seg_indptr
        num_segments = info.num_segments
        ml, sl = info.max_len, info.seg_lens
        changes = {}
        if type(ml) is int and ml == 0:
            tokens_exist = getattr(x_value, "shape", (0,))[0] > 0
            if tokens_exist and isinstance(seg_indptr, torch.Tensor):
                check_index_tensor(seg_indptr, nB + ".seg_indptr", function, code="GL204")
                if seg_indptr.device.type == "meta":
                    raise _no_values(nB + ".seg_indptr", seg_indptr, function, "GL204")
                host = read_host(seg_indptr, nB + ".seg_indptr", function)
                live = num_segments if type(num_segments) is int and 0 <= num_segments < len(host) else -1
                tokens_exist = host[live] > 0
            if tokens_exist:
                if mode == _state.STRICT:
                    raise GuardError("GL203", argument=nB + ".max_len", function=function,
                                     expected="the longest segment length (> 0: tokens are present)",
                                     got="max_len=0")
                ml = None
        if ml is None:
            if seg_indptr is None:
                raise GuardError(GL201.code, argument=nB + ".seg_indptr", function=function,
                                 expected="max_len or seg_lens, or seg_indptr to derive them from",
                                 got="None for all three", detail=GL201.diagnosis.message)
            if not isinstance(seg_indptr, torch.Tensor):
                raise GuardError("GL204", argument=nB + ".seg_indptr", function=function,
                                 expected="an integer tensor of segment offsets", got=describe(seg_indptr))
            check_index_tensor(seg_indptr, nB + ".seg_indptr", function, code="GL204")
            if seg_indptr.device.type == "meta":
                raise _no_values(nB + ".seg_indptr", seg_indptr, function, "GL204")
            values = {"seg_indptr": seg_indptr, "num_segments": num_segments}
            steps = [(MAX_LEN_DERIVATION, derive_max_len)] if "max_len" in reads else []
            if sl is None and ("seg_lens" in reads or not steps):
                steps.insert(0, (SEG_LENS_DERIVATION, derive_seg_lens))
            for d, impl in steps:
                before = _state.counters.host_reads
                value, fresh = impl(d, context, tuple(values[s] for s in d.sources), None)
                if fresh:
                    _state.note_derived(function, f"{nB}.{d.target}", d.name, d.sources, fresh=True,
                                        host_read=_state.counters.host_reads > before)
                else:
                    _state.note_cached(d.name)
                changes[d.target] = value
        return _info_copy(info, **changes) if changes else info

    def check(info: Any, x_value: Any, w_value: Any) -> None:
        tokens = getattr(x_value, "shape", None)
        if tokens is not None and len(tokens) < 2:
            tokens = None  # not (S, K): the kernel's own check names x (GL205); no token count to compare with
        max_rank = None
        if rank_dim is not None and w_value is not None:
            max_rank = int(w_value.shape[rank_dim]) // rank_stack
        check_lora(function, seg_indptr=info.seg_indptr, num_segments=info.num_segments,
                   weight_indices=info.weight_indices, lora_ranks=getattr(info, "lora_ranks", None),
                   seg_lens=info.seg_lens, max_len=info.max_len,
                   tokens=int(tokens[0]) if tokens is not None else None,
                   num_slots=int(w_value.shape[0]) if getattr(w_value, "shape", None) is not None and len(
                       w_value.shape) else None,
                   max_rank=max_rank, permutation=getattr(info, "permutation", None), prefix=nB + ".")

    def hook(mode: int, x_value: Any, w_value: Any, info: Any) -> tuple:
        if info is None:
            raise GuardError(GL201.code, argument=nB, function=function, expected="a LoRA batch info object",
                             got="None")
        missing = [f for f in ("num_segments", "seg_indptr", "max_len", "seg_lens") if not hasattr(info, f)]
        if missing:
            raise GuardError("GL204", argument=nB, function=function,
                             expected="a LoRA batch info object (fields num_segments, seg_indptr, weight_indices, "
                                      "lora_ranks, scalings, max_len, seg_lens, permutation)",
                             got=f"{describe(info)} without {', '.join(missing)}",
                             fix="Build a LoRABatchInfo (keywords only) instead of a dict or another object.")
        ml = info.max_len
        if ml is not None and (type(ml) is not int or ml > 0):
            new = info  # max_len given: nothing to derive
        else:
            # Strict mode re-checks the caller's own values (max_len == 0 is an error there).
            memo = mode == _state.DERIVE and not is_compiling()
            new = copies.get(info) if memo else None
            if new is not None:
                if info.seg_lens is None:
                    _state.note_cached(SEG_LENS_DERIVATION.name, MAX_LEN_DERIVATION.name)
                else:
                    _state.note_cached(MAX_LEN_DERIVATION.name)
            else:
                if mode == _state.STRICT:
                    prefetch(info.seg_indptr, info.weight_indices, getattr(info, "lora_ranks", None), info.seg_lens,
                             getattr(info, "permutation", None))
                snapshot = _snapshot(info) if memo else None
                new = complete(info, x_value, mode)
                if new is not info and memo:
                    copies.put(info, snapshot, new)
        if mode == _state.STRICT:
            check(new, x_value, w_value if has_weights else None)
        return x_value, w_value, new

    fast = "{batch_info} is not None and ((_guardlint_ml := getattr({batch_info}, 'max_len', None)).__class__ " \
           "is int and _guardlint_ml > 0)"
    wrapper = make_wrapper(fn, accesses(fn, p), ("x", "weights", "batch_info"), hook, fast=fast)
    wrapper.__guardlint__ = ("lora", p)
    return wrapper
