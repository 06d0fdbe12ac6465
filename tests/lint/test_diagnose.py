"""``guardlint diagnose``: real-looking tracebacks in, the rule, the user's frame and the command out."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint.contracts import all_contracts, get
from guardlint.lint.cli import main
from guardlint.lint.diagnose import diagnose, run_diagnose

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "diagnose"
SAMPLE = ROOT / "examples" / "traceback.txt"


def invoke(*args, input=None):
    return CliRunner().invoke(main, ["diagnose", *args], input=input)


# -- every known error, as a realistic traceback ----------------------------------------------------------
# (fixture, code, user frame (file, line, function), start of the matched line, command)
CASES = [
    (SAMPLE, "GL101", ("/srv/app/models/qwen2_vision.py", 131, "forward"),
     "ValueError: sequence_lengths should be prepared", "guardlint --select GL101,GL102 /srv/app/models"),
    (FIXTURES / "scheduler_gl101.log", "GL101", ("/workspace/myvlm/myvlm/vision_tower.py", 97, "forward"),
     "RuntimeError: sequence_lengths should be prepared",
     "guardlint --select GL101,GL102 /workspace/myvlm/myvlm"),
    (FIXTURES / "pytest_long_gl102.txt", "GL102", ("models/qwen2_vision.py", 31, "forward"),
     "RuntimeError: max_seqlen should be prepared", "guardlint --select GL101,GL102 models"),
    (FIXTURES / "docker_gl201.log", "GL201", ("/opt/plugins/mla_lora/backend.py", 141, "run_kv_b_step_a"),
     "ValueError: LoRA batch_info must provide max_len or seg_lens.",
     "guardlint --select GL201 /opt/plugins/mla_lora"),
    (FIXTURES / "pytest_short_gl107_numel.txt", "GL107", ("vision/encoder.py", 77, "forward"),
     "RuntimeError: packed indptr numel mismatch: got 3, expected 24", None),
    (FIXTURES / "ipython_gl107_tensor.txt", "GL107", ("In[7]", 4, None),
     "RuntimeError: flashinfer_cudnn expects packed indptrs as a torch.Tensor", None),
    (FIXTURES / "capture_gl105_chained.txt", "GL105", ("/home/ml/vit-serve/vit_serve/vit.py", 97, "forward"),
     "torch.AcceleratorError: CUDA error: operation not permitted when stream is capturing",
     "guardlint --select GL104 /home/ml/vit-serve/vit_serve"),
    (FIXTURES / "triton_gl301_no_driver.txt", "GL301", ("/home/ml/lora-bench/bench_shrink.py", 33, "run_shrink"),
     "RuntimeError: 0 active drivers ([]).", "TRITON_INTERPRET=1 python /home/ml/lora-bench/bench_shrink.py"),
    (FIXTURES / "guard_gl103_strict.txt", "GL103", ("/home/ml/vit-demo/encode.py", 6, "encode"),
     "guardlint.guard.errors.GuardError: [GL103 invalid-varlen-metadata] varlen_attention(): argument "
     "'cu_seqlens'", "GUARDLINT_MODE=strict python /home/ml/vit-demo/encode.py"),
    (FIXTURES / "pytest_guard_gl201.txt", "GL201", ("mla_lora/backend.py", 141, "run_kv_b_step_a"),
     "guardlint.guard.errors.GuardError: [GL201 missing-max-len-and-seg-lens] step_a_q()",
     "guardlint --select GL201 mla_lora"),
]


@pytest.mark.parametrize("path, code, frame, message, command", CASES, ids=[c[0].name for c in CASES])
def test_diagnose_known_traceback(path, code, frame, message, command):
    result = diagnose(path.read_bytes())
    assert result.code == code
    assert (result.frame.file, result.frame.line, result.frame.function) == frame
    assert result.message.startswith(message)
    assert result.command == command
    assert result.matches[0] == code


@pytest.mark.parametrize("path, code, frame, message, command", CASES, ids=[c[0].name for c in CASES])
def test_diagnose_cli_json_for_each_fixture(path, code, frame, message, command):
    r = invoke(str(path), "--format", "json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["code"] == code and out["name"] == get(code).name
    assert out["frame"]["file"] == frame[0] and out["frame"]["line"] == frame[1]
    assert out["message"].startswith(message) and out["command"] == command


def test_diagnose_sample_traceback_text_has_every_section():
    r = invoke(str(SAMPLE))
    assert r.exit_code == 0
    out = r.stdout
    assert out.startswith("GL101 missing-sequence-lengths: ")
    assert "where: /srv/app/models/qwen2_vision.py:131, in forward" in out
    assert "attn_out = self.attn(q, k, v, cu_seqlens, bsz, seq_len)" in out
    for section in ("What it means", "When it happens", "Solutions", "Example fix", "before:", "after:",
                    "Find the same pattern elsewhere"):
        assert section in out, section
    # The traceback runs through sglang: its fix is the one solution, under the engine's name.
    from guardlint.contracts.catalog import SGLANG_CUDNN_FIX

    flat = " ".join(out.split())
    assert "Solutions (sglang)" in out and SGLANG_CUDNN_FIX in flat
    assert get("GL101").diagnosis.solutions[0][:60] not in flat
    assert "guardlint --select GL101,GL102 /srv/app/models" in out


def test_diagnose_engine_traceback_gets_the_engine_example():
    # The traceback runs through the engine: the example shown is the engine's call, not guardlint's kernel.
    out = json.loads(invoke(str(SAMPLE), "--format", "json").stdout)
    assert "sglang.srt.layers.attention.vision" in out["example"]["bad"]
    assert "# expect" not in out["example"]["bad"]
    # ... and its fix is the engine's own helper, with no guardlint import in the engine's file.
    fixed = out["example"]["fixed"]
    assert "forward_metadata=prepare_flashinfer_cudnn_vision_attention_metadata(" in fixed and "guardlint" not in fixed
    guard = json.loads(invoke(str(FIXTURES / "guard_gl103_strict.txt"), "--format", "json").stdout)
    assert guard["example"] is None  # GL103 has no code example; none is made up


# -- the messages alone ----------------------------------------------------------------------------------
ENGINE_MESSAGES = [
    ("sequence_lengths should be prepared for vision flashinfer_cudnn attention backend", "GL101"),
    ("RuntimeError: max_seqlen should be prepared for vision flashinfer_cudnn attention backend", "GL102"),
    ("ValueError: LoRA batch_info must provide max_len or seg_lens.", "GL201"),
    ("RuntimeError: packed indptr numel mismatch: got 5, expected 9 (= 3*(B+1))", "GL107"),
    ("flashinfer_cudnn expects packed indptrs as a torch.Tensor", "GL107"),
    ("torch.AcceleratorError: CUDA error: operation not permitted when stream is capturing", "GL105"),
    ("RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor "
     "is pinned", "GL105"),
    ("RuntimeError: 0 active drivers ([]). There should only be one.", "GL301"),
]


@pytest.mark.parametrize("message, code", ENGINE_MESSAGES)
def test_diagnose_bare_message(message, code):
    result = diagnose(message)
    assert result.code == code and result.frame is None
    assert result.message == message
    r = invoke(input=message + "\n")
    assert r.exit_code == 0 and r.stdout.startswith(f"{code} {get(code).name}: ")


# -- GuardError: every code the guard can raise is recognised by its code -----------------------------------
def _formatted_guard_error(code: str) -> str:
    import traceback

    from guardlint.guard.errors import GuardError

    def model_forward():
        raise GuardError(code, argument="cu_seqlens", expected="1-D integer prefix sums",
                         got="Tensor(shape=(3, 2), dtype=torch.float32 on cpu)", function="varlen_attention")

    try:
        model_forward()
    except GuardError as e:
        return "".join(traceback.format_exception(e))
    raise AssertionError("not raised")


@pytest.mark.parametrize("code", [c.code for c in all_contracts()])
def test_diagnose_every_guard_error_by_its_code(code):
    text = _formatted_guard_error(code)
    result = diagnose(text)
    assert result.code == code and result.evidence == "guard-error-code"
    assert result.frame.file == __file__ and result.frame.function == "model_forward"
    assert f"[{code} {get(code).name}]" in result.message
    # The error's own fix line is the fix; it is the contract's first solution unless the raiser gave one.
    assert result.fix == get(code).diagnosis.solutions[0]


def test_diagnose_guard_errors_own_fix_line_is_the_fix():
    from guardlint.guard.errors import GuardError

    message = str(GuardError("GL106", argument="backend", expected="a backend that runs head_dim=80",
                             got="'flashinfer'", function="varlen_attention", fix='Use backend="triton".'))
    result = diagnose(f"guardlint.guard.errors.GuardError: {message}\n")
    assert result.code == "GL106" and result.fix == 'Use backend="triton".'
    assert result.exception_type == "guardlint.guard.errors.GuardError"


def test_diagnose_guard_code_beats_another_rule_on_a_later_exception_line():
    inner = _formatted_guard_error("GL105")
    outer = ('Traceback (most recent call last):\n  File "/srv/app/vit.py", line 40, in forward\n'
             "    return self.attn(q, k, v, cu_seqlens, bsz, seq_len)\n"
             "RuntimeError: sequence_lengths should be prepared for vision flashinfer_cudnn attention backend\n")
    text = inner + "\nDuring handling of the above exception, another exception occurred:\n\n" + outer
    result = diagnose(text)
    assert result.code == "GL105" and result.matches[:2] == ("GL105", "GL101")


def test_diagnose_exception_line_beats_text_elsewhere():
    log = ("[2025-06-12 10:41:01 TP0] retrying after: max_seqlen should be prepared for vision flashinfer_cudnn "
           "attention backend\n"
           "Traceback (most recent call last):\n"
           '  File "/opt/plugins/mla_lora/backend.py", line 141, in run_kv_b_step_a\n'
           "    return step_a_q(x, weights, self.batch_info)\n"
           "ValueError: LoRA batch_info must provide max_len or seg_lens.\n")
    result = diagnose(log)
    assert result.code == "GL201" and result.evidence == "exception-line"
    assert result.matches == ("GL201", "GL102")


def test_diagnose_latest_exception_of_a_chain_wins():
    first = ('Traceback (most recent call last):\n  File "/srv/a.py", line 1, in f\n    g()\n'
             "RuntimeError: 0 active drivers ([]). There should only be one.\n")
    second = ('Traceback (most recent call last):\n  File "/srv/b.py", line 2, in h\n    f()\n'
              "ValueError: LoRA batch_info must provide max_len or seg_lens.\n")
    text = first + "\nThe above exception was the direct cause of the following exception:\n\n" + second
    result = diagnose(text)
    assert result.code == "GL201" and result.frame.file == "/srv/b.py"
    assert result.matches == ("GL201", "GL301")


def test_diagnose_engine_source_in_pytest_output_is_no_evidence():
    # pytest --tb=long quotes the engine's source, which spells out the GL101 message; the error is GL102.
    result = diagnose((FIXTURES / "pytest_long_gl102.txt").read_text())
    assert result.matches == ("GL102",)
    test_text = (FIXTURES / "pytest_guard_gl201.txt").read_text()
    assert "sequence_lengths should be prepared" in test_text
    assert diagnose(test_text).matches == ("GL201",)


def test_diagnose_host_read_in_user_code_is_a_hint_not_a_diagnosis():
    text = ('Traceback (most recent call last):\n  File "/srv/app/vit.py", line 97, in forward\n'
            "    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())\n"
            "torch.AcceleratorError: CUDA error: an out of memory error was encountered\n")
    result = diagnose(text)
    assert result.code is None and result.related == ("GL104",)
    assert result.command == "guardlint --select GL104 /srv/app"
    r = invoke(input=text)
    assert r.exit_code == 1 and "GL104 (per-layer-host-sync)" in r.stdout
    # The same host read in library code (the engine's own .item()) is not the user's to fix.
    engine = text.replace("/srv/app/vit.py", "/usr/lib/python3.12/site-packages/sglang/srt/layers/vit.py")
    assert diagnose(engine).related == () and diagnose(engine).command == "guardlint rules"
    # A host copy of lengths already on the host is no hint.
    assert diagnose(text.replace("int((cu_seqlens[1:] - cu_seqlens[:-1]).max())",
                                 "max(seq_lens_cpu.tolist())")).related == ()
    # An illegal memory access is a possible GL103; the host read stays a hint beside it.
    fault = diagnose(text.replace("an out of memory error", "an illegal memory access"))
    assert (fault.code, fault.related, fault.frame.line) == ("GL103", ("GL104",), 97)
    assert "CUDA_LAUNCH_BLOCKING=1" in fault.confirm and "GUARDLINT_MODE=strict" in fault.confirm


# -- the user's frame ------------------------------------------------------------------------------------
@pytest.mark.parametrize("file", [
    "/usr/local/lib/python3.12/site-packages/torch/nn/modules/module.py",
    "/usr/lib/python3/dist-packages/numpy/core/fromnumeric.py",
    "/home/u/triton/python/triton/runtime/jit.py",
    "/opt/flashinfer/flashinfer/prefill.py",
    "/home/u/src/sglang/python/sglang/srt/layers/attention/vision.py",
    "/usr/lib/python3.12/threading.py",
    "/opt/conda/lib/python3.11/concurrent/futures/thread.py",
    "<frozen importlib._bootstrap>",
    "<frozen runpy>",
    "/usr/lib/python3.12/importlib/__init__.py",
    "<guardlint wrapper of varlen_attention>",
    "/srv/venv/lib/python3.12/site-packages/guardlint/guard/ready.py",
    "/home/u/guardlint/kernels/attention/api.py",
    r"C:\Users\me\AppData\Local\Programs\Python\Python312\Lib\threading.py",
    r"C:\proj\.venv\Lib\site-packages\torch\nn\modules\module.py",
])
def test_library_frames_are_not_the_users(file):
    from guardlint.lint.diagnose import is_library_frame

    assert is_library_frame(file)


@pytest.mark.parametrize("file", [
    "/srv/app/models/qwen2_vision.py", "models/qwen2_vision.py", "<stdin>", "<string>", "In[3]",
    "<ipython-input-4-5d1f3c>", "/home/u/torch_utils/varlen.py", "/home/u/guardlint/examples/vit.py",
    r"C:\proj\vision\encoder.py",
])
def test_user_frames(file):
    from guardlint.lint.diagnose import is_library_frame

    assert not is_library_frame(file)


def test_this_checkouts_guardlint_sources_are_library_frames():
    # An editable install keeps guard/ and kernels/ outside site-packages.
    import importlib.util

    from guardlint.lint.diagnose import is_library_frame

    guard_dir = importlib.util.find_spec("guardlint.guard").submodule_search_locations[0]
    assert is_library_frame(str(Path(guard_dir) / "metadata.py"))
    assert not is_library_frame(str(ROOT / "examples" / "vit.py"))


def test_user_frame_is_the_innermost_outside_libraries():
    from guardlint.lint.diagnose import Frame, user_frame

    frames = [Frame("/srv/app/serve.py", 88, "<module>"), Frame("/srv/app/models/vit.py", 212, "forward"),
              Frame("/usr/lib/python3.12/site-packages/torch/nn/modules/module.py", 1775, "_call_impl"),
              Frame("/srv/app/models/vit.py", 131, "forward"),
              Frame("/usr/lib/python3.12/site-packages/sglang/srt/layers/attention/vision.py", 694, "forward")]
    assert user_frame(frames) is frames[3]
    assert user_frame(frames[2:3]) is None and user_frame([]) is None


def test_frame_from_windows_traceback_and_its_search_dir():
    text = ('Traceback (most recent call last):\n'
            '  File "C:\\proj\\vision\\encoder.py", line 77, in forward\n    x = self.attn(q, k, v, cu)\n'
            '  File "C:\\proj\\.venv\\Lib\\site-packages\\sglang\\srt\\layers\\attention\\vision.py", line 694, '
            'in forward\n    raise RuntimeError(\n'
            "RuntimeError: max_seqlen should be prepared for vision flashinfer_cudnn attention backend\r\n")
    result = diagnose(text.replace("\n", "\r\n"))
    assert (result.code, result.frame.file, result.frame.line) == ("GL102", "C:\\proj\\vision\\encoder.py", 77)
    assert result.command == "guardlint --select GL101,GL102 C:\\proj\\vision"


def test_search_dir_is_dot_without_a_file_frame():
    assert diagnose("sequence_lengths should be prepared for vision flashinfer_cudnn attention backend"
                    ).command == "guardlint --select GL101,GL102 ."
    stdin = ('Traceback (most recent call last):\n  File "<stdin>", line 1, in <module>\n'
             "ValueError: LoRA batch_info must provide max_len or seg_lens.\n")
    result = diagnose(stdin)
    assert result.frame.file == "<stdin>" and result.command == "guardlint --select GL201 ."
    spaced = stdin.replace("<stdin>", "/home/me/My Models/lora.py")
    assert diagnose(spaced).command == "guardlint --select GL201 '/home/me/My Models'"


# -- input forms -----------------------------------------------------------------------------------------
def test_diagnose_reads_stdin_without_argument_and_with_dash():
    text = SAMPLE.read_text()
    assert invoke(input=text).exit_code == 0
    r = invoke("-", "--format", "json", input=text)
    assert r.exit_code == 0 and json.loads(r.stdout)["code"] == "GL101"


def test_diagnose_missing_file_is_a_usage_error():
    r = invoke("/no/such/traceback.txt")
    assert r.exit_code == 2 and "no such file: '/no/such/traceback.txt'" in r.output


@pytest.mark.parametrize("prefix", [
    "2025-06-12T10:52:31.418207356Z ",                     # docker logs -t
    "2025-06-12T10:52:31.418207356+00:00 stderr F ",       # Kubernetes (CRI) container log
    "[2025-06-12 10:52:31 TP0] ",                          # the serving engine's logger
    "2025-06-12 10:52:31,418 ERROR ",                      # logging's default with a level
    "2025-06-12 10:52:31 | ERROR | ",                      # loguru-like
    "Jun 12 10:52:31 gpu-node-3 python[4242]: ",           # journald / syslog
])
def test_diagnose_log_lines_with_timestamps(prefix):
    lines = SAMPLE.read_text().splitlines()
    text = "\n".join(prefix + line for line in lines) + "\n"
    result = diagnose(text)
    assert result.code == "GL101"
    assert (result.frame.file, result.frame.line) == ("/srv/app/models/qwen2_vision.py", 131)
    assert result.frame.source == "attn_out = self.attn(q, k, v, cu_seqlens, bsz, seq_len)"
    assert result.message.startswith("ValueError: sequence_lengths")


def test_diagnose_logged_error_line_without_traceback():
    log = ("2025-06-12 10:52:30,001 INFO Prefill batch. #new-seq: 1\n"
           "2025-06-12 10:52:31,418 ERROR ValueError: LoRA batch_info must provide max_len or seg_lens.\n")
    result = diagnose(log)
    assert result.code == "GL201" and result.evidence == "exception-line"
    assert result.message == "ValueError: LoRA batch_info must provide max_len or seg_lens."
    assert result.exception_type == "ValueError"


def test_diagnose_per_line_prefix_seen_before_traceback():
    # docker compose: `service-1  | ` on every line, no timestamp
    text = "".join(f"vision-worker-1  | {line}\n" for line in SAMPLE.read_text().splitlines())
    result = diagnose(text)
    assert result.code == "GL101" and result.frame.line == 131


def test_diagnose_traceback_inside_a_json_log_line():
    windows = SAMPLE.read_text().replace("/srv/app/models/qwen2_vision.py", "C:\\srv\\new\\models\\vision.py")
    log = (json.dumps({"ts": "2025-06-12T10:41:06Z", "level": "info", "msg": "batch ok"}) + "\n"
           + json.dumps({"ts": "2025-06-12T10:41:07Z", "level": "error", "exc_info": windows}) + "\n")
    result = diagnose(log)
    assert result.code == "GL101" and result.evidence == "exception-line"
    assert (result.frame.file, result.frame.line) == ("C:\\srv\\new\\models\\vision.py", 131)
    assert result.frame.source == "attn_out = self.attn(q, k, v, cu_seqlens, bsz, seq_len)"


def test_diagnose_utf16_crlf_and_colours():
    text = SAMPLE.read_text()
    assert diagnose(text.encode("utf-16")).code == "GL101"  # PowerShell's `>` writes UTF-16 with a BOM
    assert diagnose(text.encode("utf-16-le")).code == "GL101"
    assert diagnose(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode()).frame.line == 131
    coloured = text.replace("ValueError:", "\x1b[1;31mValueError\x1b[0m:").replace('File "', '\x1b[35mFile "')
    assert diagnose(coloured).frame.line == 131


@pytest.mark.parametrize("data", [
    b"", b"\x00" * 1000, bytes(range(256)) * 40, b"\xff\xfe\xfd" * 999, "\ud800".encode("utf-8", "surrogatepass"),
    b"Traceback (most recent call last):\n" * 50, b'  File "x", line 99999999999999999999, in f\n' * 3,
    b"E" * 200_000, b"[" * 5000 + b"2025-06-12 10:52:31" * 500, b"_ " * 10000,
])
def test_garbage_does_not_crash(data):
    r = invoke(input=data)
    assert r.exit_code == 1 and (r.exception is None or isinstance(r.exception, SystemExit)), r.exception
    assert "No guardlint rule matches" in r.stdout
    out = json.loads(invoke("--format", "json", input=data).stdout)
    assert out["code"] is None and out["matches"] == []


def test_message_inside_binary_noise_is_still_found():
    data = bytes(range(256)) + b"\nValueError: LoRA batch_info must provide max_len or seg_lens.\n" + b"\xff" * 99
    assert diagnose(data).code == "GL201"


def test_diagnose_never_raises_on_arbitrary_text():
    from hypothesis import given, settings, strategies as st

    alphabet = st.sampled_from(list('Traceback (most recent call last):\n  File "x.py", line 3, in f\n'
                                    "E> _=:[]0GL1\x00\x1bsequence_lengths should be prepared"))

    @settings(max_examples=150, deadline=None)
    @given(st.one_of(st.text(alphabet), st.text(), st.binary()))
    def check(data):
        result = diagnose(data)
        assert result.code is None or result.code in {c.code for c in all_contracts()}
        json.loads(run_diagnose(data, fmt="json").stdout)

    check()


# -- JSON shape, exit codes --------------------------------------------------------------------------------
def test_json_shape():
    out = json.loads(invoke(str(FIXTURES / "capture_gl105_chained.txt"), "--format", "json").stdout)
    for key in ("code", "name", "message", "frame", "fix", "command", "matches"):
        assert key in out, key
    assert set(out["frame"]) >= {"file", "line", "function"}
    assert out["kind"] == "runtime" and out["matches"] == ["GL105", "GL104"] and out["related"] == ["GL104"]
    assert out["prevent"].startswith("GL105 is raised at runtime only")
    assert out["fix"] == get("GL105").diagnosis.solutions[0]
    assert out["diagnosis"]["what_it_means"] == get("GL105").diagnosis.what_it_means
    assert out["explain"] == "guardlint explain GL105"
    strict = json.loads(invoke(str(FIXTURES / "guard_gl103_strict.txt"), "--format", "json").stdout)
    assert strict["kind"] == "runtime" and strict["related"] == []
    assert strict["prevent"].endswith("run with GUARDLINT_MODE=strict: "
                                      "GUARDLINT_MODE=strict python /home/ml/vit-demo/encode.py")
    assert strict["fix"] == get("GL103").diagnosis.solutions[0]  # the error's own fix line
    assert strict["fix"].startswith("Build cu_seqlens as torch.cat(")


def test_no_match_exit_1_and_says_what_to_do():
    path = FIXTURES / "no_match_oom.txt"
    r = invoke(str(path))
    assert r.exit_code == 1
    assert "No guardlint rule matches this error." in r.stdout and "guardlint rules" in r.stdout
    assert "torch.OutOfMemoryError: CUDA out of memory" in r.stdout
    out = json.loads(invoke(str(path), "--format", "json").stdout)
    assert out["code"] is None and out["name"] is None and out["fix"] is None and out["matches"] == []
    assert out["command"] == "guardlint rules"
    assert out["frame"] == {"file": "/home/ml/vit-serve/vit_serve/vit.py", "line": 88, "function": "forward",
                            "source": "x = self.patch_embed(pixels)"}
    assert run_diagnose(path.read_bytes()).exit_code == 1


def test_unknown_guard_code_is_no_match():
    assert diagnose("GuardError: [GL999 something] f(): argument 'x': expected a, got b.").code is None


# -- start-up ----------------------------------------------------------------------------------------------
def test_diagnose_is_imported_lazily_and_listed_in_help():
    code = "import sys, guardlint.lint.cli; print('guardlint.lint.diagnose' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    r = CliRunner().invoke(main, ["--help"])
    assert "diagnose" in r.stdout
    assert "--format" in CliRunner().invoke(main, ["diagnose", "--help"]).stdout


# -- the engines' current errors (sglang 0.5.23, vLLM 0.33.0) ------------------------------------------------
ENGINES_DIR = ROOT / ".engines"
# (fixture, code, user frame (file, line), the engine frame that raised it, the fix's start)
ENGINE_CASES = [
    (FIXTURES / "sglang_vit_gl102_int_none.txt", "GL102",
     ("/sgl-workspace/sglang/python/sglang/srt/models/qwen2_5_vl.py", 282),
     ("/sgl-workspace/sglang/python/sglang/srt/layers/attention/vision.py", 697, "max_seqlen = int(max_seqlen)"),
     "In sglang: build the metadata once per forward"),
    (FIXTURES / "sglang_lora_gl201_cdiv_none.log", "GL201", ("/home/ml/lora-exp/lora_exp/replay.py", 73),
     ("/usr/local/lib/python3.12/dist-packages/sglang/kernels/ops/lora/dense/sgemm_lora_a.py", 151,
      "triton.cdiv(batch_info.max_len, BLOCK_S) * triton.cdiv(R, BLOCK_R),"),
     "In sglang: the Triton LoRA kernels size their grid with triton.cdiv(batch_info.max_len"),
    (FIXTURES / "vllm_qwen2vl_gl101_bare_assert.txt", "GL101",
     ("/workspace/vllm/vllm/model_executor/models/qwen2_vl.py", 380),
     ("/workspace/vllm/vllm/v1/attention/ops/vit_attn_wrappers.py", 364, "assert sequence_lengths is not None"),
     "In vLLM: once per forward"),
]


@pytest.mark.parametrize("path, code, where, raised, fix", ENGINE_CASES, ids=[c[0].name for c in ENGINE_CASES])
def test_diagnose_engine_error_without_a_rule_in_its_text(path, code, where, raised, fix):
    result = diagnose(path.read_bytes())
    assert result.code == code and result.evidence == "exception-line" and result.confirm is None
    assert (result.frame.file, result.frame.line) == where
    assert (result.raised_at.file, result.raised_at.line, result.raised_at.source) == raised
    assert result.fix.startswith(fix) and result.fix in get(code).diagnosis.solutions
    out = invoke(str(path)).stdout
    name = {"sglang": "sglang", "vllm": "vLLM"}[result.engine]
    assert f"where: {where[0]}:{where[1]}" in out and f"Solutions ({name})" in out


def test_diagnose_engine_fixes_name_the_engines_own_helpers():
    sglang = diagnose((FIXTURES / "sglang_vit_gl102_int_none.txt").read_text()).fix
    assert "prepare_flashinfer_cudnn_vision_attention_metadata(cu_seqlens, device, elem_per_token=H*D)" in sglang
    assert "forward_metadata=meta" in sglang
    vllm = diagnose((FIXTURES / "vllm_qwen2vl_gl101_bare_assert.txt").read_text()).fix
    assert "MMEncoderAttention.maybe_compute_seq_lens(" in vllm and "compute_max_seqlen(" in vllm
    assert "sequence_lengths=" in vllm and "max_seqlen=" in vllm


def test_diagnose_vllm_bare_assert_is_told_apart_by_its_source_line():
    text = (FIXTURES / "vllm_qwen2vl_gl101_bare_assert.txt").read_text()
    max_seqlen = text.replace("line 364, in flashinfer_wrapper\n    assert sequence_lengths is not None",
                              "line 363, in flashinfer_wrapper\n    assert max_seqlen is not None")
    result = diagnose(max_seqlen)
    assert (result.code, result.frame.line, result.raised_at.line) == ("GL102", 380, 363)
    assert result.fix.startswith("In vLLM:")
    # cu_seqlens missing has no rule of its own; an unrelated bare assert matches nothing.
    assert diagnose(text.replace("assert sequence_lengths is not None", "assert cu_seqlens is not None")).code is None
    assert diagnose(text.replace("assert sequence_lengths is not None", "assert q.is_contiguous()")).code is None
    # The line decides, not the file: a fork's copy of the wrapper raises the same assert.
    fork = diagnose(text.replace("vllm/v1/attention/ops/vit_attn_wrappers.py", "myvit/ops.py"))
    assert (fork.code, fork.raised_at.file, fork.engine) == ("GL101", "/workspace/vllm/myvit/ops.py", "vllm")


def test_diagnose_typeerror_on_none_needs_the_line_that_raised_it():
    text = (FIXTURES / "sglang_vit_gl102_int_none.txt").read_text()
    elsewhere = text.replace("max_seqlen = int(max_seqlen)", "n = int(n)")
    assert diagnose(elsewhere).code is None
    lora = (FIXTURES / "sglang_lora_gl201_cdiv_none.log").read_text()
    # The caller's line decides: cdiv fed from another value is another error, in whatever file.
    assert diagnose(lora.replace("cdiv(batch_info.max_len,", "cdiv(batch_info.num_tokens,")).code is None
    assert diagnose(lora.replace("sglang/kernels/ops/lora", "myproj/ops")).code == "GL201"


@pytest.mark.parametrize("message, code, fix", [
    ("RuntimeError: sequence_lengths must be a torch.Tensor", "GL101", "In sglang:"),
    ("RuntimeError: packed indptr numel mismatch: got 3, expected 27 (= 3*(B+1))", "GL107", "In sglang:"),
    ("RuntimeError: offset + len out of bounds; packed indptr is wrong", "GL103", "In sglang:"),
    ("RuntimeError: flashinfer_cudnn expects packed indptrs as a torch.Tensor", "GL107", "In sglang:"),
])
def test_diagnose_sglang_messages_get_the_sglang_fix(message, code, fix):
    result = diagnose(message + "\n")
    assert result.code == code and result.message == message and result.fix.startswith(fix)
    assert result.engine == "sglang" and result.frame is None


def test_diagnose_illegal_memory_access_is_a_possible_cause():
    message = "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
    result = diagnose(message + "\n")
    assert result.code == "GL103" and result.confirm is not None
    assert "CUDA_LAUNCH_BLOCKING=1" in result.confirm and "GUARDLINT_MODE=strict" in result.confirm
    out = invoke(input=message + "\n").stdout
    assert "Possibly GL103: confirm it" in out and "several causes" in out
    assert json.loads(invoke("--format", "json", input=message + "\n").stdout)["possible"] is True
    lora = (FIXTURES / "sglang_lora_gl201_cdiv_none.log").read_text().replace(
        "TypeError: unsupported operand type(s) for +: 'NoneType' and 'int'", message)
    in_lora = diagnose(lora)
    assert (in_lora.code, in_lora.frame.line) == ("GL204", 73) and "LoRA batch info" in in_lora.confirm


def test_diagnose_no_cuda_device_is_not_a_metadata_error():
    text = ('Traceback (most recent call last):\n  File "/home/ml/vit-demo/encode.py", line 6, in encode\n'
            "    q = q.cuda()\n"
            "RuntimeError: CUDA error: no CUDA-capable device is detected\n")
    result = diagnose(text)
    assert result.code == "GL301" and result.confirm is None and result.frame.line == 6
    assert get("GL301").diagnosis.what_it_means.startswith("Not a metadata error")
    assert not set(result.matches) & {"GL101", "GL102", "GL103", "GL107", "GL201", "GL204"}


def test_diagnose_two_error_lines_name_both_rules_each_with_its_message():
    first = "RuntimeError: sequence_lengths must be a torch.Tensor"
    second = "ValueError: LoRA batch_info must provide max_len or seg_lens."
    result = diagnose(f"{first}\n{second}\n")
    assert {result.code, result.also[0][0]} == {"GL101", "GL201"}
    quoted = {result.code: result.message, result.also[0][0]: result.also[0][1]}
    assert quoted == {"GL101": first, "GL201": second}
    out = invoke(input=f"{first}\n{second}\n").stdout
    assert "Also in the input" in out and first in out and second in out
    also = json.loads(invoke("--format", "json", input=f"{second}\n{first}\n").stdout)["also"]
    assert [(a["code"], a["message"]) for a in also] == [("GL201", second)]


@pytest.mark.parametrize("file, library", [
    ("/sgl-workspace/sglang/python/sglang/srt/models/qwen2_5_vl.py", False),
    ("/usr/local/lib/python3.12/dist-packages/sglang/srt/models/qwen2_5_vl.py", False),
    ("/workspace/vllm/vllm/model_executor/models/qwen2_vl.py", False),
    ("/usr/lib/python3.12/site-packages/vllm/model_executor/models/qwen2_5_vl.py", False),
    ("/sgl-workspace/sglang/python/sglang/srt/layers/attention/vision.py", True),
    ("/sgl-workspace/sglang/python/sglang/srt/lora/backend/triton_backend.py", True),
    ("/sgl-workspace/sglang/python/sglang/kernels/ops/lora/dense/sgemm_lora_a.py", True),
    ("/workspace/vllm/vllm/v1/attention/ops/vit_attn_wrappers.py", True),
    ("/workspace/vllm/vllm/model_executor/layers/attention/mm_encoder_attention.py", True),
    ("/workspace/vllm/vllm/model_executor/custom_op.py", True),
])
def test_engine_model_files_are_user_frames(file, library):
    from guardlint.lint.diagnose import is_library_frame

    assert is_library_frame(file) is library


@pytest.mark.parametrize("path, release", [
    (FIXTURES / "sglang_vit_gl102_int_none.txt", "sglang-0.5.23"),
    (FIXTURES / "sglang_lora_gl201_cdiv_none.log", "sglang-0.5.23"),
    (FIXTURES / "vllm_qwen2vl_gl101_bare_assert.txt", "vllm-0.33.0"),
])
def test_engine_fixtures_quote_the_pinned_releases(path, release):
    from guardlint.lint.diagnose import parse

    root = ENGINES_DIR / release
    if not root.is_dir():
        pytest.skip(f"{release} is not unpacked under .engines (make engines)")
    package = release.split("-")[0]
    checked = 0
    for block in parse(path.read_text()).blocks:
        for frame in block.frames:
            parts = frame.file.split("/")
            if package in parts:
                rel = "/".join(parts[len(parts) - 1 - parts[::-1].index(package):])
                if not (root / rel).is_file():  # a checkout's own scripts and tests are not in the release
                    continue
                line = (root / rel).read_text().splitlines()[frame.line - 1].strip()
                assert line == frame.source, (rel, frame.line)
                checked += 1
    assert checked >= 2
