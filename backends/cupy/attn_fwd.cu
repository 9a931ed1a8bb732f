// portattn CuPy backend: forward kernels (FlashAttention-2 work partition).
//
// attn_fwd_mma<T, HD, NWARPS, BN, MT, KV_STAGES, EXTRAS>  fp16/bf16 on tensor cores (mma.sync m16n8k16).
//   One CTA per (Q tile of 16*MT*NWARPS rows, query head, batch); warp w owns 16*MT rows
//   (MT m16 tiles, so each K/V fragment read from shared memory feeds MT mma's).
//   K/V tiles of BN keys go through shared memory with cp.async (KV_STAGES 1: one K and one V
//   buffer, V and the next K each fetched during the other's matmul, as FA2; KV_STAGES 2: two
//   K+V buffers, the next tile fetched during the whole current one); Q, K and V fragments are
//   read with ldmatrix; S = Q K^T and O += P V accumulate in float32 registers; P is
//   re-packed from the S accumulators into A fragments without touching shared memory.
//   HD is the head dim padded to a multiple of 32 (the tail of q/k/v is zero-filled).
//   EXTRAS = softcap / ALiBi / bias are compiled in (masking is always available).
//
// attn_fwd_fma<T, HD>  the float32 path (IEEE float32 FMA for Q K^T, no TF32, natural-log softmax
//   with expf, P V and row sums accumulated in float64), any T: one CTA of 128 threads per
//   (16 rows, head, batch); 8 threads share a row.

template <typename T, int HD, int NWARPS, int BN, int MT, int KV_STAGES, bool EXTRAS>
__global__ void __launch_bounds__(NWARPS * 32, 1)
attn_fwd_mma(PA_COMMON_PARAMS, T* __restrict__ o, long long o_sb, long long o_ss, long long o_sh,
             float* __restrict__ lse) {
    constexpr int WM = 16 * MT;          // rows per warp (MT m16 tiles share each K/V fragment)
    constexpr int BM = WM * NWARPS;
    constexpr int NT = NWARPS * 32;
    constexpr int LDS = HD + 8;          // padded row: ldmatrix rows fall in distinct banks
    constexpr int NT_S = BN / 8;         // n-tiles of S per m-tile
    constexpr int NT_O = HD / 8;         // n-tiles of O per m-tile
    static_assert(KV_STAGES == 1 || KV_STAGES == 2, "one K/V buffer (K, V staggered) or two (K+V prefetched)");
    constexpr int KV_TILE = BN * LDS;    // elements of one K (or V) buffer
    extern __shared__ __align__(16) unsigned char smem_raw[];
    SmemCarve sm{smem_raw};
    T* sQ = sm.take<T>(BM * LDS);
    T* sK = sm.take<T>(KV_STAGES * KV_TILE);   // [KV_STAGES][BN][LDS]
    T* sV = sm.take<T>(KV_STAGES * KV_TILE);   // [KV_STAGES][BN][LDS]

    const auto [tid, warp, lane, g, t4] = warp_lane();
    PA_ROW_TILE_PROLOGUE(BM, BN);
    const ScoreMods mods = PA_MODS_IF(EXTRAS, b, h);
    const float scale_log2 = scale * PA_LOG2E;

    // Stage 0: Q tile and the first K tile (KV_STAGES 2: and V tile) in flight; the CTA walks
    // keys [n_lo, n_hi) in BN tiles.
    load_tile_async<T, BM, HD, LDS, NT>(sQ, PA_Q_ROW(s, b, h, m0), q_ss, s.sq - m0, head_dim, tid);
    if (n_first < n_hi) {
        load_tile_async<T, BN, HD, LDS, NT>(sK, cta.k_seq + n_first * k_ss, k_ss, s.sk - n_first, head_dim, tid);
        if (KV_STAGES == 2)
            load_tile_async<T, BN, HD, LDS, NT>(sV, cta.v_seq + n_first * v_ss, v_ss, s.sk - n_first, head_dim_v, tid);
    }
    cp_async_commit();

    float acc[MT][NT_O][4];               // O accumulator: rows g, g+8 of each m-tile
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) zero_acc<NT_O>(acc[mt]);
    float m_i[MT][2], l_i[MT][2];         // running row max (base 2) and row sum (this thread's columns)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) m_i[mt][0] = m_i[mt][1] = PA_NEG_INF, l_i[mt][0] = l_i[mt][1] = 0.f;
    const int row_w = m0 + warp * WM;     // first row of this warp
    const T* sQw = sQ + warp * WM * LDS;
    // ldmatrix addresses: per-lane byte offsets inside a 16x16 block (A: rows of Q; B: keys of
    // K, keys of V transposed); the matmuls add compile-time block offsets.
    constexpr int ES = sizeof(T);
    const pa_u32 aQ = smem_addr(sQw) + ldm_a_offset(lane, LDS) * ES;
    const pa_u32 aK = smem_addr(sK) + ldm_b_offset(lane, LDS) * ES;
    const pa_u32 aV = smem_addr(sV) + ldm_bt_offset(lane, LDS) * ES;

    // KV_STAGES 1 (FA2's pipeline): one K and one V buffer; V(n) loads during S = Q K(n)^T and
    // the softmax, K(n+1) during O += P V(n): two barriers per tile. KV_STAGES 2: two K+V
    // buffers; tile n+1 is fetched into the other buffer while tile n is used, so each copy has
    // a whole iteration to land, and one barrier per tile. The arithmetic is the same.
    for (int n0 = n_first, it = 0; n0 < n_hi; n0 += BN, ++it) {
        const int buf = KV_STAGES == 2 ? (it & 1) : 0;
        const pa_u32 kv_off = buf * KV_TILE * ES;
        // Stage 1 (KV_STAGES 1): K tile landed (and every warp is done with the previous V);
        // fetch V. (KV_STAGES 2): K and V of tile n landed, every warp is done with the other
        // buffer (tile n-1): fetch tile n+1 into it.
        cp_async_wait_all();
        __syncthreads();
        if (KV_STAGES == 1) {
            load_tile_async<T, BN, HD, LDS, NT>(sV, cta.v_seq + n0 * v_ss, v_ss, s.sk - n0, head_dim_v, tid);
            cp_async_commit();
        } else if (n0 + BN < n_hi) {
            load_kv_async<T, BN, HD, LDS, NT>(sK + (buf ^ 1) * KV_TILE, sV + (buf ^ 1) * KV_TILE, cta, n0 + BN, k_ss, v_ss,
                                              head_dim, head_dim_v, tid);
            cp_async_commit();
        }

        // Stage 2: S = Q K^T on tensor cores; each K fragment feeds MT m-tiles.
        float sc[MT][NT_S][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) zero_acc<NT_S>(sc[mt]);
        warp_mma_abt_mt<T, HD / 16, BN / 16, LDS, MT>(sc, aQ, aK + kv_off);

        // Stage 3: scale (+ softcap, ALiBi, bias) into base-2 logits; mask where needed.
        const bool need_mask = keys_need_mask(s, m0, BM, n0, BN, win_left, win_right);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT_S; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int i = row_w + mt * 16 + g + (e / 2) * 8, j = n0 + nt * 8 + 2 * t4 + (e % 2);
                    float x;
                    if (EXTRAS) {
                        float th;
                        x = (i < s.sq && j < s.sk) ? score_nat(sc[mt][nt][e], mods, s, i, j, &th) * PA_LOG2E
                                                   : PA_NEG_INF;
                    } else {
                        x = sc[mt][nt][e] * scale_log2;
                    }
                    if (need_mask && !is_visible(s, i, j, win_left, win_right)) x = PA_NEG_INF;
                    sc[mt][nt][e] = x;
                }

        // Stage 4: online softmax: new row max, rescale the running sum and accumulator.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = m_i[mt][r];
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt) mx = fmaxf(mx, fmaxf(sc[mt][nt][2 * r], sc[mt][nt][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_use = mx == PA_NEG_INF ? 0.f : mx;
                const float alpha = fast_exp2(m_i[mt][r] - m_use);
                m_i[mt][r] = mx;
                float rowsum = 0.f;
#pragma unroll
                for (int nt = 0; nt < NT_S; ++nt) {
                    const float p0 = fast_exp2(sc[mt][nt][2 * r] - m_use);
                    const float p1 = fast_exp2(sc[mt][nt][2 * r + 1] - m_use);
                    sc[mt][nt][2 * r] = p0;
                    sc[mt][nt][2 * r + 1] = p1;
                    rowsum += p0 + p1;
                }
                l_i[mt][r] = l_i[mt][r] * alpha + rowsum;
#pragma unroll
                for (int dt = 0; dt < NT_O; ++dt) {
                    acc[mt][dt][2 * r] *= alpha;
                    acc[mt][dt][2 * r + 1] *= alpha;
                }
            }

        // Stage 5 (KV_STAGES 1): V tile landed (and every warp is done with K); prefetch the
        // next K tile.
        if (KV_STAGES == 1) {
            cp_async_wait_all();
            __syncthreads();
            if (n0 + BN < n_hi) {
                load_tile_async<T, BN, HD, LDS, NT>(sK, cta.k_seq + (n0 + BN) * k_ss, k_ss, s.sk - n0 - BN, head_dim,
                                                    tid);
                cp_async_commit();
            }
        }

        // Stage 6: O += P V, P taken from the S accumulators as A fragments.
        warp_mma_pb_mt<T, BN / 16, HD / 16, LDS, MT, NT_S>(acc, sc, aV + kv_off);
    }

    // Epilogue: O / l (0 for rows with no visible key), lse = (m + log2 l) ln 2.
    // A CTA whose rows see no key skips the loop, so its Q copies (issued by every thread, into
    // every warp's rows) may still be in flight: wait, and barrier the whole CTA, before the warps
    // overwrite their Q rows with output.
    cp_async_wait_all();
    __syncthreads();
    T* sO = const_cast<T*>(sQw);          // the warp's own Q rows stage its output rows
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float l = l_i[mt][r];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const int rl = mt * 16 + g + r * 8, i = row_w + rl;
            if (t4 == 0 && i < s.sq) {
                const float v_lse = (l > 0.f) ? (m_i[mt][r] + fast_log2(l)) * PA_LN2 : PA_NEG_INF;
                lse[row_index(b, h, lse_sb, lse_sh, s, i)] = v_lse;
            }
#pragma unroll
            for (int dt = 0; dt < NT_O; ++dt)
                *reinterpret_cast<pa_u32*>(sO + rl * LDS + dt * 8 + 2 * t4) =
                    Elem<T>::pack2(acc[mt][dt][2 * r] * inv, acc[mt][dt][2 * r + 1] * inv);
        }
    __syncwarp();
    // Store the staged rows in 16-byte chunks.
    constexpr int CPR = HD / 8;
    for (int c = lane; c < WM * CPR; c += 32) {
        const int r = c / CPR, col = (c % CPR) * 8;
        const int i = row_w + r;
        if (i < s.sq && col < head_dim_v) {
            T* dst = tok_ptr(o, b, o_sb, s.q0 + i, o_ss, h, o_sh) + col;
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(sO + r * LDS + col);
        }
    }
}

// ----- the float32 (FMA) forward --------------------------------------------------------------
// 128 threads: thread t owns row t/8 of the 16-row tile and, for that row, keys sub + 8c of each
// key tile and output columns sub + 8c (sub = t % 8). Shared memory holds Q, a K tile, a V tile
// and P, all in float32.
template <typename T, int HD>
__global__ void __launch_bounds__(128, 1)
attn_fwd_fma(PA_COMMON_PARAMS, T* __restrict__ o, long long o_sb, long long o_ss, long long o_sh,
             float* __restrict__ lse) {
    constexpr int BM = 16, NT = 128;
    constexpr int BN = HD <= 128 ? 32 : 16;
    constexpr int KPT = BN / 8;          // keys per thread
    constexpr int CPT = HD / 8;          // output columns per thread
    constexpr int LDK = HD + 1;          // odd stride: conflict-free column reads
    extern __shared__ __align__(16) unsigned char smem_raw[];
    SmemCarve sm{smem_raw};
    float* sQ = sm.take<float>(BM * HD);   // BM x HD
    float* sK = sm.take<float>(BN * LDK);  // BN x LDK
    float* sV = sm.take<float>(BN * HD);   // BN x HD
    float* sP = sm.take<float>(BM * BN);   // BM x BN

    PA_FMA_ROW_PROLOGUE(BM, 8);
    load_rows_f32<T, BM, HD, HD, NT>(sQ, PA_Q_ROW(s, b, h, m0), q_ss, s.sq - m0, head_dim, tid);

    // P V and the row sum accumulate in float64: sums of hundreds of terms of either sign would
    // otherwise lose a few float32 ulps against plain float32 math (docs/semantics.md's yardstick).
    double acc[CPT];
    #pragma unroll
    for (int c = 0; c < CPT; ++c) acc[c] = 0.0;
    float m_i = PA_NEG_INF;
    double l_i = 0.0;

    for (int n0 = cta.n_first(BN); n0 < n_hi; n0 += BN) {
        // Stage 1: K and V tiles into shared memory (float32, zero outside the sequence).
        __syncthreads();
        load_kv_rows_f32<T, BN, HD, LDK, HD, NT>(sK, sV, cta, n0, k_ss, v_ss, head_dim, head_dim_v, tid);
        __syncthreads();

        // Stage 2: this thread's scores s = q_i . k_j, turned into masked logits.
        // (ScoreAcc: float64 sums for float32 inputs, see attn_common.cuh)
        typedef typename ScoreAcc<T>::type acc_t;
        acc_t dots[KPT];
        #pragma unroll
        for (int c = 0; c < KPT; ++c) dots[c] = 0;
        for (int d = 0; d < HD; ++d) {
            const acc_t qd = sQ[row * HD + d];
            #pragma unroll
            for (int c = 0; c < KPT; ++c) dots[c] = acc_fma(qd, (acc_t)sK[(sub + 8 * c) * LDK + d], dots[c]);
        }
        float sc[KPT];
        float mx = m_i;
        #pragma unroll
        for (int c = 0; c < KPT; ++c) {
            const int j = n0 + sub + 8 * c;
            float th;
            sc[c] = is_visible(s, i, j, win_left, win_right) ? score_nat((float)dots[c], mods, s, i, j, &th) : PA_NEG_INF;
            mx = fmaxf(mx, sc[c]);
        }

        // Stage 3: online softmax over the 8 threads of the row.
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        const float m_use = mx == PA_NEG_INF ? 0.f : mx;
        const float alpha = expf(m_i - m_use);
        m_i = mx;
        double rowsum = 0.0;
        #pragma unroll
        for (int c = 0; c < KPT; ++c) {
            const float p = expf(sc[c] - m_use);
            sP[row * BN + sub + 8 * c] = p;
            rowsum += p;
        }
        l_i = l_i * alpha + rowsum;
        __syncwarp();

        // Stage 4: acc = alpha * acc + P V (the row's P was written by this warp).
        #pragma unroll
        for (int c = 0; c < CPT; ++c) acc[c] *= alpha;
        for (int j = 0; j < BN; ++j) {
            const double p = sP[row * BN + j];
            #pragma unroll
            for (int c = 0; c < CPT; ++c) acc[c] = fma(p, (double)sV[j * HD + sub + 8 * c], acc[c]);
        }
        __syncwarp();
    }

    // Epilogue: O / l, lse.
    l_i += __shfl_xor_sync(0xffffffffu, l_i, 1);
    l_i += __shfl_xor_sync(0xffffffffu, l_i, 2);
    l_i += __shfl_xor_sync(0xffffffffu, l_i, 4);
    if (i < s.sq) {
        const double l_div = l_i > 0.0 ? l_i : 1.0;   // acc is 0 for a row with no visible key
        T* dst = tok_ptr(o, b, o_sb, s.q0 + i, o_ss, h, o_sh);
        #pragma unroll
        for (int c = 0; c < CPT; ++c) {
            const int d = sub + 8 * c;
            if (d < head_dim_v) dst[d] = Elem<T>::from_float((float)(acc[c] / l_div));
        }
        if (sub == 0) lse[row_index(b, h, lse_sb, lse_sh, s, i)] = l_i > 0.0 ? m_i + (float)log(l_i) : PA_NEG_INF;
    }
}
