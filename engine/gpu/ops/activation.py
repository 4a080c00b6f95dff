"""SwiGLU + q8_1 of the prefill FFN (swiglu.cu): act = q8_1(silu(g) * u), or silu(g) * u as f16
in the Hopper GEMMs' tiled operand (swiglu_x16)."""
from __future__ import annotations

import numpy as np

from engine.gpu import kernels
from engine.gpu.ops._util import contig


def swiglu_q8_1(g, u, ld: int, F: int, act) -> None:
    """act = q8_1(silu(g) * u): g, u float32 views of T rows with row stride ld (elements),
    F columns each (F % 32 == 0); act Q8Act [T, F]."""
    T = int(act.q.shape[0])
    if F % 32:
        raise ValueError(f"swiglu_q8_1: F={F} is not a multiple of 32")
    contig(act.q, np.int8, (T, F), "swiglu act.q")
    contig(act.ds, np.float32, (T, F // 32, 2), "swiglu act.ds")
    if ld % 4:
        raise ValueError(f"swiglu_q8_1: row stride {ld} is not a multiple of 4 (float4 loads)")
    n4 = T * F // 4
    if n4 == 0:
        return
    k = kernels.get_kernel("swiglu.cu", "swiglu_q8_1")
    k(((n4 + 255) // 256,), (256,), (g, u, np.int64(ld), np.int32(F), act.q, act.ds, np.int64(n4)))


def swiglu_x16(g, u, ld: int, F: int, xt, T: int) -> None:
    """xt = tiled f16 of silu(g) * u (the same h as swiglu_q8_1) for T rows: g, u as there; xt
    float16 [F/64, ceil(T/8), 8, 8, 8] (engine.gpu.ops.wgmma.tiled_shape), rows past T untouched."""
    from engine.gpu.ops.wgmma import tiled_shape

    if F % 256:
        raise ValueError(f"swiglu_x16: F={F} is not a multiple of 256")
    if ld % 4:
        raise ValueError(f"swiglu_x16: row stride {ld} is not a multiple of 4 (float4 loads)")
    contig(xt, np.float16, tiled_shape(T, F), "swiglu xt")
    if T * F == 0:
        return
    k = kernels.get_kernel("swiglu.cu", "swiglu_x16")
    k((F // 256, (T + 7) // 8), (256,), (g, u, np.int64(ld), np.int32(F), np.int32(T), xt))
