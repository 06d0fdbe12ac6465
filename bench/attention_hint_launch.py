"""What the launch after an unverified hint costs, and what the cost is made of (H200).

The Triton forward with a hint nothing verified runs a second kernel for the query tiles past the hint
(``_varlen_attention_rest``). With a right hint that kernel does no work, so its cost is its launch. This times,
side by side in rounds of shuffled order, the first kernel alone and followed by: the second kernel as shipped
(a programmatic dependent launch on Hopper), the same launched plainly, the same with light launch options (4
warps, one stage, BLOCK_N=32: a small shared-memory footprint), the same on a grid of one program per sequence,
and an empty Triton kernel launched plainly (what any plain second launch costs). Two timers: CUDA events around
each of back-to-back eager calls, and a CUDA graph of 16 calls replayed (no host in the way).
    python3 bench/attention_hint_launch.py [--rounds 7] [--write]
"""
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint")

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402

from _util import amortised_graph_us, cuda_time_us, env_meta, write_results  # noqa: E402
from guardlint.kernels._launch import DirectLaunch  # noqa: E402
from guardlint.kernels.attention import triton as tri  # noqa: E402

IMAGES = (1024, 4096, 256, 2304, 576, 8192)


@triton.jit
def _empty(x):
    pass


def case(name: str, lens, d: int = 80, heads: int = 16):
    T = sum(lens)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(T, heads, d, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return name, q, k, v, cu, max(lens)


def variants(q, k, v, cu, max_seqlen):
    """name -> a call enqueuing that variant's kernels."""
    total, heads, d = q.shape
    batch = cu.numel() - 1
    scale = d ** -0.5
    tri.varlen_attention_triton(q, k, v, cu, max_seqlen, scale, False, max_seqlen_verified=True)  # tunes
    key, size_class, by_length = tri._launch_key(q, k, cu, max_seqlen, False)
    block_m, kwargs, direct = tri._launches[key]
    out = tri.new_output(q)
    order = tri.sequence_order(cu) if by_length else cu
    sq, sk, sv, so = q.stride(), k.stride(), v.stride(), out.stride()
    args = (q, k, v, out, out, cu, order, sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], so[0], so[1], 0, total,
            scale * tri.LOG2E, size_class)
    tiles = -(-max_seqlen // block_m)
    shipped = tri._rest(key, kwargs)
    plain = DirectLaunch(tri._varlen_attention_rest, dict(tri._rest_options(kwargs), GDC=False, launch_pdl=False))
    light = DirectLaunch(tri._varlen_attention_rest,
                         dict(tri._rest_options(kwargs), BLOCK_N=32, num_warps=4, num_stages=1))
    grid = tri.rest_grid(heads, batch, q.device)
    empty = DirectLaunch(_empty, {})
    rest_args = args + (tiles, heads)

    def first():
        direct(args + (0,), (tiles, heads, batch))

    return {
        "first kernel alone (verified hint)": first,
        "+ second kernel, as shipped": lambda: (first(), shipped(rest_args, grid)),
        "+ second kernel, no dependent launch": lambda: (first(), plain(rest_args, grid)),
        "+ second kernel, light options": lambda: (first(), light(rest_args, grid)),
        "+ second kernel, one program per sequence": lambda: (first(), shipped(rest_args, (1, 1, batch))),
        "+ an empty kernel": lambda: (first(), empty((out,), (1,))),
    }, out, (block_m, kwargs, grid)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    rows = []
    for name, q, k, v, cu, mx in (case("64x256-d80", (256,) * 64), case("6img-d80", IMAGES)):
        calls, out, (block_m, kwargs, grid) = variants(q, k, v, cu, mx)
        ref = tri.varlen_attention_triton(q, k, v, cu, mx, q.shape[2] ** -0.5, False, max_seqlen_verified=True)
        for label, fn in calls.items():  # every variant writes the same rows
            out.zero_()
            fn()
            torch.cuda.synchronize()
            assert torch.equal(out, ref), label
        iters = 200 if q.shape[0] < 20000 else 30
        events: dict = {label: [] for label in calls}
        graphs: dict = {label: [] for label in calls}
        for _ in range(args.rounds):
            order = list(calls)
            random.shuffle(order)
            for label in order:
                events[label].append(cuda_time_us(calls[label], warmup=10, iters=iters))
                graphs[label].append(amortised_graph_us([calls[label]], calls=16, replays=20))
        base = "first kernel alone (verified hint)"
        for label in calls:
            ev = [a / b for a, b in zip(events[label], events[base])]
            gr = [a / b for a, b in zip(graphs[label], graphs[base])]
            rows.append({"case": name, "launches": label, "events_us": round(statistics.median(events[label]), 2),
                         "events_x": round(statistics.median(ev), 4),
                         "events_x_range": f"{min(ev):.3f}-{max(ev):.3f}",
                         "graph_us": round(statistics.median(graphs[label]), 2),
                         "graph_x": round(statistics.median(gr), 4),
                         "graph_x_range": f"{min(gr):.3f}-{max(gr):.3f}",
                         "block_m": block_m, "rest_grid": "x".join(map(str, grid))})
            print(rows[-1], flush=True)
    meta = env_meta()
    meta.update({"rounds": args.rounds, "dtype": "bfloat16", "heads": 16,
                 "method": "rounds of shuffled order; events: CUDA events around each of back-to-back eager calls "
                           "(median); graph: 16 calls in one CUDA graph, median replay / 16; x: median over rounds "
                           "of the ratio to the first kernel alone in the same round"})
    table = write_results("attention_hint_launch", rows,
                          ["case", "launches", "events_us", "events_x", "events_x_range", "graph_us", "graph_x",
                           "graph_x_range", "rest_grid"], meta=meta,
                          title="The launch after an unverified hint: what it costs (H200, bf16, right hints)")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
