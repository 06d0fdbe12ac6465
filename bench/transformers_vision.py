"""Qwen2.5-VL-7B's vision tower in Hugging Face transformers: attn_implementation "sdpa" (a loop over images and
windows) against "guardlint_flash" (one varlen_attention call per layer) and torch's varlen flash attention
registered the same way. Random weights, bf16; each output is first checked against an fp32 sdpa run, then
whole-tower forwards are timed (median after warm-up, CUDA events). Prints a Markdown table last.

GPU: ``python bench/transformers_vision.py [--write]``; anywhere: ``python bench/transformers_vision.py --smoke``
(tiny tower, fp32, CPU: the Triton kernel runs in the interpreter). ``--write`` writes
bench/results/transformers_vision.{json,md} (+ .png with matplotlib).

``--train``: one training step per timed call instead of a forward: the tower in train mode with grad enabled,
``loss = pooler_output.float().square().mean()``, ``loss.backward()`` (the gradients set to None at the start of
each step; no optimizer step). Implementations: the floor (v passed through; the step without attention), torch's
varlen flash (timed first, with the floor, so that ratios compare one run), guardlint_flash (triton) (the Triton
backward), guardlint_flash (auto) (auto's choice among the backends with a backward: on a GPU by the dispatch
table's forward + backward times, on the CPU the per-sequence SDPA loop), and HF sdpa under --smoke or with
``--train-sdpa`` (about 10x slower on the GPU, so left out there by default). Correctness first: the gradients
of the first and last blocks' qkv weights against the fp32 sdpa tower's (computed once per case with activation
checkpointing, so only each block's input stays alive, then freed), relative max error within the forward's
tolerance or the row is WRONG and the exit code 1. Columns: the median step ``ms``; ``above_floor_ms``, ms minus
the floor's; ``above_floor_vs_torch``, that over torch varlen flash's; ``step_vs_torch``, ms over torch's; all
within a case. On the GPU only the 6-image case runs (34560 patches). ``--write`` writes
bench/results/transformers_vision_train.{json,md,png} (``..._train_smoke`` with --smoke).
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
import traceback
from pathlib import Path
from typing import Optional

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


def torch_varlen_problem(device, grad: bool = False) -> str:
    """'' when torch's varlen flash attention runs bf16 head dim 80 here (``grad``: forward and backward), else
    why not."""
    if device.type != "cuda":
        return "needs a CUDA device"
    q = torch.randn(8, 2, 80, device=device, dtype=torch.bfloat16, requires_grad=grad)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    try:
        out = torch_varlen_forward(None, *(q.transpose(0, 1)[None],) * 3, None, cu_seq_lens_q=cu, max_length_q=5)
        if grad:
            out[0].float().sum().backward()
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


def finish(args, rows, columns, name: str, device, dtype, warmup: int, iters: int, extra: dict, *, title: str,
           ylabel: Optional[str] = None) -> str:
    """The run's metadata, and with --write its results (``name``, ``name``_smoke under --smoke) and plot; the
    Markdown table either way."""
    meta = env_meta()
    meta.update(device=str(device), dtype=str(dtype).replace("torch.", ""), warmup=warmup, iters=iters,
                config="smoke" if args.smoke else "Qwen2.5-VL-7B vision tower (random weights)", **extra)
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    if not args.write:
        return markdown_table(rows, columns)
    name = f"{name}_smoke" if args.smoke else name
    table = write_results(name, rows, columns, meta=meta, title=title)
    plot(rows, RESULTS / f"{name}.png", **({"ylabel": ylabel} if ylabel else {}))
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny tower, fp32, runs on the CPU")
    parser.add_argument("--write", action="store_true",
                        help="write bench/results/transformers_vision.* (transformers_vision_train.* with --train)")
    parser.add_argument("--train", action="store_true",
                        help="time one training step (forward + backward) instead of a forward; gradients checked")
    parser.add_argument("--train-sdpa", action="store_true",
                        help="with --train on the GPU: also HF sdpa (about 10x slower; always in --smoke)")
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
    if args.train:
        return train_main(args, device, config, cases, dtype, warmup, iters, tolerance)

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
    table = finish(args, rows, columns, "transformers_vision", device, dtype, warmup, iters, {},
                   title="Hugging Face Qwen2.5-VL vision tower: attention implementations")
    print(table)
    return 1 if failed else 0


# -- --train: one training step (forward + backward) --------------------------------------------------

SDPA = "HF sdpa (loop over images/windows)"
TORCH = "torch varlen flash"
# The floor and torch first: the ratios of every later row come from the same run as theirs.
TRAIN_ORDER = [FLOOR, TORCH, "guardlint_flash (triton)", "guardlint_flash (auto)", SDPA]


def checked_params(tower) -> dict:
    """name -> the parameters whose gradients --train compares: the first and last blocks' qkv weights (the
    first block's gradient comes through every block's backward). Not the patch embedding: bf16 HF sdpa's own
    error there is already 0.04 against fp32 (7B config, 256-1408 patches, CPU), too near the tolerance."""
    last = len(tower.blocks) - 1
    return {"blocks.0.attn.qkv.weight": tower.blocks[0].attn.qkv.weight,
            f"blocks.{last}.attn.qkv.weight": tower.blocks[last].attn.qkv.weight}


def train_step(tower, pixels, grid) -> None:
    """One training step: gradients to None, forward with grad, a scalar loss of the output, backward."""
    tower.zero_grad(set_to_none=True)
    loss = tower(pixels, grid_thw=grid).pooler_output.float().square().mean()
    loss.backward()


def checkpointing(tower, on: bool) -> None:
    """Activation checkpointing of the tower's blocks (non-reentrant), on or off."""
    if not on:
        disable = getattr(tower, "activation_checkpointing_disable", None) or tower.gradient_checkpointing_disable
        disable()
        return
    enable = getattr(tower, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def reference_grads(tower, pixels, grid) -> dict:
    """The fp32 sdpa tower's gradients of ``checked_params``. Its blocks recompute their activations in the
    backward (only each block's input is kept: 34560 patches would not fit otherwise); the graph and the tower's
    own gradients are gone when this returns, only the copies compared stay."""
    tower.set_attn_implementation("sdpa")
    checkpointing(tower, True)
    try:
        train_step(tower, pixels, grid)
        return {name: p.grad.detach().float().clone() for name, p in checked_params(tower).items()}
    finally:
        checkpointing(tower, False)
        tower.zero_grad(set_to_none=True)


def grad_error(tower, reference: dict) -> float:
    """Relative max error of the tower's gradients against ``reference``: the worst over the tensors of
    max |g - g_ref| / max |g_ref|."""
    params = checked_params(tower)
    return max(((params[name].grad.float() - ref).abs().max() / ref.abs().max()).item()
               for name, ref in reference.items())


def train_main(args, device, config, cases, dtype, warmup, iters, tolerance) -> int:
    if device.type == "cpu":
        torch.set_num_threads(1)  # else OpenMP's threads and the autograd engine's contend: 10-100x noisy steps
    impls = register_all(device)
    if not impls[TORCH].startswith("skipped"):
        problem = torch_varlen_problem(device, grad=True)
        if problem:
            impls[TORCH] = "skipped: no backward here: " + problem
    if not (args.smoke or args.train_sdpa):
        impls[SDPA] = "skipped: about 10x slower than the others under --train; --train-sdpa adds it"
    if not args.smoke:
        cases = cases[:1]  # the 6-image case: a training step of the 7B tower on 34560 patches is heavy enough
    reference_tower = build_tower(config, torch.float32, device).train()
    tower = build_tower(config, dtype, device).train() if dtype != torch.float32 else reference_tower
    rows, failed = [], False
    for case, grids in cases:
        pixels, grid = inputs(config, grids, device)
        reference = reference_grads(reference_tower, pixels, grid)
        pixels = pixels.to(dtype)
        case_rows = []
        for label in TRAIN_ORDER:
            impl = impls[label]
            row = {"case": case, "tokens": int(grid.prod(-1).sum()), "implementation": label}
            case_rows.append(row)
            if impl.startswith("skipped"):
                row["note"] = impl
                continue
            tower.set_attn_implementation(impl)
            try:
                train_step(tower, pixels, grid)  # the gradients checked; also the first warm-up step
                if label == FLOOR:
                    row["note"] = "not attention: v passed through; the step without attention, gradients not checked"
                else:
                    error = grad_error(tower, reference)
                    row["grad_rel_max_err_vs_fp32"] = error
                    if not error <= tolerance:
                        row["note"] = f"WRONG: gradient relative error {error:.3g} > {tolerance:g}"
                        failed = True
                        continue
                row["ms"] = time_ms(lambda: train_step(tower, pixels, grid), device, warmup, iters)
            except Exception as exc:  # an implementation that fails (out of memory, no backward) is a row
                traceback.print_exc()
                first = (str(exc).splitlines() or [""])[0][:160]
                row["note"] = f"ERROR: {type(exc).__name__}: {first}"
                failed = True
                continue
            finally:
                tower.zero_grad(set_to_none=True)
            error = row.get("grad_rel_max_err_vs_fp32")
            print(f"{case} | {label}: {row['ms']:.2f} ms a step"
                  + (f", gradient rel err {error:.2e}" if error is not None else ""), file=sys.stderr, flush=True)
        derive_ratios(case_rows)
        rows += case_rows

    columns = ["case", "tokens", "implementation", "ms", "above_floor_ms", "above_floor_vs_torch", "step_vs_torch",
               "grad_rel_max_err_vs_fp32", "note"]
    extra = dict(step="train mode, grad enabled: loss = pooler_output.float().square().mean(), loss.backward(); "
                      "gradients set to None in each step; no optimizer step",
                 checked="gradients of " + ", ".join(reference) + " against the fp32 sdpa tower's "
                         "(relative max error, the worst of them)",
                 tolerance=tolerance)
    table = finish(args, rows, columns, "transformers_vision_train", device, dtype, warmup, iters, extra,
                   title="Qwen2.5-VL vision tower: one training step (forward + backward)",
                   ylabel="vision tower training step, ms (median)")
    print(table)
    return 1 if failed else 0


def derive_ratios(case_rows: list) -> None:
    """The columns against the floor and torch varlen flash, where those rows were timed in this case."""
    by_label = {r["implementation"]: r for r in case_rows if "ms" in r}
    floor, torch_row = by_label.get(FLOOR), by_label.get(TORCH)
    torch_above = torch_row["ms"] - floor["ms"] if floor and torch_row else None
    for row in by_label.values():
        if torch_row:
            row["step_vs_torch"] = row["ms"] / torch_row["ms"]
        if floor and row is not floor:
            row["above_floor_ms"] = row["ms"] - floor["ms"]
            if torch_above is not None and torch_above > 0:
                row["above_floor_vs_torch"] = row["above_floor_ms"] / torch_above


def plot(rows, path, ylabel: str = "vision tower forward, ms (median)") -> None:
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
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
