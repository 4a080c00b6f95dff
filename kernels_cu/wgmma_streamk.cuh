// wgmma_streamk.cuh: stream-K for the small-batch Hopper GEMMs (an A/B form, issue 12; nothing in
// production launches it): the work of every output tile, (tile, super-block) units, dealt evenly
// to a grid that fits the GPU at once, instead of one block (or one cluster of KP K-parts) a tile.
//
// Why: at T = 32 a 22016 x 4096 gate|up GEMM is 172 tiles on 132 SMs. 40 SMs run two tiles of 16
// super-blocks each and set the time while 92 run one (docs/perf-log.md Session 31: 30.5 us on
// the H100, the K split in clusters slower still). Here G blocks (the host: as many as the SMs
// hold at once, engine.gpu.ops.wgmma.streamk_grid) each take units u0 .. u1 - 1 of U = tiles x nsb
// (unit u: tile u / nsb, super-block u % nsb; u0 = b U / G), so every SM gets the same number of
// super-blocks to within one.
//
// A block's units cut tiles into segments; each segment runs wgmma_gemm's pipeline (wg_sk_kloop)
// from its own first weights and stages. The segment holding a tile's super-block 0 is the tile's
// owner: it is the last segment of its block, so the other segments of the tile (the first
// segments of the next blocks, run at their start) are normally done when it finishes. A
// non-owner writes its f32 tile to part[its block] (accumulator c of thread x at c * 256 + x,
// coalesced) and adds 1 to flags[tile] (release); the owner waits (acquire) for its count, adds
// the partials in block order (own sums + block b + 1 + block b + 2 ...: the same sum whoever ran
// when), resets the flag for the next launch, and stores as wgmma_gemm's KP = 1 epilogue does
// (plain f32 rows, or SWIGLU's tiled f16 h). Every block must be resident at once (an owner spins
// on later blocks): G <= the blocks the SMs hold, and a spin longer than ~2 s traps rather than
// hangs.
//
// The K loop is wgmma_gemm's (wgmma_common.cuh), kept apart here so production machine code stays
// the GPU-tested one until this form is decided: made production, wgmma_gemm calls wg_sk_kloop;
// retired, this file goes.
#pragma once
#include "wgmma_common.cuh"

// WG_SK_PREFETCH (1; 0 the control): a segment's last super-block loads the next segment's first
// weights (q4_K: formats without per-stage loads), so only a block's first segment waits for DRAM.
#ifndef WG_SK_PREFETCH
#define WG_SK_PREFETCH 1
#endif
// Two blocks an SM at 32-token tiles (at most 128 registers: the deal's G is what the SMs hold).
#define WG_SK_MIN_BLOCKS(BT) ((BT) <= 32 ? 2 : 1)

// wgmma_gemm's K loop over super-blocks sb0 .. sb1 - 1 of rows r0, r1 (cur, st: lane t's first
// registers, loaded; the mbarriers initialized and no copy in flight): acc zeroed, then summed.
// With next0 (WG_SK_PREFETCH, formats without per-stage loads): the last super-block loads
// super-block 0 of rows next0, next1 (the block's next segment) and leaves it in cur.
template <class WT, int BT, int STAGES, int NSLOT>
__device__ __forceinline__ void wg_sk_kloop(float (&acc)[WgTile<BT>::NH][WgTile<BT>::NACC], typename WT::Sb& cur,
                                            typename WT::St (&st)[NSLOT], const u8* r0, const u8* r1, int sb0,
                                            int sb1, const u8* src0, size_t src_step, u32 copy_bytes, u32 s0,
                                            u32 bars, u64 desc0, int t, const u8* next0, const u8* next1) {
    typedef WgTile<BT> Tile;
    constexpr u32 STAGE_BYTES = BT * WG_BK * 2;
    constexpr int RB = STAGES >= 8 ? 4 : 1;
    static_assert(STAGES < 8 || STAGES % 4 == 0, "the super-block refill takes whole super-blocks of buffers");
    const int j0 = 4 * sb0, nst = 4 * (sb1 - sb0);
    if (threadIdx.x == 0)
        for (int l = 0; l < STAGES && l < nst; ++l)
            wg_bulk_stage(s0 + l * STAGE_BYTES, bars + 8 * l, src0 + l * src_step, copy_bytes);
#pragma unroll
    for (int h = 0; h < Tile::NH; ++h)
#pragma unroll
        for (int i = 0; i < Tile::NACC; ++i) acc[h][i] = 0.0f;
    typename WT::Sb nxt;
    typename WT::Sc sc;
    u32 a[4][4];
    for (int sb = sb0; sb < sb1; ++sb) {
        if (sb + 1 < sb1) WT::load(nxt, r0, r1, sb + 1, t);
        else if (next0 != nullptr) WT::load(nxt, next0, next1, 0, t);
        WT::scales(sc, cur, t);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            const int j = sb * 4 + jj;
            const u32 l = (u32)(j - j0), buf = l % STAGES;
            mbar_wait(bars + 8 * buf, (l / STAGES) & 1);
            WT::frags(a, cur, st[jj % NSLOT], jj, sc, t);
            if constexpr (WT::PF > 0) {
                if (l + WT::PF < (u32)nst) WT::load_stage(st[jj % NSLOT], r0, r1, j + WT::PF, t);
            }
            wg_fence();
            wg_issue_stage<BT>(acc, a, wg_desc_add(desc0, buf * STAGE_BYTES));
            wg_commit();
            wg_wait<1>();
            if constexpr (RB == 1) {
                const u32 ln = l - 1 + STAGES;
                __syncthreads();
                if (threadIdx.x == 0 && l >= 1 && ln < (u32)nst) {
                    const u32 bn = ln % STAGES;
                    wg_bulk_stage(s0 + bn * STAGE_BYTES, bars + 8 * bn, src0 + ln * src_step, copy_bytes);
                }
            } else if (jj == 0 && l >= 4 && l + STAGES - 4 < (u32)nst) {
                __syncthreads();
                if (threadIdx.x == 0)
                    for (u32 ln = l + STAGES - 4; ln < l + STAGES && ln < (u32)nst; ++ln) {
                        const u32 bn = ln % STAGES;
                        wg_bulk_stage(s0 + bn * STAGE_BYTES, bars + 8 * bn, src0 + ln * src_step, copy_bytes);
                    }
            }
        }
        cur = nxt;
    }
    wg_wait<0>();
}

// The block holding unit u of U dealt to G blocks (u0(b) = b U / G): the largest b with u0(b) <= u.
__device__ __forceinline__ int wg_sk_block_of(int u, int U, int G) {
    return (int)(((long long)(u + 1) * G - 1) / U);
}

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long wg_globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Stream-K GEMM of one block (module comment): y[T, N] = x . W^T over ntok x N / 128 tiles, or with
// SWIGLU the gate|up GEMM's h into Xo (wgmma_gemm SWIGLU). part: f32 [G][NH NACC][256], flags:
// int [tiles], zero before the first launch (owners leave them zero).
template <class WT, int BT, int STAGES, bool SWIGLU>
__device__ __forceinline__ void wgmma_gemm_sk(const u8* __restrict__ W, const u8* __restrict__ Xt,
                                              float* __restrict__ Y, int T, int N, int K,
                                              float* __restrict__ part, int* __restrict__ flags) {
    extern __shared__ __align__(1024) u8 smem[];
    typedef WgTile<BT> Tile;
    constexpr int NC = Tile::NH * Tile::NACC;                  // accumulators a thread
    constexpr int NSLOT = WT::PF > 0 ? WT::PF : 1;
    static_assert(4 % NSLOT == 0, "WT::PF must divide the 4 stages of a super-block");
    const u32 s0 = smem_u32(smem);
    const u32 bars = s0 + wg_stage_area<BT, STAGES, 1>();
    const u64 desc0 = wg_desc(s0, 128, 1024);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int ngroups = (T + 7) / 8, ntok = (T + BT - 1) / BT;
    const size_t row_bytes = (size_t)(K / 256) * WT::BLOCK_BYTES;
    const size_t src_step = (size_t)ngroups * 1024;
    const int nsb = K / 256, U = ntok * (N / WG_ROWS) * nsb, G = gridDim.x, b = blockIdx.x;
    const int u1 = (int)((long long)(b + 1) * U / G);
    // Lane t's rows of row tile `tile` (wgmma_gemm's r0, r1): a SWIGLU feature's gate and up rows, else rows g, g + 8.
    auto rows = [&](int tile, const u8*& r0, const u8*& r1) {
        const int row = SWIGLU ? tile * (WG_ROWS / 2) + warp * 8 + g : tile * WG_ROWS + warp * 16 + g;
        r0 = W + (size_t)row * row_bytes;
        r1 = r0 + (SWIGLU ? (size_t)(N / 2) : (size_t)8) * row_bytes;
    };
    bool first = true, have = false;                           // have: cur holds the segment's first weights
    typename WT::Sb cur;
    typename WT::St st[NSLOT];
    for (int u = (int)((long long)b * U / G); u < u1;) {
        const int q = u / nsb, sbA = u - q * nsb, sbB = min(nsb, sbA + (u1 - u));
        const int tile = q / ntok, g0 = (q - tile * ntok) * (BT / 8);
        const int row0 = tile * WG_ROWS + warp * 16 + g;
        const int feat = tile * (WG_ROWS / 2) + warp * 8 + g;
        const u8 *r0, *r1, *next0 = nullptr, *next1 = nullptr;
        rows(tile, r0, r1);
        if (!have) wg_load_first<WT, NSLOT>(cur, st, r0, r1, sbA, 4 * sbA, t);
        const int un = u + (sbB - sbA);                        // the next segment: a tile from its start
        if constexpr (WG_SK_PREFETCH && WT::PF == 0) {
            if (un < u1) rows(un / nsb / ntok, next0, next1);
        }
        if (first) pdl_entry();
        else __syncthreads();                                  // every wait of the last segment passed
        if (threadIdx.x == 0) {
#pragma unroll
            for (int i = 0; i < STAGES; ++i) mbar_init(bars + 8 * i, 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
        float acc[Tile::NH][Tile::NACC];
        const u8* src0 = Xt + ((size_t)(4 * sbA) * ngroups + g0) * 1024;
        wg_sk_kloop<WT, BT, STAGES, NSLOT>(acc, cur, st, r0, r1, sbA, sbB, src0, src_step,
                                           (u32)min(BT / 8, ngroups - g0) * 1024, s0, bars, desc0, t, next0, next1);
        have = next0 != nullptr;
        if (sbA != 0) {                                        // not the owner: the partial tile out
            float* slot = part + (size_t)b * NC * WG_THREADS + threadIdx.x;
#pragma unroll
            for (int h = 0; h < Tile::NH; ++h)
#pragma unroll
                for (int i = 0; i < Tile::NACC; ++i) slot[(h * Tile::NACC + i) * WG_THREADS] = acc[h][i];
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence();
                red_release_gpu_add(flags + q, 1);
            }
        } else {
            const int last = wg_sk_block_of((q + 1) * nsb - 1, U, G);   // the tile's last block
            if (last > b) {
                if (threadIdx.x == 0) {
                    const unsigned long long t_start = wg_globaltimer();
                    while (ld_acquire_gpu(flags + q) < last - b) {
                        __nanosleep(64);
                        if (wg_globaltimer() - t_start > 2000000000ull) __trap();   // a block never came
                    }
                    flags[q] = 0;                              // for the next launch (stream order)
                }
                __syncthreads();
                for (int p = b + 1; p <= last; ++p) {            // block order: the sum is fixed
                    const float* slot = part + (size_t)p * NC * WG_THREADS + threadIdx.x;
#pragma unroll
                    for (int h = 0; h < Tile::NH; ++h)
#pragma unroll
                        for (int i = 0; i < Tile::NACC; ++i) acc[h][i] += __ldcg(slot + (h * Tile::NACC + i) * WG_THREADS);
                }
            }
            // wgmma_gemm's KP = 1 epilogue. acc[h][4 i + e]: row g + 8 (e >> 1), token BN h + 8 i + 2 t + (e & 1)
            const int tok0 = g0 * 8;
#pragma unroll
            for (int h = 0; h < Tile::NH; ++h)
#pragma unroll
                for (int i = 0; i < Tile::NACC / 4; ++i)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int tok = tok0 + Tile::BN * h + 8 * i + 2 * t + (e & 1);
                        if constexpr (SWIGLU) {
                            if (e < 2)
                                wg_store_pair(reinterpret_cast<u16*>(Y), tok, feat, ngroups,
                                              wg_swiglu_h(acc[h][4 * i + e], acc[h][4 * i + e + 2]), tok < T);
                        } else if (tok < T) {
                            Y[(size_t)tok * N + row0 + 8 * (e >> 1)] = acc[h][4 * i + e];
                        }
                    }
        }
        u = un;
        first = false;
    }
    if (first) pdl_entry();                                    // no units (the host keeps G <= U)
}
