// wgmma_q4_k.cu: Hopper (sm_90a) prefill GEMM y[T, N] = x[T, K] . W[N, K]^T with W in q4_K
// blocks dequantized to f16 in registers (the A operand of wgmma.m64n128k16, f32 accumulation
// over the whole K) and x in f16 from shared memory (the B operand). Issue 14, route (b).
//
// Inputs: W uint8 [N, K/256 * 144] (q4_K rows: d f16 @0, dmin f16 @2, scales[12] @4, qs[128] @16);
//         Xt f16 [K/64, ceil(T/8), 8, 8, 8]: 64-k block, token group, 8-k chunk, token, k in the
//            permuted k order below, tokens past T zero (wgmma_tile_x16 writes it), so that one
//            stage (BT tokens x 64 k) is BT / 8 x 1,024 contiguous bytes laid out as shared memory
//            wants them;
//         Y f32 [T, N]. N % 128 == 0, K % 256 == 0; T any (ragged token tiles are zero-filled).
// Weight numerics (engine.reference.wgmma.dequant_q4_k_f16 emulates them bit for bit):
//   s = f16(d sc_j), m' = f16(dmin m_j) (f32 products, exact, rounded once to f16),
//   w = f16(q s - m') (one fused f16x2 FMA: HFMA2), for q in 0..15 of sub-block j.
// The GEMM sums f16 x f16 products in f32 on the tensor cores (order inside wgmma unspecified).
//
// Fragments (A from registers, as mma.m16n8k16: warp v of a warpgroup owns rows 16v..16v+15;
// lane (g, t) = (lane / 4, lane % 4) holds rows g and g+8, k columns 2t, 2t+1, 2t+8, 2t+9 of
// each k16 step). Lane t reads qs chunk t (bytes 32t..32t+31: sub-block 2t in the low nibbles,
// 2t+1 in the high ones) of its two rows as 8 words; word m feeds k16 steps 2m and 2m+1:
//   step 2m:   cols 2t+e   <- low nibble of byte 4m+2e,   cols 2t+8+e <- low of byte 4m+1+2e
//   step 2m+1: cols 2t+e   <- high nibble of byte 4m+2e,  cols 2t+8+e <- high of byte 4m+1+2e
// so logical k L = 16 s + c of a super-block holds element P(L) (wgmma_tile_x16 and
// engine.reference.wgmma.k_permutation): s = 2m + hi, c = 2t + 8 f + e ->
//   P = 64 t + 32 hi + 4 m + f + 2 e.
// Nibbles to f16 without conversions: (w & 0x000F000F) | 0x6400.. is the f16 pair 1024 + q;
// (w & 0x00F000F0) | 0x6400.. is 1024 + 16 q; one HADD2 / HFMA2 leaves q exactly.
//
// Shared memory, one activation stage = BT tokens x 64 k f16, as wgmma's no-swizzle K-major
// core matrices (8 tokens x 16 bytes, 128 contiguous bytes): byte of (token n, k) =
//   (n / 8) * 1024 + (k / 8) * 128 + (n % 8) * 16 + (k % 8) * 2,
// i.e. one contiguous range of Xt. Descriptor: LBO (next 8 k) = 128 B, SBO (next
// 8 tokens) = 1024 B; k16 step s starts at 256 s.
//
// Grid: x = token tile (fastest, so the blocks in flight share few weight rows and each row tile
// is read from DRAM about once), y = 128-row tile.
// Pipeline: STAGES buffers, each filled by one cp.async.bulk copy (async proxy, completion
// counted in bytes on the buffer's mbarrier), STAGES - 1 stages ahead. Each warpgroup
// waits for stage j's mbarrier, dequantizes its A fragments while its wgmmas of stage j - 1 run,
// issues stage j, waits for stage j - 1 (wgmma.wait_group 1); after a barrier of both warpgroups
// thread 0 refills buffer j - 1. No proxy fence in the loop: with 16-byte cp.async (generic
// proxy) every stage needs fence.proxy.async, whose MEMBAR also waits for the weight loads in
// flight, and that pipeline measured 10-25% slower (docs/perf-log.md, Session 12).
// Weights stream register-direct, one super-block (6 x 16 bytes per lane) ahead.
#include "common.cuh"

#define WG_BK 64                       // k per activation stage
#define WG_ROWS 128                    // weight rows per block (2 warpgroups x 64)
#define WG_THREADS 256

__device__ __forceinline__ u64 wg_desc(u32 saddr, u32 lbo, u32 sbo) {
    return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// bytes (multiple of 16) global -> shared through the async proxy, counted on mbarrier bar.
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// D[64 x 128] += A[64 x 16] (registers) . B[16 x 128] (shared, K-major, descriptor)
__device__ __forceinline__ void wgmma_n128(float (&d)[64], const u32 (&a)[4], u64 desc) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

__device__ __forceinline__ u32 h2_fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
__device__ __forceinline__ u32 h2_add(u32 a, u32 b) {
    u32 r;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 f32_to_h2_bcast(float x) {   // (f16(x), f16(x)), round to nearest
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return (u32)h * 0x10001u;
}

#define H2_1024 0x64006400u            // (1024, 1024)
#define H2_M1024 0xE400E400u           // (-1024, -1024)
#define H2_1_16 0x2C002C00u            // (1/16, 1/16)
#define H2_M64 0xD400D400u             // (-64, -64)

// One super-block of a lane's two rows: the 16-byte header and the 32 qs bytes of chunk t.
struct WgSb {
    uint4 hdr[2];
    uint4 qs[2][2];
};

__device__ __forceinline__ void wg_load_sb(WgSb& s, const u8* r0, const u8* r1, int sb, int t) {
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
__device__ __forceinline__ void wg_scales(const uint4& h, int t, u32& s_lo, u32& m_lo, u32& s_hi, u32& m_hi) {
    const float d = f16_to_f32((u16)(h.x & 0xFFFF)), dmin = f16_to_f32((u16)(h.x >> 16));
    const u32 sc[3] = {h.y, h.z, h.w};                 // scales[0..11]
    int s[2], m[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int j = 2 * t + i;                       // run-time j: byte extraction by shifts
        const u32 bj = (sc[0] >> (8 * (j & 3))) & 0xFF, bj4 = (sc[1] >> (8 * (j & 3))) & 0xFF;
        const u32 bj8 = (sc[2] >> (8 * (j & 3))) & 0xFF;
        if (j < 4) {
            s[i] = bj & 63;
            m[i] = bj4 & 63;
        } else {                                       // j - 4 in 0..3: bytes j-4 (sc[0]), j (sc[1]), j+4 (sc[2])
            s[i] = (bj8 & 0xF) | ((bj >> 6) << 4);
            m[i] = (bj8 >> 4) | ((bj4 >> 6) << 4);
        }
    }
    s_lo = f32_to_h2_bcast(d * (float)s[0]);
    s_hi = f32_to_h2_bcast(d * (float)s[1]);
    m_lo = f32_to_h2_bcast(dmin * (float)m[0]) ^ 0x80008000u;   // -m' (exact negation)
    m_hi = f32_to_h2_bcast(dmin * (float)m[1]) ^ 0x80008000u;
}

// Word -> the two k16 steps' registers of one row: lo = step 2m (cols 2t.., 2t+8..), hi = step 2m+1.
__device__ __forceinline__ void wg_dequant_word(u32 w, u32 s_lo, u32 m_lo, u32 s_hi, u32 m_hi,
                                                u32& lo_a, u32& lo_b, u32& hi_a, u32& hi_b) {
    const u32 w8 = w >> 8;
    lo_a = h2_fma(h2_add((w & 0x000F000Fu) | H2_1024, H2_M1024), s_lo, m_lo);
    lo_b = h2_fma(h2_add((w8 & 0x000F000Fu) | H2_1024, H2_M1024), s_lo, m_lo);
    hi_a = h2_fma(h2_fma((w & 0x00F000F0u) | H2_1024, H2_1_16, H2_M64), s_hi, m_hi);
    hi_b = h2_fma(h2_fma((w8 & 0x00F000F0u) | H2_1024, H2_1_16, H2_M64), s_hi, m_hi);
}

__device__ __forceinline__ u32 uint4_word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Stage jj (0..3) of a super-block: words 2jj, 2jj+1 of both rows -> 4 k16 steps x 4 registers.
__device__ __forceinline__ void wg_stage_frags(u32 (&a)[4][4], const WgSb& s, int jj, const u32 (&sc)[2][4]) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int m = 2 * jj + q;                      // word index 0..7, compile-time after unroll
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u32 w = uint4_word(s.qs[r][m >> 2], m & 3);
            u32 lo_a, lo_b, hi_a, hi_b;
            wg_dequant_word(w, sc[r][0], sc[r][1], sc[r][2], sc[r][3], lo_a, lo_b, hi_a, hi_b);
            a[2 * q][r] = lo_a;                        // step 2m: reg r = row g / g+8, cols 2t..
            a[2 * q][2 + r] = lo_b;                    //          reg 2+r: cols 2t+8..
            a[2 * q + 1][r] = hi_a;
            a[2 * q + 1][2 + r] = hi_b;
        }
    }
}

template <int BT>
__device__ __forceinline__ void wg_issue_stage(float (&acc)[BT / 128][64], const u32 (&a)[4][4], u32 sbuf) {
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int h = 0; h < BT / 128; ++h)
            wgmma_n128(acc[h], a[s], wg_desc(sbuf + h * 16 * 1024 + s * 256, 128, 1024));
}

// Byte offset in Xt of the 1,024-byte piece (token group gi, k0 .. k0 + 63).
__device__ __forceinline__ size_t wg_piece(int gi, int ngroups, int k0) {
    return ((size_t)(k0 / WG_BK) * ngroups + gi) * 1024;
}

// Thread 0: the stage's token groups in one copy; groups past the last one are not copied (their
// token columns are never stored).
template <int BT>
__device__ __forceinline__ void wg_bulk_stage(u32 sbuf, u32 bar, const u8* __restrict__ Xt, int ngroups, int g0,
                                              int k0) {
    const u32 bytes = (u32)min(BT / 8, ngroups - g0) * 1024;
    mbar_arrive_expect_tx(bar, bytes);
    bulk_g2s(sbuf, Xt + wg_piece(g0, ngroups, k0), bytes, bar);
}

template <int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, 1)
wgmma_q4_k(const u8* __restrict__ W, const u8* __restrict__ Xt, float* __restrict__ Y, int T, int N, int K) {
    pdl_entry();
    extern __shared__ __align__(1024) u8 smem[];
    const u32 s0 = smem_u32(smem);
    constexpr u32 STAGE_BYTES = BT * WG_BK * 2;
    const u32 bars = s0 + STAGES * STAGE_BYTES;                  // one 8-byte mbarrier per buffer
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.y * WG_ROWS + warp * 16 + g;       // warpgroup wg: warps 4wg..4wg+3
    const int g0 = blockIdx.x * (BT / 8), ngroups = (T + 7) / 8;
    const size_t row_bytes = (size_t)(K / 256) * 144;
    const u8* r0 = W + (size_t)row0 * row_bytes;
    const u8* r1 = r0 + 8 * row_bytes;
    const int nst = K / WG_BK, nsb = K / 256;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int b = 0; b < STAGES; ++b) mbar_init(bars + 8 * b, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int j = 0; j < STAGES && j < nst; ++j)
            wg_bulk_stage<BT>(s0 + j * STAGE_BYTES, bars + 8 * j, Xt, ngroups, g0, j * WG_BK);

    float acc[BT / 128][64];
#pragma unroll
    for (int h = 0; h < BT / 128; ++h)
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;

    WgSb cur, nxt;
    wg_load_sb(cur, r0, r1, 0, t);
    u32 sc[2][4];
    u32 a[4][4];
    for (int sb = 0; sb < nsb; ++sb) {
        if (sb + 1 < nsb) wg_load_sb(nxt, r0, r1, sb + 1, t);
        wg_scales(cur.hdr[0], t, sc[0][0], sc[0][1], sc[0][2], sc[0][3]);
        wg_scales(cur.hdr[1], t, sc[1][0], sc[1][1], sc[1][2], sc[1][3]);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            const int j = sb * 4 + jj;
            mbar_wait(bars + 8 * (j % STAGES), (j / STAGES) & 1);       // stage j landed
            wg_stage_frags(a, cur, jj, sc);
            wg_fence();
            wg_issue_stage<BT>(acc, a, s0 + (j % STAGES) * STAGE_BYTES);
            wg_commit();
            wg_wait<1>();                              // stage j - 1 retired in this warpgroup
            const int jn = j - 1 + STAGES;             // refill buffer j - 1 once both warpgroups retired it
            __syncthreads();
            if (threadIdx.x == 0 && j >= 1 && jn < nst)
                wg_bulk_stage<BT>(s0 + (jn % STAGES) * STAGE_BYTES, bars + 8 * (jn % STAGES), Xt, ngroups, g0,
                                  jn * WG_BK);
        }
        cur = nxt;
    }
    wg_wait<0>();

    // acc[h][4 i + e]: row g + 8 (e >> 1), token 128 h + 8 i + 2 t + (e & 1)
    const int tok0 = g0 * 8;
#pragma unroll
    for (int h = 0; h < BT / 128; ++h)
#pragma unroll
        for (int i = 0; i < 16; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int tok = tok0 + 128 * h + 8 * i + 2 * t + (e & 1);
                if (tok < T) Y[(size_t)tok * N + row0 + 8 * (e >> 1)] = acc[h][4 * i + e];
            }
}

// x f32 [T, K] -> Xt f16 [K/64, ceil(T/8), 8, 8, 8] (layout at the top): element (token n, logical
// k L of super-block b) = f16(x[n, 256 b + P(L)]), zero for n >= T. One thread per element of Xt.
__global__ void wgmma_tile_x16(const float* __restrict__ x, u16* __restrict__ Xt, int T, int K) {
    pdl_entry();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int ngroups = (T + 7) / 8;
    if (i >= (size_t)ngroups * 8 * K) return;
    const int kk = (int)(i & 7), nn = (int)((i >> 3) & 7), kc = (int)((i >> 6) & 7);
    const size_t piece = i >> 9;                               // 64-k block * ngroups + token group
    const int n = (int)(piece % ngroups) * 8 + nn, kabs = (int)(piece / ngroups) * WG_BK + kc * 8 + kk;
    const int L = kabs & 255;
    const int s = L >> 4, c = L & 15;
    const int hi = s & 1, m = s >> 1, e = c & 1, f = (c >> 3) & 1, tt = (c >> 1) & 3;
    const int P = 64 * tt + 32 * hi + 4 * m + f + 2 * e;
    u16 h = 0;
    if (n < T) asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x[(size_t)n * K + (kabs & ~255) + P]));
    Xt[i] = h;
}
