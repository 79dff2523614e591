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


AUTO_REPLIES = [
    'Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> and '
    "<tool_c is not a call <tool_call>{oops}</tool_call> done",
    # the whitespace a template writes around blocks is not content, streamed or not
    ' Sure!  <tool_call>{"name": "add", "arguments": {}}</tool_call>\n'
    '<tool_call>{"name": "mul", "arguments": {}}</tool_call>\n trailing  \n',
    '\n<tool_call>{"name": "add", "arguments": {}}</tool_call> \n ',
    "  no calls, spaces kept  ",
    'unclosed <tool_call>{"name": "add", "arguments": {}} ',
]


@pytest.mark.parametrize("text", AUTO_REPLIES)
@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_streamed_auto_reply_gives_the_same_content_and_calls(text, split):
    mode = _mode()
    stream = ToolStream(mode)
    content, names = "", []
    pieces = [text[i : i + split] for i in range(0, len(text), split)]
    for i, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, finished=i == len(pieces) - 1)
        content += c
        names += [d.function.name for d in deltas]
    whole_content, calls = parse_reply(mode, text)
    assert [c.function.name for c in calls] == names
    assert content == (whole_content or "")


def test_content_around_calls_loses_only_the_whitespace_next_to_the_blocks():
    mode = _mode()
    assert parse_reply(mode, AUTO_REPLIES[0])[0] == (
        "Sure.and <tool_c is not a call <tool_call>{oops}</tool_call> done"
    )
    assert parse_reply(mode, AUTO_REPLIES[1])[0] == " Sure!trailing  \n"
    assert parse_reply(mode, AUTO_REPLIES[2])[0] is None
    assert parse_reply(mode, AUTO_REPLIES[3]) == (AUTO_REPLIES[3], [])


@pytest.mark.parametrize(
    "body",
    [
        '{"name": ["add"], "arguments": {}}',  # a name that is not a string (was a 500)
        '{"name": {"a": 1}, "arguments": {}}',
        '{"name": 5}',
        '{"name": "add", "arguments": "not json"}',  # arguments that are not an object
        '{"name": "add", "arguments": 5}',
        '{"name": "add", "arguments": null}',
        '{"name": "add", "arguments": "[1, 2]"}',
        '["add", {}]',
    ],
)
def test_blocks_that_make_no_call_stay_content_whole_and_streamed(body):
    text = f"<tool_call>{body}</tool_call>"
    assert parse_hermes(text, {"add", "mul"}) == (text, [])
    stream = ToolStream(_mode())
    first, second = stream.feed(text[:15], False), stream.feed(text[15:], True)
    assert first[0] + second[0] == text and first[1] == second[1] == []


def test_arguments_written_as_a_json_string_of_an_object_are_that_object():
    body = json.dumps({"name": "add", "arguments": json.dumps({"a": 1})})
    content, calls = parse_hermes(f"<tool_call>{body}</tool_call>", {"add"})
    assert content is None and json.loads(calls[0].function.arguments) == {"a": 1}


def test_constrained_replies_parse_into_calls():
    content, calls = parse_reply(_mode("required"),
                                 '[{"name": "add", "parameters": {"a": 1}}, {"name": "mul", "parameters": {}}]')  # fmt: skip
    assert content is None and [c.function.name for c in calls] == ["add", "mul"]
    named = _mode({"type": "function", "function": {"name": "mul"}})
    content, calls = parse_reply(named, '{"x": 2}')
    assert content is None and calls[0].function.name == "mul"
    assert json.loads(calls[0].function.arguments) == {"x": 2}
    assert parse_reply(named, '{"x": ') == ('{"x": ', [])  # cut by max_tokens: text as is


# ---- --tool-call-parser llama3_json | mistral ---------------------------------------------------

OTHER_FORMATS = [
    # (parser, reply, content, [(name, arguments)])
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}}', None, [("add", {"a": 1})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
     '{"name": "mul", "arguments": {"b": 2}}', None, [("add", {"a": 1}), ("mul", {"b": 2})]),
    ("llama3_json", ' \n{"name": "mul", "parameters": "{\\"b\\": 2}"}', None, [("mul", {"b": 2})]),
    ("llama3_json", "The sum is 3.", "The sum is 3.", []),
    ("llama3_json", '{"name": "div", "parameters": {}}', '{"name": "div", "parameters": {}}', []),
    ("llama3_json", '{"a": 1} is JSON', '{"a": 1} is JSON', []),
    ("llama3_json", '{"name": "add", "parameters": {}} and', '{"name": "add", "parameters": {}} and',
     []),
    ("llama3_json", "<|python_t", "<|python_t", []),
    ("mistral", 'Let me add.  [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
     '{"name": "mul", "arguments": {}}]', "Let me add.", [("add", {"a": 1}), ("mul", {})]),
    ("mistral", '[TOOL_CALLS] {"name": "add", "arguments": {}}', None, [("add", {})]),
    ("mistral", 'Sure.[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]mul[ARGS]{"b": 2}', "Sure.",
     [("add", {"a": 1}), ("mul", {"b": 2})]),  # (the newer tokenizers' form)
    ("mistral", "[TOOL_CALLS]add[ARGS]{oops}", "[TOOL_CALLS]add[ARGS]{oops}", []),
    ("mistral", "No calls [TOOL_CALL here", "No calls [TOOL_CALL here", []),
    ("mistral", "Broken [TOOL_CALLS][{]", "Broken [TOOL_CALLS][{]", []),
    ("mistral", 'x [TOOL_CALLS][{"name": "div", "arguments": {}}]',
     'x [TOOL_CALLS][{"name": "div", "arguments": {}}]', []),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), OTHER_FORMATS)
@pytest.mark.parametrize("split", [1, 4, 1000])
def test_other_formats_whole_and_streamed(parser, text, content, calls, split):
    """Llama 3's JSON calls and Mistral's ``[TOOL_CALLS]`` array: the calls named among the
    tools with object arguments; anything else is content, whole; a stream gives the same."""
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "auto"}
    )
    mode = tool_mode(req, parser)
    got_content, got_calls = parse_reply(mode, text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    stream, streamed, names = ToolStream(mode), "", []
    pieces = [text[i : i + split] for i in range(0, len(text), split)]
    for i, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, finished=i == len(pieces) - 1)
        streamed += c
        names += [d.function.name for d in deltas]
    assert streamed == (content or "") and names == [name for name, _ in calls]


def test_mistral_calls_have_the_ids_its_templates_take():
    """9 letters or digits: Mistral's templates refuse any other id, so the next turn, which
    sends the calls back, would not render. Constrained calls too."""
    import re

    for choice, text in (("auto", '[TOOL_CALLS][{"name": "add", "arguments": {}}]'),
                         ("required", '[{"name": "mul", "parameters": {}}]'),
                         ({"type": "function", "function": {"name": "add"}}, "{}")):  # fmt: skip
        req = ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": choice}
        )
        _, calls = parse_reply(tool_mode(req, "mistral"), text)
        assert calls and all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls), calls
        _, hermes = parse_reply(tool_mode(req), text.replace("[TOOL_CALLS]", ""))
        assert all(c.id.startswith("call_") for c in hermes)


CODER_TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {
    "type": "object", "properties": {
        "cmd": {"type": "string"}, "timeout": {"type": "integer"}, "ratio": {"type": "number"},
        "dry": {"type": "boolean"}, "env": {"type": "object"}, "args": {"type": "array"},
        "note": {"type": ["string", "null"]}}}}}]  # fmt: skip
CODER_REPLY = (
    "I will run it.\n<tool_call>\n<function=run>\n<parameter=cmd>\nls -la\n  src/\n"
    "</parameter>\n<parameter=timeout>\n30\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
    '<parameter=dry>\nTrue\n</parameter>\n<parameter=env>\n{"A": "1"}\n</parameter>\n'
    "<parameter=args>\n[1, 2]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
    "<parameter=other>\n7\n</parameter>\n</function>\n</tool_call>\nDone."
)  # fmt: skip


@pytest.mark.parametrize("split", [1, 5, 10_000])
def test_qwen3_coder_blocks_are_calls_typed_by_the_tools_schema(split):
    """Qwen3-Coder's ``<function=...>`` / ``<parameter=...>`` blocks: each value read as its
    schema types it (a parameter the schema does not name, or a string one, as written, less
    the line breaks next to its tags); the text around stays content, in its place when
    streamed; a block naming no tool is content."""
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": CODER_TOOLS}
    )
    mode = tool_mode(req, "qwen3_coder")
    content, calls = parse_reply(mode, CODER_REPLY)
    assert content == "I will run it.Done."
    [call] = calls
    assert call.function.name == "run"
    assert json.loads(call.function.arguments) == {
        "cmd": "ls -la\n  src/", "timeout": 30, "ratio": 0.5, "dry": True, "env": {"A": "1"},
        "args": [1, 2], "note": None, "other": "7"}  # fmt: skip
    stream, order = ToolStream(mode), []
    pieces = [CODER_REPLY[i : i + split] for i in range(0, len(CODER_REPLY), split)]
    for i, piece in enumerate(pieces):
        for p in stream.feed_pieces(piece, finished=i == len(pieces) - 1):
            if isinstance(p, str) and p and order and isinstance(order[-1], str):
                order[-1] += p
            elif not isinstance(p, str) or p:
                order.append(p if isinstance(p, str) else ("call", p.function.name))
    assert order == ["I will run it.", ("call", "run"), "Done."]
    unknown = CODER_REPLY.replace("<function=run>", "<function=rm>")
    assert parse_reply(mode, unknown) == (unknown, [])


@pytest.mark.parametrize(("value", "schema", "want"), [
    ("1e3", {"type": "integer"}, "1e3"),  # (not an integer as written: kept)
    ("12345678901234567890123", {"type": "number"}, 12345678901234567890123),
    ("nan", {"type": "number"}, "nan"), ("inf", {"type": "number"}, "inf"),  # (not JSON)
    ("2.5", {"type": "number"}, 2.5), ("-7", {"type": "integer"}, -7),
    ("5", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 5),
    ("null", {"type": "integer"}, None), ("null", {"type": "string"}, "null"),
    ("42", {"type": "string"}, "42"), ("[1]", {"type": "object"}, "[1]"),
])  # fmt: skip
def test_qwen3_coder_values_take_only_what_their_type_reads(value, schema, want):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": schema}}}}]  # fmt: skip
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    )
    text = f"<tool_call>\n<function=f>\n<parameter=p>\n{value}\n</parameter>\n</function>\n</tool_call>"
    _, [call] = parse_reply(tool_mode(req, "qwen3_coder"), text)
    assert json.loads(call.function.arguments) == {"p": want}


def test_qwen3_coder_block_may_hold_several_calls():
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": CODER_TOOLS}
    )
    text = ("<tool_call>\n<function=run>\n<parameter=cmd>\nls\n</parameter>\n</function>\n"
            "<function=run>\n</function>\n</tool_call>")  # fmt: skip
    content, calls = parse_reply(tool_mode(req, "qwen3_coder"), text)
    assert content is None
    assert [json.loads(c.function.arguments) for c in calls] == [{"cmd": "ls"}, {}]
