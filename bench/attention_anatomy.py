"""Where the Gluon attention kernels' time goes (GPU only): probes that strip one ingredient of the loop at a time,
timed beside FlashAttention-3 (FlashInfer) on the same tokens.

The case is bench/attention.py's 6-image ViT batch (1024/4096/256/2304/576/8192 tokens, 16 heads, bf16,
non-causal) at D=128, D=80 and D=64. Each probe is the product kernel compiled with one helper swapped for a
cheaper one (the kernel and the functions between it and that helper are rebuilt over a copy of their module's
globals, so the product itself is untouched):

- ``no exp2``: the online softmax with ``exp2(x)`` replaced by ``x`` (row max, scaling, row sums and the O
  rescale stay): what the exponentials on the MUFU cost;
- ``no softmax``: ``P = S`` cast to 16 bits; no row max, no exponentials, no sums, no rescale: the tensor
  cores, the TMA ring and the barriers alone, i.e. this kernel design's ceiling;
- ``S without its 16-wide part`` (D=80): ``Q K^T`` over the first 64 columns only: what the chained K=16 wgmma
  of the two-part head costs.

Beside them: the same kernel through the public API (``varlen_attention(..., backend="gluon")``), and candidates
checked against float64 like the product: the other consumer-warpgroup count where both are possible (D <= 80:
two where the product runs three, ``GUARDLINT_GLUON_WGS=2``; three where it runs two), and 1, 2 or 3 of every 8
of P's exponentials computed on the FMA units instead of the MUFU (``GUARDLINT_GLUON_EXP2_POLY``,
``attention.softmax_exp2``).
Probes compute made-up numbers: they are timings, not results (the product kernels are checked against float64
first). Every row is timed side by side over ROUNDS rounds, each in a shuffled order (a row's time can depend on
the row before it); the table gives the median round and each row's ratio to the product kernel and to FA3 at
D=128 on the same tokens, and the median ratio to the product over PAIRS back-to-back pairs (x_gluon_paired).

    python bench/attention_anatomy.py [--write]        # on an H200
    python bench/attention_anatomy.py --compile-check  # anywhere: builds every probe for sm_90a, no GPU
Writes bench/results/attention_anatomy.{json,md}.
"""
from __future__ import annotations

from _util import WRITE_HELP, require

require("torch", "triton", "guardlint")  # a clear message outside the venv

import argparse  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: E402

from guardlint.kernels.attention import gluon as G  # noqa: E402
from guardlint.kernels.attention import gluon_split as GS  # noqa: E402

ROUNDS = 9
PAIRS = 10
# Exponentials of every 8 on the FMA units, tried beside the product (attention.softmax_exp2).
EXP2_POLY_CANDIDATES = (1, 2, 3)
START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", file=sys.stderr, flush=True)


@gluon.jit
def _softmax_no_exp(scores, m_i, l_i, qk_scale, POLY: gl.constexpr):
    """``_softmax_step`` with exp2(x) replaced by x: the same max, scaling, sums and rescale, no MUFU work."""
    m_new = gl.maximum(m_i, gl.max(scores, 1) * qk_scale)
    p = scores * qk_scale - m_new[:, None]
    alpha = m_i - m_new
    return p, m_new, alpha, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _softmax_none(scores, m_i, l_i, qk_scale, POLY: gl.constexpr):
    """No softmax: P = S, the running max and sum untouched, a rescale by a constant 1 (folded away)."""
    return scores, m_i, gl.full(m_i.shape, 1.0, gl.float32, m_i.type.layout), l_i


@gluon.jit
def _scores_first_part(q, q1, k_tile, k_tile1, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """``gluon_split._scores`` without its second wgmma: S over the first part of the head only."""
    return warpgroup_mma(q, k_tile.permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                         use_acc=False, is_async=True)


# (probe, what it measures, module, its kernel's name, helper swaps)
def probes(head_dim: int) -> list:
    module, kernel = (GS, "_varlen_attention_fwd_ws_split") if head_dim in GS.PARTS else (G, "_varlen_attention_fwd_ws")
    out = [("no exp2", "exp2(x) -> x in the online softmax (max, scaling, sums, O rescale kept)", module, kernel,
            {"_softmax_step": _softmax_no_exp}),
           ("no softmax", "P = S: no max, no exp2, no sums, no rescale (tensor cores + TMA ring + barriers)", module,
            kernel, {"_softmax_step": _softmax_none})]
    if head_dim in GS.PARTS:
        out.append(("S without its 16-wide part", "Q K^T over the first 64 columns only (no chained K=16 wgmma)",
                    module, kernel, {"_scores": _scores_first_part}))
    return out


def probe_kernel(module, kernel: str, swaps: dict):
    """``module``'s kernel with the helpers in ``swaps`` in place of its own. The functions on the way from the
    kernel to those helpers (its partitions and their loop step) are rebuilt over a copy of the module's globals;
    the module itself is untouched."""
    scope = dict(vars(module))
    scope.update(swaps)
    for name in ("_kv_step", "_consumer", "_producer", kernel):
        fn = vars(module)[name].fn
        clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        clone.__qualname__, clone.__module__, clone.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
        # Triton reads which parameters are constexprs from the annotations: without them a launch would pass
        # STAGES, HEAD_DIM, ... as runtime integers.
        clone.__annotations__, clone.__kwdefaults__ = dict(fn.__annotations__), fn.__kwdefaults__
        scope[name] = gluon.jit(clone)
    return scope[kernel]


def with_setting(module, name: str, value, call):
    """``call`` run with ``module.<name>`` set to ``value``: a setting, or a kernel (the launch code looks both up
    at each call)."""
    def run():
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            return call()
        finally:
            setattr(module, name, saved)
    return run


def compile_check() -> int:
    """Build the product kernels and every probe for sm_90a (no GPU) and show that each probe dropped what it
    says: exp2 instructions and wgmma counts per kernel."""
    seen = {}
    compile_sm90 = G.compile_sm90

    def keep(fn, signature, constants, num_warps, attrs=None):
        result = compile_sm90(fn, signature, constants, num_warps, attrs)
        seen["ptx"] = result["ptx"]
        return result

    G.compile_sm90 = keep
    rc = 0
    for head_dim in (128, 80, 64):
        split = head_dim in GS.PARTS
        resources = GS.hopper_resources if split else G.hopper_resources
        base = resources(head_dim)
        counts = {}
        counts["product"] = _ptx_counts(seen["ptx"])
        for name, _, module, kernel, swaps in probes(head_dim):
            fn = probe_kernel(module, kernel, swaps)
            if [p.is_constexpr for p in fn.params] != [p.is_constexpr for p in getattr(module, kernel).params]:
                print(f"D={head_dim} {name}: constexpr parameters differ from the kernel's", file=sys.stderr)
                rc = 1
            saved = getattr(module, kernel)
            setattr(module, kernel, fn)
            try:
                res = resources(head_dim)
            finally:
                setattr(module, kernel, saved)
            counts[name] = _ptx_counts(seen["ptx"])
            counts[name]["spills"] = res["spill_bytes"]
        counts["product"]["spills"] = base["spill_bytes"]
        for name, c in counts.items():
            print(f"D={head_dim:<4d} {name:28s} ex2 {c['ex2']:4d}  wgmma {c['wgmma']:4d}  spills {c['spills']}")
        ok = all(counts[n]["ex2"] < counts["product"]["ex2"] for n in ("no exp2", "no softmax"))
        if split:
            ok = ok and counts["S without its 16-wide part"]["wgmma"] < counts["product"]["wgmma"]
        if not ok:
            print(f"D={head_dim}: a probe compiled to the product's instructions", file=sys.stderr)
            rc = 1
    # Shapes the README weighs: three warpgroups at D=80 (GUARDLINT_GLUON_WGS=3, P through shared memory), some of
    # P's exponentials on the FMA units, and two warpgroups with 256-key tiles (2 stages, to fit shared memory),
    # which spill.
    res = GS.hopper_resources(80, "bf16", False, 3)
    print(f"variant D=80  3 consumer warpgroups, P in shared memory: spills {res['spill_bytes']}, "
          f"shared {res['shared_bytes']} bytes")
    for head_dim in (128, 80, 64):
        resources = GS.hopper_resources if head_dim in GS.PARTS else G.hopper_resources
        for poly in EXP2_POLY_CANDIDATES:
            res = resources(head_dim, "bf16", False, 0, poly)
            print(f"variant D={head_dim:<4d}exp2 {poly} of {G.EXP2_PACK.value} on FMA: ex2 on the MUFU "
                  f"{res['ex2_mufu']}, on the FMA units {res['ex2_fma']}, spills {res['spill_bytes']}")
    for head_dim in (64, 80, 128):
        res = _resources_256(head_dim)
        print(f"variant D={head_dim:<4d}2 consumer warpgroups, 256-key tiles: spills {res['spill_bytes']}, "
              f"shared {res['shared_bytes']} bytes")
    return rc


def _resources_256(head_dim: int) -> dict:
    """ptxas resources of the two-warpgroup kernel with 256-key tiles (2 stages), compiled for sm_90a."""
    from guardlint.kernels._gluon import tensordesc

    keys, constants = 256, dict(BLOCK_N=256, STAGES=2, CAUSAL=False, WGS=2, EXP2_POLY=0)
    if head_dim in GS.PARTS:
        d0, d1 = GS.PARTS[head_dim]
        descs = {}
        for name, rows in (("q_desc", G.ROWS_PER_WG), ("k_desc", keys), ("v_desc", keys)):
            descs[name], descs[name + "1"] = tensordesc("bf16", rows, d0), tensordesc("bf16", rows, d1)
        return G.compiled_resources(GS._varlen_attention_fwd_ws_split, descs, "bf16", dict(constants, D0=d0, D1=d1))
    descs = {name: tensordesc("bf16", rows, head_dim)
             for name, rows in (("q_desc", G.ROWS_PER_WG), ("k_desc", keys), ("v_desc", keys))}
    return G.compiled_resources(G._varlen_attention_fwd_ws, descs, "bf16", dict(constants, HEAD_DIM=head_dim))


def _ptx_counts(ptx: str) -> dict:
    return {"ex2": len(re.findall(r"\bex2\.approx", ptx)), "wgmma": len(re.findall(r"\bwgmma\.mma_async", ptx))}


def fa3_warm(head_dims) -> list:
    """FlashInfer's FA3 modules built in the background (a JIT build each, minutes on a fresh machine)."""
    return [subprocess.Popen([sys.executable, str(HERE / "_attention_worker.py"), "--warm", "fa3", "--warm-head-dim",
                              str(d)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for d in head_dims]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=WRITE_HELP)
    parser.add_argument("--compile-check", action="store_true", help="build every probe for sm_90a; no GPU needed")
    parser.add_argument("--fa3-timeout", type=float, default=240.0, help="seconds to wait for FlashInfer's FA3 build")
    args = parser.parse_args()
    if args.compile_check:
        return compile_check()

    import torch

    from _attention_cases import IMAGES_6, Case, make_inputs, max_abs_error, passes, reference
    from _util import cuda_time_us, env_meta, write_results
    from guardlint.kernels import varlen_attention
    from guardlint.kernels.attention import flashinfer as fi

    if not torch.cuda.is_available() or not G.is_hopper(torch.device("cuda")):
        print("attention_anatomy: needs a Hopper GPU (the Gluon kernels are sm_90a)", file=sys.stderr)
        return 2
    fa3_reason = fi.unavailable_reason(torch.device("cuda"))
    builders = [] if fa3_reason else fa3_warm((128, 64))
    cases = [Case(f"6img-d{d}", IMAGES_6, d) for d in (128, 80, 64)]
    inputs = {c.name: make_inputs(c, torch.device("cuda"), torch.bfloat16) for c in cases}
    calls, notes = {}, {}
    for case in cases:
        q, k, v, cu, offsets, plan = inputs[case.name]
        scale = case.head_dim ** -0.5

        def product(q=q, k=k, v=v, cu=cu, case=case, scale=scale):
            return G.varlen_attention_gluon(q, k, v, cu, case.max_seqlen, scale, False)

        out = product()
        err = max_abs_error(out, reference(case, q, k, v, offsets))
        log(f"{case.name} gluon: max abs error {err:.3g} against float64")
        if not passes(err):
            print(f"{case.name}: the Gluon kernel is WRONG (max abs error {err:.3g}); no timings", file=sys.stderr)
            return 1
        calls[(case.name, "gluon")] = product
        notes[(case.name, "gluon")] = f"the product kernel ({G.describe(case.head_dim)}); max abs error {err:.2g}"
        calls[(case.name, "public API")] = lambda q=q, k=k, v=v, cu=cu, plan=plan: varlen_attention(
            q, k, v, cu, metadata=plan, backend="gluon")
        notes[(case.name, "public API")] = "varlen_attention(..., backend='gluon'), prepared plan: the same kernel"
        # Candidates, not probes: the product with one setting changed, checked against float64 like it. The other
        # consumer-warpgroup count (GUARDLINT_GLUON_WGS) where both are possible, so that the count each head dim
        # runs is measured against the other in the same run; some of P's exponentials on the FMA units
        # (GUARDLINT_GLUON_EXP2_POLY, attention.softmax_exp2).
        other = 2 if G.consumer_groups(case.head_dim, False) == 3 else 3
        settings = [(f"{other} consumer warpgroups", "WGS_SETTING", str(other))] if (
            other == 2 or case.head_dim <= G.THREE_WG_MAX_HEAD_DIM) else []
        settings += [(f"exp2 {poly} of {G.EXP2_PACK.value} on FMA", "EXP2_POLY_SETTING", str(poly))
                     for poly in EXP2_POLY_CANDIDATES if poly != G.exp2_poly()]
        for label, name, value in settings:
            alt = with_setting(G, name, value, product)
            err_alt = max_abs_error(alt(), reference(case, q, k, v, offsets))
            log(f"{case.name} gluon, {label}: max abs error {err_alt:.3g} against float64")
            described = with_setting(G, name, value, lambda d=case.head_dim: G.describe(d))()
            if passes(err_alt):
                calls[(case.name, label)] = alt
                notes[(case.name, label)] = f"candidate ({described}); max abs error {err_alt:.2g}"
            else:
                notes[(case.name, label)] = f"WRONG RESULT (max abs error {err_alt:.3g}): not timed"
        for name, what, module, kernel, swaps in probes(case.head_dim):
            calls[(case.name, name)] = with_setting(module, kernel, probe_kernel(module, kernel, swaps), product)
            calls[(case.name, name)]()
            notes[(case.name, name)] = what
        torch.cuda.synchronize()
        log(f"{case.name}: probes built")
    for proc in builders:
        try:
            proc.wait(timeout=max(args.fa3_timeout - (time.time() - START), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
    for case in cases:
        q, k, v, cu, offsets, plan = inputs[case.name]
        if case.head_dim not in (64, 128):
            continue
        if fa3_reason or not fi.supports("fa3", case.head_dim, q.dtype, q.device):
            notes[(case.name, "flashinfer-fa3")] = f"not run: {fa3_reason or 'FA3 does not take this head dim here'}"
            continue
        try:
            def fa3(q=q, k=k, v=v, cu=cu, plan=plan):
                return varlen_attention(q, k, v, cu, metadata=plan, backend="flashinfer-fa3")

            err = max_abs_error(fa3(), reference(case, q, k, v, offsets))
            calls[(case.name, "flashinfer-fa3")] = fa3
            notes[(case.name, "flashinfer-fa3")] = f"FlashInfer FA3 ragged prefill, planned; max abs error {err:.2g}"
        except Exception as exc:  # reported in the table, not raised
            notes[(case.name, "flashinfer-fa3")] = f"not run: {type(exc).__name__}: {exc}"[:200]
        log(f"{case.name} flashinfer-fa3: {notes[(case.name, 'flashinfer-fa3')]}")
    keys = list(calls)
    times = {key: [] for key in keys}
    for r in range(ROUNDS):
        # A fresh order each round: a row's time can depend on the row before it (clocks after a heavy kernel).
        for key in random.Random(r).sample(keys, len(keys)):
            times[key].append(cuda_time_us(calls[key], warmup=3, iters=20))
        log(f"round {r + 1}/{ROUNDS}")
    us = {key: statistics.median(t) for key, t in times.items()}
    # Each row against its case's product, back to back in alternating order: the median ratio of PAIRS pairs.
    paired = {}
    for key in keys:
        if key[1] == "gluon":
            continue
        product_call, ratios = calls[(key[0], "gluon")], []
        for i in range(PAIRS):
            first, second = (product_call, calls[key]) if i % 2 == 0 else (calls[key], product_call)
            a, b = cuda_time_us(first, warmup=2, iters=8), cuda_time_us(second, warmup=2, iters=8)
            ratios.append(b / a if i % 2 == 0 else a / b)
        paired[key] = statistics.median(ratios)
    log("pairs timed")
    fa3_128 = us.get(("6img-d128", "flashinfer-fa3"))
    rows = []
    for case in cases:
        product = us[(case.name, "gluon")]
        mine = [k for k in keys if k[0] == case.name]
        for key in mine + [k for k in notes if k[0] == case.name and k not in mine]:
            if key not in us:
                if key in notes:
                    rows.append({"case": case.name, "probe": key[1], "what": notes[key]})
                continue
            rows.append({"case": case.name, "probe": key[1], "what": notes[key], "us": us[key],
                         "tflops": case.flops / (us[key] * 1e-6) / 1e12, "x_gluon": us[key] / product,
                         "x_gluon_paired": paired.get(key, 1.0),
                         "x_fa3_d128": us[key] / fa3_128 if fa3_128 else None})
    meta = env_meta()
    meta.update(case="6 images 1024/4096/256/2304/576/8192 tokens, 16 heads, bf16, non-causal",
                timing=f"median of per-call CUDA events (3 warm-up, 20 calls), median of {ROUNDS} rounds, each in a "
                       f"shuffled order; x_gluon_paired: median ratio to the product over {PAIRS} back-to-back pairs "
                       f"(8 calls each, alternating which runs first)",
                tflops="of the case's full attention FLOPs (4 L^2 H D per sequence), probes too")
    columns = ["case", "probe", "what", "us", "tflops", "x_gluon", "x_gluon_paired", "x_fa3_d128"]
    table = write_results("attention_anatomy", rows, columns, meta=meta,
                          title="Where the Gluon attention kernels' time goes (6 images, bf16, device us per call)",
                          out_dir=None)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
