"""flake8 plugin: ``flake8 --select GL`` reports what ``guardlint check`` reports for the same files, reading the
``[tool.guardlint]`` of the nearest ``pyproject.toml`` above each file and honouring ``# guardlint: ignore[...]``
and ``# noqa``. A file that does not parse never reaches a flake8 plugin (flake8 reports E999 and stops), so
there is no GL000 for a syntax error; guardlint's other GL000s (a file it parsed but could not check) stay.
"""
# flake8 imports this module in every run, even one that never selects GL: only the standard library
# and guardlint's version are imported here; the runner (and libcst, when a file may hold a target)
# load inside run().
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Union

from guardlint._version import __version__

if TYPE_CHECKING:
    import ast

    from .config import Settings
    from .findings import Finding
    from .rules import RuleSet

__all__ = ["Plugin"]

# flake8 runs plugins in worker processes, one file at a time: these live as long as the process, so
# each folder's pyproject.toml lookup and each configuration's parse happen once per worker.
_CONFIG_OF_FOLDER: dict[str, Optional[str]] = {}
# config path (None: no configuration found) -> its settings and rules, or the text of its error
_SETTINGS: dict[Optional[str], Union[tuple[Settings, RuleSet], str]] = {}


class Plugin:
    """guardlint's findings for one file, as flake8 asks for them (``tree`` is what makes flake8 run
    this once per file; the source is re-read from ``lines``, the text flake8 itself checks)."""

    name = "guardlint"
    version = __version__

    def __init__(self, tree: ast.AST, filename: str, lines: list[str]):
        self.filename = filename
        self.lines = lines

    def run(self) -> Iterator[tuple[int, int, str, type]]:
        for f in findings(self.filename, self.lines):
            # guardlint's columns are 1-based, flake8's 0-based (it adds the one back when printing)
            yield f.line, max(f.column - 1, 0), f"{f.code} {f.message}", type(self)


def findings(filename: str, lines: list[str]) -> list[Finding]:
    """What ``guardlint check`` reports for ``filename`` whose text is ``lines``: the project's
    configuration, excludes and suppression comments applied, sorted."""
    found = _settings_for(filename)
    if isinstance(found, str):
        from .engine import file_error

        # A broken [tool.guardlint] is guardlint's exit 2; here it becomes a GL000 on each file it
        # governs, so the run still ends and no file under it looks clean.
        return file_error(filename, f"invalid configuration, the file was not checked: {found}").findings
    settings, rules = found
    from .runner import lint_buffer

    # The command line's own decisions for a file (excludes, pre-filters, module name for relative
    # imports and a package's __init__, selection, per-file ignores), on the text flake8 read.
    return lint_buffer(_source_bytes(lines, filename), filename, settings, rules=rules)


def _settings_for(filename: str) -> Union[tuple[Settings, RuleSet], str]:
    from guardlint.contracts import ConfigError

    from .config import Settings, find_config, load_settings
    from .runner import rules_for

    # As ``guardlint check FILE``: the search starts at the file, or at the working directory for a
    # name that is no file (stdin's display name).
    path = os.path.abspath(filename)
    folder = os.path.dirname(path) if os.path.isfile(path) else os.getcwd()
    if folder not in _CONFIG_OF_FOLDER:
        found = find_config(Path(folder))
        _CONFIG_OF_FOLDER[folder] = str(found) if found is not None else None
    config = _CONFIG_OF_FOLDER[folder]
    if config not in _SETTINGS:
        try:
            # No configuration above the file: the defaults, rooted where flake8 runs (as the command line)
            settings = load_settings(config=config) if config is not None else Settings(root=Path.cwd())
            _SETTINGS[config] = (settings, rules_for(settings))
        except ConfigError as e:
            _SETTINGS[config] = str(e)
    return _SETTINGS[config]


def _source_bytes(lines: list[str], filename: str) -> bytes:
    """The bytes guardlint would have read. flake8 hands over decoded lines and guardlint decodes by the
    file's PEP 263 cookie, so the text is encoded back with the encoding it declares; where flake8 fell
    back to latin-1 (bytes the declared encoding cannot decode), latin-1 gives back the file's bytes, and
    guardlint reports them as the command line does (GL000)."""
    import io
    import tokenize

    text = "".join(lines)
    head = "".join(lines[:2]).encode("utf-8", "surrogatepass")
    try:
        encoding: Optional[str] = tokenize.detect_encoding(io.BytesIO(head).readline)[0]
    except (SyntaxError, LookupError):  # an unknown or malformed cookie: flake8 read latin-1
        encoding = None
    if encoding is not None and (text.isascii() or _decodes(filename, encoding)):
        try:
            return text.encode(encoding)
        except (UnicodeError, LookupError):
            pass
    try:
        return text.encode("latin-1")
    except UnicodeError:
        return text.encode("utf-8", "surrogatepass")


def _decodes(filename: str, encoding: str) -> bool:
    """False when the file on disk is not valid ``encoding``, which is when flake8 read it as latin-1
    (stdin, or a file gone since, counts as valid: flake8 decoded it)."""
    try:
        with open(filename, "rb") as f:
            f.read().decode(encoding)
    except OSError:
        return True
    except (UnicodeError, LookupError):
        return False
    return True
