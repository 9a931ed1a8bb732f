// portattn CuPy backend: the warp-specialized Hopper forward (sm_90a), FA3's structure with
// cp.async instead of TMA.
//
// attn_fwd_wgmma_ws<T, HD, BN, PINGPONG>  the same problems, arguments, outputs and arithmetic
//   per tile as attn_fwd_wgmma (attn_fwd_wgmma.cu; its helpers wg_qk, wg_softmax_pv,
//   wg_epilogue), with the work split by warpgroup instead of one barrier per key tile:
//   * warpgroup 0, the producer (setmaxnreg down to 40 registers): copies Q and the first K/V
//     tile, then each next tile into a ring of 2 stages with cp.async; once a tile's copies
//     landed (cp.async.wait_group 0), fence.proxy.async and an arrive on that stage's `full`
//     mbarrier (128 arrivals; Q on its own); before refilling a stage it waits on its `empty`
//     mbarrier, so each tile loads while the one before it is computed;
//   * warpgroups 1 and 2, the consumers (setmaxnreg up to 232): 64 query rows each; per tile
//     wait on `full`, S = Q K^T, softmax, O += P V, then arrive on `empty` (256 arrivals). The
//     two consumers are not tied to each other by any CTA barrier;
//   * PINGPONG: the consumers take turns issuing S = Q K^T (named barriers 1 and 2, 256 threads:
//     consumer c syncs on 1 + c before its S matmul and arrives on 2 - c after issuing it), so one
//     consumer's softmax runs while the other's matmuls use the tensor cores (FA3's pingpong).
//   Out and lse are bit-identical to attn_fwd_wgmma's (same instructions per tile, same order).

template <typename T, int HD, int BN, bool PINGPONG>
__global__ void __launch_bounds__(384, 1)
attn_fwd_wgmma_ws(PA_COMMON_PARAMS, T* __restrict__ o, long long o_sb, long long o_ss, long long o_sh,
                  float* __restrict__ lse) {
    constexpr int BM = 128;                    // two consumer warpgroups of 64 rows
    constexpr int STAGES = 2;
    constexpr int Q_BYTES = BM * HD * 2;
    constexpr int KV_BYTES = BN * HD * 2;
    static_assert(HD % 64 == 0 && HD <= 256 && BN % 64 == 0 && BN <= 256, "SW128 blocks, one wgmma N");
    static_assert(sizeof(T) == 2, "16-bit elements");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const pa_u32 raw = smem_addr(smem_raw), base = sw128_align(raw);
    unsigned char* gbase = smem_raw + (base - raw);
    const pa_u32 sQ = base;
    const pa_u32 sK = base + Q_BYTES;                  // [STAGES][BN x HD]
    const pa_u32 sV = sK + STAGES * KV_BYTES;          // [STAGES][BN x HD]
    const pa_u32 bar_q = sV + STAGES * KV_BYTES;       // mbarriers: Q, full[STAGES], empty[STAGES]
    const pa_u32 bar_full = bar_q + 8, bar_empty = bar_full + 8 * STAGES;

    const int tid = threadIdx.x, wg = tid / 128;
    PA_ROW_TILE_PROLOGUE(BM, BN);
    const int n_tiles = n_first < n_hi ? (n_hi - n_first + BN - 1) / BN : 0;
    if (tid == 0) {
        mbar_init(bar_q, 128);
        mbar_ring_init<STAGES>(bar_full, bar_empty, 128, 256);
    }
    __syncthreads();

    if (wg == 0) {
        // ----- producer -----
        setmaxnreg_dec<40>();
        load_tile_sw128<T, BM, HD, 128>(sQ, PA_Q_ROW(s, b, h, m0), q_ss, s.sq - m0, head_dim, tid);
        if (n_tiles > 0) {
            load_tile_sw128<T, BN, HD, 128>(sK, cta.k_seq + n_first * k_ss, k_ss, s.sk - n_first, head_dim, tid);
            load_tile_sw128<T, BN, HD, 128>(sV, cta.v_seq + n_first * v_ss, v_ss, s.sk - n_first, head_dim_v, tid);
        }
        cp_async_commit();
        cp_async_wait_all();
        fence_proxy_async();
        mbar_arrive(bar_q);
        if (n_tiles > 0) mbar_arrive(bar_full);
        // tile it into stage it % STAGES once the consumers released it (tile it - STAGES), then
        // publish it as soon as it has landed: each tile loads while the one before is computed
        for (int it = 1; it < n_tiles; ++it) {
            const int st = it % STAGES, n0 = n_first + it * BN;
            if (it >= STAGES) mbar_wait(bar_empty + 8 * st, ((it / STAGES) - 1) & 1);
            load_tile_sw128<T, BN, HD, 128>(sK + st * KV_BYTES, cta.k_seq + n0 * k_ss, k_ss, s.sk - n0, head_dim, tid);
            load_tile_sw128<T, BN, HD, 128>(sV + st * KV_BYTES, cta.v_seq + n0 * v_ss, v_ss, s.sk - n0, head_dim_v,
                                            tid);
            cp_async_commit();
            cp_async_wait_all();
            fence_proxy_async();
            mbar_arrive(bar_full + 8 * st);
        }
        return;
    }

    // ----- consumers -----
    setmaxnreg_inc<232>();
    const int c = wg - 1, wq = (tid / 32) % 4, lane = tid % 32, g = lane / 4, t4 = lane % 4;
    const float scale_log2 = scale * PA_LOG2E;
    float acc[HD / 2];
    float sc[BN / 2];
    zero_floats<HD / 2>(acc);
    zero_floats<BN / 2>(sc);
    float m_i[2] = {PA_NEG_INF, PA_NEG_INF}, l_i[2] = {0.f, 0.f};
    const int lrow = c * 64 + wq * 16 + g;
    const int row0 = m0 + lrow;
    const pa_u32 sQw = sQ + c * 64 * 128;
    if (PINGPONG && c == 1 && n_tiles > 0) named_bar_arrive(1, 256);   // consumer 0 issues first
    mbar_wait(bar_q, 0);
    for (int it = 0; it < n_tiles; ++it) {
        const int st = it % STAGES, n0 = n_first + it * BN;
        mbar_wait(bar_full + 8 * st, (it / STAGES) & 1);
        fence_proxy_async();
        if (PINGPONG) named_bar_sync(1 + c, 256);
        wg_qk<T, HD, BM, BN>(sc, sQw, sK + st * KV_BYTES);
        if (PINGPONG && !(c == 1 && it == n_tiles - 1)) named_bar_arrive(2 - c, 256);
        pa_u32 pa[BN / 16][4];
        wg_softmax_pv<T, HD, BM, BN>(sc, acc, m_i, l_i, pa, sV, st, s, m0, row0, n0, t4, scale_log2, win_left,
                                     win_right);
        mbar_arrive(bar_empty + 8 * st);
    }
    wg_epilogue<T, HD, BM>(acc, m_i, l_i, gbase, lrow, c * 64 + wq * 16, m0, t4, lane, s, b, h, o, o_sb, o_ss, o_sh,
                           lse, lse_sb, lse_sh, head_dim_v);
}
