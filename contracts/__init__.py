"""The contract catalog: one source of truth for what each kernel needs, how to derive it and the
diagnosis text. Plain Python: the linter, the runtime guard and ``guardlint explain`` all read it.
"""
from __future__ import annotations

from .catalog import BUILTIN, LORA_FIELDS, VISION_PARAMS
from .config import ConfigError, contract_from_config
from .model import Contract, Derivation, Diagnosis, Example, Target

_BY_CODE = {c.code: c for c in BUILTIN}


def get(code: str) -> Contract:
    """The built-in contract with this code (``KeyError`` naming the known codes otherwise)."""
    try:
        return _BY_CODE[code.upper()]
    except KeyError:
        raise KeyError(f"unknown rule code {code!r}; known: {', '.join(sorted(_BY_CODE))}") from None


def all_contracts() -> tuple[Contract, ...]:
    return BUILTIN


def match_error(text: str) -> list[Contract]:
    """Contracts whose code or error patterns occur in ``text`` (an error message or traceback)."""
    return [c for c in BUILTIN if c.matches_error(text)]


__all__ = [
    "BUILTIN", "ConfigError", "Contract", "Derivation", "Diagnosis", "Example", "LORA_FIELDS", "Target",
    "VISION_PARAMS", "all_contracts", "contract_from_config", "get", "match_error",
]
