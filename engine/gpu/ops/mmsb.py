"""Small-batch GEMMs (mmsb_q4_k.cu / mmsb_q6_k.cu): y[T, N] = W x for T <= MMSB_MAX_TOKENS tokens of q8_1
activations, with the K-split plan that fills the GPU; on the current stream, no sync.

    y = mmsb(weight, act, out, sm_count)      # DeviceWeight [N, K], Q8Act [T, K] -> y [T, N]

Plan (plan()): row tiles of rows_per_block(MR) (4 warps x MR m-tiles of 16 rows); the kernel's
resident blocks per SM (registers and shared memory) times the SMs are the slots; parts = the
K-split with the least predicted time, waves x (super-blocks per part + the partial sums' round
trip) (each tile's parts sum in a fixed order, common.cuh mmq_split_reduce); the activations
of a block's K range are staged `ch` = stage_sb() super-blocks at a time into two alternating
buffers (the next stage lands while this one is consumed; one buffer when one stage holds the
range).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from engine.gpu import kernels, registry

WARPS = 4                    # SB_WARPS of mmsb_common.cuh
THREADS = 32 * WARPS
MAX_PARTS = 16
STAGE_SB = 1                 # super-blocks per activation stage (double-buffered; 1 < 2 < 4 in
                             # time at T = 32, perf-log session 10)
SMEM_PER_SM = 228 * 1024     # sm_90, 1 KB of it reserved per block
_PAD = {"q4_k": 32, "q6_k": 16}  # SB4_PAD / SB6_PAD
_BLOCK_BYTES = {"q4_k": 144, "q6_k": 210}
KERNEL_FILE = {"q4_k": "mmsb_q4_k.cu", "q6_k": "mmsb_q6_k.cu"}


def rows_per_block(mr: int) -> int:
    """sb_rows of mmsb_common.cuh."""
    return 16 * mr * WARPS


class SbPlan(NamedTuple):
    tiles: int        # row tiles of rows_per_block(MR)
    parts: int        # K-parts per tile
    ch: int           # super-blocks per activation stage
    smem: int         # dynamic shared memory (bytes)
    per_sm: int       # resident blocks per SM


def smem_bytes(kind: str, ntt: int, ch: int, double: bool) -> int:
    """SbLayout::smem: per stage buffer (two when `double`), activations [ch][8 ntt][256 + PAD]
    int8 + (d8, s8) [ch 8][8 ntt] float2."""
    tp = 8 * ntt
    return (2 if double else 1) * ch * tp * (256 + _PAD[kind] + 8 * 8)


def blocks_per_sm(regs: int, smem: int) -> int:
    by_regs = 65536 // (-(-max(regs, 1) // 8) * 8 * THREADS)
    by_smem = SMEM_PER_SM // (smem + 1024)
    return max(1, min(by_regs, by_smem, 2048 // THREADS, 32))


def stage_sb() -> int:
    """Super-blocks per activation stage: STAGE_SB, or GGUF_PREFILL_MMSB_STAGE (a measurement
    switch, so stage sizes compare in one device call)."""
    v = os.environ.get("GGUF_PREFILL_MMSB_STAGE", "")
    if not v:
        return STAGE_SB
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"GGUF_PREFILL_MMSB_STAGE={v!r}: a positive number of super-blocks")
    return int(v)


def plan(kind: str, T: int, N: int, K: int, sm_count: int, regs: int, max_parts: int = MAX_PARTS,
         parts: int | None = None, mr: int = 1, stage: int | None = None) -> SbPlan:
    ntt = registry.mmsb_ntt(T)
    nsb = K // 256
    tiles = -(-N // rows_per_block(mr))
    stage = stage or stage_sb()
    if parts is None:
        slots = sm_count * blocks_per_sm(regs, smem_bytes(kind, ntt, min(stage, nsb), nsb > stage))
        # least waves x (super-blocks per part + the split's round trip of partial sums,
        # 2 x 4 bytes per row and staged token, in units of a super-block's bytes per row),
        # then fewest parts
        red = 8 * 8 * ntt / _BLOCK_BYTES[kind]
        parts = min(range(1, max(1, min(nsb, max_parts)) + 1),
                    key=lambda p: (-(-tiles * p // slots) * (-(-nsb // p) + (red if p > 1 else 0.0)), p))
    if not 1 <= parts <= max(1, nsb):
        raise ValueError(f"mmsb: {parts} parts for K={K}")
    span = -(-nsb // parts)                       # most super-blocks of one part
    ch = min(span, stage)
    smem = smem_bytes(kind, ntt, ch, span > ch)
    return SbPlan(tiles, parts, ch, smem, blocks_per_sm(regs, smem))


def mmsb(weight, act, out, sm_count: int, variant: str = registry.MMSB_VARIANT,
         parts: int | None = None, workspace=None):
    """out[T, N] = weight . act^T (T <= registry.MMSB_MAX_TOKENS). variant: MMSB_VARIANT or
    "mmsb.r<MR>d<D>" (registry.mmsb_config), optionally +"+splitP" (at most P parts); parts forces
    the K-split (tests). workspace(n_floats, n_slots) -> (float32 ws, uint32 counters) for
    parts > 1 (the MMQ tail-split buffers)."""
    T, K = act.tokens, act.cols
    N = weight.rows
    kind = weight.kind
    ntt = registry.mmsb_ntt(T)
    padded = bool(getattr(weight, "padded", False))
    mr = registry.mmsb_config(kind, ntt, variant)[0]
    name = registry.mmsb_instance(kind, ntt, padded, variant)
    k = kernels.get_kernel(KERNEL_FILE[kind], name)
    cap = registry.split_max_parts(variant) if registry.mmq_split_name(variant)[1] else MAX_PARTS
    p = plan(kind, T, N, K, sm_count, int(k.num_regs), cap, parts, mr=mr)
    k = kernels.get_kernel(KERNEL_FILE[kind], name, dynamic_smem=p.smem)
    if p.parts > 1:
        ws, cnt = workspace(p.tiles * p.parts * mr * ntt * 4 * THREADS, p.tiles)
    else:
        ws = cnt = out
    k((p.tiles, p.parts), (THREADS,), (weight.data, act.q, act.ds, out, np.int32(T), np.int32(N), np.int32(K),
                                       np.int32(p.ch), np.int32(p.parts), ws, cnt), shared_mem=p.smem)
    return out
