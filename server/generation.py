"""One generate job as a sequence of the engine's scheduler (engine.scheduler.Sequence): the
text that leaves the worker, stop strings, logprob records, metrics and the job's events.

- Text leaves only as complete UTF-8 characters (bytes from token_to_bytes go through an
  incremental decoder), and text that might be the start of a `stop` string is held back
  until it is known not to be.
- One "text" event per generated token (its text may be empty), so a client sees every step.
- Greedy (no sampler) takes the engine's own argmax; a sampler (server.sampling.TokenChooser)
  gets the logits of each step.
"""

from __future__ import annotations

import codecs
import logging
import time
from typing import Callable, Sequence

from server.errors import APIError

log = logging.getLogger("server")


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



class GenerationJob:
    """A runner Job (kind "generate") as an engine.scheduler.Sequence (`seq`); its callbacks
    run on the engine worker between steps and emit the job's "text" and "done" events."""

    def __init__(self, job, engine, metrics, stopping: Callable[[], bool]):
        from engine.scheduler import Sequence as EngineSequence
        from server.sampling import TokenChooser

        self.job, self.engine, self.metrics = job, engine, metrics
        self.text = TextAssembler(engine.token_bytes, job.stops)
        self.chooser = job.sampler if isinstance(job.sampler, TokenChooser) else None
        self.records = (self.chooser.records if self.chooser is not None
                        and self.chooser.top_logprobs is not None else None)
        self.tokens: list[int] = []
        self.pending = 0          # tokens whose logprobs have not gone out with a text event
        self.first_seen = False
        eog = frozenset() if job.ignore_eos else frozenset(engine.eog_ids())
        self.seq = EngineSequence(
            job.prompt_ids, job.max_tokens, on_token=self.on_token, on_finish=self.on_finish,
            eog_ids=eog, sampler=job.sampler,
            is_cancelled=lambda: job.cancelled.is_set() or stopping())

    def _emit_text(self, delta: str) -> None:
        lps = None
        if self.records is not None:
            n = len(self.tokens)
            lps = self.records[n - self.pending:n]
        self.pending = 0
        self.job.emit("text", (delta, lps))

    def _first(self, prompt_s: float) -> None:
        if not self.first_seen:
            self.first_seen = True
            n_new = len(self.job.prompt_ids) - self.seq.cached_tokens
            self.metrics.observe_prefill(n_new, prompt_s)

    def on_token(self, step) -> bool:
        if not self.first_seen:
            self._first(self.seq.result.prompt_ms / 1e3)
            self.metrics.time_to_first_token.observe(time.perf_counter() - self.job.submitted)
        self.metrics.generated_tokens.inc()
        self.tokens.append(int(step.token))
        self.pending += 1
        # one event per token, as OpenAI streams: its text may be "" (a token with no bytes of
        # its own, an incomplete UTF-8 character, text held back as a possible stop string)
        self._emit_text(self.text.push(int(step.token)))
        if self.text.stopped:
            return False
        if self.chooser is not None and self.chooser.stopped:
            return False          # the structured output is complete
        return True

    def on_finish(self, res) -> None:
        job = self.job
        job.finished = True
        if res.stop_reason == "error":
            job.emit("error", APIError(500, f"engine error: {res.error}"))
            return
        if res.prompt_ms > 0:
            self._first(res.prompt_ms / 1e3)
        finish = {"eog": "stop", "stop": "stop", "cancelled": "cancelled"}.get(res.stop_reason, "length")
        if finish == "cancelled":
            self.metrics.cancelled.inc()
        if self.chooser is not None and self.chooser.error:
            log.warning("structured output ended early: %s", self.chooser.error)
        tail = self.text.finish()
        if tail or self.pending:
            self._emit_text(tail)
        timings = res.timings
        timings["predicted_n"] = len(self.tokens)
        job.emit("done", {"finish_reason": finish, "tokens": list(self.tokens), "timings": timings,
                          "prompt_n": len(job.prompt_ids), "cached_tokens": self.seq.cached_tokens,
                          "logprobs": self.records[:len(self.tokens)] if self.records is not None else None})
