"""What the GPU prefill kernels compute, with their numerics, in numpy: q8_1 activations into every
MMQ GEMM, f16 activations and f16-rounded weights into the Hopper (wgmma) GEMMs, f16 Q/K/V and P
in attention, float32 elsewhere. One function per op, named after the op
(its launcher is engine/gpu/ops/<family>.py, its kernel kernels_cu/<op>.cu); each returns arrays,
the caller places them in device buffers (tests/gpu_emulation.py runs GPUModel on these).

The float formulas are engine/reference/ops.py's; the exact integer-dot MMQ oracles and their
error bounds are engine/reference/mmq.py's. q8_1 is engine.formats.quants.quantize_q8_1
(d = amax/127, q = round(x/d), s = d * sum(q)), returned as (q int8 [T, K], d, s f32 [T, K/32]).
"""
from __future__ import annotations

import math

import numpy as np

from engine.formats import quants
from engine.reference import wgmma as wgmma_ref
from engine.reference.ops import apply_rope, rms_norm, silu

__all__ = ["embed", "rmsnorm_q8_1", "rmsnorm_x16", "qkv_rope_f16", "attention_f16", "swiglu_q8_1", "swiglu_x16",
           "mmq_q8_1", "wgmma_f16", "untile_x16", "dequantize_weight"]


def dequantize_weight(rows: np.ndarray, kind: str, padded: bool = False) -> np.ndarray:
    """float32 rows of a q4_K or q6_K (raw 210 B or padded 224 B) device weight."""
    rows = np.asarray(rows)
    if kind == "q4_k":
        return quants.dequantize_q4_k(rows)
    return quants.dequantize_q6_k(rows, padded=padded)


def embed(rows: np.ndarray, kind: str, padded: bool = False) -> np.ndarray:
    """x[i] = dequant(W_embd[ids[i]]): the caller passes the table's rows table[ids]."""
    return dequantize_weight(rows, kind, padded)


def _add_rms_norm(x: np.ndarray, w: np.ndarray, eps: float, y: np.ndarray | None):
    """(x', h): x' = x + y (x when y is None), h = x' / sqrt(mean(x'^2) + eps) * w."""
    if y is not None:
        x = x + y
    return x, rms_norm(x, w, eps)


def rmsnorm_q8_1(x: np.ndarray, w: np.ndarray, eps: float, y: np.ndarray | None = None):
    """x' = x + y; h = x' / sqrt(mean(x'^2) + eps) * w; returns (x', h, q8_1(h)) with q8_1(h) = (q, d, s)."""
    x, h = _add_rms_norm(x, w, eps, y)
    return x, h, quants.quantize_q8_1(np.ascontiguousarray(h, dtype=np.float32))


def rmsnorm_x16(x: np.ndarray, w: np.ndarray, eps: float, y: np.ndarray | None = None):
    """rmsnorm_q8_1's (x', h) and h in the Hopper GEMMs' tiled f16 operand (engine.reference.wgmma.tile_x16)."""
    x, h = _add_rms_norm(x, w, eps, y)
    return x, h, wgmma_ref.tile_x16(h)


def qkv_rope_f16(q, k, v, bq, bk, bv, cos, sin, n_heads: int, n_kv_heads: int, head_dim: int, neox: bool):
    """Q = f16(rope(q + bq) * log2(e)/sqrt(hd)), K = f16(rope(k + bk)), V = f16(v + bv), head-major
    [heads, n, hd]; rope pairs (i, i + hd/2) when neox, else (2i, 2i+1)."""
    n = cos.shape[0]
    rt = "neox" if neox else "normal"
    qq = q + bq if bq is not None else q.copy()
    kk = k + bk if bk is not None else k.copy()
    vv = v + bv if bv is not None else v.copy()
    qr = apply_rope(qq.reshape(n, n_heads, head_dim), cos, sin, rt)
    kr = apply_rope(kk.reshape(n, n_kv_heads, head_dim), cos, sin, rt)
    qscale = np.float32(math.log2(math.e) / math.sqrt(head_dim))
    return ((qr * qscale).astype(np.float16).transpose(1, 0, 2),
            kr.astype(np.float16).transpose(1, 0, 2),
            vv.reshape(n, n_kv_heads, head_dim).astype(np.float16).transpose(1, 0, 2))


def attention_f16(qh: np.ndarray, kc: np.ndarray, vc: np.ndarray, start: int) -> np.ndarray:
    """o = (f16(P) V) / sum(P), P = exp2(Q K^T - max) with causal mask; qh f16 [H, n, hd] (scaled by
    log2 e / sqrt hd), kc/vc f16 [KVH, maxT, hd] holding positions 0..start+n-1 -> float32 [n, H*hd]."""
    H, n, hd = qh.shape
    KVH = kc.shape[0]
    G = H // KVH
    L = start + n
    out = np.empty((n, H, hd), dtype=np.float32)
    qpos = start + np.arange(n)
    mask = np.arange(L)[None, :] > qpos[:, None]
    for h in range(H):
        q = qh[h].astype(np.float64)
        k = kc[h // G, :L].astype(np.float64)
        v = vc[h // G, :L].astype(np.float64)
        s = q @ k.T
        s[mask] = -np.inf
        m = s.max(axis=1, keepdims=True)
        p = np.exp2(s - m)
        l = p.sum(axis=1, keepdims=True)
        out[:, h] = (p.astype(np.float16).astype(np.float64) @ v) / l
    return out.reshape(n, H * hd)


def swiglu_q8_1(g: np.ndarray, u: np.ndarray):
    """q8_1(silu(g) * u) = (q, d, s)."""
    return quants.quantize_q8_1(np.ascontiguousarray(silu(g) * u, dtype=np.float32))


def swiglu_x16(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u in the Hopper GEMMs' tiled f16 operand."""
    return wgmma_ref.tile_x16(np.ascontiguousarray(silu(g) * u, dtype=np.float32))


def untile_x16(xt: np.ndarray, T: int) -> np.ndarray:
    """The tiled operand [K/64, ceil(T/8), 8, 8, 8] -> float16 [T, K] in the natural k order."""
    kb, ng = xt.shape[:2]
    K = kb * 64
    xp = np.asarray(xt).transpose(1, 3, 0, 2, 4).reshape(ng * 8, K)[:T]
    inv = np.argsort(wgmma_ref.k_permutation())
    return np.ascontiguousarray(xp.reshape(T, K // 256, 256)[:, :, inv].reshape(T, K))


def wgmma_f16(w_rows: np.ndarray, kind: str, x16: np.ndarray, padded: bool = False) -> np.ndarray:
    """y = f32(x16 @ w16.T) in float64: the Hopper GEMM on its own operands (f16 activations, the
    weights dequantized to f16 as the kernel does; engine.reference.wgmma has its bound)."""
    return wgmma_ref.wgmma_reference(wgmma_ref.dequant_f16(w_rows, kind, padded), x16).astype(np.float32)


def mmq_q8_1(w_rows: np.ndarray, kind: str, q: np.ndarray, d: np.ndarray, padded: bool = False) -> np.ndarray:
    """y = f32(dequant(q, d) @ dequant(W).T) in float64: the q8_1 GEMM without the kernels'
    integer-dot rounding (that one, and its bound, is engine/reference/mmq.py's)."""
    xq = quants.dequantize_q8_1(q, d)
    w = dequantize_weight(w_rows, kind, padded)
    return (xq.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32)
