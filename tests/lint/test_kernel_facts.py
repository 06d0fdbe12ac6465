"""GL104 by what a known varlen kernel's call states (``kernel_facts``), not by names: the offsets handed to
flash-attn's ``flash_attn_varlen_func`` (or vLLM's fork) are read on the device, so each parameter they derive
from through torch ops that keep a tensor where it is, ``seq_len`` or any other name, is device metadata; a
0-d device tensor handed to one of the kernel's int parameters is converted on the host at every call."""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from guardlint.lint import kernel_facts
from guardlint.lint.config import Settings
from guardlint.lint.runner import lint_paths

ROOT = Path(__file__).resolve().parents[2]
VLLM_FA = ROOT / ".engines" / "vllm-0.33.0" / "vllm" / "vllm_flash_attn" / "flash_attn_interface.py"

HEADER = """\
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    {imports}


    def sdpa_fallback(q, k, v, seq_len):
        out = []
        for length in seq_len.tolist():
            out.append(length)
        return out


    class Attention(nn.Module):
        def forward(self, q, k, v, seq_len):
    """


def _gl104(tmp_path: Path, body: str, imports: str = "from flash_attn import flash_attn_varlen_func") -> list:
    source = textwrap.dedent(HEADER).format(imports=imports) + textwrap.indent(textwrap.dedent(body), " " * 8)
    (tmp_path / "model.py").write_text(source)
    report = lint_paths([str(tmp_path)], Settings(root=tmp_path))
    return sorted((f.line, f.message) for f in report.findings if f.code == "GL104")


# The MiMo audio tokenizer's attention (vllm-omni 0.30.0): lengths on the device, named seq_len.
MIMO = """\
    if torch.cuda.is_available():
        cu_len = F.pad(torch.cumsum(seq_len, dim=0), (1, 0), "constant", 0).to(torch.int32)
        max_seqlen = torch.max(seq_len).to(torch.int32).detach()
        return flash_attn_varlen_func(q, k, v, cu_len, cu_len, max_seqlen, max_seqlen, causal=True)
    return sdpa_fallback(q, k, v, seq_len)
"""


def test_a_device_max_handed_to_flash_attns_int_and_a_helper_reading_the_lengths(tmp_path):
    found = _gl104(tmp_path, MIMO)
    assert len(found) == 2, found
    (kernel_line, kernel), (helper_line, helper) = found
    assert "max_seqlen (from seq_len), a device tensor, as flash_attn_varlen_func's int max_seqlen_q" in kernel
    assert "Attention.forward" in kernel
    assert "sdpa_fallback(...) reads seq_len with .tolist()" in helper
    assert kernel_line < helper_line


def test_vllms_fork_takes_max_seqlen_before_the_offsets(tmp_path):
    # One call, read by each library's signature: the int at position 3 is vLLM's max_seqlen_q, flash-attn's
    # offsets.
    body = """\
        cu = torch.cumsum(seq_len, 0).int()
        longest = seq_len.max()
        return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest)
    """
    vllm = _gl104(tmp_path, body, "from vllm.vllm_flash_attn import flash_attn_varlen_func")
    assert len(vllm) == 1 and "cu (from seq_len), a device tensor, as flash_attn_varlen_func's int max_seqlen_q" \
        in vllm[0][1], vllm
    flash_attn = _gl104(tmp_path, body, "from flash_attn import flash_attn_varlen_func")
    assert len(flash_attn) == 1 and "longest (from seq_len), a device tensor, as flash_attn_varlen_func's int " \
        "max_seqlen_q" in flash_attn[0][1], flash_attn


@pytest.mark.parametrize("body", [
    # the maximum from host lengths: an int, no read
    """\
    cu = F.pad(torch.cumsum(seq_len, 0), (1, 0)).int()
    return flash_attn_varlen_func(q, k, v, cu, cu, max(self.host_lengths), max(self.host_lengths))
    """,
    # offsets moved to the device: the parameter may be host data, so it is no fact
    """\
    cu = torch.cumsum(seq_len, 0).to(q.device)
    longest = seq_len.max()
    sdpa_fallback(q, k, v, seq_len)
    return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest)
    """,
    # the parameter bound again before the offsets are made from it
    """\
    seq_len = torch.tensor(self.lengths)
    cu = torch.cumsum(seq_len, 0)
    sdpa_fallback(q, k, v, seq_len)
    return flash_attn_varlen_func(q, k, v, cu, cu, 8, 8)
    """,
], ids=["host-max", "offsets-moved", "rebound"])
def test_no_fact_no_finding(tmp_path, body):
    assert _gl104(tmp_path, body) == []


def test_a_function_of_that_name_the_tree_defines_is_no_kernel(tmp_path):
    # Not imported from flash-attn: what it does is the tree's, and its name proves nothing.
    imports = "def flash_attn_varlen_func(*args, **kwargs):\n    return None"
    assert _gl104(tmp_path, MIMO, imports) == []


def test_module_imports_and_try_blocks_reach_the_kernel():
    tree = ast.parse(textwrap.dedent("""\
        import flash_attn.flash_attn_interface as fai
        try:
            from flash_attn import flash_attn_varlen_func as varlen
        except ImportError:
            varlen = None
        import vllm.vllm_flash_attn
    """))
    kernels = kernel_facts.kernels_of(tree.body)
    assert kernels["varlen"][0] == "flash_attn.flash_attn_varlen_func"
    assert kernels["fai.flash_attn_varlen_func"][0] == "flash_attn.flash_attn_interface.flash_attn_varlen_func"
    assert kernels["vllm.vllm_flash_attn.flash_attn_varlen_func"][1]["ints"][0] == (3, "max_seqlen_q")


@pytest.mark.skipif(not VLLM_FA.exists(), reason="vLLM 0.33.0's source is not fetched (make test-engines)")
def test_the_catalogs_vllm_signature_is_the_releases():
    tree = ast.parse(VLLM_FA.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "flash_attn_varlen_func")
    params = [a.arg for a in fn.args.args]
    entry = kernel_facts.catalog.VARLEN_KERNELS["vllm.vllm_flash_attn.flash_attn_varlen_func"]
    for position, name in (*entry["offsets"], *entry["ints"]):
        assert params[position] == name


def test_a_file_goes_to_the_exact_reading_only_where_a_def_hands_metadata_to_an_int():
    def facts(body: str):
        source = "from flash_attn import flash_attn_varlen_func\n\n" + textwrap.dedent(body)
        return kernel_facts.file_facts(ast.parse(source), source.encode())

    # a maximum of metadata the def was given, on the device: the exact reading decides
    kernels, seeds, suspect, _ = facts("""\
        def attend(q, cu_seqlens):
            longest = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
            return flash_attn_varlen_func(q, q, q, cu_seqlens, cu_seqlens, longest, longest)
    """)
    assert kernels and suspect and seeds == {"attend": frozenset({"cu_seqlens"})}
    # maxima unpacked from a helper's result (transformers' _upad_input), or read to an int: nothing to read
    for body in ("""\
        def attend(self, q, mask):
            q, cu_seq_lens, max_seq_lens = self._upad_input(q, mask)
            max_q, max_k = max_seq_lens
            return flash_attn_varlen_func(q, q, q, cu_seq_lens[0], cu_seq_lens[1], max_q, max_k)
    """, """\
        def attend(q, cu_seqlens):
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
            return flash_attn_varlen_func(q, q, q, cu_seqlens, cu_seqlens, longest, longest)
    """):
        assert facts(body)[2] is False
    # no call of a known kernel: nothing
    assert facts("def attend(q, cu_seqlens):\n    return q\n") == (
        {"flash_attn_varlen_func": kernel_facts.kernels_of(ast.parse(
            "from flash_attn import flash_attn_varlen_func").body)["flash_attn_varlen_func"]}, {}, False, {})


# verl's patched Qwen2-VL attention (0.9.1, reduced): the helper returns the maxima beside the offsets, both from one
# device tensor, and the caller hands them to flash-attn's ints; no name and no parameter says where they live.
VERL = """\
    import torch
    import torch.nn as nn
    from flash_attn import flash_attn_varlen_func


    def prepare_fa2_from_position_ids(query, key, value, position_ids):
        position_ids = position_ids.view(-1)
        cu_seqlens = torch.cat(((position_ids == 0).nonzero().view(-1).to(torch.int32),
                                torch.tensor(position_ids.size(), device=position_ids.device, dtype=torch.int32)))
        max_length = cu_seqlens.diff().max()
        return (query, key, value, (cu_seqlens, cu_seqlens), (max_length, max_length))


    class VisionAttention(nn.Module):
        def forward(self, query_states, key_states, value_states, position_ids):
            q, k, v, (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k) = prepare_fa2_from_position_ids(
                query_states, key_states, value_states, position_ids
            )
            return flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
"""


def test_a_maximum_returned_beside_the_offsets_it_derives_from_is_on_their_device(tmp_path):
    (tmp_path / "model.py").write_text(textwrap.dedent(VERL))
    report = lint_paths([str(tmp_path)], Settings(root=tmp_path))
    found = [(f.line, f.message, f.note) for f in report.findings if f.code == "GL104"]
    assert len(found) == 1, found
    line, message, note = found[0]
    assert line == 19
    assert "max_seqlen_q (from prepare_fa2_from_position_ids()), a device tensor, as flash_attn_varlen_func's int " \
        "max_seqlen_q inside VisionAttention.forward" in message, message
    assert "beside the offsets this call hands flash_attn_varlen_func as cu_seqlens_q" in note, note


def test_a_maximum_the_helper_reads_to_an_int_or_builds_apart_is_not(tmp_path):
    for old, new in (("max_length = cu_seqlens.diff().max()", "max_length = int(cu_seqlens.diff().max().item())"),
                     ("max_length = cu_seqlens.diff().max()", "max_length = other.max()"),
                     ("(max_length, max_length))", "(max_length, max_length)) if True else None")):
        (tmp_path / "model.py").write_text(textwrap.dedent(VERL).replace(old, new).replace(
            "def prepare_fa2_from_position_ids(query, key, value, position_ids)",
            "def prepare_fa2_from_position_ids(query, key, value, position_ids, other=None)"))
        report = lint_paths([str(tmp_path)], Settings(root=tmp_path))
        # (the helper's own .item() per layer is a finding of its own, at its call; no int is a device tensor)
        assert [f for f in report.findings if "int max_seqlen" in f.message] == [], (new, report.findings)


def test_a_name_alternative_imports_bind_is_the_kernel_where_one_binds_it():
    # verl's models: flash-attn's kernel where it is installed, transformers' NPU wrapper on Ascend.
    body = ast.parse(textwrap.dedent("""\
        if is_flash_attn_2_available():
            from flash_attn import flash_attn_func, flash_attn_varlen_func
        if is_npu_available:
            from transformers.integrations.npu_flash_attention import (
                npu_flash_attn_varlen_func as flash_attn_varlen_func)
    """)).body
    found = kernel_facts.kernels_of(body)
    assert list(found) == ["flash_attn_varlen_func"] and found["flash_attn_varlen_func"][0] == \
        "flash_attn.flash_attn_varlen_func", found
    # the NPU wrapper alone is no kernel this module knows
    assert kernel_facts.kernels_of(body[1:]) == {}
