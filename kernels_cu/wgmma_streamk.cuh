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
// One pipeline a block: its units are one run of 4 nu stages through the activation ring (stage
// L: part L % 4 of unit u0 + L / 4, wherever that unit's tile and super-block are), the weights
// one unit ahead across tile boundaries, so a block fills its pipeline once, as wgmma_gemm does.
// Where the run crosses a tile's end the block closes a segment: every wgmma retired, then
// - the segment that holds the tile's super-block 0 owns the tile. It is its block's last segment
//   unless the tile is whole in the block, so the tile's other segments (the first segments of
//   the next blocks, run at their start) are normally done by then. It waits (acquire) for their
//   count, adds their partials in block order (own sums + block b + 1 + ...: the same sum
//   whoever ran when), resets the count for the next launch and stores as wgmma_gemm's KP = 1
//   epilogue does (plain f32 rows, or SWIGLU's tiled f16 h);
// - any other segment (always its block's first) writes its f32 tile to part[its block]
//   (accumulator c of thread x at c * 256 + x, coalesced) and adds 1 to flags[tile] (release).
// Every block must be resident at once (an owner spins on later blocks): G <= the blocks the SMs
// hold, and a spin longer than ~2 s traps rather than hangs.
//
// The loop is wgmma_gemm's (wgmma_common.cuh) with the stage's source and rows taken per unit; it
// is kept apart so production machine code stays the GPU-tested one until this form is decided.
#pragma once
#include "wgmma_common.cuh"

// Two blocks an SM at 32-token tiles (at most 128 registers: the deal's G is what the SMs hold).
#define WG_SK_MIN_BLOCKS(BT) ((BT) <= 32 ? 2 : 1)

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

// Stream-K GEMM of block b of a deal of G blocks (module comment): y[T, N] = x . W^T over ntok x
// N / 128 tiles, or with SWIGLU the gate|up GEMM's h into Xo, or with ROPE the q|k|v GEMM's
// rope.cu outputs (wgmma_gemm's SWIGLU, ROPE). part: f32 [G][NH NACC][256], flags: int [tiles],
// zero before the first launch (owners leave them zero). A launch may hold two deals (the pair:
// its wrapper gives each its blocks, part and flags; ROPE: the second's rows from rope_row0 on).
template <class WT, int BT, int STAGES, bool SWIGLU, bool ROPE = false>
__device__ __forceinline__ void wgmma_gemm_sk(const u8* __restrict__ W, const u8* __restrict__ Xt,
                                              float* __restrict__ Y, int T, int N, int K,
                                              float* __restrict__ part, int* __restrict__ flags, int b, int G,
                                              const WgRope* rope = nullptr, int rope_row0 = 0) {
    extern __shared__ __align__(1024) u8 smem[];
    typedef WgTile<BT> Tile;
    constexpr u32 STAGE_BYTES = BT * WG_BK * 2;
    constexpr int NC = Tile::NH * Tile::NACC;                  // accumulators a thread
    constexpr int NSLOT = WT::PF > 0 ? WT::PF : 1;
    constexpr int RB = STAGES >= 8 ? 4 : 1;                    // buffers refilled together (wgmma_gemm)
    static_assert(4 % NSLOT == 0, "WT::PF must divide the 4 stages of a super-block");
    static_assert(STAGES < 8 || STAGES % 4 == 0, "the super-block refill takes whole super-blocks of buffers");
    const u32 s0 = smem_u32(smem);
    const u32 bars = s0 + wg_stage_area<BT, STAGES, 1>();
    const u64 desc0 = wg_desc(s0, 128, 1024);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int ngroups = (T + 7) / 8, ntok = (T + BT - 1) / BT;
    const size_t row_bytes = (size_t)(K / 256) * WT::BLOCK_BYTES;
    const int nsb = K / 256, U = ntok * (N / WG_ROWS) * nsb;
    int rp0 = 0, rstep = 8;                                    // ROPE: the pair's first local row, lr1 - lr0
    if constexpr (ROPE) wg_rope_rows(*rope, warp, g, rp0, rstep);
    const int u0 = (int)((long long)b * U / G), nu = (int)((long long)(b + 1) * U / G) - u0;
    const int nst = 4 * nu;                                    // the block's stages
    // A unit and what it needs, stepped one unit at a time (divisions only where the tile changes):
    // its tile q, super-block sb, token group g0 and lane t's rows r0, r1 (wgmma_gemm's: a SWIGLU
    // feature's gate and up rows, a ROPE pair's two rows, else rows g and g + 8).
    struct Unit {
        int q, sb, g0;
        const u8 *r0, *r1;
    };
    auto at_tile = [&](Unit& c) {
        const int tile = c.q / ntok;
        const int row = SWIGLU ? tile * (WG_ROWS / 2) + warp * 8 + g
                              : tile * WG_ROWS + (ROPE ? rp0 : warp * 16 + g);
        c.r0 = W + (size_t)row * row_bytes;
        c.r1 = c.r0 + (SWIGLU ? (size_t)(N / 2) : (size_t)rstep) * row_bytes;
        c.g0 = (c.q - tile * ntok) * (BT / 8);
    };
    auto next_unit = [&](Unit& c) {
        if (++c.sb == nsb) {
            c.sb = 0;
            ++c.q;
            at_tile(c);
        }
    };
    Unit first{u0 / nsb, u0 % nsb, 0, nullptr, nullptr};
    at_tile(first);
    // Thread 0's copy cursor: the stages go out in order (stage L: part L % 4 of the block's unit
    // L / 4), from c_src, c_bytes; c_left: the parts left in the cursor's tile.
    const size_t src_step = (size_t)ngroups * 1024;
    const u8* c_src = Xt + ((size_t)(4 * first.sb) * ngroups + first.g0) * 1024;
    u32 c_bytes = (u32)min(BT / 8, ngroups - first.g0) * 1024;
    int c_left = 4 * (nsb - first.sb), c_q = first.q;
    auto copy_next = [&](int L) {
        const u32 buf = (u32)L % STAGES;
        wg_bulk_stage(s0 + buf * STAGE_BYTES, bars + 8 * buf, c_src, c_bytes);
        c_src += src_step;
        if (--c_left == 0) {                                   // the next tile, from its first stage
            c_left = 4 * nsb;
            const int g0 = ntok == 1 ? 0 : (++c_q % ntok) * (BT / 8);
            c_src = Xt + (size_t)g0 * 1024;
            c_bytes = (u32)min(BT / 8, ngroups - g0) * 1024;
        }
    };

    typename WT::Sb cur, nxt;
    typename WT::St st[NSLOT];
    if (nu > 0)                                                // before the PDL wait, as wgmma_gemm
        wg_load_first<WT, NSLOT>(cur, st, first.r0, first.r1, first.sb, 4 * first.sb, t);
    pdl_entry();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) mbar_init(bars + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int L = 0; L < STAGES && L < nst; ++L) copy_next(L);
    // The per-stage weights of formats with them (q6_K): stage L + PF, in order, from the cursor pc.
    Unit pc = first;
    int p_part = 0;
    for (int i = 0; i < WT::PF; ++i)
        if (++p_part == 4) {
            p_part = 0;
            next_unit(pc);
        }

    float acc[Tile::NH][Tile::NACC];
#pragma unroll
    for (int h = 0; h < Tile::NH; ++h)
#pragma unroll
        for (int i = 0; i < Tile::NACC; ++i) acc[h][i] = 0.0f;
    typename WT::Sc sc;
    u32 a[4][4];
    bool owner = first.sb == 0;                                // the open segment holds its tile's super-block 0
    Unit seg = first;                                          // the open segment's tile and first super-block
    for (int k = 0; k < nu;) {                                 // k: the block's units done
        const int q = seg.q, sb_end = seg.sb + min(nsb - seg.sb, nu - k);
        const int L0 = 4 * (k - seg.sb);                      // stage L of super-block sb, part jj: L0 + 4 sb + jj
        for (int sb = seg.sb; sb < sb_end; ++sb) {
            if (sb + 1 < sb_end) {
                WT::load(nxt, seg.r0, seg.r1, sb + 1, t);
            } else if (sb_end - seg.sb + k < nu) {                 // across the tile's end: the next tile's first
                Unit after{q + 1, 0, 0, nullptr, nullptr};
                at_tile(after);
                WT::load(nxt, after.r0, after.r1, 0, t);
            }
            WT::scales(sc, cur, t);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const int L = L0 + 4 * sb + jj;
                const u32 buf = (u32)L % STAGES;
                mbar_wait(bars + 8 * buf, ((u32)L / STAGES) & 1);
                WT::frags(a, cur, st[jj % NSLOT], jj, sc, t);
                if constexpr (WT::PF > 0) {                        // the slot is free: stage L + PF into it
                    if (L + WT::PF < nst) {
                        WT::load_stage(st[jj % NSLOT], pc.r0, pc.r1, 4 * pc.sb + p_part, t);
                        if (++p_part == 4) {
                            p_part = 0;
                            next_unit(pc);
                        }
                    }
                }
                wg_fence();
                {                                                  // wg_issue_stage, the segment's first step fresh
                    const u64 dbuf = wg_desc_add(desc0, buf * STAGE_BYTES);
                    const int fresh = sb == seg.sb && jj == 0;
#pragma unroll
                    for (int s4 = 0; s4 < 4; ++s4)
#pragma unroll
                        for (int h = 0; h < Tile::NH; ++h)
                            wgmma_n_fresh<Tile::BN>(acc[h], a[s4],
                                                    wg_desc_add(dbuf, h * (Tile::BN / 8) * 1024 + s4 * 256),
                                                    s4 == 0 && fresh);
                }
                wg_commit();
                wg_wait<1>();
                if constexpr (RB == 1) {
                    __syncthreads();                               // buffer of stage L - 1 retired by both warpgroups
                    if (threadIdx.x == 0 && L >= 1 && L - 1 + STAGES < nst) copy_next(L - 1 + STAGES);
                } else if (jj == 0 && L >= 4 && L + STAGES - 4 < nst) {
                    __syncthreads();                               // the last unit's 4 buffers retired
                    if (threadIdx.x == 0)
                        for (int Ln = L + STAGES - 4; Ln < L + STAGES && Ln < nst; ++Ln) copy_next(Ln);
                }
            }
            cur = nxt;
        }
        k += sb_end - seg.sb;
        // ---- the segment ends: tile q
        wg_wait<0>();
        if (!owner) {                                          // the partial tile out
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
                    const unsigned long long t_start = globaltimer_ns();
                    while (ld_acquire_gpu(flags + q) < last - b) {
                        __nanosleep(64);
                        if (globaltimer_ns() - t_start > 2000000000ull) __trap();   // a block never came
                    }
                    flags[q] = 0;                              // for the next launch (stream order)
                }
                __syncthreads();
            }
            float v[Tile::NH][Tile::NACC];                     // the tile's sums (acc stays the wgmmas' own)
#pragma unroll
            for (int h = 0; h < Tile::NH; ++h)
#pragma unroll
                for (int i = 0; i < Tile::NACC; ++i) v[h][i] = acc[h][i];
            for (int p = b + 1; p <= last; ++p) {                // block order: the sum is fixed
                const float* slot = part + (size_t)p * NC * WG_THREADS + threadIdx.x;
#pragma unroll
                for (int h = 0; h < Tile::NH; ++h)
#pragma unroll
                    for (int i = 0; i < Tile::NACC; ++i) v[h][i] += __ldcg(slot + (h * Tile::NACC + i) * WG_THREADS);
            }
            // wgmma_gemm's KP = 1 epilogue. acc[h][4 i + e]: row g + 8 (e >> 1), token BN h + 8 i + 2 t + (e & 1)
            const int tile = q / ntok, tok0 = (q - tile * ntok) * BT;
            const int row0 = tile * WG_ROWS + warp * 16 + g, feat = tile * (WG_ROWS / 2) + warp * 8 + g;
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
                                              wg_swiglu_h(v[h][4 * i + e], v[h][4 * i + e + 2]), tok < T);
                        } else if constexpr (ROPE) {
                            if (e < 2 && tok < T)
                                wg_rope_store(*rope, rope_row0 + tile * WG_ROWS + rp0, rstep, tok, T, v[h][4 * i + e],
                                              v[h][4 * i + e + 2]);
                        } else if (tok < T) {
                            Y[(size_t)tok * N + row0 + 8 * (e >> 1)] = v[h][4 * i + e];
                        }
                    }
        }
        owner = true;                                          // every later segment starts a tile
        seg.q = q + 1;
        seg.sb = 0;
        if (k < nu) at_tile(seg);
    }
}
