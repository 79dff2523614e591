"""A request stream whose consumer fell behind takes what queued up as one delta."""

from __future__ import annotations

import asyncio

from infer.core.outputs import RequestOutput, merge_deltas
from infer.core.request import RequestTimings, TokenLogprob
from infer.engine.async_engine import RequestStream
from infer.engine.core_loop import Ack


class FakeEngine:
    def __init__(self) -> None:
        self.done: list[str] = []
        self.sent: list = []
        self.forgotten: list[str] = []
        self.dead = None

    def request_done(self, request_id: str, out: RequestOutput) -> None:
        self.done.append(request_id)

    def send(self, command) -> None:
        self.sent.append(command)

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def delta(rid: str, tokens: list[int], text: str, total: int, finished: bool = False,
          prompt_logprobs=None) -> RequestOutput:  # fmt: skip
    return RequestOutput(
        rid, tokens, text, [TokenLogprob(t, -0.5 * t, 1, ()) for t in tokens], finished,
        "length" if finished else None, None, 5, total, 0, RequestTimings(), None, prompt_logprobs,
    )  # fmt: skip


def consume(request_ids: list[str], items: list) -> tuple[list[tuple[int, RequestOutput]], list]:
    """Queue ``items`` as the engine's dispatch would, then iterate the stream to its end."""

    async def main():
        engine = FakeEngine()
        stream = RequestStream(engine, request_ids, deadline=None)
        for item in items:
            stream._put(item)
        got = [pair async for pair in stream]
        return got, engine.done

    return asyncio.run(main())


def test_merge_joins_tokens_text_logprobs_and_keeps_the_newest_totals():
    first = delta("a", [1, 2], "he", 2, prompt_logprobs=[None, TokenLogprob(3, -1.0, 1, ())])
    later = delta("a", [3], "llo", 3, finished=True)
    out = merge_deltas(first, later)
    assert out.new_token_ids == [1, 2, 3] and out.new_text == "hello"
    assert [lp.token_id for lp in out.new_logprobs] == [1, 2, 3]
    assert out.finished and out.finish_reason == "length" and out.num_output_tokens == 3
    assert out.prompt_logprobs == first.prompt_logprobs
    assert out.timings is later.timings
    assert first.new_token_ids == [1, 2]  # the inputs are not changed


def test_queued_deltas_of_one_request_arrive_as_one():
    items = [Ack("a", None), delta("a", [1], "x", 1), delta("a", [2], "y", 2),
             delta("a", [3], "z", 3, finished=True)]  # fmt: skip
    got, done = consume(["a"], items)
    assert len(got) == 1
    index, out = got[0]
    assert index == 0 and out.new_token_ids == [1, 2, 3] and out.new_text == "xyz"
    assert out.finished and out.num_output_tokens == 3
    assert done == ["a"]


def test_merging_stops_at_a_sibling_and_keeps_the_order():
    items = [Ack("a", None), Ack("b", None), delta("a", [1], "x", 1), delta("a", [2], "y", 2),
             delta("b", [7], "p", 1), delta("a", [3], "z", 3, finished=True),
             delta("b", [8], "q", 2, finished=True)]  # fmt: skip
    got, done = consume(["a", "b"], items)
    assert [(i, out.new_token_ids) for i, out in got] == [(0, [1, 2]), (1, [7]), (0, [3]), (1, [8])]
    assert "".join(out.new_text for i, out in got if i == 0) == "xyz"
    assert sorted(done) == ["a", "b"]


def test_a_finished_delta_is_never_merged_with_what_follows():
    # A request id reused after its end (the engine forgets finished ids) must not have the new
    # request's first delta glued onto the old one's last.
    items = [Ack("a", None), delta("a", [1], "x", 1, finished=True), delta("a", [9], "n", 1)]
    got, _ = consume(["a"], items)
    assert [out.new_token_ids for _, out in got] == [[1]]


def _ended(items_after_end: list, delay_s: float = 0.01):
    """A stream ended by the server (``_End``) while its child's ack was pending; what the
    engine sends after is queued ``delay_s`` later. The outputs, the finished ids, the engine."""

    async def main():
        engine = FakeEngine()
        stream = RequestStream(engine, ["a"], deadline=None)
        stream.end("server shutting down")
        loop = asyncio.get_running_loop()
        for item in items_after_end:
            loop.call_later(delay_s, stream._put, item)
        t0 = loop.time()
        await stream.accepted()
        got = [out async for _, out in stream]
        return got, engine, loop.time() - t0

    return asyncio.run(main())


def test_a_refused_request_the_server_ends_is_not_reported_and_not_waited_for():
    got, engine, seconds = _ended([Ack("a", ValueError("too long"))])
    assert got == [] and engine.done == [] and engine.forgotten == ["a"]
    assert seconds < 1  # not END_GRACE_S
    assert [type(c).__name__ for c in engine.sent] == ["AbortRequests"]


def test_an_engine_failure_while_the_server_ends_a_stream_still_ends_it_as_an_abort():
    from infer.engine.core_loop import error_output

    got, engine, _ = _ended([Ack("a", None), delta("a", [7], "x", 1),
                             error_output("a", "the engine was stopped")])  # fmt: skip
    assert [o.finish_reason for o in got] == [None, "abort"]
    assert got[-1].error == "server shutting down" and got[-1].num_output_tokens == 1
    assert engine.done == ["a"]
