"""Eager cost per varlen attention call on one GPU: what a ViT forward that does not capture CUDA graphs pays.

For 64 x 256 and 8 x 256 tokens (16 heads, bf16) at D=80 and D=128: 200 calls back to back with one
synchronize at the end, wall time per call (median of 15 rounds, interleaved over the calls of a case), the
host CPU time of the same calls (``time.thread_time``: what the Python thread spends issuing them), and the
device time of the call replayed from a CUDA graph. Every call passes prepared metadata (the layer loop of a
serving engine): no host read of cu_seqlens.

Calls: ``varlen_attention`` on ``triton`` (launched directly once compiled, kernels/_launch.py), the same
through ``JITFunction.run`` (direct launches off), ``auto``, ``gluon`` (the same two ways), ``torch-varlen``; FlashInfer
FA2 as its own users call it (``wrapper.run(q, k, v)`` on a wrapper planned once: FA2 does not build for D=80)
and through ``varlen_attention(backend="flashinfer-fa2")``. Each output is checked against a float64
reference first.

    python bench/attention_eager.py [--write]      # --write: bench/results/attention_eager.{json,md}
"""
from __future__ import annotations

import argparse
import json
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import require  # noqa: E402

require("torch", "triton", "guardlint")

try:
    import torch
    from _attention_cases import Case, make_inputs, max_abs_error, passes, reference
    from _util import amortised_graph_us, bar_plot, env_meta, markdown_table, write_results

    from guardlint.kernels.attention import dispatch
    from guardlint.kernels.attention import flashinfer as fi
    from guardlint.kernels.attention import gluon as gluon_path
    from guardlint.kernels.attention import triton as triton_path
    from guardlint.kernels import varlen_attention
except ImportError as e:
    sys.exit(f"bench/attention_eager.py needs guardlint with torch installed (make install; .venv/bin/python): {e}")

ROUNDS = 15
CALLS = 200
CASES = [Case(f"{n}x256-d{d}", (256,) * n, d) for n in (64, 8) for d in (80, 128)]


def one_round(call) -> tuple:
    """(wall us per call, host CPU us per call) of CALLS calls back to back, one synchronize at the end."""
    torch.cuda.synchronize()
    cpu, start = time.thread_time(), time.perf_counter()
    for _ in range(CALLS):
        call()
    host = time.thread_time() - cpu
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / CALLS, host * 1e6 / CALLS


@contextlib.contextmanager
def direct_launches(on: bool):
    """The attention kernels' direct launches (Triton and Gluon) on or off (off: every launch through
    JITFunction.run)."""
    entries = [entry[2] for entry in triton_path._launches.values()] + list(triton_path._rests.values()) \
        + list(gluon_path._direct.values())
    for entry in entries:
        entry.enabled = on
    try:
        yield
    finally:
        for entry in entries:
            entry.enabled = True


def flashinfer_fa2(q, k, v, offsets, scale):
    """FlashInfer's ragged prefill wrapper planned once (its users' per-layer call is ``run``), or None."""
    if not fi.supports("fa2", q.shape[2], q.dtype, q.device):
        return None
    wrapper = fi._flashinfer().BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=q.device), "NHD", backend="fa2")
    indptr = torch.tensor(offsets, dtype=torch.int32)
    wrapper.plan(indptr, indptr, q.shape[1], k.shape[1], q.shape[2], causal=False, sm_scale=scale,
                 q_data_type=q.dtype, kv_data_type=k.dtype)
    return lambda: wrapper.run(q, k, v)


def plot(rows: list, out_dir=None):
    """bench/results/attention_eager.png (``out_dir``: where; default only with --write)."""
    return bar_plot("attention_eager", rows, group="case", label="call", out_dir=out_dir,
                    values={"wall_us": "eager wall per call",
                                                                        "host_us": "host CPU per call",
                                                                        "graph_us": "device time (CUDA graph)"},
                    title="Varlen attention eager calls on an H200 (16 heads, bf16)")


BACKENDS = ("triton", "gluon", "torch-varlen", "sdpa", "flashinfer-fa2", "flashinfer-fa3", "flashinfer-cudnn")
DISPATCH_TABLE = Path(__file__).resolve().parent.parent / "kernels" / "attention" / "attention_dispatch.json"


def write_host_times(rows: list, gpu: str, table: Path = DISPATCH_TABLE) -> dict:
    """Put each backend's host time per eager call (median over the cases) into the dispatch table's
    ``host_us`` for this GPU: ``auto`` weighs it in eager calls (kernels/attention/dispatch.py, RULE)."""
    times = {name: round(statistics.median(r["host_us"] for r in rows if r["call"] == name), 1)
             for name in BACKENDS if any(r["call"] == name for r in rows)}
    data = json.loads(table.read_text())
    data.setdefault("host_us", {})[gpu] = times
    data["rule"] = dispatch.RULE
    table.write_text(json.dumps(data, indent=1) + "\n")
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write bench/results/attention_eager.{json,md,png}")
    parser.add_argument("--plot", action="store_true", help="only draw bench/results/attention_eager.png from its JSON")
    parser.add_argument("--dispatch", action="store_true",
                        help="only write the host times of bench/results/attention_eager.json into "
                             "kernels/attention/attention_dispatch.json (--write does it too)")
    args = parser.parse_args()
    if args.plot or args.dispatch:
        saved = json.loads((Path(__file__).resolve().parent / "results" / "attention_eager.json").read_text())
        if args.plot:
            print(plot(saved["rows"], Path(__file__).resolve().parent / "results"))
        if args.dispatch:
            print(write_host_times(saved["rows"], saved["meta"]["gpu"]))
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for case in CASES:
        q, k, v, cu, offsets, plan = make_inputs(case, "cuda", torch.bfloat16)
        scale = case.head_dim ** -0.5
        ref = reference(case, q, k, v, offsets)
        calls = {}
        for backend in ("triton", "auto", "gluon", "torch-varlen", "flashinfer-fa2"):
            try:
                out = varlen_attention(q, k, v, cu, metadata=plan, backend=backend)
            except Exception as exc:  # a backend that does not take this head dim or is not installed here
                print(f"{case.name:12s} {backend:40s} skipped: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            calls[backend] = (lambda b=backend: varlen_attention(q, k, v, cu, metadata=plan, backend=b), True, out)
            if backend in ("triton", "gluon"):
                calls[f"{backend}, launch through JITFunction.run"] = (calls[backend][0], False, out)
        fa2 = flashinfer_fa2(q, k, v, offsets, scale)
        if fa2 is not None:
            calls["FlashInfer FA2 wrapper.run (planned once)"] = (fa2, True, fa2())
        errors = {name: max_abs_error(out, ref) for name, (_, _, out) in calls.items()}
        walls: dict = {name: [] for name in calls}
        hosts: dict = {name: [] for name in calls}
        graphs = {}
        for name, (call, direct, _) in calls.items():
            with direct_launches(direct):
                for _ in range(20):
                    call()
                graphs[name] = amortised_graph_us([call])
        for _ in range(ROUNDS):
            for name, (call, direct, _) in calls.items():
                with direct_launches(direct):
                    wall, host = one_round(call)
                walls[name].append(wall)
                hosts[name].append(host)
        for name in calls:
            row = dict(case=case.name, call=name, wall_us=statistics.median(walls[name]),
                       host_us=statistics.median(hosts[name]), graph_us=graphs[name], max_abs_err=errors[name],
                       correct=passes(errors[name]))
            rows.append(row)
            print(f"{case.name:12s} {name:44s} wall {row['wall_us']:7.1f} us  host {row['host_us']:6.1f} us  "
                  f"graph {row['graph_us']:7.1f} us  err {row['max_abs_err']:.2g}", flush=True)
    meta = env_meta()
    meta.update(timing=f"wall_us: {CALLS} eager calls back to back, one synchronize, median of {ROUNDS} rounds "
                       "interleaved over the calls of a case; host_us: the thread's CPU time over the same calls; "
                       "graph_us: device time, 16 calls per CUDA graph (bench/_util.amortised_graph_us); "
                       "max_abs_err against a float64 reference; prepared metadata on every call",
                heads=16, dtype="bfloat16")
    columns = ["case", "call", "wall_us", "host_us", "graph_us", "max_abs_err", "correct"]
    if args.write:
        table = write_results("attention_eager", rows, columns, meta=meta,
                              title="Varlen attention eager calls: wall and host time per call (us)")
    else:
        table = markdown_table(rows, columns)
    if args.write:
        plot(rows)
        print("host_us in the dispatch table:", write_host_times(rows, meta["gpu"]))
    print()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
