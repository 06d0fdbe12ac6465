"""``guardlint server``: a language server on stdio (pygls) for editors.

Diagnostics on open, change and save, checked from the buffer in memory; a quick fix per finding that has
one (unsafe ones say so) and the rule's explanation on hover. Each document
is checked with the ``[tool.guardlint]`` settings of the nearest configuration above it, as the CLI does.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lsprotocol import types
from pygls.lsp.server import LanguageServer
from pygls.uris import to_fs_path
from pygls.workspace import ServerTextPosition, ServerTextRange, TextDocument

from guardlint._version import __version__
from guardlint.contracts import ConfigError, Contract, all_contracts

from .config import Settings, find_config, load_settings
from .findings import Finding
from .output import help_uri
from .rules import RuleSet


SOURCE = "guardlint"


@dataclass(frozen=True)
class Checked:
    """The findings of one version of a document, kept for hover and code actions."""

    version: Optional[int]
    source: str
    findings: tuple[Finding, ...]
    settings: Optional[Settings]


class _SettingsCache:
    """Settings per configuration file, read again when the file's modification time changes (a saved
    ``pyproject.toml`` applies to the next check without a restart)."""

    def __init__(self):
        self._by_config: dict[Optional[Path], tuple[float, Settings]] = {}
        self._rules: dict[int, tuple[Settings, RuleSet]] = {}

    def for_path(self, path: Path) -> Settings:
        config = find_config(path.parent)
        mtime = config.stat().st_mtime if config is not None else 0.0
        hit = self._by_config.get(config)
        if hit is not None and hit[0] == mtime:
            return hit[1]
        settings = load_settings([str(path)], cwd=path.parent)
        self._by_config[config] = (mtime, settings)
        return settings

    def rules(self, settings: Settings) -> RuleSet:
        from .runner import rules_for

        key = id(settings)
        hit = self._rules.get(key)
        if hit is None or hit[0] is not settings:
            hit = self._rules[key] = (settings, rules_for(settings))
        return hit[1]

    def clear(self) -> None:
        self._by_config.clear()
        self._rules.clear()


class GuardlintServer(LanguageServer):
    def __init__(self):
        super().__init__(SOURCE, __version__, text_document_sync_kind=types.TextDocumentSyncKind.Incremental)
        self.checked: dict[str, Checked] = {}
        self.settings = _SettingsCache()
        # One checking thread: a document's checks run one after another, newest version last, and the
        # event loop stays free for hovers and code actions meanwhile.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guardlint-check")
        self._dirty: set[str] = set()
        self._running: set[str] = set()
        self._lock = threading.Lock()

    # -- checking ----------------------------------------------------------------------------------
    def check_document(self, uri: str, source: str, version: Optional[int]) -> tuple[Checked, Optional[str]]:
        """The findings of ``source`` as ``guardlint check`` would report them for the document's path,
        and a configuration error (shown to the user) or None."""
        from .runner import lint_buffer

        path = Path(to_fs_path(uri) or uri)
        try:
            settings = self.settings.for_path(path)
        except ConfigError as e:
            return Checked(version, source, (), None), str(e)
        findings = lint_buffer(source.encode("utf-8", "surrogatepass"), str(path), settings,
                               rules=self.settings.rules(settings))
        return Checked(version, source, tuple(findings), settings), None

    async def schedule(self, uri: str) -> None:
        """Check ``uri``'s newest text and publish; changes that arrive meanwhile are checked once, after."""
        self._dirty.add(uri)
        if uri in self._running:
            return
        self._running.add(uri)
        loop = asyncio.get_running_loop()
        try:
            while uri in self._dirty:
                self._dirty.discard(uri)
                doc = self.workspace.get_text_document(uri)
                source, version = doc.source, doc.version
                checked, error = await loop.run_in_executor(self.executor, self.check_document, uri, source,
                                                            version)
                if error is not None:
                    self.window_show_message(types.ShowMessageParams(types.MessageType.Error,
                                                                     f"guardlint: {error}"))
                if uri in self._dirty:  # a newer text is waiting: these findings are already stale
                    continue
                self.checked[uri] = checked
                self.text_document_publish_diagnostics(types.PublishDiagnosticsParams(
                    uri=uri, version=version, diagnostics=[diagnostic(doc, f) for f in checked.findings]))
        finally:
            self._running.discard(uri)

    def current(self, uri: str) -> Optional[tuple[TextDocument, Checked]]:
        """The document and its findings, when they were computed on its current text."""
        checked = self.checked.get(uri)
        if checked is None:
            return None
        doc = self.workspace.get_text_document(uri)
        if doc.source != checked.source:
            return None
        return doc, checked


# -- positions: findings count characters from 1; LSP counts UTF-16 units (by default) from 0 ------------
def _range(doc: TextDocument, line: int, column: int, end_line: int, end_column: int) -> types.Range:
    lines = doc.lines
    start = ServerTextPosition(max(line - 1, 0), max(column - 1, 0))
    if end_line <= 0:  # no end: to the end of the line
        end_line = line
        end_column = len(lines[line - 1].rstrip("\r\n")) + 1 if 0 < line <= len(lines) else column
    end = ServerTextPosition(max(end_line - 1, 0), max(end_column - 1, 0))
    return doc.range_to_client_units(ServerTextRange(start, end))


def diagnostic(doc: TextDocument, f: Finding) -> types.Diagnostic:
    severity = types.DiagnosticSeverity.Error if f.severity == "error" else types.DiagnosticSeverity.Warning
    href = help_uri(f.code, f.name)
    return types.Diagnostic(
        range=_range(doc, f.line, f.column, f.end_line, f.end_column),
        message=f"{f.message}\n{f.note}" if f.note else f.message,
        severity=severity,
        code=f.code,
        code_description=types.CodeDescription(href) if href else None,
        source=SOURCE,
    )


def _same(d: types.Diagnostic, doc: TextDocument, f: Finding) -> bool:
    return d.code == f.code and d.range == _range(doc, f.line, f.column, f.end_line, f.end_column)


def _contains(r: types.Range, p: types.Position) -> bool:
    return (r.start.line, r.start.character) <= (p.line, p.character) <= (r.end.line, r.end.character)


def _overlaps(a: types.Range, b: types.Range) -> bool:
    return not ((a.end.line, a.end.character) < (b.start.line, b.start.character)
                or (b.end.line, b.end.character) < (a.start.line, a.start.character))


def _contract(code: str, settings: Optional[Settings]) -> Optional[Contract]:
    extra = settings.contracts if settings is not None else ()
    return next((c for c in (*extra, *all_contracts()) if c.code == code), None)


server = GuardlintServer()


@server.feature(types.TEXT_DOCUMENT_DID_OPEN)
async def did_open(ls: GuardlintServer, params: types.DidOpenTextDocumentParams) -> None:
    await ls.schedule(params.text_document.uri)


@server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
async def did_change(ls: GuardlintServer, params: types.DidChangeTextDocumentParams) -> None:
    await ls.schedule(params.text_document.uri)


@server.feature(types.TEXT_DOCUMENT_DID_SAVE)
async def did_save(ls: GuardlintServer, params: types.DidSaveTextDocumentParams) -> None:
    uri = params.text_document.uri
    if uri.endswith(("pyproject.toml", "guardlint.toml")):
        ls.settings.clear()  # a configuration changed: every open Python document is checked again
        for open_uri in list(ls.workspace.text_documents):
            if open_uri.endswith((".py", ".pyi")):
                await ls.schedule(open_uri)
        return
    await ls.schedule(uri)


@server.feature(types.WORKSPACE_DID_CHANGE_WATCHED_FILES)
async def did_change_watched(ls: GuardlintServer, params: types.DidChangeWatchedFilesParams) -> None:
    if any(c.uri.endswith(("pyproject.toml", "guardlint.toml")) for c in params.changes):
        ls.settings.clear()
        for open_uri in list(ls.workspace.text_documents):
            if open_uri.endswith((".py", ".pyi")):
                await ls.schedule(open_uri)


@server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
def did_close(ls: GuardlintServer, params: types.DidCloseTextDocumentParams) -> None:
    uri = params.text_document.uri
    ls.checked.pop(uri, None)
    ls.text_document_publish_diagnostics(types.PublishDiagnosticsParams(uri=uri, diagnostics=[]))


@server.feature(types.TEXT_DOCUMENT_HOVER)
def hover(ls: GuardlintServer, params: types.HoverParams) -> Optional[types.Hover]:
    """The explanation of each rule reported where the cursor is (``guardlint explain CODE``)."""
    from .explain import explain

    found = ls.current(params.text_document.uri)
    if found is None:
        return None
    doc, checked = found
    pages, seen = [], set()
    for f in checked.findings:
        r = _range(doc, f.line, f.column, f.end_line, f.end_column)
        if f.code in seen or not _contains(r, params.position):
            continue
        contract = _contract(f.code, checked.settings)
        if contract is not None:
            seen.add(f.code)
            pages.append(f"**{f.code}** {f.message}\n\n```text\n{explain(contract).rstrip()}\n```")
    if not pages:
        return None
    return types.Hover(contents=types.MarkupContent(types.MarkupKind.Markdown, "\n\n---\n\n".join(pages)))


def _text_edits(doc: TextDocument, f: Finding) -> list[types.TextEdit]:
    assert f.fix is not None
    return [types.TextEdit(_range(doc, e.line, e.column, e.end_line, e.end_column), e.content)
            for e in f.fix.edits]


@server.feature(types.TEXT_DOCUMENT_CODE_ACTION,
                types.CodeActionOptions(code_action_kinds=[types.CodeActionKind.QuickFix]))
def code_action(ls: GuardlintServer, params: types.CodeActionParams) -> Optional[list[types.CodeAction]]:
    """A quick fix per finding in the range that has a fix; unsafe ones (every built-in fix is: it adds
    a runtime dependency or a host read) are marked and never preferred, so no editor applies them on
    its own."""
    uri = params.text_document.uri
    found = ls.current(uri)
    if found is None:
        return None
    doc, checked = found
    only = params.context.only
    if only and not any(types.CodeActionKind.QuickFix.startswith(k) for k in only):
        return None
    actions = []
    for f in checked.findings:
        if f.fix is None:
            continue
        r = _range(doc, f.line, f.column, f.end_line, f.end_column)
        if not _overlaps(r, params.range):
            continue
        unsafe = f.fix.applicability == "unsafe"
        related = [d for d in params.context.diagnostics if _same(d, doc, f)]
        actions.append(types.CodeAction(
            title=f"{f.code}: {f.fix.message}" + (" (unsafe fix)" if unsafe else ""),
            kind=types.CodeActionKind.QuickFix,
            diagnostics=related or [diagnostic(doc, f)],
            is_preferred=not unsafe,
            edit=types.WorkspaceEdit(changes={uri: _text_edits(doc, f)}),
        ))
    return actions


def main() -> None:
    server.start_io()


if __name__ == "__main__":
    main()
