"""Generated call sites against an oracle that decides from the generated structure alone.

Hypothesis builds a call of a contract target (import aliases, instances, ``.forward``), with
arguments by position and by keyword in any order, ``None`` and ``0`` values, calls as values,
``*args`` / ``**kwargs``, placed at module level, in a function, inside another call, a comprehension
or a lambda. The oracle applies the contracts' rules to that structure (None counts as missing; a
splat makes a call unknown; positions bind by ``params``) and must agree with the linter exactly; the
fix must then remove every finding it is offered for, leave a parsing file, and be idempotent.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings, strategies as st

from guardlint.contracts import LORA_FIELDS, VISION_PARAMS, get
from guardlint.lint import build_rules, check_source, fixed_source

RULES = build_rules()
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# How each target is imported and called: (import lines, callee, params, keyword-only extras, codes).
TARGETS = {
    "cudnn": ("from guardlint.kernels import cudnn_vision_attention\n", "cudnn_vision_attention"),
    "cudnn_alias": ("from guardlint.kernels import cudnn_vision_attention as attend\n", "attend"),
    "cudnn_module": ("import guardlint.kernels as gk\n", "gk.cudnn_vision_attention"),
    "cudnn_submodule": ("from guardlint.kernels.attention import cudnn_vision_attention as cva\n", "cva"),
    "vision_instance": ("from sglang.srt.layers.attention.vision import VisionFlashInferAttention as VFA\n"
                        "attn = VFA()\n", "attn"),
    "vision_forward": ("from sglang.srt.layers.attention.vision import VisionFlashInferAttention\n"
                       "attn = VisionFlashInferAttention()\n", "attn.forward"),
    "lora": ("from sglang.srt.lora.utils import LoRABatchInfo\n", "LoRABatchInfo"),
    "lora_alias": ("from sglang.srt.lora.utils import LoRABatchInfo as Info\n", "Info"),
    "lora_module": ("import sglang.srt.lora.utils as lora_utils\n", "lora_utils.LoRABatchInfo"),
    "ours_lora": ("from guardlint.kernels import LoRABatchInfo as OurInfo\n", "OurInfo"),
    "not_a_target": ("def cudnn_vision_attention(*args, **kwargs):\n    return args\n", "cudnn_vision_attention"),
}
VISION_CODES = ("GL101", "GL102")
LORA_CODES = ("GL201", "GL202", "GL203")
WRAPPERS = {
    "statement": "out = {call}\n",
    "function": "def run(q, k, v):\n    return {call}\n",
    "inside_call": "out = wrap(0, key={call})\n",
    "comprehension": "outs = [{call} for _ in range(2)]\n",
    "lambda": "later = lambda: {call}\n",
    "nested_lambda_in_call": "out = wrap(lambda *a: {call})\n",
}


@dataclass(frozen=True)
class Site:
    target: str
    positional: tuple[tuple[str, str], ...]  # (parameter it binds, value kind) in order
    keywords: tuple[tuple[str, str], ...]
    star: bool
    double_star: bool
    wrapper: str

    def kind(self) -> str:
        return "lora" if "lora" in self.target or "Info" in TARGETS[self.target][1] else "vision"

    def value(self, name: str, kind: str) -> str:
        return {"name": name, "none": "None", "zero": "0", "call": f"make_{name}()",
                "attr": f"batch.{name}"}[kind]

    def source(self) -> str:
        imports, callee = TARGETS[self.target]
        args = [self.value(n, k) for n, k in self.positional]
        if self.star:
            args.append("*extra")
        args += [f"{n}={self.value(n, k)}" for n, k in self.keywords]
        if self.double_star:
            args.append("**options")
        call = f"{callee}({', '.join(args)})"
        return imports + "\n" + WRAPPERS[self.wrapper].format(call=call)


def _sites():
    values = st.sampled_from(["name", "none", "call", "attr"])

    @st.composite
    def build(draw):
        target = draw(st.sampled_from(sorted(TARGETS)))
        lora = target in ("lora", "lora_alias", "lora_module", "ours_lora")
        # guardlint's own LoRABatchInfo keeps the engine's first ten fields.
        params = LORA_FIELDS[:10] if target == "ours_lora" else LORA_FIELDS if lora else VISION_PARAMS
        extras = () if lora else ("sequence_lengths", "max_seqlen")
        n_pos = draw(st.integers(0, len(params)))
        positional = tuple((p, draw(st.sampled_from(["name", "none", "call", "attr", "zero"]) if p == "max_len"
                                    else values)) for p in params[:n_pos])
        rest = [p for p in (*params[n_pos:], *extras)]
        chosen = draw(st.lists(st.sampled_from(rest), unique=True, max_size=len(rest))) if rest else []
        keywords = tuple((n, draw(st.sampled_from(["name", "none", "call", "attr", "zero"]) if n == "max_len"
                                  else values)) for n in chosen)
        return Site(target, positional, keywords, draw(st.booleans()) and draw(st.booleans()),
                    draw(st.booleans()) and draw(st.booleans()), draw(st.sampled_from(sorted(WRAPPERS))))

    return build()


def oracle(site: Site) -> set[str]:
    """The codes the contracts demand for this call, from its structure."""
    if site.target == "not_a_target":
        return set()
    codes = LORA_CODES if site.kind() == "lora" else VISION_CODES
    bound = dict(site.positional) | dict(site.keywords)
    present = {n for n, k in bound.items() if k != "none"}
    out = set()
    for code in codes:
        c = get(code)
        if c.kind == "call":
            if not (site.star or site.double_star) and not any(all(n in present for n in g) for g in c.require):
                out.add(code)
        elif c.kind == "positional":
            if site.positional:
                out.add(code)
        elif c.kind == "value":
            for name, literal in c.forbidden_values:
                if literal == "0" and bound.get(name) == "zero":
                    out.add(code)
    return out


def fixable(site: Site, code: str) -> bool:
    """Whether the oracle expects a fix for ``code`` here: no splat, and the derivation's sources
    passed as names or attribute chains (never re-evaluating a call)."""
    bound = dict(site.positional) | dict(site.keywords)
    if site.star or site.double_star:
        return False
    if get(code).kind == "positional":
        return True
    sources = {"GL101": ("cu_seqlens", "q"), "GL102": ("cu_seqlens", "q"), "GL201": ("seg_indptr",)}[code]
    return all(bound.get(s) in ("name", "attr") for s in sources)


@SETTINGS
@given(_sites())
def test_findings_equal_the_oracle(site):
    src = site.source()
    findings = check_source(src.encode(), "gen.py", RULES).findings
    assert {f.code for f in findings} == oracle(site), src
    # One finding per code, on the line of the call.
    assert len(findings) == len({f.code for f in findings}), src


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_sites())
def test_fixes_remove_what_they_are_offered_for(site):
    src = site.source()
    findings = check_source(src.encode(), "gen.py", RULES).findings
    for f in findings:
        if f.code in ("GL101", "GL102", "GL201", "GL202"):
            assert (f.fix is not None) == fixable(site, f.code), (f.message, src)
            if f.fix is None and not (site.star or site.double_star):
                assert "; no fix: " in f.message or "; no fix (same call as " in f.message, src
    out = fixed_source(src, "gen.py", unsafe_fixes=True)
    ast.parse(out)
    assert fixed_source(out, "gen.py", unsafe_fixes=True) == out, out
    left = {f.code for f in check_source(out.encode(), "gen.py", RULES).findings}
    offered = {f.code for f in findings if f.fix is not None}
    # GL202's fix names the arguments; what they bind does not change, so GL201/GL203 stay as they were.
    assert not left & offered, (src, out)
    assert left <= {f.code for f in findings}, (src, out)
