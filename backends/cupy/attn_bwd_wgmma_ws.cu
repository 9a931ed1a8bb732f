// portattn CuPy backend: the warp-specialized fused-dQ dK/dV kernel (sm_90a; what
// PORTATTN_CUPY_DQ=auto runs, configs.WGMMA_BWD_FUSED_DQ_AUTO_ROLE).
//
// attn_bwd_dkdv_wgmma_ws<T, HD>  the problems, tiles and per-tile products of
//   attn_bwd_dkdv_wgmma<T, HD, 64, 2, false, true> (attn_bwd_wgmma.cu: 128 keys of one kv head
//   per work item, 64-row query tiles, dQ added into a float32 buffer with atomics), with the loads
//   moved to a producer warpgroup, so that no CTA-wide barrier ties the two consumer warpgroups per
//   tile (the fused kernel has two: the tile landed, and the dS^T exchange), and persistent CTAs:
//   * work items (a key tile of a kv head of a batch element, in the order of the fused kernel's
//     grid): a CTA's first is its block index, each next one its producer takes from a counter in
//     global memory (next_item, zeroed before the launch) and publishes through an item slot.
//   * warpgroup 0, the producer (setmaxnreg down to PRODUCER_REGS): per item K and V into one of
//     two K/V buffers, then each query tile's Q, dO (cp.async) and row statistics (lse log2 e,
//     delta: plain stores) into a ring of 2 stages that runs on across items; once a stage's copies
//     landed, fence.proxy.async and an arrive on its `full` mbarrier (128 arrivals), K and V's
//     on `kv_full` with the item's first tile. A stage is refilled after its `empty` mbarrier (256
//     arrivals), a K/V buffer after its `kv_empty` (256).
//   * warpgroups 1 and 2, the consumers (setmaxnreg up to CONSUMER_REGS): keys 64c ... 64c + 63 of
//     the item; per tile: wait on `full`, then S^T, dP^T, P^T, dV, dS^T and dK exactly as the fused
//     kernel, dS^T stored into the dS^T buffer of the tile, dQ, an arrive on `empty`; per item, an
//     arrive on `kv_empty` after its last product, then its dK and dV stored.
//   * dQ: the two consumers' dS^T meet at named barrier 1 (256 threads) and consumer c adds
//     dS K[:, c HD/2 ...] over the item's 128 keys, as the fused kernel does.
//   Two dS^T buffers alternate over the tiles a consumer computes (skipped tiles do not count): a
//   warp stores a tile's dS^T only after the barrier of the tile before, which each reader of the
//   buffer's previous contents passes after its dQ product retired. dK and dV are bit-identical
//   to the fused kernel's (the same products in the same order); dQ's float32 sums differ in
//   order (atomics) as the fused kernel's do between runs.

template <typename T, int HD>
__global__ void __launch_bounds__(384, 1)
attn_bwd_dkdv_wgmma_ws(PA_COMMON_PARAMS, const T* __restrict__ dout, long long do_sb, long long do_ss, long long do_sh,
                       const float* __restrict__ lse, const float* __restrict__ delta, T* __restrict__ dk,
                       long long dk_sb, long long dk_ss, long long dk_sh, T* __restrict__ dv, long long dv_sb,
                       long long dv_ss, long long dv_sh, float* __restrict__ dq_acc, long long dqa_sb,
                       long long dqa_ss, long long dqa_sh, int kv_heads, int batch, int* __restrict__ next_item) {
    constexpr int BM = 64, BN = 128, STAGES = 2, KV_BUFS = 2;
    constexpr int NT = 128;                    // the producer's threads (PA_DKDV_WG_LOAD_QUERY_TILE)
    constexpr int KV_BYTES = BN * HD * 2;      // the K (or V) tile
    constexpr int QT_BYTES = BM * HD * 2;      // one Q (or dO) stage
    constexpr int DS_BYTES = BN * BM * 2;      // one dS^T buffer [BN keys x BM queries]
    static_assert(HD == 64 || HD == 128, "HD: the fused dQ's head dims (one-CTA tiles)");
    static_assert(sizeof(T) == 2, "16-bit elements");
    // registers per thread (setmaxnreg; 128 PRODUCER_REGS + 256 CONSUMER_REGS <= 64512): the consumers
    // hold dK and dV (HD floats), S^T and dP^T (64), P^T and dS^T (32) and a dQ partial
    constexpr int PRODUCER_REGS = HD == 64 ? 56 : 24, CONSUMER_REGS = HD == 64 ? 224 : 240;
    static_assert(128 * PRODUCER_REGS + 256 * CONSUMER_REGS <= 64512, "the register file");
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const pa_u32 raw = smem_addr(smem_raw), base = sw128_align(raw);
    const pa_u32 sKV = base;                               // [KV_BUFS][K | V]
    const pa_u32 sQ = sKV + KV_BUFS * 2 * KV_BYTES;        // [STAGES][BM x HD]
    const pa_u32 sdO = sQ + STAGES * QT_BYTES;             // [STAGES][BM x HD]
    const pa_u32 sdS = sdO + STAGES * QT_BYTES;            // [2][BN x BM] (SW128; 1024-aligned)
    const pa_u32 bar_full = sdS + 2 * DS_BYTES;            // mbarriers: full[STAGES], empty[STAGES],
    const pa_u32 bar_empty = bar_full + 8 * STAGES;        // kv_full[KV_BUFS], kv_empty[KV_BUFS]
    const pa_u32 bar_kv_full = bar_empty + 8 * STAGES;
    const pa_u32 bar_kv_empty = bar_kv_full + 8 * KV_BUFS;
    const pa_u32 slots = bar_kv_empty + 8 * KV_BUFS;       // the items of the CTA's last two: int[2]
    volatile int* item_slot = reinterpret_cast<volatile int*>(smem_raw + (slots - raw));
    float* sL = reinterpret_cast<float*>(smem_raw + (slots + 8 - raw));   // [STAGES][lse2 | delta]

    const int tid = threadIdx.x, wg = tid / 128;
    const int n_x = (seqlen_k + BN - 1) / BN, n_items = n_x * kv_heads * batch;
    if (tid == 0) {
        mbar_ring_init<STAGES>(bar_full, bar_empty, 128, 256);
        mbar_ring_init<KV_BUFS>(bar_kv_full, bar_kv_empty, 128, 256);
    }
    __syncthreads();

    if (wg == 0) {
        // ----- producer: per item, its K and V into K/V buffer n % KV_BUFS (once the consumers
        // released the item before the last there), then tile it into ring stage rt % STAGES once
        // the consumers released tile rt - STAGES, each published as soon as landed (K and V with
        // the first tile) -----
        setmaxnreg_dec<PRODUCER_REGS>();
        int rt = 0;                            // ring tiles loaded, over all items
        for (int n = 0;; ++n) {
            const int kb = n % KV_BUFS;
            if (n >= KV_BUFS) mbar_wait(bar_kv_empty + 8 * kb, ((n / KV_BUFS) - 1) & 1);
            if (tid == 0) item_slot[n % 2] = n == 0 ? (int)blockIdx.x : (int)gridDim.x + atomicAdd(next_item, 1);
            named_bar_sync(4, 128);
            const int item = item_slot[n % 2];
            if (item >= n_items) {             // no work left: the consumers see it through kv_full
                mbar_arrive(bar_kv_full + 8 * kb);
                return;
            }
            PA_KEY_ITEM_PROLOGUE(item, n_x, BN, BM);
            if (n_iter > 0) {                  // K and V land with the first tile (one commit group)
                const pa_u32 sK = sKV + kb * 2 * KV_BYTES;
                load_tile_sw128<T, BN, HD, NT>(sK, cta.k_tile, k_ss, s.sk - cta.n0, head_dim, tid);
                load_tile_sw128<T, BN, HD, NT>(sK + KV_BYTES, cta.v_tile, v_ss, s.sk - cta.n0, head_dim_v, tid);
            }
            for (int it = 0; it < n_iter; ++it, ++rt) {
                const int st = rt % STAGES;
                if (rt >= STAGES) mbar_wait(bar_empty + 8 * st, ((rt / STAGES) - 1) & 1);
                PA_DKDV_WG_LOAD_QUERY_TILE(sQ + st * QT_BYTES, sdO + st * QT_BYTES, sL + st * 2 * BM, walk.head(it),
                                           walk.row0(it));
                cp_async_commit();
                cp_async_wait_all();
                fence_proxy_async();
                if (it == 0) mbar_arrive(bar_kv_full + 8 * kb);
                mbar_arrive(bar_full + 8 * st);
            }
            if (n_iter == 0) mbar_arrive(bar_kv_full + 8 * kb);   // nothing to load: the item alone
        }
    }

    // ----- consumers -----
    setmaxnreg_inc<CONSUMER_REGS>();
    const int c = wg - 1, lane = tid % 32, wq = (tid / 32) % 4, g = lane / 4, t4 = lane % 4;
    const float scale_log2 = scale * PA_LOG2E;
    const int kw = 64 * c;                     // the consumer's first key in the CTA
    pa_u32 pa[BM / 16][4], da[BM / 16][4];     // P^T and dS^T as A fragments
    float st[BM / 2], dpt[BM / 2];             // S^T and dP^T of a tile
    float dk_acc[HD / 2], dv_acc[HD / 2];      // rows (keys) g, g + 8 of the warp's 16
    constexpr int DQ_N = HD / 2;               // columns of the consumer's dQ product
    int rt = 0;                                // ring tiles consumed, over all items
    int dsb = 0;                               // the dS^T buffer of the next computed tile

    for (int n = 0;; ++n) {
        const int kb = n % KV_BUFS;
        mbar_wait(bar_kv_full + 8 * kb, (n / KV_BUFS) & 1);
        const int item = item_slot[n % 2];
        if (item >= n_items) return;
        PA_KEY_ITEM_PROLOGUE(item, n_x, BN, BM);
        const int n0 = cta.n0;
        const int nw0 = n0 + kw;                   // the consumer's first key in the sequence
        const int j0 = nw0 + wq * 16 + g;          // this thread's keys: j0, j0 + 8
        const pa_u32 sK = sKV + kb * 2 * KV_BYTES;
        const pa_u32 sKw = sK + kw * 128, sVw = sK + KV_BYTES + kw * 128;   // 8-row groups are 1024 B
        zero_floats<HD / 2>(dk_acc);
        zero_floats<HD / 2>(dv_acc);

        for (int it = 0; it < n_iter; ++it, ++rt) {
            const int stg = rt % STAGES, m0 = walk.row0(it);
            mbar_wait(bar_full + 8 * stg, (rt / STAGES) & 1);
            // uniform per CTA (both consumers meet at named barrier 1)
            if (!tile_any_visible(s, m0, BM, n0, BN, win_left, win_right)) {
                mbar_arrive(bar_empty + 8 * stg);
                continue;
            }
            fence_proxy_async();
            const pa_u32 sQb = sQ + stg * QT_BYTES, sdOb = sdO + stg * QT_BYTES, sdSb = sdS + dsb * DS_BYTES;
            const float* lse2_t = sL + stg * 2 * BM;

            // S^T = K_c Q^T and dP^T = V_c dO^T, two commit groups
            zero_floats<BM / 2>(st);
            zero_floats<BM / 2>(dpt);
            wg_qk<T, HD, BN, BM>(st, opaque_u32(sKw), sQb);
            wg_qk<T, HD, BN, BM>(dpt, opaque_u32(sVw), sdOb);
            // S^T landed: P^T in place, re-packed; dV_c += P^T dO issued
            wgmma_wait<1>();
            wgmma_fence_acc<BM>(st);
            const bool check = tile_needs_mask(s, m0, BM, nw0, 64, win_left, win_right);
            wg_probs_keys<BM>(st, lse2_t, check, s, j0, m0, t4, scale_log2, win_left, win_right);
            acc_to_a_frags<T, BM>(pa, st);
            wg_pv<T, HD, BM>(dv_acc, pa, sdOb, 1);
            // dP^T landed: dS^T in place, re-packed, stored for dQ; dK_c += dS^T Q issued
            wgmma_wait<1>();
            wgmma_fence_acc<BM>(dpt);
            wg_dscores_keys<BM>(st, dpt, lse2_t + BM, t4);
            acc_to_a_frags<T, BM>(da, dpt);
            store_ds_t<BM>(sdSb + kw * 128, da, wq, g, t4);
            wg_pv<T, HD, BM>(dk_acc, da, sQb, 1);
            // dV retired (dK still runs): P^T's fragments free for dQ's accumulators; the dS^T this
            // dQ reads stored and visible to wgmma
            wgmma_wait<1>();
            fence_proxy_async();
            named_bar_sync(1, 256);
            const int h = walk.head(it), row_w = m0 + wq * 16;
            float* const dq_rows = tok_ptr(dq_acc, b, dqa_sb, s.q0 + row_w, dqa_ss, h, dqa_sh);
            {
                // a fresh partial, set by its chain's first k-step (scale-d 0)
                float dq_part[DQ_N / 2];
                const int dq_col = c * DQ_N;   // K's columns dq_col ... (SW128 blocks of 64)
                const pa_u32 sk_col = sK + (dq_col / 64) * (BN * 128) + (dq_col % 64) * 2;
                wg_ds_k<T, DQ_N, BN>(dq_part, opaque_u32(sdSb), opaque_u32(sk_col));
                wgmma_wait<0>();
                wgmma_fence_acc<DQ_N>(dq_part);
                mbar_arrive(bar_empty + 8 * stg);   // dK retired: Q, dO and the stats are read
                red_acc_rows<DQ_N>(dq_rows + dq_col, dqa_ss, dq_part, s.sq - row_w, head_dim - dq_col, g, t4);
            }
            wgmma_fence_acc<HD>(dv_acc);
            wgmma_fence_acc<HD>(dk_acc);
            dsb ^= 1;
        }
        // every product of the item retired (dQ's wait_group 0): K and V are read
        mbar_arrive(bar_kv_empty + 8 * kb);
        if (cta.empty()) continue;

        // Epilogue: the warp's 16 keys of dK (times the softmax scale) and dV; keys past the
        // sequence end and columns past the head dims are not stored.
        const int key_w = nw0 + wq * 16;
        scale_floats<HD / 2>(dk_acc, scale);
        store_acc_rows<T, HD / 8>(tok_ptr(dk, b, dk_sb, s.k0 + key_w, dk_ss, cta.hk, dk_sh), dk_ss,
                                  reinterpret_cast<const float (*)[4]>(dk_acc), s.sk - key_w, 0, head_dim, g, t4);
        store_acc_rows<T, HD / 8>(tok_ptr(dv, b, dv_sb, s.k0 + key_w, dv_ss, cta.hk, dv_sh), dv_ss,
                                  reinterpret_cast<const float (*)[4]>(dv_acc), s.sk - key_w, 0, head_dim_v, g, t4);
    }
}
