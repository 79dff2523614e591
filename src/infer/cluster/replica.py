"""One engine replica as a Ray Serve deployment: infer's own server app, called in-process.

The replica builds the engine exactly as ``infer serve`` does (``start_engine``: the loop in its
own process by default), wraps it in ``build_app`` and runs the app's lifespan. The router sends
it whole HTTP requests (:class:`~infer.cluster.asgi.ForwardedRequest`) and streams back what
the app answers, so the replicas behave byte for byte like single servers.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from ray import serve

from infer.cluster.asgi import ForwardedRequest, ResponseStart, call_asgi
from infer.config import EngineConfig
from infer.server.serving import ServerSettings

logger = logging.getLogger("infer.cluster")


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica needs to start its engine and app (pickled to the actor)."""

    engine: EngineConfig
    settings: ServerSettings
    engine_process: bool = True
    torch_threads: int | None = None
    log_level: str = "info"


@dataclass(frozen=True)
class ReplicaInfo:
    """What the router asks a replica once at start-up."""

    block_size: int
    num_blocks: int
    prefix_caching: bool
    max_model_len: int


@serve.deployment(
    # The engine's own bounded queue answers 429; Serve must not queue or refuse first.
    max_ongoing_requests=100_000,
    health_check_period_s=5,
)
class InferReplica:
    """One engine behind infer's FastAPI app; the router calls :meth:`handle` per request."""

    async def __init__(self, spec: ReplicaSpec) -> None:
        from infer.server.app import build_app
        from infer.server.cli import _configure_logging, start_engine

        _configure_logging(spec.log_level, access_log=False)
        self.engine = start_engine(spec.engine, spec.engine_process, spec.torch_threads)
        self.app = build_app(self.engine, spec.settings)
        self.async_engine = self.app.state.async_engine
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
            prefix_caching=spec.engine.cache.enable_prefix_caching,
            max_model_len=self.engine.max_model_len,
        )
        logger.info("replica ready: KV cache %d blocks of %d tokens", cap.num_blocks,
                    cap.block_size)  # fmt: skip

    async def info(self) -> ReplicaInfo:
        """The KV geometry the router's prefix policy needs."""
        return self.info_

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """Answer one forwarded request: a ``ResponseStart``, then body chunks as they come.

        Cancelled by the router (its client disconnected): the app gets ``http.disconnect``
        and aborts the engine request, as a single server does.
        """
        async for piece in call_asgi(self.app, request):
            yield piece

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
