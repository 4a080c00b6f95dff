"""The Ray Serve request router of the engine deployment: server.cluster.prefix_router's rule
inside Ray Serve's custom RequestRouter interface (ray.serve.request_router, Ray >= 2.46).

It runs in the process that holds the DeploymentHandle (the front). A request's handle call
carries `route_ids` (the prompt's token ids, or None) and optionally `target` (a replica id:
used by the front to ask one given replica for its metrics). choose_replicas returns a ranking,
one replica per rank; Ray Serve takes the first that accepts. When the request's future
resolves the decision is recorded (counter per replica and reason, blocks remembered, one more
in flight); on_request_completed takes it back out of flight.
"""

from __future__ import annotations

import importlib
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from server.cluster.prefix_router import (DEFAULT_BLOCK_SIZE, DEFAULT_IMBALANCE,
                                          DEFAULT_MAX_BLOCKS, Decision, PrefixRouter)

# The routers of this process by deployment name (the front reads decisions and replica ids).
ROUTERS: dict[str, "PrefixAffinityRequestRouter"] = {}


class PrefixAffinityRequestRouter(RequestRouter):
    def initialize_state(self, block_size: int = DEFAULT_BLOCK_SIZE,
                         max_blocks: int = DEFAULT_MAX_BLOCKS,
                         imbalance: int = DEFAULT_IMBALANCE, **_: Any) -> None:
        self.prefix = PrefixRouter(block_size, max_blocks, imbalance)
        self._hooked: dict[str, Any] = {}            # internal request id -> its future
        self._placed: dict[str, tuple[str, str]] = {}  # request id -> (replica, reason) in flight
        # Ray Serve may ship this class by value (cloudpickle), with its own copy of this
        # module's globals: register in the imported module, where the front looks.
        importlib.import_module(__name__).ROUTERS[self._deployment_id.name] = self

    # ---- Ray Serve hooks
    def update_replicas(self, replicas: List[RunningReplica]):
        out = super().update_replicas(replicas)
        self.prefix.set_replicas(r.replica_id.unique_id for r in replicas)
        return out

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.prefix.remove_replica(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("target")
        if target:
            return [[by_id[target]]] if target in by_id else []
        decision = self.prefix.choose(kwargs.get("route_ids"), list(by_id))
        if pending_request is not None:
            self._track(pending_request, decision)
        return [[by_id[rid]] for rid in decision.ranking]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        placed = self._placed.pop(internal_request_id, None)
        if placed is not None:
            self.prefix.finished(placed[0])

    # ---- bookkeeping
    def _track(self, pr: PendingRequest, decision: Decision) -> None:
        """Count the request where it is meant to go at once (routing tasks run concurrently:
        the next choice must see this one in flight), then correct it when Ray Serve's choice
        is known (the first rank that accepts; usually the first)."""
        req = pr.metadata.internal_request_id
        prev = self._placed.pop(req, None)       # a retry: the earlier plan did not happen
        if prev is not None:
            self.prefix.unroute(*prev)
        if decision.replica is not None:
            reason = self.prefix.routed_to(decision.replica, decision)
            self._placed[req] = (decision.replica, reason)
        fut = pr.future
        if self._hooked.get(req) is fut:
            return
        self._hooked[req] = fut

        def done(f) -> None:
            if self._hooked.get(req) is f:
                self._hooked.pop(req, None)
            if f.cancelled() or f.exception() is not None:
                placed = self._placed.pop(req, None)
                if placed is not None:
                    self.prefix.unroute(*placed)
                return
            rid = f.result().replica_id.unique_id
            placed = self._placed.get(req)
            if placed is not None and placed[0] != rid:
                self.prefix.unroute(*placed)
                self._placed[req] = (rid, self.prefix.routed_to(rid, None))

        fut.add_done_callback(done)

    def replica_ids(self) -> list[str]:
        return [rid.unique_id for rid in self.curr_replicas]
