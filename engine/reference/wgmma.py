"""Oracle of the Hopper f16 GEMMs (kernels_cu/wgmma_q4_k.cu, wgmma_q6_k.cu, issue 14 route (b)):
q4_K / q6_K weights dequantized to f16 exactly as the kernels do, activations rounded to f16 and stored in a
permuted k order, products summed in float64.

    k_permutation() -> int [256]: P, with Xp[t, 256 b + L] = x[t, 256 b + P[L]]
    permute_x16(x) -> float16 [T, K]: the activations rounded to f16 in the kernel's k order
    tile_x16(x) -> float16 [K/64, ceil(T/8), 8, 8, 8]: the same, tiled as the kernel reads it
    dequant_q4_k_f16(blocks) -> float16 [N, K]: w = f16(q f16(d sc) - f16(dmin m)), one rounding
    dequant_q6_k_f16(blocks, padded) -> float16 [N, K]: w = f16((q - 32) f16(d sc)), one rounding
    dequant_f16(blocks, kind, padded): one of the two by weight kind
    wgmma_reference(w16, x16) -> float64 [T, N]; wgmma_abs(w16, x16) -> sum of |x||w|
    wgmma_error_bound(K, S) -> per-element bound on |y - ref|

The kernel's f16 path differs from the q8_1 MMQ path (engine.reference.mmq) by design: the weights
carry one f16 rounding (relative 2^-11) instead of none, the activations one f16 rounding instead
of the q8_1 block quantization (relative ~2^-8), and the sums run in f32 on the tensor cores.
"""
from __future__ import annotations

import numpy as np

from engine.formats.quants import QK_K, q4_k_fields, q6_k_fields


def k_permutation() -> np.ndarray:
    """P [256]: logical k L = 16 s + c of a super-block holds element P[L] (wgmma_q4_k.cu):
    s = 2 m + hi, c = 2 t + 8 f + e  ->  P = 64 t + 32 hi + 4 m + f + 2 e."""
    L = np.arange(QK_K)
    s, c = L >> 4, L & 15
    hi, m = s & 1, s >> 1
    e, t, f = c & 1, (c >> 1) & 3, (c >> 3) & 1
    return 64 * t + 32 * hi + 4 * m + f + 2 * e


def permute_x16(x: np.ndarray) -> np.ndarray:
    """float32 [T, K] -> float16 [T, K] in the kernel's k order (round to nearest even)."""
    x = np.asarray(x, dtype=np.float32)
    T, K = x.shape
    if K % QK_K:
        raise ValueError(f"permute_x16: K={K} is not a multiple of {QK_K}")
    with np.errstate(over="ignore"):                 # |x| >= 65520 -> inf, as cvt.rn.f16.f32
        return x.reshape(T, K // QK_K, QK_K)[:, :, k_permutation()].reshape(T, K).astype(np.float16)


def tile_x16(x: np.ndarray) -> np.ndarray:
    """float32 [T, K] -> float16 [K/64, ceil(T/8), 8, 8, 8]: [64-k block, token group, 8-k chunk,
    token, k] of permute_x16(x), tokens past T zero: 8 tokens x 64 k are one 1,024-byte piece and
    consecutive token groups of one 64-k block are contiguous (one copy per pipeline stage)."""
    xp = permute_x16(x)
    T, K = xp.shape
    T8 = -(-T // 8) * 8
    padded = np.zeros((T8, K), dtype=np.float16)
    padded[:T] = xp
    return np.ascontiguousarray(padded.reshape(T8 // 8, 8, K // 64, 8, 8).transpose(2, 0, 3, 1, 4))


def dequant_q4_k_f16(blocks: np.ndarray) -> np.ndarray:
    """q4_K rows uint8 [N, K/256*144] -> float16 [N, K] in the natural k order, as the kernel
    computes them: s = f16(d sc), m' = f16(dmin m) (exact f32 products rounded once), then
    w = f16(q s - m') with a single rounding (HFMA2; exact here in float64 before the rounding)."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    N = blocks.shape[0]
    d, dmin, sc, m, q = q4_k_fields(blocks)
    s16 = (d[:, None] * sc.astype(np.float32)).astype(np.float16).astype(np.float64)
    m16 = (dmin[:, None] * m.astype(np.float32)).astype(np.float16).astype(np.float64)
    w = q.astype(np.float64) * s16[:, :, None] - m16[:, :, None]
    return w.astype(np.float16).reshape(N, -1)


def dequant_q6_k_f16(blocks: np.ndarray, padded: bool = False) -> np.ndarray:
    """q6_K rows uint8 [N, K/256*210] (or [N, K/256*224] with padded=True) -> float16 [N, K] in
    the natural k order, as wgmma_q6_k.cu computes them: s = f16(d sc) (the exact f32 product
    rounded once), then w = f16((q - 32) s) with a single rounding (HMUL2 of the exact f16
    q - 32; exact here in float64 before the rounding, signed zeros included)."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    N = blocks.shape[0]
    d, sc, q = q6_k_fields(blocks, padded=padded)                   # q: int8, already q - 32
    with np.errstate(over="ignore", invalid="ignore"):             # as cvt.rn.f16.f32 / HMUL2: inf, NaN
        s16 = (d[:, None] * sc.astype(np.float32)).astype(np.float16).astype(np.float64)
        w = q.reshape(-1, 16, 16).astype(np.float64) * s16[:, :, None]
        return w.astype(np.float16).reshape(N, -1)


def dequant_f16(blocks: np.ndarray, kind: str, padded: bool = False) -> np.ndarray:
    """dequant_q4_k_f16 or dequant_q6_k_f16 by weight kind ("q4_k" / "q6_k")."""
    if kind == "q4_k":
        return dequant_q4_k_f16(blocks)
    if kind == "q6_k":
        return dequant_q6_k_f16(blocks, padded)
    raise ValueError(f"dequant_f16: no Hopper GEMM for {kind}")


def wgmma_reference(w16: np.ndarray, x16: np.ndarray) -> np.ndarray:
    """y[T, N] = x16 . w16^T in float64 (both in the natural k order)."""
    return np.asarray(x16, np.float64) @ np.asarray(w16, np.float64).T


def wgmma_abs(w16: np.ndarray, x16: np.ndarray) -> np.ndarray:
    """S[T, N] = sum_k |x16| |w16|: the scale of the rounding error."""
    return np.abs(np.asarray(x16, np.float64)) @ np.abs(np.asarray(w16, np.float64)).T


def wgmma_error_bound(K: int, S: np.ndarray) -> np.ndarray:
    """|y - ref| <= (K/16 + 16) 2^-22 S: the f16 x f16 products are exact in f32; the tensor
    cores add each k16 step's sum into the f32 accumulator with at most one rounding or
    truncation (2^-23 of the running magnitude, <= S) plus a few units inside the step, doubled."""
    return (K / 16 + 16) * 2.0 ** -22 * np.asarray(S, np.float64)
