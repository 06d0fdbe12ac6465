"""Checking one file: CPython's parse, the tree pre-filter, one libcst walk (``scopes.py``), the contracts
(``checker.py``), then positions (``positions.py``), suppressions and fix edits (``edits.py``). Never
raises for a problem of the file: that is a GL000 finding.
"""
# Files are parsed by CPython's ``ast`` first: it is ~6-10x cheaper than libcst, gives CPython's own
# syntax-error messages, refuses the deeply nested input that crashes libcst's native parser (a
# segfault would end the whole run), and its call positions spare libcst's PositionProvider, which
# costs ~2.5x the parse (positions agree exactly: 27k calls of 127 site-packages files compared).
from __future__ import annotations

import ast
import gc
import importlib
from typing import TYPE_CHECKING, Callable, Optional

from guardlint.contracts import Contract, get as _builtin_contract

from . import suppress
from .findings import FileResult, Finding, without_fix
from .patterns import PATTERNS
from .rules import RuleSet

if TYPE_CHECKING:
    import libcst as cst

    from .checker import BoundArgs, Checker, RawFinding, bind_args, contract_note as pattern_note
    from .edits import EditBuilder as _Fixer
    from .names import Resolver
    from .positions import positions_from_ast as _positions_from_ast, positions_from_cst as _positions_from_cst
    from .scopes import Collector
    from .walk import Walker

# libcst and the modules built on it are bound here on first need (``_load``): importing libcst costs
# ~0.4 s, more than checking a file, and most files never get past the pre-filters. The names that
# moved out of this module stay importable from it, and a name replaced here (as tests do) is the one
# used.
_LAZY = {
    "cst": ("libcst", ""),
    "Walker": (".walk", "Walker"),
    "Resolver": (".names", "Resolver"),
    "Collector": (".scopes", "Collector"),
    "BoundArgs": (".checker", "BoundArgs"),
    "bind_args": (".checker", "bind_args"),
    "Checker": (".checker", "Checker"),
    "RawFinding": (".checker", "RawFinding"),
    "pattern_note": (".checker", "contract_note"),
    "_positions_from_ast": (".positions", "positions_from_ast"),
    "_positions_from_cst": (".positions", "positions_from_cst"),
    "_Fixer": (".edits", "EditBuilder"),
}
_loaded = False

__all__ = ["MAX_BYTES", "FileResult", "check_source", "file_error", "syntax_check",
           # re-exported from the modules this one was split into
           "BoundArgs", "Checker", "Collector", "RawFinding", "bind_args", "_Fixer", "_positions_from_ast",
           "_positions_from_cst"]


def _load() -> None:
    global _loaded
    if _loaded:
        return
    bound = globals()
    for name, (module, attr) in _LAZY.items():
        if name not in bound:
            found = importlib.import_module(module, __package__)
            bound[name] = getattr(found, attr) if attr else found
    _loaded = True


def __getattr__(name: str):
    if name in _LAZY:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


MAX_BYTES = 10 * 1024 * 1024


# -- one file --------------------------------------------------------------------------------------
def file_error(path: str, detail: str, line: Optional[int] = 1, column: Optional[int] = 1) -> FileResult:
    c = _builtin_contract("GL000")
    line = max(int(line or 1), 1)
    column = max(int(column or 1), 1)
    f = Finding(path, line, column, c.code, f"{c.diagnosis.message}: {detail}", c.name, c.severity,
                line, column)
    return FileResult(path, [f])


def _too_nested(e: SyntaxError) -> bool:
    msg = str(e.msg or "")
    return "too many nested" in msg or "too complex" in msg or "too many statically nested" in msg


def _pattern_visitor(contract: Contract, report: Callable):
    module, cls = PATTERNS[contract.code].visitor.split(":")
    return getattr(importlib.import_module(f"guardlint.lint.{module}"), cls)(contract, report)


_LARGE_FILE = 512 * 1024


def syntax_check(data: bytes, path: str) -> FileResult:
    """GL000 for a file that no rule can match but that does not parse either (files are only fully
    checked when the pre-filter finds a target name in them; syntax errors are reported everywhere)."""
    if len(data) > MAX_BYTES:
        return FileResult(path, [])
    # A large file is parsed a chunk at a time (its whole tree takes ~120 bytes a byte). From chunks'
    # default MIN_BYTES on: importing that module loads libcst, which a small file here never needs.
    if len(data) >= _LARGE_FILE:
        from . import chunks

        if chunks.parses(data):
            return FileResult(path, [])
    # The tree is dropped at once and holds no cycles: the collector passes that its allocations
    # would trigger are pure cost (~15% of this function on the sglang tree).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        ast.parse(data, filename=path)
    except SyntaxError as e:
        if _too_nested(e):
            return file_error(path, e.msg, e.lineno, e.offset)
        _load()
        try:  # syntax newer than this Python's (libcst knows it) is no error of the file
            cst.parse_module(data)
            return FileResult(path, [])
        except Exception:
            return file_error(path, str(e.msg), e.lineno, e.offset)
    except ValueError as e:  # null bytes
        return file_error(path, str(e))
    except (RecursionError, MemoryError):
        # Too deep for the ast module but maybe not for the compiler: nothing to report when no rule
        # could match anyway.
        return FileResult(path, [])
    finally:
        if was_enabled:
            gc.enable()
    return FileResult(path, [])


def check_source(data: bytes, path: str, rules: RuleSet, *, strict: bool = False,
                 module_name: Optional[str] = None, is_package: bool = False,
                 keep_module: bool = False, prefilter: bool = False, sketch: bool = False,
                 callees: Optional[dict] = None) -> FileResult:
    """Findings of one file's bytes (PEP 263 cookies and a UTF-8 BOM are honoured).

    ``module_name`` (dotted, from the file's package) resolves relative imports and makes this
    file's own module-level definitions targets when their qualified name is one. Never raises for
    a problem of the file: those are GL000 findings. With ``prefilter``, a file whose CPython tree
    holds nothing a rule could report is not given to libcst (``prefilter.py``); ``parsed`` is then
    False. With ``sketch``, the result carries the file's facts for the callee summaries; ``callees``
    is the file's table of them (``summaries.build``), which GL104 asks at its calls.
    """
    try:
        return _check_source(data, path, rules, strict, module_name, is_package, keep_module, prefilter,
                             sketch, callees)
    except RecursionError:
        return file_error(path, "nested too deeply to check")
    except MemoryError:
        return file_error(path, "out of memory while checking")
    except Exception as e:  # a bug of ours must not end the run for every other file
        return file_error(path, f"internal error while checking ({type(e).__name__}: {e}); "
                                f"the file was not checked")


def _check_source(data, path, rules, strict, module_name, is_package, keep_module, prefilter, sketch=False,
                  callees=None) -> FileResult:
    if len(data) > MAX_BYTES:
        return file_error(path, f"file too large to check ({len(data) / 1e6:.1f} MB; the limit is "
                                f"{MAX_BYTES // (1024 * 1024)} MB)")
    if not keep_module:
        from . import chunks

        if len(data) >= chunks.MIN_BYTES:  # a large file, in pieces: its trees would take gigabytes
            result = chunks.check(data, path, rules, strict, module_name, is_package, prefilter, _pattern_visitor)
            if result is not None:
                return result
    tree = None
    syntax_error: Optional[SyntaxError] = None
    # As in syntax_check: the tree holds no cycles, so collector passes during the parse are pure
    # cost, and most files past the textual filter end here when the tree pre-filter drops them.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        tree = ast.parse(data, filename=path)
    except SyntaxError as e:
        if _too_nested(e):
            return file_error(path, e.msg, e.lineno, e.offset)
        syntax_error = e
    except (RecursionError, MemoryError):
        return file_error(path, "nested too deeply to parse")
    except ValueError as e:  # null bytes
        return file_error(path, str(e))
    finally:
        if was_enabled:
            gc.enable()
    facts = None
    if sketch and tree is not None:
        from .summaries import sketch as sketch_file

        facts = sketch_file(tree, data, path, module_name, is_package)
    kernel_facts: Optional[tuple] = None
    if prefilter and tree is not None:
        from .prefilter import tree_filter

        gate = tree_filter(rules)
        if not gate.may_report(tree, data):
            # A call of a known varlen kernel states facts no name carries (``kernel_facts``): GL104 reads it.
            if gate.host_sync:
                from .kernel_facts import file_facts

                kernel_facts = file_facts(tree, data, module_name, is_package)
            if not (kernel_facts and (kernel_facts[1] or kernel_facts[2])):
                return FileResult(path, [], facts=facts)
    _load()
    # libcst's parse allocates a node object per token and per grammar rule and makes no cycles: the
    # collector passes it triggers cost ~10% of the parse (65 files of sglang 0.5.23: 2.26 -> 2.04 s).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        module = cst.parse_module(data)
    except Exception as e:  # ParserSyntaxError, decoding errors, unknown encodings
        if syntax_error is not None:
            return file_error(path, syntax_error.msg, syntax_error.lineno, syntax_error.offset)
        if tree is not None:  # CPython reads it: a limit of libcst's parser, not an error of the file
            detail = e.message.strip().splitlines()[0] if isinstance(e, cst.ParserSyntaxError) else str(e)
            return file_error(path, f"valid Python that the checker's parser cannot read ({detail}); "
                                    f"the file was not checked")
        if isinstance(e, cst.ParserSyntaxError):
            return file_error(path, e.message.strip().splitlines()[0], e.raw_line, e.raw_column + 1)
        return file_error(path, f"{type(e).__name__}: {e}")
    finally:
        if was_enabled:
            gc.enable()

    collector = Collector(module_name, is_package)
    collector.default_indent = module.default_indent
    raw: list[RawFinding] = []
    visitors: list[object] = [collector]
    for contract in rules.patterns:
        # (``note``: the finding's own facts, before the rule's words: the path through a callee, GL104)
        visitor = _pattern_visitor(contract, lambda node, message, note="", c=contract: raw.append(RawFinding(
            node, c, message, c.severity, note="\n".join(filter(None, (note, pattern_note(c)))))))
        if callees and hasattr(visitor, "callees"):
            visitor.callees, visitor.path = callees, path
        if hasattr(visitor, "registered") and tree is not None:
            from .registries import may_register, registered

            if may_register(data):
                visitor.registered = registered(tree)
        if hasattr(visitor, "kernels"):
            if kernel_facts is None:
                from .kernel_facts import file_facts

                kernel_facts = file_facts(tree, data, module_name, is_package)
            visitor.kernels, visitor.kernel_seeds, visitor.kernel_unpacked = \
                kernel_facts[0], kernel_facts[1], kernel_facts[3]
        visitors.append(visitor)
    Walker(visitors).walk(module)
    raw.extend(Checker(rules, collector, strict, path=path).run())
    result = FileResult(path, [], parsed=True, module=module if keep_module else None, facts=facts)
    if not raw:
        return result

    positions = _positions_from_ast(module, tree, collector.calls, raw, data) if tree is not None else None
    if positions is None:
        positions = _positions_from_cst(module, raw)
    table = suppress.suppressions(data) if suppress.may_suppress(data) else None
    fixer = _Fixer(module, tree, data, Resolver(collector.module, {}, ()))
    fixer.path = path
    seen = set()
    for r, (line, col, end_line, end_col, call_line, call_range) in sorted(zip(raw, positions),
                                                                           key=lambda x: x[1][:5]):
        code = r.contract.code
        # A multi-line call is suppressed on its first line or on the finding's own lines.
        if table and suppress.is_suppressed(table, code, (line, end_line, call_line)):
            continue
        key = (line, col, code, r.message)
        if key in seen:
            continue
        seen.add(key)
        fix, why = fixer.fix(r, call_range)
        message, note = without_fix(r.message, r.note, why)
        result.findings.append(Finding(path, line, col, code, message, r.contract.name, r.severity,
                                       end_line, end_col, fix, note))
        if keep_module:
            result.nodes.append(r.node)
    return result
