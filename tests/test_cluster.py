"""Scale-out (issue 16): the prefix-aware router alone (no Ray), the serve flags, then
`gguf-prefill serve --replicas 2` on the CPU backend with the tiny model in a local Ray instance
(a subprocess, as users run it): requests spread over both replicas, prefix-affine requests land
on one, the choice shows in /metrics, and a killed replica is replaced while its in-flight
stream ends with a clean error."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server.cluster.prefix_router import (LEAST_LOADED, PREFIX, PrefixRouter, block_hashes)
from server_fixtures import REPO, ServerProcess, metric, parse_metrics


# ---- the router, without Ray -------------------------------------------------------------------

def test_block_hashes_are_chained_and_cover_full_blocks_only():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2                                    # 40 tokens: 2 full blocks, 8 left over
    b = block_hashes(list(range(32)) + [99] * 16, 16)
    assert a == b[:2] and len(b) == 3
    c = block_hashes([7] + list(range(1, 32)), 16)        # first block differs ...
    assert c[0] != a[0] and c[1] != a[1]                  # ... so every later hash differs
    assert block_hashes(list(range(15)), 16) == [] and block_hashes(None) == []


def test_longest_prefix_wins_else_least_loaded():
    r = PrefixRouter(block_size=4, max_blocks=100, imbalance=2)
    r.set_replicas(["a", "b"])
    shared = list(range(100, 112))                        # 3 blocks
    d = r.choose(shared + [1, 2, 3, 4])
    assert d.reason == LEAST_LOADED and d.matched_blocks == 0
    assert r.routed_to("a", d) == LEAST_LOADED
    d2 = r.choose(shared + [9, 9, 9, 9, 9])
    assert (d2.replica, d2.reason, d2.matched_blocks) == ("a", PREFIX, 3)
    assert d2.ranking == ["a", "b"]
    # b holds a longer prefix of another prompt: it wins that one even though busier
    other = list(range(500, 520))
    r.routed_to("b", r.choose(other))
    r.routed_to("b", r.choose([1, 2, 3, 4]))
    d3 = r.choose(other + [0])
    assert (d3.replica, d3.reason, d3.matched_blocks) == ("b", PREFIX, 5)
    # too busy: the prefix replica is passed over past `imbalance` more requests in flight
    for _ in range(3):
        r.routed_to("b", None)
    d4 = r.choose(other)
    assert d4.reason == LEAST_LOADED and d4.replica == "a"
    assert r.routed[("a", LEAST_LOADED)] == 1 and r.routed.get(("b", PREFIX), 0) == 0


def test_no_match_spreads_by_in_flight_then_least_recently_chosen():
    r = PrefixRouter(block_size=16)
    r.set_replicas(["a", "b", "c"])
    got = []
    for _ in range(6):
        d = r.choose([1, 2, 3])                           # shorter than a block: no affinity
        got.append(d.replica)
        r.routed_to(d.replica, d)
    assert sorted(got[:3]) == ["a", "b", "c"] and sorted(got[3:]) == ["a", "b", "c"]
    r.finished("b")
    assert r.choose([1]).replica == "b"                   # fewest in flight now
    assert r.inflight("a") == 2 and r.inflight("b") == 1


def test_lru_is_bounded_and_replica_set_changes_forget():
    r = PrefixRouter(block_size=2, max_blocks=4)
    r.set_replicas(["a"])
    r.routed_to("a", r.choose([1, 2, 3, 4, 5, 6]))
    r.routed_to("a", r.choose([7, 8, 9, 10, 11, 12]))    # 6 blocks offered, 4 kept
    assert r.cached_blocks("a") == 4
    assert r.choose([1, 2, 3, 4]).matched_blocks == 0    # the oldest blocks went first
    assert r.choose([7, 8, 9, 10, 11, 12]).matched_blocks == 3
    r.set_replicas(["b"])                                 # a died, b replaced it
    assert r.replicas == ["b"] and r.cached_blocks("a") == 0
    d = r.choose([7, 8, 9, 10])
    assert d.replica == "b" and d.reason == LEAST_LOADED


def test_front_metrics_merge_replicas_with_a_label():
    from server.cluster.front_metrics import FrontMetrics
    from server.metrics import Metrics

    m1, m2 = Metrics(), Metrics()
    m1.queue_depth.set(3)
    m2.queue_depth.set(1)
    m1.requests.labels("/v1/completions", "200").inc()
    f = FrontMetrics()
    f.update({("a", PREFIX): 2, ("b", LEAST_LOADED): 1}, {"a": 1, "b": 0}, {"a": 5, "b": 0},
             {"a": m1.render().decode(), "b": m2.render().decode()})
    text = f.render().decode()
    m = parse_metrics(text)
    assert metric(m, "gguf_prefill_queue_depth", replica="a") == 3
    assert metric(m, "gguf_prefill_queue_depth", replica="b") == 1
    assert metric(m, "gguf_prefill_router_requests_total", replica="a", reason="prefix") == 2
    assert metric(m, "gguf_prefill_requests_total", endpoint="/v1/completions", replica="a",
                  status="200") == 1
    assert metric(m, "gguf_prefill_replicas") == 2
    assert text.count("# TYPE gguf_prefill_queue_depth ") == 1    # one family, two samples


def test_asgi_call_streams_and_reports_disconnect():
    import asyncio

    from server.cluster.asgi_call import call

    seen = {}

    async def app(scope, receive, send):
        msg = await receive()
        seen["body"] = msg["body"]
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        await send({"type": "http.response.body", "body": b"two", "more_body": True})
        seen["next"] = (await receive())["type"]        # the caller left: a disconnect

    async def main():
        parts = []
        agen = call(app, "POST", "/x", b"", [], b"hello")
        async for p in agen:
            parts.append(p)
            if p == b"two":
                break
        await agen.aclose()
        return parts

    parts = asyncio.run(main())
    assert parts[0] == {"status": 201, "headers": [["content-type", "text/plain"]]}
    assert parts[1:] == [b"one", b"two"]
    assert seen == {"body": b"hello", "next": "http.disconnect"}


# ---- flags -------------------------------------------------------------------------------------

def _serve(*args, env=None, timeout=60):
    e = dict(os.environ, PYTHONPATH=str(REPO))
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "engine", "serve", *args], capture_output=True,
                          text=True, timeout=timeout, env=e, cwd=REPO)


@pytest.mark.parametrize("args,env,needle", [
    (["--replicas", "-1"], {}, "--replicas (or GGUF_PREFILL_REPLICAS): -1 must be in 0..1024"),
    (["--replicas", "2", "--min-replicas", "3"], {}, "--min-replicas (or GGUF_PREFILL_MIN_REPLICAS): 3 is more than replicas (2)"),
    (["--replicas", "2", "--max-replicas", "1"], {}, "--max-replicas (or GGUF_PREFILL_MAX_REPLICAS): 1 is fewer than replicas (2)"),
    (["--min-replicas", "1"], {}, "needs --replicas"),
    ([], {"GGUF_PREFILL_REPLICAS": "two"}, "GGUF_PREFILL_REPLICAS='two': not an integer"),
    (["--replicas", "x"], {}, "gguf-prefill serve: error: argument --replicas"),
])
def test_bad_replica_flags_are_one_line_exit_2(args, env, needle, tiny_model_path):
    r = _serve("-m", tiny_model_path, *args, env=env)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_help_shows_the_scale_out_flags():
    from server.main import build_parser

    text = " ".join(build_parser().format_help().split())
    for flag, env in (("--replicas", "GGUF_PREFILL_REPLICAS"),
                      ("--min-replicas", "GGUF_PREFILL_MIN_REPLICAS"),
                      ("--max-replicas", "GGUF_PREFILL_MAX_REPLICAS")):
        assert flag in text and env in text


def test_replicas_without_ray_is_one_error_line(tiny_model_path, tmp_path):
    # a `ray` package that cannot be imported stands in for an install without the extra
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    r = _serve("-m", tiny_model_path, "--replicas", "2", "--device", "cpu",
               env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gguf-prefill serve: error: --replicas needs "
                                                   "Ray Serve"), r.stderr
    assert "gguf-prefill[cluster]" in lines[0]


def test_replica_options_from_settings():
    from server.cluster import replica_options
    from server.settings import Settings

    fixed = replica_options(Settings(replicas=3, device="gpu", parallel=4, max_queue=10))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"]["num_gpus"] == 1 and fixed["max_ongoing_requests"] == 14
    auto = replica_options(Settings(replicas=2, min_replicas=1, max_replicas=4, device="cpu",
                                    parallel=8))
    assert auto["ray_actor_options"]["num_gpus"] == 0 and "num_replicas" not in auto
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                          "initial_replicas": 2, "target_ongoing_requests": 8}


# ---- 2 replicas on a local Ray instance ---------------------------------------------------------

ray = pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory):
    args = ["--replicas", "2", "--parallel", "4", "--ctx-size", "2048", "--max-batch-tokens", "64"]
    env = {"RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0"}
    with ServerProcess(tiny_model_path, args, env=env,
                       log_dir=tmp_path_factory.mktemp("logs")) as s:
        s.wait_ready(timeout=90)                  # one replica answers /health ...
        assert len(_replicas(s.url, want=2, timeout=60)) == 2, s.log()   # ... the router sees both
        yield s


def _complete(url, body, timeout=60):
    with httpx.Client(base_url=url, timeout=timeout) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.headers["x-gguf-prefill-replica"], r.json()


def _metrics(url):
    with httpx.Client(base_url=url, timeout=30) as c:
        return parse_metrics(c.get("/metrics").text)


def _replicas(url, want=2, timeout=60.0):
    """The router's replica ids (from /metrics), waiting until there are `want` of them."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        ids = sorted({k.split('replica="')[1].split('"')[0] for k in m
                      if k.startswith("gguf_prefill_router_inflight{")})
        if len(ids) == want or time.monotonic() > deadline:
            return ids
        time.sleep(0.5)


def test_concurrent_requests_spread_over_both_replicas(cluster):
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5)] for i in range(12)]  # < 1 block: no affinity
    body = lambda p: {"prompt": p, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    with cf.ThreadPoolExecutor(12) as ex:
        got = list(ex.map(lambda p: _complete(cluster.url, body(p)), prompts))
    used = {rid for rid, _ in got}
    assert len(used) == 2, used
    assert all(b["usage"]["completion_tokens"] == 24 for _, b in got)
    m = _metrics(cluster.url)
    for rid in used:   # the decision and each replica's own metrics, labelled, on one page
        assert metric(m, "gguf_prefill_router_requests_total", replica=rid, reason="least_loaded") >= 1
        assert f'gguf_prefill_queue_depth{{replica="{rid}"}}' in m
        assert metric(m, "gguf_prefill_model_loaded", replica=rid) == 1
    assert metric(m, "gguf_prefill_replicas") == 2


def test_prefix_affine_requests_land_on_one_replica(cluster):
    shared = [(13 * j) % 250 + 2 for j in range(80)]                    # 5 blocks of 16
    first, body0 = _complete(cluster.url, {"prompt": shared + [1], "max_tokens": 2})
    before = _metrics(cluster.url)
    places = []
    for tail in range(2, 8):
        rid, body = _complete(cluster.url, {"prompt": shared + [tail, tail], "max_tokens": 2})
        places.append(rid)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64   # its slot cache
    assert set(places) == {first}
    after = _metrics(cluster.url)
    key = dict(replica=first, reason="prefix")
    assert metric(after, "gguf_prefill_router_requests_total", **key) - \
        metric(before, "gguf_prefill_router_requests_total", **key) == 6
    assert metric(after, "gguf_prefill_router_cached_blocks", replica=first) >= 5


def test_killed_replica_is_replaced_and_its_stream_ends_cleanly(cluster):
    old = _replicas(cluster.url)
    assert len(old) == 2
    body = {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    events: list = []
    with httpx.Client(base_url=cluster.url, timeout=httpx.Timeout(30.0)) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            victim = r.headers["x-gguf-prefill-replica"]
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    break
            with httpx.Client(base_url=cluster.url, timeout=30) as c2:   # the replica's pid
                pid = _pid_of(c2, victim)
            os.kill(pid, signal.SIGKILL)                                    # the replica dies
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
    assert time.monotonic() - t0 < 30, "the stream of a dead replica must end, not hang"
    last = json.loads(events[-1][len("data: "):])
    assert last["error"]["code"] == 503 and "replica" in last["error"]["message"], last
    assert "[DONE]" not in "".join(events)
    # Ray Serve starts a replacement; requests are served meanwhile and after
    deadline = time.monotonic() + 60
    while True:
        now = _replicas(cluster.url, want=2, timeout=5)
        if len(now) == 2 and victim not in now:
            break
        assert time.monotonic() < deadline, f"no replacement for {victim}: {now}\n{cluster.log()}"
        time.sleep(1)
    new = (set(now) - set(old)).pop()
    served = {_complete(cluster.url, {"prompt": [i + 3, 4], "max_tokens": 2})[0]
              for i in range(8)}
    assert new in served
    m = _metrics(cluster.url)
    assert metric(m, "gguf_prefill_replica_failures_total") >= 1


def _pid_of(client, rid):
    """The pid of replica `rid`: its gguf_prefill_replica_process sample on the front's page."""
    for k in parse_metrics(client.get("/metrics").text):
        if k.startswith("gguf_prefill_replica_process{") and f'replica="{rid}"' in k:
            return int(k.split('pid="')[1].split('"')[0])
    raise AssertionError(f"no process info for replica {rid}")


def test_sigterm_stops_the_cluster_cleanly(cluster):
    assert cluster.terminate() == 0
