"""Overload and cancellation: a full queue answers 429 at once while accepted requests complete;
a client that goes away (stream dropped, non-streaming timeout, still queued) aborts its request
and every KV block comes back."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from tests.server.conftest import start_server

LONG = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True,
        "temperature": 0}  # fmt: skip


@pytest.fixture(scope="module")
def server(llama_checkpoint, server_logs):
    yield from start_server(llama_checkpoint, server_logs, "--max-num-seqs", "2",
                            "--max-queued-requests", "2")  # fmt: skip


def finished_count(server, reason: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf'^vllm:request_success_total{{[^}}]*finished_reason="{reason}"[^}}]*}} (\S+)$',
                  text, re.M)  # fmt: skip
    assert m, text
    return float(m.group(1))


def test_overload_answers_429_at_once_while_accepted_requests_complete(server):
    async def run() -> list[tuple[int, dict]]:
        order: list[tuple[int, dict]] = []
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:

            async def one() -> None:
                r = await c.post("/v1/completions", json=LONG)
                body = r.json()
                if r.status_code == 429:
                    body["retry_after"] = r.headers.get("retry-after")
                order.append((r.status_code, body))

            await asyncio.gather(*[one() for _ in range(8)])
        return order

    order = asyncio.run(run())
    statuses = [s for s, _ in order]
    accepted = [body for s, body in order if s == 200]
    rejected = [body for s, body in order if s == 429]
    assert len(accepted) + len(rejected) == 8, statuses
    assert 2 <= len(accepted) <= 4  # 2 running + up to 2 waiting
    # Every refusal came back before the first accepted request finished: answered at once.
    assert statuses == [429] * len(rejected) + [200] * len(accepted)
    for body in rejected:
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
        assert body["retry_after"] == "1"
    for body in accepted:
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 600
    server.wait_idle()


def test_dropped_stream_is_aborted_and_frees_its_blocks(server):
    aborted = finished_count(server, "abort")
    with httpx.stream("POST", server.base_url + "/completions", json={**LONG, "stream": True},
                      timeout=60) as r:  # fmt: skip
        lines = r.iter_lines()  # held, so the connection stays open until the block ends
        events = 0
        while events < 3:
            events += next(lines).startswith("data: ")
        stats = server.debug()
        assert stats["num_running"] == 1 and stats["num_free_blocks"] < stats["num_total_blocks"]
    # Leaving the block closed the connection mid-stream.
    stats = server.wait_idle()
    assert stats["kv_usage"] == 0.0
    assert finished_count(server, "abort") == aborted + 1


def test_non_streaming_client_that_gives_up_aborts(server):
    """A client that stops waiting for a non-streamed answer (a timeout of its own) closes the
    connection: its request is aborted. It gives up once the request runs, so the request
    provably reached the engine (a fixed client timeout could fire before that on a loaded
    machine, and then there would be nothing to abort)."""
    aborted = finished_count(server, "abort")

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            task = asyncio.create_task(c.post("/completions", json={**LONG, "max_tokens": 1000}))
            await asyncio.to_thread(server.wait_running, 1)
            assert not task.done()
            task.cancel()  # closes its connection
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    server.wait_idle()
    assert finished_count(server, "abort") == aborted + 1


def test_request_dropped_while_queued_leaves_nothing_behind(server):
    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            busy = [asyncio.create_task(c.post("/v1/completions", json=LONG)) for _ in range(2)]
            while server.debug()["num_running"] < 2:
                await asyncio.sleep(0.02)
            queued = asyncio.create_task(c.post("/v1/completions", json=LONG))
            while server.debug()["num_waiting"] < 1:
                await asyncio.sleep(0.02)
            queued.cancel()  # closes its connection while the request waits for a slot
            results = await asyncio.gather(*busy)
            assert all(r.status_code == 200 for r in results)

    asyncio.run(run())
    server.wait_idle()
    assert "Traceback" not in server.log()


def test_more_choices_than_the_queue_holds_is_400_not_429(server):
    r = httpx.post(server.base_url + "/completions", json={**LONG, "max_tokens": 4, "n": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(server.base_url + "/embeddings", json={"input": ["a", "b", "c"]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input" and "3 inputs embedded" in error["message"]
