"""--quantization int4 under tensor parallelism (its own module: the main TP module keeps a
two-rank engine open in a module-scoped fixture, and one process runs one TP engine at a time)."""

from __future__ import annotations

import pytest

from infer.core.sampling_params import SamplingParams
from infer.llm import LLM

from .test_tensor_parallel import OPTIONS, PROMPTS

pytestmark = pytest.mark.distributed


def test_int4_weights_split_on_group_boundaries(tiny_checkpoints):
    """--quantization int4 under two ranks: each rank quantizes its shard, and the shards cut
    on group boundaries (row-parallel inputs 64 / 2 = 32, one group), so both ranks together
    hold one rank's 4-bit weights: the same logits, the same greedy tokens."""
    from infer.runner.int4 import Int4Linear

    path = str(tiny_checkpoints["llama"])
    options = dict(OPTIONS, quantization="int4")
    single = LLM(path, **options)
    with LLM(path, tensor_parallel_size=2, **options) as double:
        layers = [m for m in double.engine.runner.model.modules() if isinstance(m, Int4Linear)]
        assert len(layers) == 4 * single.engine.spec.num_layers
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
        expected, got = single.generate(PROMPTS, params), double.generate(PROMPTS, params)
        for e, g in zip(expected, got, strict=True):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert abs(lg.logprob - le.logprob) < 1e-4
