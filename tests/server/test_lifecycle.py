"""Request timeouts, prefix caching through the API, and SIGTERM draining to a clean exit."""

from __future__ import annotations

import errno
import json
import os
import re
import signal

import httpx
import openai
import pytest
from tests.server.conftest import start_server

from infer.engine.core_loop import STEP_DELAY_ENV

LONG = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}
# A long shared prefix (many full KV blocks) so a repeat can be served from the prefix cache.
PREFIX = "The import statement combines two operations; it searches for the named module. " * 6


@pytest.fixture(scope="module")
def server(llama_checkpoint, server_logs):
    # Prefix caching is on by default: no flag asks for it.
    yield from start_server(llama_checkpoint, server_logs, "--drain-timeout", "20")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def slow_server(llama_checkpoint, server_logs):
    """Every engine step sleeps 10 ms: 1000 tokens take >= 10 s, over three times the 3 s
    timeout, however fast the machine; and 3 s leave a loaded machine time for a first token."""
    yield from start_server(llama_checkpoint, server_logs, "--request-timeout", "3.0",
                            "--no-enable-prefix-caching", env={STEP_DELAY_ENV: "0.01"})  # fmt: skip


def test_reset_prefix_cache_is_refused_with_prefix_caching_off(slow_server):
    r = httpx.post(slow_server.url + "/reset_prefix_cache")
    assert r.status_code == 409
    assert "--no-enable-prefix-caching" in r.json()["error"]["message"]


def test_request_timeout_ends_with_abort(slow_server):
    client = openai.OpenAI(base_url=slow_server.base_url, api_key="unused", max_retries=0)
    got = client.completions.create(prompt=LONG["prompt"], model="tiny", max_tokens=1000,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].finish_reason == "abort"
    assert 0 < got.usage.completion_tokens < 1000
    assert got.choices[0].text
    slow_server.wait_idle()


def test_request_timeout_bounds_a_whole_beam_search(slow_server):
    """Each round of a beam search is a short request of its own: the timeout is the search's,
    which ends where it is, its beams finishing with abort (1000 rounds take >= 10 s here)."""
    r = httpx.post(slow_server.base_url + "/completions", timeout=60,
                   json={**LONG, "n": 2, "use_beam_search": True})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["finish_reason"] for c in body["choices"]] == ["abort", "abort"]
    assert 0 < body["usage"]["completion_tokens"] < 2000
    slow_server.wait_idle()


def test_streamed_request_timeout_ends_with_abort(slow_server):
    with httpx.stream("POST", slow_server.base_url + "/completions",
                      json={**LONG, "stream": True}, timeout=60) as r:  # fmt: skip
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] == "abort"
    slow_server.wait_idle()


def test_repeated_prefix_is_served_from_the_cache(server, client):
    def ask(suffix: str):
        return client.completions.create(model="tiny", prompt=PREFIX + suffix, max_tokens=4,
                                         temperature=0)  # fmt: skip

    first = ask("Alpha")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = ask("Beta")
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < again.usage.prompt_tokens
    assert httpx.post(server.url + "/reset_prefix_cache").json() == {"reset": True}
    assert ask("Gamma").usage.prompt_tokens_details.cached_tokens == 0
    metrics = httpx.get(server.url + "/metrics").text
    hits = [ln for ln in metrics.splitlines() if ln.startswith("vllm:prefix_cache_hits_total{")]
    assert float(hits[0].rsplit(" ", 1)[1]) >= cached


def test_cache_salt_isolates_prefix_hits(server, client):
    def ask(salt: str):
        return client.completions.create(model="tiny", prompt=PREFIX + "Delta", max_tokens=2,
                                         temperature=0, extra_body={"cache_salt": salt})  # fmt: skip

    ask("tenant-a")
    assert ask("tenant-b").usage.prompt_tokens_details.cached_tokens == 0
    assert ask("tenant-a").usage.prompt_tokens_details.cached_tokens > 0


def test_sigterm_drains_in_flight_requests_and_exits_zero(server):
    """Last in this module: it stops the module's server."""
    body = {**LONG, "max_tokens": 200, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        server.proc.send_signal(signal.SIGTERM)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"  # finished, not cut
    assert server.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)
    log = server.log()
    assert "received SIGTERM" in log and "Traceback" not in log


def test_sigterm_past_the_drain_timeout_ends_streams_with_abort(llama_checkpoint, server_logs):
    """In-flight streams that outlast a short drain timeout (each step sleeps 10 ms: 1000
    tokens take >= 10 s, twenty times the 0.5 s) end with an ``abort`` chunk and ``[DONE]``,
    non-streamed ones with an ``abort`` answer, and the server exits 0."""
    import concurrent.futures
    import time

    gen = start_server(llama_checkpoint, server_logs, "--drain-timeout", "0.5",
                       env={STEP_DELAY_ENV: "0.01"})  # fmt: skip
    server = next(gen)
    try:

        def stream() -> list[str]:
            with httpx.stream("POST", server.base_url + "/completions",
                              json={**LONG, "stream": True}, timeout=60) as r:  # fmt: skip
                return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

        def whole() -> dict:
            return httpx.post(server.base_url + "/completions", json=LONG, timeout=60).json()

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(stream) for _ in range(3)]
            plain = pool.submit(whole)
            server.wait_running(4)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            for f in streams:
                events = f.result()
                assert events[-1] == "[DONE]"
                assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
            assert plain.result()["choices"][0]["finish_reason"] == "abort"
        assert server.proc.wait(30) == 0
        assert time.monotonic() - t0 < 20
        log = server.log()
        assert "up to 0.5s" in log and "Traceback" not in log and "CancelledError" not in log
    finally:
        gen.close()


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_sigterm_to_the_whole_process_group_drains(tensor_parallel, llama_checkpoint, server_logs):
    """systemd's default stop, `kill -TERM -- -PGID`: the signal reaches the engine process (and
    the tensor-parallel rank) too. They leave shutdown to the server, which drains: every stream
    gets all its tokens and [DONE], and the server exits 0. (Each step sleeps 10 ms, so the
    streams are in flight when the signal comes, however fast the machine.)"""
    import concurrent.futures

    args = ["--drain-timeout", "60", "--tensor-parallel-size", str(tensor_parallel)]
    gen = start_server(llama_checkpoint, server_logs, *args, env={STEP_DELAY_ENV: "0.01"},
                       new_session=True)  # fmt: skip
    server = next(gen)
    try:

        def stream() -> list[str]:
            body = {**LONG, "max_tokens": 150, "stream": True, "temperature": 0}
            with httpx.stream("POST", server.base_url + "/completions", json=body,
                              timeout=120) as r:  # fmt: skip
                return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream) for _ in range(3)]
            server.wait_running(3)
            os.killpg(server.proc.pid, signal.SIGTERM)
            for f in streams:
                events = f.result()
                assert events[-1] == "[DONE]"
                final = json.loads(events[-2])
                assert final["choices"][0]["finish_reason"] == "length"
                text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
                assert text  # every chunk arrived
        assert server.proc.wait(60) == 0
        log = server.log()
        assert "engine stopped" not in log and "Traceback" not in log
    finally:
        gen.close()


def test_the_port_is_held_from_the_start_and_refuses_until_the_server_is_up(
    llama_checkpoint, tmp_path
):
    """The listening socket is bound before the engine starts (a load can take minutes, and a
    tensor-parallel start hands out ephemeral ports to its workers' sockets): meanwhile no
    other program can bind the port, and a client is refused at once rather than left
    waiting; once the engine is up, the server serves on it."""
    import socket
    import threading
    import time

    from tests.server.conftest import ServerProcess

    from infer.engine.core_client import ENGINE_START_GATE_ENV

    gate = tmp_path / "engine-may-start"
    logs = tmp_path / "logs"
    logs.mkdir()
    seen: dict = {}

    def probe_while_held() -> None:
        try:
            deadline = time.monotonic() + 120
            port = None
            while port is None and time.monotonic() < deadline:
                for log in logs.glob("server-*.log"):
                    held = re.search(r"port (\d+) held", log.read_text(errors="replace"))
                    if held:
                        port = int(held.group(1))
                time.sleep(0.05)
            seen["port"] = port
            with socket.socket() as other:
                try:
                    other.bind(("127.0.0.1", port))
                except OSError as e:
                    seen["bind"] = e.errno
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except OSError as e:
                seen["connect"] = type(e).__name__
        finally:
            gate.touch()

    thread = threading.Thread(target=probe_while_held)
    thread.start()
    server = ServerProcess(llama_checkpoint, log_dir=logs,
                           env={ENGINE_START_GATE_ENV: str(gate)})  # fmt: skip
    try:
        thread.join()
        assert seen == {"port": server.port, "bind": errno.EADDRINUSE,
                        "connect": "ConnectionRefusedError"}  # fmt: skip
        with server.client() as client:
            assert client.get("/health").status_code == 200
    finally:
        assert server.terminate() == 0
