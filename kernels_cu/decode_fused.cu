// decode_fused.cu: the small decode-step kernels around the MMVQ GEMVs, fused so that a step
// is as few launches as possible. All read the step's token / position from device memory
// (`state`, int32: [0] token, [1] position = KV length before this token, [2] tokens emitted),
// so one captured CUDA graph serves every step. Float formulas follow engine/reference.py
// with the same float32 rounding steps (__fmul_rn etc. keep the compiler from fusing into FMA).
//
// decode_embed      x[k] = dequant(token_embd)[state[0], k]          (one row; q4_K, q6_K raw
//                   or padded, f16, f32): q4_K (d*sc)*q - (dmin*m), q6_K (d*sc)*q.
// rmsnorm_q8        h = (x * (1 / sqrt(mean(x^2) + eps))) * w, then q8_1 of h. ceil(K / 1024)
//                   blocks, each reducing all of x (any grid gives the same bits).
// quantize_row_q8   q8_1 of a float32 row, one warp per 32 values.
//   q8_1 as engine.quants.quantize_q8_1: decode_common.cuh q8_1_warp (s = d * sum(q)).
// qkv_post          qkv = [q | k | v] (float32, H*HD + 2*KVH*HD, straight from the MMVQ) plus
//                   bias (optional), RoPE at p = state[1] with the host's float32 cos/sin table
//                   [max_pos, HD/2] (normal: pairs (2i, 2i+1); neox: (i, i + HD/2)):
//                       out0 = x0 c - x1 s, out1 = x0 s + x1 c
//                   q -> qrot float32 [H, HD]; k, v -> the layer's K/V cache at token p
//                   (element (p, kvh, i) at p*tok_stride + kvh*head_stride + i; float32 or f16,
//                   f16 rounded to nearest even).
// swiglu_mul        out[n] = silu(g[n]) * u[n] (used only when ffn_gate / ffn_up differ in type).
// set_state         state = (token, position, count) (one launch instead of a host copy).
#include "common.cuh"
#include "decode_common.cuh"

// f32_to_f16_rn: numerics.cuh.

// ---------------------------------------------------------------- embedding row

// wtype: 0 f32, 1 f16, 12 q4_K, 14 q6_K; bstride: bytes per 256-block (144, 210 or 224).
extern "C" __global__ void __launch_bounds__(256)
decode_embed(const u8* __restrict__ W, long long row_bytes, int wtype, int bstride,
             const int* __restrict__ state, float* __restrict__ x, int K) {
    pdl_entry_trigger();
    const int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= K) return;
    const u8* row = W + (size_t)__ldg(state) * (size_t)row_bytes;
    float v;
    if (wtype == 0) {
        v = reinterpret_cast<const float*>(row)[k];
    } else if (wtype == 1) {
        v = f16_to_f32(reinterpret_cast<const u16*>(row)[k]);
    } else if (wtype == 12) {
        const u8* b = row + (size_t)(k >> 8) * bstride;
        const int e = k & 255, j = e >> 5, l = e & 31;
        const float d = f16_to_f32(*reinterpret_cast<const u16*>(b));
        const float dmin = f16_to_f32(*reinterpret_cast<const u16*>(b + 2));
        const u8* s = b + 4;
        int sc, m;
        if (j < 4) {
            sc = s[j] & 63;
            m = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
            m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
        const int q = (b[16 + 32 * (j >> 1) + l] >> (4 * (j & 1))) & 0xF;
        v = __fsub_rn(__fmul_rn(__fmul_rn(d, (float)sc), (float)q), __fmul_rn(dmin, (float)m));
    } else {  // 14: q6_K
        const u8* b = row + (size_t)(k >> 8) * bstride;
        const int e = k & 255;
        const int q = expand_q6_elem(b, b + 128, e);
        const float d = f16_to_f32((u16)b[208] | ((u16)b[209] << 8));
        const float sc = (float)(signed char)b[192 + (e >> 4)];
        v = __fmul_rn(__fmul_rn(d, sc), (float)q);
    }
    x[k] = v;
}

// ---------------------------------------------------------------- rmsnorm + q8_1

#define RMS_NT 1024
#define RMS_MAXJ 8                           // K <= RMS_NT * RMS_MAXJ (ops.norm.RMSNORM_MAX_K)

// Every block computes the same sum of squares in the order of one 1024-thread block (thread t
// adds x[t], x[t + 1024], ... in turn; warp, then block butterflies), then quantizes the 1024-value
// slices b, b + gridDim.x, ...: slice s's value t is the thread's own x[t + 1024 s], and warp w
// writes its q8_1 group 32 s + w. So any grid gives the one-block bits; the decode step launches
// ceil(K / 1024) blocks (one group per warp: the groups are written in parallel, not in turn).
extern "C" __global__ void __launch_bounds__(RMS_NT)
rmsnorm_q8(const float* __restrict__ x, const float* __restrict__ w, float eps, int K,
           i8* __restrict__ q, float2* __restrict__ ds, float* __restrict__ hout) {
    pdl_entry_trigger();
    __shared__ float red[RMS_NT / 32];
    __shared__ float rscale;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float xv[RMS_MAXJ];                      // all loads issued before the first add
#pragma unroll
    for (int j = 0; j < RMS_MAXJ; ++j) xv[j] = tid + j * RMS_NT < K ? x[tid + j * RMS_NT] : 0.0f;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < RMS_MAXJ; ++j)
        if (tid + j * RMS_NT < K) ss += xv[j] * xv[j];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        float t = red[lane];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
        if (lane == 0) {
            const float ms = __fdiv_rn(t, (float)K);
            rscale = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
        }
    }
    __syncthreads();
    const float r = rscale;
#pragma unroll
    for (int j = 0; j < RMS_MAXJ; ++j) {
        const int k = tid + j * RMS_NT;      // K is a multiple of 32: whole warps in or out
        if (j % gridDim.x != blockIdx.x || k >= K) continue;
        const float h = __fmul_rn(__fmul_rn(xv[j], r), w[k]);
        if (hout) hout[k] = h;
        q8_1_warp(h, q + k, ds + (k >> 5));
    }
}

extern "C" __global__ void __launch_bounds__(256)
quantize_row_q8(const float* __restrict__ x, i8* __restrict__ q, float2* __restrict__ ds, int nblk) {
    pdl_entry_trigger();
    const int blk = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (blk >= nblk) return;                   // whole warps only
    const int k = blk * 32 + (threadIdx.x & 31);
    q8_1_warp(x[k], q + k, ds + blk);
}

// ---------------------------------------------------------------- bias + RoPE + KV append

template <bool F16>
__device__ __forceinline__ void kv_store(void* base, size_t idx, float v) {
    if (F16) reinterpret_cast<u16*>(base)[idx] = f32_to_f16_rn(v);
    else reinterpret_cast<float*>(base)[idx] = v;
}

template <bool F16>
__device__ __forceinline__ void qkv_post_body(
    const float* __restrict__ qkv, const float* __restrict__ bias, const float* __restrict__ rcos,
    const float* __restrict__ rsin, const int* __restrict__ state, float* __restrict__ qrot,
    void* __restrict__ kc, void* __restrict__ vc, long long tok_stride, long long head_stride,
    int H, int KVH, int HD, int neox) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int half = HD >> 1;
    const int npairs = (H + KVH) * half;
    const int p = __ldg(state + 1);
    if (t < npairs) {
        const int hh = t / half, i = t % half;
        const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const int base = hh * HD;
        float x0 = qkv[base + a], x1 = qkv[base + b];
        if (bias) {
            x0 = __fadd_rn(x0, bias[base + a]);
            x1 = __fadd_rn(x1, bias[base + b]);
        }
        const float c = rcos[(size_t)p * half + i], s = rsin[(size_t)p * half + i];
        const float o0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        const float o1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
        if (hh < H) {
            qrot[base + a] = o0;
            qrot[base + b] = o1;
        } else {
            const size_t kb = (size_t)p * tok_stride + (size_t)(hh - H) * head_stride;
            kv_store<F16>(kc, kb + a, o0);
            kv_store<F16>(kc, kb + b, o1);
        }
    } else if (t < npairs + KVH * HD) {
        const int e = t - npairs;
        const int off = (H + KVH) * HD + e;
        float v = qkv[off];
        if (bias) v = __fadd_rn(v, bias[off]);
        const size_t vb = (size_t)p * tok_stride + (size_t)(e / HD) * head_stride + (e % HD);
        kv_store<F16>(vc, vb, v);
    }
}

#define QKV_POST_INSTANCE(F16, NAME)                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                          \
    qkv_post_##NAME(const float* __restrict__ qkv, const float* __restrict__ bias,             \
                    const float* __restrict__ rcos, const float* __restrict__ rsin,            \
                    const int* __restrict__ state, float* __restrict__ qrot,                   \
                    void* __restrict__ kc, void* __restrict__ vc, long long tok_stride,        \
                    long long head_stride, int H, int KVH, int HD, int neox) {                 \
        pdl_entry_trigger();                                                                   \
        qkv_post_body<F16>(qkv, bias, rcos, rsin, state, qrot, kc, vc, tok_stride,             \
                           head_stride, H, KVH, HD, neox);                                     \
    }

QKV_POST_INSTANCE(false, f32)
QKV_POST_INSTANCE(true, f16)

// ---------------------------------------------------------------- small helpers

extern "C" __global__ void __launch_bounds__(256)
swiglu_mul(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ out, int n) {
    pdl_entry_trigger();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float gv = g[i];
        out[i] = __fmul_rn(silu_ref(gv), u[i]);
    }
}

extern "C" __global__ void set_state(int* __restrict__ state, int token, int pos, int count) {
    pdl_entry_trigger();
    if (threadIdx.x == 0) {
        state[0] = token;
        state[1] = pos;
        state[2] = count;
    }
}
