"""GL104 through callees: a per-layer call of a function of the scanned tree that reads on the host the
parameter it is handed a device value derived from metadata is a per-layer host read, reported at the call
with the path to the read (``summaries.py``); host values, unresolved callees and reads a passed argument
spares are not."""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from guardlint.lint import runner, summaries
from guardlint.lint.config import Settings
from guardlint.lint.runner import lint_paths

BLOCK = """\
    import torch
    import torch.nn as nn
    {imports}


    class VisionBlock(nn.Module):
        def forward(self, x, cu_seqlens):
    {body}
            return x
    """


def _tree(root: Path, files: dict) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _block(body: str, imports: str = "", helpers: str = "") -> str:
    body = textwrap.indent(textwrap.dedent(body), " " * 8)
    return textwrap.dedent(BLOCK).format(imports=imports, body=body) + textwrap.dedent(helpers)


def _gl104(root: Path, **options) -> list:
    """(file relative to ``root``, line, message, note) of each GL104 finding of a run over ``root``."""
    report = lint_paths([str(root)], Settings(root=root), **options)
    return [(Path(f.path).relative_to(root).as_posix(), f.line, f.message, f.note) for f in report.findings
            if f.code == "GL104"]


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(textwrap.dedent(text).splitlines(), 1) if needle in line)


# A block of mylib/ that calls longest() with its offsets.
CALLER = _block("n = longest(cu_seqlens)", imports="from mylib.seq import longest")


@pytest.fixture()
def package(tmp_path):
    """mylib/ with a helper module: longest() reads its argument with .item() (line 3)."""
    return _tree(tmp_path, {
        "mylib/__init__.py": "",
        "mylib/seq.py": """\
            def longest(cu):
                lengths = cu[1:] - cu[:-1]
                return lengths.max().item()


            def spans(cu):
                return (cu[1:] - cu[:-1]).tolist()
            """,
    })


# -- the three shapes of issue 27 ------------------------------------------------------------------------
def test_callee_summaries_same_class_helper_method(tmp_path):
    model = _block("spans = self._spans(cu_seqlens)", helpers="""\

        class Other:
            pass
        """)
    model = model.replace("    def forward", "    def _spans(self, cu):\n        return cu.tolist()\n\n    def forward")
    _tree(tmp_path, {"model.py": model})
    ((path, line, message, note),) = _gl104(tmp_path)
    assert (path, line) == ("model.py", _line(model, "self._spans(cu_seqlens)"))
    assert "self._spans(...) reads cu_seqlens with .tolist()" in message and "inside VisionBlock.forward" in message
    assert f"`VisionBlock._spans()` in {tmp_path / 'model.py'}:{_line(model, 'return cu.tolist()')}" in note


def test_callee_summaries_a_helper_that_reads_a_host_copy(tmp_path):
    # A helper of the block builds a key from ``cu.cpu().tolist()``: the copy is the sync, per layer.
    model = _block("mask = self._mask(cu_seqlens)")
    helper = ("    def _mask(self, cu):\n        if cu is None:\n            return None\n"
              "        return tuple(cu.cpu().tolist())\n\n    def forward")
    model = model.replace("    def forward", helper)
    _tree(tmp_path, {"model.py": model})
    ((_, line, message, note),) = _gl104(tmp_path)
    assert line == _line(model, "self._mask(cu_seqlens)") and "self._mask(...) reads cu_seqlens" in message
    assert "(.cpu().tolist())" in note


def test_callee_summaries_a_helper_that_copies_host_data_is_silent(tmp_path):
    model = _block("mask = self._mask(cu_seqlens.tolist())")
    model = model.replace("    def forward", "    def _mask(self, cu):\n        return tuple(cu.cpu().tolist())\n\n"
                          "    def forward")
    _tree(tmp_path, {"model.py": model})
    assert [f for f in _gl104(tmp_path) if "_mask" in f[2]] == []


def test_callee_summaries_module_function_of_the_same_file(tmp_path):
    model = _block("n = longest(cu_seqlens)", helpers="""\


        def longest(cu):
            return int((cu[1:] - cu[:-1]).max())
        """)
    _tree(tmp_path, {"model.py": model})
    ((_, line, message, note),) = _gl104(tmp_path)
    assert line == _line(model, "n = longest(") and "longest(...) reads cu_seqlens with int()" in message
    assert f"`longest()` in {tmp_path / 'model.py'}:{_line(model, 'return int(')}" in note  # the read's line


@pytest.mark.parametrize("imports, call", [
    ("from mylib.seq import longest", "longest(cu_seqlens)"),
    ("from .seq import longest", "longest(cu_seqlens)"),
    ("import mylib.seq as seq", "seq.longest(cu_seqlens)"),
    ("from mylib import seq", "seq.longest(cu_seqlens)"),
    ("import mylib.seq", "mylib.seq.longest(cu_seqlens)"),
])
def test_callee_summaries_cross_module_through_imports(package, imports, call):
    model = _block(f"n = {call}", imports=imports)
    _tree(package, {"mylib/model.py": model})
    ((path, line, message, note),) = _gl104(package)
    assert (path, line) == ("mylib/model.py", _line(model, call))
    assert f"{call.split('(')[0]}(...) reads cu_seqlens with .item() via `longest()`" in message
    seq = package / "mylib" / "seq.py"
    assert note.startswith(f"longest() reads its cu on the host (.item()): `longest()` in {seq}:3")


def test_callee_summaries_src_layout_and_a_reexport(tmp_path):
    _tree(tmp_path, {
        "src/mylib/__init__.py": "from .ops import longest\n",
        "src/mylib/ops.py": "def longest(cu):\n    return cu.max().item()\n",
        "src/mylib/model.py": _block("n = longest(cu_seqlens)", imports="from mylib import longest"),
    })
    ((path, _, message, _),) = _gl104(tmp_path)
    assert path == "src/mylib/model.py" and "via `longest()` in" in message


def test_callee_summaries_device_max_handed_to_a_wrapper(tmp_path):
    """A layer passes a device max to a wrapper that calls .item() on it, two modules and two calls away."""
    model = _block("""\
        max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
        x = flash_wrapper(x, x, x, cu_seqlens, max_seqlen)
        """, imports="from attn.wrap import flash_wrapper")
    _tree(tmp_path, {
        "attn/__init__.py": "",
        "attn/wrap.py": "from attn.impl import launch\n\n\ndef flash_wrapper(q, k, v, cu_seqlens, max_seqlen):\n"
                        "    return launch(q, cu_seqlens, max_len=max_seqlen)\n",
        "attn/impl.py": "def launch(q, cu, *, max_len):\n    grid = (max_len.item(), q.shape[1])\n    return q\n",
        "attn/model.py": model,
    })
    ((_, line, message, note),) = _gl104(tmp_path)
    assert line == _line(model, "flash_wrapper(")
    assert message.startswith("host sync per layer: flash_wrapper(...) reads max_seqlen (from cu_seqlens) with .item()")
    # each step where it happens: the wrapper's call of launch(), launch()'s .item()
    assert note == (f"flash_wrapper() reads its max_seqlen on the host (.item()): `flash_wrapper()` in "
                    f"{tmp_path / 'attn' / 'wrap.py'}:5 -> `launch()` in {tmp_path / 'attn' / 'impl.py'}:2.\n"
                    "host sync in a per-layer forward: read the lengths once per model forward.")


def test_callee_summaries_inherited_helper_of_a_base_class_in_another_module(tmp_path):
    _tree(tmp_path, {
        "vit/__init__.py": "",
        "vit/base.py": "class BlockBase:\n    def _lengths(self, cu):\n        return (cu[1:] - cu[:-1]).tolist()\n",
        "vit/model.py": _block("lengths = self._lengths(cu_seqlens)", imports="from vit.base import BlockBase")
        .replace("class VisionBlock(nn.Module)", "class VisionBlock(BlockBase)"),
    })
    ((_, _, message, _),) = _gl104(tmp_path)
    assert message.startswith("host sync per layer: self._lengths(...) reads cu_seqlens with .tolist() via "
                              "`_lengths()`")


# -- what is not reported ------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [
    "n = longest(cu_seqlens.to('cpu', non_blocking=True))",  # copied without a wait: no sync here
    "n = longest([0, 3, 7])",  # a Python list
    "host = torch.tensor([0, 3, 7]).cumsum(0)\nn = longest(host)",  # made on the host from a host list
    "n = longest(cu_seqlens_cpu)",  # named as the host copy (sglang's convention)
    "n = longest(x)",  # not metadata
    "n = longest(len(cu_seqlens))",
])
def test_callee_summaries_host_arguments_are_not_reads(package, body):
    _tree(package, {"mylib/model.py": _block(body, imports="from mylib.seq import longest")
                    .replace("def forward(self, x, cu_seqlens)", "def forward(self, x, cu_seqlens, cu_seqlens_cpu)")})
    assert _gl104(package) == []


@pytest.mark.parametrize("call, copy", [
    ("n = longest(cu_seqlens.cpu())", ".cpu()"), ("n = longest(cu_seqlens.to('cpu'))", '.to("cpu")')])
def test_callee_summaries_a_host_copy_handed_over_is_the_caller_s_sync(package, call, copy):
    """The copy waits for the device in the layer; the helper then reads host data (no read through it)."""
    _tree(package, {"mylib/model.py": _block(call, imports="from mylib.seq import longest")})
    assert [message for _, _, message, _ in _gl104(package)] == [
        f"host sync per layer: {copy} on cu_seqlens inside VisionBlock.forward"]


def test_callee_summaries_a_parameter_declared_to_take_host_data_is_not_a_device_value(package):
    """``cu_seqlens: torch.Tensor | Sequence[int]``: the callers may pass a host list (lmdeploy's MoonViT
    encoder does), so nothing shows the value on the device and the call is not a read; the same layer
    declared ``torch.Tensor`` (or nothing) still is."""
    both = _block("n = longest(cu_seqlens)", imports="from mylib.seq import longest\nfrom typing import Sequence")
    _tree(package, {"mylib/model.py": both.replace("def forward(self, x, cu_seqlens)",
                                                   "def forward(self, x, cu_seqlens: torch.Tensor | Sequence[int])")})
    assert _gl104(package) == []
    _tree(package, {"mylib/model.py": both.replace("def forward(self, x, cu_seqlens)",
                                                   "def forward(self, x, cu_seqlens: Union[torch.Tensor, list])")
                    .replace("from typing import Sequence", "from typing import Union")})
    assert _gl104(package) == []
    _tree(package, {"mylib/model.py": both.replace("def forward(self, x, cu_seqlens)",
                                                   "def forward(self, x, cu_seqlens: Optional[torch.Tensor])")})
    assert len(_gl104(package)) == 1


def test_callee_summaries_a_read_once_per_loop_is_not_per_layer(package):
    """Under ``if i == k:`` in ``for i, layer in enumerate(self.layers)`` the call runs once per forward
    (sglang's MiniCPM-V ``vit_merger`` after one layer); its ``else`` branch runs per layer."""
    model = """\
        import torch.nn as nn
        from mylib.seq import longest


        class Encoder(nn.Module):
            def forward(self, x, cu_seqlens):
                for i, layer in enumerate(self.layers):
                    x = layer(x, cu_seqlens)
                    if i == self.insert_layer_id:
                        n = longest(cu_seqlens)
                    else:
                        m = longest(cu_seqlens)
                for j in range(len(self.blocks)):
                    if self.k == j and x is not None:
                        n = longest(cu_seqlens)
                return x
        """
    _tree(package, {"mylib/model.py": model})
    assert [line for _, line, _, _ in _gl104(package)] == [_line(model, "m = longest(")]


def test_callee_summaries_outside_per_layer_code_is_silent(package):
    _tree(package, {"mylib/model.py": "from mylib.seq import longest\n\n\ndef prepare(cu_seqlens):\n"
                                      "    return longest(cu_seqlens)\n"})
    assert _gl104(package) == []


@pytest.mark.parametrize("imports, body", [
    ("from elsewhere import longest", "n = longest(cu_seqlens)"),  # a module not in the tree
    ("", "n = longest(cu_seqlens)"),  # a name nothing binds: no guessing from mylib/seq.py's def
    ("from mylib.seq import longest", "longest = make()\nn = longest(cu_seqlens)"),  # bound again in the def
    ("from mylib.seq import longest", "n = self.longest(cu_seqlens)"),  # no such method in the class
    ("from mylib import seq", "n = seq.missing(cu_seqlens)"),
])
def test_callee_summaries_unresolved_callee_is_silent(package, imports, body):
    _tree(package, {"mylib/model.py": _block(body, imports=imports)})
    assert _gl104(package) == []


def test_callee_summaries_recursion_terminates(tmp_path):
    model = _block("n = walk(cu_seqlens, 3)", helpers="""\


        def walk(cu, depth):
            if depth:
                return hop(cu, depth - 1)
            return walk(cu, depth)


        def hop(cu, depth):
            if depth > 1:
                return walk(cu[1:], depth)
            return cu[-1].item()
        """)
    _tree(tmp_path, {"model.py": model})
    ((_, _, message, note),) = _gl104(tmp_path)
    assert "walk(...) reads cu_seqlens with .item() via `hop()`" in message
    assert "`walk()` in" in note and "-> `hop()` in" in note


def test_callee_summaries_forwarded_keywords_through_kwargs(tmp_path):
    model = _block("""\
        max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
        x = run(x, max_seqlen=max_seqlen)
        y = run(x, max_seqlen=7)
        """, helpers="""\


        def run(q, **kwargs):
            return backend(q, **kwargs)


        def backend(q, max_seqlen=None):
            return q[: int(max_seqlen)]
        """)
    _tree(tmp_path, {"model.py": model})
    ((_, line, message, _),) = _gl104(tmp_path)
    assert line == _line(model, "x = run(") and "run(...) reads max_seqlen (from cu_seqlens) with int()" in message


def test_callee_summaries_a_read_the_caller_spares_by_passing_host_bounds(tmp_path):
    """sglang's kimi_k3_vl and minimax_h3: the helper reads the offsets only when no host bounds are given."""
    model = _block("""\
        a = attend(x, cu_seqlens, bounds=self.bounds)
        b = attend(x, cu_seqlens)
        c = attend(x, cu_seqlens, None)
        """, helpers="""\


        def attend(q, cu, bounds=None):
            bounds = bounds if bounds is not None else tuple(cu.tolist())
            return q
        """)
    _tree(tmp_path, {"model.py": model})
    assert [line for _, line, _, _ in _gl104(tmp_path)] == [_line(model, "b = attend("), _line(model, "c = attend(")]


def test_callee_summaries_a_parallel_run_finds_the_same(package, monkeypatch):
    for i in range(20):
        _tree(package, {f"mylib/model{i}.py": CALLER})
    serial = _gl104(package, jobs=1)
    monkeypatch.setattr(runner, "MIN_PARALLEL", 1)
    assert len(serial) == 20 and _gl104(package, jobs=2) == serial


def test_callee_summaries_are_built_once_a_run(package, monkeypatch):
    """Two files call the same helper: one build, one exact reading of the helper."""
    for i in range(2):
        _tree(package, {f"mylib/model{i}.py": CALLER})
    builds, reads = [], []
    build, read_facts = summaries.build, summaries.read_facts
    monkeypatch.setattr(summaries, "build", lambda *a: builds.append(1) or build(*a))
    monkeypatch.setattr(summaries, "read_facts", lambda data, fn: reads.append(fn.qualname) or read_facts(data, fn))
    assert len(_gl104(package)) == 2 and builds == [1] and reads == ["longest"]


def test_callee_summaries_can_be_turned_off(package, monkeypatch):
    _tree(package, {"mylib/model.py": CALLER})
    monkeypatch.setattr(runner, "CALLEE_SUMMARIES", False)
    assert _gl104(package) == []


# -- what a summary says ---------------------------------------------------------------------------------
def _function(source: str, qualname: str):
    text = textwrap.dedent(source)
    data = text.encode()
    facts = summaries.sketch(ast.parse(data), data, "m.py", "m", False)
    return summaries._Sketch(ast.parse(data), data, "m.py", "m", False, facts).function(qualname)


def test_callee_summaries_required_parameters_raise_or_assert_when_none():
    fn = _function("""\
        def attend(q, cu_seqlens, max_seqlen, scale=None, bias=None, flag=None):
            if cu_seqlens is None or q is None:
                raise ValueError("cu_seqlens is required")
            assert max_seqlen is not None and flag, "max_seqlen is required"
            if scale is None:
                scale = 1.0
            return q * scale
        """, "attend")
    assert fn.requires == {"cu_seqlens", "q", "max_seqlen", "flag"}
    assert fn.ignores == {"bias"}


def test_callee_summaries_forwards_and_method_binding():
    fn = _function("""\
        class Attention:
            def forward(self, q, max_seqlen=None, **kwargs):
                return self.impl(q, max_seqlen=max_seqlen, **kwargs)

            @staticmethod
            def impl(q, max_seqlen=None, **kwargs):
                return q
        """, "Attention.forward")
    assert fn.forwards == {"max_seqlen", "**"} and fn.bound == 1
    assert fn.calls == {"self.impl": ("self", "Attention", "impl")}
    assert _function("class A:\n    @staticmethod\n    def impl(q):\n        return q\n", "A.impl").bound == 0


def test_callee_summaries_read_facts_follow_values_not_names():
    """The exact reading: every parameter is taken for a device tensor; what the function copies to the
    host first is not read; a read on the None-branch of another parameter is spared by passing it."""
    source = textwrap.dedent("""\
        def f(cu, host, n: int, bounds=None):
            host = host.cpu()
            a = host.tolist()
            b = int(n)
            c = bounds if bounds is not None else cu.tolist()
            return g(cu[1:], other=cu)
        """)
    data = source.encode()
    facts = summaries.sketch(ast.parse(data), data, "m.py", "m", False)
    fn = summaries._Sketch(ast.parse(data), data, "m.py", "m", False, facts).function("f")
    direct, calls, returned = summaries.read_facts(data, fn)
    assert returned == frozenset()  # g's result: not known here
    assert fn.kernel == frozenset()  # g is the file's (followed): cu goes to no kernel
    # (``host.cpu()`` copies what the caller passes: a sync where that is a device tensor)
    assert direct == {"cu": (".tolist()", frozenset({"bounds"}), 5, False), "host": (".cpu()", frozenset(), 2, False)}
    # per call: (callee, None-branch, positional (parameter carried, what is passed), keywords, **kwargs on, line)
    assert ("g", frozenset(), [("cu", "")], {"other": ("cu", "cu")}, False, 6) in calls


def test_callee_summaries_a_read_spared_by_an_early_return(tmp_path):
    """transformers' get_max_seqlen: a precomputed max in ``kwargs`` returns before the .item()."""
    model = _block("""\
        a = get_max(cu_seqlens, kwargs={"max_seqlen": self.max_seqlen})
        b = get_max(cu_seqlens)
        """, helpers="""\


        def get_max(cu, kwargs=None):
            if kwargs is not None and (found := kwargs.pop("max_seqlen", None)) is not None:
                return found
            return (cu[1:] - cu[:-1]).max().item()
        """)
    _tree(tmp_path, {"model.py": model})
    assert [line for _, line, _, _ in _gl104(tmp_path)] == [_line(model, "b = get_max(")]


@pytest.mark.parametrize("body, unless", [
    ("return cu.tolist()", frozenset()),
    ("if bounds is None:\n    return cu.tolist()\nreturn bounds", {"bounds"}),
    ("if not bounds:\n    return cu.tolist()\nreturn bounds", {"bounds"}),
    ("if bounds is not None:\n    return bounds\nelse:\n    return cu.tolist()", {"bounds"}),
    ("if bounds is not None:\n    return bounds\nreturn cu.tolist()", {"bounds"}),
    ("return bounds or cu.tolist()", {"bounds"}),
    ("if bounds is not None:\n    x = 1\nreturn cu.tolist()", frozenset()),  # no early return
    ("if flag:\n    return bounds\nreturn cu.tolist()", frozenset()),  # not a None test of a parameter
])
def test_callee_summaries_reads_on_the_path_of_a_missing_parameter(body, unless):
    source = "def f(cu, bounds=None):\n    flag = bounds\n" + textwrap.indent(body, "    ") + "\n"
    data = source.encode()
    facts = summaries.sketch(ast.parse(data), data, "m.py", "m", False)
    fn = summaries._Sketch(ast.parse(data), data, "m.py", "m", False, facts).function("f")
    ((kind, spared, _, _),) = summaries.read_facts(data, fn)[0].values()
    assert (kind, spared) == (".tolist()", frozenset(unless))


# -- a bare copy in a callee ---------------------------------------------------------------------------------
# vllm-ascend 0.23's AscendMMEncoderAttention: the layer hands its offsets to a helper that returns a host copy.
COPYING = """\
    def _host_offsets(self, bsz, q_len, cu, *, capturing=False):
        if capturing or cu is None:
            return torch.arange(0, (bsz + 1) * q_len, q_len, device="cpu")
        return cu.cpu()

    def forward"""


def test_callee_summaries_a_helper_that_returns_a_bare_copy(tmp_path):
    model = _block("""\
        a = self._host_offsets(2, 8, cu_seqlens)
        b = self._host_offsets(2, 8, cu_seqlens, capturing=self.graph)
        c = self._host_offsets(2, 8, cu_seqlens.tolist())
        d = self._host_offsets(2, 8, None)
        """).replace("    def forward", textwrap.indent(COPYING, ""), 1)
    _tree(tmp_path, {"model.py": model})
    ((_, line, message, note),) = [f for f in _gl104(tmp_path) if "_host_offsets" in f[2]]
    assert line == _line(model, "a = self._host_offsets(")  # b: a value passed spares it; c, d: host data
    assert "self._host_offsets(...) reads cu_seqlens with .cpu()" in message  # (the path: in the note)
    read = f"{tmp_path / 'model.py'}:{_line(model, 'return cu.cpu()')}"
    assert note.startswith(f"VisionBlock._host_offsets() reads its cu on the host (.cpu()): "
                           f"`VisionBlock._host_offsets()` in {read}")


def test_callee_summaries_a_helper_that_copies_without_waiting_is_silent(tmp_path):
    model = _block("a = self._host_offsets(2, 8, cu_seqlens)").replace(
        "    def forward", COPYING.replace("cu.cpu()", "cu.to('cpu', non_blocking=True)"), 1)
    _tree(tmp_path, {"model.py": model})
    assert _gl104(tmp_path) == []


# -- vLLM's CustomOp: forward runs the platform's method -------------------------------------------------------
DISPATCHER = """\
    import torch.nn as nn


    class CustomOp(nn.Module):
        def __init__(self):
            super().__init__()
            self._forward_method = self.dispatch_forward()

        def forward(self, *args, **kwargs):
            return self._forward_method(*args, **kwargs)

        def forward_native(self, *args, **kwargs):
            raise NotImplementedError

        def forward_oot(self, *args, **kwargs):
            return self.forward_native(*args, **kwargs)

        def dispatch_forward(self):
            if is_out_of_tree():
                return self.forward_oot
            return self.maybe_compile(self.forward_native)
    """
PLUGIN = """\
    import torch
    from ops.mm_attention import {base}


    class {name}({base}):
        def forward_oot(self, q, k, v, cu_seqlens=None, max_seqlen=None):
            seq_lens_cpu = torch.diff(cu_seqlens).to("cpu")
            return self._run(q, cu_seqlens=cu_seqlens)

        def _run(self, q, *, cu_seqlens=None):
            return self._offsets(cu_seqlens)

        def _offsets(self, cu):
            return cu.cpu()

        def forward_helper(self, q, cu_seqlens):
            return cu_seqlens.cpu()  # not a method the forward runs
    """


def _dispatch_tree(root: Path, base: str, name: str) -> Path:
    return _tree(root, {
        "ops/__init__.py": "",
        "ops/custom_op.py": DISPATCHER,
        "ops/mm_attention.py": "import torch.nn as nn\nfrom ops.custom_op import CustomOp\n\n\n"
                               "class MMEncoderAttention(CustomOp):\n"
                               "    def forward_native(self, q, k, v, cu_seqlens=None):\n"
                               "        return q\n\n\nclass PlainAttention(nn.Module):\n"
                               "    def forward(self, q, k, v, cu_seqlens=None):\n        return q\n",
        "plugin/__init__.py": "",
        "plugin/attn.py": PLUGIN.format(base=base, name=name),
    })


@pytest.mark.parametrize("name", ["AscendMMEncoderAttention", "AscendMMEncoderAttention310"])
def test_callee_summaries_custom_op_dispatch_targets_run_per_layer(tmp_path, name):
    """The tree's CustomOp forward calls the method its instance picked (read from the definition): in a
    layer derived from it (by name, or through its base's), forward_oot runs per layer as forward would."""
    _dispatch_tree(tmp_path, "MMEncoderAttention", name)
    found = [(path, line, message.split(": ", 1)[1], note) for path, line, message, note in _gl104(tmp_path)]
    plugin = PLUGIN.format(base="MMEncoderAttention", name=name)
    assert [f[:3] for f in found] == [
        ("plugin/attn.py", _line(plugin, '.to("cpu")'), f'.to("cpu") on cu_seqlens inside {name}.forward_oot'),
        # (the message has no room left for the path: the note says it)
        ("plugin/attn.py", _line(plugin, "self._run("),
         f"self._run(...) reads cu_seqlens with .cpu() inside {name}.forward_oot"),
    ]
    attn = tmp_path / "plugin" / "attn.py"
    assert found[1][3].startswith(f"{name}._run() reads its cu_seqlens on the host (.cpu()): `{name}._run()` in "
                                  f"{attn}:{_line(plugin, 'return self._offsets(')} -> `{name}._offsets()` in "
                                  f"{attn}:{_line(plugin, 'return cu.cpu()')}.")


def test_callee_summaries_forward_methods_of_a_layer_whose_forward_does_not_dispatch_are_silent(tmp_path):
    _dispatch_tree(tmp_path, "PlainAttention", "PluginAttention")
    assert _gl104(tmp_path) == []


def test_callee_summaries_custom_op_of_the_pinned_vllm_when_no_source_is_found(tmp_path):
    """vllm-ascend scanned without vLLM: MMEncoderAttention is the pinned CustomOp subclass (catalog)."""
    plugin = PLUGIN.format(base="MMEncoderAttention", name="AscendMMEncoderAttention").replace(
        "from ops.mm_attention import", "from vllm.model_executor.layers.attention.mm_encoder_attention import")
    _tree(tmp_path, {"plugin/__init__.py": "", "plugin/attn.py": plugin})
    assert [line for _, line, _, _ in _gl104(tmp_path)] == [_line(plugin, '.to("cpu")'), _line(plugin, "self._run(")]


# -- a table of functions ------------------------------------------------------------------------------------
# sglang 0.4.10's MoonViT: ``VL_VISION_ATTENTION_FUNCTIONS[self.attn_implementation](...)``.
TABLE = """\


    def flash_attention(q, q_cu_seqlens=None):
        max_seqlen = (q_cu_seqlens[1:] - q_cu_seqlens[:-1]).max().item()
        return q


    def sdpa_attention(q, q_cu_seqlens=None):
        return q


    ATTENTION_FUNCTIONS = {
        "sdpa": sdpa_attention,
        "flash_attention_2": flash_attention,
    }
    """


@pytest.mark.parametrize("call", [
    "x = ATTENTION_FUNCTIONS[self.impl](x, q_cu_seqlens=cu_seqlens)",
    "x = ATTENTION_FUNCTIONS.get(self.impl)(x, cu_seqlens)",
    "attn = ATTENTION_FUNCTIONS[self.impl]\nx = attn(x, q_cu_seqlens=cu_seqlens)",
])
def test_callee_summaries_a_table_call_reaches_every_function_entry(tmp_path, call):
    model = _block(call, helpers=TABLE)
    _tree(tmp_path, {"model.py": model})
    ((_, line, message, note),) = _gl104(tmp_path)
    assert line == _line(model, call.splitlines()[-1])
    assert "(...) reads cu_seqlens with .item()" in message
    assert note.startswith("flash_attention() (as ATTENTION_FUNCTIONS['flash_attention_2']) reads its q_cu_seqlens "
                           "on the host (.item()): `flash_attention()` in")


def test_callee_summaries_a_table_entry_reached_through_a_helper_method(tmp_path):
    """The MoonViT shape: forward calls a method that picks the function from the table."""
    model = _block("x = self.attend(x, cu_seqlens)", helpers=TABLE).replace("    def forward", (
        "    def attend(self, x, cu_seqlens):\n        fn = ATTENTION_FUNCTIONS[self.impl]\n"
        "        return fn(x, q_cu_seqlens=cu_seqlens)\n\n    def forward"), 1)
    _tree(tmp_path, {"model.py": model})
    ((_, line, message, note),) = _gl104(tmp_path)
    assert line == _line(model, "x = self.attend(") and "self.attend(...) reads cu_seqlens with .item()" in message
    assert "`VisionBlock.attend()` in" in note and "`flash_attention()` (as ATTENTION_FUNCTIONS['flash_attention_2'])" \
        in note


def test_callee_summaries_a_table_imported_from_another_module(tmp_path):
    _tree(tmp_path, {"vit/__init__.py": "", "vit/attn.py": TABLE,
                     "vit/model.py": _block("x = ATTENTION_FUNCTIONS[self.impl](x, cu_seqlens)",
                                            imports="from vit.attn import ATTENTION_FUNCTIONS")})
    ((path, _, message, _),) = _gl104(tmp_path)
    assert path == "vit/model.py" and "ATTENTION_FUNCTIONS[...](...) reads cu_seqlens with .item()" in message


@pytest.mark.parametrize("call, table", [
    ("x = ATTENTION_FUNCTIONS[self.impl](x, cu_seqlens)", TABLE.replace("        max_seqlen = (q_cu_seqlens[1:]"
                                                                       " - q_cu_seqlens[:-1]).max().item()\n", "")),
    ("x = ATTENTION_FUNCTIONS[self.impl](x, cu_seqlens.tolist())", TABLE),  # a host list: the layer's own read
    ("x = ATTENTION_FUNCTIONS[self.impl](x, lengths)", TABLE),  # nothing derived from metadata
    ("ATTENTION_FUNCTIONS = {}\nx = ATTENTION_FUNCTIONS[self.impl](x, cu_seqlens)", TABLE),  # bound again
])
def test_callee_summaries_a_table_whose_entries_do_not_read_what_is_passed_is_silent(tmp_path, call, table):
    _tree(tmp_path, {"model.py": _block(call, helpers=table).replace("def forward(self, x, cu_seqlens)",
                                                                      "def forward(self, x, cu_seqlens, lengths)")})
    assert [f for f in _gl104(tmp_path) if "ATTENTION_FUNCTIONS" in f[2]] == []


def test_the_read_kept_for_a_parameter_does_not_depend_on_the_walk_order():
    # Two paths to reads of one parameter (vLLM's FlashAttention and Triton wrappers both call .item()): the
    # summary keeps the same one whatever order the fixed point meets them in, so a run's output is the same
    # from run to run (string hashing, and with it set order, changes between processes).
    from guardlint.lint.summaries import Read, _better

    flash = Read(".item()", (("layer.forward", "a.py", 3, ""), ("flash_wrapper", "w.py", 58, "")))
    triton = Read(".item()", (("layer.forward", "a.py", 4, ""), ("triton_wrapper", "w.py", 90, "")))
    deeper = Read(".item()", (("layer.forward", "a.py", 3, ""), ("f", "w.py", 1, ""), ("g", "w.py", 9, "")))
    spared = Read(".item()", (("layer.forward", "a.py", 2, ""),), frozenset({"max_seqlen"}))
    assert _better(flash, triton) and not _better(triton, flash)
    assert _better(flash, deeper) and not _better(deeper, flash)
    assert _better(deeper, spared) and not _better(spared, deeper)  # a read no argument spares wins
    assert not _better(flash, flash)
