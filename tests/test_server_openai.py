"""OpenAI API completeness (issue 15), through the official `openai` SDK against a real uvicorn
process serving the tiny synthetic model on the CPU backend. Every implemented field is checked
streamed and not, against the engine run in this process; every refused field is a 400 that
names it."""

from __future__ import annotations

import json
import sys

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from server_fixtures import ServerProcess  # noqa: E402

N_CTX = 2048
IGNORE_EOS = {"ignore_eos": True, "return_tokens": True}
CHAT = [{"role": "user", "content": "Tell me about colors"}]


# ---- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_engine(tiny_model_path):
    from engine.loader import load_model
    from engine.text.tokenizer import load_tokenizer

    return load_model(tiny_model_path, device="cpu"), load_tokenizer(tiny_model_path)


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    with ServerProcess(tiny_model_path, ["--ctx-size", str(N_CTX)],
                       log_dir=tmp_path_factory.mktemp("logs")) as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        yield c


def chat_ids(tok, messages=CHAT):
    return tok.encode(tok.render_chat(messages, add_generation_prompt=True))


def reference(tiny_engine, ids, n, *, ignore_eos=True, choose=None):
    """The engine's own loop, optionally with a per-step chooser over (logits, generated)."""
    from engine.generate import generate

    model, tok = tiny_engine
    eog = set() if ignore_eos else tok.eog_ids
    if choose is None:
        return generate(model, ids, n, eog).tokens
    out: list[int] = []

    def sampler(logits):
        t = choose(np.asarray(logits, dtype=np.float64), out)
        out.append(t)
        return t

    return generate(model, ids, n, eog, sampler=sampler).tokens


def ref_logprobs(tiny_engine, ids, tokens):
    """log_softmax of the model's logits at every generated position (teacher forced)."""
    from server.sampling import log_softmax

    model, _ = tiny_engine
    rows = model.forward(ids + tokens[:-1], model.new_cache(len(ids) + len(tokens)), all_logits=True)
    return [log_softmax(rows[len(ids) - 1 + i]) for i in range(len(tokens))]


def text_of(tok, tokens):
    return b"".join(tok.token_to_bytes(t) for t in tokens).decode("utf-8", "replace")


def key_of(tok, t):
    from server.openai_api import token_text

    return token_text(tok.token_to_bytes(t))


def collect_chat(stream):
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


def collect_completion(stream):
    chunks = list(stream)
    return chunks, "".join(c.choices[0].text for c in chunks if c.choices)


def bad_request(excinfo, *needles):
    e = excinfo.value
    assert e.status_code == 400, e
    msg = e.body["message"] if isinstance(e.body, dict) else str(e)
    for n in needles:
        assert n in msg, (n, msg)
    return e.body


# ---- models ------------------------------------------------------------------------------------

def test_models_list_and_retrieve(client):
    (m,) = client.models.list().data
    assert m.id == "tiny.gguf" and m.object == "model"
    assert client.models.retrieve("tiny.gguf").id == "tiny.gguf"
    assert client.models.retrieve("tiny").id == "tiny.gguf"  # the stem is an alias
    with pytest.raises(openai.NotFoundError) as ei:
        client.models.retrieve("gpt-4o")
    assert ei.value.body["type"] == "model_not_found" and "gpt-4o" in ei.value.body["message"]


def test_wrong_model_name_is_404(client):
    for call in (lambda m: client.completions.create(model=m, prompt="Hi", max_tokens=2),
                 lambda m: client.chat.completions.create(model=m, messages=CHAT, max_tokens=2)):
        with pytest.raises(openai.NotFoundError) as ei:
            call("gpt-3.5-turbo")
        assert ei.value.body["type"] == "model_not_found" and ei.value.body["param"] == "model"
        assert call("tiny").model == "tiny.gguf"
        assert call("tiny.gguf").model == "tiny.gguf"


# ---- token caps --------------------------------------------------------------------------------

def test_max_completion_tokens_caps_chat(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=3,
                                       extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    chunks, _ = collect_chat(client.chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=3, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    assert chunks[-1].usage.completion_tokens == 3
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 4
    # the same cap twice is fine; two different caps are refused
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                       max_completion_tokens=2, extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, max_completion_tokens=5)
    bad_request(ei, "max_tokens", "max_completion_tokens")


def test_n_predict_alias(client, tiny_engine):
    _, tok = tiny_engine
    r = client.completions.create(model="tiny", prompt="Hello", extra_body={"n_predict": 5, **IGNORE_EOS})
    assert r.usage.completion_tokens == 5
    assert r.choices[0].model_extra["tokens"] == reference(tiny_engine, tok.encode("Hello"), 5)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=3, extra_body={"n_predict": 5})
    bad_request(ei, "n_predict")


# ---- greedy default, seed -----------------------------------------------------------------------

def test_greedy_default_is_the_engine(client, tiny_engine):
    _, tok = tiny_engine
    want = reference(tiny_engine, tok.encode("The quick brown fox"), 24)
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=24,
                                  extra_body=IGNORE_EOS)
    assert r.choices[0].model_extra["tokens"] == want
    assert r.choices[0].text == text_of(tok, want) and r.choices[0].logprobs is None
    r0 = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=24,
                                   temperature=0, extra_body=IGNORE_EOS)
    assert r0.choices[0].model_extra["tokens"] == want


def test_seed_is_deterministic(client, tiny_engine):
    from server.sampling import Sampler

    _, tok = tiny_engine
    ids = chat_ids(tok)
    for seed in (7, -3):
        req = dict(model="tiny", messages=CHAT, max_tokens=20, temperature=1.0, seed=seed,
                   extra_body=IGNORE_EOS)
        a = client.chat.completions.create(**req)
        b = client.chat.completions.create(**req)
        assert a.choices[0].model_extra["tokens"] == b.choices[0].model_extra["tokens"]
        s = Sampler(1.0, 0, 1.0, seed)
        want = reference(tiny_engine, ids, 20, choose=lambda x, _: s(x))
        assert a.choices[0].model_extra["tokens"] == want
        _, text = collect_chat(client.chat.completions.create(**req, stream=True))
        assert text == a.choices[0].message.content
        # asking for logprobs does not change what is sampled
        c = client.chat.completions.create(**req, logprobs=True)
        assert c.choices[0].model_extra["tokens"] == want
    others = {tuple(client.chat.completions.create(**{**req, "seed": s}).choices[0].model_extra["tokens"])
              for s in (1, 2, 3)}
    assert len(others) > 1


# ---- stop ---------------------------------------------------------------------------------------

def test_stop_string_and_list(client):
    full = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=32,
                                     extra_body=IGNORE_EOS).choices[0].text
    for i in range(4, len(full) - 3):
        stop = full[i:i + 3]
        if full.find(stop) == i and "\ufffd" not in stop:
            break
    else:
        pytest.skip("greedy text too repetitive for a stop-string probe")
    for s in (stop, [stop, "\x00never"]):
        r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=32,
                                      stop=s, extra_body=IGNORE_EOS)
        assert r.choices[0].text == full[:i] and r.choices[0].finish_reason == "stop"
        chunks, text = collect_completion(client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=32, stop=s, stream=True,
            extra_body=IGNORE_EOS))
        assert text == full[:i] and chunks[-1].choices[0].finish_reason == "stop"


# ---- stream_options.include_usage ----------------------------------------------------------------

def test_include_usage_final_chunk(client):
    plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, extra_body=IGNORE_EOS)
    chunks, text = collect_chat(client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=6, stream=True, stream_options={"include_usage": True},
        extra_body=IGNORE_EOS))
    assert text == plain.choices[0].message.content
    last = chunks[-1]
    assert last.choices == [] and last.usage.model_dump() == plain.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    chunks, text = collect_completion(client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, stream=True, stream_options={"include_usage": True},
        extra_body=IGNORE_EOS))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    # without it: no usage-only chunk (the finish chunk still carries llama-server's usage)
    chunks, _ = collect_completion(client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, stream=True, extra_body=IGNORE_EOS))
    assert all(c.choices for c in chunks)


# ---- logprobs -----------------------------------------------------------------------------------

def test_completion_logprobs(client, tiny_engine):
    _, tok = tiny_engine
    prompt = "Hello world"
    ids = tok.encode(prompt)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, logprobs=3,
                                  extra_body=IGNORE_EOS)
    tokens = r.choices[0].model_extra["tokens"]
    assert tokens == reference(tiny_engine, ids, 12)
    lp = r.choices[0].logprobs
    ref = ref_logprobs(tiny_engine, ids, tokens)
    assert lp.tokens == [key_of(tok, t) for t in tokens]
    assert lp.token_logprobs == pytest.approx([float(ref[i][t]) for i, t in enumerate(tokens)], abs=1e-3)
    for i, top in enumerate(lp.top_logprobs):
        assert len(top) == 3 and lp.tokens[i] in top  # greedy: the chosen one is the best
        assert max(top.values()) == pytest.approx(lp.token_logprobs[i])
        best3 = np.argsort(-ref[i], kind="stable")[:3]
        assert set(top) == {key_of(tok, int(t)) for t in best3}
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # streamed: the same entries, spread over the chunks
    chunks, text = collect_completion(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, logprobs=3, stream=True, extra_body=IGNORE_EOS))
    assert text == r.choices[0].text
    got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            for k in got:
                got[k] += getattr(c.choices[0].logprobs, k)
    assert got == lp.model_dump()
    # logprobs=0: the chosen token only
    r0 = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, logprobs=0, extra_body=IGNORE_EOS)
    assert [list(t) for t in r0.choices[0].logprobs.top_logprobs] == [[k] for k in r0.choices[0].logprobs.tokens]


def test_chat_logprobs(client, tiny_engine):
    _, tok = tiny_engine
    ids = chat_ids(tok)
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, logprobs=True,
                                       top_logprobs=2, extra_body=IGNORE_EOS)
    tokens = r.choices[0].model_extra["tokens"]
    content = r.choices[0].logprobs.content
    ref = ref_logprobs(tiny_engine, ids, tokens)
    assert len(content) == len(tokens) == 10
    for i, (e, t) in enumerate(zip(content, tokens)):
        assert bytes(e.bytes) == tok.token_to_bytes(t)
        assert e.logprob == pytest.approx(float(ref[i][t]), abs=1e-3)
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    chunks, text = collect_chat(client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=10, logprobs=True, top_logprobs=2, stream=True,
        extra_body=IGNORE_EOS))
    assert text == r.choices[0].message.content
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    # logprobs without top_logprobs: no alternatives; no logprobs: null
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    assert client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3).choices[0].logprobs is None


# ---- echo ---------------------------------------------------------------------------------------

def test_echo(client, tiny_engine):
    _, tok = tiny_engine
    prompt = "The quick brown fox"
    ids = tok.encode(prompt)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, extra_body=IGNORE_EOS)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, echo=True, extra_body=IGNORE_EOS)
    assert r.choices[0].text == prompt + plain.choices[0].text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (plain.usage.prompt_tokens,
                                                                   plain.usage.completion_tokens)
    _, text = collect_completion(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, echo=True, stream=True, extra_body=IGNORE_EOS))
    assert text == r.choices[0].text
    # token-id prompts echo their decoded text
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2, echo=True, extra_body=IGNORE_EOS)
    assert r.choices[0].text.startswith(prompt)

    # echo + logprobs: the prompt's tokens scored too (the first has nothing to condition on)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                                  extra_body=IGNORE_EOS)
    lp = r.choices[0].logprobs
    gen = r.choices[0].model_extra["tokens"]
    assert lp.tokens == [key_of(tok, t) for t in ids + gen]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    model, _ = tiny_engine
    from server.sampling import log_softmax

    rows = model.forward(ids, model.new_cache(len(ids)), all_logits=True)
    want = [float(log_softmax(rows[i - 1])[ids[i]]) for i in range(1, len(ids))]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-3)
    assert lp.text_offset[len(ids)] == len(prompt)
    chunks, text = collect_completion(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=2, stream=True, extra_body=IGNORE_EOS))
    assert text == r.choices[0].text
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens

    # max_tokens 0 with echo: score the prompt, generate nothing
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
    assert r.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)


# ---- penalties, logit_bias ----------------------------------------------------------------------

@pytest.mark.parametrize("presence,frequency", [(0.0, 1.5), (1.5, 0.0), (-1.0, 0.5)])
def test_penalties(client, tiny_engine, presence, frequency):
    _, tok = tiny_engine
    ids = tok.encode("Hello world")

    def choose(x, out):
        for t in set(out):
            x[t] -= out.count(t) * frequency + presence
        return int(np.argmax(x))

    want = reference(tiny_engine, ids, 24, choose=choose)
    assert want != reference(tiny_engine, ids, 24)  # the penalty changes the output here
    req = dict(model="tiny", prompt="Hello world", max_tokens=24, presence_penalty=presence,
               frequency_penalty=frequency, extra_body=IGNORE_EOS)
    r = client.completions.create(**req)
    assert r.choices[0].model_extra["tokens"] == want
    chunks, text = collect_completion(client.completions.create(**req, stream=True))
    assert text == r.choices[0].text
    c = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, presence_penalty=presence,
                                       frequency_penalty=frequency, extra_body=IGNORE_EOS)
    assert c.choices[0].model_extra["tokens"] == reference(tiny_engine, chat_ids(tok), 12, choose=choose)


def test_logit_bias(client, tiny_engine):
    _, tok = tiny_engine
    t = tok.encode("a", add_special=False)[0]
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, logit_bias={str(t): 100},
                                  extra_body=IGNORE_EOS)
    assert r.choices[0].model_extra["tokens"] == [t] * 5
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=5, logit_bias={"99999": 1})
    bad_request(ei, "logit_bias", "99999")


# ---- structured output --------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "color", "n"], "additionalProperties": False}


def test_json_schema(client):
    pytest.importorskip("llguidance")
    fmt = {"type": "json_schema", "json_schema": {"name": "probe", "schema": SCHEMA, "strict": True}}
    for temperature in (None, 1.0):
        kw = dict(model="tiny", messages=CHAT, max_tokens=60, response_format=fmt, seed=3)
        if temperature:
            kw["temperature"] = temperature
        r = client.chat.completions.create(**kw)
        out = json.loads(r.choices[0].message.content)
        assert set(out) == {"ok", "color", "n"} and isinstance(out["ok"], bool)
        assert out["color"] in ("red", "green", "blue") and 0 <= out["n"] <= 9
        assert r.choices[0].finish_reason == "stop"
        _, text = collect_chat(client.chat.completions.create(**kw, stream=True))
        assert text == r.choices[0].message.content
    r = client.completions.create(model="tiny", prompt="JSON:", max_tokens=60,
                                  extra_body={"response_format": fmt})  # a server extension there
    assert set(json.loads(r.choices[0].text)) == {"ok", "color", "n"}


def test_json_object(client, tiny_model_path):
    llg = pytest.importorskip("llguidance")
    from server.runner import Engine
    from server import structured
    from engine.text.tokenizer import load_tokenizer
    from engine.loader import load_model

    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40,
                                       response_format={"type": "json_object"},
                                       extra_body={"return_tokens": True})
    tokens = r.choices[0].model_extra["tokens"]
    assert r.choices[0].message.content.startswith("{")
    # every token the server chose is one the grammar allows (the tiny random model rarely
    # closes its object within 40 tokens, so the text is a valid JSON prefix)
    eng = Engine(model=load_model(tiny_model_path, device="cpu"), tokenizer=load_tokenizer(tiny_model_path),
                 n_ctx=N_CTX, model_id="tiny.gguf")
    m = structured.new_matcher(eng, structured.grammar_for(type("RF", (), {"type": "json_object"})()))
    assert m.consume_tokens(tokens), m.get_error()
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert llg is not None


def test_bad_schema_is_400(client):
    pytest.importorskip("llguidance")
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}})
    bad_request(ei, "response_format")
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5,
                                       response_format={"type": "json_object"}, extra_body={"ignore_eos": True})
    bad_request(ei, "ignore_eos")


def test_structured_without_the_extra(monkeypatch):
    from server import structured
    from server.errors import APIError

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import -> ImportError
    with pytest.raises(APIError) as ei:
        structured.grammar_for(type("RF", (), {"type": "json_object"})())
    assert ei.value.status == 400
    assert "response_format" in ei.value.message and "gguf-prefill[structured]" in ei.value.message


# ---- refused fields ------------------------------------------------------------------------------

REFUSED_CHAT = [
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("tool_choice", {"tool_choice": "auto"}),
    ("functions", {"functions": [{"name": "f"}]}),
    ("function_call", {"function_call": "auto"}),
    ("store", {"store": True}),
    ("service_tier", {"service_tier": "flex"}),
    ("stream_options", {"stream_options": {"include_usage": True}}),  # without stream
    ("top_logprobs", {"top_logprobs": 2}),  # without logprobs
    ("reasoning_effort", {"reasoning_effort": "low"}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("repeat_penalty", {"repeat_penalty": 1.1}),
    ("messages.0.tool_calls", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
    ("response_format.strictness", {"response_format": {"type": "text", "strictness": 1}}),
]
REFUSED_COMPLETION = [
    ("suffix", {"suffix": "end"}),
    ("best_of", {"best_of": 3}),
    ("min_p", {"min_p": 0.1}),
    ("grammar_file", {"grammar_file": "/etc/passwd"}),
]


@pytest.mark.parametrize("field,body", REFUSED_CHAT, ids=[f for f, _ in REFUSED_CHAT])
def test_refused_chat_fields(http, field, body):
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field and field in err["message"]


@pytest.mark.parametrize("field,body", REFUSED_COMPLETION, ids=[f for f, _ in REFUSED_COMPLETION])
def test_refused_completion_fields(http, field, body):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_refused_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    bad_request(ei, "tools", "not supported")
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, suffix="!")
    bad_request(ei, "suffix")


def test_harmless_fields_accepted(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, user="u-1",
                                       safety_identifier="s", prompt_cache_key="k",
                                       metadata={"tag": "x"}, store=False, service_tier="auto",
                                       parallel_tool_calls=False, tool_choice="none", n=1,
                                       response_format={"type": "text"})
    assert r.choices[0].message.role == "assistant"
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, user="u-1", best_of=1, n=1)
    assert r.usage.completion_tokens >= 0


def test_message_name_goes_to_the_template(client):
    named = [{"role": "user", "content": "Tell me about colors", "name": "alice"}]
    r = client.chat.completions.create(model="tiny", messages=named, max_tokens=3)
    assert r.choices[0].message.role == "assistant"
