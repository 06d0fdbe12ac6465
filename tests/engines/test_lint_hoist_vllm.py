"""GL101's fix across functions for vLLM 0.33.0, run in the engine: the real model files, fixed by the linter, build
sequence_lengths (and, under FlashInfer, the host max_seqlen and element offsets the wrapper reads) once before the
block loop with MMEncoderAttention's own helpers, and pass it down through the blocks to the layer.

The fixed towers run from their own (fixed) source with 32 blocks: the tower's forward, the blocks' and the
attention layers' forwards as written, MMEncoderAttention's helpers, forward_cuda, _forward_flashinfer and
_forward_sdpa, and the wrappers flashinfer_wrapper and torch_sdpa_wrapper, all taken from the release with ``ast``.
Faked: FlashInfer's cuDNN kernel (``cudnn_batch_prefill_with_kv_cache``, addressing q/k/v/o through the element
offsets it is given, in each tensor's own token stride), the tensor-parallel linear layers (plain matmuls), the
rotary kernel (identity) and the norms and MLPs (a plain layer norm, zero). Host reads are counted on the tensors the
model keeps on the device (a tensor subclass marks them: the inputs, what async_tensor_h2d moves, what is built with an
explicit device, and everything computed from those), outside the faked kernel.
"""
from __future__ import annotations

import __future__
import ast
import contextlib
import difflib
import enum
import functools
import os
import types
from pathlib import Path

import einops
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fetch import release_dir
from guardlint.lint.runner import fixed_source, lint_source
from source import Recorder, load, module_path

RELEASE = "vllm-0.33.0"
MM = "vllm.model_executor.layers.attention.mm_encoder_attention"
WRAPPERS = "vllm.v1.attention.ops.vit_attn_wrappers"
MODELS = "vllm.model_executor.models"
DEPTH = 32
H, D = 2, 16

if not (release_dir(RELEASE) / "vllm").is_dir() and not os.environ.get("GUARDLINT_ENGINE_VLLM"):
    pytest.skip("vLLM 0.33.0 is not fetched (make engines-vllm; make test-engines runs these)",
                allow_module_level=True)


class Backend(enum.Enum):
    """The members of vLLM's AttentionBackendEnum its helpers and layers compare against."""
    FLASH_ATTN = "FLASH_ATTN"
    ROCM_AITER_FA = "ROCM_AITER_FA"
    TRITON_ATTN = "TRITON_ATTN"
    FLASHINFER = "FLASHINFER"
    TORCH_SDPA = "TORCH_SDPA"


# -- where the model's tensors live -------------------------------------------------------------------------------
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__array__,
          torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class OnDevice(torch.Tensor):
    """A tensor the model keeps on the GPU: copying its contents to the host is a device-to-host read (counted);
    what is computed from it stays on the device."""

    reads = 0
    counting = True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # repeat_interleave with tensor repeats reads them to size its output (vLLM's own, in dots_ocr's forward).
        sized = func is torch.repeat_interleave and "output_size" not in kwargs and \
            isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor)
        if sized and OnDevice.counting:
            OnDevice.reads += 1
        if func in _READS:
            if OnDevice.counting:
                OnDevice.reads += 1
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        return super().__torch_function__(func, types, args, kwargs)


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(OnDevice)


class TorchOnDevice(types.ModuleType):
    """``torch`` as the model files see it: a tensor built with an explicit device lives on the device."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(data, *args, device=None, **kwargs):
        t = torch.tensor(data, *args, **kwargs)
        return on_device(t) if device is not None else t


# -- vLLM's own pieces -----------------------------------------------------------------------------------------------
def _span(t, start, n):
    """n tokens of t from element offset ``start``, in t's own strides (what cuDNN's ragged offsets mean)."""
    return torch.as_strided(t, (n, t.shape[-2], t.shape[-1]), (t.stride(-3), t.stride(-2), t.stride(-1)),
                            t.storage_offset() + start)


def cudnn_fake(q, k, v, scale, workspace, *, max_token_per_sequence, max_sequence_kv, actual_seq_lens_q,
               actual_seq_lens_kv, causal, return_lse, batch_offsets_q, batch_offsets_k, batch_offsets_v,
               batch_offsets_o, out=None, **_):
    """FlashInfer's cudnn_batch_prefill_with_kv_cache, per sequence (its own reads are not the model's)."""
    OnDevice.counting = False
    try:
        lens = actual_seq_lens_q.view(-1).tolist()
        assert max(lens) <= max_token_per_sequence, "a sequence longer than the max the kernel was sized for"
        out = torch.full_like(q, float("nan")) if out is None else out.fill_(float("nan"))
        for b, n in enumerate(lens):
            if n:
                sq, sk, sv = (_span(t, int(o.view(-1)[b]), n).transpose(0, 1)
                              for t, o in ((q, batch_offsets_q), (k, batch_offsets_k), (v, batch_offsets_v)))
                o = F.scaled_dot_product_attention(sq, sk, sv, scale=scale)
                _span(out, int(batch_offsets_o.view(-1)[b]), n).copy_(o.transpose(0, 1))
        return out, None
    finally:
        OnDevice.counting = True


def _class_from(path: Path, name: str, keep: set, ns: dict, base: type) -> type:
    node = next(n for n in ast.parse(path.read_text(encoding="utf-8")).body
                if isinstance(n, ast.ClassDef) and n.name == name)
    body = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name in keep]
    ns["_Base"] = base
    cls = ast.ClassDef(name=name, bases=[ast.Name("_Base", ast.Load())], keywords=[], body=body, decorator_list=[],
                       type_params=[])
    exec(compile(ast.fix_missing_locations(ast.Module(body=[cls], type_ignores=[])), str(path), "exec"), ns)
    return ns[name]


@functools.lru_cache(maxsize=None)
def engine() -> tuple[type, Recorder, object]:
    """MMEncoderAttention (helpers, forward_cuda and the FlashInfer and SDPA paths it dispatches to; the class's
    registration and __init__, which need a vLLM config, left out), the faked cuDNN kernel, async_tensor_h2d."""
    kernel = Recorder(cudnn_fake)
    prefill = types.ModuleType("flashinfer.prefill")
    prefill.cudnn_batch_prefill_with_kv_cache = kernel
    flashinfer = types.ModuleType("flashinfer")
    flashinfer.prefill = prefill
    import sys
    sys.modules.setdefault("flashinfer", flashinfer)
    sys.modules["flashinfer.prefill"] = prefill
    platform = types.SimpleNamespace(is_rocm=lambda: False, is_zen_cpu=lambda: False)
    wrappers = load(RELEASE, WRAPPERS, ["flashinfer_wrapper", "apply_sdpa", "torch_sdpa_wrapper"],
                    {"torch": torch, "einops": einops, "F": F, "gpu_sync_allowed": contextlib.nullcontext,
                     "current_platform": platform})
    utils = load(RELEASE, "vllm.utils.torch_utils", ["async_tensor_h2d"], {"torch": torch, "np": np,
                                                                            "PIN_MEMORY": False})

    def h2d(*args, **kwargs):
        """vLLM's async_tensor_h2d: what it hands back lives on the device."""
        return on_device(utils["async_tensor_h2d"](*args, **kwargs))

    ns = load(RELEASE, MM, ["FLASHINFER_BATCH_BUCKETS", "FLASHINFER_MAX_SEQLEN_BUCKETS", "add_padding_to_seqlens",
                            "bucket_flashinfer_max_seqlen"],
              {"np": np, "torch": torch, "round_up": lambda x, y: ((x + y - 1) // y) * y})
    ns.update({"AttentionBackendEnum": Backend, "maybe_get_oot_by_class": lambda cls: cls, "async_tensor_h2d": h2d,
               "vit_flashinfer_wrapper": wrappers["flashinfer_wrapper"],
               "vit_torch_sdpa_wrapper": lambda q, k, v, scale, cu_seqlens, enable_gqa=False:
                   wrappers["torch_sdpa_wrapper"](q, k, v, scale, cu_seqlens, enable_gqa),
               "_get_flashinfer_workspace_buffer": lambda: torch.empty(0, dtype=torch.uint8)})
    keep = {"compute_max_seqlen", "maybe_compute_seq_lens", "maybe_recompute_cu_seqlens", "view_qkv_to_4d",
            "_forward_sdpa", "_forward_flashinfer", "forward_cuda"}
    cls = _class_from(module_path(RELEASE, MM), "MMEncoderAttention", keep, ns, nn.Module)
    cls.forward = cls.forward_cuda  # CustomOp's dispatch on a CUDA platform
    return cls, kernel, h2d


def encoder_layer(backend: Backend) -> nn.Module:
    cls, _, _ = engine()
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    layer.num_heads = layer.num_kv_heads = H
    layer.head_size, layer.scale, layer.dtype = D, D ** -0.5, torch.float32
    layer.attn_backend, layer.is_flash_attn_backend, layer.fp8_enabled = backend, False, False
    return layer


# -- the model files, as written and as fixed -------------------------------------------------------------------------
def model_text(module: str, fixed: bool) -> tuple[str, Path]:
    path = module_path(RELEASE, f"{MODELS}.{module}")
    text = path.read_text(encoding="utf-8")
    return (fixed_source(text, str(path), unsafe_fixes=True) if fixed else text), path


def model_classes(text: str, path: Path, names: list, ns: dict) -> dict:
    """The methods of the classes ``names`` of a model file's text, but __init__ (it builds vLLM's parallel layers;
    the test sets what the forwards read): no class decorators, no class attributes (weight-name mappers)."""
    classes = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name in names:
            node.body = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"]
            node.decorator_list = []
            classes.append(node)
    flags = __future__.annotations.compiler_flag
    code = compile(ast.Module(body=classes, type_ignores=[]), str(path), "exec", flags=flags, dont_inherit=True)
    exec(code, ns)
    return ns


def bare(cls: type, **attrs) -> nn.Module:
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


class Linear(nn.Module):
    """vLLM's parallel linear layers on one rank: (x @ W^T, bias)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return x @ self.weight.T, None


def norm() -> nn.Module:
    return nn.LayerNorm(H * D, elementwise_affine=False)


class Zero(nn.Module):
    def forward(self, x, *_):
        return torch.zeros_like(x)


class Rotary(nn.Module):
    """ApplyRotaryEmb, faked as the identity (the rotation is no part of the metadata)."""

    def forward(self, x, cos, sin):
        return x


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3 * H * D, H * D, generator=g) * 0.3, torch.randn(H * D, H * D, generator=g) * 0.05


def namespace() -> dict:
    cls, _, h2d = engine()
    return {"torch": TorchOnDevice(), "nn": nn, "F": F, "np": np, "einops": einops,
            "rearrange": einops.rearrange, "functools": functools, "partial": functools.partial,
            "MMEncoderAttention": cls, "AttentionBackendEnum": Backend, "async_tensor_h2d": h2d}


def dots_tower(fixed: bool, backend: Backend) -> nn.Module:
    """dots_ocr's DotsVisionTransformer: it builds cu_seqlens from the image grid on the device."""
    ns = namespace()
    qwen2 = module_path(RELEASE, f"{MODELS}.qwen2_vl")
    model_classes(qwen2.read_text(encoding="utf-8"), qwen2, ["Qwen2VisionAttention"], ns)
    text, path = model_text("dots_ocr", fixed)
    model_classes(text, path, ["DotsVisionAttention", "DotsVisionBlock", "DotsVisionTransformer"], ns)
    wqkv, wproj = weights()
    blocks = nn.ModuleList(
        bare(ns["DotsVisionBlock"], norm1=norm(), norm2=nn.Identity(), mlp=Zero(),
             attn=bare(ns["DotsVisionAttention"], tp_size=1, tp_rank=0, num_attention_heads_per_partition=H,
                       hidden_size_per_attention_head=D, qkv=Linear(wqkv), proj=Linear(wproj),
                       apply_rotary_emb=Rotary(), attn=encoder_layer(backend)))
        for _ in range(DEPTH))
    patchifier = bare(nn.Module, proj=nn.Linear(1, 1))

    class PatchEmbed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patchifier = patchifier

        def forward(self, x, grid):
            return x

    return bare(ns["DotsVisionTransformer"], spatial_merge_size=2, patch_embed=PatchEmbed(), blocks=blocks,
                rotary_pos_emb=lambda n: torch.zeros(n, D // 4), attn_backend=backend, post_trunk_norm=None,
                merger=nn.Identity())


def qwen2_tower(fixed: bool, backend: Backend) -> nn.Module:
    """qwen2_vl's Qwen2VisionTransformer: its prepare_encoder_metadata moves the offsets to the device; its layer
    passes v as a view into the fused qkv projection."""
    ns = namespace()
    text, path = model_text("qwen2_vl", fixed)
    model_classes(text, path, ["Qwen2VisionAttention", "Qwen2VisionBlock", "Qwen2VisionTransformer"], ns)
    wqkv, wproj = weights(1)
    blocks = nn.ModuleList(
        bare(ns["Qwen2VisionBlock"], norm1=norm(), norm2=nn.Identity(), mlp=Zero(),
             attn=bare(ns["Qwen2VisionAttention"], tp_size=1, tp_rank=0, num_attention_heads_per_partition=H,
                       hidden_size_per_attention_head=D, qkv=Linear(wqkv), proj=Linear(wproj),
                       apply_rotary_emb=Rotary(), attn=encoder_layer(backend)))
        for _ in range(DEPTH))

    class PatchEmbed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(1, 1)

        def forward(self, x):
            return x

    rope = types.SimpleNamespace(get_cos_sin=lambda n: (torch.ones(n, D // 4), torch.zeros(n, D // 4)))
    return bare(ns["Qwen2VisionTransformer"], spatial_merge_size=2, patch_embed=PatchEmbed(), blocks=blocks,
                input_norm=lambda x, dtype: x, rotary_pos_emb=rope, attn_backend=backend,
                merger=lambda x: x.squeeze(1))


TOWERS = {"dots_ocr": (dots_tower, [[1, 2, 4], [1, 4, 4], [1, 2, 2]]),
          "qwen2_vl": (qwen2_tower, [[1, 2, 2], [2, 2, 4], [1, 4, 4]])}


def lengths_of(grid) -> list:
    return [h * w for t, h, w in grid for _ in range(t)]


def run(module: str, fixed: bool, backend: Backend) -> tuple[torch.Tensor, list, int]:
    """The tower over the grid's images: (output, the cuDNN kernel's calls, host reads during the forward)."""
    build, grid = TOWERS[module]
    tower = build(fixed, backend)
    _, kernel, _ = engine()
    kernel.calls.clear()
    x = on_device(torch.randn(sum(lengths_of(grid)), H * D, generator=torch.Generator().manual_seed(2)))
    OnDevice.reads = 0
    with torch.no_grad():
        out = tower(x, grid)
    return out.as_subclass(torch.Tensor).reshape(x.shape[0], -1), list(kernel.calls), OnDevice.reads


@pytest.mark.parametrize("module", sorted(TOWERS))
def test_the_fixed_tower_runs_vllms_flashinfer_path_in_every_block_with_one_host_read(module):
    grid = TOWERS[module][1]
    lengths = lengths_of(grid)
    with pytest.raises(AssertionError):  # the release as it is: the wrapper's bare asserts
        run(module, False, Backend.FLASHINFER)
    out, calls, reads = run(module, True, Backend.FLASHINFER)
    reference, _, _ = run(module, False, Backend.TORCH_SDPA)  # vLLM's own SDPA path, per image, token offsets
    assert len(calls) == DEPTH and reads <= 2
    cu = np.cumsum([0, *lengths])
    padded = 8 - len(lengths)  # vLLM's batch bucket
    for _, kw in calls:
        assert kw["actual_seq_lens_q"].view(-1).tolist() == lengths + [0] * padded
        assert kw["actual_seq_lens_kv"].view(-1).tolist() == lengths + [0] * padded
        assert kw["max_token_per_sequence"] == kw["max_sequence_kv"] == 1024
        # q, k and o at the layer's width per token; v made contiguous (or already so) at the same width.
        offsets = [int(c) * H * D for c in cu] + [int(cu[-1]) * H * D] * padded
        assert kw["batch_offsets_q"].view(-1).tolist() == offsets == kw["batch_offsets_v"].view(-1).tolist()
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("module", sorted(TOWERS))
def test_the_fixed_tower_is_unchanged_under_another_backend_but_for_one_host_read(module):
    before, _, reads_before = run(module, False, Backend.TORCH_SDPA)
    after, calls, reads_after = run(module, True, Backend.TORCH_SDPA)
    assert not calls
    assert torch.equal(before, after)
    # vLLM's SDPA wrapper reads the lengths back in every block; the fix adds the one host copy of the offsets.
    assert reads_before >= DEPTH and reads_after == reads_before + 1


@pytest.mark.parametrize("module", ["dots_ocr", "ernie45_vl", "isaac", "lfm2_siglip2", "paddleocr_vl", "qwen2_vl",
                                    "qwen3_omni_moe_thinker"])
def test_the_fixed_file_compiles_re_lints_clean_and_a_second_fix_changes_nothing(module):
    text, path = model_text(module, False)
    (finding,) = [f for f in lint_source(text, str(path)) if f.code == "GL101"]
    fixed = fixed_source(text, str(path), unsafe_fixes=True)
    compile(fixed, str(path), "exec")
    assert not [f for f in lint_source(fixed, str(path)) if f.code == "GL101"]
    assert fixed_source(fixed, str(path), unsafe_fixes=True) == fixed
    # Lines the fix does not edit are kept as they were (it inserts whole lines before the loop and after
    # signatures' and calls' last elements, and edits the call's value argument in place).
    touched = {line for e in finding.fix.edits for line in range(e.line, e.end_line + 1)
               if not (e.line == e.end_line and e.column == 1)}
    old, new = text.splitlines(), fixed.splitlines()
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            assert set(range(i1 + 1, i2 + 1)) <= touched, old[i1:i2]


def test_a_contiguous_v_under_the_owners_default_offsets_is_misread():
    """Why glm4_1v and glm5next get no fix: their prepare_encoder_metadata builds offsets in the helper's default
    layout (v at three times q's stride, a view into the fused qkv projection), and their attention passes a v made
    contiguous. Through vLLM's own wrapper, a v so laid out is read right only with the one-stride offsets the fix
    writes (or as the view the default layout describes)."""
    cls, kernel, _ = engine()
    layer = encoder_layer(Backend.FLASHINFER)
    lengths = [5, 11, 3]
    cu = np.array([0, *np.cumsum(lengths)], dtype=np.int32)
    qkv = torch.randn(sum(lengths), 3, H, D, generator=torch.Generator().manual_seed(3))
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    dev = torch.device("cpu")
    seq = cls.maybe_compute_seq_lens(Backend.FLASHINFER, cu, dev)
    top = torch.tensor(cls.compute_max_seqlen(Backend.FLASHINFER, cu), dtype=torch.int32)
    default = cls.maybe_recompute_cu_seqlens(Backend.FLASHINFER, cu, H * D, 1, dev)
    one_stride = cls.maybe_recompute_cu_seqlens(Backend.FLASHINFER, cu, H * D, 1, dev, fp8_padded_hidden_size=H * D)
    expected = torch.empty_like(q)
    for a, b in zip(cu[:-1], cu[1:]):
        expected[a:b] = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)),
                                                       scale=D ** -0.5).transpose(0, 1)
    torch.testing.assert_close(layer._forward_flashinfer(q, k, v, default, top, seq), expected)
    torch.testing.assert_close(layer._forward_flashinfer(q, k, v.contiguous(), one_stride, top, seq), expected)
    with pytest.raises(RuntimeError):  # past the end of v: on the GPU, garbage or an illegal memory access
        layer._forward_flashinfer(q, k, v.contiguous(), default, top, seq)


# Every GL101 finding of the pinned tree: fixed, or the words its line ends with.
FIXED = ["dots_ocr", "ernie45_vl", "isaac", "lfm2_siglip2", "paddleocr_vl", "qwen2_vl", "qwen3_omni_moe_thinker"]
REFUSED = {
    "model_executor.models.funasr": "cu_seqlens not passed down",
    "model_executor.models.funaudiochat": "grouped k/v heads",
    "model_executor.models.glm4_1v": "owner's offsets do not fit v",
    "model_executor.models.glm_ocr": "no layer loop in this file",
    "model_executor.models.keye": "grouped k/v heads",
    "model_executor.models.mimo_v2_omni": "grouped k/v heads",
    "model_executor.models.moonvit": "cu_seqlens read on the way down",
    "model_executor.models.openpangu_vl": "cu_seqlens changes in the loop",
    "model_executor.models.siglip2navit": "cu_seqlens changes in the loop",
    "models.deepseek_v4.common.vision": "no single loop owner",
    "models.glm5next.common.multimodal": "owner's offsets do not fit v",
    "models.muse_spark.common.vision": "no single loop owner",
}


@pytest.mark.parametrize("module", [f"model_executor.models.{m}" for m in FIXED] + sorted(REFUSED))
def test_each_finding_of_the_pinned_tree_is_fixed_or_says_why_not(module):
    path = module_path(RELEASE, f"vllm.{module}")
    (finding,) = [f for f in lint_source(path.read_text(encoding="utf-8"), str(path)) if f.code == "GL101"]
    if module in REFUSED:
        assert finding.fix is None and finding.message.endswith("; no fix: " + REFUSED[module])
        assert "It is not built where the layer loop runs: " in finding.note
    else:
        assert finding.fix is not None and finding.fix.applicability == "unsafe"
        assert "with MMEncoderAttention's own helpers" in finding.fix.message
        assert finding.fix.message.endswith("(a host read once per forward)")
