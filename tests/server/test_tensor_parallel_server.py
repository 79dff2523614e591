"""`infer serve --tensor-parallel-size 2`: the engine process drives one worker process over gloo;
the text is the one-rank text, and a worker that dies ends the server with a clear message."""

from __future__ import annotations

import json
import re

import openai
import pytest
from tests.server.conftest import ServerProcess

from infer import SamplingParams
from infer.engine.core_loop import STEP_DELAY_ENV

pytestmark = pytest.mark.distributed


def test_two_ranks_serve_the_one_rank_text_until_a_worker_dies(
    llama_checkpoint, server_logs, offline_llm
):
    # 20 ms a step: the 900-token stream is provably still running when the worker is killed.
    server = ServerProcess(
        llama_checkpoint,
        "--tensor-parallel-size",
        "2",
        log_dir=server_logs,
        env={STEP_DELAY_ENV: "0.02"},
    )
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        params = SamplingParams(temperature=0.0, max_tokens=16)
        want = offline_llm.generate("def main():", params)[0].outputs[0].text
        got = client.completions.create(
            model="tiny", prompt="def main():", max_tokens=16, temperature=0
        )
        assert got.choices[0].text == want
        assert server.wait_idle()["num_free_blocks"] > 0

        worker = int(re.search(r"worker pids (\d+)", server.log()).group(1))
        body = {"prompt": "Once", "max_tokens": 900, "ignore_eos": True, "stream": True}
        events = server.stream_and_kill(worker, body)
        assert events[-1] == "[DONE]"
        message = json.loads(events[-2])["error"]["message"]
        assert "tensor parallel worker rank 1 exited (code -9)" in message
        assert server.proc.wait(60) == 1
    finally:
        server.kill()
