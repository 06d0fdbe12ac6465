"""How a LoRA GEMM call reaches its kernel: eagerly the launcher itself (no custom-op dispatch), the custom
op under dispatch modes, identical results either way; one launch per call, no host read of batch tensors,
autotuning once per launch key, batch checks remembered per batch info but never stale.
"""
from __future__ import annotations

import pytest
import torch
import triton.runtime.interpreter as interpreter
from torch.utils._python_dispatch import TorchDispatchMode

from guardlint.guard import GuardError
from guardlint.kernels.lora import api as lora
from guardlint.kernels.lora import triton as lora_triton
from guardlint.kernels.lora import (qkv_lora_b, sgemm_lora_a, sgemm_lora_a_reference, sgemm_lora_b,
                                    sgemm_lora_b_reference, step_a_q, step_a_v, step_b_q, step_b_v)
from test_lora import SLOTS, check, layout, rand

MLA = dict(qk_nope_head_dim=8, v_head_dim=4)
H, R = 2, 4


def calls(name="permuted"):
    """(public call name, thunk building fresh inputs and calling it, op name) for every custom op."""
    info, S = layout(name, R)
    f = dict(dtype=torch.float32)
    x, a = rand(S, 24, **f, seed=1), rand(SLOTS, 2 * R, 24, **f, seed=2)
    y, b = rand(S, R, **f, seed=3), rand(SLOTS, 20, R, **f, seed=4)
    y3, b3 = rand(S, 3 * R, **f, seed=5), rand(SLOTS, 20, R, **f, seed=6)
    q, lb = rand(S, H, 8, **f, seed=7), rand(SLOTS, H * 12, R, **f, seed=8)
    yh, la = rand(S, H, R, **f, seed=9), rand(SLOTS, R, 10, **f, seed=10)
    latent = rand(S, H, 10, **f, seed=11)
    base = lambda *shape: rand(*shape, **f, seed=12)  # noqa: E731
    return info, [
        ("sgemm_lora_a", lambda: sgemm_lora_a(x, a, info, 2), "sgemm_lora_a"),
        ("sgemm_lora_b", lambda: sgemm_lora_b(y, b, info, base(S, 20)), "sgemm_lora_b"),
        ("qkv_lora_b", lambda: qkv_lora_b(y3, b3, info, [0, 8, 14, 20], base(S, 20)), "qkv_lora_b"),
        ("step_a_q", lambda: step_a_q(q, lb, info, **MLA), "lora_step_a"),
        ("step_b_q", lambda: step_b_q(yh, la, info, base(S, H, 10)), "lora_step_b"),
        ("step_a_v", lambda: step_a_v(latent, la, info), "lora_step_a"),
        ("step_b_v", lambda: step_b_v(yh, lb, info, base(S, H, 4), **MLA), "lora_step_b"),
    ]


class RecordOps(TorchDispatchMode):
    """A dispatch mode that only records the ops it sees (as a tracer or profiler would)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", range(7), ids=[c[0] for c in calls()[1]])
def test_eager_launch_and_custom_op_give_identical_results(case, monkeypatch):
    _, entries = calls()
    name, call, op = entries[case]
    eager = call()
    # A dispatch mode on the stack must see the one opaque op, and get the same numbers from it.
    with RecordOps() as mode:
        via_op = call()
    assert f"guardlint.{op}.default" in mode.seen, mode.seen
    torch.testing.assert_close(via_op, eager, rtol=0, atol=0)
    # In plain eager mode the op's dispatch is never entered.
    for attr in ("_sgemm_lora_a_op", "_sgemm_lora_b_op", "_qkv_lora_b_op", "_step_a_op", "_step_b_op"):
        monkeypatch.setattr(lora, attr, lambda *args: pytest.fail("eager call went through the custom op"))
    torch.testing.assert_close(call(), eager, rtol=0, atol=0)


def test_parameter_weights_launch_directly_and_fake_tensors_see_the_op(monkeypatch):
    info, S = layout("mixed", 16)
    x = rand(S, 40, dtype=torch.float32, seed=1)
    w = torch.nn.Parameter(rand(SLOTS, 16, 40, dtype=torch.float32, seed=2), requires_grad=False)
    expect = sgemm_lora_a(x, w.detach(), info)
    monkeypatch.setattr(lora, "_sgemm_lora_a_op", lambda *args: pytest.fail("went through the custom op"))
    torch.testing.assert_close(sgemm_lora_a(x, w, info), expect, rtol=0, atol=0)
    monkeypatch.undo()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        out = sgemm_lora_a(fake.from_tensor(x), fake.from_tensor(w.detach()), info)
    assert out.shape == expect.shape and type(out) is not torch.Tensor


def test_inputs_that_require_grad_take_the_differentiable_reference(monkeypatch):
    """The Triton kernels have no backward: a call that needs a graph runs the torch reference (default
    backend) instead of the op, and the gradient flows."""
    info, S = layout("mixed", 16)
    x = rand(S, 40, dtype=torch.float32, seed=1).requires_grad_()
    w = rand(SLOTS, 16, 40, dtype=torch.float32, seed=2)
    seen = []
    real = lora._sgemm_lora_a_op
    monkeypatch.setattr(lora, "_sgemm_lora_a_op", lambda *args: seen.append(1) or real(*args))
    out = sgemm_lora_a(x, w, info)
    assert seen == [] and out.requires_grad
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    torch.testing.assert_close(out.detach(), sgemm_lora_a_reference(x.detach(), w, info))
    with torch.no_grad():
        torch.testing.assert_close(sgemm_lora_a(x, w, info), out.detach(), rtol=1e-5, atol=1e-5)
    assert seen == [], "a plain eager call launches directly, not through the op"


def test_eager_in_place_launch_bumps_the_version_counter():
    info, S = layout("mixed", 16)
    y, b, base = rand(S, 16, dtype=torch.float32, seed=1), rand(SLOTS, 40, 16, dtype=torch.float32, seed=2), \
        rand(S, 40, dtype=torch.float32, seed=3)
    before = base._version
    sgemm_lora_b(y, b, info, base)
    assert base._version > before


@pytest.fixture
def launches(monkeypatch):
    """Grids the interpreter runs."""
    grids = []
    original = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        grids.append(self.grid)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    return grids


def test_one_launch_and_no_host_read_per_call(launches, monkeypatch):
    """With max_len given, nothing on a call's path reads a tensor to the host (each read would be a
    device sync on a GPU), and each call is one kernel launch: no workspace pass, no zero-fill."""
    _, entries = calls("graph_padded_permuted")
    for _, call, _ in entries:
        call()  # first calls: autotuning keys, batch checks
    reads = []
    for attr in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, attr)
        monkeypatch.setattr(torch.Tensor, attr, lambda self, *a, _n=attr, _o=original, **k: reads.append(_n)
                            or _o(self, *a, **k))
    launches.clear()
    for _, call, _ in entries:
        call()
    monkeypatch.undo()
    assert reads == []
    assert len(launches) == len(entries)


def test_find_tile_scans_batches_longer_than_one_chunk_and_expand_splits_columns(monkeypatch):
    """decode: 9 one-token segments and the tail scanned 4 at a time: three chunks carry the tile count.
    Expand columns in two groups: 3 column tiles of 16, so one group loops twice and one once."""
    monkeypatch.setattr(lora_triton, "_INTERPRET_BLOCK_SEG", 4)
    monkeypatch.setattr(lora_triton, "_INTERPRET_GROUPS", 2)
    monkeypatch.setattr(lora_triton._shrink, "chosen", {})
    monkeypatch.setattr(lora_triton._expand, "chosen", {})
    for name in ("decode", "graph_padded_permuted"):
        info, S = layout(name, 16)
        x, a = rand(S, 40, dtype=torch.float32, seed=1), rand(SLOTS, 16, 40, dtype=torch.float32, seed=2)
        check(sgemm_lora_a(x, a, info), sgemm_lora_a_reference(x, a, info),
              sgemm_lora_a_reference(x.double(), a.double(), info))
        y, b = rand(S, 16, dtype=torch.float32, seed=3), rand(SLOTS, 40, 16, dtype=torch.float32, seed=4)
        check(sgemm_lora_b(y, b, info), sgemm_lora_b_reference(y, b, info),
              sgemm_lora_b_reference(y.double(), b.double(), info))
        base = rand(S, 40, dtype=torch.float32, seed=5)
        check(sgemm_lora_b(y, b, info, base.clone()), sgemm_lora_b_reference(y, b, info, base.clone()),
              sgemm_lora_b_reference(y.double(), b.double(), info, base.double()))


class FakeAutotuner:
    def __init__(self):
        self.runs = 0
        self.best_config = lora_triton._SHRINK_CONFIGS[1]

    def run(self, *args, grid, warmup, **meta):
        self.runs += 1
        self.grid = grid(self.best_config.kwargs)


def test_autotuning_runs_once_per_launch_key(monkeypatch):
    """GPU path with a stand-in autotuner and kernel: the first call of a key tunes (and launches once),
    later calls look the options up and launch the kernel directly with the tuned config."""
    tuner = lora_triton._Tuned(lora_triton._lora_shrink_kernel, lora_triton._SHRINK_CONFIGS, ["K"],
                               lora_triton._prune_shrink, {"BLOCK_S": 16, "BLOCK_K": 16})
    fake = FakeAutotuner()
    tuner.autotuner = fake
    direct = []
    monkeypatch.setattr(lora_triton, "INTERPRET", False)
    monkeypatch.setattr(lora_triton, "_shrink", tuner)
    monkeypatch.setattr(lora_triton.DirectLaunch, "__call__",
                        lambda self, args, grid: direct.append((grid, self.options)))
    x, w, out = torch.zeros(100, 64), torch.zeros(2, 16, 64), torch.zeros(100, 16)
    seg = torch.tensor([0, 60, 100], dtype=torch.int32)
    for _ in range(3):
        lora_triton.launch_shrink(x, (64, 0, 1), w, (1024, 0, 64, 1), out, (16, 0, 1), seg, seg, seg, None, 2, 100,
                                    1, 64, 16, 16)
    assert fake.runs == 1 and len(direct) == 2
    cfg = fake.best_config
    grid, kw = direct[0]
    # 100 tokens in 2 segments: at most ceil(100 / 32) + 2 + 1 (tail) token tiles, one column block.
    assert grid == fake.grid == (4 + 3, 1)
    assert kw["BLOCK_S"] == cfg.kwargs["BLOCK_S"] and kw["num_warps"] == cfg.num_warps
    assert kw["num_stages"] == cfg.num_stages and kw["BLOCK_N"] == 16 and kw["UPCAST"] is False


def test_first_launch_under_graph_capture_uses_a_fitting_config_and_tunes_later(monkeypatch):
    tuner = lora_triton._Tuned(lora_triton._lora_shrink_kernel, lora_triton._SHRINK_CONFIGS, ["K"],
                               lora_triton._prune_shrink, {"BLOCK_S": 16, "BLOCK_K": 16})
    tuner.autotuner = FakeAutotuner()
    launched = []
    names = lora_triton._lora_shrink_kernel.arg_names
    monkeypatch.setattr(tuner, "kernel", type("K", (), {"arg_names": names,
                                                        "run": lambda self, *a, grid, warmup, **kw:
                                                        launched.append((grid, kw))})())
    monkeypatch.setattr(lora_triton, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    # The pruning sees the launch's arguments by name: a decode-sized batch with K = 64 (too short to split).
    values = {"x_ptr": torch.zeros(8, 64), "K": 64, "size_class": 0}
    args = tuple(values.get(name) for name in names[:names.index("size_class") + 1])
    tuner.first_launch("key", args, {"BLOCK_N": 16}, lambda blocks: (blocks["BLOCK_S"], 1))
    assert tuner.autotuner.runs == 0 and tuner.chosen == {}
    (grid, kw), = launched
    assert grid == (lora_triton._SHRINK_CONFIGS[0].kwargs["BLOCK_S"], 1) and "num_warps" in kw


def test_tuning_an_in_place_launch_restores_its_output_once_and_launches_once_more(monkeypatch):
    """Trials of an accumulating launch add into the caller's output back to back (no copy around each
    one): it is saved before them and put back after, and the chosen config then updates it once."""
    names = lora_triton._lora_expand_kernel.arg_names
    out = torch.arange(6.0)
    launched = []

    class Trials(FakeAutotuner):
        def run(self, *args, grid, warmup, **meta):
            super().run(*args, grid=grid, warmup=warmup, **meta)
            out.mul_(-3).add_(7)  # what any number of trial runs and the tuner's own launch may leave

    def kernel_run(self, *args, grid, warmup, **kw):
        launched.append((grid, kw))
        out.add_(1)

    tuner = lora_triton._Tuned(lora_triton._lora_expand_kernel, lora_triton._EXPAND_CONFIGS, ["N"],
                               lora_triton._prune_expand, {"BLOCK_S": 16, "BLOCK_N": 16, "STAGES": 2})
    tuner.autotuner = Trials()
    tuner.autotuner.best_config = lora_triton._EXPAND_CONFIGS[0]
    monkeypatch.setattr(tuner, "kernel", type("K", (), {"arg_names": names, "run": kernel_run})())
    monkeypatch.setattr(lora_triton, "INTERPRET", False)
    values = {"x_ptr": torch.zeros(8, 16), "size_class": 2}
    args = tuple(values.get(name) for name in names[:names.index("size_class") + 1])
    meta = {"BLOCK_K": 16, "K_CHUNKS": 1}
    tuner.first_launch("key", args, meta, lambda blocks: (blocks["BLOCK_S"], 1), restore=out)
    assert torch.equal(out, torch.arange(6.0) + 1)
    (grid, kw), = launched
    assert tuner.autotuner.runs == 1 and grid == (32, 1) and kw["num_warps"] == 4 and kw["BLOCK_K"] == 16
    assert tuner.chosen["key"][:2] == (32, 128)
    # A fresh output (every element written by the tuner's own launch) is not launched again.
    tuner.first_launch("key2", args, meta, lambda blocks: (blocks["BLOCK_S"], 1))
    assert len(launched) == 1 and tuner.autotuner.runs == 2


def test_batch_checks_are_remembered_but_a_replaced_field_is_checked_again():
    info, S = layout("mixed", 16)
    x, a = rand(S, 40, dtype=torch.float32, seed=1), rand(SLOTS, 16, 40, dtype=torch.float32, seed=2)
    sgemm_lora_a(x, a, info)
    assert id(info) in lora._checked
    info.lora_ranks = info.lora_ranks[:2]
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x, a, info)
    assert err.value.code == "GL205" and err.value.argument == "batch_info.lora_ranks"
    # Another token count is another check (the permutation no longer has one entry per token).
    info, S = layout("permuted", 16)
    x = rand(S, 40, dtype=torch.float32, seed=1)
    sgemm_lora_a(x, a, info)
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x[:-1], a, info)
    assert err.value.argument == "batch_info.permutation"


def test_a_strided_batch_tensor_is_copied_at_every_call_never_remembered():
    """A non-contiguous seg_indptr is copied for the kernel; the copy must not outlive the call, or an
    in-place update of the caller's buffer (CUDA-graph style) would go unseen."""
    info, S = layout("mixed", 16)
    x, a = rand(S, 40, dtype=torch.float32, seed=1), rand(SLOTS, 16, 40, dtype=torch.float32, seed=2)
    wide = torch.zeros(2 * info.seg_indptr.shape[0], dtype=torch.int32)
    wide[::2] = info.seg_indptr
    info.seg_indptr = wide[::2]
    first = sgemm_lora_a(x, a, info)
    check(first, sgemm_lora_a_reference(x, a, info), sgemm_lora_a_reference(x.double(), a.double(), info))
    wide[2:2 * info.num_segments + 1:2] = 0  # every live segment empties: only the tail remains
    second = sgemm_lora_a(x, a, info)
    assert torch.equal(second, torch.zeros_like(second))


def test_split_k_is_tried_only_where_token_tiles_are_few_and_k_is_long(monkeypatch):
    """Split configs are kept for up to 1024 tokens when every slice gets two K steps; a prefill-sized
    batch, or a short K (the MLA steps), tunes over single-pass configs only; 16-token tiles only for
    decode-shaped batches (8 tokens a segment or fewer)."""
    K_ = lora_triton
    assert [K_._size_class(t, s) for t, s in ((64, 64), (128, 8), (512, 4), (4096, 8), (4096, 1024))] == [3, 0, 1, 2, 5]
    x = torch.empty(0, dtype=torch.bfloat16)

    def kept(size_class, K):
        return [(c.kwargs["BLOCK_S"], c.kwargs["SPLIT_K"])
                for c in K_._prune_shrink(K_._SHRINK_CONFIGS, {"x_ptr": x, "size_class": size_class, "K": K},
                                          BLOCK_N=16)]
    decode = kept(3, 4096)
    assert decode and all(s == 16 for s, _ in decode) and {1, 4, 8} <= {k for _, k in decode}
    assert {k for _, k in kept(1, 4096)} >= {1, 4} and (32, 4) in kept(1, 4096)
    # Prefill: single-pass 32- and 16-token tiles; 64-token ones would leave SMs idle at a few thousand tokens.
    assert {k for _, k in kept(2, 4096)} == {1} and {s for s, _ in kept(2, 4096)} == {16, 32}
    # The pruning's order is the preference: split configs first for few tiles; a short K (the MLA steps) on
    # a prefill batch keeps 64-row tiles alone.
    assert kept(1, 4096)[0][1] > 1 and kept(1, 4096)[-1][1] == 1
    assert kept(2, 128) == [(64, 1)] and kept(2, 4096)[0] == (32, 1)
    assert {k for _, k in kept(0, 512)} == {1}  # 512 / 4 slices is one 256-wide step each
    # The tile search scans one warp-wide vector when the segments and the tail fit in it.
    monkeypatch.setattr(K_, "INTERPRET", False)
    assert (K_._block_seg(31), K_._block_seg(32)) == (32, K_.BLOCK_SEG)


def test_expand_grid_halves_its_programs_from_rank_64(monkeypatch):
    """Column groups split N until about EXPAND_PROGRAMS programs exist, half as many from rank 64 on; never
    more groups than column tiles, and the heads multiply the programs."""
    K_ = lora_triton
    monkeypatch.setattr(K_, "INTERPRET", False)
    # 4096 tokens in 32-row tiles plus 8 segment tiles: 136 tiles, 4096 columns in 32 tiles of 128.
    assert K_._expand_grid(4096, 8, 1, 4096, 32, 128, 16) == (136 * 4, 1)
    assert K_._expand_grid(4096, 8, 1, 4096, 32, 128, 32) == (136 * 4, 1)
    assert K_._expand_grid(4096, 8, 1, 4096, 32, 128, 64) == (136 * 2, 1)
    assert K_._expand_grid(4096, 8, 1, 4096, 32, 128, 256) == (136 * 2, 1)
    assert K_._expand_grid(64, 0, 1, 256, 16, 128, 16) == (4 * 2, 1)  # two column tiles at most
    assert K_._expand_grid(4096, 8, 16, 512, 32, 128, 64) == (136, 16)
    monkeypatch.setattr(K_, "INTERPRET", True)
    assert K_._expand_grid(4096, 8, 1, 4096, 32, 128, 16) == (136 * K_._INTERPRET_GROUPS, 1)


def test_expand_tries_64_row_tiles_on_prefill_batches_only():
    """Classes 0-1 (up to 1024 tokens) have too few 64-row tiles for the GPU; decode classes take 16 rows."""
    K_ = lora_triton
    x = torch.empty(0, dtype=torch.bfloat16)

    def rows(size_class):
        kept = K_._prune_expand(K_._EXPAND_CONFIGS, {"x_ptr": x, "size_class": size_class}, BLOCK_K=16, K_CHUNKS=1)
        return {c.kwargs["BLOCK_S"] for c in kept}
    assert rows(2) == {16, 32, 64} and rows(0) == rows(1) == {16, 32} and rows(3) == rows(5) == {16}


def test_tuning_keeps_the_listed_order_unless_a_later_config_wins_clearly():
    """Trial times swing by 10-30% between tunings: the earliest config within the margin (25%) of the fastest
    is chosen, a later one only when it is clearly faster; without trial times, the tuner's pick stands."""
    a, b, c = lora_triton._SHRINK_CONFIGS[:3]
    pick = lora_triton._preferred
    assert pick([a, b, c], {a: [26.5, 21.0, 23.0], b: [21.6, 21.0, 22.0], c: [28.0, 27.0, 29.0]}, b) is a
    assert pick([a, b, c], {a: [27.5, 26.0, 28.0], b: [21.6, 21.0, 22.0], c: [28.0, 27.0, 29.0]}, b) is b
    assert pick([c, b, a], {a: [27.5, 26.0, 28.0], b: [21.6, 21.0, 22.0], c: [26.0, 27.0, 29.0]}, b) is c
    assert pick([a, b, c], {b: 30.0, c: 29.0}, c) is b
    assert pick([a, b, c], None, c) is c


def test_gluon_shrink_takes_only_calls_it_fits():
    """The Gluon prefill shrink takes one head of 16-bit x without permutation, rows TMA can address (16-byte
    aligned strides, W's slots stacked as one matrix), stacks of at most 16 columns; anything else stays on
    the Triton kernel."""
    G = lora_triton._gluon.load("lora.gluon")
    if G is None:
        pytest.skip("this Triton has no Gluon")
    x, w = torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(4, 16, 64, dtype=torch.bfloat16)

    def fits(x=x, w=w, xs=None, ws=None, perm=None, heads=1, N=16):
        xs = xs or (x.stride(0), 0, x.stride(1))
        ws = ws or (w.stride(0), 0, w.stride(1), w.stride(2))
        return G.fits(x, xs, w, ws, (N, 0, 1), perm, heads, N)

    assert fits()
    assert fits(x=x.half(), w=w.half())
    assert not fits(perm=torch.arange(64))
    assert not fits(heads=2)
    assert not fits(x=x.float(), w=w.float())
    assert not fits(x=x, w=w.half())
    assert not fits(w=torch.zeros(4, 32, 64, dtype=torch.bfloat16), N=32)  # wider than MAX_N (16)
    odd = torch.zeros(64, 65, dtype=torch.bfloat16)[:, :64]  # rows 130 bytes apart
    assert not fits(x=odd)
    assert not fits(x=torch.zeros(64, 128, dtype=torch.bfloat16)[:, ::2])  # K stride 2
    assert not fits(ws=(w.stride(0) * 2, 0, w.stride(1), w.stride(2)))    # slots not stacked
    # Not on a CUDA tensor: never.
    assert not G.supports(x, (64, 0, 1), w, (1024, 0, 64, 1), (16, 0, 1), None, 1, 16)


def test_prefill_shrinks_route_to_gluon_where_it_fits(monkeypatch):
    """Size class 2 (more than 1024 tokens, more than 8 a segment) and ``supports`` while a CUDA graph is
    captured: the Gluon launch; an eager call (its TMA descriptors cost ~20 us of host time per call), a
    smaller batch, or GUARDLINT_LORA_GLUON=0 (USE_GLUON), the Triton kernel."""
    K_ = lora_triton
    gluon, triton_calls = [], []
    capturing = [True]
    monkeypatch.setattr(K_, "_capturing", lambda x: capturing[0])
    monkeypatch.setattr(K_._gluon, "load", lambda name: type("Fits", (), {"supports": staticmethod(lambda *a: True)}))
    monkeypatch.setattr(K_, "_gluon_shrink_run", lambda *a, **kw: gluon.append(a[9:]))
    monkeypatch.setattr(K_._shrink, "first_launch", lambda *a, **kw: triton_calls.append(1))
    monkeypatch.setattr(K_._shrink, "chosen", {})
    seg = torch.tensor([0, 1000, 2048], dtype=torch.int32)

    def launch(S):
        x, w, out = torch.zeros(S, 64), torch.zeros(2, 16, 64), torch.zeros(S, 16)
        K_.launch_shrink(x, (64, 0, 1), w, (1024, 0, 64, 1), out, (16, 0, 1), seg, seg, seg, None, 2, S, 1, 64,
                         16, 16)

    launch(2048)
    assert gluon == [(2, 2048, 64, 16, 16)] and not triton_calls
    launch(1024)
    assert len(gluon) == 1 and triton_calls == [1]
    capturing[0] = False  # eager: the Triton kernel, unless GUARDLINT_LORA_GLUON=1 (GLUON_EAGER)
    monkeypatch.setattr(K_._shrink, "chosen", {})
    launch(2048)
    assert len(gluon) == 1 and triton_calls == [1, 1]
    monkeypatch.setattr(K_, "GLUON_EAGER", True)
    launch(2048)
    assert len(gluon) == 2 and triton_calls == [1, 1]
    capturing[0] = True
    monkeypatch.setattr(K_, "USE_GLUON", False)
    monkeypatch.setattr(K_._shrink, "chosen", {})
    launch(2048)
    assert len(gluon) == 2 and triton_calls == [1, 1, 1]
