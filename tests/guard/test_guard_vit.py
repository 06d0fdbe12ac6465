"""A 32-layer toy ViT derives once per forward; torch.compile and CUDA-graph capture behave."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import guardlint.guard.metadata as plan_module
from guardlint.guard import (GuardError, clear_cache, guard, guard_lora, guard_varlen, mode,
                             prepare_varlen_metadata, reset_stats, stats)

HEADS, HEAD_DIM, LAYERS = 2, 8, 32


@guard_varlen
def varlen_attention(q, k, v, cu_seqlens, *, sequence_lengths=None, max_seqlen=None, metadata=None):
    """Block-diagonal attention over packed sequences, with no host work of its own: the sequence of
    each token comes from ``sequence_lengths`` (``output_size`` keeps repeat_interleave sync-free)."""
    assert type(max_seqlen) is int and sequence_lengths.dtype == torch.int32
    T = q.shape[0]
    seq_id = torch.repeat_interleave(torch.arange(sequence_lengths.numel(), device=q.device), sequence_lengths.long(),
                                     output_size=T)
    mask = seq_id[:, None] == seq_id[None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cu_seqlens, metadata=None):
        q, k, v = self.qkv(x).view(x.shape[0], 3, HEADS, HEAD_DIM).unbind(1)
        out = varlen_attention(q, k, v, cu_seqlens, metadata=metadata)
        return x + self.proj(out.reshape(x.shape[0], -1))


class ToyViT(nn.Module):
    def __init__(self, layers=LAYERS):
        super().__init__()
        self.blocks = nn.ModuleList(Block(HEADS * HEAD_DIM) for _ in range(layers))

    def forward(self, x, cu_seqlens, prepare=False):
        metadata = prepare_varlen_metadata(cu_seqlens, x) if prepare else None
        for block in self.blocks:
            x = block(x, cu_seqlens, metadata)
        return x


def reference_forward(model, x, lengths):
    """Each image on its own through plain SDPA: what the packed forward must reproduce."""
    outs, start = [], 0
    for n in lengths:
        h = x[start:start + n]
        for block in model.blocks:
            q, k, v = block.qkv(h).view(n, 3, HEADS, HEAD_DIM).unbind(1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            h = h + block.proj(o.transpose(0, 1).reshape(n, -1))
        outs.append(h)
        start += n
    return torch.cat(outs)


@pytest.fixture(autouse=True)
def fresh():
    clear_cache()
    reset_stats()
    torch.manual_seed(0)
    yield
    clear_cache()


LENGTHS = [7, 3, 12, 1]


def images():
    x = torch.randn(sum(LENGTHS), HEADS * HEAD_DIM)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return x, cu


@torch.no_grad()
def test_vit_32_layers_one_read_per_forward():
    model = ToyViT()
    x, cu = images()
    out = model(x, cu)
    s = stats()
    assert s["host_reads"] == 1 and s["device_reads"] == 0
    assert s["derivations"] == {"diff": LAYERS, "max_of_diff": LAYERS} and s["cache_hits"] == 2 * (LAYERS - 1)
    assert len(s["events"]) == 2  # derived once, served 31 times
    torch.testing.assert_close(out, reference_forward(model, x, LENGTHS))
    model(x, cu)
    assert stats()["host_reads"] == 1  # the next forward with the same cu_seqlens reads nothing


@torch.no_grad()
def test_vit_host_list_cu_seqlens_reads_nothing():
    model = ToyViT()
    x, cu = images()
    out = model(x, cu.tolist())
    assert stats()["host_reads"] == 0
    torch.testing.assert_close(out, reference_forward(model, x, LENGTHS))


@torch.no_grad()
def test_vit_prepared_metadata_reads_once_and_derives_nothing():
    model = ToyViT()
    x, cu = images()
    out = model(x, cu, prepare=True)
    s = stats()
    assert s["host_reads"] == 1 and s["derivations"] == {}
    torch.testing.assert_close(out, reference_forward(model, x, LENGTHS))


@torch.no_grad()
def test_vit_new_batch_in_place_reads_again():
    model = ToyViT(layers=4)
    x, cu = images()
    model(x, cu)
    cu.copy_(torch.tensor([0, 3, 10, 22, 23], dtype=torch.int32))
    out = model(x, cu)
    assert stats()["host_reads"] == 2
    torch.testing.assert_close(out, reference_forward(model, x, [3, 7, 12, 1]))


@torch.no_grad()
def test_vit_strict_mode_validates_once_per_tensor_version():
    model = ToyViT()
    x, cu = images()
    with mode("strict"):
        model(x, cu)
    assert stats()["host_reads"] == 1 and stats()["checks"] == LAYERS


# -- torch.compile ----------------------------------------------------------------------------------

@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@torch.no_grad()
def test_compile_fullgraph_with_prepared_metadata(dynamo):
    block = Block(HEADS * HEAD_DIM)
    x, cu = images()
    meta = prepare_varlen_metadata(cu, x)
    compiled = torch.compile(lambda x, meta: block(x, meta.cu_seqlens, meta), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, meta), block(x, cu, meta))


@torch.no_grad()
def test_compile_fullgraph_with_values_passed(dynamo):
    x, cu = images()
    q = x.view(-1, HEADS, HEAD_DIM)
    lens = cu[1:] - cu[:-1]

    def attend(q, cu, lens):
        return varlen_attention(q, q, q, cu, sequence_lengths=lens, max_seqlen=12) * 2

    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, cu, lens), attend(q, cu, lens))


@torch.no_grad()
def test_compile_fullgraph_lora_with_max_len(dynamo):
    class Info:
        def __init__(self, max_len):
            self.max_len, self.seg_lens = max_len, None

    @guard_lora
    def shrink(x, weights, batch_info):
        return x @ weights[0].T * batch_info.max_len

    x, w = torch.randn(5, 4), torch.randn(2, 3, 4)
    info = Info(3)
    compiled = torch.compile(lambda x, w: shrink(x, w, info), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w), shrink(x, w, info))


@torch.no_grad()
def test_compile_fullgraph_generic_guard_and_strict_mode(dynamo):
    @guard(["GL101", "GL102"])
    def vision_attention(q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None, forward_metadata=None, **kwargs):
        return q * forward_metadata.flashinfer_max_seqlen + forward_metadata.sequence_lengths.sum()

    x, cu = images()
    q = x.view(-1, HEADS, HEAD_DIM)
    meta = prepare_varlen_metadata(cu, q, layout="cudnn", bucket=True)
    call = lambda q, meta: vision_attention(q, q, q, meta.cu_seqlens, 4, 23, forward_metadata=meta)  # noqa: E731
    torch.testing.assert_close(torch.compile(call, fullgraph=True, backend="eager")(q, meta), q * 4096 + 23)
    torch._dynamo.reset()
    with mode("strict"):
        block = Block(HEADS * HEAD_DIM)
        compiled = torch.compile(lambda x, meta: block(x, meta.cu_seqlens, meta), fullgraph=True, backend="eager")
        tokens_meta = prepare_varlen_metadata(cu, x)
        torch.testing.assert_close(compiled(x, tokens_meta), block(x, cu, tokens_meta))


@torch.no_grad()
def test_compile_call_that_derives_stays_correct(dynamo):
    # Deriving max_seqlen reads cu_seqlens: a graph break, not a wrong (baked-in) value.
    x, cu = images()
    q = x.view(-1, HEADS, HEAD_DIM)

    def attend(q, cu):
        return varlen_attention(q, q, q, cu) + 1

    compiled = torch.compile(attend, backend="eager")
    torch.testing.assert_close(compiled(q, cu), attend(q, cu))
    other = torch.tensor([0, 20, 21, 22, 23], dtype=torch.int32)
    torch.testing.assert_close(compiled(q, other), attend(q, other))
    cu.copy_(torch.tensor([0, 1, 2, 3, 23], dtype=torch.int32))
    torch.testing.assert_close(compiled(q, cu), attend(q, cu))


# -- CUDA graph capture (simulated on the CPU; the real one runs in bench/guard_sync.py) ------------

@pytest.fixture
def capturing(monkeypatch):
    monkeypatch.setattr(plan_module, "capturing", lambda device: True)


def test_capture_without_cached_metadata_is_gl105(capturing):
    x, cu = images()
    q = x.view(-1, HEADS, HEAD_DIM)
    with pytest.raises(GuardError) as info:
        varlen_attention(q, q, q, cu)
    assert (info.value.code, info.value.argument) == ("GL105", "cu_seqlens")
    assert "before" in str(info.value) and stats()["host_reads"] == 0


def test_capture_with_prepared_or_cached_metadata_runs(monkeypatch):
    x, cu = images()
    q = x.view(-1, HEADS, HEAD_DIM)
    meta = prepare_varlen_metadata(cu, q)
    varlen_attention(q, q, q, cu)  # warm-up call before capture fills the cache
    reads = stats()["host_reads"]
    monkeypatch.setattr(plan_module, "capturing", lambda device: True)
    varlen_attention(q, q, q, cu, metadata=meta)
    varlen_attention(q, q, q, cu)
    with mode("strict"):
        varlen_attention(q, q, q, cu, metadata=meta)
    assert stats()["host_reads"] == reads


def test_capture_upload_of_host_offsets_is_gl105(capturing):
    x, _ = images()
    with pytest.raises(GuardError) as info:
        prepare_varlen_metadata([0, 7, 10, 22, 23], x)
    assert info.value.code == "GL105"


def test_capture_strict_value_checks_are_skipped_not_synced(capturing):
    x, cu = images()
    q = x.view(-1, HEADS, HEAD_DIM)
    with mode("strict"):
        varlen_attention(q, q, q, cu, sequence_lengths=cu[1:] - cu[:-1], max_seqlen=12)
    assert stats()["checks_skipped"] == 1 and stats()["host_reads"] == 0


def test_capture_lora_derivation_is_gl105(capturing):
    class Info:
        def __init__(self):
            self.seg_indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
            self.num_segments, self.max_len, self.seg_lens = 2, None, None

    @guard_lora
    def shrink(x, weights, batch_info):
        return batch_info

    with pytest.raises(GuardError) as info:
        shrink(torch.randn(5, 4), torch.randn(2, 3, 4), Info())
    assert (info.value.code, info.value.argument) == ("GL105", "batch_info.seg_indptr")


@pytest.mark.gpu
def test_cuda_graph_capture_real():
    q = torch.randn(23, HEADS, HEAD_DIM, device="cuda")
    cu = torch.tensor([0, 7, 10, 22, 23], dtype=torch.int32, device="cuda")
    meta = prepare_varlen_metadata(cu, q)
    torch.cuda.synchronize()
    varlen_attention(q, q, q, cu, metadata=meta)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(GuardError) as info:
        with torch.cuda.graph(graph):
            varlen_attention(q, q, q, cu.clone())
    assert info.value.code == "GL105"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = varlen_attention(q, q, q, cu, metadata=meta)
    q.normal_()
    graph.replay()
    torch.testing.assert_close(out, varlen_attention(q, q, q, cu, metadata=meta))
