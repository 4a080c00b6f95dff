// swiglu.cu: SwiGLU fused with the q8_1 quantization of its output (the ffn_down A operand).
//
// In:  g, u float32, row t at g + t*ld, u + t*ld (F columns each; with the fused gate|up GEMM
//      output [T, 2F] that is g = gu, u = gu + F, ld = 2F). F % 32 == 0.
// Out: h = silu(g) * u = (g / (1 + exp(-g))) * u        (engine.reference.silu, float32)
//      as q8_1: q int8 [T, F], ds float2 [T, F/32] = (d, s): d = amax/127, q = roundf(h/d),
//      s = d * sum(q) (the dequantized sum; see rmsnorm.cu for why not sum(h)).
// One thread per 4 consecutive elements (n4 = T*F/4 float4s, 16-byte loads: ld and the g/u
// offsets are multiples of 4 floats); a q8_1 block is 8 consecutive lanes (shuffles xor 1, 2,
// 4; lanes past n4 take part with zeros and store nothing). Block 256 threads.
// swiglu_x16: the same h as f16 into the Hopper GEMMs' tiled operand (x16_tiles.cuh).
#include "common.cuh"
#include "x16_tiles.cuh"

// silu in the RnDivExact policy (numerics.cuh: non-ftz add / div), then the ftz product.
__device__ __forceinline__ float sw_silu_mul(float g, float u) {
    return __fmul_rn(silu<RnDivExact>(g), u);
}

// The q8_1 block below is rmsnorm.cu's (numerics.cuh q8_1_quad<RnDivExact>) written out:
// through the shared helper this kernel's machine code changes (dev/kernel_identity.py).
extern "C" __global__ void __launch_bounds__(256)
swiglu_q8_1(const float* __restrict__ g, const float* __restrict__ u, long long ld, int F,
            i8* __restrict__ q, float2* __restrict__ ds, long long n4) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // float4 index
    const int lane = threadIdx.x & 31;
    const bool ok = i < n4;                       // n4 = T*F/4; all lanes reach the shuffles
    const int f4 = F >> 2;
    const long long t = ok ? i / f4 : 0;
    const int c = ok ? (int)(i - t * f4) : 0;
    float4 gv = {0.0f, 0.0f, 0.0f, 0.0f}, uv = {0.0f, 0.0f, 0.0f, 0.0f};
    if (ok) {
        gv = *reinterpret_cast<const float4*>(g + t * ld + 4 * c);
        uv = *reinterpret_cast<const float4*>(u + t * ld + 4 * c);
    }
    float h[4] = {sw_silu_mul(gv.x, uv.x), sw_silu_mul(gv.y, uv.y), sw_silu_mul(gv.z, uv.z),
                  sw_silu_mul(gv.w, uv.w)};
    float amax = fmaxf(fmaxf(fabsf(h[0]), fabsf(h[1])), fmaxf(fabsf(h[2]), fabsf(h[3])));
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float d = nf_div(amax, 127.0f);
    const bool zero = __float_as_int(amax) == 0;
    int qv[4], qs = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        qv[k] = zero ? 0 : (int)roundf(nf_div(h[k], d));
        qs += qv[k];
    }
#pragma unroll
    for (int off = 4; off > 0; off >>= 1) qs += __shfl_xor_sync(0xffffffffu, qs, off);
    if (ok) {
        reinterpret_cast<u32*>(q)[i] = (u32)(qv[0] & 0xFF) | ((u32)(qv[1] & 0xFF) << 8) |
                                       ((u32)(qv[2] & 0xFF) << 16) | ((u32)(qv[3] & 0xFF) << 24);
        if ((lane & 7) == 0) ds[i >> 3] = make_float2(d, __fmul_rn(d, (float)qs));
    }
}

// h as in swiglu_q8_1 (bit for bit) as f16 into Xt (x16_tiles.cuh) of T rows, zeroed past T by
// the caller. One thread per 4 consecutive elements (n4 = T*F/4).
extern "C" __global__ void __launch_bounds__(256)
swiglu_x16(const float* __restrict__ g, const float* __restrict__ u, long long ld, int F, int T,
           u16* __restrict__ Xt) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // float4 index
    const int f4 = F >> 2;
    if (i >= (long long)T * f4) return;
    const int t = (int)(i / f4), c = (int)(i - (long long)t * f4);
    const float4 gv = *reinterpret_cast<const float4*>(g + t * ld + 4 * c);
    const float4 uv = *reinterpret_cast<const float4*>(u + t * ld + 4 * c);
    wg_store_quad(Xt, t, 4 * c, (T + 7) / 8, sw_silu_mul(gv.x, uv.x), sw_silu_mul(gv.y, uv.y),
                  sw_silu_mul(gv.z, uv.z), sw_silu_mul(gv.w, uv.w));
}
