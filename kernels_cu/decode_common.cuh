// decode_common.cuh: device helpers shared by the decode kernels (mmvq_q4_k.cu, mmvq_q6_k.cu,
// decode_fused.cu, attention_decode.cu). Inlined after common.cuh by engine/kernels.py.
//
// q8_1_warp: the q8_1 block of 32 values held one per lane of a warp (engine.quants.quantize_q8_1):
//   d = amax / 127, q_i = amax == 0 ? 0 : roundf(x_i / d), s = d * sum(q) (integer sum, exact).
// mmvq_epilogue: an MMVQ warp's R row sums -> y (store / add / swiglu; MODE 3 = swiglu too, MODE
// 4 = store too). mmvq_group_q8: MODE 3's tail, the q8_1 of y in the same launch; mmvq_qkv_post:
// MODE 4's tail, qkv_post in the same launch (below).
#pragma once

#ifndef MMVQ_NW
#define MMVQ_NW 4         // warps (rows) per MMVQ block (2 | 8: A/B defines; the launcher follows)
#endif
#ifndef MMVQ_UNROLL
#define MMVQ_UNROLL 2     // loop iterations (super-block slots) a lane keeps in flight
#endif

// 16-byte weight load that skips L1 (each weight byte is used once). GGP_EMU: the CPU
// emulator of tests/cuda_emu (plain C++ in place of PTX).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
#ifndef GGP_EMU
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}

// SiLU and the q8_1 warp block of the decode kernels: numerics.cuh in the RnFtz policy (the
// ftz intrinsics; quantize_q8_1.cu runs the same block in RnExact, prefill swiglu.cu the same
// SiLU in RnDivExact: merging them would change production machine code).
__device__ __forceinline__ float silu_ref(float g) { return silu<RnFtz>(g); }

// q8_1 of one 32-value block, lane i holding x_i; every lane writes its q, lane 0 writes (d, s).
__device__ __forceinline__ void q8_1_warp(float x, i8* __restrict__ q, float2* __restrict__ ds) {
    q8_1_warp32<RnFtz>(x, q, ds, threadIdx.x & 31);
}

// ---------------------------------------------------------------- MMVQ epilogue

// Row sums -> outputs (lane i of the warp stores row row0 + i).
template <int R, int MODE, int NR>
__device__ __forceinline__ void mmvq_epilogue(float (&acc)[NR], bool active, int row0, int N,
                                              float* __restrict__ Y) {
    constexpr bool GLU = MODE == 2 || MODE == 3;      // y = silu(gate) * up
    constexpr bool STORE = MODE == 0 || MODE == 4;    // y = dot
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], off);
    }
    if (active && lane < R && row0 + lane < N) {
        float v = acc[0], u = GLU ? acc[R] : 0.0f;
#pragma unroll
        for (int i = 1; i < R; ++i) {
            if (lane == i) {
                v = acc[i];
                if (GLU) u = acc[R + i];
            }
        }
        const int n = row0 + lane;
        if (STORE) Y[n] = v;
        else if (GLU) Y[n] = __fmul_rn(silu_ref(v), u);
        else Y[n] += v;
    }
}

// The extra parameters / arguments of a MODE 3 instance (the instance macros take them, empty for
// the other modes).
#define MMVQ_Q8_PARAMS , i8* __restrict__ oq, float2* __restrict__ ods, unsigned* __restrict__ tickets
#define MMVQ_Q8_ARGS , oq, ods, tickets

// MODE 3's tail: the q8_1 blocks of y (the down GEMV's input) written by the launch that makes y,
// instead of a quantize_row_q8 launch after it. Block blk holds rows RPB blk .. RPB blk + RPB - 1
// (RPB = MMVQ_NW R rows per block, a divisor of 32), so a 32-row q8_1 group is 32 / RPB blocks.
// Each block stores its rows (mmvq_epilogue), fences, and takes a ticket of its group; the block
// that draws the group's last ticket reads the 32 values back past L1 (ld.cg) and writes their
// q8_1 block with q8_1_warp, the same arithmetic on the same float32 values as quantize_row_q8
// (the same bits), then puts the ticket count back to 0 for the next launch (a captured step
// replays it). N must be a multiple of 32 (the launcher checks).
template <int RPB>
__device__ __forceinline__ void mmvq_group_q8(const float* __restrict__ Y, int blk, i8* __restrict__ oq,
                                              float2* __restrict__ ods, unsigned* __restrict__ tickets) {
    static_assert(32 % RPB == 0, "a q8_1 group is whole blocks");
    __shared__ int last;
    const int g = blk * RPB / 32;
    __threadfence();                                  // this thread's y visible to the group's last block
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(tickets + g, 1u) == 32 / RPB - 1;
    __syncthreads();
    if (last && threadIdx.x < 32) {
        __threadfence();
        const int k = g * 32 + (int)threadIdx.x;
        q8_1_warp(__ldcg(Y + k), oq + k, ods + g);
        if (threadIdx.x == 0) tickets[g] = 0;
    }
}

// ---------------------------------------------------------------- bias + RoPE + KV append

template <bool F16>
__device__ __forceinline__ void kv_store(void* base, size_t idx, float v) {
    if (F16) reinterpret_cast<u16*>(base)[idx] = f32_to_f16_rn(v);
    else reinterpret_cast<float*>(base)[idx] = v;
}

// Rotation pair i of head hh of [q | k] (values x0, x1 at a = neox ? i : 2i, b = neox ? i + HD/2 :
// 2i + 1 of the head): + bias, RoPE at position p (out0 = x0 c - x1 s, out1 = x0 s + x1 c), then
// q head hh < H -> qrot, k head hh - H -> the K cache at token p.
template <bool F16>
__device__ __forceinline__ void qkv_rope_pair(float x0, float x1, const float* __restrict__ bias,
                                              const float* __restrict__ rcos, const float* __restrict__ rsin,
                                              int p, float* __restrict__ qrot, void* __restrict__ kc,
                                              long long tok_stride, long long head_stride, int H, int HD,
                                              int neox, int hh, int i) {
    const int half = HD >> 1;
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const int base = hh * HD;
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
}

// Element e (0 .. KVH HD - 1) of v, value v: + bias, then the V cache at token p.
template <bool F16>
__device__ __forceinline__ void qkv_v_elem(float v, const float* __restrict__ bias, int p, void* __restrict__ vc,
                                           long long tok_stride, long long head_stride, int H, int KVH, int HD,
                                           int e) {
    if (bias) v = __fadd_rn(v, bias[(H + KVH) * HD + e]);
    kv_store<F16>(vc, (size_t)p * tok_stride + (size_t)(e / HD) * head_stride + (e % HD), v);
}

// MODE 4 (store_post): store, then the bias + RoPE + K/V append of qkv_post in the same launch.
// The segments' outputs are views of one [q | k | v] buffer (qkv), so block blk of a segment whose
// output is y holds rows r0 = (y - qkv) + RPB blk .. + RPB - 1 of it, all in head r0 / HD (RPB
// divides HD; the launcher checks). Each block stores its rows, fences and takes a ticket of its
// head; the block that draws the head's last ticket (HD / RPB of them) reads the head back past L1
// and runs qkv_rope_pair (q, k heads) or qkv_v_elem (v heads) on it, then zeroes the ticket: the
// arithmetic of qkv_post on the same float32 values, so the same bits.
struct QkvPostArgs {
    const float* qkv;
    const float* bias;
    const float* rcos;
    const float* rsin;
    const int* state;
    float* qrot;
    void* kc;
    void* vc;
    long long tok_stride, head_stride;
    int H, KVH, HD, neox;
    unsigned* tickets;                                // one per head of [q | k | v], zero between launches
};
// (qkv without __restrict__: the segments' outputs y0..y2 are views of it; only its address is used)
#define MMVQ_POST_PARAMS                                                                          \
    , const float* qkv, const float* __restrict__ bias, const float* __restrict__ rcos,           \
    const float* __restrict__ rsin, const int* __restrict__ state, float* __restrict__ qrot,        \
    void* __restrict__ kc, void* __restrict__ vc, long long tok_stride, long long head_stride,      \
    int H, int KVH, int HD, int neox, unsigned* __restrict__ tickets
#define MMVQ_POST_ARGS                                                                            \
    , nullptr, nullptr, nullptr,                                                                  \
    QkvPostArgs{qkv, bias, rcos, rsin, state, qrot, kc, vc, tok_stride, head_stride, H, KVH, HD, neox, tickets}

template <int RPB, bool F16>
__device__ __forceinline__ void mmvq_qkv_post(const float* __restrict__ Y, int blk, QkvPostArgs a) {
    __shared__ int last;
    const int seg = (int)(Y - a.qkv);                 // the segment's first row in [q | k | v]
    const int head = (seg + blk * RPB) / a.HD;
    __threadfence();                                  // this thread's rows visible to the head's last block
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(a.tickets + head, 1u) == (unsigned)(a.HD / RPB - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int p = __ldg(a.state + 1), half = a.HD >> 1;
    const float* hy = Y + (head * a.HD - seg);        // the head's rows, read through the pointer that wrote them
    if (head < a.H + a.KVH) {
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            const int ia = a.neox ? i : 2 * i, ib = a.neox ? i + half : 2 * i + 1;
            qkv_rope_pair<F16>(__ldcg(hy + ia), __ldcg(hy + ib), a.bias, a.rcos, a.rsin, p, a.qrot, a.kc,
                               a.tok_stride, a.head_stride, a.H, a.HD, a.neox, head, i);
        }
    } else {
        for (int e = threadIdx.x; e < a.HD; e += blockDim.x)
            qkv_v_elem<F16>(__ldcg(hy + e), a.bias, p, a.vc, a.tok_stride, a.head_stride, a.H, a.KVH, a.HD,
                            (head - a.H - a.KVH) * a.HD + e);
    }
    if (threadIdx.x == 0) a.tickets[head] = 0;
}
