"""What the Gluon kernels (``attention.gluon``, ``lora.gluon``) share, importing no Gluon itself.

- ``load``: a Gluon kernel module on first use, or None where this Triton's Gluon does not import it.
  Importing Gluon adds ~45 ms to an import, and a Triton without it must still serve every call from the
  Triton kernels, so no module imports a Gluon one at load time.
- ``is_hopper``: whether a device is an sm_90 GPU (asked once per device).
- ``smem_layout``: the swizzled shared-memory layout of a TMA tile (built once per shape and dtype).
- ``compile_sm90`` and ``tensordesc``: a kernel compiled for sm_90a without a GPU, for the CPU tests' resource
  checks (call in a process without TRITON_INTERPRET).
"""
from __future__ import annotations

import functools
import importlib

import torch


@functools.lru_cache(maxsize=None)
def load(name: str):
    """``guardlint.kernels.<name>`` (``name`` a dotted path below it, as ``"lora.gluon"``), or None when it
    does not import (no Gluon, an older or partial Triton)."""
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except Exception:  # noqa: BLE001 - the Gluon path is simply unavailable; the Triton kernels serve the call
        return None


@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def is_hopper(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 GPU (the capability is read once per device)."""
    return device.type == "cuda" and _major(device.index if device.index is not None
                                            else torch.cuda.current_device()) == 9


@functools.lru_cache(maxsize=None)
def smem_layout(rows: int, cols: int, dtype: torch.dtype):
    # Building a layout costs ~8 us of Python.
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16 if dtype == torch.bfloat16
                                                else gl.float16)


def tensordesc(dtype: str, rows: int, cols: int) -> str:
    """Signature type of a TMA descriptor argument: ``dtype`` "bf16" or "fp16", tiles of rows x cols."""
    layout = smem_layout(rows, cols, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    return f"tensordesc<{dtype}[{rows}, {cols}],{layout!r}>"


def compile_sm90(fn, signature: dict, constants: dict, num_warps: int, attrs: dict | None = None) -> dict:
    """Compile ``fn`` for sm_90a and read what it became: ``ptx``, ``shared_bytes`` and ptxas's registers and
    spill bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from ._ptxas import sm90_resources

    compiled = triton.compile(GluonASTSource(fn, signature, constexprs=constants, attrs=attrs or {}),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    ptx = compiled.asm["ptx"]
    return {"ptx": ptx, "shared_bytes": compiled.metadata.shared, **sm90_resources(ptx)}
