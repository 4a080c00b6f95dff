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


def rows_per_block() -> int:
    """Output rows of one MMVQ block (the tails of swiglu_q8 / store_post need whole blocks per
    q8_1 group / head)."""
    return mmvq_warps() * ROWS_PER_WARP


def mmvq_launch(weights: Sequence, outs: Sequence, xq, xds, mode: str = "store", q8_out=None,
                post: tuple = ()) -> None:
    """y = W x for one q8_1 row (xq int8 [K], xds float32 [K/32, 2]) on the current stream.

    store:     up to 3 matrices of one kind, layout and K, outs[i] = W_i x.
    add:       one matrix, outs[0] += W x.
    swiglu:    weights = (gate, up) of one kind, outs[0] = silu(Wg x) * (Wu x).
    swiglu_q8: swiglu, and q8_out = (q int8 [N], ds float32 [N/32, 2], tickets uint32 [N/32],
               zeros before the first launch; each launch leaves them zero) gets the q8_1 of
               outs[0] in the same launch (the bits of quantize_row_q8).
    store_post: store into views of one [q | k | v] buffer, then qkv_post's bias + RoPE + f16
               K/V append in the same launch; post = qkv_post_args(...).
    """
    w0 = weights[0]
    kind, padded, K = w0.kind, bool(getattr(w0, "padded", False)), int(w0.cols)
    for w in weights:
        if w.kind != kind or bool(getattr(w, "padded", False)) != padded or int(w.cols) != K:
            raise ValueError("mmvq: matrices of one launch must share kind, layout and K")
    extra: tuple = ()
    if mode in ("swiglu", "swiglu_q8"):
        if len(weights) != 2 or weights[1].rows != w0.rows:
            raise ValueError(f"mmvq {mode}: needs (gate, up) with the same rows")
        segs = [w0]
        if mode == "swiglu_q8":
            extra = _q8_out_args(q8_out, int(w0.rows))
    elif mode == "add":
        if len(weights) != 1:
            raise ValueError(f"mmvq {mode}: one matrix")
        segs = [w0]
    else:
        if not 1 <= len(weights) <= 3:
            raise ValueError(f"mmvq {mode}: 1 to 3 matrices")
        segs = list(weights)
        if mode == "store_post":
            extra = _post_args(outs, post)
    grid, _, args = _segments(segs, weights, outs)
    k = kernels.get_kernel(KERNEL_FILE[kind], registry.mmvq_name(kind, mode, padded))
    if grid:
        k((grid,), (mmvq_warps() * 32,), args + (xq, xds, np.int32(K)) + extra)


def _q8_out_args(q8_out, n: int) -> tuple:
    """The (oq, ods, tickets) arguments of a swiglu_q8 launch with n output rows."""
    if q8_out is None or len(q8_out) != 3:
        raise ValueError("mmvq swiglu_q8: q8_out = (q, ds, tickets)")
    if n % 32 or 32 % rows_per_block():
        raise ValueError(f"mmvq swiglu_q8: {n} rows are no whole q8_1 groups of whole "
                         f"{rows_per_block()}-row blocks")
    q, ds, tickets = q8_out
    if q.dtype != np.int8 or q.size != n or ds.dtype != np.float32 or ds.size != n // 16 \
            or tickets.dtype != np.uint32 or tickets.size != n // 32:
        raise ValueError(f"mmvq swiglu_q8: q int8 [{n}], ds float32 [{n // 32}, 2], tickets uint32 [{n // 32}]")
    return q, ds, tickets


def _segments(segs: Sequence, weights: Sequence, outs: Sequence):
    """(grid, block boundaries (nb1, nb2), the kernels' w0..2, y0..2, n0..2, nb1, nb2 arguments)
    of up to 3 segments: blocks [0, nb1) segment 0, [nb1, nb2) segment 1, [nb2, grid) segment 2."""
    rpb = rows_per_block()
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


def mmvq_mixed_launch(weights: Sequence, outs: Sequence, xq, xds, post: tuple = ()) -> None:
    """store mode over q4_K and q6_K matrices in one launch (mmvq_mixed.cu; `mixes`): outs[i] =
    W_i x, the same bits as mmvq_launch over each kind's run; with post (qkv_post_args), the
    store_post form (mmvq_launch's)."""
    if not mixes(weights) or len(outs) != len(weights):
        raise ValueError("mmvq mixed: 2-3 matrices of one K, q4_K first, then q6_K of one layout, an out each")
    grid, (nb1, nb2), args = _segments(weights, weights, outs)
    b6 = (nb1, nb2)[[w.kind for w in weights].count("q4_k") - 1]    # the first q6_K block
    padded = bool(getattr(weights[-1], "padded", False))
    extra = _post_args(outs, post) if post else ()
    k = kernels.get_kernel(MIXED_FILE, registry.mmvq_mixed_name(padded, "store_post" if post else "store"))
    k((grid,), (mmvq_warps() * 32,), args + (xq, xds, np.int32(weights[0].cols), np.int32(b6)) + extra)


def _address(a) -> int:
    """Device (cupy) or host (the CPU emulator's numpy) address of an array's first element."""
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return int(iface["data"][0])


def _post_args(outs: Sequence, post: tuple) -> tuple:
    """post (qkv_post_args) after checking that every output is a run of whole heads of its qkv
    buffer (the kernel finds a row's head from the output's offset in qkv)."""
    if not post:
        raise ValueError("mmvq store_post: post = qkv_post_args(...)")
    qkv, hd = post[0], int(post[12])
    for y in outs:
        off, rem = divmod(_address(y) - _address(qkv), 4)
        if rem or off < 0 or off % hd or off + y.size > qkv.size or y.dtype != np.float32:
            raise ValueError(f"mmvq store_post: an output is no run of whole {hd}-row heads of the qkv buffer")
    return tuple(post)


def qkv_post_args(qkv_post: tuple, tickets) -> tuple:
    """The extra arguments of a store_post launch: decode_fused.cu qkv_post's arguments (qkv,
    bias or null, rcos, rsin, state, qrot, kc, vc, tok_stride, head_stride, H, KVH, HD, neox;
    kc / vc an f16 cache layer), then the tickets (uint32 [H + 2 KVH], zeros before the first
    launch; each launch leaves them zero)."""
    qkv, kc, vc = qkv_post[0], qkv_post[6], qkv_post[7]
    H, KVH, head_dim = (int(v) for v in qkv_post[10:13])
    nh = H + 2 * KVH
    if head_dim % rows_per_block():
        raise ValueError(f"mmvq store_post: head size {head_dim} is no whole {rows_per_block()}-row blocks")
    if qkv.dtype != np.float32 or qkv.size != nh * head_dim:
        raise ValueError(f"mmvq store_post: qkv float32 [{nh * head_dim}]")
    if kc.dtype != np.float16 or vc.dtype != np.float16:
        raise ValueError("mmvq store_post: an f16 K/V cache")
    if tickets.dtype != np.uint32 or tickets.size != nh:
        raise ValueError(f"mmvq store_post: tickets uint32 [{nh}]")
    return tuple(qkv_post) + (tickets,)
