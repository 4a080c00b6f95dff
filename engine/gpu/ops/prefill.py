"""Launchers for the prefill kernels around the GEMMs (one Python function per kernel).

Arrays are cupy arrays on the current device; every function launches on the current stream
and returns without synchronizing. The GEMMs and the plain q8_1 quantizer are in
engine.gpu.ops.mmq (mmq, quantize_q8_1, Q8Act); the functions here produce and consume the same
Q8Act layout (q int8 [T, K], ds float32 [T, K/32, 2] = (d, s)).

    embed(table, ids_dev, x)                                 embed.cu
    add_rmsnorm_q8_1(x, y, w, eps, act)                      rmsnorm.cu     x += y; act = q8_1(rmsnorm(x) w)
    qkv_rope(q, k, v, lds, biases, cos, sin, qout, kc, vc, start)  rope.cu  bias + RoPE, K/V -> cache
    attention_prefill(qh, kc, vc, start, out_act | out_f32)  attention_prefill.cu
    swiglu_q8_1(g, u, ld, F, act)                            swiglu.cu      act = q8_1(silu(g) u)
"""
from __future__ import annotations

import math

import numpy as np

from engine.gpu import kernels

ATT_BQ = 64                 # queries per attention block (attention_prefill.cu AT_BQ)
ATT_THREADS = 128
ATT_HEAD_DIMS = (64, 128)   # instantiated head sizes
RMSNORM_MAX_K = 8192        # rmsnorm.cu RN_MAXJ * 256


def _null():
    return np.uintp(0)


def _ptr(a):
    return _null() if a is None else a


def _contig(a, dtype, shape, what):
    if a.dtype != dtype or tuple(a.shape) != tuple(shape) or not a.flags.c_contiguous:
        raise ValueError(f"{what}: expected contiguous {np.dtype(dtype).name}{list(shape)}, "
                         f"got {a.dtype.name}{list(a.shape)} (contiguous={a.flags.c_contiguous})")


def embed(table, ids, x) -> None:
    """x[t] = dequant(table)[ids[t]]: table a DeviceWeight (q4_K, or q6_K raw/padded) [V, K];
    ids int32 [n] on the device (checked on the host beforehand); x float32 [n, K]."""
    n = int(ids.shape[0])
    K = table.cols
    _contig(x, np.float32, (n, K), "embed x")
    if n == 0:
        return
    if table.kind == "q4_k":
        k = kernels.get_kernel("embed.cu", "embed_q4_k")
        k((K // 256, n), (256,), (table.data, ids, x, np.int32(K)))
    elif table.kind == "q6_k":
        k = kernels.get_kernel("embed.cu", "embed_q6_k")
        k((K // 256, n), (256,), (table.data, ids, x, np.int32(K), np.int32(table.block_stride)))
    else:  # pragma: no cover - DeviceWeight holds only these
        raise ValueError(f"embed: unsupported table type {table.kind}")


def add_rmsnorm_q8_1(x, y, w, eps: float, act, hout=None) -> None:
    """Fused: if y is not None, x += y (in place); then act = q8_1(rmsnorm(x) * w) row by row.
    x, y float32 [R, K]; w float32 [K]; act Q8Act [R, K]; hout optional float32 [R, K]."""
    R, K = map(int, x.shape)
    if K % 256 or K > RMSNORM_MAX_K:
        raise ValueError(f"add_rmsnorm_q8_1: K={K} must be a multiple of 256 and <= {RMSNORM_MAX_K}")
    _contig(x, np.float32, (R, K), "rmsnorm x")
    if y is not None:
        _contig(y, np.float32, (R, K), "rmsnorm y")
    _contig(w, np.float32, (K,), "rmsnorm w")
    _contig(act.q, np.int8, (R, K), "rmsnorm act.q")
    _contig(act.ds, np.float32, (R, K // 32, 2), "rmsnorm act.ds")
    if hout is not None:
        _contig(hout, np.float32, (R, K), "rmsnorm hout")
    if R == 0:
        return
    k = kernels.get_kernel("rmsnorm.cu", "add_rmsnorm_q8_1")
    k((R,), (256,), (x, _ptr(y), w, act.q, act.ds, _ptr(hout), np.int32(K), np.float32(eps)))


def qkv_rope(q, k, v, lds: tuple[int, int, int], bq, bk, bv, cos, sin, qout, kc, vc, start: int, neox: bool,
             n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """Bias + RoPE + f16: q/k/v float32 views of n token rows, row strides `lds` (elements);
    cos/sin float32 [n, hd/2] for positions start..start+n-1; qout f16 [H, n, hd] (scaled by
    log2(e)/sqrt(hd)); kc/vc the layer's f16 caches [KVH, maxT, hd], written at start..start+n-1."""
    n = int(cos.shape[0])
    half = head_dim // 2
    _contig(cos, np.float32, (n, half), "rope cos")
    _contig(sin, np.float32, (n, half), "rope sin")
    _contig(qout, np.float16, (n_heads, n, head_dim), "rope qout")
    maxT = int(kc.shape[1])
    _contig(kc, np.float16, (n_kv_heads, maxT, head_dim), "rope kc")
    _contig(vc, np.float16, (n_kv_heads, maxT, head_dim), "rope vc")
    if start + n > maxT:
        raise ValueError(f"qkv_rope: tokens {start}..{start + n} exceed the cache ({maxT})")
    if n == 0:
        return
    pairs = (n_heads + 2 * n_kv_heads) * half
    qscale = math.log2(math.e) / math.sqrt(head_dim)
    kern = kernels.get_kernel("rope.cu", "qkv_rope")
    kern(((pairs + 255) // 256, n), (256,),
         (q, k, v, np.int64(lds[0]), np.int64(lds[1]), np.int64(lds[2]), _ptr(bq), _ptr(bk), _ptr(bv), cos, sin, qout, kc, vc,
          np.int32(n), np.int32(n_heads), np.int32(n_kv_heads), np.int32(head_dim),
          np.int32(start), np.int32(maxT), np.int32(1 if neox else 0), np.float32(qscale)))


def attention_smem_bytes(head_dim: int) -> int:
    return 5 * 64 * head_dim * 2


def attention_prefill(qh, kc, vc, start: int, out_act=None, out_f32=None) -> None:
    """Causal GQA attention of the ubatch queries qh f16 [H, n, hd] (rope.cu's output) over the
    layer's cache kc/vc f16 [KVH, maxT, hd] (keys 0..start+n-1). Output: out_act (Q8Act
    [n, H*hd], the attn_output GEMM's input) or out_f32 (float32 [n, H*hd]); exactly one."""
    H, n, hd = map(int, qh.shape)
    KVH, maxT = int(kc.shape[0]), int(kc.shape[1])
    if hd not in ATT_HEAD_DIMS:
        raise ValueError(f"attention_prefill: head size {hd} not instantiated ({ATT_HEAD_DIMS})")
    if H % KVH:
        raise ValueError(f"attention_prefill: {H} heads over {KVH} KV heads")
    if (out_act is None) == (out_f32 is None):
        raise ValueError("attention_prefill: give exactly one of out_act, out_f32")
    _contig(qh, np.float16, (H, n, hd), "attention q")
    _contig(kc, np.float16, (KVH, maxT, hd), "attention kc")
    _contig(vc, np.float16, (KVH, maxT, hd), "attention vc")
    if start + n > maxT:
        raise ValueError(f"attention_prefill: tokens {start}..{start + n} exceed the cache ({maxT})")
    QD = H * hd
    if out_act is not None:
        _contig(out_act.q, np.int8, (n, QD), "attention out q")
        _contig(out_act.ds, np.float32, (n, QD // 32, 2), "attention out ds")
        name, o, oq, ods = f"attn_prefill_h{hd}_q8", _null(), out_act.q, out_act.ds
    else:
        _contig(out_f32, np.float32, (n, QD), "attention out")
        name, o, oq, ods = f"attn_prefill_h{hd}_f32", out_f32, _null(), _null()
    if n == 0:
        return
    smem = attention_smem_bytes(hd)
    k = kernels.get_kernel("attention_prefill.cu", name, dynamic_smem=smem)
    k(((n + ATT_BQ - 1) // ATT_BQ, H), (ATT_THREADS,),
      (qh, kc, vc, o, oq, ods, np.int32(n), np.int32(H), np.int32(KVH), np.int32(start),
       np.int32(maxT)), shared_mem=smem)


def swiglu_q8_1(g, u, ld: int, F: int, act) -> None:
    """act = q8_1(silu(g) * u): g, u float32 views of T rows with row stride ld (elements),
    F columns each (F % 32 == 0); act Q8Act [T, F]."""
    T = int(act.q.shape[0])
    if F % 32:
        raise ValueError(f"swiglu_q8_1: F={F} is not a multiple of 32")
    _contig(act.q, np.int8, (T, F), "swiglu act.q")
    _contig(act.ds, np.float32, (T, F // 32, 2), "swiglu act.ds")
    if ld % 4:
        raise ValueError(f"swiglu_q8_1: row stride {ld} is not a multiple of 4 (float4 loads)")
    n4 = T * F // 4
    if n4 == 0:
        return
    k = kernels.get_kernel("swiglu.cu", "swiglu_q8_1")
    k(((n4 + 255) // 256,), (256,), (g, u, np.int64(ld), np.int32(F), act.q, act.ds, np.int64(n4)))
