"""Rule selectors as ruff takes them: codes, prefixes and rule names, on the command line and in
``[tool.guardlint]``; one that matches no rule is a usage error that names it (exit 2)."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint.lint.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lint"
VISION = str(FIXTURES / "qwen2_vl_vision.py")
LORA = str(FIXTURES / "lora_backend.py")
USER_CALLS = "from mylib.ops import fwd, bwd\nfwd(1)\nbwd(1)\n"
USER_CONTRACTS = """
[[tool.guardlint.contracts]]
call = "mylib.ops.fwd"
params = ["x", "n"]
require = [["n"]]
name = "fwd-needs-n"

[[tool.guardlint.contracts]]
call = "mylib.ops.bwd"
params = ["x", "m"]
require = [["m"]]
name = "bwd-needs-m"
code = "GL901"
"""


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def codes(result) -> set:
    return {line.split()[1] for line in result.stdout.splitlines()}


def _project(tmp_path: Path, table: str, source: str = "") -> Path:
    (tmp_path / "pyproject.toml").write_text(f"[tool.guardlint]\n{table}\n")
    (tmp_path / "model.py").write_text(source or Path(LORA).read_text())
    return tmp_path


# -- a selector that matches nothing --------------------------------------------------------------------
@pytest.mark.parametrize("option, value", [
    ("--select", "GL9"),  # a prefix of no rule: it used to print "All checks passed." and exit 0
    ("--select", "GL14"),
    ("--ignore", "GL14"),
    ("--ignore", "GL999"),
    ("--select", "E501"),
    ("--select", "GL101,GL9"),  # one bad item of a comma list is enough
])
def test_selector_that_matches_no_rule_is_a_usage_error(option, value):
    r = invoke(option, value, LORA)
    bad = [v for v in value.split(",") if v != "GL101"][0]
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.startswith(f"guardlint: error: {option}: {bad!r} matches no rule (known: GL000, GL001, GL002, ")
    assert "All checks passed" not in r.output and "Traceback" not in r.output


def test_prefixes_that_match_rules_still_select():
    assert codes(invoke("--select", "GL2", LORA)) == {"GL201", "GL202", "GL203"}
    assert codes(invoke("--select", "GL1", VISION)) == {"GL101", "GL102", "GL104"}
    assert invoke("--select", "GL3", LORA).exit_code == 0  # GL301 exists (a runtime rule): nothing to report


@pytest.mark.parametrize("table, key", [
    ("ignore = ['GL14']", "tool.guardlint.ignore"),
    ("select = ['GL9']", "tool.guardlint.select"),
    ("select = ['missing-max-len']", "tool.guardlint.select"),
    ("per-file-ignores = { 'model.py' = ['GL7'] }", "tool.guardlint.per-file-ignores.'model.py'"),
    ("per-file-ignores = { 'model.py' = ['zero-max-length'] }", "tool.guardlint.per-file-ignores.'model.py'"),
])
def test_config_selector_that_matches_no_rule_exits_2(tmp_path, table, key):
    _project(tmp_path, table)
    r = invoke(str(tmp_path))
    value = table.split("'")[-2]
    assert r.exit_code == 2 and r.stdout == ""
    assert f"{key}: {value!r} matches no rule (known" in r.stderr


def test_codes_of_user_contracts_are_known(tmp_path):
    _project(tmp_path, USER_CONTRACTS, USER_CALLS)
    assert codes(invoke("--select", "GL9", str(tmp_path))) == {"GL901"}
    assert codes(invoke("--ignore", "GL901", str(tmp_path))) == {"GL001"}
    assert invoke("--select", "GL9", LORA).exit_code == 2  # without those contracts GL9 matches nothing


# -- rule names --------------------------------------------------------------------------------------------
def test_explain_takes_a_rule_name():
    by_name, by_code = invoke("explain", "missing-max-seqlen"), invoke("explain", "GL102")
    assert by_name.exit_code == 0 and by_name.stdout == by_code.stdout
    assert by_name.stdout.startswith("# missing-max-seqlen (GL102)\n")
    assert invoke("explain", "Missing-Max-Seqlen").stdout == by_code.stdout


def test_explain_unknown_name_exits_2_naming_it():
    r = invoke("explain", "missing-max-seqlens")
    assert r.exit_code == 2 and "'missing-max-seqlens'" in r.stderr and r.stdout == ""


@pytest.mark.parametrize("args, expected", [
    (["--select", "missing-max-seqlen"], {"GL102"}),
    (["--select", "missing-max-seqlen,per-layer-host-sync"], {"GL102", "GL104"}),
    (["--select", "GL1", "--ignore", "missing-sequence-lengths"], {"GL102", "GL104"}),
    (["--ignore", "per-layer-host-sync", "--ignore", "GL102"], {"GL101"}),
])
def test_select_and_ignore_take_rule_names(args, expected):
    assert codes(invoke(*args, VISION)) == expected


def test_unknown_rule_name_on_the_command_line_exits_2():
    r = invoke("--ignore", "per-layer-hostsync", VISION)
    assert r.exit_code == 2
    assert r.stderr.startswith("guardlint: error: --ignore: 'per-layer-hostsync' matches no rule (known names: ")
    assert "per-layer-host-sync" in r.stderr


@pytest.mark.parametrize("table, expected", [
    ("select = ['missing-max-len-and-seg-lens']", {"GL201"}),
    ("ignore = ['zero-max-len', 'positional-lora-batch-info']", {"GL201"}),
    ("per-file-ignores = { 'model.py' = ['missing-max-len-and-seg-lens', 'GL202'] }", {"GL203"}),
])
def test_config_takes_rule_names(tmp_path, table, expected):
    _project(tmp_path, table)
    assert codes(invoke(str(tmp_path))) == expected


def test_names_of_user_contracts_pick_one_contract_of_a_shared_code(tmp_path):
    """Two contracts of the configuration may both be GL001: a name turns one off, not the code."""
    table = USER_CONTRACTS.replace('code = "GL901"\n', "")
    _project(tmp_path, table, USER_CALLS)
    both = invoke(str(tmp_path)).stdout.splitlines()
    assert [line.split(": ", 2)[1].split()[0] for line in both] == ["GL001", "GL001"]
    only_bwd = invoke("--ignore", "fwd-needs-n", str(tmp_path)).stdout.splitlines()
    assert len(only_bwd) == 1 and "bwd(...)" in only_bwd[0]
    explained = invoke("explain", "bwd-needs-m", "--config", str(tmp_path / "pyproject.toml"))
    assert explained.stdout.startswith("# bwd-needs-m (GL001)\n") and "mylib.ops.bwd" in explained.stdout

