// argmax.cu: greedy token choice on the GPU, so only the token id has to come back.
//
// argmax_step (the decode step's greedy choice):
// In:  logits float32 [V].
// Out: the index of the largest logit, ties -> the lowest index, a NaN counting as the
//      largest (numpy.argmax semantics), written to
//        state[0]             the next step's input token (decode_fused.cu reads it),
//        hist[state[2]]       the token history (if state[2] < hist_cap), then state[2] += 1,
//        state[1] += 1        the next step's position,
//        best[0]              (optional, may be null) the chosen logit.
// One block of 1024 threads: each thread scans a strided slice in increasing index order
// (strict > keeps the first maximum), then a shared-memory tree merges (value, index) pairs
// with the same order (am_block_argmax).
//
// argmax_rows: the same choice for each of several rows (a batched step's logits), one block
// per row: grid = rows, row r over logits + r * ld (V values), ids[r] = its index,
// best[r] (optional, may be null) = its logit. No state, no history.
#include "common.cuh"

#define AM_NT 1024

__device__ __forceinline__ bool am_better(float v, int i, float bv, int bi) {
    // v at i beats bv at bi?  NaN is the largest value; equal values -> lower index
    const bool vn = v != v, bn = bv != bv;
    if (vn || bn) return vn && (!bn || i < bi);
    return v > bv || (v == bv && i < bi);
}

// The block's argmax of logits[0..V): (sv[0], si[0]) after the call, every thread past the
// last barrier. si[0] is out of 0..V-1 only for V == 0 (the callers map it to 0).
__device__ __forceinline__ void am_block_argmax(const float* __restrict__ logits, int V, float* sv, int* si) {
    const int tid = threadIdx.x;
    float bv = __int_as_float(0xff800000);   // -inf
    int bi = 0x7fffffff;
    for (int i = tid; i < V; i += AM_NT) {
        const float v = logits[i];
        if (am_better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    sv[tid] = bv;
    si[tid] = bi;
    __syncthreads();
    for (int n = AM_NT / 2; n > 0; n >>= 1) {
        if (tid < n && am_better(sv[tid + n], si[tid + n], sv[tid], si[tid])) {
            sv[tid] = sv[tid + n];
            si[tid] = si[tid + n];
        }
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(AM_NT)
argmax_step(const float* __restrict__ logits, int V, int* __restrict__ state,
            int* __restrict__ hist, int hist_cap, float* __restrict__ best) {
    pdl_entry_trigger();
    __shared__ float sv[AM_NT];
    __shared__ int si[AM_NT];
    am_block_argmax(logits, V, sv, si);
    if (threadIdx.x == 0) {
        int tok = si[0];
        if (tok < 0 || tok >= V) tok = 0;    // V == 0 or all -inf: never an out-of-range id
        state[0] = tok;
        const int c = state[2];
        if (c < hist_cap) hist[c] = tok;
        state[2] = c + 1;
        state[1] += 1;
        if (best) best[0] = sv[0];
    }
}

extern "C" __global__ void __launch_bounds__(AM_NT)
argmax_rows(const float* __restrict__ logits, int V, long long ld, int* __restrict__ ids,
            float* __restrict__ best) {
    pdl_entry();
    __shared__ float sv[AM_NT];
    __shared__ int si[AM_NT];
    const int r = blockIdx.x;
    am_block_argmax(logits + (size_t)r * ld, V, sv, si);
    if (threadIdx.x == 0) {
        int tok = si[0];
        if (tok < 0 || tok >= V) tok = 0;    // V == 0: never an out-of-range id
        ids[r] = tok;
        if (best) best[r] = sv[0];
    }
}
