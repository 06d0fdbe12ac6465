"""Block-size sweep of the LoRA shrink and expand kernels on the reference prefill case (GPU only).

Each config is timed as device time per call, amortised: 16 calls captured in one CUDA graph, cycling over
4 input sets (128 MB of x, more than the H200's 50 MB L2), replayed 30 times; median over replays / 16.
A 32 MB device-to-device copy timed the same way gives the bandwidth floor of the same run.

    python bench/lora_sweep.py [--quick]
"""
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint")  # a clear message outside the venv

import argparse
import importlib.util
import itertools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CALLS, SETS, REPLAYS = 16, 4, 30


def _load_bench():
    spec = importlib.util.spec_from_file_location("lora_bench", HERE / "lora.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["lora_bench"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def amortised_us(torch, fns) -> float:
    """Median device time per call of ``fns`` (one callable per input set), captured 16 at a time."""
    from _util import amortised_graph_us

    return amortised_graph_us(fns, calls=CALLS, replays=REPLAYS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true",
                    help="update the committed files in bench/results/ (default: print only)")
    ap.add_argument("--quick", action="store_true", help="fewer configs")
    args = ap.parse_args()
    import torch
    import triton

    if not torch.cuda.is_available():
        print("lora_sweep needs a CUDA device")
        return 2
    from _util import env_meta, write_results

    from guardlint.kernels.lora import triton as K
    from guardlint.kernels import lora

    lb = _load_bench()
    case = next(c for c in lb.all_cases(False) if c.name == "prefill-r16")
    dev = torch.device("cuda")
    sets = [lb.build(case, dev, torch, lora) for _ in range(SETS)]
    for i, (_, _, _, t) in enumerate(sets):  # distinct inputs per set (build() is seeded)
        for key in ("x", "y", "base"):
            t[key] = t[key] + (i + 1) * 1e-3
    S, info = sets[0][0], sets[0][1]
    e = 2
    bw_src = [torch.randn(S * case.K, device=dev, dtype=torch.bfloat16) for _ in range(SETS)]
    bw_dst = torch.empty_like(bw_src[0])
    copy_us = amortised_us(torch, [lambda s=s: bw_dst.copy_(s) for s in bw_src])
    bandwidth = 2 * e * S * case.K / (copy_us * 1e-6) / 1e9
    floors = {"sgemm_lora_a": e * (S * case.K + S * case.R) / (bandwidth * 1e3),
              "sgemm_lora_b": e * (S * case.R + 2 * S * case.N) / (bandwidth * 1e3)}
    print(f"copy bandwidth {bandwidth:.0f} GB/s (amortised, {copy_us:.1f} us per 32 MB copy)")

    shrink_space = [dict(BLOCK_S=s, BLOCK_K=k, SPLIT_K=1, num_warps=w, num_stages=st)
                    for s, k, w, st in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4), (3, 4, 5, 7, 9))]
    expand_space = [dict(BLOCK_S=s, BLOCK_N=n, STAGES=st, num_warps=w, num_stages=st)
                    for s, n, w, st in itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4), (2, 3, 4, 6))]
    if args.quick:
        shrink_space, expand_space = shrink_space[::4], expand_space[::4]

    def sweep(name, tuned_attr, space, call):
        original = getattr(K, tuned_attr)
        rows = []
        default_us = amortised_us(torch, [lambda t=t: call(t) for _, _, _, t in sets])
        rows.append(dict(kernel=name, config="default (autotuned set)", us=default_us,
                         floor_us=floors[name], pct_of_floor=100 * floors[name] / default_us))
        for cfg in space:
            kw = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
            conf = triton.Config(kw, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            named = {"x_ptr": sets[0][3]["x"], "K": case.K, "size_class": K._size_class(S, len(case.lens))}
            if original.prune([conf], named, **_prune_meta(name, case))[0] is not conf:
                continue  # does not fit shared memory by the kernel's own estimate
            setattr(K, tuned_attr, K._Tuned(original.kernel, [conf], original.autotuner.keys, original.prune,
                                            original.interpret_blocks,
                                            **({"restore_value": ["out_ptr"]} if name == "sgemm_lora_b" else {})))
            label = " ".join(f"{k}{v}" for k, v in cfg.items())
            try:
                us = amortised_us(torch, [lambda t=t: call(t) for _, _, _, t in sets])
            except Exception as exc:  # a config the compiler rejects is reported, not fatal
                print(f"  {name} {label}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            finally:
                setattr(K, tuned_attr, original)
            rows.append(dict(kernel=name, config=label, us=us, floor_us=floors[name],
                             pct_of_floor=100 * floors[name] / us))
            print(f"  {name:13s} {label:45s} {us:7.2f} us")
        return rows

    rows = sweep("sgemm_lora_a", "_shrink", shrink_space, lambda t: lora.sgemm_lora_a(t["x"], t["A"], info))
    rows += sweep("sgemm_lora_b", "_expand", expand_space,
                  lambda t: lora.sgemm_lora_b(t["y"], t["B"], info, t["base"]))
    best = {}
    for r in rows:
        if r["config"].startswith("default"):
            continue
        if r["kernel"] not in best or r["us"] < best[r["kernel"]]["us"]:
            best[r["kernel"]] = r
    ranked = [r for r in rows if r["config"].startswith("default")]
    ranked += sorted((r for r in rows if not r["config"].startswith("default")), key=lambda r: (r["kernel"], r["us"]))
    meta = env_meta()
    meta.update(case="prefill-r16 (S=4096, K=N=4096, r=16, 8 segments)", bandwidth_gbs=round(bandwidth),
                timing=f"{CALLS} calls per CUDA graph over {SETS} input sets, median of {REPLAYS} replays / {CALLS}")
    table = write_results("lora_sweep", ranked[:2] + [best[k] for k in sorted(best)] + ranked[2:],
                          ["kernel", "config", "us", "floor_us", "pct_of_floor"], meta=meta,
                          title="LoRA block-size sweep, prefill r=16 (device us per call, amortised)")
    print(table)
    return 0


def _prune_meta(name, case):
    if name == "sgemm_lora_a":
        return {"BLOCK_N": 16}
    return {"BLOCK_K": 16, "K_CHUNKS": 1}


if __name__ == "__main__":
    sys.exit(main())
