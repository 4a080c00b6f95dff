"""Seeded temperature / top-k / top-p sampler (numpy). Same seed and logits, same token.
TokenChooser: logit_bias, presence/frequency penalties, a grammar mask and logprobs on top.

The Sampler is used only when a request asks for temperature > 0; temperature unset or 0
(the default) is greedy, and a request with nothing else either goes through the engine's
greedy path untouched. Candidates are ordered by (logit desc, id asc), so ties
resolve to the lowest id exactly like greedy argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        # OpenAI seeds are any 64-bit integer; numpy's generator takes non-negative ones
        self.rng = np.random.default_rng(None if seed is None else int(seed) % 2**64)

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


# ---- the per-request token choice ------------------------------------------------------------

@dataclass
class TokenLogprob:
    """One generated (or prompt) position: the token, its log-probability, the top ones."""
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (id, logprob), most likely first, ties by lower id


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = float(x.max())
    return x - (m + float(np.log(np.exp(x - m).sum())))


def top_entries(lp: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    k = min(k, lp.size)
    part = np.argpartition(-lp, k - 1)[:k]
    cut = lp[part].min()
    cand = np.flatnonzero(lp >= cut)  # everything tied at the cut, so ties go to the lower id
    order = cand[np.lexsort((cand, -lp[cand]))][:k]
    return [(int(i), float(lp[i])) for i in order]


def logprob_entry(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    lp = log_softmax(logits)
    return TokenLogprob(int(token), float(lp[token]), top_entries(lp, k))


class TokenChooser:
    """The `sampler` handed to engine.generate.generate_steps when a request asks for more
    than plain greedy decoding (a request that asks for nothing extra gets no chooser at all,
    so the default stays the engine's greedy loop, byte for byte).

    Per step, on the model's logits (OpenAI's order): + logit_bias; - frequency_penalty *
    count(token) - presence_penalty * [count > 0] over the tokens generated so far (not the
    prompt); the structured-output grammar's mask (disallowed tokens -> -inf); then the
    seeded `Sampler`, or argmax (ties -> lowest id) when there is none.

    `top_logprobs` (None: no logprobs) records, per step, the chosen token's log-probability
    and the top-k alternatives under the model's own distribution (log_softmax of the raw
    logits, before bias, penalties, mask and temperature). `stopped` turns true when the
    grammar is complete (nothing more may follow); `error` says why the grammar could not
    go on, if it could not.
    """

    def __init__(self, sampler: Sampler | None = None, *, logit_bias: dict[int, float] | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, matcher=None,
                 top_logprobs: int | None = None, eog_ids=()):
        self.sampler = sampler
        bias = {int(k): float(v) for k, v in (logit_bias or {}).items() if v != 0}
        self._bias_ids = np.array(sorted(bias), dtype=np.int64)
        self._bias_vals = np.array([bias[i] for i in sorted(bias)], dtype=np.float64)
        self.presence = float(presence_penalty)
        self.frequency = float(frequency_penalty)
        self.counts: dict[int, int] = {}
        self.matcher = matcher
        self.top_logprobs = top_logprobs
        self.records: list[TokenLogprob] = []
        self.eog = sorted(int(t) for t in eog_ids)
        self.stopped = False
        self.error: str | None = None
        self._modifies = bool(bias) or self.presence != 0 or self.frequency != 0 or matcher is not None

    def process(self, logits: np.ndarray) -> np.ndarray:
        """The logits the choice is made on (a float64 copy when anything changes them)."""
        raw = np.asarray(logits).reshape(-1)
        if not self._modifies:
            return raw
        x = raw.astype(np.float64)
        if self._bias_ids.size:
            ok = self._bias_ids < x.size
            x[self._bias_ids[ok]] += self._bias_vals[ok]
        if self.counts and (self.presence or self.frequency):
            ids = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            c = np.fromiter(self.counts.values(), dtype=np.float64, count=len(self.counts))
            x[ids] -= c * self.frequency + self.presence
        if self.matcher is not None:
            x[~self._allowed(x.size)] = -np.inf
        return x

    def _allowed(self, n: int) -> np.ndarray:
        mask = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(mask, bitorder="little")[:n].astype(bool)
        if bits.size < n:
            bits = np.concatenate([bits, np.zeros(n - bits.size, dtype=bool)])
        return bits

    def __call__(self, logits: np.ndarray) -> int:
        raw = np.asarray(logits).reshape(-1)
        x = self.process(raw)
        if self.matcher is not None and (self.matcher.is_error() or not np.isfinite(x).any()):
            self.error = self.matcher.get_error() or "the grammar allows no further token"
            self.stopped = True
            token = self.eog[0] if self.eog else int(np.argmax(raw))
        else:
            token = int(np.argmax(x)) if self.sampler is None else int(self.sampler(x))
            if not np.isfinite(x[token]):  # float rounding at the top of the cumulative sum
                token = int(np.argmax(x))
        if self.top_logprobs is not None:
            self.records.append(logprob_entry(raw, token, self.top_logprobs))
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.matcher is not None and not self.stopped and token not in self.eog:
            self.matcher.consume_token(token)
            if self.matcher.is_error():
                self.error = self.matcher.get_error()
                self.stopped = True
            elif self.matcher.is_stopped():
                self.stopped = True  # complete: the output ends here
        return token
