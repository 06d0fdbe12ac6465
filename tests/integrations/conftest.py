"""Integrations lane: the wrapped models call guardlint.kernels, imported at module level here too, so without
a GPU TRITON_INTERPRET is set before any @triton.jit kernel is defined (as in tests/kernels/conftest.py)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
