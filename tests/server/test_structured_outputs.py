"""Structured outputs over HTTP: response_format (json_object / json_schema), vLLM's
structured_outputs and guided_* fields, and the openai SDK's parse helper. The random-weight
test model would never write valid JSON on its own: the grammar guarantees it."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel
from tests.server.conftest import concurrently

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SEEDS = range(20)


@pytest.fixture(scope="module")
def client(shared_server) -> OpenAI:
    return OpenAI(base_url=shared_server.base_url, api_key=shared_server.api_key)


def test_json_schema_outputs_validate_for_every_seed(client, shared_server):
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}  # fmt: skip
    outs = concurrently(lambda seed: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A person, as JSON"}],
        response_format=response_format, temperature=1.0, seed=seed, max_tokens=120,
    ), SEEDS)  # fmt: skip
    for out in outs:
        choice = out.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stats = shared_server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_completions_take_every_spelling(client):
    cases = [
        ({"structured_outputs": {"regex": r"[a-z]{3}-[0-9]{2,4}"}}, "regex"),
        ({"guided_regex": r"[a-z]{3}-[0-9]{2,4}"}, "regex"),
        ({"structured_outputs": {"choice": ["positive", "negative", "neutral"]}}, "choice"),
        ({"guided_choice": ["positive", "negative", "neutral"]}, "choice"),
        ({"structured_outputs": {"json": SCHEMA}}, "json"),
        ({"guided_json": json.dumps(SCHEMA)}, "json"),
        ({"response_format": {"type": "json_object"}}, "object"),
        (
            {
                "structured_outputs": {
                    "grammar": 'start: "yes" | "no" | ("maybe " NUMBER)\nNUMBER: /[0-9]+/'
                }
            },
            "lark",
        ),  # fmt: skip
        ({"guided_grammar": 'root ::= "x" [0-9]+ "y"'}, "gbnf"),
    ]
    runs = [(body, kind, seed) for body, kind in cases for seed in SEEDS]
    outs = concurrently(lambda run: client.completions.create(
        model="tiny", prompt="Answer:", max_tokens=100, temperature=1.0, seed=run[2],
        extra_body=run[0],
    ), runs)  # fmt: skip
    for (_, kind, _), out in zip(runs, outs, strict=True):
        text, finish = out.choices[0].text, out.choices[0].finish_reason
        if kind == "object" and finish == "length":
            # Any JSON object may be longer than max_tokens (strings are unbounded): then
            # it is cut, as documented; the schema cases bound their strings.
            assert text.startswith("{")
            continue
        assert finish == "stop", (kind, text)
        if kind == "regex":
            assert re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", text), text
        elif kind == "choice":
            assert text in ("positive", "negative", "neutral")
        elif kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "object":
            assert isinstance(json.loads(text), dict)
        elif kind == "lark":
            assert re.fullmatch(r"yes|no|maybe [0-9]+", text), text
        else:
            assert re.fullmatch(r"x[0-9]+y", text), text


def test_a_grammar_cut_by_max_tokens_finishes_with_length(client):
    out = client.completions.create(model="tiny", prompt="n:", max_tokens=3, temperature=0,
                                    extra_body={"guided_regex": "[0-9]{40}"})  # fmt: skip
    assert out.choices[0].finish_reason == "length"
    assert re.fullmatch(r"[0-9]*", out.choices[0].text)


class Person(BaseModel):
    name: str
    age: int


def test_openai_sdk_parse_helper(client):
    out = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Who?"}], response_format=Person,
        temperature=0.7, seed=3, max_tokens=200,
    )  # fmt: skip
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Person)


def test_streamed_structured_output_matches_the_whole_one(client):
    body = dict(model="tiny", prompt="x", max_tokens=60, temperature=0,
                extra_body={"structured_outputs": {"json": SCHEMA}})  # fmt: skip
    whole = client.completions.create(**body).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True)
                       if c.choices)  # fmt: skip
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


def test_constrained_and_unconstrained_requests_share_a_batch(client):
    """Unconstrained requests give exactly their own tokens next to constrained ones."""
    plain = dict(model="tiny", prompt="The quick brown fox", max_tokens=24, temperature=0,
                 extra_body={"ignore_eos": True})  # fmt: skip
    alone = client.completions.create(**plain).choices[0].text
    import concurrent.futures

    def constrained(seed: int):
        return client.completions.create(model="tiny", prompt="x", max_tokens=60, seed=seed,
                                         extra_body={"guided_json": SCHEMA})  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        others = [pool.submit(constrained, s) for s in range(6)]
        together = [pool.submit(client.completions.create, **plain) for _ in range(2)]
        for f in others:
            jsonschema.validate(json.loads(f.result().choices[0].text), SCHEMA)
        assert [f.result().choices[0].text for f in together] == [alone, alone]


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema", "invalid JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "schema is missing"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml' is not supported"),
        ({"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
        ({"guided_choice": []}, "guided_choice", "is empty"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "is empty"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar", "invalid grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml", "unsupported key"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(body, param, message, shared_server):
    r = httpx.post(f"{shared_server.base_url}/completions", headers=shared_server.headers,
                   json={"model": "tiny", "prompt": "x", "max_tokens": 5, **body})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    ok = httpx.post(f"{shared_server.base_url}/completions", headers=shared_server.headers,
                    json={"model": "tiny", "prompt": "x", "max_tokens": 3})  # fmt: skip
    assert ok.status_code == 200
