"""LoRA kernels on the GPU: the Gluon prefill shrink (Hopper) against the torch reference and float64, on
layouts that give its tiles several adapters, rank-0 and out-of-range slots, graph padding and uncovered
rows; and the Triton kernel on the same calls, side by side. The expand's tuning call (trials in place on
the caller's output). Skipped without a CUDA device."""
from __future__ import annotations

import pytest
import torch

from guardlint.kernels import _gluon
from guardlint.kernels.lora import triton as lora_triton
from guardlint.kernels.lora import sgemm_lora_a, sgemm_lora_a_reference
from test_lora import make_batch

pytestmark = pytest.mark.gpu

SLOTS = 4


def batch(lens, slots, ranks, *, pad=0, extra_rows=0):
    """test_lora's batch (stale graph-buffer entries past num_segments included), these ranks, on the GPU."""
    info, S = make_batch(lens, slots, 16, pad=pad, extra_rows=extra_rows)
    info.lora_ranks = torch.tensor(ranks, dtype=torch.int32)
    for field in ("seg_indptr", "weight_indices", "lora_ranks", "scalings"):
        setattr(info, field, getattr(info, field).cuda())
    return info, S


def random_lens(seed, total):
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        lens.append(int(torch.randint(1, 200, (1,), generator=g)))
    return lens


# More than 1024 tokens averaging more than 8 a segment: the prefill shape the Gluon shrink takes.
LAYOUTS = {
    # segment edges inside 32-row tiles: tiles of two and more adapters; slot 2 has rank 0
    "unaligned": (random_lens(1, 1500), None, [16, 5, 0, 9], {}),
    # graph-padded buffers (stale entries past num_segments) and rows no live segment covers
    "graph_padded": ([700, 3, 0, 350, 1], [3, 0, 1, 2, 0], [16, 16, 16, 16], {"pad": 3, "extra_rows": 77}),
    # more segments than one lookup chunk (32)
    "many_segments": (random_lens(2, 2100), None, [16, 8, 16, 1], {}),
    # whole tiles of a rank-0 slot (no K pass at all)
    "rank0_tiles": ([512, 512, 100], [2, 0, 2], [16, 16, 0, 16], {}),
}


@pytest.fixture
def gluon_calls(monkeypatch):
    if _gluon.load("lora.gluon") is None or not _gluon.is_hopper(torch.device("cuda")):
        pytest.skip("the Gluon shrink needs Triton's Gluon and a Hopper GPU")
    calls = []
    monkeypatch.setattr(lora_triton, "GLUON_EAGER", True)  # eager calls here, to check the kernel itself
    run = lora_triton._gluon_shrink_run
    monkeypatch.setattr(lora_triton, "_gluon_shrink_run", lambda *a, **kw: calls.append(1) or run(*a, **kw))
    return calls


def check(out, x, w, info, stack_num=1, rtol=1.6e-2, atol=3e-2):
    ref = sgemm_lora_a_reference(x, w, info, stack_num)
    ref64 = sgemm_lora_a_reference(x.double(), w.double(), info, stack_num)
    nan = torch.isnan(ref64)
    assert torch.equal(torch.isnan(out), nan), "NaN rows differ from the reference's"
    torch.testing.assert_close(out[~nan], ref[~nan], rtol=rtol, atol=atol)
    torch.testing.assert_close(out[~nan].double(), ref64[~nan], rtol=rtol, atol=10 * atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gluon_shrink_matches_reference(name, dtype, gluon_calls, monkeypatch):
    lens, slots, ranks, kw = LAYOUTS[name]
    slots = slots or [i % SLOTS for i in range(len(lens))]
    info, S = batch(lens, slots, ranks, **kw)
    assert lora_triton._size_class(S, info.num_segments) == 2
    g = torch.Generator(device="cuda").manual_seed(0)
    K = 1000  # not a multiple of the 256-wide K step: TMA zero-fills the last one
    x = torch.randn(S, K, generator=g, device="cuda").to(dtype)
    w = (torch.randn(SLOTS, 16, K, generator=g, device="cuda") * K ** -0.5).to(dtype)
    out = sgemm_lora_a(x, w, info)
    assert gluon_calls, "the call did not take the Gluon shrink"
    check(out, x, w, info)
    # The Triton kernel on the same call agrees.
    monkeypatch.setattr(lora_triton, "USE_GLUON", False)
    torch.testing.assert_close(sgemm_lora_a(x, w, info), out, rtol=1.6e-2, atol=3e-2, equal_nan=True)


@pytest.mark.parametrize("stack_num,R", [(3, 16), (1, 64), (2, 32)])
def test_gluon_shrink_stacks_and_ranks(stack_num, R, gluon_calls, monkeypatch):
    """q/k/v stacks (48 columns in a 64-wide tile) and larger ranks; slot 1's rank ends inside a stack. The
    routing sends only 16-column stacks here (wider ones measured faster on Triton); the kernel takes up to 64."""
    monkeypatch.setattr(_gluon.load("lora.gluon"), "MAX_N", _gluon.load("lora.gluon").KERNEL_MAX_N)
    lens = random_lens(3, 1800)
    info, S = batch(lens, [i % SLOTS for i in range(len(lens))], [R, R // 2 + 1, 0, R])
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(S, 512, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(SLOTS, stack_num * R, 512, generator=g, device="cuda") * 512 ** -0.5).to(torch.bfloat16)
    check(sgemm_lora_a(x, w, info, stack_num), x, w, info, stack_num)
    assert gluon_calls


def test_gluon_shrink_zeroes_out_of_range_slots_and_ranks(gluon_calls):
    lens = [300, 200, 600, 100]
    info, S = batch(lens, [10 ** 6, 1, 0, 3], [16, 17, 0, 9])  # slot 1: rank above the stored 16
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(S, 512, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(SLOTS, 16, 512, generator=g, device="cuda") * 512 ** -0.5).to(torch.bfloat16)
    out = sgemm_lora_a(x, w, info)  # derive mode: device values are not checked before launch
    assert torch.equal(out[:500], torch.zeros_like(out[:500])) and out[500:].abs().sum() > 0
    check(out, x, w, info)
    assert gluon_calls


def test_calls_the_gluon_shrink_does_not_take_go_to_triton(gluon_calls):
    """Permuted rows, fp32 and stacks wider than MAX_N stay on the Triton kernel."""
    lens = random_lens(4, 1500)
    info, S = batch(lens, [i % SLOTS for i in range(len(lens))], [16, 16, 16, 16])
    x = torch.randn(S, 256, device="cuda")
    w = torch.randn(SLOTS, 16, 256, device="cuda") * 0.06
    check(sgemm_lora_a(x, w, info), x, w, info, rtol=1e-4, atol=1e-4)                    # fp32
    info.permutation = torch.randperm(S, device="cuda").to(torch.int32)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    check(sgemm_lora_a(xb, wb, info), xb, wb, info)                                       # permuted
    info.permutation = None
    w64 = torch.randn(SLOTS, 64, 256, device="cuda").to(torch.bfloat16) * 0.06
    info.lora_ranks = torch.full((SLOTS,), 64, dtype=torch.int32, device="cuda")
    check(sgemm_lora_a(xb, w64, info), xb, w64, info)                                     # 64 columns
    assert not gluon_calls


@pytest.mark.parametrize("R", [16, 64])
def test_expand_tuning_call_updates_its_output_once(R, monkeypatch):
    """The first call of a launch key tunes: its trials add into the caller's output, which is saved before them
    and restored after; the call's result must still be one update (rank 16 and 64 at prefill size, mixed ranks
    so both the selecting and the full-rank paths run)."""
    from guardlint.kernels.lora import sgemm_lora_b, sgemm_lora_b_reference

    monkeypatch.setattr(lora_triton._expand, "chosen", {})
    monkeypatch.setattr(lora_triton._expand.autotuner, "cache", {})
    lens = random_lens(3, 2000)
    info, S = batch(lens, [i % SLOTS for i in range(len(lens))], [R, R // 2, 0, R], extra_rows=40)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(S, R, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(SLOTS, 1024, R, generator=g).to("cuda", torch.bfloat16)
    base = torch.randn(S, 1024, generator=g).to("cuda", torch.bfloat16)
    want = sgemm_lora_b_reference(x.double(), w.double(), info, base.double())
    out = sgemm_lora_b(x, w, info, base.clone())
    assert lora_triton._expand.chosen, "the call did not tune"
    torch.testing.assert_close(out.double(), want, rtol=1.6e-2, atol=3e-1)
    again = sgemm_lora_b(x, w, info, base.clone())
    assert torch.equal(again, out)


def _recorded_direct_launches(monkeypatch):
    """Every DirectLaunch call: (the launcher, its args, its grid)."""
    seen = []
    call = lora_triton.DirectLaunch.__call__
    monkeypatch.setattr(lora_triton.DirectLaunch, "__call__",
                        lambda self, args, grid: seen.append((self, args, grid)) or call(self, args, grid))
    return seen


# Views that change what Triton specializes on: a pointer off 16-byte alignment, token counts and strides
# of 1, of a multiple of 16 and of neither, int64 tables.
SPECIALIZATIONS = {
    "aligned": dict(S_extra=0, offset=0, table=torch.int32),
    "misaligned_x": dict(S_extra=0, offset=1, table=torch.int32),
    "odd_tokens_int64": dict(S_extra=3, offset=0, table=torch.int64),
    "one_token": dict(S_extra=None, offset=0, table=torch.int32),
}


@pytest.mark.parametrize("name", list(SPECIALIZATIONS))
def test_direct_launch_uses_the_binary_triton_would_pick(name, monkeypatch):
    """After the first call of a configuration, its Triton kernels are launched straight from the kept
    binary (kernels/_launch.py). For inputs that Triton specializes differently, the kept binary is the one
    ``JITFunction.run`` returns for the same arguments, and the results match float64 references."""
    from guardlint.kernels.lora import sgemm_lora_b, sgemm_lora_b_reference

    spec = SPECIALIZATIONS[name]
    lens = [1] if spec["S_extra"] is None else [40, 7, 16 + spec["S_extra"], 1]
    info, S = batch(lens, [0, 1, 3, 2][:len(lens)], [16, 9, 16, 4])
    for field in ("seg_indptr", "weight_indices"):
        setattr(info, field, getattr(info, field).to(spec["table"]))
    g = torch.Generator(device="cpu").manual_seed(5)
    K, N = 136, 200
    x = torch.randn(S * K + spec["offset"], generator=g).to("cuda", torch.bfloat16)[spec["offset"]:].view(S, K)
    A = (torch.randn(SLOTS, 16, K, generator=g) * K ** -0.5).to("cuda", torch.bfloat16)
    y = torch.randn(S, 16, generator=g).to("cuda", torch.bfloat16)
    B = (torch.randn(SLOTS, N, 16, generator=g) * 0.25).to("cuda", torch.bfloat16)
    base = torch.randn(S, N, generator=g).to("cuda", torch.bfloat16)
    seen = _recorded_direct_launches(monkeypatch)
    for _ in range(3):  # the first call tunes, the second keeps the binary, the third launches it directly
        out_a = sgemm_lora_a(x, A, info)
        out_b = sgemm_lora_b(y, B, info, base.clone())
    check(out_a, x, A, info)
    ref = sgemm_lora_b_reference(y.double(), B.double(), info, base.double())
    torch.testing.assert_close(out_b.double(), ref, rtol=2e-2, atol=6e-2)
    launched = {id(d): d for d, _, _ in seen}
    assert launched, "no launch went through a DirectLaunch"
    for direct, args, grid in seen:
        assert direct.enabled and direct.binaries, "a configuration kept no binary"
        triton_pick = direct.fn.run(*args, grid=grid, warmup=True, **direct.options)
        kept = direct.binaries[direct._signature(args)]
        assert kept[0] is triton_pick.run and kept[1] == triton_pick.function, \
            f"{name}: the kept binary is not the one Triton picks"


@pytest.mark.parametrize("how", ["assigned", "chained"])
def test_direct_launch_steps_aside_for_launch_hooks(how, monkeypatch):
    """With a Triton launch hook set (a profiler: assigned, or added to Triton's hook chain), calls go
    through JITFunction.run so that it sees them; with the chain empty again, they launch directly."""
    from triton import knobs

    info, S = batch([30, 2], [0, 1], [16, 16, 16, 16])
    x = torch.randn(S, 64, device="cuda", dtype=torch.bfloat16)
    A = torch.randn(SLOTS, 16, 64, device="cuda", dtype=torch.bfloat16)
    sgemm_lora_a(x, A, info)
    sgemm_lora_a(x, A, info)
    hooked = []
    hook = lambda metadata: hooked.append(metadata)  # noqa: E731
    chain = knobs.runtime.launch_enter_hook
    if how == "assigned" or not hasattr(chain, "add"):
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    else:
        chain.add(hook)
    try:
        out = sgemm_lora_a(x, A, info)
        torch.cuda.synchronize()
    finally:
        if how == "chained" and hasattr(chain, "remove"):
            chain.remove(hook)
    assert hooked, "the launch hook did not see the call"
    check(out, x, A, info)


@pytest.mark.parametrize("perm_kind", ["duplicate", "out_of_range", "negative"])
def test_bad_permutation_on_the_gpu_is_gl204_in_derive_mode(perm_kind):
    """Derive mode reads a device permutation once per version (no silent unwritten rows); the layers of a
    forward share that read; under CUDA-graph capture nothing is read."""
    from guardlint.guard import GuardError, mode, reset_stats, stats

    info, S = batch([30, 2], [0, 1], [16, 16, 16, 16])
    x = torch.randn(S, 64, device="cuda", dtype=torch.bfloat16)
    A = torch.randn(SLOTS, 16, 64, device="cuda", dtype=torch.bfloat16)
    good = torch.randperm(S, device="cuda").to(torch.int32)
    info.permutation = good
    reset_stats()
    with mode("derive"):
        outs = [sgemm_lora_a(x, A, info) for _ in range(3)]
    assert stats()["cache_misses"] <= 1, "the permutation was read more than once for one version"
    for out in outs:
        check(out, x, A, info)
    bad = good.clone()
    bad[3] = {"duplicate": int(bad[4]), "out_of_range": S + 7, "negative": -1}[perm_kind]
    info.permutation = bad
    with mode("derive"), pytest.raises(GuardError) as err:
        sgemm_lora_a(x, A, info)
    assert err.value.code == "GL204" and err.value.argument == "batch_info.permutation"
