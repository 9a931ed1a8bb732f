// portattn CuPy backend: the Hopper (sm_90a) tensor-core backward, wgmma through inline PTX.
//
// The same formulas as attn_bwd_mma.cu (FA2's backward; P = exp2(s log2 e - lse log2 e) from the
// forward's lse, delta_i = dO_i . O_i - dlse_i from attn_bwd_preprocess, dS = P (dP - delta), P and
// dS rounded to T before their matmul, float32 accumulation), without score extras (softcap /
// ALiBi / bias run attn_bwd_*_mma<..., EXTRAS = true>). The softmax scale is applied once, to the
// finished dK and dQ (dS here is the gradient of the scaled score). Deterministic: no atomics,
// every CTA writes only its own rows; causal (both alignments), window, GQA/MQA, varlen, Sq != Sk
// and Dv != D as the mma.sync kernels, with the same arguments.
//
// attn_bwd_dkdv_wgmma<T, HD, BM, NWG>  one CTA of NWG consumer warpgroups per (64 NWG keys, kv
//   head, batch); warpgroup w owns keys 64w ... 64w + 63 of the CTA (warp q of it keys
//   16q ... 16q + 15), so its dK / dV rows never leave it. K and V stay in shared memory (SW128,
//   attn_sm90.cuh); the CTA walks every query head of its GQA group and every BM-row query tile
//   that can see its keys (row_range), Q / dO tiles (SW128) and their rows' lse log2 e / delta
//   double-buffered with cp.async. Per tile and warpgroup (skipped when none of its keys is
//   visible to the tile), four wgmma commit groups, each waited for only when its result is needed
//   (wait_group 1), so that the exponentials run beside dP^T and dS^T beside dV:
//     S^T  = K_w Q^T     wgmma_ss m64nBMk16, A = K (K-major), B = Q (K-major)     (wg_qk)
//     dP^T = V_w dO^T    wgmma_ss, A = V, B = dO                                   (wg_qk)
//     P^T = exp2(S^T scale log2 e - lse2) (wg_probs_keys): the accumulator layout is the
//     A-register layout, so it is re-packed in registers (acc_to_a_frags)
//     dV_w += P^T dO     wgmma_rs m64nHDk16, B = dO MN-major (trans-b)            (wg_pv)
//     dS^T = P^T (dP^T - delta) (wg_dscores_keys), re-packed
//     dK_w += dS^T Q     wgmma_rs, B = Q MN-major                                  (wg_pv)
//   dK is scaled by the softmax scale and both are stored from the accumulators (4-byte pairs).
//   OVERLAP (opt-in, not yet timed on a GPU): dV and dK of a tile are left in flight into the next
//   one, which issues its S^T and dP^T behind them and retires all three with its first
//   wait_group 1; Q / dO (and their stats) then sit in three buffers, so that the one the tile
//   before reads is not refilled while its products run.
//   HD 256 (SPLIT): dK and dV of 64 keys x 256 columns are 256 floats per thread, over the 255
//   registers of one, so the CTA's two warpgroups share its 64 keys and split the outputs:
//   warpgroup 0 issues S^T and accumulates dV, warpgroup 1 issues S^T and dP^T and accumulates dK
//   (five products per tile pair instead of four: S^T twice; each warpgroup holds 128
//   accumulators, as one of HD 128), against 64-row query tiles as below (configs.wgmma_bwd_tile:
//   255 registers; 32-row tiles ran 1.13-1.22 x slower); the serial walk only.
// attn_bwd_dq_wgmma<T, HD, BN, NWG>  one CTA of NWG warpgroups per (64 NWG query rows, head,
//   batch); warpgroup w owns rows 64w ... 64w + 63 (as the forward); Q and dO stay in shared
//   memory, each thread keeps its two rows' lse log2 e and delta in registers, and the visible
//   key tiles (key_range) of BN keys are double-buffered with cp.async:
//     S = Q_w K^T, dP = dO_w V^T (wgmma_ss, wg_qk; P computed while dP runs); dS = P (dP - delta)
//     in registers; dQ_w += dS K (wgmma_rs, B = K MN-major, wg_pv); dQ scaled and stored at the end.
//   OVERLAP (opt-in, not yet timed): dQ += dS K of a tile stays in flight into the next tile, whose
//   first wait_group 1 retires it; K then sits in three buffers (V in two).
//   HD 256 with 64-key tiles (configs.wgmma_bwd_tile): Q, dO (128 KB) and two K buffers leave room
//   for one V buffer (224 KB in all), so the next tile's V is loaded once every warpgroup's dP of
//   this tile retired (a CTA barrier after step 4's first wait), behind P, dS and the dQ product.
// Two CTAs per SM (configs.WGMMA_BWD_TWO_CTA_CAPABLE): at HD 64, 32-row query tiles in dK/dV and
// 32-key tiles in dQ keep both kernels within 128 registers a thread, so __launch_bounds__ asks
// for two CTAs there, one elsewhere.

// Does any (query row, key) pair of rows [m0, m0 + bm) and keys [n0, n0 + bn) (each clipped to its
// sequence) see each other? A warpgroup skips a tile for which this is false.
__device__ __forceinline__ bool tile_any_visible(const SeqInfo& s, int m0, int bm, int n0, int bn, int left,
                                                 int right) {
    const int r_last = min(m0 + bm, s.sq) - 1;
    if (r_last < m0) return false;
    int lo, hi;
    key_range(s, m0, r_last, left, right, &lo, &hi);
    return max(lo, n0) < min(hi, n0 + bn);
}

// P of one accumulator element from its score dot q_i . k_j and the row's lse2 (lse log2 e, +inf
// for a row with no visible key or past the sequence end): exp2(dot scale log2 e - lse2), 0 where
// (i, j) is masked (tested only when `check`: the tile crosses a causal / window / sequence boundary).
__device__ __forceinline__ float wg_prob(float dot, float lse2, bool check, const SeqInfo& s, int i, int j,
                                         float scale_log2, int left, int right) {
    const float p = fast_exp2(dot * scale_log2 - lse2);
    return (check && !is_visible(s, i, j, left, right)) ? 0.f : p;
}

// dK/dV, P stage: S^T (st: one warpgroup's 64 keys x BM queries) into P^T in place. Element 4 nb + e
// is key j0 + 8 (e / 2) (j0: this thread's first key) and query m0 + 8 nb + 2 t4 + e % 2 of the tile,
// whose lse2 sits in shared memory (lse2_t, indexed from the tile's first row).
template <int BM>
__device__ __forceinline__ void wg_probs_keys(float* st, const float* lse2_t, bool check, const SeqInfo& s, int j0,
                                              int m0, int t4, float scale_log2, int left, int right) {
#pragma unroll
    for (int nb = 0; nb < BM / 8; ++nb) {
        const int il = 8 * nb + 2 * t4;
        const float2 l2 = *reinterpret_cast<const float2*>(lse2_t + il);
#pragma unroll
        for (int e = 0; e < 4; ++e)
            st[4 * nb + e] = wg_prob(st[4 * nb + e], e % 2 ? l2.y : l2.x, check, s, m0 + il + e % 2, j0 + 8 * (e / 2),
                                     scale_log2, left, right);
    }
}

// dK/dV, dS stage: dS^T = P^T (dP^T - delta) into dpt (element 4 nb + e: query 8 nb + 2 t4 + e % 2
// of the tile, whose delta sits in shared memory, delta_t). Masked entries have P^T = 0, so dS^T = 0.
template <int BM>
__device__ __forceinline__ void wg_dscores_keys(const float* pt, float* dpt, const float* delta_t, int t4) {
#pragma unroll
    for (int nb = 0; nb < BM / 8; ++nb) {
        const int il = 8 * nb + 2 * t4;
        const float2 dl = *reinterpret_cast<const float2*>(delta_t + il);
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[4 * nb + e] = pt[4 * nb + e] * (dpt[4 * nb + e] - (e % 2 ? dl.y : dl.x));
    }
}

// dQ, P stage: S (sc: one warpgroup's 64 rows x BN keys) into P in place. Element 4 nb + e is row
// i0 + 8 (e / 2) (lse2[e / 2]: this thread's two rows, in registers) and key n0 + 8 nb + 2 t4 + e % 2.
template <int BN>
__device__ __forceinline__ void wg_probs_rows(float* sc, const float* lse2, bool check, const SeqInfo& s, int i0,
                                              int n0, int t4, float scale_log2, int left, int right) {
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            sc[4 * nb + e] = wg_prob(sc[4 * nb + e], lse2[e / 2], check, s, i0 + 8 * (e / 2),
                                     n0 + 8 * nb + 2 * t4 + e % 2, scale_log2, left, right);
}

// dQ, dS stage: dS = P (dP - delta) into dp (element 4 nb + e: row i0 + 8 (e / 2), delta_r[e / 2]).
template <int BN>
__device__ __forceinline__ void wg_dscores_rows(const float* p, float* dp, const float* delta_r) {
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[4 * nb + e] = p[4 * nb + e] * (dp[4 * nb + e] - delta_r[e / 2]);
}

// An opaque copy of a shared-memory address, made inside a loop: the compiler cannot hoist what is
// computed from it (the HD / 16 wgmma descriptors of a loop-invariant K or V tile, 2 registers
// each) out of the loop and keep it live across the accumulators' wgmmas.
__device__ __forceinline__ pa_u32 opaque_u32(pa_u32 x) {
    asm volatile("" : "+r"(x));
    return x;
}

template <int N>
__device__ __forceinline__ void scale_floats(float* x, float f) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] *= f;
}

// Fused dQ (DQ), store stage: a warpgroup's dS^T (da: BM / 16 A fragments of its 64 keys x BM
// queries, rows 16 wq + g and + 8 of the warp) into the SW128 tile sds of [keys x BM queries] at
// its first key row: fragment j of k-step kk holds keys + 8 (j % 2) and queries 16 kk + 8 (j / 2)
// + 2 t4, + 1. The tile is then the MN-major A operand of dQ += dS K (rows = K = keys, columns =
// M = queries). One 4-byte store per fragment; the 8 rows g of a warp fall on 8 swizzle phases, so
// its 32 stores hit 32 banks.
template <int BM>
__device__ __forceinline__ void store_ds_t(pa_u32 sds, pa_u32 (*da)[4], int wq, int g, int t4) {
    static_assert(BM == 64, "the dS^T tile is one 64-column SW128 block");
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = 16 * wq + g + 8 * (j % 2), col = 16 * kk + 8 * (j / 2);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sds + sw128_offset<64>(r, col) + 4 * t4), "r"(da[kk][j])
                         : "memory");
        }
}

// Fused dQ, product stage: one warpgroup's dq[64 x N] = dS[64 x BN] K[BN x N] (issued and
// committed), A = the dS^T tile sds ([BN keys x 64 queries], MN-major) and B = the K tile ([BN
// keys x HD], MN-major) from column sk_col on, N columns of it. The first k-step ignores dq's
// values (dq is a fresh partial per query tile).
template <typename T, int N, int BN>
__device__ __forceinline__ void wg_ds_k(float* dq, pa_u32 sds, pa_u32 sk_col) {
    wgmma_fence_acc<N>(dq);   // the previous tile's reads of dq (its reductions) come first
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
        wgmma_ss_mn<T, N>(dq, sw128_desc(sds + kk * 2048, 64 * 128, 1024), sw128_desc(sk_col + kk * 2048, BN * 128, 1024),
                          kk > 0 ? 1 : 0);
    wgmma_commit();
}

// Fused dQ, reduction stage: a warp's 16 rows x N columns of a dQ partial (the m64nNk16 layout)
// added into the float32 accumulator (row_stride floats between rows; base at the warp's first row
// and the partial's first column), rows < rows_valid and columns < cols_valid (a multiple of 8):
// one float2 atomic add per element pair, so the sum's order is the order the CTAs arrive in.
template <int N>
__device__ __forceinline__ void red_acc_rows(float* base, long long row_stride, const float* acc, int rows_valid,
                                             int cols_valid, int g, int t4) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        if (row >= rows_valid) continue;
#pragma unroll
        for (int nb = 0; nb < N / 8; ++nb) {
            const int col = 8 * nb + 2 * t4;
            if (col < cols_valid)
                atomicAdd(reinterpret_cast<float2*>(base + row * row_stride + col),
                          make_float2(acc[4 * nb + 2 * r], acc[4 * nb + 2 * r + 1]));
        }
    }
}

// Q and dO rows M0 ... M0 + BM - 1 of head H into the SW128 tiles SQ / SDO (zero-filled past the
// sequence and the head dims) and their rows' lse2 / delta into SL (load_row_stats).
#define PA_DKDV_WG_LOAD_QUERY_TILE(SQ, SDO, SL, H, M0)                                                             \
    do {                                                                                                          \
        load_tile_sw128<T, BM, HD, NT>(SQ, PA_Q_ROW(s, b, H, M0), q_ss, s.sq - (M0), head_dim, tid);               \
        load_tile_sw128<T, BM, HD, NT>(SDO, PA_DO_ROW(s, b, H, M0), do_ss, s.sq - (M0), head_dim_v, tid);          \
        load_row_stats<BM, NT>(SL, lse, delta, lse_sb, lse_sh, s, b, H, M0, tid);                                  \
    } while (0)

template <typename T, int HD, int BM, int NWG, bool OVERLAP, bool DQ>
__global__ void __launch_bounds__(NWG * 128, (HD <= 64 && BM <= 32) ? 2 : 1)
attn_bwd_dkdv_wgmma(PA_COMMON_PARAMS, const T* __restrict__ dout, long long do_sb, long long do_ss, long long do_sh,
                    const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk,
                    long long dk_sb, long long dk_ss, long long dk_sh, T* __restrict__ dv, long long dv_sb,
                    long long dv_ss, long long dv_sh, float* __restrict__ dq_acc, long long dqa_sb, long long dqa_ss,
                    long long dqa_sh) {
    constexpr bool SPLIT = HD > 128;           // warpgroup 0 dV, 1 dK of the same 64 keys (header)
    constexpr int BN = SPLIT ? 64 : 64 * NWG;  // keys per CTA, 64 per warpgroup (SPLIT: 64)
    constexpr int NT = 128 * NWG;
    constexpr int KV_BYTES = BN * HD * 2;      // the K (or V) tile
    constexpr int QT_BYTES = BM * HD * 2;      // one Q (or dO) buffer
    constexpr int QBUFS = 2 + OVERLAP;         // Q / dO / stats buffers: 3 with OVERLAP
    static_assert(HD % 64 == 0 && HD <= 256, "HD: whole 64-column SW128 blocks, at most 256 (one wgmma N)");
    static_assert(!SPLIT || (NWG == 2 && !OVERLAP), "HD > 128: two warpgroups, one per output; serial walk");
    static_assert(BM % 32 == 0 && BM <= 256, "BM: whole 16-row k-steps and 8-row groups, at most 256 (one wgmma N)");
    static_assert(sizeof(T) == 2, "16-bit elements");
    static_assert(!DQ || (!SPLIT && !OVERLAP && NWG == 2 && BM == 64), "fused dQ: HD <= 128, serial walk, 64-row tiles");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const pa_u32 raw = smem_addr(smem_raw), base = sw128_align(raw);
    const pa_u32 sK = base;
    const pa_u32 sV = sK + KV_BYTES;
    const pa_u32 sQ = sV + KV_BYTES;               // [QBUFS][BM x HD]
    const pa_u32 sdO = sQ + QBUFS * QT_BYTES;      // [QBUFS][BM x HD]
    const pa_u32 sdS = sdO + QBUFS * QT_BYTES;     // DQ: dS^T [BN keys x BM queries] (SW128; 1024-aligned)
    // [QBUFS][lse2 BM | delta BM]
    float* sL = reinterpret_cast<float*>(smem_raw + (sdS + (DQ ? BN * BM * 2 : 0) - raw));

    const WgLane w = wg_lane();
    const int tid = w.tid, wg = w.wg, wq = w.wq, g = w.g, t4 = w.t4;
    PA_KEY_CTA_PROLOGUE(BN);
    const float scale_log2 = scale * PA_LOG2E;

    // K and V (resident for the whole walk) and the first query tile (the walk: QueryTileWalk).
    load_tile_sw128<T, BN, HD, NT>(sK, cta.k_tile, k_ss, s.sk - n0, head_dim, tid);
    load_tile_sw128<T, BN, HD, NT>(sV, cta.v_tile, v_ss, s.sk - n0, head_dim_v, tid);
    const QueryTileWalk<BM> walk(hk, gqa_ratio, cta.r_lo, cta.r_hi);
    const int n_iter = walk.n_iter;
    if (n_iter > 0) PA_DKDV_WG_LOAD_QUERY_TILE(sQ, sdO, sL, walk.h_first, walk.m_first);
    cp_async_commit();

    // rows (keys) g, g + 8 of the warp's 16, as the forward's O; SPLIT: one array, the warpgroup's output
    float dk_own[SPLIT ? 1 : HD / 2], dv_acc[HD / 2];
    float* const dk_acc = SPLIT ? dv_acc : dk_own;
    const bool has_dv = !SPLIT || wg == 0, has_dk = !SPLIT || wg == 1;   // uniform per warpgroup
    if (!OVERLAP) {                            // OVERLAP: set by the first products (acc_in 0), or zeroed after
        zero_floats<HD / 2>(dk_acc);
        if (!SPLIT) zero_floats<HD / 2>(dv_acc);
    }
    int acc_in = 0;                            // a dV / dK product has been issued
    const int kw = SPLIT ? 0 : wg * 64;        // the warpgroup's first key in the CTA
    const int nw0 = n0 + kw;                   // ... in the sequence
    const int j0 = nw0 + wq * 16 + g;          // this thread's keys: j0, j0 + 8
    const pa_u32 sKw = sK + kw * 128, sVw = sV + kw * 128;   // 8-row groups are 1024 B
    pa_u32 pa[BM / 16][4], da[BM / 16][4];     // P^T and dS^T as A fragments (OVERLAP: read into the next tile)
    // S^T and dP^T of a tile (the first k-step of each chain ignores them: scale-d 0). OVERLAP zeroes
    // them once, here: a mov into a chain's accumulators while the tile before's dV / dK run makes
    // ptxas serialize every wgmma (C7515).
    float st[BM / 2], dpt[BM / 2];
    if (OVERLAP) {
        zero_floats<BM / 2>(st);
        zero_floats<BM / 2>(dpt);
    }
    constexpr int DQ_N = HD / 2;   // DQ: the warpgroup's half of a query tile's dQ (64 rows x HD / 2 columns)

    for (int it = 0; it < n_iter; ++it) {
        const int buf = OVERLAP ? it % QBUFS : it & 1, nxt = OVERLAP ? (it + 1) % QBUFS : buf ^ 1;
        const int m0 = walk.row0(it);
        // 1. tile `it` landed (this thread's copies), visible to the async proxy; every thread's
        //    copies done and every warpgroup finished with the buffer of tile it + 1 - QBUFS (whose
        //    products the tile before retired): prefetch it + 1 into it.
        cta_tiles_landed();
        if (it + 1 < n_iter) {
            const int h1 = walk.head(it + 1), m1 = walk.row0(it + 1);
            PA_DKDV_WG_LOAD_QUERY_TILE(sQ + nxt * QT_BYTES, sdO + nxt * QT_BYTES, sL + nxt * 2 * BM, h1, m1);
            cp_async_commit();
        }
        // uniform per warpgroup (DQ: per CTA, both warpgroups meet at the dS^T barrier below)
        if (DQ ? !tile_any_visible(s, m0, BM, n0, BN, win_left, win_right)
               : !tile_any_visible(s, m0, BM, nw0, 64, win_left, win_right)) {
            if (OVERLAP) wgmma_wait<0>();      // the tile before's dV / dK, before its buffer is refilled
            continue;
        }
        const pa_u32 sQb = sQ + buf * QT_BYTES, sdOb = sdO + buf * QT_BYTES;
        const float* lse2_t = sL + buf * 2 * BM;

        // 2. S^T = K_w Q^T and dP^T = V_w dO^T (64 keys x BM queries), two commit groups (SPLIT:
        //    dP^T by warpgroup 1 only)
        if (!OVERLAP) {
            zero_floats<BM / 2>(st);
            zero_floats<BM / 2>(dpt);
        }
        wg_qk<T, HD, BN, BM>(st, opaque_u32(sKw), sQb);
        // 3. S^T landed (dP^T may still run; OVERLAP: the tile before's dV / dK retired too, so
        //    pa / da are ordinary registers again): P^T in place (masked only where the tile
        //    crosses a boundary), re-packed as A fragments; dV_w += P^T dO issued
        if (has_dk) {
            wg_qk<T, HD, BN, BM>(dpt, opaque_u32(sVw), sdOb);
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();                   // SPLIT, warpgroup 0: S^T is its only group
        }
        wgmma_fence_acc<BM>(st);
        if (OVERLAP) {
            fence_a_frags<BM / 16>(pa);
            fence_a_frags<BM / 16>(da);
        }
        const bool check = tile_needs_mask(s, m0, BM, nw0, 64, win_left, win_right);
        wg_probs_keys<BM>(st, lse2_t, check, s, j0, m0, t4, scale_log2, win_left, win_right);
        if (has_dv) {
            acc_to_a_frags<T, BM>(pa, st);
            wg_pv<T, HD, BM>(dv_acc, pa, sdOb, OVERLAP ? acc_in : 1);
        }

        // 4. dP^T landed (dV may still run): dS^T in place, re-packed; dK_w += dS^T Q issued
        if (has_dk) {
            if (SPLIT) wgmma_wait<0>();        // SPLIT, warpgroup 1: dP^T is its only group
            else wgmma_wait<1>();
            wgmma_fence_acc<BM>(dpt);
            wg_dscores_keys<BM>(st, dpt, lse2_t + BM, t4);
            acc_to_a_frags<T, BM>(da, dpt);
            if constexpr (DQ) store_ds_t<BM>(sdS + kw * 128, da, wq, g, t4);
            wg_pv<T, HD, BM>(dk_acc, da, sQb, OVERLAP ? acc_in : 1);
        }
        // 5. DQ (dV and dK may still run): both warpgroups' dS^T stored and visible to wgmma; the
        //    warpgroup's dQ columns of the tile, dS (all BN keys) K, reduced into dq_acc with
        //    float2 atomics once they land (dq_acc is scaled and rounded after the kernel).
        if constexpr (DQ) {
            wgmma_wait<1>();   // dV retired (dK still runs): P^T's fragments free for dQ's accumulators
            fence_proxy_async();
            __syncthreads();
            // a fresh partial per tile, set by the chain's first product (scale-d 0): declared here,
            // not zeroed (no mov into it while dK runs, and not live across the walk)
            float dq_part[DQ_N / 2];
            const int dq_col = wg * DQ_N;   // K's columns dq_col ... (opaque: see wg_qk's)
            wg_ds_k<T, DQ_N, BN>(dq_part, opaque_u32(sdS), opaque_u32(sK + (dq_col / 64) * (BN * 128) + (dq_col % 64) * 2));
            wgmma_wait<0>();
            wgmma_fence_acc<DQ_N>(dq_part);
            const int h = walk.head(it), row_w = m0 + wq * 16;
            red_acc_rows<DQ_N>(tok_ptr(dq_acc, b, dqa_sb, s.q0 + row_w, dqa_ss, h, dqa_sh) + dq_col, dqa_ss, dq_part,
                               s.sq - row_w, head_dim - dq_col, g, t4);
        }
        acc_in = 1;
        if (!OVERLAP) {
            wgmma_wait<0>();
            wgmma_fence_acc<HD>(dv_acc);
            if (!SPLIT) wgmma_fence_acc<HD>(dk_acc);
        }
    }
    if (OVERLAP) {   // the last tile's dV / dK; keys that no query saw get 0
        wgmma_wait<0>();
        wgmma_fence_acc<HD>(dv_acc);
        wgmma_fence_acc<HD>(dk_acc);
        if (!acc_in) {
            zero_floats<HD / 2>(dk_acc);
            zero_floats<HD / 2>(dv_acc);
        }
    }
    cp_async_wait_all();   // a CTA with no query tile still has its K/V copies in flight

    // Epilogue: the warp's 16 keys of dK (times the softmax scale) and dV; keys past the
    // sequence end and columns past the head dims are not stored.
    const int key_w = nw0 + wq * 16;
    if (has_dk) {
        scale_floats<HD / 2>(dk_acc, scale);
        store_acc_rows<T, HD / 8>(tok_ptr(dk, b, dk_sb, s.k0 + key_w, dk_ss, hk, dk_sh), dk_ss,
                                  reinterpret_cast<const float (*)[4]>(dk_acc), s.sk - key_w, 0, head_dim, g, t4);
    }
    if (has_dv)
        store_acc_rows<T, HD / 8>(tok_ptr(dv, b, dv_sb, s.k0 + key_w, dv_ss, hk, dv_sh), dv_ss,
                                  reinterpret_cast<const float (*)[4]>(dv_acc), s.sk - key_w, 0, head_dim_v, g, t4);
}

template <typename T, int HD, int BN, int NWG, bool OVERLAP>
__global__ void __launch_bounds__(NWG * 128, (HD <= 64 && BN <= 32) ? 2 : 1)
attn_bwd_dq_wgmma(PA_COMMON_PARAMS, const T* __restrict__ dout, long long do_sb, long long do_ss, long long do_sh,
                  const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, long long dq_sb,
                  long long dq_ss, long long dq_sh) {
    constexpr int BM = 64 * NWG;               // query rows per CTA, 64 per warpgroup
    constexpr int NT = 128 * NWG;
    constexpr int Q_BYTES = BM * HD * 2;       // the Q (or dO) tile
    constexpr int KV_BYTES = BN * HD * 2;      // one K (or V) buffer
    constexpr int KBUFS = 2 + OVERLAP;         // K buffers (3 with OVERLAP)
    constexpr int VBUFS = (HD > 128 && BN > 32) ? 1 : 2;   // V buffers: one where two would not fit
    static_assert(HD % 64 == 0 && HD <= 256, "HD: whole 64-column SW128 blocks, at most 256 (one wgmma N)");
    static_assert(BN % 32 == 0 && BN <= 256, "BN: whole 16-key k-steps and 8-row groups, at most 256 (one wgmma N)");
    static_assert(sizeof(T) == 2, "16-bit elements");
    static_assert(VBUFS == 2 || !OVERLAP, "one V buffer: the serial walk only");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const pa_u32 raw = smem_addr(smem_raw), base = sw128_align(raw);
    const pa_u32 sQ = base;
    const pa_u32 sdO = sQ + Q_BYTES;
    const pa_u32 sK = sdO + Q_BYTES;           // [KBUFS][BN x HD]
    const pa_u32 sV = sK + KBUFS * KV_BYTES;   // [VBUFS][BN x HD]

    const WgLane w = wg_lane();
    const int tid = w.tid, wg = w.wg, wq = w.wq, g = w.g, t4 = w.t4;
    PA_ROW_TILE_PROLOGUE(BM, BN);
    const float scale_log2 = scale * PA_LOG2E;

    // Q and dO rows (resident) and the first K/V tile.
    load_tile_sw128<T, BM, HD, NT>(sQ, PA_Q_ROW(s, b, h, m0), q_ss, s.sq - m0, head_dim, tid);
    load_tile_sw128<T, BM, HD, NT>(sdO, PA_DO_ROW(s, b, h, m0), do_ss, s.sq - m0, head_dim_v, tid);
    if (n_first < n_hi) load_kv_sw128<T, BN, HD, NT>(sK, sV, cta, n_first, k_ss, v_ss, head_dim, head_dim_v, tid);
    cp_async_commit();

    const int mw0 = m0 + wg * 64;              // the warpgroup's first row
    const int i0 = mw0 + wq * 16 + g;          // this thread's rows: i0, i0 + 8
    float lse2[2], delta_r[2];
    load_row_stats2(lse2, delta_r, lse, delta, lse_sb, lse_sh, s, b, h, i0);
    float dq_acc[HD / 2];                      // OVERLAP: set by the first dQ product (acc_in 0), or zeroed after
    if (!OVERLAP) zero_floats<HD / 2>(dq_acc);
    int acc_in = 0;                            // a dQ product has been issued
    const pa_u32 sQw = sQ + wg * 64 * 128, sdOw = sdO + wg * 64 * 128;
    pa_u32 da[BN / 16][4];                     // dS as A fragments (OVERLAP: read into the next tile)
    float sc[BN / 2], dp[BN / 2];              // S and dP of a tile (zeroed once with OVERLAP: see dK/dV's st)
    if (OVERLAP) {
        zero_floats<BN / 2>(sc);
        zero_floats<BN / 2>(dp);
    }

    for (int n0 = n_first, it = 0; n0 < n_hi; n0 += BN, ++it) {
        const int kb = it % KBUFS, vb = VBUFS == 2 ? (it & 1) : 0;
        // 1. tile n landed and is visible to wgmma; every warpgroup is done with the V buffer of
        //    tile n - BN and the K buffer of tile n + BN - KBUFS BN (whose dQ product the tile
        //    before retired): tile n + BN prefetched into them (one V buffer: its V in step 4).
        cta_tiles_landed();
        if (n0 + BN < n_hi) {
            load_tile_sw128<T, BN, HD, NT>(sK + ((it + 1) % KBUFS) * KV_BYTES, cta.k_seq + (n0 + BN) * k_ss, k_ss,
                                           s.sk - (n0 + BN), head_dim, tid);
            if (VBUFS == 2)
                load_tile_sw128<T, BN, HD, NT>(sV + (vb ^ 1) * KV_BYTES, cta.v_seq + (n0 + BN) * v_ss, v_ss,
                                               s.sk - (n0 + BN), head_dim_v, tid);
            cp_async_commit();
        }
        const bool visible = tile_any_visible(s, mw0, 64, n0, BN, win_left, win_right);   // uniform per warpgroup
        if (VBUFS == 2 && !visible) {
            if (OVERLAP) wgmma_wait<0>();      // the tile before's dQ, before its K buffer is refilled
            continue;
        }
        const pa_u32 sKb = sK + kb * KV_BYTES, sVb = sV + vb * KV_BYTES;

        if (visible) {
            // 2. S = Q_w K^T and dP = dO_w V^T (64 rows x BN keys), two commit groups
            if (!OVERLAP) {
                zero_floats<BN / 2>(sc);
                zero_floats<BN / 2>(dp);
            }
            wg_qk<T, HD, BM, BN>(sc, opaque_u32(sQw), sKb);
            wg_qk<T, HD, BM, BN>(dp, opaque_u32(sdOw), sVb);

            // 3. S landed (dP may still run; OVERLAP: the tile before's dQ too, so da is an
            //    ordinary register again): P in place
            wgmma_wait<1>();
            wgmma_fence_acc<BN>(sc);
            if (OVERLAP) fence_a_frags<BN / 16>(da);
            const bool check = tile_needs_mask(s, mw0, 64, n0, BN, win_left, win_right);
            wg_probs_rows<BN>(sc, lse2, check, s, i0, n0, t4, scale_log2, win_left, win_right);

            // 4. dP landed (this warpgroup is done with V)
            wgmma_wait<0>();
            wgmma_fence_acc<BN>(dp);
        }
        if (VBUFS == 1) {   // every warpgroup is done with V: tile n + BN's V into its one buffer
            __syncthreads();
            if (n0 + BN < n_hi) {
                load_tile_sw128<T, BN, HD, NT>(sV, cta.v_seq + (n0 + BN) * v_ss, v_ss, s.sk - (n0 + BN), head_dim_v,
                                               tid);
                cp_async_commit();
            }
            if (!visible) continue;
        }
        //    dS in place, re-packed as A fragments; dQ_w += dS K (K read MN-major)
        wg_dscores_rows<BN>(sc, dp, delta_r);
        acc_to_a_frags<T, BN>(da, dp);
        wg_pv<T, HD, BN>(dq_acc, da, sKb, OVERLAP ? acc_in : 1);
        acc_in = 1;
        if (!OVERLAP) {
            wgmma_wait<0>();
            wgmma_fence_acc<HD>(dq_acc);
        }
    }
    if (OVERLAP) {   // the last tile's dQ; rows that saw no key get 0
        wgmma_wait<0>();
        wgmma_fence_acc<HD>(dq_acc);
        if (!acc_in) zero_floats<HD / 2>(dq_acc);
    }
    cp_async_wait_all();   // a CTA whose rows see no key still has its Q/dO copies in flight

    scale_floats<HD / 2>(dq_acc, scale);
    const int row_w = mw0 + wq * 16;
    store_acc_rows<T, HD / 8>(tok_ptr(dq, b, dq_sb, s.q0 + row_w, dq_ss, h, dq_sh), dq_ss,
                              reinterpret_cast<const float (*)[4]>(dq_acc), s.sq - row_w, 0, head_dim, g, t4);
}
