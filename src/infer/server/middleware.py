"""Plain ASGI middleware: the access log, the API key check, the request-size limit and the
500 of an unexpected failure.

Written as raw ASGI (not ``BaseHTTPMiddleware``) so streaming responses pass through untouched
and a client disconnect still reaches the handler.
"""

from __future__ import annotations

import hmac
import logging
import time
from urllib.parse import parse_qs

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer.server.errors import APIError, internal_error

access_logger = logging.getLogger("infer.access")
logger = logging.getLogger("infer.server")

OPEN_PATHS = frozenset({"/health"})
DASHBOARD_ASSETS = "/dashboard/static/"


async def _send_error(send: Send, error: APIError, headers: dict[str, str] | None = None) -> None:
    response = error.response(headers=headers)
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})  # fmt: skip
    await send({"type": "http.response.body", "body": response.body})


class UnexpectedErrorMiddleware:
    """A route's failure that no handler expected: logged once, answered with a 500 in the
    OpenAI shape, and the connection kept open.

    An ``Exception`` handler of the app runs in Starlette's outermost middleware, which sends
    its response and then raises the error again (for the server to log); uvicorn then closes
    the connection, so a keep-alive client's next request on it failed with a reset. A
    response already under way (a stream) cannot turn into a 500: that error goes on up and
    the connection closes, as it must with a body cut short.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as e:
            if started:
                raise
            logger.exception("unhandled error while serving a request")
            await _send_error(send, internal_error(e))


class AccessLogMiddleware:
    """One line per request: client, method, path, status, request id, tokens, duration."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [0]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            state = scope.get("state") or {}
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            extra = ""
            if "request_id" in state:
                extra += f" id={state['request_id']}"
            if "usage" in state:
                extra += f" prompt_tokens={state['usage'][0]} completion_tokens={state['usage'][1]}"
            access_logger.info(
                '%s "%s %s" %s%s %.1fms', who, scope["method"], scope["path"],
                status[0] or "disconnected", extra, (time.perf_counter() - start) * 1000,
            )  # fmt: skip


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``) on every route
    but /health (401 otherwise).

    A browser cannot add that header to a page load or an ``EventSource``, so the dashboard's
    routes also take the key as ``?api_key=``; its static assets (page code and the vendored
    chart library, nothing secret) need none.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(DASHBOARD_ASSETS):
            return await self.app(scope, receive, send)
        offered = [value for name, value in scope["headers"] if name == b"authorization"]
        # (Anthropic's clients send the key as x-api-key: either header may hold it)
        offered += [b"Bearer " + value for name, value in scope["headers"]
                    if name == b"x-api-key" and value]  # fmt: skip
        if not any(offered) and path.startswith("/dashboard"):
            key = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
            offered = [f"Bearer {key[0]}".encode()] if key else []
        given = b"".join(offered)
        if not any(hmac.compare_digest(value, self.expected) for value in offered):
            why = "missing API key" if not given else "incorrect API key"
            error = APIError(
                401,
                f"{why}: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                code="invalid_api_key",
            )
            await _send_error(send, error, {"WWW-Authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse bodies over ``max_bytes`` with 413: by Content-Length up front, else as they stream."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        message = f"the request body is larger than this server's limit of {limit} bytes"
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit:
                    await _send_error(send, APIError(413, message, code="request_too_large"))
                    return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    # FastAPI re-raises HTTPException from body reading; our handler shapes it.
                    raise HTTPException(413, message)
            return msg

        await self.app(scope, limited_receive, send)


GENERATION_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/classify",
        "/v1/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    }
)


class OverloadMiddleware:
    """While the waiting queue is full, generation requests get their 429 before the body is
    read, parsed or tokenized: under a burst a rejection then costs a fraction of a millisecond
    of the event loop instead of a full request's front-end work (the engine would refuse it
    anyway once it got there)."""

    def __init__(self, app: ASGIApp, queue_is_full) -> None:  # noqa: ANN001 - a callable
        self.app = app
        self.queue_is_full = queue_is_full

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in GENERATION_PATHS
            and self.queue_is_full()
        ):
            error = APIError(429, "the waiting queue is full; retry later", code="queue_full")
            await _send_error(send, error, error.headers)
            return
        await self.app(scope, receive, send)
