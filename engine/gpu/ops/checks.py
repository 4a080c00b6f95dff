"""Verification kernels (not on the forward path): q6k_expand_check.cu."""
from __future__ import annotations

import numpy as np

from engine.gpu import kernels
from engine.gpu.ops._util import check_dev


def q6k_expand_check(blocks_padded):
    """Verification kernel: padded q6_K blocks uint8 [nblocks, 224] (device) ->
    (closed-form expansion, per-element expansion), each int8 [nblocks, 256] centred values."""
    import cupy as cp

    nb = int(blocks_padded.shape[0])
    check_dev(blocks_padded, np.uint8, (nb, 224), "q6k_expand_check blocks")
    closed = cp.full((nb, 256), 127, dtype=cp.int8)     # poison: never a centred q6 value
    elem = cp.full((nb, 256), 127, dtype=cp.int8)
    k = kernels.get_kernel("q6k_expand_check.cu", "q6k_expand_check")
    units = nb * 4
    k(((units + 255) // 256,), (256,), (blocks_padded, closed, elem, np.int32(nb)))
    return closed, elem
