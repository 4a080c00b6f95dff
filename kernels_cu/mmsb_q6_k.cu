// mmsb_q6_k.cu: small-batch GEMM y[T, N] = x[T, K] . W[N, K]^T, W in q6_K blocks (raw 210-byte
// or padded 224-byte), x in q8_1 blocks, T <= 8 NTT (instance <NTT, MR, D, PADDED>: NTT n-tiles,
// MR m-tiles per warp, a ring of D super-blocks in flight; registry.MMSB_CONFIGS), f32 output
// [T, N]; skeleton, grid and shared-memory layout in mmsb_common.cuh (weights = MMA A operand,
// tokens = B operand).
//
// Inputs: W uint8 [N, K/256 * BS] (ql[128] @0, qh[64] @128, sc[16] int8 @192, d f16 @208;
//         BS = 224 with 14 zero bytes, or 210); Aq int8 [T, K], Ads float2 [T, K/32].
// Formula (engine.reference.mmq.mmq_reference_q6_k), 16-element sub-blocks j, q8_1 block j/2:
//   y[t,n] += sum_j (d sc_j) d8[t, j/2] sum_i (q6[j,i] - 32) q8[t, 16 j + i]
//
// Fragments (m16n8k16, k in natural order): unit (h, l0), h = half, l0 in {0, 16}: lane (g, t)
// loads the words ql[64h + l0 + 4t], ql[64h + 32 + l0 + 4t], qh[32h + l0 + 4t] of rows g and
// g+8 of each m-tile; common.cuh q6_word(.., qq) turns them into the 4 centred int8 of elements
// 128h + 32qq + l0 + 4t.. = positions 4t..4t+3 of sub-block j = 8h + 2qq + l0/16: the A
// fragment a0 (row g) / a1 (row g+8) of that sub-block, against b0 = the activation word of
// token g at the same elements (one 4-byte shared load). Padded rows: 4-byte loads; raw rows
// (2-byte aligned): the same words from 2-byte loads, so both layouts give the same bits.
// Scale term, as mmq_q6_k.cu: D = M + dot (C = MMQ_MAGIC_I), u = fma(D_lo, dsc_lo, -M dsc_lo),
// v = fma(D_hi, dsc_hi, -M dsc_hi) for the two sub-blocks (l0 = 0, 16) of a q8_1 block, then
// acc = fma(u + v, d8, acc).
// Shared-memory row stride of the activations: 256 + 16 bytes (== 16 mod 128: the 4-byte
// loads of a warp, 8 tokens x 16 bytes, hit 32 distinct banks).
#include "common.cuh"
#include "mmsb_common.cuh"

#define SB6_PAD 16

template <bool PADDED>
__device__ __forceinline__ u32 ld_w32(const u8* p) {        // 4 bytes at p (raw: 2-byte aligned)
    if (PADDED) return __ldg(reinterpret_cast<const u32*>(p));
    const u16* q = reinterpret_cast<const u16*>(p);
    return (u32)__ldg(q) | ((u32)__ldg(q + 1) << 16);
}

template <int MR>
struct Q6Sb {               // one super-block of a lane's 2 MR rows (r = 2 m + h: row 16 m + g + 8 h)
    u32 ql0[2 * MR][2][2];  // [row][h][l0 / 16]: ql[64h + l0 + 4t]
    u32 ql1[2 * MR][2][2];  //                    ql[64h + 32 + l0 + 4t]
    u32 qh[2 * MR][2][2];   //                    qh[32h + l0 + 4t]
    u32 sc[2 * MR][4];      // [row]: the 16 int8 scales
    u32 d[2 * MR];          // [row]: d (f16, low 16 bits)
};

template <int MR, bool PADDED>
__device__ __forceinline__ void q6sb_load(Q6Sb<MR>& s, const u8* const (&rows)[2 * MR], int sb, int t4) {
    constexpr int BS = PADDED ? 224 : 210;
#pragma unroll
    for (int r = 0; r < 2 * MR; ++r) {
        const u8* b = rows[r] + (size_t)sb * BS;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int l = 0; l < 2; ++l) {
                s.ql0[r][h][l] = ld_w32<PADDED>(b + 64 * h + 16 * l + 4 * t4);
                s.ql1[r][h][l] = ld_w32<PADDED>(b + 64 * h + 32 + 16 * l + 4 * t4);
                s.qh[r][h][l] = ld_w32<PADDED>(b + 128 + 32 * h + 16 * l + 4 * t4);
            }
#pragma unroll
        for (int w = 0; w < 4; ++w) s.sc[r][w] = ld_w32<PADDED>(b + 192 + 4 * w);
        s.d[r] = (u32)__ldg(reinterpret_cast<const u16*>(b + 208));
    }
}

template <int NTT, int MR>
__device__ __forceinline__ void q6sb_compute(float (&acc)[MR][NTT][4], const Q6Sb<MR>& s, const u8* sqb,
                                             const float* sdsb, int g, int t4) {
    constexpr int TP = 8 * NTT;
    constexpr int RS = SbLayout<NTT, SB6_PAD>::RS;
    const u8* bq = sqb + g * RS + 4 * t4;               // + 8 nt RS + 32 blk (+ 16): immediates
    const float* bd = sdsb + 4 * t4;                    // d8 of tokens 2t, 2t+1: + 2 (blk TP + 8 nt)
    float dw[2 * MR];
#pragma unroll
    for (int r = 0; r < 2 * MR; ++r) dw[r] = f16_to_f32((u16)s.d[r]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) {
            const int blk = 4 * h + qq;                      // q8_1 block of the super-block
            // A words of the two sub-blocks 2 blk (l = 0) and 2 blk + 1 (l = 1), per lane row r
            u32 a[2][2 * MR];
            float ds[2][2 * MR], mds[2][2 * MR];
#pragma unroll
            for (int l = 0; l < 2; ++l)
#pragma unroll
                for (int r = 0; r < 2 * MR; ++r) {
                    const u32 qlw = (qq & 1) ? s.ql1[r][h][l] : s.ql0[r][h][l];
                    a[l][r] = q6_word(qlw, s.qh[r][h][l], qq);
                    const int j = 2 * blk + l;              // scale byte j of sc
                    const int sc = (int)(signed char)(s.sc[r][j >> 2] >> (8 * (j & 3)));
                    ds[l][r] = dw[r] * (float)sc;
                    mds[l][r] = -MMQ_MAGIC_F * ds[l][r];
                }
#pragma unroll
            for (int nt = 0; nt < NTT; ++nt) {
                const u8* brow = bq + 8 * nt * RS + 32 * blk;
                const u32 b0 = *reinterpret_cast<const u32*>(brow);
                const u32 b1 = *reinterpret_cast<const u32*>(brow + 16);
                const float4 d8 = *reinterpret_cast<const float4*>(bd + 2 * (blk * TP + 8 * nt));
#pragma unroll
                for (int m = 0; m < MR; ++m) {
                    int dl[4], dhi[4];
                    mma_s8_k16(dl, a[0][2 * m], a[0][2 * m + 1], b0, MMQ_MAGIC_I);
                    mma_s8_k16(dhi, a[1][2 * m], a[1][2 * m + 1], b1, MMQ_MAGIC_I);
                    float* o = acc[m][nt];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = 2 * m + (i >> 1);
                        const float u = fmaf(__int_as_float(dl[i]), ds[0][r], mds[0][r]);
                        const float v = fmaf(__int_as_float(dhi[i]), ds[1][r], mds[1][r]);
                        o[i] = fmaf(u + v, (i & 1) ? d8.z : d8.x, o[i]);
                    }
                }
            }
        }
    }
}

template <int NTT, int MR_, bool PADDED>
struct Q6Body {
    static constexpr int MR = MR_;
    using Sb = Q6Sb<MR>;    // 34 MR registers
    float acc[MR][NTT][4];
    const u8* rows[2 * MR];
    int g, t4;
    __device__ __forceinline__ void load(Sb& s, int sb) const { q6sb_load<MR, PADDED>(s, rows, sb, t4); }
    __device__ __forceinline__ void compute(const Sb& s, const u8* sqb, const float* sdsb) {
        q6sb_compute<NTT, MR>(acc, s, sqb, sdsb, g, t4);
    }
};

// NTT n-tiles (T <= 8 NTT), MR m-tiles per warp, D super-blocks in flight per warp.
template <int NTT, int MR, int D, bool PADDED>
__global__ void __launch_bounds__(SB_THREADS, sb_min_blocks(MR))
mmsb_q6_k(const u8* __restrict__ W, const i8* __restrict__ Aq, const float2* __restrict__ Ads,
          float* __restrict__ Y, int T, int N, int K, int ch, int parts, float* __restrict__ Wsp,
          u32* __restrict__ Cnt) {
    pdl_entry();
    sb_gemm<NTT, SB6_PAD, D, PADDED ? 224 : 210, Q6Body<NTT, MR, PADDED>>(W, Aq, Ads, Y, T, N, K, ch, parts,
                                                                          Wsp, Cnt);
}
