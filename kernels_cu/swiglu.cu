// swiglu.cu: SwiGLU fused with the q8_1 quantization of its output (the ffn_down A operand).
//
// In:  g, u float32, row t at g + t*ld, u + t*ld (F columns each; with the fused gate|up GEMM
//      output [T, 2F] that is g = gu, u = gu + F, ld = 2F). F % 32 == 0.
// Out: h = silu(g) * u = (g / (1 + exp(-g))) * u        (engine.reference.silu, float32)
//      as q8_1: q int8 [T, F], ds float2 [T, F/32] = (d, s), quantize_q8_1.cu's formula.
// One warp per 32-element block (nblk = T*F/32), lane i holds element i; block 256 threads.
#include "common.cuh"

#ifndef GGP_EMU
__device__ __forceinline__ float sw_add(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float sw_div(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
#else   // CPU emulation (tests/cuda_emu)
inline float sw_add(float a, float b) { return a + b; }
inline float sw_div(float a, float b) { return a / b; }
#endif

extern "C" __global__ void __launch_bounds__(256)
swiglu_q8_1(const float* __restrict__ g, const float* __restrict__ u, long long ld, int F,
            i8* __restrict__ q, float2* __restrict__ ds, long long nblk) {
    const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (gw >= nblk) return;                       // whole warps only
    const int fb = F >> 5;
    const long long t = gw / fb;
    const int c = (int)(gw - t * fb);
    const long long src = t * ld + 32 * c + lane;
    const float gv = g[src], uv = u[src];
    const float h = __fmul_rn(sw_div(gv, sw_add(1.0f, expf(-gv))), uv);
    float amax = fabsf(h), s = h;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        s = sw_add(s, __shfl_xor_sync(0xffffffffu, s, off));
    }
    const float d = sw_div(amax, 127.0f);
    const int qi = (__float_as_int(amax) == 0) ? 0 : (int)roundf(sw_div(h, d));
    q[gw * 32 + lane] = (i8)qi;
    if (lane == 0) ds[gw] = make_float2(d, s);
}
