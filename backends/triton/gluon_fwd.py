"""An FA3-style attention forward for NVIDIA Hopper (sm_90) in Gluon: the triton backend's default
forward where the H200 timed it faster than the portable kernel (:data:`AUTO_MIN_SEQLEN_Q`).

Gluon (``triton.experimental.gluon``, triton >= 3.6) is triton's lower-level language: explicit
layouts, shared memory, mbarriers, TMA, asynchronous ``wgmma`` and warp specialisation. This
module writes FlashAttention-3's forward schedule with it (Shah et al., 2024), because triton's
own ``tl.range(warp_specialize=True)`` leaves the portable kernel's loop unspecialised at 8 warps
(docs/triton.md). One CTA owns 128 query rows of one (batch, head) and runs three partitions:

* **producer** (1 warp, few registers): TMA loads of the two 64-row Q tiles, then of every K and
  V tile of the band into a ``STAGES``-deep shared ring; ``k_ready``/``v_ready`` mbarriers carry
  the byte counts, ``k_empty``/``v_empty`` (count 2: both consumers) give a slot back;
* **two consumer warpgroups** (4 warps each, most registers), one per 64 query rows, issuing
  asynchronous ``wgmma``: S = Q Kᵀ from shared memory, O += P V with P in registers (the
  accumulator layout of S *is* the A-operand layout of P V, no shuffle). They share the ring;
  with ``PINGPONG`` they take turns to issue their products (two more mbarriers), so one
  warpgroup's softmax overlaps the other's matrix products (FA3's inter-warpgroup ping-pong;
  without it they run independently and the hardware interleaves them); inside a warpgroup the
  next tile's Q Kᵀ and the previous tile's P V are in flight while it does a tile's softmax
  (FA3's intra-warpgroup overlap).

Semantics are the portable forward's (``kernels.attn_fwd``, docs/semantics.md): scores in base 2
with ``qk_scale2 = scale·log2(e)`` and ``exp2``; bottom-right or top-left causal alignment on the
aligned row ``i + off``; key tiles in three phases (masked / unmasked / masked, only the band's
edge tiles pay for the element mask); GQA by the head index; a row with no visible key outputs 0
and ``lse = -inf``. Out ``(B, Sq, Hq, Dv)`` and lse ``(B, Hq, Sq)`` are written through their
strides; Q/K/V/O go through device-side tensor descriptors of each (sequence, head)'s ``(S, D)``
slab, whose bounds zero-fill ragged tiles and clip the O store. With ``RESIDUAL`` (a training
forward, ``ops.forward_for_backward``) the epilogue also stores O's rounding residual
``O_f32 − round(O_f32)`` (O's dtype and strides; the backward's delta of the unrounded output,
as ``kernels.attn_fwd``'s ``RESIDUAL``) through the same Q tile once O's store has read it;
without it the kernel compiles to the same code as before the option. Dense inputs only; float16 and
bfloat16; ``D == Dv`` in {64, 128, 256}; no softcap, ALiBi, bias or sliding window
(:func:`gluon_reasons` says which problems it cannot run).

``PERSISTENT`` (D 64/128/256, O through the Q tile where its own does not fit, D 256: ``O_IN_Q``, :func:`smem_plan`; ``auto`` takes it where the H200 timed it faster, :data:`AUTO_PERSISTENT`;
``PORTATTN_TRITON_GLUON_PERSISTENT`` forces it on or off) is FA3's persistent schedule against the one-tile CTA's fixed cost (pipeline fill, epilogue,
descriptor set-up): one CTA per SM walks (query tile, head) work units (:func:`_work_tile`,
for causal-like bands longest first, a long and a short tile together) with rank-4 descriptors made once, the producer's ring count
running on across items, two Q tiles a consumer used by alternate items (``Q_BUFS``,
:func:`_q_slot`: the next item's Q loads while this one runs), each handed back before the
epilogue (``q_empty``), and O stored through its own shared tiles, so the next item's loads overlap
the current one's band and epilogue. The same stage
helpers (:func:`_load_q`, :func:`_load_kv`, :func:`_attend`, :func:`_epilogue`) run both; with it
off every variant compiles to the same code as before it existed.

The module imports without triton's Gluon (``GLUON_ERROR`` then says why, and every problem is
refused). Between triton 3.6 (the H200's) and 3.9 the pieces used here keep their signatures
but for the TMA copies, renamed in 3.9 (``async_copy_global_to_shared`` / ``_shared_to_global``
-> ``async_load`` / ``async_store``; the old names raise there), resolved once below;
``gl.warp_specialize``'s register list is required in 3.6 and optional in 3.9 (always given).
"""

from __future__ import annotations

import functools
import os

import torch

try:   # Gluon and its Hopper pieces: triton >= 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    GLUON_ERROR = ""
except Exception as exc:   # an older triton, or a build without Gluon
    gluon = gl = None
    GLUON_ERROR = f"triton has no Gluon Hopper API ({type(exc).__name__}: {exc})"

#: the environment switch of the triton backend's forward (read by :func:`forward_choice`)
ENV_SWITCH = "PORTATTN_TRITON_FORWARD"
#: the head dims the kernel is written for (``D == Dv``); each has its tile table row below
HEAD_DIMS = (64, 128, 256)
#: stands for an unbounded window side (as ops.UNBOUNDED)
_UNBOUNDED = 1 << 30
#: query rows per consumer warpgroup (wgmma's M is 64 per warpgroup); a CTA holds two
WG_M = 64
#: the head dims of the persistent variant (``PERSISTENT``; ``auto``'s rows, ``PORTATTN_TRITON_GLUON_PERSISTENT``)
PERSISTENT_HEAD_DIMS = (64, 128, 256)
#: the head dims that can run three consumer warpgroups (192-row CTAs; :func:`consumers_for`)
THREE_CONSUMER_HEAD_DIMS = (64,)
#: the consumer warpgroups per head dim when neither the call nor ``PORTATTN_TRITON_GLUON_CONSUMERS`` says:
#: three at D 64, where ``auto`` takes the Gluon forward only on rows an H100 timed with three
#: (2026-12-05, tools/gluon_consumers_check.py, benchmarks/results/triton-gluon-consumers-h100.txt:
#: three / two consumers 1.07-1.17 x one-tile and 1.02-1.11 x persistent non-causal, 1.07-1.10 x
#: causal from S 8k; slower on short causal bands, which stay with the portable kernel)
DEFAULT_CONSUMERS = {64: 3, 128: 2, 256: 2}
#: kernel arguments only the persistent variant reads (the constexpr None otherwise, as ORES)
_PERSISTENT_ONLY_ARGS = ("batch",)


@functools.lru_cache(maxsize=8)
def tile_config(head_dim: int, consumers: int = 2) -> tuple[int, int]:
    """(BLOCK_N, STAGES) for head dim ``head_dim`` and ``consumers`` warpgroups: shared memory is a
    Q tile of (64, D) per consumer plus ``STAGES`` K and V tiles of (BLOCK_N, D), 2 bytes each
    (the persistent kernel adds an O tile per consumer): D 64 -> 16 + 96 KiB (three consumers 24
    + 96), D 128 -> 32 + 128 KiB, D 256 -> 64 + 128 KiB (the H200 allows 227 KiB a block). FA3
    uses the same N for D 64/128 with two; D 256 halves it to keep the accumulator (64 x 256
    fp32, 128 registers) in budget. Three consumers at D 128 would need 64-key tiles for S and P
    to fit beside the accumulator in 160 registers; they compiled without spills but ran 0.84-1.00
    x two (an H100, 2026-12-05, benchmarks/results/triton-gluon-consumers-d128-h100.txt), so D 128
    keeps two."""
    return {(64, 2): (128, 3), (64, 3): (128, 3), (128, 2): (128, 2), (256, 2): (64, 2)}[head_dim, consumers]


# ----- the kernel ---------------------------------------------------------------------------

if gl is not None:
    # triton 3.9 renamed the TMA copies (the 3.6 names raise there)
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _LOG2E = gl.constexpr(1.4426950408889634)
    _LN2 = gl.constexpr(0.6931471805599453)
    _WG_M = gl.constexpr(WG_M)

    @gluon.jit
    def _key_phases(m0, sq, sk, off, window_left, window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """(lo, full_lo, full_hi, hi) of the key tiles for the query rows ``m0 … m0+BLOCK_M-1``:
        tiles in [lo, full_lo) and [full_hi, hi) need the element mask, [full_lo, full_hi) are
        visible to every row (kernels._key_phases, the same arithmetic)."""
        r0 = m0 + off
        r1 = gl.minimum(m0 + BLOCK_M, sq) - 1 + off
        lo = gl.maximum(r0 - window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        hi = gl.minimum(r1 + window_right + 1, sk)
        full_lo = gl.maximum(r1 - window_left, 0)
        full_lo = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        full_lo = gl.minimum(gl.maximum(full_lo, lo), gl.maximum(hi, lo))
        full_hi = (gl.maximum(r0 + window_right + 1, 0) // BLOCK_N) * BLOCK_N
        full_hi = gl.minimum(full_hi, (sk // BLOCK_N) * BLOCK_N)
        full_hi = gl.maximum(full_hi, full_lo)
        return lo, full_lo, full_hi, hi

    @gluon.jit
    def _tile_index(LONGEST_FIRST: gl.constexpr):
        """This CTA's tile along grid dimension 0: ``program_id(0)``, reversed with ``LONGEST_FIRST``
        (a causal-like band: the last tiles see the most keys, or queries, so they start first)."""
        pid = gl.program_id(0)
        if LONGEST_FIRST:
            pid = gl.num_programs(0) - 1 - pid
        return pid

    @gluon.jit
    def _heads(bh, num_heads_q, gqa_ratio):
        """(b, h, h_kv) of (batch, head) number ``bh`` of B·Hq: its batch, query head and the KV
        head it reads (GQA: ``gqa_ratio`` = Hq // Hkv query heads share one)."""
        b = bh // num_heads_q
        h = bh % num_heads_q
        h_kv = h // gqa_ratio
        return b, h, h_kv

    @gluon.jit
    def _align_offset(sq, sk, BOTTOM_RIGHT: gl.constexpr):
        """``off``: query row ``i`` is aligned with key ``i + off`` (the causal diagonal and the
        window's centre): ``Sk − Sq`` bottom-right, 0 top-left (docs/semantics.md)."""
        if BOTTOM_RIGHT:
            off = sk - sq
        else:
            off = sk * 0
        return off

    @gluon.jit
    def _longest_first(w, num_m, num_bh, head_group):
        """``(m, bh)``, the query tile and (batch, head) of the ``w``-th work item of a causal-like
        band's walk over ``num_m`` tiles of ``num_bh`` (batch, head)s: the (batch, head)s in groups of
        ``head_group`` (:func:`head_group`), each group's tiles longest first across its heads (the
        last tile of every head, then the one before, ...). The long tiles start early and short ones
        end the schedule (balance), while the K and V the tiles in flight read stay in L2: one group's
        heads at a time (a walk longest first over all heads re-reads them from DRAM)."""
        span = head_group * num_m
        grp = w // span
        g0 = grp * head_group
        g = gl.minimum(head_group, num_bh - g0)
        r = w - grp * span
        return num_m - 1 - r // g, g0 + r % g

    @gluon.jit
    def _row_tile(num_heads_q, gqa_ratio, sq, sk, window_left, window_right, BLOCK_N: gl.constexpr,
                  BOTTOM_RIGHT: gl.constexpr, LONGEST_FIRST: gl.constexpr, CONSUMERS: gl.constexpr = 2,
                  head_group=None):
        """The prologue of a Q-stationary CTA (the forward, the backward's dQ) on grid
        (cdiv(Sq, 64·CONSUMERS), B·Hq): ``(b, h, h_kv, m0, off, (lo, full_lo, full_hi, hi))`` — its
        batch, query head and KV head (:func:`_heads` of its grid row), its first query row ``m0`` of 64·CONSUMERS
        (one 64-row tile per consumer warpgroup; the last tile first with ``LONGEST_FIRST``), the
        alignment ``off`` (:func:`_align_offset`) and the band of ``BLOCK_N``-key tiles its rows see
        in three phases (:func:`_key_phases`). With ``head_group`` (the forward, ``LONGEST_FIRST``)
        the grid's CTAs, numbered in launch order, take the tiles of :func:`_longest_first`'s walk."""
        BLOCK_M: gl.constexpr = CONSUMERS * _WG_M
        if LONGEST_FIRST and head_group is not None:
            num_m = gl.num_programs(0)
            pid, bh = _longest_first(gl.program_id(1) * num_m + gl.program_id(0), num_m, gl.num_programs(1),
                                     head_group)
        else:
            pid = _tile_index(LONGEST_FIRST)
            bh = gl.program_id(1)
        b, h, h_kv = _heads(bh, num_heads_q, gqa_ratio)
        m0 = pid * BLOCK_M
        off = _align_offset(sq, sk, BOTTOM_RIGHT)
        phases = _key_phases(m0, sq, sk, off, window_left, window_right, BLOCK_M, BLOCK_N)
        return b, h, h_kv, m0, off, phases

    @gluon.jit
    def _work_range(sq, batch, num_heads_q, CONSUMERS: gl.constexpr, PAIRED: gl.constexpr):
        """``(num_m, start, stop, step)``: the cdiv(Sq, 64·CONSUMERS) query tiles of a (batch, head),
        and the range of this persistent CTA's loop over its tiles (:func:`_work_tile`). Unpaired,
        the walk's tiles ``program_id``, ``program_id`` + ``num_programs``, ...; with ``PAIRED``
        every ``num_programs``-th of cdiv(num_m, 2) units a (batch, head) from ``program_id``, two
        tiles a unit, counted 0, 1, ..."""
        num_m = (sq + CONSUMERS * _WG_M - 1) // (CONSUMERS * _WG_M)
        if PAIRED:
            units = ((num_m + 1) >> 1) * (batch * num_heads_q)
            mine = (units - gl.program_id(0) + gl.num_programs(0) - 1) // gl.num_programs(0)
            return num_m, 0, mine * 2, 1
        else:
            return num_m, gl.program_id(0), num_m * batch * num_heads_q, gl.num_programs(0)

    @gluon.jit
    def _work_tile(j, num_m, batch, num_heads_q, gqa_ratio, head_group, LONGEST_FIRST: gl.constexpr,
                   PAIRED: gl.constexpr, CONSUMERS: gl.constexpr):
        """``(b, h, h_kv, m0)``: the batch, query head, KV head (:func:`_heads`) and first query row of
        step ``j`` of a persistent CTA's loop (:func:`_work_range`), the producer's and the
        consumers' alike. Unpaired, ``j`` numbers the walk's tiles: head-major (a head's tiles
        run side by side and share its K and V in L2), or with ``LONGEST_FIRST`` (a causal-like
        band) :func:`_longest_first`'s walk, ``head_group`` heads at a time; each CTA takes every
        #SMs-th, so which lengths it gets depends on how #SMs falls on the walk. With ``PAIRED`` (a
        causal-like band) the CTA's ``j``-th tile is of its ``j//2``-th unit, every #SMs-th of
        :func:`_longest_first`'s walk over pairs of one head's tiles, ``num_m-1-x`` then ``x``:
        the long one first, and every unit about ``num_m``+1 key tiles, so each CTA gets about the
        same work (docs/triton.md, The causal walk in pairs). The middle tile of an odd ``num_m``
        pairs with tile ``num_m``, past the end, which sees no keys (:func:`_item_band`)."""
        num_bh = batch * num_heads_q
        if PAIRED:
            x, bh = _longest_first(gl.program_id(0) + (j >> 1) * gl.num_programs(0), (num_m + 1) >> 1, num_bh,
                                   head_group)
            first = num_m - 1 - x
            t = j & 1   # 0: the long tile, 1: the short one (tile num_m where the two are one tile)
            m = first + t * (x - first) + t * (first == x).to(gl.int32) * (num_m - x)
        elif LONGEST_FIRST:
            m, bh = _longest_first(j, num_m, num_bh, head_group)
        else:
            m = j % num_m
            bh = j // num_m
        b, h, h_kv = _heads(bh, num_heads_q, gqa_ratio)
        return b, h, h_kv, m * (CONSUMERS * _WG_M)

    @gluon.jit
    def _item_band(m0, sq, sk, off, window_left, window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   PAIRED: gl.constexpr):
        """:func:`_key_phases` of a persistent CTA's tile at query row ``m0``; with ``PAIRED`` a tile
        past the end (``m0`` >= Sq, :func:`_work_tile`'s partner of an odd middle tile) sees no keys."""
        lo, full_lo, full_hi, hi = _key_phases(m0, sq, sk, off, window_left, window_right, BLOCK_M, BLOCK_N)
        if PAIRED:
            hi = hi * (m0 < sq).to(gl.int32)
        return lo, full_lo, full_hi, hi

    @gluon.jit
    def _tma_load_rows(desc, row, b, h, bar, dst, PERSISTENT: gl.constexpr):
        """TMA load of the ``(rows, D)`` tile at sequence position ``row`` into ``dst``: through a
        descriptor of one (sequence, head)'s ``(S, D)`` slab, or (``PERSISTENT``) of the whole
        ``(B, S, H, D)`` tensor at ``[b, row, h, 0]`` (its S bound zero-fills ragged tiles)."""
        if PERSISTENT:
            _tma_load(desc, [b, row, h, 0], bar, dst.reshape([1, dst.shape[0], 1, dst.shape[1]]))
        else:
            _tma_load(desc, [row, 0], bar, dst)

    @gluon.jit
    def _tma_store_rows(desc, row, b, h, src, PERSISTENT: gl.constexpr):
        """TMA store of ``src`` at sequence position ``row`` (as :func:`_tma_load_rows`); the
        descriptor's S bound clips rows >= S."""
        if PERSISTENT:
            _tma_store(desc, [b, row, h, 0], src.reshape([1, src.shape[0], 1, src.shape[1]]))
        else:
            _tma_store(desc, [row, 0], src)

    @gluon.jit
    def _q_slot(c, WG: gl.constexpr, CONSUMERS: gl.constexpr, Q_BUFS: gl.constexpr):
        """The ``q_smem`` / ``q_bar`` / ``q_empty`` slot of warpgroup ``WG``'s Q tile for a CTA's
        ``c``-th work item, and the parity of that item's round on the slot's barriers: with
        ``Q_BUFS`` 2 the items alternate between two sets of ``CONSUMERS`` slots."""
        if Q_BUFS == 1:
            slot = c * 0 + WG
            ph = c & 1
        else:
            slot = (c % Q_BUFS) * CONSUMERS + WG
            ph = (c // Q_BUFS) & 1
        return slot, ph

    @gluon.jit
    def _load_q(q_desc, q_smem, q_bar, q_empty, c, m0, b, h, HEAD_D: gl.constexpr, PERSISTENT: gl.constexpr,
                CONSUMERS: gl.constexpr, Q_BUFS: gl.constexpr):
        """The producer's first stage of a tile: the 64-row Q tile of every consumer warpgroup (one
        per ``q_smem`` slot). ``PERSISTENT``: the ``c``-th
        tile of this CTA, loaded once its warpgroup released the slot's previous tile (``q_empty``,
        waited on the parity before the current round's: a fresh barrier passes at once); with
        ``Q_BUFS`` 2 that is the tile of item ``c − 2``, so item ``c``'s Q loads while item ``c − 1``
        runs (:func:`_q_slot`)."""
        tile_bytes: gl.constexpr = _WG_M * HEAD_D * 2
        for wg in gl.static_range(CONSUMERS):
            if PERSISTENT:
                slot, ph = _q_slot(c, wg, CONSUMERS, Q_BUFS)
                mbarrier.wait(q_empty.index(slot), ph ^ 1)
            else:
                slot = wg
            mbarrier.expect(q_bar.index(slot), tile_bytes)
            _tma_load_rows(q_desc, m0 + wg * _WG_M, b, h, q_bar.index(slot), q_smem.index(slot), PERSISTENT)

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, i, lo, hi, b, h_kv,
                 BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
        """The producer's second stage: K and V of every key tile in [lo, hi) into the ring, ``i``
        counting the ring's tiles (0 at a CTA's start, running on across a persistent CTA's
        tiles); returns the count after the band. A slot is refilled once both consumers released
        it (``*_empty``, waited on the parity before the current round's)."""
        kv_bytes: gl.constexpr = BLOCK_N * HEAD_D * 2
        for n in range(lo, hi, BLOCK_N):
            st = i % STAGES
            ph = (i // STAGES) & 1
            mbarrier.wait(k_empty.index(st), ph ^ 1)
            mbarrier.expect(k_ready.index(st), kv_bytes)
            _tma_load_rows(k_desc, n, b, h_kv, k_ready.index(st), k_smem.index(st), PERSISTENT)
            mbarrier.wait(v_empty.index(st), ph ^ 1)
            mbarrier.expect(v_ready.index(st), kv_bytes)
            _tma_load_rows(v_desc, n, b, h_kv, v_ready.index(st), v_smem.index(st), PERSISTENT)
            i += 1
        return i

    @gluon.jit
    def _producer(args, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
        """The load warp of one CTA's tile: its Q tiles (:func:`_load_q`), then K and V of every key
        tile in [lo, hi) into the ring (:func:`_load_kv`). ``args``: the kernel's values it takes (a
        partition's values travel as one tuple, its constexprs beside it)."""
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, m0, lo, hi = args
        _load_q(q_desc, q_smem, q_bar, None, 0, m0, 0, 0, HEAD_D, False, q_smem.shape[0], 1)
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, lo * 0, lo, hi, 0, 0,
                 BLOCK_N, HEAD_D, STAGES, False)

    @gluon.jit
    def _persistent_producer(args, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                             LONGEST_FIRST: gl.constexpr, PAIRED: gl.constexpr, CONSUMERS: gl.constexpr,
                             Q_BUFS: gl.constexpr):
        """The load warp of a persistent CTA: :func:`_producer`'s two stages for each of its work
        units' tiles (:func:`_work_tile`), the ring count
        running on across items, so the next item's Q and first K/V tiles load while the
        consumers still finish (and store) the current one."""
        (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, batch,
         num_heads_q, gqa_ratio, head_group, sq, sk, off, window_left, window_right) = args
        kv = sq * 0
        c = sq * 0
        num_m, start, stop, step = _work_range(sq, batch, num_heads_q, CONSUMERS, PAIRED)
        for j in range(start, stop, step):
            b, h, h_kv, m0 = _work_tile(j, num_m, batch, num_heads_q, gqa_ratio, head_group, LONGEST_FIRST, PAIRED,
                                        CONSUMERS)
            lo, full_lo, full_hi, hi = _item_band(m0, sq, sk, off, window_left, window_right, CONSUMERS * _WG_M,
                                                  BLOCK_N, PAIRED)
            _load_q(q_desc, q_smem, q_bar, q_empty, c, m0, b, h, HEAD_D, True, CONSUMERS, Q_BUFS)
            kv = _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, kv, lo, hi, b, h_kv,
                          BLOCK_N, HEAD_D, STAGES, True)
            c += 1

    @gluon.jit
    def _masked(s, rows, cols, sk, off, window_left, window_right):
        """Scores of the keys a row cannot see set to -inf (keys >= Sk, outside the band)."""
        aligned = rows[:, None] + off
        c = cols[None, :]
        visible = (c < sk) & (c >= aligned - window_left) & (c <= aligned + window_right)
        return gl.where(visible, s, float("-inf"))

    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale2):
        """One tile of the online softmax on raw scores ``s`` (natural units of Q Kᵀ): the new
        max, the rescale ``alpha`` of what was summed before, the tile's ``p`` and the new sum.
        A row with nothing visible yet keeps m = -inf and subtracts 0 (no -inf - -inf)."""
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2((m_i - m_safe) * qk_scale2)
        p = gl.exp2(s * qk_scale2 - (m_safe * qk_scale2)[:, None])
        l_new = l_i * alpha + gl.sum(p, 1)
        return m_new, alpha, p, l_new

    @gluon.jit
    def _turn_wait(turn, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """FA3's warpgroup ping-pong (``PINGPONG``): the consumers (one barrier each in ``turn``: two,
        or three at :data:`THREE_CONSUMER_HEAD_DIMS`) take turns to issue their products in a
        cycle, WG 0 its k-th after the last WG's (k-1)-th, WG w > 0 its k-th after WG w-1's k-th, so
        that one warpgroup's softmax runs while another's products do. ``turn[w]`` is the barrier
        WG w waits on (:func:`_turn_pass` arrives on the next one's); WG 0's first wait passes on
        the fresh barrier (parity 1), and all issue at the same count of points, so the turns line
        up; no barrier can run a phase ahead of its waiter, since the cycle passes through it."""
        FIRST: gl.constexpr = 1 if WG == 0 else 0
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (k & 1) ^ FIRST)

    @gluon.jit
    def _turn_pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
        NEXT: gl.constexpr = (WG + 1) % turn.shape[0]
        if PINGPONG:
            mbarrier.arrive(turn.index(NEXT), count=1)

    @gluon.jit
    def _band(acc, m_i, l_i, p_prev, i, turn_off, start, stop, q, ring, rows, cols0, sk, off, window_left, window_right,
              qk_scale2, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr,
              MASK: gl.constexpr, full_lo, full_hi):
        """Key tiles [start, stop) of one phase. ``ring`` = (K tiles, V tiles, k_ready, v_ready,
        k_empty, v_empty, turn); ``i`` counts the tiles this warpgroup has taken from it (``i +
        turn_off`` its ping-pong turns, :func:`_attend`) and ``p_prev`` is tile i-1's P, whose P V is still to be added. Each step issues
        S_i = Q K_iᵀ and acc += P_{i-1} V_{i-1} (both async), waits for S_i only, does its
        softmax while P V runs, then waits for P V and rescales acc by this tile's alpha. ``MASK``:
        the element mask never (False: an unmasked phase), on every tile (True: an edge phase), or on
        the tiles outside [``full_lo``, ``full_hi``) (2: the whole band in one step, ``ONE_STEP``)."""
        k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn = ring
        for n in range(start, stop, BLOCK_N):
            st = i % STAGES
            pst = (i - 1) % STAGES
            mbarrier.wait(k_ready.index(st), (i // STAGES) & 1)
            mbarrier.wait(v_ready.index(pst), ((i - 1) // STAGES) & 1)
            _turn_wait(turn, i + turn_off, WG, PINGPONG)
            s = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), gl.zeros([_WG_M, BLOCK_N], gl.float32, s_layout),
                              use_acc=False, is_async=True)
            acc = warpgroup_mma(p_prev, v_smem.index(pst), acc, is_async=True)
            _turn_pass(turn, WG, PINGPONG)
            s = warpgroup_mma_wait(1, deps=(s,))        # S_i done; P_{i-1} V_{i-1} may still run
            mbarrier.arrive(k_empty.index(st), count=1)
            if MASK == 2:
                if (n < full_lo) | (n >= full_hi):
                    s = _masked(s, rows, n + cols0, sk, off, window_left, window_right)
            elif MASK:
                s = _masked(s, rows, n + cols0, sk, off, window_left, window_right)
            m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, qk_scale2)
            acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
            mbarrier.arrive(v_empty.index(pst), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_prev = gl.convert_layout(p.to(q.dtype), p_layout)
            i += 1
        return acc, m_i, l_i, p_prev, i

    @gluon.jit
    def _attend(acc, m_i, l_i, i0, turn_off, q, ring, rows, cols0, sk, off, lo, full_lo, full_hi, hi,
                window_left, window_right, qk_scale2, s_layout: gl.constexpr, o_layout: gl.constexpr,
                p_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr,
                PINGPONG: gl.constexpr, ONE_STEP: gl.constexpr = False):
        """A consumer's main loop over a non-empty band [lo, hi): the first tile (always masked: it
        may be an edge tile) starts the pipeline, :func:`_band` runs the three phases (``ONE_STEP``:
        the rest of the band in one :func:`_band` whose step masks the edge tiles behind a runtime
        branch — one copy of the step's code instead of three, for the instruction cache), the last
        tile's P V ends it; returns ``(acc, m_i, l_i, i)``. ``i0`` is the ring count at the band's
        first tile (0 in a CTA of one tile, running on in a persistent CTA) and ``i`` the count
        after it; ``turn_off`` is added to the ring count to number the ping-pong turns (the
        bands before this one: each has one more issue point than tiles)."""
        k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn = ring
        st0 = i0 % STAGES
        mbarrier.wait(k_ready.index(st0), (i0 // STAGES) & 1)
        _turn_wait(turn, i0 + turn_off, WG, PINGPONG)
        s = warpgroup_mma(q, k_smem.index(st0).permute((1, 0)), gl.zeros([_WG_M, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        _turn_pass(turn, WG, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(st0), count=1)
        s = _masked(s, rows, lo + cols0, sk, off, window_left, window_right)
        m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i, qk_scale2)
        p_prev = gl.convert_layout(p.to(q.dtype), p_layout)
        i = lo * 0 + (i0 + 1)
        nxt = lo + BLOCK_N
        if ONE_STEP:
            acc, m_i, l_i, p_prev, i = _band(acc, m_i, l_i, p_prev, i, turn_off, nxt, hi, q, ring, rows, cols0, sk,
                                             off, window_left, window_right, qk_scale2, s_layout, o_layout, p_layout,
                                             BLOCK_N, STAGES, WG, PINGPONG, 2, full_lo, full_hi)
        else:
            for phase in gl.static_range(3):   # masked / unmasked / masked, as kernels._phase_range
                if phase == 0:
                    start = nxt
                    stop = gl.maximum(full_lo, nxt)
                elif phase == 1:
                    start = gl.maximum(full_lo, nxt)
                    stop = gl.maximum(full_hi, nxt)
                else:
                    start = gl.maximum(full_hi, nxt)
                    stop = hi
                acc, m_i, l_i, p_prev, i = _band(acc, m_i, l_i, p_prev, i, turn_off, start, stop, q, ring, rows,
                                                 cols0, sk, off, window_left, window_right, qk_scale2, s_layout,
                                                 o_layout, p_layout, BLOCK_N, STAGES, WG, PINGPONG,
                                                 phase != 1, full_lo, full_hi)
        # the last tile's P V
        pst = (i - 1) % STAGES
        mbarrier.wait(v_ready.index(pst), ((i - 1) // STAGES) & 1)
        _turn_wait(turn, i + turn_off, WG, PINGPONG)
        acc = warpgroup_mma(p_prev, v_smem.index(pst), acc, is_async=True)
        _turn_pass(turn, WG, PINGPONG)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        mbarrier.arrive(v_empty.index(pst), count=1)
        return acc, m_i, l_i, i

    @gluon.jit
    def _epilogue(acc, m_i, l_i, o_descs, o_tile, LSE, lse_off, rows, row0, b, h, sq, qk_scale2,
                  o_layout: gl.constexpr, RESIDUAL: gl.constexpr, PERSISTENT: gl.constexpr):
        """Normalise once (rows with no visible key output 0 and lse = -inf), store lse, and O
        (with ``RESIDUAL`` then O's rounding residual) through the shared tile ``o_tile`` by TMA
        (:func:`_tma_store_rows`; the descriptor clips rows >= Sq). One tile a CTA: ``o_tile`` is
        the Q tile (its last reader, a wgmma, has completed) and the stores drain before the CTA
        ends. ``PERSISTENT``: ``o_tile`` is O's own buffer; the previous item's stores must have
        read it before it is rewritten, and this item's drain while the next item runs."""
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
        lse = gl.where(empty, float("-inf"), (m_i * qk_scale2 + gl.log2(l_safe)) * _LN2)
        gl.store(LSE + lse_off + rows, lse, mask=rows < sq)
        out16 = out.to(o_tile.dtype)
        if PERSISTENT:
            tma.store_wait(0)               # the previous item's O (or residual) has been read out
        o_tile.store(out16)
        fence_async_shared()
        _tma_store_rows(o_descs[0], row0, b, h, o_tile, PERSISTENT)
        if RESIDUAL:   # O_f32 - round(O_f32), rounded: the backward's delta of the unrounded output
            res = (out - out16.to(gl.float32)).to(o_tile.dtype)
            tma.store_wait(0)               # O has been read out of the tile before it takes the residual
            o_tile.store(res)
            fence_async_shared()
            _tma_store_rows(o_descs[1], row0, b, h, o_tile, PERSISTENT)
        if not PERSISTENT:
            tma.store_wait(0)

    @gluon.jit
    def _consumer(WG: gl.constexpr, args, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                  PINGPONG: gl.constexpr, RESIDUAL: gl.constexpr, ONE_STEP: gl.constexpr):
        """One consumer warpgroup: the 64 query rows ``m0 + WG·64 …``; writes their O and lse, and
        with ``RESIDUAL`` O's rounding residual (``o_descs`` = (O's descriptor,) or (O's, ORES's)).
        ``args``: the kernel's values every consumer takes (one tuple, so that the partitions
        differ in ``WG`` alone).
        Every warpgroup issues products at the same points (the first tile's S, one step per
        further tile, the last P V), so the ping-pong turns pair up."""
        (o_descs, q_smem, q_bar, ring, LSE, lse_off, m0, sq, sk, off, lo, full_lo, full_hi, hi, window_left,
         window_right, qk_scale2) = args
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row0 = m0 + WG * _WG_M
        rows = row0 + gl.arange(0, _WG_M, layout=gl.SliceLayout(1, s_layout))
        cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([_WG_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([_WG_M], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([_WG_M, HEAD_D], gl.float32, o_layout)
        q = q_smem.index(WG)
        mbarrier.wait(q_bar.index(WG), 0)   # also before the O store reuses the tile
        if lo < hi:
            acc, m_i, l_i, i = _attend(acc, m_i, l_i, 0, 0, q, ring, rows, cols0, sk, off, lo, full_lo, full_hi, hi,
                                       window_left, window_right, qk_scale2, s_layout, o_layout, p_layout, BLOCK_N,
                                       STAGES, WG, PINGPONG, ONE_STEP)
        _epilogue(acc, m_i, l_i, o_descs, q, LSE, lse_off, rows, row0, 0, 0, sq, qk_scale2, o_layout, RESIDUAL,
                  False)

    @gluon.jit
    def _persistent_consumer(WG: gl.constexpr, args, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                             STAGES: gl.constexpr, PINGPONG: gl.constexpr, RESIDUAL: gl.constexpr,
                             LONGEST_FIRST: gl.constexpr, PAIRED: gl.constexpr, CONSUMERS: gl.constexpr,
                             Q_BUFS: gl.constexpr, O_IN_Q: gl.constexpr, ONE_STEP: gl.constexpr):
        """One consumer warpgroup of a persistent CTA: :func:`_consumer`'s stages for each work
        item the producer loads (:func:`_persistent_producer`, the same walk). Q is given back
        (``q_empty``) as soon as the band's last product has read it, before the epilogue, so the
        next item's Q loads while this one's O is normalised and stored (O has its own buffer,
        ``o_smem``). ``O_IN_Q`` (where O's own tiles do not fit, :func:`smem_plan`: D 256, a deeper ring): ``o_smem`` is ``q_smem``
        (one Q buffer), O leaves through the Q tile as in the one-tile kernel, and Q is given back
        once those stores have read it. Three counts run across items: ``c`` the items (``q_bar``'s parity), ``kv``
        the ring's tiles, ``bands`` the non-empty bands (each has one more ping-pong turn than
        tiles: the turn count is ``kv + bands``)."""
        (o_descs, q_smem, o_smem, q_bar, q_empty, ring, LSE, stride_lb, stride_lh, batch, num_heads_q, gqa_ratio,
         head_group, sq, sk, off, window_left, window_right, qk_scale2) = args
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        o_tile = o_smem.index(WG)
        kv = sq * 0
        c = sq * 0
        bands = sq * 0
        num_m, start, stop, step = _work_range(sq, batch, num_heads_q, CONSUMERS, PAIRED)
        for j in range(start, stop, step):
            b, h, h_kv, m0 = _work_tile(j, num_m, batch, num_heads_q, gqa_ratio, head_group, LONGEST_FIRST, PAIRED,
                                        CONSUMERS)
            lo, full_lo, full_hi, hi = _item_band(m0, sq, sk, off, window_left, window_right, CONSUMERS * _WG_M,
                                                  BLOCK_N, PAIRED)
            row0 = m0 + WG * _WG_M
            rows = row0 + gl.arange(0, _WG_M, layout=gl.SliceLayout(1, s_layout))
            m_i = gl.full([_WG_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([_WG_M], gl.float32, gl.SliceLayout(1, s_layout))
            acc = gl.zeros([_WG_M, HEAD_D], gl.float32, o_layout)
            slot, ph = _q_slot(c, WG, CONSUMERS, Q_BUFS)
            q = q_smem.index(slot)
            mbarrier.wait(q_bar.index(slot), ph)
            if lo < hi:
                acc, m_i, l_i, kv = _attend(acc, m_i, l_i, kv, bands, q, ring, rows, cols0, sk, off, lo, full_lo,
                                            full_hi, hi, window_left, window_right, qk_scale2, s_layout, o_layout,
                                            p_layout, BLOCK_N, STAGES, WG, PINGPONG, ONE_STEP)
                bands += 1
            if not O_IN_Q:
                mbarrier.arrive(q_empty.index(slot), count=1)   # Q's last reader (a wgmma) has completed
            lse_off = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
            _epilogue(acc, m_i, l_i, o_descs, o_tile, LSE, lse_off, rows, row0, b, h, sq, qk_scale2, o_layout,
                      RESIDUAL, True)
            if O_IN_Q:
                tma.store_wait(0)           # O (and the residual) have been read out of the Q tile
                mbarrier.arrive(q_empty.index(slot), count=1)
            c += 1
        tma.store_wait(0)

    @gluon.jit
    def _global_descriptors(Q, K, V, O, ORES, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                            stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, batch, num_heads_q,
                            gqa_ratio, sq, sk, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, RESIDUAL: gl.constexpr):
        """``(q_desc, k_desc, v_desc, o_descs)`` of a persistent CTA, made once for all its work
        items: rank-4 descriptors of the whole ``(B, S, H, D)`` tensors through their strides
        (boxes of one batch and head), whose per-dimension bounds do what the per-(sequence, head)
        slabs' do: zero-fill rows >= Sq and keys >= Sk on load, clip rows >= Sq on store
        (:func:`_tma_load_rows`, :func:`_tma_store_rows`). ``o_descs`` as :func:`_consumer`'s."""
        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
        num_heads_kv = num_heads_q // gqa_ratio
        q_desc = tma.make_tensor_descriptor(Q, [batch, sq, num_heads_q, HEAD_D], [stride_qb, stride_qs, stride_qh, 1],
                                            [1, _WG_M, 1, HEAD_D], layout)
        k_desc = tma.make_tensor_descriptor(K, [batch, sk, num_heads_kv, HEAD_D], [stride_kb, stride_ks, stride_kh, 1],
                                            [1, BLOCK_N, 1, HEAD_D], layout)
        v_desc = tma.make_tensor_descriptor(V, [batch, sk, num_heads_kv, HEAD_D], [stride_vb, stride_vs, stride_vh, 1],
                                            [1, BLOCK_N, 1, HEAD_D], layout)
        o_desc = tma.make_tensor_descriptor(O, [batch, sq, num_heads_q, HEAD_D], [stride_ob, stride_os, stride_oh, 1],
                                            [1, _WG_M, 1, HEAD_D], layout)
        if RESIDUAL:   # ORES has O's shape and strides
            r_desc = tma.make_tensor_descriptor(ORES, [batch, sq, num_heads_q, HEAD_D],
                                                [stride_ob, stride_os, stride_oh, 1], [1, _WG_M, 1, HEAD_D], layout)
            o_descs = (o_desc, r_desc)
        else:
            o_descs = (o_desc,)
        return q_desc, k_desc, v_desc, o_descs

    @gluon.jit(do_not_specialize=("seqlen_q", "seqlen_k", "stride_lb", "stride_lh", "batch", "head_group"))
    def attn_fwd_gluon(Q, K, V, O, LSE, ORES,
                       stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                       stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                       stride_lb, stride_lh,
                       num_heads_q, gqa_ratio, seqlen_q, seqlen_k, qk_scale2, window_left, window_right, batch,
                       head_group, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       BOTTOM_RIGHT: gl.constexpr, LONGEST_FIRST: gl.constexpr, PINGPONG: gl.constexpr,
                       RESIDUAL: gl.constexpr, PERSISTENT: gl.constexpr, CONSUMERS: gl.constexpr,
                       PAIRED: gl.constexpr, Q_BUFS: gl.constexpr, O_IN_Q: gl.constexpr, ONE_STEP: gl.constexpr):
        """O = softmax(scale·QKᵀ)V for 64·CONSUMERS query rows of one (batch, head): grid
        (cdiv(Sq, 64·CONSUMERS), B·Hq), 4 warps (consumer 0) + one or two more 4-warp consumers
        (``CONSUMERS`` 2 or 3, :func:`consumers_for`) + a 1-warp producer.
        ``RESIDUAL``: also ORES = O_f32 − round(O_f32) in O's dtype, through O's strides (ORES is
        None without it, a constexpr, so the inference kernel has no extra parameter).
        ``PERSISTENT`` (:data:`PERSISTENT_HEAD_DIMS`): grid (min(#SMs, units),), each CTA walks
        work units (:func:`_work_tile`) with rank-4 descriptors of the whole (B, S, H, D) tensors
        made once, and O in its own shared buffer; ``batch`` is B there (the constexpr None
        otherwise, as ORES). ``LONGEST_FIRST`` (a causal-like band): the query tiles run in
        :func:`_longest_first`'s walk, ``head_group`` (batch, head)s at a time (:func:`head_group`;
        unread otherwise); with ``PERSISTENT`` and ``PAIRED`` a CTA takes them in long + short pairs
        (:func:`_work_tile`)."""
        sq = seqlen_q
        sk = seqlen_k
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        if PERSISTENT:
            off = _align_offset(sq, sk, BOTTOM_RIGHT)
            q_desc, k_desc, v_desc, o_descs = _global_descriptors(
                Q, K, V, O, ORES, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb,
                stride_vs, stride_vh, stride_ob, stride_os, stride_oh, batch, num_heads_q, gqa_ratio, sq, sk,
                HEAD_D, BLOCK_N, RESIDUAL)
        else:
            b, h, h_kv, m0, off, phases = _row_tile(num_heads_q, gqa_ratio, sq, sk, window_left, window_right,
                                                    BLOCK_N, BOTTOM_RIGHT, LONGEST_FIRST, CONSUMERS, head_group)
            lo, full_lo, full_hi, hi = phases

            b64 = b.to(gl.int64)
            q_desc = tma.make_tensor_descriptor(Q + b64 * stride_qb + h.to(gl.int64) * stride_qh, [sq, HEAD_D],
                                                [stride_qs, 1], [_WG_M, HEAD_D], smem_layout)
            k_desc = tma.make_tensor_descriptor(K + b64 * stride_kb + h_kv.to(gl.int64) * stride_kh, [sk, HEAD_D],
                                                [stride_ks, 1], [BLOCK_N, HEAD_D], smem_layout)
            v_desc = tma.make_tensor_descriptor(V + b64 * stride_vb + h_kv.to(gl.int64) * stride_vh, [sk, HEAD_D],
                                                [stride_vs, 1], [BLOCK_N, HEAD_D], smem_layout)
            o_desc = tma.make_tensor_descriptor(O + b64 * stride_ob + h.to(gl.int64) * stride_oh, [sq, HEAD_D],
                                                [stride_os, 1], [_WG_M, HEAD_D], smem_layout)
            if RESIDUAL:   # ORES has O's shape and strides
                r_desc = tma.make_tensor_descriptor(ORES + b64 * stride_ob + h.to(gl.int64) * stride_oh,
                                                    [sq, HEAD_D], [stride_os, 1], [_WG_M, HEAD_D], smem_layout)
                o_descs = (o_desc, r_desc)
            else:
                o_descs = (o_desc,)
            lse_off = b64 * stride_lb + h.to(gl.int64) * stride_lh

        dtype: gl.constexpr = Q.dtype.element_ty
        q_smem = gl.allocate_shared_memory(dtype, [Q_BUFS * CONSUMERS, _WG_M, HEAD_D], smem_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], smem_layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        q_bar = gl.allocate_shared_memory(gl.int64, [Q_BUFS * CONSUMERS, 1], bar_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        for j in gl.static_range(Q_BUFS * CONSUMERS):
            mbarrier.init(q_bar.index(j), count=1)
        for j in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(j), count=1)
            mbarrier.init(v_ready.index(j), count=1)
            mbarrier.init(k_empty.index(j), count=CONSUMERS)   # one arrival per consumer warpgroup
            mbarrier.init(v_empty.index(j), count=CONSUMERS)

        turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], bar_layout)
        for j in gl.static_range(CONSUMERS):
            mbarrier.init(turn.index(j), count=1)
        if PERSISTENT:   # O's own tiles (where they fit, smem_plan), so the next item's Q can load while O is stored
            if O_IN_Q:
                o_smem = q_smem
            else:
                o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, _WG_M, HEAD_D], smem_layout)
            q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS * CONSUMERS, 1], bar_layout)
            for j in gl.static_range(Q_BUFS * CONSUMERS):
                mbarrier.init(q_empty.index(j), count=1)
        fence_async_shared()   # the inits (generic proxy) before the TMA engine (async proxy) signals them
        ring = (k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn)
        # the partitions: the consumer warpgroups (the default partition is consumer 0), then the producer
        # warp; 3 consumers leave each 160 registers of the SM's 64 K (16 warps: 3 x 128 threads x 160 + the
        # producer's warpgroup x 24), 2 leave 240 (12 warps)
        if PERSISTENT:
            cargs = (o_descs, q_smem, o_smem, q_bar, q_empty, ring, LSE, stride_lb, stride_lh, batch, num_heads_q,
                     gqa_ratio, head_group, sq, sk, off, window_left, window_right, qk_scale2)
            pargs = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                     batch, num_heads_q, gqa_ratio, head_group, sq, sk, off, window_left, window_right)
            if CONSUMERS == 3:
                gl.warp_specialize([
                    (_persistent_consumer, (0, cargs, BLOCK_N, HEAD_D, STAGES, PINGPONG, RESIDUAL, LONGEST_FIRST, PAIRED,
                                             CONSUMERS, Q_BUFS, O_IN_Q, ONE_STEP)),
                    (_persistent_consumer, (1, cargs, BLOCK_N, HEAD_D, STAGES, PINGPONG, RESIDUAL, LONGEST_FIRST, PAIRED,
                                             CONSUMERS, Q_BUFS, O_IN_Q, ONE_STEP)),
                    (_persistent_consumer, (2, cargs, BLOCK_N, HEAD_D, STAGES, PINGPONG, RESIDUAL, LONGEST_FIRST, PAIRED,
                                             CONSUMERS, Q_BUFS, O_IN_Q, ONE_STEP)),
                    (_persistent_producer, (pargs, BLOCK_N, HEAD_D, STAGES, LONGEST_FIRST, PAIRED, CONSUMERS, Q_BUFS)),
                ], [4, 4, 1], [160, 160, 24])
            else:
                gl.warp_specialize([
                    (_persistent_consumer, (0, cargs, BLOCK_N, HEAD_D, STAGES, PINGPONG, RESIDUAL, LONGEST_FIRST, PAIRED,
                                             CONSUMERS, Q_BUFS, O_IN_Q, ONE_STEP)),
                    (_persistent_consumer, (1, cargs, BLOCK_N, HEAD_D, STAGES, PINGPONG, RESIDUAL, LONGEST_FIRST, PAIRED,
                                             CONSUMERS, Q_BUFS, O_IN_Q, ONE_STEP)),
                    (_persistent_producer, (pargs, BLOCK_N, HEAD_D, STAGES, LONGEST_FIRST, PAIRED, CONSUMERS, Q_BUFS)),
                ], [4, 1], [240, 24])
        else:
            cargs = (o_descs, q_smem, q_bar, ring, LSE, lse_off, m0, sq, sk, off, lo, full_lo, full_hi, hi,
                     window_left, window_right, qk_scale2)
            pargs = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, m0, lo,
                     hi)
            if CONSUMERS == 3:
                gl.warp_specialize([(_consumer, (0, cargs, BLOCK_N, HEAD_D, STAGES, PINGPONG, RESIDUAL, ONE_STEP)),
                                    (_consumer, (1, cargs, BLOCK_N, HEAD_D, STAGES, PINGPONG, RESIDUAL, ONE_STEP)),
                                    (_consumer, (2, cargs, BLOCK_N, HEAD_D, STAGES, PINGPONG, RESIDUAL, ONE_STEP)),
                                    (_producer, (pargs, BLOCK_N, HEAD_D, STAGES))], [4, 4, 1], [160, 160, 24])
            else:
                gl.warp_specialize([(_consumer, (0, cargs, BLOCK_N, HEAD_D, STAGES, PINGPONG, RESIDUAL, ONE_STEP)),
                                    (_consumer, (1, cargs, BLOCK_N, HEAD_D, STAGES, PINGPONG, RESIDUAL, ONE_STEP)),
                                    (_producer, (pargs, BLOCK_N, HEAD_D, STAGES))], [4, 1], [240, 24])


# ----- cross-compilation (no GPU needed) ----------------------------------------------------

def _default_pingpong() -> bool:
    """FA3's ping-pong between the consumer warpgroups (:func:`_turn_wait`) unless
    ``PORTATTN_TRITON_GLUON_PINGPONG=0`` (read per call); the check tool times both."""
    from portattn import config
    return config.triton_gluon_pingpong()


#: where ``auto`` runs two consumer warpgroups although :data:`DEFAULT_CONSUMERS` says three: (head dim,
#: causal) -> [fewest, most) query rows. D 64 causal on an H100 (2026-12-06, tools/head_group_check.py,
#: benchmarks/results/consumers-d64-h100.txt): the persistent kernel with two (128-row tiles,
#: the walk unpaired) 1.05 x the portable kernel at S 2k and 4k (training 1.03 / 1.06), where three
#: (192-row tiles: more of the diagonal masked) ran 0.82 / 0.98 x it; at 8k three are 1.06 x two.
#: D 64 non-causal (the same day, tools/gluon_persistent_diag.py --time, the same file): persistent with
#: two 1.05 / 1.06 x the portable kernel at S 512 / 1k (three 0.95 / 1.02), but 0.93 / 0.91 x three at
#: 2k / 4k.
AUTO_TWO_CONSUMERS = {(64, True): (2048, 8192), (64, False): (512, 2048)}


def row_holds(table: dict, key: tuple, seqlen_q: int) -> bool:
    """Whether ``table`` (``auto``'s rows: key -> [fewest, most) query rows, as
    :data:`AUTO_TWO_CONSUMERS` and :data:`AUTO_PERSISTENT`) has a row ``key`` whose range holds
    ``seqlen_q``."""
    rows = table.get(key)
    return rows is not None and rows[0] <= seqlen_q < rows[1]


def consumers_for(head_dim: int, consumers: int | None = None, spec=None) -> int:
    """The consumer warpgroups of a launch at ``head_dim`` (64 query rows each): ``consumers``, else
    ``PORTATTN_TRITON_GLUON_CONSUMERS`` (3 there means 3 where the head dim can run them, 2
    elsewhere), else two where ``spec`` (the problem, when given) falls in a row of
    :data:`AUTO_TWO_CONSUMERS`, else :data:`DEFAULT_CONSUMERS`. Three (FA3's 192-row tiles at D 64, where the
    softmax is large against D's products) only at :data:`THREE_CONSUMER_HEAD_DIMS`: their 160
    registers hold a 64 × D accumulator beside a 64 × 128 S only at D 64 (at D 128 with 64-key
    tiles they ran slower than two, :func:`tile_config`); a ``consumers`` other than 2 or 3, or 3
    at another head dim, raises ValueError."""
    if consumers is None:
        from portattn import config
        consumers = config.triton_gluon_consumers()
        if consumers == 3 and head_dim not in THREE_CONSUMER_HEAD_DIMS:
            consumers = 2
    if consumers is None:
        if spec is not None and row_holds(AUTO_TWO_CONSUMERS, (head_dim, bool(spec.causal)), spec.seqlen_q):
            return 2
        return DEFAULT_CONSUMERS.get(head_dim, 2)
    if consumers not in (2, 3) or (consumers == 3 and head_dim not in THREE_CONSUMER_HEAD_DIMS):
        raise ValueError(f"the Gluon forward runs 2 consumer warpgroups, or 3 at D in {THREE_CONSUMER_HEAD_DIMS}; "
                         f"got {consumers} at D {head_dim}")
    return consumers


def _default_persistent() -> bool | None:
    """``PORTATTN_TRITON_GLUON_PERSISTENT`` (read per call): True always, False never, None (unset,
    the default) ``auto`` (:data:`AUTO_PERSISTENT`)."""
    from portattn import config
    return config.triton_gluon_persistent()


def persistent_for(head_dim: int, persistent: bool | None = None, auto: bool = False) -> bool:
    """Whether a launch at ``head_dim`` runs the persistent variant: ``persistent``, else the
    environment switch (:func:`_default_persistent`), else ``auto`` (what :func:`auto_persistent`
    says of the problem) — only ever at a head dim of :data:`PERSISTENT_HEAD_DIMS`."""
    if persistent is None:
        persistent = _default_persistent()
    if persistent is None:
        persistent = auto
    return bool(persistent) and head_dim in PERSISTENT_HEAD_DIMS


#: the L2 bytes one group of a causal walk's heads may fill with K and V (:func:`head_group`): a third
#: of the H100's and H200's 50 MiB, the rest for the Q and O tiles streaming past
HEAD_GROUP_L2_BYTES = 16 << 20

#: the fewest query rows at which the one-tile kernel's grid walks in groups (:func:`head_group`);
#: below, one head's tiles after the other's. An H100 (2026-12-05, tools/head_group_check.py,
#: benchmarks/results/head-group-h100.txt; bf16 causal, 16k tokens) timed the groups at 1.00-1.06 x
#: the one-head order from S 2k (D 256 2k-8k 1.04-1.06, D 128 8k 1.03; training 0.97-1.07) but
#: 0.95-0.98 x below it (training 0.87-0.93): short tiles end every group together, their stores
#: bunched. The persistent walk groups at every length (1.16-1.27 x its walk over every head at
#: D 128 S 512-1k).
ONE_TILE_GROUP_MIN_SEQLEN_Q = 2048


def head_group(spec, persistent: bool = True) -> int:
    """How many (batch, head)s the longest-first walk of a causal-like band (:func:`_longest_first`)
    takes together: ``PORTATTN_TRITON_HEAD_GROUP`` when set, else as many query heads as fit the
    K and V they read (Sk·(D + Dv)·2 bytes a KV head, shared by ``Hq / Hkv`` query heads) in
    :data:`HEAD_GROUP_L2_BYTES` — for the one-tile kernel (``persistent=False``) from
    :data:`ONE_TILE_GROUP_MIN_SEQLEN_Q` query rows, 1 below; at least 1, at most B·Hq (all of
    them: longest first over every head)."""
    from portattn import config
    group = config.triton_head_group()
    if group is None and not persistent and spec.seqlen_q < ONE_TILE_GROUP_MIN_SEQLEN_Q:
        group = 1
    if group is None:
        per_head = spec.seqlen_k * (spec.head_dim + spec.head_dim_v) * spec.q.element_size()
        group = HEAD_GROUP_L2_BYTES * (spec.num_heads_q // spec.num_heads_kv) // max(per_head, 1)
    return max(1, min(group, spec.batch * spec.num_heads_q))


def _rank4_strides(*tensors: torch.Tensor) -> bool:
    """Whether the persistent variant's rank-4 descriptors can describe ``tensors`` (B, S, H, D):
    no zero stride among B, S and H (an expanded tensor, e.g. K broadcast over heads). The one-tile
    kernel puts the batch and head offsets into its descriptors' base instead, so it takes them."""
    return all(x != 0 for t in tensors for x in t.stride()[:3])


#: the head dims whose persistent causal walk goes in long + short pairs (:func:`_work_tile`) when
#: ``PORTATTN_TRITON_PAIRED_WALK`` is unset. D 128: 1.04-1.09 x unpaired from S 2k (an H100,
#: 2026-12-06, benchmarks/results/paired-walk-h100.txt). D 64 unpaired: with three consumers the
#: pairs ran 0.98-0.99 x the unpaired walk at S 8k (the same file and
#: benchmarks/results/consumers-d64-h100.txt), with two (:data:`AUTO_TWO_CONSUMERS`) 0.94 /
#: 0.98 x at 2k / 4k. D 256 pairs like D 128 (its persistent rows were timed with them).
PAIRED_HEAD_DIMS = (128, 256)


def launch_constexprs(head_dim: int, causal: bool, bottom_right: bool = True, pingpong: bool | None = None,
                      residual: bool = False, persistent: bool = False, consumers: int | None = None,
                      paired: bool | None = None, q_buffers: int | None = None, stages: int | None = None) -> dict:
    """The constexprs of one launch (also what :func:`compile_for` specialises on); ``residual``:
    the training variant that also stores O's rounding residual; ``persistent``: the persistent
    variant (:data:`PERSISTENT_HEAD_DIMS` only; ValueError elsewhere); ``consumers``: the consumer
    warpgroups (:func:`consumers_for`); ``paired``: a persistent causal walk's tiles in long +
    short pairs (:func:`_work_tile`; None: ``PORTATTN_TRITON_PAIRED_WALK``, where unset at
    :data:`PAIRED_HEAD_DIMS`; only persistent causal launches pair); ``q_buffers``: a persistent launch's Q tiles a consumer
    warpgroup (1 or 2; None: ``PORTATTN_TRITON_Q_BUFFERS``; the one-tile kernel has 1); ``stages``: a
    persistent launch's K/V ring depth (None: ``PORTATTN_TRITON_GLUON_STAGES``, else
    :func:`tile_config`'s; the one-tile kernel always has :func:`tile_config`'s). The persistent
    kernel's shared memory follows :func:`smem_plan` (``Q_BUFS``, ``O_IN_Q``). ``ONE_STEP``:
    ``PORTATTN_TRITON_GLUON_ONE_STEP`` (:func:`_attend`)."""
    from portattn import config
    if persistent and head_dim not in PERSISTENT_HEAD_DIMS:
        raise ValueError(f"the persistent Gluon forward runs D in {PERSISTENT_HEAD_DIMS}, not {head_dim}")
    consumers = consumers_for(head_dim, consumers)
    block_n, stages_default = tile_config(head_dim, consumers)
    if paired is None:
        paired = config.triton_paired_walk()
    if paired is None:
        paired = head_dim in PAIRED_HEAD_DIMS
    q_bufs, o_in_q = 1, False
    if persistent:
        if stages is None:
            stages = config.triton_gluon_stages() or stages_default
        q_bufs, o_in_q = smem_plan(head_dim, consumers, block_n, stages, _q_buffers(True, q_buffers))
    else:
        _q_buffers(False, q_buffers)   # the argument is checked all the same
        stages = stages_default
    return dict(HEAD_D=head_dim, BLOCK_N=block_n, STAGES=stages, BOTTOM_RIGHT=bottom_right, LONGEST_FIRST=causal,
                PINGPONG=_default_pingpong() if pingpong is None else pingpong, RESIDUAL=residual,
                PERSISTENT=persistent, CONSUMERS=consumers,
                PAIRED=bool(persistent and causal and paired),
                Q_BUFS=q_bufs, O_IN_Q=o_in_q, ONE_STEP=config.triton_gluon_one_step())


def _q_buffers(persistent: bool, q_buffers: int | None) -> int:
    """The Q tiles a consumer warpgroup asks for: ``q_buffers`` (1 or 2), else
    ``PORTATTN_TRITON_Q_BUFFERS``, for persistent launches (:func:`smem_plan` gives them where they
    fit); 1 for the one-tile kernel, whose CTA loads one Q tile."""
    from portattn import config
    n = config.triton_q_buffers() if q_buffers is None else q_buffers
    if n not in (1, 2):
        raise ValueError(f"q_buffers: 1 or 2 Q tiles a consumer warpgroup, not {n!r}")
    return n if persistent else 1


#: the shared memory a CTA may take on sm_90 (227 KiB, the opt-in maximum of H100 and H200)
SMEM_LIMIT_BYTES = 232448

#: what :func:`smem_plan` leaves beside the tiles: the mbarriers and the compiler's scratch (the D 128
#: persistent kernel's 229816 bytes hold 229376 of tiles, triton 3.6)
SMEM_SLACK_BYTES = 1024


def smem_plan(head_dim: int, consumers: int, block_n: int, stages: int, q_buffers: int = 2) -> tuple[int, bool]:
    """``(Q_BUFS, O_IN_Q)`` of a persistent launch: its shared memory holds ``Q_BUFS`` Q tiles of
    (64, D) per consumer warpgroup, the ring's ``stages`` K and V tiles of (``block_n``, D), and —
    unless ``O_IN_Q`` — O's own (64, D) tile per consumer, 2 bytes an element, within
    :data:`SMEM_LIMIT_BYTES` less :data:`SMEM_SLACK_BYTES`. The first layout that fits, of: the
    ``q_buffers`` asked for with O's own tiles; one Q buffer with O's own tiles; one Q buffer with O
    stored through it (``O_IN_Q``: the next item's Q loads once O has left). D 128 with the default
    ring: two Q buffers and O's own tiles (229376 bytes); D 256: O through the one Q tile. ValueError
    when not even the last fits (a ring too deep)."""
    wg_tile = WG_M * head_dim * 2
    ring = 2 * stages * block_n * head_dim * 2
    budget = SMEM_LIMIT_BYTES - SMEM_SLACK_BYTES
    for q_bufs, o_in_q in ((q_buffers, False), (1, False), (1, True)):
        if q_bufs * consumers * wg_tile + ring + (0 if o_in_q else consumers * wg_tile) <= budget:
            return q_bufs, o_in_q
    raise ValueError(f"a ring of {stages} K/V tiles of {block_n} keys at D {head_dim} with {consumers} consumer "
                     f"warpgroups does not fit {SMEM_LIMIT_BYTES} bytes of shared memory; use fewer stages "
                     f"(PORTATTN_TRITON_GLUON_STAGES)")


#: launch options: 4 warps run the default partition (consumer 0); the workers add 5 warps (9 with
#: three consumers)
LAUNCH_OPTIONS = dict(num_warps=4, num_stages=1)


def compile_for(head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, causal: bool = False,
                arch: int = 90, pingpong: bool | None = None, residual: bool = False, persistent: bool = False,
                bottom_right: bool = True, consumers: int | None = None, q_buffers: int | None = None,
                stages: int | None = None):
    """``triton.compile`` of :func:`attn_fwd_gluon` for ``GPUTarget("cuda", arch, 32)`` without a GPU;
    returns the compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata.shared``).
    ``residual``: the training variant (``RESIDUAL``, an ORES pointer); without it ORES is the
    constexpr None, as :func:`gluon_forward` launches it. ``persistent``: the persistent variant
    (``batch`` an int32 argument; the constexpr None without it); ``q_buffers``: its Q tiles a
    consumer (None: ``PORTATTN_TRITON_Q_BUFFERS``); ``stages``: its K/V ring depth (None:
    ``PORTATTN_TRITON_GLUON_STAGES``, :func:`launch_constexprs`)."""
    if GLUON_ERROR:
        raise RuntimeError(GLUON_ERROR)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    ptr = {torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    consts = launch_constexprs(head_dim, causal, bottom_right, pingpong=pingpong, residual=residual,
                               persistent=persistent, consumers=consumers, q_buffers=q_buffers, stages=stages)
    if not residual:
        consts["ORES"] = None
    if not persistent:
        consts.update(dict.fromkeys(_PERSISTENT_ONLY_ARGS))
    sig = {}
    for name in attn_fwd_gluon.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("Q", "K", "V", "O", "ORES"):
            sig[name] = ptr
        elif name == "LSE":
            sig[name] = "*fp32"
        elif name == "qk_scale2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    src = GluonASTSource(attn_fwd_gluon, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(LAUNCH_OPTIONS))



def _cubin_facts(cubin: bytes) -> dict:
    """Registers and stack (spills) from ``cuobjdump -res-usage``, and the SASS counts of HGMMA,
    UTMALDG/UTMASTG (TMA), USETMAXREG and local-memory spills (LDL/STL); {} without cuobjdump."""
    import re
    import shutil
    import subprocess
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    tool = tool if os.path.exists(tool) else shutil.which("cuobjdump")
    if not tool:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        try:
            res = subprocess.run([tool, "-res-usage", fh.name], capture_output=True, text=True, timeout=120).stdout
            sass = subprocess.run([tool, "-sass", fh.name], capture_output=True, text=True, timeout=120).stdout
        except (OSError, subprocess.SubprocessError):
            return {}
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    facts = dict(regs=int(regs.group(1)) if regs else None, stack=int(stack.group(1)) if stack else None)
    for name, pat in (("HGMMA", r"\bHGMMA\b"), ("UTMALDG", r"\bUTMALDG\b"), ("UTMASTG", r"\bUTMASTG\b"),
                      ("USETMAXREG", r"\bUSETMAXREG\b"), ("LDL/STL", r"\b(?:LDL|STL)\b")):
        facts[name] = len(re.findall(pat, sass))
    return facts


def compile_report(head_dim: int = 128, causal: bool = False, dtype: torch.dtype = torch.bfloat16,
                   pingpong: bool | None = None, residual: bool = False, persistent: bool = False,
                   bottom_right: bool = True, consumers: int | None = None) -> dict:
    """Cross-compile one variant for sm_90 and describe it: shared bytes, PTX counts of
    ``wgmma.mma_async`` / ``cp.async.bulk.tensor`` (TMA; ``tma_store`` the shared-to-global ones)
    / ``setmaxnreg`` and its values, the kernel's parameter count, and :func:`_cubin_facts`."""
    import re
    import time
    start = time.perf_counter()
    pingpong = _default_pingpong() if pingpong is None else pingpong
    consumers = consumers_for(head_dim, consumers)
    c = compile_for(head_dim, dtype, causal, pingpong=pingpong, residual=residual, persistent=persistent,
                    bottom_right=bottom_right, consumers=consumers)
    ptx = c.asm["ptx"]
    lc = launch_constexprs(head_dim, causal, bottom_right, pingpong, residual, persistent, consumers)
    row = dict(head_dim=head_dim, causal=causal, pingpong=pingpong, residual=residual,
               **(dict(consumers=consumers) if consumers != 2 else {}),
               **(dict(persistent=True, bottom_right=bottom_right, tma_4d=ptx.count("cp.async.bulk.tensor.4d"),
                       **{k.lower(): lc[k] for k in ("STAGES", "Q_BUFS", "O_IN_Q")})
                  if persistent else {}),
               dtype=str(dtype).replace("torch.", ""),
               shared=int(c.metadata.shared), num_warps=int(c.metadata.num_warps),
               wgmma=ptx.count("wgmma.mma_async"), tma=ptx.count("cp.async.bulk.tensor"),
               tma_store=ptx.count("cp.async.bulk.tensor.2d.global.shared")
               + ptx.count("cp.async.bulk.tensor.4d.global.shared"),
               params=len(set(re.findall(r"attn_fwd_gluon_param_(\d+)", ptx))),
               setmaxnreg=sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}))
    row.update(_cubin_facts(c.asm["cubin"]))
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def main(argv=None) -> int:
    """``python -m portattn.backends.triton.gluon_fwd [--json] [--residual off|on|both]
    [--persistent off|on|both] [--top-left]``: cross-compile every head dim, causal and not, for
    sm_90 and print what each compiled to (exit 1 on a compile error); ``--residual`` the
    inference kernel (default), the training one (``RESIDUAL``) or both; ``--persistent`` the
    one-tile kernel (default), the persistent one (``PERSISTENT``, its head dims only) or both;
    ``--top-left`` top-left causal alignment instead of bottom-right; ``--consumers 3`` three
    consumer warpgroups where a head dim can run them (:data:`THREE_CONSUMER_HEAD_DIMS`; the
    others keep two)."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    ap.add_argument("--dims", default=",".join(map(str, HEAD_DIMS)))
    ap.add_argument("--pingpong", choices=("on", "off", "both"), default="both")
    ap.add_argument("--residual", choices=("on", "off", "both"), default="off")
    ap.add_argument("--persistent", choices=("on", "off", "both"), default="off")
    ap.add_argument("--top-left", action="store_true", help="BOTTOM_RIGHT off (top-left causal alignment)")
    ap.add_argument("--consumers", type=int, choices=(2, 3), default=None,
                    help="consumer warpgroups (3 at D 64 only; default: consumers_for's)")
    args = ap.parse_args(argv)
    if GLUON_ERROR:
        print(GLUON_ERROR)
        return 1
    rows, failed = [], False
    pingpongs = {"on": (True,), "off": (False,), "both": (False, True)}[args.pingpong]
    residuals = {"on": (True,), "off": (False,), "both": (False, True)}[args.residual]
    persistents = {"on": (True,), "off": (False,), "both": (False, True)}[args.persistent]
    for d in (int(x) for x in args.dims.split(",")):
        for causal in (False, True):
            for pp in pingpongs:
                for res in residuals:
                    for pers in persistents:
                        if pers and d not in PERSISTENT_HEAD_DIMS:
                            continue
                        try:
                            rows.append(compile_report(d, causal, pingpong=pp, residual=res, persistent=pers,
                                                       bottom_right=not args.top_left,
                                                       consumers=args.consumers if d in THREE_CONSUMER_HEAD_DIMS
                                                       else None))
                        except Exception as exc:   # a compile error is a failed row, reported with its message
                            failed = True
                            rows.append(dict(head_dim=d, causal=causal, pingpong=pp, residual=res,
                                             **(dict(persistent=True) if pers else {}),
                                             error=f"{type(exc).__name__}: {exc}"[-600:]))
    return print_compile_rows(rows, args.json, failed)


def print_compile_rows(rows: list[dict], as_json: bool, failed: bool) -> int:
    """A cross-compile CLI's output (this module's and ``gluon_bwd``'s): one JSON list, or a line
    of ``key=value`` a row; returns the exit code (1 when a compile failed)."""
    import json
    if as_json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(" ".join(f"{k}={v}" for k, v in r.items()))
    return 1 if failed else 0

# ----- host side ----------------------------------------------------------------------------

def _tma_aligned(t: torch.Tensor) -> bool:
    """A tensor descriptor needs a 16-byte aligned base and row strides (last stride 1)."""
    e = t.element_size()
    st = t.stride()
    return t.data_ptr() % 16 == 0 and st[-1] == 1 and all((x * e) % 16 == 0 for x in st[:-1])


def _device_reasons(spec) -> list[str]:
    """The first of :func:`gluon_reasons` and ``gluon_bwd.gluon_bwd_reasons``: Gluon's Hopper API
    missing (:data:`GLUON_ERROR`), ``spec``'s device not an NVIDIA sm_90 one."""
    reasons = []
    if GLUON_ERROR:
        reasons.append(GLUON_ERROR)
    dev = spec.q.device
    if dev.type != "cuda" or getattr(torch.version, "hip", None):
        reasons.append(f"needs an NVIDIA CUDA device (sm_90), got {dev.type}"
                       + (" (ROCm)" if dev.type == "cuda" else ""))
    elif torch.cuda.get_device_capability(dev) != (9, 0):
        major, minor = torch.cuda.get_device_capability(dev)
        reasons.append(f"written for Hopper sm_90 (wgmma, TMA, setmaxnreg), got sm_{major}{minor}")
    return reasons


def _tma_reasons(spec) -> list[str]:
    """The last of both: q, k or v (a CUDA tensor, not varlen) that a TMA descriptor cannot take
    (:func:`_tma_aligned`)."""
    if not spec.is_varlen and spec.q.device.type == "cuda":
        bad = [n for n, t in (("q", spec.q), ("k", spec.k), ("v", spec.v)) if not _tma_aligned(t)]
        if bad:
            return [f"{', '.join(bad)} not TMA-compatible (16-byte aligned base and strides, unit last stride)"]
    return []


def gluon_reasons(spec) -> list[str]:
    """Why :func:`gluon_forward` cannot run ``spec`` (empty when it can), one sentence each."""
    reasons = _device_reasons(spec)
    if spec.q.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"dtype {spec.q.dtype}: only float16 and bfloat16")
    if spec.head_dim != spec.head_dim_v or spec.head_dim not in HEAD_DIMS:
        reasons.append(f"head dims D={spec.head_dim}, Dv={spec.head_dim_v}: needs D == Dv in {HEAD_DIMS}")
    for name, present in (("varlen (cu_seqlens)", spec.is_varlen), ("softcap", spec.softcap is not None),
                          ("ALiBi", spec.alibi_slopes is not None), ("attn_bias / mask", spec.attn_bias is not None),
                          ("a sliding window", spec.has_window)):
        if present:
            reasons.append(f"{name} is not implemented in the Gluon forward")
    if spec.batch * spec.num_heads_q > 65535:
        reasons.append(f"batch × heads = {spec.batch * spec.num_heads_q} > 65535 (the grid's second dimension)")
    reasons += _tma_reasons(spec)
    return reasons


#: where ``auto`` takes the Gluon forward for a call that needs no gradient: (head dim, causal) ->
#: the fewest query rows at which the H200 timed it faster than the portable kernel (2026-12-03,
#: tools/triton_gluon_check.py, benchmarks/results/triton-gluon-check-h200.txt, bf16, S = 1k/4k/16k
#: with B·S = 16k tokens): D 128 1.09-1.27 x from S 1k, but 0.94 x at S 1k causal; D 256
#: 1.30-1.34 x from S 1k, causal and not, and at S 512 1.29 x, causal 1.23 x (2026-12-04,
#: tools/gluon_persistent_diag.py --time --cells, benchmarks/results/triton-gluon-persistent-h200.txt);
#: D 64 with two consumers 0.60-1.04 x (faster only at S 16k); with three (:data:`DEFAULT_CONSUMERS`, an
#: H100, 2026-12-05, tools/gluon_consumers_check.py, benchmarks/results/triton-gluon-consumers-h100.txt)
#: 1.22 / 1.21 x the portable kernel at S 8k / 16k non-causal, 1.04 / 1.19 x causal (0.82 x at 4k
#: causal), so D 64 takes it from 8k (non-causal 2k-8k: the persistent row of AUTO_PERSISTENT).
AUTO_MIN_SEQLEN_Q = {(128, False): 1024, (128, True): 2048, (256, False): 512, (256, True): 512,
                     (64, False): 8192, (64, True): 8192}


#: the same for training forwards (``ops.forward_for_backward``: the ``RESIDUAL`` epilogue, which
#: also stores O's rounding residual). The H200 checked that epilogue (half-ulp residuals, same O
#: and lse as the inference kernel, D 64/128/256) and timed it against the portable training
#: forward (the same tool and file, "training forward", 2026-12-03): D 128 1.03-1.22 x from S 1k,
#: but 0.88-0.89 x at S 1k causal; D 256 1.19-1.38 x from S 1k, causal and not, and 1.23 / 1.21 x
#: at S 512 (2026-12-04, the same run as above). D 64 with three consumers (the H100 run above):
#: one-tile 1.27 x the portable training forward at S 16k non-causal (persistent 1.17 x; 2k-16k the
#: persistent row, 1.14-1.22 x), causal 1.01 x at 8k and 1.23 x at 16k (0.79 x at 4k).
AUTO_TRAINING_MIN_SEQLEN_Q = {(128, False): 1024, (128, True): 2048, (256, False): 512, (256, True): 512,
                              (64, False): 16384, (64, True): 8192}


#: where ``auto`` runs the persistent variant (:data:`PERSISTENT_HEAD_DIMS`) instead of the
#: one-tile kernel: (head dim, causal, training) -> [fewest, most) query rows (bf16, B·S = 16k
#: tokens, hidden 2048; ratio persistent / what ``auto`` runs otherwise).
#: Non-causal: D 128 on the H200 (2026-12-04, tools/gluon_persistent_diag.py --time,
#: benchmarks/results/triton-gluon-persistent-h200.txt) 1.37 at S 512, 1.25 at 1k, 1.11 at 2k,
#: 1.05 at 4k, 1.01 at 16k (training 1.36, 1.30, 1.12, 0.98, 1.10); D 64 with three consumers on
#: an H100 (2026-12-05, tools/gluon_consumers_check.py, benchmarks/results/triton-gluon-consumers-h100.txt)
#: 1.14-1.22 x the portable kernel at 2k-8k, 0.91 / 0.93 x the one-tile kernel at 8k / 16k
#: (training 1.03 at 8k, 0.92 at 16k): so to 8k (training 16k); the portable kernel below 2k.
#: Causal, with the grouped walk (:func:`head_group`), on an H100 (2026-12-05,
#: tools/head_group_check.py, benchmarks/results/head-group-h100.txt): D 128 1.36 / 1.24 / 1.08 /
#: 0.93 x the one-tile kernel at S 512 / 1k / 2k / 4k (training 1.40 / 1.23 / 1.25 / 1.00), so to 4k
#: (before the groups the walk went longest first over every head, re-reading K and V from DRAM:
#: 1.16-1.30 x slower at S 512-2k; the rows ended at 2k); D 64 1.04 at 8k (training 1.05) and 0.99 at
#: 16k against the one-tile kernel, 0.98 x the portable kernel at 4k (training 0.95).
#: With the walk in long + short pairs (:func:`_work_tile`), on an H100 (2026-12-06,
#: tools/head_group_check.py, benchmarks/results/paired-walk-h100.txt): D 128 1.35 / 1.17 / 1.09 /
#: 1.04 / 0.99 x the one-tile kernel at S 512 / 2k / 4k / 8k / 16k (training 1.35 / 1.29 / 1.12 /
#: 1.06 / 0.97), so D 128 causal to 16k (was 4k); D 64 0.99 x its unpaired walk at 8k.
#: D 64 causal with two consumers from 2k (:data:`AUTO_TWO_CONSUMERS`, unpaired: :data:`PAIRED_HEAD_DIMS`;
#: an H100, 2026-12-06, benchmarks/results/consumers-d64-h100.txt): 1.05 / 1.05 x the portable kernel at
#: S 2k / 4k (training 1.03 / 1.06), 0.99 at 1k and 0.88 at 512; so from 2k (was 8k).
#: D 256 (O through the Q tile, ``O_IN_Q``) against the one-tile kernel on an H100 (2026-12-06,
#: tools/gluon_persistent_diag.py --time, benchmarks/results/persistent-d256-h100.txt): non-causal 1.21 / 1.10 /
#: 1.03 / 1.01 / 0.99 / 1.05 x at S 512 / 1k / 2k / 4k / 8k / 16k (training 1.23 / 1.13 / 1.06 / 0.95 / 1.01 /
#: 0.98), causal 1.07 / 1.14 / 1.07 / 1.05 / 1.00 / 0.97 (training 1.02 / 1.10 / 1.06 / 1.05 / 0.92 / 1.03):
#: so non-causal below 4k, causal below 8k. D 64 non-causal inference from 512 with two consumers below 2k
#: (:data:`AUTO_TWO_CONSUMERS`: 1.05 / 1.06 x the portable kernel at 512 / 1k; training untimed there).
AUTO_PERSISTENT = {
    (128, False, False): (512, 1 << 31), (128, True, False): (512, 16384),
    (128, False, True): (512, 1 << 31), (128, True, True): (512, 16384),
    (64, False, False): (512, 8192), (64, False, True): (2048, 16384),
    (64, True, False): (2048, 16384), (64, True, True): (2048, 16384),
    (256, False, False): (512, 4096), (256, False, True): (512, 4096),
    (256, True, False): (512, 8192), (256, True, True): (512, 8192),
}


def auto_persistent(spec, training: bool = False) -> bool:
    """Whether :data:`AUTO_PERSISTENT` has a row for ``spec``'s (head dim, causal, ``training``)
    whose query-row range holds ``spec.seqlen_q`` (``D == Dv`` and the rank-4 descriptors'
    strides, :func:`_rank4_strides`, both needed)."""
    return (row_holds(AUTO_PERSISTENT, (spec.head_dim, bool(spec.causal), bool(training)), spec.seqlen_q)
            and spec.head_dim_v == spec.head_dim and _rank4_strides(spec.q, spec.k, spec.v))


def auto_takes(spec, training: bool = False) -> bool:
    """Whether ``auto`` would take the Gluon forward for ``spec``'s shape (before
    :func:`gluon_reasons`): a row of :data:`AUTO_MIN_SEQLEN_Q` (``training``:
    :data:`AUTO_TRAINING_MIN_SEQLEN_Q`) and at least its query rows, or a row of
    :data:`AUTO_PERSISTENT` while ``PORTATTN_TRITON_GLUON_PERSISTENT`` leaves it to ``auto`` or
    turns it on."""
    table = AUTO_TRAINING_MIN_SEQLEN_Q if training else AUTO_MIN_SEQLEN_Q
    need = table.get((spec.head_dim, bool(spec.causal)))
    if need is not None and spec.head_dim_v == spec.head_dim and spec.seqlen_q >= need:
        return True
    return _default_persistent() is not False and auto_persistent(spec, training)


def forward_choice(spec, training: bool = False) -> str:
    """``"gluon"`` or ``"triton"`` (the portable kernel) by ``PORTATTN_TRITON_FORWARD``: ``gluon``
    where :func:`gluon_reasons` is empty; ``auto`` (the default) also only where :func:`auto_takes`
    (``training``: a forward whose backward follows); ``portable`` never."""
    from portattn import config
    mode = config.triton_forward()
    if mode == "portable" or (mode == "auto" and not auto_takes(spec, training)):
        return "triton"
    return "gluon" if not gluon_reasons(spec) else "triton"


def _ensure_allocator() -> None:
    """Device-side tensor descriptors live in triton's per-launch global scratch (ops installs a
    torch-backed allocator for its own TMA kernels; the same one serves here)."""
    from . import ops
    ops._ensure_allocator()


@functools.lru_cache(maxsize=16)
def _sm_count(device) -> int:
    """The persistent grid's size: one CTA per SM (a CTA holds ~190 KiB of shared memory)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _buffer(given, shape, dtype, device, name: str) -> torch.Tensor:
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(given.shape) != tuple(shape) or given.dtype != dtype or given.device != device or given.stride(-1) != 1:
        raise ValueError(f"{name} must be {dtype} of shape {tuple(shape)} on {device} with unit last stride; got "
                         f"{given.dtype} {tuple(given.shape)} on {given.device}, strides {given.stride()}")
    return given


def gluon_forward(spec, *, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                  pingpong: bool | None = None, residual: bool = False, ores: torch.Tensor | None = None,
                  persistent: bool | None = None, consumers: int | None = None, stages: int | None = None) -> tuple:
    """``(out, lse)`` of ``spec`` by :func:`attn_fwd_gluon`: out ``(B, Sq, Hq, Dv)`` in q's dtype,
    lse ``(B, Hq, Sq)`` float32 natural log, as ``ops.forward`` returns them (written into ``out``
    / ``lse`` when given: views with a unit last stride, O's row stride 16-byte aligned). Raises
    ValueError with :func:`gluon_reasons` when the kernel cannot run the problem. ``pingpong``:
    the consumers' ping-pong on or off (None: :data:`PINGPONG`). ``persistent``: the persistent
    variant on or off (None: ``PORTATTN_TRITON_GLUON_PERSISTENT``, and where that is unset
    :data:`AUTO_PERSISTENT` for this problem, :func:`persistent_for`). ``consumers``: 2 or 3
    consumer warpgroups, 64 query rows each (None: :func:`consumers_for`'s choice for this
    problem; 3 at :data:`THREE_CONSUMER_HEAD_DIMS` only). ``stages``: the persistent variant's K/V ring
    depth (None: ``PORTATTN_TRITON_GLUON_STAGES``, else :func:`tile_config`'s; :func:`smem_plan`).

    ``residual=True`` (a forward whose backward follows, as ``ops.forward_for_backward``):
    ``(out, lse, ores)`` with ``ores`` = O_f32 − round(O_f32) rounded to q's dtype, ``(B, Sq, Hq,
    Dv)`` with out's strides (zeros for an empty problem; written into ``ores`` when given, which
    must have out's strides), the residual the backward's delta needs (docs/triton.md)."""
    reasons = gluon_reasons(spec)
    if reasons:
        raise ValueError("the Gluon forward cannot run this problem: " + "; ".join(reasons))
    dev = spec.q.device
    out = _buffer(out, spec.out_shape, spec.dtype, dev, "out")
    lse = _buffer(lse, spec.lse_shape, torch.float32, dev, "lse")
    if ores is not None and (not residual or ores.stride() != out.stride()):
        raise ValueError("ores is written only with residual=True, and must have out's strides "
                         f"{out.stride()}" + ("" if ores is None else f"; got {ores.stride()}"))
    if residual:
        if ores is None:
            ores = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=dev)
        ores = _buffer(ores, out.shape, out.dtype, dev, "ores")
    if spec.is_empty:
        return (out.zero_(), lse.fill_(float("-inf"))) + ((ores.zero_(),) if residual else ())
    for name, t in (("out", out), ("ores", ores)):
        if t is not None and not _tma_aligned(t):
            raise ValueError(f"{name} (strides {t.stride()}) is not TMA-compatible: 16-byte aligned base and row strides")
    q, k, v = spec.q, spec.k, spec.v
    window_left = _UNBOUNDED if spec.window_left is None else spec.window_left
    window_right = _UNBOUNDED if spec.window_right is None else spec.window_right
    if spec.causal:
        window_right = 0
    causal_like = window_right != _UNBOUNDED
    _ensure_allocator()
    persistent = (persistent_for(spec.head_dim, persistent, auto_persistent(spec, residual))
                  and _rank4_strides(q, k, v, out))
    consumers = consumers_for(spec.head_dim, consumers, spec)
    tiles = (-(-spec.seqlen_q // (consumers * WG_M)), spec.batch * spec.num_heads_q)
    consts = launch_constexprs(spec.head_dim, causal_like, spec.alignment == "bottom_right", pingpong, residual,
                               persistent, consumers, stages=stages)
    units = -(-tiles[0] // (1 + consts["PAIRED"])) * tiles[1]   # _work_range
    grid = (min(_sm_count(dev), units),) if persistent else tiles
    attn_fwd_gluon[grid](q, k, v, out, lse, ores, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                         *out.stride()[:3], *lse.stride()[:2], spec.num_heads_q, spec.num_heads_q // spec.num_heads_kv,
                         spec.seqlen_q, spec.seqlen_k, float(spec.scale) * 1.4426950408889634,
                         window_left, window_right, spec.batch if persistent else None,
                         head_group(spec, persistent) if causal_like else 1,
                         **consts, **LAUNCH_OPTIONS)
    return (out, lse, ores) if residual else (out, lse)



if __name__ == "__main__":
    raise SystemExit(main())
