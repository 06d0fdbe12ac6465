"""``guardlint server`` driven as an editor drives it: a subprocess on stdio, JSON-RPC in Content-Length frames.

Every test starts the real server and speaks the protocol through ``lsp_client`` (not pygls), then
compares what the server says with what ``guardlint check`` says about the same text.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pygls", reason="the language server needs pygls (pip install 'guardlint[server]')")

from lsp_client import Client, apply_edits, insert  # noqa: E402

from guardlint.lint.commands import run_check  # noqa: E402
from guardlint.lint.runner import fixed_source  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

LORA_BAD = '''\
from sglang.srt.lora.utils import LoRABatchInfo


def make(bs, seg_indptr, weight_indices, lora_ranks, scalings):
    return LoRABatchInfo(bs=bs, num_segments=bs, seg_indptr=seg_indptr, weight_indices=weight_indices,
                         lora_ranks=lora_ranks, scalings=scalings, use_cuda_graph=False, permutation=None)
'''

VIT_BAD = '''\
from guardlint.kernels import cudnn_vision_attention


def attend(q, k, v, cu_seqlens):
    return cudnn_vision_attention(q, k, v, cu_seqlens, cu_seqlens.numel() - 1, 64)
'''


@pytest.fixture
def client():
    c = Client(cwd=str(ROOT))
    yield c
    if c.proc.poll() is None:
        c.shutdown()


def _cli_findings(path: Path) -> set:
    out = run_check([str(path)], fmt="json", cwd=path.parent)
    return {(f["code"], f["line"], f["column"]) for f in json.loads(out.stdout)}


def _lsp_findings(diagnostics: list[dict]) -> set:
    return {(d["code"], d["range"]["start"]["line"] + 1, d["range"]["start"]["character"] + 1) for d in diagnostics}


def test_server_publishes_the_findings_of_check_on_open(client):
    client.initialize([ROOT])
    for name in ("vit.py", "engine_backend.py", "vit_fixed.py"):
        path = EXAMPLES / name
        uri = client.open(path, path.read_text())
        diagnostics = client.diagnostics(uri, version=1)
        assert _lsp_findings(diagnostics) == _cli_findings(path), name
        for d in diagnostics:
            assert d["source"] == "guardlint"
            assert d["severity"] in (1, 2)
            assert d["codeDescription"]["href"].endswith("#" + d["code"].lower() + "-" + _name(d["code"]))
    assert client.shutdown() == 0


def _name(code: str) -> str:
    from guardlint.contracts import get

    return get(code).name


def test_server_rechecks_the_buffer_not_the_file(client, tmp_path):
    path = tmp_path / "lora.py"
    path.write_text("x = 1\n")  # the file on disk stays clean: every finding comes from the buffer
    client.initialize([tmp_path])
    uri = client.open(path, LORA_BAD)
    assert [d["code"] for d in client.diagnostics(uri, version=1)] == ["GL201"]
    # Type the missing keyword, one incremental change at the end of the call's last line.
    line = LORA_BAD.splitlines().index(next(ln for ln in LORA_BAD.splitlines() if "permutation=None)" in ln))
    col = LORA_BAD.splitlines()[line].index("permutation=None") + len("permutation=None")
    client.change(uri, 2, [insert(line, col, ", max_len=8")])
    assert client.diagnostics(uri, version=2) == []
    # And take it out again: the finding comes back for version 3.
    start = {"line": line, "character": col}
    end = {"line": line, "character": col + len(", max_len=8")}
    client.change(uri, 3, [{"range": {"start": start, "end": end}, "text": ""}])
    assert [d["code"] for d in client.diagnostics(uri, version=3)] == ["GL201"]
    assert path.read_text() == "x = 1\n"


def test_server_code_action_applies_what_fix_writes(client, tmp_path):
    path = tmp_path / "vit.py"
    path.write_text(VIT_BAD)
    client.initialize([tmp_path])
    uri = client.open(path, VIT_BAD)
    diagnostics = client.diagnostics(uri, version=1)
    assert sorted(d["code"] for d in diagnostics) == ["GL101", "GL102"]
    first = diagnostics[0]
    actions = client.request("textDocument/codeAction", {
        "textDocument": {"uri": uri}, "range": first["range"], "context": {"diagnostics": [first]}})
    assert actions, "a finding with a fix offers a quick fix"
    for action in actions:
        assert action["kind"] == "quickfix"
        assert action["title"].endswith("(unsafe fix)")  # every built-in fix is unsafe: marked, never preferred
        assert not action.get("isPreferred")
    mine = next(a for a in actions if a["title"].startswith(first["code"]))
    assert mine["diagnostics"][0]["code"] == first["code"]
    after = apply_edits(VIT_BAD, mine["edit"]["changes"][uri])
    assert after == fixed_source(VIT_BAD, str(path), unsafe_fixes=True)
    compile(after, str(path), "exec")
    # A range without findings offers nothing; a request for other kinds neither.
    empty = {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 1}}
    assert client.request("textDocument/codeAction", {
        "textDocument": {"uri": uri}, "range": empty, "context": {"diagnostics": []}}) == []
    assert not client.request("textDocument/codeAction", {
        "textDocument": {"uri": uri}, "range": first["range"],
        "context": {"diagnostics": [first], "only": ["source.organizeImports"]}})


def test_server_hover_shows_the_rules_explanation(client, tmp_path):
    path = tmp_path / "vit.py"
    client.initialize([tmp_path])
    uri = client.open(path, VIT_BAD)
    diagnostics = client.diagnostics(uri, version=1)
    at = diagnostics[0]["range"]["start"]
    hover = client.request("textDocument/hover", {"textDocument": {"uri": uri}, "position": at})
    text = hover["contents"]["value"]
    assert hover["contents"]["kind"] == "markdown"
    for code in ("GL101", "GL102"):
        assert f"**{code}**" in text
    assert "## What it does" in text and "missing-sequence-lengths" in text
    nowhere = client.request("textDocument/hover", {"textDocument": {"uri": uri},
                                                    "position": {"line": 0, "character": 0}})
    assert nowhere is None


def test_server_honours_each_workspace_folders_configuration(client, tmp_path):
    strict_dir, lenient_dir = tmp_path / "a", tmp_path / "b"
    strict_dir.mkdir()
    lenient_dir.mkdir()
    (lenient_dir / "pyproject.toml").write_text('[tool.guardlint]\nignore = ["GL102"]\nexclude = ["gen/"]\n')
    (lenient_dir / "gen").mkdir()
    client.initialize([strict_dir, lenient_dir])
    uri_a = client.open(strict_dir / "vit.py", VIT_BAD)
    uri_b = client.open(lenient_dir / "vit.py", VIT_BAD)
    uri_gen = client.open(lenient_dir / "gen" / "vit.py", VIT_BAD)
    assert sorted(d["code"] for d in client.diagnostics(uri_a, version=1)) == ["GL101", "GL102"]
    assert [d["code"] for d in client.diagnostics(uri_b, version=1)] == ["GL101"]
    assert client.diagnostics(uri_gen, version=1) == []  # excluded, as `guardlint check` skips it
    # The configuration is edited and saved: the open documents are checked again with it.
    config = lenient_dir / "pyproject.toml"
    config.write_text('[tool.guardlint]\nignore = ["GL101"]\n')
    seen = len(client.notifications)
    client.notify("textDocument/didSave", {"textDocument": {"uri": config.as_uri()}})
    assert [d["code"] for d in client.diagnostics(uri_b, after=seen)] == ["GL102"]
    # A broken configuration is said, not swallowed.
    config.write_text('[tool.guardlint]\nignore = ["GL9"]\nselect = 3\n')
    seen = len(client.notifications)
    client.notify("textDocument/didSave", {"textDocument": {"uri": config.as_uri()}})
    _, shown = client.wait_for(lambda m: m.get("method") == "window/showMessage", after=seen)
    assert "guardlint:" in shown["params"]["message"] and "select" in shown["params"]["message"]


def test_server_ranges_count_utf16_units(client, tmp_path):
    # A character outside the BMP is two UTF-16 units: the range must start one unit later than the
    # character count says.
    source = VIT_BAD.replace("    return cudnn", "    s = '\U0001f600'; return cudnn")
    path = tmp_path / "emoji.py"
    client.initialize([tmp_path])
    uri = client.open(path, source)
    diagnostics = client.diagnostics(uri, version=1)
    line = source.splitlines()[4]
    assert diagnostics and all(d["range"]["start"]["line"] == 4 for d in diagnostics)
    assert diagnostics[0]["range"]["start"]["character"] == line.index("cudnn") + 1


def test_server_close_clears_the_diagnostics_and_exit_is_clean(client, tmp_path):
    client.initialize([tmp_path])
    uri = client.open(tmp_path / "vit.py", VIT_BAD)
    assert client.diagnostics(uri, version=1)
    seen = len(client.notifications)
    client.notify("textDocument/didClose", {"textDocument": {"uri": uri}})
    assert client.diagnostics(uri, after=seen) == []
    assert client.shutdown() == 0


def test_server_without_pygls_is_a_usage_error():
    code = ("import sys; sys.modules['pygls'] = None; sys.modules['pygls.lsp.server'] = None\n"
            "from guardlint.lint.cli import main\nmain(['server'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "pip install 'guardlint[server]'" in proc.stderr
