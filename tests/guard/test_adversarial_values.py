"""Adversarial callers: values that contradict cu_seqlens, metadata that lies, strict mode under torch.compile.

Every call ends in a coded GuardError naming the argument, or in an output equal to a float64 reference
(backend="sdpa"): no silent wrong result, no uncoded exception. CPU tensors throughout.
"""
from __future__ import annotations

import dataclasses
import signal
from typing import Any, Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guardlint.guard import (VERIFIED, GuardError, clear_cache, guard, guard_cudnn_vision, guard_varlen, mode,
                             prepare_varlen_metadata, reset_stats, stats)
from guardlint.integrations import transformers as gl_transformers
from guardlint.kernels import cudnn_vision_attention, varlen_attention

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
H, D = 2, 16


@pytest.fixture(autouse=True)
def fresh():
    clear_cache()
    reset_stats()
    # No call may hang: a test that runs past a minute fails instead of stalling the suite.
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("timed out", pytrace=False))
    signal.alarm(60)
    yield
    signal.alarm(0)
    clear_cache()


def offsets_of(lengths) -> list:
    return [0, *np.cumsum(lengths, dtype=np.int64).tolist()]


def inputs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    return tuple(torch.randn(T, H, D, generator=g) for _ in range(3))


def reference(q, k, v, offsets, causal=False) -> torch.Tensor:
    """Each sequence on its own in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    out = torch.zeros_like(q)
    for s, e in zip(offsets[:-1], offsets[1:]):
        if e > s:
            out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                      v[s:e].transpose(0, 1), is_causal=causal).transpose(0, 1)
    return out


def as_form(values, form: str) -> Any:
    if form == "list":
        return list(values)
    if form == "numpy-view":
        return torch.from_numpy(np.array(values, dtype=np.int32))
    return torch.tensor(values, dtype=torch.int64 if form == "int64" else torch.int32)


def settle(call, codes: dict, ref: Optional[torch.Tensor]):
    """The call ends in a GuardError whose (code, argument) is one of ``codes``, or in ``ref``."""
    try:
        out = call()
    except GuardError as error:
        assert (error.code, error.argument) in codes, (error.code, error.argument, str(error))
        return error
    assert ref is not None, "expected a coded error, got an output"
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    return out


# -- a caller's max_seqlen against the facts ----------------------------------------------------------

@dataclasses.dataclass
class EngineMetadata:
    """Duck-typed metadata as engines keep it (cu_seqlens and a host max)."""

    cu_seqlens: Any
    max_seqlen: Any
    seq_lens: Any = None


class Layer(torch.nn.Module):
    is_causal = False


def _transformers(q, k, v, cu, mx):
    out, _ = gl_transformers.attention_forward(Layer(), q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], None, cu_seq_lens_q=cu, max_length_q=mx,
                                               is_causal=False)
    return out[0]


PATHS = {
    "kwarg": lambda q, k, v, cu, mx, lens: varlen_attention(q, k, v, cu, max_seqlen=mx, backend="sdpa"),
    "kwarg+lengths": lambda q, k, v, cu, mx, lens: varlen_attention(q, k, v, cu, max_seqlen=mx, backend="sdpa",
                                                                    sequence_lengths=lens),
    "duck metadata": lambda q, k, v, cu, mx, lens: varlen_attention(q, k, v, None, backend="sdpa",
                                                                    metadata=EngineMetadata(cu, mx)),
    "duck metadata beside cu": lambda q, k, v, cu, mx, lens: varlen_attention(
        q, k, v, cu, backend="sdpa", metadata=EngineMetadata(cu, mx, lens)),
    "prepared beside kwarg": lambda q, k, v, cu, mx, lens: varlen_attention(
        q, k, v, cu, max_seqlen=mx, backend="sdpa", metadata=prepare_varlen_metadata(cu, q)),
    "cudnn kwargs": lambda q, k, v, cu, mx, lens: cudnn_vision_attention(
        q, k, v, cu, 1, q.shape[0], max_seqlen=mx, sequence_lengths=lens, backend="sdpa"),
    "cudnn kwargs, lengths derived": lambda q, k, v, cu, mx, lens: cudnn_vision_attention(
        q, k, v, cu, 1, q.shape[0], max_seqlen=mx, backend="sdpa"),
    "transformers max_length_q": lambda q, k, v, cu, mx, lens: _transformers(q, k, v, cu, mx),
}
MAX_NAMES = {("GL103", name) for name in ("max_seqlen", "metadata.max_seqlen", "max_length_q")}


@SETTINGS
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(lambda x: sum(x) > 0),
       lie=st.integers(-9, 3), form=st.sampled_from(["int32", "int64", "numpy-view"]),
       path=st.sampled_from(sorted(PATHS)), strict=st.booleans())
def test_adversarial_max_seqlen_below_the_longest_is_refused_above_runs(lengths, lie, form, path, strict):
    clear_cache()
    offsets = offsets_of(lengths)
    longest = max(lengths)
    mx = max(longest + lie, 0)
    q, k, v = inputs(lengths)
    cu = as_form(offsets, form)
    lens = torch.tensor(lengths, dtype=torch.int32)
    with mode("strict" if strict else "derive"):
        got = settle(lambda: PATHS[path](q, k, v, cu, mx, lens), MAX_NAMES,
                     reference(q, k, v, offsets) if mx >= longest else None)
    assert isinstance(got, GuardError) == (mx < longest)


def test_adversarial_max_seqlen_checked_where_the_guard_read_the_offsets():
    """The guard reads cu_seqlens to derive the lengths: the max it then knows is 20, the caller's 10 is refused."""
    q, k, v = inputs([20, 5, 7])
    cu = torch.tensor([0, 20, 25, 32], dtype=torch.int32)
    for path in PATHS:
        with pytest.raises(GuardError) as info:
            PATHS[path](q, k, v, cu, 10, torch.tensor([20, 5, 7], dtype=torch.int32))
        assert (info.value.code, info.value.argument) in MAX_NAMES, path
        assert "10" in info.value.got and "20" in info.value.expected or path.startswith("cudnn")


@SETTINGS
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(lambda x: sum(x) > 0),
       index=st.integers(0, 4), delta=st.integers(-3, 3), cudnn=st.booleans())
def test_adversarial_sequence_lengths_that_are_not_the_differences(lengths, index, delta, cudnn):
    clear_cache()
    offsets = offsets_of(lengths)
    q, k, v = inputs(lengths)
    cu = torch.tensor(offsets, dtype=torch.int32)
    given_lengths = list(lengths)
    given_lengths[index % len(lengths)] += delta
    lens = torch.tensor(given_lengths, dtype=torch.int32)
    if cudnn:
        call = lambda: cudnn_vision_attention(q, k, v, cu, 1, q.shape[0], max_seqlen=64,  # noqa: E731
                                              sequence_lengths=lens, backend="sdpa")
    else:
        call = lambda: varlen_attention(q, k, v, cu, max_seqlen=64, sequence_lengths=lens,  # noqa: E731
                                        backend="sdpa")
    settle(call, {("GL103", "sequence_lengths")}, reference(q, k, v, offsets) if delta == 0 else None)


# -- metadata made from other offsets ---------------------------------------------------------------

@SETTINGS
@given(lengths=st.lists(st.integers(1, 9), min_size=2, max_size=5), shift=st.integers(-2, 2),
       layout=st.sampled_from(["tokens", "cudnn"]), entry=st.sampled_from(["varlen", "cudnn"]),
       strict=st.booleans())
def test_adversarial_metadata_from_other_offsets(lengths, shift, layout, entry, strict):
    clear_cache()
    offsets = offsets_of(lengths)
    other = list(offsets)
    other[1] = min(max(other[1] + shift, 0), other[2])
    q, k, v = inputs(lengths)
    cu = torch.tensor(offsets, dtype=torch.int32)
    meta = prepare_varlen_metadata(torch.tensor(other, dtype=torch.int32), q, layout=layout, bucket=layout == "cudnn")
    if entry == "varlen":
        call = lambda: varlen_attention(q, k, v, cu, metadata=meta, backend="sdpa")  # noqa: E731
    else:
        call = lambda: cudnn_vision_attention(q, k, v, cu, 1, q.shape[0], forward_metadata=meta,  # noqa: E731
                                              backend="sdpa")
    with mode("strict" if strict else "derive"):
        settle(call, {("GL103", "cu_seqlens")}, reference(q, k, v, offsets) if other == offsets else None)


def test_adversarial_engine_cudnn_metadata_from_other_offsets():
    """The engine's own cuDNN metadata (packed element indptrs on the host) beside a cu_seqlens it does not
    describe: refused in derive mode, with no device read."""
    q, k, v = inputs([4, 8])
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)

    @dataclasses.dataclass
    class VisionMetadata:
        packed_indptrs: torch.Tensor
        sequence_lengths: torch.Tensor
        flashinfer_max_seqlen: int

    def engine(offsets, lengths, mx):
        section = torch.tensor(offsets, dtype=torch.int32) * H * D
        return VisionMetadata(torch.cat([section] * 3), torch.tensor(lengths, dtype=torch.int32).view(-1, 1, 1, 1), mx)

    good = engine([0, 4, 12], [4, 8], 4096)
    out = cudnn_vision_attention(q, k, v, cu, 1, 12, forward_metadata=good, backend="sdpa")
    torch.testing.assert_close(out.double(), reference(q, k, v, [0, 4, 12]), atol=2e-5, rtol=1e-4)
    for fm, argument in ((engine([0, 6, 12], [6, 6], 4096), "cu_seqlens"),
                         (engine([0, 4, 12], [4, 7], 4096), "forward_metadata.sequence_lengths"),
                         (engine([0, 4, 12], [4, 8], 6), "forward_metadata.flashinfer_max_seqlen")):
        with pytest.raises(GuardError) as info:
            cudnn_vision_attention(q, k, v, cu, 1, 12, forward_metadata=fm, backend="sdpa")
        assert (info.value.code, info.value.argument) == ("GL103", argument)
    assert stats()["device_reads"] == 0


# -- prepared metadata is checked, never taken as validated -------------------------------------------

@pytest.mark.parametrize("strict", [False, True])
def test_adversarial_replaced_metadata_is_checked(strict):
    q, k, v = inputs([20, 5, 7])
    cu = torch.tensor([0, 20, 25, 32], dtype=torch.int32)
    meta = prepare_varlen_metadata(cu, q)
    forged = {
        "max_seqlen": (dataclasses.replace(meta, max_seqlen=5), "metadata.max_seqlen"),
        "host offsets": (dataclasses.replace(meta, host_cu_seqlens=(0, 10, 25, 32)), "metadata.cu_seqlens"),
        "batch size": (dataclasses.replace(meta, batch_size=2), "metadata"),
        "lengths": (dataclasses.replace(meta, seq_lens=torch.tensor([10, 15, 7], dtype=torch.int32)),
                    "metadata.seq_lens"),
    }
    with mode("strict" if strict else "derive"):
        for name, (fake, argument) in forged.items():
            for cu_arg in (cu, None, fake.cu_seqlens):
                with pytest.raises(GuardError) as info:
                    varlen_attention(q, k, v, cu_arg, metadata=fake, backend="sdpa")
                assert info.value.code == "GL103", name
                # Named by what it contradicts: the field, or the offsets the object claims to describe.
                assert info.value.argument in (argument, "cu_seqlens", "metadata"), (name, info.value.argument)
        # A larger max is only a launch size: it runs, and right.
        roomy = dataclasses.replace(meta, max_seqlen=64)
        torch.testing.assert_close(varlen_attention(q, k, v, cu, metadata=roomy, backend="sdpa").double(),
                                   reference(q, k, v, [0, 20, 25, 32]), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("strict", [False, True])
def test_adversarial_prepared_metadata_written_in_place(strict):
    q, k, v = inputs([3, 9])
    cu = torch.tensor([0, 3, 12], dtype=torch.int32)
    meta = prepare_varlen_metadata(cu, q)
    meta.cu_seqlens[1] = 6  # the object's own tensor, as an engine refilling its buffers would
    with mode("strict" if strict else "derive"):
        for cu_arg in (None, meta.cu_seqlens):
            with pytest.raises(GuardError) as info:
                varlen_attention(q, k, v, cu_arg, metadata=meta, backend="sdpa")
            assert info.value.code == "GL103" and info.value.argument in ("metadata", "cu_seqlens",
                                                                          "metadata.cu_seqlens")


def test_adversarial_strict_rereads_a_prepared_object_in_one_read():
    q, k, v = inputs([3, 9])
    cu = torch.tensor([0, 3, 12], dtype=torch.int32)
    meta = prepare_varlen_metadata(cu, q, layout="cudnn", bucket=True)
    reset_stats()
    with mode("strict"):
        for _ in range(4):
            cudnn_vision_attention(q, k, v, cu, 1, 12, forward_metadata=meta, backend="sdpa")
    s = stats()
    assert s["host_reads"] == 1 and s["checks"] == 4


# -- strict mode under torch.compile --------------------------------------------------------------------

@guard_varlen
def attend(q, k, v, cu_seqlens, *, sequence_lengths=None, max_seqlen=None, metadata=None):
    return q * max_seqlen + sequence_lengths.sum()


@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@torch.no_grad()
def test_adversarial_strict_under_compile_checks_as_the_graph_runs(dynamo):
    q, _, _ = inputs([5, 7])
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    lens = cu[1:] - cu[:-1]
    with mode("strict"):
        compiled = torch.compile(lambda q, cu, lens, mx: attend(q, q, q, cu, sequence_lengths=lens, max_seqlen=mx),
                                 fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(q, cu, lens, 7), q * 7 + 12)
        with pytest.raises(GuardError) as info:
            compiled(q, cu, lens, 3)  # the same graph, other values: checked at this call
        assert (info.value.code, info.value.argument) == ("GL103", "max_seqlen")
        with pytest.raises(GuardError) as info:
            compiled(q, cu, torch.tensor([6, 6], dtype=torch.int32), 7)
        assert (info.value.code, info.value.argument) == ("GL103", "sequence_lengths")
        forged = dataclasses.replace(prepare_varlen_metadata(cu, q), max_seqlen=5)
        on_meta = torch.compile(lambda q, meta: attend(q, q, q, meta.cu_seqlens, metadata=meta), fullgraph=True,
                                backend="eager")
        with pytest.raises(GuardError) as info:
            on_meta(q, forged)
        assert (info.value.code, info.value.argument) == ("GL103", "metadata.max_seqlen")


# -- the generic decorator validates what it derives --------------------------------------------------

@SETTINGS
@given(offsets=st.lists(st.integers(0, 20), min_size=2, max_size=6), form=st.sampled_from(["int32", "list"]))
def test_adversarial_generic_guard_refuses_negative_lengths(offsets, form):
    @guard("GL101", cu_seqlens="cu", sequence_lengths="lens")
    def attn(x, cu, lens=None):
        return lens

    offsets = [0, *offsets]
    bad = any(b < a for a, b in zip(offsets, offsets[1:]))
    try:
        lens = attn(None, as_form(offsets, form))
    except GuardError as error:
        assert bad and (error.code, error.argument) == ("GL103", "cu")
        assert "non-decreasing" in error.expected and "index" in error.got
        return
    assert not bad and lens.tolist() == [b - a for a, b in zip(offsets, offsets[1:])]


# -- the flag the kernels read: was max_seqlen proven? -------------------------------------------------

@guard_varlen
def flagged(q, k, v, cu_seqlens, *, sequence_lengths=None, max_seqlen=None, metadata=None,
            max_seqlen_verified=False):
    return max_seqlen, max_seqlen_verified


@guard_cudnn_vision
def flagged_cudnn(q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None, forward_metadata=None, *,
                  max_seqlen_verified=False, **kwargs):
    return max_seqlen_verified


def test_adversarial_max_seqlen_verified_flag():
    assert VERIFIED == "max_seqlen_verified"
    q, _, _ = inputs([5, 7])
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    lens = cu[1:] - cu[:-1]
    assert flagged(q, q, q, cu) == (7, True)                                        # derived from a read
    assert flagged(q, q, q, cu, max_seqlen=9, sequence_lengths=lens) == (9, True)     # host offsets: checked
    assert flagged(q, q, q, cu, metadata=prepare_varlen_metadata(cu, q)) == (7, True)
    assert flagged(q, q, q, [0, 5, 12], max_seqlen=7, max_seqlen_verified=False) == (7, True)
    # A caller cannot claim it: the guard overwrites the flag, in every mode.
    with mode("off"):
        assert flagged(q, q, q, cu, max_seqlen=3, sequence_lengths=lens, max_seqlen_verified=True) == (3, False)
    # Offsets whose values the guard does not have (here: the meta device) and no read planned: passed on,
    # unverified, with no read added.
    reset_stats()
    device_cu = torch.empty(3, dtype=torch.int32, device="meta")
    assert flagged(q, q, q, device_cu, max_seqlen=3, sequence_lengths=lens, max_seqlen_verified=True) == (3, False)
    assert stats()["host_reads"] == 0
    assert flagged_cudnn(q, q, q, cu, 1, 12) is True
    assert flagged_cudnn(q, q, q, cu, 1, 12, sequence_lengths=lens, max_seqlen=7) is True
    with mode("off"):
        assert flagged_cudnn(q, q, q, cu, 1, 12, max_seqlen_verified=True) is False


# -- host reads: the verify-on-read path costs none of its own --------------------------------------------

class Block(torch.nn.Module):
    def forward(self, x, cu, max_seqlen):
        q = x.view(x.shape[0], H, D)
        return x + varlen_attention(q, q, q, cu, max_seqlen=max_seqlen, backend="sdpa").reshape(x.shape)


@torch.no_grad()
def test_adversarial_vit_32_layers_verifies_a_passed_max_with_the_one_read():
    blocks = [Block() for _ in range(32)]
    lengths = [7, 3, 12, 1]
    x = torch.randn(sum(lengths), H * D)
    cu = torch.tensor(offsets_of(lengths), dtype=torch.int32)
    for block in blocks:
        x = block(x, cu, 12)
    assert stats()["host_reads"] == 1 and stats()["device_reads"] == 0
    reset_stats()
    with pytest.raises(GuardError) as info:
        blocks[0](x, torch.tensor(offsets_of(lengths), dtype=torch.int32), 11)
    assert (info.value.code, info.value.argument) == ("GL103", "max_seqlen") and stats()["host_reads"] == 1
    reset_stats()
    for block in blocks:  # host offsets in a list: nothing to read
        x = block(x, offsets_of(lengths), 12)
    assert stats()["host_reads"] == 0
