"""The tree pre-filter (lint/prefilter.py) never drops a file with findings: the engine with and without
it gives the same findings on every fixture, every catalog example and generated call sites; and it
does drop the files that only mention a trigger word."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from guardlint import __version__
from guardlint.contracts import all_contracts
from guardlint.lint import build_rules, check_source, lint_paths, load_settings
from guardlint.lint import runner
from guardlint.lint.config import Settings
from guardlint.lint.prefilter import tree_filter

from test_lint_oracle import _sites

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lint"
RULES = build_rules()
FIXTURE_FILES = sorted(FIXTURES.rglob("*.py"))
EXAMPLES = [pytest.param(e.code, id=f"{c.code}-{e.kind}{i}") for c in all_contracts()
            for i, e in enumerate(c.examples)]


def _both(data: bytes, rules=RULES, **kw):
    """Findings without and with the tree pre-filter, and whether libcst saw the file with it."""
    def key(result):
        return [(f.line, f.column, f.end_line, f.end_column, f.code, f.message, f.fix) for f in result.findings]

    full = check_source(data, "x.py", rules, **kw)
    filtered = check_source(data, "x.py", rules, prefilter=True, **kw)
    return key(full), key(filtered), filtered.parsed


def _same(data: bytes, rules=RULES, **kw) -> bool:
    full, filtered, parsed = _both(data, rules, **kw)
    assert filtered == full
    return parsed


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=[str(p.relative_to(FIXTURES)) for p in FIXTURE_FILES])
@pytest.mark.parametrize("strict", [False, True])
def test_prefilter_keeps_every_fixture_finding(path, strict):
    name, is_pkg = runner.module_name_for(str(path))
    _same(path.read_bytes(), strict=strict, module_name=name, is_package=is_pkg)


@pytest.mark.parametrize("code", EXAMPLES)
def test_prefilter_keeps_every_catalog_example_finding(code):
    data = code.encode()
    full, filtered, parsed = _both(data)
    assert filtered == full
    if full:  # a bad example must reach libcst
        assert parsed


def test_prefilter_keeps_the_user_projects_findings(monkeypatch):
    root = FIXTURES / "user_project"
    settings_ = load_settings([str(root)])
    keys = []
    for on in (False, True):
        monkeypatch.setattr(runner, "AST_PREFILTER", on)
        report = lint_paths([str(root)], settings_, jobs=1)
        keys.append(sorted((f.path, f.line, f.column, f.code, f.message) for f in report.findings))
    assert keys[0] == keys[1] and keys[0]


def test_prefilter_whole_fixture_tree_in_parallel(monkeypatch):
    keys = []
    for on in (False, True):
        monkeypatch.setattr(runner, "AST_PREFILTER", on)
        report = lint_paths([str(FIXTURES)], Settings(root=FIXTURES), jobs=2)
        keys.append(sorted((f.path, f.line, f.column, f.code, f.message) for f in report.findings))
    assert keys[0] == keys[1] and keys[0]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_sites())
def test_prefilter_keeps_generated_call_site_findings(site):
    _same(site.source().encode())


# -- GL104 sites: receivers, host reads, contexts ----------------------------------------------------
RECEIVERS = ("cu_seqlens", "self.seq_lens", "batch.extend_seq_lens[0]", "seq_lens_cpu", "seqlens - 1",
             "(cu_seqlens[1:] - cu_seqlens[:-1])", "x.seg_indptr", "torch.diff(cu_seqlens_q)", "lengths",
             "f(seq_lens=n)", "-seg_lens", "(a if c else seq_lens)")
READS = ("{r}.item()", "{r}.tolist()", "int({r}.max())", "int({r}.max().item())", "int(x=({r}).max())",
         "{r}.max()", "int({r})", "{r}.item(0)", "float({r}.max())", "bool({r}[0])", "{r}.cpu()", "{r}.to('cpu')",
         "{r}.to(device='cpu', non_blocking=True)", "{r}.cpu().tolist()")
PLACES = (
    "class {cls}(nn.Module):\n    def {meth}(self, x):\n        y = {read}\n        return y\n",
    "class {cls}:\n    async def {meth}(self):\n        if x:\n            return [{read} for _ in z]\n",
    "for layer in {loop}:\n    y = {read}\n",
    "def run(m):\n    for i, b in enumerate({loop}):\n        out = {read}\n",
    "async def run(m):\n    async for b in {loop}:\n        out = lambda: {read}\n",
    "y = {read}\n",
    "def helper():\n    return {read}\n",
    "class {cls}:\n    y = {read}\n",
    "class {cls}:\n    def {meth}(self):\n        def inner():\n            return {read}\n        return inner\n",
    "class Outer:\n    class {cls}:\n        def {meth}(self):\n            return {read}\n",
    "class {cls}:\n    @deco({read})\n    def {meth}(self, n=1):\n        pass\n",
    # a layer through its base; a platform method of a CustomOp-like dispatcher defined in the file
    "class Plugin310({cls}):\n    def {meth}(self, x):\n        return {read}\n",
    "class Op:\n    def __init__(self):\n        self._f = self.pick()\n\n    def forward(self, *a):\n"
    "        return self._f(*a)\n\n    def pick(self):\n        return self.forward_oot\n\n\n"
    "class {cls}(Op):\n    def {meth}(self, x):\n        return {read}\n",
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(place=st.sampled_from(PLACES), read=st.sampled_from(READS), receiver=st.sampled_from(RECEIVERS),
       cls=st.sampled_from(("VisionBlock", "DecoderLayer", "SelfAttention", "Helper", "ATTENTION")),
       meth=st.sampled_from(("forward", "step", "__call__", "forward_oot")),
       loop=st.sampled_from(("self.layers", "range(num_layers)", "blocks", "items", "model.vision_blocks")))
def test_prefilter_keeps_generated_host_sync_findings(place, read, receiver, cls, meth, loop):
    source = "import torch\n" + place.format(cls=cls, meth=meth, loop=loop, read=read.format(r=receiver))
    _same(source.encode())


# -- what it drops ------------------------------------------------------------------------------------
def _sent(source: str) -> bool:
    data = source.encode()
    assert RULES.may_match(data), "the textual pre-filter must let this through for the test to mean anything"
    return tree_filter(RULES).may_report(ast.parse(data), data)


def test_prefilter_drops_trigger_words_in_comments_and_strings():
    assert not _sent('"""Calls varlen_attention, LoRABatchInfo(seg_lens=None)."""\n'
                     "# cudnn_vision_attention(q, k, v)\nx = 'seg_lens'\n")


def test_prefilter_drops_host_reads_outside_per_layer_code():
    source = ("class Helper:\n    def forward(self, cu_seqlens):\n        return cu_seqlens.tolist()\n"
              "def prepare(block, seq_lens):\n    return int(seq_lens.max())\n"
              "class VisionBlock:\n    def forward(self, seq_lens_cpu):\n        return seq_lens_cpu.tolist()\n")
    assert not _sent(source)
    full, filtered, parsed = _both(source.encode())
    assert full == filtered == [] and not parsed


def test_prefilter_sends_aliased_imports_and_replace_fields():
    assert _sent("from guardlint.kernels import cudnn_vision_attention as va\nva(q)\n")
    assert _sent("from sglang.srt.lora.utils import LoRABatchInfo as I\ninfo = I(1)\n")
    assert _sent("import guardlint.kernels.cudnn_vision_attention as c\n")
    assert _sent("from dataclasses import replace as r\ninfo = r(info, seg_lens=None, max_len=None)\n")
    assert _sent("class VisionBlock:\n    def forward(self, cu_seqlens):\n        return cu_seqlens.tolist()\n")


def test_prefilter_does_not_load_at_start_up():
    out = subprocess.run([sys.executable, "-c", "import sys; from guardlint.lint.cli import main\n"
                          "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
                          "print('guardlint.lint.prefilter' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines() == [f"guardlint {__version__}", "False"]


# -- instance targets: only calls of instances made in the file can be reported ---------------------
VISION = "from sglang.srt.layers.attention.vision import VisionAttention, QKV_BACKEND_IMPL\n"


@pytest.mark.parametrize("init, call, reported", [
    ("self.attn = VisionAttention(dim)", "self.attn(x, cu_seqlens=cu)", True),
    ("self.attn = VisionAttention(dim)", "self.attn(x, cu_seqlens=cu, max_seqlen=None)", True),
    ("self.attn = VisionAttention(dim)", "self.attn(x, **kwargs)", True),
    ("self.attn = VisionAttention(dim)", "self.attn.forward(x, max_seqlen=m)", False),
    ("self.attn = VisionAttention(dim)", "self.attn(x, forward_metadata=meta)", False),
    ("self.attn: VisionAttention = VisionAttention(dim)", "self.attn(\n            x)", True),
    ("self.backend = QKV_BACKEND_IMPL[name](dim)", "self.backend.forward(q=x, cu_seqlens=None)", True),
    ("self.backend = QKV_BACKEND_IMPL[name](dim)",
     "self.backend.forward(q=x, forward_metadata=meta, sequence_lengths=s, max_seqlen=m)", False),
    ("self.attn = None", "VisionAttention(dim)(x)", True),
    ("self.attn = None", "VisionAttention(dim)(x, max_seqlen=m)", False),
])
def test_prefilter_instance_targets_sends_only_unsatisfied_calls(init, call, reported):
    source = (VISION + "\n\nclass Block:\n    def __init__(self, dim):\n        " + init + "\n\n"
              "    def forward(self, x, cu, m, meta, s, kwargs):\n        return " + call + "\n")
    assert _sent(source) == reported
    full, filtered, _ = _both(source.encode())
    assert filtered == full


def test_prefilter_instance_targets_mentioned_but_not_called_are_dropped():
    assert not _sent(VISION + "def build(dim) -> 'VisionAttention':\n    return isinstance(dim, VisionAttention)\n")


def test_prefilter_instance_target_imported_under_another_name_is_sent():
    assert _sent("from sglang.srt.layers.attention.vision import VisionAttention as VA\nVA(1)(x)\n")


def test_prefilter_callee_targets_only_in_annotations_are_dropped():
    source = ("from sglang.srt.lora.utils import LoRABatchInfo\n\n\n"
              "def run(batch_info: LoRABatchInfo, seg_lens) -> LoRABatchInfo:\n"
              "    assert isinstance(batch_info, LoRABatchInfo)\n    return batch_info\n")
    assert not _sent(source)
    assert _sent(source + "info = LoRABatchInfo(1, 2)\n")


# -- GL104's textual filter: a file whose reads can be per layer is passed ----------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(place=st.sampled_from(PLACES), read=st.sampled_from(READS), receiver=st.sampled_from(RECEIVERS),
       cls=st.sampled_from(("VisionBlock", "DecoderLayer", "SelfAttention", "Helper", "ATTENTION")),
       meth=st.sampled_from(("forward", "step", "__call__", "forward_oot")),
       loop=st.sampled_from(("self.layers", "range(num_layers)", "blocks", "items", "model.vision_blocks")))
def test_host_sync_text_filter_keeps_generated_findings(place, read, receiver, cls, meth, loop):
    data = ("import torch\n" + place.format(cls=cls, meth=meth, loop=loop, read=read.format(r=receiver))).encode()
    if any(f.code == "GL104" for f in check_source(data, "x.py", RULES).findings):
        assert HOST_SYNC_SPEC.may_match(data)


HOST_SYNC_SPEC = runner.rules_for(Settings(root=Path.cwd())).pattern_specs[0]


@pytest.mark.parametrize("source", [
    # a receiver written over lines before its read
    "class VisionBlock:\n    def forward(self, cu_seqlens):\n        n = (\n            cu_seqlens[1:]\n"
    "            - cu_seqlens[:-1]\n        ).max().item()\n",
    # int( with its argument on the next line
    "for layer in self.layers:\n    n = int(\n        seq_lens.max()\n    )\n",
    # a decorator belongs to the forward below it
    "class VisionBlock:\n    @deco(\n        seq_lens.item()\n    )\n    def forward(self):\n        pass\n",
    # a module-level helper called per layer
    "def helper(seq_lens):\n    return seq_lens.tolist()\n\n\nclass DecoderLayer:\n    def forward(self, s):\n"
    "        if s:\n            return helper(s)\n",
    "for b in self.vision_blocks:\n    if (b.x > 0).any():\n        pass\n    seq_lens = 1\n",
    "async def run(m):\n    async for b in m.blocks:\n        out = int(b.seq_lens[0])\n",
    # CRLF line ends
    "class XLayer:\r\n    def forward(self, seq_lens):\r\n        return seq_lens.tolist()\r\n",
    # a bare copy in the platform method of a layer named through its base (vLLM's CustomOp, pinned)
    "from vllm.model_executor.layers.attention import MMEncoderAttention\n\n\n"
    "class AscendMMEncoderAttention310(MMEncoderAttention):\n    def forward_oot(self, q, cu_seqlens):\n"
    "        seq_lens_cpu = torch.diff(cu_seqlens).to('cpu')\n",
])
def test_host_sync_text_filter_passes_per_layer_reads(source):
    data = source.encode()
    assert HOST_SYNC_SPEC.may_match(data)
    assert [f.code for f in check_source(data, "x.py", RULES).findings] == ["GL104"]


@pytest.mark.parametrize("source", [
    # reads outside any per-layer place, though the file has one
    "def prepare(seq_lens):\n    return seq_lens.max().item()\n\n\nfor layer in self.layers:\n    x = layer(x)\n",
    "class VisionBlock:\n    def forward(self, x):\n        return x\n\n    def step(self, seq_lens):\n"
    "        return seq_lens.tolist()\n",
    "class Helper:\n    def forward(self, seq_lens):\n        return seq_lens.tolist()\n\n"
    "class VisionBlock:\n    pass\n",
    # .item() of something else, .any() that is not a test
    "for layer in self.layers:\n    n = x.item()\n    a = 1\n    m = seq_lens\n    ok = (seq_lens > 0).any()\n",
    # a copy in a method of a class that is not a layer, by its name or its bases'
    "class Helper(Base):\n    def forward_oot(self, cu_seqlens):\n        return cu_seqlens.cpu()\n",
])
def test_host_sync_text_filter_drops_reads_outside_per_layer_code(source):
    assert not HOST_SYNC_SPEC.may_match(source.encode())
    assert check_source(source.encode(), "x.py", RULES).findings == []
