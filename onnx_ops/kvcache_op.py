"""The exportable form of :func:`portattn.kvcache.attention_with_kvcache`.

``attention_with_kvcache`` writes the new keys/values into the caches in place, which ONNX (a
functional format) cannot express. Under ``torch.export`` (``torch.compiler.is_exporting()``,
which ``portattn.onnx.export`` goes through) it calls :func:`export_attention_with_kvcache`
instead, which

1. validates the arguments exactly as the eager call does, on ``meta`` stand-ins (shapes, dtypes;
   the contents of ``cache_seqlens`` are data and are never read while tracing);
2. calls the functional torch op ``portattn::attention_with_kvcache`` — it mutates nothing and
   returns ``(out, k_cache_updated, v_cache_updated, lse)`` — which ``portattn.onnx.export``
   translates into one ``portattn.FlashAttentionKVCache`` node (``FlashAttentionPagedKVCache``
   with a ``block_table``);
3. copies the updated caches back into the caller's tensors, so the traced program keeps the
   in-place semantics (``torch.export`` records it as an input mutation; a model that returns its
   caches returns the updated ones, which become the ONNX graph's present-key/value outputs).

Eager calls never come here: their behaviour is unchanged.

Importing this module needs torch only (it registers the torch op).
"""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor

__all__ = ["export_attention_with_kvcache"]


@torch.library.custom_op("portattn::attention_with_kvcache", mutates_args=())
def _kvcache_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor], cache_seqlens: Tensor,
    block_table: Optional[Tensor], alibi_slopes: Optional[Tensor], scale: float, causal: bool, alignment: str,
    window_left: int, window_right: int, softcap: float, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Functional ``attention_with_kvcache``: ``(out, k_cache', v_cache', lse)``, inputs untouched.
    ``window_left``/``window_right`` -1 = unbounded, ``softcap`` 0 = off, ``backend`` "" = dispatch."""
    from portattn.kvcache import build_kvcache_spec, run_kvcache

    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    window = None
    if window_left >= 0 or (window_right >= 0 and not causal):
        window = (window_left if window_left >= 0 else None, None if causal or window_right < 0 else window_right)
    kv = build_kvcache_spec(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                            causal=causal, causal_alignment=alignment, window=window, scale=scale, softcap=softcap or None,
                            alibi_slopes=alibi_slopes, return_lse=True)
    out, lse = run_kvcache(kv, backend or None)
    return out, k_cache, v_cache, lse


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, scale, causal, alignment,
                  window_left, window_right, softcap, backend):
    batch, sq, hq, _ = q.shape
    out = q.new_empty((batch, sq, hq, v_cache.shape[-1]))
    lse = q.new_empty((batch, hq, sq), dtype=torch.float32)
    return out, torch.empty_like(k_cache), torch.empty_like(v_cache), lse


def _meta(t):
    return t if not isinstance(t, torch.Tensor) else torch.empty_like(t, device="meta")


def export_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                                  causal=False, causal_alignment="bottom_right", window=None, scale=None,
                                  softcap=None, alibi_slopes=None, return_lse=False, backend=None):
    """``attention_with_kvcache`` while ``torch.export`` traces: same arguments, same results, the
    caches updated in place through the functional op (see the module docstring)."""
    from portattn.kvcache import build_kvcache_spec

    # every check of the eager call, on stand-ins whose contents are never read
    kv = build_kvcache_spec(_meta(q), _meta(k_cache), _meta(v_cache), _meta(k), _meta(v),
                            cache_seqlens=_meta(cache_seqlens), block_table=_meta(block_table), causal=causal,
                            causal_alignment=causal_alignment,
                            window=window, scale=scale, softcap=softcap, alibi_slopes=_meta(alibi_slopes))
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens = cache_seqlens
    else:   # None (every sequence fills the cache) or an int
        fill = kv.capacity if cache_seqlens is None else cache_seqlens
        seqlens = torch.full((q.shape[0],), fill, dtype=torch.int32, device=q.device)
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.detach().to(torch.float32).expand(kv.batch, kv.num_heads_q).contiguous()
    out, k_new_cache, v_new_cache, lse = _kvcache_op(
        q, k_cache, v_cache, k, v, seqlens, block_table, slopes, kv.scale, kv.causal, kv.alignment,
        -1 if kv.window_left is None else kv.window_left, -1 if kv.window_right is None else kv.window_right,
        kv.softcap or 0.0, backend or "")
    k_cache.copy_(k_new_cache)
    v_cache.copy_(v_new_cache)
    return (out, lse) if return_lse else out
