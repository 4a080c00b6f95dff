// decode_common.cuh: device helpers shared by the decode kernels (mmvq_q4_k.cu, mmvq_q6_k.cu,
// decode_fused.cu, attention_decode.cu). Inlined after common.cuh by engine/kernels.py.
//
// q8_1_warp: the q8_1 block of 32 values held one per lane of a warp (engine.quants.quantize_q8_1):
//   d = amax / 127, q_i = amax == 0 ? 0 : roundf(x_i / d), s = d * sum(q) (integer sum, exact).
// mmvq_epilogue: an MMVQ warp's R row sums -> y (store / add / swiglu).
// l2_prefetch_share: an MMVQ block's share of the next GEMV's weights into L2 (DEC_L2PF).
#pragma once

#ifndef MMVQ_NW
#define MMVQ_NW 4         // warps (rows) per MMVQ block (2 | 8: A/B defines; the launcher follows)
#endif
#ifndef MMVQ_UNROLL
#define MMVQ_UNROLL 2     // loop iterations (super-block slots) a lane keeps in flight
#endif

// 16-byte weight load that skips L1 (each weight byte is used once). GGP_EMU: the CPU
// emulator of tests/cuda_emu (plain C++ in place of PTX).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
#ifndef GGP_EMU
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}

#ifndef DEC_L2PF
#define DEC_L2PF 0        // MiB of the next GEMV's weights an MMVQ launch asks L2 for (0: none; A/B)
#endif

// The tail of an MMVQ block: its share of the next GEMV's weights into L2 (the first DEC_L2PF
// MiB of ranges p0 [n0 bytes] and p1 [n1], together; block b of G takes bytes [b S / G, (b + 1)
// S / G) of the S it asks for, rounded to 16, in one cp.async.bulk.prefetch by thread 0). The
// blocks that finish first start the next matrix's stream while the last ones still read theirs,
// and it runs on through the small kernels in between (norm, RoPE, attention), where the DRAM
// would idle. A hint: no result depends on it (the weights are never written during a step),
// and nothing waits for it. The bulk prefetch wants 16-byte aligned addresses and sizes: a
// misaligned range is skipped.
__device__ __forceinline__ void l2_prefetch_share(const u8* p0, long long n0, const u8* p1, long long n1) {
#if DEC_L2PF > 0 && !defined(GGP_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (threadIdx.x != 0) return;
    constexpr long long cap = (long long)DEC_L2PF << 20;
    n0 = ((size_t)p0 & 15) ? 0 : min(n0, cap) & ~15LL;
    n1 = ((size_t)p1 & 15) ? 0 : min(n1, cap - n0) & ~15LL;
    const long long total = n0 + n1, g = gridDim.x;
    const long long a = (total * blockIdx.x / g) & ~15LL;
    const long long b = blockIdx.x + 1 == g ? total : (total * (blockIdx.x + 1) / g) & ~15LL;
    if (a < n0 && a < b)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p0 + a), "r"((u32)(min(b, n0) - a)) : "memory");
    if (b > n0 && max(a, n0) < b)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p1 + (max(a, n0) - n0)), "r"((u32)(b - max(a, n0)))
                     : "memory");
#else
    (void)p0; (void)n0; (void)p1; (void)n1;
#endif
}

// SiLU and the q8_1 warp block of the decode kernels: numerics.cuh in the RnFtz policy (the
// ftz intrinsics; quantize_q8_1.cu runs the same block in RnExact, prefill swiglu.cu the same
// SiLU in RnDivExact: merging them would change production machine code).
__device__ __forceinline__ float silu_ref(float g) { return silu<RnFtz>(g); }

// q8_1 of one 32-value block, lane i holding x_i; every lane writes its q, lane 0 writes (d, s).
__device__ __forceinline__ void q8_1_warp(float x, i8* __restrict__ q, float2* __restrict__ ds) {
    q8_1_warp32<RnFtz>(x, q, ds, threadIdx.x & 31);
}

// ---------------------------------------------------------------- MMVQ epilogue

// Row sums -> outputs (lane i of the warp stores row row0 + i).
template <int R, int MODE, int NR>
__device__ __forceinline__ void mmvq_epilogue(float (&acc)[NR], bool active, int row0, int N,
                                              float* __restrict__ Y) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], off);
    }
    if (active && lane < R && row0 + lane < N) {
        float v = acc[0], u = (MODE == 2) ? acc[R] : 0.0f;
#pragma unroll
        for (int i = 1; i < R; ++i) {
            if (lane == i) {
                v = acc[i];
                if (MODE == 2) u = acc[R + i];
            }
        }
        const int n = row0 + lane;
        if (MODE == 0) Y[n] = v;
        else if (MODE == 2) Y[n] = __fmul_rn(silu_ref(v), u);
        else Y[n] += v;
    }
}
