// q6k_expand_check.cu: verification kernel of the two q6_K B-staging arms of mmq_q6_k.cu,
// through the very device functions those arms run (common.cuh):
//   padded arm: load_b's three uint4 loads (verbatim) + expand_q6_unit (closed form in registers);
//   raw arm:    expand_q6_group_raw (expand_q6_elem per element: the byte map, byte loads).
//
// In:  padded uint8 [nblocks, 224] (16-byte aligned blocks), raw uint8 [nblocks, 210] (the
//      same blocks in the GGUF layout, 2-byte aligned).
// Out: out_closed, out_raw int8 [nblocks, 256]: every element's centred value (q6 - 32).
// One thread per unit (block b, half h, l0 in {0,16}): elements 128 h + 32 qq + l0 + i.
// The seed's gate: out_closed == out_raw byte for byte (and == engine.formats.quants.q6_k_fields,
// checked on the host by tests/test_gpu_mmq.py).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
q6k_expand_check(const u8* __restrict__ padded, const u8* __restrict__ raw, i8* __restrict__ out_closed,
                 i8* __restrict__ out_raw, int nblocks) {
    pdl_entry();
    const int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= nblocks * 4) return;
    const int b = u >> 2, h = (u >> 1) & 1, l0b = u & 1, l0 = 16 * l0b;
    const u8* pblk = padded + (size_t)b * 224;
    // the loads of mmq_q6_k.cu load_b, verbatim
    const uint4 ql0 = __ldg(reinterpret_cast<const uint4*>(pblk + 64 * h + l0));
    const uint4 ql1 = __ldg(reinterpret_cast<const uint4*>(pblk + 64 * h + 32 + l0));
    const uint4 qh = __ldg(reinterpret_cast<const uint4*>(pblk + 128 + 32 * h + l0));
    uint4 oc[4];
    expand_q6_unit(ql0, ql1, qh, oc);
    const u8* rblk = raw + (size_t)b * 210;
#pragma unroll
    for (int qq = 0; qq < 4; ++qq) {
        const size_t off = (size_t)b * 256 + h * 128 + qq * 32 + l0;
        *reinterpret_cast<uint4*>(out_closed + off) = oc[qq];
        *reinterpret_cast<uint4*>(out_raw + off) = expand_q6_group_raw(rblk, h, qq, l0b);
    }
}
