"""The Gluon (Hopper) attention kernel without a GPU: it compiles for sm_90a within the register and
shared-memory budget (Triton's bundled ptxas), its schedule keeps the PV product in flight while S is
waited on, and the ``gluon`` backend refuses every call it cannot take. Its numbers against float64 are
checked on the GPU (tests/kernels/test_attention_gpu.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from guardlint.guard import GuardError
from guardlint.kernels import varlen_attention
from guardlint.kernels.attention import api as attention
from guardlint.kernels.attention import gluon as gluon_path

SHARED_MEMORY_PER_BLOCK = 227 * 1024


COMPILED = [(64, "bf16", False), (64, "fp16", False), (64, "bf16", True), (128, "bf16", False), (128, "fp16", False),
            (128, "bf16", True)]
# (head_dim, dtype, causal, consumer warpgroups): D=80 runs two; three there (GUARDLINT_GLUON_WGS=3: P through
# shared memory, so that each fits its 160 registers) stay compiled and checked.
SPLIT_COMPILED = [(80, "bf16", False, 2), (96, "bf16", False, 2), (80, "fp16", False, 2), (80, "bf16", True, 2),
                  (80, "bf16", False, 3), (80, "fp16", False, 3)]


@pytest.fixture(scope="module")
def resources():
    """ptxas resources per (module, head_dim, dtype, causal) of both kernels (``gluon``, ``gluon_split``), compiled
    in a fresh process: this one runs Triton's interpreter (TRITON_INTERPRET=1 before the kernels were
    defined), which cannot compile for a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from guardlint.kernels.attention import gluon, gluon_split; "
            f"print(json.dumps([dict(m.hopper_resources(d, t, c, *w), module=m.__name__.rsplit('.', 1)[1]) "
            f"for m, configs in ((gluon, {COMPILED!r}), (gluon_split, {SPLIT_COMPILED!r})) "
            f"for d, t, c, *w in configs]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {(r["module"], r["head_dim"], r["dtype"], r["causal"], r["wgs"]): r
            for r in json.loads(done.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("head_dim,dtype,causal", COMPILED)
def test_compiles_for_hopper_without_spills(resources, head_dim, dtype, causal):
    """Causal too: the diagonal tile's mask keeps the registers and the in-flight PV product. Non-causal D=64 runs
    three consumer warpgroups, each within its smaller share of the registers."""
    res = resources[("gluon", head_dim, dtype, causal, 3 if head_dim == 64 and not causal else 2)]
    assert res["wgs"] == (3 if head_dim == 64 and not causal else 2)
    assert res["spill_bytes"] == 0
    assert res["shared_bytes"] <= SHARED_MEMORY_PER_BLOCK
    # setmaxnreg: the producer warp gives registers up, the consumer warpgroups take them.
    assert gluon_path.consumer_regs(res["wgs"]) in res["partition_registers"] and 24 in res["partition_registers"]
    # "wait until one group is left" is what lets the softmax of S_j run while P_{j-1} V_{j-1} is in flight.
    assert res["wgmma_waits"] == [0, 1]


@pytest.mark.parametrize("head_dim,dtype,causal,wgs", SPLIT_COMPILED)
def test_split_head_dims_compile_for_hopper_without_spills(resources, head_dim, dtype, causal, wgs):
    """80 = 64 + 16 and 96 = 64 + 32 (Gluon's tiles are powers of two): within the register and shared-memory
    budget, the producer's and consumers' register split as for the other head dims, and S_j waited on
    while both parts of P_{j-1} V_{j-1} stay in flight (two groups outstanding)."""
    res = resources[("gluon_split", head_dim, dtype, causal, wgs)]
    assert res["spill_bytes"] == 0 and res["shared_bytes"] <= SHARED_MEMORY_PER_BLOCK
    assert gluon_path.consumer_regs(wgs) in res["partition_registers"] and 24 in res["partition_registers"]
    assert res["wgmma_waits"] == [0, 2]
    assert sum(res["parts"]) == head_dim and all(p & (p - 1) == 0 for p in res["parts"])


@pytest.mark.parametrize("setting,expected", [
    ("", {(64, False): 3, (64, True): 2, (80, False): 2, (80, True): 2, (96, False): 2, (128, False): 2}),
    ("2", {(64, False): 2, (64, True): 2, (80, False): 2, (96, False): 2, (128, False): 2}),
    ("3", {(64, False): 3, (64, True): 2, (80, False): 3, (96, False): 2, (128, False): 2}),
])
def test_consumer_warpgroups_per_head_dim(monkeypatch, setting, expected):
    """Three consumer warpgroups for non-causal D=64 (measured faster), two elsewhere (at D=80 three tie with two);
    GUARDLINT_GLUON_WGS=2 keeps two everywhere, =3 allows three up to D=80; causal always two."""
    monkeypatch.setattr(gluon_path, "WGS_SETTING", setting)
    got = {key: gluon_path.consumer_groups(*key) for key in expected}
    assert got == expected


@pytest.mark.parametrize("head_dim,causal,setting,wgs", [(64, False, "", 3), (64, True, "", 2), (80, False, "", 2),
                                                        (80, False, "3", 3), (128, False, "", 2)])
def test_launch_grid_follows_the_warpgroup_count(monkeypatch, head_dim, causal, setting, wgs):
    """The host launch sizes the grid by the query tile (64 rows per consumer warpgroup) and hands the kernel
    the matching WGS, stages and register share (no GPU: the launch is recorded, not run)."""
    launches = []

    class Recorder:
        def __init__(self, fn, options):
            self.options = options

        def __call__(self, args, grid):
            launches.append((self.options, grid))

    monkeypatch.setattr(gluon_path, "direct_launch", lambda fn, **options: Recorder(fn, options))
    monkeypatch.setattr(gluon_path, "WGS_SETTING", setting)
    lengths = [1000, 193, 0, 64]
    cu = torch.tensor([0, 1000, 1193, 1193, 1257], dtype=torch.int32)
    q = torch.zeros(sum(lengths), 4, head_dim, dtype=torch.bfloat16)
    gluon_path.varlen_attention_gluon(q, q, q, cu, max(lengths), 0.1, causal)
    (options, grid), = launches
    assert options["WGS"] == wgs and options["CONSUMER_REGS"] == gluon_path.consumer_regs(wgs)
    assert options["EXP2_POLY"] == gluon_path.exp2_poly()
    assert options["STAGES"] == gluon_path.stages_for(head_dim, wgs)
    assert options["BLOCK_N"] == 128
    assert grid == (-(-1000 // (64 * wgs)), 4, 4)


def test_anatomy_probes_compile_and_drop_what_they_name():
    """bench/attention_anatomy.py's probes (the kernels with one helper swapped) build for sm_90a and each drops
    what its row says: fewer exp2 without the softmax, fewer wgmma without S's 16-wide part. Fails when a
    rename leaves a probe compiling to the product's own instructions."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[2] / "bench" / "attention_anatomy.py"
    done = subprocess.run([sys.executable, str(script), "--compile-check"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("D=")]
    assert {r[0] for r in rows} == {"D=128", "D=80", "D=64"} and len(rows) == 10
    assert all(r[-1] == "0" for r in rows), "no probe spills"


@pytest.mark.parametrize("head_dim,dtype,causal,wgs", [c for c in SPLIT_COMPILED if c[3] == 3])
def test_three_warpgroups_at_d80_fit_their_registers(resources, head_dim, dtype, causal, wgs):
    """The three-warpgroup D=80 kernel (GUARDLINT_GLUON_WGS=3): with P in shared memory (not held in registers
    beside the next S) each consumer fits the 160 registers per thread that three consumers and the producer leave
    (with P in registers it spills); the P tiles fit shared memory beside Q and the K/V ring."""
    res = resources[("gluon_split", head_dim, dtype, causal, wgs)]
    assert gluon_path.p_in_shared(head_dim, wgs)
    assert res["spill_bytes"] == 0 and res["shared_bytes"] <= SHARED_MEMORY_PER_BLOCK
    assert gluon_path.consumer_regs(3) in res["partition_registers"] and 24 in res["partition_registers"]


def test_exponentials_split_between_mufu_and_fma_units_compile_without_spills():
    """GUARDLINT_GLUON_EXP2_POLY (attention.softmax_exp2): the kernels with some of P's exponentials on the FMA
    units build for sm_90a without spills, D=80 with three warpgroups (the tightest registers) too, and move
    exactly poly of every 8 of P's exponentials off the MUFU (the rescale factors stay there)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    configs = [("gluon_split", 80, 3, 0), ("gluon_split", 80, 3, 2), ("gluon_split", 80, 3, 4), ("gluon", 128, 2, 0),
               ("gluon", 128, 2, 4)]
    code = ("import json; from guardlint.kernels.attention import gluon, gluon_split; "
            f"print(json.dumps([dict(getattr(__import__('guardlint.kernels.attention.' + m, fromlist=['x']), "
            f"'hopper_resources')(d, 'bf16', False, w, p), module=m) for m, d, w, p in {configs!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    res = {(r["module"], r["head_dim"], r["poly"]): r for r in json.loads(done.stdout.strip().splitlines()[-1])}
    for (module, head_dim, poly), r in res.items():
        base = res[(module, head_dim, 0)]
        assert r["spill_bytes"] == 0, (module, head_dim, poly)
        assert r["ex2_mufu"] + r["ex2_fma"] == base["ex2_mufu"] and base["ex2_fma"] == 0
        p_exps = res[(module, head_dim, 4)]["ex2_fma"] * 2  # 4 of 8 of P's exponentials
        assert r["ex2_fma"] * 8 == poly * p_exps


@pytest.mark.parametrize("setting,expected", [("", 0), ("0", 0), ("3", 3), ("4", 4)])
def test_exp2_poly_setting(monkeypatch, setting, expected):
    monkeypatch.setattr(gluon_path, "EXP2_POLY_SETTING", setting)
    assert gluon_path.exp2_poly() == expected


@pytest.mark.parametrize("setting", ["5", "-1", "two", "2.0"])
def test_an_exp2_poly_setting_out_of_range_is_refused(monkeypatch, setting):
    monkeypatch.setattr(gluon_path, "EXP2_POLY_SETTING", setting)
    with pytest.raises(ValueError, match=f"GUARDLINT_GLUON_EXP2_POLY must be 0 to 4, got '{setting}'"):
        gluon_path.exp2_poly()


@pytest.mark.parametrize("head_dim,wgs", [(64, 2), (64, 3), (80, 2), (80, 3), (96, 2), (128, 2)])
def test_the_kv_ring_fits_shared_memory(head_dim, wgs):
    stages = gluon_path.stages_for(head_dim, wgs)
    q_bytes = gluon_path.block_m(wgs) * head_dim * 2
    p_bytes = gluon_path.block_m(wgs) * gluon_path.BLOCK_N * 2 if gluon_path.p_in_shared(head_dim, wgs) else 0
    assert stages >= 2
    assert q_bytes + p_bytes + stages * 2 * gluon_path.BLOCK_N * head_dim * 2 <= SHARED_MEMORY_PER_BLOCK - 1024


@dataclass
class FakeTensor:
    """What ``supports`` reads of a tensor, so the CUDA branches can be checked without a GPU."""
    shape: tuple
    strides: tuple
    dtype: torch.dtype = torch.bfloat16
    ptr: int = 1 << 20
    device: torch.device = torch.device("cuda", 0)

    def stride(self, dim):
        return self.strides[dim]

    def element_size(self):
        return torch.empty((), dtype=self.dtype).element_size()

    def data_ptr(self):
        return self.ptr


def packed(tokens=64, heads=4, head_dim=128, **kw):
    return FakeTensor((tokens, heads, head_dim), (heads * head_dim, head_dim, 1), **kw)


@pytest.mark.parametrize("change,expected", [
    ({}, True),
    ({"dtype": torch.float16}, True),
    ({"dtype": torch.float32}, False),                                      # wgmma here is 16-bit only
    ({"head_dim": 80, "split": False}, False),                              # GUARDLINT_GLUON_SPLIT=0
    ({"head_dim": 80}, True),                                               # in two parts, 64 + 16
    ({"head_dim": 96, "split": True}, True),
    ({"head_dim": 112, "split": True}, False),                              # no parts for 112
    ({"causal": True}, True),                                               # causal too ...
    ({"causal": True, "causal_on": False}, False),                          # ... unless GUARDLINT_GLUON_CAUSAL=0
    ({"causal": True, "head_dim": 80}, True),
    ({"ptr": (1 << 20) + 8}, False),                                        # TMA needs 16-byte aligned bases
    ({"device": torch.device("cpu")}, False),
])
def test_supports(monkeypatch, change, expected):
    monkeypatch.setattr(gluon_path, "is_hopper", lambda device: True)
    monkeypatch.setattr(gluon_path, "SPLIT_ENABLED", change.pop("split", True))
    monkeypatch.setattr(gluon_path, "CAUSAL_ENABLED", change.pop("causal_on", True))
    causal = change.pop("causal", False)
    head_dim = change.pop("head_dim", 128)
    q = packed(head_dim=head_dim, **change)
    kv = packed(heads=2, head_dim=head_dim, **change)
    assert gluon_path.supports(q, kv, kv, causal=causal) is expected


def test_supports_refuses_causal_other_gpus_and_strided_heads(monkeypatch):
    monkeypatch.setattr(gluon_path, "is_hopper", lambda device: True)
    monkeypatch.setattr(gluon_path, "CAUSAL_ENABLED", False)
    q, kv = packed(), packed(heads=2)
    assert not gluon_path.supports(q, kv, kv, causal=True)
    # A v slice of a fused qkv buffer: rows of 3 * H * D, heads still contiguous -> TMA reads it.
    fused = FakeTensor((64, 2, 128), (3 * 2 * 128, 128, 1))
    assert gluon_path.supports(q, kv, fused, causal=False)
    # Heads not contiguous (a transposed view): no (tokens, heads * D) descriptor exists.
    assert not gluon_path.supports(q, kv, FakeTensor((64, 2, 128), (128, 64 * 128, 1)), causal=False)
    monkeypatch.setattr(gluon_path, "is_hopper", lambda device: False)
    assert not gluon_path.supports(q, kv, kv, causal=False)  # wgmma is Hopper's; Blackwell has tcgen05


def test_backend_gluon_without_a_gpu_is_a_coded_error():
    q = torch.randn(12, 4, 128)
    k = v = torch.randn(12, 2, 128)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    assert not attention._runnable("gluon", q, k, 128 ** -0.5, False)
    with pytest.raises(GuardError) as err:
        varlen_attention(q, k, v, cu, backend="gluon")
    assert err.value.argument == "backend" and err.value.code in ("GL301", "GL106")
    assert "gluon" in str(err.value)


def test_a_table_that_ranks_gluon_first_only_routes_calls_it_can_run():
    """The dispatch table may rank gluon fastest; a call gluon cannot take goes to the next backend."""
    from guardlint.kernels.attention import dispatch

    entry = {"device": "NVIDIA H200", "capability": [9, 0], "head_dim": 128, "dtype": "bfloat16", "causal": False,
             "batch": 6, "max_seqlen": 8192, "total_tokens": 16448,
             "times_us": {"gluon": 1254.0, "triton": 1592.0, "sdpa": 1304.0}}
    q = torch.randn(12, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(12, 2, 128, dtype=torch.bfloat16)

    def choose(runnable):
        return dispatch.choose(device_type="cuda", device_name="NVIDIA H200", capability=(9, 0), head_dim=128,
                               dtype="bfloat16", causal=False, batch=6, max_seqlen=8192, total_tokens=16448,
                               runnable=runnable, entries=[entry])

    runnable = lambda name: attention._runnable(name, q, k, 128 ** -0.5, False)  # noqa: E731
    assert not runnable("gluon")  # CPU tensors
    assert choose(runnable) == "sdpa"
    assert choose(lambda name: name == "gluon" or runnable(name)) == "gluon"
