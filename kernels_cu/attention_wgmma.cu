// attention_wgmma.cu: causal GQA attention for prefill on Hopper warpgroup MMAs (sm_90a, issue
// 14): attention_prefill.cu's arithmetic (attention_common.cuh: the same mask, online softmax in
// the exp2 domain, f16 P, f32 accumulation, output store), with both products on wgmma instead of
// per-warp mma.sync:
//   S (64 queries x 128 keys) = Q K^T: wgmma.m64n128k16 x HD/16, A = the warpgroup's Q tile and
//                              B = the K tile, both read from shared memory by descriptors;
//   O (64 x HD) += P V:        wgmma.m64n{HD}k16 x 8, A = P from registers (at_pack_p), B = the
//                              V tile read transposed (MN-major) by the descriptor.
// A block is AW_NWG = 2 warpgroups (128 queries, 64 each) sharing each K/V tile, so a tile is read
// from L2 once per 128 queries (attention_prefill.cu: once per 64) and from shared memory once per
// warpgroup (mma.sync: once per warp), and the MMAs run asynchronously to the issuing warps.
//
// In / out: as attention_prefill.cu's one-sequence entry (Q f16 [H, n, HD] pre-scaled by
// log2(e)/sqrt(HD); Kc, Vc f16 [KVH, maxT, HD]; f32, q8_1 or tiled f16 output; query head h reads KV
// head h / (H / KVH); start = start0 + (*startp if given)).
// Shared memory: AW_STAGES stages x (K tile, V tile), then Q's AW_NWG 64-row tiles (one per
// warpgroup); every tile is 64 rows x HD f16 in the 128-byte swizzled layout that the descriptors
// read (wgmma_ops.cuh): atom column a (d = 64 a .. 64 a + 63) at a * 8 KB, row r's 128-byte row
// of it at r * 128, its 16-byte chunk c (d = 64 a + 8 c ..) at chunk c ^ (r % 8) (the hardware's
// XOR of address bits 4..6 with 7..9; stages 1 KB aligned).
// Q and K as A and B of S (K-major, k = d): SBO 1024 (8 rows), k16 step s at + (s / 4) * 8 KB +
// (s % 4) * 32. V as B of O (MN-major, k = key): LBO 8 KB (64 columns), SBO 1024 (8 keys), k16
// step s at + s * 2 KB. Loaded by cp.async (a warp reads two whole key rows of HD = 128:
// coalesced, and writes whole 128-byte rows: conflict-free), keys past the block's last query
// zero-filled.
// Pipeline (no block barrier after the start; H100: 1.11-1.22x the per-tile __syncthreads form at
// 4096@4096, docs/perf-log.md Session 20): a full and an empty mbarrier per stage. Every thread
// copies its share of tile j, then cp.async.mbarrier.arrive.noinc on full[j] (the arrival lands
// with its copies; count AW_NTH), so no thread waits for its own copies. A warpgroup waits for
// full[kt] and fences (fence.proxy.async: the generic-proxy copies visible to its wgmmas), issues
// its wgmmas, then copies tile kt + AW_STAGES - 2 once that stage's empty mbarrier says every
// warp (count AW_NTH / 32) released its previous tile; a warp releases tile kt - 1 when its P V
// has completed. Every thread copies and every warp releases every tile of the block (a warpgroup
// past its last tile, or without queries, too: the counts are fixed). A parity wait cannot pass
// on a phase two ahead: that phase needs the waiter's own arrival first.
// AW_SPLIT=1 (A/B define): K and V in rings of their own (AW_KST, AW_VST buffers, each with its
// full / empty pair): a K tile is released once S has landed, so the same shared memory holds
// tiles further ahead (K kt + AW_KST - 1, V kt + AW_VST - 2).
// AW_PROD=1 (production; 0: an A/B define): FA3's warp specialisation. One more warpgroup (the
// last) copies every K / V tile, each as soon as its buffer's empty mbarrier allows (full counts
// its 128 threads), with its registers lowered to AW_PROD_REGS (setmaxnreg) and the consumers'
// raised to AW_CONS_REGS; the consumers only wait, compute and release (H100: 1.10x at 4096@4096
// and 1.05x at 3314@0 with 32 / 32 heads, 1.04x / 0.99x with 28 / 4; docs/perf-log.md, Session 22).
// Loop (FA3's intra-warpgroup overlap): at the top of key tile kt, wait for tile kt (tiles kt - 1
// (its V) and kt in use, the rest loading); S of tile kt and P V of tile kt - 1 are issued together;
// wait for S; mask (tiles crossing a warp's diagonal) and softmax (corr kept) while P V runs; wait
// for P V; o *= corr; P of tile kt packed. With AW_PP the warpgroups issue in turn (FA3's
// ping-pong). The arithmetic on o is the plain sequence (+= P V, *= corr, ...), so the output
// bits are those of S, softmax, P V in turn (and of attention_prefill.cu). The first tile and the
// last P V are peeled: a wgmma under a branch makes ptxas serialize them all (C7520). wg_keep
// after each wait pins the accumulators (and P) to it, so the compiler moves no use of them
// above it. Warps of a warpgroup with queries whose own rows are past them still take part (a
// wgmma is warpgroup-wide) and store nothing.
// A/B defines (GGUF_PREFILL_KERNEL_DEFINES; the launcher follows them): AW_NWG warpgroups per
// block (2), AW_BK keys per K/V tile (128; 64 makes S m64n64, then AW_STAGES 4), AW_STAGES (3),
// AW_PP (1). 128-key tiles halve the fences and softmax rounds per key (H200, 4096@4096: 1.11x
// the 64-key form; docs/perf-log.md, Session 18).
// Grid (H, ceil(n / AW_BQ)) (attention_common.cuh: at_head_tile), q tiles in reverse order
// (longest first); AW_NTH threads; dynamic smem (2 * AW_STAGES * AW_BK + 64 * AW_NWG) * HD * 2
// bytes (224 KB at HD = 128), then 2 * AW_STAGES 8-byte mbarriers (AW_SPLIT: AW_KST + AW_VST
// tiles in place of the stages, two mbarriers each).
#include "attention_common.cuh"
#include "wgmma_ops.cuh"

#ifndef AW_BK
#define AW_BK 128                         // keys per K/V tile (64: an A/B define, with AW_STAGES 4)
#endif
#ifndef AW_STAGES
#define AW_STAGES 3                       // K/V stages: tiles kt - 1 (its V) and kt in use, 1 loading
#endif
#ifndef AW_SPLIT
#define AW_SPLIT 0                        // 1 (A/B define): K and V in rings of their own (below)
#endif
#ifndef AW_KST
#define AW_KST 3                          // AW_SPLIT: K tiles (kt in use until S lands, 2 loading)
#endif
#ifndef AW_VST
#define AW_VST 3                          // AW_SPLIT: V tiles (kt - 1 in use, kt landed, 1 loading)
#endif
#if AW_SPLIT
#define AW_KN AW_KST                      // K ring, V ring (buffers each)
#define AW_VN AW_VST
#define AW_KAHEAD (AW_KST - 1)            // at key tile kt the copies of K tile kt + AW_KAHEAD
#define AW_VAHEAD (AW_VST - 2)            // and of V tile kt + AW_VAHEAD are issued
#define AW_NBUF (AW_KST + AW_VST)         // K / V tile buffers
#define AW_NBAR (2 * (AW_KST + AW_VST))   // mbarriers
#else
#define AW_KN AW_STAGES                   // one ring of stages, each a K and a V tile
#define AW_VN AW_STAGES
#define AW_KAHEAD (AW_STAGES - 2)         // tiles loaded ahead of the one in use
#define AW_VAHEAD (AW_STAGES - 2)
#define AW_NBUF (2 * AW_STAGES)
#define AW_NBAR (2 * AW_STAGES)
#endif
#ifndef AW_V_LBO                          // V (MN-major, 128-byte swizzle): LBO = the next 64 columns
#define AW_V_LBO ATOM                     // (atom column), SBO = the next 8 keys (PTX ISA / CUTLASS's
#define AW_V_SBO 1024                     // canonical MN-major form); defines swap them for checks
#endif
#ifndef AW_NWG
#define AW_NWG 2                          // warpgroups per block, 64 queries each (3: an A/B define)
#endif
#define AW_BQ (64 * AW_NWG)               // queries per block
#ifndef AW_MHA_GROUP                      // where every query head has its own KV head (H == KVH),
#define AW_MHA_GROUP 4                    // the blocks go out G heads at a time (at_head_tile; 0: off, an
#endif                                    // A/B define; AT_HGROUP overrides it for every layout)
#ifndef AW_PROD
#define AW_PROD 1                         // one more warpgroup issues every K/V copy (0: an A/B define)
#endif
#ifndef AW_PROD_REGS                      // AW_PROD: the producer's registers, the consumers' (x 128,
#define AW_PROD_REGS 24                   // x 256: <= 64 K)
#define AW_CONS_REGS 240
#endif
static_assert(!AW_PROD || 128 * (AW_NWG * AW_CONS_REGS + AW_PROD_REGS) <= 65536,
              "AW_PROD: the warpgroups' setmaxnreg counts exceed the register file (AW_NWG 3 needs AW_PROD=0)");
#define AW_NTH (128 * (AW_NWG + AW_PROD))
#define AW_NCP (AW_PROD ? 128 : AW_NTH)   // threads that copy K / V (a full mbarrier's count)
#define AW_NCW (4 * AW_NWG)               // warps that read K / V (an empty mbarrier's count)
#ifndef AW_PP
#define AW_PP 1                           // the warpgroups' wgmma issues take turns (0: an A/B define)
#endif
#define AW_PP_BAR 8                       // named barriers 8 ..: warpgroup w waits at 8 + w for its turn

enum { AW_ALL = 0, AW_PRODUCER = 1, AW_CONSUMER = 2 };   // the body's role (AW_ALL: no producer)
template <int R>
struct AwRole {
    static constexpr int value = R;
};

template <int HD, int OUT, int ROLE>
__device__ __forceinline__ void attn_wgmma_body(
        const u16* __restrict__ Q, const u16* __restrict__ Kc, const u16* __restrict__ Vc,
        float* __restrict__ O, i8* __restrict__ Oq, float2* __restrict__ Ods,
        int T, int H, int KVH, int row0, int nq, int pos0, int kvbase, int maxT, int h) {
    constexpr int CH = HD / 8;            // 16-byte chunks per row
    constexpr int KS = HD / 16;           // k16 steps of Q K^T
    constexpr int ROWB = HD * 2;
    constexpr int NS = AW_BK / 8;         // n8 blocks of S (per warp: rows g, g + 8)
    constexpr int NP = AW_BK / 16;        // k16 steps of P V
    constexpr int TILE = AW_BK * ROWB;    // bytes of one K or V tile
    constexpr int QTILE = 64 * ROWB;      // bytes of one warpgroup's Q tile
    // Tile j in a ring of n buffers: buffer slot(j, n), the use of parity(j, n) of its mbarriers.
    auto slot = [](int j, int n) { return j % n; };
    auto parity = [](int j, int n) -> u32 { return (j / n) & 1; };
    // Buffer of K tile j and of V tile j: the stage's halves, or the two rings (K first).
    auto kbuf = [&](int j) -> u32 { return AW_SPLIT ? slot(j, AW_KN) * TILE : slot(j, AW_KN) * 2 * TILE; };
    auto vbuf = [&](int j) -> u32 {
        return AW_SPLIT ? (AW_KN + slot(j, AW_VN)) * TILE : slot(j, AW_VN) * 2 * TILE + TILE;
    };
    constexpr u32 ATOM = AW_BK * 128;     // bytes of one 64-column atom column of a K / V tile
    constexpr u32 QATOM = 64 * 128;       // the same of a Q tile
    constexpr u32 QOFF = AW_NBUF * TILE;  // the swizzled Q tiles (QTILE per warpgroup)
    constexpr u32 QSET = AW_BQ * ROWB;    // bytes of the block's Q tiles
    static_assert(AW_BK == 64 || AW_BK == 128, "64- or 128-key tiles (the S wgmma is m64n{AW_BK})");
    static_assert(AW_KAHEAD >= 1 && AW_VAHEAD >= 0, "at least one tile loading");
    static_assert(HD == 64 || HD == 128, "head size: the P V wgmma is m64n{HD}");

#ifndef GGP_EMU
    extern __shared__ __align__(1024) u8 smem[];
    const u32 sbase = smem_u32(smem);     // descriptors: shared addresses
#else
    u8* smem = at_emu_smem;
    wg_emu_smem = smem;
    const u32 sbase = 0;                  // descriptors: offsets from wg_emu_smem
#endif
    if (dyn_smem_bytes() < QOFF + QSET + 8 * AW_NBAR || (sbase & 1023))
        __trap();                                                 // swizzle: 1 KB aligned
    const saddr s0 = smem_u32(smem);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int g = lane >> 2, tig = lane & 3;
    const int kvh = h / (H / KVH);
    const int L = pos0 + nq;                          // keys of the tile's last query
    const int nkt = (L - 1) / AW_BK + 1;
    const bool idle = warp * 16 >= nq;                // none of the warp's rows is a query
    const int wg_last = min(pos0 + 64 * wg + 63, L - 1);   // position of the warpgroup's last query

    const u16* Qh = Q + ((size_t)h * T + row0) * HD;
    const u16* Kh = Kc + ((size_t)kvh * maxT + kvbase) * HD;
    const u16* Vh = Vc + ((size_t)kvh * maxT + kvbase) * HD;

    // Byte of the 16-byte chunk ch of row r in a swizzled tile whose atom columns are atom bytes.
    auto sw = [](u32 atom, int r, int ch) -> u32 { return (ch >> 3) * atom + r * 128 + (((ch & 7) ^ (r & 7)) << 4); };
    // mbarriers of buffer b of a ring: full (the tile landed: every thread's copies) and empty
    // (every warp done with it); one ring's (the stages') serve K and V unless AW_SPLIT.
    const u32 kfull0 = sbase + QOFF + QSET, kempty0 = kfull0 + 8 * AW_KN;
    const u32 vfull0 = AW_SPLIT ? kempty0 + 8 * AW_KN : kfull0;
    const u32 vempty0 = AW_SPLIT ? vfull0 + 8 * AW_VN : kempty0;
    if (tid == 0) {
        for (int b = 0; b < AW_KN; ++b) {
            mbar_init(kfull0 + 8 * b, AW_NCP);
            mbar_init(kempty0 + 8 * b, AW_NCW);
        }
        for (int b = 0; AW_SPLIT && b < AW_VN; ++b) {
            mbar_init(vfull0 + 8 * b, AW_NCP);
            mbar_init(vempty0 + 8 * b, AW_NCW);
        }
    }
    __syncthreads();                                  // initialized before any arrival
    // The block's Q rows (warpgroup w's 64 at QOFF + w QTILE), copied by every thread.
    for (int p = tid; p < AW_BQ * CH; p += AW_NTH) {
        const int row = p / CH, ch = p % CH;
        const bool ok = row < nq;
        cp_async16(s0 + QOFF + (row >> 6) * QTILE + sw(QATOM, row & 63, ch), Qh + (size_t)(ok ? row : 0) * HD + ch * 8,
                   ok ? 16 : 0);
    }
    // K / V tiles: at_copy_kv (chunk tid % CH of keys tid / CH + KSTEP i); the 8-chunk piece of a
    // 128-byte atom row lands permuted within that row (conflict-free).
    constexpr int KSTEP = AW_NCP / CH;
    static_assert(AW_NCP % CH == 0, "copy layout");
    const int ctid = AW_PROD ? tid - 128 * AW_NWG : tid;   // the thread's place among the copying ones
    const int kin0 = ctid / CH, kch = ctid % CH;
    const saddr kvdst = s0 + sw(ATOM, kin0, kch);
    const u16* Kch = Kh + kch * 8;
    const u16* Vch = Vh + kch * 8;
    // This thread's copies of tile j from src (K; under AW_SPLIT K or V) into dst, and without
    // AW_SPLIT of its V into dst_v.
    auto load = [&](int j, const u16* src, saddr dst, saddr dst_v) {
        at_copy_kv<AW_BK, KSTEP, HD, !AW_SPLIT>(dst, dst_v, 128, src, Vch, ((size_t)j * AW_BK + kin0) * HD, kin0,
                                                (j + 1) * AW_BK <= L, L - j * AW_BK - kin0);
    };
    // Tile j's copies in a ring of n buffers: once every warp released the buffer's previous tile,
    // this thread's copies, then its arrival on the buffer's full mbarrier when they have landed.
    auto claim = [&](u32 empty0, int n, int j) {
        if (j >= n) mbar_wait(empty0 + 8 * slot(j, n), parity(j, n) ^ 1);   // the buffer's previous use
    };
    auto produce_k = [&](int j) {
        if (j >= nkt) return;
        claim(kempty0, AW_KN, j);
        load(j, Kch, kvdst + kbuf(j), kvdst + vbuf(j));
        cp_async_mbar_arrive(kfull0 + 8 * slot(j, AW_KN));
    };
    auto produce_v = [&](int j) {
        if (!AW_SPLIT || j >= nkt) return;
        claim(vempty0, AW_VN, j);
        load(j, Vch, kvdst + vbuf(j), 0);
        cp_async_mbar_arrive(vfull0 + 8 * slot(j, AW_VN));
    };
    // The copies a thread issues at key tile kt (after its wgmmas; for the tiles it passes). Under
    // AW_PROD the consumers copy nothing: the producer warpgroup copies every tile (below).
    auto produce = [&](int kt) {
        if (AW_PROD) return;
        produce_k(kt + AW_KAHEAD);
        produce_v(kt + AW_VAHEAD);
    };
#pragma unroll
    for (int j = 0; j < AW_KAHEAD && !AW_PROD; ++j) produce_k(j);
#pragma unroll
    for (int j = 0; j < AW_VAHEAD && !AW_PROD; ++j) produce_v(j);
    cp_async_commit();
    cp_async_wait<0>();                               // Q (and the first tiles) landed
    fence_proxy_async();
    __syncthreads();
    // FA3's warp specialisation: the producer copies every tile, each as soon as its buffer is
    // free; the entry waits for its last copies.
    if constexpr (ROLE == AW_PRODUCER) {
        for (int j = 0; j < nkt; ++j) {
            produce_k(j);
            produce_v(j);
        }
        return;
    }

    float o[HD / 8][4], mrow[2], lrow[2];
    at_init(o, mrow, lrow);
    const int wfirst = pos0 + warp * 16;              // position of the warp's first query
    const int prow = wfirst + g;                      // rows g and g + 8

    // Descriptors: encoded once (the warpgroup's Q tile, the tile buffers' base); a k16 step or a
    // buffer is then one add to the start field (wg_desc_add), not a mask-shift-or per wgmma.
    const u64 qdesc = wg_desc_sw128(sbase + QOFF + wg * QTILE, 16, 1024);
    const u64 kdesc0 = wg_desc_sw128(sbase, 16, 1024);
    const u64 vdesc0 = wg_desc_sw128(sbase, AW_V_LBO, AW_V_SBO);
    // S = Q K^T of tile kt into s (issued and committed; not waited for).
    auto issue_s = [&](float (&s)[NS][4], int kt) {
        const u64 kdesc = wg_desc_add(kdesc0, kbuf(kt));
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            const u32 kstep = (kk >> 2) * ATOM + (kk & 3) * 32;   // k16 step kk of a swizzled tile
            const u32 qstep = (kk >> 2) * QATOM + (kk & 3) * 32;
            float (&sf)[AW_BK / 2] = reinterpret_cast<float(&)[AW_BK / 2]>(s);
            if (kk == 0) wgmma_ss_n<AW_BK, 0>(sf, wg_desc_add(qdesc, qstep), wg_desc_add(kdesc, kstep));
            else wgmma_ss_n<AW_BK, 1>(sf, wg_desc_add(qdesc, qstep), wg_desc_add(kdesc, kstep));
        }
        wg_commit();
    };
    u32 pa[NP][4];                                    // P of the tile, the A operand of P V
    // O += P V of tile kt (issued and committed; not waited for).
    auto issue_pv = [&](int kt) {
        const u64 vdesc = wg_desc_add(vdesc0, vbuf(kt));
#pragma unroll
        for (int kk = 0; kk < NP; ++kk)
            wgmma_n<HD, 1, 1>(reinterpret_cast<float(&)[HD / 2]>(o), pa[kk], wg_desc_add(vdesc, kk * 2048));
        wg_commit();
    };
    // Top of tile kt: wait for its K (AW_SPLIT: and for the V of tile kt - 1) to land, fence (the
    // copies visible to this thread's wgmmas). A warp releases tile kt's K once its S has landed
    // (AW_SPLIT), its V (else the stage) once its P V has.
    auto wait_v = [&](int kt) {
        if (AW_SPLIT && kt >= 0) mbar_wait(vfull0 + 8 * slot(kt, AW_VN), parity(kt, AW_VN));
    };
    auto next_tile = [&](int kt) {
        mbar_wait(kfull0 + 8 * slot(kt, AW_KN), parity(kt, AW_KN));
        wait_v(kt - 1);
        fence_proxy_async();
    };
    auto release_k = [&](int kt) {
        if (AW_SPLIT && lane == 0) mbar_arrive(kempty0 + 8 * slot(kt, AW_KN));
    };
    auto release_v = [&](int kt) {
        if (lane == 0) mbar_arrive(vempty0 + 8 * slot(kt, AW_VN));
    };
    // AW_PP (FA3's ping-pong): the warpgroups issue their wgmmas of a tile in turn (0, 1, .., 0,
    // ..), so one's softmax runs under the others' MMAs instead of all at once. Turn t of
    // warpgroup w waits at barrier 8 + w for turn t of warpgroup w - 1 (t - 1 of the last one,
    // which lets warpgroup 0 start), and each takes nkt + 1 turns (tiles, the last P V; a
    // warpgroup past its last tile, or without queries, takes its turns without wgmmas), so every
    // bar.sync meets its bar.arrive (the last warpgroup's last turn arrives nowhere).
    constexpr int LASTWG = AW_NWG - 1;
    auto turn_begin = [&]() {
        if (AW_PP) named_bar_sync(AW_PP_BAR + wg, 256);
    };
    auto turn_end = [&](bool last) {
        if (AW_PP && !(wg == LASTWG && last)) named_bar_arrive(AW_PP_BAR + (wg == LASTWG ? 0 : wg + 1), 256);
    };
    if (AW_PP && wg == LASTWG) named_bar_arrive(AW_PP_BAR, 256);
    // Mask and softmax of tile kt's S (corr kept); once the pending P V (of tile kt - 1) has
    // landed, o *= corr; P of tile kt packed for its P V.
    const int wg_nkt = wg_last / AW_BK + 1;           // the warpgroup's tiles (warpgroup-uniform)
    float corr[2];
    auto softmax_pack = [&](float (&s)[NS][4], int kt, bool pv_pending) {
        const int k0 = kt * AW_BK;
        if (k0 + AW_BK - 1 > wfirst) at_mask(s, k0, prow, tig);
#pragma unroll
        for (int r = 0; r < 2; ++r) corr[r] = at_softmax_row(s, mrow, lrow, r);
        if (pv_pending) {
            wg_wait<0>();                             // P V of tile kt - 1 landed in o
            wg_keep(reinterpret_cast<float(&)[HD / 2]>(o));
            wg_keep(reinterpret_cast<u32(&)[NP * 4]>(pa));    // P's registers live until the wgmmas read them
            release_v(kt - 1);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) at_rescale_row(o, corr[r], r);
#pragma unroll
        for (int kk = 0; kk < NP; ++kk) at_pack_p(pa[kk], s, kk);
    };
    // Tiles kt0 .. nkt - 1 that the warpgroup does not read: their copies, releases and turns.
    auto pass_tiles = [&](int kt0) {
        for (int kt = kt0; kt < nkt; ++kt) {
            turn_begin();
            turn_end(false);
            produce(kt);
            release_k(kt);
            release_v(kt);
        }
    };
    if (64 * wg >= nq) {                              // a warpgroup without queries
        pass_tiles(0);
        turn_begin();                                 // turn nkt
        turn_end(true);
        cp_async_commit();
        cp_async_wait<0>();                           // this thread's last copies landed
        return;
    }
    {
        float s[NS][4];
        next_tile(0);
        turn_begin();
        wg_fence();
        issue_s(s, 0);
        turn_end(false);
        produce(0);
        wg_wait<0>();
        wg_keep(reinterpret_cast<float(&)[NS * 4]>(s));   // no read of s above the wait
        release_k(0);
        softmax_pack(s, 0, false);
    }
    for (int kt = 1; kt < wg_nkt; ++kt) {
        float s[NS][4];
        next_tile(kt);
        turn_begin();
        wg_fence();
        issue_s(s, kt);
        issue_pv(kt - 1);
        turn_end(false);
        produce(kt);
        wg_wait<1>();                                 // S landed (groups complete in order)
        wg_keep(reinterpret_cast<float(&)[NS * 4]>(s));
        release_k(kt);
        softmax_pack(s, kt, true);
    }
    if (AW_SPLIT) {
        wait_v(wg_nkt - 1);
        fence_proxy_async();
    }
    turn_begin();                                     // turn wg_nkt
    wg_fence();
    issue_pv(wg_nkt - 1);
    turn_end(wg_nkt == nkt);
    wg_wait<0>();
    wg_keep(reinterpret_cast<float(&)[HD / 2]>(o));
    release_v(wg_nkt - 1);
    pass_tiles(wg_nkt);
    cp_async_commit();
    cp_async_wait<0>();                               // this thread's last copies landed

    if (idle) return;                                 // warp-uniform; no block barrier below
    at_store<HD, OUT>(o, lrow, warp * 16, g, tig, row0, nq, h, H, T, O, Oq, Ods);
}

// One block per (head, query tile) (at_head_tile, grouped by AW_MHA_GROUP); under AW_PROD the
// producer warpgroup and the consumers each run the body in their role.
template <int HD, int OUT>
__device__ __forceinline__ void attn_wgmma_entry(
        const u16* __restrict__ Q, const u16* __restrict__ Kc, const u16* __restrict__ Vc, float* __restrict__ O,
        i8* __restrict__ Oq, float2* __restrict__ Ods, int n, int H, int KVH, const int* __restrict__ startp,
        int start0, int maxT) {
    pdl_entry();
    const int start = start0 + (startp ? *startp : 0);
    const int G = AT_HGROUP > 0 ? AT_HGROUP : (H == KVH ? AW_MHA_GROUP : 0);   // heads per group (at_head_tile)
    const int2 ht = at_head_tile(G);
    const int q0 = (AT_NTILES - 1 - ht.y) * AW_BQ;
    auto works = [&](auto role) {                     // this block's (head, query tile) in a role
        attn_wgmma_body<HD, OUT, decltype(role)::value>(Q, Kc, Vc, O, Oq, Ods, n, H, KVH, q0, min(AW_BQ, n - q0),
                                                        start + q0, 0, maxT, ht.x);
    };
    if constexpr (!AW_PROD) {
        works(AwRole<AW_ALL>());
    } else if (threadIdx.x >= 128 * AW_NWG) {         // the producer warpgroup (setmaxnreg: each role
        wg_setmaxnreg_dec<AW_PROD_REGS>();            // its own code after it)
        works(AwRole<AW_PRODUCER>());
        cp_async_commit();
        cp_async_wait<0>();                           // its last copies landed
    } else {
        wg_setmaxnreg_inc<AW_CONS_REGS>();
        works(AwRole<AW_CONSUMER>());
    }
}

#define AW_INSTANCE(NAME, HDV, OUTV)                                                            \
    extern "C" __global__ void __launch_bounds__(AW_NTH, 1)                                     \
    NAME(const u16* __restrict__ Q, const u16* __restrict__ Kc, const u16* __restrict__ Vc,     \
         float* __restrict__ O, i8* __restrict__ Oq, float2* __restrict__ Ods, int n, int H,    \
         int KVH, const int* __restrict__ startp, int start0, int maxT) {                       \
        attn_wgmma_entry<HDV, OUTV>(Q, Kc, Vc, O, Oq, Ods, n, H, KVH, startp, start0, maxT);   \
    }

AW_INSTANCE(attn_wgmma_h64_f32, 64, AT_F32)
AW_INSTANCE(attn_wgmma_h64_q8, 64, AT_Q8)
AW_INSTANCE(attn_wgmma_h64_x16, 64, AT_X16)
AW_INSTANCE(attn_wgmma_h128_f32, 128, AT_F32)
AW_INSTANCE(attn_wgmma_h128_q8, 128, AT_Q8)
AW_INSTANCE(attn_wgmma_h128_x16, 128, AT_X16)
