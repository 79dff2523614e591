"""The engine loop in its own process (the server's default): same API, same cleanup, and a dead
engine process gives errors with a clear message and a server that exits non-zero."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from tests.server.conftest import ServerProcess, start_server

from infer import SamplingParams
from infer.engine.core_loop import STEP_DELAY_ENV


@pytest.fixture(scope="module")
def server(llama_checkpoint, server_logs):
    yield from start_server(llama_checkpoint, server_logs, "--torch-threads", "1",
                            "--enable-prefix-caching")  # fmt: skip


def test_text_equals_offline_and_streams(server, offline_llm):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    want = offline_llm.generate("def main():", SamplingParams(temperature=0.0, max_tokens=16))
    got = client.completions.create(model="tiny", prompt="def main():", max_tokens=16,
                                    temperature=0)  # fmt: skip
    assert got.choices[0].text == want[0].outputs[0].text
    chunks = list(client.completions.create(model="tiny", prompt="def main():", max_tokens=16,
                                            temperature=0, stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == got.choices[0].text
    assert httpx.post(server.url + "/reset_prefix_cache").json() == {"reset": True}


def test_dropped_stream_frees_blocks_in_the_child(server):
    body = {"prompt": "Once", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert server.debug()["num_running"] == 1
    stats = server.wait_idle()
    assert stats["kv_usage"] == 0.0


def test_replies_bigger_than_the_pipe_buffer_cross_whole(server):
    # prompt_logprobs of a long prompt make one step's reply hundreds of KiB: it reaches the
    # server in parts, while other streams' replies keep coming. (Reading the pipe on the event
    # loop once took a partly arrived reply for the engine's death.)
    prompt = [10 + (i * 7) % 400 for i in range(900)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "prompt_logprobs": 20}
    stream_body = {"prompt": "Once", "max_tokens": 64, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}}  # fmt: skip

    def big() -> list:
        r = httpx.post(server.base_url + "/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["prompt_logprobs"]

    def streamed() -> int:
        # Tokens by the usage event, not events: a stream that falls behind the engine gets
        # several steps' tokens in one event.
        with httpx.stream("POST", server.base_url + "/completions", json=stream_body,
                          timeout=120) as r:  # fmt: skip
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        return events[-1]["usage"]["completion_tokens"]

    with ThreadPoolExecutor(6) as pool:
        bigs = [pool.submit(big) for _ in range(3)]
        streams = [pool.submit(streamed) for _ in range(3)]
        for f in bigs:
            block = f.result()
            assert block[0] is None and len(block) == len(prompt)
            assert all(len(entry) >= 20 for entry in block[1:])
        assert [f.result() for f in streams] == [64] * 3
    assert httpx.get(server.url + "/health").status_code == 200


def test_sigterm_stops_both_processes(server):
    assert server.terminate() == 0
    assert "engine runs in process" in server.log() and "Traceback" not in server.log()
    # The engine process froze its start-up heap before serving (engine/heap.py).
    frozen = int(re.search(r"\((\d+) start-up objects frozen", server.log()).group(1))
    assert frozen > 10_000


def test_killed_engine_fails_the_stream_and_the_server_exits_non_zero(
    llama_checkpoint, server_logs
):
    # 20 ms a step: the 900-token stream is provably still running when the engine is killed.
    server = ServerProcess(llama_checkpoint, log_dir=server_logs, env={STEP_DELAY_ENV: "0.02"})
    try:
        pid = int(re.search(r"engine runs in process (\d+)", server.log()).group(1))
        body = {"prompt": "Once", "max_tokens": 900, "ignore_eos": True, "stream": True}
        events = server.stream_and_kill(pid, body)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "engine process exited" in error["message"]
        assert server.proc.wait(60) == 1
        assert "the engine died" in server.log()
    finally:
        server.kill()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to bind")
def test_cpu_bind_gives_the_engine_main_thread_a_core_of_its_own(llama_checkpoint, server_logs):
    cores = sorted(os.sched_getaffinity(0))
    server = ServerProcess(llama_checkpoint, "--cpu-bind", "auto", log_dir=server_logs)
    try:
        engine_pid = int(re.search(r"engine runs in process (\d+)", server.log()).group(1))
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        got = client.completions.create(model="tiny", prompt="Once", max_tokens=8, temperature=0)
        assert got.usage.completion_tokens == 8
        # A new grammar compiles on a helper thread the main thread starts: off its core too.
        task = Path(f"/proc/{engine_pid}/task")
        before = len(list(task.iterdir()))
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            response_format={"type": "json_object"},
        )  # fmt: skip
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert len(list(task.iterdir())) > before  # the grammar pool's thread
        rest = set(cores[1:])
        for tid in map(int, os.listdir(f"/proc/{engine_pid}/task")):
            want = {cores[0]} if tid == engine_pid else rest
            assert os.sched_getaffinity(tid) == want, (tid, engine_pid)
        server_threads = os.listdir(f"/proc/{server.proc.pid}/task")
        assert server_threads and all(
            os.sched_getaffinity(int(tid)) == rest for tid in server_threads
        )
        assert f"cores: engine main thread {cores[0]}" in server.log()
    finally:
        assert server.terminate() == 0


def test_cpu_bind_on_one_core_says_it_binds_nothing(llama_checkpoint, server_logs):
    core = min(os.sched_getaffinity(0))
    server = ServerProcess(llama_checkpoint, "--cpu-bind", str(core), log_dir=server_logs)
    try:
        assert f"--cpu-bind {core}: one core, so nothing to bind" in server.log()
        assert "cores: engine main thread" not in server.log()
    finally:
        assert server.terminate() == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu-bind", "0-4096"], "are not available to this process"),
        (["--cpu-bind", "x"], "'x' is not a core number or range"),
        (["--cpu-bind", "auto", "--no-engine-process"], "needs the engine in its own process"),
    ],
)
def test_cpu_bind_refuses_what_it_cannot_do(llama_checkpoint, args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "infer.server", "--model", str(llama_checkpoint), *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr


def test_a_start_up_that_fails_after_the_spawn_stops_the_engine_process(llama_checkpoint):
    """The child ignores SIGTERM and SIGINT (its parent ends it): a failure of the server's
    own start-up work (or a Ctrl-C) while the engine builds must not leave it behind, or this
    process's exit would wait on it for ever."""
    import multiprocessing

    from infer.config import EngineConfig
    from infer.engine.core_client import EngineProcess

    def fail() -> None:
        raise RuntimeError("the server's own start-up failed")

    config = EngineConfig.from_kwargs(model=str(llama_checkpoint), kv_cache_memory=16 << 20)
    with pytest.raises(RuntimeError, match="the server's own start-up failed"):
        EngineProcess(config, torch_threads=1, meanwhile=fail)
    assert not [p for p in multiprocessing.active_children() if p.name == "infer-engine"]
