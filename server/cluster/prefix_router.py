"""Prefix-aware replica choice, in plain Python (no Ray): unit-tested alone, driven by the Ray
Serve request router (server.cluster.ray_router).

The rule (as SGLang's router and llm-d route): a prompt's token ids are cut into blocks of
`block_size` tokens and each full block gets a chained hash (block i's hash covers blocks 0..i,
as vLLM's block hashing), so one hash names a whole prefix. Every replica keeps a bounded LRU of
the block hashes of the prompts routed to it: what its slot prompt cache probably still holds.
A request goes to the replica holding the longest run of its leading blocks ("prefix"), unless
that replica has `imbalance` more requests in flight than the least loaded one; with no match
(or a prompt shorter than one block) it goes to the replica with the fewest requests in flight,
ties to the one chosen least recently ("least_loaded").
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_BLOCKS = 8192   # per replica: 131,072 prompt tokens remembered
DEFAULT_IMBALANCE = 16      # in-flight requests over the least loaded before affinity yields

PREFIX = "prefix"
LEAST_LOADED = "least_loaded"
REASONS = (PREFIX, LEAST_LOADED)


def block_hashes(ids: Sequence[int] | None, block_size: int = DEFAULT_BLOCK_SIZE) -> list[bytes]:
    """Chained hashes of the full blocks of `ids` (a trailing partial block is not hashed):
    h[i] = blake2b(h[i-1] + the block's ids as int64). Stable across processes (no hash())."""
    if not ids or block_size < 1:
        return []
    out: list[bytes] = []
    prev = b""
    for start in range(0, len(ids) - block_size + 1, block_size):
        block = ids[start:start + block_size]
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(struct.pack(f"<{len(block)}q", *(int(t) for t in block)))
        prev = h.digest()
        out.append(prev)
    return out


@dataclass
class Decision:
    """Where a request should go: `ranking` (best first), the preferred `replica`, `reason`,
    the number of leading blocks that replica holds, and the request's block hashes."""
    replica: str | None
    reason: str
    matched_blocks: int
    ranking: list[str]
    hashes: list[bytes] = field(default_factory=list)


class _Replica:
    __slots__ = ("blocks", "inflight", "last_chosen")

    def __init__(self) -> None:
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.inflight = 0
        self.last_chosen = 0


class PrefixRouter:
    """Per-replica LRU of served block hashes + in-flight counts -> a Decision per request."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 imbalance: int = DEFAULT_IMBALANCE):
        if block_size < 1 or max_blocks < 1 or imbalance < 0:
            raise ValueError("block_size and max_blocks must be >= 1, imbalance >= 0")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.imbalance = imbalance
        self._replicas: dict[str, _Replica] = {}
        self._clock = 0
        self.routed: dict[tuple[str, str], int] = {}   # (replica, reason) -> requests

    # ---- the replica set
    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def set_replicas(self, ids: Iterable[str]) -> None:
        """The live replica set: new ones start empty, gone ones are forgotten."""
        keep = list(ids)
        for rid in keep:
            self._replicas.setdefault(rid, _Replica())
        for rid in list(self._replicas):
            if rid not in keep:
                del self._replicas[rid]

    def remove_replica(self, rid: str) -> None:
        self._replicas.pop(rid, None)

    def inflight(self, rid: str) -> int:
        r = self._replicas.get(rid)
        return r.inflight if r is not None else 0

    def cached_blocks(self, rid: str) -> int:
        r = self._replicas.get(rid)
        return len(r.blocks) if r is not None else 0

    # ---- choosing
    def matched_blocks(self, rid: str, hashes: Sequence[bytes]) -> int:
        r = self._replicas.get(rid)
        if r is None:
            return 0
        n = 0
        for h in hashes:  # chained: the first miss ends the shared prefix
            if h not in r.blocks:
                break
            n += 1
        return n

    def choose(self, ids: Sequence[int] | None, candidates: Iterable[str] | None = None) -> Decision:
        """Rank `candidates` (default: every known replica) for a prompt of token `ids`."""
        cands = [c for c in (self._replicas if candidates is None else candidates)]
        for c in cands:
            self._replicas.setdefault(c, _Replica())
        hashes = block_hashes(ids, self.block_size)
        if not cands:
            return Decision(None, LEAST_LOADED, 0, [], hashes)

        def load_key(rid: str):
            r = self._replicas[rid]
            return (r.inflight, r.last_chosen)

        by_load = sorted(cands, key=load_key)
        least = self._replicas[by_load[0]].inflight
        best, best_n = None, 0
        if hashes:
            for rid in by_load:          # ties in match length go to the less loaded
                n = self.matched_blocks(rid, hashes)
                if n > best_n:
                    best, best_n = rid, n
        if best is not None and self._replicas[best].inflight - least <= self.imbalance:
            ranking = [best] + [r for r in by_load if r != best]
            return Decision(best, PREFIX, best_n, ranking, hashes)
        return Decision(by_load[0], LEAST_LOADED, 0, by_load, hashes)

    # ---- what happened
    def routed_to(self, rid: str, decision: Decision | None) -> str:
        """The request of `decision` went to `rid`: count it, remember its blocks there, one
        more in flight. Returns the reason recorded ("prefix" only when it went where its
        prefix is)."""
        r = self._replicas.setdefault(rid, _Replica())
        reason = LEAST_LOADED
        if decision is not None and decision.reason == PREFIX and decision.replica == rid:
            reason = PREFIX
        self._clock += 1
        r.last_chosen = self._clock
        r.inflight += 1
        if decision is not None:
            self._remember(r, decision.hashes)
        self.routed[(rid, reason)] = self.routed.get((rid, reason), 0) + 1
        return reason

    def unroute(self, rid: str, reason: str) -> None:
        """Take back a routed_to (a placement that did not happen after all); the blocks stay
        remembered (harmless: the next request of that prefix checks again)."""
        r = self._replicas.get(rid)
        if r is not None and r.inflight > 0:
            r.inflight -= 1
        n = self.routed.get((rid, reason), 0)
        if n > 1:
            self.routed[(rid, reason)] = n - 1
        else:
            self.routed.pop((rid, reason), None)

    def finished(self, rid: str) -> None:
        r = self._replicas.get(rid)
        if r is not None and r.inflight > 0:
            r.inflight -= 1

    def _remember(self, r: _Replica, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            r.blocks[h] = None
            r.blocks.move_to_end(h)
        while len(r.blocks) > self.max_blocks:
            r.blocks.popitem(last=False)
