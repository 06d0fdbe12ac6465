"""Shared benchmark plumbing: CUDA-event timing (median after warm-up) and result files.

Every benchmark prints a table last. The committed results, ``bench/results/<name>.json`` + ``.md``
(+ ``.png``), are written only with ``--write`` (or into a folder the script is told to use), so a trial run
never overwrites them.
"""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

RESULTS = Path(__file__).resolve().parent / "results"
# Every script that writes bench/results/ takes --write (read here, so it holds wherever _util is imported).
WRITE = "--write" in sys.argv[1:]
WRITE_HELP = "write the results into bench/results/ (the committed ones); without it they are printed only"


def require(*modules: str) -> None:
    """Exit with a clear message when a module this benchmark imports is missing (run outside the venv)."""
    missing = []
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    if missing:
        script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "this benchmark"
        sys.exit(f"{script} needs {', '.join(missing)}, which {sys.executable} cannot import. Run it with the "
                 f"project's venv (make install; .venv/bin/python bench/{script} ...), or run "
                 f"pip install -e '.[torch,test]' with this Python.")


def results_dir(out_dir: Optional[os.PathLike] = None) -> Optional[Path]:
    """Where result files go: ``out_dir`` when given, bench/results/ with --write, else None (print only)."""
    if out_dir:
        return Path(out_dir)
    return RESULTS if WRITE else None


def env_meta() -> dict:
    """Versions and device, recorded beside every result."""
    meta = {"python": platform.python_version(), "machine": platform.machine(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import flashinfer

        meta["flashinfer"] = flashinfer.__version__
    except Exception:
        meta["flashinfer"] = None
    return meta


def cpu_name() -> str:
    """The CPU's model name, recorded beside host-time results (they mean little without it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def cuda_time_us(fn: Callable[[], object], *, warmup: int = 10, iters: int = 50,
                 setup: Optional[Callable[[], object]] = None) -> float:
    """Median time of ``fn()`` in microseconds, each call bracketed by its own CUDA events.

    The calls are queued back to back and synchronised once at the end, as in a model forward: when the
    host enqueues faster than the GPU runs, each bracket holds device time only; when it is slower, the
    GPU waits and the bracket holds that wait too (a host-bound call shows its host cost). ``setup`` (not
    timed, outside the brackets) runs before each call, e.g. to refresh inputs or flush the L2 cache.
    """
    import torch

    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        if setup is not None:
            setup()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def amortised_graph_us(fns: Sequence[Callable[[], object]], *, calls: int = 16, replays: int = 30) -> float:
    """Device time per call, amortised: ``calls`` calls captured in one CUDA graph, cycling over ``fns``
    (one callable per input set: sets that together exceed the L2 keep each call's reads cold), replayed
    ``replays`` times; the median replay divided by ``calls``. No host work and no launch gaps between
    the calls beyond the graph's own."""
    import torch

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def l2_flusher(mb: int = 256):
    """A setup callable that overwrites a buffer bigger than the L2 cache (50 MB on an H200)."""
    import torch

    buf = torch.empty(mb * 1024 * 1024 // 4, dtype=torch.float32, device="cuda")
    return lambda: buf.zero_()


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
        return "" if v is None else str(v)

    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(out)


def write_results(name: str, rows: Sequence[dict], columns: Sequence[str], *, meta: Optional[dict] = None,
                  title: str = "", out_dir: Optional[os.PathLike] = None) -> str:
    """Write ``<name>.json`` and ``<name>.md`` (see :func:`results_dir`); return the Markdown table (callers
    print it last)."""
    out = results_dir(out_dir)
    if out is None:
        print(f"{name}: results not written (pass --write to update bench/results/)", file=sys.stderr)
        return markdown_table(rows, columns)
    out.mkdir(parents=True, exist_ok=True)
    meta = meta if meta is not None else env_meta()
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=2) + "\n")
    table = markdown_table(rows, columns)
    head = f"# {title or name}\n\n" + ", ".join(f"{k}: {v}" for k, v in meta.items()) + "\n\n"
    (out / f"{name}.md").write_text(head + table + "\n")
    return table


def bar_plot(name: str, rows: Sequence[dict], *, group: str, label: str, values: dict, title: str,
             ylabel: str = "us", out_dir: Optional[os.PathLike] = None) -> Optional[Path]:
    """``<name>.png`` beside the results: one panel per value of ``group``, one bar cluster per row (named by
    its ``label``), one bar per column of ``values`` ({column: legend}). None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        print(f"{name}: no plot (matplotlib does not import: {type(exc).__name__})", file=sys.stderr)
        return None
    out = results_dir(out_dir)
    if out is None:
        return None
    groups = list(dict.fromkeys(r[group] for r in rows))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.8), squeeze=False)
    width = 0.8 / max(len(values), 1)
    for ax, g in zip(axes[0], groups):
        mine = [r for r in rows if r[group] == g]
        for i, (column, legend) in enumerate(values.items()):
            xs = [x + (i - (len(values) - 1) / 2) * width for x in range(len(mine))]
            ax.bar(xs, [r.get(column) or 0 for r in mine], width, label=legend)
        ax.set_xticks(list(range(len(mine))))
        ax.set_xticklabels([str(r[label]) for r in mine], rotation=35, ha="right", fontsize=7)
        ax.set_title(str(g))
        ax.set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
