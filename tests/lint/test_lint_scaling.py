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
