"""One JSON error shape everywhere: {"error": {"code": <http status>, "type": ..., "message": ...}}.

Covers our own APIError (with Retry-After on 429 and on the loading 503), FastAPI's
request-validation 422s (the message names the field), Starlette's 404/405, and the body guard
that runs before FastAPI sees the request: 413 (bytes or characters over the limit), 408 (body
too slow), 400 naming every kind of parse error. Types follow llama-server's names.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import sys

import anyio.to_thread
from typing import Any, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import printable

log = logging.getLogger("server")

TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str | None = None, **extra: Any):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or TYPE_BY_STATUS.get(status, "server_error")
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.type, **self.extra)


def error_body(status: int, message: str, type: str | None = None, **extra: Any) -> dict[str, Any]:
    err = {"code": status, "type": type or TYPE_BY_STATUS.get(status, "server_error"),
           "message": message}
    err.update(extra)
    return {"error": err}


def error_response(status: int, message: str, type: str | None = None,
                   headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(error_body(status, message, type, **extra), status_code=status,
                        headers=headers)


def retry_after(exc: APIError) -> dict[str, str] | None:
    """Retry-After for the statuses a client should retry: 429 (queue full) at once-ish, 503
    while the model loads a little later. Not while shutting down or after a failed load."""
    if exc.status == 429:
        return {"Retry-After": "1"}
    if exc.status == 503 and exc.message.startswith("Loading"):
        return {"Retry-After": "5"}
    return None


def format_validation_errors(errors: Iterable[dict[str, Any]]) -> str:
    """'max_tokens: Input should be a valid integer; messages.0.role: Field required'."""
    parts: list[str] = []
    seen: set[str] = set()
    for e in errors:
        # union members show up as extra loc elements ('str', 'list[constrained-int]',
        # 'TextPart'): drop them so the path is the field as the client wrote it
        loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _is_type_tag(x)]
        field = ".".join(loc) if loc else "body"
        msg = e.get("msg", "invalid value")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        text = f"{field}: {msg}"
        if text not in seen:
            seen.add(text)
            parts.append(text)
    return "; ".join(parts) if parts else "invalid request"


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*|"
                       r"(function|constrained|literal)[-\[].*)$")


def _is_type_tag(x: Any) -> bool:
    return isinstance(x, str) and bool(_TYPE_TAG.match(x))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=retry_after(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            # the body guard catches this first; kept for bodies it does not inspect
            return error_response(400, "request body is not valid JSON")
        return error_response(422, format_validation_errors(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"not found: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            method = request.scope.get("gguf_prefill.method") or request.method  # HEAD -> GET
            message = f"method {method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


# ---- ASGI middleware -------------------------------------------------------------------------

async def _send_json(send, status: int, body: dict[str, Any],
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    hdrs += headers or []
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data})


class AuthMiddleware:
    """With an API key set, every route but /health needs 'Authorization: Bearer KEY'
    (or 'X-Api-Key: KEY'); otherwise 401 in the common error shape."""

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.key is None or scope["path"] in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = None
        auth = headers.get(b"authorization")
        if auth is not None:
            scheme, _, value = auth.partition(b" ")
            if scheme.lower() == b"bearer":
                given = value.strip()
        if given is None:
            given = headers.get(b"x-api-key")
        if given is None:
            return await _send_json(send, 401, error_body(
                401, "missing API key: send 'Authorization: Bearer <key>'"),
                [(b"www-authenticate", b"Bearer")])
        if not hmac.compare_digest(given, self.key):
            return await _send_json(send, 401, error_body(401, "invalid API key"),
                                    [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


MAX_JSON_DEPTH = 64  # arrays/objects inside each other; no request of ours needs more than 4
_THREAD_PARSE_BYTES = 64 * 1024  # bigger bodies are checked off the event loop


class BodyError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class _BadNumber(ValueError):
    pass


def _reject_constant(name: str):
    raise _BadNumber(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _BadNumber(f"number {text[:40]} is out of range for a double")
    return value


def _json_kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def check_json_body(body: bytes, max_chars: int | None = None,
                    max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """The request body as a JSON object, or BodyError(400 naming the problem, or 413 for more
    than `max_chars` characters of text in all its strings together)."""
    if not body.strip():
        raise BodyError(400, "request body is empty: send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"request body is not valid UTF-8 (byte {e.start}: "
                             f"{body[e.start:e.start + 1]!r})") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise BodyError(400, f"request body is nested too deeply (more than {max_depth} levels "
                             "of arrays/objects)") from None
    except json.JSONDecodeError as e:
        raise BodyError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} "
                             f"column {e.colno}") from None
    except _BadNumber as e:
        raise BodyError(400, f"request body is not valid JSON: {e}") from None
    except ValueError as e:  # int('9' * 5000): Python's int-string conversion limit
        if "digits" in str(e):
            raise BodyError(400, f"request body has an integer with more than "
                                 f"{sys.get_int_max_str_digits()} digits") from None
        raise BodyError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise BodyError(400, f"request body must be a JSON object, not {_json_kind(value)}")
    chars = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > max_depth:
            raise BodyError(400, f"request body is nested too deeply (more than {max_depth} "
                                 "levels of arrays/objects)")
        for x in (v.values() if isinstance(v, dict) else v):
            if isinstance(x, str):
                chars += len(x)
            elif isinstance(x, (dict, list)):
                stack.append((x, depth + 1))
    if max_chars is not None and chars > max_chars:
        raise BodyError(413, f"request text is {chars} characters, over the {max_chars}-character "
                             "limit (--max-input-chars)")
    return value


def _is_json_type(ctype: bytes | None) -> bool:
    if ctype is None:
        return True  # like FastAPI: no Content-Type is read as JSON
    main = ctype.split(b";")[0].strip().lower()
    return main == b"application/json" or (main.startswith(b"application/")
                                            and main.endswith(b"+json"))


class BodyGuardMiddleware:
    """Reads a request body before the app does and answers, in the common error shape:
    413 over `limit` bytes (Content-Length first, then while reading) or over `max_chars`
    characters of text; 408 (and close) when the body does not arrive within `timeout` seconds;
    400 naming the problem for a Content-Type that is not JSON, an empty body, invalid UTF-8,
    malformed JSON, NaN/Infinity, an integer over Python's 4,300-digit limit, nesting over
    MAX_JSON_DEPTH, or a top level that is not an object. The body is then replayed to the app;
    later receive() calls (disconnect detection) pass through."""

    def __init__(self, app, limit: int, max_chars: int | None = None,
                 timeout: float | None = None):
        self.app = app
        self.limit = limit
        self.max_chars = max_chars
        self.timeout = timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        close = [(b"connection", b"close")]
        clen = headers.get(b"content-length")
        if clen is not None:
            try:
                n = int(clen)
            except ValueError:
                return await _send_json(send, 400, error_body(400, "invalid Content-Length header"),
                                        close)
            if n > self.limit:
                return await _send_json(send, 413, error_body(
                    413, f"request body is {n} bytes, over the {self.limit}-byte limit"), close)
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout is None else loop.time() + self.timeout
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            try:
                if deadline is None:
                    message = await receive()
                else:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except (asyncio.TimeoutError, TimeoutError):
                return await _send_json(send, 408, error_body(
                    408, f"request body not received within {self.timeout:g} s "
                         f"({size} bytes came; --body-timeout)"), close)
            if message["type"] == "http.disconnect":
                return  # client went away before sending the body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _send_json(send, 413, error_body(
                    413, f"request body is over the {self.limit}-byte limit"), close)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        ctype = headers.get(b"content-type")
        if not _is_json_type(ctype):
            hint = ("; with curl, add -H 'Content-Type: application/json'"
                    if ctype.lower().startswith(b"application/x-www-form-urlencoded") else "")
            return await _send_json(send, 400, error_body(
                400, f"Content-Type must be application/json, not "
                     f"{printable(ctype.decode('latin-1'), 80)}{hint}"))
        try:
            if len(body) > _THREAD_PARSE_BYTES:
                await anyio.to_thread.run_sync(check_json_body, body, self.max_chars)
            else:
                check_json_body(body, self.max_chars)
        except BodyError as e:
            return await _send_json(send, e.status, error_body(e.status, e.message))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
