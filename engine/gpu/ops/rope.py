"""Bias + RoPE + f16 of the prefill q/k/v, K/V written into the cache (rope.cu)."""
from __future__ import annotations

import math

import numpy as np

from engine.gpu import kernels
from engine.gpu.ops._util import contig, ptr


def qkv_rope(q, k, v, lds: tuple[int, int, int], bq, bk, bv, cos, sin, qout, kc, vc, start: int, neox: bool,
             n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """Bias + RoPE + f16: q/k/v float32 views of n token rows, row strides `lds` (elements);
    cos/sin float32 [n, hd/2] for positions start..start+n-1; qout f16 [H, n, hd] (scaled by
    log2(e)/sqrt(hd)); kc/vc the layer's f16 caches [KVH, maxT, hd], written at start..start+n-1."""
    n = int(cos.shape[0])
    half = head_dim // 2
    contig(cos, np.float32, (n, half), "rope cos")
    contig(sin, np.float32, (n, half), "rope sin")
    contig(qout, np.float16, (n_heads, n, head_dim), "rope qout")
    maxT = int(kc.shape[1])
    contig(kc, np.float16, (n_kv_heads, maxT, head_dim), "rope kc")
    contig(vc, np.float16, (n_kv_heads, maxT, head_dim), "rope vc")
    if start + n > maxT:
        raise ValueError(f"qkv_rope: tokens {start}..{start + n} exceed the cache ({maxT})")
    if n == 0:
        return
    pairs = (n_heads + 2 * n_kv_heads) * half
    qscale = math.log2(math.e) / math.sqrt(head_dim)
    kern = kernels.get_kernel("rope.cu", "qkv_rope")
    kern(((pairs + 255) // 256, n), (256,),
         (q, k, v, np.int64(lds[0]), np.int64(lds[1]), np.int64(lds[2]), ptr(bq), ptr(bk), ptr(bv), cos, sin, qout, kc, vc,
          np.int32(n), np.int32(n_heads), np.int32(n_kv_heads), np.int32(head_dim),
          np.int32(start), np.int32(maxT), np.int32(1 if neox else 0), np.float32(qscale)))
