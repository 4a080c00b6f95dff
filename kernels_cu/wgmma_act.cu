// wgmma_act.cu: float32 activations into the Hopper f16 GEMMs' tiled operand (x16_tiles.cuh),
// for producers without a fused x16 output (the attention output). rmsnorm.cu and swiglu.cu
// write it fused. engine.reference.wgmma.tile_x16 is the oracle (bit for bit).
#include "x16_tiles.cuh"

// x f32 [T, K] -> Xt f16 [K/64, ceil(T/8), 8, 8, 8] (x16_tiles.cuh): element (token n, logical
// k L of super-block b) = f16(x[n, 256 b + P(L)]); rows past T not written (zero from the
// caller, engine.gpu.ops.wgmma.tiled_buffer). Block b owns token group b.
__global__ void wgmma_tile_x16(const float* __restrict__ x, u16* __restrict__ Xt, int T, int K) {
    pdl_entry();
    wg_write_group(Xt, blockIdx.x, T, K, [&](int n, int e) { return x[(size_t)n * K + e]; });
}
