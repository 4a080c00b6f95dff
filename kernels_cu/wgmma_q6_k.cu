// wgmma_q6_k.cu: the Hopper f16 GEMM (wgmma_common.cuh) for q6_K weights. Issue 14, route (b).
//
// Inputs: W uint8 [N, K/256 * BB] (q6_K rows: ql[128] @0, qh[64] @128, sc int8[16] @192, d f16
//         @208; BB = 224 with PADDED (the 210 bytes then 14 zero bytes: 16-byte aligned blocks,
//         8-byte loads) or 210 (raw: 2-byte aligned blocks, 2-byte loads; bit-identical output));
//         Xt f16 tiled activations (wgmma_common.cuh, x16_tiles.cuh), the same operand as q4_K's;
//         Y f32 [T, N]. N % 128 == 0, K % 256 == 0; T any.
// Weight numerics (engine.reference.wgmma.dequant_q6_k_f16 emulates them bit for bit):
//   s = f16(d sc_j) (f32 product, exact, rounded once to f16), w = f16((q - 32) s) (one HMUL2;
//   q - 32 is exact in f16), for q in 0..63 of 16-element sub-block j.
// Element e = 128 h + 32 qd + l (l < 32) is q = (ql[64 h + 32 (qd & 1) + l] >> 4 (qd >> 1)) & 15
// | ((qh[32 h + l] >> 2 qd) & 3) << 4. Lane t's elements 64t .. 64t + 63 (wgmma_common.cuh) are
// h = t >> 1, nibble n = t & 1: element 64t + 32 hi + j is qd = 2n + hi, l = j, i.e. byte j of
// ql run 64 h + 32 hi (nibble n), byte j of qh run 32 h (bits 4n + 2hi, 4n + 2hi + 1), scale
// sc[4t + 2 hi + j / 16]. So word m (bytes j = 4m .. 4m + 3) of a row comes from three words:
// L = ql[64h + 4m ..], U = ql[64h + 32 + 4m ..], H = qh[32h + 4m ..], and pipeline stage jj
// (words 2jj, 2jj + 1) from three 8-byte pieces per row, streamed PF stages ahead (St) instead
// of a whole super-block (96 bytes a row: twice that would not fit in registers).
// Six-bit bytes without per-byte work (shifts by the lane constant 4n; SHF.W is a rotate):
//   X = H << (4 - 4n)                         qh pair 2n at bits 4..5, pair 2n+1 at 6..7 of a byte
//   v  = (L >> 4n) & 0x0F0F0F0F | X & 0x30303030          = q        (step 2m, hi = 0)
//   v4 = rotr(U, 4n - 2) & 0x3C3C3C3C | X & 0xC0C0C0C0    = 4 q      (step 2m + 1, hi = 1)
// then PRMT puts bytes 0, 2 (1, 3) under 0x64: the f16 pair 1024 + q (1024 + 4 q, exact below
// 2048); one HADD2 of -1056 (HFMA2 by 1/4 and -288) leaves q - 32 exactly, one HMUL2 scales it.
#include "f16x2.cuh"
#ifndef GGP_EMU                      // the CPU emulator takes the policy alone (tests/test_wgmma_reference.py)
#include "wgmma_common.cuh"
#include "wgmma_streamk.cuh"
#endif

#define H2_M1056 0xE420E420u           // (-1056, -1056)
#define H2_M1152 0xE480E480u           // (-1152, -1152)
#define H2_M288 0xDC80DC80u            // (-288, -288)
#define H2_1_4 0x34003400u             // (1/4, 1/4)

// PF: stages loaded ahead (a ring of PF slots of 12 registers, 24 for raw blocks).
template <bool PADDED, int PF_>
struct WgQ6K {
enum { BLOCK_BYTES = PADDED ? 224 : 210, PF = PF_ };

// Per super-block (one ahead): row r's scale word sc[4t .. 4t + 3] and d (f16 bits).
struct Sb {
    u32 sc[2];
    u32 d[2];
};
// Per stage: row r's pieces L (p[r][0]), U (p[r][1]), H (p[r][2]), each words 2jj, 2jj + 1;
// raw blocks keep the four 16-bit loads of a piece (assembled when the fragments are built, so
// no instruction waits for a load at the time it is issued).
struct St {
    u32 p[2][3][PADDED ? 2 : 4];
};
struct Sc {
    u32 v[2][4];                                       // row r: f16x2 scale of sub-block 4t + i
};

static __device__ __forceinline__ u32 ld_u32(const u8* p) {   // p 4-byte aligned (padded only)
    return __ldg((const u32*)p);
}
static __device__ __forceinline__ u32 ld_u16(const u8* p) {
    return __ldg((const u16*)p);
}

static __device__ __forceinline__ void load(Sb& s, const u8* r0, const u8* r1, int sb, int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u8* b = (r ? r1 : r0) + (size_t)sb * BLOCK_BYTES;
        if constexpr (PADDED) {
            s.sc[r] = ld_u32(b + 192 + 4 * t);
        } else {
            s.sc[r] = __byte_perm(ld_u16(b + 192 + 4 * t), ld_u16(b + 194 + 4 * t), 0x5410);
        }
        s.d[r] = ld_u16(b + 208);
    }
}

static __device__ __forceinline__ void scales(Sc& sc, const Sb& s, int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        // In f16x2 (f16x2.cuh h2_byte_scaled): the int8 scale with its sign bit flipped is q + 128,
        // so the bias -1152 leaves q.
        const u32 d2 = __byte_perm(s.d[r], 0, 0x1010), u = s.sc[r] ^ 0x80808080u;
#pragma unroll
        for (int i = 0; i < 4; ++i) sc.v[r][i] = h2_byte_scaled(u, 0x4040u + 0x0101u * i, H2_M1152, d2);
    }
}

// Stage j: words 2jj, 2jj + 1 (bytes 8jj .. 8jj + 7) of the runs L, U, H of both rows.
static __device__ __forceinline__ void load_stage(St& st, const u8* r0, const u8* r1, int j, int t) {
    const int off = 64 * (t >> 1) + 8 * (j & 3);       // L in the block; U: off + 32
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u8* b = (r ? r1 : r0) + (size_t)(j >> 2) * BLOCK_BYTES;
        const u8* src[3] = {b + off, b + off + 32, b + 128 + 32 * (t >> 1) + 8 * (j & 3)};
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            if constexpr (PADDED) {
                const uint2 v = __ldg((const uint2*)src[k]);
                st.p[r][k][0] = v.x;
                st.p[r][k][1] = v.y;
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) st.p[r][k][i] = ld_u16(src[k] + 2 * i);
            }
        }
    }
}

// Word q (0, 1) of piece k of row r.
static __device__ __forceinline__ u32 word(const St& st, int r, int k, int q) {
    if constexpr (PADDED) return st.p[r][k][q];
    else return __byte_perm(st.p[r][k][2 * q], st.p[r][k][2 * q + 1], 0x5410);
}

// Stage jj (0..3) of a super-block: words m = 2jj, 2jj+1 of both rows -> 4 k16 steps x 4 registers.
static __device__ __forceinline__ void frags(u32 (&a)[4][4], const Sb&, const St& st, int jj, const Sc& sc, int t) {
    const u32 sl = 4 * (t & 1);                        // ql nibble shift 4n
    const u32 sx = 4 - sl, su = sl - 2;                // qh left shift 4 - 4n; U rotate 4n - 2 (mod 32)
#pragma unroll
    for (int q = 0; q < 2; ++q) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u32 L = word(st, r, 0, q), U = word(st, r, 1, q), H = word(st, r, 2, q);
            const u32 x = H << sx;
            const u32 v = ((L >> sl) & 0x0F0F0F0Fu) | (x & 0x30303030u);
            const u32 v4 = (__funnelshift_r(U, U, su) & 0x3C3C3C3Cu) | (x & 0xC0C0C0C0u);
            const u32 s_lo = sc.v[r][jj >> 1], s_hi = sc.v[r][2 + (jj >> 1)];   // m >= 4 <=> jj >= 2
            a[2 * q][r] = h2_mul(h2_add(__byte_perm(v, 0x64, 0x4240), H2_M1056), s_lo);         // bytes 0, 2
            a[2 * q][2 + r] = h2_mul(h2_add(__byte_perm(v, 0x64, 0x4341), H2_M1056), s_lo);     // bytes 1, 3
            a[2 * q + 1][r] = h2_mul(h2_fma(__byte_perm(v4, 0x64, 0x4240), H2_1_4, H2_M288), s_hi);
            a[2 * q + 1][2 + r] = h2_mul(h2_fma(__byte_perm(v4, 0x64, 0x4341), H2_1_4, H2_M288), s_hi);
        }
    }
}
};

// Stages loaded ahead: 4 with BT = 128 (a whole super-block's time to land, as q4_K's Sb), 2
// beside BT = 256's 128 accumulators (its stages take twice the tensor time, so the loads get
// about as long); -D overrides for A/B runs (GGUF_PREFILL_KERNEL_DEFINES; 1, 2 or 4). ptxas 12.9,
// no spills: padded 187 / 234 registers, raw 236 / 244 (PF = 4 at BT = 256: 244 padded, raw spills).
#ifndef WG_Q6_PF128
#define WG_Q6_PF128 4
#endif
#ifndef WG_Q6_PF256
#define WG_Q6_PF256 2
#endif
#ifndef WG_Q6_PF64
#define WG_Q6_PF64 2
#endif
template <int BT>
constexpr int wg_q6_pf() { return BT >= 256 ? WG_Q6_PF256 : BT >= 128 ? WG_Q6_PF128 : WG_Q6_PF64; }

#ifndef GGP_EMU
template <bool PADDED, int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, 1)
wgmma_q6_k(const u8* __restrict__ W, const u8* __restrict__ Xt, float* __restrict__ Y, int T, int N, int K) {
    wgmma_gemm<WgQ6K<PADDED, wg_q6_pf<BT>()>, BT, STAGES>(W, Xt, Y, T, N, K, wg_block_tiles().row);
}

// K split in KP parts (wgmma_q4_k.cu's wgmma_q4_k_kp).
template <bool PADDED, int BT, int STAGES, int KP>
__global__ void __cluster_dims__(1, 1, KP) __launch_bounds__(WG_THREADS, 1)
wgmma_q6_k_kp(const u8* __restrict__ W, const u8* __restrict__ Xt, float* __restrict__ Y, int T, int N, int K) {
    wgmma_gemm<WgQ6K<PADDED, wg_q6_pf<BT>()>, BT, STAGES, KP>(W, Xt, Y, T, N, K, wg_block_tiles().row);
}

// Stream-K (wgmma_streamk.cuh, an A/B form): a 1-D grid of G blocks sharing the tiles' super-blocks.
template <bool PADDED, int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, PADDED ? WG_SK_MIN_BLOCKS(BT) : 1)
wgmma_q6_k_sk(const u8* __restrict__ W, const u8* __restrict__ Xt, float* __restrict__ Y, int T, int N, int K,
              float* __restrict__ part, int* __restrict__ flags) {
    wgmma_gemm_sk<WgQ6K<PADDED, wg_q6_pf<BT>()>, BT, STAGES, false>(W, Xt, Y, T, N, K, part, flags, blockIdx.x,
                                                                    gridDim.x);
}
#endif
