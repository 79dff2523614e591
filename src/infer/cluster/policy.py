"""Which replica gets a request: round-robin, least-loaded, or prefix-aware.

Pure Python (no ray, no torch), so every rule is unit-tested without a cluster. A policy is told
when a request starts and ends on a replica (``start`` / ``finish``) and keeps the in-flight
count per replica; ``choose`` looks at the request's block hashes and those counts.

The block hashes are the prefix cache's own identities (:func:`prompt_block_hashes` chains
:func:`infer.kv_cache.block_pool.hash_block_tokens` over the prompt's full blocks exactly as
``PagedKVManager`` does), so "replica A was sent these hashes" means "replica A computed, and
probably still caches, these blocks". The router's hashes never have to equal the replicas'
(Python's ``hash`` of a salted string differs between processes): affinity only needs the same
prompt prefix to give the same hashes inside the router.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from infer.kv_cache.block_pool import BlockHash, hash_block_tokens

POLICIES = ("prefix", "round-robin", "least-loaded")


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks, as the prefix cache computes them.

    Like ``PagedKVManager.lookup_prefix``, the block holding the prompt's last token is left
    out when the prompt fills it exactly: that token's logits are always computed, so the
    block is never served from the cache.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    extra = (cache_salt,) if cache_salt else ()  # the manager's _extra_keys
    num_blocks = max(0, len(token_ids) - 1) // block_size
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why (for the router's metrics and logs)."""

    replica: int
    reason: str  # "round-robin" | "least-loaded" | "prefix-hit" | "overloaded" | "no-prefix"
    matched_blocks: int = 0


class RoutingPolicy:
    """Base: in-flight counts per replica, and a least-loaded pick for the subclasses.

    Ties in load go to the replica sent the fewest requests so far, then the lowest index, so a
    run of one-at-a-time requests alternates instead of piling onto replica 0.
    """

    name = "base"

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"a policy needs at least one replica, got {num_replicas}")
        self.num_replicas = num_replicas
        self.in_flight = [0] * num_replicas
        self.sent = [0] * num_replicas

    def choose(self, block_hashes: Sequence[BlockHash] = ()) -> Decision:
        """The replica for a request whose prompt has these block hashes."""
        raise NotImplementedError

    def start(self, replica: int, block_hashes: Sequence[BlockHash] = ()) -> None:
        """A request was sent to ``replica``."""
        self.in_flight[replica] += 1
        self.sent[replica] += 1

    def finish(self, replica: int) -> None:
        """A request on ``replica`` ended (finished, failed or aborted)."""
        if self.in_flight[replica] <= 0:
            raise ValueError(f"replica {replica} has no request in flight")
        self.in_flight[replica] -= 1

    def least_loaded(self) -> int:
        return min(range(self.num_replicas), key=lambda i: (self.in_flight[i], self.sent[i], i))


class RoundRobin(RoutingPolicy):
    """Replicas in turn, whatever their load or cache."""

    name = "round-robin"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = 0

    def choose(self, block_hashes: Sequence[BlockHash] = ()) -> Decision:
        replica = self._next
        self._next = (self._next + 1) % self.num_replicas
        return Decision(replica, "round-robin")


class LeastLoaded(RoutingPolicy):
    """The replica with the fewest requests in flight."""

    name = "least-loaded"

    def choose(self, block_hashes: Sequence[BlockHash] = ()) -> Decision:
        return Decision(self.least_loaded(), "least-loaded")


class PrefixAware(RoutingPolicy):
    """The replica most likely to hold the prompt's prefix in its KV cache.

    Per replica, an LRU-bounded set of the block hashes it has been sent (``capacity_blocks``,
    about its KV pool: a replica cannot cache more blocks than it has). A request goes to the
    replica with the longest run of its leading block hashes in that set, unless that replica
    has more than ``max_load_gap`` requests in flight beyond the least-loaded one: then caching
    loses to queueing, and the least-loaded replica gets it (and from then on also holds the
    prefix, so a hot prefix spreads over replicas as its load grows). No match at all: the
    least-loaded replica, and among equally loaded ones the one remembering the fewest blocks,
    so new prefixes spread evenly over the caches. Ties in match length go to the less loaded.
    """

    name = "prefix"

    def __init__(self, num_replicas: int, capacity_blocks: int = 4096, max_load_gap: int = 4):
        super().__init__(num_replicas)
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        if max_load_gap < 0:
            raise ValueError(f"max_load_gap must be >= 0, got {max_load_gap}")
        self.capacity_blocks = capacity_blocks
        self.max_load_gap = max_load_gap
        self.held: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(num_replicas)]

    def least_loaded(self) -> int:
        return min(
            range(self.num_replicas),
            key=lambda i: (self.in_flight[i], len(self.held[i]), self.sent[i], i),
        )

    def matched(self, replica: int, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the prompt ``replica`` was sent before."""
        held = self.held[replica]
        n = 0
        for h in block_hashes:
            if h not in held:
                break
            n += 1
        return n

    def choose(self, block_hashes: Sequence[BlockHash] = ()) -> Decision:
        least = self.least_loaded()
        if not block_hashes:
            return Decision(least, "no-prefix")
        matches = [self.matched(i, block_hashes) for i in range(self.num_replicas)]
        best = min(
            range(self.num_replicas),
            key=lambda i: (-matches[i], self.in_flight[i], self.sent[i], i),
        )
        if matches[best] == 0:
            return Decision(least, "least-loaded")
        if self.in_flight[best] - self.in_flight[least] > self.max_load_gap:
            return Decision(least, "overloaded", 0)
        return Decision(best, "prefix-hit", matches[best])

    def start(self, replica: int, block_hashes: Sequence[BlockHash] = ()) -> None:
        super().start(replica, block_hashes)
        held = self.held[replica]
        for h in block_hashes:  # most recently used last; the oldest are dropped first
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)


def make_policy(name: str, num_replicas: int, **kwargs: int) -> RoutingPolicy:
    """The policy called ``name`` (one of :data:`POLICIES`); ``kwargs`` go to ``PrefixAware``."""
    if name == "prefix":
        return PrefixAware(num_replicas, **kwargs)
    if name == "round-robin":
        return RoundRobin(num_replicas)
    if name == "least-loaded":
        return LeastLoaded(num_replicas)
    raise ValueError(f"unknown router policy {name!r}: choose one of {', '.join(POLICIES)}")
