"""Engine tests: the engines' own code from pinned releases (see fetch.py), GPU kernels faked.

Some modules import guardlint.kernels at module level (test_sglang_vision, test_integrations), and this lane is
collected before tests/kernels in a whole run, so without a GPU TRITON_INTERPRET is set here too, before any
@triton.jit kernel is defined (as in tests/kernels/conftest.py).
"""
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
