"""GL104 in code bound at run time through transformers' attention registry: a function registered in
``ALL_ATTENTION_FUNCTIONS`` (or through ``AttentionInterface.register``) runs once per attention layer, whatever its
name, and so do the closures it builds; an assert's message, evaluated only when the assert fails, is no read."""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from guardlint.lint import registries
from guardlint.lint.config import Settings
from guardlint.lint.runner import lint_paths

# ms-swift 4.6's sequence-parallel flash attention, reduced: registered from inside a method, reading the
# offsets it rebuilds from the position ids in a closure it calls in every layer.
SWIFT = """\
    from functools import partial

    import torch


    class SequenceParallel:
        def prepare(self):
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            def local_flash_attn(module, query, key, value, attention_mask, *args, **kwargs):
                def _attention(query, key, value, **kwargs):
                    cu_seqlens = offsets_from(kwargs["position_ids"])
                    max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max().item()
                    assert query.shape[2] > 0, f"cu_seqlens: {cu_seqlens.tolist()}"
                    return ring(query, key, value, cu_seqlens, max_seqlen)

                return _attention(query, key, value, **kwargs)

            ALL_ATTENTION_FUNCTIONS["flash_attention_2_origin"] = ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
            ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = partial(local_flash_attn, dist_attn=None)
"""


def _gl104(tmp_path: Path, source: str) -> list:
    (tmp_path / "sp.py").write_text(textwrap.dedent(source))
    report = lint_paths([str(tmp_path)], Settings(root=tmp_path))
    return sorted((f.line, f.message) for f in report.findings if f.code == "GL104")


def test_a_function_registered_in_transformers_attention_registry_runs_per_layer(tmp_path):
    found = _gl104(tmp_path, SWIFT)
    # the .item() in the closure, once; not the .tolist() of the assert's message
    assert [line for line, _ in found] == [13], found
    assert "inside local_flash_attn(), registered in ALL_ATTENTION_FUNCTIONS (line 20)" in found[0][1]


@pytest.mark.parametrize("registration", [
    "AttentionInterface.register('ring', local_flash_attn)",
    "ALL_ATTENTION_FUNCTIONS.register('ring', local_flash_attn)",
])
def test_the_registry_s_register_method_too(tmp_path, registration):
    source = SWIFT.replace(
        "ALL_ATTENTION_FUNCTIONS[\"flash_attention_2\"] = partial(local_flash_attn, dist_attn=None)",
        registration).replace("import ALL_ATTENTION_FUNCTIONS", "import ALL_ATTENTION_FUNCTIONS, AttentionInterface")
    assert [line for line, _ in _gl104(tmp_path, source)] == [13]


@pytest.mark.parametrize("change", [
    # a registry of the tree's own, not transformers'
    ("from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS", "ALL_ATTENTION_FUNCTIONS = {}"),
    # a lookup, not a registration (every transformers model does this)
    ("ALL_ATTENTION_FUNCTIONS[\"flash_attention_2\"] = partial(local_flash_attn, dist_attn=None)",
     "fn = ALL_ATTENTION_FUNCTIONS[\"flash_attention_2\"]"),
], ids=["own-registry", "lookup"])
def test_no_registration_no_per_layer_code(tmp_path, change):
    assert _gl104(tmp_path, SWIFT.replace(*change)) == []


def test_registered_names_the_defs_and_their_lines():
    tree = ast.parse(textwrap.dedent(SWIFT))
    assert registries.registered(tree) == {"local_flash_attn": ("ALL_ATTENTION_FUNCTIONS", 20)}
    assert registries.may_register(textwrap.dedent(SWIFT).encode())
    assert not registries.may_register(b"fn = ALL_ATTENTION_FUNCTIONS[impl]\n")


# The ring attention the registered function calls, through an autograd Function: ``Ring.apply(...)`` runs
# ``Ring.forward(ctx, ...)``, whose helper reads the offsets on the host.
RING = """\
    import torch


    def half_index(cu_seqlens):
        return torch.zeros((cu_seqlens[-1].item(),), dtype=torch.bool)


    class Ring(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, cu_seqlens):
            index = half_index(cu_seqlens)
            return q[index]


    def ring_attention(q, cu_seqlens):
        return Ring.apply(q, cu_seqlens)
"""


def test_a_registered_function_reaches_a_read_through_an_autograd_function(tmp_path):
    (tmp_path / "ring.py").write_text(textwrap.dedent(RING))
    source = textwrap.dedent(SWIFT).replace("import torch\n", "import torch\n\nfrom ring import ring_attention\n", 1)
    source = source.replace("return ring(query, key, value, cu_seqlens, max_seqlen)",
                            "return ring_attention(query, cu_seqlens)")
    found = _gl104(tmp_path, source)
    assert len(found) == 2, found
    assert "ring_attention(...) reads cu_seqlens" in found[1][1]
    # An .apply of a class that is no autograd Function reaches nothing.
    (tmp_path / "ring.py").write_text(textwrap.dedent(RING).replace("class Ring(torch.autograd.Function)",
                                                                    "class Ring"))
    assert len(_gl104(tmp_path, source)) == 1
