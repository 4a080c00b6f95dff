"""Continuous batching through the real server (CPU backend, tiny model): concurrent requests
get what each gets alone, one step serves several of them, the slot prompt cache reports
cached_tokens, /slots and the batching metrics."""
from __future__ import annotations

import concurrent.futures as cf

import httpx
import numpy as np
import pytest

from server_fixtures import ServerProcess, metric, parse_metrics


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from engine.reference.model import ReferenceModel

    return ReferenceModel.from_path(tiny_model_path)


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    args = ["--parallel", "4", "--max-batch-tokens", "24", "--ctx-size", "512"]
    with ServerProcess(tiny_model_path, args, via_cli=False, log_dir=tmp_path_factory.mktemp("logs")) as s:
        s.wait_ready()
        yield s


def _complete(url, ids, n):
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": n, "ignore_eos": True,
                                            "temperature": 0, "return_tokens": True})
        assert r.status_code == 200, r.text
        return r.json()


def test_concurrent_requests_equal_alone(server, model):
    from engine.generate import generate

    rng = np.random.default_rng(1)
    V = model.config.vocab_size
    prompts = [rng.integers(0, V, int(rng.integers(5, 60))).tolist() for _ in range(10)]
    with cf.ThreadPoolExecutor(10) as ex:
        bodies = list(ex.map(lambda p: _complete(server.url, p, 20), prompts))
    for p, body in zip(prompts, bodies):
        alone = generate(model, p, 20)
        got = body["choices"][0]["tokens"]
        for i, (a, b) in enumerate(zip(alone.tokens, got)):
            if alone.margins[i] < 0.5:
                break
            assert a == b, (i, alone.margins[i])
        assert body["usage"]["completion_tokens"] == 20
    with httpx.Client(base_url=server.url, timeout=30) as c:
        m = parse_metrics(c.get("/metrics").text)
    steps = metric(m, "gguf_prefill_batch_sequences_count")
    seqs = metric(m, "gguf_prefill_batch_sequences_sum")
    assert steps > 0 and seqs / steps > 1.5, (steps, seqs)      # steps served several sequences
    assert metric(m, "gguf_prefill_batch_tokens_sum") >= sum(len(p) for p in prompts)
    # every step's wall time is observed; the CPU backend has no device clock
    assert metric(m, "gguf_prefill_step_seconds_count", part="wall") == steps
    assert metric(m, "gguf_prefill_step_seconds_sum", part="wall") > 0
    assert metric(m, "gguf_prefill_step_seconds_count", part="device") == 0
    assert 0 < metric(m, "gguf_prefill_step_seconds_count", part="interval") < steps


def test_prefix_cache_reports_cached_tokens(server, model):
    rng = np.random.default_rng(2)
    shared = rng.integers(0, model.config.vocab_size, 100).tolist()
    first = _complete(server.url, shared + [1, 2], 4)
    second = _complete(server.url, shared + [3, 4, 5], 4)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 100
    assert first["usage"]["prompt_tokens"] == 102
    with httpx.Client(base_url=server.url, timeout=30) as c:
        m = parse_metrics(c.get("/metrics").text)
    assert metric(m, "gguf_prefill_prefix_cache_hits_total") >= 1
    assert metric(m, "gguf_prefill_prefix_cache_tokens_total") >= 100


def test_slots_view(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.get("/slots")
    assert r.status_code == 200
    body = r.json()
    assert body["n_slots"] == 4 and body["slot_capacity"] == 512 and body["max_batch_tokens"] == 24
    assert len(body["slots"]) == 4 and all(s["state"] == "idle" for s in body["slots"])
    assert any(s["n_cached"] > 0 for s in body["slots"])     # the earlier tests left prompts cached


def test_request_over_a_slot_is_a_400(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": [1] * 500, "max_tokens": 100})
    assert r.status_code == 400 and "n_ctx (512)" in r.json()["error"]["message"], r.text
