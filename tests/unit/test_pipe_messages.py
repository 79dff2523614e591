"""What crosses the pipe from the engine process to the server each step, and what the server
makes of it."""

from __future__ import annotations

import pickle

from infer.core.outputs import RequestOutput
from infer.core.request import RequestTimings
from infer.engine.core_client import TokenTimesMirror, pack_for_pipe
from infer.engine.core_loop import StatsUpdate


def _output(rid: str, times: list[float], new: int, finished: bool) -> RequestOutput:
    timings = RequestTimings(arrival=0.0, first_scheduled=0.0, first_token=0.0, token_times=times)
    return RequestOutput(
        rid, [1] * new, "x", finished=finished, num_output_tokens=len(times), timings=timings
    )


def test_long_unfinished_outputs_carry_only_this_steps_timestamps():
    history = [float(i) for i in range(2000)]
    running, done = _output("a", history, 2, False), _output("b", history, 1, True)
    other = StatsUpdate.__new__(StatsUpdate)  # anything that is not an output passes untouched
    packed = pack_for_pipe([running, done, other])
    assert packed[2] is other
    received = TokenTimesMirror().unpack(pickle.loads(pickle.dumps(packed[:2])))
    # The engine's own objects are not touched (in-process consumers share them).
    assert len(running.timings.token_times) == 2000 and len(done.timings.token_times) == 2000
    # Per step, a long stream costs a fixed few hundred bytes, not its whole history.
    assert len(pickle.dumps(packed[0])) < len(pickle.dumps(running)) // 20
    # A finished one goes whole; both come back as the outputs they were.
    assert received[1] == done
    assert received[0].timings.token_times == [1998.0, 1999.0]  # a mirror that saw no earlier
    assert received[0].timings.first_token == 0.0 and received[0].num_output_tokens == 2000


def test_every_field_crosses_the_pipe():
    """Every field of an output (and of its timings) set to something not its default comes
    back equal: a field added to RequestOutput without adding it to the packing fails here."""
    import dataclasses

    from infer.core.request import TokenLogprob

    lp = TokenLogprob(5, -0.25, 1, ((5, -0.25),))
    timings = RequestTimings(arrival=1.0, first_scheduled=2.0, first_token=3.0, token_times=[3.0],
                             finished=4.0)  # fmt: skip
    values = {"request_id": "r", "new_token_ids": [5], "new_text": "t", "new_logprobs": [lp],
              "finished": True, "finish_reason": "stop", "stop_reason": 7,
              "num_prompt_tokens": 3, "num_output_tokens": 1, "num_cached_tokens": 2,
              "timings": timings, "error": "e", "prompt_logprobs": [None, lp],
              "kv_payload": {"kv": 1}, "embedding": [0.5, -1.0]}  # fmt: skip
    assert set(values) == {f.name for f in dataclasses.fields(RequestOutput)}
    out = RequestOutput(**values)
    assert TokenTimesMirror().unpack(pickle.loads(pickle.dumps(pack_for_pipe([out])))) == [out]
    assert pickle.loads(pickle.dumps(out)) == out  # RequestOutput.__reduce__, for other pickling
    assert set(vars(timings)) == {f.name for f in dataclasses.fields(RequestTimings)}


def test_the_server_side_puts_every_list_back_together():
    """Step by step through pickling, as over the pipe: every output the server sees carries
    the request's whole token_times."""
    mirror = TokenTimesMirror()
    engine_times: list[float] = []
    for step in range(150):
        new = 2 if step % 3 else 1
        engine_times.extend(float(step) + i / 10 for i in range(new))
        if step == 100:  # this step's two tokens cut back to one before it is sent
            del engine_times[-2:]
            engine_times.append(100.5)
            new = 1
        sent = pack_for_pipe([_output("a", engine_times, new, finished=False)])
        received = mirror.unpack(pickle.loads(pickle.dumps(sent)))
        assert received[0].timings.token_times == engine_times, step
    final = pickle.loads(pickle.dumps(pack_for_pipe([_output("a", engine_times, 1, True)])))
    final = mirror.unpack(final)
    assert final[0].timings.token_times == engine_times
    assert mirror._times == {}  # nothing kept for a finished request


def test_an_output_sent_after_the_next_step_carries_its_own_tokens_timestamps():
    """On the GPU step a step's outputs are made while the next step runs and sent after it:
    the request's live list has the next step's time too, which is not this output's."""
    mirror = TokenTimesMirror()
    live = [0.0, 1.0, 2.0]
    first = _output("a", live, 3, False)  # a first output goes whole
    mirror.unpack(pickle.loads(pickle.dumps(pack_for_pipe([first]))))
    live += [3.0, 4.0, 5.0]  # tokens 4 and 5 (held back), then the next step's token 6
    held = RequestOutput("a", [1, 1], "x", finished=False, num_output_tokens=5,
                         timings=first.timings)  # fmt: skip
    (got,) = mirror.unpack(pickle.loads(pickle.dumps(pack_for_pipe([held]))))
    assert got.timings.token_times == [0.0, 1.0, 2.0, 3.0, 4.0]
