"""--quantization int4 / int8 under tensor parallelism (its own module: the main TP module keeps a
two-rank engine open in a module-scoped fixture, and one process runs one TP engine at a time)."""

from __future__ import annotations

import pytest

from infer.core.sampling_params import SamplingParams
from infer.llm import LLM

from .test_tensor_parallel import OPTIONS, PROMPTS

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_weights_under_two_ranks_are_one_ranks(method, tiny_checkpoints):
    """--quantization int4 / int8 under two ranks give one rank's weights: int4's shards cut on
    group boundaries (row-parallel inputs 64 / 2 = 32, one group); int8's per-channel scales
    of a row-parallel shard are the whole row's (each rank took its half-row's: the tokens
    depended on the rank count). The same logits, the same greedy tokens."""
    from infer.runner.int4 import Int4Linear
    from infer.runner.quant import Int8Linear

    kind = Int4Linear if method == "int4" else Int8Linear
    path = str(tiny_checkpoints["llama"])
    options = dict(OPTIONS, quantization=method)
    single = LLM(path, **options)
    with LLM(path, tensor_parallel_size=2, **options) as double:
        layers = [m for m in double.engine.runner.model.modules() if isinstance(m, kind)]
        # (4 per decoder layer; int8 also the vocabulary projection)
        assert len(layers) == 4 * single.engine.spec.num_layers + (method == "int8")
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
        expected, got = single.generate(PROMPTS, params), double.generate(PROMPTS, params)
        for e, g in zip(expected, got, strict=True):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            for le, lg in zip(e.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert abs(lg.logprob - le.logprob) < 1e-4
