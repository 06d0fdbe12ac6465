"""A small language-server client over stdio, as an editor is: JSON-RPC 2.0 in ``Content-Length`` frames.

It starts ``guardlint server`` in a subprocess, answers the server's own requests with null, and keeps
every notification it receives, so a test or a benchmark can wait for the diagnostics of one version.
Written against the protocol, not against pygls, so it checks the framing the server really writes.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional


class LspError(Exception):
    pass


class Client:
    def __init__(self, cmd: Optional[list[str]] = None, cwd: Optional[str] = None):
        cmd = cmd or [sys.executable, "-m", "guardlint.lint.cli", "server"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._next_id = 0
        self._responses: dict[int, dict] = {}
        self.notifications: list[tuple[float, dict]] = []
        self._cond = threading.Condition()
        self._closed = False
        self.stderr: "queue.Queue[bytes]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    # -- framing -------------------------------------------------------------------------------------
    def _send(self, payload: dict) -> None:
        body = json.dumps(payload).encode("utf-8")
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        self.proc.stdin.flush()

    def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        try:
            while True:
                headers = {}
                while True:
                    line = out.readline()
                    if not line:
                        return
                    line = line.strip()
                    if not line:
                        break
                    key, _, value = line.decode("ascii").partition(":")
                    headers[key.strip().lower()] = value.strip()
                body = out.read(int(headers["content-length"]))
                message = json.loads(body.decode("utf-8"))
                self._dispatch(message)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.put(line)

    def _dispatch(self, message: dict) -> None:
        if "id" in message and "method" in message:  # the server asks: an editor answers every request
            self._send({"jsonrpc": "2.0", "id": message["id"], "result": None})
            return
        with self._cond:
            if "id" in message:
                self._responses[message["id"]] = message
            else:
                self.notifications.append((time.perf_counter(), message))
            self._cond.notify_all()

    # -- the protocol ----------------------------------------------------------------------------------
    def request(self, method: str, params: Any = None, timeout: float = 30.0) -> Any:
        self._next_id += 1
        rid = self._next_id
        self._send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
        with self._cond:
            if not self._cond.wait_for(lambda: rid in self._responses or self._closed, timeout):
                raise LspError(f"no answer to {method} in {timeout} s")
            if rid not in self._responses:
                raise LspError(f"the server closed its output before answering {method}: {self.stderr_text()}")
            response = self._responses.pop(rid)
        if "error" in response:
            raise LspError(f"{method}: {response['error']}")
        return response.get("result")

    def notify(self, method: str, params: Any = None) -> None:
        self._send({"jsonrpc": "2.0", "method": method, "params": params})

    def wait_for(self, predicate: Callable[[dict], bool], timeout: float = 30.0, after: int = 0) -> tuple[float, dict]:
        """The first notification (index >= ``after``) for which ``predicate`` holds, with its arrival time."""
        with self._cond:
            def found():
                return next((n for n in self.notifications[after:] if predicate(n[1])), None)

            if not self._cond.wait_for(lambda: found() is not None or self._closed, timeout):
                raise LspError(f"no matching notification in {timeout} s")
            hit = found()
            if hit is None:
                raise LspError(f"the server closed its output: {self.stderr_text()}")
            return hit

    def diagnostics(self, uri: str, version: Optional[int] = None, timeout: float = 30.0,
                    after: int = 0) -> list[dict]:
        def match(m: dict) -> bool:
            return (m.get("method") == "textDocument/publishDiagnostics" and m["params"]["uri"] == uri
                    and (version is None or m["params"].get("version") == version))

        return self.wait_for(match, timeout, after)[1]["params"]["diagnostics"]

    def stderr_text(self) -> str:
        lines = []
        while not self.stderr.empty():
            lines.append(self.stderr.get().decode("utf-8", "replace"))
        return "".join(lines)

    # -- an editor's session ---------------------------------------------------------------------------
    def initialize(self, folders: list[Path]) -> dict:
        result = self.request("initialize", {
            "processId": os.getpid(),
            "rootUri": folders[0].as_uri() if folders else None,
            "workspaceFolders": [{"uri": f.as_uri(), "name": f.name} for f in folders],
            "capabilities": {"textDocument": {
                "publishDiagnostics": {"versionSupport": True},
                "hover": {"contentFormat": ["markdown", "plaintext"]},
                "codeAction": {"codeActionLiteralSupport": {"codeActionKind": {"valueSet": ["quickfix", "source"]}}},
            }, "general": {"positionEncodings": ["utf-16"]}},
        })
        self.notify("initialized", {})
        return result

    def open(self, path: Path, text: str, version: int = 1) -> str:
        uri = path.as_uri()
        self.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python",
                                                              "version": version, "text": text}})
        return uri

    def change(self, uri: str, version: int, changes: list[dict]) -> None:
        self.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": version},
                                               "contentChanges": changes})

    def shutdown(self, timeout: float = 10.0) -> int:
        try:
            self.request("shutdown", timeout=timeout)
            self.notify("exit")
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def insert(line: int, character: int, text: str) -> dict:
    """An incremental change inserting ``text`` at a (0-based) position."""
    pos = {"line": line, "character": character}
    return {"range": {"start": pos, "end": pos}, "text": text}


def apply_edits(text: str, edits: list[dict]) -> str:
    """``text`` after LSP TextEdits (UTF-16 positions), applied from the last to the first."""
    lines = text.splitlines(keepends=True) or [""]

    def offset(pos: dict) -> int:
        line = pos["line"]
        if line >= len(lines):
            return len(text)
        start = sum(len(s) for s in lines[:line])
        units, i = 0, 0
        row = lines[line]
        while i < len(row) and units < pos["character"]:
            units += 2 if ord(row[i]) > 0xFFFF else 1
            i += 1
        return start + i

    spans = sorted(((offset(e["range"]["start"]), offset(e["range"]["end"]), e["newText"]) for e in edits),
                   reverse=True)
    for start, end, new in spans:
        text = text[:start] + new + text[end:]
    return text
