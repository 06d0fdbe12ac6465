"""LoRA GEMMs meet the guard and their own input checks: derived batch info, strict-mode codes
(GL203, GL204), bad inputs (GL205 naming the argument), no-driver (GL301), and torch.compile.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from guardlint.contracts import LORA_FIELDS
from guardlint.guard import GuardError, mode
from guardlint.kernels.lora import api as lora
from guardlint.kernels.lora import triton as lora_triton
from guardlint.kernels.lora import (LoRABatchInfo, qkv_lora_b, sgemm_lora_a, sgemm_lora_a_reference, sgemm_lora_b,
                                    sgemm_lora_b_reference, step_a_q, step_a_q_reference, step_a_v, step_b_q,
                                    step_b_v)
from test_lora import SLOTS, check, layout, rand

MLA = dict(qk_nope_head_dim=8, v_head_dim=4)


def shrink_inputs(name="mixed", dtype=torch.float32, **kw):
    info, S = layout(name, 16, **kw)
    return rand(S, 32, dtype=dtype, seed=1), rand(SLOTS, 16, 32, dtype=dtype, seed=2), info


def test_lora_batch_info_fields_follow_the_catalog():
    # ours carries the engine's first ten fields, in the engine's order (the engine's six later ones
    # serve its MoE and lm_head paths)
    ours = tuple(f.name for f in dataclasses.fields(LoRABatchInfo))
    assert ours == LORA_FIELDS[:10]
    info, _ = layout("mixed", 16)
    with pytest.raises(TypeError):
        LoRABatchInfo(*[getattr(info, f) for f in ours])


@pytest.mark.parametrize("name", ["mixed", "graph_padded_permuted"])
def test_sgemm_lora_a_derives_missing_max_len_and_seg_lens(name):
    x, w, prepared = shrink_inputs(name)
    bare = dataclasses.replace(prepared, max_len=None, seg_lens=None)
    out = sgemm_lora_a(x, w, bare)
    assert bare.max_len is None and bare.seg_lens is None, "the caller's batch info must not change"
    assert torch.equal(out, sgemm_lora_a(x, w, prepared))
    check(out, sgemm_lora_a_reference(x, w, prepared), sgemm_lora_a_reference(x.double(), w.double(), prepared))


def test_mla_step_derives_max_len_with_weights_named_lora_b():
    info, S = layout("permuted", 4)
    q_nope = rand(S, 2, 8, dtype=torch.float32, seed=3)
    lora_b = rand(SLOTS, 2 * 12, 4, dtype=torch.float32, seed=4)
    bare = dataclasses.replace(info, max_len=None)
    torch.testing.assert_close(step_a_q(q_nope, lora_b, bare, **MLA),
                               step_a_q_reference(q_nope, lora_b, info, **MLA), rtol=1e-5, atol=1e-5)


def test_strict_mode_rejects_zero_max_len_with_tokens():
    x, w, info = shrink_inputs()
    with mode("strict"), pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, dataclasses.replace(info, max_len=0))
    assert err.value.code == "GL203"


def test_strict_mode_rejects_an_out_of_range_weight_index():
    x, w, info = shrink_inputs()
    info.weight_indices = info.weight_indices.clone()
    info.weight_indices[3] = SLOTS
    with mode("strict"), pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, info)
    assert err.value.code == "GL204" and "weight_indices" in err.value.argument


def test_strict_mode_rejects_a_rank_above_the_stored_rank():
    info, S = layout("mixed", 8)
    x, w = rand(S, 8, dtype=torch.float32, seed=5), rand(SLOTS, 24, 8, dtype=torch.float32, seed=6)
    info.lora_ranks = info.lora_ranks.clone()
    info.lora_ranks[0] = 9
    with mode("strict"), pytest.raises(GuardError) as err:
        sgemm_lora_b(x, w, info)
    assert err.value.code == "GL204" and "lora_ranks" in err.value.argument


def test_strict_mode_passes_a_good_batch():
    x, w, info = shrink_inputs("permuted")
    with mode("strict"):
        out = sgemm_lora_a(x, w, dataclasses.replace(info, max_len=None))
    check(out, sgemm_lora_a_reference(x, w, info), sgemm_lora_a_reference(x.double(), w.double(), info))


def test_off_mode_without_max_len_is_gl201_not_a_crash():
    x, w, info = shrink_inputs()
    with mode("off"), pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, dataclasses.replace(info, max_len=None, seg_lens=None))
    assert err.value.code == "GL201" and "max_len or seg_lens" in str(err.value)


@pytest.mark.parametrize("max_len", [0, 1])
def test_the_grid_does_not_depend_on_max_len_so_a_short_one_drops_no_tokens(max_len):
    """The grid is sized by the token count, not by max_len (as in the engine, where seg_lens alone is
    enough): with the check off, a max_len of 0 or 1 against a longest segment of 17 still covers every row."""
    x, w, info = shrink_inputs("permuted")
    with mode("off"):
        out = sgemm_lora_a(x, w, dataclasses.replace(info, max_len=max_len))
    check(out, sgemm_lora_a_reference(x, w, info), sgemm_lora_a_reference(x.double(), w.double(), info))


@pytest.mark.parametrize("packed", [False, True], ids=["segment-tiles", "packed-tiles"])
def test_out_of_range_slot_and_rank_are_no_adapter_instead_of_reading_out_of_bounds(packed, monkeypatch):
    monkeypatch.setattr(lora._k, "_PACKED_FROM_CLASS", 0 if packed else 99)
    info, S = layout("mixed", 16)
    info.weight_indices = info.weight_indices.clone()
    info.weight_indices[0] = 10 ** 6           # segment 0: rows 0..4
    info.lora_ranks = torch.tensor([16, 17, 0, 9], dtype=torch.int32)  # slot 1 (segments 1, 3): rank too big
    x, w = rand(S, 16, dtype=torch.float32, seed=7), rand(SLOTS, 40, 16, dtype=torch.float32, seed=8)
    base = rand(S, 40, dtype=torch.float32, seed=9)
    with pytest.raises(GuardError) as err:  # host tensors: checked in derive mode too
        sgemm_lora_b(x, w, info, base.clone())
    assert err.value.code == "GL204" and err.value.argument == "batch_info.weight_indices"
    with mode("off"):  # as device tensors go in derive mode: no value checks, max_len given
        out = sgemm_lora_b(x, w, info, base.clone())
    ref = sgemm_lora_b_reference(x, w, info, base.clone())
    bad = list(range(0, 5)) + list(range(6, 23))
    assert torch.equal(out[bad], base[bad]) and torch.equal(ref[bad], base[bad])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_corrupt_live_seg_indptr_is_clamped_to_x():
    x, w, info = shrink_inputs()
    info.seg_indptr = torch.tensor([0, 5, 10 ** 6, -3, 20, 30, 31], dtype=torch.int32)
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, info)
    assert err.value.code == "GL204" and err.value.argument == "batch_info.seg_indptr"
    with mode("off"):
        out = sgemm_lora_a(x, w, info)
    torch.testing.assert_close(out, sgemm_lora_a_reference(x, w, info), rtol=1e-5, atol=1e-5)


def _errors():
    """(case name, thunk) pairs that must raise GL205 naming the argument in the case name."""
    x, w, info = shrink_inputs()
    S = x.shape[0]
    y, wb = rand(S, 16, dtype=torch.float32, seed=3), rand(SLOTS, 24, 16, dtype=torch.float32, seed=4)
    qkv_x, qkv_w = rand(S, 12, dtype=torch.float32, seed=5), rand(SLOTS, 20, 4, dtype=torch.float32, seed=6)
    y3, la = rand(S, 2, 4, dtype=torch.float32, seed=7), rand(SLOTS, 4, 10, dtype=torch.float32, seed=8)
    lb = rand(SLOTS, 2 * 12, 4, dtype=torch.float32, seed=9)
    short = dataclasses.replace(info, lora_ranks=info.lora_ranks[:2])
    return {
        "weights: K mismatch": lambda: sgemm_lora_a(x, w[:, :, :16], info),
        "weights: dtype": lambda: sgemm_lora_a(x, w.half(), info),
        "weights: stack_num does not divide": lambda: sgemm_lora_a(x, w, info, stack_num=3),
        "x: 3-D": lambda: sgemm_lora_a(x[:, None], w, info),
        "x: integer dtype": lambda: sgemm_lora_a(x.long(), w.long(), info),
        "stack_num: zero": lambda: sgemm_lora_a(x, w, info, stack_num=0),
        "batch_info.lora_ranks: shorter than the slots": lambda: sgemm_lora_a(x, w, short),
        "batch_info.permutation: wrong length": lambda: sgemm_lora_a(
            x, w, dataclasses.replace(info, permutation=torch.arange(S - 1, dtype=torch.int32))),
        "batch_info.seg_indptr: float": lambda: sgemm_lora_a(
            x, w, dataclasses.replace(info, seg_indptr=info.seg_indptr.float())),
        "batch_info.max_len: a tensor": lambda: sgemm_lora_a(
            x, w, dataclasses.replace(info, max_len=torch.tensor(17))),
        "weights: rank mismatch": lambda: sgemm_lora_b(y, wb[:, :, :8], info),
        "base_output: wrong width": lambda: sgemm_lora_b(y, wb, info, torch.zeros(S, 23)),
        "base_output: wrong dtype": lambda: sgemm_lora_b(y, wb, info, torch.zeros(S, 24, dtype=torch.float64)),
        "base_output: overlapping rows": lambda: sgemm_lora_b(y, wb, info, torch.zeros(1, 24).expand(S, 24)),
        "x: not 3 ranks wide": lambda: qkv_lora_b(qkv_x[:, :8], qkv_w, info, [0, 8, 14, 20]),
        "output_offset: does not end at the stack height": lambda: qkv_lora_b(qkv_x, qkv_w, info, [0, 8, 14, 18]),
        "output_offset: three entries": lambda: qkv_lora_b(qkv_x, qkv_w, info, torch.tensor([0, 8, 14])),
        "lora_b: rows are not H * (qk_nope + v)": lambda: step_a_q(rand(S, 2, 8, dtype=torch.float32, seed=1),
                                                                   lb[:, :20], info, **MLA),
        "q_nope: head dim": lambda: step_a_q(rand(S, 2, 6, dtype=torch.float32, seed=1), lb, info, **MLA),
        "lora_a: rank mismatch": lambda: step_b_q(y3, la[:, :3], info),
        "lora_a: kv_lora_rank mismatch": lambda: step_a_v(rand(S, 2, 12, dtype=torch.float32, seed=1), la, info),
        "base_output: wrong head dim": lambda: step_b_v(y3, lb, info, torch.zeros(S, 2, 5), **MLA),
        "backend: unknown": lambda: sgemm_lora_a(x, w, info, backend="cuda"),
    }


@pytest.mark.parametrize("case", list(_errors()))
def test_bad_input_is_gl205_naming_the_argument(case):
    with pytest.raises(GuardError) as err:
        _errors()[case]()
    argument = case.split(":")[0]
    assert err.value.code == "GL205" and err.value.argument == argument, str(err.value)
    assert isinstance(err.value, ValueError) and isinstance(err.value, RuntimeError)
    text = str(err.value)
    assert "expected" in text and "got" in text and "guardlint explain GL205" in text


def test_bad_input_message_names_shapes_not_contents():
    x, w, info = shrink_inputs()
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w[:, :, :16], info)
    text = str(err.value)
    assert "shape=(4, 16, 16)" in text and "K=32" in text
    assert f"{float(w[0, 0, 0]):.4f}" not in text


def test_triton_without_driver_or_interpreter_is_gl301(monkeypatch):
    monkeypatch.setattr(lora_triton, "INTERPRET", False)
    x, w, info = shrink_inputs()
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, info, backend="triton")
    assert err.value.code == "GL301" and err.value.argument == "x"
    # The default backend falls back to the reference on a plain CPU.
    assert torch.equal(sgemm_lora_a(x, w, info), sgemm_lora_a_reference(x, w, info))


def test_torch_compile_fullgraph_sees_one_op_per_kernel():
    x, w, info = shrink_inputs("permuted")
    wb = rand(SLOTS, 24, 16, dtype=torch.float32, seed=3)
    base = rand(x.shape[0], 24, dtype=torch.float32, seed=4)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def lora_layer(x, w, wb, base, info):
        return sgemm_lora_b(sgemm_lora_a(x, w, info), wb, info, base) * 2

    compiled = torch.compile(lora_layer, fullgraph=True, backend=backend)
    out = compiled(x, w, wb, base.clone(), info)
    torch.testing.assert_close(out, lora_layer(x, w, wb, base.clone(), info), rtol=0, atol=0)
    assert seen.count("guardlint.sgemm_lora_a.default") == 1, seen
    assert seen.count("guardlint.sgemm_lora_b.default") == 1, seen
    torch._dynamo.reset()


def test_custom_ops_pass_opcheck():
    """Schema, fake impls, mutation declarations and dynamic-shape tracing, by torch.library.opcheck."""
    info, S = layout("permuted", 4)
    batch = lora._op_batch(lora._check_batch("test", torch.zeros(S, 1), info, SLOTS))
    f = dict(dtype=torch.float32)
    x, w = rand(S, 24, **f, seed=1), rand(SLOTS, 8, 24, **f, seed=2)
    y, wb = rand(S, 4, **f, seed=3), rand(SLOTS, 20, 4, **f, seed=4)
    y3, la = rand(S, 2, 4, **f, seed=5), rand(SLOTS, 4, 10, **f, seed=6)
    samples = [
        (torch.ops.guardlint.sgemm_lora_a, (x, w, *batch, 2)),
        (torch.ops.guardlint.sgemm_lora_b, (y, wb, torch.zeros(S, 20), *batch, True)),
        (torch.ops.guardlint.qkv_lora_b, (rand(S, 12, **f, seed=7), wb, torch.zeros(S, 20), *batch, False,
                                          [0, 8, 14, 20], None)),
        (torch.ops.guardlint.lora_step_a, (rand(S, 2, 10, **f, seed=8), la, [40, 0, 10, 1], 4, *batch)),
        (torch.ops.guardlint.lora_step_b, (y3, la, [40, 0, 1, 10], 0, torch.zeros(S, 2, 10), *batch, True)),
    ]
    for op, args in samples:
        torch.library.opcheck(op, args)
