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
import itertools
import multiprocessing
import os
import queue
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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


def parse_arm(text: str) -> tuple[str, str, list[str]]:
    """``NAME=SRC[:FLAGS]``, a benchmark's arm: a name, the source folder its server runs from
    (``PYTHONPATH``; ``src`` when empty) and server flags: ``(name, src, flags)``."""
    name, _, rest = text.partition("=")
    src, _, flags = rest.partition(":")
    return name, src or "src", shlex.split(flags)


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
    cpu0 = time.process_time()
    records, _ = asyncio.run(closed_loop(base, prompts, concurrency, out_len, model))
    results.put((which, records, t0, time.perf_counter(), time.process_time() - cpu0))


def closed_loop_processes(
    base: str,
    prompts: list[list[int]],
    concurrency: int,
    out_len: int,
    processes: int,
    model: str = "m",
    span: ClientSpan | None = None,
) -> tuple[list[RequestRecord], float]:
    """:func:`closed_loop` spread over ``processes`` client processes started together.

    Prompt ``i`` goes to process ``i % processes``, the ``concurrency`` streams are shared out
    among them. One Python process reading server-sent events tops out at a few thousand events
    a second (httpx parses each line in Python: ~2,400 a second, a core kept busy, on a 2-core
    AMD EPYC VM it shared with the server), below what a GPU server streams at C=64: the server
    would be measured at the client's speed. The records (indices as in ``prompts``) and the
    wall time from the first process's start to the last one's end; ``span``, when given, gets
    that window and each client process's CPU seconds.
    """
    processes = max(1, min(processes, concurrency, len(prompts)))
    if processes == 1:
        t0, cpu0 = time.perf_counter(), time.thread_time()  # (this thread runs the loop)
        records, wall = asyncio.run(closed_loop(base, prompts, concurrency, out_len, model))
        if span is not None:
            span.start, span.end = t0, time.perf_counter()
            span.cpu_s = [time.thread_time() - cpu0]
        return records, wall
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
    for p, recs, *_ in gathered:
        for r in recs:
            r.index = r.index * processes + p  # child p's i-th prompt is prompts[i * P + p]
        records += recs
    records.sort(key=lambda r: r.index)
    start, end = min(g[2] for g in gathered), max(g[3] for g in gathered)
    if span is not None:
        span.start, span.end = start, end
        span.cpu_s = [g[4] for g in sorted(gathered, key=lambda g: g[0])]
    return records, end - start


@dataclass
class ClientSpan:
    """When a closed loop's clients ran (``time.perf_counter()``: CLOCK_MONOTONIC, one clock
    for every process of the machine) and the CPU seconds each client process used."""

    start: float = 0.0
    end: float = 0.0
    cpu_s: list[float] = field(default_factory=list)


def stat_fields(text: str) -> list[str]:
    """The fields of a Linux ``/proc/<pid>/stat`` text after ``pid (comm)``, the state first
    (split after the last ``)``: a command name may hold spaces and parentheses)."""
    return text[text.rfind(")") + 2 :].split()


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far, from Linux's
    ``/proc/<pid>/stat``; None where it cannot be read (another OS, a process gone)."""
    try:
        fields = stat_fields(Path(f"/proc/{pid}/stat").read_text())
        ticks = int(fields[11]) + int(fields[12])  # utime, stime
    except (OSError, IndexError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


class CpuPoller:
    """Samples some processes' CPU seconds every ``interval_s`` on a thread, so that the cores
    each kept busy over a window known only afterwards (a load's :class:`ClientSpan`) can be
    read off::

        with CpuPoller({"api_server": pid, "engine": engine_pid}) as poller:
            records, wall = closed_loop_processes(..., span=span)
        poller.cores(span.start, span.end)   # {"api_server": 0.45, "engine": 0.97}
    """

    def __init__(self, pids: dict[str, int], interval_s: float = 0.05) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float | None]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-poller", daemon=True)

    def sample(self) -> None:
        cpu = {name: process_cpu_s(pid) for name, pid in self.pids.items()}
        self.samples.append((time.perf_counter(), cpu))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> CpuPoller:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def cores(self, start: float, end: float) -> dict[str, float | None]:
        """Each process's CPU seconds over ``[start, end]`` divided by its length: the cores it
        kept busy on average (:func:`cores_between`)."""
        return {name: cores_between(self.samples, name, start, end) for name in self.pids}


class GpuUtilPoller:
    """``nvidia-smi``'s GPU utilization (the share of its last sample period in which a kernel
    ran), read every ``interval_ms`` by one ``nvidia-smi -lms`` process and a thread, so that
    its mean over a window known only afterwards (a load's) says whether the GPU or the host
    set the pace: a host-bound step leaves the GPU idle between its kernels. Without
    ``nvidia-smi`` (a CPU machine) there are no samples and every mean is None::

        with GpuUtilPoller() as gpu:
            records, wall = closed_loop_processes(..., span=span)
        gpu.mean(span.start, span.end)   # 97.5
    """

    # A sample averages the driver's last period (1/6 s to 1 s by the product, nvidia-smi's
    # manual says): those read this soon after a window opens still hold what came before it.
    SETTLE_S = 0.2

    def __init__(self, interval_ms: int = 100, index: int = 0, command: str = "nvidia-smi"):
        self.interval_ms = interval_ms
        self.index = index
        self.command = command
        self.samples: list[tuple[float, float]] = []
        self.unread: list[str] = []  # the last lines that were no number (an error, say)
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuUtilPoller:
        import shutil

        exe = shutil.which(self.command)
        if exe is None:
            return self
        query = ["--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        self._proc = subprocess.Popen(
            [exe, f"--id={self.index}", *query, f"--loop-ms={self.interval_ms}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._thread = threading.Thread(target=self._read, name="gpu-util", daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                value = float(line.split(",")[0])
            except ValueError:  # ("[N/A]", a warning, an error)
                self.unread = [*self.unread[-2:], line.strip()[:200]]
                continue
            self.samples.append((time.perf_counter(), value))

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            if self._proc.poll() is None:
                self._proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()

    def window(self, start: float, end: float) -> list[float]:
        """The samples read in ``[start + SETTLE_S, end]``."""
        return [value for t, value in self.samples if start + self.SETTLE_S <= t <= end]

    def mean(self, start: float, end: float) -> float | None:
        """The mean utilization (%) over ``[start, end]`` (:meth:`window`; None: no sample)."""
        inside = self.window(start, end)
        return sum(inside) / len(inside) if inside else None

    def report(self, start: float, end: float, log: Callable[[str], None]) -> dict:
        """A load's ``gpu_busy_pct`` and ``gpu_busy_samples`` over ``[start, end]``; when it
        got no sample, logs the last line nvidia-smi wrote that was no number (its error)."""
        busy = self.mean(start, end)
        if busy is None and self.unread:
            log(f"nvidia-smi: {self.unread[-1]}")
        return {"gpu_busy_pct": busy, "gpu_busy_samples": len(self.window(start, end))}


class MetricsPoller:
    """Reads a server's ``/metrics`` every ``interval_s`` on a thread: the running and waiting
    requests' gauges, whose means over a window known only afterwards (a load's
    :class:`ClientSpan`) say how full the batch was; and, first and last, the latency
    histograms' sums and counts, whose differences give the server's own mean time to first
    token, queue time and request latency over the load (what the clients add is the rest)::

        with MetricsPoller(url) as server:
            records, wall = closed_loop_processes(..., span=span)
        server.gauge_means(span.start, span.end)   # {"running": 61.2, "waiting": 0.4}
        server.histogram_means_ms()                # {"ttft": 7.9, "queue": 1.1, "e2e": 190.3}
    """

    GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"}
    HISTOGRAMS = {
        "ttft": "vllm:time_to_first_token_seconds",
        "queue": "vllm:request_queue_time_seconds",
        "e2e": "vllm:e2e_request_latency_seconds",
    }

    def __init__(self, url: str, interval_s: float = 0.1) -> None:
        self.url = url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-poller", daemon=True)

    def scrape(self) -> dict[str, float]:
        """The gauges and the histograms' ``_sum`` / ``_count``, each summed over its labels
        (empty when the server does not answer)."""
        from prometheus_client.parser import text_string_to_metric_families

        wanted = set(self.GAUGES.values()) | {
            f"{name}{part}" for name in self.HISTOGRAMS.values() for part in ("_sum", "_count")
        }
        values: dict[str, float] = {}
        try:
            with urllib.request.urlopen(self.url, timeout=2) as resp:
                text = resp.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name in wanted:
                        values[sample.name] = values.get(sample.name, 0.0) + sample.value
        except Exception:  # noqa: BLE001 - a read that failed (a reset, a cut page) counts, no more
            self.errors += 1
            return {}
        return values

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            values = self.scrape()
            if values:
                self.samples.append((time.perf_counter(), values))

    def __enter__(self) -> MetricsPoller:
        self.first = self.scrape()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.last = self.scrape()

    def gauge_means(self, start: float, end: float) -> dict[str, float | None]:
        """Each gauge's mean over the samples read in ``[start, end]`` (None: none was)."""
        inside = [values for t, values in self.samples if start <= t <= end]
        means: dict[str, float | None] = {}
        for key, name in self.GAUGES.items():
            seen = [v[name] for v in inside if name in v]
            means[key] = sum(seen) / len(seen) if seen else None
        return means

    def histogram_means_ms(self) -> dict[str, float | None]:
        """Each histogram's mean (ms) over what it counted between the first and last reads."""
        means: dict[str, float | None] = dict.fromkeys(self.HISTOGRAMS)
        if not self.first or not self.last:  # (a delta from the server's start: no mean)
            return means
        for key, name in self.HISTOGRAMS.items():
            counted = self.last.get(f"{name}_count", 0.0) - self.first.get(f"{name}_count", 0.0)
            total = self.last.get(f"{name}_sum", 0.0) - self.first.get(f"{name}_sum", 0.0)
            means[key] = 1000 * total / counted if counted > 0 else None
        return means


def cores_between(
    samples: list[tuple[float, dict[str, float | None]]], name: str, start: float, end: float
) -> float | None:
    """Process ``name``'s CPU seconds between ``start`` and ``end`` (each read linearly between
    the two samples around it) over ``end - start``; None for an empty window, one the samples
    do not cover, or a process whose samples are missing."""
    points = [(t, cpu[name]) for t, cpu in samples if cpu.get(name) is not None]
    if end <= start or len(points) < 2 or not points[0][0] <= start < end <= points[-1][0]:
        return None

    def at(t: float) -> float:
        for (t0, c0), (t1, c1) in itertools.pairwise(points):
            if t0 <= t <= t1:
                return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)
        raise AssertionError("t is inside the samples")

    return (at(end) - at(start)) / (end - start)


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
