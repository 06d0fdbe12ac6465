"""``[tool.guardlint]``: discovery, keys, errors that name the key (exit 2), excludes, per-file ignores."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint.contracts import ConfigError
from guardlint.lint.cli import main
from guardlint.lint.config import Glob, PathMatcher, Settings, find_config, load_settings, settings_from_table
from guardlint.lint.runner import discover

BAD_LORA = "from sglang.srt.lora.utils import LoRABatchInfo\nLoRABatchInfo(bs=1)\n"


def _project(tmp_path: Path, table: str) -> Path:
    (tmp_path / "pyproject.toml").write_text(f"[project]\nname = 'p'\n\n[tool.guardlint]\n{table}\n")
    (tmp_path / "model.py").write_text(BAD_LORA)
    return tmp_path


@pytest.mark.parametrize("table, words", [
    ("selct = ['GL1']", ["tool.guardlint", "unknown key 'selct'", "select"]),
    ("select = 'GL1'", ["tool.guardlint.select", "expected a list", "str"]),
    ("select = ['E501']", ["tool.guardlint.select", "'E501'"]),
    ("ignore = ['GL999']", ["tool.guardlint.ignore", "'GL999' matches no rule (known: GL000, "]),
    ("exclude = 'build'", ["tool.guardlint.exclude", "expected a list"]),
    ("exclude = ['!keep.py']", ["tool.guardlint.exclude", "negated"]),
    ("per-file-ignores = ['tests']", ["tool.guardlint.per-file-ignores", "expected a table"]),
    ("per-file-ignores = { 'tests/**' = 'GL2' }", ["per-file-ignores.'tests/**'", "expected a list"]),
    ("contracts = { call = 'a.b' }", ["tool.guardlint.contracts", "array of tables"]),
    ("[[tool.guardlint.contracts]]\ncall = 'a.b'\nrequire = [['x']]\nretries = 3",
     ["tool.guardlint.contracts[0]", "unknown key 'retries'"]),
    ("[[tool.guardlint.contracts]]\ncall = 'a.b'", ["tool.guardlint.contracts[0].require", "missing"]),
    ("[[tool.guardlint.contracts]]\ncall = 'a.b'\nrequire = 'x'", ["contracts[0].require", "non-empty list"]),
    ("select = [", ["invalid TOML"]),
])
def test_config_errors_name_the_key_and_exit_2(tmp_path, table, words):
    _project(tmp_path, table)
    with pytest.raises(ConfigError) as err:
        load_settings([str(tmp_path)])
    for w in words:
        assert w in str(err.value)
    result = CliRunner().invoke(main, [str(tmp_path)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.startswith("guardlint: error: ") and words[0] in result.stderr
    assert "Traceback" not in result.output


def test_nearest_pyproject_with_our_table_wins(tmp_path):
    outer = _project(tmp_path, "ignore = ['GL201']")
    inner = outer / "sub"
    inner.mkdir()
    (inner / "pyproject.toml").write_text("[project]\nname = 'no-table'\n")
    (inner / "model.py").write_text(BAD_LORA)
    assert find_config(inner) == outer / "pyproject.toml"
    settings = load_settings([str(inner / "model.py")])
    assert settings.root == outer.resolve() and settings.ignore == ("GL201",)
    (inner / "pyproject.toml").write_text("[tool.guardlint]\nselect = ['GL1']\n")
    assert load_settings([str(inner)]).select == ("GL1",)


def test_no_configuration_means_defaults_rooted_at_cwd(tmp_path):
    settings = load_settings([], cwd=tmp_path)
    assert settings.config_path is None and settings.root == tmp_path
    assert settings.select == ("GL",) and ".venv" in settings.exclude


def test_config_option_overrides_discovery(tmp_path):
    _project(tmp_path, "ignore = ['GL201']")
    other = tmp_path / "guardlint.toml"
    other.write_text("select = ['GL1']\n")  # a dedicated file holds the table itself
    assert load_settings([str(tmp_path)], str(other)).select == ("GL1",)
    with pytest.raises(ConfigError, match="--config"):
        load_settings([str(tmp_path)], str(tmp_path / "missing.toml"))


def test_user_contract_from_pyproject(tmp_path):
    _project(tmp_path, "[[tool.guardlint.contracts]]\ncall = 'mylib.ops.fwd'\nparams = ['x', 'max_len']\n"
                       "require = [['max_len']]\n")
    (tmp_path / "use.py").write_text("from mylib.ops import fwd\nfwd(1)\nfwd(1, 2)\n")
    result = CliRunner().invoke(main, [str(tmp_path / "use.py")])
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        f"{tmp_path / 'use.py'}:2:1: GL001 fwd needs max_len: fwd(...) without max_len"]


@pytest.mark.parametrize("pattern, path, is_dir, expected", [
    ("build", "build", True, True),
    ("build", "src/build", True, True),
    ("build", "src/build/x.py", False, True),  # below an excluded folder
    ("build/", "build", False, False),  # folders only
    ("/build", "src/build", True, False),  # anchored at the root
    ("src/gen", "src/gen/a.py", False, True),
    ("src/gen", "lib/src/gen", True, False),
    ("*_pb2.py", "a/b/ops_pb2.py", False, True),
    ("tests/**/fixtures", "tests/a/b/fixtures/x.py", False, True),
    ("tests/**/fixtures", "tests/fixtures", True, True),
    ("**/legacy", "deep/er/legacy/x.py", False, True),
    ("legacy/**", "legacy/a/b.py", False, True),
    ("mod?.py", "mod1.py", False, True),
    ("mod?.py", "mod12.py", False, False),
    ("mod[0-3].py", "mod2.py", False, True),
    ("mod[!0-3].py", "mod2.py", False, False),
    ("*.py", "a/b.pyi", False, False),
    ("a*", "b/abc", True, True),
    ("a/*", "a/b/c.py", False, True),
])
def test_exclude_globs_are_gitignore_like(pattern, path, is_dir, expected):
    assert PathMatcher([pattern]).matches(path, is_dir) is expected


def test_glob_star_stays_in_one_segment():
    assert not Glob.compile("src/*.py").matches("src/a/b.py", False)


def test_default_and_configured_excludes_in_discovery(tmp_path):
    for rel in (".venv/lib/x.py", "build/x.py", "node_modules/p/x.py", "src/__pycache__/x.py", "src/a.py",
                "src/gen/b.py", "src/c.pyi", "src/d.txt", "docs/conf.py"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x = 1\n")
    settings = settings_from_table({"exclude": ["gen/", "docs"]}, tmp_path)
    found = sorted(Path(f).relative_to(tmp_path).as_posix() for f in discover([str(tmp_path)], settings))
    assert found == ["src/a.py", "src/c.pyi"]
    # A folder given on the command line that is itself excluded is skipped too.
    assert discover([str(tmp_path / "build")], settings) == []


def test_per_file_ignores_take_codes_and_prefixes(tmp_path):
    _project(tmp_path, "per-file-ignores = { 'tests/**' = ['GL2'], 'model.py' = ['GL201'] }")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(BAD_LORA + "LoRABatchInfo(bs=1, max_len=0, seg_lens=s)\n")
    (tmp_path / "other.py").write_text(BAD_LORA)
    result = CliRunner().invoke(main, [str(tmp_path)])
    assert [Path(line.split(":")[0]).name for line in result.stdout.splitlines()] == ["other.py"]


def test_settings_selection_prefixes():
    s = Settings(root=Path("."), select=("GL1", "GL201"), ignore=("GL10",))
    assert s.selected("GL201") and s.selected("GL110") and not s.selected("GL101") and not s.selected("GL202")


# -- user contracts: require must name params; built-in codes are taken ----------------------------------
def test_user_contract_require_outside_params_is_a_config_error(tmp_path):
    _project(tmp_path, "[[tool.guardlint.contracts]]\ncall = 'mylib.ops.fwd'\nparams = ['x', 'max_len']\n"
                       "require = [['max_seqlen']]\n")
    (tmp_path / "use.py").write_text("from mylib.ops import fwd\nfwd(1)\n")
    r = CliRunner().invoke(main, [str(tmp_path / "use.py")])
    assert r.exit_code == 2 and "Traceback" not in r.output
    for words in ("contracts[0].require[0]", "'max_seqlen'", "['x', 'max_len']", "'mylib.ops.fwd'"):
        assert words in r.stderr


def test_user_contract_require_may_name_a_field_of_a_param(tmp_path):
    _project(tmp_path, "[[tool.guardlint.contracts]]\ncall = 'mylib.ops.fwd'\nparams = ['x', 'meta']\n"
                       "require = [['meta.max_len']]\n")
    (tmp_path / "use.py").write_text("x = 1\n")
    assert CliRunner().invoke(main, [str(tmp_path / "use.py")]).exit_code == 0


@pytest.mark.parametrize("code", ["GL000", "GL101", "GL201", "GL104"])
def test_user_contract_cannot_take_a_built_in_code(tmp_path, code):
    _project(tmp_path, f"[[tool.guardlint.contracts]]\ncall = 'mylib.ops.fwd'\nparams = ['x', 'max_len']\n"
                       f"require = [['max_len']]\ncode = '{code}'\n")
    (tmp_path / "use.py").write_text("from mylib.ops import fwd\nfwd(1)\n")
    r = CliRunner().invoke(main, [str(tmp_path / "use.py")])
    assert r.exit_code == 2 and "contracts[0].code" in r.stderr and repr(code) in r.stderr
    assert "built-in" in r.stderr


def test_user_contract_with_its_own_code(tmp_path):
    _project(tmp_path, "[[tool.guardlint.contracts]]\ncall = 'mylib.ops.fwd'\nparams = ['x', 'max_len']\n"
                       "require = [['max_len']]\ncode = 'GL901'\n")
    (tmp_path / "use.py").write_text("from mylib.ops import fwd\nfwd(1)\n")
    r = CliRunner().invoke(main, [str(tmp_path / "use.py")])
    assert r.exit_code == 1 and "GL901" in r.stdout


@pytest.mark.parametrize("name", [".git", "build", "node_modules", "foo_bar-1.x", "a.b.c"])
def test_glob_bare_name_is_pathspecs_own_regex(name):
    from guardlint.lint.config import _pattern_class

    assert Glob.compile(name).regex.pattern == _pattern_class()(name).regex.pattern
    assert PathMatcher([name]).matches(f"src/{name}/x.py") and not PathMatcher([name]).matches(f"src/{name}x/y.py")
