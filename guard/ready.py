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
from typing import Any, Callable, Optional, ParamSpec, Sequence, TypeVar, overload

import torch

from guardlint.contracts import get as get_contract

from . import _cache, _state
from . import metadata as _metadata
from ._cache import _VALUES, _VERSION, MISS, IdentityCache, cache, unchanged
from ._codegen import PREFIX, accesses, make_wrapper
from .decorator import Param, bind, qualified_name
from .derive import Context, DERIVERS
from .errors import GuardError, describe
from .metadata import (VarlenMetadata, bucket_batch_size, bucket_max_seqlen, check_index_tensor, check_prefix_sums,
                       host_copy, host_sequence, is_compiling, on_host, prepare, read_host, token_offsets)
from .validate import (check_lora, check_max_seqlen, check_plan_facts, check_plan_source, check_varlen,
                       prefetch)

# A guarded function that declares this keyword-only parameter gets True there when the guard proved, at this
# call, that the max_seqlen it receives is at least the longest sequence of the cu_seqlens it receives
# (from values read or compared now); False otherwise (mode off, or a caller's value on a path with no read).
# Whatever the caller passes is overwritten. A kernel may size its launch by max_seqlen only when it is True.
VERIFIED = "max_seqlen_verified"
LENGTHS_FIX = ("Pass cu_seqlens[1:] - cu_seqlens[:-1] of the same offsets (computed once per batch), or leave "
               "sequence_lengths out and let the guard derive it.")

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



def _plan_trusted(function: str, plan: VarlenMetadata, q: Any, argument: str, code: str, fit: Optional[bool],
                  compiling: bool) -> bool:
    """Whether a prepared plan's facts hold for this call: prepared for q's token count (else ``code``), from
    this call's offsets (``fit``, from ``check_plan_source``), and, when the guard did not build it (hand-made or
    ``dataclasses.replace``-d), its own facts checked: never taken as validated. Never while torch.compile traces."""
    q_shape = getattr(q, "shape", None)
    if not compiling and q_shape is not None and len(q_shape) and plan.total_tokens != q_shape[0]:
        raise GuardError(code, argument=argument, function=function,
                         expected=f"metadata prepared for q's token count T={q_shape[0]}",
                         got=f"metadata for {describe(plan.total_tokens)} tokens (a stale plan?)")
    if compiling:
        return False
    if plan._origin is None:
        return check_plan_facts(function, plan, q, argument) and fit is True
    return fit is True

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


def _flag_param(fn: Callable) -> Optional[str]:
    """``VERIFIED`` when ``fn`` declares it as a named parameter (the guard then always sets it), else None."""
    p = inspect.signature(fn).parameters.get(VERIFIED)
    if p is None or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
        return None
    return VERIFIED


def _lengths(offsets: Sequence[int]) -> tuple:
    return tuple(offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1))


def _fresh(meta: Any, cu: Any, q: Any) -> bool:
    """Was ``meta`` prepared from this very ``cu`` (unchanged since, ``_cache``), for a q of this shape, with its own
    tensors not written since? The prepared path's whole check, inlined into the wrappers."""
    fast = meta._fast
    if fast is None or fast[0]() is not cu or not _cache.enabled:
        return False
    fp = fast[1]
    # unchanged(cu, fp), with its two common kinds inline: a device tensor (version counter and data pointer) and a
    # few host ints. Sizes, strides and dtype are not compared here: with the counter and pointer kept they change
    # only by a ``.data =`` reassignment (set_, resize_, as_strided_ and the in-place view ops bump the version),
    # which no version check sees (the cache's documented blind spot; set_cache(False) re-derives every call for
    # callers who write that way).
    kind = fp[0]
    if kind == _VERSION:
        if cu._version != fp[1] or cu.data_ptr() != fp[4]:
            return False
    elif not (cu.tolist() == fp[1] if kind == _VALUES else unchanged(cu, fp)):
        return False
    return fast[2]._version == fast[3] and q.__class__ is torch.Tensor and q.shape == fast[4]


def _fresh_inline(meta: str, cu: str, q: str) -> str:
    """``_fresh(meta, cu, q)`` as an expression for the generated wrappers, its common case (device offsets: a
    version counter and a data pointer) written out: no call frame, no global lookups. Other fingerprints (host
    offsets, by contents) go through ``_fresh``. The placeholders' names are the wrapper's own locals."""
    f, fp = f"{PREFIX}f", f"{PREFIX}fp"
    return (f"({f} := {meta}._fast) is not None and {f}[0]() is {cu} and {PREFIX}cache.enabled "
            f"and (({fp} := {f}[1])[0] == {_cache._VERSION} and {cu}._version == {fp}[1] "
            f"and {cu}.data_ptr() == {fp}[4] and {f}[2]._version == {f}[3] and {q}.__class__ is {PREFIX}Tensor "
            f"and {q}.shape == {f}[4] or {fp}[0] != {_cache._VERSION} and {PREFIX}fresh({meta}, {cu}, {q}))")


def _longest(plan: Any) -> int:
    """The longest sequence of a plan: its max_seqlen where the guard built it, else from its host offsets
    (already checked by ``check_plan_facts``)."""
    if type(plan) is VarlenMetadata and plan._origin is not None:
        return plan.max_seqlen
    return max(_lengths(plan.host_cu_seqlens) or [0])


def _free_facts(cu: Any, q: Any, layout: str, function: str, argument: str) -> Optional[tuple]:
    """(lengths, longest) of host offsets (a CPU tensor: read uncounted, cached while unchanged), validated for
    q's shape as ``prepare`` validates them; the cuDNN layout takes element offsets too (lengths then padded)."""
    shape = getattr(q, "shape", None)
    tag = ("facts", layout, shape)
    facts = cache.get(cu, tag)
    if facts is MISS:
        if _metadata.capturing(cu.device):  # a host tensor never is; the tests' simulated capture says so
            return None
        T = HD = None
        if shape is not None and len(shape) >= 2:
            T, HD = int(shape[0]), math.prod(int(d) for d in shape[1:])
        check_index_tensor(cu, argument, function)
        host = read_host(cu, argument, function, counted=False)
        offsets = token_offsets(host, layout=layout if T is not None else "tokens", total_tokens=T,
                                elements_per_token=HD, argument=argument, function=function)
        lengths = _lengths(offsets)
        facts = (lengths, max(lengths or [0]))
        cache.put(cu, tag, facts)
    return facts


def _check_given_lengths(function: str, seq: Any, lengths: tuple, argument: str, padded: bool) -> None:
    """A caller's ``sequence_lengths`` against the true lengths, where that costs no device read (a host
    tensor); zero padding allowed on the cuDNN path (and trailing zero-length sequences either way)."""
    if isinstance(seq, (list, tuple)):
        given: Any = host_sequence(seq, argument, function)
    else:
        given = cache.get(seq, "flat") if seq.__class__ is torch.Tensor else MISS
    if given is MISS:
        if not on_host(seq):
            return
        if seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool or \
                seq.layout is not torch.strided:
            raise GuardError("GL103", argument=argument, function=function, expected="an integer tensor",
                             got=describe(seq))
        given = _host_values(seq, argument, function)
        if given is None:
            return
        cache.put(seq, "flat", given)
    if given == lengths:
        return
    n = min(len(lengths), len(given))
    if given[:n] != lengths[:n] or (not padded and len(given) != len(lengths)) or any(given[n:]) or any(lengths[n:]):
        bad = next((i for i in range(n) if given[i] != lengths[i]), n)
        raise GuardError("GL103", argument=argument, function=function,
                         expected="cu_seqlens[1:] - cu_seqlens[:-1]" + (" (zero-padded)" if padded else ""),
                         got=f"{describe(seq)} with a different length at index {bad}", fix=LENGTHS_FIX)


def _check_given_max(function: str, mx: Any, longest: int, argument: str) -> bool:
    """A caller's ``max_seqlen`` against the longest sequence: GL103 below it; True when checked."""
    if type(mx) is not int:
        return False
    check_max_seqlen(function, mx, longest, argument=argument)
    return True


def _given_beside_plan(function: str, plan: Any, seq: Any, mx: Any, nS: str, nX: str, padded: bool) -> bool:
    """A caller's values beside a plan: ``max_seqlen`` against its longest sequence, ``sequence_lengths`` (on the
    host) against its lengths. True when a max_seqlen was checked."""
    checked = _check_given_max(function, mx, _longest(plan), nX) if mx is not None else False
    if seq is not None and seq is not plan.seq_lens and seq is not plan.sequence_lengths:
        _check_given_lengths(function, seq, _lengths(plan.host_cu_seqlens), nS, padded)
    return checked


def _build_varlen(fn: Callable, **rename: str) -> Callable:
    function = qualified_name(fn)
    names: tuple = ("q", "cu_seqlens", "sequence_lengths", "max_seqlen", "metadata")
    p = bind(fn, names, rename, function=function, must_accept=("q", "cu_seqlens", "sequence_lengths", "max_seqlen"))
    nC, nS, nX = p["cu_seqlens"].param, p["sequence_lengths"].param, p["max_seqlen"].param
    nQ, nM = p["q"].param, p["metadata"].param
    flag = _flag_param(fn)
    if flag is not None:
        names += (flag,)
        p[flag] = Param(flag, flag, True)
    Tensor = torch.Tensor

    def prepared(q: Any, cu: Any, seq: Any, mx: Any, meta: Any) -> tuple:
        """Metadata prepared from this very cu_seqlens, which is unchanged since: its facts hold."""
        verified = _given_beside_plan(function, meta, seq, mx, nS, nX, False) if mx is not None else True
        if mx is None:
            _given_beside_plan(function, meta, seq, None, nS, nX, False)
            mx = meta.max_seqlen
        if seq is None:
            seq = meta.seq_lens
        if flag is not None:
            return q, cu, seq, mx, meta, verified
        return q, cu, seq, mx, meta

    VM, DERIVE, cache_module = VarlenMetadata, _state.DERIVE, _cache
    # Values passed with host offsets, checked once while cu_seqlens and sequence_lengths are unchanged.
    checked_values = IdentityCache(16)

    def hook(mode: int, q: Any, cu: Any, seq: Any, mx: Any, meta: Any, *_flag: Any) -> tuple:
        # The prepared path, in the fewest steps: the cu_seqlens it was prepared from, unchanged (``_cache``).
        if meta.__class__ is VM and mode == DERIVE and (fast := meta._fast) is not None and fast[0]() is cu \
                and cache_module.enabled and unchanged(cu, fast[1]) and fast[2]._version == fast[3] \
                and q.__class__ is Tensor and q.shape == fast[4]:
            if seq is None and mx is None:
                return (q, cu, meta.seq_lens, meta.max_seqlen, meta, True) if flag is not None else \
                    (q, cu, meta.seq_lens, meta.max_seqlen, meta)
            return prepared(q, cu, seq, mx, meta)
        if meta is None and seq is None and mx is None and mode == DERIVE and cu.__class__ is Tensor \
                and q.__class__ is Tensor and cache_module.enabled and q.dim() == 3 and not is_compiling():
            # cu_seqlens alone, its plan already derived for this q's shape and unchanged since: the plan's values
            # (the lookup the path below makes, without the checks the plan passed when it was made).
            known = cache.get(cu, ("meta", "tokens", False, q.shape, q.device))
            if known is not MISS:
                _state.note_cached(SEQ_DERIVATION, MAX_DERIVATION)
                return (q, cu, known.seq_lens, known.max_seqlen, meta, True) if flag is not None else \
                    (q, cu, known.seq_lens, known.max_seqlen, meta)
        if meta is None and mode == DERIVE and mx.__class__ is int and seq.__class__ is Tensor \
                and cu.__class__ is Tensor and q.__class__ is Tensor and cu.is_cpu \
                and checked_values.get((cu, seq), (mx, q.shape)) is True:
            return (q, cu, seq, mx, meta, True) if flag is not None else (q, cu, seq, mx, meta)
        if not _cache.enabled:
            _cache.new_call()
        if isinstance(q, Tensor) and q.dim() != 3:
            raise GuardError("GL106", argument=nQ, function=function,
                             expected="a 3-D tensor (total_tokens, num_heads, head_dim)", got=describe(q),
                             fix="Flatten (B, S, H, D) to (B*S, H, D) with q.reshape(-1, H, D) and pass cu_seqlens "
                                 "for the packed sequences.")
        if isinstance(cu, Tensor) and cu.is_meta:
            raise _no_values(nC, cu, function, "GL103")
        if isinstance(cu, Tensor) and cu.layout is not torch.strided:
            check_index_tensor(cu, nC, function)  # a sparse tensor: no kernel indexes it (no read needed to say so)
        plan: Any = None
        trusted = False  # the plan's facts hold for the cu_seqlens this call will use, proven now
        derived = False  # the plan is the guard's own, made from this call's cu_seqlens
        facts: Optional[tuple] = None  # (lengths, longest) of host cu_seqlens, where there is no plan
        mx_name, seq_name = nX, nS
        # While torch.compile traces, values known only as the graph runs are not checked here (a GuardError
        # raised in a trace cannot be traced): strict mode checks them in the graph (validate.compiled_check_varlen).
        compiling = is_compiling()
        if type(meta) is VarlenMetadata:
            plan = meta
            trusted = _plan_trusted(function, meta, q, nM, "GL103", check_plan_source(function, meta, cu, nC),
                                    compiling)
        elif meta is not None:
            # Any object with the same fields serves (the engines' own metadata: true lengths are
            # seq_lens there, sequence_lengths the padded ones); missing ones are derived below.
            if seq is None:
                seq = getattr(meta, "seq_lens", None)
                if seq is None and getattr(meta, "packed_indptrs", None) is None:
                    seq = getattr(meta, "sequence_lengths", None)
                seq_name = f"{nM}.seq_lens"
            if mx is None:
                mx = getattr(meta, "max_seqlen", None)
                mx_name = f"{nM}.max_seqlen"
            planned = getattr(meta, "cu_seqlens", None)
            if cu is not None and planned is not None:
                check_plan_source(function, meta, cu, nC)
            elif cu is None:
                cu = planned
        if plan is None:
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
                trusted = derived = True
            elif isinstance(cu, Tensor) and cu.is_cpu and not compiling and cu.dim() == 1 and \
                    cu.layout is torch.strided and cu.dtype in (torch.int32, torch.int64):
                # (Offsets of another kind are the kernel's to refuse, before any read: GL106.)
                # Every value was passed, and cu_seqlens is on the host: checking them costs no device read.
                if mode == _state.STRICT:
                    prefetch(cu, seq)
                facts = _free_facts(cu, q, "tokens", function, nC)
        verified = False
        if plan is not None:
            checked = _given_beside_plan(function, plan, seq, mx, seq_name, mx_name, False) \
                if (seq is not None or mx is not None) and not compiling else False
            if mx is not None:
                verified = checked and trusted
            else:
                mx = plan.max_seqlen
                verified = trusted
            if seq is None:
                seq = plan.seq_lens
            if cu is None or not isinstance(cu, Tensor):
                cu = plan.cu_seqlens
        elif facts is not None:
            lengths, longest = facts
            verified = type(mx) is int and (mx >= longest or _check_given_max(function, mx, longest, mx_name))
            _check_given_lengths(function, seq, lengths, seq_name, False)
            if verified and meta is None and seq.__class__ is Tensor and q.__class__ is Tensor and seq.is_cpu:
                checked_values.put((cu, seq), (mx, q.shape), True)
        if mode == _state.STRICT:
            verified = check_varlen(function, q=q, cu_seqlens=cu, sequence_lengths=seq, max_seqlen=mx, metadata=plan,
                                    metadata_name=nM, derived=derived) or verified
        if flag is not None:
            return q, cu, seq, mx, meta, verified
        return q, cu, seq, mx, meta

    fast = ("{metadata} is None and {sequence_lengths} is not None and {max_seqlen} is not None "
            "and isinstance({cu_seqlens}, _guardlint_Tensor) and not {cu_seqlens}.is_cpu")
    # Metadata prepared from this very cu_seqlens, unchanged: its values, with no hook call.
    prepared_path = ("{metadata}.__class__ is _guardlint_VM and {sequence_lengths} is None and {max_seqlen} is None "
                     "and " + _fresh_inline("{metadata}", "{cu_seqlens}", "{q}"),
                     {"sequence_lengths": "{metadata}.seq_lens", "max_seqlen": "{metadata}.max_seqlen",
                      **({flag: "True"} if flag else {})})
    wrapper = make_wrapper(fn, accesses(fn, p), names, hook, fast=fast,
                           env={"Tensor": Tensor, "VM": VarlenMetadata, "fresh": _fresh, "cache": _cache},
                           reset=(flag,) if flag else (), prepared=prepared_path)
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
    filled = _info_copy(fm, changes, argument, function)
    _state.note_derived(function, argument, META_DERIVATION.name, (argument + ".cu_seqlens",), fresh=True,
                        host_read=False)
    if not is_compiling():
        cache.put(cu, tag, filled)
    return filled


def _on_host_or_sequence(value: Any) -> bool:
    """Offsets whose values cost no device read: a CPU tensor, a list or a tuple."""
    return (isinstance(value, torch.Tensor) and value.is_cpu) or isinstance(value, (list, tuple))


def _host_values(value: Any, argument: str, function: str) -> Optional[tuple]:
    """The values of host offsets (a CPU tensor, list or tuple), flat; None for a device tensor."""
    if isinstance(value, torch.Tensor):
        if is_compiling() or not value.is_cpu:
            return None
        if value.dim() != 1:
            return tuple(value.reshape(-1).tolist())  # the engines' (Bp, 1, 1, 1) lengths: a host view, no sync
        return host_copy(value, argument, function)
    if isinstance(value, (list, tuple)):
        return host_sequence(value, argument, function)
    return None


def _token_reader(q: Any, function: str, argument: str) -> Optional[Callable[..., tuple]]:
    """Host offsets -> token offsets for q's shape (token offsets, or the cuDNN path's element offsets)."""
    shape = getattr(q, "shape", None)
    if shape is None or len(shape) < 2:
        return None

    def to_tokens(host: tuple, name: str = argument) -> tuple:
        HD = math.prod(int(d) for d in shape[1:])
        return token_offsets(host, layout="cudnn", total_tokens=int(shape[0]), elements_per_token=HD, argument=name,
                             function=function)

    return to_tokens


def _compare_offsets(function: str, given: tuple, offsets: tuple, argument: str) -> None:
    """GL103 unless ``given`` (token offsets, maybe padded with zero-length sequences) are ``offsets``."""
    if given[:len(offsets)] != offsets or any(v != offsets[-1] for v in given[len(offsets):]):
        raise GuardError("GL103", argument=argument, function=function,
                         expected="the offsets forward_metadata describes", got="other offsets",
                         fix="Build forward_metadata from this cu_seqlens (once per batch), or pass only one of them.")


def _check_engine_metadata(function: str, fm: Any, cu: Any, nF: str, nC: str) -> bool:
    """The engine's metadata without cuDNN fields (``cu_seqlens`` and a host ``max_seqlen``): what can be checked
    with no device read. True when its max_seqlen was checked against its offsets."""
    own = getattr(fm, "cu_seqlens", None)
    offsets = _host_values(own, nF + ".cu_seqlens", function) if isinstance(own, torch.Tensor) else None
    if offsets is None:
        return False
    check_prefix_sums(offsets, nF + ".cu_seqlens", function)
    if cu is not None and cu is not own:
        given = _host_values(cu, nC, function)
        if given is not None:
            _compare_offsets(function, given, offsets, nC)
    mx = getattr(fm, "max_seqlen", None)
    lengths = [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]
    if type(mx) is int:
        check_max_seqlen(function, mx, max(lengths, default=0), lengths, argument=nF + ".max_seqlen")
    seq = getattr(fm, "seq_lens", None)
    given_lengths = _host_values(seq, nF + ".seq_lens", function) if isinstance(seq, torch.Tensor) else None
    if given_lengths is not None and list(given_lengths) != lengths:
        raise GuardError("GL103", argument=nF + ".seq_lens", function=function,
                         expected="cu_seqlens[1:] - cu_seqlens[:-1] of the metadata", got="other lengths")
    return type(mx) is int


def _check_engine_packed(function: str, fm: Any, cu: Any, to_tokens: Optional[Callable[..., tuple]], nF: str,
                         nC: str) -> bool:
    """The engine's cuDNN metadata (``packed_indptrs``, padded ``sequence_lengths``, a host max) against itself and
    the caller's cu_seqlens, where that costs no device read. True when its max was checked."""
    packed = _host_values(fm.packed_indptrs, nF + ".packed_indptrs", function)
    given = _host_values(cu, nC, function) if cu is not None and cu is not fm.packed_indptrs else None
    if packed is None or to_tokens is None:
        own = getattr(fm, "cu_seqlens", None)
        offsets = _host_values(own, nF + ".cu_seqlens", function) if isinstance(own, torch.Tensor) else None
        if given is not None and offsets is not None and to_tokens is not None and cu is not own:
            _compare_offsets(function, to_tokens(given), tuple(offsets), nC)
        return False
    n = len(packed)
    tokens = to_tokens(packed, nF + ".packed_indptrs")
    if len(tokens) == n and n > 1:
        raise GuardError("GL107", argument=nF + ".packed_indptrs", function=function,
                         expected="packed element indptrs [qk | v | o] of shape (3(Bp+1),)",
                         got=f"token offsets of shape ({n},)")
    if given is not None:
        _compare_offsets(function, tokens, to_tokens(given), nC)
    lengths = [tokens[i + 1] - tokens[i] for i in range(len(tokens) - 1)]
    seq = _host_values(getattr(fm, "sequence_lengths", None), nF + ".sequence_lengths", function) \
        if isinstance(getattr(fm, "sequence_lengths", None), torch.Tensor) else None
    if seq is not None and list(seq) != lengths:
        raise GuardError("GL103", argument=nF + ".sequence_lengths", function=function,
                         expected="the lengths of packed_indptrs (zero-padded)", got=f"{len(seq)} other lengths")
    mx = getattr(fm, "flashinfer_max_seqlen", None)
    name = nF + ".flashinfer_max_seqlen"
    if mx is None:
        mx, name = getattr(fm, "max_seqlen", None), nF + ".max_seqlen"
    if type(mx) is not int:
        return False
    check_max_seqlen(function, mx, max(lengths, default=0), lengths, argument=name)
    return True


def _build_cudnn(fn: Callable, **rename: str) -> Callable:
    function = qualified_name(fn)
    names: tuple = ("q", "cu_seqlens", "forward_metadata", "sequence_lengths", "max_seqlen")
    p = bind(fn, names, rename, function=function, must_accept=("q", "cu_seqlens", "forward_metadata"))
    nF, nS, nX = p["forward_metadata"].param, p["sequence_lengths"].param, p["max_seqlen"].param
    # sglang 0.5.10's backend has no forward_metadata parameter: it reads packed indptrs from
    # cu_seqlens and sequence_lengths/max_seqlen from kwargs, so the plan is handed over that way.
    as_kwargs = nF not in inspect.signature(fn).parameters
    nC = p["cu_seqlens"].param
    flag = _flag_param(fn)
    if flag is not None:
        names += (flag,)
        p[flag] = Param(flag, flag, True)
    context = Context(function, GL101.code)
    derive_meta = DERIVERS[META_DERIVATION.name]

    VM, DERIVE, cache_module, Tensor = VarlenMetadata, _state.DERIVE, _cache, torch.Tensor

    def hook(mode: int, q: Any, cu: Any, fm: Any, seq: Any, mx: Any, *_flag: Any) -> tuple:
        # The prepared path, in the fewest steps: cuDNN metadata prepared from this very cu_seqlens, unchanged.
        if fm.__class__ is VM and mode == DERIVE and seq is None and mx is None and (fast := fm._fast) is not None \
                and fast[0]() is cu and cache_module.enabled and unchanged(cu, fast[1]) \
                and fast[2]._version == fast[3] and q.__class__ is Tensor and q.shape == fast[4] \
                and fm.layout == "cudnn":
            if as_kwargs:
                out: tuple = (q, fm.packed_indptrs, None, fm.sequence_lengths, fm.flashinfer_max_seqlen)
            else:
                out = (q, cu, fm, seq, mx)
            return (*out, True) if flag is not None else out
        if fm is None and seq is None and mx is None and mode == DERIVE and cu.__class__ is Tensor \
                and q.__class__ is Tensor and cache_module.enabled and q.dim() == 3 and not is_compiling():
            # cu_seqlens alone, its cuDNN plan already derived for this q's shape and unchanged since: the plan
            # (the lookup the path below makes, without the checks the plan passed when it was made).
            known = cache.get(cu, ("meta", "cudnn", True, q.shape, q.device))
            if known is not MISS:
                _state.note_cached(META_DERIVATION.name)
                if as_kwargs:
                    out = (q, known.packed_indptrs, None, known.sequence_lengths, known.flashinfer_max_seqlen)
                else:
                    out = (q, cu, known, seq, mx)
                return (*out, True) if flag is not None else out
        if not _cache.enabled:
            _cache.new_call()
        packed_q = _Packed(q) if getattr(q, "ndim", 3) == 4 else q
        if isinstance(cu, torch.Tensor) and cu.is_meta:
            raise _no_values(nC, cu, function, "GL103")
        compiling = is_compiling()  # see guard_varlen's hook
        plan: Any = None  # a VarlenMetadata whose facts are known (prepared, derived or checked)
        trusted = False   # ... and proven to hold for this call's cu_seqlens now
        derived = False
        if fm is not None or (seq is not None and mx is not None):
            if isinstance(cu, torch.Tensor) and (cu.layout is not torch.strided or (cu.dim() != 1 and cu.is_cpu)):
                # Sparse, or host offsets of another rank (a backend reads them flat: they describe nothing). The
                # derivation below refuses them as it reads; these paths may not read.
                check_index_tensor(cu, nC, function)
        if fm is None and (seq is None or mx is None):
            if cu is None:
                code, name = (GL101, nS) if seq is None else (GL102, nX)
                raise GuardError(code.code, argument=name, function=function,
                                 expected=f"{code.requirement_text()} passed and not None, or cu_seqlens "
                                          "to derive forward_metadata from",
                                 got="None, and cu_seqlens is None too", detail=code.diagnosis.message)
            fm = MISS
            if isinstance(cu, torch.Tensor) and not compiling:
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
            plan, trusted, derived = fm, True, True
        elif type(fm) is VarlenMetadata:
            fit = check_plan_source(function, fm, cu, nC, _token_reader(packed_q, function, nC) if cu is not None
                                    else None)
            trusted = _plan_trusted(function, fm, packed_q, nF, "GL107", fit, compiling)
            if fm.layout != "cudnn":
                # Prepared for other kernels: re-plan from its host offsets (no read).
                fm, fresh = prepare(fm.host_cu_seqlens, packed_q, layout="cudnn", bucket=True, function=function,
                                    argument=nF)
                if fresh:
                    _state.note_derived(function, nF, META_DERIVATION.name, (nF,), fresh=True, host_read=False)
                else:
                    _state.note_cached(META_DERIVATION.name)
                derived = True
            plan = fm
        elif fm is not None:
            if getattr(fm, "packed_indptrs", None) is None:
                trusted = _check_engine_metadata(function, fm, cu, nF, nC)
                fm = _fill_cudnn(fm, packed_q, function, nF)
            else:
                trusted = _check_engine_packed(function, fm, cu, _token_reader(packed_q, function, nC), nF, nC)
        elif not compiling and (isinstance(cu, (list, tuple)) or (
                on_host(cu) and cu.dim() == 1 and cu.layout is torch.strided and cu.dtype in (torch.int32, torch.int64)
                and (not isinstance(seq, torch.Tensor) or cu.numel() in (seq.numel() + 1, 3 * (seq.numel() + 1))))):
            # Every value was passed, and cu_seqlens is on the host: checking them costs no device read. (Offsets
            # of another kind or size are the backend's to refuse, before any read: GL106/GL107.)
            if mode == _state.STRICT:
                prefetch(cu, seq)
            facts = _free_facts(cu, packed_q, "cudnn", function, nC) if isinstance(cu, torch.Tensor) else None
            if facts is not None:
                lengths, longest = facts
            elif isinstance(cu, torch.Tensor):
                lengths, longest = (), None
            else:
                host = host_sequence(cu, nC, function)
                to_tokens = _token_reader(packed_q, function, nC)
                lengths = _lengths(to_tokens(host) if to_tokens is not None else host)
                longest = max(lengths or [0])
            if longest is not None:
                trusted = _check_given_max(function, mx, longest, nX)
                _check_given_lengths(function, seq, lengths, nS, True)
        verified = trusted
        if plan is not None and (seq is not None or mx is not None) and not compiling:
            # The caller's kwargs beside the plan: the function reads them when it gets no forward_metadata.
            checked = _given_beside_plan(function, plan, seq, mx, nS, nX, True)
            if fm is None:
                verified = checked and trusted
        if mode == _state.STRICT:
            checked = check_varlen(function, q=packed_q, cu_seqlens=cu, sequence_lengths=seq, max_seqlen=mx,
                                   metadata=fm if fm is not None else None, layout="cudnn", metadata_name=nF,
                                   derived=derived)
            verified = checked or verified
        if as_kwargs and fm is not None:
            result: tuple = (q, fm.packed_indptrs, None, fm.sequence_lengths, fm.flashinfer_max_seqlen)
        else:
            result = (q, cu, fm, seq, mx)
        return (*result, verified) if flag is not None else result

    host = _on_host_or_sequence
    if as_kwargs:
        fast = ("{sequence_lengths} is not None and {max_seqlen} is not None and {forward_metadata} is None "
                "and not _guardlint_host({cu_seqlens})")
    else:
        # Prepared metadata goes through the hook (which tensor it was made from is checked); the engine's own
        # object with its cuDNN fields on the device passes, as do values passed with device offsets.
        fast = ("({forward_metadata} is not None and {forward_metadata}.__class__ is not _guardlint_VM "
                "and {forward_metadata}.packed_indptrs is not None "
                "and not _guardlint_host({forward_metadata}.packed_indptrs) and not _guardlint_host({cu_seqlens})) "
                "or ({forward_metadata} is None and {sequence_lengths} is not None and {max_seqlen} is not None "
                "and not _guardlint_host({cu_seqlens}))")
    # cuDNN metadata prepared from this very cu_seqlens, unchanged: passed on as it is, with no hook call.
    access = accesses(fn, p)
    absent = "{sequence_lengths} is None and {max_seqlen} is None"
    varkw = {access[n].varkw for n in ("sequence_lengths", "max_seqlen")}
    if len(varkw) == 1 and None not in varkw:
        # Both arrive through **kwargs (the engine's signature): an empty dict holds neither, with no lookup.
        absent = f"(not {varkw.pop()} or ({absent}))"
    prepared_path = None if as_kwargs else (
        "{forward_metadata}.__class__ is _guardlint_VM and " + absent + " and {forward_metadata}.layout == 'cudnn' "
        "and " + _fresh_inline("{forward_metadata}", "{cu_seqlens}", "{q}"),
        {flag: "True"} if flag else {})
    wrapper = make_wrapper(fn, access, names, hook, fast=fast,
                           env={"VM": VarlenMetadata, "host": host, "fresh": _fresh, "cache": _cache,
                                "Tensor": torch.Tensor},
                           reset=(flag,) if flag else (), prepared=prepared_path)
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


def _cpu_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_cpu


def _info_copy(info: Any, changes: dict, argument: str = "batch_info", function: Optional[str] = None) -> Any:
    """A copy of ``info`` with ``changes`` (the caller's object is never mutated); a coded error for one whose
    fields cannot be set on a copy (a namedtuple: positional, the trap the engines' changing field order sets)."""
    if dataclasses.is_dataclass(info) and not isinstance(info, type):
        return dataclasses.replace(info, **changes)
    try:
        out = copy.copy(info)
        for name, value in changes.items():
            setattr(out, name, value)
    except (AttributeError, TypeError):
        lora = not argument.endswith("metadata")
        raise GuardError(
            "GL204" if lora else "GL107", argument=argument, function=function, got=describe(info),
            expected=f"an object whose fields can be set on a copy (a dataclass or a plain object) to fill in "
                     f"{', '.join(changes)}",
            fix="Build a LoRABatchInfo with keywords, or pass max_len and seg_lens." if lora else
                "Pass prepare_varlen_metadata(cu_seqlens, q, layout=\"cudnn\", bucket=True) as forward_metadata.") \
            from None
    return out


def _snapshot(info: Any) -> Optional[tuple]:
    """The identity of every field of ``info`` and the fingerprint of its seg_indptr (``_cache``: contents on
    the host, version and storage on a device): when all are the same at the next call, the copy made then is
    still right."""
    fields = getattr(info, "__dict__", None)
    if fields is None:
        return None
    seg_indptr = info.seg_indptr
    fp = cache.fingerprint(seg_indptr) if isinstance(seg_indptr, torch.Tensor) else None
    return tuple(fields.values()), fp


class _Copies:
    """Completed copies of LoRA batch infos, so 60 layers x several kernels make one copy, not hundreds.
    Keyed on the caller's object (weakly: an entry dies with it) and checked against a snapshot."""

    def __init__(self, capacity: int = 16) -> None:
        # hold=False: an info that takes no weakref (__slots__ without __weakref__) is copied at every call
        self.entries = IdentityCache(capacity, hold=False)

    def get(self, info: Any, tokens: Optional[int] = None) -> Any:
        entry = self.entries.get((info,), tokens)
        if entry is MISS:
            return None
        (fields, fp), completed = entry
        now = info.__dict__
        if len(now) != len(fields) or not all(map(operator.is_, now.values(), fields)):
            return None
        if fp is not None and not unchanged(info.seg_indptr, fp):
            return None
        return completed

    def put(self, info: Any, snapshot: Optional[tuple], completed: Any, tokens: Optional[int] = None) -> None:
        if snapshot is not None:
            self.entries.put((info,), tokens, (snapshot, completed))

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
        return _info_copy(info, changes, nB, function) if changes else info

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

    check_max, check_lens = "max_len" in reads, "seg_lens" in reads

    def check_segments(info: Any) -> None:
        """num_segments against seg_indptr's size (no read): more live segments than offsets would index past
        the end of seg_indptr."""
        num_segments = info.num_segments
        if num_segments is None:
            return
        if type(num_segments) is not int or num_segments < 0:
            raise GuardError("GL204", argument=nB + ".num_segments", function=function, expected="a Python int >= 0",
                             got=describe(num_segments))
        seg_indptr = getattr(info, "seg_indptr", None)
        if isinstance(seg_indptr, torch.Tensor) and seg_indptr.dim() == 1 and num_segments > seg_indptr.numel() - 1:
            raise GuardError("GL204", argument=nB + ".num_segments", function=function,
                             expected=f"at most seg_indptr.numel() - 1 = {seg_indptr.numel() - 1}",
                             got=f"num_segments={num_segments}")

    def free_check(info: Any, tokens: Optional[int], always: bool = False) -> None:
        """The caller's max_len and seg_lens (the fields this kernel reads) against seg_indptr's live segments (valid
        prefix sums), where that costs no device read: seg_indptr on the host, or already read by this call's
        derivation. ``always=False``: only where a value was given."""
        ml, sl = info.max_len, info.seg_lens
        ml_given = check_max and type(ml) is int and ml > 0
        if not (always or ml_given or (check_lens and sl is not None)):
            return
        seg_indptr = getattr(info, "seg_indptr", None)
        if seg_indptr.__class__ is not torch.Tensor or is_compiling():
            return
        num_segments = info.num_segments
        tag = ("lora-live", num_segments if type(num_segments) is int else None)
        facts = cache.get(seg_indptr, tag)
        if facts is MISS:
            check_segments(info)
            if seg_indptr.is_cpu:
                check_index_tensor(seg_indptr, nB + ".seg_indptr", function, code="GL204")
                host = host_copy(seg_indptr, nB + ".seg_indptr", function)
            else:
                host = cache.get(seg_indptr, "host")
                host = None if host is MISS else host
            if host is None:
                return
            n = num_segments if type(num_segments) is int and 0 <= num_segments < len(host) else len(host) - 1
            live = host[:n + 1]
            check_prefix_sums(live, nB + ".seg_indptr", function, code="GL204")
            lengths = _lengths(live)
            facts = (lengths, max(lengths or [0]), live[-1])
            cache.put(seg_indptr, tag, facts)
        # The live total may be below x's rows (CUDA-graph padding): strict mode compares it with the token count.
        lengths, longest, total = facts
        if ml_given and ml < longest:
            raise GuardError("GL204", argument=nB + ".max_len", function=function,
                             expected=f"at least the longest live segment ({longest} tokens)",
                             got=f"max_len={ml}, shorter than segment {lengths.index(longest)}",
                             detail="A kernel that sizes its grid by max_len skips the tail of longer segments.")
        if check_lens and sl is not None and sl.__class__ is torch.Tensor and sl.dim() == 1:
            given = cache.get(sl, "flat")
            if given is MISS:
                if not on_host(sl) or sl.is_meta or sl.dtype.is_floating_point or sl.dtype.is_complex or \
                        sl.dtype == torch.bool:
                    return
                given = host_copy(sl, nB + ".seg_lens", function)
                if given is None:
                    return
                cache.put(sl, "flat", given)
            if len(given) < len(lengths) or given[:len(lengths)] != lengths:
                raise GuardError("GL204", argument=nB + ".seg_lens", function=function,
                                 expected="seg_indptr[1:] - seg_indptr[:-1] over the live segments",
                                 got=f"{describe(sl)} with other lengths")

    DERIVE = _state.DERIVE

    def hook(mode: int, x_value: Any, w_value: Any, info: Any) -> tuple:
        if not _cache.enabled:
            _cache.new_call()
        shape = getattr(x_value, "shape", None)
        tokens = shape[0] if shape is not None and len(shape) == 2 else None  # x (S, K): S tokens
        if mode == DERIVE and info is not None and not is_compiling():
            ml = getattr(info, "max_len", None)
            if ml.__class__ is int and ml > 0 and hasattr(info, "seg_lens") and hasattr(info, "num_segments"):
                free_check(info, tokens)  # max_len given (and seg_indptr on the host: else this was the fast path)
                return x_value, w_value, info
            if ml is None or ml.__class__ is int and ml == 0:
                new = copies.get(info, tokens)
                if new is not None:  # completed before for as many tokens, and nothing of it changed since
                    if info.seg_lens is None:
                        _state.note_cached(SEG_LENS_DERIVATION.name, MAX_LEN_DERIVATION.name)
                    else:
                        _state.note_cached(MAX_LEN_DERIVATION.name)
                    free_check(info, tokens)
                    return x_value, w_value, new
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
        check_segments(info)
        ml = info.max_len
        if ml is not None and type(ml) is not int:
            # A grid size: a float, a bool or a tensor here is a crash (or a sync) in the kernel. A type the kernel
            # cannot take: GL205, as the bundled kernels name it.
            raise GuardError("GL205", argument=nB + ".max_len", function=function,
                             expected="a Python int >= 0 (a tensor would cost a device sync)", got=describe(ml))
        if ml is not None and ml < 0:
            raise GuardError("GL204", argument=nB + ".max_len", function=function,
                             expected="a Python int >= 0 (the longest live segment)", got="a negative int")
        if ml is not None and ml > 0:
            new = info  # max_len given: nothing to derive
        else:
            # Strict mode re-checks the caller's own values (max_len == 0 is an error there).
            memo = mode == _state.DERIVE and not is_compiling()
            new = copies.get(info, tokens) if memo else None
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
                    copies.put(info, snapshot, new, tokens)
        free_check(info, tokens, always=True)
        if mode == _state.STRICT:
            check(new, x_value, w_value if has_weights else None)
        return x_value, w_value, new

    # max_len given: nothing to derive; the hook still runs where seg_indptr is on the host (free checks).
    fast = "{batch_info} is not None and ((_guardlint_ml := getattr({batch_info}, 'max_len', None)).__class__ " \
           "is int and _guardlint_ml > 0) and not _guardlint_host(getattr({batch_info}, 'seg_indptr', None))"
    wrapper = make_wrapper(fn, accesses(fn, p), ("x", "weights", "batch_info"), hook, fast=fast,
                           env={"host": _cpu_tensor})
    wrapper.__guardlint__ = ("lora", p)
    return wrapper
