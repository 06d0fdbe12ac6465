"""``guardlint --fix``: fixes derived from each contract, their layout, imports, safety, and the files
they write (encoding, BOM, line breaks, mode bits, symlinks, atomic replacement, never a broken file)."""
from __future__ import annotations

import ast
import json
import os
import shutil
import stat
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint.contracts import all_contracts, contract_from_config
from guardlint.lint import build_rules, check_source, fixed_source, lint_source
from guardlint.lint import engine
from guardlint.lint.cli import main
from guardlint.lint.config import Settings
from guardlint.lint.findings import Edit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lint"
CUDNN = "from guardlint.kernels import cudnn_vision_attention\n"
LORA = "from sglang.srt.lora.utils import LoRABatchInfo\n"
IMPORT = "from guardlint.guard import prepare_varlen_metadata\n"
PREPARED = 'forward_metadata=prepare_varlen_metadata(cu, q, layout="cudnn")'


def fix(src: str, **kw) -> str:
    kw.setdefault("unsafe_fixes", True)
    return fixed_source(textwrap.dedent(src), **kw)


def findings(src: str, rules=None):
    return check_source(textwrap.dedent(src).encode(), "snippet.py", rules or build_rules()).findings


def invoke(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


# -- the catalog's own examples --------------------------------------------------------------------------
PAIRS = [pytest.param(c, c.examples[i - 1], e, id=f"{c.code}-{i}")
         for c in all_contracts() for i, e in enumerate(c.examples) if e.kind == "fixed"]
BAD = [pytest.param(c, e, id=f"{c.code}-{i}") for c in all_contracts() for i, e in enumerate(c.examples)
       if e.kind == "bad"]


def test_every_fixable_contract_shows_its_fix():
    fixable = {c.code for c in all_contracts() if c.linted and c.fix_safety != "none" and c.examples}
    assert fixable and fixable == {p.values[0].code for p in PAIRS}


@pytest.mark.parametrize("contract, bad, fixed", PAIRS)
def test_catalog_fixed_example_is_exactly_the_fix_of_the_bad_one(contract, bad, fixed):
    assert fixed_source(bad.without_markers(), unsafe_fixes=True) == fixed.code
    # The fix is unsafe, so plain --fix leaves the example alone.
    assert fixed_source(bad.without_markers()) == bad.without_markers()


@pytest.mark.parametrize("contract, bad", BAD)
def test_every_bad_example_after_fixing(contract, bad):
    """Fixed where the contract has a fix (its code is gone, the file parses, a second fix changes
    nothing); untouched where it has none."""
    src = bad.without_markers()
    out = fixed_source(src, unsafe_fixes=True)
    ast.parse(out)
    assert fixed_source(out, unsafe_fixes=True) == out
    left = {f.code for f in check_source(out.encode(), "x.py", build_rules()).findings}
    if contract.fix_safety == "none":
        assert out == src and contract.code in left
    else:
        assert out != src and contract.code not in left


# -- GL101 / GL102 -------------------------------------------------------------------------------------
def test_gl101_and_gl102_of_one_call_give_one_keyword_and_one_import():
    out = fix(f"import torch\n{CUDNN}\nout = cudnn_vision_attention(q, k, v, cu, 1, 8)\n")
    assert out == f"import torch\n{IMPORT}{CUDNN}\nout = cudnn_vision_attention(q, k, v, cu, 1, 8, {PREPARED})\n"
    assert out.count("forward_metadata=") == 1


def test_the_import_is_added_once_for_many_calls_and_not_when_present():
    src = f"{CUDNN}a = cudnn_vision_attention(q, k, v, cu, 1, 8)\nb = cudnn_vision_attention(q, k, v, cu, 1, 8)\n"
    assert fix(src).count(IMPORT) == 1
    present = IMPORT + src
    assert fix(present).count("import prepare_varlen_metadata") == 1
    inside = f"def f(q, k, v, cu):\n    {IMPORT}    return cudnn_vision_attention(q, k, v, cu, 1, 8)\n"
    assert fix(CUDNN + inside).count("import prepare_varlen_metadata") == 1


def test_the_import_sorts_among_its_packages_imports_else_goes_after_the_last_import_or_the_docstring():
    # guardlint.guard sorts before guardlint.kernels: where an import sorter would put it.
    src = f'"""Doc."""\n\nimport os\n{CUDNN}\n\ndef f():\n    import json\n    return cudnn_vision_attention(q, k, v, cu, 1, 8)\n'
    lines = fix(src).splitlines()
    assert lines[3:5] == [IMPORT.strip(), CUDNN.strip()]
    # After the last of them when it sorts last.
    src = f"import os\nfrom guardlint.contracts import get\n{CUDNN}import sys\n\nout = cudnn_vision_attention(q, k, v, cu, 1, 8)\n"
    assert fix(src).splitlines()[1:5] == ["from guardlint.contracts import get", IMPORT.strip(), CUDNN.strip(), "import sys"]
    # No import of its package: after the last top-level import.
    src = "import os\nimport guardlint.kernels as gk\n\nout = gk.cudnn_vision_attention(q, k, v, cu, 1, 8)\n"
    assert fix(src).splitlines()[2] == IMPORT.strip()
    # No import at all before the call (the target imported under a try): after the docstring.
    src = '"""Doc."""\ntry:\n    ' + CUDNN + 'except ImportError:\n    pass\nx = cudnn_vision_attention(q, k, v, cu, 1, 8)\n'
    assert fix(src).splitlines()[1] == IMPORT.strip()


def test_a_module_level_call_before_the_last_import_gets_the_import_before_it():
    src = f"{CUDNN}out = cudnn_vision_attention(q, k, v, cu, 1, 8)\nimport os\n"
    out = fix(src)
    assert out.index(IMPORT) < out.index("out = ")
    exec_free = ast.parse(out)  # noqa: F841 - it parses


def test_no_fix_when_the_helper_name_means_something_else():
    src = f"{CUDNN}def prepare_varlen_metadata(x):\n    return x\n\nout = cudnn_vision_attention(q, k, v, cu, 1, 8)\n"
    assert fix(src) == textwrap.dedent(src)
    (f101, _) = findings(src)
    assert f101.fix is None and "; no fix: prepare_varlen_metadata already names something else" in f101.message


@pytest.mark.parametrize("args, expected", [
    ("q, k, v, cu, 1, 8, None, None", 'q, k, v, cu, 1, 8, None, prepare_varlen_metadata(cu, q, layout="cudnn")'),
    ("q, k, v, cu, 1, 8, forward_metadata=None", f"q, k, v, cu, 1, 8, {PREPARED}"),
    ("q, k, v, cu, 1, 8, sequence_lengths=None, max_seqlen=None",
     f"q, k, v, cu, 1, 8, sequence_lengths=None, max_seqlen=None, {PREPARED}"),
    ("q, k, v, cu, 1, 8, sequence_lengths=lens", f"q, k, v, cu, 1, 8, sequence_lengths=lens, {PREPARED}"),
    ("q=q, k=k, v=v, cu_seqlens=cu, bsz=1, seq_len=8",
     'q=q, k=k, v=v, cu_seqlens=cu, bsz=1, seq_len=8, forward_metadata=prepare_varlen_metadata(cu, q, layout="cudnn")'),
    ("self.q, k, v, batch.cu_seqlens[0], 1, 8",
     'self.q, k, v, batch.cu_seqlens[0], 1, 8, forward_metadata=prepare_varlen_metadata(batch.cu_seqlens[0], self.q, layout="cudnn")'),
])
def test_gl101_fix_adds_or_replaces_forward_metadata(args, expected):
    out = fix(f"{CUDNN}cudnn_vision_attention({args})\n")
    assert out.splitlines()[-1] == f"cudnn_vision_attention({expected})"
    assert not [f for f in findings(out) if f.code in ("GL101", "GL102")]


@pytest.mark.parametrize("imports", [
    "from guardlint.kernels.attention import cudnn_vision_attention\n",
    "import guardlint.kernels.attention as ka\n",
])
def test_gl101_fix_when_the_kernel_is_imported_from_its_submodule(imports):
    """The fix is chosen by the target, whichever of its names the call uses."""
    callee = "ka.cudnn_vision_attention" if " as ka" in imports else "cudnn_vision_attention"
    out = fix(f"{imports}out = {callee}(q, k, v, cu, 1, 8)\n")
    # Sorted before a `from guardlint...` import of the kernel, after a plain `import` of it.
    head = f"{IMPORT}{imports}" if imports.startswith("from ") else f"{imports}{IMPORT}"
    assert out == f"{head}out = {callee}(q, k, v, cu, 1, 8, {PREPARED})\n"
    assert not [f for f in findings(out) if f.code in ("GL101", "GL102")]


ENGINE_VISION = "from sglang.srt.layers.attention.vision import VisionFlashInferAttention\n"
ENGINE_PREPARED = ("forward_metadata=prepare_flashinfer_cudnn_vision_attention_metadata(cu_seqlens, q.device, "
                   "elem_per_token=q.shape[-2] * q.shape[-1])")


@pytest.mark.parametrize("owner, per_layer", [("VisionTower", False), ("VisionBlock", True),
                                              ("Qwen2VisionAttention", True), ("ViTLayer", True)])
def test_engine_call_fixed_with_the_engine_helper_once_per_forward_never_per_layer(owner, per_layer):
    """The engine's helper is not cached: in a forward that runs once per layer it would be a host read in
    every layer, so there the finding says why there is no fix and what to do instead."""
    src = (f"{ENGINE_VISION}\n\nclass {owner}:\n    def __init__(self):\n"
           "        self.attn = VisionFlashInferAttention()\n\n"
           "    def forward(self, q, k, v, cu_seqlens, bsz, seq_len):\n"
           "        return self.attn(q, k, v, cu_seqlens, bsz, seq_len)\n")
    got = [f for f in findings(src) if f.code in ("GL101", "GL102")]
    assert [f.code for f in got] == ["GL101", "GL102"]
    if per_layer:
        assert fix(src) == src
        for f in got:  # GL101 says why; GL102, on the same call for the same reason, points at it
            assert f.fix is None
            assert "build it once per model forward, before the block loop " \
                   "(prepare_flashinfer_cudnn_vision_attention_metadata(...))" in findings(src)[0].note
        assert got[0].message.endswith(f"; no fix: runs per layer in {owner}.forward")
        shown = [f for f in lint_source(src, "snippet.py") if f.code in ("GL101", "GL102")]  # as a user sees them
        assert shown[0].message == got[0].message and shown[1].message.endswith("; no fix (same call as GL101)")
    else:
        out = fix(src)
        assert out == src.replace(ENGINE_VISION, ENGINE_VISION + "from sglang.srt.layers.attention.vision import "
                                  "prepare_flashinfer_cudnn_vision_attention_metadata\n").replace(
            "bsz, seq_len)\n", f"bsz, seq_len, {ENGINE_PREPARED})\n")
        assert "guardlint" not in out and not [f for f in findings(out) if f.code in ("GL101", "GL102")]


@pytest.mark.parametrize("args, why", [
    ("q, k, v, make_cu(), 1, 8", "cu_seqlens is `make_cu()`, a call"),
    ("q, k, v, cu[i.item()], 1, 8", "cu_seqlens is `cu[i.item()]`, a subscript with a computed index"),
    ("q, k, v, (cu := build()), 1, 8", "an assignment expression"),
    ("proj(x), k, v, cu, 1, 8", "q is `proj(x)`, a call"),
    ("q, k, v, cu + 0, 1, 8", "cu_seqlens is `cu + 0`, an expression"),
    ("q, k, v, None, 1, 8", "cu_seqlens is None"),
    ("q, k, v", "cu_seqlens is not passed"),
])
def test_no_safe_fix_says_why(args, why):
    src = f"{CUDNN}cudnn_vision_attention({args})\n"
    got = findings(src)
    assert got and all(f.fix is None and ("; no fix: " in f.message or "; no fix (same call as GL101)" in f.message)
                       for f in got)
    assert why in got[0].message
    assert fix(src) == src


# -- GL201 ----------------------------------------------------------------------------------------------
def test_gl201_fix_from_keyword_and_positional_seg_indptr():
    out = fix(LORA + "a = LoRABatchInfo(bs=1, num_segments=1, seg_indptr=self.indptr)\n"
                     "b = LoRABatchInfo(False, 1, 1, indptr, w, r, s)\n")
    # seg_lens alone is not enough for the engine's Triton kernels (grid: triton.cdiv(max_len, BLOCK_S)).
    assert "seg_indptr=self.indptr, seg_lens=self.indptr[1:] - self.indptr[:-1], " \
           "max_len=int((self.indptr[1:] - self.indptr[:-1]).max()))" in out
    assert "LoRABatchInfo(use_cuda_graph=False, bs=1, num_segments=1, seg_indptr=indptr, weight_indices=w, " \
           "lora_ranks=r, scalings=s, seg_lens=indptr[1:] - indptr[:-1], " \
           "max_len=int((indptr[1:] - indptr[:-1]).max()))" in out


@pytest.mark.parametrize("params, expected", [
    ("p, seg_lens", "seg_lens=seg_lens, max_len=int(seg_lens.max())"),
    ("p, max_len", "seg_lens=p[1:] - p[:-1], max_len=max_len"),
    ("p, seg_lens, max_len", "seg_lens=seg_lens, max_len=max_len"),
])
def test_gl201_fix_uses_values_already_in_scope(params, expected):
    out = fix(LORA + f"def build({params}):\n    return LoRABatchInfo(bs=1, seg_indptr=p)\n")
    assert out.splitlines()[-1] == f"    return LoRABatchInfo(bs=1, seg_indptr=p, {expected})"


def test_gl201_replaces_an_explicit_none_in_place():
    src = LORA + "info = LoRABatchInfo(bs=1, seg_indptr=p, max_len=None, seg_lens=None, permutation=None)\n"
    assert fix(src).splitlines()[-1] == \
        "info = LoRABatchInfo(bs=1, seg_indptr=p, max_len=int((p[1:] - p[:-1]).max()), seg_lens=p[1:] - p[:-1], " \
        "permutation=None)"


def test_gl201_dataclasses_replace():
    src = "import dataclasses\n\ndef reset(self):\n    return dataclasses.replace(self.info, max_len=None, seg_lens=None)\n"
    assert fix(src).splitlines()[-1] == \
        "    return dataclasses.replace(self.info, max_len=None, seg_lens=self.info.seg_indptr[1:] - self.info.seg_indptr[:-1])"
    own = "from dataclasses import replace\nreplace(info, seg_indptr=p, seg_lens=None, max_len=None)\n"
    assert "seg_lens=p[1:] - p[:-1]" in fix(own)
    src = "import dataclasses\ndataclasses.replace(make(), max_len=None, seg_lens=None)\n"
    (f,) = findings(src)
    assert f.fix is None and "the record is `make()`, a call" in f.message


# -- GL202 ----------------------------------------------------------------------------------------------
def test_gl202_names_positional_arguments_in_field_order():
    out = fix(LORA + "LoRABatchInfo(False, 2, 2, seg_lens=lens)\n")
    assert out.splitlines()[-1] == "LoRABatchInfo(use_cuda_graph=False, bs=2, num_segments=2, seg_lens=lens)"


OUR_LORA = "from guardlint.kernels import LoRABatchInfo\n"


@pytest.mark.parametrize("imports, args, why", [
    (LORA, "False, 1, 1, p, w, r, s, None, lens, None, a, b, c, d, e, f, extra",
     "17 positional arguments, but LoRABatchInfo(...) takes 16"),
    # Ours keeps the engine's first ten fields: an eleventh positional has no field to be named after.
    (OUR_LORA, "False, 1, 1, p, w, r, s, None, lens, None, extra",
     "11 positional arguments, but LoRABatchInfo(...) takes 10"),
    (LORA, "False, 1, bs=1, seg_lens=lens", "bs is passed both by position and by keyword"),
    (LORA, "False, *rest, seg_lens=lens", "it passes *args or **kwargs"),
])
def test_gl202_without_a_fix_says_why(imports, args, why):
    src = imports + f"LoRABatchInfo({args})\n"
    (f,) = [f for f in findings(src) if f.code == "GL202"]
    assert f.fix is None and why in f.message
    assert fix(src) == src


def test_gl202_names_fields_by_the_resolved_class():
    """The engine's LoRABatchInfo (0.5.23) has 16 fields, ours the first ten, also when ours is imported
    through its submodule."""
    args = "False, 1, 1, p, w, r, s, None, lens, None, extra"
    assert fix(LORA + f"LoRABatchInfo({args})\n").splitlines()[-1] == (
        "LoRABatchInfo(use_cuda_graph=False, bs=1, num_segments=1, seg_indptr=p, weight_indices=w, lora_ranks=r, "
        "scalings=s, max_len=None, seg_lens=lens, permutation=None, expected_tokens=extra)")
    sub = "from guardlint.kernels.lora import LoRABatchInfo\n"
    (f,) = [f for f in findings(sub + f"LoRABatchInfo({args})\n") if f.code == "GL202"]
    assert f.fix is None and "11 positional arguments, but LoRABatchInfo(...) takes 10" in f.message


def test_overlapping_fixes_settle_in_a_second_round():
    """GL201 (replace the 9th positional None) and GL202 (name every positional) edit the same span."""
    src = LORA + "info = LoRABatchInfo(False, 1, 1, p, w, r, s, None, None, None)\n"
    assert sorted(f.code for f in findings(src)) == ["GL201", "GL202"]
    assert fix(src).splitlines()[-1] == (
        "info = LoRABatchInfo(use_cuda_graph=False, bs=1, num_segments=1, seg_indptr=p, weight_indices=w, "
        "lora_ranks=r, scalings=s, max_len=int((p[1:] - p[:-1]).max()), seg_lens=p[1:] - p[:-1], permutation=None)")


# -- user contracts (GL001) --------------------------------------------------------------------------------
def test_user_contract_fix_only_with_a_derivation_template():
    base = {"call": "mylib.ops.fwd", "params": ["x", "cu_seqlens", "max_seqlen"], "require": [["max_seqlen"]]}
    src = "from mylib.ops import fwd\nfwd(x, cu)\n"
    plain = build_rules([contract_from_config(base)])
    (f,) = findings(src, plain)
    assert f.fix is None and f.message.endswith("without max_seqlen")  # no template: nothing to say
    derived = build_rules([contract_from_config(
        {**base, "derive": {"max_seqlen": "int(({cu_seqlens}[1:] - {cu_seqlens}[:-1]).max())"}})])
    (f,) = findings(src, derived)
    assert f.fix.applicability == "unsafe"
    settings = Settings(root=Path("."), contracts=(contract_from_config(
        {**base, "derive": {"max_seqlen": "int(({cu_seqlens}[1:] - {cu_seqlens}[:-1]).max())"}}),))
    assert fixed_source(src, unsafe_fixes=True, settings=settings).splitlines()[-1] == \
        "fwd(x, cu, max_seqlen=int((cu[1:] - cu[:-1]).max()))"


def test_user_project_fix_through_the_cli(tmp_path):
    project = tmp_path / "p"
    shutil.copytree(FIXTURES / "user_project", project)
    r = invoke("--fix", "--unsafe-fixes", str(project / "model.py"))
    text = (project / "model.py").read_text()
    assert "paged_decode(q, kv_cache, block_table, seq_lens, max_seq_len=int(seq_lens.max()))" in text
    assert r.exit_code == 1 and "GL901" in r.stdout and "GL001" not in r.stdout  # GL901 has no template


# -- layout ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, expected", [
    ("LoRABatchInfo(\n    bs=1,\n    seg_indptr=p,\n)\n",
     "LoRABatchInfo(\n    bs=1,\n    seg_indptr=p,\n    seg_lens=p[1:] - p[:-1],\n    max_len=int((p[1:] - p[:-1]).max()),\n)\n"),
    ("LoRABatchInfo(\n    bs=1,\n    seg_indptr=p\n)\n",
     "LoRABatchInfo(\n    bs=1,\n    seg_indptr=p,\n    seg_lens=p[1:] - p[:-1],\n    max_len=int((p[1:] - p[:-1]).max())\n)\n"),
    ("LoRABatchInfo(  # batch\n    seg_indptr=p,  # prefix sums\n)\n",
     "LoRABatchInfo(  # batch\n    seg_indptr=p,  # prefix sums\n    seg_lens=p[1:] - p[:-1],\n    max_len=int((p[1:] - p[:-1]).max()),\n)\n"),
    ("LoRABatchInfo(bs=1,\n              seg_indptr=p)\n",
     "LoRABatchInfo(bs=1,\n              seg_indptr=p,\n              seg_lens=p[1:] - p[:-1],\n"
     "              max_len=int((p[1:] - p[:-1]).max()))\n"),
    ("LoRABatchInfo(bs=1, seg_indptr=p,)\n", "LoRABatchInfo(bs=1, seg_indptr=p, seg_lens=p[1:] - p[:-1], max_len=int((p[1:] - p[:-1]).max()),)\n"),
    ("(LoRABatchInfo)(seg_indptr=p)\n", "(LoRABatchInfo)(seg_indptr=p, seg_lens=p[1:] - p[:-1], max_len=int((p[1:] - p[:-1]).max()))\n"),
    ("x = (LoRABatchInfo(seg_indptr=p))\n", "x = (LoRABatchInfo(seg_indptr=p, seg_lens=p[1:] - p[:-1], max_len=int((p[1:] - p[:-1]).max())))\n"),
])
def test_fix_keeps_the_layout_of_the_call(call, expected):
    assert fix(LORA + call) == LORA + expected


def test_fix_inside_indented_blocks_and_tabs():
    src = LORA + "class A:\n\tdef f(self, p):\n\t\treturn LoRABatchInfo(\n\t\t\tbs=1,\n\t\t\tseg_indptr=p,\n\t\t)\n"
    assert fix(src) == src.replace("seg_indptr=p,\n", "seg_indptr=p,\n\t\t\tseg_lens=p[1:] - p[:-1],\n"
                                                    "\t\t\tmax_len=int((p[1:] - p[:-1]).max()),\n")


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.py.fixed")), ids=lambda p: p.name)
def test_fixture_fixes_exactly_to_its_fixed_file(path):
    source = path.with_suffix("")
    assert fixed_source(source.read_bytes(), str(source), unsafe_fixes=True) == path.read_bytes()


def test_every_fixture_fixes_to_a_parsing_file_and_a_second_fix_changes_nothing():
    for path in sorted(FIXTURES.glob("*.py")):
        data = path.read_bytes()
        once = fixed_source(data, str(path), unsafe_fixes=True)
        if path.name == "syntax_error.py":
            assert once == data
            continue
        ast.parse(once)
        assert fixed_source(once, str(path), unsafe_fixes=True) == once, path.name


# -- files -----------------------------------------------------------------------------------------------------
def _write(tmp_path, name: str, data: bytes, mode: int = 0o644) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    os.chmod(p, mode)
    return p


@pytest.mark.parametrize("name", ["crlf.py", "bom_crlf.py", "latin1_cookie.py"])
def test_fixed_files_keep_encoding_bom_and_line_breaks(tmp_path, name):
    src = (FIXTURES / name).read_bytes()
    p = _write(tmp_path, name, src)
    invoke("--fix", "--unsafe-fixes", str(p))
    out = p.read_bytes()
    assert out.startswith(b"\xef\xbb\xbf") == src.startswith(b"\xef\xbb\xbf")
    assert out.count(b"\r\n") == out.count(b"\n") if b"\r\n" in src else b"\r" not in out
    if name == "latin1_cookie.py":
        assert b"\xe9" in out and out.startswith(b"# -*- coding: latin-1 -*-")
    if name != "crlf.py":  # crlf.py's GL201 call has no seg_indptr: nothing to fix there
        assert out != src and b"forward_metadata=prepare_varlen_metadata(4, 1" in out


def test_fixed_file_keeps_its_mode_bits_and_no_temporary_file_is_left(tmp_path):
    p = _write(tmp_path, "m.py", (LORA + "LoRABatchInfo(seg_indptr=p)\n").encode(), 0o751)
    before = {x.name for x in tmp_path.iterdir()}
    r = invoke("--fix", "--unsafe-fixes", str(p))
    assert r.exit_code == 0 and "seg_lens=" in p.read_text()
    assert stat.S_IMODE(p.stat().st_mode) == 0o751
    assert {x.name for x in tmp_path.iterdir()} == before


def test_a_symlink_is_fixed_through_not_replaced(tmp_path):
    real = _write(tmp_path, "real.py", (LORA + "LoRABatchInfo(seg_indptr=p)\n").encode())
    link = tmp_path / "link.py"
    link.symlink_to(real)
    invoke("--fix", "--unsafe-fixes", str(link))
    assert link.is_symlink() and "seg_lens=" in real.read_text()


def test_a_file_that_does_not_parse_is_never_written(tmp_path):
    src = (LORA + "LoRABatchInfo(seg_indptr=p)\nx = (\n").encode()
    p = _write(tmp_path, "broken.py", src)
    os.utime(p, (1, 1))
    r = invoke("--fix", "--unsafe-fixes", str(p))
    assert r.exit_code == 1 and "GL000" in r.stdout
    assert p.read_bytes() == src and p.stat().st_mtime == 1


def test_a_fix_that_would_break_the_file_is_not_written(tmp_path, monkeypatch):
    src = (LORA + "LoRABatchInfo(seg_indptr=p)\n").encode()
    p = _write(tmp_path, "m.py", src)
    monkeypatch.setattr(engine._Fixer, "_call_edit", lambda self, *a: Edit(2, 1, 2, 1, "))) "))
    r = invoke("--fix", "--unsafe-fixes", str(p))
    assert p.read_bytes() == src
    assert r.exit_code == 1 and "GL000 fix not applied: the fixed file would not parse" in r.stdout
    assert "GL201" in r.stdout  # the finding stays


def test_a_file_that_cannot_be_written_keeps_its_findings(tmp_path, monkeypatch):
    from guardlint.lint import fixer

    def refuse(path, data):
        raise PermissionError(13, "Permission denied")

    p = _write(tmp_path, "m.py", (LORA + "LoRABatchInfo(seg_indptr=p)\n").encode())
    monkeypatch.setattr(fixer, "write_atomic", refuse)  # the runner imports it when it writes
    r = invoke("--fix", "--unsafe-fixes", str(p))
    assert r.exit_code == 1 and "could not be written: Permission denied" in r.stdout and "GL201" in r.stdout


# -- the command line --------------------------------------------------------------------------------------
@pytest.fixture
def project(tmp_path):
    shutil.copy(FIXTURES / "lora_backend.py", tmp_path / "lora_backend.py")
    shutil.copy(FIXTURES / "qwen2_vl_vision.py", tmp_path / "qwen2_vl_vision.py")
    return tmp_path


def test_fix_and_diff_together_are_refused(project):
    r = invoke("--fix", "--diff", str(project))
    assert r.exit_code == 2 and "--fix and --diff cannot be used together" in r.stderr and r.stdout == ""


def test_diff_prints_and_writes_nothing(project):
    before = {p.name: p.read_bytes() for p in project.iterdir()}
    r = invoke("--diff", "--unsafe-fixes", str(project))
    assert r.exit_code == 1 and r.stdout.startswith(f"--- {project / 'lora_backend.py'}\n+++ ")
    # The seg_lens already in scope is passed, and max_len derived from it.
    assert "+            max_len=int(seg_lens.max()),\n+            seg_lens=seg_lens,\n" in r.stdout
    assert "-            max_len=None,\n-            seg_lens=None,\n" in r.stdout
    assert {p.name: p.read_bytes() for p in project.iterdir()} == before
    # The per-layer attention call (GL101, GL102) gets no fix.
    assert r.stderr.startswith("Would fix 10 findings (5 would remain).")
    # Without --unsafe-fixes every fix here is hidden.
    r = invoke("--diff", str(project))
    assert r.stdout == "" and r.stderr == ("No fixes would be applied (15 would remain).\n"
                                           "No fixes available (10 hidden fixes can be enabled with the "
                                           "`--unsafe-fixes` option).\n")


def test_diff_applies_with_patch(project, tmp_path):
    patch = shutil.which("patch")
    if patch is None:
        pytest.skip("the patch program is not installed")
    import subprocess

    diff = invoke("--diff", "--unsafe-fixes", str(project)).stdout
    expected = {}
    for name in ("lora_backend.py", "qwen2_vl_vision.py"):
        expected[name] = fixed_source((project / name).read_bytes(), unsafe_fixes=True)
    subprocess.run([patch, "-p0", "-s"], input=diff.encode(), cwd="/", check=True)
    for name, data in expected.items():
        assert (project / name).read_bytes() == data


def test_fix_reports_what_remains_and_exits_by_it(project):
    r = invoke("--fix", "--unsafe-fixes", str(project))
    assert r.exit_code == 1
    assert r.stderr == "Found 15 findings (10 fixed, 5 remaining).\n"
    assert sorted({line.split()[1] for line in r.stdout.splitlines()}) == ["GL101", "GL102", "GL104", "GL203"]
    # The attention call left is the one in a per-layer forward, and it says so.
    attention = [line for line in r.stdout.splitlines() if " GL101 " in line or " GL102 " in line]
    assert len(attention) == 2 and attention[0].endswith("; no fix: runs per layer in Qwen2VisionAttention.forward")
    assert attention[1].endswith("; no fix (same call as GL101)")
    # A second run has nothing to fix and reports the same.
    again = invoke("--fix", "--unsafe-fixes", str(project))
    assert again.stdout == r.stdout and again.stderr == "Found 5 findings.\n"
    clean = invoke("--fix", "--unsafe-fixes", "--select", "GL201", str(project))
    assert (clean.exit_code, clean.stderr) == (0, "All checks passed.\n")


def test_fix_without_unsafe_fixes_applies_nothing_and_says_so(project):
    before = (project / "lora_backend.py").read_bytes()
    r = invoke("--fix", str(project))
    assert (project / "lora_backend.py").read_bytes() == before
    assert r.stderr.endswith("No fixes available (10 hidden fixes can be enabled with the `--unsafe-fixes` option).\n")


def test_fixable_marker_and_json_fix_object(project):
    plain = invoke(str(project / "lora_backend.py")).stdout.splitlines()
    assert not any("[*]" in line for line in plain)
    marked = invoke("--unsafe-fixes", str(project / "lora_backend.py")).stdout.splitlines()
    assert sum(": GL201 [*] " in line for line in marked) == 4
    assert any(": GL203 an empty launch grid: " in line for line in marked)  # no fix: no marker
    data = json.loads(invoke("--format", "json", str(project / "lora_backend.py")).stdout)
    by_code = {}
    for d in data:
        by_code.setdefault(d["code"], d)
    fix_object = by_code["GL201"]["fix"]
    assert fix_object["applicability"] == "unsafe"
    assert fix_object["message"] == "Set seg_lens=seg_lens; Set max_len=int(seg_lens.max()) (a host read, once per batch)"
    assert fix_object["edits"] == [{"line": 40, "column": 21, "end_line": 41, "end_column": 26,
                                    "content": "int(seg_lens.max()),\n            seg_lens=seg_lens"}]
    assert by_code["GL203"]["fix"] is None


def test_statistics_fixable_column(project):
    plain = invoke("--statistics", str(project)).stdout
    assert "[*]" not in plain and "[ ]" not in plain
    rows = {line.split("\t")[1]: line.split("\t")[2] for line in invoke("--statistics", "--unsafe-fixes",
                                                                        str(project)).stdout.splitlines()}
    assert rows["GL201"] == "[*] missing-max-len-and-seg-lens" and rows["GL203"] == "[ ] zero-max-len"
    data = json.loads(invoke("--statistics", "--format", "json", str(project)).stdout)
    assert {d["code"]: (d["fixable"], d["unsafe_fixes"]) for d in data}["GL201"] == (0, 4)


def test_fix_from_stdin_prints_the_fixed_source():
    src = LORA + "info = LoRABatchInfo(seg_indptr=p)\n"
    r = invoke("--fix", "--unsafe-fixes", "-", input=src)
    assert r.exit_code == 0 and r.stdout == LORA + "info = LoRABatchInfo(seg_indptr=p, seg_lens=p[1:] - p[:-1], " \
                                                   "max_len=int((p[1:] - p[:-1]).max()))\n"
    r = invoke("--fix", "-", "--stdin-filename", "m.py", input=src)
    assert r.stdout == src and "m.py:2:8: GL201" in r.stderr


def test_derived_expressions_are_parsed_once_for_many_calls(monkeypatch):
    import libcst as cst

    from guardlint.lint import fixes

    src = CUDNN + "".join(f"def f{i}(q, k, v, cu):\n    return cudnn_vision_attention(q, k, v, cu, 1, 8)\n"
                          for i in range(5))
    fixes._parse_expression.cache_clear()
    out = fix(src)
    assert out.count(PREPARED) == 5
    assert fixes._parse_expression.cache_info().misses < 5
    # the shared nodes write the same text as fresh parses
    monkeypatch.setattr(fixes, "_parse_expression", cst.parse_expression)
    assert fix(src) == out
