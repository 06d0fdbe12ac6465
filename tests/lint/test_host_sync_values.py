"""GL104 per-layer-host-sync by where values live (lint/values.py): a device value derived from metadata
is reported under its own name, a host value is not, whatever it is called; and the value model itself."""
from __future__ import annotations

import libcst as cst
import pytest

from guardlint.lint import build_rules, check_source
from guardlint.lint.values import DEVICE, HOST, UNKNOWN, Values, declared_value

from test_lint_prefilter import _same

RULES = build_rules()
HEAD = ("import torch\nimport torch.nn as nn\n\n\nclass PatchAttention(nn.Module):\n"
        "    def forward(self, hidden, q, k, v, cu_seqlens, lengths_list):\n")


def _gl104(body: str, head: str = HEAD) -> list[tuple[int, str]]:
    """GL104 findings of ``body`` put in ``head``'s forward: (line in the body from 1, what is read)."""
    source = head + "".join(f"        {line}\n" for line in body.splitlines())
    result = check_source(source.encode(), "m.py", RULES, prefilter=True)
    _same(source.encode())  # the tree pre-filter keeps whatever the engine reports
    from guardlint.lint.patterns import PATTERNS

    first = head.count("\n") + 1  # the line of the body's first statement
    found = [(f.line - first + 1, f.message.split(" inside ")[0].rsplit(": ", 1)[1]) for f in result.findings
             if f.code == "GL104"]
    if found:  # the textual pre-filter lets the file through
        assert PATTERNS["GL104"].may_match(source.encode())
    return found


# -- the examples ------------------------------------------------------------------------------
def test_host_sync_values_spans_tolist_is_reported_under_its_own_name():
    body = ("spans = cu_seqlens[1:] - cu_seqlens[:-1]  # a device tensor, whatever its name\n"
            "parts = [torch.split(t, spans.tolist(), 0) for t in (q, k, v)]\n")
    assert _gl104(body) == [(2, ".tolist() on spans (from cu_seqlens)")]


def test_host_sync_values_diff_max_int_is_reported():
    body = "w = torch.diff(cu_seqlens)\nm = w.max()\nn = int(m)\n"
    assert _gl104(body) == [(3, "int() of m (from cu_seqlens)")]


def test_host_sync_values_int_of_a_derived_max_is_reported():
    assert _gl104("w = torch.diff(cu_seqlens)\nn = int(w.max())\n") == [(2, "int(....max()) on w (from cu_seqlens)")]


def test_host_sync_values_metadata_name_built_on_the_host_is_not_reported():
    body = "cu_seqlens = torch.tensor(lengths_list).cumsum(0)\nbounds = cu_seqlens.tolist()\nn = int(cu_seqlens[-1])\n"
    assert _gl104(body) == []


def test_host_sync_values_host_copy_then_tolist():
    # The copy of device metadata is the sync: made in its own statement, it is reported there and a read of
    # it later is a read of host data; a read written on the copy (``t.cpu().tolist()``,
    # ``t.to('cpu').tolist()``) is reported once, as the read of what it copies.
    body = ("seq_lens = cu_seqlens.cpu()\nbounds = seq_lens.tolist()\n"
            "spans = cu_seqlens[1:] - cu_seqlens[:-1]\nsizes = spans.to('cpu').tolist()\n"
            "ends = cu_seqlens.cpu().tolist()\n")
    assert _gl104(body) == [(1, ".cpu() on cu_seqlens"), (4, '.to("cpu").tolist() on spans (from cu_seqlens)'),
                            (5, ".cpu().tolist() on cu_seqlens")]


def test_host_sync_values_a_bare_copy_of_a_derived_value_is_reported_under_its_own_name():
    body = ("spans = cu_seqlens[1:] - cu_seqlens[:-1]\nhost = spans.cpu()\n"
            "lens = torch.tensor(lengths_list)\nalso = lens.cpu()\n")  # a host tensor copied: no sync
    assert _gl104(body) == [(2, ".cpu() on spans (from cu_seqlens)")]


def test_host_sync_values_tuple_unpacking_keeps_the_device():
    body = "a, b = cu_seqlens[:-1], cu_seqlens[1:]\nsizes = (b - a).tolist()\n"
    assert _gl104(body) == [(2, ".tolist() on b (from cu_seqlens)")]


def test_host_sync_values_a_branch_on_the_device_is_reported():
    body = ("if self.training:\n"
            "    lens = torch.tensor(lengths_list)\n"
            "else:\n"
            "    lens = cu_seqlens[1:] - cu_seqlens[:-1]\n"
            "sizes = lens.tolist()  # may be device\n")
    assert _gl104(body) == [(5, ".tolist() on lens (from cu_seqlens)")]


def test_host_sync_values_both_branches_on_the_host_are_not_reported():
    body = ("if self.training:\n"
            "    cu_seqlens = torch.tensor(lengths_list).cumsum(0)\n"
            "else:\n"
            "    cu_seqlens = torch.zeros(4, dtype=torch.int32)\n"
            "sizes = cu_seqlens.tolist()\n")
    assert _gl104(body) == []


def test_host_sync_values_loop_carried_value_is_reported():
    head = ("import torch\nimport torch.nn as nn\n\n\nclass VisionModel(nn.Module):\n"
            "    def forward(self, hidden, cu_seqlens, lengths_list):\n")
    body = ("lens = None\n"
            "for blk in self.blocks:\n"
            "    if lens is not None:\n"
            "        hidden = blk(hidden, lens.tolist())\n"
            "    lens = cu_seqlens[1:] - cu_seqlens[:-1]\n")
    assert _gl104(body, head) == [(4, ".tolist() on lens (from cu_seqlens)")]


def test_host_sync_values_comprehension_targets_hold_elements():
    body = ("spans = cu_seqlens[1:] - cu_seqlens[:-1]\n"
            "sizes = [int(s) for s in spans]  # each is a 0-d device tensor\n"
            "bounds = [int(b) for b in cu_seqlens.cpu()]\n")  # the copy is the sync, not each int()
    assert _gl104(body) == [(2, "int() of s (from cu_seqlens)"), (3, ".cpu() on cu_seqlens")]


def test_host_sync_values_truth_test_of_a_derived_value():
    body = ("spans = cu_seqlens[1:] - cu_seqlens[:-1]\n"
            "if spans[0] > 0:\n    pass\n"
            "if spans.max() > 4096:\n    pass\n"
            "if torch.tensor(lengths_list).max() > 4096:\n    pass\n")
    assert _gl104(body) == [(2, "if ... spans (from cu_seqlens) ... (the truth of a tensor)"),
                            (4, "if ... spans (from cu_seqlens) ... (the truth of a tensor)")]


def test_host_sync_values_any_of_a_host_comparison_is_not_reported():
    body = ("if (torch.tensor(lengths_list) > 0).any():\n    pass\n"
            "if (cu_seqlens > 0).any():\n    pass\n")
    assert _gl104(body) == [(3, "if (...).any() (the truth of a tensor)")]


def test_host_sync_values_declared_host_lengths_are_not_reported():
    head = ("import torch.nn as nn\n\n\nclass FluxBlock(nn.Module):\n"
            "    def forward(self, x, seq_lens: list[int] | None = None, cu_seqlens=None):\n")
    body = ("total = sum(seq_lens)\n"
            "if total != x.shape[0]:\n    pass\n"
            "bounds = [int(n) for n in seq_lens]\n"
            "lens = cu_seqlens[1:]\n"
            "if sum(lens) > 0:\n    pass\n")
    assert _gl104(body, head) == [(6, "if ... lens (from cu_seqlens) ... (the truth of a tensor)")]


def test_host_sync_values_a_declared_list_the_code_subtracts_is_no_list():
    # keye's vision attention (aphrodite 0.24): annotated as a list, subtracted as a tensor, which a list cannot be
    head = ("import torch.nn as nn\n\n\nclass SiglipAttention(nn.Module):\n"
            "    def forward(self, x, cu_seqlens: list | None = None, seq_lens: list[int] | None = None):\n")
    body = ("max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max()\n"
            "longest = int(max_seqlen)\n"
            "total = sum(seq_lens) + len(seq_lens)\n"
            "bound = int(max(seq_lens))\n")
    assert _gl104(body, head) == [(2, "int() of max_seqlen (from cu_seqlens)")]
    # a declared list made into a tensor first, then subtracted: the tensor is the list's, on the host
    body = ("cu_seqlens = torch.tensor(cu_seqlens)\n"
            "spans = cu_seqlens[1:] - cu_seqlens[:-1]\n"
            "bound = int(spans.max())\n")
    assert _gl104(body, head.replace("import torch.nn", "import torch\nimport torch.nn")) == []


def test_host_sync_values_fallback_branch_values_are_left_to_gl109():
    """After ``if forward_metadata is not None: ... else: ...`` values are the prepared branch's: the
    fallback runs for callers that pass no metadata, and those are reported (GL109)."""
    body = ("if forward_metadata is not None:\n"
            "    lens = forward_metadata.cu_seqlens.to('cpu')\n"
            "else:\n"
            "    lens = cu_seqlens[1:]\n"
            "sizes = lens.tolist()\n")
    head = HEAD.replace("lengths_list)", "lengths_list, forward_metadata=None)")
    assert _gl104(body, head) == []
    assert _gl104(body.replace(".to('cpu')", ""), head) == [(5, ".tolist() on lens (from cu_seqlens)")]


def test_host_sync_values_unknown_values_fall_back_to_names():
    body = ("cu_seqlens = self.make(hidden)\nbounds = cu_seqlens.tolist()\n"
            "sizes = self.other(hidden)\nn = sizes.tolist()\n")
    assert _gl104(body) == [(2, ".tolist() on cu_seqlens")]


def test_host_sync_values_helper_reads_a_derived_value():
    source = ("import torch\nimport torch.nn as nn\n\n\n"
              "def spans_of(cu_seqlens):\n"
              "    spans = cu_seqlens[1:] - cu_seqlens[:-1]\n"
              "    return spans.tolist()\n\n\n"
              "def host_spans(lengths_list):\n"
              "    cu_seqlens = torch.tensor(lengths_list).cumsum(0)\n"
              "    return (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()\n\n\n"
              "class PatchBlock(nn.Module):\n"
              "    def forward(self, x, cu_seqlens, lengths_list):\n"
              "        a = spans_of(cu_seqlens)\n"
              "        b = host_spans(lengths_list)\n"
              "        return x\n")
    result = check_source(source.encode(), "m.py", RULES, prefilter=True)
    _same(source.encode())
    assert [(f.line, f.message.split(": ", 1)[1].split(" inside ")[0]) for f in result.findings if f.code == "GL104"] \
        == [(17, "spans_of(...), which reads .tolist() on spans (from cu_seqlens)")]


def test_host_sync_values_chunked_check_finds_what_the_whole_file_check_finds(monkeypatch):
    from guardlint.lint import chunks
    from guardlint.lint.engine import _pattern_visitor
    from guardlint.lint.runner import lint_source

    helper = ("def spans_of(cu_seqlens):\n"
              "    spans = cu_seqlens[1:] - cu_seqlens[:-1]\n"
              "    return spans.tolist()\n\n\n")
    block = ("class Patch{i}Block(nn.Module):\n"
             "    def forward(self, x, cu_seqlens):\n"
             "        n = spans_of(cu_seqlens)\n"
             "        w = torch.diff(cu_seqlens)\n"
             "        return x[: int(w.max())]\n\n\n")
    source = "import torch\nimport torch.nn as nn\n\n\n" + helper + "".join(block.format(i=i) for i in range(6))
    monkeypatch.setattr(chunks, "MIN_BYTES", 1 << 40)
    whole = lint_source(source, "gen.py")
    monkeypatch.setattr(chunks, "MIN_BYTES", 0)
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 200)
    assert len(chunks._starts(source)) >= 3
    assert chunks.check(source.encode(), "gen.py", RULES, False, None, False, True, _pattern_visitor) is not None
    chunked = lint_source(source, "gen.py")
    assert chunked == whole
    reads = sorted(f.message.split(": ", 1)[1].split(" inside ")[0] for f in whole if f.code == "GL104")
    assert reads == ["int(....max()) on w (from cu_seqlens)"] * 6 \
        + ["spans_of(...), which reads .tolist() on spans (from cu_seqlens)"] * 6


def test_host_sync_values_text_filter_passes_derived_reads_only_where_metadata_is_named():
    from guardlint.lint.patterns import PATTERNS

    spec = PATTERNS["GL104"]
    head = b"class XBlock:\n    def forward(self, x, seq_lens):\n        spans = seq_lens[1:]\n\n\n\n\n"
    assert spec.may_match(head + b"        return spans.tolist()\n")
    assert spec.may_match(head + b"        return int(spans)\n")
    assert spec.may_match(head + b"        if spans[0]:\n            pass\n")
    # In a loop over layers of a function that is not per layer itself: read by read.
    loop = (b"class Model:\n    def forward(self, x, seq_lens):\n        spans = seq_lens[1:]\n\n\n\n\n"
            b"        for blk in self.blocks:\n            x = blk(x)\n")
    assert spec.may_match(loop + b"            if spans[0]:\n                pass\n")
    assert spec.may_match(loop + b"            n = int(spans)\n")
    assert not spec.may_match(loop + b"            if spans is None:\n                pass\n")
    # The read in a function that names no metadata, or outside per-layer code: nothing to follow.
    other = b"class XBlock:\n    def forward(self, x, seq_lens):\n        pass\n\n    def g(self, spans):\n"
    assert not spec.may_match(other + b"        return spans.tolist()\n")
    assert not spec.may_match(b"def prepare(seq_lens):\n    spans = seq_lens[1:]\n\n\n\n\n    return spans.tolist()\n"
                              b"class XBlock:\n    def forward(self, x):\n        return x\n")


@pytest.mark.parametrize("body, kept", [
    ("spans = cu_seqlens[1:]\nw = spans.max()\nreturn int(w)\n", True),
    ("spans = self.pad(cu_seqlens)\nreturn int(spans)\n", False),  # an unknown call derives nothing
    ("total = sum(seq_lens)\nif total != x.shape[0]:\n    return int(total)\nreturn x\n", False),
    ("seq_lens = seq_lens_dev\ntotal = sum(seq_lens)\nreturn int(total)\n", True),  # bound again
    ("spans = self.seq_lens[1:]\nreturn int(spans)\n", True),  # the attribute, not the parameter
    ("flag = (x > 0).any()\nif torch.isinf(x).any():\n    pass\nreturn x\n", False),
    ("if (x > 0).any():\n    pass\nreturn x\n", True),
    ("if spans is None:\n    spans = cu_seqlens[1:]\nreturn x\n", False),
])
def test_host_sync_values_tree_filter_follows_derivations(body, kept):
    """The tree pre-filter sends a file to libcst for a read of a value that may derive from metadata,
    through the operations the value model follows, and not for one that cannot."""
    import ast

    from guardlint.lint.prefilter import tree_filter

    head = ("import torch\nimport torch.nn as nn\n\n\nclass FluxBlock(nn.Module):\n"
            "    def forward(self, x, seq_lens: list[int], cu_seqlens, seq_lens_dev):\n")
    source = (head + "".join(f"        {line}\n" for line in body.splitlines())).encode()
    assert tree_filter(RULES).may_report(ast.parse(source), source) is kept
    _same(source)
    if kept and "int(" in body:  # the visitor reports what the filter keeps for it
        assert [f for f in check_source(source, "m.py", RULES).findings if f.code == "GL104"]


# -- the value model -----------------------------------------------------------------------------------
def _probes(source: str, assume=None) -> list:
    """The values of the arguments of ``probe(...)`` calls in the first function of ``source``, in order."""
    module = cst.parse_module(source)
    func = next(s for s in module.body if isinstance(s, cst.FunctionDef))
    values = Values(func, assume)
    found: list = []

    class Probes(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if isinstance(node.func, cst.Name) and node.func.value == "probe":
                found.append(values.of(node.args[0].value))

    func.visit(Probes())
    return found


def _where(source: str) -> list:
    return [(v.where, v.source) for v in _probes(source)]


def test_values_seeds_metadata_parameters_and_attributes_on_the_device():
    assert _where("def f(self, cu_seqlens, seq_lens_cpu, x):\n"
                  "    probe(cu_seqlens)\n    probe(seq_lens_cpu)\n    probe(x)\n"
                  "    probe(self.seg_lens)\n    probe(meta.cu_seqlens_q)\n    probe(self.proj)\n") == [
        (DEVICE, "cu_seqlens"), (UNKNOWN, None), (UNKNOWN, None), (DEVICE, "seg_lens"), (DEVICE, "cu_seqlens_q"),
        (UNKNOWN, None)]


def test_values_device_stays_device_through_tensor_math():
    assert _where("def f(cu_seqlens):\n"
                  "    probe(cu_seqlens[1:] - cu_seqlens[:-1])\n"
                  "    probe(-cu_seqlens[0])\n"
                  "    probe(cu_seqlens > 0)\n"
                  "    probe(torch.diff(cu_seqlens).max())\n"
                  "    probe(cu_seqlens.cumsum(0).to(torch.int32).contiguous())\n"
                  "    probe(torch.cat([cu_seqlens, cu_seqlens]))\n"
                  "    probe(max(cu_seqlens))\n") == [(DEVICE, "cu_seqlens")] * 7


@pytest.mark.parametrize("expr", [
    "cu_seqlens.cpu()", "cu_seqlens.tolist()", "cu_seqlens.item()", "cu_seqlens.numpy()", "int(cu_seqlens[0])",
    "len(cu_seqlens)", "list(range(3))", "cu_seqlens.shape[0]", "cu_seqlens.size(0)", "cu_seqlens.numel()",
    "cu_seqlens.to('cpu')", "cu_seqlens.to(device='cpu')", "cu_seqlens.to(torch.device('cpu'))",
    "torch.tensor(lengths)", "torch.as_tensor([1, 2])", "torch.arange(4)", "torch.zeros(3, device='cpu')",
    "torch.tensor(lengths).cumsum(0)", "np.cumsum(lengths)", "[1, 2]", "(3, 4)", "{'a': 1}", "'text'", "None",
    "x is None", "not cu_seqlens", "torch.zeros(3, device=torch.tensor(lengths).device)", "f'{cu_seqlens}'",
])
def test_values_host_results(expr):
    assert _where(f"def f(cu_seqlens, lengths):\n    probe({expr})\n") == [(HOST, None)]


@pytest.mark.parametrize("expr, source", [
    ("torch.tensor(lengths).cuda()", None), ("torch.tensor(lengths).to('cuda')", None),
    ("torch.tensor(lengths).to(device)", None), ("torch.tensor(lengths).to(device=dev)", None),
    ("torch.zeros(3, device='cuda:0')", None), ("torch.arange(4, device=cu_seqlens.device)", None),
    ("torch.tensor(lengths, device=x.device)", None), ("cu_seqlens.new_zeros(3)", None),
    ("torch.as_tensor(cu_seqlens)", "cu_seqlens"), ("cu_seqlens.to(x_dev.device)", "cu_seqlens"),
])
def test_values_device_results(expr, source):
    assert _where(f"def f(cu_seqlens, lengths, x):\n    probe({expr})\n") == [(DEVICE, source)]


def test_values_unknown_calls_are_unknown_unless_named_like_metadata():
    assert _where("def f(x):\n    a = self.make(x)\n    seq_lens = self.make(x)\n    probe(a)\n"
                  "    probe(seq_lens)\n    probe(a.max())\n") == [(UNKNOWN, None), (DEVICE, "seq_lens"),
                                                                   (UNKNOWN, None)]


def test_values_branches_merge_by_union():
    src = ("def f(c, cu_seqlens, lengths):\n"
           "    if c:\n        x = torch.tensor(lengths)\n    elif c > 1:\n        x = cu_seqlens[1:]\n"
           "    else:\n        x = self.g()\n"
           "    probe(x)\n"
           "    try:\n        y = cu_seqlens.cpu()\n    except ValueError:\n        y = cu_seqlens\n"
           "    probe(y)\n")
    assert _where(src) == [(DEVICE | HOST | UNKNOWN, "cu_seqlens"), (DEVICE | HOST, "cu_seqlens")]


def test_values_paths_that_end_do_not_merge():
    src = ("def f(c, cu_seqlens):\n"
           "    x = cu_seqlens\n"
           "    if c:\n        x = cu_seqlens.cpu()\n        return x\n"
           "    probe(x)\n")
    assert _where(src) == [(DEVICE, "cu_seqlens")]


def test_values_assume_takes_one_branch():
    src = ("def f(meta, cu_seqlens):\n"
           "    if meta:\n        x = cu_seqlens.cpu()\n    else:\n        x = cu_seqlens\n"
           "    probe(x)\n")
    assert [(v.where, v.source) for v in _probes(src, lambda test: True)] == [(HOST, None)]
    assert [(v.where, v.source) for v in _probes(src, lambda test: False)] == [(DEVICE, "cu_seqlens")]
    assert [(v.where, v.source) for v in _probes(src)] == [(DEVICE | HOST, "cu_seqlens")]
    # An assumed branch that returns: the code below runs only when the assumption fails.
    ends = "def f(meta, cu_seqlens):\n    if meta:\n        return cu_seqlens.cpu()\n    x = cu_seqlens\n    probe(x)\n"
    assert [(v.where, v.source) for v in _probes(ends, lambda test: True)] == [(DEVICE, "cu_seqlens")]


def test_values_loops_reach_a_fixed_point():
    src = ("def f(cu_seqlens, blocks):\n"
           "    x = 0\n"
           "    y = 0\n"
           "    for blk in blocks:\n"
           "        probe(x)\n"
           "        y = x\n"
           "        x = cu_seqlens[1:]\n"
           "    probe(y)\n"
           "    i = 0\n"
           "    while i < 3:\n"
           "        if i:\n            z = cu_seqlens\n            break\n"
           "        z = 1\n"
           "    probe(z)\n")
    assert _where(src) == [(DEVICE | HOST, "cu_seqlens"), (DEVICE | HOST, "cu_seqlens"), (DEVICE | HOST, "cu_seqlens")]


def test_values_unpacking_and_iteration():
    src = ("def f(cu_seqlens, lengths):\n"
           "    a, (b, c) = cu_seqlens[0], (lengths, cu_seqlens[1:])\n"
           "    probe(a)\n    probe(b)\n    probe(c)\n"
           "    first, *rest = cu_seqlens.tolist()\n"
           "    probe(first)\n    probe(rest)\n"
           "    for i, (lo, hi) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):\n"
           "        probe(i)\n        probe(hi - lo)\n"
           "    for n in cu_seqlens.tolist():\n        probe(n)\n"
           "    pair = (cu_seqlens, 1)\n    probe(pair)\n    probe(pair[0])\n")
    assert _where(src) == [(DEVICE, "cu_seqlens"), (UNKNOWN, None), (DEVICE, "cu_seqlens"), (HOST, None),
                           (HOST, None), (HOST, None), (DEVICE, "cu_seqlens"), (HOST, None), (HOST, None),
                           (DEVICE | HOST, "cu_seqlens")]


def test_values_comprehension_targets_stay_in_their_comprehension():
    src = ("def f(cu_seqlens):\n"
           "    s = 1\n"
           "    sizes = [s + 1 for s in cu_seqlens if probe(s)]\n"
           "    probe(s)\n"
           "    probe(sizes)\n"
           "    probe(sizes[0])\n")
    values = _probes(src)
    assert [(v.where, v.source) for v in values[:3]] == [(DEVICE, "cu_seqlens"), (HOST, None), (HOST, None)]
    assert (values[3].where, values[3].source) == (DEVICE, "cu_seqlens")  # a list of device tensors


def test_values_tracked_attributes_and_rebinding():
    src = ("def f(self, cu_seqlens, lengths):\n"
           "    self.cu_seqlens = torch.tensor(lengths)\n"
           "    probe(self.cu_seqlens)\n"
           "    self.spans = cu_seqlens[1:]\n"
           "    probe(self.spans)\n"
           "    self = other\n"
           "    probe(self.cu_seqlens)\n"
           "    cu_seqlens = cu_seqlens.cpu()\n"
           "    cu_seqlens += 1\n"
           "    probe(cu_seqlens)\n")
    assert _where(src) == [(HOST, None), (DEVICE, "cu_seqlens"), (DEVICE, "cu_seqlens"), (HOST, None)]


def test_values_nested_functions_and_lambdas_are_their_own():
    src = ("def f(cu_seqlens):\n"
           "    x = cu_seqlens.cpu()\n"
           "    def g():\n        return x\n"
           "    h = lambda: x\n"
           "    probe(g)\n    probe(h)\n    probe(x)\n")
    module = cst.parse_module(src)
    func = module.body[0]
    values = Values(func)
    inner = func.body.body[1].body.body[0].body[0].value  # the ``x`` returned by g
    assert values.at(inner) is None
    assert _where(src) == [(UNKNOWN, None), (UNKNOWN, None), (HOST, None)]


def test_values_walrus_with_and_del():
    src = ("def f(cu_seqlens):\n"
           "    if (n := cu_seqlens.max()) > 0:\n        pass\n"
           "    probe(n)\n"
           "    with open('x') as fh:\n        probe(fh)\n"
           "    del n\n"
           "    probe(n)\n")
    assert _where(src) == [(DEVICE, "cu_seqlens"), (UNKNOWN, None), (UNKNOWN, None)]


@pytest.mark.parametrize("annotation, where", [
    ("list[int]", HOST), ("Optional[List[int]]", HOST), ("list[int] | None", HOST), ("tuple[int, ...]", HOST),
    ("np.ndarray", HOST), ("int", HOST), ("torch.Tensor", None), ("torch.Tensor | None", None),
    ("Union[int, torch.Tensor]", HOST | UNKNOWN), ("torch.Tensor | Sequence[int]", HOST | UNKNOWN),
    ("Optional[Union[torch.Tensor, list[int]]]", HOST | UNKNOWN),
])
def test_values_declared_types_of_host_data(annotation, where):
    """A type that admits host data besides None (``int | torch.Tensor``) is not shown to be on the device,
    whatever the name: the callers may pass either."""
    got = declared_value(cst.parse_expression(annotation))
    assert (got.where if got is not None else None) == where
    source = f"def f(seq_lens: {annotation}):\n    probe(seq_lens)\n"
    expected = {HOST: (HOST, None), None: (DEVICE, "seq_lens"), HOST | UNKNOWN: (HOST | UNKNOWN, None)}[where]
    assert _where(source) == [expected]


def test_values_elements_of_a_declared_list_of_tensors_are_unknown():
    assert _where("def f(seq_lens: list[torch.Tensor]):\n    probe(seq_lens)\n    probe(seq_lens[0])\n") == [
        (HOST, None), (UNKNOWN, None)]
