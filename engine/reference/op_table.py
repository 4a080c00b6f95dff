"""The table of ops that drives the GPU op tests (tests/test_ops.py), as llama.cpp's
test-backend-ops does: per op its shape cases, the input builder, the numpy oracle and the error
bound. Shapes, oracles and bounds only (no GPU imports), so a benchmark can read it too.

    OPS[name] = Op(cases, inputs(rng, **case) -> dict, oracle(inputs) -> ndarray,
                   bound(inputs, **case) -> float or ndarray of |gpu - oracle| allowed (0: bit-exact))

The GPU launch of each op is in tests/test_ops.py (LAUNCH, by the same name). Covered so far:
quantize_q8_1 and the prefill GEMMs (mmq q4_K, q6_K raw, q6_K padded); the other ops of issue 11
(mmvq, embed, add_rmsnorm_q8_1, qkv_rope, attention, swiglu_q8_1, argmax) are still tested by
tests/test_gpu_model.py / test_gpu_decode.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from engine.formats import quants as Q
from engine.reference.mmq import abs_terms, error_bound, mmq_reference, random_blocks


@dataclass(frozen=True)
class Op:
    cases: tuple[dict, ...]
    inputs: Callable[..., dict]
    oracle: Callable[[dict], np.ndarray]
    bound: Callable[..., object]


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


OPS: dict[str, Op] = {
    "quantize_q8_1": Op(tuple({"T": T, "K": K} for T, K in ((1, 256), (7, 4096), (65, 11008))),
                        _q8_inputs, _q8_oracle, lambda inp, **c: 0.0),
    "mmq_q4_k": Op(_mmq_cases("q4_k"), _mmq_inputs("q4_k", False), _mmq_oracle, _mmq_bound),
    "mmq_q6_k_raw": Op(_mmq_cases("q6_k"), _mmq_inputs("q6_k", False), _mmq_oracle, _mmq_bound),
    "mmq_q6_k_padded": Op(_mmq_cases("q6_k"), _mmq_inputs("q6_k", True), _mmq_oracle, _mmq_bound),
}


def cases() -> list[tuple[str, dict]]:
    """(op name, case) of every table row, for pytest.mark.parametrize and benchmarks."""
    return [(name, c) for name, op in OPS.items() for c in op.cases]
