"""kernels/_launch.py on the CPU: the argument signature is at least as fine as Triton's own specialization,
and a DirectLaunch keeps one binary per signature, launches it with the constexprs last, and steps aside
for launch hooks and the interpreter. (On the GPU, test_lora_gpu checks the kept binary against the one
``JITFunction.run`` picks.)"""
from __future__ import annotations

import types

import pytest
import torch

from guardlint.kernels import _launch
from guardlint.kernels._launch import DirectLaunch, _int_class

specialize = pytest.importorskip("triton._C.libtriton").native_specialize_impl
BaseBackend = pytest.importorskip("triton.backends.compiler").BaseBackend

INTS = sorted({*range(-40, 41), 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 1, 2 ** 31 + 16, -(2 ** 31),
               -(2 ** 31) - 1, -(2 ** 31) - 16, 2 ** 63 - 16, 2 ** 63 - 1, 2 ** 63, 2 ** 63 + 1, 2 ** 63 + 32,
               2 ** 64 - 16, 4096, 4097, 12288})


@pytest.mark.parametrize("specialized", [True, False], ids=["specialized", "do_not_specialize"])
def test_int_classes_are_at_least_as_fine_as_tritons(specialized):
    triton_of = {}
    for v in INTS:
        triton_of.setdefault(_int_class(v), set()).add(specialize(BaseBackend, v, False, specialized, True))
    for cls, seen in triton_of.items():
        assert len(seen) == 1, f"class {cls} holds ints Triton specializes differently: {seen}"


def test_floats_and_bools_have_their_own_classes():
    scalars = [0.0, 1.0, 16.0, -2.5, 1e300, True, False] + INTS
    triton_of = {}
    for v in scalars:
        triton_of.setdefault(_int_class(v), set()).add(specialize(BaseBackend, v, False, True, True))
    assert all(len(seen) == 1 for seen in triton_of.values()), triton_of
    assert _int_class(1.0) != _int_class(1) and _int_class(True) != _int_class(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.int64])
def test_tensor_signature_follows_dtype_and_alignment(dtype):
    base = torch.zeros(64, dtype=dtype)
    triton_of = {}
    for offset in range(8):
        t = base[offset:]
        ours = (t.dtype, not t.data_ptr() & 15)
        triton_of.setdefault(ours, set()).add(specialize(BaseBackend, t, False, True, True))
    assert all(len(seen) == 1 for seen in triton_of.values()), triton_of
    assert len(triton_of) == (1 if dtype.itemsize >= 16 else 2)


def test_descriptor_signature_follows_tritons():
    """TMA descriptors (Gluon's kernels take them): Triton specializes on the dtype, block shape and layout,
    not on the base address, shape or strides; so do we."""
    gluon = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from guardlint.kernels._gluon import smem_layout

    base = torch.zeros(1 << 16, dtype=torch.bfloat16)
    triton_of, ours_of = {}, {}
    for dtype in (torch.bfloat16, torch.float16):
        for offset, rows, cols in ((0, 100, 80), (8, 100, 80), (0, 640, 96), (64, 31, 128)):
            t = base[offset:offset + rows * cols].view(rows, cols).view(dtype)
            for block in ((64, 64), (64, 16), (128, 16)):
                d = gluon.TensorDescriptor(t, [rows, cols], [cols, 1], list(block), smem_layout(*block, dtype))
                ours = _launch._descriptor_class(d)
                assert _launch._is_descriptor(d) and not _launch._is_descriptor(t)
                triton_of.setdefault(ours, set()).add(specialize(BaseBackend, d, False, True, True))
                ours_of.setdefault(specialize(BaseBackend, d, False, True, True), set()).add(ours)
    assert all(len(seen) == 1 for seen in triton_of.values()), triton_of
    assert len(triton_of) == len(ours_of) == 6, "one class per dtype x block"


def test_direct_launch_classes_descriptor_arguments(on_gpu):
    """A descriptor argument is neither a tensor nor a scalar: its class joins the signature, and a
    descriptor of another block shape gets Triton's own launch (another binary)."""
    gluon = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from guardlint.kernels._gluon import smem_layout

    fn, launches = fake_kernel(["desc", "x", "n", "BLOCK"], {"BLOCK"})
    direct = DirectLaunch(fn, {"BLOCK": 16})
    direct.knobs = None
    t, x = torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(16)
    wide = gluon.TensorDescriptor(t, [64, 64], [64, 1], [64, 64], smem_layout(64, 64, t.dtype))
    narrow = gluon.TensorDescriptor(t, [64, 64], [64, 1], [64, 16], smem_layout(64, 16, t.dtype))
    direct((wide, x, 3), (1,))
    direct((wide, x, 5), (1,))
    direct((narrow, x, 5), (1,))
    assert [k[0] for k in launches] == ["jit", "direct", "jit"]
    assert launches[1][1][9] is wide, "the descriptor itself goes to the launcher (it encodes it)"


def fake_kernel(names, constexprs):
    """A stand-in JIT function: params with is_constexpr, run() records and returns a compiled stand-in."""
    launches, compiled = [], []

    def run(*args, grid, warmup, **options):
        binary = types.SimpleNamespace(function=len(compiled) + 100, packed_metadata=("meta",),
                                       run=lambda *a: launches.append(("direct", a)))
        compiled.append(binary)
        launches.append(("jit", args, grid, options))
        return binary

    params = [types.SimpleNamespace(name=n, is_constexpr=n in constexprs) for n in names]
    return types.SimpleNamespace(params=params, run=run, __name__="k"), launches


@pytest.fixture
def on_gpu(monkeypatch):
    """Pretend to be on device 0 with raw stream 7."""
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    monkeypatch.setattr(_launch, "ENABLED", True)


def test_direct_launch_keeps_one_binary_per_signature(on_gpu):
    fn, launches = fake_kernel(["x", "n", "stride", "BLOCK", "FLAG"], {"BLOCK", "FLAG"})
    direct = DirectLaunch(fn, {"BLOCK": 32, "FLAG": True, "num_warps": 4})
    direct.knobs = None
    x = torch.zeros(64)
    direct((x, 48, 1), (3, 2))
    direct((x, 64, 1), (5, 1))  # same classes: the kept binary, launched directly
    assert [k[0] for k in launches] == ["jit", "direct"]
    grid_x, grid_y, grid_z, stream, function, packed, meta, enter, exit_, *args = launches[1][1]
    assert (grid_x, grid_y, grid_z, stream, function, packed) == (5, 1, 1, 7, 100, ("meta",))
    assert (meta, enter, exit_) == (None, None, None)
    assert args == [x, 64, 1, 32, True], "arguments, then the constexprs in declaration order"
    direct((x[1:], 64, 1), (5, 1))  # misaligned pointer: Triton's own launch (another binary)
    direct((x, 47, 1), (5, 1))  # 47 is not a multiple of 16
    direct((x, 48, 16), (5, 1))  # a stride of 16 instead of 1
    assert [k[0] for k in launches] == ["jit", "direct", "jit", "jit", "jit"]
    direct((x, 47, 1), (5, 1))
    assert launches[-1][0] == "direct" and launches[-1][1][4] == 102
    assert len(direct.binaries) == 4


def test_direct_launch_steps_aside(on_gpu, monkeypatch):
    fn, launches = fake_kernel(["x", "n", "BLOCK"], {"BLOCK"})
    x = torch.zeros(16)
    # A launch hook: Triton's chain with a call in it, or a plain callable.
    chain = types.SimpleNamespace(calls=[print])
    direct = DirectLaunch(fn, {"BLOCK": 16})
    direct.knobs = types.SimpleNamespace(launch_enter_hook=chain, launch_exit_hook=None)
    for _ in range(3):
        direct((x, 3), (1,))
    assert [k[0] for k in launches] == ["jit"] * 3
    chain.calls.clear()
    direct((x, 3), (1,))  # keeps the binary
    direct((x, 3), (1,))
    assert [k[0] for k in launches[3:]] == ["jit", "direct"]
    direct.knobs.launch_exit_hook = print
    direct((x, 3), (1,))
    assert launches[-1][0] == "jit"
    # The interpreter, and GUARDLINT_DIRECT_LAUNCH=0: always Triton's launch.
    for off in (DirectLaunch(fn, {"BLOCK": 16}, interpret=True),):
        off((x, 3), (1,))
        off((x, 3), (1,))
        assert not off.enabled and launches[-1][0] == "jit"
    monkeypatch.setattr(_launch, "ENABLED", False)
    assert not DirectLaunch(fn, {"BLOCK": 16}).enabled


def test_constexprs_must_come_last(on_gpu):
    fn, _ = fake_kernel(["x", "BLOCK", "n"], {"BLOCK"})
    with pytest.raises(ValueError, match="constexpr parameters must come last"):
        DirectLaunch(fn, {"BLOCK": 16})
