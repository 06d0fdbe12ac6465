"""LoRA GEMM kernels through the Triton interpreter against their torch references and float64.

Layouts hit the edge cases (empty and one-token segments, rank-0 slots, mixed ranks, permutation,
CUDA-graph buffers with a stale tail); fresh outputs are NaN-poisoned so an unwritten element fails.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from guardlint.guard import mode
from guardlint.kernels.lora import api as lora
from guardlint.kernels.lora import (LoRABatchInfo, qkv_lora_b, qkv_lora_b_reference, sgemm_lora_a,
                                    sgemm_lora_a_reference, sgemm_lora_b, sgemm_lora_b_reference, step_a_q,
                                    step_a_q_reference, step_a_v, step_a_v_reference, step_b_q,
                                    step_b_q_reference, step_b_v, step_b_v_reference)

# Interpreter-sized problems: S <= 64, K/N <= 64, R <= 16.
SLOTS = 4
# name -> (segment lengths, slot per segment, extra kwargs)
LAYOUTS = {
    # empty and one-token segments, a rank-0 slot (2), mixed ranks
    "mixed": ([5, 0, 1, 17, 7, 1], [0, 1, 2, 1, 0, 3], {}),
    "permuted": ([5, 0, 1, 17, 7, 1], [0, 1, 2, 1, 0, 3], {"permute": True}),
    # CUDA-graph buffers: stale entries past num_segments, rows no live segment covers
    "graph_padded": ([9, 1, 0, 6], [3, 0, 1, 2], {"pad": 3, "extra_rows": 5}),
    "graph_padded_permuted": ([9, 1, 0, 6], [3, 0, 1, 2], {"pad": 3, "extra_rows": 5, "permute": True}),
    "decode": ([1] * 9, [0, 3, 1, 2, 3, 0, 0, 1, 3], {}),
    "random": None,
}


def random_layout(seed: int):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(3, 8, (1,), generator=g))
    choices = torch.tensor([0, 1, 1, 2, 3, 7, 16, 19, 20])
    lens = choices[torch.randint(0, len(choices), (n,), generator=g)].tolist()
    slots = torch.randint(0, SLOTS, (n,), generator=g).tolist()
    return lens, slots, {"permute": bool(seed % 2), "pad": seed % 3, "extra_rows": seed % 4}


def ranks_for(R: int) -> list:
    """Per-slot ranks: full, small, none, odd."""
    return [R, 3, 0, R // 2 + 1]


def make_batch(lens, slots, R: int, *, permute=False, pad=0, extra_rows=0, seed=0, max_len="exact"):
    """LoRABatchInfo for these segments; returns (info, S). Stale buffer entries are garbage that would
    address far outside x if a kernel read them."""
    g = torch.Generator().manual_seed(seed + 1)
    indptr = [0] + list(itertools.accumulate(lens))
    S = indptr[-1] + extra_rows
    stale_indptr = [10 ** 6, -7, 3][:pad]
    stale_slots = [99, -1, 10 ** 5][:pad]
    info = LoRABatchInfo(
        use_cuda_graph=pad > 0, bs=len(lens) + pad, num_segments=len(lens),
        seg_indptr=torch.tensor(indptr + stale_indptr, dtype=torch.int32),
        weight_indices=torch.tensor(slots + stale_slots, dtype=torch.int32),
        lora_ranks=torch.tensor(ranks_for(R), dtype=torch.int32),
        scalings=torch.tensor([0.5, 2.0, 1.0, 0.25], dtype=torch.float32),
        max_len=max(lens, default=0) if max_len == "exact" else max_len,
        permutation=torch.randperm(S, generator=g).to(torch.int32) if permute else None)
    return info, S


def layout(name: str, R: int, seed: int = 0, **overrides):
    spec = random_layout(seed) if name == "random" else LAYOUTS[name]
    lens, slots, kw = spec
    kw = {**kw, **overrides}
    return make_batch(lens, slots, R, seed=seed, **kw)


# (rtol, atol) against the torch reference in the same dtype, and against float64. The interpreter rounds
# float32 -> bfloat16 by truncation (the GPU rounds to nearest), hence two ulps for bfloat16.
TOL = {
    torch.float32: ((1e-5, 1e-5), (1e-5, 1e-4)),
    torch.float16: ((2e-3, 4e-3), (2e-3, 2e-2)),
    torch.bfloat16: ((1.6e-2, 3e-2), (1.6e-2, 1e-1)),
}
DTYPES = list(TOL)


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def check(out: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite elements"
    (rt, at), (rt64, at64) = TOL[out.dtype]
    torch.testing.assert_close(out, ref, rtol=rt, atol=at)
    torch.testing.assert_close(out.double(), ref64, rtol=rt64, atol=at64)


def nan_like(shape, dtype, device):
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Fresh outputs start as NaN: the kernels must write every element."""
    monkeypatch.setattr(lora, "_new_output", nan_like)


@pytest.fixture(params=["segment-tiles", "packed-tiles"])
def expand_tiles(request, monkeypatch):
    """Expand token tiles hold one segment's rows (prefill batches) or consecutive rows across segments and
    adapters (packed, decode batches); both are forced here, whatever the layout's shape."""
    monkeypatch.setattr(lora._k, "_PACKED_FROM_CLASS", 0 if request.param == "packed-tiles" else 99)
    return request.param


LAYOUT_NAMES = list(LAYOUTS)
# Every layout in bfloat16 (the dtype the interpreter gets wrong without upcasting), and each other
# dtype on layouts with and without permutation and padding: the full product costs 2x the time.
CASES = [(name, torch.bfloat16) for name in LAYOUT_NAMES] + [
    ("mixed", torch.float32), ("graph_padded_permuted", torch.float32), ("permuted", torch.float16),
    ("random", torch.float16)]
# Fresh (not accumulated) expand outputs: the tail column must zero-fill uncovered rows.
FRESH_CASES = [("mixed", torch.bfloat16), ("graph_padded_permuted", torch.bfloat16), ("random", torch.float32)]
EXPAND_CASES = [(name, dtype, False) for name, dtype in CASES] + [(name, dtype, True) for name, dtype in FRESH_CASES]


def ids(case):
    name, dtype, *fresh = case
    return f"{name}-{str(dtype).split('.')[-1]}" + ("-fresh" if fresh and fresh[0] else "")


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_sgemm_lora_a_matches_reference(case):
    name, dtype = case
    # Alternate a plain stack (R=16, one column block) and a q/k/v stack (3 x R=8, two column blocks).
    stack_num, R = (3, 8) if LAYOUT_NAMES.index(name) % 2 else (1, 16)
    info, S = layout(name, R, seed=LAYOUT_NAMES.index(name))
    x = rand(S, 40, dtype=dtype, seed=1)
    w = rand(SLOTS, stack_num * R, 40, dtype=dtype, seed=2)
    out = sgemm_lora_a(x, w, info, stack_num)
    check(out, sgemm_lora_a_reference(x, w, info, stack_num), sgemm_lora_a_reference(x.double(), w.double(), info,
                                                                                       stack_num))


def untouched_rows(info, S):
    """Rows an accumulating expand must leave alone: segments whose slot has rank 0, and rows no live
    segment covers (sorted positions past seg_indptr[num_segments])."""
    n = info.num_segments
    indptr = info.seg_indptr[: n + 1].tolist()
    ranks = info.lora_ranks.tolist()
    positions = list(range(indptr[-1], S))
    for g in range(n):
        if ranks[info.weight_indices[g]] == 0:
            positions += range(indptr[g], indptr[g + 1])
    pos = torch.tensor(positions, dtype=torch.long)
    return info.permutation[pos].long() if info.permutation is not None else pos


@pytest.mark.parametrize("case", EXPAND_CASES, ids=ids)
def test_sgemm_lora_b_matches_reference(case, expand_tiles):
    name, dtype, fresh = case
    R, N = 16, 40
    info, S = layout(name, R, seed=10 + LAYOUT_NAMES.index(name))
    x = rand(S, R, dtype=dtype, seed=11)
    w = rand(SLOTS, N, R, dtype=dtype, seed=12)
    if fresh:
        out = sgemm_lora_b(x, w, info)
        ref, ref64 = sgemm_lora_b_reference(x, w, info), sgemm_lora_b_reference(x.double(), w.double(), info)
    else:
        # A strided base (a column slice of a wider buffer) is updated in place.
        wide = rand(S, N + 8, dtype=dtype, seed=13)
        base = wide[:, 4: 4 + N]
        before = base.clone()
        out = sgemm_lora_b(x, w, info, base)
        assert out is base
        ref = sgemm_lora_b_reference(x, w, info, before.clone())
        ref64 = sgemm_lora_b_reference(x.double(), w.double(), info, before.double())
        untouched = untouched_rows(info, S)
        assert len(untouched) > 0
        assert torch.equal(out[untouched], before[untouched])
        assert torch.equal(wide[:, :4], rand(S, N + 8, dtype=dtype, seed=13)[:, :4])
    check(out, ref, ref64)


@pytest.mark.parametrize("chunks", [1, 2], ids=["one-chunk", "two-chunks"])
def test_sgemm_lora_b_ignores_nan_past_each_slots_rank(chunks, expand_tiles, monkeypatch):
    """Stored rank columns past a slot's rank may hold anything: NaN there in x and W must not reach the
    output, for slots below the stored rank (their W tiles are selected) and at it (taken as loaded)."""
    monkeypatch.setattr(lora._k._expand, "chosen", {})
    if chunks == 2:
        monkeypatch.setattr(lora._k, "_EXPAND_MAX_BLOCK_K", 16)
    dtype, R, N = torch.bfloat16, 32, 24
    info, S = layout("mixed", R, seed=5)
    ranks = info.lora_ranks.tolist()
    assert R in ranks and any(0 < r < R for r in ranks)
    x = rand(S, R, dtype=dtype, seed=51)
    w = rand(SLOTS, N, R, dtype=dtype, seed=52)
    slot_of_row = torch.full((S,), -1, dtype=torch.long)
    indptr = info.seg_indptr.tolist()
    for g in range(info.num_segments):
        slot_of_row[indptr[g]: indptr[g + 1]] = int(info.weight_indices[g])
    rows = info.permutation.long() if info.permutation is not None else torch.arange(S)
    for slot, r in enumerate(ranks):
        w[slot, :, r:] = float("nan")
        x[rows[slot_of_row == slot], r:] = float("nan")
    base = rand(S, N, dtype=dtype, seed=53)
    ref64 = sgemm_lora_b_reference(x.double(), w.double(), info, base.double())
    ref = sgemm_lora_b_reference(x, w, info, base.clone())
    out = sgemm_lora_b(x, w, info, base)
    check(out, ref, ref64)


@pytest.mark.parametrize("offsets", ["host", "device"])
@pytest.mark.parametrize("fresh", [False, True], ids=["accumulate", "fresh"])
@pytest.mark.parametrize("name", ["graph_padded_permuted", "random"])
def test_qkv_lora_b_matches_reference(name, fresh, offsets, expand_tiles):
    dtype = torch.bfloat16
    R, n_q, n_kv = 8, 24, 12
    starts = [0, n_q, n_q + n_kv, n_q + 2 * n_kv]
    output_offset = starts if offsets == "host" else torch.tensor(starts, dtype=torch.int32)
    info, S = layout(name, R, seed=20)
    x = rand(S, 3 * R, dtype=dtype, seed=21)
    w = rand(SLOTS, starts[-1], R, dtype=dtype, seed=22)
    base = None if fresh else rand(S, starts[-1], dtype=dtype, seed=23)
    out = qkv_lora_b(x, w, info, output_offset, None if base is None else base.clone())
    ref = qkv_lora_b_reference(x, w, info, starts, None if base is None else base.clone())
    ref64 = qkv_lora_b_reference(x.double(), w.double(), info, starts, None if base is None else base.double())
    check(out, ref, ref64)


@pytest.mark.parametrize("fresh", [False, True], ids=["accumulate", "fresh"])
def test_sgemm_lora_b_rank_in_chunks(fresh, monkeypatch, expand_tiles):
    """Stored ranks above the largest dot operand go in chunks (128 on the GPU; 16 here, so R = 32 is two,
    and the slot of rank 17 ends inside the second)."""
    monkeypatch.setattr(lora._k, "_EXPAND_MAX_BLOCK_K", 16)
    monkeypatch.setattr(lora._k._expand, "chosen", {})
    R, N = 32, 40
    info, S = layout("graph_padded_permuted", R, seed=14)
    x, w = rand(S, R, dtype=torch.bfloat16, seed=15), rand(SLOTS, N, R, dtype=torch.bfloat16, seed=16)
    base = None if fresh else rand(S, N, dtype=torch.bfloat16, seed=17)
    out = sgemm_lora_b(x, w, info, None if fresh else base.clone())
    check(out, sgemm_lora_b_reference(x, w, info, None if fresh else base.clone()),
          sgemm_lora_b_reference(x.double(), w.double(), info, None if fresh else base.double()))


@pytest.mark.parametrize("n_kv", [16, 12], ids=["slices-on-multiples-of-8", "slices-off-multiples-of-8"])
@pytest.mark.parametrize("offsets", ["host", "device"])
def test_qkv_lora_b_slice_alignment(offsets, n_kv, expand_tiles):
    """Slice edges on multiples of 8 take the kernels' 16-byte path (decided on the host for host offsets,
    in the kernel for device ones); both paths are the reference."""
    R, n_q = 8, 24
    starts = [0, n_q, n_q + n_kv, n_q + 2 * n_kv]
    info, S = layout("permuted", R, seed=26)
    x = rand(S, 3 * R, dtype=torch.bfloat16, seed=27)
    w = rand(SLOTS, starts[-1], R, dtype=torch.bfloat16, seed=28)
    base = rand(S, starts[-1], dtype=torch.bfloat16, seed=29)
    out = qkv_lora_b(x, w, info, starts if offsets == "host" else torch.tensor(starts), base.clone())
    check(out, qkv_lora_b_reference(x, w, info, starts, base.clone()),
          qkv_lora_b_reference(x.double(), w.double(), info, starts, base.double()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_qkv_lora_b_slices_are_the_sgemm_lora_b_of_each_projection(dtype):
    R, n_q, n_kv = 8, 24, 12
    info, S = layout("mixed", R)
    x = rand(S, 3 * R, dtype=dtype, seed=24)
    w = rand(SLOTS, n_q + 2 * n_kv, R, dtype=dtype, seed=25)
    out = qkv_lora_b(x, w, info, (0, n_q, n_q + n_kv, n_q + 2 * n_kv))
    cols = [(0, n_q), (n_q, n_q + n_kv), (n_q + n_kv, n_q + 2 * n_kv)]
    for i, (lo, hi) in enumerate(cols):
        part = sgemm_lora_b(x[:, i * R:(i + 1) * R].contiguous(), w[:, lo:hi].contiguous(), info)
        torch.testing.assert_close(out[:, lo:hi], part, rtol=0, atol=0)


# MLA sizes: H heads, qk_nope, v_head, kv_lora_rank, stored rank R.
H, QK_NOPE, V_HEAD, KV_RANK, R_MLA = 3, 20, 12, 24, 8
MLA = dict(qk_nope_head_dim=QK_NOPE, v_head_dim=V_HEAD)


def mla_weights(dtype):
    lora_a = rand(SLOTS, R_MLA, KV_RANK, dtype=dtype, seed=31)
    lora_b = rand(SLOTS, H * (QK_NOPE + V_HEAD), R_MLA, dtype=dtype, seed=32)
    return lora_a, lora_b


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_step_a_q_matches_reference(case):
    name, dtype = case
    info, S = layout(name, R_MLA, seed=40 + LAYOUT_NAMES.index(name))
    _, lora_b = mla_weights(dtype)
    # q_nope is a strided slice of q (the rope part follows it in each head).
    q_nope = rand(S, H, QK_NOPE + 6, dtype=dtype, seed=41)[:, :, :QK_NOPE]
    out = step_a_q(q_nope, lora_b, info, **MLA)
    check(out, step_a_q_reference(q_nope, lora_b, info, **MLA),
          step_a_q_reference(q_nope.double(), lora_b.double(), info, **MLA))


@pytest.mark.parametrize("case", EXPAND_CASES, ids=ids)
def test_step_b_q_matches_reference(case, expand_tiles):
    name, dtype, fresh = case
    info, S = layout(name, R_MLA, seed=50 + LAYOUT_NAMES.index(name))
    lora_a, _ = mla_weights(dtype)
    y = rand(S, H, R_MLA, dtype=dtype, seed=51)
    base = None if fresh else rand(S, H, KV_RANK, dtype=dtype, seed=52)
    out = step_b_q(y, lora_a, info, None if base is None else base.clone())
    check(out, step_b_q_reference(y, lora_a, info, None if base is None else base.clone()),
          step_b_q_reference(y.double(), lora_a.double(), info, None if base is None else base.double()))


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_step_a_v_matches_reference(case):
    name, dtype = case
    info, S = layout(name, R_MLA, seed=60 + LAYOUT_NAMES.index(name))
    lora_a, _ = mla_weights(dtype)
    latent = rand(S, H, KV_RANK, dtype=dtype, seed=61)
    out = step_a_v(latent, lora_a, info)
    check(out, step_a_v_reference(latent, lora_a, info), step_a_v_reference(latent.double(), lora_a.double(), info))


@pytest.mark.parametrize("case", EXPAND_CASES, ids=ids)
def test_step_b_v_matches_reference(case, expand_tiles):
    name, dtype, fresh = case
    info, S = layout(name, R_MLA, seed=70 + LAYOUT_NAMES.index(name))
    _, lora_b = mla_weights(dtype)
    y = rand(S, H, R_MLA, dtype=dtype, seed=71)
    base = None if fresh else rand(S, H, V_HEAD, dtype=dtype, seed=72)
    out = step_b_v(y, lora_b, info, None if base is None else base.clone(), **MLA)
    check(out, step_b_v_reference(y, lora_b, info, None if base is None else base.clone(), **MLA),
          step_b_v_reference(y.double(), lora_b.double(), info, None if base is None else base.double(), **MLA))


def test_mla_steps_compose_to_the_lora_of_kv_b_proj():
    """A_q then B_q is q_nope through the k_nope rows of scaling * B @ A, head by head; same for v."""
    info, S = layout("mixed", R_MLA, permute=True)
    lora_a, lora_b = mla_weights(torch.float32)
    q_nope = rand(S, H, QK_NOPE, dtype=torch.float32, seed=90)
    latent = rand(S, H, KV_RANK, dtype=torch.float32, seed=91)
    q_latent = step_b_q(step_a_q(q_nope, lora_b, info, **MLA), lora_a, info)
    v_out = step_b_v(step_a_v(latent, lora_a, info), lora_b, info, **MLA)
    expect_q, expect_v = torch.zeros_like(q_latent), torch.zeros_like(v_out)
    indptr = info.seg_indptr.tolist()
    for g in range(info.num_segments):
        slot = int(info.weight_indices[g])
        r, scaling = int(info.lora_ranks[slot]), float(info.scalings[slot])
        rows = info.permutation[indptr[g]: indptr[g + 1]].long()
        delta_w = scaling * lora_b[slot, :, :r].double() @ lora_a[slot, :r].double()  # (H*(qk+v), kv_rank)
        per_head = delta_w.reshape(H, QK_NOPE + V_HEAD, KV_RANK)
        expect_q[rows] = torch.einsum("thk,hkc->thc", q_nope[rows].double(), per_head[:, :QK_NOPE]).float()
        expect_v[rows] = torch.einsum("thc,hvc->thv", latent[rows].double(), per_head[:, QK_NOPE:]).float()
    torch.testing.assert_close(q_latent, expect_q, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(v_out, expect_v, rtol=1e-5, atol=1e-4)


def row_by_row(fn: str, x, w, info):
    """The LoRA GEMMs written out token by token in float64, from the layout alone (no code shared with
    the references): a token of segment g (rows in permutation order) gets, for slot s = weight_indices[g]
    and rank r = lora_ranks[s], shrink ``x[t] @ A[s, :r].T`` in columns ``:r``, or expand
    ``scalings[s] * x[t, :r] @ B[s][:, :r].T``; rows of no live segment stay 0."""
    indptr, slots = info.seg_indptr.tolist(), info.weight_indices.tolist()
    order = info.permutation.tolist() if info.permutation is not None else list(range(x.shape[0]))
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    for g in range(info.num_segments):
        s = slots[g]
        r, scaling = int(info.lora_ranks[s]), float(info.scalings[s])
        for pos in range(indptr[g], indptr[g + 1]):
            t = order[pos]
            for col in range(w.shape[1]):
                if fn == "sgemm_lora_a":
                    if col < r:
                        out[t, col] = sum(float(x[t, i]) * float(w[s, col, i]) for i in range(x.shape[1]))
                else:
                    out[t, col] = scaling * sum(float(x[t, i]) * float(w[s, col, i]) for i in range(r))
    return out


@pytest.mark.parametrize("fn", ["sgemm_lora_a", "sgemm_lora_b"])
def test_torch_backend_is_the_reference(fn):
    info, S = layout("permuted", 16)
    if fn == "sgemm_lora_a":
        x, w = rand(S, 40, dtype=torch.float32, seed=1), rand(SLOTS, 16, 40, dtype=torch.float32, seed=2)
        got, ref = sgemm_lora_a(x, w, info, backend="torch"), sgemm_lora_a_reference(x, w, info)
    else:
        x, w = rand(S, 16, dtype=torch.float32, seed=1), rand(SLOTS, 40, 16, dtype=torch.float32, seed=2)
        got, ref = sgemm_lora_b(x, w, info, backend="torch"), sgemm_lora_b_reference(x, w, info)
    # backend="torch" runs the reference, and the reference is the definition written out row by row
    assert torch.equal(got, ref)
    torch.testing.assert_close(ref.double(), row_by_row(fn, x, w, info), rtol=1e-5, atol=1e-5)
    check(getattr(lora, fn)(x, w, info, backend="triton"), ref, ref.double())


@pytest.mark.parametrize("split", [3, 4])
@pytest.mark.parametrize("name", ["mixed", "graph_padded_permuted", "decode"])
def test_shrink_split_k_matches_reference(name, split, monkeypatch):
    """K reduced by ``split`` programs per tile, float32 partials summed by the last to arrive: 40 columns in
    16-wide steps make slices of 16, 16 and 8 (and an empty fourth at 4). The second call launches from the
    recorded options with freshly zeroed counters."""
    monkeypatch.setattr(lora._k._shrink, "interpret_blocks", {"BLOCK_S": 16, "BLOCK_K": 16, "SPLIT_K": split})
    monkeypatch.setattr(lora._k._shrink, "chosen", {})
    info, S = layout(name, 16, seed=3)
    x, w = rand(S, 40, dtype=torch.float32, seed=1), rand(SLOTS, 16, 40, dtype=torch.float32, seed=2)
    for _ in range(2):
        check(sgemm_lora_a(x, w, info), sgemm_lora_a_reference(x, w, info),
              sgemm_lora_a_reference(x.double(), w.double(), info))
    # Heads on grid axis 1: each (head, tile) has its own partials and counter.
    info, S = layout(name, R_MLA, seed=3)
    lora_a, _ = mla_weights(torch.bfloat16)
    latent = rand(S, H, KV_RANK, dtype=torch.bfloat16, seed=61)
    check(step_a_v(latent, lora_a, info), step_a_v_reference(latent, lora_a, info),
          step_a_v_reference(latent.double(), lora_a.double(), info))


def test_shrink_split_k_counters_return_to_zero_and_are_reused(monkeypatch):
    """Eager launches on a GPU stream share one set of partials and counters (no allocation or memset per
    call): each split tile's last part sets its counter back to zero, so the next launch with the same
    buffers sums the right partials."""
    monkeypatch.setattr(lora._k._shrink, "interpret_blocks", {"BLOCK_S": 16, "BLOCK_K": 16, "SPLIT_K": 3})
    monkeypatch.setattr(lora._k._shrink, "chosen", {})
    shared = (torch.full((1 << 16,), float("nan")), torch.zeros(256, dtype=torch.int32))
    used = []
    monkeypatch.setattr(lora._k, "_split_pair",
                        lambda device, cells, tiles: used.append(cells) or (*shared, cells, tiles))
    info, S = layout("mixed", 16, seed=3)
    for seed in (1, 2, 3):
        x, w = rand(S, 40, dtype=torch.float32, seed=seed), rand(SLOTS, 16, 40, dtype=torch.float32, seed=seed + 10)
        check(sgemm_lora_a(x, w, info), sgemm_lora_a_reference(x, w, info),
              sgemm_lora_a_reference(x.double(), w.double(), info))
        assert not shared[1].any(), f"counters left at {shared[1].nonzero().flatten().tolist()}"
    assert len(used) == 3 and torch.isfinite(shared[0][:16]).all(), "the launches did not use the shared partials"


def test_split_buffers_are_allocated_per_call_off_the_gpu():
    """Off the GPU (and under graph capture) every split launch gets its own zeroed counters."""
    launch = [((6, 1), {"SPLIT_K": 3, "BLOCK_S": 16})]
    first, second = lora._k._split_buffers(torch.device("cpu"), launch, 16), \
        lora._k._split_buffers(torch.device("cpu"), launch, 16)
    assert first[1].data_ptr() != second[1].data_ptr() and not first[1].any()
    assert first[0].numel() == 6 * 16 * 16 and first[1].numel() == 2
    assert len(lora._k._split_pair(torch.device("cpu"), 10, 3)) == 2


def test_shrink_split_k_zeroes_bad_slots_and_rank_0(monkeypatch):
    """A split tile with an out-of-range slot (no adapter) is written (zeros) by its first part alone, as is
    a rank-0 tile: neither waits on a counter."""
    monkeypatch.setattr(lora._k._shrink, "interpret_blocks", {"BLOCK_S": 16, "BLOCK_K": 16, "SPLIT_K": 2})
    monkeypatch.setattr(lora._k._shrink, "chosen", {})
    info, S = layout("mixed", 16)
    info.weight_indices = info.weight_indices.clone()
    info.weight_indices[0] = 10 ** 6  # segment 0: rows 0..4; slot 2 (segment 2, row 5) has rank 0
    x, w = rand(S, 40, dtype=torch.float32, seed=7), rand(SLOTS, 16, 40, dtype=torch.float32, seed=8)
    with mode("off"):  # host values are checked (GL204) in the other modes
        out = sgemm_lora_a(x, w, info)
    ref = sgemm_lora_a_reference(x, w, info)
    assert torch.equal(out[:6], torch.zeros(6, 16)) and torch.equal(ref[:6], torch.zeros(6, 16))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fresh", [False, True], ids=["accumulate", "fresh"])
@pytest.mark.parametrize("name", ["mixed", "graph_padded_permuted", "decode"])
def test_lookups_past_the_first_block_of_segments_and_slots(name, fresh, expand_tiles, monkeypatch):
    """Tables longer than one lookup block (2 entries here): segments and slots past the first block are
    found by the further passes of the tile search and of the packed per-row lookup."""
    monkeypatch.setattr(lora._k, "_INTERPRET_BLOCK_SEG", 2)
    monkeypatch.setattr(lora._k._expand, "chosen", {})
    monkeypatch.setattr(lora._k._shrink, "chosen", {})
    info, S = layout(name, 16, seed=21)
    x, w = rand(S, 16, dtype=torch.float32, seed=22), rand(SLOTS, 40, 16, dtype=torch.float32, seed=23)
    base = None if fresh else rand(S, 40, dtype=torch.float32, seed=24)
    check(sgemm_lora_b(x, w, info, None if fresh else base.clone()),
          sgemm_lora_b_reference(x, w, info, None if fresh else base.clone()),
          sgemm_lora_b_reference(x.double(), w.double(), info, None if fresh else base.double()))
    xa, wa = rand(S, 40, dtype=torch.float32, seed=25), rand(SLOTS, 16, 40, dtype=torch.float32, seed=26)
    check(sgemm_lora_a(xa, wa, info), sgemm_lora_a_reference(xa, wa, info),
          sgemm_lora_a_reference(xa.double(), wa.double(), info))
