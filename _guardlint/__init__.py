"""guardlint: derive, validate and lint the metadata that varlen attention and LoRA kernels need.

The runtime half (``guardlint.guard``, ``guardlint.kernels``) imports torch; the static half
(``guardlint.lint``) never does. Both read ``guardlint.contracts``. Importing this package is cheap.
"""
from guardlint._version import __version__

__all__ = ["__version__"]
