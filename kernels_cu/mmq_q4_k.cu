// mmq_q4_k.cu: y[T, N] = x[T, K] . W[N, K]^T with W in q4_K blocks and x in q8_1 blocks,
// int8 tensor cores (mma.sync m16n8k32 s8.s8.s32), f32 output, token-major rows.
//
// Inputs: W uint8 [N, K/256 * 144] (raw GGUF q4_K rows, 16-byte aligned base);
//         Aq int8 [T, K], Ads float2 [T, K/32] = (d8, s8) (quantize_q8_1.cu);
//         Y float32 [T, N]. Any T >= 1, N >= 1, K % 256 == 0.
// Formula (per 32-element sub-block g = 8 b + j of super-block b, engine.quants
// mmq_reference_q4_k):
//   y[t,n] = sum_g  (d[n,b] sc[n,g]) d8[t,g] sum_l q4[n,g,l] q8[t,g,l]
//                 - (dmin[n,b] m[n,g]) s8[t,g]
// One k32 MMA step = one sub-block = one q8_1 block. The MMA accumulates onto C = MMQ_MAGIC_I,
// so D read as a float is exactly M + dot (M = 1.5*2^23); then per element, three FFMAs:
//   u   = fma(D, dsc, -M*dsc)   = round(dot * dsc)   (exact operands: dsc = d*sc has <= 17
//                                                      significant bits, M*dsc <= 19)
//   acc = fma(u, d8, acc);  acc = fma(-dmm, s8, acc)     (dmm = dmin*m, exact)
//
// Tiles and staging (MmqShape in common.cuh): per stage (k = 128, half a super-block)
//   sA/sAds  q8_1 activations, cp.async, 3 buffers (see mmq_stage_a);
//   sB  [BN][64]  the stage's raw qs bytes (two 32-byte chunks), cp.async, 3 buffers,
//                 16-byte chunk ch of row r at ch ^ ((r >> 1) & 3) (conflict-free ldmatrix);
//                 one ldmatrix.x4 word serves two sub-blocks: low nibbles (& 0x0F0F0F0F) for
//                 sub-block 2c, high nibbles (>> 4) for 2c+1;
//   sTab[4][BN]   float d*sc per row and sub-block (-M d sc is formed in registers), then
//                 sTabM[4][BN] float -dmin*m (TCMIN: m) and [BN] -dmin; 2 buffers, written from
//                 the 16-byte block header prefetched into registers one stage ahead.
// One __syncthreads per stage; stage s+2 copies in flight while stage s is computed.
// Ragged T / N: zero-filled tiles (cp.async src-size 0) and guarded stores.
#include "common.cuh"

template <int MT, int NT, int WM, int WN>
struct Q4KLayout {
    using S = MmqShape<MT, NT, WM, WN>;
    static constexpr int B_BYTES = S::BN * 64;
    // float2 [4][BN] (dsc, -M dsc) + float [4][BN] (-dmin m, or m for TCMIN) + float [BN] -dmin
    static constexpr int TAB_BYTES = 4 * S::BN * 12 + S::BN * 4;
    static constexpr int OFF_ADS = MMQ_NSTAGE * S::A_BYTES;
    static constexpr int OFF_B = OFF_ADS + MMQ_NSTAGE * S::ADS_BYTES;
    static constexpr int OFF_TAB = OFF_B + MMQ_NSTAGE * B_BYTES;
    static constexpr int SMEM = OFF_TAB + 2 * TAB_BYTES;
};

template <int MT, int NT, int WM, int WN, int MINB, int TCMIN>
__global__ void __launch_bounds__(WM * WN * 32, MINB)
mmq_q4_k(const u8* __restrict__ W, const i8* __restrict__ Aq, const float2* __restrict__ Ads,
         float* __restrict__ Y, int T, int N, int K) {
    using S = MmqShape<MT, NT, WM, WN>;
    using L = Q4KLayout<MT, NT, WM, WN>;
    constexpr int NTH = S::NTH, BM = S::BM, BN = S::BN;
    static_assert(NT % 2 == 0, "NT must be even (one ldmatrix.x4 covers two n-tiles)");
    constexpr int NU = 2 * BN;                      // header units: (row, pair of sub-blocks)
    constexpr int UPT = (NU + NTH - 1) / NTH;

    extern __shared__ __align__(16) u8 smem[];
    if (dyn_smem_bytes() < (u32)L::SMEM) __trap();

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int wm = warp / WN, wn = warp % WN;
    const int m0 = wm * MT * 16, n0 = wn * NT * 8;
    const int n_base = blockIdx.x * BN, m_base = blockIdx.y * BM;
    const int nst = K / MMQ_KS;
    const size_t rb = (size_t)(K >> 8) * 144;
    const u32 sbase = smem_u32(smem);

    // ---- B (raw qs) cp.async for stage s into buffer bs
    auto stage_b = [&](int s, int bs) {
        const u32 sB = sbase + L::OFF_B + bs * L::B_BYTES;
        constexpr int NP = BN * 4;
#pragma unroll
        for (int i = 0; i < (NP + NTH - 1) / NTH; ++i) {
            const int p = tid + i * NTH;
            if (NP % NTH == 0 || p < NP) {
                const int row = p >> 2, ch = p & 3;
                const int n = n_base + row;
                const bool ok = n < N;
                const u8* src = W + (size_t)(ok ? n : 0) * rb + (size_t)(s >> 1) * 144 + 16
                              + (s & 1) * 64 + ch * 16;
                cp_async16(sB + row * 64 + ((ch ^ ((row >> 1) & 3)) << 4), src, ok ? 16 : 0);
            }
        }
    };
    auto stage = [&](int s, int bs) {
        mmq_stage_a<BM, NTH>(sbase + bs * S::A_BYTES, sbase + L::OFF_ADS + bs * S::ADS_BYTES,
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
                hdr[i] = __ldg(reinterpret_cast<const uint4*>(W + (size_t)n * rb + (size_t)(s >> 1) * 144));
        }
    };
    auto write_tab = [&](int s, int bt) {
        float* tab = reinterpret_cast<float*>(smem + L::OFF_TAB + bt * L::TAB_BYTES);
        float* tabm = tab + 4 * BN;
        const int h = s & 1;
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const int u = tid + i * NTH;
            if (NU % NTH == 0 || u < NU) {
                const int row = u % BN, pair = u / BN;
                const uint4 q = hdr[i];
                const float d = f16_to_f32((u16)(q.x & 0xFFFF));
                const float dmin = f16_to_f32((u16)(q.x >> 16));
                if (TCMIN && pair == 0) tabm[4 * BN + row] = -dmin;
#pragma unroll
                for (int cc = 0; cc < 2; ++cc) {
                    const int c = pair * 2 + cc;          // sub-block within the stage
                    const int sh = 8 * c;                 // byte c of scales words 0..2
                    const u32 b0 = (q.y >> sh) & 0xFF, b1 = (q.z >> sh) & 0xFF, b2 = (q.w >> sh) & 0xFF;
                    int sc, m;
                    if (h == 0) { sc = b0 & 63; m = b1 & 63; }
                    else        { sc = (b2 & 0xF) | ((b0 >> 6) << 4); m = (b2 >> 4) | ((b1 >> 6) << 4); }
                    const float dsc = d * (float)sc;
                    tab[c * BN + row] = dsc;
                    tabm[c * BN + row] = TCMIN ? (float)m : -(dmin * (float)m);
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

    // ---- prologue: stages 0 and 1 in flight, table 0 written, header 1 in registers
    stage(0, 0);
    cp_async_commit();
    if (nst > 1) stage(1, 1);
    cp_async_commit();
    load_hdr(0);
    write_tab(0, 0);
    if (nst > 1) load_hdr(1);

    const int lr = lane & 7;
    int bs = 0;                                   // buffer of stage s (s % 3)
    for (int s = 0; s < nst; ++s) {
        cp_async_wait<1>();                       // this thread's copies of stage s landed
        __syncthreads();                          // everyone's; stage s-1 fully consumed
        {
            const int bs2 = (bs >= 1) ? bs - 1 : 2;   // (s + 2) % 3
            if (s + 2 < nst) stage(s + 2, bs2);
            cp_async_commit();
        }
        const u32 sA = sbase + bs * S::A_BYTES;
        const float2* sAds = reinterpret_cast<const float2*>(smem + L::OFF_ADS + bs * S::ADS_BYTES);
        const u32 sB = sbase + L::OFF_B + bs * L::B_BYTES;
        const float* tab = reinterpret_cast<const float*>(smem + L::OFF_TAB + (s & 1) * L::TAB_BYTES);
        const float* tabm = tab + 4 * BN;
        const float* tabd = tabm + 4 * BN;

#pragma unroll 1
        for (int jp = 0; jp < 2; ++jp) {
            u32 braw[NT][2];
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
                const int row = n0 + (2 * np + (lane >> 4)) * 8 + lr;
                const int ch = 2 * jp + ((lane >> 3) & 1);
                ldmatrix_x4(braw[2 * np][0], braw[2 * np][1], braw[2 * np + 1][0], braw[2 * np + 1][1],
                            sB + row * 64 + ((ch ^ ((lr >> 1) & 3)) << 4));
            }
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int c = 2 * jp + hh;
                u32 b[NT][2];
                float4 rs[NT];
                float2 mm[NT];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    b[nt][0] = (braw[nt][0] >> (4 * hh)) & 0x0F0F0F0Fu;
                    b[nt][1] = (braw[nt][1] >> (4 * hh)) & 0x0F0F0F0Fu;
                {
                    // (dsc, -M dsc) of rows r, r+1: -M dsc is exact, computed here rather than
                    // loaded (shared-memory bandwidth, not ALU, is the tighter limit)
                    const float2 ds2 = *reinterpret_cast<const float2*>(tab + c * BN + n0 + nt * 8 + 2 * tig);
                    rs[nt] = make_float4(ds2.x, -MMQ_MAGIC_F * ds2.x, ds2.y, -MMQ_MAGIC_F * ds2.y);
                }
                    if (!TCMIN) mm[nt] = *reinterpret_cast<const float2*>(tabm + c * BN + n0 + nt * 8 + 2 * tig);
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    u32 a[4];
                    mmq_load_a(a, sA, m0 + mt * 16, c, lane);
                    float2 dl, dh;
                    if (TCMIN) {   // d8 only (the min term is done per stage)
                        dl.x = reinterpret_cast<const float*>(sAds)[2 * ((m0 + mt * 16 + g) * 4 + c)];
                        dh.x = reinterpret_cast<const float*>(sAds)[2 * ((m0 + mt * 16 + g + 8) * 4 + c)];
                        dl.y = dh.y = 0.0f;
                    } else {
                        dl = sAds[(m0 + mt * 16 + g) * 4 + c];
                        dh = sAds[(m0 + mt * 16 + g + 8) * 4 + c];
                    }
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        int d[4];
                        mma_s8_k32(d, a[0], a[1], a[2], a[3], b[nt][0], b[nt][1], MMQ_MAGIC_I);
                        float* o = acc[mt][nt];
                        // rs = (dsc, -M dsc) of rows r, r+1; mm = -dmm of rows r, r+1
                        o[0] = fmaf(fmaf(__int_as_float(d[0]), rs[nt].x, rs[nt].y), dl.x, o[0]);
                        if (!TCMIN) o[0] = fmaf(mm[nt].x, dl.y, o[0]);
                        o[1] = fmaf(fmaf(__int_as_float(d[1]), rs[nt].z, rs[nt].w), dl.x, o[1]);
                        if (!TCMIN) o[1] = fmaf(mm[nt].y, dl.y, o[1]);
                        o[2] = fmaf(fmaf(__int_as_float(d[2]), rs[nt].x, rs[nt].y), dh.x, o[2]);
                        if (!TCMIN) o[2] = fmaf(mm[nt].x, dh.y, o[2]);
                        o[3] = fmaf(fmaf(__int_as_float(d[3]), rs[nt].z, rs[nt].w), dh.x, o[3]);
                        if (!TCMIN) o[3] = fmaf(mm[nt].y, dh.y, o[3]);
                    }
                }
            }
        }

        if (TCMIN) {
            // min term of the stage on the tensor cores: Z[t, n] = sum_c s8[t, c] m[n, c]
            // (m16n8k4 TF32, s8 split hi + lo so the product keeps ~22 bits; m is exact),
            // then acc -= dmin * Z: one FFMA per output per stage instead of one per block.
            u32 shi[MT][2], slo[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float sv = sAds[(m0 + mt * 16 + g + 8 * h) * 4 + tig].y;
                    shi[mt][h] = f32_to_tf32(sv);
                    slo[mt][h] = f32_to_tf32(sv - __uint_as_float(shi[mt][h]));
                }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const u32 bm = __float_as_uint(tabm[tig * BN + n0 + nt * 8 + g]);
                const float2 nd = *reinterpret_cast<const float2*>(tabd + n0 + nt * 8 + 2 * tig);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mma_tf32_k4(z, shi[mt][0], shi[mt][1], bm);
                    mma_tf32_k4(z, slo[mt][0], slo[mt][1], bm);
                    float* o = acc[mt][nt];
                    o[0] = fmaf(nd.x, z[0], o[0]);
                    o[1] = fmaf(nd.y, z[1], o[1]);
                    o[2] = fmaf(nd.x, z[2], o[2]);
                    o[3] = fmaf(nd.y, z[3], o[3]);
                }
            }
        }

        if (s + 1 < nst) {
            write_tab(s + 1, (s + 1) & 1);
            if (s + 2 < nst) load_hdr(s + 2);
        }
        bs = (bs == 2) ? 0 : bs + 1;
    }

    mmq_store<MT, NT>(Y, acc, T, N, m_base + m0, n_base + n0, lane);
}
