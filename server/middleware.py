"""ASGI middleware around the whole app: what the client got, crashes, the shutdown deadline, HEAD.

OutcomeMiddleware (outermost of ours) counts every request by what its client actually got:
    status="<http status>"  the response was sent in full;
    status="499"            the client went away before the response was complete (an
                            abandoned stream is not a 200);
    status="<error code>"   a stream that ended with an SSE error event (`data: {"error":...}`:
                            500 engine error, 503 shutdown, ...), although its HTTP status was 200;
    status="500"            the app raised: the client gets a JSON 500 (or, mid-stream, an SSE
                            error event and a clean end), the traceback is logged once and the
                            connection stays usable.
It also ends requests still running when the shutdown grace period is over (Lifecycle): a JSON
503 if nothing was sent yet, else an SSE error event and a clean end of the stream.

HeadMiddleware answers HEAD wherever GET is allowed: the GET response without its body.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

from server.errors import error_body
from server.metrics import Metrics

log = logging.getLogger("server")

SSE_TYPE = b"text/event-stream"
OVER_CAPACITY = "gguf_prefill.over_capacity"  # scope key set by server.protocol: the message


class Lifecycle:
    """The shutdown deadline. `begin_shutdown(grace)` may be called from a signal handler; when
    `grace` seconds have passed, every request still in flight is ended with a clean error."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.inflight: set["_Record"] = set()
        self.grace: float | None = None
        self.expired = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def begin_shutdown(self, grace: float) -> None:
        if self.grace is not None or self.loop is None:
            return
        self.grace = grace
        loop = self.loop
        try:
            loop.call_soon_threadsafe(loop.call_later, grace, self._expire)
        except RuntimeError:  # loop already closed
            pass

    def _expire(self) -> None:
        self.expired = True
        if self.inflight:
            log.warning("shutdown grace period (%g s) is over: ending %d request(s) with an error",
                        self.grace, len(self.inflight))
        for rec in list(self.inflight):
            rec.abort()


class _Record:
    __slots__ = ("task", "aborted", "started", "status", "sse", "complete", "stream_error",
                 "disconnected", "counted")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.aborted = False
        self.started = False
        self.status = 0
        self.sse = False
        self.complete = False
        self.stream_error: int | None = None
        self.disconnected = False
        self.counted = False

    def abort(self) -> None:
        if self.task is not None and not self.task.done():
            self.aborted = True
            self.task.cancel()


def _stream_error_code(body: bytes) -> int | None:
    """The code of an SSE error event `data: {"error": {"code": N, ...}}` (else None)."""
    if not body.startswith(b'data: {"error"'):
        return None
    try:
        payload = json.loads(body[len(b"data: "):].split(b"\n\n", 1)[0])
        code = payload["error"].get("code", 500)
        return int(code) if isinstance(code, int) else 500
    except (ValueError, KeyError, AttributeError, TypeError):
        return 500


def _sse_error(status: int, message: str, type: str | None = None) -> bytes:
    return b"data: " + json.dumps(error_body(status, message, type)).encode() + b"\n\n"


class OutcomeMiddleware:
    def __init__(self, app, metrics: Metrics, lifecycle: Lifecycle,
                 label: Callable[[str], str]):
        self.app = app
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.label = label

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = self.label(scope["path"])
        rec = _Record()

        async def receive_tracking():
            message = await receive()
            if message["type"] == "http.disconnect":
                rec.disconnected = True
            return message

        async def send_tracking(message):
            kind = message["type"]
            if kind == "http.response.start":
                rec.started = True
                rec.status = int(message["status"])
                for k, v in message.get("headers") or ():
                    if k.lower() == b"content-type":
                        rec.sse = v.lower().startswith(SSE_TYPE)
            elif kind == "http.response.body":
                body = message.get("body", b"")
                if rec.sse and body and rec.stream_error is None:
                    rec.stream_error = _stream_error_code(body)
                if not message.get("more_body", False):
                    try:
                        await send(message)
                    except BaseException:
                        rec.disconnected = True
                        raise
                    rec.complete = True
                    self._count(endpoint, rec)  # no await since the send: seen before any
                    return                      # later request on this connection
            await send(message)

        if scope.get(OVER_CAPACITY):
            await self._end_with_error(rec, send, 503, scope[OVER_CAPACITY],
                                       [(b"retry-after", b"1")])
            self._count(endpoint, rec)
            return
        if self.lifecycle.expired:
            rec.aborted = True
            await self._end_aborted(rec, send)
            self._count(endpoint, rec)
            return
        task = asyncio.ensure_future(self.app(scope, receive_tracking, send_tracking))
        rec.task = task
        self.lifecycle.inflight.add(rec)
        try:
            await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if not rec.aborted or (me is not None and me.cancelling()):
                raise  # we are being cancelled ourselves (uvicorn's hard deadline)
            await self._end_aborted(rec, send)
        except Exception as exc:  # noqa: BLE001 - a crash becomes a counted, clean 500
            log.error("unhandled error on %s %s", scope.get("method"), scope.get("path"),
                      exc_info=exc)
            await self._end_crashed(rec, send, exc)
        finally:
            self.lifecycle.inflight.discard(rec)
            self._count(endpoint, rec)

    # -- ending a request the app did not finish
    async def _end_aborted(self, rec: _Record, send) -> None:
        grace = self.lifecycle.grace or 0.0
        msg = (f"server is shutting down: the request did not finish within the {grace:g} s "
               "shutdown grace period")
        await self._end_with_error(rec, send, 503, msg)

    async def _end_crashed(self, rec: _Record, send, exc: BaseException) -> None:
        from engine.errors import printable

        await self._end_with_error(rec, send, 500,
                                   f"internal error: {type(exc).__name__}: {printable(exc, 300)}")

    async def _end_with_error(self, rec: _Record, send, status: int, message: str,
                              extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
        if rec.disconnected or rec.complete:
            return
        try:
            if not rec.started:
                data = json.dumps(error_body(status, message)).encode()
                headers = [(b"content-type", b"application/json"),
                           (b"content-length", str(len(data)).encode()),
                           (b"connection", b"close"), *extra_headers]
                await send({"type": "http.response.start", "status": status, "headers": headers})
                rec.started, rec.status = True, status
                await send({"type": "http.response.body", "body": data})
            else:
                if rec.sse:
                    await send({"type": "http.response.body", "body": _sse_error(status, message),
                                "more_body": True})
                    rec.stream_error = rec.stream_error or status
                else:
                    rec.stream_error = status  # a cut body: counted as the error, not the status
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            rec.complete = True
        except Exception:  # noqa: BLE001 - the client is gone; nothing more to tell it
            rec.disconnected = True

    def _count(self, endpoint: str, rec: _Record) -> None:
        if rec.counted:
            return
        rec.counted = True
        if rec.complete and not rec.disconnected:
            status = rec.stream_error or rec.status
        elif rec.aborted:
            status = 503
        else:
            status = 499  # the client left before the response was complete
        self.metrics.requests.labels(endpoint, str(status)).inc()


class HeadMiddleware:
    """HEAD runs the GET route and sends its status and headers without the body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)
        scope = dict(scope, method="GET")
        scope["gguf_prefill.method"] = "HEAD"

        async def send_headless(message):
            if message["type"] == "http.response.body":
                message = {"type": "http.response.body", "body": b"",
                           "more_body": message.get("more_body", False)}
            await send(message)

        return await self.app(scope, receive, send_headless)


def request_method(scope: dict[str, Any]) -> str:
    """The method as the client sent it (HEAD is served as GET)."""
    return scope.get("gguf_prefill.method") or scope.get("method", "")
