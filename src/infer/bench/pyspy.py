"""Where a running server's processes spend their time: ``py-spy record`` on each, summed up.

The yardstick for "where does the time go" on a server under load is a sampling profiler on the
real processes, not a guess. ``py-spy`` (a static binary: ``pip install py-spy``, or carried to a
machine without one) attaches to a live process; its ``raw`` output is one line per distinct
stack (``frame;frame;...;frame count``), which :func:`top_frames` folds into the functions with
the most samples of their own (self) and under them (inclusive).
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
from pathlib import Path

PY_SPY_ENV = "INFER_PY_SPY"


def find_py_spy() -> str | None:
    """``$INFER_PY_SPY``, else ``py-spy`` on the PATH, else None."""
    path = os.environ.get(PY_SPY_ENV)
    if path and os.access(path, os.X_OK):
        return path
    return shutil.which("py-spy")


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux: ``/proc/PID/task/*/children``)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            with open(task / "children") as f:
                children += [int(p) for p in f.read().split()]
        except OSError:  # a thread that ended since the listing
            continue
    return children


def spawned_children(server_pid: int) -> list[int]:
    """The ``multiprocessing`` spawn children of ``infer serve`` (not the resource tracker, also
    a child), oldest first: the engine process, then any more API server processes
    (``--api-server-count``: started once the engine is up)."""
    found = []
    for pid in child_pids(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        except (OSError, IndexError, ValueError):
            continue
        if b"spawn_main" in cmdline:
            found.append((started, pid))
    return [pid for _, pid in sorted(found)]


def engine_pid(server_pid: int) -> int | None:
    """The engine process of ``infer serve`` (its first spawn child)."""
    children = spawned_children(server_pid)
    return children[0] if children else None


def api_server_pids(server_pid: int) -> list[int]:
    """Every API server process of ``infer serve``: itself, then those it started."""
    return [server_pid, *spawned_children(server_pid)[1:]]


def record(py_spy: str, pid: int, seconds: float, out: Path, rate: int = 200) -> subprocess.Popen:
    """Start sampling ``pid`` for ``seconds`` into ``out`` (raw format); wait on the result."""
    cmd = [py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
           "--rate", str(rate), "--format", "raw", "--output", str(out), "--nonblocking"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def top_frames(raw: Path, n: int = 15) -> dict:
    """The ``n`` functions with the most samples of their own (``self``) and under them
    (``inclusive``), as ``[share of samples, "function (file:line)"]``, from a raw profile."""
    own: collections.Counter[str] = collections.Counter()
    under: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = stack.split(";")
        own[frames[-1]] += samples
        for frame in set(frames):
            under[frame] += samples
    if not total:
        return {"samples": 0, "self": [], "inclusive": []}

    def share(counter: collections.Counter[str]) -> list[list]:
        return [[round(c / total, 4), f] for f, c in counter.most_common(n)]

    return {"samples": total, "self": share(own), "inclusive": share(under)}
