// portattn CuPy backend: backward kernels (FlashAttention-2 backward, float32 FMA).
//
// With P = exp(s - lse) recomputed from q, k and the forward's lse:
//   delta_i = sum_d dO_id O_id - dlse_i             (attn_bwd_preprocess)
// (dlse_i: the loss gradient of the returned natural-log lse, 0 when none reaches it; since
// d lse_i / d s_ij = P_ij it adds dlse_i P_ij to dS_ij, which is the shift of delta)
// (natural-log units throughout: P = expf(s - lse), as the float32 forward computes it)
//   dV_j    = sum_i P_ij dO_i                        (attn_bwd_dkdv)
//   dS_ij   = P_ij (dO_i . v_j - delta_i)            natural-log logit gradient
//   dot_ij  = dS_ij * scale * (1 - tanh^2)           softcap chain rule (1 without softcap)
//   dK_j    = sum_i dot_ij q_i                       (attn_bwd_dkdv)
//   dQ_i    = sum_j dot_ij k_j                       (attn_bwd_dq)
// float32 inputs run attn_bwd_stats instead of the preprocess (exact row statistics, below).
// Deterministic: no atomics. dK/dV: one CTA per (32 keys, kv head, batch) walks every query head
// of its GQA group and every query tile that can see its keys; dQ: one CTA per (16 rows, head,
// batch) walks the visible key tiles. Arithmetic is IEEE float32 for every input dtype.

// One thread per row, summing d = 0, 1, ... with fmaf: the same order as the dP = dO . v dots of
// the kernels below, so that dP - delta is exactly 0 where it should be (e.g. one visible key).
// Rows whose O and dO start 16-byte aligned are read 16 bytes at a time (the same sum: only the
// loads are wider; a warp's 32 rows are far apart, so 2-byte loads cost a memory transaction per
// element); the rest of a row, and unaligned rows, element by element.
template <typename T>
__global__ void __launch_bounds__(128)
attn_bwd_preprocess(const T* __restrict__ o, long long o_sb, long long o_ss, long long o_sh,
                    const T* __restrict__ dout, long long do_sb, long long do_ss, long long do_sh,
                    float* __restrict__ delta, long long lse_sb, long long lse_sh,
                    const int* __restrict__ cu_q, int seqlen_q, int total_q, int head_dim_v,
                    const float* __restrict__ dlse) {
    const int b = blockIdx.z, h = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    long long q0 = 0;
    int sq = seqlen_q;
    if (cu_q != nullptr) seq_span(cu_q, b, seqlen_q, total_q, &q0, &sq);
    if (i >= sq) return;
    const T* orow = tok_ptr(o, b, o_sb, q0 + i, o_ss, h, o_sh);
    const T* drow = tok_ptr(dout, b, do_sb, q0 + i, do_ss, h, do_sh);
    float acc = 0.f;
    int d = 0;
    constexpr int VEC = 16 / sizeof(T);
    if (((reinterpret_cast<unsigned long long>(orow) | reinterpret_cast<unsigned long long>(drow)) & 15) == 0) {
#pragma unroll 4
        for (; d + VEC <= head_dim_v; d += VEC) {
            const uint4 ov = *reinterpret_cast<const uint4*>(orow + d);
            const uint4 dv = *reinterpret_cast<const uint4*>(drow + d);
            const T* oe = reinterpret_cast<const T*>(&ov);
            const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc = fmaf(Elem<T>::to_float(de[e]), Elem<T>::to_float(oe[e]), acc);
        }
    }
    for (; d < head_dim_v; ++d) acc = fmaf(Elem<T>::to_float(drow[d]), Elem<T>::to_float(orow[d]), acc);
    const long long idx = b * lse_sb + h * lse_sh + q0 + i;
    // (rows with lse = -inf never read delta: their P and dS are 0 in every kernel)
    delta[idx] = dlse != nullptr ? acc - dlse[idx] : acc;
}

// Q and dO rows [m0, m0 + ROWS) of head h into shared float32 (zero outside the sequence and
// past head_dim / head_dim_v).
#define PA_LOAD_QUERY_ROWS_F32(ROWS, SQ, SDO, S, B, H, M0)                                                       \
    do {                                                                                                          \
        load_rows_f32<T, ROWS, HD, LD, NT>(SQ, PA_Q_ROW(S, B, H, M0), q_ss, (S).sq - (M0), head_dim, tid);         \
        load_rows_f32<T, ROWS, HD, LD, NT>(SDO, PA_DO_ROW(S, B, H, M0), do_ss, (S).sq - (M0), head_dim_v, tid);    \
    } while (0)

// Row statistics one (i, j) entry needs: P = exp(s - lse), or with `exact` (float32 inputs)
// P = exp(s - m) / l from attn_bwd_stats, which carries no rounding of lse.
struct RowStats {
    float lse, m, l, delta;
};

// P_ij and the gradient of the raw dot product q_i . k_j for one (i, j); 0 where j is masked.
__device__ __forceinline__ void grad_entry(float dot, float dpv, const RowStats& row, bool exact, const ScoreMods& mods,
                                           const SeqInfo& s, int i, int j, int left, int right, float* p_out,
                                           float* ddot_out) {
    float p = 0.f, ddot = 0.f;
    const float delta_i = row.delta;
    if (is_visible(s, i, j, left, right) && (exact ? row.l > 0.f : row.lse != PA_NEG_INF)) {
        float th = 0.f;
        const float x = score_nat(dot, mods, s, i, j, &th);
        p = exact ? expf(x - row.m) / row.l : expf(x - row.lse);
        ddot = p * (dpv - delta_i) * mods.scale;
        if (mods.softcap > 0.f) ddot *= 1.f - th * th;
    }
    *p_out = p;
    *ddot_out = ddot;
}

// Row statistics for the float32 backward (`exact`): the softmax's row max m_i and sum l_i
// recomputed with a float64 sum, so that P = exp(s - m) / l carries no rounding of the float32
// lse, and delta_i = sum_j P_ij dP_ij, the softmax backward's own row sum (the order of plain
// float32 math), instead of dO_i . O_i, which inherits O's rounding. One CTA per (16 rows, head,
// batch), 16 threads per row (keys sub and sub + 16 of each tile); two passes over the keys.
// With one visible key, P = 1 and delta equals dP bit for bit (same dot order as below).
template <typename T, int HD>
__global__ void __launch_bounds__(256, 1)
attn_bwd_stats(PA_COMMON_PARAMS, const T* __restrict__ dout, long long do_sb, long long do_ss, long long do_sh,
               float* __restrict__ row_m, float* __restrict__ row_l, float* __restrict__ delta,
               const float* __restrict__ dlse) {
    constexpr int BM = 16, BN = 32, NT = 256, LD = HD + 1;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    SmemCarve sm{smem_raw};
    float* sQ = sm.take<float>(BM * LD);
    float* sdO = sm.take<float>(BM * LD);
    float* sK = sm.take<float>(BN * LD);
    float* sV = sm.take<float>(BN * LD);

    PA_FMA_ROW_PROLOGUE(BM, 16);
    const int n_first = cta.n_first(BN);
    PA_LOAD_QUERY_ROWS_F32(BM, sQ, sdO, s, b, h, m0);

    // Pass 1: online row max and float64 sum over this thread's keys, then over the row's 16 threads.
    float m_t = PA_NEG_INF;
    double l_t = 0.0;
    for (int n0 = n_first; n0 < n_hi; n0 += BN) {
        __syncthreads();
        load_rows_f32<T, BN, HD, LD, NT>(sK, cta.k_seq + n0 * k_ss, k_ss, s.sk - n0, head_dim, tid);
        __syncthreads();
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int jl = sub + 16 * c, j = n0 + jl;
            const float dot = score_dot<T, HD>(&sQ[row * LD], &sK[jl * LD]);
            if (!is_visible(s, i, j, win_left, win_right)) continue;
            float th;
            const float x = score_nat(dot, mods, s, i, j, &th);
            if (x == PA_NEG_INF) continue;
            if (x > m_t) {
                l_t *= exp((double)m_t - (double)x);
                m_t = x;
            }
            l_t += exp((double)x - (double)m_t);
        }
    }
    float m = m_t;
    for (int off = 1; off < 16; off *= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    double l = m_t == PA_NEG_INF ? 0.0 : l_t * exp((double)m_t - (double)m);
    for (int off = 1; off < 16; off *= 2) l += __shfl_xor_sync(0xffffffffu, l, off);
    const float l_f = (float)l;

    // Pass 2: delta = sum_j P_ij (dO_i . v_j) with P as the dK/dV and dQ kernels compute it.
    double dsum = 0.0;
    for (int n0 = n_first; n0 < n_hi; n0 += BN) {
        __syncthreads();
        load_kv_rows_f32<T, BN, HD, LD, LD, NT>(sK, sV, cta, n0, k_ss, v_ss, head_dim, head_dim_v, tid);
        __syncthreads();
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int jl = sub + 16 * c, j = n0 + jl;
            const float dot = score_dot<T, HD>(&sQ[row * LD], &sK[jl * LD]);
            const float dpv = dot_f32<HD>(&sdO[row * LD], &sV[jl * LD]);
            if (!is_visible(s, i, j, win_left, win_right) || !(l_f > 0.f)) continue;
            float th;
            const float p = expf(score_nat(dot, mods, s, i, j, &th) - m) / l_f;
            dsum += (double)p * (double)dpv;
        }
    }
    for (int off = 1; off < 16; off *= 2) dsum += __shfl_xor_sync(0xffffffffu, dsum, off);
    if (sub == 0 && i < s.sq) {
        const long long idx = row_index(b, h, lse_sb, lse_sh, s, i);
        row_m[idx] = m;
        row_l[idx] = l_f;
        // minus dlse (see the top of the file), rounded once; a row with no visible key takes none
        const double dl = (dlse != nullptr && l_f > 0.f) ? (double)dlse[idx] : 0.0;
        delta[idx] = (float)(dsum - dl);
    }
}

// Up to HD 160 two CTAs per SM fit (<= 128 registers, 66 KB of shared memory at 160): asked of
// ptxas explicitly (unconstrained it took 133 registers, one CTA, at HD 160 float32 on sm_90;
// with the bound 72-126 on sm_80/sm_90, no spills). The arithmetic is unchanged.
template <typename T, int HD>
__global__ void __launch_bounds__(256, HD <= 160 ? 2 : 1)
attn_bwd_dkdv(PA_COMMON_PARAMS, const T* __restrict__ dout, long long do_sb, long long do_ss, long long do_sh,
              const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk, long long dk_sb,
              long long dk_ss, long long dk_sh, T* __restrict__ dv, long long dv_sb, long long dv_ss,
              long long dv_sh, const float* __restrict__ row_m, const float* __restrict__ row_l) {
    constexpr int BN = 32, BM = 16, NT = 256, LD = HD + 1, CPT = HD / 8;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    SmemCarve sm{smem_raw};
    float* sK = sm.take<float>(BN * LD);
    float* sV = sm.take<float>(BN * LD);
    float* sQ = sm.take<float>(BM * LD);
    float* sdO = sm.take<float>(BM * LD);
    float* sP = sm.take<float>(BM * (BN + 1));
    float* sdS = sm.take<float>(BM * (BN + 1));
    float* sRow = sm.take<float>(4 * BM);   // lse[BM], delta[BM], m[BM], l[BM]
    const bool exact = row_m != nullptr;

    const int tid = threadIdx.x, key_l = tid / 8, sub = tid % 8;
    PA_KEY_CTA_PROLOGUE(BN);
    const int r_lo = cta.r_lo, r_hi = cta.r_hi;
    const int j = n0 + key_l;

    // Stage 0: this CTA's K and V tiles stay in shared memory for the whole walk.
    load_rows_f32<T, BN, HD, LD, NT>(sK, cta.k_tile, k_ss, s.sk - n0, head_dim, tid);
    load_rows_f32<T, BN, HD, LD, NT>(sV, cta.v_tile, v_ss, s.sk - n0, head_dim_v, tid);

    float dk_acc[CPT], dv_acc[CPT];
    #pragma unroll
    for (int c = 0; c < CPT; ++c) dk_acc[c] = dv_acc[c] = 0.f;

    for (int hh = 0; hh < gqa_ratio; ++hh) {
        const int h = hk * gqa_ratio + hh;
        const ScoreMods mods = PA_MODS(b, h);
        for (int m0 = (r_lo / BM) * BM; m0 < r_hi; m0 += BM) {
            // Stage 1: the query tile, its dO, lse and delta.
            __syncthreads();
            PA_LOAD_QUERY_ROWS_F32(BM, sQ, sdO, s, b, h, m0);
            if (tid < BM) {
                const bool ok = m0 + tid < s.sq;
                const long long idx = row_index(b, h, lse_sb, lse_sh, s, m0 + tid);
                sRow[tid] = ok ? lse[idx] : PA_NEG_INF;
                sRow[BM + tid] = ok ? delta[idx] : 0.f;
                sRow[2 * BM + tid] = ok && exact ? row_m[idx] : 0.f;
                sRow[3 * BM + tid] = ok && exact ? row_l[idx] : 0.f;
            }
            __syncthreads();

            // Stage 2: recompute P and the score gradient for rows sub, sub + 8 against key j.
            for (int rr = 0; rr < 2; ++rr) {
                const int il = sub + 8 * rr;
                const float dot = score_dot<T, HD>(&sQ[il * LD], &sK[key_l * LD]);
                const float dpv = dot_f32<HD>(&sdO[il * LD], &sV[key_l * LD]);
                float p, ddot;
                const RowStats row = {sRow[il], sRow[2 * BM + il], sRow[3 * BM + il], sRow[BM + il]};
                grad_entry(dot, dpv, row, exact, mods, s, m0 + il, j, win_left, win_right, &p, &ddot);
                sP[il * (BN + 1) + key_l] = p;
                sdS[il * (BN + 1) + key_l] = ddot;
            }
            __syncthreads();

            // Stage 3: dV_j += P^T dO, dK_j += dS^T Q.
            for (int il = 0; il < BM; ++il) {
                const float p = sP[il * (BN + 1) + key_l], ds = sdS[il * (BN + 1) + key_l];
                #pragma unroll
                for (int c = 0; c < CPT; ++c) {
                    dv_acc[c] = fmaf(p, sdO[il * LD + sub + 8 * c], dv_acc[c]);
                    dk_acc[c] = fmaf(ds, sQ[il * LD + sub + 8 * c], dk_acc[c]);
                }
            }
        }
    }

    if (j < s.sk) {
        T* dk_row = tok_ptr(dk, b, dk_sb, s.k0 + j, dk_ss, hk, dk_sh);
        T* dv_row = tok_ptr(dv, b, dv_sb, s.k0 + j, dv_ss, hk, dv_sh);
        #pragma unroll
        for (int c = 0; c < CPT; ++c) {
            const int d = sub + 8 * c;
            if (d < head_dim) dk_row[d] = Elem<T>::from_float(dk_acc[c]);
            if (d < head_dim_v) dv_row[d] = Elem<T>::from_float(dv_acc[c]);
        }
    }
}

template <typename T, int HD>
__global__ void __launch_bounds__(256, 1)
attn_bwd_dq(PA_COMMON_PARAMS, const T* __restrict__ dout, long long do_sb, long long do_ss, long long do_sh,
            const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dq, long long dq_sb,
            long long dq_ss, long long dq_sh, const float* __restrict__ row_m, const float* __restrict__ row_l) {
    constexpr int BM = 16, BN = 32, NT = 256, LD = HD + 1, CPT = HD / 16;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    SmemCarve sm{smem_raw};
    float* sQ = sm.take<float>(BM * LD);
    float* sdO = sm.take<float>(BM * LD);
    float* sK = sm.take<float>(BN * LD);
    float* sV = sm.take<float>(BN * LD);
    float* sdS = sm.take<float>(BM * (BN + 1));

    PA_FMA_ROW_PROLOGUE(BM, 16);

    // Stage 0: this CTA's Q and dO rows, and each row's lse and delta.
    PA_LOAD_QUERY_ROWS_F32(BM, sQ, sdO, s, b, h, m0);
    const long long ridx = row_index(b, h, lse_sb, lse_sh, s, i);
    const bool exact = row_m != nullptr;
    RowStats stats = {PA_NEG_INF, 0.f, 0.f, 0.f};
    if (i < s.sq) {
        stats.lse = lse[ridx];
        stats.delta = delta[ridx];
        if (exact) {
            stats.m = row_m[ridx];
            stats.l = row_l[ridx];
        }
    }
    float dq_acc[CPT];
    #pragma unroll
    for (int c = 0; c < CPT; ++c) dq_acc[c] = 0.f;

    for (int n0 = cta.n_first(BN); n0 < n_hi; n0 += BN) {
        // Stage 1: K and V tiles.
        __syncthreads();
        load_kv_rows_f32<T, BN, HD, LD, LD, NT>(sK, sV, cta, n0, k_ss, v_ss, head_dim, head_dim_v, tid);
        __syncthreads();

        // Stage 2: score gradient of row i against keys sub and sub + 16.
        #pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int jl = sub + 16 * c;
            const float dot = score_dot<T, HD>(&sQ[row * LD], &sK[jl * LD]);
            const float dpv = dot_f32<HD>(&sdO[row * LD], &sV[jl * LD]);
            float p, ddot;
            grad_entry(dot, dpv, stats, exact, mods, s, i, n0 + jl, win_left, win_right, &p, &ddot);
            sdS[row * (BN + 1) + jl] = ddot;
        }
        __syncwarp();   // a row's 16 threads live in one warp

        // Stage 3: dQ_i += dS K.
        for (int jl = 0; jl < BN; ++jl) {
            const float ds = sdS[row * (BN + 1) + jl];
            #pragma unroll
            for (int c = 0; c < CPT; ++c) dq_acc[c] = fmaf(ds, sK[jl * LD + sub + 16 * c], dq_acc[c]);
        }
    }

    if (i < s.sq) {
        T* dst = tok_ptr(dq, b, dq_sb, s.q0 + i, dq_ss, h, dq_sh);
        #pragma unroll
        for (int c = 0; c < CPT; ++c) {
            const int d = sub + 16 * c;
            if (d < head_dim) dst[d] = Elem<T>::from_float(dq_acc[c]);
        }
    }
}
