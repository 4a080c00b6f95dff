// attention_decode.cu: attention of one query token over the KV cache, split over keys
// (flash-decoding): attn_split_* computes per (split, KV head) a partial softmax, and
// attn_combine_* merges the splits of each head and writes the output as q8_1 (the A operand
// of the attn_output MMVQ) and, optionally, as float32.
//
// Inputs:
//   q      float32 [H, HD] (rope applied), head h uses KV head h / G (G = H / KVH, GQA)
//   kc, vc the layer's K and V cache, float32 or f16 (KV), element (t, kvh, i) at
//          t * tok_stride + kvh * head_stride + i (elements; [T, KVH, HD] or [KVH, T, HD])
//   pos    device int: the query's position; keys 0..pos are attended (L = pos + 1), so one
//          captured launch serves every decode step.
// Split s of S (gridDim.x) covers keys [s C, min(L, (s+1) C)), C = ceil(L / S); empty splits
// write m = -inf. Per split and head (scores in float32, scale = 1/sqrt(HD) as in the reference):
//   m = max_j q.k_j * scale,  l = sum_j exp(q.k_j * scale - m),  o = sum_j exp(...) v_j
// computed tile by tile (TK = 64 keys) with the online-softmax rescale. Combine:
//   M = max_s m_s, out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s.
// Partial buffers: part_o float32 [H, S, HD], part_ml float2 [H, S] = (m, l).
//
// attn_split: block = 128 threads; a key row is HD / VEC lanes (VEC = elements per 16-byte
// load: 8 for f16, 4 for f32), so a pass covers 128 / (HD / VEC) keys; K and V of a tile are
// loaded together (one memory round trip per tile), q of the G heads sits in shared memory.
// attn_combine: block = HD threads (one per output dim), grid = H; the q8_1 quantization is
// decode_common.cuh q8_1_warp (one warp = one 32-element block, s = d * sum(q)).
// Kernel names: attn_split_h{HD}_g{G}_{f16|f32}, attn_combine_h{HD}.
//
// Varlen (the decode rows of a batched step, engine/gpu/batch.py; the same split + combine):
//   Q      f16 [H, T, HD], rope.cu's output: rotated and scaled by log2(e)/sqrt(HD), so the
//          scores are in the exp2 domain (as attention_prefill.cu): scale 1, exp2 for exp
//   kc, vc f16 [KVH, maxT, HD], the shared cache
//   rows   int4 [R] = (t, L, kvbase, 0): query row t attends keys 0..L-1 at cache rows
//          kvbase..; L <= 0: a padding row (a CUDA graph keeps a fixed grid), nothing written
//   attn_split_varlen_h{HD}_g{G}: grid (S, KVH, R); partials part_o [R, H, S, HD], part_ml
//          [R, H, S] as above, per row
//   attn_combine_varlen_h{HD}: grid (H, R); row t of the outputs: Oq int8 / Ods float2 (q8_1,
//          [T, H*HD]) and, if not null, O float32 [T, H*HD]; Oq may be null (float32 only).
#include "common.cuh"
#include "decode_common.cuh"

#define ATT_NT 128
#define ATT_NEG_INF __int_as_float(0xff800000)
#define ATT_TK 64

__device__ __forceinline__ uint4 ld_kv16(const void* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}

// 16 loaded bytes -> VEC floats
__device__ __forceinline__ void kv_floats(const uint4& t, float (&v)[4]) {
    v[0] = __uint_as_float(t.x); v[1] = __uint_as_float(t.y);
    v[2] = __uint_as_float(t.z); v[3] = __uint_as_float(t.w);
}
__device__ __forceinline__ void kv_floats(const uint4& t, float (&v)[8]) {
    const u32 w[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = f16_to_f32((u16)(w[i] & 0xFFFFu));
        v[2 * i + 1] = f16_to_f32((u16)(w[i] >> 16));
    }
}

__device__ __forceinline__ float q_float(float v) { return v; }
__device__ __forceinline__ float q_float(u16 v) { return f16_to_f32(v); }

// e^x, or 2^x for scores in the exp2 domain (varlen)
template <bool EXP2>
__device__ __forceinline__ float att_exp(float x) { return EXP2 ? exp2f(x) : expf(x); }

// Keys [j0, j1) of one split for the G query heads of KV head kvh -> part_o / part_ml.
// q: head h's query at q + h * q_head_stride (float32, or f16 for varlen).
template <int HD, int G, typename KV, typename QT, bool EXP2>
__device__ __forceinline__ void attn_split_tiles(
    const QT* __restrict__ q, long long q_head_stride, const KV* __restrict__ kc, const KV* __restrict__ vc,
    long long tok_stride, long long head_stride, float scale, float* __restrict__ part_o,
    float2* __restrict__ part_ml, int S, int s, int kvh, int j0, int j1) {
    constexpr int VEC = 16 / sizeof(KV);
    constexpr int LPK = HD / VEC;            // lanes per key row
    constexpr int KPP = ATT_NT / LPK;        // keys per pass
    constexpr int NPASS = ATT_TK / KPP;
    constexpr int NW = ATT_NT / 32;
    constexpr bool PREV = sizeof(KV) == 2;   // f16: V loaded with K (registers allow it)
    static_assert(LPK <= 32 && (32 % LPK) == 0, "a key row must fit in a warp");

    __shared__ __align__(16) float sq[G][HD];
    __shared__ float sp[G][ATT_TK];
    __shared__ float sm[G], sl[G], salpha[G];
    __shared__ __align__(16) float sred[NW][G][HD];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h0 = kvh * G;
    for (int i = tid; i < G * HD; i += ATT_NT)
        sq[i / HD][i % HD] = q_float(q[(size_t)(h0 + i / HD) * q_head_stride + i % HD]);
    if (tid < G) { sm[tid] = ATT_NEG_INF; sl[tid] = 0.0f; }
    __syncthreads();

    const int lk = tid % LPK, kg = tid / LPK;
    const KV* kbase = kc + (size_t)kvh * head_stride + lk * VEC;
    const KV* vbase = vc + (size_t)kvh * head_stride + lk * VEC;
    float acc[G][VEC];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[g][e] = 0.0f;

    for (int t0 = j0; t0 < j1; t0 += ATT_TK) {
        // K (and, for f16, V) of the whole tile in flight at once; rows past j1 are clamped
        // to j1 - 1 (read, scored -inf)
        uint4 kr[NPASS], vr[PREV ? NPASS : 1];
#pragma unroll
        for (int p = 0; p < NPASS; ++p) {
            const size_t j = (size_t)min(t0 + p * KPP + kg, j1 - 1);
            kr[p] = ld_kv16(kbase + j * tok_stride);
            if (PREV) vr[p] = ld_kv16(vbase + j * tok_stride);
        }
        // scores
#pragma unroll
        for (int p = 0; p < NPASS; ++p) {
            const int kk = p * KPP + kg;
            const bool valid = t0 + kk < j1;
            float kv[VEC];
            kv_floats(kr[p], kv);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float part = 0.0f;
#pragma unroll
                for (int e = 0; e < VEC; ++e) part += sq[g][lk * VEC + e] * kv[e];
#pragma unroll
                for (int off = LPK / 2; off > 0; off >>= 1)
                    part += __shfl_xor_sync(0xffffffffu, part, off);
                if (lk == 0) sp[g][kk] = valid ? part * scale : ATT_NEG_INF;
            }
        }
        __syncthreads();
        // online softmax: warp w updates heads g = w, w + NW, ...
        for (int g = warp; g < G; g += NW) {
            const float v0 = sp[g][lane], v1 = sp[g][lane + 32];
            float mx = fmaxf(v0, v1);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float mold = sm[g];
            const float mnew = fmaxf(mold, mx);
            const float p0 = att_exp<EXP2>(v0 - mnew), p1 = att_exp<EXP2>(v1 - mnew);
            sp[g][lane] = p0;
            sp[g][lane + 32] = p1;
            float sum = p0 + p1;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            __syncwarp();
            if (lane == 0) {
                const float a = att_exp<EXP2>(mold - mnew);
                salpha[g] = a;
                sl[g] = sl[g] * a + sum;
                sm[g] = mnew;
            }
        }
        __syncthreads();
        // o = o * alpha + sum_j p_j v_j
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float a = salpha[g];
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[g][e] *= a;
        }
#pragma unroll
        for (int p = 0; p < NPASS; ++p) {
            const int kk = p * KPP + kg;       // invalid keys have p = exp(-inf) = 0
            float vv[VEC];
            if (PREV) {
                kv_floats(vr[PREV ? p : 0], vv);
            } else {
                const size_t j = (size_t)min(t0 + kk, j1 - 1);
                kv_floats(ld_kv16(vbase + j * tok_stride), vv);
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float pv = sp[g][kk];
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[g][e] += pv * vv[e];
            }
        }
        __syncthreads();                       // sp / salpha are rewritten by the next tile
    }
    // reduce over the key groups: lanes of a warp with the same lk, then the NW warps
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            float v = acc[g][e];
#pragma unroll
            for (int off = LPK; off < 32; off <<= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            acc[g][e] = v;
        }
    if (lane < LPK) {
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int e = 0; e < VEC; ++e) sred[warp][g][lk * VEC + e] = acc[g][e];
    }
    __syncthreads();
    for (int i = tid; i < G * HD; i += ATT_NT) {
        const int g = i / HD, dd = i % HD;
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; ++w) o += sred[w][g][dd];
        part_o[((size_t)(h0 + g) * S + s) * HD + dd] = o;
    }
    if (tid < G) part_ml[(size_t)(h0 + tid) * S + s] = make_float2(sm[tid], sl[tid]);
}

// One output element (head h, dim dd) of the combine, and its q8_1 block (the 32 lanes of the
// calling warp hold 32 consecutive dims of one head).
template <int HD, bool EXP2>
__device__ __forceinline__ void attn_combine_one(
    int h, int dd, const float* __restrict__ part_o, const float2* __restrict__ part_ml, int S,
    float* __restrict__ out, i8* __restrict__ oq, float2* __restrict__ ods) {
    const float2* ml = part_ml + (size_t)h * S;
    float M = ATT_NEG_INF;
    for (int s = 0; s < S; ++s) M = fmaxf(M, ml[s].x);
    float den = 0.0f, o = 0.0f;
    for (int s = 0; s < S; ++s) {
        const float2 v = ml[s];
        if (v.x == ATT_NEG_INF) continue;          // empty split (its o was never written)
        const float w = att_exp<EXP2>(v.x - M);
        den += w * v.y;
        const float* po = part_o + ((size_t)h * S + s) * HD + dd;
        o += w * *po;
    }
    o = o / den;
    const int idx = h * HD + dd;
    if (out) out[idx] = o;
    if (oq) q8_1_warp(o, oq + idx, ods + (idx >> 5));     // oq: a kernel argument (warp-uniform)
}

template <int HD, int G, typename KV>
__device__ __forceinline__ void attn_split_body(
    const float* __restrict__ q, const KV* __restrict__ kc, const KV* __restrict__ vc,
    long long tok_stride, long long head_stride, const int* __restrict__ pos_ptr, float scale,
    float* __restrict__ part_o, float2* __restrict__ part_ml) {
    const int S = gridDim.x, s = blockIdx.x, kvh = blockIdx.y;
    const int tid = threadIdx.x;
    const int L = __ldg(pos_ptr) + 1;
    const int C = (L + S - 1) / S;
    const int j0 = s * C, j1 = min(L, j0 + C);
    const int h0 = kvh * G;
    if (j0 < j1) {
        attn_split_tiles<HD, G, KV, float, false>(q, HD, kc, vc, tok_stride, head_stride, scale, part_o,
                                                  part_ml, S, s, kvh, j0, j1);
    } else if (tid < G) {
        part_ml[(size_t)(h0 + tid) * S + s] = make_float2(ATT_NEG_INF, 0.0f);
    }
}

#define ATT_SPLIT_INSTANCE(HD, G, KVT, NAME)                                                   \
    extern "C" __global__ void __launch_bounds__(ATT_NT)                                       \
    attn_split_h##HD##_g##G##_##NAME(const float* __restrict__ q, const KVT* __restrict__ kc,  \
                                     const KVT* __restrict__ vc, long long tok_stride,         \
                                     long long head_stride, const int* __restrict__ pos_ptr,   \
                                     float scale, float* __restrict__ part_o,                  \
                                     float2* __restrict__ part_ml) {                           \
        pdl_entry_trigger();                                                                   \
        attn_split_body<HD, G, KVT>(q, kc, vc, tok_stride, head_stride, pos_ptr, scale,        \
                                    part_o, part_ml);                                          \
    }

#define ATT_SPLIT_G(G)                                                                         \
    ATT_SPLIT_INSTANCE(64, G, u16, f16)                                                        \
    ATT_SPLIT_INSTANCE(64, G, float, f32)                                                      \
    ATT_SPLIT_INSTANCE(128, G, u16, f16)                                                       \
    ATT_SPLIT_INSTANCE(128, G, float, f32)

ATT_SPLIT_G(1)
ATT_SPLIT_G(2)
ATT_SPLIT_G(4)
ATT_SPLIT_G(6)
ATT_SPLIT_G(7)
ATT_SPLIT_G(8)

// ---------------------------------------------------------------- combine (+ q8_1)

template <int HD>
__device__ __forceinline__ void attn_combine_body(
    const float* __restrict__ part_o, const float2* __restrict__ part_ml, int S,
    float* __restrict__ out, i8* __restrict__ oq, float2* __restrict__ ods) {
    attn_combine_one<HD, false>(blockIdx.x, threadIdx.x, part_o, part_ml, S, out, oq, ods);
}

#define ATT_COMBINE_INSTANCE(HD)                                                               \
    extern "C" __global__ void __launch_bounds__(HD)                                           \
    attn_combine_h##HD(const float* __restrict__ part_o, const float2* __restrict__ part_ml,   \
                       int S, float* __restrict__ out, i8* __restrict__ oq,                    \
                       float2* __restrict__ ods) {                                             \
        pdl_entry_trigger();                                                                   \
        attn_combine_body<HD>(part_o, part_ml, S, out, oq, ods);                               \
    }

ATT_COMBINE_INSTANCE(64)
ATT_COMBINE_INSTANCE(128)

// ---------------------------------------------------------------- varlen (batched decode rows)

template <int HD, int G>
__device__ __forceinline__ void attn_split_varlen_body(
    const u16* __restrict__ Q, const u16* __restrict__ kc, const u16* __restrict__ vc,
    const int4* __restrict__ rows, int T, int maxT, float* __restrict__ part_o, float2* __restrict__ part_ml) {
    const int S = gridDim.x, s = blockIdx.x, kvh = blockIdx.y, r = blockIdx.z;
    const int4 rw = rows[r];
    const int L = rw.y;
    if (L <= 0) return;                                   // padding row
    const int H = gridDim.y * G, h0 = kvh * G;
    float* po = part_o + (size_t)r * H * S * HD;
    float2* pml = part_ml + (size_t)r * H * S;
    const int C = (L + S - 1) / S;
    const int j0 = s * C, j1 = min(L, j0 + C);
    if (j0 < j1) {
        attn_split_tiles<HD, G, u16, u16, true>(Q + (size_t)rw.x * HD, (long long)T * HD, kc + (size_t)rw.z * HD,
                                                vc + (size_t)rw.z * HD, HD, (long long)maxT * HD, 1.0f, po, pml,
                                                S, s, kvh, j0, j1);
    } else if (threadIdx.x < G) {
        pml[(size_t)(h0 + threadIdx.x) * S + s] = make_float2(ATT_NEG_INF, 0.0f);
    }
}

#define ATT_SPLIT_VARLEN_INSTANCE(HD, G)                                                       \
    extern "C" __global__ void __launch_bounds__(ATT_NT)                                       \
    attn_split_varlen_h##HD##_g##G(const u16* __restrict__ Q, const u16* __restrict__ kc,      \
                                   const u16* __restrict__ vc, const int4* __restrict__ rows,  \
                                   int T, int maxT, float* __restrict__ part_o,                \
                                   float2* __restrict__ part_ml) {                             \
        pdl_entry();                                                                           \
        attn_split_varlen_body<HD, G>(Q, kc, vc, rows, T, maxT, part_o, part_ml);              \
    }

#define ATT_SPLIT_VARLEN_G(G) ATT_SPLIT_VARLEN_INSTANCE(64, G) ATT_SPLIT_VARLEN_INSTANCE(128, G)
ATT_SPLIT_VARLEN_G(1)
ATT_SPLIT_VARLEN_G(2)
ATT_SPLIT_VARLEN_G(4)
ATT_SPLIT_VARLEN_G(6)
ATT_SPLIT_VARLEN_G(7)
ATT_SPLIT_VARLEN_G(8)

template <int HD>
__device__ __forceinline__ void attn_combine_varlen_body(
    const float* __restrict__ part_o, const float2* __restrict__ part_ml, const int4* __restrict__ rows,
    int S, float* __restrict__ out, i8* __restrict__ oq, float2* __restrict__ ods) {
    const int h = blockIdx.x, r = blockIdx.y, H = gridDim.x;
    const int4 rw = rows[r];
    if (rw.y <= 0) return;                                // padding row (block-uniform)
    const size_t row = (size_t)rw.x * H * HD;             // output row t
    attn_combine_one<HD, true>(h, threadIdx.x, part_o + (size_t)r * H * S * HD, part_ml + (size_t)r * H * S, S,
                               out ? out + row : nullptr, oq ? oq + row : nullptr, ods + row / 32);
}

#define ATT_COMBINE_VARLEN_INSTANCE(HD)                                                        \
    extern "C" __global__ void __launch_bounds__(HD)                                           \
    attn_combine_varlen_h##HD(const float* __restrict__ part_o, const float2* __restrict__ part_ml, \
                              const int4* __restrict__ rows, int S, float* __restrict__ out,   \
                              i8* __restrict__ oq, float2* __restrict__ ods) {                 \
        pdl_entry();                                                                           \
        attn_combine_varlen_body<HD>(part_o, part_ml, rows, S, out, oq, ods);                  \
    }

ATT_COMBINE_VARLEN_INSTANCE(64)
ATT_COMBINE_VARLEN_INSTANCE(128)
