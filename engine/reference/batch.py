"""The CPU backend's batched step (the BatchBackend contract of engine/scheduler.py).

KV slots: slot i is one KVCache of the reference model, grown on demand (float32 on the host,
so it is only as long as its longest sequence so far, rounded up to GROW tokens). A step is
one ReferenceModel.hidden_batch over every entry's tokens (the GEMMs over all rows at once,
attention per sequence), then the output projection of the rows whose logits are wanted.

    b = ReferenceBatch(model, n_slots=4, slot_capacity=4096)
    outs = b.run([entry, ...])   # entry: .slot, .ids, .start, .want (None | "argmax" | "logits")
    b.copy_prefix(src, dst, n)   # positions 0..n-1 of slot src -> slot dst

launch() computes the step at once (collect() hands its result back): the host is the device.
An entry with ids == [FOLLOW] feeds the slot's latest argmax, kept per slot as the GPU does.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.reference.model import KVCache, ReferenceModel
from engine.reference.ops import top_two

GROW = 256


class ReferenceBatch:
    device = "cpu"

    def __init__(self, model: ReferenceModel, n_slots: int, slot_capacity: int):
        if n_slots < 1 or slot_capacity < 1:
            raise ValueError(f"batch: {n_slots} slots of {slot_capacity} tokens")
        self.model = model
        self.n_slots = int(n_slots)
        self.slot_capacity = int(slot_capacity)
        self._caches: list[KVCache | None] = [None] * self.n_slots
        self._last = [0] * self.n_slots          # each slot's latest argmax (FOLLOW)

    def _cache(self, slot: int, need: int) -> KVCache:
        """Slot `slot`'s cache, grown to hold `need` positions (contents kept)."""
        if need > self.slot_capacity:
            raise ValueError(f"batch: {need} tokens exceed the slot size {self.slot_capacity}")
        c = self._caches[slot]
        if c is None or c.max_tokens < need:
            cap = min(self.slot_capacity, -(-need // GROW) * GROW)
            new = self.model.new_cache(cap)
            if c is not None:
                new.k[:, :c.max_tokens] = c.k
                new.v[:, :c.max_tokens] = c.v
            c = self._caches[slot] = new
        return c

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        if n <= 0 or src == dst:
            return
        a, b = self._cache(src, n), self._cache(dst, n)
        b.k[:, :n] = a.k[:, :n]
        b.v[:, :n] = a.v[:, :n]

    def run(self, entries: Sequence) -> list:
        return self.collect(self.launch(entries))

    def collect(self, handle: list) -> list:
        return handle

    def launch(self, entries: Sequence) -> list:
        """One forward over the entries' tokens; per entry None, (id, top logit, margin) for
        want == "argmax", or the float32 [vocab] logits for want == "logits"."""
        parts = []
        for e in entries:
            c = self._cache(e.slot, e.start + len(e.ids))
            c.length = e.start
            parts.append(([self._last[e.slot]] if e.follows else e.ids, c))
        h = self.model.hidden_batch(parts)
        ends = np.cumsum([len(e.ids) for e in entries]) - 1
        wanted = [i for i, e in enumerate(entries) if e.want is not None]
        out: list = [None] * len(entries)
        if wanted:
            logits = self.model.logits_of(h[ends[wanted]])
            for j, i in enumerate(wanted):
                if entries[i].want == "argmax":
                    out[i] = top_two(logits[j])
                    self._last[entries[i].slot] = out[i][0]
                else:
                    out[i] = logits[j]
                    self._last[entries[i].slot] = int(np.argmax(logits[j]))
        return out
