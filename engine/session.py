"""The Session protocol: one generation over a backend, and the adapter for backends that only
have the forward protocol (engine.reference.model.ReferenceModel).

A session owns its KV cache (and, on the GPU, the decode graph over it). Its life:

    s = open_session(model, n_tokens)       # capacity >= n_tokens (prompt + new tokens)
    s.prefill(prompt_ids)                   # many tokens; the last row's logits become current
    tok, top, margin = s.argmax()           # greedy choice of the current logits (margin: nan
                                            #   where the backend does not compute it cheaply)
    logits = s.logits()                     # or the logits themselves (numpy float32 [vocab]),
                                            #   for a sampler or logprobs
    s.step(tok)                             # one token (decode mode); its logits become current
    ...
    s.close()                               # done: reset, and back to the model's pool if any

`s.length` (tokens in the cache), `s.capacity`, `s.synchronize()` (wait for queued work),
`s.reset()` (empty the cache, keep the buffers). Sessions are context managers (close on exit).

Backends: a model with `session(n_tokens)` (engine.gpu.model.GPUModel -> GPUSession) provides
its own; any other model with `new_cache(n)` / `forward(ids, cache)` gets a ForwardSession.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from engine.reference.ops import top_two  # noqa: F401 - re-exported (engine.generate)


class Session(Protocol):
    capacity: int
    length: int

    def prefill(self, ids: Sequence[int]) -> None: ...

    def step(self, token: int) -> None: ...

    def argmax(self) -> tuple[int, float, float]: ...

    def logits(self) -> np.ndarray: ...

    def synchronize(self) -> None: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


class ForwardSession:
    """A Session over `model.new_cache` / `model.forward` (the logits are on the host already,
    so argmax() also gives the margin)."""

    def __init__(self, model, capacity: int):
        self.model = model
        self.cache = model.new_cache(int(capacity))
        self._logits: np.ndarray | None = None

    @property
    def capacity(self) -> int:
        return int(self.cache.max_tokens)

    @property
    def length(self) -> int:
        return int(self.cache.length)

    def prefill(self, ids: Sequence[int]) -> None:
        self._logits = self.model.forward(ids, self.cache)

    def step(self, token: int) -> None:
        self._logits = self.model.forward([int(token)], self.cache)

    def argmax(self) -> tuple[int, float, float]:
        return top_two(self.logits())

    def logits(self) -> np.ndarray:
        if self._logits is None:
            raise ValueError("no logits yet (prefill or step first)")
        return self._logits

    def synchronize(self) -> None:
        pass

    def reset(self) -> None:
        self.cache.length = 0
        self._logits = None

    def close(self) -> None:
        self.reset()

    def __enter__(self) -> "ForwardSession":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def open_session(model, n_tokens: int) -> Session:
    """The model's own session when it has one (GPU), else a ForwardSession."""
    make = getattr(model, "session", None)
    if callable(make):
        return make(int(n_tokens))
    return ForwardSession(model, int(n_tokens))
