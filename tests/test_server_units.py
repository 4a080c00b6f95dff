"""Server pieces that need no process: settings precedence, the sampler, /health while the model
loads (in-process ASGI), chat on a model without a chat template."""

from __future__ import annotations

import argparse
import copy
import threading
import time

import numpy as np
import pytest

from server.sampling import Sampler
from server.settings import Settings, add_serve_arguments


# ---- settings ---------------------------------------------------------------------------------

def parse(argv, environ=None):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return Settings.from_namespace(p.parse_args(argv), environ=environ or {})


def test_settings_defaults():
    s = parse([])
    assert (s.model, s.host, s.port, s.ctx_size, s.api_key, s.max_queue, s.shutdown_timeout, s.device) == \
        (None, "127.0.0.1", 8080, 0, None, 128, 30.0, "auto")


def test_settings_flags_beat_env_beat_defaults():
    env = {"GGUF_PREFILL_MODEL": "/m/env.gguf", "GGUF_PREFILL_HOST": "0.0.0.0", "GGUF_PREFILL_PORT": "9000",
           "GGUF_PREFILL_CTX_SIZE": "512", "GGUF_PREFILL_API_KEY": "k", "GGUF_PREFILL_MAX_QUEUE": "3",
           "GGUF_PREFILL_SHUTDOWN_TIMEOUT": "2.5", "GGUF_PREFILL_DEVICE": "cpu"}
    s = parse([], env)
    assert (s.model, s.host, s.port, s.ctx_size, s.api_key, s.max_queue, s.shutdown_timeout, s.device) == \
        ("/m/env.gguf", "0.0.0.0", 9000, 512, "k", 3, 2.5, "cpu")
    s = parse(["-m", "/m/flag.gguf", "--port", "9100", "-c", "256", "--api-key", "f", "--max-queue", "7",
               "--shutdown-timeout", "1", "--host", "::1", "--device", "gpu"], env)
    assert (s.model, s.host, s.port, s.ctx_size, s.api_key, s.max_queue, s.shutdown_timeout, s.device) == \
        ("/m/flag.gguf", "::1", 9100, 256, "f", 7, 1.0, "gpu")


def test_settings_reject_bad_values():
    with pytest.raises(ValueError, match="GGUF_PREFILL_PORT"):
        parse([], {"GGUF_PREFILL_PORT": "eighty"})
    with pytest.raises(ValueError, match="max_queue"):
        parse(["--max-queue", "0"])
    with pytest.raises(ValueError, match="ctx_size"):
        parse(["-c", "-1"])


def test_settings_from_cli_namespace_ignores_other_attributes():
    ns = argparse.Namespace(verb="serve", fn=print, model="x.gguf", host=None, port=None, ctx_size=None,
                            api_key=None, max_queue=None, shutdown_timeout=None, device=None)
    assert Settings.from_namespace(ns, environ={}).model == "x.gguf"


def test_cli_has_serve_verb():
    from engine.cli import build_parser

    args = build_parser().parse_args(["serve", "-m", "m.gguf", "--port", "1234", "--max-queue", "2"])
    s = Settings.from_namespace(args, environ={})
    assert (s.model, s.port, s.max_queue) == ("m.gguf", 1234, 2)


# ---- sampler ----------------------------------------------------------------------------------

def test_sampler_same_seed_same_tokens():
    rng = np.random.default_rng(0)
    logits = [rng.normal(size=300).astype(np.float32) for _ in range(50)]
    a = [Sampler(0.8, 40, 0.9, seed=7)(x) for x in logits]
    s1, s2 = Sampler(0.8, 40, 0.9, seed=7), Sampler(0.8, 40, 0.9, seed=7)
    assert [s1(x) for x in logits] == [s2(x) for x in logits]
    assert [s1(x) for x in logits] == [s2(x) for x in logits]  # streams stay in step
    s3 = Sampler(0.8, 40, 0.9, seed=8)
    assert [s3(x) for x in logits] != a


def test_sampler_cuts():
    x = np.array([1.0, 5.0, 5.0, 2.0, -1.0], dtype=np.float32)
    assert {Sampler(1.0, top_k=1, seed=s)(x) for s in range(20)} == {1}  # tie -> lowest id
    assert {Sampler(1.0, top_p=1e-6, seed=s)(x) for s in range(20)} == {1}
    assert {Sampler(1.0, top_k=2, seed=s)(x) for s in range(50)} == {1, 2}
    assert {Sampler(1e-4, seed=s)(x) for s in range(20)} <= {1, 2}


def test_sampler_follows_softmax():
    x = np.log(np.array([0.5, 0.3, 0.2]))
    s = Sampler(1.0, seed=123)
    counts = np.bincount([s(x) for _ in range(4000)], minlength=3) / 4000
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


# ---- in-process app ---------------------------------------------------------------------------

def test_health_503_while_loading(tiny_model_path):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.runner import load_engine

    release = threading.Event()

    def slow_loader(settings):
        assert release.wait(30)
        return load_engine(settings)

    app = create_app(Settings(model=tiny_model_path, device="cpu", ctx_size=256), loader=slow_loader)
    with TestClient(app) as c:
        r = c.get("/health")
        assert r.status_code == 503
        assert r.json()["error"] == {"code": 503, "type": "unavailable_error", "message": "Loading model"}
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
        release.set()
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_load_failure_is_reported(tmp_path):
    from fastapi.testclient import TestClient

    from engine.errors import GGUFError
    from server.app import create_app

    def bad_loader(settings):
        raise GGUFError("x.gguf: tensor blk.0.attn_q.weight: truncated")

    app = create_app(Settings(model="x.gguf"), loader=bad_loader)
    failed = threading.Event()
    app.state.runner.on_load_failed = lambda e: failed.set()
    with TestClient(app) as c:
        assert failed.wait(10)
        r = c.get("/health")
        assert r.status_code == 503 and "blk.0.attn_q.weight" in r.json()["error"]["message"]


def test_chat_without_template_is_400(tiny_model_path):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.runner import load_engine

    eng = load_engine(Settings(model=tiny_model_path, device="cpu", ctx_size=256))
    eng.tokenizer = copy.copy(eng.tokenizer)
    eng.tokenizer.chat_template = None
    app = create_app(Settings(model=tiny_model_path), engine=eng)
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "chat template" in err["message"]
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
