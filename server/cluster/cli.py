"""`gguf-prefill serve --replicas N`: the settings are checked and the model file validated by
server.main; here Ray is started (or joined, with RAY_ADDRESS), Serve's HTTP proxy listens on
--host/--port, the application of server.cluster.deployments runs, and the process waits.
SIGTERM/SIGINT: Serve shuts down (replicas get --shutdown-timeout to finish), Ray stops, exit 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from server.settings import Settings

log = logging.getLogger("server")



class _Interrupted(Exception):
    """SIGTERM/SIGINT before the application was running."""


def serve_cluster(settings: Settings) -> int:
    from engine.errors import UsageError

    import ray
    from ray import serve

    from server.cluster.deployments import FRONT, build

    address = os.environ.get("RAY_ADDRESS") or None
    init = {"address": address, "logging_level": logging.WARNING, "log_to_driver": False}
    if address is None:
        init["include_dashboard"] = False
    ray.init(**init)
    # after ray.init, whose own SIGTERM handler would abort the process: a signal before the
    # application runs interrupts the start-up, after it ends the wait; both shut down cleanly
    stop = threading.Event()
    handlers = {}

    def on_signal(*_):
        stop.set()
        if not running.is_set():
            running.set()  # once: a second signal during the shutdown changes nothing
            raise _Interrupted()

    running = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, on_signal)
    try:
        try:
            serve.start(http_options={"host": settings.host, "port": settings.port})
        except Exception as e:  # noqa: BLE001 - e.g. the port is in use
            raise UsageError(f"serve: cannot start Ray Serve's proxy on "
                             f"{settings.host}:{settings.port}: {e}") from None
        log.info("starting %d engine replica(s) of %s on Ray (%s) ...", settings.replicas,
                 settings.model, "GPU, 1 each" if settings.device == "gpu" else "CPU")
        serve.run(build(settings), name="gguf-prefill", route_prefix="/", blocking=False)
        running.set()
        log.info("ready: %d replica(s) answer on http://%s:%d (front: %s)", settings.replicas,
                 settings.host, settings.port, FRONT)
        while not stop.wait(0.5):
            pass
        log.info("shutting down Ray Serve (in-flight requests get %g s)",
                 settings.shutdown_timeout)
        return 0
    except _Interrupted:
        log.info("interrupted while starting; shutting down")
        return 0
    finally:
        running.set()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for sig, old in handlers.items():
                signal.signal(sig, old)
