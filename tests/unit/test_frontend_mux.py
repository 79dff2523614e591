"""The engine side of several API server processes (``engine.frontends.FrontendMux``): every
command in, every reply to the API server it belongs to, over real pipes."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import threading

import pytest

from infer.core.outputs import RequestOutput
from infer.core.request import RequestTimings
from infer.core.sampling_params import InvalidRequestError, SamplingParams
from infer.engine.core_client import TokenTimesMirror, pack_for_pipe
from infer.engine.core_loop import (
    AbortRequests,
    Ack,
    AddRequest,
    CallEngine,
    CallResult,
    EngineStopped,
    FinishedElsewhere,
    StatsUpdate,
    Stop,
)
from infer.engine.frontends import FrontendMux

PARAMS = SamplingParams(max_tokens=4)


@pytest.fixture
def pipes():
    """Three API servers' ends (what they send and read) and the mux over the engine's ends."""
    pairs = [mp.Pipe() for _ in range(3)]
    servers = [ours for ours, _ in pairs]
    mux = FrontendMux([theirs for _, theirs in pairs], pack_for_pipe)
    yield servers, mux
    for ours, theirs in pairs:
        ours.close()
        theirs.close()


def _read(conn, wait: float = 0.2) -> list:
    """What one API server got: the packed outputs made whole again, as its reader does."""
    got = []
    while conn.poll(wait):
        got += TokenTimesMirror().unpack(conn.recv())
    return got


def _output(rid: str, finished: bool = False, payload: object = None) -> RequestOutput:
    timings = RequestTimings(1.0, 1.1, 1.2, [1.2], 1.3 if finished else None)
    return RequestOutput(rid, [7], "x", finished=finished, finish_reason="length" if finished
                         else None, num_prompt_tokens=3, num_output_tokens=1, timings=timings,
                         kv_payload=payload)  # fmt: skip


def _stats() -> StatsUpdate:
    return StatsUpdate(stats="s", num_steps=1, num_step_failures=0)


def test_outputs_go_to_the_api_server_that_added_the_request(pipes):
    servers, mux = pipes
    servers[0].send(AddRequest("a", [1, 2, 3], PARAMS))
    servers[1].send(AddRequest("b", [1, 2, 3], PARAMS))
    commands = mux.next_commands(block=True)
    while len(commands) < 2:  # (the second pipe's command may land a moment later)
        commands += mux.next_commands(block=True)
    assert sorted(c.request_id for c in commands) == ["a", "b"]
    mux.emit([Ack("a", None), Ack("b", None), _output("a"), _output("b"), _stats()])
    got = [_read(s) for s in servers]
    assert [type(r).__name__ for r in got[0]] == ["Ack", "RequestOutput", "StatsUpdate"]
    assert got[0][1].request_id == "a" and got[1][1].request_id == "b"
    assert [type(r).__name__ for r in got[2]] == ["StatsUpdate"]  # everyone's

    # A finished request's final output: to its own API server whole, to the others as
    # FinishedElsewhere (for their metrics) without its payload.
    mux.emit([_output("a", finished=True, payload=b"kv"), _stats()])
    got = [_read(s) for s in servers]
    assert got[0][0].finished and got[0][0].kv_payload == b"kv"
    for other in (got[1], got[2]):
        seen = other[0]
        assert isinstance(seen, FinishedElsewhere)
        assert seen.output.request_id == "a" and seen.output.kv_payload is None
        assert seen.output.num_output_tokens == 1 and seen.output.timings.token_times == [1.2]
    assert "a" not in mux.owner and mux.owner == {"b": 1}


def test_call_ids_are_renumbered_and_answered_to_the_caller(pipes):
    servers, mux = pipes
    servers[1].send(CallEngine(0, "get_stats"))
    servers[2].send(CallEngine(0, "poll_trace", (5,)))
    commands = []
    while len(commands) < 2:
        commands += mux.next_commands(block=True)
    ids = {c.method: c.call_id for c in commands}
    assert len(set(ids.values())) == 2  # both counted from 0: renumbered apart
    assert commands[[c.method for c in commands].index("poll_trace")].args == (5,)
    mux.emit([CallResult(ids["poll_trace"], value="trace"), CallResult(ids["get_stats"], "st")])
    got = [_read(s) for s in servers]
    assert got[0] == [] and got[1] == [CallResult(0, "st")] and got[2] == [CallResult(0, "trace")]


def test_a_request_id_in_use_by_another_api_server_is_refused(pipes):
    servers, mux = pipes
    servers[0].send(AddRequest("same", [1], PARAMS))
    assert [c.request_id for c in mux.next_commands(block=True)] == ["same"]
    servers[1].send(AddRequest("same", [1], PARAMS))
    assert mux.next_commands(block=True) == []  # answered here: nothing reaches the engine
    mux.emit([_output("same"), _stats()])
    first, second = _read(servers[0]), _read(servers[1])
    assert first[0].request_id == "same" and isinstance(first[0], RequestOutput)
    refusal = second[0]
    assert isinstance(refusal, Ack) and isinstance(refusal.error, InvalidRequestError)
    assert "already in use" in str(refusal.error)
    assert mux.owner == {"same": 0}


def test_an_api_server_aborts_only_its_own_requests(pipes):
    servers, mux = pipes
    servers[0].send(AddRequest("a", [1], PARAMS))
    servers[1].send(AddRequest("b", [1], PARAMS))
    commands = []
    while len(commands) < 2:
        commands += mux.next_commands(block=True)
    servers[1].send(AbortRequests(("a", "b")))
    assert mux.next_commands(block=True) == [AbortRequests(("b",))]


def test_an_api_server_that_leaves_has_its_requests_aborted(pipes):
    servers, mux = pipes
    servers[1].send(AddRequest("b1", [1], PARAMS))
    servers[1].send(AddRequest("b2", [1], PARAMS))
    servers[2].send(AddRequest("c", [1], PARAMS))
    commands = []
    while len(commands) < 3:
        commands += mux.next_commands(block=True)
    # Stop from an API server other than the first: it leaves, the engine goes on.
    servers[1].send(Stop())
    assert mux.next_commands(block=True) == [AbortRequests(("b1", "b2"))]
    mux.emit([_output("b1", finished=True), _output("b2", finished=True), _stats()])
    got = _read(servers[1])
    assert [type(r).__name__ for r in got] == ["RequestOutput", "RequestOutput", "StatsUpdate",
                                               "EngineStopped"]  # fmt: skip
    assert got[-1] == EngineStopped(None)
    assert mux.live == {0, 2}
    # A pipe that closes (the process died): the same, and nothing more is sent to it.
    servers[2].close()
    assert mux.next_commands(block=True) == [AbortRequests(("c",))]
    mux.emit([_output("c", finished=True), _stats()])
    # (the first counts the aborted requests in its metrics, as any finished request)
    seen = [(type(r).__name__, getattr(r, "output", r)) for r in _read(servers[0])]
    assert [(kind, getattr(out, "request_id", None)) for kind, out in seen] == [
        ("FinishedElsewhere", "b1"), ("FinishedElsewhere", "b2"), ("StatsUpdate", None),
        ("FinishedElsewhere", "c"), ("StatsUpdate", None)]  # fmt: skip
    assert 2 not in mux.live
    # Stop from the first stops the engine.
    servers[0].send(Stop())
    assert mux.next_commands(block=True) == [Stop()]


def test_when_every_api_server_has_gone_the_engine_stops(pipes):
    servers, mux = pipes
    for s in servers:
        s.close()
    commands = []
    while not any(isinstance(c, Stop) for c in commands):
        commands += mux.next_commands(block=True)
    assert mux.live == set()


def test_a_second_end_of_one_request_is_counted_nowhere(pipes):
    """A step that fails outside the forward pass ends its requests twice (the abort it asks
    for, the error it reports): the owner gets the first, the others see it once."""
    servers, mux = pipes
    servers[1].send(AddRequest("a", [1], PARAMS))
    mux.next_commands(block=True)
    mux.emit([_output("a", finished=True), _output("a", finished=True), _stats()])
    got = [_read(s) for s in servers]
    assert [type(r).__name__ for r in got[1]] == ["RequestOutput", "StatsUpdate"]
    for other in (got[0], got[2]):
        assert [type(r).__name__ for r in other] == ["FinishedElsewhere", "StatsUpdate"]


def test_an_api_server_that_stops_reading_never_stalls_the_engine(pipes):
    """One API server stops reading its pipe (stopped, hung): the engine's sends to it queue
    up instead of blocking, the others get theirs at once, and it gets every message, in
    order, once it reads again."""
    servers, mux = pipes
    servers[0].send(AddRequest("a", [1], PARAMS))
    servers[1].send(AddRequest("b", [1], PARAMS))
    commands = mux.next_commands(block=True)
    while len(commands) < 2:
        commands += mux.next_commands(block=True)
    text = "x" * 4096  # ~4 KB a message: a few MB in all, far past what a pipe holds
    steps = 600

    def engine() -> None:
        for step in range(steps):
            out = _output("a")
            mux.emit([dataclasses.replace(out, new_text=f"{step}:{text}"), _output("b"), _stats()])

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    got_b = []
    while len(got_b) < 2 * steps:  # API server 1 reads along while API server 0 does not
        assert servers[1].poll(30), "the engine stalled behind API server 0's full pipe"
        got_b += TokenTimesMirror().unpack(servers[1].recv())
        _read(servers[2], wait=0)  # (API server 2 reads along too)
    thread.join(30)
    assert not thread.is_alive()
    _read(servers[2], wait=0)
    assert mux.outboxes[0].backlog > 0  # (it really was behind)

    closing = threading.Thread(target=mux.close, daemon=True)
    closing.start()  # writes what is queued for API server 0 as it reads
    mirror, got_a = TokenTimesMirror(), []
    while len(got_a) < 2 * steps:
        assert servers[0].poll(30)
        got_a += mirror.unpack(servers[0].recv())
    closing.join(30)
    texts = [r.new_text for r in got_a if isinstance(r, RequestOutput)]
    assert texts == [f"{step}:{text}" for step in range(steps)]
    assert mux.outboxes[0].backlog == 0
