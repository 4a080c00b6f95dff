"""Run engine.gpu.model.GPUModel on the CPU: numpy stands in for cupy and each GPU launcher is
replaced by a numpy emulation of the same numerics (q8_1 GEMM inputs, f16 Q/K/V/P in attention,
f32 elsewhere).

Two uses, both without a GPU:
- the GPUModel plumbing (fused weight groups, views and strides, ubatch chunking, KV-cache
  offsets, all_logits, errors) is exercised end to end;
- the emulated logits against the float32 reference give the error the int8 activations and
  the f16 attention operands alone cause: the bound the real GPU logits are held to is
  derived from it (tests/test_gpu_model.py).

    with emulated_gpu():
        model = GPUModel(open_model(path))
        logits = model.forward(ids, model.new_cache(n))
"""
from __future__ import annotations

import math
import sys
import types
from contextlib import contextmanager

import numpy as np

from engine.formats import quants
from engine.reference.model import apply_rope, rms_norm, silu


def _fake_cupy() -> types.ModuleType:
    cp = types.ModuleType("cupy")
    for name in ("empty", "zeros", "full", "asarray", "concatenate", "float16", "float32", "int8",
                 "int32", "uint8", "ndarray", "arange"):
        setattr(cp, name, getattr(np, name))
    cp.asnumpy = lambda a: np.array(a)

    class _Device:
        id = 0

        def synchronize(self):
            pass

    class _Event:
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

    cuda = types.SimpleNamespace(Device=lambda *a: _Device(), Event=_Event,
                                 get_elapsed_time=lambda a, b: 0.0)
    cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: 0)
    cp.cuda = cuda
    return cp


def _store_q8(h: np.ndarray, act) -> None:
    """q8_1 as the fused kernels write it (engine.formats.quants.quantize_q8_1)."""
    q, d, s = quants.quantize_q8_1(np.ascontiguousarray(h, dtype=np.float32))
    act.q[...] = q
    act.ds[..., 0] = d
    act.ds[..., 1] = s


def emu_embed(table, ids, x):
    from engine.reference.model import dequantize_rows

    rows = table.data[np.asarray(ids, dtype=np.int64)]
    if table.kind == "q4_k":
        x[...] = quants.dequantize_q4_k(rows)
    else:
        x[...] = quants.dequantize_q6_k(rows, padded=table.padded)


def emu_add_rmsnorm_q8_1(x, y, w, eps, act, hout=None):
    if y is not None:
        x += y
    h = rms_norm(x, w, eps)
    if hout is not None:
        hout[...] = h
    _store_q8(h, act)


def emu_qkv_rope(q, k, v, lds, bq, bk, bv, cos, sin, qout, kc, vc, start, neox, n_heads, n_kv_heads, head_dim):
    n = cos.shape[0]
    rt = "neox" if neox else "normal"
    qq = q + bq if bq is not None else q.copy()
    kk = k + bk if bk is not None else k.copy()
    vv = v + bv if bv is not None else v.copy()
    qr = apply_rope(qq.reshape(n, n_heads, head_dim), cos, sin, rt)
    kr = apply_rope(kk.reshape(n, n_kv_heads, head_dim), cos, sin, rt)
    qscale = np.float32(math.log2(math.e) / math.sqrt(head_dim))
    qout[...] = (qr * qscale).astype(np.float16).transpose(1, 0, 2)
    kc[:, start:start + n] = kr.astype(np.float16).transpose(1, 0, 2)
    vc[:, start:start + n] = vv.reshape(n, n_kv_heads, head_dim).astype(np.float16).transpose(1, 0, 2)


def attention_numpy(qh, kc, vc, start):
    """qh f16 [H, n, hd] (scaled by log2 e / sqrt hd); kc/vc f16 [KVH, maxT, hd]
    -> float32 [n, H*hd], with P rounded to f16 before P V (as the kernel does)."""
    H, n, hd = qh.shape
    KVH = kc.shape[0]
    G = H // KVH
    L = start + n
    out = np.empty((n, H, hd), dtype=np.float32)
    qpos = start + np.arange(n)
    mask = np.arange(L)[None, :] > qpos[:, None]
    for h in range(H):
        q = qh[h].astype(np.float64)
        k = kc[h // G, :L].astype(np.float64)
        v = vc[h // G, :L].astype(np.float64)
        s = q @ k.T
        s[mask] = -np.inf
        m = s.max(axis=1, keepdims=True)
        p = np.exp2(s - m)
        l = p.sum(axis=1, keepdims=True)
        out[:, h] = (p.astype(np.float16).astype(np.float64) @ v) / l
    return out.reshape(n, H * hd)


def emu_attention_prefill(qh, kc, vc, start, out_act=None, out_f32=None):
    o = attention_numpy(qh, kc, vc, start)
    if out_f32 is not None:
        out_f32[...] = o
    else:
        _store_q8(o, out_act)


def emu_swiglu_q8_1(g, u, ld, F, act):
    _store_q8(silu(g) * u, act)


def emu_mmq(weight, act, out=None, variant=None):
    T, K = act.q.shape
    xq = quants.dequantize_q8_1(act.q, act.ds[..., 0])
    rows = np.asarray(weight.data)
    if weight.kind == "q4_k":
        w = quants.dequantize_q4_k(rows)
    else:
        w = quants.dequantize_q6_k(rows, padded=weight.padded)
    y = (xq.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32)
    if out is None:
        return y
    out[...] = y
    return out


@contextmanager
def emulated_gpu():
    """Patch cupy (numpy), the prefill launchers (engine.gpu.ops.*) and engine.gpu.ops.mmq.mmq for the duration."""
    from engine.gpu import ops

    saved_mod = sys.modules.get("cupy")
    patches = {(ops.embed, "embed"): emu_embed, (ops.norm, "add_rmsnorm_q8_1"): emu_add_rmsnorm_q8_1,
               (ops.rope, "qkv_rope"): emu_qkv_rope, (ops.attention, "attention_prefill"): emu_attention_prefill,
               (ops.activation, "swiglu_q8_1"): emu_swiglu_q8_1, (ops.mmq, "mmq"): emu_mmq}
    saved = {key: getattr(*key) for key in patches}
    sys.modules["cupy"] = _fake_cupy()
    try:
        for (mod, name), fn in patches.items():
            setattr(mod, name, fn)
        yield
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)
        if saved_mod is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved_mod
