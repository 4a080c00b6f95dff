"""The numpy reference forward: its ops against plain formulas, and KV-cache consistency."""
from __future__ import annotations

import numpy as np
import pytest

from engine.formats.config import ModelConfig
from engine.generate import generate, top_two
from engine.formats.rope import rope_tables
from engine.reference.model import ReferenceModel
from engine.reference.ops import apply_rope, causal_attention, rms_norm


def cfg(rope_type="normal", hd=8):
    return ModelConfig(arch="llama", n_layers=1, d_model=4 * hd, n_heads=4, n_kv_heads=2, head_dim=hd,
                       d_ff=64, vocab_size=10, n_ctx_train=64, rope_base=10000.0, rope_type=rope_type,
                       rms_eps=1e-5, has_qkv_bias=False, tied_output=False)


def test_rms_norm():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-6)


def test_rope_normal_rotates_adjacent_pairs_and_neox_rotates_halves():
    c = cfg(hd=8)
    pos = np.array([0, 1, 5, 100])
    cos, sin = rope_tables(c, pos)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 2, 8)).astype(np.float32)
    normal = apply_rope(x, cos, sin, "normal")
    neox = apply_rope(x, cos, sin, "neox")
    np.testing.assert_allclose(normal[0], x[0], atol=1e-7)  # position 0: identity
    # pair (0, 1) of normal is rotated by angle pos * base^0 = pos
    ang = pos[:, None].astype(np.float64)
    want0 = x[..., 0] * np.cos(ang) - x[..., 1] * np.sin(ang)
    np.testing.assert_allclose(normal[..., 0], want0, rtol=1e-5, atol=1e-5)
    # neox pairs (i, i + hd/2): same rotation as normal applied to the interleaved permutation
    perm = np.array([0, 4, 1, 5, 2, 6, 3, 7])
    np.testing.assert_allclose(apply_rope(x[..., perm], cos, sin, "normal"), neox[..., perm], atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(neox, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def naive_attention(q, k, v, start):
    n, H, hd = q.shape
    group = H // k.shape[1]
    out = np.zeros((n, H, hd))
    for i in range(n):
        for h in range(H):
            kk, vv = k[: start + i + 1, h // group], v[: start + i + 1, h // group]
            s = kk @ q[i, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vv
    return out.reshape(n, H * hd)


@pytest.mark.parametrize("start,n,chunk", [(0, 7, 256), (5, 9, 4), (0, 1, 256)])
def test_causal_gqa_attention_matches_naive(start, n, chunk):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((n, 4, 8)).astype(np.float32)
    k = rng.standard_normal((start + n, 2, 8)).astype(np.float32)
    v = rng.standard_normal((start + n, 2, 8)).astype(np.float32)
    got = causal_attention(q, k, v, start, query_chunk=chunk)
    np.testing.assert_allclose(got, naive_attention(q, k, v, start), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2"])
def tiny_ref(request, tiny_model_path, tiny_qwen2_model_path):
    return ReferenceModel.from_path(tiny_model_path if request.param == "tiny" else tiny_qwen2_model_path)


def test_incremental_forward_equals_one_prefill(tiny_ref):
    ids = [3, 17, 42, 5, 99, 7, 1, 250, 11, 12]
    full = tiny_ref.forward(ids, tiny_ref.new_cache(len(ids)), all_logits=True)
    assert full.shape == (len(ids), tiny_ref.config.vocab_size) and np.isfinite(full).all()
    cache = tiny_ref.new_cache(len(ids))
    part = tiny_ref.forward(ids[:4], cache, all_logits=True)
    np.testing.assert_allclose(part, full[:4], rtol=1e-4, atol=1e-4)
    for i in range(4, len(ids)):
        step = tiny_ref.forward([ids[i]], cache)
        np.testing.assert_allclose(step, full[i], rtol=1e-4, atol=1e-4)
    assert cache.length == len(ids)


def test_synthetic_logits_are_peaked_and_greedy_is_deterministic(tiny_ref):
    prompt = [1, 2, 3, 4, 5]
    a = generate(tiny_ref, prompt, 8)
    b = generate(tiny_ref, prompt, 8)
    assert a.tokens == b.tokens and len(a.tokens) == 8
    assert np.median(a.margins) > 0.5  # synthetic weights are scaled for clear top-1 margins


def test_top_two_ties_go_to_lowest_id():
    best, top, margin = top_two(np.array([1.0, 3.0, 3.0, 0.0], dtype=np.float32))
    assert (best, top, margin) == (1, 3.0, 0.0)


def test_kv_cache_overflow_and_bad_ids_are_clear_errors(tiny_ref):
    from engine.errors import GGUFError

    with pytest.raises(GGUFError, match="exceed the KV cache"):
        tiny_ref.forward([1, 2, 3], tiny_ref.new_cache(2))
    with pytest.raises(GGUFError, match="outside the vocabulary"):
        tiny_ref.forward([tiny_ref.config.vocab_size], tiny_ref.new_cache(2))


@pytest.mark.parametrize("budget", [0, 400_000])
def test_f32_budget_keeps_the_logits(tiny_ref, budget):
    """Matrices past the float32 budget are dequantized per forward: same W rows, same logits;
    the resident figure drops to the quantized bytes of those matrices."""
    ids = [3, 17, 42, 5, 99, 7]
    lean = ReferenceModel(tiny_ref.file, f32_bytes=budget)
    assert lean.resident_bytes < tiny_ref.resident_bytes
    want = tiny_ref.forward(ids, tiny_ref.new_cache(7), all_logits=True)
    cache = lean.new_cache(7)
    got = lean.forward(ids, cache, all_logits=True)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    full = tiny_ref.forward(ids + [9], tiny_ref.new_cache(7), all_logits=True)
    np.testing.assert_allclose(lean.forward([9], cache), full[-1], rtol=1e-4, atol=1e-4)

def test_f32_budget_from_env(monkeypatch):
    from engine.errors import GGUFError
    from engine.reference.model import f32_budget_from_env

    monkeypatch.delenv("GGUF_PREFILL_CPU_F32_GIB", raising=False)
    assert f32_budget_from_env() is None
    monkeypatch.setenv("GGUF_PREFILL_CPU_F32_GIB", "1.5")
    assert f32_budget_from_env() == 3 * 2**29
    for bad in ("abc", "-1", "nan", "inf"):
        monkeypatch.setenv("GGUF_PREFILL_CPU_F32_GIB", bad)
        with pytest.raises(GGUFError, match="GGUF_PREFILL_CPU_F32_GIB"):
            f32_budget_from_env()
