"""LLaVA under tensor parallelism (its own module: one process runs one TP engine at a time):
every rank holds the whole vision tower and projector and computes a step's images from the
pixels the batch carries, then its share of the decoder; greedy outputs are one rank's."""

from __future__ import annotations

import pytest

from infer import SamplingParams
from infer.llm import LLM
from infer.testing.checkpoints import default_root
from infer.testing.vision import build_llava, random_image

from .test_tensor_parallel import OPTIONS

pytestmark = pytest.mark.distributed


def test_llava_under_two_ranks_is_one_ranks():
    folder = str(build_llava(default_root()))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [
        {"prompt": f"USER: <image>\nPicture {i}? ASSISTANT:",
         "multi_modal_data": {"image": random_image(50 + i)}}
        for i in range(3)
    ] + ["USER: no picture ASSISTANT:"]  # fmt: skip
    single = [r.outputs[0].token_ids for r in LLM(folder, **OPTIONS).generate(prompts, params)]
    with LLM(folder, tensor_parallel_size=2, **OPTIONS) as double:
        got = [r.outputs[0].token_ids for r in double.generate(prompts, params)]
        stats = double.engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    assert got == single
