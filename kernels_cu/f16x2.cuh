// f16x2.cuh: packed-half arithmetic and bit tricks of the Hopper GEMMs' weight dequantization
// (wgmma_q4_k.cu, wgmma_q6_k.cu). A u32 holds two f16 (low half first); every op rounds to
// nearest even once, as the PTX .rn instructions do. GGP_EMU (tests/cuda_emu): the same ops in
// C++ (exact in __float128, then one rounding to _Float16), so the weight policies run on the CPU
// against engine.reference.wgmma (tests/test_wgmma_reference.py).
#pragma once
#include "common.cuh"

#define H2_1024 0x64006400u            // (1024, 1024)
#define H2_M1024 0xE400E400u           // (-1024, -1024)

#ifndef GGP_EMU
__device__ __forceinline__ u32 h2_fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
__device__ __forceinline__ u32 h2_add(u32 a, u32 b) {
    u32 r;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 h2_mul(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// (a & MASK) | OR in one LOP3 (C++ `(a & m) | c` compiles to two: SASS LOP3 takes one immediate,
// and ptxas does not keep the other constant in a register on its own).
template <u32 MASK, u32 OR>
__device__ __forceinline__ u32 and_or(u32 a) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "n"(OR));   // 0xEA = (a & b) | c
    return d;
}
#else
inline __float128 emu_h_exact(u32 v, int half) {
    const u16 b = (u16)(v >> (16 * half));
    _Float16 h;
    std::memcpy(&h, &b, 2);
    return (__float128)h;
}
inline u32 emu_h_round(__float128 x) {
    const _Float16 h = (_Float16)x;    // one rounding, to nearest even
    u16 b;
    std::memcpy(&b, &h, 2);
    return b;
}
inline u32 h2_fma(u32 a, u32 b, u32 c) {
    u32 r = 0;
    for (int i = 0; i < 2; ++i)
        r |= emu_h_round(emu_h_exact(a, i) * emu_h_exact(b, i) + emu_h_exact(c, i)) << (16 * i);
    return r;
}
inline u32 h2_add(u32 a, u32 b) {
    u32 r = 0;
    for (int i = 0; i < 2; ++i) r |= emu_h_round(emu_h_exact(a, i) + emu_h_exact(b, i)) << (16 * i);
    return r;
}
inline u32 h2_mul(u32 a, u32 b) {
    u32 r = 0;
    for (int i = 0; i < 2; ++i) r |= emu_h_round(emu_h_exact(a, i) * emu_h_exact(b, i)) << (16 * i);
    return r;
}
template <u32 MASK, u32 OR>
inline u32 and_or(u32 a) { return (a & MASK) | OR; }
#endif

// A super-block scale in f16x2 without conversions: bytes sel (a PRMT selector: two bytes of w,
// each beside 0x64) make the f16 pair 1024 + byte; adding `bias` (-1024, or -1024 - 128 for a
// sign-flipped int8) leaves the integer exactly; times `scale` rounds the exact product once,
// as the f32 product (exact) rounded to f16 does.
__device__ __forceinline__ u32 h2_byte_scaled(u32 w, u32 sel, u32 bias, u32 scale) {
    return h2_mul(h2_add(__byte_perm(w, 0x64646464u, sel), bias), scale);
}

__device__ __forceinline__ u32 uint4_word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
