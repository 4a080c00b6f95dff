"""`gguf-prefill serve`: check the flags and the model, load it, then listen; drain on SIGTERM.

Order of events, so that "running on" and "ready" are only printed when the server can answer:
1. flags and GGUF_PREFILL_* variables are checked (a bad value: one stderr line, exit 2);
2. the model file is validated and the context size checked against the model's training
   context and a KV-cache memory estimate (refused with the limit named, exit 2);
3. the port is bound (not yet listening: an address in use fails here, before the load);
4. the engine worker thread loads the model, with a progress line every few seconds; SIGTERM
   or SIGINT while loading exits 0 without listening;
5. one log line names the model, architecture, backend, device, resident memory and load time;
   then uvicorn listens and "ready" is logged.
SIGTERM/SIGINT: uvicorn stops accepting, in-flight requests get --shutdown-timeout seconds to
finish; after that, streams get an SSE error event and a clean end, others a JSON 503; then the
worker stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Mapping

from server.settings import Settings, add_serve_arguments

log = logging.getLogger("server")

PROGRESS_FIRST_S = 2.0   # first "still loading" line after this many seconds
PROGRESS_EVERY_S = 5.0   # then one every this many seconds
_HARD_DEADLINE_EXTRA_S = 5.0  # uvicorn's own cancel, after our clean shutdown errors


def _usage_error(e: ValueError):
    """Settings' "field: message" as "--field: message" (the flag the user typed)."""
    from engine.errors import UsageError

    from server.settings import ENV_PREFIX

    text = str(e)
    name, sep, rest = text.partition(": ")
    if sep and name.isidentifier():
        text = f"--{name.replace('_', '-')} (or {ENV_PREFIX}{name.upper()}): {rest}"
    return UsageError(f"serve: {text}")


def _settings(args: Any, kwargs: Mapping[str, Any]) -> Settings:
    try:
        if args is None:
            return Settings.from_env(**kwargs)
        settings = Settings.from_namespace(args)
        return settings.with_(**kwargs) if kwargs else settings
    except ValueError as e:
        raise _usage_error(e) from None
    except TypeError as e:  # a value of the wrong type handed in by a caller
        raise _usage_error(ValueError(str(e))) from None


# ---- memory -----------------------------------------------------------------------------------

def resident_bytes() -> int:
    """This process's resident set size (0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import resource

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        except Exception:  # noqa: BLE001
            return 0


def available_memory(device: str) -> tuple[int | None, str]:
    """Bytes free for the KV cache on `device` ("cpu"/"gpu"): (None, ...) when unknown."""
    if device == "gpu":
        try:
            import cupy

            free, _total = cupy.cuda.runtime.memGetInfo()
            return int(free), "GPU"
        except Exception:  # noqa: BLE001 - the loader will say what is wrong with the GPU
            return None, "GPU"
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    try:  # a container's cgroup v2 limit, when lower
        with open("/sys/fs/cgroup/memory.max") as f:
            raw = f.read().strip()
        if raw != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                used = int(f.read().strip())
            left = max(0, int(raw) - used)
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail, "host"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_context(settings: Settings, cfg: Any, file_bytes: int, device: str) -> int:
    """The context size serve will use, or UsageError naming the limit it is over: the model's
    training context (n_ctx_train), or the memory one full-context KV cache needs (f32 on the
    CPU, f16 on the GPU) on top of the weights."""
    from engine.errors import UsageError

    n_train = int(getattr(cfg, "n_ctx_train", 0) or 0)
    n_ctx = settings.ctx_size or n_train
    flag = f"--ctx-size {settings.ctx_size}" if settings.ctx_size else \
        f"the model's training context ({n_train} tokens)"
    if n_train and n_ctx > n_train:
        raise UsageError(f"serve: --ctx-size {n_ctx} is over the model's training context "
                         f"(n_ctx_train {n_train}); use --ctx-size {n_train} or less "
                         "(0 = the training context)")
    if n_ctx < 1:
        raise UsageError("serve: the model does not say its training context "
                         "(context_length); give --ctx-size N")
    elem = 4 if device == "cpu" else 2
    per_token = 2 * int(cfg.n_layers) * int(cfg.n_kv_heads) * int(cfg.head_dim) * elem
    kv = per_token * n_ctx
    avail, where = available_memory(device)
    if avail is not None and kv + file_bytes > avail:
        fit = max(0, (avail - file_bytes) // per_token) // 256 * 256
        hint = f"use --ctx-size {fit} or less" if fit >= 256 else "not even 256 tokens fit"
        raise UsageError(
            f"serve: {flag} needs a {_gib(kv)} KV cache ({per_token} bytes per token: "
            f"{cfg.n_layers} layers x {cfg.n_kv_heads} KV heads x {cfg.head_dim} x K,V in "
            f"{'f32' if elem == 4 else 'f16'}) plus {_gib(file_bytes)} of weights, but "
            f"{_gib(avail)} of {where} memory is available; {hint}")
    return n_ctx


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    from engine.loader import gpu_available

    return "gpu" if gpu_available() else "cpu"


# ---- listening socket -------------------------------------------------------------------------

def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not listen: connections are refused until uvicorn runs) so that a port in use
    fails before the model loads."""
    from engine.errors import UsageError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"serve: --host {host!r}: {e.strerror or e}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UsageError(f"serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


# ---- loading ----------------------------------------------------------------------------------

def _wait_loaded(runner, model_path: str, stop: threading.Event) -> float | None:
    """Wait for the worker to load the model, logging progress; the load time, or None when a
    signal asked us to stop first."""
    name = os.path.basename(model_path or "the model")
    t0 = time.monotonic()
    next_note = PROGRESS_FIRST_S
    while runner.state == "loading":
        if stop.wait(0.05):
            return None
        elapsed = time.monotonic() - t0
        if elapsed >= next_note:
            log.info("loading %s: %.0f s so far, %s resident", name, elapsed,
                     _gib(resident_bytes()))
            next_note += PROGRESS_EVERY_S
    return time.monotonic() - t0


def startup_line(engine, load_s: float) -> str:
    model = engine.model
    cfg = model.config
    device = getattr(model, "device", None) or "cpu"
    parts = [f"model {engine.model_id}: {getattr(cfg, 'arch', '?')}, "
             f"{getattr(cfg, 'n_layers', '?')} layers, vocab {engine.vocab_size}",
             f"backend {type(model).__name__} on {device}",
             f"n_ctx {engine.n_ctx} (n_ctx_train {engine.n_ctx_train})",
             f"{_gib(resident_bytes())} resident"]
    on_device = getattr(model, "resident_bytes", None)
    if device != "cpu" and isinstance(on_device, int) and on_device:
        parts[-1] += f" + {_gib(on_device)} on the GPU"
    parts.append(f"loaded in {load_s:.1f} s")
    return "; ".join(parts)


def _setup_logging(level: str) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    log.setLevel(getattr(logging, level.upper(), logging.INFO))


# ---- serve ------------------------------------------------------------------------------------

def serve(args: argparse.Namespace | Mapping[str, Any] | Settings | None = None,
          **kwargs: Any) -> int:
    """Run the server until SIGTERM/SIGINT. Returns the exit status (0 after a clean drain).

    Raises UsageError for a bad setting, a context that does not fit or a port in use, and
    GGUFError for a model file that is missing, invalid or fails to load; the CLI turns either
    into one stderr line and exit 2."""
    settings = _settings(args, kwargs)
    _setup_logging(settings.log_level)
    if settings.replicas:
        from server.cluster import require_ray

        require_ray()  # before the model is read: the missing extra is the first thing said

    from engine.formats.weights import open_model
    from server.runner import resolve_model_path

    model_path = resolve_model_path(settings.model)
    model_file = open_model(model_path)  # container problems fail fast, before the load
    file_bytes = os.path.getsize(model_path)
    device = _resolve_device(settings.device)
    check_context(settings, model_file.config, file_bytes, device)
    del model_file
    settings = settings.with_(model=model_path)
    if settings.replicas:  # N engine replicas behind a front, on Ray Serve (server.cluster)
        from server.cluster.cli import serve_cluster

        bind_socket(settings.host, settings.port).close()  # a port in use fails here, not in Ray
        return serve_cluster(settings.with_(device=device))
    sock = bind_socket(settings.host, settings.port)
    try:
        return _serve_bound(settings, sock)
    finally:
        sock.close()


def serve_app(app, settings: Settings) -> int:
    """Serve an app made by server.app.create_app (with its engine or loader) exactly as
    `serve` does: same protocol, timeouts, shutdown and logging (for embedding and tests)."""
    _setup_logging(settings.log_level)
    sock = bind_socket(settings.host, settings.port)
    try:
        return _serve_bound(settings, sock, app)
    finally:
        sock.close()


def _serve_bound(settings: Settings, sock: socket.socket, app=None) -> int:
    import uvicorn

    from server.app import create_app
    from server.protocol import make_protocol

    if app is None:
        app = create_app(settings)
    runner = app.state.runner

    stop = threading.Event()
    handlers = {}
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:
        for sig in (signal.SIGTERM, signal.SIGINT):
            handlers[sig] = signal.signal(sig, lambda *_: stop.set())
    if runner.state == "loading":
        log.info("loading %s (device %s) ...", settings.model, settings.device)
    runner.start()
    try:
        load_s = _wait_loaded(runner, settings.model, stop)
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)
    if load_s is None:
        log.info("interrupted while loading the model; exiting")
        runner.stop(timeout=1.0)
        return 0
    if runner.state == "failed":
        err = runner.load_error
        if isinstance(err, Exception):
            raise err
        return 1
    log.info("%s", startup_line(runner.engine, load_s))

    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level,
        lifespan="on", access_log=settings.log_level == "debug",
        http=make_protocol(settings.header_timeout, settings.max_connections),
        timeout_keep_alive=settings.keep_alive_timeout,
        timeout_graceful_shutdown=settings.shutdown_timeout + _HARD_DEADLINE_EXTRA_S)
    server = _DrainingServer(config, runner, app.state.lifecycle, settings)
    try:
        server.run(sockets=[sock])
    except SystemExit as e:  # uvicorn gives up on startup (it has logged why)
        return int(e.code) if isinstance(e.code, int) else 1
    if runner.load_error is not None:
        err = runner.load_error
        if isinstance(err, Exception):
            raise err
        return 1
    if not server.started:
        return 1
    return 0


class _DrainingServer:
    """uvicorn.Server whose SIGTERM handler first marks the runner as draining (requests that
    still arrive on open keep-alive connections get a clean 503) and starts the shutdown
    deadline, logs "ready" once listening, and exits 0."""

    def __new__(cls, config, runner, lifecycle, settings: Settings):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # noqa: D401 - uvicorn hook
                # Not super(): uvicorn records the signal and re-raises it after shutdown,
                # which would turn a clean drain into death-by-SIGTERM (exit status -15).
                runner.begin_drain()
                lifecycle.begin_shutdown(settings.shutdown_timeout)
                if self.should_exit:
                    self.force_exit = True  # a second signal: stop waiting
                else:
                    self.should_exit = True

            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                if self.started and not self.should_exit:
                    if sockets:
                        self._log_started_message(sockets)  # "Uvicorn running on http://..."
                    host, port = (sockets[0].getsockname()[:2] if sockets
                                  else (settings.host, settings.port))
                    log.info("ready: model %s answers on http://%s:%d", runner.engine.model_id,
                             f"[{host}]" if ":" in str(host) else host, port)

        return Server(config)


# ---- entry point ------------------------------------------------------------------------------

class _OneLineParser(argparse.ArgumentParser):
    """argparse errors as one stderr line (no usage block), exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser(prog: str = "gguf-prefill serve") -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=prog, description="OpenAI-compatible HTTP server for gguf-prefill. Every flag "
                               "also reads a GGUF_PREFILL_* variable (flag > variable > default).")
    add_serve_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`gguf-prefill serve ...` / `python -m server ...`: parse, serve, and turn every bad
    input (flag, variable, model file, port) into one stderr line and exit status 2."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    from engine.errors import GGUFError, UsageError

    from server.cluster import ClusterUnavailable

    try:
        return serve(ns)
    except ClusterUnavailable as e:
        parser.error(str(e))  # "gguf-prefill serve: error: ...", exit 2
    except (GGUFError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""),
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
