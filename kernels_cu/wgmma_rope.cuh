// wgmma_rope.cuh: the q|k|v GEMM's fused epilogue (wgmma_common.cuh wgmma_gemm<.., ROPE>, for
// ubatches of <= 32 tokens: engine.gpu.ops.wgmma.qkv_rope_wanted; issues 12 and 14), apart from
// the GEMM so the CPU emulator compiles it alone (tests/test_wgmma_reference.py).
//
// W's rows are [Wq; Wk; Wv] from global row row_base on (the pair launch's q6_K part: row_base =
// Na), and the outputs are rope.cu's, bit for bit: qout f16 [H, T, HD] = rope(q + bq) * qscale,
// kc / vc f16 [KVH, maxT, HD] at cache row row_t = rope(k + bk) / v + bv; token t at position
// pos_t, row row_t = start0 + *startp + t, or posv[t] / rowv[t] (rope.cu's header). A thread's
// rows g and g + 8 are the two elements of RoPE pair p = 8 warp + g of the tile's 64: local rows
//   lr0 = (p / half) HD + (neox ? p % half : 2 (p % half)),  lr1 = lr0 + (neox ? half : 1)
// (half = HD / 2, 128 % HD == 0); v rows take the same pairing and are stored plain.
#pragma once
#include "common.cuh"

struct WgRope {
    const float *bq, *bk, *bv, *cosT, *sinT;       // biases or null; the RoPE tables [P, HD / 2]
    u16 *qout, *kc, *vc;
    const int *startp, *posv, *rowv;               // startp may be null; posv / rowv both or neither
    int start0, maxT, qdim, kvdim, hd, neox;
    float qscale;                                  // float32 of log2(e) / sqrt(HD), as the host gives rope.cu
    int row_base;
};

// The q|k|v kernels' parameters after the GEMM's (from startp on in rope.cu's order, as
// engine.gpu.ops.rope.rope_params gives them), and the WgRope they make (row_base 0).
#define WG_ROPE_PARAMS const float* __restrict__ bq, const float* __restrict__ bk, const float* __restrict__ bv, \
    const float* __restrict__ cosT, const float* __restrict__ sinT, u16* __restrict__ qout, u16* __restrict__ kc, \
    u16* __restrict__ vc, int qdim, int kvdim, int hd, const int* __restrict__ startp, int start0, \
    const int* __restrict__ posv, const int* __restrict__ rowv, int maxT, int neox, float qscale
#define WG_ROPE_ARGS {bq, bk, bv, cosT, sinT, qout, kc, vc, startp, posv, rowv, start0, maxT, qdim, kvdim, hd, neox, \
    qscale, 0}

// Thread (warp, g)'s RoPE pair p = 8 warp + g of a row tile: its local rows lr0 and lr0 + step.
__device__ __forceinline__ void wg_rope_rows(const WgRope& r, int warp, int g, int& lr0, int& step) {
    const int p = warp * 8 + g, half = r.hd >> 1;
    lr0 = (p / half) * r.hd + (r.neox ? p % half : 2 * (p % half));
    step = r.neox ? half : 1;
}

// Pair (x0, x1) of token tok at local rows lrow, lrow + step (of global row row_base + lrow on):
// rope.cu's arithmetic and stores.
__device__ __forceinline__ void wg_rope_store(const WgRope& r, int lrow, int step, int tok, int T, float x0,
                                              float x1) {
    const int gr = r.row_base + lrow;
    int pos, crow;
    if (r.posv) {
        pos = r.posv[tok];
        crow = r.rowv[tok];
    } else {
        pos = crow = r.start0 + (r.startp ? *r.startp : 0) + tok;
    }
    const int vbase = r.qdim + r.kvdim;
    if (gr >= vbase) {                                        // v: bias, f16, the V cache
        const int c = gr - vbase, hh = c / r.hd, e0 = c - hh * r.hd;
        if (r.bv) {
            x0 = __fadd_rn(x0, r.bv[c]);
            x1 = __fadd_rn(x1, r.bv[c + step]);
        }
        u16* dst = r.vc + ((size_t)hh * r.maxT + crow) * r.hd + e0;
        dst[0] = f32_to_f16_rn(x0);
        dst[step] = f32_to_f16_rn(x1);
        return;
    }
    const bool isq = gr < r.qdim;
    const int c = isq ? gr : gr - r.qdim, hh = c / r.hd, e0 = c - hh * r.hd;
    const float* bias = isq ? r.bq : r.bk;
    if (bias) {
        x0 = __fadd_rn(x0, bias[c]);
        x1 = __fadd_rn(x1, bias[c + step]);
    }
    const int half = r.hd >> 1, pi = r.neox ? e0 : e0 >> 1;
    const float cs = r.cosT[(size_t)pos * half + pi], sn = r.sinT[(size_t)pos * half + pi];
    const float o0 = __fsub_rn(__fmul_rn(x0, cs), __fmul_rn(x1, sn));
    const float o1 = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, cs));
    if (isq) {
        u16* dst = r.qout + ((size_t)hh * T + tok) * r.hd + e0;
        dst[0] = f32_to_f16_rn(__fmul_rn(o0, r.qscale));
        dst[step] = f32_to_f16_rn(__fmul_rn(o1, r.qscale));
    } else {
        u16* dst = r.kc + ((size_t)hh * r.maxT + crow) * r.hd + e0;
        dst[0] = f32_to_f16_rn(o0);
        dst[step] = f32_to_f16_rn(o1);
    }
}
