"""Real server processes on loopback for the server tests (one per test module)."""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

STARTUP_TIMEOUT = 180.0  # a loaded 2-core machine can take a while to import torch
# Replicas on a local Ray Serve: Ray's own start, then each replica's (40-90 s measured on a
# loaded 2-core machine, and a test may start a second cluster beside the first). The server
# gives its replicas 300 s itself.
RAY_STARTUP_TIMEOUT = 420.0
RAY_FLAGS = ("--data-parallel-size", "--prefill-replicas", "--decode-replicas")


_SERVER_NUMBERS = itertools.count()  # (each server's log file: server-N.log)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m infer.server`` in a subprocess, its log in a file, ready once /health is 200."""

    def __init__(
        self,
        model: Path,
        *args: str,
        log_dir: Path,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        new_session: bool = False,
    ):
        ray = any(flag in args for flag in RAY_FLAGS)
        # --port 0: the kernel's choice, read from the log once it serves. A port chosen here
        # and given could be taken before the server binds it (an ephemeral port the kernel
        # hands a tensor-parallel worker's gloo socket, another test's server). Ray Serve's
        # proxy wants a port named.
        self.port = free_port() if ray else 0
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_dir / f"server-{next(_SERVER_NUMBERS)}.log"
        cmd = [sys.executable, "-m", "infer.server", "--model", str(model),
               "--port", str(self.port), "--served-model-name", "tiny", *args]  # fmt: skip
        if api_key:
            cmd += ["--api-key", api_key]
        # NOTE: one intra-op thread. On a shared 2-core box, torch's spinning OpenMP threads make
        # a tiny model's forward pass up to 100x slower under contention (measured: 18 s vs
        # 0.2 s for 64 prompts x 16 tokens at load average 10); the tests are about behaviour.
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS="1", **(env or {}))  # fmt: skip
        self._log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the process
        self._local = threading.local()  # each polling thread's client (see debug())
        # new_session: the server leads a process group of its own (and its children), which a
        # test can signal as a whole, as systemd or `kill -- -PGID` do.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=new_session)  # fmt: skip
        self._wait_ready(RAY_STARTUP_TIMEOUT if ray else STARTUP_TIMEOUT, own_log=not ray)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait_ready(self, timeout: float, own_log: bool = True) -> None:
        """Until ``/health`` answers 200 from this process: ``own_log``, once its log says
        which port uvicorn serves (``--port 0``; with a port given, another test's server
        starting at the same moment on it must not have its 200 taken for this one's, whose
        SIGTERM handler is not installed yet)."""
        deadline = time.monotonic() + timeout
        # NOTE: one client for every poll. httpx.get builds a client each call, loading the CA
        # bundle: ~20 ms of CPU a poll, taken from the server starting on a 2-core box. With one
        # client a refused connection costs ~0.1 ms, so the interval can be short (each of the
        # ~25 starts in tests/server waits half an interval past ready, on average).
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
                if own_log and not self.port:
                    serving = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)",
                                        self.log())  # fmt: skip
                    if serving:
                        self.port = int(serving.group(1))
                        self.url = f"http://127.0.0.1:{self.port}"
                if self.port:
                    try:
                        if client.get(self.url + "/health").status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_lines(self, needle: str, timeout: float = 10.0) -> list[str]:
        """The log's lines holding ``needle``, waiting up to ``timeout`` for a first one: the
        server may write a line (the access log's) a moment after the client has its answer."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [ln for ln in self.log().splitlines() if needle in ln]
            if lines or time.monotonic() > deadline:
                return lines
            time.sleep(0.05)

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60, **kwargs)

    def debug(self) -> dict:
        # NOTE: a client kept per thread: httpx.get builds one a call (~20 ms of CPU, loading
        # the CA bundle), and wait_running / wait_idle poll every 20-50 ms on a 2-core box.
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(headers=self.headers, timeout=10)
        return client.get(self.url + "/debug/engine").json()

    def wait_running(self, count: int, timeout: float = 30.0) -> dict:
        """Poll until at least ``count`` requests are in flight; return the stats."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.debug()
            if stats["in_flight"] >= count:
                return stats
            time.sleep(0.02)
        raise AssertionError(f"fewer than {count} requests in flight: {self.debug()}")

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Poll until no request is in flight and every KV block is free; return the stats."""
        deadline = time.monotonic() + timeout
        stats = self.debug()
        while time.monotonic() < deadline:
            stats = self.debug()
            idle = stats["in_flight"] == 0 and stats["num_running"] == 0
            if (
                idle
                and stats["num_waiting"] == 0
                and stats["num_free_blocks"] == stats["num_total_blocks"]
            ):
                return stats
            time.sleep(0.05)
        raise AssertionError(f"server did not go idle: {stats}")

    def stream_and_kill(self, pid: int, body: dict) -> list[str]:
        """Stream ``body`` from /completions, SIGKILL ``pid`` once the first event has arrived,
        and return the ``data:`` payloads received up to the end of the stream."""
        with httpx.stream("POST", self.base_url + "/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            os.kill(pid, signal.SIGKILL)
            return [line[6:] for line in lines if line.startswith("data: ")]

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def llama_checkpoint(tiny_checkpoints) -> Path:
    """The tiny random Llama checkpoint every server test serves."""
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


def assert_start_fails(model: Path, flags: list[str], message: str) -> None:
    """``infer.server`` with ``flags`` exits non-zero at start-up, ``message`` on stderr and no
    traceback."""
    cmd = [sys.executable, "-m", "infer.server", "--model", str(model),
           "--port", "0", *flags]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def start_server(
    model: Path,
    log_dir: Path,
    *args: str,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    new_session: bool = False,
):
    """A context-managed server: yields it, terminates it after."""
    server = ServerProcess(model, *args, log_dir=log_dir, api_key=api_key, env=env,
                           new_session=new_session)  # fmt: skip
    try:
        yield server
    finally:
        server.terminate()


T = TypeVar("T")


def concurrently(request: Callable[[T], Any], items: Iterable[T]) -> list[Any]:
    """``[request(item) for item in items]``, the requests in flight together (one batch on the
    server: many sequential requests would each pay a whole step per token), results in order."""
    items = list(items)
    with ThreadPoolExecutor(max(1, len(items))) as pool:
        return list(pool.map(request, items))


SHARED_KEY = "test-key-123"


@pytest.fixture(scope="session")
def shared_server(llama_checkpoint, server_logs):
    """One server for the API, bad-input and concurrency tests (an API key, 64 sequence slots)."""
    yield from start_server(llama_checkpoint, server_logs, "--max-num-seqs", "64",
                            api_key=SHARED_KEY)  # fmt: skip


@pytest.fixture(scope="session")
def offline_llm(llama_checkpoint):
    """The offline API on the same checkpoint: the reference the server's text must equal."""
    import torch

    from infer import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see ServerProcess: contention makes 2 spinning threads crawl
    try:
        yield LLM(str(llama_checkpoint), max_num_seqs=64)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_engine(llama_checkpoint, offline_llm):
    """An in-process ``LLMEngine`` for the bridge and in-process app tests (after offline_llm,
    which pins one intra-op thread)."""
    from infer.config import EngineConfig
    from infer.engine.engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(model=str(llama_checkpoint), max_num_seqs=8))
