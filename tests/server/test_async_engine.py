"""The thread bridge on a real engine, in process: routing, refusals, failure isolation, bounds,
aborts and timeouts."""

from __future__ import annotations

import asyncio
import threading

import pytest

from infer import SamplingParams
from infer.core.sampling_params import InvalidRequestError
from infer.engine.async_engine import AddRequest, AsyncEngine, QueueFullError
from infer.engine.core_loop import STEP_DELAY_ENV
from infer.engine.engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


@pytest.fixture
def engine(tiny_engine):
    return tiny_engine


def ids(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def run(engine: LLMEngine, body, **options):
    """Run ``body(async_engine)`` on a fresh bridge; check the engine is idle afterwards."""

    async def main():
        bridge = AsyncEngine(engine, **options)
        bridge.start()
        try:
            return await body(bridge)
        finally:
            await bridge.drain(10)
            await bridge.shutdown()

    result = asyncio.run(main())
    stats = engine.get_stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_total_blocks
    return result


async def collect(stream) -> tuple[str, str | None]:
    text, reason = "", None
    async for _, out in stream:
        text += out.new_text
        reason = out.finish_reason if out.finished else reason
    return text, reason


def test_concurrent_requests_get_their_own_outputs(engine, offline_llm):
    prompts = ["The quick brown fox", "def main():", "for i in range(10):"]
    want = [r.outputs[0].text for r in offline_llm.generate(prompts, GREEDY)]

    async def body(bridge):
        streams = []
        for i, p in enumerate(prompts):
            stream = bridge.add_group([AddRequest(f"r{i}", ids(engine, p), GREEDY)])
            streams.append(stream)
        for s in streams:
            await s.accepted()
        return await asyncio.gather(*[collect(s) for s in streams])

    got = run(engine, body)
    assert [t for t, _ in got] == want


def test_a_refused_request_fails_alone(engine):
    async def body(bridge):
        good = bridge.add_group([AddRequest("good", ids(engine, "hello"), GREEDY)])
        bad = bridge.add_group([AddRequest("bad", [5] * 5000, GREEDY)])
        with pytest.raises(InvalidRequestError) as err:
            await bad.accepted()
        await good.accepted()
        return err.value, await collect(good)

    error, (text, reason) = run(engine, body)
    assert error.param == "prompt" and "5000" in error.message
    assert text and reason == "length"


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_goes_on(engine, monkeypatch):
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)

    async def body(bridge):
        first = bridge.add_group([AddRequest("victim", ids(engine, "hello"), LONG)])
        await first.accepted()
        victim = [out async for _, out in first]
        after = bridge.add_group([AddRequest("after", ids(engine, "world"), GREEDY)])
        await after.accepted()
        return victim[-1], await collect(after), bridge.num_step_failures

    final, (text, reason), failures = run(engine, body)
    assert final.finish_reason == "error" and "boom" in final.error
    assert text and reason == "length"
    assert failures == 1


def test_queue_bound_refuses_at_once(engine):
    async def body(bridge):
        first = bridge.add_group([AddRequest("q1", ids(engine, "a b c"), GREEDY)])
        with pytest.raises(QueueFullError):
            bridge.add_group([AddRequest("q2", ids(engine, "d e f"), GREEDY)])
        with pytest.raises(InvalidRequestError):  # more than the bound: never admissible
            bridge.add_group([AddRequest(f"n{i}", ids(engine, "g"), GREEDY) for i in range(2)])
        await first.accepted()
        return await collect(first)

    text, reason = run(engine, body, max_queued_requests=1)
    assert reason == "length"


def test_abort_frees_the_slot_and_reports_abort(engine):
    finished = []

    async def body(bridge):
        stream = bridge.add_group([AddRequest("long", ids(engine, "Once"), LONG)])
        await stream.accepted()
        seen = 0
        async for _, out in stream:
            seen += len(out.new_token_ids)
            if seen >= 3:
                stream.abort("test")
                break
        while bridge.stats.num_running:  # the engine thread publishes stats after each step
            await asyncio.sleep(0.01)
        return bridge.stats

    stats = run(engine, body, on_finished=finished.append)
    assert stats.num_free_blocks == stats.num_total_blocks  # freed before shutdown
    assert [o.finish_reason for o in finished] == ["abort"]


def test_timeout_ends_the_request_with_abort(engine, monkeypatch):
    monkeypatch.setenv(STEP_DELAY_ENV, "0.01")  # 900 steps take >= 9 s: far past the timeout

    async def body(bridge):
        stream = bridge.add_group([AddRequest("slow", ids(engine, "Once"), LONG)])
        await stream.accepted()
        return [out async for _, out in stream]

    outs = run(engine, body, request_timeout=0.2)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert outs[-1].num_output_tokens < 900


@pytest.mark.parametrize("how", ["end", "drain"])
def test_a_stream_the_server_ends_gets_the_tokens_the_stream_interval_held_back(
    engine, monkeypatch, how
):
    """A deadline or a drain ends a request through its stream (``_End``): the final output is
    the engine's abort, with every token made since the last one sent."""
    monkeypatch.setenv(STEP_DELAY_ENV, "0.01")
    monkeypatch.setattr(engine, "_stream_interval", 10_000)
    finished = []

    async def body(bridge):
        stream = bridge.add_group([AddRequest("slow", ids(engine, "Once"), LONG)])
        await stream.accepted()
        start = bridge.stats.generation_tokens_total
        while bridge.stats.generation_tokens_total < start + 4:  # its first token, 3 held
            await asyncio.sleep(0.01)
        if how == "end":
            stream.end("ended by the test")
            return [out async for _, out in stream]
        outs = []

        async def consume():
            outs.extend([out async for _, out in stream])

        task = asyncio.ensure_future(consume())
        await bridge.drain(0.0)  # the drain's abort, then the engine stops (run's shutdown)
        await bridge.shutdown()
        await task
        return outs

    outs = run(engine, body, on_finished=finished.append)
    final = outs[-1]
    why = "ended by the test" if how == "end" else "server shutting down"
    assert final.finished and final.finish_reason == "abort" and final.error == why
    assert len(outs) == 2  # the first token alone, then the rest with the end
    assert sum(len(o.new_token_ids) for o in outs) == final.num_output_tokens >= 4
    assert [o.num_output_tokens for o in finished] == [final.num_output_tokens]


def test_calls_run_on_the_engine_thread(engine, monkeypatch):
    monkeypatch.setattr(
        engine, "where", lambda x: (threading.current_thread().name, x), raising=False
    )

    async def body(bridge):
        return await bridge.call("where", 7)

    assert run(engine, body) == ("infer-engine", 7)


def test_a_failing_call_raises_its_error(engine):
    async def body(bridge):
        with pytest.raises(AttributeError):
            await bridge.call("no_such_method")
        return await bridge.call("reset_prefix_cache")

    assert run(engine, body) in (True, False)


def test_exported_kv_is_kept_for_its_stream_only(engine):
    from infer.core.outputs import RequestOutput

    prompt = ids(engine, "The quick brown fox jumps over the lazy dog")
    one = SamplingParams(temperature=0.0, max_tokens=1)

    async def body(bridge):
        stream = bridge.add_group([AddRequest("p", prompt, one, export_kv=True)])
        await stream.accepted()
        finals = [out async for _, out in stream if out.finished]
        payload = bridge.take_exported_kv("p")
        # A payload whose stream is gone (its client left while the last step ran) is not kept.
        late = RequestOutput("gone", [], "", finished=True, finish_reason="length",
                             kv_payload=payload)  # fmt: skip
        bridge._dispatch([late])
        return finals, payload, dict(bridge.exported_kv)

    finals, payload, left = run(engine, body)
    assert finals[0].kv_payload is None  # taken off the output the stream sees
    assert payload is not None and payload.token_ids == tuple(prompt[:-1])
    assert left == {}


def test_a_stream_cancelled_before_its_first_byte_aborts_its_request(engine, monkeypatch):
    """A replica's app, called in process by the router (``call_asgi``): the router gives up on
    a stream while the app still waits for the engine to take the request (the engine is in a
    slowed step). The response's generator never started, so its ``finally`` never ran: the
    request ran to max_tokens, counted in flight for ever. The response aborts it itself."""
    import json

    from infer.cluster.asgi import ForwardedRequest, call_asgi
    from infer.server.app import build_app
    from infer.server.serving import ServerSettings

    monkeypatch.setenv(STEP_DELAY_ENV, "1.0")

    def forwarded(body: dict) -> ForwardedRequest:
        return ForwardedRequest("POST", "/v1/completions", b"",
                                ((b"content-type", b"application/json"),),
                                json.dumps(body).encode())  # fmt: skip

    async def drain(gen) -> None:
        async for _ in gen:
            pass

    async def main() -> None:
        app = build_app(engine, ServerSettings(served_model_names=("tiny",)))
        bridge = app.state.async_engine
        async with app.router.lifespan_context(app):
            busy = asyncio.create_task(drain(call_asgi(app, forwarded(
                {"prompt": "hello", "max_tokens": 2, "ignore_eos": True}))))  # fmt: skip
            while bridge.stats.num_running == 0:  # the engine is inside a 1 s step now
                await asyncio.sleep(0.01)
            victim = asyncio.create_task(drain(call_asgi(app, forwarded(
                {"prompt": "victim", "max_tokens": 200, "ignore_eos": True, "stream": True}))))  # fmt: skip
            await asyncio.sleep(0.1)  # waiting for the engine's ack
            victim.cancel()
            await asyncio.gather(victim, return_exceptions=True)
            await busy
            for _ in range(300):  # the abort is taken at the next step
                if bridge.num_in_flight == 0 and bridge.stats.num_running == 0:
                    break
                await asyncio.sleep(0.05)
            assert bridge.num_in_flight == 0 and bridge.stats.num_running == 0

    asyncio.run(main())
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
