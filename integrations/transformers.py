"""Hugging Face transformers: ``attn_implementation="guardlint_flash"`` runs a whole model on ``varlen_attention``.

``register()`` adds one function to transformers' ``AttentionInterface`` and one to its mask interface. The name
contains "flash", so vision towers (Qwen2-VL, Qwen2.5-VL, GLM-4V) pass ``cu_seq_lens_q``/``max_length_q`` and
run one packed call per layer instead of a Python loop over images and windows. Text-model calls take the
kernel where it is exact (no mask, or a padding mask with queries aligned to the keys) and torch SDPA with
the mask everywhere else (decode with a KV cache, static caches, packed or sliding-window masks).
transformers is imported only inside ``register()``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from guardlint.guard import GuardError, describe, prepare_varlen_metadata
from guardlint.guard._cache import MISS, IdentityCache
from guardlint.guard._state import note_read

__all__ = ["DEFAULT_NAME", "attention_forward", "register", "unregister"]

DEFAULT_NAME = "guardlint_flash"
FUNCTION = "guardlint.integrations.transformers"

# name -> varlen_attention backend, for every name register() installed.
_registered: dict = {}


# -- registration -------------------------------------------------------------------------------------

def register(name: str = DEFAULT_NAME, *, backend: str = "auto") -> str:
    """Register guardlint's attention with transformers under ``name`` and return the name.

    Then ``from_pretrained(..., attn_implementation=name)`` or ``model.set_attn_implementation(name)``
    runs every attention layer of the model through this module. ``name`` must contain "flash" (that is how
    transformers' vision towers decide to pass packed ``cu_seq_lens`` instead of looping over images).
    ``backend`` is handed to ``varlen_attention``: ``"auto"`` also serves training (inputs that need gradients
    get a backend with a backward); an explicit backend without one raises a coded ``GuardError``.
    """
    if not isinstance(name, str) or "flash" not in name or "/" in name or ":" in name:
        raise GuardError("GL106", argument="name", function="register", got=describe(name),
                         expected='a name containing "flash" and no "/" or ":" (e.g. "guardlint_flash")',
                         detail="transformers passes packed cu_seq_lens only to implementations named *flash*; "
                                "names with '/' or ':' are read as Hub kernel repositories.")
    from guardlint.kernels.attention import BACKENDS
    if backend not in BACKENDS:
        raise GuardError("GL106", argument="backend", function="register", got=describe(backend),
                         expected=" / ".join(repr(b) for b in BACKENDS))
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:  # the optional extra is missing
        raise ImportError("guardlint.integrations.transformers needs transformers: "
                          "pip install 'guardlint[transformers]'") from error
    _registered[name] = backend
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    _skip_flash_preload()
    return name


def unregister(name: str = DEFAULT_NAME) -> None:
    """Remove ``name`` from transformers' interfaces (models already set to it fail on their next call)."""
    if _registered.pop(name, None) is None:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)


def _skip_flash_preload() -> None:
    """transformers 5.x preloads any implementation named *flash* as a flash-attn package or a Hub kernel and
    fails for a registered function; the preload is skipped for the names registered here (it loads
    functions this module never calls)."""
    import transformers.modeling_utils as modeling_utils
    original = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if original is None or getattr(original, "_guardlint", False):
        return

    def lazy_import_flash_attention(implementation, *args, **kwargs):
        if implementation in _registered:
            return (None, None, None, None, None), (dict, dict)
        return original(implementation, *args, **kwargs)

    patched: Any = lazy_import_flash_attention  # marked with attributes of its own
    patched._guardlint = True
    patched.__wrapped__ = original
    modeling_utils.lazy_import_flash_attention = patched


# -- masks ------------------------------------------------------------------------------------------

def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
                   mask_function: Any = None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """The mask interface: flash's 2-D padding mask (or None) where the pattern is plain causal or
    bidirectional with the queries at the end of the keys; otherwise SDPA's 4-D boolean mask, never skipped
    (a skipped mask would mean top-left causal, which only SDPA's ``is_causal`` knows)."""
    from transformers import masking_utils as mu
    plain = mask_function is None or mask_function is mu.causal_mask_function \
        or mask_function is mu.bidirectional_mask_function
    aligned = (type(q_offset) is int and type(kv_offset) is int and q_offset + q_length == kv_offset + kv_length
               and (attention_mask is None or attention_mask.shape[-1] >= kv_length))
    if plain and aligned:
        return mu.flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                                       attention_mask=attention_mask)
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    return mu.sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                        mask_function=mask_function if mask_function is not None else mu.causal_mask_function,
                        attention_mask=attention_mask, allow_is_causal_skip=False,
                        allow_is_bidirectional_skip=False, **kwargs)


# -- the attention function -------------------------------------------------------------------------

def _refuse(argument: str, expected: str, got: str, detail: str = "") -> GuardError:
    return GuardError("GL106", argument=argument, expected=expected, got=got, function=FUNCTION, detail=detail,
                      fix='load the model with attn_implementation="sdpa" (or "eager") for this feature')


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, **kwargs) -> tuple:
    """transformers' attention interface: q ``(B, H, Sq, D)``, k/v ``(B, Hkv, Sk, D)``; returns
    ``((B, Sq, H, D), None)``.

    Paths: ``cu_seq_lens_q`` -> ``varlen_attention`` (max derived once per forward when missing); a 4-D
    mask -> torch SDPA with it; a 2-D padding mask with Sq == Sk -> unpadded, ``varlen_attention``, padded
    back (padding rows are zeros); no mask with Sq == Sk -> ``varlen_attention`` on equal lengths; Sq != Sk
    (decode) -> SDPA with bottom-right causal and padding masks. Refused (GL106): dropout, softcap,
    attention sinks, paged caches, a sliding window without a mask, different q and k offsets.
    """
    if dropout:
        raise _refuse("dropout", "0.0 (the kernels have no attention dropout)", repr(dropout))
    if softcap is not None:
        raise _refuse("softcap", "None", repr(softcap))
    if kwargs.get("s_aux") is not None:
        raise _refuse("s_aux", "None (no attention sinks)", describe(kwargs["s_aux"]))
    if kwargs.get("block_table") is not None:
        raise _refuse("block_table", "None (no paged KV cache)", describe(kwargs["block_table"]),
                      "Continuous batching needs a paged kernel.")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    mask = attention_mask
    if mask is not None and mask.dim() == 2 and mask.shape[-1] < k_len:
        # A static cache: keys past the mask are empty slots.
        key, value, k_len = key[:, :, :mask.shape[-1]], value[:, :, :mask.shape[-1]], mask.shape[-1]
    if sliding_window is not None and (mask is None or mask.dim() == 2) and 0 < sliding_window < k_len:
        raise _refuse("sliding_window", f"None or >= the {k_len} keys (the mask carries windows)",
                      repr(sliding_window), "No sliding-window mask reached the attention.")
    implementation = None
    if hasattr(module, "config"):
        config: Any = module.config  # the model's PretrainedConfig (nn.Module's __getattr__ types it as a tensor)
        implementation = config._attn_implementation
    backend = _registered.get(implementation, "auto")

    cu_q = kwargs.get("cu_seq_lens_q")
    if mask is None and cu_q is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and cu_k is not cu_q and not _same_offsets(cu_q, cu_k):
            raise _refuse("cu_seq_lens_k", "cu_seq_lens_q's offsets (varlen_attention takes one set)",
                          describe(cu_k))
        out = _varlen(query, key, value, cu_q, kwargs.get("max_length_q"), scaling, causal, backend, planned=True)
        return out.view(batch, q_len, heads, head_dim), None
    if mask is not None and mask.dim() != 2:
        return _sdpa(query, key, value, mask, scaling, False), None
    if q_len != k_len:
        bias = _decode_mask(mask, q_len, k_len, causal, query.device)
        return _sdpa(query, key, value, bias, scaling, False), None
    if mask is None:
        cu = _uniform_offsets(batch, q_len, query.device)
        out = _varlen(query, key, value, cu, q_len, scaling, causal, backend)
        return out.view(batch, q_len, heads, head_dim), None
    index, meta = _unpad_plan(mask, query)
    q, k, v = (x.transpose(1, 2).reshape(batch * q_len, x.shape[1], head_dim) for x in (query, key, value))
    from guardlint.kernels import varlen_attention
    packed = varlen_attention(q.index_select(0, index), k.index_select(0, index), v.index_select(0, index),
                              meta.cu_seqlens, max_seqlen=meta.max_seqlen, metadata=meta, softmax_scale=scaling,
                              causal=causal, backend=backend)
    out = packed.new_zeros(batch * q_len, heads, head_dim).index_copy(0, index, packed)
    return out.view(batch, q_len, heads, head_dim), None


def _varlen(query, key, value, cu_seqlens, max_seqlen, scaling, causal, backend, planned=False):
    """``varlen_attention`` on (B, H, S, D) inputs. ``planned``: the model's own packed offsets and max
    (``cu_seq_lens_q``/``max_length_q``): the guard reads the offsets once per forward to derive the lengths and
    checks an int ``max_length_q`` against them (a short one is GL103, named as the model passed it); a tensor
    one is not read (the derived max is used)."""
    from guardlint.kernels import varlen_attention
    q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (query, key, value))
    if type(max_seqlen) is not int:
        max_seqlen = None
    try:
        return varlen_attention(q, k, v, cu_seqlens, max_seqlen=max_seqlen, softmax_scale=scaling, causal=causal,
                                backend=backend)
    except GuardError as error:
        if not planned or max_seqlen is None or error.argument != "max_seqlen":
            raise
        raise GuardError(error.code, argument="max_length_q", function=FUNCTION, expected=error.expected,
                         got=error.got.replace("max_seqlen=", "max_length_q="), detail=error.detail,
                         fix="Pass the longest length of cu_seq_lens_q as max_length_q, or leave it out.") from None


def _sdpa(query, key, value, mask, scaling, causal):
    """torch SDPA on (B, H, S, D) with kv heads repeated for GQA; returns (B, Sq, H, D)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal,
                                                           scale=scaling)
    return out.transpose(1, 2)


def _decode_mask(padding: Optional[torch.Tensor], q_len: int, k_len: int, causal: bool, device) -> Any:
    """Boolean (B or 1, 1, Sq, Sk): queries are the last Sq positions of the keys; rows with no key left
    (padding queries) attend everything, as SDPA's masks do, so no NaN reaches later layers."""
    allowed = None
    if causal and q_len > 1:
        rows = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
        allowed = (torch.arange(k_len, device=device)[None, :] <= rows)[None, None]
    if padding is not None:
        keys = padding[:, None, None, :].to(device=device, dtype=torch.bool)
        allowed = keys if allowed is None else allowed & keys
    if allowed is None:
        return None
    return allowed | ~allowed.any(dim=-1, keepdim=True)


# -- cached plans -----------------------------------------------------------------------------------

_uniform: dict = {}
_unpad = IdentityCache(8)
_equal = IdentityCache(8)


def _keyed(cache: IdentityCache, tensors: tuple, build):
    """``build()`` once per state of ``tensors`` (per object: an entry dies with them; a host mask is compared by
    contents, a device one by version and storage, see guard/_cache.py): one plan per forward, shared by every
    layer."""
    value = cache.get(tensors)
    if value is MISS:
        value = build()
        cache.put(tensors, None, value)
    return value


def _same_offsets(a: torch.Tensor, b: torch.Tensor) -> bool:
    def read():
        note_read(a)
        return a.shape == b.shape and bool(torch.equal(a, b.to(a.device)))
    return _keyed(_equal, (a, b), read)


def _uniform_offsets(batch: int, length: int, device) -> torch.Tensor:
    key = (batch, length, device)
    cu = _uniform.get(key)
    if cu is None:
        if len(_uniform) >= 32:
            _uniform.clear()
        cu = _uniform[key] = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)
    return cu


def _unpad_plan(mask: torch.Tensor, query: torch.Tensor) -> tuple:
    """Kept-token indices and varlen metadata of a 2-D padding mask: one host read per mask, not per layer."""
    def build():
        keep = mask.to(torch.bool)
        note_read(keep)
        lengths = keep.sum(dim=-1).tolist()
        total = sum(lengths)
        flat = keep.reshape(-1)
        index = (torch.nonzero_static(flat, size=total) if hasattr(torch, "nonzero_static")
                 else torch.nonzero(flat)).reshape(-1)
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        probe = query.new_empty((total, query.shape[1], query.shape[3]))
        return index, prepare_varlen_metadata(offsets, probe)
    return _keyed(_unpad, (mask,), build)
