"""Small-batch GEMMs (mmsb_q4_k.cu / mmsb_q6_k.cu): y[T, N] = W x for T <= MMSB_MAX_TOKENS (16) tokens of q8_1
activations, with the K-split plan that fills the GPU in one wave; on the current stream, no sync.

    y = mmsb(weight, act, out, sm_count)      # DeviceWeight [N, K], Q8Act [T, K] -> y [T, N]

Plan (plan()): row tiles of ROWS_PER_BLOCK; the kernel's resident blocks per SM (registers and
shared memory) times the SMs are the slots; parts = the K-split that fills them without a
second wave (each tile's parts sum in a fixed order, common.cuh mmq_split_reduce); the
activations of a block's K range are staged at once when they fit STAGE_BUDGET bytes, else in
stages of `ch` super-blocks.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from engine.gpu import kernels, registry

ROWS_PER_BLOCK = 64          # SB_ROWS of mmsb_common.cuh (4 warps x 16 weight rows)
THREADS = 128
MAX_PARTS = 16
STAGE_BUDGET = 48 * 1024     # shared memory of one activation stage (a block's whole K range if it fits)
SMEM_PER_SM = 228 * 1024     # sm_90, 1 KB of it reserved per block
_PAD = {"q4_k": 32, "q6_k": 16}  # SB4_PAD / SB6_PAD
KERNEL_FILE = {"q4_k": "mmsb_q4_k.cu", "q6_k": "mmsb_q6_k.cu"}


class SbPlan(NamedTuple):
    tiles: int        # row tiles of ROWS_PER_BLOCK
    parts: int        # K-parts per tile
    ch: int           # super-blocks per activation stage
    smem: int         # dynamic shared memory (bytes)
    per_sm: int       # resident blocks per SM


def smem_bytes(kind: str, ntt: int, ch: int) -> int:
    """SbLayout::smem: activations [8 ntt][ch 256 + PAD] int8 + (d8, s8) [ch 8][8 ntt] float2."""
    tp = 8 * ntt
    return tp * (ch * 256 + _PAD[kind]) + ch * 8 * tp * 8


def blocks_per_sm(regs: int, smem: int) -> int:
    by_regs = 65536 // (-(-max(regs, 1) // 8) * 8 * THREADS)
    by_smem = SMEM_PER_SM // (smem + 1024)
    return max(1, min(by_regs, by_smem, 2048 // THREADS, 32))


def plan(kind: str, T: int, N: int, K: int, sm_count: int, regs: int, max_parts: int = MAX_PARTS,
         parts: int | None = None) -> SbPlan:
    ntt = registry.mmsb_ntt(T)
    nsb = K // 256
    tiles = -(-N // ROWS_PER_BLOCK)
    per_sb = smem_bytes(kind, ntt, 1) - _PAD[kind] * 8 * ntt
    if parts is None:
        ch1 = max(1, min(nsb, STAGE_BUDGET // per_sb))
        slots = sm_count * blocks_per_sm(regs, smem_bytes(kind, ntt, ch1))
        parts = max(1, min(slots // tiles, nsb, max_parts))
    if not 1 <= parts <= max(1, nsb):
        raise ValueError(f"mmsb: {parts} parts for K={K}")
    span = -(-nsb // parts)                       # most super-blocks of one part
    ch = max(1, min(span, STAGE_BUDGET // per_sb))
    smem = smem_bytes(kind, ntt, ch)
    return SbPlan(tiles, parts, ch, smem, blocks_per_sm(regs, smem))


def mmsb(weight, act, out, sm_count: int, variant: str = registry.MMSB_VARIANT,
         parts: int | None = None, workspace=None):
    """out[T, N] = weight . act^T (T <= registry.MMSB_MAX_TOKENS). variant: MMSB_VARIANT or
    MMSB_VARIANT+"+splitP" (at most P parts); parts forces the K-split (tests). workspace(n_floats,
    n_slots) -> (float32 ws, uint32 counters) for parts > 1 (the MMQ tail-split buffers)."""
    T, K = act.tokens, act.cols
    N = weight.rows
    kind = weight.kind
    ntt = registry.mmsb_ntt(T)
    padded = bool(getattr(weight, "padded", False))
    name = registry.mmsb_instance(kind, ntt, padded)
    k = kernels.get_kernel(KERNEL_FILE[kind], name)
    cap = registry.split_max_parts(variant) if registry.mmq_split_name(variant)[1] else MAX_PARTS
    p = plan(kind, T, N, K, sm_count, int(k.num_regs), cap, parts)
    k = kernels.get_kernel(KERNEL_FILE[kind], name, dynamic_smem=p.smem)
    if p.parts > 1:
        ws, cnt = workspace(p.tiles * p.parts * ntt * 4 * THREADS, p.tiles)
    else:
        ws = cnt = out
    k((p.tiles, p.parts), (THREADS,), (weight.data, act.q, act.ds, out, np.int32(T), np.int32(N), np.int32(K),
                                       np.int32(p.ch), np.int32(p.parts), ws, cnt), shared_mem=p.smem)
    return out
