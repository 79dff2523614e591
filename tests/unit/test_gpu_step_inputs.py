"""The GPU step's buffers (``runner/gpu/step.py``) as a step writes them: decode rows and mixed
steps, exact or padded to a graph bucket, with the tile list a padded mixed step's fixed-grid
attention walks. Plain CPU tensors (the buffers are pinned only on a GPU); no kernel runs."""

from __future__ import annotations

import itertools

import torch

from infer.core.messages import SequenceSlice
from infer.runner.gpu.step import StepInputs, StepShape

BS = 4


def _upload_counting_copies(inputs: StepInputs, monkeypatch) -> list[int]:
    """``inputs.upload()``, and the size of each copy it made."""
    copies: list[int] = []
    original = torch.Tensor.copy_
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "copy_",
                  lambda self, src, **kw: copies.append(src.numel()) or original(self, src))  # fmt: skip
        inputs.upload()
    return copies


def _inputs() -> StepInputs:
    shape = StepShape(max_rows=64, max_table_rows=8, max_seqs=4, max_blocks=6, max_tiles=8)
    return StepInputs(shape, torch.device("cpu"))


def test_a_mixed_step_padded_to_its_bucket_writes_padding_rows_and_its_tiles():
    inputs = _inputs()
    seqs = [
        SequenceSlice(6, 1, [3, 9]),  # a decode at position 6
        SequenceSlice(0, 9, [5, 10, 11]),  # a fresh prompt of 9
        SequenceSlice(8, 5, [1, 2, 7, 0]),  # a later chunk of 5 at 8..12
    ]
    ids = [100, *range(200, 209), *range(300, 305)]
    positions = [6, *range(9), *range(8, 13)]
    inputs._np["slots"][:] = 77  # a step before's values
    got_ids, got_pos, fields = inputs.fill(ids, positions, seqs, BS, padded_rows=24, tile_size=4)
    assert got_ids.tolist() == ids + [0] * 9 and got_pos.tolist() == positions + [0] * 9
    slots = fields["slots"].tolist()
    assert slots[0] == 9 * BS + 2  # block 1 of [3, 9], offset 2
    assert slots[1:10] == [5 * BS + p % BS if p < 4 else (10 if p < 8 else 11) * BS + p % BS
                           for p in range(9)]  # fmt: skip
    assert slots[15:] == [-1] * 9  # padding: stored nowhere
    assert fields["query_start"].tolist() == [0, 1, 10, 15]
    assert fields["num_computed"].tolist() == [6, 0, 8]
    # tiles of 4 queries: 1 for the decode, 3 for the 9, 2 for the 5
    tile_seq, tile_index, num_tiles = inputs.tile_views()
    assert int(num_tiles[0]) == 6
    assert tile_seq[:6].tolist() == [0, 1, 1, 1, 2, 2]
    assert tile_index[:6].tolist() == [0, 0, 1, 2, 0, 1]


def test_a_mixed_steps_one_token_chunks_are_a_decode_list_and_in_no_tile():
    """decode_rows (a mixed step's default): its one-token chunks listed for the decode kernel
    as (query row, sequence, context), the unused entries of a padded step's fixed-size list
    context 0 (over a step before's values); a padded step's tile list holds only the longer
    chunks' tiles."""
    inputs = _inputs()
    seqs = [
        SequenceSlice(6, 1, [3, 9]),  # a decode at position 6
        SequenceSlice(0, 9, [5, 10, 11]),  # a fresh prompt of 9
        SequenceSlice(2, 1, [4]),  # a decode at position 2
    ]
    ids = [100, *range(200, 209), 300]
    positions = [6, *range(9), 2]
    inputs._np["decode_list"][:] = 5  # a step before's values
    _, _, fields = inputs.fill(ids, positions, seqs, BS, padded_rows=16, tile_size=4,
                               decode_rows=4)  # fmt: skip
    assert fields["decode_entries"] == 4
    row_ids, row_seq, row_lens = inputs.decode_row_views(4)
    assert row_ids.tolist() == [0, 10, 0, 0] and row_seq.tolist() == [0, 2, 0, 0]
    assert row_lens.tolist() == [7, 3, 0, 0]
    tile_seq, tile_index, num_tiles = inputs.tile_views()
    assert int(num_tiles[0]) == 3  # the prompt's 9 queries in tiles of 4; no decode's
    assert tile_seq[:3].tolist() == [1, 1, 1] and tile_index[:3].tolist() == [0, 1, 2]
    # an exact (eager) step: as many entries as decodes
    _, _, fields = inputs.fill(ids[1:], positions[1:], seqs[1:], BS, decode_rows=0)
    assert fields["decode_entries"] == 1
    assert [v.tolist() for v in inputs.decode_row_views(1)] == [[9], [1], [3]]
    # no decode in the step, or the switch off: no list
    _, _, fields = inputs.fill(ids[1:10], positions[1:10], seqs[1:2], BS, decode_rows=0)
    assert "decode_entries" not in fields
    _, _, fields = inputs.fill(ids, positions, seqs, BS)
    assert "decode_entries" not in fields


def test_decode_rows_padded_to_their_bucket_attend_to_nothing_past_the_step():
    inputs = _inputs()
    seqs = [SequenceSlice(6, 1, [3, 9]), SequenceSlice(1, 1, [4])]
    _, _, fields = inputs.fill([1, 2], [6, 1], seqs, BS, padded_rows=4)
    assert fields["slots"].tolist() == [9 * BS + 2, 4 * BS + 1, -1, -1]
    assert fields["context_lens"].tolist() == [7, 2, 0, 0]
    assert int(inputs.tile_views()[2][0]) == 0  # no tile list written for decode rows


def test_start_up_warms_the_kernels_up_after_capturing_the_graphs_on_cuda_only():
    """``ModelRunner.capture_graphs`` (the engine's last start-up step): the graphs first, then
    the warm-up that launches the eager steps' kernels, which only a CUDA device compiles."""
    from infer.runner.runner import ModelRunner

    calls: list[str] = []

    class Step:
        def capture(self) -> None:
            calls.append("capture")

        def warm_up(self) -> int:
            calls.append("warm_up")
            return 1

    runner = ModelRunner.__new__(ModelRunner)  # (only what capture_graphs reads)
    runner.cuda_step = Step()
    for device, want in (("cuda", ["capture", "warm_up"]), ("cpu", ["capture"])):
        calls.clear()
        runner.device = torch.device(device)
        runner.capture_graphs()
        assert calls == want, device


def test_a_step_is_copied_in_a_few_copies_of_what_it_wrote_after_its_rows_are_staged(
    monkeypatch,
):
    """fill(upload=False) writes the host side only; stage adds index rows; upload copies
    every part written (parts less than _MERGE_GAP apart in one copy) and nothing else; a step
    filled before the one before was uploaded is refused, unless that one's writes were
    discarded (it failed)."""
    import pytest

    from infer.runner.gpu import step as step_mod

    inputs = _inputs()
    seqs = [SequenceSlice(6, 1, [3, 9]), SequenceSlice(1, 1, [4])]
    ids, positions, fields = inputs.fill([11, 12], [6, 1], seqs, BS, upload=False)
    assert ids.tolist() == [0, 0] and fields["slots"].tolist() == [0, 0]  # (not yet copied)
    rows = inputs.stage("sample_rows", [1, 0])
    copies = _upload_counting_copies(inputs, monkeypatch)
    assert ids.tolist() == [11, 12] and positions.tolist() == [6, 1]
    assert rows.tolist() == [1, 0] and fields["context_lens"].tolist() == [7, 2]
    assert fields["slots"].tolist() == [9 * BS + 2, 4 * BS + 1]
    assert len(copies) <= 3 and not any(inputs._written.values())  # (a small shape: few gaps)
    inputs.fill([11], [7], seqs[:1], BS, upload=False)
    with pytest.raises(AssertionError, match="never uploaded"):
        inputs.fill([11], [7], seqs[:1], BS)
    inputs.discard()  # (a step that failed before its upload)
    ids, _, _ = inputs.fill([13], [7], seqs[:1], BS)
    assert ids.tolist() == [13] and not any(inputs._written.values())
    big = inputs.stage("sample_rows", list(range(65)))  # more than the buffer: its own tensor
    assert big.tolist() == list(range(65)) and not any(inputs._written.values())
    assert step_mod.merged_ranges([(9000, 9004), (0, 4), (100, 104), (2, 8)], 4096) == [
        (0, 104),
        (9000, 9004),
    ]


def test_the_fields_share_two_buffers_without_overlapping_each_aligned():
    inputs = _inputs()
    spans = {}
    for name, (dtype, offset, per_row) in inputs._where.items():
        host, dev = getattr(inputs, name)
        assert host.dtype == dev.dtype == dtype and offset % 32 == 0
        spans.setdefault(dtype, []).append((offset, offset + host.numel()))
        assert dev.data_ptr() == inputs._buffers[dtype][1].data_ptr() + offset * dev.element_size()
        assert per_row == (host.shape[1] if host.dim() == 2 else 1)
    for ranges in spans.values():
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges))  # no two overlap


def test_a_decode_step_of_the_bench_engine_takes_five_copies(monkeypatch):
    """The 1B bench engine's buffers (8,192 batched tokens + a 2,048-token context apart): a
    decode step of 64 rows fed by the step before copies ids, positions, the fed rows, the
    slots and (context lengths .. tables) — five copies, each no larger than its parts plus
    the small fields between them."""
    shape = StepShape(max_rows=8192 + 2048, max_table_rows=256, max_seqs=256, max_blocks=128)
    inputs = StepInputs(shape, torch.device("cpu"))
    seqs = [SequenceSlice(100 + i, 1, list(range(8))) for i in range(64)]
    inputs.fill([1] * 64, [100 + i for i in range(64)], seqs, 16, padded_rows=64, upload=False)
    inputs.stage("feed_rows", list(range(64)))
    inputs.stage("feed_sources", list(range(64)))
    copies = _upload_counting_copies(inputs, monkeypatch)
    assert len(copies) == 5
    assert sum(copies) < 64 * 5 + 64 * 128 + 3 * 256 + 2 * 256 + 4 * 32 * 8
