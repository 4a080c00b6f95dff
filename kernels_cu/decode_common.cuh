// decode_common.cuh: device helpers shared by the decode kernels (mmvq_q4_k.cu, mmvq_q6_k.cu,
// decode_fused.cu, attention_decode.cu). Inlined after common.cuh by engine/kernels.py.
//
// q8_1_warp: the q8_1 block of 32 values held one per lane of a warp (engine.quants.quantize_q8_1):
//   d = amax / 127, q_i = amax == 0 ? 0 : roundf(x_i / d), s = d * sum(q) (integer sum, exact).
// mmvq_epilogue: an MMVQ warp's R row sums -> y (store / add / swiglu).
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
