"""Token generation over any backend (the Backend protocol of docs/ARCHITECTURE.md).

Greedy decoding is argmax with ties going to the lowest id (numpy's argmax). A generation stops at
an end-of-generation token (which, as in llama.cpp, is not emitted), at max_tokens, or when
`should_stop()` says so (a cancelled request).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

Sampler = Callable[[np.ndarray], int]


def top_two(logits: np.ndarray) -> tuple[int, float, float]:
    """(argmax id, its logit, its lead over the runner-up)."""
    best = int(np.argmax(logits))
    top = float(logits[best])
    if logits.shape[0] < 2:
        return best, top, float("inf")
    rest = logits.copy()
    rest[best] = -np.inf
    return best, top, top - float(rest.max())


@dataclass
class Step:
    token: int
    top_logit: float  # the chosen token's logit
    margin: float     # top logit minus runner-up logit (greedy lead)


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    top_logits: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    stop_reason: str = "length"  # "eog" | "length" | "cancelled"

    @property
    def timings(self) -> dict:
        n_p, n_g = len(self.prompt_ids), len(self.tokens)
        return {
            "prompt_n": n_p, "prompt_ms": self.prompt_ms,
            "prompt_per_second": n_p / self.prompt_ms * 1e3 if self.prompt_ms > 0 else 0.0,
            "predicted_n": n_g, "predicted_ms": self.predicted_ms,
            "predicted_per_second": n_g / self.predicted_ms * 1e3 if self.predicted_ms > 0 else 0.0,
        }


def generate_steps(model, prompt_ids: Sequence[int], max_tokens: int, eog_ids=(),
                   sampler: Sampler | None = None, result: Generation | None = None,
                   ) -> Iterator[Step]:
    """Yield one Step per emitted token; fills `result` (timings, stop reason) as it goes.

    The consumer may stop iterating at any time (cancellation); result.stop_reason then stays
    "cancelled" unless the loop ended by itself.
    """
    prompt_ids = [int(t) for t in prompt_ids]
    res = result if result is not None else Generation(prompt_ids)
    res.prompt_ids = prompt_ids
    res.stop_reason = "cancelled"
    eog = set(int(t) for t in eog_ids)
    cache = model.new_cache(len(prompt_ids) + max(max_tokens, 1))
    t0 = time.perf_counter()
    logits = model.forward(prompt_ids, cache)
    res.prompt_ms = (time.perf_counter() - t0) * 1e3
    decode_s = 0.0
    for i in range(max_tokens):
        best, top, margin = top_two(logits)
        token = best if sampler is None else int(sampler(logits))
        if token != best:
            top, margin = float(logits[token]), float(logits[token]) - float(logits[best])
        if token in eog:
            res.stop_reason = "eog"
            return
        res.tokens.append(token)
        res.top_logits.append(top)
        res.margins.append(margin)
        yield Step(token, top, margin)
        if i + 1 == max_tokens:
            break
        t1 = time.perf_counter()
        logits = model.forward([token], cache)
        decode_s += time.perf_counter() - t1
        res.predicted_ms = decode_s * 1e3
    res.stop_reason = "length"


def generate(model, prompt_ids: Sequence[int], max_tokens: int, eog_ids=(),
             sampler: Sampler | None = None) -> Generation:
    res = Generation(list(prompt_ids))
    for _ in generate_steps(model, prompt_ids, max_tokens, eog_ids, sampler, res):
        pass
    return res
