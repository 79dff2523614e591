"""One HTTP request through an ASGI app in-process, its response streamed back piece by piece.

A replica runs infer's own FastAPI app (``infer.server.app.build_app``) and serves the router's
forwarded requests through it with :func:`call_asgi`, so every route, error body, ``429`` with
``Retry-After`` and SSE stream is exactly what ``infer serve`` answers. No ray here: the
forwarded request and the response pieces are plain picklable values.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("infer.cluster")

# How long a cancelled call lets the app finish its own clean-up (the engine abort) after the
# disconnect is delivered, before the app's task is cancelled outright.
DISCONNECT_GRACE_S = 5.0


@dataclass(frozen=True)
class ForwardedRequest:
    """What the router saw of a client's request (the body already read)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ResponseStart:
    """The first piece of every forwarded response; body chunks (``bytes``) follow."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    def header(self, name: str) -> str | None:
        key = name.lower().encode("latin-1")
        for k, v in self.headers:
            if k.lower() == key:
                return v.decode("latin-1")
        return None


_DONE = object()


async def call_asgi(app: Any, request: ForwardedRequest,
                    extensions: dict[str, Any] | None = None) -> AsyncIterator[ResponseStart | bytes]:  # fmt: skip
    """Run ``request`` through the ASGI ``app``; yield its ``ResponseStart``, then body chunks
    as the app sends them (an SSE stream event by event). ``extensions`` are added to the ASGI
    scope (a disaggregated replica's KV hand-off).

    Closing or cancelling the iteration early is a client disconnect: the app receives
    ``http.disconnect`` (infer aborts the engine request on it) and its sends fail, then it
    gets :data:`DISCONNECT_GRACE_S` to finish before its task is cancelled.
    """
    out: asyncio.Queue[Any] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if disconnected.is_set():  # what a server does when the peer is gone
            raise OSError("the client disconnected")
        await out.put(message)

    path = request.path or "/"
    scope = {
        "type": "http",
        # NOTE: spec 2.3, not 2.4: under 2.4 Starlette's responses stop listening for
        # http.disconnect and rely on a failing send, which only happens at the next chunk; a
        # stream waiting on a slow first token would keep its engine request that long.
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method.upper(),
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in request.headers],
        "client": request.client,
        "server": ("127.0.0.1", 0),
        **(extensions or {}),
    }

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            out.put_nowait(_DONE)

    task = asyncio.create_task(run())
    finished = False
    try:
        while True:
            message = await out.get()
            if message is _DONE:
                finished = True
                task.result()  # the app's own exception, if it raised one
                raise RuntimeError(f"{request.method} {path}: the app ended without a response")
            kind = message["type"]
            if kind == "http.response.start":
                headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
                yield ResponseStart(int(message["status"]), headers)
            elif kind == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    yield bytes(chunk)
                if not message.get("more_body", False):
                    finished = True
                    return
    finally:
        if not finished:  # the caller went away mid-response: a disconnect
            disconnected.set()
        if not task.done():
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_GRACE_S)
            if not done:
                logger.warning("%s %s did not stop %gs after a disconnect; cancelling it",
                               request.method, path, DISCONNECT_GRACE_S)  # fmt: skip
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        elif not task.cancelled() and task.exception() is not None and not finished:
            logger.debug("forwarded request failed after a disconnect", exc_info=task.exception())
