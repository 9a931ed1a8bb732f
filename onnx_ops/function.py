"""The bodies of ``portattn.FlashAttention``, ``portattn.FlashAttentionKVCache`` and
``portattn.FlashAttentionPagedKVCache``: FlashAttention's tiled online softmax in ONNX.

Authored with onnxscript; the Python ``for`` over K/V blocks becomes an ONNX ``Loop`` whose
carried state is the running row max ``m``, the running row sum ``l`` and the unnormalised
output ``acc``. One iteration materialises scores for all query rows against one block of
``block_size`` keys, so peak memory grows as ``B·Hq·Sq·block_size``, never as ``Sq·Sk``.

The ops share model-local helper functions (domain ``portattn``), so each stage is written once:

* :func:`FlashAttentionLayout` — stage 0: Q, K, V in float32 in the grouped layout below (q pre-scaled);
* :func:`GroupedHeads` — bias, mask and ALiBi slopes grouped the same way (broadcast axes stay 1);
* :func:`AttentionWindow` — the window ``[i' − left, i' + right]`` from the attributes;
* :func:`FlashAttentionBlock` — stages 1–6 for one key block ``[j0, j1)``: scores, softcap,
  ALiBi, bias, window/causal, mask, key-length mask, then the online-softmax update;
* :func:`FlashAttentionFinish` — stage 7: normalise, rows with no visible key → 0 and -inf LSE;
* :func:`FlashAttentionLoop` — the algorithm over a key range: stage 0, the ``Loop`` over key
  blocks applying stages 1–6, stage 7; every op calls it;
* for the two KV-cache ops: :func:`KVCacheSlots` (where the append writes), :func:`KVCacheWrite`
  (the append, one ``ScatterND``), :func:`KVCacheBand` (per-sequence rows and the visible key
  range) and :func:`KVCacheAttend` (the loop over the visible slots, no bias or mask); the ops
  differ only in how slots are addressed (``(b, p)`` or ``(block_table[b, p // page], p % page)``).

Helpers that consume attributes take them as function attributes (forwarded by reference), so each
attribute becomes a tensor in one place only.

Layout inside the bodies (GQA groups made explicit so that K/V are never repeated)::

    Q (B, Sq, Hq, D)  -> q5  (B, Hkv, G, Sq, D)      G = Hq // Hkv, query head h = kv·G + g
    K (B, Sk, Hkv, D) -> kT5 (B, Hkv, 1, D, Sk)
    V (B, Sk, Hkv, Dv)-> v5  (B, Hkv, 1, Sk, Dv)
    scores of a block        (B, Hkv, G, Sq, blk)

Every computation is in float32 (q/k/v of float16/bfloat16 are cast on entry, the output cast
back to Q's type), except ``Q Kᵀ``, accumulated in float64 and rounded once. Optional features
are switched on per call by scalar conditions evaluated once before the loop, so a feature that
is off costs nothing inside the loop:

* ``softcap > 0``: ``s = softcap · tanh(s / softcap)``;
* ALiBi (any non-zero slope): ``s -= slope · |i + Sk − Sq − j|``;
* ``bias`` (any non-zero entry): ``s += bias``;
* causal / window: keys outside ``[i' − left, i' + right]`` are masked, ``i' = i + Sk − Sq``
  (``alignment = 0``, bottom-right) or ``i' = i`` (``alignment = 1``, top-left);
* ``mask`` (any False entry): keys where the mask is False are masked;
* KV cache (the KV-cache ops only): ``Sk`` is each sequence's own length ``L_b``, and keys
  at or beyond it are masked in the scores *and* zeroed in V (NaN there never reaches Y).

Rows that see no key end with ``l = 0``: their output is 0 and their LSE ``-inf`` (never NaN).
"""

from __future__ import annotations

from onnxscript import opset18 as op
from onnxscript import script
from onnxscript.values import Opset

from .schema import DOMAIN, VERSION

portattn_opset = Opset(DOMAIN, VERSION)


# ----- shared helpers ---------------------------------------------------------------------------

@script(portattn_opset, default_opset=op)
def FlashAttentionLayout(Q, K, V, hq, hkv, scale_t):
    """q5 (B, Hkv, G, Sq, D) scaled, kT5 (B, Hkv, 1, D, Sk), v5 (B, Hkv, 1, Sk, Dv), float32.
    ``hq``/``hkv`` are 1-D int64 ``[1]``; Q/K/V may be 4-D or packed 3-D ``(B, S, H·D)``."""
    one1 = op.Constant(value_ints=[1])
    q_shape = op.Shape(Q)
    v_shape = op.Shape(V)
    batch = op.Shape(Q, start=0, end=1)
    seq_q = op.Shape(Q, start=1, end=2)
    seq_k = op.Shape(K, start=1, end=2)
    group = op.Div(hq, hkv)
    head_dim = op.Div(op.ReduceProd(op.Slice(q_shape, [2], [100]), keepdims=1), hq)
    head_dim_v = op.Div(op.ReduceProd(op.Slice(v_shape, [2], [100]), keepdims=1), hkv)
    q5 = op.Reshape(op.Cast(Q, to=1), op.Concat(batch, seq_q, hkv, group, head_dim, axis=0), allowzero=1)
    q5 = op.Mul(op.Transpose(q5, perm=[0, 2, 3, 1, 4]), scale_t)
    kf = op.Reshape(op.Cast(K, to=1), op.Concat(batch, seq_k, hkv, one1, head_dim, axis=0), allowzero=1)
    kT5 = op.Transpose(kf, perm=[0, 2, 3, 4, 1])
    vf = op.Reshape(op.Cast(V, to=1), op.Concat(batch, seq_k, hkv, one1, head_dim_v, axis=0), allowzero=1)
    v5 = op.Transpose(vf, perm=[0, 2, 3, 1, 4])
    return q5, kT5, v5


@script(portattn_opset, default_opset=op)
def GroupedHeads(x, hkv):
    """``x`` 4-D ``(xB, xH, xSq, xSk)``, broadcastable to the scores ``(B, Hq, Sq, Sk)`` (bias,
    mask, ALiBi slopes as ``(B, Hq, 1, 1)``), grouped like a block's scores ``(B, Hkv, G, Sq, blk)``:
    ``(xB, h, xH / h, xSq, xSk)`` with ``h = min(xH, Hkv)`` (``hkv`` 1-D int64 ``[1]``), so a
    broadcast head axis stays 1 and ``Hq`` heads split as ``kv·G + g``; nothing is expanded."""
    shape = op.Shape(x)
    heads = op.Slice(shape, [1], [2])
    heads_kv = op.Min(heads, hkv)
    return op.Reshape(x, op.Concat(op.Slice(shape, [0], [1]), heads_kv, op.Div(heads, heads_kv),
                                   op.Slice(shape, [2], [4]), axis=0))


@script(portattn_opset, default_opset=op)
def AttentionWindow(sq, sk, causal: int = 0, window_left: int = -1, window_right: int = -1):
    """The window of aligned row ``i'``, keys ``[i' − left, i' + right]`` (int64 scalars), from the
    attributes: ``causal`` forces ``right = 0``; an unbounded side (-1) becomes ``sq + sk``, wider
    than any band of ``sq`` rows over at most ``sk`` keys. ``use_window``: a side is bounded."""
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    causal_t = op.Constant(value_int=causal)
    left_t = op.Constant(value_int=window_left)
    right_t = op.Constant(value_int=window_right)
    right_eff = op.Where(op.Equal(causal_t, one), zero, right_t)
    use_window = op.Or(op.GreaterOrEqual(left_t, zero), op.GreaterOrEqual(right_eff, zero))
    unbounded = op.Add(sq, sk)
    left = op.Where(op.Less(left_t, zero), unbounded, left_t)
    right = op.Where(op.Less(right_eff, zero), unbounded, right_eff)
    return left, right, use_window


@script(portattn_opset, default_opset=op)
def FlashAttentionBlock(q5, kT5, v5, m, l, acc, j0, j1, rows, alibi_rows, left, right, key_len,
                        bias5, bias_cols, mask5, mask_cols, slopes5, softcap_t,
                        use_softcap, use_alibi, use_bias, use_window, use_mask, use_len):
    """One key block ``[j0, j1)`` (int64 scalars): stages 1–6, returns the updated (m, l, acc).

    ``rows``/``alibi_rows``: the aligned row index ``i'`` and ALiBi's ``i + Sk − Sq``, shaped to
    broadcast against the block's scores ``(B, Hkv, G, Sq, blk)`` ((Sq, 1) or (B, 1, 1, Sq, 1));
    ``key_len``: keys at or beyond it are invisible ((B, 1, 1, 1, 1), used when ``use_len``).
    """
    one = op.Constant(value_int=1)
    one1 = op.Constant(value_ints=[1])
    zero_f = op.Constant(value_float=0.0)
    neg_inf = op.Constant(value_float=float("-inf"))
    # stage 1: scores of this key block, s = scale · q kᵀ
    j0_1d = op.Reshape(j0, [1])
    j1_1d = op.Reshape(j1, [1])
    k_blk = op.Slice(kT5, j0_1d, j1_1d, [4])
    v_blk = op.Slice(v5, j0_1d, j1_1d, [3])
    s = op.Cast(op.MatMul(op.Cast(q5, to=11), op.Cast(k_blk, to=11)), to=1)   # (B, Hkv, G, Sq, blk)
    key_ids = op.Range(j0, j1, one)
    cols = op.Unsqueeze(key_ids, [0])                          # (1, blk)
    # stage 2: softcap
    if use_softcap:
        # tanh in float64: onnxruntime's float32 Tanh is ~2.5e-7 relative off (2 ulps)
        s_c = op.Mul(op.Cast(op.Tanh(op.Cast(op.Div(s, softcap_t), to=11)), to=1), softcap_t)
    else:
        s_c = op.Identity(s)
    # stage 3: ALiBi, s -= slope · |i + Sk − Sq − j|
    if use_alibi:
        dist = op.Cast(op.Abs(op.Sub(alibi_rows, cols)), to=1)
        s_a = op.Sub(s_c, op.Mul(slopes5, dist))
    else:
        s_a = op.Identity(s_c)
    # stage 4: additive bias (broadcast columns stay one wide)
    if use_bias:
        b_blk = op.Slice(bias5, op.Min(j0_1d, op.Sub(bias_cols, one1)), op.Min(j1_1d, bias_cols), [4])
        s_b = op.Add(s_a, b_blk)
    else:
        s_b = op.Identity(s_a)
    # stage 5: causal / sliding window, the boolean mask, the per-sequence key length
    if use_window:
        keep_w = op.And(op.GreaterOrEqual(cols, op.Sub(rows, left)), op.LessOrEqual(cols, op.Add(rows, right)))
        s_w = op.Where(keep_w, s_b, neg_inf)
    else:
        s_w = op.Identity(s_b)
    if use_mask:
        keep_m = op.Slice(mask5, op.Min(j0_1d, op.Sub(mask_cols, one1)), op.Min(j1_1d, mask_cols), [4])
        s_m = op.Where(keep_m, s_w, neg_inf)
    else:
        s_m = op.Identity(s_w)
    if use_len:
        # cache slots beyond the sequence: -inf scores and zero values (0 · NaN would be NaN)
        s_l = op.Where(op.Less(cols, key_len), s_m, neg_inf)
        v_use = op.Where(op.Less(op.Unsqueeze(key_ids, [1]), key_len), v_blk, zero_f)
    else:
        s_l = op.Identity(s_m)
        v_use = op.Identity(v_blk)
    # stage 6: online softmax, rescale the running sum and output by exp(m_old − m_new)
    m_new = op.Max(m, op.ReduceMax(s_l, [-1], keepdims=1))
    m_use = op.Where(op.IsInf(m_new), zero_f, m_new)            # rows with nothing visible yet
    p = op.Exp(op.Sub(s_l, m_use))
    alpha = op.Exp(op.Sub(m, m_use))
    l_new = op.Add(op.Mul(l, alpha), op.ReduceSum(p, [-1], keepdims=1))
    acc_new = op.Add(op.Mul(acc, alpha), op.MatMul(p, v_use))
    return m_new, l_new, acc_new


@script(portattn_opset, default_opset=op)
def FlashAttentionFinish(acc, l, m, Q, hq):
    """Stage 7: ``Y = acc / l`` as ``(B, Sq, Hq, Dv)`` in Q's type and ``LSE (B, Hq, Sq)``;
    rows with ``l = 0`` (no visible key) give 0 and ``-inf``."""
    zero_f = op.Constant(value_float=0.0)
    one_f = op.Constant(value_float=1.0)
    batch = op.Shape(Q, start=0, end=1)
    seq_q = op.Shape(Q, start=1, end=2)
    head_dim_v = op.Shape(acc, start=4, end=5)
    empty = op.Equal(l, zero_f)
    out5 = op.Div(acc, op.Where(empty, one_f, l))
    m_fin = op.Where(op.IsInf(m), zero_f, m)
    lse5 = op.Add(m_fin, op.Log(l))                                 # log(0) = -inf
    out = op.Transpose(out5, perm=[0, 3, 1, 2, 4])                  # (B, Sq, Hkv, G, Dv)
    Y = op.CastLike(op.Reshape(out, op.Concat(batch, seq_q, hq, head_dim_v, axis=0), allowzero=1), Q)
    LSE = op.Reshape(lse5, op.Concat(batch, hq, seq_q, axis=0), allowzero=1)
    return Y, LSE


@script(portattn_opset, default_opset=op)
def FlashAttentionLoop(Q, K, V, hq, hkv, alibi_slopes, bias5, bias_cols, mask5, mask_cols, use_bias, use_mask,
                       rows, alibi_rows, left, right, use_window, key_len, use_len, col_lo, col_hi,
                       scale: float = 1.0, softcap: float = 0.0, block_size: int = 256):
    """The whole algorithm over the keys ``[col_lo, col_hi)`` of K/V (int64 scalars): stage 0
    (:func:`FlashAttentionLayout`), the ALiBi and softcap switches, then a ``Loop`` over blocks
    of ``block_size`` keys applying :func:`FlashAttentionBlock` (stages 1–6) to the running
    ``m, l (B, Hkv, G, Sq, 1)`` and ``acc (B, Hkv, G, Sq, Dv)``, then stage 7
    (:func:`FlashAttentionFinish`): ``Y (B, Sq, Hq, Dv)`` in Q's type, ``LSE (B, Hq, Sq)``.

    ``alibi_slopes (B, Hq)`` as given (zeros: off); ``bias5``/``mask5`` grouped by
    :func:`GroupedHeads` with their key extent ``bias_cols``/``mask_cols`` (1-D ``[1]``) and their
    switches; the band (``rows``, ``alibi_rows``, ``left``, ``right``, ``use_window``) and the
    key length (``key_len``, ``use_len``) as :func:`FlashAttentionBlock` takes them.
    """
    one = op.Constant(value_int=1)
    one1 = op.Constant(value_ints=[1])
    zero_f = op.Constant(value_float=0.0)
    neg_inf = op.Constant(value_float=float("-inf"))
    scale_t = op.Constant(value_float=scale)
    softcap_t = op.Constant(value_float=softcap)
    block = op.Constant(value_int=block_size)
    q5, kT5, v5 = FlashAttentionLayout(Q, K, V, hq, hkv, scale_t)
    slopes5 = GroupedHeads(op.Unsqueeze(op.Cast(alibi_slopes, to=1), [2, 3]), hkv)     # (B, h, G, 1, 1)
    use_softcap = op.Greater(softcap_t, zero_f)
    use_alibi = op.Greater(op.ReduceMax(op.Abs(slopes5), keepdims=0), zero_f)
    # running state: max m, sum l, unnormalised output acc
    rows_shape = op.Shape(q5, start=0, end=4)                                           # (B, Hkv, G, Sq)
    m = op.Expand(neg_inf, op.Concat(rows_shape, one1, axis=0))
    l = op.Expand(zero_f, op.Concat(rows_shape, one1, axis=0))
    acc = op.Expand(zero_f, op.Concat(rows_shape, op.Shape(v5, start=4, end=5), axis=0))
    n_blocks = op.Div(op.Sub(op.Add(op.Sub(col_hi, col_lo), block), one), block)
    # no row (Sq or B·Hq zero): no block is visited. onnxruntime 1.30's broadcasting refuses the
    # empty blocks' (B, Hkv, G, 0, ...) products (Mul: "4 by 16"); 1.32 accepts them.
    has_rows = op.Min(op.ReduceProd(rows_shape, keepdims=0), one)
    n_blocks = op.Mul(n_blocks, has_rows)
    for blk_index in range(n_blocks):
        j0 = op.Add(col_lo, op.Mul(blk_index, block))
        j1 = op.Min(op.Add(j0, block), col_hi)
        m, l, acc = FlashAttentionBlock(q5, kT5, v5, m, l, acc, j0, j1, rows, alibi_rows, left, right, key_len,
                                        bias5, bias_cols, mask5, mask_cols, slopes5, softcap_t,
                                        use_softcap, use_alibi, use_bias, use_window, use_mask, use_len)
    Y, LSE = FlashAttentionFinish(acc, l, m, Q, hq)
    return Y, LSE


#: the helper functions every model using one of the ops must carry
HELPERS = (FlashAttentionLayout, GroupedHeads, AttentionWindow, FlashAttentionBlock, FlashAttentionFinish,
           FlashAttentionLoop)


# ----- portattn.FlashAttention ---------------------------------------------------------------

@script(portattn_opset, default_opset=op)
def FlashAttention(Q, K, V, bias, mask, alibi_slopes,
                   scale: float = 1.0, causal: int = 0, alignment: int = 0,
                   window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                   q_num_heads: int = 0, kv_num_heads: int = 0, block_size: int = 256):
    # ---- attributes as scalar tensors (the others become tensors in the helpers that use them)
    alignment_t = op.Constant(value_int=alignment)
    hq_attr = op.Constant(value_int=q_num_heads)
    hkv_attr = op.Constant(value_int=kv_num_heads)
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    zero_f = op.Constant(value_float=0.0)
    no = op.Cast(zero, to=9)

    # ---- heads from the attributes when given, else from the 4-D shapes ---------------------
    hq = op.Where(op.Greater(hq_attr, zero), op.Reshape(hq_attr, [1]), op.Slice(op.Shape(Q), [2], [3]))
    hkv = op.Where(op.Greater(hkv_attr, zero), op.Reshape(hkv_attr, [1]), op.Slice(op.Shape(K), [2], [3]))

    # ---- bias and mask grouped like the scores, each switched on when not neutral ------------
    bias_f = op.Cast(bias, to=1)
    bias5 = GroupedHeads(bias_f, hkv)
    bias_cols = op.Shape(bias_f, start=3, end=4)
    use_bias = op.Greater(op.ReduceMax(op.Abs(bias_f), keepdims=0), zero_f)
    mask5 = GroupedHeads(mask, hkv)
    mask_cols = op.Shape(mask, start=3, end=4)
    use_mask = op.Not(op.Cast(op.ReduceMin(op.Cast(mask, to=6), keepdims=0), to=9))

    # ---- the visible band: rows i' = i + offset, keys in [i' - left, i' + right] -----------
    sq = op.Squeeze(op.Shape(Q, start=1, end=2))
    sk = op.Squeeze(op.Shape(K, start=1, end=2))
    left, right, use_window = AttentionWindow(sq, sk, causal=causal, window_left=window_left,
                                              window_right=window_right)
    offset = op.Where(op.Equal(alignment_t, zero), op.Sub(sk, sq), zero)
    rows = op.Unsqueeze(op.Add(op.Range(zero, sq, one), offset), [1])                 # (Sq, 1)
    alibi_rows = op.Unsqueeze(op.Add(op.Range(zero, sq, one), op.Sub(sk, sq)), [1])   # ALiBi: always bottom-right
    # Key blocks that no row can see are never visited.
    col_lo = op.Max(zero, op.Sub(offset, left))
    col_hi = op.Min(sk, op.Add(op.Add(op.Sub(sq, one), offset), op.Add(right, one)))
    col_hi = op.Max(col_hi, col_lo)

    # ---- stages 0-7 over the keys [col_lo, col_hi) ---------------------------------------------
    Y, LSE = FlashAttentionLoop(Q, K, V, hq, hkv, alibi_slopes, bias5, bias_cols, mask5, mask_cols, use_bias,
                                use_mask, rows, alibi_rows, left, right, use_window, sk, no, col_lo, col_hi,
                                scale=scale, softcap=softcap, block_size=block_size)
    return Y, LSE


# ----- KV-cache helpers (shared by FlashAttentionKVCache and FlashAttentionPagedKVCache) --------

@script(portattn_opset, default_opset=op)
def KVCacheSlots(cache_seqlens, n_new, cap):
    """Where the append writes: ``src (B, T)`` (which new key), ``pos (B, T)`` (which cache
    position, in ``[0, cap)``), ``fits (B, 1, 1, 1)`` and the lengths after it ``n_keys (B,)``.

    ``K_new[b, t]`` goes to position ``cache_seqlens[b] + t`` (flash-attn's in-place write).
    Lengths are clamped into ``[0, cap]``; new keys that would land beyond the capacity are not
    written: their position is clamped to the last one the sequence may write, which gets the same
    value from every duplicate (the last new key that fits, or its own old value when none fits).
    """
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    one1 = op.Constant(value_ints=[1])
    start = op.Min(op.Max(op.Cast(cache_seqlens, to=7), zero), cap)            # (B,)
    room = op.Sub(op.Sub(cap, one), start)                                      # last new index that fits
    t = op.Range(zero, op.Min(n_new, cap), one)                                 # (T,)
    src = op.Min(op.Unsqueeze(t, [0]), op.Unsqueeze(op.Max(room, zero), [1]))   # (B, T)
    pos = op.Min(op.Add(op.Unsqueeze(start, [1]), src), op.Sub(cap, one))      # (B, T)
    fits = op.Reshape(op.GreaterOrEqual(room, zero), op.Concat(op.Shape(cache_seqlens), one1, one1, one1, axis=0),
                      allowzero=1)
    n_keys = op.Min(op.Add(start, n_new), cap)                                  # (B,) L_b
    return src, pos, fits, n_keys


@script(portattn_opset, default_opset=op)
def KVCacheWrite(cache, new, slots, src, fits):
    """``cache`` with ``new[b, src[b, t]]`` written at ``slots[b, t]`` (indices into the cache's
    first two axes) where the sequence ``fits``, its old value elsewhere."""
    old = op.Cast(op.GatherND(cache, slots), to=1)
    fresh = op.Cast(op.GatherND(new, op.Unsqueeze(src, [2]), batch_dims=1), to=1)
    # the choice in float32 (exact for every T; onnxruntime's CPU Where has no bfloat16), (B, T) rows only
    return op.ScatterND(cache, slots, op.CastLike(op.Where(fits, fresh, old), cache))


@script(portattn_opset, default_opset=op)
def KVCacheBand(Q, n_keys, cap, causal: int = 0, alignment: int = 0, window_left: int = -1, window_right: int = -1):
    """The per-sequence band (``Sk = L_b``): aligned rows ``i' = i + L_b - Sq`` (bottom-right) or
    ``i``, shaped ``(B, 1, 1, Sq, 1)``; ALiBi's rows; ``key_len (B, 1, 1, 1, 1)``; the effective
    window (:func:`AttentionWindow`); the key range ``[col_lo, col_hi)`` that some row of some
    sequence can see."""
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    one1 = op.Constant(value_ints=[1])
    alignment_t = op.Constant(value_int=alignment)
    batch = op.Shape(Q, start=0, end=1)
    seq_q = op.Shape(Q, start=1, end=2)
    sq = op.Squeeze(seq_q)
    left, right, use_window = AttentionWindow(sq, cap, causal=causal, window_left=window_left,
                                              window_right=window_right)
    offset = op.Where(op.Equal(alignment_t, zero), op.Sub(n_keys, sq), op.Mul(n_keys, zero))   # (B,)
    rows5 = op.Concat(batch, one1, one1, seq_q, one1, axis=0)
    i = op.Unsqueeze(op.Range(zero, sq, one), [0])                                            # (1, Sq)
    rows = op.Reshape(op.Add(i, op.Unsqueeze(offset, [1])), rows5, allowzero=1)
    alibi_rows = op.Reshape(op.Add(i, op.Unsqueeze(op.Sub(n_keys, sq), [1])), rows5, allowzero=1)
    key_len = op.Reshape(n_keys, op.Concat(batch, one1, one1, one1, one1, axis=0), allowzero=1)
    # keys no row of any sequence can see are never visited (a batch of 0 visits none)
    col_lo = op.Max(zero, op.ReduceMin(op.Concat(op.Sub(offset, left), op.Reshape(cap, [1]), axis=0), keepdims=0))
    last = op.Add(op.Add(op.Sub(offset, one), sq), op.Add(right, one))                       # (B,) band end
    col_hi = op.ReduceMax(op.Concat(op.Min(n_keys, last), op.Reshape(zero, [1]), axis=0), keepdims=0)
    col_hi = op.Max(col_hi, col_lo)
    return rows, alibi_rows, key_len, left, right, col_lo, col_hi, use_window


@script(portattn_opset, default_opset=op)
def KVCacheAttend(Q, k_vis, v_vis, alibi_slopes, rows, alibi_rows, key_len, left, right, col_lo, col_hi,
                  use_window, scale: float = 1.0, softcap: float = 0.0, block_size: int = 256):
    """Attention of Q over the visible cache slots ``k_vis``/``v_vis (B, >= col_hi, Hkv, D/Dv)``
    with per-sequence key lengths: :func:`FlashAttentionLoop` over ``[col_lo, col_hi)`` with the
    band of :func:`KVCacheBand`, no bias and no mask."""
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    one1 = op.Constant(value_ints=[1])
    zero_f = op.Constant(value_float=0.0)
    yes = op.Cast(one, to=9)
    no = op.Cast(zero, to=9)
    hq = op.Shape(Q, start=2, end=3)
    hkv = op.Shape(k_vis, start=2, end=3)
    Y, LSE = FlashAttentionLoop(Q, k_vis, v_vis, hq, hkv, alibi_slopes, zero_f, one1, yes, one1, no, no,
                                rows, alibi_rows, left, right, use_window, key_len, yes, col_lo, col_hi,
                                scale=scale, softcap=softcap, block_size=block_size)
    return Y, LSE


# ----- portattn.FlashAttentionKVCache ------------------------------------------------------------

@script(portattn_opset, default_opset=op)
def FlashAttentionKVCache(Q, K_cache, V_cache, K_new, V_new, cache_seqlens, alibi_slopes,
                          scale: float = 1.0, causal: int = 0, alignment: int = 0,
                          window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                          block_size: int = 256):
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    cap = op.Squeeze(op.Shape(K_cache, start=1, end=2))
    n_new = op.Squeeze(op.Shape(K_new, start=1, end=2))

    # ---- append at (b, cache_seqlens[b] + t) ---------------------------------------------------
    src, pos, fits, n_keys = KVCacheSlots(cache_seqlens, n_new, cap)
    rows_b = op.Expand(op.Unsqueeze(op.Range(zero, op.Squeeze(op.Shape(Q, start=0, end=1)), one), [1]),
                       op.Shape(pos))
    slots = op.Concat(op.Unsqueeze(rows_b, [2]), op.Unsqueeze(pos, [2]), axis=2)   # (B, T, 2)
    K_present = KVCacheWrite(K_cache, K_new, slots, src, fits)
    V_present = KVCacheWrite(V_cache, V_new, slots, src, fits)

    # ---- attend to the slots [0, col_hi) only: a decode step costs O(max_b L_b), not O(S_max) ---
    rows, alibi_rows, key_len, left, right, col_lo, col_hi, use_window = KVCacheBand(
        Q, n_keys, cap, causal=causal, alignment=alignment, window_left=window_left, window_right=window_right)
    hi_1d = op.Reshape(col_hi, [1])
    k_vis = op.Slice(K_present, [0], hi_1d, [1])
    v_vis = op.Slice(V_present, [0], hi_1d, [1])
    Y, LSE = KVCacheAttend(Q, k_vis, v_vis, alibi_slopes, rows, alibi_rows, key_len, left, right, col_lo, col_hi,
                           use_window, scale=scale, softcap=softcap, block_size=block_size)
    return Y, K_present, V_present, LSE


# ----- portattn.FlashAttentionPagedKVCache -------------------------------------------------------

@script(portattn_opset, default_opset=op)
def FlashAttentionPagedKVCache(Q, K_cache, V_cache, K_new, V_new, cache_seqlens, block_table, alibi_slopes,
                               scale: float = 1.0, causal: int = 0, alignment: int = 0,
                               window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                               block_size: int = 256):
    zero = op.Constant(value_int=0)
    one = op.Constant(value_int=1)
    num_pages = op.Squeeze(op.Shape(K_cache, start=0, end=1))
    page_size = op.Squeeze(op.Shape(K_cache, start=1, end=2))
    table = op.Cast(block_table, to=7)                                          # (B, max_pages)
    cap = op.Mul(op.Squeeze(op.Shape(table, start=1, end=2)), page_size)       # max_pages · page_size
    n_new = op.Squeeze(op.Shape(K_new, start=1, end=2))
    last_page = op.Sub(num_pages, one)

    # ---- append: position p of sequence b is row p % page_size of page block_table[b, p // page_size]
    src, pos, fits, n_keys = KVCacheSlots(cache_seqlens, n_new, cap)
    page = op.Min(op.Max(op.GatherElements(table, op.Div(pos, page_size), axis=1), zero), last_page)
    slots = op.Concat(op.Unsqueeze(page, [2]), op.Unsqueeze(op.Mod(pos, page_size), [2]), axis=2)   # (B, T, 2)
    K_present = KVCacheWrite(K_cache, K_new, slots, src, fits)
    V_present = KVCacheWrite(V_cache, V_new, slots, src, fits)

    # ---- gather the pages holding the slots [0, col_hi) into (B, pages · page_size, Hkv, D) ------
    rows, alibi_rows, key_len, left, right, col_lo, col_hi, use_window = KVCacheBand(
        Q, n_keys, cap, causal=causal, alignment=alignment, window_left=window_left, window_right=window_right)
    n_vis = op.Div(op.Sub(op.Add(col_hi, page_size), one), page_size)
    pages = op.Min(op.Max(op.Slice(table, [0], op.Reshape(n_vis, [1]), [1]), zero), last_page)   # (B, n_vis)
    k_pages = op.Gather(K_present, pages, axis=0)                             # (B, n_vis, page, Hkv, D)
    v_pages = op.Gather(V_present, pages, axis=0)
    batch = op.Shape(Q, start=0, end=1)
    flat = op.Concat(batch, op.Reshape(op.Mul(n_vis, page_size), [1]), axis=0)
    k_vis = op.Reshape(k_pages, op.Concat(flat, op.Shape(K_cache, start=2, end=4), axis=0), allowzero=1)
    v_vis = op.Reshape(v_pages, op.Concat(flat, op.Shape(V_cache, start=2, end=4), axis=0), allowzero=1)
    Y, LSE = KVCacheAttend(Q, k_vis, v_vis, alibi_slopes, rows, alibi_rows, key_len, left, right, col_lo, col_hi,
                           use_window, scale=scale, softcap=softcap, block_size=block_size)
    return Y, K_present, V_present, LSE


#: the KV-cache helpers
KV_HELPERS = (KVCacheSlots, KVCacheWrite, KVCacheBand, KVCacheAttend)

#: op name -> its onnxscript function
OPS = {"FlashAttention": FlashAttention, "FlashAttentionKVCache": FlashAttentionKVCache,
       "FlashAttentionPagedKVCache": FlashAttentionPagedKVCache}
