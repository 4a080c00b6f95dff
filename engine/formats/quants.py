"""k-quant block formats (q4_K, q6_K, q8_1) in numpy: layouts, (de)quantizers, the
q6_K 210 -> 224 byte repack. (The integer-dot MMQ references the CUDA kernels are checked
against are in engine/reference/mmq.py.)

Everything is vectorised over blocks (no Python loop over blocks) and works on arrays of
shape [..., n_blocks * block_bytes] (rows of whole blocks); float outputs are float32.

Block layouts (QK_K = 256 weights per super-block, little-endian):

q4_K, 144 bytes (`block_q4_K` in ggml):
    offset 0..1     d     f16   super-block scale for the sub-block scales
    offset 2..3     dmin  f16   super-block scale for the sub-block mins
    offset 4..15    scales[12]  8 x 6-bit scale sc_j and 8 x 6-bit min m_j, packed:
                        bytes 0..3 : sc_j (j = 0..3) in bits 0..5, bits 6..7 = high 2 bits of sc_{j+4}
                        bytes 4..7 : m_j  (j = 0..3) in bits 0..5, bits 6..7 = high 2 bits of m_{j+4}
                        bytes 8..11: low nibble = low 4 bits of sc_{j+4}, high nibble = low 4 bits of m_{j+4}
    offset 16..143  qs[128]     256 x 4-bit quants: 4 chunks of 32 bytes; chunk c holds sub-block
                                2c in the low nibbles and sub-block 2c+1 in the high nibbles
                                (element l of sub-block 2c+h is (qs[32c + l] >> 4h) & 15)
    value(j, l) = (d * sc_j) * q - (dmin * m_j)        (8 sub-blocks of 32 elements)

q6_K, 210 bytes (`block_q6_K`):
    offset 0..127    ql[128]   low 4 bits of the 256 quants
    offset 128..191  qh[64]    high 2 bits of the quants
    offset 192..207  sc[16]    int8 scale of each 16-element sub-block
    offset 208..209  d   f16   super-block scale
    element e = 128*h + n (half h = 0..1, n = 0..127):
        low  = (ql[64*h + n % 64] >> (4 * (n // 64))) & 15
        high = (qh[32*h + n % 32] >> (2 * (n // 32))) & 3
        q = (low | high << 4) - 32                   (-32..31)
    value(e) = (d * sc[e // 16]) * q

q6_K padded, 224 bytes: the same 210 bytes followed by 14 zero bytes, so with a 16-byte
aligned base every block (224 = 14 * 16) starts 16-byte aligned (uint4 loads on the GPU).

q8_1 (activations, QK8_1 = 32 values per block; kept as three planes, not packed):
    d = amax / 127 (float32), q = roundf(x / d) (half away from zero, q = 0 when d == 0),
    s = d * sum(q) (float32 product of d and the exact integer sum; see quantize_q8_1).
"""

from __future__ import annotations

import numpy as np

QK_K = 256
Q4_K_BYTES = 144
Q6_K_BYTES = 210
Q6_K_PADDED_BYTES = 224
QK8_1 = 32

__all__ = [
    "QK_K", "Q4_K_BYTES", "Q6_K_BYTES", "Q6_K_PADDED_BYTES", "QK8_1",
    "dequantize_q4_k", "dequantize_q6_k", "quantize_q4_k", "quantize_q6_k",
    "repack_q6_k_padded", "unpack_q6_k_padded", "quantize_q8_1", "dequantize_q8_1",
    "q4_k_fields", "q6_k_fields",
]


# ----------------------------------------------------------------------------- helpers

def _blocks(a: np.ndarray, block_bytes: int, what: str) -> tuple[np.ndarray, tuple[int, ...], int]:
    """View a uint8 [..., n*block_bytes] array as [n_total, block_bytes]."""
    a = np.asarray(a)
    if a.dtype != np.uint8:
        raise TypeError(f"{what}: expected uint8 blocks, got {a.dtype}")
    if a.ndim == 0 or a.shape[-1] % block_bytes:
        raise ValueError(f"{what}: last dimension {a.shape[-1:]} is not a multiple of {block_bytes}")
    nb = a.shape[-1] // block_bytes
    return np.ascontiguousarray(a).reshape(-1, block_bytes), a.shape[:-1], nb


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf semantics (half away from zero), exact for float32 input of moderate size."""
    v64 = np.asarray(v, dtype=np.float64)
    return np.trunc(v64 + np.copysign(0.5, v64))


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float array [B] -> uint8 [B, 2] (little-endian f16)."""
    return np.ascontiguousarray(v.astype("<f2")).view(np.uint8).reshape(-1, 2)


# ----------------------------------------------------------------------------- q4_K

def _q4_k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scales uint8 [B, 12] -> (sc uint8 [B, 8], m uint8 [B, 8])."""
    s = scales.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    m = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, m


def _q4_k_pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """sc, m uint8 [B, 8] (0..63) -> uint8 [B, 12]."""
    sc = sc.astype(np.uint8)
    m = m.astype(np.uint8)
    a = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    b = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([a, b, c], axis=-1).astype(np.uint8)


def q4_k_fields(blocks: np.ndarray):
    """Split q4_K blocks [B, 144] into (d f32 [B], dmin f32 [B], sc u8 [B,8], m u8 [B,8],
    q u8 [B, 8, 32]) where q[:, j, l] is element 32*j + l."""
    b = blocks.reshape(-1, Q4_K_BYTES)
    d = np.ascontiguousarray(b[:, 0:2]).view("<f2").astype(np.float32).reshape(-1)
    dmin = np.ascontiguousarray(b[:, 2:4]).view("<f2").astype(np.float32).reshape(-1)
    sc, m = _q4_k_scale_min(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(-1, 8, 32)
    return d, dmin, sc, m, q


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """uint8 [..., n*144] -> float32 [..., n*256]; bit-exact with gguf.quants.dequantize
    (same float32 operation order: (d*sc) * q - (dmin*m), no fused multiply-add)."""
    b, lead, nb = _blocks(blocks, Q4_K_BYTES, "dequantize_q4_k")
    d, dmin, sc, m, q = q4_k_fields(b)
    ds = (d[:, None] * sc.astype(np.float32))[:, :, None]
    dm = (dmin[:, None] * m.astype(np.float32))[:, :, None]
    y = ds * q.astype(np.float32) - dm
    return y.reshape(*lead, nb * QK_K)


def quantize_q4_k(x: np.ndarray, refine: int = 2) -> np.ndarray:
    """float32 [..., n*256] -> uint8 [..., n*144].

    Per 32-element sub-block: min-max affine fit (min clamped to <= 0, as q4_K can only
    subtract), then `refine` rounds of least-squares re-fit of (scale, min) given the current
    4-bit assignment; sub-block scales/mins are quantized to 6 bits against the f16
    super-block d = max(scale)/63, dmin = max(min)/63, and the final 4-bit codes are chosen
    against the effective (f16 d * sc, f16 dmin * m) actually stored.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        raise ValueError(f"quantize_q4_k: last dimension {x.shape[-1:]} is not a multiple of {QK_K}")
    lead, nb = x.shape[:-1], x.shape[-1] // QK_K
    xb = x.reshape(-1, 8, 32).astype(np.float64)

    mn = np.minimum(xb.min(axis=-1), 0.0)          # [B, 8] (<= 0)
    mx = xb.max(axis=-1)
    scale = (mx - mn) / 15.0
    mins = -mn                                      # >= 0; value = scale*q - mins
    for _ in range(refine):
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(scale[..., None] > 0, np.rint((xb + mins[..., None]) / scale[..., None]), 0.0)
        q = np.clip(q, 0, 15)
        # least squares x ~ scale*q - mins over the sub-block
        n = 32.0
        sq, sqq = q.sum(-1), (q * q).sum(-1)
        sx, sqx = xb.sum(-1), (q * xb).sum(-1)
        det = n * sqq - sq * sq
        ok = det > 1e-12
        with np.errstate(divide="ignore", invalid="ignore"):
            new_scale = (n * sqx - sq * sx) / det
            new_off = (sqq * sx - sq * sqx) / det       # = -mins
        good = ok & (new_scale > 0) & (new_off <= 0)
        scale = np.where(good, new_scale, scale)
        mins = np.where(good, -new_off, mins)

    d = scale.max(axis=-1) / 63.0                    # [B]
    dmin = mins.max(axis=-1) / 63.0
    d16 = d.astype(np.float16).astype(np.float64)
    dmin16 = dmin.astype(np.float16).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d16[:, None] > 0, np.rint(scale / d16[:, None]), 0)
        m = np.where(dmin16[:, None] > 0, np.rint(mins / dmin16[:, None]), 0)
    sc = np.clip(sc, 0, 63).astype(np.uint8)
    m = np.clip(m, 0, 63).astype(np.uint8)

    eff_s = d16[:, None] * sc                        # [B, 8]
    eff_m = dmin16[:, None] * m
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff_s[..., None] > 0, np.rint((xb + eff_m[..., None]) / eff_s[..., None]), 0)
    q = np.clip(q, 0, 15).astype(np.uint8)           # [B, 8, 32]

    qr = q.reshape(-1, 4, 2, 32)
    qs = (qr[:, :, 0, :] | (qr[:, :, 1, :] << 4)).reshape(-1, 128)
    out = np.concatenate(
        [_f16_bytes(d16), _f16_bytes(dmin16), _q4_k_pack_scales(sc, m), qs], axis=-1
    )
    return out.reshape(*lead, nb * Q4_K_BYTES)


# ----------------------------------------------------------------------------- q6_K

def _q6_k_view(blocks: np.ndarray, padded: bool, what: str):
    bb = Q6_K_PADDED_BYTES if padded else Q6_K_BYTES
    b, lead, nb = _blocks(blocks, bb, what)
    return b[:, :Q6_K_BYTES], lead, nb


def q6_k_fields(blocks: np.ndarray, padded: bool = False):
    """Split q6_K blocks into (d f32 [B], sc int8 [B, 16], q int8 [B, 256] centred -32..31)."""
    b, _, _ = _q6_k_view(blocks, padded, "q6_k_fields")
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(-1, 2, 4, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(-1, 2, 4, 32)
    q = (ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
    d = np.ascontiguousarray(b[:, 208:210]).view("<f2").astype(np.float32).reshape(-1)
    return d, sc, q.reshape(-1, QK_K)


def dequantize_q6_k(blocks: np.ndarray, padded: bool = False) -> np.ndarray:
    """uint8 [..., n*210] (or [..., n*224] with padded=True) -> float32 [..., n*256];
    bit-exact with gguf.quants.dequantize: (d * sc) * q in float32."""
    b, lead, nb = _q6_k_view(blocks, padded, "dequantize_q6_k")
    d, sc, q = q6_k_fields(b)
    ds = (d[:, None] * sc.astype(np.float32))[:, :, None]        # [B, 16, 1]
    y = ds * q.reshape(-1, 16, 16).astype(np.float32)
    return y.reshape(*lead, nb * QK_K)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [..., n*256] -> uint8 [..., n*210].

    ggml-style: per 16-element sub-block the signed value of largest magnitude maps to -32
    (scale = -vmax/32), the 16 sub-block scales are quantized to int8 against the f16
    super-block d = -smax/128 (smax = the sub-scale of largest magnitude), then the 6-bit
    codes are chosen against the effective f16 d * sc actually stored.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        raise ValueError(f"quantize_q6_k: last dimension {x.shape[-1:]} is not a multiple of {QK_K}")
    lead, nb = x.shape[:-1], x.shape[-1] // QK_K
    xb = x.reshape(-1, 16, 16).astype(np.float64)

    idx = np.abs(xb).argmax(axis=-1)
    vmax = np.take_along_axis(xb, idx[..., None], axis=-1)[..., 0]      # [B, 16] signed
    scale = vmax / -32.0
    j = np.abs(scale).argmax(axis=-1)
    smax = np.take_along_axis(scale, j[:, None], axis=-1)[:, 0]          # [B] signed
    d = smax / -128.0
    d16 = d.astype(np.float16).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d16[:, None] != 0, np.rint(scale / d16[:, None]), 0)
    sc = np.clip(sc, -128, 127)
    eff = d16[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(eff[..., None] != 0, np.rint(xb / eff[..., None]), 0)
    L = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)   # [B, half, n]

    lo, hi = L & 0x0F, L >> 4
    ql = (lo[:, :, :64] | (lo[:, :, 64:] << 4)).reshape(-1, 128)
    qh = (hi[:, :, 0:32] | (hi[:, :, 32:64] << 2) | (hi[:, :, 64:96] << 4) | (hi[:, :, 96:128] << 6))
    qh = qh.reshape(-1, 64)
    out = np.concatenate(
        [ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d16)], axis=-1
    )
    return out.reshape(*lead, nb * Q6_K_BYTES)


def repack_q6_k_padded(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., n*210] -> uint8 [..., n*224]: each block followed by 14 zero bytes."""
    b, lead, nb = _blocks(raw, Q6_K_BYTES, "repack_q6_k_padded")
    out = np.zeros((b.shape[0], Q6_K_PADDED_BYTES), dtype=np.uint8)
    out[:, :Q6_K_BYTES] = b
    return out.reshape(*lead, nb * Q6_K_PADDED_BYTES)


def unpack_q6_k_padded(padded: np.ndarray) -> np.ndarray:
    """uint8 [..., n*224] -> uint8 [..., n*210] (drops the 14 padding bytes of each block)."""
    b, lead, nb = _blocks(padded, Q6_K_PADDED_BYTES, "unpack_q6_k_padded")
    return np.ascontiguousarray(b[:, :Q6_K_BYTES]).reshape(*lead, nb * Q6_K_BYTES)


# ----------------------------------------------------------------------------- q8_1

def quantize_q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 [T, K] -> (q int8 [T, K], d float32 [T, K/32], s float32 [T, K/32]).

    The one q8_1 definition of every backend (numpy, quantize_q8_1.cu, and every kernel that
    writes q8_1 in its epilogue), reproducible bit for bit on the GPU:
        amax = max |x_i|
        d    = amax / 127.0f                 (float32 division)
        q_i  = 0 if amax == 0 else roundf(x_i / d)   (float32 division, then round half
                                                       away from zero)
        s    = d * sum_i q_i                 (the integer sum is exact, |sum| <= 4064; one
                                              float32 rounding)
    Why s = d * sum(q) and not llama.cpp CUDA's float sum of the inputs: the q4_K min term
    dmin*m*s then cancels against the quantized inputs exactly, so an MMQ/MMVQ output equals
    dequant(W) . dequant(x). With s = sum(x) it carries an extra dmin*m*sum(x - dequant(x)):
    measured on a real-weight slice of the default model, the prefill logit error against the
    float32 reference was 7.96e-2 with sum(x) and 2.35e-2 with d*sum(q) (docs/perf-log.md).
    It is also ggml's CPU q8_1 definition.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % QK8_1:
        raise ValueError(f"quantize_q8_1: expected [T, K] with K % 32 == 0, got {x.shape}")
    T, K = x.shape
    xb = x.reshape(T, K // QK8_1, QK8_1)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = (xb / d[..., None]).astype(np.float32)
    q = np.where(amax[..., None] == 0, 0.0, _round_half_away(np.where(amax[..., None] == 0, 0, v)))
    q = q.astype(np.int8).reshape(T, K)
    return q, d, q8_1_block_sum(q, d)


def q8_1_block_sum(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """s of q8_1 blocks (q int8 [..., K], d [..., K/32]) -> float32 [..., K/32] = d * sum(q),
    the integer sum exact, one float32 rounding."""
    qs = np.asarray(q).reshape(*q.shape[:-1], -1, QK8_1).sum(-1, dtype=np.int32).astype(np.float32)
    return (np.asarray(d, dtype=np.float32) * qs).astype(np.float32)


def dequantize_q8_1(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(q int8 [T, K], d [T, K/32]) -> float32 [T, K] = q * d."""
    T, K = q.shape
    return (q.reshape(T, K // QK8_1, QK8_1).astype(np.float32) * d[..., None]).reshape(T, K)
