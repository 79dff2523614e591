"""Anthropic's Messages API (``POST /v1/messages``) with the ``anthropic`` SDK, as Claude Code
and other Anthropic clients call a local server: a message is the chat reply to the same
conversation (greedy: the same text and token counts), streamed as Anthropic's events that the
SDK assembles into the same message; stop sequences, tool use (``tool_use`` blocks whose input
fits the tool's schema; ``tool_result`` blocks sent back), token counting, the API key in
``x-api-key``; what infer does not serve is a 400 naming the field."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI
from tests.server.test_tool_calls import SCHEMAS, TIME, WEATHER

TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": TIME},
]
QUESTION = "What is the weather in Paris?"
# (newer Anthropic SDKs take no temperature argument: it goes in the body as they send it)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(shared_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=shared_server.url, api_key=shared_server.api_key)


@pytest.fixture(scope="module")
def chat(shared_server) -> OpenAI:
    return OpenAI(base_url=shared_server.base_url, api_key=shared_server.api_key)


def test_a_message_is_the_chat_reply(client, chat, shared_server):
    """``system`` and ``messages`` are the chat's messages: the greedy text, the token counts
    and the stop (``max_tokens`` where it cut the reply, else ``end_turn``) are the chat
    reply's; ``count_tokens`` counts the prompt the reply read."""
    body = dict(model="tiny", max_tokens=12, system="Be brief.", extra_body=GREEDY,
                messages=[{"role": "user", "content": QUESTION}])  # fmt: skip
    message = client.messages.create(**body)
    want = chat.chat.completions.create(model="tiny", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])  # fmt: skip
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == want.choices[0].message.content
    # (Anthropic counts the prompt's tokens read from the prefix cache apart)
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert usage.output_tokens == want.usage.completion_tokens
    length = want.choices[0].finish_reason == "length"
    assert message.stop_reason == ("max_tokens" if length else "end_turn")
    counted = client.messages.count_tokens(model="tiny", system="Be brief.",
                                           messages=body["messages"])  # fmt: skip
    message = client.messages.create(**body | {"extra_body": {"temperature": 0, "top_k": 1}})
    assert message.content[0].text == want.choices[0].message.content
    assert counted.input_tokens == want.usage.prompt_tokens
    stats = shared_server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_streamed_message_is_the_same_message(client):
    """The SDK's stream helper reads Anthropic's events (``message_start``, a block's start,
    deltas and stop, ``message_delta``, ``message_stop``) into the unstreamed message."""
    body = dict(model="tiny", max_tokens=10, extra_body=GREEDY,
                messages=[{"role": "user", "content": QUESTION}])  # fmt: skip
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason,
                                                              whole.usage.output_tokens)  # fmt: skip
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    )
    with client.messages.stream(**body) as stream:
        kinds = [event.type for event in stream]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_stop_sequence_ends_the_reply_and_is_named(client):
    body = dict(model="tiny", max_tokens=16, extra_body=GREEDY,
                messages=[{"role": "user", "content": QUESTION}])  # fmt: skip
    text = client.messages.create(**body).content[0].text
    at = next(k for k in range(2, len(text) - 3) if text.find(text[k : k + 3]) == k
              and text[k : k + 3].strip())  # fmt: skip
    stop = text[at : at + 3]
    message = client.messages.create(**body, stop_sequences=[stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.content[0].text == text[:at]


def test_tool_use_blocks_and_tool_results(client):
    """``tool_choice`` ``any`` gives ``tool_use`` blocks (``stop_reason: tool_use``) whose
    input fits their tool's schema, the same streamed; ``tool`` gives that tool; a
    conversation with the call and its ``tool_result`` is served."""
    body = dict(model="tiny", max_tokens=150, tools=TOOLS,
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                messages=[{"role": "user", "content": QUESTION}],
                extra_body={"seed": 3, "temperature": 0.8})  # fmt: skip
    message = client.messages.create(**body)
    [call] = message.content
    assert call.type == "tool_use" and message.stop_reason == "tool_use"
    jsonschema.validate(call.input, SCHEMAS[call.name])
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", call.name,
                                                                   call.input)]  # fmt: skip
    named = client.messages.create(model="tiny", max_tokens=80, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_time"},
                                   messages=[{"role": "user", "content": QUESTION}])  # fmt: skip
    assert [b.name for b in named.content] == ["get_time"]
    follow = client.messages.create(model="tiny", max_tokens=5, tools=TOOLS, messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": call.id, "name": call.name,
                                           "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": '{"temp": 21}'}]},
    ], tool_choice={"type": "none"})  # fmt: skip
    assert [b.type for b in follow.content] == ["text"]


def test_text_around_a_call_keeps_its_place(shared_server, client):
    """A reply "hi <call> bye" (a grammar makes the model write it; auto tool choice): a text
    block, the ``tool_use`` block, a text block, in that order, whole and streamed."""
    import re

    reply = ('hi <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> '
             "bye")  # fmt: skip
    body = dict(model="tiny", max_tokens=60, tools=TOOLS, messages=[{"role": "user",
                "content": QUESTION}], extra_body={"structured_outputs": {
                    "regex": re.sub(r"([\[\]{}])", r"\\\1", reply)}})  # fmt: skip
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    for got in (whole, final):
        assert [(b.type, getattr(b, "text", None) or getattr(b, "name", None))
                for b in got.content] == [("text", "hi"), ("tool_use", "get_time"),
                                          ("text", "bye")]  # fmt: skip
        assert got.stop_reason == "tool_use"


def test_the_conversation_is_read_as_anthropic_reads_it(client, chat):
    """A final assistant message is a reply begun for the model (it goes on from it, as the
    chat route's ``continue_final_message``); two user turns in a row are one; a prompt
    longer than the context is still counted."""
    begun = [{"role": "user", "content": QUESTION},
             {"role": "assistant", "content": "The weather"}]  # fmt: skip
    message = client.messages.create(model="tiny", max_tokens=6, messages=begun,
                                     extra_body=GREEDY)  # fmt: skip
    want = chat.chat.completions.create(model="tiny", max_tokens=6, temperature=0,
                                        messages=begun, extra_body={
                                            "continue_final_message": True,
                                            "add_generation_prompt": False})  # fmt: skip
    assert message.content[0].text == want.choices[0].message.content
    split = client.messages.count_tokens(model="tiny", messages=[
        {"role": "user", "content": "Hello"}, {"role": "user", "content": "there"}])  # fmt: skip
    joined = client.messages.count_tokens(model="tiny", messages=[
        {"role": "user", "content": "Hello\n\nthere"}])  # fmt: skip
    assert split.input_tokens == joined.input_tokens
    long = client.messages.count_tokens(model="tiny", messages=[
        {"role": "user", "content": "word " * 5000}])  # fmt: skip
    assert long.input_tokens > 4000


def test_a_max_tokens_past_the_context_is_cut_to_what_it_leaves(client, shared_server):
    """Claude Code asks for 32,000 tokens whatever the model: the reply gets the room the
    context leaves and stops there with ``max_tokens`` (a prompt that leaves none is a 400)."""
    info = httpx.get(shared_server.base_url + "/models", headers=shared_server.headers).json()
    context = info["data"][0]["max_model_len"]
    # (streamed, as Claude Code asks: the SDK refuses so large a max_tokens otherwise)
    with client.messages.stream(model="tiny", max_tokens=32000,
                                messages=[{"role": "user", "content": "x"}],
                                extra_body={"ignore_eos": True}) as stream:  # fmt: skip
        message = stream.get_final_message()
    assert message.stop_reason == "max_tokens"
    assert (
        message.usage.input_tokens
        + message.usage.cache_read_input_tokens
        + (message.usage.output_tokens)
        == context
    )


def test_output_config_format_makes_json_its_schema_accepts(client):
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    message = client.messages.create(model="tiny", max_tokens=60, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": QUESTION}],
                                     output_config={"format": {"type": "json_schema",
                                                               "schema": schema}})  # fmt: skip
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_the_api_key_may_come_as_x_api_key(shared_server):
    """Either header may hold the key (a client may send both, one of them for another
    service); a wrong one in both is a 401."""
    bad = anthropic.Anthropic(base_url=shared_server.url, api_key="wrong")
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    for headers, status in (({"x-api-key": shared_server.api_key,
                              "Authorization": "Bearer other"}, 200),
                            ({"x-api-key": "", "Authorization": "Basic abc"}, 401)):  # fmt: skip
        r = httpx.post(shared_server.url + "/v1/messages", json=body, headers=headers)
        assert r.status_code == status, r.text


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens", "Field required"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": "AA=="}}]}]},
         "messages[0].content[0]", "this model reads no images"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "data": "AA=="}}]}]},
         "messages[0].content[0]", "no document"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
          "tool_choice": {"type": "tool"}}, "tool_choice.name", "needs a name"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "n": 2}, "n",
         "one reply"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x " * 5000}]},
         "messages", "context length"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_it(shared_server, body, param, words):
    headers = {"x-api-key": shared_server.api_key}
    r = httpx.post(shared_server.url + "/v1/messages", json={"model": "tiny", **body},
                   headers=headers)  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and words in error["message"], error


def test_qwen3_coder_calls_reach_anthropic_clients_typed(llama_checkpoint, server_logs):
    """``--tool-call-parser qwen3_coder`` (Qwen3-Coder's ``<function=...>`` blocks; a grammar
    makes the random model write one): ``/v1/messages`` gives a ``tool_use`` block whose input
    is typed by the tool's schema, whole and streamed; the chat route gives the same call."""
    import json
    import re

    from tests.server.conftest import start_server

    reply = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
             "</function>\n</tool_call>")  # fmt: skip
    tools = [
        {
            "name": "get_weather",
            "input_schema": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string"},
                    "days": {"type": "integer"},
                },
            },
        }
    ]
    body = dict(model="tiny", max_tokens=300, tools=tools,
                messages=[{"role": "user", "content": QUESTION}],
                extra_body={"structured_outputs": {"regex": re.escape(reply)}})  # fmt: skip
    want = {"city": "Paris", "unit": "celsius", "days": 3}
    for server in start_server(llama_checkpoint, server_logs, "--served-model-name", "tiny",
                               "--tool-call-parser", "qwen3_coder"):  # fmt: skip
        client = anthropic.Anthropic(base_url=server.url, api_key="none")
        message = client.messages.create(**body)
        assert message.stop_reason == "tool_use", message
        with client.messages.stream(**body) as stream:
            final = stream.get_final_message()
        for got in (message, final):
            assert [(b.type, b.name, b.input) for b in got.content] == [
                ("tool_use", "get_weather", want)]  # fmt: skip
            assert got.stop_reason == "tool_use"
        chat = OpenAI(base_url=server.base_url, api_key="none").chat.completions.create(
            model="tiny", max_tokens=300, messages=body["messages"],
            tools=[{"type": "function", "function": {"name": "get_weather",
                                                     "parameters": tools[0]["input_schema"]}}],
            extra_body=body["extra_body"])  # fmt: skip
        [call] = chat.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == want
