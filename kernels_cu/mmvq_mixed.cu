// mmvq_mixed.cu: the decode step's q / k / v GEMVs in one launch when their matrices differ in
// kind (q4_K_M files: Wq, Wk q4_K beside Wv q6_K in about half the layers), store mode:
// y_s[n] = sum_k W_s[n, k] x[k] for one q8_1 row x.
//
// Segments as in mmvq_q4_k.cu (blocks [0, nb1) segment 0, [nb1, nb2) segment 1, [nb2, grid)
// segment 2); blocks below b6 run the q4_K body (mmvq_q4_k.cu), the others the q6_K body
// (mmvq_q6_k.cu, PADDED: 224-byte blocks, else raw 210), so the q4_K segments come first and
// b6 is nb1 or nb2. A row's arithmetic is that of mmvq_q4_k_store / mmvq_q6_k_*_store: the
// same bits as the two launches. Kernel names: mmvq_mixed_{pad|raw}_store.
#define MMVQ_BODIES_ONLY
#include "mmvq_q4_k.cu"
#include "mmvq_q6_k.cu"

#define MMVQ_MIXED_INSTANCE(LAYOUT, PADDED)                                                       \
    extern "C" __global__ void __launch_bounds__(MMVQ_NW * 32)                                    \
    mmvq_mixed_##LAYOUT##_store(                                                                  \
        const u8* __restrict__ w0, const u8* __restrict__ w1, const u8* __restrict__ w2,          \
        float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2, int n0, int n1,   \
        int n2, int nb1, int nb2, const i8* __restrict__ xq, const float2* __restrict__ xds,      \
        int K, int b6) {                                                                          \
        if ((int)blockIdx.x < b6)                                                                 \
            mmvq_q4_k_body<1, 0>(w0, w1, w2, y0, y1, y2, n0, n1, n2, nb1, nb2, xq, xds, K);       \
        else                                                                                      \
            mmvq_q6_k_body<1, 0, PADDED>(w0, w1, w2, y0, y1, y2, n0, n1, n2, nb1, nb2, xq, xds, K); \
    }

MMVQ_MIXED_INSTANCE(pad, true)
MMVQ_MIXED_INSTANCE(raw, false)
