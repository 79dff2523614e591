"""A server with speculative decoding streams the same tokens as plain decoding, exports
vLLM's spec-decode metrics, returns every block, and bad speculative configs stop it at
start-up with a message that names the problem."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from openai import OpenAI
from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def spec_server(llama_checkpoint, server_logs):
    # The target as its own draft: every proposal is accepted, whatever the random weights say.
    config = json.dumps({"model": str(llama_checkpoint), "num_speculative_tokens": 4})
    yield from start_server(llama_checkpoint, server_logs, "--speculative-config", config,
                            env={"INFER_SPEC_LOG_INTERVAL": "0"})  # fmt: skip


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_speculative_server_streams_plain_tokens_and_counts_proposals(spec_server, shared_server):
    prompt = "for i in range(10): for i in range(10): for i in range(10):"
    body = dict(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                extra_body={"ignore_eos": True})  # fmt: skip
    client = OpenAI(base_url=spec_server.base_url, api_key="unused")
    stream = client.completions.create(**body, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    whole = client.completions.create(**body)
    plain_client = OpenAI(base_url=shared_server.base_url, api_key=shared_server.api_key)
    plain = plain_client.completions.create(**body)
    assert whole.usage.completion_tokens == 40
    assert text == whole.choices[0].text == plain.choices[0].text
    metrics = httpx.get(spec_server.base_url.removesuffix("/v1") + "/metrics").text
    drafts = _metric(metrics, "vllm:spec_decode_num_drafts_total")
    proposed = _metric(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _metric(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    per_position = _metric(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert drafts > 0 and proposed >= drafts and accepted == proposed
    assert per_position == accepted
    stats = spec_server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    log = spec_server.log()
    assert "4 proposals per step" in log
    assert "speculative decoding: mean acceptance length 5.00" in log  # k = 4, all accepted


@pytest.mark.parametrize(
    "config,message",
    [
        ("{oops", "--speculative-config is not valid JSON"),
        ('{"method": "eagle9", "num_speculative_tokens": 2}', "speculative method 'eagle9' is unknown"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
        ('{"model": "/no/such/draft", "num_speculative_tokens": 2}', "/no/such/draft"),
    ],
)  # fmt: skip
def test_bad_speculative_configs_stop_the_server_with_a_clear_message(
    config, message, llama_checkpoint
):
    cmd = [sys.executable, "-m", "infer.server", "--model", str(llama_checkpoint),
           "--port", "0", "--speculative-config", config]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr
