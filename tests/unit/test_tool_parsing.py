"""Tool-call parsing of free ("auto") replies written in the Hermes / Qwen format, whole and
streamed, and the constrained (required / named) reply shapes."""

from __future__ import annotations

import json

import pytest

from infer.server.protocol import ChatCompletionRequest
from infer.server.tools import ToolStream, parse_hermes, parse_reply, tool_mode

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "mul"}}]  # fmt: skip


def _mode(choice="auto"):
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": choice}
    )
    return tool_mode(req)


def test_hermes_blocks_become_calls_and_the_rest_stays_content():
    text = ('Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
            '</tool_call>\n<tool_call>{"name": "mul", "arguments": {"a": 3}}</tool_call>')  # fmt: skip
    content, calls = parse_hermes(text, {"add", "mul"})
    assert content == "Let me compute."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("mul", {"a": 3})]  # fmt: skip
    # Unknown functions and broken JSON stay text.
    for bad in ['<tool_call>{"name": "div", "arguments": {}}</tool_call>',
                "<tool_call>{not json}</tool_call>", "no calls here"]:  # fmt: skip
        assert parse_hermes(bad, {"add", "mul"}) == (bad, [])


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_streamed_auto_reply_gives_the_same_content_and_calls(split):
    text = ('Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> and '
            "<tool_c is not a call <tool_call>{oops}</tool_call> done")  # fmt: skip
    mode = _mode()
    stream = ToolStream(mode)
    content, names = "", []
    pieces = [text[i : i + split] for i in range(0, len(text), split)]
    for i, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, finished=i == len(pieces) - 1)
        content += c
        names += [d.function.name for d in deltas]
    assert names == ["add"]
    whole_content, calls = parse_reply(mode, text)
    assert [c.function.name for c in calls] == names
    assert content.strip() == whole_content
    assert "<tool_c is not a call" in content and "{oops}" in content


def test_constrained_replies_parse_into_calls():
    content, calls = parse_reply(_mode("required"),
                                 '[{"name": "add", "parameters": {"a": 1}}, {"name": "mul", "parameters": {}}]')  # fmt: skip
    assert content is None and [c.function.name for c in calls] == ["add", "mul"]
    named = _mode({"type": "function", "function": {"name": "mul"}})
    content, calls = parse_reply(named, '{"x": 2}')
    assert content is None and calls[0].function.name == "mul"
    assert json.loads(calls[0].function.arguments) == {"x": 2}
    assert parse_reply(named, '{"x": ') == ('{"x": ', [])  # cut by max_tokens: text as is
