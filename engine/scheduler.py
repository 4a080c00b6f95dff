"""Continuous batching: many generations share one backend, one forward per step.

Each step runs ONE forward over a token batch that mixes the next token of every decoding
sequence with chunks of prompts still being prefilled (chunked prefill under a per-step token
budget, so a long prompt never stalls the decoders for its whole prefill). Sequences join and
leave between steps. The backend (the BatchBackend contract below) holds the KV cache of every
sequence in fixed slots; a sequence holds one slot from admission to its end.

    sched = Scheduler(backend, max_batch_tokens=512)
    sched.add(seq)            # a Sequence; it waits until a slot is free
    while sched.busy:
        sched.step()          # one forward; every sequence's callbacks run between steps

BatchBackend (engine.reference.batch.ReferenceBatch, engine.gpu.batch.GPUBatch):
    n_slots, slot_capacity           slots and positions per slot
    launch(entries) -> handle        enqueue one forward (the GPU returns at once); entry: .slot,
                                     .ids (tokens to append at positions .start..), .want (None
                                     | "argmax" | "logits"). ids == [FOLLOW]: the token the
                                     backend chose by argmax for that slot in the step launched
                                     before (the host may not have it yet)
    collect(handle) -> list          wait for it; per entry None, (id, top logit, margin) or
                                     float32 [vocab] logits
    run(entries) -> list             collect(launch(entries))
    copy_prefix(src, dst, n)         positions 0..n-1 of slot src into slot dst
    last_device_seconds (optional)   the device time of the latest collected step

Overlap (as SGLang's overlap scheduler): while every running sequence is greedy, step() plans
and launches step N+1 before it collects step N, so the host's work (planning, delivery,
callbacks) runs while the device computes. A decoder whose token is still in flight is fed by
FOLLOW; one that turns out to have ended (end-of-generation, a stop string, cancelled) has its
extra token computed and dropped, its slot released as usual (the K/V written past its cached
tokens is never claimed). A sequence that needs logits on the host (a sampler, logprobs) makes
the scheduler collect before it plans, as without overlap.

Prefix reuse (llama-server's slot prompt cache, plus copies between slots): every slot
remembers the tokens whose K/V it holds. A new sequence takes the free slot whose tokens share
the longest prefix with its prompt; if another slot (busy or not) shares a longer one of at
least MIN_COPY tokens, that prefix is copied over. The reused tokens (at most len(prompt) - 1:
the last prompt token is always run, for its logits) are Sequence.cached_tokens.

Token choice per sequence: greedy (the backend's argmax: ties -> the lowest id) unless the
sequence has a sampler or needs logits (logprobs), as engine.generate. A sequence ends at an
end-of-generation token (not emitted), after max_tokens tokens, when its on_token callback
returns False (stop string, structured output complete) or when it is cancelled.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import numpy as np

from engine.generate import Generation, Step, choose_from_logits

log = logging.getLogger("engine.scheduler")

MIN_COPY = 16             # shortest prefix worth copying from another slot


FOLLOW = -1               # BatchEntry.ids == [FOLLOW]: the slot's token from the step before


@dataclass
class BatchEntry:
    slot: int
    ids: list[int]
    start: int
    want: str | None = None        # None | "argmax" | "logits"

    @property
    def follows(self) -> bool:
        return len(self.ids) == 1 and self.ids[0] == FOLLOW


@dataclass(eq=False)
class Sequence:
    """One generation. on_token(Step) -> bool (False: stop here, the token stays emitted);
    on_finish(Generation) when it ends (result.stop_reason: "eog" | "length" | "stop" |
    "cancelled" | "error", result.error set for "error")."""
    prompt_ids: list[int]
    max_tokens: int
    on_token: Callable[[Step], bool]
    on_finish: Callable[[Generation], None]
    eog_ids: frozenset = frozenset()
    sampler: Callable[[np.ndarray], int] | None = None
    need_logits: bool = False
    is_cancelled: Callable[[], bool] = lambda: False
    # set by the scheduler
    slot: int = -1
    cached_tokens: int = 0        # prompt tokens reused from the prefix cache
    n_fed: int = 0                # tokens of prompt (+ generated) whose K/V are in the slot
    next_token: int | None = None  # last emitted token, fed by the next step
    pending: int = 0              # launched steps that will choose a token for it
    finished: bool = False
    result: Generation = field(default=None)  # type: ignore[assignment]
    t_admit: float = 0.0
    t_first: float = 0.0

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        self.result = Generation(list(self.prompt_ids))
        self.result.stop_reason = "cancelled"

    @property
    def prefilling(self) -> bool:
        return self.n_fed < len(self.prompt_ids)


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n]) != np.asarray(b[:n])
    i = int(np.argmax(x)) if x.any() else n
    return i


class SlotTable:
    """Which slot is busy, and the tokens whose K/V each slot holds (the prefix cache)."""

    def __init__(self, n_slots: int):
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]
        self.busy = [False] * n_slots
        self.used = [0.0] * n_slots            # last release time (least recently used first)

    @property
    def n_free(self) -> int:
        return self.busy.count(False)

    def acquire(self, prompt: list[int]) -> tuple[int, int, int | None]:
        """(slot, reusable tokens, slot to copy them from or None); the slot is marked busy."""
        limit = max(0, len(prompt) - 1)
        match = [min(common_prefix(t, prompt), limit) for t in self.tokens]
        free = [i for i, b in enumerate(self.busy) if not b]
        slot = max(free, key=lambda i: (match[i], -self.used[i]))
        src = max(range(len(match)), key=lambda i: match[i])
        self.busy[slot] = True
        if match[src] > match[slot] and match[src] >= MIN_COPY:
            return slot, match[src], src
        return slot, match[slot], None

    def release(self, slot: int) -> None:
        self.busy[slot] = False
        self.used[slot] = time.monotonic()


@dataclass
class StepStats:
    tokens: int = 0
    sequences: int = 0
    decode: int = 0
    seconds: float = 0.0                 # wall: plan, forward, delivery
    device_seconds: float | None = None  # the forward's kernels (backend.last_device_seconds)


@dataclass
class _Launched:
    entries: list[BatchEntry]
    owners: list[Sequence]
    n_decode: int
    handle: object


class Scheduler:
    def __init__(self, backend, max_batch_tokens: int = 512, overlap: bool = True):
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.backend = backend
        self.max_batch_tokens = int(max_batch_tokens)
        self.overlap = bool(overlap)
        self.slots = SlotTable(backend.n_slots)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []      # admission order
        self.inflight: _Launched | None = None  # launched, not yet collected
        self.last = StepStats()
        self.prefix_hits = 0
        self.prefix_tokens = 0

    # ------------------------------------------------------------------ queue
    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.inflight)

    @property
    def free_slots(self) -> int:
        return self.slots.n_free - len(self.waiting)

    def add(self, seq: Sequence) -> None:
        need = len(seq.prompt_ids) + max(seq.max_tokens, 1)
        if not seq.prompt_ids:
            raise ValueError("a generation needs at least one prompt token")
        if need > self.backend.slot_capacity:
            raise ValueError(f"{len(seq.prompt_ids)} prompt tokens + {seq.max_tokens} new tokens "
                             f"exceed the slot size {self.backend.slot_capacity}")
        self.waiting.append(seq)

    def cancel_all(self) -> None:
        for s in self.waiting + self.running:
            s.is_cancelled = lambda: True

    # ------------------------------------------------------------------ one step
    def step(self) -> StepStats:
        """Admit what fits, launch one forward, and hand every sequence of the step before
        (overlap) or of this one its token. The StepStats describe the step collected."""
        t0 = time.perf_counter()
        self._reap_cancelled()
        self._admit()
        if self.inflight is not None and not self._may_follow():
            self._collect(self._take_inflight())        # host-chosen tokens: deliver first
        entries, owners, n_dec = self._plan()
        prev = self._take_inflight()
        if entries:
            try:
                handle = self.backend.launch(entries)
            except Exception as e:  # noqa: BLE001 - every sequence of the step ends with the error
                self._fail(owners, e)
                if prev is not None:
                    self._collect(prev)
                raise
            for e, s in zip(entries, owners):
                s.n_fed += len(e.ids)
                if e.want is not None:
                    s.pending += 1
                if not s.prefilling and not e.follows:
                    s.next_token = None
            self.inflight = _Launched(entries, owners, n_dec, handle)
        # without overlap, prev is None (_may_follow() is False: collected above): this step
        done = prev if self.overlap else self._take_inflight()
        if done is None:
            self.last = StepStats()
            return self.last
        self._collect(done)
        self.last = StepStats(sum(len(e.ids) for e in done.entries), len(done.entries), done.n_decode,
                              time.perf_counter() - t0, getattr(self.backend, "last_device_seconds", None))
        return self.last

    def _take_inflight(self) -> _Launched | None:
        x, self.inflight = self.inflight, None
        return x

    def _may_follow(self) -> bool:
        """Whether the next step may be planned before the step in flight is delivered: every
        running sequence takes the backend's argmax (no host-side choice)."""
        return self.overlap and all(self._want(s) == "argmax" for s in self.running)

    def _collect(self, step: _Launched) -> None:
        """Wait for a launched step and deliver its tokens."""
        try:
            outs = self.backend.collect(step.handle)
        except Exception as e:  # noqa: BLE001 - every sequence of the step ends with the error,
            self._fail(step.owners, e)          # and of the step launched after it (same device)
            late = self._take_inflight()
            if late is not None:
                self._fail(late.owners, e)
                try:
                    self.backend.collect(late.handle)
                except Exception:  # noqa: BLE001 - its error is the one being raised
                    pass
            raise
        for e, s, out in zip(step.entries, step.owners, outs):
            if e.want is not None:
                s.pending -= 1
            if s.finished:                              # ended while this step was in flight
                continue
            # a followed token is the one delivered for s just before this step
            self.slots.tokens[s.slot].extend([s.result.tokens[-1]] if e.follows else e.ids)
            if out is not None:
                self._deliver(s, out)
            elif s.max_tokens <= 0 and not s.prefilling:
                self._finish(s, "length")               # prompt only

    def _fail(self, owners, e: Exception) -> None:
        for s in {id(s): s for s in owners}.values():
            if not s.finished:
                s.result.error = f"{type(e).__name__}: {e}"
                self._finish(s, "error")

    def _reap_cancelled(self) -> None:
        for s in list(self.waiting):
            if s.is_cancelled():
                self.waiting.remove(s)
                self._finish(s, "cancelled")
        for s in list(self.running):
            if s.is_cancelled():
                self._finish(s, "cancelled")

    def _admit(self) -> None:
        while self.waiting and self.slots.n_free:
            s = self.waiting.pop(0)
            slot, reuse, src = self.slots.acquire(s.prompt_ids)
            if src is not None:
                self.backend.copy_prefix(src, slot, reuse)
            self.slots.tokens[slot] = list(s.prompt_ids[:reuse])
            s.slot, s.cached_tokens, s.n_fed = slot, reuse, reuse
            s.t_admit = time.perf_counter()
            if reuse:
                self.prefix_hits += 1
                self.prefix_tokens += reuse
            self.running.append(s)

    def _want(self, s: Sequence) -> str:
        return "logits" if (s.sampler is not None or s.need_logits) else "argmax"

    def _plan(self) -> tuple[list[BatchEntry], list[Sequence], int]:
        """The step's entries (decoders first, then prompt chunks), their sequences, and how
        many of them are decoders."""
        entries, owners = [], []
        for s in self.running:                          # every decoder's next token
            if s.prefilling:
                continue
            if s.pending:                               # its token is in flight: follow it
                if s.pending == 1 and len(s.result.tokens) + 1 < s.max_tokens:
                    entries.append(BatchEntry(s.slot, [FOLLOW], s.n_fed, "argmax"))
                    owners.append(s)
            elif s.next_token is not None:
                entries.append(BatchEntry(s.slot, [s.next_token], s.n_fed, self._want(s)))
                owners.append(s)
        n_dec = len(entries)
        budget = max(self.max_batch_tokens - n_dec, min(64, self.max_batch_tokens))
        for s in self.running:                          # then prompt chunks, oldest first
            if budget <= 0:
                break
            if s.prefilling:
                n = min(len(s.prompt_ids) - s.n_fed, budget)
                last = s.n_fed + n == len(s.prompt_ids)
                want = self._want(s) if last and s.max_tokens > 0 else None
                entries.append(BatchEntry(s.slot, s.prompt_ids[s.n_fed:s.n_fed + n], s.n_fed, want))
                owners.append(s)
                budget -= n
        return entries, owners, n_dec

    def _deliver(self, s: Sequence, out) -> None:
        if isinstance(out, tuple):
            token, top, margin = out
            logits = None
        else:
            token, top, margin, logits = choose_from_logits(out, s.sampler, s.need_logits)
        now = time.perf_counter()
        res = s.result
        if s.t_first == 0.0:
            res.prompt_ms = (now - s.t_admit) * 1e3
            s.t_first = now
        else:
            res.predicted_ms = (now - s.t_first) * 1e3
        if token in s.eog_ids:
            self._finish(s, "eog")
            return
        res.tokens.append(token)
        res.top_logits.append(top)
        res.margins.append(margin)
        try:
            go_on = s.on_token(Step(token, top, margin, logits))
        except Exception as e:  # noqa: BLE001 - the consumer's fault ends its sequence only
            s.result.error = f"{type(e).__name__}: {e}"
            self._finish(s, "error")
            return
        if not go_on:
            self._finish(s, "stop")
        elif len(res.tokens) >= s.max_tokens:
            self._finish(s, "length")
        elif not s.pending:                             # (else a step in flight follows it)
            s.next_token = token

    def _finish(self, s: Sequence, reason: str) -> None:
        s.finished = True
        if s in self.running:
            self.running.remove(s)
            # the slot keeps the tokens whose K/V it holds: the prompt and all but the last
            # emitted token (never fed)
            self.slots.release(s.slot)
            if reason == "error":
                self.slots.tokens[s.slot] = []          # contents unknown after a failed step
        s.result.stop_reason = reason
        try:
            s.on_finish(s.result)
        except Exception:  # noqa: BLE001 - nothing more to tell that sequence; the rest go on
            log.exception("a sequence's on_finish failed")

    # ------------------------------------------------------------------ views
    def slot_view(self) -> list[dict]:
        """The /slots JSON: one entry per slot."""
        by_slot = {s.slot: s for s in self.running}
        out = []
        for i in range(self.backend.n_slots):
            s = by_slot.get(i)
            d = {"id": i, "state": "idle" if s is None else ("prefill" if s.prefilling else "decode"),
                 "n_cached": len(self.slots.tokens[i])}
            if s is not None:
                d.update(n_prompt=len(s.prompt_ids), n_prompt_done=s.n_fed if s.prefilling else len(s.prompt_ids),
                         n_decoded=len(s.result.tokens), cached_tokens=s.cached_tokens,
                         max_tokens=s.max_tokens)
            out.append(d)
        return out
