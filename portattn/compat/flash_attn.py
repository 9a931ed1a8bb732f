"""flash-attn 2's Python API, computed by :func:`portattn.attention`.

Replace ``from flash_attn import flash_attn_func`` by
``from portattn.compat.flash_attn import flash_attn_func`` (likewise for the other five
functions): same positional order, keywords, defaults and return values as flash-attn 2.x's
``flash_attn_interface``; every call goes through portattn's dispatch (``portattn.use_backend``,
``PORTATTN_BACKEND`` and ``backend=``-free priority lists apply), so it runs wherever a
portattn backend runs (CPU included) and is differentiable in q, k, v (and in packed ``qkv``/``kv``).

Semantics (flash-attn's, which are portattn's defaults — docs/semantics.md):

* layout ``(batch, seqlen, nheads, headdim)``; varlen ``(total, nheads, headdim)`` with int32
  ``cu_seqlens`` of length ``batch + 1``; GQA/MQA when k/v have fewer heads (query head ``h``
  reads kv head ``h // (nheads // nheads_k)``);
* ``softmax_scale`` defaults to ``1/sqrt(headdim)``;
* ``causal=True`` is aligned **bottom-right** (the last query row sees the last key); rows that
  see no key output 0;
* ``window_size=(left, right)``: query ``i`` sees keys ``[i + Sk - Sq - left, i + Sk - Sq + right]``;
  a negative side is unbounded; ``causal=True`` forces ``right = 0`` (as flash-attn does);
* ``softcap > 0``: ``s = softcap · tanh(s / softcap)``; ``0.0`` is off;
* ``alibi_slopes`` ``(nheads,)`` or ``(batch, nheads)`` float32: ``s -= slope · |i + Sk - Sq - j|``;
* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: ``softmax_lse`` float32
  ``(batch, nheads, seqlen_q)`` (varlen: ``(nheads, total_q)``), natural log. flash-attn returns
  its dropout-mask tensor as the third item, which is empty unless ``dropout_p > 0``; portattn has
  no dropout, so the third item is ``None``.

``flash_attn_with_kvcache`` (decoding) is implemented in :mod:`portattn.kvcache` and re-exported
here, so the flash-attn import line stays the only change.

Differences from flash-attn (see docs/integrations.md):

* ``dropout_p > 0`` raises ``ValueError`` (portattn has no attention dropout);
* ``block_table`` (paged KV) of ``flash_attn_varlen_func`` raises ``ValueError``: use
  ``flash_attn_with_kvcache``;
* a row with no visible key has ``softmax_lse = -inf`` (its log-sum-exp over nothing), where
  flash-attn's kernels write ``+inf``; the output is 0 in both;
* ``deterministic=True`` requests determinism for the call (``portattn.config.deterministic_scope``):
  the dispatch takes only backends with a deterministic backward, and triton runs its two-kernel
  backward instead of the atomic dQ it uses by default on Hopper at head dims 128/256. Under
  ``torch.compile`` use ``PORTATTN_DETERMINISTIC=1`` or ``torch.use_deterministic_algorithms(True)``
  instead;
* inputs need not be CUDA tensors, have head dims that are multiples of 8, or be fp16/bf16:
  any dtype and device some portattn backend supports works.
"""

from __future__ import annotations

import contextlib
import numbers

import torch

from .. import config
from ..api import attention
from ..errors import describe
from ..kvcache import flash_attn_with_kvcache

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]


# ----- argument translation ------------------------------------------------------------------

def _check_dropout(dropout_p) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {dropout_p!r}")
    if dropout_p != 0:
        raise ValueError(
            f"dropout_p={dropout_p} is not supported: portattn computes exact attention without attention "
            f"dropout; pass dropout_p=0.0 (flash-attn's own advice for evaluation), or apply dropout outside "
            f"attention")


def _window(window_size, causal: bool) -> tuple[int | None, int | None] | None:
    """flash-attn's ``(left, right)`` (negative = unbounded) as portattn's ``window``."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints (-1 = unbounded), got {window_size!r}")
    sides = []
    for name, w in zip(("window_size[0] (left)", "window_size[1] (right)"), window_size):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"{name} must be an int (-1 = unbounded), got {w!r}")
        sides.append(None if w < 0 else int(w))
    left, right = sides
    if causal:
        right = None        # flash-attn: causal sets right = 0 whatever was passed; portattn's causal=True does
    if left is None and right is None:
        return None
    return (left, right)


def _softcap(softcap) -> float | None:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float (0.0 = off), got {softcap!r}")
    return float(softcap) if softcap > 0 else None


def _run(q, k, v, *, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
         return_attn_probs, **varlen):
    _check_dropout(dropout_p)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    kwargs = dict(q=q, k=k, v=v, causal=causal, window=_window(window_size, causal), scale=softmax_scale,
                  softcap=_softcap(softcap), alibi_slopes=alibi_slopes, **varlen)
    # deterministic=True: the call's spec carries it, so the dispatch takes a deterministic backend
    # and its backward runs deterministically (triton: no atomic dQ); eager calls only
    scope = config.deterministic_scope() if deterministic else contextlib.nullcontext()
    with scope:
        if not return_attn_probs:
            return attention(**kwargs)
        out, lse = attention(**kwargs, return_lse=True)
    return out, lse, None


def _unpack(name: str, packed, count: int, dims: int, layout: str):
    """Split a packed tensor along its stacking axis (views, so gradients reach ``packed``)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    axis = dims - 3
    if packed.dim() != dims or packed.shape[axis] != count:
        raise ValueError(f"{name} must have shape {layout}; got {describe(packed)}")
    return packed.unbind(axis)


# ----- dense ---------------------------------------------------------------------------------

def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Attention over ``q (B, Sq, H, D)``, ``k (B, Sk, Hk, D)``, ``v (B, Sk, Hk, Dv)`` -> ``out (B, Sq, H, Dv)``.

    ``return_attn_probs=True``: ``(out, softmax_lse (B, H, Sq) float32, None)``. Semantics and
    the differences from flash-attn: module docstring.
    """
    return _run(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                return_attn_probs=return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` with ``qkv (B, S, 3, H, D)`` stacked; gradients flow into ``qkv``."""
    q, k, v = _unpack("qkv", qkv, 3, 5, "(batch, seqlen, 3, nheads, headdim)")
    return _run(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                return_attn_probs=return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` with ``kv (B, Sk, 2, Hk, D)`` stacked; gradients flow into ``kv``."""
    k, v = _unpack("kv", kv, 2, 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return _run(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                return_attn_probs=return_attn_probs)


# ----- varlen (packed sequences) ---------------------------------------------------------------

def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Attention over packed sequences: ``q (total_q, H, D)``, ``k/v (total_k, Hk, D/Dv)``,
    ``cu_seqlens_q/k`` int32 ``(B + 1,)`` -> ``out (total_q, H, Dv)``. Causal and windows are
    aligned bottom-right per sequence. ``return_attn_probs=True``:
    ``(out, softmax_lse (H, total_q) float32, None)``. ``block_table`` (paged KV) is not
    supported here: use ``flash_attn_with_kvcache``."""
    if block_table is not None:
        raise ValueError("block_table (paged KV cache) is not supported by flash_attn_varlen_func in portattn; "
                         "use flash_attn_with_kvcache for paged caches, or pass contiguous k/v with cu_seqlens_k")
    return _run(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                return_attn_probs=return_attn_probs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """:func:`flash_attn_varlen_func` with ``qkv (total, 3, H, D)`` stacked and one ``cu_seqlens``
    / ``max_seqlen`` for queries and keys."""
    q, k, v = _unpack("qkv", qkv, 3, 4, "(total, 3, nheads, headdim)")
    return _run(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                return_attn_probs=return_attn_probs, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_varlen_func` with ``kv (total_k, 2, Hk, D)`` stacked."""
    k, v = _unpack("kv", kv, 2, 4, "(total_k, 2, nheads_k, headdim)")
    return _run(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                return_attn_probs=return_attn_probs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)

