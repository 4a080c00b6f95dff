// mmq_q4_k.cu: y[T, N] = x[T, K] . W[N, K]^T with W in q4_K blocks and x in q8_1 blocks,
// int8 tensor cores (mma.sync m16n8k32 s8.s8.s32), f32 output, token-major rows.
//
// Inputs: W uint8 [N, K/256 * 144] (raw GGUF q4_K rows, 16-byte aligned base);
//         Aq int8 [T, K], Ads float2 [T, K/32] = (d8, s8) (quantize_q8_1.cu);
//         Y float32 [T, N]. Any T >= 1, N >= 1, K % 256 == 0.
//         split0, parts, Wsp f32, Cnt u32: the tail split (Grid below).
// Formula (per 32-element sub-block g = 8 b + j of super-block b, engine.quants
// mmq_reference_q4_k):
//   y[t,n] = sum_g  (d[n,b] sc[n,g]) d8[t,g] sum_l q4[n,g,l] q8[t,g,l]
//                 - (dmin[n,b] m[n,g]) s8[t,g]
// One k32 MMA step = one sub-block = one q8_1 block. The MMA accumulates onto C = MMQ_MAGIC_I,
// so D read as a float is exactly M + dot (M = 1.5*2^23); then per element:
//   u   = fma(D, dsc, -M*dsc)   = round(dot * dsc)   (exact operands: dsc = d*sc has <= 17
//                                                      significant bits, M*dsc <= 19)
//   acc = fma(u, d8, acc)
// and the min term per stage on the tensor cores (TCMIN = 1, the only arm left; the per-block
// FFMA arm TCMIN = 0 was retired, dev/RETIRED.md): Z[t,n] = sum over the stage's blocks of s8[t,c] m[n,c] by
// TF32 MMAs (s8 split into hi + lo TF32 parts, m exact), then acc = fma(-dmin, Z, acc).
//
// Tiles and staging (MmqShape in common.cuh), per stage of KS = 128 or 256 k, 2 buffers:
//   sA/sAds  q8_1 activations, cp.async (mmq_stage_a);
//   sB  [BN][KS/2]  the stage's raw qs bytes, cp.async; 16-byte chunk ch of row r at
//                   ch ^ swz(r) (conflict-free ldmatrix); one ldmatrix word serves two
//                   sub-blocks: low nibbles (& 0x0F0F0F0F) for 2c, high nibbles (>> 4) for 2c+1;
//   sTab  [NC][BN] float d*sc (-M d sc is formed in registers), [NC][BN] float m,
//                  [BN] float -dmin; written from the 16-byte block header, which
//                  is prefetched into registers one stage ahead.
// One __syncthreads per stage. Ragged T / N: zero-filled tiles (cp.async src-size 0) and
// guarded stores.
// Grid: one block per output tile, (ceil(N / BN), ceil(T / BM)) (SPLIT = false). With the
// tail split the host launches that instance for the tiles [0, split0) and then the
// SPLIT = true instance for the rest (the last, partial wave): `parts` blocks per tile along
// K whose partial sums meet in the workspace Wsp / counters Cnt (common.cuh mmq_work /
// mmq_split_reduce; the host plan is engine.gpu_ops.split_plan).
#include "common.cuh"

template <int MT, int NT, int WM, int WN, int KS>
struct Q4KLayout {
    using S = MmqShape<MT, NT, WM, WN, KS>;
    static constexpr int RB = KS / 2;                       // qs bytes per row per stage
    static constexpr int B_BYTES = S::BN * RB;
    static constexpr int TAB_BYTES = 2 * S::NC * S::BN * 4 + S::BN * 4;
    static constexpr int OFF_ADS = MMQ_NBUF * S::A_BYTES;
    static constexpr int OFF_B = OFF_ADS + MMQ_NBUF * S::ADS_BYTES;
    static constexpr int OFF_TAB = OFF_B + MMQ_NBUF * B_BYTES;
    static constexpr int SMEM = OFF_TAB + 2 * TAB_BYTES;
    // swizzle of 16-byte chunks in a B row: 4 chunks per 64-byte row (pairs of rows share a
    // 128-byte bank line), 8 per 128-byte row
    __device__ static __forceinline__ int swz(int row) { return RB == 64 ? ((row >> 1) & 3) : (row & 7); }
};

template <int MT, int NT, int WM, int WN, int MINB, int KS, int TCMIN, bool SPLIT>
__global__ void __launch_bounds__(WM * WN * 32, MINB)
mmq_q4_k(const u8* __restrict__ W, const i8* __restrict__ Aq, const float2* __restrict__ Ads,
         float* __restrict__ Y, int T, int N, int K,
         int split0, int parts, float* __restrict__ Wsp, u32* __restrict__ Cnt) {
    pdl_entry();
    static_assert(TCMIN == 1, "the per-block min term (TCMIN = 0) was retired: dev/RETIRED.md");
    using S = MmqShape<MT, NT, WM, WN, KS>;
    using L = Q4KLayout<MT, NT, WM, WN, KS>;
    constexpr int NTH = S::NTH, BM = S::BM, BN = S::BN, NC = S::NC, RB = L::RB;
    static_assert(NT % 2 == 0, "NT must be even (one ldmatrix.x4 covers two n-tiles)");
    constexpr int NU = 2 * BN;                      // header units: (row, half of the stage's blocks)
    constexpr int UPT = (NU + NTH - 1) / NTH;
    constexpr int CPU = NC / 2;                     // blocks per header unit

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
    const size_t rb = (size_t)(K >> 8) * 144;
    const u32 sbase = smem_u32(smem);

    // ---- B (raw qs) cp.async for stage s into buffer bs: thread copies chunk tid % PRB of rows
    //      tid / PRB + i * (NTH / PRB)
    auto stage_b = [&](int s, int bs) {
        constexpr int PRB = RB / 16;
        constexpr int RSTEP = NTH / PRB;
        const int row0 = tid / PRB, ch = tid % PRB;
        const int k0 = s * KS;
        const u8* src0 = W + (size_t)(n_base + row0) * rb + (size_t)(k0 >> 8) * 144 + 16
                       + ((k0 & 255) >> 1) + ch * 16;
        const u32 dst0 = sbase + L::OFF_B + bs * L::B_BYTES + row0 * RB + ((ch ^ L::swz(row0)) << 4);
#pragma unroll
        for (int i = 0; i < (BN + RSTEP - 1) / RSTEP; ++i) {
            const int row = row0 + i * RSTEP;
            if (BN % RSTEP == 0 || row < BN) {
                const bool ok = n_base + row < N;
                const u8* src = ok ? src0 + (size_t)i * RSTEP * rb : W;
                cp_async16(dst0 + i * RSTEP * RB, src, ok ? 16 : 0);   // swz(row) == swz(row0)
            }
        }
    };
    auto stage = [&](int s, int bs) {
        mmq_stage_a<BM, NTH, KS>(sbase + bs * S::A_BYTES, sbase + L::OFF_ADS + bs * S::ADS_BYTES,
                                 Aq, Ads, m_base, T, K, s, tid);
        stage_b(s, bs);
    };

    // ---- block headers (d, dmin, scales) prefetched in registers, one stage ahead
    uint4 hdr[UPT];
    auto load_hdr = [&](int s) {
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const int u = tid + i * NTH;
            const int row = u % BN;
            const int n = n_base + row;
            hdr[i] = make_uint4(0, 0, 0, 0);
            if ((NU % NTH == 0 || u < NU) && n < N)
                hdr[i] = __ldg(reinterpret_cast<const uint4*>(W + (size_t)n * rb + (size_t)((s * KS) >> 8) * 144));
        }
    };
    auto write_tab = [&](int s, int bt) {
        float* tab = reinterpret_cast<float*>(smem + L::OFF_TAB + bt * L::TAB_BYTES);
        float* tabm = tab + NC * BN;
        const int j0 = ((s * KS) & 255) >> 5;             // first sub-block of the stage
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const int u = tid + i * NTH;
            if (NU % NTH == 0 || u < NU) {
                const int row = u % BN, part = u / BN;
                const uint4 q = hdr[i];
                const float d = f16_to_f32((u16)(q.x & 0xFFFF));
                const float dmin = f16_to_f32((u16)(q.x >> 16));
                if (part == 0) tabm[NC * BN + row] = -dmin;
#pragma unroll
                for (int cc = 0; cc < CPU; ++cc) {
                    const int c = part * CPU + cc;                // block within the stage
                    const int j = j0 + c;                         // sub-block within the super-block
                    const int sh = 8 * (j & 3);                   // byte j&3 of scales words 0..2
                    const u32 b0 = (q.y >> sh) & 0xFF, b1 = (q.z >> sh) & 0xFF, b2 = (q.w >> sh) & 0xFF;
                    int sc, m;
                    if (j < 4) { sc = b0 & 63; m = b1 & 63; }
                    else       { sc = (b2 & 0xF) | ((b0 >> 6) << 4); m = (b2 >> 4) | ((b1 >> 6) << 4); }
                    tab[c * BN + row] = d * (float)sc;
                    tabm[c * BN + row] = (float)m;
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

    // ---- prologue: stage s0 in flight, table s0 written, header s0+1 in registers
    stage(s0, 0);
    cp_async_commit();
    load_hdr(s0);
    write_tab(s0, 0);
    if (s0 + 1 < s1) load_hdr(s0 + 1);

    const int lr = lane & 7;
    for (int s = s0; s < s1; ++s) {
        const int bs = (s - s0) & 1;
        cp_async_wait<0>();                       // this thread's copies of stage s landed
        __syncthreads();                          // everyone's; stage s-1 fully consumed
        if (s + 1 < s1) stage(s + 1, bs ^ 1);
        cp_async_commit();

        const u32 sA = sbase + bs * S::A_BYTES;
        const float* sAdsf = reinterpret_cast<const float*>(smem + L::OFF_ADS + bs * S::ADS_BYTES);
        const u32 sB = sbase + L::OFF_B + bs * L::B_BYTES;
        const float* tab = reinterpret_cast<const float*>(smem + L::OFF_TAB + bs * L::TAB_BYTES);
        const float* tabm = tab + NC * BN;
        const float* tabd = tabm + NC * BN;

#pragma unroll 1
        for (int jp = 0; jp < NC / 2; ++jp) {
            u32 braw[NT][2];
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                const int row = n0 + (2 * np + (lane >> 4)) * 8 + lr;
                const int ch = 2 * jp + ((lane >> 3) & 1);
                ldmatrix_x4(braw[2 * np][0], braw[2 * np][1], braw[2 * np + 1][0], braw[2 * np + 1][1],
                            sB + row * RB + ((ch ^ L::swz(lr)) << 4));
            }
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int c = 2 * jp + hh;
                u32 b[NT][2];
                float4 rs[NT];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    b[nt][0] = (braw[nt][0] >> (4 * hh)) & 0x0F0F0F0Fu;
                    b[nt][1] = (braw[nt][1] >> (4 * hh)) & 0x0F0F0F0Fu;
                    // (dsc, -M dsc) of rows r, r+1: -M dsc is exact, formed here rather than
                    // loaded (shared-memory bandwidth, not ALU, is the tighter limit)
                    const float2 ds2 = *reinterpret_cast<const float2*>(tab + c * BN + n0 + nt * 8 + 2 * tig);
                    rs[nt] = make_float4(ds2.x, -MMQ_MAGIC_F * ds2.x, ds2.y, -MMQ_MAGIC_F * ds2.y);
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    u32 a[4];
                    mmq_load_a<KS>(a, sA, m0 + mt * 16, c, lane);
                    const int rl = m0 + mt * 16 + g;
                    const float dl = sAdsf[2 * (rl * NC + c)], dh = sAdsf[2 * ((rl + 8) * NC + c)];
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        int d[4];
                        mma_s8_k32(d, a[0], a[1], a[2], a[3], b[nt][0], b[nt][1], MMQ_MAGIC_I);
                        float* o = acc[mt][nt];
                        // rs = (dsc, -M dsc) of rows r, r+1
                        o[0] = fmaf(fmaf(__int_as_float(d[0]), rs[nt].x, rs[nt].y), dl, o[0]);
                        o[1] = fmaf(fmaf(__int_as_float(d[1]), rs[nt].z, rs[nt].w), dl, o[1]);
                        o[2] = fmaf(fmaf(__int_as_float(d[2]), rs[nt].x, rs[nt].y), dh, o[2]);
                        o[3] = fmaf(fmaf(__int_as_float(d[3]), rs[nt].z, rs[nt].w), dh, o[3]);
                    }
                }
            }
        }

        if (TCMIN) {
            // min term of the stage on the tensor cores: Z[t, n] = sum_c s8[t, c] m[n, c]
            // (TF32 m16n8k4 / k8, s8 split hi + lo so the product keeps ~22 bits; m is exact),
            // then acc -= dmin * Z: one FFMA per output per stage instead of one per block.
            constexpr int KH = NC / 4;            // 1: k4 (KS 128), 2: k8 (KS 256)
            u32 shi[MT][2][KH], slo[MT][2][KH];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int kh = 0; kh < KH; ++kh) {
                        const float sv = sAdsf[2 * ((m0 + mt * 16 + g + 8 * h) * NC + tig + 4 * kh) + 1];
                        shi[mt][h][kh] = f32_to_tf32(sv);
                        slo[mt][h][kh] = f32_to_tf32(sv - __uint_as_float(shi[mt][h][kh]));
                    }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                u32 bm[KH];
#pragma unroll
                for (int kh = 0; kh < KH; ++kh)
                    bm[kh] = __float_as_uint(tabm[(tig + 4 * kh) * BN + n0 + nt * 8 + g]);
                const float2 nd = *reinterpret_cast<const float2*>(tabd + n0 + nt * 8 + 2 * tig);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    if (KH == 1) {
                        mma_tf32_k4(z, shi[mt][0][0], shi[mt][1][0], bm[0]);
                        mma_tf32_k4(z, slo[mt][0][0], slo[mt][1][0], bm[0]);
                    } else {
                        mma_tf32_k8(z, shi[mt][0][0], shi[mt][1][0], shi[mt][0][KH - 1], shi[mt][1][KH - 1],
                                    bm[0], bm[KH - 1]);
                        mma_tf32_k8(z, slo[mt][0][0], slo[mt][1][0], slo[mt][0][KH - 1], slo[mt][1][KH - 1],
                                    bm[0], bm[KH - 1]);
                    }
                    float* o = acc[mt][nt];
                    o[0] = fmaf(nd.x, z[0], o[0]);
                    o[1] = fmaf(nd.y, z[1], o[1]);
                    o[2] = fmaf(nd.x, z[2], o[2]);
                    o[3] = fmaf(nd.y, z[3], o[3]);
                }
            }
        }

        if (s + 1 < s1) {
            write_tab(s + 1, bs ^ 1);
            if (s + 2 < s1) load_hdr(s + 2);
        }
    }

    if constexpr (SPLIT) {
        if (!mmq_split_reduce<MT, NT, NTH>(acc, wk, parts, Wsp, Cnt, tid)) return;
    }
    mmq_store<MT, NT>(Y, acc, T, N, m_base + m0, n_base + n0, lane);
}
