"""Varlen attention on one GPU: correctness against float64, then median times of every backend.

    python bench/attention.py [--write-dispatch] [--cases 6img,64x256,sweep] [--no-flashinfer] [--quick] [--out DIR]
    python bench/attention.py --quick --cpu-smoke        # tiny shapes on the CPU: checks the script
"""
# Cases: 6 images of 1024/4096/256/2304/576/8192 tokens (non-causal and causal) and 64 images of 256 tokens,
# 16 heads, head dim 80 and 128, bfloat16; plus a sweep of 8 images of 256..8192 tokens at head dim 80. Our Triton
# kernel, the SDPA loop and torch's varlen attention run in this process; each FlashInfer configuration
# runs in its own subprocess (bench/_attention_worker.py): a CUDA fault poisons the context. Then the
# dispatch table is built from those first times, written, and loaded here. Last, ``auto`` and every backend
# that passed (FlashInfer ones too, now known not to fault) are timed again in this process, interleaved,
# and those side-by-side medians are the reported times and ratios (the first ones stay as alone_us).
# Writes bench/results/attention.{json,md,png} (attention_smoke.* for --cpu-smoke) and, with
# --write-dispatch, kernels/attention/attention_dispatch.json, the table ``backend="auto"`` reads. Prints a table last.
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint")  # a clear message outside the venv

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DISPATCH_OUT = ROOT / "kernels" / "attention" / "attention_dispatch.json"
START = time.time()

# Backends this process times before the table exists; FlashInfer variants go to subprocesses, auto
# comes last, here.
LOCAL = ("triton", "gluon", "sdpa", "torch-varlen")
FLASHINFER = ("flashinfer-fa2", "flashinfer-fa3", "flashinfer-cudnn")
WORKER_TIMEOUT = {"flashinfer-fa3": 240, "flashinfer-fa2": 150, "flashinfer-cudnn": 150, "warm": 300}
AUTO_ROUNDS = 7  # side-by-side rounds: each times auto and every passing backend once (median per backend)
# Then auto and its pick alone, back to back, in alternating order: the median of these pairs' ratios compares
# the two without the other backends' measurements between them (the GPU's speed drifts between slots).
PAIRED_ROUNDS = 8
RESERVE_S = 20  # kept back from --budget for writing the results
GOAL_D80_US = 1180.0  # the best D=80 anchor (SDPA loop) for 6 images
GOAL_D128_RATIO = 1.25
GOAL_AUTO_RATIO = 1.03
GOAL_D80_VS_FA3 = 0.85  # Gluon at D=80 against FA3 on the same tokens at D=128 (inputs a caller keeps padded)
GOAL_VS_FA3 = 1.0  # the best of ours against FA3 at D=128, non-causal and causal
AUTO_RESERVE_S = 60  # of the budget kept for the final auto timing (FlashInfer workers get the rest)


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def worker_command(args, *extra) -> list:
    cmd = [sys.executable, str(HERE / "_attention_worker.py"), *extra, "--warmup", str(args.warmup),
           "--iters", str(args.iters)]
    if args.quick:
        cmd.append("--quick")
    if args.cpu_smoke:
        cmd.append("--cpu-smoke")
    if args.cases:
        cmd += ["--cases", args.cases]
    return cmd


def parse_worker(proc_out: str, proc_err: str, returncode: int, label: str) -> list:
    lines = [ln for ln in proc_out.splitlines() if ln.startswith("RESULT ")]
    if lines:
        try:
            return json.loads(lines[-1][len("RESULT "):])
        except ValueError:
            pass
    tail = " | ".join(proc_err.strip().splitlines()[-3:])
    return [{"error": f"{label} exited with {returncode} and no result: {tail}"[:500]}]


def remaining(args) -> float:
    return args.budget - RESERVE_S - (time.time() - START)


def run_worker(args, label: str, extra: list, env: dict | None = None) -> list:
    timeout = min(WORKER_TIMEOUT.get(label, 200), remaining(args) - AUTO_RESERVE_S)
    if timeout < 15:
        return [{"error": f"{label} skipped: the --budget of {args.budget:.0f}s is spent"}]
    log(f"subprocess: {label} (timeout {timeout:.0f}s)")
    try:
        proc = subprocess.run(worker_command(args, *extra), capture_output=True, text=True, cwd=ROOT,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        return [{"error": f"{label} timed out after {exc.timeout}s"}]
    sys.stderr.write(proc.stderr[-4000:])
    return parse_worker(proc.stdout, proc.stderr, proc.returncode, label)


def local_rows(cases, args, cuda: bool, warm_proc) -> list:
    """Correctness of every local backend first (Triton autotunes here), then the timings."""
    import torch

    from _attention_cases import host_us, make_inputs, max_abs_error, passes, reference, row, time_us
    from guardlint.kernels import varlen_attention
    from guardlint.kernels.attention import api as attention
    from guardlint.kernels.attention import triton as triton_path

    device = torch.device("cuda" if cuda else "cpu")
    checked = {}
    rows = []
    for case in cases:
        q, k, v, cu, offsets, plan = make_inputs(case, device, torch.bfloat16)
        ref = reference(case, q, k, v, offsets)
        for backend in LOCAL:
            if not attention._runnable(backend, q, k, case.head_dim ** -0.5, case.causal):
                rows.append(row(case, backend, ok=False, note="skipped: " + attention._why_not(backend, q)))
                continue
            out = varlen_attention(q, k, v, cu, metadata=plan, causal=case.causal, backend=backend)
            err = max_abs_error(out, ref)
            checked[(case.name, backend)] = err
            log(f"check {case.name:18s} {backend:13s} max abs error {err:.2e}{'' if passes(err) else '  <-- WRONG'}")
        del q, k, v, ref
    if warm_proc is not None:
        # FlashInfer's JIT build ran beside the checks; wait for it before timing so nothing competes.
        proc, out_file, err_file = warm_proc
        try:
            # Leave two minutes of the budget for the timed subprocesses.
            deadline = min(WORKER_TIMEOUT["warm"] - (time.time() - START), remaining(args) - 120)
            proc.wait(timeout=max(deadline, 1))
            out_file.seek(0)
            err_file.seek(0)
            for r in parse_worker(out_file.read(), err_file.read(), proc.returncode, "warm"):
                log(f"warm: {r}")
        except subprocess.TimeoutExpired:
            proc.kill()
            log("warm: timed out; the FlashInfer workers build their own modules")
        out_file.close()
        err_file.close()
    for case in cases:
        q, k, v, cu, offsets, plan = make_inputs(case, device, torch.bfloat16)
        for backend in LOCAL:
            if (case.name, backend) not in checked:
                continue
            err = checked[(case.name, backend)]
            note = ""
            if backend == "triton" and cuda:
                note = triton_path.tuned_config(case.head_dim, case.causal, case.max_seqlen) or ""
            if backend == "gluon":
                note = attention._gluon().describe(case.head_dim, case.causal)
            if not passes(err):
                rows.append(row(case, backend, err=err, note=f"WRONG RESULT (max abs error {err:.3g})"))
                continue
            fn = lambda: varlen_attention(q, k, v, cu, metadata=plan, causal=case.causal,  # noqa: E731
                                          backend=backend)
            t = time_us(fn, cuda=cuda, warmup=args.warmup, iters=args.iters)
            rows.append(row(case, backend, time=t, err=err, note=note, host=host_us(fn, cuda=cuda)))
            log(f"time  {case.name:18s} {backend:13s} {t:9.1f} us  {rows[-1]['tflops']:.1f} TFLOP/s "
                f"host {rows[-1]['host_us']:.1f} us {note}")
        del q, k, v
    return rows


def side_by_side(cases, args, cuda: bool, entries: list, rows: list) -> list:
    """``auto`` per case, once the table of this run is loaded, timed in this process in alternation with
    every backend that passed here or in its subprocess: ``AUTO_ROUNDS`` rounds, each timing every one of
    them once in a shuffled order (the same timer as every other row), median per backend. The first,
    separate measurements (``alone_us``) built the table; the side-by-side medians replace them in
    ``time_us``, so the ratios in the table and the goals come from one process, one timer and interleaved
    calls (the GPU's clocks drift by several percent over a run). Returns the auto rows; the others are
    updated in place."""
    import statistics

    import torch

    from _attention_cases import host_us, make_inputs, max_abs_error, passes, reference, row, time_us
    from guardlint.kernels import varlen_attention
    from guardlint.kernels.attention import api as attention
    from guardlint.kernels.attention import CONCRETE

    device = torch.device("cuda" if cuda else "cpu")
    table_best = {e["case"]: e["best"] for e in entries}
    out_rows = []
    for case in cases:
        if remaining(args) < 10:
            out_rows.append(row(case, "auto", ok=False, note=f"skipped: the --budget of {args.budget:.0f}s is spent"))
            continue
        q, k, v, cu, offsets, plan = make_inputs(case, device, torch.bfloat16)
        try:
            pick = attention.select_backend(q, k, cu, case.max_seqlen, causal=case.causal, backend="auto")
            note = f"auto -> {pick}"
            best = table_best.get(case.name)
            if best is not None and best != pick:
                # The table's fastest backend cannot run in this process: say why, in the row itself.
                note += f"; table best {best} not runnable here: {attention._why_not(best, q) or 'unknown'}"
            auto = lambda: varlen_attention(q, k, v, cu, metadata=plan, causal=case.causal,  # noqa: E731
                                            backend="auto")
            out = auto()  # also loads what the pick needs (FlashInfer's modules, plans) before timing
            err = max_abs_error(out, reference(case, q, k, v, offsets))
            del out
            if not passes(err):
                out_rows.append(row(case, "auto", err=err, note=f"WRONG RESULT (max abs error {err:.3g}); {note}"))
                continue
            others = {r["backend"]: r for r in rows
                      if r.get("case") == case.name and r["backend"] in CONCRETE and r.get("ok") and r.get("time_us")
                      and attention._runnable(r["backend"], q, k, case.head_dim ** -0.5, case.causal)}
            calls = {"auto": auto}
            for backend in others:
                calls[backend] = lambda b=backend: varlen_attention(q, k, v, cu, metadata=plan, causal=case.causal,
                                                                    backend=b)
                calls[backend]()  # plans and modules loaded before timing
            times = {name: [] for name in calls}
            names = list(calls)
            for i in range(AUTO_ROUNDS):
                # A fresh order each round: none is always first after a pause (clocks ramp) or always after the
                # same heavy kernel (bench/attention_anatomy.py saw a row's time follow the row before it).
                for name in random.Random(i).sample(names, len(names)):
                    times[name].append(time_us(calls[name], cuda=cuda, warmup=args.warmup, iters=args.iters))
            medians = {name: statistics.median(t) for name, t in times.items()}
            for backend, r in others.items():
                r["alone_us"] = r["time_us"]
                r["time_us"] = medians[backend]
                r["tflops"] = case.flops / (medians[backend] * 1e-6) / 1e12
            t_auto = medians["auto"]
            t_pick = medians.get(pick)
            paired = None
            if pick in calls:
                ratios = []
                for i in range(PAIRED_ROUNDS):
                    pair = ("auto", pick) if i % 2 == 0 else (pick, "auto")
                    got = {name: time_us(calls[name], cuda=cuda, warmup=args.warmup, iters=args.iters)
                           for name in pair}
                    ratios.append(got["auto"] / got[pick])
                paired = statistics.median(ratios)
            out_rows.append(row(case, "auto", time=t_auto, err=err, host=host_us(auto, cuda=cuda),
                                note=note + (f"; {pick} beside it: {t_pick:.1f} us" if t_pick else "")
                                + (f"; paired with it: {paired:.3f}x" if paired is not None else "")))
            out_rows[-1]["pick"], out_rows[-1]["pick_us"], out_rows[-1]["paired_ratio"] = pick, t_pick, paired
            log(f"side by side {case.name:18s} " + ", ".join(f"{n} {t:.1f}" for n, t in medians.items()))
        except Exception as exc:
            out_rows.append(row(case, "auto", ok=False, note=f"error: {type(exc).__name__}: {exc}"[:300]))
            log(f"auto  {case.name}: {type(exc).__name__}: {exc}")
            if cuda:
                try:
                    torch.cuda.synchronize()
                except Exception:
                    break  # a fault leaves the context unusable: report what there is
        del q, k, v
    return out_rows


def dispatch_entries(cases, rows, device_name: str, capability: tuple) -> list:
    from guardlint.kernels.attention import CONCRETE

    entries = []
    for case in cases:
        times = {r["backend"]: r["time_us"] for r in rows
                 if r.get("case") == case.name and r["backend"] in CONCRETE and r.get("ok") and r.get("time_us")}
        if not times:
            continue
        entries.append({
            "device": device_name, "capability": list(capability), "dtype": "bfloat16", "head_dim": case.head_dim,
            "causal": case.causal, "case": case.name, "batch": len(case.lengths), "max_seqlen": case.max_seqlen,
            "total_tokens": case.total_tokens, "times_us": {k: round(v, 2) for k, v in sorted(times.items())},
            "best": min(times, key=times.get),
        })
    return entries


def annotate(cases, rows) -> dict:
    """vs_best for every timed row; returns the best selectable time per case."""
    from guardlint.kernels.attention import CONCRETE

    best = {}
    for case in cases:
        timed = [r for r in rows if r.get("case") == case.name and r.get("ok") and r.get("time_us")]
        selectable = [r for r in timed if r["backend"] in CONCRETE]
        if not selectable:
            continue
        best[case.name] = min(r["time_us"] for r in selectable)
        for r in timed:
            r["vs_best"] = r["time_us"] / best[case.name]
    return best


def goals(cases, rows, best) -> list:
    def time_of(case, backend):
        r = next((r for r in rows if r.get("case") == case and r["backend"] == backend and r.get("ok")), None)
        return r["time_us"] if r and r.get("time_us") else None

    out = []
    t80 = time_of("6img-d80", "triton")
    if t80 is not None:
        out.append((t80 <= GOAL_D80_US, f"Triton 6 images D=80: {t80:.0f} us (goal <= {GOAL_D80_US:.0f} us, "
                                        f"the best anchor)"))
    # Ours at D=128: the Triton kernel and the Gluon one (Triton's explicit-layout dialect), each reported.
    for backend, label in (("triton", "Triton"), ("gluon", "Gluon")):
        t128 = time_of("6img-d128", backend)
        if t128 is not None and "6img-d128" in best:
            ratio = t128 / best["6img-d128"]
            out.append((ratio <= GOAL_D128_RATIO, f"{label} 6 images D=128: {t128:.0f} us = {ratio:.2f}x the best "
                                                  f"measured (goal <= {GOAL_D128_RATIO}x)"))
    # Kernel against kernel: FA3 at D=128 on the same tokens is what a caller who keeps inputs padded runs.
    fa3 = time_of("6img-d128", "flashinfer-fa3")
    t80 = time_of("6img-d80", "gluon")
    if fa3 is not None and t80 is not None:
        out.append((t80 / fa3 <= GOAL_D80_VS_FA3, f"Gluon 6 images D=80: {t80:.0f} us = {t80 / fa3:.3f}x FA3 at "
                                                  f"D=128 on the same tokens (goal <= {GOAL_D80_VS_FA3}x)"))
    for name in ("6img-d128", "6img-d128-causal"):
        fa3 = time_of(name, "flashinfer-fa3")
        ours = [(t, b) for b in ("triton", "gluon") if (t := time_of(name, b)) is not None]
        if fa3 is not None and ours:
            t, b = min(ours)
            out.append((t / fa3 <= GOAL_VS_FA3, f"best of ours on {name}: {b} {t:.0f} us = {t / fa3:.3f}x FA3 "
                                                f"(goal <= {GOAL_VS_FA3}x)"))
    worst = None
    for case in cases:
        t = time_of(case.name, "auto")
        if t is None or case.name not in best:
            continue
        ratio = t / best[case.name]
        if worst is None or ratio > worst[0]:
            worst = (ratio, case.name)
    if worst is not None:
        out.append((worst[0] <= GOAL_AUTO_RATIO, f"auto vs best, worst case {worst[1]}: {worst[0]:.3f}x "
                                                 f"(goal <= {GOAL_AUTO_RATIO}x in every case)"))
    beside = [(r["time_us"] / r["pick_us"], r["case"], r["pick"]) for r in rows
              if r["backend"] == "auto" and r.get("ok") and r.get("pick_us")]
    if beside:
        ratio, case, pick = max(beside)
        out.append((ratio <= GOAL_AUTO_RATIO, f"auto vs its pick called directly beside it, worst case {case} "
                                              f"(-> {pick}): {ratio:.3f}x (goal <= {GOAL_AUTO_RATIO}x)"))
    paired = [(r["paired_ratio"], r["case"], r["pick"]) for r in rows
              if r["backend"] == "auto" and r.get("ok") and r.get("paired_ratio")]
    if paired:
        ratio, case, pick = max(paired)
        out.append((ratio <= GOAL_AUTO_RATIO, f"auto vs its pick, paired back to back ({PAIRED_ROUNDS} pairs, order "
                                              f"alternated), worst case {case} (-> {pick}): {ratio:.3f}x "
                                              f"(goal <= {GOAL_AUTO_RATIO}x)"))
    return out


def plot(cases, rows, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"no plot: matplotlib does not import ({type(exc).__name__})"
    sweep = [c for c in cases if c.sweep]
    main = [c for c in cases if not c.sweep]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    for backend in ("triton", "gluon", "auto", "sdpa", "torch-varlen", "fa3-pad128"):
        pts = [(c.lengths[0], r["tflops"]) for c in sweep for r in rows
               if r.get("case") == c.name and r["backend"] == backend and r.get("ok") and r.get("tflops")]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=backend)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per image (8 images, 16 heads, D=80)")
    ax.set_ylabel("TFLOP/s (4 sum L^2 H D / time)")
    ax.set_title("Sequence-length sweep, bf16")
    if ax.get_lines():
        ax.legend()
    ax.grid(alpha=0.3)
    ax = axes[1]
    backends = [b for b in ("triton", "gluon", "auto", "sdpa", "torch-varlen", *FLASHINFER, "fa3-pad128")
                if any(r["backend"] == b and r.get("time_us") for r in rows)]
    width = 0.8 / max(len(backends), 1)
    for i, backend in enumerate(backends):
        xs, ys = [], []
        for j, c in enumerate(main):
            r = next((r for r in rows if r.get("case") == c.name and r["backend"] == backend and r.get("ok")), None)
            if r and r.get("time_us"):
                xs.append(j + i * width)
                ys.append(r["time_us"] / 1000)
        ax.bar(xs, ys, width=width, label=backend)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(main))], [c.name for c in main])
    ax.set_yscale("log")
    ax.set_ylabel("ms per call (median)")
    ax.set_title("Main cases")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help="update the committed files in bench/results/ (default: print only)")
    parser.add_argument("--cases", help="comma-separated case-name prefixes (6img, 64x256, sweep, 6img-d80, ...)")
    parser.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer subprocesses")
    parser.add_argument("--quick", action="store_true", help="fewer iterations and sweep points")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (interpreter, sdpa)")
    parser.add_argument("--write-dispatch", action="store_true",
                        help="write kernels/attention/attention_dispatch.json from the measured best per case")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds for the whole run; subprocess timeouts shrink to fit (default 420)")
    parser.add_argument("--out", type=Path, help="also copy the result files and dispatch table into this folder")
    parser.add_argument("--name", help="result file name (default attention): a subset run beside the full table")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--iters", type=int)
    args = parser.parse_args()
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    args.iters = args.iters if args.iters is not None else (10 if args.quick else 50)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
    # Triton keeps its autotune picks on disk: a repeated run skips tuning (device time).
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    sys.path.insert(0, str(HERE))

    import torch

    from _attention_cases import ANCHORS, all_cases, select
    from _util import env_meta, results_dir, write_results

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("No CUDA device: run with --cpu-smoke for a CPU check of this script.", file=sys.stderr)
        return 2
    cases = select(all_cases(quick=args.quick, smoke=args.cpu_smoke), args.cases)
    if not cases:
        print(f"--cases {args.cases!r} matches no case", file=sys.stderr)
        return 2
    name = args.name or ("attention_smoke" if args.cpu_smoke else "attention")
    meta = env_meta()
    meta.update(heads=16 if not args.cpu_smoke else 2, dtype="bfloat16", warmup=args.warmup, iters=args.iters,
                timing="median of per-call CUDA events, calls queued back to back (bench/_util.cuda_time_us), "
                "public API with a prepared plan; "
                "time_us: median of 7 interleaved rounds in one process (every backend and auto side by side); "
                "alone_us: the first, separate measurement (FlashInfer in its own process) that built the table; "
                "host_us: median host time of one call, nothing synchronised (what the CPU spends per call)"
                if cuda else "host clock, CPU smoke run (not a measurement)")
    log(f"{len(cases)} cases on {meta.get('gpu', 'cpu')}: {', '.join(c.name for c in cases)}")

    use_fi = not args.no_flashinfer
    warm_proc = None
    if use_fi and cuda:
        # Files, not pipes: JIT build logs could fill a pipe and stall the child.
        out_file, err_file = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        # Every head dim FlashInfer builds for among the cases, the reference case's 128 first.
        dims = sorted({c.head_dim for c in cases if c.head_dim in (64, 128)} | {128}, reverse=True)
        proc = subprocess.Popen([sys.executable, str(HERE / "_attention_worker.py"), "--warm", "fa2,fa3",
                                 "--warm-head-dim", ",".join(map(str, dims))],
                                cwd=ROOT, stdout=out_file, stderr=err_file, text=True)
        warm_proc = (proc, out_file, err_file)
    rows = local_rows(cases, args, cuda, warm_proc)
    errors = []
    if use_fi:
        # Cheapest first, so that a tight budget still measures some of them (auto keeps its own reserve).
        for backend in ("flashinfer-cudnn", "flashinfer-fa2", "flashinfer-fa3"):
            for r in run_worker(args, backend, ["--backend", backend]):
                (errors if "error" in r else rows).append(r)
    if cuda:
        device_name = torch.cuda.get_device_name()
        capability = tuple(torch.cuda.get_device_capability())
    else:
        device_name, capability = "cpu", ()
    entries = dispatch_entries(cases, rows, device_name, capability)
    from guardlint.kernels.attention import dispatch

    table = {"version": dispatch.TABLE_VERSION, "meta": meta, "rule": dispatch.RULE, "entries": entries}
    try:  # eager host times per backend come from bench/attention_eager.py: kept
        table["host_us"] = json.loads(DISPATCH_OUT.read_text()).get("host_us", {})
    except (OSError, ValueError):
        pass
    if args.write_dispatch:
        table_file = DISPATCH_OUT if cuda else HERE / "results" / "attention_smoke_dispatch.json"
    else:
        table_file = Path(tempfile.mkstemp(prefix="attention_dispatch_", suffix=".json")[1])
    table_file.write_text(json.dumps(table, indent=1) + "\n")
    if args.write_dispatch:
        log(f"dispatch table: {table_file.relative_to(ROOT)} ({len(entries)} entries)")
    # auto reads exactly the table just written: point it there and forget earlier choices.
    os.environ[dispatch.TABLE_ENV] = str(table_file)
    dispatch.reset()
    for r in side_by_side(cases, args, cuda, entries, rows):
        (errors if "error" in r else rows).append(r)
    if not args.write_dispatch:
        table_file.unlink(missing_ok=True)

    best = annotate(cases, rows)
    outcome = goals(cases, rows, best) if cuda else []
    columns = ["case", "backend", "time_us", "tflops", "vs_best", "alone_us", "host_us", "max_abs_err", "note"]
    order = {b: i for i, b in enumerate(("triton", "gluon", "auto", "sdpa", "torch-varlen", *FLASHINFER, "fa3-pad128"))}
    case_order = {c.name: i for i, c in enumerate(cases)}
    rows.sort(key=lambda r: (case_order.get(r.get("case"), 99), order.get(r.get("backend"), 99)))
    # bench/results/ with --write; otherwise a temporary folder (printed), so a trial run keeps the committed files
    res = results_dir() or Path(tempfile.mkdtemp(prefix="attention_results_"))
    table_md = write_results(name, rows, columns, meta=meta, out_dir=res,
                             title=f"Varlen attention, bf16, {meta['heads']} heads (time in us, median per call)")
    if res != HERE / "results":
        log(f"results in {res} (pass --write to update bench/results/)")
    md = res / f"{name}.md"
    extra = ["", "## Goals", *[f"- {'PASS' if ok else 'FAIL'}: {text}" for ok, text in outcome]]
    extra += ["", "## Anchors measured on an H200 (DESIGN.md), us",
              *[f"- {case}: " + ", ".join(f"{b} {lo}-{hi}" if lo != hi else f"{b} {lo}" for b, (lo, hi) in a.items())
                for case, a in ANCHORS.items()]]
    extra += ["", "Dispatch rule (`backend=\"auto\"`):", "", "```", dispatch.RULE.rstrip(), "```"]
    if errors:
        extra += ["", "## Subprocess errors", *[f"- {e['error']}" for e in errors]]
    with md.open("a") as fh:
        fh.write("\n".join(extra) + "\n")
    log(plot(cases, rows, res / f"{name}.png"))
    if args.out:
        import shutil

        args.out.mkdir(parents=True, exist_ok=True)
        copies = [res / f"{name}.{ext}" for ext in ("json", "md", "png")]
        if args.write_dispatch:
            copies.append(DISPATCH_OUT if cuda else HERE / "results" / "attention_smoke_dispatch.json")
        for path in copies:
            if path.exists():
                shutil.copy2(path, args.out / path.name)
        log(f"copied {len(copies)} files to {args.out}")
    wrong = [r for r in rows if str(r.get("note", "")).startswith("WRONG")]
    for e in errors:
        print(f"subprocess error: {e['error']}")
    for ok, text in outcome:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    if wrong:
        print("CORRECTNESS FAILURES: " + ", ".join(f"{r['case']}/{r['backend']} (max abs error {r['max_abs_err']:.3g})"
                                                   for r in wrong))
    print()
    print(table_md)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
