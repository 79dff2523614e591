"""OpenAI's Responses API (``POST /v1/responses``) with the ``openai`` SDK: a response is the
chat reply to the same conversation (greedy: the same text, the same token counts), streamed as
typed events the SDK's stream helper assembles into the same response; stored responses are
continued by ``previous_response_id``, fetched and deleted; tool calls come back as
``function_call`` items and their outputs go back in; ``text.format`` constrains the reply;
logprobs come with ``include``; what infer does not serve is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI
from tests.server.test_tool_calls import SCHEMAS, TIME, WEATHER

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city",
     "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": TIME},
]  # fmt: skip
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(shared_server) -> OpenAI:
    return OpenAI(base_url=shared_server.base_url, api_key=shared_server.api_key)


def _chat(client: OpenAI, messages: list[dict], max_tokens: int = 12):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                          max_tokens=max_tokens)  # fmt: skip


def test_a_response_is_the_chat_reply(client, shared_server):
    """``input`` and ``instructions`` are the chat's user and system messages: the greedy text,
    the token counts and the cut (``incomplete``, ``max_output_tokens``) are the chat reply's;
    the response echoes its settings and is stored (``GET`` gives it back)."""
    resp = client.responses.create(model="tiny", input=QUESTION, instructions="Be brief.",
                                   max_output_tokens=12, temperature=0,
                                   metadata={"run": "1"})  # fmt: skip
    chat = _chat(client, [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": QUESTION}])  # fmt: skip
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat.choices[0].message.content
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == chat.usage.total_tokens
    if chat.choices[0].finish_reason == "length":
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    else:
        assert resp.status == "completed"
    assert (resp.instructions, resp.max_output_tokens, resp.metadata) == ("Be brief.", 12,
                                                                         {"run": "1"})  # fmt: skip
    assert client.responses.retrieve(resp.id).output_text == resp.output_text
    stats = shared_server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_streamed_response_is_the_same_response(client):
    """The SDK's stream helper takes the events (numbered from 0; ``created`` and
    ``in_progress`` first, the text's deltas, then ``completed``, or ``incomplete`` where
    ``max_output_tokens`` cut the reply) and assembles the response the unstreamed request
    gives (the SDK's ``get_final_response`` wants a completed one)."""
    body = dict(model="tiny", input=QUESTION, max_output_tokens=10, temperature=0)
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response() if whole.status == "completed" else events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-1] == f"response.{whole.status}"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert [e.text for e in events if e.type == "response.output_text.done"] == [whole.output_text]


def test_previous_response_id_continues_the_conversation(client):
    """A stored response's conversation (its input and reply) comes before the next input:
    the answer is the chat reply to the three messages; a deleted, unstored or unknown
    response is a 404 (a 400 naming previous_response_id where a request names it)."""
    first = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=8,
                                    temperature=0)  # fmt: skip
    second = client.responses.create(model="tiny", input="And tomorrow?", temperature=0,
                                     previous_response_id=first.id, max_output_tokens=8)  # fmt: skip
    chat = _chat(client, [{"role": "user", "content": QUESTION},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "And tomorrow?"}], 8)  # fmt: skip
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    client.responses.delete(first.id)
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    for gone in (first.id, unstored.id, "resp_nothing"):
        with pytest.raises(openai.NotFoundError, match="no response with id"):
            client.responses.retrieve(gone)
        with pytest.raises(openai.BadRequestError, match="no response with id") as e:
            client.responses.create(model="tiny", input="x", previous_response_id=gone)
        assert e.value.body["param"] == "previous_response_id"


def test_tool_calls_are_function_call_items(client):
    """``tool_choice: required`` gives ``function_call`` items whose arguments fit their tool's
    schema (streamed: ``function_call_arguments`` events with the same calls); a named choice
    gives that function; the calls and their outputs sent back as input are served."""
    body = dict(model="tiny", input=QUESTION, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, temperature=0.8, max_output_tokens=150)  # fmt: skip
    resp = client.responses.create(**body, extra_body={"seed": 5})
    [call] = resp.output
    assert call.type == "function_call" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    with client.responses.stream(**body, extra_body={"seed": 5}) as stream:
        events = list(stream)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [(call.name, call.arguments)]
    named = client.responses.create(model="tiny", input=QUESTION, tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_time"},
                                    max_output_tokens=80)  # fmt: skip
    assert [item.name for item in named.output] == ["get_time"]
    follow = client.responses.create(model="tiny", tools=TOOLS, tool_choice="none",
                                     max_output_tokens=5, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'},
    ])  # fmt: skip
    assert [item.type for item in follow.output] == ["message"]


def test_text_around_a_call_is_one_message_before_it(client):
    """A reply "hi <call> bye" (a grammar makes the model write it; auto tool choice): one
    message of the text around the call, then the call, whole and streamed (the message
    stays open across the call while streaming)."""
    import re

    reply = ('hi <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> '
             "bye")  # fmt: skip
    body = dict(model="tiny", input=QUESTION, tools=TOOLS, max_output_tokens=60,
                extra_body={"structured_outputs": {
                    "regex": re.sub(r"([\[\]{}])", r"\\\1", reply)}})  # fmt: skip
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        final = stream.get_final_response()
    for got in (whole, final):
        assert [item.type for item in got.output] == ["message", "function_call"]
        assert got.output_text == "hibye" and got.output[1].name == "get_time"


def test_text_format_and_logprobs(client):
    """``text.format`` json_schema makes the reply JSON its schema accepts; ``include`` of
    ``message.output_text.logprobs`` gives each output token's log-probability and its
    ``top_logprobs`` alternatives, as the chat endpoint gives them."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    resp = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=60,
                                   temperature=0, text={"format": {
                                       "type": "json_schema", "name": "city", "schema": schema,
                                       "strict": True}})  # fmt: skip
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"
    resp = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=6,
                                   temperature=0, top_logprobs=2,
                                   include=["message.output_text.logprobs"])  # fmt: skip
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                          "content": QUESTION}], max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)  # fmt: skip
    lps = resp.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [lp.token for lp in lps] == [lp.token for lp in want]
    assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in want], abs=1e-5)
    assert all(len(lp.top_logprobs) == 2 for lp in lps)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "x", "background": True}, "background", "not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content[0]", "this model reads no images"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input[0].content", "input_text"),
        ({"input": []}, "input", "no message"),
        ({"input": "x", "top_k": "many"}, "top_k", "valid integer"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"input": "x", "n": 2}, "n", "one reply"),
        ({"input": "x", "use_beam_search": True}, "use_beam_search", "one reply"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens",
         "reduce the prompt or max_output_tokens"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_it(shared_server, body, param, words):
    with shared_server.client() as c:
        r = c.post("/v1/responses", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and words in error["message"], error
