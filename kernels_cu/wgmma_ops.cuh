// wgmma_ops.cuh: the Hopper (sm_90a) warpgroup MMA building blocks shared by the wgmma GEMMs
// (wgmma_common.cuh) and the wgmma attention (attention_wgmma.cu).
//
// wgmma_n<BN, TB, ACC>(d, a, desc): D[64 x BN] (+)= A[64 x 16] . B[16 x BN], f16 inputs, f32
// accumulation; A from registers (per warp v of the warpgroup rows 16v..16v+15 in the
// mma.m16n8k16 A layout: lane (g, t) holds rows g, g+8 and k 2t, 2t+1, 2t+8, 2t+9), B from shared
// memory through a descriptor; BN / 2 accumulators per thread, d[4 i + e] = (row g + 8 (e >> 1),
// column 8 i + 2 t + (e & 1)). ACC = 0: D = A . B (scale-d 0), else D += A . B.
// wgmma_ss_n<64, ACC>(d, adesc, bdesc): the same with A from shared memory too (K-major).
// B layouts, no swizzle, built from core matrices of 8 rows x 16 contiguous bytes (128 bytes):
//   TB = 0 (K-major): a core matrix is 8 columns n x 8 k, byte (n % 8) * 16 + (k % 8) * 2;
//   TB = 1 (MN-major, "transposed"): 8 k x 8 columns n, byte (k % 8) * 16 + (n % 8) * 2.
//   Either way the core matrix of (k / 8, n / 8) starts at start + (k / 8) * LBO + (n / 8) * SBO
//   (PTX ISA "matrix descriptor": LBO along K, SBO along M/N in the no-swizzle mode).
// Descriptor (wg_desc): start / 16 in bits 0..13, LBO / 16 in 16..29, SBO / 16 in 32..45.
// wg_desc_sw128: the 128-byte swizzle mode (bits 62..63 = 1): the canonical layout's 16-byte
// chunk at address a sits at a ^ (((a >> 7) & 7) << 4) (1 KB aligned patterns of 8 rows x 128 B):
//   K-major: row n (of 8-row groups SBO apart) holds 64 k in 128 B; a k16 step starts 32 B on;
//   MN-major: row k (of 8-row groups SBO apart) holds 64 columns n in 128 B, the next 64 at LBO.
// mbar_*, cp_async_mbar_arrive, named_bar_*: the barriers of the attention's pipeline and of the
// GEMMs' bulk-copy stages.
// Under the CPU emulator (GGP_EMU) wgmma_n computes its result at issue, for blocks of one to four
// warpgroups (128 to 512 threads) in which every thread of an issuing warpgroup issues it (a
// barrier of the warpgroup's 128 threads inside, named barriers 1 to 4), with shared addresses
// (descriptors, mbarriers) as offsets from wg_emu_smem.
#pragma once
#include "common.cuh"

#ifndef GGP_EMU
__device__ __forceinline__ u64 wg_desc(u32 saddr, u32 lbo, u32 sbo) {
    return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}
__device__ __forceinline__ u64 wg_desc_sw128(u32 saddr, u32 lbo, u32 sbo) {
    return wg_desc(saddr, lbo, sbo) | (1ull << 62);
}
// The descriptor of saddr + off from that of saddr: the start field is bits 0..13 of the u64 (the
// address / 16), and shared addresses stay below 2^18, so adding off / 16 never carries out of it
// (one add instead of the mask-shift-or per wgmma).
__device__ __forceinline__ u64 wg_desc_add(u64 desc, u32 off) { return desc + (off >> 4); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
// An empty asm that reads and redefines each register: uses of d (wgmma accumulators, read
// asynchronously) stay after the wgmma.wait_group issued before it, and registers that a wgmma
// reads stay allocated until then.
template <int N>
__device__ __forceinline__ void wg_keep(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
template <int N>
__device__ __forceinline__ void wg_keep(u32 (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i]) :: "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async proxy
// (wgmma operands read through descriptors): by each writing thread before a barrier, or by a
// reading thread once an mbarrier says the copies landed (the attention's pipeline).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Shared-memory mbarriers (init with an arrival count; arrive; wait until the phase of a parity has
// completed) and the arrival that a thread's cp.asyncs make when they have all landed (.noinc: it
// is one of the init count's arrivals); named barriers (bar.sync waits, bar.arrive only counts).
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void named_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(count) : "memory");
}
// A warpgroup's register ceiling raised / lowered to N (warp specialisation: a producer warpgroup
// gives its registers to the consumers; the kernel needs __launch_bounds__(threads, 1)).
template <int N>
__device__ __forceinline__ void wg_setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N)); }
template <int N>
__device__ __forceinline__ void wg_setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N)); }

#define WG_D4(i) "+f"(d[4 * (i)]), "+f"(d[4 * (i) + 1]), "+f"(d[4 * (i) + 2]), "+f"(d[4 * (i) + 3])
#define WG_A4 "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(ACC), "n"(TB)
#define WG_MMA(N) "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 "
#define WG_PRED(I) "{\n.reg .pred p;\nsetp.ne.b32 p, %" #I ", 0;\n"
#define WG_D64 WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3), WG_D4(4), WG_D4(5), WG_D4(6), WG_D4(7), \
               WG_D4(8), WG_D4(9), WG_D4(10), WG_D4(11), WG_D4(12), WG_D4(13), WG_D4(14), WG_D4(15)
#define WG_D64_LIST                                                                     \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
template <int BN, int TB = 0, int ACC = 1>
__device__ __forceinline__ void wgmma_n(float (&d)[BN / 2], const u32 (&a)[4], u64 desc) {
    static_assert(BN == 32 || BN == 64 || BN == 128, "BN: 32, 64 or 128");
    if constexpr (BN == 32) {
        asm volatile(WG_PRED(21) WG_MMA(32)
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                     "{%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
                     : WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3) : WG_A4);
    } else if constexpr (BN == 64) {
        asm volatile(WG_PRED(37) WG_MMA(64)
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                     "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                     : WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3), WG_D4(4), WG_D4(5), WG_D4(6), WG_D4(7) : WG_A4);
    } else {
        asm volatile(WG_PRED(69) WG_MMA(128)
                     WG_D64_LIST
                     "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
                     : WG_D64
                     : WG_A4);
    }
}
// D[64 x BN] (+)= A[64 x 16] . B[16 x BN], A too from shared memory (K-major, descriptor adesc).
template <int BN, int ACC = 1>
__device__ __forceinline__ void wgmma_ss_n(float (&d)[BN / 2], u64 adesc, u64 bdesc) {
    static_assert(BN == 64 || BN == 128, "BN: 64 or 128");
    if constexpr (BN == 64) {
        asm volatile(WG_PRED(34) WG_MMA(64)
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                     "%32, %33, p, 1, 1, 0, 0;\n}\n"
                     : WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3), WG_D4(4), WG_D4(5), WG_D4(6), WG_D4(7)
                     : "l"(adesc), "l"(bdesc), "n"(ACC));
    } else {
        asm volatile(WG_PRED(66) WG_MMA(128)
                     WG_D64_LIST
                     "%64, %65, p, 1, 1, 0, 0;\n}\n"
                     : WG_D64
                     : "l"(adesc), "l"(bdesc), "n"(ACC));
    }
}
// wgmma_n (BN 32 or 64, TB = 0) with scale-d at run time: fresh = 1 makes D = A . B, else D += A . B
// (the stream-K GEMMs' segments, wgmma_streamk.cuh: their accumulators are then never written by
// other instructions inside the pipeline, which would make ptxas serialize every wgmma, C7515).
template <int BN>
__device__ __forceinline__ void wgmma_n_fresh(float (&d)[BN / 2], const u32 (&a)[4], u64 desc, int fresh) {
    static_assert(BN == 32 || BN == 64, "BN: 32 or 64");
    const int acc = !fresh;
    if constexpr (BN == 32) {
        asm volatile(WG_PRED(21) WG_MMA(32)
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                     "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
                     : WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
    } else {
        asm volatile(WG_PRED(37) WG_MMA(64)
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                     "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                     : WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3), WG_D4(4), WG_D4(5), WG_D4(6), WG_D4(7)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
    }
}
#undef WG_D4
#undef WG_A4
#undef WG_MMA
#undef WG_PRED
#undef WG_D64_LIST
#undef WG_D64

#else
static u8* wg_emu_smem = nullptr;           // the block's shared memory (set by the kernel)
static u32 wg_emu_a[512][4];
inline u64 wg_desc(u32 saddr, u32 lbo, u32 sbo) {
    return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}
inline u64 wg_desc_add(u64 desc, u32 off) { return desc + (off >> 4); }
inline u64 wg_desc_sw128(u32 saddr, u32 lbo, u32 sbo) { return wg_desc(saddr, lbo, sbo) | (1ull << 62); }
inline void wg_fence() {}
inline void wg_commit() {}
template <int N> inline void wg_wait() {}
template <int N> inline void wg_keep(float (&)[N]) {}
template <int N> inline void wg_keep(u32 (&)[N]) {}
inline void fence_proxy_async() {}
// An mbarrier: the pending count, then the init count (bits 1..) and the phase (bit 0).
inline void mbar_init(u32 bar, u32 count) {
    u32* m = (u32*)(wg_emu_smem + bar);
    m[0] = count;
    m[1] = count << 1;
}
inline void mbar_arrive(u32 bar) {
    u32* m = (u32*)(wg_emu_smem + bar);
    if (m[0] == 0) std::abort();
    if (--m[0] == 0) {
        m[0] = m[1] >> 1;
        m[1] ^= 1;
    }
}
inline void mbar_wait(u32 bar, u32 parity) {
    for (long spin = 0; (((const u32*)(wg_emu_smem + bar))[1] & 1) == parity; ++spin) {
        if (spin > 20000) {          // a few rounds suffice when the arrivals can come
            std::fprintf(stderr, "mbar_wait: the phase of parity %u at %u never completes\n", parity, bar);
            std::abort();
        }
        emu_yield();
    }
}
inline void cp_async_mbar_arrive(u32 bar) { emu_cp_async_arrive(mbar_arrive, bar); }   // when the copies land
inline void named_bar_sync(int id, int count) { emu_bar_sync(id, count); }
inline void named_bar_arrive(int id, int count) { emu_bar_arrive(id, count); }
template <int N>
inline void wg_setmaxnreg_inc() {}              // registers: nothing to emulate
template <int N>
inline void wg_setmaxnreg_dec() {}
// Element (row n of the M/N side, k) of a shared-memory operand read through descriptor desc
// (TB: MN-major, else K-major); the layouts of the top comment.
inline float wg_emu_elem(u64 desc, bool mn_major, int n, int k) {
    const u32 start = (u32)(desc & 0x3FFF) << 4, lbo = (u32)((desc >> 16) & 0x3FFF) << 4,
              sbo = (u32)((desc >> 32) & 0x3FFF) << 4;
    const int mode = (int)(desc >> 62);
    if (mode != 0 && mode != 1) std::abort();     // no swizzle or 128-byte swizzle only
    u32 at;
    if (mode == 0) {
        at = start + (k >> 3) * lbo + (n >> 3) * sbo + (mn_major ? (k & 7) * 16 + (n & 7) * 2 : (n & 7) * 16 + (k & 7) * 2);
    } else {
        at = mn_major ? start + (n >> 6) * lbo + (k >> 3) * sbo + (k & 7) * 128 + (n & 63) * 2
                      : start + (n >> 3) * sbo + (n & 7) * 128 + k * 2;
        at ^= ((at >> 7) & 7) << 4;
    }
    return f16_to_f32(*(const u16*)(wg_emu_smem + at));
}
// A[r][k] of the warpgroup's register fragments (wg_emu_a): warp r / 16, lane 4 (r % 8) + (k % 8) / 2,
// register (r % 16 >= 8) + 2 (k >= 8), half k % 2.
inline float wg_emu_areg(int wg0, int r, int k) {
    const u32 aw = wg_emu_a[wg0 + 32 * (r >> 4) + 4 * (r & 7) + ((k & 7) >> 1)][((r >> 3) & 1) + 2 * (k >> 3)];
    return f16_to_f32((u16)((k & 1) ? aw >> 16 : aw & 0xFFFF));
}
// D (+)= A . B for the calling thread's accumulators; adesc == 0: A from wg_emu_a.
template <int BN, int TB, int ACC>
inline void wg_emu_mma(float (&d)[BN / 2], u64 adesc, u64 bdesc) {
    const int tid = threadIdx.x, wg0 = tid & ~127, w = (tid & 127) >> 5, g = (tid & 31) >> 2, t = tid & 3;
    for (int i = 0; i < BN / 2; ++i) {
        const int r = 16 * w + g + 8 * ((i & 3) >> 1), c = 8 * (i >> 2) + 2 * t + (i & 1);
        float acc = ACC ? d[i] : 0.0f;
        for (int k = 0; k < 16; ++k)
            acc += (adesc ? wg_emu_elem(adesc, false, r, k) : wg_emu_areg(wg0, r, k)) * wg_emu_elem(bdesc, TB, c, k);
        d[i] = acc;
    }
}
inline void wg_emu_check() {
    if (blockDim.x % 128 || blockDim.x > 512 || blockDim.y != 1 || !wg_emu_smem) std::abort();
}
inline void wg_emu_sync() { emu_bar_sync(1 + threadIdx.x / 128, 128); }   // the warpgroup's threads
template <int BN, int TB = 0, int ACC = 1>
inline void wgmma_n(float (&d)[BN / 2], const u32 (&a)[4], u64 desc) {
    wg_emu_check();
    for (int i = 0; i < 4; ++i) wg_emu_a[threadIdx.x][i] = a[i];
    wg_emu_sync();
    wg_emu_mma<BN, TB, ACC>(d, 0, desc);
    wg_emu_sync();
}
template <int BN, int ACC = 1>
inline void wgmma_ss_n(float (&d)[BN / 2], u64 adesc, u64 bdesc) {
    wg_emu_check();
    wg_emu_sync();
    wg_emu_mma<BN, 0, ACC>(d, adesc, bdesc);
    wg_emu_sync();
}
#endif
