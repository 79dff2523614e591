"""A CPU step's inputs at fixed addresses: the buffers each step is written into.

Nothing on a CPU captures a graph, but the fused decode loop (``decode_fast.py``) is the CPU's
replayable step, and every step's inputs go into the same memory here, allocated once with the
runner: numpy views filled in place, torch tensors that are views of them, so a step builds no
tensors from Python lists and its kernels read the same addresses step after step::

    input_ids    [max_rows] int64                 the step's tokens, flat (any step that fits)
    positions    [max_rows] int64
    --- decode steps (every sequence one new token): row r is the step's sequence r ---
    slots        [max_seqs] int64                 cache slot of row r's new token
    rows         [max_seqs] int64                 0, 1, ... (the decode rows, in batch order)
    context_lens [max_seqs] int32                 keys row r attends: its past + its new token
    tables       [max_seqs, max_blocks] int32     row r's block table; the tail an earlier,
                                                  longer table left is never read (context_lens
                                                  bounds every read)

A step with a prefill chunk or a speculative verify chunk builds its own metadata
(:class:`~infer.runner.attention.AttentionContext`'s general path): its shapes vary with the
chunks, and nothing replays it. A decode step without the runner's buffers (a draft model's, a
CUDA torch step's) goes through a set of these sized to it: one arithmetic for every decode step.
"""

from __future__ import annotations

import numpy as np
import torch

from infer.core.messages import SequenceSlice


class HostStepInputs:
    """The buffers above, for steps of up to ``max_rows`` tokens and ``max_seqs`` decode rows
    whose block tables hold up to ``max_blocks`` blocks."""

    def __init__(self, max_rows: int, max_seqs: int, max_blocks: int) -> None:
        self.max_rows, self.max_seqs, self.max_blocks = max_rows, max_seqs, max_blocks
        # numpy arrays (filled in place) and torch views of them (what the kernels read)
        self._ids, self._pos = np.zeros(max_rows, np.int64), np.zeros(max_rows, np.int64)
        self._slots, self._rows = np.zeros(max_seqs, np.int64), np.arange(max_seqs)
        self._lens = np.zeros(max_seqs, np.int32)
        self._tables = np.zeros((max_seqs, max_blocks), np.int32)
        self._computed = np.zeros(max_seqs, np.int64)
        self.input_ids, self.positions = torch.from_numpy(self._ids), torch.from_numpy(self._pos)
        self.slots, self.rows = torch.from_numpy(self._slots), torch.from_numpy(self._rows)
        self.context_lens = torch.from_numpy(self._lens)
        self.tables = torch.from_numpy(self._tables)

    def tokens(
        self, token_ids: list[int], positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``token_ids`` and ``positions`` written into the buffers (views of their first
        rows), or None when the step has more tokens than they hold."""
        n = len(token_ids)
        if n > self.max_rows:
            return None
        self._ids[:n] = token_ids
        self._pos[:n] = positions
        return self.input_ids[:n], self.positions[:n]

    def decode(self, sequences: list[SequenceSlice], block_size: int) -> int:
        """Fill the decode buffers for ``sequences`` when every one decodes one token and they
        fit; returns the number of rows written (0: not a decode step for these buffers, the
        caller builds its own metadata)."""
        n = len(sequences)
        if not n or n > self.max_seqs:
            return 0
        tables, computed = self._tables, self._computed
        for i, seq in enumerate(sequences):
            table = seq.block_table
            if seq.num_new_tokens != 1 or len(table) > self.max_blocks:
                return 0
            tables[i, : len(table)] = table
            computed[i] = seq.num_computed_tokens
        past = computed[:n]
        slots = self._slots[:n]
        # slot = tables[r, past // bs] * bs + past % bs: the row's physical block, the offset
        slots[:] = tables[self._rows[:n], past // block_size]
        slots *= block_size
        slots += past % block_size
        np.add(past, 1, out=self._lens[:n], casting="unsafe")
        return n
