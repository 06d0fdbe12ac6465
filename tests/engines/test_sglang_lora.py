"""sglang's own LoRA kernel launchers run with the batch info guardlint completes (0.5.23).

``sgemm_lora_a_fwd`` and the absorbed-MLA ``step_a_q_fwd`` are taken from the pinned release with
``ast`` and run as written (their grids come from ``triton.cdiv(batch_info.max_len, BLOCK_S)``); the
``@triton.jit`` kernels are fakes that compute the shrink only over the rows the launched grid covers,
so a missing or too-small ``max_len`` is a wrong number here, as on the GPU.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
import triton

from guardlint.guard import clear_cache, guard_lora, stats
from source import Recorder, dataclass_fields, load

NEW = "sglang-0.5.23"
LENGTHS = (5, 20, 3, 33)
ADAPTER = (1, 0, 1, 2)
R, K = 4, 32


def utils() -> dict:
    return load(NEW, "sglang.srt.lora.utils", ["MoELoRABatchInfo", "LoRABatchInfo"],
                {"torch": torch, "dataclass": dataclasses.dataclass, "Optional": Optional})


def shrink_fake(grid, x, weights, output, N, K_, stack_num, *strides_and_info, **meta):
    """What ``_sgemm_lora_a_kernel`` computes: program (pid_s, segment) covers BLOCK_S rows."""
    seg_lens, seg_indptr, weight_indices, lora_ranks, perm = strides_and_info[7:12]
    assert isinstance(seg_lens, torch.Tensor), f"the kernel reads seg_lens, got {seg_lens!r}"
    block_s = strides_and_info[13]
    row_blocks = grid[0] // triton.cdiv(N, strides_and_info[14])
    for s in range(grid[1]):
        start, n = int(seg_indptr[s]), int(seg_lens[s])
        w = weights[int(weight_indices[s])]
        rank = int(lora_ranks[int(weight_indices[s])]) * stack_num
        rows = range(start, start + min(n, row_blocks * block_s))
        for r in rows:
            output[r, :rank] = w[:rank] @ x[r]


class Launch(Recorder):
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((args, dict(kwargs, _grid=grid)))
            shrink_fake(grid, *args, **kwargs)
        return launch


def sgemm_a() -> dict:
    ns = {"torch": torch, "triton": triton, "LoRABatchInfo": utils()["LoRABatchInfo"],
          "_sgemm_lora_a_kernel": Launch()}
    return load(NEW, "sglang.kernels.ops.lora.dense.sgemm_lora_a", ["sgemm_lora_a_fwd"], ns)


def batch(info_cls, *, max_len=None, seg_lens=None, extra_segments=0):
    """A batch info as the engine builds it (keywords: the field order changed between releases)."""
    lengths = list(LENGTHS) + [0] * extra_segments
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return info_cls(use_cuda_graph=extra_segments > 0, bs=len(LENGTHS), num_segments=len(LENGTHS),
                    seg_indptr=indptr, weight_indices=torch.tensor(list(ADAPTER) + [0] * extra_segments,
                                                                   dtype=torch.int32),
                    lora_ranks=torch.tensor([R, R, 2], dtype=torch.int32), scalings=torch.ones(3),
                    max_len=max_len, seg_lens=seg_lens)


def inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(LENGTHS), K, generator=g)
    w = torch.randn(3, R, K, generator=g)
    return x, w


def reference(x, w):
    out = torch.zeros(x.shape[0], R)
    start = 0
    ranks = (R, R, 2)
    for n, a in zip(LENGTHS, ADAPTER):
        out[start:start + n, :ranks[a]] = (x[start:start + n].double() @ w[a, :ranks[a]].double().T).float()
        start += n
    return out


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_cache()
    yield
    clear_cache()


def test_the_engines_batch_info_has_the_fields_the_guard_reads():
    fields = dataclass_fields(NEW, "sglang.srt.lora.utils", "LoRABatchInfo")
    assert len(fields) == 16
    for name in ("use_cuda_graph", "bs", "num_segments", "seg_indptr", "weight_indices", "lora_ranks",
                 "scalings", "max_len", "seg_lens", "permutation"):
        assert name in fields


def test_unguarded_launch_without_max_len_fails_in_the_engine():
    fwd = sgemm_a()["sgemm_lora_a_fwd"]
    x, w = inputs()
    with pytest.raises(TypeError):
        fwd(x, w, batch(utils()["LoRABatchInfo"]))  # triton.cdiv(None, BLOCK_S)


@pytest.mark.parametrize("given", ["neither", "seg_lens only", "cuda-graph buffer"])
def test_guard_lora_completes_the_engines_batch_info(given):
    ns = sgemm_a()
    info_cls = utils()["LoRABatchInfo"]
    x, w = inputs()
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    info = {"neither": lambda: batch(info_cls),
            "seg lens only": None,
            "seg_lens only": lambda: batch(info_cls, seg_lens=lens),
            "cuda-graph buffer": lambda: batch(info_cls, extra_segments=4)}[given]()
    guarded = guard_lora(ns["sgemm_lora_a_fwd"], weights="weights")
    out = torch.zeros(x.shape[0], R)
    got = guarded(x, w, info)
    # output rows past each slot's rank are the kernel's to leave alone: compare the ranked part
    for start, n, a in zip([0, 5, 25, 28], LENGTHS, ADAPTER):
        rank = (R, R, 2)[a]
        out[start:start + n, :rank] = got[start:start + n, :rank]
    torch.testing.assert_close(out, reference(x, w))
    args, kw = ns["_sgemm_lora_a_kernel"].last
    assert kw["_grid"] == (triton.cdiv(max(LENGTHS), 16) * triton.cdiv(R, 16), len(LENGTHS))
    assert args[13][:len(LENGTHS)].tolist() == list(LENGTHS)  # seg_lens reached the kernel
    assert info.max_len is None  # the caller's object is never mutated
    # Every LoRA layer of the forward gets the same batch info: derived once, not per layer.
    before = stats()["host_reads"]
    for _ in range(4):
        guarded(x, w, info)
    assert stats()["host_reads"] == before


def test_the_absorbed_mla_path_raises_the_seed_error_and_the_guard_prevents_it():
    info_cls = utils()["LoRABatchInfo"]
    kernel = Recorder()
    ns = load(NEW, "sglang.kernels.ops.lora.dense.kv_b_lora_absorbed",
              ["_BLOCK_S", "_STEP_A_BLOCK_K", "_STEP_A_BLOCK_N", "_num_segments", "_max_segment_len",
               "_segment_grid_size", "step_a_q_fwd"],
              {"torch": torch, "triton": triton, "LoRABatchInfo": info_cls, "_step_a_q_kernel": kernel})
    H, nope, full_k = 2, 8, 12
    q_nope = torch.randn(sum(LENGTHS), H, nope)
    B_buf = torch.randn(3, H * full_k, R)
    with pytest.raises(ValueError, match="LoRA batch_info must provide max_len or seg_lens."):
        ns["step_a_q_fwd"](q_nope, B_buf, batch(info_cls), full_k)
    guarded = guard_lora(ns["step_a_q_fwd"], x="q_nope", weights="B_buf")
    guarded(q_nope, B_buf, batch(info_cls), full_k)
    _, kw = kernel.last
    assert kw["_grid"] == (triton.cdiv(max(LENGTHS), 16) * triton.cdiv(R, 16), H, len(LENGTHS))
