// mmvq_q6_k.cu: batch-1 matrix-vector product over q6_K weights and q8_1 activations (MMVQ),
// both row layouts: raw 210-byte blocks and padded 224-byte blocks (engine/gpu_weights.py).
//
// Weights: W uint8 [N, (K/256) * BS], BS = 210 (raw GGUF) or 224 (the same + 14 zero bytes):
//   ql[128] @0, qh[64] @128, sc[16] int8 @192, d f16 @208 (engine/quants.py).
//   element e = 128 hh + n: low 4 bits (ql[64 hh + n % 64] >> 4 (n / 64)) & 15,
//   high 2 bits (qh[32 hh + n % 32] >> 2 (n / 32)) & 3, centred q = (low | high << 4) - 32.
// Activations: q8_1 of one row: xq int8 [K], xds float2 [K/32] = (d8, s8).
// Formula (engine.quants.mmq_reference_q6_k, in float32 here):
//   y[n] = sum_j (d * sc_j) * d8_{j/2} * sum_l q6[j,l] * q8[j,l]     (16-element sub-blocks j)
//
// Work split: a warp owns R rows; lane l takes block 8 it + (l >> 2) and unit u = l & 3 of it
// (half hh = u >> 1, l0 = 16 (u & 1)): the 64 elements n = 32 qq + l0 + i (qq = 0..3,
// i = 0..15) of half hh, held by three 16-byte slices ql[64hh + l0], ql[64hh + 32 + l0],
// qh[32hh + l0] (common.cuh q6_word recombines them into centred int8 in registers), plus the
// 16 scales and d. Padded rows: every block is 16-byte aligned, so the slices are uint4 loads
// that bypass L1. Raw rows: blocks are only 2-byte aligned, so the same registers are filled
// with 16-bit loads (the parity arm). 16 dp4a per slot against four 16-byte q8 slices.
//
// Launch, modes and epilogue exactly as mmvq_q4_k.cu (block = 4 warps, R = 1 row per warp, up
// to 3 segments; MODE 0 store, 1 add, 2 swiglu).
// Kernel names: mmvq_q6_k_{pad|raw}_{store|add|swiglu}.
#include "common.cuh"
#include "decode_common.cuh"

__device__ __forceinline__ u32 ld_u16x2(const u8* p) {      // p 2-byte aligned
    const u16* q = reinterpret_cast<const u16*>(p);
    return (u32)__ldg(q) | ((u32)__ldg(q + 1) << 16);
}

__device__ __forceinline__ uint4 ld_raw16(const u8* p) {   // 16 bytes at a 2-byte aligned p
    return make_uint4(ld_u16x2(p), ld_u16x2(p + 4), ld_u16x2(p + 8), ld_u16x2(p + 12));
}

struct Q6Slot {
    uint4 ql0, ql1, qh, sc;
    u32 d;          // low 16 bits: d (f16)
};

template <bool PADDED>
__device__ __forceinline__ void q6k_load(Q6Slot& s, const u8* blk, int hh, int l0) {
    if (PADDED) {
        s.ql0 = ld_stream16(blk + 64 * hh + l0);
        s.ql1 = ld_stream16(blk + 64 * hh + 32 + l0);
        s.qh = ld_stream16(blk + 128 + 32 * hh + l0);
        s.sc = ld_stream16(blk + 192);
        s.d = __ldg(reinterpret_cast<const u32*>(blk + 208));
    } else {
        s.ql0 = ld_raw16(blk + 64 * hh + l0);
        s.ql1 = ld_raw16(blk + 64 * hh + 32 + l0);
        s.qh = ld_raw16(blk + 128 + 32 * hh + l0);
        s.sc = ld_raw16(blk + 192);
        s.d = (u32)__ldg(reinterpret_cast<const u16*>(blk + 208));
    }
}

__device__ __forceinline__ int sc_byte(const uint4& sc, int hh, int qq, int l0) {
    // sub-block j = 8 hh + 2 qq + l0 / 16: word 2 hh + (qq >> 1), byte 2 (qq & 1) + (l0 >> 4)
    const u32 w = hh ? ((qq >> 1) ? sc.w : sc.z) : ((qq >> 1) ? sc.y : sc.x);
    return (int)(signed char)(w >> (8 * (2 * (qq & 1) + (l0 >> 4))));
}

__device__ __forceinline__ float q6k_slot(const Q6Slot& s, int hh, int l0, const uint4 (&x)[4],
                                          const float (&d8)[4]) {
    float r = 0.0f;
#pragma unroll
    for (int qq = 0; qq < 4; ++qq) {
        const uint4& l = (qq & 1) ? s.ql1 : s.ql0;
        int dot = 0;
        dot = __dp4a((int)q6_word(l.x, s.qh.x, qq), (int)x[qq].x, dot);
        dot = __dp4a((int)q6_word(l.y, s.qh.y, qq), (int)x[qq].y, dot);
        dot = __dp4a((int)q6_word(l.z, s.qh.z, qq), (int)x[qq].z, dot);
        dot = __dp4a((int)q6_word(l.w, s.qh.w, qq), (int)x[qq].w, dot);
        r += (float)sc_byte(s.sc, hh, qq, l0) * d8[qq] * (float)dot;
    }
    return f16_to_f32((u16)(s.d & 0xFFFFu)) * r;
}

// ---------------------------------------------------------------- q6_K body

template <int R, int MODE, bool PADDED>
__device__ __forceinline__ void mmvq_q6_k_body(
    const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,
    float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2,
    int n0, int n1, int n2, int nb1, int nb2,
    const i8* __restrict__ xq, const float2* __restrict__ xds, int K) {
    constexpr int NR = (MODE == 2) ? 2 * R : R;
    constexpr int BS = PADDED ? 224 : 210;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int blk = blockIdx.x;
    const u8* W;
    float* Y;
    int N;
    if (blk < nb1) {
        W = w0; Y = y0; N = n0;
    } else if (blk < nb2) {
        blk -= nb1; W = w1; Y = y1; N = n1;
    } else {
        blk -= nb2; W = w2; Y = y2; N = n2;
    }
    const int row0 = (blk * MMVQ_NW + warp) * R;
    const bool active = row0 < N;
    const int nb = active ? (K >> 8) : 0;
    const size_t rb = (size_t)(K >> 8) * BS;
    const u8* rows[NR];
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = max(0, min(row0 + i, N - 1));
        rows[i] = W + (size_t)r * rb;
        if (MODE == 2) rows[R + i] = w1 + (size_t)r * rb;
    }
    const int u4 = lane & 3, hh = u4 >> 1, l0 = 16 * (u4 & 1);
    float acc[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = 0.0f;

    pdl_entry_trigger();

    // one block per iteration, the compiler unrolls by two
#pragma unroll MMVQ_UNROLL
    for (int b = lane >> 2; b < nb; b += 8) {
        uint4 x[4];
        float d8[4];
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) {
            x[qq] = __ldg(reinterpret_cast<const uint4*>(xq + b * 256 + 128 * hh + 32 * qq + l0));
            d8[qq] = __ldg(xds + b * 8 + 4 * hh + qq).x;
        }
        Q6Slot s[NR];
#pragma unroll
        for (int i = 0; i < NR; ++i) q6k_load<PADDED>(s[i], rows[i] + (size_t)b * BS, hh, l0);
#pragma unroll
        for (int i = 0; i < NR; ++i) acc[i] += q6k_slot(s[i], hh, l0, x, d8);
    }
    mmvq_epilogue<R, MODE, NR>(acc, active, row0, N, Y);
}

#define MMVQ_Q6K_INSTANCE(LAYOUT, PADDED, MODE, NAME)                                           \
    extern "C" __global__ void __launch_bounds__(MMVQ_NW * 32)                                  \
    mmvq_q6_k_##LAYOUT##_##NAME(                                                                \
        const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,        \
        float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2, int n0, int n1, \
        int n2, int nb1, int nb2, const i8* __restrict__ xq, const float2* __restrict__ xds,    \
        int K) {                                                                                \
        mmvq_q6_k_body<1, MODE, PADDED>(w0, w1, w2, y0, y1, y2, n0, n1, n2, nb1, nb2, xq, xds, K); \
    }

#define MMVQ_Q6K_LAYOUT(LAYOUT, PADDED)                 \
    MMVQ_Q6K_INSTANCE(LAYOUT, PADDED, 0, store)        \
    MMVQ_Q6K_INSTANCE(LAYOUT, PADDED, 1, add)          \
    MMVQ_Q6K_INSTANCE(LAYOUT, PADDED, 2, swiglu)

#ifndef MMVQ_BODIES_ONLY                 // mmvq_mixed.cu takes the body alone
MMVQ_Q6K_LAYOUT(pad, true)
MMVQ_Q6K_LAYOUT(raw, false)
#endif
