"""A forward pass that fails fails its request only: 500 with an error body (or an error event in
a stream), and the next request is served. In process (the app over ASGI), so the failure can be
injected into the real engine's model runner."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from infer.engine.engine import LLMEngine
from infer.server.app import build_app
from infer.server.serving import ServerSettings

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "temperature": 0}


@pytest.fixture
def engine(tiny_engine):
    return tiny_engine


def fail_next_forward(engine: LLMEngine, monkeypatch) -> None:
    real = engine.runner.launch  # a step's forward pass is queued by launch, waited by collect
    state = {"armed": True}

    def launch(*args, **kwargs):
        if state["armed"]:
            state["armed"] = False
            raise RuntimeError("injected forward failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", launch)


def serve(engine: LLMEngine, body):
    app = build_app(engine, ServerSettings(served_model_names=("tiny",)))

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await body(client)

    return asyncio.run(main())


def test_failed_request_gets_500_and_the_next_is_served(engine, monkeypatch):
    fail_next_forward(engine, monkeypatch)

    async def body(client):
        return (await client.post("/v1/completions", json=BODY),
                await client.post("/v1/completions", json=BODY))  # fmt: skip

    failed, ok = serve(engine, body)
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert "injected forward failure" in error["message"] and error["type"] == "server_error"
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


def test_failed_stream_gets_an_error_event_then_done(engine, monkeypatch):
    fail_next_forward(engine, monkeypatch)

    async def body(client):
        r = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True})  # fmt: skip
        metrics = (await client.get("/metrics")).text
        return r, metrics

    r, metrics = serve(engine, body)
    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert "injected forward failure" in json.loads(events[-2])["error"]["message"]
    assert 'vllm:request_success_total{finished_reason="error",model_name="tiny"} 1.0' in metrics


def test_an_unexpected_failure_is_a_500_that_goes_no_further(engine, monkeypatch):
    """A route's failure no handler expected: a 500 in the error shape, and nothing raised past
    the app (had it been, as Starlette's last-resort handler does after answering, uvicorn
    would close the connection and a keep-alive client's next request would be reset)."""
    from infer.server.serving import Serving

    def encode(self, text, add_special_tokens=False):
        raise ZeroDivisionError("injected tokenizer failure")

    monkeypatch.setattr(Serving, "encode", encode)

    async def body(client):
        return (await client.post("/v1/completions", json=BODY),
                await client.post("/v1/completions", json={**BODY, "prompt": [5, 6, 7]}))  # fmt: skip

    failed, ok = serve(engine, body)  # (ASGITransport raises whatever the app raises)
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error"
    assert (
        error["message"] == "internal server error: ZeroDivisionError: injected tokenizer failure"
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
