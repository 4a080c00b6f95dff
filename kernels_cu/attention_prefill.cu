// attention_prefill.cu: causal GQA attention for prefill, flash-style (FlashAttention-2 loop)
// on f16 tensor cores (mma.sync m16n8k16, f32 accumulation), online softmax in f32.
//
// Written for one sequence (the varlen entry below maps a batch of sequences onto it):
// In:  Q  f16 [H, n, HD]      queries of this ubatch (positions start .. start+n-1), already
//                             rotated and scaled by log2(e)/sqrt(HD) (rope.cu), so
//                             scores live in the exp2 domain;
//      Kc, Vc f16 [KVH, maxT, HD]  the layer's KV cache, keys 0 .. start+n-1 valid (this
//                             ubatch's K/V were written by rope.cu; earlier ubatches before).
//      Query head h reads KV head h / (H / KVH).
// Out: o[t, h*HD + i] = sum_j p_j V[j, i] / sum_j p_j,  p_j = 2^(s_j - max_j s_j),
//      s_j = Q[h, t] . K[j]  over keys j <= start + t   (engine.reference.causal_attention)
//      OUT = AT_F32 (_f32 entries): O float32 [n, H*HD];
//      OUT = AT_Q8 (_q8):  the q8_1 blocks of each 32-column block of o (the attn_output GEMM's
//                  A operand): Oq int8 [n, H*HD], Ods float2 [n, H*HD/32] = (d, s),
//                  d = amax/127, q = roundf(o/d), s = d * sum(q) (the dequantized sum;
//                  see rmsnorm.cu for why not sum(o));
//      OUT = AT_X16 (_x16): the Hopper GEMM's tiled f16 operand [H*HD/64, ceil(n/8), 8, 8, 8]
//                  (x16_tiles.cuh) at O's address, the bits wgmma_tile_x16 makes of the f32 o.
// Tiling: block = 4 warps = 64 queries (16 per warp) of one head; keys in tiles of 64,
//   K/V tiles double-buffered by cp.async (keys past the block's last query zero-filled, so
//   p = 0 never meets garbage in V); smem rows of HD f16 with 16-byte chunk c of row r at
//   c ^ (r & 7) (conflict-free ldmatrix). Per tile and warp: S (16 x 64) = Q K^T from register Q
//   fragments and ldmatrix K fragments; causal mask (assignment of -inf) only on tiles that
//   cross the warp's diagonal; tiles past the warp's last query are skipped;
//   m_new = max(m, rowmax S); corr = 2^(m - m_new); l = l corr + sum p; O = O corr + P V with
//   P converted in registers to the f16 A fragments and V fragments by ldmatrix.trans.
//   A row whose scores are all -inf so far uses 0 as its max (2^-inf = 0, never NaN).
//   A warp whose 16 query rows are all past the tile's queries (a short tile: a decode token
//   is a 1-query tile) skips the math of every key tile; it still joins the barriers and the
//   cooperative loads.
// Entry points (one body, attn_prefill_body: a tile of nq <= 64 queries, rows row0.. of Q and
// of the outputs, at positions pos0.., over keys 0..pos0+nq-1 at cache rows kvbase..):
//   attn_prefill_h{HD}_{f32,q8}: one sequence, the ubatch's n queries at positions start..,
//     keys at cache rows 0..; start = start0 + (startp ? *startp : 0): startp, the position
//     read on the device (one CUDA graph of the prefill serves every position,
//     engine/gpu/prefill_graph.py). Grid (H, ceil(n/64)), q tiles in reverse order (longest
//     first): tile i = queries 64 i .. min(64 i + 64, n) - 1.
//   attn_prefill_varlen_h{HD}_{f32,q8}: a batched step mixing sequences; Q [H, T, HD], O/Oq/Ods
//     [T, ...]; tiles int4 [gridDim.y] = {row0, nq, pos0, kvbase}, one per block: query rows
//     row0..row0+nq-1 of one sequence at positions pos0..pos0+nq-1, whose key p lives at cache
//     row kvbase + p (sequences occupy disjoint row ranges); nq == 0: the block returns at once
//     (padding, so that a CUDA graph keeps a fixed grid); 1 <= nq <= 64 otherwise (more: trap).
//     engine.gpu.ops.attention.varlen_tiles cuts sequences into the one-sequence kernel's tiles.
// Grid (H, tiles) (attention_common.cuh: AT_HEAD, AT_TILE); 128 threads; dynamic smem 5 * 64 * HD * 2
// bytes (Q, 2 x K, 2 x V).
#include "attention_common.cuh"

template <int HD, int OUT>
__device__ __forceinline__ void attn_prefill_body(
        const u16* __restrict__ Q, const u16* __restrict__ Kc, const u16* __restrict__ Vc,
        float* __restrict__ O, i8* __restrict__ Oq, float2* __restrict__ Ods,
        int T, int H, int KVH, int row0, int nq, int pos0, int kvbase, int maxT) {
    // T: rows of Q [H, T, HD] and of the outputs; this block: query head AT_HEAD, queries
    // row0 .. row0+nq-1 (1 <= nq <= AT_BQ) at positions pos0 .. pos0+nq-1 over keys
    // 0 .. pos0+nq-1 at cache rows kvbase .. of each KV head plane
    constexpr int CH = HD / 8;            // 16-byte chunks per row
    constexpr int KS = HD / 16;           // k-steps of Q K^T
    constexpr int NO = HD / 8;            // n-tiles of O
    constexpr int ROWB = HD * 2;
    constexpr int TILE = AT_BK * ROWB;    // bytes of one 64-row tile (Q tile too: BQ == BK)
    static_assert(AT_BQ == AT_BK, "one tile size");
    static_assert(HD % 32 == 0 && HD <= 256, "head size");

#ifndef GGP_EMU
    extern __shared__ __align__(16) u8 smem[];
#else
    u8* smem = at_emu_smem;
#endif
    if (dyn_smem_bytes() < (u32)(5 * TILE)) __trap();
    const saddr sQ = smem_u32(smem);
    const saddr sK0 = sQ + TILE, sV0 = sQ + 3 * TILE;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int h = AT_HEAD, kvh = h / (H / KVH);
    const int L = pos0 + nq;                          // keys of the tile's last query
    const int nkt = (L - 1) / AT_BK + 1;
    const bool idle = warp * 16 >= nq;                // none of the warp's rows is a query

    const u16* Qh = Q + ((size_t)h * T + row0) * HD;
    const u16* Kh = Kc + ((size_t)kvh * maxT + kvbase) * HD;
    const u16* Vh = Vc + ((size_t)kvh * maxT + kvbase) * HD;

    at_stage_q<HD, AT_BQ, AT_NTH>(sQ, Qh, nq, tid);
    // K / V tiles: at_copy_kv (chunk tid % CH of keys tid / CH + KSTEP i), unswizzled atoms.
    constexpr int KSTEP = AT_NTH / CH;
    static_assert(AT_NTH % CH == 0, "copy layout");
    const int kin0 = tid / CH, kch = tid % CH;
    const saddr kvdst = kin0 * ROWB + ((kch ^ (kin0 & 7)) << 4);
    const u16* Kch = Kh + kch * 8;
    const u16* Vch = Vh + kch * 8;
    auto load_kv = [&](int kt, int buf) {
        const saddr dst = kvdst + buf * TILE;
        at_copy_kv<AT_BK, KSTEP, HD>(sK0 + dst, sV0 + dst, ROWB, Kch, Vch, ((size_t)kt * AT_BK + kin0) * HD, kin0,
                                     (kt + 1) * AT_BK <= L, L - kt * AT_BK - kin0);
    };
    load_kv(0, 0);
    cp_async_commit();

    u32 qa[KS][4];
    float o[NO][4], mrow[2], lrow[2];
    at_init(o, mrow, lrow);
    const int wfirst = pos0 + warp * 16;              // position of the warp's first query
    const int prow = wfirst + g;                      // rows g and g + 8

    for (int kt = 0; kt < nkt; ++kt) {
        cp_async_wait<0>();
        __syncthreads();                              // tile kt landed; tile kt-1 consumed
        if (kt == 0 && !idle) at_q_frags<HD>(qa, sQ, warp, lane);
        if (kt + 1 < nkt) load_kv(kt + 1, (kt + 1) & 1);
        cp_async_commit();
        const int k0 = kt * AT_BK;
        if (idle || k0 > wfirst + 15) continue;       // no query, or every key after every query
        const saddr sK = sK0 + (kt & 1) * TILE, sV = sV0 + (kt & 1) * TILE;

        float s[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int row = j * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int ch = 2 * kk + ((lane >> 3) & 1);
                u32 b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3, sK + row * ROWB + ((ch ^ (row & 7)) << 4));
                mma_f16(s[2 * j], qa[kk], b0, b1);
                mma_f16(s[2 * j + 1], qa[kk], b2, b3);
            }
        }
        if (k0 + AT_BK - 1 > wfirst) at_mask(s, k0, prow, tig);   // the tile crosses the warp's diagonal
        at_softmax(s, o, mrow, lrow);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {              // 16 keys per k-step
            u32 pa[4];
            at_pack_p(pa, s, kk);
#pragma unroll
            for (int j = 0; j < NO / 2; ++j) {
                const int row = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
                const int ch = 2 * j + (lane >> 4);
                u32 b0, b1, b2, b3;
                ldmatrix_x4_trans(b0, b1, b2, b3, sV + row * ROWB + ((ch ^ (row & 7)) << 4));
                mma_f16(o[2 * j], pa, b0, b1);
                mma_f16(o[2 * j + 1], pa, b2, b3);
            }
        }
    }

    if (idle) return;                                 // warp-uniform; no block barrier below
    at_store<HD, OUT>(o, lrow, warp * 16, g, tig, row0, nq, h, H, T, O, Oq, Ods);
}

#define AT_INSTANCE(HDV, SUF, OUTV)                                                              \
    extern "C" __global__ void __launch_bounds__(AT_NTH)                                        \
    attn_prefill_h##HDV##_##SUF(const u16* __restrict__ Q, const u16* __restrict__ Kc,          \
                                const u16* __restrict__ Vc, float* __restrict__ O,              \
                                i8* __restrict__ Oq, float2* __restrict__ Ods, int n, int H,    \
                                int KVH, const int* __restrict__ startp, int start0, int maxT) { \
        pdl_entry();                                                                            \
        const int q0 = (AT_NTILES - 1 - AT_TILE) * AT_BQ;                                       \
        attn_prefill_body<HDV, OUTV>(Q, Kc, Vc, O, Oq, Ods, n, H, KVH, q0, min(AT_BQ, n - q0),  \
                                    start0 + (startp ? *startp : 0) + q0, 0, maxT);            \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(AT_NTH)                                        \
    attn_prefill_varlen_h##HDV##_##SUF(const u16* __restrict__ Q, const u16* __restrict__ Kc,   \
                                       const u16* __restrict__ Vc, float* __restrict__ O,       \
                                       i8* __restrict__ Oq, float2* __restrict__ Ods,           \
                                       const int4* __restrict__ tiles, int T, int H, int KVH,   \
                                       int maxT) {                                              \
        pdl_entry();                                                                            \
        const int4 tl = tiles[AT_TILE];                                                         \
        if (tl.y <= 0) return;                                                                  \
        if (tl.y > AT_BQ) __trap();                                                             \
        attn_prefill_body<HDV, OUTV>(Q, Kc, Vc, O, Oq, Ods, T, H, KVH, tl.x, tl.y, tl.z, tl.w,   \
                                    maxT);                                                      \
    }

AT_INSTANCE(64, f32, AT_F32)
AT_INSTANCE(64, q8, AT_Q8)
AT_INSTANCE(64, x16, AT_X16)
AT_INSTANCE(128, f32, AT_F32)
AT_INSTANCE(128, q8, AT_Q8)
AT_INSTANCE(128, x16, AT_X16)
