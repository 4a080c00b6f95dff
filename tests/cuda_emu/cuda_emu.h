// cuda_emu.h: run CUDA C kernels on the CPU, for checking kernel logic where no GPU is at hand.
//
// A kernel file of kernels_cu/ is compiled with g++ after this header, with the real kernels_cu
// headers (common.cuh, numerics.cuh, ...) inlined as engine.gpu.kernels.source does for NVRTC
// (tests/cuda_emu/emu.py assembles the source and generates one thunk per extern "C" kernel);
// their GGP_EMU branches replace the PTX, this header supplies the CUDA built-ins. Each CUDA thread of a block is a fiber (ucontext) on one OS thread;
// blocks run one after another, so `__shared__` can be `static`. __syncthreads / __syncwarp /
// __shfl_xor_sync / __shfl_down_sync (lanes past 31 keep their own value) are barriers between fibers (threads that returned no longer count, as on the
// GPU); cp.async copies land late (emu_cp_async: at wait_group, at thread exit, or one arrival
// at a time when the block is otherwise stuck); emu_bar_sync(id, count) is a named barrier
// (bar.sync id, count: released when the threads waiting at id and those that passed it by
// emu_bar_arrive (bar.arrive) make count), and emu_yield() lets the other fibers run (spin
// waits: mbarriers). Floating point follows IEEE float32 with -ffp-contract=off (no FMA contraction), so the
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
enum { RUN = 0, WAIT_BLOCK = 1, WAIT_WARP = 2, DONE = 3, WAIT_NAMED = 4, WAIT_SPIN = 5 };
// A thread's cp.async traffic in issue order: copies (the 16 source bytes taken at issue, as the
// source is not written during a kernel), group commits, and the arrivals that
// cp.async.mbarrier.arrive makes once the thread's earlier copies have landed.
struct AsyncOp {
    int kind;                     // 0 copy, 1 commit, 2 arrive
    unsigned char* dst;
    unsigned char data[16];
    void (*arrive)(unsigned);
    unsigned arg;
};
struct Fiber {
    ucontext_t ctx;
    dim3 tid;
    int state;
    int warp;
    int bar;                      // WAIT_NAMED: the barrier id
    bool woken;                   // set running from WAIT_SPIN (no progress if it spins again)
    std::vector<AsyncOp> async;   // cp.async ops not landed yet
};
// Land the ops async[0 .. end) in order (copies written, arrivals made).
static inline void land(Fiber& f, size_t end) {
    std::vector<AsyncOp> ops(f.async.begin(), f.async.begin() + end);
    f.async.erase(f.async.begin(), f.async.begin() + end);
    for (const AsyncOp& op : ops) {
        if (op.kind == 0) std::memcpy(op.dst, op.data, 16);
        else if (op.kind == 2) op.arrive(op.arg);
    }
}
// Copies land as late as they can: only when the block makes no other progress (every live
// thread waits at a barrier or spins on an mbarrier) does one thread's oldest pending arrival land,
// with the copies before it (and at wait_group and at thread exit). So a reader that waits on the
// wrong mbarrier (or none) sees stale shared memory.
static inline bool land_one_arrival(Fiber& f) {
    for (size_t i = 0; i < f.async.size(); ++i)
        if (f.async[i].kind == 2) {
            land(f, i + 1);
            return true;
        }
    return false;
}
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
    land(*g_cur, g_cur->async.size());   // a thread's copies land before its block ends
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
inline void emu_yield() { emu::wait(emu::WAIT_SPIN); }   // a spin-wait round: others first

// cp.async (16 bytes, or n = 0: zero-fill), commit_group, wait_group N (every op before the N
// most recent commits lands), cp.async.mbarrier.arrive (arrive(arg) once the earlier copies land).
inline void emu_cp_async(void* dst, const void* src, int n) {
    emu::AsyncOp op{0, (unsigned char*)dst, {}, nullptr, 0};
    if (n == 16) std::memcpy(op.data, src, 16);
    emu::g_cur->async.push_back(op);
}
inline void emu_cp_async_commit() { emu::g_cur->async.push_back(emu::AsyncOp{1, nullptr, {}, nullptr, 0}); }
inline void emu_cp_async_wait(int n) {
    std::vector<emu::AsyncOp>& q = emu::g_cur->async;
    size_t end = q.size();
    int commits = 0;
    while (end > 0 && !(q[end - 1].kind == 1 && commits++ == n)) --end;   // just past the (n+1)-th last commit
    emu::land(*emu::g_cur, end);
}
inline void emu_cp_async_arrive(void (*arrive)(unsigned), unsigned arg) {
    emu::g_cur->async.push_back(emu::AsyncOp{2, nullptr, {}, arrive, arg});
}

// The value of lane src(lane) of this warp (every lane of the warp calls it).
template <class T, class Src>
inline T emu_shfl(T v, Src src) {
    static_assert(sizeof(T) <= 8, "shuffle of a type over 8 bytes");
    const int w = emu::g_cur->warp, lane = (int)(threadIdx.x & 31);
    u64 bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    emu::g_warp_buf[w][lane] = bits;
    emu::wait(emu::WAIT_WARP);
    const u64 o = emu::g_warp_buf[w][src(lane)];
    emu::wait(emu::WAIT_WARP);
    T r;
    std::memcpy(&r, &o, sizeof(T));
    return r;
}
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int off) {
    return emu_shfl(v, [off](int lane) { return lane ^ off; });
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, int off) {
    return emu_shfl(v, [off](int lane) { return lane + off < 32 ? lane + off : lane; });
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
                    f.woken = false;
                    f.async.clear();
                }
                bool spinners_woken = false;       // since the last progress
                unsigned land_next = 0;            // round-robin over threads for the late landings
                for (;;) {
                    bool ran = false;
                    for (unsigned i = 0; i < n; ++i) {
                        if (g_f[i].state != RUN) continue;
                        g_cur = &g_f[i];
                        swapcontext(&g_sched, &g_f[i].ctx);
                        ran |= !(g_f[i].woken && g_f[i].state == WAIT_SPIN);
                        g_f[i].woken = false;
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
                    if (ran || released) {
                        spinners_woken = false;
                        for (unsigned i = 0; i < n; ++i)
                            if (g_f[i].state == WAIT_SPIN) g_f[i].state = RUN, g_f[i].woken = true;
                        continue;
                    }
                    // No progress: let the spinners look again, then land one pending arrival.
                    bool landed = false;
                    if (spinners_woken)
                        for (unsigned k = 0; k < n && !landed; ++k, land_next = (land_next + 1) % n)
                            landed = land_one_arrival(g_f[land_next]);
                    bool spinners = false;
                    for (unsigned i = 0; i < n; ++i)
                        if (g_f[i].state == WAIT_SPIN) g_f[i].state = RUN, g_f[i].woken = true, spinners = true;
                    if (spinners && (!spinners_woken || landed)) {
                        spinners_woken = true;
                        continue;
                    }
                    std::fprintf(stderr, "emu_launch: deadlock in block (%u,%u,%u): %u live, %u at "
                                 "__syncthreads, the rest at a warp or named barrier or spinning\n", x, y, z, live, at_block);
                    return 2;
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
