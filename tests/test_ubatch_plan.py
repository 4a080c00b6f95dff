"""engine/gpu/ubatch_plan.py: the split of a long prompt into ubatches (CPU arithmetic, no GPU)."""
from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import pytest

from engine.gpu import registry
from engine.gpu.ubatch_plan import bounds, gemm_wave_cost, layer_launches, plan_ubatches, split


def _layer_gemms(d, ff, q, kv, n_layers=32) -> Counter:
    """One launch per layer for q|k|v, gate|up, Wo and down (all on wgmma)."""
    return Counter({(q + 2 * kv, d): n_layers, (2 * ff, d): n_layers, (d, q): n_layers, (d, ff): n_layers})


QWEN2_7B = _layer_gemms(3584, 18944, 3584, 512, 28)
LLAMA2_7B = _layer_gemms(4096, 11008, 4096, 4096)
LLAMA3_8B = _layer_gemms(4096, 14336, 4096, 1024)


def test_wave_cost_counts_whole_waves():
    """A 3,584-row matrix: 448 blocks of 256 tokens at T = 4096 (3.39 waves -> 4), 392 at 3584
    (2.97 -> 3): the model charges whole waves."""
    g = Counter({(3584, 3584): 1})
    for T, waves in ((4096, 4), (3584, 3)):
        bt, kp = registry.wgmma_config(T, 3584, 3584)
        assert (bt, kp) == (256, 1)
        assert math.ceil(-(-T // bt) * 28 / registry.WGMMA_WAVE_SMS) == waves
        assert gemm_wave_cost(T, g) == waves * 256 * 3584


@pytest.mark.parametrize("n", [1, 17, 3314, 4096])
def test_short_prompt_is_one_ubatch(n):
    assert plan_ubatches(n, 4096, QWEN2_7B) == [n]


def test_wave_aware_split():
    """qwen2-7b's 8,192 tokens: 3,584 + 3,584 + 1,024 (measured +2.2% pp8192, perf-log Session 23);
    the llama shapes keep 4,096 (their 4,096-token waves are 97% full)."""
    assert plan_ubatches(8192, 4096, QWEN2_7B) == [3584, 3584, 1024]
    assert plan_ubatches(8192, 4096, LLAMA2_7B) == [4096, 4096]
    assert plan_ubatches(8192, 4096, LLAMA3_8B) == [4096, 4096]


@pytest.mark.parametrize("n", [4097, 5000, 8192, 12000, 20000])
@pytest.mark.parametrize("gemms", [QWEN2_7B, LLAMA2_7B, LLAMA3_8B], ids=["qwen2", "llama2", "llama3"])
def test_plan_covers_the_prompt(n, gemms):
    """Every token once, no ubatch above the limit, all but the last the same size, and the
    split no costlier in the model than plain ubatches."""
    sizes = plan_ubatches(n, 4096, gemms)
    assert sum(sizes) == n and max(sizes) <= 4096
    assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]
    cost = sum(gemm_wave_cost(t, gemms) for t in sizes)
    assert cost <= sum(gemm_wave_cost(t, gemms) for t in split(n, 4096))


def test_plain_split_without_wgmma_or_small_ubatch():
    assert plan_ubatches(1100, 700, Counter()) == [700, 400]          # not on the Hopper path
    assert plan_ubatches(150, 64, QWEN2_7B) == [64, 64, 22]           # tests' small ubatches
    assert plan_ubatches(1100, 256, QWEN2_7B) == [256] * 4 + [76]


def test_user_ubatch_is_a_candidate():
    """A ubatch that is no multiple of 256 is tried as given before the multiples below it."""
    sizes = plan_ubatches(8192, 3000, LLAMA2_7B)
    assert sum(sizes) == 8192 and max(sizes) <= 3000


def test_bounds():
    assert bounds([3584, 3584, 1024]) == [(0, 3584), (3584, 7168), (7168, 8192)]


def test_layer_launches_counts_pairs_and_skips_mmq():
    """A q|k|v pair is one launch with the rows added; matrices off the Hopper path count not."""
    w = lambda rows, cols, kind="q4_k": SimpleNamespace(rows=rows, cols=cols, kind=kind)
    seg = lambda m: SimpleNamespace(w=m)
    layer = SimpleNamespace(qkv=[seg(w(4096, 4096)), seg(w(1024, 4096, "q6_k"))], gate_up=[seg(w(22016, 4096))],
                            wo=w(4096, 4096), down=w(4096, 11008, "q6_k"))
    on = lambda m: m.kind == "q4_k" or m.rows == 1024
    assert layer_launches([layer] * 2, on, lambda ws: len(ws) == 2) == Counter(
        {(5120, 4096): 2, (22016, 4096): 2, (4096, 4096): 2})
    assert layer_launches([layer], on, lambda ws: False) == Counter(
        {(4096, 4096): 2, (1024, 4096): 1, (22016, 4096): 1})
