// attention_prefill.cu: causal GQA attention for prefill, flash-style (FlashAttention-2 loop)
// on f16 tensor cores (mma.sync m16n8k16, f32 accumulation), online softmax in f32.
//
// Written for one sequence (the varlen entry below maps a batch of sequences onto it):
// In:  Q  f16 [H, n, HD]      queries of this ubatch (positions start .. start+n-1), already
//                             rotated and scaled by log2(e)/sqrt(HD) (rope.cu), so
//                             scores live in the exp2 domain;
//      Kc, Vc f16 [KVH, maxT, HD]  the layer's KV cache, keys 0 .. start+n-1 valid (this
//                             ubatch's K/V were written by rope.cu; earlier ubatches before).
//      Query head h reads KV head h / (H / KVH).
// Out: o[t, h*HD + i] = sum_j p_j V[j, i] / sum_j p_j,  p_j = 2^(s_j - max_j s_j),
//      s_j = Q[h, t] . K[j]  over keys j <= start + t   (engine.reference.causal_attention)
//      Q8 = false: O float32 [n, H*HD];
//      Q8 = true:  the q8_1 blocks of each 32-column block of o (the attn_output GEMM's A
//                  operand): Oq int8 [n, H*HD], Ods float2 [n, H*HD/32] = (d, s),
//                  d = amax/127, q = roundf(o/d), s = d * sum(q) (the dequantized sum;
//                  see rmsnorm.cu for why not sum(o)).
// Tiling: block = 4 warps = 64 queries (16 per warp) of one head; keys in tiles of 64,
//   K/V tiles double-buffered by cp.async (keys past the block's last query zero-filled, so
//   p = 0 never meets garbage in V); smem rows of HD f16 with 16-byte chunk c of row r at
//   c ^ (r & 7) (conflict-free ldmatrix). Per tile and warp: S (16 x 64) = Q K^T from register Q
//   fragments and ldmatrix K fragments; causal mask (assignment of -inf) only on tiles that
//   cross the warp's diagonal; tiles past the warp's last query are skipped;
//   m_new = max(m, rowmax S); corr = 2^(m - m_new); l = l corr + sum p; O = O corr + P V with
//   P converted in registers to the f16 A fragments and V fragments by ldmatrix.trans.
//   A row whose scores are all -inf so far uses 0 as its max (2^-inf = 0, never NaN).
//   A warp whose 16 query rows are all past the tile's queries (a short tile: a decode token
//   is a 1-query tile) skips the math of every key tile; it still joins the barriers and the
//   cooperative loads.
// Entry points (one body, attn_prefill_body: a tile of nq <= 64 queries, rows row0.. of Q and
// of the outputs, at positions pos0.., over keys 0..pos0+nq-1 at cache rows kvbase..):
//   attn_prefill_h{HD}_{f32,q8}: one sequence, the ubatch's n queries at positions start..,
//     keys at cache rows 0..; start = start0 + (startp ? *startp : 0): startp, the position
//     read on the device (one CUDA graph of the prefill serves every position,
//     engine/gpu/prefill_graph.py). Grid (ceil(n/64), H), q tiles in reverse order (longest
//     first): tile i = queries 64 i .. min(64 i + 64, n) - 1.
//   attn_prefill_varlen_h{HD}_{f32,q8}: a batched step mixing sequences; Q [H, T, HD], O/Oq/Ods
//     [T, ...]; tiles int4 [gridDim.x] = {row0, nq, pos0, kvbase}, one per block: query rows
//     row0..row0+nq-1 of one sequence at positions pos0..pos0+nq-1, whose key p lives at cache
//     row kvbase + p (sequences occupy disjoint row ranges); nq == 0: the block returns at once
//     (padding, so that a CUDA graph keeps a fixed grid); 1 <= nq <= 64 otherwise (more: trap).
//     engine.gpu.ops.attention.varlen_tiles cuts sequences into the one-sequence kernel's tiles.
// Grid (tiles, H); 128 threads; dynamic smem 5 * 64 * HD * 2 bytes (Q, 2 x K, 2 x V).
#include "common.cuh"

#define AT_BQ 64
#define AT_BK 64
#define AT_NTH 128
#define AT_NEG_INF __int_as_float(0xff800000)
#define AT_SMEM_MAX (5 * 64 * 256)

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
static u8 at_emu_smem[AT_SMEM_MAX] __attribute__((aligned(16)));
static unsigned long long at_emu_addr[32][32];
static u32 at_emu_frag[32][32][6];
inline saddr smem_u32(const void* p) { return (saddr)p; }
inline u32 dyn_smem_bytes() { return AT_SMEM_MAX; }
inline void __trap() { std::abort(); }
inline void cp_async16(saddr dst, const void* src, int n) {
    if (n == 16) std::memcpy((void*)dst, src, 16); else std::memset((void*)dst, 0, 16);
}
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
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

template <int HD, bool Q8>
__device__ __forceinline__ void attn_prefill_body(
        const u16* __restrict__ Q, const u16* __restrict__ Kc, const u16* __restrict__ Vc,
        float* __restrict__ O, i8* __restrict__ Oq, float2* __restrict__ Ods,
        int T, int H, int KVH, int row0, int nq, int pos0, int kvbase, int maxT) {
    // T: rows of Q [H, T, HD] and of the outputs; this block: query head blockIdx.y, queries
    // row0 .. row0+nq-1 (1 <= nq <= AT_BQ) at positions pos0 .. pos0+nq-1 over keys
    // 0 .. pos0+nq-1 at cache rows kvbase .. of each KV head plane
    constexpr int CH = HD / 8;            // 16-byte chunks per row
    constexpr int KS = HD / 16;           // k-steps of Q K^T
    constexpr int NO = HD / 8;            // n-tiles of O
    constexpr int ROWB = HD * 2;
    constexpr int TILE = AT_BK * ROWB;    // bytes of one 64-row tile (Q tile too: BQ == BK)
    static_assert(AT_BQ == AT_BK, "one tile size");
    static_assert(HD % 32 == 0 && HD <= 256, "head size");

#ifndef GGP_EMU
    extern __shared__ __align__(16) u8 smem[];
#else
    u8* smem = at_emu_smem;
#endif
    if (dyn_smem_bytes() < (u32)(5 * TILE)) __trap();
    const saddr sQ = smem_u32(smem);
    const saddr sK0 = sQ + TILE, sV0 = sQ + 3 * TILE;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int h = blockIdx.y, kvh = h / (H / KVH);
    const int L = pos0 + nq;                          // keys of the tile's last query
    const int nkt = (L - 1) / AT_BK + 1;
    const bool idle = warp * 16 >= nq;                // none of the warp's rows is a query

    const u16* Qh = Q + ((size_t)h * T + row0) * HD;
    const u16* Kh = Kc + ((size_t)kvh * maxT + kvbase) * HD;
    const u16* Vh = Vc + ((size_t)kvh * maxT + kvbase) * HD;

    for (int p = tid; p < AT_BQ * CH; p += AT_NTH) {
        const int row = p / CH, ch = p % CH;
        const bool ok = row < nq;
        cp_async16(sQ + row * ROWB + ((ch ^ (row & 7)) << 4),
                   Qh + (size_t)(ok ? row : 0) * HD + ch * 8, ok ? 16 : 0);
    }
    auto load_kv = [&](int kt, int buf) {
        for (int p = tid; p < AT_BK * CH; p += AT_NTH) {
            const int row = p / CH, ch = p % CH;
            const int key = kt * AT_BK + row;
            const bool ok = key < L;
            const size_t off = (size_t)(ok ? key : 0) * HD + ch * 8;
            const saddr dst = buf * TILE + row * ROWB + ((ch ^ (row & 7)) << 4);
            cp_async16(sK0 + dst, Kh + off, ok ? 16 : 0);
            cp_async16(sV0 + dst, Vh + off, ok ? 16 : 0);
        }
    };
    load_kv(0, 0);
    cp_async_commit();

    u32 qa[KS][4];
    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float mrow[2] = {AT_NEG_INF, AT_NEG_INF}, lrow[2] = {0.0f, 0.0f};
    const int wfirst = pos0 + warp * 16;              // position of the warp's first query
    const int prow = wfirst + g;                      // rows g and g + 8

    for (int kt = 0; kt < nkt; ++kt) {
        cp_async_wait<0>();
        __syncthreads();                              // tile kt landed; tile kt-1 consumed
        if (kt == 0 && !idle) {
#pragma unroll
            for (int kk = 0; kk < KS; ++kk) {
                const int row = warp * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
                const int ch = 2 * kk + (lane >> 4);
                ldmatrix_x4(qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3],
                            sQ + row * ROWB + ((ch ^ (row & 7)) << 4));
            }
        }
        if (kt + 1 < nkt) load_kv(kt + 1, (kt + 1) & 1);
        cp_async_commit();
        const int k0 = kt * AT_BK;
        if (idle || k0 > wfirst + 15) continue;       // no query, or every key after every query
        const saddr sK = sK0 + (kt & 1) * TILE, sV = sV0 + (kt & 1) * TILE;

        float s[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int row = j * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int ch = 2 * kk + ((lane >> 3) & 1);
                u32 b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3, sK + row * ROWB + ((ch ^ (row & 7)) << 4));
                mma_f16(s[2 * j], qa[kk], b0, b1);
                mma_f16(s[2 * j + 1], qa[kk], b2, b3);
            }
        }
        if (k0 + AT_BK - 1 > wfirst) {                // the tile crosses the warp's diagonal
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + j * 8 + 2 * tig + (e & 1);
                    if (key > prow + 8 * (e >> 1)) s[j][e] = AT_NEG_INF;
                }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = AT_NEG_INF;
#pragma unroll
            for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(mrow[r], mx);
            const float muse = (mnew == AT_NEG_INF) ? 0.0f : mnew;
            const float corr = exp2f(mrow[r] - muse);
            mrow[r] = mnew;
            float ls = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                s[j][2 * r] = exp2f(s[j][2 * r] - muse);
                s[j][2 * r + 1] = exp2f(s[j][2 * r + 1] - muse);
                ls += s[j][2 * r] + s[j][2 * r + 1];
            }
            lrow[r] = fmaf(lrow[r], corr, ls);
#pragma unroll
            for (int j = 0; j < NO; ++j) {
                o[j][2 * r] *= corr;
                o[j][2 * r + 1] *= corr;
            }
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {              // 16 keys per k-step
            u32 pa[4];
            pa[0] = pack_f16x2(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = pack_f16x2(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = pack_f16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = pack_f16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int j = 0; j < NO / 2; ++j) {
                const int row = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
                const int ch = 2 * j + (lane >> 4);
                u32 b0, b1, b2, b3;
                ldmatrix_x4_trans(b0, b1, b2, b3, sV + row * ROWB + ((ch ^ (row & 7)) << 4));
                mma_f16(o[2 * j], pa, b0, b1);
                mma_f16(o[2 * j + 1], pa, b2, b3);
            }
        }
    }

    if (idle) return;                                 // warp-uniform; no block barrier below
    const int QD = H * HD;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = lrow[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = nf_div(1.0f, l);
        const int lr = warp * 16 + g + 8 * r;         // row in the tile
        const int t = row0 + lr;
        const bool ok = lr < nq;
        if (!Q8) {
            if (ok) {
#pragma unroll
                for (int j = 0; j < NO; ++j)
                    *reinterpret_cast<float2*>(O + (size_t)t * QD + h * HD + j * 8 + 2 * tig) =
                        make_float2(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
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

#define AT_INSTANCE(HDV, SUF, Q8V)                                                              \
    extern "C" __global__ void __launch_bounds__(AT_NTH)                                        \
    attn_prefill_h##HDV##_##SUF(const u16* __restrict__ Q, const u16* __restrict__ Kc,          \
                                const u16* __restrict__ Vc, float* __restrict__ O,              \
                                i8* __restrict__ Oq, float2* __restrict__ Ods, int n, int H,    \
                                int KVH, const int* __restrict__ startp, int start0, int maxT) { \
        pdl_entry();                                                                            \
        const int q0 = (gridDim.x - 1 - blockIdx.x) * AT_BQ;                                    \
        attn_prefill_body<HDV, Q8V>(Q, Kc, Vc, O, Oq, Ods, n, H, KVH, q0, min(AT_BQ, n - q0),  \
                                    start0 + (startp ? *startp : 0) + q0, 0, maxT);            \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(AT_NTH)                                        \
    attn_prefill_varlen_h##HDV##_##SUF(const u16* __restrict__ Q, const u16* __restrict__ Kc,   \
                                       const u16* __restrict__ Vc, float* __restrict__ O,       \
                                       i8* __restrict__ Oq, float2* __restrict__ Ods,           \
                                       const int4* __restrict__ tiles, int T, int H, int KVH,   \
                                       int maxT) {                                              \
        pdl_entry();                                                                            \
        const int4 tl = tiles[blockIdx.x];                                                      \
        if (tl.y <= 0) return;                                                                  \
        if (tl.y > AT_BQ) __trap();                                                             \
        attn_prefill_body<HDV, Q8V>(Q, Kc, Vc, O, Oq, Ods, T, H, KVH, tl.x, tl.y, tl.z, tl.w,   \
                                    maxT);                                                      \
    }

AT_INSTANCE(64, f32, false)
AT_INSTANCE(64, q8, true)
AT_INSTANCE(128, f32, false)
AT_INSTANCE(128, q8, true)
