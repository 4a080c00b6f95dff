// gather_rows.cu: the rows of a batched step's residual stream whose logits are wanted
// (the last token of each sequence that chooses a token this step), for the output head.
//
// In:  x, y  float32 [T, d]   the residual stream and the last layer's ffn_down output
//      sel   int32 [R]        rows of x / y to take (0 <= sel[r] < T, checked on the host)
// Out: out   float32 [R, d]   out[r, i] = x[sel[r], i] + y[sel[r], i]
//      (the add that rmsnorm.cu fuses, rounded to nearest: the head's rmsnorm then runs on
//      out with no y, giving the same values as add_rmsnorm over the rows in place.)
// Grid: (ceil(d / 256), R); 256 threads, one element each.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
gather_add_rows(const float* __restrict__ x, const float* __restrict__ y, const int* __restrict__ sel,
                float* __restrict__ out, int d) {
    pdl_entry();
    const int r = blockIdx.y;
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i >= d) return;
    const size_t src = (size_t)sel[r] * d + i;
    out[(size_t)r * d + i] = __fadd_rn(x[src], y[src]);
}
