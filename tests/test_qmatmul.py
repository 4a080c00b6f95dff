"""The CPU backend's quantized matrices (engine/reference/qmatmul.py, numba) against numpy:
the dequantizer bit for bit, the fused product within float32 rounding, every token's outputs
independent of the step's size; the default choice between float32 and quantized matrices; and
the numpy fallback when numba is missing."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from engine.formats.qtypes import qtype
from engine.formats.weights import LAYER_MATRICES, layer_name, open_model
from engine.reference import model as refmodel
from engine.reference.mmq import random_blocks
from engine.reference.model import AUTO_F32_MAX, FUSED_MAX_T, ReferenceModel, default_quantized
from engine.reference.ops import dequantize_rows

qmatmul = pytest.importorskip("engine.reference.qmatmul")


def _matrices(path):
    """Every q4_K / q6_K matrix of a model file: (name, kind, TensorInfo)."""
    mf = open_model(path)
    out = []
    for t in [mf.output_tensor] + [mf.tensor(layer_name(i, r)) for i in range(mf.config.n_layers)
                                   for r in LAYER_MATRICES]:
        kind = qtype(t.type_name).kind
        if kind in qmatmul.KINDS:
            out.append((t.name, kind, t))
    return out


@pytest.fixture(scope="module")
def tiny_matrices(tiny_model_path, tiny_qwen2_model_path):
    mats = _matrices(tiny_model_path) + _matrices(tiny_qwen2_model_path)
    assert {k for _, k, _ in mats} == {"q4_k", "q6_k"}
    return mats


def _bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_dequantize_is_bit_identical_to_numpy(tiny_matrices):
    for name, kind, t in tiny_matrices:
        q = qmatmul.QuantMatrix(kind, t.data)
        want = dequantize_rows(t)
        assert np.array_equal(_bits(q.dequantize(0, np.empty_like(want))), _bits(want)), name
        r0, n = want.shape[0] // 3, max(1, want.shape[0] // 4)
        part = q.dequantize(r0, np.empty((n, want.shape[1]), np.float32))
        assert np.array_equal(_bits(part), _bits(want[r0:r0 + n])), name


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_dequantize_random_blocks_bit_identical(kind):
    """Random quants, scales and mins, including subnormal and zero f16 scales."""
    blocks = random_blocks(np.random.default_rng(3), kind, 37, 768)
    want = qtype(kind).dequantize(blocks)
    got = qmatmul.QuantMatrix(kind, blocks).dequantize(0, np.empty_like(want))
    assert np.array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("T", [1, 2, 5, FUSED_MAX_T, 33])
def test_matmul_t_matches_numpy_product(tiny_matrices, T):
    rng = np.random.default_rng(T)
    for name, kind, t in tiny_matrices:
        w = dequantize_rows(t)
        h = rng.standard_normal((T, w.shape[1])).astype(np.float32)
        want = h.astype(np.float64) @ w.astype(np.float64).T
        got = qmatmul.QuantMatrix(kind, t.data).matmul_t(h)
        assert got.dtype == np.float32 and got.shape == (T, w.shape[0])
        # float32 sums of K products: a few units of rounding of the largest partial sums
        tol = 1e-6 * w.shape[1] ** 0.5 * (np.abs(h) @ np.abs(w).T).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=name)


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_each_token_gets_the_same_bits_alone_and_in_a_step(kind):
    """The per-(row, token) summation order depends on K alone: the single-token kernel and the
    T-token kernel agree bit for bit, whatever the other tokens of the step."""
    rng = np.random.default_rng(11)
    q = qmatmul.QuantMatrix(kind, random_blocks(rng, kind, 50, 1024))
    h = rng.standard_normal((9, 1024)).astype(np.float32)
    full = q.matmul_t(h)
    for i in range(h.shape[0]):
        assert np.array_equal(_bits(q.matmul_t(h[i:i + 1])[0]), _bits(full[i])), i
    assert np.array_equal(_bits(q.matmul_t(h[3:7])), _bits(full[3:7]))


def test_quantized_model_matches_float32_model(tiny_model_path):
    mf = open_model(tiny_model_path)
    f32, quant = ReferenceModel(mf), ReferenceModel(mf, quantized=True)
    assert not f32.quantized and quant.quantized
    assert quant.resident_bytes < f32.resident_bytes / 3
    ids = [3, 17, 42, 5, 99, 7, 1, 2, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19, 20]
    for n in (1, 6, FUSED_MAX_T, FUSED_MAX_T + 1, len(ids)):       # fused, and chunks + BLAS
        want = f32.forward(ids[:n], f32.new_cache(32), all_logits=True)
        got = quant.forward(ids[:n], quant.new_cache(32), all_logits=True)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    cache = quant.new_cache(32)
    quant.forward(ids[:6], cache)
    step = quant.forward([9], cache)
    full = quant.forward(ids[:6] + [9], quant.new_cache(32), all_logits=True)
    np.testing.assert_allclose(step, full[-1], rtol=0, atol=1e-4 * np.abs(full).max())


def test_decoder_row_same_bits_alone_and_batched(tiny_qwen2_model_path):
    """A decoder's token in a step of up to FUSED_MAX_T rows (other decoders, a prompt chunk)
    gets the bits it gets alone: engine/reference/batch.py runs hidden_batch then logits_of."""
    m = ReferenceModel(open_model(tiny_qwen2_model_path), quantized=True)
    prompt = [5, 6, 7, 8, 9]

    def primed():
        c = m.new_cache(16)
        m.hidden(prompt, c)
        return c

    alone = m.logits_of(m.hidden([11], primed())[-1:])
    other = m.new_cache(16)
    h = m.hidden_batch([([1, 2, 3, 4], other), ([11], primed())])
    assert h.shape[0] <= FUSED_MAX_T
    batched = m.logits_of(h[[3, 4]])
    assert np.array_equal(_bits(batched[1]), _bits(alone[0]))


def test_default_choice():
    assert default_quantized(AUTO_F32_MAX + 1, None)
    assert not default_quantized(AUTO_F32_MAX, None)
    assert not default_quantized(10 * AUTO_F32_MAX, 0)               # an explicit budget rules
    assert not default_quantized(10 * AUTO_F32_MAX, 2**40)


def test_default_choice_on_a_model(tiny_model_path, monkeypatch):
    mf = open_model(tiny_model_path)
    monkeypatch.delenv("GGUF_PREFILL_CPU_F32_GIB", raising=False)
    assert not ReferenceModel(mf).quantized                          # tiny: float32, as before
    monkeypatch.setattr(refmodel, "AUTO_F32_MAX", 0)                 # as if it were large
    m = ReferenceModel(mf)
    assert m.quantized and all(layer["ffn_up"].q is not None for layer in m.layers)
    monkeypatch.setenv("GGUF_PREFILL_CPU_F32_GIB", "0")              # explicit: today's behaviour
    m = ReferenceModel(mf)
    assert not m.quantized and all(layer["ffn_up"].w is None and layer["ffn_up"].q is None
                                   for layer in m.layers)


def test_without_numba_falls_back_to_numpy_with_one_warning(tiny_model_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)                  # `import numba` fails
    monkeypatch.delitem(sys.modules, "engine.reference.qmatmul")
    mf = open_model(tiny_model_path)
    with pytest.warns(RuntimeWarning, match="numba") as caught:
        m = ReferenceModel(mf, quantized=True)
    assert len(caught) == 1
    assert not m.quantized
    assert all(a.w is None and a.q is None for layer in m.layers for k, a in layer.items()
               if k in LAYER_MATRICES)
    ids = [3, 17, 42, 5]
    want = ReferenceModel(mf).forward(ids, m.new_cache(4), all_logits=True)
    np.testing.assert_allclose(m.forward(ids, m.new_cache(4), all_logits=True), want, rtol=1e-6, atol=1e-6)


def test_engine_imports_no_numba_for_float32_models(tiny_model_path):
    """The GPU image has no numba: the reference model loads small models without it."""
    code = ("import sys; sys.modules['numba'] = None\n"
            "from engine.loader import load_model\n"
            f"m = load_model({tiny_model_path!r}, device='cpu')\n"
            "m.forward([1, 2, 3], m.new_cache(3))\n"
            "assert not m.quantized\n")
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, timeout=120)
