"""The live view: ``/dashboard`` (a static page) fed by ``/dashboard/events`` (server-sent events).

Each event is one poll of the engine (``LLMEngine.poll_trace``: the steps since the last event and
a snapshot of the queues and KV blocks) plus what only the server sees: rolling TTFT / ITL
percentiles of the requests finished in the last ``LATENCY_WINDOW_S`` seconds and throughput
from the engine's token counters. The engine records steps only while some page polls, and the
server keeps finished requests' timings only while some page is connected: with no viewer the
view costs nothing.

The page (``static/dashboard.html`` + ``dashboard.js``) draws with uPlot, vendored under
``static/vendor/uplot`` (no CDN, no build step), and can also replay a recorded trace file
(``infer bench ... --trace FILE``: one ``{"step", "snapshot"}`` JSON object per line).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from infer.core.outputs import RequestOutput
from infer.engine.async_engine import AsyncEngine

STATIC_DIR = Path(__file__).parent / "static"
LATENCY_WINDOW_S = 30.0
"""Finished requests older than this drop out of the rolling percentiles."""
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 5.0


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles (``None`` when there is nothing to rank)."""
    if not values:
        return {f"p{q}": None for q in qs}
    ordered = sorted(values)
    n = len(ordered)
    return {f"p{q}": ordered[min(n - 1, max(0, -(-q * n // 100) - 1))] for q in qs}


class LatencyWindow:
    """TTFT and ITL of the requests finished in the last ``window_s`` seconds."""

    def __init__(self, window_s: float = LATENCY_WINDOW_S) -> None:
        self.window_s = window_s
        self._finished: deque[tuple[float, float | None, list[float]]] = deque()

    def observe(self, out: RequestOutput, now: float | None = None) -> None:
        t = out.timings
        if t is None:
            return
        ttft = None if t.first_token is None else max(0.0, t.first_token - t.arrival)
        times = t.token_times
        itl = [max(0.0, b - a) for a, b in zip(times, times[1:], strict=False)]
        self._finished.append((time.monotonic() if now is None else now, ttft, itl))

    def summary(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        while self._finished and self._finished[0][0] < now - self.window_s:
            self._finished.popleft()
        ttft = [1000 * x for _, x, _ in self._finished if x is not None]
        itl = [1000 * x for _, _, gaps in self._finished for x in gaps]
        return {
            "window_s": self.window_s,
            "num_finished": len(self._finished),
            "ttft_ms": percentiles(ttft),
            "itl_ms": percentiles(itl),
        }


class Dashboard:
    """The event feed of the live view; one per app."""

    def __init__(self, async_engine: AsyncEngine, model_name: str,
                 role: str | None = None) -> None:  # fmt: skip
        self.async_engine = async_engine
        self.model_name = model_name
        self.role = role  # "prefill" / "decode" on a disaggregated replica
        self.latency = LatencyWindow()
        self.num_viewers = 0

    def observe_finished(self, out: RequestOutput) -> None:
        if self.num_viewers:
            self.latency.observe(out)

    async def events(self, request: Request, interval: float) -> AsyncIterator[str]:
        """``data: {...}`` every ``interval`` seconds until the client leaves or the server
        drains."""
        engine = self.async_engine
        self.num_viewers += 1
        since = 0
        last = (time.monotonic(), engine.stats.prompt_tokens_total,
                engine.stats.generation_tokens_total)  # fmt: skip
        try:
            yield "retry: 1000\n\n"
            while engine.accepting and engine.dead is None:
                poll = await engine.call("poll_trace", since)
                if poll.steps:
                    since = poll.steps[-1].step
                now, stats = time.monotonic(), engine.stats
                dt = max(1e-6, now - last[0])
                event = poll.to_json()
                event["model"] = self.model_name
                if self.role:
                    event["role"] = self.role
                event["latency"] = self.latency.summary()
                event["throughput"] = {
                    "prompt_tok_s": (stats.prompt_tokens_total - last[1]) / dt,
                    "generation_tok_s": (stats.generation_tokens_total - last[2]) / dt,
                }
                last = (now, stats.prompt_tokens_total, stats.generation_tokens_total)
                event["server"] = {
                    "in_flight": engine.num_in_flight,
                    "steps": engine.num_steps,
                    "preemptions_total": stats.num_preemptions_total,
                    "finished_total": stats.finished_total,
                }
                yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
                if await request.is_disconnected():
                    break
                await asyncio.sleep(interval)
        finally:
            self.num_viewers -= 1


def install_dashboard(app: FastAPI, dashboard: Dashboard) -> None:
    """``/dashboard`` (the page), ``/dashboard/events`` (SSE) and ``/dashboard/static/``."""
    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")

    @app.get("/dashboard", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html")

    @app.get("/dashboard/events", include_in_schema=False)
    async def events(request: Request, interval: float = 0.25) -> StreamingResponse:
        interval = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, interval))
        return StreamingResponse(
            dashboard.events(request, interval),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
