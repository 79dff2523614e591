"""Tool calls over HTTP: tool_choice required / named constrain the reply to valid calls
(names and arguments checked against each tool's schema, 20 seeds on a random model), replies
stream as tool-call deltas, the openai SDK's tool helpers parse them, tools and tool results
reach the chat template, and inconsistent tool fields are 400s naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from tests.server.conftest import concurrently, start_server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}  # fmt: skip
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(shared_server) -> OpenAI:
    return OpenAI(base_url=shared_server.base_url, api_key=shared_server.api_key)


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_tool_choice_always_gives_valid_calls(client, shared_server):
    """One call per reply (``parallel_tool_calls: false``) is bounded, so every reply ends on
    its own; with parallel calls the list may grow past max_tokens and be cut (``length``,
    the text returned as content), and every reply that ends on its own is valid."""
    cases = [(seed, parallel) for seed in range(20) for parallel in (False, True)]
    outs = concurrently(lambda case: client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=case[1], temperature=1.0, seed=case[0], max_tokens=150,
    ), cases)  # fmt: skip
    finished = 0
    for (_, parallel), out in zip(cases, outs, strict=True):
        choice = out.choices[0]
        if parallel and choice.finish_reason == "length":
            assert choice.message.content.startswith('[{"name":')
            continue
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls)
        assert parallel or len(choice.message.tool_calls) == 1
        finished += parallel
    print(f"{finished} of 20 parallel-call replies ended on their own")
    assert finished > 0
    stats = shared_server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_named_tool_choice_gives_that_function_with_valid_arguments(client):
    outs = concurrently(lambda seed: client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=80,
    ), range(10))  # fmt: skip
    for named in outs:
        calls = named.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_time"]
        _check_calls(calls)


def test_streamed_tool_calls_arrive_as_deltas(client):
    body = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, temperature=0.8, seed=5, max_tokens=150)  # fmt: skip
    whole = client.chat.completions.create(**body).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content
        # the role first, then the calls: no empty chunk for each held-back token
        assert delta.role or delta.tool_calls or chunk.choices[0].finish_reason, chunk
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole
    ]


class GetWeather(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["celsius", "fahrenheit"]


def test_openai_sdk_tool_helpers_parse_the_calls(client):
    out = client.chat.completions.parse(
        model="tiny", messages=MESSAGES, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", parallel_tool_calls=False, temperature=0.5, seed=1,
        max_tokens=150,
    )  # fmt: skip
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


class Address(BaseModel):
    city: str = Field(max_length=10)


class Move(BaseModel):
    to: Address
    via: list[Address] = Field(max_length=2)


def test_required_calls_follow_tools_whose_schemas_have_defs(client):
    """A tool's parameters that reference their own ``$defs`` (what the SDK's
    pydantic_function_tool makes of nested models) still resolve once nested in the schema of
    the required call list (they were a 400: "Pointer '/$defs/Address' does not exist"); a
    function without parameters takes none (``{}``)."""
    tools = [openai.pydantic_function_tool(Move),
             {"type": "function", "function": {"name": "ping"}}]  # fmt: skip
    assert "$defs" in tools[0]["function"]["parameters"]
    outs = concurrently(lambda seed: client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=tools, tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200,
    ), range(6))  # fmt: skip
    ended = [out.choices[0] for out in outs if out.choices[0].finish_reason == "tool_calls"]
    assert ended
    for choice in ended:
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        if call.function.name == "ping":
            assert arguments == {}
        else:
            Move.model_validate(arguments)
    named = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=tools, max_tokens=20,
        tool_choice={"type": "function", "function": {"name": "ping"}})  # fmt: skip
    assert json.loads(named.choices[0].message.tool_calls[0].function.arguments) == {}


def test_an_auto_reply_with_a_block_that_makes_no_call_is_content(shared_server):
    """A ``<tool_call>`` block whose name is not a string is text, whole and streamed (it was a
    500, and a stream cut without an error or ``[DONE]``); the same reply with a proper name
    is a call."""
    url = f"{shared_server.base_url}/chat/completions"
    for name, calls in (('["get_time"]', 0), ('"get_time"', 1)):
        reply = f'<tool_call>{{"name": {name}, "arguments": {{}}}}</tool_call>'
        body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 60,
                "structured_outputs": {"regex": re.sub(r"([\[\]{}])", r"\\\1", reply)}}  # fmt: skip
        r = httpx.post(url, headers=shared_server.headers, json=body, timeout=60)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert len(message.get("tool_calls") or []) == calls
        assert message["content"] == (None if calls else reply)
        with httpx.stream("POST", url, headers=shared_server.headers, timeout=60,
                          json={**body, "stream": True}) as s:  # fmt: skip
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in lines[:-1]]
        assert "".join(d.get("content") or "" for d in deltas) == (reply if not calls else "")
        assert sum(len(d.get("tool_calls") or []) for d in deltas) == calls


def test_tool_results_in_the_history_are_served(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]  # fmt: skip
    out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=5)  # fmt: skip
    assert out.choices[0].message.tool_calls in (None, [])
    assert out.choices[0].finish_reason in ("stop", "length")


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def test_the_chat_template_sees_the_tools(llama_checkpoint, server_logs, tmp_path: Path):
    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    server = start_server(llama_checkpoint, server_logs, "--chat-template", str(template))
    s = next(server)
    try:
        c = OpenAI(base_url=s.base_url, api_key="unused")
        plain = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
        with_tools = c.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                               tool_choice="none", max_tokens=1)  # fmt: skip
        assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    finally:
        server.close()


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "'nope', which is not among the tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "two tools are named 'get_weather'"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "cannot be combined"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
          "tool_choice": "required"}, "tools", "invalid JSON schema"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400s_naming_the_field(body, param, message, shared_server):
    r = httpx.post(f"{shared_server.base_url}/chat/completions", headers=shared_server.headers,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **body})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and message in error["message"], error
