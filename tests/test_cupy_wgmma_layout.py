"""CPU check of the wgmma forward's shared-memory bookkeeping (no GPU needed).

A numpy emulation of how wgmma reads a 128-byte-swizzled operand through a matrix descriptor
(the canonical layouts of CUTLASS's make_gmma_desc / the PTX ISA: K-major
``Swizzle<3,4,3> o ((8,m),(T,2k)):((8T,SBO),(1,T))``, MN-major
``Swizzle<3,4,3> o ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))``, the swizzle XOR-ing byte-address
bits [4,7) with bits [7,10)) reads tiles that were stored with ``sw128_offset`` and checks that
the descriptors the kernels build (start-address steps and LBO / SBO, taken *from the source*:
attn_sm90.cuh's wg_qk / wg_pv, evaluated in Python) see Q, K and V as the products need them,
and that the accumulator -> A-fragment re-packing (acc_to_a_frags) and the D fragment
coordinates give P V. This checks the kernel's arithmetic on addresses against that model of
the hardware; tools/cupy_wgmma_check.py's probe checks the model on the H200.
"""
import re

import numpy as np
import pytest
from portattn.backends.cupy import configs

SRC = configs.source(configs.WGMMA_SOURCE_FILES)


def _c_expr(text: str) -> str:
    return " ".join(text.split()).replace("(pa_u32)", "").replace("/", "//").replace("&&", "and").replace("||", "or")


def _sw128_offset(rows, r, col):
    body = re.search(r"sw128_offset\(int r, int col\) \{\s*return (.*?);\n", SRC, re.S).group(1)
    return eval(_c_expr(body), {}, {"ROWS": rows, "r": r, "col": col})


def _qk_offsets(kk, bm, bn):
    oq = re.search(r"const pa_u32 oq = (.*?);", SRC).group(1)
    ok = re.search(r"const pa_u32 ok = (.*?);", SRC).group(1)
    env = {"kk": kk, "BM": bm, "BN": bn}
    return eval(_c_expr(oq), {}, env), eval(_c_expr(ok), {}, env)


def _pv_desc(kk, bn):
    """(start offset, LBO, SBO) of wg_pv's V descriptor at k16 step kk (its default offsets)."""
    start = re.search(r"sw128_desc\(sv \+ (.*?), lbo, sbo\)", SRC).group(1)
    lbo = re.search(r"pa_u32 lbo = (.*?),", SRC).group(1)
    sbo = re.search(r"pa_u32 sbo = (\d+)\)", SRC).group(1)
    env = {"kk": kk, "BN": bn}
    return eval(_c_expr(start), {}, env), eval(_c_expr(lbo), {}, env), int(sbo)


def _qk_descs():
    """(LBO, SBO) the S = Q K^T descriptors use (both operands)."""
    call = re.search(r"wgmma_ss<T, BN>\(s, sw128_desc\(sq \+ oq, (\d+), (\d+)\), sw128_desc\(sk \+ ok, (\d+), (\d+)\)",
                     SRC)
    return tuple(int(x) for x in call.groups())


def _store(tile, rows):
    """tile [rows, hd] of 16-bit values into a flat byte-addressed smem image (element per 2 bytes)."""
    hd = tile.shape[1]
    mem = np.full(rows * hd * 2 // 2, np.nan)
    for r in range(rows):
        for col in range(0, hd, 8):
            off = _sw128_offset(rows, r, col)
            assert off % 16 == 0
            mem[off // 2: off // 2 + 8] = tile[r, col:col + 8]
    return mem


def _phys(addr):
    """The 128-byte swizzle of a byte address (base 1024-aligned)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def _read_kmajor(mem, start, sbo, n_rows):
    """An [n_rows x 16] K-major operand (one k16 step) read through a SW128 descriptor."""
    out = np.empty((n_rows, 16))
    for m in range(n_rows):
        for k in range(16):
            addr = start + (m % 8) * 128 + (m // 8) * sbo + k * 2
            out[m, k] = mem[_phys(addr) // 2]
    return out


def _read_mnmajor(mem, start, lbo, sbo, n_cols):
    """A [16 x n_cols] MN-major operand (one k16 step) read through a SW128 descriptor."""
    out = np.empty((16, n_cols))
    for k in range(16):
        for n in range(n_cols):
            addr = start + (n % 64) * 2 + (k % 8) * 128 + (n // 64) * lbo + (k // 8) * sbo
            out[k, n] = mem[_phys(addr) // 2]
    return out


@pytest.mark.parametrize("hd", configs.WGMMA_HEAD_DIMS)
def test_qk_and_pv_descriptors_read_the_stored_tiles(hd):
    bn, nwg = configs.wgmma_tile(hd)
    bm = 64 * nwg
    rng = np.random.default_rng(hd)
    q, k, v = rng.standard_normal((bm, hd)), rng.standard_normal((bn, hd)), rng.standard_normal((bn, hd))
    mq, mk, mv = _store(q, bm), _store(k, bn), _store(v, bn)
    lbo_q, sbo_q, lbo_k, sbo_k = _qk_descs()
    assert sbo_q == sbo_k == 1024   # 8 rows of 128 bytes; LBO is unused by swizzled K-major layouts
    for wg in range(nwg):
        wg_start = wg * 64 * 128          # sQw in the kernel
        s = np.zeros((64, bn))
        for kk in range(hd // 16):
            oq, ok = _qk_offsets(kk, bm, bn)
            a = _read_kmajor(mq, wg_start + oq, sbo_q, 64)
            b = _read_kmajor(mk, ok, sbo_k, bn)
            np.testing.assert_array_equal(a, q[64 * wg:64 * wg + 64, 16 * kk:16 * kk + 16])
            np.testing.assert_array_equal(b, k[:, 16 * kk:16 * kk + 16])
            s += a @ b.T
        np.testing.assert_allclose(s, q[64 * wg:64 * wg + 64] @ k.T, rtol=1e-12, atol=1e-12)
    for kk in range(bn // 16):
        start, lbo, sbo = _pv_desc(kk, bn)
        np.testing.assert_array_equal(_read_mnmajor(mv, start, lbo, sbo, hd), v[16 * kk:16 * kk + 16])


def _d_coords(warp, lane, i):
    """(row, col) of accumulator register i of a thread (the m64nNk16 D fragment, attn_wgmma_ops.cuh)."""
    g, t4 = lane // 4, lane % 4
    return 16 * warp + g + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * t4 + (i % 2)


def _a_coords(warp, lane, reg, half):
    """(row, k) of 16-bit half `half` of A register `reg` (the m64nNk16 A fragment from registers)."""
    g, t4 = lane // 4, lane % 4
    return 16 * warp + g + 8 * (reg % 2), 8 * (reg // 2) + 2 * t4 + half


def test_accumulator_repack_is_the_a_fragment():
    """acc_to_a_frags (read from the source) turns the S fragment into P's A fragments."""
    body = re.search(r"acc_to_a_frags\(pa_u32 \(\*p\)\[4\], const float\* s\) \{(.*?)\n\}", SRC, re.S).group(1)
    picks = re.findall(r"p\[kk\]\[(\d)\] = Elem<T>::pack2\(s\[8 \* kk \+ (\d)\], s\[8 \* kk \+ (\d)\]\)", body)
    assert len(picks) == 4
    bn = 128
    s = np.random.default_rng(1).standard_normal((64, bn))
    for warp in range(4):
        for lane in range(32):
            regs = np.empty(bn // 2)
            for i in range(bn // 2):
                regs[i] = s[_d_coords(warp, lane, i)]
            for kk in range(bn // 16):
                for reg, lo, hi in picks:
                    for half, src in ((0, lo), (1, hi)):
                        row, kcol = _a_coords(warp, lane, int(reg), half)
                        assert regs[8 * kk + int(src)] == s[row, 16 * kk + kcol]


def _desc(saddr, lbo, sbo):
    """attn_sm90.cuh's sw128_desc, evaluated from the source."""
    body = re.search(r"sw128_desc\(pa_u32 saddr, pa_u32 lbo, pa_u32 sbo\) \{\s*return (.*?);\n", SRC, re.S).group(1)
    expr = " ".join(body.split()).replace("(unsigned long long)", "").replace("1ull", "1")
    return eval(expr, {}, {"saddr": saddr, "lbo": lbo, "sbo": sbo})


@pytest.mark.parametrize("hd", configs.WGMMA_HEAD_DIMS)
def test_descriptor_bit_fields(hd):
    """PTX ISA 9.7.15.5.1.1 (matrix descriptor): start address >> 4 in bits 0-13, LBO >> 4 in
    16-29, SBO >> 4 in 32-45, base offset in 49-51 (0: every swizzle atom starts on a 1024-byte
    boundary), swizzle mode in 62-63 (1 = 128-byte); the other bits 0. Every descriptor the
    forward builds (Q, K, V tiles at the kernel's shared-memory offsets, each k16 step) fits its
    field exactly, and every tile base is 1024-byte aligned."""
    bn, nwg = configs.wgmma_tile(hd)
    bm = 64 * nwg
    q_bytes, kv_bytes = bm * hd * 2, bn * hd * 2
    smem = configs.KernelConfig("fwd_wgmma", "bfloat16", hd).smem_bytes("plain")
    base = 1024 * 3   # any 1024-aligned base the kernel's realignment can produce
    sk, sv = base + q_bytes, base + q_bytes + 2 * kv_bytes
    assert sv + 2 * kv_bytes - base <= smem - 1024 and sv + 2 * kv_bytes < 1 << 18   # fits the 18-bit window
    tiles = [base + wg * 64 * 128 for wg in range(nwg)] + [sk + b * kv_bytes for b in (0, 1)] + \
        [sv + b * kv_bytes for b in (0, 1)]
    assert all(t % 1024 == 0 for t in tiles)
    lbo_q, sbo_q, _, _ = _qk_descs()
    descs = []
    for kk in range(hd // 16):
        oq, ok = _qk_offsets(kk, bm, bn)
        descs += [(t + oq, lbo_q, sbo_q) for t in tiles[:nwg]] + [(t + ok, lbo_q, sbo_q) for t in tiles[nwg:nwg + 2]]
    for kk in range(bn // 16):
        start, lbo, sbo = _pv_desc(kk, bn)
        descs += [(t + start, lbo, sbo) for t in tiles[nwg + 2:]]
    for addr, lbo, sbo in descs:
        d = _desc(addr, lbo, sbo)
        assert d & 0x3FFF == addr >> 4 and addr % 16 == 0
        assert (d >> 16) & 0x3FFF == lbo >> 4 and lbo % 16 == 0
        assert (d >> 32) & 0x3FFF == sbo >> 4 and sbo % 16 == 0
        # base offset 0: the start lies in the first 128-byte row of its atom (a K-major k16 step
        # adds 32 bytes inside that row, an MN-major one whole 1024-byte atoms)
        assert (d >> 49) & 7 == 0 and addr % 1024 < 128
        assert d >> 62 == 1
        assert d & ~((0x3FFF) | (0x3FFF << 16) | (0x3FFF << 32) | (7 << 49) | (3 << 62)) == 0
