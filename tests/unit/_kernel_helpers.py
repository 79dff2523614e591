"""Helpers of the kernel tests: spying on a method, shuffled paged block tables."""

from __future__ import annotations

from typing import Any

import torch


def count_calls(monkeypatch: Any, cls: type, name: str) -> list[int]:
    """Wrap ``cls.name`` so each call appends 1 to the returned list, then runs the original."""
    calls: list[int] = []
    original = getattr(cls, name)

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, spy)
    return calls


def shuffled_block_tables(
    gen: torch.Generator, lens: list[int], block_size: int, num_blocks: int
) -> tuple[list[list[int]], torch.Tensor]:
    """Shuffled, non-overlapping block tables for sequences of ``lens`` tokens: as lists, and
    as one int32 tensor padded with zeros to one width."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(perm[used : used + need])
        used += need
    padded = torch.zeros(len(lens), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t)
    return tables, padded
