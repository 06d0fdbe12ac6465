"""GL104 per-layer-host-sync beyond ``.item()``: casts and truth tests of device lengths in per-layer
code are host reads; values the code shows to be on the host are not (the engine trees' own cases)."""
from __future__ import annotations

import pytest

from guardlint.lint import build_rules, check_source

from test_lint_prefilter import _same

RULES = build_rules()
HEAD = ("import torch.nn as nn\n\n\nclass VisionBlock(nn.Module):\n"
        "    def forward(self, x, cu_seqlens, seq_lens, seq_lens_cpu):\n")


def _gl104(body: str) -> list[tuple[int, str]]:
    source = HEAD + "".join(f"        {line}\n" for line in body.splitlines())
    result = check_source(source.encode(), "m.py", RULES, prefilter=True)
    _same(source.encode())  # the tree pre-filter keeps whatever the engine reports
    return [(f.line - 5, f.message.split(" inside ")[0].rsplit(": ", 1)[1]) for f in result.findings
            if f.code == "GL104"]


@pytest.mark.parametrize("read, what", [
    ("n = int(cu_seqlens[-1])", "int() of cu_seqlens"),
    ("ok = bool(seq_lens[0])", "bool() of seq_lens"),
    ("r = float(self.seg_lens[1:] - 1)", "float() of seg_lens"),
    ("if seq_lens:\n    pass", "if seq_lens (the truth of a tensor)"),
    ("if not cu_seqlens[0]:\n    pass", "if cu_seqlens (the truth of a tensor)"),
    ("if x is not None and cu_seqlens[-1] > 4:\n    pass", "if ... cu_seqlens ... (the truth of a tensor)"),
    ("while seq_lens[0] < 3:\n    pass", "while ... seq_lens ... (the truth of a tensor)"),
])
def test_per_layer_host_sync_casts_and_truth_tests_of_device_lengths(read, what):
    assert _gl104(read) == [(1, what)]


@pytest.mark.parametrize("read", [
    "n = int(seq_lens_cpu[0])",  # host-named
    "n = int(len(seq_lens))",
    "n = int(cu_seqlens.shape[0])",
    "n = int(cu_seqlens.size(0)) + int(seq_lens.numel())",
    "n = int(cu_seqlens.cpu()[-1])",  # treated as host once copied
    "if seq_lens is None:\n    pass",
    "if len(seq_lens) > 2:\n    pass",
    # sglang 0.5.10's VisionAscendAttention.forward: a device attribute, not the lengths' values
    "if seq_lens.is_npu:\n    seq_lens = seq_lens.to('cpu')",
    "n = int(max_seqlen)",  # a host int by the field's own convention
])
def test_per_layer_host_sync_leaves_host_values_alone(read):
    assert _gl104(read) == []


@pytest.mark.parametrize("read, what", [
    ("b = tuple(cu_seqlens.cpu().tolist())", ".cpu().tolist() on cu_seqlens"),
    ("b = cu_seqlens.detach().cpu().numpy().tolist()", ".detach().cpu().numpy().tolist() on cu_seqlens"),
    ("n = seq_lens.to('cpu').max().item()", ""),  # a reduction between copy and read: not followed (a limit)
    ("b = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device='cpu').tolist()", '.to("cpu").tolist() on cu_seqlens'),
    ("b = seq_lens_cpu.cpu().tolist()", ""),  # host data copied to the host: no sync
    ("b = cu_seqlens.contiguous().tolist()", ".tolist() on cu_seqlens"),  # no copy: as before
])
def test_per_layer_host_sync_a_read_of_a_host_copy_reads_the_device_tensor(read, what):
    # ``t.cpu().tolist()`` copies ``t`` to the host: a sync when t is device metadata, whatever the copy is.
    assert _gl104(read) == ([(1, what)] if what else [])


def test_per_layer_host_sync_int_of_item_is_reported_once_as_item():
    assert _gl104("n = int(seq_lens.max().item())") == [(1, ".item() on seq_lens")]


def test_per_layer_host_sync_truth_test_outside_per_layer_code_is_fine():
    source = b"def prepare(seq_lens):\n    if seq_lens[0] > 0:\n        return int(seq_lens[0])\n"
    assert check_source(source, "m.py", RULES).findings == []


def test_per_layer_host_sync_text_filter_sees_tests_written_over_lines():
    from guardlint.lint.patterns import PATTERNS

    spec = PATTERNS["GL104"]
    head = b"class XBlock:\n    def forward(self, seq_lens):\n"
    assert spec.may_match(head + b"        if (\n            seq_lens[0] > 0\n        ):\n            pass\n")
    assert spec.may_match(head + b"        if (\n            x\n            and seq_lens[0] > 0\n        ):\n")
    assert spec.may_match(head + b"        n = int(seq_lens[-1])\n")
    assert not spec.may_match(head + b"        if seq_lens is None:\n            pass\n")


def test_per_layer_host_sync_needle_pattern_finds_each_needle():
    from guardlint.lint.patterns import PATTERNS

    spec = PATTERNS["GL104"]
    for needle in spec.needles:
        assert spec.needle_pattern.search(b"x = " + needle + b"[0]\n")
    assert not spec.needle_pattern.search(b"seq_len = seg_len + seqlen_q + segment_lens\n")
