"""``guardlint diagnose`` on every shape the engines raise GL101, GL102 and GL201 in (the message alone, an
assert line alone, a frame, a whole traceback from sglang or vLLM), the advice of that engine only, no
paragraph twice, and JSON that says what the text says."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint.contracts import all_contracts, get
from guardlint.contracts.catalog import SGLANG_CUDNN_FIX, VLLM_CUDNN_FIX
from guardlint.lint.cli import main
from guardlint.lint.diagnose import diagnose

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "diagnose"
SAMPLE = (ROOT / "examples" / "traceback.txt").read_text()
VLLM_TB = (FIXTURES / "vllm_qwen2vl_gl101_bare_assert.txt").read_text()
SGLANG_INT_NONE = (FIXTURES / "sglang_vit_gl102_int_none.txt").read_text()
SGLANG_CDIV = (FIXTURES / "sglang_lora_gl201_cdiv_none.log").read_text()

SITE = "/usr/local/lib/python3.12/dist-packages"
VLLM_WRAPPER = f"{SITE}/vllm/v1/attention/ops/vit_attn_wrappers.py"
TRITON = f"{SITE}/triton/__init__.py"
SEQ_LENS_MSG = "sequence_lengths should be prepared for vision flashinfer_cudnn attention backend"
MAX_SEQLEN_MSG = "max_seqlen should be prepared for vision flashinfer_cudnn attention backend"
LORA_MSG = "ValueError: LoRA batch_info must provide max_len or seg_lens."
NONE_PLUS_INT = "TypeError: unsupported operand type(s) for +: 'NoneType' and 'int'"
ASSERT_SEQ = "assert sequence_lengths is not None"
ASSERT_MAX = "assert max_seqlen is not None"


def frame(file: str, line: int, function: str, source: str) -> str:
    return f'  File "{file}", line {line}, in {function}\n    {source}\n'


CDIV_FRAME = frame(TRITON, 69, "cdiv", "return (x + y - 1) // y")


def caller(source: str, file: str = "/srv/lora/launch.py") -> str:
    return frame(file, 151, "launch", source)


# (id, input, code, engine: whose advice the answer gives, None for the general advice)
SHAPES = [
    # GL101
    ("gl101-message", SEQ_LENS_MSG, "GL101", None),
    ("gl101-message-with-type", f"RuntimeError: {SEQ_LENS_MSG}", "GL101", None),
    ("gl101-sglang-message", "RuntimeError: sequence_lengths must be a torch.Tensor", "GL101", "sglang"),
    ("gl101-assert-alone", ASSERT_SEQ, "GL101", "vllm"),
    ("gl101-assert-and-exception", f"{ASSERT_SEQ}\nAssertionError", "GL101", "vllm"),
    ("gl101-assert-copied-from-a-traceback", f"    {ASSERT_SEQ}\nAssertionError", "GL101", "vllm"),
    ("gl101-assert-frame", frame(VLLM_WRAPPER, 364, "flashinfer_wrapper", ASSERT_SEQ) + "AssertionError",
     "GL101", "vllm"),
    ("gl101-assert-frame-of-a-fork", frame("/srv/fork/ops/vit.py", 40, "flashinfer_wrapper", ASSERT_SEQ)
     + "AssertionError", "GL101", "vllm"),
    ("gl101-assert-pytest", f"{VLLM_WRAPPER}:364: in flashinfer_wrapper\n    {ASSERT_SEQ}\nE   AssertionError",
     "GL101", "vllm"),
    ("gl101-traceback-sglang", SAMPLE, "GL101", "sglang"),
    ("gl101-traceback-vllm", VLLM_TB, "GL101", "vllm"),
    # GL102
    ("gl102-message", MAX_SEQLEN_MSG, "GL102", None),
    ("gl102-message-with-type", f"ValueError: {MAX_SEQLEN_MSG}", "GL102", None),
    ("gl102-assert-alone", ASSERT_MAX, "GL102", "vllm"),
    ("gl102-assert-and-exception", f"{ASSERT_MAX}\nAssertionError", "GL102", "vllm"),
    ("gl102-assert-frame", frame(VLLM_WRAPPER, 363, "flashinfer_wrapper", ASSERT_MAX) + "AssertionError",
     "GL102", "vllm"),
    ("gl102-traceback-sglang", SAMPLE.replace(f"ValueError: {SEQ_LENS_MSG}", f"RuntimeError: {MAX_SEQLEN_MSG}"),
     "GL102", "sglang"),
    ("gl102-traceback-sglang-int-none", SGLANG_INT_NONE, "GL102", "sglang"),
    ("gl102-traceback-vllm", VLLM_TB.replace(f"line 364, in flashinfer_wrapper\n    {ASSERT_SEQ}",
                                             f"line 363, in flashinfer_wrapper\n    {ASSERT_MAX}"), "GL102", "vllm"),
    # GL201
    ("gl201-message", LORA_MSG, "GL201", None),
    ("gl201-traceback-sglang", SGLANG_CDIV, "GL201", "sglang"),
    ("gl201-caller-triton-cdiv", caller("grid = (triton.cdiv(max_len, BLOCK_S), R)") + CDIV_FRAME + NONE_PLUS_INT,
     "GL201", "sglang"),
    ("gl201-caller-self-batch-info", caller("n = cdiv(self.batch_info.max_len, BLOCK_S)") + CDIV_FRAME
     + NONE_PLUS_INT, "GL201", "sglang"),
    ("gl201-caller-info", caller("triton.cdiv(info.max_len, BLOCK) * triton.cdiv(R, BLOCK_R),") + CDIV_FRAME
     + NONE_PLUS_INT, "GL201", "sglang"),
    ("gl201-caller-only", caller("triton.cdiv(info.max_len, BLOCK)") + NONE_PLUS_INT, "GL201", "sglang"),
    ("gl201-cdiv-frame-only", CDIV_FRAME + NONE_PLUS_INT, "GL201", "sglang"),
    ("gl201-exception-then-cdiv-frame", f"{NONE_PLUS_INT}\n{CDIV_FRAME}", "GL201", "sglang"),
    ("gl201-own-cdiv", frame("/srv/lora/util.py", 3, "cdiv", "return (a + b - 1) // b")
     + NONE_PLUS_INT, "GL201", "sglang"),
]
IDS = [s[0] for s in SHAPES]


def run(text: str, fmt: str = "text"):
    r = CliRunner().invoke(main, ["diagnose", "--format", fmt], input=text + "\n")
    assert r.exit_code in (0, 1), r.output
    return r.stdout


@pytest.mark.parametrize("name, text, code, engine", SHAPES, ids=IDS)
def test_diagnose_shape(name, text, code, engine):
    result = diagnose(text + "\n")
    assert (result.code, result.engine) == (code, engine)
    # Only cdiv without the line that called it leaves the caller's value open.
    assert (result.confirm is not None) == name.endswith(("cdiv-frame-only", "then-cdiv-frame", "own-cdiv"))
    assert run(text).startswith(f"{code} {get(code).name}: ")


def test_diagnose_cdiv_is_told_apart_by_its_caller():
    result = diagnose(SGLANG_CDIV)
    assert result.raised_at.source == "triton.cdiv(batch_info.max_len, BLOCK_S) * triton.cdiv(R, BLOCK_R),"
    bare = diagnose(CDIV_FRAME + NONE_PLUS_INT)
    assert bare.raised_at.function == "cdiv" and "if that line passes max_len" in bare.confirm
    assert "Possibly GL201: confirm it" in run(CDIV_FRAME + NONE_PLUS_INT)


# -- no over-match ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    NONE_PLUS_INT,
    frame("/srv/app/batch.py", 12, "pack", "total = offset + n") + NONE_PLUS_INT,
    frame("/srv/app/batch.py", 12, "pack", "total = max_len + n") + NONE_PLUS_INT,
    caller("grid = (triton.cdiv(num_tokens, BLOCK_M),)") + CDIV_FRAME + NONE_PLUS_INT,
    caller("grid = (triton.cdiv(max_len, BLOCK_S),)") + frame("/srv/lora/x.py", 9, "scale", "return s + 1")
    + NONE_PLUS_INT,
    CDIV_FRAME + "TypeError: unsupported operand type(s) for //: 'int' and 'NoneType'",
    "Traceback (most recent call last):\n" + CDIV_FRAME.replace("in cdiv", "in <module>") + NONE_PLUS_INT,
    "assert cu_seqlens is not None\nAssertionError",
    frame(VLLM_WRAPPER, 362, "flashinfer_wrapper", "assert cu_seqlens is not None") + "AssertionError",
    "AssertionError",
    # pytest --tb=long quotes the engine's function around the failing line: those lines are no evidence.
    "______________________________ test_vit ______________________________\n\n"
    "    def flashinfer_wrapper(q, k, v, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):\n"
    f"        {ASSERT_SEQ}\n>       q = q.view(-1, 16, 80)\nE       RuntimeError: shape '[-1, 16, 80]' is invalid\n\n"
    f"{VLLM_WRAPPER}:366: RuntimeError",
], ids=["message", "unrelated-frame", "max_len-without-cdiv", "cdiv-fed-from-other", "cdiv-caller-but-raised-deeper",
        "other-operator", "cdiv-named-frame-not-a-function", "assert-cu_seqlens", "assert-cu_seqlens-frame",
        "bare-assertion-error", "assert-quoted-by-pytest"])
def test_diagnose_does_not_overmatch(text):
    result = diagnose(text + "\n")
    assert result.code is None, (result.code, result.raised_at)
    assert run(text).startswith("No guardlint rule matches")


# -- the advice of the engine the error came from ------------------------------------------------------------
SGLANG_ONLY = ("prepare_flashinfer_cudnn_vision_attention_metadata", "prepare_vision_attention_metadata",
               "VisionAttention call", "In sglang", "prepare_lora_batch", "extend_seq_lens_cpu")
VLLM_ONLY = ("MMEncoderAttention", "maybe_compute_seq_lens", "compute_max_seqlen", "In vLLM")
GENERAL_ONLY = ("prepare_varlen_metadata", "@guard(", "guardlint.kernels")


def _flat(text: str) -> str:
    return " ".join(text.split())


def _section(text: str, title: str) -> str:
    m = re.search(rf"^{re.escape(title)}.*\n((?:  .*\n|\n(?=  ))*)", text, re.M)
    return _flat(m.group(1)) if m else ""


@pytest.mark.parametrize("name, text, code, engine", [s for s in SHAPES if s[3] == "vllm"],
                         ids=[s[0] for s in SHAPES if s[3] == "vllm"])
def test_diagnose_vllm_answer_has_vllm_advice_only(name, text, code, engine):
    out, data = run(text), json.loads(run(text, "json"))
    assert "Solutions (vLLM)" in out and _section(out, "Solutions") == f"- {VLLM_CUDNN_FIX}"
    assert "forward_metadata=" not in out and "forward_metadata" not in _section(out, "Solutions")
    for word in SGLANG_ONLY + GENERAL_ONLY:
        assert word not in _flat(out), word
        assert word not in json.dumps([data["fix"], data["solutions"], data["example"], data["summary"]]), word
    assert "forward_metadata" not in out.split("\n", 1)[0]  # the summary line is in vLLM's terms
    assert data["solutions"] == [VLLM_CUDNN_FIX] and data["fix"] == VLLM_CUDNN_FIX


@pytest.mark.parametrize("name, text, code, engine", [s for s in SHAPES if s[3] == "sglang"],
                         ids=[s[0] for s in SHAPES if s[3] == "sglang"])
def test_diagnose_sglang_answer_has_sglang_advice_only(name, text, code, engine):
    out, data = run(text), json.loads(run(text, "json"))
    assert "Solutions (sglang)" in out
    for word in VLLM_ONLY:
        assert word not in _flat(out), word
        assert word not in json.dumps(data), word
    sglang = [s for s in get(code).diagnosis.solutions if s.startswith("In sglang:")]
    assert data["solutions"] == sglang and _section(out, "Solutions") == " ".join(f"- {s}" for s in sglang)
    if code in ("GL101", "GL102"):
        assert "prepare_varlen_metadata" not in _section(out, "Solutions")
    # An example, where there is one, is the engine's own call, not guardlint's kernels.
    example = data["example"]
    assert example is None or ("from sglang." in example["bad"] and "guardlint" not in example["fixed"])
    assert (example is None) == ("Example fix" not in out)


@pytest.mark.parametrize("name, text, code, engine", [s for s in SHAPES if s[3] is None],
                         ids=[s[0] for s in SHAPES if s[3] is None])
def test_diagnose_unknown_engine_gets_the_general_advice_and_each_variant_once(name, text, code, engine):
    out = _flat(run(text))
    solutions = get(code).diagnosis.solutions
    assert "Solutions " not in out.replace("Solutions -", "")  # no engine in the title
    assert out.count("In sglang:") == 1
    assert out.count("In vLLM:") == (1 if VLLM_CUDNN_FIX in solutions else 0)
    for solution in solutions:
        assert out.count(solution) == 1, solution[:60]


# -- no paragraph twice -------------------------------------------------------------------------------------
def _also_inputs() -> list[str]:
    vllm_both = (frame(VLLM_WRAPPER, 363, "flashinfer_wrapper", ASSERT_MAX) + "AssertionError\n\n"
                 + frame(VLLM_WRAPPER, 364, "flashinfer_wrapper", ASSERT_SEQ) + "AssertionError")
    return [
        vllm_both,
        f"{ASSERT_SEQ}\nAssertionError\n\n{ASSERT_MAX}\nAssertionError",
        f"RuntimeError: {SEQ_LENS_MSG}\nRuntimeError: {MAX_SEQLEN_MSG}",
        "RuntimeError: sequence_lengths must be a torch.Tensor\nRuntimeError: packed indptr numel mismatch: got 3",
        SAMPLE + "\n" + SGLANG_INT_NONE,
        SGLANG_CDIV + "\n" + LORA_MSG,
    ]


FIXTURE_FILES = sorted(FIXTURES.iterdir())
REPEAT_INPUTS = ([s[1] for s in SHAPES] + _also_inputs() + [p.read_text(errors="replace") for p in FIXTURE_FILES])


def _paragraphs(text: str) -> list[str]:
    """Paragraphs of prose: blocks between blank lines, each bullet its own; code examples left out (a
    before/after pair shares its lines by design)."""
    prose = re.sub(r"^\s*```python\n.*?^\s*```\n", "", text, flags=re.S | re.M)
    out = []
    for block in re.split(r"\n\s*\n", prose):
        for part in re.split(r"\n\s*- ", "\n" + block):
            flat = _flat(part)
            if len(flat) >= 40:
                out.append(flat)
    return out


@pytest.mark.parametrize("text", REPEAT_INPUTS)
def test_diagnose_prints_no_paragraph_twice(text):
    out = run(text)
    paragraphs = _paragraphs(out)
    repeated = {p for p in paragraphs if paragraphs.count(p) > 1}
    assert not repeated, repeated
    flat = _flat(out)
    for contract in all_contracts():
        for solution in contract.diagnosis.solutions:
            assert flat.count(solution) <= 1, (contract.code, solution[:60])
    assert flat.count(_flat(SGLANG_CUDNN_FIX)) <= 1 and flat.count(_flat(VLLM_CUDNN_FIX)) <= 1


def test_diagnose_two_errors_of_one_engine_share_its_fix_once():
    out = run(_also_inputs()[0])
    assert "Also in the input" in out and "fix: as above" in out
    assert f"- GL102 (missing-max-seqlen): AssertionError: {ASSERT_MAX}" in out
    assert _flat(out).count(VLLM_CUDNN_FIX) == 1


# -- JSON says what the text says ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", REPEAT_INPUTS)
def test_diagnose_json_matches_the_text(text):
    out, data = run(text), json.loads(run(text, "json"))
    if data["code"] is None:
        assert out.startswith("No guardlint rule matches")
        return
    result = diagnose(text + "\n")
    assert out.startswith(f"{data['code']} {data['name']}: {data['summary']}\n")
    assert data["engine"] == result.engine
    assert data["solutions"] == list(result.solutions) == data["diagnosis"]["solutions"]
    assert data["fix"] == result.fix
    flat = _flat(out)
    for solution in data["solutions"]:
        assert solution in flat
    for solution in set(get(data["code"]).diagnosis.solutions) - set(data["solutions"]):
        assert solution not in flat, solution[:60]
    if data["example"] is None:
        assert "Example fix" not in out
    else:
        assert "Example fix" in out and data["example"]["bad"].splitlines()[-1].strip() in out
