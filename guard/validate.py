"""Strict mode: value checks of varlen and LoRA metadata with at most one host read per call.

Every metadata tensor a call needs checked is flattened into one int64 buffer on its device and read
back once; the checks then run on the host copy, which is cached per tensor version (a second layer
with the same tensors reads nothing). Messages name positions, never values.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from . import _state
from ._cache import MISS, cache
from .errors import GuardError, describe
from . import metadata as _metadata
from .metadata import VarlenMetadata, check_index_tensor, host_sequence, is_compiling, token_offsets


def read_together(tensors: Sequence[torch.Tensor], names: Sequence[str] = (),
                  lora: bool = False) -> Optional[list]:
    """Host tuples of ``tensors`` (all on one device) with one read for the uncached ones; None when a
    read is not allowed now (CUDA graph capture, compile tracing): the value checks are then skipped.
    ``names`` name them in errors (a tensor on the meta device: GL103, or GL204 with ``lora``)."""
    if is_compiling():
        return None
    out: list = [MISS] * len(tensors)
    todo = []
    for i, t in enumerate(tensors):
        out[i] = cache.get(t, "host")
        if out[i] is MISS:
            todo.append(i)
    if not todo:
        return out
    first = tensors[todo[0]]
    for i in todo:
        if tensors[i].device.type == "meta":
            # No values to check (and reading would be NotImplementedError): a kernel would get none either.
            raise GuardError("GL204" if lora else "GL103", argument=names[i] if names else "metadata",
                             expected="a tensor with values (not on the meta device)", got=describe(tensors[i]))
    if _metadata.capturing(first.device):
        return None
    flat = torch.cat([tensors[i].reshape(-1).to(torch.int64) for i in todo]) if len(todo) > 1 \
        else tensors[todo[0]].reshape(-1)
    _state.counters.cache_misses += 1
    _state.note_read(first)
    values = flat.tolist()
    start = 0
    for i in todo:
        n = tensors[i].numel()
        out[i] = tuple(values[start:start + n])
        start += n
        cache.put(tensors[i], "host", out[i])
    return out


def prefetch(*values: Any) -> None:
    """Strict mode, before deriving: read all of a call's integer metadata tensors in one go, so that
    the derivation and the checks after it find their host copies cached (one read per call)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor) and v.device.type != "meta" and not (
        v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool)]
    if len(tensors) > 1:
        device = tensors[0].device
        read_together([t for t in tensors if t.device == device])


def _skipped() -> None:
    _state.counters.checks_skipped += 1


def _int_tensor(value: Any, argument: str, function: Optional[str], code: str, device) -> None:
    if not isinstance(value, torch.Tensor):
        raise GuardError(code, argument=argument, function=function, expected="an integer tensor",
                         got=describe(value))
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise GuardError(code, argument=argument, function=function,
                         expected="an integer tensor (int32 or int64)", got=describe(value))
    if device is not None and value.device != device:
        raise GuardError(code, argument=argument, function=function,
                         expected=f"a tensor on {device} (the device of the data)", got=describe(value))


def _python_int(value: Any, argument: str, function: Optional[str], code: str) -> None:
    if type(value) is not int:  # bool, numpy ints and 0-d tensors all slip through `isinstance(_, int)`
        raise GuardError(code, argument=argument, function=function, expected="a Python int >= 0",
                         got=describe(value))
    if value < 0:
        raise GuardError(code, argument=argument, function=function, expected="a Python int >= 0",
                         got="a negative int")


def _first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _lengths(offsets: Sequence[int]) -> list:
    return [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]


def _argmax(values: Sequence[int]) -> int:
    return max(range(len(values)), key=values.__getitem__)


# -- varlen attention -------------------------------------------------------------------------------

def plan_fits(plan: Any, cu_seqlens: Any) -> bool:
    """Was ``plan`` (prepared metadata, or any object with ``cu_seqlens``) made from this very
    ``cu_seqlens``: the plan's own tensor, the tensor it was prepared from and unchanged since (the guard
    cache remembers which; no read), or, for offsets on the host, the same values? ``cu_seqlens=None``
    fits any plan (the plan supplies it). Never reads a device tensor."""
    if cu_seqlens is None:
        return True
    planned = getattr(plan, "cu_seqlens", None)
    if cu_seqlens is planned:
        return True
    if isinstance(cu_seqlens, torch.Tensor):
        if cache.made_from(plan, cu_seqlens):
            return True
        if cu_seqlens.device.type != "cpu" or cu_seqlens.dim() != 1:
            return False
        host = tuple(cu_seqlens.tolist())  # a host tensor: no device read
    else:
        try:
            host = tuple(int(x) for x in cu_seqlens)
        except (TypeError, ValueError):
            return False
    offsets = getattr(plan, "host_cu_seqlens", None)
    if offsets is None and isinstance(planned, torch.Tensor) and planned.device.type == "cpu":
        offsets = tuple(planned.tolist())
    return offsets is not None and tuple(offsets) == host


def check_plan_source(function: Optional[str], plan: Any, cu_seqlens: Any, argument: str = "cu_seqlens") -> None:
    """GL103 unless ``plan_fits(plan, cu_seqlens)``: metadata prepared from other offsets (or from this
    tensor before an in-place write) must not silently replace the caller's cu_seqlens, nor be ignored.
    Skipped while torch.compile traces (no identities then); strict mode still compares values."""
    if plan_fits(plan, cu_seqlens) or is_compiling():
        return
    raise GuardError(
        "GL103", argument=argument, function=function,
        expected="the cu_seqlens the metadata was prepared from (the same tensor, unchanged, or equal host "
                 "offsets)",
        got=f"metadata {describe(plan)} prepared from other offsets than cu_seqlens={describe(cu_seqlens)} "
            "(or from this tensor before an in-place write)",
        fix="Prepare the metadata from this cu_seqlens once per batch (prepare_varlen_metadata(cu_seqlens, q)) "
            "and pass both, or pass only one of them.")


def check_varlen(function: Optional[str], *, q: Any, cu_seqlens: Any = None, sequence_lengths: Any = None,
                 max_seqlen: Any = None, metadata: Any = None, layout: str = "tokens") -> None:
    """Validate what a varlen attention call will use. ``metadata`` is a ``VarlenMetadata`` (prepared:
    its host offsets were validated when it was built) or, for the cuDNN path, any object with
    ``packed_indptrs``. Raises GuardError GL103 / GL107; returns quietly when reads are not allowed.

    In three steps: the prepared metadata against q (no read); every tensor that needs its values read in
    one packed host read; then the offsets each source implies, checked against each other, and the
    lengths and max_seqlen against them."""
    _state.counters.checks += 1
    shape = getattr(q, "shape", None)
    T = int(shape[0]) if shape is not None and len(shape) else None
    HD = 1
    for d in (shape[1:] if shape is not None else ()):
        HD *= int(d)
    device = getattr(q, "device", None)
    prepared = metadata if isinstance(metadata, VarlenMetadata) else None
    offsets: Optional[tuple] = None
    if prepared is not None:
        _check_prepared(prepared, function, T, HD, device, layout)
        offsets = prepared.host_cu_seqlens
        if max_seqlen is prepared.max_seqlen or max_seqlen is prepared.flashinfer_max_seqlen:
            max_seqlen = None
    pending, names = _to_read(function, device, prepared, metadata, cu_seqlens, sequence_lengths)
    if max_seqlen is not None:
        _python_int(max_seqlen, "max_seqlen", function, "GL103")
    host_cu = host_sequence(cu_seqlens, "cu_seqlens", function) \
        if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor) else None
    hosts = read_together(pending, names) if pending else []
    if hosts is None:
        _skipped()
        return
    got = dict(zip(names, hosts))
    host_cu = got.get("cu_seqlens", host_cu)
    if host_cu is not None:
        # Without q there is no token count to tell element offsets from token offsets by.
        from_cu = token_offsets(host_cu, layout=layout if T is not None else "tokens", total_tokens=T,
                                elements_per_token=HD, function=function)
        if offsets is not None and from_cu != offsets:
            bad = _first_difference(from_cu, offsets)
            raise GuardError("GL103", argument="cu_seqlens", function=function,
                             expected="the offsets the metadata was prepared from",
                             got=f"different offsets (first difference at index {bad})")
        offsets = from_cu
    if "packed_indptrs" in got and T is not None:
        offsets = _packed_offsets(got["packed_indptrs"], offsets, function, T, HD)
    if offsets is None:
        return
    lengths = _lengths(offsets)
    if "sequence_lengths" in got:
        _check_sequence_lengths(got["sequence_lengths"], sequence_lengths, lengths, layout, function)
    if max_seqlen is not None and lengths and max_seqlen < max(lengths):
        raise GuardError("GL103", argument="max_seqlen", function=function,
                         expected="at least the longest sequence of cu_seqlens",
                         got=f"max_seqlen={max_seqlen}, shorter than sequence {_argmax(lengths)} of cu_seqlens",
                         detail="A short max_seqlen makes the kernel skip the tail of longer sequences.",
                         fix="Pass the true longest length (int((cu_seqlens[1:] - cu_seqlens[:-1]).max()), once "
                             "per batch), or omit max_seqlen and let the guard derive it.")


def _check_prepared(prepared: VarlenMetadata, function: Optional[str], T: Optional[int], HD: int, device: Any,
                    layout: str) -> None:
    """Prepared metadata made for q: its token count, its device and, for the cuDNN path, its layout."""
    if T is not None and prepared.total_tokens != T:
        raise GuardError("GL103", argument="metadata", function=function,
                         expected=f"metadata prepared for q's token count T={T}",
                         got=f"metadata for {prepared.total_tokens} tokens (a stale plan?)")
    if device is not None and prepared.device != device:
        raise GuardError("GL103", argument="metadata", function=function,
                         expected=f"metadata on {device} (q's device)", got=f"metadata on {prepared.device}")
    if layout == "cudnn" and (prepared.layout != "cudnn" or prepared.elements_per_token != HD):
        raise GuardError("GL107", argument="forward_metadata", function=function,
                         expected=f"metadata prepared with layout=\"cudnn\" for H*D={HD}",
                         got=f"layout {prepared.layout!r} with H*D={prepared.elements_per_token}")


def _to_read(function: Optional[str], device: Any, prepared: Optional[VarlenMetadata], metadata: Any,
             cu_seqlens: Any, sequence_lengths: Any) -> tuple:
    """(tensors whose values the check needs, their names): each checked for kind and device first. What the
    prepared metadata holds was validated when it was built, so it is not read again."""
    pending: list = []
    names: list = []
    if isinstance(cu_seqlens, torch.Tensor) and not (prepared is not None and cu_seqlens is prepared.cu_seqlens):
        check_index_tensor(cu_seqlens, "cu_seqlens", function)
        _int_tensor(cu_seqlens, "cu_seqlens", function, "GL103", device)
        pending.append(cu_seqlens)
        names.append("cu_seqlens")
    if prepared is None and metadata is not None:
        packed = getattr(metadata, "packed_indptrs", None)
        if packed is None:
            raise GuardError("GL107", argument="forward_metadata", function=function,
                             expected="a VarlenMetadata or an object with packed_indptrs",
                             got=f"{type(metadata).__name__} without packed_indptrs")
        check_index_tensor(packed, "forward_metadata.packed_indptrs", function, code="GL107", min_numel=3)
        _int_tensor(packed, "forward_metadata.packed_indptrs", function, "GL107", device)
        pending.append(packed)
        names.append("packed_indptrs")
    if sequence_lengths is not None and not (prepared is not None and (
            sequence_lengths is prepared.sequence_lengths or sequence_lengths is prepared.seq_lens)):
        _int_tensor(sequence_lengths, "sequence_lengths", function, "GL103", device)
        pending.append(sequence_lengths)
        names.append("sequence_lengths")
    return pending, names


def _packed_offsets(values: tuple, offsets: Optional[tuple], function: Optional[str], T: int, HD: int) -> tuple:
    """The token offsets of cuDNN packed element indptrs ``[qk | v | o]``, checked against ``offsets`` (from
    cu_seqlens or the metadata) when there are some: the packed form may be padded with zero-length
    sequences, its live part must match."""
    from_packed = token_offsets(values, layout="cudnn", total_tokens=T, elements_per_token=HD,
                                argument="forward_metadata.packed_indptrs", function=function)
    if len(values) == len(from_packed) and HD != 1:
        raise GuardError("GL107", argument="forward_metadata.packed_indptrs", function=function,
                         expected="packed element indptrs [qk | v | o] of shape (3(Bp+1),)",
                         got=f"token offsets of shape ({len(values)},)")
    if offsets is None:
        return from_packed
    live, tail = from_packed[:len(offsets)], from_packed[len(offsets):]
    if live != offsets or any(v != offsets[-1] for v in tail):
        raise GuardError("GL103", argument="forward_metadata.packed_indptrs", function=function,
                         expected="element offsets of the same sequences as cu_seqlens",
                         got="different sequences")
    return offsets


def _check_sequence_lengths(given: tuple, sequence_lengths: Any, lengths: list, layout: str,
                            function: Optional[str]) -> None:
    """``sequence_lengths`` (read: ``given``) equal to the lengths of the offsets, zero-padded only in the
    cuDNN layout (a bucketed batch)."""
    n_live = len(lengths)
    if len(given) < n_live or (len(given) > n_live and layout != "cudnn"):
        raise GuardError("GL103", argument="sequence_lengths", function=function,
                         expected=f"{n_live} lengths (one per sequence of cu_seqlens)", got=describe(sequence_lengths))
    bad = _first_difference(given[:n_live], lengths)
    if bad is None and any(given[n_live:]):
        bad = n_live + next(i for i, v in enumerate(given[n_live:]) if v)
    if bad is not None:
        raise GuardError("GL103", argument="sequence_lengths", function=function,
                         expected="cu_seqlens[1:] - cu_seqlens[:-1] (zero-padded for a bucketed batch)",
                         got=f"a different length at index {bad}")


# -- segmented LoRA ---------------------------------------------------------------------------------

def permutation_error(values: Sequence[int]) -> Optional[str]:
    """What is wrong with host ``values`` as a permutation of ``range(len(values))`` (positions, never
    values), or None."""
    n = len(values)
    seen = bytearray(n)
    for i, p in enumerate(values):
        if not 0 <= p < n:
            return f"an out-of-range entry at position {i}"
        if seen[p]:
            return f"a repeated entry at position {i} (so another token is never written)"
        seen[p] = 1
    return None


def check_lora(function: Optional[str], *, seg_indptr: Any, num_segments: Any = None, weight_indices: Any = None,
               lora_ranks: Any = None, seg_lens: Any = None, max_len: Any = None, tokens: Optional[int] = None,
               num_slots: Optional[int] = None, max_rank: Optional[int] = None, permutation: Any = None,
               prefix: str = "batch_info.") -> None:
    """Validate LoRA batch info over its live segments (entries past ``num_segments`` are CUDA-graph
    padding and ignored): prefix sums, slots, ranks (0 <= rank <= ``max_rank``), seg_lens, max_len and
    ``permutation`` (a permutation of ``range(tokens)``), all in one host read. Raises GuardError GL204
    (inconsistent) or GL203 (max_len == 0 with tokens).

    In two steps: kinds, devices and sizes of what is given, collected for one packed read; then the values
    (``_check_lora_values``)."""
    _state.counters.checks += 1
    if seg_indptr is None:
        return
    check_index_tensor(seg_indptr, prefix + "seg_indptr", function, code="GL204")
    device = seg_indptr.device
    if num_segments is None:
        num_segments = seg_indptr.numel() - 1
    _python_int(num_segments, prefix + "num_segments", function, "GL204")
    if num_segments > seg_indptr.numel() - 1:
        raise GuardError("GL204", argument=prefix + "num_segments", function=function,
                         expected=f"at most seg_indptr.numel() - 1 = {seg_indptr.numel() - 1}",
                         got=f"num_segments={num_segments}")
    if max_len is not None:
        _python_int(max_len, prefix + "max_len", function, "GL204")
    pending = [seg_indptr]
    names = ["seg_indptr"]
    for name, value in (("weight_indices", weight_indices), ("seg_lens", seg_lens)):
        if value is None:
            continue
        _int_tensor(value, prefix + name, function, "GL204", device)
        if value.dim() != 1 or value.numel() < num_segments:
            raise GuardError("GL204", argument=prefix + name, function=function,
                             expected=f"a 1-D tensor with at least num_segments={num_segments} entries",
                             got=describe(value))
        pending.append(value)
        names.append(name)
    if lora_ranks is not None and weight_indices is not None:
        _int_tensor(lora_ranks, prefix + "lora_ranks", function, "GL204", device)
        pending.append(lora_ranks)
        names.append("lora_ranks")
    if permutation is not None:
        _int_tensor(permutation, prefix + "permutation", function, "GL204", device)
        if permutation.dim() != 1 or (tokens is not None and permutation.numel() != tokens):
            raise GuardError("GL204", argument=prefix + "permutation", function=function,
                             expected=f"a 1-D tensor of {tokens} entries (one per token of x)",
                             got=describe(permutation))
        pending.append(permutation)
        names.append("permutation")
    hosts = read_together(pending, [prefix + n for n in names], lora=True)
    if hosts is None:
        _skipped()
        return
    _check_lora_values(dict(zip(names, hosts)), function, num_segments, max_len, tokens, num_slots, max_rank,
                       prefix)


def _check_lora_values(got: dict, function: Optional[str], num_segments: int, max_len: Optional[int],
                       tokens: Optional[int], num_slots: Optional[int], max_rank: Optional[int], prefix: str) -> None:
    """The read values of a LoRA batch info (``got``: field name -> host values) over its live segments."""
    lengths = _live_lengths(got["seg_indptr"][:num_segments + 1], tokens, function, prefix)
    if "weight_indices" in got:
        _check_slots(got["weight_indices"][:num_segments], got.get("lora_ranks"), num_slots, max_rank, function,
                     prefix)
    if "permutation" in got:
        problem = permutation_error(got["permutation"])
        if problem is not None:
            raise GuardError("GL204", argument=prefix + "permutation", function=function,
                             expected=f"a permutation of range({len(got['permutation'])}) (each token once)",
                             got=problem)
    if "seg_lens" in got:
        bad = _first_difference(got["seg_lens"][:num_segments], lengths)
        if bad is not None:
            raise GuardError("GL204", argument=prefix + "seg_lens", function=function,
                             expected="seg_indptr[1:] - seg_indptr[:-1] over the live segments",
                             got=f"a different length at segment {bad}")
    if max_len is not None:
        if max_len == 0 and sum(lengths) > 0:
            raise GuardError("GL203", argument=prefix + "max_len", function=function,
                             expected="the longest segment length (> 0: tokens are present)", got="max_len=0")
        if lengths and max_len < max(lengths):
            raise GuardError("GL204", argument=prefix + "max_len", function=function,
                             expected="at least the longest live segment",
                             got=f"max_len={max_len}, shorter than segment {_argmax(lengths)}")


def _live_lengths(live: Sequence[int], tokens: Optional[int], function: Optional[str], prefix: str) -> list:
    """The lengths of the live segments: prefix sums from 0, never decreasing, ending at the token count."""
    arg = prefix + "seg_indptr"
    if live[0] != 0:
        raise GuardError("GL204", argument=arg, function=function, expected="prefix sums starting at 0",
                         got="a nonzero first entry")
    for i in range(1, len(live)):
        if live[i] < live[i - 1]:
            raise GuardError("GL204", argument=arg, function=function,
                             expected="non-decreasing prefix sums over the live segments",
                             got=f"a decrease at index {i}")
    if tokens is not None and live[-1] != tokens:
        raise GuardError("GL204", argument=arg, function=function,
                         expected=f"seg_indptr[num_segments] == x's token count {tokens}",
                         got="a different total (stale num_segments or seg_indptr?)")
    return _lengths(live)


def _check_slots(wi: Sequence[int], ranks: Optional[Sequence[int]], num_slots: Optional[int],
                 max_rank: Optional[int], function: Optional[str], prefix: str) -> None:
    """The live segments' slots in the weight stack and in ``lora_ranks``, and their ranks in [0, max_rank]."""
    if num_slots is not None:
        bad = next((i for i, w in enumerate(wi) if not 0 <= w < num_slots), None)
        if bad is not None:
            raise GuardError("GL204", argument=prefix + "weight_indices", function=function,
                             expected=f"slots in [0, {num_slots}) (weights.shape[0])",
                             got=f"an out-of-range slot at segment {bad}")
    if ranks is None:
        return
    for i, w in enumerate(wi):
        if not 0 <= w < len(ranks):
            raise GuardError("GL204", argument=prefix + "weight_indices", function=function,
                             expected=f"slots in [0, {len(ranks)}) (lora_ranks.shape[0])",
                             got=f"an out-of-range slot at segment {i}")
        if ranks[w] < 0 or (max_rank is not None and ranks[w] > max_rank):
            bound = f"in [0, {max_rank}] (the stored rank)" if max_rank is not None else ">= 0"
            raise GuardError("GL204", argument=prefix + "lora_ranks", function=function,
                             expected=f"ranks {bound}",
                             got=f"a {'negative' if ranks[w] < 0 else 'larger'} rank for the adapter of "
                                 f"segment {i}")
