"""What the pinned engines define (module paths, parameters, registries, backends) and the derivations
the rules write: shared by every rule family."""
from __future__ import annotations

from typing import Any

from ..model import Derivation

VISION_MODULE = "sglang.srt.layers.attention.vision"
VISION_FI = f"{VISION_MODULE}.VisionFlashInferAttention"
# The engine's backend table (``--mm-attention-backend`` picks an entry): ``QKV_BACKEND_IMPL[backend](...)``
# with a key that is not a constant may be the cuDNN backend.
QKV_BACKENDS = f"{VISION_MODULE}.QKV_BACKEND_IMPL[]"
# Constant keys of such tables, resolved: a key that names another backend is no candidate.
REGISTRIES = {f"{VISION_MODULE}.QKV_BACKEND_IMPL": {"flashinfer_cudnn": VISION_FI}}
VISION_ATTENTION = f"{VISION_MODULE}.VisionAttention"
# The releases the catalog's picture of each engine is taken from. The linter judges a call by the engine's
# own source where the scanned tree or the environment has it (lint/engine_defs.py), by this picture where not,
# and a finding says which.
PINNED = {"sglang": "0.5.23", "vllm": "0.33.0"}
# sglang 0.5.23's QKV_BACKEND_IMPL: for each backend, the keywords of VisionAttention.forward (which passes
# forward_metadata and max_seqlen on to it) whose value it reads in place of a host read of its own. Empty: no
# keyword spares it one (sdpa builds its mask from the offsets on the host unless given a mask, flashinfer_cudnn
# needs its prepared values rather than reading them, ascend copies the offsets to the host either way, amx and
# xpu always read). tests/engines/test_catalog_drift.py compares this with what the release's source says.
VISION_BACKENDS_SPARED_BY = {
    "triton_attn": ("forward_metadata", "max_seqlen"),
    "sdpa": (),
    "fa3": ("forward_metadata", "max_seqlen"),
    "fa4": ("forward_metadata", "max_seqlen"),
    "flashinfer_cudnn": (),
    "ascend_attn": (),
    "aiter_attn": ("forward_metadata",),
    "amx_attn": (),
    "xpu_attn": (),
}
# A layer that picks its backend from a table when built: the constructor's keyword that names the entry (the
# platform's default when absent or None), the table, and the catalog's keywords per backend (above).
LAYER_BACKENDS = {VISION_ATTENTION: ("qkv_backend", f"{VISION_MODULE}.QKV_BACKEND_IMPL", VISION_BACKENDS_SPARED_BY)}
VLLM_MM = "vllm.model_executor.layers.attention.mm_encoder_attention.MMEncoderAttention"
# Other names an engine exports a target under (its package's __init__ re-imports it): most of vLLM
# 0.33's models import MMEncoderAttention from vllm.model_executor.layers.attention.
REEXPORTS = {"vllm.model_executor.layers.attention.MMEncoderAttention": VLLM_MM}
# The methods an instance call runs where the class defines no forward of its own (vLLM's CustomOp dispatches
# forward to the one of the platform): what the call may pass is read from them.
CALLED_METHODS = {VLLM_MM: ("forward_native", "forward_cuda")}
OUR_CUDNN = "guardlint.kernels.cudnn_vision_attention"
ENGINE_LORA_INFO = "sglang.srt.lora.utils.LoRABatchInfo"
OUR_LORA_INFO = "guardlint.kernels.lora.LoRABatchInfo"

# Engine signature of VisionFlashInferAttention.forward in sglang 0.5.23 (and of our drop-in); the prepared
# values travel through **kwargs, so they are keyword-only. tests/engines/test_catalog_drift.py compares
# these tuples with the pinned releases.
VISION_PARAMS = ("q", "k", "v", "cu_seqlens", "bsz", "seq_len", "softmax_scale", "forward_metadata")
# VisionAttention.forward, the layer the engine's models call (0.5.23).
VISION_ATTENTION_PARAMS = (
    "x", "cu_seqlens", "position_embeddings", "rotary_pos_emb_cos", "rotary_pos_emb_sin", "attention_mask",
    "forward_metadata", "full_attn",
)
# vLLM 0.33 MMEncoderAttention.forward_native / forward_cuda.
VLLM_MM_PARAMS = ("query", "key", "value", "cu_seqlens", "max_seqlen", "sequence_lengths")
# What an instance call of a pinned engine layer does with its arguments on CUDA, for trees scanned where that
# engine is not installed (the callee summaries read the source when it is): the parameters it reads on the host
# (kind, the function, file and line of the read; vLLM 0.33 marks them ``with gpu_sync_allowed():``), and those it
# hands to a kernel (needed on the device: a host read of one elsewhere is its own). tests/engines/
# test_catalog_drift.py checks each read against the release's line.
PINNED_HOST_READS: dict[str, dict[str, Any]] = {
    VLLM_MM: {
        "method": "forward_cuda",
        "params": VLLM_MM_PARAMS,
        "reads": {"max_seqlen": (".item()", "flash_attn_maxseqlen_wrapper", "vllm/v1/attention/ops/vit_attn_wrappers.py",
                                 58)},
        "uses": ("query", "key", "value", "cu_seqlens", "sequence_lengths"),
    },
}
# Varlen attention kernels that engines and models call directly, by the qualified name a tree imports them under:
# the positions and names of their offsets parameters (read on the device: a value handed there is a device
# tensor, and so is each parameter of the caller it derives from through torch ops that keep a tensor where it
# is), and of their int parameters (a 0-d device tensor handed there is converted on the host, a sync per call).
# flash-attn 2.x (flash_attn/flash_attn_interface.py) takes the offsets before the ints; vLLM's fork
# (vllm/vllm_flash_attn/flash_attn_interface.py, 0.30 and 0.33) takes ``max_seqlen_q`` first.
_FLASH_ATTN_2 = {"offsets": ((3, "cu_seqlens_q"), (4, "cu_seqlens_k")),
                 "ints": ((5, "max_seqlen_q"), (6, "max_seqlen_k"))}
_VLLM_FLASH_ATTN = {"offsets": ((4, "cu_seqlens_q"), (6, "cu_seqlens_k")),
                    "ints": ((3, "max_seqlen_q"), (5, "max_seqlen_k"))}
VARLEN_KERNELS: dict[str, dict[str, Any]] = {
    "flash_attn.flash_attn_varlen_func": _FLASH_ATTN_2,
    "flash_attn.flash_attn_interface.flash_attn_varlen_func": _FLASH_ATTN_2,
    "vllm.vllm_flash_attn.flash_attn_varlen_func": _VLLM_FLASH_ATTN,
    "vllm.vllm_flash_attn.flash_attn_interface.flash_attn_varlen_func": _VLLM_FLASH_ATTN,
}
# Attention registries whose entries a model calls once per attention layer, by the package that defines them and
# the names a tree imports from it: transformers' attention modules look their implementation up in
# ``ALL_ATTENTION_FUNCTIONS`` (an ``AttentionInterface``) at every forward, so a function registered there
# (``ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = fn``, ``AttentionInterface.register("name", fn)``) is per-layer
# code.
ATTENTION_REGISTRIES = {"transformers": ("ALL_ATTENTION_FUNCTIONS", "AttentionInterface")}
# Engine field order of LoRABatchInfo in sglang 0.5.23 (it changed between releases: positional
# construction is a trap). Ours has the first ten.
LORA_FIELDS = (
    "use_cuda_graph", "bs", "num_segments", "seg_indptr", "weight_indices", "lora_ranks", "scalings",
    "max_len", "seg_lens", "permutation", "expected_tokens", "has_active_lora", "is_prefill",
    "req_seg_indptr", "req_weight_indices", "moe_lora_info",
)
# Functions that build VisionAttentionMetadata: the fields each sets whatever its arguments (the rest
# are set only when passed as a keyword, not None). Read by the linter to tell metadata that carries the
# cuDNN fields from metadata that does not.
METADATA_BUILDERS = {
    f"{VISION_MODULE}.prepare_vision_attention_metadata": ("cu_seqlens", "seq_lens", "max_seqlen"),
    f"{VISION_MODULE}.prepare_flashinfer_cudnn_vision_attention_metadata": (
        "cu_seqlens", "seq_lens", "max_seqlen", "packed_indptrs", "sequence_lengths", "flashinfer_max_seqlen"),
    f"{VISION_MODULE}.VisionAttentionMetadata": ("cu_seqlens", "seq_lens", "max_seqlen"),
}
ENGINE_PREPARE_IMPORT = ((VISION_MODULE, "prepare_flashinfer_cudnn_vision_attention_metadata"),)
# The same builders as a user reads them (GL108's note): those that set packed_indptrs only when passed it,
# and those that always set it.
_BUILT_WITHOUT_PACKED = " or ".join(
    f"{q.rsplit('.', 1)[1]}(...)" for q, f in METADATA_BUILDERS.items() if "packed_indptrs" not in f)
_BUILT_WITH_PACKED = " and ".join(
    f"{q.rsplit('.', 1)[1]}(...)" for q, f in METADATA_BUILDERS.items() if "packed_indptrs" in f)

PREPARE_IMPORT = (("guardlint.guard", "prepare_varlen_metadata"),)

# GL104's vocabulary, read by the linter's visitor and by the diagnose patterns below: names of metadata whose
# values a per-layer forward might read back, and suffixes of names that already live on the host
# (sglang's seq_lens_cpu), where a read is no sync.
SEQLEN_STEMS = ("cu_seqlens", "seqlens", "seq_lens", "seg_lens", "seg_indptr")
HOST_SUFFIXES = ("_cpu", "_host", "_list", "_np")
_STEMS = "|".join(SEQLEN_STEMS)
_HOST = "|".join(h.lstrip("_") for h in HOST_SUFFIXES)

# In the engine's own files the fix calls the engine's helper: it builds the padded sequence_lengths and
# bucketed flashinfer_max_seqlen the engine reads, and adds no import of guardlint to an engine file.
ENGINE_PREPARE_CUDNN = Derivation(
    target="forward_metadata",
    sources=("cu_seqlens", "q"),
    name="engine_prepare_cudnn",
    template="prepare_flashinfer_cudnn_vision_attention_metadata({cu_seqlens}, {q}.device, "
             "elem_per_token={q}.shape[-2] * {q}.shape[-1])",
    imports=ENGINE_PREPARE_IMPORT,
    host_read=True,
    note="The engine's own helper (one host read: the maximum length). Once per model forward, before "
    "the block loop; in a per-layer forward the fix says so.",
    for_targets=(VISION_FI, QKV_BACKENDS),
)

# One derivation serves GL101 and GL102: prepared metadata carries both values. prepare_varlen_metadata
# tells token offsets (B+1,) from the engine's packed element indptrs (3(B+1),), so the fix is right
# whichever form the call passes as cu_seqlens; a naive cu[1:] - cu[:-1] is not.
PREPARE_CUDNN = Derivation(
    target="forward_metadata",
    sources=("cu_seqlens", "q"),
    name="prepare_varlen_cudnn",
    template='prepare_varlen_metadata({cu_seqlens}, {q}, layout="cudnn")',
    imports=PREPARE_IMPORT,
    host_read=True,
    note="One host read when cu_seqlens is on the GPU, none when it is on the host; cached per tensor "
    "version, so 32 layers sharing one cu_seqlens cost one read. Better: call it once per forward.",
    for_targets=(OUR_CUDNN,),
    cached=True,
)
SEQUENCE_LENGTHS = Derivation(
    target="sequence_lengths",
    sources=("cu_seqlens",),
    name="diff",
    template="{cu_seqlens}[1:] - {cu_seqlens}[:-1]",
    host_read=False,
    note="Token offsets only: on packed element indptrs this is wrong, hence forward_metadata for fixes.",
    for_targets=(OUR_CUDNN, VISION_FI, QKV_BACKENDS),
)
MAX_SEQLEN = Derivation(
    target="max_seqlen",
    sources=("cu_seqlens",),
    name="max_of_diff",
    template="int(({cu_seqlens}[1:] - {cu_seqlens}[:-1]).max())",
    host_read=True,
    for_targets=(OUR_CUDNN, VISION_FI, QKV_BACKENDS),
)
SEG_LENS = Derivation(
    target="seg_lens",
    sources=("seg_indptr",),
    name="diff",
    template="{seg_indptr}[1:] - {seg_indptr}[:-1]",
    host_read=False,
    note="Under CUDA graphs the buffer is longer than the live batch: entries past num_segments are "
    "stale and must be ignored (the kernels do).",
)
MAX_LEN = Derivation(
    target="max_len",
    sources=("seg_lens",),
    name="max_of_seg_lens",
    template="int({seg_lens}.max())",
    host_read=True,
    note="One host read per batch (LoRABatchInfo is built once per batch, not per layer). Prefer a host "
    "value already at hand (the scheduler's lengths, e.g. max(extend_seq_lens_cpu)).",
)
# What the runtime guard runs (the linter writes MAX_LEN above): under CUDA graphs only the first
# num_segments entries of seg_indptr are live, so the maximum is taken over those.
MAX_LIVE_LEN = Derivation(
    target="max_len",
    sources=("seg_indptr", "num_segments"),
    name="max_of_live_diff",
    template="int(({seg_indptr}[1:num_segments + 1] - {seg_indptr}[:num_segments]).max())",
    host_read=True,
    note="Over the live num_segments only.",
)

