"""Qwen2.5-VL-7B's vision tower in Hugging Face transformers: attn_implementation "sdpa" (a loop over images and
windows) against "guardlint_flash" (one varlen_attention call per layer) and torch's varlen flash attention
registered the same way. Random weights, bf16; each output is first checked against an fp32 sdpa run, then
whole-tower forwards are timed (median after warm-up, CUDA events). Prints a Markdown table last.

GPU: ``python bench/transformers_vision.py [--write]``; anywhere: ``python bench/transformers_vision.py --smoke``
(tiny tower, fp32, CPU: the Triton kernel runs in the interpreter). ``--write`` writes
bench/results/transformers_vision.{json,md} (+ .png with matplotlib).
"""
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint", "transformers")  # a clear message outside the venv

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _util import RESULTS, cuda_time_us, env_meta, markdown_table, write_results  # noqa: E402

# Qwen2.5-VL-7B-Instruct's vision config (config.json "vision_config").
CONFIG_7B = dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420, out_hidden_size=3584,
                 window_size=112, fullatt_block_indexes=[7, 15, 23, 31], patch_size=14, spatial_merge_size=2,
                 temporal_patch_size=2, in_channels=3, hidden_act="silu")
CONFIG_SMOKE = dict(depth=4, hidden_size=64, num_heads=4, intermediate_size=96, out_hidden_size=64, window_size=8,
                    fullatt_block_indexes=[1, 3], patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                    in_channels=3, hidden_act="silu")
# (name, [(t, h, w) patch grids]); 14-pixel patches, so 1344x1344 pixels is 96x96 patches.
CASES_7B = [
    ("6 images, 34560 patches", [(1, 96, 96), (1, 64, 96), (1, 80, 80), (1, 48, 64), (1, 96, 64), (1, 56, 64)]),
    ("1 image 1344x1344, 9216 patches", [(1, 96, 96)]),
]
CASES_SMOKE = [("3 images, 112 patches", [(1, 8, 8), (1, 4, 8), (1, 4, 4)]), ("1 image, 64 patches", [(1, 8, 8)])]


# -- torch's own varlen flash attention, as a transformers attention function --------------------------

def torch_varlen_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                         **kwargs):
    """``torch.nn.attention.varlen.varlen_attn`` (else ``aten._flash_attention_forward``) on the packed
    ``cu_seq_lens`` the vision tower passes; (1, H, T, D) in, (1, T, H, D) out."""
    cu = kwargs["cu_seq_lens_q"].to(torch.int32)
    max_len = kwargs["max_length_q"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    if is_causal or dropout:
        raise NotImplementedError("the vision towers call non-causal attention without dropout")
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is not None:
        # The signature moved between releases: scale only where it is a parameter (else the default, D**-0.5).
        scale = {"scale": scaling} if "scale" in inspect.signature(varlen_attn).parameters else {}
        out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **scale)
    else:
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, False, False,
                                                      scale=scaling)[0]
    return out.unsqueeze(0), None


def torch_varlen_problem(device) -> str:
    """'' when torch's varlen flash attention runs bf16 head dim 80 here, else why not."""
    if device.type != "cuda":
        return "needs a CUDA device"
    q = torch.randn(8, 2, 80, device=device, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    try:
        torch_varlen_forward(None, *(q.transpose(0, 1)[None],) * 3, None, cu_seq_lens_q=cu, max_length_q=5)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # not in this torch build, or not for this GPU
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"


FLOOR = "no attention (the tower's floor)"


def no_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """Not attention: v passed through in the layout attention returns, (1, T, H, D). Timing a tower with it
    gives the time of everything but attention, the floor no attention kernel can go under."""
    return value.transpose(1, 2), None


def register_all(device) -> dict:
    """label -> attn_implementation name; labels of implementations that cannot run here map to a reason."""
    from transformers import AttentionInterface

    from guardlint.integrations import transformers as gl_transformers

    impls = {"HF sdpa (loop over images/windows)": "sdpa",
             "guardlint_flash (auto)": gl_transformers.register("guardlint_flash"),
             "guardlint_flash (triton)": gl_transformers.register("guardlint_flash_triton", backend="triton")}
    problem = torch_varlen_problem(device)
    if problem:
        impls["torch varlen flash"] = "skipped: " + problem
    else:
        # The name needs the same flash preload skip; then the function is replaced by torch's own call.
        name = gl_transformers.register("torch_varlen_flash", backend="torch-varlen")
        AttentionInterface.register(name, torch_varlen_forward)
        impls["torch varlen flash"] = name
    floor = gl_transformers.register("no_attention_flash", backend="triton")
    AttentionInterface.register(floor, no_attention_forward)
    impls[FLOOR] = floor
    return impls


# -- the run ------------------------------------------------------------------------------------------

def build_tower(config: dict, dtype, device):
    from transformers import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(Qwen2_5_VLVisionConfig(**config),
                                                                  attn_implementation="sdpa")
    return tower.to(device=device, dtype=dtype).eval()


def inputs(config: dict, grids, device):
    grid = torch.tensor(grids, dtype=torch.long, device=device)
    patches = int(grid.prod(-1).sum())
    features = config["in_channels"] * config["temporal_patch_size"] * config["patch_size"] ** 2
    generator = torch.Generator().manual_seed(1)
    return torch.randn(patches, features, generator=generator).to(device), grid


def forward(tower, impl, pixels, grid):
    tower.set_attn_implementation(impl)
    with torch.no_grad():
        return tower(pixels, grid_thw=grid).pooler_output


def time_ms(fn, device, warmup: int, iters: int) -> float:
    if device.type == "cuda":
        return cuda_time_us(fn, warmup=warmup, iters=iters) / 1e3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny tower, fp32, runs on the CPU")
    parser.add_argument("--write", action="store_true", help="write bench/results/transformers_vision.*")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        parser.error("no CUDA device: run with --smoke")
    config, cases = (CONFIG_SMOKE, CASES_SMOKE) if args.smoke else (CONFIG_7B, CASES_7B)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    iters = args.iters if args.iters is not None else (3 if args.smoke else 10)
    # bf16 against fp32 over 32 layers: relative max error of HF's own sdpa is the yardstick.
    tolerance = 1e-4 if args.smoke else 5e-2

    impls = register_all(device)
    reference_tower = build_tower(config, torch.float32, device)  # both fit: 2.7 GB fp32 + 1.4 GB bf16
    tower = build_tower(config, dtype, device) if dtype != torch.float32 else reference_tower
    rows, failed = [], False
    for case, grids in cases:
        pixels, grid = inputs(config, grids, device)
        reference = forward(reference_tower, "sdpa", pixels, grid).float()
        scale = reference.abs().max().item()
        pixels = pixels.to(dtype)
        baseline = None
        for label, impl in impls.items():
            row = {"case": case, "tokens": int(grid.prod(-1).sum()), "implementation": label}
            if impl.startswith("skipped"):
                row["note"] = impl
                rows.append(row)
                continue
            out = forward(tower, impl, pixels, grid).float()
            error = (out - reference).abs().max().item() / scale
            row["rel_max_err_vs_fp32"] = error
            if label == FLOOR:
                row["note"] = "not attention: v passed through; the time of everything else, output not checked"
                row.pop("rel_max_err_vs_fp32")
            elif not error <= tolerance:
                row["note"] = f"WRONG: relative error {error:.3g} > {tolerance:g}"
                failed = True
                rows.append(row)
                continue
            row["ms"] = time_ms(lambda: forward(tower, impl, pixels, grid), device, warmup, iters)
            baseline = row["ms"] if impl == "sdpa" else baseline
            if baseline:
                row["speedup_vs_sdpa"] = baseline / row["ms"]
            rows.append(row)
            print(f"{case} | {label}: {row['ms']:.2f} ms, rel err {error:.2e}", file=sys.stderr, flush=True)

    columns = ["case", "tokens", "implementation", "ms", "speedup_vs_sdpa", "rel_max_err_vs_fp32", "note"]
    meta = env_meta()
    meta.update(device=str(device), dtype=str(dtype).replace("torch.", ""), warmup=warmup, iters=iters,
                config="smoke" if args.smoke else "Qwen2.5-VL-7B vision tower (random weights)")
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    if args.write:
        name = "transformers_vision_smoke" if args.smoke else "transformers_vision"
        table = write_results(name, rows, columns, meta=meta,
                              title="Hugging Face Qwen2.5-VL vision tower: attention implementations")
        plot(rows, RESULTS / f"{name}.png")
    else:
        table = markdown_table(rows, columns)
    print(table)
    return 1 if failed else 0


def plot(rows, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    timed = [r for r in rows if "ms" in r]
    cases = list(dict.fromkeys(r["case"] for r in timed))
    labels = list(dict.fromkeys(r["implementation"] for r in timed))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        values = [next((r["ms"] for r in timed if r["case"] == c and r["implementation"] == label), 0)
                  for c in cases]
        ax.bar([x + i * width for x in range(len(cases))], values, width, label=label)
    ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(cases))], cases)
    ax.set_ylabel("vision tower forward, ms (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
