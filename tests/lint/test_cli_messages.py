"""Finding messages that fit a terminal line, with the why and the how on the rule's page: docs/rules.md (one
section per rule, the text of ``guardlint explain``), linked from SARIF's ``helpUri``."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint.contracts import all_contracts
from guardlint.lint.cli import main
from guardlint.lint.commands import run_check
from guardlint._version import __version__
from guardlint.lint.explain import DOCS_URL, REPOSITORY, anchor, explain, rules_markdown

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
FIXTURES = ROOT / "tests" / "fixtures" / "lint"
ENGINES = [ROOT / ".engines" / name for name in ("sglang-0.5.23", "sglang-0.5.10.post1", "vllm-0.33.0")]
LIMIT = 120


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def _json(*args) -> list[dict]:
    return json.loads(invoke("--format", "json", *args).stdout)


# -- short messages -----------------------------------------------------------------------------------------
def test_example_messages_fit_a_line():
    found = _json(str(EXAMPLES))
    assert {d["code"] for d in found} >= {"GL101", "GL102", "GL104", "GL201", "GL202", "GL203"}
    assert [d["message"] for d in found if len(d["message"]) > LIMIT] == []


@pytest.mark.parametrize("tree", ENGINES, ids=[p.name for p in ENGINES])
def test_engine_tree_messages_fit_a_line(tree):
    if not tree.is_dir():
        pytest.skip(f"{tree.name} is fetched by `make engines` (not committed)")
    found = json.loads(run_check([str(tree)], fmt="json", exit_zero=True).stdout)
    assert found and [d["message"] for d in found if len(d["message"]) > LIMIT] == []


def test_a_per_layer_call_says_why_there_is_no_fix_once():
    """GL101 and GL102 on one call in a block's forward: the line keeps the facts (the call, what it lacks, why
    no fix), GL102 points at GL101 instead of repeating it, and the advice is in the note."""
    by_code = {d["code"]: d for d in _json(str(EXAMPLES / "engine_backend.py")) if d["line"] == 17}
    gl101, gl102 = by_code["GL101"], by_code["GL102"]
    assert gl101["message"] == ("VisionFlashInferAttention(...) passes sequence_lengths=None; no fix: runs per layer "
                                "in Qwen2VisionBlock.forward")
    assert gl102["message"] == "VisionFlashInferAttention(...) passes max_seqlen=None; no fix (same call as GL101)"
    assert "build it once per model forward, before the block loop" in gl101["note"]
    assert gl101["note"].startswith("sequence_lengths should be prepared for vision flashinfer_cudnn")
    assert gl102["note"].startswith("max_seqlen should be prepared") and "block loop" not in gl102["note"]


def test_the_reason_stays_with_the_code_a_user_sees(tmp_path):
    """With GL101 ignored (by option or per file) GL102 is the first of its call: it says the reason itself."""
    expected = ("VisionFlashInferAttention(...) passes max_seqlen=None; no fix: runs per layer in "
                "Qwen2VisionBlock.forward")
    alone = [d for d in _json("--ignore", "GL101", str(EXAMPLES / "engine_backend.py")) if d["line"] == 17]
    assert [(d["code"], d["message"]) for d in alone] == [("GL102", expected)]
    assert "block loop" in alone[0]["note"]
    project = tmp_path / "p"
    project.mkdir()
    (project / "pyproject.toml").write_text("[tool.guardlint]\n"
                                            "per-file-ignores = { 'm.py' = ['missing-sequence-lengths'] }\n")
    (project / "m.py").write_text((EXAMPLES / "engine_backend.py").read_text())
    per_file = [d for d in _json(str(project)) if d["line"] == 17]
    assert [(d["code"], d["message"]) for d in per_file] == [("GL102", expected)]


def test_warnings_and_lora_findings_say_the_facts():
    messages = {(d["code"], d["line"]): d["message"] for d in _json(str(EXAMPLES))
                if d["path"].endswith("vit.py") or d["line"] in (22, 29)}
    assert messages[("GL104", 29)] == "host sync per layer: int(....max()) on cu_seqlens inside VisionAttention.forward"
    assert messages[("GL202", 22)] == ("field order differs between releases: LoRABatchInfo(...) passes 10 "
                                       "positional arguments")
    assert messages[("GL203", 29)] == "an empty launch grid: LoRABatchInfo(...) passes max_len=0"
    assert messages[("GL201", 53)] == "LoRABatchInfo(...) without max_len or seg_lens"


# -- docs/rules.md ---------------------------------------------------------------------------------------------
def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_committed_rules_page_is_the_generated_one():
    committed = (ROOT / "docs" / "rules.md").read_text(encoding="utf-8")
    assert committed == rules_markdown(), "run: python -m guardlint.lint.explain > docs/rules.md"


def test_rules_page_has_each_rule_under_its_anchor_with_its_explain_text():
    page = rules_markdown()
    headings = {_slug(h): h for h in re.findall(r"^## (.+)$", page, flags=re.M)}
    for c in all_contracts():
        assert anchor(c) == f"{c.code.lower()}-{c.name}" and anchor(c) in headings, c.code
        start = page.index(f"\n## {c.code} {c.name}\n")
        end = page.find("\n## ", start + 1)
        section = page[start + 1: end if end != -1 else len(page)].rstrip("\n")
        body = [line[1:] if line.startswith("###") else line for line in section.splitlines()[1:]]
        assert "\n".join(body).strip() == "\n".join(explain(c).splitlines()[1:]).strip(), c.code
    assert "(#gl101-missing-sequence-lengths)" in page  # the index links the sections


def test_sarif_rules_link_their_section():
    log = json.loads(invoke("--format", "sarif", str(EXAMPLES)).stdout)
    rules = log["runs"][0]["tool"]["driver"]["rules"]
    # The page of this release, in the repository pyproject.toml names.
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's tomllib reads pyproject.toml")
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert REPOSITORY == urls["Repository"]
    assert DOCS_URL == f"{REPOSITORY}/blob/v{__version__}/docs/rules.md"
    assert {r["id"]: r["helpUri"] for r in rules}["GL101"] == f"{DOCS_URL}#gl101-missing-sequence-lengths"
    by_code = {c.code: c for c in all_contracts()}
    assert all(r["helpUri"] == f"{DOCS_URL}#{anchor(by_code[r['id']])}" for r in rules)
    per_layer = next(res for res in log["runs"][0]["results"] if "no fix: runs per layer" in res["message"]["text"])
    assert "block loop" in per_layer["properties"]["note"]


def test_the_docs_url_is_one_constant():
    sources = [p for p in (ROOT / "lint").glob("*.py") if REPOSITORY in p.read_text(encoding="utf-8")]
    assert [p.name for p in sources] == ["explain.py"]


def test_sarif_rule_of_a_user_contract_has_no_help_uri(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[[tool.guardlint.contracts]]\ncall = 'mylib.ops.fwd'\n"
                                             "params = ['x', 'n']\nrequire = [['n']]\ncode = 'GL901'\n")
    (tmp_path / "m.py").write_text("from mylib.ops import fwd\nfwd(1)\n")
    log = json.loads(invoke("--format", "sarif", str(tmp_path)).stdout)
    rules = {r["id"]: r for r in log["runs"][0]["tool"]["driver"]["rules"]}
    assert "helpUri" not in rules["GL901"] and rules["GL000"]["helpUri"].endswith("#gl000-parse-error")
