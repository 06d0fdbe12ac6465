"""The catalog's picture of the engines against the pinned releases: a rename in the next release fails here.

Signatures and field orders are read from the engines' sources (``source.py``), never imported.
"""
import os

import pytest
import source
from fetch import release_dir

from guardlint.contracts import catalog

SGLANG = "sglang-0.5.23"
OLD_SGLANG = "sglang-0.5.10.post1"
VISION = catalog.VISION_MODULE
VLLM_MM_MODULE = catalog.VLLM_MM.rsplit(".", 1)[0]


def _own(params):
    return [p for p in params if p != "self" and not p.startswith("*")]


def test_lora_batch_info_fields_match_the_engine():
    assert source.dataclass_fields(SGLANG, "sglang.srt.lora.utils", "LoRABatchInfo") == list(catalog.LORA_FIELDS)


def test_lora_batch_info_older_release_is_a_prefix():
    old = source.dataclass_fields(OLD_SGLANG, "sglang.srt.lora.utils", "LoRABatchInfo")
    assert list(catalog.LORA_FIELDS[: len(old)]) == old


def test_vision_flashinfer_forward_signature():
    assert _own(source.parameters(SGLANG, VISION, "VisionFlashInferAttention.forward")) == list(catalog.VISION_PARAMS)
    old = _own(source.parameters(OLD_SGLANG, VISION, "VisionFlashInferAttention.forward"))
    assert list(catalog.VISION_PARAMS[: len(old)]) == old


def test_vision_attention_forward_signature():
    assert _own(source.parameters(SGLANG, VISION, "VisionAttention.forward")) == list(catalog.VISION_ATTENTION_PARAMS)


def test_backend_table_and_metadata_builders_exist():
    table = source.definition(SGLANG, VISION, "QKV_BACKEND_IMPL")
    keys = {k.value: v.id for k, v in zip(table.value.keys, table.value.values)}
    for key, qual in catalog.REGISTRIES[f"{VISION}.QKV_BACKEND_IMPL"].items():
        assert keys[key] == qual.rsplit(".", 1)[-1]
    fields = source.dataclass_fields(SGLANG, VISION, "VisionAttentionMetadata")
    for builder, sets in catalog.METADATA_BUILDERS.items():
        source.definition(SGLANG, VISION, builder.rsplit(".", 1)[-1])
        assert set(sets) <= set(fields)
    params = source.parameters(SGLANG, VISION, "prepare_flashinfer_cudnn_vision_attention_metadata")
    assert params == ["cu_seqlens", "device", "elem_per_token"]


def test_vision_backends_spared_by_match_the_engine():
    """``VISION_BACKENDS_SPARED_BY`` (the linter's picture where no engine source is found) is what the linter reads
    from the release's own source: per backend, the keywords of VisionAttention that spare it a host read."""
    from guardlint.lint import engine_defs

    near = str(source.module_path(SGLANG, "sglang.srt.models.siglip"))
    keys, label = engine_defs.backend_keys(f"{VISION}.QKV_BACKEND_IMPL", near)
    assert keys == set(catalog.VISION_BACKENDS_SPARED_BY) and label.endswith("(this tree)")
    for key, spared in catalog.VISION_BACKENDS_SPARED_BY.items():
        judged = engine_defs.judge(catalog.VISION_ATTENTION, "instance", ("forward_metadata", "max_seqlen"), near,
                                   frozenset({key}))
        assert judged.takes == set(spared), key
    # The older release's layer passes max_seqlen on, but none of its backends reads it instead of the host.
    old = str(source.module_path(OLD_SGLANG, "sglang.srt.models.siglip"))
    older = engine_defs.judge(catalog.VISION_ATTENTION, "instance", ("forward_metadata", "max_seqlen"), old)
    assert older.takes == set() and older.params[-1] == "attention_mask"


def test_vllm_mm_encoder_attention_signature():
    if not release_dir("vllm-0.33.0").is_dir() and not os.environ.get("GUARDLINT_ENGINE_VLLM"):
        pytest.skip("vLLM 0.33.0 is not fetched (make engines-vllm; GUARDLINT_ENGINE_VLLM=1 makes this an error)")
    for method in ("forward_native", "forward_cuda"):
        assert _own(source.parameters("vllm-0.33.0", VLLM_MM_MODULE, f"MMEncoderAttention.{method}")) == \
            list(catalog.VLLM_MM_PARAMS)


def test_vllm_reexports_are_imports_of_the_target():
    """``REEXPORTS``: each alias's package imports the target from the target's own module."""
    import ast

    if not release_dir("vllm-0.33.0").is_dir() and not os.environ.get("GUARDLINT_ENGINE_VLLM"):
        pytest.skip("vLLM 0.33.0 is not fetched (make engines-vllm; GUARDLINT_ENGINE_VLLM=1 makes this an error)")
    for alias, target in catalog.REEXPORTS.items():
        package, name = alias.rsplit(".", 1)
        init = release_dir("vllm-0.33.0").joinpath(*package.split("."), "__init__.py")
        tree = ast.parse(init.read_bytes())
        assert any(isinstance(n, ast.ImportFrom) and f"{n.module}.{name}" == target
                   and any(a.name == name and a.asname is None for a in n.names) for n in ast.walk(tree)), alias


def test_vllm_pinned_host_reads_are_the_release_s():
    """``PINNED_HOST_READS`` (what a tree scanned without vLLM is judged against): each read is on the pinned
    line, inside the named function; the method takes the catalog's parameters."""
    import ast

    if not release_dir("vllm-0.33.0").is_dir() and not os.environ.get("GUARDLINT_ENGINE_VLLM"):
        pytest.skip("vLLM 0.33.0 is not fetched (make engines-vllm; GUARDLINT_ENGINE_VLLM=1 makes this an error)")
    for target, fact in catalog.PINNED_HOST_READS.items():
        module = target.rsplit(".", 1)[0]
        cls = target.rsplit(".", 1)[1]
        params = _own(source.parameters("vllm-0.33.0", module, f"{cls}.{fact['method']}"))
        assert list(fact["params"]) == params
        assert set(fact["uses"]) | set(fact["reads"]) <= set(params)
        for param, (kind, function, path, line) in fact["reads"].items():
            text = release_dir("vllm-0.33.0").joinpath(path).read_text()
            assert f"{param}{kind}" in text.splitlines()[line - 1]
            defs = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == function]
            assert any(d.lineno <= line <= d.end_lineno for d in defs)
