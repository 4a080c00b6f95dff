"""q8_1 activations on the device (Q8Act) and the plain quantizer (quantize_q8_1.cu).

The fused producers (norm.add_rmsnorm_q8_1, activation.swiglu_q8_1, attention_prefill with
out_act) write the same layout: q int8 [T, K], ds float32 [T, K/32, 2] = (d, s).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from engine.gpu import kernels
from engine.gpu.ops._util import check_dev


class Q8Act(NamedTuple):
    """q8_1 activations on the device: q int8 [T, K]; ds float32 [T, K/32, 2] = (d, s)."""
    q: object
    ds: object

    @property
    def tokens(self) -> int:
        return int(self.q.shape[0])

    @property
    def cols(self) -> int:
        return int(self.q.shape[1])


def quantize_q8_1(x, out: Q8Act | None = None) -> Q8Act:
    """f32 activations [T, K] (K % 32 == 0) -> q8_1 blocks, bit-identical to
    engine.formats.quants.quantize_q8_1 (d = ds[..., 0], s = ds[..., 1])."""
    import cupy as cp

    if x.ndim != 2 or x.shape[1] % 32:
        raise ValueError(f"quantize_q8_1: expected [T, K] with K % 32 == 0, got {x.shape}")
    T, K = map(int, x.shape)
    check_dev(x, np.float32, (T, K), "quantize_q8_1 x")
    if out is None:
        out = Q8Act(cp.empty((T, K), dtype=cp.int8), cp.empty((T, K // 32, 2), dtype=cp.float32))
    else:
        check_dev(out.q, np.int8, (T, K), "quantize_q8_1 out.q")
        check_dev(out.ds, np.float32, (T, K // 32, 2), "quantize_q8_1 out.ds")
    nblk = T * K // 32
    if nblk:
        k = kernels.get_kernel("quantize_q8_1.cu", "quantize_q8_1")
        threads = 256
        grid = (nblk * 32 + threads - 1) // threads
        k((grid,), (threads,), (x, out.q, out.ds, np.int64(nblk)))
    return out
