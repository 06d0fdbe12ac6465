"""GL104 in per-layer code bound at run time (``lint/reach.py``): the impl a layer holds through a typed factory
(vllm-omni's diffusion attention: ``self.attention = self.attn_backend.get_impl_cls()(...)``) runs the method of
whichever subclass the run picks, and a def installed as a layer class's forward runs in its place. Their reads
are reported where they are, with the path from the layer; a member whose type no fact tells is not followed."""
from __future__ import annotations

import textwrap
from pathlib import Path

from guardlint.lint.config import Settings
from guardlint.lint.runner import lint_paths

ABSTRACT = """\
    from abc import ABC, abstractmethod

    import torch


    class AttentionBackend(ABC):
        @staticmethod
        @abstractmethod
        def get_impl_cls() -> type["AttentionImpl"]:
            raise NotImplementedError


    class AttentionImpl(ABC):
        def forward(self, query, key, value, attn_metadata):
            if torch.cuda.is_available():
                return self.forward_cuda(query, key, value, attn_metadata)
            return self.forward_native(query, key, value, attn_metadata)

        def forward_cuda(self, query, key, value, attn_metadata):
            raise NotImplementedError

        def forward_native(self, query, key, value, attn_metadata):
            return query
"""
# The offsets from a dict of the metadata, read in a static helper (vllm-omni's TRTLLM impl, reduced).
PACKED = """\
    from omni.backends.abstract import AttentionBackend, AttentionImpl


    class PackedImpl(AttentionImpl[object]):
        @staticmethod
        def _layout(q, cu_seq_lens_q):
            if int(cu_seq_lens_q[-1].item()) != q.shape[0]:
                raise ValueError("short")
            return cu_seq_lens_q

        def forward_cuda(self, query, key, value, attn_metadata):
            extra = attn_metadata.extra
            cu_seq_lens_q = extra["cu_seqlens_q"]
            return self._layout(query, cu_seq_lens_q)


    class PackedBackend(AttentionBackend):
        @staticmethod
        def get_impl_cls() -> type["PackedImpl"]:
            return PackedImpl
"""
# Lengths from a padding mask, in a helper of another module imported inside the method (the FLASH_ATTN impl).
MASKED = """\
    from omni.backends.abstract import AttentionImpl


    class MaskedImpl(AttentionImpl):
        def forward_cuda(self, query, key, value, attn_metadata):
            mask = attn_metadata.attn_mask
            return self._varlen(query, mask)

        def _varlen(self, query, mask):
            from omni.utils.unpad import unpad_lengths

            cu, longest = unpad_lengths(mask)
            return query[:longest]
"""
UNPAD = """\
    import torch


    def unpad_lengths(attention_mask):
        seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
        max_seqlen_in_batch = seqlens_in_batch.max().item()
        return torch.cumsum(seqlens_in_batch, dim=0), max_seqlen_in_batch
"""
LAYER = """\
    from torch import nn

    from omni.backends.abstract import AttentionBackend
    from omni.selector import select_backend


    class Attention(nn.Module):
        def __init__(self, name: str):
            super().__init__()
            self.attn_backend: type[AttentionBackend] = select_backend(name)
            self.attn_impl_cls = self.attn_backend.get_impl_cls()
            self.attention = self.attn_impl_cls()

        def forward(self, q, k, v, attn_metadata):
            return self._run(q, k, v, attn_metadata)

        def _run(self, q, k, v, attn_metadata):
            return self.attention.forward(q, k, v, attn_metadata)
"""
SELECTOR = """\
    import importlib

    from omni.backends.abstract import AttentionBackend


    def select_backend(name: str) -> type[AttentionBackend]:
        module, _, cls = name.rpartition(".")
        return getattr(importlib.import_module(module), cls)
"""
MODEL = """\
    from torch import nn

    from omni.layer import Attention


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attention("omni.backends.packed.PackedBackend")

        def forward(self, x, cu_seqlens, attn_metadata):
            attn_metadata.extra["cu_seqlens_q"] = cu_seqlens
            return self.attn(x, x, x, attn_metadata)
"""
TREE = {"omni/__init__.py": "", "omni/backends/__init__.py": "", "omni/utils/__init__.py": "",
        "omni/backends/abstract.py": ABSTRACT, "omni/backends/packed.py": PACKED, "omni/backends/masked.py": MASKED,
        "omni/utils/unpad.py": UNPAD, "omni/layer.py": LAYER, "omni/selector.py": SELECTOR, "omni/model.py": MODEL}


def _gl104(tmp_path: Path, files: dict) -> list:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    report = lint_paths([str(tmp_path / "omni")], Settings(root=tmp_path))
    return sorted((Path(f.path).relative_to(tmp_path).as_posix(), f.line, f"{f.message}\n{f.note}")
                  for f in report.findings if f.code == "GL104")


def test_each_impl_a_typed_factory_can_pick_runs_per_layer(tmp_path):
    found = _gl104(tmp_path, TREE)
    assert [(p, line) for p, line, _ in found] == [("omni/backends/packed.py", 7), ("omni/utils/unpad.py", 6)], found
    packed, unpad = found[0][2], found[1][2]
    # The line names the read and the def; the note, the path that binds the def per layer.
    assert "host sync per layer: .item() on cu_seq_lens_q inside PackedImpl._layout\n" in packed, packed
    assert "PackedImpl._layout runs once per layer: Block.forward -> Attention.forward -> Attention._run -> " \
           "self.attention (whichever AttentionImpl the run picks): AttentionImpl.forward -> " \
           "PackedImpl.forward_cuda -> PackedImpl._layout" in packed, packed
    assert ".item() on seqlens_in_batch inside unpad_lengths\n" in unpad
    assert "MaskedImpl.forward_cuda -> MaskedImpl._varlen -> unpad_lengths" in unpad, unpad


def test_a_member_whose_type_no_fact_tells_is_not_followed(tmp_path):
    # The same factory without annotations: nothing says which classes the member can hold.
    files = dict(TREE)
    files["omni/layer.py"] = LAYER.replace(": type[AttentionBackend]", "")
    files["omni/selector.py"] = SELECTOR.replace(" -> type[AttentionBackend]", "")
    files["omni/backends/abstract.py"] = ABSTRACT.replace(' -> type["AttentionImpl"]', "")
    assert _gl104(tmp_path, files) == []


def test_a_subclass_of_another_base_is_not_reached(tmp_path):
    # The reading impl derives from a base no layer holds: it is not per-layer code.
    files = dict(TREE)
    files["omni/backends/packed.py"] = PACKED.replace("(AttentionImpl[object])", "(object)")
    assert [p for p, _, _ in _gl104(tmp_path, files)] == ["omni/utils/unpad.py"]


def test_a_member_its_constructor_builds_is_bound_statically(tmp_path):
    # self.attention = PackedImpl(): that class's forward, which the callee summaries judge at its call; no
    # subclass is reached and no place is added.
    files = dict(TREE)
    files["omni/layer.py"] = LAYER.replace("self.attention = self.attn_impl_cls()", "self.attention = PackedImpl()") \
        .replace("from omni.selector import select_backend", "from omni.selector import select_backend\n"
                 "from omni.backends.packed import PackedImpl")
    assert _gl104(tmp_path, files) == []


def test_a_helper_bound_per_layer_is_reported_at_its_read_not_also_at_its_call(tmp_path):
    files = dict(TREE)
    files["omni/backends/masked.py"] = textwrap.dedent(MASKED).replace(
        "        from omni.utils.unpad import unpad_lengths\n\n", "") + textwrap.dedent("""\


        def unpad_lengths(attention_mask):
            seqlens_in_batch = attention_mask.sum(dim=-1)
            return seqlens_in_batch, int(seqlens_in_batch.max().item())
    """)
    found = _gl104(tmp_path, files)
    assert [(p, line) for p, line, _ in found] == [("omni/backends/masked.py", 16),
                                                    ("omni/backends/packed.py", 7)], found


PATCHED = """\
    def patched_forward(self, hidden, cu_seqlens):
        max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
        return hidden[:max_seqlen]
"""
PATCH = """\
    def apply(model):
        from omni.vision import VisionAttention, VisionModel
        from omni.patched import patched_forward

        VisionAttention.forward = patched_forward
"""
VISION = """\
    from torch import nn


    class VisionAttention(nn.Module):
        def forward(self, hidden, cu_seqlens):
            return hidden


    class VisionModel(nn.Module):
        def forward(self, hidden, cu_seqlens):
            return hidden
"""


def test_a_def_installed_as_a_layer_class_s_forward_runs_per_layer(tmp_path):
    # verl's monkey patch, reduced: the def lives in another module, imported inside the installing function.
    found = _gl104(tmp_path, {"omni/__init__.py": "", "omni/patched.py": PATCHED, "omni/patch.py": PATCH,
                              "omni/vision.py": VISION})
    assert [(p, line) for p, line, _ in found] == [("omni/patched.py", 2)], found
    assert "inside patched_forward\npatched_forward runs once per layer: VisionAttention.forward = " \
           "patched_forward (patch.py:5) -> patched_forward" in found[0][2], found


def test_a_def_installed_as_a_whole_model_s_forward_is_not_per_layer(tmp_path):
    patch = PATCH.replace("VisionAttention.forward = patched_forward", "VisionModel.forward = patched_forward")
    assert _gl104(tmp_path, {"omni/__init__.py": "", "omni/patched.py": PATCHED, "omni/patch.py": patch,
                             "omni/vision.py": VISION}) == []


def test_installed_through_method_type_or_setattr(tmp_path):
    for line in ("VisionAttention.forward = types.MethodType(patched_forward, None)",
                 "setattr(VisionAttention, 'forward', patched_forward)"):
        patch = "import types\n\n\n" + textwrap.dedent(PATCH).replace("VisionAttention.forward = patched_forward", line)
        found = _gl104(tmp_path, {"omni/__init__.py": "", "omni/patched.py": PATCHED, "omni/patch.py": patch,
                                  "omni/vision.py": VISION})
        assert [(p, n) for p, n, _ in found] == [("omni/patched.py", 2)], (line, found)


USP = """\
    from omni.backends.abstract import AttentionImpl


    class Packed(AttentionImpl):
        def forward_varlen(self, query, cu_seqlens, cu_seqlens_host=None):
            bounds = cu_seqlens_host if cu_seqlens_host is not None else tuple(cu_seqlens.tolist())
            return self._dense(query, cu_seqlens=cu_seqlens) if len(bounds) > 2 else query

        def _dense(self, query, cu_seqlens=None):
            if cu_seqlens is None:
                return query
            return [int(x) for x in cu_seqlens.tolist()]
"""
USP_LAYER = """\
    from torch import nn

    from omni.backends.abstract import AttentionImpl


    class USPAttention(nn.Module):
        def __init__(self, impl: type[AttentionImpl]):
            super().__init__()
            self.attn_impl = impl()

        def forward(self, q, cu_seqlens, bounds):
            return self.attn_impl.forward_varlen(q, cu_seqlens=cu_seqlens, cu_seqlens_host=tuple(bounds))
"""


def test_a_read_the_binding_calls_spare_is_not_reported(tmp_path):
    # sglang 0.5.23's diffusion attention, reduced: the layer hands the offsets on the host too, and the impl
    # reads the device ones only when none are given; its helper reads them whenever it is handed them.
    found = _gl104(tmp_path, {"omni/__init__.py": "", "omni/backends/__init__.py": "",
                              "omni/backends/abstract.py": ABSTRACT, "omni/backends/usp.py": USP,
                              "omni/layer.py": USP_LAYER})
    assert [(p, line) for p, line, _ in found] == [("omni/backends/usp.py", 12)], found
    assert "Packed.forward_varlen -> Packed._dense" in found[0][2]


SDPA = """\
    from omni.backends.abstract import AttentionImpl


    class Base(AttentionImpl):
        def forward(self, *args, **kwargs):
            return self.forward_native(*args, **kwargs)


    class Encoder(Base):
        def forward_native(self, query, key, value, cu_seqlens=None):
            return sdpa(query, cu_seqlens)


    def sdpa(query, cu_seqlens=None):
        if cu_seqlens is None:
            return query
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        return query.split(lens)
"""
CLIP = """\
    from torch import nn

    from omni.backends.abstract import AttentionImpl


    class ClipAttention(nn.Module):
        def __init__(self, attn_cls: type[AttentionImpl]):
            super().__init__()
            self.attn = attn_cls()

        def forward(self, q, cu_seqlens):
            return self.attn(q, q, q{passed})
"""


def test_what_a_def_does_only_once_an_argument_no_binding_call_passes_is_given_is_not_reported(tmp_path):
    # vLLM 0.33's CLIP attention, reduced: its typed member's forward hands on *args/**kwargs, and the wrapper reads
    # the offsets only when some are given; CLIP gives none. A caller that gives them makes the read per layer.
    files = {"omni/__init__.py": "", "omni/backends/__init__.py": "", "omni/backends/abstract.py": ABSTRACT,
             "omni/backends/sdpa.py": SDPA}
    assert _gl104(tmp_path, {**files, "omni/clip.py": CLIP.format(passed="")}) == []
    found = _gl104(tmp_path, {**files, "omni/clip.py": CLIP.format(passed=", cu_seqlens=cu_seqlens")})
    assert [(p, line) for p, line, _ in found] == [("omni/backends/sdpa.py", 17)], found


QUANT = """\
    from torch import nn

    from omni.backends.abstract import AttentionImpl


    class MLPBlock(nn.Module):
        def __init__(self, method: type[AttentionImpl]):
            super().__init__()
            self.quant_method = method()

        def forward(self, x, cu_seqlens):
            return self.quant_method.forward(x, x, x, x)
"""


def test_a_binding_handed_no_metadata_is_not_followed(tmp_path):
    # A linear layer's quant_method.apply(self, x): whatever impl the run picks gets no metadata to read per layer.
    files = {k: v for k, v in TREE.items() if k != "omni/model.py"}
    assert _gl104(tmp_path, {**files, "omni/linear.py": QUANT}) == []
    found = _gl104(tmp_path, {**files, "omni/linear.py": QUANT.replace("forward(x, x, x, x)",
                                                                       "forward(x, x, x, cu_seqlens)")})
    assert [p for p, _, _ in found] == ["omni/backends/packed.py", "omni/utils/unpad.py"], found
    assert "MLPBlock.forward -> self.quant_method (whichever AttentionImpl the run picks)" in found[0][2]


def test_follow_bindings_off_in_the_configuration_or_on_the_command_line(tmp_path):
    from guardlint.lint.commands import run_check

    for name, text in {**TREE, "pyproject.toml": "[tool.guardlint]\nfollow-bindings = false\n"}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    off = run_check([str(tmp_path / "omni")], cwd=tmp_path, exit_zero=True)
    assert "GL104" not in off.stdout, off.stdout
    on = run_check([str(tmp_path / "omni")], cwd=tmp_path, exit_zero=True, follow_bindings=True)
    assert on.stdout.count("GL104") == 2, on.stdout
    (tmp_path / "pyproject.toml").write_text("[tool.guardlint]\nfollow-bindings = 'no'\n")
    bad = run_check([str(tmp_path / "omni")], cwd=tmp_path)
    assert bad.exit_code == 2 and "follow-bindings: expected true or false, got 'no'" in bad.stderr, bad


FISH = """\
    import types


    def dispatch(attn_metadata, seq_lens):
        upper_bound = attn_metadata.seq_lens_cpu_upper_bound
        if upper_bound is None or upper_bound.device.type != "cpu":
            return None
        bound = int(upper_bound.max().item())
        return max(bound, int(seq_lens.max().item()))


    def forward_with_cache(impl, original, layer, query, attn_metadata):
        seq_lens = attn_metadata.seq_lens
        dispatch(attn_metadata, seq_lens)
        return original(layer, query, attn_metadata)


    def install(model):
        for layer in model.layers:
            impl = layer.self_attn.attn.impl
            original_forward = impl.forward

            def fish_forward(this_impl, layer, query, attn_metadata, *, _original=original_forward):
                return forward_with_cache(this_impl, _original, layer, query, attn_metadata)

            impl.forward = types.MethodType(fish_forward, impl)
"""


def test_a_closure_installed_on_each_layer_s_object_runs_per_layer(tmp_path):
    # vllm-omni's fish kvcache backend, reduced: a def nested in the installing function replaces the forward of an
    # object reached from each element of a loop over the layers. The host copy of the bound, proved on the CPU by
    # the early return, is not read from the device; the device lengths are.
    found = _gl104(tmp_path, {"omni/__init__.py": "", "omni/fish.py": FISH})
    assert [(p, line) for p, line, _ in found] == [("omni/fish.py", 9)], found
    assert "dispatch runs once per layer: impl.forward = fish_forward (fish.py:26) -> install.fish_forward -> " \
           "forward_with_cache -> dispatch" in found[0][2], found


# A generic build (lmdeploy's backends): ``build_op(spec: BuildSpec[ImplT]) -> ImplT`` returns the type the spec's
# class fills in (``class FlashAttentionBuildSpec(BuildSpec[FlashAttentionImpl])``), and the layer holds what it builds.
GENERIC_BASE = """\
    from typing import Generic, TypeVar

    ImplT = TypeVar("ImplT")


    class BuildSpec(Generic[ImplT]):
        pass


    class OpsBackend:
        @classmethod
        def build_op(cls, spec: BuildSpec[ImplT], *, deterministic: bool = False) -> ImplT:
            raise NotImplementedError
"""
GENERIC_SPEC = """\
    from dataclasses import dataclass

    from lm.backends.base import BuildSpec


    class FlashAttentionImpl:
        def forward(self, query, key, value, q_start_loc, q_seqlens, max_q_seqlen):
            raise NotImplementedError


    @dataclass(frozen=True)
    class FlashAttentionBuildSpec(BuildSpec[FlashAttentionImpl]):
        num_heads: int
"""
GENERIC_IMPL = """\
    from lm.backends.flash_attention import FlashAttentionImpl


    class DeviceFlashAttentionImpl(FlashAttentionImpl):
        def __init__(self, num_heads):
            self.num_heads = num_heads
            from lm.kernels.device import flash_attention_fwd
            self.flash_attention_fwd = flash_attention_fwd

        def forward(self, query, key, value, q_start_loc, q_seqlens, max_q_seqlen):
            out = query.new_empty(query.shape)
            self.flash_attention_fwd(query, key, value, out, q_start_loc=q_start_loc, q_seqlens=q_seqlens)
            return out
"""
# The kernel the impl stores in a member (lmdeploy's dlinfer kernels): the device offsets copied to the host.
GENERIC_KERNEL = """\
    def flash_attention_fwd(query, key, value, out, q_start_loc, q_seqlens):
        actual_seq_lengths_cpu = (q_start_loc + q_seqlens).cpu()
        return out, actual_seq_lengths_cpu
"""
GENERIC_SELECTOR = """\
    from lm.backends.base import OpsBackend


    def get_backend() -> type[OpsBackend]:
        return OpsBackend
"""
GENERIC_LAYER = """\
    from torch import nn

    from lm.backends.flash_attention import FlashAttentionBuildSpec
    from lm.backends.selector import get_backend


    class FlashAttention(nn.Module):
        def __init__(self, num_heads):
            super().__init__()
            self.impl = get_backend().build_op(FlashAttentionBuildSpec(num_heads=num_heads), deterministic=False)

        def forward(self, query, key, value, q_start_loc, q_seqlens, max_q_seqlen=None):
            if max_q_seqlen is None:
                max_q_seqlen = query.numel() // (query.size(-1) * query.size(-2))
            return self.impl.forward(query, key, value, q_start_loc=q_start_loc, q_seqlens=q_seqlens,
                                     max_q_seqlen=max_q_seqlen)
"""
GENERIC_MODEL = """\
    from torch import nn

    from lm.nn.attention import FlashAttention


    class VisionAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = FlashAttention(16)

        def forward(self, hidden_states, cu_seqlens):
            return self.attention(hidden_states, hidden_states, hidden_states, q_start_loc=cu_seqlens[:-1],
                                  q_seqlens=cu_seqlens[1:] - cu_seqlens[:-1])
"""
GENERIC_TREE = {"lm/__init__.py": "", "lm/backends/__init__.py": "", "lm/backends/device/__init__.py": "",
                "lm/nn/__init__.py": "", "lm/models/__init__.py": "",
                "lm/backends/base.py": GENERIC_BASE, "lm/backends/flash_attention.py": GENERIC_SPEC,
                "lm/backends/device/flash_attention.py": GENERIC_IMPL, "lm/backends/selector.py": GENERIC_SELECTOR,
                "lm/nn/attention.py": GENERIC_LAYER, "lm/models/vit.py": GENERIC_MODEL,
                "lm/kernels/__init__.py": "", "lm/kernels/device.py": GENERIC_KERNEL}


def _gl104_in(tmp_path: Path, files: dict, top: str) -> list:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    report = lint_paths([str(tmp_path / top)], Settings(root=tmp_path))
    return sorted((Path(f.path).relative_to(tmp_path).as_posix(), f.line, f"{f.message}\n{f.note}")
                  for f in report.findings if f.code == "GL104")


def test_a_generic_build_returns_the_type_its_spec_fills_in(tmp_path):
    found = _gl104_in(tmp_path, GENERIC_TREE, "lm")
    assert [(p, line) for p, line, _ in found] == [("lm/kernels/device.py", 2)], found
    assert "flash_attention_fwd runs once per layer" in found[0][2], found
    assert "self.impl (whichever FlashAttentionImpl the run picks)" in found[0][2], found


def test_a_generic_build_with_a_spec_that_fills_in_nothing_is_not_followed(tmp_path):
    files = dict(GENERIC_TREE)
    files["lm/backends/flash_attention.py"] = GENERIC_SPEC.replace("(BuildSpec[FlashAttentionImpl])", "")
    assert _gl104_in(tmp_path, files, "lm") == []
