// wgmma_common.cuh: the Hopper (sm_90a) prefill GEMM pipeline shared by every weight format,
// y[T, N] = x[T, K] . W[N, K]^T with W dequantized to f16 in registers (the A operand of
// wgmma.m64nBNk16, BN = min(BT, 128) tokens, f32 accumulation over the block's K range) and x in
// f16 from shared memory (the B operand). Issues 14 (route (b)) and 12 (small batches). A weight format is a policy WT (wgmma_q4_k.cu, wgmma_q6_k.cu):
//   WT::BLOCK_BYTES                       bytes of one 256-element super-block in a row
//   WT::Sb, WT::load(sb, r0, r1, b, t)   lane t's registers of super-block b of rows r0, r1
//   WT::Sc, WT::scales(sc, sb, t)        their f16x2 scale operands
//   WT::PF, WT::St, WT::load_stage(st, r0, r1, j, t)
//                                        lane t's registers of pipeline stage j (part j % 4 of
//                                        super-block j / 4), loaded PF stages ahead into a ring of
//                                        PF slots (PF = 1, 2 or 4), for formats too large to hold
//                                        a super-block twice (q6_K); PF = 0: none (empty St)
//   WT::frags(a, sb, st, jj, sc, t)      k16 steps 4 jj .. 4 jj + 3 of lane t's A fragment (st: the
//                                        stage's slot)
//
// A fragment (as mma.m16n8k16: warp v of a warpgroup owns rows 16v..16v+15; lane (g, t) =
// (lane / 4, lane % 4) holds rows g and g+8, k columns 2t, 2t+1, 2t+8, 2t+9 of each k16 step;
// register r of step s: row g + 8 (r & 1), columns 2t + 8 (r >> 1) + {0, 1}). Every format
// fills it from the same activation order: lane t owns the super-block's elements 64t..64t+63,
// and word m (m = 0..7) of its element bytes j = 4m..4m+3 feeds steps 2m (elements 64t + j) and
// 2m+1 (elements 64t + 32 + j): step 2m: cols 2t+e <- element byte 4m+2e, cols 2t+8+e <- byte
// 4m+1+2e. So logical k L = 16 s + c of a super-block holds element P(L) (x16_tiles.cuh wg_perm,
// engine.reference.wgmma.k_permutation): s = 2m + hi, c = 2t + 8 f + e ->
//   P = 64 t + 32 hi + 4 m + f + 2 e.
//
// Activations Xt f16 [K/64, ceil(T/8), 8, 8, 8]: 64-k block, token group, 8-k chunk, token, k in
// the permuted order, tokens past T zero (wgmma_act.cu writes it), so one stage (BT tokens x 64 k)
// is BT / 8 x 1,024 contiguous bytes laid out as shared memory wants them: wgmma's no-swizzle
// K-major core matrices (8 tokens x 16 bytes, 128 contiguous bytes), byte of (token n, k) =
//   (n / 8) * 1024 + (k / 8) * 128 + (n % 8) * 16 + (k % 8) * 2.
// Descriptor: LBO (next 8 k) = 128 B, SBO (next 8 tokens) = 1024 B; k16 step s starts at 256 s.
//
// Grid: x = token tile of BT, y = 128-row tile, z = K part (KP > 1: clusters of the KP parts of
// one tile, summed at the end; wgmma_gemm); 256 threads = 2 warpgroups x 64 rows. Blocks in
// launch order take WG_RASTER (4) token tiles at a time across every row tile (wg_block_tiles):
// the blocks in flight share few weight rows (each row tile read from DRAM a few times) and the
// activations of 4 token tiles (8 MB at BT 256, K 4096). Token tile fastest over all of them
// (WG_RASTER=0, an A/B define) made every wave read all 33.5 MB of a 4,096-token ubatch's
// activations, which L2 (50 MB) did not keep beside the weights and the output (H100,
// docs/perf-log.md Session 26: the raster gives pp8192 +1.8-2.5%, pp3314 +0.1-1.9%).
// Pipeline: STAGES buffers, each filled by one cp.async.bulk copy (async proxy, completion
// counted in bytes on the buffer's mbarrier), STAGES - 1 stages ahead. Each warpgroup waits for
// stage j's mbarrier, builds its A fragments while its wgmmas of stage j - 1 run, issues stage j,
// waits for stage j - 1 (wgmma.wait_group 1); after a barrier of both warpgroups thread 0 refills
// buffer j - 1 (with STAGES >= 8: the 4 buffers of the last super-block, once a super-block,
// wgmma_gemm's RB). No proxy fence in the loop: with 16-byte cp.async (generic proxy) every stage
// needs fence.proxy.async, whose MEMBAR also waits for the weight loads in flight, and that
// pipeline measured 10-25% slower (docs/perf-log.md, Session 12). Weights stream
// register-direct, one super-block ahead (Sb), or per stage PF stages ahead (St; q6_K).
#pragma once
#include "common.cuh"
#include "f16x2.cuh"
#include "x16_tiles.cuh"
#include "wgmma_ops.cuh"
#include "wgmma_rope.cuh"

// WG_TIMELINE (a diagnostic define, 0 in production): thread 0 of each block records the GEMM's
// phases into wg_timeline[linear block id][WG_TL_SLOTS], read back by dev/wg_timeline.py: entry,
// after the PDL wait, stages issued, the first super-block's weights in use, its stage 0 landed,
// the first super-block done, the K loop done (after the last wgmma), with a K split (KP > 1) the
// partial tiles visible (after the first cluster barrier) and this part's sums stored, exit (the
// host fills the two K-split phases of an unsplit GEMM with its loop's end). Each phase is stamped
// twice: %globaltimer (ns, one clock for all SMs: the blocks side by side) in slot phase, and
// clock64 (the SM's cycles, exact: the phases of one block) in slot WG_TL_PHASES + phase; then
// %smid. A stamp that follows a value branches on it first (wg_tl_after), so it cannot be taken
// before the value has arrived.
#ifndef WG_TIMELINE
#define WG_TIMELINE 0
#endif
#if WG_TIMELINE
#define WG_TL_BLOCKS 8192
#define WG_TL_SLOTS 24
enum { WG_TL_ENTRY, WG_TL_PDL, WG_TL_ISSUED, WG_TL_WEIGHTS0, WG_TL_STAGE0, WG_TL_SB0, WG_TL_LOOP, WG_TL_EPI_SYNC,
       WG_TL_EPI_SUM, WG_TL_EXIT, WG_TL_PHASES };
#define WG_TL_SMID (2 * WG_TL_PHASES)
__device__ unsigned long long wg_timeline[WG_TL_BLOCKS * WG_TL_SLOTS];
__device__ __forceinline__ void wg_tl(int slot) {
    const u32 b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (threadIdx.x != 0 || b >= WG_TL_BLOCKS) return;
    unsigned long long* row = wg_timeline + (size_t)b * WG_TL_SLOTS;
    const unsigned long long t = globaltimer_ns();
    unsigned long long c;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) :: "memory");
    row[slot] = t;
    row[WG_TL_PHASES + slot] = c;
    if (slot == WG_TL_ENTRY) {
        u32 sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        row[WG_TL_SMID] = sm;
    }
}
__device__ __forceinline__ void wg_tl_after(int slot, u32 dep) {
    if (dep != 0xFFFFFFFFu) wg_tl(slot);
}
#else
#define wg_tl(slot) ((void)0)
#define wg_tl_after(slot, dep) ((void)0)
#endif

#define WG_BK 64                       // k per activation stage
#define WG_ROWS 128                    // weight rows per block (2 warpgroups x 64)
#define WG_THREADS 256
#ifndef WG_RASTER
#define WG_RASTER 4                    // token tiles per raster group (0: token tile = blockIdx.x)
#endif

// This block's (token tile, row tile): (blockIdx.x, blockIdx.y), or with WG_RASTER = G launch
// position L = x + y * nx taken G token tiles at a time: group L / (G ny) holds token tiles
// G (L / (G ny)) .. + gs - 1 (gs = G, fewer in the last group), row tile = (L % (G ny)) / gs.
// The z (K part) of a cluster is left alone, so a cluster's parts keep one output tile.
struct WgTiles { int tok, row; };
__device__ __forceinline__ WgTiles wg_block_tiles() {
#if WG_RASTER > 0
    const int nx = gridDim.x, ny = gridDim.y;
    if (nx > WG_RASTER) {
        const int L = blockIdx.x + blockIdx.y * nx, span = WG_RASTER * ny;
        const int first = L / span * WG_RASTER, gs = min(WG_RASTER, nx - first), w = L % span;
        return {first + w % gs, w / gs};
    }
#endif
    return {(int)blockIdx.x, (int)blockIdx.y};
}


__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
// bytes (multiple of 16) global -> shared through the async proxy, counted on mbarrier bar.
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}



// Tokens per wgmma (BN) and wgmmas per k16 step (NH) of a BT-token tile.
template <int BT>
struct WgTile {
    static_assert(BT == 32 || BT == 64 || BT == 128 || BT == 256, "BT: 32, 64, 128 or 256");
    enum { BN = BT < 128 ? BT : 128, NH = BT / BN, NACC = BN / 2 };
};

// The stage's 4 k16 steps x NH token halves; dbuf: the descriptor of the stage buffer.
template <int BT>
__device__ __forceinline__ void wg_issue_stage(float (&acc)[WgTile<BT>::NH][WgTile<BT>::NACC], const u32 (&a)[4][4],
                                               u64 dbuf) {
    constexpr int BN = WgTile<BT>::BN;
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int h = 0; h < WgTile<BT>::NH; ++h)
            wgmma_n<BN>(acc[h], a[s], wg_desc_add(dbuf, h * (BN / 8) * 1024 + s * 256));
}

// Thread-block clusters (the K-parts of one output tile, wgmma_gemm with KP > 1).
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// f32 at shared address `addr` of this CTA's layout, in cluster CTA `rank` (distributed shared memory).
__device__ __forceinline__ float ld_dsmem_f32(u32 addr, u32 rank) {
    u32 remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// Thread 0: one stage's token groups in one copy from src (Xt's 64-k block of the stage, token
// group g0: Xt + ((k0 / 64) * ngroups + g0) * 1024); `bytes`: the groups up to the last one
// (the columns past it are never stored).
__device__ __forceinline__ void wg_bulk_stage(u32 sbuf, u32 bar, const u8* src, u32 bytes) {
    mbar_arrive_expect_tx(bar, bytes);
    bulk_g2s(sbuf, src, bytes, bar);
}

// Lane t's registers of the block's first super-block sb0 (and with WT::PF > 0 its first PF
// stages, j0 = 4 sb0 on): nst >= 4, the host keeps KP <= K / 256.
template <class WT, int NSLOT>
__device__ __forceinline__ void wg_load_first(typename WT::Sb& cur, typename WT::St (&st)[NSLOT], const u8* r0,
                                              const u8* r1, int sb0, int j0, int t) {
    WT::load(cur, r0, r1, sb0, t);
    if constexpr (WT::PF > 0) {
#pragma unroll
        for (int p = 0; p < WT::PF; ++p) WT::load_stage(st[p], r0, r1, j0 + p, t);   // PF <= 4 <= nst
    }
}

// Dynamic shared memory of wgmma_gemm<_, BT, STAGES, KP> (engine.gpu.ops.wgmma.smem_bytes mirrors it):
// the stage buffers (with KP > 1 at least the BT * 512 bytes of the partial tile that reuses
// them after the K loop), then one 8-byte mbarrier per stage.
template <int BT, int STAGES, int KP>
constexpr u32 wg_stage_area() {
    return (KP > 1 && BT * 512 > STAGES * BT * WG_BK * 2) ? BT * 512 : STAGES * BT * WG_BK * 2;
}

// The whole GEMM of one block, output rows 128 tile .. 128 tile + 127 (the __global__ wrappers call
// it first: it makes the PDL wait itself; tile = wg_block_tiles().row, or a tile of one of two
// matrices: wgmma_pair.cu). KP = 1: the block runs all of K. KP > 1: the grid's z = K-part,
// launched as clusters of KP blocks along z (__cluster_dims__ on the wrapper): part p runs
// super-blocks nsb p / KP .. nsb (p + 1) / KP - 1, then the parts add their f32 tiles through
// distributed shared memory, part 0 + part 1 + ... in that order whoever sums (so the result does
// not depend on timing), each block summing and storing every KP-th accumulator.
//
// SWIGLU (the gate|up GEMM's fused epilogue): W = [gate; up], N = 2 F rows; the block's 128 rows
// are features 64 tile .. 64 tile + 63 of both halves (warp v's rows g: gate 8 v + g, g + 8: up
// 8 v + g), and Y is the down GEMM's tiled f16 operand Xo of F columns (x16_tiles.cuh), not f32:
// Xo = tiled f16 of h = silu(gate) * up (wg_swiglu_h), the bits swiglu_x16 makes of this GEMM's
// f32 output, tokens < T stored. Each of a KP > 1 cluster's parts sums both halves of its pairs.
template <class WT, int BT, int STAGES, int KP = 1, bool SWIGLU = false, bool ROPE = false>
__device__ __forceinline__ void wgmma_gemm(const u8* __restrict__ W, const u8* __restrict__ Xt,
                                           float* __restrict__ Y, int T, int N, int K, int tile,
                                           const WgRope* rope = nullptr) {
    extern __shared__ __align__(1024) u8 smem[];
    typedef WgTile<BT> Tile;
    const u32 s0 = smem_u32(smem);
    constexpr u32 STAGE_BYTES = BT * WG_BK * 2;
    const u32 bars = s0 + wg_stage_area<BT, STAGES, KP>();      // one 8-byte mbarrier per buffer
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = tile * WG_ROWS + warp * 16 + g;       // warpgroup wg: warps 4wg..4wg+3
    const int g0 = wg_block_tiles().tok * (BT / 8), ngroups = (T + 7) / 8;
    const size_t row_bytes = (size_t)(K / 256) * WT::BLOCK_BYTES;
    const int feat = tile * (WG_ROWS / 2) + warp * 8 + g;   // SWIGLU: this thread's gate / up feature
    int rp0 = 0, rstep = 8;                                 // ROPE: the pair's first local row, lr1 - lr0
    if constexpr (ROPE) wg_rope_rows(*rope, warp, g, rp0, rstep);
    const u8* r0 = W + (size_t)(SWIGLU ? feat : ROPE ? tile * WG_ROWS + rp0 : row0) * row_bytes;
    const u8* r1 = r0 + (SWIGLU ? (size_t)(N / 2) : (size_t)rstep) * row_bytes;
    const int nsb_all = K / 256;
    const int sb0 = KP > 1 ? (int)(blockIdx.z * nsb_all / KP) : 0;
    const int sb1 = KP > 1 ? (int)((blockIdx.z + 1) * nsb_all / KP) : nsb_all;
    const int j0 = 4 * sb0, nst = 4 * (sb1 - sb0);              // this block's stages j0 .. j0 + nst - 1
    // Stage l (local) of Xt: src0 + l * src_step; its buffer l % STAGES (unsigned: l >= 0).
    const u8* src0 = Xt + ((size_t)j0 * ngroups + g0) * 1024;
    const size_t src_step = (size_t)ngroups * 1024;
    const u32 copy_bytes = (u32)min(BT / 8, ngroups - g0) * 1024;
    const u64 desc0 = wg_desc(s0, 128, 1024);                   // buffer b: + b * STAGE_BYTES

    constexpr int NSLOT = WT::PF > 0 ? WT::PF : 1;  // stage j lives in slot j % NSLOT = jj % NSLOT
    static_assert(4 % NSLOT == 0, "WT::PF must divide the 4 stages of a super-block");
    // The first weights before the PDL wait (a weight: no predecessor writes it; the wrappers
    // leave the wait to here), so their DRAM latency overlaps the end of the kernel before this
    // one, whose grid must still complete (no early trigger: PDL_EARLY, retired). H200:
    // pp128 +0.3..+1.6%, pp3314 / pp8192 +0..+1% (docs/perf-log.md Session 28).
    typename WT::Sb cur, nxt;
    typename WT::St st[NSLOT];
    wg_tl(WG_TL_ENTRY);
    wg_load_first<WT, NSLOT>(cur, st, r0, r1, sb0, j0, t);
    pdl_entry();
    wg_tl(WG_TL_PDL);
    if (threadIdx.x == 0) {
#pragma unroll
        for (int b = 0; b < STAGES; ++b) mbar_init(bars + 8 * b, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int l = 0; l < STAGES && l < nst; ++l)
            wg_bulk_stage(s0 + l * STAGE_BYTES, bars + 8 * l, src0 + l * src_step, copy_bytes);
    wg_tl(WG_TL_ISSUED);

    float acc[Tile::NH][Tile::NACC];
#pragma unroll
    for (int h = 0; h < Tile::NH; ++h)
#pragma unroll
        for (int i = 0; i < Tile::NACC; ++i) acc[h][i] = 0.0f;

    typename WT::Sc sc;
    u32 a[4][4];
    // Refills: STAGES < 8, each stage's buffer once both warpgroups retired it (a block barrier a
    // stage); STAGES >= 8 (registry.wgmma_stages: token tiles <= 64), the 4 buffers of a
    // super-block together at the next super-block's first stage (a barrier a super-block), each
    // refilled stage STAGES - 4 .. STAGES - 1 stages ahead of its use.
    constexpr int RB = STAGES >= 8 ? 4 : 1;
    static_assert(STAGES < 8 || STAGES % 4 == 0, "the super-block refill takes whole super-blocks of buffers");
    for (int sb = sb0; sb < sb1; ++sb) {
        if (sb + 1 < sb1) WT::load(nxt, r0, r1, sb + 1, t);
        WT::scales(sc, cur, t);
        if (sb == sb0) wg_tl_after(WG_TL_WEIGHTS0, sc.v[0][0]);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            const int j = sb * 4 + jj;                                  // global stage
            const u32 l = (u32)(j - j0), buf = l % STAGES;              // local stage, its buffer
            mbar_wait(bars + 8 * buf, (l / STAGES) & 1);                // stage l landed
            if (l == 0) wg_tl(WG_TL_STAGE0);
            WT::frags(a, cur, st[jj % NSLOT], jj, sc, t);
            if constexpr (WT::PF > 0) {                // the slot is free: stage j + PF into it
                if (l + WT::PF < (u32)nst) WT::load_stage(st[jj % NSLOT], r0, r1, j + WT::PF, t);
            }
            wg_fence();
            wg_issue_stage<BT>(acc, a, wg_desc_add(desc0, buf * STAGE_BYTES));
            wg_commit();
            wg_wait<1>();                              // stage l - 1 retired in this warpgroup
            if constexpr (RB == 1) {
                const u32 ln = l - 1 + STAGES;         // refill buffer l - 1 once both warpgroups retired it
                __syncthreads();
                if (threadIdx.x == 0 && l >= 1 && ln < (u32)nst) {
                    const u32 bn = ln % STAGES;
                    wg_bulk_stage(s0 + bn * STAGE_BYTES, bars + 8 * bn, src0 + ln * src_step, copy_bytes);
                }
            } else if (jj == 0 && l >= 4 && l + STAGES - 4 < (u32)nst) {   // uniform over the block
                __syncthreads();                       // the last super-block's stages l - 4 .. l - 1 retired
                if (threadIdx.x == 0)
                    for (u32 ln = l + STAGES - 4; ln < l + STAGES && ln < (u32)nst; ++ln) {
                        const u32 bn = ln % STAGES;
                        wg_bulk_stage(s0 + bn * STAGE_BYTES, bars + 8 * bn, src0 + ln * src_step, copy_bytes);
                    }
            }
        }
        cur = nxt;
        if (sb == sb0) wg_tl(WG_TL_SB0);
    }
    wg_wait<0>();
    wg_tl_after(WG_TL_LOOP, __float_as_uint(acc[0][0]));

    // acc[h][4 i + e]: row g + 8 (e >> 1), token BN h + 8 i + 2 t + (e & 1)
    const int tok0 = g0 * 8;
    // SWIGLU / ROPE: each accumulator pair (4 i + e, 4 i + e + 2), e < 2, of token half h (rows g and
    // g + 8: gate and up of a feature, or the two elements of a RoPE pair); gu(h, i, e, a, b) gives
    // the pair's sums, or false where another K part stores it. SWIGLU: h into Xo; ROPE:
    // wg_rope_store.
    auto pair_store = [&](auto gu) {
#pragma unroll
        for (int h = 0; h < Tile::NH; ++h)
#pragma unroll
            for (int i = 0; i < Tile::NACC / 4; ++i)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float vg, vu;
                    if (!gu(h, i, e, vg, vu)) continue;                  // uniform over the block
                    const int tok = tok0 + Tile::BN * h + 8 * i + 2 * t + e;
                    if constexpr (ROPE) {
                        if (tok < T) wg_rope_store(*rope, tile * WG_ROWS + rp0, rstep, tok, T, vg, vu);
                    } else {
                        wg_store_pair(reinterpret_cast<u16*>(Y), tok, feat, ngroups, wg_swiglu_h(vg, vu), tok < T);
                    }
                }
    };
    // Plain outputs (K split): accumulator c = h NACC + i (row g + 8 ((i >> 1) & 1), token BN h +
    // 8 (i >> 2) + 2 t + (i & 1)) into Y; sum(c, y) gives its sum, or false where another part stores it.
    auto plain_store = [&](auto sum) {
#pragma unroll
        for (int h = 0; h < Tile::NH; ++h)
#pragma unroll
            for (int i = 0; i < Tile::NACC; ++i) {
                float y;
                if (!sum(h * Tile::NACC + i, y)) continue;              // uniform over the block
                const int tok = tok0 + Tile::BN * h + 8 * (i >> 2) + 2 * t + (i & 1);
                if (tok < T) Y[(size_t)tok * N + row0 + 8 * ((i >> 1) & 1)] = y;
            }
    };
    if constexpr ((SWIGLU || ROPE) && KP == 1) {
        pair_store([&](int h, int i, int e, float& vg, float& vu) {
            vg = acc[h][4 * i + e];
            vu = acc[h][4 * i + e + 2];
            return true;
        });
    } else if constexpr (KP == 1) {
#pragma unroll
        for (int h = 0; h < Tile::NH; ++h)
#pragma unroll
            for (int i = 0; i < Tile::NACC / 4; ++i)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int tok = tok0 + Tile::BN * h + 8 * i + 2 * t + (e & 1);
                    if (tok < T) Y[(size_t)tok * N + row0 + 8 * (e >> 1)] = acc[h][4 * i + e];
                }
    } else {
        // Partial tile over the stage buffers (every stage consumed: no copy in flight), accumulator
        // c of thread x at float c * WG_THREADS + x; accumulator c of the tile is summed by part c % KP.
        float* part = (float*)smem;
        __syncthreads();                               // the other warpgroup's wgmmas read the buffers
#pragma unroll
        for (int h = 0; h < Tile::NH; ++h)
#pragma unroll
            for (int i = 0; i < Tile::NACC; ++i) part[(h * Tile::NACC + i) * WG_THREADS + threadIdx.x] = acc[h][i];
        cluster_sync();                                // every part's tile written and visible
        wg_tl(WG_TL_EPI_SYNC);
        const u32 rank = cluster_rank();
        if constexpr (SWIGLU || ROPE) {
            pair_store([&](int h, int i, int e, float& vg, float& vu) {     // pair summed by part `pair` % KP
                const int c = h * Tile::NACC + 4 * i + e, pair = (h * Tile::NACC / 4 + i) * 2 + e;
                if (pair % KP != (int)rank) return false;
                const u32 ag = s0 + (u32)(c * WG_THREADS + threadIdx.x) * 4, au = ag + 2 * WG_THREADS * 4;
                vg = vu = 0.0f;
#pragma unroll
                for (int q = 0; q < KP; ++q) {
                    vg += ld_dsmem_f32(ag, q);
                    vu += ld_dsmem_f32(au, q);
                }
                return true;
            });
        } else {
            plain_store([&](int c, float& v) {
                if (c % KP != (int)rank) return false;
                const u32 addr = s0 + (u32)(c * WG_THREADS + threadIdx.x) * 4;
                v = 0.0f;
#pragma unroll
                for (int q = 0; q < KP; ++q) v += ld_dsmem_f32(addr, q);
                return true;
            });
        }
        wg_tl(WG_TL_EPI_SUM);
        cluster_sync();                                // no block leaves while its tile is read
    }
    wg_tl(WG_TL_EXIT);
}
