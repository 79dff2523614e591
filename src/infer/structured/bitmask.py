"""Applying a token bitmask to logits (bit ``t % 32`` of word ``t // 32`` set: token allowed)."""

from __future__ import annotations

import torch


def apply_bitmask(logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf in place (``rows`` of ``logits``)."""
    vocab = logits.shape[1]
    allowed = ((mask[:, :, None] >> _BITS) & 1).reshape(mask.shape[0], -1)[:, :vocab]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    masked = logits.index_select(0, index).masked_fill_(allowed.to(logits.device) == 0, -torch.inf)
    logits.index_copy_(0, index, masked)


def allows(words: list[int], token: int) -> bool:
    """Whether one bitmask row (its int32 words, as a list) allows ``token``."""
    return token // 32 < len(words) and bool(words[token // 32] >> (token % 32) & 1)


_BITS = torch.arange(32, dtype=torch.int32)
