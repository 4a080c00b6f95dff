// x16_tiles.cuh: where an activation goes in the Hopper f16 GEMMs' operand (wgmma_common.cuh).
// Xt f16 [K/64, ceil(T/8), 8 k-chunks, 8 tokens, 8 k]: logical k L of super-block b (L = 0..255)
// holds element 256 b + P(L), P = 64 t + 32 hi + 4 m + f + 2 e for s = 2m + hi = L / 16,
// c = 2t + 8f + e = L % 16 (the A-fragment order of wgmma_common.cuh). Tokens past T stay zero
// (the producers write tokens < T into a zeroed buffer). engine.reference.wgmma.tile_x16 is the
// oracle.
#pragma once
#include "common.cuh"

// P(L): the element of a super-block that logical k L holds.
__device__ __forceinline__ int wg_perm(int L) {
    const int s = L >> 4, c = L & 15;
    const int hi = s & 1, m = s >> 1, e = c & 1, f = (c >> 3) & 1, tt = (c >> 1) & 3;
    return 64 * tt + 32 * hi + 4 * m + f + 2 * e;
}

// Element index in Xt of (token n, logical k kl) with ngroups token groups.
__device__ __forceinline__ size_t wg_xt_index(int n, int kl, int ngroups) {
    return ((size_t)(kl >> 6) * ngroups + (n >> 3)) * 512 + ((kl >> 3) & 7) * 64 + (n & 7) * 8 + (kl & 7);
}

__device__ __forceinline__ u32 wg_pack_f16x2(float lo, float hi) {
    return (u32)f32_to_f16_rn(lo) | ((u32)f32_to_f16_rn(hi) << 16);    // numerics.cuh: cvt.rn.f16.f32
}

// Elements k..k+3 (k % 4 == 0) of token n: within the super-block p = k % 256 has t = p / 64,
// hi = p / 32 % 2, m = p / 4 % 8 and b = 0..3 gives (f, e) = (b & 1, b >> 1), so h0, h2 sit at
// logical L = 16 (2m + hi) + 2t, L + 1 and h1, h3 at L + 8, L + 9 (the next 8-k chunk): two
// 4-byte stores. wg_quad_logical(k): that L plus the super-block's first k.
__device__ __forceinline__ int wg_quad_logical(int k) {
    const int p = k & 255, t = p >> 6, hi = (p >> 5) & 1, m = (p >> 2) & 7;
    return (k & ~255) + 16 * (2 * m + hi) + 2 * t;
}
__device__ __forceinline__ void wg_store_quad(u16* __restrict__ Xt, int n, int k, int ngroups,
                                              float h0, float h1, float h2, float h3) {
    u32* dst = reinterpret_cast<u32*>(Xt + wg_xt_index(n, wg_quad_logical(k), ngroups));
    dst[0] = wg_pack_f16x2(h0, h2);
    dst[32] = wg_pack_f16x2(h1, h3);                   // + 64 elements: chunk kc + 1
}

// SwiGLU's h = silu(g) * u: silu in the RnDivExact policy (numerics.cuh: non-ftz add / div), then
// the ftz product. swiglu.cu and the gate|up GEMM's fused epilogue (wgmma_common.cuh) share it.
__device__ __forceinline__ float wg_swiglu_h(float g, float u) {
    return __fmul_rn(silu<RnDivExact>(g), u);
}

// h of feature k (any k) and token n, held one per lane of a warp whose lanes l and l + 8 hold
// features k and k + 2 of the same token (the wgmma accumulator rows g, g + 2): features k, k + 2
// of a quad sit side by side in Xt (logical L and L + 1, wg_quad_logical), so lane l packs both
// into one 4-byte store. Every lane of the warp must call it (a shuffle); `store`: token n < T.
__device__ __forceinline__ void wg_store_pair(u16* __restrict__ Xt, int n, int k, int ngroups, float h,
                                              bool store) {
    const float h2 = __shfl_down_sync(0xffffffffu, h, 8);
    if (store && (k & 2) == 0) {
        u32* dst = reinterpret_cast<u32*>(Xt + wg_xt_index(n, wg_quad_logical(k & ~3) + 8 * (k & 1), ngroups));
        *dst = wg_pack_f16x2(h, h2);
    }
}
