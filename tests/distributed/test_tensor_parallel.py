"""Tensor parallelism on CPU: two ranks (this process and one spawned worker) over gloo give the
same logits as one, to float32 rounding, and the same greedy tokens, for every architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer.core.sampling_params import SamplingParams
from infer.llm import LLM
from infer.runner.attention import SequenceSlice
from infer.runner.runner import StepBatch
from tests.conftest import ARCH_KINDS

pytestmark = pytest.mark.distributed

OPTIONS = dict(dtype="float32", block_size=8, enable_prefix_caching=True, prefill_chunk_size=16)
PREFIX = list(range(40, 70))
PROMPTS = [
    [5, 6, 7, 8, 9, 10],
    list(range(100, 140)),  # longer than one prefill chunk
    PREFIX + [1, 2, 3],
]
HIT = [PREFIX + [4, 5]]  # after PROMPTS: its prefix is in the cache


@pytest.fixture(scope="module", params=ARCH_KINDS)
def pair(request, tiny_checkpoints: dict[str, Path]):
    """``(one rank, two ranks)`` offline engines for one architecture."""
    path = str(tiny_checkpoints[request.param])
    single = LLM(path, **OPTIONS)
    with LLM(path, tensor_parallel_size=2, **OPTIONS) as double:
        yield single, double


def run_logits(llm: LLM, batch: StepBatch) -> torch.Tensor:
    """The logits of ``batch``'s sampled rows, every rank running it."""
    engine = llm.engine
    if engine.tp_workers is not None:
        engine.tp_workers.send(batch)
    logits, _, _ = engine.runner.run(batch)
    assert logits is not None
    return logits


def test_logits_match_one_rank(pair):
    # A prefill of two sequences (every row scored), then a decode step over the cached context.
    a, b = list(range(3, 16)), [900, 17, 256, 3, 1023]
    prefill = StepBatch(
        token_ids=a + b,
        positions=list(range(len(a))) + list(range(len(b))),
        seqs=[SequenceSlice(0, len(a), [0, 1]), SequenceSlice(0, len(b), [2])],
        sample_rows=list(range(len(a) + len(b))),
        prompt_rows=[],
        swap_out=[],
        swap_in=[],
    )
    decode = StepBatch(
        token_ids=[7, 11],
        positions=[len(a), len(b)],
        seqs=[SequenceSlice(len(a), 1, [0, 1]), SequenceSlice(len(b), 1, [2])],
        sample_rows=[0, 1],
        prompt_rows=[],
        swap_out=[],
        swap_in=[],
    )
    single, double = pair
    for batch in (prefill, decode):
        expected, got = run_logits(single, batch), run_logits(double, batch)
        assert (
            got.shape == expected.shape == (len(batch.sample_rows), single.engine.spec.vocab_size)
        )
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_greedy_outputs_identical_and_blocks_freed(pair):
    single, double = pair
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    expected = single.generate(PROMPTS, params) + single.generate(HIT, params)
    got = double.generate(PROMPTS, params) + double.generate(HIT, params)
    for e, g in zip(expected, got, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
    stats = double.engine.get_stats()
    # One block pool, in the driver, governs the cache of every rank.
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.prefix_cache_hits_total > 0


def test_embeddings_match_one_rank(pair):
    """The driver's final hidden states are whole (the last layer's reduce is done): an
    embedding under two ranks is one rank's."""
    single, double = pair
    for e, g in zip(single.embed(PROMPTS), double.embed(PROMPTS), strict=True):
        torch.testing.assert_close(torch.tensor(g.outputs.embedding),
                                   torch.tensor(e.outputs.embedding), rtol=0, atol=1e-4)  # fmt: skip
    stats = double.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_heads_that_do_not_divide_are_refused(tiny_checkpoints):
    with pytest.raises(
        ValueError, match="tensor_parallel_size 3 does not divide num_attention_heads=4"
    ):
        LLM(str(tiny_checkpoints["llama"]), tensor_parallel_size=3)


def test_speculative_decoding_is_refused(tiny_checkpoints):
    with pytest.raises(ValueError, match="speculative decoding does not run with tensor parallel"):
        LLM(
            str(tiny_checkpoints["llama"]),
            tensor_parallel_size=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
