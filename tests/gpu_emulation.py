"""Run engine.gpu.model.GPUModel on the CPU: numpy stands in for cupy and each GPU launcher is
replaced by the numpy reference of the same numerics (engine/reference/numerics.py: q8_1 MMQ
inputs, f16 inputs and f16-rounded weights in the Hopper GEMMs, f16 Q/K/V/P in attention, f32
elsewhere). The Hopper path runs where a test sets GPUModel.wgmma_min_tokens (the fake device
is no sm_90). This file is only the plumbing: a fake cupy and
the launchers patched for the duration of `emulated_gpu()`.

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

import sys
import types
from contextlib import contextmanager

import numpy as np

from engine.formats import quants
from engine.reference import numerics


def _fake_cupy() -> types.ModuleType:
    cp = types.ModuleType("cupy")
    for name in ("empty", "zeros", "full", "asarray", "concatenate", "float16", "float32", "int8",
                 "int32", "uint8", "ndarray", "arange"):
        setattr(cp, name, getattr(np, name))
    cp.asnumpy = lambda a: np.array(a)

    class _Device:
        id = 0
        attributes = {"MultiProcessorCount": 132}

        def synchronize(self):
            pass

    class _Event:
        def __init__(self, disable_timing=False):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

    cuda = types.SimpleNamespace(Device=lambda *a: _Device(), Event=_Event,
                                 get_elapsed_time=lambda a, b: 0.0, get_current_stream=lambda: None)
    cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: 0)
    cp.cuda = cuda
    return cp


def _store_q8(q8, act) -> None:
    """(q, d, s) into a Q8Act's planes: act.q int8 [R, K], act.ds float32 [R, K/32, 2] = (d, s)."""
    q, d, s = q8
    act.q[...] = q
    act.ds[..., 0] = d
    act.ds[..., 1] = s


# Each launcher of engine.gpu.ops, with the launcher's signature, over engine.reference.numerics.

def emu_embed(table, ids, x):
    x[...] = numerics.embed(table.data[np.asarray(ids, dtype=np.int64)], table.kind, table.padded)


def emu_add_rmsnorm_q8_1(x, y, w, eps, act, hout=None):
    xs, h, q8 = numerics.rmsnorm_q8_1(x, w, eps, y)
    if y is not None:
        x[...] = xs
    if hout is not None:
        hout[...] = h
    _store_q8(q8, act)


def emu_add_rmsnorm_x16(x, y, w, eps, xt):
    xs, _, tiled = numerics.rmsnorm_x16(x, w, eps, y)
    if y is not None:
        x[...] = xs
    xt[...] = tiled


def emu_qkv_rope(q, k, v, lds, bq, bk, bv, cos, sin, qout, kc, vc, start, neox, n_heads, n_kv_heads, head_dim,
                 start_dev=None, rows=None):
    start += 0 if start_dev is None else int(start_dev[0])
    n = qout.shape[1]
    if rows is None:
        pos = cache_rows = np.arange(start, start + n)
    else:
        pos, cache_rows = (np.asarray(a, dtype=np.int64) for a in rows)
    qh, kh, vh = numerics.qkv_rope_f16(q, k, v, bq, bk, bv, cos[pos], sin[pos],
                                       n_heads, n_kv_heads, head_dim, neox)
    qout[...] = qh
    kc[:, cache_rows] = kh
    vc[:, cache_rows] = vh


def _store_attention(o, out_act, out_f32, out_x16):
    from engine.reference.wgmma import tile_x16

    if out_f32 is not None:
        out_f32[...] = o
    elif out_x16 is not None:
        out_x16[...] = tile_x16(o)
    else:
        _store_q8(quants.quantize_q8_1(o), out_act)


def emu_attention_prefill(qh, kc, vc, start, out_act=None, out_f32=None, start_dev=None, variant=None, out_x16=None):
    start += 0 if start_dev is None else int(start_dev[0])
    _store_attention(numerics.attention_f16(qh, kc, vc, start), out_act, out_f32, out_x16)


def emu_attention_varlen(qh, kc, vc, tiles_dev, out_act=None, out_f32=None, decode=None, out_x16=None):
    T, QD = qh.shape[1], qh.shape[0] * qh.shape[2]
    o = np.zeros((T, QD), dtype=np.float32)
    for row0, nq, pos0, kvb in np.asarray(tiles_dev):
        if nq > 0:
            o[row0:row0 + nq] = numerics.attention_f16(qh[:, row0:row0 + nq], kc[:, kvb:], vc[:, kvb:], pos0)
    for row, keys, kvb, _ in (np.asarray(decode.rows) if decode is not None else ()):
        if keys > 0:
            o[row:row + 1] = numerics.attention_f16(qh[:, row:row + 1], kc[:, kvb:], vc[:, kvb:], keys - 1)
    _store_attention(o, out_act, out_f32, out_x16)


def emu_swiglu_q8_1(g, u, ld, F, act):
    _store_q8(numerics.swiglu_q8_1(g, u), act)


def emu_swiglu_x16(g, u, ld, F, xt, T):
    xt[...] = numerics.swiglu_x16(g, u)


def emu_tile_x16(x, out=None):
    from engine.reference.wgmma import tile_x16

    t = tile_x16(x)
    if out is None:
        return t
    out[...] = t
    return out


def emu_tiled_buffer(T, K):
    from engine.gpu.ops.wgmma import tiled_shape

    return np.zeros(tiled_shape(T, K), dtype=np.float16)


def emu_wgmma(weight, xt, T, out=None):
    y = numerics.wgmma_f16(weight.data, weight.kind, numerics.untile_x16(xt, T), weight.padded)
    if out is None:
        return y
    out[...] = y
    return out


def emu_wgmma_pair(wa, wb, xt, T, out_a=None, out_b=None):
    return emu_wgmma(wa, xt, T, out_a), emu_wgmma(wb, xt, T, out_b)


def emu_wgmma_swiglu(weight, xt, T, out=None):
    y, F = emu_wgmma(weight, xt, T), weight.rows // 2
    h = numerics.swiglu_x16(y[:, :F], y[:, F:])
    if out is None:
        return h
    out[...] = h
    return out


def emu_wgmma_qkv_rope(weights, xt, T, bq, bk, bv, cos, sin, qout, kc, vc, start, neox, n_heads, n_kv_heads,
                       head_dim, start_dev=None, rows=None):
    y = np.concatenate([emu_wgmma(w, xt, T) for w in weights], axis=1)
    qd, kvd = n_heads * head_dim, n_kv_heads * head_dim
    emu_qkv_rope(y[:, :qd], y[:, qd:qd + kvd], y[:, qd + kvd:], None, bq, bk, bv, cos, sin, qout, kc, vc, start, neox,
                 n_heads, n_kv_heads, head_dim, start_dev, rows)


def emu_mmq(weight, act, out=None, variant=None):
    y = numerics.mmq_q8_1(weight.data, weight.kind, act.q, act.ds[..., 0], weight.padded)
    if out is None:
        return y
    out[...] = y
    return out


def emu_gather_add_rows(x, y, sel, out):
    out[...] = x[np.asarray(sel)] + y[np.asarray(sel)]


def emu_argmax_rows(logits_2d, ids_out, best_out=None):
    ids_out[...] = np.argmax(logits_2d, axis=1)
    if best_out is not None:
        best_out[...] = logits_2d[np.arange(logits_2d.shape[0]), ids_out]


def emu_record_last(chosen, slot, last):
    for c, s in zip(np.asarray(chosen), np.asarray(slot)):
        if s >= 0:
            last[s] = c


def emu_resolve_follow(ids, last):
    follow = ids < 0
    ids[follow] = last[-ids[follow] - 1]


def emu_upload_async(dst, host, stream):
    dst[...] = host


def emu_download_async(src, host, stream):
    host[...] = src


@contextmanager
def emulated_gpu():
    """Patch cupy (numpy), the prefill launchers (engine.gpu.ops.*) and engine.gpu.ops.mmq.mmq for the
    duration; prompts and batched steps run eager (no CUDA graph: engine.gpu.model's graph_tokens
    says None, engine.gpu.batch.GPUBatch._replay enqueues)."""
    from engine.gpu import batch as gpu_batch, model as gpu_model, ops

    saved_mod = sys.modules.get("cupy")
    patches = {(ops.embed, "embed"): emu_embed, (ops.norm, "add_rmsnorm_q8_1"): emu_add_rmsnorm_q8_1,
               (ops.rope, "qkv_rope"): emu_qkv_rope, (ops.attention, "attention_prefill"): emu_attention_prefill,
               (ops.attention, "attention_varlen"): emu_attention_varlen,
               (ops.activation, "swiglu_q8_1"): emu_swiglu_q8_1, (ops.mmq, "mmq"): emu_mmq,
               (ops.norm, "add_rmsnorm_x16"): emu_add_rmsnorm_x16, (ops.activation, "swiglu_x16"): emu_swiglu_x16,
               (ops.wgmma, "tile_x16"): emu_tile_x16, (ops.wgmma, "tiled_buffer"): emu_tiled_buffer,
               (ops.wgmma, "wgmma"): emu_wgmma, (ops.wgmma, "wgmma_pair"): emu_wgmma_pair,
               (ops.wgmma, "wgmma_swiglu"): emu_wgmma_swiglu, (ops.wgmma, "wgmma_qkv_rope"): emu_wgmma_qkv_rope,
               (ops.norm, "gather_add_rows"): emu_gather_add_rows, (ops.argmax, "argmax_rows"): emu_argmax_rows,
               (ops.argmax, "record_last"): emu_record_last, (ops.argmax, "resolve_follow"): emu_resolve_follow,
               (gpu_batch, "pinned_int32"): lambda n: np.zeros(n, np.int32),
               (gpu_batch, "upload_async"): emu_upload_async, (gpu_batch, "download_async"): emu_download_async,
               (gpu_model, "graph_tokens"): lambda n, start, capacity: None,
               (gpu_batch.GPUBatch, "_replay"): lambda self, sb: sb.enqueue(self)}
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
