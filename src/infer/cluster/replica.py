"""One engine replica as a Ray Serve deployment: infer's own server app, called in-process.

The replica builds the engine exactly as ``infer serve`` does (``start_engine``: the loop in its
own process by default), wraps it in ``build_app`` and runs the app's lifespan. The router sends
it whole HTTP requests (:class:`~infer.cluster.asgi.ForwardedRequest`) and streams back what
the app answers, so the replicas behave byte for byte like single servers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray import serve

from infer.cluster.asgi import ForwardedRequest, ResponseStart, call_asgi
from infer.cluster.disagg import KVReceived, KVTicket, NoRoom, PrefillResult
from infer.config import EngineConfig
from infer.core.kv_transfer import KV_TRANSFER_SCOPE_KEY, KVHandoff
from infer.server.serving import ServerSettings

logger = logging.getLogger("infer.cluster")

# A payload fetched for a handle() call that never came (the router's client left) is dropped
# after this many seconds.
_RECEIVED_TTL_S = 60.0
# Test hook: seconds a decode replica waits before fetching a transferred KV payload.
_FETCH_DELAY_S = float(os.environ.get("INFER_TEST_KV_FETCH_DELAY", "0") or 0)


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica needs to start its engine and app (pickled to the actor)."""

    engine: EngineConfig
    settings: ServerSettings
    engine_process: bool = True
    torch_threads: int | None = None
    log_level: str = "info"
    role: str = "both"  # "prefill" | "decode": disaggregated (infer.cluster.disagg)


@dataclass(frozen=True)
class ReplicaInfo:
    """What the router asks a replica once at start-up."""

    block_size: int
    num_blocks: int
    prefix_caching: bool
    max_model_len: int
    role: str = "both"
    pid: int = 0  # the replica's process
    engine_pid: int | None = None  # its engine's process (None: a thread of the replica)


@serve.deployment(
    # The engine's own bounded queue answers 429; Serve must not queue or refuse first.
    max_ongoing_requests=100_000,
    health_check_period_s=5,
)
class InferReplica:
    """One engine behind infer's FastAPI app; the router calls :meth:`handle` per request."""

    async def __init__(self, spec: ReplicaSpec) -> None:
        from infer.server.app import build_app
        from infer.server.cli import configure_logging, start_engine

        configure_logging(spec.log_level, access_log=False)
        self.engine = start_engine(spec.engine, spec.engine_process, spec.torch_threads)
        settings = spec.settings
        if spec.role != "both":
            settings = replace(settings, role=spec.role)
        self.app = build_app(self.engine, settings)
        self.async_engine = self.app.state.async_engine
        # Decode side: payloads fetched by receive(), by key, until their handle() call.
        self._received: dict[str, tuple[float, Any]] = {}
        # The app's lifespan starts the engine loop on this (Serve's user-code) event loop and,
        # on exit, drains in-flight requests and stops the engine.
        self._lifespan: AbstractAsyncContextManager[Any] = self.app.router.lifespan_context(
            self.app
        )
        await self._lifespan.__aenter__()
        cap = self.engine.capacity
        self.info_ = ReplicaInfo(
            block_size=cap.block_size,
            num_blocks=cap.num_blocks,
            prefix_caching=bool(spec.engine.cache.enable_prefix_caching),
            max_model_len=self.engine.max_model_len,
            role=spec.role,
            pid=os.getpid(),
            engine_pid=getattr(self.engine, "pid", None),
        )
        logger.info("%s replica ready: KV cache %d blocks of %d tokens", spec.role,
                    cap.num_blocks, cap.block_size)  # fmt: skip

    async def info(self) -> ReplicaInfo:
        """The KV geometry the router's prefix policy needs."""
        return self.info_

    async def receive(self, ticket: KVTicket) -> KVReceived | NoRoom:
        """A decode replica's half of a hand-off: ``NoRoom`` when the KV pool has too few free
        blocks for the prompt now (checked, not reserved); else fetch the payload from the
        object store and keep it for the :meth:`handle` call that names its key.

        A call of its own, not an argument of the streaming one: Ray keeps a task's arguments
        (the ticket's object reference) alive as long as the task, and a stream would pin the
        payload in the object store until its last token.
        """
        free = self.async_engine.stats.num_free_blocks
        if free < ticket.num_blocks:
            return NoRoom(free, ticket.num_blocks)
        t0 = time.perf_counter()
        if _FETCH_DELAY_S:  # test hook: a transfer that provably outlasts a client
            await asyncio.sleep(_FETCH_DELAY_S)
        payload = await ticket.ref
        now = time.monotonic()
        for key in [k for k, (at, _) in self._received.items() if now - at > _RECEIVED_TTL_S]:
            del self._received[key]  # fetched for a call that never came (the client left)
        key = uuid.uuid4().hex
        self._received[key] = (now, payload)
        return KVReceived(time.perf_counter() - t0, ticket.nbytes, key)

    async def handle(self, request: ForwardedRequest, received: str | None = None
                     ) -> AsyncIterator[ResponseStart | bytes]:  # fmt: skip
        """Answer one forwarded request: a ``ResponseStart``, then body chunks as they come.

        ``received``: the key of a payload :meth:`receive` fetched; the request runs from it
        (a decode replica; a key that expired runs the prompt here).

        Cancelled by the router (its client disconnected): the app gets ``http.disconnect``
        and aborts the engine request, as a single server does.
        """
        extensions = None
        kept = self._received.pop(received, None) if received is not None else None
        if kept is not None:
            # The app drops the payload once the engine has it: no reference outlives that.
            extensions = {KV_TRANSFER_SCOPE_KEY: KVHandoff("decode", kept[1])}
            del kept
        async for piece in call_asgi(self.app, request, extensions):
            yield piece

    async def prefill(self, request: ForwardedRequest) -> PrefillResult:
        """Run the prefill half of a request (one token: the engine copies the prompt's KV out
        in the step that finishes it and frees the blocks), then put that KV in the object
        store. The app's answer comes back as is; the ticket only when the request
        succeeded."""
        handoff = KVHandoff("prefill")
        try:
            pieces = [p async for p in call_asgi(self.app, request,
                                                 {KV_TRANSFER_SCOPE_KEY: handoff})]  # fmt: skip
        finally:  # the engine copied the KV out and freed the blocks in the finishing step
            payloads = [self.async_engine.take_exported_kv(r) for r in handoff.request_ids]
        start = pieces[0]
        assert isinstance(start, ResponseStart)
        body = b"".join(p for p in pieces[1:] if isinstance(p, bytes))
        if start.status != 200 or len(payloads) != 1 or payloads[0] is None:
            return PrefillResult(start, body)
        payload = payloads[0]
        t0 = time.perf_counter()
        ref = await asyncio.to_thread(ray.put, payload)  # not on the loop: tens of MB
        ticket = KVTicket(ref, payload.nbytes, payload.num_tokens, payload.block_size)
        return PrefillResult(start, body, ticket, time.perf_counter() - t0)

    async def check_health(self) -> None:
        """Serve's health probe: a dead engine makes the replica unhealthy (Serve restarts it)."""
        if self.async_engine.dead is not None:
            raise RuntimeError(f"the engine has stopped: {self.async_engine.dead}")

    async def __del__(self) -> None:
        # Serve calls this when it stops the replica: drain, then stop the engine.
        lifespan = getattr(self, "_lifespan", None)
        if lifespan is not None:
            self._lifespan = None
            await lifespan.__aexit__(None, None, None)
