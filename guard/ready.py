"""Ready decorators for the kernels: ``guard_varlen``, ``guard_cudnn_vision`` and ``guard_lora``.

Each is the catalog's contract (GL101/GL102, GL201/GL203/GL204) specialised for one kernel family, so
its fast path is a few attribute loads: a prepared call adds well under a microsecond.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, Callable, Optional

import torch

from guardlint.contracts import get as get_contract

from . import _state
from ._cache import MISS, cache
from .decorator import NOT_POSITIONAL, bind, qualified_name
from .derive import Context, DERIVERS
from .errors import GuardError, describe
from .metadata import VarlenMetadata, check_index_tensor, is_compiling, prepare, read_host
from .validate import check_lora, check_varlen

GL101, GL102, GL201 = get_contract("GL101"), get_contract("GL102"), get_contract("GL201")
# Derivation names for stats and events come from the catalog, not from here.
SEQ_DERIVATION = GL101.derivation_for("sequence_lengths").name
MAX_DERIVATION = GL102.derivation_for("max_seqlen").name
META_DERIVATION = GL101.derivation_for("forward_metadata")
SEG_LENS_DERIVATION = GL201.derivation_for("seg_lens")
MAX_LEN_DERIVATION = GL201.derivation_for("max_len")


def _decorator(build: Callable, fn: Optional[Callable], options: dict):
    """Allow both ``@guard_x`` and ``@guard_x(option=...)``."""
    if fn is not None:
        return build(fn, **options)
    return lambda f: build(f, **options)


def _replace(args: tuple, index: int, value: Any) -> tuple:
    return args[:index] + (value,) + args[index + 1:]


# -- varlen attention -------------------------------------------------------------------------------

def guard_varlen(fn: Optional[Callable] = None, **rename: str):
    """Guard ``varlen_attention(q, k, v, cu_seqlens, *, sequence_lengths=None, max_seqlen=None,
    metadata=None, ...)``.

    Afterwards the function always gets ``max_seqlen`` (a Python int) and ``sequence_lengths`` (int32,
    on q's device), and a tensor ``cu_seqlens``: taken from ``metadata`` when one was given (values the
    caller passed explicitly win), else derived from ``cu_seqlens`` with one host read per distinct
    tensor version (none for a host list). ``metadata`` itself is passed only when the caller gave one.
    Strict mode validates values (GL103/GL107). ``rename`` maps these names to other parameter names.
    """
    return _decorator(_build_varlen, fn, rename)


def _build_varlen(fn: Callable, **rename: str) -> Callable:
    function = qualified_name(fn)
    p = bind(fn, ("q", "cu_seqlens", "sequence_lengths", "max_seqlen", "metadata"), rename, function=function,
             must_accept=("q", "cu_seqlens", "sequence_lengths", "max_seqlen"))
    iQ, nQ = p["q"].index, p["q"].param
    iC, nC = p["cu_seqlens"].index, p["cu_seqlens"].param
    iS, nS = p["sequence_lengths"].index, p["sequence_lengths"].param
    iX, nX = p["max_seqlen"].index, p["max_seqlen"].param
    iM, nM = p["metadata"].index, p["metadata"].param
    Tensor = torch.Tensor

    def put(args: tuple, kwargs: dict, index: int, name: str, value: Any) -> tuple:
        if index < len(args):
            return _replace(args, index, value)
        kwargs[name] = value
        return args

    def slow(args: tuple, kwargs: dict, mode: int) -> Any:
        n = len(args)
        q = args[iQ] if iQ < n else kwargs.get(nQ)
        cu = args[iC] if iC < n else kwargs.get(nC)
        seq = args[iS] if iS < n else kwargs.get(nS)
        mx = args[iX] if iX < n else kwargs.get(nX)
        meta = args[iM] if iM < n else kwargs.get(nM)
        plan = meta if isinstance(meta, VarlenMetadata) else None
        if meta is not None and plan is None:
            # Any object with the same fields serves; missing ones are derived below.
            seq = getattr(meta, "sequence_lengths", None) if seq is None else seq
            mx = getattr(meta, "max_seqlen", None) if mx is None else mx
            cu = getattr(meta, "cu_seqlens", None) if cu is None else cu
        if plan is None and (seq is None or mx is None or (cu is not None and not isinstance(cu, Tensor))):
            if cu is None:
                code, name = (GL101, nS) if seq is None else (GL102, nX)
                raise GuardError(code.code, argument=name, function=function,
                                 expected="sequence_lengths and max_seqlen, or metadata="
                                          "prepare_varlen_metadata(cu_seqlens, q), or cu_seqlens to derive them",
                                 got="None, and cu_seqlens is None too")
            before = _state.counters.host_reads
            plan, fresh = prepare(cu, q, layout="tokens", function=function, argument=nC)
            read = _state.counters.host_reads > before
            if seq is None:
                _state.note_derived(function, nS, SEQ_DERIVATION, (nC,), fresh=fresh, host_read=False)
            if mx is None:
                _state.note_derived(function, nX, MAX_DERIVATION, (nC,), fresh=fresh, host_read=read)
        if plan is not None:
            seq = plan.sequence_lengths if seq is None else seq
            mx = plan.max_seqlen if mx is None else mx
            if cu is None or not isinstance(cu, Tensor):
                cu = plan.cu_seqlens
        if mode == _state.STRICT:
            check_varlen(function, q=q, cu_seqlens=cu, sequence_lengths=seq, max_seqlen=mx, metadata=plan)
        args = put(args, kwargs, iC, nC, cu)
        args = put(args, kwargs, iS, nS, seq)
        args = put(args, kwargs, iX, nX, mx)
        return fn(*args, **kwargs)

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        mode = _state.current
        if not mode:
            return fn(*args, **kwargs)
        n = len(args)
        meta = args[iM] if iM < n else kwargs.get(nM)
        if type(meta) is VarlenMetadata and mode != _state.STRICT:
            # Prepared plan: fill what the caller left out, no host work.
            if (args[iS] if iS < n else kwargs.get(nS)) is None:
                if iS < n:
                    args = _replace(args, iS, meta.sequence_lengths)
                else:
                    kwargs[nS] = meta.sequence_lengths
            if (args[iX] if iX < n else kwargs.get(nX)) is None:
                if iX < n:
                    args = _replace(args, iX, meta.max_seqlen)
                else:
                    kwargs[nX] = meta.max_seqlen
            if not isinstance(args[iC] if iC < n else kwargs.get(nC), Tensor):
                if iC < n:
                    args = _replace(args, iC, meta.cu_seqlens)
                else:
                    kwargs[nC] = meta.cu_seqlens
            return fn(*args, **kwargs)
        if (meta is None and mode != _state.STRICT
                and (args[iS] if iS < n else kwargs.get(nS)) is not None
                and (args[iX] if iX < n else kwargs.get(nX)) is not None
                and isinstance(args[iC] if iC < n else kwargs.get(nC), Tensor)):
            return fn(*args, **kwargs)
        return slow(args, kwargs, mode)

    guarded.__guardlint__ = ("varlen", p)
    return guarded


# -- cuDNN vision attention -------------------------------------------------------------------------

def guard_cudnn_vision(fn: Optional[Callable] = None, **rename: str):
    """Guard ``cudnn_vision_attention(q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None,
    forward_metadata=None, **kwargs)`` (contracts GL101 + GL102).

    Afterwards the function gets ``forward_metadata``: the caller's (any object with ``packed_indptrs``,
    or a ``VarlenMetadata``; one prepared with layout "tokens" is re-planned for cuDNN from its host
    offsets, no read), or, when the caller passed ``sequence_lengths`` and ``max_seqlen`` in kwargs, those
    pass through untouched, or else ``prepare_varlen_metadata(cu_seqlens, q, layout="cudnn",
    bucket=True)``, cached per cu_seqlens version. cu_seqlens may be token offsets or the engine's
    packed element indptrs. Strict mode validates values (GL103/GL107).
    """
    return _decorator(_build_cudnn, fn, rename)


def _build_cudnn(fn: Callable, **rename: str) -> Callable:
    function = qualified_name(fn)
    p = bind(fn, ("q", "cu_seqlens", "forward_metadata", "sequence_lengths", "max_seqlen"), rename,
             function=function, must_accept=("q", "cu_seqlens", "forward_metadata"))
    iQ, nQ = p["q"].index, p["q"].param
    iC, nC = p["cu_seqlens"].index, p["cu_seqlens"].param
    iF, nF = p["forward_metadata"].index, p["forward_metadata"].param
    iS, nS = p["sequence_lengths"].index, p["sequence_lengths"].param
    iX, nX = p["max_seqlen"].index, p["max_seqlen"].param

    def slow(args: tuple, kwargs: dict, mode: int) -> Any:
        n = len(args)
        q = args[iQ] if iQ < n else kwargs.get(nQ)
        cu = args[iC] if iC < n else kwargs.get(nC)
        fm = args[iF] if iF < n else kwargs.get(nF)
        seq = args[iS] if iS < n else kwargs.get(nS)
        mx = args[iX] if iX < n else kwargs.get(nX)
        if fm is None and (seq is None or mx is None):
            if cu is None:
                code, name = (GL101, nS) if seq is None else (GL102, nX)
                raise GuardError(code.code, argument=name, function=function,
                                 expected=f"{code.requirement_text()} passed and not None, or cu_seqlens "
                                          "to derive forward_metadata from",
                                 got="None, and cu_seqlens is None too", detail=code.diagnosis.message)
            before = _state.counters.host_reads
            fm, fresh = DERIVERS[META_DERIVATION.name](
                {"cu_seqlens": cu, "q": q}, META_DERIVATION, Context(function, GL101.code))
            _state.note_derived(function, nF, META_DERIVATION.name, META_DERIVATION.sources, fresh=fresh,
                                host_read=_state.counters.host_reads > before)
        elif type(fm) is VarlenMetadata and fm.layout != "cudnn":
            fm, fresh = prepare(fm.host_cu_seqlens, q, layout="cudnn", bucket=True, function=function,
                                argument=nF)
            _state.note_derived(function, nF, META_DERIVATION.name, (nF,), fresh=fresh, host_read=False)
        if mode == _state.STRICT:
            if fm is not None:
                check_varlen(function, q=q, cu_seqlens=cu, metadata=fm, layout="cudnn")
            else:
                check_varlen(function, q=q, cu_seqlens=cu, sequence_lengths=seq, max_seqlen=mx, layout="cudnn")
        if fm is not None:
            if iF < n:
                args = _replace(args, iF, fm)
            else:
                kwargs[nF] = fm
        return fn(*args, **kwargs)

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        mode = _state.current
        if not mode:
            return fn(*args, **kwargs)
        if mode != _state.STRICT:
            n = len(args)
            fm = args[iF] if iF < n else kwargs.get(nF)
            if fm is not None:
                if type(fm) is not VarlenMetadata or fm.layout == "cudnn":
                    return fn(*args, **kwargs)
            elif ((args[iS] if iS < n else kwargs.get(nS)) is not None
                  and (args[iX] if iX < n else kwargs.get(nX)) is not None):
                return fn(*args, **kwargs)
        return slow(args, kwargs, mode)

    guarded.__guardlint__ = ("cudnn_vision", p)
    return guarded


# -- segmented LoRA ---------------------------------------------------------------------------------

def guard_lora(fn: Optional[Callable] = None, *, batch_info: str = "batch_info", x: Optional[str] = None,
               weights: Optional[str] = "weights", rank_dim: Optional[int] = None, rank_stack: int = 1):
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
    """
    return _decorator(_build_lora, fn, dict(batch_info=batch_info, x=x, weights=weights, rank_dim=rank_dim,
                                            rank_stack=rank_stack))


def _info_copy(info: Any, **changes: Any) -> Any:
    if dataclasses.is_dataclass(info) and not isinstance(info, type):
        return dataclasses.replace(info, **changes)
    out = copy.copy(info)
    for name, value in changes.items():
        setattr(out, name, value)
    return out


def _build_lora(fn: Callable, *, batch_info: str, x: Optional[str], weights: Optional[str],
                rank_dim: Optional[int], rank_stack: int) -> Callable:
    import inspect

    function = qualified_name(fn)
    first = next(iter(inspect.signature(fn).parameters), None)
    x = x or first
    if x is None:
        raise GuardError("GL001", argument="x", function=function, expected="a kernel taking x first",
                         got="a function without parameters")
    names = {"batch_info": batch_info, "x": x}
    if weights is not None:
        names["weights"] = weights
    p = bind(fn, names, {k: v for k, v in names.items() if k != v}, function=function,
             must_accept=("batch_info",))
    if weights is not None and p["weights"].index == NOT_POSITIONAL and not p["weights"].accepted:
        p.pop("weights")
    if rank_dim is not None and (type(rank_dim) is not int or "weights" not in p):
        raise GuardError("GL001", argument="rank_dim", function=function,
                         expected="an int dimension of the kernel's weights parameter", got=repr(rank_dim))
    if type(rank_stack) is not int or rank_stack < 1:
        raise GuardError("GL001", argument="rank_stack", function=function, expected="an int >= 1",
                         got=repr(rank_stack))
    iB, nB = p["batch_info"].index, p["batch_info"].param
    px, pw = p["x"], p.get("weights")
    seg_ctx = Context(function, GL201.code)

    def derive(info: Any, x_value: Any, mode: int) -> Any:
        seg_indptr = info.seg_indptr
        num_segments = info.num_segments
        ml, sl = info.max_len, info.seg_lens
        changes = {}
        if type(ml) is int and ml == 0:
            tokens_exist = getattr(x_value, "shape", (0,))[0] > 0
            if tokens_exist and seg_indptr is not None:
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
            values = {"seg_indptr": seg_indptr, "num_segments": num_segments}
            if sl is None:
                before = _state.counters.host_reads
                sl, fresh = DERIVERS[SEG_LENS_DERIVATION.name](values, SEG_LENS_DERIVATION, seg_ctx)
                _state.note_derived(function, nB + ".seg_lens", SEG_LENS_DERIVATION.name,
                                    SEG_LENS_DERIVATION.sources, fresh=fresh,
                                    host_read=_state.counters.host_reads > before)
                changes["seg_lens"] = sl
            before = _state.counters.host_reads
            ml, fresh = DERIVERS[MAX_LEN_DERIVATION.name](values, MAX_LEN_DERIVATION, seg_ctx)
            _state.note_derived(function, nB + ".max_len", MAX_LEN_DERIVATION.name, MAX_LEN_DERIVATION.sources,
                                fresh=fresh, host_read=_state.counters.host_reads > before)
            changes["max_len"] = ml
        return _info_copy(info, **changes) if changes else info

    def strict(info: Any, x_value: Any, w_value: Any) -> None:
        tokens = getattr(x_value, "shape", None)
        max_rank = None
        if rank_dim is not None and w_value is not None:
            max_rank = int(w_value.shape[rank_dim]) // rank_stack
        check_lora(function, seg_indptr=info.seg_indptr, num_segments=info.num_segments,
                   weight_indices=info.weight_indices, lora_ranks=getattr(info, "lora_ranks", None),
                   seg_lens=info.seg_lens, max_len=info.max_len,
                   tokens=int(tokens[0]) if tokens is not None and len(tokens) else None,
                   num_slots=int(w_value.shape[0]) if getattr(w_value, "shape", None) is not None else None,
                   max_rank=max_rank, prefix=nB + ".")

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        mode = _state.current
        if not mode:
            return fn(*args, **kwargs)
        n = len(args)
        info = args[iB] if iB < n else kwargs.get(nB)
        if info is None:
            raise GuardError(GL201.code, argument=nB, function=function,
                             expected="a LoRA batch info object", got="None")
        ml = info.max_len
        if mode != _state.STRICT and ml is not None and (ml.__class__ is not int or ml > 0):
            return fn(*args, **kwargs)
        x_value = px.get(args, kwargs)
        new = derive(info, x_value, mode)
        if mode == _state.STRICT:
            strict(new, x_value, pw.get(args, kwargs) if pw is not None else None)
        if new is not info:
            if iB < n:
                args = _replace(args, iB, new)
            else:
                kwargs[nB] = new
        return fn(*args, **kwargs)

    guarded.__guardlint__ = ("lora", p)
    return guarded
