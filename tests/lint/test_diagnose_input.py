"""``guardlint diagnose [FILE | - | MESSAGE...]``: the message itself as arguments, stdin, files, and the
usage error for a path that names no file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint.lint.cli import main

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "examples" / "traceback.txt"
GUARDLINT = Path(sys.executable).parent / "guardlint"
MAX_SEQLEN = "ValueError: max_seqlen should be prepared for vision flashinfer_cudnn attention backend"
LORA = "ValueError: LoRA batch_info must provide max_len or seg_lens."


def invoke(*args, input=None):
    return CliRunner().invoke(main, ["diagnose", *args], input=input)


def as_json(*args, input=None) -> dict:
    r = invoke("--format", "json", *args, input=input)
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)


def test_diagnose_message_as_one_argument():
    r = invoke(MAX_SEQLEN)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("GL102 missing-max-seqlen: ") and f"error: {MAX_SEQLEN}" in r.stdout
    out = as_json(MAX_SEQLEN)
    assert (out["code"], out["message"], out["exception"]) == ("GL102", MAX_SEQLEN, "ValueError")


def test_diagnose_message_as_one_argument_through_the_installed_command():
    r = subprocess.run([str(GUARDLINT), "diagnose", MAX_SEQLEN], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("GL102 missing-max-seqlen: ") and "No such file" not in r.stderr


def test_diagnose_message_as_several_words():
    # The message typed without quotes: the words are one line again.
    out = as_json(*MAX_SEQLEN.split())
    assert (out["code"], out["message"]) == ("GL102", MAX_SEQLEN)
    assert as_json(*LORA.split())["message"] == LORA


def test_diagnose_message_as_several_lines():
    out = as_json("assert sequence_lengths is not None", "AssertionError")
    assert (out["code"], out["message"], out["exception"]) == ("GL101", "assert sequence_lengths is not None",
                                                               "AssertionError")
    # `Type:` then the quoted message is one exception line.
    assert as_json("ValueError:", MAX_SEQLEN.split(": ", 1)[1])["message"] == MAX_SEQLEN
    # A whole traceback in one quoted argument is read as it is.
    assert as_json(SAMPLE.read_text())["frame"]["line"] == 131


def test_diagnose_message_words_that_look_like_options():
    words = "TypeError: unsupported operand type(s) for -: 'NoneType' and 'int'".split()
    r = invoke(*words)
    assert r.exit_code == 1 and "No such option" not in r.output
    assert "error: TypeError: unsupported operand type(s) for -: 'NoneType' and 'int'" in r.stdout
    assert as_json(*LORA.split())["code"] == "GL201"  # --format before the words
    r = invoke(*LORA.split(), "--format", "json")     # ... and after them
    assert r.exit_code == 0 and json.loads(r.stdout)["code"] == "GL201"


def test_diagnose_mistyped_option_is_a_usage_error():
    r = invoke("--fromat", "json", str(SAMPLE))
    assert r.exit_code == 2 and "no such option: --fromat" in r.output


@pytest.mark.parametrize("args", [(), ("-",)])
def test_diagnose_stdin_without_argument_or_dash(args):
    r = invoke(*args, input=LORA + "\n")
    assert r.exit_code == 0 and r.stdout.startswith("GL201 ")
    assert "Paste the error" not in r.stderr  # no prompt when stdin is not a terminal


def test_diagnose_prompts_on_a_terminal():
    pty = pytest.importorskip("pty")
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([str(GUARDLINT), "diagnose"], stdin=follower, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        os.write(leader, (LORA + "\n").encode() + b"\x04")  # Ctrl-D at a line's start: end of input
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(leader)
        os.close(follower)
    assert "Paste the error or traceback, then press Ctrl-D." in err
    assert proc.returncode == 0 and out.startswith("GL201 ")


def test_diagnose_file_argument_is_read(tmp_path, monkeypatch):
    # A word without a path's look is still a file when one of that name exists.
    monkeypatch.chdir(tmp_path)
    Path("error").write_text(SAMPLE.read_text())
    out = as_json("error")
    assert out["code"] == "GL101" and out["frame"]["line"] == 131
    spaced = tmp_path / "my logs" / "vit crash.txt"
    spaced.parent.mkdir()
    spaced.write_bytes(SAMPLE.read_text().encode("utf-16"))
    assert as_json(str(spaced))["code"] == "GL101"


def test_diagnose_several_files_are_read_together(tmp_path):
    (tmp_path / "a.log").write_text(SAMPLE.read_text())
    (tmp_path / "b.log").write_text(LORA + "\n")
    out = as_json(str(tmp_path / "a.log"), str(tmp_path / "b.log"))
    # Read in order, one input: the later error is the answer, the other is named beside it.
    assert out["code"] == "GL201" and [a["code"] for a in out["also"]] == ["GL101"]
    r = invoke(str(tmp_path / "a.log"), str(tmp_path / "c.log"))
    assert r.exit_code == 2 and "no such file" in r.output and "c.log" in r.output


@pytest.mark.parametrize("arg", ["/no/such/traceback.txt", "traceback.log", "nohup.out", "logs/err",
                                 "C:\\logs\\vit", "TRACEBACK.TXT"])
def test_diagnose_missing_path_is_a_usage_error(arg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = invoke(arg)
    assert r.exit_code == 2, r.output
    assert f"no such file: {arg!r}" in r.output and "Usage:" in r.output
    assert "No guardlint rule matches" not in r.output


def test_diagnose_folder_is_a_usage_error(tmp_path):
    r = invoke(str(tmp_path))
    assert r.exit_code == 2 and "is a folder, not a file" in r.output


@pytest.mark.parametrize("arg", ["AssertionError", "GL999", "sequence_lengths"])
def test_diagnose_one_word_that_is_no_path_is_a_message(arg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = invoke(arg)
    assert r.exit_code == 1 and "No guardlint rule matches" in r.stdout and "no such file" not in r.output
