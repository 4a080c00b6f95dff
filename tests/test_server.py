"""The HTTP service, end to end: a real uvicorn process on 127.0.0.1 serving the tiny synthetic
model on the CPU (numpy reference) backend, checked against the engine run in this process."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import threading
import time

import httpx
import pytest

from server_fixtures import ServerProcess, metric, parse_metrics, sse_events

N_CTX = 2048  # the tiny model's n_ctx_train
MAX_QUEUE = 64


# ---- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_engine(tiny_model_path):
    from engine.loader import load_model
    from engine.text.tokenizer import load_tokenizer

    return load_model(tiny_model_path, device="cpu"), load_tokenizer(tiny_model_path)


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    """The main server, started through the CLI verb: `python -m engine serve`."""
    with ServerProcess(tiny_model_path, ["--ctx-size", str(N_CTX), "--max-queue", str(MAX_QUEUE)],
                       log_dir=tmp_path_factory.mktemp("logs")) as s:
        s.wait_ready()
        yield s


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        yield c


def greedy(tiny_engine, ids, n, ignore_eos=False, sampler=None):
    from engine.generate import generate

    model, tok = tiny_engine
    return generate(model, ids, n, set() if ignore_eos else tok.eog_ids, sampler=sampler)


def token_text(tok, tokens) -> str:
    return b"".join(tok.token_to_bytes(t) for t in tokens).decode("utf-8", "replace")


def scrape(client) -> dict[str, float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return parse_metrics(r.text)


def wait_idle(client, timeout=15.0) -> dict[str, float]:
    """Metrics once the engine has nothing running and nothing queued."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = scrape(client)
        if metric(m, "gguf_prefill_requests_processing") == 0 and metric(m, "gguf_prefill_queue_depth") == 0:
            return m
        time.sleep(0.02)
    raise AssertionError("engine still busy")


def assert_timings(t: dict, prompt_n: int, predicted_n: int) -> None:
    assert set(t) == {"prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                      "predicted_per_second"}
    assert t["prompt_n"] == prompt_n and t["predicted_n"] == predicted_n
    assert t["prompt_ms"] > 0 and t["prompt_per_second"] > 0
    if predicted_n > 1:
        assert t["predicted_ms"] > 0 and t["predicted_per_second"] > 0


def assert_error(r: httpx.Response, status: int, type_: str, *needles: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert err["code"] == status and err["type"] == type_, err
    for needle in needles:
        assert needle in err["message"], (needle, err["message"])
    return err


# ---- health, models, tokenizer ----------------------------------------------------------------

def test_health_and_models(client, tiny_engine):
    assert client.get("/health").json() == {"status": "ok"}
    data = client.get("/v1/models").json()
    assert data["object"] == "list"
    (m,) = data["data"]
    assert m["id"] == "tiny.gguf" and m["object"] == "model"
    assert m["meta"]["n_ctx"] == N_CTX and m["meta"]["n_vocab"] == tiny_engine[0].config.vocab_size
    assert m["meta"]["backend"] == "ReferenceModel"


def test_tokenize_detokenize(client, tiny_engine):
    _, tok = tiny_engine
    text = "Hello world, héllo <|im_start|>"
    r = client.post("/tokenize", json={"content": text})
    assert r.status_code == 200
    ids = r.json()["tokens"]
    assert ids == tok.encode(text, add_special=False)
    assert client.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"] == tok.encode(text)
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    pieces = client.post("/tokenize", json={"content": "ab", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tok.encode("ab", add_special=False)


# ---- completions ------------------------------------------------------------------------------

PROMPTS = ["Hello world", "The quick brown fox", "def f(x):\n    return", "12345"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_is_engine_greedy(client, tiny_engine, prompt):
    _, tok = tiny_engine
    ids = tok.encode(prompt)
    want = greedy(tiny_engine, ids, 24)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "return_tokens": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "tiny.gguf"
    (choice,) = body["choices"]
    assert choice["tokens"] == want.tokens
    assert choice["text"] == token_text(tok, want.tokens)
    assert choice["finish_reason"] == ("stop" if want.stop_reason == "eog" else "length")
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want.tokens),
                             "total_tokens": len(ids) + len(want.tokens),
                             "prompt_tokens_details": {"cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]}}
    assert_timings(body["timings"], len(ids), len(want.tokens))
    # the same prompt given as token ids
    r2 = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 24, "return_tokens": True})
    assert r2.json()["choices"][0]["tokens"] == want.tokens


def test_completion_default_max_tokens_and_ignore_eos(client, tiny_engine):
    _, tok = tiny_engine
    r = client.post("/v1/completions", json={"prompt": "Hello", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default for completions
    ids = tok.encode("Hello")
    want = greedy(tiny_engine, ids, 40, ignore_eos=True)
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 40, "ignore_eos": True,
                                             "return_tokens": True})
    assert r.json()["choices"][0]["tokens"] == want.tokens and len(want.tokens) == 40


def test_sampling_seeded(client, tiny_engine):
    from server.sampling import Sampler

    _, tok = tiny_engine
    req = {"prompt": "Hello world", "max_tokens": 20, "temperature": 0.9, "top_k": 40, "top_p": 0.95,
           "seed": 1234, "return_tokens": True, "ignore_eos": True}
    a = client.post("/v1/completions", json=req).json()["choices"][0]["tokens"]
    b = client.post("/v1/completions", json=req).json()["choices"][0]["tokens"]
    assert a == b  # same seed, same output
    want = greedy(tiny_engine, tok.encode("Hello world"), 20, ignore_eos=True,
                  sampler=Sampler(0.9, 40, 0.95, 1234))
    assert a == want.tokens
    others = [client.post("/v1/completions", json={**req, "seed": s}).json()["choices"][0]["tokens"]
              for s in (1, 2, 3)]
    assert any(o != a for o in others)


def test_stop_strings_cut_output(client, tiny_engine):
    _, tok = tiny_engine
    full = client.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 32,
                                                "ignore_eos": True}).json()["choices"][0]["text"]
    # a stop string from the middle of the greedy text, first occurring there
    for i in range(4, len(full) - 3):
        stop = full[i:i + 3]
        if full.find(stop) == i and "\ufffd" not in stop:
            break
    else:
        pytest.skip("greedy text too repetitive for a stop-string probe")
    req = {"prompt": "The quick brown fox", "max_tokens": 32, "ignore_eos": True, "stop": [stop, "\x00never"]}
    body = client.post("/v1/completions", json=req).json()
    assert body["choices"][0]["text"] == full[:i]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 32
    with client.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == full[:i]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


# ---- chat -------------------------------------------------------------------------------------

def test_chat_completion(client, tiny_engine):
    _, tok = tiny_engine
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    ids = tok.encode(tok.render_chat(messages, add_generation_prompt=True))
    want = greedy(tiny_engine, ids, 20)
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 20, "return_tokens": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["tokens"] == want.tokens
    assert choice["message"] == {"role": "assistant", "content": token_text(tok, want.tokens)}
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert_timings(body["timings"], len(ids), len(want.tokens))
    # content given as a list of text parts renders the same prompt
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]},
             messages[1]]
    r2 = client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 20, "return_tokens": True})
    assert r2.json()["choices"][0]["tokens"] == want.tokens


def test_chat_stream(client, tiny_engine):
    messages = [{"role": "user", "content": "Tell me a story"}]
    plain = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 30,
                                                      "ignore_eos": True}).json()
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": messages, "max_tokens": 30, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == plain["choices"][0]["message"]["content"]
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["usage"]["prompt_tokens_details"]["cached_tokens"] > 0    # same prompt again
    final["usage"].pop("prompt_tokens_details")
    plain["usage"].pop("prompt_tokens_details")
    assert final["usage"] == plain["usage"]
    assert_timings(final["timings"], plain["usage"]["prompt_tokens"], 30)


# ---- streaming --------------------------------------------------------------------------------

def test_completion_stream(client, tiny_engine):
    _, tok = tiny_engine
    req = {"prompt": "The quick brown fox", "max_tokens": 48, "ignore_eos": True, "return_tokens": True}
    plain = client.post("/v1/completions", json=req).json()
    with client.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
        assert r.status_code == 200
        raw = r.read().decode("utf-8")  # a partial UTF-8 character anywhere would fail here
    assert raw.endswith("data: [DONE]\n\n")
    blocks = raw.split("\n\n")[:-1]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks)
    events = list(sse_events(blocks))
    chunks = events[:-1]
    assert len(chunks) == 48 + 1        # one chunk per generated token, then the finish chunk
    for c in chunks[:-1]:
        assert c["object"] == "text_completion" and c["choices"][0]["finish_reason"] is None
        assert "usage" not in c
    assert sum(c["choices"][0]["text"] != "" for c in chunks[:-1]) > 24
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    n_prompt = len(tok.encode(req["prompt"]))
    cached = final["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert 0 < cached < n_prompt     # the same prompt again: its prefix is reused, the last token runs
    plain["usage"].pop("prompt_tokens_details")
    assert final["usage"] == plain["usage"] == {"prompt_tokens": n_prompt,
                                                "completion_tokens": 48, "total_tokens": plain["usage"]["total_tokens"]}
    assert final["tokens"] == plain["choices"][0]["tokens"]
    assert_timings(final["timings"], plain["usage"]["prompt_tokens"], 48)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == plain["choices"][0]["text"] == token_text(tok, plain["choices"][0]["tokens"])


def test_stream_keeps_split_characters_whole(client, tiny_engine):
    """A generation where one multi-byte UTF-8 character spans two tokens: the stream carries
    the whole character (decoding each token alone would give U+FFFD pieces instead)."""
    _, tok = tiny_engine
    for i in range(80):
        prompt = f"Prompt {i} \u00e9"
        tokens = greedy(tiny_engine, tok.encode(prompt), 48, ignore_eos=True).tokens
        pieces = [tok.token_to_bytes(t) for t in tokens]
        whole = b"".join(pieces).decode("utf-8", "replace")
        naive = "".join(p.decode("utf-8", "replace") for p in pieces)
        if whole != naive:
            break
    else:
        pytest.skip("no greedy generation splits a character across tokens")
    with client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 48,
                                                       "ignore_eos": True, "stream": True}) as r:
        events = list(sse_events(r.iter_lines()))
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == whole != naive


def test_stream_never_splits_utf8(tiny_engine):
    """Byte tokens of one multi-byte character come out as one whole character."""
    from server.runner import TextAssembler

    _, tok = tiny_engine
    text = "aé€😀b"
    ids = tok.encode(text, add_special=False)
    asm = TextAssembler(tok.token_to_bytes)
    pieces = [asm.push(t) for t in ids] + [asm.finish()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # one byte per token: the split really happens
    asm = TextAssembler(lambda t: bytes([t]))
    out = [asm.push(b) for b in "€".encode()]
    assert out == ["", "", "€"]
    # stop strings: held back while they might still match, cut when they do
    asm = TextAssembler(lambda t: bytes([t]), stops=["xyz"])
    got = "".join(asm.push(b) for b in b"abxy") + asm.push(ord("q"))
    assert got == "abxyq"
    asm = TextAssembler(lambda t: bytes([t]), stops=["xyz"])
    got = "".join(asm.push(b) for b in b"abxyz12") + asm.finish()
    assert got == "ab" and asm.stopped


# ---- prefill probe ----------------------------------------------------------------------------

def test_prefill_endpoint(client, tiny_engine):
    _, tok = tiny_engine
    r = client.post("/v1/prefill", json={"n_tokens": 256})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "prefill" and body["n_tokens"] == 256 and body["model"] == "tiny.gguf"
    t = body["timings"]
    assert t["prompt_n"] == 256 and t["prompt_ms"] > 0
    assert t["prompt_per_second"] == pytest.approx(256 / (t["prompt_ms"] / 1000))
    assert t["predicted_n"] == 0
    text = "The quick brown fox jumps over the lazy dog"
    body = client.post("/v1/prefill", json={"prompt": text}).json()
    assert body["timings"]["prompt_n"] == len(tok.encode(text))
    assert client.post("/v1/prefill", json={"prompt": [1, 2, 3]}).json()["n_tokens"] == 3
    err = assert_error(client.post("/v1/prefill", json={"n_tokens": N_CTX + 1}), 400,
                       "exceed_context_size_error", "n_tokens")
    assert err["n_prompt_tokens"] == N_CTX + 1 and err["n_ctx"] == N_CTX
    assert_error(client.post("/v1/prefill", json={}), 422, "invalid_request_error", "prompt", "n_tokens")
    assert_error(client.post("/v1/prefill", json={"n_tokens": 0}), 422, "invalid_request_error", "n_tokens")


# ---- metrics ----------------------------------------------------------------------------------

def test_metrics_move_by_the_right_amounts(client, tiny_engine):
    _, tok = tiny_engine
    prompt = "Metrics are counted per token"
    n_prompt = len(tok.encode(prompt))
    before = wait_idle(client)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 7, "ignore_eos": True})
    assert r.status_code == 200
    r = client.post("/v1/prefill", json={"n_tokens": 100})
    assert r.status_code == 200
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": -1})
    assert r.status_code == 422
    after = wait_idle(client)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("gguf_prefill_prompt_tokens_total") == n_prompt + 100
    assert delta("gguf_prefill_generated_tokens_total") == 7
    assert delta("gguf_prefill_prefill_duration_seconds_count") == 2
    assert delta("gguf_prefill_time_to_first_token_seconds_count") == 1
    assert delta("gguf_prefill_prefill_seconds_total") > 0
    assert delta("gguf_prefill_prefill_duration_seconds_sum") == pytest.approx(
        delta("gguf_prefill_prefill_seconds_total"))
    assert metric(after, "gguf_prefill_prompt_tokens_per_second") > 0
    assert delta("gguf_prefill_prompt_throughput_tokens_per_second_count") == 2
    assert delta("gguf_prefill_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta("gguf_prefill_requests_total", endpoint="/v1/completions", status="422") == 1
    assert delta("gguf_prefill_requests_total", endpoint="/v1/prefill", status="200") == 1
    assert metric(after, "gguf_prefill_queue_depth") == 0
    assert metric(after, "gguf_prefill_model_loaded") == 1


# ---- errors -----------------------------------------------------------------------------------

BAD_REQUESTS = [
    # (name, path, raw body, status, type, words the message must contain)
    ("malformed json", "/v1/completions", b'{"prompt": "hi", ', 400, "invalid_request_error", ["not valid JSON"]),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "invalid_request_error", ["UTF-8"]),
    ("lone surrogate", "/v1/completions", b'{"prompt": "\\ud800"}', 422, "invalid_request_error", ["prompt", "surrogate"]),
    ("not an object", "/v1/completions", b'[1, 2]', 400, "invalid_request_error", ["body", "object"]),
    ("missing prompt", "/v1/completions", b'{"max_tokens": 3}', 422, "invalid_request_error", ["prompt", "Field required"]),
    ("empty prompt", "/v1/completions", b'{"prompt": ""}', 422, "invalid_request_error", ["prompt", "empty"]),
    ("empty id list", "/v1/completions", b'{"prompt": []}', 422, "invalid_request_error", ["prompt", "empty"]),
    ("prompt wrong type", "/v1/completions", b'{"prompt": 5}', 422, "invalid_request_error", ["prompt"]),
    ("max_tokens string", "/v1/completions", b'{"prompt": "hi", "max_tokens": "5"}', 422, "invalid_request_error", ["max_tokens", "integer"]),
    ("max_tokens bool", "/v1/completions", b'{"prompt": "hi", "max_tokens": true}', 422, "invalid_request_error", ["max_tokens"]),
    ("max_tokens float", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2.5}', 422, "invalid_request_error", ["max_tokens"]),
    ("negative max_tokens", "/v1/completions", b'{"prompt": "hi", "max_tokens": -3}', 422, "invalid_request_error", ["max_tokens", "greater than or equal to 1"]),
    ("zero max_tokens", "/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 422, "invalid_request_error", ["max_tokens"]),
    ("huge max_tokens", "/v1/completions", b'{"prompt": "hi", "max_tokens": 100000000000000000000}', 422, "invalid_request_error", ["max_tokens", "less than or equal"]),
    ("temperature string", "/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 422, "invalid_request_error", ["temperature"]),
    ("negative temperature", "/v1/completions", b'{"prompt": "hi", "temperature": -1}', 422, "invalid_request_error", ["temperature"]),
    ("top_p zero", "/v1/completions", b'{"prompt": "hi", "top_p": 0}', 422, "invalid_request_error", ["top_p"]),
    ("stream string", "/v1/completions", b'{"prompt": "hi", "stream": "yes"}', 422, "invalid_request_error", ["stream"]),
    ("empty stop", "/v1/completions", b'{"prompt": "hi", "stop": [""]}', 422, "invalid_request_error", ["stop", "empty"]),
    ("n > 1", "/v1/completions", b'{"prompt": "hi", "n": 2}', 422, "invalid_request_error", ["n"]),
    ("token out of vocab", "/v1/completions", b'{"prompt": [1, 99999]}', 400, "invalid_request_error", ["prompt", "99999"]),
    ("negative token", "/v1/completions", b'{"prompt": [1, -2]}', 422, "invalid_request_error", ["prompt.1"]),
    ("messages missing", "/v1/chat/completions", b'{"model": "x"}', 422, "invalid_request_error", ["messages", "Field required"]),
    ("messages empty", "/v1/chat/completions", b'{"messages": []}', 422, "invalid_request_error", ["messages", "empty"]),
    ("message without role", "/v1/chat/completions", b'{"messages": [{"content": "hi"}]}', 422, "invalid_request_error", ["messages.0.role"]),
    ("bad role", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 422, "invalid_request_error", ["messages.0.role"]),
    ("content wrong type", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": 7}]}', 422, "invalid_request_error", ["messages.0.content"]),
    ("chat max_tokens negative", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', 422, "invalid_request_error", ["max_tokens"]),
    ("tokenize without content", "/tokenize", b'{"text": "hi"}', 422, "invalid_request_error", ["content"]),
    ("detokenize bad ids", "/detokenize", b'{"tokens": ["a"]}', 422, "invalid_request_error", ["tokens.0"]),
    ("detokenize out of vocab", "/detokenize", b'{"tokens": [100000]}', 400, "invalid_request_error", ["tokens", "100000"]),
    ("empty body", "/v1/completions", b'', 400, "invalid_request_error", ["body", "empty"]),
]


@pytest.mark.parametrize("name,path,body,status,type_,needles", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request(client, name, path, body, status, type_, needles):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert_error(r, status, type_, *needles)


def test_exceed_context(client, tiny_engine):
    _, tok = tiny_engine
    ids = tok.encode("Hello world")
    r = client.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": N_CTX})
    err = assert_error(r, 400, "exceed_context_size_error", "prompt", "max_tokens", "n_ctx")
    assert err["n_prompt_tokens"] == len(ids) and err["n_ctx"] == N_CTX
    # exactly at the limit is fine
    r = client.post("/v1/completions", json={"prompt": [1] * (N_CTX - 1), "max_tokens": 1})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a " * N_CTX}],
                                                  "max_tokens": 1})
    assert_error(r, 400, "exceed_context_size_error", "prompt")


def test_oversized_body_413(client):
    big = json.dumps({"prompt": "a" * (1 << 20)}).encode()
    assert_error(client.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
                 413, "invalid_request_error", "limit")

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * 65536
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, "invalid_request_error", "limit")


def test_404_405(client):
    assert_error(client.get("/v1/nothing"), 404, "not_found_error", "/v1/nothing")
    assert_error(client.post("/v1/engines/x/completions", json={}), 404, "not_found_error")
    assert_error(client.get("/v1/completions"), 405, "invalid_request_error", "GET", "/v1/completions")
    assert_error(client.delete("/health"), 405, "invalid_request_error", "DELETE")


def test_no_request_names_a_file(client, tiny_engine):
    """`model` is only compared with the served id (a path is a 404 model_not_found); unknown
    fields (a path anywhere) are refused by name (400), never opened."""
    for model in ("/etc/passwd", "../../../../etc/shadow"):
        r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "model": model})
        assert_error(r, 404, "model_not_found", model)
        assert "root:" not in r.text
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "model": "tiny.gguf",
                                             "model_path": "/etc/passwd", "lora": "/etc/passwd",
                                             "grammar_file": "/etc/passwd"})
    assert_error(r, 400, "invalid_request_error", "model_path", "lora", "grammar_file", "unrecognized")
    assert "root:" not in r.text
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "model": "tiny.gguf"})
    assert r.status_code == 200 and r.json()["model"] == "tiny.gguf"
    from server import schemas

    for cls in (schemas.CompletionRequest, schemas.ChatRequest, schemas.PrefillRequest,
                schemas.TokenizeRequest, schemas.DetokenizeRequest):
        assert not any(w in f for f in cls.model_fields for w in ("path", "file", "dir", "lora", "slot"))


# ---- concurrency, queue, cancellation ---------------------------------------------------------

def test_64_concurrent_clients(server, tiny_engine):
    _, tok = tiny_engine
    prompts = [f"Client number {i} asks" for i in range(64)]
    want = [greedy(tiny_engine, tok.encode(p), 8).tokens for p in prompts]
    barrier = threading.Barrier(64, timeout=30)

    def one(i):
        with httpx.Client(base_url=server.url, timeout=90.0) as c:
            barrier.wait()
            if i % 2:
                r = c.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 8, "return_tokens": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["tokens"]
            with c.stream("POST", "/v1/completions", json={"prompt": prompts[i], "max_tokens": 8,
                                                           "return_tokens": True, "stream": True}) as r:
                assert r.status_code == 200
                events = list(sse_events(r.iter_lines()))
            assert events[-1] == "[DONE]"
            return events[-2]["tokens"]

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(64) as pool:
        got = list(pool.map(one, range(64), timeout=120))
    assert got == want
    assert time.monotonic() - t0 < 120


def test_cancel_on_disconnect(client, server):
    before = wait_idle(client)
    n = 1500
    with httpx.Client(base_url=server.url, timeout=30.0) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "Cancel me", "max_tokens": n,
                                                       "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                if got >= 3:
                    break
        # leaving the blocks closes the connection mid-stream
    t0 = time.monotonic()
    after = wait_idle(client, timeout=10)
    stopped_in = time.monotonic() - t0
    generated = metric(after, "gguf_prefill_generated_tokens_total") - metric(before, "gguf_prefill_generated_tokens_total")
    assert 3 <= generated < n / 2, generated
    assert metric(after, "gguf_prefill_requests_cancelled_total") - metric(before, "gguf_prefill_requests_cancelled_total") == 1
    assert stopped_in < 5
    # the next request is served promptly
    t0 = time.monotonic()
    r = client.post("/v1/completions", json={"prompt": "Next", "max_tokens": 4})
    assert r.status_code == 200 and time.monotonic() - t0 < 3

    # a non-streaming request whose client gives up is cancelled too
    before = wait_idle(client)
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(0.5)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": "Cancel me too", "max_tokens": n, "ignore_eos": True})
    after = wait_idle(client, timeout=10)
    generated = metric(after, "gguf_prefill_generated_tokens_total") - metric(before, "gguf_prefill_generated_tokens_total")
    assert generated < n / 2, generated


# ---- a second server: API key from the environment, a queue of one -----------------------------

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed_server(tiny_model_path, tmp_path_factory):
    env = {"GGUF_PREFILL_API_KEY": KEY, "GGUF_PREFILL_MAX_QUEUE": "1", "GGUF_PREFILL_CTX_SIZE": "1024",
           "GGUF_PREFILL_PARALLEL": "1"}   # one slot: a second request waits in the queue
    with ServerProcess(tiny_model_path, [], env=env, via_cli=False,
                       log_dir=tmp_path_factory.mktemp("logs")) as s:
        s.wait_ready()
        yield s


def test_api_key(keyed_server):
    with httpx.Client(base_url=keyed_server.url, timeout=30) as c:
        assert c.get("/health").status_code == 200  # open without a key
        assert_error(c.get("/v1/models"), 401, "authentication_error", "missing API key")
        assert_error(c.post("/v1/completions", json={"prompt": "hi"}), 401, "authentication_error")
        assert_error(c.get("/metrics"), 401, "authentication_error")
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401,
                     "authentication_error", "invalid API key")
        assert_error(c.get("/v1/models", headers={"Authorization": f"Basic {KEY}"}), 401, "authentication_error")
        ok = c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
        assert ok.json()["data"][0]["meta"]["n_ctx"] == 1024  # GGUF_PREFILL_CTX_SIZE
        assert c.get("/v1/models", headers={"X-Api-Key": KEY}).status_code == 200


def test_queue_full_429(keyed_server):
    auth = {"Authorization": f"Bearer {KEY}"}
    slow = {"prompt": "Slow request", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=keyed_server.url, timeout=60, headers=auth) as c:
        with c.stream("POST", "/v1/completions", json=slow) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # keep a reference: dropping it closes the connection
            next(lines)  # the slow one is running now
            queued_result = {}

            def queued():
                with httpx.Client(base_url=keyed_server.url, timeout=60, headers=auth) as c2:
                    queued_result["r"] = c2.post("/v1/completions", json={"prompt": "Queued", "max_tokens": 4})

            t = threading.Thread(target=queued)
            t.start()
            deadline = time.monotonic() + 10
            while metric(parse_metrics(c.get("/metrics").text), "gguf_prefill_queue_depth") < 1:
                assert time.monotonic() < deadline, "second request never queued"
                time.sleep(0.01)
            r = c.post("/v1/completions", json={"prompt": "One too many", "max_tokens": 4})
            assert_error(r, 429, "rate_limit_error", "busy")
            r = c.post("/v1/prefill", json={"n_tokens": 8})
            assert_error(r, 429, "rate_limit_error")
        # closing the slow stream cancels it; the queued request is then served
        t.join(timeout=30)
        assert not t.is_alive()
        assert queued_result["r"].status_code == 200, queued_result["r"].text
        m = parse_metrics(c.get("/metrics").text)
        assert metric(m, "gguf_prefill_requests_total", endpoint="/v1/completions", status="429") == 1


# ---- SIGTERM ----------------------------------------------------------------------------------

def test_sigterm_drains_in_flight_then_exits_0(tiny_model_path, tmp_path):
    with ServerProcess(tiny_model_path, ["--shutdown-timeout", "30", "--ctx-size", "1024", "--parallel", "1"],
                       log_dir=tmp_path, via_cli=False) as s:
        s.wait_ready()
        results = {}
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "Drain me", "max_tokens": 400,
                                                           "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)  # in flight

                def queued():  # waits behind the streaming one, also in flight
                    with httpx.Client(base_url=s.url, timeout=60) as c2:
                        results["queued"] = c2.post("/v1/completions", json={"prompt": "Me too", "max_tokens": 5,
                                                                             "ignore_eos": True})

                t = threading.Thread(target=queued)
                t.start()
                deadline = time.monotonic() + 10
                while metric(parse_metrics(c.get("/metrics").text), "gguf_prefill_queue_depth") < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                t_sig = time.monotonic()
                s.proc.send_signal(signal.SIGTERM)
                # new connections are refused once the listener closes
                deadline = time.monotonic() + 5
                while True:
                    try:
                        httpx.get(s.url + "/health", timeout=1)
                    except httpx.TransportError:
                        break
                    assert time.monotonic() < deadline, "still accepting after SIGTERM"
                    time.sleep(0.02)
                events = list(sse_events(lines))
            t.join(timeout=30)
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 400
        assert results["queued"].status_code == 200
        assert results["queued"].json()["usage"]["completion_tokens"] == 5
        assert s.proc.wait(timeout=30) == 0, s.log()
        assert time.monotonic() - t_sig < 30


def test_sigterm_timeout_cuts_long_requests(tiny_model_path, tmp_path):
    with ServerProcess(tiny_model_path, ["--shutdown-timeout", "1"], log_dir=tmp_path, via_cli=False) as s:
        s.wait_ready()
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "Too long", "max_tokens": 2000,
                                                           "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                t_sig = time.monotonic()
                s.proc.send_signal(signal.SIGTERM)
                try:
                    events = list(sse_events(lines))
                except httpx.TransportError:
                    events = []
        assert "[DONE]" not in events  # cut off, not finished
        assert s.proc.wait(timeout=15) == 0, s.log()
        assert time.monotonic() - t_sig < 10


# ---- startup failures -------------------------------------------------------------------------

def test_bad_model_fails_fast(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    for model in (str(bad), str(tmp_path / "missing.gguf")):
        s = ServerProcess(model, [], log_dir=tmp_path)
        try:
            assert s.proc.wait(timeout=30) == 2
        finally:
            s.terminate()
        out = s.log().strip().splitlines()
        assert model in out[-1], out
