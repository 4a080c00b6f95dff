// mmq_q6_k.cu: y[T, N] = x[T, K] . W[N, K]^T with W in q6_K blocks and x in q8_1 blocks,
// int8 tensor cores (mma.sync m16n8k16 s8.s8.s32), f32 output, token-major rows.
//
// Inputs: W uint8 [N, K/256 * bstride], bstride = 210 (raw GGUF) or 224 (padded: the 210
//         bytes + 14 zero bytes, every block 16-byte aligned);
//         Aq int8 [T, K], Ads float2 [T, K/32] = (d8, s8) (quantize_q8_1.cu);
//         Y float32 [T, N]. Any T >= 1, N >= 1, K % 256 == 0.
//         split0, parts, Wsp f32, Cnt u32: the tail split (Grid below).
// Formula (16-element sub-blocks j; q8_1 block g = j / 2; engine.quants mmq_reference_q6_k):
//   y[t,n] = sum_g d8[t,g] * ( (d sc[n,2g]) dot16_lo + (d sc[n,2g+1]) dot16_hi )
//   dot16 = sum over 16 elements of (q6 - 32) * q8.
// The scale changes every 16 elements, so a q8_1 block (k32) is two m16n8k16 MMAs, each
// with its own integer dot, accumulated onto C = MMQ_MAGIC_I (D as a float = M + dot exactly,
// M = 1.5*2^23), then per element (four ops):
//   u = fma(D_lo, dsc_lo, -M dsc_lo) = round(dot_lo dsc_lo)    (dsc = d*sc: <= 19 significant
//   v = fma(D_hi, dsc_hi, -M dsc_hi) = round(dot_hi dsc_hi)     bits, M dsc <= 21: exact)
//   acc = fma(u + v, d8, acc)
// (An m16n8k32 would sum both halves under one scale; pre-scaling B by sc overflows int8.)
//
// B staging (per stage of KS = 128 or 256 k): the weight tile is expanded to centred int8
// (-32..31) in shared memory, sB [BN][KS] with 16-byte chunk ch of row r at ch ^ (r & 7),
// 2 buffers. A unit = (row, half h, l0 in {0,16}) = 64 elements 128 h + 32 qq + l0 + i:
//   padded arm ((bstride & 15) == 0): three uint4 loads ql[64h+l0..], ql[64h+32+l0..],
//     qh[32h+l0..] (all 16-byte aligned), prefetched into registers one stage ahead, then
//     expand_q6_unit (closed form in registers) -> four 16-byte
//     smem stores;
//   raw arm (210-byte rows, 2-byte aligned): expand_q6_group_raw, expand_q6_elem per element
//     (byte loads). kernels_cu/q6k_expand_check.cu runs these same functions.
// Both arms write identical bytes, so their outputs are bit-identical.
// sTab [KS/32][BN] float2 (dsc_lo, dsc_hi) per row and q8_1 block of the stage, 2 buffers
// (-M dsc is formed in registers: shared-memory bandwidth is the tighter limit).
// A (activations) as in mmq_q4_k.cu: cp.async, 2 buffers; one __syncthreads per stage.
//
// Grid: one block per output tile, (ceil(N / BN), ceil(T / BM)) (SPLIT = false). With the
// tail split the host launches that instance for the tiles [0, split0) and then the
// SPLIT = true instance for the rest (the last, partial wave): `parts` blocks per tile along
// K whose partial sums meet in the workspace Wsp / counters Cnt (common.cuh mmq_work /
// mmq_split_reduce; the host plan is engine.gpu_ops.split_plan).
#include "common.cuh"

template <int MT, int NT, int WM, int WN, int KS>
struct Q6KLayout {
    using S = MmqShape<MT, NT, WM, WN, KS>;
    static constexpr int B_BYTES = S::BN * KS;
    static constexpr int TAB_BYTES = S::NC * S::BN * 8;
    static constexpr int OFF_ADS = MMQ_NBUF * S::A_BYTES;
    static constexpr int OFF_B = OFF_ADS + MMQ_NBUF * S::ADS_BYTES;
    static constexpr int OFF_TAB = OFF_B + MMQ_NBUF * B_BYTES;
    static constexpr int SMEM = OFF_TAB + MMQ_NBUF * TAB_BYTES;
};

template <int MT, int NT, int WM, int WN, int MINB, int KS, int UNR, bool SPLIT>
__global__ void __launch_bounds__(WM * WN * 32, MINB)
mmq_q6_k(const u8* __restrict__ W, const i8* __restrict__ Aq, const float2* __restrict__ Ads,
         float* __restrict__ Y, int T, int N, int K, int bstride,
         int split0, int parts, float* __restrict__ Wsp, u32* __restrict__ Cnt) {
    pdl_entry();
    using S = MmqShape<MT, NT, WM, WN, KS>;
    using L = Q6KLayout<MT, NT, WM, WN, KS>;
    constexpr int NTH = S::NTH, BM = S::BM, BN = S::BN, NC = S::NC;
    static_assert(NT % 2 == 0, "NT must be even (one ldmatrix.x4 covers two n-tiles)");
    constexpr int NU = BN * (KS / 64);              // expansion units: (row, half, l0)
    constexpr int UPT = (NU + NTH - 1) / NTH;

    extern __shared__ __align__(16) u8 smem[];
    if (dyn_smem_bytes() < (u32)L::SMEM) __trap();

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int wm = warp / WN, wn = warp % WN;
    const int m0 = wm * MT * 16, n0 = wn * NT * 8;
    if (!SPLIT && mmq_no_tile(split0)) return;
    const MmqWork wk = mmq_work<BM, BN, SPLIT>(T, N, K / KS, split0, parts);
    const int n_base = wk.n_base, m_base = wk.m_base;
    const int s0 = wk.s0, s1 = wk.s1;               // this block's stages
    const size_t rb = (size_t)(K >> 8) * bstride;
    const bool padded = (bstride & 15) == 0;       // the uint4 gate
    const u32 sbase = smem_u32(smem);

    // ---- B prefetch registers (padded arm)
    uint4 pql0[UPT], pql1[UPT], pqh[UPT];
    uint2 psc[UPT];
    u32 pd[UPT];
    // unit u: row u % BN, q = u / BN -> half h = h0 + (q >> 1) of super-block (s KS) / 256,
    // l0 = 16 (q & 1); it expands the 64 elements 128 h + 32 qq + l0 + i (qq, i = 0..3, 0..15)
    auto load_b = [&](int s) {
        const int k0 = s * KS;
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const int u = tid + i * NTH;
            const int row = u % BN, q = u / BN;
            const int h = ((k0 & 255) >> 7) + (q >> 1), l0 = (q & 1) * 16;
            const int n = n_base + row;
            pql0[i] = pql1[i] = pqh[i] = make_uint4(0, 0, 0, 0);
            psc[i] = make_uint2(0, 0);
            pd[i] = 0;
            if (padded && (NU % NTH == 0 || u < NU) && n < N) {
                const u8* blk = W + (size_t)n * rb + (size_t)(k0 >> 8) * bstride;
                pql0[i] = __ldg(reinterpret_cast<const uint4*>(blk + 64 * h + l0));
                pql1[i] = __ldg(reinterpret_cast<const uint4*>(blk + 64 * h + 32 + l0));
                pqh[i] = __ldg(reinterpret_cast<const uint4*>(blk + 128 + 32 * h + l0));
                psc[i] = __ldg(reinterpret_cast<const uint2*>(blk + 192 + 8 * h));
                pd[i] = __ldg(reinterpret_cast<const u16*>(blk + 208));
            }
        }
    };
    auto store_b = [&](int s, int bb) {
        const u32 sB = sbase + L::OFF_B + bb * L::B_BYTES;
        float* tab = reinterpret_cast<float*>(smem + L::OFF_TAB + bb * L::TAB_BYTES);
        const int k0 = s * KS;
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const int u = tid + i * NTH;
            if (NU % NTH == 0 || u < NU) {
                const int row = u % BN, q = u / BN;
                const int hs = q >> 1, l0b = q & 1;             // half within the stage, l0 / 16
                const int h = ((k0 & 255) >> 7) + hs;           // half within the super-block
                const int n = n_base + row;
                const u32 rowB = sB + row * KS;
                if (padded || n >= N) {
                    // padded arm (or an out-of-range row: the prefetch registers are zero)
                    uint4 out[4];
                    expand_q6_unit(pql0[i], pql1[i], pqh[i], out);
                    const float d = f16_to_f32((u16)pd[i]);
#pragma unroll
                    for (int qq = 0; qq < 4; ++qq) {
                        const u32 w = (qq < 2) ? psc[i].x : psc[i].y;
                        const int sc = (int)(i8)((w >> (8 * ((2 * qq + l0b) & 3))) & 0xFF);
                        const int ch = 8 * hs + 2 * qq + l0b;
                        if (n >= N) out[qq] = make_uint4(0, 0, 0, 0);
                        st_shared_v4(rowB + ((ch ^ (row & 7)) << 4), out[qq]);
                        const float dsc = (n >= N) ? 0.0f : d * (float)sc;
                        tab[2 * ((4 * hs + qq) * BN + row) + l0b] = dsc;
                    }
                } else {
                    // raw arm: per-element byte loads (expand_q6_elem), one 16-byte group at a time
                    const u8* blk = W + (size_t)n * rb + (size_t)(k0 >> 8) * bstride;
                    const float d = f16_to_f32((u16)(blk[208] | (blk[209] << 8)));
#pragma unroll 1
                    for (int qq = 0; qq < 4; ++qq) {
                        const uint4 v = expand_q6_group_raw(blk, h, qq, l0b);
                        const int ch = 8 * hs + 2 * qq + l0b;
                        st_shared_v4(rowB + ((ch ^ (row & 7)) << 4), v);
                        const float dsc = d * (float)(int)(i8)blk[192 + 8 * h + 2 * qq + l0b];
                        tab[2 * ((4 * hs + qq) * BN + row) + l0b] = dsc;
                    }
                }
            }
        }
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

    // ---- prologue: stage s0 of A in flight, B/table s0 expanded, B s0+1 in registers
    mmq_stage_a<BM, NTH, KS>(sbase, sbase + L::OFF_ADS, Aq, Ads, m_base, T, K, s0, tid);
    cp_async_commit();
    load_b(s0);
    store_b(s0, 0);
    if (s0 + 1 < s1) load_b(s0 + 1);

    const int lr = lane & 7;
    for (int s = s0; s < s1; ++s) {
        const int bs = (s - s0) & 1;
        cp_async_wait<0>();
        __syncthreads();
        if (s + 1 < s1)
            mmq_stage_a<BM, NTH, KS>(sbase + (bs ^ 1) * S::A_BYTES, sbase + L::OFF_ADS + (bs ^ 1) * S::ADS_BYTES,
                                     Aq, Ads, m_base, T, K, s + 1, tid);
        cp_async_commit();
        const u32 sA = sbase + bs * S::A_BYTES;
        const float* sAdsf = reinterpret_cast<const float*>(smem + L::OFF_ADS + bs * S::ADS_BYTES);
        const u32 sB = sbase + L::OFF_B + bs * L::B_BYTES;
        const float* tab = reinterpret_cast<const float*>(smem + L::OFF_TAB + bs * L::TAB_BYTES);

#pragma unroll UNR
        for (int c = 0; c < NC; ++c) {          // UNR: blocks per loop body (1 or 2)
            // A fragments and d8 of every m-tile first, then one n-tile pair at a time (keeps
            // the live B fragments and scales to one pair: no spills at 128 registers)
            u32 a[MT][4];
            float dl[MT], dh[MT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mmq_load_a<KS>(a[mt], sA, m0 + mt * 16, c, lane);
                dl[mt] = sAdsf[2 * ((m0 + mt * 16 + g) * NC + c)];
                dh[mt] = sAdsf[2 * ((m0 + mt * 16 + g + 8) * NC + c)];
            }
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                u32 b[2][2];
                {
                    const int row = n0 + (2 * np + (lane >> 4)) * 8 + lr;
                    const int ch = 2 * c + ((lane >> 3) & 1);
                    ldmatrix_x4(b[0][0], b[0][1], b[1][0], b[1][1], sB + row * KS + ((ch ^ lr) << 4));
                }
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int nt = 2 * np + j;
                    // (dsc_lo, dsc_hi) of rows r, r+1; -M dsc is exact and formed here (4 FMUL)
                    // instead of loaded: shared-memory bandwidth is the tighter limit
                    const float4 t4 = *reinterpret_cast<const float4*>(tab + 2 * (c * BN + n0 + nt * 8 + 2 * tig));
                    const float4 ra = make_float4(t4.x, -MMQ_MAGIC_F * t4.x, t4.y, -MMQ_MAGIC_F * t4.y);
                    const float4 rb = make_float4(t4.z, -MMQ_MAGIC_F * t4.z, t4.w, -MMQ_MAGIC_F * t4.w);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        int lo[4], hi[4];
                        mma_s8_k16(lo, a[mt][0], a[mt][1], b[j][0], MMQ_MAGIC_I);
                        mma_s8_k16(hi, a[mt][2], a[mt][3], b[j][1], MMQ_MAGIC_I);
                        float* o = acc[mt][nt];
                        // ra / rb: (dsc_lo, -M dsc_lo, dsc_hi, -M dsc_hi) of rows r / r+1
#define Q6_TERM(D_LO, D_HI, R) (fmaf(__int_as_float(D_LO), R.x, R.y) + fmaf(__int_as_float(D_HI), R.z, R.w))
                        o[0] = fmaf(Q6_TERM(lo[0], hi[0], ra), dl[mt], o[0]);
                        o[1] = fmaf(Q6_TERM(lo[1], hi[1], rb), dl[mt], o[1]);
                        o[2] = fmaf(Q6_TERM(lo[2], hi[2], ra), dh[mt], o[2]);
                        o[3] = fmaf(Q6_TERM(lo[3], hi[3], rb), dh[mt], o[3]);
#undef Q6_TERM
                    }
                }
            }
        }

        if (s + 1 < s1) {
            store_b(s + 1, bs ^ 1);
            if (s + 2 < s1) load_b(s + 2);
        }
    }

    if constexpr (SPLIT) {
        if (!mmq_split_reduce<MT, NT, NTH>(acc, wk, parts, Wsp, Cnt, tid)) return;
    }
    mmq_store<MT, NT>(Y, acc, T, N, m_base + m0, n_base + n0, lane);
}
