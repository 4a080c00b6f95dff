"""The table of ops that drives the GPU op tests (tests/test_ops.py), as llama.cpp's
test-backend-ops does: per op its shape cases, the input builder, the numpy oracle and the error
bound. Shapes, oracles and bounds only (no GPU imports), so a benchmark can read it too.

    OPS[name] = Op(cases, inputs(rng, **case) -> dict, oracle(inputs) -> ndarray,
                   bound(inputs, **case) -> float or ndarray of |gpu - oracle| allowed (0: bit-exact),
                   emu_skip(**case) -> True for cases too big for the CPU emulator,
                   nbytes(inputs, **case) -> bytes the op reads (dev/op_bench.py's GB/s))

The GPU launch of each op is in tests/test_ops.py (LAUNCH, by the same name). Oracles and bounds
are those of tests/test_gpu_model.py / test_gpu_decode.py for the same op. Rows:
    quantize_q8_1                     bit-exact to quants.quantize_q8_1
    mmq_{q4_k,q6_k_raw,q6_k_padded}   reference.mmq oracle, error_bound
    mmvq_{store,add,swiglu}_{q4_k,q6_k_raw,q6_k_padded}
                                      reference.mmq oracle; |y - ref| <= (K/16 + 8) 2^-24 S (+ the
                                      add / swiglu epilogue terms of test_gpu_decode.test_mmvq)
    embed_{q4_k,q6_k_raw,q6_k_padded} bit-exact dequantization of the chosen rows
    add_rmsnorm_q8_1                  x + y exact, h within 2e-6 relative of reference.ops.rms_norm
    qkv_rope                          bit-exact to reference.numerics.qkv_rope_f16; cache rows outside
                                      start..start+n untouched (NaN poison kept: 1.0 per element)
    attention_prefill                 float32 output, |o - ref| <= 2^-9 max|V| (numerics.attention_f16)
    attention_decode                  float32 output, |o - ref| <= 1e-5 max|V| + 1e-6 (float64 softmax)
    argmax                            numpy.argmax (ties lowest, NaN wins), state / history update
Not yet here (still only in the per-op tests): the q8_1 outputs checked against quantize_q8_1 of
the kernel's own float32 output (rmsnorm, attention), swiglu_q8_1 (its bound uses the kernel's d).
"""
from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Callable

import numpy as np

from engine.formats import quants as Q
from engine.reference.mmq import abs_terms, error_bound, mmq_reference, random_blocks

U = 2.0 ** -24


def _no_skip(**case) -> bool:
    return False


def _array_bytes(inp, **case) -> int:
    """Default: every numpy array of the inputs is read once."""
    return int(sum(v.nbytes for v in inp.values() if isinstance(v, np.ndarray)))


@dataclass(frozen=True)
class Op:
    cases: tuple[dict, ...]
    inputs: Callable[..., dict]
    oracle: Callable[[dict], np.ndarray]
    bound: Callable[..., object]
    emu_skip: Callable[..., bool] = _no_skip
    nbytes: Callable[..., int] = _array_bytes


def activations(rng, T: int, K: int) -> np.ndarray:
    """f32 [T, K] over 4 decades per row, with an all-zero block, a subnormal block and ties."""
    x = rng.standard_normal((T, K)).astype(np.float32)
    x *= (10.0 ** rng.uniform(-2, 2, (T, 1))).astype(np.float32)
    x[0, :32] = 0.0
    if K >= 64:
        x[0, 32:64] *= np.float32(1e-38)
    if T > 1:
        x[1, : K // 2] = np.round(x[1, : K // 2])
    return x


# ----------------------------------------------------------------------------- quantize_q8_1

def _q8_inputs(rng, T, K):
    return {"x": activations(rng, T, K)}


def _q8_oracle(inp):
    q, d, s = Q.quantize_q8_1(inp["x"])
    return np.concatenate([q.astype(np.float64).reshape(-1), d.astype(np.float64).reshape(-1),
                           s.astype(np.float64).reshape(-1)])


# ----------------------------------------------------------------------------- mmq

def _mmq_inputs(kind, padded):
    def make(rng, T, N, K, variant):
        w = random_blocks(rng, kind, N, K, special=True)
        x = activations(rng, T, K)
        return {"w": w, "x": x, "kind": kind, "padded": padded}
    return make


def _mmq_oracle(inp):
    q, d, s = Q.quantize_q8_1(inp["x"])
    return mmq_reference(inp["kind"], inp["w"], q, d, s)        # w: raw rows (padded on upload)


def _mmq_bound(inp, T, N, K, variant, tc_min_term=False):
    q, d, s = Q.quantize_q8_1(inp["x"])
    S, S_min = abs_terms(inp["kind"], inp["w"], q, d, s)
    return error_bound(inp["kind"], K, S, S_min, tc_min_term)


MMQ_SHAPES = ((1, 128, 256), (65, 200, 512), (130, 256, 1024))
MMQ_VARIANTS = {"q4_k": ("m64n128tc_k256", "m128n128w8tc_k256"), "q6_k": ("m64n128", "m128n128w8_k256")}


def _mmq_cases(kind):
    return tuple({"T": T, "N": N, "K": K, "variant": v} for v in MMQ_VARIANTS[kind] for T, N, K in MMQ_SHAPES)

def _q8_bytes(T, K):
    return T * K + T * (K // 32) * 8                     # int8 q + (d, s) float32 per block


def _mmq_bytes(inp, T, N, K, variant):
    return int(inp["w"].nbytes) + _q8_bytes(T, K)


# ----------------------------------------------------------------------------- mmvq
# tests/test_gpu_decode.py test_mmvq: random_blocks (special scales), x over 4 decades with an
# all-zero q8_1 block, oracle mmq_reference on the raw rows, bound (K/16 + 8) U S per element.

MMVQ_SHAPES = ((1, 256), (5, 256), (7, 1536), (37, 768), (64, 512), (33, 4096), (300, 2048),
               (517, 11008), (4099, 4096), (4096, 4096))


def _mmvq_inputs(kind, padded, mode):
    def make(rng, N, K):
        w = random_blocks(rng, kind, N, K, special=True)
        x = (rng.standard_normal((1, K)) * 10.0 ** rng.uniform(-2, 2)).astype(np.float32)
        x[0, :32] = 0.0                                          # an all-zero q8_1 block
        q, d, s = Q.quantize_q8_1(x)
        inp = {"w": w, "q": q, "d": d, "s": s, "kind": kind, "padded": padded, "mode": mode}
        if mode == "add":
            inp["y0"] = rng.standard_normal(N).astype(np.float32)
        if mode == "swiglu":
            inp["w2"] = random_blocks(rng, kind, N, K, special=True)
        return inp
    return make


def _gemv(inp, w):
    return mmq_reference(inp["kind"], w, inp["q"], inp["d"], inp["s"])[0]


def _gemv_bound(inp, w, K):
    S, _ = abs_terms(inp["kind"], w, inp["q"], inp["d"], inp["s"])
    return (K / 16 + 8) * U * S[0]


def _silu_terms(ref):
    e = np.exp(-np.abs(ref))                                     # logistic, stable both ways
    sig = np.where(ref >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return ref * sig, sig * (1 + ref * (1 - sig))


def _mmvq_oracle(inp):
    ref = _gemv(inp, inp["w"])
    if inp["mode"] == "add":
        return inp["y0"].astype(np.float64) + ref
    if inp["mode"] == "swiglu":
        silu, _ = _silu_terms(ref)
        return silu * _gemv(inp, inp["w2"])
    return ref


def _mmvq_bound(inp, N, K):
    bound = _gemv_bound(inp, inp["w"], K)
    if inp["mode"] == "add":
        y0 = inp["y0"]
        ref = _gemv(inp, inp["w"])
        return bound + 2 * U * np.abs(y0 + ref) + 2 * U * np.abs(y0)
    if inp["mode"] == "swiglu":
        ref, ref2 = _gemv(inp, inp["w"]), _gemv(inp, inp["w2"])
        silu, dsilu = _silu_terms(ref)
        return (np.abs(dsilu * ref2) * bound + np.abs(silu) * _gemv_bound(inp, inp["w2"], K)
                + 8 * U * np.abs(silu * ref2) + 1e-30)
    return bound


def _mmvq_bytes(inp, N, K):
    w = inp["w"].nbytes * (2 if inp["mode"] == "swiglu" else 1)
    w += inp["w"].nbytes // 210 * 14 if inp["padded"] else 0     # padded q6_K rows: 224 B blocks
    return int(w + _q8_bytes(1, K) + (4 * N if inp["mode"] == "add" else 0))


def _mmvq_op(kind, padded, mode):
    return Op(tuple({"N": N, "K": K} for N, K in MMVQ_SHAPES), _mmvq_inputs(kind, padded, mode),
              _mmvq_oracle, _mmvq_bound, emu_skip=lambda N, K: N * K > 50_000, nbytes=_mmvq_bytes)


# ----------------------------------------------------------------------------- embed
# tests/test_gpu_model.py test_embed_rows_bit_exact: rows bit-identical to quants' dequantization.

def _embed_inputs(kind, padded):
    def make(rng, V, K, n):
        rows = random_blocks(rng, kind, V, K, special=False)
        return {"rows": rows, "ids": rng.integers(0, V, n).astype(np.int32), "kind": kind, "padded": padded}
    return make


def _embed_oracle(inp):
    r = inp["rows"][inp["ids"]]
    return (Q.dequantize_q4_k(r) if inp["kind"] == "q4_k" else Q.dequantize_q6_k(r)).astype(np.float64)


def _embed_bytes(inp, V, K, n):
    return int(n * inp["rows"].shape[1] + 4 * n)


def _embed_op(kind, padded):
    return Op(({"V": 37, "K": 512, "n": 11}, {"V": 300, "K": 4096, "n": 64}), _embed_inputs(kind, padded),
              _embed_oracle, lambda inp, **c: 0.0, nbytes=_embed_bytes)


# ----------------------------------------------------------------------------- add_rmsnorm_q8_1
# tests/test_gpu_model.py test_add_rmsnorm_q8_1: x += y exactly, h within 2e-6 relative.
# (Its third check, act = quantize_q8_1 of the kernel's own h, is not a table row yet.)

def _rms_inputs(rng, R, K, with_y):
    x = (rng.standard_normal((R, K)) * rng.uniform(0.1, 30, (R, 1))).astype(np.float32)
    y = (rng.standard_normal((R, K)) * 2).astype(np.float32)
    w = rng.uniform(-2, 2, K).astype(np.float32)
    return {"x": x, "y": y if with_y else None, "w": w, "eps": 1e-5}


def _rms_oracle(inp):
    from engine.reference.ops import rms_norm

    xs = inp["x"] + inp["y"] if inp["y"] is not None else inp["x"]
    return np.concatenate([xs.astype(np.float64).reshape(-1),
                           rms_norm(xs, inp["w"], inp["eps"]).astype(np.float64).reshape(-1)])


def _rms_bound(inp, R, K, with_y):
    ref = _rms_oracle(inp)[R * K:]
    return np.concatenate([np.zeros(R * K), 2e-6 * (np.abs(ref) + 1e-30)])


def _rms_bytes(inp, R, K, with_y):
    return int(4 * R * K * (3 if with_y else 1) + 4 * K)         # x (+ y, + x written back), w


# ----------------------------------------------------------------------------- qkv_rope
# tests/test_gpu_model.py test_qkv_rope_bit_exact.

def _rope_inputs(rng, rope_type, hd, bias):
    from engine.formats.config import ModelConfig
    from engine.formats.rope import rope_tables

    H, KVH, n, start, maxT = 4, 2, 5, 3, 16
    cfg = ModelConfig("llama", 1, H * hd, H, KVH, hd, 256, 10, 64, 1e4 if rope_type == "normal" else 1e6,
                      rope_type, 1e-5, bias, False)
    qd, kvd = H * hd, KVH * hd
    qkv = (rng.standard_normal((n, qd + 2 * kvd)) * 3).astype(np.float32)
    b = [(rng.standard_normal(c) * 50).astype(np.float32) if bias else None for c in (qd, kvd, kvd)]
    cos, sin = rope_tables(cfg, np.arange(start, start + n))
    cos_all, sin_all = rope_tables(cfg, np.arange(start + n))       # the kernel's tables (rows start..)
    return {"qkv": qkv, "bq": b[0], "bk": b[1], "bv": b[2], "cos": np.ascontiguousarray(cos, np.float32),
            "sin": np.ascontiguousarray(sin, np.float32), "cos_all": np.ascontiguousarray(cos_all, np.float32),
            "sin_all": np.ascontiguousarray(sin_all, np.float32), "H": H, "KVH": KVH, "n": n, "start": start,
            "maxT": maxT, "neox": rope_type == "neox"}


def _rope_oracle(inp):
    from engine.reference.numerics import qkv_rope_f16

    H, KVH, n, start, maxT = inp["H"], inp["KVH"], inp["n"], inp["start"], inp["maxT"]
    qkv = inp["qkv"]
    hd = inp["cos"].shape[1] * 2
    qd, kvd = H * hd, KVH * hd
    rq, rk, rv = qkv_rope_f16(qkv[:, :qd], qkv[:, qd:qd + kvd], qkv[:, qd + kvd:], inp["bq"], inp["bk"],
                              inp["bv"], inp["cos"], inp["sin"], H, KVH, hd, inp["neox"])
    outside = np.ones(2 * KVH * (maxT - n) * hd)                 # 1.0: the NaN poison is still there
    return np.concatenate([a.astype(np.float64).reshape(-1) for a in (rq, rk, rv)] + [outside])


# ----------------------------------------------------------------------------- attention prefill
# tests/test_gpu_model.py test_attention_prefill (its float32 output; the q8_1 output is not a row yet).

def _att_prefill_inputs(rng, hd, H, KVH, n, start, big):
    maxT = start + n + 9
    L = start + n
    q = rng.standard_normal((H, n, hd)).astype(np.float32) * (math.log2(math.e) / math.sqrt(hd))
    k = rng.standard_normal((KVH, maxT, hd)).astype(np.float32)
    v = rng.standard_normal((KVH, maxT, hd)).astype(np.float32) * 3
    if big:                      # Qwen2-like: a large bias on a few dims -> scores ~ 1e4
        k[:, :, :4] += 300.0
        q[:, :, :4] *= 40.0
    k[:, L:] = np.nan            # past the prompt: never to be read
    v[:, L:] = np.nan
    return {"q": q.astype(np.float16), "k": k.astype(np.float16), "v": v.astype(np.float16), "start": start}


def _att_prefill_oracle(inp):
    from engine.reference.numerics import attention_f16

    n, L = inp["q"].shape[1], inp["start"] + inp["q"].shape[1]
    kf, vf = inp["k"].copy(), inp["v"].copy()
    kf[:, L:] = 0
    vf[:, L:] = 0
    return attention_f16(inp["q"], kf, vf, inp["start"]).astype(np.float64)


def _att_prefill_bound(inp, hd, H, KVH, n, start, big):
    return float(np.nanmax(np.abs(inp["v"][:, :start + n].astype(np.float32)))) * 2 ** -9


def _att_prefill_bytes(inp, hd, H, KVH, n, start, big):
    return int(inp["q"].nbytes + 2 * KVH * (start + n) * hd * 2)


ATT_PREFILL_CASES = tuple(dict(zip(("hd", "H", "KVH", "n", "start", "big"), c)) for c in (
    (64, 4, 2, 1, 0, False), (64, 4, 2, 7, 0, False), (128, 4, 1, 65, 0, False),
    (64, 2, 2, 70, 61, True), (128, 4, 2, 130, 3, True)))


# ----------------------------------------------------------------------------- attention decode
# tests/test_gpu_decode.py test_attention_decode (float32 output; its q8_1 output not a row yet).

ATT_DECODE_CONFIGS = ((32, 32, 128, "f16", "thd"), (12, 2, 128, "f16", "thd"), (32, 32, 128, "f16", "htd"),
                      (4, 2, 64, "f32", "thd"), (12, 2, 128, "f32", "htd"), (2, 2, 128, "f16", "thd"))


def _att_decode_cases():
    out = []
    for H, KVH, hd, dt, layout in ATT_DECODE_CONFIGS:
        for L in (1, 100, 3314):
            for S in ((1, 3, 64) if L > 1 else (1, 4)):
                out.append({"H": H, "KVH": KVH, "hd": hd, "kv": dt, "layout": layout, "L": L, "splits": S})
    return tuple(out)


def _att_decode_inputs(rng, H, KVH, hd, kv, layout, L, splits):
    T = L + 5                                                    # cache capacity > length
    npdt = np.float16 if kv == "f16" else np.float32
    k = (rng.standard_normal((T, KVH, hd)) * 2).astype(npdt)
    v = rng.standard_normal((T, KVH, hd)).astype(npdt)
    q = rng.standard_normal((H, hd)).astype(np.float32)
    k[L:] = np.nan                                               # never read: past the length
    v[L:] = np.nan
    return {"q": q, "k": k, "v": v, "L": L}


def _att_decode_oracle(inp):
    q, k, v = inp["q"], inp["k"], inp["v"]
    H, hd = q.shape
    KVH = k.shape[1]
    L = inp["L"]
    G = H // KVH
    kk = k[:L].astype(np.float64)
    vv = v[:L].astype(np.float64)
    ref = np.empty((H, hd))
    scale = float(np.float32(1.0 / np.sqrt(hd)))
    for h in range(H):
        sc = kk[:, h // G] @ q[h].astype(np.float64) * scale
        p = np.exp(sc - sc.max())
        ref[h] = (p / p.sum()) @ vv[:, h // G]
    return ref.reshape(-1)


def _att_decode_bound(inp, H, KVH, hd, kv, layout, L, splits):
    return 1e-5 * float(np.abs(inp["v"][:L].astype(np.float64)).max()) + 1e-6


def _att_decode_bytes(inp, H, KVH, hd, kv, layout, L, splits):
    return int(inp["q"].nbytes + 2 * L * KVH * hd * inp["k"].itemsize)


# ----------------------------------------------------------------------------- argmax
# tests/test_gpu_decode.py test_argmax: numpy.argmax semantics; state [tok, step+1, hist idx+1].

def _argmax_inputs(rng, V, pattern):
    x = rng.standard_normal(V).astype(np.float32)
    if pattern == "tie":
        x[rng.choice(V, 3, replace=False)] = 50.0                # a three-way tie
    elif pattern == "nan":
        x[V // 2] = np.nan
        x[V - 1] = np.nan                                        # NaN wins, first NaN
    elif pattern == "neginf":
        x[:] = -np.inf
    return {"x": x}


def _argmax_oracle(inp):
    want = int(np.argmax(inp["x"]))
    return np.array([want, 11, 1, want], dtype=np.float64)       # state[0..2] from [-1, 10, 0], hist[0]


ARGMAX_CASES = tuple({"V": V, "pattern": p} for V in (512, 32000, 151936)
                     for p in ("random", "tie", "nan", "neginf"))


OPS: dict[str, Op] = {
    "quantize_q8_1": Op(tuple({"T": T, "K": K} for T, K in ((1, 256), (7, 4096), (65, 11008))),
                        _q8_inputs, _q8_oracle, lambda inp, **c: 0.0),
    "mmq_q4_k": Op(_mmq_cases("q4_k"), _mmq_inputs("q4_k", False), _mmq_oracle, _mmq_bound, nbytes=_mmq_bytes),
    "mmq_q6_k_raw": Op(_mmq_cases("q6_k"), _mmq_inputs("q6_k", False), _mmq_oracle, _mmq_bound,
                       nbytes=_mmq_bytes),
    "mmq_q6_k_padded": Op(_mmq_cases("q6_k"), _mmq_inputs("q6_k", True), _mmq_oracle, _mmq_bound,
                          nbytes=_mmq_bytes),
    **{f"mmvq_{mode}_{name}": _mmvq_op(kind, padded, mode) for mode in ("store", "add", "swiglu")
       for name, kind, padded in (("q4_k", "q4_k", False), ("q6_k_raw", "q6_k", False),
                                  ("q6_k_padded", "q6_k", True))},
    **{f"embed_{name}": _embed_op(kind, padded) for name, kind, padded in
       (("q4_k", "q4_k", False), ("q6_k_raw", "q6_k", False), ("q6_k_padded", "q6_k", True))},
    "add_rmsnorm_q8_1": Op(tuple({"R": 6, "K": K, "with_y": y} for K, y in
                                 ((512, True), (768, False), (1536, True), (4096, True))),
                           _rms_inputs, _rms_oracle, _rms_bound, nbytes=_rms_bytes),
    "qkv_rope": Op(tuple({"rope_type": r, "hd": hd, "bias": b} for r, hd, b in
                         (("normal", 64, False), ("neox", 128, True), ("neox", 64, True))),
                   _rope_inputs, _rope_oracle, lambda inp, **c: 0.0),
    "attention_prefill": Op(ATT_PREFILL_CASES, _att_prefill_inputs, _att_prefill_oracle, _att_prefill_bound,
                            nbytes=_att_prefill_bytes),
    "attention_decode": Op(_att_decode_cases(), _att_decode_inputs, _att_decode_oracle, _att_decode_bound,
                           emu_skip=lambda H, L, **c: L > 300 or H == 32, nbytes=_att_decode_bytes),
    "argmax": Op(ARGMAX_CASES, _argmax_inputs, _argmax_oracle, lambda inp, **c: 0.0,
                 emu_skip=lambda V, **c: V > 32000),
}


def cases() -> list[tuple[str, dict]]:
    """(op name, case) of every table row, for pytest.mark.parametrize and benchmarks."""
    return [(name, c) for name, op in OPS.items() for c in op.cases]
