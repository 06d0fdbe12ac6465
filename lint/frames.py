"""Which frames of a traceback are the user's: not torch, triton, flashinfer, an engine's library code (its
model files are the user's), an installed package, the standard library or guardlint itself. The
innermost such frame is where the failing call was made, and its folder is where to look for more.
"""
from __future__ import annotations

import re
import sysconfig
from functools import lru_cache
from pathlib import PurePosixPath, PureWindowsPath
from typing import Iterable, Optional

from .tracebacks import Frame

# Frames in these packages (a path component of this name) are never the user's code...
LIBRARY_PARTS = frozenset({"torch", "triton", "flashinfer", "sglang", "vllm", "site-packages", "dist-packages",
                           "importlib", "_guardlint"})
# ...except the engines' model files, wherever installed: there a model calls the attention layer, and that
# call is where the metadata is to be passed (the engine's backends, LoRA and scheduler stay library code).
_ENGINE_MODEL_FILE = re.compile(r"(?:^|/)(?:sglang/srt/models|vllm/model_executor/models)/[^/]+\.py$")
ENGINES = ("sglang", "vllm")
_GUARDLINT_SUBPACKAGES = ("guard", "kernels", "lint", "contracts")
USER_PSEUDO_FILE = re.compile(r"^(?:<stdin>|<string>|<console>|<input>|<ipython-input-[^>]*>|In ?\[\d+\])$")
_STDLIB = re.compile(r"[\\/]lib(?:64)?[\\/]python\d+(?:\.\d+)?t?[\\/]|(?i:[\\/]python\d*[\\/]lib[\\/])")


@lru_cache(maxsize=1)
def _local_roots() -> tuple[str, ...]:
    """This interpreter's stdlib and guardlint's own folders (an editable install has them outside
    site-packages), as ``/``-separated path prefixes."""
    from importlib.util import find_spec

    roots = [sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib")]
    for sub in _GUARDLINT_SUBPACKAGES:
        try:
            spec = find_spec(f"guardlint.{sub}")
        except (ImportError, ValueError):
            spec = None
        roots += list(spec.submodule_search_locations or []) if spec else []
    return tuple(dict.fromkeys(str(r).replace("\\", "/").rstrip("/") + "/" for r in roots if r))


@lru_cache(maxsize=4096)
def is_library_frame(file: str) -> bool:
    """Is this frame's file part of torch, triton, flashinfer, a serving engine (but for its model files), an
    installed package, the Python standard library or guardlint itself (rather than the user's code)?"""
    if USER_PSEUDO_FILE.match(file):
        return False
    if file.startswith("<"):  # <frozen runpy>, <guardlint wrapper of varlen_attention>
        return True
    if _ENGINE_MODEL_FILE.search(file.replace("\\", "/")):
        return False
    parts = [p for p in re.split(r"[\\/]+", file) if p]
    if LIBRARY_PARTS.intersection(parts):
        return True
    if any(a == "guardlint" and b in _GUARDLINT_SUBPACKAGES for a, b in zip(parts, parts[1:])):
        return True
    if _STDLIB.search(file):
        return True
    posix = file.replace("\\", "/")
    return any(posix.startswith(root) for root in _local_roots())


def user_frame(frames: Iterable[Frame]) -> Optional[Frame]:
    """The innermost frame outside library code: where the user's code made the failing call."""
    return next((frame for frame in reversed(list(frames)) if not is_library_frame(frame.file)), None)


def search_dir(frame: Optional[Frame]) -> str:
    """The folder of the user's frame (where the same mistake most likely repeats), else ``.``."""
    if frame is None or frame.file.startswith("<") or USER_PSEUDO_FILE.match(frame.file):
        return "."
    file = frame.file
    windows = re.match(r"^[A-Za-z]:[\\/]", file) or ("\\" in file and "/" not in file)
    parent = str((PureWindowsPath if windows else PurePosixPath)(file).parent)
    return parent if parent not in ("", ".") else "."
