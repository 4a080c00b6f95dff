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
// CuPy compiles with -ftz=true; abs/max/div/mul here are inline PTX without .ftz (numerics.cuh
// nf_*: the RnExact policy) and the
// zero test reads the bits, so subnormal inputs give numpy's result too.
#include "common.cuh"

// The block is written out here rather than as numerics.cuh q8_1_warp32<RnExact>: that
// template (same operations, same order) gives this kernel different machine code
// (dev/kernel_identity.py), and production SASS must not move.
extern "C" __global__ void __launch_bounds__(256)
quantize_q8_1(const float* __restrict__ x, i8* __restrict__ q, float2* __restrict__ ds,
              long long nblk) {
    pdl_entry();
    const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (gw >= nblk) return;                    // whole warps only (blockDim % 32 == 0)
    const float v = x[gw * 32 + lane];
    float amax = nf_abs(v);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = nf_max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float d = nf_div(amax, 127.0f);
    const int qi = (__float_as_int(amax) == 0) ? 0 : (int)roundf(nf_div(v, d));
    q[gw * 32 + lane] = (i8)qi;
    int qsum = qi;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) qsum += __shfl_xor_sync(0xffffffffu, qsum, off);
    if (lane == 0) ds[gw] = make_float2(d, nf_mul(d, (float)qsum));
}
