"""test_lora_adversarial's bad batch infos on the GPU, in bfloat16 and float16, in derive mode (device tensors
reach the kernels unchecked): every row is the float64 reference's, on decode and prefill shapes, through
the Gluon shrink, and in a CUDA graph captured on a good batch and replayed on a bad one. Skipped without CUDA.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from guardlint.guard import GuardError, mode
from guardlint.kernels import _gluon
from guardlint.kernels.lora import triton as lora_triton
from guardlint.kernels.lora import sgemm_lora_b
from test_lora_adversarial import (ALL_BATCHES, INF, NAN, OVERLAPPING, N, R, S, SLOTS, bad_info, batches, calls,
                                   check_call, make_info, packed_tiles, poisoned_outputs, rand)

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
TOL = dict(rtol=1.6e-2, atol=3e-2)
# More than 1024 tokens averaging more than 8 a segment: prefill tiles (and the Gluon shrink's shape).
PREFILL = 3000
PREFILL_BATCHES = {
    "indptr_starts_above_0": ([300, 800, 800, 2000, 2600, 3000], [0, 1, 2, 3, 1], [R, 3, 0, 5], [0.5, 2.0, INF, 0.25]),
    "indptr_decreases": ([0, 900, 500, 1500, 1400, 2900, 7], [3, 0, 1, 3, 0], [R, 3, 0, 5], [0.5, 2.0, INF, 0.25]),
    "slots_and_ranks_out_of_range": ([0, 700, 1200, 1201, 2500, 3000], [SLOTS, -1, 0, 1, 3], [R + 1, 3, 0, -2],
                                     [1.0, 0.5, INF, NAN]),
}


def on_gpu(info):
    fields = {f: getattr(info, f).cuda() for f in ("seg_indptr", "weight_indices", "lora_ranks", "scalings")}
    if info.permutation is not None:
        fields["permutation"] = info.permutation.cuda()
    return dataclasses.replace(info, **fields)


@pytest.mark.parametrize("packed", [False, True], ids=["segment-tiles", "packed-tiles"])
@pytest.mark.parametrize("fresh", [False, True], ids=["accumulate", "fresh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(ALL_BATCHES))
def test_bad_batch_info_on_the_gpu_is_the_reference(name, dtype, fresh, packed):
    info = bad_info(name, permute=name == "indptr_decreases", device="cuda")
    with poisoned_outputs(), packed_tiles(packed):
        for call in calls(S, dtype, fresh=fresh, device="cuda"):
            check_call(call, info, S, **TOL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(PREFILL_BATCHES))
def test_bad_prefill_batch_info_on_the_gpu_is_the_reference(name, dtype):
    info = make_info(*PREFILL_BATCHES[name], device="cuda", tokens=PREFILL)
    assert lora_triton._size_class(PREFILL, info.num_segments) == 2
    with poisoned_outputs():
        for fresh in (True, False):
            for call in calls(PREFILL, dtype, fresh=fresh, device="cuda", seed=1):
                check_call(call, info, PREFILL, **TOL)


@pytest.mark.parametrize("name", list(PREFILL_BATCHES))
def test_gluon_shrink_on_bad_batch_info_is_the_reference(name, monkeypatch):
    if _gluon.load("lora.gluon") is None or not _gluon.is_hopper(torch.device("cuda")):
        pytest.skip("the Gluon shrink needs Triton's Gluon and a Hopper GPU")
    used = []
    run = lora_triton._gluon_shrink_run
    monkeypatch.setattr(lora_triton, "GLUON_EAGER", True)
    monkeypatch.setattr(lora_triton, "_gluon_shrink_run", lambda *a, **kw: used.append(1) or run(*a, **kw))
    info = make_info(*PREFILL_BATCHES[name], device="cuda", tokens=PREFILL)
    with poisoned_outputs():
        check_call(calls(PREFILL, torch.bfloat16, fresh=True, device="cuda", seed=2)[0], info, PREFILL, **TOL)
    assert used, "the call did not take the Gluon shrink"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_random_batch_info_on_the_gpu_is_the_reference(case):
    info, tokens, fresh, packed = case
    info = on_gpu(info)
    with poisoned_outputs(), packed_tiles(packed):
        for call in calls(tokens, torch.bfloat16, fresh=fresh, device="cuda"):
            check_call(call, info, tokens, **TOL)


@pytest.mark.parametrize("tokens", [S, PREFILL], ids=["decode", "prefill"])
def test_graph_captured_on_a_good_batch_replays_a_bad_one_as_the_reference(tokens, monkeypatch):
    """CUDA-graph buffers are rewritten in place between replays; nothing checks their values there."""
    n = 5
    good = [0, *(tokens * (g + 1) // n for g in range(n))]
    info = make_info(good, [0, 1, 3, 0, 1], [R, 3, 0, 5], [0.5, 2.0, INF, 0.25], device="cuda", tokens=tokens)
    shrink, expand = calls(tokens, torch.bfloat16, fresh=False, device="cuda", seed=3)[:2]

    def step():
        return shrink.run(info), expand.run(info)

    # Compiled and tuned outside the capture: the Gluon shrink (taken under capture at prefill size), then
    # the Triton kernels.
    monkeypatch.setattr(lora_triton, "GLUON_EAGER", True)
    step()
    monkeypatch.setattr(lora_triton, "GLUON_EAGER", False)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a_out, b_out = step()
    for name in ("indptr_decreases", "indptr_starts_above_0"):
        bad = PREFILL_BATCHES[name] if tokens == PREFILL else ALL_BATCHES[name]
        info.seg_indptr.copy_(torch.tensor(bad[0][: n + 1], dtype=torch.int32))
        info.weight_indices.copy_(torch.tensor([SLOTS, 1, 3, -1, 0], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for call, out in ((shrink, a_out), (expand, b_out)):
            ref64 = call.reference(info)
            assert torch.isfinite(out).all(), f"{name}, {call.name}: NaN or leftover memory"
            torch.testing.assert_close(out.double(), ref64, **TOL)


def test_strict_mode_reads_device_batch_info_once_and_reports_it():
    """Derive mode never reads device tensors (above); strict mode does, and reports what it reads."""
    info = bad_info("slots_out_of_range", device="cuda")
    with mode("strict"), pytest.raises(GuardError) as err:
        calls(S, torch.bfloat16, fresh=True, device="cuda")[0].run(info)
    assert err.value.code == "GL204" and "weight_indices" in err.value.argument


@pytest.mark.parametrize("case", list(OVERLAPPING))
def test_overlapping_base_output_on_the_gpu_is_gl205(case):
    x, w = rand(S, R, dtype=torch.bfloat16, device="cuda"), rand(SLOTS, N, R, dtype=torch.bfloat16, device="cuda")
    info = on_gpu(make_info([0, 9, 20, 40], [0, 3, 1], [R, 3, 0, 5], [0.5, 2.0, 1.0, 0.25]))
    with pytest.raises(GuardError) as err:
        sgemm_lora_b(x, w, info, OVERLAPPING[case](dtype=torch.bfloat16, device="cuda"))
    assert err.value.code == "GL205" and err.value.argument == "base_output"


def test_base_output_leaf_requiring_grad_on_the_gpu_is_gl205():
    x, w = rand(S, R, dtype=torch.bfloat16, device="cuda"), rand(SLOTS, N, R, dtype=torch.bfloat16, device="cuda")
    info = on_gpu(make_info([0, 9, 20, 40], [0, 3, 1], [R, 3, 0, 5], [0.5, 2.0, 1.0, 0.25]))
    base = torch.zeros(S, N, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    with pytest.raises(GuardError) as err:
        sgemm_lora_b(x, w, info, base)
    assert err.value.code == "GL205" and err.value.argument == "base_output"
