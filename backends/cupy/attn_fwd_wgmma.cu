// portattn CuPy backend: the Hopper (sm_90a) tensor-core forward, wgmma through inline PTX.
//
// attn_fwd_wgmma<T, HD, BN, NWG>  fp16/bf16, padded head dim HD in {64, 128, 256}, no score
//   extras (softcap / ALiBi / bias run attn_fwd_mma); causal (both alignments), window, GQA,
//   varlen, Sq != Sk and Dv != D as attn_fwd_mma, with the same arguments, output and lse layout.
//   One CTA of NWG consumer warpgroups per (tile of 64 NWG query rows, query head, batch);
//   warpgroup w owns rows 64w ... 64w + 63 (warp q of it rows 16q ... 16q + 15, so a row's
//   statistics stay in the 4 lanes of a quad, as in attn_fwd_mma). Q and double-buffered K/V
//   tiles of BN keys sit in shared memory in the SW128 layout (attn_sm90.cuh), filled with
//   cp.async 16-byte copies (zero-filled); per key tile:
//     1. wait for tile n, fence.proxy.async (cp.async writes are generic-proxy writes that
//        wgmma reads), barrier; issue tile n+1 into the other buffer;
//     2. S = Q K^T: HD / 16 wgmma.m64nBNk16 with both operands from shared-memory descriptors;
//     3. scale into base 2, mask only on tiles that cross the causal / window diagonal or the
//        sequence end; online softmax on the accumulator fragment (quad shuffles);
//     4. O += P V: BN / 16 wgmma.m64nHDk16, P re-packed from the S accumulators into A register
//        fragments, V an MN-major descriptor (trans-b).
//   The epilogue is attn_fwd_mma's: O / l (0 for a row with no visible key), lse = (m + log2 l)
//   ln 2 (-inf for such a row), output staged through the warpgroup's own Q rows and stored in
//   16-byte chunks.
//
// attn_wgmma_probe<T, HD, BN>  one warpgroup, for tools/cupy_wgmma_check.py: S = Q K^T and
//   O = T(S) V of one 64-row Q tile and one BN-key tile (contiguous inputs), written in float32,
//   through the same load / descriptor / wgmma helpers; tells a K-major (S) from an MN-major or
//   A-fragment (O) layout mistake; V's descriptor offsets (v_lbo, v_sbo) come from the caller
//   (the kernel's: BN * 128 and 1024).

// Step 3 of a key tile for one thread of a consumer warpgroup: the S accumulator sc (rows row0,
// row0 + 8; keys n0 + 8 nb + 2 t4 + {0, 1}) into base-2 logits, masked when need_mask (the tile
// crosses a boundary); online softmax: new row max m_i, sum l_i (this thread's columns), sc
// overwritten by P, and alpha[r] = 2^(m_old - m_new), the factor O's row r is rescaled by
// (wg_rescale) — not here, so that O may still be the target of an in-flight P V.
template <int BN>
__device__ __forceinline__ void wg_softmax_tile(float* sc, float* m_i, float* l_i, float* alpha, bool need_mask,
                                                const SeqInfo& s, int row0, int n0, int t4, float scale_log2,
                                                int win_left, int win_right) {
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float x = sc[4 * nb + e] * scale_log2;
            if (need_mask) {
                const int i = row0 + (e / 2) * 8, j = n0 + nb * 8 + 2 * t4 + (e % 2);
                if (!is_visible(s, i, j, win_left, win_right)) x = PA_NEG_INF;
            }
            sc[4 * nb + e] = x;
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = m_i[r];
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) mx = fmaxf(mx, fmaxf(sc[4 * nb + 2 * r], sc[4 * nb + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_use = mx == PA_NEG_INF ? 0.f : mx;
        alpha[r] = fast_exp2(m_i[r] - m_use);
        m_i[r] = mx;
        float rowsum = 0.f;
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) {
            const float p0 = fast_exp2(sc[4 * nb + 2 * r] - m_use);
            const float p1 = fast_exp2(sc[4 * nb + 2 * r + 1] - m_use);
            sc[4 * nb + 2 * r] = p0;
            sc[4 * nb + 2 * r + 1] = p1;
            rowsum += p0 + p1;
        }
        l_i[r] = l_i[r] * alpha[r] + rowsum;
    }
}

// O's rows (this thread's: g, g + 8 of its warp) times alpha (wg_softmax_tile's).
template <int HD>
__device__ __forceinline__ void wg_rescale(float* acc, const float* alpha) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int nb = 0; nb < HD / 8; ++nb) {
            acc[4 * nb + 2 * r] *= alpha[r];
            acc[4 * nb + 2 * r + 1] *= alpha[r];
        }
}

// Steps 3 and 4 of a key tile once S = Q K^T (tile rows m0 ... m0 + BM - 1, keys n0 ...) is issued
// into sc: wait for it, base-2 logits masked where the tile crosses a boundary, online softmax
// (wg_softmax_tile), then O += P V with P re-packed from sc into pa (the caller's: declared there,
// the PTX stays that of the kernels this was folded from) and V buffer buf of the SW128 tiles sv
// (BN x HD each), waited for.
template <typename T, int HD, int BM, int BN>
__device__ __forceinline__ void wg_softmax_pv(float* sc, float* acc, float* m_i, float* l_i, pa_u32 (*pa)[4],
                                              pa_u32 sv, int buf, const SeqInfo& s, int m0, int row0, int n0,
                                              int t4, float scale_log2, int win_left, int win_right) {
    wgmma_wait<0>();
    wgmma_fence_acc<BN>(sc);
    const bool need_mask = keys_need_mask(s, m0, BM, n0, BN, win_left, win_right);
    float alpha[2];
    wg_softmax_tile<BN>(sc, m_i, l_i, alpha, need_mask, s, row0, n0, t4, scale_log2, win_left, win_right);
    wg_rescale<HD>(acc, alpha);
    acc_to_a_frags<T, BN>(pa, sc);
    wg_pv<T, HD, BN>(acc, pa, sv + buf * (BN * HD * 2));
    wgmma_wait<0>();
    wgmma_fence_acc<HD>(acc);
}

// The epilogue of one warp (rows lrow0 = 16 q + ... of the tile; this thread's rows lrow, lrow + 8):
// O / l (0 for a row with no visible key), lse = (m + log2 l) ln 2 (-inf for such a row); the
// output is staged through the warp's own rows of the SW128 Q tile (gq, BM rows; no other warp
// reads them any more) and stored in 16-byte chunks.
template <typename T, int HD, int BM>
__device__ __forceinline__ void wg_epilogue(const float* acc, const float* m_i, const float* l_i,
                                            unsigned char* gq, int lrow, int lrow_warp, int m0, int t4, int lane,
                                            const SeqInfo& s, int b, int h, T* __restrict__ o, long long o_sb,
                                            long long o_ss, long long o_sh, float* __restrict__ lse,
                                            long long lse_sb, long long lse_sh, int head_dim_v) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_i[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int lr = lrow + 8 * r, i = m0 + lr;
        if (t4 == 0 && i < s.sq) {
            const float v_lse = (l > 0.f) ? (m_i[r] + fast_log2(l)) * PA_LN2 : PA_NEG_INF;
            lse[row_index(b, h, lse_sb, lse_sh, s, i)] = v_lse;
        }
#pragma unroll
        for (int nb = 0; nb < HD / 8; ++nb)
            *reinterpret_cast<pa_u32*>(gq + sw128_offset<BM>(lr, nb * 8) + 4 * t4) =
                Elem<T>::pack2(acc[4 * nb + 2 * r] * inv, acc[4 * nb + 2 * r + 1] * inv);
    }
    __syncwarp();
    constexpr int CPR = HD / 8;
    for (int c = lane; c < 16 * CPR; c += 32) {
        const int rr = c / CPR, col = (c % CPR) * 8;
        const int lr = lrow_warp + rr, i = m0 + lr;
        if (i < s.sq && col < head_dim_v) {
            T* dst = tok_ptr(o, b, o_sb, s.q0 + i, o_ss, h, o_sh) + col;
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(gq + sw128_offset<BM>(lr, col));
        }
    }
}

// What a walk of attn_fwd_wgmma reads and never changes: the warpgroup's Q rows (sQw), the K / V
// double buffers, the CTA (sequence, K / V rows) and its key tiles [n_first, n_hi), the strides
// and head dims of K / V, this thread's index, the CTA's first row m0 and the thread's row0, its
// column pair t4, scale log2 e and the window. The walks update O (acc), S / P (sc) and the row
// statistics m_i / l_i.
template <typename T>
struct WgWalk {
    pa_u32 sQw, sK, sV;
    const RowCta<T>& cta;
    int n_first, n_hi;
    long long k_ss, v_ss;
    int head_dim, head_dim_v, tid, m0, row0, t4;
    float scale_log2;
    int win_left, win_right;
};

// The serial walk of attn_fwd_wgmma: per key tile, kv_walk_step (tile it landed, tile it + 1
// prefetched into the other buffers), S = Q K^T, softmax, O += P V, each waited for before the next.
template <typename T, int HD, int BM, int BN, int NT>
__device__ __forceinline__ void wg_walk_serial(float* acc, float* sc, float* m_i, float* l_i, const WgWalk<T>& wk) {
    constexpr int KV_BYTES = BN * HD * 2;
    for (int n0 = wk.n_first, it = 0; n0 < wk.n_hi; n0 += BN, ++it) {
        const int buf = it & 1;
        kv_walk_step<T, BN, HD, NT>(wk.sK, wk.sV, KV_BYTES, buf, wk.cta, n0 + BN, wk.n_hi, wk.k_ss, wk.v_ss,
                                    wk.head_dim, wk.head_dim_v, wk.tid);
        wg_qk<T, HD, BM, BN>(sc, wk.sQw, wk.sK + buf * KV_BYTES);
        pa_u32 pa[BN / 16][4];
        wg_softmax_pv<T, HD, BM, BN>(sc, acc, m_i, l_i, pa, wk.sV, buf, wk.cta.s, wk.m0, wk.row0, n0, wk.t4,
                                     wk.scale_log2, wk.win_left, wk.win_right);
    }
}

// The overlapped walk (FA3's intra-warpgroup pipelining): iteration it issues S = Q K^T of tile it
// and, behind it on the tensor cores, O += P V of tile it - 1; the softmax of tile it runs while
// that P V does. V therefore trails K by one tile in the double buffers: at the top of iteration it
// K of tile it and V of tile it - 1 have landed, and the barrier there also says every warpgroup is
// done with K of tile it - 1 and V of tile it - 2, whose buffers then take K of tile it + 1 and V of
// tile it. O is rescaled (and P of tile it packed into pa, P of tile it - 1's registers) only after
// the P V reading them is waited for; the last tile's P V follows the loop. Same products, softmax
// and rescale per tile as the serial walk, in the same order per accumulator.
template <typename T, int HD, int BM, int BN, int NT>
__device__ __forceinline__ void wg_walk_overlap(float* acc, float* sc, float* m_i, float* l_i, const WgWalk<T>& wk) {
    constexpr int KV_BYTES = BN * HD * 2;
    const SeqInfo& s = wk.cta.s;
    pa_u32 pa[BN / 16][4];
    int it = 0;
    for (int n0 = wk.n_first; n0 < wk.n_hi; n0 += BN, ++it) {
        const int buf = it & 1;
        // 1. K of tile it, V of tile it - 1 landed and visible to wgmma; refill the freed buffers
        cta_tiles_landed();
        if (n0 + BN < wk.n_hi)
            load_tile_sw128<T, BN, HD, NT>(wk.sK + (buf ^ 1) * KV_BYTES, wk.cta.k_seq + (n0 + BN) * wk.k_ss, wk.k_ss,
                                           s.sk - (n0 + BN), wk.head_dim, wk.tid);
        if (it > 0)
            load_tile_sw128<T, BN, HD, NT>(wk.sV + buf * KV_BYTES, wk.cta.v_seq + n0 * wk.v_ss, wk.v_ss, s.sk - n0,
                                           wk.head_dim_v, wk.tid);
        cp_async_commit();
        // 2. S = Q K^T of tile it; O += P V of tile it - 1 queued behind it
        wg_qk<T, HD, BM, BN>(sc, wk.sQw, wk.sK + buf * KV_BYTES);
        if (it > 0) {
            wg_pv<T, HD, BN>(acc, pa, wk.sV + (buf ^ 1) * KV_BYTES);
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();
        }
        wgmma_fence_acc<BN>(sc);
        // 3. the softmax of tile it while P V runs (O and pa untouched)
        float alpha[2];
        wg_softmax_tile<BN>(sc, m_i, l_i, alpha, keys_need_mask(s, wk.m0, BM, n0, BN, wk.win_left, wk.win_right), s,
                            wk.row0, n0, wk.t4, wk.scale_log2, wk.win_left, wk.win_right);
        // 4. P V done: only now O and pa are ordinary registers again
        wgmma_wait<0>();
        wgmma_fence_acc<HD>(acc);
        fence_a_frags<BN / 16>(pa);
        wg_rescale<HD>(acc, alpha);
        acc_to_a_frags<T, BN>(pa, sc);
    }
    if (it > 0) {   // O += P V of the last tile (its V: issued in its iteration, or with Q)
        cta_tiles_landed();
        wg_pv<T, HD, BN>(acc, pa, wk.sV + ((it - 1) & 1) * KV_BYTES);
        wgmma_wait<0>();
        wgmma_fence_acc<HD>(acc);
    }
}

// Two CTAs per SM with 64-key tiles at HD 64 (at most 128 registers; configs.WGMMA_TWO_CTA_HEAD_DIMS),
// one elsewhere.
template <typename T, int HD, int BN, int NWG, bool OVERLAP>
__global__ void __launch_bounds__(NWG * 128, (HD <= 64 && BN <= 64) ? 2 : 1)
attn_fwd_wgmma(PA_COMMON_PARAMS, T* __restrict__ o, long long o_sb, long long o_ss, long long o_sh,
               float* __restrict__ lse) {
    constexpr int BM = 64 * NWG;
    constexpr int NT = 128 * NWG;
    constexpr int Q_BYTES = BM * HD * 2;
    constexpr int KV_BYTES = BN * HD * 2;      // one K (or V) buffer
    static_assert(HD % 64 == 0 && HD <= 256, "HD: whole 64-column SW128 blocks, at most 256 (one wgmma N)");
    static_assert(BN % 64 == 0 && BN <= 256, "BN: whole 8-row groups, at most 256 (one wgmma N)");
    static_assert(sizeof(T) == 2, "16-bit elements");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const pa_u32 raw = smem_addr(smem_raw), base = sw128_align(raw);
    unsigned char* gbase = smem_raw + (base - raw);
    const pa_u32 sQ = base;
    const pa_u32 sK = base + Q_BYTES;          // [2][BN x HD]
    const pa_u32 sV = sK + 2 * KV_BYTES;       // [2][BN x HD]

    const WgLane w = wg_lane();
    const int tid = w.tid, wg = w.wg, wq = w.wq, lane = w.lane, g = w.g, t4 = w.t4;
    PA_ROW_TILE_PROLOGUE(BM, BN);
    const float scale_log2 = scale * PA_LOG2E;

    load_tile_sw128<T, BM, HD, NT>(sQ, PA_Q_ROW(s, b, h, m0), q_ss, s.sq - m0, head_dim, tid);
    if (n_first < n_hi) load_kv_sw128<T, BN, HD, NT>(sK, sV, cta, n_first, k_ss, v_ss, head_dim, head_dim_v, tid);
    cp_async_commit();

    float acc[HD / 2];                         // O: n8 block i at 4i + {0,1} (row g), 4i + {2,3} (row g + 8)
    float sc[BN / 2];                          // S, then P, same layout
    zero_floats<HD / 2>(acc);
    zero_floats<BN / 2>(sc);
    float m_i[2] = {PA_NEG_INF, PA_NEG_INF}, l_i[2] = {0.f, 0.f};
    const int lrow = wg * 64 + wq * 16 + g;    // this thread's rows in the tile: lrow, lrow + 8
    const int row0 = m0 + lrow;
    const pa_u32 sQw = sQ + wg * 64 * 128;     // the warpgroup's 64 rows (8-row groups are 1024 B)

    // 1. K/V tiles landed, 2. S = Q K^T, 3. softmax, 4. O += P V: serially or overlapped
    const WgWalk<T> walk{sQw, sK, sV, cta, n_first, n_hi, k_ss, v_ss, head_dim, head_dim_v, tid, m0, row0, t4,
                         scale_log2, win_left, win_right};
    if (OVERLAP)
        wg_walk_overlap<T, HD, BM, BN, NT>(acc, sc, m_i, l_i, walk);
    else
        wg_walk_serial<T, HD, BM, BN, NT>(acc, sc, m_i, l_i, walk);

    // Epilogue. A CTA whose rows see no key skips the loop with its Q copies possibly in flight.
    cp_async_wait_all();
    __syncthreads();
    wg_epilogue<T, HD, BM>(acc, m_i, l_i, gbase, lrow, wg * 64 + wq * 16, m0, t4, lane, s, b, h, o, o_sb, o_ss, o_sh,
                           lse, lse_sb, lse_sh, head_dim_v);
}

template <typename T, int HD, int BN>
__global__ void __launch_bounds__(128, 1)
attn_wgmma_probe(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                 float* __restrict__ s_out, float* __restrict__ o_out, int v_lbo, int v_sbo) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const pa_u32 raw = smem_addr(smem_raw), base = sw128_align(raw);
    const pa_u32 sQ = base, sK = base + 64 * HD * 2, sV = sK + BN * HD * 2;
    const WgLane w = wg_lane();   // one warpgroup
    const int tid = w.tid, wq = w.wq, g = w.g, t4 = w.t4;
    load_tile_sw128<T, 64, HD, 128>(sQ, q, HD, 64, HD, tid);
    load_tile_sw128<T, BN, HD, 128>(sK, k, HD, BN, HD, tid);
    load_tile_sw128<T, BN, HD, 128>(sV, v, HD, BN, HD, tid);
    cp_async_commit();
    cta_tiles_landed();
    float sc[BN / 2], acc[HD / 2];
    zero_floats<BN / 2>(sc);
    zero_floats<HD / 2>(acc);
    wg_qk<T, HD, 64, BN>(sc, sQ, sK);
    wgmma_wait<0>();
    wgmma_fence_acc<BN>(sc);
    const int r0 = wq * 16 + g;
    store_acc_f32<BN>(s_out, sc, r0, t4);
    pa_u32 pa[BN / 16][4];
    acc_to_a_frags<T, BN>(pa, sc);
    wg_pv<T, HD, BN>(acc, pa, sV, 1, (pa_u32)v_lbo, (pa_u32)v_sbo);
    wgmma_wait<0>();
    wgmma_fence_acc<HD>(acc);
    store_acc_f32<HD>(o_out, acc, r0, t4);
}
