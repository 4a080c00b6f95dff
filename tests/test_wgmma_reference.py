"""CPU: the oracle of the Hopper f16 GEMM (engine.reference.wgmma) and a lane-by-lane numpy
replay of wgmma_q4_k.cu's fragment construction (nibble bit tricks, f16x2 FMAs, which register
of which k16 step each word feeds), so the kernel's k order is checked without a GPU."""
from __future__ import annotations

import numpy as np

from engine.formats import quants as Q
from engine.reference.mmq import random_blocks
from engine.reference.wgmma import (
    dequant_q4_k_f16, k_permutation, permute_x16, tile_x16, wgmma_abs, wgmma_error_bound, wgmma_reference,
)


def test_permutation_is_a_bijection_within_super_blocks():
    P = k_permutation()
    assert sorted(P) == list(range(256))
    x = np.arange(2 * 512, dtype=np.float32).reshape(2, 512)
    xp = permute_x16(x).astype(np.float32)
    assert np.array_equal(xp[:, 256:] - 256, xp[:, :256])            # same map in every super-block
    assert np.array_equal(xp[0, :256], P.astype(np.float32))


def test_tiled_pieces_are_the_shared_memory_stage_layout():
    """Token groups g0.. of one 64-k block are contiguous in tile_x16, and the 1,024-byte piece of
    (token group, 64 k) holds (token n, k) at byte (k / 8) * 128 + (n % 8) * 16 + (k % 8) * 2, the
    kernel's shared-memory core-matrix layout."""
    rng = np.random.default_rng(3)
    T, K = 13, 512
    x = rng.standard_normal((T, K)).astype(np.float32)
    xp, xt = permute_x16(x), tile_x16(x)
    assert xt.shape == (K // 64, 2, 8, 8, 8)
    flat = xt.reshape(-1)
    for n in (0, 7, 8, 12):
        for k in (0, 9, 63, 64, 300, 511):
            gi, k0 = n // 8, k // 64 * 64
            piece = (k0 // 64 * 2 + gi) * 512                           # in f16 elements
            byte = (k - k0) // 8 * 128 + n % 8 * 16 + k % 8 * 2
            assert flat[piece + byte // 2] == xp[n, k]
    assert not xt[:, 1, :, 5:].any()                                    # tokens 13..15: zero


def test_dequant_f16_is_the_f32_dequant_rounded_closely():
    rng = np.random.default_rng(5)
    w = random_blocks(rng, "q4_k", 64, 1024, special=True)
    w16 = dequant_q4_k_f16(w).astype(np.float64)
    w32 = Q.dequantize_q4_k(w).astype(np.float64)
    # two roundings of the scale terms (2^-11 each, relative to |s q| + |m'|) and one of the result
    d, dmin, sc, m, q = Q.q4_k_fields(w)
    mag = (np.abs(d[:, None] * sc)[:, :, None] * q + np.abs(dmin[:, None] * m)[:, :, None]).reshape(w16.shape)
    assert np.all(np.abs(w16 - w32) <= 3 * 2.0 ** -11 * mag + 2.0 ** -24)


def _f16_bits(v):
    return np.asarray(v, dtype=np.float16).view(np.uint16)


def _halves(u32):
    """u32 -> (low f16, high f16) as float64."""
    u32 = np.uint32(u32)
    lo = np.array([u32 & 0xFFFF], dtype=np.uint16).view(np.float16)[0]
    hi = np.array([u32 >> 16], dtype=np.uint16).view(np.float16)[0]
    return float(lo), float(hi)


def _fma16(a, b, c):
    return np.float16(a * b + c)      # float64 is exact for these operands: one rounding


def test_kernel_fragments_replayed_match_the_oracle():
    """Replay, for every lane (g, t) of one warp, the words -> registers of wgmma_q4_k.cu and
    place each register half at its wgmma A position (row, k16 step, column); the result must be
    dequant_q4_k_f16 in the permuted order."""
    rng = np.random.default_rng(11)
    w = random_blocks(rng, "q4_k", 16, 256, special=False)
    want = dequant_q4_k_f16(w)[:, k_permutation()].astype(np.float64)
    got = np.full((16, 256), np.nan)
    d, dmin, sc, m, _ = Q.q4_k_fields(w)
    for g in range(8):
        for t in range(4):
            for r, row in enumerate((g, g + 8)):
                qs = w[row, 16:144]
                s = [float(np.float16(d[row] * np.float32(sc[row, 2 * t + i]))) for i in (0, 1)]
                mm = [-float(np.float16(dmin[row] * np.float32(m[row, 2 * t + i]))) for i in (0, 1)]
                for mw in range(8):
                    b = qs[32 * t + 4 * mw: 32 * t + 4 * mw + 4].astype(np.uint32)
                    word = int(b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24))
                    w8 = word >> 8
                    regs = {}
                    for name, src, mask in (("lo_a", word, 0x000F000F), ("lo_b", w8, 0x000F000F),
                                            ("hi_a", word, 0x00F000F0), ("hi_b", w8, 0x00F000F0)):
                        pair = _halves((src & mask) | 0x64006400)
                        if mask == 0x000F000F:
                            qv = [float(np.float16(p - 1024.0)) for p in pair]
                            regs[name] = [float(_fma16(q, s[0], mm[0])) for q in qv]
                        else:
                            qv = [float(_fma16(p, 1.0 / 16, -64.0)) for p in pair]
                            regs[name] = [float(_fma16(q, s[1], mm[1])) for q in qv]
                    # step 2mw: cols 2t+e <- lo_a, 2t+8+e <- lo_b; step 2mw+1: hi_a, hi_b
                    for step, (ra, rb) in ((2 * mw, ("lo_a", "lo_b")), (2 * mw + 1, ("hi_a", "hi_b"))):
                        for e in (0, 1):
                            got[row, 16 * step + 2 * t + e] = regs[ra][e]
                            got[row, 16 * step + 2 * t + 8 + e] = regs[rb][e]
    assert not np.isnan(got).any()
    assert np.array_equal(got, want)


def test_oracle_bound_covers_f32_sums():
    rng = np.random.default_rng(3)
    w = random_blocks(rng, "q4_k", 32, 2048, special=False)
    w16 = dequant_q4_k_f16(w)
    x16 = rng.standard_normal((8, 2048)).astype(np.float16)
    ref = wgmma_reference(w16, x16)
    f32 = (x16.astype(np.float32) @ w16.astype(np.float32).T).astype(np.float64)
    assert np.all(np.abs(f32 - ref) <= wgmma_error_bound(2048, wgmma_abs(w16, x16)))
