"""max_seqlen is a launch size, never a correctness input: the Triton kernel (through the interpreter) writes every
row for hints below, at and above the longest sequence, against float64 on a NaN-filled output; launches are
clamped to the token count; an unverified hint adds a second launch for the tiles past it; and the Gluon backend runs
only with a verified hint (a stand-in Gluon module here: the real one needs a Hopper GPU).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from guardlint.guard import mode, prepare_varlen_metadata
from guardlint.kernels import varlen_attention
from guardlint.kernels.attention import api as attention
from guardlint.kernels.attention import triton as triton_path
from guardlint.kernels.attention.reference import reference_varlen_attention

# With the interpreter's 16-row query tiles: 2 and 3 tiles, one row, exactly one tile, empty sequences.
LENGTHS = [20, 0, 37, 1, 16, 0]
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}


def make_batch(lengths, heads=4, kv_heads=2, head_dim=32, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    q = torch.randn(offsets[-1], heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(offsets[-1], kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(offsets[-1], kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v, torch.tensor(offsets, dtype=torch.int32), offsets


def hints(lengths):
    """Below the longest sequence (down to 1), at it, just past it, the token count, and absurdly large."""
    longest, total = max(lengths), sum(lengths)
    return [1, longest - 1, longest, longest + 1, total, 10 ** 9]


def assert_matches(out, q, k, v, offsets, causal, scale):
    ref = reference_varlen_attention(q, k, v, offsets, scale, causal)
    assert torch.isfinite(out).all(), "a row was left unwritten (NaN poison) or is not finite"
    atol, rtol = TOLERANCE[q.dtype]
    err = (out.double() - ref).abs()
    assert (err <= atol + rtol * ref.abs()).all(), f"max abs error {err.max().item():.3g}"


@pytest.fixture
def poisoned_output(monkeypatch):
    monkeypatch.setattr(triton_path, "new_output", lambda q: torch.full_like(q, float("nan")))


@pytest.mark.parametrize("head_dim,dtype", [(16, torch.float32), (32, torch.float32), (80, torch.bfloat16)],
                         ids=["d16", "d32", "d80-bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_writes_every_row_for_any_max_seqlen(head_dim, dtype, causal, poisoned_output):
    # D=80 runs as two parts (64 + 16); GQA 4:2.
    q, k, v, cu, offsets = make_batch(LENGTHS, head_dim=head_dim, dtype=dtype, seed=head_dim + int(causal))
    for hint in hints(LENGTHS):
        out = triton_path.varlen_attention_triton(q, k, v, cu, hint, 0.2, causal)
        assert_matches(out, q, k, v, offsets, causal, 0.2)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_taller_query_tiles_loop_too(causal, poisoned_output):
    # BLOCK_M = 32 = 2 * BLOCK_N: one program per sequence and head for a hint of 1, causal tiles last first.
    q, k, v, cu, offsets = make_batch([45, 1, 70, 0], head_dim=32)
    for hint in (1, 33):
        out = triton_path.varlen_attention_triton(q, k, v, cu, hint, 0.15, causal, config=(32, 16, 4, 1))
        assert_matches(out, q, k, v, offsets, causal, 0.15)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_attention_with_a_callers_short_max_seqlen(causal, poisoned_output):
    """The engines' call: offsets, their lengths and a max_seqlen no one checks (the guard off, so the kernel sees
    the value as given), planned at the first call and launched from the plan at the second."""
    q, k, v, cu, offsets = make_batch(LENGTHS, head_dim=32)
    lengths = cu[1:] - cu[:-1]
    with mode("off"):
        for hint in (1, max(LENGTHS) - 1, 10 ** 9):
            for _ in range(2):
                out = varlen_attention(q, k, v, cu, sequence_lengths=lengths, max_seqlen=hint, causal=causal,
                                       backend="triton")
                assert_matches(out, q, k, v, offsets, causal, 32 ** -0.5)


def test_launch_rows_are_the_hint_clamped_to_the_token_count():
    assert triton_path.launch_rows(10 ** 9, 40) == 40
    assert triton_path.launch_rows(20, 40) == 20
    assert triton_path.launch_rows(0, 40) == 1 and triton_path.launch_rows(-3, 40) == 1
    # A grid covers every tile when the hint was verified or reaches the token count, never on a claim of 0.
    assert triton_path.covers(40, 40, False) and triton_path.covers(20, 40, True)
    assert not triton_path.covers(39, 40, False) and not triton_path.covers(0, 40, True)


@pytest.mark.parametrize("sms, head_programs", [(1, 1), (4, 2), (1000, 4)])
def test_only_an_unverified_hint_adds_the_launch_of_the_tiles_past_it(monkeypatch, sms, head_programs):
    q, k, v, cu, offsets = make_batch([21, 3], head_dim=32)
    rests = []
    rest = triton_path._rest
    monkeypatch.setattr(triton_path, "_launches", {})
    monkeypatch.setattr(triton_path, "_rests", {})
    monkeypatch.setattr(triton_path, "_SM_COUNTS", {q.device: sms})

    def recorded(key, kwargs):
        launch = rest(key, kwargs)
        return lambda args, grid: rests.append((args[-2:], grid, launch.fn.__name__)) or launch(args, grid)

    monkeypatch.setattr(triton_path, "_rest", recorded)
    for hint, verified in ((21, False), (21, True), (24, False), (10 ** 9, False), (1, False)):
        out = triton_path.varlen_attention_triton(q, k, v, cu, hint, 0.1, False, max_seqlen_verified=verified)
        assert_matches(out, q, k, v, offsets, False, 0.1)
    # One first-launch kernel (one tile per program, no loop) for every hint; the looping kernel runs after it
    # only for the hints nothing verified below the token count (21 and 1), from the first tile the first launch
    # left (16-row tiles: 2 of them for 21 rows, 1 for 1): per sequence as many head programs as fill the SMs
    # (each looping over heads h, h + programs, ...), at least one, at most one per head.
    assert [key[-2] for key in triton_path._launches] == [True]  # visited longest first
    assert all(kwargs["TILE_LOOP"] is False for _, kwargs, _ in triton_path._launches.values())
    grid = (1, head_programs, 2)
    assert rests == [((2, 4), grid, "_varlen_attention_rest"), ((1, 4), grid, "_varlen_attention_rest")]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_right_unverified_hint_gives_what_a_verified_one_gives(causal):
    # The second launch finds no tile past a right hint: the output is the first launch's, bit for bit.
    q, k, v, cu, _ = make_batch(LENGTHS, head_dim=32, seed=3)
    unverified = triton_path.varlen_attention_triton(q, k, v, cu, max(LENGTHS), 0.2, causal)
    verified = triton_path.varlen_attention_triton(q, k, v, cu, max(LENGTHS), 0.2, causal, max_seqlen_verified=True)
    assert torch.equal(unverified, verified)


# -- the Gluon backend: only with a verified max_seqlen -----------------------------------------------

@pytest.fixture
def stand_in_gluon(monkeypatch):
    """A Gluon module that takes every call and records the max_seqlen it was launched with (its output: the
    float64 reference), so the routing runs on the CPU; plans made here stay here."""
    ran = []

    def launch(q, k, v, cu_seqlens, max_seqlen, scale, causal=False):
        ran.append(max_seqlen)
        offsets = cu_seqlens.tolist()
        return reference_varlen_attention(q, k, v, offsets, scale, causal).to(q.dtype)

    module = SimpleNamespace(supports=lambda *args, **kwargs: True, varlen_attention_gluon=launch)
    monkeypatch.setattr(attention, "_gluon", lambda: module)
    monkeypatch.setattr(attention, "_gluon_runnable", lambda q, k, causal: True)
    monkeypatch.setattr(attention, "_calls", {})
    return ran


def test_gluon_backend_runs_triton_for_an_unverified_max_seqlen(stand_in_gluon, poisoned_output):
    q, k, v, cu, offsets = make_batch(LENGTHS, head_dim=32)
    lengths = cu[1:] - cu[:-1]
    total = sum(LENGTHS)
    with mode("off"):  # the caller's values as given: nothing verified them
        for hint in hints(LENGTHS):
            stand_in_gluon.clear()
            out = varlen_attention(q, k, v, cu, sequence_lengths=lengths, max_seqlen=hint, backend="gluon")
            assert_matches(out, q, k, v, offsets, False, 32 ** -0.5)
            # At least the token count is a fact, not a claim: no sequence is longer.
            assert stand_in_gluon == ([hint] if hint >= total else []), hint
            assert attention.select_backend(q, k, cu, hint, backend="gluon") == ("gluon" if hint >= total
                                                                                 else "triton")
        # Guarded callers cannot claim it: the guard sets the flag itself (to False when it did not check).
        stand_in_gluon.clear()
        varlen_attention(q, k, v, cu, sequence_lengths=lengths, max_seqlen=5, backend="gluon",
                         max_seqlen_verified=True)
        assert stand_in_gluon == []
    assert attention.select_backend(q, k, cu, max(LENGTHS), backend="gluon", max_seqlen_verified=True) == "gluon"


def test_gluon_backend_runs_gluon_for_a_derived_max_seqlen(stand_in_gluon):
    q, k, v, cu, offsets = make_batch(LENGTHS, head_dim=32)
    out = varlen_attention(q, k, v, cu, metadata=prepare_varlen_metadata(cu, q), backend="gluon")
    assert_matches(out, q, k, v, offsets, False, 32 ** -0.5)
    out = varlen_attention(q, k, v, cu, backend="gluon")  # derived by the guard
    assert_matches(out, q, k, v, offsets, False, 32 ** -0.5)
    assert stand_in_gluon == [max(LENGTHS)] * 2
