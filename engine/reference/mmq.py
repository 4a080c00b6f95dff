"""Oracles of the MMQ / MMVQ integer GEMMs (the kernels' formulation in float64), their stated
error bounds, and random valid weight blocks to feed them.

    mmq_reference(kind, w_rows, q, d, s, padded=False) -> float64 [T, N]
        mmq_reference_q4_k / mmq_reference_q6_k: the exact integer-dot formulation the kernels
        compute (q4_K: sum (d sc) d8 dot - (dmin m) s8; q6_K: sum (d sc) d8 dot).
    abs_terms(kind, w, q, d, s) -> (S, S_min): magnitudes of the scaled terms summed
    error_bound(kind, K, S, S_min, tc_min_term) -> the per-element bound on |y - ref|
    random_blocks(rng, kind, n_rows, K) -> uint8 rows of valid blocks

Used by tests/test_ops.py, tests/test_gpu_mmq.py, tests/test_gpu_decode.py, the CPU emulator's
GEMM fallback and dev/gemm_bench.py.
"""
from __future__ import annotations

import numpy as np

from engine.formats import quants as Q
from engine.formats.qtypes import qtype
from engine.formats.quants import (
    Q4_K_BYTES, Q6_K_BYTES, Q6_K_PADDED_BYTES, QK8_1, QK_K, q4_k_fields, q6_k_fields,
)


def _check_act(q, d, s, K):
    q = np.asarray(q)
    T = q.shape[0]
    if q.shape != (T, K):
        raise ValueError(f"activation q shape {q.shape} does not match K={K}")
    d = np.asarray(d, dtype=np.float64).reshape(T, K // QK8_1)
    s = np.asarray(s, dtype=np.float64).reshape(T, K // QK8_1)
    return q, d, s, T


def mmq_reference_q4_k(w_rows: np.ndarray, q: np.ndarray, d: np.ndarray, s: np.ndarray,
                       chunk: int = 8) -> np.ndarray:
    """Exact integer-dot q4_K x q8_1 GEMM (the kernel oracle), float64 [T, N].

    y[t, n] = sum over 32-element sub-blocks g (super-block b = g // 8, j = g % 8) of
        (d_w[n,b] * sc[n,g]) * d8[t,g] * sum_l(q4[n,g,l] * q8[t,g,l])  -  (dmin_w[n,b] * m[n,g]) * s8[t,g]
    The integer sums are exact (computed as float32 matmuls of small integers: |sum| <=
    15*127*32 < 2^24); the scale products and accumulation are float64.
    """
    w_rows = np.asarray(w_rows)
    N = w_rows.shape[0]
    nb = w_rows.shape[1] // Q4_K_BYTES
    K = nb * QK_K
    q, d8, s8, T = _check_act(q, d, s, K)
    dw, dminw, sc, m, q4 = q4_k_fields(w_rows.reshape(N * nb, Q4_K_BYTES))
    G = K // 32
    A = (dw.astype(np.float64)[:, None] * sc).reshape(N, G)           # d_w * sc_j   [N, G]
    M = (dminw.astype(np.float64)[:, None] * m).reshape(N, G)         # dmin_w * m_j [N, G]
    y = -(s8 @ M.T)                                                    # [T, N]
    wq = q4.reshape(N, G, 32).transpose(1, 2, 0).astype(np.float32)   # [G, 32, N]
    aq = q.reshape(T, G, 32).transpose(1, 0, 2).astype(np.float32)    # [G, T, 32]
    for g0 in range(0, G, chunk):
        g1 = min(G, g0 + chunk)
        dots = np.matmul(aq[g0:g1], wq[g0:g1])                         # [c, T, N] exact ints
        for i, g in enumerate(range(g0, g1)):
            y += (d8[:, g:g + 1] * A[None, :, g]) * dots[i]
    return y


def mmq_reference_q6_k(w_rows: np.ndarray, q: np.ndarray, d: np.ndarray, s: np.ndarray,
                       padded: bool = False, chunk: int = 16) -> np.ndarray:
    """Exact integer-dot q6_K x q8_1 GEMM (the kernel oracle), float64 [T, N].

    y[t, n] = sum over 16-element sub-blocks j (q8_1 block g = j // 2 covers two of them) of
        (d_w[n, j // 16] * sc[n, j]) * d8[t, g] * sum_l((q6[n,j,l] - 32) * q8[t,j,l])
    (s is accepted for a uniform signature; q6_K has no min term).
    """
    w_rows = np.asarray(w_rows)
    N = w_rows.shape[0]
    bb = Q6_K_PADDED_BYTES if padded else Q6_K_BYTES
    nb = w_rows.shape[1] // bb
    K = nb * QK_K
    q, d8, _s8, T = _check_act(q, d, s, K)
    dw, sc, q6 = q6_k_fields(w_rows.reshape(N * nb, bb), padded=padded)
    J = K // 16
    A = (dw.astype(np.float64)[:, None] * sc).reshape(N, J)           # [N, J]
    wq = q6.reshape(N, J, 16).transpose(1, 2, 0).astype(np.float32)   # [J, 16, N]
    aq = q.reshape(T, J, 16).transpose(1, 0, 2).astype(np.float32)    # [J, T, 16]
    y = np.zeros((T, N), dtype=np.float64)
    for j0 in range(0, J, chunk):
        j1 = min(J, j0 + chunk)
        dots = np.matmul(aq[j0:j1], wq[j0:j1])                         # [c, T, N]
        for i, j in enumerate(range(j0, j1)):
            y += (d8[:, j // 2:j // 2 + 1] * A[None, :, j]) * dots[i]
    return y


def mmq_reference(kind: str, w_rows, q, d, s, padded: bool = False) -> np.ndarray:
    """The oracle of a kernel family ('q4_k' / 'q6_k'), float64 [T, N]."""
    if kind == "q4_k":
        return mmq_reference_q4_k(w_rows, q, d, s)
    if kind == "q6_k":
        return mmq_reference_q6_k(w_rows, q, d, s, padded=padded)
    raise ValueError(f"no MMQ oracle for {kind!r}")


def random_blocks(rng, kind: str, n_rows: int, K: int, special: bool = True) -> np.ndarray:
    """Random valid q4_K / q6_K rows uint8 [n_rows, K/256*bytes]: random bytes with the f16
    scale fields set to finite values in (-0.05, 0.05) (a few tiny / zero ones if special)."""
    bb = qtype(kind).block_bytes
    offs = (0, 2) if kind == "q4_k" else (208,)        # the f16 scale fields (d, dmin / d)
    nb = K // Q.QK_K
    b = rng.integers(0, 256, (n_rows * nb, bb), dtype=np.uint8)
    for off in offs:
        v = rng.uniform(-0.05, 0.05, b.shape[0]).astype("<f2")
        if special:
            v[::29] = np.float16(6e-8)
            v[::31] = np.float16(0.0)
        b[:, off:off + 2] = v.view(np.uint8).reshape(-1, 2)
    return b.reshape(n_rows, nb * bb)


U32 = 2.0 ** -24   # float32 unit roundoff


def abs_terms(kind: str, w, q, d, s, padded: bool = False):
    """Magnitudes of the scaled terms the GEMM sums, float64 [T, N] each: (S, S_min).
    q4_K: S = sum_g |d sc| |d8| sum_l q4 |q8| + |dmin m| |s8|, S_min = the second part;
    q6_K: S = sum_j |d sc_j| |d8| sum_l |q6 - 32| |q8|, S_min = 0."""
    T, K = q.shape
    N = w.shape[0]
    aq = np.abs(q.astype(np.float32))
    ad = np.abs(np.asarray(d, np.float64)).reshape(T, K // 32)
    if kind == "q4_k":
        dw, dmin, sc, m, q4 = Q.q4_k_fields(w.reshape(-1, Q.Q4_K_BYTES))
        G = K // 32
        A = np.abs(dw.astype(np.float64)[:, None] * sc).reshape(N, G)
        M = np.abs(dmin.astype(np.float64)[:, None] * m).reshape(N, G)
        smin = np.abs(np.asarray(s, np.float64)).reshape(T, G) @ M.T
        tot = smin.copy()
        wq = q4.reshape(N, G, 32).astype(np.float32)
        for g in range(G):
            tot += (ad[:, g:g + 1] * A[None, :, g]) * (aq[:, 32 * g:32 * g + 32] @ wq[:, g, :].T)
        return tot, smin
    bb = Q.Q6_K_PADDED_BYTES if padded else Q.Q6_K_BYTES
    dw, sc, q6 = Q.q6_k_fields(w.reshape(-1, bb), padded=padded)
    J = K // 16
    A = np.abs(dw.astype(np.float64)[:, None] * sc).reshape(N, J)
    wq = np.abs(q6.reshape(N, J, 16).astype(np.float32))
    tot = np.zeros((T, N))
    for j in range(J):
        tot += (ad[:, j // 2:j // 2 + 1] * A[None, :, j]) * (aq[:, 16 * j:16 * j + 16] @ wq[:, j, :].T)
    return tot, np.zeros_like(tot)


def error_bound(kind: str, K: int, S, S_min, tc_min_term: bool = False):
    """The stated per-element bound on |y - ref| (float64 [T, N]).

    Integer dots are exact; each scaled term gets at most three float32 roundings and the
    K/32 (q4_K: 2K/32) terms are summed in float32: gamma_n with n <= K/16 + 3, so
    (K/16 + 4) u S. The "tc" variants compute each stage's min term on TF32 tensor cores
    with s8 split hi + lo (representation error <= 2^-22 |s8|, products exact) and f32
    accumulation of 8 products (<= 8 x 2^-22 of their magnitude): + 40 u S_min.
    The tail split ("+split") sums each part's terms, then the P parts in order: a term sees
    at most (its part's terms) + 3 + (P - 1) <= K/16 + 3 roundings, the same bound.
    tc_min_term: the variant computes the min term on tensor cores
    (engine.gpu.kernels.mmq_uses_tc)."""
    b = (K / 16 + 4) * U32 * S
    if tc_min_term:
        b = b + 40 * U32 * S_min
    return b
