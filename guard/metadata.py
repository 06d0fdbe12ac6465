"""The varlen plan: ``VarlenMetadata`` and ``prepare_varlen_metadata`` (host work once per batch).

Like FlashInfer's ``plan()``, all host work happens here, once per batch: one read of ``cu_seqlens``
(none when it is already on the host), validation on that host copy, and one upload of every derived
array to q's device. Layers then take the prepared object and do no host work.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import torch

from . import _cache, _state
from ._cache import MISS, cache, fingerprint
from .errors import GuardError, describe

LAYOUTS = ("tokens", "cudnn", "vllm")
INT32_MAX = 2**31 - 1
# The engine's buckets: a CUDA graph captured for one bucket replays for every batch that fits it.
BATCH_BUCKETS = (8, 16, 32, 64)
BATCH_STEP = 8
# Past the last bucket both engines round up to a multiple of it.
SEQLEN_BUCKETS = (4096, 8192, 16384, 32768, 65536, 131072)  # sglang's FLASHINFER_MAX_SEQLEN_BUCKETS
VLLM_SEQLEN_BUCKETS = (1024, 2048) + SEQLEN_BUCKETS  # vLLM's: the same, from 1k


def bucket_batch_size(batch_size: int) -> int:
    """8, 16, 32, 64, then the next multiple of 8 (an empty batch takes the smallest bucket)."""
    for bucket in BATCH_BUCKETS:
        if batch_size <= bucket:
            return bucket
    return -(-batch_size // BATCH_STEP) * BATCH_STEP


def bucket_max_seqlen(max_seqlen: int, buckets: Sequence[int] = SEQLEN_BUCKETS) -> int:
    """4096, 8192, ... 131072, then the next multiple of 131072 (as sglang buckets; vLLM's buckets start
    at 1024: pass ``VLLM_SEQLEN_BUCKETS``)."""
    for bucket in buckets:
        if max_seqlen <= bucket:
            return bucket
    return -(-max_seqlen // buckets[-1]) * buckets[-1]


@dataclass(frozen=True, eq=False)
class VarlenMetadata:
    """Prepared varlen metadata for one batch; pass it to every layer.

    The field names and meanings are the engines' own (sglang's ``VisionAttentionMetadata``, vLLM's
    ``MMEncoderAttention`` arguments), so the object can be handed to an engine backend as it is:

    - ``cu_seqlens``: int32 ``(B+1,)`` token offsets on q's device; ``seq_lens``: int32 ``(B,)`` true
      lengths; ``max_seqlen``: the true longest sequence, a Python int; ``host_cu_seqlens``: the offsets
      on the host (they came with the one read ``max_seqlen`` needed).
    - ``sequence_lengths``: layout ``"tokens"``: ``seq_lens`` itself ``(B,)``; layouts ``"cudnn"`` and
      ``"vllm"``: the lengths the cuDNN kernel reads, zero-padded to Bp, int32 ``(Bp, 1, 1, 1)``.
    - ``packed_indptrs`` (``"cudnn"``): int32 ``(3(Bp+1),)`` element offsets in sections
      ``[qk | v | o]``, each ``cu_padded * H * D`` (sglang's ``VisionFlashInferAttention``).
      ``"vllm"``: int32 ``(2(Bp+1),)`` in sections ``[qko | v]``, the v section in v's own token stride
      (vLLM's ``flashinfer_wrapper`` reads it as ``cu_seqlens``).
    - ``flashinfer_max_seqlen``: the max the cuDNN kernel is sized with (bucketed when prepared with
      ``bucket=True``); None in the tokens layout.
    - ``padded_batch_size``: Bp (B unless bucketed); ``elements_per_token``: H*D the element offsets
      were built for (cudnn and vllm layouts).
    """

    layout: str
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen: int
    batch_size: int
    total_tokens: int
    host_cu_seqlens: tuple
    sequence_lengths: Optional[torch.Tensor] = None
    packed_indptrs: Optional[torch.Tensor] = None
    flashinfer_max_seqlen: Optional[int] = None
    padded_batch_size: int = 0
    elements_per_token: Optional[int] = None
    # Not fields (``dataclasses.replace`` and hand-built objects leave them None): set on objects this module
    # builds. ``_origin``: the cu_seqlens it was prepared from, as it was (``_cache.Origin``); ``_own``: the one
    # buffer behind its own tensors, its fingerprint and its version (the prepared path's cheap check: any torch
    # write to one of them moves the version they share), to see writes to them after the build; and the shape
    # of the q it was prepared for (a q of that shape needs no other check of its own).
    _origin: ClassVar[Any] = None
    _own: ClassVar[Any] = None
    _fast: ClassVar[Any] = None  # (weakref to the source, its fingerprint, _own's buffer, version, q's shape)

    def __repr__(self) -> str:
        # Shapes, never contents: a repr in a log must not sync the device or leak data.
        extra = ""
        if self.layout != "tokens":
            extra = (f", packed_indptrs={describe(self.packed_indptrs)}, flashinfer_max_seqlen="
                     f"{self.flashinfer_max_seqlen}, padded_batch_size={self.padded_batch_size}")
        return (f"VarlenMetadata(layout={self.layout!r}, batch_size={self.batch_size}, total_tokens="
                f"{self.total_tokens}, max_seqlen={self.max_seqlen}, cu_seqlens={describe(self.cu_seqlens)}"
                f"{extra})")

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device


# -- host copies ------------------------------------------------------------------------------------

# Dynamo folds this call to True while tracing; the guard then skips its cache (weakrefs, ids).
is_compiling = torch.compiler.is_compiling


def capturing(device: torch.device) -> bool:
    """Is a CUDA graph being captured on the current stream? Asked only for CUDA devices: the query
    raises on builds without CUDA."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _capture_error(argument: str, value: Any, function: Optional[str]) -> GuardError:
    return GuardError(
        "GL105", argument=argument, function=function,
        expected="metadata prepared before CUDA graph capture (or already cached for this tensor)",
        got=f"{describe(value)} with nothing cached while the stream is capturing",
        detail="A host read now would fail with 'operation not permitted when stream is capturing'.",
    )


def check_index_tensor(value: torch.Tensor, argument: str, function: Optional[str], code: str = "GL103",
                       min_numel: int = 1) -> None:
    """Static checks (no read) for a 1-D integer offsets tensor."""
    if value.layout is not torch.strided:
        raise GuardError(code, argument=argument, function=function,
                         expected="a dense (strided) integer tensor", got=f"{describe(value)}, layout {value.layout}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise GuardError(code, argument=argument, function=function,
                         expected="an integer tensor (int32 or int64)", got=describe(value))
    if value.dim() != 1:
        raise GuardError(code, argument=argument, function=function,
                         expected="a 1-D tensor of prefix sums", got=describe(value))
    if value.numel() < min_numel:
        raise GuardError(code, argument=argument, function=function,
                         expected=f"at least {min_numel} entry (offsets start with 0)", got=describe(value))


def read_host(tensor: torch.Tensor, argument: str, function: Optional[str], counted: bool = True,
              code: str = "GL103") -> tuple:
    """The tensor's values as a host tuple: one read, cached while the tensor is unchanged (``_cache``).
    ``counted=False``: a host tensor read only because it is on the host (a check that costs no sync), left
    out of ``stats()["host_reads"]``, which counts the reads a device tensor would cost. ``code``: the error
    for a tensor with no values (on the meta device)."""
    compiling = is_compiling()
    if not compiling:
        values = cache.get(tensor, "host")
        if values is not MISS:
            return values
        if tensor.is_meta:
            raise GuardError(code, argument=argument, function=function,
                             expected="a tensor with values (not on the meta device)", got=describe(tensor))
        if capturing(tensor.device):
            raise _capture_error(argument, tensor, function)
        _state.counters.cache_misses += 1
        if counted:
            _state.note_read(tensor)
    values = tuple(tensor.tolist())
    if not compiling:
        cache.put(tensor, "host", values)
    return values


def on_host(value: Any) -> bool:
    """A tensor whose values cost no device sync to read (CPU), outside compile tracing."""
    return isinstance(value, torch.Tensor) and value.is_cpu and not is_compiling()


def host_copy(value: Any, argument: str, function: Optional[str]) -> Optional[tuple]:
    """The values of a host tensor (cached; read uncounted), or None for a device tensor (no read made)."""
    if not on_host(value):
        return None
    values = cache.get(value, "host")
    if values is not MISS:
        return values
    if capturing(value.device):  # never for a real host tensor; the tests' simulated capture says so
        return None
    return read_host(value, argument, function, counted=False)


def host_sequence(value: Any, argument: str, function: Optional[str], code: str = "GL103") -> tuple:
    """A list, tuple or numpy array of offsets as a tuple of Python ints (no device involved)."""
    if hasattr(value, "__array__") and hasattr(value, "dtype") and hasattr(value, "ndim"):
        if getattr(value.dtype, "kind", "") not in "iu" or value.ndim != 1:
            raise GuardError(code, argument=argument, function=function,
                             expected="a 1-D integer array of prefix sums", got=describe(value))
        values = tuple(value.tolist())
    elif isinstance(value, (list, tuple)):
        values = tuple(value)
        for i, v in enumerate(values):
            if type(v) is not int:
                try:
                    if isinstance(v, bool):
                        raise TypeError
                    values = values[:i] + (operator.index(v),) + values[i + 1:]
                except TypeError:
                    raise GuardError(code, argument=argument, function=function,
                                     expected="a flat sequence of Python ints",
                                     got=f"{describe(value)} whose entry {i} is {type(v).__name__}") from None
    else:
        raise GuardError(code, argument=argument, function=function,
                         expected="a 1-D integer tensor, list, tuple or numpy array", got=describe(value))
    if not values:
        raise GuardError(code, argument=argument, function=function,
                         expected="at least 1 entry (offsets start with 0)", got=describe(value))
    return values


# -- interpretation of the offsets ------------------------------------------------------------------

def first_decrease(values: Sequence[int]) -> Optional[int]:
    """Index i of the first values[i] < values[i-1], or None."""
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            return i
    return None


def check_prefix_sums(values: Sequence[int], argument: str, function: Optional[str], code: str = "GL103",
                      what: str = "prefix sums") -> None:
    if values[0] != 0:
        raise GuardError(code, argument=argument, function=function,
                         expected=f"{what} starting at 0", got="a nonzero first entry")
    bad = first_decrease(values)
    if bad is not None:
        raise GuardError(code, argument=argument, function=function,
                         expected=f"non-decreasing {what}",
                         got=f"a decrease at index {bad} ({argument}[{bad}] < {argument}[{bad - 1}])")


def packed_sections(values: Sequence[int]) -> Optional[int]:
    """Section length when ``values`` are three identical sections ``[qk | v | o]``, else None."""
    n = len(values)
    if n < 3 or n % 3:
        return None
    s = n // 3
    first = values[:s]
    if tuple(values[s:2 * s]) != tuple(first) or tuple(values[2 * s:]) != tuple(first):
        return None
    return s


def token_offsets(values: Sequence[int], *, layout: str, total_tokens: Optional[int],
                  elements_per_token: Optional[int], argument: str = "cu_seqlens",
                  function: Optional[str] = None) -> tuple:
    """Validate host offsets and return them as token offsets ``(B+1,)``.

    For layout ``"cudnn"`` they may be token offsets ``(B+1,)`` (last == T) or the engine's packed element
    indptrs ``(3(B+1),)`` (sections equal, each ending at T*H*D): told apart by shape and last value.
    """
    T, HD = total_tokens, elements_per_token
    if layout == "cudnn":
        if T is None or HD is None:  # callers pass q's shape with this layout (prepare() requires q)
            raise GuardError("GL107", argument="q", function=function,
                             expected="q (total_tokens, num_heads, head_dim): element offsets need its T and H*D",
                             got="no q")
        tokens_fit = values[-1] == T and values[0] == 0 and first_decrease(values) is None
        s = packed_sections(values)
        # With tokens present both readings cannot fit (packed sections restart at 0, valid token
        # offsets do not); with none, every reading describes empty sequences: take the plain one.
        packed_fit = s is not None and values[s - 1] == T * HD and T > 0
        if packed_fit and not tokens_fit:
            section = values[:s]
            check_prefix_sums(section, argument, function, what="element offsets")
            bad = next((i for i, v in enumerate(section) if v % HD), None)
            if bad is not None:
                raise GuardError("GL107", argument=argument, function=function,
                                 expected=f"element offsets that are multiples of H*D={HD}",
                                 got=f"entry {bad} of the [qk] section is not")
            return tuple(v // HD for v in section)
        if not tokens_fit:
            n = len(values)
            if n >= 3 and n % 3 == 0 and values[n // 3 - 1] == T * HD:
                raise GuardError("GL103", argument=argument, function=function,
                                 expected="packed element indptrs with three identical sections [qk | v | o]",
                                 got=f"{n} entries whose sections differ")
            if HD != 1 and values[-1] == T * HD:
                raise GuardError("GL107", argument=argument, function=function,
                                 expected=f"token offsets ending at T={T} or packed element indptrs "
                                          f"[qk | v | o] of shape (3(B+1),) ending at T*H*D={T * HD}",
                                 got=f"element offsets of shape ({n},) (a single section)")
            check_prefix_sums(values, argument, function)
            raise GuardError("GL103", argument=argument, function=function,
                             expected=f"offsets ending at q's token count T={T} (or T*H*D={T * HD} for "
                                      f"packed element indptrs)",
                             got="a different last entry")
    if T is not None and values[-1] != T and HD is not None and HD != 1:
        s = packed_sections(values) or len(values)
        if values[s - 1] == T * HD:
            raise GuardError("GL107", argument=argument, function=function,
                             expected=f"token offsets ending at q's token count T={T}",
                             got=f"element offsets (ending at T*H*D={T * HD})",
                             fix="divide by H*D, or use layout=\"cudnn\" where element offsets are meant")
    check_prefix_sums(values, argument, function)
    if T is not None and values[-1] != T:
        raise GuardError("GL103", argument=argument, function=function,
                         expected=f"token offsets ending at q's token count T={T}",
                         got="a different last entry")
    if values[-1] > INT32_MAX:
        raise GuardError("GL103", argument=argument, function=function,
                         expected="offsets that fit int32", got=f"a last entry above {INT32_MAX}")
    return tuple(values)


def _lengths(offsets: Sequence[int]) -> list:
    return [offsets[i + 1] - offsets[i] for i in range(len(offsets) - 1)]


# -- building the plan ------------------------------------------------------------------------------

def _upload(values: list, device: torch.device) -> torch.Tensor:
    """One host-to-device copy, asynchronous: pinned staging memory, ``non_blocking=True``."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.int32)
    pinned = device.type == "cuda"
    staged = torch.tensor(values, dtype=torch.int32, pin_memory=pinned)
    return staged.to(device, non_blocking=True)


def _build(offsets: tuple, *, layout: str, bucket: bool, device: torch.device,
           elements_per_token: Optional[int], argument: str, function: Optional[str],
           v_elements_per_token: Optional[int] = None, q_shape: Any = None) -> VarlenMetadata:
    B = len(offsets) - 1
    lengths = _lengths(offsets)
    max_seqlen = max(lengths) if lengths else 0
    values = list(offsets) + lengths
    extra: dict = {"padded_batch_size": B}
    sections = 0
    if layout != "tokens":
        HD = elements_per_token
        if HD is None:  # element offsets need q's H*D (prepare() requires q for these layouts)
            raise GuardError("GL107", argument="q", function=function,
                             expected=f"q (total_tokens, num_heads, head_dim): layout {layout!r} needs its H*D",
                             got="no q")
        Bp = bucket_batch_size(B) if bucket else B
        padded = list(offsets) + [offsets[-1]] * (Bp - B)
        strides = (HD, HD, HD) if layout == "cudnn" else (HD, v_elements_per_token or HD)
        if padded[-1] * max(strides) > INT32_MAX:
            raise GuardError("GL103", argument=argument, function=function,
                             expected="element offsets (T*H*D) that fit the cuDNN backend's int32",
                             got=f"T*H*D above {INT32_MAX}")
        sections = len(strides)
        for stride in strides:
            values += [x * stride for x in padded]
        values += lengths + [0] * (Bp - B)
        extra = {"padded_batch_size": Bp, "elements_per_token": HD,
                 "flashinfer_max_seqlen": bucket_max_seqlen(
                     max_seqlen, SEQLEN_BUCKETS if layout == "cudnn" else VLLM_SEQLEN_BUCKETS)
                 if bucket else max_seqlen}
    if capturing(device):
        # A copy captured into the graph would replay from a staging buffer that is reused later.
        raise _capture_error(argument, offsets, function)
    buf = _upload(values, device)
    own = None if is_compiling() else (buf, fingerprint(buf), buf._version, q_shape)
    cu = buf[:B + 1]
    seq = buf[B + 1:2 * B + 1]
    if sections:
        Bp = extra["padded_batch_size"]
        start = 2 * B + 1
        extra["packed_indptrs"] = buf[start:start + sections * (Bp + 1)]
        extra["sequence_lengths"] = buf[start + sections * (Bp + 1):].view(Bp, 1, 1, 1)
    else:
        extra["sequence_lengths"] = seq
    meta = VarlenMetadata(layout=layout, cu_seqlens=cu, seq_lens=seq, max_seqlen=max_seqlen,
                          batch_size=B, total_tokens=offsets[-1], host_cu_seqlens=offsets, **extra)
    object.__setattr__(meta, "_own", own)
    return meta


def _query_shape(q: Any, function: Optional[str]) -> tuple:
    shape = getattr(q, "shape", None)
    if shape is None or len(shape) < 1:
        raise GuardError("GL106", argument="q", function=function,
                         expected="q of shape (total_tokens, num_heads, head_dim)", got=describe(q))
    elements = math.prod(int(d) for d in shape[1:])
    if elements < 1:
        raise GuardError("GL106", argument="q", function=function,
                         expected="q with at least one element per token", got=describe(q))
    return int(shape[0]), elements, q.device


def _token_stride(v: Any, function: Optional[str]) -> Optional[int]:
    """Elements between two tokens of v (vLLM's v section is addressed in v's own storage)."""
    if v is None:
        return None
    if not isinstance(v, torch.Tensor) or v.dim() < 3:
        raise GuardError("GL106", argument="v", function=function,
                         expected="v of shape (total_tokens, num_heads, head_dim)", got=describe(v))
    return int(v.stride(-3))


def prepare(cu_seqlens: Any, q: Any = None, *, layout: str = "tokens", bucket: bool = False,
            function: Optional[str] = None, argument: str = "cu_seqlens", v: Any = None,
            counted: bool = True) -> tuple:
    """``prepare_varlen_metadata`` that also says whether the result was freshly built (not cached).
    ``counted=False``: a host tensor's read is a free check (see ``read_host``)."""
    compiling = is_compiling()
    shape = getattr(q, "shape", None)
    device = getattr(q, "device", None)
    v_stride = _token_stride(v, function) if layout == "vllm" else None
    # The plan depends on q only through its shape (T, H*D) and device (and v's token stride for vllm).
    tag = ("meta", layout, bool(bucket), shape, device) + ((v_stride,) if v_stride else ())
    is_tensor = isinstance(cu_seqlens, torch.Tensor)
    if is_tensor and not compiling:
        meta = cache.get(cu_seqlens, tag)
        if meta is not MISS:
            return meta, False
    if layout not in LAYOUTS:
        raise GuardError("GL103", argument="layout", function=function,
                         expected=" or ".join(repr(x) for x in LAYOUTS), got=repr(layout))
    if q is not None:
        T, HD, device = _query_shape(q, function)
    elif layout != "tokens":
        raise GuardError("GL107", argument="q", function=function,
                         expected="q (total_tokens, num_heads, head_dim): element offsets need H*D",
                         got="None")
    else:
        T = HD = None
        device = cu_seqlens.device if is_tensor else torch.device("cpu")
    if is_tensor:
        check_index_tensor(cu_seqlens, argument, function)
        if cu_seqlens.device.type == "meta":
            raise GuardError("GL103", argument=argument, function=function,
                             expected="a tensor with values (not on the meta device)", got=describe(cu_seqlens))
        host = read_host(cu_seqlens, argument, function, counted=counted)
        host_key = None
    else:
        host = host_sequence(cu_seqlens, argument, function)
        host_key = tag + (host,)
        if not compiling:
            meta = cache.get_host(host_key)
            if meta is not MISS:
                return meta, False
    offsets = token_offsets(host, layout=layout, total_tokens=T, elements_per_token=HD,
                            argument=argument, function=function)
    meta = _build(offsets, layout=layout, bucket=bucket, device=device, elements_per_token=HD, q_shape=shape,
                  argument=argument, function=function, v_elements_per_token=v_stride)
    if not compiling:
        if host_key is None:
            cache.put(cu_seqlens, tag, meta)  # also remembers that meta was made from this tensor as it is
            origin, own = meta._origin, meta._own
            if origin is not None and own is not None:
                # What the guards' prepared path compares, in one tuple (see ready.guard_varlen).
                object.__setattr__(meta, "_fast", (origin.ref, origin.fp, own[0], own[2], own[3]))
        else:
            cache.seal(meta, None)
            cache.put_host(host_key, meta)
    return meta, True


def prepare_varlen_metadata(cu_seqlens: Any, q: Optional[torch.Tensor] = None, *, layout: str = "tokens",
                            bucket: bool = False, v: Optional[torch.Tensor] = None) -> VarlenMetadata:
    """Prepare varlen metadata once per batch; pass the result to every layer.

    Args:
        cu_seqlens: token offsets ``(B+1,)``, int32/int64, starting at 0, non-decreasing, ending at
            q's token count. A GPU tensor costs one host read (cached per tensor version); a CPU
            tensor, list, tuple or numpy array costs no device read at all. For ``layout="cudnn"`` the
            engine's packed element indptrs ``(3(B+1),)`` are accepted too.
        q: ``(total_tokens, num_heads, head_dim)``; its device receives the metadata and its shape
            checks the total (and gives H*D for element offsets). Required for ``layout="cudnn"``.
        layout: ``"tokens"`` (FA-style kernels), ``"cudnn"`` (sglang's flashinfer_cudnn backend: packed
            element indptrs ``[qk | v | o]``, padded ``sequence_lengths``, ``flashinfer_max_seqlen``) or
            ``"vllm"`` (vLLM's FlashInfer ViT wrapper: two sections ``[qko | v]``).
        bucket: pad the batch (8, 16, 32, 64, then multiples of 8) and round ``flashinfer_max_seqlen`` up
            (4096 ... 131072, then multiples of 4096) so one CUDA graph serves many batches, as the
            engines' own cuDNN metadata does.
        v: layout ``"vllm"`` only: the value tensor whose token stride addresses the v section (vLLM
            passes v as a view into the fused qkv projection: three times H*D). Default: H*D.

    Raises ``GuardError``: GL103 (invalid offsets), GL107 (token vs element offsets), GL105 (a read or
    upload would be needed during CUDA graph capture).
    """
    if not _cache.enabled:
        _cache.new_call()
    return prepare(cu_seqlens, q, layout=layout, bucket=bucket, function="prepare_varlen_metadata", v=v)[0]
