"""MMVQ: y = W x for one q8_1 row (the decode GEMVs, mmvq_q4_k.cu / mmvq_q6_k.cu) with their
epilogues (store / add / swiglu), on the current stream."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.gpu import kernels, registry

MMVQ_NW = 4               # warps per MMVQ block (mmvq_*.cu)
ROWS_PER_WARP = 1         # mmvq_*.cu instances (perf-log decode run 2; other arms: dev/RETIRED.md)
KERNEL_FILE = {"q4_k": "mmvq_q4_k.cu", "q6_k": "mmvq_q6_k.cu"}


def mmvq_launch(weights: Sequence, outs: Sequence, xq, xds, mode: str = "store") -> None:
    """y = W x for one q8_1 row (xq int8 [K], xds float32 [K/32, 2]) on the current stream.

    store:   up to 3 matrices of one kind, layout and K, outs[i] = W_i x.
    add:     one matrix, outs[0] += W x.
    swiglu:  weights = (gate, up) of one kind, outs[0] = silu(Wg x) * (Wu x).
    """
    w0 = weights[0]
    kind, padded, K = w0.kind, bool(getattr(w0, "padded", False)), int(w0.cols)
    for w in weights:
        if w.kind != kind or bool(getattr(w, "padded", False)) != padded or int(w.cols) != K:
            raise ValueError("mmvq: matrices of one launch must share kind, layout and K")
    if mode == "swiglu":
        if len(weights) != 2 or weights[1].rows != w0.rows:
            raise ValueError("mmvq swiglu: needs (gate, up) with the same rows")
        segs = [w0]
    elif mode == "add":
        if len(weights) != 1:
            raise ValueError(f"mmvq {mode}: one matrix")
        segs = [w0]
    else:
        if not 1 <= len(weights) <= 3:
            raise ValueError("mmvq store: 1 to 3 matrices")
        segs = list(weights)
    rpb = MMVQ_NW * ROWS_PER_WARP
    nbs = [-(-int(w.rows) // rpb) for w in segs]
    grid = sum(nbs)
    nb1 = nbs[0]
    nb2 = nb1 + (nbs[1] if len(nbs) > 1 else 0)
    ws = [w.data for w in weights] + [w0.data] * (3 - len(weights))
    ys = list(outs) + [outs[0]] * (3 - len(outs))
    ns = [int(w.rows) for w in segs] + [0] * (3 - len(segs))
    k = kernels.get_kernel(KERNEL_FILE[kind], registry.mmvq_name(kind, mode, padded))
    if grid:
        k((grid,), (MMVQ_NW * 32,), (ws[0], ws[1], ws[2], ys[0], ys[1], ys[2],
                                     np.int32(ns[0]), np.int32(ns[1]), np.int32(ns[2]),
                                     np.int32(nb1), np.int32(nb2), xq, xds, np.int32(K)))
