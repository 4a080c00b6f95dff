"""Server settings: `serve` flags, each mirrored by a GGUF_PREFILL_* environment variable.

Precedence: command-line flag > environment variable > default. This module imports nothing
heavy (no FastAPI, no numpy) so `gguf-prefill --help` stays fast; the CLI calls
`add_serve_arguments(parser)` and hands the parsed namespace to `server.main.serve`.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

ENV_PREFIX = "GGUF_PREFILL_"

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_MAX_QUEUE = 128
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any prompt that fits a context window
DEFAULT_MAX_INPUT_CHARS = 1 << 18  # 262,144 characters of text per request (~8 per token at 32k)
DEFAULT_MAX_CONNECTIONS = 512  # open client connections; more get a JSON 503 and are closed
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0  # seconds an idle keep-alive connection stays open
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds from connection (or the previous response) to headers
DEFAULT_BODY_TIMEOUT = 30.0  # seconds to receive the whole request body
DEFAULT_PARALLEL = 8  # sequences in flight (KV slots)
DEFAULT_MAX_BATCH_TOKENS = 512  # tokens per engine step (decodes + prompt chunks)
MAX_REPLICAS = 1024  # engine replicas behind the Ray Serve front (server.cluster)


@dataclass(frozen=True)
class Settings:
    model: str | None = None  # None: the default model (engine.tools.fetch)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    ctx_size: int = 0  # 0: the model's training context (n_ctx_train)
    api_key: str | None = None
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting behind the one being served
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT  # seconds to drain on SIGTERM
    device: str = "auto"  # "auto" | "cpu" | "gpu"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_level: str = "info"
    max_input_chars: int = DEFAULT_MAX_INPUT_CHARS  # text in one request body; more -> 413
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    parallel: int = DEFAULT_PARALLEL
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    kv_cache_tokens: int = 0  # 0: parallel x ctx_size (GPU: what free memory holds)
    replicas: int = 0  # engine replicas over Ray Serve (server.cluster); 0: this process serves
    min_replicas: int = 0  # autoscaling lower bound; 0: = replicas
    max_replicas: int = 0  # autoscaling upper bound; 0: = replicas

    def __post_init__(self) -> None:
        for name in _INT_FIELDS | _FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{name}: {v!r} is not a number")
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{name}: {v!r} is not a finite number")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not in 0..65535")
        if self.ctx_size < 0:
            raise ValueError(f"ctx_size: {self.ctx_size} must be >= 0 (0 = model's n_ctx_train)")
        if self.max_queue < 1:
            raise ValueError(f"max_queue: {self.max_queue} must be >= 1")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout: {self.shutdown_timeout} must be >= 0")
        if self.device not in ("auto", "cpu", "gpu"):
            raise ValueError(f"device: {self.device!r} is not one of auto, cpu, gpu")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: {self.max_body_bytes} must be >= 1024")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.max_input_chars < 1:
            raise ValueError(f"max_input_chars: {self.max_input_chars} must be >= 1")
        if self.max_connections < 1:
            raise ValueError(f"max_connections: {self.max_connections} must be >= 1")
        if not 1 <= self.parallel <= MAX_PARALLEL:
            raise ValueError(f"parallel: {self.parallel} must be in 1..{MAX_PARALLEL}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens: {self.max_batch_tokens} must be >= 1")
        if self.kv_cache_tokens < 0:
            raise ValueError(f"kv_cache_tokens: {self.kv_cache_tokens} must be >= 0 (0 = auto)")
        if self.kv_cache_tokens and self.kv_cache_tokens < self.parallel:
            raise ValueError(f"kv_cache_tokens: {self.kv_cache_tokens} is fewer than one token for "
                             f"each of the {self.parallel} slots (parallel)")
        self._check_replicas()
        for name in ("keep_alive_timeout", "header_timeout", "body_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: {getattr(self, name)} must be > 0 seconds")
        if self.api_key == "":
            object.__setattr__(self, "api_key", None)

    def _check_replicas(self) -> None:
        for name in ("replicas", "min_replicas", "max_replicas"):
            if not 0 <= getattr(self, name) <= MAX_REPLICAS:
                raise ValueError(f"{name}: {getattr(self, name)} must be in 0..{MAX_REPLICAS}")
        if not self.replicas:
            for name in ("min_replicas", "max_replicas"):
                if getattr(self, name):
                    raise ValueError(f"{name}: {getattr(self, name)} needs --replicas N (the "
                                     "replicas to start with)")
            return
        lo = self.min_replicas or self.replicas
        hi = self.max_replicas or self.replicas
        if lo > self.replicas:
            raise ValueError(f"min_replicas: {lo} is more than replicas ({self.replicas})")
        if hi < self.replicas:
            raise ValueError(f"max_replicas: {hi} is fewer than replicas ({self.replicas})")

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Defaults, then GGUF_PREFILL_* variables, then `overrides` (values that are None are
        treated as "not given")."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _convert(f.name, raw, f"{ENV_PREFIX}{f.name.upper()}")
        for name, value in overrides.items():
            if name not in _FIELD_NAMES:
                continue  # the CLI namespace carries other verbs' attributes
            if value is not None:
                values[name] = value
        return cls(**values)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace | Mapping[str, Any] | "Settings",
                       environ: Mapping[str, str] | None = None) -> "Settings":
        if isinstance(ns, Settings):
            return ns
        items = dict(ns) if isinstance(ns, Mapping) else vars(ns)
        return cls.from_env(environ, **items)

    def with_(self, **changes: Any) -> "Settings":
        return replace(self, **changes)


_FIELD_NAMES = {f.name for f in fields(Settings)}
_INT_FIELDS = {"port", "ctx_size", "max_queue", "max_body_bytes", "max_input_chars",
               "max_connections", "parallel", "max_batch_tokens", "kv_cache_tokens",
               "replicas", "min_replicas", "max_replicas"}
MAX_PARALLEL = 256
_FLOAT_FIELDS = {"shutdown_timeout", "keep_alive_timeout", "header_timeout", "body_timeout"}
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _convert(name: str, raw: str, source: str) -> Any:
    try:
        if name in _INT_FIELDS:
            return int(raw)
        if name in _FLOAT_FIELDS:
            return float(raw)
    except ValueError:
        kind = "an integer" if name in _INT_FIELDS else "a number"
        raise ValueError(f"{source}={raw[:40]!r}: not {kind}") from None
    return raw


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `serve` flags. Every default is None so that an unset flag falls back to its
    GGUF_PREFILL_* variable, then to the Settings default."""
    env = ENV_PREFIX
    parser.add_argument("-m", "--model", default=None, metavar="PATH",
                        help=f"GGUF model file (env {env}MODEL; default: the default model)")
    parser.add_argument("--host", default=None,
                        help=f"address to listen on (env {env}HOST; default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=None,
                        help=f"TCP port (env {env}PORT; default {DEFAULT_PORT})")
    parser.add_argument("-c", "--ctx-size", dest="ctx_size", type=int, default=None, metavar="N",
                        help=f"context size in tokens, prompt + generated (env {env}CTX_SIZE; "
                             "default 0 = the model's training context)")
    parser.add_argument("--api-key", dest="api_key", default=None, metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on every route but /health "
                             f"(env {env}API_KEY; default none: no key needed)")
    parser.add_argument("--max-queue", dest="max_queue", type=int, default=None, metavar="N",
                        help=f"requests that may wait behind the running one; more get 429 "
                             f"(env {env}MAX_QUEUE; default {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--shutdown-timeout", dest="shutdown_timeout", type=float, default=None,
                        metavar="SECONDS",
                        help=f"on SIGTERM, seconds to let in-flight requests finish; then streams get "
                             f"an error event and others a 503 "
                             f"(env {env}SHUTDOWN_TIMEOUT; default {DEFAULT_SHUTDOWN_TIMEOUT:g})")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default=None,
                        help=f"backend (env {env}DEVICE; default auto: GPU when present)")
    parser.add_argument("--max-body-bytes", dest="max_body_bytes", type=int, default=None,
                        metavar="N", help=f"largest request body; bigger gets 413 "
                                          f"(env {env}MAX_BODY_BYTES; default {DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--log-level", dest="log_level", default=None,
                        choices=LOG_LEVELS,
                        help=f"log level (env {env}LOG_LEVEL; default info)")
    parser.add_argument("--max-input-chars", dest="max_input_chars", type=int, default=None,
                        metavar="N", help=f"most characters of text (all strings together) in one "
                                          f"request; more gets 413 (env {env}MAX_INPUT_CHARS; "
                                          f"default {DEFAULT_MAX_INPUT_CHARS})")
    parser.add_argument("--max-connections", dest="max_connections", type=int, default=None,
                        metavar="N", help=f"open client connections; one more gets a 503 and is "
                                          f"closed (env {env}MAX_CONNECTIONS; "
                                          f"default {DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--keep-alive-timeout", dest="keep_alive_timeout", type=float,
                        default=None, metavar="SECONDS",
                        help=f"close a keep-alive connection idle this long (env "
                             f"{env}KEEP_ALIVE_TIMEOUT; default {DEFAULT_KEEP_ALIVE_TIMEOUT:g})")
    parser.add_argument("--header-timeout", dest="header_timeout", type=float, default=None,
                        metavar="SECONDS",
                        help=f"a request's line and headers must arrive within this many seconds "
                             f"of the connection opening (or of the previous response); else 408 "
                             f"and close (env {env}HEADER_TIMEOUT; default {DEFAULT_HEADER_TIMEOUT:g})")
    parser.add_argument("--body-timeout", dest="body_timeout", type=float, default=None,
                        metavar="SECONDS",
                        help=f"the whole request body must arrive within this many seconds after "
                             f"the headers; else 408 and close (env {env}BODY_TIMEOUT; "
                             f"default {DEFAULT_BODY_TIMEOUT:g})")
    parser.add_argument("-np", "--parallel", dest="parallel", type=int, default=None, metavar="N",
                        help=f"sequences decoded together, each in its own KV slot; more requests "
                             f"wait in the queue (env {env}PARALLEL; default {DEFAULT_PARALLEL})")
    parser.add_argument("--max-batch-tokens", dest="max_batch_tokens", type=int, default=None,
                        metavar="N", help=f"tokens per engine step: one per decoding sequence, the "
                                          f"rest prompt chunks (env {env}MAX_BATCH_TOKENS; "
                                          f"default {DEFAULT_MAX_BATCH_TOKENS})")
    parser.add_argument("--kv-cache-tokens", dest="kv_cache_tokens", type=int, default=None,
                        metavar="N", help=f"positions of the shared KV cache, split evenly over the "
                                          f"slots; a request's context is at most one slot "
                                          f"(env {env}KV_CACHE_TOKENS; default 0 = parallel x "
                                          f"ctx-size, on the GPU shrunk to fit free memory)")
    parser.add_argument("--replicas", dest="replicas", type=int, default=None, metavar="N",
                        help=f"serve through N engine replicas on Ray Serve (one GPU each on "
                             f"--device gpu), behind one front with prefix-aware routing; needs "
                             f"pip install 'gguf-prefill[cluster]'; joins the Ray cluster of "
                             f"RAY_ADDRESS, else starts a local one (env {env}REPLICAS; "
                             f"default 0 = this process serves)")
    parser.add_argument("--min-replicas", dest="min_replicas", type=int, default=None,
                        metavar="N", help=f"with --replicas: autoscaling lower bound; Ray Serve "
                                          f"scales on --parallel requests in flight per replica "
                                          f"(env "
                                          f"{env}MIN_REPLICAS; default 0 = --replicas)")
    parser.add_argument("--max-replicas", dest="max_replicas", type=int, default=None,
                        metavar="N", help=f"with --replicas: autoscaling upper bound (env "
                                          f"{env}MAX_REPLICAS; default 0 = --replicas)")
    return parser
