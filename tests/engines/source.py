"""Run an engine's own functions and classes without importing the engine.

The engines' import chains need GPUs and hundreds of packages, so the tests take the source of the
definitions they exercise from a pinned release (``fetch.py``) with ``ast``, compile it under the engine
file's real name (tracebacks point at the engine's lines), and execute it in a namespace where only the
GPU kernels are replaced by recording fakes. Everything else the definitions use is the real thing:
torch, einops, triton's helpers, and the engine's other definitions named in the same load.
"""
from __future__ import annotations

import __future__
import ast
import enum
import functools
import sys
import types
from pathlib import Path
from typing import Any, Iterable

import pytest

from fetch import RELEASES, release_dir


class VllmBackend(enum.Enum):
    """The members of vLLM's AttentionBackendEnum its encoder-attention helpers and layers compare against."""
    FLASH_ATTN = "FLASH_ATTN"
    ROCM_AITER_FA = "ROCM_AITER_FA"
    TRITON_ATTN = "TRITON_ATTN"
    FLASHINFER = "FLASHINFER"
    TORCH_SDPA = "TORCH_SDPA"


def module_path(release: str, module: str) -> Path:
    """``sglang.srt.layers.attention.vision`` in a fetched release, or skip... never: fail loudly."""
    root = release_dir(release)
    if not root.is_dir():
        pytest.fail(f"engine release {release} is not fetched: run `make engines` "
                    f"(python tests/engines/fetch.py {RELEASES[release][0]})", pytrace=False)
    path = root / (module.replace(".", "/") + ".py")
    if not path.is_file():
        raise FileNotFoundError(f"{release}: {module} ({path}) not found: has the engine moved it?")
    return path


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _defined(node: ast.stmt) -> Iterable[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
    elif isinstance(node, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Name):
                yield target.id
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        yield node.target.id


def definition(release: str, module: str, name: str) -> ast.stmt:
    """The top-level statement of ``module`` that defines ``name`` (the last one, as Python keeps)."""
    found = [n for n in _tree(module_path(release, module)).body if name in _defined(n)]
    if not found:
        raise LookupError(f"{release}: {module} defines no top-level {name!r}: has the engine renamed it?")
    return found[-1]


def load(release: str, module: str, names: Iterable[str], namespace: dict) -> dict:
    """Execute the definitions of ``names`` from ``module`` (in file order) in ``namespace``; return it.

    ``namespace`` supplies what they reference: real modules, and fakes for the GPU kernels only.
    """
    path = module_path(release, module)
    wanted = set(names)
    body = [n for n in _tree(path).body if wanted & set(_defined(n))]
    missing = wanted - {d for n in body for d in _defined(n)}
    if missing:
        raise LookupError(f"{release}: {module} defines no top-level {sorted(missing)}: has the engine renamed it?")
    tree = _tree(path)
    # The file's own future imports (``annotations`` changes how dataclasses read their fields).
    flags = 0
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            for alias in node.names:
                flags |= getattr(__future__, alias.name).compiler_flag
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec", flags=flags, dont_inherit=True)
    # A real module object under a private name: dataclasses and pickling look classes up in sys.modules.
    name = f"_engine_{release.replace('.', '_').replace('-', '_')}.{module}"
    mod = sys.modules.get(name) or types.ModuleType(name)
    mod.__dict__.update(namespace)
    mod.__file__ = str(path)
    sys.modules[name] = mod
    exec(code, mod.__dict__)
    namespace.update(mod.__dict__)
    return namespace


def parameters(release: str, module: str, qualname: str) -> list:
    """Parameter names of a function or method (``Class.method``), read from the source."""
    head, _, method = qualname.partition(".")
    node: Any = definition(release, module, head)
    if method:
        node = next((n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == method), None)
        if node is None:
            raise LookupError(f"{release}: {module}.{qualname} not found")
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    if a.vararg:
        names.append("*" + a.vararg.arg)
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return names


def dataclass_fields(release: str, module: str, name: str) -> list:
    """Field names of a dataclass, in declaration order (positional construction follows it)."""
    node = definition(release, module, name)
    return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


class Recorder:
    """A fake GPU kernel: records each call's arguments and answers with ``respond(*args, **kwargs)``."""

    def __init__(self, respond=None) -> None:
        self.calls: list = []
        self.respond = respond

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.respond(*args, **kwargs) if self.respond else None

    def __getitem__(self, grid: Any) -> "Recorder":
        """``kernel[grid](...)``: a Triton launch; the grid is recorded with the call."""
        def launch(*args: Any, **kwargs: Any) -> Any:
            g = grid(kwargs) if callable(grid) else grid
            self.calls.append((args, dict(kwargs, _grid=g)))
            return None
        return launch

    @property
    def last(self) -> tuple:
        assert self.calls, "the fake kernel was never reached"
        return self.calls[-1]
