// wgmma_q4_k.cu: the Hopper f16 GEMM (wgmma_common.cuh) for q4_K weights. Issue 14, route (b).
//
// Inputs: W uint8 [N, K/256 * 144] (q4_K rows: d f16 @0, dmin f16 @2, scales[12] @4, qs[128] @16);
//         Xt f16 tiled activations (wgmma_common.cuh, wgmma_act.cu); Y f32 [T, N].
//         N % 128 == 0, K % 256 == 0; T any.
//         wgmma_q4_k_swiglu*: W = [gate; up] (N = 2 F, F % 256 == 0), out Xo f16 tiled [T, F] of
//         silu(gate) * up (the down GEMM's operand; the bits of wgmma_q4_k + swiglu.cu swiglu_x16).
// Weight numerics (engine.reference.wgmma.dequant_q4_k_f16 emulates them bit for bit):
//   s = f16(d sc_j), m' = f16(dmin m_j) (f32 products, exact, rounded once to f16),
//   w = f16(q s - m') (one fused f16x2 FMA: HFMA2), for q in 0..15 of sub-block j.
// Lane t's elements 64t..64t+63 are qs chunk t (bytes 32t..32t+31): sub-block 2t in the low
// nibbles (element 64t + j = low nibble of byte j), 2t+1 in the high ones (64t + 32 + j).
// Nibbles to f16 without conversions: (w & 0x000F000F) | 0x6400.. is the f16 pair 1024 + q;
// (w & 0x00F000F0) | 0x6400.. is 1024 + 16 q; one HADD2 / HFMA2 leaves q exactly.
#include "f16x2.cuh"
#ifndef GGP_EMU                      // the CPU emulator takes the policy alone (tests/test_wgmma_reference.py)
#include "wgmma_common.cuh"
#include "wgmma_streamk.cuh"
#endif

#define H2_1_16 0x2C002C00u            // (1/16, 1/16)
#define H2_M64 0xD400D400u             // (-64, -64)

struct WgQ4K {
static constexpr int BLOCK_BYTES = 144;
enum { PF = 0 };                                       // no per-stage part: the super-block streams in
struct St {};                                          // Sb (an enum: a static constexpr adds a .global)

// One super-block of a lane's two rows: the 16-byte header and the 32 qs bytes of chunk t.
struct Sb {
    uint4 hdr[2];
    uint4 qs[2][2];
};
struct Sc {
    u32 v[2][4];                                       // row r: scale lo, -min lo, scale hi, -min hi
};

static __device__ __forceinline__ void load(Sb& s, const u8* r0, const u8* r1, int sb, int t) {
    const uint4* p0 = (const uint4*)(r0 + (size_t)sb * 144);
    const uint4* p1 = (const uint4*)(r1 + (size_t)sb * 144);
    s.hdr[0] = __ldg(p0);
    s.hdr[1] = __ldg(p1);
    s.qs[0][0] = __ldg(p0 + 1 + 2 * t);
    s.qs[0][1] = __ldg(p0 + 2 + 2 * t);
    s.qs[1][0] = __ldg(p1 + 1 + 2 * t);
    s.qs[1][1] = __ldg(p1 + 2 + 2 * t);
}

// (scale, -min) f16x2 pairs of sub-blocks 2t (lo) and 2t+1 (hi) of one row from its header.
// Without branches (lanes t < 2 and t >= 2 of one warp took different paths): bytes k, k + 1
// (k = 2t mod 4) of scales[0..3] (A), [4..7] (B) and [8..11] (C) side by side in one word each;
// sub-blocks j < 4 (t < 2): scale = A & 63, min = B & 63; j >= 4: scale = C & 15 | (A >> 6) << 4,
// min = C >> 4 | (B >> 6) << 4, both bytes of a word at once.
static __device__ __forceinline__ void row_scales(const uint4& h, int t, u32& s_lo, u32& m_lo, u32& s_hi, u32& m_hi) {
    const u32 sel = (t & 1) ? 0x3232u : 0x1010u;
    const u32 A = __byte_perm(h.y, 0, sel), B = __byte_perm(h.z, 0, sel), C = __byte_perm(h.w, 0, sel);
    const bool upper = t >= 2;
    const u32 sc = upper ? ((C & 0x0F0Fu) | ((A >> 2) & 0x3030u)) : (A & 0x3F3Fu);
    const u32 mn = upper ? (((C >> 4) & 0x0F0Fu) | ((B >> 2) & 0x3030u)) : (B & 0x3F3Fu);
    // In f16x2 (f16x2.cuh h2_byte_scaled; exact products: 11 x 6 bits); times (-dmin, -dmin) gives
    // -m' (the sign of a product is exact). Against the I2F / FMUL / F2F form: pp32 +1.3..+3.7%,
    // pp128 +1.4..+2.1% (H100, docs/perf-log.md Session 29).
    const u32 d2 = __byte_perm(h.x, 0, 0x1010), nm2 = __byte_perm(h.x, 0, 0x3232) ^ 0x80008000u;
    s_lo = h2_byte_scaled(sc, 0x4040, H2_M1024, d2);
    s_hi = h2_byte_scaled(sc, 0x4141, H2_M1024, d2);
    m_lo = h2_byte_scaled(mn, 0x4040, H2_M1024, nm2);
    m_hi = h2_byte_scaled(mn, 0x4141, H2_M1024, nm2);
}

// Word -> the two k16 steps' registers of one row: lo = step 2m (cols 2t.., 2t+8..), hi = step 2m+1.
static __device__ __forceinline__ void dequant_word(u32 w, u32 s_lo, u32 m_lo, u32 s_hi, u32 m_hi,
                                                u32& lo_a, u32& lo_b, u32& hi_a, u32& hi_b) {
    const u32 w8 = w >> 8;
    lo_a = h2_fma(h2_add(and_or<0x000F000Fu, H2_1024>(w), H2_M1024), s_lo, m_lo);
    lo_b = h2_fma(h2_add(and_or<0x000F000Fu, H2_1024>(w8), H2_M1024), s_lo, m_lo);
    hi_a = h2_fma(h2_fma(and_or<0x00F000F0u, H2_1024>(w), H2_1_16, H2_M64), s_hi, m_hi);
    hi_b = h2_fma(h2_fma(and_or<0x00F000F0u, H2_1024>(w8), H2_1_16, H2_M64), s_hi, m_hi);
}

static __device__ __forceinline__ void scales(Sc& sc, const Sb& s, int t) {
    row_scales(s.hdr[0], t, sc.v[0][0], sc.v[0][1], sc.v[0][2], sc.v[0][3]);
    row_scales(s.hdr[1], t, sc.v[1][0], sc.v[1][1], sc.v[1][2], sc.v[1][3]);
}

// Stage jj (0..3) of a super-block: words 2jj, 2jj+1 of both rows -> 4 k16 steps x 4 registers.
static __device__ __forceinline__ void frags(u32 (&a)[4][4], const Sb& s, const St&, int jj, const Sc& sc, int) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int m = 2 * jj + q;                      // word index 0..7, compile-time after unroll
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u32 w = uint4_word(s.qs[r][m >> 2], m & 3);
            u32 lo_a, lo_b, hi_a, hi_b;
            dequant_word(w, sc.v[r][0], sc.v[r][1], sc.v[r][2], sc.v[r][3], lo_a, lo_b, hi_a, hi_b);
            a[2 * q][r] = lo_a;                        // step 2m: reg r = row g / g+8, cols 2t..
            a[2 * q][2 + r] = lo_b;                    //          reg 2+r: cols 2t+8..
            a[2 * q + 1][r] = hi_a;
            a[2 * q + 1][2 + r] = hi_b;
        }
    }
}
};

#ifndef GGP_EMU
template <int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, 1)
wgmma_q4_k(const u8* __restrict__ W, const u8* __restrict__ Xt, float* __restrict__ Y, int T, int N, int K) {
    wgmma_gemm<WgQ4K, BT, STAGES>(W, Xt, Y, T, N, K, wg_block_tiles().row);
}

// K split in KP parts, a cluster of KP blocks along the grid's z per output tile (few tokens:
// row tiles x token tiles alone would not fill the GPU).
template <int BT, int STAGES, int KP>
__global__ void __cluster_dims__(1, 1, KP) __launch_bounds__(WG_THREADS, 1)
wgmma_q4_k_kp(const u8* __restrict__ W, const u8* __restrict__ Xt, float* __restrict__ Y, int T, int N, int K) {
    wgmma_gemm<WgQ4K, BT, STAGES, KP>(W, Xt, Y, T, N, K, wg_block_tiles().row);
}

// The gate|up GEMM with SwiGLU fused (wgmma_common.cuh SWIGLU): W = [gate; up] (N = 2 F rows),
// Xo = the down GEMM's tiled f16 operand of h = silu(gate) * up; grid as wgmma_q4_k's over N.
template <int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, 1)
wgmma_q4_k_swiglu(const u8* __restrict__ W, const u8* __restrict__ Xt, u16* __restrict__ Xo, int T, int N, int K) {
    wgmma_gemm<WgQ4K, BT, STAGES, 1, true>(W, Xt, reinterpret_cast<float*>(Xo), T, N, K, wg_block_tiles().row);
}

template <int BT, int STAGES, int KP>
__global__ void __cluster_dims__(1, 1, KP) __launch_bounds__(WG_THREADS, 1)
wgmma_q4_k_swiglu_kp(const u8* __restrict__ W, const u8* __restrict__ Xt, u16* __restrict__ Xo, int T, int N,
                     int K) {
    wgmma_gemm<WgQ4K, BT, STAGES, KP, true>(W, Xt, reinterpret_cast<float*>(Xo), T, N, K, wg_block_tiles().row);
}

// Stream-K (wgmma_streamk.cuh, an A/B form): a 1-D grid of G blocks sharing the tiles'
// super-blocks; plain and with the SwiGLU epilogue.
template <int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, WG_SK_MIN_BLOCKS(BT))
wgmma_q4_k_sk(const u8* __restrict__ W, const u8* __restrict__ Xt, float* __restrict__ Y, int T, int N, int K,
              float* __restrict__ part, int* __restrict__ flags) {
    wgmma_gemm_sk<WgQ4K, BT, STAGES, false>(W, Xt, Y, T, N, K, part, flags, blockIdx.x, gridDim.x);
}

template <int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, WG_SK_MIN_BLOCKS(BT))
wgmma_q4_k_swiglu_sk(const u8* __restrict__ W, const u8* __restrict__ Xt, u16* __restrict__ Xo, int T, int N, int K,
                     float* __restrict__ part, int* __restrict__ flags) {
    wgmma_gemm_sk<WgQ4K, BT, STAGES, true>(W, Xt, reinterpret_cast<float*>(Xo), T, N, K, part, flags,
                                             blockIdx.x, gridDim.x);
}

// The q|k|v GEMM with bias + RoPE + the K/V cache append fused (wgmma_common.cuh ROPE; ubatches
// of <= 32 tokens): W = [Wq; Wk; Wv], every row q4_K; the outputs rope.cu's. Grid as
// wgmma_q4_k's over N.
template <int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, 1)
wgmma_q4_k_rope(const u8* __restrict__ W, const u8* __restrict__ Xt, int T, int N, int K, WG_ROPE_PARAMS) {
    const WgRope rope = WG_ROPE_ARGS;
    wgmma_gemm<WgQ4K, BT, STAGES, 1, false, true>(W, Xt, nullptr, T, N, K, wg_block_tiles().row, &rope);
}

template <int BT, int STAGES, int KP>
__global__ void __cluster_dims__(1, 1, KP) __launch_bounds__(WG_THREADS, 1)
wgmma_q4_k_rope_kp(const u8* __restrict__ W, const u8* __restrict__ Xt, int T, int N, int K, WG_ROPE_PARAMS) {
    const WgRope rope = WG_ROPE_ARGS;
    wgmma_gemm<WgQ4K, BT, STAGES, KP, false, true>(W, Xt, nullptr, T, N, K, wg_block_tiles().row, &rope);
}

// Stream-K (wgmma_streamk.cuh, an A/B form) of the q|k|v GEMM with the RoPE epilogue.
template <int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, WG_SK_MIN_BLOCKS(BT))
wgmma_q4_k_rope_sk(const u8* __restrict__ W, const u8* __restrict__ Xt, int T, int N, int K, float* __restrict__ part,
                   int* __restrict__ flags, WG_ROPE_PARAMS) {
    const WgRope rope = WG_ROPE_ARGS;
    wgmma_gemm_sk<WgQ4K, BT, STAGES, false, true>(W, Xt, nullptr, T, N, K, part, flags, blockIdx.x, gridDim.x, &rope);
}
#endif
