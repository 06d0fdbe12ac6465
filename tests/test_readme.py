"""The README stays true: its rule table is the catalog's, and every guardlint command it shows runs."""
from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint.contracts.docs import END, START, rule_section
from guardlint.lint.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_rule_table_is_generated_from_the_catalog():
    start = README.index(START)
    end = README.index(END) + len(END)
    assert README[start:end] == rule_section(), "run: python -m guardlint.contracts.docs and paste into README.md"


def _commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [line.split(" #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("guardlint ")]


def test_readme_shows_guardlint_commands():
    assert len(_commands()) >= 6


def _json_codes(out: str) -> set:
    return {f["code"] for f in json.loads(out)}


# What each README command must do on examples/: (exit code, a check of its output). A command added to the
# README needs its line here.
EXPECTED = {
    "guardlint examples/": (1, lambda out: "examples/vit.py:30:15: GL101 " in out and "vit_fixed.py" not in out),
    "guardlint check examples/ --format json": (
        1, lambda out: {"GL101", "GL102", "GL104", "GL201", "GL202", "GL203"} == _json_codes(out)),
    "guardlint examples/ --statistics": (1, lambda out: out.startswith("3\tGL201\tmissing-max-len-and-seg-lens\n")
                                         and "\n1\tGL104\tper-layer-host-sync\n" in out),
    "guardlint examples/ --select GL1 --ignore GL104": (
        1, lambda out: " GL101 " in out and " GL104 " not in out and " GL2" not in out),
    "guardlint explain GL201": (0, lambda out: out.startswith("# missing-max-len-and-seg-lens (GL201)\n")),
    "guardlint rules": (0, lambda out: all(code in out for code in ("GL000", "GL101", "GL201", "GL203"))),
    "guardlint diagnose examples/traceback.txt": (0, lambda out: out.startswith("GL101 missing-sequence-lengths")),
    'guardlint diagnose "ValueError: max_seqlen should be prepared for vision flashinfer_cudnn attention backend"': (
        0, lambda out: out.startswith("GL102 missing-max-seqlen")),
    "guardlint explain missing-max-seqlen": (0, lambda out: out.startswith("# missing-max-seqlen (GL102)\n")),
    "guardlint --diff --unsafe-fixes examples/": (
        1, lambda out: "+++ examples/engine_backend.py" in out and "+    return BatchInfo(use_cuda_graph=False" in out),
}


def test_every_readme_command_has_an_expectation():
    assert sorted(_commands()) == sorted(EXPECTED)


@pytest.mark.parametrize("command", _commands())
def test_readme_command_runs(command, tmp_path, monkeypatch):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, shlex.split(command)[1:])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    exit_code, output_ok = EXPECTED[command]
    assert result.exit_code == exit_code, f"{command!r} exited {result.exit_code}:\n{result.output}"
    assert output_ok(result.stdout), f"{command!r} printed:\n{result.stdout}"
    assert (tmp_path / "examples" / "vit.py").read_bytes() == (ROOT / "examples" / "vit.py").read_bytes()
