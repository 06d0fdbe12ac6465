"""``install()``: guardlint's guards around sglang's own backends, in place, with no engine file edited.

    import guardlint.integrations.sglang as gl_sglang
    gl_sglang.install()     # before the model runs, in every process that runs it

Wrapped: ``VisionFlashInferAttention.forward`` (the flashinfer_cudnn ViT backend: missing
``sequence_lengths``/``max_seqlen``/``forward_metadata`` are derived once per forward, metadata without
``packed_indptrs`` is completed on the device) and the LoRA kernel launchers the LoRA backends call
(``sgemm_lora_a_fwd``, ``qkv_lora_b_fwd``, the absorbed-MLA ``step_*_fwd`` ...: a ``batch_info``
without ``max_len``/``seg_lens`` is completed from ``seg_indptr``). ``uninstall()`` restores the
originals. sglang is imported only by these two calls.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, List, Tuple

from guardlint.guard import guard_cudnn_vision, guard_lora

VISION = "sglang.srt.layers.attention.vision"
# Modules whose globals hold the LoRA kernel launchers the backends call (imported by name there).
LORA_CALLERS = (
    "sglang.srt.lora.backend.triton_backend",
    "sglang.srt.lora.backend.triton_v2_backend",
    "sglang.srt.lora.backend.chunked_backend",
    "sglang.srt.lora.deepseek_mla_correction",
)

_patches: List[Tuple[Any, str, Any]] = []
_wrapped: List[str] = []


def _patch(owner: Any, name: str, new: Any, label: str) -> None:
    _patches.append((owner, name, getattr(owner, name)))
    setattr(owner, name, new)
    _wrapped.append(label)


def _is_lora_launcher(name: str, value: Any) -> bool:
    if not inspect.isfunction(value) or hasattr(value, "__guardlint__"):
        return False
    if not (name.endswith("_fwd") or name.endswith("_forward")):
        return False
    params = list(inspect.signature(value).parameters)
    return "batch_info" in params and params.index("batch_info") >= 1


def install(*, vision: bool = True, lora: bool = True) -> List[str]:
    """Wrap sglang's backends; returns what was wrapped (``module.name``). Calling it twice is harmless.
    Modules this sglang release does not have are skipped."""
    if _patches:
        return list(_wrapped)
    if vision:
        module = importlib.import_module(VISION)
        cls = getattr(module, "VisionFlashInferAttention", None)
        if cls is not None:
            _patch(cls, "forward", guard_cudnn_vision(cls.forward), f"{VISION}.VisionFlashInferAttention.forward")
    if lora:
        for name in LORA_CALLERS:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for attr, value in list(vars(module).items()):
                if _is_lora_launcher(attr, value):
                    params = list(inspect.signature(value).parameters)
                    _patch(module, attr, guard_lora(value, x=params[0], weights=params[1]), f"{name}.{attr}")
    return list(_wrapped)


def uninstall() -> None:
    """Restore every original that ``install()`` replaced."""
    while _patches:
        owner, name, original = _patches.pop()
        setattr(owner, name, original)
    _wrapped.clear()
