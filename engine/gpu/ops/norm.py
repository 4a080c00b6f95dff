"""Fused residual add + RMSNorm + q8_1 (rmsnorm.cu): x += y; act = q8_1(rmsnorm(x) * w), or the
same rows as f16 in the Hopper GEMMs' tiled operand (add_rmsnorm_x16).

The decode step's row norm (decode_fused.cu rmsnorm_q8) is launched by engine.gpu.decode; a
batched step's head first gathers its wanted rows with the add done (gather_rows.cu)."""
from __future__ import annotations

import numpy as np

from engine.gpu import kernels
from engine.gpu.ops._util import contig, ptr

RMSNORM_MAX_K = 8192        # rmsnorm.cu RN_MAXJ * 256


def _check_inputs(op: str, x, y, w) -> tuple[int, int]:
    """(R, K) of the residual rows x, after checking x, y (or None) and the norm weight w."""
    R, K = map(int, x.shape)
    if K % 256 or K > RMSNORM_MAX_K:
        raise ValueError(f"{op}: K={K} must be a multiple of 256 and <= {RMSNORM_MAX_K}")
    contig(x, np.float32, (R, K), "rmsnorm x")
    if y is not None:
        contig(y, np.float32, (R, K), "rmsnorm y")
    contig(w, np.float32, (K,), "rmsnorm w")
    return R, K


def add_rmsnorm_q8_1(x, y, w, eps: float, act, hout=None) -> None:
    """Fused: if y is not None, x += y (in place); then act = q8_1(rmsnorm(x) * w) row by row.
    x, y float32 [R, K]; w float32 [K]; act Q8Act [R, K]; hout optional float32 [R, K]."""
    R, K = _check_inputs("add_rmsnorm_q8_1", x, y, w)
    contig(act.q, np.int8, (R, K), "rmsnorm act.q")
    contig(act.ds, np.float32, (R, K // 32, 2), "rmsnorm act.ds")
    if hout is not None:
        contig(hout, np.float32, (R, K), "rmsnorm hout")
    if R == 0:
        return
    k = kernels.get_kernel("rmsnorm.cu", "add_rmsnorm_q8_1")
    k((R,), (256,), (x, ptr(y), w, act.q, act.ds, ptr(hout), np.int32(K), np.float32(eps)))


def add_rmsnorm_x16(x, y, w, eps: float, xt) -> None:
    """add_rmsnorm_q8_1 with the normed rows h written as f16 into xt, the Hopper GEMMs' tiled
    operand float16 [K/64, ceil(R/8), 8, 8, 8] (engine.gpu.ops.wgmma.tiled_shape); the rows past R
    of xt are left as they are (zero from engine.gpu.ops.wgmma.tiled_buffer)."""
    from engine.gpu.ops.wgmma import tiled_shape

    R, K = _check_inputs("add_rmsnorm_x16", x, y, w)
    contig(xt, np.float16, tiled_shape(R, K), "rmsnorm xt")
    if R == 0:
        return
    k = kernels.get_kernel("rmsnorm.cu", "add_rmsnorm_x16")
    k((R,), (256,), (x, ptr(y), w, xt, np.int32(K), np.float32(eps)))


def gather_add_rows(x, y, sel, out) -> None:
    """out[r] = x[sel[r]] + y[sel[r]] (gather_rows.cu): the rows of a batched step whose
    logits are wanted, with the residual add done, for the head's add_rmsnorm_q8_1(out, None).
    x, y float32 [T, d]; sel int32 [R] on the device (0 <= sel < T: the caller's check);
    out float32 [R, d]."""
    T, d = map(int, x.shape)
    R = int(sel.shape[0])
    contig(x, np.float32, (T, d), "gather x")
    contig(y, np.float32, (T, d), "gather y")
    contig(sel, np.int32, (R,), "gather sel")
    contig(out, np.float32, (R, d), "gather out")
    if R == 0:
        return
    k = kernels.get_kernel("gather_rows.cu", "gather_add_rows")
    k((-(-d // 256), R), (256,), (x, y, sel, out, np.int32(d)))
