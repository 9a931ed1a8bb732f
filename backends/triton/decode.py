"""Split-KV decoding kernels (Flash-Decoding) for :func:`portattn.kvcache.attention_with_kvcache`.

At most two launches per call, none of which synchronises with the host (CUDA-graph capturable);
the host side of a call is cached (see "Host cost" below):

1. the append of new k/v (only with new k/v): by default (:data:`FOLD_APPEND`) in the prologue of
   ``decode_split``: every program first writes the new rows its own chunk of keys will read
   (rows ``cache_seqlens[b] + t``; paged: through the block table), then a barrier makes them
   visible to its threads, and program (split 0, row block 0) of each (sequence, KV head) writes
   every new row (also those no query sees). Several programs may write the same row: always
   the same bytes. Rows that would land beyond the capacity are not written. A new row written
   into a slot that another sequence of the same call reads as one of its old keys (pages
   shared across sequences) is a caller error: that sequence may see either value. With
   ``FOLD_APPEND = False`` a separate ``decode_append`` launch (one program per (sequence, new
   position, KV head)) writes them first.
2. ``decode_split``: grid ``(num_splits, Hkv · m_blocks, B)``. The ``G = Hq / Hkv`` query heads
   of one KV head and the ``Sq`` queries are packed into the rows of one tile (row ``r`` is head
   ``r // Sq`` of the group, query ``r % Sq``: GQA packing), so every K/V byte is read once per
   KV head. Each program reads its sequence's length on the device, takes the band of keys its
   rows can see (``[0, L)`` cut by causal/window on the aligned row ``i + L - Sq``), cuts it
   into ``num_splits`` chunks of whole ``BLOCK_N`` tiles and runs the online softmax over its
   chunk (one masked loop). It writes a float32 partial
   output and its lse (natural log; ``-inf`` when the chunk holds no visible key), or — when
   ``num_splits == 1`` (constexpr ``SPLIT`` off) — the final output and lse directly. The split
   count is a run-time argument: a new count does not recompile.
3. ``decode_combine`` (only when ``num_splits > 1``): one program per (sequence, query head,
   query) merges the partials:
   ``out = Σ_s exp(lse_s - m) o_s / Σ_s exp(lse_s - m)``, ``lse = m + log Σ_s exp(lse_s - m)``;
   a row with no visible key gets 0 and ``-inf``.

Variants for sweeps (tools/decode_variants.py) and table rows (``configs._DECODE_ROWS_NVIDIA``):
a :class:`.configs.DecodeConfig` sets the split heuristic's programs per SM and the paged loop's
page-id handling (:data:`PAGE_FIT_IDS`, :data:`PAGE_FIT_DIRECT`); they read the same keys as the
default loop, in the same order (the same bits).

Keys are read only below each sequence's length (masked loads), so NaN in unused slots never
enters a sum; page ids are clamped into ``[0, num_pages)``. The split count is a host-side
function of ``B``, ``Hkv``, the cache capacity and the SM count (:func:`num_splits_for`), never of
``cache_seqlens`` contents. Tile sizes come from :func:`.configs.decode_config`.

Host cost. Everything that depends only on host values of the spec (device, dtype, shapes, cache
layout, Sq, Sk_new, features, scale: :func:`_launch_key`) is computed once into a
:class:`_Launch` (grids, the kernels' trailing scalar and constexpr arguments, passed
positionally, launch options, the partials' layout); a call reads one ``stride()`` per tensor,
allocates out, lse and (with splits) one float32 buffer of partials, and launches through
:func:`.launcher.fast`: triton's own per-launch work (specialising every argument, the cache key,
a check of every global a kernel uses) runs once per specialisation, later calls with the same
key launch the compiled kernel directly (the normal path under the interpreter). Constants are
literals, not ``tl.constexpr`` globals (each global is checked on every normal launch).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import launcher
from .configs import ELEM_SIZES, decode_config, decode_programs_per_sm, device_target, padded_dim
from .kernels import _div, _load_tile, _mm, _online_max, _round_to, _scores, _tanh

#: an unbounded window side inside the kernels (|row ± window| stays far from int32 limits)
UNBOUNDED = 1 << 30
# The kernels below write their constants (UNBOUNDED = 1073741824, log2(e) = 1.4426950408889634,
# ln(2) = 0.6931471805599453) as literals, not as tl.constexpr globals: Triton compares every
# global a kernel uses with its value at compile time on every launch (a Python constexpr
# __ne__ each, several microseconds per call on a slow host). A literal is the same constexpr to
# the compiler (the PTX is identical).
#: the most splits one call uses (the combine kernel's tile of partials)
MAX_SPLITS = 128
#: rows of the packed (GQA × Sq) query tile at most; more rows take more programs (m_blocks)
MAX_BLOCK_M = 64
#: the split heuristic's wave-efficiency tolerance (:func:`num_splits_for`; flash-attn's 0.85).
#: At B 1 / Sk 128k / Sq 1 it gives 57 splits (228 programs of 264 slots); the H200 sweep of
#: 2026-12-01 (eager timing) read 3.23 / 3.15 / 3.09 / 3.20 TB/s at 28 / 57 / 114 / 128 splits:
#: no case for filling every slot yet. tools/decode_sweep.py times 1, 2 and 4 programs per SM.
SPLIT_EFFICIENCY = 0.85


#: how a key tile of ``BLOCK_N`` rows meets the pages of a paged cache (decode_split's constexpr
#: ``PAGE_FIT``, chosen on the host by :func:`page_fit`; see :func:`_tile_rows`)
PAGE_FIT_GENERAL = 0   # neither divides the other: a page lookup and two divisions per row
PAGE_FIT_TILE = 1      # page_size % BLOCK_N == 0: one scalar page id per tile
PAGE_FIT_ROWS = 2      # BLOCK_N % page_size == 0: per-row page ids without divisions in the loop
#: added to ``PAGE_FIT_ROWS`` / ``PAGE_FIT_GENERAL`` by a config with ``page_ids``
#: (:class:`.configs.DecodeConfig`): the key loop carries the next tile's int32 page ids (one
#: vector for K and V) instead of its int64 row offsets (two vectors), which it then computes
#: from the ids in the iteration that loads the tile (a sweep variant; see :func:`_decode_range`)
PAGE_FIT_IDS = 4
#: added to any case by a config with ``page_direct``: each tile's page ids are loaded in the
#: iteration that reads the tile (no loop carry), so Triton's pipeliner sees a two-level
#: indirection (page id, then K/V) and prefetches the page ids with the tiles (at the price of
#: K/V stages: deep-stage configs only; a sweep variant)
PAGE_FIT_DIRECT = 8


def page_fit(page_size: int, block_n: int, page_ids: bool = False, page_direct: bool = False) -> int:
    """The :data:`PAGE_FIT_TILE` / :data:`PAGE_FIT_ROWS` / :data:`PAGE_FIT_GENERAL` case of a
    paged cache's ``page_size`` (host int: the cache's ``shape[1]``) and the key tile height;
    ``page_direct`` adds :data:`PAGE_FIT_DIRECT` to any case, else ``page_ids`` adds
    :data:`PAGE_FIT_IDS` to the two per-row cases (a tile inside one page carries one scalar
    already)."""
    if page_size % block_n == 0:
        fit = PAGE_FIT_TILE
    else:
        fit = PAGE_FIT_ROWS if block_n % page_size == 0 else PAGE_FIT_GENERAL
    if page_direct:
        return fit + PAGE_FIT_DIRECT
    return fit + PAGE_FIT_IDS if page_ids and fit != PAGE_FIT_TILE else fit


def page_fit_for(cfg, page_size: int) -> int:
    """:func:`page_fit` of a decode config (a :class:`.configs.DecodeConfig` may turn on
    ``page_ids`` / ``page_direct``; a plain ``KernelConfig`` has neither)."""
    return page_fit(page_size, cfg.block_n, getattr(cfg, "page_ids", False), getattr(cfg, "page_direct", False))


# ----- kernels ------------------------------------------------------------------------------

@triton.jit
def _rows(BT, bt_base, cols, end, page_size, num_pages, stride_kp, stride_ks, stride_vp, stride_vs,
          PAGED: tl.constexpr):
    """Element offsets (K, V) of the cache rows at positions ``cols`` of one sequence. Paged: page
    ``block_table[cols // page_size]`` (read only below ``end``, ids clamped into
    ``[0, num_pages)``), row ``cols % page_size``."""
    if PAGED:
        page = tl.load(BT + bt_base + cols // page_size, mask=cols < end, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        in_page = cols % page_size
        return page * stride_kp + in_page * stride_ks, page * stride_vp + in_page * stride_vs
    else:
        return cols * stride_ks, cols * stride_vs


@triton.jit
def _decode_tile(acc, l_i, m_i, q, k_base, v_base, krow, vrow, start_n, end, offs_n, offs_d,
                 qpos, apos, slope2, qk_scale2, softcap_scale, softcap2, window_left, window_right,
                 HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, IEEE: tl.constexpr, RAW_SCORES: tl.constexpr):
    """One K/V tile (rows at offsets ``krow``/``vrow``) of the online softmax for the packed rows."""
    cols = start_n + offs_n
    k = _load_tile(k_base + krow[:, None] + offs_d[None, :], cols, end, offs_d, HEAD_D, BLOCK_D, MASKED)
    qk = _scores(q, k, IEEE)
    if SOFTCAP:
        s = _tanh(qk * softcap_scale, IEEE) * softcap2
    elif RAW_SCORES:
        s = qk
    else:
        s = qk * qk_scale2
    if ALIBI:   # -slope·|i + L - Sq - j| (the bottom-right distance, whatever the alignment)
        s = s - slope2[:, None] * tl.abs((apos[:, None] - cols[None, :]).to(tl.float32))
    if MASKED:
        c = cols[None, :]
        visible = (c < end) & (c >= qpos[:, None] - window_left) & (c <= qpos[:, None] + window_right)
        s = tl.where(visible, s, float("-inf"))
    m_new, alpha, p = _online_max(m_i, s, qk_scale2, RAW_SCORES)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(v_base + vrow[:, None] + offs_d[None, :], cols, end, offs_d, HEAD_DV, BLOCK_D, MASKED)
    acc = _mm(_round_to(p, v.dtype), v, acc * alpha[:, None], IEEE)
    return acc, l_i, m_new


@triton.jit
def _page_base(BT, bt_base, start_n, end, page_size, num_pages, stride_kp, stride_ks, stride_vp, stride_vs):
    """``PAGE_FIT_TILE`` (``page_size % BLOCK_N == 0``): the key tile starting at ``start_n`` (a
    multiple of ``BLOCK_N``) lies in one page: the scalar element offsets (K, V) of its first row
    (one page id, read only below ``end``, clamped into ``[0, num_pages)``); its rows follow at
    the cache's row strides as in a contiguous cache."""
    idx = start_n // page_size
    page = tl.load(BT + bt_base + idx, mask=start_n < end, other=0)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
    in_page = start_n - idx * page_size
    return page * stride_kp + in_page * stride_ks, page * stride_vp + in_page * stride_vs


@triton.jit
def _tile_rows(BT, bt_base, start_n, end, offs_n, page_shift, page_size, num_pages, stride_kp, stride_ks, stride_vp,
               stride_vs, PAGE_FIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets (K, V) of the cache rows of the key tile starting at ``start_n`` (a multiple
    of ``BLOCK_N``) with a paged cache, by :data:`PAGE_FIT` (``PAGE_FIT_TILE``: :func:`_page_base`):

    * ``PAGE_FIT_ROWS`` (``BLOCK_N % page_size == 0``, so ``page_size = 2 ** page_shift``): the
      tile covers whole pages: row ``r`` (``r = (start_n + offs_n) % BLOCK_N``) is row
      ``r & (page_size - 1)`` of page index ``start_n // page_size + (r >> page_shift)``: one
      scalar division per tile, shifts and masks per row. ``r`` is a per-iteration value on
      purpose: loop-invariant row vectors (``offs_n // page_size`` and its products) cost
      237 registers against 182 this way (sm_90 D128, 64 rows; the contiguous tile: 176);
    * ``PAGE_FIT_GENERAL``: per row ``block_table[col // page_size]``, row ``col % page_size``
      (:func:`_rows`; two run-time integer divisions per row and tile).

    Page ids are read only below ``end`` and clamped into ``[0, num_pages)``."""
    if PAGE_FIT == 2:
        r = (start_n + offs_n) % BLOCK_N
        in_page = r & (page_size - 1)
        page = tl.load(BT + bt_base + (start_n // page_size + (r >> page_shift)), mask=start_n + offs_n < end,
                       other=0)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        return page * stride_kp + in_page * stride_ks, page * stride_vp + in_page * stride_vs
    else:
        return _rows(BT, bt_base, start_n + offs_n, end, page_size, num_pages, stride_kp, stride_ks, stride_vp,
                     stride_vs, True)


@triton.jit
def _tile_ids(BT, bt_base, start_n, end, offs_n, page_shift, page_size, num_pages, PAGE_FIT: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """``PAGE_FIT_IDS`` variants: the int32 page id of every row of the key tile starting at
    ``start_n`` (``PAGE_FIT_ROWS + PAGE_FIT_IDS``: index ``start_n // page_size + (r >>
    page_shift)`` as in :func:`_tile_rows`; ``PAGE_FIT_GENERAL + PAGE_FIT_IDS``: ``col //
    page_size``), read only below ``end``, clamped into ``[0, num_pages)``."""
    if PAGE_FIT == 6:
        r = (start_n + offs_n) % BLOCK_N
        idx = start_n // page_size + (r >> page_shift)
    else:
        idx = (start_n + offs_n) // page_size
    page = tl.load(BT + bt_base + idx, mask=start_n + offs_n < end, other=0)
    return tl.minimum(tl.maximum(page, 0), num_pages - 1)


@triton.jit
def _id_rows(page, start_n, offs_n, page_size, stride_kp, stride_ks, stride_vp, stride_vs, PAGE_FIT: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """Element offsets (K, V) of the key tile's rows from their page ids (:func:`_tile_ids`)."""
    if PAGE_FIT == 6:
        in_page = ((start_n + offs_n) % BLOCK_N) & (page_size - 1)
    else:
        in_page = (start_n + offs_n) % page_size
    p64 = page.to(tl.int64)
    return p64 * stride_kp + in_page * stride_ks, p64 * stride_vp + in_page * stride_vs


@triton.jit
def _log2_pages(page_size):
    """log2 of a power-of-two ``page_size`` (≤ 256) as int32: the shift from a key row to its page."""
    shift = 0
    for i in tl.static_range(8):
        shift += (page_size > (1 << i)).to(tl.int32)
    return shift


@triton.jit
def _decode_range(acc, l_i, m_i, q, BT, k_base, v_base, bt_base, lo, hi, end, offs_n, offs_d, qpos, apos, slope2,
                  page_size, num_pages, stride_kp, stride_ks, stride_vp, stride_vs,
                  qk_scale2, softcap_scale, softcap2, window_left, window_right,
                  HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, PAGED: tl.constexpr, PAGE_FIT: tl.constexpr, SOFTCAP: tl.constexpr,
                  ALIBI: tl.constexpr, IEEE: tl.constexpr, RAW_SCORES: tl.constexpr):
    """Tiles ``[lo, hi)`` of the key loop (``lo`` a multiple of ``BLOCK_N`` when paged). The next
    tile's row offsets are computed one iteration ahead (a loop-carried value): with paged caches
    the K/V addresses then do not depend on a load of the same iteration, which Triton's software
    pipeliner (3.9, checked in the sm_90 output) otherwise treats as an indirection level, giving
    K/V half the stages (two, with one ``async_wait 0`` per tile). A carry of two or more tiles
    ahead turns the pipeliner off altogether (3.6 and 3.9). That carried block-table load stays
    a synchronous load in the loop (sm_90 ttgir, 3.9); two sweep variants change it:
    ``PAGE_FIT_IDS`` carries int32 page ids instead of the int64 offsets, ``PAGE_FIT_DIRECT``
    loads each tile's page ids in its own iteration, which the pipeliner then prefetches as
    cp.async copies (with about half the K/V stages: deep-stage configs only)."""
    if PAGE_FIT >= 8:   # PAGE_FIT_DIRECT: each tile's page ids loaded in its own iteration (no carry)
        page_shift = _log2_pages(page_size)
        for start_n in range(lo, hi, BLOCK_N):
            if PAGE_FIT == 9:
                k_off, v_off = _page_base(BT, bt_base, start_n, end, page_size, num_pages, stride_kp, stride_ks,
                                          stride_vp, stride_vs)
                r = (start_n + offs_n) % BLOCK_N
                krow, vrow = k_off + r * stride_ks, v_off + r * stride_vs
            else:
                krow, vrow = _tile_rows(BT, bt_base, start_n, end, offs_n, page_shift, page_size, num_pages,
                                        stride_kp, stride_ks, stride_vp, stride_vs, PAGE_FIT - 8, BLOCK_N)
            acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, k_base, v_base, krow, vrow, start_n, end, offs_n,
                                         offs_d, qpos, apos, slope2, qk_scale2, softcap_scale, softcap2,
                                         window_left, window_right, HEAD_D, HEAD_DV, BLOCK_D, MASKED, SOFTCAP,
                                         ALIBI, IEEE, RAW_SCORES)
    elif PAGE_FIT == 1:   # PAGE_FIT_TILE: a scalar base per tile (carried), rows at the row strides
        k_off, v_off = _page_base(BT, bt_base, lo, end, page_size, num_pages, stride_kp, stride_ks, stride_vp,
                                  stride_vs)
        for start_n in range(lo, hi, BLOCK_N):
            next_k, next_v = _page_base(BT, bt_base, start_n + BLOCK_N, end, page_size, num_pages, stride_kp,
                                        stride_ks, stride_vp, stride_vs)
            # the tile's rows as (start_n + offs_n) % BLOCK_N (= offs_n, start_n being a multiple of
            # BLOCK_N): a per-iteration value as in the contiguous loop. With offs_n * stride (loop
            # invariant) the compiler hoisted the whole (BLOCK_N, BLOCK_D) offset tensor out of the
            # loop: sm_90 D128 64 rows 217 registers against the contiguous tile's 176, 179 this way
            # (triton 3.6; an & (BLOCK_N - 1) is folded back to offs_n: 217 again)
            r = (start_n + offs_n) % BLOCK_N
            acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, k_base + k_off, v_base + v_off, r * stride_ks,
                                         r * stride_vs, start_n, end, offs_n, offs_d, qpos, apos, slope2, qk_scale2,
                                         softcap_scale, softcap2,
                                         window_left, window_right, HEAD_D, HEAD_DV, BLOCK_D, MASKED, SOFTCAP,
                                         ALIBI, IEEE, RAW_SCORES)
            k_off, v_off = next_k, next_v
    elif PAGE_FIT >= 4:   # PAGE_FIT_IDS: carry the next tile's int32 page ids, offsets per iteration
        page_shift = _log2_pages(page_size)
        ids = _tile_ids(BT, bt_base, lo, end, offs_n, page_shift, page_size, num_pages, PAGE_FIT, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            next_ids = _tile_ids(BT, bt_base, start_n + BLOCK_N, end, offs_n, page_shift, page_size, num_pages,
                                 PAGE_FIT, BLOCK_N)
            krow, vrow = _id_rows(ids, start_n, offs_n, page_size, stride_kp, stride_ks, stride_vp, stride_vs,
                                  PAGE_FIT, BLOCK_N)
            acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, k_base, v_base, krow, vrow, start_n, end, offs_n,
                                         offs_d, qpos, apos, slope2, qk_scale2, softcap_scale, softcap2,
                                         window_left, window_right, HEAD_D, HEAD_DV, BLOCK_D, MASKED, SOFTCAP,
                                         ALIBI, IEEE, RAW_SCORES)
            ids = next_ids
    elif PAGED:
        page_shift = _log2_pages(page_size)   # PAGE_FIT_ROWS: a power of two <= BLOCK_N / 2 there
        krow, vrow = _tile_rows(BT, bt_base, lo, end, offs_n, page_shift, page_size, num_pages, stride_kp, stride_ks,
                                stride_vp, stride_vs, PAGE_FIT, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            next_k, next_v = _tile_rows(BT, bt_base, start_n + BLOCK_N, end, offs_n, page_shift, page_size,
                                        num_pages, stride_kp, stride_ks, stride_vp, stride_vs, PAGE_FIT, BLOCK_N)
            acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, k_base, v_base, krow, vrow, start_n, end, offs_n,
                                         offs_d, qpos, apos, slope2, qk_scale2, softcap_scale, softcap2,
                                         window_left, window_right, HEAD_D, HEAD_DV, BLOCK_D, MASKED, SOFTCAP,
                                         ALIBI, IEEE, RAW_SCORES)
            krow, vrow = next_k, next_v
    else:
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + offs_n
            acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, k_base, v_base, cols * stride_ks, cols * stride_vs,
                                         start_n, end, offs_n, offs_d, qpos, apos, slope2, qk_scale2,
                                         softcap_scale, softcap2, window_left, window_right, HEAD_D, HEAD_DV,
                                         BLOCK_D, MASKED, SOFTCAP, ALIBI, IEEE, RAW_SCORES)
    return acc, l_i, m_i


@triton.jit
def _append_rows(kn_base, vn_base, BT, k_base, v_base, bt_base, lo, hi, n0, offs_n, offs_d, page_size, num_pages,
                 stride_kp, stride_ks, stride_vp, stride_vs, stride_kns, stride_vns,
                 HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr):
    """Copy new key/value rows at cache positions ``[lo, hi)`` (new row ``pos - n0``) into the cache."""
    for r0 in range(lo, hi, BLOCK_N):
        cols = r0 + offs_n
        ok = cols < hi
        krow, vrow = _rows(BT, bt_base, cols, hi, page_size, num_pages, stride_kp, stride_ks, stride_vp, stride_vs,
                           PAGED)
        t = cols - n0
        kmask = ok[:, None] & (offs_d[None, :] < HEAD_D)
        k = tl.load(kn_base + t[:, None] * stride_kns + offs_d[None, :], mask=kmask, other=0.0)
        tl.store(k_base + krow[:, None] + offs_d[None, :], k, mask=kmask)
        vmask = ok[:, None] & (offs_d[None, :] < HEAD_DV)
        v = tl.load(vn_base + t[:, None] * stride_vns + offs_d[None, :], mask=vmask, other=0.0)
        tl.store(v_base + vrow[:, None] + offs_d[None, :], v, mask=vmask)


@triton.jit
def decode_split(
    Q, K, V, BT, SEQLENS, SLOPES, O, LSE, OP, LSEP, KN, VN,
    stride_qb, stride_qs, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_bt,
    stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
    stride_ob, stride_os, stride_oh,
    seqlen_q, group, num_heads_q, capacity, seqlen_new, page_size, num_pages, m_blocks, num_splits,
    qk_scale2, softcap_scale, softcap2, window_left, window_right,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    PAGED: tl.constexpr, PAGE_FIT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
    IEEE: tl.constexpr, RAW_SCORES: tl.constexpr, APPEND: tl.constexpr,
):
    """One (split, KV head · row block, sequence): online softmax over the split's key chunk.

    ``APPEND``: first write the new rows ``KN``/``VN`` (b, t, hk) at positions ``n0 + t`` below
    the capacity. One launch cannot order programs, so every program writes the new rows that
    its own chunk reads (the same bytes as any other writer), then a barrier makes them visible
    to its threads; program (split 0, row block 0) of each (sequence, KV head) writes all of
    them (also those no program reads)."""
    split = tl.program_id(0)
    pid1 = tl.program_id(1)
    b = tl.program_id(2)
    hk = pid1 // m_blocks
    mb = pid1 % m_blocks
    b64 = b.to(tl.int64)
    n0 = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), capacity)
    seq_len = tl.minimum(n0 + seqlen_new, capacity)          # keys visible to this sequence

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < group * seqlen_q
    qi = rows % seqlen_q                                      # query index
    h = hk * group + tl.minimum(rows // seqlen_q, group - 1)  # query head (clamped for padding rows)
    apos = qi + (seq_len - seqlen_q)                          # bottom-right aligned row (ALiBi's)
    if BOTTOM_RIGHT:
        qpos = apos
    else:
        qpos = qi
    # the band of keys any row of this tile sees, and this split's chunk of it
    q_lo = tl.min(tl.where(row_ok, qpos, 1073741824), 0)
    q_hi = tl.max(tl.where(row_ok, qpos, -1073741824), 0)
    lo = tl.maximum(q_lo - window_left, 0)
    if PAGED:   # from a multiple of BLOCK_N (keys below the band are masked): the paged tile
        lo = lo - lo % BLOCK_N   # addressing (_tile_rows) needs tiles on multiples of BLOCK_N
    hi = tl.minimum(tl.maximum(q_hi + window_right + 1, 0), seq_len)
    n_keys = tl.maximum(hi - lo, 0)
    chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, hi)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + b64 * stride_qb + qi[:, None] * stride_qs + h[:, None] * stride_qh + offs_d[None, :]
    if HEAD_D == BLOCK_D:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    if PAGED:
        k_base = K + hk.to(tl.int64) * stride_kh
        v_base = V + hk.to(tl.int64) * stride_vh
    else:
        k_base = K + b64 * stride_kp + hk.to(tl.int64) * stride_kh
        v_base = V + b64 * stride_vp + hk.to(tl.int64) * stride_vh
    bt_base = b64 * stride_bt
    if APPEND:
        everything = (split == 0) & (mb == 0)
        w_lo = tl.where(everything, n0, tl.maximum(start, n0))
        w_hi = tl.where(everything, seq_len, tl.minimum(end, seq_len))
        _append_rows(KN + b64 * stride_knb + hk * stride_knh, VN + b64 * stride_vnb + hk * stride_vnh, BT, k_base,
                     v_base, bt_base, w_lo, w_hi, n0, offs_n, offs_d, page_size, num_pages, stride_kp, stride_ks,
                     stride_vp, stride_vs, stride_kns, stride_vns, HEAD_D, HEAD_DV, BLOCK_N, PAGED)
        tl.debug_barrier()
    slope2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ALIBI:
        slope2 = tl.load(SLOPES + b * num_heads_q + h, mask=row_ok, other=0.0) * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # one masked loop: three (masked edges, unmasked inside) cost 185 -> 255 registers and 5x the
    # compile time (sm_80 D64 M32 N128), for mask arithmetic a bandwidth-bound loop hides
    acc, l_i, m_i = _decode_range(acc, l_i, m_i, q, BT, k_base, v_base, bt_base, start, end, end, offs_n, offs_d,
                                  qpos, apos, slope2, page_size, num_pages, stride_kp, stride_ks, stride_vp,
                                  stride_vs, qk_scale2, softcap_scale, softcap2, window_left, window_right,
                                  HEAD_D, HEAD_DV, BLOCK_D, BLOCK_N, True, PAGED, PAGE_FIT, SOFTCAP, ALIBI, IEEE,
                                  RAW_SCORES)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = _div(acc, l_safe[:, None], IEEE)
    if RAW_SCORES:
        m_i = m_i * qk_scale2
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    row = (b64 * num_heads_q + h) * seqlen_q + qi             # (b, h, i) row of lse and the partials
    dmask = row_ok[:, None] & (offs_d[None, :] < HEAD_DV)
    if not SPLIT:
        o_ptrs = O + b64 * stride_ob + qi[:, None] * stride_os + h[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, _round_to(out, O.dtype.element_ty), mask=dmask)
        tl.store(LSE + row, lse, mask=row_ok)
    else:
        part = row * num_splits + split
        tl.store(OP + part[:, None] * HEAD_DV + offs_d[None, :], out, mask=dmask)
        tl.store(LSEP + part, lse, mask=row_ok)


@triton.jit
def decode_combine(
    OP, LSEP, O, LSE, stride_ob, stride_os, stride_oh, num_heads_q, seqlen_q, num_splits,
    HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
):
    """Merge the partial outputs of one (b, h, i) row by their lse."""
    row = tl.program_id(0).to(tl.int64)
    qi = row % seqlen_q
    bh = row // seqlen_q
    h = bh % num_heads_q
    b = bh // num_heads_q
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    lse = tl.load(LSEP + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2((lse - m_safe) * 1.4426950408889634)
    total = tl.sum(w, 0)
    parts = tl.load(OP + (row * num_splits + offs_s)[:, None] * HEAD_DV + offs_d[None, :],
                    mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DV), other=0.0)
    empty = total == 0.0
    out = _div(tl.sum(w[:, None] * parts, 0), tl.where(empty, 1.0, total), IEEE)
    o_ptrs = O + b * stride_ob + qi * stride_os + h * stride_oh + offs_d
    tl.store(o_ptrs, _round_to(out, O.dtype.element_ty), mask=offs_d < HEAD_DV)
    tl.store(LSE + row, tl.where(empty, float("-inf"), m_safe + tl.log2(tl.where(empty, 1.0, total)) * 0.6931471805599453))


@triton.jit
def decode_append(
    KN, VN, K, V, BT, SEQLENS,
    stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
    capacity, page_size, num_pages,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr,
):
    """Write new key/value row (b, t, kv head) at cache position cache_seqlens[b] + t."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    hk = tl.program_id(2).to(tl.int64)
    pos = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), capacity) + t
    offs_d = tl.arange(0, BLOCK_D)
    fits = (offs_d * 0 + pos) < capacity     # a vector: the interpreter rejects scalar & block masks
    pos = tl.minimum(pos, capacity - 1)
    if PAGED:
        page = tl.load(BT + b * stride_bt + pos // page_size)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        k_row = K + page * stride_kp + (pos % page_size) * stride_ks
        v_row = V + page * stride_vp + (pos % page_size) * stride_vs
    else:
        k_row = K + b * stride_kp + pos * stride_ks
        v_row = V + b * stride_vp + pos * stride_vs
    k = tl.load(KN + b * stride_knb + t * stride_kns + hk * stride_knh + offs_d, mask=offs_d < HEAD_D)
    tl.store(k_row + hk * stride_kh + offs_d, k, mask=fits & (offs_d < HEAD_D))
    v = tl.load(VN + b * stride_vnb + t * stride_vns + hk * stride_vnh + offs_d, mask=offs_d < HEAD_DV)
    tl.store(v_row + hk * stride_vh + offs_d, v, mask=fits & (offs_d < HEAD_DV))


# ----- host side ----------------------------------------------------------------------------

@functools.cache
def _sm_count(device_type: str, index: int | None) -> int:
    if device_type != "cuda":
        return 8    # the interpreter: a few "SMs", so that CPU tests split the keys too
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                            ).multi_processor_count


def num_splits_for(units: int, key_blocks: int, num_sms: int, programs_per_sm: int = 2) -> int:
    """How many chunks to cut each (sequence, KV head, row block)'s keys into.

    ``units`` programs exist without splitting; ``key_blocks`` is the number of ``BLOCK_N``
    tiles of the longest possible sequence (the cache capacity, not its contents). Enough
    resident programs (``programs_per_sm`` per SM) keep the memory system busy: when ``units``
    already fills 80 % of them, no split; otherwise the smallest split count whose wave
    efficiency (programs / slots, over whole waves) is within :data:`SPLIT_EFFICIENCY` of the
    best, keeping at least
    two tiles per split (the combine pass and the per-split epilogue cost more than they save
    below that) and at most :data:`MAX_SPLITS`.
    """
    slots = max(1, num_sms * programs_per_sm)
    if units <= 0 or key_blocks <= 2 or units >= 0.8 * slots:
        return 1
    max_splits = max(1, min(MAX_SPLITS, key_blocks // 2))

    def efficiency(s):
        waves = units * s / slots
        return waves / -(-waves // 1)

    best = max(efficiency(s) for s in range(1, max_splits + 1))
    return next(s for s in range(1, max_splits + 1) if efficiency(s) >= SPLIT_EFFICIENCY * best)


def _plan(kv, config=None):
    """(config, block_d, BLOCK_M, m_blocks, num_splits) of one call (host ints only);
    ``config`` replaces the table's tiles (sweeps, tools/decode_sweep.py); its ``block_m`` caps
    the packed tile's height like the table's does (16, 32 or 64). A
    :class:`.configs.DecodeConfig` (the table's paged rows, or a sweep's) may also set the split
    heuristic's programs per SM and the paged loop's ``page_ids`` carry."""
    if config is not None and config.block_m not in (16, 32, 64):
        raise ValueError(f"config.block_m must be 16, 32 or 64 (the packed query tile's height cap), "
                         f"got {config.block_m}")
    return _plan_cached(kv.device.type, kv.device.index, kv.dtype, kv.head_dim, kv.head_dim_v, kv.gqa_ratio,
                        kv.seqlen_q, kv.batch, kv.num_heads_kv, kv.capacity, kv.window_left, kv.window_right,
                        kv.num_splits, config, kv.paged)


@functools.lru_cache(maxsize=1024)
def _plan_cached(device_type, device_index, dtype, head_dim, head_dim_v, group, seqlen_q, batch, num_heads_kv,
                 capacity, window_left, window_right, num_splits, config, paged=False):
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    target = device_target(device)
    block_d = max(padded_dim(head_dim), padded_dim(head_dim_v))
    rows = group * seqlen_q
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))
    cfg = decode_config(target, block_d, ELEM_SIZES[dtype], block_m, paged) if config is None else config
    block_m = min(block_m, cfg.block_m)
    m_blocks = triton.cdiv(rows, block_m)
    units = batch * num_heads_kv * m_blocks
    keys = capacity
    if window_left is not None:   # a window bounds the band of keys a tile can see
        keys = min(keys, window_left + seqlen_q + (window_right or 0))
    if num_splits:
        splits = max(1, min(MAX_SPLITS, num_splits))
    else:
        per_sm = getattr(cfg, "programs_per_sm", 0) or decode_programs_per_sm(target, block_m)
        splits = num_splits_for(units, triton.cdiv(keys, cfg.block_n), _sm_count(device_type, device_index), per_sm)
    return cfg, block_d, block_m, m_blocks, splits


class _Launch:
    """Everything of one call's three launches that depends only on host values of the spec
    (not on tensor addresses or strides): grids, the trailing scalar and constexpr arguments
    (positional, in the kernels' order), launch options and the partials' buffer layout.
    Built once per :func:`_launch_key` by :func:`_launch_plan`."""

    __slots__ = ("splits", "rows", "out_shape", "lse_shape", "out_strides", "part_numel", "lse_offset",
                 "split_grid", "split_tail", "split_opts", "combine_grid", "combine_tail", "combine_opts",
                 "append_grid", "append_tail", "append_opts", "paged", "alibi", "fold")


def _launch_key(kv, config) -> tuple:
    """The host values a :class:`_Launch` depends on (cheap: attribute reads of the spec)."""
    bt = kv.block_table
    return (kv.q.device, kv.q.dtype, kv.batch, kv.seqlen_q, kv.num_heads_q, kv.num_heads_kv, kv.head_dim,
            kv.head_dim_v, kv.seqlen_new, kv.page_size, kv.num_pages, kv.capacity, bt is not None,
            kv.alibi_slopes is not None, kv.scale, kv.softcap, kv.alignment, kv.window_left, kv.window_right,
            kv.allow_tf32, kv.num_splits, config, FOLD_APPEND)


#: _launch_key -> _Launch (host values only: no tensor is kept)
_LAUNCHES: dict = {}
_LAUNCHES_MAX = 1024


def _launch_plan(kv, config=None) -> _Launch:
    """The cached :class:`_Launch` of ``kv`` (built on the first call with its key)."""
    key = _launch_key(kv, config)
    p = _LAUNCHES.get(key)
    if p is None:
        if len(_LAUNCHES) >= _LAUNCHES_MAX:
            _LAUNCHES.clear()
        p = _LAUNCHES[key] = _build_launch(kv, config)
    return p


def _build_launch(kv, config) -> _Launch:
    cfg, block_d, block_m, m_blocks, splits = _plan(kv, config)
    p = _Launch()
    b, sq, hq, hkv, dv = kv.batch, kv.seqlen_q, kv.num_heads_q, kv.num_heads_kv, kv.head_dim_v
    rows = b * hq * sq
    p.splits, p.rows, p.paged, p.alibi = splits, rows, kv.paged, kv.alibi_slopes is not None
    p.out_shape, p.lse_shape = kv.out_shape, kv.lse_shape
    p.out_strides = (sq * hq * dv, hq * dv, dv)          # out is allocated contiguous here
    # one float32 buffer holds the partial outputs (rows, splits, Dv) and, from a 16-byte
    # aligned offset on, the partial lse (rows, splits)
    p.lse_offset = -(-rows * splits * dv // 4) * 4
    p.part_numel = p.lse_offset + rows * splits
    softcap = kv.softcap
    raw = kv.dtype == torch.float32 and softcap is None and kv.alibi_slopes is None
    ieee = kv.dtype == torch.float32 and not kv.allow_tf32
    p.split_grid = (splits, hkv * m_blocks, b)
    p.split_tail = (
        *p.out_strides,
        sq, kv.gqa_ratio, hq, kv.capacity, kv.seqlen_new, kv.page_size, kv.num_pages, m_blocks, splits,
        kv.scale * LOG2E_HOST, kv.scale / softcap if softcap else 1.0, softcap * LOG2E_HOST if softcap else 1.0,
        UNBOUNDED if kv.window_left is None else kv.window_left,
        UNBOUNDED if kv.window_right is None else kv.window_right,
        # HEAD_D, HEAD_DV, BLOCK_D, BLOCK_M, BLOCK_N, SPLIT, PAGED, PAGE_FIT, BOTTOM_RIGHT, SOFTCAP, ALIBI, IEEE,
        # RAW_SCORES, APPEND (set below)
        kv.head_dim, dv, block_d, block_m, cfg.block_n, splits > 1, kv.paged,
        page_fit_for(cfg, kv.page_size) if kv.paged else PAGE_FIT_GENERAL,
        kv.alignment == "bottom_right",
        softcap is not None, kv.alibi_slopes is not None, ieee, raw,
    )
    p.split_opts = cfg.launch_options()
    p.combine_grid = (rows,)
    # num_heads_q, seqlen_q, num_splits, HEAD_DV, BLOCK_D, BLOCK_S, IEEE
    p.combine_tail = (*p.out_strides, hq, sq, splits, dv, padded_dim(dv), max(16, triton.next_power_of_2(splits)), ieee)
    p.combine_opts = {"num_warps": 4, "enable_fp_fusion": True}
    p.append_grid = None
    if kv.k_new is not None and kv.seqlen_new and b and kv.capacity:
        p.append_grid = (b, kv.seqlen_new, hkv)
        # capacity, page_size, num_pages, HEAD_D, HEAD_DV, BLOCK_D, PAGED
        p.append_tail = (kv.capacity, kv.page_size, kv.num_pages, kv.head_dim, dv,
                         max(padded_dim(kv.head_dim), padded_dim(dv)), kv.paged)
        p.append_opts = {"num_warps": 1, "enable_fp_fusion": True}
    p.fold = FOLD_APPEND and p.append_grid is not None
    p.split_tail += (p.fold,)
    return p


#: write the new k/v rows in the split kernel's prologue (one launch less per call) instead of
#: a separate ``decode_append`` launch before it; both give the same cache and results
FOLD_APPEND = True
_NO_STRIDES = (0, 0, 0, 0)


#: log2(e) as a host float (kernels.LOG2E is a tl.constexpr)
LOG2E_HOST = 1.4426950408889634


def _last_unit(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``t`` (made contiguous when its last dimension is strided) and its strides: one
    ``stride()`` call per tensor."""
    st = t.stride()
    if st[-1] != 1 and t.shape[-1] != 1:
        t = t.contiguous()
        st = t.stride()
    return t, st


def _append(kv, p: _Launch, kc, vc, skc, svc, bt, sbt) -> None:
    kn, skn = _last_unit(kv.k_new)
    vn, svn = _last_unit(kv.v_new)
    launcher.fast(decode_append)[p.append_grid](
        kn, vn, kc, vc, bt, kv.cache_seqlens,
        skn[0], skn[1], skn[2], svn[0], svn[1], svn[2],
        skc[0], skc[1], skc[2], svc[0], svc[1], svc[2], sbt, *p.append_tail, **p.append_opts,
    )


def append(kv) -> None:
    """Write ``kv.k_new``/``kv.v_new`` into the caches in place (one small launch)."""
    p = _launch_plan(kv)
    if p.append_grid is None:
        return
    kc, vc = kv.k_cache, kv.v_cache
    bt = kv.block_table if p.paged else kv.cache_seqlens
    _append(kv, p, kc, vc, kc.stride(), vc.stride(), bt, bt.stride(0) if p.paged else 0)


def forward(kv, config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Append (in the split kernel, :data:`FOLD_APPEND`), split, combine (only with more than
    one split): ``(out (B, Sq, Hq, Dv), lse (B, Hq, Sq) float32)``. ``config``
    (a :class:`.configs.KernelConfig`) overrides the tile table, for benchmark sweeps.

    Per call only tensors, their strides (one ``stride()`` each) and three allocations (out,
    lse, and one buffer of partials when the keys are split); everything else comes from the
    cached :class:`_Launch`."""
    p = _launch_plan(kv, config)
    q, sq = _last_unit(kv.q)
    kc, vc = kv.k_cache, kv.v_cache
    skc, svc = kc.stride(), vc.stride()
    seqlens = kv.cache_seqlens
    if p.paged:
        bt = kv.block_table
        sbt = bt.stride(0)
    else:
        bt, sbt = seqlens, 0
    if p.fold:
        kn, skn = _last_unit(kv.k_new)
        vn, svn = _last_unit(kv.v_new)
    else:
        if p.append_grid is not None:
            _append(kv, p, kc, vc, skc, svc, bt, sbt)
        kn = vn = q
        skn = svn = _NO_STRIDES
    out = q.new_empty(p.out_shape, dtype=kv.dtype)
    lse = q.new_empty(p.lse_shape, dtype=torch.float32)
    if p.splits > 1:
        part_o = q.new_empty((p.part_numel,), dtype=torch.float32)
        part_lse = part_o[p.lse_offset:]
    else:
        part_o = part_lse = lse
    slopes = kv.alibi_slopes if p.alibi else lse
    launcher.fast(decode_split)[p.split_grid](
        q, kc, vc, bt, seqlens, slopes, out, lse, part_o, part_lse, kn, vn,
        sq[0], sq[1], sq[2], skc[0], skc[1], skc[2], svc[0], svc[1], svc[2], sbt,
        skn[0], skn[1], skn[2], svn[0], svn[1], svn[2],
        *p.split_tail, **p.split_opts,
    )
    if p.splits > 1:
        launcher.fast(decode_combine)[p.combine_grid](part_o, part_lse, out, lse, *p.combine_tail, **p.combine_opts)
    return out, lse


def plan_summary(kv, config=None) -> dict:
    """The launch choices of one call (for benchmarks and docs): tiles, splits, programs."""
    cfg, block_d, block_m, m_blocks, splits = _plan(kv, config)
    return dict(config=cfg.short(), block_d=block_d, block_m=block_m, m_blocks=m_blocks, num_splits=splits,
                programs=splits * kv.num_heads_kv * m_blocks * kv.batch)
