"""The replica's in-process forwarding (call_asgi) and the /metrics merge, without ray."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from infer.cluster.asgi import ForwardedRequest, ResponseStart, call_asgi
from infer.cluster.metrics import merge_metrics


def _app(events: list[str]) -> Starlette:
    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"got": body, "q": request.query_params.get("q")}, status_code=201,
                            headers={"Retry-After": "1"})  # fmt: skip

    async def stream(request: Request) -> StreamingResponse:
        async def gen():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                events.append("stream closed")

        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/stream", stream)])


def test_call_asgi_passes_status_headers_and_body():
    async def main() -> list:
        req = ForwardedRequest("POST", "/echo", b"q=1",
                               ((b"content-type", b"application/json"),), b'{"a": 1}')  # fmt: skip
        return [piece async for piece in call_asgi(_app([]), req)]

    pieces = asyncio.run(main())
    start = pieces[0]
    assert isinstance(start, ResponseStart)
    assert start.status == 201 and start.header("retry-after") == "1"
    assert b"".join(pieces[1:]) == b'{"got":{"a":1},"q":"1"}'


def test_closing_a_stream_early_is_a_disconnect():
    events: list[str] = []

    async def main() -> list:
        chunks = []
        gen = call_asgi(_app(events), ForwardedRequest("GET", "/stream"))
        async for piece in gen:
            chunks.append(piece)
            if len(chunks) == 3:
                break
        await gen.aclose()  # what a cancelled router call does to the replica's generator
        return chunks

    chunks = asyncio.run(main())
    assert chunks[1:] == [b"data: 0\n\n", b"data: 1\n\n"]
    assert events == ["stream closed"]  # the app saw the disconnect and closed its stream


def test_merge_sums_samples_and_averages_fractions():
    one = (
        "# HELP vllm:prefix_cache_hits Hits.\n# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="m"} 10.0\n'
        "# HELP vllm:kv_cache_usage_perc Usage.\n# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
        "# HELP t TTFT.\n# TYPE t histogram\n"
        't_bucket{le="0.1",model_name="m"} 1.0\nt_bucket{le="+Inf",model_name="m"} 2.0\n'
        't_count{model_name="m"} 2.0\nt_sum{model_name="m"} 0.3\n'
        "# HELP vllm:lora_requests_info Adapters.\n# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters=""} 1.7e9\n'
    )
    two = one.replace("} 10.0", "} 5.0").replace("} 0.5", "} 0.1").replace('"m"} 2.0', '"m"} 4.0')
    two = two.replace("} 1.7e9", "} 1.8e9")  # (a gauge whose value is a time: the latest)
    merged = {f.name: f for f in text_string_to_metric_families(merge_metrics([one, two]))}
    values = {(s.name, s.labels.get("le")): s.value for f in merged.values() for s in f.samples}
    assert values[("vllm:prefix_cache_hits_total", None)] == 15.0
    assert abs(values[("vllm:kv_cache_usage_perc", None)] - 0.3) < 1e-9
    assert values[("t_bucket", "+Inf")] == 6.0 and values[("t_count", None)] == 6.0
    assert values[("t_bucket", "0.1")] == 2.0
    assert values[("vllm:lora_requests_info", None)] == 1.8e9
    assert merged["vllm:prefix_cache_hits"].type == "counter"
    assert merge_metrics([]) == ""


def test_reset_prefix_cache_through_the_router_is_true_only_when_every_replica_reset():
    """One replica refusing (requests running) makes the answer false, and the router keeps its
    memory of where prefixes are (it forgot it before asking); a failure passes through."""
    import json

    import pytest

    pytest.importorskip("ray")
    from infer.cluster.router import reset_answer

    def answer(status: int, body: dict) -> tuple[ResponseStart, bytes]:
        return ResponseStart(status, ((b"content-type", b"application/json"),)), json.dumps(
            body).encode()  # fmt: skip

    response, forget = reset_answer([answer(200, {"reset": True}), answer(200, {"reset": True})])
    assert json.loads(response.body) == {"reset": True} and forget
    response, forget = reset_answer([answer(200, {"reset": True}), answer(200, {"reset": False})])
    assert json.loads(response.body) == {"reset": False} and not forget
    off = {"error": {"message": "prefix caching is off"}}
    response, forget = reset_answer([answer(200, {"reset": True}), answer(409, off)])
    assert response.status_code == 409 and json.loads(response.body) == off and not forget
