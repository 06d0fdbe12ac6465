"""Runs the linter over paths: discovery, the textual pre-filter, parallel checking, selection.

Reading and pre-filtering happen in this process (a substring search per file, far cheaper than any
parse); only files that can contain a target are parsed, across processes when there are enough of
them to pay for starting the workers.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from guardlint.contracts import all_contracts

from .config import SELECTOR, PathMatcher, Settings, UsageError, check_codes, relative_to_root
from .findings import Finding
from .rules import RuleSet, build_rules

SOURCE_SUFFIXES = (".py", ".pyi")
# Below this many files to parse, starting worker processes (fork + libcst import, ~0.1-0.3 s)
# costs more than it saves; a 300-line file parses in ~10 ms.
MIN_PARALLEL = 24


@dataclass
class Report:
    findings: list[Finding]
    files: int = 0  # files considered
    parsed: int = 0  # files that passed the pre-filter and were parsed
    results: list = field(default_factory=list)  # FileResult per parsed file, with keep_modules


@dataclass(frozen=True)
class Candidate:
    path: str  # as shown in findings
    data: bytes
    module_name: Optional[str]
    is_package: bool


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def rules_for(settings: Settings) -> RuleSet:
    builtin = [c for c in all_contracts() if settings.selected(c.code)]
    extra = [c for c in settings.contracts if settings.selected(c.code)]
    return build_rules(extra, builtin=builtin)


def with_options(settings: Settings, select: Sequence[str] = (), ignore: Sequence[str] = (),
                 exclude: Sequence[str] = ()) -> Settings:
    """Command-line options over the configuration: --select replaces, --ignore and --exclude add."""
    select = tuple(s.strip().upper() for s in select if s.strip())
    ignore = tuple(s.strip().upper() for s in ignore if s.strip())
    for key, codes in (("--select", select), ("--ignore", ignore)):
        for code in codes:
            if not SELECTOR.match(code):
                raise UsageError(f"{key}: {code!r} is not a rule code or prefix (like 'GL101' or 'GL1')")
        check_codes(settings, codes, key, error=UsageError)
    exclude = tuple(e.strip() for e in exclude if e.strip())
    if exclude:
        from guardlint.contracts import ConfigError

        try:
            PathMatcher(exclude, "--exclude")
        except ConfigError as e:
            raise UsageError(str(e)) from None
    return dataclasses.replace(settings, select=select or settings.select, ignore=settings.ignore + ignore,
                               exclude=settings.exclude + exclude)


# -- discovery ------------------------------------------------------------------------------------
def discover(paths: Sequence[str], settings: Settings) -> list[str]:
    """Python files under ``paths`` (``*.py``, ``*.pyi``), excludes applied, in a stable order."""
    matcher = PathMatcher(settings.exclude)
    out: list[str] = []
    for arg in paths:
        p = Path(arg)
        if not p.exists():
            raise UsageError(f"{arg}: no such file or directory")
        rel = relative_to_root(p, settings.root)
        if rel not in ("", ".") and matcher.matches(rel, p.is_dir()):
            continue
        if p.is_file():
            out.append(os.path.normpath(arg))
            continue
        base_rel = "" if rel in ("", ".") else rel + "/"
        for dirpath, dirnames, filenames in os.walk(arg):
            sub = os.path.relpath(dirpath, arg)
            sub_rel = base_rel + ("" if sub == "." else Path(sub).as_posix() + "/")
            dirnames[:] = sorted(d for d in dirnames if not _leaf_matches(matcher, sub_rel + d, True))
            for name in sorted(filenames):
                if name.endswith(SOURCE_SUFFIXES) and not _leaf_matches(matcher, sub_rel + name, False):
                    out.append(os.path.normpath(os.path.join(dirpath, name)))
    return list(dict.fromkeys(out))


def _leaf_matches(matcher: PathMatcher, rel: str, is_dir: bool) -> bool:
    # Parents were matched (and pruned) on the way down.
    return any(g.matches(rel, is_dir) for g in matcher.globs)


_PACKAGE_CACHE: dict[str, Optional[str]] = {}


def module_name_for(path: str) -> tuple[Optional[str], bool]:
    """Dotted module name from the package folders (those with ``__init__.py``) around ``path``."""
    p = Path(path)
    stem = p.name.rsplit(".", 1)[0]
    if not stem.isidentifier():
        return None, False
    package = _package_of(str(p.parent.resolve()) if p.parent != Path("") else os.getcwd())
    is_package = stem == "__init__"
    if is_package:
        return package, True
    return (f"{package}.{stem}" if package else stem), False


def _package_of(folder: str) -> Optional[str]:
    if folder in _PACKAGE_CACHE:
        return _PACKAGE_CACHE[folder]
    name: Optional[str] = None
    if os.path.isfile(os.path.join(folder, "__init__.py")):
        leaf = os.path.basename(folder)
        if leaf.isidentifier():
            parent = _package_of(os.path.dirname(folder)) if os.path.dirname(folder) != folder else None
            name = f"{parent}.{leaf}" if parent else leaf
    _PACKAGE_CACHE[folder] = name
    return name


# -- checking -------------------------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(rules: RuleSet, strict: bool) -> None:
    _WORKER["rules"] = rules
    _WORKER["strict"] = strict


def _check_chunk(chunk: list[Candidate]) -> list:
    from .engine import check_source

    rules, strict = _WORKER["rules"], _WORKER["strict"]
    out = []
    for c in chunk:
        r = check_source(c.data, c.path, rules, strict=strict, module_name=c.module_name,
                         is_package=c.is_package)
        out.append((r.path, r.findings, r.parsed))
    return out


def _check_all(candidates: list[Candidate], rules: RuleSet, strict: bool, jobs: Optional[int],
               keep_modules: bool) -> list:
    workers = min(cpu_count(), jobs or cpu_count(), max(1, len(candidates) // 8))
    if keep_modules or workers <= 1 or len(candidates) < MIN_PARALLEL:
        from .engine import check_source

        return [check_source(c.data, c.path, rules, strict=strict, module_name=c.module_name,
                             is_package=c.is_package, keep_module=keep_modules) for c in candidates]
    from concurrent.futures import ProcessPoolExecutor

    # Biggest files first, dealt round-robin into chunks, so no worker ends with a long tail.
    ordered = sorted(candidates, key=lambda c: -len(c.data))
    n_chunks = workers * 4
    chunks = [ordered[i::n_chunks] for i in range(n_chunks)]
    chunks = [c for c in chunks if c]
    from .engine import FileResult

    results = []
    with ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(rules, strict)) as pool:
        for part in pool.map(_check_chunk, chunks):
            results.extend(FileResult(path, findings, parsed) for path, findings, parsed in part)
    return results


def lint_paths(paths: Sequence[str], settings: Settings, *, strict: bool = False,
               stdin: Optional[bytes] = None, stdin_filename: Optional[str] = None,
               jobs: Optional[int] = None, keep_modules: bool = False) -> Report:
    """Lint files and folders (``-`` reads ``stdin``); findings sorted by path, line, column."""
    from .engine import file_error

    rules = rules_for(settings)
    files = discover([p for p in paths if p != "-"], settings)
    candidates: list[Candidate] = []
    findings: list[Finding] = []
    for path in files:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            findings.extend(file_error(path, f"cannot read: {e.strerror or e}").findings)
            continue
        if rules.may_match(data):
            name, is_pkg = module_name_for(path)
            candidates.append(Candidate(path, data, name, is_pkg))
    n_files = len(files)
    if "-" in paths:
        n_files += 1
        data = stdin if stdin is not None else b""
        shown = stdin_filename or "-"
        if rules.may_match(data):
            name, is_pkg = module_name_for(stdin_filename) if stdin_filename else (None, False)
            candidates.append(Candidate(shown, data, name, is_pkg))

    results = _check_all(candidates, rules, strict, jobs, keep_modules) if candidates else []
    for r in results:
        findings.extend(r.findings)
    findings = [f for f in findings if settings.selected(f.code)]
    findings = _per_file_ignores(findings, settings)
    findings.sort(key=Finding.sort_key)
    return Report(findings, files=n_files, parsed=len(results), results=results if keep_modules else [])


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
        if not any(f.code.startswith(c) for c in ignored_for[f.path]):
            out.append(f)
    return out


def lint_source(source, path: str = "<string>", *, settings: Optional[Settings] = None, strict: bool = False,
                module_name: Optional[str] = None, rules: Optional[RuleSet] = None) -> list[Finding]:
    """Findings of one source text or bytes, selection applied (no pre-filter: it is always parsed)."""
    from .engine import check_source

    data = source.encode("utf-8") if isinstance(source, str) else source
    settings = settings or Settings(root=Path.cwd())
    rules = rules or rules_for(settings)
    result = check_source(data, path, rules, strict=strict, module_name=module_name)
    return [f for f in result.findings if settings.selected(f.code)]
