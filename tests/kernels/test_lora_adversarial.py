"""LoRA kernels on batch infos they cannot use: every output row is what the torch reference gives (no NaN,
no leftover memory), and host-side facts are coded errors: bad seg_indptr, slots and ranks (GL204),
overlapping or grad-requiring base_output (GL205), a namedtuple batch info (GL204).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guardlint.guard import GuardError, mode
from guardlint.kernels.lora import api as lora
from guardlint.kernels.lora import (LoRABatchInfo, qkv_lora_b, qkv_lora_b_reference, sgemm_lora_a,
                                    sgemm_lora_a_reference, sgemm_lora_b, sgemm_lora_b_reference, step_a_q,
                                    step_a_q_reference, step_a_v, step_a_v_reference, step_b_q, step_b_q_reference,
                                    step_b_v, step_b_v_reference)

S, SLOTS, R = 40, 4, 8
K, N = 24, 20
H, QK_NOPE, V_HEAD, KV_RANK = 2, 8, 4, 12
MLA = dict(qk_nope_head_dim=QK_NOPE, v_head_dim=V_HEAD)
QKV_STARTS = [0, 12, 18, 24]
INF, NAN = float("inf"), float("nan")

# name -> seg_indptr over 5 live segments (then a stale entry), slot per segment, rank per slot, scaling per slot.
# Slot 2 has rank 0 and an infinite scaling: a scaling that takes no product must not reach the output.
GOOD_RANKS, GOOD_SCALINGS = [R, 3, 0, 5], [0.5, 2.0, INF, 0.25]
BAD_BATCHES = {
    "indptr_starts_above_0": ([6, 10, 10, 25, 33, 40, 7], [0, 1, 2, 3, 1], GOOD_RANKS, GOOD_SCALINGS),
    "indptr_decreases": ([0, 12, 7, 20, 18, 36, -9], [3, 0, 1, 3, 0], GOOD_RANKS, GOOD_SCALINGS),
    "indptr_negative_and_past_tokens": ([-5, 8, 100, 30, 41, 39, 0], [1, 0, 3, 1, 0], GOOD_RANKS, GOOD_SCALINGS),
    "slots_out_of_range": ([0, 5, 12, 20, 33, 40, 3], [SLOTS, -1, 10 ** 6, 1, 0], GOOD_RANKS, GOOD_SCALINGS),
    # slot 0 above the stored rank, slot 1 negative (its scaling NaN), slot 3 fine
    "ranks_out_of_range": ([0, 9, 17, 20, 31, 40, 0], [0, 1, 2, 3, 1], [R + 1, -1, 0, 5], [1.0, NAN, INF, 0.5]),
}
# int64 tables whose entries would wrap into range if narrowed to 32 bits
WIDE = 2 ** 32
WIDE_BATCHES = {
    "int64_past_2_31": ([0, 7, WIDE + 3, 25, 40], [WIDE + 1, 3, 0, -WIDE + 2], [WIDE + 4, 3, 0, 5], GOOD_SCALINGS),
}
ALL_BATCHES = {**BAD_BATCHES, **WIDE_BATCHES}


def rand(*shape, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def make_info(indptr, slots, ranks, scalings, *, index=torch.int32, permute=False, device="cpu",
              tokens: int = S) -> LoRABatchInfo:
    """A batch info over ``len(slots)`` live segments (seg_indptr entries past them are stale)."""
    n = len(slots)
    return LoRABatchInfo(
        use_cuda_graph=len(indptr) > n + 1, bs=n, num_segments=n,
        seg_indptr=torch.tensor(indptr, dtype=index, device=device),
        weight_indices=torch.tensor(slots, dtype=index, device=device),
        lora_ranks=torch.tensor(ranks, dtype=index, device=device),
        scalings=torch.tensor(scalings, dtype=torch.float32, device=device), max_len=tokens,
        permutation=(torch.randperm(tokens, generator=torch.Generator().manual_seed(3)).to(torch.int32).to(device)
                     if permute else None))


def bad_info(name: str, *, permute: bool = False, device="cpu") -> LoRABatchInfo:
    return make_info(*ALL_BATCHES[name], index=torch.int64 if name in WIDE_BATCHES else torch.int32,
                     permute=permute, device=device)


def rows_with_adapter(info, tokens: int, num_slots: int, max_rank: int) -> torch.Tensor:
    """Boolean per row of x: does the row take a product? By the documented rule in its other form (a
    sorted position's segment is the first g with seg_indptr[g + 1] > position, from seg_indptr[0] on),
    so that the reference's running maximum is checked too."""
    n = info.num_segments
    indptr = info.seg_indptr[: n + 1].tolist()
    slots, ranks = info.weight_indices[:n].tolist(), info.lora_ranks.tolist()
    takes = torch.zeros(tokens, dtype=torch.bool)
    for p in range(tokens):
        seg = next((g for g in range(n) if indptr[g + 1] > p), None)
        if seg is None or p < indptr[0]:
            continue
        slot = slots[seg]
        takes[p] = 0 <= slot < num_slots and 0 < ranks[slot] <= max_rank
    if info.permutation is not None:
        rows = torch.zeros(tokens, dtype=torch.bool)
        rows[info.permutation.long().cpu()] = takes
        return rows
    return takes


@contextlib.contextmanager
def packed_tiles(packed: bool):
    """Expand token tiles of one segment's rows, or packed rows across segments, whatever the batch shape."""
    before = lora._k._PACKED_FROM_CLASS
    lora._k._PACKED_FROM_CLASS = 0 if packed else 99
    try:
        yield
    finally:
        lora._k._PACKED_FROM_CLASS = before


@contextlib.contextmanager
def poisoned_outputs():
    """Fresh kernel outputs start as NaN: an unwritten element shows."""
    before = lora._new_output
    lora._new_output = lambda shape, dtype, device: torch.full(tuple(shape), NAN, dtype=dtype, device=device)
    try:
        yield
    finally:
        lora._new_output = before


class Call(NamedTuple):
    """One public function on one batch: run(info) -> output; reference(info) -> float64 output; base: the
    output it updates in place (None: a fresh one); shrink: whether rows without an adapter are 0 (else
    they keep base, or 0 in a fresh output)."""

    name: str
    run: object
    reference: object
    base: Optional[torch.Tensor]
    shrink: bool


def calls(tokens: int, dtype: torch.dtype, *, fresh: bool, device="cpu", seed: int = 0) -> list:
    """Every public LoRA function with inputs for ``tokens`` rows."""
    def r(*shape, s):
        return rand(*shape, dtype=dtype, seed=seed * 100 + s, device=device)

    def f64(t):
        return None if t is None else t.double()

    def base(*shape, s):
        return None if fresh else r(*shape, s=s)

    x, w_a = r(tokens, K, s=1), r(SLOTS, 2 * R, K, s=2)
    y, w_b, b = r(tokens, R, s=3), r(SLOTS, N, R, s=4), base(tokens, N, s=5)
    qx, qw, qb = r(tokens, 3 * R, s=6), r(SLOTS, QKV_STARTS[-1], R, s=7), base(tokens, QKV_STARTS[-1], s=8)
    q_nope, lora_b = r(tokens, H, QK_NOPE, s=9), r(SLOTS, H * (QK_NOPE + V_HEAD), R, s=10)
    lora_q, lora_a, bq = r(tokens, H, R, s=11), r(SLOTS, R, KV_RANK, s=12), base(tokens, H, KV_RANK, s=13)
    latent, lora_v, bv = r(tokens, H, KV_RANK, s=14), r(tokens, H, R, s=15), base(tokens, H, V_HEAD, s=16)

    def clone(t):
        return None if t is None else t.clone()

    return [
        Call("sgemm_lora_a", lambda i: sgemm_lora_a(x, w_a, i, 2),
             lambda i: sgemm_lora_a_reference(x.double(), w_a.double(), i, 2), None, True),
        Call("sgemm_lora_b", lambda i: sgemm_lora_b(y, w_b, i, clone(b)),
             lambda i: sgemm_lora_b_reference(y.double(), w_b.double(), i, f64(b)), b, False),
        Call("qkv_lora_b", lambda i: qkv_lora_b(qx, qw, i, QKV_STARTS, clone(qb)),
             lambda i: qkv_lora_b_reference(qx.double(), qw.double(), i, QKV_STARTS, f64(qb)), qb, False),
        Call("step_a_q", lambda i: step_a_q(q_nope, lora_b, i, **MLA),
             lambda i: step_a_q_reference(q_nope.double(), lora_b.double(), i, **MLA), None, True),
        Call("step_b_q", lambda i: step_b_q(lora_q, lora_a, i, clone(bq)),
             lambda i: step_b_q_reference(lora_q.double(), lora_a.double(), i, f64(bq)), bq, False),
        Call("step_a_v", lambda i: step_a_v(latent, lora_a, i),
             lambda i: step_a_v_reference(latent.double(), lora_a.double(), i), None, True),
        Call("step_b_v", lambda i: step_b_v(lora_v, lora_b, i, clone(bv), **MLA),
             lambda i: step_b_v_reference(lora_v.double(), lora_b.double(), i, f64(bv), **MLA), bv, False),
    ]


def check_call(call: Call, info, tokens: int, rtol: float = 1e-5, atol: float = 1e-4) -> None:
    """The kernel's output against the float64 reference; rows without an adapter exactly 0 (shrink, fresh
    expand) or exactly the base (accumulating expand), in both."""
    out = call.run(info)
    ref64 = call.reference(info)
    assert torch.isfinite(out).all(), f"{call.name}: NaN or leftover memory"
    torch.testing.assert_close(out.double(), ref64, rtol=rtol, atol=atol, msg=lambda m: f"{call.name}: {m}")
    none = ~rows_with_adapter(info, tokens, SLOTS, R).to(out.device)
    keep = torch.zeros_like(out) if call.base is None or call.shrink else call.base
    assert torch.equal(out[none], keep[none]), f"{call.name}: rows without an adapter changed"
    assert torch.equal(ref64[none], keep[none].double()), f"{call.name}: the reference disagrees with the rule"


# Kernel-level cases run with the guard off: host tensors are checked (GL204) in every other mode, and device
# tensors in derive mode reach the kernels unchecked, as here.
CASES = [(name, fresh, packed) for name in ALL_BATCHES for fresh, packed in ((True, False), (False, True))] + [
    ("indptr_decreases", False, False), ("slots_out_of_range", True, True)]


@pytest.mark.parametrize("name,fresh,packed", CASES,
                         ids=[f"{n}-{'fresh' if f else 'accumulate'}-{'packed' if p else 'segment'}"
                              for n, f, p in CASES])
def test_bad_batch_info_rows_are_the_references(name, fresh, packed):
    info = bad_info(name, permute=name == "indptr_decreases")
    with mode("off"), poisoned_outputs(), packed_tiles(packed):
        for call in calls(S, torch.float32, fresh=fresh, seed=len(name)):
            check_call(call, info, S)


@pytest.mark.parametrize("split", [2, 3])
def test_split_k_shrink_on_bad_batch_info(split, monkeypatch):
    """Split-K tiles without an adapter are written (zeros) by their first part alone; the others sum
    their parts as usual."""
    monkeypatch.setattr(lora._k._shrink, "interpret_blocks", {"BLOCK_S": 16, "BLOCK_K": 16, "SPLIT_K": split})
    monkeypatch.setattr(lora._k._shrink, "chosen", {})
    with mode("off"), poisoned_outputs():
        for name in ("indptr_starts_above_0", "ranks_out_of_range"):
            check_call(calls(S, torch.float32, fresh=True)[0], bad_info(name), S)


def test_lookups_past_the_first_block_on_bad_batch_info(monkeypatch):
    """The running maximum carries over from one block of segments to the next (2 a block here)."""
    monkeypatch.setattr(lora._k, "_INTERPRET_BLOCK_SEG", 2)
    monkeypatch.setattr(lora._k._expand, "chosen", {})
    monkeypatch.setattr(lora._k._shrink, "chosen", {})
    with mode("off"), poisoned_outputs():
        for name, packed in (("indptr_decreases", False), ("indptr_starts_above_0", True)):
            with packed_tiles(packed):
                for call in calls(S, torch.float32, fresh=packed)[:2]:
                    check_call(call, bad_info(name), S)


@st.composite
def batches(draw):
    tokens = draw(st.integers(1, 48))
    n = draw(st.integers(0, 6))
    indptr = draw(st.lists(st.integers(-4, tokens + 6), min_size=n + 1, max_size=n + 1))
    if draw(st.booleans()):
        indptr = sorted(indptr)  # near-valid: monotone, not from 0 or past the tokens
    slots = draw(st.lists(st.integers(-2, SLOTS + 1), min_size=n, max_size=n))
    ranks = draw(st.lists(st.integers(-2, R + 2), min_size=SLOTS, max_size=SLOTS))
    # Slots without an adapter get NaN or inf scalings: neither may reach an output.
    scalings = [(0.5 + s if 0 < r <= R else (INF if s % 2 else NAN)) for s, r in enumerate(ranks)]
    info = LoRABatchInfo(use_cuda_graph=False, bs=n, num_segments=n,
                         seg_indptr=torch.tensor(indptr, dtype=torch.int32),
                         weight_indices=torch.tensor(slots, dtype=torch.int32),
                         lora_ranks=torch.tensor(ranks, dtype=torch.int32),
                         scalings=torch.tensor(scalings, dtype=torch.float32), max_len=max(tokens, 1),
                         permutation=(torch.randperm(tokens, generator=torch.Generator().manual_seed(tokens))
                                      .to(torch.int32) if draw(st.booleans()) else None))
    return info, tokens, draw(st.booleans()), draw(st.booleans())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_random_batch_info_matches_the_reference(case):
    info, tokens, fresh, packed = case
    with mode("off"), poisoned_outputs(), packed_tiles(packed):
        for call in calls(tokens, torch.float32, fresh=fresh)[:2]:
            check_call(call, info, tokens)


# -- host-side facts: coded errors before any launch ------------------------------------------------------

HOST_ERRORS = {
    "indptr_starts_above_0": "batch_info.seg_indptr",
    "indptr_decreases": "batch_info.seg_indptr",
    "indptr_negative_and_past_tokens": "batch_info.seg_indptr",
    "slots_out_of_range": "batch_info.weight_indices",
    "ranks_out_of_range": "batch_info.lora_ranks",
    "int64_past_2_31": "batch_info.seg_indptr",
}


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("name", list(HOST_ERRORS))
def test_host_batch_info_the_kernels_cannot_use_is_gl204(name, backend):
    for call in calls(S, torch.float32, fresh=False)[:2]:
        with pytest.raises(GuardError) as err:
            if backend is None:
                call.run(bad_info(name))
            else:
                getattr(lora, call.name)(*_args(call.name), bad_info(name), backend=backend)
        assert err.value.code == "GL204" and err.value.argument == HOST_ERRORS[name], str(err.value)
        assert "expected" in str(err.value) and "fix:" in str(err.value)


def _args(name):
    return {"sgemm_lora_a": (rand(S, K), rand(SLOTS, R, K)), "sgemm_lora_b": (rand(S, R), rand(SLOTS, N, R))}[name]


def test_host_check_reports_positions_not_values():
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(rand(S, K), rand(SLOTS, R, K), bad_info("indptr_decreases"))
    assert "index 2" in str(err.value) and "12" not in str(err.value.got)


def test_host_check_leaves_graph_padding_and_uncovered_tail_alone():
    """Stale entries past num_segments and rows past seg_indptr[num_segments] are a CUDA-graph batch, not
    an error."""
    info = LoRABatchInfo(use_cuda_graph=True, bs=4, num_segments=2,
                         seg_indptr=torch.tensor([0, 5, 30, -1, 99], dtype=torch.int32),
                         weight_indices=torch.tensor([1, 3, 77, -5], dtype=torch.int32),
                         lora_ranks=torch.tensor([R, 3, 0, 5], dtype=torch.int32), scalings=torch.ones(SLOTS),
                         max_len=25)
    with poisoned_outputs():
        for call in calls(S, torch.float32, fresh=True)[:2]:
            check_call(call, info, S)


def test_host_check_is_read_again_after_an_in_place_update():
    x, w = rand(S, K), rand(SLOTS, R, K)
    info = LoRABatchInfo(use_cuda_graph=False, bs=2, num_segments=2, seg_indptr=torch.tensor([0, 10, 40]),
                         weight_indices=torch.tensor([0, 1]), lora_ranks=torch.tensor([R, 3, 0, 5]),
                         scalings=torch.ones(SLOTS), max_len=30)
    sgemm_lora_a(x, w, info)
    info.weight_indices[1] = SLOTS
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, info)
    assert err.value.argument == "batch_info.weight_indices"
    info.weight_indices[1] = 1
    info.lora_ranks[1] = R + 1
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, info)
    assert err.value.argument == "batch_info.lora_ranks"


# -- base_output: overlapping rows, grad ----------------------------------------------------------------------

def _good_info():
    return LoRABatchInfo(use_cuda_graph=False, bs=3, num_segments=3,
                         seg_indptr=torch.tensor([0, 9, 20, 40], dtype=torch.int32),
                         weight_indices=torch.tensor([0, 3, 1], dtype=torch.int32),
                         lora_ranks=torch.tensor([R, 3, 0, 5], dtype=torch.int32),
                         scalings=torch.tensor([0.5, 2.0, 1.0, 0.25]), max_len=20)


# (S, N) views that share memory between elements; keywords: dtype and device (a copy would not overlap).
OVERLAPPING = {
    "token stride 0": lambda **kw: torch.zeros(N, **kw).as_strided((S, N), (0, 1)),
    "token stride below the row": lambda **kw: torch.zeros(S * N, **kw).as_strided((S, N), (N - 3, 1)),
    "column stride 0": lambda **kw: torch.zeros(S, **kw).as_strided((S, N), (1, 0)),
    "rows interleaved into each other": lambda **kw: torch.zeros(S * N, **kw).as_strided((S, N), (2, 3)),
}


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("case", list(OVERLAPPING))
def test_overlapping_base_output_is_gl205(case, backend):
    x, w = rand(S, R), rand(SLOTS, N, R)
    with pytest.raises(GuardError) as err:
        sgemm_lora_b(x, w, _good_info(), OVERLAPPING[case](), backend=backend)
    assert err.value.code == "GL205" and err.value.argument == "base_output", str(err.value)
    assert "strides" in err.value.got


def test_overlapping_heads_of_an_mla_base_output_are_gl205():
    base = torch.zeros(S * H * KV_RANK).as_strided((S, H, KV_RANK), (H * KV_RANK, KV_RANK // 2, 1))
    with pytest.raises(GuardError) as err:
        step_b_q(rand(S, H, R), rand(SLOTS, R, KV_RANK), _good_info(), base)
    assert err.value.code == "GL205" and err.value.argument == "base_output"


NON_OVERLAPPING = {
    "column slice of a wider buffer": lambda b: torch.cat([b, b[:, :5]], 1)[:, :N],
    "every other row of a taller buffer": lambda b: torch.stack([b, b], 1).reshape(2 * S, N)[::2],
    "column-major": lambda b: b.t().contiguous().t(),
    "as_strided with gaps": lambda b: torch.zeros(S * (N + 4)).as_strided((S, N), (N + 4, 1)).copy_(b),
}


@pytest.mark.parametrize("case", list(NON_OVERLAPPING))
def test_strided_base_output_without_overlap_is_updated_in_place(case):
    x, w, info = rand(S, R, seed=1), rand(SLOTS, N, R, seed=2), _good_info()
    before = rand(S, N, seed=3)
    base = NON_OVERLAPPING[case](before)
    assert torch.equal(base, before)
    out = sgemm_lora_b(x, w, info, base)
    assert out is base
    torch.testing.assert_close(out.double(), sgemm_lora_b_reference(x.double(), w.double(), info, before.double()),
                               rtol=1e-5, atol=1e-4)


def test_may_overlap_reads_sizes_and_strides_only():
    assert not lora._may_overlap((4, 5), (5, 1)) and not lora._may_overlap((4, 5), (1, 4))
    assert not lora._may_overlap((1, 5), (0, 1)) and not lora._may_overlap((0, 5), (0, 0))
    assert lora._may_overlap((4, 5), (4, 1)) and lora._may_overlap((4, 5), (0, 1))
    assert lora._may_overlap((3, 2, 4), (8, 2, 1)) and not lora._may_overlap((3, 2, 4), (8, 4, 1))


@pytest.mark.parametrize("backend", [None, "torch", "triton"])
def test_base_output_leaf_requiring_grad_is_gl205(backend):
    x, w = rand(S, R), rand(SLOTS, N, R)
    base = rand(S, N).requires_grad_()
    with pytest.raises(GuardError) as err:
        sgemm_lora_b(x, w, _good_info(), base, backend=backend)
    assert err.value.code == "GL205" and err.value.argument == "base_output", str(err.value)
    assert "does not require grad" in err.value.fix and "reference backend" in err.value.fix
    with pytest.raises(GuardError) as err:
        step_b_v(rand(S, H, R), rand(SLOTS, H * (QK_NOPE + V_HEAD), R), _good_info(),
                 torch.zeros(S, H, V_HEAD, requires_grad=True), backend=backend, **MLA)
    assert err.value.code == "GL205" and err.value.argument == "base_output"


def test_base_output_requiring_grad_without_autograd_or_as_a_non_leaf():
    x, w, info = rand(S, R, seed=1), rand(SLOTS, N, R, seed=2), _good_info()
    before = rand(S, N, seed=3)
    ref = sgemm_lora_b_reference(x.double(), w.double(), info, before.double())
    leaf = before.clone().requires_grad_()
    with torch.no_grad():  # an in-place update of a leaf, as an optimizer's: allowed, on the kernel
        out = sgemm_lora_b(x, w, info, leaf)
    torch.testing.assert_close(out.detach().double(), ref, rtol=1e-5, atol=1e-4)
    # A non-leaf under autograd goes to the reference, which updates it differentiably.
    leaf = before.clone().requires_grad_()
    out = sgemm_lora_b(x, w, info, leaf * 1)
    out.sum().backward()
    torch.testing.assert_close(out.detach().double(), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(leaf.grad, torch.ones(S, N))


# -- the batch info's type -------------------------------------------------------------------------------------

class TupleBatchInfo(NamedTuple):
    use_cuda_graph: bool
    bs: int
    num_segments: int
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    lora_ranks: torch.Tensor
    scalings: torch.Tensor
    max_len: Optional[int] = None
    seg_lens: Optional[torch.Tensor] = None
    permutation: Optional[torch.Tensor] = None


def _tuple_info(**changes):
    good = _good_info()
    fields = {name: getattr(good, name) for name in TupleBatchInfo._fields}
    return TupleBatchInfo(**{**fields, **changes})


@pytest.mark.parametrize("guard_mode", ["derive", "strict", "off"])
def test_namedtuple_batch_info_is_gl204(guard_mode):
    with mode(guard_mode), pytest.raises(GuardError) as err:
        sgemm_lora_a(rand(S, K), rand(SLOTS, R, K), _tuple_info())
    assert err.value.code == "GL204" and err.value.argument == "batch_info", str(err.value)
    assert "LoRABatchInfo" in err.value.expected and "mutable" in err.value.expected


def test_namedtuple_batch_info_without_max_len_is_gl204():
    """Derive mode completes a batch info without max_len on a copy before the kernel's own check: the
    guard refuses one whose fields cannot be set."""
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(rand(S, K), rand(SLOTS, R, K), _tuple_info(max_len=None))
    assert err.value.code == "GL204" and err.value.argument == "batch_info"
