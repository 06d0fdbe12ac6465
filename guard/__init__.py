"""Runtime guard: derive missing varlen / LoRA metadata once, validate it on request, fail with a code."""
from .errors import GuardError, describe

__all__ = ["GuardError", "describe"]
