"""``infer serve --api-server-count N``: N processes serve HTTP on one port over one engine.
Every process answers as one server would (the offline engine's text, streamed or not), every
``/metrics`` counts every request, a drain reaches them all, and the death of one ends the
server."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from tests.server.conftest import assert_start_fails, start_server

from infer import SamplingParams
from infer.engine.core_client import ENGINE_START_GATE_ENV
from infer.engine.core_loop import STEP_DELAY_ENV

PROMPT = "The import statement combines two operations"
ACCESS = re.compile(r"infer\.access \[(api\d)\]")
SERVES = re.compile(r"API server 2 of 2 \(process (\d+)\) serves")
WAITS = re.compile(r"API server 2 of 2 \(process (\d+)\) waits for the engine")
ENGINE_UP = "engine runs in process"


@pytest.fixture(scope="module")
def server(llama_checkpoint, server_logs):
    # Each step sleeps 5 ms: the drain test's streams are in flight when the signal comes.
    yield from start_server(llama_checkpoint, server_logs, "--api-server-count", "2",
                            "--drain-timeout", "60", env={STEP_DELAY_ENV: "0.005"})  # fmt: skip


def _completion(server, stream: bool) -> tuple[str, dict]:
    """One greedy completion on a connection of its own (the kernel picks the process)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    if not stream:
        r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()
        return got["choices"][0]["text"], got["usage"]
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(ln) for ln in lines[:-1]]
    return "".join(e["choices"][0]["text"] for e in events if e["choices"]), events[-1]["usage"]


def _successes(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))  # fmt: skip


def test_every_api_server_answers_as_one_server_would(server, offline_llm):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = offline_llm.generate(PROMPT, greedy)[0].outputs[0].text
    sent = 0
    # New connections until each process has answered some (the kernel hands each to
    # whichever process accepts it first): streamed and whole, the offline engine's text.
    while sent < 80:
        for stream in (False, True):
            text, usage = _completion(server, stream)
            assert text == want and usage["completion_tokens"] == 8
            sent += 1
        tags = {m.group(1) for m in map(ACCESS.search, server.log().splitlines()) if m}
        if tags == {"api0", "api1"} and sent >= 8:
            break
    assert tags == {"api0", "api1"}, tags
    # Every process's /metrics counts every request, whichever served it (scrapes on new
    # connections land on either process).
    counts = {_successes(server) for _ in range(6)}
    assert counts == {float(sent)}
    server.wait_idle()


def test_a_burst_of_connections_spreads_over_the_api_servers(server):
    """128 connections opened at once, one request each, to the 2 idle API servers: each
    serves about half (a socket each, SO_REUSEPORT: the kernel hashes connections over them).
    On one shared socket the first process to wake took most of a burst (4 processes: 63/1/0/0
    of 64). One getting under 40 of 128 by chance: ~2e-5."""

    async def burst() -> list[int]:
        # (all at once on one client: none finds a free connection, each opens its own)
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
            replies = await asyncio.gather(*(client.get("/health") for _ in range(128)))
        return [r.status_code for r in replies]

    def served() -> collections.Counter:
        lines = server.log().splitlines()
        return collections.Counter(m.group(1) for m in map(ACCESS.search, lines)
                                   if m and '"GET /health"' in m.string)  # fmt: skip

    deadline = time.monotonic() + 10  # (the first listens a moment after it logs that it runs)
    while (listening := _listening_sockets(server.port)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert listening == 2  # one each, not one shared
    before = served()
    assert asyncio.run(burst()) == [200] * 128
    deadline = time.monotonic() + 30
    while sum((tags := served() - before).values()) < 128:  # (logged as each ends)
        assert time.monotonic() < deadline, tags
        time.sleep(0.05)
    counts = [tags["api0"], tags["api1"]]
    assert sum(counts) == 128 and min(counts) >= 40, counts


def test_a_drain_reaches_every_api_server_and_every_stream_finishes(server):
    """Last but one user of the module's server: SIGTERM to the first process only (as
    `kill PID` sends it); it passes the signal on, every process lets its streams finish,
    and all exit, the first with 0."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 120, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip

    def stream() -> list[str]:
        with httpx.stream("POST", server.base_url + "/completions", json=body,
                          timeout=120) as r:  # fmt: skip
            return [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]

    helper = int(SERVES.search(server.log()).group(1))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream) for _ in range(6)]
        deadline = time.monotonic() + 60
        while server.debug()["num_running"] < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        for f in streams:
            events = f.result()
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(60) == 0
    deadline = time.monotonic() + 30
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(helper)
    log = server.log()
    assert log.count("received SIGTERM") == 2  # each process drained
    assert "Traceback" not in log and "exited (code" not in log


def test_the_first_socket_refuses_a_port_another_server_holds():
    """The API servers share a port through SO_REUSEPORT; a second server started on that
    port must fail ("address in use") rather than quietly take a share of its connections."""
    from infer.server.api_servers import listening_socket

    with listening_socket("127.0.0.1", 0, first=True) as first:
        first.listen()
        port = first.getsockname()[1]
        with listening_socket("127.0.0.1", port) as helper:  # another API server of the same
            helper.listen()
            with pytest.raises(OSError) as e:
                listening_socket("127.0.0.1", port, first=True)
            assert e.value.errno == errno.EADDRINUSE


def _listening_sockets(port: int) -> int:
    """How many TCP sockets listen on ``port`` (IPv4, this network namespace)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    # local address "0100007F:1F90", state "0A" (LISTEN)
    return sum(1 for r in rows if int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "0A")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has left
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_an_api_server_that_dies_takes_the_server_down(llama_checkpoint, server_logs):
    gen = start_server(llama_checkpoint, server_logs, "--api-server-count", "2")
    server = next(gen)
    try:
        helper = int(SERVES.search(server.log()).group(1))
        os.kill(helper, signal.SIGKILL)
        assert server.proc.wait(60) == 1
        assert f"API server process {helper} exited (code -9)" in server.log()
    finally:
        gen.close()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--api-server-count", "2", "--no-engine-process"], "needs the engine in its own"),
        (["--api-server-count", "0"], "must be >= 1"),
        (["--api-server-count", "2", "--cpu-bind", "auto"], "does not combine with --cpu-bind"),
    ],
    ids=["no-engine-process", "zero", "cpu-bind"],
)
def test_what_it_does_not_combine_with_is_refused(flags, message, llama_checkpoint):
    assert_start_fails(llama_checkpoint, flags, message)


def _wait_for_line(
    path, pattern: re.Pattern, timeout: float = 120.0
) -> tuple[re.Match | None, str]:
    """The first match of ``pattern`` in the log at ``path`` (None after ``timeout`` s), and
    the log as it was then."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        match = pattern.search(text)
        if match or time.monotonic() > deadline:
            return match, text
        time.sleep(0.05)


def test_the_other_api_servers_start_while_the_engine_starts(llama_checkpoint, tmp_path):
    """The other API servers import their modules and bind their sockets while the engine
    starts (a model's load can take minutes), not after: with the engine held at start-up (a
    hook), the second process says it waits for the engine before the engine is up; let go,
    the engine starts and both serve."""
    gate = tmp_path / "engine-may-start"
    seen: dict = {}

    def open_the_gate_once_the_other_waits() -> None:
        try:
            match, text = None, ""
            deadline = time.monotonic() + 120
            while match is None and time.monotonic() < deadline:
                for log in logs.glob("server-*.log"):
                    match, text = _wait_for_line(log, WAITS, timeout=0)
                time.sleep(0.05)
            seen.update(waits=match is not None, engine_up=ENGINE_UP in text)
        finally:
            gate.touch()

    logs = tmp_path / "logs"
    logs.mkdir()
    thread = threading.Thread(target=open_the_gate_once_the_other_waits)
    thread.start()
    gen = start_server(llama_checkpoint, logs, "--api-server-count", "2",
                       env={ENGINE_START_GATE_ENV: str(gate)})  # fmt: skip
    try:
        server = next(gen)
        thread.join()
        assert seen == {"waits": True, "engine_up": False}
        text, usage = _completion(server, stream=False)
        assert usage["completion_tokens"] == 8
        assert SERVES.search(server.log())
    finally:
        thread.join()
        gen.close()


def _group_alive(pgid: int) -> list[int]:
    """The processes of group ``pgid`` still running (not zombies)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry))
    return alive


def _start_held(model, tmp_path, gate) -> tuple[subprocess.Popen, Path]:
    """``infer serve --api-server-count 2`` leading a process group of its own, its engine held
    at start-up until ``gate`` exists; the process and its log."""
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "infer.server", "--model", str(model),
           "--port", "0", "--api-server-count", "2"]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               **{ENGINE_START_GATE_ENV: str(gate)})  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    return proc, log


def _assert_the_group_is_gone(proc: subprocess.Popen, timeout: float) -> None:
    """``proc`` (a group leader) exits non-zero within ``timeout`` s, and nothing of its group
    is left."""
    assert proc.wait(timeout) != 0
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _group_alive(proc.pid) == []


def test_a_ctrl_c_while_the_engine_starts_leaves_no_process_behind(llama_checkpoint, tmp_path):
    """A Ctrl-C in the terminal (SIGINT to the whole process group) while the engine starts:
    the first process leaves and takes the others and the engine with it (both ignore the
    signal until they serve: the first decides)."""
    proc, log = _start_held(llama_checkpoint, tmp_path, tmp_path / "never")
    try:
        match, text = _wait_for_line(log, WAITS)
        assert match, text
        assert ENGINE_UP not in text
        os.killpg(proc.pid, signal.SIGINT)
        _assert_the_group_is_gone(proc, 60)
        assert not _alive(int(match.group(1)))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_port_taken_while_the_engine_loads_ends_the_start_with_no_process_left(
    llama_checkpoint, tmp_path
):
    """The API servers' sockets are bound, not listening, while the engine loads; a program
    that takes the port meanwhile makes their listen fail once the engine is up. The first
    process must then leave, not wait on the others and the engine for ever (both ignore the
    SIGTERM multiprocessing's exit sends)."""
    import socket

    gate = tmp_path / "engine-may-start"
    proc, log = _start_held(llama_checkpoint, tmp_path, gate)
    taker = socket.socket()
    try:
        match, text = _wait_for_line(log, WAITS)
        assert match, text
        port = int(re.search(r"port (\d+) held", text).group(1))
        taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taker.bind(("127.0.0.1", port))
        taker.listen()
        gate.touch()
        _assert_the_group_is_gone(proc, 120)
        assert "address already in use" in log.read_text().lower()
    finally:
        taker.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_tokenizer_is_loaded_early_only_from_a_plain_local_folder(llama_checkpoint, tmp_path):
    """The other API servers load the tokenizer while the engine starts where its folder is
    known then (the one the first will name: the model's resolved, or ``--tokenizer``'s); a
    built-in model or a GGUF file is resolved by the engine's start, so they wait for it."""
    from types import SimpleNamespace

    from infer.server.api_servers import tokenizer_folder_now

    def config(model, tokenizer=None):
        return SimpleNamespace(model=SimpleNamespace(model=model, tokenizer=tokenizer))

    link = tmp_path / "link"
    link.symlink_to(llama_checkpoint)
    assert tokenizer_folder_now(config(str(link))) == str(llama_checkpoint.resolve())
    assert tokenizer_folder_now(config("small", tokenizer=str(link))) == str(link)
    assert tokenizer_folder_now(config("small")) is None
    assert tokenizer_folder_now(config(None)) is None
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert tokenizer_folder_now(config(str(gguf))) is None
