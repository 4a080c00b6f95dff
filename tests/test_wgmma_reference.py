"""CPU: the oracle of the Hopper f16 GEMMs (engine.reference.wgmma) and lane-by-lane numpy
replays of wgmma_q4_k.cu's and wgmma_q6_k.cu's fragment construction (bit tricks, f16x2 ops,
which register of which k16 step each word feeds; for q6_K also the loads of both block layouts
and the stage ring), so the kernels' k order is checked without a GPU."""
from __future__ import annotations

import math

import numpy as np
import pytest

from engine.formats import quants as Q
from engine.reference.mmq import random_blocks
from engine.reference.wgmma import (
    dequant_q4_k_f16, dequant_q6_k_f16, k_permutation, permute_x16, tile_x16, wgmma_abs, wgmma_error_bound,
    wgmma_reference,
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


# ----------------------------------------------------------------------------- q6_K

def test_dequant_q6_k_f16_is_the_f32_dequant_rounded_closely():
    """|w16 - w32| <= 2.001 2^-11 |d sc (q - 32)| + 2^-19: the f16 rounding of s = d sc (2^-11
    relative, or 2^-25 absolute where s is subnormal, times |q - 32| <= 32) and of the product
    (2^-11 relative, 2^-25 absolute), plus dequantize_q6_k's own f32 rounding of (d sc) q
    (2^-24). Raw and padded blocks give the same bits."""
    rng = np.random.default_rng(7)
    w = random_blocks(rng, "q6_k", 64, 1024, special=True)
    w16 = dequant_q6_k_f16(w)
    w16p = dequant_q6_k_f16(Q.repack_q6_k_padded(w), padded=True)
    assert np.array_equal(w16.view(np.uint16), w16p.view(np.uint16))
    w32 = Q.dequantize_q6_k(w).astype(np.float64)
    d, sc, q = Q.q6_k_fields(w)
    mag = np.abs((d[:, None] * sc.astype(np.float32)).astype(np.float64)[:, :, None]
                 * q.reshape(-1, 16, 16)).reshape(w16.shape)
    err = np.abs(w16.astype(np.float64) - w32)
    assert np.all(err <= 2.001 * 2.0 ** -11 * mag + 2.0 ** -19)
    assert (d == 0).any() and (np.abs(d) < 2.0 ** -14).any()          # zero and subnormal d covered


def _u32(x):
    return int(x) & 0xFFFFFFFF


def _byte_perm(x, y, s):
    """__byte_perm(x, y, s): result byte i = byte (s >> 4i) & 7 of the 8-byte (y:x)."""
    src = _u32(x) | (_u32(y) << 32)
    return sum(((src >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _h2(u, op):
    """Apply op (float64 -> float64, exact for these operands) to both f16 halves of u and round
    each result once to f16 (HADD2 / HFMA2 / HMUL2, round to nearest even)."""
    out = 0
    for i in (0, 1):
        h = np.array([(u >> (16 * i)) & 0xFFFF], dtype=np.uint16).view(np.float16)[0]
        r = np.float16(op(np.float64(h)))
        out |= int(np.array([r], dtype=np.float16).view(np.uint16)[0]) << (16 * i)
    return out


def _q6_replay(rowb: np.ndarray, padded: bool, g: int, t: int, nsb: int, pf: int):
    """wgmma_q6_k.cu for lane (g, t) of warp 0 in numpy: the loads of WgQ6K (byte addresses
    checked for the load width), the scale words, wgmma_gemm's ring of pf stage slots, the bit
    tricks on uint32 and the f16x2 ops; yields (row, super-block, k16 step, column, f16 bits)."""
    BB = 224 if padded else 210

    def ld(row, off, nbytes):                          # little-endian load, alignment as the kernel's
        addr = row * rowb.shape[1] + off                # rows start at the (256-aligned) allocation
        assert addr % nbytes == 0, (addr, nbytes)
        return int.from_bytes(rowb[row, off:off + nbytes].tobytes(), "little")

    rows = (g, g + 8)

    def load_sb(sb):                                   # WgQ6K::load
        out = []
        for row in rows:
            b = sb * BB
            if padded:
                scw = ld(row, b + 192 + 4 * t, 4)
            else:
                scw = _byte_perm(ld(row, b + 192 + 4 * t, 2), ld(row, b + 194 + 4 * t, 2), 0x5410)
            out.append((scw, ld(row, b + 208, 2)))
        return out

    def scales(sbv):                                   # WgQ6K::scales: f16x2 (s, s) per row, sub-block 4t + i
        v = []
        for scw, dbits in sbv:
            d = np.float32(np.array([dbits], dtype=np.uint16).view(np.float16)[0])
            row = []
            for i in range(4):
                q = np.int8(np.uint8((scw >> (8 * i)) & 0xFF))
                hs = int(np.array([np.float16(d * np.float32(q))], dtype=np.float16).view(np.uint16)[0])
                row.append(hs * 0x10001)
            v.append(row)
        return v

    def load_stage(j):                                 # WgQ6K::load_stage -> per row 3 pieces of 2 words
        off = 64 * (t >> 1) + 8 * (j & 3)
        st = []
        for row in rows:
            b = (j >> 2) * BB
            pieces = []
            for src in (b + off, b + off + 32, b + 128 + 32 * (t >> 1) + 8 * (j & 3)):
                if padded:
                    v = ld(row, src, 8)
                    pieces.append((v & 0xFFFFFFFF, v >> 32))
                else:
                    h = [ld(row, src + 2 * i, 2) for i in range(4)]
                    pieces.append((_byte_perm(h[0], h[1], 0x5410), _byte_perm(h[2], h[3], 0x5410)))
            st.append(pieces)
        return st

    sl = 4 * (t & 1)
    sx, su = 4 - sl, (sl - 2) & 31
    nst = 4 * nsb
    slots = [load_stage(p) for p in range(pf)]
    for sb in range(nsb):
        sc = scales(load_sb(sb))
        for jj in range(4):
            j = 4 * sb + jj
            st = slots[jj % pf]
            for q in (0, 1):
                for r in (0, 1):
                    L, U, H = (st[r][k][q] for k in range(3))
                    x = _u32(H << sx)
                    v = ((L >> sl) & 0x0F0F0F0F) | (x & 0x30303030)
                    rot = _u32((U >> su) | (U << (32 - su)))
                    v4 = (rot & 0x3C3C3C3C) | (x & 0xC0C0C0C0)
                    s_lo, s_hi = sc[r][jj >> 1], sc[r][2 + (jj >> 1)]
                    regs = {}
                    for reg, src, sel in ((0, v, 0x4240), (2, v, 0x4341)):
                        p = _h2(_byte_perm(src, 0x64, sel), lambda a: a - 1056.0)
                        regs[(2 * q, reg)] = _h2mul(p, s_lo)
                    for reg, src, sel in ((0, v4, 0x4240), (2, v4, 0x4341)):
                        p = _h2(_byte_perm(src, 0x64, sel), lambda a: a * 0.25 - 288.0)
                        regs[(2 * q + 1, reg)] = _h2mul(p, s_hi)
                    for (s_loc, reg), u in regs.items():
                        for e in (0, 1):   # register reg + r: row g + 8 r, cols 2t + 8 (reg >> 1) + e
                            yield rows[r], sb, 4 * jj + s_loc, 2 * t + 8 * (reg >> 1) + e, (u >> (16 * e)) & 0xFFFF
            if j + pf < nst:
                slots[jj % pf] = load_stage(j + pf)


def _h2mul(a, b):
    """HMUL2 of two f16x2 words: per half f16(a b) (exact in float64, one rounding)."""
    out = 0
    for i in (0, 1):
        x = np.array([(a >> (16 * i)) & 0xFFFF], dtype=np.uint16).view(np.float16)[0]
        y = np.array([(b >> (16 * i)) & 0xFFFF], dtype=np.uint16).view(np.float16)[0]
        r = np.float16(np.float64(x) * np.float64(y))
        out |= int(np.array([r], dtype=np.float16).view(np.uint16)[0]) << (16 * i)
    return out


def test_q6_k_kernel_fragments_replayed_match_the_oracle():
    """Replay, for every lane (g, t) of one warp, wgmma_q6_k.cu's loads (both layouts), stage
    ring (PF = 1, 2, 4, across super-block boundaries), six-bit assembly and f16x2 ops, and place
    each register half at its wgmma A position (row, k16 step, column): the result must be
    dequant_q6_k_f16 in the permuted order, bit for bit (signed zeros included)."""
    rng = np.random.default_rng(13)
    nsb = 3
    w = random_blocks(rng, "q6_k", 16, 256 * nsb, special=True)
    w[0, 192:208] = np.array([-128, 127, 0, -1, 1, 64, -64, 5, 9, -9, 100, -100, 3, -3, 7, -7],
                             np.int8).view(np.uint8)     # extreme scales
    w[1, :192] = 0xFF                                  # q = 63 everywhere; w[2]: q = 0 (-32)
    w[2, :192] = 0x00
    P = np.concatenate([256 * b + k_permutation() for b in range(nsb)])
    want = dequant_q6_k_f16(w)[:, P].view(np.uint16)
    for padded, pf in ((True, 4), (True, 2), (False, 2), (False, 1), (True, 1)):
        rowb = Q.repack_q6_k_padded(w) if padded else w
        got = np.full((16, 256 * nsb), -1, dtype=np.int64)
        for g in range(8):
            for t in range(4):
                for row, sb, step, col, bits in _q6_replay(rowb, padded, g, t, nsb, pf):
                    assert got[row, 256 * sb + 16 * step + col] == -1
                    got[row, 256 * sb + 16 * step + col] = bits
        assert (got >= 0).all(), (padded, pf)
        assert np.array_equal(got.astype(np.uint16), want), (padded, pf)


def test_wgmma_config_choices():
    """registry.wgmma_config reproduces the Session 13, 15 and 24 hopper_bench winners (T = 32 /
    64 / 128; the q4_K + q6_K pairs by their rows together): K split to about 1.5 blocks per SM at
    T <= 64 (8 parts, two per SM, for a long K), wide matrices unsplit in one 128-token tile at
    T = 65..128, and every choice is a compiled production instance."""
    from engine.gpu import registry

    cases = {(32, 4096, 4096): (32, 4), (32, 22016, 4096): (32, 1), (32, 11008, 4096): (32, 2),
             (64, 4096, 4096): (64, 4), (64, 12288, 4096): (64, 2), (128, 4096, 11008): (64, 2),
             (128, 22016, 4096): (128, 1), (3314, 4096, 4096): (256, 1), (512, 4096, 4096): (128, 1),
             (32, 2048, 1536): (32, 4), (32, 8192 + 4096, 4096): (32, 2), (32, 5120 + 1024, 4096): (32, 4),
             (32, 4096 + 512, 3584): (32, 4), (128, 5120 + 1024, 4096): (64, 2), (128, 12288, 4096): (128, 1),
             # a long K in 8 parts where they fit two blocks per SM (Session 24)
             (32, 4096, 14336): (32, 8), (64, 3584, 18944): (64, 8), (32, 4096, 11008): (32, 4),
             (128, 4096, 14336): (64, 2), (32, 22016, 14336): (32, 1)}
    for (T, N, K), want in cases.items():
        assert registry.wgmma_config(T, N, K) == want, (T, N, K)
    for T in range(registry.WGMMA_MIN_TOKENS, 300):
        for N, K in ((4096, 4096), (4096, 11008), (11008, 4096), (32000, 4096), (1536, 8960), (256, 512),
                     (4096, 14336), (3584, 18944)):
            bt, kp = registry.wgmma_config(T, N, K)
            assert (bt, kp) in registry.WGMMA_LAUNCHED and kp <= K // 256


def _build_on_cpu(tmp_path, name: str, source: str):
    """`source` (kernel code and a harness) compiled by g++ against the CPU emulator's header
    (tests/cuda_emu/cuda_emu.h), loaded with ctypes; skips without g++."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    emu_h = (Path(__file__).parent / "cuda_emu" / "cuda_emu.h").read_text()
    src, so = tmp_path / f"{name}.cpp", tmp_path / f"{name}.so"
    src.write_text(emu_h + "\n" + source)
    r = subprocess.run(["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-Wno-unknown-pragmas",
                        "-o", str(so), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return ctypes.CDLL(str(so))


# Lane (g, t) of warp v: rows 16 v + g and 16 v + g + 8; out[v][lane][sb][jj][step][reg], the
# pipeline's calls in order (wgmma_common.cuh wgmma_gemm: load, scales, then per stage j = 4 sb + jj
# load_stage and frags).
_POLICY_HARNESS = r'''
template <class WT>
void policy_frags(const u8* W, int nrows, int nsb, u32* out) {
    const size_t row_bytes = (size_t)nsb * WT::BLOCK_BYTES;
    for (int v = 0; v < nrows / 16; ++v)
        for (int lane = 0; lane < 32; ++lane) {
            const int g = lane >> 2, t = lane & 3;
            const u8* r0 = W + (size_t)(16 * v + g) * row_bytes;
            const u8* r1 = r0 + 8 * row_bytes;
            for (int sb = 0; sb < nsb; ++sb) {
                typename WT::Sb s;
                typename WT::Sc sc;
                WT::load(s, r0, r1, sb, t);
                WT::scales(sc, s, t);
                for (int jj = 0; jj < 4; ++jj) {
                    typename WT::St st;
                    if constexpr (WT::PF > 0) WT::load_stage(st, r0, r1, 4 * sb + jj, t);
                    u32 a[4][4];
                    WT::frags(a, s, st, jj, sc, t);
                    u32* o = out + ((((size_t)v * 32 + lane) * nsb + sb) * 4 + jj) * 16;
                    for (int i = 0; i < 16; ++i) o[i] = a[i / 4][i % 4];
                }
            }
        }
}
extern "C" void run_policy(const u8* W, int nrows, int nsb, u32* out) { policy_frags<POLICY>(W, nrows, nsb, out); }
'''


@pytest.mark.parametrize("kind,layout", [("q4_k", "raw"), ("q6_k", "padded"), ("q6_k", "raw")])
def test_weight_policy_on_cpu_matches_dequant(tmp_path, kind, layout):
    """The weight policies of kernels_cu/wgmma_q4_k.cu and wgmma_q6_k.cu (headers, scales, the
    unpack to f16 A fragments; q6_K in both block layouts) compiled for the CPU
    (tests/cuda_emu/cuda_emu.h; f16x2.cuh's GGP_EMU ops round once from exact values, as the PTX
    does) give engine.reference.wgmma's dequantization bit for bit, in the A-fragment order of
    wgmma_common.cuh, on random blocks with extreme scales (the scales made in f16x2)."""
    import ctypes

    from engine.gpu import kernels

    fname, policy = {("q4_k", "raw"): ("wgmma_q4_k.cu", "WgQ4K"), ("q6_k", "padded"): ("wgmma_q6_k.cu", "WgQ6K<true, 4>"),
                     ("q6_k", "raw"): ("wgmma_q6_k.cu", "WgQ6K<false, 4>")}[kind, layout]
    lib = _build_on_cpu(tmp_path, "policy", kernels.source(fname) + f"\n#define POLICY {policy}\n" + _POLICY_HARNESS)

    rng = np.random.default_rng(5)
    N, K = 32, 1024
    nsb = K // 256
    w = random_blocks(rng, kind, N, K, special=True)
    w16 = (dequant_q4_k_f16(w) if kind == "q4_k" else dequant_q6_k_f16(w)).view(np.uint16)
    wdev = np.ascontiguousarray(Q.repack_q6_k_padded(w) if layout == "padded" else w)
    out = np.zeros((N // 16, 32, nsb, 4, 4, 4), dtype=np.uint32)
    lib.run_policy(ctypes.c_void_p(wdev.ctypes.data), ctypes.c_int(N), ctypes.c_int(nsb), ctypes.c_void_p(out.ctypes.data))
    P = np.asarray(k_permutation())
    want = np.zeros_like(out)
    for v in range(N // 16):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for sb in range(nsb):
                for jj in range(4):
                    for s in range(4):
                        for reg in range(4):
                            row = 16 * v + g + 8 * (reg & 1)
                            L = 16 * (4 * jj + s) + 2 * t + 8 * (reg >> 1)
                            lo, hi = w16[row, 256 * sb + P[L]], w16[row, 256 * sb + P[L + 1]]
                            want[v, lane, sb, jj, s, reg] = int(lo) | int(hi) << 16
    bad = np.argwhere(out != want)
    assert bad.size == 0, f"{len(bad)} of {out.size} fragment words differ, first at {bad[0].tolist()}"


# Every thread of every row tile of a [q; k; v] GEMM output y [T, N] as the ROPE epilogue runs it
# (wgmma_common.cuh: wg_rope_rows, then wg_rope_store of each token's pair), from global row
# row_base on.
_ROPE_HARNESS = r'''
extern "C" void run_rope(const float* y, int T, int N, int row_base, const float* bq, const float* bk,
                         const float* bv, const float* cosT, const float* sinT, u16* qout, u16* kc, u16* vc,
                         int qdim, int kvdim, int hd, const int* startp, int start0, const int* posv,
                         const int* rowv, int maxT, int neox, float qscale, int* hits) {
    const WgRope r = {bq, bk, bv, cosT, sinT, qout, kc, vc, startp, posv, rowv, start0, maxT, qdim, kvdim, hd,
                      neox, qscale, row_base};
    for (int tile = 0; tile < N / 128; ++tile)
        for (int warp = 0; warp < 8; ++warp)
            for (int g = 0; g < 8; ++g) {
                int lr0, step;
                wg_rope_rows(r, warp, g, lr0, step);
                const int row = tile * 128 + lr0;
                hits[row] += 1;
                hits[row + step] += 1;
                for (int tok = 0; tok < T; ++tok)
                    wg_rope_store(r, row, step, tok, T, y[(size_t)tok * N + row], y[(size_t)tok * N + row + step]);
            }
}
'''


@pytest.mark.parametrize("hd,neox,bias,split,varlen", [(128, False, False, False, False), (128, True, True, True, False),
                                                         (64, True, True, False, True), (64, False, True, True, True)])
def test_rope_epilogue_on_cpu_matches_qkv_rope(tmp_path, hd, neox, bias, split, varlen):
    """The q|k|v GEMM's RoPE epilogue (wgmma_common.cuh wg_rope_rows / wg_rope_store, an A/B form)
    compiled for the CPU: every output row taken once, in pairs, and qout / the K and V cache rows
    equal engine.reference.numerics.qkv_rope_f16 (the emulator's qkv_rope, rope.cu's numerics) bit
    for bit; `split`: the matrix in two launches as wgmma_pair runs it ([Wq; Wk], then Wv from
    global row q_dim + kv_dim on); positions from start0 + *startp, or (`varlen`) per token from
    posv with cache rows rowv."""
    import ctypes

    from engine.formats.config import ModelConfig
    from engine.formats.rope import rope_tables
    from engine.gpu import kernels
    from engine.reference import numerics

    lib = _build_on_cpu(tmp_path, "rope", kernels.source("wgmma_rope.cuh") + _ROPE_HARNESS)

    rng = np.random.default_rng(7)
    H, KVH, T, maxT, start0, startp = 256 // hd, 128 // hd, 5, 40, 3, 9
    qd, kvd = H * hd, KVH * hd
    N = qd + 2 * kvd
    mc = ModelConfig("llama", 1, qd, H, KVH, hd, 256, 10, 64, 1e6 if neox else 1e4, "neox" if neox else "normal",
                     1e-5, bias, False)
    cos, sin = (np.ascontiguousarray(a, dtype=np.float32) for a in rope_tables(mc, np.arange(maxT)))
    y = (rng.standard_normal((T, N)) * 3).astype(np.float32)
    b = [(rng.standard_normal(c) * 5).astype(np.float32) if bias else None for c in (qd, kvd, kvd)]
    qout = np.full((H, T, hd), 0x7E00, np.uint16)
    kc = np.full((KVH, maxT, hd), 0x7E00, np.uint16)
    vc = np.full((KVH, maxT, hd), 0x7E00, np.uint16)
    hits = np.zeros(N, np.int32)
    sp = np.array([startp], np.int32)
    P = ctypes.c_void_p

    def ptr(a):
        return P(None) if a is None else P(a.ctypes.data)

    qscale = np.float32(math.log2(math.e) / math.sqrt(hd))
    if varlen:
        pos = rng.integers(0, maxT, T).astype(np.int32)
        rows = rng.permutation(maxT)[:T].astype(np.int32)
    else:
        pos = rows = np.arange(start0 + startp, start0 + startp + T)
    parts = [(0, N)] if not split else [(0, qd + kvd), (qd + kvd, N)]
    for r0, r1 in parts:
        ys = np.ascontiguousarray(y[:, r0:r1])
        lib.run_rope(ptr(ys), T, r1 - r0, r0, ptr(b[0]), ptr(b[1]), ptr(b[2]), ptr(cos), ptr(sin), ptr(qout), ptr(kc),
                     ptr(vc), qd, kvd, hd, ptr(sp), start0, ptr(pos if varlen else None),
                     ptr(rows if varlen else None), maxT, int(neox), ctypes.c_float(qscale), ptr(hits[r0:r1]))
    assert np.all(hits == 1)
    wq, wk, wv = numerics.qkv_rope_f16(y[:, :qd], y[:, qd:qd + kvd], y[:, qd + kvd:], *b, cos[pos], sin[pos],
                                       H, KVH, hd, neox)
    assert np.array_equal(qout, wq.view(np.uint16))
    assert np.array_equal(kc[:, rows], wk.view(np.uint16)) and np.array_equal(vc[:, rows], wv.view(np.uint16))
    rest = np.setdiff1d(np.arange(maxT), rows)
    assert np.all(kc[:, rest] == 0x7E00) and np.all(vc[:, rest] == 0x7E00)
