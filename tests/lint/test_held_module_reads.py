"""GL104 through a module the layer holds: ``self.attn = Cls(...)`` in ``__init__``, then ``self.attn(...)`` in
a per-layer forward runs ``Cls``'s forward, or the method its CustomOp forward dispatches to, as the tree, a
copy above it or the installed engine defines it (never imported). A device value the layer makes and hands
there is a per-layer read when that code reads it on the host, down to a ``torch.ops.<ns>.<name>`` call of a
function registered as that op; a parameter the layer only passes on is its caller's fact, and the CPU
platform's method reads host tensors only."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from guardlint.lint import engine_defs
from guardlint.lint.config import Settings
from guardlint.lint.runner import lint_paths

ROOT = Path(__file__).resolve().parents[2]
PINNED_VLLM = ROOT / ".engines" / "vllm-0.33.0"

# An engine as the layer's tree would import it: a CustomOp whose forward calls the method its instance
# picked; the CUDA method reaches a read of max_seqlen through a module function and a registered op.
ENGINE = {
    "vllm/__init__.py": "",
    "vllm/custom_op.py": """\
        import torch.nn as nn


        class CustomOp(nn.Module):
            def __init__(self):
                super().__init__()
                self._forward_method = self.dispatch_forward()

            def forward(self, *args, **kwargs):
                return self._forward_method(*args, **kwargs)

            def dispatch_forward(self):
                if self.on_cpu:
                    return self.forward_cpu
                return self.forward_cuda
        """,
    "vllm/wrappers.py": """\
        import torch

        from vllm.registry import direct_register_custom_op


        def flash_wrapper(q, cu_seqlens, max_seqlen):
            from vllm.kernels import varlen_kernel

            if max_seqlen is None:
                max_seqlen = q.shape[0]
            else:
                max_seqlen = max_seqlen.item()
            return varlen_kernel(q, cu_seqlens_q=cu_seqlens, max_seqlen_q=max_seqlen)


        direct_register_custom_op(op_name="flash_wrapper", op_func=flash_wrapper)


        def sdpa_split(q, cu_seqlens):
            lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            return q


        def vit_flash_wrapper(q, cu_seqlens=None, max_seqlen=None):
            return torch.ops.vllm.flash_wrapper(q, cu_seqlens, max_seqlen)
        """,
    "vllm/attention.py": """\
        from vllm.custom_op import CustomOp
        from vllm.wrappers import sdpa_split, vit_flash_wrapper


        class EncoderAttention(CustomOp):
            def forward_cuda(self, query, cu_seqlens=None, max_seqlen=None):
                return vit_flash_wrapper(query, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)

            def forward_cpu(self, query, cu_seqlens=None, max_seqlen=None):
                return int(max_seqlen) + sdpa_split(query, cu_seqlens)
        """,
}

LAYER = """\
    import torch
    from torch import nn

    from vllm.attention import EncoderAttention


    class PatchAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = EncoderAttention()

        def forward(self, q, cu_seqlens, max_seqlen=None, lengths=None, meta=None):
    {body}
    """


def _write(root: Path, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _layer(body: str) -> str:
    return textwrap.dedent(LAYER).format(body=textwrap.indent(textwrap.dedent(body), " " * 8))


def _gl104(root: Path) -> list:
    report = lint_paths([str(root)], Settings(root=root))
    return [f for f in report.findings if f.code == "GL104"]


@pytest.fixture()
def engine_tree(tmp_path):
    """The engine as a copy in the scanned tree (a fork or a vendored engine)."""
    engine_defs.clear()
    _write(tmp_path, ENGINE)
    yield tmp_path
    engine_defs.clear()


def test_a_device_max_made_per_layer_and_read_by_the_held_engine_module(engine_tree):
    body = "m = (cu_seqlens[1:] - cu_seqlens[:-1]).max()\nreturn self.attn(q, cu_seqlens=cu_seqlens, max_seqlen=m)"
    layer = _layer(body)
    _write(engine_tree, {"model/__init__.py": "", "model/layer.py": layer})
    (found,) = _gl104(engine_tree)
    assert found.line == next(i for i, line in enumerate(layer.splitlines(), 1) if "return self.attn(" in line)
    assert "self.attn(...) reads m (from cu_seqlens)" in found.message
    # the path: the dispatched CUDA method, the module function, then the function registered as the op
    assert found.note.startswith("EncoderAttention.forward_cuda() reads its max_seqlen on the host (.item()): ")
    assert "`vit_flash_wrapper()` in" in found.note and "`flash_wrapper()` in" in found.note
    assert found.note.index("`vit_flash_wrapper()`") < found.note.index("`flash_wrapper()`")


@pytest.mark.parametrize("body", [
    # a parameter passed on: where it lives is the caller's fact
    "return self.attn(q, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)",
    # ... also through an attribute of one, or defaulted only where it is None
    "m = meta.max_seqlen if meta is not None else None\nreturn self.attn(q, cu_seqlens=cu_seqlens, max_seqlen=m)",
    # a host value made here
    "m = torch.tensor(max(lengths))\nreturn self.attn(q, cu_seqlens=cu_seqlens, max_seqlen=m)",
    # nothing the engine reads
    "return self.attn(q, cu_seqlens=cu_seqlens)",
], ids=["parameter", "attribute-of-parameter", "host", "not-passed"])
def test_what_the_layer_does_not_make_on_the_device_is_not_its_read(engine_tree, body):
    _write(engine_tree, {"model/__init__.py": "", "model/layer.py": _layer(body)})
    assert _gl104(engine_tree) == []


def test_the_cpu_platform_method_reads_host_tensors_only(engine_tree):
    """forward_cpu reads max_seqlen and cu_seqlens on the host: on the CPU platform no read waits for a device."""
    engine = dict(ENGINE)
    engine["vllm/custom_op.py"] = engine["vllm/custom_op.py"].replace("return self.forward_cuda",
                                                                      "return self.forward_native")
    engine["vllm/attention.py"] += ("\n    def forward_native(self, query, cu_seqlens=None, max_seqlen=None):\n"
                                    "        return query\n")
    _write(engine_tree, engine)
    body = "m = (cu_seqlens[1:] - cu_seqlens[:-1]).max()\nreturn self.attn(q, cu_seqlens=cu_seqlens, max_seqlen=m)"
    _write(engine_tree, {"model/__init__.py": "", "model/layer.py": _layer(body)})
    assert _gl104(engine_tree) == []


def test_an_op_registered_by_decorator_is_followed(engine_tree):
    engine = dict(ENGINE)
    engine["vllm/wrappers.py"] = engine["vllm/wrappers.py"].replace(
        "        def flash_wrapper(",
        '        @torch.library.custom_op("vllm::flash_wrapper", mutates_args=())\n        def flash_wrapper(')\
        .replace('direct_register_custom_op(op_name="flash_wrapper", op_func=flash_wrapper)', "")
    _write(engine_tree, engine)
    body = "m = (cu_seqlens[1:] - cu_seqlens[:-1]).max()\nreturn self.attn(q, cu_seqlens=cu_seqlens, max_seqlen=m)"
    _write(engine_tree, {"model/__init__.py": "", "model/layer.py": _layer(body)})
    (found,) = _gl104(engine_tree)
    assert "`flash_wrapper()` in" in found.note


def test_an_unregistered_op_is_not_guessed(engine_tree):
    engine = dict(ENGINE)
    engine["vllm/wrappers.py"] = engine["vllm/wrappers.py"].replace(
        'direct_register_custom_op(op_name="flash_wrapper", op_func=flash_wrapper)', "")
    _write(engine_tree, engine)
    body = "m = (cu_seqlens[1:] - cu_seqlens[:-1]).max()\nreturn self.attn(q, cu_seqlens=cu_seqlens, max_seqlen=m)"
    _write(engine_tree, {"model/__init__.py": "", "model/layer.py": _layer(body)})
    assert _gl104(engine_tree) == []


def test_a_helper_that_defaults_a_parameter_reads_only_when_it_is_not_passed(tmp_path):
    """``if max_seqlen is None: max_seqlen = f(cu)``: a read of the result is a read of cu only for callers
    that pass no max_seqlen."""
    helper = """\
        def longest(cu, max_seqlen=None):
            if max_seqlen is None:
                max_seqlen = (cu[1:] - cu[:-1]).max()
            return max_seqlen.item()
        """
    layer = """\
        import torch
        import torch.nn as nn

        from lib.seq import longest


        class VisionBlock(nn.Module):
            def forward(self, x, cu_seqlens, lengths):
                a = longest(cu_seqlens, max_seqlen=torch.tensor(max(lengths)))
                b = longest(cu_seqlens)
                return x
        """
    _write(tmp_path, {"lib/__init__.py": "", "lib/seq.py": helper, "lib/block.py": layer})
    found = _gl104(tmp_path)
    assert [f.line for f in found] == [10]
    assert "longest(...) reads cu_seqlens" in found[0].message


# A layer on vLLM's MMEncoderAttention (imported from ``module``): line 13 hands it a maximum it takes of the
# offsets on the device in every forward, line 14 the max_seqlen its caller gave.
VLLM_LAYER = textwrap.dedent("""\
    import torch
    from torch import nn
    from {module} import MMEncoderAttention


    class PatchAttention(nn.Module):
        def __init__(self, heads, dim):
            super().__init__()
            self.attn = MMEncoderAttention(heads, dim, scale=dim ** -0.5)

        def forward(self, q, k, v, cu_seqlens, max_seqlen):
            m = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
            a = self.attn(query=q, key=k, value=v, cu_seqlens=cu_seqlens, max_seqlen=m)
            return self.attn(query=q, key=k, value=v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    """)


def test_the_pinned_vllm_encoder_attention_installed(tmp_path, monkeypatch):
    """The real engine: vLLM 0.33.0's MMEncoderAttention on sys.path (as an installed package), a layer that
    computes its max_seqlen on the device in every forward; the note names the release's read."""
    if not (PINNED_VLLM / "vllm").is_dir():
        pytest.skip("vLLM 0.33.0 is fetched by `make engines-vllm` (not committed)")
    monkeypatch.syspath_prepend(str(PINNED_VLLM))
    engine_defs.clear()
    module = "vllm.model_executor.layers.attention.mm_encoder_attention"
    _write(tmp_path, {"model.py": VLLM_LAYER.format(module=module)})
    try:
        (found,) = _gl104(tmp_path)
    finally:
        engine_defs.clear()
    assert found.line == 13
    assert found.note.startswith("MMEncoderAttention.forward_cuda() (judged against vllm")
    # (FlashAttention's or Triton's wrapper, whichever path the summary met first: both call .item())
    assert "_wrapper()` in" in found.note and "vit_attn_wrappers.py:" in found.note


# -- a loop over the layers the model holds -----------------------------------------------------------------
TOWER = """\
    import torch
    from torch import nn

    from vllm.attention import EncoderAttention


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = EncoderAttention()

        def forward(self, x, cu_seqlens, max_seqlen=None):
            return self.attn(x, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


    class Tower(nn.Module):
        def __init__(self, depth):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(depth)])

        def forward(self, x, grid, lengths):
    {body}
            for i, blk in enumerate(self.blocks):
                x = blk(x, cu_seqlens, max_seqlen=m)
            return x
    """


def _tower(body: str) -> str:
    return textwrap.dedent(TOWER).format(body=textwrap.indent(textwrap.dedent(body), " " * 8))


def test_a_device_max_made_once_and_read_by_every_block_is_reported_at_the_loop(engine_tree):
    tower = _tower("cu_seqlens = torch.tensor(grid, device=x.device).cumsum(0)\n"
                   "m = (cu_seqlens[1:] - cu_seqlens[:-1]).max()")
    _write(engine_tree, {"model/__init__.py": "", "model/tower.py": tower})
    (found,) = _gl104(engine_tree)
    assert found.line == next(i for i, line in enumerate(tower.splitlines(), 1) if "x = blk(" in line)
    assert "blk(...) reads m with .item()" in found.message and "inside a loop over" in found.message
    assert found.note.startswith("Block.forward() reads its max_seqlen on the host (.item()): `Block.forward()` in ")
    assert "`flash_wrapper()` in" in found.note


@pytest.mark.parametrize("body", [
    # the maximum on the host, then handed over: no device read
    "cu_seqlens = torch.tensor(grid, device=x.device).cumsum(0)\nm = torch.tensor(max(lengths))",
    # a maximum derived from a parameter that is copied to the device afterwards: its own location is the
    # caller's fact, not this def's (the tensor the engine needs on the device is the copy)
    "m = (grid[1:] - grid[:-1]).max()\ncu_seqlens = grid.to(x.device)",
], ids=["host-max", "max-before-the-copy"])
def test_what_the_loop_does_not_make_on_the_device_is_not_reported(engine_tree, body):
    _write(engine_tree, {"model/__init__.py": "", "model/tower.py": _tower(body)})
    assert _gl104(engine_tree) == []


def test_a_read_of_what_the_engine_also_hands_to_a_kernel_is_the_engine_s_own(engine_tree):
    """The engine's SDPA path reads cu_seqlens with .tolist(), its FlashAttention path hands it to the kernel:
    it needs cu_seqlens on the device, so no caller can spare that read."""
    engine = dict(ENGINE)
    engine["vllm/wrappers.py"] += textwrap.indent(textwrap.dedent("""\


        def flash_attn_varlen(q, cu_seqlens):
            from vllm.kernels import varlen_kernel

            return varlen_kernel(q, cu_seqlens_q=cu_seqlens)
        """), " " * 8)
    engine["vllm/attention.py"] = engine["vllm/attention.py"].replace(
        "from vllm.wrappers import sdpa_split, vit_flash_wrapper",
        "from vllm.wrappers import flash_attn_varlen, sdpa_split, vit_flash_wrapper").replace(
        "return vit_flash_wrapper(query, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)",
        "if self.sdpa:\n                    return sdpa_split(query, cu_seqlens)\n"
        "                return flash_attn_varlen(query, cu_seqlens)")
    _write(engine_tree, engine)
    tower = _tower("cu_seqlens = torch.tensor(grid, device=x.device).cumsum(0)\nm = None")
    _write(engine_tree, {"model/__init__.py": "", "model/tower.py": tower})
    # (the engine's own per-layer method is a place of its own: the read is reported there, in vllm/)
    assert [Path(f.path).parent.name for f in _gl104(engine_tree)] == ["vllm"]
    # without the kernel path the .tolist() is the only use: the caller's device offsets are read per layer
    engine["vllm/attention.py"] = engine["vllm/attention.py"].replace(
        "return flash_attn_varlen(query, cu_seqlens)", "return query")
    _write(engine_tree, engine)
    (found,) = [f for f in _gl104(engine_tree) if Path(f.path).parent.name == "model"]
    assert "blk(...) reads cu_seqlens with .tolist()" in found.message


def test_a_block_s_own_read_is_reported_in_the_block_not_again_at_the_loop(tmp_path):
    model = """\
        import torch
        from torch import nn


        class Block(nn.Module):
            def forward(self, x, cu_seqlens):
                n = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
                return x * n


        class Tower(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([Block() for _ in range(4)])

            def forward(self, x, grid):
                cu_seqlens = torch.tensor(grid, device=x.device).cumsum(0)
                for blk in self.blocks:
                    x = blk(x, cu_seqlens)
                return x
        """
    _write(tmp_path, {"model.py": model})
    assert [f.line for f in _gl104(tmp_path)] == [7]


def test_a_sync_the_engine_allows_is_reported_only_where_the_device_value_is_made(engine_tree):
    """vLLM wraps its .tolist() of cu_seqlens in ``with gpu_sync_allowed():``: its own per-layer method,
    passing on the offsets it was given, is not reported; a model that makes device offsets and hands them
    there still is."""
    engine = dict(ENGINE)
    engine["vllm/wrappers.py"] = engine["vllm/wrappers.py"].replace(
        "            lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()",
        "            with gpu_sync_allowed():\n                lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()")
    engine["vllm/attention.py"] = engine["vllm/attention.py"].replace(
        "return vit_flash_wrapper(query, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)",
        "return sdpa_split(query, cu_seqlens)")
    _write(engine_tree, engine)
    assert "gpu_sync_allowed" in (engine_tree / "vllm" / "wrappers.py").read_text()
    tower = _tower("cu_seqlens = torch.tensor(grid, device=x.device).cumsum(0)\nm = None")
    _write(engine_tree, {"model/__init__.py": "", "model/tower.py": tower})
    found = _gl104(engine_tree)
    assert [(Path(f.path).parent.name, "blk(...) reads cu_seqlens with .tolist()" in f.message) for f in found] \
        == [("model", True)]


def test_without_the_engine_installed_the_catalog_s_release_is_the_judge(tmp_path):
    """vLLM not installed, no copy in the tree: MMEncoderAttention is judged by the catalog's pinned picture
    (its wrappers call max_seqlen.item(), FlashAttention needs cu_seqlens on the device), and says so."""
    engine_defs.clear()
    _write(tmp_path, {"model.py": VLLM_LAYER.format(module="vllm.model_executor.layers.attention")})
    (found,) = _gl104(tmp_path)
    assert found.line == 13
    assert found.note.startswith("MMEncoderAttention.forward_cuda() (judged against catalog: vllm 0.33.0) reads "
                                 "its max_seqlen on the host (.item()): `flash_attn_maxseqlen_wrapper()` in "
                                 "vllm/v1/attention/ops/vit_attn_wrappers.py:58.")


# -- a value the model's helper returns ------------------------------------------------------------------------
HELPER = """\


        def compute_max(self, cu_seqlens):
            max_seqlen = None
            if self.flash:
                max_seqlen = {made}
            return max_seqlen
"""


@pytest.mark.parametrize("made, reported", [
    ("(cu_seqlens[1:] - cu_seqlens[:-1]).max()", True),  # a device maximum (or None)
    ("int((cu_seqlens[1:] - cu_seqlens[:-1]).max())", False),  # read once per forward: a host int
], ids=["device", "host"])
def test_a_helper_s_returned_device_max_handed_to_every_block(engine_tree, made, reported):
    tower = _tower("cu_seqlens = torch.tensor(grid, device=x.device).cumsum(0)\nm = self.compute_max(cu_seqlens)")
    tower = tower.replace("\n    def forward(self, x, grid, lengths):", textwrap.indent(
        textwrap.dedent(HELPER).format(made=made), "    ") + "\n    def forward(self, x, grid, lengths):")
    _write(engine_tree, {"model/__init__.py": "", "model/tower.py": tower})
    found = [f for f in _gl104(engine_tree) if Path(f.path).parent.name == "model"]
    assert [("blk(...) reads m with .item()" in f.message) for f in found] == ([True] if reported else [])


def test_offsets_moved_to_the_model_s_device_are_on_the_device_whatever_they_derive_from(engine_tree):
    """``.to(self.device)`` places the offsets by a fact, though they derive from a parameter named like
    metadata (whose own place is its caller's): the helper's maximum of them is a device value."""
    tower = _tower("cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(self.device)\n"
                   "m = self.compute_max(cu_seqlens)")
    tower = tower.replace("def forward(self, x, grid, lengths):", "def forward(self, x, grid, seq_lens):") \
        .replace("lengths.cumsum(0)", "seq_lens.cumsum(0)").replace("from torch import nn", "from torch import nn\n"
                                                                    "import torch.nn.functional as F")
    tower = tower.replace("\n    def forward(self, x, grid, seq_lens):", textwrap.indent(
        textwrap.dedent(HELPER).format(made="(cu_seqlens[1:] - cu_seqlens[:-1]).max()"), "    ")
        + "\n    def forward(self, x, grid, seq_lens):")
    _write(engine_tree, {"model/__init__.py": "", "model/tower.py": tower})
    found = [f for f in _gl104(engine_tree) if Path(f.path).parent.name == "model"]
    assert [("blk(...) reads m" in f.message) for f in found] == [True]
