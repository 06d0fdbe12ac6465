"""Applying fixes: text edits onto a file's bytes, re-checking, writing atomically, printing diffs.

A file keeps its encoding (PEP 263 cookie or BOM), line breaks and permissions; a fixed version that
does not parse is never written. Fixes whose edits overlap wait for the next round, after a re-check.
"""
from __future__ import annotations

import ast
import difflib
import io
import os
import re
import stat
import tempfile
import tokenize
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .findings import Finding, Fix

# Overlapping fixes (a call fixed inside another fixed call) need a re-check between rounds; real
# files settle in two. The bound only stops a fix that would not satisfy its own contract.
MAX_ROUNDS = 6
_NEWLINE = re.compile(r"\r\n|\r|\n")


@dataclass
class Change:
    """What fixing did to one file: ``after`` is ``before`` when nothing could be applied."""

    path: str
    before: bytes
    after: bytes
    fixed: int = 0  # findings whose fix was applied
    findings: list[Finding] = field(default_factory=list)  # what remains, positions in ``after``
    error: Optional[str] = None  # why the fixed file was not (or could not be) written
    stdin: bool = False  # the source came from standard input

    @property
    def changed(self) -> bool:
        return self.after != self.before


def encoding_of(data: bytes) -> str:
    """The encoding Python reads ``data`` with: a BOM gives ``utf-8-sig`` (so the BOM is kept when
    written back), a PEP 263 cookie its codec, else UTF-8."""
    try:
        return tokenize.detect_encoding(io.BytesIO(data).readline)[0]
    except SyntaxError:
        return "utf-8"


class _Text:
    def __init__(self, text: str):
        self.text = text
        self.starts = [0, *(m.end() for m in _NEWLINE.finditer(text))]

    def offset(self, line: int, column: int) -> int:
        if not 0 < line <= len(self.starts):
            raise ValueError(f"line {line} is outside the file")
        return min(self.starts[line - 1] + column - 1, len(self.text))


def apply_fixes(data: bytes, fixes: Sequence[Fix]) -> tuple[bytes, list[bool]]:
    """``data`` with every fix whose edits do not overlap an earlier one's applied; which were.

    Identical edits (two findings of one call share a fix, two fixes share an import) are applied once;
    insertions at one point go in the order of the fixes."""
    encoding = encoding_of(data)
    text = _Text(data.decode(encoding))
    taken: list[tuple[int, int, str]] = []
    applied: list[bool] = []
    for fix in fixes:
        spans = []
        try:
            for e in fix.edits:
                spans.append((text.offset(e.line, e.column), text.offset(e.end_line, e.end_column), e.content))
        except ValueError:
            applied.append(False)
            continue
        new = [s for s in spans if s not in taken]
        if any(_overlap(s, t) for s in new for t in taken) or any(
                _overlap(a, b) for i, a in enumerate(new) for b in new[i + 1:]):
            applied.append(False)
            continue
        taken.extend(new)
        applied.append(True)
    out = text.text
    # Stable sort by position: from the end backwards, insertions at one point keep their order.
    # From the end backwards; of two insertions at one point the later fix goes in first, so that
    # the earlier one ends up before it.
    order = sorted(range(len(taken)), key=lambda i: (taken[i][0], taken[i][1], i), reverse=True)
    for i in order:
        start, end, content = taken[i]
        out = out[:start] + content + out[end:]
    if not any(applied):
        return data, applied
    return out.encode(encoding), applied


def _overlap(a: tuple[int, int, str], b: tuple[int, int, str]) -> bool:
    (s1, e1, _), (s2, e2, _) = a, b
    if s1 == e1 and s2 == e2:
        return False  # two insertions at one point both go in
    if s1 == e1:
        return s2 < s1 < e2
    if s2 == e2:
        return s1 < s2 < e1
    return s1 < e2 and s2 < e1


def parse_problem(data: bytes) -> Optional[str]:
    """None when CPython parses ``data``; else its error."""
    try:
        ast.parse(data)
    except SyntaxError as e:
        return f"{e.msg} (line {e.lineno})"
    except (ValueError, RecursionError, MemoryError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def fix_source(data: bytes, findings: list[Finding], recheck: Callable[[bytes], list[Finding]], *,
               unsafe_fixes: bool, path: str = "") -> Change:
    """Apply the findings' fixes in rounds until none applies; ``recheck`` lints fixed bytes (with the
    run's selection) so that what remains is reported at its new position."""
    change = Change(path, data, data, findings=list(findings))
    current = data
    for _ in range(MAX_ROUNDS):
        todo = [f for f in change.findings if f.fixable(unsafe_fixes)]
        if not todo:
            break
        fixes = list(dict.fromkeys(f.fix for f in todo))
        new, applied = apply_fixes(current, fixes)
        done = {fix for fix, ok in zip(fixes, applied) if ok}
        if new == current:
            break
        problem = parse_problem(new)
        if problem is not None:
            change.error = f"the fixed file would not parse ({problem}); " + (
                "it was not written" if current == data else "the fixes of earlier rounds were kept")
            break
        change.fixed += sum(1 for f in todo if f.fix in done)
        current = new
        change.findings = recheck(current)
    change.after = current
    return change


# -- writing -----------------------------------------------------------------------------------------
def write_atomic(path: str, data: bytes) -> None:
    """Replace the file at ``path`` (through a symlink: its target) by ``data`` in one step: a
    temporary file in the same folder, the original's mode bits (and owner, where allowed), then
    ``os.replace``, so a reader sees the old file or the new one, never half of it.

    A file with other hard links keeps its inode, so that every name sees the fix: the full new
    content is written and synced to the temporary file first, then copied over the original in
    place (``_write_in_place``)."""
    target = os.path.realpath(path)
    st = os.stat(target)
    if st.st_nlink > 1:
        _write_in_place(target, data)
        return
    tmp = _write_temp(target, data)
    try:
        os.chmod(tmp, stat.S_IMODE(st.st_mode))
        if hasattr(os, "chown"):
            try:
                os.chown(tmp, st.st_uid, st.st_gid)
            except OSError:  # not ours to give away: the file keeps the writer's owner
                pass
        os.replace(tmp, target)
    except BaseException:
        _unlink(tmp)
        raise


def _write_in_place(target: str, data: bytes) -> None:
    """Overwrite ``target`` through its own inode. The new content is first written whole to a
    temporary file beside it (a full disk fails there, before the original is touched); the
    original is then truncated and rewritten from memory. Should that rewrite fail, the old
    content is put back, and the temporary copy of the new one is kept and named in the error."""
    with open(target, "rb") as f:
        before = f.read()
    tmp = _write_temp(target, data)
    try:
        with open(target, "r+b") as f:
            try:
                f.write(data)
                f.truncate()
                f.flush()
                os.fsync(f.fileno())
            except BaseException:
                f.seek(0)
                f.write(before)
                f.truncate()
                f.flush()
                raise
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror or e}; the fixed text is kept in {tmp}") from None
    _unlink(tmp)


def _write_temp(target: str, data: bytes) -> str:
    """``data`` written whole and synced to a new temporary file beside ``target``; returns its path."""
    folder = os.path.dirname(target) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(target) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def unified_diff(path: str, before: bytes, after: bytes) -> str:
    """A unified diff of the decoded texts, as ``patch -p0`` reads it (``\\ No newline at end of
    file`` where one is missing)."""
    encoding = encoding_of(before)
    a = _lines(before.decode(encoding))
    b = _lines(after.decode(encoding))
    out = []
    for line in difflib.unified_diff(a, b, fromfile=path, tofile=path):
        if not line.endswith(("\n", "\r")):
            line += "\n\\ No newline at end of file\n"
        out.append(line)
    return "".join(out)


def _lines(text: str) -> list[str]:
    """Lines with their breaks, split where Python splits source lines (not at \\f or \\x1c)."""
    if not text:
        return []
    ends = [m.end() for m in _NEWLINE.finditer(text)]
    starts = [0, *ends]
    if not ends or ends[-1] != len(text):
        ends.append(len(text))
    return [text[s:e] for s, e in zip(starts, ends)]
