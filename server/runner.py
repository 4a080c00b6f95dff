"""The engine worker: ONE thread loads the model and then runs the continuous-batching
scheduler (engine.scheduler): every step is one forward over the next token of each running
generation and chunks of prompts being prefilled. The HTTP side (asyncio) submits jobs to a
bounded FIFO queue and reads their events.

- Jobs wait in the queue until a KV slot is free (--parallel slots); a full queue raises
  APIError(429) at submit time, before any response has started.
- Cancellation: `job.cancel()` (client disconnected, server shutting down) is checked between
  steps; the sequence leaves the batch and its slot is free for the next job.
- Per-job text, stop strings and logprobs: server/generation.py.
- Prefill probes (/v1/prefill) and prompt scoring (echo + logprobs) run whole, between steps.
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
from server.generation import TextAssembler  # noqa: F401 - re-exported (tests, embedders)
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
    batch: Any = None          # the batched-step backend (model.batch); attach_batch makes it

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


def attach_batch(engine: Engine, settings: Settings) -> None:
    """The shared KV cache: --parallel slots of --kv-cache-tokens / parallel positions each
    (default: n_ctx each; on the GPU, shrunk to what free memory holds unless the flag is
    given). A request's context (n_ctx) is then at most one slot."""
    from engine.errors import UsageError

    n = settings.parallel
    total = settings.kv_cache_tokens or n * engine.n_ctx
    cap = min(engine.n_ctx, total // n)
    if cap < 1:
        raise UsageError(f"serve: --kv-cache-tokens {total} is fewer than one token per slot "
                         f"(--parallel {n})")
    engine.batch = engine.model.batch(n, cap, fit_memory=not settings.kv_cache_tokens)
    if engine.batch.slot_capacity < engine.n_ctx:
        log.info("n_ctx %d -> %d: %d slots of %d tokens", engine.n_ctx, engine.batch.slot_capacity,
                 n, engine.batch.slot_capacity)
    engine.n_ctx = min(engine.n_ctx, engine.batch.slot_capacity)


def warm_up_batch(batch, max_tokens: int = 128) -> None:
    """Load the batched step's kernels and record its CUDA graphs now (while /health says 503),
    so no request pays for them: one step of each power-of-two size up to max_tokens in slot 0
    (its contents are forgotten: the scheduler made later starts with every slot empty)."""
    from engine.scheduler import BatchEntry

    t = 1
    while t <= min(max_tokens, batch.slot_capacity):
        batch.run([BatchEntry(0, [0] * t, 0, "argmax")])
        t *= 2


def load_engine(settings: Settings) -> Engine:
    from engine.loader import load_model
    from engine.text.tokenizer import load_tokenizer

    path = resolve_model_path(settings.model)
    t0 = time.perf_counter()
    model = load_model(path, device=settings.device)
    tokenizer = load_tokenizer(path)
    n_ctx_train = int(model.config.n_ctx_train)
    n_ctx = settings.ctx_size or n_ctx_train
    if n_ctx_train and n_ctx > n_ctx_train:
        log.warning("ctx-size %d is over the model's training context %d", n_ctx, n_ctx_train)
    engine = Engine(model=model, tokenizer=tokenizer, n_ctx=n_ctx,
                    model_id=os.path.basename(path), n_ctx_train=n_ctx_train)
    attach_batch(engine, settings)
    if getattr(model, "device", "cpu") != "cpu":
        # the kernels and graphs every request runs, now (while /health says 503), so the first
        # request's timings are real
        from engine.gpu.prefill_graph import GRAPH_MAX_TOKENS

        warm_up_batch(engine.batch, min(GRAPH_MAX_TOKENS, settings.max_batch_tokens))
    log.info("loaded %s (%s backend) in %.2f s, n_ctx %d, %d slots", path, type(model).__name__,
             time.perf_counter() - t0, engine.n_ctx, settings.parallel)
    return engine


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
        self.scheduler = None      # engine.scheduler.Scheduler, made by the worker thread
        self._t_step: float | None = None    # when the latest step was observed (busy runs only)
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
        from engine.scheduler import Scheduler

        if self.engine.batch is None:
            attach_batch(self.engine, self.settings)
        sched = self.scheduler = Scheduler(self.engine.batch, self.settings.max_batch_tokens)
        while not self._stop.is_set():
            self._intake(sched)
            if not sched.busy:
                continue
            try:
                stats = sched.step()
            except BaseException:  # noqa: BLE001 - the step's sequences got an error event
                log.exception("engine step failed")
                continue
            self._observe(sched, stats)
        sched.cancel_all()
        sched.step()               # every sequence left ends "cancelled"
        self._observe(sched, None)

    def _intake(self, sched) -> None:
        """Move queued jobs into the scheduler while it has free slots (the rest wait in the
        bounded queue, where 429 applies); block briefly only when the engine is idle.
        Prefill probes and prompt scoring (echo + logprobs) run here, between steps."""
        from server.generation import GenerationJob

        block = not sched.busy
        while sched.free_slots > 0 and not self._stop.is_set():
            try:
                job = self._queue.get(timeout=0.1) if block else self._queue.get_nowait()
            except queue.Empty:
                break
            block = False
            self.metrics.queue_depth.set(self._queue.qsize() + len(sched.waiting))
            if job.cancelled.is_set():
                self._finish_cancelled(job)
                continue
            try:
                if job.kind == "prefill":
                    self._run_prefill(job)
                    job.finished = True
                    continue
                score_s = self._score_prompt(job) if job.prompt_logprobs is not None else 0.0
                if job.max_tokens == 0:          # prompt scoring only (echo)
                    self._emit_scored(job, score_s)
                    continue
                sched.add(GenerationJob(job, self.engine, self.metrics, self._stop.is_set).seq)
            except BaseException as e:  # noqa: BLE001 - one failed job must not kill the worker
                log.exception("job failed")
                job.finished = True
                job.emit("error", APIError(500, f"engine error: {type(e).__name__}: {e}"))

    def _observe(self, sched, stats) -> None:
        m = self.metrics
        m.requests_processing.set(len(sched.running))
        m.queue_depth.set(self._queue.qsize() + len(sched.waiting))
        held = sum(s.n_fed for s in sched.running)
        b = sched.backend
        m.kv_cache_usage.set(held / max(1, b.n_slots * b.slot_capacity))
        m.set_prefix(sched.prefix_hits, sched.prefix_tokens)
        if stats is not None and stats.tokens:
            m.batch_tokens.observe(stats.tokens)
            m.batch_sequences.observe(stats.sequences)
            m.step_seconds.labels("wall").observe(stats.seconds)
            if stats.device_seconds is not None:
                m.step_seconds.labels("device").observe(stats.device_seconds)
            now = time.perf_counter()
            if self._t_step is not None:
                m.step_seconds.labels("interval").observe(now - self._t_step)
            self._t_step = now
        else:
            self._t_step = None

    def slots(self) -> dict:
        """The /slots view: every KV slot, what it runs and what it holds."""
        sched = self.scheduler
        if sched is None:
            return {"n_slots": 0, "slot_capacity": 0, "slots": []}
        for _ in range(3):                 # the worker may change the lists under us: retry
            try:
                view = sched.slot_view()
                break
            except (RuntimeError, KeyError, IndexError):
                continue
        else:
            view = []
        return {"n_slots": sched.backend.n_slots, "slot_capacity": sched.backend.slot_capacity,
                "max_batch_tokens": sched.max_batch_tokens, "waiting": len(sched.waiting),
                "prefix_cache_hits": sched.prefix_hits, "slots": view}

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

    def _emit_scored(self, job: Job, score_s: float) -> None:
        """The "done" of an echo request with nothing to generate (max_tokens 0)."""
        from engine.generate import Generation

        res = Generation(list(job.prompt_ids))
        res.prompt_ms = score_s * 1e3
        wants_lps = getattr(job.sampler, "top_logprobs", None) is not None
        job.finished = True
        job.emit("done", {"finish_reason": "length", "tokens": [], "timings": res.timings,
                          "prompt_n": len(job.prompt_ids), "cached_tokens": 0,
                          "logprobs": [] if wants_lps else None})


def synthetic_ids(n: int, vocab_size: int, seed: int = 0) -> list[int]:
    """Deterministic pseudo-random token ids for the prefill probe."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, vocab_size, size=n)]
