"""``guardlint.integrations.sglang.install()`` wraps sglang's real classes in place, and ``uninstall()``
restores them. The engine's modules are built from the pinned release's own definitions (only the GPU
kernels faked) and placed in ``sys.modules`` under their real names, as an engine process has them."""
from __future__ import annotations

import sys
import types

import pytest
import torch
import triton

import guardlint.integrations.sglang as gl_sglang
from guardlint.guard import clear_cache
from test_sglang_lora import LENGTHS, batch, inputs, reference, sgemm_a, utils
from test_sglang_vision import NEW, engine, inputs as vit_inputs, reference as vit_reference


@pytest.fixture
def sglang_modules(monkeypatch):
    vision = engine(NEW)
    lora = sgemm_a()
    mods = {}
    for name, ns in (("sglang.srt.layers.attention.vision", vision),
                     ("sglang.srt.lora.backend.triton_backend", lora)):
        mod = types.ModuleType(name)
        mod.__dict__.update({k: v for k, v in ns.items() if not k.startswith("__")})
        mods[name] = mod
    for parent in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention", "sglang.srt.lora",
                   "sglang.srt.lora.backend"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    clear_cache()
    yield mods, vision, lora
    gl_sglang.uninstall()
    clear_cache()


def test_install_wraps_the_vision_backend_and_lora_launchers(sglang_modules):
    mods, vision, lora = sglang_modules
    cls = mods["sglang.srt.layers.attention.vision"].VisionFlashInferAttention
    original_forward = cls.forward
    original_launch = mods["sglang.srt.lora.backend.triton_backend"].sgemm_lora_a_fwd
    wrapped = gl_sglang.install()
    assert wrapped == ["sglang.srt.layers.attention.vision.VisionFlashInferAttention.forward",
                       "sglang.srt.lora.backend.triton_backend.sgemm_lora_a_fwd"]
    assert gl_sglang.install() == wrapped  # idempotent

    q, k, v, cu = vit_inputs()
    out = cls().forward(q, k, v, cu, 3, 11)  # the engine's own call shape, no metadata
    torch.testing.assert_close(out, vit_reference(q, k, v, cu))
    assert vision["kernel"].last[1]["actual_seq_lens_q"].view(-1).tolist()[:3] == [5, 11, 3]

    x, w = inputs()
    got = mods["sglang.srt.lora.backend.triton_backend"].sgemm_lora_a_fwd(x, w, batch(utils()["LoRABatchInfo"]))
    grid = lora["_sgemm_lora_a_kernel"].last[1]["_grid"]
    assert grid == (triton.cdiv(max(LENGTHS), 16), len(LENGTHS))
    torch.testing.assert_close(got[:5, :4], reference(x, w)[:5, :4])

    gl_sglang.uninstall()
    assert cls.forward is original_forward
    assert mods["sglang.srt.lora.backend.triton_backend"].sgemm_lora_a_fwd is original_launch
    with pytest.raises(RuntimeError, match="sequence_lengths should be prepared"):
        cls().forward(q, k, v, cu, 3, 11)


def test_importing_the_integration_imports_no_engine():
    import subprocess
    code = ("import sys, guardlint.integrations.sglang, guardlint.integrations.vllm; "
            "print(any(m.split('.')[0] in ('sglang', 'vllm') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
