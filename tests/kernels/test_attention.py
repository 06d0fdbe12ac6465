"""varlen_attention / cudnn_vision_attention on the CPU: the Triton kernel through the interpreter and the
SDPA loop against a float64 reference, input validation (GL106), auto dispatch, and the cuDNN drop-in's
metadata (checked against hand-computed element offsets through an emulated cuDNN call).
"""
from __future__ import annotations

import json

import pytest
import torch

from guardlint.guard import GuardError, clear_cache, prepare_varlen_metadata, reset_stats, stats
from guardlint.kernels import cudnn_vision_attention, varlen_attention
from guardlint.kernels.attention import api as attention
from guardlint.kernels.attention import dispatch
from guardlint.kernels.attention import flashinfer as fi
from guardlint.kernels.attention import triton as triton_path
from guardlint.kernels.attention.reference import reference_varlen_attention, sdpa_varlen

# Per dtype: (atol, rtol) of the kernel against float64 on inputs already rounded to that dtype; the
# output rounding dominates (bfloat16 keeps 8 bits).
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def make_batch(lengths, heads=4, kv_heads=2, head_dim=64, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    total = offsets[-1]
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v, torch.tensor(offsets, dtype=torch.int32), offsets


def random_lengths(seed, count=5, longest=40):
    gen = torch.Generator().manual_seed(seed)
    lengths = [0, 1] + torch.randint(2, longest, (count - 2,), generator=gen).tolist()
    return [lengths[i] for i in torch.randperm(count, generator=gen).tolist()]


def assert_close_to_reference(out, q, k, v, offsets, causal, scale=None):
    scale = q.shape[2] ** -0.5 if scale is None else scale
    ref = reference_varlen_attention(q, k, v, offsets, scale, causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "a row was not written (NaN poison left) or is not finite"
    atol, rtol = TOLERANCE[q.dtype]
    err = (out.double() - ref).abs()
    bound = atol + rtol * ref.abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"max abs error {err.max().item():.3g} exceeds the {q.dtype} tolerance"


@pytest.fixture
def poisoned_output(monkeypatch):
    """Kernel outputs start as NaN, so any element the kernel fails to write fails the comparison."""
    monkeypatch.setattr(triton_path, "new_output", lambda q: torch.full_like(q, float("nan")))


# -- the Triton kernel through the interpreter ------------------------------------------------------

@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_attention_triton_matches_float64(head_dim, dtype, causal, poisoned_output):
    lengths = random_lengths(seed=head_dim + int(causal))
    q, k, v, cu, offsets = make_batch(lengths, head_dim=head_dim, dtype=dtype, seed=len(str(dtype)))
    out = varlen_attention(q, k, v, cu, causal=causal, backend="triton")
    assert_close_to_reference(out, q, k, v, offsets, causal)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(96, 4, 1), (240, 2, 2)])
def test_varlen_attention_triton_split_head_dims(head_dim, heads, kv_heads, poisoned_output):
    # 96 = 64 + 32 with 4:1 GQA; 240 = 128 + 64 + 32 + 16 exercises all four parts.
    q, k, v, cu, offsets = make_batch([19, 0, 33], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                      dtype=torch.bfloat16)
    out = varlen_attention(q, k, v, cu, causal=True, backend="triton", softmax_scale=0.05)
    assert_close_to_reference(out, q, k, v, offsets, True, scale=0.05)


def test_varlen_attention_triton_causal_with_taller_query_tiles(poisoned_output):
    # BLOCK_M = 2 * BLOCK_N: a query tile then spans two diagonal key tiles, both masked.
    q, k, v, cu, offsets = make_batch([45, 1, 32], head_dim=64)
    out = triton_path.varlen_attention_triton(q, k, v, cu, 45, 0.125, True, config=(32, 16, 4, 1))
    assert_close_to_reference(out, q, k, v, offsets, True, scale=0.125)


def test_varlen_attention_triton_only_empty_sequences():
    q, k, v, cu, _ = make_batch([0, 0, 0], head_dim=64)
    out = varlen_attention(q, k, v, cu, backend="triton")
    assert out.shape == (0, 4, 64)


def test_varlen_attention_triton_clamps_offsets_past_the_tokens(poisoned_output):
    # cu_seqlens claiming more tokens than q has: the kernel stays in bounds (the guard's strict mode
    # reports the metadata); rows that exist are still attended over what exists.
    q, k, v, _, _ = make_batch([10], head_dim=64)
    cu = torch.tensor([0, 25], dtype=torch.int32)
    out = triton_path.varlen_attention_triton(q, k, v, cu, 25, 0.125, False)
    assert_close_to_reference(out, q, k, v, [0, 10], False, scale=0.125)


@pytest.mark.parametrize("head_dim", range(16, 257, 16))
def test_head_dim_parts_are_powers_of_two_summing_to_the_head_dim(head_dim):
    parts = triton_path.head_dim_parts(head_dim)
    live = [p for p in parts if p]
    assert sum(live) == head_dim
    assert all(p >= 16 and p & (p - 1) == 0 for p in live)
    assert live == sorted(live, reverse=True) and len(set(live)) == len(live)


def test_triton_autotune_candidates_fit_hopper_shared_memory():
    for head_dim in range(16, 257, 16):
        for elem in (2, 4):
            configs = triton_path.configs_for(head_dim, elem)
            assert configs, (head_dim, elem)
            for cfg in configs:
                assert triton_path._shared_bytes(cfg, head_dim, elem) <= 227 * 1024


# -- the torch paths --------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_attention_sdpa_matches_float64(causal, dtype):
    q, k, v, cu, offsets = make_batch(random_lengths(seed=7, count=6, longest=64), heads=6, kv_heads=2,
                                      head_dim=80, dtype=dtype)
    out = varlen_attention(q, k, v, cu, causal=causal, backend="sdpa")
    assert_close_to_reference(out, q, k, v, offsets, causal)


def test_sdpa_varlen_leaves_uncovered_tokens_alone():
    q, k, v, _, _ = make_batch([6, 4], head_dim=64)
    out = sdpa_varlen(q, k, v, [0, 6], 0.125, False)
    assert torch.equal(out[6:], torch.zeros_like(out[6:]))


def test_varlen_attention_auto_on_cpu_picks_sdpa():
    q, k, v, cu, _ = make_batch([5, 0, 9], head_dim=80)
    assert attention.select_backend(q, k, cu, 9) == "sdpa"
    auto = varlen_attention(q, k, v, cu, backend="auto")
    assert torch.equal(auto, varlen_attention(q, k, v, cu, backend="sdpa"))


def test_varlen_attention_derives_metadata_once_and_accepts_a_prepared_plan():
    q, k, v, cu, offsets = make_batch([12, 0, 7, 30], head_dim=64)
    clear_cache()
    reset_stats()
    plan = prepare_varlen_metadata(cu, q)
    assert plan.max_seqlen == 30 and plan.host_cu_seqlens == tuple(offsets)
    assert stats()["host_reads"] == 1
    with_plan = varlen_attention(q, k, v, cu, metadata=plan, backend="sdpa")
    assert stats()["host_reads"] == 1 and stats()["derivations"] == {}   # the plan is taken as it is
    clear_cache()
    reset_stats()
    # Four layers of one forward, each without metadata: derived from cu_seqlens once, then from the cache.
    layers = [varlen_attention(q, k, v, cu, backend="sdpa") for _ in range(4)]
    s = stats()
    assert s["host_reads"] == 1 and s["cache_misses"] == 1, s
    assert s["derivations"] == {"diff": 4, "max_of_diff": 4} and len(s["events"]) == 2, s
    for derived in layers:
        assert torch.equal(with_plan, derived)


def test_varlen_attention_rejects_a_stale_plan():
    q, k, v, cu, _ = make_batch([12, 7], head_dim=64)
    other = prepare_varlen_metadata(torch.tensor([0, 5], dtype=torch.int32), q[:5])
    with pytest.raises(GuardError) as err:
        varlen_attention(q, k, v, cu, metadata=other, max_seqlen=12, sequence_lengths=other.sequence_lengths)
    # Prepared from other offsets: the message names both the metadata and the caller's cu_seqlens.
    assert err.value.code == "GL103" and err.value.argument == "cu_seqlens" and "metadata" in str(err.value)


# -- validation: GL106 names the argument, and nothing launches ------------------------------------

def _bad_inputs():
    q, k, v, cu, _ = make_batch([5, 7], head_dim=64)
    yield "q as (B, S, H, D)", dict(q=q.view(1, 12, 4, 64)), "q"
    yield "k of another dtype", dict(k=k.half()), "k"
    yield "v of another shape", dict(v=v[:, :1]), "v"
    yield "k with fewer tokens", dict(k=k[:5], v=v[:5]), "k"
    yield "head dim 72", dict(q=torch.randn(12, 4, 72), k=torch.randn(12, 2, 72), v=torch.randn(12, 2, 72)), "q"
    yield "3 kv heads for 4 heads", dict(k=torch.randn(12, 3, 64), v=torch.randn(12, 3, 64)), "k"
    yield "float64 inputs", dict(q=q.double(), k=k.double(), v=v.double()), "q"
    yield "float cu_seqlens", dict(cu_seqlens=cu.float()), "cu_seqlens"
    yield "cu_seqlens on another device", dict(cu_seqlens=cu.to("meta")), "cu_seqlens"
    yield "an unknown backend", dict(backend="flash"), "backend"
    yield "a NaN scale", dict(softmax_scale=float("nan")), "softmax_scale"
    yield "causal as a string", dict(causal="yes"), "causal"
    yield "FlashInfer on the CPU", dict(backend="flashinfer-fa3"), "backend"
    yield "torch varlen on the CPU", dict(backend="torch-varlen"), "backend"


@pytest.mark.parametrize("case,changes,argument", list(_bad_inputs()), ids=[c for c, _, _ in _bad_inputs()])
def test_varlen_attention_gl106_names_the_argument(case, changes, argument, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for invalid input")

    monkeypatch.setattr(triton_path, "varlen_attention_triton", no_launch)
    monkeypatch.setattr(attention.torch_paths, "sdpa_varlen", no_launch)
    q, k, v, cu, _ = make_batch([5, 7], head_dim=64)
    call = dict(q=q, k=k, v=v, cu_seqlens=cu, max_seqlen=7, sequence_lengths=cu[1:] - cu[:-1], backend="triton")
    call.update(changes)
    with pytest.raises(GuardError) as err:
        varlen_attention(call.pop("q"), call.pop("k"), call.pop("v"), call.pop("cu_seqlens"), **call)
    assert err.value.code == "GL106"
    assert err.value.argument == argument
    assert "GL106" in str(err.value) and argument in str(err.value)


def test_varlen_attention_rejects_a_float_max_seqlen():
    q, k, v, cu, _ = make_batch([5, 7], head_dim=64)
    with pytest.raises(GuardError) as err:
        varlen_attention(q, k, v, cu, max_seqlen=7.0, sequence_lengths=cu[1:] - cu[:-1])
    assert err.value.code == "GL103" and err.value.argument == "max_seqlen"


# -- auto: the dispatch table and its rule ----------------------------------------------------------

def _entry(head_dim, batch, max_seqlen, total, times, device="NVIDIA H200", dtype="bfloat16", causal=False):
    return dict(device=device, capability=[9, 0], head_dim=head_dim, dtype=dtype, causal=causal, batch=batch,
                max_seqlen=max_seqlen, total_tokens=total, times_us=times)


TABLE = [
    _entry(80, 6, 8192, 16448, {"triton": 1100.0, "sdpa": 1180.0, "torch-varlen": 1830.0}),
    _entry(80, 64, 256, 16384, {"triton": 140.0, "sdpa": 2900.0, "torch-varlen": 125.0}),
    _entry(128, 6, 8192, 16448, {"triton": 1250.0, "flashinfer-fa3": 1080.0, "sdpa": 1220.0}),
    _entry(128, 64, 256, 16384, {"triton": 150.0, "flashinfer-cudnn": 114.0, "flashinfer-fa2": 121.0}),
]


def _choose(head_dim, batch, max_seqlen, total, runnable=lambda name: True, **kw):
    args = dict(device_type="cuda", device_name="NVIDIA H200", capability=(9, 0), head_dim=head_dim,
                dtype="bfloat16", causal=False, batch=batch, max_seqlen=max_seqlen, total_tokens=total,
                runnable=runnable, entries=TABLE)
    args.update(kw)
    return dispatch.choose(**args)


def test_dispatch_picks_the_measured_best_for_a_benchmarked_case():
    assert _choose(80, 6, 8192, 16448) == "triton"
    assert _choose(80, 64, 256, 16384) == "torch-varlen"
    assert _choose(128, 6, 8192, 16448) == "flashinfer-fa3"
    assert _choose(128, 64, 256, 16384) == "flashinfer-cudnn"


def test_dispatch_nearest_case_by_head_dim_then_sequence_profile():
    # 96 is nearest to 80 (log2 distance 0.26 vs 0.42); 32 images of 300 tokens look like 64 x 256.
    assert _choose(96, 32, 300, 9600) == "torch-varlen"
    assert _choose(96, 2, 6000, 9000) == "triton"
    # 192 is nearest to 128; FA3 cannot run 192, so the next fastest runnable backend of that entry wins.
    assert _choose(192, 6, 8192, 16448, runnable=lambda n: n != "flashinfer-fa3") == "sdpa"


def test_dispatch_weighs_host_time_in_eager_calls_only():
    """A short batch bound by the host: in an eager call the backend whose launch costs more host time
    than its device time saves loses; under CUDA-graph capture (no host time per replay) device time rules."""
    entries = [_entry(128, 8, 256, 2048, {"triton": 17.0, "gluon": 12.0, "flashinfer-fa2": 16.0})]
    host = {"triton": 26.0, "gluon": 90.0, "flashinfer-fa2": 37.0}
    assert _choose(128, 8, 256, 2048, entries=entries, host=host, eager=False) == "gluon"
    assert _choose(128, 8, 256, 2048, entries=entries, host=host, eager=True) == "triton"
    # A long batch: the device time is larger than any host time, so eager calls keep the fastest kernel.
    entries = [_entry(128, 6, 8192, 16448, {"triton": 1250.0, "gluon": 900.0})]
    assert _choose(128, 6, 8192, 16448, entries=entries, host=host, eager=True) == "gluon"
    # Backends without a measured host time are ranked by their table time alone.
    assert _choose(128, 8, 256, 2048, entries=[_entry(128, 8, 256, 2048, {"sdpa": 20.0, "gluon": 12.0})],
                   host=host, eager=True) == "sdpa"


def test_dispatch_reads_host_times_from_the_table(tmp_path, monkeypatch):
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"version": dispatch.TABLE_VERSION, "entries": TABLE, "host_us": {
        "NVIDIA H200": {"triton": 25.0, "gluon": "slow", "sdpa": -1, "torch-varlen": float("inf")},
        "broken": [1, 2]}}))
    monkeypatch.setenv(dispatch.TABLE_ENV, str(table))
    dispatch.reset()
    try:
        assert dispatch.host_times("NVIDIA H200") == {"triton": 25.0}
        assert dispatch.host_times("NVIDIA A100") == {} and dispatch.host_times("broken") == {}
    finally:
        dispatch.reset()
    assert dispatch._host == {}


def test_auto_plans_eager_and_captured_calls_apart(monkeypatch):
    """The plan cache keys on whether the call is being captured into a CUDA graph: auto may choose
    differently there, and the choice made for one must not be reused for the other."""
    seen = []
    monkeypatch.setattr(attention, "_resolve", lambda *a, eager=True, verified=False: seen.append(eager) or "sdpa")
    monkeypatch.setattr(attention, "_calls", {})
    q, k, v, cu, offsets = make_batch([9, 0, 14], head_dim=80)
    outs = []
    for capturing in (False, True, False, True):
        monkeypatch.setattr(attention, "_capturing", lambda q, c=capturing: c)
        outs.append(varlen_attention(q, k, v, cu, max_seqlen=14, backend="auto"))
    assert seen == [True, False], "one plan per capture state, each made with its own eager flag"
    assert all(torch.equal(outs[0], o) for o in outs)
    # A named backend has no choice to make: capture state is not probed or keyed.
    monkeypatch.setattr(attention, "_capturing", lambda q: pytest.fail("probed for a named backend"))
    varlen_attention(q, k, v, cu, max_seqlen=14, backend="sdpa")


def test_dispatch_defaults_without_a_matching_table():
    assert _choose(80, 6, 8192, 16448, entries=[]) == "triton"
    assert _choose(80, 6, 8192, 16448, device_name="NVIDIA A100", capability=(8, 0)) == "triton"
    # Another Hopper part without its own entries uses the H200's (same capability major).
    assert _choose(128, 6, 8192, 16448, device_name="NVIDIA H100 80GB HBM3") == "flashinfer-fa3"
    assert _choose(80, 6, 8192, 16448, runnable=lambda n: False) == "triton"
    assert dispatch.choose(device_type="cpu", head_dim=80, dtype="float32", causal=False, batch=1,
                           max_seqlen=1, total_tokens=1, runnable=lambda n: True) == "sdpa"


def test_dispatch_table_loads_from_the_environment_and_ignores_bad_files(tmp_path, monkeypatch):
    good = tmp_path / "table.json"
    good.write_text(json.dumps({"version": dispatch.TABLE_VERSION, "entries": TABLE + [{"head_dim": "x"}]}))
    monkeypatch.setenv(dispatch.TABLE_ENV, str(good))
    dispatch.reset()
    try:
        assert len(dispatch.load_table()) == len(TABLE)
        bad = tmp_path / "bad.json"
        bad.write_text("{not json")
        monkeypatch.setenv(dispatch.TABLE_ENV, str(bad))
        assert dispatch.load_table() == []
        monkeypatch.setenv(dispatch.TABLE_ENV, str(tmp_path / "missing.json"))
        assert dispatch.load_table() == []
    finally:
        dispatch.reset()


def test_shipped_dispatch_table_comes_from_the_benchmark():
    if not dispatch.TABLE_PATH.exists():
        pytest.skip("no dispatch table shipped yet (bench/attention.py --write-dispatch writes it)")
    data = json.loads(dispatch.TABLE_PATH.read_text())
    assert data["version"] == dispatch.TABLE_VERSION and data["meta"].get("gpu")
    for entry in data["entries"]:
        assert dispatch._valid_entry(entry)
        assert set(entry["times_us"]) <= set(attention.CONCRETE)
    # Host times per eager call (bench/attention_eager.py): every one valid and for a backend that exists.
    assert dispatch._valid_host(data.get("host_us")) == data.get("host_us", {})
    for times in data.get("host_us", {}).values():
        assert set(times) <= set(attention.CONCRETE)


# -- per-call host work: checks and the backend choice once per call signature ---------------------

@pytest.fixture
def counted_planning(monkeypatch):
    """Counts input checks and backend resolutions, starting from an empty plan cache."""
    counts = {"checks": 0, "resolves": 0}
    real_check, real_resolve = attention._check_inputs, attention._resolve

    def check(*args):
        counts["checks"] += 1
        return real_check(*args)

    def resolve(*args, **kwargs):
        counts["resolves"] += 1
        return real_resolve(*args, **kwargs)

    monkeypatch.setattr(attention, "_check_inputs", check)
    monkeypatch.setattr(attention, "_resolve", resolve)
    dispatch.reset()
    yield counts
    dispatch.reset()


def test_varlen_attention_plans_once_per_call_signature(counted_planning):
    q, k, v, cu, offsets = make_batch([9, 0, 14], head_dim=80)
    plan = prepare_varlen_metadata(cu, q)
    first = varlen_attention(q, k, v, cu, metadata=plan, backend="auto")
    for _layer in range(3):
        assert torch.equal(varlen_attention(q, k, v, cu, metadata=plan, backend="auto"), first)
    # auto resolves its pick for eager calls and for calls under CUDA-graph capture once, together.
    assert counted_planning == {"checks": 1, "resolves": 2}
    assert_close_to_reference(first, q, k, v, offsets, False)
    # Anything the checks or the choice depend on makes a new plan: max_seqlen, scale, causal, backend.
    varlen_attention(q, k, v, cu, max_seqlen=20, sequence_lengths=plan.sequence_lengths, backend="auto")
    varlen_attention(q, k, v, cu, metadata=plan, softmax_scale=0.5, backend="auto")
    varlen_attention(q, k, v, cu, metadata=plan, causal=True, backend="auto")
    varlen_attention(q, k, v, cu, metadata=plan, backend="sdpa")
    assert counted_planning == {"checks": 5, "resolves": 9}


def test_varlen_attention_planned_signature_still_rejects_bad_arguments(counted_planning):
    q, k, v, cu, _ = make_batch([5, 7], head_dim=64)
    plan = prepare_varlen_metadata(cu, q)
    varlen_attention(q, k, v, cu, metadata=plan, softmax_scale=1.0, causal=True)
    lengths = plan.sequence_lengths
    bad = [
        (dict(metadata=plan, softmax_scale=1.0, causal=1), "GL106", "causal"),  # 1 == True, same hash
        (dict(metadata=plan, softmax_scale=True, causal=True), "GL106", "softmax_scale"),  # True == 1.0
        (dict(max_seqlen=7.0, sequence_lengths=lengths, softmax_scale=1.0, causal=True), "GL103", "max_seqlen"),
        (dict(metadata=plan, backend=["sdpa"]), "GL106", "backend"),
    ]
    for kwargs, code, argument in bad:
        with pytest.raises(GuardError) as err:
            varlen_attention(q, k, v, cu, **kwargs)
        assert (err.value.code, err.value.argument) == (code, argument), kwargs
    with pytest.raises(GuardError) as err:  # same shapes, another dtype: another signature
        varlen_attention(q, k.half(), v, cu, metadata=plan, softmax_scale=1.0, causal=True)
    assert err.value.argument == "k"


@pytest.mark.parametrize("captured_pick", ["sdpa", "triton"])
def test_auto_asks_whether_the_stream_is_capturing_only_where_the_picks_differ(monkeypatch, captured_pick):
    """auto's pick for an eager call and for one under CUDA-graph capture are planned together; a planned call
    queries the capture state (a driver call on CUDA) only when they differ, and then runs the right one."""
    ran, queries, capturing = [], [], [False]

    def resolve(backend, q, k, cu, max_seqlen, scale, causal, function, eager=True, verified=False):
        return "sdpa" if eager else captured_pick

    def runner(name, q, cu, function):
        return lambda q, *args: ran.append(name) or torch.zeros_like(q)

    monkeypatch.setattr(attention, "_resolve", resolve)
    monkeypatch.setattr(attention, "_runner", runner)
    monkeypatch.setattr(attention, "_capturing", lambda q: queries.append(1) or capturing[0])
    dispatch.reset()
    q, k, v, cu, _ = make_batch([5, 7], head_dim=64)
    for _ in range(3):
        varlen_attention(q, k, v, cu, backend="auto")
    capturing[0] = True
    varlen_attention(q, k, v, cu, backend="auto")
    differ = captured_pick != "sdpa"
    assert ran == ["sdpa"] * 3 + [captured_pick]
    # the first call asks once (it is not planning under capture); later ones only where the picks differ
    assert len(queries) == 1 + (3 if differ else 0)


def test_auto_first_seen_under_capture_plans_only_the_captured_call(monkeypatch):
    eagers = []

    def resolve(backend, q, k, cu, max_seqlen, scale, causal, function, eager=True, verified=False):
        eagers.append(eager)
        return "sdpa"

    monkeypatch.setattr(attention, "_resolve", resolve)
    monkeypatch.setattr(attention, "_capturing", lambda q: True)
    dispatch.reset()
    q, k, v, cu, _ = make_batch([5, 7], head_dim=64)
    varlen_attention(q, k, v, cu, backend="auto")
    assert eagers == [False] and not attention._calls  # nothing kept: an eager call plans both


def test_dispatch_reset_forgets_planned_calls():
    q, k, v, cu, _ = make_batch([5, 7], head_dim=64)
    varlen_attention(q, k, v, cu, backend="sdpa")
    assert attention._calls
    dispatch.reset()
    assert not attention._calls


def test_varlen_attention_triton_eager_calls_skip_the_custom_op(monkeypatch):
    q, k, v, cu, _ = make_batch([6, 11], heads=2, kv_heads=1, head_dim=80)
    via_op = torch.ops.guardlint.varlen_attention_triton(q, k, v, cu, 11, 80 ** -0.5, False)

    def dispatcher(*args):
        raise AssertionError("an eager call went through the op dispatcher")

    monkeypatch.setattr(attention, "varlen_attention_triton_op", dispatcher)
    eager = varlen_attention(q, k, v, cu, backend="triton")
    assert torch.equal(eager, via_op)


def test_triton_launcher_reuses_launch_settings_per_key(monkeypatch):
    q, k, v, cu, offsets = make_batch([21, 3], heads=2, kv_heads=2, head_dim=96)
    monkeypatch.setattr(triton_path, "_launches", {})
    monkeypatch.setattr(triton_path, "_rests", {})
    first = triton_path.varlen_attention_triton(q, k, v, cu, 21, 0.1, False)
    # Unequal lengths: visited longest first; no log-sum-exp output; a hint nothing verified (21 of 24 tokens):
    # a second launch for the tiles past it, with the first one's settings.
    key = (96, 1, False, 0, torch.float32, torch.int32, True, False)
    assert list(triton_path._launches) == [key] and list(triton_path._rests) == [key]
    block_m, kwargs, _ = triton_path._launches[key]
    assert (block_m, kwargs["BLOCK_N"], kwargs["D0"], kwargs["D1"]) == (16, 16, 64, 32)
    again = triton_path.varlen_attention_triton(q, k, v, cu, 21, 0.1, False)
    explicit = triton_path.varlen_attention_triton(q, k, v, cu, 21, 0.1, False, config=(16, 16, 4, 1))
    assert torch.equal(first, again) and torch.equal(first, explicit)
    assert_close_to_reference(first, q, k, v, offsets, False, scale=0.1)


def test_varlen_attention_triton_later_calls_launch_from_their_plan(monkeypatch, poisoned_output):
    q, k, v, cu, offsets = make_batch([33, 2, 17], heads=4, kv_heads=2, head_dim=80, dtype=torch.float16)
    dispatch.reset()  # a fresh signature: the first call plans, the second launches from the plan
    first = varlen_attention(q, k, v, cu, backend="triton", causal=True)
    real = triton_path.varlen_attention_triton

    def unplanned(*args, **kwargs):
        raise AssertionError("a planned call went through the unplanned launcher")

    monkeypatch.setattr(triton_path, "varlen_attention_triton", unplanned)
    second = varlen_attention(q, k, v, cu, backend="triton", causal=True)
    assert torch.equal(first, second)
    assert_close_to_reference(second, q, k, v, offsets, True)
    # Same shapes, strided last dim: the plan hands it to the launcher that copies.
    monkeypatch.setattr(triton_path, "varlen_attention_triton", real)
    wide = torch.stack([q, torch.zeros_like(q)], dim=-1).flatten(-2)
    strided = wide[..., ::2]
    assert strided.shape == q.shape and strided.stride(-1) == 2
    assert torch.equal(varlen_attention(strided, k, v, cu, backend="triton", causal=True), first)


def test_varlen_attention_rejects_max_seqlen_zero_with_tokens():
    q, k, v, cu, _ = make_batch([5, 7], head_dim=64)
    with pytest.raises(GuardError) as err:
        varlen_attention(q, k, v, cu, max_seqlen=0, sequence_lengths=cu[1:] - cu[:-1], backend="triton")
    assert (err.value.code, err.value.argument) == ("GL103", "max_seqlen")


def test_sequence_order_is_longest_first_and_kept_per_version(monkeypatch):
    monkeypatch.setattr(triton_path, "_orders", type(triton_path._orders)())
    cu = torch.tensor([0, 5, 5, 30, 37, 62], dtype=torch.int64)  # lengths 5, 0, 25, 7, 25
    order = triton_path.sequence_order(cu)
    assert order.tolist() == [2, 4, 3, 0, 1] and order.dtype == cu.dtype
    assert triton_path.sequence_order(cu) is order  # the next layer: no new device work
    cu[1] = 2  # changed in place (lengths 2, 3, 25, 7, 25): a new version, a new order
    assert triton_path.sequence_order(cu).tolist() == [2, 4, 3, 1, 0]


def test_varlen_attention_triton_equal_lengths_skip_the_order(monkeypatch, poisoned_output):
    def no_order(cu_seqlens):
        raise AssertionError("equal lengths need no order")

    monkeypatch.setattr(triton_path, "sequence_order", no_order)
    q, k, v, cu, offsets = make_batch([20, 20, 20], head_dim=80, dtype=torch.float16)
    out = varlen_attention(q, k, v, cu, backend="triton", causal=True)
    assert_close_to_reference(out, q, k, v, offsets, True)


def test_triton_kernel_clamps_a_corrupt_sequence_order(monkeypatch, poisoned_output):
    # Indices past the batch must never address outside cu_seqlens: they read the last sequence.
    corrupt = lambda cu: torch.full((cu.numel() - 1,), 99, dtype=cu.dtype)  # noqa: E731
    monkeypatch.setattr(triton_path, "sequence_order", corrupt)
    q, k, v, cu, offsets = make_batch([7, 19], head_dim=64)
    out = triton_path.varlen_attention_triton(q, k, v, cu, 19, 0.125, False)
    ref = reference_varlen_attention(q, k, v, offsets, 0.125, False)
    torch.testing.assert_close(out[7:].double(), ref[7:], atol=2e-5, rtol=2e-5)
    assert torch.isnan(out[:7]).all()  # the first sequence was never visited


def test_varlen_attention_triton_strided_head_dim(poisoned_output):
    # Every other element of a wider buffer: the launcher copies to unit stride before launching.
    q, k, v, cu, offsets = make_batch([13, 30], heads=2, kv_heads=2, head_dim=128)
    q, k, v = (t[..., ::2] for t in (q, k, v))
    assert q.stride(-1) == 2
    out = varlen_attention(q, k, v, cu, backend="triton")
    assert_close_to_reference(out, q, k, v, offsets, False)


# -- the op torch.compile sees ----------------------------------------------------------------------

def test_triton_custom_op_registration():
    q, k, v, cu, _ = make_batch([3, 5], heads=2, kv_heads=1, head_dim=16)
    torch.library.opcheck(torch.ops.guardlint.varlen_attention_triton.default, (q, k, v, cu, 5, 0.25, False),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("causal", [False, True])
def test_gluon_custom_op_registration_and_causal(causal):
    """The Gluon op's schema and fake take ``causal``; off a Hopper GPU the op runs the Triton kernel with the
    same flag (a causal call that came out non-causal would not match the reference)."""
    pytest.importorskip("triton.experimental.gluon")
    q, k, v, cu, offsets = make_batch([3, 5], heads=2, kv_heads=1, head_dim=16)
    op = torch.ops.guardlint.varlen_attention_gluon.default
    torch.library.opcheck(op, (q, k, v, cu, 5, 16 ** -0.5, causal), test_utils=("test_schema", "test_faketensor"))
    assert_close_to_reference(op(q, k, v, cu, 5, 16 ** -0.5, causal), q, k, v, offsets, causal)


def test_torch_compile_sees_one_attention_op():
    q, k, v, cu, offsets = make_batch([3, 5], heads=2, kv_heads=1, head_dim=16)
    lengths = cu[1:] - cu[:-1]
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def forward(q, k, v, cu, lengths):
        return varlen_attention(q, k, v, cu, sequence_lengths=lengths, max_seqlen=5, backend="triton") * 2

    torch._dynamo.reset()
    out = torch.compile(forward, backend=backend, fullgraph=True)(q, k, v, cu, lengths)
    assert sum("varlen_attention_triton" in name for name in seen) == 1
    assert_close_to_reference(out / 2, q, k, v, offsets, False)


# -- cudnn_vision_attention -------------------------------------------------------------------------

HEADS, HEAD_DIM = 12, 128  # 1536 elements per token, as in the engine's ViT
TOKEN_CU = [0, 480, 1200]
PADDED_OFFSETS = [0, 480 * 1536, 1200 * 1536] + [1200 * 1536] * 6  # batch bucket 8: six empty images
PADDED_LENGTHS = [480, 720, 0, 0, 0, 0, 0, 0]


@pytest.fixture(scope="module")
def vit_batch():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1200, HEADS, HEAD_DIM, generator=gen) for _ in range(3))
    return q, k, v


class EmulatedCudnn:
    """Stands in for FlashInfer's cuDNN prefill: computes attention from the *element* offsets it is
    given, so wrong offsets give wrong outputs, and records what it received."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, o_off, qk_off, lengths, max_seqlen, scale, causal, *, v_offsets=None):
        v_off = qk_off if v_offsets is None else v_offsets
        self.calls.append(dict(o=o_off.view(-1).tolist(), qk=qk_off.view(-1).tolist(), v=v_off.view(-1).tolist(),
                               lengths=lengths.tolist(), lengths_shape=tuple(lengths.shape), max_seqlen=max_seqlen))
        assert type(max_seqlen) is int and max_seqlen >= int(lengths.max())
        out = torch.full_like(q, float("nan"))
        width = q.shape[1] * q.shape[2]
        flat = (q.reshape(-1), k.reshape(-1), v.reshape(-1), out.view(-1))
        for b, n in enumerate(lengths.view(-1).tolist()):
            if n == 0:
                continue
            qs, ks, vs = (src[off[b]: off[b] + n * width].view(n, q.shape[1], q.shape[2])
                          for src, off in zip(flat[:3], (qk_off.view(-1), qk_off.view(-1), v_off.view(-1))))
            flat[3][o_off.view(-1)[b]: o_off.view(-1)[b] + n * width] = sdpa_varlen(
                qs, ks, vs, [0, n], scale, causal).reshape(-1)
        return out


@pytest.fixture
def emulated_cudnn(monkeypatch):
    fake = EmulatedCudnn()
    monkeypatch.setattr(fi, "cudnn_prefill", fake)
    real = attention._runnable
    monkeypatch.setattr(attention, "_runnable",
                        lambda name, *a: name == "flashinfer-cudnn" or real(name, *a))
    return fake


def test_cudnn_vision_attention_derives_the_engines_packed_metadata(vit_batch, emulated_cudnn):
    q, k, v = vit_batch
    cu = torch.tensor(TOKEN_CU, dtype=torch.int32)
    out = cudnn_vision_attention(q, k, v, cu, 1, 1200)
    (call,) = emulated_cudnn.calls
    assert call["qk"] == call["v"] == call["o"] == PADDED_OFFSETS
    assert call["lengths"] == [[[[n]]] for n in PADDED_LENGTHS] and call["lengths_shape"] == (8, 1, 1, 1)
    assert call["max_seqlen"] == 4096
    assert_close_to_reference(out, q, k, v, TOKEN_CU, False)


def test_cudnn_vision_attention_accepts_packed_indptrs(vit_batch, emulated_cudnn):
    q, k, v = vit_batch
    packed = torch.tensor(PADDED_OFFSETS * 3, dtype=torch.int32)
    lengths = torch.tensor(PADDED_LENGTHS, dtype=torch.int32).view(8, 1, 1, 1)
    out = cudnn_vision_attention(q, k, v, packed, 1, 1200, sequence_lengths=lengths, max_seqlen=4096)
    (call,) = emulated_cudnn.calls
    assert call["qk"] == PADDED_OFFSETS and call["max_seqlen"] == 4096
    expected = varlen_attention(q, k, v, torch.tensor(TOKEN_CU, dtype=torch.int32), backend="sdpa")
    torch.testing.assert_close(out, expected)


def test_cudnn_vision_attention_without_cudnn_matches_varlen_attention(vit_batch):
    # No FlashInfer here: the drop-in runs varlen_attention's auto choice on the same data, from token
    # offsets, from packed indptrs, and from prepared metadata alike.
    q, k, v = vit_batch
    cu = torch.tensor(TOKEN_CU, dtype=torch.int32)
    expected = varlen_attention(q, k, v, cu)
    packed = torch.tensor(PADDED_OFFSETS * 3, dtype=torch.int32)
    lengths = torch.tensor(PADDED_LENGTHS, dtype=torch.int32)
    plan = prepare_varlen_metadata(cu, q, layout="cudnn", bucket=True)
    for out in (cudnn_vision_attention(q, k, v, cu, 1, 1200),
                cudnn_vision_attention(q, k, v, packed, 1, 1200, sequence_lengths=lengths, max_seqlen=4096),
                cudnn_vision_attention(q, k, v, cu, 1, 1200, forward_metadata=plan)):
        torch.testing.assert_close(out, expected)


def test_cudnn_vision_attention_takes_the_engines_metadata_object(vit_batch):
    q, k, v = vit_batch

    class VisionAttentionMetadata:  # the engine's own object: packed indptrs, no host copy
        packed_indptrs = torch.tensor(PADDED_OFFSETS * 3, dtype=torch.int32)
        sequence_lengths = torch.tensor(PADDED_LENGTHS, dtype=torch.int32)
        flashinfer_max_seqlen = 4096

    out = cudnn_vision_attention(q, k, v, None, 1, 1200, forward_metadata=VisionAttentionMetadata())
    expected = varlen_attention(q, k, v, torch.tensor(TOKEN_CU, dtype=torch.int32), backend="sdpa")
    torch.testing.assert_close(out, expected)


def test_cudnn_vision_attention_restores_a_four_dim_layout(vit_batch):
    q, k, v = (t[:480] for t in vit_batch)
    cu = torch.tensor([0, 480], dtype=torch.int32)
    lengths = torch.tensor([480], dtype=torch.int32)
    out = cudnn_vision_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), cu, 1, 480,
                                 sequence_lengths=lengths, max_seqlen=480)
    assert out.shape == (1, 480, HEADS, HEAD_DIM)
    torch.testing.assert_close(out[0], varlen_attention(q, k, v, cu))


def test_cudnn_vision_attention_checks_bsz_seq_len_and_packed_size(vit_batch):
    q, k, v = vit_batch
    cu = torch.tensor(TOKEN_CU, dtype=torch.int32)
    with pytest.raises(GuardError) as err:
        cudnn_vision_attention(q, k, v, cu, 1, 720)  # fewer tokens than q has
    assert err.value.code == "GL106" and err.value.argument == "seq_len"
    with pytest.raises(GuardError) as err:
        cudnn_vision_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), cu, 2, 600,
                               sequence_lengths=cu[1:] - cu[:-1], max_seqlen=720)
    assert err.value.code == "GL106" and err.value.argument == "bsz"
    lengths = torch.tensor(PADDED_LENGTHS, dtype=torch.int32)
    with pytest.raises(GuardError) as err:
        cudnn_vision_attention(q, k, v, torch.arange(12, dtype=torch.int32), 1, 1200, sequence_lengths=lengths,
                               max_seqlen=4096)
    assert err.value.code == "GL107" and err.value.argument == "cu_seqlens"


def test_cudnn_vision_attention_rejects_a_plan_for_other_shapes(vit_batch):
    q, k, v = vit_batch
    cu = torch.tensor(TOKEN_CU, dtype=torch.int32)
    plan = prepare_varlen_metadata(cu, q[:, :6], layout="cudnn")  # built for 6 heads, not 12
    with pytest.raises(GuardError) as err:
        cudnn_vision_attention(q, k, v, cu, 1, 1200, forward_metadata=plan)
    assert err.value.code == "GL107" and err.value.argument == "forward_metadata"


# -- FlashInfer call contracts, against stand-ins with FlashInfer 0.7's signatures ------------------

class FakeRaggedWrapper:
    """``BatchPrefillWithRaggedKVCacheWrapper``'s constructor, ``plan`` and ``run`` signatures; ``run``
    computes attention from the *planned* indptr, so a wrong plan gives a wrong answer."""

    plans = []

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None,
                 jit_kwargs=None):
        assert kv_layout == "NHD" and backend in ("fa2", "fa3")
        self.backend = backend

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
             rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True,
             prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None,
             fixed_split_size=None, disable_split_kv=False):
        assert qo_indptr.device.type == "cpu" and qo_indptr.dtype == torch.int32
        self.indptr, self.heads = qo_indptr.tolist(), (num_qo_heads, num_kv_heads)
        self.causal, self.scale = causal, sm_scale
        FakeRaggedWrapper.plans.append((self.backend, tuple(self.indptr), num_qo_heads, num_kv_heads, head_dim_qk,
                                        q_data_type, kv_data_type))

    def run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, o_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None):
        assert (q.shape[1], k.shape[1]) == self.heads
        return sdpa_varlen(q, k, v, self.indptr, self.scale, self.causal)


class FakeFlashInfer:
    BatchPrefillWithRaggedKVCacheWrapper = FakeRaggedWrapper


def test_flashinfer_ragged_plans_once_per_layout_and_drops_empty_sequences(monkeypatch):
    monkeypatch.setattr(fi, "_module", FakeFlashInfer)
    monkeypatch.setattr(fi, "_plans", type(fi._plans)())
    monkeypatch.setattr(fi, "_by_identity", type(fi._by_identity)())
    FakeRaggedWrapper.plans = []
    q, k, v, cu, offsets = make_batch([7, 0, 12, 0], heads=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    plan = prepare_varlen_metadata(cu, q)
    for _layer in range(4):
        out = fi.ragged(q, k, v, plan.host_cu_seqlens, 0.125, True, "fa3")
    assert FakeRaggedWrapper.plans == [("fa3", (0, 7, 19), 4, 2, 64, torch.bfloat16, torch.bfloat16)]
    assert_close_to_reference(out, q, k, v, offsets, True, scale=0.125)
    fi.ragged(q, k, v, tuple(offsets), 0.125, True, "fa3")  # equal offsets, another object: same plan
    fi.ragged(q, k, v, plan.host_cu_seqlens, 0.125, False, "fa3")  # another mask: a new plan
    assert len(FakeRaggedWrapper.plans) == 2


def test_flashinfer_cudnn_call_matches_its_signature(monkeypatch):
    seen = {}

    def cudnn_batch_prefill_with_kv_cache(q, k_cache, v_cache, scale, workspace_buffer, *, max_token_per_sequence,
                                          max_sequence_kv, actual_seq_lens_q, actual_seq_lens_kv, block_tables=None,
                                          causal, return_lse, batch_offsets_q=None, batch_offsets_o=None,
                                          batch_offsets_k=None, batch_offsets_v=None, batch_offsets_stats=None,
                                          out=None, lse=None, is_cuda_graph_compatible=False, backend=None):
        seen.update(max_token_per_sequence=max_token_per_sequence, lengths=actual_seq_lens_q.shape,
                    q_off=batch_offsets_q.view(-1).tolist(), k_off=batch_offsets_k.view(-1).tolist(), causal=causal)
        return torch.zeros_like(q), None

    class FakeCudnn:
        pass

    FakeCudnn.cudnn_batch_prefill_with_kv_cache = staticmethod(cudnn_batch_prefill_with_kv_cache)
    monkeypatch.setattr(fi, "_module", FakeCudnn)
    monkeypatch.setattr(fi, "_workspace", lambda device, purpose: torch.empty(0, dtype=torch.uint8))
    q, k, v, cu, _ = make_batch([3, 5], heads=4, kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    qo, kv, lengths = fi.cudnn_offsets(q, k, cu, cu[1:] - cu[:-1])
    out = fi.cudnn_prefill(q, k, v, qo, kv, lengths, 5, 0.1, False)
    assert out.shape == q.shape
    assert seen == dict(max_token_per_sequence=5, lengths=(2, 1, 1, 1), q_off=[0, 3 * 512, 8 * 512],
                        k_off=[0, 3 * 256, 8 * 256], causal=False)


def test_gluon_backend_resolution_traces_under_torch_compile():
    """Resolving the Gluon backend imports its module lazily; under torch.compile(fullgraph=True) that
    runs once at trace time instead of being traced (Dynamo cannot trace an import)."""
    from guardlint.kernels.attention import api as attention_module

    q = torch.randn(10, 2, 128)
    expected = attention_module._runnable("gluon", q, q, 1.0, False)
    torch._dynamo.reset()
    f = torch.compile(lambda q: q + attention_module._runnable("gluon", q, q, 1.0, False), fullgraph=True,
                      backend="eager")
    torch.testing.assert_close(f(q), q + expected)
    torch._dynamo.reset()
