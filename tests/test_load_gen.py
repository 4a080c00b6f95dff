"""scripts/load_gen.py: the percentile helper, the argument bounds (127.0.0.1 only), the prompts,
the stream reader against small fake servers (errors, cuts, timeouts, no usage), and a real run
against the server on the tiny synthetic model (CPU backend)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from server_fixtures import REPO, ServerProcess

SCRIPT = REPO / "scripts" / "load_gen.py"


def _load():
    spec = importlib.util.spec_from_file_location("load_gen", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["load_gen"] = mod
    spec.loader.exec_module(mod)
    return mod


lg = _load()


# ---- percentile --------------------------------------------------------------------------------

def test_percentile_known_values():
    assert lg.percentile([], 50) is None
    assert lg.percentile([7.0], 50) == 7.0 and lg.percentile([7.0], 99) == 7.0
    assert lg.percentile([1, 2, 3, 4], 50) == 2.5
    assert lg.percentile([3, 1, 2], 50) == 2.0          # order does not matter
    xs = list(range(1, 101))
    assert lg.percentile(xs, 0) == 1 and lg.percentile(xs, 100) == 100
    assert lg.percentile(xs, 50) == pytest.approx(50.5)
    assert lg.percentile(xs, 99) == pytest.approx(99.01)
    assert lg.percentile([10, 20], 25) == pytest.approx(12.5)
    rng = np.random.default_rng(1)
    for n in (2, 5, 17, 1000):
        v = rng.normal(size=n)
        for q in (1, 50, 90, 99):
            assert lg.percentile(v, q) == pytest.approx(float(np.percentile(v, q)))
    with pytest.raises(ValueError):
        lg.percentile([1], 101)


# ---- arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["localhost", "0.0.0.0", "10.0.0.1", "::1", "example.com",
                                  "127.0.0.2", ""])
def test_other_hosts_are_refused(host, capsys):
    with pytest.raises(ValueError, match="only targets 127.0.0.1"):
        lg.check_host(host)
    with pytest.raises(SystemExit) as e:
        lg.main(["--host", host, "--port", "1"])
    assert e.value.code == 2
    assert "refusing host" in capsys.readouterr().err


def test_host_refused_from_the_command_line():
    p = subprocess.run([sys.executable, str(SCRIPT), "--host", "192.168.1.1"], capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 2 and "refusing host '192.168.1.1'" in p.stderr


@pytest.mark.parametrize("argv, words", [
    (["--concurrency", "1,257"], "outside 1..256"),
    (["--concurrency", "0"], "outside 1..256"),
    (["--concurrency", "a"], "comma-separated"),
    (["--requests", "4097"], "outside 1..4096"),
    (["--requests", "0"], "outside 1..4096"),
    (["--timeout", "0"], "--timeout"),
    (["--max-seconds", "-1"], "--max-seconds"),
    (["--id-lo", "5", "--id-hi", "5"], "--id-lo"),
    (["--prompt-tokens", "8", "--shared-prefix", "9"], "--shared-prefix"),
    (["--max-tokens", "0"], "--max-tokens"),
])
def test_bounds(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        lg.parse_args(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_defaults():
    a = lg.parse_args([])
    assert (a.host, a.port, a.levels, a.timeout, a.prompt_tokens, a.max_tokens, a.id_lo, a.id_hi,
            a.warmup, a.shared_prefix) == ("127.0.0.1", 8080, [1, 8, 32], 600.0, 256, 128, 100,
                                           20000, 1, 0)
    assert [lg.level_requests(a, c) for c in a.levels] == [2, 16, 64]
    a = lg.parse_args(["--requests", "5"])
    assert lg.level_requests(a, 32) == 5


def test_prompts_fresh_seeded_shared_prefix():
    p = lg.PromptSource(16, 10, 50, seed=3, shared_prefix=5)
    got = [p.next() for _ in range(20)]
    assert all(len(x) == 16 and all(10 <= t < 50 for t in x) for x in got)
    assert all(x[:5] == got[0][:5] for x in got)
    assert len({tuple(x[5:]) for x in got}) == 20
    again = lg.PromptSource(16, 10, 50, seed=3, shared_prefix=5)
    assert [again.next() for _ in range(20)] == got
    other = lg.PromptSource(16, 10, 50, seed=4, shared_prefix=5)
    assert other.next() != got[0]
    body = json.loads(lg.request_body([1, 2], 4))
    assert body == {"prompt": [1, 2], "max_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}


# ---- fake servers: what the reader makes of odd answers ----------------------------------------

def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _event(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _tok(text="x", finish=None, usage=None):
    body = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return body


async def _fake(behaviour):
    """A one-behaviour HTTP server on 127.0.0.1; behaviour(writer) writes the whole answer."""
    async def handle(reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            n = int([h for h in head.decode().split("\r\n") if h.lower().startswith("content-length")][0]
                    .split(":")[1])
            json.loads(await reader.readexactly(n))
            await behaviour(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _run_against(behaviour, *extra):
    async def go():
        server, port = await _fake(behaviour)
        async with server:
            args = lg.parse_args(["--port", str(port), "--concurrency", "2", "--requests", "3",
                                  "--prompt-tokens", "4", "--max-tokens", "3", *extra])
            return await lg.run(args)
    return asyncio.run(go())


SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")


def test_fake_good_stream_chunked_with_usage():
    async def ok(w):
        w.write(SSE_HEAD)
        for i in range(3):
            w.write(_chunked(_event(_tok("ab"))))
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(_chunked(_event(_tok("", "length"))))
        # one HTTP chunk holding two events, the second split across chunks
        both = _event({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}) + _event(b"[DONE]")
        w.write(_chunked(both[:-9]) + _chunked(both[-9:]) + b"0\r\n\r\n")
        await w.drain()

    rc, recs = _run_against(ok, "--warmup", "0")
    r = recs[0]
    assert rc == 0 and r["errors"] == 0 and r["ok"] == 3 and r["cut"] == 0
    assert r["completion_tokens"] == 9 and r["prompt_tokens"] == 12 and r["token_counts"] == "usage"
    assert r["ttft_p50_s"] > 0 and r["itl_p50_ms"] >= 5 and r["gen_tok_s"] > 0
    assert r["req_decode_tok_s_p50"] > 0


def test_fake_no_usage_counts_chunks_and_eof_body():
    async def no_usage(w):
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        w.write(b"".join(_event(_tok("t")) for _ in range(2)) + b": comment\n\n"
                + _event(_tok("", "length")) + _event(b"[DONE]"))
        await w.drain()

    rc, recs = _run_against(no_usage, "--warmup", "0")
    r = recs[0]
    assert r["errors"] == 0 and r["token_counts"] == "chunks"
    assert r["completion_tokens"] == 6 and r["prompt_tokens"] == 12


@pytest.mark.parametrize("answer, words", [
    (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: 45\r\n\r\n"
     b'{"error": {"message": "queue full", "x": 1}} ', "HTTP 429: queue full"),
    (SSE_HEAD + _chunked(_event(_tok("a")) + _event({"error": {"message": "engine error: boom"}}))
     + b"0\r\n\r\n", "error event: engine error: boom"),
    (SSE_HEAD + _chunked(_event(_tok("a"))) + b"0\r\n\r\n", "without data: [DONE]"),
    (SSE_HEAD + _chunked(b"data: {not json\n\n") + b"0\r\n\r\n", "not JSON"),
    (b"garbage\r\n\r\n", "bad status line"),
])
def test_fake_errors(answer, words):
    async def bad(w):
        w.write(answer)
        await w.drain()

    rc, recs = _run_against(bad, "--warmup", "0")
    r = recs[0]
    assert rc == 0 and r["errors"] == 3 and r["ok"] == 0
    assert any(words in s for s in r["error_samples"]), r["error_samples"]


def test_fake_warmup_failure_is_exit_1():
    async def refuse(w):
        w.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
        await w.drain()

    rc, recs = _run_against(refuse, "--warmup", "2")
    assert rc == 1 and recs == []


def test_nothing_listening_is_an_error_per_request():
    import socket

    with socket.socket() as s:  # a port with nothing behind it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = lg.parse_args(["--port", str(port), "--concurrency", "1", "--requests", "2",
                          "--warmup", "0"])
    rc, recs = asyncio.run(lg.run(args))
    assert rc == 0 and recs[0]["errors"] == 2 and "ConnectionRefusedError" in recs[0]["error_samples"][0]


async def _slow(w):
    w.write(SSE_HEAD)
    for _ in range(100):
        w.write(_chunked(_event(_tok("z"))))
        await w.drain()
        await asyncio.sleep(0.05)


def test_fake_max_seconds_cuts_a_level():
    t0 = time.perf_counter()
    rc, recs = _run_against(_slow, "--warmup", "0", "--max-seconds", "0.5")
    r = recs[0]
    assert time.perf_counter() - t0 < 3
    assert r["errors"] == 0 and r["cut"] == 2 and r["requests"] == 2 and r["planned"] == 3
    assert r["completion_tokens"] >= 4 and r["wall_s"] < 1.5   # chunks that arrived still count
    assert "unsent=1" in lg.level_line(r)


def test_fake_timeout_is_an_error():
    rc, recs = _run_against(_slow, "--warmup", "0", "--timeout", "0.3")
    r = recs[0]
    assert r["errors"] == 3 and r["cut"] == 0 and "timeout after 0.3 s" in r["error_samples"][0]


# ---- the real server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    with ServerProcess(tiny_model_path, ["--ctx-size", "2048"],
                       log_dir=tmp_path_factory.mktemp("logs")) as s:
        s.wait_ready()
        yield s


def test_real_server(server, tmp_path):
    out = tmp_path / "load.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--port", str(server.port), "--concurrency", "1,2",
                        "--requests", "2", "--prompt-tokens", "8", "--max-tokens", "4",
                        "--id-lo", "10", "--id-hi", "500", "--timeout", "60", "--max-seconds", "60",
                        "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr + server.log()
    doc = json.loads(out.read_text())
    assert doc["config"]["concurrency"] == [1, 2] and doc["config"]["host"] == "127.0.0.1"
    recs = doc["records"]
    assert [r["concurrency"] for r in recs] == [1, 2]
    for r in recs:
        assert r["errors"] == 0 and r["cut"] == 0 and r["ok"] == 2 and r["requests"] == 2, r
        assert r["token_counts"] == "usage"
        assert r["completion_tokens"] == 2 * 4 and r["prompt_tokens"] == 2 * 8
        assert r["ttft_p50_s"] > 0 and r["ttft_p99_s"] >= r["ttft_p50_s"]
        assert r["gen_tok_s"] > 0 and r["prompt_tok_s"] > 0 and r["wall_s"] > 0
        assert r["itl_p50_ms"] is not None and r["req_decode_tok_s_p50"] > 0
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("load_gen: 127.0.0.1:") and lines[1].startswith("warmup: 1 requests, 0 failed")
    assert lines[2].startswith("c=1 req=2 err=0") and lines[3].startswith("c=2 req=2 err=0")
    assert "gen tok/s" in lines[4] and lines[-1].split()[0] == "2"


def test_real_server_shared_prefix_in_process(server):
    args = lg.parse_args(["--port", str(server.port), "--concurrency", "2", "--requests", "3",
                          "--prompt-tokens", "8", "--shared-prefix", "6", "--max-tokens", "3",
                          "--id-lo", "10", "--id-hi", "500", "--warmup", "0"])
    rc, recs = asyncio.run(lg.run(args))
    assert rc == 0 and recs[0]["errors"] == 0
    assert recs[0]["completion_tokens"] == 9 and recs[0]["prompt_tokens"] == 24
