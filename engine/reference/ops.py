"""Float reference ops (numpy, float32): the formulas the CPU backend runs and every GPU op is
checked against. RoPE tables (cos/sin per position) come from engine.formats.rope.

    dequantize_rows(t, rows)      W[rows] as float32 (bit-exact with gguf.quants.dequantize)
    rms_norm(x, w, eps)           x / sqrt(mean(x^2) + eps) * w
    apply_rope(x, cos, sin, rt)   normal: pairs (2i, 2i+1); neox: pairs (i, i + hd/2)
    silu(x)                       x / (1 + exp(-x))
    causal_attention(q, k, v, s)  softmax(q k^T / sqrt(hd) + causal mask) v, GQA
"""
from __future__ import annotations

import numpy as np

from engine.formats.gguf_file import TensorInfo
from engine.formats.qtypes import qtype

ROW_CHUNK = 2048  # rows dequantized at a time: bounds the temporaries


def dequantize_rows(t: TensorInfo, rows: np.ndarray | slice | None = None,
                    out: np.ndarray | None = None) -> np.ndarray:
    """float32 [rows, cols] of a 2-D tensor (all rows, or the selected ones), into `out` if given."""
    data = t.data if rows is None else t.data[rows]
    fn = qtype(t.type_name).dequantize
    n = data.shape[0]
    if out is None:
        out = np.empty((n, t.shape[-1]), dtype=np.float32)
    for r in range(0, n, ROW_CHUNK):
        out[r:r + ROW_CHUNK] = fn(np.asarray(data[r:r + ROW_CHUNK]))
    return out


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis, float32."""
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
    return (x * (1.0 / np.sqrt(ms + np.float32(eps)))).astype(np.float32) * w


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_type: str) -> np.ndarray:
    """(x0, x1) -> (x0 c - x1 s, x0 s + x1 c); x: [n, heads, hd]; cos/sin: [n, hd/2]."""
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    if rope_type == "normal":
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
    else:
        half = x.shape[-1] // 2
        x0, x1 = x[..., :half], x[..., half:]
        out[..., :half] = x0 * c - x1 * s
        out[..., half:] = x0 * s + x1 * c
    return out


def silu(x: np.ndarray) -> np.ndarray:
    """x / (1 + exp(-x))."""
    return x / (np.float32(1.0) + np.exp(-x))


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int,
                     query_chunk: int = 256) -> np.ndarray:
    """softmax(q k^T / sqrt(hd) + causal mask) v; q: [n, H, hd] at positions start..start+n-1;
    k, v: [start+n, KVH, hd]; head h reads KV head h // (H / KVH). Returns [n, H*hd]."""
    n, n_heads, hd = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    scale = np.float32(1.0 / np.sqrt(hd))
    kt = np.ascontiguousarray(k.transpose(1, 2, 0))  # [KVH, hd, L]
    vt = np.ascontiguousarray(v.transpose(1, 0, 2))  # [KVH, L, hd]
    out = np.empty((n, n_heads, hd), dtype=np.float32)
    for c0 in range(0, n, query_chunk):
        c1 = min(n, c0 + query_chunk)
        length = start + c1  # keys visible to the last query of the chunk
        qc = q[c0:c1].reshape(c1 - c0, n_kv, group, hd).transpose(1, 2, 0, 3)  # [KVH, G, m, hd]
        qc = qc.reshape(n_kv, group * (c1 - c0), hd)
        scores = (qc @ kt[:, :, :length]) * scale  # [KVH, G*m, L]
        scores = scores.reshape(n_kv, group, c1 - c0, length)
        qpos = start + np.arange(c0, c1)
        mask = np.arange(length)[None, :] > qpos[:, None]  # [m, L]
        scores[:, :, mask] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        o = p.reshape(n_kv, group * (c1 - c0), length) @ vt[:, :length]  # [KVH, G*m, hd]
        out[c0:c1] = o.reshape(n_kv, group, c1 - c0, hd).transpose(2, 0, 1, 3).reshape(c1 - c0, n_heads, hd)
    return out.reshape(n, n_heads * hd)


def top_two(logits: np.ndarray) -> tuple[int, float, float]:
    """(argmax id, its logit, its lead over the runner-up); ties -> the lowest id."""
    best = int(np.argmax(logits))
    top = float(logits[best])
    if logits.shape[0] < 2:
        return best, top, float("inf")
    rest = logits.copy()
    rest[best] = -np.inf
    return best, top, top - float(rest.max())
