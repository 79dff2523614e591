"""Two replicas on a local Ray Serve behind one endpoint: ``infer serve --data-parallel-size 2``
as a real process, driven over HTTP.

The server starts its own local Ray (about 20 s on 2 cores); the module starts one, with the
prefix-aware policy, an API key and steps slowed to 5 ms. The routing workload is sent one
request at a time, so the router's choices and the engines' caches (and so the hit rates) are
the same on any machine; round-robin's hit rate on it is that of two engines taking the requests
in turn (what a round-robin router does with one request at a time: RoundRobin's cycle is
tested in test_policy.py), run in this process with the replicas' settings.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from infer.cluster.workload import SharedPrefixWorkload
from tests.server.conftest import ServerProcess, start_server

pytest.importorskip("ray.serve", reason='needs Ray Serve: pip install -e ".[ray]"')
pytestmark = pytest.mark.ray

# The KV pool of each replica: the workload's 8 prefixes of 8 blocks fit two pools together
# (4 prefixes each) but not one, so where a prefix is sent decides whether it is still cached.
REPLICA_FLAGS = ("--data-parallel-size", "2", "--enable-prefix-caching", "--num-kv-blocks", "40",
                 "--max-num-seqs", "2", "--max-queued-requests", "2", "--enable-lora")  # fmt: skip
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]


@pytest.fixture(scope="module")
def prefix_server(llama_checkpoint, server_logs) -> Iterator[ServerProcess]:
    # (an API key: the replicas check it, and the router on its own routes; steps of at least
    # 5 ms, so each of the overload's 200-token requests runs >= 1 s: the others arrive while
    # the first ones still hold the queues, even when Ray routes slowly; a drain as long as the
    # SIGTERM test's stream takes on a slow machine, where 30 s once cut it)
    yield from start_server(llama_checkpoint, server_logs, *REPLICA_FLAGS,
                            "--router-policy", "prefix", "--drain-timeout", "300",
                            api_key="router-key",
                            env={"INFER_TEST_STEP_DELAY": "0.005",
                                 "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})  # fmt: skip


def metric_values(server: ServerProcess) -> dict[str, float]:
    """The endpoint's /metrics as ``name{labels}`` -> value (histogram buckets left out)."""
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "_bucket{" not in line:
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def total(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    got = 0.0
    for key, value in values.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            got += value
    return got


def wait_idle(server: ServerProcess, timeout: float = 60.0) -> dict[str, float]:
    """Poll until nothing runs or waits on any replica, every KV block is free and the router
    has nothing in flight."""
    deadline = time.monotonic() + timeout
    while True:
        m = metric_values(server)
        stats = httpx.get(server.url + "/router/stats", headers=server.headers, timeout=30).json()
        idle = (
            total(m, "vllm:num_requests_running") == 0
            and total(m, "vllm:num_requests_waiting") == 0
            and total(m, "infer:kv_cache_free_blocks") == total(m, "infer:kv_cache_total_blocks")
            and stats["in_flight"] == [0, 0]
        )
        if idle:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the replicas did not go idle: {stats} {m}")
        time.sleep(0.1)


def metrics_when(server: ServerProcess, ready: Callable[[dict[str, float]], bool],
                 timeout: float = 30.0) -> dict[str, float]:  # fmt: skip
    """The endpoint's metrics once ``ready(metrics)`` holds, else the last read after
    ``timeout``: a replica's API layer may count a request's ending a moment after its engine
    is idle (an abort, under load)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metric_values(server)
        if ready(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def ended(now: dict[str, float], before: dict[str, float], reason: str) -> float:
    """Requests finished with ``reason`` between two reads of the metrics."""
    name = "vllm:request_success_total"
    return total(now, name, finished_reason=reason) - total(before, name, finished_reason=reason)


def alternating_hit_rate(model: Path) -> float:
    """The prefix cache hit rate of the workload (as :func:`run_workload` sends it) on two
    engines with the replicas' settings that take its requests in turn, one at a time."""
    from infer import SamplingParams
    from infer.config import EngineConfig
    from infer.engine.engine import LLMEngine

    config = EngineConfig.from_kwargs(model=str(model), enable_prefix_caching=True,
                                      num_kv_blocks=40, max_num_seqs=2)  # fmt: skip
    engines = [LLMEngine(config) for _ in range(2)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i, (_, ids) in enumerate(SharedPrefixWorkload().requests()):
        engine = engines[i % 2]
        engine.add_request(str(i), ids, params)
        while engine.has_unfinished_requests():
            engine.step()
    stats = [engine.get_stats() for engine in engines]
    return sum(s.prefix_cache_hits_total for s in stats) / sum(
        s.prefix_cache_queries_total for s in stats
    )


def run_workload(server: ServerProcess) -> tuple[float, list[float]]:
    """The 8 prefixes x 16 requests workload, one request at a time; the prefix cache hit rate
    over it and each replica's share of its requests (from the router's counter)."""
    before = metric_values(server)
    with server.client() as c:
        assert c.post("/reset_prefix_cache").status_code == 200
        for _, ids in SharedPrefixWorkload().requests():
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 4,
                                                "ignore_eos": True})  # fmt: skip
            assert r.status_code == 200, r.text
    after = metric_values(server)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    hit_rate = delta("vllm:prefix_cache_hits_total") / delta("vllm:prefix_cache_queries_total")
    sent = [delta("infer:router_requests_total", replica=f"replica-{i}") for i in range(2)]
    assert sum(sent) == 128
    return hit_rate, [s / sum(sent) for s in sent]


def test_completions_and_chat_through_the_router(prefix_server):
    client = openai.OpenAI(base_url=prefix_server.base_url, api_key=prefix_server.api_key)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    got = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert got.usage.completion_tokens == 8
    streamed = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8,
                                         temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == got.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                          temperature=0)  # fmt: skip
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                                 temperature=0, stream=True))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    # the same chat again: the router tokenized it, and sends it where it went before
    stats = httpx.get(prefix_server.url + "/router/stats", headers=prefix_server.headers).json()
    assert stats["policy"] == "prefix" and sum(stats["sent"]) == 4
    # errors pass through with their status and body
    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    bad = httpx.post(prefix_server.base_url + "/completions", content=b"{not json",
                     headers={**prefix_server.headers, "content-type": "application/json"})  # fmt: skip
    assert bad.status_code == 400 and "error" in bad.json()
    assert httpx.get(prefix_server.url + "/health").json() == {"status": "ok"}
    wait_idle(prefix_server)


def test_a_stored_response_is_found_on_the_replica_that_made_it(prefix_server):
    """``/v1/responses`` goes to the replicas in turn, and a response is kept by the one that
    made it: continuing it, fetching it and deleting it reach that replica whichever the turn
    falls on (an unknown id is still a 400 / 404 naming it)."""
    client = openai.OpenAI(base_url=prefix_server.base_url, api_key=prefix_server.api_key)
    first = client.responses.create(model="tiny", input="Name a prime number.",
                                    max_output_tokens=4, temperature=0)  # fmt: skip
    last = first
    for _ in range(3):  # (the turns fall on both replicas)
        last = client.responses.create(model="tiny", input="And another?", temperature=0,
                                        max_output_tokens=4, previous_response_id=last.id)  # fmt: skip
        assert last.previous_response_id is not None
        assert last.usage.input_tokens > first.usage.input_tokens
    for _ in range(2):
        assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="no response with id"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="no response with id"):
        client.responses.create(model="tiny", input="x", previous_response_id=first.id)


def test_text_prompts_with_a_shared_prefix_stay_on_one_replica(prefix_server):
    before = metric_values(prefix_server)
    long_doc = "The quick brown fox jumps over the lazy dog near the river bank. " * 12
    with prefix_server.client() as c:
        for q in ("Who jumps?", "Where is the dog?", "What colour is the fox?", "Why?"):
            r = c.post("/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 2,
                "messages": [{"role": "system", "content": long_doc},
                             {"role": "user", "content": q}]})  # fmt: skip
            assert r.status_code == 200, r.text
    after = metric_values(prefix_server)
    hits = [total(after, "infer:router_requests_total", replica=f"replica-{i}", reason="prefix-hit")
            - total(before, "infer:router_requests_total", replica=f"replica-{i}",
                    reason="prefix-hit") for i in range(2)]  # fmt: skip
    assert sorted(hits) == [0, 3]  # the first one chose a replica; the other three followed
    cached = total(after, "vllm:prefix_cache_hits_total") - total(
        before, "vllm:prefix_cache_hits_total"
    )
    assert cached > 0


def test_the_responses_and_messages_apis_are_routed_by_prefix(prefix_server):
    """``/v1/responses`` and ``/v1/messages`` are routed as chat is: by their conversation's
    blocks (the instructions or the system prompt a client sends every time), so requests
    sharing it follow its cached prefix."""
    before = metric_values(prefix_server)
    long_doc = "Answer in one word, about rivers, foxes and dogs near the bank. " * 12
    with prefix_server.client() as c:
        for q in ("Who jumps?", "Where is the dog?", "Why?"):
            r = c.post("/v1/responses", json={"model": "tiny", "max_output_tokens": 2,
                                              "instructions": long_doc, "input": q})  # fmt: skip
            assert r.status_code == 200, r.text
            r = c.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "system": long_doc,
                                             "messages": [{"role": "user", "content": q}]})  # fmt: skip
            assert r.status_code == 200, r.text
    after = metric_values(prefix_server)
    hits = [total(after, "infer:router_requests_total", replica=f"replica-{i}", reason="prefix-hit")
            - total(before, "infer:router_requests_total", replica=f"replica-{i}",
                    reason="prefix-hit") for i in range(2)]  # fmt: skip
    assert sorted(hits) == [0, 5]  # (the two fronts write the same chat prompt)
    wait_idle(prefix_server)


def test_embeddings_of_one_document_stay_on_one_replica(prefix_server):
    """Embedding requests are routed as generation is: their first input's blocks decide, so
    chunks of one long document sent one by one follow its cached prefix."""
    before = metric_values(prefix_server)
    doc = "A class definition defines a class object, and its suite is executed once. " * 12
    with prefix_server.client() as c:
        for tail in ("first part", "second part", "third part"):
            r = c.post("/v1/embeddings", json={"model": "tiny", "input": [doc + tail, tail]})
            assert r.status_code == 200, r.text
            assert len(r.json()["data"]) == 2
    after = metric_values(prefix_server)
    hits = [total(after, "infer:router_requests_total", replica=f"replica-{i}", reason="prefix-hit")
            - total(before, "infer:router_requests_total", replica=f"replica-{i}",
                    reason="prefix-hit") for i in range(2)]  # fmt: skip
    assert sorted(hits) == [0, 2]
    wait_idle(prefix_server)


def test_aborted_streams_free_everything(prefix_server):
    before = metric_values(prefix_server)
    long = {"model": "tiny", "max_tokens": 560, "ignore_eos": True, "stream": True}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=prefix_server.url, timeout=60,
                                     headers=prefix_server.headers) as c:  # fmt: skip

            async def dropped(prompt: str) -> int:
                events = 0
                async with c.stream("POST", "/v1/completions",
                                    json={**long, "prompt": prompt}) as r:  # fmt: skip
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        events += line.startswith("data: ")
                        if events == 3:
                            break  # leaving the block closes the connection mid-stream
                return events

            assert await asyncio.gather(dropped("Once upon a time"), dropped("In a galaxy")) == [
                3, 3]  # fmt: skip
            # The streams' aborts reach the replicas a moment later: until they have, a stream
            # still counts as running and would pass for the request below.
            await asyncio.to_thread(wait_idle, prefix_server)

            # a non-streamed request whose client goes away once it runs
            whole = asyncio.create_task(c.post("/v1/completions", json={
                **long, "stream": False, "prompt": "A long time ago"}))  # fmt: skip
            while total(metric_values(prefix_server), "vllm:num_requests_running") < 1:
                assert not whole.done(), "the request ended before it was seen running"
                await asyncio.sleep(0.02)
            whole.cancel()  # closes its connection
            await asyncio.gather(whole, return_exceptions=True)

    asyncio.run(run())
    wait_idle(prefix_server)
    after = metrics_when(
        prefix_server, lambda m: ended(m, before, "abort") + ended(m, before, "length") >= 3
    )

    # The streams were dropped with 557 tokens to go. The non-streamed one is aborted unless
    # the engine finished all its tokens before the disconnect reached it (a fast machine):
    # either way it ended, and nothing is left running or holding a block (wait_idle).
    aborts = ended(after, before, "abort")
    assert aborts >= 2 and aborts + ended(after, before, "length") == 3
    # and the replicas serve on
    with prefix_server.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200


def test_prefix_routing_doubles_the_hit_rate_of_round_robin(prefix_server, llama_checkpoint):
    prefix_rate, prefix_shares = run_workload(prefix_server)
    rr_rate = alternating_hit_rate(llama_checkpoint)
    print(f"hit rate: prefix {prefix_rate:.3f} (shares {prefix_shares}), "
          f"round-robin {rr_rate:.3f}")  # fmt: skip
    assert prefix_rate >= 2 * rr_rate
    assert max(prefix_shares) <= 0.6


def test_the_key_guards_every_route_but_health(prefix_server):
    for path in ("/metrics", "/router/stats", "/v1/models"):
        assert httpx.get(prefix_server.url + path).status_code == 401, path
    assert httpx.get(prefix_server.url + "/health").status_code == 200


def test_overload_passes_through(prefix_server):
    """429 with Retry-After from a replica's full queue reaches the client unchanged."""
    long = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=prefix_server.url, timeout=120,
                                     headers=prefix_server.headers,
                                     limits=httpx.Limits(max_connections=32)) as c:  # fmt: skip
            return await asyncio.gather(*[c.post("/v1/completions", json=long)
                                          for _ in range(12)])  # fmt: skip

    results = asyncio.run(run())
    rejected = [r for r in results if r.status_code == 429]
    accepted = [r for r in results if r.status_code == 200]
    assert len(rejected) + len(accepted) == 12 and rejected, [r.status_code for r in results]
    for r in rejected:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    assert all(r.json()["usage"]["completion_tokens"] == 200 for r in accepted)
    wait_idle(prefix_server)


def test_metrics_are_the_sum_of_the_replicas(prefix_server):
    m = metric_values(prefix_server)
    assert total(m, "infer:kv_cache_total_blocks") == 80  # 2 x 40
    requests = total(m, "infer:router_requests_total")
    finished = total(m, "vllm:request_success_total")
    # every request the engines finished was routed (the 404 and 400 above never reached one)
    assert requests >= finished > 0
    assert re.search(r"^infer:router_routing_seconds_count \d", httpx.get(
        prefix_server.url + "/metrics", headers=prefix_server.headers).text, re.M)  # fmt: skip


def test_lora_adapters_load_and_unload_on_every_replica(prefix_server, llama_checkpoint,
                                                         tmp_path):  # fmt: skip
    """The LoRA routes reach every replica (sent to one in turn, an adapter loaded on one
    replica was a 404 on the other every second request); its requests are served wherever
    they go."""
    from infer.testing.lora import build_lora_adapter

    path = build_lora_adapter(llama_checkpoint, tmp_path / "a1", rank=4, seed=1)
    http = httpx.Client(base_url=prefix_server.url, headers=prefix_server.headers, timeout=60)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(path)})
    assert r.status_code == 200, r.text
    body = {"model": "a1", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    for _ in range(4):  # (both replicas: the policy spreads new prompts, round-robin the rest)
        assert "a1" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    before = http.get("/router/stats").json()["sent"]
    for i in range(4):  # new prompts: spread over both replicas
        r = http.post("/v1/completions", json={**body, "prompt": f"{i} {body['prompt']}"})
        assert r.status_code == 200, r.text
    after = http.get("/router/stats").json()["sent"]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 200
    for _ in range(4):
        assert "a1" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert http.post("/v1/completions", json=body).status_code == 404
    wait_idle(prefix_server)


def test_sigterm_finishes_the_streams_in_flight_and_refuses_new_requests(prefix_server):
    """As a single server drains: a stream running when SIGTERM comes finishes (its last event,
    usage and [DONE]), requests that arrive meanwhile get 503, and the process exits 0. Serve
    shut down at once cut the stream. (Last in the module: it stops the module's server.)"""
    import signal
    import threading

    server = prefix_server
    body = {"model": "tiny", "prompt": "drain me", "max_tokens": 600, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    events: list[str] = []
    first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          headers=server.headers, timeout=120) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()

    assert server.log_lines("serving tiny on http://", timeout=120)  # (a signal before: no drain)
    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    refused = None
    while reader.is_alive() and refused is None:  # (the drain starts within a second)
        try:
            r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=30,
                           json={"model": "tiny", "prompt": "late", "max_tokens": 2})  # fmt: skip
        except httpx.TransportError:
            break
        if r.status_code == 503:
            refused = r.json()
        time.sleep(0.1)
    reader.join(120)
    assert refused is not None and refused["error"]["code"] == "unavailable", refused
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 600
    assert server.proc.wait(120) == 0


def test_the_router_renders_a_chat_as_the_server_does(llama_checkpoint):
    """The router hashes a chat's prompt from its own rendering (a tokenizer and the settings,
    no engine): the same ids the server computes, so a repeated chat goes where its prefix is."""
    from transformers import AutoTokenizer

    from infer.cluster.router import _ChatRendering
    from infer.server.chat import render_request
    from infer.server.protocol import ChatCompletionRequest

    tokenizer = AutoTokenizer.from_pretrained(llama_checkpoint)
    req = ChatCompletionRequest(messages=MESSAGES)
    ids = render_request(_ChatRendering(tokenizer, None), req)  # type: ignore[arg-type]
    assert ids == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)  # fmt: skip
