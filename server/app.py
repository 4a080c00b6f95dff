"""FastAPI routes. All engine work goes through the Runner (one worker thread running the
continuous-batching scheduler, bounded queue).

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/prefill, GET /v1/models,
GET /health, GET /metrics, GET /slots, POST /tokenize, POST /detokenize.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from server.errors import APIError, AuthMiddleware, BodyGuardMiddleware, error_body, install_error_handlers
from server.metrics import Metrics
from server.middleware import HeadMiddleware, Lifecycle, OutcomeMiddleware
from server.runner import Engine, Job, Runner, new_job, synthetic_ids
from server.openai_api import (CompletionLogprobs, chat_logprobs, check_model, max_new_tokens,
                               merge_blocks, model_not_found, plan_generation, refuse)
from server.schemas import (ChatRequest, CompletionRequest, DetokenizeRequest, PrefillRequest,
                            TokenizeRequest, timings_dict, usage_dict)
from server.settings import Settings

log = logging.getLogger("server")

KNOWN_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/prefill", "/v1/models",
                "/health", "/metrics", "/slots", "/tokenize", "/detokenize")


def endpoint_label(path: str) -> str:
    """The /metrics `endpoint` label: the route, '/v1/models/{id}', or 'other' (bounded)."""
    if path in KNOWN_ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return "other"


# CPU-heavy text work (tokenize, detokenize, pieces, chat templates) runs in threads, at most
# this many at once, so big inputs never stall the event loop (/health) nor take every thread.
TEXT_THREADS = 4
_text_limiter: anyio.CapacityLimiter | None = None


async def text_work(fn: Callable[..., Any], *args: Any) -> Any:
    global _text_limiter
    if _text_limiter is None:
        _text_limiter = anyio.CapacityLimiter(TEXT_THREADS)
    return await anyio.to_thread.run_sync(fn, *args, limiter=_text_limiter)


def create_app(settings: Settings | None = None, engine: Engine | None = None,
               loader: Callable[[Settings], Engine] | None = None) -> FastAPI:
    """`engine`: an already-loaded Engine (tests, embedding); otherwise the worker thread loads
    one with `loader` (default server.runner.load_engine) while /health answers 503."""
    settings = settings or Settings.from_env()
    metrics = Metrics()
    runner = Runner(settings, metrics, engine=engine, loader=loader)
    lifecycle = Lifecycle()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        lifecycle.bind(asyncio.get_running_loop())
        runner.start()  # a no-op when `serve` started it to load the model before listening
        try:
            yield
        finally:
            runner.stop(timeout=5.0)

    app = FastAPI(title="gguf-prefill", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.runner = runner
    app.state.lifecycle = lifecycle
    install_error_handlers(app)

    def ready_engine() -> Engine:
        if not runner.ready:
            raise runner.unavailable()
        return runner.engine  # type: ignore[return-value]

    # ---- health / models / metrics -----------------------------------------------------------
    @app.get("/health")
    async def health():
        if not runner.ready:
            err = runner.unavailable()
            return JSONResponse(err.body(), status_code=503)
        return {"status": "ok"}

    def model_card(eng: Engine) -> dict[str, Any]:
        cfg = eng.model.config
        return {"id": eng.model_id, "object": "model", "created": 0, "owned_by": "gguf-prefill",
                "aliases": list(eng.names()[1:]),
                "meta": {"n_ctx": eng.n_ctx, "n_ctx_train": eng.n_ctx_train,
                         "n_vocab": eng.vocab_size, "arch": getattr(cfg, "arch", None),
                         "n_layers": getattr(cfg, "n_layers", None),
                         "backend": type(eng.model).__name__,
                         "device": getattr(eng.model, "device", None)}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(ready_engine())]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str):
        eng = ready_engine()
        if model_id not in eng.names():
            raise model_not_found(model_id, eng)
        return model_card(eng)

    @app.get("/slots")
    async def slots():
        """What each KV slot runs and holds (llama-server's /slots, in this engine's terms)."""
        ready_engine()
        return runner.slots()

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type=Metrics.CONTENT_TYPE)

    # ---- tokenizer ---------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        eng = ready_engine()

        def work() -> bytes:  # encoding, pieces and the JSON of a big answer: all off the loop
            ids = eng.encode(req.content, req.add_special, req.parse_special)
            if req.with_pieces:
                body: Any = {"tokens": [{"id": t, "piece": eng.decode([t])} for t in ids]}
            else:
                body = {"tokens": ids}
            return json.dumps(body, ensure_ascii=False).encode()

        return Response(await text_work(work), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        eng = ready_engine()
        check_ids(eng, req.tokens, "tokens")
        text = await text_work(eng.decode, req.tokens)
        return Response(json.dumps({"content": text}, ensure_ascii=False).encode(),
                        media_type="application/json")

    # ---- prefill probe -----------------------------------------------------------------------
    @app.post("/v1/prefill")
    async def prefill(req: PrefillRequest, request: Request):
        eng = ready_engine()
        if req.n_tokens is not None:
            if req.n_tokens > eng.n_ctx:
                raise exceed_context(req.n_tokens, 0, eng.n_ctx, "n_tokens")
            ids = synthetic_ids(req.n_tokens, eng.vocab_size, req.seed)
        else:
            ids = await prompt_ids(eng, req.prompt)
            if len(ids) > eng.n_ctx:
                raise exceed_context(len(ids), 0, eng.n_ctx, "prompt")
        job = runner.submit(new_job("prefill", ids))
        result = await await_job(job, request)
        return {"object": "prefill", "model": eng.model_id, "n_tokens": result["prompt_n"],
                "timings": timings_dict(result["prompt_n"], result["prompt_ms"], 0, 0.0)}

    # ---- completions -------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        eng = ready_engine()
        refuse(req)
        check_model(eng, req)
        ids = await prompt_ids(eng, req.prompt)
        return await run_generation(eng, req, ids, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        eng = ready_engine()
        refuse(req)
        check_model(eng, req)
        # `name` (a participant's name) goes to the template with the message, as OpenAI's
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        ids = await run_in_threadpool(eng.encode_chat, messages)
        return await run_generation(eng, req, ids, request, chat=True)

    # ---- helpers -----------------------------------------------------------------------------
    async def run_generation(eng: Engine, req, ids: list[int], request: Request, chat: bool):
        n_prompt = len(ids)
        max_tokens = max_new_tokens(req, chat, n_prompt, eng.n_ctx)
        if n_prompt + max_tokens > eng.n_ctx:
            raise exceed_context(n_prompt, max_tokens, eng.n_ctx, "prompt")
        plan = await plan_generation(eng, req, ids, chat, max_tokens)
        job = runner.submit(new_job("generate", ids, max_tokens=max_tokens, sampler=plan.sampler,
                                    stops=req.stop_list(), ignore_eos=req.ignore_eos,
                                    prompt_logprobs=plan.prompt_logprobs))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            return StreamingResponse(stream_events(job, rid, created, eng, chat, req, plan),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        parts: list[str] = []
        prompt_lps: list[Any] = []

        async def collect():
            while True:
                kind, payload = await job.next_event()
                if kind == "text":
                    parts.append(payload[0])
                elif kind == "prompt":
                    prompt_lps[:] = payload
                elif kind == "error":
                    raise payload
                else:
                    return payload

        done = await with_disconnect_cancel(job, request, collect())
        text = "".join(parts)
        choice: dict[str, Any] = {"index": 0, "finish_reason": done["finish_reason"]}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = (chat_logprobs(eng.token_bytes, done["logprobs"])
                                  if plan.top_logprobs is not None else None)
        else:
            lp = None
            if plan.top_logprobs is not None:
                fmt = CompletionLogprobs(eng.token_bytes)
                if plan.prompt_logprobs is not None:
                    lp = fmt.block(prompt_lps[plan.echo_skip:], ids[plan.echo_skip:])
                fmt.restart(len(plan.echo or ""))
                lp = merge_blocks(lp, fmt.block(done["logprobs"]))
            choice["text"] = (plan.echo or "") + text
            choice["logprobs"] = lp
        if req.return_tokens:
            choice["tokens"] = done["tokens"]
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": eng.model_id, "system_fingerprint": fingerprint(eng),
                "choices": [choice], "usage": usage_dict(n_prompt, len(done["tokens"]), done.get("cached_tokens", 0)),
                "timings": done["timings"]}

    async def stream_events(job: Job, rid: str, created: int, eng: Engine, chat: bool,
                            req, plan) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        model_id = eng.model_id
        fmt = CompletionLogprobs(eng.token_bytes, len(plan.echo or ""))
        want_lp = plan.top_logprobs is not None

        def chunk(delta: str | None, finish: str | None, lps=None, **extra: Any) -> bytes:
            if chat:
                d: dict[str, Any] = {} if delta is None else {"content": delta}
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
                if want_lp and lps:
                    choice["logprobs"] = chat_logprobs(eng.token_bytes, lps)
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None,
                          "finish_reason": finish}
                if want_lp and lps is not None:
                    choice["logprobs"] = fmt.block(lps)
            body = {"id": rid, "object": obj, "created": created, "model": model_id,
                    "system_fingerprint": fingerprint(eng), "choices": [choice], **extra}
            if plan.include_usage:
                body.setdefault("usage", None)
            return sse(body)

        try:
            if chat:
                first = {"id": rid, "object": obj, "created": created, "model": model_id,
                         "system_fingerprint": fingerprint(eng),
                         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
                if plan.include_usage:
                    first["usage"] = None
                yield sse(first)
            elif plan.echo is not None and plan.prompt_logprobs is None:
                yield chunk(plan.echo, None)
            while True:
                kind, payload = await job.next_event()
                if kind == "text":
                    yield chunk(payload[0], None, payload[1])
                elif kind == "prompt":  # echo + logprobs: the prompt text and its scores
                    echo = chunk(plan.echo, None)
                    if not chat:
                        prompt = CompletionLogprobs(eng.token_bytes)
                        body = json.loads(echo[len(b"data: "):])
                        body["choices"][0]["logprobs"] = prompt.block(
                            payload[plan.echo_skip:], job.prompt_ids[plan.echo_skip:])
                        echo = sse(body)
                    yield echo
                elif kind == "error":
                    yield b"data: " + json.dumps(payload.body()).encode() + b"\n\n"
                    return
                else:
                    usage = usage_dict(len(job.prompt_ids), len(payload["tokens"]),
                                       payload.get("cached_tokens", 0))
                    extra: dict[str, Any] = {"timings": payload["timings"]}
                    if not plan.include_usage:
                        extra["usage"] = usage  # llama-server style, on the finish chunk
                    if req.return_tokens:
                        extra["tokens"] = payload["tokens"]
                    yield chunk(None, payload["finish_reason"], **extra)
                    if plan.include_usage:
                        yield sse({"id": rid, "object": obj, "created": created, "model": model_id,
                                   "system_fingerprint": fingerprint(eng), "choices": [],
                                   "usage": usage, "timings": payload["timings"]})
                    yield b"data: [DONE]\n\n"
                    return
        finally:
            if not job.finished:
                job.cancel()  # client went away (or the server is cancelling us)

    async def await_job(job: Job, request: Request) -> dict[str, Any]:
        async def result():
            while True:
                kind, payload = await job.next_event()
                if kind == "error":
                    raise payload
                if kind == "done":
                    return payload

        return await with_disconnect_cancel(job, request, result())

    async def with_disconnect_cancel(job: Job, request: Request, coro):
        """Await `coro`; if the client disconnects first, cancel the job."""
        work = asyncio.ensure_future(coro)

        async def watch():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            job.cancel()
            work.cancel()
            raise
        finally:
            watcher.cancel()
        if not work.done():
            job.cancel()
            work.cancel()
            raise APIError(499, "client disconnected", type="cancelled")
        return work.result()

    # outermost last: outcome counting (and crash / shutdown-deadline answers), HEAD, auth,
    # then the body guard (413/408/400 before FastAPI parses anything)
    app.add_middleware(BodyGuardMiddleware, limit=settings.max_body_bytes,
                       max_chars=settings.max_input_chars, timeout=settings.body_timeout)
    app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    app.add_middleware(HeadMiddleware)
    app.add_middleware(OutcomeMiddleware, metrics=metrics, lifecycle=lifecycle,
                       label=endpoint_label)
    return app


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


def fingerprint(eng: Engine) -> str:
    return f"gguf-prefill-{type(eng.model).__name__}-{getattr(eng.model, 'device', 'cpu')}"


async def prompt_ids(eng: Engine, prompt) -> list[int]:
    if isinstance(prompt, str):
        ids = await run_in_threadpool(eng.encode, prompt)
        if not ids:
            raise APIError(400, "prompt: encodes to zero tokens")
        return ids
    ids = [int(t) for t in prompt]
    check_ids(eng, ids, "prompt")
    return ids


def check_ids(eng: Engine, ids: list[int], field: str) -> None:
    bad = [t for t in ids if not 0 <= t < eng.vocab_size]
    if bad:
        raise APIError(400, f"{field}: token id {bad[0]} is out of range for the vocabulary "
                            f"(0..{eng.vocab_size - 1})")


def exceed_context(n_prompt: int, max_tokens: int, n_ctx: int, field: str) -> APIError:
    if max_tokens:
        msg = (f"the request exceeds the available context size: {field} ({n_prompt} tokens) + "
               f"max_tokens ({max_tokens}) = {n_prompt + max_tokens} > n_ctx ({n_ctx})")
    else:
        msg = (f"the request exceeds the available context size: {field} ({n_prompt} tokens) "
               f"> n_ctx ({n_ctx})")
    return APIError(400, msg, type="exceed_context_size_error", n_prompt_tokens=n_prompt,
                    n_ctx=n_ctx)
