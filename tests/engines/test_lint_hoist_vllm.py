"""GL101's fix across functions for vLLM 0.33.0, run in the engine: the real model files, fixed by the linter, build
sequence_lengths (and, under FlashInfer, the host max_seqlen and element offsets the wrapper reads) once before the
layer loop with MMEncoderAttention's own helpers, and pass it down through the layers to the attention; the FP8 width
of those offsets comes from vLLM's get_fp8_padded_hidden_size, asked in the loop owner's __init__.

Each of the four fixed towers (dots_ocr, isaac, paddleocr_vl and qwen3_omni_moe_thinker's audio encoder) and the three
that get no fix because vLLM can capture them in an encoder CUDA graph (ernie45_vl, lfm2_siglip2 through lfm2_vl, and
qwen2_vl) runs from its own source, as fixed, with 32 layers: the tower's forward, the layers' and attentions' forwards
as written, the statements the fix adds to the owner's __init__ (run while the model is "built": vLLM's config, and so
its FP8 setting, is readable only then), the caller that builds cu_seqlens where the tower takes it as an argument
(lfm2_vl, paddleocr_vl), MMEncoderAttention's helpers, forward_cuda, _forward_flashinfer, _forward_sdpa and
_forward_fa, and the wrappers flashinfer_wrapper, torch_sdpa_wrapper and flash_attn_maxseqlen_wrapper, all taken from
the release with ``ast``. The three towers vLLM can capture in an encoder CUDA graph also run that way.
Faked: FlashInfer's cuDNN kernel (``cudnn_batch_prefill_with_kv_cache``, addressing q/k/v/o through the element
offsets it is given, in each tensor's own token stride) and flash_attn_varlen_func, the tensor-parallel linear layers
(plain matmuls), the rotary kernel (identity), the norms and MLPs (a plain layer norm, zero), and the patch embeddings
and the mergers and projectors after the encoder (identity: no part of the attention metadata). Host reads are
recorded, by the engine line that makes them, on the tensors the model keeps on the device (a tensor subclass marks
them: the inputs, what async_tensor_h2d moves, what is built with an explicit device, and everything computed from
those), outside the faked kernels; a read inside vLLM's own ``gpu_sync_allowed()`` is marked as declared.
"""
from __future__ import annotations

import __future__
import ast
import collections
import contextlib
import dataclasses
import difflib
import functools
import linecache
import math
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple, TypeAlias

import einops
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fetch import release_dir
from guardlint.lint.runner import fixed_source, lint_source
from source import Recorder, VllmBackend, load, module_path

RELEASE = "vllm-0.33.0"
MM = "vllm.model_executor.layers.attention.mm_encoder_attention"
WRAPPERS = "vllm.v1.attention.ops.vit_attn_wrappers"
MODELS = "vllm.model_executor.models"
DEPTH = 32
H, D = 2, 16
FP8 = False  # MMEncoderAttention's FP8 attention (mm_encoder_attn_dtype="fp8"), q/k/v quantized before the kernel

if not (release_dir(RELEASE) / "vllm").is_dir() and not os.environ.get("GUARDLINT_ENGINE_VLLM"):
    pytest.skip("vLLM 0.33.0 is not fetched (make engines-vllm; make test-engines runs these)",
                allow_module_level=True)


Backend = VllmBackend


# -- where the model's tensors live -------------------------------------------------------------------------------
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__array__,
          torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class Read(NamedTuple):
    """One device-to-host read: the engine line that makes it, and whether vLLM declares it (gpu_sync_allowed)."""
    line: str
    where: str
    declared: bool


def _sized_by_the_device(func, args, kwargs) -> bool:
    """Ops whose output size depends on a device tensor's values, so the host waits for them: repeat_interleave
    with tensor repeats and no output_size (vLLM's own, in dots_ocr's forward), and a boolean-mask index (in the
    Qwen3-Omni audio encoder's)."""
    if func is torch.repeat_interleave:
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return "output_size" not in kwargs and isinstance(repeats, torch.Tensor)
    if func is torch.Tensor.__getitem__:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


def _engine_line() -> Read:
    root = str(release_dir(RELEASE))
    frame = sys._getframe(2)
    while frame is not None and not frame.f_code.co_filename.startswith(root):
        frame = frame.f_back
    if frame is None:
        return Read("<no engine line>", "?", OnDevice.allowed > 0)
    name, line = frame.f_code.co_filename, frame.f_lineno
    return Read(linecache.getline(name, line).strip(), f"{Path(name).name}:{line}", OnDevice.allowed > 0)


class CaptureSync(RuntimeError):
    """What the CUDA runtime answers a device-to-host sync during a stream capture ("operation not permitted when
    stream is capturing")."""


class OnDevice(torch.Tensor):
    """A tensor the model keeps on the GPU: copying its contents to the host is a device-to-host read (recorded);
    what is computed from it stays on the device."""

    reads: list = []
    counting = True
    allowed = 0
    capturing = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if OnDevice.counting and (func in _READS or _sized_by_the_device(func, args, kwargs)):
            OnDevice.reads.append(_engine_line())
            if OnDevice.capturing:
                raise CaptureSync(f"{func.__name__} at {OnDevice.reads[-1].where}: {OnDevice.reads[-1].line}")
        if func in _READS:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        return super().__torch_function__(func, types, args, kwargs)


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(OnDevice)


@contextlib.contextmanager
def gpu_sync_allowed(first_only: bool = False):
    """vLLM's mark on a host read it makes on purpose (a no-op unless VLLM_GPU_SYNC_CHECK is set): reads inside it
    are recorded as declared."""
    OnDevice.allowed += 1
    try:
        yield
    finally:
        OnDevice.allowed -= 1


class WrapperTorch(types.ModuleType):
    """``torch`` as vLLM's attention wrappers see it: torch.cuda says whether a graph capture is under way."""

    cuda = types.SimpleNamespace(is_current_stream_capturing=lambda: OnDevice.capturing)

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)


_FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange"}


class TorchOnDevice(types.ModuleType):
    """``torch`` as the model files see it: a tensor built with an explicit device lives on the device."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name):
        factory = getattr(torch, name)
        if name not in _FACTORIES:
            return factory

        @functools.wraps(factory)
        def build(*args, device=None, **kwargs):
            t = factory(*args, **kwargs)
            return on_device(t) if device is not None else t
        return build


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


def flash_attn_fake(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                    out, **_):
    """vLLM's flash_attn_varlen_func, per sequence of cu_seqlens_q (its own reads are not the model's)."""
    OnDevice.counting = False
    try:
        cu = cu_seqlens_q.tolist()
        assert cu == cu_seqlens_k.tolist() and max(b - a for a, b in zip(cu, cu[1:])) <= max_seqlen_q == max_seqlen_k
        for a, b in zip(cu, cu[1:]):
            o = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=softmax_scale)
            out[a:b] = o.transpose(0, 1)
        return out
    finally:
        OnDevice.counting = True


def quantize_fp8_fake(tensor, scale, skip_scale=False, fp8_quant=None):
    """vLLM's quantize_fp8_maybe_pad_head_dim with scale 1 and the cast to FP8 left out: a new contiguous tensor, the
    head dimension zero-padded to a multiple of 16 (what cuDNN's FP8 prefill needs)."""
    return F.pad(tensor, (0, -tensor.shape[-1] % 16)).contiguous()


def _class_from(path: Path, name: str, keep: set, ns: dict, base: type) -> type:
    """The methods ``keep`` of class ``name`` of a release file, on ``base`` (its own bases need a vLLM config)."""
    node = next(n for n in ast.parse(path.read_text(encoding="utf-8")).body
                if isinstance(n, ast.ClassDef) and n.name == name)
    body = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name in keep]
    ns["_Base"] = base
    cls = ast.ClassDef(name=name, bases=[ast.Name("_Base", ast.Load())], keywords=[], body=body, decorator_list=[],
                       type_params=[])
    module = ast.fix_missing_locations(ast.Module(body=[cls], type_ignores=[]))
    exec(compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
    return ns[name]


@functools.lru_cache(maxsize=None)
def engine() -> tuple[type, Recorder, object]:
    """MMEncoderAttention (helpers, forward_cuda and the FlashInfer, SDPA and FlashAttention paths it dispatches to;
    the class's registration and __init__, which need a vLLM config, left out), the faked cuDNN kernel,
    async_tensor_h2d. flash_attn_maxseqlen_wrapper imports its kernel when called: see ``flash_attention``."""
    kernel = Recorder(cudnn_fake)
    prefill = types.ModuleType("flashinfer.prefill")
    prefill.cudnn_batch_prefill_with_kv_cache = kernel
    flashinfer = types.ModuleType("flashinfer")
    flashinfer.prefill = prefill
    sys.modules.setdefault("flashinfer", flashinfer)
    sys.modules["flashinfer.prefill"] = prefill
    platform = types.SimpleNamespace(is_rocm=lambda: False, is_zen_cpu=lambda: False, is_cuda=lambda: True)
    wrappers = load(RELEASE, WRAPPERS, ["flashinfer_wrapper", "apply_sdpa", "torch_sdpa_wrapper",
                                        "flash_attn_maxseqlen_wrapper"],
                    {"torch": WrapperTorch(), "einops": einops, "F": F, "gpu_sync_allowed": gpu_sync_allowed,
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
               "vit_flash_attn_wrapper": wrappers["flash_attn_maxseqlen_wrapper"],
               "vit_torch_sdpa_wrapper": lambda q, k, v, scale, cu_seqlens, enable_gqa=False:
                   wrappers["torch_sdpa_wrapper"](q, k, v, scale, cu_seqlens, enable_gqa),
               "quantize_fp8_maybe_pad_head_dim": quantize_fp8_fake,
               "_get_flashinfer_workspace_buffer": lambda: torch.empty(0, dtype=torch.uint8)})
    keep = {"compute_max_seqlen", "maybe_compute_seq_lens", "maybe_recompute_cu_seqlens", "view_qkv_to_4d",
            "_forward_sdpa", "_forward_flashinfer", "_forward_fa", "_quantize_qkv_fp8", "forward_cuda"}
    cls = _class_from(module_path(RELEASE, MM), "MMEncoderAttention", keep, ns, nn.Module)
    cls.forward = cls.forward_cuda  # CustomOp's dispatch on a CUDA platform
    return cls, kernel, h2d


def encoder_layer(backend: Backend) -> nn.Module:
    cls, _, _ = engine()
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    layer.num_heads = layer.num_kv_heads = H
    layer.head_size, layer.scale, layer.dtype = D, D ** -0.5, torch.float32
    layer.attn_backend, layer.fp8_enabled, layer._fa_version = backend, FP8, 2
    layer.is_flash_attn_backend = backend in (Backend.FLASH_ATTN, Backend.ROCM_AITER_FA)
    if FP8:  # as _init_fp8_state leaves it for static scales
        layer._fp8_dynamic_scale, layer.fp8_quant = False, object()
        layer.skip_scale_q = layer.skip_scale_k = layer.skip_scale_v = False
        layer._fp8_q_scale = layer._fp8_k_scale = layer._fp8_v_scale = torch.ones(())
    return layer


@contextlib.contextmanager
def flash_attention():
    """flash_attn_maxseqlen_wrapper's ``from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func``,
    answered with the faked kernel while the block runs."""
    fa_utils = types.ModuleType("vllm.v1.attention.backends.fa_utils")
    fa_utils.flash_attn_varlen_func = flash_attn_fake
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, fa_utils.__name__, fa_utils)
        yield


# -- the model files, as written and as fixed -------------------------------------------------------------------------
def model_text(module: str, fixed: bool) -> tuple[str, Path]:
    path = module_path(RELEASE, f"{MODELS}.{module}")
    text = path.read_text(encoding="utf-8")
    return (fixed_source(text, str(path), unsafe_fixes=True) if fixed else text), path


def model_classes(text: str, path: Path, names: list, ns: dict) -> dict:
    """The top-level functions and the classes ``names`` of a model file's text, the classes without __init__ (it
    builds vLLM's parallel layers; the test sets what the forwards read), class decorators (vLLM's torch.compile
    registration) or class attributes (weight-name mappers). The statements of __init__ that ask vLLM's
    get_fp8_padded_hidden_size (the fix's) are kept, as ``_built``, which ``bare`` runs once the layers are set. A
    fixed text is compiled under its own name, with its lines in linecache, so that tracebacks and recorded reads
    show the line as fixed."""
    defs = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            defs.append(node)
        elif isinstance(node, ast.ClassDef) and node.name in names:
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            asks = [stmt for stmt in (init.body if init is not None else [])
                    if any(isinstance(n, ast.Name) and n.id == "get_fp8_padded_hidden_size" for n in ast.walk(stmt))]
            node.body = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"]
            if asks:
                built = ast.parse("def _built(self): pass").body[0]
                built.body = asks
                node.body.append(ast.copy_location(built, asks[0]))
            node.decorator_list = []
            defs.append(node)
    assert {d.name for d in defs} == set(names), f"{path.name} defines no {set(names) - {d.name for d in defs}}"
    name = str(path)
    if text != path.read_text(encoding="utf-8"):
        name = f"{path} (as fixed)"
        linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    flags = __future__.annotations.compiler_flag
    exec(compile(ast.Module(body=defs, type_ignores=[]), name, "exec", flags=flags, dont_inherit=True), ns)
    return ns


def bare(cls: type, **attrs) -> nn.Module:
    """An instance without its __init__, with ``attrs``; then what the fix added to that __init__ (``_built``), run
    while the model is built."""
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    for k, v in attrs.items():
        setattr(obj, k, v)
    built = getattr(cls, "_built", None)
    if built is not None:
        Building.now = True
        try:
            built(obj)
        finally:
            Building.now = False
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


class PatchEmbed(nn.Module):
    """A patch embedding, faked as the identity on tokens already embedded; the model reads only its weights'
    dtype and device. ``batched`` adds the batch dimension the embedding returns."""

    def __init__(self, batched: bool = False, **modules: nn.Module) -> None:
        super().__init__()
        self.batched = batched
        for name, module in modules.items():
            setattr(self, name, module)

    def forward(self, x, *_, **__):
        return x.unsqueeze(0) if self.batched else x


class Projector(nn.Module):
    """lfm2_vl's multi-modal projector, faked as the identity: a downsample factor of 1, a token per patch."""

    factor = 1

    def forward(self, vision_features_packed, spatial_shapes):
        return vision_features_packed

    def forward_with_gather_idx(self, vision_features_packed, gather_idx):
        return vision_features_packed


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3 * H * D, H * D, generator=g) * 0.3, torch.randn(H * D, H * D, generator=g) * 0.05


def tokens(n: int) -> torch.Tensor:
    """n embedded patches (or frames), on the device."""
    return on_device(torch.randn(n, H * D, generator=torch.Generator().manual_seed(2)))


class Building:
    """Whether the model is being built: vLLM sets its config (set_current_vllm_config) while the model is built,
    not while it runs, so vision.get_multimodal_config answers only then."""
    now = False


def multimodal_config():
    """vision.get_multimodal_config: the multimodal config while the model is built, None in a forward."""
    return types.SimpleNamespace(mm_encoder_attn_dtype="fp8" if FP8 else None) if Building.now else None


@functools.lru_cache(maxsize=None)
def fp8_width() -> Callable:
    """vLLM's get_fp8_padded_hidden_size, from the release, over the config above."""
    math_utils = load(RELEASE, "vllm.utils.math_utils", ["round_up"], {})
    return load(RELEASE, f"{MODELS}.vision", ["get_fp8_padded_hidden_size"],
                {"get_multimodal_config": multimodal_config, "round_up": math_utils["round_up"]}
                )["get_fp8_padded_hidden_size"]


def namespace() -> dict:
    cls, _, h2d = engine()
    return {"torch": TorchOnDevice(), "nn": nn, "F": F, "np": np, "einops": einops, "math": math,
            "rearrange": einops.rearrange, "functools": functools, "partial": functools.partial,
            "MMEncoderAttention": cls, "AttentionBackendEnum": Backend, "async_tensor_h2d": h2d,
            "gpu_sync_allowed": gpu_sync_allowed, "PIN_MEMORY": False,
            "get_fp8_padded_hidden_size": fp8_width()}


def layers(backend: Backend, seed: int, make: Callable[[Linear, Linear, nn.Module], nn.Module]) -> nn.ModuleList:
    """DEPTH layers made by ``make(qkv, proj, attention)``, all with the same fused qkv and output projections."""
    wqkv, wproj = weights(seed)
    return nn.ModuleList(make(Linear(wqkv), Linear(wproj), encoder_layer(backend)) for _ in range(DEPTH))


def lengths_of(grid: list) -> list:
    """The frames of (t, h, w) images, as the towers that attend per frame pack them."""
    return [h * w for t, h, w in grid for _ in range(t)]


def heads() -> dict:
    """What the vision attentions' __init__ sets from the config on one rank."""
    return {"tp_size": 1, "tp_rank": 0, "num_attention_heads_per_partition": H, "hidden_size_per_attention_head": D}


# -- the towers, as vLLM calls them ----------------------------------------------------------------------------------
def dots_tower(fixed: bool, backend: Backend, grid: list) -> Callable:
    """dots_ocr's DotsVisionTransformer: it builds cu_seqlens from the image grid on the device."""
    ns = namespace()
    qwen2 = module_path(RELEASE, f"{MODELS}.qwen2_vl")
    model_classes(qwen2.read_text(encoding="utf-8"), qwen2, ["Qwen2VisionAttention"], ns)
    text, path = model_text("dots_ocr", fixed)
    model_classes(text, path, ["DotsVisionAttention", "DotsVisionBlock", "DotsVisionTransformer"], ns)
    blocks = layers(backend, 0, lambda qkv, proj, attn: bare(
        ns["DotsVisionBlock"], norm1=norm(), norm2=nn.Identity(), mlp=Zero(),
        attn=bare(ns["DotsVisionAttention"], **heads(), qkv=qkv, proj=proj, apply_rotary_emb=Rotary(), attn=attn)))
    tower = bare(ns["DotsVisionTransformer"], spatial_merge_size=2, blocks=blocks,
                 patch_embed=PatchEmbed(patchifier=bare(nn.Module, proj=nn.Linear(1, 1))),
                 rotary_pos_emb=lambda n: torch.zeros(n, D // 4), attn_backend=backend, post_trunk_norm=None,
                 merger=nn.Identity())
    return lambda: tower(tokens(sum(lengths_of(grid))), grid)


def qwen2_vision(fixed: bool, backend: Backend) -> nn.Module:
    """qwen2_vl's Qwen2VisionTransformer: its prepare_encoder_metadata moves the offsets to the device; its layer
    passes v as a view into the fused qkv projection."""
    ns = namespace()
    text, path = model_text("qwen2_vl", fixed)
    model_classes(text, path, ["Qwen2VisionAttention", "Qwen2VisionBlock", "Qwen2VisionTransformer"], ns)
    blocks = layers(backend, 1, lambda qkv, proj, attn: bare(
        ns["Qwen2VisionBlock"], norm1=norm(), norm2=nn.Identity(), mlp=Zero(),
        attn=bare(ns["Qwen2VisionAttention"], **heads(), qkv=qkv, proj=proj, apply_rotary_emb=Rotary(), attn=attn)))
    rope = types.SimpleNamespace(get_cos_sin=lambda n: (torch.ones(n, D // 4), torch.zeros(n, D // 4)))
    return bare(ns["Qwen2VisionTransformer"], spatial_merge_size=2, patch_embed=PatchEmbed(proj=nn.Linear(1, 1)),
                blocks=blocks, input_norm=lambda x, dtype: x, rotary_pos_emb=rope, attn_backend=backend,
                merger=lambda x: x.squeeze(1))


def qwen2_tower(fixed: bool, backend: Backend, grid: list) -> Callable:
    tower = qwen2_vision(fixed, backend)
    return lambda: tower(tokens(sum(lengths_of(grid))), grid)


def ernie_vision(fixed: bool, backend: Backend) -> nn.Module:
    """ernie45_vl's Ernie4_5_VisionTransformer: its prepare_encoder_metadata builds cu_seqlens on the host from the
    grid and moves it with async_tensor_h2d; its attention makes q, k and v contiguous itself (so the fix leaves v)."""
    ns = namespace()
    text, path = model_text("ernie45_vl", fixed)
    model_classes(text, path, ["Ernie4_5_VisionAttention", "Ernie4_5_VisionBlock", "Ernie4_5_VisionTransformer"], ns)
    blocks = layers(backend, 3, lambda qkv, proj, attn: bare(
        ns["Ernie4_5_VisionBlock"], norm1=norm(), norm2=nn.Identity(), mlp=Zero(),
        attn=bare(ns["Ernie4_5_VisionAttention"], **heads(), qkv=qkv, proj=proj, apply_rotary_emb=Rotary(), attn=attn)))
    return bare(ns["Ernie4_5_VisionTransformer"], spatial_merge_size=2, patch_embed=PatchEmbed(proj=nn.Linear(1, 1)),
                blocks=blocks, rotary_pos_emb=lambda n: torch.zeros(int(n), D // 4), ln=norm(), attn_backend=backend)


def ernie_tower(fixed: bool, backend: Backend, grid: list) -> Callable:
    tower = ernie_vision(fixed, backend)
    return lambda: tower(tokens(sum(lengths_of(grid))), grid)


def isaac_tower(fixed: bool, backend: Backend, grids: list) -> Callable:
    """isaac's Siglip2VisionTransformer: create_cumulative_seq_lengths builds cu_seqlens (and a max_seqlen) on the
    device from the image grids, which IsaacForConditionalGeneration moves there with async_tensor_h2d. Its pixel
    shuffle after the encoder is left out (pixel_shuffle_scale_factor 1)."""
    ns = namespace()
    text, path = model_text("isaac", fixed)
    model_classes(text, path, ["create_cumulative_seq_lengths", "Siglip2VisionAttention", "Siglip2EncoderLayer",
                               "Siglip2Encoder", "Siglip2VisionTransformer"], ns)
    encoder = bare(ns["Siglip2Encoder"], layers=layers(backend, 4, lambda qkv, proj, attn: bare(
        ns["Siglip2EncoderLayer"], layer_norm1=norm(), layer_norm2=nn.Identity(), mlp=Zero(),
        self_attn=bare(ns["Siglip2VisionAttention"], **heads(), qkv_proj=qkv, out_proj=proj, attn=attn))))
    tower = bare(ns["Siglip2VisionTransformer"], embeddings=lambda packed: packed[0], encoder=encoder,
                 post_layernorm=norm(), pixel_shuffle_scale_factor=1)
    h2d = ns["async_tensor_h2d"]
    return lambda: tower((tokens(sum(h * w for h, w in grids)), h2d(torch.tensor(grids), "cpu", dtype=torch.int32)))


def lfm2_vision(fixed: bool, backend: Backend) -> nn.Module:
    """lfm2_siglip2's Siglip2Model in (the methods of) lfm2_vl's model that calls it: the caller packs the tiles and
    builds cu_seqlens on the device and max_seqlen on the host; the encoder's layer passes v as a view."""
    ns = namespace()
    ns["resolve_visual_encoder_outputs"] = load(
        RELEASE, f"{MODELS}.vision",
        ["VisionFeatureSelectStrategyStr", "VisionFeatureSelectStrategy", "resolve_visual_encoder_outputs"],
        {"torch": torch, "Literal": Literal, "TypeAlias": TypeAlias, "Callable": Callable},
    )["resolve_visual_encoder_outputs"]
    text, path = model_text("lfm2_siglip2", fixed)
    model_classes(text, path, ["Siglip2Attention", "Siglip2EncoderLayer", "Siglip2Encoder",
                               "Siglip2VisionTransformer", "Siglip2Model"], ns)
    encoder = bare(ns["Siglip2Encoder"], layers=layers(backend, 5, lambda qkv, proj, attn: bare(
        ns["Siglip2EncoderLayer"], layer_norm1=norm(), layer_norm2=nn.Identity(), mlp=Zero(),
        self_attn=bare(ns["Siglip2Attention"], num_heads_per_partition=H, head_dim=D, qkv_proj=qkv, out_proj=proj,
                       attn=attn))))
    transformer = bare(ns["Siglip2VisionTransformer"], encoder=encoder, post_layernorm=norm(),
                       embeddings=PatchEmbed(patch_embedding=PatchEmbed(weight=nn.Parameter(torch.zeros(1)))),
                       config=types.SimpleNamespace(num_hidden_layers=DEPTH))
    caller = _class_from(module_path(RELEASE, f"{MODELS}.lfm2_vl"), "Lfm2VLForConditionalGeneration",
                         {"image_pixels_to_features", "_get_lfm2vl_tile_output_lengths", "encoder_cudagraph_forward",
                          "_get_lfm2vl_tile_input_lengths", "_get_lfm2vl_cu_seqlens"},
                         dict(namespace(), set_forward_context=lambda *_: contextlib.nullcontext()), nn.Module)
    return bare(caller, vision_tower=bare(ns["Siglip2Model"], vision_model=transformer),
                multi_modal_projector=Projector(), vllm_config=None)


def lfm2_tower(fixed: bool, backend: Backend, shapes: list) -> Callable:
    model = lfm2_vision(fixed, backend)
    lengths = [h * w for h, w in shapes]
    # The processor's padded tiles: (tiles, longest, patch dim), on the device; spatial_shapes stays on the host.
    padded = torch.zeros(len(shapes), max(lengths), H * D)
    for i, part in enumerate(tokens(sum(lengths)).as_subclass(torch.Tensor).split(lengths)):
        padded[i, :len(part)] = part
    return lambda: torch.cat(model.image_pixels_to_features(on_device(padded), torch.tensor(shapes)))


def paddle_tower(fixed: bool, backend: Backend, grid: list) -> Callable:
    """paddleocr_vl's SiglipVisionModel as PaddleOCRVLForConditionalGeneration.encode_image calls it: the caller
    builds cu_seqlens on the host, one segment per image (all its frames), the encoder moves it with
    async_tensor_h2d; its attention passes v as a view."""
    ns = namespace()
    text, path = model_text("paddleocr_vl", fixed)
    model_classes(text, path, ["SiglipAttention", "SiglipEncoderLayer", "SiglipEncoder", "SiglipVisionTransformer",
                               "SiglipVisionModel"], ns)
    encoder = bare(ns["SiglipEncoder"], attn_backend=backend, rotary_pos_emb=lambda n: torch.zeros(n, D // 4),
                   layers=layers(backend, 6, lambda qkv, proj, attn: bare(
                       ns["SiglipEncoderLayer"], layer_norm1=norm(), layer_norm2=nn.Identity(), mlp=Zero(),
                       self_attn=bare(ns["SiglipAttention"], **heads(), qkv_proj=qkv, out_proj=proj,
                                      apply_rotary_emb=Rotary(), attn=attn))))
    visual = bare(ns["SiglipVisionModel"], vision_model=bare(
        ns["SiglipVisionTransformer"], embeddings=PatchEmbed(batched=True, patch_embedding=nn.Linear(1, 1)),
        encoder=encoder, post_layernorm=norm()))
    caller = _class_from(module_path(RELEASE, f"{MODELS}.paddleocr_vl"), "PaddleOCRVLForConditionalGeneration",
                         {"encode_image"}, namespace(), nn.Module)
    model = bare(caller, visual=visual)
    return lambda: model.encode_image(tokens(sum(lengths_of(grid))), [tuple(g) for g in grid])


def audio_tower(fixed: bool, backend: Backend, frames: list) -> Callable:
    """qwen3_omni_moe_thinker's Qwen3OmniMoeAudioEncoder: it cuts each audio's mel frames into 100-frame chunks for
    its convolutions (host reads it declares with gpu_sync_allowed) and attends in windows of n_window_infer frames
    (104 tokens), cu_seqlens built on the host and moved with async_tensor_h2d; its layer passes v as a view."""
    ns = namespace()
    ns["SinusoidsPositionEmbedding"] = load(RELEASE, f"{MODELS}.qwen3_omni_moe_thinker", ["SinusoidsPositionEmbedding"],
                                            {"nn": nn, "torch": torch, "np": np})["SinusoidsPositionEmbedding"]
    text, path = model_text("qwen3_omni_moe_thinker", fixed)
    model_classes(text, path, ["_get_feat_extract_output_lengths", "Qwen3OmniMoeAudioAttention",
                               "Qwen3OmniMoeAudioEncoderLayer", "Qwen3OmniMoeAudioEncoder"], ns)
    zero = torch.zeros(H * D, H * D)
    mel, channels = 16, 16  # three stride-2 convolutions: 16 mel bins -> 2, times 16 channels = H * D
    with torch.random.fork_rng():
        torch.manual_seed(4)
        convs = [nn.Conv2d(1, channels, 3, 2, padding=1), nn.Conv2d(channels, channels, 3, 2, padding=1),
                 nn.Conv2d(channels, channels, 3, 2, padding=1), nn.Linear(2 * channels, H * D, bias=False)]
    encoder = bare(ns["Qwen3OmniMoeAudioEncoder"], n_window=50, n_window_infer=800, conv_chunksize=500,
                   positional_embedding=ns["SinusoidsPositionEmbedding"](64, H * D), conv2d1=convs[0],
                   conv2d2=convs[1], conv2d3=convs[2], conv_out=convs[3], ln_post=norm(), proj1=nn.Identity(),
                   act=nn.Identity(), proj2=nn.Identity(), attn_backend=backend,
                   layers=layers(backend, 7, lambda qkv, proj, attn: bare(
                       ns["Qwen3OmniMoeAudioEncoderLayer"], self_attn_layer_norm=norm(), final_layer_norm=norm(),
                       fc1=Linear(zero), fc2=Linear(zero), activation_fn=F.gelu,
                       self_attn=bare(ns["Qwen3OmniMoeAudioAttention"], head_dim=D, qkv_proj=qkv, out_proj=proj,
                                      attn=attn))))
    features = torch.randn(mel, sum(frames), generator=torch.Generator().manual_seed(2))

    def forward():
        # Qwen3OmniMoeConditionalGenerationMixin._process_audio_input: the lengths go to the device.
        feature_lens = ns["async_tensor_h2d"](torch.tensor(frames), "cpu")
        return encoder(on_device(features), feature_lens=feature_lens,
                       aftercnn_lens=ns["_get_feat_extract_output_lengths"](feature_lens))
    return forward


@dataclasses.dataclass(frozen=True)
class Tower:
    """One fixed tower's run: how to build its forward, what it is fed, and what the kernel and the host must see."""
    build: Callable[[bool, Backend, list], Callable[[], torch.Tensor]]
    grid: list  # the images (t, h, w), tiles or images (h, w), or audios (mel frames) of one forward
    lengths: list  # the attention sequences the tower packs them into, in order
    reads: tuple | None  # every host read of the fixed tower's forward under FlashInfer, by (part of) its line; None:
    # the linter gives the tower no fix


FIX_READ = "cu_seqlens_cpu = cu_seqlens.cpu().numpy()"  # the fix's one read, before the layer loop (declared)
TOWERS = {
    "dots_ocr": Tower(dots_tower, [[1, 2, 4], [1, 4, 4], [1, 2, 2]], [8, 16, 4],
                      ("cu_seqlens = torch.repeat_interleave(", FIX_READ)),  # the release's own, sizing cu_seqlens
    "ernie45_vl": Tower(ernie_tower, [[1, 2, 4], [2, 2, 2], [1, 4, 4]], [8, 4, 4, 16], None),  # captured: no fix
    "isaac": Tower(isaac_tower, [[2, 4], [4, 4], [2, 2]], [8, 16, 4], (FIX_READ,)),
    "lfm2_siglip2": Tower(lfm2_tower, [[2, 4], [4, 4], [2, 6]], [8, 16, 12], None),  # captured: no fix
    "paddleocr_vl": Tower(paddle_tower, [[1, 2, 4], [2, 2, 2], [1, 4, 4]], [8, 8, 16], (FIX_READ,)),
    "qwen2_vl": Tower(qwen2_tower, [[1, 2, 2], [2, 2, 4], [1, 4, 4]], [4, 8, 8, 16], None),  # captured: no fix
    # 1230, 370 and 60 frames: 160, 48 and 8 tokens after the convolutions, the first cut at 104. The release's own
    # five reads, all in gpu_sync_allowed(), size the chunks and the mask; then the fix's.
    "qwen3_omni_moe_thinker": Tower(audio_tower, [1230, 370, 60], [104, 56, 48, 8], (
        "total_chunks = int(chunk_num.sum())", "chunk_lengths_list = chunk_lengths.tolist()",
        "max_len_after_cnn = feature_lens_after_cnn.max().item()",
        "hidden_states = padded_embed[padded_mask_after_cnn]", "aftercnn_lens_list = aftercnn_lens.tolist()",
        FIX_READ)),
}


def run(module: str, fixed: bool, backend: Backend) -> tuple[torch.Tensor, list, list]:
    """The tower over its grid: (output, the cuDNN kernel's calls, the host reads during the forward)."""
    tower = TOWERS[module]
    forward = tower.build(fixed, backend, tower.grid)
    _, kernel, _ = engine()
    kernel.calls.clear()
    OnDevice.reads = []
    with torch.no_grad():
        out = forward()
    return out.as_subclass(torch.Tensor).reshape(-1, out.shape[-1]), list(kernel.calls), list(OnDevice.reads)


def bucket(n: int) -> int:
    """vLLM's FlashInfer batch bucket for n sequences."""
    return next(b for b in (8, 16, 32, 64) if b >= n)


FIXED = sorted(m for m, tower in TOWERS.items() if tower.reads is not None)


@pytest.mark.parametrize("module", FIXED)
def test_the_fixed_tower_runs_vllms_flashinfer_path_in_every_layer_reading_the_host_only_before_the_loop(module):
    tower = TOWERS[module]
    lengths = tower.lengths
    with pytest.raises(AssertionError) as unfixed:  # the release as it is: the wrapper's bare asserts
        run(module, False, Backend.FLASHINFER)
    assert unfixed.traceback[-1].name == "flashinfer_wrapper"
    out, calls, reads = run(module, True, Backend.FLASHINFER)
    reference, _, _ = run(module, False, Backend.TORCH_SDPA)  # vLLM's own SDPA path, per sequence, token offsets
    assert len(calls) == DEPTH
    # Every read of the forward, by its line: none in a layer; at most two that vLLM does not declare.
    assert len(reads) == len(tower.reads) and all(want in got.line for want, got in zip(tower.reads, reads)), reads
    assert sum(not r.declared for r in reads) <= 2
    assert all(r.declared for r in reads if FIX_READ in r.line)  # the fix's, in vLLM's gpu_sync_allowed()
    cu = np.cumsum([0, *lengths])
    padded = bucket(len(lengths)) - len(lengths)
    for _, kw in calls:
        assert kw["actual_seq_lens_q"].view(-1).tolist() == lengths + [0] * padded
        assert kw["actual_seq_lens_kv"].view(-1).tolist() == lengths + [0] * padded
        assert kw["max_token_per_sequence"] == kw["max_sequence_kv"] == 1024
        # q, k and o at the layer's width per token; v made contiguous (or already so) at the same width.
        offsets = [int(c) * H * D for c in cu] + [int(cu[-1]) * H * D] * padded
        assert [kw[f"batch_offsets_{t}"].view(-1).tolist() for t in "qkvo"] == [offsets] * 4
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("module", FIXED)
def test_the_fixed_tower_is_unchanged_under_another_backend_but_for_one_host_read(module):
    before, _, reads_before = run(module, False, Backend.TORCH_SDPA)
    after, calls, reads_after = run(module, True, Backend.TORCH_SDPA)
    assert not calls
    assert torch.equal(before, after)
    # vLLM's SDPA wrapper reads the lengths back in every layer; the fix adds the one host copy of the offsets.
    added = collections.Counter(r.line for r in reads_after) - collections.Counter(r.line for r in reads_before)
    assert len(reads_before) >= DEPTH and len(reads_after) == len(reads_before) + 1
    assert list(added.elements()) == [FIX_READ]


@pytest.mark.parametrize("module", FIXED)
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


# Every GL101 finding of the pinned tree: fixed (FIXED, above), or the words its line ends with.
REFUSED = {
    "model_executor.models.ernie45_vl": "tower captured in a CUDA graph",
    "model_executor.models.lfm2_siglip2": "tower captured in a CUDA graph",
    "model_executor.models.qwen2_vl": "tower captured in a CUDA graph",
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


# -- encoder CUDA graphs -----------------------------------------------------------------------------------------------
# With compilation_config.cudagraph_mm_encoder (off by default) vLLM captures the encoder forward of ernie45_vl,
# qwen2_vl and lfm2_vl in a CUDA graph (EncoderCudaGraphManager._capture_budget_graph) through the model's
# encoder_cudagraph_forward, the metadata prepared outside the graph as prepare_encoder_cudagraph_capture_inputs does
# (cu_seqlens padded to the batch size, max_seqlen on the host); a read from the device inside the capture is an error,
# and a host value read at capture would be kept for every later batch. The linter gives these towers no fix: the
# tower "as fixed" is the release's own, which the capture takes.
def ernie_captured(fixed: bool, backend: Backend, grid: list) -> Callable:
    caller = _class_from(module_path(RELEASE, f"{MODELS}.ernie45_vl"), "Ernie4_5_VLMoeForConditionalGeneration",
                         {"encoder_cudagraph_forward"}, namespace(), nn.Module)
    model = bare(caller, vision_model=ernie_vision(fixed, backend))
    values = model.vision_model.prepare_encoder_metadata(grid, max_batch_size=8, max_seqlen_override=1024,
                                                         device=torch.device("cpu"))
    return lambda: model.encoder_cudagraph_forward({**values, "pixel_values": tokens(sum(lengths_of(grid)))})


def qwen2_captured(fixed: bool, backend: Backend, grid: list) -> Callable:
    caller = _class_from(module_path(RELEASE, f"{MODELS}.qwen2_vl"), "Qwen2VLForConditionalGeneration",
                         {"encoder_cudagraph_forward"}, namespace(), nn.Module)
    model = bare(caller, visual=qwen2_vision(fixed, backend))
    values = model.visual.prepare_encoder_metadata(grid, max_batch_size=8, max_seqlen_override=1024,
                                                   device=torch.device("cpu"))
    return lambda: model.encoder_cudagraph_forward({**values, "pixel_values": tokens(sum(lengths_of(grid)))})


def lfm2_captured(fixed: bool, backend: Backend, shapes: list) -> Callable:
    model = lfm2_vision(fixed, backend)
    n = sum(h * w for h, w in shapes)
    values = {"pos_embeds": torch.zeros(n, H * D), "max_seqlen": torch.tensor(1024, dtype=torch.int32),
              "cu_seqlens": model._get_lfm2vl_cu_seqlens(shapes, torch.device("cpu")), "gather_idx": None}
    return lambda: model.encoder_cudagraph_forward({**values, "pixel_values_packed": tokens(n)})


CAPTURED = {"ernie45_vl": ernie_captured, "lfm2_siglip2": lfm2_captured, "qwen2_vl": qwen2_captured}


@pytest.mark.parametrize("module, hook, seam", [
    ("ernie45_vl", "Ernie4_5_VLMoeForConditionalGeneration.encoder_cudagraph_forward",
     "Ernie4_5_VisionTransformer.prepare_encoder_metadata"),
    ("lfm2_siglip2", "Lfm2VLForConditionalGeneration.encoder_cudagraph_forward in lfm2_vl.py",
     "Lfm2VLForConditionalGeneration.prepare_encoder_cudagraph_capture_inputs in lfm2_vl.py"),
    ("qwen2_vl", "Qwen2VLForConditionalGeneration.encoder_cudagraph_forward",
     "Qwen2VisionTransformer.prepare_encoder_metadata"),
])
def test_a_tower_vllm_captures_in_an_encoder_cuda_graph_gets_no_fix_and_the_reason_names_the_capture(module, hook,
                                                                                                    seam):
    assert sorted(CAPTURED) == sorted(set(TOWERS) - set(FIXED))
    text, path = model_text(module, False)
    (finding,) = [f for f in lint_source(text, str(path)) if f.code == "GL101"]
    assert finding.fix is None and fixed_source(text, str(path), unsafe_fixes=True) == text
    assert f"the tower is captured in a CUDA graph ({hook})" in finding.note
    assert f"build sequence_lengths in {seam}, outside the capture" in finding.note


@pytest.mark.parametrize("module, fixed", [(m, fixed) for fixed in (False, True) for m in sorted(CAPTURED)])
def test_the_tower_captured_in_an_encoder_cuda_graph_reads_nothing_from_the_device_under_flash_attention(module,
                                                                                                          fixed):
    reference, _, _ = run(module, False, Backend.TORCH_SDPA)
    forward = CAPTURED[module](fixed, Backend.FLASH_ATTN, TOWERS[module].grid)
    OnDevice.reads, OnDevice.capturing = [], True
    try:
        with flash_attention(), torch.no_grad():
            out = forward()
    finally:
        OnDevice.capturing = False
    assert not OnDevice.reads
    torch.testing.assert_close(out.as_subclass(torch.Tensor).reshape(reference.shape), reference, rtol=1e-4,
                               atol=1e-4)


# -- FP8 attention -----------------------------------------------------------------------------------------------------
# Under mm_encoder_attn_dtype="fp8" and FlashInfer, _forward_flashinfer quantizes q, k and v into new contiguous
# tensors with the head padded to a multiple of 16, so the offsets must use that padded width: vLLM's own towers pass
# fp8_padded_hidden_size=get_fp8_padded_hidden_size(num_heads, head_dim), asked in __init__ (it reads vLLM's config,
# which is set while the model is built: in a forward it answers None). isaac's and paddleocr_vl's SigLIP towers (and
# lfm2_siglip2's, which gets no fix) have heads of 72 (1152 / 16).
@pytest.mark.parametrize("head_size", [16, 24])
@pytest.mark.parametrize("module", FIXED)
def test_the_fixed_tower_under_fp8_attention_addresses_the_padded_heads(module, head_size, monkeypatch):
    monkeypatch.setitem(globals(), "D", head_size)
    reference, _, _ = run(module, False, Backend.TORCH_SDPA)
    monkeypatch.setitem(globals(), "FP8", True)
    out, calls, _ = run(module, True, Backend.FLASHINFER)
    cu = np.cumsum([0, *TOWERS[module].lengths])
    width = H * -(-head_size // 16) * 16  # per token, in every quantized tensor
    assert len(calls) == DEPTH
    for _, kw in calls:
        assert kw["batch_offsets_q"].view(-1).tolist()[:len(cu)] == [int(c) * width for c in cu]
        assert kw["batch_offsets_v"].view(-1).tolist()[:len(cu)] == [int(c) * width for c in cu]
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
