"""Fused residual add + RMSNorm + q8_1 (rmsnorm.cu): x += y; act = q8_1(rmsnorm(x) * w).

The decode step's row norm (decode_fused.cu rmsnorm_q8) is launched by engine.gpu.decode."""
from __future__ import annotations

import numpy as np

from engine.gpu import kernels
from engine.gpu.ops._util import contig, ptr

RMSNORM_MAX_K = 8192        # rmsnorm.cu RN_MAXJ * 256


def add_rmsnorm_q8_1(x, y, w, eps: float, act, hout=None) -> None:
    """Fused: if y is not None, x += y (in place); then act = q8_1(rmsnorm(x) * w) row by row.
    x, y float32 [R, K]; w float32 [K]; act Q8Act [R, K]; hout optional float32 [R, K]."""
    R, K = map(int, x.shape)
    if K % 256 or K > RMSNORM_MAX_K:
        raise ValueError(f"add_rmsnorm_q8_1: K={K} must be a multiple of 256 and <= {RMSNORM_MAX_K}")
    contig(x, np.float32, (R, K), "rmsnorm x")
    if y is not None:
        contig(y, np.float32, (R, K), "rmsnorm y")
    contig(w, np.float32, (K,), "rmsnorm w")
    contig(act.q, np.int8, (R, K), "rmsnorm act.q")
    contig(act.ds, np.float32, (R, K // 32, 2), "rmsnorm act.ds")
    if hout is not None:
        contig(hout, np.float32, (R, K), "rmsnorm hout")
    if R == 0:
        return
    k = kernels.get_kernel("rmsnorm.cu", "add_rmsnorm_q8_1")
    k((R,), (256,), (x, ptr(y), w, act.q, act.ds, ptr(hout), np.int32(K), np.float32(eps)))
