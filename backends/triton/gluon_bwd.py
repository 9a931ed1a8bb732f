"""An FA3-style attention backward for NVIDIA Hopper (sm_90) in Gluon. ``auto`` (the default,
:func:`backward_choice`) takes it where the H200 timed it faster than the portable backward
(:data:`AUTO_MIN_SEQLEN`, :data:`AUTO_GQA_MIN_SEQLEN`); ``PORTATTN_TRITON_BACKWARD=gluon`` takes it
wherever :func:`gluon_bwd_reasons` is empty. ``tools/triton_gluon_bwd_check.py`` checks its
gradients against float64 on a GPU and times it; the tile schedule is also emulated in float64 on
the CPU (tests/test_triton_gluon_bwd.py).

It takes over after the portable backward's prep kernel (``kernels.attn_bwd_prep``), which turns
the forward's lse into ``m = lse·log2(e)`` (+inf for a row with no visible key) and computes the
exact ``delta = rowsum(dO ∘ O_unrounded) − dlse`` from the forward's rounding residual, so the
lse gradient is carried too and no kernel below walks the band for row statistics. Then two
kernels, each one CTA of three partitions (a 1-warp TMA producer and two 4-warp consumer
warpgroups issuing asynchronous ``wgmma``, FA3's register split 240 / 24):

* :func:`attn_bwd_dkdv_gluon`, K/V-stationary: a CTA owns 128 keys of one (batch, query head),
  64 per consumer warpgroup, with K and V resident in shared memory; the producer streams the
  visible query tiles' Q and dO through a ``STAGES``-deep ring (``ready`` / ``empty`` mbarriers).
  Per tile pair a warpgroup computes Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (both async), then
  Pᵀ = exp2(Sᵀ·scale·log2e − m) (the element mask only on the band's edge tiles), dV += Pᵀ dO,
  dSᵀ = Pᵀ ∘ (dPᵀ − delta), dK += dSᵀ Q — four products; dK is scaled once at the end. A row
  with no visible key has m = +inf, so its P and dS are exactly 0.
* :func:`attn_bwd_dq_gluon`, Q-stationary (deterministic dQ, no atomics): a CTA owns 128 query
  rows, 64 per warpgroup, with Q and dO resident; the producer streams K and V of the visible key
  tiles. Per tile: S = Q Kᵀ, dP = dO Vᵀ, dS = P ∘ (dP − delta), dQ += dS K — three products.

Five products per tile pair plus the recomputed S and dP of the dQ pass (seven, as the Triton
tutorial; FA3's atomic dQ would save two — not done here). At D 256 (:data:`SPLIT_HEAD_DIMS`)
the two float32 accumulators of dK and dV (2 x 128 registers a thread) do not fit, so the dK/dV
kernel runs as two launches (constexpr ``PART``, :func:`kernels_for`): a dV pass (Sᵀ, Pᵀ,
dV += Pᵀ dO; no V loaded) and a dK pass (Sᵀ, dPᵀ, dSᵀ, dK += dSᵀ Q), one accumulator each;
``PART`` 0 is the fused kernel of D 64 / 128, unchanged (same TTGIR and PTX). GQA (``Hq > Hkv``, FA3's way): a
dK/dV CTA owns a key tile of one KV head and walks, phase by phase, each query head of its group
(h_kv·ratio … h_kv·ratio + ratio − 1) over the band — the producer streams every (head, query
tile) pair through the one ring by a 3-D (head, row, D) descriptor, the consumers read each
head's m / delta rows — so dK and dV sum over the group in registers and are stored once, in
the output dtype; a fixed order, bit-identical across runs, no extra memory. Without GQA the
kernel is the same as before the group walk existed (a constexpr; same TTGIR and PTX).
Causal grids run the longest tiles first (dQ: the last query
tiles; dK/dV under an anti-causal band: the last key tiles).

The band logic is the forward's: key tiles of a query tile from :func:`gluon_fwd._key_phases`,
query tiles of a key tile from :func:`_query_phases` (kernels._query_phases in Gluon), each in
three phases masked / unmasked / masked, so sliding windows, both causal alignments and
Sq ≠ Sk are covered. The dQ kernel's CTA prologue (tile order, heads, alignment, band) is the
forward's own :func:`gluon_fwd._row_tile`; the dK/dV kernel's is its mirror :func:`_key_tile`.
What it refuses, :func:`gluon_bwd_reasons` says.
"""

from __future__ import annotations

import functools

import torch

from .gluon_fwd import (
    _UNBOUNDED,
    GLUON_ERROR,
    WG_M,
    _cubin_facts,
    _device_reasons,
    _tma_aligned,
    _tma_reasons,
    gl,
    gluon,
)

if gl is not None:
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .gluon_fwd import _WG_M, _align_offset, _heads, _longest_first, _masked, _row_tile, _tile_index, _tma_load

#: the environment switch of the triton backend's backward (read by :func:`backward_choice`)
ENV_SWITCH = "PORTATTN_TRITON_BACKWARD"
#: the head dims the kernels are written for (``D == Dv``)
HEAD_DIMS = (64, 128, 256)
#: head dims whose dK/dV kernel runs as two launches (``PART`` 1 dV, then ``PART`` 2 dK): at D 256
#: the fused kernel's two float32 accumulators (dK, dV: 2 x 128 registers a thread) do not fit a
#: consumer warpgroup's 240 registers; each pass holds one
SPLIT_HEAD_DIMS = (256,)
#: keys per dK/dV CTA and query rows per dQ CTA: two consumer warpgroups of 64
BLOCK = 2 * WG_M


@functools.lru_cache(maxsize=8)
def tile_config(head_dim: int) -> dict:
    """Tiles of both kernels at ``head_dim``: ``dkdv`` = (BLOCK_M query rows per streamed tile,
    STAGES), ``dq`` = (BLOCK_N keys per streamed tile, STAGES).

    Shared memory, 2 bytes an element: dK/dV holds K and V (128 x D each) plus STAGES x (Q, dO)
    tiles of (BLOCK_M, D): D 64 -> 32 + 3 x 16 = 80 KiB, D 128 -> 64 + 3 x 16 = 112 KiB; dQ holds
    Q and dO (128 x D each) plus STAGES x (K, V) tiles of (BLOCK_N, D): D 64 -> 32 + 2 x 32 =
    96 KiB, D 128 -> 64 + 2 x 32 = 128 KiB. Registers of a consumer thread (64 rows a warpgroup):
    dK/dV holds dK + dV (D / 2 each) and Sᵀ, dPᵀ (BLOCK_M / 2 each): at D 128 BLOCK_M 64 spilled
    (~370 bytes of stack with triton 3.6 and 3.9), 32 does not; dQ holds dQ (D / 2) and S, dP
    (BLOCK_N / 2 each). (FA3's D 128 backward tile is 64 x 128 with hand-placed registers.)

    D 256 (:data:`SPLIT_HEAD_DIMS`; ``dkdv`` is the tile of both its passes): the dK pass holds K
    and V (64 KiB each) plus 2 x (Q, dO) tiles of (32, 256): 128 + 2 x 32 = 192 KiB; the dV pass
    the same less V (it loads none, so its buffer is dropped): 128 KiB; dQ holds Q and dO (64 KiB
    each) plus 2 x (K, V) tiles of (32, 256): 192 KiB (the H200 allows 227 KiB a block). One
    float32 (64, 256) accumulator a pass: 128 registers a thread, and BLOCK 32's Sᵀ / dPᵀ (S, dP)
    16 each — no spills with triton 3.9; triton 3.6 leaves 24 bytes of stack in the dK pass (48
    with GQA, a few reloads in its loop), which BLOCK_M 16 clears."""
    return {64: {"dkdv": (64, 3), "dq": (128, 2)}, 128: {"dkdv": (32, 3), "dq": (64, 2)},
            256: {"dkdv": (32, 2), "dq": (32, 2)}}[head_dim]


# ----- the kernels ----------------------------------------------------------------------------

if gl is not None:

    @gluon.jit
    def _query_phases(n0, sq, sk, off, window_left, window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """(lo, full_lo, full_hi, hi) of the query tiles for the keys ``n0 … n0+BLOCK_N-1`` (the
        mirror of :func:`_key_phases`, kernels._query_phases' arithmetic): row ``i`` sees key
        ``j`` iff ``j - right - off <= i <= j + left - off``; [full_lo, full_hi) need no mask."""
        c1 = gl.minimum(n0 + BLOCK_N, sk) - 1
        lo = gl.maximum(n0 - window_right - off, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
        hi = gl.minimum(c1 + window_left - off + 1, sq)
        full_lo = gl.maximum(n0 + BLOCK_N - 1 - window_right - off, 0)
        full_lo = ((full_lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        full_lo = gl.minimum(gl.maximum(full_lo, lo), gl.maximum(hi, lo))
        full_hi = (gl.maximum(n0 + window_left - off + 1, 0) // BLOCK_M) * BLOCK_M
        full_hi = gl.minimum(full_hi, (sq // BLOCK_M) * BLOCK_M)
        if n0 + BLOCK_N > sk:   # a ragged key tile is never mask-free
            full_hi = full_lo
        full_hi = gl.maximum(full_hi, full_lo)
        return lo, full_lo, full_hi, hi

    @gluon.jit
    def _key_tile(num_heads_q, gqa_ratio, sq, sk, window_left, window_right, head_group, BLOCK_M: gl.constexpr,
                  BOTTOM_RIGHT: gl.constexpr, LONGEST_FIRST: gl.constexpr, GQA: gl.constexpr):
        """The prologue of a K/V-stationary (dK/dV) CTA, the mirror of :func:`gluon_fwd._row_tile`:
        ``(b, h, h_kv, n0, off, (lo, full_lo, full_hi, hi))`` — its batch, query head (with ``GQA``
        the first of its KV head's group, grid (cdiv(Sk, 128), Hkv, B); without it grid
        (cdiv(Sk, 128), B·Hq) and :func:`gluon_fwd._heads`) and KV head, its first key ``n0`` of 128
        (the last tile first with ``LONGEST_FIRST``, an anti-causal band), the alignment ``off`` and
        the band of ``BLOCK_M``-row query tiles that see its keys in three phases
        (:func:`_query_phases`). Without ``GQA`` the CTAs, numbered in launch order, take their key
        tiles in :func:`gluon_fwd._longest_first`'s walk, ``head_group`` (batch, head)s at a time
        (1: one head after the other, the grid's own order), the first tile first (a causal band's
        longest) or with ``LONGEST_FIRST`` the last."""
        BLOCK_N: gl.constexpr = 2 * _WG_M
        if GQA:
            pid = _tile_index(LONGEST_FIRST)
            h_kv = gl.program_id(1)
            b = gl.program_id(2)
            h = h_kv * gqa_ratio
        else:
            num_n = gl.num_programs(0)
            last, bh = _longest_first(gl.program_id(1) * num_n + gl.program_id(0), num_n, gl.num_programs(1),
                                      head_group)
            if LONGEST_FIRST:
                pid = last
            else:
                pid = num_n - 1 - last
            b, h, h_kv = _heads(bh, num_heads_q, gqa_ratio)
        n0 = pid * BLOCK_N
        off = _align_offset(sq, sk, BOTTOM_RIGHT)
        lo, full_lo, full_hi, hi = _query_phases(n0, sq, sk, off, window_left, window_right, BLOCK_M, BLOCK_N)
        return b, h, h_kv, n0, off, (lo, full_lo, full_hi, hi)

    @gluon.jit
    def _phase_bounds(phase: gl.constexpr, lo, full_lo, full_hi, hi):
        """Tile range of one phase: 0 masked (band start), 1 unmasked, 2 masked (band end)."""
        if phase == 0:
            return lo, full_lo
        elif phase == 1:
            return full_lo, full_hi
        else:
            return full_hi, hi

    @gluon.jit
    def _masked_t(s_t, keys, qrows, sk, off, window_left, window_right):
        """:func:`_masked` in the transposed (key, query) orientation of the dK/dV kernel."""
        aligned = qrows[None, :] + off
        c = keys[:, None]
        visible = (c < sk) & (c >= aligned - window_left) & (c <= aligned + window_right)
        return gl.where(visible, s_t, float("-inf"))

    @gluon.jit
    def _stream_pairs(desc_a, desc_b, smem_a, smem_b, ready, empty, lo, hi,
                      BLOCK: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
        """The producer's loop, shared by both kernels: for every tile start in [lo, hi) the
        (BLOCK, D) tiles of ``desc_a`` and ``desc_b`` (Q and dO, or K and V) into ring slot
        ``i % STAGES``, once both consumers released it (``empty``, count 2; waited on the
        parity before the current round's, so a fresh barrier passes at once)."""
        pair_bytes: gl.constexpr = 2 * BLOCK * HEAD_D * 2
        i = 0
        for n in range(lo, hi, BLOCK):
            st = i % STAGES
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(st), pair_bytes)
            _tma_load(desc_a, [n, 0], ready.index(st), smem_a.index(st))
            _tma_load(desc_b, [n, 0], ready.index(st), smem_b.index(st))
            i += 1

    @gluon.jit
    def _stream_group(desc_a, desc_b, smem_a, smem_b, ready, empty, n_heads, phases,
                      BLOCK: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
        """:func:`_stream_pairs` over a GQA group, in the consumers' order
        (:func:`_dkdv_group_band`): phase by phase (``phases`` = (lo, full_lo, full_hi, hi), the
        same band for every head), within a phase the group's ``n_heads`` query heads in turn,
        within a head its tiles; one ring count ``i`` across all. ``desc_a`` / ``desc_b`` are 3-D
        (query head of the group, row, D) descriptors with (1, BLOCK, D) blocks, loaded into the
        ring's 2-D (BLOCK, D) slots viewed as (1, BLOCK, D)."""
        pair_bytes: gl.constexpr = 2 * BLOCK * HEAD_D * 2
        lo, full_lo, full_hi, hi = phases
        i = 0
        for phase in gl.static_range(3):
            start, stop = _phase_bounds(phase, lo, full_lo, full_hi, hi)
            for hh in range(n_heads):
                for n in range(start, stop, BLOCK):
                    st = i % STAGES
                    mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(st), pair_bytes)
                    _tma_load(desc_a, [hh, n, 0], ready.index(st),
                              smem_a.index(st).reshape([1, BLOCK, HEAD_D]))
                    _tma_load(desc_b, [hh, n, 0], ready.index(st),
                              smem_b.index(st).reshape([1, BLOCK, HEAD_D]))
                    i += 1

    @gluon.jit
    def _resident_producer(desc_a, desc_b, smem_a, smem_b, bar, m0, stream, lo, hi,
                           BLOCK: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                           GROUP: gl.constexpr = False, n_heads=1, phases=None, LOAD_B: gl.constexpr = True):
        """The load warp: the CTA's two resident (64, D) tiles of ``desc_a`` and ``desc_b`` per
        warpgroup (K and V, or Q and dO) on ``bar[wg]`` (without ``LOAD_B`` only ``desc_a``'s: the
        D 256 dV pass has no use for V), then :func:`_stream_pairs` over the band
        (``GROUP``: :func:`_stream_group` over the ``n_heads`` query heads of a GQA group and the
        band's ``phases``).
        ``stream`` = (the streamed descriptors a and b, their rings, ready, empty)."""
        tile_bytes: gl.constexpr = _WG_M * HEAD_D * 2
        for wg in gl.static_range(2):
            if LOAD_B:
                mbarrier.expect(bar.index(wg), 2 * tile_bytes)
                _tma_load(desc_a, [m0 + wg * _WG_M, 0], bar.index(wg), smem_a.index(wg))
                _tma_load(desc_b, [m0 + wg * _WG_M, 0], bar.index(wg), smem_b.index(wg))
            else:
                mbarrier.expect(bar.index(wg), tile_bytes)
                _tma_load(desc_a, [m0 + wg * _WG_M, 0], bar.index(wg), smem_a.index(wg))
        s_desc_a, s_desc_b, ring_a, ring_b, ready, empty = stream
        if GROUP:
            _stream_group(s_desc_a, s_desc_b, ring_a, ring_b, ready, empty, n_heads, phases,
                          BLOCK, HEAD_D, STAGES)
        else:
            _stream_pairs(s_desc_a, s_desc_b, ring_a, ring_b, ready, empty, lo, hi, BLOCK, HEAD_D, STAGES)

    @gluon.jit
    def _smem_ring(desc_a, desc_b, dtype: gl.constexpr, layout: gl.constexpr, BLOCK: gl.constexpr,
                   HEAD_D: gl.constexpr, STAGES: gl.constexpr):
        """The shared memory and barriers of both kernels, initialised and fenced:
        ``(res_a, res_b, bar, ring, stream)`` — the two resident (2, 64, D) tiles per warpgroup
        (K and V, or Q and dO) with their load barriers ``bar`` (2, 1); the ``ring`` =
        (a tiles, b tiles, ready, empty) of ``STAGES`` (BLOCK, D) slot pairs streamed from
        ``desc_a`` / ``desc_b``, ``ready`` one TMA arrival, ``empty`` one arrival per consumer
        warpgroup; ``stream`` = (desc_a, desc_b, the ring) for :func:`_resident_producer`."""
        res_a = gl.allocate_shared_memory(dtype, [2, _WG_M, HEAD_D], layout)
        res_b = gl.allocate_shared_memory(dtype, [2, _WG_M, HEAD_D], layout)
        ring_a = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_D], layout)
        ring_b = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_D], layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        for j in gl.static_range(2):
            mbarrier.init(bar.index(j), count=1)
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(empty.index(j), count=2)   # one arrival per consumer warpgroup
        fence_async_shared()   # the inits (generic proxy) before the TMA engine (async proxy) signals them
        return res_a, res_b, bar, (ring_a, ring_b, ready, empty), (desc_a, desc_b, ring_a, ring_b, ready, empty)

    @gluon.jit
    def _store_rows(ptr, off, stride_s, acc, row0, nrows, layout: gl.constexpr,
                    ROWS: gl.constexpr, HEAD_D: gl.constexpr):
        """Store a (ROWS, D) accumulator (``layout``) at rows ``row0 …`` of a (S, D) slab with
        row stride ``stride_s``, rows >= ``nrows`` skipped, cast to the pointer's dtype."""
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
        ptrs = ptr + off + rows.to(gl.int64)[:, None] * stride_s + cols[None, :]
        mask = (rows[:, None] < nrows) & (cols[None, :] < HEAD_D)
        gl.store(ptrs, acc.to(ptr.dtype.element_ty), mask=mask)

    # --- dK / dV ---------------------------------------------------------------------------

    @gluon.jit
    def _p_t(s_t, m2, keys, qrows, sk, off, window_left, window_right, qk_scale2, MASKED: gl.constexpr):
        """Pᵀ (64 keys, BLOCK_M queries, float32, Sᵀ's layout) from the finished Sᵀ = K Qᵀ:
        Pᵀ = exp2(Sᵀ·scale·log2e − m), ``qk_scale2`` = scale·log2e and ``m2`` the query rows' m
        (= lse·log2e; +inf for a row with no visible key or past Sq, so its column is 0); with
        ``MASKED`` (the band's edge tiles) Sᵀ is first set to −inf where a key is invisible to a
        query row or past Sk (:func:`_masked_t`), so Pᵀ is 0 there."""
        if MASKED:
            s_t = _masked_t(s_t, keys, qrows, sk, off, window_left, window_right)
        return gl.exp2(s_t * qk_scale2 - m2[None, :])

    @gluon.jit
    def _dkdv_tile(dk, dv, k, v, q, do, m_ptrs, d_ptrs, in_q, keys, qrows, sk, off, window_left, window_right,
                   qk_scale2, st_layout: gl.constexpr, op_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                   MASKED: gl.constexpr):
        """One (64 keys, BLOCK_M queries) tile pair of a consumer warpgroup: Sᵀ = K Qᵀ and
        dPᵀ = V dOᵀ issued together; while they run, the rows' m and delta load; then
        Pᵀ (:func:`_p_t`), dV += Pᵀ dO (async, overlapping dSᵀ), dSᵀ = Pᵀ ∘ (dPᵀ − delta), dK += dSᵀ Q."""
        zero = gl.zeros([_WG_M, BLOCK_M], gl.float32, st_layout)
        s_t = warpgroup_mma(k, q.permute((1, 0)), zero, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v, do.permute((1, 0)), zero, use_acc=False, is_async=True)
        m2 = gl.load(m_ptrs, mask=in_q, other=float("inf"))     # +inf: no visible key / past Sq -> P = 0
        delta = gl.load(d_ptrs, mask=in_q, other=0.0)
        s_t = warpgroup_mma_wait(1, deps=(s_t,))                 # Sᵀ done, dPᵀ may still run
        p_t = _p_t(s_t, m2, keys, qrows, sk, off, window_left, window_right, qk_scale2, MASKED)
        p_op = gl.convert_layout(p_t.to(q.dtype), op_layout)
        dv = warpgroup_mma(p_op, do, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t,))               # dPᵀ done, dV may still run
        ds_op = gl.convert_layout((p_t * (dp_t - delta[None, :])).to(q.dtype), op_layout)
        dk = warpgroup_mma(ds_op, q, dk, is_async=True)
        dk, dv, p_op, ds_op = warpgroup_mma_wait(0, deps=(dk, dv, p_op, ds_op))
        return dk, dv

    @gluon.jit
    def _dv_tile(dv, k, q, do, m_ptrs, in_q, keys, qrows, sk, off, window_left, window_right, qk_scale2,
                 st_layout: gl.constexpr, op_layout: gl.constexpr, BLOCK_M: gl.constexpr, MASKED: gl.constexpr):
        """The dV half of :func:`_dkdv_tile` (the D 256 dV pass, ``PART`` 1): Sᵀ = K Qᵀ, Pᵀ,
        dV += Pᵀ dO — two products, one accumulator."""
        zero = gl.zeros([_WG_M, BLOCK_M], gl.float32, st_layout)
        s_t = warpgroup_mma(k, q.permute((1, 0)), zero, use_acc=False, is_async=True)
        m2 = gl.load(m_ptrs, mask=in_q, other=float("inf"))
        s_t = warpgroup_mma_wait(0, deps=(s_t,))
        p_t = _p_t(s_t, m2, keys, qrows, sk, off, window_left, window_right, qk_scale2, MASKED)
        p_op = gl.convert_layout(p_t.to(q.dtype), op_layout)
        dv = warpgroup_mma(p_op, do, dv, is_async=True)
        dv, p_op = warpgroup_mma_wait(0, deps=(dv, p_op))
        return dv

    @gluon.jit
    def _dk_tile(dk, k, v, q, do, m_ptrs, d_ptrs, in_q, keys, qrows, sk, off, window_left, window_right, qk_scale2,
                 st_layout: gl.constexpr, op_layout: gl.constexpr, BLOCK_M: gl.constexpr, MASKED: gl.constexpr):
        """The dK half of :func:`_dkdv_tile` (the D 256 dK pass, ``PART`` 2): Sᵀ = K Qᵀ and
        dPᵀ = V dOᵀ together, Pᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − delta), dK += dSᵀ Q — three products."""
        zero = gl.zeros([_WG_M, BLOCK_M], gl.float32, st_layout)
        s_t = warpgroup_mma(k, q.permute((1, 0)), zero, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v, do.permute((1, 0)), zero, use_acc=False, is_async=True)
        m2 = gl.load(m_ptrs, mask=in_q, other=float("inf"))
        delta = gl.load(d_ptrs, mask=in_q, other=0.0)
        s_t = warpgroup_mma_wait(1, deps=(s_t,))
        p_t = _p_t(s_t, m2, keys, qrows, sk, off, window_left, window_right, qk_scale2, MASKED)
        dp_t = warpgroup_mma_wait(0, deps=(dp_t,))
        ds_op = gl.convert_layout((p_t * (dp_t - delta[None, :])).to(q.dtype), op_layout)
        dk = warpgroup_mma(ds_op, q, dk, is_async=True)
        dk, ds_op = warpgroup_mma_wait(0, deps=(dk, ds_op))
        return dk

    @gluon.jit
    def _dkdv_step(dk, dv, k, v, q, do, m_ptrs, d_ptrs, in_q, keys, qrows, sk, off, window_left, window_right,
                   qk_scale2, st_layout: gl.constexpr, op_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                   MASKED: gl.constexpr, PART: gl.constexpr):
        """One tile pair of ``PART``: 0 both (:func:`_dkdv_tile`), 1 dV only, 2 dK only."""
        if PART == 0:
            dk, dv = _dkdv_tile(dk, dv, k, v, q, do, m_ptrs, d_ptrs, in_q, keys, qrows, sk, off, window_left,
                                window_right, qk_scale2, st_layout, op_layout, BLOCK_M, MASKED)
        elif PART == 1:
            dv = _dv_tile(dv, k, q, do, m_ptrs, in_q, keys, qrows, sk, off, window_left, window_right, qk_scale2,
                          st_layout, op_layout, BLOCK_M, MASKED)
        else:
            dk = _dk_tile(dk, k, v, q, do, m_ptrs, d_ptrs, in_q, keys, qrows, sk, off, window_left, window_right,
                          qk_scale2, st_layout, op_layout, BLOCK_M, MASKED)
        return dk, dv

    @gluon.jit
    def _dkdv_ring_step(dk, dv, i, m, k, v, ring, m_base, d_base, keys, qcols0, sq, sk, off, window_left,
                        window_right, qk_scale2, st_layout: gl.constexpr, op_layout: gl.constexpr,
                        BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr, PART: gl.constexpr):
        """The ``i``-th tile pair taken from the ring, query rows ``m … m+BLOCK_M-1``: wait until
        slot ``i % STAGES`` holds its Q and dO tiles (``ready``, on round ``i // STAGES``'s
        parity), one :func:`_dkdv_step` (``PART``) on them with the rows' m and delta
        (``m_base`` / ``d_base`` + rows; rows >= ``sq`` masked), then hand the slot back to the
        producer (``empty``, one arrival per consumer warpgroup). ``ring`` = (Q tiles, dO tiles,
        ready, empty); returns ``(dk, dv, i + 1)``."""
        q_smem, do_smem, ready, empty = ring
        st = i % STAGES
        qrows = m + qcols0
        in_q = qrows < sq
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        dk, dv = _dkdv_step(dk, dv, k, v, q_smem.index(st), do_smem.index(st), m_base + qrows, d_base + qrows,
                            in_q, keys, qrows, sk, off, window_left, window_right, qk_scale2,
                            st_layout, op_layout, BLOCK_M, MASKED, PART)
        mbarrier.arrive(empty.index(st), count=1)
        i += 1
        return dk, dv, i

    @gluon.jit
    def _dkdv_band(dk, dv, i, start, stop, k, v, ring, m_base, d_base, keys, qcols0, sq, sk, off,
                   window_left, window_right, qk_scale2, st_layout: gl.constexpr, op_layout: gl.constexpr,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr, PART: gl.constexpr = 0):
        """Query tiles [start, stop) of one phase, each a :func:`_dkdv_ring_step`; ``i`` counts the
        tiles taken from the ring (``ring`` = (Q tiles, dO tiles, ready, empty))."""
        for m in range(start, stop, BLOCK_M):
            dk, dv, i = _dkdv_ring_step(dk, dv, i, m, k, v, ring, m_base, d_base, keys, qcols0, sq, sk, off,
                                        window_left, window_right, qk_scale2, st_layout, op_layout, BLOCK_M,
                                        STAGES, MASKED, PART)
        return dk, dv, i

    @gluon.jit
    def _dkdv_group_band(dk, dv, i, start, stop, k, v, ring, m_base, d_base, stride_lh, n_heads, keys, qcols0,
                         sq, sk, off, window_left, window_right, qk_scale2, st_layout: gl.constexpr,
                         op_layout: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                         MASKED: gl.constexpr, PART: gl.constexpr = 0):
        """:func:`_dkdv_band` over a GQA group: query tiles [start, stop) of one phase for each of
        the ``n_heads`` query heads in turn (``m_base`` / ``d_base``: the first head's m and
        delta rows, ``stride_lh`` apart) as one flat loop over the (head, tile) pairs with a
        running (tile, head), so the loop nest is the MHA kernel's (a nested head loop spilled)."""
        m = start
        for _ in range(n_heads * ((stop - start + BLOCK_M - 1) // BLOCK_M)):
            dk, dv, i = _dkdv_ring_step(dk, dv, i, m, k, v, ring, m_base, d_base, keys, qcols0, sq, sk, off,
                                        window_left, window_right, qk_scale2, st_layout, op_layout, BLOCK_M,
                                        STAGES, MASKED, PART)
            m += BLOCK_M
            if m >= stop:   # the next head of the group, from the phase's first tile
                m = start
                m_base += stride_lh
                d_base += stride_lh
        return dk, dv, i

    @gluon.jit
    def _dkdv_consumer(WG: gl.constexpr, k_smem, v_smem, kv_bar, ring, DK, DV, dk_off, dv_off, stride_dks,
                       stride_dvs, ROWMAX, DELTA, row_off, stride_lh, n_heads, n0, sq, sk, off,
                       lo, full_lo, full_hi, hi, window_left, window_right, qk_scale2, scale,
                       BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr,
                       PART: gl.constexpr = 0):
        """One consumer warpgroup of the dK/dV kernel: keys ``n0 + WG·64 …``; walks every query
        tile of the band (three phases) — of one query head, or (``GROUP``) in each phase of each
        of the ``n_heads`` query heads of the KV head's group in turn (``row_off``: the first one's
        rows of ROWMAX / DELTA, ``stride_lh`` apart), accumulating dK and dV across them in
        registers — and writes its dK (scaled once) and dV rows — zeros where no query sees the keys.
        ``PART`` 1 / 2 (D 256, one float32 accumulator a pass): dV only / dK only."""
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_D, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        key0 = n0 + WG * _WG_M
        keys = key0 + gl.arange(0, _WG_M, layout=gl.SliceLayout(1, st_layout))
        qcols0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        dk = gl.zeros([_WG_M, HEAD_D], gl.float32, acc_layout)
        dv = gl.zeros([_WG_M, HEAD_D], gl.float32, acc_layout)
        k = k_smem.index(WG)
        v = v_smem.index(WG)
        mbarrier.wait(kv_bar.index(WG), 0)
        i = lo * 0
        for phase in gl.static_range(3):
            start, stop = _phase_bounds(phase, lo, full_lo, full_hi, hi)
            if GROUP:   # every query head of the KV head's group, in the producer's order
                dk, dv, i = _dkdv_group_band(dk, dv, i, start, stop, k, v, ring, ROWMAX + row_off, DELTA + row_off,
                                             stride_lh, n_heads, keys, qcols0, sq, sk, off, window_left, window_right,
                                             qk_scale2, st_layout, op_layout, BLOCK_M, STAGES, phase != 1, PART)
            else:
                dk, dv, i = _dkdv_band(dk, dv, i, start, stop, k, v, ring, ROWMAX + row_off, DELTA + row_off, keys,
                                       qcols0, sq, sk, off, window_left, window_right, qk_scale2, st_layout,
                                       op_layout, BLOCK_M, STAGES, phase != 1, PART)
        if PART != 1:
            _store_rows(DK, dk_off, stride_dks, dk * scale, key0, sk, acc_layout, _WG_M, HEAD_D)
        if PART != 2:
            _store_rows(DV, dv_off, stride_dvs, dv, key0, sk, acc_layout, _WG_M, HEAD_D)

    @gluon.jit(do_not_specialize=("seqlen_q", "seqlen_k", "stride_lb", "stride_lh"))
    def attn_bwd_dkdv_gluon(Q, K, V, DO, DK, DV, ROWMAX, DELTA,
                            stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                            stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                            stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                            stride_lb, stride_lh,
                            num_heads_q, gqa_ratio, seqlen_q, seqlen_k, qk_scale2, scale, window_left, window_right,
                            head_group,
                            HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                            BOTTOM_RIGHT: gl.constexpr, LONGEST_FIRST: gl.constexpr, GQA: gl.constexpr,
                            PART: gl.constexpr = 0):
        """dK, dV (``PART`` 0; at D 256 two launches, ``PART`` 1 dV and ``PART`` 2 dK) of 128 keys
        of one KV head: grid (cdiv(Sk, 128), B·Hq) without ``GQA``,
        (cdiv(Sk, 128), Hkv, B) with it; 4 warps (consumer 0) +
        a 4-warp consumer + a 1-warp producer. Without ``GQA`` (Hq == Hkv) against its one query
        head; with ``GQA`` against each of the ``gqa_ratio`` query heads h_kv·ratio … of its group
        in turn (fixed order, deterministic), the sums kept in registers. DK/DV ``(B, Sk, Hkv, D)``
        (Q's dtype, one store per CTA); ROWMAX/DELTA ``(B, Hq, Sq)`` float32 from the prep kernel."""
        sq = seqlen_q
        sk = seqlen_k
        b, h, h_kv, n0, off, phases = _key_tile(num_heads_q, gqa_ratio, sq, sk, window_left, window_right, head_group,
                                                BLOCK_M, BOTTOM_RIGHT, LONGEST_FIRST, GQA)
        lo, full_lo, full_hi, hi = phases

        b64 = b.to(gl.int64)
        h64 = h.to(gl.int64)
        hkv64 = h_kv.to(gl.int64)
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        if GQA:   # (query head of the group, row, D): the producer walks the group's heads by coordinate
            head_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
            q_desc = tma.make_tensor_descriptor(Q + b64 * stride_qb + h64 * stride_qh, [gqa_ratio, sq, HEAD_D],
                                                [stride_qh, stride_qs, 1], [1, BLOCK_M, HEAD_D], head_layout)
            do_desc = tma.make_tensor_descriptor(DO + b64 * stride_dob + h64 * stride_doh, [gqa_ratio, sq, HEAD_D],
                                                 [stride_doh, stride_dos, 1], [1, BLOCK_M, HEAD_D], head_layout)
        else:
            q_desc = tma.make_tensor_descriptor(Q + b64 * stride_qb + h64 * stride_qh, [sq, HEAD_D],
                                                [stride_qs, 1], [BLOCK_M, HEAD_D], smem_layout)
            do_desc = tma.make_tensor_descriptor(DO + b64 * stride_dob + h64 * stride_doh, [sq, HEAD_D],
                                                 [stride_dos, 1], [BLOCK_M, HEAD_D], smem_layout)
        k_desc = tma.make_tensor_descriptor(K + b64 * stride_kb + hkv64 * stride_kh, [sk, HEAD_D],
                                            [stride_ks, 1], [_WG_M, HEAD_D], smem_layout)
        v_desc = tma.make_tensor_descriptor(V + b64 * stride_vb + hkv64 * stride_vh, [sk, HEAD_D],
                                            [stride_vs, 1], [_WG_M, HEAD_D], smem_layout)
        if GQA:
            dk_off = b64 * stride_dkb + hkv64 * stride_dkh
            dv_off = b64 * stride_dvb + hkv64 * stride_dvh
        else:   # h == h_kv (the MHA kernel's text, unchanged)
            dk_off = b64 * stride_dkb + h64 * stride_dkh
            dv_off = b64 * stride_dvb + h64 * stride_dvh
        row_off = b64 * stride_lb + h64 * stride_lh

        k_smem, v_smem, kv_bar, ring, stream = _smem_ring(q_desc, do_desc, Q.dtype.element_ty, smem_layout,
                                                          BLOCK_M, HEAD_D, STAGES)
        gl.warp_specialize([
            (_dkdv_consumer, (0, k_smem, v_smem, kv_bar, ring, DK, DV, dk_off, dv_off, stride_dks, stride_dvs,
                              ROWMAX, DELTA, row_off, stride_lh, gqa_ratio, n0, sq, sk, off, lo, full_lo, full_hi,
                              hi, window_left, window_right, qk_scale2, scale, BLOCK_M, HEAD_D, STAGES, GQA, PART)),
            (_dkdv_consumer, (1, k_smem, v_smem, kv_bar, ring, DK, DV, dk_off, dv_off, stride_dks, stride_dvs,
                              ROWMAX, DELTA, row_off, stride_lh, gqa_ratio, n0, sq, sk, off, lo, full_lo, full_hi,
                              hi, window_left, window_right, qk_scale2, scale, BLOCK_M, HEAD_D, STAGES, GQA, PART)),
            (_resident_producer, (k_desc, v_desc, k_smem, v_smem, kv_bar, n0, stream, lo, hi,
                                  BLOCK_M, HEAD_D, STAGES, GQA, gqa_ratio, (lo, full_lo, full_hi, hi), PART != 1)),
        ], [4, 1], [240, 24])

    # --- dQ ----------------------------------------------------------------------------------

    @gluon.jit
    def _dq_tile(dq, q, do, k, v, m2, delta, rows, cols, sk, off, window_left, window_right, qk_scale2,
                 s_layout: gl.constexpr, op_layout: gl.constexpr, BLOCK_N: gl.constexpr, MASKED: gl.constexpr):
        """One (64 rows, BLOCK_N keys) tile of a dQ warpgroup: S = Q Kᵀ and dP = dO Vᵀ issued
        together, P = exp2(S·scale·log2e − m), dS = P ∘ (dP − delta), dQ += dS K."""
        zero = gl.zeros([_WG_M, BLOCK_N], gl.float32, s_layout)
        s = warpgroup_mma(q, k.permute((1, 0)), zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v.permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))
        if MASKED:
            s = _masked(s, rows, cols, sk, off, window_left, window_right)
        p = gl.exp2(s * qk_scale2 - m2[:, None])
        dp = warpgroup_mma_wait(0, deps=(dp,))
        ds_op = gl.convert_layout((p * (dp - delta[:, None])).to(q.dtype), op_layout)
        dq = warpgroup_mma(ds_op, k, dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
        return dq

    @gluon.jit
    def _dq_band(dq, i, start, stop, q, do, ring, m2, delta, rows, cols0, sk, off, window_left, window_right,
                 qk_scale2, s_layout: gl.constexpr, op_layout: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr):
        """Key tiles [start, stop) of one phase (``ring`` = (K tiles, V tiles, ready, empty))."""
        k_smem, v_smem, ready, empty = ring
        for n in range(start, stop, BLOCK_N):
            st = i % STAGES
            mbarrier.wait(ready.index(st), (i // STAGES) & 1)
            dq = _dq_tile(dq, q, do, k_smem.index(st), v_smem.index(st), m2, delta, rows, n + cols0, sk, off,
                          window_left, window_right, qk_scale2, s_layout, op_layout, BLOCK_N, MASKED)
            mbarrier.arrive(empty.index(st), count=1)
            i += 1
        return dq, i

    @gluon.jit
    def _dq_consumer(WG: gl.constexpr, q_smem, do_smem, qd_bar, ring, DQ, dq_off, stride_dqs,
                     ROWMAX, DELTA, row_off, m0, sq, sk, off, lo, full_lo, full_hi, hi,
                     window_left, window_right, qk_scale2, scale,
                     BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
        """One consumer warpgroup of the dQ kernel: the 64 query rows ``m0 + WG·64 …``; writes
        their dQ (scaled once; zeros for rows with no visible key)."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_D, 16])
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        row0 = m0 + WG * _WG_M
        rows = row0 + gl.arange(0, _WG_M, layout=gl.SliceLayout(1, s_layout))
        cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        in_rows = rows < sq
        m2 = gl.load(ROWMAX + row_off + rows, mask=in_rows, other=float("inf"))
        delta = gl.load(DELTA + row_off + rows, mask=in_rows, other=0.0)
        dq = gl.zeros([_WG_M, HEAD_D], gl.float32, acc_layout)
        q = q_smem.index(WG)
        do = do_smem.index(WG)
        mbarrier.wait(qd_bar.index(WG), 0)
        i = lo * 0
        for phase in gl.static_range(3):
            start, stop = _phase_bounds(phase, lo, full_lo, full_hi, hi)
            dq, i = _dq_band(dq, i, start, stop, q, do, ring, m2, delta, rows, cols0, sk, off, window_left,
                             window_right, qk_scale2, s_layout, op_layout, BLOCK_N, STAGES, phase != 1)
        _store_rows(DQ, dq_off, stride_dqs, dq * scale, row0, sq, acc_layout, _WG_M, HEAD_D)

    @gluon.jit(do_not_specialize=("seqlen_q", "seqlen_k", "stride_lb", "stride_lh"))
    def attn_bwd_dq_gluon(Q, K, V, DO, DQ, ROWMAX, DELTA,
                          stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                          stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                          stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh,
                          num_heads_q, gqa_ratio, seqlen_q, seqlen_k, qk_scale2, scale, window_left, window_right,
                          head_group,
                          HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          BOTTOM_RIGHT: gl.constexpr, LONGEST_FIRST: gl.constexpr):
        """dQ of 128 query rows of one (batch, head): grid (cdiv(Sq, 128), B·Hq), 4 warps
        (consumer 0) + a 4-warp consumer + a 1-warp producer; with ``LONGEST_FIRST`` (a causal-like
        band) the tiles in :func:`gluon_fwd._longest_first`'s walk, ``head_group`` (batch, head)s at
        a time."""
        sq = seqlen_q
        sk = seqlen_k
        b, h, h_kv, m0, off, phases = _row_tile(num_heads_q, gqa_ratio, sq, sk, window_left, window_right, BLOCK_N,
                                                BOTTOM_RIGHT, LONGEST_FIRST, 2, head_group)
        lo, full_lo, full_hi, hi = phases

        b64 = b.to(gl.int64)
        h64 = h.to(gl.int64)
        hkv64 = h_kv.to(gl.int64)
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_desc = tma.make_tensor_descriptor(Q + b64 * stride_qb + h64 * stride_qh, [sq, HEAD_D],
                                            [stride_qs, 1], [_WG_M, HEAD_D], smem_layout)
        do_desc = tma.make_tensor_descriptor(DO + b64 * stride_dob + h64 * stride_doh, [sq, HEAD_D],
                                             [stride_dos, 1], [_WG_M, HEAD_D], smem_layout)
        k_desc = tma.make_tensor_descriptor(K + b64 * stride_kb + hkv64 * stride_kh, [sk, HEAD_D],
                                            [stride_ks, 1], [BLOCK_N, HEAD_D], smem_layout)
        v_desc = tma.make_tensor_descriptor(V + b64 * stride_vb + hkv64 * stride_vh, [sk, HEAD_D],
                                            [stride_vs, 1], [BLOCK_N, HEAD_D], smem_layout)
        dq_off = b64 * stride_dqb + h64 * stride_dqh
        row_off = b64 * stride_lb + h64 * stride_lh

        q_smem, do_smem, qd_bar, ring, stream = _smem_ring(k_desc, v_desc, Q.dtype.element_ty, smem_layout,
                                                           BLOCK_N, HEAD_D, STAGES)
        gl.warp_specialize([
            (_dq_consumer, (0, q_smem, do_smem, qd_bar, ring, DQ, dq_off, stride_dqs, ROWMAX, DELTA, row_off,
                            m0, sq, sk, off, lo, full_lo, full_hi, hi, window_left, window_right, qk_scale2, scale,
                            BLOCK_N, HEAD_D, STAGES)),
            (_dq_consumer, (1, q_smem, do_smem, qd_bar, ring, DQ, dq_off, stride_dqs, ROWMAX, DELTA, row_off,
                            m0, sq, sk, off, lo, full_lo, full_hi, hi, window_left, window_right, qk_scale2, scale,
                            BLOCK_N, HEAD_D, STAGES)),
            (_resident_producer, (q_desc, do_desc, q_smem, do_smem, qd_bar, m0, stream, lo, hi,
                                  BLOCK_N, HEAD_D, STAGES)),
        ], [4, 1], [240, 24])


# ----- cross-compilation (no GPU needed) ----------------------------------------------------

#: launch options: 4 warps run the default partition (consumer 0); the workers add 5 warps
LAUNCH_OPTIONS = dict(num_warps=4, num_stages=1)
#: the launches, by the names :func:`compile_for` and the check tool use: ``dkdv`` (the fused dK/dV
#: kernel, D 64 / 128), ``dv`` and ``dk`` (its two D 256 passes, ``PART`` 1 and 2), ``dq``
KERNELS = ("dkdv", "dv", "dk", "dq")
#: the dK/dV kernel's ``PART`` of each of its launch names
_PARTS = {"dkdv": 0, "dv": 1, "dk": 2}


#: whether a causal-like backward's grids walk their tiles in head groups (:func:`head_group`)
GROUPED_WALK = True


def head_group(spec) -> int:
    """How many (batch, head)s the causal-like backward grids (dQ's query tiles, longest first;
    dK/dV's key tiles, first first) take together: :func:`gluon_fwd.head_group` of the one-tile
    grid (the K and V, or Q and dO, of a group fit in L2; ``PORTATTN_TRITON_HEAD_GROUP`` overrides;
    1 below ``ONE_TILE_GROUP_MIN_SEQLEN_Q`` query rows) with :data:`GROUPED_WALK`, else 1 (one head
    after the other, each grid's own order). The order changes no arithmetic."""
    from . import gluon_fwd
    return gluon_fwd.head_group(spec, persistent=False) if GROUPED_WALK else 1


def kernels_for(head_dim: int) -> tuple[str, ...]:
    """The launches of a backward at ``head_dim``, in :func:`gluon_backward`'s order."""
    return ("dv", "dk", "dq") if head_dim in SPLIT_HEAD_DIMS else ("dkdv", "dq")


def launch_constexprs(kernel: str, head_dim: int, bottom_right: bool = True, longest_first: bool = False,
                      gqa: bool = False) -> dict:
    """The constexprs of one launch of ``kernel`` (``"dkdv"``, ``"dv"``, ``"dk"`` or ``"dq"``, see
    :func:`kernels_for`); ``gqa`` (Hq > Hkv): the dK/dV kernel's group walk (a CTA per KV head, its
    query heads reduced in registers)."""
    if kernel not in kernels_for(head_dim):
        raise ValueError(f"kernel={kernel!r} at head dim {head_dim}: expected one of {kernels_for(head_dim)}")
    dkdv = kernel in _PARTS
    block, stages = tile_config(head_dim)["dkdv" if dkdv else "dq"]
    tile = "BLOCK_M" if dkdv else "BLOCK_N"
    consts = {"HEAD_D": head_dim, tile: block, "STAGES": stages, "BOTTOM_RIGHT": bottom_right,
              "LONGEST_FIRST": longest_first}
    if dkdv:
        consts["GQA"] = gqa
        consts["PART"] = _PARTS[kernel]
    return consts


def _kernel(kernel: str):
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS}")
    return attn_bwd_dkdv_gluon if kernel in _PARTS else attn_bwd_dq_gluon


def compile_for(kernel: str = "dkdv", head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                causal: bool = False, gqa: bool = False, arch: int = 90):
    """``triton.compile`` of one kernel for ``GPUTarget("cuda", arch, 32)`` without a GPU (``gqa``:
    the dK/dV kernel's GQA group walk, ``GQA=True``); returns the compiled kernel
    (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata.shared``). ``kernel``: one of
    :func:`kernels_for` ``(head_dim)`` (at D 256 ``dv``, ``dk``, ``dq``)."""
    if GLUON_ERROR:
        raise RuntimeError(GLUON_ERROR)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype={dtype}: only float16 and bfloat16")
    ptr = {torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    fn = _kernel(kernel)
    consts = launch_constexprs(kernel, head_dim, longest_first=causal and kernel == "dq", gqa=gqa)
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("Q", "K", "V", "DO", "DQ", "DK", "DV"):
            sig[name] = ptr
        elif name in ("ROWMAX", "DELTA"):
            sig[name] = "*fp32"
        elif name in ("qk_scale2", "scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    src = GluonASTSource(fn, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(LAUNCH_OPTIONS))


def compile_report(kernel: str = "dkdv", head_dim: int = 128, causal: bool = False,
                   dtype: torch.dtype = torch.bfloat16, gqa: bool = False) -> dict:
    """Cross-compile one variant for sm_90 and describe it: shared bytes, warps, PTX counts of
    ``wgmma.mma_async`` / ``cp.async.bulk.tensor`` (TMA) / ``setmaxnreg`` values, and the SASS
    facts of :func:`gluon_fwd._cubin_facts` (registers, stack, HGMMA, UTMALDG, LDL/STL)."""
    import re
    import time
    start = time.perf_counter()
    c = compile_for(kernel, head_dim, dtype, causal, gqa)
    ptx = c.asm["ptx"]
    row = dict(kernel=kernel, head_dim=head_dim, causal=causal, gqa=gqa, dtype=str(dtype).replace("torch.", ""),
               shared=int(c.metadata.shared), num_warps=int(c.metadata.num_warps),
               wgmma=ptx.count("wgmma.mma_async"), tma=ptx.count("cp.async.bulk.tensor"),
               setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}))
    row.update(_cubin_facts(c.asm["cubin"]))
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def main(argv=None) -> int:
    """``python -m portattn.backends.triton.gluon_bwd [--json]``: cross-compile every launch
    (:func:`kernels_for`: dkdv and dq, at D 256 dv, dk and dq) at every head dim for sm_90 and
    print what each compiled to (exit 1 on a compile error)."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    ap.add_argument("--dims", default=",".join(map(str, HEAD_DIMS)))
    ap.add_argument("--kernels", default=",".join(KERNELS), help="a subset of each head dim's kernels_for")
    ap.add_argument("--causal", choices=("on", "off", "both"), default="off")
    ap.add_argument("--gqa", action="store_true", help="also the dK/dV kernel's GQA group walk (GQA=True)")
    args = ap.parse_args(argv)
    if GLUON_ERROR:
        print(GLUON_ERROR)
        return 1
    rows, failed = [], False
    causals = {"on": (True,), "off": (False,), "both": (False, True)}[args.causal]
    for d in (int(x) for x in args.dims.split(",")):
        for kernel in (k for k in kernels_for(d) if k in args.kernels.split(",")):
            for causal in causals:
                for gqa in ((False, True) if args.gqa and kernel in _PARTS else (False,)):
                    try:
                        rows.append(compile_report(kernel, d, causal, gqa=gqa))
                    except Exception as exc:   # a compile error is a failed row, reported with its message
                        failed = True
                        rows.append(dict(kernel=kernel, head_dim=d, causal=causal, gqa=gqa,
                                         error=f"{type(exc).__name__}: {exc}"[-1500:]))
    from .gluon_fwd import print_compile_rows
    return print_compile_rows(rows, args.json, failed)


# ----- host side ----------------------------------------------------------------------------

def gluon_bwd_reasons(spec, has_residual: bool = True) -> list[str]:
    """Why :func:`gluon_backward` cannot run ``spec``'s backward (empty when it can), one
    sentence each. ``has_residual``: the forward kept O's rounding residual (ops.forward_for_backward
    does for 16-bit inputs; without it the portable backward recomputes exact row statistics)."""
    reasons = _device_reasons(spec)
    if spec.q.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"dtype {spec.q.dtype}: only float16 and bfloat16")
    elif not has_residual:
        reasons.append("no rounding residual of O from the forward (the Gluon backward takes delta from it)")
    if spec.head_dim != spec.head_dim_v or spec.head_dim not in HEAD_DIMS:
        reasons.append(f"head dims D={spec.head_dim}, Dv={spec.head_dim_v}: needs D == Dv in {HEAD_DIMS}")
    for name, present in (("varlen (cu_seqlens)", spec.is_varlen), ("softcap", spec.softcap is not None),
                          ("ALiBi", spec.alibi_slopes is not None), ("attn_bias / mask", spec.attn_bias is not None)):
        if present:
            reasons.append(f"{name} is not implemented in the Gluon backward")
    if spec.batch * spec.num_heads_q > 65535:
        reasons.append(f"batch × heads = {spec.batch * spec.num_heads_q} > 65535 (the dQ grid's second dimension)")
    reasons += _tma_reasons(spec)
    return reasons


#: where ``auto`` (the default) takes the Gluon backward without GQA: head dim -> the fewest query
#: rows and keys. The H200 (2026-12-03, bf16, 16k tokens, hidden 2048; benchmarks/results/
#: triton-gluon-bwd-check-h200.*) timed it at D 128 1.04-1.36 x the deterministic portable
#: backward and 1.11-1.32 x the atomic one from S 1k; at D 64 1.08-1.25 x from S 4k but 0.83-0.90 x
#: at S 1k; at D 256 (two dK/dV passes, then dQ) 1.35-1.86 x the deterministic and 1.18-1.49 x the
#: atomic backward from S 1k, causal and not (1.22-1.36 x FA2). S 512 is untimed and keeps the
#: portable backward.
AUTO_MIN_SEQLEN = {128: 1024, 64: 4096, 256: 1024}

#: the same with GQA (the dK/dV kernel's in-CTA walk over the group's query heads): timed on the
#: H200 at D 128, S 4k and 16k, Hq/Hkv 16/4 and 16/2 (the same run): 1.25-1.37 x the deterministic
#: portable backward, 1.30-1.64 x the atomic one. Shorter sequences and D 64 with GQA are untimed
#: and keep the portable backward.
AUTO_GQA_MIN_SEQLEN = {128: 4096}


def auto_takes(spec) -> bool:
    """Whether ``auto`` would take the Gluon backward for ``spec``'s shape (before
    :func:`gluon_bwd_reasons`): a head dim of :data:`AUTO_MIN_SEQLEN` (with GQA:
    :data:`AUTO_GQA_MIN_SEQLEN`) and at least that many query rows and keys."""
    table = AUTO_MIN_SEQLEN if spec.num_heads_q == spec.num_heads_kv else AUTO_GQA_MIN_SEQLEN
    need = table.get(spec.head_dim)
    return need is not None and spec.head_dim_v == spec.head_dim and min(spec.seqlen_q, spec.seqlen_k) >= need


def backward_choice(spec, has_residual: bool = True) -> str:
    """``"gluon"`` or ``"triton"`` (the portable / atomic backward) by
    ``PORTATTN_TRITON_BACKWARD``: ``gluon`` where :func:`gluon_bwd_reasons` is empty; ``auto``
    (the default) also only where :func:`auto_takes`; ``portable`` never. An unknown value raises
    ``ValueError``. The Gluon backward is deterministic, so it serves determinism requests too."""
    from portattn import config
    mode = config.triton_backward()
    if mode == "portable" or (mode == "auto" and not auto_takes(spec)):
        return "triton"
    return "gluon" if not gluon_bwd_reasons(spec, has_residual) else "triton"


def _windows(spec) -> tuple[int, int]:
    left = _UNBOUNDED if spec.window_left is None else spec.window_left
    right = 0 if spec.causal else (_UNBOUNDED if spec.window_right is None else spec.window_right)
    return left, right


def _check_stats(name: str, t: torch.Tensor, spec) -> None:
    shape = tuple(spec.lse_shape)
    if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != spec.q.device or t.stride(-1) != 1:
        raise ValueError(f"{name} must be float32 of shape {shape} on {spec.q.device} with unit last stride; "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}, strides {t.stride()}")


def gluon_backward(spec, dout: torch.Tensor, rowmax: torch.Tensor, delta: torch.Tensor,
                   dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write dq ``(B, Sq, Hq, D)``, dk and dv ``(B, Sk, Hkv, D)`` (views with a unit last stride,
    written through their strides; q's dtype) of ``spec`` by the two Gluon kernels, from
    ``dout`` (O's shape) and the prep kernel's ``rowmax`` (= lse·log2(e), +inf for a row with
    no visible key) and ``delta`` (= rowsum(dO ∘ O) − dlse), both float32 ``spec.lse_shape``.
    Deterministic: every output element is written by one program (with GQA the dK/dV program of
    a KV head sums its group's query heads in a fixed order in registers). At D 256 the dK/dV
    kernel runs twice (:func:`kernels_for`: the dV pass, then the dK pass), then dQ. Raises ValueError with
    :func:`gluon_bwd_reasons` when the kernels cannot run the problem."""
    reasons = gluon_bwd_reasons(spec)
    if reasons:
        raise ValueError("the Gluon backward cannot run this problem: " + "; ".join(reasons))
    for name, t in (("rowmax", rowmax), ("delta", delta)):
        _check_stats(name, t, spec)
    for name, g, ref in (("dq", dq, spec.q), ("dk", dk, spec.k), ("dv", dv, spec.v)):
        if tuple(g.shape) != tuple(ref.shape) or g.dtype != ref.dtype or g.stride(-1) != 1:
            raise ValueError(f"{name} must be {ref.dtype} of shape {tuple(ref.shape)} with unit last stride; "
                             f"got {g.dtype} {tuple(g.shape)} strides {g.stride()}")
    if tuple(dout.shape) != tuple(spec.out_shape):
        raise ValueError(f"dout must have the output's shape {tuple(spec.out_shape)}, got {tuple(dout.shape)}")
    if spec.is_empty:
        return dq.zero_(), dk.zero_(), dv.zero_()
    dout = dout.to(spec.dtype)
    if not _tma_aligned(dout):
        dout = dout.contiguous()
    from . import gluon_fwd
    gluon_fwd._ensure_allocator()
    q, k, v = spec.q, spec.k, spec.v
    hq, hkv = spec.num_heads_q, spec.num_heads_kv
    gqa = hq // hkv
    left, right = _windows(spec)
    bottom_right = spec.alignment == "bottom_right"
    causal_like = right != _UNBOUNDED and left == _UNBOUNDED
    anticausal_like = left != _UNBOUNDED and right == _UNBOUNDED
    qk_scale2 = float(spec.scale) * 1.4426950408889634
    common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    ints = (hq, gqa, spec.seqlen_q, spec.seqlen_k, qk_scale2, float(spec.scale), left, right)
    lse_strides = rowmax.stride()[:2]
    if delta.stride()[:2] != lse_strides:
        delta = delta.contiguous()
        rowmax = rowmax.contiguous()
        lse_strides = rowmax.stride()[:2]
    group = head_group(spec) if causal_like or anticausal_like else 1
    ntile_k = -(-spec.seqlen_k // BLOCK)   # a CTA per (key tile, KV head)
    grid_kv = (ntile_k, spec.batch * hq) if gqa == 1 else (ntile_k, hkv, spec.batch)
    for part in (p for p in kernels_for(spec.head_dim) if p in _PARTS):   # dkdv, or (D 256) dv then dk
        attn_bwd_dkdv_gluon[grid_kv](q, k, v, dout, dk, dv, rowmax, delta, *common,
                                     *dk.stride()[:3], *dv.stride()[:3], *lse_strides, *ints, group,
                                     **launch_constexprs(part, spec.head_dim, bottom_right, anticausal_like, gqa > 1),
                                     **LAUNCH_OPTIONS)
    grid_q = (-(-spec.seqlen_q // BLOCK), spec.batch * hq)
    attn_bwd_dq_gluon[grid_q](q, k, v, dout, dq, rowmax, delta, *common, *dq.stride()[:3], *lse_strides, *ints,
                              group, **launch_constexprs("dq", spec.head_dim, bottom_right, causal_like),
                              **LAUNCH_OPTIONS)
    return dq, dk, dv


if __name__ == "__main__":
    raise SystemExit(main())
