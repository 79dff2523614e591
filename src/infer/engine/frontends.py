"""One engine process, several API server processes (``--api-server-count``): the engine
side's routing of commands and replies over one pipe per API server.

One Python process writes at most some tens of thousands of streamed events a second (each a
render, a socket write and several hops through asyncio and the ASGI stack); a GPU engine
makes tokens faster than that. Several API server processes share the listening socket (the
kernel hands each new connection to one of them) and each talks to the engine over a pipe of
its own::

    api server 0 (the first: starts the rest) ─ pipe 0 ─┐
    api server 1                              ─ pipe 1 ─┼─ FrontendMux ─ run_engine_loop(LLMEngine)
    api server N-1                            ─ pipe N-1┘

:class:`FrontendMux` gives the engine loop the commands of every pipe and sends each reply
where it belongs:

- a request's ``Ack`` and outputs go to the API server that added it;
- a ``CallResult`` goes to the API server that asked (call ids are renumbered on the way in,
  since every API server counts its own from 0, and back on the way out);
- ``StatsUpdate`` and ``EngineStopped`` go to every API server;
- a finished request's final output also goes to every other API server, as
  ``FinishedElsewhere`` (without its payloads): each one's ``/metrics`` and ``/dashboard``
  count every request the engine served, whichever process a scrape lands on.

``Stop`` from API server 0 stops the engine; from any other, or a pipe that closes, only that
API server leaves: its requests are aborted and it gets its own ``EngineStopped``.

The engine never waits on one API server's pipe (:class:`Outbox`): a process that stops
reading (stopped, swapped out, hung) would otherwise fill its pipe and stall the engine, and
every other API server's streams with it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from infer.core.outputs import RequestOutput
from infer.core.sampling_params import InvalidRequestError
from infer.engine.core_loop import (
    AbortRequests,
    Ack,
    AddRequest,
    CallEngine,
    CallResult,
    EngineStopped,
    FinishedElsewhere,
    Stop,
)

logger = logging.getLogger(__name__)


class Outbox:
    """One API server's pipe, written so that the engine never waits on it.

    A message goes straight into the pipe while nothing is queued and the pipe has room for
    it (the common case: no thread hop, the order kept); otherwise it is queued for a writer
    thread of this pipe's own, which waits for the reader instead of the engine. A pipe whose
    reader has gone (its end closed) takes nothing more; the mux's reading side finds it gone.
    """

    WARN_BACKLOG = 1000  # messages queued behind a reader that does not read: said at 1k, 10k, ...

    def __init__(self, conn: Any, name: str) -> None:
        self.conn = conn
        self.name = name
        self.broken = False
        self._queued = 0  # messages handed to the writer (counted by the engine's thread)
        self._written = 0  # ... of which written (counted by the writer's thread)
        self._warn_at = self.WARN_BACKLOG
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._room = select.poll()
        self._room.register(conn.fileno(), select.POLLOUT)
        # A Unix socket pair is writable while three quarters of its send buffer are free
        # (counted with each chunk's overhead): a quarter of the buffer goes in unblocked.
        with socket.socket(fileno=conn.fileno()) as sock:
            try:
                self._direct_limit = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 4
            finally:
                sock.detach()  # (the descriptor is the connection's)

    @property
    def backlog(self) -> int:
        """Messages queued and not yet written."""
        return self._queued - self._written

    def send(self, obj: Any) -> None:
        if self.broken:
            return
        buf = ForkingPickler.dumps(obj)
        # NOTE: with nothing queued the writer is not writing either (it counts a message
        # written only once it is), so this thread may write without interleaving with it.
        if not self.backlog and len(buf) <= self._direct_limit and self._room.poll(0):
            try:
                self.conn.send_bytes(buf)
            except OSError:
                self.broken = True
            return
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write, name=f"outbox-{self.name}", daemon=True
            )
            self._writer.start()
        self._queued += 1
        self._queue.put(buf)
        if self.backlog >= self._warn_at:
            logger.warning("%s has not read %d messages the engine sent it; the engine goes "
                           "on without waiting", self.name, self.backlog)  # fmt: skip
            self._warn_at *= 10

    def _write(self) -> None:
        while (buf := self._queue.get()) is not None:
            if not self.broken:
                try:
                    self.conn.send_bytes(buf)
                except OSError:
                    self.broken = True
            self._written += 1

    def close(self, timeout: float) -> None:
        """Write what is queued, waiting at most ``timeout`` seconds for a slow reader."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout)


class FrontendMux:
    """The engine loop's ``next_commands`` and ``emit`` over one connection per API server
    (``multiprocessing`` connections; ``pack`` turns a list of replies into what crosses)."""

    def __init__(self, conns: list[Any], pack: Callable[[list], list]) -> None:
        self.conns = list(conns)
        self.pack = pack
        self.outboxes = [Outbox(c, f"API server {i}") for i, c in enumerate(self.conns)]
        self.live = set(range(len(conns)))
        self.owner: dict[str, int] = {}  # request id -> the API server that added it
        self.calls: dict[int, tuple[int, int]] = {}  # engine call id -> (API server, its id)
        self._call_ids = itertools.count()
        self._refused: list[tuple[int, Ack]] = []  # answered here, sent with the next replies
        self._left: list[int] = []  # API servers that sent Stop: answered with EngineStopped

    # ---- commands in ----------------------------------------------------------------------
    def next_commands(self, block: bool) -> list:
        """The commands that have arrived on every pipe (waiting for one when ``block``)."""
        commands: list = []
        while True:
            ready = wait([self.conns[i] for i in sorted(self.live)], None if block else 0)
            for conn in ready:
                index = self.conns.index(conn)
                try:
                    while True:
                        self._take(index, conn.recv(), commands)
                        if index not in self.live or not conn.poll(0):
                            break
                except (EOFError, OSError):
                    self._leave(index, commands)
            if not self.live and not any(isinstance(c, Stop) for c in commands):
                commands.append(Stop())  # every API server has gone
            if commands or not block or self._refused or self._left:
                return commands

    def _take(self, index: int, command: Any, commands: list) -> None:
        if isinstance(command, AddRequest):
            rid = command.request_id
            if rid in self.owner:  # another API server's request has that id
                error = InvalidRequestError(f"request id {rid!r} is already in use", param=None)
                self._refused.append((index, Ack(rid, error)))
                return
            self.owner[rid] = index
        elif isinstance(command, AbortRequests):
            mine = tuple(r for r in command.request_ids if self.owner.get(r) == index)
            command = AbortRequests(mine)
        elif isinstance(command, CallEngine):
            call_id = next(self._call_ids)
            self.calls[call_id] = (index, command.call_id)
            command = dataclasses.replace(command, call_id=call_id)
        elif isinstance(command, Stop) and index != 0:
            self._leave(index, commands)
            self._left.append(index)
            return
        commands.append(command)

    def _leave(self, index: int, commands: list) -> None:
        """API server ``index`` has gone (or is going): abort what it had in flight."""
        self.live.discard(index)
        ids = tuple(r for r, i in self.owner.items() if i == index)
        if ids:
            commands.append(AbortRequests(ids))

    # ---- replies out ----------------------------------------------------------------------
    def emit(self, replies: list) -> None:
        """Send each reply to the API server(s) it belongs to (see the module docstring)."""
        n = len(self.conns)
        out: list[list] = [[] for _ in range(n)]
        for index, ack in self._refused:
            out[index].append(ack)
        self._refused.clear()
        for r in replies:
            kind = type(r)
            if kind is RequestOutput:
                index = self.owner.get(r.request_id)
                if r.finished and index is not None:  # (a second end of one request: dropped)
                    self.owner.pop(r.request_id, None)
                    seen = FinishedElsewhere(dataclasses.replace(
                        r, kv_payload=None, embedding=None, prompt_logprobs=None,
                        new_logprobs=[]))  # fmt: skip
                    for other in self.live:
                        if other != index:
                            out[other].append(seen)
                if index is not None:
                    out[index].append(r)
            elif kind is Ack:
                index = self.owner.get(r.request_id)
                if r.error is not None:
                    self.owner.pop(r.request_id, None)
                if index is not None:
                    out[index].append(r)
            elif kind is CallResult:
                index, call_id = self.calls.pop(r.call_id, (None, 0))
                if index is not None:
                    out[index].append(dataclasses.replace(r, call_id=call_id))
            else:  # StatsUpdate, EngineStopped: everyone's
                for replies_of in out:
                    replies_of.append(r)
        for index in self._left:
            out[index].append(EngineStopped())
        left, self._left = set(self._left), []
        for index in range(n):
            if out[index] and (index in self.live or index in left):
                # (one that has gone: its pipe's end tells next_commands)
                self.outboxes[index].send(self.pack(out[index]))

    def close(self, error: str | None = None, timeout: float = 5.0) -> None:
        """The engine stops: with ``error``, every API server still there is told why; what
        is queued is written, waiting at most ``timeout`` seconds in all for slow readers."""
        if error is not None:
            for index in self.live:
                self.outboxes[index].send([EngineStopped(error=error)])
        deadline = time.monotonic() + timeout
        for box in self.outboxes:
            box.close(max(0.0, deadline - time.monotonic()))
