"""The OpenAI SDK against a real server: shapes, streaming, n, logprobs, stop, seeds, usage, and
text equal to the offline ``LLM`` API's for the same request."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from infer import LLM, SamplingParams

PROMPT = "The quick brown fox"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def offline(offline_llm) -> LLM:
    return offline_llm


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


# ---- basics -------------------------------------------------------------------------------------


def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_completion_text_equals_offline_llm(client, offline):
    want = offline.generate(PROMPT, greedy(24))[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    choice = got.choices[0]
    assert choice.text == want.outputs[0].text
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    assert got.id.startswith("cmpl-") and got.object == "text_completion" and got.model == "tiny"


def test_completion_stream_equals_non_stream_and_ends_with_usage(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    *content, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(len(c.choices) == 1 and c.usage is None for c in content)
    # (how many events carry the text is the server's timing: deltas that queue up while its
    # event loop waits are sent as one event)
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stream_ends_with_done_and_has_no_usage_unless_asked(server):
    with httpx.stream("POST", server.base_url + "/completions", headers=server.headers, timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 5, "stream": True}) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    bodies = [json.loads(e) for e in events[:-1]]
    assert all(b["choices"] and b.get("usage") is None for b in bodies)


def test_chat_text_equals_offline_llm(client, offline):
    want = offline.chat(MESSAGES, greedy(20))
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20,
                                         temperature=0)  # fmt: skip
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.id.startswith("chatcmpl-") and got.object == "chat.completion"


def test_chat_stream_sends_role_first_then_pieces_then_usage(client):
    kw = dict(model="tiny", messages=MESSAGES, max_completion_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    first, *content, last = chunks
    assert first.choices[0].delta.role == "assistant"
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.completion_tokens == 16  # max_completion_tokens is honoured
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content
    assert content[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_max_tokens_gives_length_and_exact_usage(client):
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=7,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 7


# ---- n, seeds ---------------------------------------------------------------------------------


def test_n_choices_equal_offline_children(client, offline):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16)
    want = [o.text for o in offline.generate(PROMPT, params)[0].outputs]
    got = client.completions.create(model="tiny", prompt=PROMPT, n=3, temperature=1.0, seed=7,
                                    max_tokens=16)  # fmt: skip
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == want
    assert len(set(want)) > 1  # seed + i: the children differ


def test_n_in_a_stream_interleaves_choice_indices(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, n=2,
                                                 max_tokens=8, temperature=0, stream=True))  # fmt: skip
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] != ""  # greedy: both children say the same


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                         temperature=1.0, seed=seed).choices[0].text  # fmt: skip

    assert sample(123) == sample(123)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


# ---- logprobs, stop ---------------------------------------------------------------------------


def test_completion_logprobs(client):
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                    logprobs=3)  # fmt: skip
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0.0
        assert 1 <= len(top) <= 4 and top[token] == value
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely


def test_chat_logprobs(client):
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.bytes == list(item.token.encode())


def test_stop_string_cuts_the_text(client, offline):
    base = offline.generate(PROMPT, greedy(24))[0].outputs[0].text
    stop = base[6:9]
    assert stop.strip(), "the baseline text is too short for this test"
    cut = base.index(stop)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                    stop=[stop])  # fmt: skip
    assert got.choices[0].text == base[:cut]
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_extra["stop_reason"] == stop  # vLLM's extra field
    kept = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                     stop=stop, extra_body={"include_stop_str_in_output": True})  # fmt: skip
    assert kept.choices[0].text == base[: cut + len(stop)]


def test_stop_token_ids_match_offline(client, offline):
    ids = offline.generate(PROMPT, greedy(24, ignore_eos=True))[0].outputs[0].token_ids
    stop_id = ids[4]
    want = offline.generate(PROMPT, greedy(24, ignore_eos=True, stop_token_ids=(stop_id,)))[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id], "ignore_eos": True})  # fmt: skip
    assert got.choices[0].finish_reason == "stop" == want.outputs[0].finish_reason
    assert got.choices[0].text == want.outputs[0].text
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids) <= 5


# ---- prompt forms, echo, tokens ---------------------------------------------------------------


def test_prompt_forms_and_choice_indices(client, server):
    ids = httpx.post(
        server.url + "/tokenize", json={"prompt": PROMPT}, headers=server.headers
    ).json()["tokens"]
    as_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    as_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert as_ids.choices[0].text == as_text.choices[0].text
    many = client.completions.create(model="tiny", prompt=[PROMPT, "def main():"], n=2,
                                     max_tokens=8, temperature=0)  # fmt: skip
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == as_text.choices[0].text
    assert many.choices[2].text == many.choices[3].text
    batch = client.completions.create(model="tiny", prompt=[ids, ids[:2]], max_tokens=8,
                                      temperature=0)  # fmt: skip
    assert batch.choices[0].text == as_text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + 2


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                       echo=True)  # fmt: skip
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_tokenize_detokenize_round_trip(server):
    with server.client() as c:
        tok = c.post("/tokenize", json={"prompt": "Unicode: héllo wörld"}).json()
        assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
        assert tok["token_strs"] is None
        strs = c.post("/tokenize", json={"prompt": "Unicode: héllo wörld",
                                         "return_token_strs": True}).json()["token_strs"]  # fmt: skip
        assert len(strs) == tok["count"] and all(isinstance(t, str) and t for t in strs)
        back = c.post("/detokenize", json={"tokens": tok["tokens"]}).json()
        assert back["prompt"] == "Unicode: héllo wörld"
        chat = c.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat["count"] > tok["count"]


def test_continuous_usage_stats(server):
    body = {"prompt": PROMPT, "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream(
        "POST", server.base_url + "/completions", headers=server.headers, json=body, timeout=60
    ) as r:
        events = [json.loads(e) for e in sse_events(r)[:-1]]
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


# ---- field policy -----------------------------------------------------------------------------


def test_unknown_fields_are_ignored_with_a_log_line(client, server):
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                    extra_body={"frobnicate_level": 11})  # fmt: skip
    assert got.choices[0].text is not None
    assert "ignoring unknown field(s) frobnicate_level" in server.log()


@pytest.mark.parametrize(
    "field,value",
    [("functions", [{"name": "f"}]),  # the legacy spelling of tools
     ("prediction", {"type": "content", "content": "x"}),
     ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
     ("prompt_embeds", "AAAA")],
)  # fmt: skip
def test_meaning_changing_fields_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                       extra_body={field: value})  # fmt: skip
    assert err.value.body["param"] == field and field in err.value.body["message"]


def test_harmless_values_of_structured_fields_pass(client):
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                         response_format={"type": "text"}, tool_choice="none")  # fmt: skip
    assert got.choices[0].finish_reason in ("stop", "length")


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-5", prompt=PROMPT, max_tokens=3)
    assert err.value.body["param"] == "model"


# ---- ops routes ---------------------------------------------------------------------------------


def test_health_answers_get_and_head_without_a_key(server):
    # Load balancers' probes send HEAD as often as GET; neither needs the API key.
    got = httpx.get(server.url + "/health")
    assert got.status_code == 200
    head = httpx.head(server.url + "/health")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]


def test_openapi_schema_describes_the_api(server):
    spec = httpx.get(server.url + "/openapi.json", headers=server.headers).json()
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                 "/tokenize", "/detokenize", "/reset_prefix_cache"]:  # fmt: skip
        assert path in spec["paths"], path
    schemas = spec["components"]["schemas"]
    completion_fields = schemas["CompletionRequest"]["properties"]
    for field in ["prompt", "max_tokens", "ignore_eos", "stream_options", "logprobs", "echo",
                  "priority", "cache_salt", "min_tokens", "seed"]:  # fmt: skip
        assert field in completion_fields, field
    assert "max_completion_tokens" in schemas["ChatCompletionRequest"]["properties"]
    post = spec["paths"]["/v1/completions"]["post"]
    ok = post["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/CompletionResponse")
    # Each SSE event: its data is a JSON chunk (or an error) or the closing [DONE].
    data = ok["text/event-stream"]["schema"]["properties"]["data"]["anyOf"]
    assert data[0] == {"const": "[DONE]"}
    assert data[1]["contentSchema"]["anyOf"][0]["$ref"].endswith("/CompletionStreamResponse")
    # Every reference resolves (the SSE event bodies included).
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(spec)))
    assert refs and refs <= set(schemas), refs - set(schemas)
    for field in ["tools", "tool_choice", "logit_bias", "prompt_logprobs"]:
        assert field in schemas["ChatCompletionRequest"]["properties"], field
    assert schemas["TokenizeRequest"]["properties"]["messages"]["anyOf"][0]["minItems"] == 1
    vocab = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] + 1
    ok = httpx.post(server.url + "/detokenize", headers=server.headers,
                    json={"tokens": [vocab - 1]})  # fmt: skip
    past = httpx.post(server.url + "/detokenize", headers=server.headers, json={"tokens": [vocab]})
    assert ok.status_code == 200 and past.status_code == 400
    assert post["responses"]["429"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ErrorResponse"
    )


def test_schema_valid_requests_once_refused_are_served(client):
    """Requests the published schema calls valid, which the server used to refuse."""
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                         logprobs=False, top_logprobs=0)  # fmt: skip
    assert got.choices[0].logprobs is None
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, echo=True,
                                       logprobs=0)  # fmt: skip
    assert echoed.choices[0].text.startswith(PROMPT)


def test_metrics_use_vllm_names_with_model_label(client, server):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
                 "vllm:request_generation_tokens_bucket"]:  # fmt: skip
        lines = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
        assert lines, name
        assert all('model_name="tiny"' in ln for ln in lines), name
    success = [ln for ln in text.splitlines()
               if ln.startswith("vllm:request_success_total{") and 'finished_reason="length"' in ln]  # fmt: skip
    assert float(success[0].rsplit(" ", 1)[1]) >= 1


def test_reset_prefix_cache_works_with_the_default_flags(server):
    """Prefix caching is on unless turned off (as in vLLM)."""
    r = httpx.post(server.url + "/reset_prefix_cache", headers=server.headers)
    assert r.status_code == 200 and r.json() == {"reset": True}


def test_access_log_has_a_line_per_request(client, server):
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    lines = server.log_lines(got.id)
    assert len(lines) == 1 and '"POST /v1/completions" 200' in lines[0]


def test_logit_bias_over_http(client, server):
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={"42": 100}, extra_body={"ignore_eos": True})  # fmt: skip
    ids = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={"42": 100}, logprobs=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert got.usage.completion_tokens == 4
    assert len(set(ids.choices[0].logprobs.tokens)) == 1
    for bias, message in [({"abc": 1}, "keys must be token ids"), ({"5": 500}, "[-100, 100]"),
                          ({"999999": 1}, "past the vocabulary")]:  # fmt: skip
        r = httpx.post(server.url + "/v1/completions", headers=server.headers,
                       json={"model": "tiny", "prompt": PROMPT, "logit_bias": bias})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        assert message in r.json()["error"]["message"]


def test_finished_counts_agree_between_metrics_and_debug(client, server):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers,
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": 500,
                            "ignore_eos": True, "stream": True}) as r:  # fmt: skip
        next(line for line in r.iter_lines() if line.startswith("data: "))  # then hang up
    server.wait_idle()
    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    from_metrics = {}
    for line in text.splitlines():
        m = re.match(r'vllm:request_success_total\{.*finished_reason="(\w+)".*\} (\S+)', line)
        if m and float(m.group(2)):
            from_metrics[m.group(1)] = int(float(m.group(2)))
    assert server.debug()["finished_total"] == from_metrics
    assert from_metrics.get("abort", 0) >= 1


def test_bad_words_are_not_generated(server):
    """vLLM's ``bad_words`` (it was refused): the first word of the greedy reply, banned,
    is not in the reply; a blank word is a 400 naming the field."""
    with server.client() as c:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True,
                "temperature": 0}  # fmt: skip
        plain = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        word = plain.split()[0]
        got = c.post("/v1/completions", json={**body, "bad_words": [word]})
        assert got.status_code == 200, got.text
        text = got.json()["choices"][0]["text"]
        assert text != plain and word not in text.split()
        for word in ("  ", "\x1c\x1f"):  # (blank to str.strip() and to the schema alike)
            blank = c.post("/v1/completions", json={**body, "bad_words": [word]})
            assert blank.status_code == 400 and blank.json()["error"]["param"] == "bad_words[0]"


def test_allowed_token_ids_bound_the_reply(server):
    """vLLM's ``allowed_token_ids``: one allowed id, that id every time, sampled or not (the
    field was ignored); one past the vocabulary is a 400 naming it."""
    with server.client() as c:
        (token,) = c.post("/tokenize", json={"prompt": "x", "add_special_tokens": False}).json()[
            "tokens"]  # fmt: skip
        want = c.post("/detokenize", json={"tokens": [token] * 4}).json()["prompt"]
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True,
                "temperature": 1.0, "allowed_token_ids": [token]}  # fmt: skip
        assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
        bad = c.post("/v1/completions", json={**body, "allowed_token_ids": [token, 10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"
