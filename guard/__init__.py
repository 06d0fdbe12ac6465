"""Runtime guard: derive missing varlen / LoRA metadata once, validate it on request, fail with a code.

``prepare_varlen_metadata`` is the plan (host work once per batch); ``guard``, ``guard_varlen``,
``guard_cudnn_vision``, ``guard_lora`` and ``guard_mm_encoder`` (vLLM's encoder attention) enforce the
catalog's contracts at call time. Modes: ``off``, ``derive`` (default) and ``strict``; ``GUARDLINT_MODE``
sets the initial one, ``GUARDLINT_CACHE=off`` (or ``set_cache(False)``) re-derives at every call.
"""
from guardlint._requires import require as _require

_require("guardlint.guard", "torch")

from ._cache import caching, clear_cache, set_cache
from ._state import DerivationEvent, get_mode, mode, on_derive, reset_stats, set_mode, stats
from .decorator import guard
from .encoder import guard_mm_encoder
from .errors import GuardError, describe
from .metadata import VarlenMetadata, bucket_batch_size, bucket_max_seqlen, prepare_varlen_metadata
from .ready import VERIFIED, guard_cudnn_vision, guard_lora, guard_varlen
from .validate import check_lora, check_varlen

__all__ = [
    "DerivationEvent", "GuardError", "VERIFIED", "VarlenMetadata", "bucket_batch_size", "bucket_max_seqlen",
    "caching", "check_lora", "check_varlen", "clear_cache", "describe", "get_mode", "guard", "guard_cudnn_vision",
    "guard_lora", "guard_mm_encoder", "guard_varlen", "mode", "on_derive", "prepare_varlen_metadata", "reset_stats",
    "set_cache", "set_mode", "stats",
]
