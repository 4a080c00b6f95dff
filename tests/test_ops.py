"""GPU ops against their oracles, driven by engine.reference.op_table (one row per op and shape
case): launch the engine.gpu.ops launcher on poisoned outputs, compare with the numpy oracle
within the table's bound (0: bit-exact).

LAUNCH[name](cp, inp, case) uploads the inputs and poisons the outputs, and returns (run, fetch):
run() launches the op (no host work, no synchronization), fetch() -> float64 ndarray shaped as
the oracle's. dev/op_bench.py times run() with the same table."""
from __future__ import annotations

import numpy as np
import pytest

from engine.reference import op_table

pytestmark = pytest.mark.gpu


def _launch_quantize_q8_1(cp, inp, case):
    from engine.gpu.ops import q8

    T, K = case["T"], case["K"]
    out = q8.Q8Act(cp.full((T, K), -128, dtype=cp.int8),            # poison: never produced
                   cp.full((T, K // 32, 2), np.nan, dtype=cp.float32))
    x = cp.asarray(inp["x"])

    def fetch():
        ds = cp.asnumpy(out.ds).astype(np.float64)
        return np.concatenate([cp.asnumpy(out.q).astype(np.float64).reshape(-1),
                               ds[..., 0].reshape(-1), ds[..., 1].reshape(-1)])
    return (lambda: q8.quantize_q8_1(x, out=out)), fetch


def _launch_mmq(cp, inp, case):
    from engine.gpu.ops import mmq
    from engine.gpu.weights import upload_weight

    kind, T, N = inp["kind"], case["T"], case["N"]
    if kind == "q6_k":
        wd = upload_weight(inp["w"], "Q6_K", pad_q6k=inp["padded"])
        assert wd.padded == inp["padded"]
    else:
        wd = upload_weight(inp["w"], "Q4_K")
    act = mmq.quantize_q8_1(cp.asarray(inp["x"]))
    y = cp.full((T, N), np.nan, dtype=cp.float32)                    # poison
    return (lambda: mmq.mmq(wd, act, out=y, variant=case["variant"])), (lambda: cp.asnumpy(y).astype(np.float64))


def _upload(cp, rows, kind, padded):
    from engine.gpu.weights import upload_weight

    return upload_weight(rows, "Q4_K" if kind == "q4_k" else "Q6_K", pad_q6k=padded)


def _launch_mmvq(cp, inp, case):
    from engine.gpu.ops.mmvq import mmvq_launch

    kind, padded, mode, N = inp["kind"], inp["padded"], inp["mode"], case["N"]
    ws = [_upload(cp, inp["w"], kind, padded)]
    if mode == "swiglu":
        ws.append(_upload(cp, inp["w2"], kind, padded))
    ds = np.stack([np.asarray(inp["d"], np.float32).reshape(-1), np.asarray(inp["s"], np.float32).reshape(-1)], -1)
    xq, xds = cp.asarray(inp["q"].reshape(-1)), cp.asarray(ds)
    y = cp.asarray(inp["y0"]) if mode == "add" else cp.full(N, np.nan, dtype=cp.float32)   # poison
    return (lambda: mmvq_launch(ws, [y], xq, xds, mode)), (lambda: cp.asnumpy(y).astype(np.float64))


def _launch_embed(cp, inp, case):
    from engine.gpu import ops

    table = _upload(cp, inp["rows"], inp["kind"], inp["padded"])
    ids = cp.asarray(inp["ids"])
    x = cp.full((case["n"], case["K"]), np.nan, dtype=cp.float32)   # poison
    return (lambda: ops.embed.embed(table, ids, x)), (lambda: cp.asnumpy(x).astype(np.float64))


def _q8_poisoned(cp, T, K):
    from engine.gpu.ops.q8 import Q8Act

    return Q8Act(cp.full((T, K), 0x55, dtype=cp.int8), cp.full((T, K // 32, 2), np.nan, dtype=cp.float32))


def _launch_add_rmsnorm_q8_1(cp, inp, case):
    from engine.gpu import ops

    R, K = case["R"], case["K"]
    xd = cp.asarray(inp["x"])
    yd = cp.asarray(inp["y"]) if inp["y"] is not None else None
    wd = cp.asarray(inp["w"])
    act = _q8_poisoned(cp, R, K)
    hout = cp.full((R, K), np.nan, dtype=cp.float32)
    return ((lambda: ops.norm.add_rmsnorm_q8_1(xd, yd, wd, inp["eps"], act, hout=hout)),
            (lambda: np.concatenate([cp.asnumpy(xd).astype(np.float64).reshape(-1),
                                     cp.asnumpy(hout).astype(np.float64).reshape(-1)])))


def _launch_qkv_rope(cp, inp, case):
    from engine.gpu import ops

    H, KVH, n, start, maxT, hd = inp["H"], inp["KVH"], inp["n"], inp["start"], inp["maxT"], case["hd"]
    qd, kvd = H * hd, KVH * hd
    ld = qd + 2 * kvd
    d = cp.asarray(inp["qkv"])
    b = [None if inp[k] is None else cp.asarray(inp[k]) for k in ("bq", "bk", "bv")]
    cos, sin = cp.asarray(inp["cos_all"]), cp.asarray(inp["sin_all"])
    qout = cp.full((H, n, hd), np.nan, dtype=cp.float16)
    kc = cp.full((KVH, maxT, hd), np.nan, dtype=cp.float16)
    vc = cp.full((KVH, maxT, hd), np.nan, dtype=cp.float16)

    def run():
        ops.rope.qkv_rope(d[:, :qd], d[:, qd:qd + kvd], d[:, qd + kvd:], (ld, ld, ld), *b, cos, sin,
                          qout, kc, vc, start, inp["neox"], H, KVH, hd)

    def fetch():
        gq, gk, gv = cp.asnumpy(qout), cp.asnumpy(kc), cp.asnumpy(vc)
        outside = np.concatenate([gk[:, :start], gk[:, start + n:], gv[:, :start], gv[:, start + n:]], axis=1)
        return np.concatenate([gq.astype(np.float64).reshape(-1),
                               gk[:, start:start + n].astype(np.float64).reshape(-1),
                               gv[:, start:start + n].astype(np.float64).reshape(-1),
                               np.isnan(outside.astype(np.float32)).astype(np.float64).reshape(-1)])
    return run, fetch


def _launch_attention_prefill(cp, inp, case):
    from engine.gpu import ops

    qd, kd, vd = cp.asarray(inp["q"]), cp.asarray(inp["k"]), cp.asarray(inp["v"])
    out = cp.full((case["n"], case["H"] * case["hd"]), np.nan, dtype=cp.float32)   # poison
    return ((lambda: ops.attention.attention_prefill(qd, kd, vd, inp["start"], out_f32=out)),
            (lambda: cp.asnumpy(out).astype(np.float64)))


def _launch_attention_decode(cp, inp, case):
    from engine.gpu.ops.attention import attention_launch

    H, KVH, hd, L, S = case["H"], case["KVH"], case["hd"], case["L"], case["splits"]
    k, v = inp["k"], inp["v"]
    T = k.shape[0]
    if case["layout"] == "thd":
        kd, vd, ts, hs = cp.asarray(k), cp.asarray(v), KVH * hd, hd
    else:
        kd = cp.asarray(np.ascontiguousarray(k.transpose(1, 0, 2)))
        vd = cp.asarray(np.ascontiguousarray(v.transpose(1, 0, 2)))
        ts, hs = hd, T * hd
    q = cp.asarray(inp["q"])
    pos = cp.asarray(np.array([L - 1], dtype=np.int32))
    part_o = cp.full((H, S, hd), np.nan, dtype=cp.float32)
    part_ml = cp.full((H, S, 2), np.nan, dtype=cp.float32)
    out = cp.full(H * hd, np.nan, dtype=cp.float32)
    oq = cp.full(H * hd, 127, dtype=cp.int8)
    ods = cp.full((H * hd // 32, 2), np.nan, dtype=cp.float32)
    return ((lambda: attention_launch(q, kd, vd, ts, hs, pos, H, KVH, hd, case["kv"], S, part_o, part_ml,
                                      oq, ods, out=out)),
            (lambda: cp.asnumpy(out).astype(np.float64)))


def _launch_argmax(cp, inp, case):
    from engine.gpu import kernels

    V = case["V"]
    k = kernels.get_kernel("argmax.cu", "argmax_step")
    x = cp.asarray(inp["x"])
    state = cp.asarray(np.array([-1, 10, 0, 0], dtype=np.int32))
    hist = cp.full(8, -7, dtype=cp.int32)
    best = cp.full(1, np.nan, dtype=cp.float32)

    def fetch():
        st = cp.asnumpy(state)
        return np.array([st[0], st[1], st[2], cp.asnumpy(hist)[0]], dtype=np.float64)
    return (lambda: k((1,), (1024,), (x, np.int32(V), state, hist, np.int32(8), best))), fetch


LAUNCH = {"quantize_q8_1": _launch_quantize_q8_1, "add_rmsnorm_q8_1": _launch_add_rmsnorm_q8_1,
          "qkv_rope": _launch_qkv_rope, "attention_prefill": _launch_attention_prefill,
          "attention_decode": _launch_attention_decode, "argmax": _launch_argmax,
          **{n: _launch_mmq for n in op_table.OPS if n.startswith("mmq_")},
          **{n: _launch_mmvq for n in op_table.OPS if n.startswith("mmvq_")},
          **{n: _launch_embed for n in op_table.OPS if n.startswith("embed_")}}


def _bound(name, inp, case):
    op = op_table.OPS[name]
    if name.startswith("mmq"):
        from engine.gpu import kernels

        kind = inp["kind"]
        return op.bound(inp, **case, tc_min_term=kernels.mmq_uses_tc(kind, case["variant"]))
    return op.bound(inp, **case)


def test_table_and_launchers_agree():
    assert set(LAUNCH) == set(op_table.OPS)


@pytest.mark.parametrize("name,case", op_table.cases(),
                         ids=[f"{n}-" + "-".join(f"{k}{v}" for k, v in c.items()) for n, c in op_table.cases()])
def test_op(cp, name, case):
    op = op_table.OPS[name]
    if getattr(cp, "__emulated__", False) and op.emu_skip(**case):
        pytest.skip("too big for the CPU emulator")
    rng = np.random.default_rng(11)
    inp = op.inputs(rng, **case)
    ref = op.oracle(inp)
    run, fetch = LAUNCH[name](cp, inp, case)
    run()
    got = fetch()
    bound = _bound(name, inp, case)
    assert got.shape == ref.shape
    if np.all(np.asarray(bound) == 0):
        # bit-exact ops: compare the float32 bits (NaN poison or a -0/+0 slip is a failure)
        bad = got.astype(np.float32).view(np.uint32) != ref.astype(np.float32).view(np.uint32)
    else:
        bad = ~np.isfinite(got) | (np.abs(got - ref) > bound)
    assert not bad.any(), f"{name} {case}: {int(bad.sum())} of {bad.size} outside the bound"
