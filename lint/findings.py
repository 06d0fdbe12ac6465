"""What the linter reports: a ``Finding`` per problem, with the ``Fix`` that ``--fix`` would apply, a
``FileResult`` per file, and the ``Outcome`` (exit code and text) of a command.

Plain data (no libcst), so findings and their fixes travel between worker processes and into every
output format.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Literal, Optional, Union

if TYPE_CHECKING:
    import libcst as cst

Severity = Literal["error", "warning"]
EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
# ``guardlint check --output-format``: ``text`` is ruff's ``concise`` (both names are taken); ``full`` adds
# the source line, the note and the fix under each finding.
FORMATS = ("text", "concise", "full", "json", "sarif", "github")
Applicability = Literal["safe", "unsafe"]
# A finding's message is one terminal line: ``[<headline>: ]<facts>`` (the call and what it lacks), then
# ``; no fix: <why>`` where the rule has fixes and this call gets none. The why and the how in full are
# the finding's ``note`` and the rule's ``guardlint explain`` page.
NO_FIX = "; no fix: "
# A finding's message fits a line of this many characters: a reason that would not fit is said shorter.
MESSAGE_WIDTH = 120


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
    # The longer text behind the message, one sentence a line: what the kernel would say, why no fix is
    # written and what to do instead (``--output-format full`` prints it, JSON carries it).
    note: str = ""

    def sort_key(self) -> tuple:
        return (self.path, self.line, self.column, self.code, self.message)

    def fixable(self, unsafe_fixes: bool) -> bool:
        return self.fix is not None and self.fix.applies(unsafe_fixes)

    def to_dict(self) -> dict:
        return {"path": self.path, "line": self.line, "column": self.column, "end_line": self.end_line,
                "end_column": self.end_column, "code": self.code, "name": self.name, "message": self.message,
                "severity": self.severity, "fix": self.fix.to_dict() if self.fix is not None else None,
                "note": self.note}


def message(facts: str, headline: str = "") -> str:
    """A finding's one-line message before any no-fix reason (``without_fix`` adds that)."""
    return f"{headline}: {facts}" if headline else facts


def without_fix(message: str, note: str, why: str) -> tuple[str, str]:
    """A finding's message and note when its fix is refused for ``why`` (a ``NoFix`` reason: its first
    line goes on the message, the rest to the note)."""
    if not why:
        return message, note
    short, _, instead = why.partition("\n")
    return message + NO_FIX + short, "\n".join(part for part in (note, instead) if part)


def per_layer_place(context: str) -> str:
    """Why code runs per layer (``X.forward, which runs once per layer``, ``a loop over self.blocks``) as
    the place it runs in: ``X.forward``, ``a loop over self.blocks``."""
    return context.removesuffix(", which runs once per layer")


def share_reasons(findings: Iterable[Finding]) -> list[Finding]:
    """Findings of one call with the same no-fix reason (GL101 and GL102 in a per-layer forward) say it
    once: the first code keeps it, the others end in ``; no fix (same call as GL101)``. Run on the
    findings a user sees (after selection and ignores), so the one named is never a hidden one."""
    findings = list(findings)
    first: dict[tuple, Finding] = {}
    for f in findings:
        _, sep, why = f.message.partition(NO_FIX)
        if sep:
            key = (f.path, f.line, f.column, why)
            if key not in first or f.code < first[key].code:
                first[key] = f
    if len(first) == sum(1 for f in findings if NO_FIX in f.message):
        return findings  # no reason repeats
    out = []
    for f in findings:
        head, sep, why = f.message.partition(NO_FIX)
        said = first.get((f.path, f.line, f.column, why)) if sep else None
        if said is not None and said.code != f.code:
            # The note keeps its own lines (what this code's kernel says) and drops what the first says.
            shared = set(said.note.splitlines())
            note = "\n".join(line for line in f.note.splitlines() if line not in shared)
            f = dataclasses.replace(f, message=f"{head}; no fix (same call as {said.code})", note=note)
        out.append(f)
    return out


@dataclass
class FileResult:
    """Findings of one file. ``module`` (and ``nodes``, the node of each finding) are kept on
    request for a fixer; they do not cross process boundaries. ``facts``: what the callee summaries
    need of the file (``summaries.FileFacts``), when asked for."""

    path: str
    findings: list[Finding]
    parsed: bool = False
    module: Optional[cst.Module] = None
    nodes: list = field(default_factory=list)
    facts: object = None


@dataclass(frozen=True)
class Outcome:
    """What a command answers: its exit code (``EXIT_*``) and the text for stdout and stderr."""

    exit_code: int
    stdout: Union[str, bytes] = ""  # bytes: written as they are (``--fix -`` keeps the input's encoding)
    stderr: str = ""
