"""Segmented LoRA GEMMs: shrink (``sgemm_lora_a``), expand (``sgemm_lora_b``, ``qkv_lora_b``) and the four
MLA absorbed ``kv_b_proj`` steps (``step_a_q``, ``step_b_q``, ``step_a_v``, ``step_b_v``).

Each public function checks its inputs (GL205), then makes one Triton launch (see ``lora.triton``):
directly when eager, through a ``torch.library`` custom op (``guardlint::<name>``) when torch.compile or a
dispatch mode is watching; each has an exact torch reference (``<name>_reference``) that is its
definition. Math, shapes and the grid are in the docstrings below and in ``lora.triton``.
"""
from __future__ import annotations

import itertools
import operator
import weakref
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from guardlint.guard import GuardError, _state as _guard_state, describe, guard_lora
from guardlint.guard._cache import fingerprint as _fingerprint, unchanged as _unchanged
from guardlint.guard.metadata import capturing as _capturing, read_host as _read_host
from guardlint.guard.validate import permutation_error

from . import triton as _k

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)


@dataclass(kw_only=True)
class LoRABatchInfo:
    """Per-batch segment metadata of the LoRA GEMMs, in the engine's field order (keywords only: the
    order changed between releases).

    ``seg_indptr`` (int32, ``(num_segments + 1,)`` or a longer CUDA-graph buffer whose tail is stale):
    prefix sums of segment lengths over sorted token positions. ``weight_indices`` (int32,
    ``(num_segments,)`` or longer): slot per segment. ``lora_ranks`` (int32, ``(num_slots,)``): rank per
    slot, 0 = no adapter. ``scalings`` (float32, ``(num_slots,)``). ``max_len``: longest live segment, a
    host int; ``seg_lens``: ``diff(seg_indptr)``; the guard derives both when missing. ``permutation``
    (int32/int64, ``(S,)``): sorted position ``p`` reads ``x[permutation[p]]`` and writes
    ``out[permutation[p]]``; ``None`` = identity. All tensors on the device of x.

    Contents the kernels cannot use still give defined rows (``lora.triton``'s header has the rule, the
    references follow it): segments overlap nowhere, a slot or rank out of range is no adapter, and rows
    of no segment or no adapter are 0 (shrink) or left as they are (expand). Host tensors are checked
    instead (GL204) in every mode but off; device tensors in strict mode, which reads them once.
    """

    use_cuda_graph: bool
    bs: int
    num_segments: int
    seg_indptr: Tensor
    weight_indices: Tensor
    lora_ranks: Tensor
    scalings: Tensor
    max_len: Optional[int] = None
    seg_lens: Optional[Tensor] = None
    permutation: Optional[Tensor] = None


class _Batch(NamedTuple):
    """Batch info checked against x and the weight stack, unpacked for the custom ops."""

    seg_indptr: Tensor
    weight_indices: Tensor
    lora_ranks: Tensor
    scalings: Tensor
    permutation: Optional[Tensor]
    num_segments: int
    max_len: Optional[int]


# ---------------------------------------------------------------------------------------------------------
# Input checks: every user-caused misfit is a GuardError before anything launches.


def _bad(function: str, argument: str, expected: str, got) -> GuardError:
    return GuardError("GL205", argument=argument, expected=expected,
                      got=got if isinstance(got, str) else describe(got), function=function)


def _check_data(function: str, name: str, t, ndim: int, device: Optional[torch.device] = None,
                dtype: Optional[torch.dtype] = None) -> None:
    if not isinstance(t, Tensor):
        raise _bad(function, name, f"a {ndim}-D torch.Tensor", t)
    if t.dim() != ndim:
        raise _bad(function, name, f"a {ndim}-D tensor", t)
    if dtype is None and t.dtype not in _FLOATS:
        raise _bad(function, name, "dtype float16, bfloat16 or float32", t)
    if dtype is not None and t.dtype != dtype:
        raise _bad(function, name, f"dtype {dtype} (the input's)", t)
    if device is not None and t.device != device:
        raise _bad(function, name, f"a tensor on {device} (the input's device)", t)


def _check_output(function: str, out, shape: tuple, x: Tensor) -> None:
    _check_data(function, "base_output", out, len(shape), x.device, x.dtype)
    if out.shape != shape:
        raise _bad(function, "base_output", f"shape {shape}", out)
    # Updated in place: elements that share memory would be added into by several programs at once, and
    # the result would depend on their timing.
    if not out.is_contiguous() and _may_overlap(out.shape, out.stride()):
        raise GuardError("GL205", argument="base_output", function=function,
                         expected="a tensor whose elements do not share memory (each dimension's stride at least "
                                  "the span of the dimensions with smaller strides; no expand() or overlapping "
                                  "as_strided())",
                         got=f"{describe(out)} with strides {tuple(out.stride())}",
                         fix="Pass a tensor with its own memory per element (base_output.contiguous(), or the "
                             "layer's output itself), then read the result from it.")


def _may_overlap(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether two elements of a tensor with these sizes and strides may share memory: taken dimension by
    dimension in order of stride, each stride must step past everything the smaller ones span. (A few
    interleaved layouts that do not overlap fail this too; they are refused as well.)"""
    if 0 in shape:
        return False
    span = 0
    for stride, size in sorted((st, n) for st, n in zip(strides, shape) if n > 1):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _check_meta(function: str, name: str, t, device: torch.device, min_len: int, floating: bool = False) -> Tensor:
    kind = "floating" if floating else "int32/int64"
    if not isinstance(t, Tensor) or t.dim() != 1:
        raise _bad(function, f"batch_info.{name}", f"a 1-D {kind} tensor", t)
    if (t.dtype not in _FLOATS + (torch.float64,)) if floating else (t.dtype not in _INTS):
        raise _bad(function, f"batch_info.{name}", f"a 1-D {kind} tensor", t)
    if t.device != device:
        raise _bad(function, f"batch_info.{name}", f"a tensor on {device} (the input's device)", t)
    if t.shape[0] < min_len:
        raise _bad(function, f"batch_info.{name}", f"at least {min_len} entries", t)
    # The kernels index these buffers with unit stride.
    return t.contiguous()


# Batch infos that passed _check_batch: id -> (weak reference, field values, device, tokens, (slots, stored
# rank), _Batch, fingerprints of the fields whose values were checked).
# Every layer of a forward calls several kernels with one batch info; checking it once saves ~3 µs a call.
_checked: dict = {}
_CHECKED_CAPACITY = 8


def _check_batch(function: str, x: Tensor, batch_info, num_slots: int, max_rank: Optional[int] = None) -> _Batch:
    """Check batch_info against x (S tokens) and the weight stack (num_slots, stored rank max_rank) and
    unpack it.

    A batch info seen before with the same field objects (compared by identity, so a field set to
    another tensor or int is checked again), x's device, token count, num_slots and max_rank, and the same
    contents (host) or versions (device) of the fields whose values were read, is not re-checked."""
    entry = _checked.get(id(batch_info))
    if entry is not None and entry[0]() is batch_info and entry[3] == x.shape[0] \
            and entry[4] == (num_slots, max_rank) and entry[2] == x.device:
        now = getattr(batch_info, "__dict__", None)
        if now is not None and len(now) == len(entry[1]) and all(map(operator.is_, now.values(), entry[1])) \
                and _still(entry[5], entry[6]):
            return entry[5]
    batch = _check_batch_fields(function, x, batch_info, num_slots, max_rank)
    fields = getattr(batch_info, "__dict__", None)
    # A contiguous copy of a strided field would go stale when the caller updates the field in place.
    copied = (batch.seg_indptr is not batch_info.seg_indptr or batch.weight_indices is not batch_info.weight_indices
              or batch.lora_ranks is not batch_info.lora_ranks or batch.scalings is not batch_info.scalings
              or batch.permutation is not getattr(batch_info, "permutation", None))
    if fields is not None and not copied:
        try:
            ref = weakref.ref(batch_info)
        except TypeError:  # __slots__ without __weakref__: checked at every call
            return batch
        if len(_checked) >= _CHECKED_CAPACITY:
            _checked.pop(next(iter(_checked)))
        _checked[id(batch_info)] = (ref, tuple(fields.values()), x.device, x.shape[0], (num_slots, max_rank), batch,
                                    _fingerprints(batch))
    return batch


def _checked_fields(batch: _Batch) -> tuple:
    """The fields whose values were checked: the permutation; on the host, also seg_indptr, weight_indices and
    lora_ranks."""
    if batch.seg_indptr.device.type != "cpu":
        return (batch.permutation,)
    return (batch.permutation, batch.seg_indptr, batch.weight_indices, batch.lora_ranks)


def _fingerprints(batch: _Batch):
    """What the checked fields hold (so an update is checked again) and whether the mode let them be checked.
    Host fields are compared by contents, not by version counter: a write through a numpy view of the same
    memory changes the values without bumping ``_version``."""
    # Under torch.compile the fields are not traceable values (nor are the values checked).
    if _is_compiling():
        return None
    if torch._C._len_torch_dispatch_stack():
        # Under a dispatch mode (fake tensors) the real fields' memory is read as it is, not through the mode.
        with _disable_current_modes():
            return _fingerprints(batch)
    return (tuple(None if t is None else _fingerprint(_host_array(t)) for t in _checked_fields(batch)),
            _guard_state.current == _guard_state.OFF)


def _host_array(t: Tensor):
    """A host tensor as a numpy view of its memory (compared by address, shape, dtype and bytes: no tensor
    method runs, so a call served from the cache makes no Tensor host read), else the tensor itself (a device
    tensor: compared by version and storage)."""
    if t.device.type == "cpu" and t.layout is torch.strided and not t.requires_grad:
        try:
            return t.numpy()
        except (RuntimeError, TypeError, ValueError):
            pass
    return t


def _still(batch: _Batch, fps) -> bool:
    """Do the checked fields still hold what ``_fingerprints`` saw, in the same mode? While torch.compile
    traces, a check made while tracing stands (values are not checked there); one made eagerly is made again."""
    if _is_compiling():
        return fps is None
    if torch._C._len_torch_dispatch_stack():
        with _disable_current_modes():
            return _still(batch, fps)
    return fps is not None and fps[1] == (_guard_state.current == _guard_state.OFF) and all(
        fp is None or _unchanged(_host_array(t), fp) for t, fp in zip(_checked_fields(batch), fps[0]))


def _check_batch_fields(function: str, x: Tensor, batch_info, num_slots: int,
                        max_rank: Optional[int] = None) -> _Batch:
    if isinstance(batch_info, tuple):
        # Positional fields whose order changed between releases, and none can be set (the guard completes a
        # batch info by setting seg_lens and max_len on a copy).
        raise GuardError("GL204", argument="batch_info", function=function,
                         expected="a LoRABatchInfo (keywords only) or a mutable object with its fields",
                         got=f"{type(batch_info).__name__}, a tuple",
                         fix="Build guardlint.kernels.lora.LoRABatchInfo(...) (or the engine's own LoRABatchInfo) "
                             "with keywords instead of a namedtuple.")
    missing = [f for f in ("num_segments", "seg_indptr", "weight_indices", "lora_ranks", "scalings")
               if not hasattr(batch_info, f)]
    if missing:
        raise _bad(function, "batch_info", "a LoRABatchInfo", f"{type(batch_info).__name__} without "
                   f"{', '.join(missing)}")
    num_segments = batch_info.num_segments
    if not isinstance(num_segments, int) or isinstance(num_segments, bool) or num_segments < 0:
        raise _bad(function, "batch_info.num_segments", "a Python int >= 0", num_segments)
    max_len = getattr(batch_info, "max_len", None)
    # The grid is sized by the token count, not by max_len, so seg_lens alone is enough (as in the engine);
    # with neither, the batch info is the one the engine rejects, and so is it here.
    if max_len is None and getattr(batch_info, "seg_lens", None) is None:
        raise GuardError(
            "GL201", argument="batch_info", expected="max_len (a Python int) or seg_lens",
            got=f"max_len=None, seg_lens={describe(getattr(batch_info, 'seg_lens', None))}", function=function,
            detail="LoRA batch_info must provide max_len or seg_lens.")
    if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 0):
        raise _bad(function, "batch_info.max_len", "a Python int >= 0 (a tensor would cost a device sync)",
                   max_len)
    device = x.device
    seg_indptr = _check_meta(function, "seg_indptr", batch_info.seg_indptr, device, num_segments + 1)
    weight_indices = _check_meta(function, "weight_indices", batch_info.weight_indices, device, num_segments)
    lora_ranks = _check_meta(function, "lora_ranks", batch_info.lora_ranks, device, num_slots)
    scalings = _check_meta(function, "scalings", batch_info.scalings, device, num_slots, floating=True)
    permutation = getattr(batch_info, "permutation", None)
    if permutation is not None:
        permutation = _check_meta(function, "permutation", permutation, device, x.shape[0])
        if permutation.shape[0] != x.shape[0]:
            raise _bad(function, "batch_info.permutation", f"{x.shape[0]} entries (one per token of x)",
                       permutation)
        if not _is_compiling():
            if permutation.device.type == "cpu":
                # Host values cost no device read: checked in every mode.
                _check_permutation_values(function, permutation.tolist())
            elif (permutation.device.type == "cuda" and _guard_state.current != _guard_state.OFF
                  and not _capturing(permutation.device)):
                # A duplicate or missing entry would leave rows unwritten: read once per permutation
                # version (the layers of a forward share one read). Under CUDA-graph capture nothing can be
                # read; the kernels then skip out-of-range entries, never reading or writing through them.
                _check_permutation_values(function, _read_host(permutation, "batch_info.permutation",
                                                               function))
    if seg_indptr.device.type == "cpu" and _guard_state.current != _guard_state.OFF and not _is_compiling():
        # Host values cost no device read: what the kernels would quietly define (lora.triton's header) is
        # reported instead. On the device only strict mode reads them.
        _check_host_values(function, seg_indptr[: num_segments + 1].tolist(), weight_indices[:num_segments].tolist(),
                           lora_ranks.tolist(), x.shape[0], num_slots, max_rank)
    return _Batch(seg_indptr, weight_indices, lora_ranks, scalings, permutation, num_segments, max_len)


def _check_host_values(function: str, indptr: Sequence[int], slots: Sequence[int], ranks: Sequence[int], tokens: int,
                       num_slots: int, max_rank: Optional[int]) -> None:
    """GL204 for live segments the kernels would give no rows or no adapter: seg_indptr not prefix sums
    from 0 within x's tokens, a slot outside the weight stack, a used slot's rank outside [0, max_rank].
    Messages name positions, never values."""
    arg = "batch_info.seg_indptr"
    fix = ("Rebuild seg_indptr for this batch: prefix sums of the segment lengths from 0, ending at most at "
           "x.shape[0] (or keep num_segments to the live segments).")
    if indptr[0] != 0:
        raise GuardError("GL204", argument=arg, function=function, expected="prefix sums starting at 0",
                         got="a nonzero first entry", fix=fix)
    for i in range(1, len(indptr)):
        if indptr[i] < indptr[i - 1]:
            raise GuardError("GL204", argument=arg, function=function,
                             expected="non-decreasing prefix sums over the live segments",
                             got=f"a decrease at index {i}", fix=fix)
    if indptr[-1] > tokens:
        raise GuardError("GL204", argument=arg, function=function,
                         expected=f"offsets in [0, {tokens}] (x's token count) over the live segments",
                         got=f"an offset past the tokens at index {len(indptr) - 1}", fix=fix)
    for g, slot in enumerate(slots):
        if not 0 <= slot < num_slots:
            raise GuardError("GL204", argument="batch_info.weight_indices", function=function,
                             expected=f"slots in [0, {num_slots}) (the weight stack's)",
                             got=f"an out-of-range slot at segment {g}",
                             fix="Map each segment to a loaded adapter's slot (slot 0 with rank 0 for no adapter).")
        if max_rank is not None and not 0 <= ranks[slot] <= max_rank:
            raise GuardError("GL204", argument="batch_info.lora_ranks", function=function,
                             expected=f"ranks in [0, {max_rank}] (the stored rank) for the slots in use",
                             got=f"an out-of-range rank for slot {slot} (segment {g})",
                             fix="Set lora_ranks[slot] to the adapter's rank, at most the stack's stored rank.")


def _check_permutation_values(function: str, values: Sequence[int]) -> None:
    bad = permutation_error(values)
    if bad is not None:
        raise GuardError("GL204", argument="batch_info.permutation", function=function,
                         expected=f"a permutation of range({len(values)}) (each token of x once)", got=bad,
                         fix="Build permutation as the argsort of the tokens' segment order (torch.argsort of "
                             "the per-token adapter index, stable), one entry per token of x.")


def _check_weights(function: str, name: str, w, x: Tensor) -> None:
    _check_data(function, name, w, 3, x.device, x.dtype)
    if w.shape[0] < 1:
        raise _bad(function, name, "at least one slot (num_slots, ...)", w)


def _rank_of(function: str, name: str, stored: int, w: Tensor, what: str) -> int:
    if stored < 1:
        raise _bad(function, name, f"a stored rank >= 1 ({what})", w)
    return stored


def _mla_dims(function: str, name: str, lora_b: Tensor, heads: int, qk_nope_head_dim: int,
              v_head_dim: int) -> None:
    for arg, v in (("qk_nope_head_dim", qk_nope_head_dim), ("v_head_dim", v_head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _bad(function, arg, "a Python int >= 1", v)
    rows = heads * (qk_nope_head_dim + v_head_dim)
    if lora_b.shape[1] != rows:
        raise _bad(function, name, f"(num_slots, H * (qk_nope_head_dim + v_head_dim) = {rows}, R)", lora_b)


def _needs_grad(tensors) -> Optional[str]:
    """The first parameter name whose tensor requires grad while grad mode is on (None: no graph needed)."""
    if not _grad_enabled():
        return None
    return next((name for name, t in tensors if isinstance(t, Tensor) and t.requires_grad), None)


def _resolve_backend(function: str, backend: Optional[str], x: Tensor, *inputs: tuple) -> str:
    """The backend that runs the call; ``inputs`` are (parameter name, value) pairs of the tensors it reads
    and writes. The Triton kernels have no backward: when one of them requires grad
    (grad mode on), ``None`` picks the torch reference (differentiable) and ``'triton'`` is refused
    (GL205) instead of returning an output that silently drops out of the graph."""
    if backend is not None and backend not in ("triton", "torch"):
        raise _bad(function, "backend", "'triton', 'torch' or None", backend)
    if backend != "torch":
        grad = _needs_grad(inputs)
        if grad is not None:
            if backend is None:
                return "torch"
            raise GuardError("GL205", argument=grad, function=function,
                             expected="inputs that do not require grad (the Triton LoRA kernels have no backward)",
                             got=f"{grad}.requires_grad=True with grad mode enabled",
                             fix="Use backend='torch' (or None) for training, or call under torch.no_grad() "
                                 "(or pass detached tensors) for inference.")
    if backend is None:
        return "triton" if (x.is_cuda or _k.INTERPRET) else "torch"
    if backend == "triton" and not (x.is_cuda or _k.INTERPRET):
        raise GuardError("GL301", argument="x", expected="a CUDA tensor (or TRITON_INTERPRET=1 set before "
                         "import)", got=describe(x), function=function)
    return backend


def _new_output(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Fresh kernel output. Every element is written by the kernel (tests swap in a NaN-filled one)."""
    return torch.empty(tuple(shape), dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------------------
# References: the definitions. Host loops over live segments; exact in float64, float32 accumulation
# for 16-bit inputs (as the kernels), rounded once to the output dtype.


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _live_segments(batch_info, num_slots: int, max_rank: int, tokens: int, function: str = "lora reference"):
    """(rows, slot, rank, scaling) per live segment that takes a product, by the rule of ``lora.triton``'s
    header: segment ``g`` covers sorted positions ``[c_g, c_{g+1})``, ``c`` the running maximum of
    ``seg_indptr`` clamped to ``[0, tokens]``; it takes a product when its slot is in ``[0, num_slots)``
    and that slot's rank in ``(0, max_rank]``. Every other row has no adapter.

    A ``permutation`` that is not one of ``range(tokens)`` is GL204 (it would leave rows unwritten)."""
    n = batch_info.num_segments
    bounds = list(itertools.accumulate((min(max(v, 0), tokens) for v in batch_info.seg_indptr[: n + 1].tolist()),
                                       max))
    slots = batch_info.weight_indices[:n].tolist()
    ranks = batch_info.lora_ranks.tolist()
    scalings = batch_info.scalings.tolist()
    permutation = getattr(batch_info, "permutation", None)
    if permutation is not None:
        _check_permutation_values(function, permutation.tolist())
    for g in range(n):
        start, stop = bounds[g], bounds[g + 1]
        slot = slots[g]
        if stop <= start or not 0 <= slot < num_slots or not 0 < ranks[slot] <= max_rank:
            continue
        if permutation is not None:
            rows = permutation[start:stop].long()
        else:
            rows = torch.arange(start, stop, device=batch_info.seg_indptr.device)
        yield rows, slot, ranks[slot], scalings[slot]


def sgemm_lora_a_reference(x: Tensor, weights: Tensor, batch_info, stack_num: int = 1) -> Tensor:
    """Definition of :func:`sgemm_lora_a`: per segment, stack ``i`` columns ``[iR, iR + r)`` =
    ``x[rows] @ A[slot, iR : iR + r].T``; all other columns, and rows of no segment or no adapter, are 0."""
    S = x.shape[0]
    R = weights.shape[1] // stack_num
    out = torch.zeros((S, stack_num * R), dtype=x.dtype, device=x.device)
    ct = _compute_dtype(x.dtype)
    for rows, slot, r, _ in _live_segments(batch_info, weights.shape[0], R, S, "sgemm_lora_a"):
        xs = x[rows].to(ct)
        for i in range(stack_num):
            out[rows, i * R: i * R + r] = (xs @ weights[slot, i * R: i * R + r].to(ct).T).to(x.dtype)
    return out


def _expand_rows(out: Tensor, rows: Tensor, cols: slice, delta: Tensor, scaling: float) -> None:
    ct = delta.dtype
    out[rows, cols] = (out[rows, cols].to(ct) + scaling * delta).to(out.dtype)


def sgemm_lora_b_reference(x: Tensor, weights: Tensor, batch_info, base_output: Optional[Tensor] = None) -> Tensor:
    """Definition of :func:`sgemm_lora_b`: ``out = base_output or zeros``; per segment
    ``out[rows] += scaling * x[rows, :r] @ B[slot][:, :r].T`` (in place, computed in float32 and rounded
    once); rows of no segment or no adapter are left as they are. Returns out."""
    out = base_output if base_output is not None else x.new_zeros((x.shape[0], weights.shape[1]))
    ct = _compute_dtype(x.dtype)
    for rows, slot, r, scaling in _live_segments(batch_info, weights.shape[0], weights.shape[2], x.shape[0],
                                                 "sgemm_lora_b"):
        _expand_rows(out, rows, slice(None), x[rows, :r].to(ct) @ weights[slot, :, :r].to(ct).T, scaling)
    return out


def qkv_lora_b_reference(x: Tensor, weights: Tensor, batch_info, output_offset,
                         base_output: Optional[Tensor] = None) -> Tensor:
    """Definition of :func:`qkv_lora_b`: slice ``i`` of the output, columns ``[off[i], off[i+1])``, gets
    ``scaling * x[rows, iR : iR + r] @ B[slot][off[i]:off[i+1], :r].T``."""
    off = [int(v) for v in (output_offset.tolist() if isinstance(output_offset, Tensor) else output_offset)]
    R = weights.shape[2]
    out = base_output if base_output is not None else x.new_zeros((x.shape[0], weights.shape[1]))
    ct = _compute_dtype(x.dtype)
    for rows, slot, r, scaling in _live_segments(batch_info, weights.shape[0], R, x.shape[0], "qkv_lora_b"):
        for i in range(3):
            delta = x[rows, i * R: i * R + r].to(ct) @ weights[slot, off[i]: off[i + 1], :r].to(ct).T
            _expand_rows(out, rows, slice(off[i], off[i + 1]), delta, scaling)
    return out


def _per_head_b(lora_b: Tensor, slot: int, heads: int, qk_nope_head_dim: int, v_head_dim: int):
    """B[slot] as (H, qk_nope + v_head, R): per head its k_nope rows, then its v rows."""
    return lora_b[slot].reshape(heads, qk_nope_head_dim + v_head_dim, lora_b.shape[2])


def step_a_q_reference(q_nope: Tensor, lora_b: Tensor, batch_info, *, qk_nope_head_dim: int,
                       v_head_dim: int) -> Tensor:
    """Definition of :func:`step_a_q`: ``y[rows, h, :r] = q_nope[rows, h] @ B[slot, h*(qk_nope+v) :
    h*(qk_nope+v) + qk_nope, :r]``; other columns 0."""
    S, H, _ = q_nope.shape
    R = lora_b.shape[2]
    out = q_nope.new_zeros((S, H, R))
    ct = _compute_dtype(q_nope.dtype)
    for rows, slot, r, _ in _live_segments(batch_info, lora_b.shape[0], R, q_nope.shape[0], "step_a_q"):
        b_k = _per_head_b(lora_b, slot, H, qk_nope_head_dim, v_head_dim)[:, :qk_nope_head_dim, :r]
        out[rows, :, :r] = torch.einsum("thk,hkr->thr", q_nope[rows].to(ct), b_k.to(ct)).to(out.dtype)
    return out


def step_b_q_reference(lora_q: Tensor, lora_a: Tensor, batch_info, base_output: Optional[Tensor] = None) -> Tensor:
    """Definition of :func:`step_b_q`: ``out[rows, h] += scaling * lora_q[rows, h, :r] @ A[slot, :r, :]``."""
    S, H, R = lora_q.shape
    out = base_output if base_output is not None else lora_q.new_zeros((S, H, lora_a.shape[2]))
    ct = _compute_dtype(lora_q.dtype)
    for rows, slot, r, scaling in _live_segments(batch_info, lora_a.shape[0], R, lora_q.shape[0], "step_b_q"):
        delta = torch.einsum("thr,rc->thc", lora_q[rows, :, :r].to(ct), lora_a[slot, :r].to(ct))
        out[rows] = (out[rows].to(ct) + scaling * delta).to(out.dtype)
    return out


def step_a_v_reference(attn_latent: Tensor, lora_a: Tensor, batch_info) -> Tensor:
    """Definition of :func:`step_a_v`: ``y[rows, h, :r] = attn_latent[rows, h] @ A[slot, :r, :].T``;
    other columns 0."""
    S, H, _ = attn_latent.shape
    R = lora_a.shape[1]
    out = attn_latent.new_zeros((S, H, R))
    ct = _compute_dtype(attn_latent.dtype)
    for rows, slot, r, _ in _live_segments(batch_info, lora_a.shape[0], R, attn_latent.shape[0], "step_a_v"):
        out[rows, :, :r] = torch.einsum("thc,rc->thr", attn_latent[rows].to(ct),
                                        lora_a[slot, :r].to(ct)).to(out.dtype)
    return out


def step_b_v_reference(lora_v: Tensor, lora_b: Tensor, batch_info, base_output: Optional[Tensor] = None, *,
                       qk_nope_head_dim: int, v_head_dim: int) -> Tensor:
    """Definition of :func:`step_b_v`: ``out[rows, h] += scaling * lora_v[rows, h, :r] @
    B[slot, h*(qk_nope+v) + qk_nope : (h+1)*(qk_nope+v), :r].T``."""
    S, H, R = lora_v.shape
    out = base_output if base_output is not None else lora_v.new_zeros((S, H, v_head_dim))
    ct = _compute_dtype(lora_v.dtype)
    for rows, slot, r, scaling in _live_segments(batch_info, lora_b.shape[0], R, lora_v.shape[0], "step_b_v"):
        b_v = _per_head_b(lora_b, slot, H, qk_nope_head_dim, v_head_dim)[:, qk_nope_head_dim:, :r]
        delta = torch.einsum("thr,hvr->thv", lora_v[rows, :, :r].to(ct), b_v.to(ct))
        out[rows] = (out[rows].to(ct) + scaling * delta).to(out.dtype)
    return out


# ---------------------------------------------------------------------------------------------------------
# Launchers and custom ops. Each public function checks its inputs, then launches through ``_launch``:
# eagerly it calls the launcher itself (a custom op's dispatch costs 20-50 µs of CPU per call), while
# torch.compile tracing, fake / functional tensors, dispatch modes and autograd see one opaque custom op
# per call (``guardlint::<name>``) whose body is the same launcher.


def _strides3(t: Tensor) -> tuple:
    """(t, h, last) strides of a 2-D (h absent: 0) or 3-D tensor."""
    s = t.stride()
    return (s[0], 0, s[1]) if len(s) == 2 else s


def _sgemm_lora_a_launch(x: Tensor, weights: Tensor, seg_indptr: Tensor, weight_indices: Tensor, lora_ranks: Tensor,
                         scalings: Tensor, permutation: Optional[Tensor], num_segments: int, stack_num: int) -> Tensor:
    S, K = x.shape
    N = weights.shape[1]
    out = _new_output((S, N), x.dtype, x.device)
    ws = weights.stride()
    _k.launch_shrink(x, _strides3(x), weights, (ws[0], 0, ws[1], ws[2]), out, _strides3(out), seg_indptr,
                     weight_indices, lora_ranks, permutation, num_segments, S, 1, K, N, N // stack_num)
    return out


def _sgemm_lora_b_launch(x: Tensor, weights: Tensor, out: Tensor, seg_indptr: Tensor, weight_indices: Tensor,
                         lora_ranks: Tensor, scalings: Tensor, permutation: Optional[Tensor], num_segments: int,
                         accumulate: bool) -> None:
    ws = weights.stride()
    _k.launch_expand(x, _strides3(x), weights, (ws[0], 0, ws[1], ws[2]), out, _strides3(out), seg_indptr,
                     weight_indices, lora_ranks, scalings, permutation, num_segments, x.shape[0], 1, weights.shape[1],
                     weights.shape[2], accumulate)


def _qkv_lora_b_launch(x: Tensor, weights: Tensor, out: Tensor, seg_indptr: Tensor, weight_indices: Tensor,
                       lora_ranks: Tensor, scalings: Tensor, permutation: Optional[Tensor], num_segments: int,
                       accumulate: bool, slice_starts: Optional[list[int]], output_offset: Optional[Tensor]) -> None:
    _, n_total, R = weights.shape
    if slice_starts is not None:
        widest = max(slice_starts[1] - slice_starts[0], slice_starts[2] - slice_starts[1],
                     slice_starts[3] - slice_starts[2])
    else:
        widest = n_total  # slice widths live on the device: size the grid for the widest possible
    xs, ws = x.stride(), weights.stride()
    _k.launch_expand(x, (xs[0], R * xs[1], xs[1]), weights, (ws[0], 0, ws[1], ws[2]), out, _strides3(out),
                     seg_indptr, weight_indices, lora_ranks, scalings, permutation, num_segments, x.shape[0], 3,
                     widest, R, accumulate, slice_starts, output_offset, n_total)


def _step_a_launch(x: Tensor, w: Tensor, w_strides: list[int], rank: int, seg_indptr: Tensor, weight_indices: Tensor,
                   lora_ranks: Tensor, scalings: Tensor, permutation: Optional[Tensor], num_segments: int) -> Tensor:
    S, H, K = x.shape
    out = _new_output((S, H, rank), x.dtype, x.device)
    _k.launch_shrink(x, x.stride(), w, w_strides, out, out.stride(), seg_indptr, weight_indices, lora_ranks,
                     permutation, num_segments, S, H, K, rank, rank)
    return out


def _step_b_launch(x: Tensor, w: Tensor, w_strides: list[int], w_row: int, out: Tensor, seg_indptr: Tensor,
                   weight_indices: Tensor, lora_ranks: Tensor, scalings: Tensor, permutation: Optional[Tensor],
                   num_segments: int, accumulate: bool) -> None:
    S, H, R = x.shape
    _k.launch_expand(x, x.stride(), w, w_strides, out, out.stride(), seg_indptr, weight_indices, lora_ranks, scalings,
                     permutation, num_segments, S, H, out.shape[2], R, accumulate, w_row=w_row)


_sgemm_lora_a_op = torch.library.custom_op("guardlint::sgemm_lora_a", mutates_args=())(_sgemm_lora_a_launch)
_sgemm_lora_b_op = torch.library.custom_op("guardlint::sgemm_lora_b", mutates_args=("out",))(_sgemm_lora_b_launch)
_qkv_lora_b_op = torch.library.custom_op("guardlint::qkv_lora_b", mutates_args=("out",))(_qkv_lora_b_launch)
_step_a_op = torch.library.custom_op("guardlint::lora_step_a", mutates_args=())(_step_a_launch)
_step_b_op = torch.library.custom_op("guardlint::lora_step_b", mutates_args=("out",))(_step_b_launch)


@_sgemm_lora_a_op.register_fake
def _(x, weights, seg_indptr, weight_indices, lora_ranks, scalings, permutation, num_segments, stack_num):
    return x.new_empty((x.shape[0], weights.shape[1]))


@_step_a_op.register_fake
def _(x, w, w_strides, rank, seg_indptr, weight_indices, lora_ranks, scalings, permutation, num_segments):
    return x.new_empty((x.shape[0], x.shape[1], rank))


for _op in (_sgemm_lora_b_op, _qkv_lora_b_op, _step_b_op):
    _op.register_fake(lambda *args: None)

# Tensor types launched directly; any other subclass (fake, functional, user dispatch subclasses) gets the op.
_PLAIN = frozenset((Tensor, torch.nn.Parameter))
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_grad_enabled = torch.is_grad_enabled
_bump_version = torch._C._increment_version


def _launch(op, launch, out: Optional[Tensor], x: Tensor, w: Tensor, *args):
    """``launch(x, w, *args)`` directly in plain eager mode, else the custom op ``op`` (same arguments)
    so that torch.compile, fake and functional tensors, dispatch modes and autograd see one opaque node.

    A direct launch that writes ``out`` in place bumps its version counter, as the op would."""
    # is_compiling first: under torch.compile it is a constant, and the rest is not traceable.
    if (_is_compiling() or type(x) not in _PLAIN or type(w) not in _PLAIN or _dispatch_modes()
            or ((x.requires_grad or w.requires_grad) and _grad_enabled())):
        return op(x, w, *args)
    result = launch(x, w, *args)
    if out is not None:
        _bump_version((out,))
    return result


def _op_batch(batch: _Batch) -> tuple:
    return (batch.seg_indptr, batch.weight_indices, batch.lora_ranks, batch.scalings, batch.permutation,
            batch.num_segments)


class _Spec(NamedTuple):
    """What every public LoRA function checks the same way: its name, its activation parameter and that
    tensor's rank, its weight-stack parameter."""

    function: str
    x: str
    ndim: int
    weights: str


_SPECS = {spec.function: spec for spec in (
    _Spec("sgemm_lora_a", "x", 2, "weights"), _Spec("sgemm_lora_b", "x", 2, "weights"),
    _Spec("qkv_lora_b", "x", 2, "weights"), _Spec("step_a_q", "q_nope", 3, "lora_b"),
    _Spec("step_b_q", "lora_q", 3, "lora_a"), _Spec("step_a_v", "attn_latent", 3, "lora_a"),
    _Spec("step_b_v", "lora_v", 3, "lora_b"))}


def _begin(spec: _Spec, x, weights, backend: Optional[str], base_output=None) -> str:
    """The checks every public function starts with, in this order: the activation, the backend that runs
    the call (any of x, the weights and an output updated in place requiring grad counts), the weight
    stack against x. Returns the backend."""
    fn = spec.function
    _check_data(fn, spec.x, x, spec.ndim)
    if base_output is not None and getattr(base_output, "requires_grad", False) and base_output.is_leaf \
            and _grad_enabled():
        # Every backend updates base_output in place, which autograd refuses for a leaf that requires grad.
        raise GuardError("GL205", argument="base_output", function=fn,
                         expected="a tensor that does not require grad, or a non-leaf one (it is updated in place)",
                         got=f"{describe(base_output)}, a leaf with requires_grad=True, grad mode enabled",
                         fix="Pass a tensor that does not require grad (base.detach()); under autograd use the "
                             "reference backend (backend='torch' or None) on a non-leaf copy (base.clone()), or "
                             "pass base_output=None and add the result.")
    backend = _resolve_backend(fn, backend, x, (spec.x, x), (spec.weights, weights), ("base_output", base_output))
    _check_weights(fn, spec.weights, weights, x)
    return backend


def _end(spec: _Spec, x: Tensor, weights: Tensor, batch_info, base_output: Optional[Tensor], shape: tuple,
         max_rank: int) -> _Batch:
    """The checks every public function ends with, after its own shape checks: the output it updates in
    place (when given) against ``shape``, then the batch info against x and the weight stack (whose stored
    rank is ``max_rank``)."""
    if base_output is not None:
        _check_output(spec.function, base_output, shape, x)
    return _check_batch(spec.function, x, batch_info, weights.shape[0], max_rank)


def _check_int(function: str, name: str, value, lo: int, hi: Optional[int] = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise _bad(function, name, f"a Python int in [{lo}, {hi if hi is not None else 'inf'}]", value)


# ---------------------------------------------------------------------------------------------------------
# Public functions.


@guard_lora(reads=("seg_lens",), rank_dim=1)
def sgemm_lora_a(x: Tensor, weights: Tensor, batch_info: LoRABatchInfo, stack_num: int = 1, *,
                 backend: Optional[str] = None) -> Tensor:
    """``sgemm_lora_a(x, weights, batch_info, stack_num=1, *, backend=None) -> (S, stack_num * R)``

    Segmented LoRA shrink: ``x @ A[slot].T`` per segment, for ``stack_num`` stacked adapters
    (q/k/v or gate/up share one x).

    Parameters
    ----------
    x : Tensor
        ``(S, K)``, float16 / bfloat16 / float32, CUDA (CPU under TRITON_INTERPRET=1 or backend='torch').
    weights : Tensor
        ``(num_slots, stack_num * R, K)``, x's dtype and device; ``R`` is the stored (maximum) rank.
    batch_info : LoRABatchInfo
        Segments over x's rows; ``max_len`` or ``seg_lens`` set (or derived by the guard).
    stack_num : int
        Number of stacked A matrices.
    backend : str, optional
        ``"triton"`` or ``"torch"`` (the reference); ``None``: triton on CUDA or under the interpreter.

    Returns
    -------
    Tensor
        ``(S, stack_num * R)``, x's dtype and device. For a token of a segment with slot ``s`` and rank
        ``r = lora_ranks[s]``, stack ``i``'s first ``r`` columns are ``x @ A[s, iR : iR + r].T`` and its
        other columns 0; rows of no live segment, or of a segment without an adapter (rank 0, a slot or rank
        out of range), are 0.
    """
    fn = "sgemm_lora_a"
    spec = _SPECS[fn]
    backend = _begin(spec, x, weights, backend)
    _check_int(fn, "stack_num", stack_num, 1)
    if weights.shape[2] != x.shape[1] or weights.shape[1] % stack_num:
        raise _bad(fn, "weights", f"(num_slots, stack_num * R, K={x.shape[1]}) with stack_num={stack_num}", weights)
    R = _rank_of(fn, "weights", weights.shape[1] // stack_num, weights, "weights.shape[1] // stack_num")
    batch = _end(spec, x, weights, batch_info, None, (), R)
    if backend == "torch":
        return sgemm_lora_a_reference(x, weights, batch_info, stack_num)
    return _launch(_sgemm_lora_a_op, _sgemm_lora_a_launch, None, x, weights, *_op_batch(batch), stack_num)


@guard_lora(reads=("seg_lens",), rank_dim=2)
def sgemm_lora_b(x: Tensor, weights: Tensor, batch_info: LoRABatchInfo, base_output: Optional[Tensor] = None, *,
                 backend: Optional[str] = None) -> Tensor:
    """``sgemm_lora_b(x, weights, batch_info, base_output=None, *, backend=None) -> (S, N)``

    Segmented LoRA expand: ``out += scaling * x[:, :r] @ B[slot][:, :r].T`` per segment.

    Parameters
    ----------
    x : Tensor
        ``(S, R)``, float16 / bfloat16 / float32, CUDA (CPU under TRITON_INTERPRET=1 or backend='torch');
        usually the output of :func:`sgemm_lora_a`.
    weights : Tensor
        ``(num_slots, N, R)``, x's dtype and device.
    batch_info : LoRABatchInfo
        As for :func:`sgemm_lora_a`; ``scalings`` apply here.
    base_output : Tensor, optional
        ``(S, N)``, x's dtype and device, any strides without overlap: updated in place. Rows of segments
        without an adapter (rank 0, or a slot or rank out of range), and rows of no live segment, are not
        touched. It must not be a leaf that requires grad while grad mode is on (GL205).

    Returns
    -------
    Tensor
        ``base_output`` (or a fresh ``(S, N)`` tensor, zeros plus the LoRA delta).
    """
    fn = "sgemm_lora_b"
    spec = _SPECS[fn]
    backend = _begin(spec, x, weights, backend, base_output)
    if weights.shape[2] != x.shape[1]:
        raise _bad(fn, "weights", f"(num_slots, N, R={x.shape[1]}) (R = x.shape[1])", weights)
    R = _rank_of(fn, "x", x.shape[1], x, "x.shape[1]")
    shape = (x.shape[0], weights.shape[1])
    batch = _end(spec, x, weights, batch_info, base_output, shape, R)
    if backend == "torch":
        return sgemm_lora_b_reference(x, weights, batch_info, base_output)
    out = base_output if base_output is not None else _new_output(shape, x.dtype, x.device)
    _launch(_sgemm_lora_b_op, _sgemm_lora_b_launch, out, x, weights, out, *_op_batch(batch), base_output is not None)
    return out


def _slice_starts(fn: str, output_offset, n_total: int, x: Tensor):
    """(host starts, device tensor): exactly one is not None."""
    if isinstance(output_offset, Tensor):
        if output_offset.dim() != 1 or output_offset.shape[0] != 4 or output_offset.dtype not in _INTS:
            raise _bad(fn, "output_offset", "4 ints [0, N_q, N_q + N_kv, N_q + 2 N_kv] (int32/int64 tensor)",
                       output_offset)
        if output_offset.device.type == "cpu" and x.device.type != "cpu":
            output_offset = output_offset.tolist()  # a host tensor costs no sync
        elif output_offset.device != x.device:
            raise _bad(fn, "output_offset", f"a tensor on {x.device} or the host", output_offset)
        else:
            return None, output_offset.contiguous()
    if not isinstance(output_offset, (list, tuple)) or len(output_offset) != 4 or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in output_offset):
        raise _bad(fn, "output_offset", "4 ints [0, N_q, N_q + N_kv, N_q + 2 N_kv]", output_offset)
    starts = list(output_offset)
    if starts[0] != 0 or starts[3] != n_total or any(starts[i] > starts[i + 1] for i in range(3)):
        raise _bad(fn, "output_offset", f"non-decreasing slice starts from 0 to weights.shape[1] = {n_total}",
                   f"{starts}")
    return starts, None


@guard_lora(reads=("seg_lens",), rank_dim=2)
def qkv_lora_b(x: Tensor, weights: Tensor, batch_info: LoRABatchInfo, output_offset: Union[Sequence[int], Tensor],
               base_output: Optional[Tensor] = None, *, backend: Optional[str] = None) -> Tensor:
    """``qkv_lora_b(x, weights, batch_info, output_offset, base_output=None, *, backend=None) -> (S, N_q + 2 N_kv)``

    Segmented LoRA expand of the fused q/k/v projection: slice ``i`` of the output, columns
    ``[off[i], off[i+1])``, gets ``scaling * x[:, iR : iR + r] @ B[slot][off[i]:off[i+1], :r].T``.

    Parameters
    ----------
    x : Tensor
        ``(S, 3 R)``: the q, k and v shrink outputs side by side; float16 / bfloat16 / float32, CUDA (CPU
        under TRITON_INTERPRET=1 or backend='torch').
    weights : Tensor
        ``(num_slots, N_q + 2 N_kv, R)``, x's dtype and device.
    batch_info : LoRABatchInfo
        As for :func:`sgemm_lora_b`.
    output_offset : sequence of 4 ints, or Tensor
        Slice starts ``[0, N_q, N_q + N_kv, N_q + 2 N_kv]``: host ints (checked), or an int32/int64
        tensor on x's device (not read on the host: values are clamped to the weight stack in the
        kernel, and a fresh output is zero-filled first since the slices cannot be checked to tile it).
    base_output : Tensor, optional
        ``(S, N_q + 2 N_kv)``, updated in place as in :func:`sgemm_lora_b`.

    Returns
    -------
    Tensor
        ``base_output`` or a fresh ``(S, N_q + 2 N_kv)`` tensor.
    """
    fn = "qkv_lora_b"
    spec = _SPECS[fn]
    backend = _begin(spec, x, weights, backend, base_output)
    R = weights.shape[2]
    if x.shape[1] != 3 * R:
        raise _bad(fn, "x", f"(S, 3 * R = {3 * R}) (R = weights.shape[2])", x)
    _rank_of(fn, "weights", R, weights, "weights.shape[2]")
    n_total = weights.shape[1]
    starts, offsets = _slice_starts(fn, output_offset, n_total, x)
    shape = (x.shape[0], n_total)
    batch = _end(spec, x, weights, batch_info, base_output, shape, R)
    if backend == "torch":
        return qkv_lora_b_reference(x, weights, batch_info, starts if starts is not None else offsets, base_output)
    accumulate = base_output is not None
    if base_output is not None:
        out = base_output
    elif starts is not None:
        out = _new_output(shape, x.dtype, x.device)
    else:
        out, accumulate = torch.zeros(shape, dtype=x.dtype, device=x.device), True
    _launch(_qkv_lora_b_op, _qkv_lora_b_launch, out, x, weights, out, *_op_batch(batch), accumulate, starts, offsets)
    return out


@guard_lora(reads=("seg_lens",), weights="lora_b", rank_dim=2)
def step_a_q(q_nope: Tensor, lora_b: Tensor, batch_info: LoRABatchInfo, *, qk_nope_head_dim: int, v_head_dim: int,
             backend: Optional[str] = None) -> Tensor:
    """``step_a_q(q_nope, lora_b, batch_info, *, qk_nope_head_dim, v_head_dim, backend=None) -> (S, H, R)``

    MLA absorbed ``kv_b_proj``, q path, step A: ``q_nope`` through the transposed k_nope rows of the
    LoRA B matrix, per head ``h``: ``y[:, h, :r] = q_nope[:, h] @ B[s, h*(qk_nope+v) : h*(qk_nope+v) +
    qk_nope, :r]``.

    Parameters
    ----------
    q_nope : Tensor
        ``(S, H, qk_nope_head_dim)``, float16 / bfloat16 / float32, CUDA (CPU under TRITON_INTERPRET=1
        or backend='torch'); any strides (a slice of q is fine).
    lora_b : Tensor
        ``(num_slots, H * (qk_nope_head_dim + v_head_dim), R)``: the LoRA B of ``kv_b_proj``, per head its
        k_nope rows then its v rows; q_nope's dtype and device.
    batch_info : LoRABatchInfo
        Segments over q_nope's tokens.
    qk_nope_head_dim, v_head_dim : int
        Per-head sizes that lay out ``lora_b``'s rows.

    Returns
    -------
    Tensor
        ``(S, H, R)``, columns ``>= r`` zero; input of :func:`step_b_q`.
    """
    fn = "step_a_q"
    spec = _SPECS[fn]
    backend = _begin(spec, q_nope, lora_b, backend)
    S, H, qk = q_nope.shape
    _mla_dims(fn, "lora_b", lora_b, H, qk_nope_head_dim, v_head_dim)
    if qk != qk_nope_head_dim:
        raise _bad(fn, "q_nope", f"(S, H, qk_nope_head_dim={qk_nope_head_dim})", q_nope)
    R = _rank_of(fn, "lora_b", lora_b.shape[2], lora_b, "lora_b.shape[2]")
    batch = _end(spec, q_nope, lora_b, batch_info, None, (), R)
    if backend == "torch":
        return step_a_q_reference(q_nope, lora_b, batch_info, qk_nope_head_dim=qk_nope_head_dim,
                                  v_head_dim=v_head_dim)
    b0, b1, b2 = lora_b.stride()
    # W[slot, h, n, k] = B[slot, h * (qk_nope + v) + k, n]
    w_strides = [b0, (qk_nope_head_dim + v_head_dim) * b1, b2, b1]
    return _launch(_step_a_op, _step_a_launch, None, q_nope, lora_b, w_strides, R, *_op_batch(batch))


@guard_lora(reads=("seg_lens",), weights="lora_a", rank_dim=1)
def step_b_q(lora_q: Tensor, lora_a: Tensor, batch_info: LoRABatchInfo, base_output: Optional[Tensor] = None, *,
             backend: Optional[str] = None) -> Tensor:
    """``step_b_q(lora_q, lora_a, batch_info, base_output=None, *, backend=None) -> (S, H, kv_lora_rank)``

    MLA absorbed ``kv_b_proj``, q path, step B: per head ``out[:, h] += scaling * y[:, h, :r] @
    A[s, :r, :]`` into the latent q.

    Parameters
    ----------
    lora_q : Tensor
        ``(S, H, R)``: :func:`step_a_q`'s output; float16 / bfloat16 / float32, CUDA (CPU under
        TRITON_INTERPRET=1 or backend='torch').
    lora_a : Tensor
        ``(num_slots, R, kv_lora_rank)``: the LoRA A of ``kv_b_proj``, shared by all heads.
    batch_info : LoRABatchInfo
        As for :func:`step_a_q`.
    base_output : Tensor, optional
        ``(S, H, kv_lora_rank)``: the absorbed q (``q_nope @ W_UK``), updated in place.

    Returns
    -------
    Tensor
        ``base_output`` or a fresh ``(S, H, kv_lora_rank)`` tensor.
    """
    fn = "step_b_q"
    spec = _SPECS[fn]
    backend = _begin(spec, lora_q, lora_a, backend, base_output)
    S, H, R = lora_q.shape
    if lora_a.shape[1] != R:
        raise _bad(fn, "lora_a", f"(num_slots, R={R}, kv_lora_rank) (R = lora_q.shape[2])", lora_a)
    _rank_of(fn, "lora_q", R, lora_q, "lora_q.shape[2]")
    shape = (S, H, lora_a.shape[2])
    batch = _end(spec, lora_q, lora_a, batch_info, base_output, shape, R)
    if backend == "torch":
        return step_b_q_reference(lora_q, lora_a, batch_info, base_output)
    out = base_output if base_output is not None else _new_output(shape, lora_q.dtype, lora_q.device)
    a0, a1, a2 = lora_a.stride()
    # W[slot, h, n, k] = A[slot, k, n]
    _launch(_step_b_op, _step_b_launch, out, lora_q, lora_a, [a0, 0, a2, a1], 0, out, *_op_batch(batch),
            base_output is not None)
    return out


@guard_lora(reads=("seg_lens",), weights="lora_a", rank_dim=1)
def step_a_v(attn_latent: Tensor, lora_a: Tensor, batch_info: LoRABatchInfo, *,
             backend: Optional[str] = None) -> Tensor:
    """``step_a_v(attn_latent, lora_a, batch_info, *, backend=None) -> (S, H, R)``

    MLA absorbed ``kv_b_proj``, v path, step A: per head ``y[:, h, :r] = x[:, h] @ A[s, :r, :].T``.

    Parameters
    ----------
    attn_latent : Tensor
        ``(S, H, kv_lora_rank)``: the attention output in the latent space; float16 / bfloat16 /
        float32, CUDA (CPU under TRITON_INTERPRET=1 or backend='torch'); any strides.
    lora_a : Tensor
        ``(num_slots, R, kv_lora_rank)``, attn_latent's dtype and device.
    batch_info : LoRABatchInfo
        Segments over the tokens.

    Returns
    -------
    Tensor
        ``(S, H, R)``, columns ``>= r`` zero; input of :func:`step_b_v`.
    """
    fn = "step_a_v"
    spec = _SPECS[fn]
    backend = _begin(spec, attn_latent, lora_a, backend)
    if lora_a.shape[2] != attn_latent.shape[2]:
        raise _bad(fn, "lora_a", f"(num_slots, R, kv_lora_rank={attn_latent.shape[2]}) (attn_latent.shape[2])",
                   lora_a)
    R = _rank_of(fn, "lora_a", lora_a.shape[1], lora_a, "lora_a.shape[1]")
    batch = _end(spec, attn_latent, lora_a, batch_info, None, (), R)
    if backend == "torch":
        return step_a_v_reference(attn_latent, lora_a, batch_info)
    a0, a1, a2 = lora_a.stride()
    # W[slot, h, n, k] = A[slot, n, k]
    return _launch(_step_a_op, _step_a_launch, None, attn_latent, lora_a, [a0, 0, a1, a2], R, *_op_batch(batch))


@guard_lora(reads=("seg_lens",), weights="lora_b", rank_dim=2)
def step_b_v(lora_v: Tensor, lora_b: Tensor, batch_info: LoRABatchInfo, base_output: Optional[Tensor] = None, *,
             qk_nope_head_dim: int, v_head_dim: int, backend: Optional[str] = None) -> Tensor:
    """``step_b_v(lora_v, lora_b, batch_info, base_output=None, *, qk_nope_head_dim, v_head_dim, backend=None)
    -> (S, H, v_head_dim)``

    MLA absorbed ``kv_b_proj``, v path, step B: per head ``out[:, h] += scaling * y[:, h, :r] @
    B[s, h*(qk_nope+v) + qk_nope : (h+1)*(qk_nope+v), :r].T``.

    Parameters
    ----------
    lora_v : Tensor
        ``(S, H, R)``: :func:`step_a_v`'s output; float16 / bfloat16 / float32, CUDA (CPU under
        TRITON_INTERPRET=1 or backend='torch').
    lora_b : Tensor
        ``(num_slots, H * (qk_nope_head_dim + v_head_dim), R)``, as for :func:`step_a_q`.
    batch_info : LoRABatchInfo
        As for :func:`step_a_v`.
    base_output : Tensor, optional
        ``(S, H, v_head_dim)``: the attention output (``attn_latent @ W_UV.T``), updated in place.
    qk_nope_head_dim, v_head_dim : int
        Per-head sizes that lay out ``lora_b``'s rows.

    Returns
    -------
    Tensor
        ``base_output`` or a fresh ``(S, H, v_head_dim)`` tensor.
    """
    fn = "step_b_v"
    spec = _SPECS[fn]
    backend = _begin(spec, lora_v, lora_b, backend, base_output)
    S, H, R = lora_v.shape
    _mla_dims(fn, "lora_b", lora_b, H, qk_nope_head_dim, v_head_dim)
    if lora_b.shape[2] != R:
        raise _bad(fn, "lora_b", f"(num_slots, H * (qk_nope_head_dim + v_head_dim), R={R}) (R = lora_v.shape[2])",
                   lora_b)
    _rank_of(fn, "lora_v", R, lora_v, "lora_v.shape[2]")
    shape = (S, H, v_head_dim)
    batch = _end(spec, lora_v, lora_b, batch_info, base_output, shape, R)
    if backend == "torch":
        return step_b_v_reference(lora_v, lora_b, batch_info, base_output, qk_nope_head_dim=qk_nope_head_dim,
                                  v_head_dim=v_head_dim)
    out = base_output if base_output is not None else _new_output(shape, lora_v.dtype, lora_v.device)
    b0, b1, b2 = lora_b.stride()
    # W[slot, h, n, k] = B[slot, h * (qk_nope + v) + qk_nope + n, k]
    _launch(_step_b_op, _step_b_launch, out, lora_v, lora_b, [b0, (qk_nope_head_dim + v_head_dim) * b1, b1, b2],
            qk_nope_head_dim, out, *_op_batch(batch), base_output is not None)
    return out
