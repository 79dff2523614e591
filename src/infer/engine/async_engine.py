"""The bridge between the synchronous ``LLMEngine`` and asyncio: one thread owns the engine.

::

    event loop (HTTP handlers)                      engine thread (owns LLMEngine)
    ─────────────────────────                      ──────────────────────────────
    add_group() ── AddRequest ──┐                  loop:
    stream.abort() ── Abort ────┼─► command queue ─►  drain commands (block when idle)
    call(fn) ── Call ───────────┘                     add / abort / call on the engine
                                                      step() -> [RequestOutput]
    RequestStream.queue ◄── call_soon_threadsafe ◄─   acks, deltas (one hop per batch)

The engine is not thread-safe, so nothing but the engine thread touches it; the event loop
only ever sees immutable messages (``RequestOutput``, acks, stats snapshots). A failing
``add_request`` fails that request alone; a failing ``step()`` fails the requests that were in
flight and the loop goes on serving new ones.

Admission control happens here, on the event loop, before anything is queued: when the engine's
waiting queue plus the adds not yet applied reach ``max_queued_requests``, ``add_group`` raises
``QueueFullError`` at once (the server answers 429).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from infer.core.outputs import RequestOutput
from infer.core.request import RequestTimings
from infer.core.sampling_params import InvalidRequestError, SamplingParams
from infer.engine.engine import QueueFullError

logger = logging.getLogger("infer.engine")


class EngineStoppedError(Exception):
    """The engine is shutting down or its thread has died (HTTP 503)."""


class RequestFailedError(Exception):
    """The engine failed while serving a request (HTTP 500 / an error event in a stream)."""


# ---- messages to the engine thread ---------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class AbortRequests:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class CallOnEngine:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future


@dataclass(frozen=True)
class _Ack:
    request_id: str
    error: BaseException | None


@dataclass(frozen=True)
class _Timeout:
    pass


_STOP = object()


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
        self._unacked = set(request_ids)
        self._unfinished = set(request_ids)
        self._last: dict[str, RequestOutput] = {}
        self._timer: asyncio.TimerHandle | None = None
        if deadline is not None:
            self._timer = asyncio.get_running_loop().call_at(
                deadline, self._queue.put_nowait, _Timeout()
            )

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: Any) -> None:  # event loop only
        self._queue.put_nowait(item)

    async def accepted(self) -> None:
        """Wait until the engine has taken every child; raise its refusal otherwise.

        ``InvalidRequestError`` (a 400: too long, can never fit) or ``RequestFailedError``.
        """
        while self._unacked:
            item = await self._queue.get()
            if isinstance(item, _Ack):
                self._unacked.discard(item.request_id)
                if item.error is not None:
                    # The engine refused it: it never ran, so it is not reported as finished.
                    self._unfinished.discard(item.request_id)
                    self._engine._streams.pop(item.request_id, None)
                    self.abort("a sibling request was refused")
                    raise item.error
            elif isinstance(item, _Timeout):
                self._queue.put_nowait(item)  # let iteration report it
                return
            else:  # an output before its ack cannot happen (FIFO hops), but keep it
                self._queue.put_nowait(item)
                await asyncio.sleep(0)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            while self._unfinished:
                item = await self._queue.get()
                if isinstance(item, _Ack):
                    self._unacked.discard(item.request_id)
                    if item.error is not None:
                        raise item.error
                    continue
                if isinstance(item, _Timeout):
                    for rid, out in self._abort_outputs("request timed out"):
                        yield self._index[rid], out
                    return
                out: RequestOutput = item
                if out.request_id not in self._unfinished:
                    continue
                self._last[out.request_id] = out
                if out.finished:
                    self._unfinished.discard(out.request_id)
                    self._engine._request_done(out.request_id, out)
                yield self._index[out.request_id], out
        finally:
            if self._unfinished:  # consumer went away (disconnect, error): abort the rest
                self.abort()
            if self._timer is not None:
                self._timer.cancel()

    def _abort_outputs(self, why: str) -> list[tuple[str, RequestOutput]]:
        """End every unfinished child as aborted: tell the engine, synthesise final deltas."""
        ids = [rid for rid in self.request_ids if rid in self._unfinished]
        if not ids:
            return []
        self._engine._send(AbortRequests(tuple(ids)))
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
            self._engine._request_done(rid, out)
            done.append((rid, out))
        logger.info("aborted %s (%s)", ",".join(ids), why)
        return done

    def abort(self, why: str = "client disconnected") -> None:
        """Abort every unfinished child (idempotent). Frees their KV blocks in the next step."""
        self._abort_outputs(why)
        if self._timer is not None:
            self._timer.cancel()


# ---- the engine owner --------------------------------------------------------------------------


class AsyncEngine:
    """Owns an ``LLMEngine`` on a background thread; safe to use from one asyncio event loop.

    ``on_finished(output)`` is called on the event loop for every engine request that ends
    (including aborts and timeouts) with its final ``RequestOutput`` - the metrics hook.
    """

    def __init__(
        self,
        engine: Any,
        *,
        max_queued_requests: int | None = None,
        request_timeout: float | None = None,
        on_finished: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.request_timeout = request_timeout
        self.on_finished = on_finished
        self.stats = engine.get_stats()  # snapshot, replaced after every step
        self.num_steps = 0
        self.num_step_failures = 0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._unapplied_adds = 0  # adds queued but not yet given to the engine
        self._engine_waiting = self.stats.num_waiting
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._accepting = True
        self.dead: BaseException | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="infer-engine", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        self._accepting = False

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def abort_all(self, why: str) -> None:
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.abort(why)

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
        """Stop the engine thread (after ``drain``)."""
        self.stop_accepting()
        self._commands.put(_STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ---- the event-loop API -------------------------------------------------------------------
    def add_group(
        self,
        requests: list[AddRequest],
    ) -> RequestStream:
        """Queue engine requests that answer one API request; raise ``QueueFullError`` when full.

        Never blocks: the 429 decision is made here, before anything reaches the engine.
        """
        if not self._accepting:
            raise EngineStoppedError("the server is shutting down")
        if self.dead is not None:
            raise EngineStoppedError(f"the engine has stopped: {self.dead}")
        bound = self.max_queued_requests
        if bound is not None and len(requests) > bound:  # would be refused forever: not a 429
            raise InvalidRequestError(
                f"this request needs {len(requests)} sequences but the waiting queue holds at "
                f"most {bound}",
                param="n",
            )
        with self._lock:
            queued = self._unapplied_adds + self._engine_waiting
            if bound is not None and queued + len(requests) > bound:
                raise QueueFullError(
                    f"the waiting queue is full ({queued} of {bound} requests waiting); retry later"
                )
            self._unapplied_adds += len(requests)
        deadline = None
        if self.request_timeout is not None:
            deadline = asyncio.get_running_loop().time() + self.request_timeout
        stream = RequestStream(self, [r.request_id for r in requests], deadline)
        for r in requests:
            self._streams[r.request_id] = stream
            self._commands.put(r)
        return stream

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(CallOnEngine(fn, future))
        return await asyncio.wrap_future(future)

    def _send(self, command: Any) -> None:
        self._commands.put(command)

    def _request_done(self, request_id: str, final: RequestOutput) -> None:
        self._streams.pop(request_id, None)
        if self.on_finished is not None:
            try:
                self.on_finished(final)
            except Exception:  # metrics must never break serving
                logger.exception("on_finished hook failed")

    # ---- event-loop side of the hop ---------------------------------------------------------
    def _dispatch(self, items: list) -> None:
        for item in items:
            rid = item.request_id
            stream = self._streams.get(rid)
            if stream is not None:
                stream._put(item)

    def _post(self, items: list) -> None:  # engine thread
        if items and self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closed under us at exit
                self._loop.call_soon_threadsafe(self._dispatch, items)

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                commands = [self._commands.get()] if idle else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                stop = _STOP in commands
                acks, aborted = self._apply([c for c in commands if c is not _STOP])
                self._post(acks)
                if stop:  # abort what is left, let the engine release it, and leave
                    for rid in list(self._streams):
                        with contextlib.suppress(Exception):
                            engine.abort_request(rid)
                    if engine.has_unfinished_requests():
                        engine.step()
                    self._publish_stats()
                    self._fail_all(EngineStoppedError("the engine was stopped"))
                    return
                if engine.has_unfinished_requests() or aborted:
                    self._post(self._step())
                self._publish_stats()
        except BaseException as e:  # noqa: BLE001 - the loop must report why it died
            logger.exception("engine thread died")
            self.dead = e
            self._fail_all(EngineStoppedError(f"the engine thread died: {e}"))

    def _publish_stats(self) -> None:
        with self._lock:
            self.stats = self.engine.get_stats()
            self._engine_waiting = self.stats.num_waiting

    def _apply(self, commands: list) -> tuple[list, bool]:
        engine = self.engine
        acks: list[_Ack] = []
        aborted = False
        adds = 0
        for cmd in commands:
            if isinstance(cmd, AddRequest):
                adds += 1
                error: BaseException | None = None
                try:
                    engine.add_request(
                        cmd.request_id,
                        cmd.prompt_token_ids,
                        cmd.params,
                        priority=cmd.priority,
                        cache_salt=cmd.cache_salt,
                        arrival_time=cmd.arrival_time,
                    )
                except (InvalidRequestError, QueueFullError) as e:
                    error = e
                except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop
                    logger.exception("add_request failed for %s", cmd.request_id)
                    error = RequestFailedError(f"{type(e).__name__}: {e}")
                acks.append(_Ack(cmd.request_id, error))
            elif isinstance(cmd, AbortRequests):
                for rid in cmd.request_ids:
                    try:
                        engine.abort_request(rid)
                        aborted = True
                    except Exception:  # noqa: BLE001
                        logger.exception("abort_request failed for %s", rid)
            elif isinstance(cmd, CallOnEngine) and cmd.future.set_running_or_notify_cancel():
                try:
                    cmd.future.set_result(cmd.fn(engine))
                except BaseException as e:  # noqa: BLE001
                    cmd.future.set_exception(e)
        if adds:
            ok = sum(1 for a in acks if a.error is None)
            with self._lock:
                self._unapplied_adds -= adds
                self._engine_waiting += ok
        return acks, aborted

    def _step(self) -> list:
        engine = self.engine
        try:
            outputs = engine.step()
            self.num_steps += 1
            return outputs
        except Exception as e:  # noqa: BLE001
            # We cannot tell which request broke the step: fail those in flight, keep serving.
            self.num_step_failures += 1
            logger.exception("engine step failed; failing the requests in flight")
            failed = []
            for rid in list(self._streams):
                with contextlib.suppress(Exception):
                    engine.abort_request(rid)
                failed.append(
                    RequestOutput(
                        request_id=rid,
                        new_token_ids=[],
                        new_text="",
                        finished=True,
                        finish_reason="error",
                        error=f"engine step failed: {type(e).__name__}: {e}",
                    )
                )
            return failed

    def _fail_all(self, error: BaseException) -> None:
        items = [
            RequestOutput(
                request_id=rid,
                new_token_ids=[],
                new_text="",
                finished=True,
                finish_reason="error",
                error=str(error),
            )
            for rid in list(self._streams)
        ]
        self._post(items)
