"""``infer serve --stream-interval N`` over HTTP: a streamed completion's events carry N tokens
each (the first token alone, the end at once), and the text they add up to is what the offline
engine writes."""

from __future__ import annotations

import json

import httpx
import pytest
from tests.server.conftest import start_server

from infer import SamplingParams

PROMPT = "The import statement combines two operations"


@pytest.fixture(scope="module")
def server(llama_checkpoint, server_logs):
    # A stream that falls behind the engine takes the deltas queued up as one event (by
    # design), so on a fast machine the first token and the next four could go out together.
    # Steps slowed to 50 ms each leave the reader ample time to take every event alone.
    yield from start_server(llama_checkpoint, server_logs, "--stream-interval", "4",
                            env={"INFER_TEST_STEP_DELAY": "0.05"})  # fmt: skip


def _events(server, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/completions", headers=server.headers,
                      json=body, timeout=120) as r:  # fmt: skip
        assert r.status_code == 200
        lines = [ln[len("data: ") :] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_streamed_events_carry_n_tokens_and_the_text_is_the_offline_engines(server, offline_llm):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 14, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    events = _events(server, body)
    chunks = [e for e in events if e["choices"]]
    # 14 = 1 + 4 + 4 + 4 + 1: the running count of tokens after each event.
    assert [e["usage"]["completion_tokens"] for e in chunks] == [1, 5, 9, 13, 14]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 14
    greedy = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    want = offline_llm.generate(PROMPT, greedy)[0].outputs[0].text
    assert "".join(e["choices"][0]["text"] for e in chunks) == want


def test_a_stop_string_ends_the_stream_where_it_ends_offline(server, offline_llm):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    text = offline_llm.generate(PROMPT, greedy)[0].outputs[0].text
    stop = text[6:9]
    assert stop and stop in text
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True, "stop": [stop]}  # fmt: skip
    chunks = [e for e in _events(server, body) if e["choices"]]
    assert "".join(e["choices"][0]["text"] for e in chunks) == text[: text.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_streamed_chat_reply_with_logprobs_adds_up_to_the_whole_reply(server):
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 9, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    whole = httpx.post(f"{server.base_url}/chat/completions", headers=server.headers,
                       json=body, timeout=120).json()["choices"][0]  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/chat/completions", headers=server.headers,
                      json={**body, "stream": True}, timeout=120) as r:  # fmt: skip
        lines = [ln[len("data: ") :] for ln in r.iter_lines() if ln.startswith("data: ")]
    events = [json.loads(ln) for ln in lines[:-1]]
    choices = [e["choices"][0] for e in events if e["choices"]]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    logprobs = [lp for c in choices if c.get("logprobs") for lp in c["logprobs"]["content"]]
    assert content == whole["message"]["content"]
    assert logprobs == whole["logprobs"]["content"] and len(logprobs) == 9
    # 9 tokens at an interval of 4: the first alone, then 4, then the last 4 with the end
    assert [len(c["logprobs"]["content"]) for c in choices if c.get("logprobs")] == [1, 4, 4]
