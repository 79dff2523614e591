"""What crosses the pipe from the engine process to the server each step, and what the server
makes of it."""

from __future__ import annotations

import pickle

from infer.core.outputs import RequestOutput
from infer.core.request import RequestTimings
from infer.engine.core_client import TokenTimesMirror, thin_for_pipe
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
    thinned = thin_for_pipe([running, done, other])
    assert thinned[2] is other
    assert thinned[0].timings.token_times == [1998.0, 1999.0]
    assert thinned[0].timings.first_token == 0.0 and thinned[0].num_output_tokens == 2000
    assert thinned[1] is done and len(done.timings.token_times) == 2000
    # The engine's own object is not touched (in-process consumers share it).
    assert len(running.timings.token_times) == 2000
    # Per step, a long stream costs a fixed few hundred bytes, not its whole history.
    assert len(pickle.dumps(thinned[0])) < len(pickle.dumps(running)) // 20
    # A short one goes as it is (cheaper than copying it).
    short = _output("c", [0.0] * 10, 1, False)
    assert thin_for_pipe([short])[0] is short


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
        sent = thin_for_pipe([_output("a", engine_times, new, finished=False)])
        received = pickle.loads(pickle.dumps(sent))
        mirror.restore(received)
        assert received[0].timings.token_times == engine_times, step
    final = pickle.loads(pickle.dumps(thin_for_pipe([_output("a", engine_times, 1, True)])))
    mirror.restore(final)
    assert final[0].timings.token_times == engine_times
    assert mirror._times == {}  # nothing kept for a finished request
