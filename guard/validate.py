"""Value checks of varlen and LoRA metadata: strict mode's, with at most one host read per call, and the
free ones every mode runs where the values are already on the host. The checks run on host copies cached
while their tensors are unchanged (``_cache``); under torch.compile they run as an op of the graph. Messages
name positions, never values.
"""
from __future__ import annotations

import operator
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

import torch

from . import _cache, _state
from ._cache import MISS, cache, unchanged
from .errors import GuardError, describe
from . import metadata as _metadata
from .metadata import (VarlenMetadata, check_index_tensor, host_copy, host_sequence, is_compiling, read_host,
                       token_offsets)


def read_together(tensors: Sequence[torch.Tensor], names: Sequence[str] = (),
                  lora: bool = False) -> Optional[list]:
    """Host tuples of ``tensors`` with one read per device for the uncached ones (one in all, as a call's
    metadata shares q's device); None when a read is not allowed now (CUDA graph capture): the value checks
    are then skipped. ``names`` name them in errors (a tensor on the meta device: GL103, or GL204 with
    ``lora``). A tensor listed twice is read once."""
    if is_compiling():
        return None
    out: list = [MISS] * len(tensors)
    todo: dict = {}  # device -> indices still to read
    first_of: dict = {}  # id -> first index of that tensor
    for i, t in enumerate(tensors):
        first = first_of.setdefault(id(t), i)
        if first != i:
            continue
        out[i] = cache.get(t, "host")
        if out[i] is MISS:
            if t.device.type == "meta":
                # No values to check (and reading would be NotImplementedError): a kernel would get none either.
                raise GuardError("GL204" if lora else "GL103", argument=names[i] if names else "metadata",
                                 expected="a tensor with values (not on the meta device)", got=describe(t))
            todo.setdefault(t.device, []).append(i)
    if any(_metadata.capturing(device) for device in todo):
        return None
    for indices in todo.values():
        flat = torch.cat([tensors[i].reshape(-1).to(torch.int64) for i in indices]) if len(indices) > 1 \
            else tensors[indices[0]].reshape(-1)
        _state.counters.cache_misses += 1
        _state.note_read(tensors[indices[0]])
        values = flat.tolist()
        start = 0
        for i in indices:
            n = tensors[i].numel()
            out[i] = tuple(values[start:start + n])
            start += n
            cache.put(tensors[i], "host", out[i])
    for i, t in enumerate(tensors):
        if out[i] is MISS:
            out[i] = out[first_of[id(t)]]
    return out


def prefetch(*values: Any) -> None:
    """Strict mode, before deriving: read all of a call's integer metadata tensors in one go, so that
    the derivation and the checks after it find their host copies cached (one read per call)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor) and v.layout is torch.strided and not v.is_meta
               and not (v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool)]
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

def plan_fit(plan: Any, cu_seqlens: Any, to_tokens: Optional[Callable[[tuple], tuple]] = None,
             function: Optional[str] = None, argument: str = "cu_seqlens") -> Optional[bool]:
    """Does ``plan`` (prepared metadata, or any object with ``cu_seqlens``) describe ``cu_seqlens`` as it is now?

    True: proven with no device read: the tensor the guard prepared it from, unchanged since (``_cache``), or
    its own tensors unchanged since they were built, or equal offsets read from the host. False: other
    offsets, or written since. None: only a device read could tell (the plan's own device tensor, on a plan
    the guard did not build). ``cu_seqlens=None`` asks about the plan's own offsets. With the cache off
    (``set_cache(False)``) a device tensor is read instead (nothing it wrote is seen otherwise).
    ``to_tokens`` turns host values of ``cu_seqlens`` into token offsets (the cuDNN path's element offsets)."""
    planned = getattr(plan, "cu_seqlens", None)
    own = plan._own if type(plan) is VarlenMetadata else None
    if cu_seqlens is None or cu_seqlens is planned or (
            own is not None and cu_seqlens is getattr(plan, "packed_indptrs", None)):
        if own is not None:
            if not unchanged(own[0], own[1]):
                return False
            if _cache.enabled or _cache.by_contents(own[1]):
                return True
        elif not isinstance(planned, torch.Tensor):
            return None
        tensor: Any = planned
    else:
        tensor = cu_seqlens
        if isinstance(tensor, torch.Tensor) and cache.made_from(plan, tensor):
            if own is None or unchanged(own[0], own[1]):
                return True
            return False
    offsets = getattr(plan, "host_cu_seqlens", None)
    if isinstance(tensor, torch.Tensor):
        if tensor.dim() != 1 or tensor.layout is not torch.strided or tensor.is_meta:
            return False
        host = host_copy(tensor, argument, function)
        if host is None:
            if _cache.enabled or offsets is None or is_compiling() or _metadata.capturing(tensor.device):
                return None if tensor is planned else False
            host = read_host(tensor, argument, function)  # the cache is off: a read is the only proof
    else:
        try:
            host = tuple(operator.index(x) for x in tensor)
        except TypeError:
            return False
    if to_tokens is not None and tensor is cu_seqlens:
        host = to_tokens(host)
    if offsets is None and tensor is not planned:
        offsets = host_copy(planned, argument, function) if isinstance(planned, torch.Tensor) else None
        if offsets is None:
            return False
    if offsets is None:
        return None
    offsets = tuple(offsets)
    if to_tokens is None:
        return host == offsets
    # The cuDNN path's offsets may be padded to a bucket with zero-length sequences.
    return host[:len(offsets)] == offsets and all(v == offsets[-1] for v in host[len(offsets):])


def plan_fits(plan: Any, cu_seqlens: Any) -> bool:
    """May ``plan``'s host offsets stand for ``cu_seqlens``? Only when proven (``plan_fit`` is True): a kernel
    that would otherwise read ``cu_seqlens`` itself. Never reads a device tensor (with the cache on)."""
    return plan_fit(plan, cu_seqlens) is True


def check_plan_source(function: Optional[str], plan: Any, cu_seqlens: Any, argument: str = "cu_seqlens",
                      to_tokens: Optional[Callable[[tuple], tuple]] = None) -> Optional[bool]:
    """GL103 where ``plan_fit`` is False: metadata prepared from other offsets (or from this tensor, or into
    its own tensors, before a write) must not silently replace the caller's cu_seqlens, nor be ignored.
    Returns ``plan_fit``'s answer (True: proven, None: unknown without a device read). Skipped while
    torch.compile traces (no identities then; strict mode compares values as the graph runs)."""
    if is_compiling():
        return None
    fit = plan_fit(plan, cu_seqlens, to_tokens, function, argument)
    if fit is not False:
        return fit
    raise GuardError(
        "GL103", argument=argument if cu_seqlens is not None else "metadata", function=function,
        expected="the cu_seqlens the metadata was prepared from (the same tensor, unchanged, or equal host "
                 "offsets)",
        got=f"metadata {describe(plan)} prepared from other offsets than cu_seqlens={describe(cu_seqlens)} "
            "(or written in place since it was prepared)",
        fix="Prepare the metadata from this cu_seqlens once per batch (prepare_varlen_metadata(cu_seqlens, q)) "
            "and pass both, or pass only one of them; prepare it again after writing to cu_seqlens.")


def check_varlen(function: Optional[str], *, q: Any, cu_seqlens: Any = None, sequence_lengths: Any = None,
                 max_seqlen: Any = None, metadata: Any = None, layout: str = "tokens",
                 metadata_name: str = "metadata", derived: bool = False) -> bool:
    """Validate what a varlen attention call will use. ``metadata`` is a ``VarlenMetadata`` (checked against
    its own tensors: a prepared object is re-validated, never trusted) or, for the cuDNN path, any object with
    ``packed_indptrs``. Raises GuardError GL103 / GL107; returns quietly when reads are not allowed (CUDA graph
    capture). Under torch.compile the checks run as an op of the graph (``compiled_check_varlen``). Returns True
when the values were checked here, now (False: skipped under capture, or left to the graph's op).

    In three steps: the prepared metadata against q (no read); every tensor that needs its values read in
    one packed host read; then the offsets each source implies, checked against each other, and the
    lengths and max_seqlen against them. ``derived``: the metadata is the guard's own plan for this call's
    cu_seqlens (built from the values checked here), so its tensors are not read back."""
    if is_compiling():
        compiled_check_varlen(function, q=q, cu_seqlens=cu_seqlens, sequence_lengths=sequence_lengths,
                              max_seqlen=max_seqlen, metadata=metadata, layout=layout, metadata_name=metadata_name)
        return False
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
        _check_prepared(prepared, function, T, HD, device, layout, metadata_name)
        if max_seqlen is prepared.max_seqlen or max_seqlen is prepared.flashinfer_max_seqlen:
            max_seqlen = None  # checked below as the metadata's own
    pending, names = _to_read(function, device, None if derived else prepared, metadata, cu_seqlens,
                              sequence_lengths, metadata_name)
    if max_seqlen is not None:
        _python_int(max_seqlen, "max_seqlen", function, "GL103")
    host_cu = host_sequence(cu_seqlens, "cu_seqlens", function) \
        if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor) else None
    hosts = read_together(pending, names) if pending else []
    if hosts is None:
        _skipped()
        return False
    got = dict(zip(names, hosts))
    if prepared is not None:
        offsets = check_metadata_values(function, prepared, got, T, HD, metadata_name)
    host_cu = got.get("cu_seqlens", host_cu)
    if host_cu is not None:
        # Without q there is no token count to tell element offsets from token offsets by.
        from_cu = token_offsets(host_cu, layout=layout if T is not None else "tokens", total_tokens=T,
                                elements_per_token=HD, function=function)
        if offsets is not None and not _same_batch(from_cu, offsets, layout):
            bad = _first_difference(from_cu, offsets)
            raise GuardError("GL103", argument="cu_seqlens", function=function,
                             expected="the offsets the metadata was prepared from",
                             got=f"different offsets (first difference at index {bad})")
        offsets = offsets or from_cu
    if "packed_indptrs" in got and T is not None:
        offsets = _packed_offsets(got["packed_indptrs"], offsets, function, T, HD)
    if offsets is None:
        return False
    lengths = _lengths(offsets)
    if "sequence_lengths" in got:
        _check_sequence_lengths(got["sequence_lengths"], sequence_lengths, lengths, layout, function)
    if max_seqlen is not None:
        check_max_seqlen(function, max_seqlen, max(lengths, default=0), lengths)
    return True


def _same_batch(tokens: tuple, offsets: tuple, layout: str) -> bool:
    """The same sequences: equal offsets, or (cuDNN path) ``tokens`` padded with zero-length sequences."""
    if layout == "tokens":
        return tokens == offsets
    return tokens[:len(offsets)] == offsets and all(v == offsets[-1] for v in tokens[len(offsets):])


def check_max_seqlen(function: Optional[str], max_seqlen: int, longest: int, lengths: Optional[Sequence[int]] = None,
                     argument: str = "max_seqlen", fix: Optional[str] = None) -> None:
    """GL103 when a caller's ``max_seqlen`` is below the longest sequence the guard knows of (above it is only
    a launch size: allowed)."""
    if max_seqlen >= longest:
        return
    which = f" {_argmax(lengths)}" if lengths else ""
    raise GuardError("GL103", argument=argument, function=function,
                     expected=f"at least the longest sequence of cu_seqlens ({longest} tokens)",
                     got=f"{argument}={max_seqlen}, shorter than sequence{which} of cu_seqlens",
                     detail="A short max_seqlen makes a kernel sized by it skip the tail of longer sequences.",
                     fix=fix or "Pass the true longest length (int((cu_seqlens[1:] - cu_seqlens[:-1]).max()), once "
                                "per batch), or omit max_seqlen and let the guard derive it.")


METADATA_FIX = ("Pass the object prepare_varlen_metadata returned as it is (a dataclasses.replace-d copy or a write to "
                "its tensors describes another batch); prepare it again for each new batch.")


def check_metadata_values(function: Optional[str], meta: VarlenMetadata, got: dict, T: Optional[int], HD: int,
                          name: str = "metadata") -> tuple:
    """A ``VarlenMetadata`` against itself: its host offsets valid (for q's ``T`` when known), and every field
    that ``got`` holds the host values of (``<name>.cu_seqlens``, ``.seq_lens``, ``.sequence_lengths``,
    ``.packed_indptrs``) and its ints consistent with them. Returns the offsets. A hand-built or
    ``dataclasses.replace``-d object gets the same checks as a prepared one."""
    offsets = host_sequence(meta.host_cu_seqlens, name + ".host_cu_seqlens", function)
    offsets = token_offsets(offsets, layout="tokens", total_tokens=T, elements_per_token=None,
                            argument=name + ".host_cu_seqlens", function=function)
    lengths = _lengths(offsets)
    longest = max(lengths, default=0)
    B = len(lengths)
    if meta.batch_size != B or meta.total_tokens != offsets[-1]:
        raise GuardError("GL103", argument=name, function=function,
                         expected=f"batch_size={B} and total_tokens={offsets[-1]} (its host_cu_seqlens)",
                         got=f"batch_size={meta.batch_size!r}, total_tokens={meta.total_tokens!r}",
                         fix=METADATA_FIX)
    own = got.get(name + ".cu_seqlens")
    if own is not None and own != offsets:
        raise GuardError("GL103", argument=name + ".cu_seqlens", function=function,
                         expected=f"the offsets of {name}.host_cu_seqlens",
                         got=f"different offsets (first difference at index {_first_difference(own, offsets)})",
                         fix=METADATA_FIX)
    seq = got.get(name + ".seq_lens")
    if seq is not None and list(seq) != lengths:
        raise GuardError("GL103", argument=name + ".seq_lens", function=function,
                         expected="cu_seqlens[1:] - cu_seqlens[:-1] of the metadata",
                         got=f"a different length at index {_first_difference(seq, lengths)}",
                         fix=METADATA_FIX)
    padded = meta.padded_batch_size if meta.layout != "tokens" else B
    seq = got.get(name + ".sequence_lengths")
    if seq is not None:
        if type(padded) is not int or padded < B:
            raise GuardError("GL103", argument=name + ".padded_batch_size", function=function,
                             expected=f"an int >= batch_size={B}", got=describe(padded),
                         fix=METADATA_FIX)
        want = lengths + [0] * (padded - B)
        if list(seq) != want:
            raise GuardError("GL103", argument=name + ".sequence_lengths", function=function,
                             expected="the metadata's lengths (zero-padded to padded_batch_size)",
                             got=f"{len(seq)} entries, first difference at index {_first_difference(seq, want)}",
                         fix=METADATA_FIX)
    _python_int(meta.max_seqlen, name + ".max_seqlen", function, "GL103")
    check_max_seqlen(function, meta.max_seqlen, longest, lengths, argument=name + ".max_seqlen", fix=METADATA_FIX)
    if meta.layout != "tokens":
        fmax: Any = meta.flashinfer_max_seqlen
        _python_int(fmax, name + ".flashinfer_max_seqlen", function, "GL103")
        check_max_seqlen(function, fmax, longest, lengths, argument=name + ".flashinfer_max_seqlen",
                         fix=METADATA_FIX)
        packed = got.get(name + ".packed_indptrs")
        per_token = meta.elements_per_token
        if packed is not None:
            section = [x * per_token for x in offsets] + [offsets[-1] * per_token] * (padded - B) \
                if type(per_token) is int else None
            n = padded + 1
            sections = 3 if meta.layout == "cudnn" else 2
            ok = section is not None and len(packed) == sections * n and list(packed[:n]) == section
            if ok and meta.layout == "cudnn":
                ok = list(packed[n:2 * n]) == section and list(packed[2 * n:]) == section
            elif ok:  # vLLM's v section is in v's own token stride: the same sequences, some stride
                v = packed[n:]
                ok = v[0] == 0 and all(v[i + 1] - v[i] >= 0 for i in range(len(v) - 1))
            if not ok:
                raise GuardError("GL103", argument=name + ".packed_indptrs", function=function,
                                 expected=f"{sections} sections of the metadata's offsets times "
                                          f"elements_per_token={per_token!r}, {n} entries each",
                                 got=f"{len(packed)} entries that differ",
                         fix=METADATA_FIX)
    return offsets


def check_plan_facts(function: Optional[str], meta: VarlenMetadata, q: Any, name: str = "metadata") -> bool:
    """The checks of ``check_metadata_values`` that cost no device read (a ``VarlenMetadata`` the guard did not
    build: hand-made or ``dataclasses.replace``-d): its ints against its host offsets, and those of its tensors
    on the host against them. True when every tensor it holds was checked (all on the host)."""
    got = {}
    complete = True
    for field in ("cu_seqlens", "seq_lens", "sequence_lengths", "packed_indptrs"):
        t = getattr(meta, field)
        if t is None or (field == "sequence_lengths" and t is meta.seq_lens):
            continue
        if not isinstance(t, torch.Tensor):
            raise GuardError("GL103", argument=f"{name}.{field}", function=function, expected="a tensor",
                             got=describe(t))
        values = host_copy(t, f"{name}.{field}", function)
        if values is None:
            complete = False
        else:
            got[f"{name}.{field}"] = values
    shape = getattr(q, "shape", None)
    T = int(shape[0]) if shape is not None and len(shape) else None
    check_metadata_values(function, meta, got, T, 1, name)
    return complete


def _check_prepared(prepared: VarlenMetadata, function: Optional[str], T: Optional[int], HD: int, device: Any,
                    layout: str, name: str = "metadata") -> None:
    """Prepared metadata made for q: its token count, its device and, for the cuDNN path, its layout."""
    if prepared.layout not in ("tokens", "cudnn", "vllm"):
        raise GuardError("GL103", argument=name + ".layout", function=function,
                         expected="'tokens', 'cudnn' or 'vllm'", got=describe(prepared.layout))
    if T is not None and prepared.total_tokens != T:
        raise GuardError("GL103", argument=name, function=function,
                         expected=f"metadata prepared for q's token count T={T}",
                         got=f"metadata for {describe(prepared.total_tokens)} tokens (a stale plan?)")
    if not isinstance(prepared.cu_seqlens, torch.Tensor):
        raise GuardError("GL103", argument=name + ".cu_seqlens", function=function, expected="a tensor",
                         got=describe(prepared.cu_seqlens))
    if device is not None and prepared.device != device:
        raise GuardError("GL103", argument=name, function=function,
                         expected=f"metadata on {device} (q's device)", got=f"metadata on {prepared.device}")
    if layout == "cudnn" and (prepared.layout != "cudnn" or prepared.elements_per_token != HD):
        raise GuardError("GL107", argument=name, function=function,
                         expected=f"metadata prepared with layout=\"cudnn\" for H*D={HD}",
                         got=f"layout {prepared.layout!r} with H*D={describe(prepared.elements_per_token)}")


def _to_read(function: Optional[str], device: Any, prepared: Optional[VarlenMetadata], metadata: Any,
             cu_seqlens: Any, sequence_lengths: Any, metadata_name: str = "metadata") -> tuple:
    """(tensors whose values the check needs, their names): each checked for kind and device first. A
    prepared object's own tensors are read too (strict mode trusts no object: one may have been written in
    place or ``dataclasses.replace``-d since it was built)."""
    pending: list = []
    names: list = []
    if prepared is not None:
        for field in ("cu_seqlens", "seq_lens", "sequence_lengths", "packed_indptrs"):
            t = getattr(prepared, field)
            if t is None or any(t is p for p in pending):
                continue
            argument = f"{metadata_name}.{field}"
            _int_tensor(t, argument, function, "GL103", device)
            if t.layout is not torch.strided:
                check_index_tensor(t, argument, function)
            pending.append(t)
            names.append(argument)
    if isinstance(cu_seqlens, torch.Tensor) and prepared is None and isinstance(metadata, VarlenMetadata) \
            and cu_seqlens is metadata.cu_seqlens:
        pass  # the guard's own plan for this call, built from the offsets it checked
    elif isinstance(cu_seqlens, torch.Tensor) and not any(cu_seqlens is p for p in pending):
        check_index_tensor(cu_seqlens, "cu_seqlens", function)
        _int_tensor(cu_seqlens, "cu_seqlens", function, "GL103", device)
        pending.append(cu_seqlens)
        names.append("cu_seqlens")
    elif isinstance(cu_seqlens, torch.Tensor):
        names.append("cu_seqlens")  # the same tensor as one of the metadata's: read once, checked under both names
        pending.append(cu_seqlens)
    if metadata is not None and not isinstance(metadata, VarlenMetadata):
        packed = getattr(metadata, "packed_indptrs", None)
        if packed is None:
            raise GuardError("GL107", argument="forward_metadata", function=function,
                             expected="a VarlenMetadata or an object with packed_indptrs",
                             got=f"{type(metadata).__name__} without packed_indptrs")
        check_index_tensor(packed, "forward_metadata.packed_indptrs", function, code="GL107", min_numel=3)
        _int_tensor(packed, "forward_metadata.packed_indptrs", function, "GL107", device)
        pending.append(packed)
        names.append("packed_indptrs")
    if sequence_lengths is not None and not (isinstance(metadata, VarlenMetadata) and (
            sequence_lengths is metadata.sequence_lengths or sequence_lengths is metadata.seq_lens)):
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
                         got=f"a different length at index {bad}",
                         fix="Pass cu_seqlens[1:] - cu_seqlens[:-1] of the same offsets (computed once per batch), or "
                             "leave sequence_lengths out and let the guard derive it.")


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
    (inconsistent) or GL203 (max_len == 0 with tokens). Under torch.compile the checks run as an op of the
    graph (``compiled_check_lora``).

    In two steps: kinds, devices and sizes of what is given, collected for one packed read; then the values
    (``_check_lora_values``)."""
    if is_compiling():
        compiled_check_lora(function, seg_indptr=seg_indptr, num_segments=num_segments,
                            weight_indices=weight_indices, lora_ranks=lora_ranks, seg_lens=seg_lens, max_len=max_len,
                            tokens=tokens, num_slots=num_slots, max_rank=max_rank, permutation=permutation,
                            prefix=prefix)
        return
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


# -- strict mode under torch.compile ------------------------------------------------------------------
# Reading values while Dynamo traces would be a graph break (or a failure with fullgraph=True), and checking
# then would check the trace, not the run. So a strict call under torch.compile adds one op to the graph: it
# gets the tensors and ints the checks need, runs them when the graph runs (each call, on that call's
# values), and raises the same GuardError. It returns nothing; ``token`` is declared written so that no
# compiler removes it as dead code (nothing is written to it).

_TOKEN = torch.empty(0)
_VARLEN_TENSORS = ("cu_seqlens", "sequence_lengths", "m.cu_seqlens", "m.seq_lens", "m.sequence_lengths",
                   "m.packed_indptrs")
_VARLEN_INTS = ("T", "HD", "max_seqlen", "m.max_seqlen", "m.batch_size", "m.total_tokens", "m.padded_batch_size",
                "m.flashinfer_max_seqlen", "m.elements_per_token")
_LORA_TENSORS = ("seg_indptr", "weight_indices", "lora_ranks", "seg_lens", "permutation")
_LORA_INTS = ("num_segments", "max_len", "tokens", "num_slots", "max_rank")


@torch.library.custom_op("guardlint::strict_check", mutates_args=("token",))
def _strict_check_op(token: torch.Tensor, tensors: list[torch.Tensor], ints: list[int], spec: str) -> None:
    """Runs the strict checks ``spec`` names on these values (see ``compiled_check_varlen``)."""
    kind, function, layout, tensor_names, int_names, host_n, device, metadata_name = spec.split("|")
    t = dict(zip(tensor_names.split(",") if tensor_names else (), tensors))
    n = int(host_n)
    i = dict(zip(int_names.split(",") if int_names else (), ints[n:]))
    if kind == "lora":
        check_lora(function, seg_indptr=t.get("seg_indptr"), num_segments=i.get("num_segments"),
                   weight_indices=t.get("weight_indices"), lora_ranks=t.get("lora_ranks"), seg_lens=t.get("seg_lens"),
                   max_len=i.get("max_len"), tokens=i.get("tokens"), num_slots=i.get("num_slots"),
                   max_rank=i.get("max_rank"), permutation=t.get("permutation"), prefix=layout)
        return
    q = SimpleNamespace(shape=torch.Size((i["T"], i["HD"])) if "T" in i else None,
                        device=torch.device(device) if device else None)
    metadata: Any = None
    if "m.cu_seqlens" in t:
        # Rebuilt as it was (a hand-made object may lack fields: they are checked as such, hence the Any).
        fields: dict[str, Any] = dict(
            layout=kind[len("varlen-"):], cu_seqlens=t["m.cu_seqlens"], seq_lens=t.get("m.seq_lens"),
            max_seqlen=i.get("m.max_seqlen"), batch_size=i.get("m.batch_size"), total_tokens=i.get("m.total_tokens"),
            host_cu_seqlens=tuple(ints[:n]), sequence_lengths=t.get("m.sequence_lengths", t.get("m.seq_lens")),
            packed_indptrs=t.get("m.packed_indptrs"), flashinfer_max_seqlen=i.get("m.flashinfer_max_seqlen"),
            padded_batch_size=i.get("m.padded_batch_size"), elements_per_token=i.get("m.elements_per_token"))
        metadata = VarlenMetadata(**fields)
    elif "m.packed_indptrs" in t:
        metadata = SimpleNamespace(packed_indptrs=t["m.packed_indptrs"])
    check_varlen(function, q=q, cu_seqlens=t.get("cu_seqlens"), sequence_lengths=t.get("sequence_lengths"),
                 max_seqlen=i.get("max_seqlen"), metadata=metadata, layout=layout, metadata_name=metadata_name)


@_strict_check_op.register_fake
def _(token, tensors, ints, spec):
    return None


def _int_or_none(value: Any, argument: str, function: Optional[str], code: str) -> Any:
    """An int the op can carry (a Python or symbolic int), None for None; anything else fails now, as the
    eager checks would."""
    if value is None:
        return None
    if type(value) is bool or not isinstance(value, (int, torch.SymInt)):
        raise GuardError(code, argument=argument, function=function, expected="a Python int >= 0",
                         got=describe(value))
    return value


def _emit(kind: str, function: Optional[str], layout: str, tensors: dict, ints: dict, host: Sequence[int] = (),
          device: str = "", metadata_name: str = "metadata") -> None:
    tensor_names = [k for k, v in tensors.items() if v is not None]
    int_names = [k for k, v in ints.items() if v is not None]
    spec = "|".join((kind, function or "", layout, ",".join(tensor_names), ",".join(int_names), str(len(host)),
                     device, metadata_name))
    _strict_check_op(_TOKEN, [tensors[k] for k in tensor_names], [*host, *(ints[k] for k in int_names)], spec)


def compiled_check_varlen(function: Optional[str], *, q: Any, cu_seqlens: Any, sequence_lengths: Any,
                          max_seqlen: Any, metadata: Any, layout: str, metadata_name: str = "metadata") -> None:
    """``check_varlen`` as an op of the graph torch.compile is building (see above)."""
    shape = getattr(q, "shape", None)
    ints: dict = {"T": None, "HD": None}
    if shape is not None and len(shape):
        hd = 1
        for d in shape[1:]:
            hd = hd * d
        ints = {"T": shape[0], "HD": hd}
    device = getattr(q, "device", None)
    if not isinstance(cu_seqlens, torch.Tensor) and cu_seqlens is not None:
        cu_seqlens = torch.tensor(host_sequence(cu_seqlens, "cu_seqlens", function), dtype=torch.int64)
    tensors = {"cu_seqlens": cu_seqlens, "sequence_lengths": sequence_lengths}
    for name, value in tensors.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise GuardError("GL103", argument=name, function=function, expected="an integer tensor",
                             got=describe(value))
    ints["max_seqlen"] = _int_or_none(max_seqlen, "max_seqlen", function, "GL103")
    host: Sequence[int] = ()
    kind = "varlen-tokens"
    if isinstance(metadata, VarlenMetadata):
        kind = "varlen-" + metadata.layout
        host = tuple(metadata.host_cu_seqlens)
        tensors.update({"m.cu_seqlens": metadata.cu_seqlens, "m.seq_lens": metadata.seq_lens,
                        "m.sequence_lengths": metadata.sequence_lengths,
                        "m.packed_indptrs": metadata.packed_indptrs})
        for name in ("max_seqlen", "batch_size", "total_tokens", "padded_batch_size", "flashinfer_max_seqlen",
                     "elements_per_token"):
            ints["m." + name] = _int_or_none(getattr(metadata, name), f"{metadata_name}.{name}", function, "GL103")
    elif metadata is not None:
        tensors["m.packed_indptrs"] = getattr(metadata, "packed_indptrs", None)
        if not isinstance(tensors["m.packed_indptrs"], torch.Tensor):
            raise GuardError("GL107", argument=metadata_name, function=function,
                             expected="a VarlenMetadata or an object with packed_indptrs",
                             got=f"{type(metadata).__name__} without packed_indptrs")
    _emit(kind, function, layout, tensors, ints, host, "" if device is None else str(device), metadata_name)


def compiled_check_lora(function: Optional[str], *, seg_indptr: Any, num_segments: Any, weight_indices: Any,
                        lora_ranks: Any, seg_lens: Any, max_len: Any, tokens: Any, num_slots: Any, max_rank: Any,
                        permutation: Any, prefix: str) -> None:
    """``check_lora`` as an op of the graph torch.compile is building (see above)."""
    tensors = {"seg_indptr": seg_indptr, "weight_indices": weight_indices, "lora_ranks": lora_ranks,
               "seg_lens": seg_lens, "permutation": permutation}
    for name, value in tensors.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise GuardError("GL204", argument=prefix + name, function=function, expected="an integer tensor",
                             got=describe(value))
    ints = {"num_segments": _int_or_none(num_segments, prefix + "num_segments", function, "GL204"),
            "max_len": _int_or_none(max_len, prefix + "max_len", function, "GL204"),
            "tokens": tokens, "num_slots": num_slots, "max_rank": max_rank}
    _emit("lora", function, prefix, tensors, ints)
