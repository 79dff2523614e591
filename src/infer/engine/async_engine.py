"""The bridge between the engine loop and asyncio.

::

    event loop (HTTP handlers)                        engine loop (thread or process)
    ─────────────────────────                        ───────────────────────────────
    add_group() ── AddRequest ──┐                    loop:
    stream.abort() ── Abort ────┼─► core.send() ────►  drain commands (block when idle)
    call(method) ── CallEngine ─┘                       add / abort / call on the engine
                                                        step() -> [RequestOutput]
    RequestStream.queue ◄── _dispatch ◄── replies ◄──   acks, deltas, stats (one list a step)

The engine loop (``core_loop``) runs on a thread of this process (``ThreadCore``: the offline
and test set-up) or in a process of its own (``EngineProcess``: what ``infer serve`` does by
default). Everything on this side runs on the event loop, so no locks: replies arrive through
``call_soon_threadsafe`` and are routed to the request streams here.

Admission control happens here, on the event loop, before anything is queued: when the engine's
waiting queue (as of the last step) plus the adds it has not acknowledged yet reach
``max_queued_requests``, ``add_group`` raises ``QueueFullError`` at once (the server answers 429).
This is the only queue bound: the engine itself takes whatever it is given.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from infer.core.outputs import RequestOutput, merge_deltas
from infer.core.pooling_params import PoolingParams
from infer.core.request import RequestTimings
from infer.core.sampling_params import InvalidRequestError
from infer.engine.core_client import EngineConnection, EngineProcess, ThreadCore
from infer.engine.core_loop import (
    AbortRequests,
    Ack,
    AddRequest,
    CallEngine,
    CallResult,
    EngineStopped,
    FinishedElsewhere,
    RequestFailedError,
    StatsUpdate,
    Stop,
    error_output,
)

logger = logging.getLogger("infer.engine")

__all__ = [
    "AddRequest",
    "AsyncEngine",
    "EngineStoppedError",
    "QueueFullError",
    "RequestFailedError",
    "RequestStream",
]


END_GRACE_S = 5.0
"""How long a stream the server ends (a deadline, a drain) waits for the engine's final outputs
of its aborted requests (one step, normally) before it makes them itself."""
_GRACE_OVER = object()  # queued into a stream when END_GRACE_S has passed


class EngineStoppedError(Exception):
    """The engine is shutting down or has died (HTTP 503)."""


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queued_requests`` (the server answers 429)."""


@dataclasses.dataclass(frozen=True)
class _End:
    """The server ends the stream's unfinished children (a deadline, a shutdown): the consumer
    gets a final ``abort`` delta for each, so a streamed answer still ends cleanly."""

    why: str


# ---- the per-request handle ------------------------------------------------------------------


class RequestStream:
    """The outputs of one API request: ``n`` engine requests sharing one asyncio queue.

    Iterate it for ``(index, RequestOutput)`` pairs until every child has finished. A deadline
    (``--request-timeout``) ends the unfinished children with ``finish_reason="abort"``.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str], deadline: float | None):
        self._engine = engine
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._queue: asyncio.Queue = asyncio.Queue()
        self._early: collections.deque = collections.deque()  # outputs seen while awaiting acks
        self._unacked = set(request_ids)
        self._unfinished = set(request_ids)
        self._last: dict[str, RequestOutput] = {}
        self._timer: asyncio.TimerHandle | None = None
        if deadline is not None:
            self._timer = asyncio.get_running_loop().call_at(
                deadline, self._queue.put_nowait, _End("request timed out")
            )

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: Any) -> None:  # event loop only
        self._queue.put_nowait(item)

    async def _get(self) -> Any:
        return self._early.popleft() if self._early else await self._queue.get()

    async def accepted(self) -> None:
        """Wait until the engine has taken every child; raise its refusal otherwise.

        ``InvalidRequestError`` (a 400: too long, can never fit) or ``RequestFailedError``.
        """
        while self._unacked:
            item = await self._queue.get()  # not _get(): _early holds no acks
            if isinstance(item, Ack):
                self._unacked.discard(item.request_id)
                if item.error is not None:
                    # The engine refused it: it never ran, so it is not reported as finished.
                    self._unfinished.discard(item.request_id)
                    self._engine.forget(item.request_id)
                    self.abort("a sibling request was refused")
                    raise item.error
            elif isinstance(item, _End):
                self._early.append(item)  # let iteration report it
                return
            else:  # a sibling's output (it was taken and stepped before this one): keep order
                self._early.append(item)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            while self._unfinished:
                item = await self._get()
                if isinstance(item, Ack):
                    self._unacked.discard(item.request_id)
                    if item.error is not None:
                        raise item.error
                    continue
                if isinstance(item, _End):
                    async for pair in self._end(item.why):
                        yield pair
                    return
                out: RequestOutput = item
                if out.request_id not in self._unfinished:
                    continue
                out = self._take_queued(out)
                self._last[out.request_id] = out
                if out.finished:
                    self._unfinished.discard(out.request_id)
                    self._engine.request_done(out.request_id, out)
                yield self._index[out.request_id], out
        finally:
            if self._unfinished:  # consumer went away (disconnect, error): abort the rest
                self.abort()
            if self._timer is not None:
                self._timer.cancel()

    async def _end(self, why: str) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The server ends the unfinished children (a deadline, a drain): the engine aborts
        them, and their final outputs are the engine's, which carry every token it made, those
        held back by ``--stream-interval`` included; they end with ``finish_reason`` abort
        and ``why`` as their error. Where the engine has not answered within ``END_GRACE_S``,
        has failed meanwhile (an error output) or is dead, the final outputs are made here,
        from the last ones seen, as before the engine could answer."""
        ids = tuple(rid for rid in self.request_ids if rid in self._unfinished)
        if ids and self._engine.dead is None:
            self._engine.send(AbortRequests(ids))
            logger.info("aborting %s (%s)", ",".join(ids), why)
            # NOTE: a marker queued by a timer, not asyncio.wait_for: on Python < 3.12
            # wait_for can swallow the consumer's cancellation (a client that left).
            timer = asyncio.get_running_loop().call_later(END_GRACE_S, self._put, _GRACE_OVER)
            try:
                while self._unfinished:
                    item = await self._get()
                    if item is _GRACE_OVER:
                        break
                    if isinstance(item, Ack):
                        self._unacked.discard(item.request_id)
                        if item.error is not None:  # refused: it never ran, is not reported
                            self._unfinished.discard(item.request_id)
                            self._engine.forget(item.request_id)
                        continue
                    if (
                        not isinstance(item, RequestOutput)
                        or item.request_id not in self._unfinished
                    ):
                        continue  # an earlier end
                    out = item  # (not merged: an error output would swallow the deltas)
                    if out.finish_reason == "error":
                        break  # the engine failed meanwhile: the abort is made here
                    if out.finished:
                        if out.finish_reason == "abort" and out.error is None:
                            out = dataclasses.replace(out, error=why)
                        self._unfinished.discard(out.request_id)
                        self._engine.request_done(out.request_id, out)
                    self._last[out.request_id] = out
                    yield self._index[out.request_id], out
            finally:
                timer.cancel()
        for rid, out in self._abort_outputs(why, tell_engine=False):
            yield self._index[rid], out

    def _take_queued(self, out: RequestOutput) -> RequestOutput:
        """``out`` joined with the deltas of the same request already queued behind it.

        When the consumer falls behind the engine (a server writing tens of thousands of
        events a second), the deltas of several steps wait here; sending them as one event
        costs one render and one write instead of one each, so the stream catches up instead
        of lagging further. A consumer that keeps up finds nothing queued: one delta a step.
        Stops at anything else (an ack, an end, a sibling's delta), which is read next.
        """
        queued = self._queue
        while not out.finished and not self._early and not queued.empty():
            item = queued.get_nowait()
            if isinstance(item, RequestOutput) and item.request_id == out.request_id:
                out = merge_deltas(out, item)
            else:
                self._early.append(item)
        return out

    def _abort_outputs(self, why: str, tell_engine: bool = True) -> list[tuple[str, RequestOutput]]:
        """End every unfinished child as aborted: tell the engine, synthesise final deltas."""
        ids = [rid for rid in self.request_ids if rid in self._unfinished]
        if not ids:
            return []
        if tell_engine:
            self._engine.send(AbortRequests(tuple(ids)))
        done = []
        now = time.perf_counter()
        for rid in ids:
            last = self._last.get(rid)
            # A copy: the engine thread owns the live timings object.
            timings = (
                dataclasses.replace(last.timings) if last and last.timings else RequestTimings()
            )
            if timings.finished is None:
                timings.finished = now
            out = RequestOutput(
                request_id=rid,
                new_token_ids=[],
                new_text="",
                finished=True,
                finish_reason="abort",
                num_prompt_tokens=last.num_prompt_tokens if last else 0,
                num_output_tokens=last.num_output_tokens if last else 0,
                num_cached_tokens=last.num_cached_tokens if last else 0,
                timings=timings,
                error=why,
            )
            self._unfinished.discard(rid)
            self._engine.request_done(rid, out)
            done.append((rid, out))
        logger.info("aborted %s (%s)", ",".join(ids), why)
        return done

    def end(self, why: str) -> None:
        """End the unfinished children as aborted *through the consumer*: it receives their
        final ``abort`` deltas (and a streamed answer its last chunk and ``[DONE]``)."""
        self._put(_End(why))

    def abort(self, why: str = "client disconnected") -> None:
        """Abort every unfinished child (idempotent). Frees their KV blocks in the next step."""
        self._abort_outputs(why)
        if self._timer is not None:
            self._timer.cancel()


# ---- the engine owner --------------------------------------------------------------------------


class AsyncEngine:
    """Runs an engine loop (a thread for an ``LLMEngine``, a child for an ``EngineProcess``);
    use from one asyncio event loop.

    ``on_finished(output)`` is called on the event loop for every engine request that ends
    (including aborts and timeouts) with its final ``RequestOutput`` - the metrics hook.
    ``on_dead(why)`` is called once if the engine dies on its own (the server then exits).
    """

    def __init__(
        self,
        engine: Any,
        *,
        max_queued_requests: int | None = None,
        request_timeout: float | None = None,
        on_finished: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        if isinstance(engine, EngineProcess | EngineConnection):
            self.core: ThreadCore | EngineProcess | EngineConnection = engine
            self.stats = engine.startup_stats
        else:
            self.core = ThreadCore(engine)
            self.stats = engine.get_stats()  # snapshot, replaced after every step
        self.max_queued_requests = max_queued_requests
        self.request_timeout = request_timeout
        self.on_finished = on_finished
        self.on_dead: Callable[[str], None] | None = None
        # Awaited by shutdown() before it stops the engine (the first of several API servers
        # waits there for the others to leave).
        self.before_stop: Callable[[], Awaitable[None]] | None = None
        self.num_steps = 0
        self.num_step_failures = 0
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        # Prompt KV of finished ``export_kv`` requests (prefill/decode disaggregation), taken
        # off their final outputs until the replica collects it (take_exported_kv).
        self.exported_kv: dict[str, Any] = {}
        self._call_ids = itertools.count()
        self._unacked_adds = 0  # adds sent but not yet acknowledged by the engine
        self._stopped: asyncio.Event | None = None  # created in start(), on the event loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._accepting = True
        self.dead: str | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self.core.start(self._post)

    def stop_accepting(self) -> None:
        self._accepting = False

    @property
    def accepting(self) -> bool:
        """False once the server drains or shuts down."""
        return self._accepting

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def queue_is_full(self) -> bool:
        """Whether the waiting queue has no room for even one more request."""
        bound = self.max_queued_requests
        return bound is not None and self._unacked_adds + self.stats.num_waiting >= bound

    def abort_all(self, why: str) -> None:
        """End every in-flight request; each consumer gets its final ``abort`` deltas."""
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.end(why)

    async def drain(self, timeout: float) -> bool:
        """Stop taking requests; wait up to ``timeout`` s for in-flight ones, then abort them.

        Returns True when everything finished on its own.
        """
        self.stop_accepting()
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        clean = not self._streams
        if not clean:
            self.abort_all("server shutting down")
        return clean

    async def shutdown(self) -> None:
        """Stop the engine loop (after ``drain``) and wait for it to leave."""
        self.stop_accepting()
        if self.before_stop is not None:
            await self.before_stop()
        if self.dead is None and self._stopped is not None:
            self.core.send(Stop())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), 30)
        await asyncio.to_thread(self.core.join, 10)
        await asyncio.to_thread(self.core.close)

    # ---- the event-loop API -------------------------------------------------------------------
    def add_group(self, requests: list[AddRequest]) -> RequestStream:
        """Queue engine requests that answer one API request; raise ``QueueFullError`` when full.

        Never blocks: the 429 decision is made here, before anything reaches the engine.
        """
        if not self._accepting:
            raise EngineStoppedError("the server is shutting down")
        if self.dead is not None:
            raise EngineStoppedError(f"the engine has stopped: {self.dead}")
        bound = self.max_queued_requests
        if bound is not None and len(requests) > bound:  # would be refused forever: not a 429
            embeds = isinstance(requests[0].params, PoolingParams)
            raise InvalidRequestError(
                f"this request needs {len(requests)} "
                f"{'inputs embedded' if embeds else 'sequences'} but the waiting queue holds at "
                f"most {bound}",
                param="input" if embeds else "n",
            )
        queued = self._unacked_adds + self.stats.num_waiting
        if bound is not None and queued + len(requests) > bound:
            raise QueueFullError(
                f"the waiting queue is full ({queued} of {bound} requests waiting); retry later"
            )
        self._unacked_adds += len(requests)
        deadline = None
        if self.request_timeout is not None:
            deadline = asyncio.get_running_loop().time() + self.request_timeout
        stream = RequestStream(self, [r.request_id for r in requests], deadline)
        for r in requests:
            self._streams[r.request_id] = stream
            self.core.send(r)
        return stream

    async def call(self, method: str, *args: Any) -> Any:
        """Run ``engine.<method>(*args)`` in the engine loop between steps; return its result."""
        if self.dead is not None:
            raise EngineStoppedError(f"the engine has stopped: {self.dead}")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self.core.send(CallEngine(call_id, method, args))
        return await future

    def take_exported_kv(self, request_id: str) -> Any:
        """The KV payload an ``export_kv`` request's final output brought, or None."""
        return self.exported_kv.pop(request_id, None)

    def send(self, command: Any) -> None:
        """Send a command to the engine loop (``AbortRequests`` from a stream)."""
        if self.dead is None:
            self.core.send(command)

    def forget(self, request_id: str) -> None:
        """Stop routing outputs for a request the engine refused."""
        self._streams.pop(request_id, None)

    def request_done(self, request_id: str, final: RequestOutput) -> None:
        """A request's stream has seen its final output: stop routing, run the metrics hook."""
        self._streams.pop(request_id, None)
        self._observe_finished(final)

    def _observe_finished(self, final: RequestOutput) -> None:
        """The metrics hook, for a request this server or (``FinishedElsewhere``) another
        API server process served."""
        if self.on_finished is not None:
            try:
                self.on_finished(final)
            except Exception:  # metrics must never break serving
                logger.exception("on_finished hook failed")

    # ---- replies from the engine loop -------------------------------------------------------
    def _post(self, replies: list) -> None:  # a background thread
        loop = self._loop
        if replies and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closed under us at exit
                loop.call_soon_threadsafe(self._dispatch, replies)

    def _dispatch(self, replies: list) -> None:  # the event loop
        for item in replies:
            if isinstance(item, StatsUpdate):
                self.stats = item.stats
                self.num_steps, self.num_step_failures = item.num_steps, item.num_step_failures
            elif isinstance(item, CallResult):
                future = self._calls.pop(item.call_id, None)
                if future is not None and not future.done():
                    if item.error is not None:
                        future.set_exception(item.error)
                    else:
                        future.set_result(item.value)
            elif isinstance(item, EngineStopped):
                self._on_stopped(item.error)
            elif isinstance(item, FinishedElsewhere):  # another API server's: the metrics'
                self._observe_finished(item.output)
            else:  # Ack or RequestOutput
                if isinstance(item, Ack):
                    self._unacked_adds -= 1
                elif item.kv_payload is not None:  # for the replica: take_exported_kv
                    if item.request_id in self._streams:  # not when its client has left
                        self.exported_kv[item.request_id] = item.kv_payload
                    item = dataclasses.replace(item, kv_payload=None)
                stream = self._streams.get(item.request_id)
                if stream is not None:
                    stream._put(item)

    def _on_stopped(self, error: str | None) -> None:
        if self._stopped is not None:
            self._stopped.set()
        why = error or "the engine was stopped"
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineStoppedError(why))
        self._calls.clear()
        for rid in list(self._streams):
            self._streams[rid]._put(error_output(rid, why))
        if error is not None and self.dead is None:
            logger.error("engine stopped: %s", error)
            self.dead = error
            if self.on_dead is not None:
                self.on_dead(error)
