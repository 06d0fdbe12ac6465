"""guard(contract, **rename): binding at decoration, None as missing, derivation, errors, modes, stats."""
import inspect
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from guardlint.contracts import contract_from_config
from guardlint.guard import (GuardError, VarlenMetadata, clear_cache, get_mode, guard, mode, on_derive,
                             reset_stats, set_mode, stats)


@pytest.fixture(autouse=True)
def fresh():
    clear_cache()
    reset_stats()
    on_derive(None)
    yield
    on_derive(None)
    set_mode("derive")


def vision_attention(q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None, forward_metadata=None, **kwargs):
    """The engine's signature: the prepared values travel through **kwargs."""
    return {"forward_metadata": forward_metadata, **kwargs}


guarded_vision = guard(["GL101", "GL102"])(vision_attention)


def batch(tokens=(5, 7), heads=2, head_dim=64):
    q = torch.randn(sum(tokens), heads, head_dim)
    cu = torch.tensor([0, *torch.tensor(tokens).cumsum(0).tolist()], dtype=torch.int32)
    return q, cu


def test_guard_gl101_gl102_met_calls_through_untouched():
    q, cu = batch()
    meta = object()
    got = guarded_vision(q, q, q, cu, 2, 12, forward_metadata=meta)
    assert got == {"forward_metadata": meta}
    lens = cu[1:] - cu[:-1]
    got = guarded_vision(q, q, q, cu, 2, 12, sequence_lengths=lens, max_seqlen=7)
    assert got["forward_metadata"] is None and got["sequence_lengths"] is lens and got["max_seqlen"] == 7
    assert stats()["derivations"] == {} and stats()["host_reads"] == 0


def test_guard_gl101_gl102_derives_forward_metadata_once_for_32_layers():
    q, cu = batch()
    first = guarded_vision(q, q, q, cu, 2, 12)["forward_metadata"]
    assert isinstance(first, VarlenMetadata) and first.layout == "cudnn"
    assert first.sequence_lengths.flatten().tolist() == [5, 7, 0, 0, 0, 0, 0, 0]
    for _ in range(31):
        assert guarded_vision(q, q, q, cu, 2, 12)["forward_metadata"] is first
    s = stats()
    assert s["host_reads"] == 1 and s["derivations"] == {"prepare_varlen_cudnn": 32} and s["cache_hits"] == 31


def test_guard_none_keyword_counts_as_missing():
    q, cu = batch()
    got = guarded_vision(q, q, q, cu, 2, 12, softmax_scale=None, forward_metadata=None,
                         sequence_lengths=None, max_seqlen=None)
    assert isinstance(got["forward_metadata"], VarlenMetadata)


def test_guard_only_max_seqlen_missing_derives_metadata():
    q, cu = batch()
    got = guarded_vision(q, q, q, cu, 2, 12, sequence_lengths=cu[1:] - cu[:-1])
    assert isinstance(got["forward_metadata"], VarlenMetadata)


@pytest.mark.parametrize("kwargs, code, argument", [
    ({}, "GL101", "sequence_lengths"),
    ({"sequence_lengths": torch.tensor([5, 7])}, "GL102", "max_seqlen"),
])
def test_guard_unmet_with_nothing_to_derive_raises_the_contract_code(kwargs, code, argument):
    q, _ = batch()
    with pytest.raises(GuardError) as info:
        guarded_vision(q, q, q, None, 2, 12, **kwargs)
    assert info.value.code == code and info.value.argument == argument
    assert info.value.function == "vision_attention"
    assert "cu_seqlens" in str(info.value) and "should be prepared" in str(info.value)


def test_guard_rename_maps_contract_names_to_parameters():
    @guard("GL101", cu_seqlens="cu", sequence_lengths="lens")
    def attn(x, cu, lens=None):
        return lens

    x, cu = batch((3, 4, 9))
    lens = attn(x, cu)
    assert lens.tolist() == [3, 4, 9] and lens.dtype == torch.int32
    assert stats()["events"][0].target == "lens" and stats()["events"][0].derivation == "diff"
    with pytest.raises(GuardError) as info:
        attn(x, None)
    assert (info.value.code, info.value.argument) == ("GL101", "lens")


def test_guard_derived_value_fills_a_positional_slot_passed_as_none():
    @guard(["GL101", "GL102"], cu_seqlens="cu", sequence_lengths="lens", max_seqlen="longest")
    def attn(x, cu, lens=None, longest=None):
        return lens, longest

    x, cu = batch((3, 9))
    lens, longest = attn(x, cu, None, None)
    assert lens.tolist() == [3, 9] and longest == 9 and type(longest) is int


def test_guard_prefers_derivations_without_host_reads():
    @guard("GL201")
    def kernel(x, seg_indptr, num_segments, max_len=None, seg_lens=None):
        return max_len, seg_lens

    seg_indptr = torch.tensor([0, 3, 7, 7, 7], dtype=torch.int32)
    max_len, seg_lens = kernel(None, seg_indptr, 2)
    assert max_len is None and seg_lens.tolist() == [3, 4, 0, 0]
    assert stats()["host_reads"] == 0


def test_guard_method_and_module_forward():
    class Attention(nn.Module):
        @guard(["GL101", "GL102"], cu_seqlens="cu")
        def forward(self, q, cu, sequence_lengths=None, max_seqlen=None, forward_metadata=None):
            return forward_metadata

    q, cu = batch()
    layer = Attention()
    assert isinstance(layer(q, cu), VarlenMetadata)
    assert layer(q, cu) is layer.forward(q, cu)


def test_guard_keeps_signature_and_wraps():
    sig = inspect.signature(vision_attention)
    assert inspect.signature(guarded_vision) == sig
    assert guarded_vision.__wrapped__ is vision_attention and guarded_vision.__name__ == "vision_attention"


def test_guard_positional_only_and_varargs_signatures():
    @guard("GL102", cu_seqlens="cu")
    def attn(q, /, cu, *extra, max_seqlen=None, **kw):
        return q, cu, extra, max_seqlen, kw

    q, cu = batch((2, 6))
    assert attn(q, cu, 1, 2, flag=True)[2:] == ((1, 2), 6, {"flag": True})


def test_guard_mode_off_calls_the_function_directly():
    q, cu = batch()
    with mode("off"):
        assert get_mode() == "off"
        assert guarded_vision(q, q, q, cu, 2, 12) == {"forward_metadata": None}
        assert guarded_vision(q, q, q, None, 2, 12) == {"forward_metadata": None}
    assert get_mode() == "derive"
    assert stats()["derivations"] == {}


def test_guard_strict_validates_given_values():
    q, cu = batch()
    with mode("strict"):
        ok = guarded_vision(q, q, q, cu, 2, 12, sequence_lengths=cu[1:] - cu[:-1], max_seqlen=7)
        assert ok["max_seqlen"] == 7
        with pytest.raises(GuardError) as info:
            guarded_vision(q, q, q, cu, 2, 12, sequence_lengths=cu[1:] - cu[:-1], max_seqlen=6)
        assert (info.value.code, info.value.argument) == ("GL103", "max_seqlen")
        with pytest.raises(GuardError) as info:
            guarded_vision(q, q, q, cu, 2, 12, sequence_lengths=torch.tensor([6, 6]), max_seqlen=7)
        assert (info.value.code, info.value.argument) == ("GL103", "sequence_lengths")
        with pytest.raises(GuardError) as info:
            guarded_vision(q, q, q, torch.tensor([0, 5, 11]), 2, 12)
        assert (info.value.code, info.value.argument) == ("GL103", "cu_seqlens")


def test_guard_user_contract_with_template_derivation():
    contract = contract_from_config({
        "call": "mylib.ops.segment_sum", "params": ["x", "offsets", "longest"], "require": [["longest"]],
        "derive": {"longest": "int(({offsets}[1:] - {offsets}[:-1]).max())"},
    })

    @guard(contract)
    def segment_sum(x, offsets, longest=None):
        return longest

    assert segment_sum(None, torch.tensor([0, 2, 9])) == 7
    assert stats()["derivations"] == {"template": 1}
    with pytest.raises(GuardError) as info:
        segment_sum(None, None)
    assert info.value.code == "GL001" and info.value.argument == "longest"


@pytest.mark.parametrize("build", [
    lambda: guard("GL101")(lambda q, cu_seqlens: None),                          # cannot receive any group
    lambda: guard("GL101", cu_seq="cu")(vision_attention),                        # unknown contract name
    lambda: guard("GL101", sequence_lengths="lens")(lambda q, cu_seqlens, x: 0),  # rename to nothing
    lambda: guard("GL999")(vision_attention),                                     # unknown code
    lambda: guard("GL103")(vision_attention),                                     # runtime-only contract
    lambda: guard([])(vision_attention),
    lambda: guard([object()])(vision_attention),
])
def test_guard_decoration_errors_are_gl002(build):
    with pytest.raises(GuardError) as info:
        build()
    assert info.value.code == "GL002"


def test_on_derive_reports_fresh_derivations_only():
    seen = []
    on_derive(seen.append)
    q, cu = batch()
    for _ in range(3):
        guarded_vision(q, q, q, cu, 2, 12)
    assert len(seen) == 1
    event = seen[0]
    assert (event.function, event.target, event.derivation, event.host_read) == \
        ("vision_attention", "forward_metadata", "prepare_varlen_cudnn", True)
    assert str(event).startswith("guardlint: derived forward_metadata for vision_attention()")
    with pytest.raises(TypeError):
        on_derive(42)


def test_stats_reset_and_events():
    q, cu = batch()
    guarded_vision(q, q, q, cu, 2, 12)
    assert stats()["events"]
    reset_stats()
    s = stats()
    assert s["host_reads"] == 0 and s["events"] == [] and s["derivations"] == {} and s["cache_hits"] == 0


def test_set_mode_rejects_unknown_names_and_context_restores():
    with pytest.raises(ValueError, match="set_mode"):
        set_mode("loud")
    with pytest.raises(RuntimeError):
        with mode("strict"):
            assert get_mode() == "strict"
            raise RuntimeError("boom")
    assert get_mode() == "derive"


def run_with_env(value, code):
    env = dict(os.environ, GUARDLINT_MODE=value)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_mode_from_environment_variable():
    done = run_with_env(" Strict ", "from guardlint.guard import get_mode; print(get_mode())")
    assert done.returncode == 0 and done.stdout.strip() == "strict"
    done = run_with_env("verbose", "import guardlint.guard")
    assert done.returncode != 0 and "GUARDLINT_MODE" in done.stderr and "'verbose'" in done.stderr


def test_guard_strict_without_q_checks_what_it_can():
    @guard(["GL101", "GL102"])
    def attn(cu_seqlens, sequence_lengths=None, max_seqlen=None):
        return sequence_lengths, max_seqlen

    cu = torch.tensor([0, 4, 9])
    with mode("strict"):
        assert attn(cu, cu[1:] - cu[:-1], 5)[1] == 5
        with pytest.raises(GuardError) as info:
            attn(cu, cu[1:] - cu[:-1], 4)
        assert (info.value.code, info.value.argument) == ("GL103", "max_seqlen")
        lens, longest = attn(cu)
        assert lens.tolist() == [4, 5] and longest == 5
