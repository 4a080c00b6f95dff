"""uvicorn's h11 protocol with a request-header deadline and a connection cap.

uvicorn's own `timeout_keep_alive` only covers a connection that sends nothing: any byte
resets it, so a client trickling a request one byte at a time (slowloris), or a thousand
clients that each send half a request line, hold their connections forever. This protocol:

- gives every request `header_timeout` seconds, counted from the connection opening or from
  the end of the previous response, to deliver its request line and headers; then a JSON 408
  (if part of a request came) and the connection is closed. The deadline is disarmed as soon
  as the headers are in, so long streamed responses are never affected. (The body has its own
  deadline, `--body-timeout`, in server.errors.BodyGuardMiddleware.)
- over `max_connections` open connections, a new connection's request is answered with a JSON
  503 (counted in /metrics) and the connection is closed.
"""

from __future__ import annotations

import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import error_body
from server.middleware import OVER_CAPACITY

log = logging.getLogger("server")


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps(error_body(status, message)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


def make_protocol(header_timeout: float, max_connections: int) -> type:
    class GuardedH11Protocol(_GuardedH11Protocol):
        pass

    GuardedH11Protocol.header_timeout = float(header_timeout)
    GuardedH11Protocol.max_connections = int(max_connections)
    return GuardedH11Protocol


class _GuardedH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    max_connections: int = 512

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._header_timer = None
        self._partial = False
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            app = self.app
            message = (f"too many connections: the server has {self.max_connections} open "
                       "(--max-connections); retry later")

            async def over_capacity(scope, receive, send):
                scope[OVER_CAPACITY] = message
                await app(scope, receive, send)

            self.app = over_capacity  # this connection only
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is not None and data:
            self._partial = True
        super().data_received(data)
        self._headers_maybe_done()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may already parse a pipelined request
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()

    # -- the deadline
    def _headers_maybe_done(self) -> None:
        if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # request line + headers are in

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._partial = False
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._header_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._partial:
            log.debug("closing a connection: request headers not complete after %g s",
                      self.header_timeout)
            self.transport.write(_raw_response(
                408, "Request Timeout",
                f"request headers not received within {self.header_timeout:g} s "
                "(--header-timeout)"))
        self.transport.close()
