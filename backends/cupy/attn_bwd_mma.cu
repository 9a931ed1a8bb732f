// portattn CuPy backend: FlashAttention-2 backward on tensor cores (fp16/bf16, mma.sync m16n8k16).
//
// FA2 notation, one (batch, query head) pair, natural-log logits s_ij (score_nat's chain:
// scale, softcap, ALiBi, bias), lse_i from the forward, delta_i = dO_i . O_i from
// attn_bwd_preprocess (attn_bwd.cu):
//   P_ij  = exp(s_ij - lse_i)               evaluated as exp2(s_ij log2 e - lse_i log2 e); 0 for a
//                                           row with lse = -inf (no visible key) or a masked (i, j)
//   dP_ij = dO_i . v_j
//   dS_ij = P_ij (dP_ij - delta_i) * scale * (1 - tanh^2)    (the last factor only with softcap):
//                                           the gradient of the raw dot product q_i . k_j
//   dV_j = sum_i P_ij dO_i,   dK_j = sum_i dS_ij q_i,   dQ_i = sum_j dS_ij k_j
// These are exactly the FMA kernels' formulas (attn_bwd.cu, 16-bit branch); only the matmuls
// move to tensor cores: P and dS are rounded to T before their mma, as in FA2.
//
// attn_bwd_dkdv_mma<T, HD, NWARPS, BM, NSPLIT, EXTRAS>: one CTA per (BN = 16*NWARPS/NSPLIT
//   keys, kv head, batch); with NSPLIT = 1 warp w owns keys 16w..16w+15, so its dK/dV rows never
//   leave it (NSPLIT = 2, above HD 128: a warp pair shares 16 keys and splits the head dim, see
//   the kernel). K and V stay in
//   shared memory; the CTA walks every query head of its GQA group and every BM-row query tile
//   that can see its keys (row_range), Q/dO tiles double-buffered with cp.async. Per tile a warp
//   computes the transposed products, so that P^T and dS^T come out of the accumulators as the
//   A operand of the next mma:
//     S^T  = K_w Q^T      (A: K rows, ldmatrix; B: Q stored [query][d], ldmatrix)
//     dP^T = V_w dO^T     (A: V rows;            B: dO stored [query][d], ldmatrix)
//     dV_w += P^T dO      (A: P^T re-packed;     B: dO stored [query][d], ldmatrix.trans)
//     dK_w += dS^T Q      (A: dS^T re-packed;    B: Q, ldmatrix.trans)
// attn_bwd_dq_mma<T, HD, NWARPS, BN, EXTRAS>: one CTA per (BM = 16*NWARPS query rows, head,
//   batch), warp w owns rows 16w..16w+15; Q and dO stay in shared memory; the visible key tiles
//   (key_range) of BN keys are double-buffered with cp.async:
//     S = Q_w K^T, dP = dO_w V^T (B operands: K, V stored [key][d], ldmatrix),
//     dQ_w += dS K (A: dS re-packed; B: K, ldmatrix.trans).
// Deterministic: no atomics; every CTA writes only its own rows. HD is the padded head dim
// (multiple of 16); the tails of q/k/v/dO are zero-filled by the copies and never stored.

#define PA_POS_INF __int_as_float(0x7f800000)

// lse_i in base 2 as the kernels subtract it: +inf for a row that has no visible key or lies
// past the sequence end, so that P = exp2(x - lse2) is exactly 0 there (also for x = -inf).
__device__ __forceinline__ float lse_log2(const float* lse, long long idx, bool valid) {
    const float l = valid ? lse[idx] : PA_NEG_INF;
    return l == PA_NEG_INF ? PA_POS_INF : l * PA_LOG2E;
}

// P_ij and dS_ij (the gradient of the raw dot q_i . k_j) for one accumulator element.
// `check` = the tile crosses a mask or sequence boundary (EXTRAS always checks, since the bias
// may only be read inside the sequence).
template <bool EXTRAS>
__device__ __forceinline__ void grad_entry_mma(float dot, float dp, float lse2, float delta_i, const ScoreMods& mods,
                                               float scale_log2, const SeqInfo& s, int i, int j, bool check,
                                               int left, int right, float* p_out, float* ds_out) {
    if ((EXTRAS || check) && !is_visible(s, i, j, left, right)) {
        *p_out = 0.f;
        *ds_out = 0.f;
        return;
    }
    float x2, dfac = mods.scale;
    if (EXTRAS) {
        float th = 0.f;
        x2 = score_nat(dot, mods, s, i, j, &th) * PA_LOG2E;
        if (mods.softcap > 0.f) dfac *= 1.f - th * th;
    } else {
        x2 = dot * scale_log2;
    }
    const float p = fast_exp2(x2 - lse2);
    *p_out = p;
    *ds_out = p * (dp - delta_i) * dfac;
}

// Does any (query row, key) pair of the tile rows [m0, m0+bm) x keys [n0, n0+bn) need masking
// (causal / window boundary, key or query sequence end)? The forward's test plus the row end.
__device__ __forceinline__ bool tile_needs_mask(const SeqInfo& s, int m0, int bm, int n0, int bn, int left, int right) {
    return (m0 + bm > s.sq) || keys_need_mask(s, m0, bm, n0, bn, left, right);
}

// Store a warp's 16 x HD float accumulator (rows g and g + 8 of each n8 tile) as T pairs:
// rows < rows_valid, columns < cols_valid (a multiple of 8, so a pair never straddles it).
// The accumulator holds columns col0 + [0, 8 * NT_D) of the rows.
template <typename T, int NT_D>
__device__ __forceinline__ void store_acc_rows(T* base, long long row_stride, const float (*acc)[4], int rows_valid,
                                               int col0, int cols_valid, int g, int t4) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        if (row >= rows_valid) continue;
#pragma unroll
        for (int dt = 0; dt < NT_D; ++dt) {
            const int col = col0 + dt * 8 + 2 * t4;
            if (col < cols_valid)
                *reinterpret_cast<pa_u32*>(base + row * row_stride + col) =
                    Elem<T>::pack2(acc[dt][2 * r], acc[dt][2 * r + 1]);
        }
    }
}

// lse2 (lse_log2) and delta of a thread's two accumulator rows i0 and i0 + 8 of head h into
// registers (the dQ kernels; +inf and 0 past the sequence end).
__device__ __forceinline__ void load_row_stats2(float* lse2, float* delta_r, const float* lse, const float* delta,
                                                long long lse_sb, long long lse_sh, const SeqInfo& s, int b, int h,
                                                int i0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = i0 + 8 * r;
        const long long idx = row_index(b, h, lse_sb, lse_sh, s, i);
        lse2[r] = lse_log2(lse, idx, i < s.sq);
        delta_r[r] = i < s.sq ? delta[idx] : 0.f;
    }
}

// ----- dK, dV --------------------------------------------------------------------------------
// Issue the copies of one query tile (Q, dO rows m0..m0+BM-1 of head h) into buffer `buf`, and
// write its rows' lse2 / delta into shared memory (plain stores, visible after the next barrier);
// the macro reads the kernel's parameters and prologue (s, b, tid).
template <int BM, int NT>
__device__ __forceinline__ void load_row_stats(float* sL, const float* lse, const float* delta, long long lse_sb,
                                               long long lse_sh, const SeqInfo& s, int b, int h, int m0, int tid) {
    for (int r = tid; r < BM; r += NT) {
        const bool ok = m0 + r < s.sq;
        const long long idx = row_index(b, h, lse_sb, lse_sh, s, m0 + r);
        sL[r] = lse_log2(lse, idx, ok);
        sL[BM + r] = ok ? delta[idx] : 0.f;
    }
}
#define PA_DKDV_LOAD_QUERY_TILE(SQ, SDO, SL, H, M0)                                                               \
    do {                                                                                                          \
        load_tile_async<T, BM, HD, LDS, NT>(SQ, PA_Q_ROW(s, b, H, M0), q_ss, s.sq - (M0), head_dim, tid);          \
        load_tile_async<T, BM, HD, LDS, NT>(SDO, PA_DO_ROW(s, b, H, M0), do_ss, s.sq - (M0), head_dim_v, tid);     \
        load_row_stats<BM, NT>(SL, lse, delta, lse_sb, lse_sh, s, b, H, M0, tid);                                  \
    } while (0)

// Warps 2p and 2p + 1 (NSPLIT = 2) each hold a partial S^T / dP^T of the same 16 keys x BM
// queries, summed over their own half of the head dim: swap the partials through shared memory
// (fragment order, lane-indexed: conflict-free) and add, so that both warps hold the full
// products. a + b == b + a in IEEE arithmetic, so both warps get bit-identical S^T and dP^T.
// `mine` / `theirs`: this warp's and the partner's [2][NT_S * 4][32] float slots.
template <int NT_S>
__device__ __forceinline__ void pair_sum_partials(float (*st)[4], float (*dpt)[4], float* mine, const float* theirs,
                                                  int pair, int lane) {
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            mine[(nt * 4 + e) * 32 + lane] = st[nt][e];
            mine[((NT_S + nt) * 4 + e) * 32 + lane] = dpt[nt][e];
        }
    // named barrier 1 + pair over the pair's 64 threads (0 is __syncthreads'); orders the
    // shared-memory stores above before the partner's loads below
    asm volatile("bar.sync %0, 64;\n" ::"r"(1 + pair) : "memory");
#pragma unroll
    for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            st[nt][e] += theirs[(nt * 4 + e) * 32 + lane];
            dpt[nt][e] += theirs[((NT_S + nt) * 4 + e) * 32 + lane];
        }
}

// NSPLIT = 1: warp w owns keys 16w..16w+15 and every head-dim column (padded HD <= 128).
// NSPLIT = 2 (padded HD 160..256, where the dK + dV accumulators of all HD columns would need
// HD floats per thread): warps 2p and 2p + 1 share keys 16p..16p+15; warp 2p + hs sums the
// S^T / dP^T products over head-dim columns [hs * HD/2, (hs + 1) * HD/2) only, the pair adds
// the two partials (pair_sum_partials), and each warp then accumulates and stores dK and dV
// for its own half of the columns: the tensor-core work is not duplicated, and dK + dV take
// HD/2 floats per thread together (128 at HD 256, as at HD 128 without the split).
template <typename T, int HD, int NWARPS, int BM, int NSPLIT, bool EXTRAS>
__global__ void __launch_bounds__(NWARPS * 32, 1)
attn_bwd_dkdv_mma(PA_COMMON_PARAMS, const T* __restrict__ dout, long long do_sb, long long do_ss, long long do_sh,
                  const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk, long long dk_sb,
                  long long dk_ss, long long dk_sh, T* __restrict__ dv, long long dv_sb, long long dv_ss,
                  long long dv_sh) {
    static_assert(NSPLIT == 1 || NSPLIT == 2, "head-dim split of 1 or 2 warps per key group");
    static_assert(NWARPS % NSPLIT == 0 && (HD / NSPLIT) % 16 == 0 && BM % 16 == 0, "tile shape");
    static_assert(NWARPS / NSPLIT <= 15, "one named barrier per warp pair");
    constexpr int BN = 16 * (NWARPS / NSPLIT);   // keys per CTA, 16 per key group
    constexpr int HDS = HD / NSPLIT;             // head-dim columns per warp
    constexpr int NT = NWARPS * 32;
    constexpr int LDS = HD + 8;          // padded row: ldmatrix rows fall in distinct banks
    constexpr int ES = sizeof(T);
    constexpr int NT_S = BM / 8;         // n8 tiles of S^T / dP^T (queries) per warp
    constexpr int NT_D = HDS / 8;        // n8 tiles of this warp's dK / dV columns
    extern __shared__ __align__(16) unsigned char smem_raw[];
    SmemCarve sm{smem_raw};
    T* sK = sm.take<T>(BN * LDS);                 // [BN][LDS]
    T* sV = sm.take<T>(BN * LDS);                 // [BN][LDS]
    T* sQ = sm.take<T>(2 * BM * LDS);             // [2][BM][LDS]
    T* sdO = sm.take<T>(2 * BM * LDS);            // [2][BM][LDS]
    float* sL = sm.take<float>(4 * BM);           // [2][lse2 BM | delta BM]
    float* sX = sm.take<float>(0);                // NSPLIT 2: [NWARPS][2][NT_S*4][32]

    const auto [tid, warp, lane, g, t4] = warp_lane();
    const int kg = warp / NSPLIT, col0 = (warp % NSPLIT) * HDS;   // key group, first head-dim column
    PA_KEY_CTA_PROLOGUE(BN);
    const float scale_log2 = scale * PA_LOG2E;

    // Stage 0: this CTA's K and V tiles (resident for the whole walk) and the first query tile.
    load_tile_async<T, BN, HD, LDS, NT>(sK, cta.k_tile, k_ss, s.sk - n0, head_dim, tid);
    load_tile_async<T, BN, HD, LDS, NT>(sV, cta.v_tile, v_ss, s.sk - n0, head_dim_v, tid);
    // Query rows that can see any of these keys, walked in BM tiles, for each head of the group.
    const QueryTileWalk<BM> walk(hk, gqa_ratio, cta.r_lo, cta.r_hi);
    const int n_iter = walk.n_iter;
    if (n_iter > 0) PA_DKDV_LOAD_QUERY_TILE(sQ, sdO, sL, walk.h_first, walk.m_first);
    cp_async_commit();

    float dk_acc[NT_D][4], dv_acc[NT_D][4];
    zero_acc<NT_D>(dk_acc);
    zero_acc<NT_D>(dv_acc);
    // ldmatrix addresses: A = this key group's 16 K / V rows from column col0; B = Q / dO tiles
    // (per-buffer offsets below) from column col0, for the products and for dK / dV alike.
    const pa_u32 aK = smem_addr(sK + kg * 16 * LDS + col0) + ldm_a_offset(lane, LDS) * ES;
    const pa_u32 aV = smem_addr(sV + kg * 16 * LDS + col0) + ldm_a_offset(lane, LDS) * ES;
    const pa_u32 offB = (ldm_b_offset(lane, LDS) + col0) * ES, offBt = (ldm_bt_offset(lane, LDS) + col0) * ES;
    const int jl0 = kg * 16 + g;         // this lane's first key (in the CTA tile); +8 for c2, c3
    float* x_mine = sX + warp * (2 * NT_S * 4 * 32);
    const float* x_theirs = sX + (warp ^ 1) * (2 * NT_S * 4 * 32);

    for (int it = 0; it < n_iter; ++it) {
        const int buf = it & 1;
        const int h = walk.head(it), m0 = walk.row0(it);
        // Stage 1: tile `it` landed, and every warp is done with the other buffer (and with its
        // partner's partials of the last tile): prefetch it + 1.
        cp_async_wait_all();
        __syncthreads();
        if (it + 1 < n_iter) {
            const int h1 = walk.head(it + 1), m1 = walk.row0(it + 1);
            PA_DKDV_LOAD_QUERY_TILE(sQ + (buf ^ 1) * BM * LDS, sdO + (buf ^ 1) * BM * LDS, sL + (buf ^ 1) * 2 * BM, h1, m1);
            cp_async_commit();
        }
        const pa_u32 q_addr = smem_addr(sQ + buf * BM * LDS), do_addr = smem_addr(sdO + buf * BM * LDS);
        const float* lse2_t = sL + buf * 2 * BM;
        const float* delta_t = lse2_t + BM;

        // Stage 2: S^T = K_w Q^T and dP^T = V_w dO^T (16 keys x BM queries per warp), over this
        // warp's HDS columns; with NSPLIT = 2 the pair adds its two partials.
        float st[NT_S][4], dpt[NT_S][4];
        zero_acc<NT_S>(st);
        zero_acc<NT_S>(dpt);
        warp_mma_abt<T, HDS / 16, BM / 16, LDS>(st, aK, q_addr + offB);
        warp_mma_abt<T, HDS / 16, BM / 16, LDS>(dpt, aV, do_addr + offB);
        if (NSPLIT > 1) pair_sum_partials<NT_S>(st, dpt, x_mine, x_theirs, kg, lane);

        // Stage 3: P^T and dS^T in place (element e of n-tile nt: key jl0 + 8*(e/2), query
        // nt*8 + 2*t4 + e%2 of the tile).
        const ScoreMods mods = PA_MODS_IF(EXTRAS, b, h);
        const bool check = tile_needs_mask(s, m0, BM, n0, BN, win_left, win_right);
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int il = nt * 8 + 2 * t4 + (e % 2);
                const int j = n0 + jl0 + 8 * (e / 2);
                grad_entry_mma<EXTRAS>(st[nt][e], dpt[nt][e], lse2_t[il], delta_t[il], mods, scale_log2, s, m0 + il,
                                       j, check, win_left, win_right, &st[nt][e], &dpt[nt][e]);
            }

        // Stage 4: dV_w += P^T dO and dK_w += dS^T Q over this warp's columns (P^T, dS^T
        // re-packed as A fragments).
        warp_mma_pb<T, BM / 16, HDS / 16, LDS>(dv_acc, st, do_addr + offBt);
        warp_mma_pb<T, BM / 16, HDS / 16, LDS>(dk_acc, dpt, q_addr + offBt);
    }
    cp_async_wait_all();   // a CTA with no query tile still has its K/V copies in flight

    // Epilogue: the key group's 16 rows of dK and dV, this warp's columns (keys past the sequence
    // end and columns past the head dim are not stored).
    const int key_w = n0 + kg * 16;
    store_acc_rows<T, NT_D>(tok_ptr(dk, b, dk_sb, s.k0 + key_w, dk_ss, hk, dk_sh), dk_ss, dk_acc, s.sk - key_w, col0,
                            head_dim, g, t4);
    store_acc_rows<T, NT_D>(tok_ptr(dv, b, dv_sb, s.k0 + key_w, dv_ss, hk, dv_sh), dv_ss, dv_acc, s.sk - key_w, col0,
                            head_dim_v, g, t4);
}

// ----- dQ ------------------------------------------------------------------------------------
template <typename T, int HD, int NWARPS, int BN, bool EXTRAS>
__global__ void __launch_bounds__(NWARPS * 32, 1)
attn_bwd_dq_mma(PA_COMMON_PARAMS, const T* __restrict__ dout, long long do_sb, long long do_ss, long long do_sh,
                const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, long long dq_sb,
                long long dq_ss, long long dq_sh) {
    constexpr int BM = 16 * NWARPS;      // query rows per CTA, 16 per warp
    constexpr int NT = NWARPS * 32;
    constexpr int LDS = HD + 8;
    constexpr int ES = sizeof(T);
    constexpr int NT_S = BN / 8;         // n8 tiles of S / dP (keys) per warp
    constexpr int NT_D = HD / 8;         // n8 tiles of dQ (head dim) per warp
    extern __shared__ __align__(16) unsigned char smem_raw[];
    SmemCarve sm{smem_raw};
    T* sQ = sm.take<T>(BM * LDS);              // [BM][LDS]
    T* sdO = sm.take<T>(BM * LDS);             // [BM][LDS]
    T* sK = sm.take<T>(2 * BN * LDS);          // [2][BN][LDS]
    T* sV = sm.take<T>(2 * BN * LDS);          // [2][BN][LDS]

    const auto [tid, warp, lane, g, t4] = warp_lane();
    PA_ROW_TILE_PROLOGUE(BM, BN);
    const float scale_log2 = scale * PA_LOG2E;
    const ScoreMods mods = PA_MODS_IF(EXTRAS, b, h);

    // Stage 0: Q and dO rows (resident) and the first K/V tile.
    load_tile_async<T, BM, HD, LDS, NT>(sQ, PA_Q_ROW(s, b, h, m0), q_ss, s.sq - m0, head_dim, tid);
    load_tile_async<T, BM, HD, LDS, NT>(sdO, PA_DO_ROW(s, b, h, m0), do_ss, s.sq - m0, head_dim_v, tid);
    if (n_first < n_hi) load_kv_async<T, BN, HD, LDS, NT>(sK, sV, cta, n_first, k_ss, v_ss, head_dim, head_dim_v, tid);
    cp_async_commit();

    // This lane's rows: i0 = row_w + g and i0 + 8 (accumulator elements e / 2 = 0, 1).
    const int row_w = m0 + warp * 16;
    float lse2[2], delta_r[2];
    load_row_stats2(lse2, delta_r, lse, delta, lse_sb, lse_sh, s, b, h, row_w + g);

    float dq_acc[NT_D][4];
    zero_acc<NT_D>(dq_acc);
    const pa_u32 aQ = smem_addr(sQ + warp * 16 * LDS) + ldm_a_offset(lane, LDS) * ES;
    const pa_u32 adO = smem_addr(sdO + warp * 16 * LDS) + ldm_a_offset(lane, LDS) * ES;
    const pa_u32 offB = ldm_b_offset(lane, LDS) * ES, offBt = ldm_bt_offset(lane, LDS) * ES;

    for (int n0 = n_first, it = 0; n0 < n_hi; n0 += BN, ++it) {
        const int buf = it & 1;
        // Stage 1: K/V tile landed, every warp is done with the other buffer: prefetch the next.
        cp_async_wait_all();
        __syncthreads();
        if (n0 + BN < n_hi) {
            load_kv_async<T, BN, HD, LDS, NT>(sK + (buf ^ 1) * BN * LDS, sV + (buf ^ 1) * BN * LDS, cta, n0 + BN, k_ss,
                                              v_ss, head_dim, head_dim_v, tid);
            cp_async_commit();
        }
        const pa_u32 k_addr = smem_addr(sK + buf * BN * LDS), v_addr = smem_addr(sV + buf * BN * LDS);

        // Stage 2: S = Q_w K^T and dP = dO_w V^T (16 rows x BN keys per warp).
        float sc[NT_S][4], dp[NT_S][4];
        zero_acc<NT_S>(sc);
        zero_acc<NT_S>(dp);
        warp_mma_abt<T, HD / 16, BN / 16, LDS>(sc, aQ, k_addr + offB);
        warp_mma_abt<T, HD / 16, BN / 16, LDS>(dp, adO, v_addr + offB);

        // Stage 3: dS in place of dP (element e of n-tile nt: row row_w + g + 8*(e/2), key
        // n0 + nt*8 + 2*t4 + e%2).
        const bool check = tile_needs_mask(s, m0, BM, n0, BN, win_left, win_right);
#pragma unroll
        for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e / 2;
                float p;
                grad_entry_mma<EXTRAS>(sc[nt][e], dp[nt][e], lse2[r], delta_r[r], mods, scale_log2, s,
                                       row_w + g + 8 * r, n0 + nt * 8 + 2 * t4 + (e % 2), check, win_left, win_right,
                                       &p, &dp[nt][e]);
            }

        // Stage 4: dQ_w += dS K (dS re-packed as A fragments; K read transposed).
        warp_mma_pb<T, BN / 16, HD / 16, LDS>(dq_acc, dp, k_addr + offBt);
    }
    cp_async_wait_all();   // a CTA whose rows see no key still has its Q/dO copies in flight

    store_acc_rows<T, NT_D>(tok_ptr(dq, b, dq_sb, s.q0 + row_w, dq_ss, h, dq_sh), dq_ss, dq_acc, s.sq - row_w, 0,
                            head_dim, g, t4);
}
