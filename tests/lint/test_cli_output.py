"""``guardlint check``'s output as a ruff user expects it: ``--output-file``, the ``full`` format, colour on a
terminal only, and the severity of a warning on its text line."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint.lint import output
from guardlint.lint.cli import main, use_color
from guardlint.lint.commands import run_check
from guardlint.lint.findings import Edit, Finding, Fix

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lint"
VISION = str(FIXTURES / "qwen2_vl_vision.py")
LORA = str(FIXTURES / "lora_backend.py")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# What tools parse: location, then the code.
PARSEABLE = re.compile(r"^(?P<path>.+?):(?P<line>\d+):(?P<col>\d+): (?P<code>GL\d{3}) (?P<rest>.+)$")


def invoke(*args, input=None, env=None):
    return CliRunner().invoke(main, list(args), input=input, env=env)


def _plain_env() -> dict:
    return {"NO_COLOR": None, "FORCE_COLOR": None}


# -- --output-file ------------------------------------------------------------------------------------------
def test_output_file_takes_the_findings_and_stderr_keeps_the_summary(tmp_path):
    out = tmp_path / "report.txt"
    plain = invoke(VISION, LORA)
    r = invoke("-o", str(out), VISION, LORA)
    assert r.exit_code == plain.exit_code == 1
    assert r.stdout == "" and r.stderr == plain.stderr and r.stderr.startswith("Found ")
    assert out.read_text() == plain.stdout and plain.stdout.count("\n") > 10
    long_form = tmp_path / "report.json"
    r = invoke("--output-file", str(long_form), "--output-format", "json", LORA)
    assert r.stdout == "" and [d["code"] for d in json.loads(long_form.read_text())][0] == "GL201"


def test_output_file_replaces_in_one_step(tmp_path, monkeypatch):
    """A reader sees the old report or the new one: the new one is written beside it and renamed over it;
    when that fails the old one is left whole, the run exits 2 and no temporary file stays."""
    out = tmp_path / "report.txt"
    out.write_text("old report\n")
    out.chmod(0o640)
    renames = []
    real_replace = os.replace

    def replace(src, dst):
        renames.append((Path(src).parent, Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    r = invoke("-o", str(out), LORA)
    assert r.exit_code == 1 and out.read_text().startswith(f"{LORA}:32:22: GL201 ")
    assert renames == [(tmp_path, out)] and oct(out.stat().st_mode & 0o777) == oct(0o640)

    def failing(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing)
    out.write_text("old report\n")
    r = invoke("-o", str(out), LORA)
    assert r.exit_code == 2 and "--output-file" in r.stderr and "No space left on device" in r.stderr
    assert out.read_text() == "old report\n" and sorted(p.name for p in tmp_path.iterdir()) == ["report.txt"]


def test_output_file_in_a_missing_folder_exits_2(tmp_path):
    r = invoke("-o", str(tmp_path / "no" / "such" / "report.txt"), LORA)
    assert r.exit_code == 2 and r.stderr.splitlines()[-1].startswith("guardlint: error: --output-file: ")


def test_output_file_with_fix_of_stdin_keeps_the_source_on_stdout(tmp_path):
    out = tmp_path / "report.txt"
    src = "from sglang.srt.lora.utils import LoRABatchInfo\ninfo = LoRABatchInfo(bs=1, max_len=0)\n"
    r = invoke("--fix", "-o", str(out), "-", input=src)
    assert r.stdout == src and out.read_text().startswith("-:2:28: GL203 ")


# -- full ---------------------------------------------------------------------------------------------------
LORA_SOURCE = ("from sglang.srt.lora.utils import LoRABatchInfo\n\n\n"
               "def build(p):\n"
               "\tinfo = LoRABatchInfo(bs=1, seg_indptr=p)\n"  # a tab: the underline stays under the call
               "\n\ndef empty():\n"
               "    return LoRABatchInfo(\n        bs=1,\n    )\n")


def test_full_format_shows_the_source_line_the_span_the_note_and_the_fix(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(LORA_SOURCE)
    r = invoke("--output-format", "full", str(path))
    assert r.exit_code == 1 and r.stderr.startswith("Found 2 findings.")
    first, second, end = r.stdout.split("\n\n")
    assert end == ""
    call = "LoRABatchInfo(bs=1, seg_indptr=p)"
    assert first.splitlines()[:5] == [
        f"{path}:5:9: GL201 LoRABatchInfo(...) without max_len or seg_lens",
        "  |",
        f"5 |     info = {call}",
        "  |            " + "^" * len(call) + " GL201",
        "  |",
    ]
    assert first.splitlines()[5:] == [
        "  = note: LoRA batch_info must provide max_len or seg_lens.",
        "  = note: Judged against catalog: sglang 0.5.23.",
        "  = help: Add seg_lens=p[1:] - p[:-1]; Add max_len=int((p[1:] - p[:-1]).max()) (a host read, once per "
        "batch) (an unsafe fix: --unsafe-fixes applies it)",
    ]
    # A span over several lines: its first line is underlined, to its end.
    assert second.splitlines()[2:4] == ["9 |     return LoRABatchInfo(", "  |            " + "^" * 14 + " GL201"]


def test_full_format_says_why_there_is_no_fix_in_the_note():
    r = invoke("--format", "full", "--select", "GL10", VISION)
    block = next(b for b in r.stdout.split("\n\n") if b.startswith(f"{VISION}:38:19: GL101 "))
    notes = [line.split("= note: ", 1)[1] for line in block.splitlines() if "= note: " in line]
    assert notes[0] == "sequence_lengths should be prepared for vision flashinfer_cudnn attention backend."
    assert any(n.startswith("Writing forward_metadata here would add a host read per layer: build it once per "
                            "model forward, before the block loop") for n in notes)
    assert "= help:" not in block


def test_full_format_reads_stdin_and_fixed_files(tmp_path):
    src = "from sglang.srt.lora.utils import LoRABatchInfo\nLoRABatchInfo(bs=1, max_len=0)\n"
    r = invoke("--output-format", "full", "-", input=src)
    assert "2 | LoRABatchInfo(bs=1, max_len=0)\n" in r.stdout
    assert "  | " + " " * len("LoRABatchInfo(bs=1, ") + "^" * len("max_len=0") + " GL203\n" in r.stdout
    # After --fix the lines shown are the fixed ones (of stdin too, whose findings then go to stderr).
    positional = "from sglang.srt.lora.utils import LoRABatchInfo\nLoRABatchInfo(False, 1, max_len=0)\n"
    fixed = "LoRABatchInfo(use_cuda_graph=False, bs=1, max_len=0)"
    r = invoke("--fix", "--unsafe-fixes", "--output-format", "full", "-", input=positional)
    assert r.stdout.splitlines()[1] == fixed and f"2 | {fixed}\n" in r.stderr
    path = tmp_path / "m.py"
    path.write_text(positional)
    r = invoke("--fix", "--unsafe-fixes", "--output-format", "full", str(path))
    assert f"2 | {fixed}\n" in r.stdout and "^^^^^^^^^ GL203" in r.stdout


def test_output_format_aliases():
    text, concise = invoke("--output-format", "text", LORA), invoke("--output-format", "concise", LORA)
    assert text.stdout == concise.stdout == invoke("--format", "text", LORA).stdout == invoke(LORA).stdout
    assert invoke("--output-format", "xml", LORA).exit_code == 2


# -- colour -------------------------------------------------------------------------------------------------------
def test_colour_when_asked_path_bold_code_red_or_yellow():
    r = invoke("--color", "always", VISION, env=_plain_env())
    lines = r.stdout.splitlines()
    error = next(line for line in lines if ": \x1b[1m\x1b[31mGL101\x1b[0m " in line)
    assert error.startswith(f"\x1b[1m{VISION}\x1b[0m:")
    warning = next(line for line in lines if "GL104" in line)
    assert ": \x1b[1m\x1b[33mGL104\x1b[0m \x1b[33mwarning: \x1b[0m" in warning
    assert [ANSI.sub("", line) for line in lines] == invoke(VISION).stdout.splitlines()


@pytest.mark.parametrize("args, env", [
    ([], {"NO_COLOR": None, "FORCE_COLOR": None}),  # CliRunner's stdout is no terminal
    (["--color", "never"], {"FORCE_COLOR": "1"}),
    (["--format", "json", "--color", "always"], {}),
    (["--format", "sarif"], {"FORCE_COLOR": "1"}),
    (["--format", "github", "--color", "always"], {}),
    (["--statistics", "--format", "json", "--color", "always"], {}),
])
def test_no_colour_in_pipes_or_machine_formats(args, env):
    r = invoke(*args, VISION, env=env)
    assert r.stdout and "\x1b" not in r.stdout


def test_force_color_colours_a_pipe_and_never_a_file(tmp_path):
    assert "\x1b[1m" in invoke(VISION, env={"FORCE_COLOR": "1", "NO_COLOR": None}).stdout
    out = tmp_path / "report.txt"
    invoke("--color", "always", "-o", str(out), VISION, env={"FORCE_COLOR": "1"})
    assert "GL101" in out.read_text() and "\x1b" not in out.read_text()


class _Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("choice, tty, env, expected", [
    ("auto", True, {}, True),
    ("auto", False, {}, False),
    ("auto", True, {"NO_COLOR": "1"}, False),
    ("auto", True, {"NO_COLOR": ""}, True),  # no-color.org: set and not empty
    ("auto", False, {"FORCE_COLOR": "1"}, True),
    ("auto", False, {"FORCE_COLOR": "0"}, False),
    ("never", True, {"FORCE_COLOR": "1"}, False),
    ("always", False, {"NO_COLOR": "1"}, True),
])
def test_use_color(choice, tty, env, expected):
    assert use_color(choice, _Stream(tty), env) is expected


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
@pytest.mark.parametrize("no_color", [False, True])
def test_colour_on_a_real_terminal_unless_no_color(no_color):
    import pty

    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")}
    if no_color:
        env["NO_COLOR"] = "1"
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "guardlint.lint.cli", LORA], stdout=slave,
                            stderr=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the terminal closed with the process
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait() == 1
    seen = b"".join(chunks).decode()
    assert "GL201" in seen
    assert ("\x1b[1m\x1b[31mGL201\x1b[0m" in seen) is not no_color


# -- severity on the text line --------------------------------------------------------------------------------
def test_a_warning_says_so_after_the_code_and_every_line_stays_parseable():
    lines = invoke(VISION, LORA).stdout.splitlines()
    parsed = [PARSEABLE.match(line) for line in lines]
    assert all(parsed)
    warnings = [m for m in parsed if m["rest"].startswith("warning: ")]
    assert {m["code"] for m in warnings} == {"GL104"}
    assert all(not m["rest"].startswith("warning: ") for m in parsed if m["code"] != "GL104")
    data = json.loads(invoke("--format", "json", VISION, LORA).stdout)
    assert sorted((d["line"], d["code"]) for d in data if d["severity"] == "warning") == \
        sorted((int(m["line"]), m["code"]) for m in warnings)


def test_warning_marker_comes_after_the_fix_marker():
    fix = Fix("safe", "Add max_seqlen=m", (Edit(1, 5, 1, 5, "x"),))
    f = Finding("a.py", 3, 5, "GL109", "VisionAttention(...) without forward_metadata", severity="warning", fix=fix)
    assert output.text([f]) == "a.py:3:5: GL109 [*] warning: VisionAttention(...) without forward_metadata\n"
    error = Finding("a.py", 3, 5, "GL101", "x(...) without sequence_lengths")
    assert output.text([error]) == "a.py:3:5: GL101 x(...) without sequence_lengths\n"


def test_strict_unchecked_calls_are_warnings_on_the_line():
    lines = invoke("--strict", str(FIXTURES / "splats.py")).stdout.splitlines()
    unchecked = [line for line in lines if "could not be checked" in line]
    assert unchecked and all(" warning: " in line for line in unchecked)


def test_statistics_json_carries_the_severity():
    rows = {d["code"]: d for d in json.loads(invoke("--statistics", "--format", "json", VISION, LORA).stdout)}
    assert rows["GL104"]["severity"] == "warning" and rows["GL201"]["severity"] == "error"


def test_plain_function_refuses_an_unknown_format():
    out = run_check([LORA], fmt="xml")
    assert out.exit_code == 2 and "'xml'" in out.stderr
