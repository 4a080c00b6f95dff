"""engine.formats.quants: bit-exact dequantization vs gguf-py, layouts, quantizer error bounds,
q8_1 definition (rounding, s = d * sum(q)) and the integer-dot reference GEMMs."""

import os
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ
from gguf.quants import dequantize as gguf_dequantize

from engine.formats import quants as Qm
from engine.reference.mmq import mmq_reference_q4_k, mmq_reference_q6_k
from engine.formats.quants import (
    Q4_K_BYTES, Q6_K_BYTES, Q6_K_PADDED_BYTES, QK_K, QK8_1,
    dequantize_q4_k, dequantize_q6_k, dequantize_q8_1, 
    quantize_q4_k, quantize_q6_k, quantize_q8_1, repack_q6_k_padded, unpack_q6_k_padded,
)


def _rand_blocks(rng, n_rows, n_blocks, block_bytes, f16_offsets, lo=-0.05, hi=0.05):
    """Random bytes with the f16 fields replaced by finite values (incl. negative / tiny)."""
    b = rng.integers(0, 256, (n_rows * n_blocks, block_bytes), dtype=np.uint8)
    for off in f16_offsets:
        v = rng.uniform(lo, hi, b.shape[0]).astype("<f2")
        v[::17] = np.float16(6e-8)        # subnormal f16
        v[::23] = np.float16(0.0)
        b[:, off:off + 2] = v.view(np.uint8).reshape(-1, 2)
    return b.reshape(n_rows, n_blocks * block_bytes)


def _bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(
        a.view(np.uint32), b.view(np.uint32))


def test_constants():
    assert (QK_K, Q4_K_BYTES, Q6_K_BYTES, Q6_K_PADDED_BYTES, QK8_1) == (256, 144, 210, 224, 32)


def test_dequant_q4_k_bit_exact():
    rng = np.random.default_rng(1)
    b = _rand_blocks(rng, 37, 5, Q4_K_BYTES, [0, 2])
    ours = dequantize_q4_k(b)
    assert ours.shape == (37, 5 * 256)
    assert _bits_equal(ours, gguf_dequantize(b, GQ.Q4_K))
    # leading dims are preserved, 1-D works
    assert _bits_equal(dequantize_q4_k(b.reshape(37, 5, -1))[2, 3], ours[2, 256 * 3:256 * 4])
    assert _bits_equal(dequantize_q4_k(b[0]), ours[0])


@pytest.mark.parametrize("padded", [False, True])
def test_dequant_q6_k_bit_exact(padded):
    rng = np.random.default_rng(2)
    b = _rand_blocks(rng, 29, 6, Q6_K_BYTES, [208])
    ref = gguf_dequantize(b, GQ.Q6_K)
    src = repack_q6_k_padded(b) if padded else b
    assert _bits_equal(dequantize_q6_k(src, padded=padded), ref)


def test_q6_k_byte_map():
    """The seeds' byte map: element e = 128h + n -> ql[64h + n%64] nibble n//64,
    qh[32h + n%32] bits 2*(n//32); sc[e//16] int8; d f16 at 208."""
    b = np.zeros(Q6_K_BYTES, dtype=np.uint8)
    b[208:210] = np.array([1.0], dtype="<f2").view(np.uint8)
    b[192:208] = 1
    h, n = 1, 100                       # element 228
    b[64 * h + n % 64] |= 0x5 << (4 * (n // 64))
    b[128 + 32 * h + n % 32] |= 0x2 << (2 * (n // 32))
    y = dequantize_q6_k(b)
    assert y[128 * h + n] == (0x5 | 0x2 << 4) - 32
    assert np.all(np.delete(y, 128 * h + n) == -32)


def test_repack_round_trip_and_padding():
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (7, 4 * Q6_K_BYTES), dtype=np.uint8)
    p = repack_q6_k_padded(raw)
    assert p.shape == (7, 4 * Q6_K_PADDED_BYTES) and p.dtype == np.uint8
    pb = p.reshape(7, 4, Q6_K_PADDED_BYTES)
    assert np.all(pb[..., Q6_K_BYTES:] == 0)
    assert np.array_equal(pb[..., :Q6_K_BYTES], raw.reshape(7, 4, Q6_K_BYTES))
    assert np.array_equal(unpack_q6_k_padded(p), raw)
    with pytest.raises(ValueError):
        repack_q6_k_padded(raw[:, :-1])


def _rel_rms(x, y):
    return float(np.sqrt(np.mean((x.astype(np.float64) - y) ** 2) / np.mean(x.astype(np.float64) ** 2)))


def test_quantize_q4_k_error_bound():
    """Relative RMS error ||x - deq(quant(x))|| / ||x|| on N(0,1) data. 4-bit affine codes
    over a 32-sample range (~4.5 sigma) cannot do better than ~7%: measured 0.0745."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 8 * 256)).astype(np.float32)
    blk = quantize_q4_k(x)
    assert blk.shape == (64, 8 * Q4_K_BYTES) and blk.dtype == np.uint8
    err = _rel_rms(x, dequantize_q4_k(blk))
    assert err < 0.08, err
    # scaled / offset data and an all-zero block stay finite and sane
    x2 = (x * 0.02 + 0.01).astype(np.float32)
    assert _rel_rms(x2, dequantize_q4_k(quantize_q4_k(x2))) < 0.08
    z = np.zeros((2, 256), np.float32)
    assert np.array_equal(dequantize_q4_k(quantize_q4_k(z)), z)


def test_quantize_q6_k_error_bound():
    """Same measure for q6_K (6-bit symmetric codes per 16 values): measured 0.0188."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 8 * 256)).astype(np.float32)
    blk = quantize_q6_k(x)
    assert blk.shape == (64, 8 * Q6_K_BYTES) and blk.dtype == np.uint8
    err = _rel_rms(x, dequantize_q6_k(blk))
    assert err < 0.02, err
    # our blocks decode identically through gguf-py
    assert _bits_equal(dequantize_q6_k(blk), gguf_dequantize(blk, GQ.Q6_K))
    assert _bits_equal(dequantize_q4_k(quantize_q4_k(x)), gguf_dequantize(quantize_q4_k(x), GQ.Q4_K))
    z = np.zeros((2, 256), np.float32)
    assert np.array_equal(dequantize_q6_k(quantize_q6_k(z)), z)


def test_q8_1_rounding_half_away_from_zero():
    # amax = 127 -> d = 1.0 exactly, so q = roundf(x)
    x = np.zeros((1, 32), np.float32)
    x[0, :8] = [127.0, 0.5, -2.5, 1.5, -0.5, 2.4999998, 0.49999997, -126.5]
    q, d, s = quantize_q8_1(x)
    assert d[0, 0] == np.float32(1.0)
    assert list(q[0, :8]) == [127, 1, -3, 2, -1, 2, 0, -127]
    # with a non-trivial d the division is float32: q = roundf(float32(x / d))
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    q, d, s = quantize_q8_1(x)
    xb = x.reshape(4, 8, 32)
    d_exp = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    assert np.array_equal(d, d_exp) and d.dtype == np.float32
    v = (xb / d_exp[..., None]).astype(np.float32).astype(np.float64)
    q_exp = np.sign(v) * np.floor(np.abs(v) + 0.5)
    assert np.array_equal(q.reshape(4, 8, 32), q_exp.astype(np.int8))
    assert np.abs(q).max() == 127


def test_q8_1_zero_block():
    x = np.zeros((2, 64), np.float32)
    x[1, 32:] = 3.0
    q, d, s = quantize_q8_1(x)
    assert q.dtype == np.int8 and d.dtype == np.float32 and s.dtype == np.float32
    assert np.all(q[:, :32] == 0) and np.all(q[0] == 0) and d[0, 0] == 0 and s[0, 0] == 0
    assert np.all(q[1, 32:] == 127) and s[1, 1] == 96.0


def test_q8_1_sum_is_d_times_integer_sum():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 128)) * np.float32(1e4)).astype(np.float32)
    x[0, :32] = 1.0
    x[0, 0], x[0, 16] = 1e8, -1e8
    q, d, s = quantize_q8_1(x)
    for t in range(3):
        for g in range(4):
            qi = [int(v) for v in q[t, 32 * g:32 * g + 32]]
            # one float32 product of d and the exact integer sum
            assert s[t, g] == np.float32(np.float64(d[t, g]) * sum(qi))
    # s is the sum of the dequantized block (what the MMQ min term needs), not of the inputs:
    # here the inputs sum to 30, the quantized block (every 1.0 rounds to q = 0) to 0
    assert s[0, 0] == 0.0 and float(np.sum(x[0, :32], dtype=np.float64)) == 30.0
    # and the dequantized sum matches float64 to one rounding on a normal block
    deq = (q[1].reshape(4, 32).astype(np.float64) * d[1][:, None]).sum(-1)
    assert np.allclose(s[1], deq, rtol=2 ** -23, atol=0)


def _rand_q4_rows(rng, N, K):
    w = quantize_q4_k(rng.standard_normal((N, K)).astype(np.float32) * 0.05)
    return w


@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "q6_k_padded"])
def test_mmq_reference_matches_dequant_matmul(kind):
    rng = np.random.default_rng(8)
    T, N, K = 19, 23, 3 * 256
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[3, :32] = 0.0                                       # a zero q8_1 block
    q, d, s = quantize_q8_1(x)
    xq = dequantize_q8_1(q, d).astype(np.float64)
    if kind == "q4_k":
        w = _rand_blocks(rng, N, 3, Q4_K_BYTES, [0, 2], 0, 0.05)
        wf = dequantize_q4_k(w).astype(np.float64)
        # with s8 := d8 * sum(q8) the two formulations are the same sum
        s_q = (q.reshape(T, -1, 32).astype(np.float64).sum(-1) * d).astype(np.float32)
        y = mmq_reference_q4_k(w, q, d, s_q)
    else:
        w = _rand_blocks(rng, N, 3, Q6_K_BYTES, [208])
        wf = dequantize_q6_k(w).astype(np.float64)
        if kind == "q6_k_padded":
            y = mmq_reference_q6_k(repack_q6_k_padded(w), q, d, s, padded=True)
        else:
            y = mmq_reference_q6_k(w, q, d, s)
    assert y.shape == (T, N) and y.dtype == np.float64
    ref = xq @ wf.T
    scale = np.abs(xq) @ np.abs(wf).T
    assert np.all(np.abs(y - ref) <= 1e-6 * scale + 1e-30)
    # against the float (unquantized-activation) product: q8_1 error only
    yx = x.astype(np.float64) @ wf.T
    assert np.abs(y - yx).max() <= 0.02 * np.abs(yx).max()


def test_mmq_reference_q4_k_uses_s8():
    """The min term uses s8 (sum of the original activations), not d8 * sum(q8)."""
    rng = np.random.default_rng(9)
    T, N, K = 4, 5, 256
    w = _rand_blocks(rng, N, 1, Q4_K_BYTES, [0, 2], 0.001, 0.05)
    x = rng.standard_normal((T, K)).astype(np.float32)
    q, d, s = quantize_q8_1(x)
    y0 = mmq_reference_q4_k(w, q, d, s)
    y1 = mmq_reference_q4_k(w, q, d, s + np.float32(1.0))
    _, dmin, _, m, _ = Qm.q4_k_fields(w.reshape(-1, Q4_K_BYTES))
    expect = -(dmin.astype(np.float64)[:, None] * m).sum(-1)
    np.testing.assert_allclose(y1 - y0, np.broadcast_to(expect, (T, N)), rtol=1e-6, atol=1e-9)


def test_mmq_reference_speed():
    """The oracle must be usable at kernel-test sizes (T=3314, N=512, K=4096: ~3 s here)."""
    rng = np.random.default_rng(10)
    T, N, K = 3314, 512, 4096
    q, d, s = quantize_q8_1(rng.standard_normal((T, K)).astype(np.float32))
    w = _rand_blocks(rng, N, K // 256, Q4_K_BYTES, [0, 2], 0, 0.05)
    t0 = time.perf_counter()
    y = mmq_reference_q4_k(w, q, d, s)
    assert y.shape == (T, N) and np.isfinite(y).all()
    assert time.perf_counter() - t0 < 30


# ----------------------------------------------------------------------------- real model

def _model_path() -> Path:
    home = Path(os.environ.get("GGUF_PREFILL_HOME", Path.home() / ".cache" / "gguf-prefill"))
    return home / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


@pytest.mark.model
def test_default_model_dequant_bit_exact_and_repack():
    path = _model_path()
    if not path.exists():
        if os.environ.get("GGUF_PREFILL_REQUIRE_MODEL") == "1":
            pytest.fail(f"default model missing: {path}")
        pytest.skip(f"default model not present: {path}")
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    seen = {GQ.Q4_K: 0, GQ.Q6_K: 0}
    chunk_bytes = 8 << 20
    for t in reader.tensors:
        if t.tensor_type not in seen:
            continue
        seen[t.tensor_type] += 1
        data = t.data                                      # memmap [rows, row_bytes]
        rows = max(1, chunk_bytes // data.shape[1])
        for r0 in range(0, data.shape[0], rows):
            blk = np.asarray(data[r0:r0 + rows])
            ref = gguf_dequantize(blk, t.tensor_type)
            if t.tensor_type == GQ.Q4_K:
                ours = dequantize_q4_k(blk)
            else:
                ours = dequantize_q6_k(blk)
                padded = repack_q6_k_padded(blk)
                assert np.array_equal(unpack_q6_k_padded(padded), blk), t.name
                ours_p = dequantize_q6_k(padded, padded=True)
                assert np.array_equal(ours_p.view(np.uint32), ours.view(np.uint32)), t.name
            assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), (t.name, r0)
    assert seen[GQ.Q4_K] > 0 and seen[GQ.Q6_K] > 0
