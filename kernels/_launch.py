"""Direct launches of a compiled Triton kernel: the host cost of an eager call after the first.

``JITFunction.run`` binds every argument, specializes it, builds a cache key (``str`` of the options dict)
and looks the binary up on each call: for the LoRA kernels' ~30 arguments that is most of an eager call's
host time. A :class:`DirectLaunch` belongs to one tuned configuration (fixed constexprs and launch options).
Its first call for an argument signature goes through ``JITFunction.run``, which compiles or finds the
binary and launches it; the compiled kernel is kept under that signature, and later calls with the same
signature hand the arguments straight to its launcher, as ``JITFunction.run`` itself does last.

The signature is at least as fine as Triton's own specialization, so a kept binary is the one Triton would
pick: per tensor its dtype and 16-byte alignment, per int whether it is 1, a multiple of 16, and its range
(32-bit, 64-bit signed, unsigned), per TMA tensor descriptor (Gluon's kernels take them) its type, its
tensor's dtype, block shape, shared-memory layout and padding, plus the current device. A descriptor is
still encoded on every call, by the kept binary's own launcher, as ``JITFunction.run`` does. Launch hooks
(profilers such as proton) see every call: while one is set, every call goes through ``JITFunction.run``.
``GUARDLINT_DIRECT_LAUNCH=0`` turns direct launches off; they never run under ``TRITON_INTERPRET=1`` (no
binary).
"""
from __future__ import annotations

import operator
import os
from typing import Any, Callable, Optional

import torch

ENABLED = os.environ.get("GUARDLINT_DIRECT_LAUNCH", "1") not in ("", "0")

_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_I32 = range(-(2 ** 31), 2 ** 31)
_I64 = range(-(2 ** 63), 2 ** 63)


def _int_class(v: Any) -> int:
    """Triton's view of a scalar argument: for an int, 1 (a constant), 32-bit / 64-bit / unsigned, aligned to
    16 or not; a float is fp32 whatever its value, a bool u1."""
    if type(v) is float:
        return 7
    if type(v) is bool:
        return 8
    if v == 1:
        return 0
    aligned = not v & 15
    if v in _I32:
        return 1 + aligned
    return (3 if v in _I64 else 5) + aligned


def _is_descriptor(a: Any) -> bool:
    """A host TMA tensor descriptor (``triton.tools.tensor_descriptor`` or Gluon's): a tensor, a block shape."""
    return hasattr(a, "block_shape") and isinstance(getattr(a, "base", None), torch.Tensor)


def _descriptor_class(d: Any) -> tuple:
    """What Triton specializes a descriptor on: ``tensordesc<dtype[block], layout>`` (and its padding)."""
    return (type(d), d.base.dtype, tuple(d.block_shape), getattr(d, "layout", None), getattr(d, "padding", None))


def _getter(positions: tuple) -> Callable[[tuple], tuple]:
    """``args -> tuple(args[i] for i in positions)``, in C."""
    if len(positions) == 1:
        return lambda args: (args[positions[0]],)
    return operator.itemgetter(*positions) if positions else (lambda args: ())


def _runtime_knobs() -> Any:
    try:
        from triton import knobs
    except ImportError:  # older Triton: no hooks to respect
        return None
    return knobs.runtime


def _hooked(hook: Any) -> bool:
    """Is a launch hook set? Triton 3.6+ keeps a ``HookChain`` there (set when it holds a call); older
    releases, and callers that assign one, a plain callable."""
    return hook is not None and bool(getattr(hook, "calls", True))


class DirectLaunch:
    """Launches of ``fn`` with one fixed set of constexprs and launch ``options``.

    ``args`` are the kernel's non-constexpr parameters in declaration order (the constexprs must come last
    in the kernel's signature and all be in ``options``): tensors, TMA descriptors, Python ints, floats and
    bools."""

    def __init__(self, fn: Any, options: dict, interpret: bool = False) -> None:
        self.fn = fn
        self.options = options
        # An interpreted kernel (TRITON_INTERPRET=1) has no binary and no parameter list.
        params = list(getattr(fn, "params", ()))
        first_constexpr = next((i for i, p in enumerate(params) if p.is_constexpr), len(params))
        self.enabled = ENABLED and not interpret and bool(params)
        if self.enabled and any(not p.is_constexpr for p in params[first_constexpr:]):
            raise ValueError(f"{fn.__name__}: constexpr parameters must come last for a direct launch")
        self.arity = first_constexpr
        self.constants = tuple(options[p.name] for p in params[first_constexpr:]) if self.enabled else ()
        self.knobs = _runtime_knobs() if self.enabled else None
        # signature -> (launcher, CUfunction, packed metadata)
        self.binaries: dict = {}
        # Positions of the tensor and descriptor arguments (the rest are scalars), learnt at the first call.
        self.tensor_positions: Optional[tuple] = None
        self.int_positions: tuple = ()
        self._tensors: Callable[[tuple], tuple] = _getter(())
        self._descriptors: Optional[Callable[[tuple], tuple]] = None
        self._ints: Callable[[tuple], tuple] = _getter(())
        self._int_classes: dict = {}

    def _signature(self, args: tuple) -> tuple:
        if self.tensor_positions is None:
            self.tensor_positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            descriptors = tuple(i for i, a in enumerate(args) if _is_descriptor(a))
            self.int_positions = tuple(i for i, a in enumerate(args)
                                       if not isinstance(a, torch.Tensor) and i not in descriptors)
            self._tensors = _getter(self.tensor_positions)
            self._ints = _getter(self.int_positions)
            self._descriptors = _getter(descriptors) if descriptors else None
        ints = self._ints(args)
        classes = self._int_classes.get(ints)
        if classes is None:
            classes = tuple(map(_int_class, ints))
            if len(self._int_classes) < 256:  # shapes and strides repeat from layer to layer
                self._int_classes[ints] = classes
        tensors = tuple([(t.dtype, not t.data_ptr() & 15) for t in self._tensors(args)])
        if self._descriptors is not None:
            tensors += tuple(map(_descriptor_class, self._descriptors(args)))
        return (_current_device(), tensors, classes)

    def __call__(self, args: tuple, grid: tuple) -> None:
        knobs = self.knobs
        if not self.enabled or (knobs is not None and (_hooked(knobs.launch_enter_hook)
                                                       or _hooked(knobs.launch_exit_hook))):
            self.fn.run(*args, grid=grid, warmup=False, **self.options)
            return
        signature = self._signature(args)
        binary = self.binaries.get(signature)
        if binary is None:
            kernel = self.fn.run(*args, grid=grid, warmup=False, **self.options)
            launcher: Optional[Callable] = getattr(kernel, "run", None)
            function = getattr(kernel, "function", None)
            packed = getattr(kernel, "packed_metadata", None)
            if launcher is not None and function is not None and packed is not None and len(args) == self.arity:
                self.binaries[signature] = (launcher, function, packed)
            return
        launcher, function, packed = binary
        launcher(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 torch._C._cuda_getCurrentRawStream(signature[0]), function, packed, None, None, None,
                 *args, *self.constants)
