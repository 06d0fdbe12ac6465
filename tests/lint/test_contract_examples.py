"""Every contract's examples, through the linter: a contract cannot exist without showing what it
catches (bad examples, flagged exactly at their ``# expect:`` markers) and what it leaves alone (good
and fixed examples, clean for the contract's code)."""
from __future__ import annotations

import pytest

from guardlint.contracts import all_contracts
from guardlint.lint import build_rules, check_source

RULES = build_rules()
CASES = [pytest.param(c, e, id=f"{c.code}-{e.kind}{i}") for c in all_contracts() for i, e in enumerate(c.examples)]


def _findings(code: str):
    return check_source(code.encode(), "example.py", RULES).findings


@pytest.mark.parametrize("contract, example", CASES)
def test_contract_example(contract, example):
    findings = _findings(example.code)
    got = sorted((f.line, f.code) for f in findings)
    if example.kind == "bad":
        assert example.expected(), "a bad example must mark its offending lines with # expect:"
        assert got == sorted(example.expected())
        # One short line (headed by the rule's headline, where it has one); the kernel's words in the note.
        own = [f for f in findings if f.code == contract.code]
        assert all(len(f.message) <= 120 and f.message.startswith(contract.diagnosis.headline) for f in own)
        assert all(f.note.startswith(contract.diagnosis.message.rstrip(". ")) for f in own)
    else:
        assert [g for g in got if g[1] == contract.code] == []


@pytest.mark.parametrize("contract, example", [p for p in CASES if p.values[1].kind == "bad"])
def test_contract_bad_example_without_markers_is_still_flagged(contract, example):
    """The markers are comments: the finding comes from the code, not from the marker text."""
    got = sorted((f.line, f.code) for f in _findings(example.without_markers()))
    assert got == sorted(example.expected())


def test_every_linted_contract_shows_what_it_catches():
    for c in all_contracts():
        if c.linted and c.code not in ("GL000", "GL001"):  # file-level and user-declared
            assert c.examples_of("bad"), f"{c.code} has no bad example"


def test_runtime_contracts_are_never_reported():
    runtime = {c.code for c in all_contracts() if c.kind == "runtime"}
    assert runtime and not runtime & set(RULES.codes)
