"""Several API server processes over one engine: ``infer serve --api-server-count N``.

One Python process parses requests, renders and writes streamed events for every client; at
tens of thousands of streamed tokens a second (a GPU engine at high concurrency) that process,
not the engine, sets the pace. With ``N`` > 1 the first process (the one ``infer serve``
started) starts the engine process with one pipe per API server (``engine.frontends``), then
binds its listening socket and starts ``N - 1`` more API server processes, each with a socket
of its own on the same port (:func:`listening_socket`): the kernel hands each new connection
to one of them, and each runs the same app over its own pipe::

    infer serve (api server 0) ──┬── engine process (FrontendMux: a pipe per API server)
      ├── api server 1 ──────────┤
      └── api server N-1 ────────┘

What stays the same for clients: every route, on any connection. ``/metrics`` and
``/dashboard`` count every request the engine served, whichever process answers (each
finished request's final output reaches every API server). What differs: a Responses API
response is kept by the process that served it (``GET /v1/responses/{id}`` and
``previous_response_id`` find it there only), and each log line names its process
(``[api1]``).

Start-up: each process listens once every one of them has built its app, so ``/health``
answers only when all serve. Lifecycle: a SIGTERM or SIGINT to the first process is passed on
to the others; each drains its own streams; the first stops the engine once the others have
left. An API server that dies takes the server down (exit status 1), as the engine's death
does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from infer.distributed.spawn import die_with_parent, spawnable_main

logger = logging.getLogger("infer.server")


def listening_socket(host: str, port: int, first: bool = False) -> socket.socket:
    """A socket bound to ``host:port``, not yet listening, for one API server process: every
    process binds one with ``SO_REUSEPORT`` and the kernel hashes each new connection to one
    of them, an even spread. ``first``: the first process's, which makes sure nothing holds
    the port yet (OSError "address in use", as with one API server): ``SO_REUSEPORT`` alone
    would let a second ``infer serve`` on the same port share it without a word.

    One socket shared by all instead has them race to accept: the first to wake takes every
    connection waiting (asyncio accepts in a loop), so a burst lands mostly on one process
    (64 connections opened at once over 4 processes: 63/1/0/0, 50/7/7/0, 33/20/8/3 on a
    2-core VM), and a client's keep-alive connections stay where they landed for the run."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # (as uvicorn tells them)
    if first:  # a plain bind fails on a port in use, SO_REUSEPORT or not
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (TIME_WAIT is free)
            probe.bind((host, port))
            port = probe.getsockname()[1]  # (--port 0: the port the kernel chose)
    sock = socket.socket(family)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class ApiServers:
    """The first API server's handle on the others: starts them, passes its exit signal on,
    waits for them to leave, and reports one that dies on its own."""

    def __init__(self, procs: list[Any]) -> None:
        self.procs = procs
        self.stopping = False

    @classmethod
    def start(cls, args: argparse.Namespace, settings: Any, engine: Any,
              port: int, timeout: float = 600.0) -> ApiServers:  # fmt: skip
        """Start an API server process for each of ``engine.api_server_conns``, on ``port``
        (the first's: the one asked for, or the one ``--port 0`` got); return once each has
        built its app and been told to listen (RuntimeError if one fails first or ``timeout``
        s pass)."""
        servers = cls([])
        try:
            readies = servers._spawn(args, settings, engine, port)
            servers._wait_ready(readies, timeout)
            for ready in readies:  # all built: listen
                ready.send(True)
                ready.close()
        except BaseException:  # (a Ctrl-C while they start too): none is left behind
            servers.kill()
            raise
        logger.info("%d more API server processes serve: %s", len(servers.procs),
                    ", ".join(str(p.pid) for p in servers.procs))  # fmt: skip
        return servers

    def _spawn(self, args: argparse.Namespace, settings: Any, engine: Any,
               port: int) -> list[Any]:  # fmt: skip
        """Start them, one per pipe in ``engine.api_server_conns``; each one's readiness pipe
        (it says when it has built its app, and is told when to listen)."""
        ctx = mp.get_context("spawn")
        count = len(engine.api_server_conns) + 1
        readies = []
        for index, conn in enumerate(engine.api_server_conns, start=1):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_api_server_main, name=f"infer-api-{index}",
                               args=(index, count, args, settings, conn, engine.info,
                                     str(engine.tokenizer_source), port, theirs,
                                     os.getpid()))  # fmt: skip
            with spawnable_main():
                proc.start()
            conn.close()  # theirs now: its end closes when that process leaves
            theirs.close()
            self.procs.append(proc)
            readies.append(ours)
        engine.api_server_conns = []
        return readies

    def _wait_ready(self, readies: list[Any], timeout: float) -> None:
        """Wait until each has built its app (RuntimeError: one failed, or ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        for proc, ready in zip(self.procs, readies, strict=True):
            if not ready.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"API server process {proc.pid} did not start in "
                                   f"{timeout:g}s")  # fmt: skip
            try:
                ready.recv()
            except EOFError:
                proc.join(5)
                raise RuntimeError(f"API server process {proc.pid} failed to start (code "
                                   f"{proc.exitcode}; its log says why)") from None  # fmt: skip

    def kill(self) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)

    def watch(self, on_death: Any) -> None:
        """Call ``on_death(why, failed)`` (from a thread) if one of them exits before ``stop``
        (``failed``: not with status 0, as one that drained on a signal of its own does)."""

        def run() -> None:
            ready = wait([p.sentinel for p in self.procs])
            if self.stopping:
                return
            dead = next(p for p in self.procs if p.sentinel in ready)
            dead.join(1)
            why = f"API server process {dead.pid} exited (code {dead.exitcode})"
            on_death(why, dead.exitcode != 0)

        threading.Thread(target=run, name="infer-api-servers", daemon=True).start()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Pass an exit signal on (each drains its streams, then leaves)."""
        self.stopping = True
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    async def stop(self, timeout: float) -> None:
        """Ask the others to leave and wait up to ``timeout`` s; kill those still there."""
        self.signal()

        def join() -> None:
            deadline = time.monotonic() + timeout  # (one grace for them all)
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    logger.warning("API server process %d did not leave: killing it", proc.pid)
                    proc.kill()
                    proc.join(5)

        await asyncio.to_thread(join)


def _api_server_main(index: int, count: int, args: argparse.Namespace, settings: Any,
                     conn: Any, info: dict, tokenizer_source: str, port: int,
                     ready: Any, parent: int) -> None:  # fmt: skip
    """API server ``index`` of ``count``: the app over its own pipe, on a socket of its own
    on the first's port."""
    die_with_parent()
    if os.getppid() != parent:  # the first died before the line above: leave the port free
        return
    from infer.engine.core_client import EngineConnection
    from infer.engine.heap import freeze_startup_heap
    from infer.model.tokenizer import load_tokenizer
    from infer.server.app import build_app
    from infer.server.cli import DrainingServer, configure_logging, uvicorn_config

    configure_logging(args.log_level, args.access_log, tag=f"api{index}")
    sock = listening_socket(args.host, port)
    engine = EngineConnection(conn, info, load_tokenizer(tokenizer_source))
    app = build_app(engine, settings)
    server = DrainingServer(uvicorn_config(app, args), app.state.async_engine,
                            args.drain_timeout)  # fmt: skip
    freeze_startup_heap()
    logger.info("API server %d of %d (process %d) serves", index + 1, count, os.getpid())
    ready.send(True)
    try:
        ready.recv()  # every API server has built its app: listen
    except EOFError:  # the first has gone
        return
    ready.close()
    server.run(sockets=[sock])
    sys.exit(server.exit_code)
