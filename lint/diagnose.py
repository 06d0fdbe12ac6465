"""Matching an error to the catalog: from the exceptions ``tracebacks.py`` reads, the rule they match,
the user's frame (``frames.py``) and the command that finds the same pattern elsewhere. Rules are
recognised by the catalog's ``Diagnosis.patterns``, its ``ENGINE_ERRORS`` (told apart by the line or frame
that raised them) and a ``GuardError``'s ``[GLxxx]`` code; nothing here knows an error text. The answer
keeps to the engine the error came from: its solutions only.
"""
from __future__ import annotations

import re
import shlex
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Optional, Sequence, Union

from guardlint.contracts import Contract, all_contracts
from guardlint.contracts.catalog import ENGINE_ERRORS, EngineError

from .frames import ENGINES, USER_PSEUDO_FILE, is_library_frame, search_dir, user_frame
from .tracebacks import EXCEPTION_LINE, ErrorBlock, Frame, Parsed, decode, looks_like_exception, parse

if TYPE_CHECKING:
    from .commands import run_diagnose
    from .diagnose_output import as_dict, as_json, as_text

# -- matching -------------------------------------------------------------------------------------------

# Not a suppression comment (`# guardlint: ignore[GL101]`) in a quoted source line.
_GUARD_CODE = re.compile(r"(?<!ignore)\[(?P<code>GL\d{3})(?:\s+[a-z0-9][a-z0-9-]*)?\]")
_GUARD_FIX = re.compile(r"^\s*fix: (?P<fix>.+)$", re.M)
# Evidence, strongest first: a GuardError's own code on an exception line; a pattern on an exception
# line; a GuardError code elsewhere (a log line); a pattern elsewhere; a code pattern in the code that a
# traceback quotes from the user's own frames (a hint about the cause, never a diagnosis by itself).
# Code quoted from library frames is no evidence at all: the engine's source spells out its own errors.
GUARD_CODE_IN_EXCEPTION, PATTERN_IN_EXCEPTION, GUARD_CODE_IN_TEXT, PATTERN_IN_TEXT = 4, 3, 2, 1
PATTERN_IN_USER_CODE = 0
EVIDENCE = {4: "guard-error-code", 3: "exception-line", 2: "guard-code-in-text", 1: "text", 0: "user-code"}


@dataclass(frozen=True)
class _Hit:
    tier: int
    position: int
    span: int
    contract: Contract
    line: str
    block: Optional[ErrorBlock]
    entry: Optional[EngineError] = None
    raised_at: Optional[Frame] = None
    exception: Optional[str] = None  # the exception line pasted after a matched line, if any

    @property
    def rank(self) -> tuple:
        # A rule that is one possible cause among several yields to a certain one of the same tier.
        return (self.tier, not (self.entry and self.entry.confirm), self.position, self.span)


def _regexes(contract: Contract) -> tuple:
    return (rf"\b{re.escape(contract.code)}\b", *contract.diagnosis.patterns)


def _longest_match(contract: Contract, text: str) -> tuple[int, int]:
    """The longest match of the contract's patterns in ``text``: (its length, where it starts)."""
    best, at = 0, 0
    for pattern in _regexes(contract):
        for m in re.finditer(pattern, text):
            if m.end() - m.start() > best:
                best, at = m.end() - m.start(), m.start()
    return best, at


# A frame-confirmed engine error outranks a plain pattern on the same exception line.
_FRAME_CONFIRMED = 1000


def _posix(file: str) -> str:
    return file.replace("\\", "/")


def _needs_frames(entry: EngineError) -> bool:
    return bool(entry.file or entry.source or entry.callee)


def _quotes(frame: Frame, pattern: str) -> bool:
    return bool(frame.source and re.search(pattern, frame.source))


def _raising_frame(entry: EngineError, frames: Sequence[Frame]) -> Optional[Frame]:
    """The frame that tells ``entry`` apart (see ``EngineError``), or None when the frames rule it out."""
    if entry.file:
        frame = next((f for f in reversed(frames) if re.search(entry.file, _posix(f.file))), None)
        if frame is None or (entry.source and not _quotes(frame, entry.source)):
            return None
        return frame
    if not frames:
        return None
    inner = frames[-1]
    if entry.source and _quotes(inner, entry.source):
        return inner
    if not (entry.callee and inner.function and re.search(entry.callee, inner.function)):
        return None
    # The callee's own line (``return (x + y - 1) // y``) says nothing; the line that called it does.
    call = re.compile(rf"\b{re.escape(inner.function)}\s*\(")
    caller = next((f for f in reversed(frames[:-1]) if f.source and call.search(f.source)), None)
    if caller is None:
        return None if entry.source else inner
    return caller if entry.source and _quotes(caller, entry.source) else None


def _engine_error(entry: EngineError, block: ErrorBlock) -> Optional[tuple]:
    """(match on the exception, the raising frame) when ``block`` is this engine error, else None."""
    m = re.search(entry.exception, block.text, re.M)
    if m is None:
        return None
    if not _needs_frames(entry):
        return m, None
    frame = _raising_frame(entry, block.frames)
    return (m, frame) if frame is not None else None


def _line_of(text: str, at: int) -> str:
    start = text.rfind("\n", 0, at) + 1
    end = text.find("\n", at)
    return text[start:end if end >= 0 else len(text)].strip()


def _spans_by_line(lines: Sequence[str], contracts: Sequence[Contract]) -> dict:
    """{line index: {code: longest match starting on that line}}: one scan of the whole text per regex
    (a regex led by ``\\b`` has no fast scan, so a code is first looked for as a plain substring)."""
    joined = "\n".join(lines)
    starts = list(accumulate((len(line) + 1 for line in lines[:-1]), initial=0))
    found: dict = {}
    for contract in contracts:
        for k, pattern in enumerate(_regexes(contract)):
            if k == 0 and contract.code not in joined:
                continue
            for m in re.finditer(pattern, joined):
                if m.end() > m.start():
                    per_line = found.setdefault(bisect_right(starts, m.start()) - 1, {})
                    per_line[contract] = max(per_line.get(contract, 0), m.end() - m.start())
    return found


def _hits(parsed: Parsed, contracts: Sequence[Contract]) -> list[_Hit]:
    by_code = {c.code: c for c in contracts}
    lines, blocks = parsed.lines, parsed.blocks
    spans_by_line = _spans_by_line(lines, contracts)
    candidates = [c for c in contracts if any(c in spans for spans in spans_by_line.values())]
    hits: list[_Hit] = []
    for position, block in enumerate(blocks):
        if block.exception is None:
            continue
        text = block.text
        for m in _GUARD_CODE.finditer(text):
            contract = by_code.get(m.group("code"))
            if contract is not None:
                hits.append(_Hit(GUARD_CODE_IN_EXCEPTION, position, m.end() - m.start(), contract,
                                 _line_of(text, m.start()), block))
        for contract in candidates:
            span, at = _longest_match(contract, text)
            if span:
                hits.append(_Hit(PATTERN_IN_EXCEPTION, position, span, contract, _line_of(text, at), block))
        for entry in ENGINE_ERRORS:
            contract = by_code.get(entry.code)
            found = _engine_error(entry, block) if contract is not None else None
            if found and contract is not None:
                m, frame = found
                span = m.end() - m.start() + (_FRAME_CONFIRMED if frame is not None else 0)
                hits.append(_Hit(PATTERN_IN_EXCEPTION, position, span, contract, _line_of(text, m.start()), block,
                                 entry, frame))
    # An engine error that needs no frame, in a log line or a pasted message without its type.
    joined = "\n".join(lines)
    starts = list(accumulate((len(line) + 1 for line in lines[:-1]), initial=0))
    for entry in ENGINE_ERRORS:
        contract = by_code.get(entry.code)
        if _needs_frames(entry) or contract is None:
            continue
        for m in re.finditer(entry.exception, joined, re.M):
            i = bisect_right(starts, m.start()) - 1
            if m.end() > m.start() and i not in parsed.code_of:
                block = next((b for b in blocks if b.start <= i <= b.end), None)
                hits.append(_Hit(PATTERN_IN_TEXT, i, m.end() - m.start(), contract, lines[i].strip(), block, entry))
    hits += _alone_hits(parsed, by_code)
    block_of_frame = {id(f): b for b in blocks for f in b.frames}
    for i in sorted(set(spans_by_line) | {i for i, line in enumerate(lines) if "[GL" in line}):
        line, spans = lines[i], spans_by_line.get(i, {})
        frame = parsed.code_of.get(i)
        if frame is not None:
            # Quoted code is matched against code patterns only (kind "pattern", e.g. a host read of
            # cu_seqlens); an error text that a test or the engine's source spells out is no evidence.
            if not is_library_frame(frame.file):
                hits += [_Hit(PATTERN_IN_USER_CODE, i, span, c, line.strip(), block_of_frame.get(id(frame)))
                         for c, span in spans.items() if c.kind == "pattern"]
            continue
        on_line = [(GUARD_CODE_IN_TEXT, m.end() - m.start(), by_code[m.group("code")])
                   for m in _GUARD_CODE.finditer(line) if m.group("code") in by_code]
        on_line += [(PATTERN_IN_TEXT, span, c) for c, span in spans.items()]
        if on_line:
            block = next((b for b in blocks if b.start <= i <= b.end), None)
            hits += [_Hit(tier, i, span, contract, line.strip(), block) for tier, span, contract in on_line]
    return hits


def _alone_hits(parsed: Parsed, by_code: dict) -> list[_Hit]:
    """Errors whose source line is their whole text (an assert without a message), pasted without the
    frame that quotes it: the line alone, or followed by its exception line."""
    hits: list[_Hit] = []
    entries = [e for e in ENGINE_ERRORS if e.alone and e.source and e.code in by_code]
    if not entries:
        return hits
    lines = parsed.lines
    for i, line in enumerate(lines):
        stripped = line.strip()
        if i in parsed.code_of or not stripped:
            continue
        for entry in entries:
            m = re.search(entry.source, stripped)
            if m is None:
                continue
            after = next((s.strip() for s in lines[i + 1:] if s.strip()), "")
            exception = after if re.search(entry.exception, after) else None
            block = next((b for b in parsed.blocks if b.start <= i <= b.end), None)
            hits.append(_Hit(PATTERN_IN_TEXT, i, m.end() - m.start(), by_code[entry.code], stripped, block, entry,
                             exception=exception))
    return hits


# -- the answer -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DiagnoseResult:
    """What ``guardlint diagnose`` answers. ``contract`` is None when no rule matches the error itself;
    ``related`` are codes matched only by code quoted from the user's frames (hints for the command).
    ``engine``: the serving engine the error came from (only its solutions are shown); ``raised_at``: the
    frame that told an argument-less error apart; ``confirm``: set when the rule is one possible cause among
    several, saying how to confirm it; ``also``: other errors of the input, each (code, its message, fix);
    ``engine_summary``: the matched engine error's own summary line, if it has one."""

    contract: Optional[Contract]
    message: Optional[str]
    frame: Optional[Frame]
    matches: tuple = ()
    related: tuple = ()
    evidence: Optional[str] = None
    exception_type: Optional[str] = None
    guard_fix: Optional[str] = None
    program: Optional[str] = None
    files: tuple = ()
    engine: Optional[str] = None
    raised_at: Optional[Frame] = None
    confirm: Optional[str] = None
    also: tuple = ()
    engine_summary: Optional[str] = None

    @property
    def code(self) -> Optional[str]:
        return self.contract.code if self.contract else None

    @property
    def solutions(self) -> tuple:
        """The solutions the answer shows: the engine's own where it has some (see ``solutions_for``)."""
        return solutions_for(self.contract, self.engine) if self.contract else ()

    @property
    def summary(self) -> Optional[str]:
        """The contract's summary, or the engine's own terms for it (the matched engine error's, else the
        engine's target's ``message``): the contract's names arguments that engine may not take."""
        if self.contract is None:
            return None
        if self.engine_summary:
            return self.engine_summary
        if self.engine:
            for target in self.contract.targets:
                if target.message and target.qualname.split(".")[0] == self.engine:
                    return target.message
        return self.contract.summary

    @property
    def engine_name(self) -> Optional[str]:
        """The engine as its solutions spell it (vLLM), when only its solutions are shown."""
        if self.engine is None:
            return None
        names = {_solution_engine(s, spelled=True) for s in self.solutions}
        return next(iter(names)) if len(names) == 1 and None not in names else None

    @property
    def fix(self) -> Optional[str]:
        if self.contract is None:
            return None
        return self.guard_fix or next(iter(self.solutions), None)

    @property
    def lint_command(self) -> Optional[str]:
        codes = lint_codes(self.contract) if self.contract else []
        codes += [code for code in self.related if code not in codes and _linted(code)]
        if not codes:
            return None
        return f"guardlint --select {','.join(codes)} {_quote(search_dir(self.frame))}"

    @property
    def command(self) -> Optional[str]:
        """The lint run that finds the same pattern elsewhere; for a runtime-only code without one, the
        run that catches it early; ``guardlint rules`` when nothing matched."""
        if self.contract is None:
            return self.lint_command or "guardlint rules"
        return self.lint_command or run_command(self.contract, self.program)

    @property
    def prevention(self) -> Optional[str]:
        if self.contract is None or self.contract.linted:
            return None
        return prevention(self.contract, self.program, self.solutions)


_ENGINE_SOLUTION = re.compile(r"In (?P<engine>[\w.-]+):")


def _solution_engine(solution: str, spelled: bool = False) -> Optional[str]:
    """The engine a solution is written for ("In vLLM: ..."), None for a general one."""
    m = _ENGINE_SOLUTION.match(solution)
    if m is None or m.group("engine").lower() not in ENGINES:
        return None
    return m.group("engine") if spelled else m.group("engine").lower()


def solutions_for(contract: Contract, engine: Optional[str] = None) -> tuple:
    """The solutions that apply where the error came from. A known engine gets only its own (those starting
    "In <engine>:"), or the general ones where the contract has none for it: another engine's fix is wrong
    there (vLLM takes no forward_metadata). Without an engine: the general ones, then each engine's. Each
    text once."""
    solutions = tuple(dict.fromkeys(contract.diagnosis.solutions))
    if engine:
        own = tuple(s for s in solutions if _solution_engine(s) == engine.lower())
        general = tuple(s for s in solutions if _solution_engine(s) is None)
        return own or general or solutions
    return solutions


def fix_for(contract: Contract, engine: Optional[str] = None) -> Optional[str]:
    """The first solution for ``engine`` (see ``solutions_for``)."""
    return next(iter(solutions_for(contract, engine)), None)


def _engine_of(hit: "_Hit", hits: Sequence["_Hit"] = ()) -> Optional[str]:
    """The engine whose frames the error runs through (the innermost one), else that of an engine error
    matched on the same line for the same rule."""
    frames = hit.block.frames if hit.block else []
    for frame in reversed(frames):
        parts = set(re.split(r"[\\/]+", frame.file))
        engine = next((e for e in ENGINES if e in parts), None)
        if engine:
            return engine
    same = (h for h in (hit, *hits) if h.entry and h.entry.engine and h.contract is hit.contract
            and h.line == hit.line)
    return next((h.entry.engine for h in same if h.entry), None)


def _linted(code: str) -> bool:
    return any(c.code == code and c.linted for c in all_contracts())


def lint_codes(contract: Contract, contracts: Sequence[Contract] = ()) -> list[str]:
    """The rule codes that find ``contract``'s pattern statically: itself and its linted twins (the same
    kind of check on a shared target, e.g. GL101 and GL102). Empty for runtime-only codes."""
    if not contract.linted:
        return []
    shared = set(contract.targets)
    return [c.code for c in (contracts or all_contracts())
            if c.code == contract.code or (shared and c.linted and c.kind == contract.kind
                                           and shared.intersection(c.targets))]


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w@%+=:,./\\-]+", arg) else shlex.quote(arg)


# An environment setting named in a contract's solutions, e.g. GUARDLINT_MODE=strict or TRITON_INTERPRET=1.
_ENV_SETTING = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+=[\w.-]+")


def env_setting(contract: Contract) -> Optional[str]:
    m = _ENV_SETTING.search(" ".join(contract.diagnosis.solutions))
    return m.group(0) if m else None


def run_command(contract: Contract, program: Optional[str] = None) -> Optional[str]:
    """For a runtime-only code: the program run again with the setting its solutions name, if any."""
    setting = env_setting(contract)
    return f"{setting} {program or 'python <your program>'}" if setting else None


def prevention(contract: Contract, program: Optional[str] = None, solutions: Optional[Sequence[str]] = None) -> str:
    solutions = contract.diagnosis.solutions if solutions is None else solutions
    text = (f"{contract.code} is raised at runtime only: no static check finds it. "
            f"Prevent it: {solutions[0] if solutions else 'see guardlint explain ' + contract.code}")
    command = run_command(contract, program)
    if command:
        text += f" Or, as its solutions say, run with {env_setting(contract)}: {command}"
    return text


def _quoted(hit: _Hit) -> str:
    """The line that shows ``hit``'s error; an exception line without a message (a bare assert) is
    followed by the source line that raised it, which is what tells it apart."""
    if hit.raised_at is not None and hit.raised_at.source and hit.line and ":" not in hit.line:
        return f"{hit.line}: {hit.raised_at.source}"
    return hit.line


def _program(blocks: Sequence[ErrorBlock]) -> Optional[str]:
    """How the failing program was started, when an outermost frame shows it (a script or a test file)."""
    for block in blocks:
        if not block.frames:
            continue
        first = block.frames[0]
        if is_library_frame(first.file) or first.file.startswith("<") or USER_PSEUDO_FILE.match(first.file):
            continue
        if block.style == "pytest":
            return f"python -m pytest {_quote(first.file)}"
        if first.function == "<module>":
            return f"python {_quote(first.file)}"
    return None


def diagnose(text: Union[str, bytes], contracts: Optional[Sequence[Contract]] = None) -> DiagnoseResult:
    """Match an error message or traceback to the catalog. The strongest evidence wins: a GuardError's
    ``[GLxxx]`` code, then a pattern on an exception line (the latest exception of a chain first), then
    text elsewhere; among equals, the longest (most specific) pattern match."""
    contracts = tuple(contracts) if contracts else all_contracts()
    parsed = parse(decode(text))
    blocks = parsed.blocks
    hits = sorted(_hits(parsed, contracts), key=lambda h: h.rank, reverse=True)
    matches = tuple(dict.fromkeys(h.contract.code for h in hits))
    related = tuple(dict.fromkeys(h.contract.code for h in hits if h.tier == PATTERN_IN_USER_CODE))
    files = tuple(dict.fromkeys(f.file for b in blocks for f in b.frames))
    program = _program(blocks)
    best = next((h for h in hits if h.tier > PATTERN_IN_USER_CODE), None)
    if best is None:
        last = next((b for b in reversed(blocks) if b.exception), None)
        frame = next((f for b in reversed(blocks) for f in [user_frame(b.frames)] if f), None)
        return DiagnoseResult(None, last.exception if last else None, frame, matches, related,
                              exception_type=last.exception_type if last else None, program=program,
                              files=files)
    block = best.block
    frame = user_frame(block.frames) if block else None
    if frame is None:
        # A chain link raised entirely inside libraries: the user's call is in another link.
        frame = next((f for b in reversed(blocks) for f in [user_frame(b.frames)] if f), None)
    guard_fix = None
    if best.tier in (GUARD_CODE_IN_EXCEPTION, GUARD_CODE_IN_TEXT) and block is not None:
        m = _GUARD_FIX.search(block.text)
        guard_fix = m.group("fix").strip() if m else None
    message = best.line or (block.exception if block else None)
    engine = _engine_of(best, hits)
    # Other errors of the input, each quoted with its own line: two messages pasted together, a log line
    # beside a traceback, the other link of a chain.
    also, seen = [], {best.contract.code}
    for h in hits:
        # Two exceptions of the same bare line (`AssertionError`) are two errors; one line that two rules
        # match is one error (listed under "Also matched").
        other = h.line != best.line or (h.block is not None and h.block is not best.block)
        if h.tier > PATTERN_IN_USER_CODE and h.contract.code not in seen and other:
            seen.add(h.contract.code)
            also.append((h.contract.code, _quoted(h), fix_for(h.contract, _engine_of(h, hits))))
    exception_line = EXCEPTION_LINE.match(message) if message and looks_like_exception(message) else None
    pasted_after = EXCEPTION_LINE.match(best.exception) if best.exception else None
    if best.tier in (GUARD_CODE_IN_EXCEPTION, PATTERN_IN_EXCEPTION) and block is not None:
        exception_type = block.exception_type
    elif exception_line:
        exception_type = exception_line.group("type")
    elif pasted_after:
        exception_type = pasted_after.group("type")
    else:
        exception_type = None
    return DiagnoseResult(best.contract, message, frame, matches, related, EVIDENCE[best.tier], exception_type,
                          guard_fix, program, files, engine, best.raised_at,
                          best.entry.confirm if best.entry and best.entry.confirm else None, tuple(also),
                          best.entry.summary if best.entry and best.entry.engine == engine else None)


# Moved to the command layer and its output module; importable from here on first use.
_MOVED = {"as_dict": "diagnose_output", "as_json": "diagnose_output", "as_text": "diagnose_output",
          "run_diagnose": "commands"}

__all__ = ["DiagnoseResult", "diagnose", "fix_for", "solutions_for", "lint_codes", "prevention", "run_command",
           "env_setting",
           # re-exported from the modules this one was split into
           "Frame", "ErrorBlock", "Parsed", "decode", "parse", "is_library_frame", "user_frame", "search_dir",
           "as_dict", "as_json", "as_text", "run_diagnose"]


def __getattr__(name: str):
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__package__}.{module}"), name)
