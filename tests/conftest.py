"""Shared test set-up: tests marked ``gpu`` are skipped on a machine without a CUDA device.

The lanes (tests/lint, tests/guard, tests/kernels, tests/integrations, tests/engines) each run on their own as
well as together. TRITON_INTERPRET is not set here: the conftest of each lane that defines Triton kernels at
import time sets it (tests/kernels, tests/integrations, tests/engines), so the linter's lane never imports torch
or Triton for it.
"""
import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # the linter tests run without torch too
        return False


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu or _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in gpu:
        item.add_marker(skip)
