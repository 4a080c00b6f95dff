"""MMVQ: y = W x for one q8_1 row (the decode GEMVs, mmvq_q4_k.cu / mmvq_q6_k.cu) with their
epilogues (store / add / swiglu), and q4_K beside q6_K matrices in one store launch
(mmvq_mixed.cu), on the current stream."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.gpu import kernels, registry

MMVQ_NW = 4               # warps (one row each) per MMVQ block: decode_common.cuh's default
ROWS_PER_WARP = 1         # mmvq_*.cu instances (perf-log decode run 2; other arms: dev/RETIRED.md)
KERNEL_FILE = {"q4_k": "mmvq_q4_k.cu", "q6_k": "mmvq_q6_k.cu"}
MIXED_FILE = "mmvq_mixed.cu"


def mmvq_warps() -> int:
    """Warps per MMVQ block: MMVQ_NW unless an A/B run sets the define through
    GGUF_PREFILL_KERNEL_DEFINES."""
    return kernels.define_value("MMVQ_NW", MMVQ_NW)


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
    grid, _, args = _segments(segs, weights, outs)
    k = kernels.get_kernel(KERNEL_FILE[kind], registry.mmvq_name(kind, mode, padded))
    if grid:
        k((grid,), (mmvq_warps() * 32,), args + (xq, xds, np.int32(K)))


def _segments(segs: Sequence, weights: Sequence, outs: Sequence):
    """(grid, block boundaries (nb1, nb2), the kernels' w0..2, y0..2, n0..2, nb1, nb2 arguments)
    of up to 3 segments: blocks [0, nb1) segment 0, [nb1, nb2) segment 1, [nb2, grid) segment 2."""
    rpb = mmvq_warps() * ROWS_PER_WARP
    nbs = [-(-int(w.rows) // rpb) for w in segs]
    nb1 = nbs[0]
    nb2 = nb1 + (nbs[1] if len(nbs) > 1 else 0)
    ws = [w.data for w in weights] + [weights[0].data] * (3 - len(weights))
    ys = list(outs) + [outs[0]] * (3 - len(outs))
    ns = [int(w.rows) for w in segs] + [0] * (3 - len(segs))
    return sum(nbs), (nb1, nb2), (*ws, *ys, *(np.int32(n) for n in ns), np.int32(nb1), np.int32(nb2))


def mixes(weights: Sequence) -> bool:
    """Whether mmvq_mixed_launch takes these matrices: 2 or 3 of one K, q4_K ones first, then
    q6_K ones of one layout, at least one of each."""
    kinds = [w.kind for w in weights]
    n4 = kinds.count("q4_k")
    return (2 <= len(weights) <= 3 and 1 <= n4 < len(weights) and kinds == ["q4_k"] * n4 + ["q6_k"] * (len(kinds) - n4)
            and len({int(w.cols) for w in weights}) == 1
            and len({bool(getattr(w, "padded", False)) for w in weights[n4:]}) == 1)


def mmvq_mixed_launch(weights: Sequence, outs: Sequence, xq, xds) -> None:
    """store mode over q4_K and q6_K matrices in one launch (mmvq_mixed.cu; `mixes`): outs[i] =
    W_i x, the same bits as mmvq_launch over each kind's run."""
    if not mixes(weights) or len(outs) != len(weights):
        raise ValueError("mmvq mixed: 2-3 matrices of one K, q4_K first, then q6_K of one layout, an out each")
    grid, (nb1, nb2), args = _segments(weights, weights, outs)
    b6 = (nb1, nb2)[[w.kind for w in weights].count("q4_k") - 1]    # the first q6_K block
    padded = bool(getattr(weights[-1], "padded", False))
    k = kernels.get_kernel(MIXED_FILE, registry.mmvq_mixed_name(padded))
    k((grid,), (mmvq_warps() * 32,), args + (xq, xds, np.int32(weights[0].cols), np.int32(b6)))
