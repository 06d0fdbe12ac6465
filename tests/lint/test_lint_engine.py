"""The lint engine on source snippets: name resolution, instances, binding, GL201/GL104 specifics, the
guard, suppressions, positions, file-level problems, the walker and the pre-filter."""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import libcst as cst
import pytest

from guardlint.contracts import Contract, Diagnosis, Target, contract_from_config
from guardlint.lint import build_rules, check_source
from guardlint.lint import engine
from guardlint.lint.walk import Walker

RULES = build_rules()
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lint"
VISION = "from sglang.srt.layers.attention.vision import VisionFlashInferAttention\n"
LORA = "from sglang.srt.lora.utils import LoRABatchInfo\n"
CUDNN = "from guardlint.kernels import cudnn_vision_attention\n"


def lint(src: str, rules=RULES, **kw):
    return check_source(textwrap.dedent(src).encode(), "snippet.py", rules, **kw).findings


def codes(src: str, **kw) -> list[tuple[int, str]]:
    return sorted((f.line, f.code) for f in lint(src, **kw))


# -- name resolution ---------------------------------------------------------------------------------
@pytest.mark.parametrize("imports, callee", [
    ("import guardlint.kernels", "guardlint.kernels.cudnn_vision_attention"),
    ("import guardlint.kernels as gk", "gk.cudnn_vision_attention"),
    ("from guardlint import kernels", "kernels.cudnn_vision_attention"),
    ("from guardlint.kernels import cudnn_vision_attention as cva", "cva"),
    ("from guardlint.kernels.attention import cudnn_vision_attention", "cudnn_vision_attention"),
    ("from guardlint.kernels import *", "cudnn_vision_attention"),
])
def test_function_target_resolves_through_imports(imports, callee):
    assert codes(f"{imports}\n{callee}(q, k, v, cu, 1, 8)\n") == [(2, "GL101"), (2, "GL102")]


@pytest.mark.parametrize("src", [
    "def cudnn_vision_attention(*a, **k): ...\ncudnn_vision_attention(q, k, v, cu, 1, 8)\n",
    "import mylib as guardlint\nguardlint.kernels.cudnn_vision_attention(q, k, v, cu, 1, 8)\n",
    "from other.kernels import cudnn_vision_attention\ncudnn_vision_attention(q, k, v, cu, 1, 8)\n",
    "cudnn_vision_attention(q, k, v, cu, 1, 8)\n",
    CUDNN + "cudnn_vision_attention = None if x else y\ncudnn_vision_attention(q, k, v, cu, 1, 8)\n",
    CUDNN + "class cudnn_vision_attention: pass\ncudnn_vision_attention(q, k, v, cu, 1, 8)\n",
])
def test_same_short_name_from_elsewhere_is_not_a_target(src):
    assert codes(src) == []


def test_local_names_shadow_imports_only_in_their_scope():
    src = CUDNN + """
def a(cudnn_vision_attention):
    return cudnn_vision_attention(q, k, v, cu, 1, 8)

def b():
    cudnn_vision_attention = make()
    return cudnn_vision_attention(q, k, v, cu, 1, 8)

def c():
    for cudnn_vision_attention in fns:
        cudnn_vision_attention(q, k, v, cu, 1, 8)

def d():
    return cudnn_vision_attention(q, k, v, cu, 1, 8)
"""
    assert codes(src) == [(15, "GL101"), (15, "GL102")]


def test_function_level_import_and_global():
    src = """
def f():
    from guardlint.kernels import cudnn_vision_attention as attn
    return attn(q, k, v, cu, 1, 8)

def g():
    return attn(q, k, v, cu, 1, 8)

def h():
    global attn
    from guardlint.kernels import cudnn_vision_attention as attn

def i():
    return attn(q, k, v, cu, 1, 8)
"""
    # ``global attn`` in h() binds attn at module level: g() sees it too, as at run time.
    assert [line for line, _ in codes(src)] == [4, 4, 7, 7, 14, 14]
    assert codes(src.replace("    global attn\n", "")) == [(4, "GL101"), (4, "GL102")]


def test_try_import_fallback_to_none_keeps_the_import():
    src = """
try:
    from guardlint.kernels import cudnn_vision_attention
except ImportError:
    cudnn_vision_attention = None
cudnn_vision_attention(q, k, v, cu, 1, 8)
"""
    assert codes(src) == [(6, "GL101"), (6, "GL102")]


def test_relative_import_resolves_with_the_module_name():
    src = "from .utils import LoRABatchInfo\nLoRABatchInfo(bs=1)\n"
    assert codes(src, module_name="sglang.srt.lora.backend") == [(2, "GL201")]
    assert codes(src, module_name="other.pkg.backend") == []
    assert codes(src) == []  # no module name: unknown, not guessed
    pkg = "from . import utils\nutils.LoRABatchInfo(bs=1)\n"
    assert codes(pkg, module_name="sglang.srt.lora", is_package=True) == [(2, "GL201")]


def test_definition_in_the_targets_own_module_is_the_target():
    src = "class LoRABatchInfo:\n    pass\n\nLoRABatchInfo(bs=1)\n"
    assert codes(src, module_name="sglang.srt.lora.utils") == [(4, "GL201")]
    assert codes(src, module_name="mypkg.utils") == []


# -- instances --------------------------------------------------------------------------------------
def test_instance_stored_on_self_in_one_method_and_called_in_another():
    src = VISION + """
class Block:
    def __init__(self):
        self.attn = VisionFlashInferAttention()
        self.other = make()

    def forward(self, q, k, v, cu):
        a = self.attn(q, k, v, cu, 1, 8)
        b = self.attn.forward(q, k, v, cu, 1, 8, max_seqlen=8)
        c = self.other(q, k, v, cu, 1, 8)
        d = self.attn.extra_repr()
        return a, b, c, d
"""
    assert codes(src) == [(9, "GL101"), (9, "GL102"), (10, "GL101")]


def test_instance_of_another_class_is_separate():
    src = VISION + """
class A:
    def __init__(self):
        self.attn = VisionFlashInferAttention()

class B:
    def forward(self, q, k, v, cu):
        return self.attn(q, k, v, cu, 1, 8)
"""
    assert codes(src) == []


def test_local_instance_direct_and_forward_and_in_nested_scopes():
    src = VISION + """
def run(q, k, v, cu, meta):
    attn = VisionFlashInferAttention()
    attn(q, k, v, cu, 1, 8, forward_metadata=meta)
    attn.forward(q, k, v, cu, 1, 8)
    f = lambda: attn(q, k, v, cu, 1, 8, sequence_lengths=s, max_seqlen=m)
    g = [attn(x, x, x, cu, 1, 8) for x in q]
    return VisionFlashInferAttention()(q, k, v, cu, 1, 8, None, meta)
"""
    assert codes(src) == [(6, "GL101"), (6, "GL102"), (8, "GL101"), (8, "GL102")]


def test_constructing_an_instance_target_is_not_a_call_of_it():
    assert codes(VISION + "attn = VisionFlashInferAttention(num_heads=16)\n") == []


# -- argument binding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("args, expected", [
    ("q, k, v, cu, 1, 8, 0.1, meta", []),  # forward_metadata is the 8th parameter
    ("q, k, v, cu, 1, 8, forward_metadata=meta", []),
    ("q, k, v, cu, 1, 8, sequence_lengths=s, max_seqlen=m", []),
    ("q, k, v, cu, 1, 8, sequence_lengths=s", ["GL102"]),
    ("q, k, v, cu, 1, 8, max_seqlen=m", ["GL101"]),
    ("q, k, v, cu, 1, 8, None, None", ["GL101", "GL102"]),
    ("q, k, v, cu, 1, 8, forward_metadata=None", ["GL101", "GL102"]),
    ("q, k, v, cu, 1, 8, sequence_lengths=None, max_seqlen=m", ["GL101"]),
    ("q, k, v, cu, 1, 8, sequence_lengths=s if s is not None else None, max_seqlen=m", []),
    ("q, k, v, cu, 1, 8, 0.1, None, meta", ["GL101", "GL102"]),  # past the parameter list: not bound
])
def test_binding_by_keyword_and_position(args, expected):
    got = [c for _, c in codes(f"{CUDNN}cudnn_vision_attention({args})\n")]
    assert got == expected


def test_message_names_what_is_missing_and_none_values():
    (f101, f102) = lint(f"{CUDNN}cudnn_vision_attention(q, k, v, cu, 1, 8, forward_metadata=None)\n")
    assert f101.message == "cudnn_vision_attention(...) passes forward_metadata=None and no sequence_lengths"
    assert f102.message == "cudnn_vision_attention(...) passes forward_metadata=None and no max_seqlen"
    # The kernel's own words and every way out are in the note.
    assert f101.note.splitlines() == ["sequence_lengths should be prepared for vision flashinfer_cudnn attention "
                                      "backend.", "It takes forward_metadata or sequence_lengths (not None)."]
    assert f102.note.startswith("max_seqlen should be prepared")
    assert (f101.name, f101.severity) == ("missing-sequence-lengths", "error")


def test_multiline_and_nested_calls():
    src = CUDNN + """
out = wrap(
    cudnn_vision_attention(
        q,
        k, v,
        cu, 1, 8,
        max_seqlen=8,
    ),
    cudnn_vision_attention(q, k, v, cu, 1, 8, sequence_lengths=s, max_seqlen=8),
)
"""
    (f,) = lint(src)
    assert (f.code, f.line, f.column, f.end_line, f.end_column) == ("GL101", 4, 5, 9, 6)


def test_splats_are_unknown_unless_strict():
    src = CUDNN + "cudnn_vision_attention(*args)\ncudnn_vision_attention(q, **kw)\n" \
                  "cudnn_vision_attention(q, k, v, cu, 1, 8, forward_metadata=m, **kw)\n"
    assert codes(src) == []
    strict = lint(src, strict=True)
    assert sorted((f.line, f.code) for f in strict) == [(2, "GL101"), (2, "GL102"), (3, "GL101"), (3, "GL102")]
    assert all("could not be checked" in f.message and f.severity == "warning" for f in strict)
    assert "*args" in strict[0].message and "**kwargs" in strict[2].message


def test_new_call_contract_needs_no_lint_code():
    contract = contract_from_config({"call": "mylib.ops.fwd", "params": ["x", "lens", "max_len"],
                                     "require": [["max_len"]], "code": "GL950"})
    rules = build_rules([contract])
    src = "from mylib.ops import fwd\nfwd(x, lens)\nfwd(x, lens, 4)\nfwd(x, lens, max_len=None)\n"
    assert codes(src, rules=rules) == [(2, "GL950"), (4, "GL950")]


def test_new_value_and_positional_contracts_need_no_lint_code():
    diag = Diagnosis("bad", "m", "w", ())
    value = Contract("GL960", "no-zero-blocks", "s", "value", diag, targets=(Target("mylib.K", "class"),),
                     params=("blocks",), forbidden_values=(("blocks", "0"),))
    positional = Contract("GL961", "keywords-only", "s", "positional", diag, targets=(Target("mylib.K", "class"),))
    rules = build_rules([value, positional])
    src = "import mylib\nmylib.K(0)\nmylib.K(blocks=0x0)\nmylib.K(blocks=0.0)\nmylib.K(blocks=False)\n"
    assert codes(src, rules=rules) == [(2, "GL960"), (2, "GL961"), (3, "GL960")]


# -- GL201 specifics --------------------------------------------------------------------------------------
def test_gl201_satisfied_by_later_non_none_store_on_the_same_variable():
    src = LORA + """
def a(p):
    info = LoRABatchInfo(bs=1, seg_indptr=p)
    info.seg_lens = p[1:] - p[:-1]
    return info

def b(p):
    info = LoRABatchInfo(bs=1, seg_indptr=p)
    info.max_len = None
    other.max_len = 4
    return info

def c(p, info):
    info.max_len = 4
    info = LoRABatchInfo(bs=1, seg_indptr=p)
    return info

def d(p):
    self.info = LoRABatchInfo(bs=1, seg_indptr=p)
    self.info.max_len = 4

def e(p):
    info = LoRABatchInfo(bs=1, seg_indptr=p)
    def later():
        info.max_len = 4
    return info
"""
    assert codes(src) == [(9, "GL201"), (16, "GL201"), (24, "GL201")]


def test_gl201_dataclasses_replace_in_all_spellings():
    src = """
import dataclasses
import dataclasses as dc
from dataclasses import replace
from dataclasses import replace as rep

dataclasses.replace(info, max_len=None, seg_lens=None)
dc.replace(info, seg_lens=None, max_len=None)
replace(info, max_len=None, seg_lens=None)
rep(info, max_len=None, seg_lens=None, bs=2)
replace(info, max_len=None)
replace(info, max_len=None, seg_lens=lens)
replace(info, **changes)
other.replace(info, max_len=None, seg_lens=None)
"""
    got = lint(src)
    assert [(f.line, f.code) for f in got] == [(7, "GL201"), (8, "GL201"), (9, "GL201"), (10, "GL201")]
    assert got[0].message.endswith("replace(...) sets max_len=None and seg_lens=None")


# -- GL104 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("owner", ["VisionBlock", "DecoderLayer", "Qwen2VisionAttention", "MLPBLOCK", "attention"])
def test_gl104_in_forward_of_per_layer_classes(owner):
    src = f"""
class {owner}:
    def forward(self, x, cu_seqlens):
        m = int(cu_seqlens.max())
        n = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
        lens = seq_lens.tolist()
        return x
"""
    assert codes(src) == [(4, "GL104"), (5, "GL104"), (6, "GL104")]


def test_gl104_not_in_other_places():
    src = """
class VisionTransformer:
    def forward(self, x, cu_seqlens):
        m = int(cu_seqlens.max())
        for blk in self.blocks:
            x = blk(x, m)
        return x

class VisionBlock:
    def __init__(self, cu_seqlens):
        self.m = cu_seqlens.max().item()

    def forward(self, x, seq_lens_cpu, other):
        a = seq_lens_cpu.tolist()
        b = other.max().item()
        c = int(len(x))
        return x.item()

for batch in loader:
    batch.seq_lens.tolist()
"""
    assert codes(src) == []


@pytest.mark.parametrize("loop", ["self.blocks", "layers", "self.layers", "enumerate(self.blocks)",
                                  "range(self.num_layers)", "zip(self.vision_blocks, caches)", "self.layers[:n]"])
def test_gl104_in_loops_over_layers(loop):
    src = f"""
def encode(self, x, cu_seqlens, seg_indptr):
    for item in {loop}:
        x = item(x, cu_seqlens[-1].item())
        y = int((seg_indptr[1:] - seg_indptr[:-1]).max())
    return x
"""
    f = lint(src)
    assert [(x.line, x.code) for x in f] == [(4, "GL104"), (5, "GL104")]
    assert f[0].severity == "warning" and "inside a loop over" in f[0].message


def test_gl104_reports_the_outermost_read_once():
    src = "class VisionBlock:\n    def forward(self, cu_seqlens):\n        return int(cu_seqlens.max().item())\n"
    (f,) = lint(src)
    assert f.column == 20
    assert f.message == "host sync per layer: .item() on cu_seqlens inside VisionBlock.forward"


# -- the guard ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("decorator, imports", [
    ('@guard("GL101")', "from guardlint.guard import guard"),
    ("@guard", "from guardlint.guard import guard"),
    ('@guardlint.guard.guard("GL101")', "import guardlint.guard"),
    ('@g.guard("GL101")', "import guardlint.guard as g"),
    ("@guard_varlen", "from guardlint.guard.decorators import guard_varlen"),
])
def test_calls_inside_a_guarded_function_are_satisfied(decorator, imports):
    src = f"{imports}\n{CUDNN}\n{decorator}\ndef f(q, k, v, cu):\n    return cudnn_vision_attention(q, k, v, cu, 1, 8)\n"
    assert codes(src) == []


def test_a_decorator_from_elsewhere_is_not_the_guard():
    src = f"from mylib import guard\n{CUDNN}\n@guard\ndef f(q, k, v, cu):\n    return cudnn_vision_attention(q, k, v, cu, 1, 8)\n"
    assert len(codes(src)) == 2


def test_guard_does_not_excuse_positional_or_value_contracts():
    src = "from guardlint.guard import guard\n" + LORA + \
          "@guard\ndef f(p):\n    return LoRABatchInfo(False, 1, max_len=0)\n"
    assert [c for _, c in codes(src)] == ["GL202", "GL203"]


# -- suppressions -----------------------------------------------------------------------------------------
def test_suppression_on_first_or_last_line_of_a_multiline_call():
    src = LORA + "a = LoRABatchInfo(  # noqa: GL201\n    bs=1,\n)\nb = LoRABatchInfo(\n    bs=1,\n)  # noqa\n" \
                 "c = LoRABatchInfo(\n    bs=1,  # noqa\n)\n"
    assert codes(src) == [(8, "GL201")]


def test_suppression_text_inside_a_string_does_not_suppress():
    src = LORA + 'x = LoRABatchInfo(bs=1, name="# noqa")\ny = """\n# guardlint: ignore\n"""; LoRABatchInfo(bs=1)\n'
    assert codes(src) == [(2, "GL201"), (5, "GL201")]


# -- positions, encodings, file-level problems -----------------------------------------------------------------
def test_columns_count_characters_not_bytes():
    src = CUDNN + 'é = "ééé"; cudnn_vision_attention(q, k, v, cu, 1, 8, max_seqlen=1)\n'
    (f,) = lint(src)
    assert (f.line, f.column, f.end_column) == (2, 12, 12 + len("cudnn_vision_attention(q, k, v, cu, 1, 8, max_seqlen=1)"))


def test_positions_fallback_matches_cpython_positions(monkeypatch):
    src = (CUDNN + textwrap.dedent("""
        x = [f(cudnn_vision_attention(q, k, v, cu, 1, 8)) for _ in y]
        é = g(h(1))(cudnn_vision_attention(
            q, k, v, cu, 1, 8, max_seqlen=3))
        """)).encode()
    fast = check_source(src, "a.py", RULES).findings
    monkeypatch.setattr(engine, "_positions_from_ast", lambda *a: None)
    slow = check_source(src, "a.py", RULES).findings
    assert fast == slow and len(fast) == 3


def test_syntax_error_is_gl000_with_cpythons_message():
    (f,) = lint(LORA + "x = LoRABatchInfo(bs=1\n")
    assert (f.code, f.line, f.name) == ("GL000", 2, "parse-error")
    assert "was never closed" in f.message


@pytest.mark.parametrize("data, words", [
    (b"# LoRABatchInfo\nx = '\xff\xfe'\n", "decode"),
    (b"# -*- coding: bogus -*-\nLoRABatchInfo(bs=1)\n", "bogus"),
    (b"LoRABatchInfo(bs=1)\x00\n", "null"),
    (b"LoRABatchInfo(" + b"[" * 5000 + b"]" * 5000 + b")\n", "nested"),
    (b"LoRABatchInfo(" + b"-" * 20000 + b"1)\n", ""),
    (b"x = LoRABatchInfo" + b".a" * 3000 + b"\n", ""),
])
def test_file_problems_become_gl000_and_never_crash(data, words):
    findings = check_source(data, "bad.py", RULES).findings
    assert [f.code for f in findings] == ["GL000"]
    assert words in findings[0].message.lower()


def test_empty_file_and_only_comments():
    assert lint("") == [] and lint("# LoRABatchInfo(bs=1)\n") == []


# -- the walker and the pre-filter -------------------------------------------------------------------------
class _Order:
    def __init__(self):
        self.seen = []

    def on_visit(self, node):
        if isinstance(node, (cst.Call, cst.Name)):
            self.seen.append(node)
        return True

    def on_leave(self, node):
        pass


def test_walker_visits_in_libcsts_source_order():
    for path in sorted(FIXTURES.rglob("*.py")):
        try:
            module = cst.parse_module(path.read_bytes())
        except cst.ParserSyntaxError:
            continue
        reference = type("Ref", (_Order, cst.CSTVisitor), {})()
        module.visit(reference)
        ours = _Order()
        ours.visit_Call = ours.visit_Name = lambda node, o=ours: o.seen.append(node)
        Walker([ours]).walk(module)
        assert [id(n) for n in ours.seen] == [id(n) for n in reference.seen], path.name


def test_walker_order_on_tricky_syntax():
    src = textwrap.dedent("""
        @d1(a1())
        def f(p=d2(), *args: t1(), k: t2() = d3(), **kw) -> r():
            return (lambda x=d4(): b1())(c1() if c2() else c3())
        class C(b2(), metaclass=m()):
            x: a2() = a3()
        try:
            e1()
        except e2() as e:
            e3()
        y = {k(): v() for k in z()}[s1():s2():s3()]
        print(f"{q(1)!r:{w()}}")
        """)
    module = cst.parse_module(src)
    reference = type("Ref", (_Order, cst.CSTVisitor), {})()
    module.visit(reference)
    ours = _Order()
    ours.visit_Call = ours.visit_Name = lambda node, o=ours: o.seen.append(node)
    Walker([ours]).walk(module)
    assert [id(n) for n in ours.seen] == [id(n) for n in reference.seen]
    assert len(engine._positions_from_ast(module, ast.parse(src), [n for n in ours.seen if isinstance(n, cst.Call)],
                                          [], src.encode())) == 0


def test_prefilter_skips_files_that_cannot_match():
    assert not RULES.may_match(b"import torch\nx = torch.zeros(3).max().item()\n")
    assert RULES.may_match(b"from x import LoRABatchInfo\n")
    # GL104 needs a metadata name, a host read, and a per-layer place.
    assert not RULES.may_match(b"def f(cu_seqlens):\n    return cu_seqlens + 1\n")
    assert not RULES.may_match(b"def f(cu_seqlens):\n    return cu_seqlens.tolist()\n")
    assert RULES.may_match(b"class Block:\n    def forward(self, cu_seqlens):\n        return cu_seqlens.tolist()\n")
    assert RULES.may_match(b"for l in layers:\n    int(seq_lens.max())\n")


def test_every_pattern_contract_has_a_visitor():
    from guardlint.contracts import all_contracts
    from guardlint.lint.patterns import PATTERNS

    for c in all_contracts():
        if c.kind == "pattern":
            assert c.code in PATTERNS
            engine._pattern_visitor(c, lambda *a: None)


def test_an_internal_error_is_reported_for_the_file_not_raised(monkeypatch):
    def broken(*args, **kwargs):
        raise AttributeError("boom")

    monkeypatch.setattr(engine.Checker, "run", broken)
    (f,) = lint(LORA + "LoRABatchInfo(bs=1)\n")
    assert f.code == "GL000" and "internal error" in f.message and "boom" in f.message


def test_modules_and_nodes_are_kept_for_a_fixer(tmp_path):
    from guardlint.lint import lint_paths
    from guardlint.lint.config import Settings

    (tmp_path / "m.py").write_text(LORA + "info = LoRABatchInfo(bs=1)\n")
    report = lint_paths([str(tmp_path)], Settings(root=tmp_path), keep_modules=True)
    (result,) = report.results
    (finding,) = result.findings
    assert isinstance(result.module, cst.Module) and len(result.nodes) == 1
    assert result.module.code_for_node(result.nodes[0]) == "LoRABatchInfo(bs=1)"
    assert finding.fix is None


def test_vllm_mm_encoder_attention_imported_from_its_package_is_checked():
    """vLLM's models import MMEncoderAttention from vllm.model_executor.layers.attention (a re-export)."""
    from guardlint.lint import lint_source

    source = ("from vllm.model_executor.layers.attention import MMEncoderAttention\n\n\n"
              "class VisionAttention:\n    def __init__(self):\n        self.attn = MMEncoderAttention(16, 80)\n\n"
              "    def forward(self, q, k, v, cu_seqlens, max_seqlen):\n"
              "        return self.attn(query=q, key=k, value=v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)\n")
    (finding,) = lint_source(source, "m.py")
    assert finding.code == "GL101"
    # In vLLM's words, and only the argument vLLM's forward takes (it has no forward_metadata).
    assert finding.note.startswith("MMEncoderAttention on the FlashInfer cuDNN encoder backend asserts "
                                   "sequence_lengths is not None.")
    assert finding.message.startswith("MMEncoderAttention(...) without sequence_lengths; no fix: ")
    assert "forward_metadata" not in finding.message + finding.note
    fine = source.replace("max_seqlen=max_seqlen)", "max_seqlen=max_seqlen, sequence_lengths=s)")
    assert lint_source(fine, "m.py") == []
