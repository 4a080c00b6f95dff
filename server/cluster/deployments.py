"""The Ray Serve application: N `EngineReplica`s (one engine each: the project's own FastAPI
app run in-process) behind one `Front` (the HTTP ingress: prompt ids for routing, the
prefix-aware handle, a clean 503 when a replica dies, /metrics of the router and of every
replica).

    build(settings) -> Application            # what `gguf-prefill serve --replicas N` runs
    app_builder(args) -> Application          # `serve run server.cluster.deployments:app_builder
                                              #  model=/path/m.gguf replicas=2 device=cpu`
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from server.cluster import replica_options
from server.settings import Settings

log = logging.getLogger("ray.serve")  # inside replicas: Serve's own log files

ENGINE = "EngineReplica"
FRONT = "Front"
REPLICA_HEADER = "x-gguf-prefill-replica"
PART_TIMEOUT_S = 600.0     # most seconds between two parts of one reply before it is a 503
METRICS_TIMEOUT_S = 5.0    # per replica, for the front's /metrics
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "date", "server",
                "keep-alive"}


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (unit use)
        return "local"


class EngineReplica:
    """One engine: loads the model in its constructor (the replica is not routed to before),
    then answers HTTP requests through server.app's app, in this process."""

    def __init__(self, settings: dict[str, Any]):
        from server.app import create_app

        self.settings = Settings(**settings)
        self.app = create_app(self.settings)
        self.runner = self.app.state.runner
        self.runner.start()
        while self.runner.state == "loading":
            time.sleep(0.05)
        if self.runner.state == "failed":
            raise RuntimeError(f"model failed to load: {self.runner.load_error}")
        self.replica = _replica_id()

    async def http(self, method: str, path: str, query: bytes, headers: list, body: bytes,
                   route_ids: list[int] | None = None, target: str | None = None):
        """Stream one request's response: {"status", "headers", "replica"} then bytes."""
        from server.cluster.asgi_call import call

        lifecycle = self.app.state.lifecycle
        if lifecycle.loop is None:
            lifecycle.bind(asyncio.get_running_loop())
        first = True
        async for part in call(self.app, method, path, query,
                               [(bytes(k), bytes(v)) for k, v in headers], body):
            if first and isinstance(part, dict):
                part["replica"] = self.replica
                first = False
            yield part

    async def info(self, route_ids: list[int] | None = None, target: str | None = None) -> dict:
        import ray

        return {"replica": self.replica, "pid": os.getpid(), "state": self.runner.state,
                "actor_name": ray.get_runtime_context().get_actor_name()}

    async def metrics(self, route_ids: list[int] | None = None,
                      target: str | None = None) -> bytes:
        """The engine's metrics plus gguf_prefill_replica_process{pid, node} 1 (which process
        and node this replica is, for operators and tests)."""
        return self.app.state.metrics.render() + self._process_info

    @property
    def _process_info(self) -> bytes:
        import ray

        node = ray.util.get_node_ip_address()
        return (b"# HELP gguf_prefill_replica_process The process and node of this replica\n"
                b"# TYPE gguf_prefill_replica_process gauge\n"
                + f'gguf_prefill_replica_process{{node="{node}",pid="{os.getpid()}"}} 1.0\n'
                .encode())

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine stopped is replaced."""
        if self.runner.state not in ("ready", "draining") or not self.runner._thread.is_alive():
            raise RuntimeError(f"engine worker is {self.runner.state}")

    def __del__(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.stop(timeout=2.0)


def _error(status: int, message: str, type: str = "unavailable_error"):
    from starlette.responses import JSONResponse

    from server.errors import error_body

    return JSONResponse(error_body(status, message, type), status_code=status)


class Front:
    """The HTTP ingress. Every route but /metrics is answered by an engine replica chosen by
    the prefix-aware router; /metrics is the router's view plus each replica's metrics."""

    def __init__(self, engine, settings: dict[str, Any]):
        from server.cluster.front_metrics import FrontMetrics

        self.engine = engine
        self.settings = Settings(**settings)
        self.metrics = FrontMetrics()
        self._tokenizer = None
        self._tok_lock = threading.Lock()

    # ---- routing input
    def _tokenizer_for_routing(self):
        with self._tok_lock:
            if self._tokenizer is None:
                from engine.text.tokenizer import load_tokenizer

                self._tokenizer = load_tokenizer(self.settings.model)
            return self._tokenizer

    def route_ids(self, path: str, body: bytes) -> list[int] | None:
        """The prompt's token ids as the replica will see them (None: route by load). Any
        problem here is the replica's to report: routing just falls back to least loaded."""
        if path not in ("/v1/completions", "/v1/chat/completions", "/v1/prefill") or not body:
            return None
        try:
            req = json.loads(body)
            if path == "/v1/chat/completions":
                tok = self._tokenizer_for_routing()
                msgs = []
                for m in req["messages"]:
                    content = m.get("content")
                    if isinstance(content, list):
                        content = "".join(p.get("text", "") for p in content
                                          if isinstance(p, dict))
                    msgs.append({"role": m["role"], "content": content or ""})
                text = tok.render_chat(msgs, add_generation_prompt=True)
                return [int(t) for t in tok.encode(text, add_special=True, parse_special=True)]
            prompt = req.get("prompt")
            if isinstance(prompt, str):
                tok = self._tokenizer_for_routing()
                return [int(t) for t in tok.encode(prompt, add_special=True, parse_special=True)]
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
        except Exception:  # noqa: BLE001
            return None
        return None

    # ---- HTTP
    async def __call__(self, request):
        from starlette.responses import Response, StreamingResponse

        path = request.url.path
        if path == "/metrics" and request.method in ("GET", "HEAD"):
            body = await self.render_metrics()
            return Response(body, media_type=self.metrics.CONTENT_TYPE)
        body = await request.body()
        if len(body) > self.settings.max_body_bytes:
            return _error(413, f"request body is over {self.settings.max_body_bytes} bytes "
                               "(--max-body-bytes)", "invalid_request_error")
        ids = await asyncio.to_thread(self.route_ids, path, body) if body else None
        headers = [[k, v] for k, v in request.headers.raw]
        gen = self.engine.options(method_name="http", stream=True).remote(
            request.method, path, request.url.query.encode("latin-1"), headers, body,
            route_ids=ids)
        try:
            head = await asyncio.wait_for(gen.__anext__(), PART_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - replica died, unreachable or timed out
            gen.cancel()
            self.metrics.replica_failures.inc()
            return _error(503, f"engine replica failed: {_why(e)}; retry")
        out_headers = {k: v for k, v in head["headers"] if k.lower() not in _HOP_HEADERS}
        out_headers[REPLICA_HEADER] = head.get("replica", "")
        is_sse = out_headers.get("content-type", "").startswith("text/event-stream")
        if not is_sse:  # whole body first: a replica lost mid-way is then still a clean 503
            chunks = []
            try:
                while True:
                    chunks.append(await asyncio.wait_for(gen.__anext__(), PART_TIMEOUT_S))
            except StopAsyncIteration:
                pass
            except Exception as e:  # noqa: BLE001
                gen.cancel()
                self.metrics.replica_failures.inc()
                return _error(503, f"engine replica failed: {_why(e)}; retry")
            return Response(b"".join(chunks), status_code=head["status"], headers=out_headers)

        async def stream():
            try:
                while True:
                    try:
                        chunk = await asyncio.wait_for(gen.__anext__(), PART_TIMEOUT_S)
                    except StopAsyncIteration:
                        return
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:  # noqa: BLE001 - an SSE error event, then the end
                        from server.errors import error_body

                        self.metrics.replica_failures.inc()
                        err = error_body(503, f"engine replica failed: {_why(e)}",
                                         "unavailable_error")
                        yield b"data: " + json.dumps(err).encode() + b"\n\n"
                        return
                    yield chunk
            finally:
                gen.cancel()  # the client left: the replica's job is cancelled

        return StreamingResponse(stream(), status_code=head["status"], headers=out_headers)

    async def render_metrics(self) -> bytes:
        from server.cluster.ray_router import ROUTERS

        router = ROUTERS.get(ENGINE)
        if router is None:  # no request routed yet: one call makes the handle's router
            try:
                await asyncio.wait_for(self.engine.info.remote(), METRICS_TIMEOUT_S)
            except Exception:  # noqa: BLE001
                pass
            router = ROUTERS.get(ENGINE)
        texts: dict[str, str] = {}
        routed: dict = {}
        inflight: dict = {}
        cached: dict = {}
        if router is not None:
            rids = router.replica_ids()

            async def one(rid: str):
                try:
                    text = await asyncio.wait_for(
                        self.engine.metrics.remote(target=rid), METRICS_TIMEOUT_S)
                    texts[rid] = text.decode()
                except Exception as e:  # noqa: BLE001 - a replica going away: left out
                    log.warning("metrics of replica %s: %s", rid, type(e).__name__)

            # one at a time: calls made while handling one HTTP request share its internal
            # request id in Ray Serve's router, and concurrent ones with one id never resolve
            for rid in rids:
                await one(rid)
            for _ in range(3):  # the router's loop may be changing these dicts
                try:
                    p = router.prefix
                    routed = dict(p.routed)
                    inflight = {r: p.inflight(r) for r in p.replicas}
                    cached = {r: p.cached_blocks(r) for r in p.replicas}
                    break
                except RuntimeError:
                    continue
        self.metrics.update(routed, inflight, cached, texts)
        return self.metrics.render()


def _why(e: BaseException) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return f"no answer in {PART_TIMEOUT_S:g} s"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}" + (f" ({text[0][:200]})" if text else "")


def build(settings: Settings):
    """The application for `settings` (replicas, min/max replicas, device, parallel, ...)."""
    values = dataclasses.asdict(settings)
    engine_opts = replica_options(settings)
    engine = serve.deployment(EngineReplica, name=ENGINE, **engine_opts,
                              request_router_config=RequestRouterConfig(
                                  request_router_class=
                                  "server.cluster.ray_router.PrefixAffinityRequestRouter",
                                  request_router_kwargs={}))
    front = serve.deployment(Front, name=FRONT, num_replicas=1,
                             max_ongoing_requests=max(100, settings.max_connections),
                             ray_actor_options={"num_cpus": 0})
    return front.bind(engine.bind(values), values)


def app_builder(args: dict[str, str]):
    """`serve run server.cluster.deployments:app_builder key=value ...`: keys are Settings
    fields (model, device, replicas, min_replicas, max_replicas, parallel, ...); every other
    setting comes from GGUF_PREFILL_* variables as for `gguf-prefill serve`."""
    from server.main import _settings
    from server.runner import resolve_model_path

    settings = _settings(None, {k: _typed(k, v) for k, v in args.items()})
    if settings.replicas < 1:
        settings = settings.with_(replicas=1)
    return build(settings.with_(model=resolve_model_path(settings.model)))


def _typed(name: str, value: str) -> Any:
    from server.settings import _convert

    return _convert(name, value, name)
