"""Suppression comments: ``# guardlint: ignore[GL101,GL102]``, ``# guardlint: ignore``, ``# noqa: GL101``
and bare ``# noqa``. Only real comments count (found with ``tokenize``), never text in strings.
"""
from __future__ import annotations

import io
import re
import tokenize
from typing import Optional

ALL = frozenset({"*"})
_GUARDLINT = re.compile(r"#\s*guardlint:\s*ignore(?:\[(?P<codes>[^\]]*)\])?", re.IGNORECASE)
_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[\s,]+[A-Z]+[0-9]+)*))?", re.IGNORECASE)
_CODE = re.compile(r"[A-Z]+[0-9]+", re.IGNORECASE)


def parse_comment(text: str) -> frozenset[str]:
    """Codes a comment suppresses (``ALL`` for all, empty for none)."""
    codes: set[str] = set()
    for rx in (_GUARDLINT, _NOQA):
        for m in rx.finditer(text):
            group = m.group("codes")
            if group is None or not group.strip():
                return ALL
            codes.update(c.upper() for c in _CODE.findall(group))
    return frozenset(codes)


def may_suppress(data: bytes) -> bool:
    """Cheap test before tokenizing: no file without these words has a suppression, nor a UTF-8 file
    whose text nowhere matches what a suppression comment must (a comment is part of the text; files
    that import guardlint name it without suppressing anything)."""
    lower = data.lower()
    if b"noqa" not in lower and b"guardlint" not in lower:
        return False
    first = data.find(b"\n")
    second = data.find(b"\n", first + 1) if first >= 0 else -1
    if b"coding" in (data if second < 0 else data[:second]):  # a PEP 263 cookie: maybe not UTF-8
        return True
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return _GUARDLINT.search(text) is not None or _NOQA.search(text) is not None


def suppressions(data: bytes) -> Optional[dict[int, frozenset[str]]]:
    """Line -> suppressed codes, from the file's comments; None when the file cannot be tokenized."""
    out: dict[int, frozenset[str]] = {}
    try:
        for tok in tokenize.tokenize(io.BytesIO(data).readline):
            if tok.type == tokenize.COMMENT:
                codes = parse_comment(tok.string)
                if codes:
                    out[tok.start[0]] = codes | out.get(tok.start[0], frozenset())
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError, LookupError):
        return None
    return out


def is_suppressed(table: dict[int, frozenset[str]], code: str, lines) -> bool:
    for line in lines:
        codes = table.get(line)
        if codes and (codes is ALL or "*" in codes or code in codes):
            return True
    return False
