"""Property tests: valid metadata derives what a plain reference computes; invalid metadata fails in
strict mode with the right code, and never with any other exception."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from guardlint.guard import (GuardError, bucket_batch_size, bucket_max_seqlen, clear_cache, guard_lora,
                             guard_varlen, mode, prepare_varlen_metadata)

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

lengths_st = st.lists(st.integers(0, 40), min_size=0, max_size=12)
heads_st = st.sampled_from([(1, 2), (2, 4), (3, 8), (16, 5)])
form_st = st.sampled_from(["int32", "int64", "list", "tuple", "numpy"])


@guard_varlen
def varlen_attention(q, k, v, cu_seqlens, *, sequence_lengths=None, max_seqlen=None, metadata=None):
    return cu_seqlens, sequence_lengths, max_seqlen


def offsets(lengths):
    return [0, *np.cumsum(lengths, dtype=np.int64).tolist()]


def as_form(values, form):
    if form == "int32":
        return torch.tensor(values, dtype=torch.int32)
    if form == "int64":
        return torch.tensor(values, dtype=torch.int64)
    if form == "numpy":
        return np.array(values, dtype=np.int64)
    return tuple(values) if form == "tuple" else list(values)


@SETTINGS
@given(lengths=lengths_st, heads=heads_st, form=form_st, bucket=st.booleans())
def test_prepare_matches_reference(lengths, heads, form, bucket):
    clear_cache()
    H, D = heads
    cu = offsets(lengths)
    T = cu[-1]
    q = torch.empty(T, H, D)
    B = len(lengths)
    meta = prepare_varlen_metadata(as_form(cu, form), q)
    assert meta.cu_seqlens.tolist() == cu and meta.sequence_lengths.tolist() == list(lengths)
    assert meta.max_seqlen == max(lengths, default=0) and meta.batch_size == B and meta.total_tokens == T
    cudnn = prepare_varlen_metadata(as_form(cu, form), q, layout="cudnn", bucket=bucket)
    Bp = bucket_batch_size(B) if bucket else B
    padded = cu + [T] * (Bp - B)
    assert cudnn.padded_batch_size == Bp
    assert cudnn.packed_indptrs.tolist() == [x * H * D for x in padded] * 3
    assert cudnn.sequence_lengths.flatten().tolist() == list(lengths) + [0] * (Bp - B)
    longest = max(lengths, default=0)
    assert cudnn.flashinfer_max_seqlen == (bucket_max_seqlen(longest) if bucket else longest)
    # the engine's packed element indptrs describe the same batch
    if T > 0:
        packed = prepare_varlen_metadata(as_form([x * H * D for x in cu] * 3, form), q, layout="cudnn")
        assert packed.host_cu_seqlens == tuple(cu)


@SETTINGS
@given(lengths=lengths_st, heads=heads_st, form=form_st)
def test_guard_varlen_derives_reference_values(lengths, heads, form):
    clear_cache()
    cu = offsets(lengths)
    q = torch.empty(cu[-1], *heads)
    with mode("strict"):
        got_cu, seq, longest = varlen_attention(q, q, q, as_form(cu, form))
    assert got_cu.tolist() == cu and seq.tolist() == list(lengths) and longest == max(lengths, default=0)


@st.composite
def broken_varlen(draw):
    """A call with one thing wrong, and the (code, argument) strict mode must answer with."""
    lengths = draw(st.lists(st.integers(0, 30), min_size=1, max_size=10))
    H, D = draw(heads_st)
    cu = offsets(lengths)
    T = cu[-1]
    seq = torch.tensor(lengths, dtype=torch.int32)
    longest = max(lengths)
    kind = draw(st.sampled_from(["float", "2d", "negative", "decrease", "total", "empty", "huge", "seq",
                                 "seq_shape", "max_small", "max_negative", "max_type", "bool"]))
    cu_t = torch.tensor(cu, dtype=torch.int32)
    expect = ("GL103", "cu_seqlens")
    if kind == "float":
        cu_t = cu_t.float()
    elif kind == "bool":
        cu_t = cu_t.bool()
    elif kind == "2d":
        cu_t = cu_t.view(1, -1)
    elif kind == "negative":
        i = draw(st.integers(0, len(cu) - 1))
        cu_t[i] = -draw(st.integers(1, 1000))
        assume(i < len(cu) - 1 or T != -int(cu_t[i]))
    elif kind == "decrease":
        assume(len(cu) >= 3 and cu[1] > 0)
        i = draw(st.integers(1, len(cu) - 2))
        assume(cu[i] > 0)
        cu_t[i + 1] = cu[i] - draw(st.integers(1, cu[i]))
        assume(int(cu_t[-1]) == T or int(cu_t[-1]) != T * H * D)
    elif kind == "total":
        delta = draw(st.integers(1, 50))
        cu_t[-1] = T + delta
        assume(T + delta != T * H * D)
    elif kind == "empty":
        cu_t = cu_t[:0]
    elif kind == "huge":
        cu_t = torch.tensor(cu, dtype=torch.int64)
        cu_t[draw(st.integers(1, len(cu) - 1))] = 2**40
    elif kind == "seq":
        i = draw(st.integers(0, len(lengths) - 1))
        seq[i] += draw(st.integers(1, 5))
        expect = ("GL103", "sequence_lengths")
    elif kind == "seq_shape":
        seq = seq[:-1]
        expect = ("GL103", "sequence_lengths")
    elif kind == "max_small":
        assume(longest > 0)
        longest = draw(st.integers(0, longest - 1))
        expect = ("GL103", "max_seqlen")
    elif kind == "max_negative":
        longest = -draw(st.integers(1, 9))
        expect = ("GL103", "max_seqlen")
    elif kind == "max_type":
        longest = draw(st.sampled_from([float(longest), torch.tensor(longest), np.int64(longest), True]))
        expect = ("GL103", "max_seqlen")
    q = torch.empty(T, H, D)
    return q, cu_t, seq, longest, expect


@SETTINGS
@given(case=broken_varlen(), pass_values=st.booleans())
def test_strict_rejects_broken_varlen_with_the_right_code(case, pass_values):
    clear_cache()
    q, cu, seq, longest, (code, argument) = case
    if not pass_values and argument != "cu_seqlens":
        return  # only cu_seqlens itself is broken when nothing else is passed
    kwargs = {"sequence_lengths": seq, "max_seqlen": longest} if pass_values else {}
    with mode("strict"):
        with pytest.raises(GuardError) as info:
            varlen_attention(q, q, q, cu, **kwargs)
    assert (info.value.code, info.value.argument) == (code, argument), str(info.value)


@SETTINGS
@given(case=broken_varlen())
def test_prepare_rejects_broken_offsets_with_a_guard_error(case):
    clear_cache()
    q, cu, _, _, (code, argument) = case
    if argument != "cu_seqlens":
        return
    for layout in ("tokens", "cudnn"):
        with pytest.raises(GuardError) as info:
            prepare_varlen_metadata(cu, q, layout=layout)
        assert info.value.code in ("GL103", "GL107") and info.value.argument == "cu_seqlens"


class Info:
    """A duck-typed LoRA batch info (plain attributes, no dataclass)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


@guard_lora(rank_dim=1)
def lora_shrink(x, weights, batch_info):
    return batch_info


@st.composite
def lora_case(draw, broken):
    lengths = draw(st.lists(st.integers(0, 20), min_size=1, max_size=8))
    pad = draw(st.integers(0, 3))
    slots = draw(st.integers(1, 4))
    rank = draw(st.integers(1, 8))
    indptr = offsets(lengths) + [offsets(lengths)[-1] + 7] * pad
    wi = [draw(st.integers(0, slots - 1)) for _ in lengths] + [slots + 5] * pad
    ranks = [draw(st.integers(0, rank)) for _ in range(slots)]
    n = len(lengths)
    fields = dict(use_cuda_graph=pad > 0, bs=n, num_segments=n, seg_indptr=torch.tensor(indptr, dtype=torch.int32),
                  weight_indices=torch.tensor(wi, dtype=torch.int32), lora_ranks=torch.tensor(ranks, dtype=torch.int32),
                  scalings=torch.ones(slots), max_len=None, seg_lens=None, permutation=None)
    T = sum(lengths)
    expect = None
    if broken:
        kind = draw(st.sampled_from(["slot", "rank", "total", "decrease", "seg_lens", "max_len", "zero"]))
        if kind == "slot":
            fields["weight_indices"][draw(st.integers(0, n - 1))] = slots + draw(st.integers(0, 3))
            expect = ("GL204", "batch_info.weight_indices")
        elif kind == "rank":
            i = draw(st.integers(0, n - 1))
            fields["lora_ranks"][int(fields["weight_indices"][i])] = rank + 1
            expect = ("GL204", "batch_info.lora_ranks")
        elif kind == "total":
            T += draw(st.integers(1, 5))
            fields["max_len"] = max(lengths) or 1
            expect = ("GL204", "batch_info.seg_indptr")
        elif kind == "decrease":
            assume(n >= 2 and indptr[1] > 0)
            fields["seg_indptr"][2] = indptr[1] - 1 - draw(st.integers(0, indptr[1] - 1))
            fields["max_len"] = 99
            expect = ("GL204", "batch_info.seg_indptr")
        elif kind == "seg_lens":
            bad = torch.tensor(lengths, dtype=torch.int32)
            bad[draw(st.integers(0, n - 1))] += 1
            fields["seg_lens"] = bad
            expect = ("GL204", "batch_info.seg_lens")
        elif kind == "max_len":
            assume(max(lengths) > 0)
            fields["max_len"] = draw(st.integers(1, max(lengths))) - 1 or -1
            expect = ("GL204", "batch_info.max_len")
        else:
            assume(T > 0)
            fields["max_len"] = 0
            expect = ("GL203", "batch_info.max_len")
    x = torch.empty(T, 3)
    weights = torch.empty(slots, rank, 3)
    return x, weights, Info(**fields), lengths, expect


@SETTINGS
@given(case=lora_case(broken=False), strict=st.booleans())
def test_guard_lora_derives_reference_values(case, strict):
    clear_cache()
    x, weights, info, lengths, _ = case
    with mode("strict" if strict else "derive"):
        got = lora_shrink(x, weights, info)
    assert got is not info and info.max_len is None and info.seg_lens is None
    assert got.max_len == max(lengths) and got.seg_lens[:len(lengths)].tolist() == lengths


@SETTINGS
@given(case=lora_case(broken=True))
def test_guard_lora_strict_rejects_with_the_right_code(case):
    clear_cache()
    x, weights, info, _, (code, argument) = case
    with mode("strict"):
        with pytest.raises(GuardError) as info_:
            lora_shrink(x, weights, info)
    assert (info_.value.code, info_.value.argument) == (code, argument), str(info_.value)
