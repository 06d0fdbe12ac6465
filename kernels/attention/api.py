"""Varlen (packed) attention: ``varlen_attention`` over several backends, and ``cudnn_vision_attention``,
a drop-in for the engine's flashinfer_cudnn vision backend. Both are guarded: missing metadata is derived
once. Backends: ``triton`` (ours, native odd head dims), ``gluon`` (ours, warp-specialized, Hopper D=64/80/96/128),
``flashinfer`` (ragged FA2/FA3, cuDNN prefill), ``sdpa`` (torch loop, the CPU default), ``torch-varlen`` and
``auto`` (fastest measured). ``max_seqlen`` sizes launches; the Gluon kernel runs only where it is verified.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from guardlint.contracts import get as get_contract
from guardlint.guard import GuardError, describe, guard_cudnn_vision, guard_varlen, prepare_varlen_metadata
from guardlint.guard._cache import MISS, IdentityCache
from guardlint.guard.metadata import capturing
from guardlint.guard.validate import plan_fits

from .. import _gluon as gluon_modules
from . import dispatch
from . import flashinfer as fi
from . import reference as torch_paths
from . import triton as triton_path
from . import triton_bwd

BACKENDS = ("auto", "triton", "gluon", "sdpa", "torch-varlen", "flashinfer", "flashinfer-fa2", "flashinfer-fa3",
            "flashinfer-cudnn")
# Concrete backends that ``auto`` may pick (the names used in the dispatch table).
CONCRETE = ("triton", "gluon", "sdpa", "torch-varlen", "flashinfer-fa2", "flashinfer-fa3", "flashinfer-cudnn")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256

__all__ = ["BACKENDS", "cudnn_vision_attention", "select_backend", "varlen_attention"]


# -- the Triton path as one op for torch.compile -----------------------------------------------------

@torch.library.custom_op("guardlint::varlen_attention_triton", mutates_args=())
def varlen_attention_triton_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               max_seqlen: int, softmax_scale: float, causal: bool,
                               max_seqlen_verified: bool = False) -> torch.Tensor:
    """``torch.ops.guardlint.varlen_attention_triton``: the Triton kernel as one opaque op."""
    return triton_path.varlen_attention_triton(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal,
                                               max_seqlen_verified=max_seqlen_verified)


@varlen_attention_triton_op.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, max_seqlen_verified=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("guardlint::varlen_attention_triton_train", mutates_args=())
def varlen_attention_triton_train_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                     max_seqlen: int, softmax_scale: float, causal: bool,
                                     max_seqlen_verified: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.guardlint.varlen_attention_triton_train``: the Triton forward that also returns each row's
    log-sum-exp ``(T, H)`` (base 2, of the scaled logits), which its backward reuses instead of recomputing."""
    return _forward_saving_lse(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, max_seqlen_verified)


def _forward_saving_lse(q, k, v, cu_seqlens, max_seqlen, scale, causal, verified):
    """(out, lse): the Triton forward and each row's log-sum-exp, for the training op and ``_TritonTrain``."""
    lse = torch.empty(q.shape[:2], dtype=triton_bwd.stats_dtype(q.dtype), device=q.device)
    out = triton_path.varlen_attention_triton(q, k, v, cu_seqlens, max_seqlen, scale, causal,
                                              max_seqlen_verified=verified, lse=lse)
    return out, lse


@varlen_attention_triton_train_op.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, max_seqlen_verified=False):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(q.shape[:2], dtype=triton_bwd.stats_dtype(q.dtype)))


@torch.library.custom_op("guardlint::varlen_attention_triton_backward", mutates_args=())
def varlen_attention_triton_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                        out: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                        softmax_scale: float, causal: bool, lse: Optional[torch.Tensor] = None
                                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.guardlint.varlen_attention_triton_backward``: (dq, dk, dv) of the Triton forward
    (``triton_bwd``); ``lse`` from ``varlen_attention_triton_train``, or None to recompute it."""
    return triton_bwd.varlen_attention_triton_backward(grad_out, q, k, v, out, cu_seqlens, max_seqlen, softmax_scale,
                                                       causal, lse=lse)


@varlen_attention_triton_backward_op.register_fake
def _(grad_out, q, k, v, out, cu_seqlens, max_seqlen, softmax_scale, causal, lse=None):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _triton_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal = inputs[:7]
    ctx.save_for_backward(q, k, v, cu_seqlens, output)
    ctx.launch = (max_seqlen, softmax_scale, causal)


def _triton_backward(ctx, grad_out):
    q, k, v, cu_seqlens, out = ctx.saved_tensors
    dq, dk, dv = varlen_attention_triton_backward_op(grad_out, q, k, v, out, cu_seqlens, *ctx.launch)
    return dq, dk, dv, None, None, None, None, None


def _triton_train_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal = inputs[:7]
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, cu_seqlens, out, lse)
    ctx.launch = (max_seqlen, softmax_scale, causal)


def _triton_train_backward(ctx, grad_out, grad_lse):
    q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
    dq, dk, dv = varlen_attention_triton_backward_op(grad_out, q, k, v, out, cu_seqlens, *ctx.launch, lse)
    return dq, dk, dv, None, None, None, None, None


# The forward ops' backward: torch.compile traces both (eager calls that need a graph take ``_TritonTrain``;
# the plain op recomputes the statistics in its backward).
varlen_attention_triton_op.register_autograd(_triton_backward, setup_context=_triton_setup_context)
varlen_attention_triton_train_op.register_autograd(_triton_train_backward, setup_context=_triton_train_setup_context)


class _TritonTrain(torch.autograd.Function):
    """The eager training path: the Triton forward (saving each row's log-sum-exp) and its backward, launched
    directly. The same kernels as the training op, without the op dispatcher and its autograd wrapper, which
    cost more host time than the kernels' GPU time on short batches (bench/results/attention_backward_host.md)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, causal, verified):
        out, lse = _forward_saving_lse(q, k, v, cu_seqlens, max_seqlen, scale, causal, verified)
        ctx.save_for_backward(q, k, v, cu_seqlens, out, lse)
        ctx.launch = (max_seqlen, scale, causal)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # a second derivative raises: the kernels have none
        q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
        max_seqlen, scale, causal = ctx.launch
        dq, dk, dv = triton_bwd.varlen_attention_triton_backward(grad_out, q, k, v, out, cu_seqlens, max_seqlen,
                                                                 scale, causal, lse=lse)
        return dq, dk, dv, None, None, None, None, None


def _triton_trained(q, k, v, cu_seqlens, max_seqlen, scale, causal, verified: bool):
    if torch.compiler.is_compiling():
        # Through the training op: torch.compile traces its forward and its registered backward.
        return varlen_attention_triton_train_op(q, k, v, cu_seqlens, max_seqlen, scale, causal, verified)[0]
    return _TritonTrain.apply(q, k, v, cu_seqlens, max_seqlen, scale, causal, verified)


def _run_triton(q, k, v, cu_seqlens, max_seqlen, scale, causal, verified: bool = False):
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # Autograd records the Triton backward, which reuses the forward's statistics.
        return _triton_trained(q, k, v, cu_seqlens, max_seqlen, scale, causal, verified)
    if torch.compiler.is_compiling():
        # Through the op: torch.compile sees one node.
        return varlen_attention_triton_op(q, k, v, cu_seqlens, max_seqlen, scale, causal, verified)
    # Eager calls skip the op dispatcher: it costs more than the rest of the host path together
    # (bench/results/attention_overhead.md).
    return triton_path.varlen_attention_triton(q, k, v, cu_seqlens, max_seqlen, scale, causal,
                                               max_seqlen_verified=verified)


# -- the Gluon path (Hopper): imported on first use, absent when this Triton has no Gluon --------------

def _gluon():
    """``attention.gluon``, or None when ``triton.experimental.gluon`` does not import (``_gluon.load``)."""
    return gluon_modules.load("attention.gluon")


@torch.compiler.assume_constant_result
def _gluon_runnable(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """Whether the Gluon kernel takes these shapes, dtypes and device. v and the base addresses are checked
    per call, on real tensors (the runner falls back to Triton for a layout TMA cannot read). Under
    torch.compile this runs once at trace time, as a constant: Dynamo cannot trace the lazy import."""
    gluon_path = _gluon()
    return gluon_path is not None and gluon_path.supports(q, k, k, causal, pointers=False)


@torch.library.custom_op("guardlint::varlen_attention_gluon", mutates_args=())
def varlen_attention_gluon_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                              max_seqlen: int, softmax_scale: float, causal: bool) -> torch.Tensor:
    """``torch.ops.guardlint.varlen_attention_gluon``: the Gluon kernel as one opaque op."""
    return _gluon_eager(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal)


@varlen_attention_gluon_op.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _gluon_eager(q, k, v, cu_seqlens, max_seqlen: int, scale: float, causal: bool) -> torch.Tensor:
    """The Gluon kernel, reached only by calls whose max_seqlen is verified (``_resolve``): its grid holds
    cdiv(max_seqlen, 128 or 192) query tiles per sequence and nothing covers more."""
    gluon_path = _gluon()
    if not gluon_path.supports(q, k, v, causal) or cu_seqlens.stride(0) != 1 or scale <= 0:
        # The plan is per shape; strides are checked here, per call: a layout TMA cannot read runs on Triton,
        # and so do strided offsets and a scale <= 0 (the Gluon softmax scales after masking with -inf).
        return triton_path.varlen_attention_triton(q, k, v, cu_seqlens, max_seqlen, scale, causal,
                                                   max_seqlen_verified=True)
    return gluon_path.varlen_attention_gluon(q, k, v, cu_seqlens, max_seqlen, scale, causal)


# -- validation (GL106: what no backend can take) ---------------------------------------------------

def _bad(argument: str, expected: str, got: str, function: str, detail: str = "",
         fix: Optional[str] = None) -> GuardError:
    """GL106 with the fix that fits this failure (None: the catalog's reshape advice, for the layout ones)."""
    return GuardError("GL106", argument=argument, expected=expected, got=got, function=function, detail=detail,
                      fix=fix)


def _cannot_run(backend: str, q: torch.Tensor, function: str) -> GuardError:
    """A backend that cannot take these inputs here: GL301 when there is no GPU at all, else GL106."""
    if backend in ("triton", "gluon") and not torch.cuda.is_available():
        return GuardError("GL301", argument="backend", function=function, expected="a CUDA device for Triton",
                          got=f"{backend!r} with q on {q.device} and no GPU driver", detail=_why_not(backend, q))
    # The catalog's own advice for a backend that cannot run the inputs (not the reshape one).
    fix = next((s for s in get_contract("GL106").diagnosis.solutions if "backend" in s), None)
    return GuardError("GL106", argument="backend", function=function, fix=fix,
                      expected=f"a backend that runs head_dim={q.shape[2]} {q.dtype} on {q.device}",
                      got=repr(backend), detail=_why_not(backend, q))


_INDEX_DTYPES = (torch.int32, torch.int64)
_CU_FIX = "Pass cu_seqlens as a 1-D int32 tensor of token offsets (B+1,)."
_BACKEND_FIX = f"Use one of {', '.join(BACKENDS)}."


def _inputs_fit(q: Any, k: Any, v: Any, cu_seqlens: Any) -> bool:
    """The common case in one expression (about a microsecond); ``_check_inputs`` says what is wrong."""
    try:
        total, heads, head_dim = q.shape
        kv_total, kv_heads, kv_dim = k.shape
        dtype = q.dtype
        device = q.device
        return (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
                and type(cu_seqlens) is torch.Tensor and v.shape == k.shape and kv_total == total
                and kv_dim == head_dim and kv_heads > 0 and heads % kv_heads == 0 and head_dim % 16 == 0
                and 16 <= head_dim <= MAX_HEAD_DIM and dtype in DTYPES and k.dtype is dtype and v.dtype is dtype
                and cu_seqlens.dtype in _INDEX_DTYPES and cu_seqlens.dim() == 1 and cu_seqlens.numel() > 0
                and cu_seqlens.layout is torch.strided
                and k.device == device and v.device == device and cu_seqlens.device == device)
    except (AttributeError, TypeError, ValueError):
        return False


def _check_inputs(function: str, q: Any, k: Any, v: Any, cu_seqlens: Any) -> None:
    """Shapes, dtypes, devices and head dims, before anything launches. No device reads."""
    if _inputs_fit(q, k, v, cu_seqlens):
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise _bad(name, "a torch.Tensor", describe(t), function)
        if t.dim() != 3:
            shape = "(total_tokens, num_heads, head_dim)" if name == "q" else "(total_tokens, num_kv_heads, head_dim)"
            raise _bad(name, f"a 3-D tensor {shape}", describe(t), function,
                       "Packed varlen layout: flatten (B, S, H, D) to (B*S, H, D) and pass cu_seqlens.")
    if q.dtype not in DTYPES:
        raise _bad("q", "float16, bfloat16 or float32", describe(q), function,
                   fix="Cast q, k and v to one of float16, bfloat16 or float32.")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise _bad(name, f"q's dtype {q.dtype}", describe(t), function, fix="Cast k and v to q's dtype.")
        if t.device != q.device:
            raise _bad(name, f"q's device {q.device}", describe(t), function,
                       fix="Move q, k and v to one device (k.to(q.device)).")
    total, heads, head_dim = q.shape
    if k.shape != v.shape:
        raise _bad("v", f"k's shape {tuple(k.shape)}", describe(v), function,
                   fix="Pass v with k's shape (total_tokens, num_kv_heads, head_dim).")
    if k.shape[0] != total:
        raise _bad("k", f"{total} tokens (q's total_tokens)", describe(k), function,
                   fix="Pack k and v with the same cu_seqlens as q (one row per token).")
    if k.shape[2] != head_dim:
        raise _bad("k", f"head_dim {head_dim} (q's)", describe(k), function, fix="Project k and v to q's head_dim.")
    if heads < 1 or k.shape[1] < 1 or heads % k.shape[1]:
        raise _bad("k", f"num_kv_heads dividing num_heads={heads} (GQA)", describe(k), function,
                   fix="Use a num_kv_heads that divides num_heads (or repeat kv heads: "
                       "k.repeat_interleave(num_heads // num_kv_heads, dim=1)).")
    if head_dim % 16 or not 16 <= head_dim <= MAX_HEAD_DIM:
        raise _bad("q", f"head_dim 64, 80, 96, 128 or another multiple of 16 up to {MAX_HEAD_DIM}",
                   describe(q), function,
                   fix="Pad head_dim to a multiple of 16 (at most 256) and slice the output, or use backend=\"sdpa\".")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise _bad("cu_seqlens", "an integer tensor of token offsets (B+1,)", describe(cu_seqlens), function,
                   fix=_CU_FIX)
    if cu_seqlens.layout is not torch.strided:
        # A sparse (or other non-strided) tensor has no data pointer for a kernel, nor host values to slice.
        raise _bad("cu_seqlens", "a dense (strided) 1-D tensor of token offsets (B+1,)",
                   f"{describe(cu_seqlens)} with layout {cu_seqlens.layout}", function, fix=_CU_FIX)
    if cu_seqlens.dim() != 1:
        # A (1, B+1) tensor would read as one sequence boundary per row: offsets no sequence spans, zeros out.
        raise _bad("cu_seqlens", "1-D token offsets (B+1,)", f"shape {tuple(cu_seqlens.shape)}", function,
                   fix=_CU_FIX)
    if cu_seqlens.numel() < 1 or cu_seqlens.dtype not in _INDEX_DTYPES:
        raise _bad("cu_seqlens", "a 1-D int32/int64 tensor (B+1,)", describe(cu_seqlens), function, fix=_CU_FIX)
    if cu_seqlens.device != q.device:
        raise _bad("cu_seqlens", f"q's device {q.device}", describe(cu_seqlens), function,
                   "A kernel would read a host pointer on the GPU (an illegal memory access).",
                   fix="Move cu_seqlens to q's device once per batch (cu_seqlens.to(q.device, non_blocking=True)).")


def _check_call(function: str, max_seqlen: Any, softmax_scale: Any, causal: Any, backend: Any,
                max_seqlen_verified: Any = False) -> None:
    if type(max_seqlen_verified) is not bool:
        raise _bad("max_seqlen_verified", "a bool (set by the guard)", describe(max_seqlen_verified), function,
                   fix="Leave max_seqlen_verified to the guard.")
    if type(max_seqlen) is not int or max_seqlen < 0:
        raise GuardError("GL103", argument="max_seqlen", function=function,
                         expected="a Python int >= 0 (the longest sequence)", got=describe(max_seqlen))
    if softmax_scale is not None and (not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool)
                                      or not math.isfinite(softmax_scale)):
        raise _bad("softmax_scale", "None or a finite float", describe(softmax_scale), function,
                   fix="Pass softmax_scale=None (head_dim ** -0.5) or a finite float.")
    if not isinstance(causal, bool):
        raise _bad("causal", "a bool", describe(causal), function, fix="Pass causal=True or causal=False.")
    if backend not in BACKENDS:
        raise _bad("backend", " / ".join(repr(b) for b in BACKENDS), describe(backend), function, fix=_BACKEND_FIX)


# -- backend choice ---------------------------------------------------------------------------------

_device_info: dict = {}


def _device_key(device: torch.device) -> tuple:
    """(name, capability) of a CUDA device, asked once per device."""
    info = _device_info.get(device.index)
    if info is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        info = (torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)))
        _device_info[device.index] = info
    return info


def _runnable(name: str, q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> bool:
    if name == "sdpa":
        return True
    if name == "triton":
        return q.device.type == "cuda" or triton_path.INTERPRET
    if name == "torch-varlen":
        return torch_paths.torch_varlen_supports(q, k, scale, causal)
    if name == "gluon":
        return _gluon_runnable(q, k, causal)
    if name.startswith("flashinfer-"):
        return fi.supports(name[len("flashinfer-"):], q.shape[2], q.dtype, q.device)
    return False


def _why_not(name: str, q: torch.Tensor) -> str:
    if name == "triton":
        return ("Triton kernels need a CUDA device; on the CPU only the interpreter (TRITON_INTERPRET=1, set "
                "before import) runs them")
    if name.startswith("flashinfer"):
        reason = fi.unavailable_reason(q.device)
        if reason:
            return reason
        return (f"FlashInfer {name[len('flashinfer-'):]} takes head dims FA2 {sorted(fi.FA2_HEAD_DIMS)}, "
                f"FA3 {sorted(fi.FA3_HEAD_DIMS)} (Hopper), cuDNN {sorted(fi.CUDNN_HEAD_DIMS)} (bfloat16)")
    if name == "torch-varlen":
        return torch_paths._probe_varlen_attn() or "torch varlen_attn takes float16/bfloat16 CUDA tensors"
    if name == "gluon":
        if _gluon() is None:
            return "this Triton has no Gluon (triton.experimental.gluon)"
        g = _gluon()
        dims = list(g.HEAD_DIMS) + (list(g.SPLIT_HEAD_DIMS) if g.SPLIT_ENABLED else [])
        mask = "causal or not" if g.CAUSAL_ENABLED else "non-causal (GUARDLINT_GLUON_CAUSAL=0)"
        return (f"the Gluon kernel takes a Hopper GPU (sm_90), head dims {dims}, float16/"
                f"bfloat16, {mask}, q/k/v with contiguous heads")
    return ""


def select_backend(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
                   softmax_scale: Optional[float] = None, causal: bool = False, backend: str = "auto",
                   max_seqlen_verified: bool = False) -> str:
    """The concrete backend a call with these inputs runs (``auto`` and ``flashinfer`` resolved; ``gluon`` is
    ``triton`` unless max_seqlen is verified, as ``varlen_attention`` says)."""
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[2] ** -0.5
    return _resolve(backend, q, k, cu_seqlens, max_seqlen, scale, causal, "select_backend",
                    eager=not _capturing(q), verified=hint_verified(q, max_seqlen, max_seqlen_verified))


def hint_verified(q: torch.Tensor, max_seqlen: int, max_seqlen_verified: bool) -> bool:
    """Whether no sequence is longer than ``max_seqlen``, as a fact: the guard checked it against the offsets
    (``max_seqlen_verified``), or it is at least q's token count, which no sequence exceeds."""
    return triton_path.covers(max_seqlen, q.shape[0], max_seqlen_verified)


# Which kernels trust max_seqlen. The Triton kernel does not need to: its programs loop over the query tiles
# a short grid leaves out (and run the one-tile kernel where the hint is verified). The Gluon kernels size
# their grid by max_seqlen and each program owns one query tile, its producer warp and consumer warpgroups
# working through one barrier protocol; a tile loop there would re-arm every barrier per tile and cost the
# consumers registers they do not have (240 each, set by setmaxnreg; the Triton kernel's loop alone costs up to
# 100 registers and spills). So ``gluon`` runs only where the hint is verified (``hint_verified``), and any
# other call that ``gluon`` or ``auto`` would send there runs on the Triton kernel (``auto``: the fastest other
# measured backend). The guard passes ``max_seqlen_verified=True`` where it derived max_seqlen from the
# offsets or checked the caller's value against them.
# Two other backends trust the hint and are treated the same way: torch's varlen flash (``torch-varlen``) sizes
# its grid by max_seqlen, and FlashInfer's cuDNN prefill (``flashinfer-cudnn``) takes it as
# max_token_per_sequence; with a hint below the longest sequence either can leave rows unwritten. So ``auto``
# and ``flashinfer`` leave them out where the hint is unverified, and an explicit choice of either runs the
# Triton kernel (with its backward where grad is needed). FlashInfer's
# ragged FA2/FA3 path is not affected: it plans from the host offsets (``_host_offsets``), not from the hint.
HINT_TRUSTING = ("gluon", "torch-varlen", "flashinfer-cudnn")


def _resolve(backend: str, q, k, cu_seqlens, max_seqlen: int, scale: float, causal: bool, function: str,
             eager: bool = True, verified: bool = False) -> str:
    if backend == "auto" or backend == "flashinfer":
        if q.device.type != "cuda":
            if backend == "flashinfer":
                raise _cannot_run(backend, q, function)
            return "sdpa"
        name, capability = _device_key(q.device)
        only_fi = backend == "flashinfer"

        def runnable(candidate: str) -> bool:
            if only_fi and not candidate.startswith("flashinfer-"):
                return False
            if candidate in HINT_TRUSTING and not verified:
                return False
            return _runnable(candidate, q, k, scale, causal)

        choice = dispatch.choose(
            device_type="cuda", device_name=name, capability=capability, head_dim=q.shape[2],
            dtype=str(q.dtype).replace("torch.", ""), causal=causal, batch=max(cu_seqlens.shape[0] - 1, 1),
            max_seqlen=triton_path.launch_rows(max_seqlen, max(q.shape[0], 1)), total_tokens=max(q.shape[0], 1),
            runnable=runnable, memo_extra=(backend, q.shape[1] // k.shape[1], scale == q.shape[2] ** -0.5, verified),
            eager=eager)
        if only_fi and not choice.startswith("flashinfer-"):
            # Not in the table for this shape: FA3 on Hopper, else FA2, else cuDNN; a head dim none of them
            # runs (80, 96, ...) goes to our kernel rather than to padded copies.
            choice = next((f"flashinfer-{v}" for v in ("fa3", "fa2", "cudnn")
                           if runnable(f"flashinfer-{v}")), "triton")
        return choice
    if not _runnable(backend, q, k, scale, causal):
        raise _cannot_run(backend, q, function)
    if backend in HINT_TRUSTING and not verified:
        return "triton"
    return backend


# -- host offsets and the cuDNN element offsets -----------------------------------------------------

def _host_offsets(q: torch.Tensor, cu_seqlens: torch.Tensor, metadata: Any) -> tuple:
    host = getattr(metadata, "host_cu_seqlens", None) if metadata is not None else None
    # The plan's offsets only where it was made from these offsets (the guard refuses others with GL103;
    # with the guard off, cu_seqlens is the truth, as on every other backend).
    if isinstance(host, (tuple, list)) and plan_fits(metadata, cu_seqlens):
        return tuple(host)
    if cu_seqlens.device.type == "cpu":
        return tuple(cu_seqlens.tolist())
    # Cached per cu_seqlens version by the guard: the first layer reads, the others do not.
    return prepare_varlen_metadata(cu_seqlens, q).host_cu_seqlens


_MAX_CACHED = 8
_MAX_GRID_YZ = 65535
_element_offsets = IdentityCache(_MAX_CACHED)


def _cached(tag: tuple, sources: tuple, build):
    """LRU of device-side offsets derived from the ``sources`` tensors (per object and version) and ``tag``."""
    value = _element_offsets.get(sources, tag)
    if value is MISS:
        value = build()
        _element_offsets.put(sources, tag, value)
    return value


def _run_cudnn_tokens(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata):
    """The cuDNN prefill from token offsets (or a cudnn-layout plan that matches q's H*D)."""
    heads, head_dim = q.shape[1], q.shape[2]
    if (metadata is not None and getattr(metadata, "layout", None) == "cudnn"
            and getattr(metadata, "elements_per_token", None) == heads * head_dim and k.shape[1] == heads):
        packed = metadata.packed_indptrs
        section = packed.shape[0] // 3
        qk = packed[:section].view(section, 1, 1, 1)
        vo = packed[section:2 * section].view(section, 1, 1, 1)
        out = packed[2 * section:].view(section, 1, 1, 1)
        return fi.cudnn_prefill(q, k, v, out, qk, metadata.sequence_lengths, metadata.flashinfer_max_seqlen,
                                scale, causal, v_offsets=vo)
    qo_off, kv_off, lengths = _cached(("tokens", heads, k.shape[1], head_dim), (cu_seqlens, sequence_lengths),
                                      lambda: fi.cudnn_offsets(q, k, cu_seqlens, sequence_lengths))
    return fi.cudnn_prefill(q, k, v, qo_off, kv_off, lengths, max_seqlen, scale, causal)


def _run_triton_backend(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata, function):
    return _run_triton(q, k, v, cu_seqlens, max_seqlen, scale, causal)


def _run_triton_verified(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata, function):
    return _run_triton(q, k, v, cu_seqlens, max_seqlen, scale, causal, True)


def _run_triton_autograd(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata, function):
    """The Triton kernel through its training op, so that autograd records it (inputs that need a graph)."""
    return _triton_trained(q, k, v, cu_seqlens, max_seqlen, scale, causal, False)


def _run_triton_autograd_verified(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata,
                                  function):
    return _triton_trained(q, k, v, cu_seqlens, max_seqlen, scale, causal, True)


def _run_sdpa(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata, function):
    return torch_paths.sdpa_varlen(q, k, v, _host_offsets(q, cu_seqlens, metadata), scale, causal)


def _run_torch_varlen(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata, function):
    return torch_paths.torch_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, max_seqlen, scale,
                                    causal)


def _run_cudnn(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata, function):
    if sequence_lengths is None:
        sequence_lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return _run_cudnn_tokens(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, sequence_lengths,
                             max_seqlen, scale, causal, metadata)


def _run_ragged(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata, function, variant):
    offsets = _host_offsets(q, cu_seqlens, metadata)
    if offsets[0] != 0 or offsets[-1] != q.shape[0]:
        raise GuardError("GL103", argument="cu_seqlens", function=function,
                         expected=f"token offsets from 0 to q's token count {q.shape[0]}",
                         got=f"offsets from {offsets[0]} to {offsets[-1]}")
    return fi.ragged(q.contiguous(), k.contiguous(), v.contiguous(), offsets, scale, causal, variant)


def _run_gluon(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata, function):
    if torch.compiler.is_compiling():
        return varlen_attention_gluon_op(q, k, v, cu_seqlens, max_seqlen, scale, causal)
    return _gluon_eager(q, k, v, cu_seqlens, max_seqlen, scale, causal)


def _run_empty(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata, function):
    return torch.zeros_like(q)


_RUNNERS = {
    "triton": _run_triton_backend, "gluon": _run_gluon, "sdpa": _run_sdpa, "torch-varlen": _run_torch_varlen,
    "flashinfer-cudnn": _run_cudnn,
    "flashinfer-fa2": lambda *a: _run_ragged(*a, variant="fa2"),
    "flashinfer-fa3": lambda *a: _run_ragged(*a, variant="fa3"),
}


def _runner(name: str, q, cu_seqlens, function: str):
    """The function that runs backend ``name`` on inputs of these shapes (checked here, once per shape)."""
    if q.shape[0] == 0 or cu_seqlens.shape[0] < 2:
        return _run_empty
    if name in ("triton", "gluon") and (cu_seqlens.shape[0] - 1 > _MAX_GRID_YZ or q.shape[1] > _MAX_GRID_YZ):
        raise _bad("cu_seqlens", f"at most {_MAX_GRID_YZ} sequences and heads per launch (CUDA grid y/z)",
                   describe(cu_seqlens), function,
                   fix="Split the batch into launches of at most 65535 sequences (or heads), or use backend=\"sdpa\".")
    return _RUNNERS[name]


def _verified_runner(run, verified: bool):
    """``run``, or where it is the Triton kernel's and max_seqlen is verified, the one-tile-per-program kernel's."""
    return _run_triton_verified if verified and run is _run_triton_backend else run


def _planned_triton(q, k, cu_seqlens, max_seqlen: int, scale: float, causal: bool, verified: bool):
    """The Triton runner for eager calls of one signature: a launch planned once (no op dispatcher)."""
    launch = triton_path.plan_launch(q, k, cu_seqlens, max_seqlen, scale, causal, max_seqlen_verified=verified)

    def run(q, k, v, cu_seqlens, *unused):
        return launch(q, k, v, cu_seqlens)

    return run


def _run(name: str, q, k, v, cu_seqlens, sequence_lengths, max_seqlen: int, scale: float, causal: bool,
         metadata, function: str, verified: bool = False) -> torch.Tensor:
    run = _verified_runner(_runner(name, q, cu_seqlens, function), verified)
    return run(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata, function)


# Per call signature (backend, shapes, dtypes, devices, cu_seqlens layout, max_seqlen, scale, causal,
# max_seqlen_verified): the validated, resolved (runner, scale). A hit skips validation and the backend choice,
# which depend on nothing else (exact tensor types and scalar types are checked before the lookup, so 7.0 or
# True never hit 7 or 1).
# Emptied with the dispatch table (``dispatch.reset()``); not used while torch.compile traces.
_calls: dict = {}
_MAX_CALLS = 4096
_CHOOSING = ("auto", "flashinfer")


def _capturing(q: torch.Tensor) -> bool:
    """Is this call being captured into a CUDA graph (on q's current stream)?"""
    return capturing(q.device)
_SCALE_TYPES = (type(None), float, int)
dispatch.dependent_caches.append(_calls)


# Backends whose output carries an autograd graph; the others (Gluon, FlashInfer) have no backward.
AUTOGRAD = ("sdpa", "torch-varlen", "triton")


def _needs_grad(q, k, v) -> Optional[str]:
    """The first of q/k/v that requires grad while grad mode is on, or None."""
    if not torch.is_grad_enabled():
        return None
    return next((n for n, t in (("q", q), ("k", k), ("v", v)) if getattr(t, "requires_grad", False)), None)


def _grad_choice(q, k, cu_seqlens, scale: float, causal: bool, max_seqlen, max_seqlen_verified) -> str:
    """What ``auto`` runs for inputs that need a graph: on a GPU, the fastest backend with a backward by the
    dispatch table's forward + backward times (``dispatch.RULE``; torch's varlen flash only with a verified
    hint, since its kernel trusts it), ``triton`` where the table has none; ``sdpa`` on the CPU."""
    if q.device.type != "cuda":
        return "sdpa"
    name = torch.cuda.get_device_name(q.device)
    verified = hint_verified(q, max_seqlen, max_seqlen_verified)

    def runnable(backend: str) -> bool:
        if backend not in AUTOGRAD or (backend == "torch-varlen" and not verified):
            return False
        return _runnable(backend, q, k, scale, causal)

    rows = triton_path.launch_rows(max_seqlen, max(q.shape[0], 1)) if max_seqlen else max(q.shape[0], 1)
    choice = dispatch.choose(
        device_type="cuda", device_name=name, capability=torch.cuda.get_device_capability(q.device),
        head_dim=q.shape[2], dtype=str(q.dtype).replace("torch.", ""), causal=causal,
        batch=max(cu_seqlens.shape[0] - 1, 1),
        max_seqlen=rows, total_tokens=max(q.shape[0], 1), runnable=runnable, memo_extra=(verified,), train=True)
    return choice if runnable(choice) else "sdpa"


def _for_grad(backend: str, grad: Optional[str], function: str, auto: str = "sdpa") -> str:
    """``backend``, or for inputs that need a graph: ``auto`` becomes ``auto`` (the argument: a backend with a
    backward) and a backend without a backward is refused (GL106), never run into an output that silently leaves
    the graph."""
    if grad is None or backend in AUTOGRAD:
        return backend
    if backend == "auto":
        return auto
    return GuardError("GL106", argument=grad, function=function,
                      expected=f"inputs that do not require grad on backend {backend!r} (it has no backward)",
                      got=f"{grad}.requires_grad=True with grad mode enabled",
                      fix="For training use backend=\"sdpa\" (or \"auto\", which picks it when grad is needed); "
                          "for inference call under torch.no_grad() or pass detached tensors.")


def _plan_call(function: str, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, backend,
               eager: bool, grad: Optional[str] = None, capturing: bool = False,
               max_seqlen_verified: Any = False) -> tuple:
    """(run, scale, backend name) of a call: its inputs checked, its backend resolved (``capturing``: as a call
    under CUDA-graph capture), its launch planned where ``eager`` (a call whose plan is kept)."""
    backend, scale = _checked_call(function, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, backend, grad,
                                   max_seqlen_verified)
    verified = hint_verified(q, max_seqlen, max_seqlen_verified)
    return _plan_backend(function, q, k, cu_seqlens, max_seqlen, scale, causal, backend, eager, capturing, verified,
                         grad)


def _plan_calls(function: str, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, backend,
                grad: Optional[str], max_seqlen_verified: Any = False) -> tuple:
    """(the plan of an eager call, the plan of a call under CUDA-graph capture or None where it is the same
    backend): both made at once, outside capture, so that later calls ask whether the stream is capturing only
    where it matters."""
    backend, scale = _checked_call(function, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, backend, grad,
                                   max_seqlen_verified)
    verified = hint_verified(q, max_seqlen, max_seqlen_verified)
    run, scale, name = _plan_backend(function, q, k, cu_seqlens, max_seqlen, scale, causal, backend, True, False,
                                     verified, grad)
    if backend not in _CHOOSING:
        return (run, scale), None
    captured = _plan_backend(function, q, k, cu_seqlens, max_seqlen, scale, causal, backend, True, True, verified,
                             grad)
    return (run, scale), (None if captured[2] == name else captured[:2])


def _checked_call(function: str, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, backend,
                  grad: Optional[str], max_seqlen_verified: Any = False) -> tuple:
    """(backend, scale) of a call whose arguments pass the checks (``sdpa`` for ``auto`` where grad is needed)."""
    _check_inputs(function, q, k, v, cu_seqlens)
    _check_call(function, max_seqlen, softmax_scale, causal, backend, max_seqlen_verified)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[2] ** -0.5
    auto = _grad_choice(q, k, cu_seqlens, scale, causal, max_seqlen, max_seqlen_verified) \
        if grad is not None and backend == "auto" else "sdpa"
    backend = _for_grad(backend, grad, function, auto)
    if isinstance(backend, GuardError):
        raise backend
    if grad is not None and backend == "torch-varlen" and not hint_verified(q, max_seqlen, max_seqlen_verified):
        backend = "triton"  # the hint is not trusted (see HINT_TRUSTING); the Triton kernels do not depend on it
    if max_seqlen == 0 and q.shape[0] > 0 and cu_seqlens.shape[0] > 1:
        # Offsets from 0 to total_tokens with no sequence longer than 0 cannot cover any token: a kernel
        # sized by max_seqlen would launch nothing and leave the output unwritten.
        raise GuardError("GL103", argument="max_seqlen", function=function,
                         expected=f"the longest sequence length (q has {q.shape[0]} tokens)", got="max_seqlen=0")
    return backend, scale


def _plan_backend(function: str, q, k, cu_seqlens, max_seqlen, scale: float, causal, backend: str, eager: bool,
                  capturing: bool, verified: bool = False, grad: Optional[str] = None) -> tuple:
    name = _resolve(backend, q, k, cu_seqlens, max_seqlen, scale, causal, function,
                    eager=not (capturing or torch.compiler.is_compiling()), verified=verified)
    run = _verified_runner(_runner(name, q, cu_seqlens, function), verified)
    if run in (_run_triton_backend, _run_triton_verified) and grad is not None:
        # Inputs that need a graph: the op, whose autograd formula runs the Triton backward (triton_bwd).
        run = _run_triton_autograd_verified if run is _run_triton_verified else _run_triton_autograd
    elif run in (_run_triton_backend, _run_triton_verified) and eager:
        run = _planned_triton(q, k, cu_seqlens, max_seqlen, scale, causal, verified)
    return run, scale, name


# -- public entry points ----------------------------------------------------------------------------

@guard_varlen
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     sequence_lengths: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                     metadata: Any = None, softmax_scale: Optional[float] = None, causal: bool = False,
                     backend: str = "auto", max_seqlen_verified: bool = False) -> torch.Tensor:
    """Attention over packed variable-length sequences.

    Args:
        q: ``(total_tokens, num_heads, head_dim)``, float16 / bfloat16 / float32.
        k, v: ``(total_tokens, num_kv_heads, head_dim)``, q's dtype and device; ``num_kv_heads`` divides
            ``num_heads`` (query head h reads kv head ``h // (num_heads // num_kv_heads)``).
        cu_seqlens: int32/int64 ``(B+1,)`` token offsets on q's device (0, ..., total_tokens); zero-length
            sequences are allowed.
        sequence_lengths, max_seqlen, metadata: derived by the guard when missing; pass
            ``metadata=prepare_varlen_metadata(cu_seqlens, q)`` once per forward to skip all host work.
            The metadata is used only with the cu_seqlens it was prepared from (the same tensor, unchanged,
            or equal host offsets); metadata from other offsets is GL103 on every backend.
            Checks and the backend choice are made once per call signature (shapes, dtypes, devices,
            max_seqlen, scale, causal, backend) and remembered, so later layers go straight to the launch.
        softmax_scale: default ``head_dim ** -0.5``.
        causal: mask keys after the query within each sequence.
        backend: ``"auto"`` (fastest measured; when q, k or v requires grad and grad mode is on, torch's
            varlen flash where it takes the call and the hint is verified, else ``"sdpa"``: only ``"sdpa"``,
            ``"torch-varlen"`` and ``"triton"`` have a backward, the others refuse such inputs with GL106 rather
            than return an output outside the graph), ``"triton"`` (differentiable: a
            FlashAttention-2 style Triton backward, ``triton_bwd``), ``"gluon"`` (Hopper,
            D 64/80/96/128, 16-bit, and a verified max_seqlen; other layouts and calls run on Triton), ``"sdpa"``,
            ``"torch-varlen"``,
            ``"flashinfer"`` (best FlashInfer variant; head dims it cannot run go to ``triton``),
            ``"flashinfer-fa2"``, ``"flashinfer-fa3"``, ``"flashinfer-cudnn"``.
        max_seqlen_verified: set by the guard, not by callers: True where it derived ``max_seqlen`` from the
            offsets or checked the caller's value against them. ``max_seqlen`` only sizes launches: a value
            below the longest sequence makes the Triton kernel's programs loop over the tiles it leaves out
            (slower, never a row unwritten), and the Gluon kernel, which cannot, runs only when it is verified
            (this flag, or ``max_seqlen >= total_tokens``); ``select_backend`` says which kernel a call runs.

    Returns ``(total_tokens, num_heads, head_dim)`` in q's dtype. Raises ``GuardError`` GL106 for inputs
    no backend takes (or a backend that cannot run them), GL103 for inconsistent metadata.
    """
    function = "varlen_attention"
    Tensor = torch.Tensor
    signature = None
    grad = _needs_grad(q, k, v)
    if (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and type(cu_seqlens) is Tensor
            and type(max_seqlen) is int and type(causal) is bool and type(backend) is str
            and type(softmax_scale) in _SCALE_TYPES and type(max_seqlen_verified) is bool
            and not torch.compiler.is_compiling()):
        signature = (backend, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, cu_seqlens.dtype, q.device,
                     k.device, v.device, cu_seqlens.device, cu_seqlens.shape, cu_seqlens.layout, max_seqlen,
                     softmax_scale, causal, grad, max_seqlen_verified)
        plans = _calls.get(signature)
        if plans is not None:
            eager_plan, capture_plan = plans
            # auto picks apart eager calls and calls captured into a CUDA graph (no host time per replay); the
            # capture query (a driver call) is made only where the two picks differ.
            planned = capture_plan if capture_plan is not None and _capturing(q) else eager_plan
        elif backend in _CHOOSING and _capturing(q):
            # First seen under capture: only the captured call is planned (nothing kept; an eager call plans both).
            planned = _plan_call(function, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, backend, True,
                                 grad, True, max_seqlen_verified)[:2]
        else:
            plans = _plan_calls(function, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, backend, grad,
                                max_seqlen_verified)
            if len(_calls) >= _MAX_CALLS:
                _calls.clear()
            _calls[signature] = plans
            planned = plans[0]
    else:
        planned = _plan_call(function, q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, backend, False,
                             grad, backend in _CHOOSING and _capturing(q), max_seqlen_verified)[:2]
    if metadata is not None:
        total = q.shape[0]
        if getattr(metadata, "total_tokens", total) != total:
            raise GuardError("GL103", argument="metadata", function=function,
                             expected=f"metadata prepared for q's token count {total}",
                             got=f"metadata for {metadata.total_tokens} tokens (a stale plan?)")
    run, scale = planned
    return run(q, k, v, cu_seqlens, sequence_lengths, max_seqlen, scale, causal, metadata, function)


def _token_view(q, fm, cu_seqlens, sequence_lengths, max_seqlen, function):
    """Token offsets, lengths, max and host offsets (or None) for the non-cuDNN backends."""
    if fm is not None and hasattr(fm, "host_cu_seqlens") and getattr(fm, "cu_seqlens", None) is not None:
        return fm.cu_seqlens, fm.seq_lens, fm.max_seqlen, fm
    heads_dim = q.shape[1] * q.shape[2]
    if fm is not None:
        packed = fm.packed_indptrs
        section = packed.numel() // 3
        cu = _cached(("packed", heads_dim), (packed,),
                     lambda: torch.div(packed.view(-1)[:section], heads_dim, rounding_mode="floor").to(torch.int32))
        return cu, None, max_seqlen, None
    if cu_seqlens.numel() == 3 * (sequence_lengths.numel() + 1):
        section = cu_seqlens.numel() // 3
        cu = _cached(("packed", heads_dim), (cu_seqlens,),
                     lambda: torch.div(cu_seqlens[:section], heads_dim, rounding_mode="floor").to(torch.int32))
        return cu, sequence_lengths, max_seqlen, None
    return cu_seqlens, sequence_lengths, max_seqlen, None


def _packed_view(q, k, fm, cu_seqlens, sequence_lengths, max_seqlen):
    """(q/o, k, v) element offsets ``(Bp+1, 1, 1, 1)``, lengths ``(Bp, 1, 1, 1)`` and max for cuDNN."""
    heads_dim = q.shape[1] * q.shape[2]
    if fm is not None:
        packed = fm.packed_indptrs.view(-1)
        lengths = fm.sequence_lengths
    elif cu_seqlens.numel() == 3 * (sequence_lengths.numel() + 1):
        packed, lengths = cu_seqlens.view(-1), sequence_lengths
    else:
        cu = cu_seqlens.view(-1)
        packed = _cached(("pack", heads_dim), (cu_seqlens,),
                         lambda: (cu.to(torch.int32) * heads_dim).repeat(3))
        lengths = sequence_lengths
    section = packed.numel() // 3
    lengths = lengths.reshape(-1, 1, 1, 1)
    if lengths.dtype != torch.int32:
        lengths = lengths.to(torch.int32)
    return (packed[:section].view(section, 1, 1, 1), packed[section:2 * section].view(section, 1, 1, 1),
            packed[2 * section:].view(section, 1, 1, 1), lengths, max_seqlen)


def _int_max(value: Any, argument: str, function: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
        return int(value.item())  # the engine accepts a tensor too (one read)
    if isinstance(value, bool) or not isinstance(value, int):
        raise GuardError("GL103", argument=argument, function=function,
                         expected="a Python int (the longest sequence, possibly bucketed)", got=describe(value))
    return value


@guard_cudnn_vision
def cudnn_vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Any, bsz: int, seq_len: int,
                           softmax_scale: Optional[float] = None, forward_metadata: Any = None, *,
                           max_seqlen_verified: bool = False, **kwargs: Any) -> torch.Tensor:
    """Drop-in for the engine's ``VisionFlashInferAttention.forward`` (flashinfer_cudnn backend).

    Args:
        q, k, v: ``(total_tokens, num_heads, head_dim)`` packed (or ``(bsz, seq_len, H, D)``, flattened and
            restored like the engine does).
        cu_seqlens: token offsets ``(B+1,)`` or the engine's packed element indptrs ``(3(Bp+1),)``.
        bsz, seq_len: the engine's arguments (batch and tokens per batch, or images and the longest image);
            when both are ints, ``bsz * seq_len`` must cover the token count (equal q's leading dims if 4-D).
        softmax_scale: default ``head_dim ** -0.5``.
        forward_metadata: ``prepare_varlen_metadata(cu_seqlens, q, layout="cudnn")`` or the engine's
            metadata object (``packed_indptrs``, ``sequence_lengths``, ``flashinfer_max_seqlen``).
        kwargs: ``sequence_lengths`` ``(Bp,)`` / ``(Bp, 1, 1, 1)`` and ``max_seqlen`` (int) when there is no
            forward_metadata (the guard derives forward_metadata when they are missing); ``backend`` to
            override the choice below.
        max_seqlen_verified: as for ``varlen_attention`` (set by the guard).

    Runs FlashInfer's cuDNN prefill when it is installed and takes the inputs (bfloat16, head dim 128 or
    192, CUDA, H == H_kv), otherwise ``varlen_attention``'s ``auto`` choice. Returns q's shape and dtype.
    """
    function = "cudnn_vision_attention"
    backend = kwargs.pop("backend", None)
    reshaped = isinstance(q, torch.Tensor) and q.dim() == 4
    if reshaped:
        batch_shape = q.shape[:2]
        q, k, v = (t.reshape(-1, *t.shape[2:]) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    fm = forward_metadata
    sequence_lengths = kwargs.get("sequence_lengths")
    if fm is not None:
        if getattr(fm, "packed_indptrs", None) is None:
            raise GuardError("GL107", argument="forward_metadata", function=function,
                             expected="metadata with packed_indptrs (prepare_varlen_metadata(..., layout=\"cudnn\"))",
                             got=describe(fm))
        max_value = getattr(fm, "flashinfer_max_seqlen", None)
        if max_value is None:
            max_value = getattr(fm, "max_seqlen", None)
        max_seqlen = _int_max(max_value, "forward_metadata.max_seqlen", function)
        token_cu = getattr(fm, "cu_seqlens", None)
        per_token = getattr(fm, "elements_per_token", None)
        if per_token is not None and isinstance(q, torch.Tensor) and q.dim() == 3 and (
                per_token != q.shape[1] * q.shape[2] or getattr(fm, "total_tokens", q.shape[0]) != q.shape[0]):
            # A plan for other shapes would address q/k/v out of bounds on the cuDNN path.
            raise GuardError("GL107", argument="forward_metadata", function=function,
                             expected=f"metadata prepared for q: {q.shape[0]} tokens of H*D={q.shape[1] * q.shape[2]}",
                             got=f"{getattr(fm, 'total_tokens', '?')} tokens of H*D={per_token} (a stale plan?)")
    else:
        if kwargs.get("max_seqlen") is None:
            raise GuardError("GL102", argument="max_seqlen", function=function,
                             expected="a Python int, or forward_metadata", got="None")
        max_seqlen = _int_max(kwargs.get("max_seqlen"), "max_seqlen", function)
        if not isinstance(sequence_lengths, torch.Tensor):
            raise GuardError("GL101", argument="sequence_lengths", function=function,
                             expected="an int32 tensor (Bp,) or (Bp, 1, 1, 1)", got=describe(sequence_lengths))
        token_cu = cu_seqlens
    if not isinstance(token_cu, torch.Tensor):
        token_cu = getattr(fm, "packed_indptrs", None)
    if fm is not None and isinstance(token_cu, torch.Tensor) and token_cu.layout is torch.strided:
        # A plan's offsets are checked flat; the caller's own cu_seqlens is checked as given, since a (1, B+1)
        # tensor read as flat offsets by one path and by rows by another would give zeros, not an error.
        token_cu = token_cu.view(-1)
    _check_inputs(function, q, k, v, token_cu)
    if fm is None:
        n = sequence_lengths.numel()
        if cu_seqlens.numel() not in (n + 1, 3 * (n + 1)):
            raise GuardError("GL107", argument="cu_seqlens", function=function,
                             expected=f"token offsets ({n + 1},) or packed element indptrs ({3 * (n + 1)},) for "
                                      f"{n} sequence_lengths", got=describe(cu_seqlens),
                             detail="packed indptr numel mismatch")
    elif fm.packed_indptrs.numel() % 3:
        raise GuardError("GL107", argument="forward_metadata.packed_indptrs", function=function,
                         expected="packed element indptrs [qk | v | o] of shape (3(Bp+1),)",
                         got=describe(fm.packed_indptrs), detail="packed indptr numel mismatch")
    if type(bsz) is int and type(seq_len) is int:
        # Callers pass either (batch, tokens per batch) or (images, longest image): either way bsz * seq_len
        # covers every token; a 4-D q fixes both exactly.
        if reshaped and (bsz, seq_len) != tuple(batch_shape):
            raise _bad("bsz", f"q's leading dims (bsz, seq_len) = {tuple(batch_shape)}", f"({bsz}, {seq_len})",
                       function, fix="Pass bsz and seq_len as q's leading dims (bsz, seq_len) for a 4-D q.")
        if bsz * seq_len < q.shape[0]:
            raise _bad("seq_len", f"bsz * seq_len >= q's token count {q.shape[0]}", f"bsz={bsz}, seq_len={seq_len}",
                       function, fix="Pass bsz and seq_len with bsz * seq_len covering q's tokens.")
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[2] ** -0.5
    if backend is not None and backend not in BACKENDS:
        raise _bad("backend", " / ".join(repr(b) for b in BACKENDS), describe(backend), function, fix=_BACKEND_FIX)
    verified = hint_verified(q, max_seqlen, max_seqlen_verified is True)
    grad = _needs_grad(q, k, v)
    if grad is not None:
        backend = _for_grad(backend or "auto", grad, function)
        if isinstance(backend, GuardError):
            raise backend
        if backend == "torch-varlen" and not verified:
            backend = "sdpa"  # as in varlen_attention: the hint is not trusted, and only sdpa keeps the graph
    use_cudnn = (backend in (None, "flashinfer-cudnn") and k.shape[1] == q.shape[1]
                 and _runnable("flashinfer-cudnn", q, k, scale, False))
    if backend == "flashinfer-cudnn" and not use_cudnn:
        raise _cannot_run(backend, q, function)
    if use_cudnn and not verified:
        # cuDNN takes max_seqlen as max_token_per_sequence (see HINT_TRUSTING): an unverified hint goes to the
        # choice below, which leaves cuDNN out (an explicit "flashinfer-cudnn" runs the Triton kernel there).
        use_cudnn = False
    if use_cudnn:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        qk_off, v_off, o_off, lengths, max_seqlen = _packed_view(q, k, fm, cu_seqlens, sequence_lengths, max_seqlen)
        out = fi.cudnn_prefill(q, k, v, o_off, qk_off, lengths, max_seqlen, scale, False, v_offsets=v_off)
    else:
        cu, lengths, max_tokens, plan = _token_view(q, fm, cu_seqlens, sequence_lengths, max_seqlen, function)
        verified = hint_verified(q, max_tokens, max_seqlen_verified is True)
        name = _resolve(backend or "auto", q, k, cu, max_tokens, scale, False, function,
                        eager=not _capturing(q), verified=verified)
        out = _run(name, q, k, v, cu, lengths, max_tokens, scale, False, plan, function, verified)
    return out.view(*batch_shape, *out.shape[1:]) if reshaped else out
