"""The GPU prefill: each kernel against numpy, and the whole forward against the numpy reference.

Kernel checks (marker `gpu`; they also run on the CPU emulator tests/cuda_emu when that is
installed in place of cupy): outputs poisoned before each launch, fresh random inputs.
    embed            bit-identical to engine.formats.quants dequantization (q4_K, q6_K raw and padded)
    rmsnorm+q8_1     x + y exact; h within 2e-6 relative of reference.rms_norm; q, d and s
                     bit-identical to quantize_q8_1 of the kernel's own h
    rope             bit-identical to reference.apply_rope (+ bias, * qscale) rounded to f16;
                     cache rows outside start..start+n untouched
    attention        |o - ref| <= max|V| (2^-9 + 8 ln2 sqrt(hd) 2^-24 A) per element, ref = float64
                     softmax with P rounded to f16; A = the row's largest sum_i |q_i k_i|: the
                     scores are f32 sums of exact f16 products, off by about sqrt(hd) 2^-24 A
                     (4 sigma here), and a score and the row max both moving changes p by 2 ln2
                     times that (the Qwen2-like "big" cases, scores ~1e4, need it: 2^-9 alone
                     failed 1 emulated run in ~25); keys past the prompt poisoned with NaN;
                     scores up to ~1e4 stay finite
    swiglu+q8_1      |q d - silu(g) u| <= d/2 (+1e-6 relative), d within 1e-6 relative,
                     s = d * sum(q) exactly
Batched step (several sequences, rows shuffled, own positions and cache bases in one cache):
    rope varlen      q and cache rows bit-identical to the contiguous kernel per sequence;
                     cache rows of no token untouched
    attention varlen f32 and q8_1 outputs bit-identical to the one-sequence kernel per sequence
                     (1-query decode tiles, a two-tile sequence, zero padding tiles); the
                     attention bound above against the numpy oracle; rows of no sequence NaN

Whole model (marker `gpu`, real GPU only): logits vs engine.reference.model.ReferenceModel on the same
file. Error bound, relative Frobenius norm over the positions compared:
    ||gpu - ref|| / ||ref|| <= 2 x (the error of the same numerics in numpy: q8_1 GEMM inputs,
    f16 Q/K/V/P; tests/gpu_emulation.py), i.e. 2.5e-2 on the synthetic tiny models (emulated
    0.9-1.2e-2) and 5e-2 on the real-weight slice (emulated 2.1-2.5e-2: real activations have
    outlier channels, so a q8_1 block's step amax/127 is large next to its other values).
    q8_1 rounds each GEMM input to a step d = amax/127 per 32 values: error RMS d/sqrt(12) =
    amax * 2.3e-3, about 0.5% of a Gaussian block's RMS, over ~7 GEMMs per layer.
Top-1: the last-token logits (what forward returns) agree wherever the reference margin (top-1
minus top-2) is >= 0.5; over every position of a prompt, disagreements with margin >= 0.5 may
not exceed 0.2% of the positions (the q8_1 numerics alone give 3 of 3314 on the slice, at
margins 0.50-0.89: tests/gpu_emulation.py shows it on the CPU).
With GPU_REPORT=<file> each check appends one JSON line (scripts/prefill_summary.py prints them).
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.formats import quants as Q

ROOT = Path(__file__).resolve().parent.parent
SLICE = ROOT / ".gpu_data" / "slice.gguf"


def _report(**kw):
    path = os.environ.get("GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(kw) + "\n")


@pytest.fixture
def rng():
    """Fresh inputs each run; GGUF_PREFILL_TEST_SEED=N replays the run that printed `seed N`."""
    seed = int(os.environ.get("GGUF_PREFILL_TEST_SEED") or int.from_bytes(os.urandom(8), "little"))
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def _real_gpu(cp):
    if getattr(cp, "__emulated__", False):
        pytest.skip("whole-model checks need the real GPU (the MMQ kernels have no emulation)")


def _rand_blocks(rng, kind, rows, K):
    bb = Q.Q4_K_BYTES if kind == "q4_k" else Q.Q6_K_BYTES
    offs = (0, 2) if kind == "q4_k" else (208,)
    b = rng.integers(0, 256, (rows * (K // 256), bb), dtype=np.uint8)
    for off in offs:
        v = rng.uniform(-0.05, 0.05, b.shape[0]).astype("<f2")
        b[:, off:off + 2] = v.view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


def _q8(cp, T, K):
    from engine.gpu.ops.q8 import Q8Act

    q = cp.full((T, K), 0x55, dtype=cp.int8)
    ds = cp.full((T, K // 32, 2), np.nan, dtype=cp.float32)
    return Q8Act(q, ds)


# ----------------------------------------------------------------------------- kernels

@pytest.mark.gpu
@pytest.mark.parametrize("kind,padded", [("q4_k", False), ("q6_k", False), ("q6_k", True)])
def test_embed_rows_bit_exact(cp, rng, kind, padded):
    from engine.gpu import ops
    from engine.gpu.weights import upload_weight

    V, K, n = 37, 512, 11
    rows = _rand_blocks(rng, kind, V, K)
    table = upload_weight(rows, kind.upper(), pad_q6k=padded)
    ids = rng.integers(0, V, n)
    x = cp.full((n, K), np.nan, dtype=cp.float32)
    ops.embed.embed(table, cp.asarray(ids.astype(np.int32)), x)
    ref = Q.dequantize_q4_k(rows[ids]) if kind == "q4_k" else Q.dequantize_q6_k(rows[ids])
    got = cp.asnumpy(x)
    mism = int(np.sum(got.view(np.uint32) != ref.view(np.uint32)))
    _report(test="prefill_embed", kind=kind, padded=padded, elements=int(ref.size), mismatches=mism)
    assert mism == 0


@pytest.mark.gpu
@pytest.mark.parametrize("K,with_y", [(512, True), (768, False), (1536, True), (4096, True)])
def test_add_rmsnorm_q8_1(cp, rng, K, with_y):
    from engine.gpu import ops
    from engine.reference.ops import rms_norm

    R, eps = 6, 1e-5
    x = (rng.standard_normal((R, K)) * rng.uniform(0.1, 30, (R, 1))).astype(np.float32)
    y = (rng.standard_normal((R, K)) * 2).astype(np.float32)
    w = rng.uniform(-2, 2, K).astype(np.float32)
    xd, yd = cp.asarray(x), cp.asarray(y)
    act = _q8(cp, R, K)
    hout = cp.full((R, K), np.nan, dtype=cp.float32)
    ops.norm.add_rmsnorm_q8_1(xd, yd if with_y else None, cp.asarray(w), eps, act, hout=hout)
    xs = x + y if with_y else x
    assert np.array_equal(cp.asnumpy(xd), xs)
    h = cp.asnumpy(hout)
    ref = rms_norm(xs, w, eps)
    rel = float(np.max(np.abs(h - ref) / (np.abs(ref) + 1e-30)))
    q, d, s = Q.quantize_q8_1(h)
    gq, gds = cp.asnumpy(act.q), cp.asnumpy(act.ds)
    qm = int(np.sum(gq != q))
    dm = int(np.sum(gds[..., 0].view(np.uint32) != d.view(np.uint32)))
    sm = int(np.sum(gds[..., 1].view(np.uint32) != s.view(np.uint32)))
    _report(test="prefill_rmsnorm", K=K, with_y=with_y, h_max_rel=rel, q_mismatches=qm,
            d_mismatches=dm, s_mismatches=sm)
    assert rel <= 2e-6
    assert qm == 0 and dm == 0 and sm == 0


@pytest.mark.gpu
@pytest.mark.parametrize("R,K,with_y", [(6, 512, True), (13, 4096, True), (9, 768, False)])
def test_add_rmsnorm_x16(cp, rng, R, K, with_y):
    """The tiled f16 operand of the Hopper GEMMs: bit for bit the f16 of add_rmsnorm_q8_1's own
    h (its hout) in engine.reference.wgmma.tile_x16's layout, rows past R zero; the add the same."""
    from engine.gpu import ops
    from engine.gpu.ops.wgmma import tiled_buffer
    from engine.reference.wgmma import tile_x16

    eps = 1e-5
    x = (rng.standard_normal((R, K)) * rng.uniform(0.1, 30, (R, 1))).astype(np.float32)
    y = (rng.standard_normal((R, K)) * 2).astype(np.float32)
    w = rng.uniform(-2, 2, K).astype(np.float32)
    x1, x2 = cp.asarray(x), cp.asarray(x)
    hout = cp.full((R, K), np.nan, dtype=cp.float32)
    ops.norm.add_rmsnorm_q8_1(x1, cp.asarray(y) if with_y else None, cp.asarray(w), eps, _q8(cp, R, K), hout=hout)
    xt = tiled_buffer(R, K)
    ops.norm.add_rmsnorm_x16(x2, cp.asarray(y) if with_y else None, cp.asarray(w), eps, xt)
    assert np.array_equal(cp.asnumpy(x1), cp.asnumpy(x2))
    want = tile_x16(cp.asnumpy(hout)).view(np.uint16)
    mism = int(np.sum(cp.asnumpy(xt).view(np.uint16) != want))
    _report(test="prefill_rmsnorm_x16", R=R, K=K, with_y=with_y, mismatches=mism)
    assert mism == 0


@pytest.mark.gpu
@pytest.mark.parametrize("fused,T,F", [(True, 5, 512), (False, 11, 768)])
def test_swiglu_x16(cp, rng, fused, T, F):
    """silu(g) * u as the tiled f16 operand: within one f16 rounding of numpy's float32 h (the
    kernel's expf is CUDA's), tokens past T zero."""
    from engine.gpu import ops
    from engine.gpu.ops.wgmma import tiled_buffer
    from engine.reference.ops import silu
    from engine.reference.wgmma import tile_x16

    g = (rng.standard_normal((T, F)) * 4).astype(np.float32)
    u = (rng.standard_normal((T, F)) * 2).astype(np.float32)
    g[0, :40] = -200.0
    xt = tiled_buffer(T, F)
    if fused:
        gu = cp.asarray(np.concatenate([g, u], axis=1))
        ops.activation.swiglu_x16(gu[:, :F], gu[:, F:], 2 * F, F, xt, T)
    else:
        ops.activation.swiglu_x16(cp.asarray(g), cp.asarray(u), F, F, xt, T)
    h = silu(g) * u
    got = cp.asnumpy(xt).astype(np.float64)
    want16 = tile_x16(h)
    ulp = np.spacing(np.abs(want16)).astype(np.float64)                 # one f16 step at |want|
    err = float(np.max(np.abs(got - want16.astype(np.float64)) - ulp))
    _report(test="prefill_swiglu_x16", fused=fused, T=T, F=F, excess_over_ulp=err)
    assert np.isfinite(got).all()
    assert err <= 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("fused,T,F", [(True, 5, 512), (False, 5, 512), (True, 3, 96)])
def test_swiglu_q8_1(cp, rng, fused, T, F):
    from engine.gpu import ops
    from engine.reference.ops import silu

    g = (rng.standard_normal((T, F)) * 4).astype(np.float32)
    u = (rng.standard_normal((T, F)) * 2).astype(np.float32)
    g[0, :40] = -200.0                       # exp(-g) overflows: silu -> -0
    act = _q8(cp, T, F)
    if fused:
        gu = cp.asarray(np.concatenate([g, u], axis=1))
        ops.activation.swiglu_q8_1(gu[:, :F], gu[:, F:], 2 * F, F, act)
    else:
        ops.activation.swiglu_q8_1(cp.asarray(g), cp.asarray(u), F, F, act)
    h = silu(g) * u
    _, d, _ = Q.quantize_q8_1(h)
    gq, gds = cp.asnumpy(act.q), cp.asnumpy(act.ds)
    gd = gds[..., 0]
    deq = Q.dequantize_q8_1(gq, gd)
    dstep = np.repeat(gd, 32, axis=1)
    err = float(np.max(np.abs(deq - h) - dstep * (0.5 + 1e-6)))
    drel = float(np.max(np.abs(gd - d) / np.maximum(d, 1e-30)))
    sm = int(np.sum(gds[..., 1].view(np.uint32) != Q.q8_1_block_sum(gq, gd).view(np.uint32)))
    _report(test="prefill_swiglu", fused=fused, excess_over_half_step=err, d_max_rel=drel, s_mismatches=sm)
    assert np.isfinite(deq).all()
    assert err <= 1e-6 and drel <= 1e-6 and sm == 0


@pytest.mark.gpu
@pytest.mark.parametrize("rope_type,hd,bias", [("normal", 64, False), ("neox", 128, True), ("neox", 64, True)])
def test_qkv_rope_bit_exact(cp, rng, rope_type, hd, bias):
    from dataclasses import replace

    from engine.gpu import ops
    from engine.formats.config import ModelConfig
    from engine.formats.rope import rope_tables
    from engine.reference.ops import apply_rope

    H, KVH, n, start, maxT = 4, 2, 5, 3, 16
    cfg = ModelConfig("llama", 1, H * hd, H, KVH, hd, 256, 10, 64, 1e4 if rope_type == "normal" else 1e6,
                      rope_type, 1e-5, bias, False)
    qd, kvd = H * hd, KVH * hd
    qkv = (rng.standard_normal((n, qd + 2 * kvd)) * 3).astype(np.float32)
    b = [(rng.standard_normal(c) * 50).astype(np.float32) if bias else None for c in (qd, kvd, kvd)]
    cos, sin = rope_tables(cfg, np.arange(start, start + n))
    d = cp.asarray(qkv)
    qout = cp.full((H, n, hd), np.nan, dtype=cp.float16)
    kc = cp.full((KVH, maxT, hd), np.nan, dtype=cp.float16)
    vc = cp.full((KVH, maxT, hd), np.nan, dtype=cp.float16)
    ld = qd + 2 * kvd
    cos_all, sin_all = rope_tables(cfg, np.arange(start + n))        # the kernel reads rows start..
    ops.rope.qkv_rope(d[:, :qd], d[:, qd:qd + kvd], d[:, qd + kvd:], (ld, ld, ld),
               *[None if x is None else cp.asarray(x) for x in b], cp.asarray(cos_all), cp.asarray(sin_all),
               qout, kc, vc, start, rope_type == "neox", H, KVH, hd)
    q, k, v = qkv[:, :qd], qkv[:, qd:qd + kvd], qkv[:, qd + kvd:]
    if bias:
        q, k, v = q + b[0], k + b[1], v + b[2]
    qs = np.float32(math.log2(math.e) / math.sqrt(hd))
    rq = (apply_rope(q.reshape(n, H, hd), cos, sin, rope_type) * qs).astype(np.float16).transpose(1, 0, 2)
    rk = apply_rope(k.reshape(n, KVH, hd), cos, sin, rope_type).astype(np.float16).transpose(1, 0, 2)
    rv = v.reshape(n, KVH, hd).astype(np.float16).transpose(1, 0, 2)
    gq, gk, gv = cp.asnumpy(qout), cp.asnumpy(kc), cp.asnumpy(vc)
    mism = int(np.sum(gq.view(np.uint16) != rq.view(np.uint16)))
    mism += int(np.sum(gk[:, start:start + n].view(np.uint16) != rk.view(np.uint16)))
    mism += int(np.sum(gv[:, start:start + n].view(np.uint16) != rv.view(np.uint16)))
    outside = np.concatenate([gk[:, :start], gk[:, start + n:], gv[:, :start], gv[:, start + n:]], axis=1)
    _report(test="prefill_rope", rope_type=rope_type, hd=hd, bias=bias, mismatches=mism,
            outside_touched=int(np.sum(~np.isnan(outside.astype(np.float32)))))
    assert mism == 0
    assert np.isnan(outside.astype(np.float32)).all()


def _attention_inputs(rng, H, KVH, hd, n, start, maxT, big=False):
    L = start + n
    q = rng.standard_normal((H, n, hd)).astype(np.float32) * (math.log2(math.e) / math.sqrt(hd))
    k = rng.standard_normal((KVH, maxT, hd)).astype(np.float32)
    v = rng.standard_normal((KVH, maxT, hd)).astype(np.float32) * 3
    if big:                      # Qwen2-like: a large bias on a few dims -> scores ~ 1e4
        k[:, :, :4] += 300.0
        q[:, :, :4] *= 40.0
    k[:, L:] = np.nan            # past the prompt: never to be read
    v[:, L:] = np.nan
    return q.astype(np.float16), k.astype(np.float16), v.astype(np.float16)


def _attention_bound(q, k, start: int, vmax: float) -> np.ndarray:
    """The per-element bound of test_attention_prefill (module docstring) for q f16 [H, n, hd]
    over k f16 [KVH, >= start + n, hd], laid out as the output [n, H * hd]."""
    H, n, hd = q.shape
    G, L = H // k.shape[0], start + n
    qa = np.abs(q.astype(np.float64))
    ka = np.abs(np.nan_to_num(k[:, :L].astype(np.float64)))
    later = np.arange(L)[None, :] > (start + np.arange(n))[:, None]     # masked keys
    A = np.empty((n, H))
    for h in range(H):
        a = qa[h] @ ka[h // G].T
        a[later] = 0.0
        A[:, h] = a.max(axis=1)
    return np.repeat(vmax * (2.0 ** -9 + 8 * math.log(2) * math.sqrt(hd) * 2.0 ** -24 * A), hd, axis=1)


def _variant_runs(cp, variant):
    """Skip a prefill attention variant this GPU cannot run (wgmma: sm_90; the emulator runs both)."""
    if variant.startswith("wgmma") and not getattr(cp, "__emulated__", False) \
            and cp.cuda.Device().compute_capability != "90":
        pytest.skip("attention_wgmma.cu needs an sm_90 GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fa2", "wgmma"])
@pytest.mark.parametrize("hd,H,KVH,n,start,big", [
    (64, 4, 2, 1, 0, False), (64, 4, 2, 7, 0, False), (128, 4, 1, 65, 0, False),
    (64, 2, 2, 70, 61, True), (128, 4, 2, 130, 3, True), (128, 7, 1, 200, 70, False),
    (128, 2, 1, 140, 300, False), (128, 2, 1, 100, 700, False), (128, 4, 2, 640, 0, False),
    (128, 8, 8, 300, 20, False)])
def test_attention_prefill(cp, rng, hd, H, KVH, n, start, big, variant):
    """Each prefill attention kernel (attention_prefill.cu mma.sync, attention_wgmma.cu Hopper)
    against the numpy oracle within the attention bound, f32 and q8_1 outputs (module docstring)."""
    from engine.gpu import ops
    from engine.reference.numerics import attention_f16 as attention_numpy

    _variant_runs(cp, variant)
    emulated = getattr(cp, "__emulated__", False)
    maxT = start + n + 9
    q, k, v = _attention_inputs(rng, H, KVH, hd, n, start, maxT, big)
    kf = k.copy()
    vf = v.copy()
    kf[:, start + n:] = 0
    vf[:, start + n:] = 0
    ref = attention_numpy(q, kf, vf, start)
    qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    out = cp.full((n, H * hd), np.nan, dtype=cp.float32)
    ops.attention.attention_prefill(qd, kd, vd, start, out_f32=out, variant=variant)
    o = cp.asnumpy(out)
    vmax = float(np.nanmax(np.abs(v[:, :start + n].astype(np.float32))))
    bound = _attention_bound(q, k, start, vmax)
    err = float(np.max(np.abs(o - ref) / bound)) if np.isfinite(o).all() else float("inf")
    act = _q8(cp, n, H * hd)
    ops.attention.attention_prefill(qd, kd, vd, start, out_act=act, variant=variant)
    gq, gds = cp.asnumpy(act.q), cp.asnumpy(act.ds)
    deq = Q.dequantize_q8_1(gq, gds[..., 0])
    step = np.repeat(gds[..., 0], 32, axis=1)
    q8_excess = float(np.max(np.abs(deq - o) - step * (0.5 + 1e-6)))
    sm = int(np.sum(gds[..., 1].view(np.uint32) != Q.q8_1_block_sum(gq, gds[..., 0]).view(np.uint32)))
    x16_mism = _x16_mismatches(cp, out, lambda xt: ops.attention.attention_prefill(qd, kd, vd, start, out_x16=xt,
                                                                                    variant=variant))
    _report(test="prefill_attention", variant=variant, hd=hd, H=H, KVH=KVH, n=n, start=start, big=big, emulated=emulated,
            max_err_over_bound=err, q8_excess=q8_excess, s_mismatches=sm, x16_mismatches=x16_mism)
    assert np.isfinite(o).all()
    assert err <= 1.0
    assert q8_excess <= 1e-6 * vmax and sm == 0
    assert x16_mism == 0


@pytest.mark.gpu
def test_attention_define_sets_in_one_process(cp, rng, monkeypatch):
    """GGUF_PREFILL_KERNEL_DEFINES changed between launches in one process (dev/attn_bench and
    dev/ab_bench --defines / --sets): each set gets its own build of attention_wgmma.cu, and the
    forms that only move work between warpgroups or blocks (the producer warpgroup, the heads
    sent out in groups) give the default's bits."""
    from engine.gpu import kernels, ops, registry

    _variant_runs(cp, "wgmma")
    H, KVH, hd, n, start = 4, 4, 128, 300, 40
    q, k, v = _attention_inputs(rng, H, KVH, hd, n, start, start + n)
    qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    outs, builds = [], []
    for defines in ("", "AW_PROD=0", "AW_MHA_GROUP=2", ""):
        monkeypatch.setenv("GGUF_PREFILL_KERNEL_DEFINES", defines)
        out = cp.full((n, H * hd), np.nan, dtype=cp.float32)
        ops.attention.attention_prefill(qd, kd, vd, start, out_f32=out, variant="wgmma")
        outs.append(cp.asnumpy(out))
        builds.append(kernels.get_kernel("attention_wgmma.cu", registry.attn_wgmma_name(hd, "f32")))
    assert len({id(b) for b in builds}) == 3 and builds[3] is builds[0]
    for o in outs[1:]:
        assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32))


def _x16_mismatches(cp, out_f32, run):
    """The out_x16 form against the tiling oracle (engine.reference.wgmma.tile_x16, which
    wgmma_tile_x16 matches bit for bit) of the f32 output: f16 values that differ in their bits
    over tokens < T, plus values written into the padding tokens (left poisoned); 0 where the
    columns are no whole 256-column super-blocks (no x16 operand then)."""
    from engine.gpu.ops.wgmma import tiled_shape
    from engine.reference.wgmma import tile_x16

    T, K = map(int, out_f32.shape)
    if K % 256:
        return 0
    xt = cp.full(tiled_shape(T, K), 0x7E01, dtype=cp.uint16).view(cp.float16)   # a NaN no kernel writes
    run(xt)
    got = cp.asnumpy(xt).view(np.uint16)
    want = tile_x16(cp.asnumpy(out_f32)).view(np.uint16)
    tok = (np.arange(got.shape[1])[None, :, None, None, None] * 8 + np.arange(8)[None, None, None, :, None]
           + np.zeros(got.shape, dtype=np.int64))
    return int(np.sum((got != want)[tok < T])) + int(np.sum(got[tok >= T] != 0x7E01))


def test_default_ubatch(monkeypatch):
    """The prompt ubatch: DEFAULT_UBATCH, or GGUF_PREFILL_UBATCH; a bad value is a named error."""
    from engine.errors import GGUFError
    from engine.gpu.ubatch_plan import DEFAULT_UBATCH, default_ubatch

    monkeypatch.delenv("GGUF_PREFILL_UBATCH", raising=False)
    assert default_ubatch() == DEFAULT_UBATCH
    monkeypatch.setenv("GGUF_PREFILL_UBATCH", "8192")
    assert default_ubatch() == 8192
    for bad in ("0", "-5", "4k"):
        monkeypatch.setenv("GGUF_PREFILL_UBATCH", bad)
        with pytest.raises(GGUFError, match="GGUF_PREFILL_UBATCH"):
            default_ubatch()


def test_prefill_variant_rule(monkeypatch):
    """The production prefill attention: wgmma on sm_90 from ATT_WGMMA_MIN_QUERIES queries, fa2
    below and on other GPUs; GGUF_PREFILL_ATTN=fa2 forces fa2, =wgmma asks for it at any size
    (still fa2 off sm_90), an unknown value is a named error."""
    import types

    from engine.errors import GGUFError
    from engine.gpu.ops.attention import ATT_WGMMA_MIN_QUERIES as MINQ, prefill_variant

    def gpu(cc):
        dev = types.SimpleNamespace(compute_capability=cc)
        monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: dev)))

    monkeypatch.delenv("GGUF_PREFILL_ATTN", raising=False)
    gpu("90")
    assert prefill_variant() == prefill_variant(MINQ) == prefill_variant(8192) == "wgmma"
    assert prefill_variant(MINQ - 1) == prefill_variant(1) == "fa2"
    gpu("89")
    assert prefill_variant() == prefill_variant(8192) == "fa2"
    monkeypatch.setenv("GGUF_PREFILL_ATTN", "wgmma")
    assert prefill_variant() == "fa2"
    gpu("90")
    assert prefill_variant() == prefill_variant(32) == "wgmma"
    monkeypatch.setenv("GGUF_PREFILL_ATTN", "fa2")
    assert prefill_variant() == prefill_variant(8192) == "fa2"
    monkeypatch.setenv("GGUF_PREFILL_ATTN", "flash")
    with pytest.raises(GGUFError, match="GGUF_PREFILL_ATTN"):
        prefill_variant()


# ----------------------------------------------------------------------------- batched step (varlen)

def test_varlen_tiles_host():
    """The tiles of a batch: each sequence cut as the one-sequence kernel cuts it, the longest
    key range first, zero tiles up to the grid; the grid bound holds for every split of T rows."""
    from engine.gpu.ops.attention import varlen_max_tiles, varlen_tiles

    t = varlen_tiles([(1, 70, 5, 0), (0, 1, 40, 80), (72, 3, 0, 130), (71, 1, 0, 140), (75, 0, 9, 150)], n_tiles=7)
    assert t.dtype == np.int32 and t.shape == (7, 4)
    assert t.tolist() == [[65, 6, 69, 0], [1, 64, 5, 0], [0, 1, 40, 80], [72, 3, 0, 130], [71, 1, 0, 140],
                          [0, 0, 0, 0], [0, 0, 0, 0]]
    assert varlen_tiles([]).shape == (0, 4)
    assert varlen_tiles([(0, 128, 0, 0)]).tolist() == [[64, 64, 64, 0], [0, 64, 0, 0]]
    with pytest.raises(ValueError):
        varlen_tiles([(0, 129, 0, 0)], n_tiles=2)
    with pytest.raises(ValueError):
        varlen_tiles([(0, 3, -1, 0)])
    rng = np.random.default_rng(0)
    for _ in range(300):
        E = int(rng.integers(1, 9))
        T = int(rng.integers(E, 600))
        cuts = np.sort(rng.choice(np.arange(1, T), E - 1, replace=False)) if E > 1 else np.array([], int)
        ns = np.diff(np.concatenate([[0], cuts, [T]]))
        need = len(varlen_tiles([(0, int(n), 0, 0) for n in ns]))
        assert need <= varlen_max_tiles(T, E) <= min(T, T // 64 + E)
    assert varlen_max_tiles(196, 4) == 7 == len(varlen_tiles([(0, 65, 0, 0)] * 3 + [(0, 1, 0, 0)]))
    assert varlen_max_tiles(64, 2) == 2 and varlen_max_tiles(3, 8) == 3


def test_varlen_plan_host():
    """The one-query tiles of a batch become decode rows (row, keys, kvbase, 0): a decode token
    and the 1-query tail of a 65-query prompt; the rest stay tiles; both padded to the grid."""
    from engine.gpu.ops.attention import varlen_max_multi_tiles, varlen_plan

    tiles, rows = varlen_plan([(0, 65, 10, 0), (65, 1, 40, 100), (66, 2, 0, 200)], n_tiles=4, n_rows=3)
    assert tiles.tolist() == [[0, 64, 10, 0], [66, 2, 0, 200], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert rows.tolist() == [[64, 75, 0, 0], [65, 41, 100, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError):
        varlen_plan([(0, 1, 0, 0), (1, 1, 0, 9)], n_tiles=1, n_rows=1)
    rng = np.random.default_rng(1)
    for _ in range(300):                       # the fixed grids of a step of T rows, E sequences
        E = int(rng.integers(1, 9))
        T = int(rng.integers(E, 600))
        cuts = np.sort(rng.choice(np.arange(1, T), E - 1, replace=False)) if E > 1 else np.array([], int)
        ns = np.diff(np.concatenate([[0], cuts, [T]]))
        varlen_plan([(0, int(n), 0, 0) for n in ns], varlen_max_multi_tiles(T, E), E)
    assert varlen_max_multi_tiles(1, 1) == 0 and varlen_max_multi_tiles(32, 32) == 16


def _varlen_batch(rng, seqs):
    """Shuffled batch rows of sequences (n, start, kvbase): per batch row its (sequence, index)."""
    owner = [(s, i) for s, (n, _, _) in enumerate(seqs) for i in range(n)]
    perm = rng.permutation(len(owner))
    return [owner[j] for j in perm]


@pytest.mark.gpu
@pytest.mark.parametrize("rope_type,hd,bias", [("normal", 64, False), ("neox", 128, True)])
def test_qkv_rope_varlen(cp, rng, rope_type, hd, bias):
    """rows=(pos, row): a batch of 3 sequences (own starts and cache bases), rows shuffled;
    q rows and cache rows bit-identical to the contiguous kernel run per sequence; cache rows of
    no token untouched."""
    from engine.gpu import ops
    from engine.formats.config import ModelConfig
    from engine.formats.rope import rope_tables

    H, KVH, maxT = 2, 1, 48
    seqs = [(5, 3, 0), (1, 10, 20), (4, 0, 36)]            # (n, start, kvbase)
    cfg = ModelConfig("llama", 1, H * hd, H, KVH, hd, 256, 10, 64, 1e4 if rope_type == "normal" else 1e6,
                      rope_type, 1e-5, bias, False)
    qd, kvd = H * hd, KVH * hd
    ld = qd + 2 * kvd
    P = max(st + n for n, st, _ in seqs)
    cos, sin = (cp.asarray(x) for x in rope_tables(cfg, np.arange(P)))
    b = [cp.asarray((rng.standard_normal(c) * 50).astype(np.float32)) if bias else None for c in (qd, kvd, kvd)]
    per = [(rng.standard_normal((n, ld)) * 3).astype(np.float32) for n, _, _ in seqs]
    order = _varlen_batch(rng, seqs)
    T = len(order)
    qkv = np.stack([per[s][i] for s, i in order])
    pos = np.array([seqs[s][1] + i for s, i in order], dtype=np.int32)
    row = np.array([seqs[s][2] + seqs[s][1] + i for s, i in order], dtype=np.int32)
    d = cp.asarray(qkv)
    qout = cp.full((H, T, hd), np.nan, dtype=cp.float16)
    kc = cp.full((KVH, maxT, hd), np.nan, dtype=cp.float16)
    vc = cp.full((KVH, maxT, hd), np.nan, dtype=cp.float16)
    ops.rope.qkv_rope(d[:, :qd], d[:, qd:qd + kvd], d[:, qd + kvd:], (ld, ld, ld), *b, cos, sin, qout, kc, vc, 0,
                      rope_type == "neox", H, KVH, hd, rows=(cp.asarray(pos), cp.asarray(row)))
    gq, gk, gv = cp.asnumpy(qout), cp.asnumpy(kc), cp.asnumpy(vc)
    mism, written = 0, np.zeros(maxT, bool)
    for s, (n, st, base) in enumerate(seqs):
        ds = cp.asarray(per[s])
        sq = cp.full((H, n, hd), np.nan, dtype=cp.float16)
        sk = cp.full((KVH, st + n, hd), np.nan, dtype=cp.float16)
        sv = cp.full((KVH, st + n, hd), np.nan, dtype=cp.float16)
        ops.rope.qkv_rope(ds[:, :qd], ds[:, qd:qd + kvd], ds[:, qd + kvd:], (ld, ld, ld), *b, cos, sin, sq, sk, sv,
                          st, rope_type == "neox", H, KVH, hd)
        sq, sk, sv = cp.asnumpy(sq), cp.asnumpy(sk), cp.asnumpy(sv)
        rows_t = [t for t, (o, _) in enumerate(order) if o == s]
        idx = [order[t][1] for t in rows_t]
        mism += int(np.sum(gq[:, rows_t].view(np.uint16) != sq[:, idx].view(np.uint16)))
        mism += int(np.sum(gk[:, base + st:base + st + n].view(np.uint16) != sk[:, st:].view(np.uint16)))
        mism += int(np.sum(gv[:, base + st:base + st + n].view(np.uint16) != sv[:, st:].view(np.uint16)))
        written[base + st:base + st + n] = True
    untouched = bool(np.isnan(gk[:, ~written].astype(np.float32)).all() and
                     np.isnan(gv[:, ~written].astype(np.float32)).all())
    _report(test="prefill_rope_varlen", rope_type=rope_type, hd=hd, bias=bias, mismatches=mism, untouched=untouched)
    assert mism == 0
    assert untouched
    with pytest.raises(ValueError):                        # rows take the positions: no start
        ops.rope.qkv_rope(d[:, :qd], d[:, qd:qd + kvd], d[:, qd + kvd:], (ld, ld, ld), *b, cos, sin, qout, kc, vc,
                          1, rope_type == "neox", H, KVH, hd, rows=(cp.asarray(pos), cp.asarray(row)))
    with pytest.raises(ValueError):
        ops.rope.qkv_rope(d[:, :qd], d[:, qd:qd + kvd], d[:, qd + kvd:], (ld, ld, ld), *b, cos, sin, qout, kc, vc,
                          0, rope_type == "neox", H, KVH, hd, rows=(cp.asarray(pos[:-1]), cp.asarray(row[:-1])))


def _varlen_case(rng, hd, H, KVH, seqs=((70, 5, 0), (1, 40, 80), (3, 0, 130), (1, 0, 140)), maxT=150):
    """A batched step's attention inputs: sequences (n, start, kvbase) in one cache (NaN
    outside their keys), their rows in the batch in blocks of a fixed order; (seqs, row0 per
    sequence, T, q f16 [H, T, hd], kc, vc)."""
    scale = math.log2(math.e) / math.sqrt(hd)
    kc = np.full((KVH, maxT, hd), np.nan, dtype=np.float16)
    vc = np.full((KVH, maxT, hd), np.nan, dtype=np.float16)
    for n, st, base in seqs:
        kc[:, base:base + st + n] = rng.standard_normal((KVH, st + n, hd))
        vc[:, base:base + st + n] = rng.standard_normal((KVH, st + n, hd)) * 3
    order = list(range(len(seqs)))[::-1]                  # sequences' blocks of rows in the batch
    row0, r = {}, 0
    for s in order:
        row0[s] = r
        r += seqs[s][0]
    q = (rng.standard_normal((H, r, hd)) * scale).astype(np.float16)
    return list(seqs), row0, r, q, kc, vc


@pytest.mark.gpu
@pytest.mark.parametrize("hd,H,KVH,n_sm", [(64, 2, 1, 132), (128, 4, 1, 132), (128, 8, 2, 1), (64, 7, 1, 132)])
def test_attention_varlen_decode_rows(cp, rng, hd, H, KVH, n_sm):
    """varlen_plan's split of a batch: its tiles of 2+ queries give the bits of the tiles-only
    launch; its one-query tiles (two decode tokens, the 1-query tail of a 65-query prompt) go
    through attention_decode.cu's varlen split + combine (n_sm 132: many key splits; 1: one),
    within test_attention_prefill's bound of the numpy oracle, q8_1 output consistent with the
    f32 one (s = d * sum q exactly); padding rows write nothing."""
    from engine.gpu import ops
    from engine.gpu.ops.attention import VarlenDecode, varlen_max_tiles, varlen_plan, varlen_tiles
    from engine.reference.numerics import attention_f16 as attention_numpy

    seqs, row0, T, q, kc, vc = _varlen_case(rng, hd, H, KVH, seqs=((65, 5, 0), (1, 140, 80), (3, 0, 230),
                                                                    (1, 0, 240), (1, 33, 250)), maxT=300)
    spec = [(row0[s], n, st, base) for s, (n, st, base) in enumerate(seqs)]
    n_tiles, R = varlen_max_tiles(T, len(seqs)) + 1, len(seqs) + 2
    tiles, drows = varlen_plan(spec, n_tiles, R)
    assert (drows[:, 1] > 0).sum() == 4 and (tiles[:, 1] == 1).sum() == 0
    qd, kd, vd = cp.asarray(q), cp.asarray(kc), cp.asarray(vc)
    dec = VarlenDecode(cp.asarray(drows), H, KVH, hd, n_sm=n_sm)
    assert (dec.n_split > 1) == (n_sm > 1)
    out = cp.full((T + 2, H * hd), np.nan, dtype=cp.float32)[:T]        # rows past T: never written
    ops.attention.attention_varlen(qd, kd, vd, cp.asarray(tiles), out_f32=out, decode=dec)
    act = _q8(cp, T, H * hd)
    ops.attention.attention_varlen(qd, kd, vd, cp.asarray(tiles), out_act=act, decode=dec)
    whole = cp.full((T, H * hd), np.nan, dtype=cp.float32)
    ops.attention.attention_varlen(qd, kd, vd, cp.asarray(varlen_tiles(spec)), out_f32=whole)
    o, w, gq, gds = cp.asnumpy(out), cp.asnumpy(whole), cp.asnumpy(act.q), cp.asnumpy(act.ds)
    one = {int(r[0]) for r in drows if r[1] > 0}
    multi = [t for t in range(T) if t not in one]
    mism = int(np.sum(o[multi].view(np.uint32) != w[multi].view(np.uint32)))
    err = 0.0
    for row, keys, base, _ in drows[drows[:, 1] > 0]:
        kf = kc[:, base:base + keys].astype(np.float32)
        ref = attention_numpy(q[:, row:row + 1], np.nan_to_num(kc[:, base:base + keys]),
                              np.nan_to_num(vc[:, base:base + keys]), keys - 1)
        vmax = float(np.max(np.abs(vc[:, base:base + keys].astype(np.float32))))
        e = float(np.max(np.abs(o[row] - ref[0]))) if np.isfinite(o[row]).all() and np.isfinite(kf).all() else float("inf")
        err = max(err, e / vmax)
        assert e <= vmax * 2 ** -9, (row, e, vmax)
    deq = Q.dequantize_q8_1(gq, gds[..., 0])
    step = np.repeat(gds[..., 0], 32, axis=1)
    q8_excess = float(np.max(np.abs(deq - o) - step * (0.5 + 1e-6)))
    sm = int(np.sum(gds[..., 1].view(np.uint32) != Q.q8_1_block_sum(gq, gds[..., 0]).view(np.uint32)))
    _report(test="attention_varlen_decode_rows", hd=hd, H=H, KVH=KVH, splits=dec.n_split, mismatches=mism,
            max_err_over_vmax=err, bound=2 ** -9, q8_excess=q8_excess, s_mismatches=sm)
    assert np.isfinite(o).all() and mism == 0
    assert q8_excess <= 1e-6 * float(np.max(np.abs(o))) and sm == 0


@pytest.mark.gpu
@pytest.mark.parametrize("hd,H,KVH", [(64, 2, 1), (128, 2, 1)])
def test_attention_varlen(cp, rng, hd, H, KVH):
    """A batched step: a 70-query sequence (two tiles), a 3-query one, two decode tokens (1-query
    tiles), own starts and cache bases in one cache, batch rows shuffled per sequence block,
    zero tiles padding the grid. f32 and q8_1 outputs bit-identical to the one-sequence kernel
    run per sequence (over a copy of its cache rows), the x16 output to the tiling of the f32
    one; f32 within test_attention_prefill's bound of the numpy oracle. Cache rows outside every
    sequence's keys hold NaN (never read)."""
    from engine.gpu import ops
    from engine.gpu.ops.attention import varlen_max_tiles, varlen_tiles
    from engine.reference.numerics import attention_f16 as attention_numpy

    seqs, row0, T, q, kc, vc = _varlen_case(rng, hd, H, KVH)
    n_tiles = varlen_max_tiles(T, len(seqs)) + 2
    tiles = varlen_tiles([(row0[s], n, st, base) for s, (n, st, base) in enumerate(seqs)], n_tiles=n_tiles)
    assert (tiles[:, 1] == 0).sum() >= 2
    qd, kd, vd, td = cp.asarray(q), cp.asarray(kc), cp.asarray(vc), cp.asarray(tiles)
    out = cp.full((T, H * hd), np.nan, dtype=cp.float32)
    ops.attention.attention_varlen(qd, kd, vd, td, out_f32=out)
    act = _q8(cp, T, H * hd)
    ops.attention.attention_varlen(qd, kd, vd, td, out_act=act)
    o, gq, gds = cp.asnumpy(out), cp.asnumpy(act.q), cp.asnumpy(act.ds)
    mism = _x16_mismatches(cp, out, lambda xt: ops.attention.attention_varlen(qd, kd, vd, td, out_x16=xt))
    err = 0.0
    for s, (n, st, base) in enumerate(seqs):
        rows = slice(row0[s], row0[s] + n)
        L = st + n
        ks = np.full((KVH, L + 3, hd), np.nan, dtype=np.float16)
        vs = np.full((KVH, L + 3, hd), np.nan, dtype=np.float16)
        ks[:, :L], vs[:, :L] = kc[:, base:base + L], vc[:, base:base + L]
        qs = np.ascontiguousarray(q[:, rows])
        ksd, vsd, qsd = cp.asarray(ks), cp.asarray(vs), cp.asarray(qs)
        so = cp.full((n, H * hd), np.nan, dtype=cp.float32)
        ops.attention.attention_prefill(qsd, ksd, vsd, st, out_f32=so, variant="fa2")
        sa = _q8(cp, n, H * hd)
        ops.attention.attention_prefill(qsd, ksd, vsd, st, out_act=sa, variant="fa2")
        so = cp.asnumpy(so)
        mism += int(np.sum(o[rows].view(np.uint32) != so.view(np.uint32)))
        mism += int(np.sum(gq[rows] != cp.asnumpy(sa.q)))
        mism += int(np.sum(gds[rows].view(np.uint32) != cp.asnumpy(sa.ds).view(np.uint32)))
        kf, vf = ks.copy(), vs.copy()
        kf[:, L:] = 0
        vf[:, L:] = 0
        ref = attention_numpy(qs, kf, vf, st)
        vmax = float(np.max(np.abs(vs[:, :L].astype(np.float32))))
        e = float(np.max(np.abs(so - ref))) if np.isfinite(so).all() else float("inf")
        err = max(err, e / vmax)
        assert e <= vmax * 2 ** -9, (s, e, vmax)
    _report(test="prefill_attention_varlen", hd=hd, H=H, KVH=KVH, tiles=int(n_tiles), mismatches=mism,
            max_err_over_vmax=err, bound=2 ** -9, emulated=bool(getattr(cp, "__emulated__", False)))
    assert np.isfinite(o).all()
    assert mism == 0
    with pytest.raises(ValueError):
        ops.attention.attention_varlen(qd, kd, vd, cp.asarray(tiles[:, :3].copy()), out_f32=out)


# ----------------------------------------------------------------------------- whole model

def _compare(tag, lg, lr, bound, last_only=False):
    """Relative Frobenius error, top-1 rules; returns the record (asserted by the caller)."""
    lg, lr = np.atleast_2d(lg), np.atleast_2d(lr)
    rel = float(np.linalg.norm(lg - lr) / np.linalg.norm(lr))
    srt = np.sort(lr, axis=1)
    margin = srt[:, -1] - srt[:, -2]
    agree = lg.argmax(1) == lr.argmax(1)
    viol = (~agree) & (margin >= 0.5)
    rec = dict(test="prefill_model", case=tag, positions=int(lr.shape[0]), rel_err=rel, bound=bound,
               finite=bool(np.isfinite(lg).all()), top1_agree=float(agree.mean()),
               viol_margin_ge_0_5=int(viol.sum()),
               worst_disagreeing_margin=float(margin[~agree].max()) if (~agree).any() else 0.0,
               last_margin=float(margin[-1]), last_agree=bool(agree[-1]),
               max_abs_err=float(np.max(np.abs(lg - lr))))
    _report(**rec)
    print(json.dumps(rec))
    return rec


def _check(rec):
    assert rec["finite"]
    assert rec["rel_err"] <= rec["bound"], rec
    if rec["last_margin"] >= 0.5:
        assert rec["last_agree"], rec
    assert rec["viol_margin_ge_0_5"] <= max(1, int(0.002 * rec["positions"])), rec


@pytest.fixture(scope="module")
def models(cp, tiny_model_path, tiny_qwen2_model_path):
    _real_gpu(cp)
    from engine.gpu.model import GPUModel
    from engine.reference.model import ReferenceModel
    from engine.formats.weights import open_model

    out = {}
    paths = {"tiny": tiny_model_path, "tiny-qwen2": tiny_qwen2_model_path}
    if SLICE.exists():
        paths["slice"] = str(SLICE)
    for name, p in paths.items():
        mf = open_model(p)
        out[name] = (mf, ReferenceModel(mf), GPUModel(mf))
    return out


BOUNDS = {"tiny": 2.5e-2, "tiny-qwen2": 2.5e-2, "slice": 5e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("n", [600, 40, 24])
@pytest.mark.parametrize("name", ["tiny-qwen2", "slice"])
def test_forward_hopper_vs_mmq(models, name, n):
    """sm_90: the same prompt with the layer GEMMs on wgmma (f16 operands; at 40 tokens one
    64-token tile with K split across clusters, at 24 a 32-token tile with the q|k|v GEMM's RoPE
    epilogue) and on MMQ (q8_1): both within the reference bound; the f16 route's error reported
    beside the q8_1 one. Under WG_STREAMK=1 the 24- and 40-token rows run the stream-K form."""
    import cupy as cp

    if cp.cuda.Device().compute_capability != "90":
        pytest.skip("the Hopper route needs sm_90")
    if name not in models:
        pytest.skip(f"{SLICE} missing")
    mf, ref, gpu = models[name]
    ids = np.random.default_rng(11).integers(0, mf.config.vocab_size, n)
    lr = ref.forward(ids, ref.new_cache(n), all_logits=True)
    saved = gpu.wgmma_min_tokens
    try:
        recs = {}
        for tag, m in (("mmq", None), ("wgmma", 1)):
            gpu.wgmma_min_tokens = m
            lg = gpu.forward(ids, gpu.new_cache(n), all_logits=True)
            recs[tag] = _compare(f"{name}-{n}-{tag}", lg, lr, BOUNDS[name])
    finally:
        gpu.wgmma_min_tokens = saved
    for rec in recs.values():
        _check(rec)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "slice"])
@pytest.mark.parametrize("n", [1, 7, 300, "ctx"])
def test_forward_vs_reference(models, name, n):
    if name not in models:
        pytest.skip(f"{SLICE} missing (make it with the slice verb; see the module docstring)")
    mf, ref, gpu = models[name]
    n = {"ctx": 2048 if name != "slice" else 3314}.get(n, n)
    rng = np.random.default_rng(n + len(name))
    ids = rng.integers(0, mf.config.vocab_size, n)
    lr = ref.forward(ids, ref.new_cache(n), all_logits=True)
    lg = gpu.forward(ids, gpu.new_cache(n), all_logits=True)
    last = gpu.forward(ids, gpu.new_cache(n))
    assert last.shape == (mf.config.vocab_size,) and last.dtype == np.float32
    rec = _compare(f"{name} n={n} all positions", lg, lr, BOUNDS[name])
    _check(rec)
    rec_last = _compare(f"{name} n={n} last token (default output)", last, lr[-1], BOUNDS[name])
    _check(rec_last)


@pytest.mark.gpu
def test_forward_one_long_ubatch(models):
    """A 6,000-token prompt as one ubatch (the default ubatch is 8,192: ubatch_plan) and split
    at 4,096: both within the bound of the reference, every position."""
    from engine.gpu.model import GPUModel

    mf, ref, gpu = models["tiny-qwen2"]
    assert gpu.ubatch >= 6000 and gpu.ubatch_bounds(6000) == [(0, 6000)]
    n = 6000
    ids = np.random.default_rng(11).integers(0, mf.config.vocab_size, n)
    lr = ref.forward(ids, ref.new_cache(n), all_logits=True)
    _check(_compare("tiny-qwen2 n=6000 one ubatch", gpu.forward(ids, gpu.new_cache(n), all_logits=True), lr,
                    BOUNDS["tiny-qwen2"]))
    split = GPUModel(mf, ubatch=4096)
    _check(_compare("tiny-qwen2 n=6000 ubatch=4096", split.forward(ids, split.new_cache(n), all_logits=True), lr,
                    BOUNDS["tiny-qwen2"]))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-qwen2", "slice"])
def test_forward_ubatches_and_continuation(models, name):
    """Prompt split into ubatches of 256 and continued in a second forward: same bound."""
    if name not in models:
        pytest.skip(f"{SLICE} missing")
    from engine.gpu.model import GPUModel

    mf, ref, _ = models[name]
    gpu = GPUModel(mf, ubatch=256)
    n, cut = 1100, 700
    ids = np.random.default_rng(5).integers(0, mf.config.vocab_size, n)
    lr = ref.forward(ids, ref.new_cache(n), all_logits=True)
    cache = gpu.new_cache(n + 3)
    a = gpu.forward(ids[:cut], cache, all_logits=True)
    assert cache.length == cut
    b = gpu.forward(ids[cut:], cache, all_logits=True)
    assert cache.length == n
    _check(_compare(f"{name} ubatch=256, {cut}+{n - cut}", np.concatenate([a, b]), lr, BOUNDS[name]))


@pytest.mark.gpu
def test_resident_bytes_and_errors(models):
    from engine.errors import GGUFError

    for name, (mf, _, gpu) in models.items():
        size = os.path.getsize(mf.path)
        _report(test="prefill_resident", model=name, resident_bytes=gpu.resident_bytes, file_bytes=size,
                ratio=gpu.resident_bytes / size, load_seconds=gpu.load_seconds)
        assert gpu.resident_bytes <= 1.07 * size
    mf, _, gpu = models["tiny"]
    cache = gpu.new_cache(4)
    with pytest.raises(GGUFError):
        gpu.forward([1, 2, 3, 4, 5], cache)
    with pytest.raises(GGUFError):
        gpu.forward([mf.config.vocab_size], cache)
    with pytest.raises(GGUFError):
        gpu.forward([], cache)
    assert cache.length == 0


# ----------------------------------------------------------------------------- CPU: plumbing

def test_gpu_model_plumbing_emulated(tiny_qwen2_model_path):
    """GPUModel on the CPU with numpy in place of cupy and of each kernel (tests/gpu_emulation.py):
    fused weight groups, views, ubatches and cache continuation give the reference's logits within
    the bound, and chunking does not change which rows get which positions."""
    from engine.reference.model import ReferenceModel
    from engine.formats.weights import open_model
    from tests.gpu_emulation import emulated_gpu

    mf = open_model(tiny_qwen2_model_path)
    ref = ReferenceModel(mf)
    ids = np.random.default_rng(0).integers(0, mf.config.vocab_size, 150)
    lr = ref.forward(ids, ref.new_cache(150), all_logits=True)
    with emulated_gpu():
        from engine.gpu.model import GPUModel

        g = GPUModel(mf, ubatch=64)
        assert len(g.layers[0].qkv) == 1 and len(g.layers[-1].qkv) == 2    # q4_K qkv | q6_K v
        assert len(g.layers[0].gate_up) == 1
        cache = g.new_cache(160)
        a = g.forward(ids[:10], cache, all_logits=True)
        b = g.forward(ids[10:], cache, all_logits=True)
        last = g.forward(ids, g.new_cache(150))
        assert cache.length == 150
    lg = np.concatenate([a, b])
    rel = np.linalg.norm(lg - lr) / np.linalg.norm(lr)
    assert rel <= BOUNDS["tiny-qwen2"], rel
    assert np.linalg.norm(last - lr[-1]) / np.linalg.norm(lr[-1]) <= BOUNDS["tiny-qwen2"]


def test_gpu_model_qkv_rope_epilogue_emulated(tiny_qwen2_model_path, monkeypatch):
    """The fused q|k|v GEMM + RoPE epilogue (ops.wgmma.qkv_rope_wanted): on the Hopper route every
    layer's q|k|v group of a ubatch of at most QKV_ROPE_MAX_T tokens runs as one wgmma_qkv_rope
    launch (an all-q4_K [Wq; Wk; Wv], or [Wq; Wk] q4_K beside a padded q6_K Wv) in place of the
    GEMMs and qkv_rope, longer ones only under WG_QKV_EPI=2 and none under WG_QKV_EPI=0, with the
    same logits bit for bit (emulated: the wiring, not the kernel, which tests/test_gpu_wgmma.py
    checks on the GPU); ubatches below wgmma_min_tokens keep MMQ."""
    from engine.gpu import ops
    from engine.formats.weights import open_model
    from tests.gpu_emulation import emulated_gpu

    mf = open_model(tiny_qwen2_model_path)
    ids = np.random.default_rng(2).integers(0, mf.config.vocab_size, 100)
    assert ops.wgmma.QKV_ROPE_MAX_T == 32
    with emulated_gpu():
        from engine.gpu.model import GPUModel

        fused = []
        fq = ops.wgmma.wgmma_qkv_rope
        monkeypatch.setattr(ops.wgmma, "wgmma_qkv_rope",
                            lambda ws, xt, T, *a, **kw: fused.append((T, len(ws))) or fq(ws, xt, T, *a, **kw))
        g = GPUModel(mf, ubatch=64)
        g.wgmma_min_tokens = 20
        logits = {}
        for mode in ("0", "1", "2"):
            monkeypatch.setenv("GGUF_PREFILL_KERNEL_DEFINES", f"WG_QKV_EPI={mode}")
            fused.clear()
            logits[mode] = g.forward(ids, g.new_cache(100), all_logits=True)    # ubatches 64, 36
            per_layer = [len(L.qkv) for L in g.layers]
            want = {"0": [], "1": [], "2": [(64, n) for n in per_layer] + [(36, n) for n in per_layer]}[mode]
            assert fused == want, (mode, fused)
            fused.clear()
            short = g.forward(ids[:24], g.new_cache(24), all_logits=True)          # one 24-token ubatch
            assert fused == ([] if mode == "0" else [(24, n) for n in per_layer]), (mode, fused)
            logits[mode + "short"] = short
    assert {n for n in per_layer} == {1, 2}
    assert np.array_equal(logits["1"], logits["0"]) and np.array_equal(logits["2"], logits["0"])
    assert np.array_equal(logits["1short"], logits["0short"]) and np.array_equal(logits["2short"], logits["0short"])


def test_gpu_model_hopper_path_emulated(tiny_qwen2_model_path, monkeypatch):
    """The Hopper route on the CPU emulator (f16 activations, f16-rounded q4_K and q6_K weights):
    ubatches of >= wgmma_min_tokens tokens take it for every layer GEMM, shorter ones do not (q8_1
    MMQ); a q4_K | q6_K qkv group in one wgmma_pair launch; with q6_K left on MMQ that group gets
    both operand forms from one norm; the attention writing the Wo operand itself (attn_x16)
    leaves the logits bit for bit and tile_x16 unlaunched; the gate|up GEMM writes the down GEMM's
    operand itself (wgmma_swiglu), with the logits of GEMM + swiglu_x16 (WG_SWIGLU_EPI=0) bit for
    bit; the logits stay within the bound."""
    from engine.gpu import ops
    from engine.reference.model import ReferenceModel
    from engine.formats.weights import open_model
    from tests.gpu_emulation import emulated_gpu

    mf = open_model(tiny_qwen2_model_path)
    ref = ReferenceModel(mf)
    ids = np.random.default_rng(1).integers(0, mf.config.vocab_size, 150)
    lr = ref.forward(ids, ref.new_cache(150), all_logits=True)
    with emulated_gpu():
        from engine.gpu.model import GPUModel

        calls = []
        wg = ops.wgmma.wgmma
        monkeypatch.setattr(ops.wgmma, "wgmma", lambda w, xt, T, **kw: calls.append((T, w.kind)) or wg(w, xt, T, **kw))
        wp = ops.wgmma.wgmma_pair
        monkeypatch.setattr(ops.wgmma, "wgmma_pair",
                            lambda wa, wb, xt, T, *a: calls.append((T, "pair")) or wp(wa, wb, xt, T, *a))
        import engine.gpu.model as gpu_model

        planned = []                                               # what the wave model is given
        plan = gpu_model.plan_ubatches
        monkeypatch.setattr(gpu_model, "plan_ubatches", lambda n, u, gemms: planned.append(gemms) or plan(n, u, gemms))
        fused = []
        ws = ops.wgmma.wgmma_swiglu
        monkeypatch.setattr(ops.wgmma, "wgmma_swiglu", lambda w, xt, T, out=None: fused.append(T) or ws(w, xt, T, out))
        g = GPUModel(mf, ubatch=64)
        g.wgmma_min_tokens = 64
        assert g.ubatch_bounds(150) == [(0, 64), (64, 128), (128, 150)]
        lg = g.forward(ids, g.new_cache(150), all_logits=True)     # ubatches 64, 64, 22
        n_all, n_fused = len(calls), len(fused)
        tiled = []
        tx = ops.wgmma.tile_x16
        monkeypatch.setattr(ops.wgmma, "tile_x16", lambda x, out=None: tiled.append(x.shape) or tx(x, out=out))
        g.attn_x16 = True           # the attention writes the Wo operand: no tile_x16, the same logits
        lx = g.forward(ids, g.new_cache(150), all_logits=True)
        g.attn_x16 = False
        g.forward(ids[:64], g.new_cache(64))
        n_tiled, n_before_q = len(tiled), len(calls)
        n_swi = len(fused)
        monkeypatch.setenv("GGUF_PREFILL_KERNEL_DEFINES", "WG_SWIGLU_EPI=0")   # GEMM, then swiglu_x16
        ls = g.forward(ids, g.new_cache(150), all_logits=True)
        monkeypatch.delenv("GGUF_PREFILL_KERNEL_DEFINES")
        assert len(fused) == n_swi                                  # the unfused pair ran instead
        n_before_q = len(calls)
        g.wgmma_kinds = frozenset({"q4_k"})
        lq = g.forward(ids, g.new_cache(150), all_logits=True)
    n_layers = mf.config.n_layers
    assert np.array_equal(lx, lg) and np.array_equal(ls, lg)
    assert fused[:n_fused] == [64] * (2 * n_layers)      # both 64-token ubatches, every layer
    assert n_tiled == n_layers and tiled[0] == (64, mf.config.q_dim)  # the 64-token forward only
    assert {t for t, _ in calls} == {64} and {k for _, k in calls} == {"q4_k", "q6_k", "pair"}
    # every layer GEMM of the two long ubatches: qkv group (one launch, or one per type), Wo,
    # gate|up, down
    pairs = [ops.wgmma.pairs([s.w for s in L.qkv]) for L in g.layers]
    assert any(pairs) and n_all == sum(2 * ((1 if p else len(L.qkv)) + 2) for p, L in zip(pairs, g.layers))
    assert sum(k == "pair" for _, k in calls[:n_all]) == 2 * sum(pairs)
    assert 2 * sum(planned[0].values()) == n_all + n_fused   # the wave model sees the launches that ran
    assert all(k != "pair" for _, k in calls[n_before_q:])     # q6_K on MMQ: no pair launch
    for out in (lg, lq):
        rel = np.linalg.norm(out - lr) / np.linalg.norm(lr)
        assert rel <= BOUNDS["tiny-qwen2"], rel


def test_gpu_model_rejects_wrong_cache(tiny_model_path):
    from engine.reference.model import ReferenceModel
    from engine.formats.weights import open_model
    from tests.gpu_emulation import emulated_gpu

    mf = open_model(tiny_model_path)
    with emulated_gpu():
        from engine.gpu.model import GPUModel

        g = GPUModel(mf)
        with pytest.raises(TypeError):
            g.forward([1, 2], ReferenceModel(mf).new_cache(4))


def test_one_weight_set_role_views_and_bias_emulated(tiny_qwen2_model_path):
    """Decode reads GPUModel's own weights: per-role views share the fused groups' memory,
    the q/k/v biases are one array whose views the prefill takes, and the one KV cache class
    exposes per-layer views and strides."""
    from engine.formats.weights import layer_name, open_model
    from tests.gpu_emulation import emulated_gpu

    mf = open_model(tiny_qwen2_model_path)
    cfg = mf.config
    with emulated_gpu():
        from engine.gpu.kv_cache import GPUKVCache
        from engine.gpu.model import GPUModel

        g = GPUModel(mf)
        for i, L in enumerate(g.layers):
            segs = {r: s for s in L.qkv + L.gate_up for r in s.roles}
            for role, w in L.roles.items():
                assert np.shares_memory(w.data, segs[role].w.data)
                assert w.rows == {"attn_q": cfg.q_dim, "attn_k": cfg.kv_dim, "attn_v": cfg.kv_dim}.get(role, cfg.d_ff)
                raw = np.asarray(mf.tensor(layer_name(i, role)).data)
                if w.kind == "q4_k":
                    assert np.array_equal(np.asarray(w.data), raw)
            assert L.qkv_bias.shape == (cfg.q_dim + 2 * cfg.kv_dim,)
            for b in (L.bq, L.bk, L.bv):
                assert np.shares_memory(b, L.qkv_bias)
            assert np.array_equal(L.bk, np.asarray(mf.tensor(layer_name(i, "attn_k", "bias")).data))
        c = g.new_cache(10)
        assert type(c) is GPUKVCache and c.capacity == c.max_tokens == 10 and c.length == 0
        assert c.k_layer(1).shape == (cfg.n_kv_heads, 10, cfg.head_dim) and c.k.dtype == np.float16
        assert (c.tok_stride, c.head_stride) == (cfg.head_dim, 10 * cfg.head_dim)
        g.forward([1, 2, 3], c)
        assert c.length == 3
        c.reset()
        assert c.length == 0


def test_session_buckets_and_pool(monkeypatch):
    """SessionPool (engine.gpu.session) without a device: bucketed capacities, reuse of an idle
    session of the same bucket, LRU eviction by count and bytes, one retry after an out-of-memory
    error with the idle sessions freed."""
    from engine.gpu import session as S

    assert [S.bucket_capacity(n) for n in (1, 256, 257, 1000, 4096, 4097, 9000)] == \
        [256, 256, 512, 1024, 4096, 8192, 12288]

    made = []

    class FakeSession:
        def __init__(self, model, capacity, pool=None, use_graph=True):
            if model.oom:
                model.oom -= 1
                raise type("OutOfMemoryError", (Exception,), {})()
            self.capacity, self._pool, self.nbytes = capacity, pool, capacity
            made.append(self)

        def close(self):
            self._pool.give(self)

    monkeypatch.setattr(S, "GPUSession", FakeSession)
    model = type("M", (), {"oom": 0})()
    pool = S.SessionPool(model, max_idle=2, max_idle_bytes=3000)
    a = pool.take(100)
    a.close()
    assert pool.take(200) is a                        # same bucket: reused
    b = pool.take(300)                                # another bucket: new
    assert b.capacity == 512 and pool.created == 2
    a.close()
    b.close()
    c = pool.take(2000)                               # 2048
    c.close()                                         # 3 idle > max_idle: the oldest (a) goes
    assert pool.idle() == [b, c]
    small = S.SessionPool(model, max_idle=10, max_idle_bytes=1000)
    xs = [small.take(n) for n in (200, 400, 1000)]   # 256, 512, 1024 "bytes"
    for x in xs:
        x.close()
    assert small.idle() == [xs[2]]                    # over the byte cap: oldest first, one kept
    model.oom = 1
    d = pool.take(5000)                               # OOM once: idle ones dropped, retried
    assert d.capacity == 8192 and pool.idle() == []
    model.oom = 1
    with pytest.raises(Exception) as err:
        pool.take(100)
    assert type(err.value).__name__ == "OutOfMemoryError"                                # OOM with nothing idle: raised


def test_generate_sessions_on_reference(tiny_model_path):
    """engine.generate over ReferenceModel goes through engine.session.ForwardSession: the same
    tokens as stepping forward by hand, real margins, Step.logits only with need_logits."""
    from engine.generate import generate, generate_steps
    from engine.reference.model import ReferenceModel
    from engine.session import ForwardSession, open_session

    ref = ReferenceModel.from_path(tiny_model_path)
    ids = [5, 9, 200, 31]
    s = open_session(ref, 10)
    assert isinstance(s, ForwardSession) and s.capacity == 10
    cache = ref.new_cache(10)
    logits = ref.forward(ids, cache)
    want = []
    for _ in range(5):
        want.append(int(np.argmax(logits)))
        logits = ref.forward([want[-1]], cache)
    g = generate(ref, ids, 5)
    assert g.tokens == want and all(m >= 0 for m in g.margins) and g.stop_reason == "length"
    steps = list(generate_steps(ref, ids, 3, need_logits=True))
    assert [st.token for st in steps] == want[:3]
    assert all(st.logits is not None and int(np.argmax(st.logits)) == st.token for st in steps)
    assert all(st.logits is None for st in generate_steps(ref, ids, 2))
    e = generate(ref, ids, 5, eog_ids=[want[2]])
    assert e.tokens == want[:2] and e.stop_reason == "eog"
    z = generate(ref, ids, 0)
    assert z.tokens == [] and z.stop_reason == "length" and z.prompt_ms > 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "slice"])
def test_prefill_graph_equals_eager(models, name):
    """Short prompts through the prefill graph (prefill_graph.py): the same bits as the eager
    kernels at every position of a multi-turn conversation (padded and exact T), one capture
    per T, reused across positions; the logits within the reference bound."""
    if name not in models:
        pytest.skip(f"{SLICE} missing (make it with the slice verb; see the module docstring)")
    from engine.gpu.model import GPUModel
    from engine.gpu.prefill_graph import graph_tokens

    mf, ref, gpu = models[name]
    eager = GPUModel(mf, graph_prefill=False)
    rng = np.random.default_rng(7)
    turns = [5, 3, 17, 1, 128, 5, 64, 2]
    cap = sum(turns) + 40
    cg, ce, cr = gpu.new_cache(cap), eager.new_cache(cap), ref.new_cache(cap)
    for n in turns:
        ids = rng.integers(0, mf.config.vocab_size, n)
        assert graph_tokens(n, cg.length, cap) is not None
        lg = gpu.forward(ids, cg, all_logits=True)
        le = eager.forward(ids, ce, all_logits=True)
        lr = ref.forward(ids, cr, all_logits=True)
        assert np.array_equal(lg.view(np.uint32), le.view(np.uint32)), f"{name}: graph != eager at n={n}"
        _check(_compare(f"{name} graph n={n} at {cg.length - n}", lg, lr, BOUNDS[name]))
    Ts = {graph_tokens(n, 0, cap) for n in turns}
    assert set(cg.prefill_graphs) <= Ts | set(turns) and len(cg.prefill_graphs) <= len(Ts) + 2
    assert all(pg.graph is not None for pg in cg.prefill_graphs.values())
    k_g, k_e = cp_asnumpy(cg.k[:, :, :cg.length]), cp_asnumpy(ce.k[:, :, :ce.length])
    assert np.array_equal(k_g.view(np.uint16), k_e.view(np.uint16)), "K cache differs"


def cp_asnumpy(a):
    import cupy

    return cupy.asnumpy(a)


def test_gpu_batch_plumbing_emulated(tiny_qwen2_model_path):
    """engine.gpu.batch.GPUBatch on the CPU (tests/gpu_emulation.py): a step mixing prompt chunks
    and decode tokens of several slots (padding rows, tiles, cache rows, the head's gathered
    rows) gives each sequence the reference's logits within the bound; a prefix copied between
    slots continues like the original."""
    from engine.formats.weights import open_model
    from engine.reference.model import ReferenceModel
    from engine.scheduler import FOLLOW, BatchEntry
    from tests.gpu_emulation import emulated_gpu

    mf = open_model(tiny_qwen2_model_path)
    ref = ReferenceModel(mf)
    rng = np.random.default_rng(4)
    V = mf.config.vocab_size
    p = [rng.integers(0, V, n).tolist() for n in (140, 9, 70)]
    steps = [[BatchEntry(0, p[0], 0, "logits"), BatchEntry(1, p[1], 0, "logits"), BatchEntry(2, p[2][:40], 0, None)],
             [BatchEntry(2, p[2][40:], 40, "logits"), BatchEntry(0, [11], 140, "logits"),
              BatchEntry(1, [12], 9, "argmax")]]
    caches = [ref.new_cache(256) for _ in p]
    with emulated_gpu():
        from engine.gpu.model import GPUModel

        b = GPUModel(mf).batch(3, 256)
        assert b.cache.capacity == 3 * 256 + 128
        for entries in steps:
            outs = b.run(entries)
            for e, o in zip(entries, outs):
                want = ref.forward(e.ids, caches[e.slot])
                if e.want is None:
                    assert o is None
                elif e.want == "argmax":
                    assert o[0] == int(np.argmax(want)) or (np.sort(want)[-1] - np.sort(want)[-2]) < 0.5
                else:
                    assert np.linalg.norm(o - want) / np.linalg.norm(want) <= BOUNDS["tiny-qwen2"], (e.slot, e.start)
        b.copy_prefix(1, 2, 10)                              # slot 1 holds p[1] + [12]
        x = b.run([BatchEntry(2, [13], 10, "logits")])[0]
        y = b.run([BatchEntry(1, [13], 10, "logits")])[0]
        assert np.array_equal(x, y)
        with pytest.raises(ValueError, match="twice"):
            b.run([BatchEntry(0, [1], 141, None), BatchEntry(0, [2], 142, None)])
        # two steps in flight, the second fed the first's greedy token on the device (FOLLOW):
        # the logits of feeding that token explicitly in another slot with the same history
        b.copy_prefix(1, 0, 11)
        h1 = b.launch([BatchEntry(1, [5], 11, "argmax")])
        h2 = b.launch([BatchEntry(1, [FOLLOW], 12, "logits")])
        t1, z = b.collect(h1)[0][0], b.collect(h2)[0]
        assert b.run([BatchEntry(0, [5], 11, "argmax")])[0][0] == t1
        assert np.array_equal(b.run([BatchEntry(0, [t1], 12, "logits")])[0], z)
