// follow_tokens.cu: the input tokens of a batched step that the host has not seen yet
// (overlapped scheduling, engine/gpu/batch.py): a decoder's next token is the greedy choice the
// previous step made for its slot, still on the device when this step is launched.
//
// record_last: last[slot[j]] = chosen[j] for j < S with slot[j] >= 0
//      chosen int32 [S]   argmax_rows' ids of the step's wanted rows (argmax.cu)
//      slot   int32 [S]   the KV slot of each wanted row, -1 for padding rows
//      last   int32 [n_slots]  the latest greedy token of every slot
// resolve_follow: ids[t] = last[-ids[t] - 1] where ids[t] < 0 (a "follow" token of slot
//      -ids[t] - 1), other ids unchanged; T tokens.
// One thread per element, blocks of 256; launched in stream order (record_last at the end of a
// step, resolve_follow at the start of the next), both inside the step's CUDA graph.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
record_last(const int* __restrict__ chosen, const int* __restrict__ slot, int* __restrict__ last, int S) {
    pdl_entry();
    const int j = blockIdx.x * 256 + threadIdx.x;
    if (j < S && slot[j] >= 0) last[slot[j]] = chosen[j];
}

extern "C" __global__ void __launch_bounds__(256)
resolve_follow(int* __restrict__ ids, const int* __restrict__ last, int T) {
    pdl_entry();
    const int t = blockIdx.x * 256 + threadIdx.x;
    if (t < T && ids[t] < 0) ids[t] = last[-ids[t] - 1];
}
