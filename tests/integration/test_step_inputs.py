"""A CPU engine's decode steps read their inputs from the runner's fixed buffers, and give the
tokens and logprobs of steps that build new tensors each time."""

from __future__ import annotations

import pytest

from infer import SamplingParams

from .conftest import PROMPTS

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture
def engine_device() -> str:
    """The fixed host buffers are the CPU's (CUDA's are the Triton step's)."""
    return "cpu"


def _generate(llm):
    outs = llm.generate(PROMPTS, PARAMS)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_steps_use_fixed_buffers_and_change_no_token(make_llm, dtype):
    llm = make_llm("llama", dtype=dtype)
    runner = llm.engine.runner
    inputs = runner.step_inputs
    assert inputs is not None
    addresses: set[tuple[int, int, int]] = set()
    decode_steps = 0
    forward = runner.forward

    def watching(ids, pos, ctx):
        nonlocal decode_steps
        if ctx.all_decode:
            decode_steps += 1
            tables, lens = ctx.decode_tables()
            addresses.add((ids.data_ptr(), ctx.slot_mapping.data_ptr(), tables.data_ptr()))
        return forward(ids, pos, ctx)

    runner.forward = watching
    fixed = _generate(llm)
    assert decode_steps >= PARAMS.max_tokens - 1
    buffers = (inputs.input_ids.data_ptr(), inputs.slots.data_ptr(), inputs.tables.data_ptr())
    assert addresses == {buffers}  # every decode step, the same memory

    other = make_llm("llama", dtype=dtype)
    other.engine.runner.step_inputs = None  # new tensors every step, as before the buffers
    assert _generate(other) == fixed
