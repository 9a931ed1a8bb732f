"""CPU check of the wgmma backward's operand forms and fragment bookkeeping (no GPU needed).

The backward (attn_bwd_wgmma.cu) reuses the forward's wg_qk / wg_pv with other tiles in other
roles: in dK/dV, S^T = K_w Q^T has the CTA's K tile (64 NWG keys) as the K-major A operand and
the Q tile (BM rows) as the K-major B operand, and dV += P^T dO, dK += dS^T Q read dO and Q as
MN-major B operands of BM rows; in dQ, dQ += dS K reads the K tile as an MN-major B operand.
This emulates those reads with test_cupy_wgmma_layout's model of the hardware (SW128 stores,
descriptor reads, accumulator / A-fragment coordinates), taking from the source: which tile is
A and B and with which template row counts (the wg_qk / wg_pv calls of each kernel), the
warpgroup's tile offset, the element -> (key, query) coordinates the P / dS code uses for lse,
delta and masking, and the shared-memory carve-up (1024-byte aligned SW128 bases; its size is
configs.KernelConfig.smem_bytes). Then the emulated products equal K_w Q^T, P^T dO, dS^T Q and
dS K computed directly, so a wrong operand role, offset or coordinate fails here.
"""
import re

import numpy as np
import pytest
from portattn.backends.cupy import configs
from test_cupy_wgmma_layout import (
    _a_coords,
    _c_expr,
    _d_coords,
    _desc,
    _pv_desc,
    _qk_descs,
    _qk_offsets,
    _read_kmajor,
    _read_mnmajor,
    _store,
    _sw128_offset,
)

SRC = configs.source(("attn_bwd_wgmma.cu",))


def _kernel(name: str) -> str:
    start = SRC.index(f"\n{name}(")
    end = SRC.find("\ntemplate <", start)
    return SRC[start:end if end > 0 else len(SRC)]


DKDV, DQ = _kernel("attn_bwd_dkdv_wgmma"), _kernel("attn_bwd_dq_wgmma")


def _call(body: str, pattern: str):
    m = re.search(pattern, body)
    assert m, pattern
    return m.groups()


def _eval(expr: str, env: dict) -> int:
    text = _c_expr(expr)
    m = re.fullmatch(r"(.+?) \? (.+?) : (.+)", text)   # one C conditional: cond ? a : b
    if m:
        text = f"({m.group(2)}) if ({m.group(1)}) else ({m.group(3)})"
    return eval(text, {}, dict(env))


def _carve(body: str, env: dict) -> dict:
    """The kernel's constexpr sizes and SW128 region bases (relative to the aligned base)."""
    env = dict(env, base=0)
    for name, expr in re.findall(r"constexpr (?:int|bool) (\w+) = ([^;]+);", body):
        env[name] = _eval(expr, env)
    for name, expr in re.findall(r"const pa_u32 (s\w+) = ([^;,]+)[;,]", body):
        try:
            env[name] = _eval(expr, env)
        except NameError:   # per-warpgroup / per-buffer addresses (wg, buf): not part of the carve-up
            pass
    return env


def _thread_regs(mat, warp, lane, n_cols):
    """A thread's accumulator registers of a 64 x n_cols product (the m64nNk16 D fragment)."""
    return np.array([mat[_d_coords(warp, lane, i)] for i in range(n_cols // 2)])


def _a_operand(regs_per_thread, kk):
    """The 64 x 16 A operand that the A fragments re-packed from the accumulators (acc_to_a_frags:
    the same register order) give at k16 step kk."""
    a = np.full((64, 16), np.nan)
    for (warp, lane), regs in regs_per_thread.items():
        for reg in range(4):
            for half in range(2):
                row, k = _a_coords(warp, lane, reg, half)
                a[row, k] = regs[8 * kk + 2 * reg + half]
    assert not np.isnan(a).any()
    return a


@pytest.mark.parametrize("hd", configs.WGMMA_BWD_HEAD_DIMS)
def test_dkdv_operands_and_coordinates(hd):
    bm, nwg = configs.wgmma_bwd_tile(hd, "dkdv")
    bn = configs.wgmma_bwd_keys(hd)   # 64 per warpgroup, or 64 shared by both at HD 256 (SPLIT)
    overlap = configs.KernelConfig("bwd_wgmma", "bfloat16", hd).bwd_overlap
    env = _carve(DKDV, {"HD": hd, "BM": bm, "NWG": nwg, "OVERLAP": overlap})
    assert env["BN"] == bn and env["SPLIT"] == (hd > 128)
    # the two wg_qk calls: template row counts and operands (A: K / V of the warpgroup, B: Q / dO)
    a_rows, b_rows, acc, a_tile, b_tile = _call(DKDV, r"wg_qk<T, HD, (\w+), (\w+)>\((st), opaque_u32\((\w+)\), (\w+)\)")
    assert (acc, a_tile, b_tile) == ("st", "sKw", "sQb")
    a_rows2, b_rows2, a2, b2 = _call(DKDV, r"wg_qk<T, HD, (\w+), (\w+)>\(dpt, opaque_u32\((\w+)\), (\w+)\)")
    assert (a_rows2, b_rows2, a2, b2) == (a_rows, b_rows, "sVw", "sdOb")
    a_rows, b_rows = env[a_rows], env[b_rows]
    assert (a_rows, b_rows) == (bn, bm)
    assert _call(DKDV, r"const pa_u32 sKw = sK \+ ([^,]+), sVw")[0] == "kw * 128"
    kw_expr = _call(DKDV, r"const int kw = ([^;]+);")[0]   # the warpgroup's first key in the CTA
    dv_rows, dv_tile = _call(DKDV, r"wg_pv<T, HD, (\w+)>\(dv_acc, pa, (\w+)[,)]")
    dk_rows, dk_tile = _call(DKDV, r"wg_pv<T, HD, (\w+)>\(dk_acc, da, (\w+)[,)]")
    assert (dv_tile, dk_tile) == ("sdOb", "sQb") and env[dv_rows] == env[dk_rows] == bm
    # element coordinates of wg_probs_keys: (query, key) of accumulator element 4 nb + e, and the
    # query's lse2 (there) and delta (wg_dscores_keys) in shared memory
    body = re.search(r"wg_probs_keys\(.*?\n\}", SRC, re.S).group(0)
    il_expr = re.search(r"const int il = ([^;]+);", body).group(1)
    q_expr, k_expr = re.search(r"check, s, ([^,]+), ([^,]+),\s*scale_log2", body).groups()
    stat_off = re.search(r"const float2 l2 = \*reinterpret_cast<const float2\*>\(lse2_t \+ (\w+)\)", body).group(1)
    assert stat_off == "il" and "e % 2 ? l2.y : l2.x" in body
    ds_body = re.search(r"wg_dscores_keys\(.*?\n\}", SRC, re.S).group(0)
    assert re.search(r"const int il = ([^;]+);", ds_body).group(1) == il_expr
    assert "reinterpret_cast<const float2*>(delta_t + il)" in ds_body and "e % 2 ? dl.y : dl.x" in ds_body
    assert _call(DKDV, r"wg_dscores_keys<BM>\(st, dpt, (lse2_t \+ BM), t4\)")[0] == "lse2_t + BM"
    j0_expr = _call(DKDV, r"const int j0 = ([^;]+);")[0]
    nw0_expr = _call(DKDV, r"const int nw0 = ([^;]+);")[0]

    rng = np.random.default_rng(hd)
    k, v = rng.standard_normal((bn, hd)), rng.standard_normal((bn, hd))
    q, do = rng.standard_normal((bm, hd)), rng.standard_normal((bm, hd))
    mk, mv, mq, mdo = _store(k, bn), _store(v, bn), _store(q, bm), _store(do, bm)
    lbo, sbo, _, _ = _qk_descs()
    n0, m0 = 128 * 3, 64 * 5   # any tile position
    for wg in range(nwg):
        kw = _eval(kw_expr, {"wg": wg, "SPLIT": env["SPLIT"]})
        assert kw == (0 if env["SPLIT"] else 64 * wg)
        start = kw * 128
        st, dpt = np.zeros((64, bm)), np.zeros((64, bm))
        for kk in range(hd // 16):
            oa, ob = _qk_offsets(kk, a_rows, b_rows)
            st += _read_kmajor(mk, start + oa, sbo, 64) @ _read_kmajor(mq, ob, sbo, bm).T
            dpt += _read_kmajor(mv, start + oa, sbo, 64) @ _read_kmajor(mdo, ob, sbo, bm).T
        k_w, vw = k[kw:kw + 64], v[kw:kw + 64]
        np.testing.assert_allclose(st, k_w @ q.T, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dpt, vw @ do.T, rtol=1e-12, atol=1e-12)
        # P^T / dS^T stand-ins computed per element from the coordinates the kernel uses
        lse, delta = rng.standard_normal(bm), rng.standard_normal(bm)
        p_regs, ds_regs = {}, {}
        for warp in range(4):
            for lane in range(32):
                g, t4 = lane // 4, lane % 4
                nw0 = _eval(nw0_expr, {"n0": n0, "kw": kw})
                j0 = _eval(j0_expr, {"nw0": nw0, "wq": warp, "g": g})
                s_regs, d_regs = _thread_regs(st, warp, lane, bm), _thread_regs(dpt, warp, lane, bm)
                p, ds = np.empty(bm // 2), np.empty(bm // 2)
                for nb in range(bm // 8):
                    il = _eval(il_expr, {"nb": nb, "t4": t4})
                    for e in range(4):
                        i = _eval(q_expr, {"m0": m0, "il": il, "e": e})
                        j = _eval(k_expr, {"j0": j0, "e": e})
                        row, col = _d_coords(warp, lane, 4 * nb + e)
                        assert (j, i) == (nw0 + row, m0 + col), "P^T element coordinates"
                        assert il + e % 2 == i - m0, "the query's lse2 / delta in shared memory"
                        p[4 * nb + e] = np.exp(s_regs[4 * nb + e] * 0.1 - lse[i - m0])
                        ds[4 * nb + e] = p[4 * nb + e] * (d_regs[4 * nb + e] - delta[i - m0])
                p_regs[(warp, lane)], ds_regs[(warp, lane)] = p, ds
        pt = np.exp(st * 0.1 - lse[None, :])
        dst = pt * (dpt - delta[None, :])
        dv, dk = np.zeros((64, hd)), np.zeros((64, hd))
        for kk in range(bm // 16):
            start_b, lbo_b, sbo_b = _pv_desc(kk, bm)
            dv += _a_operand(p_regs, kk) @ _read_mnmajor(mdo, start_b, lbo_b, sbo_b, hd)
            dk += _a_operand(ds_regs, kk) @ _read_mnmajor(mq, start_b, lbo_b, sbo_b, hd)
        np.testing.assert_allclose(dv, pt @ do, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(dk, dst @ q, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("hd", configs.WGMMA_BWD_HEAD_DIMS)
def test_dq_operands_and_coordinates(hd):
    bn, nwg = configs.wgmma_bwd_tile(hd, "dq")
    bm = 64 * nwg
    env = _carve(DQ, {"HD": hd, "BN": bn, "NWG": nwg, "OVERLAP": configs.WGMMA_BWD_OVERLAP})
    assert env["BM"] == bm
    a_rows, b_rows, a_tile, b_tile = _call(DQ, r"wg_qk<T, HD, (\w+), (\w+)>\(sc, opaque_u32\((\w+)\), (\w+)\)")
    assert (a_tile, b_tile) == ("sQw", "sKb") and (env[a_rows], env[b_rows]) == (bm, bn)
    assert _call(DQ, r"wg_qk<T, HD, (\w+), (\w+)>\(dp, opaque_u32\((\w+)\), (\w+)\)") == (a_rows, b_rows, "sdOw", "sVb")
    pv_rows, pv_tile = _call(DQ, r"wg_pv<T, HD, (\w+)>\(dq_acc, da, (\w+)[,)]")
    assert pv_tile == "sKb" and env[pv_rows] == bn
    wg_off = _call(DQ, r"const pa_u32 sQw = sQ \+ ([^,]+), sdOw")[0]
    body = re.search(r"wg_probs_rows\(.*?\n\}", SRC, re.S).group(0)
    r_expr, k_expr = re.search(r"check, s, ([^,]+),\s*([^,]+), scale_log2", body).groups()
    lse_idx = re.search(r"wg_prob\(sc\[4 \* nb \+ e\], lse2\[([^\]]+)\], check", body).group(1)
    ds_body = re.search(r"wg_dscores_rows\(.*?\n\}", SRC, re.S).group(0)
    assert re.search(r"delta_r\[([^\]]+)\]", ds_body).group(1) == lse_idx
    i0_expr = _call(DQ, r"const int i0 = ([^;]+);")[0]
    mw0_expr = _call(DQ, r"const int mw0 = ([^;]+);")[0]

    rng = np.random.default_rng(hd + 1)
    q, k = rng.standard_normal((bm, hd)), rng.standard_normal((bn, hd))
    mq, mk = _store(q, bm), _store(k, bn)
    lbo, sbo, _, _ = _qk_descs()
    m0, n0 = 128 * 2, 64 * 7
    for wg in range(nwg):
        start = _eval(wg_off, {"wg": wg})
        sc = np.zeros((64, bn))
        for kk in range(hd // 16):
            oa, ob = _qk_offsets(kk, bm, bn)
            sc += _read_kmajor(mq, start + oa, sbo, 64) @ _read_kmajor(mk, ob, sbo, bn).T
        np.testing.assert_allclose(sc, q[64 * wg:64 * wg + 64] @ k.T, rtol=1e-12, atol=1e-12)
        ds_regs = {}
        for warp in range(4):
            for lane in range(32):
                g, t4 = lane // 4, lane % 4
                mw0 = _eval(mw0_expr, {"m0": m0, "wg": wg})
                i0 = _eval(i0_expr, {"mw0": mw0, "wq": warp, "g": g})
                regs = _thread_regs(sc, warp, lane, bn)
                for nb in range(bn // 8):
                    for e in range(4):
                        i = _eval(r_expr, {"i0": i0, "e": e})
                        j = _eval(k_expr, {"n0": n0, "nb": nb, "t4": t4, "e": e})
                        row, col = _d_coords(warp, lane, 4 * nb + e)
                        assert (i, j) == (mw0 + row, n0 + col), "S element coordinates"
                        assert _eval(lse_idx, {"e": e}) == (i - i0) // 8, "the row's lse2 / delta register"
                ds_regs[(warp, lane)] = regs * 0.5   # any function of the element: dS stands in
        dq = np.zeros((64, hd))
        for kk in range(bn // 16):
            start_b, lbo_b, sbo_b = _pv_desc(kk, bn)
            dq += _a_operand(ds_regs, kk) @ _read_mnmajor(mk, start_b, lbo_b, sbo_b, hd)
        np.testing.assert_allclose(dq, (sc * 0.5) @ k, rtol=1e-10, atol=1e-10)


_WALKS = ([(hd, ov, False) for hd in configs.WGMMA_BWD_HEAD_DIMS for ov in (False, True)
           if not ov or hd in configs.WGMMA_BWD_OVERLAP_HEAD_DIMS]
          + [(hd, False, True) for hd in configs.WGMMA_BWD_TWO_CTA_CAPABLE])


@pytest.mark.parametrize("role,hd,overlap,two_cta", [(role, *w) for role in ("dkdv", "dq") for w in _WALKS]
                         # the fused-dQ dK/dV, in the modules of either walk (its own walk: serial)
                         + [("dkdv_dq", hd, ov, two) for hd, ov, two in _WALKS
                            if hd in configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS and not two])
def test_shared_memory_carve_and_descriptors(role, hd, overlap, two_cta):
    """Every SW128 region of the kernel's carve-up starts 1024-byte aligned, the regions (and the
    dK/dV kernel's lse2 / delta floats) end within configs.KernelConfig.smem_bytes minus the 1 KB
    alignment slack, and every descriptor the kernel builds fits the PTX ISA bit fields — for both
    walks (``overlap``: three Q / dO and stats buffers in dK/dV, three K buffers in dQ), the
    two-CTA tiles (``two_cta``: 32-row query tiles in dK/dV, 32-key tiles in dQ), HD 256's dQ (one
    V buffer beside two K buffers) and the fused-dQ dK/dV (``dkdv_dq``: the serial walk's two
    buffers whatever the module's walk, then its dS^T tile [keys x BM] before the stats; its
    dQ += dS K descriptors too)."""
    tile, nwg = configs.wgmma_bwd_tile(hd, role, two_cta)
    cfg = configs.KernelConfig("bwd_wgmma", "bfloat16", hd, tile=(int(overlap), int(two_cta)))
    assert role in cfg.kernel_names()
    smem = cfg.smem_bytes(role)
    assert smem <= configs.SMEM_LIMITS[90]
    fused = role == "dkdv_dq"
    bufs = range(3 if overlap and not fused else 2)
    if role.startswith("dkdv"):
        env = _carve(DKDV, {"HD": hd, "BM": tile, "NWG": nwg, "OVERLAP": overlap and not fused, "DQ": fused})
        assert env["QBUFS"] == len(bufs)
        regions = {"sK": env["KV_BYTES"], "sV": env["KV_BYTES"], "sQ": len(bufs) * env["QT_BYTES"],
                   "sdO": len(bufs) * env["QT_BYTES"]}
        if fused:   # dS^T: the CTA's keys x the tile's BM queries, 16-bit
            regions["sdS"] = env["BN"] * tile * 2
        stats = 4 * 2 * len(bufs) * tile   # sL: [QBUFS][lse2 BM | delta BM] floats after sdO (DQ: after sdS)
        kws = [(0 if env["SPLIT"] else 64 * wg) * 128 for wg in range(nwg)]   # SPLIT: both on the same keys
        a_tiles = [env["sK"] + o for o in kws] + [env["sV"] + o for o in kws]
        a_rows, b_rows = env["BN"], tile
        b_tiles = [env["sQ"] + b * env["QT_BYTES"] for b in bufs] + [env["sdO"] + b * env["QT_BYTES"] for b in bufs]
        pv_rows, pv_tiles = tile, b_tiles
    else:
        env = _carve(DQ, {"HD": hd, "BN": tile, "NWG": nwg, "OVERLAP": overlap})
        assert env["KBUFS"] == len(bufs)
        vbufs = range(configs.wgmma_dq_vbufs(hd, tile))   # the kernel's VBUFS, evaluated from its source
        assert env["VBUFS"] == len(vbufs)
        regions = {"sQ": env["Q_BYTES"], "sdO": env["Q_BYTES"], "sK": len(bufs) * env["KV_BYTES"],
                   "sV": len(vbufs) * env["KV_BYTES"]}
        stats = 0
        a_tiles = [env["sQ"] + wg * 64 * 128 for wg in range(nwg)] + [env["sdO"] + wg * 64 * 128 for wg in range(nwg)]
        a_rows, b_rows = env["BM"], tile
        k_tiles = [env["sK"] + b * env["KV_BYTES"] for b in bufs]
        b_tiles = k_tiles + [env["sV"] + b * env["KV_BYTES"] for b in vbufs]
        pv_rows, pv_tiles = tile, k_tiles
    ordered = sorted(regions, key=lambda r: env[r])
    assert env[ordered[0]] == 0
    for a, b in zip(ordered, ordered[1:]):
        assert env[a] + regions[a] == env[b], f"{a} and {b} overlap or leave a gap"
    end = env[ordered[-1]] + regions[ordered[-1]] + stats
    assert end == smem - 1024, (end, smem)
    base = 1024 * 5
    assert all(t % 1024 == 0 for t in a_tiles + b_tiles)
    lbo, sbo, _, _ = _qk_descs()
    descs = []
    for kk in range(hd // 16):
        oa, ob = _qk_offsets(kk, a_rows, b_rows)
        descs += [(base + t + oa, lbo, sbo) for t in a_tiles] + [(base + t + ob, lbo, sbo) for t in b_tiles]
    for kk in range(pv_rows // 16):
        start, lbo_v, sbo_v = _pv_desc(kk, pv_rows)
        descs += [(base + t + start, lbo_v, sbo_v) for t in pv_tiles]
    if fused:   # dQ += dS K: A the dS^T tile, B the K tile from each warpgroup's first dQ column
        assert env["sdS"] % 1024 == 0
        src = _fused_dq_source()
        for wg in range(nwg):
            sk_col = _eval(src["b_tile"], {"sK": env["sK"], "dq_col": _eval(src["dq_col"], {"wg": wg, **env}), **env})
            for kk in range(env["BN"] // 16):
                a, b = _fused_dq_descs(src, kk, env["BN"])
                descs += [(base + env["sdS"] + a[0], *a[1:]), (base + sk_col + b[0], *b[1:])]
    for addr, lb, sb in descs:
        d = _desc(addr, lb, sb)
        assert d & 0x3FFF == addr >> 4 and (d >> 16) & 0x3FFF == lb >> 4 and (d >> 32) & 0x3FFF == sb >> 4
        assert addr < 1 << 18 and addr % 1024 < 128 and d >> 62 == 1


def _fused_dq_source() -> dict:
    """The fused dQ's expressions, from the dK/dV kernel (its calls of store_ds_t, wg_ds_k and
    red_acc_rows) and those three device functions."""
    def fn(name):
        return re.search(rf"void {name}\(.*?\n\}}", SRC, re.S).group(0)

    store, dsk, red = fn("store_ds_t"), fn("wg_ds_k"), fn("red_acc_rows")
    assert "kk < BM / 16" in store and "j < 4" in store and "kk < BN / 16" in dsk
    assert "r < 2" in red and "nb < N / 8" in red and "if (row >= rows_valid) continue;" in red
    out = {}
    out["store_rows"], out["store_base"] = _call(DKDV, r"store_ds_t<(\w+)>\((sdS \+ [^,]+), da, wq, g, t4\)")
    out["n"], out["bn"], out["a_tile"], out["b_tile"] = _call(
        DKDV, r"wg_ds_k<T, (\w+), (\w+)>\(dq_part, opaque_u32\((\w+)\), opaque_u32\((.+?)\)\);")
    out["dq_col"] = _call(DKDV, r"const int dq_col = ([^;]+);")[0]
    out["row_w"] = _call(DKDV, r"row_w = ([^;,]+);")[0]
    out["red"] = _call(DKDV, r"red_acc_rows<(\w+)>\(tok_ptr\(dq_acc, b, dqa_sb, s\.q0 \+ row_w, dqa_ss, h, dqa_sh\) "
                             r"\+ (\w+), dqa_ss, dq_part,\s*([^,]+), ([^,]+), g, t4\)")
    out["r"], out["col"] = _call(store, r"const int r = ([^,]+), col = ([^;]+);")
    out["sw_rows"], out["t4_off"] = _call(store, r'"r"\(sds \+ sw128_offset<(\d+)>\(r, col\) \+ ([^)]+)\), "r"\(da\[kk\]\[j\]\)')
    out["desc"] = _call(dsk, r"wgmma_ss_mn<T, N>\(dq, sw128_desc\(sds \+ ([^,]+), ([^,]+), (\d+)\), "
                             r"sw128_desc\(sk_col \+ ([^,]+), ([^,]+), (\d+)\),\s*([^;]+)\);")
    out["red_row"] = _call(red, r"const int row = ([^;]+);")[0]
    out["red_col"] = _call(red, r"const int col = ([^;]+);")[0]
    out["red_acc"] = _call(red, r"make_float2\(acc\[([^\]]+)\], acc\[([^\]]+)\]\)")
    assert "col < cols_valid" in red and "base + row * row_stride + col" in red
    return out


def _fused_dq_descs(src: dict, kk: int, bn: int):
    """((start, LBO, SBO) of the A = dS^T descriptor relative to the tile, the same of B = K
    relative to the warpgroup's first column), at k16 step kk."""
    a_off, a_lbo, a_sbo, b_off, b_lbo, b_sbo, _ = src["desc"]
    env = {"kk": kk, "BN": bn}
    return ((_eval(a_off, env), _eval(a_lbo, env), int(a_sbo)), (_eval(b_off, env), _eval(b_lbo, env), int(b_sbo)))


@pytest.mark.parametrize("hd", configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS)
def test_fused_dq_operands_and_coordinates(hd):
    """The fused-dQ dK/dV (DQ = true): store_ds_t puts each warpgroup's dS^T A fragments (its 64
    keys x BM queries, acc_to_a_frags' layout) into the SW128 tile sdS [BN keys x BM queries] at its
    first key's row, each element once; wg_ds_k reads that tile as the MN-major A operand (dS:
    queries x keys) and the K tile from the warpgroup's first dQ column as the MN-major B operand,
    the first k-step overwriting the (uninitialised) partial, so each warpgroup's 64 x HD / 2
    partial is dS K over the CTA's keys for its half of the columns; red_acc_rows adds each
    element of the D fragment once into (row, column) of dQ, rows past the sequence and columns
    past the head dim left alone."""
    bm, nwg = configs.wgmma_bwd_tile(hd, "dkdv_dq")
    env = _carve(DKDV, {"HD": hd, "BM": bm, "NWG": nwg, "OVERLAP": False, "DQ": True})
    bn, dq_n = env["BN"], env["DQ_N"]
    assert (bm, nwg) == (64, 2) and bn == configs.wgmma_bwd_keys(hd) == 128 and dq_n * nwg == hd
    src = _fused_dq_source()
    assert env[src["store_rows"]] == bm and int(src["sw_rows"]) == 64
    assert (env[src["n"]], env[src["bn"]], src["a_tile"]) == (dq_n, bn, "sdS")
    assert src["red"] == ("DQ_N", "dq_col", "s.sq - row_w", "head_dim - dq_col")
    kw_expr = _call(DKDV, r"const int kw = ([^;]+);")[0]

    rng = np.random.default_rng(hd + 2)
    dst = rng.standard_normal((bn, bm))   # dS^T: the CTA's keys x the query tile's rows
    k = rng.standard_normal((bn, hd))
    mk = _store(k, bn)                    # the K tile as the kernel loads it
    mds = np.full(bn * bm, np.nan)        # sdS, one element per 2 bytes
    for wg in range(nwg):
        kw = _eval(kw_expr, {"wg": wg, "SPLIT": env["SPLIT"]})
        sds = _eval(src["store_base"], {"sdS": 0, "kw": kw})
        for warp in range(4):
            for lane in range(32):
                g, t4 = lane // 4, lane % 4
                for kk in range(bm // 16):
                    for j in range(4):
                        r, col = _eval(src["r"], {"wq": warp, "g": g, "j": j}), _eval(src["col"], {"kk": kk, "j": j})
                        addr = sds + _sw128_offset(int(src["sw_rows"]), r, col) + _eval(src["t4_off"], {"t4": t4})
                        assert addr % 4 == 0 and col % 8 == 0
                        for half in range(2):   # pack2(lo, hi): lo at the lower address
                            row, kq = _a_coords(warp, lane, j, half)
                            idx = (addr + 2 * half) // 2
                            assert np.isnan(mds[idx]), "two stores to one dS^T element"
                            mds[idx] = dst[kw + row, 16 * kk + kq]
    assert not np.isnan(mds).any()
    parts = []
    for wg in range(nwg):
        dq_col = _eval(src["dq_col"], {"wg": wg, "DQ_N": dq_n})
        sk_col = _eval(src["b_tile"], {"sK": 0, "dq_col": dq_col, "BN": bn})
        part = np.full((64, dq_n), np.nan)   # uninitialised
        for kk in range(bn // 16):
            (a0, a_lbo, a_sbo), (b0, b_lbo, b_sbo) = _fused_dq_descs(src, kk, bn)
            a = _read_mnmajor(mds, a0, a_lbo, a_sbo, bm)              # [16 keys x 64 queries]
            b = _read_mnmajor(mk, sk_col + b0, b_lbo, b_sbo, dq_n)    # [16 keys x dq_n columns]
            np.testing.assert_array_equal(a, dst[16 * kk:16 * kk + 16])
            np.testing.assert_array_equal(b, k[16 * kk:16 * kk + 16, dq_col:dq_col + dq_n])
            part = a.T @ b + (part if _eval(src["desc"][6], {"kk": kk}) else 0)
        np.testing.assert_allclose(part, dst.T @ k[:, dq_col:dq_col + dq_n], rtol=1e-10, atol=1e-10)
        parts.append((dq_col, part))
    assert [c for c, _ in parts] == [dq_n * wg for wg in range(nwg)]
    # the reduction: m0 = 0 (any tile: the rows are relative to it), sq rows of the sequence there
    for sq, head_dim in ((64, hd), (41, hd - 24), (64, 40), (9, 8)):
        out, hits = np.zeros((64, hd)), np.zeros((64, hd), dtype=int)
        for dq_col, part in parts:
            for warp in range(4):
                row_w = _eval(src["row_w"], {"m0": 0, "wq": warp})
                rows_valid, cols_valid = sq - row_w, head_dim - dq_col
                for lane in range(32):
                    g, t4 = lane // 4, lane % 4
                    regs = _thread_regs(part, warp, lane, dq_n)
                    for r in range(2):
                        row = _eval(src["red_row"], {"g": g, "r": r})
                        if row >= rows_valid:
                            continue
                        for nb in range(dq_n // 8):
                            col = _eval(src["red_col"], {"nb": nb, "t4": t4})
                            if col < cols_valid:
                                for h, i_expr in enumerate(src["red_acc"]):
                                    out[row_w + row, dq_col + col + h] += regs[_eval(i_expr, {"nb": nb, "r": r})]
                                    hits[row_w + row, dq_col + col + h] += 1
        want = np.zeros((64, hd), dtype=bool)
        want[:sq, :head_dim] = True
        np.testing.assert_array_equal(hits, want.astype(int))
        np.testing.assert_allclose(out, np.where(want, dst.T @ k, 0), rtol=1e-10, atol=1e-10)


def test_no_overlapped_walk_at_hd_256():
    """The split dK/dV kernel of HD 256 has the serial walk only: a config asking for the
    overlapped one runs it, and its shared memory fits. The fused-dQ dK/dV (HD 64 / 128, not
    at 256) has the serial walk whatever the module's (OVERLAP, the 5th template argument, false;
    DQ, the 6th, true), with two Q / dO buffers and its dS^T tile."""
    for hd in configs.WGMMA_BWD_HEAD_DIMS:
        cfg = configs.KernelConfig("bwd_wgmma", "bfloat16", hd, tile=(1, 0))   # the one-CTA tiles
        assert cfg.bwd_overlap == (hd in configs.WGMMA_BWD_OVERLAP_HEAD_DIMS)
        assert cfg.max_smem_bytes() <= configs.SMEM_LIMITS[90]
        names = cfg.kernel_names()
        *_, overlap, dq = re.fullmatch(r"attn_bwd_dkdv_wgmma<(\w+), (\d+), (\d+), (\d+), (\w+), (\w+)>",
                                       names["dkdv"]).groups()
        assert (overlap, dq) == ("true" if cfg.bwd_overlap else "false", "false")
        assert ("dkdv_dq" in names) == (hd in configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS) == cfg.has_fused_dq
        if cfg.has_fused_dq:
            assert names["dkdv_dq"] == f"attn_bwd_dkdv_wgmma<pa_bf16, {hd}, 64, 2, false, true>"
            serial = configs.KernelConfig("bwd_wgmma", "bfloat16", hd, tile=(0, 0))
            assert names["dkdv_dq"] == serial.kernel_names()["dkdv_dq"]
            assert cfg.smem_bytes("dkdv_dq") == serial.smem_bytes("dkdv_dq") == (
                serial.smem_bytes("dkdv") + configs.wgmma_bwd_keys(hd) * 64 * 2)
    assert 256 not in configs.WGMMA_BWD_OVERLAP_HEAD_DIMS
    assert 256 not in configs.WGMMA_BWD_FUSED_DQ_HEAD_DIMS
