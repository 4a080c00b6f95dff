"""GPU decode mode (engine/gpu/decode.py, engine/gpu/session.py): MMVQ GEMVs, split-K decode
attention, argmax, the small fused kernels, and whole-model decoding through GPUModel's
sessions against the numpy reference.

Checks (each on fresh random inputs, outputs poisoned before the launch):
- MMVQ q4_K and q6_K (raw 210 B and padded 224 B rows), the production instance (1 row per
  warp) in every mode (store / add / swiglu), against
  engine.reference.mmq.mmq_reference_q4_k / _q6_k. Bound per element:
      |y - ref| <= (K/16 + 8) * 2^-24 * S,  S = the sum of the magnitudes of the scaled terms
  (exact integer dots; each q8_1 block's term takes a few float32 roundings and at most K/32
  partial sums are added in float32 per row, so gamma_n with n <= K/16 + 8 bounds it).
- decode attention at 1, 100 and 3,314 keys (GQA groups 1, 2, 6, f16 (and, while compiled,
  f32) caches, several split counts, token-major and head-major layouts) against float64 softmax
  attention over the
  same cached values: |o - ref| <= 1e-5 * max|V| + 1e-6; its q8_1 output identical to
  engine.formats.quants.quantize_q8_1 of its float32 output.
- argmax: numpy.argmax semantics (ties -> lowest id, NaN wins), state and history updates;
  argmax_rows (a batched step's rows, strided): the same per row as numpy.argmax and argmax_step.
- embedding rows bit-identical to the reference's dequantization; rmsnorm + q8_1 within 2 ulp
  of the reference and q8_1 identical to quantize_q8_1 of the kernel's own float32 output;
  bias + RoPE + KV append bit-identical to the reference's RoPE (rounded to the cache type).
- whole decode (synthetic tiny llama and qwen2 models; GPUModel, every token through a
  session's decode steps from an empty cache): logits of every step within a relative L2 error
  of 3e-2 of the reference (q8_1 activations against float32) and the same argmax wherever the
  reference's margin is >= 1.0; graph replay bit-identical to kernel-by-kernel launches.
- sessions: a pooled session is reused across requests (same graph, captured once) with the
  same tokens; greedy generation never copies the logits to the host; a sampler's off-argmax
  choice is fed correctly (logits bit-identical to stepping the same ids by hand); prefill +
  decode steps agree with teacher-forced prefill logits.
- greedy-32 goldens recorded from the numpy reference (tests/goldens/decode_*.json, made with
  `gguf-prefill greedy32 --record ... --device cpu`, see tests/goldens/README.md) replayed on the
  GPU (GPUModel: prompt by the prefill kernels, tokens by the decode graph) with the margin rule
  (MIN_MARGIN = 1.0), free-running and teacher-forced through decode steps, after a short
  prompt and after a 3,314-token prompt, on the tiny synthetic model and on a real-weight slice
  (.gpu_data/slice.gguf; skipped when absent). The threshold: q8_1 activations (as llama.cpp's
  MMQ/MMVQ) move the logits by at most 0.61 (tiny) / 0.45 (slice) against the float32
  reference (measured on the CPU emulator over 12 steps), so a swap of the top two needs a
  reference margin under about 2 x that; 1.0 leaves the typical (not the worst) pair safe.

With GPU_REPORT=<file> each check appends one JSON line (scripts/gpu_check.sh prints them).
Under the CPU emulator (tests/cuda_emu, cupy.__emulated__) shapes shrink and the 3,314-token
cases are skipped.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.formats import quants as Q
from engine.reference import mmq as RM

pytestmark = pytest.mark.gpu

U = 2.0 ** -24
ROOT = Path(__file__).resolve().parent.parent
GOLDENS = ROOT / "tests" / "goldens"
SLICE = ROOT / ".gpu_data" / "slice.gguf"
EMU = bool(getattr(sys.modules.get("cupy"), "__emulated__", False))
MIN_MARGIN = 1.0


def _report(**kw):
    path = os.environ.get("GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(kw) + "\n")


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(8), "little")
    print(f"seed {seed}")
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- inputs

def rand_rows(rng, kind, n_rows, K):
    """Random valid blocks: random bytes, finite f16 scales (some zero / tiny)."""
    bb = Q.Q4_K_BYTES if kind == "q4_k" else Q.Q6_K_BYTES
    offs = (0, 2) if kind == "q4_k" else (208,)
    nb = K // Q.QK_K
    b = rng.integers(0, 256, (n_rows * nb, bb), dtype=np.uint8)
    for off in offs:
        v = rng.uniform(-0.05, 0.05, b.shape[0]).astype("<f2")
        v[::29] = np.float16(6e-8)
        v[::31] = np.float16(0.0)
        b[:, off:off + 2] = v.view(np.uint8).reshape(-1, 2)
    return b.reshape(n_rows, nb * bb)


def abs_terms(kind, w, q, d, s):
    """S of the module docstring for one activation row, float64 [N]."""
    K = q.shape[-1]
    q = q.reshape(1, K)
    N = w.shape[0]
    aq = np.abs(q.astype(np.float32))
    ad = np.abs(np.asarray(d, np.float64)).reshape(1, K // 32)
    if kind == "q4_k":
        dw, dmin, sc, m, q4 = Q.q4_k_fields(w.reshape(-1, Q.Q4_K_BYTES))
        G = K // 32
        A = np.abs(dw.astype(np.float64)[:, None] * sc).reshape(N, G)
        M = np.abs(dmin.astype(np.float64)[:, None] * m).reshape(N, G)
        tot = np.abs(np.asarray(s, np.float64)).reshape(1, G) @ M.T
        wq = q4.reshape(N, G, 32).astype(np.float32)
        dots = np.einsum("gl,ngl->ng", aq.reshape(G, 32), wq)
        tot = tot + (ad.reshape(1, G) * A * dots).sum(-1)[None]
        return tot[0]
    dw, sc, q6 = Q.q6_k_fields(w.reshape(-1, Q.Q6_K_BYTES))
    J = K // 16
    A = np.abs(dw.astype(np.float64)[:, None] * sc).reshape(N, J)
    wq = np.abs(q6.reshape(N, J, 16).astype(np.float32))
    dots = np.einsum("jl,njl->nj", aq.reshape(J, 16), wq)
    return (np.repeat(ad.reshape(-1), 2)[None, :] * A * dots).sum(-1)


def upload_act(cp, q, d, s):
    ds = np.stack([np.asarray(d, np.float32).reshape(-1), np.asarray(s, np.float32).reshape(-1)], -1)
    return cp.asarray(q.reshape(-1)), cp.asarray(ds)


# ----------------------------------------------------------------------------- MMVQ

MMVQ_SHAPES = ([(37, 768), (5, 256), (64, 512), (3, 6144)] if EMU else
               [(1, 256), (7, 1536), (33, 4096), (4099, 4096), (517, 11008), (300, 2048), (4096, 4096)])


def _oracle(kind):
    return RM.mmq_reference_q4_k if kind == "q4_k" else RM.mmq_reference_q6_k


@pytest.mark.parametrize("layout", ["q4_k", "q6_k_pad", "q6_k_raw"])
@pytest.mark.parametrize("mode", ["store", "add", "swiglu"])
def test_mmvq(cp, rng, layout, mode):
    from engine.gpu.ops.mmvq import mmvq_launch
    from engine.gpu.weights import upload_weight

    kind = layout[:4]
    ttype = "Q4_K" if kind == "q4_k" else "Q6_K"
    pad = layout.endswith("pad")
    worst = 0.0
    shapes = MMVQ_SHAPES
    for N, K in shapes:
        w = rand_rows(rng, kind, N, K)
        x = (rng.standard_normal((1, K)) * 10.0 ** rng.uniform(-2, 2)).astype(np.float32)
        x[0, :32] = 0.0                                          # an all-zero q8_1 block
        q, d, s = Q.quantize_q8_1(x)
        ref = _oracle(kind)(w, q, d, s)[0]
        S = abs_terms(kind, w, q, d, s)
        bound = (K / 16 + 8) * U * S
        dw = upload_weight(w, ttype, pad_q6k=pad)
        xq, xds = upload_act(cp, q, d, s)
        if mode == "store":
            y = cp.full(N, np.nan, dtype=cp.float32)
            mmvq_launch([dw], [y], xq, xds, "store")
            got = cp.asnumpy(y)
            err, tol = np.abs(got - ref), bound
        elif mode == "add":
            y0 = rng.standard_normal(N).astype(np.float32)
            y = cp.asarray(y0)
            mmvq_launch([dw], [y], xq, xds, "add")
            got = cp.asnumpy(y)
            err = np.abs(got - (y0.astype(np.float64) + ref))
            tol = bound + 2 * U * np.abs(y0 + ref) + 2 * U * np.abs(y0)
        else:
            w2 = rand_rows(rng, kind, N, K)
            ref2 = _oracle(kind)(w2, q, d, s)[0]
            S2 = abs_terms(kind, w2, q, d, s)
            dw2 = upload_weight(w2, ttype, pad_q6k=pad)
            y = cp.full(N, np.nan, dtype=cp.float32)
            mmvq_launch([dw, dw2], [y], xq, xds, "swiglu")
            got = cp.asnumpy(y)
            e = np.exp(-np.abs(ref))                               # logistic, stable both ways
            sig = np.where(ref >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
            silu, dsilu = ref * sig, sig * (1 + ref * (1 - sig))
            err = np.abs(got - silu * ref2)
            tol = (np.abs(dsilu * ref2) * bound + np.abs(silu) * (K / 16 + 8) * U * S2
                   + 8 * U * np.abs(silu * ref2) + 1e-30)
        bad = ~np.isfinite(got) | (err > tol)
        with np.errstate(divide="ignore", invalid="ignore"):
            worst = max(worst, float(np.nanmax(np.where(tol > 0, err / tol, 0.0))))
        assert not bad.any(), (f"{layout} {mode} N={N} K={K}: {int(bad.sum())} "
                               f"bad, first row {int(np.argmax(bad))}")
    _report(test="decode_mmvq", layout=layout, mode=mode, shapes=len(shapes), worst_err_over_bound=worst)


def test_mmvq_segments(cp, rng):
    """q, k, v in one launch: three matrices, three outputs, ragged row counts."""
    from engine.gpu.ops.mmvq import mmvq_launch
    from engine.gpu.weights import upload_weight

    K = 512
    rows = (37, 9, 70) if EMU else (4096, 1024, 333)
    ws = [rand_rows(rng, "q4_k", n, K) for n in rows]
    x = rng.standard_normal((1, K)).astype(np.float32)
    q, d, s = Q.quantize_q8_1(x)
    xq, xds = upload_act(cp, q, d, s)
    ys = [cp.full(n, np.nan, dtype=cp.float32) for n in rows]
    mmvq_launch([upload_weight(w, "Q4_K") for w in ws], ys, xq, xds, "store")
    for w, y in zip(ws, ys):
        ref = RM.mmq_reference_q4_k(w, q, d, s)[0]
        bound = (K / 16 + 8) * U * abs_terms("q4_k", w, q, d, s)
        got = cp.asnumpy(y)
        assert np.isfinite(got).all() and (np.abs(got - ref) <= bound).all()


@pytest.mark.parametrize("kinds", [("q4_k", "q4_k", "q6_k_pad"), ("q4_k", "q6_k_raw"), ("q4_k", "q6_k_pad", "q6_k_pad")])
def test_mmvq_mixed_equals_per_kind_launches(cp, rng, kinds):
    """mmvq_mixed.cu: q4_K and q6_K matrices (q, k, v of a q4_K_M layer) in one launch give each
    output the bits of mmvq_launch over each kind's run, every row written."""
    from engine.gpu.ops.mmvq import mixes, mmvq_launch, mmvq_mixed_launch
    from engine.gpu.weights import upload_weight

    K = 512
    rows = (37, 9, 70)[:len(kinds)] if EMU else (4096, 1024, 333)[:len(kinds)]
    dws = [upload_weight(rand_rows(rng, k[:4], n, K), "Q4_K" if k == "q4_k" else "Q6_K", pad_q6k=k.endswith("pad"))
           for k, n in zip(kinds, rows)]
    assert mixes(dws) and not mixes(dws[::-1])
    q, d, s = Q.quantize_q8_1(rng.standard_normal((1, K)).astype(np.float32))
    xq, xds = upload_act(cp, q, d, s)
    ys = [cp.full(n, np.nan, dtype=cp.float32) for n in rows]
    mmvq_mixed_launch(dws, ys, xq, xds)
    n4 = kinds.count("q4_k")
    want = [cp.full(n, np.nan, dtype=cp.float32) for n in rows]
    mmvq_launch(dws[:n4], want[:n4], xq, xds, "store")
    mmvq_launch(dws[n4:], want[n4:], xq, xds, "store")
    for y, w in zip(ys, want):
        got = cp.asnumpy(y)
        assert np.isfinite(got).all() and np.array_equal(got.view(np.uint32), cp.asnumpy(w).view(np.uint32))


# ----------------------------------------------------------------------------- attention

def _kv_dtypes():
    try:
        from engine.gpu.registry import KV_DTYPES
    except ImportError:
        return ("f16",)
    return KV_DTYPES


ATT_CONFIGS = [c for c in ([  # (H, KVH, hd, kv dtype, layout); htd is GPUKVCache's layout
    (32, 32, 128, "f16", "thd"),
    (12, 2, 128, "f16", "thd"),
    (32, 32, 128, "f16", "htd"),
    (4, 2, 64, "f32", "thd"),
    (12, 2, 128, "f32", "htd"),
] if not EMU else [(2, 2, 128, "f16", "thd"), (12, 2, 128, "f16", "htd"), (4, 2, 64, "f32", "thd")])
    if c[3] in _kv_dtypes()]
ATT_LENGTHS = [1, 100, 300] if EMU else [1, 100, 3314]


@pytest.mark.parametrize("cfg", ATT_CONFIGS, ids=lambda c: f"H{c[0]}-KV{c[1]}-hd{c[2]}-{c[3]}-{c[4]}")
@pytest.mark.parametrize("L", ATT_LENGTHS)
def test_attention_decode(cp, rng, cfg, L):
    from engine.gpu.ops.attention import attention_launch

    H, KVH, hd, dt, layout = cfg
    T = L + 5                                                    # cache capacity > length
    npdt = np.float16 if dt == "f16" else np.float32
    k = (rng.standard_normal((T, KVH, hd)) * 2).astype(npdt)
    v = rng.standard_normal((T, KVH, hd)).astype(npdt)
    q = rng.standard_normal((H, hd)).astype(np.float32)
    k[L:] = np.nan                                               # never read: past the length
    v[L:] = np.nan
    if layout == "thd":
        kd, vd, ts, hs = cp.asarray(k), cp.asarray(v), KVH * hd, hd
    else:
        kd = cp.asarray(np.ascontiguousarray(k.transpose(1, 0, 2)))
        vd = cp.asarray(np.ascontiguousarray(v.transpose(1, 0, 2)))
        ts, hs = hd, T * hd
    # float64 reference over the same cached values
    G = H // KVH
    kk = k[:L].astype(np.float64)
    vv = v[:L].astype(np.float64)
    ref = np.empty((H, hd))
    scale = float(np.float32(1.0 / np.sqrt(hd)))
    for h in range(H):
        sc = kk[:, h // G] @ q[h].astype(np.float64) * scale
        p = np.exp(sc - sc.max())
        ref[h] = (p / p.sum()) @ vv[:, h // G]
    pos = cp.asarray(np.array([L - 1], dtype=np.int32))
    splits = [1, 3, 64] if L > 1 else [1, 4]
    for S in splits:
        part_o = cp.full((H, S, hd), np.nan, dtype=cp.float32)
        part_ml = cp.full((H, S, 2), np.nan, dtype=cp.float32)
        out = cp.full(H * hd, np.nan, dtype=cp.float32)
        oq = cp.full(H * hd, 127, dtype=cp.int8)
        ods = cp.full((H * hd // 32, 2), np.nan, dtype=cp.float32)
        attention_launch(cp.asarray(q), kd, vd, ts, hs, pos, H, KVH, hd, dt, S, part_o, part_ml, oq, ods,
                         out=out)
        got = cp.asnumpy(out).reshape(H, hd)
        err = np.abs(got - ref)
        tol = 1e-5 * np.abs(vv).max() + 1e-6
        assert np.isfinite(got).all(), f"S={S}: non-finite output"
        assert err.max() <= tol, f"S={S}: max err {err.max():.3g} > {tol:.3g}"
        rq, rd, rs = Q.quantize_q8_1(got.reshape(1, -1))
        gq, gds = cp.asnumpy(oq), cp.asnumpy(ods)
        assert (gq == rq.reshape(-1)).all()
        assert (gds[:, 0].view(np.uint32) == rd.reshape(-1).view(np.uint32)).all()
        assert (gds[:, 1].view(np.uint32) == rs.reshape(-1).view(np.uint32)).all()
        _report(test="decode_attention", H=H, KVH=KVH, hd=hd, kv=dt, layout=layout, L=L, splits=S,
                max_err=float(err.max()), tol=float(tol))


# ----------------------------------------------------------------------------- argmax

@pytest.mark.parametrize("V", [512, 32000] if EMU else [512, 32000, 151936])
def test_argmax(cp, rng, V):
    from engine.gpu import kernels

    k = kernels.get_kernel("argmax.cu", "argmax_step")
    cases = []
    x = rng.standard_normal(V).astype(np.float32)
    cases.append(x.copy())
    y = x.copy()
    top = rng.choice(V, 3, replace=False)
    y[top] = 50.0                                                # a three-way tie
    cases.append(y)
    z = x.copy()
    z[V // 2] = np.nan
    z[V - 1] = np.nan                                            # NaN wins, first NaN
    cases.append(z)
    cases.append(np.full(V, -np.inf, dtype=np.float32))
    state = cp.asarray(np.array([-1, 10, 0, 0], dtype=np.int32))
    hist = cp.full(8, -7, dtype=cp.int32)
    best = cp.full(1, np.nan, dtype=cp.float32)
    for i, c in enumerate(cases):
        k((1,), (1024,), (cp.asarray(c), np.int32(V), state, hist, np.int32(8), best))
        st = cp.asnumpy(state)
        want = int(np.argmax(c))
        assert st[0] == want, (i, st[0], want)
        assert st[1] == 11 + i and st[2] == i + 1
        assert cp.asnumpy(hist)[i] == want


@pytest.mark.parametrize("V", [512, 32000] if EMU else [512, 32000, 151936])
def test_argmax_rows(cp, rng, V):
    """argmax_rows over rows of a strided array (row stride > V): random, a three-way tie, NaNs
    (the first wins), all -inf, a row of equal values; numpy.argmax per row and argmax_step's
    choice (and logit) on the same row."""
    from engine.gpu import kernels
    from engine.gpu.ops.argmax import argmax_rows

    x = rng.standard_normal((6, V + 7)).astype(np.float32)
    x[1, rng.choice(V, 3, replace=False)] = 50.0
    x[2, [V // 2, V - 1, 3 * V // 4]] = np.nan
    x[3, :V] = -np.inf
    x[4, :V] = 0.25
    x[5, 0] = np.nan
    rows = x[:, :V]
    want = np.argmax(rows, axis=1)
    d = cp.asarray(x)
    ids = cp.full(6, -7, dtype=cp.int32)
    best = cp.full(6, 1234.0, dtype=cp.float32)
    argmax_rows(d[:, :V], ids, best)
    gi, gb = cp.asnumpy(ids), cp.asnumpy(best)
    assert gi.tolist() == want.tolist(), (gi, want)
    wb = rows[np.arange(6), want]
    assert (gb.view(np.uint32) == wb.view(np.uint32)).all(), (gb, wb)
    step = kernels.get_kernel("argmax.cu", "argmax_step")
    for r in range(6):
        state = cp.asarray(np.array([-1, 0, 0, 0], dtype=np.int32))
        hist = cp.full(1, -7, dtype=cp.int32)
        b1 = cp.full(1, 1234.0, dtype=cp.float32)
        step((1,), (1024,), (cp.asarray(rows[r]), np.int32(V), state, hist, np.int32(1), b1))
        assert int(cp.asnumpy(state)[0]) == gi[r]
        assert cp.asnumpy(b1)[0].view(np.uint32) == gb[r].view(np.uint32)
    ids2 = cp.full(6, -7, dtype=cp.int32)
    argmax_rows(d[:, :V], ids2)                                  # best optional
    assert cp.asnumpy(ids2).tolist() == want.tolist()
    with pytest.raises(ValueError):
        argmax_rows(d[:, :V], cp.full(5, 0, dtype=cp.int32))


# ----------------------------------------------------------------------------- fused kernels

def _tiny_file(tmp_path_factory, shape):
    from engine.tools.synth import write_synthetic

    p = str(tmp_path_factory.mktemp("models") / f"{shape}.gguf")
    write_synthetic(p, shape)
    return p


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return _tiny_file(tmp_path_factory, "tiny")


@pytest.fixture(scope="module")
def tiny_qwen2_path(tmp_path_factory):
    return _tiny_file(tmp_path_factory, "tiny-qwen2")


@pytest.mark.parametrize("ttype", ["Q4_K", "Q6_K_pad", "Q6_K_raw", "F16", "F32"])
def test_embed_row(cp, rng, ttype):
    """decode_embed over rows of any of its types (GPUModel itself uploads Q4_K / Q6_K)."""
    from engine.gpu import kernels
    from engine.gpu.weights import upload_weight

    class EmbedTable:
        def __init__(self, data, type_name, cols, block_stride=0):
            self.data, self.type_name, self.cols, self.block_stride = data, type_name, cols, block_stride
            self.row_bytes = int(data.shape[1])

    V, K = 50, 768
    x = rng.standard_normal((V, K)).astype(np.float32)
    if ttype == "Q4_K":
        raw = Q.quantize_q4_k(x)
        ref = Q.dequantize_q4_k(raw)
        dw = upload_weight(raw, "Q4_K")
        table = EmbedTable(dw.data, "Q4_K", K, dw.block_stride)
    elif ttype.startswith("Q6_K"):
        raw = Q.quantize_q6_k(x)
        ref = Q.dequantize_q6_k(raw)
        dw = upload_weight(raw, "Q6_K", pad_q6k=ttype.endswith("pad"))
        table = EmbedTable(dw.data, "Q6_K", K, dw.block_stride)
    elif ttype == "F16":
        ref = x.astype(np.float16).astype(np.float32)
        table = EmbedTable(cp.asarray(x.astype(np.float16).view(np.uint8)), "F16", K)
    else:
        ref = x
        table = EmbedTable(cp.asarray(x.view(np.uint8)), "F32", K)
    k = kernels.get_kernel("decode_fused.cu", "decode_embed")
    wt = {"F32": 0, "F16": 1, "Q4_K": 12, "Q6_K": 14}[table.type_name]
    for tok in (0, 17, V - 1):
        state = cp.asarray(np.array([tok, 0, 0, 0], dtype=np.int32))
        out = cp.full(K, np.nan, dtype=cp.float32)
        k((-(-K // 256),), (256,), (table.data, np.int64(table.row_bytes), np.int32(wt),
                                    np.int32(table.block_stride), state, out, np.int32(K)))
        got = cp.asnumpy(out)
        assert (got.view(np.uint32) == ref[tok].view(np.uint32)).all(), ttype


def test_rmsnorm_q8(cp, rng):
    from engine.gpu import kernels
    from engine.reference.ops import rms_norm

    k = kernels.get_kernel("decode_fused.cu", "rmsnorm_q8")
    for K in (256, 1536, 3584, 4096, 8192):
        x = (rng.standard_normal(K) * 3).astype(np.float32)
        w = rng.uniform(0.5, 1.5, K).astype(np.float32)
        eps = np.float32(1e-6)
        outs = []
        for grid in sorted({1, 2, -(-K // 1024)}):   # the decode step's grid: ceil(K / 1024)
            q = cp.full(K, 127, dtype=cp.int8)
            ds = cp.full((K // 32, 2), np.nan, dtype=cp.float32)
            h = cp.full(K, np.nan, dtype=cp.float32)
            k((grid,), (1024,), (cp.asarray(x), cp.asarray(w), eps, np.int32(K), q, ds, h))
            outs.append((cp.asnumpy(q), cp.asnumpy(ds), cp.asnumpy(h)))
        for o in outs[1:]:                            # every grid: the one-block bits
            assert all((a.view(np.uint8) == b.view(np.uint8)).all() for a, b in zip(o, outs[0])), K
        q, ds = outs[0][0], outs[0][1]
        got = outs[0][2]
        ref = rms_norm(x[None], w, float(eps))[0]
        # both sums of squares (positive terms) carry at most depth x U relative error: the
        # kernel's K / 1024 serial adds and two 32-lane trees, numpy's pairwise log2 K; the
        # scale takes half their difference (1 / sqrt), then ~4 roundings (4U alone failed
        # at 4.2U in the CPU emulator: K = 1536, seed 13192075147357824944)
        depth = -(-K // 1024) + 10 + int(np.ceil(np.log2(K)))
        assert np.all(np.abs(got - ref) <= (depth / 2 + 4) * U * np.abs(ref) + 1e-30), K
        rq, rd, rs = Q.quantize_q8_1(got[None])
        assert (q == rq[0]).all()
        assert (ds[:, 0] == rd[0]).all() and (ds[:, 1] == rs[0]).all()


def test_quantize_row_q8(cp, rng):
    from engine.gpu import kernels

    k = kernels.get_kernel("decode_fused.cu", "quantize_row_q8")
    for K in (32, 2048, 11008):
        x = (rng.standard_normal(K) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
        x[:32] = 0.0
        q = cp.full(K, 127, dtype=cp.int8)
        ds = cp.full((K // 32, 2), np.nan, dtype=cp.float32)
        k((-(-K // 256),), (256,), (cp.asarray(x), q, ds, np.int32(K // 32)))
        rq, rd, rs = Q.quantize_q8_1(x[None])
        gds = cp.asnumpy(ds)
        assert (cp.asnumpy(q) == rq[0]).all()
        assert (gds[:, 0].view(np.uint32) == rd[0].view(np.uint32)).all()
        assert (gds[:, 1].view(np.uint32) == rs[0].view(np.uint32)).all()


QKV_POST_CASES = [("f16", "htd")] + ([("f32", "thd")] if "f32" in _kv_dtypes() else [])


@pytest.mark.parametrize("rope", ["normal", "neox"])
@pytest.mark.parametrize("kv,layout", QKV_POST_CASES, ids=lambda v: str(v))
def test_qkv_post(cp, rng, rope, kv, layout):
    """bias + RoPE bit-identical to the reference's apply_rope; K and V rounded to the cache
    type (f16: GPUKVCache's [KVH, T, hd] layout) at position p only."""
    from engine.gpu import kernels
    from engine.formats.config import ModelConfig
    from engine.formats.rope import rope_tables
    from engine.reference.ops import apply_rope

    H, KVH, hd, T = 4, 2, 64, 40
    cfg = ModelConfig("llama", 1, H * hd, H, KVH, hd, 512, 100, 2048, 1e4, rope, 1e-5, True, False)
    qd, kvd = H * hd, KVH * hd
    qkv = rng.standard_normal(qd + 2 * kvd).astype(np.float32)
    bias = rng.standard_normal(qd + 2 * kvd).astype(np.float32)
    cos, sin = rope_tables(cfg, np.arange(T))
    p = 29
    npdt = np.float16 if kv == "f16" else np.float32
    shape, ts, hs = ((KVH, T, hd), hd, T * hd) if layout == "htd" else ((T, KVH, hd), KVH * hd, hd)
    kc = cp.full(shape, np.nan, dtype=npdt)
    vc = cp.full(shape, np.nan, dtype=npdt)
    qrot = cp.full(qd, np.nan, dtype=cp.float32)
    state = cp.asarray(np.array([0, p, 0, 0], dtype=np.int32))
    k = kernels.get_kernel("decode_fused.cu", "qkv_post_" + kv)
    n = (H + KVH) * hd // 2 + kvd
    k((-(-n // 256),), (256,), (cp.asarray(qkv), cp.asarray(bias), cp.asarray(cos), cp.asarray(sin), state,
                                qrot, kc, vc, np.int64(ts), np.int64(hs), np.int32(H), np.int32(KVH),
                                np.int32(hd), np.int32(rope == "neox")))
    x = qkv + bias
    qr = apply_rope(x[:qd].reshape(1, H, hd), cos[p:p + 1], sin[p:p + 1], rope).reshape(-1)
    kr = apply_rope(x[qd:qd + kvd].reshape(1, KVH, hd), cos[p:p + 1], sin[p:p + 1], rope).reshape(KVH, hd)
    vr = x[qd + kvd:].reshape(KVH, hd)
    assert (cp.asnumpy(qrot).view(np.uint32) == qr.view(np.uint32)).all()
    kg, vg = cp.asnumpy(kc), cp.asnumpy(vc)
    if layout == "htd":                                          # -> [T, KVH, hd]
        kg, vg = kg.transpose(1, 0, 2), vg.transpose(1, 0, 2)
    bits = np.uint16 if kv == "f16" else np.uint32
    assert (kg[p].view(bits) == kr.astype(npdt).view(bits)).all()
    assert (vg[p].view(bits) == vr.astype(npdt).view(bits)).all()
    others = np.delete(np.arange(T), p)
    assert np.isnan(kg[others].astype(np.float32)).all() and np.isnan(vg[others].astype(np.float32)).all()


# ----------------------------------------------------------------------------- whole decode

def _gpu_model(path, **kw):
    from engine.gpu.model import GPUModel

    return GPUModel.from_path(path, **kw)


def _step_logits(model, ids, use_graph=True):
    """Every id through decode steps of a fresh (unpooled) session: logits [n, vocab]."""
    from engine.gpu.session import GPUSession

    s = GPUSession(model, len(ids), use_graph=use_graph)
    rows = []
    for t in ids:
        s.step(t)
        rows.append(s.logits())
    assert s.length == len(ids)
    return np.stack(rows)


@pytest.mark.parametrize("which", ["tiny", "tiny-qwen2"])
def test_decode_logits_match_reference(cp, rng, which, tiny_path, tiny_qwen2_path):
    from engine.reference.model import ReferenceModel

    path = tiny_path if which == "tiny" else tiny_qwen2_path
    ref = ReferenceModel.from_path(path)
    n = 6 if EMU else 40
    ids = rng.integers(0, ref.config.vocab_size - 3, n).tolist()
    want = ref.forward(ids, ref.new_cache(n), all_logits=True)
    model = _gpu_model(path)
    got = _step_logits(model, ids, use_graph=True)
    eager = _step_logits(model, ids, use_graph=False)
    assert np.array_equal(got.view(np.uint32), eager.view(np.uint32)), "graph != eager"
    rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    srt = np.sort(want, axis=-1)
    margin = srt[:, -1] - srt[:, -2]
    agree = np.argmax(got, -1) == np.argmax(want, -1)
    _report(test="decode_logits", model=which, kv="f16", steps=n, max_rel_l2=float(rel.max()),
            argmax_agree=int(agree.sum()), confident=int((margin >= MIN_MARGIN).sum()))
    assert np.isfinite(got).all()
    assert rel.max() <= 3e-2, rel
    assert agree[margin >= MIN_MARGIN].all()


def _golden_cases(name):
    from engine.tools import greedy32

    p = GOLDENS / f"decode_{name}.json"
    if not p.exists():
        pytest.skip(f"{p} missing")
    return greedy32.load_goldens(p)


def _eog(path):
    from engine.cli import _eog_ids

    return _eog_ids(path)


def _teacher_forced_decode(model, case, min_margin):
    """Prompt by prefill, then each golden token through a decode step of a pooled session;
    compare the argmax at every step whose golden margin is >= min_margin."""
    compared = matched = 0
    with model.session(len(case["prompt_ids"]) + len(case["tokens"]) + 1) as s:
        s.prefill(case["prompt_ids"])
        for i, (tok, m) in enumerate(zip(case["tokens"], case["margin"])):
            if m >= min_margin:
                compared += 1
                matched += int(np.argmax(s.logits())) == tok
            if i + 1 < len(case["tokens"]):
                s.step(tok)
    return compared, matched


def _goldens_model(which, tiny_path):
    cases = _golden_cases(which)
    if which == "slice":
        if not SLICE.exists():
            pytest.skip(f"{SLICE} missing (python -m engine slice ...; carried to the GPU)")
        path = str(SLICE)
    else:
        path = tiny_path
    if EMU:
        cases = [c for c in cases if len(c["prompt_ids"]) < 200]
    return cases, path


@pytest.mark.parametrize("which", ["tiny", "slice"])
def test_greedy32_goldens_on_gpu(cp, which, tiny_path):
    """GPUModel: the prompt by its prefill kernels, every generated token by a pooled session's
    decode graph (only ids come back); teacher-forced through decode steps; and the
    device-chained loop (DecodeStep.chain) gives the same ids."""
    from engine.tools import greedy32

    cases, path = _goldens_model(which, tiny_path)
    model = _gpu_model(path)
    eog = _eog(path)
    rows = greedy32.run(model, cases, eog, min_margin=MIN_MARGIN)
    print(greedy32.format_rows(rows))
    tf = [_teacher_forced_decode(model, c, MIN_MARGIN) for c in cases]
    for c, r, (comp, mat) in zip(cases, rows, tf):
        _report(test="decode_greedy32_gpu_model", model=which, prompt_len=len(c["prompt_ids"]),
                compared=r.compared, matched=r.matched, ok=r.ok, teacher_compared=comp, teacher_matched=mat,
                golden_tokens=len(c["tokens"]))
    assert all(r.ok for r in rows), greedy32.format_rows(rows)
    assert all(comp == mat for comp, mat in tf), tf
    for c, r in zip(cases, rows):
        if r.compared and len(c["tokens"]) == 32 and len(c["prompt_ids"]) > 1:
            with model.session(len(c["prompt_ids"]) + r.compared) as s:
                s.prefill(c["prompt_ids"][:-1])
                got = s.decode.chain(c["prompt_ids"][-1], s.length, r.compared)
            assert [int(t) for t in got] == c["tokens"][:r.compared]


# ----------------------------------------------------------------------------- sessions

def test_session_pool_reuses_graph(cp, rng, tiny_qwen2_path):
    """Two requests of one size bucket share a session: same object, one capture, same tokens
    (the second request after a different prompt: stale cache rows past the length are never
    read)."""
    from engine.generate import generate

    model = _gpu_model(tiny_qwen2_path)
    V = model.config.vocab_size
    p1 = rng.integers(0, V, 9).tolist()
    p2 = rng.integers(0, V, 13).tolist()
    n = 4 if EMU else 12
    a = generate(model, p1, n)
    (s,) = model._sessions.idle()
    graph = s.decode.graph
    assert graph is not None and s.length == 0
    generate(model, p2, n)
    b = generate(model, p1, n)
    assert model._sessions.idle() == [s] and s.decode.graph is graph and model._sessions.created == 1
    assert s.decode.times.captures == 1
    assert a.tokens == b.tokens and len(a.tokens) == n
    assert all(np.isnan(m) for m in a.margins)                   # greedy: ids (and top logit) only
    with model.session(300) as other:                            # another size bucket
        assert other is not s and other.capacity == 512 and model._sessions.created == 2
    assert set(model._sessions.idle()) == {s, other}


def test_greedy_never_copies_logits(cp, rng, tiny_path, monkeypatch):
    from engine.generate import generate
    from engine.gpu import decode

    model = _gpu_model(tiny_path)
    ids = rng.integers(0, model.config.vocab_size, 7).tolist()
    n = 4 if EMU else 16
    want = generate(model, ids, n, need_logits=True)

    def no_copy(self, logits=None):
        raise AssertionError("greedy decode copied the logits to the host")

    monkeypatch.setattr(decode.DecodeStep, "logits_host", no_copy)
    got = generate(model, ids, n)
    assert got.tokens == want.tokens
    assert np.allclose(got.top_logits, want.top_logits, rtol=0, atol=0)
    assert all(m >= 0 for m in want.margins)


def test_sampler_off_argmax_and_logits(cp, rng, tiny_path):
    """A sampler that picks the runner-up: every step's logits (need_logits) are bit-identical to
    prefill + stepping the same ids by hand, so the host-chosen token reached the graph."""
    from engine.generate import generate_steps

    model = _gpu_model(tiny_path)
    ids = rng.integers(0, model.config.vocab_size, 5).tolist()
    n = 3 if EMU else 10
    steps = list(generate_steps(model, ids, n, sampler=lambda l: int(np.argsort(l, kind="stable")[-2]),
                                need_logits=True))
    assert len(steps) == n
    with model.session(len(ids) + n) as s:
        s.prefill(ids)
        for st in steps:
            want = s.logits()
            assert np.array_equal(st.logits.view(np.uint32), want.view(np.uint32))
            assert st.token == int(np.argsort(want, kind="stable")[-2]) and st.margin <= 0
            s.step(st.token)


def test_session_steps_match_prefill(cp, rng, tiny_qwen2_path):
    """Prefill of a prompt then decode steps give the same argmax as the teacher-forced
    prefill's rows wherever that row's margin is >= MIN_MARGIN, and stay within the step bound."""
    model = _gpu_model(tiny_qwen2_path)
    V = model.config.vocab_size
    ids = rng.integers(0, V, 12 if EMU else 48).tolist()
    cut = len(ids) // 2
    tf = model.forward(ids, model.new_cache(len(ids)), all_logits=True)
    rows = []
    with model.session(len(ids)) as s:
        s.prefill(ids[:cut])
        rows.append(s.logits())
        for t in ids[cut:-1]:
            s.step(t)
            rows.append(s.logits())
        tok, top, _ = s.argmax()
        assert tok == int(np.argmax(rows[-1])) and top == float(rows[-1][tok])
    got = np.stack(rows)
    want = tf[cut - 1:-1]
    rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    srt = np.sort(want, axis=-1)
    margin = srt[:, -1] - srt[:, -2]
    assert rel.max() <= 3e-2, rel
    assert (np.argmax(got, -1) == np.argmax(want, -1))[margin >= MIN_MARGIN].all()


def test_step_launches_and_bench(cp, tiny_qwen2_path, monkeypatch):
    """One decode step launches exactly the production kernels (per layer: the q/k/v GEMVs by
    layout runs, qkv_post, attention split + combine, Wo add, rmsnorm, gate/up swiglu, q8_1 row,
    down add, rmsnorm; then output GEMV + argmax), and bench_decode's tg rows run."""
    from engine.gpu import kernels
    from engine.gpu.decode import DecodeStep, bench_decode, same_launch
    from engine.gpu.ops.mmvq import mixes

    model = _gpu_model(tiny_qwen2_path)
    step = DecodeStep(model, model.new_cache(16))
    names = []
    orig = kernels.get_kernel

    def counting(fname, name, dynamic_smem=0):
        orig(fname, name, dynamic_smem)                          # the instance exists
        return lambda *a, **kw: names.append(name)

    monkeypatch.setattr(kernels, "get_kernel", counting)
    step.enqueue()
    monkeypatch.setattr(kernels, "get_kernel", orig)
    want = 2 + 2
    for L in model.layers:
        W = L.roles
        runs = 1 + (not same_launch(W["attn_q"], W["attn_k"])) + (not same_launch(W["attn_k"], W["attn_v"]))
        if runs == 2 and mixes([W["attn_q"], W["attn_k"], W["attn_v"]]):
            runs = 1                                             # mmvq_mixed: q4_K and q6_K in one launch
        want += runs + 1 + 2 + 1 + 1 + (1 if same_launch(W["ffn_gate"], W["ffn_up"]) else 3) + 1 + 1 + 1
    assert len(names) == want, names
    assert "mmvq_mixed_pad_store" in names       # the tiny model mixes q4_K and q6_K in some layers
    assert names[-1] == "argmax_step" and not any("addnorm" in n or "_u2" in n or "_r2" in n for n in names)
    ts = bench_decode(model, n_gen=3, depth=2, reps=1)
    assert len(ts) == 1 and ts[0] > 0
