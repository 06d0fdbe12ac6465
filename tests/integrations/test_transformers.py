"""transformers integration: tiny random Qwen2.5-VL / Qwen2-VL models give sdpa's outputs with guardlint_flash.

Vision towers, image+text forwards, greedy generation (KV-cache decode), left-padded batches, packed text
with cu_seq_lens, training gradients, refusals, and the once-per-forward metadata contract. fp32; the Triton
kernel runs through the interpreter (tests/integrations/conftest.py).
"""
import subprocess
import sys

import pytest
import torch

import guardlint.guard as guard
import guardlint.kernels
from guardlint.guard import GuardError
from guardlint.integrations import transformers as gl_transformers

# A hard dependency of the test extra: without it these tests fail, they do not skip.
import transformers
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

NAME = gl_transformers.register("guardlint_flash_triton", backend="triton")
AUTO = gl_transformers.register()  # "guardlint_flash", backend auto (sdpa on the CPU, with a backward)
IMAGE, VIDEO, START, END = 120, 121, 119, 118
GRID = torch.tensor([[1, 4, 8], [1, 4, 4]])  # 32 + 16 patches of 2x2 pixels, 2 frames each
TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            vocab_size=128, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4})
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _qwen2_5_vl(text_layers=2):
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config={**TEXT, "num_hidden_layers": text_layers},
        # head dim 16; windows of 2x2 merged tokens (16 patches); block 1 attends whole images
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           window_size=8, fullatt_block_indexes=[1], patch_size=2, spatial_merge_size=2,
                           temporal_patch_size=2),
        **TOKENS)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _qwen2_vl():
    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=TEXT,
        vision_config=dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2),
        **TOKENS)
    return Qwen2VLForConditionalGeneration(config).eval()


def _image_inputs(grid=GRID):
    torch.manual_seed(1)
    patches = int(grid.prod(-1).sum())
    pixel_values = torch.randn(patches, 3 * 2 * 2 * 2)
    parts = [torch.tensor([1])]
    for t, h, w in grid.tolist():  # one run of image tokens per image (2x2 patches merge into one token)
        parts += [torch.tensor([START]), torch.full((t * h * w // 4,), IMAGE), torch.tensor([END])]
    ids = torch.cat(parts + [torch.tensor([5, 6, 7])])[None]
    return ids, pixel_values, grid, (ids == IMAGE).int()  # mm_token_type_ids: image 1, text 0


@pytest.fixture
def varlen_calls(monkeypatch):
    """Counts varlen_attention calls (the integration resolves it from guardlint.kernels at call time)."""
    calls = []
    real = guardlint.kernels.varlen_attention

    def counted(q, k, v, cu_seqlens, **kwargs):
        calls.append((tuple(q.shape), cu_seqlens.shape[0] - 1, kwargs.get("causal"), kwargs.get("backend")))
        return real(q, k, v, cu_seqlens, **kwargs)

    monkeypatch.setattr(guardlint.kernels, "varlen_attention", counted)
    return calls


def _close(a, b, atol=2e-5):
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=1e-4)


def _run(model, impl, fn):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return fn(model)


# -- registration -------------------------------------------------------------------------------------

def test_transformers_import_is_lazy():
    code = ("import sys, guardlint, guardlint.integrations, guardlint.kernels, guardlint.guard\n"
            "assert 'transformers' not in sys.modules, 'transformers imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_transformers_register_names_every_sub_model():
    model = _qwen2_5_vl()
    model.set_attn_implementation(NAME)
    for config in (model.config, model.model.visual.config, model.model.language_model.config):
        assert config._attn_implementation == NAME
    assert transformers.AttentionInterface()[NAME] is gl_transformers.attention_forward


def test_transformers_register_from_pretrained(tmp_path):
    _qwen2_5_vl().save_pretrained(tmp_path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, attn_implementation=NAME)
    assert model.model.visual.config._attn_implementation == NAME


@pytest.mark.parametrize("name", ["guardlint", "org/flash", "flash:x", None])
def test_transformers_register_refuses_bad_names(name):
    with pytest.raises(GuardError) as error:
        gl_transformers.register(name)
    assert error.value.code == "GL106"


# -- vision towers: one packed call per layer -----------------------------------------------------------

def test_transformers_qwen2_5_vl_vision_tower(varlen_calls):
    model = _qwen2_5_vl()
    _, pixel_values, grid, _ = _image_inputs()
    reference = _run(model, "sdpa", lambda m: m.model.visual(pixel_values, grid_thw=grid).pooler_output)
    out = _run(model, NAME, lambda m: m.model.visual(pixel_values, grid_thw=grid).pooler_output)
    _close(out, reference)
    # depth 2: a windowed block (2 + 1 windows) and a full block (2 images), each one call on all 48 tokens
    assert [(c[0], c[1]) for c in varlen_calls] == [((48, 2, 16), 3), ((48, 2, 16), 2)]
    assert all(c[2] is False and c[3] == "triton" for c in varlen_calls)


def test_transformers_qwen2_vl_vision_tower(varlen_calls):
    model = _qwen2_vl()
    _, pixel_values, grid, _ = _image_inputs()
    reference = _run(model, "sdpa", lambda m: m.model.visual(pixel_values, grid_thw=grid).pooler_output)
    out = _run(model, NAME, lambda m: m.model.visual(pixel_values, grid_thw=grid).pooler_output)
    _close(out, reference)
    assert [(c[0], c[1]) for c in varlen_calls] == [((48, 2, 16), 2)] * 2


# -- whole models: image + text forward and generation ------------------------------------------------

@pytest.mark.parametrize("make", [_qwen2_5_vl, _qwen2_vl], ids=["qwen2.5-vl", "qwen2-vl"])
def test_transformers_image_forward_and_generate(make, varlen_calls):
    model = make()
    ids, pixel_values, grid, types = _image_inputs()
    inputs = dict(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid, mm_token_type_ids=types)

    def forward_and_generate(m):
        logits = m(**inputs).logits
        tokens = m.generate(**inputs, max_new_tokens=4, do_sample=False)
        return logits, tokens

    logits_ref, tokens_ref = _run(model, "sdpa", forward_and_generate)
    logits, tokens = _run(model, NAME, forward_and_generate)
    _close(logits, logits_ref)
    assert torch.equal(tokens, tokens_ref)
    # the prefill of the text model (causal, no padding) ran on the kernel too
    assert any(c[2] is True and c[0][0] == ids.shape[1] for c in varlen_calls)


def test_transformers_left_padded_batch(varlen_calls):
    model = _qwen2_5_vl()
    torch.manual_seed(2)
    ids = torch.randint(3, 100, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)

    def forward_and_generate(m):
        logits = m(input_ids=ids, attention_mask=mask).logits
        tokens = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        return logits, tokens

    logits_ref, tokens_ref = _run(model, "sdpa", forward_and_generate)
    logits, tokens = _run(model, NAME, forward_and_generate)
    keep = mask.bool()
    _close(logits[keep], logits_ref[keep])
    assert torch.equal(tokens, tokens_ref)
    # the padded prefill ran unpadded on the kernel: 22 real tokens in 3 sequences
    assert ((22, 4, 16), 3, True, "triton") in varlen_calls


def test_transformers_packed_text_derives_max_once_per_forward(varlen_calls):
    model = _qwen2_5_vl(text_layers=4)
    model.set_attn_implementation(NAME)
    torch.manual_seed(3)
    docs = [torch.randint(3, 100, (n,)) for n in (5, 9, 3)]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    guard.reset_stats()
    with torch.no_grad():
        packed = model(input_ids=torch.cat(docs)[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu, use_cache=False).logits
    stats = guard.stats()
    assert len(varlen_calls) == 4 and all(c[1] == 3 for c in varlen_calls)
    assert stats["host_reads"] == 1 and stats["derivations"]["max_of_diff"] == 4
    with torch.no_grad():
        # RoPE depends on relative positions only, so each document alone gives the same logits.
        alone = torch.cat([model(input_ids=d[None], use_cache=False).logits for d in docs], dim=1)
    _close(packed, alone, atol=5e-5)


def test_transformers_training_gradients_match_sdpa():
    model = _qwen2_5_vl().train()
    ids, pixel_values, grid, types = _image_inputs()
    grads = {}
    for impl in ("sdpa", AUTO):
        model.set_attn_implementation(impl)
        model.zero_grad()
        loss = model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid, mm_token_type_ids=types,
                     labels=ids).loss
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["sdpa"].keys() == grads[AUTO].keys()
    for name, grad in grads["sdpa"].items():
        _close(grads[AUTO][name], grad, atol=1e-4)


def test_transformers_trains_on_the_triton_backward():
    """A few optimizer steps of the tiny Qwen2.5-VL (vision tower and text model) with backend="triton": the
    Triton backward (through the interpreter here) gives sdpa's losses step after step."""
    losses = {}
    ids, pixel_values, grid, types = _image_inputs()
    for impl in ("sdpa", NAME):
        model = _qwen2_5_vl().train()
        model.set_attn_implementation(impl)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[impl] = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid, mm_token_type_ids=types,
                         labels=ids).loss
            loss.backward()
            optimizer.step()
            losses[impl].append(loss.item())
    assert losses["sdpa"][-1] < losses["sdpa"][0]  # the steps train
    torch.testing.assert_close(torch.tensor(losses[NAME]), torch.tensor(losses["sdpa"]), rtol=1e-4, atol=1e-5)


# -- refusals ---------------------------------------------------------------------------------------

class _Attention(torch.nn.Module):
    is_causal = True

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"_attn_implementation": NAME})()


@pytest.mark.parametrize("kwargs, argument", [
    ({"dropout": 0.1}, "dropout"),
    ({"softcap": 30.0}, "softcap"),
    ({"sliding_window": 4}, "sliding_window"),
    ({"s_aux": torch.zeros(4)}, "s_aux"),
    ({"block_table": torch.zeros(1, 1, dtype=torch.int32)}, "block_table"),
    ({"cu_seq_lens_q": torch.tensor([0, 4, 8]), "cu_seq_lens_k": torch.tensor([0, 2, 8])}, "cu_seq_lens_k"),
])
def test_transformers_refuses_what_it_cannot_do(kwargs, argument):
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(GuardError) as error:
        gl_transformers.attention_forward(_Attention(), q, k, v, None, **kwargs)
    assert error.value.code == "GL106" and error.value.argument == argument


def test_transformers_decode_with_padding_matches_sdpa():
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    padding = torch.ones(2, 7, dtype=torch.bool)
    padding[1, :3] = False
    out, _ = gl_transformers.attention_forward(_Attention(), q, k, v, padding, scaling=0.25)
    allowed = (torch.arange(7)[None] <= torch.arange(3)[:, None] + 4)[None, None] & padding[:, None, None]
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=allowed, scale=0.25)
    _close(out, reference.transpose(1, 2))


def test_transformers_static_cache_generate_matches_sdpa():
    model = _qwen2_5_vl()
    torch.manual_seed(5)
    ids = torch.randint(3, 100, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0

    def generate(m):
        return m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                          cache_implementation="static")

    assert torch.equal(_run(model, NAME, generate), _run(model, "sdpa", generate))


def test_transformers_4d_mask_runs_sdpa_with_it():
    torch.manual_seed(6)
    q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    blocks = torch.tensor([0, 0, 0, 1, 1, 1])  # two packed documents, causal in each
    allowed = ((blocks[:, None] == blocks[None]) & torch.ones(6, 6, dtype=torch.bool).tril())[None, None]
    out, _ = gl_transformers.attention_forward(_Attention(), q, k, v, allowed)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=allowed)
    _close(out, reference.transpose(1, 2))
