"""Kernels lane: without a GPU, the Triton kernels run through the interpreter.

TRITON_INTERPRET must be set before any @triton.jit kernel is defined, that is before the first import of
guardlint.kernels, so it is set here, when this conftest is loaded and before the lane's modules are imported.
The other lanes that import guardlint.kernels at module level (tests/integrations, tests/engines) set it the
same way in their own conftest, so each lane also runs on its own.

The lane's folder is on sys.path: test modules share helpers by module name (``from test_lora import ...``).
"""
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
