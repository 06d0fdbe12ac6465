"""Which files a run checks: the Python files under the named paths, in a stable order, with excludes
and what git ignores left out, the named paths that do not exist or are not checked, and the dotted module
name of each file (from the package folders around it).
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .config import PathMatcher, Settings, UsageError, relative_to_root

SOURCE_SUFFIXES = (".py", ".pyi")


@dataclass
class Discovery:
    files: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # named paths that do not exist
    skipped: list[tuple[str, str]] = field(default_factory=list)  # named paths not checked, and why


def discover(paths: Sequence[str], settings: Settings) -> list[str]:
    """Python files under ``paths`` (``*.py``, ``*.pyi``), excludes applied, in a stable order; a path
    that does not exist is a UsageError (``find_files`` reports it and goes on)."""
    found = find_files(paths, settings)
    if found.missing:
        raise UsageError(f"{found.missing[0]}: no such file or directory")
    return found.files


def find_files(paths: Sequence[str], settings: Settings) -> Discovery:
    """Python files under ``paths`` (``*.py``, ``*.pyi``), excludes applied, in a stable order, with
    the named paths that do not exist and those that are not checked (excluded, not Python).

    Below a folder, files and folders that git ignores are skipped (one ``git ls-files`` per folder
    argument) unless ``settings.respect_gitignore`` is off; files named directly are always kept,
    even a dangling or looping symlink (reading it is then that file's GL000)."""
    matcher = PathMatcher(settings.exclude)
    found = Discovery()
    out = found.files
    for arg in paths:
        p = Path(arg)
        if not os.path.lexists(arg):
            found.missing.append(arg)
            continue
        is_dir = p.is_dir()
        rel = relative_to_root(p, settings.root)
        if rel not in ("", ".") and matcher.matches(rel, is_dir):
            pattern = matcher.first_match(rel, is_dir)
            found.skipped.append((arg, f"excluded by the pattern {pattern!r}"
                                       + (f" ({settings.config_path})" if settings.config_path else "")))
            continue
        if not is_dir:
            why = _not_python(arg)
            if why:
                found.skipped.append((arg, why))
            else:
                out.append(os.path.normpath(arg))
            continue
        ignored = git_ignored(arg) if settings.respect_gitignore else GitIgnored()
        base_rel = "" if rel in ("", ".") else rel + "/"
        for dirpath, dirnames, filenames in os.walk(arg):
            sub = os.path.relpath(dirpath, arg)
            sub_rel = base_rel + ("" if sub == "." else Path(sub).as_posix() + "/")
            sub_git = "" if sub == "." else Path(sub).as_posix() + "/"
            dirnames[:] = sorted(d for d in dirnames if not _leaf_matches(matcher, sub_rel + d, True)
                                 and not ignored.folder(sub_git + d))
            for name in sorted(filenames):
                if (name.endswith(SOURCE_SUFFIXES) and not _leaf_matches(matcher, sub_rel + name, False)
                        and not ignored.file(sub_git + name)):
                    out.append(os.path.normpath(os.path.join(dirpath, name)))
    found.files = list(dict.fromkeys(out))
    return found


# Named files of these kinds are reported as skipped, with the reason, rather than parsed as Python.
_NOT_CHECKED = {".ipynb": "a Jupyter notebook; only Python source files (.py, .pyi) are checked"}


def _not_python(path: str) -> str:
    """Why a file named on the command line is not checked; "" when it is a Python source: ``.py``,
    ``.pyi``, or a script without a suffix whose first line is a python shebang (pre-commit's
    ``types: [python]`` passes those)."""
    if path.endswith(SOURCE_SUFFIXES):
        return ""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in _NOT_CHECKED:
        return _NOT_CHECKED[suffix]
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        first = b""
    if first.startswith(b"#!") and b"python" in first:
        return ""
    return f"not a Python source file (expected .py, .pyi or a python script, got {suffix or 'no suffix'})"


@dataclass(frozen=True)
class GitIgnored:
    """What git ignores below one folder, as paths relative to it (posix, folders without the slash)."""

    files: frozenset = frozenset()
    folders: frozenset = frozenset()

    def file(self, rel: str) -> bool:
        return rel in self.files

    def folder(self, rel: str) -> bool:
        return rel in self.folders


def git_ignored(folder: str) -> GitIgnored:
    """One ``git ls-files --others --ignored --exclude-standard --directory`` in ``folder``: ignored
    folders come back whole (``build/``), so discovery never walks into them. Outside a git work
    tree, or without git, nothing is ignored."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--others", "--ignored", "--exclude-standard",
                              "--directory"], cwd=folder, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return GitIgnored()
    if out.returncode != 0:
        return GitIgnored()
    files, folders = set(), set()
    for entry in out.stdout.decode("utf-8", "surrogateescape").split("\0"):
        if not entry or entry == "./":  # the folder itself: named on the command line, so kept
            continue
        if entry.endswith("/"):
            folders.add(entry.rstrip("/"))
        else:
            files.add(entry)
    return GitIgnored(frozenset(files), frozenset(folders))


def _leaf_matches(matcher: PathMatcher, rel: str, is_dir: bool) -> bool:
    # Parents were matched (and pruned) on the way down.
    return any(g.matches(rel, is_dir) for g in matcher.globs)


_PACKAGE_CACHE: dict[str, Optional[str]] = {}


def module_name_for(path: str) -> tuple[Optional[str], bool]:
    """Dotted module name from the package folders (those with ``__init__.py``) around ``path``."""
    p = Path(path)
    stem = p.name.rsplit(".", 1)[0]
    if not stem.isidentifier():
        return None, False
    package = _package_of(str(p.parent.resolve()) if p.parent != Path("") else os.getcwd())
    is_package = stem == "__init__"
    if is_package:
        return package, True
    return (f"{package}.{stem}" if package else stem), False


def _package_of(folder: str) -> Optional[str]:
    if folder in _PACKAGE_CACHE:
        return _PACKAGE_CACHE[folder]
    name: Optional[str] = None
    if os.path.isfile(os.path.join(folder, "__init__.py")):
        leaf = os.path.basename(folder)
        if leaf.isidentifier():
            parent = _package_of(os.path.dirname(folder)) if os.path.dirname(folder) != folder else None
            name = f"{parent}.{leaf}" if parent else leaf
    _PACKAGE_CACHE[folder] = name
    return name
