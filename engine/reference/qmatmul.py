"""Compiled (numba) q4_K / q6_K kernels for the CPU backend's quantized matrices
(engine.reference.model.Matrix): the weights stay in the file's blocks and are never all held
as float32.

    q = QuantMatrix(kind, blocks)     kind "q4_k" | "q6_k" (QuantType.kind); blocks: uint8
                                      [rows, K / 256 * block_bytes], the file's mapping
    q.dequantize(r0, out)             W[r0 : r0 + len(out)] as float32, bit-identical to
                                      engine.reference.ops.dequantize_rows (prompts: a chunk of
                                      rows, then the same BLAS product as a resident matrix)
    q.matmul_t(h)                     h [T, K] @ W.T -> float32 [T, rows] without writing W:
                                      each block's weights are formed in registers/L1 (the same
                                      float32 values) and multiplied at once (decode, small steps)

At construction each block's sub-block scales are decoded once into float32 (`scales`, 64 bytes
per 256 weights: q4_K d*sc_j and dmin*m_j, q6_K d*sc_i), so the kernels' inner loops read
only the quants. Block layouts: engine/formats/quants.py.

Numerics. A weight is formed exactly as numpy does (q4_K: (d*sc)*q - (dmin*m), q6_K: (d*sc)*q,
every product and difference rounded to float32; fastmath is off, so LLVM contracts nothing into
a fused multiply-add; f16 scales through a table made by numpy's own f16 -> f32 cast).
matmul_t sums w * h for one (row, token) in 256 float32 lanes (lane i takes k = i mod 256, in
increasing k), then folds the lanes in a fixed order (128 + 128, 64 + 64, ..., 16 + 16, then
the 16 in turn). That order depends on K alone: a token's outputs have the same bits whatever T
and whichever tokens share the call (the single-token and the T-token kernels agree bit for
bit). It is not BLAS's order: results differ from h @ dequantize_rows(W).T by float32 rounding.

Importing this module imports numba, an optional dependency: engine.reference.model imports it
only for quantized matrices. Compiled code is cached beside this file (cache=True); the first
call in a fresh checkout compiles the kernels (tens of seconds).
"""
from __future__ import annotations

import os

# numba's OpenMP pool would otherwise spin after each kernel and starve OpenBLAS's threads in the
# prompt path, which alternates the two (measured: a 23-token prompt 12 s -> 1.2 s on 2 cores;
# decode unchanged). Read when the pool first starts; a value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

__all__ = ["QuantMatrix", "f16_table"]

ROW_GROUP = 16                       # rows per parallel work item (one scratch allocation each)
_F16 = None


def f16_table() -> np.ndarray:
    """float32 [65536]: the value of every f16 bit pattern, by numpy's cast (exact)."""
    global _F16
    if _F16 is None:
        _F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    return _F16


# Integer work stays in int32 throughout: an int64 intermediate makes LLVM convert 64-bit lanes
# to float (half the vector width).

@njit(inline="always")
def _u(a, i):
    return np.int32(a[i])


@njit(inline="always")
def _f16_at(bq, i, f16):
    return f16[_u(bq, i) | (_u(bq, i + 1) << np.int32(8))]


# ----------------------------------------------------------------------------- scales

@njit(parallel=True, cache=True)
def _scales_q4k(blocks, f16, out):
    """out [rows, nb, 16]: d*sc_0..7, dmin*m_0..7 of every q4_K block."""
    rows, nb = out.shape[0], out.shape[1]
    for r in prange(rows):
        row = blocks[r]
        for b in range(nb):
            bq = row[144 * b:144 * b + 16]
            d = _f16_at(bq, 0, f16)
            dmin = _f16_at(bq, 2, f16)
            o = out[r, b]
            for j in range(4):
                o[j] = d * np.float32(_u(bq, 4 + j) & np.int32(63))
                o[8 + j] = dmin * np.float32(_u(bq, 8 + j) & np.int32(63))
                lo = _u(bq, 12 + j)
                o[4 + j] = d * np.float32((lo & np.int32(15)) | ((_u(bq, 4 + j) >> np.int32(2)) & np.int32(0x30)))
                o[12 + j] = dmin * np.float32((lo >> np.int32(4)) | ((_u(bq, 8 + j) >> np.int32(2)) & np.int32(0x30)))


@njit(parallel=True, cache=True)
def _scales_q6k(blocks, f16, out):
    """out [rows, nb, 16]: d*sc_0..15 of every q6_K block."""
    rows, nb = out.shape[0], out.shape[1]
    for r in prange(rows):
        row = blocks[r]
        for b in range(nb):
            bq = row[210 * b:210 * b + 210]
            d = _f16_at(bq, 208, f16)
            o = out[r, b]
            for i in range(16):
                o[i] = d * np.float32(np.int8(bq[192 + i]))


# ----------------------------------------------------------------------------- one block

@njit(inline="always")
def _q4k_weights(q, s, w):
    """The 256 weights of a q4_K block (q: its 128 quant bytes, s: its 16 scales) into w."""
    for c in range(4):
        ds0, dm0, ds1, dm1 = s[2 * c], s[8 + 2 * c], s[2 * c + 1], s[9 + 2 * c]
        qq = q[32 * c:32 * c + 32]
        w0 = w[64 * c:64 * c + 32]
        w1 = w[64 * c + 32:64 * c + 64]
        for lane in range(32):
            byte = _u(qq, lane)
            w0[lane] = ds0 * np.float32(np.int32(byte & np.int32(15))) - dm0
            w1[lane] = ds1 * np.float32(np.int32(byte >> np.int32(4))) - dm1


@njit(inline="always")
def _q4k_fma(q, s, x, a):
    """a[i] += weight_i * x[i] over one q4_K block (the weights as in _q4k_weights)."""
    for c in range(4):
        ds0, dm0, ds1, dm1 = s[2 * c], s[8 + 2 * c], s[2 * c + 1], s[9 + 2 * c]
        qq = q[32 * c:32 * c + 32]
        a0 = a[64 * c:64 * c + 32]
        a1 = a[64 * c + 32:64 * c + 64]
        x0 = x[64 * c:64 * c + 32]
        x1 = x[64 * c + 32:64 * c + 64]
        for lane in range(32):
            byte = _u(qq, lane)
            a0[lane] += (ds0 * np.float32(np.int32(byte & np.int32(15))) - dm0) * x0[lane]
            a1[lane] += (ds1 * np.float32(np.int32(byte >> np.int32(4))) - dm1) * x1[lane]


@njit(inline="always")
def _q6k_quants(ql, qh, lane):
    """The four 6-bit quants (minus 32) of one lane of a q6_K half: elements lane, 32 + lane,
    64 + lane, 96 + lane of the half (ql: its 64 low-bit bytes, qh: its 32 high-bit bytes)."""
    a = _u(ql, lane)
    b = _u(ql, 32 + lane)
    c = _u(qh, lane)
    v0 = (a & np.int32(15)) | ((c & np.int32(3)) << np.int32(4))
    v1 = (b & np.int32(15)) | (((c >> np.int32(2)) & np.int32(3)) << np.int32(4))
    v2 = (a >> np.int32(4)) | (((c >> np.int32(4)) & np.int32(3)) << np.int32(4))
    v3 = (b >> np.int32(4)) | (((c >> np.int32(6)) & np.int32(3)) << np.int32(4))
    return (np.float32(np.int32(v0 - np.int32(32))), np.float32(np.int32(v1 - np.int32(32))),
            np.float32(np.int32(v2 - np.int32(32))), np.float32(np.int32(v3 - np.int32(32))))


@njit(inline="always")
def _q6k_weights(bq, s, w):
    """The 256 weights of a q6_K block (bq: its 210 bytes, s: its 16 scales) into w.
    Element 128*half + 32*g + lane has scale s[8*half + 2*g + (lane >= 16)]."""
    for half in range(2):
        ql = bq[64 * half:64 * half + 64]
        qh = bq[128 + 32 * half:160 + 32 * half]
        sh = s[8 * half:8 * half + 8]
        wh = w[128 * half:128 * half + 128]
        for p in range(2):
            s0, s1, s2, s3 = sh[p], sh[2 + p], sh[4 + p], sh[6 + p]
            for lane in range(16 * p, 16 * p + 16):
                q0, q1, q2, q3 = _q6k_quants(ql, qh, lane)
                wh[lane] = s0 * q0
                wh[32 + lane] = s1 * q1
                wh[64 + lane] = s2 * q2
                wh[96 + lane] = s3 * q3


@njit(inline="always")
def _q6k_fma(bq, s, x, a):
    """a[i] += weight_i * x[i] over one q6_K block (the weights as in _q6k_weights)."""
    for half in range(2):
        ql = bq[64 * half:64 * half + 64]
        qh = bq[128 + 32 * half:160 + 32 * half]
        sh = s[8 * half:8 * half + 8]
        xh = x[128 * half:128 * half + 128]
        ah = a[128 * half:128 * half + 128]
        for p in range(2):
            s0, s1, s2, s3 = sh[p], sh[2 + p], sh[4 + p], sh[6 + p]
            for lane in range(16 * p, 16 * p + 16):
                q0, q1, q2, q3 = _q6k_quants(ql, qh, lane)
                ah[lane] += (s0 * q0) * xh[lane]
                ah[32 + lane] += (s1 * q1) * xh[32 + lane]
                ah[64 + lane] += (s2 * q2) * xh[64 + lane]
                ah[96 + lane] += (s3 * q3) * xh[96 + lane]


# ----------------------------------------------------------------------------- kernels

@njit(inline="always")
def _fold(acc, out, r):
    """out[t, r] = the 256 lanes of acc[t] summed in the fixed order of the module docstring."""
    for t in range(acc.shape[0]):
        a = acc[t]
        n = 128
        while n >= 16:
            for i in range(n):
                a[i] += a[n + i]
            n //= 2
        s = np.float32(0.0)
        for i in range(16):
            s += a[i]
        out[t, r] = s


@njit(inline="always")
def _accumulate(w, h, k0, acc):
    for t in range(h.shape[0]):
        a = acc[t]
        x = h[t, k0:k0 + 256]
        for i in range(256):
            a[i] += w[i] * x[i]


@njit(parallel=True, cache=True)
def _dequant_q4k(blocks, scales, r0, out):
    n, cols = out.shape
    for i in prange(n):
        row, s, o = blocks[r0 + i], scales[r0 + i], out[i]
        for b in range(cols // 256):
            _q4k_weights(row[144 * b + 16:144 * b + 144], s[b], o[256 * b:256 * b + 256])


@njit(parallel=True, cache=True)
def _dequant_q6k(blocks, scales, r0, out):
    n, cols = out.shape
    for i in prange(n):
        row, s, o = blocks[r0 + i], scales[r0 + i], out[i]
        for b in range(cols // 256):
            _q6k_weights(row[210 * b:210 * b + 210], s[b], o[256 * b:256 * b + 256])


@njit(parallel=True, cache=True)
def _gemv_q4k(blocks, scales, h, out):
    """T == 1: the weights formed and multiplied in one pass (no w buffer)."""
    rows = blocks.shape[0]
    nb = h.shape[1] // 256
    for g in prange((rows + ROW_GROUP - 1) // ROW_GROUP):
        acc = np.empty((1, 256), np.float32)
        for r in range(ROW_GROUP * g, min(rows, ROW_GROUP * g + ROW_GROUP)):
            row, s, a = blocks[r], scales[r], acc[0]
            a[:] = 0.0
            for b in range(nb):
                _q4k_fma(row[144 * b + 16:144 * b + 144], s[b], h[0, 256 * b:256 * b + 256], a)
            _fold(acc, out, r)


@njit(parallel=True, cache=True)
def _gemv_q6k(blocks, scales, h, out):
    rows = blocks.shape[0]
    nb = h.shape[1] // 256
    for g in prange((rows + ROW_GROUP - 1) // ROW_GROUP):
        acc = np.empty((1, 256), np.float32)
        for r in range(ROW_GROUP * g, min(rows, ROW_GROUP * g + ROW_GROUP)):
            row, s, a = blocks[r], scales[r], acc[0]
            a[:] = 0.0
            for b in range(nb):
                _q6k_fma(row[210 * b:210 * b + 210], s[b], h[0, 256 * b:256 * b + 256], a)
            _fold(acc, out, r)


@njit(parallel=True, cache=True)
def _gemm_q4k(blocks, scales, h, out):
    """T >= 1: each block's weights into w (L1), then every token's lanes."""
    rows = blocks.shape[0]
    T, K = h.shape
    for g in prange((rows + ROW_GROUP - 1) // ROW_GROUP):
        w = np.empty(256, np.float32)
        acc = np.empty((T, 256), np.float32)
        for r in range(ROW_GROUP * g, min(rows, ROW_GROUP * g + ROW_GROUP)):
            row, s = blocks[r], scales[r]
            acc[:, :] = 0.0
            for b in range(K // 256):
                _q4k_weights(row[144 * b + 16:144 * b + 144], s[b], w)
                _accumulate(w, h, 256 * b, acc)
            _fold(acc, out, r)


@njit(parallel=True, cache=True)
def _gemm_q6k(blocks, scales, h, out):
    rows = blocks.shape[0]
    T, K = h.shape
    for g in prange((rows + ROW_GROUP - 1) // ROW_GROUP):
        w = np.empty(256, np.float32)
        acc = np.empty((T, 256), np.float32)
        for r in range(ROW_GROUP * g, min(rows, ROW_GROUP * g + ROW_GROUP)):
            row, s = blocks[r], scales[r]
            acc[:, :] = 0.0
            for b in range(K // 256):
                _q6k_weights(row[210 * b:210 * b + 210], s[b], w)
                _accumulate(w, h, 256 * b, acc)
            _fold(acc, out, r)


_KERNELS = {
    "q4_k": (_scales_q4k, _dequant_q4k, _gemv_q4k, _gemm_q4k),
    "q6_k": (_scales_q6k, _dequant_q6k, _gemv_q6k, _gemm_q6k),
}
KINDS = tuple(_KERNELS)


class QuantMatrix:
    """One q4_K / q6_K matrix over its file blocks plus its decoded sub-block scales."""

    def __init__(self, kind: str, blocks: np.ndarray):
        if kind not in _KERNELS:
            raise ValueError(f"QuantMatrix: no kernel for {kind!r} (have {', '.join(KINDS)})")
        self.kind = kind
        self.blocks = np.asarray(blocks)                  # a plain view of the memmap
        if self.blocks.dtype != np.uint8 or self.blocks.ndim != 2 or not self.blocks.flags.c_contiguous:
            raise ValueError("QuantMatrix: blocks must be C-contiguous uint8 [rows, row_bytes]")
        block_bytes = 144 if kind == "q4_k" else 210
        if self.blocks.shape[1] % block_bytes:
            raise ValueError(f"QuantMatrix: row of {self.blocks.shape[1]} bytes is not whole {kind} blocks")
        nb = self.blocks.shape[1] // block_bytes
        self.rows, self.cols = self.blocks.shape[0], nb * 256
        self._scales_fn, self._dequant, self._gemv, self._gemm = _KERNELS[kind]
        self.scales = np.empty((self.rows, nb, 16), dtype=np.float32)
        self._scales_fn(self.blocks, f16_table(), self.scales)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes

    def dequantize(self, r0: int, out: np.ndarray) -> np.ndarray:
        """Rows r0 .. r0 + len(out) - 1 as float32 into out [n, cols] (C-contiguous)."""
        if out.dtype != np.float32 or not out.flags.c_contiguous or out.shape[1] != self.cols:
            raise ValueError(f"dequantize: out must be C-contiguous float32 [n, {self.cols}]")
        if r0 < 0 or r0 + out.shape[0] > self.rows:
            raise ValueError(f"dequantize: rows {r0}..{r0 + out.shape[0]} of {self.rows}")
        self._dequant(self.blocks, self.scales, r0, out)
        return out

    def matmul_t(self, h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """h [T, K] float32 @ W.T -> float32 [T, rows], the weights never written as a matrix."""
        h = np.ascontiguousarray(h, dtype=np.float32)
        if h.ndim != 2 or h.shape[1] != self.cols:
            raise ValueError(f"matmul_t: h {h.shape} against [{self.rows}, {self.cols}]")
        if out is None:
            out = np.empty((h.shape[0], self.rows), dtype=np.float32)
        (self._gemv if h.shape[0] == 1 else self._gemm)(self.blocks, self.scales, h, out)
        return out
