// q6k_expand_check.cu: verification kernel for the q6_K closed-form uint4 expansion.
//
// In:  blocks uint8 [nblocks, 224] (padded q6_K blocks, 16-byte aligned).
// Out: out_closed, out_elem int8 [nblocks, 256]: every element's centred value (q6 - 32),
//      out_closed from expand_q6_unit (3 uint4 loads + register recombination, the padded
//      MMQ arm), out_elem from expand_q6_elem (2 byte loads per element, the raw arm).
// One thread per unit (block b, half h, l0 in {0,16}): elements 128 h + 32 qq + l0 + i.
// Both must agree byte for byte (and with engine.quants.q6_k_fields).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
q6k_expand_check(const u8* __restrict__ blocks, i8* __restrict__ out_closed,
                 i8* __restrict__ out_elem, int nblocks) {
    const int u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u >= nblocks * 4) return;
    const int b = u >> 2, h = (u >> 1) & 1, l0 = (u & 1) * 16;
    const u8* blk = blocks + (size_t)b * 224;
    const uint4 ql0 = *reinterpret_cast<const uint4*>(blk + 64 * h + l0);
    const uint4 ql1 = *reinterpret_cast<const uint4*>(blk + 64 * h + 32 + l0);
    const uint4 qh = *reinterpret_cast<const uint4*>(blk + 128 + 32 * h + l0);
    uint4 oc[4], oe[4];
    expand_q6_unit(ql0, ql1, qh, oc);
    expand_q6_unit_elem(blk, h, l0, oe);
#pragma unroll
    for (int qq = 0; qq < 4; ++qq) {
        const size_t off = (size_t)b * 256 + h * 128 + qq * 32 + l0;
        *reinterpret_cast<uint4*>(out_closed + off) = oc[qq];
        *reinterpret_cast<uint4*>(out_elem + off) = oe[qq];
    }
}
