"""Seeded temperature / top-k / top-p sampler (numpy). Same seed and logits, same token.

Used only when a request asks for temperature > 0; temperature 0 (the default) goes through
the engine's greedy path untouched. Candidates are ordered by (logit desc, id asc), so ties
resolve to the lowest id exactly like greedy argmax.
"""

from __future__ import annotations

import numpy as np


class Sampler:
    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None):
        if not temperature > 0:
            raise ValueError("temperature must be > 0 for sampling (0 means greedy)")
        if top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        x = np.asarray(logits, dtype=np.float64).reshape(-1)
        order = np.lexsort((np.arange(x.size), -x))  # logit desc, then id asc
        if 0 < self.top_k < x.size:
            order = order[: self.top_k]
        z = x[order] / self.temperature
        z -= z[0]
        p = np.exp(z)
        p /= p.sum()
        if self.top_p < 1.0:
            cum = np.cumsum(p)
            keep = int(np.searchsorted(cum, self.top_p, side="left")) + 1
            order, p = order[:keep], p[:keep]
            p = p / p.sum()
        u = self.rng.random()
        i = int(np.searchsorted(np.cumsum(p), u, side="right"))
        return int(order[min(i, order.size - 1)])
