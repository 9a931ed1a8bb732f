// portattn CuPy backend: sm_90a helpers of the wgmma kernels (attn_fwd_wgmma.cu, attn_fwd_wgmma_ws.cu,
// attn_bwd_wgmma.cu).
//
// Shared-memory tile layout "SW128" (what a wgmma matrix descriptor with 128-byte swizzling
// reads): a [ROWS x HD] tile of 16-bit elements is stored as HD / 64 column blocks of
// ROWS x 64 elements (ROWS * 128 bytes each); row r of a block starts at byte 128 r and its
// 16-byte chunk c (elements 8c ... 8c + 7 of the block) sits at chunk position c ^ (r % 8).
// The tile base must be 1024-byte aligned: the hardware applies the XOR to address bits
// [4, 7) from bits [7, 10) of the absolute shared address.
//  * K-major operand (Q and K in S = Q K^T: rows = M or N, the 64 columns = K): SBO = 1024
//    (the next 8 rows), LBO unused (1); the k16 step kk inside a block adds 32 kk bytes to the
//    start address, the next 64-column block adds ROWS * 128.
//  * MN-major operand (V in O += P V: rows = K = keys, columns = N = head dim; trans-b = 1):
//    LBO = ROWS * 128 (the next 64 head-dim columns), SBO = 1024 (the next 8 keys); the k16 step
//    kk adds 16 kk rows = 2048 kk bytes.

// The first 1024-byte aligned shared address from raw on: SW128 tile bases must be (the kernels'
// smem_bytes in configs.KernelConfig add the 1 KB of slack).
__device__ __forceinline__ pa_u32 sw128_align(pa_u32 raw) { return (raw + 1023u) & ~1023u; }

// A thread of a warpgroup kernel: its warpgroup wg (128 threads), warp wq inside it, lane, and the
// fragment coordinates g = lane / 4 (row), t4 = lane % 4 (column pair).
struct WgLane {
    int tid, wg, wq, lane, g, t4;
};
__device__ __forceinline__ WgLane wg_lane() {
    WgLane w;
    w.tid = threadIdx.x;
    w.wg = w.tid / 128;
    w.wq = (w.tid / 32) % 4;
    w.lane = w.tid % 32;
    w.g = w.lane / 4;
    w.t4 = w.lane % 4;
    return w;
}

template <int N>
__device__ __forceinline__ void zero_floats(float* x) {
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = 0.f;
}

// A thread's part of a 16-row x N float accumulator in the wgmma / mma layout (element 4 nb + e:
// row r0 + 8 (e / 2), column 8 nb + 2 t4 + e % 2; r0 = the thread's first row) into the row-major
// float32 matrix out of N columns (the layout probe's S and O).
template <int N>
__device__ __forceinline__ void store_acc_f32(float* out, const float* acc, int r0, int t4) {
#pragma unroll
    for (int nb = 0; nb < N / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) out[(r0 + (e / 2) * 8) * N + nb * 8 + 2 * t4 + (e % 2)] = acc[4 * nb + e];
}

// Byte offset of (row r, column col) in a SW128 tile of ROWS rows; col a multiple of 8.
template <int ROWS>
__device__ __forceinline__ pa_u32 sw128_offset(int r, int col) {
    return (pa_u32)((col / 64) * (ROWS * 128) + r * 128 + ((((col % 64) / 8) ^ (r % 8)) * 16));
}

// 16-byte asynchronous copy global -> shared (32-bit shared address); zero-filled past src_bytes.
__device__ __forceinline__ void cp_async16_s(pa_u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// Global -> shared SW128 copy of a [ROWS x HD] tile (rows row_stride elements apart), zero-filling
// rows >= rows_valid and columns >= cols_valid (a multiple of 8); NT threads. Thread tid copies the
// 16-byte chunk at column (tid % CPR) * 8 of rows tid / CPR + i * NT / CPR, i < ROWS * CPR / NT: a
// fixed trip count with the column, its bound and the first row's addresses worked out once, so
// each copy costs a row test, an address step and the cp.async (the per-chunk div/mod and bounds
// of a tid-strided loop were ~25 instructions a copy on sm_90a). When NT / CPR is a multiple of 8
// the swizzle phase (r % 8) is the same in every pass and the shared offset steps by a constant.
template <typename T, int ROWS, int HD, int NT>
__device__ __forceinline__ void load_tile_sw128(pa_u32 sbase, const T* g, long long row_stride, int rows_valid,
                                                int cols_valid, int tid) {
    constexpr int CPR = HD / 8;   // 16-byte chunks per row
    static_assert(NT % CPR == 0 && (ROWS * CPR) % NT == 0, "whole rows per pass, whole passes per tile");
    constexpr int RSTEP = NT / CPR, PASSES = ROWS * CPR / NT;
    const int r0 = tid / CPR, col = (tid % CPR) * 8;
    const bool col_ok = col < cols_valid;
    const T* src = g + (long long)r0 * row_stride + col;
    const long long step = (long long)RSTEP * row_stride;
    // fully unrolled up to 8 passes (every consumer-side load); the 16 passes of a 128-thread
    // producer at HD 256 in fours, which its 40 registers hold without spilling
#pragma unroll(PASSES <= 8 ? PASSES : 4)
    for (int i = 0; i < PASSES; ++i) {
        const int r = r0 + i * RSTEP;
        const bool ok = col_ok && r < rows_valid;
        const pa_u32 dst = RSTEP % 8 == 0 ? sbase + sw128_offset<ROWS>(r0, col) + i * RSTEP * 128
                                          : sbase + sw128_offset<ROWS>(r, col);
        cp_async16_s(dst, ok ? src + i * step : g, ok ? 16 : 0);
    }
}

// The K and V tiles of keys n ... n + ROWS - 1 of a row CTA (rows past the sequence and columns past
// the head dims zero-filled) into the SW128 tiles sk / sv.
template <typename T, int ROWS, int HD, int NT>
__device__ __forceinline__ void load_kv_sw128(pa_u32 sk, pa_u32 sv, const RowCta<T>& cta, int n, long long k_ss,
                                              long long v_ss, int head_dim, int head_dim_v, int tid) {
    load_tile_sw128<T, ROWS, HD, NT>(sk, cta.k_seq + n * k_ss, k_ss, cta.s.sk - n, head_dim, tid);
    load_tile_sw128<T, ROWS, HD, NT>(sv, cta.v_seq + n * v_ss, v_ss, cta.s.sk - n, head_dim_v, tid);
}

// wgmma shared-memory matrix descriptor, 128-byte swizzle (PTX ISA "Matrix Descriptor"): start
// address, leading and stride byte offsets in 16-byte units, base offset 0 (1024-aligned atoms),
// layout type 1 (128B) in bits 62-63.
__device__ __forceinline__ unsigned long long sw128_desc(pa_u32 saddr, pa_u32 lbo, pa_u32 sbo) {
    return (unsigned long long)((saddr & 0x3FFFF) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// PTX ISA 9.7.15.7.1 (wgmma.fence): a register that a wgmma.mma_async reads or writes (accumulator
// or A fragment) must be accessed by ordinary instructions only before the wgmma.fence that precedes
// it. The compiler knows nothing of that fence, so an empty asm that "modifies" each register sits in
// front of it (CUTLASS's warpgroup_fence_operand): every earlier write or read of the register is
// ordered before the asm, and the asm (volatile) before the fence. wgmma_fence_acc<N> does this for
// the N / 2 accumulators of an m64nNk16 wgmma (after its wait, too: the compiler then neither reads
// nor moves them across an outstanding wgmma), fence_a_frags for the A fragments of P.
// (Written as a fold over 0 ... N / 2 - 1, not a loop: straight-line code from the start, as the
// asm statements it replaces were; an unrolled loop renames and reorders registers in the PTX.)
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x)::"memory"); }
template <int... I> struct PaIndexSeq {};
template <int N, int... I> struct PaMakeIndexSeq : PaMakeIndexSeq<N - 1, N - 1, I...> {};
template <int... I> struct PaMakeIndexSeq<0, I...> { typedef PaIndexSeq<I...> type; };
template <int... I>
__device__ __forceinline__ void fence_operands(float* d, PaIndexSeq<I...>) { (fence_operand(d[I]), ...); }
template <int N>
__device__ __forceinline__ void wgmma_fence_acc(float* d) {
    fence_operands(d, typename PaMakeIndexSeq<N / 2>::type());
}
template <int NK>
__device__ __forceinline__ void fence_a_frags(pa_u32 (*p)[4]) {
#pragma unroll
    for (int kk = 0; kk < NK; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(p[kk][j])::"memory");
}
// Ordinary (generic-proxy) shared-memory writes, cp.async included, made visible to wgmma.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Every thread's cp.async copies into shared memory have landed and are visible to the async proxy
// (wgmma): this thread's copies waited for, fence.proxy.async, then a CTA barrier (which also says
// every warpgroup is past its earlier reads of the buffers the next copies refill).
__device__ __forceinline__ void cta_tiles_landed() {
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
}

// One step of a row CTA's double-buffered K/V walk (K and V buffers kv_bytes apart): the tile in
// buffer buf landed (this thread's copies), is visible to the async proxy (wgmma), every thread's
// copies are done and every warpgroup finished with the other buffer; the next tile, keys n_next ...,
// is then prefetched into that buffer when n_next < n_hi.
template <typename T, int ROWS, int HD, int NT>
__device__ __forceinline__ void kv_walk_step(pa_u32 sk, pa_u32 sv, int kv_bytes, int buf, const RowCta<T>& cta,
                                             int n_next, int n_hi, long long k_ss, long long v_ss, int head_dim,
                                             int head_dim_v, int tid) {
    cta_tiles_landed();
    if (n_next < n_hi) {
        load_kv_sw128<T, ROWS, HD, NT>(sk + (buf ^ 1) * kv_bytes, sv + (buf ^ 1) * kv_bytes, cta, n_next, k_ss, v_ss,
                                       head_dim, head_dim_v, tid);
        cp_async_commit();
    }
}

// One warpgroup: s[64 x BN] = Q_wg[64 x HD] K^T (issued and committed, not waited for). sq: the
// warpgroup's first Q row inside a SW128 tile of BM rows; sk: a SW128 tile of BN keys.
template <typename T, int HD, int BM, int BN>
__device__ __forceinline__ void wg_qk(float* s, pa_u32 sq, pa_u32 sk) {
    wgmma_fence_acc<BN>(s);   // every earlier access to s (P's repack) stays before the wgmma.fence
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        const pa_u32 oq = (kk / 4) * (BM * 128) + (kk % 4) * 32;
        const pa_u32 ok = (kk / 4) * (BN * 128) + (kk % 4) * 32;
        wgmma_ss<T, BN>(s, sw128_desc(sq + oq, 16, 1024), sw128_desc(sk + ok, 16, 1024), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
}

// One warpgroup: o[64 x HD] += P[64 x BN] V (issued and committed). p: P as BN / 16 A fragments
// (the m16n8k16 A layout per warp); sv: a SW128 tile of BN keys x HD columns; acc_in 0: o = P V
// (the first k-step ignores o's values: an accumulator that no ordinary instruction zeroes, which
// ptxas requires of one left in flight across a loop's back edge); lbo / sbo: the MN-major
// descriptor's offsets (the kernel's are the defaults; the probe passes them at run time so that
// tools/cupy_wgmma_check.py can tell a swapped pair from other mistakes).
template <typename T, int HD, int BN>
__device__ __forceinline__ void wg_pv(float* o, pa_u32 (*p)[4], pa_u32 sv, int acc_in = 1, pa_u32 lbo = BN * 128,
                                      pa_u32 sbo = 1024) {
    wgmma_fence_acc<HD>(o);   // the rescaled accumulators and P are written before the wgmma.fence
    fence_a_frags<BN / 16>(p);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
        wgmma_rs<T, HD>(o, p[kk], sw128_desc(sv + kk * 2048, lbo, sbo), kk > 0 ? 1 : acc_in);
    wgmma_commit();
}

// The S accumulator (BN / 2 floats: n8 block i holds rows g, g + 8 at 4i + {0, 1}, 4i + {2, 3})
// as BN / 16 A fragments of 16-bit P (the accumulator layout is the A layout, element for element).
template <typename T, int BN>
__device__ __forceinline__ void acc_to_a_frags(pa_u32 (*p)[4], const float* s) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        p[kk][0] = Elem<T>::pack2(s[8 * kk + 0], s[8 * kk + 1]);
        p[kk][1] = Elem<T>::pack2(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = Elem<T>::pack2(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = Elem<T>::pack2(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

// ----- mbarriers, named barriers, register reallocation (the warp-specialized forward) -------
__device__ __forceinline__ void mbar_init(pa_u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(pa_u32 bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// Block until the phase with parity `parity` of the mbarrier has completed.
__device__ __forceinline__ void mbar_wait(pa_u32 bar, int parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// Named barriers 1... (0 is __syncthreads): `count` threads in all, syncing or arriving.
__device__ __forceinline__ void named_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One thread: the `full` (full_count arrivals) and `empty` (empty_count) mbarriers of a ring of
// STAGES stages (8 bytes apart each), then the fence that publishes them and any initialised
// before; the caller's __syncthreads follows.
template <int STAGES>
__device__ __forceinline__ void mbar_ring_init(pa_u32 bar_full, pa_u32 bar_empty, int full_count, int empty_count) {
#pragma unroll
    for (int st = 0; st < STAGES; ++st) {
        mbar_init(bar_full + 8 * st, full_count);
        mbar_init(bar_empty + 8 * st, empty_count);
    }
    fence_mbarrier_init();
}
