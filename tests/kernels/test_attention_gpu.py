"""varlen_attention on a CUDA device: the compiled Triton kernel against float64 for every head-dim split,
CUDA-graph capture with a prepared plan, torch.compile, and (each in its own process, since a CUDA fault
poisons the context) the FlashInfer backends and the cuDNN drop-in. Skipped without CUDA.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from guardlint.guard import GuardError, prepare_varlen_metadata
from guardlint.kernels import varlen_attention
from guardlint.kernels.attention import dispatch
from guardlint.kernels.attention import triton as triton_path
from guardlint.kernels.attention.reference import reference_varlen_attention

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def make_batch(lengths, heads, kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    shape = (offsets[-1], heads, head_dim)
    q = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    k = torch.randn(shape[0], kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    v = torch.randn(shape[0], kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    return q, k, v, torch.tensor(offsets, dtype=torch.int32, device="cuda"), offsets


def assert_matches(out, q, k, v, offsets, causal, scale=None):
    scale = q.shape[2] ** -0.5 if scale is None else scale
    ref = reference_varlen_attention(q, k, v, offsets, scale, causal)
    assert torch.isfinite(out).all()
    atol, rtol = TOLERANCE[q.dtype]
    err = (out.double() - ref).abs()
    assert (err <= atol + rtol * ref.abs()).all(), f"max abs error {err.max().item():.3g}"


@pytest.fixture
def poisoned_output(monkeypatch):
    monkeypatch.setattr(triton_path, "new_output", lambda q: torch.full_like(q, float("nan")))


LENGTHS = [0, 1, 300, 77, 1024, 129, 0, 513]


@pytest.mark.parametrize("head_dim", [64, 80, 96, 112, 128, 192, 240, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_bf16_every_head_dim_split(head_dim, causal, poisoned_output):
    q, k, v, cu, offsets = make_batch(LENGTHS, 8, 2, head_dim, torch.bfloat16, seed=head_dim)
    out = varlen_attention(q, k, v, cu, causal=causal, backend="triton")
    assert_matches(out, q, k, v, offsets, causal)


@pytest.mark.parametrize("lengths,head_dim", [([256] * 8, 80), ([4096, 2304, 1024], 128)])
def test_auto_runs_its_captured_pick_inside_cuda_graph_capture(lengths, head_dim):
    """auto plans its eager pick and its pick under capture together, at the first eager call; under
    torch.cuda.graph the planned call asks the stream and runs the captured pick (checked against float64 after
    a replay on new values); eager calls afterwards run the eager pick again."""
    from guardlint.kernels.attention.api import select_backend

    q, k, v, cu, offsets = make_batch(lengths, 16, 16, head_dim, torch.bfloat16, seed=head_dim)
    plan = prepare_varlen_metadata(cu, q)
    eager = varlen_attention(q, k, v, cu, metadata=plan, backend="auto")
    assert_matches(eager, q, k, v, offsets, False)
    eager_pick = select_backend(q, k, cu, plan.max_seqlen, backend="auto")
    with torch.cuda.graph(torch.cuda.CUDAGraph()):  # nothing captured: only the pick under capture
        captured_pick = select_backend(q, k, cu, plan.max_seqlen, backend="auto")
    varlen_attention(q, k, v, cu, metadata=plan, backend=captured_pick)  # its kernels built before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = varlen_attention(q, k, v, cu, metadata=plan, backend="auto")
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(captured, q, k, v, offsets, False)
    assert_matches(varlen_attention(q, k, v, cu, metadata=plan, backend="auto"), q, k, v, offsets, False)
    assert select_backend(q, k, cu, plan.max_seqlen, backend="auto") == eager_pick


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_triton_other_dtypes(dtype, poisoned_output):
    q, k, v, cu, offsets = make_batch(LENGTHS, 4, 4, 80, dtype, seed=1)
    out = varlen_attention(q, k, v, cu, backend="triton", softmax_scale=0.07)
    assert_matches(out, q, k, v, offsets, False, scale=0.07)


def test_triton_runs_inside_cuda_graph_capture_with_a_prepared_plan():
    q, k, v, cu, offsets = make_batch([200, 0, 64, 333], 16, 16, 80, torch.bfloat16)
    plan = prepare_varlen_metadata(cu, q)
    eager = varlen_attention(q, k, v, cu, metadata=plan, backend="triton")  # autotunes before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = varlen_attention(q, k, v, cu, metadata=plan, backend="triton")
    q.copy_(torch.randn_like(q))
    graph.replay()
    assert_matches(captured, q, k, v, offsets, False)
    assert not torch.equal(captured, eager)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


hopper_only = pytest.mark.skipif(not _hopper(), reason="the Gluon kernel runs on Hopper (sm_90) only")


@pytest.fixture
def poisoned_gluon_output(monkeypatch):
    from guardlint.kernels.attention import gluon as gluon_path

    monkeypatch.setattr(gluon_path, "new_output", lambda q: torch.full(q.shape, float("nan"), dtype=q.dtype,
                                                                       device=q.device))


@hopper_only
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gluon_matches_float64(head_dim, dtype, poisoned_gluon_output):
    # Lengths 0 and 1, partial last key tiles, a sequence with two 128-row query tiles, GQA 8:2.
    q, k, v, cu, offsets = make_batch(LENGTHS + [2048, 130], 8, 2, head_dim, dtype, seed=head_dim)
    out = varlen_attention(q, k, v, cu, backend="gluon")
    assert_matches(out, q, k, v, offsets, False)


@hopper_only
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("wgs", [3, 2])
def test_gluon_two_and_three_warpgroups_match_float64(head_dim, dtype, wgs, poisoned_gluon_output, monkeypatch):
    """Three consumer warpgroups (192-row query tiles, round-robin turns; the default at D=64, at D=80 with P
    through shared memory) and two (the default at D=80): partial, empty and one-row sequences, a query tile
    exactly full (192), GQA 8:2."""
    from guardlint.kernels.attention import gluon as gluon_path

    monkeypatch.setattr(gluon_path, "WGS_SETTING", str(wgs))
    seen, real = [], gluon_path.direct_launch
    monkeypatch.setattr(gluon_path, "direct_launch", lambda fn, **options: seen.append(options) or real(fn, **options))
    q, k, v, cu, offsets = make_batch(LENGTHS + [192, 2048, 193], 8, 2, head_dim, dtype, seed=head_dim + 5)
    out = varlen_attention(q, k, v, cu, backend="gluon")
    assert_matches(out, q, k, v, offsets, False)
    assert [o["WGS"] for o in seen] == [wgs]


@hopper_only
@pytest.mark.parametrize("head_dim,dtype,causal", [(64, torch.bfloat16, False), (80, torch.bfloat16, False),
                                                  (128, torch.bfloat16, False), (80, torch.float16, False),
                                                  (80, torch.bfloat16, True), (128, torch.float16, True)], ids=str)
def test_gluon_exponentials_on_the_fma_units_match_float64(head_dim, dtype, causal, poisoned_gluon_output,
                                                          monkeypatch):
    """GUARDLINT_GLUON_EXP2_POLY=3 (attention.softmax_exp2: 3 of every 8 of P's exponentials as a cubic on the FMA
    units): the same batches as the product, partial and empty sequences, GQA 8:2, NaN-poisoned output."""
    from guardlint.kernels.attention import gluon as gluon_path

    monkeypatch.setattr(gluon_path, "EXP2_POLY_SETTING", "3")
    seen, real = [], gluon_path.direct_launch
    monkeypatch.setattr(gluon_path, "direct_launch", lambda fn, **options: seen.append(options) or real(fn, **options))
    q, k, v, cu, offsets = make_batch(LENGTHS + [192, 2048, 193], 8, 2, head_dim, dtype, seed=head_dim + 11)
    out = varlen_attention(q, k, v, cu, backend="gluon", causal=causal)
    assert_matches(out, q, k, v, offsets, causal)
    assert [o["EXP2_POLY"] for o in seen] == [3]


@hopper_only
@pytest.mark.parametrize("head_dim", [80, 96])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gluon_split_head_dims_match_float64(head_dim, dtype, poisoned_gluon_output, monkeypatch):
    """Head dims 80 and 96 in two power-of-two parts (attention.gluon_split, on unless GUARDLINT_GLUON_SPLIT=0):
    the same batches as the power-of-two head dims, NaN-poisoned output."""
    from guardlint.kernels.attention import gluon as gluon_path

    monkeypatch.setattr(gluon_path, "SPLIT_ENABLED", True)
    q, k, v, cu, offsets = make_batch(LENGTHS + [2048, 130], 8, 2, head_dim, dtype, seed=head_dim)
    assert gluon_path.supports(q, k, v, False)
    out = varlen_attention(q, k, v, cu, backend="gluon")
    assert_matches(out, q, k, v, offsets, False)
    q, k, v, cu, offsets = make_batch([256] * 6, 16, 16, head_dim, dtype, seed=3)
    out = varlen_attention(q, k, v, cu.long(), backend="gluon", softmax_scale=0.05)
    assert_matches(out, q, k, v, offsets, False, scale=0.05)


@hopper_only
def test_gluon_equal_lengths_int64_offsets_and_a_scale(poisoned_gluon_output):
    q, k, v, cu, offsets = make_batch([256] * 6, 16, 16, 128, torch.bfloat16, seed=3)
    out = varlen_attention(q, k, v, cu.long(), backend="gluon", softmax_scale=0.05)
    assert_matches(out, q, k, v, offsets, False, scale=0.05)


@hopper_only
def test_gluon_reads_a_fused_qkv_buffer_and_hands_other_layouts_to_triton():
    from guardlint.kernels.attention import gluon as gluon_path

    q0, k0, v0, cu, offsets = make_batch([300, 0, 77, 1000], 8, 8, 128, torch.bfloat16, seed=9)
    qkv = torch.cat([q0, k0, v0], dim=1)  # (T, 3H, D): row stride 3*H*D, heads contiguous
    q, k, v = qkv[:, :8], qkv[:, 8:16], qkv[:, 16:]
    assert gluon_path.supports(q, k, v, False)
    assert_matches(varlen_attention(q, k, v, cu, backend="gluon"), q, k, v, offsets, False)
    # A head-major copy viewed token-major: heads not contiguous, so the call runs on the Triton kernel.
    v_t = v0.transpose(0, 1).contiguous().transpose(0, 1)
    assert not gluon_path.supports(q0, k0, v_t, False)
    assert_matches(varlen_attention(q0, k0, v_t, cu, backend="gluon"), q0, k0, v_t, offsets, False)


@pytest.mark.parametrize("backend,head_dim", [("triton", 80), pytest.param("gluon", 128, marks=hopper_only)])
def test_under_torch_compile(backend, head_dim):
    q, k, v, cu, offsets = make_batch([100, 5, 260], 8, 4, head_dim, torch.bfloat16)
    lengths = cu[1:] - cu[:-1]

    def forward(q, k, v, cu, lengths):
        return varlen_attention(q, k, v, cu, sequence_lengths=lengths, max_seqlen=260, backend=backend) + 1

    torch._dynamo.reset()
    out = torch.compile(forward, fullgraph=True)(q, k, v, cu, lengths)
    assert_matches(out - 1, q, k, v, offsets, False)


def test_triton_launches_without_the_autotuner_after_its_first_pick(monkeypatch):
    q, k, v, cu, offsets = make_batch([300, 0, 77, 1000], 8, 8, 80, torch.bfloat16, seed=5)
    first = varlen_attention(q, k, v, cu, backend="triton")  # tunes this key (or reuses an earlier pick)
    # max_seqlen derived: one tile each; the inference kernel (no log-sum-exp stored)
    key = (80, 1, False, 0, torch.bfloat16, torch.int32, True, False)
    assert key in triton_path._launches

    def tuner(*args, **kwargs):
        raise AssertionError("the autotuner ran for a key it has already picked a config for")

    monkeypatch.setattr(triton_path._varlen_attention_fwd_tuned, "run", tuner)
    again = varlen_attention(q, k, v, cu, backend="triton")
    assert torch.equal(first, again)
    assert_matches(again, q, k, v, offsets, False)


@pytest.mark.parametrize("view", ["contiguous", "head_slice", "offset_rows"])
def test_triton_direct_launch_uses_the_binary_triton_would_pick(view, monkeypatch):
    """After a key's first call the kernel is launched straight from the kept binary (kernels/_launch.py).
    Views that change Triton's specialization (strides that are not multiples of 16, base pointers off
    16-byte alignment) get their own binary, the one JITFunction.run returns for the same arguments, and
    the outputs match float64."""
    from guardlint.kernels._launch import DirectLaunch

    q, k, v, cu, offsets = make_batch([300, 0, 77, 1000], 4, 2, 80, torch.bfloat16, seed=9)
    if view == "head_slice":  # q's token stride 5 * 80 (not 4 * 80): a wider buffer, sliced
        wide = torch.randn(q.shape[0], 5, 80, device="cuda").to(q.dtype)
        wide[:, :4] = q
        q = wide[:, :4]
    elif view == "offset_rows":  # q and k start 3 elements into their storage
        q = torch.cat([q.new_zeros(3), q.flatten()])[3:].view(q.shape)
        k = torch.cat([k.new_zeros(3), k.flatten()])[3:].view(k.shape)
    seen = []
    call = DirectLaunch.__call__
    monkeypatch.setattr(DirectLaunch, "__call__",
                        lambda self, args, grid: seen.append((self, args, grid)) or call(self, args, grid))
    outs = [varlen_attention(q, k, v, cu, max_seqlen=1000, backend="triton") for _ in range(3)]
    for out in outs:
        assert_matches(out, q, k, v, offsets, False)
    assert seen, "no launch went through a DirectLaunch"
    for direct, args, grid in seen:
        assert direct.enabled and direct.binaries
        triton_pick = direct.fn.run(*args, grid=grid, warmup=True, **direct.options)
        kept = direct.binaries[direct._signature(args)]
        assert kept[0] is triton_pick.run and kept[1] == triton_pick.function


@hopper_only
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gluon_causal_matches_float64(head_dim, dtype, poisoned_gluon_output, monkeypatch):
    """Causal on the Gluon kernels (on unless GUARDLINT_GLUON_CAUSAL=0): key tiles up to the
    diagonal, the diagonal tile masked per row, query tiles launched last to first. Lengths 0 and 1, one
    query tile exactly (128), one row past it (129), several tiles with a partial last one, GQA 8:2."""
    from guardlint.kernels.attention import gluon as gluon_path

    monkeypatch.setattr(gluon_path, "CAUSAL_ENABLED", True)
    ran, launch = [], gluon_path.varlen_attention_gluon
    monkeypatch.setattr(gluon_path, "varlen_attention_gluon", lambda *a: ran.append(a[-1]) or launch(*a))
    q, k, v, cu, offsets = make_batch(LENGTHS + [128, 2048, 130], 8, 2, head_dim, dtype, seed=head_dim + 1)
    assert gluon_path.supports(q, k, v, True)
    out = varlen_attention(q, k, v, cu, causal=True, backend="gluon")
    assert_matches(out, q, k, v, offsets, True)
    # Equal lengths (no sequence order) and int64 offsets take the other launch path.
    q, k, v, cu, offsets = make_batch([384] * 3, 4, 4, head_dim, dtype, seed=7)
    out = varlen_attention(q, k, v, cu.long(), causal=True, backend="gluon")
    assert_matches(out, q, k, v, offsets, True)
    assert ran == [True, True], "both calls ran the Gluon kernel, causal"


@hopper_only
@pytest.mark.parametrize("head_dim", [128, 80])
def test_gluon_direct_launch_uses_the_binary_triton_would_pick(head_dim, monkeypatch):
    """The Gluon kernels' later calls launch the kept binary with fresh TMA descriptors (kernels/_launch.py):
    it is the one JITFunction.run returns for the same arguments, and the outputs match float64 each time,
    for new tensors of other lengths too (descriptors encode the new base, shape and strides)."""
    from guardlint.kernels._launch import DirectLaunch
    from guardlint.kernels.attention import gluon as gluon_path

    monkeypatch.setattr(gluon_path, "SPLIT_ENABLED", True)
    seen = []
    call = DirectLaunch.__call__
    monkeypatch.setattr(DirectLaunch, "__call__",
                        lambda self, args, grid: seen.append((self, args, grid)) or call(self, args, grid))
    for seed, lengths in enumerate(([300, 0, 77, 1000], [300, 0, 77, 1000], [5, 640, 129], [2048])):
        q, k, v, cu, offsets = make_batch(lengths, 8, 2, head_dim, torch.bfloat16, seed=seed)
        assert_matches(varlen_attention(q, k, v, cu, backend="gluon"), q, k, v, offsets, False)
    assert len(seen) == 4, "every Gluon launch goes through a DirectLaunch"
    for direct, args, grid in seen:
        assert direct.enabled and direct.binaries
        triton_pick = direct.fn.run(*args, grid=grid, warmup=True, **direct.options)
        kept = direct.binaries[direct._signature(args)]
        assert kept[0] is triton_pick.run and kept[1] == triton_pick.function


def test_auto_without_a_table_runs_triton_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv(dispatch.TABLE_ENV, str(tmp_path / "none.json"))
    dispatch.reset()
    try:
        from guardlint.kernels.attention import select_backend

        q, k, v, cu, _ = make_batch([10, 20], 4, 4, 80, torch.bfloat16)
        assert select_backend(q, k, cu, 20) == "triton"
    finally:
        dispatch.reset()


def test_cu_seqlens_on_the_host_is_refused_before_launch():
    q, k, v, cu, _ = make_batch([10, 20], 4, 4, 80, torch.bfloat16)
    with pytest.raises(GuardError) as err:
        varlen_attention(q, k, v, cu.cpu(), max_seqlen=20, sequence_lengths=(cu[1:] - cu[:-1]), backend="triton")
    assert err.value.code == "GL106" and err.value.argument == "cu_seqlens"


# -- FlashInfer: one process per check ---------------------------------------------------------------

ISOLATED = textwrap.dedent("""
    import json, torch
    from guardlint.kernels import varlen_attention, cudnn_vision_attention
    from guardlint.kernels.attention import flashinfer as fi
    from guardlint.kernels.attention.reference import reference_varlen_attention
    backend, head_dim, drop_in = {backend!r}, {head_dim}, {drop_in}
    variant = backend.split("-", 1)[1]
    if not fi.supports(variant, head_dim, torch.bfloat16, torch.device("cuda")):
        print(json.dumps({{"skip": fi.unavailable_reason(torch.device("cuda")) or "unsupported head dim"}}))
        raise SystemExit
    gen = torch.Generator(device="cuda").manual_seed(0)
    offsets = [0, 300, 300, 1324, 1580]
    q, k, v = (torch.randn(1580, 8, head_dim, generator=gen, device="cuda").bfloat16() for _ in range(3))
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    if drop_in:
        out = cudnn_vision_attention(q, k, v, cu, 1, 1580)
    else:
        out = varlen_attention(q, k, v, cu, backend=backend)
        out = varlen_attention(q, k, v, cu, backend=backend)  # the cached plan
    ref = reference_varlen_attention(q, k, v, offsets, head_dim ** -0.5, False)
    print(json.dumps({{"err": float((out.double() - ref).abs().max()), "finite": bool(torch.isfinite(out).all())}}))
""")


@pytest.mark.parametrize("backend,head_dim,drop_in", [
    ("flashinfer-fa2", 128, False), ("flashinfer-fa3", 128, False), ("flashinfer-fa3", 64, False),
    ("flashinfer-cudnn", 128, False), ("flashinfer-cudnn", 128, True),
])
def test_flashinfer_backend_matches_float64(backend, head_dim, drop_in):
    code = ISOLATED.format(backend=backend, head_dim=head_dim, drop_in=drop_in)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    assert result["finite"] and result["err"] < 2e-2, result
