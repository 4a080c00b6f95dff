"""One HTTP request through an ASGI app in this process, as an async stream of parts: first
`{"status": int, "headers": [[name, value], ...]}`, then the body as bytes chunks.

An engine replica runs the project's own FastAPI app (server.app.create_app) this way, so the
front and the single-process server answer every route, error and stream alike. The request
body arrives whole in one message; when the caller stops reading (the client went away, the
front is shutting down) the app sees `http.disconnect` and its job is cancelled.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

_DONE = object()


def _scope(method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
           client: tuple[str, int] | None) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": method.upper(), "scheme": "http", "path": path,
            "raw_path": path.encode("latin-1"), "query_string": query, "root_path": "",
            "headers": headers, "client": client or ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0), "state": {}}


async def call(app, method: str, path: str, query: bytes = b"",
               headers: list[tuple[bytes, bytes]] | None = None, body: bytes = b"",
               client: tuple[str, int] | None = None) -> AsyncIterator[Any]:
    """Run one request through `app`; yields the response head (a dict), then body chunks."""
    out: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            await out.put({"status": int(message["status"]),
                           "headers": [[bytes(k).decode("latin-1"), bytes(v).decode("latin-1")]
                                       for k, v in message.get("headers", [])]})
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            if chunk:
                await out.put(bytes(chunk))
            if not message.get("more_body", False):
                await out.put(_DONE)

    async def run():
        try:
            await app(_scope(method, path, query, list(headers or []), client), receive, send)
        finally:
            await out.put(_DONE)

    task = asyncio.ensure_future(run())
    try:
        while True:
            item = await out.get()
            if item is _DONE:
                break
            yield item
        await task  # an exception the app raised after the response is re-raised here
    finally:
        disconnected.set()  # the caller stopped reading: the app's request is cancelled
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
            except Exception:  # noqa: BLE001 - already reported by the app's middleware
                pass
