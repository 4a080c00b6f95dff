// rmsnorm.cu: residual add + RMSNorm + q8_1 quantization of the normed row, fused (one read
// of the residual row, no float32 copy of the normed activations).
//
// In:  x float32 [R, K] residual rows (row r at x + r*K), y float32 [R, K] or null,
//      w float32 [K] norm weight. K % 256 == 0, K <= 8192 (16-byte aligned rows).
// Out: if y: x[r] = x[r] + y[r] (written back: the residual stream after the sub-layer);
//      h = (x * (1 / sqrt(mean(x^2) + eps))) * w          (engine.reference.rms_norm, float32)
//      q8_1 of h: q int8 [R, K], ds float2 [R, K/32] = (d, s) per 32-block:
//      d = amax/127, q = roundf(h/d) (quantize_q8_1.cu's d and q), s = d * sum(q) -- the sum of
//      the DEQUANTIZED values, not quantize_q8_1.cu's sum of h: the q4_K GEMM subtracts
//      dmin*m*s, so with s = d*sum(q) it computes exactly dequant(q8) . dequant(W), while
//      s = sum(h) leaves the error -sum(e * d*sc*q4) (q4 >= 0) instead of -sum(e * W):
//      about 2x the logit error on q4_K_M models (measured; docs/perf-log.md);
//      hout float32 [R, K] = h when not null (tests).
//      add_rmsnorm_x16: the same h as f16 into the Hopper GEMMs' tiled operand (x16_tiles.cuh),
//      staged in shared memory and stored in 16-byte pieces.
// Grid: R blocks of 256 threads (8 warps); thread t holds the float4s i = t + 256 j (elements
// 4i..4i+3), j < K/1024 (rounded up; K/4 % 64 == 0, so whole warps are in or out): 16-byte
// coalesced loads and stores; a q8_1 block is 8 consecutive lanes (shuffles xor 1, 2, 4).
#include "common.cuh"
#include "x16_tiles.cuh"

#define RN_THREADS 256
#define RN_MAXJ 8            // K <= 8 * 1024

// The row's norm weights w[4i..4i+3], i = tid + 256 j, into registers, before the PDL wait (a
// weight: no predecessor writes it), so their latency overlaps the residual's loads and the
// reduction instead of following them (pp32 +1.5%, docs/perf-log.md Session 23).
__device__ __forceinline__ void rn_load_w(float4 (&wv)[RN_MAXJ], const float* __restrict__ w, int K) {
#pragma unroll
    for (int j = 0; j < RN_MAXJ; ++j) {
        const int i = threadIdx.x + RN_THREADS * j;
        if (i < (K >> 2)) wv[j] = reinterpret_cast<const float4*>(w)[i];
    }
}

// Row r: x += y (when y), v[j] = the row's float4s i = tid + 256 j; returns the row's
// 1 / sqrt(mean(x^2) + eps). Every thread of the block calls it (one barrier).
__device__ __forceinline__ float rn_add_scale(float4 (&v)[RN_MAXJ], float* __restrict__ x, const float* __restrict__ y,
                                              int r, int K, float eps, float* red) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int K4 = K >> 2;
    float4* xr = reinterpret_cast<float4*>(x + (size_t)r * K);
    const float4* yr = y ? reinterpret_cast<const float4*>(y + (size_t)r * K) : nullptr;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < RN_MAXJ; ++j) {
        const int i = tid + RN_THREADS * j;
        if (i < K4) {
            float4 a = xr[i];
            if (yr) {
                const float4 b = yr[i];
                a.x = nf_add(a.x, b.x);
                a.y = nf_add(a.y, b.y);
                a.z = nf_add(a.z, b.z);
                a.w = nf_add(a.w, b.w);
                xr[i] = a;
            }
            v[j] = a;
            ss = fmaf(a.x, a.x, ss);
            ss = fmaf(a.y, a.y, ss);
            ss = fmaf(a.z, a.z, ss);
            ss = fmaf(a.w, a.w, ss);
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int i = 0; i < RN_THREADS / 32; ++i) tot += red[i];
    return nf_div(1.0f, sqrtf(nf_div(tot, (float)K) + eps));
}

// h = (v * scale) * w, the float32 the q8_1 and the f16 outputs are made from.
__device__ __forceinline__ float4 rn_h(const float4& v, float scale, const float4& wv) {
    float4 h;
    h.x = __fmul_rn(__fmul_rn(v.x, scale), wv.x);
    h.y = __fmul_rn(__fmul_rn(v.y, scale), wv.y);
    h.z = __fmul_rn(__fmul_rn(v.z, scale), wv.z);
    h.w = __fmul_rn(__fmul_rn(v.w, scale), wv.w);
    return h;
}

extern "C" __global__ void __launch_bounds__(RN_THREADS)
add_rmsnorm_q8_1(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
                 i8* __restrict__ q, float2* __restrict__ ds, float* __restrict__ hout,
                 int K, float eps) {
    float4 wv[RN_MAXJ];
    rn_load_w(wv, w, K);                               // a weight: no wait for it
    pdl_entry();
    __shared__ float red[RN_THREADS / 32];
    const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
    const int K4 = K >> 2;
    float4 v[RN_MAXJ];
    const float scale = rn_add_scale(v, x, y, r, K, eps, red);
    u32* qr = reinterpret_cast<u32*>(q + (size_t)r * K);
    float2* dsr = ds + (size_t)r * (K >> 5);
#pragma unroll
    for (int j = 0; j < RN_MAXJ; ++j) {
        const int i = tid + RN_THREADS * j;
        if (i < K4) {                                  // warp-uniform
            const float4 h = rn_h(v[j], scale, wv[j]);
            if (hout) reinterpret_cast<float4*>(hout + (size_t)r * K)[i] = h;
            float d;
            int qv[4], qs;
            q8_1_quad<RnDivExact>(h.x, h.y, h.z, h.w, qv, d, qs);
            qr[i] = pack_i8x4(qv);
            if ((lane & 7) == 0) dsr[i >> 3] = make_float2(d, RnDivExact::mul(d, (float)qs));
        }
    }
}

// Row staging for add_rmsnorm_x16: st[kl] = the row's f16 at logical k kl, so piece
// kl / 8 = 8 run + chunk (run kl / 64, chunk kl / 8 % 8) is st[8 piece .. 8 piece + 7]: the
// token's Xt pieces back to back (in Xt piece q of token n is at wg_xt_index(n, 8 q, ngroups),
// 128 bytes from the next chunk's). Same P(L) as wg_store_quad: elements k..k+3 (k % 4 == 0) go to
// L = wg_quad_logical(k), L + 1 (h0, h2) and L + 8, L + 9 (h1, h3: chunk + 1, here + 8 elements
// where Xt has + 64); both stay in one run. A warp's stores land in the even pieces 4m + 2hi of four
// 128-byte lines, words t, t + 1 of each: 8 banks, 4-way conflicts (a few cycles a row).
__device__ __forceinline__ void rn_stage_quad(u16* __restrict__ st, int k, const float4& h) {
    u32* dst = reinterpret_cast<u32*>(st + wg_quad_logical(k));
    dst[0] = wg_pack_f16x2(h.x, h.z);
    dst[4] = wg_pack_f16x2(h.y, h.w);                  // + 8 elements: chunk + 1
}

// The same h as add_rmsnorm_q8_1 (bit for bit), written as f16 into the Hopper GEMMs' tiled
// operand Xt (x16_tiles.cuh) of T rows (the grid's R = T rows; Xt zeroed past T by the caller).
// Store path: h goes to shared memory in the tiles' order (rn_stage_quad: the row's K/8 16-byte
// pieces back to back, up to 16 KB), then after a barrier each thread stores whole pieces
// p = tid + 256 j (uint4) to Xt + wg_xt_index(r, 8 p, ngroups): one 16-byte store a piece where
// the float4-per-thread form wrote its 4-byte words from four threads (swiglu_x16 likewise).
extern "C" __global__ void __launch_bounds__(RN_THREADS)
add_rmsnorm_x16(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
                u16* __restrict__ Xt, int K, float eps) {
    float4 wv[RN_MAXJ];
    rn_load_w(wv, w, K);                               // a weight: no wait for it
    pdl_entry();
    __shared__ float red[RN_THREADS / 32];
    __shared__ __align__(16) u16 st[RN_MAXJ * 4 * RN_THREADS];   // K <= 8192 f16: 16 KB
    const int r = blockIdx.x, tid = threadIdx.x, ngroups = (gridDim.x + 7) / 8;
    float4 v[RN_MAXJ];
    const float scale = rn_add_scale(v, x, y, r, K, eps, red);
#pragma unroll
    for (int j = 0; j < RN_MAXJ; ++j) {
        const int i = tid + RN_THREADS * j;
        if (i < (K >> 2)) rn_stage_quad(st, 4 * i, rn_h(v[j], scale, wv[j]));
    }
    __syncthreads();
    const uint4* sp = reinterpret_cast<const uint4*>(st);
#pragma unroll
    for (int j = 0; j < RN_MAXJ / 2; ++j) {
        const int p = tid + RN_THREADS * j;            // K/8 % 32 == 0: warp-uniform
        if (p < (K >> 3)) *reinterpret_cast<uint4*>(Xt + wg_xt_index(r, 8 * p, ngroups)) = sp[p];
    }
}
