"""GPU (sm_90): the Hopper f16 GEMMs (kernels_cu/wgmma_q4_k.cu, wgmma_q6_k.cu) against their
float64 oracle (engine.reference.wgmma), on fresh random q4_K / q6_K blocks and activations,
poisoned outputs; q6_K in both block layouts (padded 224-byte and raw 210-byte: the same bits).

Checked: the activation tiling kernel == the numpy tiling bit for bit (f16 rounding and the zero
tokens past T included); every output element within engine.reference.wgmma.wgmma_error_bound of
the oracle on the kernel's own operands (f16-dequantized weights, f16 activations); ragged token
counts (token groups never copied), every token tile (32 to 256), stage counts from 3 to 8, and K
split in 2 to 8 parts across a cluster (uneven parts; a rerun gives the same bits). The worst ratio |y - ref| / bound goes to GPU_REPORT.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from engine.gpu.registry import STREAMK
from engine.reference.mmq import random_blocks
from engine.reference.wgmma import (
    dequant_q4_k_f16, dequant_q6_k_f16, k_permutation, tile_x16, wgmma_abs, wgmma_error_bound, wgmma_reference,
)

pytestmark = pytest.mark.gpu


def _sm90():
    import cupy as cp

    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma needs sm_90")


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(8), "little")
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def _report(**kw):
    path = os.environ.get("GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(kw) + "\n")


def test_tile_kernel_matches_numpy(rng):
    _sm90()
    import cupy as cp

    from engine.gpu.ops.wgmma import tile_x16 as gpu_tile

    x = (rng.standard_normal((37, 512)) * 3).astype(np.float32)
    x[0, :8] = [65519.0, 65521.0, -1e-8, 6e-8, 1e5, -0.0, 2.0 ** -24, 3.0 * 2 ** -25]  # rounding edges
    got = cp.asnumpy(gpu_tile(cp.asarray(x))).view(np.uint16)
    want = tile_x16(x).view(np.uint16)
    assert np.array_equal(got, want)
    assert sorted(k_permutation()) == list(range(256))


# Small batches: K split in kp parts (clusters adding through distributed shared memory).
SPLIT_CASES = [
    (32, 256, 4096, 32, 4, 4),     # one 32-token tile, 4 parts of 4 super-blocks
    (20, 128, 2048, 32, 4, 2),     # ragged token group inside the tile
    (50, 128, 11008, 64, 4, 4),    # 43 super-blocks: parts of 10 and 11
    (7, 128, 2048, 32, 3, 8),      # one token, eight parts of one super-block
    (100, 256, 1024, 128, 4, 2),
    (96, 128, 1024, 32, 4, 2),     # three token tiles, each split
    (32, 1024, 4096, None, None, None),   # the production choice (registry.wgmma_config)
    (32, 256, 14336, None, None, None),   # the production choice: 8 parts of 7 super-blocks
]


@pytest.mark.parametrize("T,N,K,bt,stages,kp", [
    (128, 128, 256, 128, 4, None),       # one tile, one super-block (fewer stages than buffers)
    (200, 256, 1024, 128, 4, None),      # ragged second token tile
    (77, 384, 4096, 256, 4, None),       # ragged single tile of 256 (token groups not copied)
    (300, 128, 2048, 128, 3, None),
    (513, 256, 4096, 128, 6, None),
    (700, 384, 1024, None, None, None),  # the production choice (registry.wgmma_config)
] + SPLIT_CASES)
def test_wgmma_q4k_vs_oracle(rng, T, N, K, bt, stages, kp):
    _sm90()
    import cupy as cp

    from engine.gpu.ops.wgmma import tile_x16 as gpu_tile
    from engine.gpu.ops.wgmma import wgmma_q4k
    from engine.gpu.weights import upload_weight

    w = random_blocks(rng, "q4_k", N, K, special=True)
    x = rng.standard_normal((T, K)).astype(np.float32)
    wd = upload_weight(w, "Q4_K")
    xt = gpu_tile(cp.asarray(x))
    y = _run_poisoned(wgmma_q4k, wd, xt, T, N, bt=bt, stages=stages, kp=kp)
    _check_vs_oracle("wgmma_q4k", y, dequant_q4_k_f16(w), x, T=T, N=N, K=K, bt=bt, stages=stages, kp=kp)
    if kp and kp > 1:                  # the parts add in a fixed order: a second run gives the same bits
        y2 = _run_poisoned(wgmma_q4k, wd, xt, T, N, bt=bt, stages=stages, kp=kp)
        assert np.array_equal(y.view(np.uint32), y2.view(np.uint32))


def _run_poisoned(gemm, wd, xt, T: int, N: int, **cfg) -> np.ndarray:
    """gemm's output (host copy) written over NaN, so an unwritten element shows."""
    import cupy as cp

    y = cp.full((T, N), np.nan, dtype=cp.float32)
    gemm(wd, xt, T, out=y, **cfg)
    return cp.asnumpy(y)


def _check_vs_oracle(test: str, y, w16, x, **case):
    """Every output within wgmma_error_bound of the float64 oracle on the kernel's operands."""
    got = np.asarray(y).astype(np.float64)
    x16 = x.astype(np.float16)
    ref = wgmma_reference(w16, x16)
    bound = wgmma_error_bound(x.shape[1], wgmma_abs(w16, x16))
    assert np.all(np.isfinite(got)), "unwritten or non-finite outputs"
    err = np.abs(got - ref)
    worst = float(np.max(err / np.maximum(bound, 1e-300)))
    _report(test=test, **case, worst_err_over_bound=worst,
            rel_l2=float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
    assert np.all(err <= bound), f"worst |y - ref| / bound = {worst:.3g}"


@pytest.mark.parametrize("T,N,K,bt,stages,kp", [
    (128, 128, 256, 128, 4, None),       # one tile, one super-block (stage ring never refilled)
    (200, 256, 1024, 128, 4, None),      # ragged second token tile (BT = 128: 4 stages loaded ahead)
    (77, 384, 4096, 256, 4, None),       # ragged single tile of 256 (BT = 256: 2 stages ahead)
    (300, 128, 2048, 256, 3, None),
    (513, 256, 1536, 128, 6, None),      # 6 super-blocks, 6 buffers
    (8, 128, 512, 128, 5, None),         # one token group
    (700, 384, 1024, None, None, None),  # the production choice (registry.wgmma_config)
] + SPLIT_CASES)
def test_wgmma_q6k_vs_oracle(rng, T, N, K, bt, stages, kp):
    _sm90()
    import cupy as cp

    from engine.gpu.ops.wgmma import tile_x16 as gpu_tile
    from engine.gpu.ops.wgmma import wgmma_q6k
    from engine.gpu.weights import upload_weight

    w = random_blocks(rng, "q6_k", N, K, special=True)
    x = rng.standard_normal((T, K)).astype(np.float32)
    xt = gpu_tile(cp.asarray(x))
    ys = {}
    for padded in (True, False):
        wd = upload_weight(w, "Q6_K", pad_q6k=padded)
        assert wd.padded == padded
        ys[padded] = _run_poisoned(wgmma_q6k, wd, xt, T, N, bt=bt, stages=stages, kp=kp)
    assert np.array_equal(ys[True].view(np.uint32), ys[False].view(np.uint32)), "raw and padded layouts differ"
    _check_vs_oracle("wgmma_q6k", ys[True], dequant_q6_k_f16(w), x, T=T, N=N, K=K, bt=bt, stages=stages, kp=kp)


def test_wgmma_q6k_instances_do_not_spill():
    """The driver's own compile of the production q6_K instances (PTX for compute_90a, JIT):
    no local memory (register spills); the registers go to GPU_REPORT (ptxas 12.9 on the CPU:
    187 / 234 padded, 236 / 244 raw, BT = 128 / 256)."""
    _sm90()
    from engine.gpu import kernels, registry
    from engine.gpu.ops.wgmma import Q6_FILE

    for name in registry.INSTANCES[Q6_FILE]:
        k = kernels.get_kernel(Q6_FILE, name)
        _report(test="wgmma_q6k_regs", instance=name, num_regs=int(k.num_regs),
                local_bytes=int(k.local_size_bytes))
        assert int(k.local_size_bytes) == 0, f"{name}: {k.local_size_bytes} B of local memory (spills)"


@pytest.mark.parametrize("T,Na,Nb,K,bt,kp", [
    (32, 256, 128, 4096, 32, 1),        # [Wq; Wk] q4_K beside Wv q6_K, one token tile
    (32, 512, 256, 2048, 32, 4),        # K split: the clusters of a tile never straddle the matrices
    (50, 128, 384, 2816, 64, 2),        # ragged tokens, 11 super-blocks in uneven parts
    (200, 384, 128, 1024, 128, 1),
    (700, 256, 128, 1024, 128, 1),      # 6 token tiles: WG_RASTER = 4 maps them in two groups
    (77, 128, 128, 1024, 256, 1),
    (24, 1024, 512, 4096, None, None),  # the production choice for the two matrices together
])
def test_wgmma_pair_equals_two_launches(rng, T, Na, Nb, K, bt, kp):
    """wgmma_pair (kernels_cu/wgmma_pair.cu): each output equal bit for bit to wgmma_q4k /
    wgmma_q6k with the same tile choice, q6_K in both layouts, every element written."""
    _sm90()
    import cupy as cp

    from engine.gpu import registry
    from engine.gpu.ops.wgmma import tile_x16 as gpu_tile
    from engine.gpu.ops.wgmma import pairs, wgmma_pair, wgmma_q4k, wgmma_q6k
    from engine.gpu.weights import upload_weight

    wa = upload_weight(random_blocks(rng, "q4_k", Na, K, special=True), "Q4_K")
    w6 = random_blocks(rng, "q6_k", Nb, K, special=True)
    xt = gpu_tile(cp.asarray(rng.standard_normal((T, K)).astype(np.float32)))
    auto = bt is None
    if auto:
        bt, kp = registry.wgmma_config(T, Na + Nb, K)
    want_a = _run_poisoned(wgmma_q4k, wa, xt, T, Na, bt=bt, kp=kp)
    for padded in (True, False):
        wb = upload_weight(w6, "Q6_K", pad_q6k=padded)
        assert pairs([wa, wb]) and not pairs([wb, wa])
        want_b = _run_poisoned(wgmma_q6k, wb, xt, T, Nb, bt=bt, kp=kp)
        ya = cp.full((T, Na), np.nan, dtype=cp.float32)
        yb = cp.full((T, Nb), np.nan, dtype=cp.float32)
        wgmma_pair(wa, wb, xt, T, ya, yb, **({} if auto else dict(bt=bt, kp=kp)))
        assert np.array_equal(cp.asnumpy(ya).view(np.uint32), want_a.view(np.uint32)), f"q4_K part (padded={padded})"
        assert np.array_equal(cp.asnumpy(yb).view(np.uint32), want_b.view(np.uint32)), f"q6_K part (padded={padded})"


def _launcher_outputs(rng, T: int, K: int, N: int = 512):
    """outputs(**cfg): every launcher's output (q4_K, q6_K padded, the pair with it, q6_K raw,
    the pair with it, the SwiGLU epilogue over [gate; up] = N rows) as host arrays, on one set of
    random weights (extreme scales) and activations, for the bit-for-bit comparisons of two
    forms that must agree."""
    import cupy as cp

    from engine.gpu.ops.wgmma import tile_x16 as gpu_tile
    from engine.gpu.ops.wgmma import tiled_buffer, wgmma_pair, wgmma_q4k, wgmma_q6k, wgmma_swiglu
    from engine.gpu.weights import upload_weight

    w4 = upload_weight(random_blocks(rng, "q4_k", N, K, special=True), "Q4_K")
    w6 = random_blocks(rng, "q6_k", N, K, special=True)
    w6s = [upload_weight(w6, "Q6_K", pad_q6k=padded) for padded in (True, False)]
    xt = gpu_tile(cp.asarray(rng.standard_normal((T, K)).astype(np.float32)))

    def outputs(**cfg):
        out = [_run_poisoned(wgmma_q4k, w4, xt, T, N, **cfg)]
        for w6d in w6s:
            out.append(_run_poisoned(wgmma_q6k, w6d, xt, T, N, **cfg))
            ya, yb = (cp.full((T, N), np.nan, dtype=cp.float32) for _ in range(2))
            wgmma_pair(w4, w6d, xt, T, ya, yb, **cfg)
            out += [ya, yb]
        h = tiled_buffer(T, N // 2)
        wgmma_swiglu(w4, xt, T, out=h, **cfg)
        return [cp.asnumpy(cp.asarray(a)) for a in out + [h]]
    return outputs


_LAUNCHERS = ("q4_K", "q6_K padded", "pair q4_K", "pair q6_K padded", "q6_K raw", "pair q4_K (raw)",
              "pair q6_K raw", "swiglu")


def _assert_same_bits(got, want):
    for name, g, w in zip(_LAUNCHERS, got, want, strict=True):
        assert g.tobytes() == w.tobytes(), name


@pytest.mark.parametrize("T,K,bt,kp", [
    (32, 512, 32, 1),          # 8 stages: the prologue loads them all, nothing refilled
    (32, 256, 32, 1),          # 4 stages, fewer than the buffers
    (32, 4096, 32, 1),         # 64 stages: 14 refills of 4
    (24, 2816, 64, 2),         # ragged tokens, 11 super-blocks in uneven parts (20 / 24 stages)
    (32, 11008, 32, 4),        # llama2-7b's down at T = 32: parts of 10 / 11 super-blocks
    (64, 3584, 64, 8),         # 14 super-blocks in 8 parts: 1 or 2 each (4 / 8 stages)
    (17, 9216, 32, 8),         # 36 super-blocks in 8 parts of 4 / 5 (16 / 20 stages)
])
@pytest.mark.parametrize("deep", [8, 12, 16])
def test_wgmma_deep_ring_equals_four_stages(rng, T, K, bt, kp, deep):
    """With 8 activation buffers (registry.wgmma_stages: production for token tiles <= 64)
    wgmma_gemm refills a super-block's 4 buffers after one block barrier (RB = 4); 12 and 16
    (registry.WGMMA_DEEP_STAGES, the A/B forms) run 2 and 3 super-blocks ahead. Each launcher
    (q4_K, q6_K in both layouts, the pair, the SwiGLU epilogue) gives the same bits as with the
    4-buffer ring (WG_SMALL_STAGES=4, the A/B form)."""
    _sm90()
    outputs = _launcher_outputs(rng, T, K)
    _assert_same_bits(outputs(bt=bt, stages=deep, kp=kp), outputs(bt=bt, stages=4, kp=kp))


@pytest.mark.parametrize("T,F,K,bt,kp", [
    (32, 256, 1024, 32, 1),             # one token tile, two row tiles (gate | up halves)
    (50, 512, 2816, 64, 2),             # ragged tokens; K split, uneven parts
    (32, 256, 4096, 32, 4),             # four parts: a pair's two halves summed by one part
    (200, 256, 1024, 128, 1),           # ragged second token tile
    (77, 512, 2048, 256, 1),            # ragged single tile of 256
    (3314, 1024, 1024, None, None),     # the production choice (registry.wgmma_config)
    (24, 768, 4096, None, None),
])
def test_wgmma_swiglu_equals_gemm_then_swiglu_x16(rng, T, F, K, bt, kp):
    """wgmma_swiglu (the gate|up GEMM's SwiGLU epilogue) == wgmma_q4k with the same tile choice,
    then activation.swiglu_x16 on its [T, 2F] output, bit for bit over the whole tiled operand
    (the tokens past T stay the buffer's zeros)."""
    _sm90()
    import cupy as cp

    from engine.gpu import registry
    from engine.gpu.ops.activation import swiglu_x16
    from engine.gpu.ops.wgmma import swiglu_fusable, tiled_buffer, wgmma_q4k, wgmma_swiglu
    from engine.gpu.ops.wgmma import tile_x16 as gpu_tile
    from engine.gpu.weights import upload_weight

    wd = upload_weight(random_blocks(rng, "q4_k", 2 * F, K, special=True), "Q4_K")
    xt = gpu_tile(cp.asarray(rng.standard_normal((T, K)).astype(np.float32)))
    if bt is None:
        bt, kp = registry.wgmma_config(T, 2 * F, K)
        assert swiglu_fusable(wd, T)
    gu = cp.asarray(_run_poisoned(wgmma_q4k, wd, xt, T, 2 * F, bt=bt, kp=kp))
    want = tiled_buffer(T, F)
    swiglu_x16(gu, gu[:, F:], 2 * F, F, want, T)
    got = tiled_buffer(T, F)
    wgmma_swiglu(wd, xt, T, out=got, bt=bt, kp=kp)
    assert np.array_equal(cp.asnumpy(got).view(np.uint16), cp.asnumpy(want).view(np.uint16))


@pytest.mark.parametrize("layout,T,H,KVH,hd,rope_type,bias,cfg,where", [
    ("q4k", 32, 4, 2, 128, "normal", False, None, "start"),       # the production choice (KP > 1)
    ("q4k", 50, 4, 2, 128, "neox", True, (64, 2), "start_dev"),   # ragged tokens, K split in 2
    ("q4k", 200, 8, 4, 64, "neox", True, (128, 1), "rows"),       # two heads a tile; varlen rows
    ("q4k", 700, 4, 4, 128, "normal", True, (256, 1), "start"),   # 3 token tiles of 256
    ("pair", 32, 4, 2, 128, "neox", True, (32, 4), "start"),      # [Wq; Wk] q4_K + Wv q6_K, 4 parts
    ("pair", 24, 4, 2, 128, "normal", False, None, "rows"),       # the production choice
    ("pair", 300, 8, 4, 64, "normal", True, (128, 1), "start_dev"),
    ("q4k", 32, 4, 2, 128, "neox", True, (32, STREAMK), "start"),          # stream-K (an A/B): same deal
    ("pair", 32, 8, 4, 128, "normal", True, (32, STREAMK), "rows"),        # as the plain stream-K GEMM
    ("pair", 24, 4, 2, 64, "neox", False, (32, STREAMK), "start_dev"),
])
def test_wgmma_qkv_rope_equals_gemm_then_qkv_rope(rng, layout, T, H, KVH, hd, rope_type, bias, cfg, where):
    """wgmma_qkv_rope (the q|k|v GEMM with bias + RoPE + the K/V append fused, production at T <= 32) ==
    wgmma_q4k / wgmma_pair with the same tile choice, then ops.rope.qkv_rope on its output, bit for
    bit: qout and both caches (written over NaN), positions from start, start_dev or varlen rows."""
    _sm90()
    import cupy as cp

    from engine.formats.config import ModelConfig
    from engine.formats.rope import rope_tables
    from engine.gpu import ops, registry
    from engine.gpu.ops.wgmma import qkv_rope_fusable, wgmma_pair, wgmma_q4k, wgmma_qkv_rope
    from engine.gpu.ops.wgmma import tile_x16 as gpu_tile
    from engine.gpu.weights import upload_weight

    K, maxT = 1024, 1024
    qd, kvd = H * hd, KVH * hd
    mc = ModelConfig("llama", 1, qd, H, KVH, hd, 256, 10, 64, 1e4 if rope_type == "normal" else 1e6,
                     rope_type, 1e-5, bias, False)
    if layout == "q4k":
        ws = [upload_weight(random_blocks(rng, "q4_k", qd + 2 * kvd, K, special=True), "Q4_K")]
    else:
        ws = [upload_weight(random_blocks(rng, "q4_k", qd + kvd, K, special=True), "Q4_K"),
              upload_weight(random_blocks(rng, "q6_k", kvd, K, special=True), "Q6_K", pad_q6k=True)]
    N = sum(w.rows for w in ws)
    bt, kp = cfg if cfg else registry.wgmma_config(T, N, K)
    if cfg is None:
        assert qkv_rope_fusable(ws, T, qd, kvd, hd)
    xt = gpu_tile(cp.asarray(rng.standard_normal((T, K)).astype(np.float32)))
    b = [cp.asarray((rng.standard_normal(c) * 5).astype(np.float32)) if bias else None for c in (qd, kvd, kvd)]
    cos, sin = (cp.asarray(x) for x in rope_tables(mc, np.arange(maxT)))
    start, start_dev, rows = 0, None, None
    if where == "start":
        start = 7
    elif where == "start_dev":
        start, start_dev = 3, cp.asarray(np.array([11], np.int32))
    else:
        perm = rng.permutation(maxT)[:T].astype(np.int32)
        rows = (cp.asarray(rng.integers(0, maxT, T).astype(np.int32)), cp.asarray(perm))
    neox = rope_type == "neox"

    def run(fused: bool):
        outs = [cp.full((H, T, hd), np.nan, dtype=cp.float16)] + [cp.full((KVH, maxT, hd), np.nan, dtype=cp.float16)
                                                                   for _ in range(2)]
        args = (*b, cos, sin, *outs, start, neox, H, KVH, hd)
        if fused:
            wgmma_qkv_rope(ws, xt, T, *args, start_dev=start_dev, rows=rows, bt=bt, kp=kp)
        else:
            y = (wgmma_q4k(ws[0], xt, T, bt=bt, kp=kp),) if layout == "q4k" else wgmma_pair(*ws, xt, T, bt=bt, kp=kp)
            y = cp.concatenate(y, axis=1) if len(y) > 1 else y[0]
            ops.rope.qkv_rope(y[:, :qd], y[:, qd:qd + kvd], y[:, qd + kvd:], (N, N, N), *args, start_dev=start_dev,
                              rows=rows)
        return [cp.asnumpy(o).view(np.uint16) for o in outs]

    want, got = run(False), run(True)
    for name, w, g in zip(("qout", "kc", "vc"), want, got):
        assert np.array_equal(w, g), f"{name}: {int(np.sum(w != g))} of {w.size} f16 words differ"


# The stream-K form (kernels_cu/wgmma_streamk.cuh, an A/B): (T, N, K, bt) and what the deal makes of it.
STREAMK_CASES = [
    (32, 1024, 4096, 32),      # 8 tiles x 16 super-blocks = 128 units, 128 blocks: each owner waits for 15
    (32, 22016, 4096, 32),     # llama2-7b's gate|up: 172 tiles over the whole GPU
    (20, 4096, 11008, 32),     # ragged tokens, 43 super-blocks a tile
    (100, 512, 2048, 32),      # four token tiles, the last ragged
    (64, 384, 3584, 64),       # 64-token tiles, 14 super-blocks
    (7, 128, 256, 32),         # one unit, one block
]


@pytest.mark.parametrize("kind", ["q4_k", "q6_k padded", "q6_k raw"])
@pytest.mark.parametrize("T,N,K,bt", STREAMK_CASES)
def test_wgmma_streamk_vs_oracle(rng, kind, T, N, K, bt):
    """Every output of the stream-K form within the oracle's bound (every tile written once, by
    its owner, with every partial added), and a rerun gives the same bits (partials added in
    block order, the arrival flags left zero for the next launch)."""
    _sm90()
    import cupy as cp

    from engine.gpu.ops.wgmma import STREAMK, wgmma_q4k, wgmma_q6k
    from engine.gpu.ops.wgmma import tile_x16 as gpu_tile
    from engine.gpu.weights import upload_weight

    fmt = kind.split()[0]
    w = random_blocks(rng, fmt, N, K, special=True)
    wd = upload_weight(w, fmt.upper(), **({} if fmt == "q4_k" else {"pad_q6k": kind.endswith("padded")}))
    gemm, w16 = (wgmma_q4k, dequant_q4_k_f16(w)) if fmt == "q4_k" else (wgmma_q6k, dequant_q6_k_f16(w))
    x = rng.standard_normal((T, K)).astype(np.float32)
    xt = gpu_tile(cp.asarray(x))
    y = _run_poisoned(gemm, wd, xt, T, N, bt=bt, kp=STREAMK)
    _check_vs_oracle(f"wgmma streamk {kind}", y, w16, x, T=T, N=N, K=K, bt=bt)
    y2 = _run_poisoned(gemm, wd, xt, T, N, bt=bt, kp=STREAMK)
    assert np.array_equal(y.view(np.uint32), y2.view(np.uint32))


@pytest.mark.parametrize("T,F,K,bt", [(32, 11008, 4096, 32), (20, 512, 2816, 32), (64, 256, 4096, 64)])
def test_wgmma_streamk_swiglu_equals_gemm_then_swiglu_x16(rng, T, F, K, bt):
    """The stream-K SwiGLU epilogue == the stream-K q4_K GEMM then activation.swiglu_x16, bit for
    bit, where the two kernels get the same grid (the same occupancy: the same deal)."""
    _sm90()
    import cupy as cp

    from engine.gpu import kernels, launch, registry
    from engine.gpu.ops.activation import swiglu_x16
    from engine.gpu.ops.wgmma import FILE, STREAMK, THREADS, smem_bytes, tiled_buffer, wgmma_q4k, wgmma_swiglu
    from engine.gpu.ops.wgmma import tile_x16 as gpu_tile
    from engine.gpu.weights import upload_weight

    smem = smem_bytes(bt, registry.wgmma_stages(bt))
    occ = [launch.occupancy(kernels.get_kernel(FILE, name(bt, None, STREAMK), dynamic_smem=smem), THREADS, smem)
           for name in (registry.wgmma_instance, registry.wgmma_swiglu_instance)]
    if occ[0] != occ[1]:
        pytest.skip(f"the two stream-K kernels hold {occ} blocks an SM: different deals")
    wd = upload_weight(random_blocks(rng, "q4_k", 2 * F, K, special=True), "Q4_K")
    xt = gpu_tile(cp.asarray(rng.standard_normal((T, K)).astype(np.float32)))
    gu = cp.asarray(_run_poisoned(wgmma_q4k, wd, xt, T, 2 * F, bt=bt, kp=STREAMK))
    want = tiled_buffer(T, F)
    swiglu_x16(gu, gu[:, F:], 2 * F, F, want, T)
    got = tiled_buffer(T, F)
    wgmma_swiglu(wd, xt, T, out=got, bt=bt, kp=STREAMK)
    assert np.array_equal(cp.asnumpy(got).view(np.uint16), cp.asnumpy(want).view(np.uint16))



@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("T,Na,Nb,K", [(32, 8192, 4096, 4096), (20, 512, 256, 2816), (64, 256, 128, 1024)])
def test_wgmma_streamk_pair_vs_oracle(rng, padded, T, Na, Nb, K):
    """The stream-K pair (two deals in one grid: q4_K Wa and q6_K Wb, blocks in proportion to their
    units): both outputs within the oracle's bound, a rerun bit-equal."""
    _sm90()
    import cupy as cp

    from engine.gpu.ops.wgmma import wgmma_pair
    from engine.gpu.ops.wgmma import tile_x16 as gpu_tile
    from engine.gpu.weights import upload_weight

    wa = random_blocks(rng, "q4_k", Na, K, special=True)
    wb = random_blocks(rng, "q6_k", Nb, K, special=True)
    da, db = upload_weight(wa, "Q4_K"), upload_weight(wb, "Q6_K", pad_q6k=padded)
    x = rng.standard_normal((T, K)).astype(np.float32)
    xt = gpu_tile(cp.asarray(x))
    bt = 32 if T <= 32 else 64

    def run():
        ya, yb = (cp.full((T, n), np.nan, dtype=cp.float32) for n in (Na, Nb))
        wgmma_pair(da, db, xt, T, ya, yb, bt=bt, kp=STREAMK)
        return cp.asnumpy(ya), cp.asnumpy(yb)

    (ya, yb), (ya2, yb2) = run(), run()
    _check_vs_oracle("wgmma streamk pair a", ya, dequant_q4_k_f16(wa), x, T=T, N=Na, K=K, bt=bt)
    _check_vs_oracle("wgmma streamk pair b", yb, dequant_q6_k_f16(wb), x, T=T, N=Nb, K=K, bt=bt)
    assert np.array_equal(ya.view(np.uint32), ya2.view(np.uint32))
    assert np.array_equal(yb.view(np.uint32), yb2.view(np.uint32))
