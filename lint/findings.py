"""What the linter reports: a ``Finding`` per problem, with a ``Fix`` slot for a later ``--fix``.

Plain data (no libcst), so findings travel between worker processes and into every output format.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, Optional

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Fix:
    """A replacement of the source range [start, end) by ``replacement``; lines and columns 1-based.

    The range is the one of the node a fixer rewrites (``Finding`` keeps the reported range), so a
    fixer working on the libcst module of ``FileResult.module`` and one working on text agree.
    ``imports`` are ``(module, name)`` pairs the replacement needs.
    """

    start_line: int
    start_column: int
    end_line: int
    end_column: int
    replacement: str
    safety: Literal["safe", "unsafe"] = "unsafe"
    description: str = ""
    imports: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, order=True)
class Finding:
    """One problem at ``path:line:column`` (1-based; ``end_column`` is one past the last character)."""

    path: str
    line: int
    column: int
    code: str
    message: str
    name: str = ""
    severity: Severity = "error"
    end_line: int = 0
    end_column: int = 0
    fix: Optional[Fix] = None

    def sort_key(self) -> tuple:
        return (self.path, self.line, self.column, self.code, self.message)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fix"] = asdict(self.fix) if self.fix is not None else None
        return {k: d[k] for k in ("path", "line", "column", "end_line", "end_column", "code", "name",
                                  "message", "severity", "fix")}
