"""Reading pasted error output: what the command line hands over (a file, stdin or the message itself),
decoding, stripping colour codes and log prefixes, and a line-by-line reader that finds each exception
(chained, pytest, IPython or a bare line), its frames outermost first, and the lines that quote a frame's code.
"""
from __future__ import annotations

import codecs
import os
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_TS = r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2})?(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2}| ?UTC)?"
# Only a line that *starts* with a timestamp loses its prefix: `[2025-06-12 10:41:07 TP0] `, docker's
# `2025-06-12T10:41:07.123Z `, CRI's `<ts> stderr F `, `<ts> ERROR `, `<ts> | `. What follows keeps its
# indentation, which is how frames, source lines and the exception line are told apart.
_LOG_PREFIX = re.compile(
    rf"^\s*(?:\[{_TS}[^\]\n]*\]|{_TS})"
    r"(?: (?:stdout|stderr) [FP])?"
    r"(?:\s*[|:-]?\s*(?:\[[^\]\n]*\]|DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)(?![\w.]))*"
    r"(?:\s*[|:-](?=\s))? ?"
)
_SYSLOG_PREFIX = re.compile(r"^[A-Z][a-z]{2} [ \d]\d \d{2}:\d{2}:\d{2} \S+ [\w./-]+(?:\[\d+\])?: ")


# A traceback inside one line of a JSON log: `"exc_info": "Traceback (most recent call last):\\n  File \\"...`.
_ESCAPED_TRACEBACK = "most recent call last):\\n"
_ESCAPED_LINE = re.compile(r"^.*most recent call last\):\\n.*$", re.M)
_ESCAPES = re.compile(r"\\(.)")
_ESCAPED = {"n": "\n", "t": "\t", '"': '"', "'": "'", "\\": "\\", "/": "/"}


def _unescape(line: str) -> str:
    return _ESCAPES.sub(lambda m: _ESCAPED.get(m.group(1), m.group(0)), line)


def decode(data: Union[bytes, str]) -> str:
    """Text from whatever was pasted or piped: UTF-8 (with or without BOM) or UTF-16 (PowerShell's ``>``),
    undecodable bytes replaced, never an exception."""
    if isinstance(data, str):
        return data
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return data.decode("utf-16", errors="replace")
    # UTF-16 without a BOM: every other byte is NUL in ASCII text.
    if len(data) >= 8 and data[1::2].count(0) > 0.9 * (len(data) // 2):
        return data.decode("utf-16-le", errors="replace")
    return data.decode("utf-8-sig", errors="replace")


# -- the command line's input ----------------------------------------------------------------------------

class InputError(ValueError):
    """An argument that names a file that cannot be read: a usage error, not a message to diagnose."""


_PATH_SUFFIXES = (".txt", ".log", ".out")
_LONG_OPTION = re.compile(r"^--[A-Za-z][\w-]*(?:=.*)?$")


def looks_like_path(arg: str) -> bool:
    """One word that ends like a saved log or holds a path separator: meant as a file, not as a message."""
    return (bool(arg) and not any(c.isspace() for c in arg)
            and (arg.lower().endswith(_PATH_SUFFIXES) or "/" in arg or "\\" in arg))


def _read_file(arg: str) -> bytes:
    if os.path.isdir(arg):
        raise InputError(f"{arg!r} is a folder, not a file")
    try:
        with open(arg, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise InputError(f"no such file: {arg!r}") from None
    except OSError as e:
        raise InputError(f"cannot read {arg!r}: {e.strerror or e}") from None


def join_arguments(args: Sequence[str]) -> str:
    """The message typed as arguments. Unquoted words (``ValueError: max_seqlen should be ...``) make one
    line; a quoted argument with spaces is a line of its own (``"assert x is not None" AssertionError``),
    except after a lone ``Type:``; an argument with newlines is kept as it is."""
    lines: list[str] = []
    words = False  # the last line ends with a one-word argument: the next word goes on it
    for arg in args:
        word = not any(c.isspace() for c in arg)
        after_type = bool(lines) and " " not in lines[-1] and lines[-1].endswith(":")
        if lines and ((word and words) or (after_type and "\n" not in arg)):
            lines[-1] += " " + arg.strip()
        else:
            lines.append(arg)
        words = word
    return "\n".join(lines) + "\n"


def read_arguments(args: Sequence[str]) -> Optional[Union[bytes, str]]:
    """What ``guardlint diagnose ARGS`` diagnoses: None for stdin (no argument, or ``-``); the contents of an
    existing file; the files of several arguments that all name files; else the arguments as the message.
    A single word that looks like a path (``looks_like_path``) but names no file is an ``InputError``."""
    args = list(args)
    if not args or args == ["-"]:
        return None
    # Unknown options reach here as words (a message may hold `-:`); a long option is a typo, not a message.
    typo = next((a for a in args if _LONG_OPTION.match(a)), None)
    if typo is not None:
        raise InputError(f"no such option: {typo}")
    if all(os.path.isfile(a) or os.path.isdir(a) or looks_like_path(a) for a in args):
        return b"\n".join(_read_file(a) for a in args)
    return join_arguments(args)


def normalize_lines(text: str) -> list[str]:
    """Lines without colour codes, control characters or leading log timestamps."""
    text = _CONTROL.sub("", _ANSI.sub("", text.replace("\r\n", "\n").replace("\r", "\n")))
    if _ESCAPED_TRACEBACK in text:
        text = _ESCAPED_LINE.sub(lambda m: _unescape(m.group(0)), text)
    out = []
    for line in text.split("\n"):
        line = line.rstrip()
        m = _LOG_PREFIX.match(line) or _SYSLOG_PREFIX.match(line)
        out.append(line[m.end():] if m else line)
    return out


# -- traceback structure --------------------------------------------------------------------------------

@dataclass
class Frame:
    """One frame of a traceback: ``file`` as printed, 1-based ``line``, ``function`` when shown."""

    file: str
    line: int
    function: Optional[str] = None
    source: Optional[str] = None

    def as_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "function": self.function, "source": self.source}

    def location(self) -> str:
        return f"{self.file}:{self.line}" + (f", in {self.function}" if self.function else "")


@dataclass
class ErrorBlock:
    """One exception of the input (one link of a chain): frames outermost first, the exception line
    (``Type: message``) and the message's further lines. ``style``: python, pytest, ipython or bare."""

    style: str
    start: int
    end: int = -1
    frames: list = field(default_factory=list)
    exception: Optional[str] = None
    exception_index: Optional[int] = None
    message: list = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join([self.exception or "", *self.message])

    @property
    def exception_type(self) -> Optional[str]:
        m = EXCEPTION_LINE.match(self.exception or "")
        return m.group("type") if m else None


_TB_START = re.compile(r"Traceback \(most recent call last\)")
_CHAIN = re.compile(r"During handling of the above exception, another exception occurred|"
                    r"The above exception was the direct cause of the following exception")
_PY_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<function>.+))?$')
_IPY_FRAME = re.compile(r"^File (?P<file>\S.*?):(?P<line>\d+)(?:, in (?P<function>[^\s(]+))?")
_IPY_CELL = re.compile(r"^Cell (?P<file>In ?\[\d+\]), line (?P<line>\d+)(?:, in (?P<function>[^\s(]+))?")
_IPY_ARROW = re.compile(r"^\s*-*>\s*\d+\s(?P<source>.*)$")
_IPY_SKIP = re.compile(r"^\s*\[\.\.\. skipping")
_MARKERS = re.compile(r"^[\^~\s]+$")
_PYTEST_HEADER = re.compile(r"^_{3,} (?P<test>.+?) _{3,}$")
_PYTEST_RULE = re.compile(r"^(?:={3,}.*|(?:_ )+_?)$")
_PYTEST_LOC = re.compile(r"^(?P<file>(?:[A-Za-z]:)?[^\s:][^:]*?\.pyw?):(?P<line>\d+):"
                         r"(?: in (?P<function>\S+)| (?P<rest>.*))?$")
_PYTEST_E = re.compile(r"^E(?:\s+(?P<text>.*))?$")
_PYTEST_ARROW = re.compile(r"^>\s+(?P<source>.*)$")
_DEF = re.compile(r"^\s*(?:async\s+)?def\s+(?P<name>\w+)\s*\(")
EXCEPTION_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::(?: (?P<message>.*))?)?$")
_EXCEPTION_NAME = re.compile(r"(?:Error|Exception|Exit|Interrupt|Warning|Fault|Failure|Failed|Iteration)$")


def looks_like_exception(line: str) -> bool:
    m = EXCEPTION_LINE.match(line) if ":" in line else None
    return bool(m and m.group("message") is not None
                and _EXCEPTION_NAME.search(m.group("type").rsplit(".", 1)[-1]))


def _prefix_template(prefix: str) -> Optional[re.Pattern]:
    """A per-line prefix seen before ``Traceback`` (``app-1  | ``), digits generalised, so that the same
    prefix with another timestamp or counter is stripped from the following lines."""
    if not prefix.strip():
        return None
    return re.compile("".join(r"\d+" if part.isdigit() else re.escape(part)
                              for part in re.split(r"(\d+)", prefix)))


class _Reader:
    """A line-by-line state machine: python / IPython tracebacks, pytest's report styles, bare lines.
    Besides the blocks it records which lines quote a frame's code (``code_of``: line index -> frame)."""

    def __init__(self, lines: Sequence[str]):
        self.lines = lines
        self.blocks: list[ErrorBlock] = []
        self.code_of: dict[int, Frame] = {}
        self.block: Optional[ErrorBlock] = None
        self.state = ""  # frames | message | pytest
        self.template: Optional[re.Pattern] = None
        self.pending_def: Optional[str] = None
        self.pending_source: Optional[str] = None
        self.pending_lines: list[int] = []
        self.want_source = False

    def read(self) -> list[ErrorBlock]:
        for i, line in enumerate(self.lines):
            if self.template is not None:
                m = self.template.match(line)
                if m:
                    line = line[m.end():]
            self._line(i, line)
        self._close(len(self.lines) - 1)
        return self.blocks

    def _open(self, style: str, i: int) -> ErrorBlock:
        self._close(i - 1)
        self.block = ErrorBlock(style, start=i)
        self.blocks.append(self.block)
        self.pending_def = self.pending_source = None
        self.pending_lines = []
        self.want_source = False
        return self.block

    def _close(self, i: int) -> None:
        if self.block is not None:
            self.block.end = max(i, self.block.start)
        self.block, self.state = None, ""

    def _line(self, i: int, line: str) -> None:
        tb = _TB_START.search(line) if "Traceback" in line else None
        if tb:
            prefix = line[:tb.start()]
            # IPython's header: `RuntimeError      Traceback (most recent call last)`, no colon.
            ipython = (bool(prefix.strip()) and EXCEPTION_LINE.match(prefix.strip()) is not None
                       and not line.rstrip().endswith(":"))
            self._open("ipython" if ipython else "python", i)
            if not ipython:
                self.template = _prefix_template(prefix)
            self.state = "frames"
            return
        if "above exception" in line and _CHAIN.search(line):
            pytest = self.block is not None and self.block.style == "pytest"
            self._close(i - 1)
            if pytest:  # pytest prints the next link's source before its location lines
                self._open("pytest", i + 1)
                self.state = "pytest"
            return
        if self.state == "frames":
            self._frame_line(i, line)
        elif self.state == "message":
            if not line.strip():
                self._close(i - 1)
            elif self._current.style == "bare" and "File" in line and _PY_FRAME.match(line):
                # The error line pasted first, then the frame it came from.
                self.state = "frames"
                self._frame_line(i, line)
            elif (self._current.style == "bare" and not line[:1].isspace()
                  and looks_like_exception(line.strip())):
                # Error lines pasted one after another: each is an error of its own.
                block = self._open("bare", i)
                block.exception, block.exception_index = line.strip(), i
                self.state = "message"
            else:
                self._current.message.append(line)
        else:
            self._outside_line(i, line)

    def _frame_line(self, i: int, line: str) -> None:
        block = self._current
        m = _PY_FRAME.match(line) or _IPY_FRAME.match(line) or _IPY_CELL.match(line)
        if m:
            function = m.group("function")
            block.frames.append(Frame(m.group("file"), int(m.group("line")),
                                      function.strip() if function else None))
            return
        stripped = line.strip()
        if not stripped or _IPY_SKIP.match(line) or stripped.startswith("[Previous line repeated"):
            return
        arrow = _IPY_ARROW.match(line) if block.style == "ipython" else None
        # An indented `Type: message` after a frame's code is the exception line under a log prefix
        # that left a space behind, not more code.
        quoted = line[0].isspace() and not (
            (not block.frames or block.frames[-1].source is not None) and looks_like_exception(stripped))
        if arrow or quoted:
            if block.frames:
                self.code_of[i] = block.frames[-1]
                if arrow:
                    block.frames[-1].source = arrow.group("source").strip()
                elif (block.style == "python" and block.frames[-1].source is None
                      and not _MARKERS.match(stripped)):
                    block.frames[-1].source = stripped
            return
        if block.exception is not None:  # frames pasted after their error line: this line is new text
            self._close(i - 1)
            self._outside_line(i, line)
            return
        block.exception, block.exception_index = stripped, i
        self.state = "message"

    @property
    def _current(self) -> ErrorBlock:
        """The block being read: there is one whenever ``state`` is set."""
        assert self.block is not None
        return self.block

    def _pytest_block(self, i: int) -> ErrorBlock:
        if self.block is None or self.block.style != "pytest":
            block = self._open("pytest", i)
            self.state = "pytest"
            return block
        return self.block

    def _outside_line(self, i: int, line: str) -> None:
        # Cheap tests first: most lines of a long log are none of these.
        header = _PYTEST_HEADER.match(line) if line.startswith("___") else None
        if header:
            self._open("pytest", i)
            self.state = "pytest"
            return
        e = _PYTEST_E.match(line) if line.startswith("E") else None
        if e:
            block = self._pytest_block(i)
            text = (e.group("text") or "").strip()
            if block.exception is None and text:
                block.exception, block.exception_index = text, i
            elif text:
                block.message.append(text)
            return
        loc = _PYTEST_LOC.match(line) if ".py" in line else None
        if loc:
            block = self._pytest_block(i)
            frame = Frame(loc.group("file"), int(loc.group("line")), loc.group("function") or self.pending_def,
                          self.pending_source)
            block.frames.append(frame)
            # --tb=long/auto print a frame's code before its location line.
            self.code_of.update((j, frame) for j in self.pending_lines)
            rest = (loc.group("rest") or "").strip()
            if block.exception is None and looks_like_exception(rest):  # --tb=line
                block.exception, block.exception_index = rest, i
            self.want_source = loc.group("function") is not None  # --tb=short: the code follows
            self.pending_def = self.pending_source = None
            self.pending_lines = []
            return
        if self.state == "pytest":
            if _PYTEST_RULE.match(line):
                if line.startswith("="):
                    self._close(i - 1)
                return
            if not line.strip():
                return
            if not line[:1].isspace() and looks_like_exception(line.strip()):
                # Not pytest's: a logged error in captured output, or after a warning's location line.
                block = self._open("bare", i)
                block.exception, block.exception_index = line.strip(), i
                self.state = "message"
                return
            if self.want_source and line[:1].isspace() and self._current.frames:
                frame = self._current.frames[-1]
                self.code_of[i] = frame
                if frame.source is None and not _MARKERS.match(line.strip()):
                    frame.source = line.strip()
                return
            self.want_source = False
            self.pending_lines.append(i)
            arrow = _PYTEST_ARROW.match(line)
            if arrow:
                self.pending_source = arrow.group("source").strip()
                return
            d = _DEF.match(line)
            if d:
                self.pending_def = d.group("name")
            return
        if looks_like_exception(line.strip()) and not line[:1].isspace():
            block = self._open("bare", i)
            block.exception, block.exception_index = line.strip(), i
            self.state = "message"
        elif "File" in line and _PY_FRAME.match(line):
            # Frames pasted without the `Traceback` line above them: the last frame or two and the error.
            self._open("python", i)
            self.state = "frames"
            self._frame_line(i, line)


@dataclass
class Parsed:
    """The input as ``diagnose`` sees it: normalised lines, exceptions in input order (a chain's cause
    first) and the lines that quote a frame's code."""

    lines: list
    blocks: list
    code_of: dict


def parse(text: str) -> Parsed:
    lines = normalize_lines(text)
    reader = _Reader(lines)
    blocks = reader.read()
    return Parsed(lines, blocks, reader.code_of)
