"""A large file checked in chunks of top-level statements, with the findings of the whole-file check.

The trees of a whole multi-megabyte module are what a large file costs: libcst's took 2.3 GB and CPython's
0.6 GB for a 5 MB module of 28k functions. Here each chunk (consecutive top-level statements, split where
a line starts with ``def``, ``class`` or a decorator) is parsed, walked and checked on its own, and only
what crosses statements is kept for the whole file:

- the collector's module scope (bindings, star imports) and its sequence numbers: one collector walks
  the chunks in order, so the scopes are the whole walk's;
- what a function body sees of the module is its last binding of a name, which may come from a later
  chunk: a chunk is checked once every chunk that binds, at module level, a name mentioned in it or in
  an earlier chunk (or a name a fix may import) has been walked (CPython's tree of each chunk tells which
  names each one binds; mentions are the words of its text);
- GL104's same-module helpers (module-level functions that read the host): a chunk's pattern walk waits
  for the last chunk defining a function whose name it mentions;
- CPython's positions of calls (kept as spans, not trees), the top-level statements' lines (where a
  fix's imports go) and the suppression comments, all in the file's line numbers.

A file that does not fit these assumptions (line breaks other than ``\\n``, an encoding other than plain
UTF-8, ``__future__`` imports past the first chunk, a chunk that does not parse on its own) is checked
whole (``check`` returns None).
"""
from __future__ import annotations

import ast
import gc
import io
import re
import tokenize
import unicodedata
from dataclasses import dataclass, field
from typing import Callable, Optional, cast

import libcst as cst

from . import suppress
from .checker import Checker, RawFinding, callable_names, contract_note as pattern_note, known_targets
from .edits import EditBuilder, Layout
from .findings import FileResult, Finding, Fix, without_fix
from .host_sync import READ_WORDS, module_helpers
from .names import ClassInfo, Resolver, Scope
from .positions import call_spans, positions_from_cst, positions_from_spans
from .rules import RuleSet
from .scopes import Collector
from .walk import Walker

# Files of at least MIN_BYTES are checked in chunks of about CHUNK_BYTES (a chunk ends at the first
# statement start past that size). Tests lower both.
MIN_BYTES = 512 * 1024
CHUNK_BYTES = 64 * 1024

# Where a top-level statement may start: a chunk boundary is only taken where CPython then parses each
# side on its own (a line inside a string or brackets fails that, and the file is checked whole).
_START = re.compile(r"^(?:@|def\b|class\b|async[ \t]+def\b)", re.M)
_WORD = re.compile(r"\w+")


class _Unchunkable(Exception):
    pass


class _Lines:
    """The lines of a text whose line breaks are ``\\n`` (``positions.LINE_BREAK.split`` of it), each
    made when asked for: ``starts`` are their offsets."""

    def __init__(self, text: str, starts: list[int]):
        self.text = text
        self.starts = starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> str:
        starts = self.starts
        end = starts[i + 1] - 1 if i + 1 < len(starts) else len(self.text)
        return self.text[starts[i]:end]


@dataclass
class _View:
    """What ``Checker`` reads of a collector, for one chunk's calls."""

    module: Scope
    sites: list
    calls: list
    assigned: dict
    stores: list
    per_layer: dict
    defs: dict


@dataclass
class _Chunk:
    index: int
    module: cst.Module
    walk_patterns: bool = False
    pattern_raw: list = field(default_factory=list)
    view: Optional[_View] = None


def _starts(text: str) -> list[int]:
    """Offsets of the chunks' first characters: statement starts at least CHUNK_BYTES apart; never
    between a decorator and what it decorates."""
    starts = [0]
    after_decorator = False
    for m in _START.finditer(text):
        if not after_decorator and m.start() - starts[-1] >= CHUNK_BYTES:
            starts.append(m.start())
        after_decorator = m.group() == "@"
    return starts


def _module_bound(body, any_global: bool) -> tuple[set, bool, list]:
    """Names ``body`` (top-level statements) may bind in the module scope (a superset: every name stored
    outside a def or class body, imports, defs and classes, ``global`` names anywhere), whether it has a
    star import, and the names of its top-level functions."""
    names: set = set()
    star = False
    defs = [s.name for s in body if type(s) is ast.FunctionDef or type(s) is ast.AsyncFunctionDef]
    stack = list(body)
    while stack:
        node = stack.pop()
        t = type(node)
        if t is ast.FunctionDef or t is ast.AsyncFunctionDef or t is ast.ClassDef:
            names.add(node.name)
            # Decorators, defaults, annotations and bases are evaluated in the enclosing scope.
            stack.extend(node.decorator_list)
            if t is ast.ClassDef:
                stack.extend(node.bases)
                stack.extend(node.keywords)
            else:
                stack.append(node.args)
                if node.returns is not None:
                    stack.append(node.returns)
            if any_global:
                for inner in node.body:
                    for n in ast.walk(inner):
                        if type(n) is ast.Global:
                            names.update(n.names)
            continue
        if t is ast.Name:
            if type(node.ctx) is ast.Store:
                names.add(node.id)
            continue
        if t is ast.Import:
            names.update(a.asname or a.name.split(".", 1)[0] for a in node.names)
        elif t is ast.ImportFrom:
            for a in node.names:
                if a.name == "*":
                    star = True
                else:
                    names.add(a.asname or a.name)
        elif t is ast.Global:
            names.update(node.names)
        elif t is ast.ExceptHandler or t is ast.MatchAs or t is ast.MatchStar:
            if node.name:
                names.add(node.name)
        elif t is ast.MatchMapping:
            if node.rest:
                names.add(node.rest)
        stack.extend(ast.iter_child_nodes(node))
    return names, star, defs


def _may_read(body, chunk: str, first_line: int) -> list[bool]:
    """For each top-level function of ``body`` (CPython's, of ``chunk``), whether its text names a host
    read (``host_sync.module_helpers``)."""
    defs = [s for s in body if type(s) is ast.FunctionDef or type(s) is ast.AsyncFunctionDef]
    if not defs:
        return []
    lines = chunk.split("\n")
    out = []
    for d in defs:
        start = min([d.lineno, *(x.lineno for x in d.decorator_list)]) - first_line
        end = (d.end_lineno or d.lineno) - first_line + 1
        out.append(READ_WORDS.search("\n".join(lines[start:end])) is not None)
    return out


def _words(text: str) -> set:
    words = set(_WORD.findall(text))
    if not text.isascii():  # CPython's names are NFKC-normalized, libcst's are as written: both count
        words.update([unicodedata.normalize("NFKC", w) for w in words if not w.isascii()])
    return words


def _fix_import_names(rules: RuleSet) -> set:
    """Names a fix may import, which the fixer looks up in the call's scope."""
    return {name for c in rules.contracts for d in (getattr(c, "derivations", None) or ())
            for _, name in getattr(d, "imports", ())}


def _untie(view: _View) -> None:
    """Empties the scopes of a checked chunk (all but the module's): a binding of a call holds its
    scope, and a class its methods' scopes, so that they would wait for the cycle collector; emptied,
    the chunk's tree goes as soon as it is done with. Nothing reads them after the chunk's check (its
    functions and classes are bound in the module scope by their own objects, which are kept)."""
    module = view.module
    scopes: dict = {}
    for _, scope, _, _, _ in view.sites:
        s = scope
        while s is not None and s is not module and id(s) not in scopes:
            scopes[id(s)] = s
            s = s.parent
    # A function with ``global`` statements may have bound a module name to a call made in it: that
    # binding keeps its scope (and the scopes around it), which later chunks may look through.
    kept = set()
    for s in scopes.values():
        if s.global_names:
            while s is not None and s is not module:
                kept.add(id(s))
                s = s.parent
    for key, s in scopes.items():
        if key in kept:
            continue
        if isinstance(s.info, ClassInfo):
            s.info.attrs = {}
        s.bindings = {}
        s.attr_stores = []


def _parse_ast(source: str):
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise _Unchunkable(str(e)) from None
    finally:
        if was_enabled:
            gc.enable()


def _no_validation(self) -> None:
    pass


def _parse_cst(source: str) -> cst.Module:
    """libcst's tree of ``source``, without the validation of each node as it is made (a third of the
    parse): the parser's own nodes are valid (libcst's ``CSTNode.__post_init__`` says as much)."""
    was_enabled = gc.isenabled()
    gc.disable()
    node_class = cst.CSTNode
    validate = node_class.__dict__.get("__post_init__")
    if validate is not None:
        node_class.__post_init__ = _no_validation  # type: ignore[method-assign]  # put back in finally
    try:
        return cst.parse_module(source)
    except Exception as e:  # a limit of libcst's parser: the whole-file check reports it
        raise _Unchunkable(str(e)) from None
    finally:
        if validate is not None:
            node_class.__post_init__ = validate  # type: ignore[method-assign]
        if was_enabled:
            gc.enable()


def _text(data: bytes) -> Optional[str]:
    """A large file's text when it can be split into chunks (plain UTF-8, ``\\n`` line breaks), else None."""
    if len(data) < MIN_BYTES or b"\r" in data or data.startswith(b"\xef\xbb\xbf"):
        return None
    try:
        if tokenize.detect_encoding(io.BytesIO(data).readline)[0] != "utf-8":
            return None
        return data.decode("utf-8")
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None


def parses(data: bytes) -> bool:
    """True when a large file parses, found chunk by chunk: CPython's whole tree of a 5 MB module is
    ~600 MB. False when that takes a whole-file parse to know (a small file, one that cannot be split, a
    chunk that does not parse on its own, a syntax error: the whole parse then reports it where it is).

    Each chunk ends where a line starts a top-level statement and parses on its own, so it closes every
    bracket, string and block it opens: the chunks one after another parse as the file does."""
    text = _text(data)
    if text is None:
        return False
    starts = _starts(text)
    if len(starts) < 2:
        return False
    was_enabled = gc.isenabled()
    gc.disable()  # the trees are dropped at once and hold no cycles
    try:
        for start, end in zip(starts, [*starts[1:], len(text)]):
            ast.parse(text[start:end])
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    finally:
        if was_enabled:
            gc.enable()
    return True


def check(data: bytes, path: str, rules: RuleSet, strict: bool, module_name: Optional[str], is_package: bool,
          prefilter: bool, pattern_visitor: Callable) -> Optional[FileResult]:
    """``engine.check_source``'s result for a large file, checked in chunks; None when the file must be
    checked whole (see the module's docstring). ``pattern_visitor(contract, report)`` makes a pattern
    rule's visitor."""
    text = _text(data)
    if text is None:
        return None
    starts = _starts(text)
    if len(starts) < 2 or "__future__" in text[starts[1]:] or "barry_as_FLUFL" in text:
        return None
    # The collector's automatic passes would look through everything alive again and again (the file's
    # findings, its module scope), for the cycles (scopes and their bindings) each chunk leaves behind:
    # they took 40% of the check of a 5 MB file. Those are collected after each chunk, among the objects
    # made since the last collection only.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _Run(data, text, starts, path, rules, strict, module_name, is_package, pattern_visitor).run(prefilter)
    except _Unchunkable:
        return None
    finally:
        if was_enabled:
            gc.enable()


class _Run:
    def __init__(self, data, text, starts, path, rules, strict, module_name, is_package, pattern_visitor):
        self.data = data
        self.text = text
        self.bounds = list(zip(starts, [*starts[1:], len(text)]))
        self.path = path
        self.rules = rules
        self.strict = strict
        self.module_name = module_name
        self.is_package = is_package
        self.pattern_visitor = pattern_visitor
        # The first line of each chunk.
        self.first_lines = []
        line, at = 1, 0
        for start, _ in self.bounds:
            line += text.count("\n", at, start)
            at = start
            self.first_lines.append(line)
        # Filled by the CPython pass (``_pass``), one entry a chunk.
        self.spans: list = []
        self.bound: list = []
        self.stars: list = []
        self.defs: list = []
        self.words: list = []
        self.may_read: list = []
        self.layout = Layout()

    def _source(self, k: int, numbered: bool = False) -> str:
        start, end = self.bounds[k]
        chunk = self.text[start:end]
        # Blank lines in front give CPython's tree the file's line numbers.
        return "\n" * (self.first_lines[k] - 1) + chunk if numbered else chunk

    def _pass(self):
        """CPython's tree of each chunk in turn: what later steps need is kept; yields its body (for the
        tree pre-filter)."""
        for k in range(len(self.bounds)):
            body = _parse_ast(self._source(k, numbered=True)).body
            self.spans.append(call_spans(body))
            self.layout.add(body)
            chunk = self._source(k)
            names, star, defs = _module_bound(body, "global" in chunk)
            self.may_read.append(_may_read(body, chunk, self.first_lines[k]))
            self.bound.append(names)
            self.stars.append(star)
            self.defs.append(defs)
            self.words.append(_words(chunk))
            yield body

    def _reparse(self):
        for k in range(len(self.bounds)):
            yield _parse_ast(self._source(k, numbered=True)).body

    def run(self, prefilter: bool) -> FileResult:
        first = self._pass()
        if prefilter:
            from .prefilter import tree_filter

            calls = iter((first, self._reparse, self._reparse, self._reparse))

            def bodies():
                got = next(calls)
                return got() if callable(got) else got

            reports = tree_filter(self.rules).may_report_bodies(bodies, self.data)
            for _ in first:  # the rest of the file, when the filter decided early
                pass
            if not reports:
                return FileResult(self.path, [])
        else:
            for _ in first:
                pass
        return self._check()

    def _ready(self, patterns: bool) -> list[int]:
        """For each chunk, the chunk after whose walk it can be checked."""
        last_bind: dict = {}
        for j, names in enumerate(self.bound):
            for n in names:
                last_bind[n] = j
        last_def: dict = {}
        for j, names in enumerate(self.defs):
            for n in names:
                last_def[n] = j
        running = max((j for j, s in enumerate(self.stars) if s), default=-1)
        fix_names = _fix_import_names(self.rules)
        ready = []
        for k, words in enumerate(self.words):
            mentioned = words | fix_names if k == 0 else words
            for n in mentioned.intersection(last_bind):
                if last_bind[n] > running:
                    running = last_bind[n]
            r = max(k, running)
            if patterns:
                for n in words.intersection(last_def):
                    r = max(r, last_def[n])
            ready.append(r)
        return ready

    def _check(self) -> FileResult:
        rules = self.rules
        collector = Collector(self.module_name, self.is_package)
        collector.module_bound = set()
        known = known_targets(rules)
        module_names: set = set()
        sink: list = [None]
        visitors = [self.pattern_visitor(c, lambda node, message, note="", c=c: sink[0].append(
            RawFinding(node, c, message, c.severity, note="\n".join(filter(None, (note, pattern_note(c)))))))
            for c in rules.patterns]
        if not all(hasattr(v, "begin_chunk") for v in visitors):
            raise _Unchunkable("a pattern rule needs the whole module")
        ready = self._ready(bool(visitors))
        self.words = self.bound = self.defs = []
        helpers: dict = {}
        both, collect, patterns = Walker([collector, *visitors]), Walker([collector]), Walker(visitors)
        # The module is each chunk's, set before its findings are fixed.
        builder = EditBuilder(cst.Module([]), None, self.data, Resolver(collector.module, {}, ()), text=self.text,
                              layout=self.layout.result(self.text.count("\n") + 2))
        builder.path = self.path
        lines = _Lines(self.text, builder._starts)
        table = suppress.suppressions(self.data) if suppress.may_suppress(self.data) else None
        seen: set = set()
        out: list = [None] * len(self.bounds)

        def finish(c: _Chunk) -> list:
            view = c.view
            assert view is not None, "a chunk is finished once, after its walk"
            if c.walk_patterns:
                sink[0] = c.pattern_raw
                for v in visitors:
                    v.begin_chunk(helpers)
                for stmt in c.module.body:
                    patterns.walk(stmt)
            raw = c.pattern_raw
            # A _View holds exactly what Checker reads of a Collector, for this chunk's calls.
            raw.extend(Checker(rules, cast(Collector, view), self.strict, module_names=module_names,
                               path=self.path).run())
            spans, self.spans[c.index] = self.spans[c.index], None
            if not raw:
                _untie(view)
                return []
            positions = positions_from_spans(spans, view.calls, raw, lines)
            if positions is None:
                d = self.first_lines[c.index] - 1
                positions = [(line + d, col, end_line + d, end_col, call_line + d, (cl + d, cc, cel + d, cec))
                             for line, col, end_line, end_col, call_line, (cl, cc, cel, cec)
                             in positions_from_cst(c.module, raw)]
            builder.module = c.module
            found = []
            for r, (line, col, end_line, end_col, call_line, call_range) in sorted(zip(raw, positions),
                                                                                   key=lambda x: x[1][:5]):
                code = r.contract.code
                if table and suppress.is_suppressed(table, code, (line, end_line, call_line)):
                    continue
                key = (line, col, code, share(r.message))
                if key in seen:
                    continue
                seen.add(key)
                fix, why = builder.fix(r, call_range)
                message, note = without_fix(key[3], r.note, why)
                found.append(Finding(self.path, line, col, code, share(message), r.contract.name, r.severity,
                                     end_line, end_col, fix if fix is None else share_fix(fix), share(note)))
            _untie(view)
            return found

        # Findings of a large file repeat their texts, imports and fixes (two findings of one call share
        # its fix): equal values are kept once.
        shared: dict = {}

        def share(value):
            return shared.setdefault(value, value)

        def share_fix(fix: Fix) -> Fix:
            got = shared.get(fix)
            if got is None:
                got = shared[fix] = Fix(fix.applicability, share(fix.message),
                                        tuple(share(e) for e in fix.edits), share(fix.imports))
            return got

        pending: list[_Chunk] = []
        for k in range(len(self.bounds)):
            module = _parse_cst(self._source(k))
            if visitors:
                module_helpers(module.body, helpers, self.may_read[k])
            self.may_read[k] = None
            collector.default_indent = module.default_indent
            c = _Chunk(k, module)
            if visitors and ready[k] == k:
                sink[0] = c.pattern_raw
                for v in visitors:
                    v.begin_chunk(helpers)
                walker = both
            else:
                c.walk_patterns = bool(visitors)
                walker = collect
            for stmt in module.body:
                walker.walk(stmt)
            # The chunk's calls, stores and per-call facts leave the collector with it.
            c.view = _View(collector.module, collector.sites, collector.calls, collector.assigned,
                           collector.stores, collector.per_layer, collector.defs)
            collector.sites, collector.calls, collector.stores = [], [], []
            collector.assigned, collector.per_layer, collector.defs = {}, {}, {}
            bindings = collector.module.bindings
            module_names.update(callable_names({n: bindings[n] for n in collector.module_bound}, known))
            collector.module_bound.clear()
            pending.append(c)
            waiting = []
            for c in pending:
                if ready[c.index] <= k:
                    out[c.index] = finish(c)
                else:
                    waiting.append(c)
            pending = waiting
            builder.release()
            del c, module
            if k % 8 == 7:
                gc.collect(0 if k % 32 != 31 else 1)
        return FileResult(self.path, [f for found in out for f in found], parsed=True)
