"""Issue 15, the server cases: each against a real uvicorn process on 127.0.0.1 serving the tiny
synthetic model on the CPU. Body parse errors, CPU-heavy text work off the event loop, header /
body / keep-alive timeouts and the connection cap, metrics that count what the client got, the
end of the shutdown grace period, Retry-After, HEAD, `serve` flag validation, the startup log.
Every loop here is bounded in time."""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from server_fixtures import REPO, ServerProcess, free_port, metric, parse_metrics, sse_events

T = 1.0  # --header-timeout / --body-timeout / --keep-alive-timeout of the main server
MAX_CONN = 40
MAX_CHARS = 300_000


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    args = ["--header-timeout", str(T), "--body-timeout", str(T), "--keep-alive-timeout", str(T),
            "--max-connections", str(MAX_CONN), "--max-input-chars", str(MAX_CHARS),
            "--max-queue", "1", "--parallel", "1"]    # one slot: the second request queues
    with ServerProcess(tiny_model_path, args, via_cli=False,
                       log_dir=tmp_path_factory.mktemp("logs")) as s:
        s.startup_statuses = s.wait_ready()
        yield s


def scrape(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def requests_count(m, endpoint: str, status: str) -> float:
    return metric(m, "gguf_prefill_requests_total", endpoint=endpoint, status=status)


def wait_count(url, endpoint, status, at_least, timeout=10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if requests_count(m, endpoint, status) >= at_least:
            return m
        assert time.monotonic() < deadline, (endpoint, status, at_least, requests_count(m, endpoint, status))
        time.sleep(0.05)


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes (or `timeout`); and when it closed."""
    t0 = time.monotonic()
    data = b""
    sock.settimeout(0.1)
    while time.monotonic() - t0 < timeout:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return data, time.monotonic() - t0
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk
    return data, float("inf")


def error_of(body: bytes | str) -> dict:
    payload = json.loads(body)
    assert set(payload) == {"error"}, payload
    return payload["error"]


# ---- body parse errors -----------------------------------------------------------------------

J = "application/json"
PARSE_ERRORS = [
    # (name, body, content type, words the 400's message names)
    ("nested 1000 deep", b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", J, ["nested too deeply"]),
    ("top level nested 1000 deep", b"[" * 1000 + b"]" * 1000, J, ["nested too deeply"]),
    ("nested 100 deep objects", b'{"prompt": "hi", "x": ' + b'{"a": ' * 100 + b"1" + b"}" * 100 + b"}", J,
     ["nested too deeply"]),
    ("integer over 4300 digits", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", J, ["4300 digits"]),
    ("integer in a list", b'{"prompt": [1, ' + b"7" * 4301 + b"]}", J, ["4300 digits"]),
    ("invalid utf-8", b'{"prompt": "\xc3\x28"}', J, ["UTF-8", "byte 12"]),
    ("text/plain", b'{"prompt": "hi"}', "text/plain", ["Content-Type", "application/json", "text/plain"]),
    ("form-urlencoded (curl -d)", b'{"prompt": "hi"}', "application/x-www-form-urlencoded",
     ["Content-Type", "curl"]),
    ("multipart", b"--x--", "multipart/form-data; boundary=x", ["Content-Type"]),
    ("empty body", b"", J, ["empty"]),
    ("whitespace body", b"  \n ", J, ["empty"]),
    ("array top level", b"[1, 2]", J, ["JSON object", "array"]),
    ("string top level", b'"hello"', J, ["JSON object", "string"]),
    ("null top level", b"null", J, ["JSON object", "null"]),
    ("number top level", b"12", J, ["JSON object", "number"]),
    ("NaN", b'{"prompt": "hi", "temperature": NaN}', J, ["NaN"]),
    ("Infinity", b'{"prompt": "hi", "temperature": -Infinity}', J, ["Infinity"]),
    ("float overflow", b'{"prompt": "hi", "temperature": 1e999}', J, ["1e999", "range"]),
    ("truncated", b'{"prompt": "hi", ', J, ["not valid JSON", "line 1"]),
    ("trailing garbage", b'{"prompt": "hi"} x', J, ["not valid JSON"]),
]


def test_body_parse_errors_are_400_counted_and_keep_the_connection(server):
    before = scrape(server.url)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read() == b'{"status":"ok"}'
    sock = conn.sock
    n_400 = 0
    for name, body, ctype, needles in PARSE_ERRORS:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": ctype})
        r = conn.getresponse()
        status, text = r.status, r.read()
        assert conn.sock is sock, f"{name}: the server closed the keep-alive connection"
        assert status == 400, (name, status, text[:300])
        err = error_of(text)
        assert err["code"] == 400 and err["type"] == "invalid_request_error", (name, err)
        for needle in needles:
            assert needle in err["message"], (name, needle, err["message"])
        if "Traceback" in err["message"]:
            raise AssertionError(err)
        n_400 += 1
    # the same connection still serves a good request
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": 2}),
                 headers={"Content-Type": J})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    r.read()
    assert conn.sock is sock
    conn.close()
    after = scrape(server.url)
    got = requests_count(after, "/v1/completions", "400") - requests_count(before, "/v1/completions", "400")
    assert got == n_400, (got, n_400)
    assert requests_count(after, "/v1/completions", "500") == requests_count(before, "/v1/completions", "500")
    assert "Traceback" not in server.log()


def test_error_paths_other_routes(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for path in ("/tokenize", "/detokenize", "/v1/chat/completions", "/v1/prefill"):
            r = c.post(path, content=b'{"content": ' + b"[" * 500 + b"]" * 500 + b"}",
                       headers={"content-type": J})
            assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], (path, r.text)


# ---- CPU-heavy text work off the event loop, with an input size limit -------------------------

def test_big_tokenize_does_not_freeze_health(server):
    text = "Hello world, h\u00e9llo ab cd. " * (MAX_CHARS // 27)
    assert len(text) <= MAX_CHARS
    result = {}

    def big():
        t0 = time.monotonic()
        with httpx.Client(timeout=120) as c:
            result["r"] = c.post(server.url + "/tokenize", json={"content": text, "with_pieces": True})
        result["s"] = time.monotonic() - t0

    latencies = []
    t = threading.Thread(target=big)
    with httpx.Client(timeout=30) as hc:
        hc.get(server.url + "/health")  # connection open before the big request starts
        t.start()
        deadline = time.monotonic() + 120
        while t.is_alive() and time.monotonic() < deadline:
            t0 = time.monotonic()
            assert hc.get(server.url + "/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)
    t.join(timeout=5)
    r = result["r"]
    assert r.status_code == 200, r.text[:300]
    pieces = r.json()["tokens"]
    assert len(pieces) > 10_000 and {"id", "piece"} == set(pieces[0])
    took = result["s"]
    assert len(latencies) >= 3, (took, latencies)
    # on the event loop, /health waited for the whole tokenization; now it is a GIL time-slice
    assert max(latencies) < max(0.5, took / 3), (took, max(latencies))


def test_input_size_limit_413(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        over = "a" * (MAX_CHARS + 1)
        for path, body in (("/tokenize", {"content": over}),
                           ("/v1/completions", {"prompt": over, "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": over[:MAX_CHARS // 2]},
                                                                  {"role": "user", "content": over[:MAX_CHARS // 2 + 1]}]})):
            r = c.post(path, json=body)
            assert r.status_code == 413, (path, r.status_code, r.text[:200])
            err = r.json()["error"]
            assert "--max-input-chars" in err["message"] and str(MAX_CHARS) in err["message"], err
        assert c.get("/health").status_code == 200


# ---- timeouts and the connection cap ---------------------------------------------------------

def test_slowloris_headers_get_408_and_close(server):
    sock = connect(server)
    t0 = time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    data = b""
    closed_at = None
    while time.monotonic() - t0 < 5 * T + 3:  # one header line every 0.2 s, forever
        try:
            sock.sendall(b"X-Slow: 1\r\n")
        except OSError:
            pass
        r, _, _ = select.select([sock], [], [], 0.2)
        if r:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                closed_at = time.monotonic() - t0
                break
            data += chunk
    sock.close()
    assert closed_at is not None, "a trickling client held its connection"
    assert closed_at < T + 2, closed_at
    assert data.startswith(b"HTTP/1.1 408 "), data[:200]
    assert b"--header-timeout" in data


def test_half_sent_requests_are_dropped(server):
    socks = []
    for i in range(MAX_CONN - 5):
        s = connect(server)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-" if i % 2 else b"GE")
        socks.append(s)
    # the server still answers others meanwhile
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    t0 = time.monotonic()
    for s in socks:
        data, when = read_until_closed(s, T + 3 - (time.monotonic() - t0))
        assert when != float("inf"), "a half-sent request was held"
        assert data == b"" or data.startswith(b"HTTP/1.1 408 ")
        s.close()
    assert time.monotonic() - t0 < T + 3


def test_idle_keep_alive_connection_closed(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read() == b'{"status":"ok"}'
    # a request within the keep-alive timeout reuses the connection
    time.sleep(T / 3)
    sock = conn.sock
    conn.request("GET", "/health")
    conn.getresponse().read()
    assert conn.sock is sock
    data, when = read_until_closed(sock, T + 3)
    assert data == b"" and T * 0.5 < when < T + 2.5, when
    conn.close()


def test_slow_body_gets_408(server):
    sock = connect(server)
    t0 = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n" + b'{"prompt": "')
    data, when = read_until_closed(sock, 3 * T + 3)
    sock.close()
    assert when < T + 2.5, when
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data[:300]
    err = error_of(body)
    assert err["code"] == 408 and "--body-timeout" in err["message"] and "12 bytes" in err["message"], err
    assert time.monotonic() - t0 < 3 * T + 3


def test_long_stream_is_not_cut_by_the_timeouts(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "Long", "max_tokens": 60, "ignore_eos": True,
                                                       "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            time.sleep(2 * T + 0.5)  # longer than the header, body and keep-alive timeouts
            events = list(sse_events(lines))
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 60


def test_connection_cap_503(server):
    before = scrape(server.url)
    socks = [connect(server) for _ in range(MAX_CONN)]
    try:
        r = httpx.get(server.url + "/health", timeout=5)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert "--max-connections" in err["message"] and r.headers["retry-after"] == "1"
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = scrape(server.url)
    assert requests_count(after, "/health", "503") - requests_count(before, "/health", "503") >= 1


# ---- Retry-After, HEAD -----------------------------------------------------------------------

def test_429_has_retry_after(server):
    slow = {"prompt": "Slow request", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=slow) as running:
            lines = running.iter_lines()
            next(lines)
            done = {}

            def queued():
                with httpx.Client(base_url=server.url, timeout=60) as c2:
                    done["r"] = c2.post("/v1/completions", json={"prompt": "Queued", "max_tokens": 2})

            t = threading.Thread(target=queued)
            t.start()
            deadline = time.monotonic() + 10
            while metric(scrape(server.url), "gguf_prefill_queue_depth") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = c.post("/v1/completions", json={"prompt": "One too many", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1", (r.status_code, r.headers)
            assert r.json()["error"]["type"] == "rate_limit_error"
        t.join(timeout=30)
    assert done["r"].status_code == 200


def test_head_where_get_is_allowed(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for path in ("/health", "/v1/models", "/metrics"):
            g = c.get(path)
            h = c.head(path)
            assert h.status_code == 200 == g.status_code, (path, h.status_code)
            assert h.content == b""
            assert h.headers["content-type"] == g.headers["content-type"]
            if path != "/metrics":  # metrics move between the two requests
                assert h.headers["content-length"] == g.headers["content-length"]
        r = c.head("/v1/completions")
        assert r.status_code == 405 and r.content == b""
        r = c.request("HEAD", "/nothing")
        assert r.status_code == 404


# ---- metrics count what the client got -------------------------------------------------------

def test_abandoned_stream_is_499_not_200(server):
    base = scrape(server.url)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "Abandon me", "max_tokens": 1500,
                                                       "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
    m = wait_count(server.url, "/v1/completions", "499", requests_count(base, "/v1/completions", "499") + 1)
    assert requests_count(m, "/v1/completions", "200") == requests_count(base, "/v1/completions", "200")


FAULTY = textwrap.dedent('''
    """A real server (server.main.serve_app) whose engine fails on purpose: /tokenize of
    "CRASH" raises in the route (a crash), a prompt starting "FAILSTREAM" fails in the engine
    worker after 3 tokens (a stream that fails after its 200)."""
    import sys

    from server.app import create_app
    from server.main import build_parser, serve_app
    from server.runner import Engine, load_engine
    from server.settings import Settings


    class FaultyEngine(Engine):
        fail_after = None

        def encode(self, text, add_special=True, parse_special=True):
            if text == "CRASH":
                raise RuntimeError("injected crash")
            if text.startswith("FAILSTREAM"):
                type(self).fail_after = 3
            return super().encode(text, add_special, parse_special)

        def token_bytes(self, token):
            n = type(self).fail_after
            if n is not None:
                if n <= 0:
                    type(self).fail_after = None
                    raise RuntimeError("injected engine fault")
                type(self).fail_after = n - 1
            return super().token_bytes(token)


    settings = Settings.from_namespace(build_parser().parse_args(sys.argv[1:]))
    engine = load_engine(settings)
    engine.__class__ = FaultyEngine
    sys.exit(serve_app(create_app(settings, engine=engine), settings))
''')


@pytest.fixture(scope="module")
def faulty_server(tiny_model_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("faulty")
    script = d / "faulty_server.py"
    script.write_text(FAULTY)
    with ServerProcess(tiny_model_path, ["--ctx-size", "512"], script=script, log_dir=d) as s:
        s.wait_ready()
        yield s


def test_crash_is_a_counted_json_500_and_the_connection_survives(faulty_server):
    url = faulty_server.url
    before = scrape(url)
    conn = http.client.HTTPConnection("127.0.0.1", faulty_server.port, timeout=10)
    conn.request("POST", "/tokenize", body=json.dumps({"content": "CRASH"}), headers={"Content-Type": J})
    r = conn.getresponse()
    body = r.read()
    assert r.status == 500 and r.getheader("content-type") == "application/json", body
    err = error_of(body)
    assert err["code"] == 500 and "RuntimeError" in err["message"] and "injected crash" in err["message"]
    conn.request("POST", "/tokenize", body=json.dumps({"content": "fine"}), headers={"Content-Type": J})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    r.read()
    conn.close()
    after = scrape(url)
    assert requests_count(after, "/tokenize", "500") - requests_count(before, "/tokenize", "500") == 1
    log = faulty_server.log()
    assert "injected crash" in log and "Exception in ASGI application" not in log
    assert log.count("injected crash") <= 2  # logged once (message + traceback), not twice over


def test_failed_stream_is_counted_as_its_error(faulty_server):
    url = faulty_server.url
    before = scrape(url)
    with httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "FAILSTREAM now", "max_tokens": 50,
                                                       "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            events = list(sse_events(r.iter_lines()))  # ends cleanly: no TransportError
        assert "[DONE]" not in events
        err = events[-1]["error"]
        assert err["code"] == 500 and "injected engine fault" in err["message"], err
        # non-streamed, the same fault is a JSON 500
        r = c.post("/v1/completions", json={"prompt": "FAILSTREAM again", "max_tokens": 50, "ignore_eos": True})
        assert r.status_code == 500 and "injected engine fault" in r.json()["error"]["message"]
    m = wait_count(url, "/v1/completions", "500", requests_count(before, "/v1/completions", "500") + 2)
    assert requests_count(m, "/v1/completions", "200") == requests_count(before, "/v1/completions", "200")


# ---- past the shutdown grace period ----------------------------------------------------------

def test_past_the_grace_period_clean_errors_then_exit_0(tiny_model_path, tmp_path):
    with ServerProcess(tiny_model_path, ["--shutdown-timeout", "1", "--ctx-size", "2048", "--parallel", "1"], log_dir=tmp_path,
                       via_cli=False) as s:
        s.wait_ready()
        results = {}
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "Too long", "max_tokens": 2000,
                                                           "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)

                def queued():
                    with httpx.Client(base_url=s.url, timeout=60) as c2:
                        results["queued"] = c2.post("/v1/completions", json={"prompt": "Waiting", "max_tokens": 5})

                t = threading.Thread(target=queued)
                t.start()
                deadline = time.monotonic() + 10
                while metric(scrape(s.url), "gguf_prefill_queue_depth") < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                t_sig = time.monotonic()
                s.proc.send_signal(signal.SIGTERM)
                events = list(sse_events(lines))  # no TransportError: the stream ends cleanly
                ended = time.monotonic() - t_sig
            t.join(timeout=30)
        assert "[DONE]" not in events
        err = events[-1]["error"]
        assert err["code"] == 503 and "shutting down" in err["message"] and "grace" in err["message"], err
        assert 0.8 < ended < 5, ended
        q = results["queued"]
        assert q.status_code == 503 and q.headers["content-type"] == "application/json", q.text
        assert "shutting down" in q.json()["error"]["message"]
        assert s.proc.wait(timeout=15) == 0, s.log()
        log = s.log()
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log


# ---- `serve` flags: one stderr line, exit 2 --------------------------------------------------

def run_serve(args, env=None, via_cli=True, timeout=60):
    cmd = [sys.executable, "-m", "engine", "serve"] if via_cli else [sys.executable, "-m", "server"]
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    for k in list(full_env):
        if k.startswith("GGUF_PREFILL_") and k != "GGUF_PREFILL_HOME":
            full_env.pop(k)
    full_env.update(env or {})
    return subprocess.run(cmd + list(args), cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_serve_flag_errors_one_line_exit_2(tiny_model_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    busy_port = taken.getsockname()[1]
    m = ["-m", tiny_model_path, "--device", "cpu", "--host", "127.0.0.1"]
    cases = [
        (["--port", "99999"], {}, ["--port", "99999", "0..65535"]),
        (["--ctx-size", "-5"], {}, ["--ctx-size", "-5"]),
        ([], {"GGUF_PREFILL_PORT": "abc"}, ["GGUF_PREFILL_PORT", "abc"]),
        ([], {"GGUF_PREFILL_SHUTDOWN_TIMEOUT": "nan"}, ["shutdown-timeout"]),
        (["--port", "abc"], {}, ["--port", "abc"]),
        (m + ["--port", str(free_port()), "--ctx-size", "10000000"], {}, ["10000000", "n_ctx_train 2048"]),
        (m + ["--port", str(busy_port)], {}, ["cannot listen", str(busy_port)]),
        (["--header-timeout", "0"], {}, ["--header-timeout"]),
        (["--max-connections", "0"], {}, ["--max-connections"]),
        (["--bogus"], {}, ["--bogus"]),
    ]
    try:
        for i, (args, env, needles) in enumerate(cases):
            p = run_serve(args, env, via_cli=i % 3 != 2)
            lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
            assert p.returncode == 2, (args, env, p.returncode, p.stderr[-2000:])
            assert len(lines) == 1, (args, env, p.stderr[-2000:])
            assert "Traceback" not in p.stderr
            for needle in needles:
                assert needle in lines[0], (args, env, needle, lines[0])
    finally:
        taken.close()


def help_entries(text: str) -> dict[str, str]:
    """argparse help -> {'--flag': 'its whole help paragraph, whitespace collapsed'}."""
    entries: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  -"):
            flags = [w.rstrip(",") for w in line.split() if w.startswith("-")]
            current = next((f for f in flags if f.startswith("--")), flags[0])
            entries[current] = [line]
        elif current is not None and line.startswith("    "):
            entries[current].append(line)
        else:
            current = None
    return {k: " ".join(" ".join(v).split()) for k, v in entries.items()}


def test_help_shows_defaults():
    p = run_serve(["--help"])
    assert p.returncode == 0, p.stderr
    entries = help_entries(p.stdout)
    for flag, default in (("--host", "127.0.0.1"), ("--port", "8080"), ("--ctx-size", "0"),
                          ("--max-queue", "128"), ("--shutdown-timeout", "30"), ("--device", "auto"),
                          ("--max-body-bytes", "1048576"), ("--log-level", "info"),
                          ("--max-input-chars", "262144"), ("--max-connections", "512"),
                          ("--keep-alive-timeout", "5"), ("--header-timeout", "10"),
                          ("--body-timeout", "30"), ("--api-key", "none"), ("--model", ": the default model")):
        assert flag in entries, (flag, sorted(entries))
        assert f"default {default}" in entries[flag] or f"default{default}" in entries[flag], (flag, entries[flag])


# ---- the newcomer's view: a startup line, "ready" only when it is ------------------------------

def test_startup_log_line_and_ready_only_when_answering(server):
    # while loading, the port was not listening: /health never said 503, only 200 once it answered
    assert server.startup_statuses == [200], server.startup_statuses
    log = server.log()
    lines = log.splitlines()
    (startup,) = [ln for ln in lines if "loaded in" in ln and "backend" in ln]
    for needle in ("model tiny.gguf", "llama", "backend ReferenceModel", "on cpu", "GiB resident",
                   "n_ctx 2048"):
        assert needle in startup, (needle, startup)
    running = [i for i, ln in enumerate(lines) if "Uvicorn running on http://127.0.0.1:" in ln]
    ready = [i for i, ln in enumerate(lines) if ln.startswith("INFO: ready: model tiny.gguf answers on")]
    assert running and ready, log
    assert lines.index(startup) < running[0] <= ready[0]
    assert lines.index(startup) > min(i for i, ln in enumerate(lines) if "loading" in ln)


SLOW_LOADER = textwrap.dedent('''
    """serve_app with a model load that takes SLOW_LOAD_S seconds."""
    import os
    import sys
    import time

    from server.app import create_app
    from server.main import build_parser, serve_app
    from server.runner import load_engine
    from server.settings import Settings


    def slow(settings):
        time.sleep(float(os.environ["SLOW_LOAD_S"]))
        return load_engine(settings)


    settings = Settings.from_namespace(build_parser().parse_args(sys.argv[1:]))
    sys.exit(serve_app(create_app(settings, loader=slow), settings))
''')


def test_slow_load_progress_then_ready(tiny_model_path, tmp_path):
    script = tmp_path / "slow_server.py"
    script.write_text(SLOW_LOADER)
    with ServerProcess(tiny_model_path, [], script=script, log_dir=tmp_path, env={"SLOW_LOAD_S": "2.6"}) as s:
        statuses = s.wait_ready(timeout=60)
        assert statuses == [200], statuses  # nothing answered (not even 503) until it could answer
        log = s.log()
        progress = log.index("loading tiny.gguf: 2 s so far")
        assert progress < log.index("Uvicorn running on") < log.index("ready: model tiny.gguf")


def test_sigterm_while_loading_exits_0_without_listening(tiny_model_path, tmp_path):
    script = tmp_path / "slow_server.py"
    script.write_text(SLOW_LOADER)
    with ServerProcess(tiny_model_path, [], script=script, log_dir=tmp_path, env={"SLOW_LOAD_S": "60"}) as s:
        deadline = time.monotonic() + 30
        while "so far" not in s.log():
            assert time.monotonic() < deadline and s.proc.poll() is None, s.log()
            time.sleep(0.1)
        with pytest.raises(httpx.TransportError):
            httpx.get(s.url + "/health", timeout=2)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=10) == 0, s.log()
        assert time.monotonic() - t0 < 5
        log = s.log()
        assert "interrupted while loading" in log and "ready" not in log and "Traceback" not in log
