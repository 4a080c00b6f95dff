"""GPU: q8_1 quantization, the q6_K closed-form expansion, and the q4_K / q6_K MMQ GEMMs
against the numpy oracle (engine.formats.quants), on fresh random inputs with poisoned outputs.

Error bound for the GEMMs (stated, asserted per element; engine.reference.mmq.error_bound):
    |y - ref| <= (K/16 + 4) * 2^-24 * S  (+ 40 * 2^-24 * S_min for the "tc" q4_K variants)
    S = sum over the scaled terms of their magnitudes:
    q4_K: S = sum_g |d sc| |d8| sum_l q4 |q8| + |dmin m| |s8|  (S_min = the |dmin m| |s8| part)
    q6_K: S = sum_j |d sc_j| |d8| sum_l |q6 - 32| |q8|
The integer dots are exact (int32 MMA, exact int->float); each scaled term is formed with at
most three float32 roundings and the K/32 (q4_K: 2 K/32) terms are summed in float32, so the
classic gamma_n bound applies with n <= K/16 + 3. The observed worst ratio |y - ref| / (2^-24 S)
is reported (GPU_REPORT) next to the bound.

Every test skips without a GPU (marker `gpu`, conftest). With GPU_REPORT=<file> each check
appends one JSON line with its figures (scripts/gpu_check.sh prints them).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from engine.formats import quants as Q
from engine.reference.mmq import abs_terms, error_bound, mmq_reference, random_blocks

pytestmark = pytest.mark.gpu

U = 2.0 ** -24


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
    """Random valid blocks: random bytes, f16 scale fields finite (incl. negative/zero/tiny)."""
    return random_blocks(rng, kind, n_rows, K, special=True)


def rand_act(rng, T, K):
    x = rng.standard_normal((T, K)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-2, 2, (T, 1))).astype(np.float32)
    x[0, :32] = 0.0                                  # amax == 0 block
    if K >= 64:
        x[0, 32:64] *= np.float32(1e-38)             # tiny / subnormal block
    if T > 1:
        x[1, : K // 2] = np.round(x[1, : K // 2])    # exact ties for roundf
    return x


def describe_errors(bad):
    """Where the failing elements are (for a kernel bug: tile / fragment patterns)."""
    t, n = np.nonzero(bad)
    if t.size == 0:
        return "none"
    return (f"{t.size} of {bad.size} bad; first (t={t[0]}, n={n[0]}); "
            f"t%16 hist {np.bincount(t % 16, minlength=16).tolist()}; "
            f"n%8 hist {np.bincount(n % 8, minlength=8).tolist()}; "
            f"t range {t.min()}..{t.max()}, n range {n.min()}..{n.max()}")


# ----------------------------------------------------------------------------- q8_1

@pytest.mark.parametrize("T,K", [(1, 256), (7, 4096), (65, 11008), (3314, 4096)])
def test_quantize_q8_1_identical(cp, rng, T, K):
    from engine.gpu.ops import mmq as gpu_ops

    x = rand_act(rng, T, K)
    qr, dr, sr = Q.quantize_q8_1(x)
    out = gpu_ops.Q8Act(cp.full((T, K), -128, dtype=cp.int8),          # poison: never produced
                        cp.full((T, K // 32, 2), np.nan, dtype=cp.float32))
    act = gpu_ops.quantize_q8_1(cp.asarray(x), out=out)
    q = cp.asnumpy(act.q)
    ds = cp.asnumpy(act.ds)
    mism_q = int((q != qr).sum())
    mism_d = int((ds[..., 0].view(np.uint32) != dr.view(np.uint32)).sum())
    mism_s = int((ds[..., 1].view(np.uint32) != sr.view(np.uint32)).sum())
    _report(test="quantize_q8_1", T=T, K=K, elements=T * K, blocks=T * K // 32,
            q_mismatches=mism_q, d_mismatches=mism_d, s_mismatches=mism_s)
    assert mism_q == 0 and mism_d == 0 and mism_s == 0, (mism_q, mism_d, mism_s)


# ----------------------------------------------------------------------------- q6_K expansion

def test_q6k_closed_form_expansion(cp, rng):
    """The seed's gate on the production code: mmq_q6_k.cu's padded arm (q6_load_unit +
    expand_q6_unit, closed form) and raw arm (expand_q6_group_raw, per-element byte map), run by
    q6k_expand_check.cu on the same blocks, agree byte for byte, and with numpy's q6_k_fields."""
    from engine.gpu.ops.checks import q6k_expand_check

    nblocks = 4096                                          # 1,048,576 elements
    raw = rand_rows(rng, "q6_k", nblocks, Q.QK_K)           # [nblocks, 210]
    padded = Q.repack_q6_k_padded(raw)
    closed, elem = q6k_expand_check(cp.asarray(padded), cp.asarray(np.ascontiguousarray(raw)))
    closed, elem = cp.asnumpy(closed), cp.asnumpy(elem)
    _, _, qref = Q.q6_k_fields(raw)
    mism = int((closed != elem).sum())
    mism_ref = int((closed != qref).sum())
    mism_raw_ref = int((elem != qref).sum())
    _report(test="q6k_expand", elements=int(closed.size), closed_vs_raw_arm_mismatches=mism,
            closed_vs_numpy_mismatches=mism_ref, raw_arm_vs_numpy_mismatches=mism_raw_ref)
    assert closed.size >= 512_000
    assert mism == 0 and mism_ref == 0 and mism_raw_ref == 0, (mism, mism_ref, mism_raw_ref)


# ----------------------------------------------------------------------------- MMQ

# T = 40: several token tiles of the 16- and 32-token tiles in the small-batch ("token-fast",
# common.cuh mmq_work) tile order
SHAPES = [(1, 300, 512), (7, 333, 1024), (40, 300, 1024), (65, 257, 4096), (3314, 200, 512), (130, 129, 256)]


def _variants(kind):
    from engine.gpu import kernels
    return kernels.mmq_variants(kind)


def _run_mmq(cp, w_dev, act, T, N, variant):
    from engine.gpu.ops import mmq as gpu_ops

    y = cp.full((T, N), np.nan, dtype=cp.float32)                      # poison
    gpu_ops.mmq(w_dev, act, out=y, variant=variant)
    return cp.asnumpy(y)


def _check_gemm(kind, variant, T, N, K, y, ref, SS, label):
    from engine.gpu import kernels
    S, S_min = SS
    bound = error_bound(kind, K, S, S_min, kernels.mmq_uses_tc(kind, variant))
    err = np.abs(y.astype(np.float64) - ref)
    finite = np.isfinite(y)
    bad = ~finite | (err > bound)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(S > 0, err / (U * S), 0.0)
    worst = float(np.nanmax(np.where(finite, ratio, np.inf))) if y.size else 0.0
    rel = float(np.linalg.norm(np.where(finite, y, 0) - ref) / max(np.linalg.norm(ref), 1e-300))
    _report(test="mmq", kind=kind, layout=label, variant=variant, T=T, N=N, K=K,
            bad=int(bad.sum()), nonfinite=int((~finite).sum()),
            worst_err_over_uS=worst,
            bound_over_uS=K / 16 + 4 + (40 if kernels.mmq_uses_tc(kind, variant) else 0),
            rel_l2=rel)
    assert not bad.any(), f"{kind}/{label}/{variant} T={T} N={N} K={K}: {describe_errors(bad)}"


@pytest.mark.parametrize("variant", _variants("q4_k"))
@pytest.mark.parametrize("T,N,K", SHAPES)
def test_mmq_q4_k(cp, rng, variant, T, N, K):
    from engine.gpu.ops import mmq as gpu_ops
    from engine.gpu.weights import upload_weight

    w = rand_rows(rng, "q4_k", N, K)
    x = rand_act(rng, T, K)
    q, d, s = Q.quantize_q8_1(x)
    act = gpu_ops.quantize_q8_1(cp.asarray(x))
    assert np.array_equal(cp.asnumpy(act.q), q)
    wd = upload_weight(w, "Q4_K")
    y = _run_mmq(cp, wd, act, T, N, variant)
    ref = mmq_reference("q4_k", w, q, d, s)
    _check_gemm("q4_k", variant, T, N, K, y, ref, abs_terms("q4_k", w, q, d, s), "raw")


@pytest.mark.parametrize("variant", _variants("q6_k"))
@pytest.mark.parametrize("T,N,K", SHAPES)
def test_mmq_q6_k_raw_and_padded(cp, rng, variant, T, N, K):
    from engine.gpu.ops import mmq as gpu_ops
    from engine.gpu.weights import upload_weight

    w = rand_rows(rng, "q6_k", N, K)
    x = rand_act(rng, T, K)
    q, d, s = Q.quantize_q8_1(x)
    act = gpu_ops.quantize_q8_1(cp.asarray(x))
    w_raw = upload_weight(w, "Q6_K", pad_q6k=False)
    w_pad = upload_weight(w, "Q6_K", pad_q6k=True)
    assert not w_raw.padded and w_pad.padded and w_pad.block_stride == 224
    assert np.array_equal(cp.asnumpy(w_pad.data), Q.repack_q6_k_padded(w))
    y_raw = _run_mmq(cp, w_raw, act, T, N, variant)
    y_pad = _run_mmq(cp, w_pad, act, T, N, variant)
    ident = int((y_raw.view(np.uint32) != y_pad.view(np.uint32)).sum())
    _report(test="q6k_raw_vs_padded", variant=variant, T=T, N=N, K=K, elements=int(y_raw.size),
            bit_mismatches=ident)
    ref = mmq_reference("q6_k", w, q, d, s)
    S = abs_terms("q6_k", w, q, d, s)
    _check_gemm("q6_k", variant, T, N, K, y_raw, ref, S, "raw")
    _check_gemm("q6_k", variant, T, N, K, y_pad, ref, S, "padded")
    assert ident == 0, f"raw vs padded: {ident} elements differ"


# ----------------------------------------------------------------------------- MMQ tail split

# (T, N, K, (split0, parts)); split0 < 0 counts from the number of tiles. K = 768 is 3 stages
# of 256 (6 of 128): uneven parts; the last tile is ragged in T and N for every tile shape.
SPLIT_CASES = [(130, 129, 768, (0, 2)), (130, 129, 768, (-1, 3)), (200, 300, 1024, (-3, 4)),
               (40, 300, 1024, (0, 2)), (40, 300, 768, (-2, 3))]


def _mmq_y(cp, w_dev, act, T, N, variant, split):
    from engine.gpu.ops import mmq as gpu_ops

    y = cp.full((T, N), np.nan, dtype=cp.float32)                      # poison
    gpu_ops.mmq(w_dev, act, out=y, variant=variant, split=split)
    return cp.asnumpy(y)


@pytest.mark.parametrize("kind,variant", [(k, v) for k in ("q4_k", "q6_k") for v in _variants(k)])
@pytest.mark.parametrize("T,N,K,plan", SPLIT_CASES)
def test_mmq_split(cp, rng, kind, variant, T, N, K, plan):
    """Forced split plans: within the bound, the same bits on a second launch (deterministic
    sum order; counters re-armed, else the second launch leaves the poison), q6_K raw ==
    padded."""
    from engine.gpu.ops import mmq as gpu_ops
    from engine.gpu import kernels
    from engine.gpu.weights import upload_weight

    tiles = gpu_ops.mmq_grid(kind, variant, T, N, K).tiles
    split = (plan[0] % tiles if plan[0] < 0 else plan[0], plan[1])
    w = rand_rows(rng, kind, N, K)
    x = rand_act(rng, T, K)
    q, d, s = Q.quantize_q8_1(x)
    act = gpu_ops.quantize_q8_1(cp.asarray(x))
    layouts = [("raw", upload_weight(w, kind.upper(), pad_q6k=False))]
    if kind == "q6_k":
        layouts.append(("padded", upload_weight(w, "Q6_K", pad_q6k=True)))
    ref = mmq_reference(kind, w, q, d, s)
    S = abs_terms(kind, w, q, d, s)
    ys = []
    for label, wd in layouts:
        y1 = _mmq_y(cp, wd, act, T, N, variant, split)
        y2 = _mmq_y(cp, wd, act, T, N, variant, split)
        _check_gemm(kind, variant + kernels.MMQ_SPLIT_SUFFIX, T, N, K, y1, ref, S, label)
        rerun = int((y1.view(np.uint32) != y2.view(np.uint32)).sum())
        assert rerun == 0, f"{kind}/{label}/{variant} split {split}: {rerun} elements differ on a rerun"
        ys.append(y1)
    if kind == "q6_k":
        assert np.array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32)), "raw vs padded differ"


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_mmq_split_auto(cp, rng, kind):
    """The "+split" production variant on a grid with a small partial last wave on this
    device (2 tile columns, tokens for SMs + 1..2 tiles)."""
    from engine.gpu.ops import mmq as gpu_ops
    from engine.gpu import kernels
    from engine.gpu.weights import upload_weight

    variant = gpu_ops.DEFAULT_VARIANT[kind] + kernels.MMQ_SPLIT_SUFFIX
    bm, bn, _ = kernels.mmq_tile(kind, variant)
    N, K = bn + 8, 512
    T = bm * (gpu_ops._sm_count() // 2 + 1) - 7
    g = gpu_ops.mmq_grid(kind, variant, T, N, K)
    assert g.parts >= 2 and g.split0 < g.tiles, g
    w = rand_rows(rng, kind, N, K)
    x = rand_act(rng, T, K)
    q, d, s = Q.quantize_q8_1(x)
    wd = upload_weight(w, kind.upper())
    act = gpu_ops.quantize_q8_1(cp.asarray(x))
    y1 = _mmq_y(cp, wd, act, T, N, variant, None)
    y2 = _mmq_y(cp, wd, act, T, N, variant, None)
    ref = mmq_reference(kind, w, q, d, s)
    _check_gemm(kind, variant, T, N, K, y1, ref, abs_terms(kind, w, q, d, s),
                "padded" if kind == "q6_k" else "raw")
    assert np.array_equal(y1.view(np.uint32), y2.view(np.uint32))


def test_linear_matches_two_steps(cp, rng):
    from engine.gpu.ops import mmq as gpu_ops
    from engine.gpu.weights import upload_weight

    T, N, K = 33, 160, 512
    w = upload_weight(rand_rows(rng, "q4_k", N, K), "Q4_K")
    x = cp.asarray(rand_act(rng, T, K))
    y1 = cp.asnumpy(gpu_ops.linear(w, x))
    y2 = cp.asnumpy(gpu_ops.mmq(w, gpu_ops.quantize_q8_1(x)))
    assert np.array_equal(y1.view(np.uint32), y2.view(np.uint32))


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("T,N", [(1, 136), (8, 136), (32, 136), (64, 136), (8500, 136), (24, 12288)])
def test_default_variant_dispatch(cp, rng, kind, T, N):
    """gpu_ops.mmq without a variant (the production path), small and large grid, and a wide
    matrix at 24 tokens (registry.SMALL_BATCH_WIDE for q4_K)."""
    from engine.gpu.ops import mmq as gpu_ops
    from engine.gpu.weights import upload_weight

    K = 512
    w = rand_rows(rng, kind, N, K)
    x = rand_act(rng, T, K)
    q, d, s = Q.quantize_q8_1(x)
    wd = upload_weight(w, kind.upper())
    y = cp.full((T, N), np.nan, dtype=cp.float32)
    gpu_ops.mmq(wd, gpu_ops.quantize_q8_1(cp.asarray(x)), out=y)
    ref = mmq_reference(kind, w, q, d, s)
    variant = gpu_ops.choose_variant(kind, T, N)
    _check_gemm(kind, variant, T, N, K, cp.asnumpy(y), ref, abs_terms(kind, w, q, d, s),
                "padded" if kind == "q6_k" else "raw")


# ----------------------------------------------------------------------------- small batch (mmsb)

# (T, N, K): every n-tile count (T = 1..64, ragged T), ragged row tiles (N % 64 != 0), an odd
# super-block count (K = 768: 3), K = 4096 / 11008 as in the 7B shapes.
SB_SHAPES = [(1, 200, 768), (5, 64, 256), (8, 333, 1024), (9, 130, 768), (16, 257, 4096),
             (16, 136, 11008), (2, 65, 512), (32, 300, 4096), (27, 129, 11008), (64, 200, 1024),
             (41, 70, 768)]
# the production (MR, D) per n-tile count and the other m-tile count (registry.mmsb_config)
SB_VARIANTS = ["mmsb", "mmsb.r2d2", "mmsb.r1d3"]


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
@pytest.mark.parametrize("T,N,K", SB_SHAPES)
@pytest.mark.parametrize("parts", [None, 1, 2, 3])
@pytest.mark.parametrize("variant", SB_VARIANTS)
def test_mmsb(cp, rng, kind, T, N, K, parts, variant):
    """Small-batch GEMM against the oracle within the bound, forced and planned K-splits; the
    same bits on a rerun (the split sums in a fixed order); q6_K raw == padded bit for bit."""
    from engine.gpu.ops import mmq as gpu_ops
    from engine.gpu.weights import upload_weight

    nsb = K // 256
    if parts is not None and parts > nsb:
        pytest.skip(f"{parts} parts > {nsb} super-blocks")
    w = rand_rows(rng, kind, N, K)
    x = rand_act(rng, T, K)
    q, d, s = Q.quantize_q8_1(x)
    act = gpu_ops.quantize_q8_1(cp.asarray(x))
    split = None if parts is None else (0, parts)
    layouts = {"raw": upload_weight(w, kind.upper(), pad_q6k=False)}
    if kind == "q6_k":
        layouts["padded"] = upload_weight(w, kind.upper(), pad_q6k=True)
    ref = mmq_reference(kind, w, q, d, s)
    SS = abs_terms(kind, w, q, d, s)
    outs = {}
    for label, wd in layouts.items():
        y1 = _mmq_y(cp, wd, act, T, N, variant, split)
        y2 = _mmq_y(cp, wd, act, T, N, variant, split)
        _check_gemm(kind, variant, T, N, K, y1, ref, SS, label)
        assert np.array_equal(y1.view(np.uint32), y2.view(np.uint32)), f"{kind}/{label}: rerun differs"
        outs[label] = y1
    if kind == "q6_k":
        diff = int((outs["raw"].view(np.uint32) != outs["padded"].view(np.uint32)).sum())
        _report(test="q6k_raw_vs_padded", variant=variant, T=T, N=N, K=K, elements=int(y1.size), bit_mismatches=diff)
        assert diff == 0, f"mmsb q6_K raw vs padded: {diff} elements differ"


def test_mmsb_dispatch_tiers(cp):
    """choose_variant's small-batch tiers name kernels that exist for every T up to their limit."""
    from engine.gpu import registry
    from engine.gpu.ops import mmq as gpu_ops

    for kind in ("q4_k", "q6_k"):
        for T in range(1, 129):
            v = gpu_ops.choose_variant(kind, T, 4096)
            name = registry.mmq_split_name(v)[0]
            assert name == registry.MMVQ_VARIANT or registry.is_mmsb(v) or name in registry.MMQ_CONFIGS[kind], v
