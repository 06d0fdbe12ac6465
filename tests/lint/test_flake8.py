"""The flake8 plugin (``guardlint.lint.flake8``): ``flake8 --select GL`` reports what ``guardlint check`` reports
(path, line, column, code, message), with ``# noqa``, ``# guardlint: ignore[...]`` and ``[tool.guardlint]``."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("flake8", reason="flake8 is not installed (it is in the `test` extra)")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["examples/vit.py", "examples/engine_backend.py", "examples/lora_layer.py", "examples/vit_fixed.py"]
LINE = re.compile(r"^(?P<path>.+?):(?P<line>\d+):(?P<col>\d+): (?P<code>[A-Z]+\d+) (?P<message>.*)$")

ATTENTION = "from guardlint.kernels import cudnn_vision_attention\n"
LORA = "from guardlint.kernels.lora import LoRABatchInfo\n"
# GL101 and GL102 on the attention call, GL201 on the batch info
MODEL = ATTENTION + LORA + """

def attend(q, k, v, cu_seqlens, max_seqlen):
    return cudnn_vision_attention(q, k, v, cu_seqlens, cu_seqlens.numel() - 1, max_seqlen)


def batch(seg_indptr):
    return LoRABatchInfo(
        bs=1,
        seg_indptr=seg_indptr,
    )
"""


def _flake8(args, cwd, stdin=None, select="GL"):
    """(path, line, column, code, message) of each line flake8 prints, and the process."""
    cmd = [sys.executable, "-m", "flake8", "--isolated", *(["--select", select] if select else []), *args]
    r = subprocess.run(cmd, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1) and not r.stderr, r.stderr
    found = set()
    for line in r.stdout.splitlines():
        m = LINE.match(line)
        assert m, f"not a flake8 finding line: {line!r}"
        found.add((os.path.normpath(m["path"]), int(m["line"]), int(m["col"]), m["code"], m["message"]))
    return found, r


def _guardlint(args, cwd, stdin=None):
    cmd = [sys.executable, "-c", "from guardlint.lint.cli import main; main()", "check", "--format", "json", *args]
    r = subprocess.run(cmd, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    return {(os.path.normpath(f["path"]), f["line"], f["column"], f["code"], f["message"])
            for f in json.loads(r.stdout)}


def _codes(found):
    return sorted((line, code) for _, line, _, code, _ in found)


def test_flake8_plugin_is_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="flake8.extension")}
    assert eps.get("GL") == "guardlint.lint.flake8:Plugin", \
        "entry point missing: reinstall the project (pip install --no-deps -e .)"
    r = subprocess.run([sys.executable, "-m", "flake8", "--version"], capture_output=True, text=True, timeout=60)
    assert "guardlint:" in r.stdout


def test_flake8_reports_what_guardlint_reports_on_the_examples():
    found, _ = _flake8(EXAMPLES, ROOT)
    expected = _guardlint(EXAMPLES, ROOT)
    assert found == expected
    # the comparison means something: the bad twins have findings, the fixed one none
    assert {p for p, *_ in found} == {"examples/vit.py", "examples/engine_backend.py"}
    found_folder, _ = _flake8(["examples"], ROOT)
    assert found_folder == _guardlint(["examples"], ROOT) == expected


def test_flake8_reports_what_guardlint_reports_on_small_files(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    # columns count characters: two non-ASCII ones before the call on its line
    (tmp_path / "wide.py").write_text(LORA + 'name = "éé"; info = LoRABatchInfo(bs=1)\n', encoding="utf-8")
    # a PEP 263 cookie: flake8 hands over decoded text, guardlint reads the bytes by the cookie
    (tmp_path / "latin.py").write_bytes(b"# -*- coding: latin-1 -*-\n" + LORA.encode()
                                        + b'name = "\xe9\xe9"; info = LoRABatchInfo(bs=1)\n')
    (tmp_path / "crlf.py").write_bytes(MODEL.replace("\n", "\r\n").encode())
    # bytes that are not UTF-8 and no cookie: flake8 reads them as latin-1, guardlint cannot decode them (GL000)
    (tmp_path / "undecodable.py").write_bytes(b'name = "\xe9"\n' + LORA.encode() + b"LoRABatchInfo(bs=1)\n")
    (tmp_path / "clean.py").write_text(LORA + "info = LoRABatchInfo(bs=1, seg_lens=lens, max_len=8)\n")
    files = ["model.py", "wide.py", "latin.py", "crlf.py", "undecodable.py", "clean.py"]
    found, _ = _flake8(files, tmp_path)
    assert found == _guardlint(files, tmp_path)
    by_file = {f: _codes({x for x in found if x[0] == f}) for f in files}
    assert by_file["model.py"] == [(6, "GL101"), (6, "GL102"), (10, "GL201")]
    assert by_file["wide.py"] == [(2, "GL201")]
    assert by_file["latin.py"] == [(3, "GL201")]
    assert by_file["crlf.py"] == by_file["model.py"]
    assert [code for _, code in by_file["undecodable.py"]] == ["GL000"]
    assert by_file["clean.py"] == []
    assert {col for p, _, col, _, _ in found if p in ("wide.py", "latin.py")} == {21}


def test_flake8_package_init_resolves_relative_imports_as_guardlint_does(tmp_path):
    """A package's ``__init__.py`` is module ``pkg`` itself: ``.ops`` there is ``pkg.ops`` (a user contract's
    target); read as a plain module it would be ``ops`` and the call would go unreported."""
    (tmp_path / "pyproject.toml").write_text("[tool.guardlint]\n\n[[tool.guardlint.contracts]]\n"
                                             "call = 'pkg.ops.fwd'\nparams = ['x', 'max_len']\n"
                                             "require = [['max_len']]\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "ops.py").write_text("def fwd(x, max_len=None):\n    return x\n")
    (tmp_path / "pkg" / "__init__.py").write_text("from .ops import fwd\n\nfwd(1)\nfwd(1, 2)\n")
    found, _ = _flake8(["pkg"], tmp_path)
    assert found == _guardlint(["pkg"], tmp_path)
    assert _codes(found) == [(3, "GL001")]


def test_flake8_noqa_suppresses_a_code_on_its_line(tmp_path):
    src = (ATTENTION + LORA
           + "out = cudnn_vision_attention(q, k, v, cu, n, m)  # noqa: GL101\n"
           + "out = cudnn_vision_attention(q, k, v, cu, n, m)  # noqa: E501\n"
           + "out = cudnn_vision_attention(q, k, v, cu, n, m)  # noqa\n"
           + "info = LoRABatchInfo(\n    bs=1,\n)  # noqa: GL201\n")
    (tmp_path / "m.py").write_text(src)
    found, _ = _flake8(["m.py"], tmp_path)
    assert found == _guardlint(["m.py"], tmp_path)
    assert _codes(found) == [(3, "GL102"), (4, "GL101"), (4, "GL102")]


def test_flake8_honours_guardlint_ignore_comments(tmp_path):
    src = (ATTENTION
           + "out = cudnn_vision_attention(q, k, v, cu, n, m)  # guardlint: ignore[GL101]\n"
           + "out = cudnn_vision_attention(q, k, v, cu, n, m)  # guardlint: ignore\n"
           + "out = cudnn_vision_attention(q, k, v, cu, n, m)\n")
    (tmp_path / "m.py").write_text(src)
    found, _ = _flake8(["m.py"], tmp_path)
    assert found == _guardlint(["m.py"], tmp_path)
    assert _codes(found) == [(2, "GL102"), (4, "GL101"), (4, "GL102")]


def test_flake8_reads_the_nearest_tool_guardlint_of_each_file(tmp_path):
    """Two projects in one flake8 run, started outside both: each file gets its own project's table
    (ignore, per-file-ignores, exclude); a project without one gets the defaults."""
    configured, plain = tmp_path / "configured", tmp_path / "plain"
    for project in (configured, plain):
        (project / "legacy").mkdir(parents=True)
        (project / "generated").mkdir()
        for rel in ("model.py", "legacy/model.py", "generated/model.py"):
            (project / rel).write_text(MODEL)
    (configured / "pyproject.toml").write_text(
        "[project]\nname = 'c'\n\n[tool.guardlint]\nignore = ['GL102']\nexclude = ['generated']\n"
        "per-file-ignores = { 'legacy/*' = ['GL2'] }\n")
    (plain / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    found, _ = _flake8(["configured", "plain"], tmp_path)
    # guardlint takes one configuration a run (the first path's): one run a project
    assert found == _guardlint(["configured"], tmp_path) | _guardlint(["plain"], tmp_path)
    codes = {p: _codes({x for x in found if x[0] == p}) for p in {x[0] for x in found}}
    assert codes == {
        "configured/model.py": [(6, "GL101"), (10, "GL201")],
        "configured/legacy/model.py": [(6, "GL101")],
        **{f"plain/{rel}": [(6, "GL101"), (6, "GL102"), (10, "GL201")]
           for rel in ("model.py", "legacy/model.py", "generated/model.py")},
    }


def test_flake8_reports_an_invalid_configuration_on_each_file(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.guardlint]\nignore = ['GL999']\n")
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "other.py").write_text("x = 1\n")
    found, _ = _flake8(["model.py", "other.py"], tmp_path)
    assert _codes(found) == [(1, "GL000"), (1, "GL000")]
    assert all("GL999" in message and "not checked" in message for *_, message in found)


def test_flake8_select_gl_reports_only_guardlint_and_the_plugin_is_on_by_default(tmp_path):
    (tmp_path / "m.py").write_text("import os\n" + MODEL + "x = '" + "a" * 100 + "'\n")
    only, _ = _flake8(["m.py"], tmp_path)
    assert _codes(only) == [(7, "GL101"), (7, "GL102"), (11, "GL201")]
    everything, _ = _flake8(["m.py"], tmp_path, select=None)
    assert {"F401", "E501"} <= {code for *_, code, _ in everything}
    assert only <= everything


def test_flake8_leaves_a_syntax_error_to_e999(tmp_path):
    """guardlint reports a file that does not parse as GL000; flake8 reports E999 and never runs its plugins
    on it, so there is no second finding for it."""
    (tmp_path / "broken.py").write_text(LORA + "info = LoRABatchInfo(bs=1\n")
    (tmp_path / "model.py").write_text(MODEL)
    found, _ = _flake8(["broken.py", "model.py"], tmp_path, select="E9,GL")
    assert [(p, code) for p, _, _, code, _ in found if p == "broken.py"] == [("broken.py", "E999")]
    assert {x for x in found if x[0] == "model.py"} == _guardlint(["model.py"], tmp_path)
    assert {code for p, _, _, code, _ in _guardlint(["broken.py"], tmp_path)} == {"GL000"}


def test_flake8_stdin_matches_guardlint_stdin(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    found, _ = _flake8(["--stdin-display-name", "pkg/model.py", "-"], tmp_path, stdin=MODEL)
    assert found == _guardlint(["--stdin-filename", "pkg/model.py", "-"], tmp_path, stdin=MODEL)
    assert _codes(found) == [(6, "GL101"), (6, "GL102"), (10, "GL201")]


def test_flake8_plugin_import_loads_no_torch_triton_or_numpy():
    code = "import guardlint.lint.flake8, sys; print([m for m in ('torch','triton','numpy') if m in sys.modules])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.strip() == "[]"
    # nor libcst: flake8 imports the plugin in runs that check no file with a target
    code = "import guardlint.lint.flake8, sys; print('libcst' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.strip() == "False"
