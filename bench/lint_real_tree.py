"""guardlint on the pinned engine trees against one process's read + ast.parse of every file, and on one file.

Paired whole-process runs, in turn guardlint / the ast loop / ruff (when it is installed in the venv; it
is no dependency), medians; one-file runs (a file without candidate text, files with one candidate
call); the findings of each tree with a reading of whether the engine's maintainers would call it real.
Goals: a tree in <= 0.35x the ast loop's time; one file <= 300 ms without a candidate, <= 600 ms with one.
Usage: .venv/bin/python bench/lint_real_tree.py [--repeat N] [--one-file-repeat N] [--write]
(the trees: python tests/engines/fetch.py sglang|vllm, unpacked under .engines/)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _util import cpu_name, env_meta, markdown_table  # noqa: E402

PY = ROOT / ".venv" / "bin" / "python"
GUARDLINT = ROOT / ".venv" / "bin" / "guardlint"
RUFF = ROOT / ".venv" / "bin" / "ruff"
ENGINES = ROOT / ".engines"
TREES = ("sglang-0.5.23", "vllm-0.33.0")
# The baseline: one process reading and parsing every .py/.pyi file of the tree.
AST_LOOP = """\
import ast, os, sys
for dirpath, dirnames, filenames in os.walk(sys.argv[1]):
    dirnames.sort()
    for name in sorted(filenames):
        if name.endswith((".py", ".pyi")):
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                data = f.read()
            try:
                ast.parse(data, filename=path)
            except (SyntaxError, ValueError):
                pass
"""
ONE_FILE = (
    ("no candidate", ROOT / "lint" / "findings.py"),
    ("one candidate call (fixture)", ROOT / "tests" / "fixtures" / "lint" / "crlf.py"),
    ("one candidate call (gemma4_vision.py)", ENGINES / "sglang-0.5.23" / "sglang" / "srt" / "models"
     / "gemma4_vision.py"),
)

# Each finding read at its call site in the pinned release: (path in the tree, line, code) -> reading.
READINGS = {
    ("sglang/multimodal_gen/runtime/layers/attention/backends/sol_attn.py", 189, "GL104"):
        "real: USPAttention.forward hands its impl (whichever AttentionImpl the run picks) the device offsets and "
        "their host copy; SolAttnImpl.forward_varlen deletes the copy and, with the SageAttention dense backend, "
        "_dense_sage calls cu_seqlens.tolist() in every layer. The other impls use the copy (not reported)",
    ("sglang/srt/layers/attention/vision.py", 743, "GL104"):
        "real: VisionFlashInferAttention.forward checks `(end_elems > total_elems_q).any()` on device "
        "tensors in every block, a host sync per layer (a bounds check that could run once per forward)",
    ("sglang/srt/layers/attention/vision.py", 1035, "GL104"):
        "real: VisionIntelXPUAttention.forward calls resolve_max_seqlen, which caches only on a "
        "SingletonCache (made by InternVL alone); every other model's raw cu_seqlens gets "
        "`int(seq_lens.max().item())` per block",
    ("sglang/srt/models/deepseek_janus_pro.py", 557, "GL109"):
        "real: VisionTransformerBlock calls VisionAttention with no cu_seqlens and no max_seqlen; the "
        "triton/fa3/fa4 backends then run resolve_precomputed_max_seqlen's `.item()` in every block "
        "(the engine's own docstring calls this a stream sync); max_seqlen = seq_len is free here",
    ("sglang/srt/layers/attention/vision.py", 403, "GL104"):
        "real under the sdpa backend: VisionSdpaAttention.forward, given no attention_mask, builds its mask "
        "cache key from `tuple(cu_seqlens.cpu().tolist())` (generate_patch_attention_mask) in every block; "
        "Qwen2.5-VL and others build cu_seqlens on the GPU before the block loop, so each layer copies it back",
    ("sglang/srt/models/mllama.py", 244, "GL109"):
        "real: MllamaVisionEncoderLayer calls self_attn without max_seqlen: per-layer `.item()` on the "
        "varlen backends",
    ("sglang/srt/models/mllama4.py", 212, "GL109"):
        "real: Llama4VisionEncoderLayer, same pattern (position_embeddings only)",
    ("sglang/srt/models/pixtral.py", 584, "GL109"):
        "real: PixtralHFTransformerBlock passes cu_seqlens=None and no max_seqlen: per-block `.item()` on "
        "the varlen backends",
    ("sglang/srt/models/qwen3_omni_moe.py", 142, "GL109"):
        "real: the audio encoder layer passes cu_seqlens but no max_seqlen, so each layer derives it "
        "with a host read",
    ("sglang/srt/models/siglip.py", 149, "GL109"):
        "real: SiglipEncoderLayer, attention_mask only: per-layer `.item()` on the varlen backends",
    ("sglang/srt/models/step3_vl.py", 591, "GL109"):
        "real: Step3VisionAttention.forward calls self.attn(hidden_states) alone, once per block",
    ("sglang/srt/models/step3_vl_10b.py", 248, "GL109"):
        "real: PerceptionEncoderVisionBlock, position_embeddings only: per-block `.item()` on the "
        "varlen backends",
    ("sglang/srt/models/gemma4_vision.py", 255, "GL101"):
        "real (the issue's case): Gemma4VisionAttention calls self.qkv_backend.forward directly with "
        "cu_seqlens=None; with --mm-attention-backend flashinfer_cudnn VisionFlashInferAttention raises "
        "'sequence_lengths should be prepared'",
    ("sglang/srt/models/gemma4_vision.py", 255, "GL102"):
        "real: the same call; the cuDNN backend's next check is 'max_seqlen should be prepared'",
    ("vllm/model_executor/models/funasr.py", 520, "GL101"):
        "real under the FlashInfer encoder backend (chosen globally for every MMEncoderAttention): "
        "vit_flashinfer_wrapper asserts sequence_lengths is not None; FunASR's audio attention passes "
        "cu_seqlens and max_seqlen only",
    ("vllm/model_executor/models/dots_ocr.py", 567, "GL104"):
        "real: DotsVisionTransformer.forward builds cu_seqlens from grid_thw_tensor, made on hidden_states.device "
        "(line 551), and compute_attn_mask_seqlen returns its device max under FLASH_ATTN/ROCM_AITER_FA/"
        "TRITON_ATTN; every block hands it to MMEncoderAttention, whose wrappers call .item(): one sync per "
        "block, which paddleocr_vl.py avoids by taking the max before the copy",
    ("vllm/model_executor/models/qwen3_omni_moe_thinker.py", 553, "GL104"):
        "real: the audio encoder puts cu_seqlens on the device (async_tensor_h2d(..., device=aftercnn_lens.device), "
        "line 545) and compute_attn_mask_seqlen returns its device max under the FA/Triton backends; every "
        "encoder layer's MMEncoderAttention reads it with .item()",
    ("vllm/model_executor/models/qwen3_omni_moe_thinker.py", 1038, "GL104"):
        "real: the vision tower moves cu_seqlens to the device (async_tensor_h2d, line 1017; the comment above the "
        "numpy copy says it avoids a GPU->CPU sync), but max_seqlen = compute_attn_mask_seqlen(cu_seqlens) is a "
        "device max under the FA/Triton backends, read with .item() by every block's MMEncoderAttention",
    ("vllm/model_executor/models/funaudiochat.py", 168, "GL104"):
        "real: FunAudioChatAudioAttention.forward computes max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max() "
        "in every layer on the device offsets the encoder builds from its padded mask (line 345) and hands it to "
        "MMEncoderAttention, whose FlashAttention and Triton wrappers call max_seqlen.item(): one sync per layer, "
        "the thing paddleocr_vl.py's comment (line 799) says it avoids by computing max_seqlen before the copy",
    ("vllm/model_executor/models/keye.py", 431, "GL104"):
        "real: KeyeSiglipAttention.forward takes the max of the device cu_seqlens (async_tensor_h2d, line 1287) in "
        "every layer (line 402) and MMEncoderAttention reads it with .item() on the FA/Triton paths",
    ("vllm/model_executor/models/openpangu_vl.py", 155, "GL104"):
        "real: the vision attention takes the max of cu_seqlens, which the tower moves .to(x.device) (line 563), "
        "in every block and MMEncoderAttention reads it with .item() on the FA/Triton paths",
    ("vllm/model_executor/models/siglip2navit.py", 263, "GL104"):
        "real: Siglip2Attention.forward takes the max of the device cu_seqlens (repeat_interleave of the device "
        "grid, line 520) in every layer; MMEncoderAttention reads it with .item() on the FA/Triton paths",
    ("vllm/model_executor/models/funaudiochat.py", 168, "GL101"):
        "real under the FlashInfer backend: the audio attention passes no sequence_lengths (bare assert)",
    ("vllm/model_executor/models/glm_ocr.py", 196, "GL101"):
        "real under the FlashInfer backend: GlmOcrVisionAttention passes no sequence_lengths, unlike "
        "qwen2.5-vl/qwen3-vl which compute it with maybe_compute_seq_lens",
    ("vllm/model_executor/models/openpangu_vl.py", 155, "GL101"):
        "real under the FlashInfer backend: no sequence_lengths (bare assert)",
    ("vllm/model_executor/models/qwen3_omni_moe_thinker.py", 261, "GL101"):
        "real under the FlashInfer backend: the audio attention passes none, while the vision tower of "
        "the same file (line 681) does",
    ("vllm/model_executor/models/dots_ocr.py", 298, "GL101"):
        "real under the FlashInfer backend: DotsVisionAttention passes cu_seqlens and max_seqlen only; "
        "its max_seqlen is computed for FLASH_ATTN/ROCM_AITER_FA/TRITON_ATTN alone, so the wrapper's "
        "asserts fail first (the model does not support that backend, and nothing says so)",
    ("vllm/model_executor/models/ernie45_vl.py", 223, "GL101"):
        "real under the FlashInfer backend: no sequence_lengths, max_seqlen only for the FA/Triton "
        "backends (bare asserts)",
    ("vllm/model_executor/models/glm4_1v.py", 369, "GL101"):
        "real under the FlashInfer backend, and a plain bug: prepare_encoder_metadata computes "
        "metadata['sequence_lengths'] (line 893) but the blocks never pass it to Glm4vVisionAttention",
    ("vllm/model_executor/models/isaac.py", 554, "GL101"):
        "real under the FlashInfer backend: no sequence_lengths (bare assert)",
    ("vllm/model_executor/models/keye.py", 431, "GL101"):
        "real under the FlashInfer backend: no sequence_lengths (bare assert)",
    ("vllm/model_executor/models/lfm2_siglip2.py", 231, "GL101"):
        "real under the FlashInfer backend: no sequence_lengths (bare assert)",
    ("vllm/model_executor/models/mimo_v2_omni.py", 316, "GL101"):
        "real under the FlashInfer backend: no sequence_lengths (bare assert)",
    ("vllm/model_executor/models/moonvit.py", 472, "GL101"):
        "real under the FlashInfer backend: MoonVitEncoderLayer passes cu_seqlens and max_seqlen only",
    ("vllm/model_executor/models/paddleocr_vl.py", 620, "GL101"):
        "real under the FlashInfer backend: no sequence_lengths, max_seqlen only for the FA/Triton "
        "backends (bare asserts)",
    ("vllm/model_executor/models/qwen2_vl.py", 380, "GL101"):
        "real under the FlashInfer backend: Qwen2VisionAttention passes no sequence_lengths and "
        "compute_attn_mask_seqlen gives max_seqlen=None for it, unlike qwen2.5-vl/qwen3-vl which "
        "prepare both",
    ("vllm/model_executor/models/siglip2navit.py", 263, "GL101"):
        "real under the FlashInfer backend: no sequence_lengths (bare assert)",
    ("vllm/models/glm5next/common/multimodal.py", 224, "GL101"):
        "real under the FlashInfer backend, as glm4_1v: metadata['sequence_lengths'] is computed (line "
        "544) and not passed to Glm5NextVisionAttention",
    ("vllm/models/muse_spark/common/vision.py", 264, "GL101"):
        "real under the FlashInfer backend: NaViTAttention passes cu_seqlens and max_seqlen only",
    ("vllm/models/deepseek_v4/common/vision.py", 147, "GL101"):
        "real under the FlashInfer backend: DeepseekV4VisionAttention passes cu_seqlens and max_seqlen "
        "only",
}


def _run(cmd: list, cwd: Path = ROOT) -> tuple[float, bytes]:
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start, out.stdout


def tools_for_tree(tree: str) -> dict:
    tools = {"guardlint": [str(GUARDLINT), "check", tree, "--exit-zero", "--format", "json"],
             # the same without the walk into code bound per layer at run time (lint/reach.py)
             "guardlint_no_bindings": [str(GUARDLINT), "check", tree, "--exit-zero", "--format", "json",
                                       "--no-follow-bindings"],
             "ast_loop": [str(PY), "-c", AST_LOOP, tree]}
    if RUFF.exists():
        tools["ruff"] = [str(RUFF), "check", "--isolated", "--no-cache", "--exit-zero", "--quiet", tree]
    return tools


def paired(tools: dict, repeat: int, cwd: Path) -> tuple[dict, bytes]:
    """``repeat`` rounds, each running every tool once, the order rotated a round; the times of each
    tool, and guardlint's last output."""
    times: dict[str, list[float]] = {name: [] for name in tools}
    names = list(tools)
    last = b""
    for i in range(repeat):
        for name in names[i % len(names):] + names[: i % len(names)]:
            t, out = _run(tools[name], cwd)
            times[name].append(t)
            if name == "guardlint":
                last = out
    return times, last


def measure_tree(tree: str, repeat: int) -> tuple[dict, list]:
    files = [p for p in (ENGINES / tree).rglob("*") if p.suffix in (".py", ".pyi") and p.is_file()]
    _run([str(PY), "-c", AST_LOOP, tree], ENGINES)  # page cache
    times, out = paired(tools_for_tree(tree), repeat, ENGINES)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ratios = [g / a for g, a in zip(times["guardlint"], times["ast_loop"])]
    row = {"tree": tree, "files": len(files), "MB": sum(p.stat().st_size for p in files) / 1e6,
           "guardlint_s": med["guardlint"], "ast_loop_s": med["ast_loop"],
           "ratio": med["guardlint"] / med["ast_loop"], "paired_ratio_median": statistics.median(ratios),
           "no_bindings_s": med.get("guardlint_no_bindings"),
           "no_bindings_ratio": med["guardlint_no_bindings"] / med["ast_loop"] if "guardlint_no_bindings" in med
           else None,
           "ruff_s": med.get("ruff"), "guardlint_runs": [round(t, 3) for t in times["guardlint"]],
           "ast_loop_runs": [round(t, 3) for t in times["ast_loop"]]}
    findings = json.loads(out or b"[]")
    return row, findings


def measure_one_file(label: str, path: Path, repeat: int) -> dict:
    tools = {"guardlint": [str(GUARDLINT), "check", str(path)]}
    if RUFF.exists():
        tools["ruff"] = [str(RUFF), "check", "--isolated", "--no-cache", "--quiet", str(path)]
    times, _ = paired(tools, repeat, ROOT)
    return {"case": label, "file": str(path.relative_to(ROOT)), "lines": path.read_bytes().count(b"\n"),
            "guardlint_ms": statistics.median(times["guardlint"]) * 1e3,
            "guardlint_min_ms": min(times["guardlint"]) * 1e3,
            "ruff_ms": statistics.median(times["ruff"]) * 1e3 if "ruff" in times else None}


# What changed in the findings since the previous committed reading, and why.
CHANGES = (
    "Changes from the reading of 2026-12-03 16:27 UTC: GL104 now follows code bound per layer at run time "
    "(lint/reach.py): the impl a layer builds through a typed factory or annotation (sglang's diffusion "
    "USPAttention.attn_impl, vLLM's CLIP attn_cls) reaches each subclass's method, and defs installed as a layer "
    "class's forward run in its place. sglang 0.5.23: 13 -> 14, `sol_attn.py:189`, real. Read and kept out by "
    "a fact: the other eight diffusion impls' forward_varlen read the offsets only when the layer passes no host "
    "copy, and USPAttention always passes one; vLLM's torch_sdpa_wrapper through CLIP's typed attn_cls (CLIP passes "
    "no offsets, and the wrapper returns before reading when none are given). vLLM 0.33.0 and sglang "
    "0.5.10.post1: unchanged. "
    "Before that, from the reading of 2026-12-03 (commit 0cdb2e0): GL104 now follows a module a layer holds "
    "(`self.attn = MMEncoderAttention(...)`, then `self.attn(...)`) into the method its CustomOp forward "
    "dispatches to, the engine modules it imports and `torch.ops.vllm.*` calls to the function registered as "
    "that op, layer loops over `self.blocks` into the block class, and what a helper returns "
    "(`max_seqlen = self.compute_attn_mask_seqlen(cu_seqlens)`). vLLM 0.33.0: 19 -> 26, the 7 new findings "
    "one pattern (a device max of the offsets handed to MMEncoderAttention, which calls .item() on it in every "
    "layer: 4 computed in the layer, dots_ocr and qwen3_omni_moe_thinker's two towers once before the loop), "
    "all real. Read and kept out by a "
    "fact, not a name: MMEncoderAttention's own SDPA path (.tolist() of the offsets it was given, inside vLLM's "
    "`with gpu_sync_allowed():`), the CPU platform's forward_cpu (host tensors), moonvit/kimi_k25_vit (the "
    "maximum is computed only when the caller passes none, and the caller passes one), radio (offsets from "
    "its caller's metadata), paddleocr_vl (the maximum is taken before the copy to the device, as its "
    "comment says). sglang 0.5.23 and 0.5.10.post1: unchanged. "
    "Before that, from the reading of 2026-12-02 16:46 UTC: sglang-0.5.23 `midashenglm.py:189` GL109 is no longer "
    "reported: DashengAttention builds its VisionAttention with the constant `qkv_backend=\"sdpa\"`, whose "
    "forward does no host read when handed a padding mask (sglang's `--mm-attention-backend` can override that "
    "constant at run time, and under a varlen backend the per-block `.item()` would be real; the linter judges "
    "the backend the code names). `vision.py:403` GL104 is new: a read written on a host copy "
    "(`cu_seqlens.cpu().tolist()`) is now followed into the callee that does it. vLLM 0.33.0: the same 19 "
    "findings; 4 now carry an unsafe fix (built at the tower's loop owner with vLLM's own helpers and passed down) "
    "and the other 15 say why there is none, where each said 'nothing at the call can build it' before. "
    "A device-to-host copy as a sync, vLLM's forward_oot and tables of functions (the untuned-tree reading's "
    "linter change) add no finding on these two trees (sglang 0.5.10.post1: 6 -> 8, both real)."
)


def findings_markdown(tree: str, findings: list) -> str:
    lines = [f"### {tree}: {len(findings)} finding{'s' if len(findings) != 1 else ''}", ""]
    for f in findings:
        rel = f["path"].split("/", 1)[1]
        reading = READINGS.get((rel, f["line"], f["code"]), "NOT READ YET")
        lines.append(f"- `{rel}:{f['line']}:{f['column']}` {f['code']} {f['message']}  \n  Reading: {reading}")
    return "\n".join(lines) + "\n"


def time_extra(args) -> None:
    """The speed table of trees outside .engines (the untuned readings' trees)."""
    rows = []
    for tree in args.extra:
        path = Path(tree).resolve()
        row, findings = measure_tree(str(path), args.repeat)
        row.update(tree=path.name, findings=len(findings))
        rows.append(row)
        print(f"{path.name}: guardlint {row['guardlint_s']:.2f} s, ast loop {row['ast_loop_s']:.2f} s "
              f"({row['ratio']:.2f}x)", flush=True)
    cols = ["tree", "files", "MB", "findings", "guardlint_s", "ast_loop_s", "ratio", "paired_ratio_median",
            "no_bindings_s", "no_bindings_ratio", "ruff_s"]
    table = markdown_table(rows, cols)
    if args.write:
        meta = env_meta()
        meta.update(cpu=cpu_name(), cpus=os.cpu_count(),
                    load_average=" / ".join(f"{x:.1f}" for x in os.getloadavg()),
                    repeat=f"median of {args.repeat} paired rounds", goal="tree <= 0.35x the ast loop")
        out = HERE / "results"
        (out / "lint_untuned_speed.json").write_text(json.dumps({"meta": meta, "trees": rows}, indent=2) + "\n")
        (out / "lint_untuned_speed.md").write_text(
            "# guardlint on trees it was not tuned on: speed\n\n" + ", ".join(f"{k}: {v}" for k, v in meta.items())
            + "\n\n" + table + "\n\nAs `lint_real_tree.md` times the pinned engines (guardlint against one process "
            "reading and `ast.parse`-ing every file, paired rounds); the findings are read in "
            "`lint_untuned_trees.md`, `lint_untuned_trees_2.md` and `lint_untuned_trees_3.md`. Command: "
            "`.venv/bin/python bench/lint_real_tree.py "
            "--extra TREE... --write`.\n")
    print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="paired rounds per tree")
    ap.add_argument("--one-file-repeat", type=int, default=15, help="paired rounds per one-file case")
    ap.add_argument("--write", action="store_true", help="write bench/results/lint_real_tree.{json,md}")
    ap.add_argument("--extra", nargs="+", metavar="TREE",
                    help="time these trees instead (unpacked wheels or sdists; no findings read), the same way; "
                         "with --write, to bench/results/lint_untuned_speed.{json,md}")
    args = ap.parse_args()
    if args.extra:
        return time_extra(args)

    trees = [t for t in TREES if (ENGINES / t).is_dir()]
    missing = sorted(set(TREES) - set(trees))
    rows, found = [], {}
    for tree in trees:
        row, findings = measure_tree(tree, args.repeat)
        rows.append(row)
        found[tree] = findings
        print(f"{tree}: guardlint {row['guardlint_s']:.2f} s, ast loop {row['ast_loop_s']:.2f} s "
              f"({row['ratio']:.2f}x), ruff {row['ruff_s'] or float('nan'):.2f} s", flush=True)
    one = [measure_one_file(label, path, args.one_file_repeat) for label, path in ONE_FILE if path.exists()]

    tree_cols = ["tree", "files", "MB", "guardlint_s", "ast_loop_s", "ratio", "paired_ratio_median", "no_bindings_s",
                 "no_bindings_ratio", "ruff_s"]
    one_cols = ["case", "file", "lines", "guardlint_ms", "guardlint_min_ms", "ruff_ms"]
    unread = [(t, f["path"], f["line"], f["code"]) for t, fs in found.items() for f in fs
              if (f["path"].split("/", 1)[1], f["line"], f["code"]) not in READINGS]
    tables = markdown_table(rows, tree_cols) + "\n\n" + markdown_table(one, one_cols)
    if unread:
        print("findings without a reading:", *unread, sep="\n  ")
    if args.write:
        meta = env_meta()
        meta.update(cpu=cpu_name(), cpus=os.cpu_count(),
                    load_average=" / ".join(f"{x:.1f}" for x in os.getloadavg()),
                    repeat=f"median of {args.repeat} paired rounds (trees), {args.one_file_repeat} (one file)",
                    ruff=subprocess.run([str(RUFF), "--version"], capture_output=True, text=True).stdout.strip()
                    if RUFF.exists() else None,
                    goals="tree <= 0.35x the ast loop; one file <= 300 ms (no candidate), <= 600 ms (one)")
        out = HERE / "results"
        out.mkdir(exist_ok=True)
        read = {t: [{**f, "reading": READINGS.get((f["path"].split("/", 1)[1], f["line"], f["code"]))}
                    for f in fs] for t, fs in found.items()}
        (out / "lint_real_tree.json").write_text(json.dumps(
            {"meta": meta, "trees": rows, "one_file": one, "findings": read}, indent=2) + "\n")
        md = out / "lint_real_tree.md"
        body = ["# guardlint on the pinned engine trees and on one file",
                ", ".join(f"{k}: {v}" for k, v in meta.items()), tables,
                "`guardlint_s` is `guardlint check TREE --exit-zero --format json` (start-up, discovery, "
                "every file's textual pre-filter, CPython's parse and the tree pre-filter of the candidates, "
                "libcst for the rest), `ast_loop_s` one process reading and `ast.parse`-ing every .py/.pyi "
                "file, `ruff_s` `ruff check --isolated --no-cache` (its default rules, all its threads) as a "
                "reference. Rounds alternate the tools with the order rotated; `paired_ratio_median` is the "
                "median of each round's own ratio. One-file rows: `guardlint check FILE` with start-up. "
                "Command: `.venv/bin/python bench/lint_real_tree.py --write`."
                + (f" Trees not unpacked here: {', '.join(missing)}." if missing else ""),
                "## Findings, each read at its call site in the pinned release", CHANGES,
                *(findings_markdown(t, fs) for t, fs in found.items())]
        md.write_text("\n\n".join(body).rstrip() + "\n")
    print(tables)


if __name__ == "__main__":
    main()
