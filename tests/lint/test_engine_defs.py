"""Calls judged by the engine the file reaches (``lint/engine_defs.py``): the scanned tree's copy first, then the
installed package's (found by path, never imported), then the catalog's pinned release; the finding names it.
Backends follow the layer's construction: a constant ``qkv_backend`` or a whitelist in ``__init__``."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from guardlint.contracts import get
from guardlint.lint import build_rules, check_source, engine_defs, fixed_source

ROOT = Path(__file__).resolve().parents[2]
PINNED = ROOT / ".engines" / "sglang-0.5.23"
VISION = "sglang.srt.layers.attention.vision"

# A fork that kept an older API: VisionAttention.forward has no forward_metadata (it takes max_seqlen from
# **kwargs and passes it on), its backends ignore max_seqlen and read the lengths on the host themselves, and
# the module has neither prepare helper.
FORK_VISION = '''\
import torch.nn as nn


class VisionFlash3Attention(nn.Module):
    def forward(self, q, k, v, cu_seqlens, bsz, seq_len, **kwargs):
        seq_lens = cu_seqlens[1:] - cu_seqlens[:-1]
        max_seqlen = seq_lens.max().item()
        return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)


class VisionSdpaAttention(nn.Module):
    def forward(self, q, k, v, bsz, cu_seqlens=None, attention_mask=None, **kwargs):
        if attention_mask is None:
            attention_mask = self.generate_patch_attention_mask(cu_seqlens)
        return sdpa(q, k, v, attention_mask)

    def generate_patch_attention_mask(self, cu_seqlens):
        return tuple(cu_seqlens.cpu().tolist())


class VisionFlashInferAttention(nn.Module):
    def forward(self, q, k, v, cu_seqlens, bsz, seq_len, **kwargs):
        if "sequence_lengths" not in kwargs:
            raise RuntimeError("sequence_lengths should be prepared for vision flashinfer_cudnn attention backend")
        return cudnn(q, k, v, kwargs["sequence_lengths"], int(kwargs["max_seqlen"]))


QKV_BACKEND_IMPL = {"fa3": VisionFlash3Attention, "sdpa": VisionSdpaAttention,
                    "flashinfer_cudnn": VisionFlashInferAttention}


class VisionAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, projection_size, use_qkv_parallel, qkv_backend=None, **kwargs):
        super().__init__()
        self.qkv_backend = QKV_BACKEND_IMPL[qkv_backend or "fa3"]()

    def forward(self, x, cu_seqlens=None, position_embeddings=None, attention_mask=None, **kwargs):
        max_seqlen = kwargs["max_seqlen"] if "max_seqlen" in kwargs else None
        return self.qkv_backend.forward(q=x, k=x, v=x, bsz=1, seq_len=x.shape[0], cu_seqlens=cu_seqlens,
                                        attention_mask=attention_mask, max_seqlen=max_seqlen)
'''

HEAD = "import torch.nn as nn\nfrom sglang.srt.layers.attention.vision import VisionAttention\n"


def tree(root: Path, vision: str) -> Path:
    """``root/sglang/srt/layers/attention/vision.py`` holding ``vision``."""
    folder = root / "sglang" / "srt" / "layers" / "attention"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vision.py").write_text(vision)
    engine_defs.clear()
    return root


def model(root: Path, text: str, name: str = "m.py") -> Path:
    path = root / "sglang" / "srt" / "models" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def findings(path: Path, code: str = "GL109"):
    return [f for f in check_source(path.read_bytes(), str(path), build_rules()).findings if f.code == code]


def block(construction_args: str = "", before: str = "", params: str = "", call: str = "x, cu_seqlens=cu_seqlens"
          ) -> str:
    """A ViT block that builds VisionAttention in __init__ and calls it in forward, with its encoder's loop."""
    init = textwrap.indent(textwrap.dedent(before), " " * 8) if before else ""
    args = f"embed_dim=64, num_heads=4, projection_size=64, use_qkv_parallel=True{construction_args}"
    return HEAD + textwrap.dedent(f"""

class VisionBlock(nn.Module):
    def __init__(self{params}):
        super().__init__()
{init}        self.attn = VisionAttention({args})

    def forward(self, x, cu_seqlens, max_seqlen=None, mask=None):
        return self.attn({call})


class VisionEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([VisionBlock() for _ in range(4)])

    def forward(self, x, cu_seqlens):
        for blk in self.blocks:
            x = blk(x, cu_seqlens)
        return x
""")


# -- a fork ------------------------------------------------------------------------------------------------
def test_vision_attention_of_a_fork_without_forward_metadata_gets_no_advice_it_cannot_take(tmp_path):
    """The fork's layer takes no forward_metadata and its backends ignore max_seqlen: neither keyword spares a
    host read there, so GL109 does not fire, and --unsafe-fixes writes nothing (no import of a helper the fork
    does not define)."""
    root = tree(tmp_path / "fork", FORK_VISION)
    path = model(root, block())
    assert findings(path) == []
    text = path.read_text()
    assert fixed_source(text, str(path), unsafe_fixes=True) == text
    # The same model judged by the catalog's release (no tree, no installed engine) gets the finding.
    alone = tmp_path / "elsewhere" / "m.py"
    alone.parent.mkdir()
    alone.write_text(text)
    (found,) = findings(alone)
    assert found.message.startswith("a host read per block: VisionAttention(...) without forward_metadata or "
                                    "max_seqlen")
    assert "Judged against catalog: sglang 0.5.23." in found.note


def test_a_fork_backend_that_takes_max_seqlen_gets_that_advice_only(tmp_path):
    """A fork whose backend reads the host only when max_seqlen is absent: the finding asks for max_seqlen
    alone, and no fix passes the forward_metadata that fork's layer does not take."""
    vision = FORK_VISION.replace(
        "        max_seqlen = seq_lens.max().item()\n",
        "        max_seqlen = kwargs.get(\"max_seqlen\")\n"
        "        if max_seqlen is None:\n"
        "            max_seqlen = seq_lens.max().item()\n")
    root = tree(tmp_path, vision)
    path = model(root, block())
    (found,) = findings(path)
    assert "VisionAttention(...) without max_seqlen; no fix: VisionAttention here takes no forward_metadata" \
        in found.message
    assert f"Judged against {root / 'sglang'} (this tree)." in found.note
    assert fixed_source(path.read_text(), str(path), unsafe_fixes=True) == path.read_text()


ENGINE_BAD = get("GL101").examples_of("bad")[1].without_markers()  # a model-level VisionFlashInferAttention call


def test_the_cudnn_fix_never_imports_a_helper_the_fork_does_not_define(tmp_path):
    """The fork's VisionFlashInferAttention takes forward_metadata, but its module has no
    prepare_flashinfer_cudnn_vision_attention_metadata: GL101/GL102 stay, with no fix and the reason."""
    vision = FORK_VISION.replace("def forward(self, q, k, v, cu_seqlens, bsz, seq_len, **kwargs):\n        if \"seq",
                                 "def forward(self, q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None, "
                                 "forward_metadata=None, **kwargs):\n        if \"seq")
    root = tree(tmp_path, vision)
    path = model(root, ENGINE_BAD)
    found = findings(path, "GL101") + findings(path, "GL102")
    assert len(found) == 2 and all(f.fix is None for f in found)
    assert found[0].message.endswith("; no fix: helper not in this sglang")
    assert "does not define prepare_flashinfer_cudnn_vision_attention_metadata" in found[0].note
    fixed = fixed_source(ENGINE_BAD, str(path), unsafe_fixes=True)
    assert fixed == ENGINE_BAD and "prepare_flashinfer_cudnn" not in fixed


def test_a_cudnn_backend_without_forward_metadata_is_asked_for_what_it_reads(tmp_path):
    """The fork's VisionFlashInferAttention reads sequence_lengths and max_seqlen from **kwargs only: the line
    names those, and the fix writes no forward_metadata (nor a diff of what may be element offsets)."""
    root = tree(tmp_path, FORK_VISION)
    path = model(root, ENGINE_BAD)
    (gl101,) = findings(path, "GL101")
    assert gl101.message == ("VisionFlashInferAttention(...) without sequence_lengths; no fix: "
                             "VisionFlashInferAttention here takes no forward_metadata")
    assert "It takes" not in gl101.note
    assert fixed_source(ENGINE_BAD, str(path), unsafe_fixes=True) == ENGINE_BAD


def test_a_backend_table_without_the_cudnn_backend_cannot_reach_it(tmp_path):
    vision = FORK_VISION.replace(',\n                    "flashinfer_cudnn": VisionFlashInferAttention}', "}")
    root = tree(tmp_path / "fork", vision)
    text = textwrap.dedent("""\
        from sglang.srt.layers.attention.vision import QKV_BACKEND_IMPL


        def run(backend, q, k, v, cu_seqlens):
            return QKV_BACKEND_IMPL[backend]().forward(q, k, v, cu_seqlens, 1, 8)
        """)
    assert findings(model(root, text), "GL101") == []
    assert len(findings(model(tmp_path / "other", text), "GL101")) == 1  # the catalog's table has it


def test_positional_lora_batch_info_is_named_by_the_forks_field_order(tmp_path):
    lora = tmp_path / "sglang" / "srt" / "lora"
    lora.mkdir(parents=True)
    (lora / "utils.py").write_text(textwrap.dedent("""\
        from dataclasses import dataclass


        @dataclass
        class LoRABatchInfo:
            bs: int
            seg_lens: object
            seg_indptr: object
            max_len: int
            weight_indices: object
        """))
    engine_defs.clear()
    path = model(tmp_path, "from sglang.srt.lora.utils import LoRABatchInfo\n\n"
                           "info = LoRABatchInfo(2, lens, indptr, 7, idx)\n")
    (found,) = findings(path, "GL202")
    assert found.fix is not None
    assert "info = LoRABatchInfo(bs=2, seg_lens=lens, seg_indptr=indptr, max_len=7, weight_indices=idx)" in \
        fixed_source(path.read_text(), str(path), unsafe_fixes=True)


# -- where the source comes from ------------------------------------------------------------------------------
def installed(site: Path, version: str, vision: str) -> Path:
    folder = site / "sglang" / "srt" / "layers" / "attention"
    folder.mkdir(parents=True)
    (folder / "vision.py").write_text(vision)
    (site / f"sglang-{version}.dist-info").mkdir()
    return site


def test_the_installed_engine_is_read_by_path_and_named(tmp_path, monkeypatch):
    site = installed(tmp_path / "site", "0.5.99", FORK_VISION)
    monkeypatch.syspath_prepend(str(site))
    engine_defs.clear()
    project = tmp_path / "project"
    project.mkdir()
    path = project / "m.py"
    path.write_text(block())
    assert findings(path) == []  # the installed fork's layer takes neither keyword
    assert engine_defs.defines(VISION, "VisionAttention", str(path)) == (True, "sglang 0.5.99 (installed)")
    assert engine_defs.defines(VISION, "prepare_vision_attention_metadata", str(path))[0] is False


def test_the_scanned_tree_comes_before_the_installed_engine(tmp_path, monkeypatch):
    site = installed(tmp_path / "site", "0.5.99", FORK_VISION)
    monkeypatch.syspath_prepend(str(site))
    root = tree(tmp_path / "fork", FORK_VISION + "\n\ndef prepare_vision_attention_metadata(cu_seqlens, device):\n"
                                                 "    return None\n")
    path = model(root, block())
    assert engine_defs.defines(VISION, "prepare_vision_attention_metadata", str(path)) == \
        (True, f"{root / 'sglang'} (this tree)")


def test_no_source_is_the_catalogs_release():
    assert engine_defs.defines(VISION, "anything", "/nonexistent/m.py") == (None, "catalog: sglang 0.5.23")


def test_the_engine_package_is_never_imported(tmp_path, monkeypatch):
    """Neither the tree's nor the installed engine's code runs: their __init__ would write a marker."""
    marker = tmp_path / "ran"
    init = f"open({str(marker)!r}, 'w').close()\n"
    site = installed(tmp_path / "site", "0.5.99", FORK_VISION)
    (site / "sglang" / "__init__.py").write_text(init)
    monkeypatch.syspath_prepend(str(site))
    root = tree(tmp_path / "fork", FORK_VISION)
    (root / "sglang" / "__init__.py").write_text(init)
    for where in (model(root, block()), tmp_path / "m.py"):
        where.write_text(block())
        findings(where)
        fixed_source(where.read_text(), str(where), unsafe_fixes=True)
    assert not marker.exists() and "sglang" not in sys.modules


# -- backends -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["catalog", "pinned"])
def test_a_constant_sdpa_backend_called_with_a_mask_gets_no_finding(tmp_path, where):
    """sdpa takes neither forward_metadata nor max_seqlen (it builds its mask from the offsets, or takes the
    caller's): no advice of GL109 applies to it."""
    path = tmp_path / "m.py"
    if where == "pinned":  # a tree whose vision module is the pinned release's
        folder = tmp_path / "sglang" / "srt" / "layers" / "attention"
        folder.mkdir(parents=True)
        (folder / "vision.py").symlink_to(pinned() / "sglang" / "srt" / "layers" / "attention" / "vision.py")
    path.write_text(block(', qkv_backend="sdpa"', call="x, attention_mask=mask"))
    assert findings(path) == []
    # The same layer with a backend picked by configuration keeps its finding.
    path.write_text(block(call="x, attention_mask=mask"))
    (found,) = findings(path)
    assert (f"Judged against {tmp_path / 'sglang'} (this tree)." if where == "pinned"
            else "Judged against catalog: sglang 0.5.23.") in found.note.splitlines()


@pytest.mark.parametrize("before", [
    'if qkv_backend not in ("sdpa", "amx_attn"):\n    raise ValueError(qkv_backend)\n',
    'assert qkv_backend == "sdpa"\n',
    'assert qkv_backend in {"sdpa"}, "only sdpa is supported"\n',
])
def test_a_whitelist_in_init_decides_which_backends_a_call_reaches(tmp_path, before):
    path = tmp_path / "m.py"
    path.write_text(block(", qkv_backend=qkv_backend", before, params=', qkv_backend="sdpa"'))
    assert findings(path) == []


def test_a_local_assigned_only_constants_decides_too(tmp_path):
    before = 'if fast:\n    backend = "amx_attn"\nelse:\n    backend = "sdpa"\n'
    path = tmp_path / "m.py"
    path.write_text(block(", qkv_backend=backend", before, params=", fast=False"))
    assert findings(path) == []
    path.write_text(block(", qkv_backend=backend", before.replace('"amx_attn"', '"fa3"'), params=", fast=False"))
    assert len(findings(path)) == 1


@pytest.mark.parametrize("construction,params,before", [
    (", qkv_backend=qkv_backend", ", qkv_backend=None", ""),
    (", qkv_backend=qkv_backend", ", qkv_backend=None",
     'if qkv_backend not in ("sdpa", "fa3"):\n    raise ValueError\n'),
    (", qkv_backend=None", "", ""),
    (", qkv_backend=pick()", "", ""),
    ("", "", ""),
])
def test_a_backend_that_may_read_the_host_keeps_the_finding(tmp_path, construction, params, before):
    path = tmp_path / "m.py"
    path.write_text(block(construction, before, params))
    (found,) = findings(path)
    assert "without forward_metadata or max_seqlen" in found.message


def test_a_backend_spared_only_by_forward_metadata_is_asked_for_it_whatever_max_seqlen(tmp_path):
    """sglang 0.5.23's aiter backend reads forward_metadata but computes max_seqlen itself: a call passing
    max_seqlen still reads the host there."""
    path = tmp_path / "m.py"
    path.write_text(block(', qkv_backend="aiter_attn"', call="x, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen"))
    (found,) = findings(path)
    assert found.message == "a host read per block: VisionAttention(...) without forward_metadata"
    assert found.fix is not None and any("forward_metadata=forward_metadata" in e.content for e in found.fix.edits)
    path.write_text(block(', qkv_backend="fa3"', call="x, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen"))
    assert findings(path) == []


# -- the pinned release ---------------------------------------------------------------------------------------
def pinned() -> Path:
    if not PINNED.is_dir():
        pytest.skip("sglang 0.5.23 is fetched by `make engines` (not committed)")
    return PINNED


def test_the_pinned_tree_keeps_its_findings_and_names_itself():
    path = pinned() / "sglang" / "srt" / "models" / "siglip.py"
    found = findings(path)
    assert found and all(f.message == "a host read per block: VisionAttention(...) without forward_metadata or "
                                      "max_seqlen; no fix: cu_seqlens not passed" for f in found)
    assert all("sglang-0.5.23/sglang (this tree)." in f.note for f in found)
