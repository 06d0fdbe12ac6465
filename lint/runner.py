"""Runs the linter over the files ``discovery.py`` finds: the textual pre-filter, checking (across
processes when there is enough work), selection, per-file ignores and fixes.
"""
# Reading and pre-filtering happen in this process (a substring search per file, far cheaper than any
# parse). Every file gets CPython's parse, so a syntax error is reported in every file; those that can
# contain a target also go through the tree pre-filter (``prefilter.py``), and the ones it keeps are
# checked with libcst. All run in one pool of worker processes when there is enough work to pay for
# starting them.
# Parsing every file with ``ast`` costs about one more ast.parse of the files the pre-filter skips,
# spread over the workers: on the generated 1216-file tree of bench/lint_speed.py the CLI went from
# 0.81-1.01x to 1.31-1.39x of one process's read + ast.parse (best of 5, a shared 2-core machine),
# inside the 1.5x budget (bench/results/lint_tree_prefilter.md).
from __future__ import annotations

import dataclasses
import os
import stat
import subprocess  # noqa: F401  (``runner.subprocess.run`` is where tests stand in for git)
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from guardlint.contracts import all_contracts

from .config import PathMatcher, Settings, UsageError, matches_any, relative_to_root, resolve_selectors
from .discovery import (SOURCE_SUFFIXES, Discovery, GitIgnored, discover, find_files, git_ignored,
                        module_name_for)
from .findings import FileResult, Finding, share_reasons
from .rules import RuleSet, build_rules

if TYPE_CHECKING:
    from .fixer import Change

__all__ = ["Report", "lint_paths", "lint_source", "fixed_source", "rules_for", "with_options", "read_source",
           "deep_check", "cpu_count", "MIN_PARALLEL", "PARSE_EVERY_FILE", "AST_PREFILTER",
           # re-exported from discovery.py
           "SOURCE_SUFFIXES", "Discovery", "GitIgnored", "discover", "find_files", "git_ignored", "module_name_for"]

PARSE_ERROR = "GL000"
# Below this many files to parse, starting worker processes (fork + libcst import, ~0.1-0.3 s)
# costs more than it saves; a 300-line file parses in ~10 ms.
MIN_PARALLEL = 24
# Every file gets CPython's parse (GL000 everywhere); False: only the pre-filtered ones are parsed, as
# before (kept so that the cost can be measured, bench/results/lint_tree_prefilter.md).
PARSE_EVERY_FILE = False
# Files past the textual pre-filter go to libcst only when their CPython tree holds something a rule
# could report (prefilter.py); False: all of them do, as before (kept so that the gain can be measured).
AST_PREFILTER = True
# GL104 asks, at a per-layer call, the summary of the function it calls (summaries.py): the files that
# can hold such a call are sketched as they are parsed, the summaries are built once from those sketches,
# and the files where a call reaches a host read are checked again with them. False: no summaries, as
# before (kept so that the cost and the findings can be compared).
CALLEE_SUMMARIES = True
# The same in bytes of work: ast.parse takes ~0.3 s per MB, the full check ~6x that.
MIN_PARALLEL_WORK = 1_500_000
FULL_CHECK_WEIGHT = 6
# Once the textual pre-filter has found enough work to start the worker processes (MIN_PARALLEL files to
# parse, or MIN_PARALLEL_WORK bytes), they start, and candidates go to them in batches of this many as it
# finds them: their start and the first checks run beside the rest of the pre-filter instead of after it.
STREAM_BATCH = 4


@dataclass
class Report:
    findings: list[Finding]
    files: int = 0  # files considered
    parsed: int = 0  # files that passed the textual pre-filter
    checked: int = 0  # of those, files that passed the tree pre-filter too: parsed by libcst and checked
    results: list = field(default_factory=list)  # FileResult per parsed file, with keep_modules
    changes: list[Change] = field(default_factory=list)  # with fix="apply" or "diff": files with fixes
    fixed: int = 0  # findings whose fix was applied (or, with "diff", would be)
    missing: list[str] = field(default_factory=list)  # paths named that do not exist
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path named, why it was not checked)


@dataclass(frozen=True)
class Candidate:
    path: str  # as shown in findings
    data: bytes
    module_name: Optional[str]
    is_package: bool
    full: bool = True  # False: only CPython's parse (the pre-filter rules out every finding)
    stdin: bool = False  # read from standard input: fixed text goes to stdout, never to a file
    sketch: bool = False  # its facts go to the callee summaries (alone, when not ``full``)
    callees: Optional[dict] = None  # its table of callee summaries (the second check of a file)

    @property
    def work(self) -> int:
        return len(self.data) * (FULL_CHECK_WEIGHT if self.full else 1)


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def rules_for(settings: Settings) -> RuleSet:
    builtin = [c for c in all_contracts() if settings.selected(c.code, c.name)]
    extra = [c for c in settings.contracts if settings.selected(c.code, c.name)]
    return build_rules(extra, builtin=builtin)


def with_options(settings: Settings, select: Sequence[str] = (), ignore: Sequence[str] = (),
                 exclude: Sequence[str] = ()) -> Settings:
    """Command-line options over the configuration: --select replaces, --ignore and --exclude add. A
    code, prefix or rule name that matches no rule is a usage error."""
    known = (*all_contracts(), *settings.contracts)
    select = resolve_selectors([s for s in select if s.strip()], known, "--select", UsageError)
    ignore = resolve_selectors([s for s in ignore if s.strip()], known, "--ignore", UsageError)
    exclude = tuple(e.strip() for e in exclude if e.strip())
    if exclude:
        from guardlint.contracts import ConfigError

        try:
            PathMatcher(exclude, "--exclude")
        except ConfigError as e:
            raise UsageError(str(e)) from None
    return dataclasses.replace(settings, select=select or settings.select, ignore=settings.ignore + ignore,
                               exclude=settings.exclude + exclude)


# -- checking -------------------------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(rules: RuleSet, strict: bool) -> None:
    _WORKER["rules"] = rules
    _WORKER["strict"] = strict


def _check_one(c: Candidate, rules: RuleSet, strict: bool, keep_module: bool = False):
    from .engine import syntax_check

    if not c.full:
        if c.sketch:
            from .summaries import sketch_source

            return FileResult(c.path, [], facts=sketch_source(c.data, c.path, c.module_name, c.is_package))
        return syntax_check(c.data, c.path)
    return deep_check(c.data, c.path, rules, strict=strict, module_name=c.module_name,
                      is_package=c.is_package, keep_module=keep_module,
                      prefilter=AST_PREFILTER and not keep_module and c.callees is None, sketch=c.sketch,
                      callees=c.callees)


# A long method chain (``a.b().c()...``, 500 links) nests two nodes a link, several frames each in
# libcst and in the walk: past Python's default limit of 1000 though CPython compiles it. Such a file
# is checked again in a thread with a large stack and a raised limit; the bounds keep a pathological
# file an error (GL000) rather than a crash. Measured (CPython 3.11): 500 links check in 0.8 s, 1000
# links (about the deepest chain CPython's parser takes) in 2.4 s, with 51 MB peak RSS.
DEEP_RECURSION_LIMIT = 20_000
DEEP_STACK_BYTES = 256 * 1024 * 1024
# Only files that CPython's own parser read at the normal limit are retried: deeper ones are not
# Python that CPython runs, and libcst's cost grows faster than linearly with the depth.
_DEPTH_ERROR = "nested too deeply to check"


def _too_deep(result) -> bool:
    return any(f.code == PARSE_ERROR and f.message.endswith(_DEPTH_ERROR) for f in result.findings)


def deep_check(data: bytes, path: str, rules: RuleSet, **options):
    """``engine.check_source``; a file too deep for Python's default recursion limit is checked again
    in a thread with a large stack and a raised (bounded) limit."""
    from .engine import check_source

    result = check_source(data, path, rules, **options)
    if not _too_deep(result):
        return result
    return _in_deep_thread(lambda: check_source(data, path, rules, **options)) or result


def _in_deep_thread(fn):
    """``fn()`` in a fresh thread with ``DEEP_STACK_BYTES`` of stack and ``DEEP_RECURSION_LIMIT``; None
    when no such thread can be started. The limit is process-wide: it is raised only while this thread
    runs (the caller waits for it) and put back after."""
    import sys
    import threading

    box: list = []
    old_limit = sys.getrecursionlimit()
    try:
        old_stack = threading.stack_size(DEEP_STACK_BYTES)
    except (ValueError, RuntimeError):
        return None
    try:
        sys.setrecursionlimit(max(old_limit, DEEP_RECURSION_LIMIT))
        thread = threading.Thread(target=lambda: box.append(fn()), name="guardlint-deep-check")
        thread.start()
        thread.join()
    except RuntimeError:  # no thread could be started
        return None
    finally:
        sys.setrecursionlimit(old_limit)
        threading.stack_size(old_stack)
    return box[0] if box else None


def _check_chunk(chunk: list[Candidate]) -> list:
    rules, strict = _WORKER["rules"], _WORKER["strict"]
    out = []
    for c in chunk:
        r = _check_one(c, rules, strict)
        out.append((r.path, r.findings, r.parsed, r.facts))
    return out


class _Workers:
    """The worker processes of one run: started by its first pass with enough work, and kept for its
    later passes (the callee summaries' reading, the second check), which then cost no start."""

    def __init__(self, rules: RuleSet, strict: bool):
        self.rules, self.strict = rules, strict
        self.pool: Any = None  # a ProcessPoolExecutor once started

    def start(self, n: int):
        if self.pool is None:
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(max_workers=n, initializer=_init_worker,
                                            initargs=(self.rules, self.strict))
        return self.pool

    def close(self, wait: bool = True) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=wait)
            self.pool = None


def _worth_workers(candidates: int, full: int, work: int) -> bool:
    """Whether this many candidates (``full`` of them to parse, ``work`` bytes weighted) pay for starting worker
    processes: at least two workers' worth of them (8 each), and enough files or bytes."""
    return candidates // 8 >= 2 and (full >= MIN_PARALLEL or work >= MIN_PARALLEL_WORK)


def _check_all(candidates: list[Candidate], rules: RuleSet, strict: bool, jobs: Optional[int],
               keep_modules: bool, progress: Optional[Callable[[int], None]] = None,
               workers: Optional[_Workers] = None, submitted: Sequence = ()) -> list:
    """One result per candidate, in the candidates' order, whether checked here or across processes
    (``workers``' when they are started, then whatever the work). ``progress(n)`` is told of each n
    files done. ``submitted``: (chunk, future) of candidates already handed to ``workers``."""
    full = sum(1 for c in candidates if c.full)
    work = sum(c.work for c in candidates)
    n = min(cpu_count(), jobs or cpu_count(), max(1, len(candidates) // 8))
    started = workers is not None and workers.pool is not None
    if keep_modules or (not started and (n <= 1 or not _worth_workers(len(candidates), full, work))):
        out = []
        for c in candidates:
            out.append(_check_one(c, rules, strict, keep_modules))
            if progress is not None:
                progress(1)
        return out
    from concurrent.futures.process import BrokenProcessPool

    # Most work first, dealt round-robin into chunks, so no worker ends with a long tail.
    handed = {id(c) for chunk, _ in submitted for c in chunk}
    ordered = sorted((c for c in candidates if id(c) not in handed), key=lambda c: -c.work)
    n_chunks = n * 4
    chunks = [c for c in (ordered[i::n_chunks] for i in range(n_chunks)) if c]
    results: dict[int, object] = {}  # id(candidate) -> its FileResult
    crashed: list[Candidate] = []
    own = workers is None
    workers = workers or _Workers(rules, strict)
    try:
        pool = workers.start(n)
        futures = list(submitted) + [(chunk, pool.submit(_check_chunk, chunk)) for chunk in chunks]
        for chunk, future in futures:
            try:
                part = future.result()
            except BrokenProcessPool:
                crashed.extend(chunk)
                continue
            for c, (path, findings, parsed, facts) in zip(chunk, part):
                results[id(c)] = FileResult(path, findings, parsed, facts=facts)
            if progress is not None:
                progress(len(chunk))
    finally:
        if own or crashed:
            workers.close(wait=not crashed)
    if crashed:
        for c, r in zip(crashed, _isolate(crashed, rules, strict)):
            results[id(c)] = r
        if progress is not None:
            progress(len(crashed))
    # Back in the candidates' order, so that a parallel run reports exactly what a serial one does.
    return [results[id(c)] for c in candidates]


def _isolate(candidates: list[Candidate], rules: RuleSet, strict: bool) -> list:
    """Checks the files of chunks whose worker died, one file at a time in a fresh worker, so that a
    file that kills the checker (a native-parser crash) costs only its own result."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from .engine import file_error
    results = []
    pool = None
    try:
        for c in candidates:
            if pool is None:
                pool = ProcessPoolExecutor(max_workers=1, initializer=_init_worker, initargs=(rules, strict))
            try:
                (path, findings, parsed, facts), = pool.submit(_check_chunk, [c]).result()
                results.append(FileResult(path, findings, parsed, facts=facts))
            except BrokenProcessPool:
                results.append(file_error(c.path, "the checking process died on this file; it was not "
                                                  "checked"))
                pool.shutdown(wait=False)
                pool = None
    finally:
        if pool is not None:
            pool.shutdown()
    return results


def read_source(path: str) -> bytes:
    """The bytes of a regular file (a FIFO or device named ``x.py`` would block or never end)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError("not a regular file")
    with open(path, "rb") as f:
        return f.read()


def lint_paths(paths: Sequence[str], settings: Settings, *, strict: bool = False,
               stdin: Optional[bytes] = None, stdin_filename: Optional[str] = None,
               jobs: Optional[int] = None, keep_modules: bool = False, fix: Optional[str] = None,
               unsafe_fixes: bool = False, progress: Optional[Callable[[int, int], None]] = None) -> Report:
    """Lint files and folders (``-`` reads ``stdin``); findings sorted by path, line, column.

    ``fix="apply"`` writes the fixes (of selected findings; unsafe ones with ``unsafe_fixes``) into
    the files, ``fix="diff"`` only computes them; both report what remains after fixing. Named paths
    that do not exist, or are not checked, are listed in the report; the others are linted anyway.
    ``progress(done, total)`` is called as files are checked."""
    rules = rules_for(settings)
    every_rule = None if _selects_all(settings) else build_rules(list(settings.contracts),
                                                                 builtin=list(all_contracts()))
    found = find_files([p for p in paths if p != "-"], settings)
    files = found.files
    summarize = CALLEE_SUMMARIES and any(c.code == "GL104" for c in rules.patterns)
    workers = _Workers(rules, strict)
    n_workers = min(cpu_count(), jobs or cpu_count())
    submitted: list = []  # (chunk, future) of candidates handed to the workers while the pre-filter ran
    stream = None
    if n_workers > 1 and not keep_modules:
        def stream(batch: list) -> None:
            submitted.append((batch, workers.start(n_workers).submit(_check_chunk, batch)))
    try:
        candidates, findings = _candidates(files, rules, every_rule, summarize, stream)
    except BaseException:
        workers.close(wait=False)
        raise
    n_files = len(files)
    if "-" in paths:
        n_files += 1
        data = stdin if stdin is not None else b""
        shown = stdin_filename or "-"
        full = rules.may_match(data)
        name, is_pkg = module_name_for(stdin_filename) if stdin_filename and full else (None, False)
        candidates.append(Candidate(shown, data, name, is_pkg, full, stdin=True))

    tick = None
    if progress is not None:
        done = [n_files - len(candidates)]  # files that could not be read are done already

        def tick(n: int) -> None:
            done[0] += n
            progress(done[0], n_files)

    try:
        results = _check_all(candidates, rules, strict, jobs, keep_modules, tick, workers, submitted) \
            if candidates else []
        if summarize and results:
            _recheck_with_callees(candidates, results, files, rules, strict, jobs, keep_modules, workers,
                                  settings.follow_bindings)
    finally:
        workers.close()
    for r in results:
        findings.extend(r.findings)
    findings = _keep(findings, settings)
    report = Report(findings, files=n_files, parsed=sum(1 for c in candidates if c.full),
                    checked=sum(1 for r in results if r.parsed),
                    results=[r for r, c in zip(results, candidates) if c.full] if keep_modules else [],
                    missing=found.missing, skipped=found.skipped)
    if fix is not None:
        _fix(report, candidates, rules, settings, strict, unsafe_fixes, write=fix == "apply")
    report.findings.sort(key=Finding.sort_key)
    return report


def _candidates(files: Sequence[str], rules: RuleSet, every_rule, summarize: bool,
                stream: Optional[Callable[[list], None]] = None) -> tuple[list, list]:
    """The files past the textual pre-filter, as candidates, and GL000 findings of those that cannot be read.
    ``stream`` is handed the candidates in batches as they are found, once they are worth worker processes
    (the last ones stay for the caller)."""
    if summarize:
        from .patterns import INSTALLS, may_call
    candidates: list[Candidate] = []
    findings: list[Finding] = []
    sent = full_files = work = 0
    streaming = False
    for path in files:
        try:
            data = read_source(path)
        except OSError as e:
            from .engine import file_error

            findings.extend(file_error(path, f"cannot read: {e.strerror or e}").findings)
            continue
        full = rules.may_match(data)
        sketch = summarize and (full or may_call(data) or INSTALLS.search(data) is not None)
        # Which files get at least CPython's parse must not depend on --select/--ignore: a file with
        # a target of an unselected rule and a syntax error is still reported (GL000).
        if not full and not sketch and not PARSE_EVERY_FILE \
                and not (every_rule is not None and every_rule.may_match(data)):
            continue
        name, is_pkg = module_name_for(path) if full or sketch else (None, False)
        candidates.append(Candidate(path, data, name, is_pkg, full, sketch=sketch))
        if stream is None:
            continue
        if not streaming:
            full_files += full
            work += candidates[-1].work
            streaming = _worth_workers(len(candidates), full_files, work)
        while streaming and len(candidates) - sent >= STREAM_BATCH:
            stream(candidates[sent: sent + STREAM_BATCH])
            sent += STREAM_BATCH
    return candidates, findings


def _recheck_with_callees(candidates: list[Candidate], results: list, files: Sequence[str], rules: RuleSet,
                          strict: bool, jobs: Optional[int], keep_modules: bool, workers: _Workers,
                          bindings: bool = True) -> None:
    """The callee summaries, built once from the files' sketches (their exact reading, libcst's, by the
    workers when they are started); the files with a per-layer call whose definition reads on the host
    what the call passes are checked again with them (in place: their candidates and results are
    replaced)."""
    from .summaries import build, read_facts

    def read_all(items: list) -> list:
        if workers.pool is not None:
            from concurrent.futures.process import BrokenProcessPool

            try:
                return list(workers.pool.map(_read_facts, items))
            except BrokenProcessPool:
                workers.close(wait=False)
        return [read_facts(*item) for item in items]

    data = {c.path: c.data for c in candidates}
    tables = build([r.facts for r in results if r.facts is not None], files,
                   lambda path: data[path] if path in data else read_source(path), read_all, bindings)
    again = []
    for i, (c, r) in enumerate(zip(candidates, results)):
        if c.path in tables and not c.stdin:
            callees, sites = tables[c.path]
            if not sites <= {(f.line, f.column) for f in r.findings if f.code == "GL104"}:  # (reported already)
                again.append((i, dataclasses.replace(c, full=True, callees=callees, sketch=False)))
    # A file the pre-filter passed over that holds code bound per layer at run time (``reach.py``) is checked too.
    known, listed = {c.path for c in candidates}, set(files)
    for path in sorted(p for p in tables if p not in known and p in listed):
        try:
            source = read_source(path)
        except OSError:
            continue
        name, is_pkg = module_name_for(path)
        candidates.append(Candidate(path, source, name, is_pkg, True))
        results.append(FileResult(path, []))
        again.append((len(candidates) - 1, dataclasses.replace(candidates[-1], callees=tables[path][0])))
    if not again:
        return
    for (i, c), r in zip(again, _check_all([c for _, c in again], rules, strict, jobs, keep_modules, None, workers)):
        candidates[i], results[i] = c, r


def _read_facts(item: tuple):
    from .summaries import read_facts

    return read_facts(*item)


def _selects_all(settings: Settings) -> bool:
    return not settings.ignore and all(s == "GL" for s in settings.select)


def _keep(findings: list[Finding], settings: Settings) -> list[Finding]:
    """The findings the selection keeps. GL000 (a file that could not be read, parsed or fixed) is
    kept whatever --select/--ignore say: a file that was not checked must never look clean."""
    findings = [f for f in findings if f.code == PARSE_ERROR or settings.selected(f.code, f.name)]
    return share_reasons(_per_file_ignores(findings, settings))


def _fix(report: Report, candidates: list[Candidate], rules: RuleSet, settings: Settings, strict: bool,
         unsafe_fixes: bool, write: bool) -> None:
    from . import fixer

    by_path: dict[str, list[Finding]] = {}
    for f in report.findings:
        by_path.setdefault(f.path, []).append(f)
    sources = {c.path: c for c in candidates if c.full}
    kept: list[Finding] = []
    for path, found in by_path.items():
        c = sources.get(path)
        if c is None or not any(f.fixable(unsafe_fixes) for f in found):
            kept.extend(found)
            continue

        def recheck(data: bytes, c=c) -> list[Finding]:
            result = deep_check(data, c.path, rules, strict=strict, module_name=c.module_name,
                                is_package=c.is_package, callees=c.callees)
            return _keep(result.findings, settings)

        change = fixer.fix_source(c.data, found, recheck, unsafe_fixes=unsafe_fixes, path=path)
        change.stdin = c.stdin
        if write and change.changed and not c.stdin:
            try:
                fixer.write_atomic(path, change.after)
            except OSError as e:
                change.error = f"the fixed file could not be written: {e.strerror or e}"
                change.findings = found
                change.after = change.before
                change.fixed = 0
        kept.extend(change.findings)
        if change.error:
            kept.append(_fix_error(path, change.error))
        report.fixed += change.fixed
        report.changes.append(change)
    report.findings = kept


def _fix_error(path: str, detail: str) -> Finding:
    from guardlint.contracts import get

    c = get("GL000")
    return Finding(path, 1, 1, c.code, f"fix not applied: {detail}", c.name, c.severity, 1, 1)


def _per_file_ignores(findings: list[Finding], settings: Settings) -> list[Finding]:
    if not settings.per_file_ignores or not findings:
        return findings
    rules = [(PathMatcher([pattern], "per-file-ignores"), codes) for pattern, codes in settings.per_file_ignores]
    ignored_for: dict[str, tuple[str, ...]] = {}
    out = []
    for f in findings:
        if f.path not in ignored_for:
            rel = relative_to_root(Path(f.path), settings.root)
            ignored_for[f.path] = tuple(c for m, codes in rules if m.matches(rel) for c in codes)
        if not matches_any(ignored_for[f.path], f.code, f.name):
            out.append(f)
    return out


def lint_buffer(data: bytes, path: str, settings: Settings, *, rules: Optional[RuleSet] = None,
                strict: bool = False) -> list[Finding]:
    """What ``guardlint check PATH`` reports when the file's text is ``data`` (an editor's unsaved buffer,
    the text flake8 read): the settings' excludes, the pre-filters, the module name, selection and per-file
    ignores, as for a file on disk."""
    if PathMatcher(settings.exclude).matches(relative_to_root(Path(path), settings.root)):
        return []
    rules = rules or rules_for(settings)
    full = rules.may_match(data)
    if not full and not PARSE_EVERY_FILE:  # as lint_paths decides for a file of a folder
        every_rule = None if _selects_all(settings) else build_rules(list(settings.contracts),
                                                                     builtin=list(all_contracts()))
        if every_rule is None or not every_rule.may_match(data):
            return []
    name, is_pkg = module_name_for(path) if full else (None, False)
    return _keep(_check_one(Candidate(path, data, name, is_pkg, full), rules, strict).findings, settings)


def lint_source(source, path: str = "<string>", *, settings: Optional[Settings] = None, strict: bool = False,
                module_name: Optional[str] = None, rules: Optional[RuleSet] = None) -> list[Finding]:
    """Findings of one source text or bytes, selection applied (no pre-filter: it is always parsed)."""
    data = source.encode("utf-8") if isinstance(source, str) else source
    settings = settings or Settings(root=Path.cwd())
    rules = rules or rules_for(settings)
    result = deep_check(data, path, rules, strict=strict, module_name=module_name)
    return _keep(result.findings, settings)


def fixed_source(source, path: str = "<string>", *, unsafe_fixes: bool = False,
                 settings: Optional[Settings] = None, strict: bool = False, module_name: Optional[str] = None,
                 rules: Optional[RuleSet] = None):
    """``source`` (text or bytes) after ``--fix`` (with ``unsafe_fixes``: ``--fix --unsafe-fixes``),
    as the same type; unchanged when nothing applies."""
    from .fixer import fix_source

    data = source.encode("utf-8") if isinstance(source, str) else source
    settings = settings or Settings(root=Path.cwd())
    rules = rules or rules_for(settings)

    def recheck(b: bytes) -> list[Finding]:
        return _keep(deep_check(b, path, rules, strict=strict, module_name=module_name).findings, settings)

    after = fix_source(data, recheck(data), recheck, unsafe_fixes=unsafe_fixes, path=path).after
    return after.decode("utf-8") if isinstance(source, str) else after
