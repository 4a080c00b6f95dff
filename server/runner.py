"""The engine worker: ONE thread loads the model and then runs every job, one at a time, from a
bounded FIFO queue. The HTTP side (asyncio) submits jobs and reads their events.

- A full queue raises APIError(429) at submit time, before any response has started.
- Cancellation: `job.cancel()` (client disconnected, server shutting down) is checked between
  tokens; the engine's step iterator is simply closed.
- Text leaves the worker only as complete UTF-8 characters (bytes from token_to_bytes go
  through an incremental decoder), and text that might be the start of a `stop` string is held
  back until it is known not to be.
- Greedy (no sampler) is exactly engine.generate's loop; the worker only consumes its steps.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from server.errors import APIError
from server.metrics import Metrics
from server.settings import Settings

log = logging.getLogger("server")


# ---- the loaded engine -----------------------------------------------------------------------

@dataclass
class Engine:
    """What the server needs from the engine: a Backend, its tokenizer, a context size."""
    model: Any
    tokenizer: Any
    n_ctx: int
    model_id: str
    n_ctx_train: int = 0

    def names(self) -> tuple[str, ...]:
        """What a request's `model` may say: the served id (the file name) or its stem."""
        stem = self.model_id[:-5] if self.model_id.endswith(".gguf") else self.model_id
        return (self.model_id, stem) if stem and stem != self.model_id else (self.model_id,)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def eog_ids(self) -> set[int]:
        return set(int(t) for t in (getattr(self.tokenizer, "eog_ids", None) or ()))

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special=add_special,
                                                      parse_special=parse_special)]

    def token_bytes(self, token: int) -> bytes:
        fn = getattr(self.tokenizer, "token_to_bytes", None)
        if fn is not None:
            return bytes(fn(int(token)))
        return self.tokenizer.decode([int(token)]).encode("utf-8")

    def decode(self, ids: Sequence[int]) -> str:
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        return "".join(dec.decode(self.token_bytes(t)) for t in ids) + dec.decode(b"", final=True)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The model's chat template over `messages` (engine.text.tokenizer.render_chat); a missing,
        broken or refusing template is the request's 400, with the reason."""
        from engine.errors import GGUFError

        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"messages: model {self.model_id} has no chat template "
                                "(tokenizer.chat_template); use /v1/completions")
        try:
            return self.tokenizer.render_chat(messages, add_generation_prompt=True)
        except (GGUFError, ValueError) as e:
            raise APIError(400, f"messages: cannot apply the chat template: {e}") from None

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.encode(self.chat_prompt(messages), add_special=True, parse_special=True)
        bos = getattr(self.tokenizer, "bos_id", None)
        if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
            ids = ids[1:]  # template already wrote the BOS text; don't double it
        return ids


def resolve_model_path(model: str | None) -> str:
    """--model, or the cached default model (engine.tools.fetch.resolve_model: never downloads)."""
    from engine.tools.fetch import resolve_model

    return resolve_model(model)


def open_model_file(path: str) -> None:
    """Validate the container synchronously (fast): a bad file fails `serve` at once."""
    from engine.formats.gguf_file import open_gguf

    open_gguf(path)


def load_engine(settings: Settings) -> Engine:
    from engine.loader import load_model
    from engine.text.tokenizer import load_tokenizer

    path = resolve_model_path(settings.model)
    t0 = time.perf_counter()
    model = load_model(path, device=settings.device)
    tokenizer = load_tokenizer(path)
    n_ctx_train = int(model.config.n_ctx_train)
    n_ctx = settings.ctx_size or n_ctx_train
    if getattr(model, "device", "cpu") != "cpu":
        # compile/load the kernels now (while /health says 503), for both the prefill and the
        # decode (session + graph) paths, so the first request's timings are real
        from engine.generate import warm_up

        warm_up(model, min(64, n_ctx))
    if n_ctx_train and n_ctx > n_ctx_train:
        log.warning("ctx-size %d is over the model's training context %d", n_ctx, n_ctx_train)
    log.info("loaded %s (%s backend) in %.2f s, n_ctx %d", path, type(model).__name__,
             time.perf_counter() - t0, n_ctx)
    return Engine(model=model, tokenizer=tokenizer, n_ctx=n_ctx,
                  model_id=os.path.basename(path), n_ctx_train=n_ctx_train)


# ---- text assembly (UTF-8 + stop strings) ----------------------------------------------------

class TextAssembler:
    def __init__(self, token_bytes: Callable[[int], bytes], stops: Sequence[str] = ()):
        self._token_bytes = token_bytes
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.stops = [s for s in stops if s]
        self._maxstop = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, token: int) -> str:
        return self._advance(self._dec.decode(self._token_bytes(token)), final=False)

    def finish(self) -> str:
        return self._advance(self._dec.decode(b"", final=True), final=True)

    def _advance(self, piece: str, final: bool) -> str:
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self._maxstop + 1)
        self.text += piece
        release = len(self.text)
        if self.stops:
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                cut = min(hits)
                self.text = self.text[:cut]
                self.stopped = True
                release = cut
            elif not final:
                release -= self._held_suffix()
        release = max(release, self.sent)
        out = self.text[self.sent:release]
        self.sent = release
        return out

    def _held_suffix(self) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        t = self.text
        for n in range(min(self._maxstop - 1, len(t)), 0, -1):
            tail = t[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


# ---- jobs ------------------------------------------------------------------------------------

@dataclass
class Job:
    kind: str  # "generate" | "prefill"
    prompt_ids: list[int]
    max_tokens: int = 0
    sampler: Any = None  # None: greedy; a Sampler or a sampling.TokenChooser
    stops: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    prompt_logprobs: int | None = None  # echo + logprobs: score the prompt, top-k per position
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    finished: bool = False

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, kind: str, payload: Any) -> None:
        if self.loop is None or self.events is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # event loop closed: nobody is listening any more
            self.cancel()

    async def next_event(self) -> tuple[str, Any]:
        assert self.events is not None
        return await self.events.get()


def new_job(kind: str, prompt_ids: list[int], **params: Any) -> Job:
    loop = asyncio.get_running_loop()
    return Job(kind=kind, prompt_ids=prompt_ids, loop=loop, events=asyncio.Queue(), **params)


# ---- the worker ------------------------------------------------------------------------------

class Runner:
    def __init__(self, settings: Settings, metrics: Metrics, engine: Engine | None = None,
                 loader: Callable[[Settings], Engine] | None = None):
        self.settings = settings
        self.metrics = metrics
        self.engine = engine
        self.loader = loader or load_engine
        self.state = "ready" if engine is not None else "loading"
        self.load_error: BaseException | None = None
        self.on_load_failed: Callable[[BaseException], None] | None = None
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=settings.max_queue)
        self._stop = threading.Event()
        self._current: Job | None = None
        self._thread = threading.Thread(target=self._main, name="engine-worker", daemon=True)
        if engine is not None:
            metrics.model_loaded.set(1)

    # -- lifecycle
    def start(self) -> None:
        if self._thread.ident is None:  # idempotent: serve starts it before uvicorn's lifespan
            self._thread.start()

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def begin_drain(self) -> None:
        if self.state in ("ready", "loading"):
            self.state = "draining"

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel whatever is left and wait (bounded) for the worker to exit."""
        if self.state != "failed":
            self.state = "stopped"
        self._stop.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            self._finish_cancelled(job)
        cur = self._current
        if cur is not None:
            cur.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- submission (event-loop side)
    def submit(self, job: Job) -> Job:
        if self.state != "ready":
            raise self.unavailable()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise APIError(429, f"server busy: {self.settings.max_queue} requests already "
                                "waiting; retry later") from None
        self.metrics.queue_depth.set(self._queue.qsize())
        return job

    def unavailable(self) -> APIError:
        if self.state == "loading":
            return APIError(503, "Loading model")
        if self.state == "failed":
            return APIError(503, f"model failed to load: {self.load_error}")
        return APIError(503, "server is shutting down")

    # -- worker thread
    def _main(self) -> None:
        if self.engine is None:
            try:
                self.engine = self.loader(self.settings)
            except BaseException as e:  # noqa: BLE001 - reported, then the server exits
                log.error("model failed to load: %s", e)
                self.load_error = e
                self.state = "failed"
                if self.on_load_failed is not None:
                    self.on_load_failed(e)
                return
            if self.state == "loading":
                self.state = "ready"
            self.metrics.model_loaded.set(1)
        while not self._stop.is_set():
            try:
                job = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            self.metrics.queue_depth.set(self._queue.qsize())
            if job.cancelled.is_set() or self._stop.is_set():
                self._finish_cancelled(job)
                continue
            self._current = job
            self.metrics.requests_processing.set(1)
            try:
                if job.kind == "prefill":
                    self._run_prefill(job)
                else:
                    self._run_generate(job)
            except BaseException as e:  # noqa: BLE001 - one failed job must not kill the worker
                log.exception("job failed")
                job.emit("error", APIError(500, f"engine error: {type(e).__name__}: {e}"))
            finally:
                job.finished = True
                self._current = None
                self.metrics.requests_processing.set(0)

    def _finish_cancelled(self, job: Job) -> None:
        self.metrics.cancelled.inc()
        job.finished = True
        job.emit("error", APIError(503, "request cancelled"))

    def _run_prefill(self, job: Job) -> None:
        model = self.engine.model
        n = len(job.prompt_ids)
        cache = model.new_cache(n)
        t0 = time.perf_counter()
        model.forward(job.prompt_ids, cache)
        dt = time.perf_counter() - t0
        self.metrics.observe_prefill(n, dt)
        job.emit("done", {"prompt_n": n, "prompt_ms": dt * 1e3})

    def _score_prompt(self, job: Job) -> float:
        """echo + logprobs: one prefill with the logits of every position; position i scores
        prompt token i + 1 (the first token has no logprob)."""
        from server.sampling import TokenLogprob, log_softmax, top_entries

        model = self.engine.model
        ids = job.prompt_ids
        t0 = time.perf_counter()
        rows = model.forward(ids, model.new_cache(len(ids)), all_logits=True)
        dt = time.perf_counter() - t0
        self.metrics.observe_prefill(len(ids), dt)
        k = int(job.prompt_logprobs or 0)
        out: list[TokenLogprob | None] = [None]
        for i in range(1, len(ids)):
            lp = log_softmax(rows[i - 1])
            out.append(TokenLogprob(int(ids[i]), float(lp[ids[i]]), top_entries(lp, k)))
        job.emit("prompt", out)
        return dt

    def _run_generate(self, job: Job) -> None:
        from engine.generate import Generation, generate_steps
        from server.sampling import TokenChooser

        eng = self.engine
        score_s = self._score_prompt(job) if job.prompt_logprobs is not None else 0.0
        eog = set() if job.ignore_eos else eng.eog_ids()
        res = Generation(list(job.prompt_ids))
        text = TextAssembler(eng.token_bytes, job.stops)
        chooser = job.sampler if isinstance(job.sampler, TokenChooser) else None
        records = chooser.records if chooser is not None and chooser.top_logprobs is not None else None
        tokens: list[int] = []
        pending = 0  # tokens whose logprobs have not gone out with a text event yet
        finish: str | None = None
        prefill_seen = False

        def emit_text(delta: str) -> None:
            nonlocal pending
            lps = None
            if records is not None:
                lps = records[len(tokens) - pending:len(tokens)]
            pending = 0
            job.emit("text", (delta, lps))

        if job.max_tokens == 0:  # prompt scoring only (echo)
            res.stop_reason = "length"
            res.prompt_ms = score_s * 1e3
            prefill_seen = True  # counted by _score_prompt
            steps = iter(())
        else:
            steps = generate_steps(eng.model, job.prompt_ids, job.max_tokens, eog, job.sampler, res)
        try:
            for step in steps:
                if not prefill_seen:
                    prefill_seen = True
                    self.metrics.observe_prefill(len(job.prompt_ids), res.prompt_ms / 1e3)
                    self.metrics.time_to_first_token.observe(time.perf_counter() - job.submitted)
                self.metrics.generated_tokens.inc()
                tokens.append(int(step.token))
                pending += 1
                delta = text.push(int(step.token))
                if delta:
                    emit_text(delta)
                if text.stopped:
                    finish = "stop"
                    break
                if chooser is not None and chooser.stopped:
                    finish = "stop"  # the structured output is complete
                    break
                if job.cancelled.is_set() or self._stop.is_set():
                    finish = "cancelled"
                    break
        finally:
            close = getattr(steps, "close", None)
            if close is not None:
                close()
        if not prefill_seen and res.prompt_ms > 0:
            self.metrics.observe_prefill(len(job.prompt_ids), res.prompt_ms / 1e3)
        if finish == "cancelled":
            self.metrics.cancelled.inc()
        if finish is None:
            finish = "stop" if res.stop_reason == "eog" else "length"
        if chooser is not None and chooser.error:
            log.warning("structured output ended early: %s", chooser.error)
        tail = text.finish()
        if tail or pending:
            emit_text(tail)
        timings = res.timings
        timings["predicted_n"] = len(tokens)
        job.emit("done", {"finish_reason": finish, "tokens": tokens, "timings": timings,
                          "prompt_n": len(job.prompt_ids),
                          "logprobs": records[:len(tokens)] if records is not None else None})


def synthetic_ids(n: int, vocab_size: int, seed: int = 0) -> list[int]:
    """Deterministic pseudo-random token ids for the prefill probe."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, vocab_size, size=n)]
