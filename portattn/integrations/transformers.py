"""Hugging Face transformers: ``attn_implementation="portattn"``.

>>> from portattn.integrations.transformers import register
>>> register()                                  # once per process; returns the name
>>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation="portattn")

:func:`register` adds two functions under one name (transformers >= 5.17):

* to ``AttentionInterface`` — :func:`attention_forward`, which every attention layer calls with
  ``query/key/value (B, H, S, D)``;
* to ``AttentionMaskInterface`` — :func:`attention_mask`, which builds the mask those layers
  receive. Without it transformers would hand a custom attention function ``attention_mask=None``
  and padding would be silently ignored.

How the mask travels. For the common structure — causal (or causal sliding-window) attention
whose last query is the last key (no cache, or a ``DynamicCache``) — the mask function returns
only a **key-padding mask** ``(B, 1, 1, Sk)`` bool (or ``None`` without padding), and
:func:`attention_forward` passes portattn's own arguments: ``causal=True`` (bottom-right),
``window=(sliding_window - 1, 0)`` for sliding layers (transformers' window of ``w`` tokens
including the query's own), ``softcap``, ``scale=scaling``, GQA heads as they are. Nothing of
size ``Sq·Sk`` is built. Everything else — a ``StaticCache`` (keys beyond the current position),
packed sequences, chunked attention, ``or/and`` mask overlays, bidirectional masks, a sliding
window under ``torch.compile`` (its mask function cannot be recognised while tracing) and single
query rows with padding — gets transformers' dense boolean mask ``(B, 1, Sq, Sk)``, passed as
``attn_bias`` with ``causal=False``. A 4-D mask the caller passes to the model is used as it is
(bool: True = keep, float: added; a bool ``(B, 1, 1, Sk)`` mask with ``Sq > 1`` is read as a
key-padding mask on top of the layer's causal/window).

Not supported (``ValueError``): attention dropout > 0 (``config.attention_dropout`` while
training), attention sinks (``s_aux``), ``position_bias``, continuous batching (paged caches).
``output_attentions=True`` returns ``None`` weights, as transformers' SDPA path does.
"""

from __future__ import annotations

import functools

import torch

from ..api import attention

NAME = "portattn"
MIN_TRANSFORMERS = "5.17"

__all__ = ["register", "attention_forward", "attention_mask", "NAME", "MIN_TRANSFORMERS"]


# ----- the mask function --------------------------------------------------------------------------

try:   # a plain module object, bound once at import (this module is imported only by its users)
    import transformers.masking_utils as _MU
except ImportError:   # register() says what to install
    _MU = None


def _masking_utils():
    """``transformers.masking_utils``. An ``import`` inside the mask function, which transformers
    calls while torch.compile traces the model, goes through transformers' lazy module and breaks
    the graph on torch 2.11 ("Bad import result: _LazyModule"), so it is bound at import."""
    return _MU


def _sliding_window_of(mask_function) -> int | None:
    """The window of ``masking_utils.sliding_window_causal_mask_function(w)`` (eager only: reads the
    closure), else None."""
    mu = _masking_utils()

    and_code = mu.and_masks(mu.causal_mask_function).__code__
    overlay_code = mu.sliding_window_overlay(1).__code__
    if getattr(mask_function, "__code__", None) is not and_code or not mask_function.__closure__:
        return None
    parts = mask_function.__closure__[0].cell_contents
    if not (isinstance(parts, tuple) and len(parts) == 2 and parts[1] is mu.causal_mask_function
            and getattr(parts[0], "__code__", None) is overlay_code and parts[0].__closure__):
        return None
    window = parts[0].__closure__[0].cell_contents
    return window if isinstance(window, int) else None


def _is_plain_causal(mask_function, local_size, use_vmap) -> bool:
    """True for the masks portattn expresses as bottom-right causal (+ window from the layer)."""
    mu = _masking_utils()

    if use_vmap:
        return False
    if mask_function is mu.causal_mask_function:
        return local_size is None
    if local_size is None or torch.compiler.is_compiling():
        return False
    return _sliding_window_of(mask_function) == local_size


def _key_padding(attention_mask: torch.Tensor, kv_length, kv_offset) -> torch.Tensor:
    """The 2-D padding mask (B, >= kv_offset + kv_length) cut to the keys of this call, (B, 1, 1, Sk)."""
    short = kv_offset + kv_length - attention_mask.shape[-1]
    if short > 0:     # keys the 2-D mask does not cover yet (e.g. a static cache's free slots)
        attention_mask = torch.nn.functional.pad(attention_mask, (0, short))
    return attention_mask[:, kv_offset:kv_offset + kv_length][:, None, None, :]


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, local_size=None, allow_is_causal_skip=True, allow_is_bidirectional_skip=False,
                   use_vmap=False, device="cpu", **kwargs):
    """transformers' mask interface for ``"portattn"`` (module docstring): a key-padding mask
    ``(B, 1, 1, Sk)`` bool or ``None`` for bottom-right-aligned (sliding) causal attention, else the
    dense boolean ``(B, 1, Sq, Sk)`` mask (True = keep) of ``masking_utils.sdpa_mask``."""
    mu = _masking_utils()

    if mask_function is None:
        mask_function = mu.causal_mask_function
    aligned = (not isinstance(q_offset, torch.Tensor) and not isinstance(kv_offset, torch.Tensor)
               and q_offset + q_length == kv_offset + kv_length)
    if aligned and _is_plain_causal(mask_function, local_size, use_vmap):
        if attention_mask is None:
            return None
        covered = attention_mask.shape[-1] >= kv_offset + kv_length     # keys past the 2-D mask count as padding
        if (covered and not torch.compiler.is_compiling()
                and bool(attention_mask[:, kv_offset:kv_offset + kv_length].all())):
            return None                      # no padding among these keys (eager only: reads values)
        if q_length > 1:
            return _key_padding(attention_mask, kv_length, kv_offset)
        # one query row: a (B, 1, 1, Sk) mask is read as a dense row, so it must carry the window too
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                        local_size=local_size, allow_is_causal_skip=False,
                        allow_is_bidirectional_skip=allow_is_bidirectional_skip, use_vmap=use_vmap, device=device)


# ----- the attention function ---------------------------------------------------------------------

def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, softcap=None, *, _portattn_backend=None, **kwargs):
    """transformers' attention interface for ``"portattn"``.

    ``query (B, Hq, Sq, D)``, ``key/value (B, Hkv, Sk, D/Dv)`` -> ``(out (B, Sq, Hq, Dv), None)``.
    ``attention_mask`` is what :func:`attention_mask` built (or a 4-D mask given to the model):
    ``None`` or ``(B, 1, 1, Sk)`` bool with ``Sq > 1`` means bottom-right causal (when the layer is
    causal) + the layer's sliding window + that key mask; any other 4-D mask is dense and used as
    ``attn_bias`` without causal/window.
    """
    if dropout:
        raise ValueError(f"dropout={dropout} is not supported by attn_implementation='portattn' (no attention "
                         f"dropout); set config.attention_dropout=0.0 or call model.eval()")
    for name in ("s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} is not supported by attn_implementation='portattn' "
                             f"(module {type(module).__name__}); use attn_implementation='eager' for this model")
    if attention_mask is None and kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError("attn_implementation='portattn' does not support continuous batching / paged caches "
                         "(cu_seq_lens_q without a mask); use generate() with a DynamicCache or StaticCache")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4):
        raise ValueError(f"attn_implementation='portattn' needs a 4-D attention mask or None, got "
                         f"{type(attention_mask).__name__} {getattr(attention_mask, 'shape', '')}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    sq, sk = query.shape[2], key.shape[2]
    mask = attention_mask
    structured = mask is None or (mask.dtype == torch.bool and mask.shape[-2] == 1 and sq > 1)
    window = None
    if structured:
        if causal and sliding_window:
            window = (int(sliding_window) - 1, None)
    else:
        causal = False
    if mask is not None:
        mask = mask[..., :sk]
    out = attention(query, key, value, layout="bhsd", causal=bool(causal), window=window, scale=scaling,
                    softcap=softcap or None, attn_bias=mask, backend=_portattn_backend)
    return out.transpose(1, 2), None


def _check_version():
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).release < Version(MIN_TRANSFORMERS).release:
        raise ImportError(f"portattn's transformers integration needs transformers >= {MIN_TRANSFORMERS} "
                          f"(its AttentionInterface / AttentionMaskInterface); found {transformers.__version__}. "
                          f"Upgrade with pip install 'portattn[hf]'")


def register(name: str = NAME, *, backend: str | None = None) -> str:
    """Register ``name`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``
    (idempotent) and return it, for ``from_pretrained/from_config(..., attn_implementation=name)``.

    ``backend`` pins a portattn backend for that name (e.g. ``register("portattn_triton",
    backend="triton")``); by default portattn's dispatch chooses per call (``portattn.use_backend``
    and ``PORTATTN_BACKEND`` apply).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name (str) or None, got {type(backend).__name__}")
    _check_version()
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface


    fn = attention_forward if backend is None else functools.partial(attention_forward, _portattn_backend=backend)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, attention_mask)
    return name
