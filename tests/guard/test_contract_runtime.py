"""Every contract's runnable examples, through the runtime guard.

The linter half of the same examples is in test_contract_examples.py. Here: a bad example crashes with the
contract's own code when the guard is off, runs when the guard derives, and then gives exactly what its fixed
twin gives; good and fixed examples run even with the guard off (they pass what the kernel needs).
"""
from __future__ import annotations

import pytest
import torch

import guardlint.guard as guard
from guardlint.contracts import all_contracts

RUNNABLE = [
    (c.code, i, e) for c in all_contracts() for i, e in enumerate(c.examples) if e.runnable
]


def _run(code: str, mode: str) -> dict:
    torch.manual_seed(0)
    namespace: dict = {"__name__": "example"}
    with guard.mode(mode):
        exec(compile(code, "<example>", "exec"), namespace)
    return {k: v for k, v in namespace.items() if isinstance(v, torch.Tensor)}


def _twin(code: str, index: int):
    contract = next(c for c in all_contracts() if c.code == code)
    later = contract.examples[index + 1:]
    return next((e for e in later if e.kind == "fixed"), None)


def test_catalog_has_runnable_examples_for_both_crashes():
    codes = {code for code, _, _ in RUNNABLE}
    assert {"GL101", "GL102", "GL201"} <= codes


@pytest.mark.parametrize("code,index,example", RUNNABLE, ids=[f"{c}-{i}-{e.kind}" for c, i, e in RUNNABLE])
def test_contract_example_at_runtime(code, index, example):
    source = example.without_markers()
    if example.kind != "bad":
        assert _run(source, "off"), "a good or fixed example must run without the guard"
        return
    expected_codes = {c for _, c in example.expected()}
    with pytest.raises(guard.GuardError) as info:
        _run(source, "off")
    assert info.value.code in expected_codes
    derived = _run(source, "derive")
    twin = _twin(code, index)
    assert twin is not None, "a runnable bad example needs a fixed twin after it"
    fixed = _run(twin.without_markers(), "off")
    shared = sorted(set(derived) & set(fixed))
    assert shared
    for name in shared:
        torch.testing.assert_close(derived[name], fixed[name], rtol=0, atol=0, msg=name)
