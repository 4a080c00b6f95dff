"""Scale-out over Ray Serve (issue 16): `gguf-prefill serve --replicas N`.

Modules (Ray is imported only by the last three, and only when --replicas is used):
    prefix_router  the prefix-aware replica choice, plain Python (block hashes, per-replica LRU,
                   least-loaded fallback)
    asgi_call      one HTTP request through an ASGI app in-process (how a replica answers)
    front_metrics  the front's /metrics: routing decisions + every replica's metrics, labelled
    ray_router     the Ray Serve RequestRouter running prefix_router's rule
    deployments    the Serve application: EngineReplica x N behind Front
    cli            `serve --replicas`: start (or join) Ray, run the application, wait for SIGTERM
"""

from __future__ import annotations

from typing import Any

RAY_REQUIREMENT = "ray[serve]>=2.40"


class ClusterUnavailable(Exception):
    """--replicas was asked for but Ray Serve cannot be imported (message: what to install)."""


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
        from ray.serve.request_router import RequestRouter  # noqa: F401
    except ImportError as e:
        raise ClusterUnavailable(
            f"--replicas needs Ray Serve ({RAY_REQUIREMENT}), which is not installed or too old "
            f"({e}); pip install 'gguf-prefill[cluster]'") from None


def replica_options(settings) -> dict[str, Any]:
    """The engine deployment's Serve options from the serve settings: a fixed --replicas, or
    autoscaling between --min-replicas and --max-replicas starting at --replicas (target: the
    replica's --parallel requests in flight); one GPU per replica on the GPU backend, one CPU
    on the numpy backend; a replica takes up to --parallel + --max-queue requests."""
    gpu = settings.device == "gpu"
    opts: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": 1 if gpu else 0, "num_cpus": 1},
        "max_ongoing_requests": settings.parallel + settings.max_queue,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": settings.shutdown_timeout,
    }
    lo = settings.min_replicas or settings.replicas
    hi = settings.max_replicas or settings.replicas
    if lo == hi == settings.replicas:
        opts["num_replicas"] = settings.replicas
    else:
        opts["autoscaling_config"] = {
            "min_replicas": lo, "max_replicas": hi, "initial_replicas": settings.replicas,
            "target_ongoing_requests": settings.parallel}
    return opts
