"""Varlen (packed) attention: ``varlen_attention`` over several backends and ``cudnn_vision_attention``.

The public API lives in ``api`` and is re-exported here. Beside it: ``triton`` and ``gluon`` (our kernels),
``flashinfer`` (FlashInfer's), ``reference`` (the torch paths and the float64 reference) and ``dispatch``
(``backend="auto"``'s table, ``attention_dispatch.json``).
"""
from __future__ import annotations

from .api import BACKENDS, cudnn_vision_attention, select_backend, varlen_attention
# public too, outside __all__ as before: the backends, dtypes and head dims checked, and the custom ops
from .api import AUTOGRAD as AUTOGRAD, CONCRETE as CONCRETE, DTYPES as DTYPES, MAX_HEAD_DIM as MAX_HEAD_DIM
from .api import varlen_attention_gluon_op as varlen_attention_gluon_op
from .api import varlen_attention_triton_op as varlen_attention_triton_op

__all__ = ["BACKENDS", "cudnn_vision_attention", "select_backend", "varlen_attention"]
