"""The servers the online benchmarks drive, started and stopped one way for all of them.

A server runs in a process group of its own (its engine process, vLLM's engine core, a local
Ray's workers go with it), its command line and output in a log file; it is ready once
``GET /health`` answers 200; stopping it sends SIGTERM to the whole group, SIGKILL to what is
left after a grace period, and waits for its port to free::

    proc, url = launch_server(cmd, port, log)    # start_server + wait_healthy, stopped on failure
    ...
    stop_server(proc, port)

    with serving(cmd, env, log, port) as (proc, url, startup_s):   # stopped on the way out
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import queue
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infer.bench.client import RequestRecord


def free_port() -> int:
    """A port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on ``host:port`` (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_port_free(port: int, timeout_s: float = 30.0) -> bool:
    t0 = time.perf_counter()
    while not port_is_free(port):
        if time.perf_counter() - t0 > timeout_s:
            return False
        time.sleep(0.5)
    return True


def start_server(cmd: list[str], env: dict | None, log_path: Path, port: int) -> subprocess.Popen:
    """Start a server in its own session (process group), its command line and output to
    ``log_path``. Refuses to start when ``port`` is taken: whatever listens there is not ours
    to stop."""
    if not port_is_free(port):
        raise RuntimeError(f"port {port} is already in use; pick another with --port")
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")  # noqa: SIM115 - closed by stop_server
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    proc.log_file = log  # type: ignore[attr-defined]
    return proc


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> float:
    """Seconds until ``GET url/health`` answers 200; raises (naming the log) if ``proc`` exits
    or time runs out."""
    log = getattr(getattr(proc, "log_file", None), "name", "its log")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode} before becoming healthy; see {log}"
            )
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return time.perf_counter() - t0
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server did not become healthy in {timeout_s:.0f} s; see {log}")


def stop_server(proc: subprocess.Popen, port: int | None = None, grace_s: float = 60) -> None:
    """SIGTERM the server (it drains and stops what it started: its engine process, its Ray),
    then SIGKILL what is left of its process group after it exits or ``grace_s`` passes.

    The group is killed even when the leader exited on time, so workers it spawned (vLLM's
    engine core, infer's engine process) never outlive it; then waits for ``port`` to free."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, if any
    proc.wait()
    log = getattr(proc, "log_file", None)
    if log is not None:
        log.close()
    if port is not None and not wait_port_free(port):
        print(f"warning: port {port} still busy after stopping the server", flush=True)


def launch_server(
    cmd: list[str],
    port: int,
    log: Path,
    env: dict | None = None,
    timeout_s: float = 600,
    grace_s: float = 60,
) -> tuple[subprocess.Popen, str]:
    """:func:`start_server` then :func:`wait_healthy`: ``(process, url)`` once ``/health``
    answers 200. A server that exits, does not come up in time, or is interrupted (Ctrl+C) is
    stopped, with its process group."""
    proc = start_server(cmd, env, log, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s)
    except BaseException:  # Ctrl+C included: never leave a server (and its Ray) behind
        stop_server(proc, grace_s=grace_s)
        raise
    return proc, url


@contextlib.contextmanager
def serving(
    cmd: list[str],
    env: dict | None,
    log: Path,
    port: int,
    timeout_s: float = 600,
    grace_s: float = 60,
) -> Iterator[tuple[subprocess.Popen, str, float]]:
    """:func:`start_server`, then ``(process, url, seconds until healthy)`` for the block; the
    server is stopped (:func:`stop_server`, ``grace_s`` to drain, its port freed) when the
    block ends, however it ends, and also when it never becomes healthy."""
    proc = start_server(cmd, env, log, port)
    url = f"http://127.0.0.1:{port}"
    try:
        yield proc, url, wait_healthy(url, proc, timeout_s)
    finally:
        stop_server(proc, port, grace_s)


async def closed_loop(
    base: str, prompts: list[list[int]], concurrency: int, out_len: int, model: str = "m"
) -> tuple[list[RequestRecord], float]:
    """``prompts`` (token ids) streamed through infer's own HTTP client, ``concurrency`` in
    flight, ``out_len`` greedy tokens each with ignore_eos: the records and the wall time."""
    from infer.bench.client import (  # the bench extra
        RequestRecord,
        build_payload,
        new_client,
        stream_request,
    )

    todo = list(enumerate(prompts))
    records: list[RequestRecord] = []
    async with new_client() as client:

        async def worker() -> None:
            while todo:
                i, ids = todo.pop(0)
                rec = RequestRecord(
                    index=i, prompt_len_target=len(ids), max_tokens=out_len, scheduled_s=0.0
                )
                payload = build_payload(model, ids, out_len)  # greedy, ignore_eos, usage
                records.append(await stream_request(client, base, payload, rec))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - t0


def _closed_loop_child(which: int, base: str, prompts: list[list[int]], concurrency: int,
                       out_len: int, model: str, start: Any, results: Any) -> None:  # fmt: skip
    """One client process of :func:`closed_loop_processes`: waits for its siblings, runs."""
    start.wait()
    t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across the processes
    records, _ = asyncio.run(closed_loop(base, prompts, concurrency, out_len, model))
    results.put((which, records, t0, time.perf_counter()))


def closed_loop_processes(
    base: str,
    prompts: list[list[int]],
    concurrency: int,
    out_len: int,
    processes: int,
    model: str = "m",
) -> tuple[list[RequestRecord], float]:
    """:func:`closed_loop` spread over ``processes`` client processes started together.

    Prompt ``i`` goes to process ``i % processes``, the ``concurrency`` streams are shared out
    among them. One Python process reading server-sent events tops out at some tens of thousands
    of events a second (httpx parses each line in Python), below what a GPU server streams at
    C=64: the server would be measured at the client's speed. The records (indices as in
    ``prompts``) and the wall time from the first process's start to the last one's end.
    """
    processes = max(1, min(processes, concurrency, len(prompts)))
    if processes == 1:
        return asyncio.run(closed_loop(base, prompts, concurrency, out_len, model))
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(processes), ctx.Queue()
    children = []
    for p in range(processes):
        share = concurrency // processes + (p < concurrency % processes)
        args = (p, base, prompts[p::processes], share, out_len, model, start, results)
        child = ctx.Process(target=_closed_loop_child, args=args, daemon=True)
        child.start()
        children.append(child)
    gathered = []
    try:
        while len(gathered) < len(children):
            try:
                gathered.append(results.get(timeout=1.0))
            except queue.Empty:
                failed = [c.exitcode for c in children if c.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"a client process exited with code {failed[0]}") from None
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
    records = []
    for p, recs, _, _ in gathered:
        for r in recs:
            r.index = r.index * processes + p  # child p's i-th prompt is prompts[i * P + p]
        records += recs
    records.sort(key=lambda r: r.index)
    wall = max(end for *_, end in gathered) - min(t0 for _, _, t0, _ in gathered)
    return records, wall


def summarize(records: list[RequestRecord], wall: float) -> dict:
    """Completed requests, output tok/s, TTFT and ITL percentiles (ms) of a closed loop."""
    from infer.bench.metrics import percentile

    ok = [r for r in records if r.success]
    ttft = [1000 * r.ttft_s for r in ok]
    itl = [1000 * x for r in ok for x in r.itls_s]
    return {
        "completed": len(ok),
        "configured": len(records),
        "output_tok_s": sum(r.output_tokens or 0 for r in ok) / wall,
        "ttft_ms": {f"p{p}": percentile(ttft, p) for p in (50, 95, 99)},
        "itl_ms": {f"p{p}": percentile(itl, p) for p in (50, 95, 99)},
        "errors": sorted({r.error for r in records if r.error})[:3],
    }
