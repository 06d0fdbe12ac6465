"""Registers and spills of a compiled kernel for sm_90a, read from Triton's bundled ptxas: no GPU needed.
Used by the CPU tests and ``bench/_attention_ptxas.py``."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def sm90_resources(ptx: str) -> dict:
    """``{"registers": per thread, "spill_bytes": spill stores}`` of PTX assembled for sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
        fh.write(ptx)
    try:
        report = subprocess.run([str(PTXAS), "-v", "--gpu-name", "sm_90a", fh.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(fh.name)
    spill = re.search(r"(\d+) bytes spill stores", report)
    return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spill_bytes": int(spill.group(1)) if spill else 0}
