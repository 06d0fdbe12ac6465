"""The runtime half's dependencies come with an extra: one clear ImportError when they are missing.

``pip install guardlint`` is the linter and ``guardlint diagnose`` (libcst, click, pathspec). The guard, the
kernels and the integrations need torch (the kernels Triton too): ``pip install 'guardlint[torch]'``.
"""
from __future__ import annotations

import importlib.util

EXTRA_HINT = "pip install 'guardlint[torch]'"


def require(package: str, *modules: str) -> None:
    """Raise one ImportError naming ``package`` and the extra when one of the top-level ``modules`` is not
    installed. Only looks the modules up (no import), so a lazily importing package stays cheap."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ImportError(
                f"{package} needs {module}, which is not installed. The base install of guardlint is the linter "
                f"and `guardlint diagnose` only; for the runtime guard, kernels and integrations: {EXTRA_HINT}",
                name=module,
            )
