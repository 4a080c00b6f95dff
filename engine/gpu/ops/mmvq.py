"""MMVQ: y = W x for one q8_1 row (decode GEMVs, mmvq_q4_k.cu / mmvq_q6_k.cu) with its
epilogues (store / add / swiglu / addnorm), on the current stream."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.gpu import decode_instances as DK
from engine.gpu import kernels

MMVQ_NW = 4               # warps per MMVQ block (mmvq_*.cu)
NORM_MAX = 8192           # MMVQ addnorm: longest vector its last block normalizes
DEFAULT_ROWS_PER_WARP = 1
DEFAULT_UNROLL = 0        # MMVQ load batch (0: run 1's loop)


def _null():
    return np.uint64(0)


def _k(fname: str, name: str):
    return kernels.get_kernel(fname, name)


def mmvq_launch(weights: Sequence, outs: Sequence, xq, xds, mode: str = "store",
                rows_per_warp: int = DEFAULT_ROWS_PER_WARP, unroll: int = DEFAULT_UNROLL,
                norm: tuple | None = None) -> None:
    """y = W x for one q8_1 row (xq int8 [K], xds float32 [K/32, 2]) on the current stream.

    store:   up to 3 matrices of one kind, layout and K, outs[i] = W_i x.
    add:     one matrix, outs[0] += W x.
    swiglu:  weights = (gate, up) of one kind, outs[0] = silu(Wg x) * (Wu x).
    addnorm: add, then the launch's last block writes q8_1(rmsnorm(outs[0]) * nw) with
             norm = (nw, eps, oq, ods, counter uint32[1], zero between launches).
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
    elif mode in ("add", "addnorm"):
        if len(weights) != 1:
            raise ValueError(f"mmvq {mode}: one matrix")
        segs = [w0]
        if mode == "addnorm" and (norm is None or int(w0.rows) > NORM_MAX):
            raise ValueError(f"mmvq addnorm: needs norm=(...) and at most {NORM_MAX} rows")
    else:
        if not 1 <= len(weights) <= 3:
            raise ValueError("mmvq store: 1 to 3 matrices")
        segs = list(weights)
    rpb = MMVQ_NW * rows_per_warp
    nbs = [-(-int(w.rows) // rpb) for w in segs]
    grid = sum(nbs)
    nb1 = nbs[0]
    nb2 = nb1 + (nbs[1] if len(nbs) > 1 else 0)
    ws = [w.data for w in weights] + [w0.data] * (3 - len(weights))
    ys = list(outs) + [outs[0]] * (3 - len(outs))
    ns = [int(w.rows) for w in segs] + [0] * (3 - len(segs))
    if norm is None:
        tail = (_null(), np.float32(0), _null(), _null(), _null())
    else:
        nw, eps, oq, ods, counter = norm
        tail = (nw, np.float32(eps), oq, ods, counter)
    name = DK.mmvq_name(kind, rows_per_warp, mode, padded, unroll)
    k = _k("mmvq_q4_k.cu" if kind == "q4_k" else "mmvq_q6_k.cu", name)
    if grid:
        k((grid,), (MMVQ_NW * 32,), (ws[0], ws[1], ws[2], ys[0], ys[1], ys[2],
                                     np.int32(ns[0]), np.int32(ns[1]), np.int32(ns[2]),
                                     np.int32(nb1), np.int32(nb2), xq, xds, np.int32(K)) + tail)
