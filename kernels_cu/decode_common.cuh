// decode_common.cuh: device helpers shared by the decode kernels (mmvq_q4_k.cu, mmvq_q6_k.cu,
// decode_fused.cu, attention_decode.cu). Inlined after common.cuh by engine/kernels.py.
//
// q8_1_warp: the q8_1 block of 32 values held one per lane of a warp (engine.quants.quantize_q8_1):
//   d = amax / 127, q_i = amax == 0 ? 0 : roundf(x_i / d), s = d * sum(q) (integer sum, exact).
// mmvq_epilogue: an MMVQ warp's R row sums -> y (store / add / swiglu), and for MODE 3 the
//   addnorm tail: the last block of the launch writes q8_1(rmsnorm(y) * nw).
#pragma once

#define MMVQ_NW 4

// 16-byte weight load that skips L1 (each weight byte is used once). GGP_EMU: the CPU
// emulator of tests/cuda_emu (plain C++ in place of PTX).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
#ifndef GGP_EMU
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}

__device__ __forceinline__ float silu_ref(float g) {
    return __fdiv_rn(g, __fadd_rn(1.0f, expf(-g)));
}

// q8_1 of one 32-value block, lane i holding x_i; every lane writes its q, lane 0 writes (d, s).
// (quantize_q8_1.cu computes the same with non-.ftz PTX so that subnormal inputs match numpy
// too; these intrinsics also build in the CPU emulator, and decode activations are normal.)
__device__ __forceinline__ void q8_1_warp(float x, i8* __restrict__ q, float2* __restrict__ ds) {
    float amax = fabsf(x);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float d = __fdiv_rn(amax, 127.0f);
    const int qi = (__float_as_int(amax) == 0) ? 0 : (int)roundf(__fdiv_rn(x, d));
    *q = (i8)qi;
    int qsum = qi;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) qsum += __shfl_xor_sync(0xffffffffu, qsum, off);
    if ((threadIdx.x & 31) == 0) *ds = make_float2(d, __fmul_rn(d, (float)qsum));
}

// ---------------------------------------------------------------- MMVQ epilogue

#define MMVQ_NORM_MAX 8192     // MODE 3: largest vector the last block normalizes (shared memory)

// MODE 3 tail, run by the last block of the launch to finish (after every row of y was
// written): q8_1 of rmsnorm(y) * nw (decode_fused.cu rmsnorm_q8, the same formulas), so the
// next GEMV's input is ready without a separate launch. y is read through L2 (ld.cg).
__device__ __forceinline__ void mmvq_norm_tail(const float* __restrict__ y, int K,
                                               const float* __restrict__ nw, float eps,
                                               i8* __restrict__ oq, float2* __restrict__ ods) {
    __shared__ float xs[MMVQ_NORM_MAX];
    __shared__ float red[MMVQ_NW];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float ss = 0.0f;
    for (int k = tid; k < K; k += MMVQ_NW * 32) {
        const float v = __ldcg(y + k);
        xs[k] = v;
        ss += v * v;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < MMVQ_NW; ++w) t += red[w];
    const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(t, (float)K), eps)));
    for (int blk = warp; blk < (K >> 5); blk += MMVQ_NW) {
        const int k = blk * 32 + lane;
        const float h = __fmul_rn(__fmul_rn(xs[k], r), nw[k]);
        q8_1_warp(h, oq + k, ods + blk);
    }
}

// Row sums -> outputs (lane i of the warp stores row row0 + i), then the MODE 3 tail.
template <int R, int MODE, int NR>
__device__ __forceinline__ void mmvq_epilogue(float (&acc)[NR], bool active, int row0, int N,
                                              float* __restrict__ Y, const float* __restrict__ nw,
                                              float eps, i8* __restrict__ oq,
                                              float2* __restrict__ ods,
                                              unsigned* __restrict__ counter) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < NR; ++i) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], off);
    }
    if (active && lane < R && row0 + lane < N) {
        float v = acc[0], u = (MODE == 2) ? acc[R] : 0.0f;
#pragma unroll
        for (int i = 1; i < R; ++i) {
            if (lane == i) {
                v = acc[i];
                if (MODE == 2) u = acc[R + i];
            }
        }
        const int n = row0 + lane;
        if (MODE == 0) Y[n] = v;
        else if (MODE == 2) Y[n] = __fmul_rn(silu_ref(v), u);
        else Y[n] += v;
    }
    if constexpr (MODE == 3) {
        __shared__ unsigned last;
        __threadfence();                     // this block's rows are visible device-wide
        __syncthreads();
        if (threadIdx.x == 0) last = (atomicAdd(counter, 1u) == gridDim.x - 1);
        __syncthreads();
        if (last) {
            __threadfence();
            mmvq_norm_tail(Y, N, nw, eps, oq, ods);
            if (threadIdx.x == 0) *counter = 0u;    // re-armed for the next launch / replay
        }
    }
}
