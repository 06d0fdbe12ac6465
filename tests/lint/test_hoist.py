"""GL109's fix across functions (``lint/hoist.py``): the metadata built once where the layer loop runs and passed
down, and, where that cannot be done, the reason on the finding."""
from __future__ import annotations

import ast
import difflib
import json
import textwrap

import pytest

from guardlint.lint import build_rules, check_source, fixed_source, lint_source
from guardlint.lint.engine_defs import defines

HEAD = """\
import torch.nn as nn
from sglang.srt.layers.attention.vision import VisionAttention
"""
HELPER = "from sglang.srt.layers.attention.vision import prepare_vision_attention_metadata\n"


def src(body: str) -> str:
    return HEAD + textwrap.dedent(body)


def fix(text: str) -> str:
    return fixed_source(text, unsafe_fixes=True)


def gl109(text: str):
    return [f for f in check_source(text.encode(), "model.py", build_rules()).findings if f.code == "GL109"]


def assert_fixed_and_stable(before: str, after: str) -> None:
    """The fixed file compiles, has no GL109 left, and a second --fix changes nothing."""
    assert after != before
    compile(after, "model.py", "exec")
    assert not gl109(after)
    assert fix(after) == after


THREE_LEVELS = src("""

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = VisionAttention(embed_dim=64, num_heads=4, projection_size=64, use_qkv_parallel=True)

    def forward(self, x, cu_seqlens, rope=None):
        return self.inner(x, cu_seqlens=cu_seqlens, position_embeddings=rope)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, x, cu_seqlens, rope):
        return x + self.attn(x, cu_seqlens, rope)


class Encoder(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(depth))

    def forward(self, x, grid):
        cu_seqlens = grid.cumsum(0)
        for i, layer in enumerate(self.layers):
            x = layer(x, cu_seqlens, rope=None)
        return x
""")


def test_the_metadata_is_built_before_the_loop_and_passed_down_two_calls():
    fixed = fix(THREE_LEVELS)
    assert_fixed_and_stable(THREE_LEVELS, fixed)
    assert HELPER in fixed
    assert "        forward_metadata = prepare_vision_attention_metadata(cu_seqlens, cu_seqlens.device)\n" \
           "        for i, layer in enumerate(self.layers):\n" \
           "            x = layer(x, cu_seqlens, rope=None, forward_metadata=forward_metadata)\n" in fixed
    assert "    def forward(self, x, cu_seqlens, rope, forward_metadata=None):\n" \
           "        return x + self.attn(x, cu_seqlens, rope, forward_metadata=forward_metadata)\n" in fixed
    assert "    def forward(self, x, cu_seqlens, rope=None, forward_metadata=None):\n" \
           "        return self.inner(x, cu_seqlens=cu_seqlens, position_embeddings=rope, " \
           "forward_metadata=forward_metadata)\n" in fixed
    # Only the edited lines changed: two signatures and three calls, plus the import and the line before the loop.
    diff = list(difflib.unified_diff(THREE_LEVELS.splitlines(), fixed.splitlines(), lineterm="", n=0))
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert len(removed) == 5 and len(added) == 7
    assert all("forward_metadata" in line or "import" in line for line in added)


def test_the_fix_is_offered_as_unsafe_with_a_message_that_names_the_path():
    (f,) = gl109(THREE_LEVELS)
    assert f.fix is not None and f.fix.applicability == "unsafe"
    assert "once in Encoder.forward" in f.fix.message
    assert "Encoder.forward -> Block.forward -> Attention.forward" in f.fix.message
    assert fixed_source(THREE_LEVELS) == THREE_LEVELS  # not without --unsafe-fixes


def test_an_owner_that_takes_the_metadata_builds_it_only_when_not_given():
    text = src("""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = VisionAttention(embed_dim=64, num_heads=4, projection_size=64, use_qkv_parallel=True)

        def forward(self, x, cu_seqlens):
            return self.attn(x, cu_seqlens=cu_seqlens)


    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x, cu_seqlens, forward_metadata=None):
            for blk in self.blocks:
                x = blk(x, cu_seqlens)
            return x
    """)
    fixed = fix(text)
    assert_fixed_and_stable(text, fixed)
    assert "        if forward_metadata is None:\n" \
           "            forward_metadata = prepare_vision_attention_metadata(cu_seqlens, cu_seqlens.device)\n" \
           "        for blk in self.blocks:\n" in fixed


def test_one_argument_a_line_stays_one_argument_a_line():
    text = src("""

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = VisionAttention(embed_dim=64, num_heads=4, projection_size=64, use_qkv_parallel=True)

        def forward(
            self,
            hidden_states,
            cu_seqlens,
            **kwargs,
        ):
            return self.self_attn(
                x=hidden_states,
                cu_seqlens=cu_seqlens,
            )


    class Encoder(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.layers = nn.ModuleList([Layer() for _ in range(n)])

        def forward(self, hidden_states, cu_seqlens):
            for encoder_layer in self.layers:
                hidden_states = encoder_layer(
                    hidden_states,
                    cu_seqlens,
                )
            return hidden_states
    """)
    fixed = fix(text)
    assert_fixed_and_stable(text, fixed)
    assert "        cu_seqlens,\n        forward_metadata=None,\n        **kwargs,\n" in fixed
    assert "            cu_seqlens=cu_seqlens,\n            forward_metadata=forward_metadata,\n        )" in fixed
    assert "                cu_seqlens,\n                forward_metadata=forward_metadata,\n            )" in fixed


BLOCK = """

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = VisionAttention(embed_dim=64, num_heads=4, projection_size=64, use_qkv_parallel=True)

    def forward(self, x, cu_seqlens):
        return self.attn(x, cu_seqlens=cu_seqlens)
"""


@pytest.mark.parametrize("rest, short, why", [
    ("", "no layer loop in this file", "nothing in this file calls Block.forward"),
    ("""

class A(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block()])

    def forward(self, x, cu):
        for b in self.blocks:
            x = b(x, cu)
        return x


class B(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block()])

    def forward(self, x, cu):
        for b in self.layers:
            x = b(x, cu)
        return x
""", "no single loop owner", "Block.forward is called from A.forward and B.forward"),
    ("""

class A(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block()])

    def forward(self, x, grid):
        for b in self.blocks:
            cu = grid.cumsum(0)
            x = b(x, cu)
        return x
""", "cu_seqlens not passed down", "cu_seqlens changes inside the layer loop of A.forward"),
    ("""

class A(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block()])

    def forward(self, x, grid):
        for b in self.blocks:
            x = b(x, grid.cumsum(0))
        return x
""", "cu_seqlens not passed down", "cannot be evaluated once before the loop"),
])
def test_no_single_loop_owner_no_fix_and_the_finding_says_why(rest, short, why):
    text = src(BLOCK + textwrap.dedent(rest))
    (f,) = gl109(text)
    assert f.fix is None
    assert f.message.endswith(f"; no fix: {short}")
    assert why in f.note
    assert fix(text) == text


def test_a_layer_that_builds_cu_seqlens_itself_or_passes_none_gets_no_fix():
    computed = src("""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = VisionAttention(embed_dim=64, num_heads=4, projection_size=64, use_qkv_parallel=True)

        def forward(self, x, grid):
            cu_seqlens = grid.cumsum(0)
            return self.attn(x, cu_seqlens=cu_seqlens)


    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block()])

        def forward(self, x, grid):
            for b in self.blocks:
                x = b(x, grid)
            return x
    """)
    (f,) = gl109(computed)
    assert f.fix is None and "cu_seqlens is computed there, not passed down" in f.note
    padded = src(BLOCK.replace("cu_seqlens=cu_seqlens", "cu_seqlens=None"))
    (g,) = gl109(padded)
    assert g.fix is None and g.message.endswith("; no fix: cu_seqlens not passed")


def test_a_name_the_owner_already_uses_is_not_overwritten():
    text = src(BLOCK + textwrap.dedent("""

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block()])

        def forward(self, x, cu):
            forward_metadata = {"kind": "mine"}
            for b in self.blocks:
                x = b(x, cu)
            return x, forward_metadata
    """))
    (f,) = gl109(text)
    assert f.fix is None and "forward_metadata already names a value in Encoder.forward" in f.note


def test_the_helper_must_exist_in_the_engine_the_file_would_import(tmp_path):
    """A fork whose vision module has no prepare_vision_attention_metadata (sglang 0.5.10's has none): no fix,
    because the fixed module would not import."""
    vision = tmp_path / "sglang" / "srt" / "layers" / "attention"
    vision.mkdir(parents=True)
    (vision / "vision.py").write_text("class VisionAttention:\n    pass\n")
    model = tmp_path / "sglang" / "srt" / "models" / "m.py"
    model.parent.mkdir(parents=True)
    model.write_text(THREE_LEVELS)
    found = [f for f in check_source(model.read_bytes(), str(model), build_rules()).findings if f.code == "GL109"]
    assert found and found[0].fix is None and found[0].message.endswith("; no fix: helper not in this sglang")
    assert defines("sglang.srt.layers.attention.vision", "VisionAttention", str(model))[0] is True
    (vision / "vision.py").write_text("def prepare_vision_attention_metadata(cu_seqlens, device):\n    pass\n")
    found = [f for f in check_source(model.read_bytes(), str(model), build_rules()).findings if f.code == "GL109"]
    assert found[0].fix is not None


def test_the_fixed_catalog_example_is_what_the_linter_writes():
    from guardlint.contracts import get
    c = get("GL109")
    bad = c.examples_of("bad")[0].without_markers()
    assert fix(bad) == c.examples_of("fixed")[0].code
    assert_fixed_and_stable(bad, fix(bad))


def test_the_json_output_carries_every_edit_of_the_fix():
    found = json.loads(json.dumps([f.to_dict() for f in lint_source(THREE_LEVELS, "model.py")]))
    (d,) = [d for d in found if d["code"] == "GL109"]
    edits = d["fix"]["edits"]
    assert len(edits) == 7  # import, two parameters, three keywords, the line before the loop
    ast.parse(fix(THREE_LEVELS))


LORA_LAYERS = '''\
import torch.nn as nn
from sglang.srt.lora.utils import LoRABatchInfo


class LoRALayer(nn.Module):
    def forward(self, x, seg_indptr, weight_indices, lora_ranks, scalings):
        info = LoRABatchInfo(
            use_cuda_graph=False,
            bs=seg_indptr.numel() - 1,
            num_segments=seg_indptr.numel() - 1,
            seg_indptr=seg_indptr,
            weight_indices=weight_indices,
            lora_ranks=lora_ranks,
            scalings=scalings,
            max_len=None,
            seg_lens=None,
            permutation=None,
        )
        return self.run(x, info)


class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList([LoRALayer() for _ in range(n)])

    def forward(self, x, seg_indptr, weight_indices, lora_ranks, scalings):
        for layer in self.layers:
            x = layer(x, seg_indptr, weight_indices, lora_ranks, scalings)
        return x
'''


def test_a_lora_batch_info_built_per_layer_gets_max_len_from_the_loop_owner():
    """GL201 in a layer's forward whose seg_indptr comes from above: max_len (the host read) is computed once
    before the layer loop, from seg_indptr alone, and passed down; the None it replaces is what callers outside
    the file still get."""
    found = [f for f in check_source(LORA_LAYERS.encode(), "model.py", build_rules()).findings if f.code == "GL201"]
    assert len(found) == 1 and found[0].fix is not None and found[0].fix.applicability == "unsafe"
    fixed = fix(LORA_LAYERS)
    compile(fixed, "model.py", "exec")
    assert not [f for f in check_source(fixed.encode(), "model.py", build_rules()).findings if f.code == "GL201"]
    assert fix(fixed) == fixed
    assert "        max_len = int((seg_indptr[1:] - seg_indptr[:-1]).max())\n        for layer in self.layers:\n" \
           "            x = layer(x, seg_indptr, weight_indices, lora_ranks, scalings, max_len=max_len)\n" in fixed
    assert "    def forward(self, x, seg_indptr, weight_indices, lora_ranks, scalings, max_len=None):\n" in fixed
    assert "            max_len=max_len,\n            seg_lens=None,\n" in fixed


def test_the_hoisted_max_len_is_what_the_kernels_need():
    """Run the fixed module: the batch info each layer builds has the longest segment as max_len."""
    import torch

    ns: dict = {}
    fixed = fix(LORA_LAYERS).replace("from sglang.srt.lora.utils import LoRABatchInfo\n", "")

    class LoRABatchInfo:
        def __init__(self, **fields):
            self.__dict__.update(fields)

    seen = []

    class Runner:
        def run(self, x, info):
            seen.append(info.max_len)
            return x

    ns.update(LoRABatchInfo=LoRABatchInfo, nn=torch.nn, Runner=Runner)
    exec(compile(fixed.replace("class LoRALayer(nn.Module):", "class LoRALayer(nn.Module, Runner):"), "m", "exec"),
         ns)
    seg_indptr = torch.tensor([0, 3, 10, 12], dtype=torch.int32)
    ns["Model"](4)(torch.zeros(12), seg_indptr, None, None, None)
    assert seen == [7, 7, 7, 7]


# -- vLLM: MMEncoderAttention's own helpers, run where the layer loop runs (GL101) ------------------------------------
VLLM_HEAD = """\
import torch
import torch.nn as nn
from vllm.model_executor.layers.attention import MMEncoderAttention
"""

VLLM_ATTENTION = """

class Attention(nn.Module):
    def __init__(self, heads, head_dim):
        super().__init__()
        self.qkv = nn.Linear(heads * head_dim, 3 * heads * head_dim)
        self.attn = MMEncoderAttention(num_heads=heads, head_size=head_dim)

    def forward(self, x, cu_seqlens, max_seqlen=None):
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, 64)).unbind(-3)
        return self.attn(query=q, key=k, value=v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention(4, 64)

    def forward(self, x, cu_seqlens, max_seqlen=None):
        return x + self.attn(x, cu_seqlens, max_seqlen=max_seqlen)
"""

VLLM_TOWER = """

class Tower(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))

    def forward(self, x, grid):
        cu_seqlens = grid.cumsum(0)
        max_seqlen = None
        for blk in self.blocks:
            x = blk(x, cu_seqlens, max_seqlen=max_seqlen)
        return x
"""

VLLM_BUILT = """\
        encoder_attn = self.blocks[0].attn.attn
        with gpu_sync_allowed():
            cu_seqlens_cpu = cu_seqlens.cpu().numpy()
        sequence_lengths = MMEncoderAttention.maybe_compute_seq_lens(
            encoder_attn.attn_backend, cu_seqlens_cpu, cu_seqlens.device
        )
        if sequence_lengths is not None:
            cu_seqlens = MMEncoderAttention.maybe_recompute_cu_seqlens(
                encoder_attn.attn_backend,
                cu_seqlens_cpu,
                encoder_attn.num_heads * encoder_attn.head_size,
                1,
                cu_seqlens.device,
                fp8_padded_hidden_size=(
                    self.fp8_padded_hidden_size or encoder_attn.num_heads * encoder_attn.head_size
                ),
            )
            max_seqlen = torch.tensor(
                MMEncoderAttention.compute_max_seqlen(encoder_attn.attn_backend, cu_seqlens_cpu),
                dtype=torch.int32,
            )
        for blk in self.blocks:
            x = blk(x, cu_seqlens, max_seqlen=max_seqlen, sequence_lengths=sequence_lengths)
"""
# The FP8 width, asked of the engine where its config is set: while the model is built.
VLLM_WIDTH = """\
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.fp8_padded_hidden_size = get_fp8_padded_hidden_size(
            self.blocks[0].attn.attn.num_heads, self.blocks[0].attn.attn.head_size
        )
"""
VLLM_IMPORTS = """\
from vllm.model_executor.layers.attention import MMEncoderAttention
from vllm.model_executor.models.vision import get_fp8_padded_hidden_size
from vllm.utils.gpu_sync_debug import gpu_sync_allowed
"""


def vllm_src(attention: str = VLLM_ATTENTION, tower: str = VLLM_TOWER) -> str:
    return VLLM_HEAD + textwrap.dedent(attention) + textwrap.dedent(tower)


def gl101(text: str, path: str = "model.py"):
    return [f for f in check_source(text.encode(), path, build_rules()).findings if f.code == "GL101"]


def test_vllm_sequence_lengths_are_built_with_the_engines_helpers_before_the_loop_and_passed_down():
    text = vllm_src()
    (f,) = gl101(text)
    assert f.fix is not None and f.fix.applicability == "unsafe"
    assert f.fix.message == (
        "Build sequence_lengths once in Tower.forward, before its layer loop, with MMEncoderAttention's own helpers "
        "(where the backend reads it, also cu_seqlens and max_seqlen as it reads them; v made contiguous at the call; "
        "the FP8 width from get_fp8_padded_hidden_size in Tower.__init__; the host copy in gpu_sync_allowed()), and "
        "pass it down (Tower.forward -> Block.forward -> Attention.forward) to the call; import "
        "vllm.model_executor.models.vision.get_fp8_padded_hidden_size, vllm.utils.gpu_sync_debug.gpu_sync_allowed "
        "(a host read once per forward)")
    assert f.fix.imports == (("vllm.model_executor.models.vision", "get_fp8_padded_hidden_size"),
                             ("vllm.utils.gpu_sync_debug", "gpu_sync_allowed"))
    fixed = fix(text)
    compile(fixed, "model.py", "exec")
    assert not gl101(fixed) and fix(fixed) == fixed
    assert "        max_seqlen = None\n" + VLLM_BUILT in fixed
    assert VLLM_WIDTH in fixed and VLLM_IMPORTS in fixed
    # v is a view into the fused projection here: made contiguous for the one-stride offsets, under FlashInfer only.
    assert "        return self.attn(query=q, key=k, value=v.contiguous() if sequence_lengths is not None else v, " \
           "cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, sequence_lengths=sequence_lengths)\n" in fixed
    assert "    def forward(self, x, cu_seqlens, max_seqlen=None, sequence_lengths=None):\n" \
           "        return x + self.attn(x, cu_seqlens, max_seqlen=max_seqlen, sequence_lengths=sequence_lengths)\n" \
        in fixed
    assert fixed_source(text) == text  # not without --unsafe-fixes


def test_vllm_a_value_made_contiguous_in_the_layer_is_passed_as_it_is():
    text = vllm_src(VLLM_ATTENTION.replace(".unbind(-3)\n", ".unbind(-3)\n        v = v.contiguous()\n"))
    fixed = fix(text)
    assert not gl101(fixed)
    assert "value=v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, sequence_lengths=sequence_lengths)" in fixed
    assert "made contiguous" not in gl101(text)[0].fix.message


def test_vllm_offsets_an_owner_may_be_given_as_none_are_read_only_when_given():
    tower = VLLM_TOWER.replace("def forward(self, x, grid):\n        cu_seqlens = grid.cumsum(0)\n",
                               "def forward(self, x, cu_seqlens=None):\n")
    fixed = fix(vllm_src(tower=tower))
    assert not gl101(fixed)
    assert "        encoder_attn = self.blocks[0].attn.attn\n" \
           "        sequence_lengths = None\n" \
           "        if cu_seqlens is not None:\n" \
           "            with gpu_sync_allowed():\n" \
           "                cu_seqlens_cpu = cu_seqlens.cpu().numpy()\n" \
           "            sequence_lengths = MMEncoderAttention.maybe_compute_seq_lens(\n" in fixed


def test_vllm_a_file_that_imports_the_helpers_already_gets_no_second_import():
    text = vllm_src().replace("from vllm.model_executor.layers.attention import MMEncoderAttention\n",
                              "from vllm.model_executor.layers.attention import MMEncoderAttention\n"
                              "from vllm.utils.gpu_sync_debug import gpu_sync_allowed\n"
                              "from vllm.model_executor.models.vision import get_fp8_padded_hidden_size as width\n")
    (f,) = gl101(text)
    assert f.fix is not None and f.fix.imports == (
        ("vllm.model_executor.models.vision", "get_fp8_padded_hidden_size"),)
    fixed = fix(text)
    assert fixed.count("import gpu_sync_allowed") == 1 and "with gpu_sync_allowed():" in fixed
    compile(fixed, "model.py", "exec")


def test_vllm_a_compiled_layer_on_the_way_down_marks_the_new_tensor_of_dynamic_size():
    """vLLM's compiler marks only the inputs its decorator names as of dynamic size; sequence_lengths follows the
    number of images (as Qwen2.5-VL and Qwen3-VL name it there)."""
    attention = VLLM_ATTENTION.replace("class Block(nn.Module):", """@support_torch_compile(
    dynamic_arg_dims={
        "x": 0,
        "cu_seqlens": 0,
    },
    enable_if=should_torch_compile_mm_encoder,
)
class Block(nn.Module):""")
    text = vllm_src(attention).replace("import torch.nn as nn\n", "import torch.nn as nn\n"
                                       "from vllm.compilation.decorators import support_torch_compile\n")
    fixed = fix(text)
    assert '        "x": 0,\n        "cu_seqlens": 0,\n        "sequence_lengths": 0,\n    },\n' in fixed
    assert not gl101(fixed) and fix(fixed) == fixed
    inferred = text.replace('dynamic_arg_dims={\n        "x": 0,\n        "cu_seqlens": 0,\n    },\n', "")
    (f,) = gl101(inferred)
    assert f.fix is None and f.message.endswith("; no fix: compiled without dims")


@pytest.mark.parametrize("attention, tower, short, why", [
    (VLLM_ATTENTION, VLLM_TOWER.replace("    def forward(self, x, grid):", """\
    def prepare_encoder_metadata(self, cu):
        return {"sequence_lengths": MMEncoderAttention.maybe_compute_seq_lens(self.attn_backend, cu, "cuda")}

    def forward(self, x, grid):"""), "owner's offsets do not fit v",
     "Tower.prepare_encoder_metadata builds sequence_lengths with MMEncoderAttention's helpers"),
    (VLLM_ATTENTION.replace("MMEncoderAttention(num_heads=heads, head_size=head_dim)",
                            "MMEncoderAttention(num_heads=heads, head_size=head_dim, num_kv_heads=2)"),
     VLLM_TOWER, "grouped k/v heads", "layer has num_kv_heads=2"),
    (VLLM_ATTENTION.replace("max_seqlen=max_seqlen)\n", "max_seqlen=self.max_len)\n"), VLLM_TOWER,
     "max_seqlen not passed down", "the call passes max_seqlen as `self.max_len`, not a value passed down"),
    (VLLM_ATTENTION.replace("return x + self.attn(", "return cu_seqlens.float().mean() + self.attn("), VLLM_TOWER,
     "cu_seqlens read on the way down", "cu_seqlens is also read in Block.forward (line"),
    (VLLM_ATTENTION, VLLM_TOWER.replace("        return x\n", "        return x, cu_seqlens\n"),
     "cu_seqlens read after the loop", "cu_seqlens is read again in Tower.forward (line"),
    (VLLM_ATTENTION, VLLM_TOWER.replace("max_seqlen = None\n", "max_seqlen = None\n        encoder_attn = 0\n"),
     "name taken", "encoder_attn already names a value in Tower.forward"),
    (VLLM_ATTENTION, VLLM_TOWER.replace("        return x\n", "        for blk in self.blocks:\n"
                                        "            x = blk(x, cu_seqlens)\n        return x\n"),
     "no single loop owner", "Block.forward is called from Tower.forward (2 calls)"),
    (VLLM_ATTENTION, VLLM_TOWER.replace("x = blk(x, cu_seqlens, max_seqlen=max_seqlen)",
                                        "x = blk(x, cu_seqlens[:-1], max_seqlen=max_seqlen)"),
     "cu_seqlens not a name", "cannot be evaluated once before the loop"),
    # The FP8 width is asked for in the owner's __init__, after the layers are built there, under a name of its own.
    (VLLM_ATTENTION, VLLM_TOWER.replace("    def __init__(self, depth):\n        super().__init__()\n",
                                        "    def build(self, depth):\n"),
     "no __init__ in the owner", "Tower has no __init__ of its own, where get_fp8_padded_hidden_size must run"),
    (VLLM_ATTENTION, VLLM_TOWER.replace("        self.blocks = nn.ModuleList(Block() for _ in range(depth))\n",
                                        "        self.build(depth)\n\n    def build(self, depth):\n"
                                        "        self.blocks = nn.ModuleList(Block() for _ in range(depth))\n"),
     "layers not built in __init__", "Tower.__init__ does not build self.blocks"),
    (VLLM_ATTENTION, VLLM_TOWER.replace("        self.blocks = nn.ModuleList(Block() for _ in range(depth))\n",
                                        "        if depth:\n"
                                        "            self.blocks = nn.ModuleList(Block() for _ in range(depth))\n"),
     "layers not built in __init__", "Tower.__init__ builds self.blocks in a branch or a loop (line"),
    (VLLM_ATTENTION, VLLM_TOWER.replace("for _ in range(depth))\n", "for _ in range(depth))\n"
                                        "        self.fp8_padded_hidden_size = 0\n"),
     "name taken", "self.fp8_padded_hidden_size already names a value in Tower"),
    # The engine runs the tower inside a CUDA graph capture (vLLM's cudagraph_mm_encoder), where a host read is an
    # error: no fix, and the reason names the hook and where the metadata belongs.
    (VLLM_ATTENTION, VLLM_TOWER + """

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = Tower(4)

    def prepare_encoder_cudagraph_capture_inputs(self, budget):
        return {}

    def encoder_cudagraph_forward(self, values):
        return self.visual(values["x"], values["grid"])
""", "tower captured in a CUDA graph",
     "the tower is captured in a CUDA graph (Model.encoder_cudagraph_forward), where the host copy of the offsets is "
     "an error and a host value would be kept for every later batch: build sequence_lengths in "
     "Model.prepare_encoder_cudagraph_capture_inputs, outside the capture"),
    (VLLM_ATTENTION, VLLM_TOWER.replace("    def forward(self, x, grid):", """\
    def prepare_encoder_metadata(self, grid):
        return {"cu_seqlens": grid.cumsum(0)}

    def forward(self, x, grid):""") + """

class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList([Tower(4)])


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Wrapper()

    def run(self, values):
        head = self.inner
        return head.towers(values)

    def encoder_cudagraph_forward(self, values):
        return self.run(values)
""", "tower captured in a CUDA graph",
     "(Model.encoder_cudagraph_forward), where the host copy of the offsets is an error and a host value would be kept "
     "for every later batch: build sequence_lengths in Tower.prepare_encoder_metadata, outside the capture"),
])
def test_vllm_no_fix_where_a_fact_the_helpers_need_is_missing_and_the_finding_says_which(attention, tower, short,
                                                                                         why):
    text = vllm_src(attention, tower)
    (f,) = gl101(text)
    assert f.fix is None
    assert f.message.endswith(f"; no fix: {short}")
    assert why in f.note and "It is not built where the layer loop runs: " in f.note
    assert fix(text) == text


def test_vllm_the_helpers_and_the_layers_attributes_must_exist_in_the_engine_the_file_would_import(tmp_path):
    """A fork whose MMEncoderAttention lacks maybe_recompute_cu_seqlens, or does not keep its head size: no fix,
    because the fixed file would call what is not there."""
    engine = tmp_path / "vllm" / "model_executor" / "layers" / "attention"
    engine.mkdir(parents=True)
    helpers = """
    @classmethod
    def maybe_compute_seq_lens(cls, attn_backend, cu_seqlens, device):
        pass

    @classmethod
    def compute_max_seqlen(cls, attn_backend, cu_seqlens):
        pass

    def forward_cuda(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        pass
"""
    recompute = """
    @classmethod
    def maybe_recompute_cu_seqlens(cls, attn_backend, cu_seqlens, hidden_size, tp_size, device,
                                   fp8_padded_hidden_size=None):
        pass
"""
    init = """
    def __init__(self, num_heads, head_size):
        self.num_heads = num_heads
        self.head_size = head_size
        self.attn_backend = None
"""
    module = engine / "mm_encoder_attention.py"
    model = tmp_path / "vllm" / "model_executor" / "models" / "m.py"
    model.parent.mkdir(parents=True)
    model.write_text(vllm_src())
    for body, short in ((init + helpers, "helper not in this vllm"),
                        (init.replace("        self.head_size = head_size\n", "") + helpers + recompute,
                         "layer attribute not in this vllm"),
                        (init + helpers + recompute, "helper not in this vllm")):  # no models/vision.py there
        module.write_text("class MMEncoderAttention:\n" + body)
        (f,) = gl101(model.read_text(), str(model))
        assert f.fix is None and f.message.endswith(f"; no fix: {short}")
    assert "vllm.model_executor.models.vision as " in f.note
    assert "vllm (this tree) does not define get_fp8_padded_hidden_size" in f.note
    vision = model.parent / "vision.py"
    vision.write_text("def get_fp8_padded_hidden_size(hidden_size):\n    return None\n")
    (f,) = gl101(model.read_text(), str(model))
    assert f.fix is None and f.message.endswith("; no fix: helper differs in this vllm")
    # The release's helper: a fix. Where that engine has no gpu_sync_allowed, the host copy is written bare.
    vision.write_text("def get_fp8_padded_hidden_size(num_heads: int, head_dim: int) -> int | None:\n"
                      "    return None\n")
    (f,) = gl101(model.read_text(), str(model))
    assert f.fix is not None and f.fix.imports == (("vllm.model_executor.models.vision", "get_fp8_padded_hidden_size"),)
    fixed = fixed_source(model.read_text(), str(model), unsafe_fixes=True)
    assert "gpu_sync_allowed" not in fixed and "        cu_seqlens_cpu = cu_seqlens.cpu().numpy()\n" in fixed
    sync = tmp_path / "vllm" / "utils" / "gpu_sync_debug.py"
    sync.parent.mkdir()
    sync.write_text("def gpu_sync_allowed(first_only: bool = False):\n    pass\n")
    fixed = fixed_source(model.read_text(), str(model), unsafe_fixes=True)
    assert "        with gpu_sync_allowed():\n            cu_seqlens_cpu = cu_seqlens.cpu().numpy()\n" in fixed
    assert "from vllm.utils.gpu_sync_debug import gpu_sync_allowed\n" in fixed


def test_vllm_a_tower_a_neighbouring_file_captures_in_a_cuda_graph_gets_no_fix(tmp_path):
    """lfm2_vl.py captures lfm2_siglip2.py's encoder: the capture hook is in the file that imports the tower's."""
    models = tmp_path / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    tower = models / "tower_siglip.py"
    tower.write_text(vllm_src() + textwrap.dedent("""

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.vision_model = Tower(4)
    """))
    (f,) = gl101(tower.read_text(), str(tower))
    assert f.fix is not None
    hook = textwrap.dedent("""\
        import torch.nn as nn
        from .tower_siglip import Model as VisionModel


        class ForConditionalGeneration(nn.Module):
            def __init__(self):
                super().__init__()
                self.vision_tower = VisionModel()

            def prepare_encoder_cudagraph_capture_inputs(self, budget):
                return {}

            def encoder_cudagraph_forward(self, values):
                embeddings = self.vision_tower.vision_model
                return embeddings(values["x"], values["grid"])
    """)
    other = models / "tower_vl.py"
    other.write_text(hook.replace("encoder_cudagraph_forward", "encoder_eager_forward"))
    (f,) = gl101(tower.read_text(), str(tower))
    assert f.fix is not None  # no capture hook there
    other.write_text(hook.replace("from .tower_siglip import", "from .other_module import"))
    (f,) = gl101(tower.read_text(), str(tower))
    assert f.fix is not None  # a hook, but it does not import this file's classes
    other.write_text(hook)
    (f,) = gl101(tower.read_text(), str(tower))
    assert f.fix is None and f.message.endswith("; no fix: tower captured in a CUDA graph")
    assert "(ForConditionalGeneration.encoder_cudagraph_forward in tower_vl.py)" in f.note
    assert "build sequence_lengths in ForConditionalGeneration.prepare_encoder_cudagraph_capture_inputs in " \
           "tower_vl.py, outside the capture" in f.note
