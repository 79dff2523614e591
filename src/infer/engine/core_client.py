"""Where the engine loop runs: a thread of this process, or a process of its own.

Both clients take commands (``core_loop.AddRequest``, ...) through ``send`` and hand every list
of replies the loop emits to ``on_replies``, called on a background thread of this process::

    ThreadCore    event loop ── SimpleQueue ──► engine thread: run_engine_loop(LLMEngine)
                  event loop ◄── on_replies ◄──┘

    EngineProcess event loop ── pipe ──► engine process: run_engine_loop(LLMEngine)
                  event loop ◄── on_replies ◄── reader thread ◄── pipe ◄──┘

In its own process the engine has its own GIL: the forward pass never waits for HTTP parsing,
tokenization or SSE writing in the server process, and a step's outputs cross the pipe as one
pickled list. The child ignores SIGINT (Ctrl+C in a terminal reaches the whole process group;
the server drains, then sends ``Stop``), and dies with its parent. If it dies on its own, the
reader thread sees the pipe close and reports ``EngineStopped(error=...)``.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from infer.config import EngineConfig
from infer.core.outputs import RequestOutput
from infer.core.request import RequestTimings
from infer.distributed.spawn import leave_shutdown_to_parent, spawnable_main
from infer.engine.affinity import CpuBinding, bind_engine_threads, bind_process
from infer.engine.core_loop import (
    Ack,
    AddRequest,
    EngineStopped,
    RequestFailedError,
    Stop,
    run_engine_loop,
)
from infer.engine.heap import freeze_startup_heap, frozen_imports

logger = logging.getLogger("infer.engine")

Replies = Callable[[list], None]


class ThreadCore:
    """The engine loop on a thread of this process (``LLM``-style use, tests, ``--no-engine-process``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, on_replies: Replies) -> None:
        def next_commands(block: bool) -> list:
            items = [self._commands.get()] if block else []
            while True:
                try:
                    items.append(self._commands.get_nowait())
                except queue.Empty:
                    return items

        def run() -> None:
            try:
                run_engine_loop(self.engine, next_commands, on_replies)
            except BaseException as e:  # noqa: BLE001 - report why the loop died
                logger.exception("engine thread died")
                on_replies([EngineStopped(error=f"the engine thread died: {e}")])

        self._thread = threading.Thread(target=run, name="infer-engine", daemon=True)
        self._thread.start()

    def send(self, command: Any) -> None:
        self._commands.put(command)

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        self.engine.close()


# Tests: the engine process waits to build its engine until this file exists (a start-up
# that provably lasts until the test says so).
ENGINE_START_GATE_ENV = "INFER_TEST_ENGINE_START_GATE"

# What the server reads off the engine once, at start-up.
_ATTRS = (
    "model_name",
    "max_model_len",
    "model_path",
    "capacity",
    "eos_token_ids",
    "config",
    "spec",
    "lora_adapters",
    "lora_parents",
    "sampling_defaults",
    "embedding_size",
    "token_embedding_size",
    "token_classes",
    "late_interaction",
)


def _child(
    conn,
    config: EngineConfig,
    log_level: int,
    torch_threads: int | None,
    binding: CpuBinding | None = None,
    other_conns: tuple = (),
) -> None:
    """The engine process: build the engine, then run the loop over the pipe (over one pipe
    per API server with ``other_conns``: ``engine.frontends``)."""
    # The server decides when to stop: a SIGTERM or SIGINT sent to the whole process group
    # (systemd, kill -- -PGID, Ctrl-C) must drain through it, not kill the engine mid-stream.
    leave_shutdown_to_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if binding is not None:  # before torch starts its threads: they stay on the bound cores
        os.sched_setaffinity(0, {binding.main} | binding.workers)
        if torch_threads is None:
            torch_threads = binding.num_threads
    with frozen_imports():
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
        from infer.engine.engine import LLMEngine

    gate = os.environ.get(ENGINE_START_GATE_ENV)
    while gate and not os.path.exists(gate):
        time.sleep(0.02)
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - report why, then exit
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    info = {name: getattr(engine, name) for name in _ATTRS}
    info["startup_stats"] = engine.get_stats()
    info["frozen_objects"] = freeze_startup_heap()
    if binding is not None:  # start-up ran the kernels: every compute thread exists now
        bind_engine_threads(binding)
    conn.send(("ok", info))

    def next_commands(block: bool) -> list:
        items = []
        try:
            if block:
                items.append(conn.recv())
            while conn.poll(0):
                items.append(conn.recv())
        except EOFError:  # the parent is gone: stop
            items.append(Stop())
        return items

    def emit(replies: list) -> None:
        conn.send(pack_for_pipe(replies))

    mux = None
    if other_conns:
        from infer.engine.frontends import FrontendMux

        mux = FrontendMux([conn, *other_conns], pack_for_pipe)
        next_commands, emit = mux.next_commands, mux.emit  # noqa: F811 - one pipe per server
    error = None
    try:
        run_engine_loop(engine, next_commands, emit)
    except BaseException as e:  # noqa: BLE001 - say why before the pipe closes
        error = f"the engine died: {e}"
        if mux is None:
            with contextlib.suppress(OSError):
                conn.send([EngineStopped(error=error)])
        raise
    finally:
        if mux is not None:  # (its writers hold what a slow reader has not taken yet)
            mux.close(error)
        engine.close()


def pack_for_pipe(replies: list) -> list:
    """The replies as they cross the pipe to the server: each ``RequestOutput`` as a plain
    tuple of its fields, the rest (acks, stats, call results) as they are, in order.

    The engine process sends one per running request every step, so this is on the engine's
    critical path: pickling 64 outputs as dataclasses (the default slots state) took ~0.3 ms
    a step (a fifth of a GPU engine process's samples at C=64), as tuples ~0.05 ms with the
    packing. An unfinished request's output carries only the timestamps of this step's new
    tokens, not its whole ``token_times``: sent whole, each step's message grew with every
    request's length (64 streams of 2,000 tokens: ~1 MB a step). The server side puts the
    outputs and the lists back together (:class:`TokenTimesMirror`).
    """
    packed: list = []
    # NOTE: the fields written out, not ``output_fields`` + a replaced timings entry: the
    # slicing to replace it made this 0.048 -> 0.080 ms for 64 outputs (test_pipe_messages
    # checks that every field crosses).
    for r in replies:
        if type(r) is RequestOutput:
            t = r.timings
            if t is not None:
                times = t.token_times
                new = len(r.new_token_ids)
                if not r.finished and len(times) > new:
                    # (by the output's own count: an output made during the next step, on the
                    # GPU step, is sent after that step has added its tokens' times)
                    end = r.num_output_tokens
                    times = times[end - new : end]
                t = (t.arrival, t.first_scheduled, t.first_token, times, t.finished)
            r = (r.request_id, r.new_token_ids, r.new_text, r.new_logprobs, r.finished,
                 r.finish_reason, r.stop_reason, r.num_prompt_tokens, r.num_output_tokens,
                 r.num_cached_tokens, t, r.error, r.prompt_logprobs, r.kv_payload,
                 r.embedding)  # fmt: skip
        packed.append(r)
    return packed


class TokenTimesMirror:
    """The server side of :func:`pack_for_pipe`: makes each packed output a ``RequestOutput``
    again, keeps each running request's ``token_times`` and gives every output the whole list,
    so consumers (the metrics, an abort that reuses the last output's timings) see what an
    in-process engine gives them."""

    def __init__(self) -> None:
        self._times: dict[str, list[float]] = {}

    def unpack(self, replies: list) -> list:
        return [self._output(r) if type(r) is tuple else r for r in replies]

    def _output(self, fields: tuple) -> RequestOutput:
        out = RequestOutput(*fields)
        if out.timings is None:
            return out
        out.timings = timings = RequestTimings(*out.timings)
        times = timings.token_times
        if out.finished:
            self._times.pop(out.request_id, None)
        elif len(times) >= out.num_output_tokens:  # sent whole
            self._times[out.request_id] = times
        else:  # the tail: the tokens before it are the ones already held
            held = self._times.setdefault(out.request_id, [])
            del held[max(0, out.num_output_tokens - len(times)) :]
            held.extend(times)
            timings.token_times = held
        return out


def _tokenizer_source_now(config: EngineConfig) -> str | Path | None:
    """Where the engine's tokenizer is, if finding it builds nothing: ``None`` for a built-in
    model not built yet (the child builds it; the tokenizer is loaded after)."""
    if config.model.tokenizer:
        return config.model.tokenizer
    from infer.builtin import BUILTIN_NAMES, builtin_dir
    from infer.builtin.cache import is_complete
    from infer.engine.model_source import DEFAULT_MODEL, resolve_model_path

    name = DEFAULT_MODEL if config.model.model is None else str(config.model.model)
    if name in BUILTIN_NAMES and not is_complete(builtin_dir(name)):
        return None
    return resolve_model_path(name)


def _cores(cores: frozenset[int]) -> str:
    return ",".join(map(str, sorted(cores)))


class _PipeClient:
    """The server's end of a pipe to the engine process: commands out, replies in on a reader
    thread (``start``)."""

    _conn: Any

    def _init_pipe(self) -> None:
        self._send_lock = threading.Lock()
        self._outbox: queue.SimpleQueue | None = None  # see send()
        self._on_replies: Replies | None = None
        self._reader: threading.Thread | None = None

    def _gone(self) -> EngineStopped:
        """What the pipe's end means."""
        return EngineStopped(error="the engine process has gone")

    def start(self, on_replies: Replies) -> None:
        mirror = TokenTimesMirror()
        self._on_replies = on_replies

        def read() -> None:
            while True:
                try:
                    replies = self._conn.recv()
                except (EOFError, OSError):
                    on_replies([self._gone()])
                    return
                replies = mirror.unpack(replies)
                on_replies(replies)
                if any(isinstance(r, EngineStopped) for r in replies):
                    return

        self._reader = threading.Thread(target=read, name="infer-engine-reader", daemon=True)
        self._reader.start()

    def send(self, command: Any) -> None:
        if self._outbox is None and not (
            isinstance(command, AddRequest) and command.kv_payload is not None
        ):
            with self._send_lock, contextlib.suppress(OSError, BrokenPipeError):
                self._conn.send(command)
            return
        # NOTE: a transferred KV payload is tens of MB: pickled and pushed through the pipe on
        # the event loop, it froze every stream of this server until the engine, between two
        # steps, had read it all (the decode side's inter-token latency showed it). From the
        # first such command on, one thread sends every command, in order, from a queue.
        if self._outbox is None:
            self._outbox = queue.SimpleQueue()
            threading.Thread(target=self._send_queued, name="infer-engine-send",
                             daemon=True).start()  # fmt: skip
        self._outbox.put(command)

    def _send_queued(self) -> None:
        assert self._outbox is not None
        while True:
            command = self._outbox.get()
            try:
                with self._send_lock:
                    self._conn.send(command)
            except (OSError, BrokenPipeError):
                pass  # the engine is gone: the reader thread reports it
            except Exception as e:  # noqa: BLE001 - e.g. no memory to pickle: fail the request
                logger.exception("sending %s to the engine failed", type(command).__name__)
                if isinstance(command, AddRequest) and self._on_replies is not None:
                    self._on_replies([Ack(command.request_id, RequestFailedError(
                        f"could not hand the request to the engine: {e}"))])  # fmt: skip

    def join(self, timeout: float) -> None:
        if self._reader is not None:
            self._reader.join(timeout)


class EngineProcess(_PipeClient):
    """The engine loop in a child process; exposes what the server reads off an engine."""

    def __init__(
        self,
        config: EngineConfig,
        torch_threads: int | None = None,
        binding: CpuBinding | None = None,
        meanwhile: Callable[[], object] | None = None,
        frontends: Sequence[Connection] = (),
    ) -> None:
        """Start the engine process and return once its engine is built.

        ``meanwhile`` runs in this process while the child builds its engine (the server
        imports its app there), after the server's tokenizer is loaded. ``frontends``: the
        engine's ends of the pipes of more API server processes (``--api-server-count``; each
        an :class:`EngineConnection` at the other end): the engine listens on those beside
        this process's (``engine.frontends``); they are the child's once it has started.
        """
        ctx = mp.get_context("spawn")  # a clean interpreter: no inherited threads or locks
        self._conn, child_conn = ctx.Pipe()
        # A daemonic process may not start processes of its own: with tensor parallelism the
        # engine starts its workers, so it is not one (it still dies with us: PDEATHSIG).
        self._proc = ctx.Process(target=_child, name="infer-engine",
                                 args=(child_conn, config, logging.getLogger().level, torch_threads,
                                       binding, tuple(frontends)),
                                 daemon=config.parallel.tensor_parallel_size == 1)  # fmt: skip
        with spawnable_main():
            self._proc.start()
        child_conn.close()
        for conn in frontends:
            conn.close()
        self._init_pipe()
        try:
            self._finish_start(config, binding, meanwhile)
        except BaseException:
            # NOTE: the child ignores SIGTERM and SIGINT (its parent ends it) and waits on the
            # pipe: left alone it would keep this process's exit waiting on it for ever
            # (multiprocessing joins its children at exit), a Ctrl-C during start-up included.
            self._conn.close()
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(10)
            raise

    def _finish_start(
        self,
        config: EngineConfig,
        binding: CpuBinding | None,
        meanwhile: Callable[[], object] | None,
    ) -> None:
        """The rest of start-up once the child runs: this process's own work meanwhile, then
        the child's answer."""
        # The server tokenizes and renders chat templates itself, from the child's files. It
        # loads its tokenizer (importing torch and transformers) while the child builds the
        # engine: loaded after the child's answer, it added ~3 s to the ~3.5 s start of a tiny
        # model on 2 cores. A failure here is raised once the child has answered, so a child
        # that failed says why first.
        from infer.model.tokenizer import load_tokenizer

        tokenizer: Any = None
        tokenizer_error: Exception | None = None
        source: str | Path | None = None
        try:
            source = _tokenizer_source_now(config)
            if source is not None:
                tokenizer = load_tokenizer(source)
        except Exception as e:  # noqa: BLE001 - raised below, after the child's answer
            tokenizer_error = e
        if meanwhile is not None:
            meanwhile()
        try:
            status, info = self._conn.recv()
        except EOFError as e:
            raise RuntimeError(
                f"the engine process exited during start-up (code {self._proc.exitcode})"
            ) from e
        if status != "ok":
            self._proc.join(10)
            raise RuntimeError(f"the engine process failed to start: {info}")
        self.info = info  # (for the other API servers' EngineConnection)
        for name, value in info.items():
            setattr(self, name, value)
        if tokenizer_error is not None:
            error, tokenizer_error = tokenizer_error, None  # no cycle through this frame
            raise RuntimeError(f"the server could not load the tokenizer: {error}") from error
        if tokenizer is None:  # a built-in model the child has just built
            from infer.engine.model_source import resolve_model_path

            try:
                source = resolve_model_path(config.model.model)
                tokenizer = load_tokenizer(source)
            except Exception as e:  # noqa: BLE001 - named as the start-up's failure
                raise RuntimeError(f"the server could not load the tokenizer: {e}") from e
        self.tokenizer = tokenizer
        self.tokenizer_source = source
        logger.info("engine runs in process %d (%d start-up objects frozen out of the garbage "
                    "collector's full passes)", self._proc.pid, self.frozen_objects)  # fmt: skip
        if binding is not None:  # after the spawn: the child started with every core
            bind_process(binding.server)
            logger.info("cores: engine main thread %d, its other threads %s, server %s",
                        binding.main, _cores(binding.workers), _cores(binding.server))  # fmt: skip

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _gone(self) -> EngineStopped:
        code = self._proc.exitcode
        if code is None:
            self._proc.join(5)
            code = self._proc.exitcode
        return EngineStopped(error=f"the engine process exited (code {code})")

    def kill(self) -> None:
        """End the child now (nothing stopped it: it ignores SIGINT and SIGTERM)."""
        self._conn.close()
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5)

    def close(self) -> None:
        """Wait for the child to leave (after ``Stop``); kill it if it does not."""
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


class EngineConnection(_PipeClient):
    """Another API server's end of its own pipe to the engine process (``--api-server-count``):
    what :class:`EngineProcess` gives the server (its start-up ``info``, a tokenizer), without
    the process, which the first API server owns. ``Stop`` from here ends this API server's
    use of the engine, not the engine."""

    def __init__(self, conn: Any, info: dict, tokenizer: Any) -> None:
        self._conn = conn
        self._init_pipe()
        for name, value in info.items():
            setattr(self, name, value)
        self.tokenizer = tokenizer

    def close(self) -> None:
        self._conn.close()
