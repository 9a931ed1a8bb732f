"""Translations of the torch op ``portattn::attention`` for ``torch.onnx.export(dynamo=True)``.

Two targets:

* ``"portattn"`` — one ``portattn.FlashAttention`` node per call (the tiled online softmax as a
  model-local function, see :mod:`.function`). Every §2 feature except varlen.
* ``"standard"`` — one ONNX ``Attention`` node (opset 23) per call, for runtimes that do not know
  the portattn op. ONNX's ``is_causal`` is aligned top-left, so bottom-right causal attention with
  ``Sq != Sk`` (or lengths the exporter cannot prove equal) and sliding windows become an explicit
  boolean mask input (built from ``Range`` comparisons: ``Sq·Sk`` booleans, no MatMul). ALiBi,
  varlen and ``return_lse=True`` cannot be expressed and raise :class:`UnsupportedFeatureError`.

The translations are called by the exporter with onnxscript's tracing evaluator active, so every
``op.*`` call below records one node.
"""

from __future__ import annotations

from .schema import (
    ALIGNMENT_CODES,
    DOMAIN,
    KV_OP_NAME,
    OP_NAME,
    PAGED_KV_OP_NAME,
    VERSION,
    kv_op_schema,
    op_schema,
    register_schema,
)

TARGETS = ("portattn", "standard")


class UnsupportedFeatureError(ValueError):
    """A feature of an attention call that the chosen export target cannot express."""


def _flash_attention_op(name: str = OP_NAME):
    import onnxscript

    register_schema()
    opset = onnxscript.values.Opset(DOMAIN, VERSION)
    schema = op_schema() if name == OP_NAME else kv_op_schema(paged=name == PAGED_KV_OP_NAME)
    return onnxscript.values.Op(opset, name, schema)


def _tensor_constant(op, array):
    import onnx_ir as ir

    return op.Constant(value=ir.tensor(array))


def _is_bool(value) -> bool:
    import onnx_ir as ir

    return getattr(value, "dtype", None) == ir.DataType.BOOL


def _is_double(value) -> bool:
    import onnx_ir as ir

    return getattr(value, "dtype", None) == ir.DataType.DOUBLE


def _reject_varlen(cu_seqlens_q) -> None:
    if cu_seqlens_q is not None:
        raise UnsupportedFeatureError(
            "varlen (cu_seqlens_q/cu_seqlens_k) cannot be exported to ONNX: pad the batch to dense "
            "(B, S, H, D) tensors with a key padding mask (attn_bias of shape (B, 1, 1, Sk)) instead")


def make_portattn_translation(block_size: int = 256):
    """The translation emitting ``portattn.FlashAttention`` (one node per call)."""
    flash_attention = _flash_attention_op()

    def portattn_attention(q, k, v, alibi_slopes=None, attn_bias=None, cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=0, max_seqlen_k=0, scale=1.0, causal=False, alignment="bottom_right",
                           window_left=-1, window_right=-1, softcap=0.0, backend="", return_lse=False,
                           needs_grad=False):
        import numpy as np
        from onnxscript import opset18 as op

        _reject_varlen(cu_seqlens_q)
        bias = mask = None
        if attn_bias is not None:
            if _is_bool(attn_bias):
                mask = attn_bias
            elif _is_double(attn_bias):
                bias = op.Cast(attn_bias, to=1)        # the op takes float/float16/bfloat16 bias
            else:
                bias = attn_bias
        if bias is None:
            bias = _tensor_constant(op, np.zeros((1, 1, 1, 1), np.float32))
        if mask is None:
            mask = _tensor_constant(op, np.ones((1, 1, 1, 1), np.bool_))
        if alibi_slopes is None:
            alibi_slopes = _tensor_constant(op, np.zeros((1, 1), np.float32))
        return flash_attention(
            q, k, v, bias, mask, alibi_slopes,
            scale=float(scale), causal=int(bool(causal)), alignment=ALIGNMENT_CODES[alignment],
            window_left=int(window_left), window_right=0 if causal else int(window_right),
            softcap=float(softcap), block_size=int(block_size), _num_outputs=2)

    return portattn_attention


def make_kvcache_translation(block_size: int = 256):
    """The translation of ``portattn::attention_with_kvcache`` (the functional KV-cache op of
    :mod:`.kvcache_op`) emitting one ``portattn.FlashAttentionKVCache`` node per call
    (``FlashAttentionPagedKVCache`` when it has a block table). Its four outputs are the op's:
    ``out``, the updated key and value caches, ``lse``."""
    kv_attention = _flash_attention_op(KV_OP_NAME)
    paged_kv_attention = _flash_attention_op(PAGED_KV_OP_NAME)

    def portattn_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                                        alibi_slopes=None, scale=1.0, causal=False, alignment="bottom_right",
                                        window_left=-1, window_right=-1, softcap=0.0, backend=""):
        import numpy as np
        from onnxscript import opset18 as op

        if k is None:   # nothing to append: empty (B, 0, Hkv, D/Dv) new keys and values
            head = op.Concat(op.Shape(q, start=0, end=1), _tensor_constant(op, np.array([0], np.int64)), axis=0)
            k, v = (op.CastLike(op.ConstantOfShape(op.Concat(head, op.Shape(c, start=2, end=4), axis=0)), c)
                    for c in (k_cache, v_cache))
        if alibi_slopes is None:
            alibi_slopes = _tensor_constant(op, np.zeros((1, 1), np.float32))
        attributes = dict(scale=float(scale), causal=int(bool(causal)), alignment=ALIGNMENT_CODES[alignment],
                          window_left=int(window_left), window_right=0 if causal else int(window_right),
                          softcap=float(softcap), block_size=int(block_size), _num_outputs=4)
        if block_table is not None:
            return paged_kv_attention(q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes,
                                      **attributes)
        return kv_attention(q, k_cache, v_cache, k, v, cache_seqlens, alibi_slopes, **attributes)

    return portattn_attention_with_kvcache


def make_standard_kvcache_translation():
    """``target="standard"`` has no KV-cache form: ONNX ``Attention`` appends past keys by
    concatenation, not at per-sequence lengths. Refused with a message."""

    def standard_attention_with_kvcache(*args, **kwargs):
        raise UnsupportedFeatureError(
            "attention_with_kvcache cannot be exported with target='standard': ONNX Attention has no "
            "per-sequence cache lengths (cache_seqlens) or in-place append; use target='portattn' "
            "(the portattn.FlashAttentionKVCache op)")

    return standard_attention_with_kvcache


def _same_length(a, b) -> bool:
    """True when two (possibly symbolic) dims are provably equal at export time."""
    try:
        if a is None or b is None:
            return False
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return str(a) == str(b) and str(a) not in ("", "None")
    except Exception:
        return False


def make_standard_translation():
    """The translation emitting ONNX ``Attention`` (opset 23), one node per call."""

    def standard_attention(q, k, v, alibi_slopes=None, attn_bias=None, cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=0, max_seqlen_k=0, scale=1.0, causal=False, alignment="bottom_right",
                           window_left=-1, window_right=-1, softcap=0.0, backend="", return_lse=False,
                           needs_grad=False):
        import numpy as np
        from onnxscript import opset23 as op

        _reject_varlen(cu_seqlens_q)
        if alibi_slopes is not None:
            raise UnsupportedFeatureError(
                "alibi cannot be exported with target='standard': ONNX Attention has no ALiBi input and "
                "an explicit bias would materialise (B, Hq, Sq, Sk) floats; use target='portattn'")
        if return_lse:
            raise UnsupportedFeatureError(
                "return_lse=True cannot be exported with target='standard': ONNX Attention has no "
                "log-sum-exp output; use target='portattn'")
        right = 0 if causal else int(window_right)
        left = int(window_left)
        has_window = left >= 0 or right >= 0
        sq, sk = q.shape[1] if q.shape is not None else None, k.shape[1] if k.shape is not None else None
        # is_causal (top-left) only where it is exact and no row can end up empty; otherwise the band
        # goes into the explicit mask together with the caller's mask.
        use_is_causal = (causal and left < 0 and attn_bias is None
                         and (alignment == "top_left" or _same_length(sq, sk)))
        mask = attn_bias
        mask_is_bool = attn_bias is not None and _is_bool(attn_bias)   # traced outputs carry no dtype: track it
        if has_window and not use_is_causal:
            # explicit band of visible keys on the aligned row i' (bottom-right: i + Sk - Sq)
            zero = _tensor_constant(op, np.array(0, np.int64))
            one = _tensor_constant(op, np.array(1, np.int64))
            seq_q = op.Squeeze(op.Shape(q, start=1, end=2))
            seq_k = op.Squeeze(op.Shape(k, start=1, end=2))
            rows = op.Range(zero, seq_q, one)
            if alignment == "bottom_right":
                rows = op.Add(rows, op.Sub(seq_k, seq_q))
            rows = op.Unsqueeze(rows, _tensor_constant(op, np.array([1], np.int64)))
            cols = op.Unsqueeze(op.Range(zero, seq_k, one), _tensor_constant(op, np.array([0], np.int64)))
            keep = None
            if left >= 0:
                keep = op.GreaterOrEqual(cols, op.Sub(rows, _tensor_constant(op, np.array(left, np.int64))))
            if right >= 0:
                upper = op.LessOrEqual(cols, op.Add(rows, _tensor_constant(op, np.array(right, np.int64))))
                keep = upper if keep is None else op.And(keep, upper)
            keep = op.Unsqueeze(keep, _tensor_constant(op, np.array([0, 1], np.int64)))   # (1, 1, Sq, Sk)
            if mask is None:
                mask, mask_is_bool = keep, True
            elif mask_is_bool:
                mask = op.And(mask, keep)
            else:
                neg_inf = op.CastLike(_tensor_constant(op, np.array(-np.inf, np.float32)), mask)
                mask = op.Where(keep, mask, neg_inf)
        if mask is not None:
            if not mask_is_bool:
                mask = op.CastLike(mask, q)
            # onnxruntime's Attention broadcasts the mask over batch and heads only: give it (.., Sq, Sk)
            rows_cols = op.Concat(_tensor_constant(op, np.array([1, 1], np.int64)), op.Shape(q, start=1, end=2),
                                  op.Shape(k, start=1, end=2), axis=0)
            mask = op.Expand(mask, rows_cols)
            # rows that see no key must give 0 (onnxruntime averages V over them instead)
            if mask_is_bool:
                row_visible = op.ReduceMax(op.Cast(mask, to=1), _tensor_constant(op, np.array([-1], np.int64)),
                                           keepdims=1)
                row_visible = op.Greater(row_visible, _tensor_constant(op, np.array(0.0, np.float32)))
            else:
                row_visible = op.Not(op.IsInf(op.ReduceMax(op.Cast(mask, to=1),
                                                           _tensor_constant(op, np.array([-1], np.int64)),
                                                           keepdims=1), detect_positive=0))
        # ONNX Attention's 4-D layout is (B, H, S, D); portattn's is (B, S, H, D).
        qt, kt, vt = (op.Transpose(t, perm=[0, 2, 1, 3]) for t in (q, k, v))
        attrs = dict(scale=float(scale), is_causal=int(use_is_causal))
        if softcap and softcap > 0:
            attrs["softcap"] = float(softcap)
        if mask is None:
            y = op.Attention(qt, kt, vt, **attrs)
        else:
            y = op.Attention(qt, kt, vt, mask, **attrs)
        if isinstance(y, (tuple, list)):
            y = y[0]
        if mask is not None:
            y = op.Where(row_visible, y, op.CastLike(_tensor_constant(op, np.array(0.0, np.float32)), y))
        out = op.Transpose(y, perm=[0, 2, 1, 3])
        # lse is not consumed (return_lse=False); an empty placeholder keeps the op's arity.
        lse = op.ConstantOfShape(_tensor_constant(op, np.array([0], np.int64)))
        return out, lse

    return standard_attention

