"""The base distribution is the linter: it runs without torch, and the runtime half says which extra it needs.

Building a venv without torch is too slow for every run, so torch, triton and numpy are hidden from a
subprocess instead: a meta-path finder that refuses them, as if they were not installed.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRA = "pip install 'guardlint[torch]'"

BLOCK = (
    "import sys\n"
    "class _Hide:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('torch', 'triton', 'numpy'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r} (hidden by the test)', name=name)\n"
    "        return None\n"
    "sys.meta_path.insert(0, _Hide())\n"
    "for _m in [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'numpy')]:\n"
    "    del sys.modules[_m]\n"
)


def run_hidden(code: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_the_blocker_hides_torch():
    out = run_hidden("import torch\n")
    assert out.returncode == 1 and "ModuleNotFoundError" in out.stderr and "hidden by the test" in out.stderr


@pytest.mark.parametrize("module", ["guardlint.guard", "guardlint.kernels", "guardlint.kernels.lora",
                                    "guardlint.integrations", "guardlint.integrations.transformers",
                                    "guardlint.integrations.sglang", "guardlint.integrations.vllm"])
def test_the_runtime_half_without_torch_names_the_extra(module):
    code = (
        "import guardlint\n"
        "try:\n"
        f"    import {module}\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
        "else:\n"
        "    print('imported')\n"
    )
    out = run_hidden(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ImportError "), out.stdout
    assert EXTRA in out.stdout and "needs torch" in out.stdout, out.stdout


def test_import_guardlint_and_the_contracts_need_no_torch():
    out = run_hidden("import guardlint, guardlint.contracts, guardlint.lint\nprint(guardlint.__version__)\n")
    assert out.returncode == 0 and out.stdout.strip() == __import__("guardlint").__version__, out.stderr


def test_the_linter_runs_without_torch_triton_or_numpy(tmp_path):
    code = (
        "from guardlint.lint.cli import main\n"
        "sys.argv = ['guardlint'] + sys.argv[1:]\n"
        "main()\n"
    )
    out = run_hidden(code, str(ROOT / "examples"))
    assert out.returncode == 1, out.stderr           # findings, not a crash
    assert "GL101" in out.stdout and "GL201" in out.stdout and "vit_fixed.py" not in out.stdout, out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    (tmp_path / "clean.py").write_text("import torch\n\nx = torch.zeros(3)\n", encoding="utf-8")
    out = run_hidden(code, str(tmp_path / "clean.py"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_diagnose_runs_without_torch_triton_or_numpy():
    code = (
        "from guardlint.lint.cli import main\n"
        "sys.argv = ['guardlint', 'diagnose', sys.argv[1]]\n"
        "main()\n"
    )
    out = run_hidden(code, str(ROOT / "examples" / "traceback.txt"))
    assert out.returncode == 0, out.stderr
    assert "GL1" in out.stdout or "GL2" in out.stdout, out.stdout
    assert "Traceback" not in out.stderr, out.stderr


# -- the distribution's metadata ------------------------------------------------------------------------

tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else None


@pytest.mark.skipif(tomllib is None, reason="tomllib is Python 3.11+")
def test_base_dependencies_are_the_linters_and_the_extras_bring_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in project["dependencies"]}
    assert names == {"libcst", "click", "pathspec"}
    extras = project["optional-dependencies"]
    assert {"torch", "triton", "numpy"} <= {d.split(">")[0].split("=")[0].strip() for d in extras["torch"]}
    for extra in ("gpu", "transformers", "test"):
        assert "guardlint[torch]" in extras[extra], extra
    assert project["license"] == "Apache-2.0"


def test_the_package_is_typed():
    assert (ROOT / "_guardlint" / "py.typed").is_file()


@pytest.mark.parametrize("folder", ["kernels", "lint"])
def test_lazy_exports_are_visible_to_type_checkers(folder):
    """``__all__`` is a literal list equal to the lazy ``_EXPORTS``, and each export is imported under
    ``if TYPE_CHECKING:`` from the submodule ``_EXPORTS`` names, so pyright/mypy and IDEs see them."""
    tree = ast.parse((ROOT / folder / "__init__.py").read_text(encoding="utf-8"))
    exports = all_ = None
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "_EXPORTS":
                exports = ast.literal_eval(node.value)
            elif node.targets[0].id == "__all__":
                all_ = ast.literal_eval(node.value)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1
                for alias in imp.names:
                    typed[alias.asname or alias.name] = imp.module
    assert exports and isinstance(all_, list)
    assert sorted(all_) == sorted(exports)
    assert typed == exports
