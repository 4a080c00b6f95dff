// mmsb_common.cuh: the skeleton of the small-batch GEMMs (mmsb_q4_k.cu, mmsb_q6_k.cu):
// y[T, N] = x[T, K] . W[N, K]^T for T <= 8 NTT tokens, int8 tensor cores with the WEIGHTS as the
// MMA's A operand (16 rows per m-tile) and the TOKENS as its B operand (8 columns per n-tile),
// so a few-token product is a few n-tiles and the time is set by streaming the weights once.
//
// Work split: block = SB_WARPS warps, each MR m-tiles = 16 MR weight rows (rows per block
// sb_rows(MR) = 64 MR), grid (ceil(N / sb_rows), parts): block (x, p) takes the super-blocks
// [p nsb / parts, (p+1) nsb / parts) of K (nsb = K / 256; the host picks parts so the grid fills
// the SMs). Each warp loads its weight rows straight into registers (no shared memory, no
// barrier on the weight path), D super-blocks ahead of their use (a ring of D register sets,
// D per instance); every activation fragment and scale read from shared memory serves the MR
// m-tiles (MR = 2 halves the shared-memory traffic per weight byte, what NTT >= 4 needs); the
// block's q8_1 activations are staged in shared memory `ch` super-blocks at a time, double-
// buffered (cp.async, all T tokens, zero rows past T; the next stage lands during this one):
//   sq  [ch][8 NTT][256 + PAD] int8, super-block-major, row = token (PAD: a bank-conflict-free
//       row stride); every fragment's offset from a lane's base is a compile-time constant
//       (8 nt RS + 32 j), so the shared loads need no address arithmetic;
//   sds [ch 8][8 NTT] float2 (d8, s8), q8_1-block-major so a lane's two tokens are one
//       16-byte load.
// Parts > 1: the partial sums meet in a workspace (common.cuh mmq_split_reduce: fixed order,
// the last block of a row tile to arrive sums and stores), so the result has the same bits
// whichever block finishes last.
//
// Accumulator layout (m16n8 D fragment, g = lane >> 2, t = lane & 3), per m-tile m, n-tile nt
// (row0 = the warp's first row + 16 m):
//   acc[m][nt][0] = (row0 + g, token 8 nt + 2t), [1] = (row0 + g, token 8 nt + 2t + 1),
//   acc[m][nt][2] = (row0 + g + 8, token 8 nt + 2t), [3] = (row0 + g + 8, token 8 nt + 2t + 1).
// A lane's weight rows: r = 2 m + h -> row row0_warp + 16 m + g + 8 h (Body::rows[r]).
#pragma once

#define SB_WARPS 4
#define SB_THREADS (32 * SB_WARPS)

__host__ __device__ constexpr int sb_rows(int mr) { return 16 * mr * SB_WARPS; }
// __launch_bounds__ minimum blocks per SM: MR = 1 (T <= 16) holds 3 (at most 168 registers; the
// compiler would take ~190 and leave 2), MR = 2 keeps every register it wants (2 blocks).
__host__ __device__ constexpr int sb_min_blocks(int mr) { return mr == 1 ? 3 : 1; }

#ifndef GGP_EMU   // PTX only (tensor cores, async copies)

// 8-byte weight load that skips L1 (each weight byte is read once).
__device__ __forceinline__ uint2 ld_stream8(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// 8-byte global -> shared copy through L1; src_bytes = 0 zero-fills.
__device__ __forceinline__ void cp_async8(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n"
                 :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// Shared-memory layout: `nbuf` stage buffers (2 when the block's K range needs more than one
// stage: stage k + 1 lands while stage k is consumed) of `ch` super-blocks each (ch: a kernel
// argument, the host's choice, registry/mmsb.plan).
template <int NTT, int PAD>
struct SbLayout {
    static constexpr int TP = 8 * NTT;                  // tokens staged (T rounded up to n-tiles)
    static constexpr int RS = 256 + PAD;                // sq row stride (bytes)
    static constexpr int SQ = TP * RS;                  // sq bytes of one super-block
    static constexpr int SDS = 8 * TP * 8;              // sds bytes of one super-block
    int ch, nbuf;
    __device__ __forceinline__ SbLayout(int ch_, int nbuf_) : ch(ch_), nbuf(nbuf_) {}
    __device__ __forceinline__ int smem() const { return nbuf * ch * (SQ + SDS); }
    __device__ __forceinline__ int sq_off(int b) const { return b * ch * SQ; }
    __device__ __forceinline__ int sds_off(int b) const { return nbuf * ch * SQ + b * ch * SDS; }
};

// Issue the copies of super-blocks [c0, c0 + n) into a stage buffer (sq, sds: its shared
// addresses); tokens >= T are zero-filled. Per super-block the thread -> chunk map is fixed
// (NTT 16-byte chunks and NTT / 2 (d8, s8) pairs per thread), so no division.
template <int NTT, int PAD>
__device__ __forceinline__ void sb_stage(u32 sq, u32 sds, const i8* __restrict__ Aq,
                                         const float2* __restrict__ Ads, int T, int K, int c0, int n, int tid) {
    using L = SbLayout<NTT, PAD>;
    constexpr int TP = L::TP;
    for (int b = 0; b < n; ++b) {
#pragma unroll
        for (int k = 0; k < TP * 16 / SB_THREADS; ++k) {
            const int i = tid + k * SB_THREADS, t = i >> 4, c = i & 15;
            const bool ok = t < T;
            const i8* src = ok ? Aq + (size_t)t * K + (size_t)(c0 + b) * 256 + c * 16 : Aq;
            cp_async16(sq + b * L::SQ + t * L::RS + c * 16, src, ok ? 16 : 0);
        }
#pragma unroll
        for (int k = 0; k < (TP * 8 + SB_THREADS - 1) / SB_THREADS; ++k) {
            const int i = tid + k * SB_THREADS, t = i >> 3, j = i & 7;
            if (i < TP * 8) {
                const bool ok = t < T;
                const float2* src = ok ? Ads + (size_t)t * (K >> 5) + (size_t)(c0 + b) * 8 + j : Ads;
                cp_async8(sds + b * L::SDS + (j * TP + t) * 8, src, ok ? 8 : 0);
            }
        }
    }
}

// The block's super-block range and, with parts > 1, its place in the split reduction.
__device__ __forceinline__ MmqWork sb_work(int nsb, int parts, int rows_per_block) {
    MmqWork w;
    w.slot = blockIdx.x;
    w.part = blockIdx.y;
    w.s0 = (int)((long long)blockIdx.y * nsb / parts);
    w.s1 = (int)((long long)(blockIdx.y + 1) * nsb / parts);
    w.n_base = blockIdx.x * rows_per_block;
    w.m_base = 0;
    return w;
}

// The K loop of a warp: `buf` is a ring of D register sets (Body::Sb), each loaded D
// super-blocks ahead of its use; the activations are staged `ch` super-blocks at a time,
// stage k + 1 issued as stage k starts (one block barrier per stage: it both publishes stage
// k and frees the buffer of stage k - 1; uniform: every warp walks the same super-blocks).
template <int NTT, int PAD, int D, class Body>
__device__ __forceinline__ void sb_loop(Body& body, const SbLayout<NTT, PAD>& L, const MmqWork& wk,
                                        const i8* __restrict__ Aq, const float2* __restrict__ Ads,
                                        int T, int K, u8* smem, int tid) {
    const u32 s_base = smem_u32(smem);
    typename Body::Sb buf[D];
#pragma unroll
    for (int r = 0; r < D; ++r)
        if (wk.s0 + r < wk.s1) body.load(buf[r], wk.s0 + r);
    sb_stage<NTT, PAD>(s_base + L.sq_off(0), s_base + L.sds_off(0), Aq, Ads, T, K, wk.s0,
                       min(L.ch, wk.s1 - wk.s0), tid);
    cp_async_commit();
    int c_begin = wk.s0, c_end = wk.s0, stage = -1;
    for (int base = wk.s0; base < wk.s1; base += D) {
#pragma unroll
        for (int r = 0; r < D; ++r) {
            const int sb = base + r;
            if (sb < wk.s1) {
                if (sb == c_end) {                           // stage + 1 begins
                    ++stage;
                    c_begin = sb;
                    c_end = min(sb + L.ch, wk.s1);
                    cp_async_wait<0>();
                    __syncthreads();
                    if (c_end < wk.s1) {
                        const int nb = (stage + 1) & 1;
                        sb_stage<NTT, PAD>(s_base + L.sq_off(nb), s_base + L.sds_off(nb), Aq, Ads, T, K,
                                           c_end, min(L.ch, wk.s1 - c_end), tid);
                        cp_async_commit();
                    }
                }
                const int i = sb - c_begin, cb = stage & 1;
                body.compute(buf[r], smem + L.sq_off(cb) + i * L.SQ,
                             reinterpret_cast<const float*>(smem + L.sds_off(cb) + i * L.SDS));
                if (sb + D < wk.s1) body.load(buf[r], sb + D);
            }
        }
    }
}

// acc -> y[t, n] (row-major [T, N]); rows >= N and tokens >= T are not stored.
template <int MR, int NTT>
__device__ __forceinline__ void sb_store(float* __restrict__ Y, const float (&acc)[MR][NTT][4], int T,
                                         int N, int row0, int lane) {
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int nt = 0; nt < NTT; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int n = row0 + 16 * m + g + 8 * (i >> 1);
                const int tok = 8 * nt + 2 * t4 + (i & 1);
                if (n < N && tok < T) Y[(size_t)tok * N + n] = acc[m][nt][i];
            }
        }
}

// The whole kernel body of both families: Body (Q4Body / Q6Body) holds the accumulators, the
// lane's 2 MR weight rows and the load / compute of one super-block of BS-byte blocks.
template <int NTT, int PAD, int D, int BS, class Body>
__device__ __forceinline__ void sb_gemm(const u8* __restrict__ W, const i8* __restrict__ Aq,
                                        const float2* __restrict__ Ads, float* __restrict__ Y, int T,
                                        int N, int K, int ch, int parts, float* __restrict__ Wsp,
                                        u32* __restrict__ Cnt) {
    // two stage buffers when the longest part (ceil(nsb / parts)) needs more than one stage
    const SbLayout<NTT, PAD> L(ch, ((K >> 8) + parts - 1) / parts > ch ? 2 : 1);
    extern __shared__ __align__(16) u8 smem[];
    if (dyn_smem_bytes() < (u32)L.smem()) __trap();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    constexpr int MR = Body::MR;
    const MmqWork wk = sb_work(K >> 8, parts, sb_rows(MR));
    const int row0 = wk.n_base + 16 * MR * warp;
    const size_t rb = (size_t)(K >> 8) * BS;
    Body body;
    body.g = lane >> 2;
    body.t4 = lane & 3;
#pragma unroll
    for (int r = 0; r < 2 * MR; ++r)      // rows past N: read row N-1, never stored
        body.rows[r] = W + (size_t)min(row0 + 16 * (r >> 1) + body.g + 8 * (r & 1), N - 1) * rb;
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int nt = 0; nt < NTT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) body.acc[m][nt][i] = 0.0f;
    sb_loop<NTT, PAD, D>(body, L, wk, Aq, Ads, T, K, smem, tid);
    if (parts > 1 && !mmq_split_reduce<MR, NTT, SB_THREADS>(body.acc, wk, parts, Wsp, Cnt, tid)) return;
    sb_store<MR, NTT>(Y, body.acc, T, N, row0, lane);
}

#endif  // GGP_EMU
