"""Generation sessions of the GPU model (the Session protocol of engine/session.py).

A `GPUSession` owns one GPUKVCache and the DecodeStep over it (work buffers, stream, CUDA
graph). The prompt goes through the model's prefill (GPUModel.forward_device, legacy stream);
each generated token through the decode graph (the session's stream). The graph is captured
on the session's first decode step and replayed for every later step of every request that
reuses the session: `GPUModel.session(n)` takes one from the model's `SessionPool` (one
capacity per size bucket, `bucket_capacity`), `close()` resets it and gives it back.

Greedy steps bring back only the chosen id and its logit (argmax.cu runs inside the graph;
after a prefill the same kernel runs once over the prefill's last row). `logits()` copies the
vocabulary of logits to the host for a sampler or logprobs.

Stream order: a prefill (legacy stream) waits for the session stream's earlier work, and the
next step or argmax waits for the prefill (events, no host synchronization).
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from engine.errors import GGUFError
from engine.gpu.decode import DecodeStep
from engine.gpu.kv_cache import GPUKVCache

MIN_BUCKET = 256
LINEAR_FROM = 4096        # capacities above this round up to multiples of it


def bucket_capacity(n_tokens: int) -> int:
    """The pooled capacity for a generation of n_tokens (prompt + new tokens): powers of two
    from MIN_BUCKET to LINEAR_FROM, then multiples of LINEAR_FROM."""
    n = max(1, int(n_tokens))
    if n <= LINEAR_FROM:
        return max(MIN_BUCKET, 1 << (n - 1).bit_length())
    return -(-n // LINEAR_FROM) * LINEAR_FROM


class GPUSession:
    """One generation's device state: a KV cache and its decode graph (module docstring)."""

    def __init__(self, model, capacity: int, pool: "SessionPool | None" = None, use_graph: bool = True):
        self.model = model
        self.cache = GPUKVCache(model.config, capacity)
        self.decode = DecodeStep(model, self.cache)
        self.use_graph = use_graph
        self._pool = pool
        self._clear()

    def _clear(self) -> None:
        self._cur = None          # device logits [vocab] of the last position fed
        self._argmaxed = False    # state/best hold the argmax of _cur
        self._host_token = None   # state[0] as the host last read it (valid for position == length)
        self._after_prefill = False
        self._stream_used = False

    # ------------------------------------------------------------------ protocol

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes + self.decode.nbytes

    def prefill(self, ids: Sequence[int]) -> None:
        """Append ids through the prefill kernels; their last row's logits become current."""
        if self._stream_used:
            self.decode.before_legacy_stream()
            self._stream_used = False
        self._cur = self.model.forward_device(ids, self.cache)
        self._argmaxed = False
        self._host_token = None
        self._after_prefill = True

    def step(self, token: int) -> None:
        """Append one token through the decode graph (asynchronous); its logits become current."""
        token, pos = int(token), self.cache.length
        if pos >= self.cache.capacity:
            raise GGUFError(f"{self.model.file.path}: {pos + 1} tokens exceed the KV cache size "
                            f"{self.cache.capacity}")
        self.decode.check(token, pos)
        self._order_after_prefill()
        if self._host_token != token:      # else the graph's argmax already left it in state
            with self.decode.stream:
                self.decode.set_state(token, pos)
        self.decode.launch(self.use_graph)
        self.cache.length = pos + 1
        self._cur = self.decode.logits
        self._argmaxed = True
        self._host_token = None

    def argmax(self) -> tuple[int, float, float]:
        """(id, logit, margin) of the current logits' argmax (ties -> lowest id, numpy's rule);
        only 32 bytes come back, so the margin is unknown (nan)."""
        self._need_logits()
        if not self._argmaxed:             # after a prefill: one argmax launch over its last row
            self._order_after_prefill()
            with self.decode.stream:
                self.decode.set_state(0, self.cache.length - 1)
                self.decode.argmax_into_state(self._cur)
            self._argmaxed = True
        io = self.decode.read_io()
        self._host_token = int(io[0])
        return self._host_token, float(io[4:5].view(np.float32)[0]), float("nan")

    def logits(self) -> np.ndarray:
        """The current logits, float32 [vocab], copied to the host."""
        self._need_logits()
        self._order_after_prefill()
        return self.decode.logits_host(self._cur)

    def synchronize(self) -> None:
        self._order_after_prefill()
        self.decode.stream.synchronize()

    def reset(self) -> None:
        """Empty the cache for the next request (the buffers and the graph stay)."""
        if self._stream_used:
            self.decode.stream.synchronize()
        self.cache.reset()
        self._clear()

    def close(self) -> None:
        """Reset and hand the session back to its pool (if any)."""
        self.reset()
        if self._pool is not None:
            self._pool.give(self)

    def __enter__(self) -> "GPUSession":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    # ------------------------------------------------------------------ internals

    def _need_logits(self) -> None:
        if self._cur is None:
            raise GGUFError(f"{self.model.file.path}: no logits yet (prefill or step first)")

    def _order_after_prefill(self) -> None:
        if self._after_prefill:
            self.decode.after_legacy_stream()
            self._after_prefill = False
        self._stream_used = True


class SessionPool:
    """Idle sessions of one model by capacity, reused across requests (a graph per session,
    captured once). At most `max_idle` idle sessions and `max_idle_bytes` of them are kept
    (the least recently used go first); a new session that does not fit in device memory
    frees the idle ones and retries once."""

    def __init__(self, model, max_idle: int = 4, max_idle_bytes: int = 4 << 30):
        self.model = model
        self.max_idle = max_idle
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[GPUSession] = []      # least recently used first
        self._lock = threading.Lock()
        self.created = 0

    def take(self, n_tokens: int) -> GPUSession:
        cap = bucket_capacity(n_tokens)
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i].capacity == cap:
                    return self._idle.pop(i)
        try:
            s = GPUSession(self.model, cap, pool=self)
        except Exception as e:  # noqa: BLE001 - only an out-of-memory error is retried
            if type(e).__name__ != "OutOfMemoryError" or not self._idle:
                raise
            self.clear()
            s = GPUSession(self.model, cap, pool=self)
        self.created += 1
        return s

    def give(self, s: GPUSession) -> None:
        with self._lock:
            if s in self._idle:
                return
            self._idle.append(s)
            while len(self._idle) > 1 and (len(self._idle) > self.max_idle or
                                           sum(x.nbytes for x in self._idle) > self.max_idle_bytes):
                self._idle.pop(0)

    def idle(self) -> list[GPUSession]:
        with self._lock:
            return list(self._idle)

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
