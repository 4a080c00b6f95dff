"""Compiled (numba) q4_K / q6_K kernels for the CPU backend's quantized matrices
(engine.reference.model.Matrix): the weights are never all held as float32.

    q = QuantMatrix(kind, blocks)     kind "q4_k" | "q6_k" (QuantType.kind); blocks: uint8
                                      [rows, K / 256 * block_bytes], the file's mapping
    q.dequantize(r0, out)             W[r0 : r0 + len(out)] as float32, bit-identical to
                                      engine.reference.ops.dequantize_rows (prompts: a chunk of
                                      rows, then a BLAS product)
    q.matmul_t(h)                     h [T, K] @ W.T -> float32 [T, rows] without writing W:
                                      each block's weights are formed in registers / L1 (the
                                      same float32 values) and multiplied at once (decode, small
                                      steps)

At construction each block's sub-block scales are decoded once into float32 (`scales`, 64 bytes
per 256 weights: q4_K d*sc_j and dmin*m_j, q6_K d*sc_i). q4_K quants are read in place from
the file's blocks; q6_K quants are unpacked once to int8 (`quants`, 256 bytes per 256 weights
instead of 210: unpacking the 6-bit fields per call cost as much as the rest of the product).
Block layouts: engine/formats/quants.py.

Numerics. A weight is formed exactly as numpy does (q4_K: (d*sc)*q - (dmin*m), q6_K: (d*sc)*q,
every product and difference rounded to float32; fastmath is off, so LLVM contracts nothing into
a fused multiply-add; f16 scales through a table made by numpy's own f16 -> f32 cast).
matmul_t sums w * h for one (row, token) in 256 float32 lanes (lane i takes k = i mod 256, in
increasing k), then folds the lanes in a fixed order (128 + 128, 64 + 64, ..., 16 + 16, then
the 16 in turn). That order depends on K alone: a token's outputs have the same bits whatever T
and whichever tokens share the call (the single-token and the T-token kernels agree bit for
bit). It is not BLAS's order: results differ from h @ dequantize_rows(W).T by float32 rounding.

Integer work is written in int32 throughout (an int64 intermediate makes LLVM convert 64-bit
lanes to float, half the vector width), and each inner loop covers a whole block (32 lanes x 8
sub-blocks for q4_K, 16 x 16 for q6_K): loops of one sub-block spent as much in setup as in
arithmetic (measured, docs/perf-log.md).

Importing this module imports numba, an optional dependency: engine.reference.model imports it
only for quantized matrices. Compiled code is cached beside this file (cache=True); the first
use in a fresh checkout (or after an edit of this file) compiles the kernels, tens of seconds on
2 cores.
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


@njit(parallel=True, cache=True)
def _expand_q6k(blocks, out):
    """out int8 [rows, nb * 256]: every q6_K block's quants in element order (_q6k_unpack)."""
    for r in prange(out.shape[0]):
        row, o = blocks[r], out[r]
        for b in range(out.shape[1] // 256):
            _q6k_unpack(row[210 * b:210 * b + 210], o[256 * b:256 * b + 256])


# ----------------------------------------------------------------------------- one block

@njit(inline="always")
def _q4k_weights(q, s, w):
    """The 256 weights of a q4_K block (q: its 128 quant bytes, s: its 16 scales) into w:
    element 64*c + 32*hi + lane is nibble hi of q[32*c + lane], scale s[2c + hi], min s[8 + 2c + hi]."""
    d0, d1, d2, d3, d4, d5, d6, d7 = s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]
    m0, m1, m2, m3, m4, m5, m6, m7 = s[8], s[9], s[10], s[11], s[12], s[13], s[14], s[15]
    for lane in range(32):
        b0, b1, b2, b3 = _u(q, lane), _u(q, 32 + lane), _u(q, 64 + lane), _u(q, 96 + lane)
        w[lane] = d0 * np.float32(np.int32(b0 & np.int32(15))) - m0
        w[32 + lane] = d1 * np.float32(np.int32(b0 >> np.int32(4))) - m1
        w[64 + lane] = d2 * np.float32(np.int32(b1 & np.int32(15))) - m2
        w[96 + lane] = d3 * np.float32(np.int32(b1 >> np.int32(4))) - m3
        w[128 + lane] = d4 * np.float32(np.int32(b2 & np.int32(15))) - m4
        w[160 + lane] = d5 * np.float32(np.int32(b2 >> np.int32(4))) - m5
        w[192 + lane] = d6 * np.float32(np.int32(b3 & np.int32(15))) - m6
        w[224 + lane] = d7 * np.float32(np.int32(b3 >> np.int32(4))) - m7


@njit(inline="always")
def _q4k_fma(q, s, x, a):
    """a[i] += weight_i * x[i] over one q4_K block (the weights as in _q4k_weights)."""
    d0, d1, d2, d3, d4, d5, d6, d7 = s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]
    m0, m1, m2, m3, m4, m5, m6, m7 = s[8], s[9], s[10], s[11], s[12], s[13], s[14], s[15]
    for lane in range(32):
        b0, b1, b2, b3 = _u(q, lane), _u(q, 32 + lane), _u(q, 64 + lane), _u(q, 96 + lane)
        a[lane] += (d0 * np.float32(np.int32(b0 & np.int32(15))) - m0) * x[lane]
        a[32 + lane] += (d1 * np.float32(np.int32(b0 >> np.int32(4))) - m1) * x[32 + lane]
        a[64 + lane] += (d2 * np.float32(np.int32(b1 & np.int32(15))) - m2) * x[64 + lane]
        a[96 + lane] += (d3 * np.float32(np.int32(b1 >> np.int32(4))) - m3) * x[96 + lane]
        a[128 + lane] += (d4 * np.float32(np.int32(b2 & np.int32(15))) - m4) * x[128 + lane]
        a[160 + lane] += (d5 * np.float32(np.int32(b2 >> np.int32(4))) - m5) * x[160 + lane]
        a[192 + lane] += (d6 * np.float32(np.int32(b3 & np.int32(15))) - m6) * x[192 + lane]
        a[224 + lane] += (d7 * np.float32(np.int32(b3 >> np.int32(4))) - m7) * x[224 + lane]


@njit(inline="always")
def _q6k_unpack(bq, o):
    """The 256 quants of a q6_K block (bq: its 210 bytes) as int8 -32..31 into o, in element
    order: element 128*half + 32*g + lane is (ql >> 4*(g // 2)) & 15 | ((qh >> 2*g) & 3) << 4,
    ql = bq[64*half + 32*(g % 2) + lane], qh = bq[128 + 32*half + lane]."""
    for half in range(2):
        ql = bq[64 * half:64 * half + 64]
        qh = bq[128 + 32 * half:160 + 32 * half]
        oh = o[128 * half:128 * half + 128]
        for lane in range(32):
            a = _u(ql, lane)
            b = _u(ql, 32 + lane)
            c = _u(qh, lane)
            oh[lane] = np.int8(((a & np.int32(15)) | ((c & np.int32(3)) << np.int32(4))) - np.int32(32))
            oh[32 + lane] = np.int8(((b & np.int32(15)) | (((c >> np.int32(2)) & np.int32(3)) << np.int32(4)))
                                    - np.int32(32))
            oh[64 + lane] = np.int8(((a >> np.int32(4)) | (((c >> np.int32(4)) & np.int32(3)) << np.int32(4)))
                                    - np.int32(32))
            oh[96 + lane] = np.int8(((b >> np.int32(4)) | (((c >> np.int32(6)) & np.int32(3)) << np.int32(4)))
                                    - np.int32(32))


@njit(inline="always")
def _q6k_weights(q, s, w):
    """The 256 weights of a q6_K block (q: its int8 quants, s: its 16 scales) into w:
    element 16*j + lane is s[j] * q[16*j + lane]."""
    s0, s1, s2, s3, s4, s5, s6, s7 = s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]
    s8, s9, s10, s11, s12, s13, s14, s15 = s[8], s[9], s[10], s[11], s[12], s[13], s[14], s[15]
    for lane in range(16):
        w[0 + lane] = s0 * np.float32(np.int32(q[0 + lane]))
        w[16 + lane] = s1 * np.float32(np.int32(q[16 + lane]))
        w[32 + lane] = s2 * np.float32(np.int32(q[32 + lane]))
        w[48 + lane] = s3 * np.float32(np.int32(q[48 + lane]))
        w[64 + lane] = s4 * np.float32(np.int32(q[64 + lane]))
        w[80 + lane] = s5 * np.float32(np.int32(q[80 + lane]))
        w[96 + lane] = s6 * np.float32(np.int32(q[96 + lane]))
        w[112 + lane] = s7 * np.float32(np.int32(q[112 + lane]))
        w[128 + lane] = s8 * np.float32(np.int32(q[128 + lane]))
        w[144 + lane] = s9 * np.float32(np.int32(q[144 + lane]))
        w[160 + lane] = s10 * np.float32(np.int32(q[160 + lane]))
        w[176 + lane] = s11 * np.float32(np.int32(q[176 + lane]))
        w[192 + lane] = s12 * np.float32(np.int32(q[192 + lane]))
        w[208 + lane] = s13 * np.float32(np.int32(q[208 + lane]))
        w[224 + lane] = s14 * np.float32(np.int32(q[224 + lane]))
        w[240 + lane] = s15 * np.float32(np.int32(q[240 + lane]))


@njit(inline="always")
def _q6k_fma(q, s, x, a):
    """a[i] += weight_i * x[i] over one q6_K block (the weights as in _q6k_weights)."""
    s0, s1, s2, s3, s4, s5, s6, s7 = s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]
    s8, s9, s10, s11, s12, s13, s14, s15 = s[8], s[9], s[10], s[11], s[12], s[13], s[14], s[15]
    for lane in range(16):
        a[0 + lane] += (s0 * np.float32(np.int32(q[0 + lane]))) * x[0 + lane]
        a[16 + lane] += (s1 * np.float32(np.int32(q[16 + lane]))) * x[16 + lane]
        a[32 + lane] += (s2 * np.float32(np.int32(q[32 + lane]))) * x[32 + lane]
        a[48 + lane] += (s3 * np.float32(np.int32(q[48 + lane]))) * x[48 + lane]
        a[64 + lane] += (s4 * np.float32(np.int32(q[64 + lane]))) * x[64 + lane]
        a[80 + lane] += (s5 * np.float32(np.int32(q[80 + lane]))) * x[80 + lane]
        a[96 + lane] += (s6 * np.float32(np.int32(q[96 + lane]))) * x[96 + lane]
        a[112 + lane] += (s7 * np.float32(np.int32(q[112 + lane]))) * x[112 + lane]
        a[128 + lane] += (s8 * np.float32(np.int32(q[128 + lane]))) * x[128 + lane]
        a[144 + lane] += (s9 * np.float32(np.int32(q[144 + lane]))) * x[144 + lane]
        a[160 + lane] += (s10 * np.float32(np.int32(q[160 + lane]))) * x[160 + lane]
        a[176 + lane] += (s11 * np.float32(np.int32(q[176 + lane]))) * x[176 + lane]
        a[192 + lane] += (s12 * np.float32(np.int32(q[192 + lane]))) * x[192 + lane]
        a[208 + lane] += (s13 * np.float32(np.int32(q[208 + lane]))) * x[208 + lane]
        a[224 + lane] += (s14 * np.float32(np.int32(q[224 + lane]))) * x[224 + lane]
        a[240 + lane] += (s15 * np.float32(np.int32(q[240 + lane]))) * x[240 + lane]


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


# Kernels: q4_K ones read the file's blocks (uint8 [rows, nb * 144]), q6_K ones the int8 quants
# ([rows, nb * 256]); scales [rows, nb, 16]; h [T, K]; out [T, rows] (dequantize: [n, K], serial:
# it runs between OpenBLAS calls, whose spinning worker holds the other core).

@njit(cache=True)
def _dequant_q4k(blocks, scales, r0, out):
    n, cols = out.shape
    for i in range(n):
        row, s, o = blocks[r0 + i], scales[r0 + i], out[i]
        for b in range(cols // 256):
            _q4k_weights(row[144 * b + 16:144 * b + 144], s[b], o[256 * b:256 * b + 256])


@njit(cache=True)
def _dequant_q6k(quants, scales, r0, out):
    n, cols = out.shape
    for i in range(n):
        row, s, o = quants[r0 + i], scales[r0 + i], out[i]
        for b in range(cols // 256):
            _q6k_weights(row[256 * b:256 * b + 256], s[b], o[256 * b:256 * b + 256])


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
def _gemv_q6k(quants, scales, h, out):
    rows = quants.shape[0]
    nb = h.shape[1] // 256
    for g in prange((rows + ROW_GROUP - 1) // ROW_GROUP):
        acc = np.empty((1, 256), np.float32)
        for r in range(ROW_GROUP * g, min(rows, ROW_GROUP * g + ROW_GROUP)):
            row, s, a = quants[r], scales[r], acc[0]
            a[:] = 0.0
            for b in range(nb):
                _q6k_fma(row[256 * b:256 * b + 256], s[b], h[0, 256 * b:256 * b + 256], a)
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
def _gemm_q6k(quants, scales, h, out):
    rows = quants.shape[0]
    T, K = h.shape
    for g in prange((rows + ROW_GROUP - 1) // ROW_GROUP):
        w = np.empty(256, np.float32)
        acc = np.empty((T, 256), np.float32)
        for r in range(ROW_GROUP * g, min(rows, ROW_GROUP * g + ROW_GROUP)):
            row, s = quants[r], scales[r]
            acc[:, :] = 0.0
            for b in range(K // 256):
                _q6k_weights(row[256 * b:256 * b + 256], s[b], w)
                _accumulate(w, h, 256 * b, acc)
            _fold(acc, out, r)


_KERNELS = {
    "q4_k": (_dequant_q4k, _gemv_q4k, _gemm_q4k),
    "q6_k": (_dequant_q6k, _gemv_q6k, _gemm_q6k),
}
KINDS = tuple(_KERNELS)
_LOADED: set[str] = set()


class QuantMatrix:
    """One q4_K / q6_K matrix: what the kernels read (`quants`) and its decoded sub-block scales.

    q4_K: quants is the file's blocks themselves (read in place, 144 bytes per 256 weights).
    q6_K: quants is an int8 copy of the 6-bit quants in element order (256 bytes per 256
    weights, 1.2x its blocks; the caller may then drop the file's pages of it, reads_file is
    False): unpacking 6-bit fields cost more per weight than the rest of the product.
    """

    def __init__(self, kind: str, blocks: np.ndarray):
        if kind not in _KERNELS:
            raise ValueError(f"QuantMatrix: no kernel for {kind!r} (have {', '.join(KINDS)})")
        blocks = np.asarray(blocks)                       # a plain view of the memmap
        if blocks.dtype != np.uint8 or blocks.ndim != 2 or not blocks.flags.c_contiguous:
            raise ValueError("QuantMatrix: blocks must be C-contiguous uint8 [rows, row_bytes]")
        block_bytes = 144 if kind == "q4_k" else 210
        if blocks.shape[1] % block_bytes:
            raise ValueError(f"QuantMatrix: row of {blocks.shape[1]} bytes is not whole {kind} blocks")
        self.kind = kind
        nb = blocks.shape[1] // block_bytes
        self.rows, self.cols = blocks.shape[0], nb * 256
        self._dequant, self._gemv, self._gemm = _KERNELS[kind]
        self.scales = np.empty((self.rows, nb, 16), dtype=np.float32)
        if kind == "q4_k":
            _scales_q4k(blocks, f16_table(), self.scales)
            self.quants = blocks
        else:
            _scales_q6k(blocks, f16_table(), self.scales)
            self.quants = np.empty((self.rows, self.cols), dtype=np.int8)
            _expand_q6k(blocks, self.quants)
        self.reads_file = kind == "q4_k"
        if kind not in _LOADED:       # load (or compile) every kernel now, not in the first forward
            one = QuantMatrix.__new__(QuantMatrix)
            one.__dict__.update(self.__dict__, quants=self.quants[:1], scales=self.scales[:1], rows=1)
            one.dequantize(0, np.empty((1, self.cols), np.float32))
            one.matmul_t(np.zeros((1, self.cols), np.float32))
            one.matmul_t(np.zeros((2, self.cols), np.float32))
            _LOADED.add(kind)

    @property
    def nbytes(self) -> int:
        return self.quants.nbytes + self.scales.nbytes

    def dequantize(self, r0: int, out: np.ndarray) -> np.ndarray:
        """Rows r0 .. r0 + len(out) - 1 as float32 into out [n, cols] (C-contiguous)."""
        if out.dtype != np.float32 or not out.flags.c_contiguous or out.shape[1] != self.cols:
            raise ValueError(f"dequantize: out must be C-contiguous float32 [n, {self.cols}]")
        if r0 < 0 or r0 + out.shape[0] > self.rows:
            raise ValueError(f"dequantize: rows {r0}..{r0 + out.shape[0]} of {self.rows}")
        self._dequant(self.quants, self.scales, r0, out)
        return out

    def matmul_t(self, h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """h [T, K] float32 @ W.T -> float32 [T, rows], the weights never written as a matrix."""
        h = np.ascontiguousarray(h, dtype=np.float32)
        if h.ndim != 2 or h.shape[1] != self.cols:
            raise ValueError(f"matmul_t: h {h.shape} against [{self.rows}, {self.cols}]")
        if out is None:
            out = np.empty((h.shape[0], self.rows), dtype=np.float32)
        (self._gemv if h.shape[0] == 1 else self._gemm)(self.quants, self.scales, h, out)
        return out
