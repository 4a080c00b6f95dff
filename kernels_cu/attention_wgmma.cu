// attention_wgmma.cu: causal GQA attention for prefill on Hopper warpgroup MMAs (sm_90a, issue
// 14): attention_prefill.cu's loop and arithmetic (attention_common.cuh: the same mask, online
// softmax in the exp2 domain, f16 P, f32 accumulation, output store), with both products on
// wgmma instead of per-warp mma.sync:
//   S (64 queries x 64 keys) = Q K^T: wgmma.m64n64k16 x HD/16, A = Q from registers (the
//                              mma.m16n8k16 A fragments, loaded once by ldmatrix), B = the K tile;
//   O (64 x HD) += P V:        wgmma.m64n{HD}k16 x 4, A = P from registers (at_pack_p), B = the
//                              V tile read transposed (MN-major) by the descriptor.
// A block is two warpgroups (128 queries, 64 each) sharing each K/V tile, so a tile is read from
// L2 once per 128 queries (attention_prefill.cu: once per 64) and from shared memory once per
// warpgroup (mma.sync: once per warp), and the MMAs run asynchronously to the issuing warps.
//
// In / out: as attention_prefill.cu's one-sequence entry (Q f16 [H, n, HD] pre-scaled by
// log2(e)/sqrt(HD); Kc, Vc f16 [KVH, maxT, HD]; f32, q8_1 or tiled f16 output; query head h reads KV
// head h / (H / KVH); start = start0 + (*startp if given)).
// Shared memory: AW_STAGES stages x (K tile, V tile), each 64 keys x HD f16 in the 128-byte
// swizzled layout that both descriptors read (wgmma_ops.cuh): atom column a (d = 64 a .. 64 a + 63)
// at a * 8 KB, key k's 128-byte row of it at k * 128, its 16-byte chunk c (d = 64 a + 8 c ..) at
// chunk c ^ (k % 8) (the hardware's XOR of address bits 4..6 with 7..9; stages 1 KB aligned).
// K as B of S (K-major, k = d): SBO 1024 (8 keys), k16 step s at + (s / 4) * 8 KB + (s % 4) * 32.
// V as B of O (MN-major, k = key): LBO 8 KB (64 columns), SBO 1024 (8 keys), k16 step s at
// + s * 2 KB. Loaded by cp.async (a warp reads two whole key rows of HD = 128: coalesced, and
// writes whole 128-byte rows: conflict-free), keys past the block's last query zero-filled; then
// fence.proxy.async and a barrier before the wgmmas read them. Q is staged once through stage
// 1 (rows of HD f16, chunk c of row r at c ^ (r & 7), for ldmatrix).
// Loop per key tile kt: wait for tile kt's copies; fence; barrier (tile kt visible; tile kt-1's
// wgmmas done, so its buffer is free); cp.async tile kt + AW_STAGES - 1 (after the fence: a proxy
// fence waits for the copies in flight); a warpgroup none of whose queries sees the tile's keys
// skips the rest; S wgmmas; wait; mask (tiles crossing a warp's diagonal), softmax; P V wgmmas;
// wait. wg_keep after each wait pins the accumulators (and P) to it, so the compiler moves no
// use of them above it. Warps whose rows are past the tile's queries still take part (a wgmma is
// warpgroup-wide) and store nothing.
// Known defect of the register-Q form: at HD = 64 ptxas reuses the Q fragments' registers after
// the first S wgmma (SASS: P is packed into them), so key tiles after the first are wrong;
// production runs HD = 64 on attention_prefill.cu (engine.gpu.ops.attention.ATT_WGMMA_HEAD_DIMS).
// QS (the attn_wgmma_qs_* entries, not yet measured on the GPU): Q stays in shared memory as two
// swizzled 64-row tiles (one per warpgroup, after the stages) and S reads it through an A
// descriptor (wgmma_ss_n): no Q registers to reuse, 30 fewer registers in all.
// OV (the attn_wgmma_ov_* entries: QS and FA3's intra-warpgroup overlap): S of tile kt and P V of
// tile kt - 1 are issued together and the softmax of tile kt runs while P V does; o is rescaled
// after P V lands, so the arithmetic (and the output) is the plain loop's. AW_OV_STAGES (4)
// stages: tiles kt - 1 (V) and kt in use, two loading.
// Grid (ceil(n / 128), H), q tiles in reverse order (longest first); 256 threads; dynamic smem
// stages * 2 * 64 * HD * 2 bytes (96 KB at HD = 128; OV 128 KB), QS / OV: + 128 * HD * 2.
#include "attention_common.cuh"
#include "wgmma_ops.cuh"

#ifndef AW_STAGES
#define AW_STAGES 3                       // K/V tiles in shared memory (loaded AW_STAGES - 1 ahead)
#endif
#ifndef AW_OV_STAGES
#define AW_OV_STAGES 4                    // OV: tiles kt - 1 (its V) and kt in use, 2 loaded ahead
#endif
#ifndef AW_V_LBO                          // V (MN-major, 128-byte swizzle): LBO = the next 64 columns
#define AW_V_LBO ATOM                     // (atom column), SBO = the next 8 keys (PTX ISA / CUTLASS's
#define AW_V_SBO 1024                     // canonical MN-major form); defines swap them for checks
#endif
#define AW_BQ 128                         // queries per block: two warpgroups of 64
#define AW_NTH 256

template <int HD, int OUT, bool QS, bool OV>
__device__ __forceinline__ void attn_wgmma_body(
        const u16* __restrict__ Q, const u16* __restrict__ Kc, const u16* __restrict__ Vc,
        float* __restrict__ O, i8* __restrict__ Oq, float2* __restrict__ Ods,
        int T, int H, int KVH, int row0, int nq, int pos0, int kvbase, int maxT) {
    constexpr int CH = HD / 8;            // 16-byte chunks per row
    constexpr int KS = HD / 16;           // k16 steps of Q K^T
    constexpr int NO = HD / 8;            // n8 blocks of O
    constexpr int ROWB = HD * 2;
    constexpr int TILE = AT_BK * ROWB;    // bytes of one 64-key tile
    constexpr int STAGE = 2 * TILE;       // K and V
    constexpr u32 ATOM = AT_BK * 128;     // bytes of one 64-column atom column of a tile
    static_assert(AT_BK == 64, "64-key tiles");
    static_assert(HD == 64 || HD == 128, "head size: the P V wgmma is m64n{HD}");
    constexpr int NST = OV ? AW_OV_STAGES : AW_STAGES;   // K/V stages
    constexpr int AHEAD = OV ? NST - 2 : NST - 1;          // tiles loaded ahead of the one in use
    static_assert(!OV || QS, "the overlapped loop reads Q from shared memory");
    static_assert(AHEAD >= 1 && (QS || AW_BQ * ROWB <= STAGE * (NST - 1)), "Q staged in stages 1..");

#ifndef GGP_EMU
    extern __shared__ __align__(1024) u8 smem[];
    const u32 sbase = smem_u32(smem);     // descriptors: shared addresses
#else
    u8* smem = at_emu_smem;
    wg_emu_smem = smem;
    const u32 sbase = 0;                  // descriptors: offsets from wg_emu_smem
#endif
    constexpr u32 QOFF = NST * STAGE;   // QS: the swizzled Q tiles (TILE per warpgroup)
    if (dyn_smem_bytes() < QOFF + (QS ? AW_BQ * ROWB : 0) || (sbase & 1023)) __trap();   // swizzle: 1 KB aligned
    const saddr s0 = smem_u32(smem);
    const saddr sQ = s0 + STAGE;          // !QS: stages 1.., until tile 1 is loaded

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
    const int g = lane >> 2, tig = lane & 3;
    const int h = blockIdx.y, kvh = h / (H / KVH);
    const int L = pos0 + nq;                          // keys of the tile's last query
    const int nkt = (L - 1) / AT_BK + 1;
    const bool idle = warp * 16 >= nq;                // none of the warp's rows is a query
#ifndef GGP_EMU
    const int wg_last = min(pos0 + 64 * wg + 63, L - 1);   // position of the warpgroup's last query
#else
    const int wg_last = L - 1;            // emulation: every warpgroup issues every wgmma
#endif

    const u16* Qh = Q + ((size_t)h * T + row0) * HD;
    const u16* Kh = Kc + ((size_t)kvh * maxT + kvbase) * HD;
    const u16* Vh = Vc + ((size_t)kvh * maxT + kvbase) * HD;

    // Byte of the 16-byte chunk ch of row r (< 64) in a swizzled 64-row tile.
    auto sw = [](int r, int ch) -> u32 { return (ch >> 3) * ATOM + r * 128 + (((ch & 7) ^ (r & 7)) << 4); };
    if constexpr (QS) {                   // warpgroup w's 64 rows: the swizzled tile at QOFF + w TILE
        for (int p = tid; p < AW_BQ * CH; p += AW_NTH) {
            const int row = p / CH, ch = p % CH;
            const bool ok = row < nq;
            cp_async16(s0 + QOFF + (row >> 6) * TILE + sw(row & 63, ch), Qh + (size_t)(ok ? row : 0) * HD + ch * 8,
                       ok ? 16 : 0);
        }
    } else {
        at_stage_q<HD, AW_BQ, AW_NTH>(sQ, Qh, nq, tid);
    }
    // Copy p of a tile: chunk p % CH of key p / CH (a warp reads whole key rows); its 8-chunk
    // piece of a 128-byte atom row lands permuted within that row (conflict-free).
    auto load_kv = [&](int kt) {
        const u32 buf = (kt % NST) * STAGE;
#pragma unroll
        for (int p = tid; p < AT_BK * CH; p += AW_NTH) {
            const int kin = p / CH, ch = p % CH;
            const int key = kt * AT_BK + kin;
            const bool ok = key < L;
            const size_t off = (size_t)(ok ? key : 0) * HD + ch * 8;
            const u32 dst = buf + sw(kin, ch);
            cp_async16(s0 + dst, Kh + off, ok ? 16 : 0);
            cp_async16(s0 + dst + TILE, Vh + off, ok ? 16 : 0);
        }
    };
    load_kv(0);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    u32 qa[KS][4];                                    // !QS: Q's register fragments
    if constexpr (!QS) {
        at_q_frags<HD>(qa, sQ, warp, lane);
        __syncthreads();                              // Q's staging buffers are free
    }
#pragma unroll
    for (int j = 1; j < AHEAD; ++j) {
        if (j < nkt) load_kv(j);
        cp_async_commit();
    }

    float o[NO][4], mrow[2], lrow[2];
    at_init(o, mrow, lrow);
    const int wfirst = pos0 + warp * 16;              // position of the warp's first query
    const int prow = wfirst + g;                      // rows g and g + 8

    // S = Q K^T of tile kt into s (issued and committed; not waited for).
    auto issue_s = [&](float (&s)[8][4], int kt) {
        const u32 kdesc = sbase + (kt % NST) * STAGE;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            const u32 kstep = (kk >> 2) * ATOM + (kk & 3) * 32;   // k16 step kk of a swizzled tile
            const u64 d = wg_desc_sw128(kdesc + kstep, 16, 1024);
            float (&sf)[32] = reinterpret_cast<float(&)[32]>(s);
            if constexpr (QS) {
                const u64 a = wg_desc_sw128(sbase + QOFF + wg * TILE + kstep, 16, 1024);
                if (kk == 0) wgmma_ss_n<64, 0>(sf, a, d);
                else wgmma_ss_n<64, 1>(sf, a, d);
            } else {
                if (kk == 0) wgmma_n<64, 0, 0>(sf, qa[kk], d);
                else wgmma_n<64, 0, 1>(sf, qa[kk], d);
            }
        }
        wg_commit();
    };
    // O += P V of tile kt (issued and committed; not waited for).
    auto issue_pv = [&](const u32 (&pa)[4][4], int kt) {
        const u32 vdesc = sbase + (kt % NST) * STAGE + TILE;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_n<HD, 1, 1>(reinterpret_cast<float(&)[HD / 2]>(o), pa[kk], wg_desc_sw128(vdesc + kk * 2048, AW_V_LBO, AW_V_SBO));
        wg_commit();
    };
    // Top of key tile kt: tile kt visible to every wgmma, and (the barrier) every warpgroup past
    // its P V of tile kt - AHEAD, whose buffer the copies of tile kt + AHEAD then reuse.
    auto next_tile = [&](int kt) {
        cp_async_wait<AHEAD - 1>();                   // this thread's copies of tile kt landed
        fence_proxy_async();
        __syncthreads();                              // every thread's, visible to the wgmmas
        if (kt + AHEAD < nkt) load_kv(kt + AHEAD);
        cp_async_commit();
    };
    u32 pa[4][4];                                     // P of the tile, the A operand of P V

    if constexpr (!OV) {
        // Per tile: S; wait; mask, softmax (o rescaled); P V; wait.
        for (int kt = 0; kt < nkt; ++kt) {
            next_tile(kt);
            const int k0 = kt * AT_BK;
            if (k0 > wg_last) continue;               // warpgroup-uniform: no query of it sees these keys
            float s[8][4];
            wg_fence();
            issue_s(s, kt);
            wg_wait<0>();
            wg_keep(reinterpret_cast<float(&)[32]>(s));   // no read of s above the wait
            if (k0 + AT_BK - 1 > wfirst) at_mask(s, k0, prow, tig);
            at_softmax(s, o, mrow, lrow);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) at_pack_p(pa[kk], s, kk);
            wg_fence();
            issue_pv(pa, kt);
            wg_wait<0>();
            wg_keep(reinterpret_cast<float(&)[HD / 2]>(o));
            wg_keep(reinterpret_cast<u32(&)[16]>(pa));    // P's registers live until the wgmmas read them
        }
    } else {
        // Per tile (FA3's intra-warpgroup overlap): S of tile kt and P V of tile kt - 1 issued
        // together; wait for S; mask and softmax (corr kept) while P V runs; wait for P V; o *= corr;
        // P of tile kt packed. The arithmetic on o is the same sequence (+= P V, *= corr, ...), so
        // the output bits are those of the loop above. The first tile and the last P V are peeled
        // (a wgmma under a branch makes ptxas serialize them all: C7520); a warpgroup's tiles are
        // 0 .. its last query's, and it joins the remaining tiles' barriers after its last P V
        // (which reads V of tile wg_nkt - 1: that buffer is reused at barrier wg_nkt + 1).
        const int wg_nkt = wg_last / AT_BK + 1;       // warpgroup-uniform
        float corr[2];
        auto softmax_pack = [&](float (&s)[8][4], int kt, bool pv_pending) {
            const int k0 = kt * AT_BK;
            if (k0 + AT_BK - 1 > wfirst) at_mask(s, k0, prow, tig);
#pragma unroll
            for (int r = 0; r < 2; ++r) corr[r] = at_softmax_row(s, mrow, lrow, r);
            if (pv_pending) {
                wg_wait<0>();                         // P V of tile kt - 1 landed in o
                wg_keep(reinterpret_cast<float(&)[HD / 2]>(o));
                wg_keep(reinterpret_cast<u32(&)[16]>(pa));
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) at_rescale_row(o, corr[r], r);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) at_pack_p(pa[kk], s, kk);
        };
        {
            float s[8][4];
            next_tile(0);
            wg_fence();
            issue_s(s, 0);
            wg_wait<0>();
            wg_keep(reinterpret_cast<float(&)[32]>(s));
            softmax_pack(s, 0, false);
        }
        for (int kt = 1; kt < wg_nkt; ++kt) {
            float s[8][4];
            next_tile(kt);
            wg_fence();
            issue_s(s, kt);
            issue_pv(pa, kt - 1);
            wg_wait<1>();                             // S landed (groups complete in order)
            wg_keep(reinterpret_cast<float(&)[32]>(s));
            softmax_pack(s, kt, true);
        }
        wg_fence();
        issue_pv(pa, wg_nkt - 1);
        wg_wait<0>();
        wg_keep(reinterpret_cast<float(&)[HD / 2]>(o));
        for (int kt = wg_nkt; kt < nkt; ++kt) next_tile(kt);
    }

    if (idle) return;                                 // warp-uniform; no block barrier below
    at_store<HD, OUT>(o, lrow, warp * 16, g, tig, row0, nq, h, H, T, O, Oq, Ods);
}

#define AW_INSTANCE(NAME, HDV, OUTV, QSV, OVV)                                                      \
    extern "C" __global__ void __launch_bounds__(AW_NTH, 1)                                     \
    NAME(const u16* __restrict__ Q, const u16* __restrict__ Kc, const u16* __restrict__ Vc,     \
         float* __restrict__ O, i8* __restrict__ Oq, float2* __restrict__ Ods, int n, int H,    \
         int KVH, const int* __restrict__ startp, int start0, int maxT) {                       \
        pdl_entry();                                                                            \
        const int q0 = (gridDim.x - 1 - blockIdx.x) * AW_BQ;                                    \
        attn_wgmma_body<HDV, OUTV, QSV, OVV>(Q, Kc, Vc, O, Oq, Ods, n, H, KVH, q0, min(AW_BQ, n - q0), \
                                       start0 + (startp ? *startp : 0) + q0, 0, maxT);         \
    }

AW_INSTANCE(attn_wgmma_h64_f32, 64, AT_F32, false, false)
AW_INSTANCE(attn_wgmma_h64_q8, 64, AT_Q8, false, false)
AW_INSTANCE(attn_wgmma_h64_x16, 64, AT_X16, false, false)
AW_INSTANCE(attn_wgmma_h128_f32, 128, AT_F32, false, false)
AW_INSTANCE(attn_wgmma_h128_q8, 128, AT_Q8, false, false)
AW_INSTANCE(attn_wgmma_h128_x16, 128, AT_X16, false, false)
AW_INSTANCE(attn_wgmma_qs_h64_f32, 64, AT_F32, true, false)
AW_INSTANCE(attn_wgmma_qs_h64_q8, 64, AT_Q8, true, false)
AW_INSTANCE(attn_wgmma_qs_h64_x16, 64, AT_X16, true, false)
AW_INSTANCE(attn_wgmma_qs_h128_f32, 128, AT_F32, true, false)
AW_INSTANCE(attn_wgmma_qs_h128_q8, 128, AT_Q8, true, false)
AW_INSTANCE(attn_wgmma_qs_h128_x16, 128, AT_X16, true, false)
AW_INSTANCE(attn_wgmma_ov_h64_f32, 64, AT_F32, true, true)
AW_INSTANCE(attn_wgmma_ov_h64_q8, 64, AT_Q8, true, true)
AW_INSTANCE(attn_wgmma_ov_h64_x16, 64, AT_X16, true, true)
AW_INSTANCE(attn_wgmma_ov_h128_f32, 128, AT_F32, true, true)
AW_INSTANCE(attn_wgmma_ov_h128_q8, 128, AT_Q8, true, true)
AW_INSTANCE(attn_wgmma_ov_h128_x16, 128, AT_X16, true, true)
