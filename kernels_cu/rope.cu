// rope.cu: QKV bias + RoPE + f16 conversion; K and V go straight into the KV cache.
//
// In:  qp, kp, vp float32: the q / k / v projections of token t at qp + t*ldq, kp + t*ldk,
//      vp + t*ldv (H*HD, KVH*HD, KVH*HD columns; with the fused QKV GEMM output
//      [n, (H + 2 KVH) HD] they are one array at column offsets 0, H*HD, (H+KVH)*HD and
//      every ld = (H + 2 KVH) HD);
//      bq, bk, bv float32 biases or null (qwen2); cosT, sinT float32 [P, HD/2] (P > every pos_t):
//      the angles of positions 0.., computed on the host exactly as engine.reference.rope_tables;
//      start = start0 + (startp ? *startp : 0) (startp: the position read on the device, so one
//      CUDA graph of the prefill serves every position, engine/gpu/prefill_graph.py).
//      Token t's position pos_t and cache row row_t:
//        posv == null (one sequence): pos_t = row_t = start + t;
//        posv != null (a batched step mixing sequences): pos_t = posv[t], row_t = rowv[t]
//          (int32 [n] each; start, startp unused; sequence s's position p at row kvbase_s + p).
// Out: qout f16 [H, n, HD]    = rope(q + bq) * qscale   (qscale = log2(e) / sqrt(HD): the
//                                attention kernel works in the exp2 domain); row t = token t
//      kc   f16 [KVH, maxT, HD] at row row_t = rope(k + bk)   (the layer's K cache)
//      vc   f16 [KVH, maxT, HD] at row row_t = v + bv          (the layer's V cache)
// RoPE of pair i (c = cos[pos_t, i], s = sin[pos_t, i]), engine.reference.apply_rope:
//   normal (llama): (x[2i], x[2i+1]);  neox (qwen2): (x[i], x[i + HD/2])
//   out0 = x0 c - x1 s,  out1 = x0 s + x1 c      (float32, products rounded separately)
// f16 conversion rounds to nearest even.
// Grid: (ceil(P / 256), n), P = (H + 2 KVH) * HD/2 pairs per token: q pairs, k pairs, v pairs.
#include "common.cuh"

// f32_to_f16_rn (cvt.rn.f16.f32): numerics.cuh.

extern "C" __global__ void __launch_bounds__(256)
qkv_rope(const float* __restrict__ qp, const float* __restrict__ kp, const float* __restrict__ vp,
         long long ldq, long long ldk, long long ldv, const float* __restrict__ bq, const float* __restrict__ bk,
         const float* __restrict__ bv, const float* __restrict__ cosT, const float* __restrict__ sinT,
         u16* __restrict__ qout, u16* __restrict__ kc, u16* __restrict__ vc,
         int n, int H, int KVH, int HD, const int* __restrict__ startp, int start0,
         const int* __restrict__ posv, const int* __restrict__ rowv, int maxT, int neox, float qscale) {
    pdl_entry();
    const int t = blockIdx.y;
    int pos, row;
    if (posv) {
        pos = posv[t];
        row = rowv[t];
    } else {
        pos = row = start0 + (startp ? *startp : 0) + t;
    }
    const int half = HD >> 1;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int nq = H * half, nk = KVH * half;
    if (i >= nq + 2 * nk) return;
    if (i >= nq + nk) {                                   // v: copy a pair of adjacent elements
        const int p = i - nq - nk;
        const int hh = p / half, e = 2 * (p - hh * half);
        const float* src = vp + (size_t)t * ldv + hh * HD + e;
        float v0 = src[0], v1 = src[1];
        if (bv) {
            v0 = __fadd_rn(v0, bv[hh * HD + e]);
            v1 = __fadd_rn(v1, bv[hh * HD + e + 1]);
        }
        u16* dst = vc + ((size_t)hh * maxT + row) * HD + e;
        dst[0] = f32_to_f16_rn(v0);
        dst[1] = f32_to_f16_rn(v1);
        return;
    }
    const bool isq = i < nq;
    const int p = isq ? i : i - nq;
    const int hh = p / half, pi = p - hh * half;
    const float* src = isq ? qp + (size_t)t * ldq + hh * HD : kp + (size_t)t * ldk + hh * HD;
    const float* bias = isq ? bq : bk;
    const int e0 = neox ? pi : 2 * pi;
    const int e1 = neox ? pi + half : 2 * pi + 1;
    float x0 = src[e0], x1 = src[e1];
    if (bias) {
        x0 = __fadd_rn(x0, bias[hh * HD + e0]);
        x1 = __fadd_rn(x1, bias[hh * HD + e1]);
    }
    const float c = cosT[(size_t)pos * half + pi], s = sinT[(size_t)pos * half + pi];
    float o0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    float o1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    if (isq) {
        u16* dst = qout + ((size_t)hh * n + t) * HD;
        dst[e0] = f32_to_f16_rn(__fmul_rn(o0, qscale));
        dst[e1] = f32_to_f16_rn(__fmul_rn(o1, qscale));
    } else {
        u16* dst = kc + ((size_t)hh * maxT + row) * HD;
        dst[e0] = f32_to_f16_rn(o0);
        dst[e1] = f32_to_f16_rn(o1);
    }
}
