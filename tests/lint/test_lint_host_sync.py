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
    "if seq_lens is None:\n    pass",
    "if len(seq_lens) > 2:\n    pass",
    # sglang 0.5.10's VisionAscendAttention.forward: a device attribute, not the lengths' values
    "if seq_lens.is_npu:\n    pass",
    "n = int(max_seqlen)",  # a host int by the field's own convention
])
def test_per_layer_host_sync_leaves_host_values_alone(read):
    assert _gl104(read) == []


@pytest.mark.parametrize("read, what", [
    ("b = tuple(cu_seqlens.cpu().tolist())", ".cpu().tolist() on cu_seqlens"),
    ("b = cu_seqlens.detach().cpu().numpy().tolist()", ".detach().cpu().numpy().tolist() on cu_seqlens"),
    # a reduction between copy and read is not followed, but the copy is a sync of its own
    ("n = seq_lens.to('cpu').max().item()", '.to("cpu") on seq_lens'),
    ("b = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device='cpu').tolist()", '.to("cpu").tolist() on cu_seqlens'),
    ("b = seq_lens_cpu.cpu().tolist()", ""),  # host data copied to the host: no sync
    ("b = cu_seqlens.contiguous().tolist()", ".tolist() on cu_seqlens"),  # no copy: as before
])
def test_per_layer_host_sync_a_read_of_a_host_copy_reads_the_device_tensor(read, what):
    # ``t.cpu().tolist()`` copies ``t`` to the host: a sync when t is device metadata, whatever the copy is.
    assert _gl104(read) == ([(1, what)] if what else [])


@pytest.mark.parametrize("copy, what", [
    ("x = cu_seqlens.cpu()", ".cpu() on cu_seqlens"),
    ("return seq_lens.cpu()", ".cpu() on seq_lens"),
    ("x = torch.diff(cu_seqlens).to('cpu')", '.to("cpu") on cu_seqlens'),
    ("x = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device='cpu')", '.to("cpu") on cu_seqlens'),
    ("x = seq_lens.to(torch.device('cpu'), torch.int32)", '.to("cpu") on seq_lens'),
    ("x = seq_lens.detach().to('cpu', non_blocking=False)", '.to("cpu") on seq_lens'),
    ("n = int(cu_seqlens.cpu()[-1])", ".cpu() on cu_seqlens"),  # the copy, then a host int
    # the known inconsistency: the copy made in one statement and read in the next is the copy's sync
    ("x = cu_seqlens.cpu()\nbounds = x.tolist()", ".cpu() on cu_seqlens"),
    # sglang 0.5.10's VisionAscendAttention.forward: the NPU lengths copied back in every layer
    ("if seq_lens.is_npu:\n    seq_lens = seq_lens.to('cpu')", '.to("cpu") on seq_lens'),
])
def test_per_layer_host_sync_a_bare_copy_of_device_lengths_is_a_sync(copy, what):
    # ``t.cpu()`` waits for the device whether or not anything reads the copy.
    line = 2 if copy.startswith("if") else 1
    assert _gl104(copy) == [(line, what)]


@pytest.mark.parametrize("copy", [
    "x = cu_seqlens.to('cpu', non_blocking=True)",  # no wait: what reads it is the code's own business
    "x = cu_seqlens.to(device='cpu', non_blocking=True)\ny = x.tolist()",
    "x = seq_lens_cpu.cpu()",  # host data
    "x = torch.tensor([0, 3, 7]).cumsum(0).cpu()",  # made on the host from a Python list
    "x = cu_seqlens.to(torch.int32)",  # a dtype, not a device
    "x = cu_seqlens.to(x.device)",
    "x = cu_seqlens.numpy()",  # of a device tensor it raises: where it runs, the tensor is host data
])
def test_per_layer_host_sync_a_copy_that_does_not_wait_or_copies_host_data_is_silent(copy):
    assert _gl104(copy) == []


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
    # The known kernels' names are tested apart (``more_needles``); the pattern holds every other needle.
    assert spec.more_needles and set(spec.more_needles) <= set(spec.needles)
    for needle in spec.needles:
        text = b"x = " + needle + b"[0]\n"
        assert bool(spec.needle_pattern.search(text)) is (needle not in spec.more_needles)
    assert not spec.needle_pattern.search(b"seq_len = seg_len + seqlen_q + segment_lens\n")


# vLLM's CustomOp: ``forward`` runs ``self._forward_method``, which ``__init__`` picks among the platform methods.
CUSTOM_OP = ("import torch\nimport torch.nn as nn\n\n\n"
             "class CustomOp(nn.Module):\n"
             "    def __init__(self):\n        super().__init__()\n"
             "        self._forward_method = self.dispatch_forward()\n\n"
             "    def forward(self, *args, **kwargs):\n        return self._forward_method(*args, **kwargs)\n\n"
             "    def dispatch_forward(self):\n"
             "        return self.forward_oot if on_plugin() else self.maybe_compile(self.forward_native)\n\n\n")
PLATFORM = ("class {cls}({base}):\n"
            "    def {method}(self, q, cu_seqlens):\n"
            "        seq_lens_cpu = torch.diff(cu_seqlens).to('cpu')\n"
            "        return q\n")


@pytest.mark.parametrize("cls, base, method, reported", [
    ("EncoderAttention", "CustomOp", "forward_oot", True),
    ("EncoderAttention", "CustomOp", "forward_native", True),
    ("EncoderAttention310", "EncoderAttention", "forward_oot", True),  # a layer through its base
    ("EncoderAttention", "CustomOp", "forward_helper", False),  # not a method the forward runs
    ("RMSNorm", "CustomOp", "forward_oot", False),  # a CustomOp, not a layer
    ("PatchAttention", "nn.Module", "forward_oot", False),  # its forward (nn.Module's) dispatches nothing
])
def test_per_layer_host_sync_custom_op_dispatch_targets_run_per_layer(cls, base, method, reported):
    source = CUSTOM_OP + ("class EncoderAttention(CustomOp):\n    pass\n\n\n" if base == "EncoderAttention" else "") \
        + PLATFORM.format(cls=cls, base=base, method=method)
    found = [f.message for f in check_source(source.encode(), "m.py", RULES, prefilter=True).findings]
    _same(source.encode())
    assert found == ([f"host sync per layer: .to(\"cpu\") on cu_seqlens inside {cls}.{method}"] if reported else [])


def test_per_layer_host_sync_custom_op_of_the_pinned_vllm():
    """Where no source of vLLM is found, the catalog's pinned MMEncoderAttention (a CustomOp) decides."""
    source = ("import torch\nfrom vllm.model_executor.layers.attention import MMEncoderAttention\n\n\n"
              + PLATFORM.format(cls="AscendMMEncoderAttention310", base="MMEncoderAttention", method="forward_oot"))
    assert [f.line for f in check_source(source.encode(), "m.py", RULES, prefilter=True).findings] == [7]
    from guardlint.lint.patterns import PATTERNS

    assert PATTERNS["GL104"].may_match(source.encode())
