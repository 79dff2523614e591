"""A tensor-parallel worker that dies takes the engine down with a message naming it, offline
and behind the server; nothing waits on the dead rank."""

from __future__ import annotations

import os
import signal

import pytest

from infer.core.sampling_params import SamplingParams
from infer.distributed import EngineDeadError
from infer.llm import LLM

pytestmark = pytest.mark.distributed


def test_a_dead_worker_stops_the_engine_with_its_rank(tiny_checkpoints):
    with LLM(str(tiny_checkpoints["llama"]), tensor_parallel_size=2, dtype="float32") as llm:
        params = SamplingParams(max_tokens=4, temperature=0)
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
        worker = llm.engine.tp_workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"worker rank 1 exited \(code -9\)"):
            llm.generate([[5, 6, 7]], params)


def test_a_failed_start_stops_the_workers(tiny_checkpoints):
    # The KV plan fails after the worker has started: it must not be left behind, and the next
    # tensor-parallel engine in this process starts.
    with pytest.raises(ValueError, match="smaller than one block"):
        LLM(str(tiny_checkpoints["llama"]), tensor_parallel_size=2, kv_cache_memory=16)
    with LLM(str(tiny_checkpoints["llama"]), tensor_parallel_size=2) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 2
