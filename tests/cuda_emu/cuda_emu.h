// cuda_emu.h: run CUDA C kernels on the CPU, for checking kernel logic where no GPU is at hand.
//
// A kernel file of kernels_cu/ is compiled with g++ after this header, with the real kernels_cu
// headers (common.cuh, numerics.cuh, ...) inlined as engine.gpu.kernels.source does for NVRTC
// (tests/cuda_emu/emu.py assembles the source and generates one thunk per extern "C" kernel);
// their GGP_EMU branches replace the PTX, this header supplies the CUDA built-ins. Each CUDA thread of a block is a fiber (ucontext) on one OS thread;
// blocks run one after another, so `__shared__` can be `static`. __syncthreads / __syncwarp /
// __shfl_xor_sync are barriers between fibers (threads that returned no longer count, as on the
// GPU); emu_bar_sync(id, count) is a named barrier (bar.sync id, count: released when the threads
// waiting at id and those that passed it by emu_bar_arrive (bar.arrive) make count), and
// emu_yield() lets the other fibers run (spin waits: mbarriers). Floating point follows IEEE float32 with -ffp-contract=off (no FMA contraction), so the
// __f*_rn intrinsics are exact; expf/sqrtf are the C library's (not bit-identical to CUDA's).
// Only what the decode kernels use is here. GGP_EMU is defined for the few PTX-only helpers.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define GGP_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct int2 { int x, y; };
struct int4 { int x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline float2 make_float2(float a, float b) { return float2{a, b}; }
inline int2 make_int2(int a, int b) { return int2{a, b}; }

using std::max;
using std::min;

// ---------------------------------------------------------------- fibers

namespace emu {
enum { RUN = 0, WAIT_BLOCK = 1, WAIT_WARP = 2, DONE = 3, WAIT_NAMED = 4 };
struct Fiber {
    ucontext_t ctx;
    dim3 tid;
    int state;
    int warp;
    int bar;                      // WAIT_NAMED: the barrier id
};
static const int NBAR = 16;
static int g_bar_count[NBAR];     // threads a named barrier waits for (its waiters' count argument)
static int g_bar_arrived[NBAR];   // bar.arrive calls counted toward the barrier's next release
static std::vector<Fiber> g_f;
static std::vector<char> g_stack;
static const size_t STACK = 192 * 1024;
static ucontext_t g_sched;
static Fiber* g_cur = nullptr;
static void (*g_thunk)(void**) = nullptr;
static void** g_args = nullptr;
static u64 g_warp_buf[32][32];

static void fiber_main() {
    g_thunk(g_args);
    g_cur->state = DONE;          // uc_link returns to the scheduler
}
static inline void wait(int st) {
    g_cur->state = st;
    swapcontext(&g_cur->ctx, &g_sched);
}
}  // namespace emu

extern dim3 blockIdx, blockDim, gridDim;
dim3 blockIdx, blockDim, gridDim;
#define threadIdx (emu::g_cur->tid)

inline void __syncthreads() { emu::wait(emu::WAIT_BLOCK); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::wait(emu::WAIT_WARP); }
inline void emu_bar_sync(int id, int count) {
    if (id <= 0 || id >= emu::NBAR) std::abort();
    emu::g_bar_count[id] = count;
    emu::g_cur->bar = id;
    emu::wait(emu::WAIT_NAMED);
}

inline void emu_bar_arrive(int id, int count) {
    if (id <= 0 || id >= emu::NBAR) std::abort();
    emu::g_bar_count[id] = count;
    if (++emu::g_bar_arrived[id] > count) std::abort();
}
inline void emu_yield() { emu::wait(emu::RUN); }

template <class T>
inline T __shfl_xor_sync(unsigned, T v, int off) {
    static_assert(sizeof(T) <= 8, "shuffle of a type over 8 bytes");
    const int w = emu::g_cur->warp, lane = (int)(threadIdx.x & 31);
    u64 bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    emu::g_warp_buf[w][lane] = bits;
    emu::wait(emu::WAIT_WARP);
    const u64 o = emu::g_warp_buf[w][lane ^ off];
    emu::wait(emu::WAIT_WARP);
    T r;
    std::memcpy(&r, &o, sizeof(T));
    return r;
}

extern "C" int emu_launch(void (*thunk)(void**), void** args, unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz) {
    using namespace emu;
    const unsigned n = bx * by * bz;
    if (n == 0 || n > 1024 || (bx % 32 && n > 32)) {
        std::fprintf(stderr, "emu_launch: unsupported block %u x %u x %u\n", bx, by, bz);
        return 1;
    }
    g_f.resize(n);
    if (g_stack.size() < n * STACK) g_stack.resize(n * STACK);
    g_thunk = thunk;
    g_args = args;
    gridDim = dim3{gx, gy, gz};
    blockDim = dim3{bx, by, bz};
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                blockIdx = dim3{x, y, z};
                std::fill(g_bar_arrived, g_bar_arrived + NBAR, 0);
                for (unsigned i = 0; i < n; ++i) {
                    Fiber& f = g_f[i];
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = g_stack.data() + i * STACK;
                    f.ctx.uc_stack.ss_size = STACK;
                    f.ctx.uc_link = &g_sched;
                    makecontext(&f.ctx, (void (*)())fiber_main, 0);
                    f.tid = dim3{i % bx, (i / bx) % by, i / (bx * by)};
                    f.state = RUN;
                    f.warp = (int)(i / 32);
                }
                for (;;) {
                    bool ran = false;
                    for (unsigned i = 0; i < n; ++i) {
                        if (g_f[i].state != RUN) continue;
                        g_cur = &g_f[i];
                        swapcontext(&g_sched, &g_f[i].ctx);
                        ran = true;
                    }
                    unsigned live = 0, at_block = 0;
                    for (unsigned i = 0; i < n; ++i) {
                        live += g_f[i].state != DONE;
                        at_block += g_f[i].state == WAIT_BLOCK;
                    }
                    if (live == 0) break;
                    bool released = false;
                    for (unsigned w = 0; w * 32 < n; ++w) {
                        unsigned lv = 0, at = 0;
                        for (unsigned i = w * 32; i < std::min(n, w * 32 + 32); ++i) {
                            lv += g_f[i].state != DONE;
                            at += g_f[i].state == WAIT_WARP;
                        }
                        if (lv && at == lv) {
                            for (unsigned i = w * 32; i < std::min(n, w * 32 + 32); ++i)
                                if (g_f[i].state == WAIT_WARP) g_f[i].state = RUN;
                            released = true;
                        }
                    }
                    for (int b = 1; b < NBAR && !released; ++b) {
                        unsigned at = 0;
                        for (unsigned i = 0; i < n; ++i) at += g_f[i].state == WAIT_NAMED && g_f[i].bar == b;
                        if (at && (int)at + g_bar_arrived[b] == g_bar_count[b]) {
                            for (unsigned i = 0; i < n; ++i)
                                if (g_f[i].state == WAIT_NAMED && g_f[i].bar == b) g_f[i].state = RUN;
                            g_bar_arrived[b] = 0;
                            released = true;
                        }
                    }
                    if (!released && at_block == live) {
                        for (unsigned i = 0; i < n; ++i)
                            if (g_f[i].state == WAIT_BLOCK) g_f[i].state = RUN;
                        released = true;
                    }
                    if (!ran && !released) {
                        std::fprintf(stderr, "emu_launch: deadlock in block (%u,%u,%u): %u live, %u at "
                                     "__syncthreads, the rest at a warp or named barrier\n", x, y, z, live, at_block);
                        return 2;
                    }
                }
            }
    return 0;
}

// ---------------------------------------------------------------- intrinsics

template <class T>
inline T __ldg(const T* p) { return *p; }
template <class T>
inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() {}
// one OS thread runs every fiber, so plain read-modify-write is atomic
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned o = *p; *p = o + v; return o; }
inline int atomicAdd(int* p, int v) { const int o = *p; *p = o + v; return o; }

inline int __dp4a(int a, int b, int c) {
    int s = c;
    for (int i = 0; i < 4; ++i) s += (int)(i8)(a >> (8 * i)) * (int)(i8)(b >> (8 * i));
    return s;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {   // PRMT, default mode
    const unsigned long long b = (unsigned long long)y << 32 | x;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n) r |= (unsigned)((b >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
    return r;
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {   // (hi:lo) >> (shift & 31)
    const unsigned long long v = (unsigned long long)hi << 32 | lo;
    return (unsigned)(v >> (shift & 31));
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }

inline float emu_half_bits_to_float(u16 h) {
    const u32 s = (u32)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    u32 bits;
    if (e == 0) {
        if (m == 0) {
            bits = s;
        } else {  // subnormal half -> normal float
            float f = std::ldexp((float)m, -24);
            return s ? -f : f;
        }
    } else if (e == 31) {
        bits = s | 0x7F800000u | (m << 13);
    } else {
        bits = s | ((e + 112) << 23) | (m << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline u16 emu_f32_to_f16(float f) {
    _Float16 h = (_Float16)f;      // round to nearest even
    u16 r;
    std::memcpy(&r, &h, 2);
    return r;
}
