"""The static half of guardlint: a libcst linter whose rules are generated from the contract catalog.

Importing this package is cheap (no libcst, no torch): the engine loads when something is checked.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Finding": "findings",
    "Fix": "findings",
    "RuleSet": "rules",
    "build_rules": "rules",
    "Settings": "config",
    "load_settings": "config",
    "UsageError": "config",
    "Report": "runner",
    "lint_paths": "runner",
    "lint_source": "runner",
    "fixed_source": "runner",
    "Edit": "findings",
    "rules_for": "runner",
    "FileResult": "findings",
    "check_source": "engine",
}

if TYPE_CHECKING:  # what pyright, mypy and IDEs see; at runtime __getattr__ imports on first use
    from .config import Settings, UsageError, load_settings
    from .engine import check_source
    from .findings import Edit, FileResult, Finding, Fix
    from .rules import RuleSet, build_rules
    from .runner import Report, fixed_source, lint_paths, lint_source, rules_for

__all__ = [
    "Edit", "FileResult", "Finding", "Fix", "Report", "RuleSet", "Settings", "UsageError", "build_rules",
    "check_source", "fixed_source", "lint_paths", "lint_source", "load_settings", "rules_for",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'guardlint.lint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
