// portattn CuPy backend: shared device helpers.
//
// The source needs no header: element types, conversions, tensor-core and async-copy
// instructions are written here with inline PTX, so NVRTC compiles it with no include path
// (the CI compile check and CuPy at run time see exactly the same text). The Python side
// concatenates attn_common.cuh, attn_fwd.cu, attn_bwd.cu and attn_bwd_mma.cu into one translation
// unit (configs.SOURCE_FILES).
//
// Conventions used by every kernel:
//  * the tensor-core forward keeps scores in base 2: s2 = log2(e) * score, so softmax uses
//    exp2 and the scale is folded into one multiply (scale_log2 = scale * log2(e)); the float32
//    kernels stay in natural units (expf/logf), so that float32 results carry no extra
//    rounding from the base change (docs/semantics.md compares them with plain float32 math);
//  * a query row i of a sequence with Sq rows and Sk keys sees key j iff
//      j < Sk  and  i' - left <= j <= i' + right,   i' = i + off_mask
//    where off_mask = Sk - Sq (bottom-right alignment) or 0 (top-left); an unbounded side is
//    passed as a large number (1 << 30);
//  * a row with no visible key has m = -inf, l = 0: its output is 0 and its lse is -inf.

typedef unsigned short pa_u16;
typedef unsigned int pa_u32;

struct pa_half { pa_u16 bits; };   // IEEE binary16 storage
struct pa_bf16 { pa_u16 bits; };   // bfloat16 storage

#define PA_LOG2E 1.4426950408889634f
#define PA_LN2 0.6931471805599453f
#define PA_NEG_INF __int_as_float(0xff800000)

enum BiasKind { BIAS_NONE = 0, BIAS_F32 = 1, BIAS_F16 = 2, BIAS_BF16 = 3, BIAS_BOOL = 4 };

// ----- element conversions -----------------------------------------------------------------
__device__ __forceinline__ float half_bits_to_float(pa_u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float bf16_bits_to_float(pa_u16 h) {
    return __uint_as_float(((pa_u32)h) << 16);
}

template <typename T> struct Elem;
template <> struct Elem<float> {
    static __device__ __forceinline__ float to_float(float x) { return x; }
    static __device__ __forceinline__ float from_float(float x) { return x; }
};
template <> struct Elem<pa_half> {
    static __device__ __forceinline__ float to_float(pa_half x) { return half_bits_to_float(x.bits); }
    static __device__ __forceinline__ pa_half from_float(float x) {
        pa_half h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
        return h;
    }
    // two floats -> one 32-bit register of two halves, `lo` in the low 16 bits
    static __device__ __forceinline__ pa_u32 pack2(float lo, float hi) {
        pa_u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};
template <> struct Elem<pa_bf16> {
    static __device__ __forceinline__ float to_float(pa_bf16 x) { return bf16_bits_to_float(x.bits); }
    static __device__ __forceinline__ pa_bf16 from_float(float x) {
        pa_bf16 h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
        return h;
    }
    static __device__ __forceinline__ pa_u32 pack2(float lo, float hi) {
        pa_u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float fast_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ----- per-sequence geometry ---------------------------------------------------------------
struct SeqInfo {
    int sq, sk;            // this sequence's query rows and keys
    long long q0, k0;      // first token of the sequence in the (packed) q / k tensors
    int off_mask;          // i' = i + off_mask for causal/window
    int off_alibi;         // ALiBi distance uses i + Sk - Sq - j always (docs/semantics.md)
};

// (start, length) of sequence b from cu_seqlens, clamped so that a bad one (its contents are not
// validated under torch.compile or graph capture) never reads or writes out of bounds: start
// and end in [0, total], end >= start, length <= max_len (docs/semantics.md).
__device__ __forceinline__ void seq_span(const int* cu, int b, int max_len, int total, long long* start, int* len) {
    const int s = min(max(cu[b], 0), total);
    const int e = min(max(cu[b + 1], s), total);
    *start = s;
    *len = min(e - s, max_len);
}

__device__ __forceinline__ SeqInfo seq_info(int b, const int* cu_q, const int* cu_k, int seqlen_q,
                                            int seqlen_k, int total_q, int total_k, int top_left) {
    SeqInfo s;
    if (cu_q != nullptr) {
        seq_span(cu_q, b, seqlen_q, total_q, &s.q0, &s.sq);
        seq_span(cu_k, b, seqlen_k, total_k, &s.k0, &s.sk);
    } else {
        s.q0 = 0;
        s.k0 = 0;
        s.sq = seqlen_q;
        s.sk = seqlen_k;
    }
    s.off_alibi = s.sk - s.sq;
    s.off_mask = top_left ? 0 : s.off_alibi;
    return s;
}

// Keys [lo, hi) that any of the rows [r_lo, r_hi] can see.
__device__ __forceinline__ void key_range(const SeqInfo& s, int r_lo, int r_hi, int left, int right,
                                          int* lo, int* hi) {
    long long a = (long long)r_lo + s.off_mask - left;
    long long b = (long long)r_hi + s.off_mask + right + 1;
    *lo = (int)(a < 0 ? 0 : a);
    *hi = (int)(b > s.sk ? s.sk : b);
}

// Query rows [lo, hi) that any of the keys [c_lo, c_hi] is seen by.
__device__ __forceinline__ void row_range(const SeqInfo& s, int c_lo, int c_hi, int left, int right,
                                          int* lo, int* hi) {
    long long a = (long long)c_lo - right - s.off_mask;
    long long b = (long long)c_hi + left - s.off_mask + 1;
    *lo = (int)(a < 0 ? 0 : a);
    *hi = (int)(b > s.sq ? s.sq : b);
}

// ----- CTA prologues ---------------------------------------------------------------------------
// Element pointer of token `tok`, head `h` of batch entry `b` in a (batch, token, head, d) tensor
// with element strides sb / ss / sh (varlen: sb = 0 and tok counts packed tokens).
template <typename T>
__device__ __forceinline__ T* tok_ptr(T* p, int b, long long sb, long long tok, long long ss, int h, long long sh) {
    return p + b * sb + tok * ss + h * sh;
}

// Index of row i (in-sequence) of head h in the float32 lse / delta / row-stat arrays.
__device__ __forceinline__ long long row_index(int b, int h, long long lse_sb, long long lse_sh, const SeqInfo& s,
                                               int i) {
    return b * lse_sb + h * lse_sh + s.q0 + i;
}

// A CTA that owns query rows [m0, m0 + bm) of query head h (grid: x = row tile, y = head,
// z = batch): its sequence (clamped, seq_info), kv head, the keys [n_lo, n_hi) any of its rows
// can see, and where that sequence's keys start in k and v (kv head hk; key j is
// k_seq + j * k_ss). The caller returns when empty().
// Row tiles run last-first (tile gridDim.x - 1 - blockIdx.x): with causal masking the last rows
// see the most keys, so the longest CTAs start first and the short ones fill the last wave
// (the order is a permutation of the tiles, nothing else changes; dK/dV CTAs, keyed by key tile,
// already start with the longest: the first keys are seen by the most rows).
template <typename T>
struct RowCta {
    SeqInfo s;
    int b, h, hk, m0, n_lo, n_hi;
    const T* k_seq;
    const T* v_seq;
    __device__ __forceinline__ bool empty() const { return m0 >= s.sq; }
    // the first key tile of width bn (tiles are aligned to multiples of bn)
    __device__ __forceinline__ int n_first(int bn) const { return (n_lo / bn) * bn; }
};
template <typename T>
__device__ __forceinline__ RowCta<T> row_cta(int bm, const int* cu_q, const int* cu_k, int seqlen_q, int seqlen_k,
                                             int total_q, int total_k, int top_left, int gqa_ratio, int left,
                                             int right, const T* k, long long k_sb, long long k_ss, long long k_sh,
                                             const T* v, long long v_sb, long long v_ss, long long v_sh) {
    RowCta<T> c;
    c.b = blockIdx.z;
    c.h = blockIdx.y;
    c.hk = c.h / gqa_ratio;
    c.s = seq_info(c.b, cu_q, cu_k, seqlen_q, seqlen_k, total_q, total_k, top_left);
    c.m0 = (gridDim.x - 1 - blockIdx.x) * bm;
    key_range(c.s, c.m0, c.m0 + bm - 1, left, right, &c.n_lo, &c.n_hi);
    c.k_seq = tok_ptr(k, c.b, k_sb, c.s.k0, k_ss, c.hk, k_sh);
    c.v_seq = tok_ptr(v, c.b, v_sb, c.s.k0, v_ss, c.hk, v_sh);
    return c;
}

// A CTA that owns keys [n0, n0 + bn) of kv head hk (grid: x = key tile, y = kv head, z = batch):
// its sequence, the query rows [r_lo, r_hi) that see any of its keys, and where its own key
// rows start in k and v (k_tile = key n0). The caller returns when empty().
template <typename T>
struct KeyCta {
    SeqInfo s;
    int b, hk, n0, r_lo, r_hi;
    const T* k_tile;
    const T* v_tile;
    __device__ __forceinline__ bool empty() const { return n0 >= s.sk; }
};
// key_cta_at: the same for key tile x of kv head hk in batch b (a persistent kernel's work item).
template <typename T>
__device__ __forceinline__ KeyCta<T> key_cta_at(int x, int hk, int b, int bn, const int* cu_q, const int* cu_k,
                                                int seqlen_q, int seqlen_k, int total_q, int total_k, int top_left,
                                                int left, int right, const T* k, long long k_sb, long long k_ss,
                                                long long k_sh, const T* v, long long v_sb, long long v_ss,
                                                long long v_sh) {
    KeyCta<T> c;
    c.b = b;
    c.hk = hk;
    c.s = seq_info(c.b, cu_q, cu_k, seqlen_q, seqlen_k, total_q, total_k, top_left);
    c.n0 = x * bn;
    row_range(c.s, c.n0, c.n0 + bn - 1, left, right, &c.r_lo, &c.r_hi);
    c.k_tile = tok_ptr(k, c.b, k_sb, c.s.k0 + c.n0, k_ss, c.hk, k_sh);
    c.v_tile = tok_ptr(v, c.b, v_sb, c.s.k0 + c.n0, v_ss, c.hk, v_sh);
    return c;
}
template <typename T>
__device__ __forceinline__ KeyCta<T> key_cta(int bn, const int* cu_q, const int* cu_k, int seqlen_q, int seqlen_k,
                                             int total_q, int total_k, int top_left, int left, int right, const T* k,
                                             long long k_sb, long long k_ss, long long k_sh, const T* v,
                                             long long v_sb, long long v_ss, long long v_sh) {
    return key_cta_at<T>(blockIdx.x, blockIdx.y, blockIdx.z, bn, cu_q, cu_k, seqlen_q, seqlen_k, total_q, total_k,
                         top_left, left, right, k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh);
}

// The prologues above and the score terms of (b, h), from a kernel's PA_COMMON_PARAMS.
#define PA_KV_ARGS k, k_sb, k_ss, k_sh, v, v_sb, v_ss, v_sh
#define PA_ROW_CTA(BM)                                                                                          \
    row_cta<T>((BM), cu_q, cu_k, seqlen_q, seqlen_k, total_q, total_k, top_left, gqa_ratio, win_left, win_right, \
               PA_KV_ARGS)
#define PA_KEY_CTA(BN) \
    key_cta<T>((BN), cu_q, cu_k, seqlen_q, seqlen_k, total_q, total_k, top_left, win_left, win_right, PA_KV_ARGS)
// Work item ITEM of a persistent dK/dV kernel over NX key tiles of BN: the KeyCta a grid
// (NX, kv_heads, batch) gives block (ITEM % NX, ITEM / NX % kv_heads, ITEM / NX / kv_heads).
#define PA_KEY_ITEM(ITEM, NX, BN)                                                                              \
    key_cta_at<T>((ITEM) % (NX), (ITEM) / (NX) % kv_heads, (ITEM) / (NX) / kv_heads, (BN), cu_q, cu_k, seqlen_q, \
                  seqlen_k, total_q, total_k, top_left, win_left, win_right, PA_KV_ARGS)
#define PA_MODS(B, H) \
    make_mods(scale, softcap, alibi, alibi_sb, bias, bias_kind, bias_sb, bias_sh, bias_si, bias_sj, (B), (H))
// The tensor-core kernels' score terms: all of them with EXTRAS; otherwise only the scale (the
// plain kernels read nothing else, and must not read alibi / bias).
#define PA_MODS_IF(EXTRAS, B, H) ((EXTRAS) ? PA_MODS(B, H) : plain_mods(scale))

// The prologue of every row kernel: its RowCta of BM query rows; declares cta and s (its
// sequence), and returns from a CTA past its sequence's rows.
#define PA_ROW_CTA_PROLOGUE(BM)                                                     \
    const RowCta<T> cta = PA_ROW_CTA(BM);                                           \
    if (cta.empty()) return;                                                        \
    const SeqInfo& s = cta.s

// The prologue of the tensor-core row kernels (the forwards and dQ, mma.sync and sm_90a) that
// walk key tiles of BN: PA_ROW_CTA_PROLOGUE, and b, h, m0, n_hi and n_first (the first key tile).
#define PA_ROW_TILE_PROLOGUE(BM, BN)                                                \
    PA_ROW_CTA_PROLOGUE(BM);                                                        \
    const int b = cta.b, h = cta.h, m0 = cta.m0, n_hi = cta.n_hi, n_first = cta.n_first(BN)

// The prologue of the dK/dV kernels: their KeyCta of BN keys; declares cta, s, b, hk and n0 (the
// first key), and returns from a CTA past its sequence's keys.
#define PA_KEY_CTA_PROLOGUE(BN)                                                     \
    const KeyCta<T> cta = PA_KEY_CTA(BN);                                           \
    if (cta.empty()) return;                                                        \
    const SeqInfo& s = cta.s;                                                       \
    const int b = cta.b, hk = cta.hk, n0 = cta.n0

// The prologue of a persistent key kernel's work item ITEM (PA_KEY_ITEM, NX key tiles of BN keys
// a sequence): declares cta, s, b and the item's query-tile walk of BM-row tiles, with n_iter its
// iterations (0 for an item past its sequence's keys, which no query row sees). Used by each
// warpgroup role that decodes the item (the warp-specialized backward of the sm_90a module).
#define PA_KEY_ITEM_PROLOGUE(ITEM, NX, BN, BM)                                      \
    const KeyCta<T> cta = PA_KEY_ITEM(ITEM, NX, BN);                                \
    const SeqInfo& s = cta.s;                                                       \
    const int b = cta.b;                                                            \
    const QueryTileWalk<BM> walk(cta.hk, gqa_ratio, cta.r_lo, cta.r_hi);            \
    const int n_iter = cta.empty() ? 0 : walk.n_iter

// The prologue of the FMA row kernels (float32 forward, stats, dQ): TPR threads per query row,
// thread tid owns row i = m0 + tid / TPR with sub = tid % TPR; declares tid, row, sub, cta, s, b,
// h, m0, n_hi, i and mods, and returns from a CTA past its sequence's rows.
#define PA_FMA_ROW_PROLOGUE(BM, TPR)                                                \
    const int tid = threadIdx.x, row = tid / (TPR), sub = tid % (TPR);              \
    PA_ROW_CTA_PROLOGUE(BM);                                                        \
    const int b = cta.b, h = cta.h, m0 = cta.m0, n_hi = cta.n_hi, i = m0 + row;     \
    const ScoreMods mods = PA_MODS(b, h)

// The query tiles a dK/dV CTA walks: for each of the gqa_ratio query heads of kv head hk, the
// BM-row tiles from m_first (r_lo rounded down to BM) that cover the rows [r_lo, r_hi) seeing
// its keys. Iteration it (0 <= it < n_iter, n_iter = 0 when no row sees them) is head head(it),
// rows row0(it) ... row0(it) + BM - 1.
template <int BM>
struct QueryTileWalk {
    int h_first, m_first, n_mt, n_iter;
    __device__ __forceinline__ QueryTileWalk(int hk, int gqa_ratio, int r_lo, int r_hi) {
        h_first = hk * gqa_ratio;
        m_first = (r_lo / BM) * BM;
        n_mt = r_hi > r_lo ? (r_hi - m_first + BM - 1) / BM : 0;
        n_iter = n_mt * gqa_ratio;
    }
    __device__ __forceinline__ int head(int it) const { return h_first + it / n_mt; }
    __device__ __forceinline__ int row0(int it) const { return m_first + (it % n_mt) * BM; }
};

// Row r of the query-side tensors q / dO (head h, batch b) in a row CTA's sequence.
#define PA_Q_ROW(S, B, H, R) tok_ptr(q, (B), q_sb, (S).q0 + (R), q_ss, (H), q_sh)
#define PA_DO_ROW(S, B, H, R) tok_ptr(dout, (B), do_sb, (S).q0 + (R), do_ss, (H), do_sh)

// Coordinates of a thread in a CTA of warps: tid, warp, lane and the mma fragment coordinates
// g = lane / 4 (row of an accumulator), t4 = lane % 4 (column pair).
struct WarpLane {
    int tid, warp, lane, g, t4;
};
__device__ __forceinline__ WarpLane warp_lane() {
    WarpLane w;
    w.tid = threadIdx.x;
    w.warp = w.tid / 32;
    w.lane = w.tid % 32;
    w.g = w.lane / 4;
    w.t4 = w.lane % 4;
    return w;
}

// Consecutive regions of a kernel's dynamic shared memory, in declaration order.
struct SmemCarve {
    unsigned char* p;
    template <typename U>
    __device__ __forceinline__ U* take(int n) {
        U* r = reinterpret_cast<U*>(p);
        p += (long long)n * sizeof(U);
        return r;
    }
};

// Does a key tile [n0, n0+bn) need a per-element mask for the rows [m0, m0+bm): does it cross
// the key sequence end or the causal / window boundary of any of the rows?
__device__ __forceinline__ bool keys_need_mask(const SeqInfo& s, int m0, int bm, int n0, int bn, int left, int right) {
    return (n0 + bn > s.sk) || ((long long)n0 < (long long)(m0 + bm - 1) + s.off_mask - left) ||
           ((long long)(n0 + bn - 1) > (long long)m0 + s.off_mask + right);
}

__device__ __forceinline__ bool is_visible(const SeqInfo& s, int i, int j, int left, int right) {
    long long ip = (long long)i + s.off_mask;
    return j >= 0 && j < s.sk && i < s.sq && (long long)j >= ip - left && (long long)j <= ip + right;
}

// ----- optional score terms (softcap, ALiBi, bias) -----------------------------------------
// Everything a kernel needs to turn q.k into the logit of one (b, h) pair.
struct ScoreMods {
    float scale;          // softmax scale
    float softcap;        // c > 0, or 0 = off
    float slope;          // ALiBi slope, or 0 = off
    const void* bias;     // bias of this (b, h), or nullptr
    int bias_kind;
    long long bias_si, bias_sj;
};

__device__ __forceinline__ ScoreMods make_mods(float scale, float softcap, const float* alibi,
                                               long long alibi_sb, const void* bias, int bias_kind,
                                               long long bias_sb, long long bias_sh, long long bias_si,
                                               long long bias_sj, int b, int h) {
    ScoreMods m;
    m.scale = scale;
    m.softcap = softcap;
    m.slope = alibi != nullptr ? alibi[b * alibi_sb + h] : 0.f;
    m.bias_kind = bias != nullptr ? bias_kind : BIAS_NONE;
    m.bias = nullptr;
    if (m.bias_kind != BIAS_NONE) {
        long long off = (long long)b * bias_sb + (long long)h * bias_sh;
        int esize = bias_kind == BIAS_F32 ? 4 : (bias_kind == BIAS_BOOL ? 1 : 2);
        m.bias = (const void*)((const char*)bias + off * esize);
    }
    m.bias_si = bias_si;
    m.bias_sj = bias_sj;
    return m;
}

// The score terms of a kernel compiled without EXTRAS: the scale alone.
__device__ __forceinline__ ScoreMods plain_mods(float scale) {
    ScoreMods m;
    m.scale = scale;
    m.softcap = 0.f;
    m.slope = 0.f;
    m.bias = nullptr;
    m.bias_kind = BIAS_NONE;
    m.bias_si = m.bias_sj = 0;
    return m;
}

// Accumulator of the FMA kernels' score dot products q_i . k_j: float64 for float32 inputs.
// A float32 FMA chain of D terms rounds at every step, and after the exponential that error is a
// relative error of every P: on the H200 it alone gave dV 5.9x the naive error at Sq=1, D=32
// (2026-11-29; a float32 emulation of the chain reproduces it to four digits). Products of
// floats are exact in float64, so the score becomes the float32 rounding of the exact sum.
// 16-bit inputs keep float32: their naive yardstick's own rounding is far larger.
template <typename T> struct ScoreAcc { typedef float type; };
template <> struct ScoreAcc<float> { typedef double type; };
__device__ __forceinline__ float acc_fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double acc_fma(double a, double b, double c) { return fma(a, b, c); }

// q_i . k_j over HD (zero-padded) columns of two shared-memory rows, accumulated as ScoreAcc<T>.
template <typename T, int HD>
__device__ __forceinline__ float score_dot(const float* a, const float* b) {
    typedef typename ScoreAcc<T>::type acc_t;
    acc_t acc = 0;
    for (int d = 0; d < HD; ++d) acc = acc_fma((acc_t)a[d], (acc_t)b[d], acc);
    return (float)acc;
}

// Natural-log logit of query row i (in-sequence) and key j from the raw dot product q_i . k_j,
// in docs/semantics.md's order: scale, softcap, ALiBi, bias (a False bool entry gives -inf).
// `th` receives tanh(scale * dot / c) when softcap is on (the backward needs it).
// Callers guarantee (i, j) is inside the sequence when bias is on.
__device__ __forceinline__ float score_nat(float dot, const ScoreMods& m, const SeqInfo& s, int i, int j,
                                           float* th) {
    // __fmul_rn: the products are rounded here, never contracted into an fma with a later
    // `x - m`. Otherwise nvrtc (--fmad=true) may compute the exponent as fma(dot, scale, -m) from
    // the unrounded product while the row max m and sum l were taken over the rounded x: then
    // sum_j P_ij != 1 by ~ulp(|x|), the softmax gradient's rows no longer sum to 0, and dQ picks
    // up |k| * ulp(|x|) (float32 at logits ~150: dq 26x the naive error on the H200, 2026-11-29;
    // a float32 emulation of both orders reproduces 1.0x vs 52x).
    float x;
    if (m.softcap > 0.f) {
        float t = tanhf(dot * m.scale / m.softcap);
        *th = t;
        x = __fmul_rn(m.softcap, t);
    } else {
        x = __fmul_rn(dot, m.scale);
    }
    if (m.slope != 0.f) {
        int dist = i + s.off_alibi - j;
        x -= m.slope * (float)(dist < 0 ? -dist : dist);
    }
    if (m.bias_kind != BIAS_NONE) {
        long long off = (long long)i * m.bias_si + (long long)j * m.bias_sj;
        switch (m.bias_kind) {
            case BIAS_F32: x += ((const float*)m.bias)[off]; break;
            case BIAS_F16: x += half_bits_to_float(((const pa_u16*)m.bias)[off]); break;
            case BIAS_BF16: x += bf16_bits_to_float(((const pa_u16*)m.bias)[off]); break;
            default: if (((const unsigned char*)m.bias)[off] == 0) x = PA_NEG_INF; break;
        }
    }
    return x;
}

// ----- PTX wrappers: shared-memory addresses, cp.async, ldmatrix, mma.sync -----------------
__device__ __forceinline__ pa_u32 smem_addr(const void* p) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (pa_u32)a;
}

// 16-byte asynchronous copy global -> shared; bytes beyond `src_bytes` (0 or 16) are zero-filled.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// ldmatrix on a 32-bit shared-memory address (kernels compute base addresses once and add
// compile-time offsets, which keeps the address arithmetic out of the inner loops).
__device__ __forceinline__ void ldmatrix_x4(pa_u32* r, pa_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(pa_u32* r, pa_u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// D(16x8, f32) += A(16x16) * B(16x8), A row-major, B column-major, fp16 or bf16 inputs.
template <typename T> __device__ __forceinline__ void mma_16816(float* d, const pa_u32* a, pa_u32 b0, pa_u32 b1);
template <> __device__ __forceinline__ void mma_16816<pa_half>(float* d, const pa_u32* a, pa_u32 b0, pa_u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma_16816<pa_bf16>(float* d, const pa_u32* a, pa_u32 b0, pa_u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Global -> shared copy of a [ROWS x HD] tile of 16-byte chunks, zero-filling rows >= rows_valid
// and columns >= cols_valid (a multiple of 8). Shared rows are padded to LDS elements.
template <typename T, int ROWS, int HD, int LDS, int NT>
__device__ __forceinline__ void load_tile_async(T* sm, const T* g, long long row_stride, int rows_valid,
                                                int cols_valid, int tid) {
    constexpr int CPR = HD / 8;   // 16-byte chunks per row
    for (int c = tid; c < ROWS * CPR; c += NT) {
        int r = c / CPR, col = (c % CPR) * 8;
        bool ok = r < rows_valid && col < cols_valid;
        const T* src = ok ? g + (long long)r * row_stride + col : g;
        cp_async16(sm + r * LDS + col, src, ok ? 16 : 0);
    }
}

// Copy ROWS rows of a (tokens, head_dim) slice (row_stride elements apart) into shared float32
// rows of pitch LD, zero-filling rows >= rows_valid and columns >= cols_valid (the FMA kernels).
template <typename T, int ROWS, int HD, int LD, int NT>
__device__ __forceinline__ void load_rows_f32(float* sm, const T* g, long long row_stride, int rows_valid,
                                              int cols_valid, int tid) {
    for (int c = tid; c < ROWS * HD; c += NT) {
        const int r = c / HD, d = c % HD;
        sm[r * LD + d] = (r < rows_valid && d < cols_valid) ? Elem<T>::to_float(g[r * row_stride + d]) : 0.f;
    }
}

// The K and V rows [n, n + ROWS) of a row CTA's sequence into shared float32 rows of pitch LDK
// (sk) and LDV (sv), zero-filled past the keys and the head dims (load_rows_f32).
template <typename T, int ROWS, int HD, int LDK, int LDV, int NT>
__device__ __forceinline__ void load_kv_rows_f32(float* sk, float* sv, const RowCta<T>& cta, int n, long long k_ss,
                                                 long long v_ss, int head_dim, int head_dim_v, int tid) {
    load_rows_f32<T, ROWS, HD, LDK, NT>(sk, cta.k_seq + n * k_ss, k_ss, cta.s.sk - n, head_dim, tid);
    load_rows_f32<T, ROWS, HD, LDV, NT>(sv, cta.v_seq + n * v_ss, v_ss, cta.s.sk - n, head_dim_v, tid);
}

// The copies (load_tile_async, not committed) of the K and V rows [n, n + ROWS) of a row CTA's
// sequence into the [ROWS][LDS] tiles sk and sv, zero-filled past the keys and the head dims.
template <typename T, int ROWS, int HD, int LDS, int NT>
__device__ __forceinline__ void load_kv_async(T* sk, T* sv, const RowCta<T>& cta, int n, long long k_ss,
                                              long long v_ss, int head_dim, int head_dim_v, int tid) {
    load_tile_async<T, ROWS, HD, LDS, NT>(sk, cta.k_seq + n * k_ss, k_ss, cta.s.sk - n, head_dim, tid);
    load_tile_async<T, ROWS, HD, LDS, NT>(sv, cta.v_seq + n * v_ss, v_ss, cta.s.sk - n, head_dim_v, tid);
}

// a . b over N floats of two shared-memory rows: one float32 fmaf chain, d = 0, 1, ... (the FMA
// backward's dP = dO_i . v_j, in attn_bwd_preprocess's order).
template <int N>
__device__ __forceinline__ float dot_f32(const float* a, const float* b) {
    float acc = 0.f;
    for (int d = 0; d < N; ++d) acc = fmaf(a[d], b[d], acc);
    return acc;
}

// ----- warp-level tile matmuls (mma.m16n8k16 fragments) -------------------------------------
// Fragment layout (g = lane / 4, t4 = lane % 4): A (16x16) regs a0..a3 hold rows g, g+8, g, g+8
// and columns 2t4 + {0,1}, 2t4 + {0,1}, 8 + 2t4 + {0,1}, 8 + 2t4 + {0,1}; B (16x8, k x n) regs
// b0, b1 hold k = 2t4 + {0,1} and 8 + 2t4 + {0,1} of column n = g; the accumulator C (16x8)
// holds c0, c1 at row g, columns 2t4 + {0,1} and c2, c3 at row g + 8.
// ldmatrix.x4: lanes 8m..8m+7 give the row addresses of 8x8 matrix m, which lands in reg m.
// The helpers below return a lane's element offset inside a 16x16 block of a shared-memory
// tile with row pitch `lds` elements (the callers add block offsets).

// A operand from a matrix stored [m][k]: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7),
// (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a0..a3.
__device__ __forceinline__ int ldm_a_offset(int lane, int lds) { return (lane % 16) * lds + (lane / 16) * 8; }
// B operand of two n8 tiles from a matrix stored [n][k] (no transpose): regs {0, 1} = (b0, b1)
// of n 0-7, regs {2, 3} = (b0, b1) of n 8-15 (the forward's K in S = Q K^T).
__device__ __forceinline__ int ldm_b_offset(int lane, int lds) {
    return ((lane / 16) * 8 + lane % 8) * lds + ((lane / 8) % 2) * 8;
}
// B operand of two n8 tiles from a matrix stored [k][n] (ldmatrix .trans): regs {0, 1} = n 0-7,
// regs {2, 3} = n 8-15 (the forward's V in O += P V).
__device__ __forceinline__ int ldm_bt_offset(int lane, int lds) {
    return (((lane / 8) % 2) * 8 + lane % 8) * lds + (lane / 16) * 8;
}

// Two accumulator tiles C[:, 0:8] (c0) and C[:, 8:16] (c1) of a 16x16 float block, re-packed as
// one 16-bit A fragment (the forward's P -> A conversion for P V).
template <typename T>
__device__ __forceinline__ void acc_to_a(pa_u32* a, const float* c0, const float* c1) {
    a[0] = Elem<T>::pack2(c0[0], c0[1]);
    a[1] = Elem<T>::pack2(c0[2], c0[3]);
    a[2] = Elem<T>::pack2(c1[0], c1[1]);
    a[3] = Elem<T>::pack2(c1[2], c1[3]);
}

template <int N>
__device__ __forceinline__ void zero_acc(float (*acc)[4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
}

// For each of MT m16 tiles: acc[mt][16 x 16*NP] += A_mt[16 x 16*KS] * B^T. A_mt is read from
// shared memory at a_addr + mt * 16 rows (this lane's ldm_a_offset included), B stored [n][k]
// at b_addr (ldm_b_offset included); row pitch LDS. Every B fragment feeds the MT m-tiles (the
// forward's S = Q K^T with MT = 2); per accumulator the k order is kk = 0, 1, ...
template <typename T, int KS, int NP, int LDS, int MT>
__device__ __forceinline__ void warp_mma_abt_mt(float (*acc)[2 * NP][4], pa_u32 a_addr, pa_u32 b_addr) {
    constexpr int ES = sizeof(T);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        pa_u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], a_addr + (mt * 16 * LDS + kk * 16) * ES);
#pragma unroll
        for (int np = 0; np < NP; ++np) {
            pa_u32 bf[4];
            ldmatrix_x4(bf, b_addr + (np * 16 * LDS + kk * 16) * ES);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816<T>(acc[mt][2 * np], a[mt], bf[0], bf[1]);
                mma_16816<T>(acc[mt][2 * np + 1], a[mt], bf[2], bf[3]);
            }
        }
    }
}

// For each of MT m16 tiles: acc[mt][16 x 16*NP] += A_mt[16 x 16*KS] * B, A_mt taken from the
// float accumulators p[mt] (2*KS n8 tiles, rounded to T), B stored [k][n] at b_addr
// (ldm_bt_offset included); row pitch LDS. Every B fragment feeds the MT m-tiles (the forward's
// O += P V).
template <typename T, int KS, int NP, int LDS, int MT, int NPT>
__device__ __forceinline__ void warp_mma_pb_mt(float (*acc)[2 * NP][4], const float (*p)[NPT][4], pa_u32 b_addr) {
    static_assert(NPT >= 2 * KS, "p holds 2 * KS n8 tiles per m-tile");
    constexpr int ES = sizeof(T);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        pa_u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc_to_a<T>(a[mt], p[mt][2 * kk], p[mt][2 * kk + 1]);
#pragma unroll
        for (int dp = 0; dp < NP; ++dp) {
            pa_u32 bf[4];
            ldmatrix_x4_trans(bf, b_addr + (kk * 16 * LDS + dp * 16) * ES);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_16816<T>(acc[mt][2 * dp], a[mt], bf[0], bf[1]);
                mma_16816<T>(acc[mt][2 * dp + 1], a[mt], bf[2], bf[3]);
            }
        }
    }
}

// One m16 tile: acc[16 x 16*NP] += A[16 x 16*KS] * B^T (see warp_mma_abt_mt).
template <typename T, int KS, int NP, int LDS>
__device__ __forceinline__ void warp_mma_abt(float (*acc)[4], pa_u32 a_addr, pa_u32 b_addr) {
    warp_mma_abt_mt<T, KS, NP, LDS, 1>(reinterpret_cast<float (*)[2 * NP][4]>(acc), a_addr, b_addr);
}

// One m16 tile: acc[16 x 16*NP] += P[16 x 16*KS] * B, P from 2*KS float accumulators (see
// warp_mma_pb_mt).
template <typename T, int KS, int NP, int LDS>
__device__ __forceinline__ void warp_mma_pb(float (*acc)[4], const float (*p)[4], pa_u32 b_addr) {
    warp_mma_pb_mt<T, KS, NP, LDS, 1, 2 * KS>(reinterpret_cast<float (*)[2 * NP][4]>(acc),
                                              reinterpret_cast<const float (*)[2 * KS][4]>(p), b_addr);
}

// The argument list every kernel shares: layout of q/k/v, sequences, masking and score terms.
// Strides are in elements; for varlen, the batch strides are 0 and cu_q/cu_k give the tokens.
#define PA_COMMON_PARAMS                                                                           \
    const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v,                    \
        long long q_sb, long long q_ss, long long q_sh, long long k_sb, long long k_ss,           \
        long long k_sh, long long v_sb, long long v_ss, long long v_sh,                           \
        const int *__restrict__ cu_q, const int *__restrict__ cu_k, int seqlen_q, int seqlen_k,   \
        int total_q, int total_k,                                                                 \
        int head_dim, int head_dim_v, int gqa_ratio, float scale, float softcap, int win_left,    \
        int win_right, int top_left, const float *__restrict__ alibi, long long alibi_sb,         \
        const void *__restrict__ bias, int bias_kind, long long bias_sb, long long bias_sh,       \
        long long bias_si, long long bias_sj, long long lse_sb, long long lse_sh
