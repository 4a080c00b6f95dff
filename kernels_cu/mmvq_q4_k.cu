// mmvq_q4_k.cu: batch-1 matrix-vector product over q4_K weights and q8_1 activations (MMVQ),
// the decode-step GEMV: y[n] = sum_k W[n, k] x[k] for one token.
//
// Weights: W uint8 [N, (K/256) * 144], GGUF q4_K rows unchanged (engine/quants.py):
//   block: d f16 @0, dmin f16 @2, scales[12] @4, qs[128] @16; qs chunk c (32 bytes) holds
//   sub-block 2c in the low nibbles and 2c+1 in the high nibbles.
// Activations: q8_1 of one row: xq int8 [K], xds float2 [K/32] = (d8, s8) (quantize_q8_1.cu).
// Formula (engine.quants.mmq_reference_q4_k, in float32 here):
//   y[n] = sum_g (d * sc_g) * d8_g * sum_l q4[g,l] * q8[g,l]  -  (dmin * m_g) * s8_g
//
// Work split: a warp owns R rows (the activation loads are shared by the R rows); lane l
// takes super-block 4*it + (l >> 3) and the 16-byte qs slice j = l & 7 of it (chunk c = j >> 1,
// half h = j & 1: bytes 16h..16h+15 of chunk c = elements 16h..16h+15 of sub-blocks 2c and 2c+1).
// Per slot a lane reads the block header (uint4: d, dmin, scales) and its qs uint4, both with
// 16-byte loads that bypass L1 (each weight byte is read once; a warp covers 4 consecutive
// blocks = 576 contiguous bytes per iteration), and the two matching 16-byte q8 slices. The
// integer dots are 8 dp4a; lane h == 0 adds the min term of both sub-blocks. Rows end with a
// warp xor-butterfly sum.
//
// Launch: block = MMVQ_NW warps (128 threads), R rows per warp, grid.x = sum over segments of
// ceil(rows_s / (MMVQ_NW * R)). Segments (up to 3 matrices of the same K in one launch; blocks
// [0, nb1) are segment 0, [nb1, nb2) segment 1, [nb2, grid) segment 2):
//   MODE 0 store : y_s[n] = dot                 (q, k, v in one launch; logits)
//   MODE 1 add   : y_0[n] += dot                (residual add; one segment)
//   MODE 2 swiglu: y_0[n] = silu(dot_gate) * dot_up with gate = w0, up = w1 (same rows);
//                  silu(g) = g / (1 + exp(-g)) as in engine/reference.py.
// R = 1 row per warp in production (the R loops stay: the rows-per-warp and load-batch arms
// were retired, dev/RETIRED.md). Kernel names: mmvq_q4_k_{store|add|swiglu}.
#include "common.cuh"
#include "decode_common.cuh"

// Contribution of one (super-block, 16-byte qs slice) to a row's dot product.
__device__ __forceinline__ float q4k_slot(const uint4& hdr, const uint4& qs, int c, int h,
                                          const uint4& xa, const uint4& xb,
                                          const float2& da, const float2& db) {
    int dl = 0, dh = 0;
    dl = __dp4a((int)(qs.x & 0x0F0F0F0Fu), (int)xa.x, dl);
    dl = __dp4a((int)(qs.y & 0x0F0F0F0Fu), (int)xa.y, dl);
    dl = __dp4a((int)(qs.z & 0x0F0F0F0Fu), (int)xa.z, dl);
    dl = __dp4a((int)(qs.w & 0x0F0F0F0Fu), (int)xa.w, dl);
    dh = __dp4a((int)((qs.x >> 4) & 0x0F0F0F0Fu), (int)xb.x, dh);
    dh = __dp4a((int)((qs.y >> 4) & 0x0F0F0F0Fu), (int)xb.y, dh);
    dh = __dp4a((int)((qs.z >> 4) & 0x0F0F0F0Fu), (int)xb.z, dh);
    dh = __dp4a((int)((qs.w >> 4) & 0x0F0F0F0Fu), (int)xb.w, dh);
    // 6-bit scale / min of sub-blocks 2c and 2c+1 (ggml get_scale_min_k4); a, b, cc are
    // scales bytes 0..3, 4..7, 8..11.
    const u32 a = hdr.y, b = hdr.z, cc = hdr.w;
    u32 sc0, sc1, m0, m1;
    if (c < 2) {
        const int sh = 16 * c;
        sc0 = (a >> sh) & 63u;
        sc1 = (a >> (sh + 8)) & 63u;
        m0 = (b >> sh) & 63u;
        m1 = (b >> (sh + 8)) & 63u;
    } else {
        const int sh = 16 * (c - 2);
        sc0 = ((cc >> sh) & 0xFu) | (((a >> (sh + 6)) & 3u) << 4);
        sc1 = ((cc >> (sh + 8)) & 0xFu) | (((a >> (sh + 14)) & 3u) << 4);
        m0 = ((cc >> (sh + 4)) & 0xFu) | (((b >> (sh + 6)) & 3u) << 4);
        m1 = ((cc >> (sh + 12)) & 0xFu) | (((b >> (sh + 14)) & 3u) << 4);
    }
    const float d = f16_to_f32((u16)(hdr.x & 0xFFFFu));
    const float dmin = f16_to_f32((u16)(hdr.x >> 16));
    float r = d * ((float)sc0 * da.x * (float)dl + (float)sc1 * db.x * (float)dh);
    const float mterm = dmin * ((float)m0 * da.y + (float)m1 * db.y);
    return h == 0 ? r - mterm : r;
}

// ---------------------------------------------------------------- q4_K body

template <int R, int MODE>
__device__ __forceinline__ void mmvq_q4_k_body(
    const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,
    float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2,
    int n0, int n1, int n2, int nb1, int nb2,
    const i8* __restrict__ xq, const float2* __restrict__ xds, int K) {
    constexpr int NR = (MODE == 2) ? 2 * R : R;
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
    const bool active = row0 < N;                // whole warps; inactive ones skip the loads
    const int nb = active ? (K >> 8) : 0;
    const size_t rb = (size_t)(K >> 8) * 144;
    const u8* rows[NR];
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int r = max(0, min(row0 + i, N - 1));   // rows past N: read row N-1, never stored
        rows[i] = W + (size_t)r * rb;
        if (MODE == 2) rows[R + i] = w1 + (size_t)r * rb;
    }
    const int j = lane & 7, c = j >> 1, h = j & 1;
    float acc[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) acc[i] = 0.0f;

    pdl_entry_trigger();

    // one super-block slot per iteration, the compiler unrolls by two
#pragma unroll MMVQ_UNROLL
    for (int sb = lane >> 3; sb < nb; sb += 4) {
        const int g0 = sb * 8 + 2 * c;
        const uint4 xa = __ldg(reinterpret_cast<const uint4*>(xq + g0 * 32 + 16 * h));
        const uint4 xb = __ldg(reinterpret_cast<const uint4*>(xq + g0 * 32 + 32 + 16 * h));
        const float2 da = __ldg(xds + g0), db = __ldg(xds + g0 + 1);
        uint4 hdr[NR], qs[NR];
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            const u8* blkp = rows[i] + (size_t)sb * 144;
            hdr[i] = ld_stream16(blkp);
            qs[i] = ld_stream16(blkp + 16 + 16 * j);
        }
#pragma unroll
        for (int i = 0; i < NR; ++i) acc[i] += q4k_slot(hdr[i], qs[i], c, h, xa, xb, da, db);
    }
    mmvq_epilogue<R, MODE, NR>(acc, active, row0, N, Y);
}

#define MMVQ_Q4K_INSTANCE(MODE, NAME)                                                         \
    extern "C" __global__ void __launch_bounds__(MMVQ_NW * 32)                                \
    mmvq_q4_k_##NAME(const u8* __restrict__ w0, const u8* __restrict__ w1,                    \
                     const u8* __restrict__ w2, float* __restrict__ y0,                       \
                     float* __restrict__ y1, float* __restrict__ y2, int n0, int n1,          \
                     int n2, int nb1, int nb2, const i8* __restrict__ xq,                     \
                     const float2* __restrict__ xds, int K) {                                 \
        mmvq_q4_k_body<1, MODE>(w0, w1, w2, y0, y1, y2, n0, n1, n2, nb1, nb2, xq, xds, K);    \
    }

#ifndef MMVQ_BODIES_ONLY                 // mmvq_mixed.cu takes the body alone
MMVQ_Q4K_INSTANCE(0, store)
MMVQ_Q4K_INSTANCE(1, add)
MMVQ_Q4K_INSTANCE(2, swiglu)
#endif
