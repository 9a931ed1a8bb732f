"""Kernel configurations of the CuPy backend: the one source of truth.

Everything that names a template instantiation lives here: the head-dim buckets, the tile
sizes of each kernel family, the shared-memory each launch needs and the NVRTC name
expressions. The run-time path (:mod:`.runtime`) and the CI compile check
(:mod:`.compile_check`) both read :func:`all_configs` / :func:`forward_config` /
:func:`backward_config`, so the check compiles exactly what the backend can launch.

This module is pure Python (no cupy, no torch), so it is importable and testable anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

#: Head dims are padded up to one of these (q/k/v tails are zero-filled by the kernels).
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]

#: portattn dtype name -> the C++ element type in attn_common.cuh, and its size in bytes.
CTYPES = {"float16": ("pa_half", 2), "bfloat16": ("pa_bf16", 2), "float32": ("float", 4)}
TENSOR_CORE_DTYPES = ("float16", "bfloat16")

#: Source files, concatenated in this order into one NVRTC translation unit.
SOURCE_FILES = ("attn_common.cuh", "attn_fwd.cu", "attn_bwd.cu", "attn_bwd_mma.cu")
#: NVRTC options (CuPy adds the architecture itself; the compile check adds it explicitly).
NVRTC_OPTIONS = ("--std=c++17",)
#: The Hopper forward (families "fwd_wgmma" and its layout probe "wgmma_probe"): a translation unit
#: of its own, compiled for the sm_90a target only (wgmma needs the arch-specific target, which
#: CuPy's RawModule cannot ask for: runtime.py compiles it with NVRTC directly).
#: The wgmma backward (family "bwd_wgmma", attn_bwd_wgmma.cu) is in the same unit, with the
#: mma.sync backward's sources for the preprocess and the helpers it shares (load_row_stats,
#: load_row_stats2, store_acc_rows, lse_log2, tile_needs_mask); templates only, nothing of theirs
#: is instantiated unless named.
WGMMA_SOURCE_FILES = ("attn_common.cuh", "attn_wgmma_ops.cuh", "attn_sm90.cuh", "attn_fwd_wgmma.cu",
                      "attn_fwd_wgmma_ws.cu", "attn_bwd.cu", "attn_bwd_mma.cu", "attn_bwd_wgmma.cu",
                      "attn_bwd_wgmma_ws.cu")
#: The sm_90a families: the wgmma forward, its warp-specialized variant, the layout probe, the
#: wgmma backward.
WGMMA_FAMILIES = ("fwd_wgmma", "fwd_wgmma_ws", "wgmma_probe", "bwd_wgmma")
WGMMA_ARCH = "sm_90a"
#: Padded head dims the wgmma forward is instantiated for (the others run attn_fwd_mma).
WGMMA_HEAD_DIMS = (64, 128, 256)
#: Padded head dims where ``auto`` takes the wgmma forward: every one it is instantiated for. The
#: H200 check (2026-12-04, benchmarks/results/cupy-wgmma-check-h200.txt, bf16, S 1k/4k/16k,
#: causal and not; the overlapped walk with fixed-trip loads) timed it 1.14-1.27 x the mma.sync
#: forward at HD 64, 1.26-1.61 x at 128 and 1.45-2.18 x at 256, after its 15 float64 checks passed.
WGMMA_AUTO_HEAD_DIMS = (64, 128, 256)
#: Environment switch of the 16-bit forward (read at call time by :func:`forward_mode`): ``auto``
#: (default, also unset/empty) = the sm_90a wgmma forward where it applies and was timed faster
#: (:data:`WGMMA_AUTO_HEAD_DIMS`), the mma.sync forward elsewhere; ``mma`` = the mma.sync forward;
#: ``wgmma`` = the wgmma forward wherever it applies (compute capability 9.0, fp16/bf16, padded
#: head dim 64/128/256, no softcap/ALiBi/bias), the mma.sync forward elsewhere; ``wgmma_ws`` = the
#: same with the warp-specialized wgmma forward (a producer warpgroup, mbarriers, consumer
#: pingpong; 0.79 x the plain, overlapped wgmma forward on the H200 on 2026-12-04, so never the
#: default).
FORWARD_ENV = "PORTATTN_CUPY_FORWARD"
#: Padded head dims the wgmma backward is instantiated for. Up to 128 a dK/dV warpgroup holds
#: the dK and dV accumulators of its 64 keys (HD floats per thread); at 256 that would be 256
#: floats, over a thread's 255 registers, so the CTA's two warpgroups share 64 keys, one
#: accumulating dV and the other dK (attn_bwd_wgmma.cu, SPLIT). Other buckets run mma.sync.
WGMMA_BWD_HEAD_DIMS = (64, 128, 256)
#: Padded head dims with an overlapped walk (``OVERLAP``). Not 256: the split dK/dV kernel there
#: (one warpgroup per output) has the serial walk only, whatever :data:`WGMMA_BWD_OVERLAP` says.
WGMMA_BWD_OVERLAP_HEAD_DIMS = (64, 128)
#: Padded head dims at which ``auto`` takes the wgmma backward (compute capability 9.0): all it is
#: instantiated for. The H200 (2026-12-04, bf16, 16k tokens, hidden 2048;
#: benchmarks/results/cupy-wgmma-bwd-check-h200.*) timed it at 1.26-1.62 x the mma.sync backward
#: at 128, 1.02-1.16 x at 64 and 1.54-1.90 x at 256 (the split dK/dV), after its 21 float64
#: checks passed with bit-identical repeats.
WGMMA_BWD_AUTO_HEAD_DIMS = (64, 128, 256)
#: Whether the wgmma backward's default instantiation leaves a tile's last products (dV and dK;
#: dQ) in flight into the next tile (``OVERLAP`` in attn_bwd_wgmma.cu, three Q/dO or K buffers)
#: instead of retiring them within it. Off: the H200 (2026-12-04) timed it at 1.01-1.05 x the
#: serial walk (geomean 1.02 over 12 cells, HD 64/128), and NVRTC 13.0's ptxas spills 4 bytes in
#: its HD 128 dK/dV kernel (``KernelConfig("bwd_wgmma", ..., tile=(1,))`` names it;
#: tools/cupy_wgmma_bwd_check.py times both).
WGMMA_BWD_OVERLAP = False
FORWARD_MODES = ("auto", "mma", "wgmma", "wgmma_ws")

# Tile sizes of the backward and of the float32 forward (must match attn_bwd.cu / attn_fwd.cu).
BWD_BLOCK_M, BWD_BLOCK_N, BWD_THREADS = 16, 32, 256
FMA_BLOCK_M, FMA_THREADS = 16, 128
PRE_ROWS, PRE_THREADS = 128, 128
#: The tensor-core backward (family "bwd_mma") covers fp16/bf16 up to this padded head dim (every
#: bucket); float32 always runs the FMA backward (family "bwd").
BWD_MMA_MAX_HEAD_DIM = 256
#: Environment switch of the 16-bit backward (read at call time by :func:`backward_config`):
#: ``auto`` (default, also unset/empty) = tensor cores at every head dim; ``mma128`` = tensor
#: cores up to padded head dim 128 and the FMA kernels above (the behaviour before issue 16);
#: ``fma`` = the FMA kernels for every problem; ``wgmma`` = the sm_90a wgmma backward where it
#: applies (compute capability 9.0, fp16/bf16, padded head dim in :data:`WGMMA_BWD_HEAD_DIMS`, no
#: softcap / ALiBi / bias), the tensor-core (mma.sync) backward elsewhere (:func:`backward_choice`
#: says why). float32 runs the FMA kernels in every mode. ``auto`` takes the wgmma backward at
#: :data:`WGMMA_BWD_AUTO_HEAD_DIMS` (where the H200 timed it faster) and mma.sync elsewhere.
BACKWARD_ENV = "PORTATTN_CUPY_BACKWARD"
BACKWARD_MODES = ("auto", "mma128", "fma", "wgmma")
#: Environment switch of the tensor-core forward's K/V pipeline (read at call time by
#: :func:`forward_config`): ``1`` (default, also unset/empty) = one K and one V buffer, V and the
#: next K each fetched while the other is used (FA2's schedule, two barriers per key tile);
#: ``2`` = two K+V buffers, the next tile fetched during the whole current one (one barrier per
#: tile; 2 x the K/V shared memory). Same arithmetic, so bit-identical outputs; not the default
#: until the H200 says it is faster (tools/cupy_fwd_check.py times both).
FORWARD_KV_STAGES_ENV = "PORTATTN_CUPY_FWD_KV_STAGES"
FORWARD_KV_STAGES = (1, 2)
#: Opt-in shared memory per block: sm_80 (A100) and sm_90 (H100/H200); every instantiation must fit.
SMEM_LIMITS = {80: 163 * 1024, 90: 227 * 1024}


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def padded_head_dim(head_dim: int, head_dim_v: int) -> int | None:
    """The template head dim for (D, Dv): the smallest bucket >= both; None when too large."""
    need = max(head_dim, head_dim_v)
    for hd in HEAD_DIM_BUCKETS:
        if hd >= need:
            return hd
    return None


def mma_tile(hd: int, extras: bool = False) -> tuple[int, int, int]:
    """(warps, BLOCK_N, MT) of the tensor-core forward; BLOCK_M = 16 * MT * warps.

    Up to D = 128 the plain kernel runs 4 warps of 32 rows (MT = 2 m16 tiles per warp, so every
    K/V fragment read from shared memory feeds two mma's) against 64-key tiles: measured on an
    H200 (2026-11-29, bf16, D = 128, S = 4096) 281 TFLOP/s against 266 for 32-key tiles and
    233 for 128x128 tiles with one m-tile per warp, although ptxas spills 76 bytes (sm_90; 32 on sm_80) at D = 128
    (outside the mma loops; compile_check lists it). The EXTRAS kernel (softcap / ALiBi / bias)
    needs more registers per score, so it keeps one m16 tile per warp. Above D = 128 the O
    accumulator (HD / 2 floats per thread and m-tile) leaves room for one m-tile and 32 keys
    (16 keys with extras at D = 256).
    """
    if hd <= 128:
        return (8, 64, 1) if extras else (4, 64, 2)
    if extras and hd > 224:
        return (4, 16, 1)
    return (4, 32, 1)


#: Padded head dims at which attn_fwd_wgmma takes 64-key tiles and runs two CTAs per SM
#: (``__launch_bounds__(256, 2)``: at most 128 registers a thread; HD 64: 127, no spills, under
#: NVRTC 13.0 and 13.5; HD 128 spilled 76-172 bytes): one CTA's loads and softmax fill the other's
#: waits on its products, as FA3's ping-pong between warpgroups does. Must match the kernel's
#: ``__launch_bounds__`` (tests/test_cupy_wgmma.py reads the registers). On the H200 (2026-12-04,
#: tools/cupy_wgmma_check.py, bf16, 16k tokens, hidden 2048) HD 64 ran 1.14-1.27 x the one-CTA
#: 128-key tiles at S 1k / 4k / 16k, causal and not (1.01-1.22 x FA2).
WGMMA_TWO_CTA_HEAD_DIMS = (64,)


def wgmma_tile(hd: int) -> tuple[int, int]:
    """(BLOCK_N, consumer warpgroups) of the wgmma forward; BLOCK_M = 64 * warpgroups.

    Two warpgroups (128 query rows) against 128-key tiles at HD 128 (S and O accumulators:
    64 + 64 floats per thread; Q + 2 x (K + V) = 160 KB, one CTA per SM), 64-key tiles at HD 256
    (O: 128 floats; 192 KB) and at HD 64, where 64-key tiles fit two CTAs per SM
    (:data:`WGMMA_TWO_CTA_HEAD_DIMS`; 49 KB each)."""
    return (64, 2) if hd > 128 or hd in WGMMA_TWO_CTA_HEAD_DIMS else (128, 2)


def wgmma_ws_tile(hd: int) -> int:
    """BLOCK_N of the warp-specialized wgmma forward (one CTA per SM; 128 query rows): 128 keys up
    to HD 128, 64 at HD 256."""
    return 64 if hd > 128 else 128


#: Whether the wgmma forward's default instantiation overlaps each key tile's softmax with the
#: previous tile's O += P V (``wg_walk_overlap`` in attn_fwd_wgmma.cu, FA3's intra-warpgroup
#: pipelining) instead of waiting for each product in turn (``wg_walk_serial``);
#: ``KernelConfig("fwd_wgmma", ..., tile=(BLOCK_N, 2, 0))`` names the serial one
#: (tools/cupy_wgmma_check.py times both).
WGMMA_OVERLAP = True


def bwd_mma_tile(hd: int, role: str) -> tuple[int, int, int]:
    """(warps, tile, split) of the tensor-core backward kernels (attn_bwd_mma.cu).

    ``dkdv``: (warps, BLOCK_M, NSPLIT): the CTA owns 16 keys per group of NSPLIT warps and walks
    query tiles of BLOCK_M rows. Up to HD 128 (NSPLIT = 1) a warp holds all HD columns of its
    keys' dK and dV (HD / 2 floats per thread each) and S^T / dP^T (BLOCK_M / 4 floats each):
    64-row tiles up to HD 64, 32-row tiles at 96 / 128, keeping the live accumulators at <= 160
    floats per thread. Above HD 128 two warps share 16 keys (NSPLIT = 2): each sums S^T / dP^T
    over half the head dim, the pair adds the partials through shared memory, and each
    accumulates half of dK / dV (HD / 4 floats each, <= 64 at HD 256); 8 warps = 64 keys per CTA
    against 32-row query tiles up to HD 224 and 16-row tiles at 256, so K, V, the
    double-buffered Q / dO and the partials fit sm_80's 163 KB (149 KB at HD 224, 115 KB at
    256). ``dq``: (warps, BLOCK_N, 1): 16 query rows per warp against 64-key tiles up to HD 128
    (dQ: HD / 2 floats, S and dP: 32 floats per thread), 32-key tiles at HD 160 / 192 (dQ up to
    96 floats, S and dP 16 each) and 16-key tiles at 224 / 256, where 32-key tiles would need
    116-132 KB and leave one 4-warp CTA per SM on sm_90 (16 keys: 87-99 KB, two CTAs). Not
    timed on the GPU yet (tools/cupy_bwd_check.py times them).
    """
    if role.startswith("dkdv"):
        if hd <= 64:
            return (4, 64, 1)
        if hd <= 128:
            return (4, 32, 1)
        return (8, 32, 2) if hd <= 224 else (8, 16, 2)
    if hd <= 128:
        return (4, 64, 1)
    return (4, 32, 1) if hd <= 192 else (4, 16, 1)


#: Padded head dims whose wgmma backward kernels have two-CTA tiles: 32-row query tiles in dK/dV
#: and 32-key tiles in dQ, at most 128 registers a thread (``__launch_bounds__(256, 2)`` in
#: attn_bwd_wgmma.cu; HD 64 serial walk: 127 / 115 registers, no spills under NVRTC 13.0 and 13.5)
#: and 50 KB of shared memory, so that two CTAs share an SM and fill each other's waits on their
#: products (the one-CTA kernels sit at 12.5 % occupancy, latency-bound: ncu-h200-cupy-d64.txt).
#: The overlapped walk does not fit there (ptxas spills and serializes its wgmma).
WGMMA_BWD_TWO_CTA_CAPABLE = (64,)
#: Of those, the head dims whose default (``auto``) wgmma backward takes the two-CTA tiles: none.
#: On the H200 (2026-12-04, tools/cupy_wgmma_bwd_check.py, ``alt``; bf16, 16k tokens, hidden 2048,
#: S 1k/4k/16k, causal and not) HD 64's ran 0.94-1.07 x the one-CTA tiles (geomean 1.00), its
#: gradient checks passing: twice the CTAs, but half-size products and twice the per-tile work.
WGMMA_BWD_TWO_CTA_HEAD_DIMS: tuple = ()
#: Padded head dims whose wgmma backward module also has the fused-dQ dK/dV kernel (role
#: ``dkdv_dq``, attn_bwd_dkdv_wgmma<..., DQ = true>): the dK/dV CTA also forms dQ += dS K for each
#: query tile it visits and adds it into a float32 buffer with atomics, so the dQ kernel (and its
#: recomputed S and dP) is not launched: five products per tile pair instead of seven. dQ's sum
#: order then depends on the CTAs' timing, so it runs only when determinism is not requested
#: (docs/semantics.md), on the one-CTA tiles (64-row query tiles, two warpgroups: each takes half
#: of dQ's columns over the CTA's 128 keys).
WGMMA_BWD_FUSED_DQ_HEAD_DIMS = (64, 128)
#: Of those, where ``PORTATTN_CUPY_DQ=auto`` (the default) takes the fused kernel when
#: determinism is not requested: where the H200 timed it faster than the two-kernel backward
#: (2026-12-04, tools/cupy_wgmma_bwd_check.py ``fused``, bf16, 16k tokens, hidden 2048, S 1k/4k/16k,
#: causal and not: 1.11-1.21 x at HD 64, 1.03-1.16 x at HD 128, geomean 1.13; its 16 HD 64/128
#: gradient checks against float64 passed, dK / dV bit-identical to the two-kernel backward's).
WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS: tuple = (64, 128)
#: Bytes of spill (stores, and stack) the fused-dQ dK/dV kernel may have at padded head dim 128:
#: 255 registers and 4 bytes of spill under NVRTC 13.0 and 13.5, measured with them (above); every
#: other default kernel must have none (tests/test_cupy_wgmma_bwd.py, tools/cupy_wgmma_bwd_check.py).
WGMMA_BWD_FUSED_DQ_SPILL_BYTES = {128: 8}
#: Bytes of spill (stores, loads, stack) the warp-specialized fused-dQ dK/dV kernel
#: (:data:`WS_FUSED_DQ_ROLES`; attn_bwd_wgmma_ws.cu) may have: its producer warpgroup runs on 56
#: registers at HD 64 and 24 at HD 128 (at HD 128 its per-item and loop-invariant values spill),
#: the consumers on 224 / 240 (at HD 128 a few loop-invariant values spill). NVRTC 13.0 (the
#: H200's): none at HD 64, 92-120 bytes at HD 128; NVRTC 13.5 none and 112-176 (timed with them).
WGMMA_BWD_WS_SPILL_BYTES = 256
#: Bytes of spill (stores, loads, stack) the split dK/dV kernel (padded head dims > 128, one
#: warpgroup per output) may have with its 64-row query tiles: 255 registers and 4 bytes of spill
#: (8 of stack) under NVRTC 13.0 (the GPU image's), none under 13.5. With 32-row tiles it had none,
#: but ran 1.13-1.22 x slower (H100, 2026-12-05, tools/cupy_wgmma_bwd_check.py: D 256 backward
#: 1.09-1.18 x FA2 with 64-row tiles against 0.90-1.01 x with 32, in one call; Nsight Compute, S 4k: the dK/dV
#: kernel 2.63 ms against 3.66).
WGMMA_BWD_SPLIT_SPILL_BYTES = 8
#: Environment switch of the 16-bit wgmma backward's dQ when determinism is not requested (read at
#: call time by :func:`fused_dq_choice`): ``auto`` (default, also unset/empty) = the fused atomic
#: dQ at :data:`WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS` by :data:`WGMMA_BWD_FUSED_DQ_AUTO_ROLE`, the dQ
#: kernel elsewhere; ``atomic`` = the fused atomic dQ by the two-warpgroup kernel wherever the
#: module has it; ``kernel`` = the deterministic dQ kernel always; ``ws`` = the fused atomic dQ by
#: the warp-specialized dK/dV kernel (see :data:`FUSED_DQ_ROLES`). Determinism requested
#: (PORTATTN_DETERMINISTIC, torch.use_deterministic_algorithms) always takes the dQ kernel.
DQ_ENV = "PORTATTN_CUPY_DQ"
DQ_MODES = ("auto", "atomic", "kernel", "ws")
#: The fused-dQ dK/dV role ``PORTATTN_CUPY_DQ=auto`` runs: the warp-specialized kernel, dQ split by
#: columns between the consumers. On the H200 (2026-12-04, tools/cupy_wgmma_bwd_check.py, bf16,
#: 16k tokens, hidden 2048, S 1k/4k/16k, HD 64/128, causal and not) it ran 0.997-1.086 x the
#: fused kernel (geomean 1.051; 0.81-1.13 x FA2), its 16 gradient checks passing with dK / dV
#: bit-identical to the two-kernel backward's. A variant with dQ per consumer over its own 64 keys
#: (twice the atomics, no barrier between the consumers) ran 0.83-1.03 x (geomean 0.92) then and
#: 0.69-0.99 x (0.81, its consumers spilling) once persistent, and was removed.
WGMMA_BWD_FUSED_DQ_AUTO_ROLE = "dkdv_dq_ws"
#: The fused-dQ dK/dV kernels of a module with :attr:`KernelConfig.has_fused_dq`, by role:
#: ``dkdv_dq`` attn_bwd_dkdv_wgmma<..., DQ = true> (two consumer warpgroups, CTA barriers per
#: tile) and ``dkdv_dq_ws`` attn_bwd_dkdv_wgmma_ws (a producer warpgroup, mbarriers, persistent
#: CTAs; the consumers meet once per tile for dQ). The mode of :data:`DQ_ENV` that runs each
#: (``auto``: :data:`WGMMA_BWD_FUSED_DQ_AUTO_ROLE`).
FUSED_DQ_ROLES = {"dkdv_dq": "atomic", "dkdv_dq_ws": "ws"}
#: Of those, the warp-specialized ones (384 threads, their own shared-memory carve-up and spill allowance)
WS_FUSED_DQ_ROLES = ("dkdv_dq_ws",)
#: The warp-specialized kernels take work items (a key tile of a kv head of a batch element, in the
#: order of a grid ``(key tiles, kv heads, batch)``) from a counter in global memory, each CTA its
#: next as its producer finishes loading the last: with one CTA per item (``0``) they are the
#: one-item-per-CTA kernel; with one CTA per SM (``1``, persistent) the producer loads the next
#: item's K, V (two K/V buffers) and first query tiles while the consumers finish the last and
#: store its dK / dV. Environment switch (read at call time by :func:`ws_persistent`): ``auto``
#: (default; :data:`WS_PERSISTENT_AUTO`), ``1`` or ``0``.
WS_PERSISTENT_ENV = "PORTATTN_CUPY_BWD_PERSISTENT"
WS_PERSISTENT_MODES = ("auto", "1", "0")
#: What ``auto`` of :data:`WS_PERSISTENT_ENV` runs: persistent. On the H200 (2026-12-04,
#: tools/cupy_wgmma_bwd_check.py ``ws`` against ``ws1``; bf16, 16k tokens, hidden 2048, S 1k/4k/16k,
#: HD 64/128, causal and not) it ran 1.004-1.043 x one CTA per item (geomean 1.021; 1.03-1.04 at
#: S 1k, where a CTA's items are short), the gradient checks passing on both grids and on three
#: CTAs taking every item (``ws3``).
WS_PERSISTENT_AUTO = True


def wgmma_bwd_tile(hd: int, role: str, two_cta: bool = False) -> tuple[int, int]:
    """(tile, consumer warpgroups) of the wgmma backward (attn_bwd_wgmma.cu); ``two_cta``: the
    two-CTA tiles of :data:`WGMMA_BWD_TWO_CTA_CAPABLE` (32 rows / 32 keys).

    ``dkdv``: (BLOCK_M, NWG): the CTA owns 64 keys per warpgroup (two: 128 keys; at HD 256 both
    share 64 keys, :func:`wgmma_bwd_keys`) and walks query tiles of BLOCK_M = 64 rows (S^T and
    dP^T: 32 + 32 floats per thread beside dK + dV's HD, or at HD 256 beside dK's or dV's 128: 255
    registers there and 4 bytes of spill under NVRTC 13.0, :data:`WGMMA_BWD_SPLIT_SPILL_BYTES`;
    32-row tiles there, half the width per product, ran 1.13-1.22 x slower). K, V and the
    double-buffered Q / dO: 67 KB at HD 64, 133 KB at HD 128, 194 KB at 256 (one CTA per SM).
    ``dq``: (BLOCK_N, NWG): 64 rows per warpgroup (two: 128 rows) against key tiles of 128 keys
    at HD 64 and 64 keys at HD 128 and 256 (S and dP: BLOCK_N / 2 floats each beside dQ's
    HD / 2; 252 registers at 256); 99 / 129 / 225 KB (at HD 256 one V buffer, the next tile's V
    loaded once the tile's dP products retired; 1.10-1.15 x faster than 32-key tiles on the
    H200, 2026-12-05). Chosen from registers and shared memory."""
    if two_cta:
        if hd not in WGMMA_BWD_TWO_CTA_CAPABLE:
            raise ValueError(f"two-CTA wgmma backward tiles at padded head dim {hd}: only at {WGMMA_BWD_TWO_CTA_CAPABLE}")
        return (32, 2)
    if role.startswith("dkdv"):
        return (64, 2)
    return (128, 2) if hd <= 64 else (64, 2)


def wgmma_bwd_other_walk(hd: int) -> tuple:
    """The bwd_wgmma ``tile`` of the walk ``auto`` does not build at ``hd`` (one of
    :data:`WGMMA_BWD_OVERLAP_HEAD_DIMS`), on the one-CTA tiles: timed against the default."""
    return (int(not WGMMA_BWD_OVERLAP),) + ((0,) if hd in WGMMA_BWD_TWO_CTA_HEAD_DIMS else ())


def wgmma_bwd_other_tiles(hd: int) -> tuple:
    """The bwd_wgmma ``tile`` of the tiles ``auto`` does not build at ``hd`` (one of
    :data:`WGMMA_BWD_TWO_CTA_CAPABLE`; serial walk): the two-CTA tiles where ``auto`` takes the
    one-CTA ones, and the other way round."""
    return (0, int(hd not in WGMMA_BWD_TWO_CTA_HEAD_DIMS))


def ws_persistent(mode: str | None = None) -> bool:
    """Whether the warp-specialized fused-dQ kernels launch one CTA per SM (persistent) or one per
    work item; ``mode`` (default :data:`WS_PERSISTENT_ENV`): see :data:`WS_PERSISTENT_MODES`."""
    mode = _env_mode(WS_PERSISTENT_ENV, WS_PERSISTENT_MODES,
                     "auto = the H200's choice; 1 = one CTA per SM taking work items; 0 = one CTA per item") \
        if mode is None else mode
    if mode not in WS_PERSISTENT_MODES:
        raise ValueError(f"persistent mode {mode!r}: one of {WS_PERSISTENT_MODES}")
    return WS_PERSISTENT_AUTO if mode == "auto" else mode == "1"


def dq_mode() -> str:
    """The value of :data:`DQ_ENV` (``auto`` when unset); ValueError names the choices."""
    return _env_mode(DQ_ENV, DQ_MODES, "auto = the fused atomic dQ where the H200 timed it faster, when "
                                       "determinism is not requested; atomic = the two-warpgroup fused kernel "
                                       "wherever the wgmma backward has it; kernel = the deterministic dQ kernel "
                                       "always; ws = the warp-specialized fused kernel")


def fused_dq_role(mode: str | None = None) -> str:
    """The fused-dQ dK/dV role (:data:`FUSED_DQ_ROLES`) that ``mode`` (default :data:`DQ_ENV`)
    runs when :func:`fused_dq_choice` fuses."""
    mode = dq_mode() if mode is None else mode
    if mode == "auto":
        return WGMMA_BWD_FUSED_DQ_AUTO_ROLE
    return {m: role for role, m in FUSED_DQ_ROLES.items()}.get(mode, "dkdv_dq")


def fused_dq_choice(cfg: KernelConfig, deterministic: bool, mode: str | None = None) -> tuple[bool, str]:
    """(whether the backward module ``cfg`` runs its fused atomic dQ, why), for a call that
    requests determinism or not; ``mode`` (default :data:`DQ_ENV`): see :data:`DQ_MODES`."""
    mode = dq_mode() if mode is None else mode
    if not cfg.has_fused_dq:
        return False, (f"{cfg.family} at padded head dim {cfg.head_dim} has no fused dQ (the wgmma backward has it "
                       f"at {', '.join(map(str, WGMMA_BWD_FUSED_DQ_HEAD_DIMS))}, one-CTA tiles): the dQ kernel")
    if deterministic:
        return False, "determinism requested: the deterministic dQ kernel"
    if mode == "kernel":
        return False, f"{DQ_ENV}=kernel: the deterministic dQ kernel"
    if mode == "auto" and cfg.head_dim not in WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS:
        auto = ", ".join(map(str, WGMMA_BWD_FUSED_DQ_AUTO_HEAD_DIMS)) or "none"
        return False, (f"padded head dim {cfg.head_dim} (auto fuses dQ at {auto}; {DQ_ENV}=atomic fuses it "
                       f"wherever it exists): the dQ kernel")
    how = {"dkdv_dq": " (the two-warpgroup kernel)", "dkdv_dq_ws": " (the warp-specialized kernel)"}
    return True, (f"{DQ_ENV}={mode}, determinism not requested: dQ fused into dK/dV with float32 atomics"
                  + how[fused_dq_role(mode)])


def wgmma_bwd_split_names() -> set[str]:
    """The split dK/dV kernels (padded head dims over 128, where :func:`wgmma_bwd_keys` has both
    warpgroups share 64 keys), whose spill :data:`WGMMA_BWD_SPLIT_SPILL_BYTES` bounds."""
    return {c.kernel_names()["dkdv"] for c in wgmma_configs() if c.family == "bwd_wgmma" and c.head_dim > 128}


def wgmma_dq_vbufs(hd: int, block_n: int) -> int:
    """V buffers of the sm_90a dQ kernel (``VBUFS`` in attn_bwd_wgmma.cu): two, so that the next
    key tile's V loads under the current tile's products, except at head dim > 128 with 64-key
    tiles, where a second (64 x 256) V buffer would not fit in 227 KB beside Q, dO and the K
    buffers and the serial walk reloads the one buffer after every warpgroup is done with it."""
    return 1 if hd > 128 and block_n > 32 else 2


def wgmma_bwd_keys(hd: int) -> int:
    """Keys one dK/dV CTA of the wgmma backward owns: 64 per warpgroup, or 64 in all at HD 256
    (one warpgroup accumulates dV, the other dK)."""
    return 64 if hd > 128 else 64 * wgmma_bwd_tile(hd, "dkdv")[1]


def _env_mode(name: str, modes: tuple, meaning: str) -> str:
    """The value of the switch ``name`` (``auto`` when unset), one of ``modes``; a ValueError names
    the choices and ``meaning``."""
    raw = os.environ.get(name, "").strip().lower() or "auto"
    if raw not in modes:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(modes)} ({meaning})")
    return raw


def backward_mode() -> str:
    """The value of :data:`BACKWARD_ENV` (``auto`` when unset); ValueError names the choices."""
    return _env_mode(BACKWARD_ENV, BACKWARD_MODES, "auto = tensor cores for fp16/bf16 at every head dim (the "
                                                   "sm_90a wgmma backward at padded head dims 64/128 on 9.0, "
                                                   "mma.sync elsewhere); wgmma = the sm_90a backward wherever "
                                                   "it applies")


def forward_mode() -> str:
    """The value of :data:`FORWARD_ENV` (``auto`` when unset); ValueError names the choices."""
    return _env_mode(FORWARD_ENV, FORWARD_MODES, "auto = the sm_90a wgmma forward at padded head dims "
                                                 "64/128/256 on 9.0, mma.sync elsewhere; wgmma = the sm_90a "
                                                 "forward wherever it applies")


def forward_kv_stages() -> int:
    """The value of :data:`FORWARD_KV_STAGES_ENV` (1 when unset); ValueError names the choices."""
    raw = os.environ.get(FORWARD_KV_STAGES_ENV, "").strip() or "1"
    if raw not in ("1", "2"):
        raise ValueError(f"{FORWARD_KV_STAGES_ENV}={raw!r}: expected 1 (one K and one V buffer, the default) "
                         f"or 2 (double-buffered K+V tiles)")
    return int(raw)


def fma_block_n(hd: int) -> int:
    return 32 if hd <= 128 else 16


@dataclass(frozen=True)
class KernelConfig:
    """One compiled module: a kernel family at one element type and padded head dim.

    ``family`` is ``"fwd_mma"`` (fp16/bf16 tensor cores, mma.sync), ``"fwd_wgmma"`` (fp16/bf16,
    sm_90a wgmma, padded head dims :data:`WGMMA_HEAD_DIMS`, no score extras; ``"wgmma_probe"``
    is its layout probe for tools/cupy_wgmma_check.py), ``"fwd_fma"`` (float32), ``"bwd"``
    (FMA backward: preprocess or stats, dK/dV and dQ; every dtype) or ``"bwd_mma"`` (tensor-core
    backward for fp16/bf16 at every padded head dim: preprocess, dK/dV and dQ, each of the
    latter two plain and with the score extras softcap / ALiBi / bias compiled in). The cache key of the compiled module is the config itself
    (plus the device, in :mod:`.runtime`).
    """

    family: str
    dtype: str
    head_dim: int
    #: fwd_mma: (warps, BLOCK_N, MT), None = :func:`mma_tile` (benchmarks try others); fwd_wgmma:
    #: (BLOCK_N, warpgroups, overlapped walk), fwd_wgmma_ws: (BLOCK_N, warpgroups, pingpong), None =
    #: :func:`wgmma_tile` and the defaults; bwd_wgmma: (overlapped walk[, two-CTA tiles]), None =
    #: :data:`WGMMA_BWD_OVERLAP` and :data:`WGMMA_BWD_TWO_CTA_HEAD_DIMS`
    tile: tuple[int, ...] | None = None
    #: K/V buffers of the tensor-core forward (1 or 2, see :data:`FORWARD_KV_STAGES_ENV`); 1 elsewhere
    kv_stages: int = 1

    @property
    def source_files(self) -> tuple[str, ...]:
        return WGMMA_SOURCE_FILES if self.family in WGMMA_FAMILIES else SOURCE_FILES

    @property
    def arch(self) -> str | None:
        """The NVRTC target this module needs (None: CuPy's choice for the device)."""
        return WGMMA_ARCH if self.family in WGMMA_FAMILIES else None

    def mma_shape(self, role: str = "plain") -> tuple[int, int, int]:
        return self.tile if self.tile is not None else mma_tile(self.head_dim, extras=role == "extras")

    @property
    def ctype(self) -> str:
        return CTYPES[self.dtype][0]

    @property
    def exact_stats(self) -> bool:
        """The backward recomputes row max/sum and delta = sum P dP (float32 inputs only)."""
        return self.family == "bwd" and self.dtype == "float32"

    def kernel_names(self) -> dict[str, str]:
        """Role -> NVRTC name expression of every kernel this config launches."""
        t, hd = self.ctype, self.head_dim
        if self.family == "fwd_mma":
            (w0, n0, m0), (w1, n1, m1) = self.mma_shape("plain"), self.mma_shape("extras")
            st = self.kv_stages
            return {"plain": f"attn_fwd_mma<{t}, {hd}, {w0}, {n0}, {m0}, {st}, false>",
                    "extras": f"attn_fwd_mma<{t}, {hd}, {w1}, {n1}, {m1}, {st}, true>"}
        if self.family == "fwd_fma":
            return {"plain": f"attn_fwd_fma<{t}, {hd}>"}
        if self.family == "fwd_wgmma":
            _, nwg, overlap = self.tile if self.tile is not None else (None, wgmma_tile(hd)[1], WGMMA_OVERLAP)
            return {"plain": f"attn_fwd_wgmma<{t}, {hd}, {self.wgmma_block_n}, {nwg}, {'true' if overlap else 'false'}>"}
        if self.family == "fwd_wgmma_ws":
            pingpong = self.tile[2] if self.tile is not None else 1
            return {"plain": f"attn_fwd_wgmma_ws<{t}, {hd}, {self.wgmma_block_n}, {'true' if pingpong else 'false'}>"}
        if self.family == "wgmma_probe":
            return {"probe": f"attn_wgmma_probe<{t}, {hd}, {wgmma_tile(hd)[0]}>"}
        if self.family == "bwd":
            # float32: exact row statistics (attn_bwd_stats) instead of delta = dO . O
            first = ({"stats": f"attn_bwd_stats<{t}, {hd}>"} if self.exact_stats
                     else {"preprocess": f"attn_bwd_preprocess<{t}>"})
            return {**first, "dkdv": f"attn_bwd_dkdv<{t}, {hd}>", "dq": f"attn_bwd_dq<{t}, {hd}>"}
        if self.family == "bwd_wgmma":
            (bm, nwg_k), (bn, nwg_q) = self.bwd_tile("dkdv"), self.bwd_tile("dq")
            ov = "true" if self.bwd_overlap else "false"
            names = {"preprocess": f"attn_bwd_preprocess<{t}>",
                     "dkdv": f"attn_bwd_dkdv_wgmma<{t}, {hd}, {bm}, {nwg_k}, {ov}, false>",
                     "dq": f"attn_bwd_dq_wgmma<{t}, {hd}, {bn}, {nwg_q}, {ov}>"}
            if self.has_fused_dq:   # the serial walk whatever the module's
                names["dkdv_dq"] = f"attn_bwd_dkdv_wgmma<{t}, {hd}, {bm}, {nwg_k}, false, true>"
                names["dkdv_dq_ws"] = f"attn_bwd_dkdv_wgmma_ws<{t}, {hd}>"
            return names
        if self.family == "bwd_mma":
            names = {"preprocess": f"attn_bwd_preprocess<{t}>"}
            for kernel in ("dkdv", "dq"):
                warps, tile, split = bwd_mma_tile(hd, kernel)
                shape = f"{warps}, {tile}, {split}" if kernel == "dkdv" else f"{warps}, {tile}"
                for role, extras in ((kernel, "false"), (f"{kernel}_extras", "true")):
                    names[role] = f"attn_bwd_{kernel}_mma<{t}, {hd}, {shape}, {extras}>"
            return names
        raise ValueError(f"unknown kernel family {self.family!r}")

    @property
    def wgmma_block_n(self) -> int:
        """BLOCK_N of a wgmma forward module: its ``tile``'s, else :func:`wgmma_tile`'s
        (:func:`wgmma_ws_tile`'s for the warp-specialized one)."""
        if self.tile is not None:
            return self.tile[0]
        return wgmma_ws_tile(self.head_dim) if self.family == "fwd_wgmma_ws" else wgmma_tile(self.head_dim)[0]

    @property
    def bwd_overlap(self) -> bool:
        """The wgmma backward's walk: products of a tile left in flight into the next one
        (``tile=(1,)``; default :data:`WGMMA_BWD_OVERLAP`) or retired within it (``tile=(0,)``);
        the two-CTA tiles have the second only."""
        if self.head_dim not in WGMMA_BWD_OVERLAP_HEAD_DIMS or self.bwd_two_cta:
            return False
        return bool(self.tile[0]) if self.tile is not None else WGMMA_BWD_OVERLAP

    @property
    def bwd_two_cta(self) -> bool:
        """Whether the wgmma backward runs its two-CTA tiles (``tile=(walk, 1)``; default: the head
        dim is in :data:`WGMMA_BWD_TWO_CTA_HEAD_DIMS`)."""
        if self.family != "bwd_wgmma" or self.head_dim not in WGMMA_BWD_TWO_CTA_CAPABLE:
            return False
        if self.tile is not None and len(self.tile) > 1:
            return bool(self.tile[1])
        return self.head_dim in WGMMA_BWD_TWO_CTA_HEAD_DIMS

    @property
    def has_fused_dq(self) -> bool:
        """Whether this wgmma backward module has the fused-dQ dK/dV kernel (``dkdv_dq``, see
        :data:`WGMMA_BWD_FUSED_DQ_HEAD_DIMS`)."""
        return (self.family == "bwd_wgmma" and self.head_dim in WGMMA_BWD_FUSED_DQ_HEAD_DIMS
                and not self.bwd_two_cta)

    def bwd_tile(self, role: str) -> tuple[int, int]:
        """:func:`wgmma_bwd_tile` of this wgmma backward module's ``role`` (``dkdv`` / ``dq``)."""
        return wgmma_bwd_tile(self.head_dim, role, self.bwd_two_cta)

    def name_expressions(self) -> list[str]:
        return list(self.kernel_names().values())

    # ----- launch geometry ---------------------------------------------------------------
    def threads(self, role: str) -> int:
        if self.family == "bwd_wgmma" and role in WS_FUSED_DQ_ROLES:
            return 384   # a producer and two consumer warpgroups
        if self.family == "bwd_wgmma" and role != "preprocess":
            return 128 * self.bwd_tile(role)[1]
        if self.family == "fwd_wgmma":
            return 128 * wgmma_tile(self.head_dim)[1]
        if self.family == "fwd_wgmma_ws":
            return 384   # a producer and two consumer warpgroups
        if self.family == "wgmma_probe":
            return 128
        if self.family == "fwd_mma":
            return 32 * self.mma_shape(role)[0]
        if self.family == "fwd_fma":
            return FMA_THREADS
        if self.family == "bwd_mma" and role != "preprocess":
            return 32 * bwd_mma_tile(self.head_dim, role)[0]
        return PRE_THREADS if role == "preprocess" else BWD_THREADS

    def block_rows(self, role: str) -> int:
        """Rows (or keys, for dK/dV) one CTA covers along the grid's x axis."""
        if self.family == "bwd_wgmma" and role != "preprocess":
            return wgmma_bwd_keys(self.head_dim) if role.startswith("dkdv") else 64 * self.bwd_tile(role)[1]
        if self.family == "fwd_wgmma":
            return 64 * wgmma_tile(self.head_dim)[1]
        if self.family == "fwd_wgmma_ws":
            return 128
        if self.family == "wgmma_probe":
            return 64
        if self.family == "fwd_mma":
            warps, _, mt = self.mma_shape(role)
            return 16 * mt * warps
        if self.family == "fwd_fma":
            return FMA_BLOCK_M
        if self.family == "bwd_mma" and role != "preprocess":
            warps, _, split = bwd_mma_tile(self.head_dim, role)
            return 16 * warps // split   # 16 keys (dK/dV) per group of `split` warps, or rows (dQ) per warp
        return {"preprocess": PRE_ROWS, "dkdv": BWD_BLOCK_N, "dq": BWD_BLOCK_M, "stats": BWD_BLOCK_M}[role]

    def smem_bytes(self, role: str) -> int:
        """Dynamic shared memory of one CTA (mirrors the carve-up at the top of each kernel)."""
        hd = self.head_dim
        if self.family == "bwd_wgmma":
            # 1 KB of slack for the 1024-byte alignment of the SW128 tiles; dK/dV: K, V [keys],
            # Q, dO [B][BLOCK_M], lse2 / delta [B][2][BLOCK_M] floats; dQ: Q, dO [64 NWG], K [B][BLOCK_N],
            # V [2][BLOCK_N]; B = 3 buffers with the overlapped walk, else 2; the fused-dQ dK/dV
            # (serial walk) adds its dS^T tile, [keys x BLOCK_M]; the warp-specialized one two of
            # them, two K/V buffers, 8 mbarriers and two work-item slots
            if role == "preprocess":
                return 0
            tile, nwg = self.bwd_tile(role)
            if role in WS_FUSED_DQ_ROLES:
                keys = wgmma_bwd_keys(hd)
                return 1024 + (4 * keys + 4 * tile) * hd * 2 + 2 * keys * tile * 2 + 64 + 8 + 16 * tile
            bufs = 3 if self.bwd_overlap and role != "dkdv_dq" else 2
            if role.startswith("dkdv"):
                keys = wgmma_bwd_keys(hd)
                ds = keys * tile * 2 if role == "dkdv_dq" else 0
                return 1024 + (2 * keys + 2 * bufs * tile) * hd * 2 + ds + 8 * bufs * tile
            return 1024 + (2 * 64 * nwg + (bufs + wgmma_dq_vbufs(hd, tile)) * tile) * hd * 2
        if self.family in WGMMA_FAMILIES:
            # 1 KB of slack: the kernel aligns its SW128 tiles to 1024 bytes; Q, then 2 x K, 2 x V
            # (the probe: Q of 64 rows, one K and one V; the warp-specialized kernel: 128 Q rows,
            # two K/V stages and 64 bytes of mbarriers)
            bn, nwg = wgmma_tile(hd)
            if self.family in ("fwd_wgmma", "fwd_wgmma_ws"):
                bn = self.wgmma_block_n
            if self.family == "fwd_wgmma_ws":
                return 1024 + (128 + 4 * bn) * hd * 2 + 64
            rows = 64 * nwg + 4 * bn if self.family == "fwd_wgmma" else 64 + 2 * bn
            return 1024 + rows * hd * 2
        if self.family == "fwd_mma":
            warps, bn, mt = self.mma_shape(role)
            return (16 * mt * warps + 2 * bn * self.kv_stages) * (hd + 8) * CTYPES[self.dtype][1]
        if self.family == "fwd_fma":
            bn = fma_block_n(hd)
            return 4 * (FMA_BLOCK_M * hd + bn * (hd + 1) + bn * hd + FMA_BLOCK_M * bn)
        if role == "preprocess":
            return 0
        if self.family == "bwd_mma":
            warps, tile, split = bwd_mma_tile(hd, role)
            lds, es = hd + 8, CTYPES[self.dtype][1]
            if role.startswith("dkdv"):
                # K, V [16*warps/split]; Q, dO [2][BLOCK_M]; lse2, delta [2][BLOCK_M]; with split 2
                # the pair partials of S^T and dP^T: [warps][2][BLOCK_M * 16] floats
                partials = 4 * warps * 2 * tile * 16 if split > 1 else 0
                return (2 * 16 * warps // split + 4 * tile) * lds * es + 4 * 4 * tile + partials
            return (2 * 16 * warps + 4 * tile) * lds * es   # Q, dO [16*warps]; K, V [2][BLOCK_N]
        ld = hd + 1
        if role == "dkdv":
            return 4 * ((2 * BWD_BLOCK_N + 2 * BWD_BLOCK_M) * ld + 2 * BWD_BLOCK_M * (BWD_BLOCK_N + 1) + 4 * BWD_BLOCK_M)
        if role == "stats":
            return 4 * (2 * BWD_BLOCK_M + 2 * BWD_BLOCK_N) * ld
        return 4 * ((2 * BWD_BLOCK_M + 2 * BWD_BLOCK_N) * ld + BWD_BLOCK_M * (BWD_BLOCK_N + 1))

    def max_smem_bytes(self) -> int:
        return max(self.smem_bytes(role) for role in self.kernel_names())


def forward_config(dtype: str, head_dim: int, head_dim_v: int, kv_stages: int | None = None) -> KernelConfig | None:
    """The forward module for a problem, or None when the head dim is over the largest bucket.

    ``kv_stages`` (tensor-core forward only; default: :data:`FORWARD_KV_STAGES_ENV`, see
    :func:`forward_kv_stages`): 1 or 2 K/V buffers. float32 ignores it (its exact FMA path)."""
    hd = padded_head_dim(head_dim, head_dim_v)
    if hd is None or dtype not in CTYPES:
        return None
    if dtype not in TENSOR_CORE_DTYPES:
        return KernelConfig("fwd_fma", dtype, hd)
    stages = forward_kv_stages() if kv_stages is None else kv_stages
    if stages not in FORWARD_KV_STAGES:
        raise ValueError(f"kv_stages={stages!r}: expected one of {FORWARD_KV_STAGES}")
    return KernelConfig("fwd_mma", dtype, hd, kv_stages=stages)


def wgmma_forward_config(dtype: str, head_dim: int, head_dim_v: int, ws: bool = False) -> KernelConfig | None:
    """The sm_90a wgmma forward module (``ws``: the warp-specialized one) for a problem's dtype
    and head dims, or None where it has no instantiation (float32, padded head dims other than
    :data:`WGMMA_HEAD_DIMS`)."""
    hd = padded_head_dim(head_dim, head_dim_v)
    if dtype not in TENSOR_CORE_DTYPES or hd not in WGMMA_HEAD_DIMS:
        return None
    return KernelConfig("fwd_wgmma_ws" if ws else "fwd_wgmma", dtype, hd)


def forward_choice(dtype: str, head_dim: int, head_dim_v: int, *, extras: bool, capability: tuple | None,
                   mode: str | None = None, kv_stages: int | None = None) -> tuple[KernelConfig | None, str]:
    """(forward module, why) for a problem: the wgmma forward when ``mode`` (default:
    :data:`FORWARD_ENV`) is ``wgmma`` (``wgmma_ws``: its warp-specialized variant), or ``auto`` at a
    padded head dim in :data:`WGMMA_AUTO_HEAD_DIMS`, and the problem is one it runs (``capability``
    (9, 0), fp16/bf16, padded head dim in :data:`WGMMA_HEAD_DIMS`, ``extras`` False: no softcap,
    ALiBi or bias), else :func:`forward_config`'s module; ``why`` says which and why (one line)."""
    base = forward_config(dtype, head_dim, head_dim_v, kv_stages=kv_stages)
    mode = forward_mode() if mode is None else mode
    if base is None or base.family != "fwd_mma":
        return base, "float32 runs its FMA forward" if base is not None else "head dim over the largest bucket"
    if mode == "mma":
        return base, f"{FORWARD_ENV}=mma: the mma.sync forward"
    if mode == "auto" and base.head_dim not in WGMMA_AUTO_HEAD_DIMS:
        return base, (f"{FORWARD_ENV}=auto: the mma.sync forward at padded head dim {base.head_dim} (timed "
                      f"faster than wgmma there on the H200)")
    if mode == "auto" and base.kv_stages != 1:
        return base, f"{FORWARD_ENV}=auto with {base.kv_stages} K/V stages (a knob of the mma.sync forward): mma.sync"
    wg = wgmma_forward_config(dtype, head_dim, head_dim_v, ws=mode == "wgmma_ws")
    if capability is None or tuple(capability) != (9, 0):
        why = f"compute capability {capability} (the wgmma forward needs 9.0, sm_90a)"
    elif extras:
        why = "softcap / ALiBi / bias run the mma.sync EXTRAS kernel"
    elif wg is None:
        why = f"padded head dim {base.head_dim} (the wgmma forward has {', '.join(map(str, WGMMA_HEAD_DIMS))})"
    else:
        return wg, f"{FORWARD_ENV}={mode}: the sm_90a {wg.family} forward"
    return base, f"{FORWARD_ENV}={mode} but {why}: the mma.sync forward"


def wgmma_configs(with_probe: bool = False) -> list[KernelConfig]:
    """Every sm_90a module (compiled for :data:`WGMMA_ARCH` only, apart from :func:`all_configs`):
    the wgmma forwards (``with_probe``: and the layout probe) and the wgmma backward."""
    fams = ("fwd_wgmma", "fwd_wgmma_ws") + (("wgmma_probe",) if with_probe else ())
    out = [KernelConfig(f, dt, hd) for f in fams for hd in WGMMA_HEAD_DIMS for dt in TENSOR_CORE_DTYPES]
    # the serial wgmma forward (timed against the overlapped one) and the warp-specialized one
    # without the consumers' pingpong (timed against it)
    out += [KernelConfig("fwd_wgmma", dt, hd, tile=(*wgmma_tile(hd), 0)) for hd in WGMMA_HEAD_DIMS
            for dt in TENSOR_CORE_DTYPES]
    out += [KernelConfig("fwd_wgmma_ws", dt, hd, tile=(wgmma_ws_tile(hd), 2, 0))
            for hd in WGMMA_HEAD_DIMS for dt in TENSOR_CORE_DTYPES]
    out += [KernelConfig("bwd_wgmma", dt, hd) for hd in WGMMA_BWD_HEAD_DIMS for dt in TENSOR_CORE_DTYPES]
    # the other walk of the wgmma backward (timed against the default)
    out += [KernelConfig("bwd_wgmma", dt, hd, tile=wgmma_bwd_other_walk(hd))
            for hd in WGMMA_BWD_OVERLAP_HEAD_DIMS for dt in TENSOR_CORE_DTYPES]
    out += [KernelConfig("bwd_wgmma", dt, hd, tile=wgmma_bwd_other_tiles(hd))
            for hd in WGMMA_BWD_TWO_CTA_CAPABLE for dt in TENSOR_CORE_DTYPES]
    return out


def wgmma_backward_config(dtype: str, head_dim: int, head_dim_v: int) -> KernelConfig | None:
    """The sm_90a wgmma backward module for a problem's dtype and head dims, or None where it has
    no instantiation (float32, padded head dims other than :data:`WGMMA_BWD_HEAD_DIMS`)."""
    hd = padded_head_dim(head_dim, head_dim_v)
    if dtype not in TENSOR_CORE_DTYPES or hd not in WGMMA_BWD_HEAD_DIMS:
        return None
    return KernelConfig("bwd_wgmma", dtype, hd)


def backward_choice(dtype: str, head_dim: int, head_dim_v: int, *, extras: bool, capability: tuple | None,
                    smem_limit: int | None = None, mode: str | None = None) -> tuple[KernelConfig | None, str]:
    """(backward module, why) for a problem: with ``mode`` (default: :data:`BACKWARD_ENV`)
    ``wgmma`` the sm_90a wgmma backward when the problem is one it runs (``capability`` (9, 0),
    fp16/bf16, padded head dim in :data:`WGMMA_BWD_HEAD_DIMS`, ``extras`` False: no softcap, ALiBi or bias,
    and its shared memory within ``smem_limit``), with ``auto`` (the default) the same where the
    padded head dim is also in :data:`WGMMA_BWD_AUTO_HEAD_DIMS`, else :func:`backward_config`'s
    module (the mma.sync backward); ``why`` says which and why."""
    mode = backward_mode() if mode is None else mode
    base = backward_config(dtype, head_dim, head_dim_v, smem_limit=smem_limit,
                           mode="auto" if mode == "wgmma" else mode)
    if base is None:
        return None, "head dim over the largest bucket"
    if dtype not in TENSOR_CORE_DTYPES:
        return base, "float32 runs its FMA backward"
    if base.family != "bwd_mma":
        return base, (f"{BACKWARD_ENV}={mode}: the FMA backward" if mode != "wgmma" else
                      f"the tensor-core modules need more shared memory than {smem_limit} bytes: the FMA backward")
    if mode not in ("auto", "wgmma"):
        return base, f"{BACKWARD_ENV}={mode}: the mma.sync backward"
    wg = wgmma_backward_config(dtype, head_dim, head_dim_v)
    if capability is None or tuple(capability) != (9, 0):
        why = f"compute capability {capability} (the wgmma backward needs 9.0, sm_90a)"
    elif extras:
        why = "softcap / ALiBi / bias run the mma.sync EXTRAS kernels"
    elif wg is None:
        why = f"padded head dim {base.head_dim} (the wgmma backward has {', '.join(map(str, WGMMA_BWD_HEAD_DIMS))})"
    elif smem_limit is not None and wg.max_smem_bytes() > smem_limit:
        why = f"it needs {wg.max_smem_bytes()} bytes of shared memory per block, the device allows {smem_limit}"
    elif mode == "auto" and wg.head_dim not in WGMMA_BWD_AUTO_HEAD_DIMS:
        why = (f"padded head dim {wg.head_dim} (auto takes it at {', '.join(map(str, WGMMA_BWD_AUTO_HEAD_DIMS))}, "
               f"where the H200 timed it faster; {BACKWARD_ENV}=wgmma forces it)")
    else:
        return wg, f"{BACKWARD_ENV}={mode}: the sm_90a wgmma backward"
    return base, f"{BACKWARD_ENV}={mode} but {why}: the mma.sync backward"


def backward_config(dtype: str, head_dim: int, head_dim_v: int, smem_limit: int | None = None,
                    mode: str | None = None) -> KernelConfig | None:
    """The backward module: tensor cores ("bwd_mma") for fp16/bf16, the FMA kernels ("bwd") for
    float32; None when the head dim is over the largest bucket.

    ``mode`` (default: the :data:`BACKWARD_ENV` variable, see :func:`backward_mode`): ``auto``,
    ``mma128`` (FMA above padded head dim 128) or ``fma`` (FMA always); ``wgmma`` answers as
    ``auto`` here (:func:`backward_choice` takes the wgmma backward where it applies). ``smem_limit`` (the
    device's opt-in bytes per block, or None = no limit): a tensor-core module that needs more
    falls back to the FMA one (sm_86 / sm_89 allow 99 KB; the HD > 128 tensor-core kernels
    need up to 135 KB)."""
    hd = padded_head_dim(head_dim, head_dim_v)
    if hd is None or dtype not in CTYPES:
        return None
    mode = backward_mode() if mode is None else mode
    # wgmma: this function's answer is the mma.sync backward (backward_choice upgrades it)
    max_hd = {"auto": BWD_MMA_MAX_HEAD_DIM, "wgmma": BWD_MMA_MAX_HEAD_DIM, "mma128": 128, "fma": 0}[mode]
    if dtype in TENSOR_CORE_DTYPES and hd <= max_hd:
        cfg = KernelConfig("bwd_mma", dtype, hd)
        if smem_limit is None or cfg.max_smem_bytes() <= smem_limit:
            return cfg
    return KernelConfig("bwd", dtype, hd)


def fma_backward_config(dtype: str, head_dim: int, head_dim_v: int) -> KernelConfig | None:
    """The FMA backward for any dtype (runtime.backward(..., force_fma=True); tests compare it
    with the tensor-core one)."""
    hd = padded_head_dim(head_dim, head_dim_v)
    if hd is None or dtype not in CTYPES:
        return None
    return KernelConfig("bwd", dtype, hd)


def all_configs() -> list[KernelConfig]:
    """Every module the backend can choose (the compile check builds all of them)."""
    out = []
    for hd in HEAD_DIM_BUCKETS:
        for dtype in CTYPES:
            for stages in (FORWARD_KV_STAGES if dtype in TENSOR_CORE_DTYPES else (1,)):
                out.append(forward_config(dtype, hd, hd, kv_stages=stages))
            out.append(backward_config(dtype, hd, hd, mode="auto"))
            fma = fma_backward_config(dtype, hd, hd)
            if fma not in out:   # the FMA backward stays launchable for every dtype (force_fma)
                out.append(fma)
    return out


def all_name_expressions() -> list[str]:
    seen: dict[str, None] = {}
    for cfg in all_configs():
        for name in cfg.name_expressions():
            seen[name] = None
    return list(seen)


@lru_cache(maxsize=4)
def source(files: tuple[str, ...] = SOURCE_FILES) -> str:
    """The CUDA C++ source: the .cu/.cuh files of this package (default :data:`SOURCE_FILES`;
    :data:`WGMMA_SOURCE_FILES` for the sm_90a module), concatenated."""
    here = os.path.dirname(os.path.abspath(__file__))
    parts = []
    for name in files:
        with open(os.path.join(here, name), encoding="utf-8") as f:
            parts.append(f"// ===== {name} =====\n" + f.read())
    return "\n".join(parts)
