"""A chat reply read by the server's parsers, streamed or not. ``--reasoning-parser qwen3``: the
thinking in ``reasoning`` (and ``reasoning_content``), the rest in ``content``; the random-weight
model is made to think by a grammar that spells the tags (a constrained reply thinks only so); a
prompt that ends inside an open ``<think>`` (the assistant turn continued) starts the reply
thinking. ``--tool-call-parser llama3_json``: a reply written as Llama 3's JSON call (a grammar
makes the model write one) is a tool call."""

from __future__ import annotations

import json
import re

import pytest
from tests.server.conftest import start_server

MESSAGES = [{"role": "user", "content": "Is the sea deep?"}]
THINKS = r"<think>[a-z]{3,6}</think>[a-z]{3,6}"


@pytest.fixture(scope="module")
def server(llama_checkpoint, server_logs):
    yield from start_server(llama_checkpoint, server_logs, "--served-model-name", "tiny",
                            "--reasoning-parser", "qwen3", "--tool-call-parser", "llama3_json",
                            "--enable-auto-tool-choice")  # fmt: skip


def _chat(c, messages, regex, **extra):
    body = {"model": "tiny", "messages": messages, "max_tokens": 40, "temperature": 0, **extra}
    if regex is not None:
        body["structured_outputs"] = {"regex": regex}
    got = c.post("/v1/chat/completions", json=body)
    assert got.status_code == 200, got.text
    return got.json()["choices"][0]["message"]


def _streamed(c, messages, regex, **extra) -> tuple[str, str]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 40, "temperature": 0,
            "stream": True, **extra}  # fmt: skip
    if regex is not None:
        body["structured_outputs"] = {"regex": regex}
    reasoning = content = ""
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    delta = choice["delta"]
                    assert delta.get("reasoning") == delta.get("reasoning_content")
                    reasoning += delta.get("reasoning") or ""
                    content += delta.get("content") or ""
    return reasoning, content


def test_thinking_goes_apart_from_the_content(server):
    with server.client() as c:
        message = _chat(c, MESSAGES, THINKS)
        reasoning, content = message["reasoning"], message["content"]
        assert re.fullmatch(r"[a-z]{3,6}", reasoning) and re.fullmatch(r"[a-z]{3,6}", content)
        assert message["reasoning_content"] == reasoning
        assert _streamed(c, MESSAGES, THINKS) == (reasoning, content)
        # vLLM's include_reasoning: false leaves the thinking out
        hidden = _chat(c, MESSAGES, THINKS, include_reasoning=False)
        assert hidden["reasoning"] is None and hidden["content"] == content
        assert _streamed(c, MESSAGES, THINKS, include_reasoning=False) == ("", content)
        # no thinking: all content, and no reasoning keys
        plain = _chat(c, MESSAGES, r"[a-z]{3,6}")
        assert re.fullmatch(r"[a-z]{3,6}", plain["content"])
        # (with a parser, a reply that does not think has the keys, null: SDK clients read
        # message.reasoning_content)
        assert plain["reasoning"] is None and plain["reasoning_content"] is None
        assert _streamed(c, MESSAGES, r"[a-z]{3,6}") == ("", plain["content"])


def test_a_prompt_that_opens_the_thinking_starts_the_reply_in_it(server):
    """The assistant turn continued from "<think>": the reply (the model's own text, which
    never closes the tag) is all reasoning; a constrained one is its grammar's content."""
    opened = [*MESSAGES, {"role": "assistant", "content": "<think>"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "max_tokens": 8,
             "ignore_eos": True}  # fmt: skip
    with server.client() as c:
        ids = c.post(
            "/tokenize",
            json={
                "model": "tiny",
                "messages": opened,
                **{k: extra[k] for k in ("continue_final_message", "add_generation_prompt")},
            },
        ).json()
        raw = c.post("/v1/completions", json={"model": "tiny", "prompt": ids["tokens"],
                                              "max_tokens": 8, "temperature": 0,
                                              "ignore_eos": True}).json()  # fmt: skip
        text = raw["choices"][0]["text"]
        assert "</think>" not in text
        message = _chat(c, opened, None, **extra)
        assert message["content"] is None and message["reasoning"] == text
        assert _streamed(c, opened, None, **extra) == (text, "")
        constrained = _chat(c, opened, r"[a-z]{3,6}", **extra)
        assert re.fullmatch(r"[a-z]{3,6}", constrained["content"])
        assert constrained["reasoning"] is None and constrained["reasoning_content"] is None


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}]  # fmt: skip
CALL = r'\{"name": "get_weather", "parameters": \{"city": "[a-z]{3,6}"\}\}'


def test_llama3_json_calls_are_tool_calls(server):
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 60,
            "temperature": 0, "structured_outputs": {"regex": CALL}}  # fmt: skip
    with server.client() as c:
        got = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert got["finish_reason"] == "tool_calls" and got["message"]["content"] is None
        (call,) = got["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        city = json.loads(call["function"]["arguments"])["city"]
        assert re.fullmatch(r"[a-z]{3,6}", city)
        calls, finish = [], None
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    assert not choice["delta"].get("content")
                    calls += choice["delta"].get("tool_calls") or []
                    finish = choice["finish_reason"] or finish
        assert [json.loads(d["function"]["arguments"]) for d in calls] == [{"city": city}]
        assert finish == "tool_calls"
        # plain text is content
        text = {**body, "structured_outputs": {"regex": r"[a-z]{3,6}"}}
        plain = c.post("/v1/chat/completions", json=text).json()["choices"][0]
        assert plain["message"]["tool_calls"] == [] and plain["finish_reason"] == "stop"


def test_a_response_puts_the_thinking_in_a_reasoning_item(server):
    """``/v1/responses`` with the parser: the thinking is a ``reasoning`` item (its
    ``reasoning_text``) before the ``message``, as the chat reply splits them; streamed, the
    ``reasoning_text`` deltas come first and the events assemble the same two items."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none")
    with server.client() as c:
        message = _chat(c, MESSAGES, THINKS)
    body = dict(model="tiny", input=MESSAGES[0]["content"], max_output_tokens=40, temperature=0,
                extra_body={"structured_outputs": {"regex": THINKS}})  # fmt: skip
    resp = client.responses.create(**body)
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == message["reasoning"]
    assert resp.output_text == message["content"]
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens < resp.usage.output_tokens
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events if e.type.endswith(".delta")]
    assert kinds[0] == "response.reasoning_text.delta" and kinds[-1].startswith("response.output")
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == resp.output_text
    # with logprobs too: the same two items either way, every output token's logprob on the
    # message's text (the thinking's tokens included, as they make no text of their own)
    body["include"] = ["message.output_text.logprobs"]
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        final = stream.get_final_response()
    for got in (whole, final):
        assert [item.type for item in got.output] == ["reasoning", "message"]
        assert len(got.output[1].content[0].logprobs) == whole.usage.output_tokens


def test_a_message_puts_the_thinking_in_a_thinking_block(server):
    """``/v1/messages`` with the parser: a ``thinking`` block (its ``signature`` empty) before
    the ``text``, as the chat reply splits them; streamed, the SDK assembles the same blocks."""
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="none")
    with server.client() as c:
        message = _chat(c, MESSAGES, THINKS)
    body = dict(model="tiny", max_tokens=40, messages=MESSAGES,
                extra_body={"temperature": 0, "structured_outputs": {"regex": THINKS}})  # fmt: skip
    got = client.messages.create(**body)
    assert [b.type for b in got.content] == ["thinking", "text"]
    assert (got.content[0].thinking, got.content[1].text) == (message["reasoning"],
                                                              message["content"])  # fmt: skip
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == got.content[0].thinking
    assert final.content[1].text == got.content[1].text
