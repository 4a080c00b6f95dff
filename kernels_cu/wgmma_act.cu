// wgmma_act.cu: float32 activations into the Hopper f16 GEMMs' tiled operand (x16_tiles.cuh),
// for producers without a fused x16 output (the attention output). rmsnorm.cu and swiglu.cu
// write it fused. engine.reference.wgmma.tile_x16 is the oracle (bit for bit).
#include "x16_tiles.cuh"

// x f32 [T, K] -> Xt f16 [K/64, ceil(T/8), 8, 8, 8] (x16_tiles.cuh): element (token n, logical
// k L of super-block b) = f16(x[n, 256 b + P(L)]), zero for n >= T. One thread per element of Xt.
__global__ void wgmma_tile_x16(const float* __restrict__ x, u16* __restrict__ Xt, int T, int K) {
    pdl_entry();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int ngroups = (T + 7) / 8;
    if (i >= (size_t)ngroups * 8 * K) return;
    const int kk = (int)(i & 7), nn = (int)((i >> 3) & 7), kc = (int)((i >> 6) & 7);
    const size_t piece = i >> 9;                               // 64-k block * ngroups + token group
    const int n = (int)(piece % ngroups) * 8 + nn, kabs = (int)(piece / ngroups) * 64 + kc * 8 + kk;
    Xt[i] = n < T ? f32_to_f16_rn(x[(size_t)n * K + (kabs & ~255) + wg_perm(kabs & 255)]) : (u16)0;
}
