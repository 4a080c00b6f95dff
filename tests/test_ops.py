"""GPU ops against their oracles, driven by engine.reference.op_table (one row per op and shape
case): launch the engine.gpu.ops launcher on poisoned outputs, compare with the numpy oracle
within the table's bound (0: bit-exact)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.reference import op_table

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no CUDA device")
    return cupy


def _launch_quantize_q8_1(cp, inp, case):
    from engine.gpu.ops import q8

    T, K = case["T"], case["K"]
    out = q8.Q8Act(cp.full((T, K), -128, dtype=cp.int8),            # poison: never produced
                   cp.full((T, K // 32, 2), np.nan, dtype=cp.float32))
    act = q8.quantize_q8_1(cp.asarray(inp["x"]), out=out)
    ds = cp.asnumpy(act.ds).astype(np.float64)
    return np.concatenate([cp.asnumpy(act.q).astype(np.float64).reshape(-1),
                           ds[..., 0].reshape(-1), ds[..., 1].reshape(-1)])


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
    mmq.mmq(wd, act, out=y, variant=case["variant"])
    return cp.asnumpy(y).astype(np.float64)


LAUNCH = {"quantize_q8_1": _launch_quantize_q8_1, "mmq_q4_k": _launch_mmq,
          "mmq_q6_k_raw": _launch_mmq, "mmq_q6_k_padded": _launch_mmq}


def _bound(name, inp, case):
    op = op_table.OPS[name]
    if name.startswith("mmq"):
        from engine.gpu import kernels

        kind = inp["kind"]
        return op.bound(inp, **case, tc_min_term=kernels.mmq_uses_tc(kind, case["variant"]))
    return op.bound(inp, **case)


@pytest.mark.parametrize("name,case", op_table.cases(),
                         ids=[f"{n}-" + "-".join(f"{k}{v}" for k, v in c.items()) for n, c in op_table.cases()])
def test_op(cp, name, case):
    assert set(LAUNCH) == set(op_table.OPS)
    op = op_table.OPS[name]
    rng = np.random.default_rng(11)
    inp = op.inputs(rng, **case)
    ref = op.oracle(inp)
    got = LAUNCH[name](cp, inp, case)
    bound = _bound(name, inp, case)
    assert got.shape == ref.shape
    if np.all(np.asarray(bound) == 0):
        # bit-exact ops: compare the float32 bits (NaN poison or a -0/+0 slip is a failure)
        bad = got.astype(np.float32).view(np.uint32) != ref.astype(np.float32).view(np.uint32)
    else:
        bad = ~np.isfinite(got) | (np.abs(got - ref) > bound)
    assert not bad.any(), f"{name} {case}: {int(bad.sum())} of {bad.size} outside the bound"
