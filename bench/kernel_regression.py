"""The kernels before and after a change, timed side by side in one process on the GPU.

``--base DIR`` holds the earlier versions of the kernel modules (written by ``--extract REV`` from git, here):
``attention_triton.py``, ``attention_gluon.py``, ``lora_triton.py``. Each is loaded beside the current module in
the same package, so both run on the same inputs, in the same process, on the same GPU. Every case is timed in
rounds; each round runs the two versions in a shuffled order, each as a CUDA-event median over back-to-back
calls, and the reported ratio is the median of the rounds' new/old ratios (the GPU's clock drifts within a
run, so only ratios of neighbours are compared). Outputs of the two versions are compared too.
Usage: python bench/kernel_regression.py --extract HEAD~3 --base .base   (here, with git)
       python3 bench/kernel_regression.py --base .base [--rounds 15] [--write]   (on the GPU)
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

FILES = {  # name in --base: (path in the repository, module it is loaded beside)
    "attention_triton.py": ("kernels/attention/triton.py", "guardlint.kernels.attention"),
    "attention_gluon.py": ("kernels/attention/gluon.py", "guardlint.kernels.attention"),
    "lora_triton.py": ("kernels/lora/triton.py", "guardlint.kernels.lora"),
    "lora_gluon.py": ("kernels/lora/gluon.py", "guardlint.kernels.lora"),
}
IMAGES = (1024, 4096, 256, 2304, 576, 8192)


def extract(rev: str, base: Path) -> None:
    base.mkdir(parents=True, exist_ok=True)
    for name, (path, _) in FILES.items():
        got = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
        if got.returncode:
            print(f"{path} not in {rev}: skipped")
            continue
        text = got.stdout
        (base / name).write_text(text)
    (base / "REV").write_text(subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True,
                                             check=True).stdout)
    print(f"wrote {', '.join(FILES)} of {rev} to {base}")


def load_base(base: Path, name: str):
    _, package = FILES[name]
    module_name = f"{package}._base_{Path(name).stem}"
    spec = importlib.util.spec_from_file_location(module_name, base / name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def time_pair(torch, calls: dict, rounds: int, iters: int) -> dict:
    """Per-call µs of each callable (median over rounds) and the median of the rounds' ratios new/old."""
    for fn in calls.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    per = {k: [] for k in calls}
    ratios = []
    for _ in range(rounds):
        order = list(calls)
        random.shuffle(order)
        got = {}
        for k in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                calls[k]()
            end.record()
            end.synchronize()
            got[k] = start.elapsed_time(end) * 1e3 / iters
            per[k].append(got[k])
        ratios.append(got["new"] / got["old"])
    return {"old_us": round(statistics.median(per["old"]), 2), "new_us": round(statistics.median(per["new"]), 2),
            "ratio": round(statistics.median(ratios), 4), "ratio_min": round(min(ratios), 4),
            "ratio_max": round(max(ratios), 4)}


def time_graphs(torch, graphs: dict, calls: int, rounds: int) -> dict:
    """As ``time_pair``, for CUDA graphs of ``calls`` captured calls each: per-call µs of a replay."""
    t = time_pair(torch, {k: g.replay for k, g in graphs.items()}, rounds, 5)
    return {**t, "old_us": round(t["old_us"] / calls, 2), "new_us": round(t["new_us"] / calls, 2)}


def graph_kernels(torch, graph, calls: int) -> dict:
    """What one replay of ``graph`` ran, by the profiler: the kernels' names and their device time per call
    (µs), the timer that launch gaps and the event pair's own cost do not reach."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    names, total = set(), 0.0
    for e in prof.events():
        if str(e.device_type).endswith("CUDA") and getattr(e, "device_time", 0) > 0:
            names.add(e.name[:40])
            total += e.device_time
    return {"kernels": sorted(names), "kernel_us": round(total / (3 * calls), 2)}


class _OldGluon:
    """``kernels._gluon`` as the earlier LoRA module sees it: ``load("lora.gluon")`` gives the earlier Gluon
    shrink (when --base has one), everything else the current helpers."""

    def __init__(self, current, old_lora_gluon):
        self._current, self._old = current, old_lora_gluon

    def load(self, name):
        return self._old if name == "lora.gluon" and self._old is not None else self._current.load(name)

    def __getattr__(self, name):
        return getattr(self._current, name)


def pin_configs(new_k, old_k) -> int:
    """Give the earlier module the launch configs the current one tuned, key by key: both tune on their own,
    trials are noisy, and two choices would compare configs, not code. Returns how many entries differed."""
    changed = 0
    for tuned in ("_shrink", "_expand"):
        new_t, old_t = getattr(new_k, tuned), getattr(old_k, tuned)
        for key, (bs, bn, options, _) in new_t.chosen.items():
            had = old_t.chosen.get(key)
            if had is None:
                continue
            if had[2] != options:
                changed += 1
            old_t.chosen[key] = (bs, bn, options, old_k.DirectLaunch(old_t.kernel, options, False))
    return changed


def lora_graph_rows(torch, lapi, new_k, old_k, rounds: int) -> list:
    """Every LoRA kernel of bench/lora.py's cases, captured in CUDA graphs (16 calls each) with the current and
    the earlier modules, replayed side by side: the path engines take (prefill shrinks on Hopper run the Gluon
    kernel there)."""
    sys.path.insert(0, str(HERE))
    import lora as bench_lora  # bench/lora.py: its cases, inputs and kernel table

    from guardlint.kernels import lora
    rows = []
    for case in bench_lora.all_cases(False):
        S, info, _, t = bench_lora.build(case, "cuda", torch, lora)
        for name, (ours, *_rest) in bench_lora.kernels(case, S, torch, lora).items():
            graphs, outs = {}, {}
            try:
                for label, module in (("new", new_k), ("old", old_k)):
                    lapi._k = module
                    try:
                        outs[label] = ours(t, info).clone()  # compiled and checked outside the capture
                        torch.cuda.synchronize()
                        if label == "old":
                            pinned = pin_configs(new_k, old_k)
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            for _ in range(16):
                                ours(t, info)
                        graphs[label] = g
                    finally:
                        lapi._k = new_k
                same = bool(torch.equal(outs["new"], outs["old"]))
                timing = time_graphs(torch, graphs, 16, rounds)
                timing["configs_pinned"] = pinned
                for label in ("new", "old"):
                    ran = graph_kernels(torch, graphs[label], 16)
                    timing[f"{label}_kernels"] = ran["kernels"]
                    timing[f"{label}_kernel_us"] = ran["kernel_us"]
            except Exception as e:  # noqa: BLE001 - a changed signature: said, and the other cases still run
                print(f"lora graph {case.name} {name}: {type(e).__name__}: {e}", flush=True)
                continue
            rows.append({"kernel": f"lora {name}, graph replay", "case": case.name,
                         "bitwise_equal": same, **timing})
            print(rows[-1], flush=True)
    return rows


def dump_binaries(modules: dict, kernel: str, tag: str) -> None:
    """With GUARDLINT_DUMP_ASM=DIR, write each module's compiled ``kernel`` (PTX and cubin, every
    specialization launched so far) there: the code the GPU ran, to read with cuobjdump -sass."""
    where = os.environ.get("GUARDLINT_DUMP_ASM")
    if not where:
        return
    Path(where).mkdir(parents=True, exist_ok=True)
    for label, module in modules.items():
        fn = getattr(module, kernel)
        for caches in getattr(fn, "device_caches", {}).values():
            for i, compiled in enumerate(caches[0].values()):
                for kind in ("ptx", "cubin"):
                    data = compiled.asm.get(kind)
                    if data is not None:
                        mode = "wb" if isinstance(data, bytes) else "w"
                        with open(Path(where) / f"{kernel}-{tag}-{label}-{i}.{kind}", mode) as f:
                            f.write(data)


def gluon_direct_rows(torch, old_gluon, rounds: int) -> list:
    """The Gluon shrink alone, launched directly (no dispatch) by each version on bench/lora.py's prefill cases,
    in CUDA graphs side by side: tells a change of the kernel from a change of which kernel the call reaches."""
    sys.path.insert(0, str(HERE))
    import lora as bench_lora

    from guardlint.kernels import lora
    from guardlint.kernels.lora import gluon as new_gluon
    rows = []
    for case in bench_lora.all_cases(False):
        S, info, _, t = bench_lora.build(case, "cuda", torch, lora)
        x, A = t["x"], t["A"]
        N = A.shape[1]
        if N > new_gluon.KERNEL_MAX_N:
            continue
        graphs, outs = {}, {}
        for label, module in (("new", new_gluon), ("old", old_gluon)):
            out = torch.empty(S, N, dtype=x.dtype, device=x.device)

            def call(module=module, out=out):
                ws = A.stride()
                module.launch(x, (x.stride(0), 0, 1), A, (ws[0], 0, ws[1], ws[2]), out, (out.stride(0), 0, 1),
                              info.seg_indptr, info.weight_indices, info.lora_ranks, info.num_segments, S,
                              x.shape[1], N, case.R)
            call()
            torch.cuda.synchronize()
            outs[label] = out.clone()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(16):
                    call()
            graphs[label] = g
        timing = time_graphs(torch, graphs, 16, rounds)
        dump_binaries({"new": new_gluon, "old": old_gluon}, "_shrink_gluon_kernel", case.name)
        for label in ("new", "old"):
            ran = graph_kernels(torch, graphs[label], 16)
            timing[f"{label}_kernels"] = ran["kernels"]
            timing[f"{label}_kernel_us"] = ran["kernel_us"]
        rows.append({"kernel": "lora gluon shrink, direct launch, graph replay", "case": case.name,
                     "bitwise_equal": bool(torch.equal(outs["new"], outs["old"])), **timing})
        print(rows[-1], flush=True)
    return rows


def attention_cases(torch):
    dev, bf = "cuda", torch.bfloat16
    out = []
    for name, lens, d, causal in (("6img-d80", IMAGES, 80, False), ("6img-d128", IMAGES, 128, False),
                                  ("6img-d80-causal", IMAGES, 80, True), ("64x256-d80", (256,) * 64, 80, False)):
        T, H = sum(lens), 16
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(T, H, d, generator=g).to(dev, bf) for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        out.append((name, q, k, v, cu, max(lens), d ** -0.5, causal))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--extract", metavar="REV")
    ap.add_argument("--base", type=Path, default=ROOT / ".base")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--lora-only", action="store_true", help="skip the attention kernels")
    ap.add_argument("--attention-only", action="store_true", help="skip the LoRA kernels")
    ap.add_argument("--name", default="kernel_regression", help="results file name (bench/results/NAME.*)")
    args = ap.parse_args()
    if args.extract:
        extract(args.extract, args.base)
        return
    import torch

    rows = []
    new_tri = importlib.import_module("guardlint.kernels.attention.triton")
    old_tri = load_base(args.base, "attention_triton.py")
    new_glu = old_glu = None
    try:
        new_glu = importlib.import_module("guardlint.kernels.attention.gluon")
        old_glu = load_base(args.base, "attention_gluon.py")
    except Exception as e:  # no Gluon here (not a Hopper GPU, or an older Triton)
        print(f"gluon not compared: {type(e).__name__}: {e}")
    for name, q, k, v, cu, max_seqlen, scale, causal in ([] if args.lora_only else attention_cases(torch)):
        # The Triton kernel twice: on a hint the guard proved (the one-tile kernel guarded calls run) and on an
        # unverified one (programs loop over the tiles a short grid would leave out).
        for label, new_mod, old_mod, fn_name, extra in (
                ("triton, verified hint", new_tri, old_tri, "varlen_attention_triton", {"max_seqlen_verified": True}),
                ("triton, unverified hint", new_tri, old_tri, "varlen_attention_triton", {}),
                ("gluon", new_glu, old_glu, "varlen_attention_gluon", {})):
            if new_mod is None or (label == "gluon" and not new_mod.supports(q, k, v, causal)):
                continue
            new_fn, old_fn = getattr(new_mod, fn_name), getattr(old_mod, fn_name)
            if extra:
                new_fn = functools.partial(new_fn, **extra)
            try:
                a = new_fn(q, k, v, cu, max_seqlen, scale, causal)
                b = old_fn(q, k, v, cu, max_seqlen, scale, causal)
                same = bool(torch.equal(a, b))
                iters = 20 if q.shape[0] > 10_000 else 200
                t = time_pair(torch, {"new": lambda: new_fn(q, k, v, cu, max_seqlen, scale, causal),
                                      "old": lambda: old_fn(q, k, v, cu, max_seqlen, scale, causal)},
                              args.rounds, iters)
            except Exception as e:  # a changed signature: said, and the other cases still run
                print(f"attention {label} {name}: {type(e).__name__}: {e}", flush=True)
                continue
            rows.append({"kernel": f"attention {label}", "case": name, "bitwise_equal": same, **t})
            print(rows[-1], flush=True)
        # The Triton kernel once more with one launch config for both sides (the one the current module's autotuner
        # picked): both modules tune on their own, trials are noisy, and two picks compare tiles, not code.
        pick = tuned_pick(new_tri, q, causal, max_seqlen)
        if pick is not None:
            rows.append(pinned_row(torch, new_tri, old_tri, name, pick, (q, k, v, cu, max_seqlen, scale, causal),
                                   args.rounds))
            print(rows[-1], flush=True)

    if not args.attention_only:
        rows += lora_rows(torch, args)
    write(torch, args, rows)


def tuned_pick(module, q, causal: bool, max_seqlen: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) the module's autotuner picked for this case's key, or None."""
    length_class = module.length_class(max_seqlen)
    for key, cfg in module._varlen_attention_fwd_tuned.cache.items():
        if tuple(key[:5]) == (q.shape[2], causal, 1, length_class, False):
            kw = cfg.kwargs
            return kw["BLOCK_M"], kw["BLOCK_N"], cfg.num_warps, cfg.num_stages
    return None


def pinned_row(torch, new_mod, old_mod, name: str, pick: tuple, inputs: tuple, rounds: int) -> dict:
    """Both Triton modules on one launch config (``config=``, the verified-hint launch): the code's cost alone."""
    q = inputs[0]
    new_fn = functools.partial(new_mod.varlen_attention_triton, config=pick, max_seqlen_verified=True)
    old_fn = functools.partial(old_mod.varlen_attention_triton, config=pick)
    same = bool(torch.equal(new_fn(*inputs), old_fn(*inputs)))
    iters = 20 if q.shape[0] > 10_000 else 200
    t = time_pair(torch, {"new": lambda: new_fn(*inputs), "old": lambda: old_fn(*inputs)}, rounds, iters)
    bm, bn, warps, stages = pick
    return {"kernel": f"attention triton, one config (BLOCK_M={bm} BLOCK_N={bn} warps={warps} stages={stages})",
            "case": name, "bitwise_equal": same, "config": list(pick), **t}


def lora_rows(torch, args) -> list:
    rows: list = []
    from guardlint.kernels import lora
    lapi = importlib.import_module("guardlint.kernels.lora.api")
    new_k, old_k = lapi._k, load_base(args.base, "lora_triton.py")
    old_lora_gluon = None
    if (args.base / "lora_gluon.py").exists():
        try:
            old_lora_gluon = load_base(args.base, "lora_gluon.py")
        except Exception as e:  # noqa: BLE001 - no Gluon here
            print(f"earlier lora gluon not loaded: {type(e).__name__}: {e}")
    old_k._gluon = _OldGluon(old_k._gluon, old_lora_gluon)
    dev, bf = "cuda", torch.bfloat16
    S, K, N, R, L = 4096, 4096, 4096, 16, 4
    lens = [512] * 8
    g = torch.Generator(device="cpu").manual_seed(0)
    info = lora.LoRABatchInfo(
        use_cuda_graph=False, bs=8, num_segments=8,
        seg_indptr=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev),
        weight_indices=torch.tensor([i % L for i in range(8)], dtype=torch.int32, device=dev),
        lora_ranks=torch.full((L,), R, dtype=torch.int32, device=dev),
        scalings=torch.tensor([0.5, 1.0, 2.0, 0.25], dtype=torch.float32, device=dev),
        max_len=max(lens), seg_lens=torch.tensor(lens, dtype=torch.int32, device=dev))
    x = torch.randn(S, K, generator=g).to(dev, bf)
    A = (torch.randn(L, R, K, generator=g) * K ** -0.5).to(dev, bf)
    y = torch.randn(S, R, generator=g).to(dev, bf)
    B = (torch.randn(L, N, R, generator=g) * R ** -0.5).to(dev, bf)
    base = torch.randn(S, N, generator=g).to(dev, bf)

    def with_kernels(module, fn):
        def call():
            lapi._k = module
            try:
                return fn()
            finally:
                lapi._k = new_k
        return call

    for name, fn in (("shrink 4096x4096 r16", lambda: lora.sgemm_lora_a(x, A, info)),
                     ("expand N4096 r16", lambda: lora.sgemm_lora_b(y, B, info, base.clone()))):
        try:
            a, b = with_kernels(new_k, fn)(), with_kernels(old_k, fn)()
            t = time_pair(torch, {"new": with_kernels(new_k, fn), "old": with_kernels(old_k, fn)}, args.rounds, 200)
        except Exception as e:
            print(f"lora {name}: {type(e).__name__}: {e}", flush=True)
            continue
        rows.append({"kernel": "lora triton", "case": name, "bitwise_equal": bool(torch.equal(a, b)), **t})
        print(rows[-1], flush=True)
    rows += lora_graph_rows(torch, lapi, new_k, old_k, args.rounds)
    if old_lora_gluon is not None:
        try:
            rows += gluon_direct_rows(torch, old_lora_gluon, args.rounds)
        except Exception as e:  # noqa: BLE001 - a changed launch signature: said, the table still written
            print(f"gluon direct: {type(e).__name__}: {e}", flush=True)
    return rows


def write(torch, args, rows: list) -> None:
    rev = (args.base / "REV").read_text().strip() if (args.base / "REV").exists() else "?"
    md = [f"# Kernels before ({rev[:10]}) and after, side by side",
          "", f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {args.rounds} rounds in shuffled "
          "order; the ratio is the median of the rounds' new/old ratios (the expand times include a clone of its "
          "base output in both). Command: `python3 bench/kernel_regression.py --base .base --write"
          + (" --attention-only" if args.attention_only else "") + f" --rounds {args.rounds}"
          + (f" --name {args.name}" if args.name != "kernel_regression" else "") + "`.", "",
          "Graph rows also give the profiler's kernel time per call (old / new) and the kernels each side ran. "
          "Attention rows named 'one config' launch both modules with the config the current module's autotuner "
          "picked for the case (`config=`): the ratio of the code alone; the other Triton rows let each side tune "
          "on its own, so a different pick can move them.", "",
          "| kernel | case | old µs | new µs | new/old (min-max) | profiler old / new µs | kernels (new) "
          "| same output |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        prof = f"{r['old_kernel_us']} / {r['new_kernel_us']}" if "new_kernel_us" in r else ""
        ran = ", ".join(r.get("new_kernels", []))
        if "old_kernels" in r and r["old_kernels"] != r.get("new_kernels"):
            ran += f" (old: {', '.join(r['old_kernels'])})"
        pinned = " (configs pinned)" if r.get("configs_pinned") else ""
        md.append(f"| {r['kernel']}{pinned} | {r['case']} | {r['old_us']} | {r['new_us']} | {r['ratio']} "
                  f"({r['ratio_min']}-{r['ratio_max']}) | {prof} | {ran} "
                  f"| {'bitwise' if r['bitwise_equal'] else 'no'} |")
    text = "\n".join(md) + "\n"
    print(text)
    if args.write:
        (HERE / "results" / f"{args.name}.json").write_text(json.dumps({"base": rev, "rows": rows}, indent=2) + "\n")
        (HERE / "results" / f"{args.name}.md").write_text(text)


if __name__ == "__main__":
    main()
