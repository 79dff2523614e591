"""The engine loop in its own process (the server's default): same API, same cleanup, and a dead
engine process gives errors with a clear message and a server that exits non-zero."""

from __future__ import annotations

import json
import re

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


def test_sigterm_stops_both_processes(server):
    assert server.terminate() == 0
    assert "engine runs in process" in server.log() and "Traceback" not in server.log()


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
