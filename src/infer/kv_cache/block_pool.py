"""The pool of KV blocks: reference counts, prefix-cache identities and an LRU free list.

A block is in exactly one of three states::

    in use          ref_count > 0                (held by >= 1 running request)
    cached, free    ref_count == 0, has a hash   (in the free list AND in the hash map: revivable)
    empty, free     ref_count == 0, no hash      (in the free list only)

The free list is ordered least-recently-freed first. Allocation pops from its front and, if
that block still carried a hash, evicts it from the hash map then (eviction is lazy: a cached
block survives until its slot is actually needed). A prefix hit on a cached free block takes it
out of the free list in O(1) (an OrderedDict keyed by block id).

No torch here: the pool only hands out block ids; the runner owns the tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BlockHash = int
ExtraKeys = tuple


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra: ExtraKeys
) -> BlockHash:
    """A full block's identity, chained over its parent so the same tokens under another
    prefix get another hash. Collisions are guarded by comparing tokens on lookup."""
    return hash((parent, tuple(token_ids), extra))


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # What the hash stands for, kept to confirm a hit (no wrong KV on a hash collision).
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    extra: ExtraKeys = ()


@dataclass
class PrefixCacheStats:
    """Monotone counters; a windowed hit rate is a difference of two snapshots."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache
    evictions: int = 0  # cached blocks whose identity was dropped to reuse the slot

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Hands out and takes back KV block ids; remembers full blocks for prefix reuse."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = False,
        hash_fn: Callable[
            [BlockHash | None, Sequence[int], ExtraKeys], BlockHash
        ] = hash_block_tokens,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, Block] = {}
        self.stats = PrefixCacheStats()

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (empty ones plus cached ones that would be evicted)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_states(self) -> str:
        """One character per block: ``u`` in use, ``c`` free with a cached prefix, ``.`` empty."""
        return "".join(
            "u" if b.ref_count else ("c" if b.block_hash is not None else ".") for b in self.blocks
        )

    def lookup(
        self, parent: BlockHash | None, token_ids: Sequence[int], extra: ExtraKeys
    ) -> Block | None:
        """The cached block holding exactly these tokens after this parent, if any."""
        h = self.hash_fn(parent, token_ids, extra)
        block = self._cached.get(h)
        if (
            block is None
            or block.parent_hash != parent
            or block.extra != extra
            or block.token_ids != tuple(token_ids)
        ):
            return None
        return block

    def holds(
        self, h: BlockHash, parent: BlockHash | None, token_ids: Sequence[int], extra: ExtraKeys
    ) -> bool:
        """Whether hash ``h`` is cached as exactly these tokens after this parent (False: free,
        or another identity's: a collision)."""
        block = self._cached.get(h)
        return (
            block is not None
            and block.parent_hash == parent
            and block.extra == extra
            and block.token_ids == tuple(token_ids)
        )

    # ---- state changes ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[Block] | None:
        """``n`` fresh blocks (ref_count 1), evicting cached identities as needed; None if short."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on prefix-hit blocks, reviving free cached ones."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference per block. Pass a request's blocks in reverse order so a prefix's
        tail is evicted before its head (heads are shared by more future requests)."""
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")
            if block.ref_count == 0:
                if not self.enable_caching:
                    self._evict(block)
                self._free[block.block_id] = None

    def cache_block(
        self, block: Block, parent: BlockHash | None, token_ids: Sequence[int], extra: ExtraKeys
    ) -> BlockHash:
        """Register a now-full block under its chained hash; returns the hash.

        If another block already holds this identity (two requests computed the same prefix at
        once), the existing one stays the cached copy and this one stays private.
        """
        h = self.hash_fn(parent, token_ids, extra)
        if self.enable_caching and block.block_hash is None and h not in self._cached:
            block.block_hash = h
            block.parent_hash = parent
            block.token_ids = tuple(token_ids)
            block.extra = extra
            self._cached[h] = block
        return h

    def reset_prefix_cache(self) -> bool:
        """Forget every cached identity. Refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
            block.token_ids = ()
        self._cached.clear()
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self.stats.evictions += 1
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = ()
        block.extra = ()
