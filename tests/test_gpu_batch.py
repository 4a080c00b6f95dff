"""The GPU batched step (engine.gpu.batch.GPUBatch) and the scheduler over it, on the real GPU.

- Logits of a step mixing prompt chunks and decode tokens of several slots, against the numpy
  reference run per sequence: within the whole-model bound of tests/test_gpu_model.py
  (relative Frobenius 2.5e-2 on the tiny models, 5e-2 on the real-weight slice).
- A CUDA-graph replay of a step equals the eager run of the same step bit for bit, and a
  prefix copied between slots gives the logits of computing it in place bit for bit.
- Greedy through the scheduler (any mix of sequences per step) equals each request alone
  through the single-stream GPU session by the margin rule (compare up to the first alone step
  with margin < 0.5), and two runs of the same batch are identical.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.scheduler import BatchEntry, Scheduler, Sequence

ROOT = Path(__file__).resolve().parent.parent
SLICE = ROOT / ".gpu_data" / "slice.gguf"
BOUND = {"tiny": 2.5e-2, "tiny-qwen2": 2.5e-2, "slice": 5e-2}


@pytest.fixture(scope="module")
def models(cp, tiny_model_path, tiny_qwen2_model_path):
    if getattr(cp, "__emulated__", False):
        pytest.skip("needs the real GPU (the MMQ kernels have no emulation)")
    from engine.formats.weights import open_model
    from engine.gpu.model import GPUModel
    from engine.reference.model import ReferenceModel

    paths = {"tiny": tiny_model_path, "tiny-qwen2": tiny_qwen2_model_path}
    if SLICE.exists():
        paths["slice"] = str(SLICE)
    out = {}
    for name, p in paths.items():
        mf = open_model(p)
        out[name] = (ReferenceModel(mf), GPUModel(mf))
    return out


NAMES = ["tiny", "tiny-qwen2", "slice"]


def _get(models, name):
    if name not in models:
        pytest.skip(f"{name} model not present")
    return models[name]


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_mixed_step_logits_match_reference(models, name):
    ref, gpu = _get(models, name)
    V = ref.config.vocab_size
    rng = np.random.default_rng(5)
    b = gpu.batch(4, 512)
    # step 1: three prompts (one of 150 tokens: an eager step over 128), step 2: two decodes and
    # a second chunk, step 3: a graph step of decodes only
    prompts = [rng.integers(0, V, n).tolist() for n in (150, 9, 70)]
    caches = [ref.new_cache(512) for _ in prompts]
    steps = [
        [BatchEntry(0, prompts[0], 0, "logits"), BatchEntry(1, prompts[1], 0, "logits"),
         BatchEntry(2, prompts[2][:40], 0, None)],
        [BatchEntry(0, [11], 150, "logits"), BatchEntry(1, [12], 9, "logits"),
         BatchEntry(2, prompts[2][40:], 40, "logits")],
        [BatchEntry(0, [13], 151, "logits"), BatchEntry(1, [14], 10, "logits"),
         BatchEntry(2, [15], 70, "logits")],
    ]
    worst = 0.0
    for entries in steps:
        outs = b.run(entries)
        for e, o in zip(entries, outs):
            want = ref.forward(e.ids, caches[e.slot])
            if e.want is None:
                assert o is None
                continue
            err = _rel(o, want)
            worst = max(worst, err)
            assert np.isfinite(o).all() and err <= BOUND[name], (name, e.slot, e.start, err)
    print(name, "worst rel err", worst)


@pytest.mark.gpu
def test_graph_replay_and_prefix_copy_bit_exact(models):
    _, gpu = _get(models, "tiny")
    V = gpu.config.vocab_size
    rng = np.random.default_rng(9)
    p = rng.integers(0, V, 30).tolist()
    b = gpu.batch(3, 256)
    first = b.run([BatchEntry(0, p, 0, "logits")])[0]            # eager + capture (T = 32)
    again = b.run([BatchEntry(1, p, 0, "logits")])[0]            # replay, another slot
    assert np.array_equal(first, again)
    # decode after a copied prefix == decode after the prefix computed in place
    b.copy_prefix(0, 2, 30)
    a = b.run([BatchEntry(0, [7], 30, "logits")])[0]
    c = b.run([BatchEntry(2, [7], 30, "logits")])[0]
    assert np.array_equal(a, c)
    assert b.graph_steps >= 3
    tok = b.run([BatchEntry(1, [7], 30, "argmax")])[0]
    assert tok[0] == int(np.argmax(a)) and tok[1] == a.max()


@pytest.mark.gpu
def test_follow_tokens_equal_explicit_ids(models):
    """Two steps in flight: a step launched with FOLLOW entries (ids resolved on the device
    from the step before, not yet collected) gives the bits of the same step with the ids
    given explicitly; the host's copy of the first step's results is not overwritten."""
    from engine.scheduler import FOLLOW

    _, gpu = _get(models, "tiny")
    V = gpu.config.vocab_size
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, V, n).tolist() for n in (5, 9, 14)]
    results = []
    for follow in (False, True):
        b = gpu.batch(3, 64)
        first = b.run([BatchEntry(i, p, 0, "argmax") for i, p in enumerate(prompts)])
        toks = [t[0] for t in first]
        h1 = b.launch([BatchEntry(i, [toks[i]], len(p), "argmax") for i, p in enumerate(prompts)])
        ids2 = [[FOLLOW]] * 3 if follow else None
        if not follow:                                          # explicit: collect first
            second = b.collect(h1)
            ids2 = [[t[0]] for t in second]
        h2 = b.launch([BatchEntry(i, ids2[i], len(p) + 1, "argmax" if i else "logits")
                       for i, p in enumerate(prompts)])
        if follow:
            second = b.collect(h1)
        third = b.collect(h2)
        results.append((second, third))
    (s_a, t_a), (s_b, t_b) = results
    pair = lambda outs: [o[:2] for o in outs]                  # (id, logit); the margin is nan
    assert pair(s_a) == pair(s_b)
    assert pair(t_a[1:]) == pair(t_b[1:]) and np.array_equal(t_a[0], t_b[0])


def _sched_run(batch, prompts, n, max_batch_tokens, overlap=True):
    sched = Scheduler(batch, max_batch_tokens=max_batch_tokens, overlap=overlap)
    seqs = []
    for i, p in enumerate(prompts):
        s = Sequence(p, n + i % 3, on_token=lambda st: True, on_finish=lambda r: None)
        sched.add(s)
        seqs.append(s)
    mixed = 0
    while sched.busy:
        st = sched.step()
        mixed += bool(st.decode and st.tokens > st.decode)
    return [s.result for s in seqs], mixed


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_scheduler_greedy_equals_alone(models, name):
    from engine.generate import generate

    ref, gpu = _get(models, name)
    V = gpu.config.vocab_size
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, V, int(rng.integers(4, 200))).tolist() for _ in range(12)]
    res, mixed = _sched_run(gpu.batch(5, 512), prompts, 16, 96)
    assert mixed > 0
    res2, _ = _sched_run(gpu.batch(5, 512), prompts, 16, 96)
    assert [r.tokens for r in res] == [r.tokens for r in res2]      # the same steps: the same bits
    # Without overlap the steps lack the dropped extra token of a sequence that just ended, so a
    # step may fall in another power-of-two bucket and, on sm_90, across the 17-token line
    # between the q8_1 kernels and the f16 wgmma ones: compared by the margin rule, like alone.
    res3, _ = _sched_run(gpu.batch(5, 512), prompts, 16, 96, overlap=False)
    compared = 0
    for p, r, r3 in zip(prompts, res, res3):
        alone = generate(gpu, p, len(r.tokens), need_logits=True)   # the single-stream session, with margins
        for i, a in enumerate(alone.tokens):
            if alone.margins[i] < 0.5:
                break
            assert r.tokens[i] == a and r3.tokens[i] == a, (name, i, alone.margins[i])
            compared += 1
    print(name, "tokens compared", compared)
