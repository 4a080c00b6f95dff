"""Verification kernels (not on the forward path): q6k_expand_check.cu."""
from __future__ import annotations

import numpy as np

from engine.gpu import kernels
from engine.gpu.ops._util import check_dev


def q6k_expand_check(blocks_padded, blocks_raw):
    """The two q6_K B-staging arms of mmq_q6_k.cu on the same blocks (device arrays):
    blocks_padded uint8 [nblocks, 224] through the padded arm (uint4 loads + closed form),
    blocks_raw uint8 [nblocks, 210] through the raw arm (per-element byte map) ->
    (closed, raw), each int8 [nblocks, 256] centred values (poisoned with 127 first)."""
    import cupy as cp

    nb = int(blocks_padded.shape[0])
    check_dev(blocks_padded, np.uint8, (nb, 224), "q6k_expand_check padded blocks")
    check_dev(blocks_raw, np.uint8, (nb, 210), "q6k_expand_check raw blocks")
    closed = cp.full((nb, 256), 127, dtype=cp.int8)     # poison: never a centred q6 value
    raw = cp.full((nb, 256), 127, dtype=cp.int8)
    k = kernels.get_kernel("q6k_expand_check.cu", "q6k_expand_check")
    units = nb * 4
    k(((units + 255) // 256,), (256,), (blocks_padded, blocks_raw, closed, raw, np.int32(nb)))
    return closed, raw
