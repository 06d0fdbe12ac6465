"""GL101-GL109: varlen (packed) attention and the vision layers that call it, each rule with its examples."""
from __future__ import annotations

from typing import Any, NamedTuple

from ..model import Contract, Derivation, Diagnosis, Example, Target
from .engine import (
    ENGINE_PREPARE_CUDNN, MAX_SEQLEN, OUR_CUDNN, PREPARE_CUDNN, QKV_BACKENDS, SEQUENCE_LENGTHS, VISION_ATTENTION,
    VISION_ATTENTION_PARAMS, VISION_FI, VISION_MODULE, VISION_PARAMS, VLLM_MM, VLLM_MM_PARAMS, _BUILT_WITHOUT_PACKED,
    _BUILT_WITH_PACKED, _HOST, _STEMS,
)

# A model-level forward (runs once per forward): the fix writes the engine's own helper there. In a
# block's forward (once per layer) the finding says why there is no fix instead.
_VISION_ENGINE_BAD = '''\
import torch.nn as nn
from sglang.srt.layers.attention.vision import VisionFlashInferAttention


class VisionTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = VisionFlashInferAttention()

    def forward(self, q, k, v, cu_seqlens, bsz, seq_len):
        return self.attn(q, k, v, cu_seqlens, bsz, seq_len)  # expect: GL101, GL102
'''

_VISION_ENGINE_FIXED = '''\
import torch.nn as nn
from sglang.srt.layers.attention.vision import VisionFlashInferAttention
from sglang.srt.layers.attention.vision import prepare_flashinfer_cudnn_vision_attention_metadata


class VisionTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = VisionFlashInferAttention()

    def forward(self, q, k, v, cu_seqlens, bsz, seq_len):
        return self.attn(q, k, v, cu_seqlens, bsz, seq_len, forward_metadata=prepare_flashinfer_cudnn_vision_attention_metadata(cu_seqlens, q.device, elem_per_token=q.shape[-2] * q.shape[-1]))
'''

_VISION_OURS_BAD = '''\
import torch
from guardlint.kernels import cudnn_vision_attention

q = torch.randn(12, 2, 64)
k, v = torch.randn_like(q), torch.randn_like(q)
cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
out = cudnn_vision_attention(q, k, v, cu_seqlens, 2, 12)  # expect: GL101, GL102
'''

_VISION_OURS_FIXED = '''\
import torch
from guardlint.guard import prepare_varlen_metadata
from guardlint.kernels import cudnn_vision_attention

q = torch.randn(12, 2, 64)
k, v = torch.randn_like(q), torch.randn_like(q)
cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
out = cudnn_vision_attention(q, k, v, cu_seqlens, 2, 12, forward_metadata=prepare_varlen_metadata(cu_seqlens, q, layout="cudnn"))
'''

_VISION_GOOD_KWARGS = '''\
import torch
from guardlint.kernels import cudnn_vision_attention

q = torch.randn(12, 2, 64)
k, v = torch.randn_like(q), torch.randn_like(q)
cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32)
lens = cu_seqlens[1:] - cu_seqlens[:-1]
out = cudnn_vision_attention(q, k, v, cu_seqlens, 2, 12, sequence_lengths=lens, max_seqlen=7)
'''

_VISION_GOOD_PREPARED = '''\
from guardlint.guard import prepare_varlen_metadata
from sglang.srt.layers.attention.vision import VisionFlashInferAttention as Attn


def run(q, k, v, cu_seqlens, bsz, seq_len):
    attn = Attn()
    meta = prepare_varlen_metadata(cu_seqlens, q, layout="cudnn")
    return attn.forward(q, k, v, cu_seqlens, bsz, seq_len, None, meta)
'''

_VISION_GOOD_LOCAL = '''\
class VisionFlashInferAttention:
    """A local class of the same short name is not the engine's."""

    def __call__(self, *args):
        return args


attn = VisionFlashInferAttention()
attn(1, 2, 3, 4, 5, 6)
'''

# The fixes that run in each engine, as of the pinned releases (sglang 0.5.23, vLLM 0.33.0). ``guardlint
# diagnose`` shows the one of the engine that a traceback runs through ("In <engine>: ...").
SGLANG_CUDNN_FIX = (
    "In sglang: build the metadata once per forward, before the block loop, with the engine's own "
    "meta = prepare_flashinfer_cudnn_vision_attention_metadata(cu_seqlens, device, elem_per_token=H*D) "
    "(sglang.srt.layers.attention.vision; H = attention heads on this rank, D = head_dim) and pass "
    "forward_metadata=meta to every VisionAttention call. prepare_vision_attention_metadata(...) is not "
    "enough for flashinfer_cudnn: it has no packed_indptrs, so the backend reads sequence_lengths and "
    "max_seqlen from kwargs, which VisionAttention fills with None."
)
VLLM_CUDNN_FIX = (
    "In vLLM: once per forward, before the block loop, from cu_seqlens as a host numpy array: "
    "sequence_lengths = MMEncoderAttention.maybe_compute_seq_lens(attn_backend, cu_seqlens, device) and "
    "max_seqlen = torch.tensor(MMEncoderAttention.compute_max_seqlen(attn_backend, cu_seqlens), "
    "dtype=torch.int32) (a CPU scalar: the wrapper calls .item()); pass sequence_lengths= and max_seqlen= "
    "to every MMEncoderAttention call, and for FLASHINFER also the element offsets "
    "MMEncoderAttention.maybe_recompute_cu_seqlens(attn_backend, cu_seqlens, hidden_size, tp_size, device) "
    "as cu_seqlens, as Qwen2.5-VL's prepare_encoder_metadata does. Those offsets address v at three times q's "
    "stride (a view into the fused qkv projection); for a v made contiguous pass fp8_padded_hidden_size=H*D "
    "too (one stride for every section), or the kernel reads v at wrong offsets. Under FP8 attention "
    "(mm_encoder_attn_dtype=\"fp8\") that width is get_fp8_padded_hidden_size(H, D) "
    "(vllm.model_executor.models.vision; the head padded to a multiple of 16), asked in __init__: it reads the "
    "config, which is set while the model is built, not in a forward. Where vLLM captures the encoder in a CUDA "
    "graph (cudagraph_mm_encoder), build all of it in prepare_encoder_metadata, outside the capture."
)



class EncoderMetadataHoist(NamedTuple):
    """A per-layer call whose missing values only the engine's own helpers can build, from the attention layer's
    backend and a host copy of the offsets, which the call does not have: they are built once in the function
    that runs the layer loop and passed down (``lint/hoist.py``, ``Hoister.plan_encoder_metadata``).

    The templates are what the fix writes before the loop: ``{layer}`` is the attention layer of the first block
    (``self.blocks[0].attn.attn``), ``{cu}`` the offsets the loop passes down, ``{host}`` their host copy (the one
    host read), ``{width}`` the owner's attribute ``width`` holds. ``param`` is built for every backend (the helper
    answers None where the backend does not read it); the values in ``rebuilt`` replace what the loop passes down
    only when it is not None, so other backends get what they got before. ``value`` is the value tensor as those
    offsets address it, written at the call when it is not already contiguous there."""

    helper_class: str
    helpers: dict[str, tuple[str, ...]]  # classmethod -> positional parameters (the pinned release's)
    attributes: tuple[str, ...]  # the layer's own attributes the templates read (set in its __init__)
    layer: str  # the local name the layer is bound to
    host: str
    param: tuple[str, str]  # (name, template)
    rebuilt: tuple[tuple[str, str], ...]  # (name of a value the call passes, template), in order
    value: str
    # (module, function, positional parameters, template): a helper that reads the engine's config, which is set
    # only while the model is built, so the fix calls it in the loop owner's __init__ (after the layers are built)
    # and keeps what it answers in ``self.<width>``; a file that cannot import it gets no fix.
    width_helper: tuple[str, str, tuple[str, ...], str]
    width: str
    # (module, context manager): the engine's mark on a host read made on purpose, written around the host copy
    # where the engine the file imports defines it (and the read left bare where it does not).
    sync_allowed: tuple[str, str]
    # The method through which the engine runs a model's encoder inside a CUDA graph capture (a host read there is
    # an error), and the methods where it prepares that graph's inputs outside the capture, as the reason names them.
    capture_hook: str
    capture_seams: tuple[str, ...]
    # The class decorator that compiles a layer's forward and its keyword naming the inputs of dynamic size (a new
    # tensor parameter of such a forward is added there, at dimension 0).
    compiled: tuple[str, str]


# vLLM 0.33.0: what MMEncoderAttention._forward_flashinfer hands flashinfer_wrapper, and how that reads it. It asserts
# cu_seqlens, max_seqlen and sequence_lengths, reads max_seqlen with .item() (so a CPU tensor, bucketed by
# compute_max_seqlen), splits cu_seqlens into two halves of element offsets [q, k and o | v] and makes q and k
# contiguous itself; v is addressed by its own token stride. maybe_recompute_cu_seqlens' default layout gives v three
# times q's stride (a view into a fused qkv projection, as Qwen2.5-VL passes it); its fp8_padded_hidden_size branch
# gives all sections one stride, which is right for a contiguous v: the fix makes v contiguous under FlashInfer and
# writes that branch with the layer's own width (its heads times its head size, per rank). Under FP8 attention
# (mm_encoder_attn_dtype="fp8") q, k and v are quantized into new contiguous tensors whose heads are padded to a
# multiple of 16, and the width is vision.get_fp8_padded_hidden_size(num_heads, head_dim), as Qwen2.5-VL and Qwen3-VL
# pass it; that helper reads get_current_vllm_config_or_none(), which is set while the model is built and not in a
# forward, so it is called in __init__ (as those towers do) and answers None without FP8. Under the other backends
# maybe_compute_seq_lens answers None and nothing else changes. With compilation_config.cudagraph_mm_encoder the
# EncoderCudaGraphManager runs encoder_cudagraph_forward inside torch.cuda.graph: a tower reached from there gets no
# fix (its metadata belongs in prepare_encoder_metadata or the capture inputs, outside the graph). execute_model runs
# under with_gpu_sync_check: with VLLM_GPU_SYNC_CHECK=error a host read outside gpu_sync_allowed() is an error.
VLLM_ENCODER_HOIST = EncoderMetadataHoist(
    helper_class="MMEncoderAttention",
    helpers={
        "maybe_compute_seq_lens": ("attn_backend", "cu_seqlens", "device"),
        "compute_max_seqlen": ("attn_backend", "cu_seqlens"),
        "maybe_recompute_cu_seqlens": ("attn_backend", "cu_seqlens", "hidden_size", "tp_size", "device",
                                       "fp8_padded_hidden_size"),
    },
    attributes=("attn_backend", "num_heads", "head_size"),
    layer="encoder_attn",
    host="{cu}.cpu().numpy()",
    param=("sequence_lengths", "MMEncoderAttention.maybe_compute_seq_lens({layer}.attn_backend, {host}, {cu}.device)"),
    rebuilt=(
        ("cu_seqlens", "MMEncoderAttention.maybe_recompute_cu_seqlens({layer}.attn_backend, {host}, "
                       "{layer}.num_heads * {layer}.head_size, 1, {cu}.device, "
                       "fp8_padded_hidden_size={width} or {layer}.num_heads * {layer}.head_size)"),
        ("max_seqlen", "torch.tensor(MMEncoderAttention.compute_max_seqlen({layer}.attn_backend, {host}), "
                       "dtype=torch.int32)"),
    ),
    value="{value}.contiguous() if sequence_lengths is not None else {value}",
    width_helper=("vllm.model_executor.models.vision", "get_fp8_padded_hidden_size", ("num_heads", "head_dim"),
                  "get_fp8_padded_hidden_size({layer}.num_heads, {layer}.head_size)"),
    width="fp8_padded_hidden_size",
    sync_allowed=("vllm.utils.gpu_sync_debug", "gpu_sync_allowed"),
    capture_hook="encoder_cudagraph_forward",
    capture_seams=("prepare_encoder_metadata", "prepare_encoder_cudagraph_capture_inputs"),
    compiled=("support_torch_compile", "dynamic_arg_dims"),
)
# Targets whose missing values are built that way, by qualified name.
HOISTED_METADATA = {VLLM_MM: VLLM_ENCODER_HOIST}

_VISION_DIAG_COMMON: dict[str, Any] = dict(
    when_it_happens=(
        "A ViT block calls the vision attention with cu_seqlens only: the model was written for the "
        "FA3/SDPA backends and then switched to flashinfer_cudnn, or a wrapper forwards every keyword and "
        "passes sequence_lengths=None / max_seqlen=None (None counts as missing)."
    ),
    solutions=(
        "Prepare the metadata once per model forward, before the block loop: "
        "meta = prepare_varlen_metadata(cu_seqlens, q, layout=\"cudnn\"), and pass forward_metadata=meta "
        "to every block (one host read per forward instead of one per layer).",
        "Or pass sequence_lengths=cu_seqlens[1:] - cu_seqlens[:-1] and max_seqlen=<python int> yourself "
        "(token offsets only; the engine's packed element indptrs need prepare_varlen_metadata).",
        "Or decorate the caller with @guard(\"GL101\") / use guardlint.kernels.cudnn_vision_attention, "
        "which derive the values at runtime and cache them per cu_seqlens version.",
        SGLANG_CUDNN_FIX,
        VLLM_CUDNN_FIX,
    ),
    fix_safety=(
        "Unsafe: for guardlint's cudnn_vision_attention the fix adds forward_metadata=prepare_varlen_metadata("
        "cu_seqlens, q, layout=\"cudnn\") and its import (correct for token offsets and for packed element "
        "indptrs alike; one host read per distinct cu_seqlens, cached per tensor version). For the engine's "
        "VisionFlashInferAttention it adds forward_metadata=prepare_flashinfer_cudnn_vision_attention_metadata("
        "cu_seqlens, q.device, elem_per_token=H*D), the engine's own helper, and no guardlint import; that "
        "helper is not cached, so no fix is written into code that runs once per layer (a block's forward): "
        "the finding says so, and the metadata belongs before the block loop. For vLLM's encoder attention layer "
        "called per layer, the file's single loop owner builds sequence_lengths once before the loop with the "
        "layer class's own helper (one host copy of the offsets per forward, inside gpu_sync_allowed() where the "
        "engine defines it) and, where that is not None (FlashInfer), also the element offsets and the CPU "
        "max_seqlen the loop passes down, with its helpers, at the width get_fp8_padded_hidden_size gives under "
        "FP8 attention (asked in the owner's __init__, where the engine's config is set; its heads times its head "
        "size otherwise); a sequence_lengths=None parameter is added down to the call (and to the dynamic "
        "dimensions of a compiled layer on the way), and a v that is not contiguous there is made so under "
        "FlashInfer. Other backends get what they got before. With no single loop owner, offsets that are read "
        "elsewhere on the way down, grouped k/v heads, a tower that builds the engine's metadata itself, a tower "
        "the engine captures in a CUDA graph (a class's encoder_cudagraph_forward, in the file or one beside it, "
        "reaches it: a host read is an error there), or an engine that lacks a helper, no fix, and the finding "
        "says why. Applied with --unsafe-fixes."
    ),
)

# How GL101 and GL102 read the engine a call reaches.
_VISION_JUDGED = (
    "Judged by the definition the call reaches: a copy of sglang's vision module in the scanned tree, else the "
    "installed sglang's (read by path, never imported), else this catalog's sglang 0.5.23; the finding's note "
    "names which. Only what VisionFlashInferAttention.forward there takes is asked for, a QKV_BACKEND_IMPL without "
    "flashinfer_cudnn cannot reach it, and a fix never imports a helper that module does not define.",
)

GL101 = Contract(
    code="GL101",
    name="missing-sequence-lengths",
    summary="Varlen ViT attention called without sequence_lengths or prepared forward_metadata",
    kind="call",
    targets=(
        Target(VISION_FI, "instance"),
        Target(QKV_BACKENDS, "instance"),
        Target(OUR_CUDNN, "function"),
        # vLLM's FlashInfer (cuDNN) path asserts sequence_lengths whenever cu_seqlens is given (its
        # issue 42787); calls without cu_seqlens take the fixed-length path.
        Target(VLLM_MM, "instance", params=VLLM_MM_PARAMS, when_passed=("cu_seqlens",),
               message="MMEncoderAttention on the FlashInfer cuDNN encoder backend asserts sequence_lengths "
                       "is not None"),
    ),
    params=VISION_PARAMS,
    require=(("forward_metadata",), ("sequence_lengths",)),
    subject=("sequence_lengths",),
    derivations=(ENGINE_PREPARE_CUDNN, PREPARE_CUDNN, SEQUENCE_LENGTHS),
    notes=_VISION_JUDGED,
    fix_safety="unsafe",
    diagnosis=Diagnosis(
        message="sequence_lengths should be prepared for vision flashinfer_cudnn attention backend",
        what_it_means=(
            "The cuDNN varlen attention needs per-sequence lengths (shape (B, 1, 1, 1), batch padded to a "
            "bucket with zero lengths) beside the element-offset packed indptrs. The call passed neither "
            "forward_metadata nor sequence_lengths, so the backend has nothing to size the sequences with."
        ),
        patterns=(
            r"sequence_lengths should be prepared for vision flashinfer_cudnn attention backend",
            r"sequence_lengths should be prepared",
        ),
        **_VISION_DIAG_COMMON,
    ),
    examples=(
        Example("bad", _VISION_OURS_BAD, runnable=True),
        Example("fixed", _VISION_OURS_FIXED, runnable=True),
        Example("bad", _VISION_ENGINE_BAD),
        Example("fixed", _VISION_ENGINE_FIXED),
        Example("good", _VISION_GOOD_KWARGS, runnable=True),
        Example("good", _VISION_GOOD_PREPARED),
        Example("good", _VISION_GOOD_LOCAL),
    ),
)

GL102 = Contract(
    code="GL102",
    name="missing-max-seqlen",
    summary="Varlen ViT attention called without max_seqlen or prepared forward_metadata",
    kind="call",
    targets=(Target(VISION_FI, "instance"), Target(QKV_BACKENDS, "instance"), Target(OUR_CUDNN, "function")),
    params=VISION_PARAMS,
    require=(("forward_metadata",), ("max_seqlen",)),
    subject=("max_seqlen",),
    derivations=(ENGINE_PREPARE_CUDNN, PREPARE_CUDNN, MAX_SEQLEN),
    notes=_VISION_JUDGED,
    fix_safety="unsafe",
    diagnosis=Diagnosis(
        message="max_seqlen should be prepared for vision flashinfer_cudnn attention backend",
        what_it_means=(
            "The cuDNN varlen attention sizes its launch (and its CUDA graph) with max_seqlen, a Python "
            "int rounded up to a bucket (4k, 8k, ... 128k). Computing it from a GPU tensor is a "
            "device-to-host sync (about 30 us on an H200; ~1 ms per forward when done in each of 32 ViT "
            "layers) and illegal during CUDA graph capture, so the backend refuses to guess."
        ),
        patterns=(
            r"max_seqlen should be prepared for vision flashinfer_cudnn attention backend",
            r"max_seqlen should be prepared",
        ),
        **_VISION_DIAG_COMMON,
    ),
    examples=GL101.examples,
)

GL103 = Contract(
    code="GL103",
    name="invalid-varlen-metadata",
    summary="cu_seqlens / sequence_lengths / max_seqlen are present but wrong",
    kind="runtime",
    diagnosis=Diagnosis(
        message="varlen metadata does not describe the packed tensors",
        what_it_means=(
            "cu_seqlens must be 1-D integer prefix sums on q's device: starting at 0, non-decreasing, "
            "ending at q's token count (or, for the cuDNN layout, the engine's packed element indptrs "
            "[qk | v | o] of shape (3(B+1),)). Given sequence_lengths must equal its differences and a "
            "given max_seqlen must be at least the true maximum. Anything else reads out of bounds on the "
            "GPU (an illegal memory access) or silently drops tokens."
        ),
        when_it_happens=(
            "cu_seqlens built from the wrong image grid, int64 where int32 is expected, a stale max_seqlen "
            "reused across batches, or token offsets mixed up with element offsets."
        ),
        solutions=(
            "Build cu_seqlens as torch.cat([zeros(1), lengths.cumsum(0)]).to(torch.int32) on q's device.",
            "Use prepare_varlen_metadata(cu_seqlens, q) and pass the result instead of separate values.",
            "Run with GUARDLINT_MODE=strict while debugging to validate every call.",
            "In sglang: let prepare_flashinfer_cudnn_vision_attention_metadata(cu_seqlens, device, "
            "elem_per_token=H*D) build the packed indptrs, H being the heads on this rank (not the model's "
            "total under tensor parallelism) and D head_dim, and pass forward_metadata=; indptrs scaled by "
            "another stride point past the end of q.",
        ),
    ),
)

GL104_GOOD = '''\
import torch.nn as nn


class VisionTransformer(nn.Module):
    def forward(self, x, cu_seqlens):
        # once per model forward: fine
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        for blk in self.blocks:
            x = blk(x, cu_seqlens, max_seqlen)
        return x
'''

GL104 = Contract(
    code="GL104",
    name="per-layer-host-sync",
    summary="A max sequence length is read back to the host in every layer",
    kind="pattern",
    severity="warning",
    diagnosis=Diagnosis(
        message="host sync in a per-layer forward: read the lengths once per model forward",
        headline="host sync per layer",
        what_it_means=(
            ".item(), .tolist(), int(t), bool(t), float(t), int(t.max()) or an if/while test of "
            "cu_seqlens-like tensors copies a value from the GPU and "
            "waits for every queued kernel: about 30 us per call on an H200, ~1 ms per forward across 32 "
            "ViT layers, and an error inside CUDA graph capture."
        ),
        when_it_happens=(
            "A block or attention module (class named *Block, *Layer, *Attention) derives max_seqlen from "
            "cu_seqlens/seq_lens/seg_lens in its own forward, or a loop over layers does it per iteration; or a "
            "function registered in transformers' ALL_ATTENTION_FUNCTIONS (run once per attention layer) does; "
            "or a layer hands flash-attn's flash_attn_varlen_func a 0-d device tensor as its int max_seqlen_q, "
            "which flash-attn converts on the host at every call."
        ),
        solutions=(
            "Compute it once in the model's forward (or prepare_varlen_metadata) and pass it down; a bounds "
            "check of the offsets belongs there too, once per batch.",
            "Keep the lengths on the host when they come from the host (image grids are host data).",
        ),
        fix_safety="No automatic fix: moving the computation out of the layer changes the call graph "
        "(new parameters on every block), which needs a person.",
        # Code, not an error text: a host read of device lengths in a frame a traceback quotes (names
        # ending in _cpu/_host/_list/_np already live on the host). Bounded, so a long log stays linear.
        patterns=(
            rf"(?:{_STEMS})(?!\w*_(?:{_HOST})\b)\w*\b"
            r"[^\n]{0,100}?\.(?:item|tolist)\(\)",
            rf"int\(\(?\w*(?:{_STEMS})(?!\w*_(?:{_HOST})\b)"
            r"[^\n]{0,100}?\.max\(\)",
        ),
    ),
    examples=(
        Example("bad", '''\
import torch.nn as nn


class VisionAttention(nn.Module):
    def forward(self, x, cu_seqlens):
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # expect: GL104
        return self.kernel(x, cu_seqlens, max_seqlen)
'''),
        Example("bad", '''\
def encode(blocks, x, cu_seqlens):
    for blk in blocks:
        max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()  # expect: GL104
        x = blk(x, cu_seqlens, max_seqlen)
    return x
'''),
        Example("bad", '''\
import torch.nn as nn


class DecoderLayer(nn.Module):
    def forward(self, x, cu_seqlens, seq_lens):
        total = int(cu_seqlens[-1])  # expect: GL104
        if seq_lens[0] > 0:  # expect: GL104
            x = x[:total]
        return x
'''),
        Example("good", GL104_GOOD),
        # Host values, whatever the names: host-named lengths, shapes and sizes, .is_npu, None tests.
        Example("good", '''\
import torch.nn as nn


class DecoderLayer(nn.Module):
    def forward(self, x, cu_seqlens, seq_lens, seq_lens_cpu):
        batch = int(cu_seqlens.shape[0]) - 1
        longest = int(max(seq_lens_cpu))
        if seq_lens is None or len(seq_lens) == 0:
            return x
        if seq_lens.is_npu:  # a device property, no read (a .to("cpu") here would be a copy per layer)
            x = x.contiguous()
        return x[:batch], longest
'''),
    ),
)

GL105 = Contract(
    code="GL105",
    name="host-sync-in-graph-capture",
    summary="Metadata would need a host read while a CUDA graph is being captured",
    kind="runtime",
    diagnosis=Diagnosis(
        message="a host read is needed to derive metadata, but the stream is capturing a CUDA graph",
        what_it_means=(
            "Deriving max_seqlen / max_len from a GPU tensor copies it to the host. During CUDA graph "
            "capture that is illegal: the driver fails with 'operation not permitted when stream is "
            "capturing' (error 900) and the capture is lost."
        ),
        when_it_happens=(
            "The first call inside torch.cuda.graph(...) / CUDA-graph warm-up of a serving engine gets "
            "cu_seqlens or seg_indptr without the prepared maxima, and nothing was cached for them."
        ),
        solutions=(
            "Prepare the metadata before capture (prepare_varlen_metadata(...), or LoRABatchInfo with "
            "max_len and seg_lens set) and pass it into the captured region.",
            "Keep max_seqlen a bucketed Python int (bucket=True) so the graph stays valid across batches.",
        ),
        patterns=(
            r"operation not permitted when stream is capturing",
            r"cudaErrorStreamCaptureUnsupported",
            r"CUDA error: operation not permitted when stream is capturing",
            r"Cannot copy between CPU and CUDA tensors during CUDA graph capture",
        ),
    ),
)

GL106 = Contract(
    code="GL106",
    name="bad-attention-input",
    summary="q/k/v shapes, dtypes, head dims or devices that the attention kernels cannot take",
    kind="runtime",
    diagnosis=Diagnosis(
        message="attention inputs do not fit the kernel",
        what_it_means=(
            "q is (total_tokens, num_heads, head_dim), k and v (total_tokens, num_kv_heads, head_dim) with "
            "num_kv_heads dividing num_heads, all of one dtype (float16, bfloat16 or float32) and device; "
            "head_dim is 64, 80, 96, 128 or a multiple of 16 up to 256."
        ),
        when_it_happens="q/k/v left as (B, S, H, D), transposed heads, mixed dtypes, or a head dim the "
        "chosen backend cannot run (FlashInfer FA2 fails at 80; FA3 takes 64/128/256; cuDNN 128/192).",
        solutions=(
            "Reshape to the packed (T, H, D) layout and cast to one dtype.",
            "Use backend=\"auto\" (or \"triton\"), which runs odd head dims natively.",
        ),
    ),
)

GL107 = Contract(
    code="GL107",
    name="cudnn-token-offsets",
    summary="Token offsets given where the cuDNN backend needs packed element indptrs",
    kind="runtime",
    diagnosis=Diagnosis(
        message="flashinfer_cudnn needs packed element indptrs [qk | v | o], not token offsets",
        what_it_means=(
            "The cuDNN backend addresses q/k/v/o by *element* offsets: packed_indptrs is "
            "cat([cu_seqlens * H * D] * 3), int32, on q's device, of shape (3(B+1),). Token offsets (B+1,) "
            "or a Python list are a different thing; the backend checks the size and type and refuses."
        ),
        when_it_happens="cu_seqlens from the FA3/SDPA path handed to the cuDNN path unchanged.",
        solutions=(
            "prepare_varlen_metadata(cu_seqlens, q, layout=\"cudnn\") builds the packed indptrs from "
            "either form and tells them apart by shape and by the last value.",
            SGLANG_CUDNN_FIX,
        ),
        patterns=(
            r"packed indptr numel mismatch",
            r"flashinfer_cudnn expects packed indptrs as a torch\.Tensor",
        ),
    ),
)

_GL108_BAD = '''\
from sglang.srt.layers.attention.vision import VisionFlashInferAttention, prepare_vision_attention_metadata


def encode(q, k, v, cu_seqlens):
    attn = VisionFlashInferAttention()
    meta = prepare_vision_attention_metadata(cu_seqlens, q.device)
    return attn(q, k, v, cu_seqlens, 1, q.shape[0], forward_metadata=meta)  # expect: GL108
'''

_GL108_GOOD = '''\
from sglang.srt.layers.attention.vision import (
    VisionFlashInferAttention,
    prepare_flashinfer_cudnn_vision_attention_metadata,
)


def encode(q, k, v, cu_seqlens):
    attn = VisionFlashInferAttention()
    meta = prepare_flashinfer_cudnn_vision_attention_metadata(cu_seqlens, q.device, elem_per_token=64)
    return attn(q, k, v, cu_seqlens, 1, q.shape[0], forward_metadata=meta)
'''

GL108 = Contract(
    code="GL108",
    name="metadata-without-cudnn-fields",
    summary="Prepared forward_metadata without the packed indptrs the cuDNN backend reads",
    kind="call",
    targets=(
        Target(VISION_FI, "instance", when_passed=("forward_metadata",)),
        Target(QKV_BACKENDS, "instance", when_passed=("forward_metadata",)),
    ),
    params=VISION_PARAMS,
    require=(("forward_metadata.packed_indptrs",), ("sequence_lengths",)),
    notes=(
        f"Reported only when the function that makes the call also builds the metadata (assigned to a name "
        f"once, or written inline in the call) with sglang's {_BUILT_WITHOUT_PACKED} and passes it no "
        f"packed_indptrs= keyword. {_BUILT_WITH_PACKED} always sets packed_indptrs; metadata that comes "
        f"from elsewhere (a parameter, an attribute, another function's result) is trusted.",
        "Not reported for VisionAttention, whose backend is the user's choice: models that build metadata "
        "without the cuDNN fields do not offer flashinfer_cudnn.",
    ),
    diagnosis=Diagnosis(
        message="forward_metadata lacks packed_indptrs: the flashinfer_cudnn backend cannot use it",
        what_it_means=(
            "The flashinfer_cudnn backend reads forward_metadata only when its packed_indptrs is set (with "
            "the padded sequence_lengths and flashinfer_max_seqlen). Metadata from "
            "prepare_vision_attention_metadata(...) has none of them, so the backend ignores it and reads "
            "sequence_lengths and max_seqlen from the call's own keywords instead; those are None, and it "
            "raises 'sequence_lengths should be prepared' (or, through VisionAttention, a TypeError from "
            "int(None))."
        ),
        when_it_happens="A block switched to flashinfer_cudnn keeps the metadata built for FA3/Triton.",
        solutions=(
            "Build the metadata with prepare_flashinfer_cudnn_vision_attention_metadata(cu_seqlens, device, "
            "elem_per_token=heads * head_dim) once per forward when the backend is flashinfer_cudnn.",
            "Or pass packed_indptrs=, sequence_lengths= and flashinfer_max_seqlen= to "
            "prepare_vision_attention_metadata.",
        ),
        fix_safety="No automatic fix: which builder to call depends on the backend the model runs with.",
    ),
    examples=(Example("bad", _GL108_BAD), Example("good", _GL108_GOOD)),
)

_GL109_BAD = '''\
import torch.nn as nn
from sglang.srt.layers.attention.vision import VisionAttention


class VisionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = VisionAttention(embed_dim=1024, num_heads=16, projection_size=1024, use_qkv_parallel=True)

    def forward(self, x, cu_seqlens, position_embeddings):
        return self.attn(x, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings)  # expect: GL109


class VisionEncoder(nn.Module):
    def __init__(self, depth=32):
        super().__init__()
        self.blocks = nn.ModuleList([VisionBlock() for _ in range(depth)])

    def forward(self, x, cu_seqlens, position_embeddings):
        for blk in self.blocks:
            x = blk(x, cu_seqlens, position_embeddings)
        return x
'''

_GL109_FIXED = '''\
import torch.nn as nn
from sglang.srt.layers.attention.vision import VisionAttention
from sglang.srt.layers.attention.vision import prepare_vision_attention_metadata


class VisionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = VisionAttention(embed_dim=1024, num_heads=16, projection_size=1024, use_qkv_parallel=True)

    def forward(self, x, cu_seqlens, position_embeddings, forward_metadata=None):
        return self.attn(x, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings, forward_metadata=forward_metadata)


class VisionEncoder(nn.Module):
    def __init__(self, depth=32):
        super().__init__()
        self.blocks = nn.ModuleList([VisionBlock() for _ in range(depth)])

    def forward(self, x, cu_seqlens, position_embeddings):
        forward_metadata = prepare_vision_attention_metadata(cu_seqlens, cu_seqlens.device)
        for blk in self.blocks:
            x = blk(x, cu_seqlens, position_embeddings, forward_metadata=forward_metadata)
        return x
'''

_GL109_GOOD = '''\
import torch.nn as nn
from sglang.srt.layers.attention.vision import VisionAttention


class VisionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = VisionAttention(embed_dim=1024, num_heads=16, projection_size=1024, use_qkv_parallel=True)

    def forward(self, x, cu_seqlens, forward_metadata):
        return self.attn(x, cu_seqlens=cu_seqlens, forward_metadata=forward_metadata)
'''

# The engine's own builder of the metadata VisionAttention reads (cu_seqlens, seq_lens, max_seqlen): one host
# read, once per model forward instead of once per block. Written where the block loop runs (lint/hoist.py).
ENGINE_PREPARE_VISION = Derivation(
    target="forward_metadata",
    sources=("cu_seqlens",),
    name="engine_prepare_vision",
    template="prepare_vision_attention_metadata({cu_seqlens}, {cu_seqlens}.device)",
    imports=((VISION_MODULE, "prepare_vision_attention_metadata"),),
    host_read=True,
    note="The engine's own helper (one host read: the maximum length), once per model forward before the "
    "block loop; the fix adds forward_metadata=None to the functions down to the call and passes it on.",
    for_targets=(VISION_ATTENTION,),
)

GL109 = Contract(
    code="GL109",
    name="vision-attention-without-metadata",
    summary="VisionAttention called per layer without forward_metadata: a host read in every block",
    kind="call",
    severity="warning",
    targets=(Target(VISION_ATTENTION, "instance"),),
    params=VISION_ATTENTION_PARAMS,
    require=(("forward_metadata",), ("max_seqlen",)),
    notes=(
        "Judged by the VisionAttention the file reaches: a copy of sglang's vision module in the scanned tree, else "
        "the installed sglang's (read by path, never imported), else this catalog's sglang 0.5.23; the finding's "
        "note names which. A keyword is asked for only where that layer passes it on to a backend that reads it "
        "instead of the host (in 0.5.23: forward_metadata and max_seqlen for triton_attn, fa3 and fa4, "
        "forward_metadata for aiter_attn); where the layer or its backends take neither (older releases and their "
        "forks), there is no finding.",
        "The backends a call can reach follow the layer's construction: a constant qkv_backend=\"sdpa\", or a name "
        "that the constructor refuses to run with unless it is one of some constants, limits them; without one "
        "(or with None, the platform's default) any backend of the table may run. sglang's server setting "
        "mm_attention_backend overrides the constructor's choice; a static check does not see it.",
    ),
    diagnosis=Diagnosis(
        message="VisionAttention without forward_metadata derives max_seqlen with a host read in every block",
        headline="a host read per block",
        what_it_means=(
            "Without forward_metadata (or a max_seqlen keyword) the FA3/FA4/Triton backends compute "
            "max_seqlen from cu_seqlens on the GPU in each block (sglang's resolve_precomputed_max_seqlen "
            "calls .item(): a device-to-host sync, ~30 us a layer on an H200, illegal under CUDA graph "
            "capture), and the flashinfer_cudnn backend dies with a TypeError from int(None)."
        ),
        when_it_happens="A ViT block written before the engine's prepared metadata existed, or a model "
        "that builds cu_seqlens per forward but never the metadata.",
        solutions=(
            "Build the metadata once per model forward, before the block loop: "
            "prepare_vision_attention_metadata(cu_seqlens, device) (or, for flashinfer_cudnn, "
            "prepare_flashinfer_cudnn_vision_attention_metadata(cu_seqlens, device, elem_per_token=...)), "
            "and pass forward_metadata= to every block.",
        ),
        fix_safety="Unsafe: the metadata is built once in the function that runs the block loop (found in the "
        "same file: one loop owner, called through the blocks' forward), and forward_metadata=None is added to "
        "each function on the way down and passed on. Callers outside the file keep working (the new "
        "parameters default to None, which VisionAttention takes as before). Where there is no single loop "
        "owner, or cu_seqlens is not passed down from it, there is no fix and the finding says why.",
    ),
    derivations=(ENGINE_PREPARE_VISION,),
    fix_safety="unsafe",
    examples=(Example("bad", _GL109_BAD), Example("fixed", _GL109_FIXED), Example("good", _GL109_GOOD)),
)
