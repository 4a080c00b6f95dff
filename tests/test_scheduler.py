"""engine.scheduler on the CPU backend: continuous batching gives each sequence the tokens it
gets alone (greedy, by the margin rule), chunked prefill, slot reuse, prefix reuse, stops,
cancellation and errors."""
from __future__ import annotations

import numpy as np
import pytest

from engine.generate import generate
from engine.reference.model import ReferenceModel
from engine.scheduler import Scheduler, Sequence, SlotTable, common_prefix


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return ReferenceModel.from_path(tiny_model_path)


def _prompts(model, n, lo=3, hi=40, seed=0):
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    return [rng.integers(0, V, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _seq(prompt, max_tokens, sink, **kw):
    toks = sink.setdefault(id(prompt), [])
    done = {}

    def fin(res):
        done["res"] = res

    s = Sequence(prompt, max_tokens, on_token=lambda st: toks.append(st.token) or True, on_finish=fin, **kw)
    s.done = done
    return s


def _run(sched, limit=10_000):
    steps = []
    while sched.busy and len(steps) < limit:
        steps.append(sched.step())
    assert not sched.busy
    return steps


def _agree(alone, batched):
    """Equal up to the first step whose margin (alone) is under 0.5."""
    for i, (a, b) in enumerate(zip(alone.tokens, batched)):
        if a != b:
            assert alone.margins[i] < 0.5, (i, alone.margins[i])
            return
        if alone.margins[i] < 0.5:
            return
    assert len(batched) == len(alone.tokens)


@pytest.mark.parametrize("max_batch_tokens", [512, 16, 5])
def test_batched_greedy_equals_alone(model, max_batch_tokens):
    prompts = _prompts(model, 7)
    sink = {}
    sched = Scheduler(model.batch(3, 128), max_batch_tokens=max_batch_tokens)
    seqs = [_seq(p, 8 + i, sink) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    steps = _run(sched)
    assert max(st.tokens for st in steps) <= max(max_batch_tokens, 3 + min(64, max_batch_tokens))
    assert any(st.decode and st.tokens > st.decode for st in steps), "prefill chunks never mixed with decodes"
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        alone = generate(model, p, 8 + i)
        _agree(alone, sink[id(p)])
        assert s.done["res"].stop_reason == "length"
        assert s.done["res"].tokens == sink[id(p)]


def test_two_runs_identical(model):
    prompts = _prompts(model, 5, seed=3)
    outs = []
    for _ in range(2):
        sink = {}
        sched = Scheduler(model.batch(4, 96), max_batch_tokens=24)
        for p in prompts:
            sched.add(_seq(p, 10, sink))
        _run(sched)
        outs.append([sink[id(p)] for p in prompts])
    assert outs[0] == outs[1]


def test_eog_stop_and_max_tokens(model):
    p = _prompts(model, 1, seed=5)[0]
    alone = generate(model, p, 8)
    sink = {}
    sched = Scheduler(model.batch(2, 64))
    s_eog = _seq(p, 8, sink, eog_ids=frozenset([alone.tokens[3]]))
    sched.add(s_eog)
    _run(sched)
    assert s_eog.done["res"].stop_reason == "eog"
    assert sink[id(p)] == alone.tokens[:3]
    # on_token returning False: a stop after the 2nd token, emitted
    got = []
    s = Sequence(p, 8, on_token=lambda st: got.append(st.token) or len(got) < 2, on_finish=lambda r: None)
    sched.add(s)
    _run(sched)
    assert got == alone.tokens[:2] and s.result.stop_reason == "stop"


def test_prompt_only_and_capacity(model):
    sched = Scheduler(model.batch(1, 32))
    s = Sequence([1, 2, 3], 0, on_token=lambda st: pytest.fail("no token expected"), on_finish=lambda r: None)
    sched.add(s)
    _run(sched)
    assert s.result.stop_reason == "length" and s.result.tokens == []
    with pytest.raises(ValueError, match="exceed the slot size 32"):
        sched.add(Sequence(list(range(30)), 3, on_token=lambda st: True, on_finish=lambda r: None))


def test_cancel_waiting_and_running(model):
    prompts = _prompts(model, 3, seed=7)
    flags = [False, False, False]
    sched = Scheduler(model.batch(1, 128))
    seqs = []
    for i, p in enumerate(prompts):
        s = Sequence(p, 50, on_token=lambda st: True, on_finish=lambda r: None,
                     is_cancelled=lambda i=i: flags[i])
        sched.add(s)
        seqs.append(s)
    sched.step()
    sched.step()
    flags[0] = flags[2] = True     # running one and a waiting one
    _run(sched)
    assert seqs[0].result.stop_reason == "cancelled" and 0 < len(seqs[0].result.tokens) < 50
    assert seqs[2].result.stop_reason == "cancelled" and seqs[2].result.tokens == []
    assert seqs[1].result.stop_reason == "length" and len(seqs[1].result.tokens) == 50


def test_prefix_reuse_same_and_other_slot(model):
    V = model.config.vocab_size
    rng = np.random.default_rng(11)
    shared = rng.integers(0, V, 40).tolist()
    a, b, c = shared + [5, 6], shared + [7, 8, 9], shared[:30] + [1]
    sched = Scheduler(model.batch(2, 128))
    sa = Sequence(a, 4, on_token=lambda st: True, on_finish=lambda r: None)
    sched.add(sa)
    _run(sched)
    assert sa.cached_tokens == 0
    sb = Sequence(b, 4, on_token=lambda st: True, on_finish=lambda r: None)
    sched.add(sb)
    sched.step()
    assert sb.cached_tokens == 40 and sb.slot == sa.slot          # the slot's own prompt cache
    sc = Sequence(c, 4, on_token=lambda st: True, on_finish=lambda r: None)
    sched.add(sc)
    _run(sched)
    assert sc.slot != sb.slot and sc.cached_tokens == 30          # copied from the busy slot
    assert sched.prefix_hits == 2 and sched.prefix_tokens == 70
    for s, p in ((sb, b), (sc, c)):
        _agree(generate(model, p, 4), s.result.tokens)


def test_slot_table_prefers_longest_then_lru():
    t = SlotTable(3)
    t.tokens = [[1, 2, 3], [1, 2], []]
    slot, reuse, src = t.acquire([1, 2, 3, 4])
    assert (slot, reuse, src) == (0, 3, None)
    assert t.acquire([9, 9])[0] in (1, 2)
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_backend_error_ends_the_step_sequences(model, where):
    class Broken:
        n_slots, slot_capacity = 2, 64

        def launch(self, entries):
            if where == "launch":
                raise RuntimeError("device lost")
            return entries

        def collect(self, handle):
            raise RuntimeError("device lost")

        def copy_prefix(self, *a):
            pass

    sched = Scheduler(Broken())
    s = Sequence([1, 2], 3, on_token=lambda st: True, on_finish=lambda r: None)
    sched.add(s)
    with pytest.raises(RuntimeError):
        while sched.busy:
            sched.step()
    assert s.result.stop_reason == "error" and "device lost" in s.result.error
    assert not sched.busy and sched.slots.n_free == 2


class Recording:
    """A backend wrapper that records every launched step and how many were in flight."""

    def __init__(self, inner):
        self.inner, self.steps, self.open, self.most_open = inner, [], 0, 0
        self.n_slots, self.slot_capacity = inner.n_slots, inner.slot_capacity

    def launch(self, entries):
        self.steps.append([(e.slot, list(e.ids), e.start, e.want) for e in entries])
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        return self.inner.launch(entries)

    def collect(self, handle):
        self.open -= 1
        return self.inner.collect(handle)

    def copy_prefix(self, *a):
        self.inner.copy_prefix(*a)


def _tokens_by_mode(model, prompts, max_tokens, overlap, stop_after=None, eog=frozenset(), **kw):
    sink, seqs = {}, []
    rec = Recording(model.batch(3, 128))
    sched = Scheduler(rec, max_batch_tokens=24, overlap=overlap)
    for i, p in enumerate(prompts):
        s = _seq(p, max_tokens + i % 3, sink, eog_ids=eog, **kw)
        if stop_after is not None:                     # a stop string after k tokens
            toks = sink[id(p)]
            s.on_token = lambda st, toks=toks: toks.append(st.token) or len(toks) < stop_after
        sched.add(s)
        seqs.append(s)
    _run(sched)
    return [sink[id(p)] for p in prompts], [s.result for s in seqs], rec


def test_overlap_gives_the_tokens_of_collect_first(model):
    """Overlapped steps (FOLLOW tokens, two steps in flight) emit exactly the tokens of the
    one-step-at-a-time scheduler: same slots, same prefix cache, same stop reasons."""
    prompts = _prompts(model, 7, seed=4)
    a, ra, rec_a = _tokens_by_mode(model, prompts, 9, overlap=False)
    b, rb, rec_b = _tokens_by_mode(model, prompts, 9, overlap=True)
    assert a == b
    assert [r.stop_reason for r in ra] == [r.stop_reason for r in rb] == ["length"] * 7
    assert [len(t) for t in b] == [9 + i % 3 for i in range(7)]
    assert rec_a.most_open == 1 and rec_b.most_open == 2
    assert any(ids == [-1] for step in rec_b.steps for _, ids, _, _ in step)


def test_overlap_drops_tokens_past_a_stop_or_eog(model):
    """A sequence that stops (stop string, end-of-generation) while its next step is in flight
    emits nothing more; its slot goes back with only the tokens it fed."""
    prompts = _prompts(model, 5, seed=5)
    a, ra, _ = _tokens_by_mode(model, prompts, 12, overlap=False, stop_after=4)
    b, rb, _ = _tokens_by_mode(model, prompts, 12, overlap=True, stop_after=4)
    assert a == b and all(len(t) == 4 for t in b)
    assert {r.stop_reason for r in rb} == {"stop"}
    eog = frozenset([b[0][2]])                  # the third token of the first prompt ends it
    a, ra, _ = _tokens_by_mode(model, prompts, 12, overlap=False, eog=eog)
    b, rb, _ = _tokens_by_mode(model, prompts, 12, overlap=True, eog=eog)
    assert a == b and len(b[0]) == 2 and rb[0].stop_reason == "eog"
    assert [r.stop_reason for r in ra] == [r.stop_reason for r in rb]


def test_overlap_waits_for_host_choices(model):
    """A sequence that needs logits on the host (a sampler) is never followed: every step is
    collected before the next is planned while it runs, and the tokens equal no-overlap."""
    prompts = _prompts(model, 4, seed=6)
    a, _, _ = _tokens_by_mode(model, prompts, 6, overlap=False, need_logits=True)
    b, _, rec = _tokens_by_mode(model, prompts, 6, overlap=True, need_logits=True)
    assert a == b and rec.most_open == 1
    assert not any(ids == [-1] for step in rec.steps for _, ids, _, _ in step)
