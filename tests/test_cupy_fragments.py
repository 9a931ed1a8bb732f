"""CPU check of the tensor-core backward's fragment bookkeeping (no GPU needed).

A numpy emulation of ``ldmatrix.x4`` (with and without ``.trans``) and ``mma.m16n8k16`` (the PTX
ISA's fragment layouts) drives the backward's warp matmuls exactly as attn_bwd_mma.cu composes
them, with the per-lane ldmatrix offsets taken *from the source* (``ldm_*_offset`` in
attn_common.cuh, evaluated in Python), and checks every product (S^T, dP^T, dV, dK in the dK/dV
kernel; S, dP, dQ in the dQ kernel) and the accumulator coordinates the kernels use for masking
against plain matrix products.
"""
import re

import numpy as np
import pytest
from portattn.backends.cupy import configs

rng = np.random.default_rng(0)


def _offset_fn(name):
    """The C expression returned by ``name`` in attn_common.cuh, as a Python function."""
    src = configs.source()
    body = re.search(name + r"\(int lane, int lds\) \{\s*return (.*?);", src, re.S).group(1)
    expr = " ".join(body.split()).replace("/", "//")
    return lambda lane, lds: eval(expr, {}, {"lane": lane, "lds": lds})


ldm_a_offset = _offset_fn("ldm_a_offset")
ldm_b_offset = _offset_fn("ldm_b_offset")
ldm_bt_offset = _offset_fn("ldm_bt_offset")


def ldmatrix_x4(mem, addrs, trans=False):
    """mem: flat smem (elements); addrs[lane]: element address. returns regs[lane][m] = (lo, hi)."""
    regs = [[None] * 4 for _ in range(32)]
    for m in range(4):
        M = np.stack([mem[addrs[8 * m + r]: addrs[8 * m + r] + 8] for r in range(8)])
        for L in range(32):
            g, t = L // 4, L % 4
            regs[L][m] = (M[2 * t, g], M[2 * t + 1, g]) if trans else (M[g, 2 * t], M[g, 2 * t + 1])
    return regs

def mma(acc, a, b0, b1):
    """acc[lane] = [c0..c3], a[lane] = 4 pairs, b0/b1[lane] = pair."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for L in range(32):
        g, t = L // 4, L % 4
        for r, (row, col) in enumerate(((g, 2*t), (g+8, 2*t), (g, 2*t+8), (g+8, 2*t+8))):
            A[row, col], A[row, col + 1] = a[L][r]
        B[2*t, g], B[2*t+1, g] = b0[L]
        B[2*t+8, g], B[2*t+9, g] = b1[L]
        C[g, 2*t], C[g, 2*t+1], C[g+8, 2*t], C[g+8, 2*t+1] = acc[L]
    D = A @ B + C
    for L in range(32):
        g, t = L // 4, L % 4
        acc[L] = [D[g, 2*t], D[g, 2*t+1], D[g+8, 2*t], D[g+8, 2*t+1]]

def warp_mma_abt(acc, mem, a_addr, b_addr, KS, NP, LDS):
    for kk in range(KS):
        a = ldmatrix_x4(mem, [a_addr[L] + kk * 16 for L in range(32)])
        for np_ in range(NP):
            bf = ldmatrix_x4(mem, [b_addr[L] + np_ * 16 * LDS + kk * 16 for L in range(32)])
            for nt, (i0, i1) in ((2*np_, (0, 1)), (2*np_+1, (2, 3))):
                cur = [acc[L][nt] for L in range(32)]
                mma(cur, a, [bf[L][i0] for L in range(32)], [bf[L][i1] for L in range(32)])
                for L in range(32):
                    acc[L][nt] = cur[L]

def acc_to_a(c0, c1):
    return [(c0[0], c0[1]), (c0[2], c0[3]), (c1[0], c1[1]), (c1[2], c1[3])]

def warp_mma_pb(acc, p, mem, b_addr, KS, NP, LDS):
    for kk in range(KS):
        a = [acc_to_a(p[L][2*kk], p[L][2*kk+1]) for L in range(32)]
        for dp in range(NP):
            bf = ldmatrix_x4(mem, [b_addr[L] + kk * 16 * LDS + dp * 16 for L in range(32)], trans=True)
            for nt, (i0, i1) in ((2*dp, (0, 1)), (2*dp+1, (2, 3))):
                cur = [acc[L][nt] for L in range(32)]
                mma(cur, a, [bf[L][i0] for L in range(32)], [bf[L][i1] for L in range(32)])
                for L in range(32):
                    acc[L][nt] = cur[L]

def zeros(n): return [[[0.0] * 4 for _ in range(n)] for _ in range(32)]

def gather(acc, n_tiles, rows=16):
    """accumulator fragments -> dense (16 x 8*n_tiles) with the documented coordinates."""
    out = np.full((rows, 8 * n_tiles), np.nan)
    for L in range(32):
        g, t = L // 4, L % 4
        for nt in range(n_tiles):
            for e in range(4):
                out[g + 8 * (e // 2), nt * 8 + 2 * t + e % 2] = acc[L][nt][e]
    return out

def scatter(acc, M):
    """The inverse of :func:`gather`: write dense ``M`` (16 x 8*n_tiles) into the fragments
    ``acc`` in place, as the kernels overwrite S/dP accumulators with P/dS."""
    for L in range(32):
        g, t = L // 4, L % 4
        for nt in range(M.shape[1] // 8):
            for e in range(4):
                acc[L][nt][e] = M[g + 8 * (e // 2), nt * 8 + 2 * t + e % 2]

def _lanes(base, offset, lds):
    """Per-lane shared-memory element addresses: ``base + offset(L, lds)`` for the 32 lanes."""
    return [base + offset(L, lds) for L in range(32)]

def _smem_tile(X, lds):
    """A (rows, HD) tile as the kernels stage it in shared memory: rows padded to ``lds``, flat."""
    m = np.zeros((X.shape[0], lds))
    m[:, :X.shape[1]] = X
    return m.ravel()


@pytest.mark.parametrize("HD,NWARPS,BM,warp", [(32, 2, 32, 0), (64, 4, 64, 3), (96, 2, 32, 1), (128, 1, 32, 0)])
def test_dkdv_fragments(HD, NWARPS, BM, warp):
    BN, LDS = 16 * NWARPS, HD + 8
    K, V = rng.standard_normal((BN, HD)), rng.standard_normal((BN, HD))
    Q, dO = rng.standard_normal((BM, HD)), rng.standard_normal((BM, HD))
    # one flat smem: sK | sV | sQ | sdO (element offsets)
    mem = np.concatenate([_smem_tile(X, LDS) for X in (K, V, Q, dO)])
    oK, oV, oQ, odO = 0, BN * LDS, 2 * BN * LDS, 2 * BN * LDS + BM * LDS
    aK = _lanes(oK + warp * 16 * LDS, ldm_a_offset, LDS)
    aV = _lanes(oV + warp * 16 * LDS, ldm_a_offset, LDS)
    bQ, bdO = _lanes(oQ, ldm_b_offset, LDS), _lanes(odO, ldm_b_offset, LDS)
    btQ, btdO = _lanes(oQ, ldm_bt_offset, LDS), _lanes(odO, ldm_bt_offset, LDS)
    Kw, Vw = K[16 * warp: 16 * warp + 16], V[16 * warp: 16 * warp + 16]
    st, dpt = zeros(BM // 8), zeros(BM // 8)
    warp_mma_abt(st, mem, aK, bQ, HD // 16, BM // 16, LDS)
    warp_mma_abt(dpt, mem, aV, bdO, HD // 16, BM // 16, LDS)
    assert np.allclose(gather(st, BM // 8), Kw @ Q.T), "S^T"
    assert np.allclose(gather(dpt, BM // 8), Vw @ dO.T), "dP^T"
    # elementwise: replace with arbitrary values keyed by coordinates (as the kernel does in place)
    # (kernel: fragment row = key jl0 + 8*(e/2), column = query il)
    P, dS = rng.standard_normal((16, BM)), rng.standard_normal((16, BM))
    scatter(st, P)
    scatter(dpt, dS)
    dv, dk = zeros(HD // 8), zeros(HD // 8)
    warp_mma_pb(dv, st, mem, btdO, BM // 16, HD // 16, LDS)
    warp_mma_pb(dk, dpt, mem, btQ, BM // 16, HD // 16, LDS)
    assert np.allclose(gather(dv, HD // 8), P @ dO), "dV"
    assert np.allclose(gather(dk, HD // 8), dS @ Q), "dK"

@pytest.mark.parametrize("HD,BM,kg", [(160, 32, 1), (192, 32, 3), (224, 16, 0), (256, 16, 2)])
def test_dkdv_split_fragments(HD, BM, kg):
    """NSPLIT = 2 (padded HD > 128): warps 2kg + hs sum S^T / dP^T over head-dim columns
    [hs*HD/2, (hs+1)*HD/2) (A and B addresses both offset by col0), the pair adds the partials
    (pair_sum_partials: fragment by fragment, lane by lane), and each warp accumulates dV / dK
    for its own columns from the B addresses offset by col0."""
    NWARPS, LDS, HDS = 8, HD + 8, HD // 2
    BN = 16 * NWARPS // 2
    K, V = rng.standard_normal((BN, HD)), rng.standard_normal((BN, HD))
    Q, dO = rng.standard_normal((BM, HD)), rng.standard_normal((BM, HD))
    mem = np.concatenate([_smem_tile(X, LDS) for X in (K, V, Q, dO)])
    oK, oV, oQ, odO = 0, BN * LDS, 2 * BN * LDS, 2 * BN * LDS + BM * LDS
    Kw, Vw = K[16 * kg: 16 * kg + 16], V[16 * kg: 16 * kg + 16]
    partials = []
    for hs in (0, 1):
        col0 = hs * HDS
        aK = _lanes(oK + kg * 16 * LDS + col0, ldm_a_offset, LDS)
        aV = _lanes(oV + kg * 16 * LDS + col0, ldm_a_offset, LDS)
        st, dpt = zeros(BM // 8), zeros(BM // 8)
        warp_mma_abt(st, mem, aK, _lanes(oQ + col0, ldm_b_offset, LDS), HDS // 16, BM // 16, LDS)
        warp_mma_abt(dpt, mem, aV, _lanes(odO + col0, ldm_b_offset, LDS), HDS // 16, BM // 16, LDS)
        cols = slice(col0, col0 + HDS)
        assert np.allclose(gather(st, BM // 8), Kw[:, cols] @ Q[:, cols].T), "partial S^T"
        partials.append((st, dpt))
    for hs in (0, 1):
        (st, dpt), (st_o, dpt_o) = partials[hs], partials[1 - hs]
        full_st = [[[a + b for a, b in zip(st[L][nt], st_o[L][nt])] for nt in range(BM // 8)] for L in range(32)]
        full_dpt = [[[a + b for a, b in zip(dpt[L][nt], dpt_o[L][nt])] for nt in range(BM // 8)] for L in range(32)]
        assert np.allclose(gather(full_st, BM // 8), Kw @ Q.T), "S^T"
        assert np.allclose(gather(full_dpt, BM // 8), Vw @ dO.T), "dP^T"
    P, dS = rng.standard_normal((16, BM)), rng.standard_normal((16, BM))
    for hs in (0, 1):
        col0 = hs * HDS
        st, dpt = zeros(BM // 8), zeros(BM // 8)
        scatter(st, P)
        scatter(dpt, dS)
        dv, dk = zeros(HDS // 8), zeros(HDS // 8)
        warp_mma_pb(dv, st, mem, _lanes(odO + col0, ldm_bt_offset, LDS), BM // 16, HDS // 16, LDS)
        warp_mma_pb(dk, dpt, mem, _lanes(oQ + col0, ldm_bt_offset, LDS), BM // 16, HDS // 16, LDS)
        assert np.allclose(gather(dv, HDS // 8), (P @ dO)[:, col0: col0 + HDS]), "dV half"
        assert np.allclose(gather(dk, HDS // 8), (dS @ Q)[:, col0: col0 + HDS]), "dK half"


def test_split_tiles_match_the_emulated_shapes():
    """The shapes above are the configured ones (configs.bwd_mma_tile)."""
    for hd in (160, 192, 224, 256):
        warps, bm, split = configs.bwd_mma_tile(hd, "dkdv")
        assert (warps, split) == (8, 2) and bm in (16, 32) and (hd // split) % 16 == 0


@pytest.mark.parametrize("HD,NWARPS,BN,warp", [(32, 2, 32, 1), (64, 4, 64, 2), (96, 1, 64, 0), (128, 2, 32, 1)])
def test_dq_fragments(HD, NWARPS, BN, warp):
    BM, LDS = 16 * NWARPS, HD + 8
    Q, dO = rng.standard_normal((BM, HD)), rng.standard_normal((BM, HD))
    K, V = rng.standard_normal((BN, HD)), rng.standard_normal((BN, HD))
    mem = np.concatenate([_smem_tile(X, LDS) for X in (Q, dO, K, V)])
    oQ, odO, oK, oV = 0, BM * LDS, 2 * BM * LDS, 2 * BM * LDS + BN * LDS
    aQ = _lanes(oQ + warp * 16 * LDS, ldm_a_offset, LDS)
    adO = _lanes(odO + warp * 16 * LDS, ldm_a_offset, LDS)
    sc, dp = zeros(BN // 8), zeros(BN // 8)
    warp_mma_abt(sc, mem, aQ, _lanes(oK, ldm_b_offset, LDS), HD // 16, BN // 16, LDS)
    warp_mma_abt(dp, mem, adO, _lanes(oV, ldm_b_offset, LDS), HD // 16, BN // 16, LDS)
    Qw, dOw = Q[16 * warp: 16 * warp + 16], dO[16 * warp: 16 * warp + 16]
    assert np.allclose(gather(sc, BN // 8), Qw @ K.T), "S"
    assert np.allclose(gather(dp, BN // 8), dOw @ V.T), "dP"
    dS = rng.standard_normal((16, BN))
    scatter(dp, dS)   # (kernel: fragment row = query row_w + g + 8*(e/2), column = key)
    dq = zeros(HD // 8)
    warp_mma_pb(dq, dp, mem, _lanes(oK, ldm_bt_offset, LDS), BN // 16, HD // 16, LDS)
    assert np.allclose(gather(dq, HD // 8), dS @ K), "dQ"
