"""Greedy choice of several logit rows at once (argmax.cu argmax_rows): a batched step's tokens;
and the follow tokens of overlapped steps (follow_tokens.cu: each slot's latest greedy token
recorded on the device, and read by the next step in place of ids the host has not seen).

The decode step's own argmax (argmax_step: state and history updates, inside the decode graph)
is launched by engine.gpu.decode.
"""
from __future__ import annotations

import numpy as np

from engine.gpu import kernels
from engine.gpu.ops._util import contig, ptr

ARGMAX_THREADS = 1024       # argmax.cu AM_NT


def argmax_rows(logits_2d, ids_out, best_out=None) -> None:
    """ids_out[r] = argmax of logits_2d[r] (float32 [R, V], rows may be strided, each row
    contiguous): ties -> the lowest index, a NaN counts as the largest (numpy.argmax); a row of
    V == 0 gives 0. ids_out int32 [R]; best_out float32 [R] (the chosen logits) or None. One
    block per row, current stream."""
    if logits_2d.ndim != 2 or logits_2d.dtype != np.float32:
        raise ValueError(f"argmax_rows: expected float32 [rows, V], got {logits_2d.dtype.name}{list(logits_2d.shape)}")
    R, V = map(int, logits_2d.shape)
    item = logits_2d.itemsize
    if V > 1 and logits_2d.strides[1] != item:
        raise ValueError(f"argmax_rows: logits rows must be contiguous (strides {logits_2d.strides})")
    if logits_2d.strides[0] % item or (R > 1 and logits_2d.strides[0] < V * item):
        raise ValueError(f"argmax_rows: logits row stride {logits_2d.strides[0]} B for {V} values")
    ld = logits_2d.strides[0] // item if R > 1 else V
    contig(ids_out, np.int32, (R,), "argmax ids")
    if best_out is not None:
        contig(best_out, np.float32, (R,), "argmax best")
    if R == 0:
        return
    k = kernels.get_kernel("argmax.cu", "argmax_rows")
    k((R,), (ARGMAX_THREADS,), (logits_2d, np.int32(V), np.int64(ld), ids_out, ptr(best_out)))


def record_last(chosen, slot, last) -> None:
    """last[slot[j]] = chosen[j] for every j with slot[j] >= 0 (follow_tokens.cu).
    chosen, slot int32 [S]; last int32 [n_slots] (slot values < n_slots: the caller's check)."""
    S = int(chosen.shape[0])
    contig(chosen, np.int32, (S,), "record_last chosen")
    contig(slot, np.int32, (S,), "record_last slot")
    contig(last, np.int32, (int(last.shape[0]),), "record_last last")
    if S:
        kernels.get_kernel("follow_tokens.cu", "record_last")(
            (-(-S // 256),), (256,), (chosen, slot, last, np.int32(S)))


def resolve_follow(ids, last) -> None:
    """ids[t] = last[-ids[t] - 1] where ids[t] < 0 (follow_tokens.cu), in place.
    ids int32 [T]; last int32 [n_slots] (-ids - 1 < n_slots: the caller's check)."""
    T = int(ids.shape[0])
    contig(ids, np.int32, (T,), "resolve_follow ids")
    contig(last, np.int32, (int(last.shape[0]),), "resolve_follow last")
    if T:
        kernels.get_kernel("follow_tokens.cu", "resolve_follow")((-(-T // 256),), (256,), (ids, last, np.int32(T)))
