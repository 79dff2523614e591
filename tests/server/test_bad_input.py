"""Malformed and hostile requests: each gets a 4xx with an OpenAI error body, never a 5xx, and the
server keeps serving afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from tests.server.conftest import SHARED_KEY

KEY = SHARED_KEY
OK_CHAT = [{"role": "user", "content": "hi"}]

C, CH = "/v1/completions", "/v1/chat/completions"
LONE = b'{"model": "tiny", "max_tokens": 2, %s}'
MB = 1_000_000


def cmpl(**fields) -> dict:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": OK_CHAT, "max_tokens": 4, **fields}


# (id, method, path, body: dict | bytes | None, headers or None for the right key, status, param)
CASES = [
    ("malformed-json", "POST", C, b'{"prompt": "x",', None, 400, None),
    ("empty-body", "POST", C, b"", None, 400, None),
    ("json-array", "POST", C, b"[1, 2]", None, 400, None),
    ("json-string", "POST", C, b'"hello"', None, 400, None),
    ("non-utf8-bytes", "POST", C, b'\xff\xfe{"prompt": "\xc3\x28"}', None, 400, None),
    ("non-utf8-in-string", "POST", C, b'{"prompt": "\xc3\x28\xa0\xa1"}', None, 400, None),
    ("nan-literal", "POST", C, b'{"prompt": "x", "temperature": NaN}', None, 400, "temperature"),
    ("infinite-number", "POST", C, b'{"prompt": "x", "top_p": 1e400}', None, 400, "top_p"),
    ("prompt-missing", "POST", C, {"model": "tiny"}, None, 400, "prompt"),
    ("prompt-int", "POST", C, cmpl(prompt=5), None, 400, "prompt"),
    ("prompt-empty-string", "POST", C, cmpl(prompt=""), None, 400, "prompt"),
    ("prompt-empty-list", "POST", C, cmpl(prompt=[]), None, 400, "prompt"),
    ("prompt-empty-ids", "POST", C, cmpl(prompt=[[]]), None, 400, None),
    ("prompt-negative-id", "POST", C, cmpl(prompt=[-1]), None, 400, "prompt"),
    ("prompt-huge-id", "POST", C, cmpl(prompt=[10**12]), None, 400, "prompt"),
    ("prompt-mixed-list", "POST", C, cmpl(prompt=[1, "a"]), None, 400, "prompt"),
    ("prompt-dict", "POST", C, cmpl(prompt={"text": "x"}), None, 400, "prompt"),
    ("prompt-over-context", "POST", C, cmpl(prompt=[5] * 2000), None, 400, "prompt"),
    ("max-tokens-negative", "POST", C, cmpl(max_tokens=-1), None, 400, "max_tokens"),
    ("max-tokens-zero", "POST", C, cmpl(max_tokens=0), None, 400, "max_tokens"),
    ("max-tokens-string", "POST", C, cmpl(max_tokens="16"), None, 400, "max_tokens"),
    ("max-tokens-float", "POST", C, cmpl(max_tokens=1.5), None, 400, "max_tokens"),
    ("max-tokens-huge", "POST", C, cmpl(max_tokens=10**20), None, 400, "max_tokens"),
    ("temperature-negative", "POST", C, cmpl(temperature=-1), None, 400, "temperature"),
    ("temperature-string", "POST", C, cmpl(temperature="hot"), None, 400, "temperature"),
    ("top-p-zero", "POST", C, cmpl(top_p=0), None, 400, "top_p"),
    ("top-p-over-one", "POST", C, cmpl(top_p=1.5), None, 400, "top_p"),
    ("top-k-negative", "POST", C, cmpl(top_k=-5), None, 400, "top_k"),
    ("n-zero", "POST", C, cmpl(n=0), None, 400, "n"),
    ("n-million", "POST", C, cmpl(n=10**6), None, 400, "n"),
    ("too-many-sequences", "POST", C, cmpl(prompt=["a b"] * 20, n=128), None, 400, "n"),
    ("logprobs-too-many", "POST", C, cmpl(logprobs=100), None, 400, "logprobs"),
    ("presence-penalty-big", "POST", C, cmpl(presence_penalty=5), None, 400, "presence_penalty"),
    (
        "repetition-penalty-0",
        "POST",
        C,
        cmpl(repetition_penalty=0),
        None,
        400,
        "repetition_penalty",
    ),
    ("seed-too-big", "POST", C, cmpl(seed=2**70), None, 400, "seed"),
    ("stop-empty-string", "POST", C, cmpl(stop=[""]), None, 400, "stop"),
    ("stop-int", "POST", C, cmpl(stop=5), None, 400, "stop"),
    ("stop-token-negative", "POST", C, cmpl(stop_token_ids=[-1]), None, 400, "stop_token_ids[0]"),
    ("stream-string", "POST", C, cmpl(stream="yes"), None, 400, "stream"),
    (
        "stream-options-string",
        "POST",
        C,
        cmpl(stream=True, stream_options="x"),
        None,
        400,
        "stream_options",
    ),  # fmt: skip
    (
        "stream-options-without-stream",
        "POST",
        C,
        cmpl(stream_options={"include_usage": True}),
        None,
        400,
        "stream_options",
    ),  # fmt: skip
    ("logit-bias-key-signed", "POST", C, cmpl(logit_bias={"+5": 1}), None, 400, "logit_bias"),
    ("logit-bias-key-zero-led", "POST", C, cmpl(logit_bias={"05": 1}), None, 400, "logit_bias"),
    ("logit-bias-key-arabic", "POST", C, cmpl(logit_bias={"\u0665": 1}), None, 400, "logit_bias"),
    ("min-over-max-tokens", "POST", C, cmpl(min_tokens=10, max_tokens=4), None, 400, "min_tokens"),
    ("priority-huge", "POST", C, cmpl(priority=2**40), None, 400, "priority"),
    # (min_tokens bans the stop ids in the logits: one past the vocabulary failed the batch)
    (
        "stop-id-past-vocab",
        "POST",
        C,
        cmpl(stop_token_ids=[10**6], min_tokens=2),
        None,
        400,
        "stop_token_ids",
    ),
    (
        "allowed-id-past-vocab",
        "POST",
        C,
        cmpl(allowed_token_ids=[10**6]),
        None,
        400,
        "allowed_token_ids",
    ),
    ("model-int", "POST", C, cmpl(model=42), None, 400, "model"),
    ("model-unknown", "POST", C, cmpl(model="nope"), None, 404, "model"),
    ("suffix-without-fim-model", "POST", C, cmpl(suffix="x"), None, 400, "suffix"),
    ("best-of-below-n", "POST", C, cmpl(best_of=1, n=2), None, 400, "best_of"),
    (
        "prompt-logprobs-too-many",
        "POST",
        C,
        cmpl(prompt_logprobs=21),
        None,
        400,
        "prompt_logprobs",
    ),  # fmt: skip
    (
        "text-plain-body",
        "POST",
        C,
        b"prompt=hello",
        {"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"},
        400,
        None,
    ),
    ("messages-missing", "POST", CH, {"model": "tiny"}, None, 400, "messages"),
    ("messages-empty", "POST", CH, chat(messages=[]), None, 400, "messages"),
    ("messages-string", "POST", CH, chat(messages="hi"), None, 400, "messages"),
    ("messages-nested-garbage", "POST", CH, chat(messages=[[1]]), None, 400, "messages[0]"),
    (
        "role-unknown",
        "POST",
        CH,
        chat(messages=[{"role": "wizard", "content": "x"}]),
        None,
        400,
        "messages[0].role",
    ),  # fmt: skip
    ("role-missing", "POST", CH, chat(messages=[{"content": "x"}]), None, 400, "messages[0].role"),
    (
        "content-int",
        "POST",
        CH,
        chat(messages=[{"role": "user", "content": 5}]),
        None,
        400,
        "messages[0].content",
    ),  # fmt: skip
    (
        "content-image-part",
        "POST",
        CH,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ]
        ),
        None,
        400,
        "messages[0].content[0]",  # (this model reads no images)
    ),  # fmt: skip
    ("top-logprobs-alone", "POST", CH, chat(top_logprobs=2), None, 400, "top_logprobs"),
    (
        "template-kwargs-reserved",
        "POST",
        CH,
        chat(chat_template_kwargs={"tokenize": True}),
        None,
        400,
        "chat_template_kwargs",
    ),  # fmt: skip
    (
        "template-kwargs-string",
        "POST",
        CH,
        chat(chat_template_kwargs="x"),
        None,
        400,
        "chat_template_kwargs",
    ),  # fmt: skip
    (
        "tool-without-function",
        "POST",
        CH,
        chat(tools=[{"type": "function"}]),
        None,
        400,
        "tools[0].function",
    ),  # fmt: skip
    (
        "max-completion-negative",
        "POST",
        CH,
        chat(max_completion_tokens=-3),
        None,
        400,
        "max_completion_tokens",
    ),  # fmt: skip
    ("chat-logprobs-int", "POST", CH, chat(logprobs=5), None, 400, "logprobs"),
    (
        "max-completion-over-context",
        "POST",
        CH,
        chat(max_completion_tokens=2000),
        None,
        400,
        "max_completion_tokens",
    ),  # fmt: skip
    # JSON's escapes can write a lone UTF-16 surrogate: not text any tokenizer takes.
    (
        "lone-surrogate-content",
        "POST",
        CH,
        LONE % b'"messages": [{"role": "user", "content": "\\ud800"}]',
        None,
        400,
        "messages[0].content",
    ),  # fmt: skip
    (
        "lone-surrogate-part",
        "POST",
        CH,
        LONE % b'"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]',
        None,
        400,
        "messages[0].content[0].text",
    ),  # fmt: skip
    (
        "lone-surrogate-model",
        "POST",
        C,
        b'{"model": "\\ud800", "prompt": "hi"}',
        None,
        400,
        "model",
    ),  # fmt: skip
    (
        "lone-surrogate-bias-key",
        "POST",
        C,
        LONE % b'"prompt": "hi", "logit_bias": {"\\ud800": 1}',
        None,
        400,
        "logit_bias",
    ),  # fmt: skip
    (
        "lone-surrogate-tokenize",
        "POST",
        "/tokenize",
        b'{"prompt": "\\ud800"}',
        None,
        400,
        "prompt",
    ),  # fmt: skip
    ("prompt-10MB", "POST", C, cmpl(prompt="a" * (10 * MB)), None, 413, None),
    ("prompt-1MB-over-context", "POST", C, cmpl(prompt="word " * (MB // 5)), None, 400, "prompt"),
    (
        "chat-1MB-over-context",
        "POST",
        CH,
        chat(messages=[{"role": "user", "content": "hi " * (MB // 3)}]),
        None,
        400,
        "messages",
    ),  # fmt: skip
    ("no-api-key", "POST", C, cmpl(), {}, 401, None),
    ("wrong-api-key", "POST", C, cmpl(), {"Authorization": "Bearer nope"}, 401, None),
    ("key-without-bearer", "POST", C, cmpl(), {"Authorization": KEY}, 401, None),
    ("models-wrong-key", "GET", "/v1/models", None, {"Authorization": "Bearer x"}, 401, None),
    ("metrics-no-key", "GET", "/metrics", None, {}, 401, None),
    ("tokenize-neither", "POST", "/tokenize", {}, None, 400, "prompt"),
    ("detokenize-negative", "POST", "/detokenize", {"tokens": [-1]}, None, 400, "tokens[0]"),
    ("detokenize-out-of-vocab", "POST", "/detokenize", {"tokens": [99999]}, None, 400, "tokens"),
    ("unknown-route", "POST", "/v1/moderations", {"input": "x"}, None, 404, None),
    ("wrong-method", "GET", C, None, None, 405, None),
]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def test_the_table_is_big_enough():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_an_error_body(server, case):
    _, method, path, body, headers, status, param = case
    if headers is None:
        headers = {"Authorization": f"Bearer {KEY}"}
    kwargs: dict = {"headers": dict(headers)}
    if isinstance(body, bytes):
        kwargs["content"] = body
        kwargs["headers"].setdefault("Content-Type", "application/json")
    elif body is not None:
        kwargs["content"] = json.dumps(body).encode()
        kwargs["headers"].setdefault("Content-Type", "application/json")
    r = httpx.request(method, server.url + path, timeout=120, **kwargs)
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert server.proc.poll() is None


def test_escaped_surrogate_pairs_are_text(server):
    """JSON escapes a character outside the BMP as a surrogate pair (Python's json.dumps does,
    by default): a pair is the character, not an error."""
    r = httpx.post(server.base_url + "/completions", headers={**server.headers,
                   "Content-Type": "application/json"},
                   content=b'{"model": "tiny", "prompt": "\\ud83d\\ude00 hi", "max_tokens": 2}')  # fmt: skip
    assert r.status_code == 200, r.text
    count = httpx.post(server.url + "/tokenize", headers=server.headers,
                       json={"prompt": "\U0001f600 hi"}).json()["count"]  # fmt: skip
    assert r.json()["usage"]["prompt_tokens"] == count > 0


def test_prompt_over_context_states_both_lengths(server):
    r = httpx.post(server.base_url + "/completions", json=cmpl(prompt=[5] * 2000),
                   headers=server.headers)  # fmt: skip
    message = r.json()["error"]["message"]
    assert "2000" in message and "1024" in message
    r = httpx.post(server.base_url + "/completions", json=cmpl(prompt=[5] * 1000, max_tokens=100),
                   headers=server.headers)  # fmt: skip
    message = r.json()["error"]["message"]
    assert "1000" in message and "100" in message and "1024" in message


def test_a_body_streamed_past_the_limit_is_413(server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * MB
        yield b'"}'

    r = httpx.post(server.base_url + "/completions", content=chunks(), timeout=120,
                   headers={**server.headers, "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_health_needs_no_key_and_the_server_still_serves(server):
    assert httpx.get(server.url + "/health").status_code == 200
    with server.client() as c:
        r = c.post("/v1/completions", json=cmpl())
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert "Traceback" not in server.log()
    assert " 500 " not in server.log()


def test_a_priority_under_first_come_first_served_is_refused(shared_server):
    """The shared server schedules fcfs: a priority it would ignore is a 400 naming it (as in
    vLLM), 0 is fine."""
    with shared_server.client() as c:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        r = c.post("/v1/completions", json={**body, "priority": 3})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
        assert c.post("/v1/completions", json={**body, "priority": 0}).status_code == 200
