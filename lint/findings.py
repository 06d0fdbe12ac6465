"""What the linter reports: a ``Finding`` per problem, with the ``Fix`` that ``--fix`` would apply, a
``FileResult`` per file, and the ``Outcome`` (exit code and text) of a command.

Plain data (no libcst), so findings and their fixes travel between worker processes and into every
output format.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional, Union

if TYPE_CHECKING:
    import libcst as cst

Severity = Literal["error", "warning"]
EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
Applicability = Literal["safe", "unsafe"]


@dataclass(frozen=True, order=True)
class Edit:
    """Replace the source range [start, end) by ``content``; lines and columns 1-based, columns in
    characters. An insertion has ``start == end``."""

    line: int
    column: int
    end_line: int
    end_column: int
    content: str

    def to_dict(self) -> dict:
        # ``asdict`` without its deep copy (every field is an int or a string): 56k findings' edits.
        return {"line": self.line, "column": self.column, "end_line": self.end_line,
                "end_column": self.end_column, "content": self.content}


@dataclass(frozen=True, order=True)
class Fix:
    """The edits that fix one finding, applied together or not at all.

    ``applicability`` follows ruff: ``safe`` fixes cannot change what the program computes and are
    applied by ``--fix``; ``unsafe`` ones (they add a runtime dependency, a host read, or rely on a
    field order) only with ``--unsafe-fixes``. ``imports`` are ``(module, name)`` pairs the edits
    add, for readers of the JSON output.
    """

    applicability: Applicability
    message: str
    edits: tuple[Edit, ...]
    imports: tuple[tuple[str, str], ...] = ()

    def applies(self, unsafe_fixes: bool) -> bool:
        return self.applicability == "safe" or unsafe_fixes

    def to_dict(self) -> dict:
        return {"applicability": self.applicability, "message": self.message,
                "edits": [e.to_dict() for e in self.edits]}


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

    def fixable(self, unsafe_fixes: bool) -> bool:
        return self.fix is not None and self.fix.applies(unsafe_fixes)

    def to_dict(self) -> dict:
        return {"path": self.path, "line": self.line, "column": self.column, "end_line": self.end_line,
                "end_column": self.end_column, "code": self.code, "name": self.name, "message": self.message,
                "severity": self.severity, "fix": self.fix.to_dict() if self.fix is not None else None}


@dataclass
class FileResult:
    """Findings of one file. ``module`` (and ``nodes``, the node of each finding) are kept on
    request for a fixer; they do not cross process boundaries."""

    path: str
    findings: list[Finding]
    parsed: bool = False
    module: Optional[cst.Module] = None
    nodes: list = field(default_factory=list)


@dataclass(frozen=True)
class Outcome:
    """What a command answers: its exit code (``EXIT_*``) and the text for stdout and stderr."""

    exit_code: int
    stdout: Union[str, bytes] = ""  # bytes: written as they are (``--fix -`` keeps the input's encoding)
    stderr: str = ""
