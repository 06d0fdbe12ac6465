"""Linter speed: files/s over a tree against reading + ``ast.parse`` of every file, in the same run.

Without PATH, lints a generated tree of >= 1000 realistic files (~4% call a contract target); also
times name resolution alternatives and ``guardlint --version``. Writes bench/results/lint_speed.*.
With ``--tree PATH`` (repeatable; unpacked sdists, say), times each tree with and without the tree
pre-filter instead and writes bench/results/lint_tree_prefilter.*.
Usage: .venv/bin/python bench/lint_speed.py [PATH] [--files N] [--repeat R] [--tree PATH ...]
"""
from __future__ import annotations

from _util import require

require("guardlint", "libcst")  # a clear message outside the venv

import argparse
import ast
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# -- a realistic tree -------------------------------------------------------------------------------
_WORDS = ("hidden", "proj", "embed", "norm", "scale", "patch", "token", "image", "video", "frame", "query",
          "key", "value", "weight", "bias", "cache", "batch", "layer", "block", "head", "window", "pos",
          "rotary", "merge", "vision", "text", "audio", "adapter", "expert", "router", "gate", "mlp")


def _ident(rng: random.Random, parts: int = 2) -> str:
    return "_".join(rng.choice(_WORDS) for _ in range(parts))


def _camel(rng: random.Random, suffix: str = "") -> str:
    return "".join(w.capitalize() for w in (rng.choice(_WORDS), rng.choice(_WORDS))) + suffix


def _header(rng, varlen: bool) -> str:
    lines = ['"""' + " ".join(rng.choice(_WORDS) for _ in range(8)).capitalize() + ".",
             "", "Implements the " + _ident(rng) + " path used by the " + _ident(rng) + " model.", '"""',
             "from __future__ import annotations", "", "import math", "import logging", "import os",
             "from dataclasses import dataclass, field", "from typing import Optional, Tuple, List, Dict", "",
             "import torch", "import torch.nn as nn", "import torch.nn.functional as F", ""]
    if varlen:
        lines += ["from .attention_utils import apply_rotary, build_cu_seqlens", ""]
    lines += ["logger = logging.getLogger(__name__)", "", ""]
    return "\n".join(lines)


def _config(rng) -> str:
    name = _camel(rng, "Config")
    fields = "\n".join(f"    {_ident(rng)}_{i}: {rng.choice(['int', 'float', 'bool', 'str'])} = "
                       f"{rng.choice(['0', '1.0', 'False', repr('gelu'), '1024', '16'])}"
                       for i in range(rng.randint(4, 12)))
    return f'''@dataclass
class {name}:
    """Configuration of the {_ident(rng)} module."""

{fields}
    extra: Dict[str, float] = field(default_factory=dict)

    def validate(self) -> None:
        if self.extra and any(v < 0 for v in self.extra.values()):
            raise ValueError(f"negative entries in {{self.extra!r}}")


'''


def _mlp(rng) -> str:
    name = _camel(rng, "MLP")
    act = rng.choice(["F.gelu", "F.silu", "torch.relu"])
    return f'''class {name}(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.dropout = nn.Dropout(p=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # {" ".join(rng.choice(_WORDS) for _ in range(6))}
        x = {act}(self.fc1(x))
        x = self.dropout(x)
        return self.fc2(x)


'''


def _attention(rng, varlen: bool) -> str:
    name = _camel(rng, rng.choice(["Attention", "SelfAttention", "Attn"]))
    body = ("        out = self.kernel(q, k, v, cu_seqlens, max_seqlen)\n" if varlen else
            "        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)\n")
    if varlen and rng.random() < 0.25:  # the per-layer host read GL104 is about
        body = "        max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()\n" + body
    sig = "cu_seqlens: torch.Tensor, max_seqlen: int" if varlen else "mask: Optional[torch.Tensor] = None"
    return f'''class {name}(nn.Module):
    """Multi-head attention over packed tokens (total_tokens, num_heads, head_dim)."""

    def __init__(self, dim: int, num_heads: int, kernel=None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.kernel = kernel
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def forward(self, x: torch.Tensor, {sig}) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        q = q * self.scale
{body}        return self.proj(out.reshape(t, -1))


'''


def _block(rng, attn: str, varlen: bool) -> str:
    name = _camel(rng, "Block")
    extra = ", cu_seqlens, max_seqlen" if varlen else ""
    return f'''class {name}(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = {attn}(dim, num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x{extra}):
        x = x + self.attn(self.norm1(x){extra})
        x = x + self.mlp(self.norm2(x))
        return x


'''


def _model(rng, block: str, varlen: bool) -> str:
    name = _camel(rng, "Transformer")
    # Once per model forward, before the block loop: the right place for a host read.
    pre = ("        lengths = [h * w for h, w in grid_thw]\n"
           "        cu_seqlens = build_cu_seqlens(lengths, device=x.device)\n"
           "        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())\n") if varlen else ""
    extra = ", cu_seqlens, max_seqlen" if varlen else ""
    return f'''class {name}(nn.Module):
    def __init__(self, depth: int = 12, dim: int = 768, num_heads: int = 12) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=14, stride=14)
        self.blocks = nn.ModuleList([{block}(dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, grid_thw: List[Tuple[int, int]]) -> torch.Tensor:
{pre}        x = self.patch_embed(x).flatten(2).transpose(1, 2).reshape(-1, x.shape[1])
        for blk in self.blocks:
            x = blk(x{extra})
        return self.norm(x)

    @torch.no_grad()
    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)


'''


def _utility(rng) -> str:
    fn = _ident(rng)
    return f'''def {fn}(items: List[str], limit: int = {rng.randint(2, 64)}) -> Dict[str, int]:
    """Count the {rng.choice(_WORDS)} entries, keeping the {rng.choice(_WORDS)} ones."""
    counts: Dict[str, int] = {{}}
    for item in items[:limit]:
        key = item.strip().lower()
        if not key or key.startswith("#"):
            continue
        counts[key] = counts.get(key, 0) + 1
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    logger.debug("%d distinct keys, top: %s", len(ordered), ordered[:3])
    return {{k: v for k, v in ordered if v > 0}}


def {fn}_shapes(tensors: List[torch.Tensor]) -> str:
    parts = []
    for i, t in enumerate(tensors):
        parts.append(f"{{i}}: {{tuple(t.shape)}} {{t.dtype}}")
    return ", ".join(parts) if parts else "<empty>"


'''


def _loader(rng) -> str:
    name = _camel(rng, "Dataset")
    return f'''class {name}(torch.utils.data.Dataset):
    def __init__(self, root: str, split: str = "train", transform=None) -> None:
        self.root = root
        self.split = split
        self.transform = transform
        self.samples = self._scan()

    def _scan(self) -> List[Tuple[str, int]]:
        out = []
        for label, sub in enumerate(sorted(os.listdir(self.root))):
            for name in sorted(os.listdir(os.path.join(self.root, sub))):
                if name.endswith((".jpg", ".png")):
                    out.append((os.path.join(self.root, sub, name), label))
        return out

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with open(path, "rb") as f:
            data = f.read()
        try:
            image = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        except (ValueError, RuntimeError) as e:
            raise RuntimeError(f"cannot read {{path}}: {{e}}") from e
        return (self.transform(image) if self.transform else image), label


def collate_{_ident(rng, 1)}(batch):
    images, labels = zip(*batch)
    return torch.stack(images), torch.tensor(labels, dtype=torch.long)


'''


_TARGET_SNIPPETS = (
    '''class FlashVisionBlock(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.attn = VisionFlashInferAttention()

    def forward(self, q, k, v, cu_seqlens, bsz, seq_len, forward_metadata=None):
        return self.attn(q, k, v, cu_seqlens, bsz, seq_len, forward_metadata=forward_metadata)

    def forward_unprepared(self, q, k, v, cu_seqlens, bsz, seq_len):
        return self.attn(q, k, v, cu_seqlens, bsz, seq_len)


''',
    '''def build_lora_batch(bs, seg_indptr, weight_indices, ranks, scalings):
    info = LoRABatchInfo(use_cuda_graph=False, bs=bs, num_segments=bs, seg_indptr=seg_indptr,
                         weight_indices=weight_indices, lora_ranks=ranks, scalings=scalings,
                         max_len=None, seg_lens=None, permutation=None)
    return info


def build_lora_batch_ok(bs, seg_indptr, weight_indices, ranks, scalings):
    return LoRABatchInfo(use_cuda_graph=False, bs=bs, num_segments=bs, seg_indptr=seg_indptr,
                         weight_indices=weight_indices, lora_ranks=ranks, scalings=scalings,
                         seg_lens=seg_indptr[1:] - seg_indptr[:-1], max_len=None, permutation=None)


''',
)


def make_file(rng: random.Random, with_target: bool, varlen: bool) -> str:
    parts = [_header(rng, varlen)]
    if with_target:
        parts.append("from sglang.srt.layers.attention.vision import VisionFlashInferAttention\n"
                     "from sglang.srt.lora.utils import LoRABatchInfo\n\n\n")
    kind = rng.random()
    target_lines = rng.randint(100, 400)
    makers = ([_config, _mlp, lambda r: _attention(r, varlen)] if kind < 0.6 else [_utility, _loader, _config])
    while sum(p.count("\n") for p in parts) < target_lines - 40:
        maker = rng.choice(makers)
        parts.append(maker(rng))
    if kind < 0.6:
        parts.append(_attention(rng, varlen))
        parts.append(_block(rng, "nn.Identity", varlen))
        parts.append(_model(rng, "nn.Identity", varlen))
    if with_target:
        parts.append(rng.choice(_TARGET_SNIPPETS))
    return "".join(parts)


def generate_tree(root: Path, n_files: int = 1200, seed: int = 0, target_share: float = 0.04,
                  varlen_share: float = 0.08) -> Path:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text("[project]\nname = \"bench-tree\"\n")
    pkgs = [root / "models" / f"family_{i}" for i in range(12)] + [root / "utils", root / "data", root / "tests"]
    for p in pkgs:
        p.mkdir(parents=True, exist_ok=True)
        (p / "__init__.py").write_text("")
    (root / "models" / "__init__.py").write_text("")
    for i in range(n_files):
        folder = pkgs[i % len(pkgs)]
        r = rng.random()
        with_target = r < target_share
        varlen = with_target or r < target_share + varlen_share
        (folder / f"{_ident(rng)}_{i}.py").write_text(make_file(rng, with_target, varlen))
    return root


# -- measurements ---------------------------------------------------------------------------------------
def files_of(root: Path) -> list[str]:
    from guardlint.lint.config import Settings
    from guardlint.lint.runner import discover

    return discover([str(root)], Settings(root=root))


def time_ast(files: list[str]) -> float:
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            ast.parse(fh.read(), filename=f)
    return time.perf_counter() - t0


def time_lint(root: Path, jobs=None):
    from guardlint.lint.config import Settings
    from guardlint.lint.runner import lint_paths

    t0 = time.perf_counter()
    report = lint_paths([str(root)], Settings(root=root), jobs=jobs)
    return time.perf_counter() - t0, report


def time_cli(root: Path) -> float:
    exe = Path(sys.executable).with_name("guardlint")
    t0 = time.perf_counter()
    subprocess.run([str(exe), str(root), "--exit-zero", "--format", "json"], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def time_lint_prefilter(root: Path, on: bool):
    from guardlint.lint import runner

    saved = runner.AST_PREFILTER
    runner.AST_PREFILTER = on
    try:
        return time_lint(root)
    finally:
        runner.AST_PREFILTER = saved


def measure_tree(root: Path, repeat: int) -> dict:
    """One real tree: read + ast.parse, the CLI, and in-process runs with and without the tree
    pre-filter (best of ``repeat`` each); the findings of both must be the same."""
    files = files_of(root)
    size = sum(os.path.getsize(f) for f in files)
    lines = sum(Path(f).read_bytes().count(b"\n") for f in files)
    time_ast(files)  # page cache
    t_ast = min(time_ast(files) for _ in range(repeat))
    t_cli = min(time_cli(root) for _ in range(repeat))
    runs = {}
    for on in (True, False):
        timed = [time_lint_prefilter(root, on) for _ in range(repeat)]
        runs[on] = min(timed, key=lambda r: r[0])
    keys = [sorted((f.path, f.line, f.column, f.code, f.message) for f in runs[on][1].findings)
            for on in (True, False)]
    if keys[0] != keys[1]:
        raise SystemExit(f"{root}: the tree pre-filter changed the findings")
    after, before = runs[True], runs[False]
    codes: dict[str, int] = {}
    for f in after[1].findings:
        codes[f.code] = codes.get(f.code, 0) + 1
    return {"tree": root.name, "files": len(files), "MB": size / 1e6, "lines": lines, "ast_s": t_ast,
            "cli_s": t_cli, "cli_ratio": t_cli / t_ast,
            "lint_s": after[0], "lint_ratio": after[0] / t_ast,
            "lint_s_text_filter_only": before[0], "ratio_text_filter_only": before[0] / t_ast,
            "past_text_filter": after[1].parsed, "to_libcst": after[1].checked,
            "findings": ", ".join(f"{k}: {v}" for k, v in sorted(codes.items())) or "none"}


def main_trees(trees: list[str], repeat: int) -> None:
    from _util import env_meta, write_results

    rows = [measure_tree(Path(t), repeat) for t in trees]
    meta = env_meta()
    meta.update(cpus=os.cpu_count(), repeat=f"best of {repeat}",
                load_average=" / ".join(f"{x:.1f}" for x in os.getloadavg()),
                sources="pip download --no-deps --no-binary :all: sglang==0.5.10.post1 transformers==5.24.0, "
                        "unpacked under /tmp (not committed)",
                goal="whole-tree lint <= 1.5x one process's read + ast.parse of every file")
    columns = ["tree", "files", "MB", "lines", "ast_s", "cli_s", "cli_ratio", "lint_s", "lint_ratio",
               "lint_s_text_filter_only", "ratio_text_filter_only", "past_text_filter", "to_libcst",
               "findings"]
    table = write_results("lint_tree_prefilter", rows, columns, meta=meta,
                          title="guardlint on public source trees: with and without the tree pre-filter")
    print(table)


def time_resolution_alternatives(files: list[str], repeat: int = 3) -> dict:
    """On the files the pre-filter lets through: ast.parse, libcst parse, our import table and checks
    after the parse, and libcst's QualifiedNameProvider after the parse (best of ``repeat``; the
    provider, at ~30 s, once)."""
    import libcst as cst
    from libcst.metadata import MetadataWrapper, QualifiedNameProvider

    from guardlint.lint.engine import Checker, Collector
    from guardlint.lint.rules import build_rules
    from guardlint.lint.walk import Walker

    rules = build_rules()
    datas = []
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        if rules.may_match(data):
            datas.append(data)

    def best(fn, n=repeat):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    def ours():
        for m in modules:
            c = Collector()
            Walker([c]).walk(m)
            Checker(rules, c).run()

    def qnp():
        for m in modules:
            MetadataWrapper(m, unsafe_skip_copy=True).resolve(QualifiedNameProvider)

    t_ast = best(lambda: [ast.parse(d) for d in datas])
    t_parse = best(lambda: [cst.parse_module(d) for d in datas])
    modules = [cst.parse_module(d) for d in datas]
    return {"files": len(datas), "ast": t_ast, "parse": t_parse, "ours": best(ours), "qnp": best(qnp, 1)}


def time_version(n: int = 11) -> float:
    exe = Path(sys.executable).with_name("guardlint")
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([str(exe), "--version"], stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true",
                    help="update the committed files in bench/results/ (default: print only)")
    ap.add_argument("path", nargs="?", help="tree to lint (default: a generated one)")
    ap.add_argument("--files", type=int, default=1200, help="files in the generated tree")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (the best is kept)")
    ap.add_argument("--tree", action="append", default=[], metavar="PATH",
                    help="a real tree to time with and without the tree pre-filter (repeatable)")
    args = ap.parse_args()
    if args.tree:
        main_trees(args.tree, args.repeat)
        return

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.path) if args.path else generate_tree(Path(tmp) / "tree", args.files)
        files = files_of(root)
        n = len(files)
        lines = sum(Path(f).read_bytes().count(b"\n") for f in files)
        # Warm the page cache and the imports before timing anything.
        time_ast(files)
        time_lint(root, jobs=1)
        t_ast = min(time_ast(files) for _ in range(args.repeat))
        runs = [time_lint(root) for _ in range(args.repeat)]
        t_lint, report = min(runs, key=lambda r: r[0])
        t_serial = min(time_lint(root, jobs=1)[0] for _ in range(args.repeat))
        t_cli = min(time_cli(root) for _ in range(args.repeat))
        alt = time_resolution_alternatives(files, args.repeat)
        t_version = time_version()

    from _util import env_meta, write_results

    rows = [
        {"measure": "read + ast.parse, every file (baseline)", "seconds": t_ast, "files_per_s": n / t_ast,
         "ratio_to_ast": 1.0},
        {"measure": f"guardlint, in process, {report.parsed} of {n} files past the textual filter, "
                    f"{report.checked} to libcst", "seconds": t_lint,
         "files_per_s": n / t_lint, "ratio_to_ast": t_lint / t_ast},
        {"measure": "guardlint, in process, one process", "seconds": t_serial, "files_per_s": n / t_serial,
         "ratio_to_ast": t_serial / t_ast},
        {"measure": "guardlint CLI (subprocess, with start-up)", "seconds": t_cli, "files_per_s": n / t_cli,
         "ratio_to_ast": t_cli / t_ast},
        {"measure": f"pre-filtered files ({alt['files']}): ast.parse", "seconds": alt["ast"],
         "ratio_to_ast": alt["ast"] / t_ast},
        {"measure": f"pre-filtered files ({alt['files']}): libcst parse", "seconds": alt["parse"],
         "ratio_to_ast": alt["parse"] / t_ast},
        {"measure": "pre-filtered files: import table + checks (ours, after parse)", "seconds": alt["ours"],
         "ratio_to_ast": alt["ours"] / t_ast},
        {"measure": "pre-filtered files: QualifiedNameProvider (after parse)", "seconds": alt["qnp"],
         "ratio_to_ast": alt["qnp"] / t_ast},
        {"measure": "guardlint --version (median of 11)", "seconds": t_version},
    ]
    meta = env_meta()
    meta.update(files=n, lines=lines, findings=len(report.findings), cpus=os.cpu_count(),
                tree=str(args.path) if args.path else f"generated, {args.files} files",
                goals="--version <= 0.15 s; whole-tree lint <= 1.5x read + ast.parse")
    table = write_results("lint_speed", rows, ["measure", "seconds", "files_per_s", "ratio_to_ast"],
                          meta=meta, title="guardlint lint speed")
    print(f"{n} files, {lines} lines; {len(report.findings)} findings; "
          f"QualifiedNameProvider costs {alt['qnp'] / alt['parse']:.1f}x the libcst parse, "
          f"our import table {alt['ours'] / alt['parse']:.2f}x")
    print(table)


if __name__ == "__main__":
    main()
