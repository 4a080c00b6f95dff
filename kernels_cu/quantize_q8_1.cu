// quantize_q8_1.cu: f32 activations -> q8_1 blocks (the MMQ A operand).
//
// In:  x float32 [T, K] row-major (K % 32 == 0), viewed as nblk = T*K/32 blocks of 32.
// Out: q int8 [T, K]; ds float2 [T, K/32] = (d, s) per block.
// One warp per block, lane i holds x_i (engine.quants.quantize_q8_1 is this, bit for bit):
//   amax = max_i |x_i|                               (butterfly, order irrelevant)
//   d    = amax / 127.0f                             (IEEE division)
//   q_i  = amax == 0 ? 0 : roundf(x_i / d)           (IEEE division, half away from zero)
//   s    = d * sum_i q_i                             (integer butterfly sum, exact; one
//                                                     float32 rounding; why not sum(x): quants.py)
// CuPy compiles with -ftz=true; abs/max/div/mul here are inline PTX without .ftz and the
// zero test reads the bits, so subnormal inputs give numpy's result too.
#include "common.cuh"

__device__ __forceinline__ float mul_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float max_nf(float a, float b) {
    float r;
    asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float abs_nf(float a) {
    float r;
    asm("abs.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
__device__ __forceinline__ float div_rn(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

extern "C" __global__ void __launch_bounds__(256)
quantize_q8_1(const float* __restrict__ x, i8* __restrict__ q, float2* __restrict__ ds,
              long long nblk) {
    const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (gw >= nblk) return;                    // whole warps only (blockDim % 32 == 0)
    const float v = x[gw * 32 + lane];
    float amax = abs_nf(v);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = max_nf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float d = div_rn(amax, 127.0f);
    const int qi = (__float_as_int(amax) == 0) ? 0 : (int)roundf(div_rn(v, d));
    q[gw * 32 + lane] = (i8)qi;
    int qsum = qi;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) qsum += __shfl_xor_sync(0xffffffffu, qsum, off);
    if (lane == 0) ds[gw] = make_float2(d, mul_rn(d, (float)qsum));
}
