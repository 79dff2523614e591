"""Several API server processes over one engine: ``infer serve --api-server-count N``.

One Python process parses requests, renders and writes streamed events for every client; at
tens of thousands of streamed tokens a second (a GPU engine at high concurrency) that process,
not the engine, sets the pace. With ``N`` > 1 the first process (the one ``infer serve``
started) binds its listening socket, starts ``N - 1`` more API server processes, each with a
socket of its own on the same port (:func:`listening_socket`), and then the engine process,
with one pipe per API server (``engine.frontends``): the kernel hands each new connection to
one of the API servers, and each runs the same app over its own pipe::

    infer serve (api server 0) ──┬── engine process (FrontendMux: a pipe per API server)
      ├── api server 1 ──────────┤
      └── api server N-1 ────────┘

What stays the same for clients: every route, on any connection. ``/metrics`` and
``/dashboard`` count every request the engine served, whichever process answers (each
finished request's final output reaches every API server). What differs: a Responses API
response is kept by the process that served it (``GET /v1/responses/{id}`` and
``previous_response_id`` find it there only), and each log line names its process
(``[api1]``).

Start-up: the others import their modules while the engine starts, and build their apps once
it is up; each process listens once every one of them has built its app, so ``/health``
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
from pathlib import Path
from typing import Any

from infer.distributed.spawn import leave_shutdown_to_parent, spawnable_main

logger = logging.getLogger("infer.server")


def listening_socket(host: str, port: int, first: bool = False,
                     shared: bool = True) -> socket.socket:  # fmt: skip
    """A socket bound to ``host:port``, not yet listening, for one API server process: every
    process binds one with ``SO_REUSEPORT`` and the kernel hashes each new connection to one
    of them, an even spread. ``first``: the first process's, which makes sure nothing holds
    the port yet (OSError "address in use", as with one API server): ``SO_REUSEPORT`` alone
    would let a second ``infer serve`` on the same port share it without a word. Not
    ``shared``: the one API server's socket, bound as uvicorn binds one (no ``SO_REUSEPORT``).

    One socket shared by all instead has them race to accept: the first to wake takes every
    connection waiting (asyncio accepts in a loop), so a burst lands mostly on one process
    (64 connections opened at once over 4 processes: 63/1/0/0, 50/7/7/0, 33/20/8/3 on a
    2-core VM), and a client's keep-alive connections stay where they landed for the run."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # (as uvicorn tells them)
    if first and shared:  # a plain bind fails on a port in use, SO_REUSEPORT or not
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (TIME_WAIT is free)
            probe.bind((host, port))
            port = probe.getsockname()[1]  # (--port 0: the port the kernel chose)
    sock = socket.socket(family)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class ApiServers:
    """The first API server's handle on the others: starts them, passes its exit signal on,
    waits for them to leave, and reports one that dies on its own.

    They start in two steps, so that their imports overlap the engine's start (a model's load
    can take minutes; each process's imports take seconds): :meth:`spawn` before the engine
    (each imports its modules, binds its socket and waits), :meth:`start` once it is up (each
    gets the engine's start-up info, builds its app and, once all have, listens)::

        first:   bind ─ spawn ─ engine starts ......... up ─ start: send ─ wait built ─ go
        api k:          imports ─ bind ─ wait ......... recv ─ tokenizer, app ─ built ─ listen
    """

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.engine_ends: list[Any] = []  # the engine's end of each one's pipe
        self._readies: list[Any] = []  # each one's readiness pipe
        self.stopping = False

    @classmethod
    def spawn(cls, args: argparse.Namespace, port: int,
              tokenizer_source: str | None = None) -> ApiServers:  # fmt: skip
        """Start ``args.api_server_count - 1`` API server processes on ``port`` (the first's:
        the one asked for, or the one ``--port 0`` got), before the engine. Each gets a pipe
        to the engine; the engine's ends wait in ``engine_ends`` for the engine process.
        ``tokenizer_source``: the tokenizer's folder where it is known before the engine is
        up (:func:`tokenizer_folder_now`): each loads it while it waits."""
        ctx = mp.get_context("spawn")
        servers = cls()
        count = args.api_server_count
        try:
            for index in range(1, count):
                engine_end, server_end = ctx.Pipe()
                ours, theirs = ctx.Pipe()
                servers.engine_ends.append(engine_end)
                servers._readies.append(ours)
                # (they ignore SIGTERM until they serve: a failed start kills them, kill())
                proc = ctx.Process(target=_api_server_main, name=f"infer-api-{index}",
                                   args=(index, count, args, server_end, port, theirs,
                                         os.getpid(), tokenizer_source))  # fmt: skip
                with spawnable_main():
                    proc.start()
                servers.procs.append(proc)
                server_end.close()  # theirs now: its end closes when that process leaves
                theirs.close()
        except BaseException:  # (a Ctrl-C while they start too): none is left behind
            servers.kill()
            raise
        return servers

    def start(self, settings: Any, engine: Any, timeout: float = 600.0) -> None:
        """Once the engine is up: hand each the app's settings and the engine's start-up info;
        return once each has built its app and been told to listen (RuntimeError if one fails
        first or ``timeout`` s pass; then none is left)."""
        try:
            for ready in self._readies:
                # OSError: it has gone (its imports failed, it was killed): said below, at
                # the end of its readiness pipe
                with contextlib.suppress(OSError):
                    ready.send((settings, engine.info, str(engine.tokenizer_source)))
            self._wait_ready(timeout)
            for proc, ready in zip(self.procs, self._readies, strict=True):  # all built: listen
                try:
                    ready.send(True)
                except OSError:
                    raise RuntimeError(f"API server process {proc.pid} exited during "
                                       "start-up") from None  # fmt: skip
                ready.close()
        except BaseException:  # (a Ctrl-C while they start too): none is left behind
            self.kill()
            raise
        logger.info("%d more API server processes serve: %s", len(self.procs),
                    ", ".join(str(p.pid) for p in self.procs))  # fmt: skip

    def _wait_ready(self, timeout: float) -> None:
        """Wait until each has built its app (RuntimeError: one failed, or ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        for proc, ready in zip(self.procs, self._readies, strict=True):
            if not ready.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"API server process {proc.pid} did not start in "
                                   f"{timeout:g}s")  # fmt: skip
            try:
                ready.recv()
            except (EOFError, OSError):  # (OSError: it left with our message unread)
                proc.join(5)
                raise RuntimeError(f"API server process {proc.pid} failed to start (code "
                                   f"{proc.exitcode}; its log says why)") from None  # fmt: skip

    def kill(self) -> None:
        """End them now (a failed start, or a second Ctrl-C)."""
        self.stopping = True
        for conn in self.engine_ends + self._readies:
            conn.close()
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


def tokenizer_folder_now(config: Any) -> str | None:
    """The folder the first API server will load its tokenizer from, where that is plainly a
    local folder (``--tokenizer``'s, or the model's; the name it will give it): None where it
    is known only once the engine is up (a built-in model, a GGUF file, a hub id)."""
    if config.model.tokenizer:
        return config.model.tokenizer if Path(config.model.tokenizer).is_dir() else None
    model = Path(str(config.model.model)).expanduser() if config.model.model else None
    if model is None or not (model / "config.json").is_file():
        return None
    return str(model.resolve())


def _api_server_main(index: int, count: int, args: argparse.Namespace, conn: Any,
                     port: int, ready: Any, parent: int,
                     tokenizer_source: str | None) -> None:  # fmt: skip
    """API server ``index`` of ``count``: the app over its own pipe, on a socket of its own
    on the first's port. Started before the engine: it imports what its app needs (and loads
    the tokenizer from ``tokenizer_source`` where that is known) while the engine starts, waits
    for the engine's start-up info on ``ready``, then builds its app."""
    # Until it serves, the first decides: a Ctrl-C in the terminal reaches the whole process
    # group, and the first ends the others (its own exit, or kill()) -- no traceback from each.
    # uvicorn sets its own handlers when it serves.
    leave_shutdown_to_parent()
    if os.getppid() != parent:  # the first died before the line above: leave the port free
        return
    from infer.engine.heap import freeze_startup_heap, frozen_imports

    with frozen_imports():  # (as the first's: no full collections walking the new modules)
        import infer.engine.engine  # noqa: F401 - (the classes the engine's info carries)
        from infer.engine.core_client import EngineConnection
        from infer.model.tokenizer import load_tokenizer
        from infer.server.app import build_app
        from infer.server.cli import DrainingServer, configure_logging, listen, uvicorn_config

        configure_logging(args.log_level, args.access_log, tag=f"api{index}")
        sock = listening_socket(args.host, port)
        tokenizer = None
        if tokenizer_source is not None:
            # (the first loads the same one and says what is wrong with it, if anything)
            with contextlib.suppress(Exception):
                tokenizer = load_tokenizer(tokenizer_source)
    logger.info("API server %d of %d (process %d) waits for the engine", index + 1, count,
                os.getpid())  # fmt: skip
    try:
        settings, info, source = ready.recv()  # the engine is up
    except (EOFError, OSError):  # the engine did not start: the first is leaving
        return
    if tokenizer is None or source != tokenizer_source:
        tokenizer = load_tokenizer(source)
    engine = EngineConnection(conn, info, tokenizer)
    app = build_app(engine, settings)
    server = DrainingServer(uvicorn_config(app, args), app.state.async_engine,
                            args.drain_timeout)  # fmt: skip
    freeze_startup_heap()
    logger.info("API server %d of %d (process %d) serves", index + 1, count, os.getpid())
    try:
        ready.send(True)
    except OSError:  # the first has gone (or is killing us)
        return
    try:
        ready.recv()  # every API server has built its app: listen
    except (EOFError, OSError):  # the first has gone (or is killing us)
        return
    ready.close()
    try:
        listen([sock], server.config.backlog)
    except OSError as e:  # (the first goes down with us: its watch)
        logger.error("cannot serve on %s:%d: %s", args.host, port, e)
        sys.exit(1)
    server.run(sockets=[sock])
    sys.exit(server.exit_code)
