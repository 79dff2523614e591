"""A CPU decode step's metadata written into the runner's fixed buffers (HostStepInputs) is the
metadata the general path builds, and attention over it gives the same output."""

from __future__ import annotations

import random

import pytest
import torch

from infer.core.messages import SequenceSlice
from infer.runner.attention import AttentionContext, KVCache
from infer.runner.attention.torch_ref import TorchAttention
from infer.runner.cpu.kernels import cpu_kernels
from infer.runner.cpu.step_inputs import HostStepInputs

BS, NUM_BLOCKS, KV_HEADS, HEADS, HEAD_DIM = 4, 64, 2, 4, 16


def decode_step(rng: random.Random, num_seqs: int, max_len: int) -> list[SequenceSlice]:
    """Sequences decoding one token each, at random lengths, over distinct random blocks."""
    blocks = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    seqs = []
    for _ in range(num_seqs):
        past = rng.randrange(0, max_len)
        table = [blocks.pop() for _ in range(past // BS + 1)]
        seqs.append(SequenceSlice(past, 1, table))
    return seqs


def _backends(dtype: torch.dtype) -> list:
    backends = [TorchAttention()]
    kernels = cpu_kernels()
    if kernels is not None and kernels.supports(dtype):
        from infer.runner.attention.cpu import CpuAttention

        backends.append(CpuAttention(kernels))
    return backends


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_buffers_give_the_general_paths_metadata_and_output(dtype):
    rng = random.Random(0)
    torch.manual_seed(0)
    cache = KVCache(1, NUM_BLOCKS, BS, KV_HEADS, HEAD_DIM, dtype, "cpu")
    for view in cache.block_views():
        view.copy_(torch.randn(view.shape).to(view.dtype))
    inputs = HostStepInputs(max_rows=16, max_seqs=8, max_blocks=12)
    # long tables first, then short ones: the tails left behind must never be read
    for num_seqs, max_len in ((8, 44), (5, 9), (8, 30), (1, 3)):
        seqs = decode_step(rng, num_seqs, max_len)
        for backend in _backends(dtype):
            fresh = AttentionContext(cache, seqs, "cpu", backend)
            fixed = AttentionContext(cache, seqs, "cpu", backend, inputs)
            assert fixed.all_decode and fixed.num_tokens == num_seqs
            assert fixed.slot_mapping.data_ptr() == inputs.slots.data_ptr()  # the same memory
            assert torch.equal(fixed.slot_mapping, fresh.slot_mapping)
            (t_fresh, l_fresh), (t_fixed, l_fixed) = fresh.decode_tables(), fixed.decode_tables()
            assert t_fixed.data_ptr() == inputs.tables.data_ptr()
            assert torch.equal(l_fixed, l_fresh)
            for row, length in enumerate(l_fresh.tolist()):
                used = -(-length // BS)
                assert torch.equal(t_fixed[row, :used], t_fresh[row, :used])
            q = torch.randn(num_seqs, HEADS, HEAD_DIM).to(dtype)
            k = torch.randn(num_seqs, KV_HEADS, HEAD_DIM).to(dtype)
            v = torch.randn(num_seqs, KV_HEADS, HEAD_DIM).to(dtype)
            saved = [view.clone() for view in cache.block_views()]
            out_fresh = fresh.attend(0, q, k, v, scale=HEAD_DIM**-0.5)
            for view, old in zip(cache.block_views(), saved, strict=True):
                view.copy_(old)  # the same cache for the second context's store
            out_fixed = fixed.attend(0, q, k, v, scale=HEAD_DIM**-0.5)
            assert torch.equal(out_fixed, out_fresh), backend.name


def test_steps_the_buffers_do_not_take_build_their_own():
    cache = KVCache(1, NUM_BLOCKS, BS, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    inputs = HostStepInputs(max_rows=16, max_seqs=2, max_blocks=3)
    cases = [
        [SequenceSlice(0, 5, [1, 2]), SequenceSlice(7, 1, [3, 4])],  # a prefill chunk
        [
            SequenceSlice(3, 1, [1]),
            SequenceSlice(3, 1, [2]),
            SequenceSlice(3, 1, [3]),
        ],  # > max_seqs
        [SequenceSlice(13, 1, [1, 2, 3, 4])],  # a table wider than max_blocks
    ]
    for seqs in cases:
        fresh = AttentionContext(cache, seqs, "cpu")
        fixed = AttentionContext(cache, seqs, "cpu", inputs=inputs)
        assert fixed.slot_mapping.data_ptr() != inputs.slots.data_ptr()
        assert torch.equal(fixed.slot_mapping, fresh.slot_mapping)
    assert inputs.tokens(list(range(17)), list(range(17))) is None  # more than max_rows
    ids, pos = inputs.tokens([5, 6, 7], [0, 1, 2])
    assert ids.tolist() == [5, 6, 7] and pos.tolist() == [0, 1, 2]
    assert ids.data_ptr() == inputs.input_ids.data_ptr()
