"""Bias + RoPE + f16 of the prefill q/k/v, K/V written into the cache (rope.cu)."""
from __future__ import annotations

import math

import numpy as np

from engine.gpu import kernels
from engine.gpu.ops._util import contig, ptr


def qkv_rope(q, k, v, lds: tuple[int, int, int], bq, bk, bv, cos, sin, qout, kc, vc, start: int, neox: bool,
             n_heads: int, n_kv_heads: int, head_dim: int, start_dev=None, rows=None) -> None:
    """Bias + RoPE + f16: q/k/v float32 views of n token rows (n = qout.shape[1]), row strides
    `lds` (elements); cos/sin float32 [P, hd/2], the tables of positions 0..P-1; qout f16
    [H, n, hd] (scaled by log2(e)/sqrt(hd)); kc/vc the layer's f16 caches [KVH, maxT, hd],
    written at positions start..start+n-1. start_dev (int32 [1] on the device, or None) is
    added to start in the kernel (a graph-captured prefill; its range is the caller's check).

    rows = (pos_dev, row_dev), int32 [n] device arrays (a batched step mixing sequences): token
    t takes RoPE position pos_dev[t] and is written to cache row row_dev[t]; start must then be
    0 and start_dev None, and the ranges (pos < P, row < maxT) are the caller's check."""
    n = int(qout.shape[1])
    tail = rope_params(cos, sin, qout, kc, vc, start, neox, n_heads, n_kv_heads, head_dim, start_dev, rows, "qkv_rope")
    if n == 0:
        return
    pairs = (n_heads + 2 * n_kv_heads) * (head_dim // 2)
    kern = kernels.get_kernel("rope.cu", "qkv_rope")
    kern(((pairs + 255) // 256, n), (256,),
         (q, k, v, np.int64(lds[0]), np.int64(lds[1]), np.int64(lds[2]), ptr(bq), ptr(bk), ptr(bv), cos, sin, qout, kc, vc,
          np.int32(n), np.int32(n_heads), np.int32(n_kv_heads), np.int32(head_dim), *tail))


def rope_params(cos, sin, qout, kc, vc, start: int, neox: bool, n_heads: int, n_kv_heads: int, head_dim: int,
                start_dev, rows, op: str) -> tuple:
    """qkv_rope's checks of its tables, outputs and positions (ValueError naming `op`), and the
    kernel arguments after the head counts: (startp, start0, posv, rowv, maxT, neox, qscale), as
    rope.cu and the fused q|k|v GEMM (ops.wgmma.wgmma_qkv_rope) both take them."""
    n = int(qout.shape[1])
    half = head_dim // 2
    P = int(cos.shape[0])
    contig(cos, np.float32, (P, half), "rope cos")
    contig(sin, np.float32, (P, half), "rope sin")
    contig(qout, np.float16, (n_heads, n, head_dim), "rope qout")
    maxT = int(kc.shape[1])
    contig(kc, np.float16, (n_kv_heads, maxT, head_dim), "rope kc")
    contig(vc, np.float16, (n_kv_heads, maxT, head_dim), "rope vc")
    if rows is not None:
        pos_dev, row_dev = rows
        if start != 0 or start_dev is not None:
            raise ValueError(f"{op}: with rows, start must be 0 and start_dev None")
        contig(pos_dev, np.int32, (n,), "rope positions")
        contig(row_dev, np.int32, (n,), "rope cache rows")
    else:
        pos_dev = row_dev = None
        if start + n > maxT:
            raise ValueError(f"{op}: tokens {start}..{start + n} exceed the cache ({maxT})")
        if start + n > P and start_dev is None:
            raise ValueError(f"{op}: tokens {start}..{start + n} past the RoPE tables ({P} positions)")
    qscale = math.log2(math.e) / math.sqrt(head_dim)
    return (ptr(start_dev), np.int32(start), ptr(pos_dev), ptr(row_dev), np.int32(maxT), np.int32(1 if neox else 0),
            np.float32(qscale))
