// rmsnorm.cu: residual add + RMSNorm + q8_1 quantization of the normed row, fused (one read
// of the residual row, no float32 copy of the normed activations).
//
// In:  x float32 [R, K] residual rows (row r at x + r*K), y float32 [R, K] or null,
//      w float32 [K] norm weight. K % 256 == 0, K <= 8192.
// Out: if y: x[r] = x[r] + y[r] (written back: the residual stream after the sub-layer);
//      h = (x * (1 / sqrt(mean(x^2) + eps))) * w          (engine.reference.rms_norm, float32)
//      q8_1 of h: q int8 [R, K], ds float2 [R, K/32] = (d, s) with quantize_q8_1.cu's formula
//      (one warp per 32-block: amax butterfly, d = amax/127, q = roundf(h/d), s = butterfly sum);
//      hout float32 [R, K] = h when not null (tests).
// Grid: R blocks of 256 threads (8 warps); thread (warp w, lane l) holds elements
// 32*(w + 8*j) + l, j < K/256 (one q8_1 block per warp and j: coalesced 128-byte rows).
#include "common.cuh"

#define RN_THREADS 256
#define RN_MAXJ 32           // K <= 32 * 256

#ifndef GGP_EMU
__device__ __forceinline__ float rn_add(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float rn_div(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
#else   // CPU emulation (tests/cuda_emu)
inline float rn_add(float a, float b) { return a + b; }
inline float rn_div(float a, float b) { return a / b; }
#endif

// One q8_1 block held one value per lane: write q[lane] and (lane 0) ds.
__device__ __forceinline__ void rn_q8_block(float v, int lane, i8* __restrict__ q, float2* __restrict__ ds) {
    float amax = fabsf(v), s = v;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
        s = rn_add(s, __shfl_xor_sync(0xffffffffu, s, off));
    }
    const float d = rn_div(amax, 127.0f);
    const int qi = (__float_as_int(amax) == 0) ? 0 : (int)roundf(rn_div(v, d));
    q[lane] = (i8)qi;
    if (lane == 0) *ds = make_float2(d, s);
}

extern "C" __global__ void __launch_bounds__(RN_THREADS)
add_rmsnorm_q8_1(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
                 i8* __restrict__ q, float2* __restrict__ ds, float* __restrict__ hout,
                 int K, float eps) {
    __shared__ float red[RN_THREADS / 32];
    const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nj = K >> 8;
    float* xr = x + (size_t)r * K;
    const float* yr = y ? y + (size_t)r * K : nullptr;
    float v[RN_MAXJ];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < RN_MAXJ; ++j) {
        if (j < nj) {
            const int e = 32 * (warp + 8 * j) + lane;
            float a = xr[e];
            if (yr) {
                a = rn_add(a, yr[e]);
                xr[e] = a;
            }
            v[j] = a;
            ss = fmaf(a, a, ss);
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int i = 0; i < RN_THREADS / 32; ++i) tot += red[i];
    const float scale = rn_div(1.0f, sqrtf(rn_div(tot, (float)K) + eps));
    i8* qr = q + (size_t)r * K;
    float2* dsr = ds + (size_t)r * (K >> 5);
#pragma unroll
    for (int j = 0; j < RN_MAXJ; ++j) {
        if (j < nj) {
            const int blk = warp + 8 * j;
            const int e = 32 * blk + lane;
            const float h = __fmul_rn(__fmul_rn(v[j], scale), w[e]);
            if (hout) hout[(size_t)r * K + e] = h;
            rn_q8_block(h, lane, qr + 32 * blk, dsr + blk);
        }
    }
}
