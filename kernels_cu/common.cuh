// common.cuh: shared types and device helpers for the gguf-prefill kernels.
//
// engine/gpu/kernels.py inlines this file in place of `#include "common.cuh"` (with #line
// directives, so compiler messages point here), so the kernels need no include path and
// CuPy's source-keyed cache sees every change. No CUDA headers are included: f16 is
// converted with inline PTX, and the built-in NVRTC vector types (uint4, float2, ...)
// are used. The float numerics (non-ftz ops, rounding policies, SiLU, q8_1 blocks, warp
// reductions) are in numerics.cuh, included here.
//
// GGP_EMU (the CPU emulator, tests/cuda_emu, which includes this very file): the scalar and
// q6_K helpers build as plain C++; the PTX-only part (async copies, tensor cores, MMQ tiling)
// is left out (the emulator runs the MMQ GEMMs through the numpy oracle).
//
// Block layouts (engine/quants.py is the reference):
//   q4_K 144 B: d f16 @0, dmin f16 @2, scales[12] @4, qs[128] @16 (chunk c = 32 bytes:
//               sub-block 2c in the low nibbles, 2c+1 in the high nibbles).
//   q6_K 210 B: ql[128] @0, qh[64] @128, sc[16] int8 @192, d f16 @208;
//        224 B padded: the same + 14 zero bytes (16-byte aligned blocks).
//   q8_1 activations (device form): q int8 [T, K], ds float2 [T, K/32] = (d, s).
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#include "numerics.cuh"

// ---------------------------------------------------------------- programmatic dependent launch
//
// Every kernel begins with pdl_entry() or pdl_entry_trigger(). Inside a captured graph,
// engine/gpu/launch.py launches kernels with the programmatic-stream-serialization attribute
// (sm_90+): a kernel's blocks may be placed before its predecessor has finished, and wait in
// griddepcontrol.wait until that grid has completed and its writes are visible, so no kernel
// touches global data before its predecessor is done (reads and writes alike).
// pdl_entry_trigger() also lets the NEXT kernel launch as soon as every block of this one has
// started (griddepcontrol.launch_dependents); pdl_entry() leaves the trigger implicit (at exit).
// The early trigger is used by the single-stream decode kernels only (decode_fused.cu, mmvq,
// attention_decode's one-sequence split/combine, argmax_step): measured on the H200 (perf-log,
// session 8) it takes tg128 from 421 to 450 tok/s, while in the MMQ / varlen kernels of a
// batched step it cost 5-7% (not profiled; presumably the successor's waiting blocks get in the
// way of kernels bound by issue rather than by bandwidth). Without the attribute (eager launches)
// and below sm_90 both instructions do nothing.
//
// KERNEL_TIMELINE (a diagnostic define, 0 in production; dev/graph_timeline.py): thread 0 of
// block (0, 0, 0) of every kernel stamps %globaltimer once its wait returns (the predecessor
// done) into the buffer the host bound to this module's ggp_tl_buf (engine.gpu.kernels
// timeline_buffer): word 0 counts the stamps, words 1 + 2 i and 2 + 2 i hold the i-th (ns, the
// launch's grid / block signature). In a captured chain the i-th stamp is the i-th launch's
// start, so the differences are each kernel's share of the graph's time as it runs, PDL overlap
// included, which the profiler's serialized durations are not.
#ifndef KERNEL_TIMELINE
#define KERNEL_TIMELINE 0
#endif
#ifndef GGP_EMU
// %globaltimer: ns, one clock for every SM (the timelines' stamps, the stream-K owner's spin limit).
__device__ __forceinline__ unsigned long long globaltimer_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
    return t;
}
#endif
#if KERNEL_TIMELINE && !defined(GGP_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KERNEL_TL_CAP 65536
__device__ unsigned long long* ggp_tl_buf;
__device__ __forceinline__ void kernel_tl_stamp() {
    if ((threadIdx.x | threadIdx.y | threadIdx.z | blockIdx.x | blockIdx.y | blockIdx.z) != 0 || ggp_tl_buf == nullptr)
        return;
    const unsigned long long t = globaltimer_ns();
    const unsigned long long sig = (gridDim.x & 0xFFFFFull) | (unsigned long long)(gridDim.y & 0xFFFu) << 20 |
                                   (unsigned long long)(gridDim.z & 0xFFu) << 32 |
                                   (unsigned long long)(blockDim.x & 0x7FFu) << 40;
    const unsigned long long i = atomicAdd(ggp_tl_buf, 1ull);
    if (i < KERNEL_TL_CAP) {
        ggp_tl_buf[1 + 2 * i] = t;
        ggp_tl_buf[2 + 2 * i] = sig;
    }
}
#else
#define kernel_tl_stamp() ((void)0)
#endif
#if !defined(GGP_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void pdl_entry() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    kernel_tl_stamp();
}
__device__ __forceinline__ void pdl_entry_trigger() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    kernel_tl_stamp();
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
#elif !defined(GGP_EMU)
__device__ __forceinline__ void pdl_entry() {}
__device__ __forceinline__ void pdl_entry_trigger() {}
#else
inline void pdl_entry() {}
inline void pdl_entry_trigger() {}
#endif

// ---------------------------------------------------------------- scalar helpers

#ifndef GGP_EMU
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#else
inline float f16_to_f32(u16 h) { return emu_half_bits_to_float(h); }
#endif

// Exact int -> float for |i| < 2^22 without I2F (a quarter-rate conversion on sm_90): the
// MMA accumulates into C = MMQ_MAGIC_I, the bit pattern of 1.5*2^23, so D's bits read as a
// float are 1.5*2^23 + dot exactly; subtracting MMQ_MAGIC_F recovers dot (one FADD).
#define MMQ_MAGIC_I 0x4B400000
#define MMQ_MAGIC_F 12582912.0f

__device__ __forceinline__ float magic_to_float(int biased) {
    return __int_as_float(biased) - MMQ_MAGIC_F;
}

// ---------------------------------------------------------------- q6_K expansion

// The three pieces below are the very code of mmq_q6_k.cu's two B-staging arms, and
// q6k_expand_check.cu runs them against each other (the closed form vs the per-element map).
//
// Per-element expansion (the raw 210-byte arm and the reference for the closed form):
// element e (0..255) of a q6_K block -> centred value (-32..31).
__device__ __forceinline__ int expand_q6_elem(const u8* ql, const u8* qh, int e) {
    const int h = e >> 7, n = e & 127;
    const int ql_idx = h * 64 + (n & 63);
    const int ql_shift = (n >> 6) * 4;
    const int qh_idx = h * 32 + (n & 31);
    const int qh_shift = ((n >> 5) & 3) * 2;
    const int v = ((ql[ql_idx] >> ql_shift) & 0x0F) | (((qh[qh_idx] >> qh_shift) & 0x03) << 4);
    return v - 32;
}

// 4 packed 6-bit values (0..63, one per byte) -> 4 packed int8 (v - 32): v + 0x60 stays in
// 0x60..0x9F (no carry between bytes), and flipping bit 7 subtracts 0x80 mod 256.
__device__ __forceinline__ u32 center_q6x4(u32 v) {
    return (v + 0x60606060u) ^ 0x80808080u;
}

// Closed-form expansion of one 64-element unit of a q6_K half-block from three uint4 loads.
// For half h and l0 in {0, 16}:
//   ql0 = ql[64h + l0 .. +15], ql1 = ql[64h + 32 + l0 .. +15], qh = qh[32h + l0 .. +15]
// out[qq] (qq = 0..3) = the 16 centred int8 of elements n = 32*qq + l0 + i (i = 0..15):
//   low nibble of (qq & 1 ? ql1 : ql0) shifted by 4*(qq >> 1), high 2 bits = qh >> 2*qq.
__device__ __forceinline__ u32 q6_word(u32 qlw, u32 qhw, int qq) {
    const u32 lo = (qlw >> (4 * (qq >> 1))) & 0x0F0F0F0Fu;
    const u32 hi = (2 * qq <= 4) ? ((qhw << (4 - 2 * qq)) & 0x30303030u)
                                 : ((qhw >> (2 * qq - 4)) & 0x30303030u);
    return center_q6x4(lo | hi);
}

__device__ __forceinline__ void expand_q6_unit(const uint4& ql0, const uint4& ql1, const uint4& qh,
                                               uint4 (&out)[4]) {
#pragma unroll
    for (int qq = 0; qq < 4; ++qq) {
        const uint4& l = (qq & 1) ? ql1 : ql0;
        out[qq].x = q6_word(l.x, qh.x, qq);
        out[qq].y = q6_word(l.y, qh.y, qq);
        out[qq].z = q6_word(l.z, qh.z, qq);
        out[qq].w = q6_word(l.w, qh.w, qq);
    }
}

// The padded arm's loads of a unit (224-byte blocks, 16-byte aligned) stay written out in
// mmq_q6_k.cu load_b (and repeated verbatim in q6k_expand_check.cu): ql0 at blk + 64 h + l0,
// ql1 at blk + 64 h + 32 + l0, qh at blk + 128 + 32 h + l0. A shared load helper (by
// reference, or as offset functions) changes that kernel's machine code (dev/kernel_identity.py).

// The raw arm (210-byte blocks, 2-byte aligned): 16 elements n = 32 qq + 16 l0b + i of half h
// through expand_q6_elem (byte loads), packed like expand_q6_unit's out[qq].
__device__ __forceinline__ uint4 expand_q6_group_raw(const u8* blk, int h, int qq, int l0b) {
    u32 w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 acc4 = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int e = h * 128 + qq * 32 + 16 * l0b + 4 * j + b;
            acc4 |= ((u32)(expand_q6_elem(blk, blk + 128, e) & 0xFF)) << (8 * b);
        }
        w[j] = acc4;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

#ifndef GGP_EMU   // ---- PTX only from here (see the top)

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void st_shared_v4(u32 addr, const uint4& v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// ---------------------------------------------------------------- async copies

// 16-byte global -> shared copy through L2 only; src_bytes = 0 zero-fills (ragged edges).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// ---------------------------------------------------------------- tensor cores

__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// D = A(16x32 s8, row) * B(32x8 s8, col) + C, all four C lanes = c.
// Fragments (g = lane>>2, t = lane&3): a0 row g k 4t..4t+3, a1 row g+8, a2 row g k+16, a3 row g+8 k+16;
// b0 k 4t..4t+3 col g, b1 k+16; d0,d1 row g cols 2t,2t+1; d2,d3 row g+8.
__device__ __forceinline__ void mma_s8_k32(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                           u32 b0, u32 b1, int c) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1),
                   "r"(c), "r"(c), "r"(c), "r"(c));
}

// The same with A unsigned (u8 0..255): a q4_K high nibble masked in place (q << 4) needs no shift.
__device__ __forceinline__ void mma_u8s8_k32(int (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                             u32 b0, u32 b1, int c) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1),
                   "r"(c), "r"(c), "r"(c), "r"(c));
}

// 2^23 + (byte k of w), exactly, as a float: one PRMT in place of a shift, a mask and a
// quarter-rate I2F; subtract 2^23 (or fold -2^23 x into an FMA) for the byte's value.
#define BYTE_MAGIC_F 8388608.0f
__device__ __forceinline__ float byte_magic(u32 w, u32 k) {
    return __int_as_float((int)__byte_perm(w, 0x4B000000u, 0x7650u | k));
}

// D = A(16x16 s8) * B(16x8 s8) + C: a0 row g k 4t.., a1 row g+8; b0 k 4t.. col g.
__device__ __forceinline__ void mma_s8_k16(int (&d)[4], u32 a0, u32 a1, u32 b0, int c) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 "
                 "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %8, %9, %10};\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0), "r"(c), "r"(c), "r"(c), "r"(c));
}

// D += A(16x8 tf32, row) * B(8x8 tf32, col): a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4);
// b0 (k t, col g), b1 (k t+4, col g).
__device__ __forceinline__ void mma_tf32_k8(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D += A(16x4 tf32, row) * B(4x8 tf32, col): a0 row g col t, a1 row g+8 col t; b0 row t col g.
__device__ __forceinline__ void mma_tf32_k4(float (&d)[4], u32 a0, u32 a1, u32 b0) {
    asm("mma.sync.aligned.m16n8k4.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b0));
}

__device__ __forceinline__ u32 f32_to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// ---------------------------------------------------------------- MMQ tiling (shared by q4_K / q6_K)
//
// Block tile BM tokens x BN weight rows, WM x WN warps, warp tile (MT*16) x (NT*8).
// K advances KS (128 = half a super-block, or 256 = one) per stage; 2 buffers per operand,
// one __syncthreads per stage (the copies of stage s+1 are issued right after it and have a
// whole stage of compute to land). The A operand (tokens, q8_1) is staged by cp.async:
//   sA   [BM][KS] int8, 16-byte chunk ch of row r stored at chunk ch ^ (r & 7)
//        (ldmatrix reads 8 rows of one chunk: 8 distinct bank groups);
//   sAds [BM][KS/32] float2 (d8, s8) of the stage's 32-element blocks.
#define MMQ_NBUF 2

template <int MT, int NT, int WM, int WN, int KS>
struct MmqShape {
    static_assert(KS == 128 || KS == 256, "KS is 128 or 256");
    static constexpr int NTH = WM * WN * 32;
    static constexpr int BM = WM * MT * 16;
    static constexpr int BN = WN * NT * 8;
    static constexpr int NC = KS / 32;                 // q8_1 blocks per stage
    static constexpr int A_BYTES = BM * KS;
    static constexpr int ADS_BYTES = BM * NC * 8;
};

__device__ __forceinline__ u32 dyn_smem_bytes() {
    u32 r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// Issue the cp.async copies of stage s (k = KS s .. KS s + KS - 1) of the q8_1 activations.
// Thread tid copies the 16-byte chunk ch = tid % PR of rows row0 + i*(NTH/PR) (PR chunks per
// row), so the source advances by a fixed stride per piece and the (swizzled) destination by
// a constant. Tokens >= T are zero-filled (src-size 0, source clamped to row 0).
template <int BM, int NTH, int KS>
__device__ __forceinline__ void mmq_stage_a(u32 sA, u32 sAds, const i8* __restrict__ Aq,
                                            const float2* __restrict__ Ads, int m_base, int T,
                                            int K, int s, int tid) {
    constexpr int PR = KS / 16;
    static_assert(NTH % PR == 0, "threads must cover whole rows");
    constexpr int RSTEP = NTH / PR;
    {
        const int row0 = tid / PR, ch = tid % PR;
        const i8* src0 = Aq + (size_t)(m_base + row0) * K + (size_t)s * KS + ch * 16;
        const u32 dst0 = sA + row0 * KS + ((ch ^ (row0 & 7)) << 4);
#pragma unroll
        for (int i = 0; i < (BM + RSTEP - 1) / RSTEP; ++i) {
            const int row = row0 + i * RSTEP;
            if (BM % RSTEP == 0 || row < BM) {
                const bool ok = m_base + row < T;
                const i8* src = ok ? src0 + (size_t)i * RSTEP * K : Aq;
                cp_async16(dst0 + i * RSTEP * KS, src, ok ? 16 : 0);
            }
        }
    }
    constexpr int DR = KS / 64;                         // 16-byte pieces of (d, s) per row
    constexpr int DSTEP = NTH / DR;
    {
        const int row0 = tid / DR, hf = tid % DR;
        const float2* src0 = Ads + (size_t)(m_base + row0) * (K >> 5) + (size_t)s * (KS / 32) + hf * 2;
#pragma unroll
        for (int i = 0; i < (BM + DSTEP - 1) / DSTEP; ++i) {
            const int row = row0 + i * DSTEP;
            if (BM % DSTEP == 0 || row < BM) {
                const bool ok = m_base + row < T;
                const float2* src = ok ? src0 + (size_t)i * DSTEP * (K >> 5) : Ads;
                cp_async16(sAds + row * (KS / 4) + hf * 16, src, ok ? 16 : 0);
            }
        }
    }
}

// A fragment (m16 x k32) of m-tile rows [row0, row0+16) and 32-element block c of the stage.
// lane l reads row row0 + (l&7) + 8*((l>>3)&1), chunk 2c + (l>>4): ldmatrix.x4 then yields
// exactly a0..a3 of the m16n8k32 A fragment.
template <int KS>
__device__ __forceinline__ void mmq_load_a(u32 (&a)[4], u32 sA, int row0, int c, int lane) {
    const int r = lane & 7;
    const int row = row0 + r + (((lane >> 3) & 1) << 3);
    const int ch = 2 * c + (lane >> 4);
    ldmatrix_x4(a[0], a[1], a[2], a[3], sA + row * KS + ((ch ^ r) << 4));
}

// Store the accumulators: y[t, n] row-major [T, N]; d0,d1 -> (g, 2t..2t+1), d2,d3 -> (g+8, ..).
template <int MT, int NT>
__device__ __forceinline__ void mmq_store(float* __restrict__ Y, const float (&acc)[MT][NT][4],
                                          int T, int N, int t_base, int n_base, int lane) {
    const int g = lane >> 2, tig = lane & 3;
    const bool pairs = (N & 1) == 0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int t = t_base + mt * 16 + g + 8 * half;
            if (t >= T) continue;
            float* yrow = Y + (size_t)t * N;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int n = n_base + nt * 8 + 2 * tig;
                const float v0 = acc[mt][nt][2 * half], v1 = acc[mt][nt][2 * half + 1];
                if (pairs && n + 1 < N) {
                    *reinterpret_cast<float2*>(yrow + n) = make_float2(v0, v1);
                } else {
                    if (n < N) yrow[n] = v0;
                    if (n + 1 < N) yrow[n + 1] = v1;
                }
            }
        }
    }
}

// ---------------------------------------------------------------- MMQ grid and tail split
//
// Tile t covers weight rows (t % nx) BN.. and tokens (t / nx) BM.. (nx = ceil(N / BN):
// consecutive blocks share a token tile). Two instances per tile shape:
//   SPLIT = false: grid (nx, ceil(split0 / nx)), block (x, y) computes tile t = y nx + x over
//                  all K stages; blocks with t >= split0 exit at once (mmq_no_tile). Without a
//                  split, split0 = the number of tiles.
//   SPLIT = true : 1-D grid, launched after the whole tiles [0, split0) (host:
//                  engine.gpu_ops.split_plan, split0 = the tiles of the full waves); block b
//                  computes part p = b % parts of tile split0 + b / parts over the stages
//                  [p nst / parts, (p+1) nst / parts), so the last, partial wave takes ~1/parts
//                  of the time of a whole tile.
// The whole-tile instance carries none of the split's state: its loop and registers are the
// unsplit kernel's (a 1-D tile index there costs the q6_K kernel 28 more bytes of spill).
// Small batches (several token tiles, ny BM <= MMQ_TFAST_TOKENS, ny = ceil(T / BM) > 1): tile t
// covers tokens (t % ny) BM.. and weight rows (t / ny) BN.. instead ("token-fast"): the blocks of
// one weight tile's token tiles are consecutive, so they run together and its bytes come from
// DRAM once (the later blocks hit L2). Same tiles, same sums; only which block computes which.
struct MmqWork {
    int n_base, m_base;   // first weight row / token of the tile
    int s0, s1;           // stages [s0, s1) of this block
    int slot, part;       // SPLIT: split tile index t - split0 and part
};

__device__ __forceinline__ bool mmq_no_tile(int split0) {       // SPLIT = false grids only
    return (int)(blockIdx.y * gridDim.x + blockIdx.x) >= split0;
}

#define MMQ_TFAST_TOKENS 64

template <int BM, int BN, bool SPLIT>
__device__ __forceinline__ MmqWork mmq_work(int T, int N, int nst, int split0, int parts) {
    MmqWork w;
    w.slot = 0, w.part = 0, w.s0 = 0, w.s1 = nst;
    const int ny = (T + BM - 1) / BM;
    const bool tfast = ny > 1 && ny * BM <= MMQ_TFAST_TOKENS;
    int t;
    if (!SPLIT) {
        if (!tfast) {
            w.n_base = blockIdx.x * BN;
            w.m_base = blockIdx.y * BM;
            return w;
        }
        t = blockIdx.y * gridDim.x + blockIdx.x;
    } else {
        w.slot = blockIdx.x / parts;
        w.part = blockIdx.x % parts;
        w.s0 = w.part * nst / parts;
        w.s1 = (w.part + 1) * nst / parts;
        t = split0 + w.slot;
    }
    const int nx = (N + BN - 1) / BN;
    w.n_base = (tfast ? t / ny : t % nx) * BN;
    w.m_base = (tfast ? t % ny : t / nx) * BM;
    return w;
}

// Epilogue of a split tile (SPLIT instance): every part writes its accumulators to the workspace
// Wsp [split tiles][parts][MT NT 4][NTH] (f32, coalesced per element), then the last part to
// arrive (counter Cnt[slot], re-armed to 0 by that block) reads them back and sums them in
// the fixed order 0, 1, .., parts-1 (the same bits whichever part arrives last; one f32 add
// per part, within the stated error bound) and returns true: it stores the tile.
template <int MT, int NT, int NTH>
__device__ __forceinline__ bool mmq_split_reduce(float (&acc)[MT][NT][4], const MmqWork& w, int parts,
                                                 float* __restrict__ Wsp, u32* __restrict__ Cnt, int tid) {
    constexpr int E = MT * NT * 4;
    float* ws = Wsp + (size_t)w.slot * parts * E * NTH + tid;     // element e of part p: ws[(p E + e) NTH]
    float* mine = ws + (size_t)w.part * E * NTH;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) __stcg(mine + ((mt * NT + nt) * 4 + i) * NTH, acc[mt][nt][i]);
    __shared__ u32 last;
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(Cnt + w.slot, 1u) == (u32)parts - 1u;
    __syncthreads();
    if (!last) return false;
    __threadfence();
#pragma unroll 1
    for (int p = 0; p < parts; ++p) {
        const float* src = ws + (size_t)p * E * NTH;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float x = __ldcg(src + ((mt * NT + nt) * 4 + i) * NTH);
                    acc[mt][nt][i] = p == 0 ? x : acc[mt][nt][i] + x;
                }
    }
    if (tid == 0) Cnt[w.slot] = 0u;                 // re-armed for the next launch / replay
    return true;
}

#endif  // GGP_EMU
