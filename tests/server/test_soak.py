"""Soak: many mixed requests against one server (generation, and some embeddings, scores and
reranks), some clients hanging up mid-stream. Nothing
5xx, every finished answer's usage matches what its client received, and afterwards the engine
is idle with every KV block free. The default run does 300 requests; ``-m slow`` runs 5,000 and
also checks that the server's memory stays flat."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import httpx
import pytest
from tests.server.conftest import start_server

SHARED = ["The import statement combines two operations; it searches for the named module. ",
          "Exceptions are raised when an error occurs during execution of a statement. ",
          "A class definition defines a class object, and its suite is executed. "]  # fmt: skip


def _body(rng: random.Random, i: int) -> tuple[str, dict]:
    prompt = rng.choice(SHARED) * rng.randint(1, 3) + f"request {i}:"
    common = {"model": "tiny", "max_tokens": rng.randint(1, 40), "priority": rng.randint(0, 3),
              "n": rng.choice([1, 1, 2, 3]), "ignore_eos": rng.random() < 0.5,
              "temperature": rng.choice([0.0, 1.0]), "seed": i}  # fmt: skip
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": prompt}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}


async def _pooling(client: httpx.AsyncClient, rng: random.Random, i: int, stats: dict) -> None:
    """An embedding, score or rerank request (some first sent and hung up on, then again)."""
    texts = [rng.choice(SHARED) * rng.randint(1, 3) + f"text {i}.{j}" for j in range(3)]
    path, body = rng.choice([
        ("/v1/embeddings", {"input": texts, "encoding_format": rng.choice(["float", "base64"])}),
        ("/score", {"text_1": texts[0], "text_2": texts}),
        ("/rerank", {"query": texts[0], "documents": texts[1:], "top_n": 1}),
    ])  # fmt: skip
    body = {**body, "model": "tiny", "priority": rng.randint(0, 3)}
    if rng.random() < 0.2:  # gone before the answer
        try:
            await client.post(path, json=body, timeout=0.05)
        except httpx.TimeoutException:
            stats["hung_up"] += 1
    r = await client.post(path, json=body)
    stats["status"].append(r.status_code)
    if r.status_code == 200:
        data = r.json()
        count = len(data["results"]) if path == "/rerank" else len(data["data"])
        assert count == {"/v1/embeddings": 3, "/score": 3, "/rerank": 1}[path], data


async def _one(client: httpx.AsyncClient, rng: random.Random, i: int, stats: dict) -> None:
    if rng.random() < 0.15:
        await _pooling(client, rng, i, stats)
        return
    path, body = _body(rng, i)
    if rng.random() < 0.5:
        r = await client.post(path, json=body)
        stats["status"].append(r.status_code)
        if r.status_code == 200:
            data = r.json()
            if path == "/v1/completions":
                texts = [c["text"] for c in data["choices"]]
            else:
                texts = [c["message"]["content"] for c in data["choices"]]
            assert len(texts) == body["n"]
            assert data["usage"]["completion_tokens"] <= body["max_tokens"] * body["n"]
        return
    hang_up = rng.random() < 0.25
    # Logprobs name every token an event carries: the client counts exactly what it received.
    logprobs = {"logprobs": 0} if path == "/v1/completions" else {"logprobs": True}
    body = {**body, **logprobs, "stream": True, "stream_options": {"include_usage": True}}
    received = 0
    async with client.stream("POST", path, json=body) as r:
        stats["status"].append(r.status_code)
        usage = None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                lp = choice.get("logprobs") or {}
                received += len(lp.get("tokens") or lp.get("content") or [])
            if hang_up and received >= 2:
                stats["hung_up"] += 1
                return
        assert usage is not None and usage["completion_tokens"] == received, (usage, received)


async def _soak(url: str, num_requests: int, concurrency: int, stats: dict) -> None:
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)

        async def run(i: int) -> None:
            async with sem:
                await _one(client, random.Random(rng.random()), i, stats)

        await asyncio.gather(*[run(i) for i in range(num_requests)])


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _run(llama_checkpoint, server_logs, num_requests: int, check_memory: bool) -> None:
    gen = start_server(llama_checkpoint, server_logs, "--scheduling-policy", "priority",
                       "--enable-prefix-caching", "--max-num-seqs", "16")  # fmt: skip
    server = next(gen)
    try:
        stats = {"status": [], "hung_up": 0}
        warm = min(1000, num_requests // 5)
        asyncio.run(_soak(server.url, warm, 32, stats))
        rss_before = _rss_kib(server.proc.pid)
        asyncio.run(_soak(server.url, num_requests - warm, 32, stats))
        assert len(stats["status"]) == num_requests
        assert not [s for s in stats["status"] if s >= 500]
        assert set(stats["status"]) <= {200}, sorted(set(stats["status"]))
        assert stats["hung_up"] > 0
        idle = server.wait_idle(60)
        assert idle["num_running"] == 0 and idle["num_waiting"] == 0
        if check_memory:
            growth = _rss_kib(server.proc.pid) / rss_before - 1
            assert growth < 0.05, f"server RSS grew {growth:.1%}"
    finally:
        gen.close()


def test_soak_short(llama_checkpoint, server_logs):
    _run(llama_checkpoint, server_logs, 300, check_memory=False)


@pytest.mark.slow
def test_soak_5000(llama_checkpoint, server_logs):
    _run(llama_checkpoint, server_logs, 5000, check_memory=True)
