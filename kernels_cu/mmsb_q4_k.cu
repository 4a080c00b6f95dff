// mmsb_q4_k.cu: small-batch GEMM y[T, N] = x[T, K] . W[N, K]^T, W in q4_K blocks, x in q8_1
// blocks, T <= 8 NTT (instance <NTT, MR, D>: NTT n-tiles, MR m-tiles per warp, a ring of D
// super-blocks in flight; registry.MMSB_CONFIGS), f32 output [T, N]; skeleton, grid and
// shared-memory layout in mmsb_common.cuh (weights = MMA A operand, tokens = B operand).
//
// Inputs: W uint8 [N, K/256 * 144] (GGUF q4_K rows: d f16 @0, dmin f16 @2, scales[12] @4,
//         qs[128] @16; qs chunk c = bytes 32c..32c+31 holds sub-block 2c in the low nibbles and
//         2c+1 in the high nibbles); Aq int8 [T, K], Ads float2 [T, K/32] = (d8, s8).
// Formula (engine.reference.mmq.mmq_reference_q4_k), per row n, token t, super-block b:
//   y[t,n] += sum_j (d sc_j) d8[t,j] dot_j  -  dmin sum_j m_j s8[t,j]      (j = 0..7)
//
// Fragments: lane (g, t) loads 8 bytes of chunk c at offset 8t for rows g and g+8 of each m-tile
// (one 32-byte sector per row per warp load). The MMA's k order is permuted inside a sub-block, the same way
// for both operands: logical k 4t..4t+3 = element 8t..8t+3, logical k 16+4t.. = element 8t+4..
// So a0/a2 = the two words of row g (low nibbles: sub-block 2c; high: 2c+1, masked in place as
// u8 16q against d/16), a1/a3 = row g+8,
// and b0/b1 = the 8 activation bytes of token g at element 8t (one 8-byte shared load).
// Scale term, as mmq_q4_k.cu: the MMA accumulates onto C = MMQ_MAGIC_I (D as a float = M + dot
// exactly), then u = fma(D, dsc, -M dsc) = round(dot dsc), acc = fma(u, d8, acc).
// Min term once per super-block on TF32 tensor cores (as mmq_q4_k.cu's TCMIN arm): Z = m . s8
// over the 8 sub-blocks (m16n8k8: a = m_t, m_{t+4} of rows g, g+8, exact; b = s8 of token g,
// sub-blocks t, t+4, split hi + lo), acc = fma(-dmin, Z, acc).
// Shared-memory row stride of the activations: 256 + 32 bytes (== 32 mod 128: the 8-byte
// loads of a half-warp, 4 tokens x 32 bytes, hit 32 distinct banks).
#include "common.cuh"
#include "mmsb_common.cuh"

#define SB4_PAD 32

template <int MR>
struct Q4Sb {               // one super-block of a lane's 2 MR rows (r = 2 m + h: row 16 m + g + 8 h)
    uint4 hdr[2 * MR];      // d, dmin, scales
    uint2 qs[2 * MR][4];    // [row][chunk]: 8 bytes at chunk offset 8t
};

template <int MR>
__device__ __forceinline__ void q4sb_load(Q4Sb<MR>& s, const u8* const (&rows)[2 * MR], int sb, int t4) {
#pragma unroll
    for (int r = 0; r < 2 * MR; ++r) {
        const u8* b = rows[r] + (size_t)sb * 144;
        s.hdr[r] = __ldg(reinterpret_cast<const uint4*>(b));
#pragma unroll
        for (int c = 0; c < 4; ++c) s.qs[r][c] = ld_stream8(b + 16 + 32 * c + 8 * t4);
    }
}

// The 6-bit scales and mins of a header (ggml get_scale_min_k4), four to a word: sub-block j's
// scale is byte j & 3 of sc[j >> 2], its min byte j & 3 of m[j >> 2].
struct Q4Scales { u32 sc[2], m[2]; };

__device__ __forceinline__ Q4Scales q4_scales(const uint4& h) {
    Q4Scales s;
    s.sc[0] = h.y & 0x3F3F3F3Fu;
    s.m[0] = h.z & 0x3F3F3F3Fu;
    s.sc[1] = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
    s.m[1] = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
    return s;
}

// Per row: dsc = d sc_j from byte_magic (fma(2^23 + sc, d, -2^23 d) rounds sc d once, as d * sc
// would); high-nibble sub-blocks (A = q << 4, u8) take d / 16, exact, so u has the same bits.
template <int NTT, int MR>
__device__ __forceinline__ void q4sb_compute(float (&acc)[MR][NTT][4], const Q4Sb<MR>& s, const u8* sqb,
                                             const float* sdsb, int g, int t4) {
    constexpr int TP = 8 * NTT;
    constexpr int RS = SbLayout<NTT, SB4_PAD>::RS;
    const u8* bq = sqb + g * RS + 8 * t4;               // + 8 nt RS + 32 j: immediates
    const float* bd = sdsb + 4 * t4;                    // (d8, s8) of tokens 2t, 2t+1: + 2 (j TP + 8 nt)
    float dw[2][2 * MR], dm[2][2 * MR];                 // [hi][row]: d (/16 for hi), -2^23 times it
    Q4Scales sc[2 * MR];
#pragma unroll
    for (int r = 0; r < 2 * MR; ++r) {
        dw[0][r] = f16_to_f32((u16)(s.hdr[r].x & 0xFFFF));
        dm[0][r] = -BYTE_MAGIC_F * dw[0][r];
        dw[1][r] = 0.0625f * dw[0][r];
        dm[1][r] = 0.0625f * dm[0][r];
        sc[r] = q4_scales(s.hdr[r]);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            const int j = 2 * c + hi;
            const u32 mask = hi ? 0xF0F0F0F0u : 0x0F0F0F0Fu;
            u32 a[MR][4];
            float dsc[2 * MR], mdsc[2 * MR];
#pragma unroll
            for (int m = 0; m < MR; ++m) {
                a[m][0] = s.qs[2 * m][c].x & mask;
                a[m][2] = s.qs[2 * m][c].y & mask;
                a[m][1] = s.qs[2 * m + 1][c].x & mask;
                a[m][3] = s.qs[2 * m + 1][c].y & mask;
            }
#pragma unroll
            for (int r = 0; r < 2 * MR; ++r) {
                dsc[r] = fmaf(byte_magic(sc[r].sc[j >> 2], j & 3), dw[hi][r], dm[hi][r]);
                mdsc[r] = -MMQ_MAGIC_F * dsc[r];
            }
#pragma unroll
            for (int nt = 0; nt < NTT; ++nt) {
                const uint2 b = *reinterpret_cast<const uint2*>(bq + 8 * nt * RS + 32 * j);
                const float4 ds = *reinterpret_cast<const float4*>(bd + 2 * (j * TP + 8 * nt));
#pragma unroll
                for (int m = 0; m < MR; ++m) {
                    int d[4];
                    mma_u8s8_k32(d, a[m][0], a[m][1], a[m][2], a[m][3], b.x, b.y, MMQ_MAGIC_I);
                    float* o = acc[m][nt];
                    o[0] = fmaf(fmaf(__int_as_float(d[0]), dsc[2 * m], mdsc[2 * m]), ds.x, o[0]);
                    o[1] = fmaf(fmaf(__int_as_float(d[1]), dsc[2 * m], mdsc[2 * m]), ds.z, o[1]);
                    o[2] = fmaf(fmaf(__int_as_float(d[2]), dsc[2 * m + 1], mdsc[2 * m + 1]), ds.x, o[2]);
                    o[3] = fmaf(fmaf(__int_as_float(d[3]), dsc[2 * m + 1], mdsc[2 * m + 1]), ds.z, o[3]);
                }
            }
        }
    }
    // min term of the super-block: Z[n, tok] = sum_j m[n, j] s8[tok, j] (TF32, s8 hi + lo); a = m_t,
    // m_{t+4} of rows g, g+8 as exact small floats
    u32 am[MR][4];
    float nd[2 * MR];
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            am[m][h] = __float_as_uint(byte_magic(sc[2 * m + h].m[0], t4) - BYTE_MAGIC_F);
            am[m][2 + h] = __float_as_uint(byte_magic(sc[2 * m + h].m[1], t4) - BYTE_MAGIC_F);
        }
#pragma unroll
    for (int r = 0; r < 2 * MR; ++r) nd[r] = -f16_to_f32((u16)(s.hdr[r].x >> 16));
    const float* bs = sdsb + 2 * (t4 * TP + g) + 1;     // s8 of sub-block t, token g: + 2 (4 TP | 8 nt)
#pragma unroll
    for (int nt = 0; nt < NTT; ++nt) {
        const float s0 = bs[2 * 8 * nt];
        const float s4 = bs[2 * (4 * TP + 8 * nt)];
        const u32 h0 = f32_to_tf32(s0), h4 = f32_to_tf32(s4);
        const u32 l0 = f32_to_tf32(s0 - __uint_as_float(h0)), l4 = f32_to_tf32(s4 - __uint_as_float(h4));
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_tf32_k8(z, am[m][0], am[m][1], am[m][2], am[m][3], h0, h4);
            mma_tf32_k8(z, am[m][0], am[m][1], am[m][2], am[m][3], l0, l4);
            float* o = acc[m][nt];
            o[0] = fmaf(nd[2 * m], z[0], o[0]);
            o[1] = fmaf(nd[2 * m], z[1], o[1]);
            o[2] = fmaf(nd[2 * m + 1], z[2], o[2]);
            o[3] = fmaf(nd[2 * m + 1], z[3], o[3]);
        }
    }
}

template <int NTT, int MR_>
struct Q4Body {
    static constexpr int MR = MR_;
    using Sb = Q4Sb<MR>;    // 24 MR registers
    float acc[MR][NTT][4];
    const u8* rows[2 * MR];
    int g, t4;
    __device__ __forceinline__ void load(Sb& s, int sb) const { q4sb_load<MR>(s, rows, sb, t4); }
    __device__ __forceinline__ void compute(const Sb& s, const u8* sqb, const float* sdsb) {
        q4sb_compute<NTT, MR>(acc, s, sqb, sdsb, g, t4);
    }
};

// NTT n-tiles (T <= 8 NTT), MR m-tiles per warp, D super-blocks in flight per warp.
template <int NTT, int MR, int D>
__global__ void __launch_bounds__(SB_THREADS, sb_min_blocks(MR))
mmsb_q4_k(const u8* __restrict__ W, const i8* __restrict__ Aq, const float2* __restrict__ Ads,
          float* __restrict__ Y, int T, int N, int K, int ch, int parts, float* __restrict__ Wsp,
          u32* __restrict__ Cnt) {
    pdl_entry();
    sb_gemm<NTT, SB4_PAD, D, 144, Q4Body<NTT, MR>>(W, Aq, Ads, Y, T, N, K, ch, parts, Wsp, Cnt);
}
