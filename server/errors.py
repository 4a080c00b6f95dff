"""One JSON error shape everywhere: {"error": {"code": <http status>, "type": ..., "message": ...}}.

Covers our own APIError, FastAPI's request-validation 422s (the message names the field),
Starlette's 404/405, and the body guard (413 oversized, 400 invalid UTF-8 / malformed JSON)
that runs before FastAPI sees the request. Types follow llama-server's names.
"""

from __future__ import annotations

import hmac
import json
import re
import logging
from typing import Any, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("server")

TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
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
        return JSONResponse(exc.body(), status_code=exc.status)

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
            message = f"method {request.method} is not allowed on {request.url.path}"
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


class BodyGuardMiddleware:
    """Reads a request body before the app does: over `limit` bytes -> 413 (checked on
    Content-Length first, then while reading), not UTF-8 -> 400, not JSON -> 400 (for JSON
    routes). The body is then replayed to the app; later receive() calls (disconnect
    detection) pass through."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        clen = headers.get(b"content-length")
        if clen is not None:
            try:
                n = int(clen)
            except ValueError:
                return await _send_json(send, 400, error_body(400, "invalid Content-Length header"))
            if n > self.limit:
                return await _send_json(send, 413, error_body(
                    413, f"request body is {n} bytes, over the {self.limit}-byte limit"),
                    [(b"connection", b"close")])
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # client went away before sending the body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _send_json(send, 413, error_body(
                    413, f"request body is over the {self.limit}-byte limit"),
                    [(b"connection", b"close")])
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        ctype = headers.get(b"content-type", b"application/json").split(b";")[0].strip().lower()
        if body and (ctype == b"application/json" or ctype.endswith(b"+json") or ctype == b""):
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as e:
                return await _send_json(send, 400, error_body(
                    400, f"request body is not valid UTF-8 (byte {e.start}: "
                         f"{body[e.start:e.start + 1]!r})"))
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                return await _send_json(send, 400, error_body(
                    400, f"request body is not valid JSON: {e.msg} at line {e.lineno} "
                         f"column {e.colno}"))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
