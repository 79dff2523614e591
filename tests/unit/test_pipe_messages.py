"""What crosses the pipe from the engine process to the server each step."""

from __future__ import annotations

import pickle

from infer.core.outputs import RequestOutput
from infer.core.request import RequestTimings
from infer.engine.core_client import thin_for_pipe
from infer.engine.core_loop import StatsUpdate


def _output(rid: str, n: int, finished: bool) -> RequestOutput:
    times = [float(i) for i in range(n)]
    timings = RequestTimings(arrival=0.0, first_scheduled=0.0, first_token=0.0, token_times=times)
    return RequestOutput(rid, [1], "x", finished=finished, num_output_tokens=n, timings=timings)


def test_unfinished_outputs_drop_token_times_and_the_final_one_keeps_them():
    running, done = _output("a", 2000, False), _output("b", 2000, True)
    other = StatsUpdate.__new__(StatsUpdate)  # anything that is not an output passes untouched
    thinned = thin_for_pipe([running, done, other])
    assert thinned[2] is other
    assert thinned[0].timings.token_times == [] and thinned[0].timings.first_token == 0.0
    assert thinned[0].num_output_tokens == 2000 and thinned[0].new_token_ids == [1]
    assert thinned[1] is done and len(done.timings.token_times) == 2000
    # The engine's own object is not touched (in-process consumers share it).
    assert len(running.timings.token_times) == 2000
    # Per step, a long stream costs a fixed few hundred bytes, not its whole history.
    assert len(pickle.dumps(thinned[0])) < len(pickle.dumps(running)) // 20
    # A short one goes as it is (cheaper than copying it).
    short = _output("c", 10, False)
    assert thin_for_pipe([short])[0] is short
