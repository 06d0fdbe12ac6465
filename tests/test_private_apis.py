"""The private torch and Triton names guardlint relies on, pinned: each exists in the installed release (or
its documented fallback works), and a private name used in the sources but missing here fails this test,
so an upgrade that drops one shows up as a named failure instead of an AttributeError on a user's call."""
from __future__ import annotations

import operator
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [p for folder in ("kernels", "guard", "integrations") for p in sorted((ROOT / folder).rglob("*.py"))]

# torch._C names: (why it is used, what happens without it). "required": used on every eager call;
# "cuda": only reached with a CUDA tensor; "fallback": read with getattr(..., None) and a public fallback.
TORCH_C = {
    "_increment_version": ("required", "an in-place LoRA launch bumps its output's version, as the op would"),
    "_len_torch_dispatch_stack": ("required", "eager LoRA calls take the custom op under a dispatch mode"),
    "_cuda_getCurrentRawStream": ("cuda", "the stream of a direct Triton launch and of eager split-K buffers"),
    "_cuda_getDevice": ("fallback", "torch.cuda.current_device"),
}


def _private_torch_names() -> set:
    names = set()
    for path in SOURCES:
        text = path.read_text(encoding="utf-8")
        names |= set(re.findall(r"torch\._C\.(_[A-Za-z0-9_]+)", text))
        names |= set(re.findall(r"getattr\(torch\._C, \"(_[A-Za-z0-9_]+)\"", text))
    return names


def test_every_private_torch_name_in_the_sources_is_pinned():
    used = _private_torch_names()
    assert used, "the scan found no private torch names: the source folders moved?"
    assert used <= set(TORCH_C), f"pin these in TORCH_C (why, and what happens without them): {used - set(TORCH_C)}"


@pytest.mark.parametrize("name", sorted(TORCH_C))
def test_pinned_torch_names_exist_or_fall_back(name):
    kind, why = TORCH_C[name]
    present = hasattr(torch._C, name)
    if kind == "required":
        assert present, f"torch {torch.__version__} has no torch._C.{name} ({why})"
    elif kind == "cuda":
        if torch.cuda.is_available():
            assert present, f"torch {torch.__version__} (CUDA) has no torch._C.{name} ({why})"
    else:
        fallback = operator.attrgetter(why.split(".", 1)[1])(torch)
        assert present or callable(fallback), f"neither torch._C.{name} nor {why}"


def test_tensor_version_counter():
    t = torch.zeros(3)
    before = t._version
    t.add_(1)
    assert t._version == before + 1


def test_direct_launch_reads_tritons_kernel_parameters():
    """kernels/_launch.py reads JITFunction.params (name, is_constexpr) and knobs.runtime's launch hooks."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from guardlint.kernels import _launch

    def body(x_ptr, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr):
        pass

    # JITFunction itself, not triton.jit: the test suite runs under TRITON_INTERPRET=1, where triton.jit
    # gives an interpreted function without the parameter list a GPU launch reads.
    kernel = JITFunction(body)
    direct = _launch.DirectLaunch(kernel, {"BLOCK": 16, "FLAG": True, "num_warps": 4}, interpret=False)
    assert direct.arity == 3 and direct.constants == (16, True)
    runtime = _launch._runtime_knobs()
    assert runtime is not None, f"triton {triton.__version__} has no triton.knobs"
    assert hasattr(runtime, "launch_enter_hook") and hasattr(runtime, "launch_exit_hook")


def test_compiled_kernel_launch_attributes():
    """A direct launch calls CompiledKernel.run(grid..., stream, function, packed_metadata, ...): the
    attributes JITFunction.run itself passes. Checked in Triton's own launch code, so that a release that
    renames them is caught here (the GPU tests check the launches themselves)."""
    import inspect

    from triton.runtime.jit import JITFunction

    source = inspect.getsource(JITFunction.run)
    for needed in ("kernel.run(", "kernel.function", "kernel.packed_metadata"):
        assert needed in source, f"triton {triton.__version__}: JITFunction.run no longer uses {needed}"


def test_triton_autotuner_attributes_the_kernels_read():
    """attention.triton reads the autotuner's ``best_config`` and ``cache``; lora.triton its
    ``configs_timings`` (with getattr defaults: a rename degrades to re-tuning, never to an error)."""
    import inspect

    from triton.runtime.autotuner import Autotuner

    source = inspect.getsource(Autotuner)
    for name in ("self.best_config", "self.configs_timings", "self.cache"):
        assert name in source, f"triton {triton.__version__}: the autotuner has no {name}"


def test_libcst_codegen_state_renders_a_node_like_the_module():
    """lint/edits.py and lint/positions.py render single nodes with libcst's internal CodegenState (a
    whole-module render per fix would be far slower): the same text as libcst's public code_for_node."""
    import libcst as cst
    from libcst._nodes.internal import CodegenState

    module = cst.parse_module("out = f(a,  b=(c),\n      **kw)  # note\n")
    call = module.body[0].body[0].value
    state = CodegenState(default_indent="    ", default_newline="\n")
    call._codegen(state)
    assert "".join(state.tokens) == module.code_for_node(call) == "f(a,  b=(c),\n      **kw)"
    # The indentation a nested node inherits is passed in, as lint/edits.py does for a call inside a block.
    nested = CodegenState(default_indent="    ", default_newline="\n", indent_tokens=["    "])
    call._codegen(nested)
    assert "".join(nested.tokens) == "f(a,  b=(c),\n          **kw)"
    # lint/chunks.py turns per-node validation off while parsing a chunk, when libcst defines it here.
    assert "__post_init__" in cst.CSTNode.__dict__ or not hasattr(cst.CSTNode, "__post_init__")
