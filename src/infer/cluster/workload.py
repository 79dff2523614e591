"""The shared-prefix workload of the router's test and benchmark (pure Python, no ray).

``num_prefixes`` sessions (a long system prompt or document each) take turns, one request per
round, in a seeded random order within each round, for ``per_prefix`` rounds: every request is
its session's prefix plus a suffix of its own. The working set (all prefixes) is meant to fit
the replicas' KV caches together but not one replica's, which is where routing by prefix pays.
Prompts are token ids, so block counts are exact whatever the tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """Sizes of the workload (in tokens); :meth:`requests` builds it."""

    num_prefixes: int = 8
    per_prefix: int = 16
    prefix_tokens: int = 128
    suffix_tokens: int = 16
    vocab_size: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prefixes", "per_prefix", "prefix_tokens", "suffix_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size < 16:
            raise ValueError(f"vocab_size must be >= 16, got {self.vocab_size}")

    def requests(self) -> list[tuple[int, list[int]]]:
        """``(prefix index, prompt token ids)`` in sending order."""
        rng = random.Random(self.seed)
        # Ids from 3 up: clear of the usual special tokens (pad / bos / eos).
        draw = lambda n: [rng.randrange(3, self.vocab_size) for _ in range(n)]  # noqa: E731
        prefixes = [draw(self.prefix_tokens) for _ in range(self.num_prefixes)]
        out = []
        for _ in range(self.per_prefix):
            order = list(range(self.num_prefixes))
            rng.shuffle(order)
            out.extend((p, prefixes[p] + draw(self.suffix_tokens)) for p in order)
        return out
