// numerics.cuh: the kernels' float numerics, one definition each (included by common.cuh, so
// every kernel file has it). engine/reference/numerics.py is the numpy model of these.
//
// Why two kinds of float op: CuPy compiles with -ftz=true, so the __f*_rn intrinsics (and
// fabsf / fmaxf / sqrtf) become .ftz PTX that flushes subnormal inputs and results to zero.
// The nf_* helpers are inline PTX without .ftz (IEEE float32, subnormals kept, as numpy).
// Which ops a kernel uses is part of its numerics (and of its machine code), so the choice is
// spelled out per kernel by a rounding policy:
//   RnExact     every op non-ftz (quantize_q8_1.cu: the MMQ A operand bit for bit like
//               engine.formats.quants.quantize_q8_1, subnormal inputs included);
//   RnDivExact  add / div non-ftz, mul / abs / max the ftz intrinsics (prefill rmsnorm.cu,
//               swiglu.cu, attention_prefill.cu: the divisions that set d and q keep
//               subnormal quotients; products and |x| of normal activations are the same either way);
//   RnFtz       every op the ftz intrinsic (the decode kernels: they also build unchanged in
//               the CPU emulator, and decode activations are normal).
// The three mixes give the same bits on normal inputs; they are kept apart because merging
// them would change the machine code of production kernels (dev/kernel_identity.py).
//
// GGP_EMU (tests/cuda_emu): plain C++ in place of the PTX; the emulator compiles with
// -ffp-contract=off and keeps subnormals, so every policy is IEEE float32 there.
#pragma once

// ---------------------------------------------------------------- non-flush-to-zero ops

#ifndef GGP_EMU
__device__ __forceinline__ float nf_add(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float nf_mul(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float nf_div(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float nf_max(float a, float b) {
    float r;
    asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float nf_abs(float a) {
    float r;
    asm("abs.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
// float -> f16 bits, round to nearest even
__device__ __forceinline__ u16 f32_to_f16_rn(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#else   // CPU emulation (tests/cuda_emu)
inline float nf_add(float a, float b) { return a + b; }
inline float nf_mul(float a, float b) { return a * b; }
inline float nf_div(float a, float b) { return a / b; }
inline float nf_max(float a, float b) { return std::fmax(a, b); }
inline float nf_abs(float a) { return std::fabs(a); }
inline u16 f32_to_f16_rn(float f) { return emu_f32_to_f16(f); }
#endif

// ---------------------------------------------------------------- rounding policies

struct RnExact {
    static __device__ __forceinline__ float add(float a, float b) { return nf_add(a, b); }
    static __device__ __forceinline__ float mul(float a, float b) { return nf_mul(a, b); }
    static __device__ __forceinline__ float div(float a, float b) { return nf_div(a, b); }
    static __device__ __forceinline__ float max(float a, float b) { return nf_max(a, b); }
    static __device__ __forceinline__ float abs(float a) { return nf_abs(a); }
};
struct RnDivExact {
    static __device__ __forceinline__ float add(float a, float b) { return nf_add(a, b); }
    static __device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
    static __device__ __forceinline__ float div(float a, float b) { return nf_div(a, b); }
    static __device__ __forceinline__ float max(float a, float b) { return fmaxf(a, b); }
    static __device__ __forceinline__ float abs(float a) { return fabsf(a); }
};
struct RnFtz {
    static __device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
    static __device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
    static __device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
    static __device__ __forceinline__ float max(float a, float b) { return fmaxf(a, b); }
    static __device__ __forceinline__ float abs(float a) { return fabsf(a); }
};

// ---------------------------------------------------------------- SiLU

// silu(g) = g / (1 + exp(-g))    (engine.reference.ops.silu; expf is CUDA's, not numpy's)
// RnDivExact: prefill swiglu.cu; RnFtz: the decode swiglu epilogues.
template <class P>
__device__ __forceinline__ float silu(float g) {
    return P::div(g, P::add(1.0f, expf(-g)));
}

// ---------------------------------------------------------------- warp reductions

// Butterfly over the W lanes of an aligned lane group (W = 32: the whole warp): every lane
// ends with the same result, whatever the order (max is exact; the integer sum is exact).
template <int W>
__device__ __forceinline__ int group_sum(int v) {
#pragma unroll
    for (int off = W / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}
template <int W>
__device__ __forceinline__ float group_sum(float v) {      // float: this butterfly's order
#pragma unroll
    for (int off = W / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}
template <int W, class P>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
    for (int off = W / 2; off > 0; off >>= 1) v = P::max(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// ---------------------------------------------------------------- q8_1 blocks

// q8_1 of a 32-value block (engine.formats.quants.quantize_q8_1, engine.reference.numerics):
//   d = amax / 127, q_i = amax == 0 ? 0 : roundf(x_i / d), s = d * sum(q) (integer sum, exact).
// The zero test reads amax's bits (a subnormal amax is not zero under any policy).

// One value per lane of a warp (lane = threadIdx.x & 31 holds x_lane): every lane writes its q, lane 0 (d, s).
// RnExact: quantize_q8_1.cu; RnFtz: the decode kernels (decode_common.cuh q8_1_warp).
template <class P>
__device__ __forceinline__ void q8_1_warp32(float x, i8* __restrict__ q, float2* __restrict__ ds, int lane) {
    const float amax = group_max<32, P>(P::abs(x));
    const float d = P::div(amax, 127.0f);
    const int qi = (__float_as_int(amax) == 0) ? 0 : (int)roundf(P::div(x, d));
    *q = (i8)qi;
    const int qsum = group_sum<32>(qi);
    if (lane == 0) *ds = make_float2(d, P::mul(d, (float)qsum));
}

// Four consecutive values per lane, a block = 8 consecutive lanes (prefill rmsnorm.cu,
// swiglu.cu): the lane's 4 q; d and qs (the block's integer sum of q) are the same on the 8
// lanes. The caller stores pack_i8x4(qv) and (d, P::mul(d, qs)).
template <class P>
__device__ __forceinline__ void q8_1_quad(float h0, float h1, float h2, float h3, int (&qv)[4], float& d,
                                          int& qs) {
    float amax = P::max(P::max(P::abs(h0), P::abs(h1)), P::max(P::abs(h2), P::abs(h3)));
    amax = group_max<8, P>(amax);
    d = P::div(amax, 127.0f);
    const bool zero = __float_as_int(amax) == 0;
    qv[0] = zero ? 0 : (int)roundf(P::div(h0, d));
    qv[1] = zero ? 0 : (int)roundf(P::div(h1, d));
    qv[2] = zero ? 0 : (int)roundf(P::div(h2, d));
    qv[3] = zero ? 0 : (int)roundf(P::div(h3, d));
    qs = group_sum<8>(qv[0] + qv[1] + qv[2] + qv[3]);
}

// Four int8 (the low bytes of q[0..3]) packed little-endian into a u32.
__device__ __forceinline__ u32 pack_i8x4(const int (&q)[4]) {
    return (u32)(q[0] & 0xFF) | ((u32)(q[1] & 0xFF) << 8) | ((u32)(q[2] & 0xFF) << 16) | ((u32)(q[3] & 0xFF) << 24);
}
