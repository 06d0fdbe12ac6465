"""The linter's work grows linearly with a file's size: counted in Python function calls (cProfile),
which are deterministic, not in seconds, which are not. bench/lint_large_file.py times the real CLI."""
from __future__ import annotations

import cProfile
import importlib.util
import pstats
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "lint_large_file.py"


def _large_source(calls: int) -> str:
    spec = importlib.util.spec_from_file_location("lint_large_file", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.large_source(calls)


def _calls_to_check(source: str) -> int:
    from guardlint.lint import build_rules
    from guardlint.lint.runner import deep_check

    rules = build_rules()
    profile = cProfile.Profile()
    profile.enable()
    result = deep_check(source.encode(), "large.py", rules)
    profile.disable()
    assert len(result.findings) == 2 * source.count("cudnn_vision_attention(q")
    return pstats.Stats(profile).total_calls


def test_check_of_many_fixable_calls_grows_linearly():
    _calls_to_check(_large_source(20))  # imports and caches outside the count
    small, large = _calls_to_check(_large_source(400)), _calls_to_check(_large_source(800))
    # Linear is 2.0 (a little less: per-file work); the per-finding scan of the module body that
    # this guards against made it 2.2 at these sizes.
    assert large / small < 2.08, (small, large)


# -- a large file is checked in chunks of top-level statements (lint/chunks.py) --------------------
_CHUNKED_HEAD = '''"""A generated module for the chunked check."""
from guardlint.kernels import cudnn_vision_attention as cva
import guardlint.kernels as gk

LIMIT = 4


class VisionBlock:
    def forward(self, q, k, v, cu_seqlens, bsz, seq_len):
        n = read_lengths(cu_seqlens)
        return cva(q, k, v, cu_seqlens, bsz, seq_len) + n


'''
_CHUNKED_FUNCTION = '''def layer_{i}(q, k, v, cu_seqlens, bsz, seq_len):
    out = cva(q, k, v, cu_seqlens, bsz, seq_len)
    other = gk.cudnn_vision_attention(
        q, k, v,
        cu_seqlens, bsz, seq_len,
    )
    late = late_bound(q, k, v, cu_seqlens, bsz, seq_len)  # noqa: GL102
    return out, other, late


@staticmethod
def decorated_{i}(q, k, v, cu_seqlens, bsz, seq_len):
    global shared_{i}
    shared_{i} = cva(q, k, v, cu_seqlens, bsz, seq_len)


'''
# A module-level call, a host-reading helper defined after its caller (GL104), and an import at the end
# that the functions before it see (a function body sees the module's last binding of a name).
_CHUNKED_TAIL = '''cva(q0, k0, v0, cu0, 1, 2)


def read_lengths(cu_seqlens):
    return cu_seqlens.max().item()


from guardlint.kernels import cudnn_vision_attention as late_bound
'''


def _chunked_source(functions: int) -> str:
    return _CHUNKED_HEAD + "".join(_CHUNKED_FUNCTION.format(i=i) for i in range(functions)) + _CHUNKED_TAIL


def _both_ways(monkeypatch, run, chunk_bytes: int):
    """``run()`` checked whole, then in chunks of about ``chunk_bytes``."""
    from guardlint.lint import chunks

    monkeypatch.setattr(chunks, "MIN_BYTES", 1 << 40)
    whole = run()
    monkeypatch.setattr(chunks, "MIN_BYTES", 0)
    monkeypatch.setattr(chunks, "CHUNK_BYTES", chunk_bytes)
    return whole, run()


def test_chunked_check_finds_what_the_whole_file_check_finds(monkeypatch):
    import collections

    from guardlint.lint import build_rules, chunks
    from guardlint.lint.engine import _pattern_visitor
    from guardlint.lint.runner import lint_source

    source = _chunked_source(12)
    rules = build_rules()
    for chunk_bytes in (1, 300, 2000):
        monkeypatch.setattr(chunks, "MIN_BYTES", 0)
        monkeypatch.setattr(chunks, "CHUNK_BYTES", chunk_bytes)
        assert len(chunks._starts(source)) >= 3
        # The chunked path itself answers (it did not fall back to the whole-file check).
        assert chunks.check(source.encode(), "gen.py", rules, False, None, False, True, _pattern_visitor) is not None
        whole, chunked = _both_ways(monkeypatch, lambda: lint_source(source, "gen.py"), chunk_bytes)
        assert chunked == whole
    codes = collections.Counter(f.code for f in whole)
    # Through the aliases, the late import (suppressed once a function for GL102), the helper.
    assert codes == {"GL101": 50, "GL102": 38, "GL104": 1}, codes
    assert all(f.fix is not None for f in whole if f.code != "GL104")


def test_chunked_check_fixes_what_the_whole_file_check_fixes(monkeypatch):
    from guardlint.lint.runner import fixed_source

    source = _chunked_source(12)
    whole, chunked = _both_ways(monkeypatch, lambda: fixed_source(source, "gen.py", unsafe_fixes=True), 300)
    assert chunked == whole
    assert whole != source and "from guardlint.guard import prepare_varlen_metadata" in whole


def test_chunked_check_of_the_benchmark_module(monkeypatch):
    from guardlint.lint.runner import fixed_source, lint_source

    source = _large_source(300)
    whole, chunked = _both_ways(monkeypatch, lambda: lint_source(source, "large.py"), 4096)
    assert chunked == whole and len(whole) == 600
    whole, chunked = _both_ways(monkeypatch, lambda: fixed_source(source, "large.py", unsafe_fixes=True), 4096)
    assert chunked == whole != source


def test_large_file_without_targets_is_syntax_checked_in_chunks(monkeypatch):
    """A large file no rule can match is only syntax-checked, a chunk at a time (CPython's whole tree of
    a 5 MB module is ~600 MB): no finding when it parses; its syntax error reported where it is (the
    whole-file parse decides whenever a chunk fails); a chunk boundary inside a string is no error."""
    from guardlint.lint import chunks, engine

    monkeypatch.setattr(chunks, "CHUNK_BYTES", 4096)
    source = _large_source(3000).replace("cudnn_vision_attention", "some_other_function")
    assert len(source) >= engine._LARGE_FILE
    parsed = []
    real_parse = chunks.ast.parse
    monkeypatch.setattr(chunks.ast, "parse", lambda text, *a, **kw: parsed.append(len(text)) or real_parse(text))
    assert chunks.parses(source.encode())
    assert len(parsed) > 100 and max(parsed) < 8192, "not parsed a chunk at a time"
    assert engine.syntax_check(source.encode(), "big.py").findings == []

    lines = source.split("\n")
    broken_line = len(lines) // 2
    lines[broken_line - 1] = "    return out *"  # inside a function in the middle of the file
    bad = "\n".join(lines).encode()
    assert not chunks.parses(bad)
    (finding,) = engine.syntax_check(bad, "big.py").findings
    assert finding.code == "GL000" and finding.line == broken_line

    # "def" at the start of a line inside a triple-quoted string: a chunk that does not parse alone, a file
    # that does.
    quoted = source + 'NOTE = """\n' + "def not_code(:\n" * 2000 + '"""\n' + source
    assert not chunks.parses(quoted.encode())
    assert engine.syntax_check(quoted.encode(), "big.py").findings == []
