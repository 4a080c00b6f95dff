"""`gguf-prefill serve`: validate the model file, start uvicorn, drain on SIGTERM.

The model loads on the engine worker thread after the socket is listening, so /health answers
503 while loading. SIGTERM/SIGINT: uvicorn stops accepting, in-flight requests get up to
--shutdown-timeout seconds to finish, then the worker is stopped and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Mapping

from server.settings import Settings, add_serve_arguments


def serve(args: argparse.Namespace | Mapping[str, Any] | Settings | None = None,
          **kwargs: Any) -> int:
    """Run the server until SIGTERM/SIGINT. Returns the exit status (0 after a clean drain).

    Raises GGUFError for a model file that is missing or invalid (checked before listening) or
    that fails to load afterwards; the CLI turns that into one stderr line and exit 2."""
    import uvicorn

    from server.app import create_app
    from server.runner import open_model_file, resolve_model_path

    if args is None:
        settings = Settings.from_env(**kwargs)
    else:
        settings = Settings.from_namespace(args)
        if kwargs:
            settings = settings.with_(**kwargs)
    model_path = resolve_model_path(settings.model)
    open_model_file(model_path)  # container problems fail fast, before the port opens
    settings = settings.with_(model=model_path)

    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level,
                            timeout_graceful_shutdown=settings.shutdown_timeout,
                            lifespan="on", access_log=settings.log_level == "debug")
    server = _DrainingServer(config, app.state.runner)

    def load_failed(exc: BaseException) -> None:
        server.should_exit = True

    app.state.runner.on_load_failed = load_failed
    server.run()
    runner = app.state.runner
    if runner.load_error is not None:
        err = runner.load_error
        if isinstance(err, Exception):
            raise err
        return 1
    if not server.started:
        return 1  # e.g. the port was taken; uvicorn has logged why
    return 0


class _DrainingServer:
    """uvicorn.Server whose SIGTERM handler first marks the runner as draining, so requests
    that still arrive on open keep-alive connections get a clean 503, and which exits 0."""

    def __new__(cls, config, runner):
        import uvicorn

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # noqa: D401 - uvicorn hook
                # Not super(): uvicorn records the signal and re-raises it after shutdown,
                # which would turn a clean drain into death-by-SIGTERM (exit status -15).
                runner.begin_drain()
                if self.should_exit:
                    self.force_exit = True  # a second signal: stop waiting
                else:
                    self.should_exit = True

        return Server(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server",
                                     description="OpenAI-compatible HTTP server for gguf-prefill")
    add_serve_arguments(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        settings = Settings.from_namespace(ns)
    except ValueError as e:
        parser.error(str(e))
    try:
        return serve(settings)
    except Exception as e:  # GGUFError and friends: one line, exit 2 (like the CLI)
        from engine.errors import GGUFError, UsageError

        if isinstance(e, (GGUFError, UsageError, OSError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    raise SystemExit(main())
