"""The built-in contract catalog: every rule code guardlint knows, with its diagnosis and examples.

Codes are stable. GL1xx: varlen attention; GL2xx: segmented LoRA GEMMs; GL0xx: the linter itself and
user-declared contracts; GL3xx: the machine. Each family sits in its own module of ``rules/``, every rule beside
its bad/fixed/good examples; what the engines define, which they all read, in ``rules/engine.py``. A new kernel
costs one entry in its family and one name in ``BUILTIN`` below.
"""
from __future__ import annotations

from .model import Contract
from .rules.engine import (  # noqa: F401 - the catalog's names, read from here
    ATTENTION_REGISTRIES, CALLED_METHODS, ENGINE_LORA_INFO, ENGINE_PREPARE_CUDNN, ENGINE_PREPARE_IMPORT, HOST_SUFFIXES,
    LAYER_BACKENDS,
    LORA_FIELDS, MAX_LEN, MAX_LIVE_LEN, MAX_SEQLEN, METADATA_BUILDERS, OUR_CUDNN, OUR_LORA_INFO, PINNED,
    PINNED_HOST_READS,
    PREPARE_CUDNN, PREPARE_IMPORT, QKV_BACKENDS, REEXPORTS, REGISTRIES, SEG_LENS, SEQLEN_STEMS, SEQUENCE_LENGTHS,
    VISION_ATTENTION, VISION_ATTENTION_PARAMS, VISION_BACKENDS_SPARED_BY, VISION_FI, VISION_MODULE, VISION_PARAMS,
    VARLEN_KERNELS, VLLM_MM, VLLM_MM_PARAMS,
)
from .rules.varlen import (  # noqa: F401 - the catalog's names, read from here
    ENGINE_PREPARE_VISION, EncoderMetadataHoist, GL101, GL102, GL103, GL104, GL104_GOOD, GL105, GL106, GL107, GL108,
    GL109, HOISTED_METADATA, SGLANG_CUDNN_FIX, VLLM_CUDNN_FIX, VLLM_ENCODER_HOIST,
)
from .rules.lora import (  # noqa: F401 - the catalog's names, read from here
    GL201, GL202, GL203, GL204, GL205,
)
from .rules.machine import (  # noqa: F401 - the catalog's names, read from here
    GL000, GL001, GL002, GL301,
)
from .rules.engine_errors import (  # noqa: F401 - the catalog's names, read from here
    ENGINE_ERRORS, EngineError,
)

BUILTIN: tuple[Contract, ...] = (
    GL000, GL001, GL002, GL101, GL102, GL103, GL104, GL105, GL106, GL107, GL108, GL109, GL201, GL202, GL203, GL204,
    GL205, GL301,
)
