"""Tensor parallelism never hangs: a rank that fails while starting, or stalls, or skips a step
ends in a clear error within a bound the test sets; no process is left behind; engines built,
closed (or just dropped) and built again in one process give one rank's tokens; a program read
from standard input can start one."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import time

import pytest

from infer.core.sampling_params import SamplingParams
from infer.distributed import EngineDeadError
from infer.distributed.executor import FAULT_ENV, STARTUP_TIMEOUT_ENV, STEP_TIMEOUT_ENV
from infer.llm import LLM

pytestmark = pytest.mark.distributed

GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPTS = [[5, 6, 7, 8], list(range(100, 120))]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _no_workers_left() -> bool:
    return not [p for p in multiprocessing.active_children() if p.name.startswith("infer-tp-")]


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("1:start", r"(?s)rank 1 exited \(code 1\) before it could join .*exit before joining"),
        ("1:load", r"(?s)rank 1 exited \(code 1\) before it could load .*exit after loading"),
        # (rank 1 hangs once loaded; on a loaded machine it may not even have joined by then)
        (
            "1:hang",
            r"rank\(s\) 1 did not (load its slice of the model|join the process group) "
            r"within 8s",
        ),
    ],
)
def test_a_rank_that_fails_to_start_ends_start_up_with_its_error(
    fault, message, tiny_checkpoints, monkeypatch
):
    """Each fault comes from a test hook the worker reads; the error names the rank, its exit
    code and quotes its last output; the wait is bounded by the start-up deadline. (A rank
    that exits is seen at once: those cases get a deadline no slow start-up can reach, a
    rank's own start being ~4 s of imports here.)"""
    monkeypatch.setenv(FAULT_ENV, fault)
    monkeypatch.setenv(STARTUP_TIMEOUT_ENV, "8" if fault.endswith("hang") else "45")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=message):
        LLM(str(tiny_checkpoints["llama"]), tensor_parallel_size=2, dtype="float32")
    assert time.monotonic() - t0 < 60
    assert _no_workers_left()


def test_a_step_the_ranks_disagree_on_raises_within_the_step_timeout(tiny_checkpoints, monkeypatch):
    """Rank 1 skips its first step's forward pass (a test hook): the driver's first collective
    waits for a peer that never comes, and times out into EngineDeadError, not a hang."""
    monkeypatch.setenv(FAULT_ENV, "1:skip-step")
    monkeypatch.setenv(STEP_TIMEOUT_ENV, "5")
    with LLM(str(tiny_checkpoints["llama"]), tensor_parallel_size=2, dtype="float32") as llm:
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="out of step"):
            llm.generate([[5, 6, 7]], GREEDY)
        assert time.monotonic() - t0 < 60
    assert _no_workers_left()


def test_build_close_build_again_and_drop_without_closing(tiny_checkpoints):
    """Two tensor-parallel engines one after the other (other architectures), the first closed,
    the second only dropped, then a third: each gives the one-rank tokens."""
    want = {}
    for kind in ("llama", "qwen3"):
        with LLM(str(tiny_checkpoints[kind]), dtype="float32") as single:
            want[kind] = _tokens(single)
    first = LLM(str(tiny_checkpoints["llama"]), tensor_parallel_size=2, dtype="float32")
    assert _tokens(first) == want["llama"]
    first.shutdown()
    second = LLM(str(tiny_checkpoints["qwen3"]), tensor_parallel_size=2, dtype="float32")
    assert _tokens(second) == want["qwen3"]
    del second  # no close: dropping the last reference stops its ranks
    with LLM(str(tiny_checkpoints["llama"]), tensor_parallel_size=2, dtype="float32") as third:
        assert _tokens(third) == want["llama"]
    assert _no_workers_left()


def test_a_second_live_engine_is_refused_with_how_to_close_the_first(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])
    refused = pytest.raises(RuntimeError, match=r"close it first \(llm.close\(\)")
    with LLM(path, tensor_parallel_size=2, dtype="float32"), refused:
        LLM(path, tensor_parallel_size=2, dtype="float32")


def test_a_program_read_from_stdin_starts_tensor_parallelism(tiny_checkpoints):
    """``python -`` cannot be re-imported by a spawned child (its file is ``<stdin>``): the
    ranks start anyway, and the program gets the one-rank tokens."""
    path = str(tiny_checkpoints["llama"])
    with LLM(path, dtype="float32") as single:
        want = _tokens(single)
    program = (
        "from infer import LLM, SamplingParams\n"
        f"with LLM({path!r}, tensor_parallel_size=2, dtype='float32') as llm:\n"
        f"    outs = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=6, temperature=0))\n"
        "    print([o.outputs[0].token_ids for o in outs])\n"
    )
    done = subprocess.run(
        [sys.executable, "-"], input=program, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str(want)
