// attention_common.cuh: the pieces of the prefill attention kernels (attention_prefill.cu:
// mma.sync, FlashAttention-2 loop; attention_wgmma.cu: Hopper wgmma) that do the same arithmetic
// on the same register fragments.
//   at_stage_q, at_q_frags: Q rows into shared memory, the warp's Q K^T A fragments from there
//   at_init:     o = 0, m = -inf, l = 0
// Fragments (a warp's 16 query rows; lane (g, t) = (lane / 4, lane % 4)): scores s[j][e] and
// output o[j][e] of the n8 column block j: row g + 8 (e >> 1), column 8 j + 2 t + (e & 1), the
// accumulator layout of mma.m16n8k16 and, per warp of a warpgroup, of wgmma.m64nNk16.
// Scores are in the exp2 domain (rope.cu scales Q by log2(e)/sqrt(HD)). Per key tile:
//   at_mask:     keys after the row's position -> -inf (only tiles crossing the diagonal)
//   at_softmax:  m_new = max(m, rowmax s); corr = 2^(m - m_new); p = 2^(s - m_new);
//                l = l corr + sum p; o *= corr (a row with every score -inf so far uses 0 as
//                its max: 2^-inf = 0, never NaN); at_softmax_row + at_rescale_row: the same
//                per row in two steps (corr kept until o may be touched)
//   at_pack_p:   p of 16 keys as the f16 A fragment of the P . V step
//   at_store:    o / l as float32 rows, as q8_1 blocks (d = amax/127, q = roundf(o/d),
//                s = d * sum(q); see rmsnorm.cu for why not sum(o)) or as the wgmma GEMMs' f16 operand
#pragma once
#include "common.cuh"
#include "x16_tiles.cuh"

#define AT_BQ 64
#define AT_BK 64
#define AT_NTH 128
#define AT_NEG_INF __int_as_float(0xff800000)
#define AT_SMEM_MAX (227 * 1024)            // the most dynamic smem of a block (sm_90), for the emulation
// Grid of the prefill / varlen entries: (H, query tiles), heads the fast index, so the hardware
// hands out blocks in decreasing key count over all heads (the tiles are numbered longest
// first): greedy list scheduling of the longest first leaves a short wave tail, where a (tiles,
// H) grid repeated long .. short once per head (H100, attention 1.02-1.15x at 4096@4096 and
// 1.04-1.28x at 3314@0; docs/perf-log.md, Session 19). The heads of one KV group also run side
// by side (K/V from L2).
// AT_HGROUP = G > 0 (an A/B define; off by default): the blocks go out a group of G heads at a
// time (heads fastest within it), so the K/V that the blocks in flight read is G heads' (L2
// working set), not every head's; launch order = linear block id, so block (x, y) takes the pair
// (head, tile) of the id's place in that order. Off, or G not dividing H: the grid as launched.
#ifndef AT_LSUM4
#define AT_LSUM4 0                          // 1: at_softmax_row's row sum in 4 chains (A/B define)
#endif
#ifndef AT_HGROUP
#define AT_HGROUP 0
#endif
// This block's (head, tile) of the (H, tiles) grid: as launched (heads fastest), or with G > 0
// dividing H the pair of its place in launch order when a group of G heads goes out at a time.
__device__ __forceinline__ int2 at_head_tile(int G = AT_HGROUP) {
    const int H = (int)gridDim.x;
    if (G <= 0 || H % G) return make_int2((int)blockIdx.x, (int)blockIdx.y);
    const int nt = (int)gridDim.y, b = (int)blockIdx.x + H * (int)blockIdx.y;
    const int grp = b / (G * nt), rem = b - grp * G * nt;
    return make_int2(grp * G + rem % G, rem / G);
}
#define AT_HEAD (at_head_tile().x)
#define AT_TILE (at_head_tile().y)
#define AT_NTILES gridDim.y

#ifndef GGP_EMU
typedef u32 saddr;                          // shared-memory address (cvta.to.shared)

__device__ __forceinline__ void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// d += A(16x16 f16, row) * B(16x8 f16, col), f32 accumulators.
__device__ __forceinline__ void mma_f16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// two f32 -> f16x2 (lo in the low half), round to nearest even
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

#else
// ---- CPU emulation (tests/cuda_emu: one fiber per thread, __syncwarp a warp barrier) of the
// PTX used above, from the PTX ISA fragment definitions; shared addresses are host pointers.
typedef unsigned long long saddr;
static u8 at_emu_smem[AT_SMEM_MAX] __attribute__((aligned(1024)));
static unsigned long long at_emu_addr[32][32];
static u32 at_emu_frag[32][32][6];
inline saddr smem_u32(const void* p) { return (saddr)p; }
inline u32 dyn_smem_bytes() { return AT_SMEM_MAX; }
inline void __trap() { std::abort(); }
inline void cp_async16(saddr dst, const void* src, int n) { emu_cp_async((void*)dst, src, n); }   // lands late
inline void cp_async_commit() { emu_cp_async_commit(); }
template <int N> inline void cp_async_wait() { emu_cp_async_wait(N); }
inline float at_h2f(u32 w, int hi) { return f16_to_f32((u16)(hi ? w >> 16 : w & 0xFFFF)); }
inline void at_ldsm(u32& r0, u32& r1, u32& r2, u32& r3, saddr addr, bool trans) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    at_emu_addr[w][lane] = addr;
    __syncwarp();
    u32* r[4] = {&r0, &r1, &r2, &r3};
    for (int i = 0; i < 4; ++i) {
        if (!trans) {
            *r[i] = *(const u32*)(at_emu_addr[w][8 * i + lane / 4] + 4 * (lane % 4));
        } else {
            const u16 lo = *(const u16*)(at_emu_addr[w][8 * i + 2 * (lane % 4)] + 2 * (lane / 4));
            const u16 hi = *(const u16*)(at_emu_addr[w][8 * i + 2 * (lane % 4) + 1] + 2 * (lane / 4));
            *r[i] = (u32)lo | ((u32)hi << 16);
        }
    }
    __syncwarp();
}
inline void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, saddr a) { at_ldsm(r0, r1, r2, r3, a, false); }
inline void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, saddr a) { at_ldsm(r0, r1, r2, r3, a, true); }
inline void mma_f16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    u32* f = at_emu_frag[w][lane];
    f[0] = a[0]; f[1] = a[1]; f[2] = a[2]; f[3] = a[3]; f[4] = b0; f[5] = b1;
    __syncwarp();
    // A[r][k]: row r = g' (+8 via a1/a3), k = 2t'+{0,1} (+8 via a2/a3) held by lane 4g'+t'
    // B[k][c]: col c = g', k = 2t'+{0,1} (b0) or 2t'+8+{0,1} (b1) held by lane 4g'+t'
    for (int e = 0; e < 4; ++e) {
        const int r = g + 8 * (e >> 1), c = 2 * t + (e & 1);
        float acc = d[e];
        for (int k = 0; k < 16; ++k) {
            const int tk = (k & 7) >> 1, hk = k & 1, kh = k >> 3;
            const u32 aw = at_emu_frag[w][4 * (r & 7) + tk][(r >> 3) + 2 * kh];
            const u32 bw = at_emu_frag[w][4 * c + tk][4 + kh];
            acc += at_h2f(aw, hk) * at_h2f(bw, hk);
        }
        d[e] = acc;
    }
    __syncwarp();
}
inline u32 pack_f16x2(float lo, float hi) { return (u32)emu_f32_to_f16(lo) | ((u32)emu_f32_to_f16(hi) << 16); }
#endif


// Rows 0 .. BQ-1 of Q (rows past nq zero) into shared rows of HD f16, the 16-byte chunk c of row r
// at c ^ (r & 7) (conflict-free ldmatrix), by NTH threads' cp.async.
template <int HD, int BQ, int NTH>
__device__ __forceinline__ void at_stage_q(saddr sQ, const u16* __restrict__ Qh, int nq, int tid) {
    constexpr int CH = HD / 8;
    for (int p = tid; p < BQ * CH; p += NTH) {
        const int row = p / CH, ch = p % CH;
        const bool ok = row < nq;
        cp_async16(sQ + row * (HD * 2) + ((ch ^ (row & 7)) << 4), Qh + (size_t)(ok ? row : 0) * HD + ch * 8,
                   ok ? 16 : 0);
    }
}

// A thread's copies of one K / V tile of BK keys (both prefill kernels): chunk kch of the keys
// kin0 + KSTEP i < BK (kch = tid % (HD / 8), kin0 = tid / (HD / 8), KSTEP = threads / (HD / 8): a
// warp reads whole key rows). KSTEP is a multiple of 8, so every copy keeps row kin0's XOR
// swizzle and lies KSTEP shared rows of srow bytes after the previous one: the addresses are the
// thread's fixed offsets plus constants. dk / dv: row kin0's chunk in the K / V tile; kch_k /
// kch_v: chunk kch of key 0; row: element offset of key kin0 of the tile; whole: every key of
// the tile is below L (block-uniform; no bounds test), else copy i holds a key while
// KSTEP i < left (= L - first key of the tile - kin0) and the rest are zero-filled. COPY_V false:
// the K tile only (dv, kch_v unused).
template <int BK, int KSTEP, int HD, bool COPY_V = true>
__device__ __forceinline__ void at_copy_kv(saddr dk, saddr dv, u32 srow, const u16* kch_k, const u16* kch_v,
                                           size_t row, int kin0, bool whole, int left) {
    constexpr int KCOPIES = (BK + KSTEP - 1) / KSTEP;
    static_assert(KSTEP % 8 == 0, "copy layout: the swizzle repeats every 8 rows");
    if (whole) {
        const u16* k = kch_k + row;
        const u16* v = kch_v + row;
#pragma unroll
        for (int i = 0; i < KCOPIES; ++i) {
            if (BK % KSTEP && kin0 + i * KSTEP >= BK) break;   // 3 warpgroups: 24 rows a step
            cp_async16(dk + i * KSTEP * srow, k + i * KSTEP * HD, 16);
            if (COPY_V) cp_async16(dv + i * KSTEP * srow, v + i * KSTEP * HD, 16);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < KCOPIES; ++i) {
        if (BK % KSTEP && kin0 + i * KSTEP >= BK) break;
        const bool ok = i * KSTEP < left;
        const size_t off = ok ? row + (size_t)i * KSTEP * HD : 0;   // else key 0, zero-filled
        cp_async16(dk + i * KSTEP * srow, kch_k + off, ok ? 16 : 0);
        if (COPY_V) cp_async16(dv + i * KSTEP * srow, kch_v + off, ok ? 16 : 0);
    }
}

// The warp's A fragments of Q K^T (its 16 rows from row 16 warp of the staged Q, HD / 16 k-steps).
template <int HD>
__device__ __forceinline__ void at_q_frags(u32 (&qa)[HD / 16][4], saddr sQ, int warp, int lane) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        const int row = warp * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        const int ch = 2 * kk + (lane >> 4);
        ldmatrix_x4(qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], sQ + row * (HD * 2) + ((ch ^ (row & 7)) << 4));
    }
}

// The online-softmax state before the first key tile: o = 0, m = -inf, l = 0.
template <int NO>
__device__ __forceinline__ void at_init(float (&o)[NO][4], float (&mrow)[2], float (&lrow)[2]) {
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    mrow[0] = mrow[1] = AT_NEG_INF;
    lrow[0] = lrow[1] = 0.0f;
}

// Keys k0 + 8 j + 2 t + (e & 1) after the position of row g + 8 (e >> 1) (prow: position of row g).
template <int NS>
__device__ __forceinline__ void at_mask(float (&s)[NS][4], int k0, int prow, int tig) {
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = k0 + j * 8 + 2 * tig + (e & 1);
            if (key > prow + 8 * (e >> 1)) s[j][e] = AT_NEG_INF;
        }
}

// The online-softmax step of row r (g + 8 r) of one key tile, o aside: s -> p in place, m and l
// updated; returns corr, the factor that row of o is to be scaled by.
template <int NS>
__device__ __forceinline__ float at_softmax_row(float (&s)[NS][4], float (&mrow)[2], float (&lrow)[2], int r) {
    // The row max over 4 interleaved chains, then 2 levels (max is exact in any order: the same
    // bits as one chain, a quarter of its dependent FMNMX latency).
    static_assert(NS >= 4, "4 chains");
    float m4[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) m4[j] = fmaxf(s[j][2 * r], s[j][2 * r + 1]);
#pragma unroll
    for (int j = 4; j < NS; ++j) m4[j & 3] = fmaxf(m4[j & 3], fmaxf(s[j][2 * r], s[j][2 * r + 1]));
    float mx = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mnew = fmaxf(mrow[r], mx);
    const float muse = (mnew == AT_NEG_INF) ? 0.0f : mnew;
    const float corr = exp2f(mrow[r] - muse);
    mrow[r] = mnew;
    // The row sum: one chain, or 4 interleaved ones under AT_LSUM4 (other rounding).
    constexpr int NC = AT_LSUM4 ? 4 : 1;
    float lc[NC] = {};
#pragma unroll
    for (int j = 0; j < NS; ++j) {
        s[j][2 * r] = exp2f(s[j][2 * r] - muse);
        s[j][2 * r + 1] = exp2f(s[j][2 * r + 1] - muse);
        lc[j % NC] += s[j][2 * r] + s[j][2 * r + 1];
    }
    float ls = lc[0];
    if constexpr (NC == 4) ls = (lc[0] + lc[1]) + (lc[2] + lc[3]);
    lrow[r] = fmaf(lrow[r], corr, ls);
    return corr;
}

template <int NO>
__device__ __forceinline__ void at_rescale_row(float (&o)[NO][4], float corr, int r) {
#pragma unroll
    for (int j = 0; j < NO; ++j) {
        o[j][2 * r] *= corr;
        o[j][2 * r + 1] *= corr;
    }
}

// The online-softmax step of one key tile: s -> p in place, m, l updated, o rescaled.
template <int NS, int NO>
__device__ __forceinline__ void at_softmax(float (&s)[NS][4], float (&o)[NO][4], float (&mrow)[2], float (&lrow)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) at_rescale_row(o, at_softmax_row(s, mrow, lrow, r), r);
}

// p of keys 16 kk .. 16 kk + 15 of the tile as the A fragment (rows g, g + 8; k 2t.., 2t+8..).
template <int NS>
__device__ __forceinline__ void at_pack_p(u32 (&pa)[4], const float (&s)[NS][4], int kk) {
    pa[0] = pack_f16x2(s[2 * kk][0], s[2 * kk][1]);
    pa[1] = pack_f16x2(s[2 * kk][2], s[2 * kk][3]);
    pa[2] = pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[3] = pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// Output forms of the attention kernels (the OUT template argument).
enum { AT_F32 = 0, AT_Q8 = 1, AT_X16 = 2 };

// Rows lr0 + g, lr0 + g + 8 of the tile (batch rows row0 + lr, written where lr < nq) of head h:
// o / l as OUT says: AT_F32 float32 into O [T, H*HD]; AT_Q8 q8_1 blocks into Oq / Ods; AT_X16
// f16 into the wgmma GEMMs' tiled operand (x16_tiles.cuh; O holds its address, T its rows), the
// bits wgmma_tile_x16 makes of the AT_F32 output (the same f32 product, rounded once): lanes t
// and t ^ 1 swap their two columns so that one of them holds 4 consecutive and stores them.
// Every lane of the warp calls it.
template <int HD, int OUT>
__device__ __forceinline__ void at_store(const float (&o)[HD / 8][4], const float (&lrow)[2], int lr0, int g, int tig,
                                         int row0, int nq, int h, int H, int T, float* __restrict__ O,
                                         i8* __restrict__ Oq, float2* __restrict__ Ods) {
    constexpr int NO = HD / 8;
    const int QD = H * HD;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = lrow[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = nf_div(1.0f, l);
        const int lr = lr0 + g + 8 * r;               // row in the tile
        const int t = row0 + lr;
        const bool ok = lr < nq;
        if (OUT == AT_F32) {
            if (ok) {
#pragma unroll
                for (int j = 0; j < NO; ++j)
                    *reinterpret_cast<float2*>(O + (size_t)t * QD + h * HD + j * 8 + 2 * tig) =
                        make_float2(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
            }
        } else if (OUT == AT_X16) {
#pragma unroll
            for (int j = 0; j < NO; ++j) {
                const float v0 = o[j][2 * r] * inv, v1 = o[j][2 * r + 1] * inv;
                const float u0 = __shfl_xor_sync(0xffffffffu, v0, 1), u1 = __shfl_xor_sync(0xffffffffu, v1, 1);
                if (ok && (tig & 1) == (j & 1)) {     // columns 8 j + 4 (tig / 2) .. + 3
                    const bool lo = (tig & 1) == 0;
                    wg_store_quad(reinterpret_cast<u16*>(O), t, h * HD + 8 * j + 4 * (tig >> 1), (T + 7) / 8,
                                  lo ? v0 : u0, lo ? v1 : u1, lo ? u0 : v0, lo ? u1 : v1);
                }
            }
        } else {
#pragma unroll
            for (int c = 0; c < HD / 32; ++c) {
                float v[8];
                float amax = 0.0f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    v[2 * i] = o[4 * c + i][2 * r] * inv;
                    v[2 * i + 1] = o[4 * c + i][2 * r + 1] * inv;
                    amax = fmaxf(amax, fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1])));
                }
                amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
                amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
                const float d = nf_div(amax, 127.0f);
                const bool zero = __float_as_int(amax) == 0;
                int qv[8], qs = 0;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    qv[i] = zero ? 0 : (int)roundf(nf_div(v[i], d));
                    qs += qv[i];
                }
                qs += __shfl_xor_sync(0xffffffffu, qs, 1);
                qs += __shfl_xor_sync(0xffffffffu, qs, 2);
                if (ok) {
                    i8* qrow = Oq + (size_t)t * QD + h * HD + 32 * c;
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        *reinterpret_cast<u16*>(qrow + i * 8 + 2 * tig) =
                            (u16)((qv[2 * i] & 0xFF) | ((qv[2 * i + 1] & 0xFF) << 8));
                    if (tig == 0)
                        Ods[(size_t)t * (QD / 32) + h * (HD / 32) + c] = make_float2(d, __fmul_rn(d, (float)qs));
                }
            }
        }
    }
}
