"""Triton kernels of the ``triton`` backend: FlashAttention-2 forward and backward.

Every kernel works on the canonical layout of :class:`portattn.spec.AttentionSpec` through
strides (last dimension contiguous): dense ``(B, S, H, D)`` or varlen ``(total, H, D)`` with
``cu_seqlens`` (then the batch stride is 0 and each sequence starts at ``cu_seqlens[b]``).

Conventions shared by all kernels (docs/semantics.md):

* scores live in base 2: ``s2 = log2(e) · s`` so that ``exp2`` replaces ``exp``; the softmax
  scale and log2(e) are folded into one multiplier ``qk_scale2``;
* the aligned row of query ``i`` is ``i + off`` with ``off = Sk - Sq`` (bottom-right) or 0
  (top-left); key ``j`` is visible iff ``row - window_left <= j <= row + window_right``
  (an unbounded side is passed as a huge number);
* key loops run in three phases: masked tiles at the band's start, unmasked tiles fully inside
  the band (no per-element mask at all), masked tiles at the band's end; tiles outside the
  band are never visited;
* one tile width ``BLOCK_D`` (a power of two ≥ 16) for both head dims: Q/K columns are masked at
  ``HEAD_D``, V/O columns at ``HEAD_DV`` (separate widths gave NaN and illegal memory accesses
  for fp16/bf16 on the H200 with triton 3.6, 2026-11-29);
* ``lse`` is stored in natural log; a row with no visible key has ``l_i = 0``: output 0 and
  ``lse = -inf``;
* the backward's row statistics: 16-bit autograd calls take them from the forward's ``lse`` and
  delta from the unrounded output (O plus the forward's rounding residual); float32, and calls
  without the residual, recompute the max ``m`` and sum ``l`` exactly as the forward does and keep
  them apart (see the backward section below, and docs/triton.md).

By default nothing uses atomics: dK/dV and dQ are computed by separate kernels that each own
their output tile, so gradients are bit-identical across runs by construction. Only when
determinism is not requested may the host pick FlashAttention-2's atomic dQ (``attn_bwd_dkdv``
with ``DQ_ATOMIC``: dQ accumulated in float32 with atomic adds, the dQ kernel skipped).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# Triton's interpreter (3.9) multiplies bfloat16 dot operands as their raw uint16 bits; when it
# is on (read, like triton does, when the kernels are defined) bf16 operands are widened first.
_INTERPRETER_BF16_DOT_FIX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"))

# bias modes (constexpr BIAS_MODE)
BIAS_NONE = 0
BIAS_ADD = 1
BIAS_BOOL = 2


# ----- small helpers ------------------------------------------------------------------------

@triton.jit
def _mm(a, b, acc, IEEE_: tl.constexpr):
    """acc + a @ b in float32 (acc None: a fresh accumulator); ``IEEE`` forces true float32
    products for float32 inputs (otherwise the target's default: TF32 on NVIDIA)."""
    if _INTERPRETER_BF16_DOT_FIX:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    if IEEE_:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _scores(q, k, IEEE_: tl.constexpr):
    """``Q Kᵀ`` of one tile, (BLOCK_M, D) x (BLOCK_N, D) -> (BLOCK_M, BLOCK_N) float32.

    On the ``IEEE`` (float32-input) path the head-dim sum is accumulated in float64 and rounded
    once: the GPU lowers a float32 dot to one FMA chain of D terms per score, whose rounding
    (growing with D) is, after the exponential, a relative error of every P. On the H200 that
    chain alone gave dV 5.9x and O 2.7x the naive error at Sq=1, D=32 (2026-11-29, reproduced to
    four digits by a float32 emulation of the chain). Products of float32 values are exact in
    float64, so the score is the float32 rounding of the exact dot product.
    """
    if IEEE_:
        return tl.dot(q.to(tl.float64), tl.trans(k).to(tl.float64), input_precision="ieee").to(tl.float32)
    else:
        return _mm(q, tl.trans(k), None, IEEE_)


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype``, to nearest even as the GPU does. Triton's 3.9
    interpreter truncates float32 → bfloat16 (even with fp_downcast_rounding="rtne"), which
    made CPU results one bf16 ulp off towards 0; there the rounding is done on the bits."""
    if _INTERPRETER_BF16_DOT_FIX:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _load_tile(ptrs, rows, row_limit, cols, HEAD: tl.constexpr, BLOCK: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load a (rows, BLOCK) tile, zero-filling rows >= row_limit and head columns >= HEAD."""
    if CHECK_ROWS:
        if HEAD == BLOCK:
            x = tl.load(ptrs, mask=rows[:, None] < row_limit, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < row_limit) & (cols[None, :] < HEAD), other=0.0)
    else:
        if HEAD == BLOCK:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols[None, :] < HEAD, other=0.0)
    return x


@triton.jit
def _store_tile(ptrs, x, rows, row_limit, cols, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    if HEAD == BLOCK:
        tl.store(ptrs, x, mask=rows[:, None] < row_limit)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < row_limit) & (cols[None, :] < HEAD))


@triton.jit
def _div(x, y, IEEE: tl.constexpr):
    """x / y; with ``IEEE`` (float32 inputs) correctly rounded. Triton's ``/`` on float32 compiles
    to ``div.full.f32`` for NVIDIA (approximate, up to 2 ulp; checked in the sm_90 PTX), which
    left the H200's float32 outputs ~2x further from the reference than the naive float32 math,
    whose division is IEEE."""
    if IEEE:
        return tl.math.div_rn(x, y)
    else:
        return x / y


@triton.jit
def _tanh(x, IEEE: tl.constexpr):
    """tanh in float32 without libdevice (portable to every target and the interpreter).

    |x| < 0.4: the odd Taylor polynomial to x¹³ (truncation < 2e-9 relative, below float32's
    ulp); elsewhere sign(x)·(1 - e)/(1 + e) with e = exp(-2|x|) ∈ (0, 0.45], where 1 - e no
    longer cancels. The old form 2/(1 + e) - 1 lost ~log2(1/|x|) bits for small |x|.
    """
    ax = tl.abs(x)
    e = tl.exp2(ax * (-2.0 * LOG2E))
    big = _div(1.0 - e, 1.0 + e, IEEE)
    big = tl.where(x < 0, -big, big)
    x2 = x * x
    poly = -929569.0 / 638512875.0
    poly = poly * x2 + 21844.0 / 6081075.0
    poly = poly * x2 - 1382.0 / 155925.0
    poly = poly * x2 + 62.0 / 2835.0
    poly = poly * x2 - 17.0 / 315.0
    poly = poly * x2 + 2.0 / 15.0
    poly = poly * x2 - 1.0 / 3.0
    small = x + x * x2 * poly
    return tl.where(ax < 0.4, small, big)


@triton.jit
def _seq_span(CU, b, max_len, total):
    """(start, length) of sequence ``b`` from ``cu_seqlens``, clamped so that a bad one (its
    contents are not validated under torch.compile or graph capture) can never read or write
    out of bounds: start in [0, total], end in [start, total], length <= max_len."""
    start = tl.minimum(tl.maximum(tl.load(CU + b), 0), total)
    end = tl.minimum(tl.maximum(tl.load(CU + b + 1), start), total)
    return start, tl.minimum(end - start, max_len)


@triton.jit
def _seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, total_q, total_k, IS_VARLEN: tl.constexpr):
    """(q_start, sq, k_start, sk) of sequence ``b``; varlen: clamped by :func:`_seq_span` into
    the ``total_q``/``total_k`` packed rows and the max lengths ``seqlen_q``/``seqlen_k``."""
    if IS_VARLEN:
        q_start, sq = _seq_span(CU_Q, b, seqlen_q, total_q)
        k_start, sk = _seq_span(CU_K, b, seqlen_k, total_k)
    else:
        zero = b * 0   # tensors, even when a length was specialised to a constant
        q_start = zero
        sq = seqlen_q + zero
        k_start = zero
        sk = seqlen_k + zero
    return q_start, sq, k_start, sk


@triton.jit
def _key_phases(m0, sq, sk, off, window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key-tile bounds for the query tile starting at ``m0``.

    Returns (lo, full_lo, full_hi, hi): tiles in [lo, full_lo) and [full_hi, hi) need the
    element mask, tiles in [full_lo, full_hi) are fully visible to every row of the tile.
    """
    r0 = m0 + off
    r1 = tl.minimum(m0 + BLOCK_M, sq) - 1 + off
    lo = tl.maximum(r0 - window_left, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(r1 + window_right + 1, sk)
    full_lo = tl.maximum(r1 - window_left, 0)
    full_lo = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), tl.maximum(hi, lo))
    full_hi = (tl.maximum(r0 + window_right + 1, 0) // BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(full_hi, (sk // BLOCK_N) * BLOCK_N)
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_phases(n0, sq, sk, off, window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query-tile bounds for the key tile starting at ``n0`` (mirror of :func:`_key_phases`).

    Row ``i`` sees key ``j`` iff ``j - right - off <= i <= j + left - off``.
    """
    c1 = tl.minimum(n0 + BLOCK_N, sk) - 1
    lo = tl.maximum(n0 - window_right - off, 0)
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = tl.minimum(c1 + window_left - off + 1, sq)
    full_lo = tl.maximum(n0 + BLOCK_N - 1 - window_right - off, 0)
    full_lo = ((full_lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), tl.maximum(hi, lo))
    full_hi = (tl.maximum(n0 + window_left - off + 1, 0) // BLOCK_M) * BLOCK_M
    full_hi = tl.minimum(full_hi, (sq // BLOCK_M) * BLOCK_M)
    if n0 + BLOCK_N > sk:   # a ragged key tile is never mask-free
        full_hi = full_lo
    full_hi = tl.maximum(full_hi, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _exp2_diff(s, m, qk_scale2, RAW_SCORES: tl.constexpr):
    """exp2 of base-2 score minus max. With raw scores ``(qk - m)`` is formed first — exact for the
    keys near the max (Sterbenz), so P carries the rounding of ``qk`` alone, as the naive
    ``softmax((q·scale) kᵀ)`` does — and scaled after; scaling each ``qk`` first added one more
    rounding of ``ulp(|s|)`` to every P (float32 at large logits: ~2x the naive error)."""
    if RAW_SCORES:
        return tl.exp2((s - m) * qk_scale2)
    else:
        return tl.exp2(s - m)


@triton.jit
def _online_max(m_i, s, qk_scale2, RAW_SCORES: tl.constexpr):
    """One tile's step of the online softmax, shared by the forward and the backward's statistics
    pass so that both see the same (m, P): ``(m_new, alpha, p)`` with the running max ``m_new``,
    the rescale ``alpha = exp2(m_i - m_new)`` of what was summed so far and the tile's
    unnormalised ``p = exp2(s - m_new)``. A row with nothing visible yet keeps m = -inf and
    subtracts 0 instead (no -inf - -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = _exp2_diff(m_i, m_safe, qk_scale2, RAW_SCORES)
    p = _exp2_diff(s, m_safe[:, None], qk_scale2, RAW_SCORES)
    return m_new, alpha, p


@triton.jit
def _logits(qk, rows, cols, sq, sk, off, bias_ptrs, stride_bm, stride_bn, slope2,
            qk_scale2, softcap_scale, softcap2, window_left, window_right,
            MASKED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS_MODE: tl.constexpr,
            RAW_SCORES: tl.constexpr, IEEE: tl.constexpr):
    """Scores in base 2 from raw ``qk = q·kᵀ``; ``rows``/``cols`` are the query and key indices
    as broadcastable 2-D tensors (``offs_m[:, None]``, ``offs_n[None, :]`` for a (query, key)
    tile; ``offs_m[None, :]``, ``offs_n[:, None]`` for the transposed (key, query) tile of the
    dK/dV kernel), so one function serves both orientations.

    Applies, in docs/semantics.md's order: scale, softcap, ALiBi, additive bias / bool mask,
    causal-window and bounds mask (``MASKED`` tiles only). Returns (s2, t) with
    ``t = tanh(scale·qk/c)`` when ``SOFTCAP`` (the backward needs it), else ``qk``.

    ``RAW_SCORES`` (no softcap, ALiBi or float bias, so the score is ``qk_scale2·qk``): s is
    ``qk`` itself, and the scale is applied after the max is subtracted (:func:`_exp2_diff`).
    """
    # 1-2. scale (and softcap c·tanh(s/c)), in base 2
    if SOFTCAP:
        t = _tanh(qk * softcap_scale, IEEE)
        s = t * softcap2
    else:
        t = qk
        if RAW_SCORES:
            s = qk
        else:
            s = qk * qk_scale2
    # 3. ALiBi: -slope·|i + Sk - Sq - j| (always the bottom-right distance)
    if ALIBI:
        dist = (rows + (sk - sq) - cols).to(tl.float32)
        s = s - slope2 * tl.abs(dist)
    # 4. additive bias or bool mask, loaded through its strides (stride 0 = broadcast)
    if BIAS_MODE != 0:
        ptrs = bias_ptrs + rows * stride_bm + cols * stride_bn
        in_bounds = (rows < sq) & (cols < sk)
        if BIAS_MODE == 1:
            s = s + tl.load(ptrs, mask=in_bounds, other=0.0).to(tl.float32) * LOG2E
        else:
            keep = tl.load(ptrs, mask=in_bounds, other=0) != 0
            s = tl.where(keep, s, float("-inf"))
    # 5. causal / sliding window on the aligned row, and the key bound
    if MASKED:
        aligned = rows + off
        visible = (cols < sk) & (cols >= aligned - window_left) & (cols <= aligned + window_right)
        s = tl.where(visible, s, float("-inf"))
    return s, t


@triton.jit
def _phase_range(phase: tl.constexpr, lo, full_lo, full_hi, hi):
    """Tile range of one phase of a band loop: 0 = masked tiles at the band's start, 1 = tiles
    fully inside the band (no element mask), 2 = masked tiles at its end. Kernels run
    ``for phase in tl.static_range(3)`` and pass ``MASKED = phase != 1`` to their band helper."""
    if phase == 0:
        return lo, full_lo
    elif phase == 1:
        return full_lo, full_hi
    else:
        return full_hi, hi


@triton.jit
def _tile_order(pid, n_tiles, LONGEST_FIRST: tl.constexpr):
    """The tile a program works on: with ``LONGEST_FIRST`` (a causal or windowed band, where the
    last query tiles see the most keys) the grid's first programs take the last tiles, so the
    long ones start early and the short ones fill the tail of the schedule."""
    if LONGEST_FIRST:
        return n_tiles - 1 - pid
    else:
        return pid


@triton.jit
def _query_tile(CU_Q, CU_K, num_heads_q, gqa_ratio, seqlen_q, seqlen_k, total_q, total_k,
                BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr, LONGEST_FIRST: tl.constexpr):
    """The prologue of a Q-stationary program (forward, dQ), grid (cdiv(Sq, BLOCK_M), B·Hq):
    ``(b, h, h_kv, q_start, sq, k_start, sk, m0)`` — its batch, query head and KV head (GQA/MQA:
    K/V are shared, never copied), its sequence's bounds (:func:`_seq_bounds`) and the first row
    ``m0`` of its query tile (:func:`_tile_order`). The kernel returns where ``m0 >= sq``."""
    pid_m = _tile_order(tl.program_id(0), tl.num_programs(0), LONGEST_FIRST)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads_q
    h = pid_bh % num_heads_q
    h_kv = h // gqa_ratio
    q_start, sq, k_start, sk = _seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, total_q, total_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    return b, h, h_kv, q_start, sq, k_start, sk, m0


@triton.jit
def _causal_offset(sq, sk, BOTTOM_RIGHT: tl.constexpr):
    """``off``, the key a query row ``i`` is aligned with is ``i + off``: Sk − Sq with bottom-right
    alignment (the last query row sees the last key), 0 with top-left."""
    if BOTTOM_RIGHT:
        off = sk - sq
    else:
        off = sk * 0
    return off


@triton.jit
def _kv_bases(K, V, b64, k_start, h_kv, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh):
    """``(k_base, v_base)``: the first element of K's and V's ``(S, D)`` slab of sequence ``b64``
    (its first packed row ``k_start``) and KV head ``h_kv``."""
    k_base = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + h_kv.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + h_kv.to(tl.int64) * stride_vh
    return k_base, v_base


@triton.jit
def _alibi_slope2(SLOPES, b, h, num_heads_q, ALIBI: tl.constexpr):
    """ALiBi's slope of (batch ``b``, query head ``h``) from ``SLOPES`` (float32 ``(B, Hq)``,
    contiguous) times log2(e), for the base-2 scores; 0.0 without ``ALIBI``."""
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(SLOPES + b * num_heads_q + h) * LOG2E
    return slope2

# ----- forward ------------------------------------------------------------------------------

@triton.jit
def _load_kv(src, start_n, stride_s, cols, sk, offs_d, HEAD: tl.constexpr, BLOCK_D: tl.constexpr,
             MASKED: tl.constexpr, TMA: tl.constexpr):
    """The (BLOCK_N, BLOCK_D) K or V tile of keys ``start_n + offs_n``: through a tensor descriptor
    (``TMA``, sm_90+: the copy engine zero-fills rows >= Sk and columns >= HEAD, as the masked load
    does) or through pointers (``src`` = the tile's pointers at key 0)."""
    if TMA:
        return src.load([start_n, 0])
    else:
        return _load_tile(src + start_n * stride_s, cols, sk, offs_d, HEAD, BLOCK_D, MASKED)


@triton.jit
def _fwd_band(acc, l_i, m_i, q, k_src, v_src, bias_ptrs, lo, hi, offs_m, offs_n, offs_d,
              sq, sk, off, stride_ks, stride_vs, stride_bm, stride_bn, slope2,
              qk_scale2, softcap_scale, softcap2, window_left, window_right,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS_MODE: tl.constexpr,
              IEEE: tl.constexpr, RAW_SCORES: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr):
    """The online softmax over key tiles ``[lo, hi)``: update (acc, l_i, m_i) tile by tile. K and V
    come from :func:`_load_kv`; ``WS`` asks triton to warp-specialise the loop (producer warps
    issue the loads, consumer warpgroups do the products: Hopper/Blackwell only)."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        cols = start_n + offs_n
        # S = Q Kᵀ for this tile
        k = _load_kv(k_src, start_n, stride_ks, cols, sk, offs_d, HEAD_D, BLOCK_D, MASKED, TMA)
        qk = _scores(q, k, IEEE)
        s, _ = _logits(qk, offs_m[:, None], cols[None, :], sq, sk, off, bias_ptrs, stride_bm, stride_bn, slope2,
                       qk_scale2, softcap_scale, softcap2, window_left, window_right,
                       MASKED, SOFTCAP, ALIBI, BIAS_MODE, RAW_SCORES, IEEE)
        m_new, alpha, p = _online_max(m_i, s, qk_scale2, RAW_SCORES)
        # rescale the running sum and accumulator, then add P V
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv(v_src, start_n, stride_vs, cols, sk, offs_d, HEAD_DV, BLOCK_D, MASKED, TMA)
        acc = _mm(_round_to(p, v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new
    return acc, l_i, m_i


#: sizes and the lse strides (H·S) are not specialised on (divisibility by 16, == 1): a new
#: sequence length reuses the compiled kernels (docs/triton.md, "Compiles")
_SIZES = ("seqlen_q", "seqlen_k", "total_q", "total_k", "stride_lb", "stride_lh")


@triton.jit
def _store_o(dst, o_offs, x, m0, offs_m, sq, offs_d, stride_os, HEAD_DV: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_D: tl.constexpr, TMA: tl.constexpr):
    """Store the (BLOCK_M, BLOCK_D) tile ``x`` of an output laid out like O at rows ``m0 …``:
    with ``TMA`` through a tensor descriptor of the ``(sq, HEAD_DV)`` slab at ``dst + o_offs``
    (the (sequence, head)'s int64 offset), else at the element offsets ``o_offs``; both clip to
    the slab."""
    if TMA:
        tl.make_tensor_descriptor(dst + o_offs, [sq, HEAD_DV], [stride_os, 1], [BLOCK_M, BLOCK_D]).store([m0, 0], x)
    else:
        _store_tile(dst + o_offs, x, offs_m, sq, offs_d, HEAD_DV, BLOCK_D)


@triton.jit(do_not_specialize=_SIZES)
def attn_fwd(
    Q, K, V, O, ORES, LSE, BIAS, SLOPES, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    num_heads_q, gqa_ratio, seqlen_q, seqlen_k, total_q, total_k,
    qk_scale2, softcap_scale, softcap2, window_left, window_right,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    BIAS_MODE: tl.constexpr, IEEE: tl.constexpr, RAW_SCORES: tl.constexpr, LONGEST_FIRST: tl.constexpr,
    RESIDUAL: tl.constexpr, TMA: tl.constexpr = False, WS: tl.constexpr = False,
):
    """O = softmax(scale·QKᵀ + bias)V for one (query tile, batch·head); writes O and lse, and with
    ``RESIDUAL`` (a 16-bit forward whose backward follows) ``ORES`` = the rounding residual
    O_f32 − round(O_f32) in O's dtype and strides, so that the backward's delta = rowsum(dO ∘ O)
    is taken of the unrounded output.

    ``TMA`` (sm_90+, chosen by configs.forward_config and checked by the host: 16-byte aligned
    bases and row strides): Q, K, V are loaded and O (and ORES) stored through device-side tensor
    descriptors of each (sequence, head)'s ``(S, D)`` slab, whose bounds replace the element masks
    (same values: zero fill on loads, clipped stores); ``WS`` asks for warp-specialised key loops
    (cross-compiled for sm_90 with triton 3.6 and 3.9: ignored at 8 warps, and the Hopper pass
    fails on the three phase loops at 4). With both off the kernel is the portable pointer version."""
    b, h, h_kv, q_start, sq, k_start, sk, m0 = _query_tile(CU_Q, CU_K, num_heads_q, gqa_ratio, seqlen_q, seqlen_k,
                                                           total_q, total_k, BLOCK_M, IS_VARLEN, LONGEST_FIRST)
    if m0 >= sq:
        return
    off = _causal_offset(sq, sk, BOTTOM_RIGHT)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    b64 = b.to(tl.int64)
    q_base = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h.to(tl.int64) * stride_qh
    k_base, v_base = _kv_bases(K, V, b64, k_start, h_kv, stride_kb, stride_ks, stride_kh,
                               stride_vb, stride_vs, stride_vh)
    k_ptrs = k_base + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_d[None, :]
    bias_ptrs = BIAS + b64 * stride_bb + h.to(tl.int64) * stride_bh
    slope2 = _alibi_slope2(SLOPES, b, h, num_heads_q, ALIBI)

    # the query tile stays resident for the whole key loop
    if TMA:
        k_src = tl.make_tensor_descriptor(k_base, [sk, HEAD_D], [stride_ks, 1], [BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, [sk, HEAD_DV], [stride_vs, 1], [BLOCK_N, BLOCK_D])
        q = tl.make_tensor_descriptor(q_base, [sq, HEAD_D], [stride_qs, 1], [BLOCK_M, BLOCK_D]).load([m0, 0])
    else:
        k_src = k_ptrs
        v_src = v_ptrs
        q = _load_tile(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], offs_m, sq, offs_d,
                       HEAD_D, BLOCK_D, True)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _key_phases(m0, sq, sk, off, window_left, window_right, BLOCK_M, BLOCK_N)
    for phase in tl.static_range(3):
        start, stop = _phase_range(phase, lo, full_lo, full_hi, hi)
        acc, l_i, m_i = _fwd_band(acc, l_i, m_i, q, k_src, v_src, bias_ptrs, start, stop, offs_m, offs_n, offs_d,
                                  sq, sk, off, stride_ks, stride_vs, stride_bm, stride_bn, slope2,
                                  qk_scale2, softcap_scale, softcap2, window_left, window_right,
                                  HEAD_D, HEAD_DV, BLOCK_D, BLOCK_N, phase != 1, SOFTCAP, ALIBI, BIAS_MODE,
                                  IEEE, RAW_SCORES, TMA, WS)

    # normalise once; rows with no visible key output 0 and lse = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = _div(acc, l_safe[:, None], IEEE)
    if RAW_SCORES:
        m_i = m_i * qk_scale2
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    # O and its residual share one layout: the (sequence, head)'s offset (TMA), or every element's
    o_offs = b64 * stride_ob + q_start.to(tl.int64) * stride_os + h.to(tl.int64) * stride_oh
    if not TMA:
        o_offs = o_offs + offs_m[:, None] * stride_os + offs_d[None, :]
    out16 = _round_to(out, O.dtype.element_ty)
    _store_o(O, o_offs, out16, m0, offs_m, sq, offs_d, stride_os, HEAD_DV, BLOCK_M, BLOCK_D, TMA)
    if RESIDUAL:   # O_f32 - round(O_f32), for the backward's delta of the unrounded output
        res = _round_to(out - out16.to(tl.float32), O.dtype.element_ty)
        _store_o(ORES, o_offs, res, m0, offs_m, sq, offs_d, stride_os, HEAD_DV, BLOCK_M, BLOCK_D, TMA)
    l_ptrs = LSE + b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m
    tl.store(l_ptrs, lse, mask=offs_m < sq)


# ----- backward -----------------------------------------------------------------------------
# dS = P ∘ (dP − delta) with P = exp2(S − m)/l, dP = dO Vᵀ and delta_i = Σ_j P_ij dP_ij − dlse_i.
# Row statistics (m, 1/l, delta) come from one of two places (constexpr EXACT_STATS of the dQ kernel):
#  * 16-bit inputs whose forward kept O's rounding residual (eager autograd: the backend's
#    ``forward_for_backward``): :func:`attn_bwd_prep` turns the forward's lse into m = lse·log2(e),
#    1/l = 1 and computes delta = rowsum(dO ∘ (O + residual)) — no pass over the keys (FA2's
#    preprocess, of the unrounded O);
#  * float32 inputs, and 16-bit ones without the residual (the torch.compile custom op, ring
#    attention's blocks): the dQ kernel's first pass recomputes m and l exactly as the forward does and
#    keeps them apart, and delta as Σ_j P_ij dP_ij: folding m and l into a float32 lse costs
#    ulp(|lse|) relative error in every P, and dO·O inherits O's rounding — both visible against
#    float32's naive error, invisible against 16-bit rounding. A row with one visible key then
#    gets P = 1 and dS = 0 exactly, as the math says.
# Then dQ (Q stationary, K/V streaming: 3 products per tile pair) and dK/dV (K/V stationary, Q/dO
# streaming, in the transposed (key, query) orientation so that P and dS feed the dV and dK
# products without a transpose: 4 products; a config with ``split`` runs it as a dV launch and a
# dK launch, 5 products, each program holding one accumulator). Every program owns its output
# tile: no atomics, bit-identical gradients across runs.
# FA2's atomic dQ (constexpr DQ_ATOMIC of the dK/dV kernel; only when determinism is not
# requested, see ops.backward): the dK/dV loop also forms this tile pair's dQ share dS K (one
# product, as (dS K)ᵀ = Kᵀ dSᵀ in the loop's orientation) and adds it into a float32 dQ
# accumulator with atomic adds, and the dQ kernel is not
# launched: 5 products per tile pair instead of 7 (6 instead of 8 with ``split``). The order of
# the additions into dQ then depends on the schedule: dQ is not bit-identical across runs.

@triton.jit
def _load_tile_t(ptrs, rows, row_limit, cols, HEAD: tl.constexpr, BLOCK: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load a transposed (BLOCK, rows) tile: zero-fill rows >= row_limit and head columns >= HEAD."""
    if CHECK_ROWS:
        if HEAD == BLOCK:
            x = tl.load(ptrs, mask=rows[None, :] < row_limit, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[None, :] < row_limit) & (cols[:, None] < HEAD), other=0.0)
    else:
        if HEAD == BLOCK:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=cols[:, None] < HEAD, other=0.0)
    return x


@triton.jit
def _atomic_add_tile_t(ptrs, x, rows, row_limit, cols, HEAD: tl.constexpr, BLOCK: tl.constexpr,
                       CHECK_ROWS: tl.constexpr):
    """Add a transposed (BLOCK, rows) float32 tile into memory atomically (the layout of
    :func:`_load_tile_t`), skipping rows >= row_limit (``CHECK_ROWS``) and head columns >= HEAD.
    Relaxed ordering: only the sum is read, after the launch."""
    if CHECK_ROWS:
        if HEAD == BLOCK:
            tl.atomic_add(ptrs, x, mask=rows[None, :] < row_limit, sem="relaxed")
        else:
            tl.atomic_add(ptrs, x, mask=(rows[None, :] < row_limit) & (cols[:, None] < HEAD), sem="relaxed")
    else:
        if HEAD == BLOCK:
            tl.atomic_add(ptrs, x, sem="relaxed")
        else:
            tl.atomic_add(ptrs, x, mask=cols[:, None] < HEAD, sem="relaxed")


@triton.jit
def _dot_f32(a, b, IEEE_: tl.constexpr):
    """``a @ b`` as float32; on the ``IEEE`` path summed in float64 and rounded once (see :func:`_scores`)."""
    if IEEE_:
        return tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee").to(tl.float32)
    else:
        return _mm(a, b, None, IEEE_)


@triton.jit
def _load_row_stats(ROWMAX, ROWINV, DELTA, row_base, offs_m, sq, EXACT_STATS: tl.constexpr):
    """(m, 1/l, delta) of rows ``offs_m``; rows with no visible key (and rows past the end) read
    m = +inf, 1/l = 0, so that their probabilities are exactly 0. Without ``EXACT_STATS`` m is the
    base-2 lse and l = 1: 1/l is not read (one load fewer per streamed tile in dK/dV), and the
    ``inv_l`` returned is a placeholder that :func:`_probs` ignores."""
    in_rows = offs_m < sq
    m2 = tl.load(ROWMAX + row_base + offs_m, mask=in_rows, other=float("inf"))
    delta = tl.load(DELTA + row_base + offs_m, mask=in_rows, other=0.0)
    if EXACT_STATS:
        inv_l = tl.load(ROWINV + row_base + offs_m, mask=in_rows, other=0.0)
    else:
        inv_l = delta
    return m2, inv_l, delta


@triton.jit
def _probs(s, m2, inv_l, qk_scale2, RAW_SCORES: tl.constexpr, EXACT_STATS: tl.constexpr):
    """P = exp2(S - m) / l from a row's max and reciprocal sum (only m, the base-2 lse, without
    ``EXACT_STATS``), given broadcast to ``s``'s shape (``m[:, None]`` for a (query, key) tile,
    ``m[None, :]`` for a transposed one)."""
    p = _exp2_diff(s, m2, qk_scale2, RAW_SCORES)
    if EXACT_STATS:
        p = p * inv_l
    return p


@triton.jit(do_not_specialize=("seqlen_q", "total_q", "stride_ilb", "stride_ilh", "stride_lb", "stride_lh"))
def attn_bwd_prep(
    O, ORES, DO, LSE, DLSE, ROWMAX, ROWINV, DELTA, CU_Q,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    stride_ilb, stride_ilh, stride_lb, stride_lh,
    num_heads_q, seqlen_q, total_q,
    HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """Row statistics of the 16-bit backward for one (query tile, batch·head), from the forward's
    ``lse`` (read through its strides ``stride_il*``): m = lse·log2(e) and 1/l = 1 (+inf and 0 for
    a row with no visible key, lse = -inf), delta = rowsum(dO ∘ (O + ORES)) − dlse with ``ORES``
    the forward's rounding residual (O's strides): the unrounded output, so delta carries no
    rounding of O — with O alone, |dO|·|O|·2⁻⁹ in every dS made dQ 8–25× the naive error at
    peaked (large-logit) softmaxes, where the exact dS is nearly 0."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads_q
    h = pid_bh % num_heads_q
    if IS_VARLEN:
        q_start, sq = _seq_span(CU_Q, b, seqlen_q, total_q)
    else:
        q_start = b * 0
        sq = seqlen_q + b * 0
    m0 = pid_m * BLOCK_M
    if m0 >= sq:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    in_rows = offs_m < sq
    o_offs = (b64 * stride_ob + q_start.to(tl.int64) * stride_os + h64 * stride_oh
              + offs_m[:, None] * stride_os + offs_d[None, :])
    o = (_load_tile(O + o_offs, offs_m, sq, offs_d, HEAD_DV, BLOCK_D, True).to(tl.float32)
         + _load_tile(ORES + o_offs, offs_m, sq, offs_d, HEAD_DV, BLOCK_D, True).to(tl.float32))
    do = _load_tile(DO + b64 * stride_dob + q_start.to(tl.int64) * stride_dos + h64 * stride_doh
                    + offs_m[:, None] * stride_dos + offs_d[None, :], offs_m, sq, offs_d, HEAD_DV, BLOCK_D, True)
    delta = tl.sum(o * do.to(tl.float32), 1)
    lse = tl.load(LSE + b64 * stride_ilb + h64 * stride_ilh + q_start + offs_m, mask=in_rows, other=float("-inf"))
    empty = lse == float("-inf")
    row_base = b64 * stride_lb + h64 * stride_lh + q_start
    if HAS_DLSE:
        # ∂lse_i/∂s_ij = P_ij: dS = P ∘ (dP − delta + dlse); rows with no visible key read 0
        delta = delta - tl.load(DLSE + row_base + offs_m, mask=in_rows & (lse != float("-inf")), other=0.0)
    tl.store(ROWMAX + row_base + offs_m, tl.where(empty, float("inf"), lse * LOG2E), mask=in_rows)
    tl.store(ROWINV + row_base + offs_m, tl.where(empty, 0.0, 1.0), mask=in_rows)
    tl.store(DELTA + row_base + offs_m, delta, mask=in_rows)


@triton.jit
def _kv_logits(q, k_ptrs, v_ptrs, bias_ptrs, start_n, offs_m, offs_n0, offs_d,
               sq, sk, off, stride_ks, stride_vs, stride_bm, stride_bn,
               slope2, qk_scale2, softcap_scale, softcap2, window_left, window_right,
               HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
               MASKED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS_MODE: tl.constexpr,
               IEEE: tl.constexpr, RAW_SCORES: tl.constexpr):
    """The prologue of one key tile in the dQ kernel's band loops: the K and V tiles of keys
    ``start_n + offs_n0`` and their base-2 logits against the resident Q tile.

    Returns ``(offs_n, k, v, s, t)`` with ``s`` the (BLOCK_M, BLOCK_N) logits of :func:`_logits`
    and ``t`` its softcap residual (``tanh``; raw ``qk`` without softcap)."""
    offs_n = start_n + offs_n0
    k = _load_tile(k_ptrs + start_n * stride_ks, offs_n, sk, offs_d, HEAD_D, BLOCK_D, MASKED)
    v = _load_tile(v_ptrs + start_n * stride_vs, offs_n, sk, offs_d, HEAD_DV, BLOCK_D, MASKED)
    qk = _scores(q, k, IEEE)
    s, t = _logits(qk, offs_m[:, None], offs_n[None, :], sq, sk, off, bias_ptrs, stride_bm, stride_bn, slope2,
                   qk_scale2, softcap_scale, softcap2, window_left, window_right,
                   MASKED, SOFTCAP, ALIBI, BIAS_MODE, RAW_SCORES, IEEE)
    return offs_n, k, v, s, t


@triton.jit
def _stats_band(m_i, l_i, dacc, q, do, k_ptrs, v_ptrs, bias_ptrs, lo, hi, offs_m, offs_n0, offs_d,
                sq, sk, off, stride_ks, stride_vs, stride_bm, stride_bn,
                slope2, qk_scale2, softcap_scale, softcap2, window_left, window_right,
                HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                MASKED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS_MODE: tl.constexpr,
                IEEE: tl.constexpr, RAW_SCORES: tl.constexpr):
    """The exact statistics pass over key tiles ``[lo, hi)``: the forward's online (m, l) and,
    rescaled alongside, dacc_i = Σ_j exp2(S_ij - m_i) dP_ij (so delta = dacc / l = Σ_j P_ij dP_ij)."""
    for start_n in range(lo, hi, BLOCK_N):
        _, _, v, s, _ = _kv_logits(q, k_ptrs, v_ptrs, bias_ptrs, start_n, offs_m, offs_n0, offs_d, sq, sk, off,
                                   stride_ks, stride_vs, stride_bm, stride_bn, slope2, qk_scale2, softcap_scale,
                                   softcap2, window_left, window_right, HEAD_D, HEAD_DV, BLOCK_D,
                                   MASKED, SOFTCAP, ALIBI, BIAS_MODE, IEEE, RAW_SCORES)
        m_new, alpha, p = _online_max(m_i, s, qk_scale2, RAW_SCORES)   # the forward's (m, P)
        dp = _mm(do, tl.trans(v), None, IEEE)                          # dP = dO Vᵀ
        l_i = l_i * alpha + tl.sum(p, 1)
        dacc = dacc * alpha + tl.sum(p * dp, 1)
        m_i = m_new
    return m_i, l_i, dacc


@triton.jit
def _dq_band(dq, q, do, m2, inv_l, delta, k_ptrs, v_ptrs, bias_ptrs, dbias_ptrs, lo, hi, offs_m, offs_n0, offs_d,
             sq, sk, off, stride_ks, stride_vs, stride_bm, stride_bn, stride_dbm, stride_dbn,
             slope2, qk_scale2, softcap_scale, softcap2, window_left, window_right,
             HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
             MASKED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS_MODE: tl.constexpr,
             BIAS_GRAD: tl.constexpr, IEEE: tl.constexpr, RAW_SCORES: tl.constexpr, EXACT_STATS: tl.constexpr):
    """Key tiles ``[lo, hi)`` against the resident Q tile: accumulate dQ (unscaled); write dBias."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n, k, v, s, t = _kv_logits(q, k_ptrs, v_ptrs, bias_ptrs, start_n, offs_m, offs_n0, offs_d, sq, sk, off,
                                        stride_ks, stride_vs, stride_bm, stride_bn, slope2, qk_scale2, softcap_scale,
                                        softcap2, window_left, window_right, HEAD_D, HEAD_DV, BLOCK_D,
                                        MASKED, SOFTCAP, ALIBI, BIAS_MODE, IEEE, RAW_SCORES)
        p = _probs(s, m2[:, None], inv_l[:, None], qk_scale2, RAW_SCORES, EXACT_STATS)   # P from the row stats
        dp = _mm(do, tl.trans(v), None, IEEE)                                               # dP = dO Vᵀ
        ds = p * (dp - delta[:, None])       # dS = P ∘ (dP − delta): the natural-log score's gradient (dBias)
        if BIAS_GRAD:
            db_ptrs = dbias_ptrs + offs_m[:, None] * stride_dbm + offs_n[None, :] * stride_dbn
            tl.store(db_ptrs, _round_to(ds, dbias_ptrs.dtype.element_ty),
                     mask=(offs_m[:, None] < sq) & (offs_n[None, :] < sk))
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = _mm(_round_to(ds, k.dtype), k, dq, IEEE)                                       # dQ += dS K
    return dq


@triton.jit(do_not_specialize=_SIZES)
def attn_bwd_dq(
    Q, K, V, DO, ROWMAX, ROWINV, DELTA, DLSE, DQ, BIAS, DBIAS, SLOPES, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_dbb, stride_dbh, stride_dbm, stride_dbn,
    num_heads_q, gqa_ratio, seqlen_q, seqlen_k, total_q, total_k,
    sm_scale, qk_scale2, softcap_scale, softcap2, window_left, window_right,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    BIAS_MODE: tl.constexpr, BIAS_GRAD: tl.constexpr, IEEE: tl.constexpr, RAW_SCORES: tl.constexpr,
    HAS_DLSE: tl.constexpr, EXACT_STATS: tl.constexpr, LONGEST_FIRST: tl.constexpr,
):
    """dQ (and dBias) of one (query tile, batch·head): Q and dO resident, one pass over the
    visible key tiles. With ``EXACT_STATS`` (float32) a first pass recomputes the row max m, sum
    l and delta = Σ_j P_ij dP_ij (minus ``DLSE`` when ``HAS_DLSE``) and stores (m, 1/l, delta)
    for the dK/dV kernel; otherwise it reads what :func:`attn_bwd_prep` stored."""
    b, h, h_kv, q_start, sq, k_start, sk, m0 = _query_tile(CU_Q, CU_K, num_heads_q, gqa_ratio, seqlen_q, seqlen_k,
                                                           total_q, total_k, BLOCK_M, IS_VARLEN, LONGEST_FIRST)
    if m0 >= sq:
        return
    off = _causal_offset(sq, sk, BOTTOM_RIGHT)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    q_ptrs = (Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h64 * stride_qh
              + offs_m[:, None] * stride_qs + offs_d[None, :])
    do_ptrs = (DO + b64 * stride_dob + q_start.to(tl.int64) * stride_dos + h64 * stride_doh
               + offs_m[:, None] * stride_dos + offs_d[None, :])
    k_base, v_base = _kv_bases(K, V, b64, k_start, h_kv, stride_kb, stride_ks, stride_kh,
                               stride_vb, stride_vs, stride_vh)
    k_ptrs = k_base + offs_n0[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = v_base + offs_n0[:, None] * stride_vs + offs_d[None, :]
    bias_ptrs = BIAS + b64 * stride_bb + h64 * stride_bh
    dbias_ptrs = DBIAS + b64 * stride_dbb + h64 * stride_dbh
    slope2 = _alibi_slope2(SLOPES, b, h, num_heads_q, ALIBI)

    q = _load_tile(q_ptrs, offs_m, sq, offs_d, HEAD_D, BLOCK_D, True)
    do = _load_tile(do_ptrs, offs_m, sq, offs_d, HEAD_DV, BLOCK_D, True)
    row_base = b64 * stride_lb + h64 * stride_lh + q_start
    lo, full_lo, full_hi, hi = _key_phases(m0, sq, sk, off, window_left, window_right, BLOCK_M, BLOCK_N)

    if EXACT_STATS:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        dacc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for phase in tl.static_range(3):
            start, stop = _phase_range(phase, lo, full_lo, full_hi, hi)
            m_i, l_i, dacc = _stats_band(m_i, l_i, dacc, q, do, k_ptrs, v_ptrs, bias_ptrs, start, stop, offs_m, offs_n0,
                                         offs_d, sq, sk, off, stride_ks, stride_vs, stride_bm, stride_bn, slope2,
                                         qk_scale2, softcap_scale, softcap2, window_left, window_right,
                                         HEAD_D, HEAD_DV, BLOCK_D, BLOCK_N, phase != 1, SOFTCAP, ALIBI, BIAS_MODE,
                                         IEEE, RAW_SCORES)
        empty = l_i == 0.0               # no visible key: P = 0 everywhere (m = +inf, 1/l = 0)
        inv_l = tl.where(empty, 0.0, _div(tl.full([BLOCK_M], 1.0, tl.float32), tl.where(empty, 1.0, l_i), IEEE))
        m2 = tl.where(empty, float("inf"), m_i)
        delta = dacc * inv_l
        in_rows = offs_m < sq
        if HAS_DLSE:
            # ∂lse_i/∂s_ij = P_ij, so dS = P ∘ (dP - delta + dlse): one shift of delta serves dQ, dBias
            # and (through DELTA) dK. Rows with no visible key (P = 0) read 0: no gradient, no NaN.
            delta = delta - tl.load(DLSE + row_base + offs_m, mask=in_rows & (l_i != 0.0), other=0.0)
        tl.store(ROWMAX + row_base + offs_m, m2, mask=in_rows)
        tl.store(ROWINV + row_base + offs_m, inv_l, mask=in_rows)
        tl.store(DELTA + row_base + offs_m, delta, mask=in_rows)
    else:
        m2, inv_l, delta = _load_row_stats(ROWMAX, ROWINV, DELTA, row_base, offs_m, sq, False)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for phase in tl.static_range(3):
        start, stop = _phase_range(phase, lo, full_lo, full_hi, hi)
        dq = _dq_band(dq, q, do, m2, inv_l, delta, k_ptrs, v_ptrs, bias_ptrs, dbias_ptrs, start, stop, offs_m, offs_n0,
                      offs_d, sq, sk, off, stride_ks, stride_vs, stride_bm, stride_bn, stride_dbm, stride_dbn,
                      slope2, qk_scale2, softcap_scale, softcap2, window_left, window_right,
                      HEAD_D, HEAD_DV, BLOCK_D, BLOCK_N, phase != 1, SOFTCAP, ALIBI, BIAS_MODE, BIAS_GRAD,
                      IEEE, RAW_SCORES, EXACT_STATS)

    dq = dq * sm_scale
    dq_ptrs = (DQ + b64 * stride_dqb + q_start.to(tl.int64) * stride_dqs + h64 * stride_dqh
               + offs_m[:, None] * stride_dqs + offs_d[None, :])
    _store_tile(dq_ptrs, _round_to(dq, DQ.dtype.element_ty), offs_m, sq, offs_d, HEAD_D, BLOCK_D)


@triton.jit
def _dkdv_band(dk, dv, k, v, qt_ptrs, do_ptrs, dqt_ptrs, ROWMAX, ROWINV, DELTA, row_base, bias_ptrs, lo, hi,
               offs_m0, offs_n, offs_d, sq, sk, off, stride_qs, stride_dos, stride_dqs, stride_bm, stride_bn, slope2,
               sm_scale, qk_scale2, softcap_scale, softcap2, window_left, window_right,
               HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
               MASKED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BIAS_MODE: tl.constexpr,
               IEEE: tl.constexpr, RAW_SCORES: tl.constexpr, EXACT_STATS: tl.constexpr, PART: tl.constexpr,
               DQ_ATOMIC: tl.constexpr):
    """Query tiles ``[lo, hi)`` against the resident K/V tile, in the (key, query) orientation:
    Sᵀ = K Qᵀ, Pᵀ, dV += Pᵀ dO, dPᵀ = V dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − delta), dK += dSᵀ Q (unscaled);
    with ``DQ_ATOMIC`` also dQᵀ += scale · Kᵀ dSᵀ, atomically into the float32 ``dqt_ptrs`` (FA2).
    ``PART`` 1 does the dV half alone (2 products), 2 the dK half alone (3 products, 4 with
    ``DQ_ATOMIC``; ``v`` used only there), 0 both (4 products, 5 with ``DQ_ATOMIC``)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        qt = _load_tile_t(qt_ptrs + start_m * stride_qs, offs_m, sq, offs_d, HEAD_D, BLOCK_D, MASKED)
        do = _load_tile(do_ptrs + start_m * stride_dos, offs_m, sq, offs_d, HEAD_DV, BLOCK_D, MASKED)
        m2, inv_l, delta = _load_row_stats(ROWMAX, ROWINV, DELTA, row_base, offs_m, sq, EXACT_STATS)
        qkt = _dot_f32(k, qt, IEEE)                                                         # Sᵀ = K Qᵀ
        st, tt = _logits(qkt, offs_m[None, :], offs_n[:, None], sq, sk, off, bias_ptrs, stride_bm, stride_bn, slope2,
                         qk_scale2, softcap_scale, softcap2, window_left, window_right,
                         MASKED, SOFTCAP, ALIBI, BIAS_MODE, RAW_SCORES, IEEE)
        pt = _probs(st, m2[None, :], inv_l[None, :], qk_scale2, RAW_SCORES, EXACT_STATS)
        if PART != 2:
            dv = _mm(_round_to(pt, do.dtype), do, dv, IEEE)                                 # dV += Pᵀ dO
        if PART != 1:
            dpt = _mm(v, tl.trans(do), None, IEEE)                                          # dPᵀ = V dOᵀ
            dst = pt * (dpt - delta[None, :])
            if SOFTCAP:
                dst = dst * (1.0 - tt * tt)
            dst = _round_to(dst, qt.dtype)
            dk = _mm(dst, tl.trans(qt), dk, IEEE)                                           # dK += dSᵀ Q
            if DQ_ATOMIC:
                # FA2's dQ step, transposed like the loop: this key tile's share (dS K)ᵀ = Kᵀ dSᵀ of the
                # query tile's dQ, scaled, added into the float32 accumulator (its M dimension is BLOCK_D,
                # not BLOCK_M: a wgmma on sm_90 even for 16- or 32-row query tiles)
                dqt = _mm(tl.trans(k), dst, None, IEEE) * sm_scale                          # dQᵀ += Kᵀ dSᵀ
                # the accumulator is BLOCK_D wide (ops.backward): no head-dim mask on the add; its
                # columns >= HEAD_D receive Kᵀ's zero-filled rows, i.e. exact zeros
                _atomic_add_tile_t(dqt_ptrs + start_m * stride_dqs, dqt, offs_m, sq, offs_d, BLOCK_D, BLOCK_D, MASKED)
    return dk, dv


@triton.jit(do_not_specialize=_SIZES)
def attn_bwd_dkdv(
    Q, K, V, DO, ROWMAX, ROWINV, DELTA, DK, DV, DQ_ACC, BIAS, SLOPES, CU_Q, CU_K,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    stride_bb, stride_bh, stride_bm, stride_bn,
    num_heads_q, num_heads_kv, gqa_ratio, seqlen_q, seqlen_k, total_q, total_k,
    sm_scale, qk_scale2, softcap_scale, softcap2, window_left, window_right,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    BIAS_MODE: tl.constexpr, IEEE: tl.constexpr, RAW_SCORES: tl.constexpr, EXACT_STATS: tl.constexpr,
    LONGEST_FIRST: tl.constexpr, PART: tl.constexpr, DQ_ATOMIC: tl.constexpr,
):
    """dK, dV of one (key tile, batch·kv head): K/V resident, loop over the query heads of the
    GQA group and over their query tiles. Each program owns its dK/dV tile (no atomics).

    ``DQ_ATOMIC`` (16-bit, determinism not requested; ops.backward): the parts that form dSᵀ (0
    and 2) also add scale · dS K into ``DQ_ACC``, a zero-initialised float32 tensor of q's shape
    with the head dim padded to ``BLOCK_D``
    (strides ``stride_dq*``), with atomic adds, masked at rows >= Sq only (columns >= HEAD_D get
    exact zeros): the whole of dQ, so the dQ kernel is not launched.

    ``PART`` (a config's ``split``, :class:`configs.KernelConfig`): 0 computes both; 1 only dV
    (K resident, V never read, one float32 accumulator) and 2 only dK (K and V resident), as two
    launches. The split costs one product more per tile pair (Sᵀ twice, 5 instead of 4) and
    halves what a program holds, for tiles that would not fit otherwise (D 256)."""
    pid_n = _tile_order(tl.program_id(0), tl.num_programs(0), LONGEST_FIRST)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads_kv
    h_kv = pid_bh % num_heads_kv
    q_start, sq, k_start, sk = _seq_bounds(CU_Q, CU_K, b, seqlen_q, seqlen_k, total_q, total_k, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= sk:
        return
    off = _causal_offset(sq, sk, BOTTOM_RIGHT)

    offs_m0 = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    b64 = b.to(tl.int64)
    k_base, v_base = _kv_bases(K, V, b64, k_start, h_kv, stride_kb, stride_ks, stride_kh,
                               stride_vb, stride_vs, stride_vh)
    # the K/V tile stays resident for every query head and query tile
    k = _load_tile(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], offs_n, sk, offs_d, HEAD_D, BLOCK_D, True)
    if PART == 1:
        v = k   # the dV part reads no V (placeholder of the same shape)
    else:
        v = _load_tile(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], offs_n, sk, offs_d, HEAD_DV, BLOCK_D,
                       True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    lo, full_lo, full_hi, hi = _query_phases(n0, sq, sk, off, window_left, window_right, BLOCK_M, BLOCK_N)
    for g in range(0, gqa_ratio):
        h = h_kv * gqa_ratio + g
        # Qᵀ tiles (head dim down, queries across) and dO tiles, streaming
        qt_ptrs = (Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h.to(tl.int64) * stride_qh
                   + offs_m0[None, :] * stride_qs + offs_d[:, None])
        do_ptrs = (DO + b64 * stride_dob + q_start.to(tl.int64) * stride_dos + h.to(tl.int64) * stride_doh
                   + offs_m0[:, None] * stride_dos + offs_d[None, :])
        row_base = b64 * stride_lb + h.to(tl.int64) * stride_lh + q_start
        # (DQ_ATOMIC) this head's float32 dQ rows, transposed as the Qᵀ tiles
        dqt_ptrs = (DQ_ACC + b64 * stride_dqb + q_start.to(tl.int64) * stride_dqs + h.to(tl.int64) * stride_dqh
                    + offs_m0[None, :] * stride_dqs + offs_d[:, None])
        bias_ptrs = BIAS + b64 * stride_bb + h.to(tl.int64) * stride_bh
        slope2 = _alibi_slope2(SLOPES, b, h, num_heads_q, ALIBI)
        for phase in tl.static_range(3):
            start, stop = _phase_range(phase, lo, full_lo, full_hi, hi)
            dk, dv = _dkdv_band(dk, dv, k, v, qt_ptrs, do_ptrs, dqt_ptrs, ROWMAX, ROWINV, DELTA, row_base, bias_ptrs,
                                start, stop, offs_m0, offs_n, offs_d, sq, sk, off, stride_qs, stride_dos, stride_dqs,
                                stride_bm, stride_bn, slope2, sm_scale, qk_scale2, softcap_scale, softcap2,
                                window_left, window_right,
                                HEAD_D, HEAD_DV, BLOCK_D, BLOCK_M, phase != 1, SOFTCAP, ALIBI, BIAS_MODE,
                                IEEE, RAW_SCORES, EXACT_STATS, PART, DQ_ATOMIC)

    dk = dk * sm_scale
    dk_ptrs = (DK + b64 * stride_dkb + k_start.to(tl.int64) * stride_dks + h_kv.to(tl.int64) * stride_dkh
               + offs_n[:, None] * stride_dks + offs_d[None, :])
    dv_ptrs = (DV + b64 * stride_dvb + k_start.to(tl.int64) * stride_dvs + h_kv.to(tl.int64) * stride_dvh
               + offs_n[:, None] * stride_dvs + offs_d[None, :])
    if PART != 1:
        _store_tile(dk_ptrs, _round_to(dk, DK.dtype.element_ty), offs_n, sk, offs_d, HEAD_D, BLOCK_D)
    if PART != 2:
        _store_tile(dv_ptrs, _round_to(dv, DV.dtype.element_ty), offs_n, sk, offs_d, HEAD_DV, BLOCK_D)
