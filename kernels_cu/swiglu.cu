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
// swiglu_x16: the same h as f16 into the Hopper GEMMs' tiled operand (x16_tiles.cuh). Block
// (super-block column S, token group G) = 8 tokens x 256 columns: the f32 loads are whole
// 1 KB row pieces (two float4s a thread); h goes through shared memory in the tiles' order (the
// block's 4 KB = four 1 KB runs of Xt, one per 64-k block), then each thread stores one 16-byte
// piece (one token's 8 k of a chunk), so a warp writes 512 contiguous bytes where the
// one-thread-per-float4 form wrote 4-byte words 64 bytes apart.
#include "common.cuh"
#include "x16_tiles.cuh"

// h = silu(g) * u: x16_tiles.cuh wg_swiglu_h (the gate|up GEMM's fused epilogue computes the same).

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
    float h[4] = {wg_swiglu_h(gv.x, uv.x), wg_swiglu_h(gv.y, uv.y), wg_swiglu_h(gv.z, uv.z),
                  wg_swiglu_h(gv.w, uv.w)};
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
// the caller (pieces of tokens past T are not stored). Grid (F / 256, ceil(T / 8)), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
swiglu_x16(const float* __restrict__ g, const float* __restrict__ u, long long ld, int F, int T,
           u16* __restrict__ Xt) {
    pdl_entry();
    __shared__ __align__(16) u16 tile[4 * 512];       // the block's 4 runs of 8 chunks x 8 tokens x 8 k
    const int k0 = 256 * blockIdx.x, n0 = 8 * blockIdx.y, tid = threadIdx.x;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int q = tid + 256 * j, r = q >> 6, k = 4 * (q & 63);   // token n0 + r, columns k0 + k..
        if (n0 + r >= T) continue;
        const size_t off = (size_t)(n0 + r) * ld + k0 + k;
        const float4 gv = *reinterpret_cast<const float4*>(g + off);
        const float4 uv = *reinterpret_cast<const float4*>(u + off);
        wg_store_quad(tile, r, k, 1, wg_swiglu_h(gv.x, uv.x), wg_swiglu_h(gv.y, uv.y),
                      wg_swiglu_h(gv.z, uv.z), wg_swiglu_h(gv.w, uv.w));
    }
    __syncthreads();
    const int blk = tid >> 6, piece = tid & 63;       // run blk (64-k block 4 S + blk), piece c * 8 + r
    if (n0 + (piece & 7) >= T) return;
    const size_t run = ((size_t)(4 * blockIdx.x + blk) * gridDim.y + blockIdx.y) * 512;
    reinterpret_cast<uint4*>(Xt + run)[piece] = reinterpret_cast<const uint4*>(tile + blk * 512)[piece];
}
