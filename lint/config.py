"""``[tool.guardlint]`` settings: rule selection, excludes, per-file ignores and user contracts.

Found in the nearest ``pyproject.toml`` with a ``[tool.guardlint]`` table upward from the first path
(or the working directory), or given with ``--config``. Errors name the key and exit with 2.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from guardlint.contracts import ConfigError, Contract, all_contracts, contract_from_config

# ``exclude`` adds to the default excludes (ruff's ``extend-exclude``); both spellings are taken, so a
# ruff configuration reads the same.
KEYS = ("select", "ignore", "exclude", "extend-exclude", "per-file-ignores", "respect-gitignore", "contracts",
        "follow-bindings")
DEFAULT_EXCLUDE = (".git", ".venv", "venv", "__pycache__", "build", "dist", "node_modules", ".tox", ".eggs")
# A rule is selected by its code, a prefix of codes (``GL1``) or its name (``missing-max-seqlen``), as in ruff.
# Codes and prefixes are kept upper case and names lower case, so a kept selector that starts with "GL" is
# a prefix.
SELECTOR = re.compile(r"^GL\d{0,3}$")
_CODE_LIKE = re.compile(r"^[A-Za-z]+\d*$")


class UsageError(ValueError):
    """A command-line problem (unknown rule code, missing path); exit code 2."""


@dataclass(frozen=True)
class Settings:
    root: Path
    config_path: Optional[Path] = None
    select: tuple[str, ...] = ("GL",)
    ignore: tuple[str, ...] = ()
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    per_file_ignores: tuple[tuple[str, tuple[str, ...]], ...] = ()
    contracts: tuple[Contract, ...] = field(default=())
    # Skip files and folders that git ignores (inside a git work tree); files named on the command
    # line are checked anyway.
    respect_gitignore: bool = True
    # GL104 follows code bound per layer at run time (reach.py): typed factories' impls, installed forwards
    follow_bindings: bool = True

    def selected(self, code: str, name: str = "") -> bool:
        return matches_any(self.select, code, name) and not matches_any(self.ignore, code, name)

    def known_codes(self) -> set[str]:
        return {c.code for c in (*all_contracts(), *self.contracts)}


def matches_any(selectors: Iterable[str], code: str, name: str = "") -> bool:
    """``code`` (of the rule named ``name``) is one of ``selectors``, as resolved by ``resolve_selectors``."""
    return any(code.startswith(s) if s[:2] == "GL" else s == name for s in selectors)


def resolve_selectors(values: Iterable[str], contracts: Iterable[Contract], key: str,
                      error: type[ValueError] = ConfigError) -> tuple[str, ...]:
    """Codes, prefixes and rule names as ``Settings`` keeps them; one that matches no rule of
    ``contracts`` (the catalog and the configuration's own) is an error naming it, as ruff refuses
    ``--select XYZ``: a typo must not turn a check off in silence."""
    contracts = tuple(contracts)
    codes = sorted({c.code for c in contracts})
    names = {c.name.lower() for c in contracts}
    out = []
    for raw in values:
        value = raw.strip()
        upper = value.upper()
        if SELECTOR.match(upper) and any(code.startswith(upper) for code in codes):
            out.append(upper)
        elif value.lower() in names:
            out.append(value.lower())
        elif _CODE_LIKE.match(value):
            raise error(f"{key}: {raw!r} matches no rule (known: {', '.join(codes)})")
        else:
            raise error(f"{key}: {raw!r} matches no rule (known names: {', '.join(sorted(names))})")
    return tuple(out)


# -- gitignore-like globs -----------------------------------------------------------------------------
def _pattern_class():
    """pathspec's gitignore pattern: ``GitIgnoreBasicPattern`` from pathspec 1.0 on (where the older
    ``gitwildmatch`` name is deprecated), ``GitWildMatchPattern`` before."""
    try:
        from pathspec.patterns.gitignore.basic import GitIgnoreBasicPattern

        return GitIgnoreBasicPattern
    except ImportError:  # pathspec < 1.0
        from pathspec.patterns.gitwildmatch import GitWildMatchPattern

        return GitWildMatchPattern


_PLAIN_NAME = re.compile(r"^(?!\.+$)[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Glob:
    """One pattern, matched like a .gitignore line (by pathspec) against a path relative to the project
    root: with no ``/`` inside it matches a name at any depth, with one it is anchored at the root; a
    trailing ``/`` matches directories only; ``*`` stays within a path segment, ``**`` crosses them."""

    pattern: str
    regex: re.Pattern

    @classmethod
    def compile(cls, pattern: str, key: str = "exclude") -> "Glob":
        p = pattern.strip()
        if not p:
            raise ConfigError(f"{key}: empty pattern")
        if p.startswith("!"):
            raise ConfigError(f"{key}: negated patterns ({pattern!r}) are not supported")
        if p.startswith("#"):
            raise ConfigError(f"{key}: pattern {pattern!r} starts with '#', which gitignore reads as a "
                              f"comment; write '\\#...' to match a name that starts with '#'")
        if p.startswith("./"):
            p = p[2:]
        if _PLAIN_NAME.match(p):
            # A bare name matches that name at any depth; the regex is pathspec's own for it, written
            # here so that the default excludes do not import pathspec (~10 ms of every run).
            return cls(pattern, re.compile(r"^(?:.+/)?" + re.escape(p) + r"(?:/|$)"))
        try:
            compiled = _pattern_class()(p)
        except (ValueError, TypeError, re.error) as e:
            raise ConfigError(f"{key}: invalid pattern {pattern!r}: expected a gitignore-style glob ({e})") \
                from None
        if compiled.regex is None or compiled.include is not True:
            raise ConfigError(f"{key}: invalid pattern {pattern!r}: expected a gitignore-style glob that "
                              f"matches paths, got one that matches nothing")
        return cls(pattern, compiled.regex)

    def matches(self, rel: str, is_dir: bool) -> bool:
        """``rel`` (posix, relative to the root; ``is_dir``: a folder) matches; ``PathMatcher`` tries
        the folders above it."""
        return self.regex.match(rel + "/" if is_dir else rel) is not None


class PathMatcher:
    def __init__(self, patterns: Iterable[str], key: str = "exclude"):
        self.globs = tuple(Glob.compile(p, key) for p in patterns)

    def matches(self, rel: str, is_dir: bool = False) -> bool:
        """True when ``rel`` or one of its parent directories matches (a .gitignore'd directory hides
        everything below it)."""
        return self.first_match(rel, is_dir) is not None

    def first_match(self, rel: str, is_dir: bool = False) -> Optional[str]:
        """The first pattern that matches ``rel`` or one of its parent directories, as written."""
        if not self.globs:
            return None
        parts = rel.split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            d = is_dir or i < len(parts)
            for g in self.globs:
                if g.matches(sub, d):
                    return g.pattern
        return None


def relative_to_root(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` in posix form; outside the root, the path as given."""
    # os.path.realpath, not Path.resolve: a symlink loop must not raise (Python 3.11 raises RuntimeError).
    try:
        return Path(os.path.realpath(path)).relative_to(os.path.realpath(root)).as_posix()
    except ValueError:
        return path.as_posix().lstrip("/")


# -- loading ----------------------------------------------------------------------------------------
def _load_toml(path: Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError(f"{path}: reading TOML needs Python 3.11 or the tomli package") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def find_config(start: Path) -> Optional[Path]:
    """The nearest pyproject.toml with a [tool.guardlint] table, from ``start`` upward."""
    d = start.resolve()
    if not d.is_dir():
        d = d.parent
    for folder in (d, *d.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            try:
                data = _load_toml(candidate)
            except ConfigError:
                # A broken pyproject.toml that is not ours to read is not our error; one with our
                # table is (it is reported when read below).
                if b"[tool.guardlint" in candidate.read_bytes():
                    return candidate
                continue
            if "guardlint" in data.get("tool", {}):
                return candidate
    return None


def _table(path: Path) -> dict:
    data = _load_toml(path)
    tool = data.get("tool")
    if isinstance(tool, dict) and "guardlint" in tool:
        table = tool["guardlint"]
    elif path.name == "pyproject.toml":
        table = {}
    else:
        table = data  # a dedicated file (guardlint.toml) holds the table itself
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: tool.guardlint: expected a table, got {type(table).__name__}")
    return table


def _selectors(value: Any, key: str) -> tuple[str, ...]:
    """The strings of a select/ignore list; they are resolved once the configuration's contracts are known."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: expected a list of rule codes, prefixes or names (strings), got "
                          f"{type(value).__name__}: {value!r}")
    return tuple(value)


def _patterns(value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: expected a list of glob patterns (strings), got "
                          f"{type(value).__name__}: {value!r}")
    PathMatcher(value, key)  # validates
    return tuple(value)


def settings_from_table(table: dict, root: Path, config_path: Optional[Path] = None) -> Settings:
    where = f"{config_path}: tool.guardlint" if config_path else "tool.guardlint"
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
    select = _selectors(table["select"], f"{where}.select") if "select" in table else ("GL",)
    ignore = _selectors(table.get("ignore", []), f"{where}.ignore")
    exclude = (DEFAULT_EXCLUDE + _patterns(table.get("exclude", []), f"{where}.exclude")
               + _patterns(table.get("extend-exclude", []), f"{where}.extend-exclude"))
    respect_gitignore = table.get("respect-gitignore", True)
    if not isinstance(respect_gitignore, bool):
        raise ConfigError(f"{where}.respect-gitignore: expected true or false, got {respect_gitignore!r}")
    follow_bindings = table.get("follow-bindings", True)
    if not isinstance(follow_bindings, bool):
        raise ConfigError(f"{where}.follow-bindings: expected true or false, got {follow_bindings!r}")
    pfi_raw = table.get("per-file-ignores", {})
    if not isinstance(pfi_raw, dict):
        raise ConfigError(f"{where}.per-file-ignores: expected a table of pattern = [codes], got "
                          f"{type(pfi_raw).__name__}: {pfi_raw!r}")
    per_file = []
    for pattern, codes in pfi_raw.items():
        key = f"{where}.per-file-ignores.{pattern!r}"
        _patterns([pattern], key)
        per_file.append((pattern, _selectors(codes, key), key))
    raw_contracts = table.get("contracts", [])
    if not isinstance(raw_contracts, list):
        raise ConfigError(f"{where}.contracts: expected an array of tables ([[tool.guardlint.contracts]]), "
                          f"got {type(raw_contracts).__name__}")
    try:
        contracts = tuple(contract_from_config(raw, i) for i, raw in enumerate(raw_contracts))
    except ConfigError as e:
        raise ConfigError(f"{config_path}: {e}" if config_path else str(e)) from None
    known = (*all_contracts(), *contracts)
    return Settings(root=root, config_path=config_path, select=resolve_selectors(select, known, f"{where}.select"),
                    ignore=resolve_selectors(ignore, known, f"{where}.ignore"), exclude=exclude,
                    per_file_ignores=tuple((pattern, resolve_selectors(codes, known, key))
                                           for pattern, codes, key in per_file),
                    contracts=contracts, respect_gitignore=respect_gitignore, follow_bindings=follow_bindings)


def load_settings(paths: Sequence[str] = (), config: Optional[str] = None, cwd: Optional[Path] = None) -> Settings:
    """Settings for a run over ``paths``: from ``config`` if given, else the nearest configuration."""
    cwd = Path(cwd) if cwd else Path.cwd()
    if config:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"--config: {config}: no such file")
        return settings_from_table(_table(path), path.resolve().parent, path)
    first = next((p for p in paths if p != "-"), None)
    start = (cwd / first) if first else cwd
    found = find_config(start if start.exists() else cwd)
    if found is None:
        return Settings(root=cwd)
    return settings_from_table(_table(found), found.resolve().parent, found)
