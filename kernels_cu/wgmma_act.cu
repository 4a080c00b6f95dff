// wgmma_act.cu: activations for the Hopper f16 GEMMs (wgmma_common.cuh): f16, tiled
// [K/64, ceil(T/8), 8 k-chunks, 8 tokens, 8 k] in the permuted k order P (wg_perm), tokens past
// T zero. engine.reference.wgmma.tile_x16 is the oracle (bit for bit).
#include "wgmma_common.cuh"

// x f32 [T, K] -> Xt f16 [K/64, ceil(T/8), 8, 8, 8] (wgmma_common.cuh): element (token n, logical
// k L of super-block b) = f16(x[n, 256 b + P(L)]), zero for n >= T. One thread per element of Xt.
__global__ void wgmma_tile_x16(const float* __restrict__ x, u16* __restrict__ Xt, int T, int K) {
    pdl_entry();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int ngroups = (T + 7) / 8;
    if (i >= (size_t)ngroups * 8 * K) return;
    const int kk = (int)(i & 7), nn = (int)((i >> 3) & 7), kc = (int)((i >> 6) & 7);
    const size_t piece = i >> 9;                               // 64-k block * ngroups + token group
    const int n = (int)(piece % ngroups) * 8 + nn, kabs = (int)(piece / ngroups) * WG_BK + kc * 8 + kk;
    u16 h = 0;
    if (n < T) asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x[(size_t)n * K + (kabs & ~255) + wg_perm(kabs & 255)]));
    Xt[i] = h;
}
