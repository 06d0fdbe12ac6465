"""Test set-up: without a GPU, Triton kernels run through the interpreter.

TRITON_INTERPRET must be set before any @triton.jit kernel is defined, so it is set here, before the
test modules import guardlint.kernels.
"""
import os

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except Exception:  # the linter tests run without torch too
    HAS_CUDA = False

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
