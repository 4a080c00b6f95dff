// embed.cu: token embedding rows, dequantized on the GPU (prefill: n tokens at once).
//
// In:  W  uint8 [V, (K/256) * bstride]  token_embd rows of q4_K (bstride 144) or q6_K
//         (bstride 210 raw, 224 padded) blocks; ids int32 [n] (0 <= id < V, checked on the host).
// Out: x  float32 [n, K], x[t, :] = dequant(W[ids[t], :]).
// Formulas (engine.quants, bit-exact: the same float32 products, no FMA contraction):
//   q4_K  element e of super-block b, sub-block j = e/32, l = e%32:
//         q = (qs[32*(j/2) + l] >> 4*(j&1)) & 15;  x = (d*sc_j)*q - (dmin*m_j)
//         (sc_j, m_j: the 6-bit scale/min pair j of scales[12], get_scale_min_k4)
//   q6_K  x = (d*sc[e/16]) * (q6(e) - 32)          (q6 from ql/qh, expand_q6_elem)
// Grid: (K/256 super-blocks, n tokens); block 256 threads, one element per thread.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
embed_q4_k(const u8* __restrict__ W, const int* __restrict__ ids, float* __restrict__ x, int K) {
    pdl_entry();
    const int b = blockIdx.x, t = blockIdx.y, e = threadIdx.x;
    const size_t rb = (size_t)(K >> 8) * 144;
    const u8* blk = W + (size_t)ids[t] * rb + (size_t)b * 144;
    const float d = f16_to_f32((u16)(blk[0] | (blk[1] << 8)));
    const float dmin = f16_to_f32((u16)(blk[2] | (blk[3] << 8)));
    const u8* sc = blk + 4;
    const int j = e >> 5, l = e & 31;
    int s, m;
    if (j < 4) {
        s = sc[j] & 63;
        m = sc[j + 4] & 63;
    } else {
        s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
    const int q = (blk[16 + 32 * (j >> 1) + l] >> (4 * (j & 1))) & 15;
    const float ds = __fmul_rn(d, (float)s), dm = __fmul_rn(dmin, (float)m);
    x[(size_t)t * K + (size_t)b * 256 + e] = __fsub_rn(__fmul_rn(ds, (float)q), dm);
}

extern "C" __global__ void __launch_bounds__(256)
embed_q6_k(const u8* __restrict__ W, const int* __restrict__ ids, float* __restrict__ x, int K,
           int bstride) {
    pdl_entry();
    const int b = blockIdx.x, t = blockIdx.y, e = threadIdx.x;
    const size_t rb = (size_t)(K >> 8) * bstride;
    const u8* blk = W + (size_t)ids[t] * rb + (size_t)b * bstride;
    const float d = f16_to_f32((u16)(blk[208] | (blk[209] << 8)));
    const int sc = (int)(signed char)blk[192 + (e >> 4)];
    const int q = expand_q6_elem(blk, blk + 128, e);
    x[(size_t)t * K + (size_t)b * 256 + e] = __fmul_rn(__fmul_rn(d, (float)sc), (float)q);
}
