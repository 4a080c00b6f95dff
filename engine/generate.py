"""Token generation over any backend, through a generation session (engine/session.py).

Greedy decoding is argmax with ties going to the lowest id (numpy's argmax; argmax.cu on the
GPU has the same rule). A generation stops at an end-of-generation token (which, as in
llama.cpp, is not emitted), at max_tokens, or when the consumer stops iterating (a cancelled
request).

Greedy without `need_logits` asks the session for the argmax only: on the GPU no vocabulary of
logits crosses to the host, and Step.margin is nan (the reference backend still gives it). A
sampler, or need_logits=True (margins, logprobs), copies the logits of each step; with
need_logits the Step carries them (Step.logits).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from engine.session import open_session, top_two

Sampler = Callable[[np.ndarray], int]

__all__ = ["Generation", "Sampler", "Step", "generate", "generate_steps", "top_two", "warm_up"]


@dataclass
class Step:
    token: int
    top_logit: float  # the chosen token's logit
    margin: float     # top logit minus runner-up logit (greedy lead); nan when not computed
    logits: np.ndarray | None = None   # float32 [vocab], with need_logits=True


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    top_logits: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    stop_reason: str = "length"  # "eog" | "length" | "cancelled" (| "stop" | "error": engine.scheduler)
    error: str | None = None

    @property
    def timings(self) -> dict:
        n_p, n_g = len(self.prompt_ids), len(self.tokens)
        return {
            "prompt_n": n_p, "prompt_ms": self.prompt_ms,
            "prompt_per_second": n_p / self.prompt_ms * 1e3 if self.prompt_ms > 0 else 0.0,
            "predicted_n": n_g, "predicted_ms": self.predicted_ms,
            "predicted_per_second": n_g / self.predicted_ms * 1e3 if self.predicted_ms > 0 else 0.0,
        }


def choose_from_logits(logits: np.ndarray, sampler: Sampler | None, need_logits: bool):
    """(token, top logit, margin, logits or None) of host logits: greedy (ties -> lowest id) or
    the sampler's choice (then top/margin are that token's logit and its lead over the best)."""
    best, top, margin = top_two(logits)
    token = best if sampler is None else int(sampler(logits))
    if token != best:
        top, margin = float(logits[token]), float(logits[token]) - float(logits[best])
    return token, top, margin, (logits if need_logits else None)


def _choose(session, sampler: Sampler | None, need_logits: bool):
    """(token, top logit, margin, logits or None) for the session's current logits."""
    if sampler is None and not need_logits:
        token, top, margin = session.argmax()
        return token, top, margin, None
    return choose_from_logits(session.logits(), sampler, need_logits)


def generate_steps(model, prompt_ids: Sequence[int], max_tokens: int, eog_ids=(),
                   sampler: Sampler | None = None, result: Generation | None = None,
                   need_logits: bool = False) -> Iterator[Step]:
    """Yield one Step per emitted token; fills `result` (timings, stop reason) as it goes.

    The consumer may stop iterating at any time (cancellation); result.stop_reason then stays
    "cancelled" unless the loop ended by itself. prompt_ms covers the prefill and the first
    token's choice; predicted_ms each later step and its choice.
    """
    prompt_ids = [int(t) for t in prompt_ids]
    res = result if result is not None else Generation(prompt_ids)
    res.prompt_ids = prompt_ids
    res.stop_reason = "cancelled"
    eog = set(int(t) for t in eog_ids)
    with open_session(model, len(prompt_ids) + max(max_tokens, 1)) as session:
        t0 = time.perf_counter()
        session.prefill(prompt_ids)
        if max_tokens <= 0:
            session.synchronize()
            res.prompt_ms = (time.perf_counter() - t0) * 1e3
            res.stop_reason = "length"
            return
        choice = _choose(session, sampler, need_logits)
        res.prompt_ms = (time.perf_counter() - t0) * 1e3
        decode_s = 0.0
        for i in range(max_tokens):
            token, top, margin, logits = choice
            if token in eog:
                res.stop_reason = "eog"
                return
            res.tokens.append(token)
            res.top_logits.append(top)
            res.margins.append(margin)
            yield Step(token, top, margin, logits)
            if i + 1 == max_tokens:
                break
            t1 = time.perf_counter()
            session.step(token)
            choice = _choose(session, sampler, need_logits)
            decode_s += time.perf_counter() - t1
            res.predicted_ms = decode_s * 1e3
    res.stop_reason = "length"


def generate(model, prompt_ids: Sequence[int], max_tokens: int, eog_ids=(),
             sampler: Sampler | None = None, need_logits: bool = False) -> Generation:
    res = Generation(list(prompt_ids))
    for _ in generate_steps(model, prompt_ids, max_tokens, eog_ids, sampler, res, need_logits=need_logits):
        pass
    return res


def warm_up(model, n_prompt: int = 64) -> None:
    """Load (compile) every kernel a request runs: a prefill of n_prompt tokens and two decode
    steps through a session (on the GPU that also captures one pooled session's graph)."""
    generate(model, [0] * max(1, int(n_prompt)), 3)
