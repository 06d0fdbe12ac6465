"""The LoRA kernels compile for an H100/H200 (sm_90) on this CPU-only machine: Triton's own ptxas builds
the cubin, so GPU-only compile errors, lost software pipelining and register spills show up in CI.

Specializations mirror real launches (ints equal to 1 become constants, multiples of 16 are marked, except
the kernels' do_not_specialize scalars), as Triton's launcher does for the benchmark's bf16/fp32 tensors.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(r'''
    import json, os, re, subprocess, tempfile, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from guardlint.kernels.lora import triton as K

    TARGET = GPUTarget("cuda", 90, 32)
    CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

    def build(fn, values, ptrs, constexprs, cfg):
        constexprs = dict(constexprs, **cfg.kwargs)
        sig, attrs, consts = {}, {}, dict(constexprs)
        for i, name in enumerate(fn.arg_names):
            if name in constexprs:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = ptrs.get(name, "*i32")
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif name in fn.do_not_specialize:
                sig[name] = "i32"
            elif values[name] == 1:
                sig[name] = "constexpr"
                consts[name] = 1
            else:
                sig[name] = "i32"
                if values[name] % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        usage = ""
        if os.path.exists(CUOBJDUMP):
            with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                f.write(k.asm["cubin"])
            usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True,
                                   text=True).stdout
            os.unlink(f.name)
        reg = re.search(r"REG:(\d+)", usage)
        local = re.search(r"LOCAL:(\d+)", usage)
        ptx = k.asm["ptx"]
        return dict(pipelined="async_copy_global_to_local" in k.asm["ttgir"],
                    regs=int(reg.group(1)) if reg else None, local=int(local.group(1)) if local else None,
                    shared=k.metadata.shared,
                    async_copy_sizes=sorted(set(re.findall(
                        r"cp\.async\.\w+\.shared\.global [^;]*?, (0x[0-9a-f]+|\d+)", ptx))),
                    plain_wide_loads=len(re.findall(r"ld\.global\.v[24]", ptx)),
                    stores=sorted(set(re.findall(r"st\.global(\.v\d)?\.b\d+", ptx))),
                    atomics=sorted(set(re.findall(r"atom\.global\.[\w.]+", ptx))),
                    l2_loads=len(re.findall(r"ld\.global\.cg", ptx)))

    S, D = 4096, 4096
    def shrink(R, heads=1, x_head=0, **over):
        v = dict(num_segments=8, num_tokens=S, num_slots=4, K=D, N=R, max_rank=R,
                 stride_xt=D, stride_xh=x_head, stride_xk=1, stride_wl=R * D, stride_wh=0, stride_wn=D,
                 stride_wk=1, stride_ot=R * heads, stride_oh=R, stride_on=1, size_class=2)
        v.update(over)
        return v
    def expand(R, N=D, **over):
        v = dict(num_segments=8, num_tokens=S, num_slots=4, N=N, n_total=N, max_rank=R,
                 slice_1=4096, slice_2=5120, slice_3=6144, stride_xt=R, stride_xh=0, stride_xk=1,
                 stride_wl=N * R, stride_wh=0, stride_wn=R, stride_wk=1, stride_ot=N, stride_oh=0, stride_on=1,
                 size_class=2)
        v.update(over)
        return v

    out = {}
    for dtype in ("bf16", "fp32"):
        ptr = dict(x_ptr="*" + dtype, w_ptr="*" + dtype, out_ptr="*" + dtype, scalings_ptr="*fp32",
                   partials_ptr="*fp32")
        prec = "ieee" if dtype == "fp32" else "tf32"
        base_s = dict(HAS_PERMUTATION=False, UPCAST=False, DOT_PRECISION=prec, BLOCK_SEG=K.BLOCK_SEG)
        base_e = dict(ACCUMULATE=True, HAS_PERMUTATION=False, SLICES=0, ALIGNED_SLICES=False, PACKED=False,
                      UPCAST=False, DOT_PRECISION=prec, BLOCK_SEG=K.BLOCK_SEG, K_CHUNKS=1)
        # Every tuning config in bf16 at rank 16; the other specializations with one config.
        configs = K._SHRINK_CONFIGS if dtype == "bf16" else K._SHRINK_CONFIGS[:1]
        for i, cfg in enumerate(configs):
            out[f"shrink-{dtype}-r16-cfg{i}-split{cfg.kwargs['SPLIT_K']}"] = build(
                K._lora_shrink_kernel, shrink(16), ptr, dict(base_s, BLOCK_N=16), cfg)
        configs = K._EXPAND_CONFIGS if dtype == "bf16" else K._EXPAND_CONFIGS[:1]
        for i, cfg in enumerate(configs):
            out[f"expand-{dtype}-cfg{i}"] = build(K._lora_expand_kernel, expand(16), ptr, dict(base_e, BLOCK_K=16),
                                                  cfg)
        if dtype != "bf16":
            continue
        cfg = K._SHRINK_CONFIGS[1]
        out["shrink-r64"] = build(K._lora_shrink_kernel, shrink(64), ptr, dict(base_s, BLOCK_N=64), cfg)
        out["shrink-permuted"] = build(K._lora_shrink_kernel, shrink(16), ptr, dict(base_s, BLOCK_N=16,
                                                                                    HAS_PERMUTATION=True), cfg)
        # MLA step A_q: 16 heads, x (S, 16, 128), W[s, h, n, k] = B[s, h * 256 + k, n]
        out["shrink-mla"] = build(K._lora_shrink_kernel,
                                  shrink(16, heads=16, x_head=128, K=128, stride_xt=2048, stride_wh=256 * 16,
                                         stride_wn=1, stride_wk=16, stride_wl=4096 * 16),
                                  ptr, dict(base_s, BLOCK_N=16), cfg)
        # 8 warps: the rank-64 x tile is one 16-byte load per thread.
        cfg = next(c for c in K._EXPAND_CONFIGS if c.num_warps == 8)
        out["expand-r64-fresh-permuted"] = build(K._lora_expand_kernel, expand(64), ptr,
                                                 dict(base_e, BLOCK_K=64, ACCUMULATE=False, HAS_PERMUTATION=True),
                                                 cfg)
        # Large ranks: every config the shared-memory pruning keeps must fit (rank 256 goes in two chunks).
        import torch
        bf16 = {"x_ptr": torch.empty(0, dtype=torch.bfloat16), "size_class": 2, "K": D}
        for R, chunks in ((128, 1), (256, 2)):
            for i, kept in enumerate(K._prune_expand(K._EXPAND_CONFIGS, bf16, BLOCK_K=R // chunks,
                                                     K_CHUNKS=chunks)):
                out[f"expand-r{R}-cfg{i}"] = build(K._lora_expand_kernel, expand(R), ptr,
                                                   dict(base_e, BLOCK_K=R // chunks, K_CHUNKS=chunks), kept)
        for i, kept in enumerate(K._prune_shrink(K._SHRINK_CONFIGS, bf16, BLOCK_N=128)):
            out[f"shrink-n128-cfg{i}"] = build(K._lora_shrink_kernel, shrink(64, N=128), ptr,
                                               dict(base_s, BLOCK_N=128), kept)
        out["expand-qkv-host-slices"] = build(K._lora_expand_kernel, expand(16, N=4096, stride_xh=16, stride_xt=48),
                                              ptr, dict(base_e, BLOCK_K=16, SLICES=1, ALIGNED_SLICES=True), cfg)
        out["expand-qkv-device-slices"] = build(K._lora_expand_kernel,
                                                expand(16, N=6144, stride_xh=16, stride_xt=48), ptr,
                                                dict(base_e, BLOCK_K=16, SLICES=2), cfg)
        # Packed decode tiles (an adapter per row): the 16-row configs, accumulating and fresh + permuted.
        for i, cfg in enumerate(c for c in K._EXPAND_CONFIGS if c.kwargs["BLOCK_S"] == 16):
            out[f"packed-expand-cfg{i}"] = build(K._lora_expand_kernel, expand(16, num_segments=64, num_tokens=64),
                                                 ptr, dict(base_e, BLOCK_K=16, PACKED=True), cfg)
            out[f"packed-expand-fresh-permuted-cfg{i}"] = build(
                K._lora_expand_kernel, expand(16, num_segments=64, num_tokens=64), ptr,
                dict(base_e, BLOCK_K=16, PACKED=True, ACCUMULATE=False, HAS_PERMUTATION=True), cfg)
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"sm_90 compile failed:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_lora_kernels_compile_for_sm90(compiled):
    assert len(compiled) >= 16
    assert all(r["shared"] <= 227 * 1024 for r in compiled.values()), compiled


def test_lora_shrink_streams_x_through_a_software_pipeline(compiled):
    """The shrink is bound by reading x: its K loop must be multi-buffered (cp.async), not load-then-wait."""
    shrinks = {k: v for k, v in compiled.items() if k.startswith("shrink-")}
    assert shrinks and all(v["pipelined"] for v in shrinks.values()), shrinks


def test_lora_shrink_reads_x_in_16_byte_copies(compiled):
    """Every cp.async of the shrink moves 16 bytes: masks on K stay uniform over a vector."""
    shrinks = {k: v["async_copy_sizes"] for k, v in compiled.items() if k.startswith("shrink-") and "mla" not in k}
    assert shrinks and all(sizes == ["0x10"] for sizes in shrinks.values()), shrinks


def test_lora_expand_streams_base_through_cp_async_and_writes_16_bytes(compiled):
    """The expand is bound by base: its tiles arrive by 16-byte cp.async into shared memory (the pipelined
    loop), not by plain loads into registers (one wide load at most: the small x tile, before the loop),
    and leave by 16-byte stores, host-sliced qkv included."""
    fast = {k: v for k, v in compiled.items() if k.startswith("expand-") and "device-slices" not in k
            and "r128" not in k and "r256" not in k}  # (x tiles of rank 128 take several wide loads)
    assert fast and all(v["pipelined"] and v["async_copy_sizes"] == ["0x10"] and v["plain_wide_loads"] <= 1
                        for v in fast.values()), fast
    assert all(v["stores"] == [".v4"] for k, v in fast.items() if "fp32" not in k), fast


def test_lora_expand_with_device_slices_has_a_16_byte_path(compiled):
    """Device slice offsets cannot be checked on the host: slices on multiples of 8 take a 16-byte path
    chosen in the kernel, others a narrow one."""
    assert compiled["expand-qkv-device-slices"]["stores"] == ["", ".v4"], compiled["expand-qkv-device-slices"]


def test_lora_packed_expand_compiles_with_16_byte_stores(compiled):
    """Packed decode tiles loop over the adapters of their rows inside the column loop; base still leaves by
    16-byte stores."""
    packed = {k: v for k, v in compiled.items() if k.startswith("packed-expand-")}
    assert len(packed) >= 2 and all(v["stores"] == [".v4"] for v in packed.values()), packed


def test_lora_kernels_do_not_spill_registers(compiled):
    if any(v["local"] is None for v in compiled.values()):
        pytest.skip("cuobjdump is not shipped with this Triton build")
    spilled = {k: v for k, v in compiled.items() if v["local"]}
    assert not spilled, spilled


def test_lora_shrink_split_k_hands_partials_over_through_l2(compiled):
    """A split config publishes its float32 partial, then counts itself in with one acquire-release atomic
    (after a barrier, so the whole block's partial is out); the last reads the partials from L2 (.cg).
    Single-pass configs have no atomic."""
    split = {k: v for k, v in compiled.items() if k.startswith("shrink-") and "-split" in k and "split1" not in k}
    single = {k: v for k, v in compiled.items() if k.startswith("shrink-") and k not in split}
    assert split and all(v["atomics"] == ["atom.global.gpu.acq_rel.add.u32"] and v["l2_loads"] >= 1
                         for v in split.values()), split
    assert single and all(v["atomics"] == [] for v in single.values()), single


GLUON_SCRIPT = textwrap.dedent(r'''
    import json
    from guardlint.kernels.lora import gluon as G
    out = [G.hopper_resources(n) for n in (16, 48, 64)] + [G.hopper_resources(16, "fp16")]
    print("RESULT " + json.dumps(out))
''')


def test_gluon_prefill_shrink_compiles_for_sm90_without_spills():
    """The Gluon shrink for sm_90a: tensor-core mma, TMA loads of x and W, shared memory within the 227 KB
    of a block, no spills, for every stack width it takes (16 to 64 columns) and both 16-bit dtypes."""
    from guardlint.kernels import _gluon

    if _gluon.load("lora.gluon") is None:
        pytest.skip("this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", GLUON_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"sm_90 compile failed:\n{proc.stderr[-4000:]}"
    for r in json.loads(lines[-1][len("RESULT "):]):
        assert r["spill_bytes"] == 0 and r["shared_bytes"] <= 227 * 1024, r
        assert r["mma"] > 0 and r["tma_loads"] >= 4, r
