"""Editor latency of ``guardlint server``: type a character, time until the new diagnostics arrive.

The model file is sglang 0.5.23's Qwen2.5-VL model (about 1,000 lines, from ``make engines``) with three
findings written into it. A client speaks JSON-RPC over the server's stdio as an editor does: it opens
the file, then types one character at a time into a comment, waiting for the diagnostics of each version.
Prints a table; ``--write`` also writes bench/results/lsp_latency.{json,md}.
Usage: .venv/bin/python bench/lsp_latency.py [--edits 20] [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "lint"))

from lsp_client import Client, insert  # noqa: E402

MODEL = ROOT / ".engines" / "sglang-0.5.23" / "sglang" / "srt" / "models" / "qwen2_5_vl.py"

# Three findings: a varlen call without sequence_lengths and max_seqlen (GL101, GL102) and a LoRA batch
# info with neither max_len nor seg_lens (GL201).
BAD = '''

from guardlint.kernels import cudnn_vision_attention
from sglang.srt.lora.utils import LoRABatchInfo


def packed_attention(q, k, v, cu_seqlens):
    return cudnn_vision_attention(q, k, v, cu_seqlens, cu_seqlens.numel() - 1, 64)


def lora_batch(bs, seg_indptr, weight_indices, lora_ranks, scalings):
    return LoRABatchInfo(bs=bs, num_segments=bs, seg_indptr=seg_indptr, weight_indices=weight_indices,
                         lora_ranks=lora_ranks, scalings=scalings, use_cuda_graph=False, permutation=None)
'''


def model_source() -> str:
    if not MODEL.is_file():
        sys.exit(f"{MODEL} is missing: run `make engines` first")
    return MODEL.read_text() + BAD


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def run(edits: int) -> dict:
    text = model_source()
    lines = text.splitlines()
    # Type into a comment line in the middle of the file: every version parses and keeps its findings.
    middle = len(lines) // 2
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen2_5_vl.py"
        path.write_text(text)
        client = Client(cwd=str(ROOT))
        try:
            t0 = time.perf_counter()
            client.initialize([Path(tmp)])
            init_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            uri = client.open(path, text)
            first = client.diagnostics(uri, version=1, timeout=120)
            open_s = time.perf_counter() - t0
            client.change(uri, 2, [insert(middle, 0, "# \n")])
            client.diagnostics(uri, version=2)
            times, counts = [], set()
            for i in range(edits):
                version = 3 + i
                sent = time.perf_counter()
                client.change(uri, version, [insert(middle, 2 + i, "x")])
                got = client.diagnostics(uri, version=version)
                times.append((time.perf_counter() - sent) * 1e3)
                counts.add(len(got))
        finally:
            client.shutdown()
    return {
        "file": f"sglang 0.5.23 srt/models/qwen2_5_vl.py + three findings ({len(lines)} lines)",
        "lines": len(lines),
        "findings": len(first),
        "findings_after_edits": sorted(counts),
        "initialize_ms": round(init_s * 1e3, 1),
        "first_diagnostics_ms": round(open_s * 1e3, 1),
        "edit_ms": [round(t, 2) for t in times],
        "median_ms": round(statistics.median(times), 1),
        "p90_ms": round(sorted(times)[int(0.9 * (len(times) - 1))], 1),
        "min_ms": round(min(times), 1),
        "max_ms": round(max(times), 1),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
    }


def markdown(r: dict) -> str:
    return "\n".join([
        "# guardlint server: diagnostics after a keystroke",
        "",
        f"File: {r['file']}, {r['findings']} findings. Machine: {r['machine']}, Python {r['python']}.",
        f"Command: `.venv/bin/python bench/lsp_latency.py --edits {len(r['edit_ms'])} --write`.",
        "",
        "| what | ms |",
        "|---|---|",
        f"| start + initialize | {r['initialize_ms']} |",
        f"| open → first diagnostics (imports libcst) | {r['first_diagnostics_ms']} |",
        f"| keystroke → diagnostics, median of {len(r['edit_ms'])} | **{r['median_ms']}** |",
        f"| p90 / min / max | {r['p90_ms']} / {r['min_ms']} / {r['max_ms']} |",
        "",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edits", type=int, default=20)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    r = run(args.edits)
    md = markdown(r)
    print(md)
    if r["findings"] != 3 or r["findings_after_edits"] != [3]:
        sys.exit(f"expected 3 findings before and after every edit, got {r['findings']} and "
                 f"{r['findings_after_edits']}")
    if args.write:
        out = HERE / "results"
        (out / "lsp_latency.json").write_text(json.dumps(r, indent=2) + "\n")
        (out / "lsp_latency.md").write_text(md)


if __name__ == "__main__":
    main()
