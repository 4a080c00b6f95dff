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


def test_cli_has_serve_verb(monkeypatch):
    """`gguf-prefill serve ...` hands its arguments to server.main.main unchanged."""
    import server.main
    from engine import cli

    seen = []
    monkeypatch.setattr(server.main, "main", lambda argv=None: seen.append(argv) or 0)
    assert cli.main(["serve", "-m", "m.gguf", "--port", "1234", "--max-queue", "2"]) == 0
    (argv,) = seen
    s = Settings.from_namespace(server.main.build_parser().parse_args(argv), environ={})
    assert (s.model, s.port, s.max_queue) == ("m.gguf", 1234, 2)


def test_settings_hardening_flags():
    s = parse([])
    assert (s.max_input_chars, s.max_connections, s.keep_alive_timeout, s.header_timeout, s.body_timeout) == \
        (262144, 512, 5.0, 10.0, 30.0)
    env = {"GGUF_PREFILL_MAX_INPUT_CHARS": "1000", "GGUF_PREFILL_MAX_CONNECTIONS": "8",
           "GGUF_PREFILL_KEEP_ALIVE_TIMEOUT": "2", "GGUF_PREFILL_HEADER_TIMEOUT": "3",
           "GGUF_PREFILL_BODY_TIMEOUT": "4"}
    s = parse([], env)
    assert (s.max_input_chars, s.max_connections, s.keep_alive_timeout, s.header_timeout, s.body_timeout) == \
        (1000, 8, 2.0, 3.0, 4.0)
    s = parse(["--max-input-chars", "5", "--max-connections", "9", "--keep-alive-timeout", "0.5",
               "--header-timeout", "1.5", "--body-timeout", "2.5"], env)
    assert (s.max_input_chars, s.max_connections, s.keep_alive_timeout, s.header_timeout, s.body_timeout) == \
        (5, 9, 0.5, 1.5, 2.5)
    for argv, word in ((["--header-timeout", "0"], "header_timeout"), (["--body-timeout", "-1"], "body_timeout"),
                       (["--keep-alive-timeout", "0"], "keep_alive_timeout"),
                       (["--max-connections", "0"], "max_connections"), (["--max-input-chars", "0"], "max_input_chars"),
                       (["--shutdown-timeout", "inf"], "shutdown_timeout"), (["--port", "70000"], "port")):
        with pytest.raises(ValueError, match=word):
            parse(argv)
    with pytest.raises(ValueError, match="GGUF_PREFILL_MAX_CONNECTIONS='many': not an integer"):
        parse([], {"GGUF_PREFILL_MAX_CONNECTIONS": "many"})


def test_serve_errors_name_the_flag_and_variable():
    from engine.errors import UsageError
    from server.main import serve

    with pytest.raises(UsageError, match=r"--port \(or GGUF_PREFILL_PORT\): 99999 is not in 0\.\.65535"):
        serve(port=99999)
    with pytest.raises(UsageError, match=r"--ctx-size \(or GGUF_PREFILL_CTX_SIZE\): -5 must be >= 0"):
        serve(ctx_size=-5)


class _Cfg:
    n_layers, n_kv_heads, head_dim, n_ctx_train = 28, 4, 128, 32768


def test_check_context_refuses_what_does_not_fit(monkeypatch):
    from engine.errors import UsageError
    from server import main

    monkeypatch.setattr(main, "available_memory", lambda device: (8 << 30, "host"))
    assert main.check_context(Settings(), _Cfg, 1 << 30, "cpu") == 32768  # 3.5 GiB of KV + 1 GiB fits
    assert main.check_context(Settings(ctx_size=4096), _Cfg, 1 << 30, "cpu") == 4096
    with pytest.raises(UsageError, match=r"--ctx-size 40000 is over the model's training context \(n_ctx_train 32768\)"):
        main.check_context(Settings(ctx_size=40000), _Cfg, 1 << 30, "cpu")
    monkeypatch.setattr(main, "available_memory", lambda device: (2 << 30, "host"))
    with pytest.raises(UsageError) as e:
        main.check_context(Settings(), _Cfg, 1 << 30, "cpu")
    msg = str(e.value)
    assert "3.50 GiB KV cache" in msg and "114688 bytes per token" in msg and "f32" in msg
    assert "2.00 GiB of host memory" in msg and "use --ctx-size 9216 or less" in msg
    # f16 on the GPU: half the bytes
    monkeypatch.setattr(main, "available_memory", lambda device: (3 << 30, "GPU"))
    assert main.check_context(Settings(), _Cfg, 1 << 30, "gpu") == 32768
    # unknown memory: only the training context is checked
    monkeypatch.setattr(main, "available_memory", lambda device: (None, "host"))
    assert main.check_context(Settings(), _Cfg, 1 << 40, "cpu") == 32768


def test_available_memory_and_rss_are_numbers():
    from server.main import available_memory, resident_bytes

    avail, where = available_memory("cpu")
    assert where == "host" and (avail is None or avail > 0)
    assert resident_bytes() > 1 << 20


def test_loading_progress_is_logged(monkeypatch, caplog):
    from server import main

    monkeypatch.setattr(main, "PROGRESS_FIRST_S", 0.1)
    monkeypatch.setattr(main, "PROGRESS_EVERY_S", 0.1)

    class SlowRunner:
        state = "loading"

    runner = SlowRunner()
    threading.Timer(0.45, lambda: setattr(runner, "state", "ready")).start()
    with caplog.at_level("INFO", logger="server"):
        took = main._wait_loaded(runner, "/m/model.gguf", threading.Event())
    assert took is not None and took >= 0.4
    notes = [r.getMessage() for r in caplog.records if "so far" in r.getMessage()]
    assert len(notes) >= 2 and all(n.startswith("loading model.gguf: ") and "resident" in n for n in notes)
    # a signal while loading: stop waiting
    stop = threading.Event()
    stop.set()
    assert main._wait_loaded(SlowRunner(), "/m/model.gguf", stop) is None


BODIES = [
    (b'{"a": 1}', None),
    (b'{"a": [[[["x"]]]]}', None),
    (b"", (400, "empty")),
    (b"[]", (400, "not an array")),
    (b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}", (400, "nested too deeply")),
    (b'{"a": ' + b"[" * 62 + b"]" * 62 + b"}", None),
    (b'{"a": ' + b"1" * 4301 + b"}", (400, "4300 digits")),
    (b'{"a": NaN}', (400, "NaN")),
    (b'{"a": "\xff"}', (400, "UTF-8")),
    (b'{"a": "' + b"x" * 11 + b'"}', (413, "11 characters, over the 10-character limit")),
    (b'{"a": ["' + b"x" * 5 + b'", {"b": "' + b"y" * 5 + b'"}]}', None),  # 10: at the limit
]


@pytest.mark.parametrize("body,want", BODIES)
def test_check_json_body(body, want):
    from server.errors import BodyError, check_json_body

    if want is None:
        assert isinstance(check_json_body(body, max_chars=10), dict)
        return
    with pytest.raises(BodyError) as e:
        check_json_body(body, max_chars=10)
    assert e.value.status == want[0] and want[1] in e.value.message, e.value.message


def test_startup_line(tiny_model_path):
    from server.main import startup_line
    from server.runner import load_engine

    eng = load_engine(Settings(model=tiny_model_path, device="cpu", ctx_size=256))
    line = startup_line(eng, 1.25)
    for needle in ("model tiny.gguf", "llama", "layers", "vocab", "backend ReferenceModel on cpu",
                   "n_ctx 256 (n_ctx_train 2048)", "GiB resident", "loaded in 1.2 s"):
        assert needle in line, (needle, line)


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
