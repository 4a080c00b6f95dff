// wgmma_pair.cu: one launch of the Hopper f16 GEMM (wgmma_common.cuh) over two matrices of one
// fused group whose types differ, on the same activations. Issues 12, 13: in q4_K_M files the q/k/v
// group of about half the layers is [Wq; Wk] q4_K beside Wv q6_K, two GEMMs of a few us each at
// 32 tokens, each leaving most SMs idle; one grid runs both.
//
//   Ya[T, Na] = x . Wa^T (q4_K, wgmma_q4_k.cu)      Yb[T, Nb] = x . Wb^T (q6_K, wgmma_q6_k.cu)
//
// Grid: x = token tile, y = row tile (Na / 128 tiles of Wa, then Nb / 128 of Wb), z = K part, as
// wg_block_tiles maps them; a block is the block of wgmma_q4_k / wgmma_q6_k with the same BT,
// STAGES, KP over its matrix, so the outputs equal those two launches' bit for bit. A row tile is
// uniform across a block and across a cluster (the KP parts of one tile share it), so the branch
// never splits a barrier.
#include "wgmma_q4_k.cu"
#include "wgmma_q6_k.cu"

// ROPE (ubatches of <= 32 tokens, wgmma_common.cuh): Wa = [Wq; Wk], Wb = Wv (its rows from
// global row Na on), Ya / Yb unused, the outputs rope.cu's.
template <bool PADDED, int BT, int STAGES, int KP, bool ROPE = false>
__device__ __forceinline__ void wgmma_pair_block(const u8* __restrict__ Wa, float* __restrict__ Ya, int Na,
                                                 const u8* __restrict__ Wb, float* __restrict__ Yb, int Nb,
                                                 const u8* __restrict__ Xt, int T, int K,
                                                 const WgRope* rope = nullptr) {
    const int tiles_a = Na / WG_ROWS, row = wg_block_tiles().row;
    if (row < tiles_a) {
        wgmma_gemm<WgQ4K, BT, STAGES, KP, false, ROPE>(Wa, Xt, Ya, T, Na, K, row, rope);
    } else if constexpr (ROPE) {
        WgRope rope_b = *rope;
        rope_b.row_base += Na;
        wgmma_gemm<WgQ6K<PADDED, wg_q6_pf<BT>()>, BT, STAGES, KP, false, true>(Wb, Xt, Yb, T, Nb, K, row - tiles_a,
                                                                               &rope_b);
    } else {
        wgmma_gemm<WgQ6K<PADDED, wg_q6_pf<BT>()>, BT, STAGES, KP>(Wb, Xt, Yb, T, Nb, K, row - tiles_a);
    }
}

// Two blocks per SM where both bodies fit them alone (padded q6_K, BT <= 64: 128 registers at
// most; unbounded, the larger body alone took 132 at BT = 64, one block per SM).
template <bool PADDED, int BT>
constexpr int wg_pair_min_blocks() { return PADDED && BT <= 64 ? 2 : 1; }

template <bool PADDED, int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, wg_pair_min_blocks<PADDED, BT>())
wgmma_pair(const u8* __restrict__ Wa, float* __restrict__ Ya, int Na, const u8* __restrict__ Wb,
           float* __restrict__ Yb, int Nb, const u8* __restrict__ Xt, int T, int K) {
    wgmma_pair_block<PADDED, BT, STAGES, 1>(Wa, Ya, Na, Wb, Yb, Nb, Xt, T, K);
}

template <bool PADDED, int BT, int STAGES, int KP>
__global__ void __cluster_dims__(1, 1, KP) __launch_bounds__(WG_THREADS, wg_pair_min_blocks<PADDED, BT>())
wgmma_pair_kp(const u8* __restrict__ Wa, float* __restrict__ Ya, int Na, const u8* __restrict__ Wb,
              float* __restrict__ Yb, int Nb, const u8* __restrict__ Xt, int T, int K) {
    wgmma_pair_block<PADDED, BT, STAGES, KP>(Wa, Ya, Na, Wb, Yb, Nb, Xt, T, K);
}

// The q|k|v GEMM with bias + RoPE + the K/V cache append fused (ROPE above):
// [Wq; Wk] q4_K beside Wv q6_K in one launch, the outputs rope.cu's.
template <bool PADDED, int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, wg_pair_min_blocks<PADDED, BT>())
wgmma_pair_rope(const u8* __restrict__ Wa, int Na, const u8* __restrict__ Wb, int Nb, const u8* __restrict__ Xt, int T,
                int K, WG_ROPE_PARAMS) {
    const WgRope rope = WG_ROPE_ARGS;
    wgmma_pair_block<PADDED, BT, STAGES, 1, true>(Wa, nullptr, Na, Wb, nullptr, Nb, Xt, T, K, &rope);
}

template <bool PADDED, int BT, int STAGES, int KP>
__global__ void __cluster_dims__(1, 1, KP) __launch_bounds__(WG_THREADS, wg_pair_min_blocks<PADDED, BT>())
wgmma_pair_rope_kp(const u8* __restrict__ Wa, int Na, const u8* __restrict__ Wb, int Nb, const u8* __restrict__ Xt,
                   int T, int K, WG_ROPE_PARAMS) {
    const WgRope rope = WG_ROPE_ARGS;
    wgmma_pair_block<PADDED, BT, STAGES, KP, true>(Wa, nullptr, Na, Wb, nullptr, Nb, Xt, T, K, &rope);
}

// Stream-K (wgmma_streamk.cuh, an A/B form): two deals in one grid, blocks 0 .. Ga - 1 over Wa's
// tiles (part, flags from their start), the others over Wb's (part after Ga blocks' slots, flags
// after Wa's tiles); a block's deal is uniform over it. ROPE: Wb's rows from global row Na on.
template <bool PADDED, int BT, int STAGES, bool ROPE>
__device__ __forceinline__ void wgmma_pair_sk_block(const u8* __restrict__ Wa, float* __restrict__ Ya, int Na,
                                                    const u8* __restrict__ Wb, float* __restrict__ Yb, int Nb,
                                                    const u8* __restrict__ Xt, int T, int K, float* __restrict__ part,
                                                    int* __restrict__ flags, int Ga, const WgRope* rope) {
    const int b = blockIdx.x;
    if (b < Ga) {
        wgmma_gemm_sk<WgQ4K, BT, STAGES, false, ROPE>(Wa, Xt, Ya, T, Na, K, part, flags, b, Ga, rope);
    } else {
        const int tiles_a = (T + BT - 1) / BT * (Na / WG_ROWS);
        float* part_b = part + (size_t)Ga * (BT / 2) * WG_THREADS;
        if constexpr (ROPE) {
            wgmma_gemm_sk<WgQ6K<PADDED, wg_q6_pf<BT>()>, BT, STAGES, false, true>(
                Wb, Xt, Yb, T, Nb, K, part_b, flags + tiles_a, b - Ga, gridDim.x - Ga, rope, Na);
        } else {
            wgmma_gemm_sk<WgQ6K<PADDED, wg_q6_pf<BT>()>, BT, STAGES, false>(Wb, Xt, Yb, T, Nb, K, part_b,
                                                                            flags + tiles_a, b - Ga, gridDim.x - Ga);
        }
    }
}

template <bool PADDED, int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, PADDED ? WG_SK_MIN_BLOCKS(BT) : 1)
wgmma_pair_sk(const u8* __restrict__ Wa, float* __restrict__ Ya, int Na, const u8* __restrict__ Wb,
              float* __restrict__ Yb, int Nb, const u8* __restrict__ Xt, int T, int K, float* __restrict__ part,
              int* __restrict__ flags, int Ga) {
    wgmma_pair_sk_block<PADDED, BT, STAGES, false>(Wa, Ya, Na, Wb, Yb, Nb, Xt, T, K, part, flags, Ga, nullptr);
}

template <bool PADDED, int BT, int STAGES>
__global__ void __launch_bounds__(WG_THREADS, PADDED ? WG_SK_MIN_BLOCKS(BT) : 1)
wgmma_pair_rope_sk(const u8* __restrict__ Wa, int Na, const u8* __restrict__ Wb, int Nb, const u8* __restrict__ Xt,
                   int T, int K, float* __restrict__ part, int* __restrict__ flags, int Ga, WG_ROPE_PARAMS) {
    const WgRope rope = WG_ROPE_ARGS;
    wgmma_pair_sk_block<PADDED, BT, STAGES, true>(Wa, nullptr, Na, Wb, nullptr, Nb, Xt, T, K, part, flags, Ga, &rope);
}
