"""Small-batch GEMMs (mmsb_q4_k.cu / mmsb_q6_k.cu): y[T, N] = W x for T <= 128 tokens of q8_1
activations, with the K-split plan that fills the GPU; on the current stream, no sync.

    y = mmsb(weight, act, out)                # DeviceWeight [N, K], Q8Act [T, K] -> y [T, N]
"""
from __future__ import annotations

import numpy as np

from engine.gpu import kernels, registry
from engine.gpu.registry import SPLIT_MAX_PARTS

ROWS_PER_BLOCK = 64          # SB_ROWS of mmsb_common.cuh (4 warps x 16 weight rows)
THREADS = 128
BLOCKS_PER_SM = 3            # the grid the K-split aims at (the resident blocks per SM at ~160 registers)
MAX_PARTS = 16
_PAD = {"q4_k": 32, "q6_k": 16}  # SB4_PAD / SB6_PAD
CHUNK = 2                    # SB_CH: super-blocks of activations staged at a time
KERNEL_FILE = {"q4_k": "mmsb_q4_k.cu", "q6_k": "mmsb_q6_k.cu"}


def smem_bytes(kind: str, ntt: int) -> int:
    """Dynamic shared memory of an instance (SbLayout::SMEM; the kernel traps if given less)."""
    tp = 8 * ntt
    return tp * (CHUNK * 256 + _PAD[kind]) + CHUNK * 8 * tp * 8


def plan_parts(N: int, K: int, sm_count: int, max_parts: int = MAX_PARTS) -> int:
    """K-parts per row tile: enough blocks for BLOCKS_PER_SM per SM, at most one super-block
    per part and at most max_parts."""
    tiles = -(-N // ROWS_PER_BLOCK)
    want = -(-BLOCKS_PER_SM * sm_count // tiles)
    return max(1, min(want, K // 256, max_parts))


def mmsb(weight, act, out, sm_count: int, variant: str = registry.MMSB_VARIANT,
         parts: int | None = None, workspace=None):
    """out[T, N] = weight . act^T (T <= registry.MMSB_MAX_TOKENS). variant: MMSB_VARIANT or
    MMSB_VARIANT+"+splitP" (at most P parts); parts forces the plan (tests). workspace(n_floats,
    n_slots) -> (float32 ws, uint32 counters) for parts > 1 (the MMQ tail-split buffers)."""
    T, K = act.tokens, act.cols
    N = weight.rows
    kind = weight.kind
    ntt = registry.mmsb_ntt(T)
    if parts is None:
        cap = registry.split_max_parts(variant) if registry.mmq_split_name(variant)[1] else MAX_PARTS
        parts = plan_parts(N, K, sm_count, cap)
    if not 1 <= parts <= max(1, K // 256):
        raise ValueError(f"mmsb: {parts} parts for K={K}")
    tiles = -(-N // ROWS_PER_BLOCK)
    padded = bool(getattr(weight, "padded", False))
    smem = smem_bytes(kind, ntt)
    k = kernels.get_kernel(KERNEL_FILE[kind], registry.mmsb_instance(kind, ntt, padded), dynamic_smem=smem)
    if parts > 1:
        ws, cnt = workspace(tiles * parts * ntt * 4 * THREADS, tiles)
    else:
        ws = cnt = out
    k((tiles, parts), (THREADS,), (weight.data, act.q, act.ds, out, np.int32(T), np.int32(N), np.int32(K),
                                   np.int32(parts), ws, cnt), shared_mem=smem)
    return out
