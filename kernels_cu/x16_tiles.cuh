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

// The producers' write pattern: a block owns token group grp (tokens 8 grp .. 8 grp + 7, those
// < T) and its threads write whole 16-byte chunks (8 logical k of one token; 8 consecutive
// threads = the 8 tokens of one core-matrix row, so a warp stores 512 contiguous bytes).
// h(n, e) gives the float value of token n, element e (absolute column); chunk (n, kl0) holds
// h at elements (kl0 & ~255) + P(kl0 % 256 + i), i = 0..7.
template <class H>
__device__ __forceinline__ void wg_write_group(u16* __restrict__ Xt, int grp, int T, int K, const H& h) {
    const int ngroups = (T + 7) / 8, nn = threadIdx.x & 7;
    const int n = grp * 8 + nn;
    if (n >= T) return;
    for (int c = threadIdx.x >> 3; c < K / 8; c += blockDim.x >> 3) {
        const int kl0 = c * 8, base = kl0 & ~255;
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            w[i] = wg_pack_f16x2(h(n, base + wg_perm((kl0 & 255) + 2 * i)), h(n, base + wg_perm((kl0 & 255) + 2 * i + 1)));
        *reinterpret_cast<uint4*>(Xt + wg_xt_index(n, kl0, ngroups)) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}
