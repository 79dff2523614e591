"""Per-request KV bookkeeping on top of the block pool. No torch.

The scheduler talks to a manager through one allocation gate::

    manager.allocate(request, num_new_tokens) -> bool   # False: memory pressure, preempt

and frees with ``manager.free(request)``. Two implementations:

- ``PagedKVManager``: blocks on demand, ``ceil(tokens / block_size)`` per request, optional
  prefix caching (``lookup_prefix`` + ``commit_full_blocks``).
- ``ContiguousKVManager``: each request reserves one ``max_model_len`` slot at admission (the
  classic pre-allocated layout the paged cache is measured against). It is a block pool whose
  block size is ``max_model_len``, so the runner and attention path are the same code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from infer.core.multimodal import block_image_keys
from infer.core.request import Request
from infer.kv_cache.block_pool import Block, BlockHash, BlockPool, PrefixCacheStats


@dataclass(frozen=True)
class PrefixHit:
    """Blocks found in the prefix cache for a request about to be admitted, and how many
    tokens past them arrive as a transferred payload (prefill/decode disaggregation)."""

    blocks: list[Block]
    hashes: list[BlockHash]
    num_transferred_tokens: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_tokens(self, block_size: int) -> int:
        """Tokens the request starts with computed."""
        return self.num_blocks * block_size + self.num_transferred_tokens


NO_HIT = PrefixHit([], [])


class KVManager(ABC):
    block_size: int
    pool: BlockPool
    num_swap_blocks: int = 0  # host slots for swapped-out blocks

    def __init__(self) -> None:
        self._blocks: dict[str, list[Block]] = {}
        # The same tables as block ids, kept in step with _blocks: a step copies every running
        # request's table, and a list copy costs a fraction of reading each Block's id.
        self._ids: dict[str, list[int]] = {}

    @abstractmethod
    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Make room for ``request``'s next ``num_new_tokens``; False (and no change) if short."""

    def lookup_prefix(self, request: Request) -> PrefixHit:
        """Cached blocks for the request's leading full blocks (never its final token)."""
        return NO_HIT

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup in the cache statistics."""

    def commit_full_blocks(self, request: Request) -> None:
        """Offer the request's newly completed blocks to the prefix cache."""

    # ---- swap (preemption by copying KV to host memory) -----------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host slots: ``[(device_block, host_slot)]``, or None
        if the swap space cannot take them (the caller then falls back to recompute)."""
        return None

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped request back: ``[(host_slot, device_block)]``, or None if short."""
        return None

    def is_swapped(self, request: Request) -> bool:
        return False

    def num_swapped_blocks_of(self, request: Request) -> int:
        """Host slots the request's swapped-out KV occupies (0 when it is not swapped)."""
        return 0

    @property
    def num_swapped_blocks(self) -> int:
        """Host slots in use by swapped-out requests."""
        return 0

    @property
    def num_swapped_requests(self) -> int:
        """Requests whose KV is in host memory."""
        return 0

    def end_step(self) -> None:
        """Called once per schedule: release host slots whose copies are now done."""

    def trim(self, request: Request) -> None:
        """Give back blocks past ``request.num_computed_tokens`` (rejected proposals' KV)."""

    def block_table(self, request: Request) -> list[int]:
        ids = self._ids.get(request.request_id)
        return ids.copy() if ids is not None else []

    def _hold(self, request_id: str, blocks: list[Block]) -> list[Block]:
        """Make ``blocks`` the request's table (the list is kept and extended in place)."""
        self._blocks[request_id] = blocks
        self._ids[request_id] = [b.block_id for b in blocks]
        return blocks

    def _extend(self, request_id: str, blocks: list[Block]) -> None:
        self._blocks[request_id].extend(blocks)
        self._ids[request_id].extend(b.block_id for b in blocks)

    def free(self, request: Request) -> None:
        self._ids.pop(request.request_id, None)
        blocks = self._blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free(list(reversed(blocks)))

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of this many tokens fits an otherwise empty pool."""
        return self.blocks_needed(num_tokens) <= self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        return self.pool.stats

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()


class PagedKVManager(KVManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        num_swap_blocks: int = 0,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # Hashes of each request's committed full blocks (the chain's parents).
        self._hashes: dict[str, list[BlockHash]] = {}
        # Requests whose chain met a hash collision: their later blocks are never cached (see
        # commit_full_blocks).
        self._uncachable: set[str] = set()
        self.num_swap_blocks = num_swap_blocks
        self._host_free: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self._swapped: dict[str, list[int]] = {}  # request id -> host slots, in block order
        # NOTE: slots freed by a swap-in are reused only from the next step: the runner copies
        # all of a step's swap-outs before its swap-ins, so same-step reuse would clobber them.
        self._host_release: list[int] = []

    @property
    def num_free_swap_blocks(self) -> int:
        return len(self._host_free)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        blocks = self._blocks.get(request.request_id)
        if not blocks or len(blocks) > len(self._host_free):
            return None
        host = [self._host_free.pop() for _ in blocks]
        pairs = [(b.block_id, h) for b, h in zip(blocks, host, strict=True)]
        hashes = self._hashes.get(request.request_id)
        uncachable = request.request_id in self._uncachable
        self.free(request)
        if hashes is not None:
            self._hashes[request.request_id] = hashes
        if uncachable:
            self._uncachable.add(request.request_id)
        self._swapped[request.request_id] = host
        return pairs

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        host = self._swapped.get(request.request_id)
        if host is None:
            return None
        need = max(self.blocks_needed(request.num_computed_tokens + num_new_tokens), len(host))
        new = self.pool.allocate(need)
        if new is None:
            return None
        del self._swapped[request.request_id]
        self._hold(request.request_id, new)
        self._host_release.extend(host)
        return [(h, b.block_id) for h, b in zip(host, new, strict=False)]

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self._swapped

    def num_swapped_blocks_of(self, request: Request) -> int:
        return len(self._swapped.get(request.request_id, ()))

    @property
    def num_swapped_blocks(self) -> int:
        return sum(len(slots) for slots in self._swapped.values())

    @property
    def num_swapped_requests(self) -> int:
        return len(self._swapped)

    def end_step(self) -> None:
        self._host_free.extend(self._host_release)
        self._host_release.clear()

    def lookup_prefix(self, request: Request) -> PrefixHit:
        if not self.enable_prefix_caching:
            return NO_HIT
        tokens = request.all_token_ids
        # NOTE: the final token is never served from cache: its logits must be computed.
        max_blocks = (len(tokens) - 1) // self.block_size
        extra = _extra_keys(request)
        blocks: list[Block] = []
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for i in range(max_blocks):
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            block = self.pool.lookup(parent, chunk, _block_keys(request, extra, i, self.block_size))
            if block is None:
                break
            blocks.append(block)
            parent = block.block_hash
            hashes.append(parent)  # type: ignore[arg-type]
        return PrefixHit(blocks, hashes)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (only admissions count, not retries)."""
        if self.enable_prefix_caching:
            self.pool.stats.queries += num_tokens
            self.pool.stats.hits += num_hit_tokens

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        held = self._blocks.get(request.request_id)
        target = request.num_computed_tokens + num_new_tokens
        if held and hit is NO_HIT:  # a running request (every decode step): no hit to weigh
            need = self.blocks_needed(target) - len(held)
            if need > self.pool.num_free_blocks:
                return False
        else:
            num_held = len(held) if held else hit.num_blocks
            if hit.num_blocks or hit.num_transferred_tokens:
                target = max(target, hit.num_tokens(self.block_size) + num_new_tokens)
            need = self.blocks_needed(target) - num_held
            # Reviving cached free blocks also takes them off the free list: count them.
            num_revived = sum(1 for b in hit.blocks if b.ref_count == 0) if held is None else 0
            if need + num_revived > self.pool.num_free_blocks:
                return False
            if held is None:
                self.pool.touch(hit.blocks)
                held = self._hold(request.request_id, list(hit.blocks))
                self._hashes[request.request_id] = list(hit.hashes)
        if need > 0:
            new = self.pool.allocate(need)
            assert new is not None
            self._extend(request.request_id, new)
        return True

    def trim(self, request: Request) -> None:
        blocks = self._blocks.get(request.request_id)
        keep = self.blocks_needed(request.num_computed_tokens)
        if blocks and len(blocks) > keep:
            surplus = blocks[keep:]
            del blocks[keep:]
            del self._ids[request.request_id][keep:]
            self.pool.free(list(reversed(surplus)))

    def commit_full_blocks(self, request: Request) -> None:
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        if num_full <= len(hashes):
            return
        extra = _extra_keys(request)
        parent = hashes[-1] if hashes else None
        uncachable = request.request_id in self._uncachable
        for i in range(len(hashes), num_full):
            chunk = request.token_ids(i * self.block_size, (i + 1) * self.block_size)
            keys = _block_keys(request, extra, i, self.block_size)
            if uncachable:  # the chain goes on (its hashes), nothing of it is cached
                h = self.pool.hash_fn(parent, chunk, keys)
            else:
                h = self.pool.cache_block(blocks[i], parent, chunk, keys)
                if not self.pool.holds(h, parent, chunk, keys):
                    # Another prefix's block holds this hash (a collision, or an identity
                    # evicted and taken since): this block stays private, and so must every
                    # later one, whose parent hash would pass for that other prefix's.
                    uncachable = True
                    self._uncachable.add(request.request_id)
            hashes.append(h)
            parent = h

    def free(self, request: Request) -> None:
        self._hashes.pop(request.request_id, None)
        self._uncachable.discard(request.request_id)
        host = self._swapped.pop(request.request_id, None)
        if host:  # aborted while swapped out
            self._host_release.extend(host)
        super().free(request)


class ContiguousKVManager(KVManager):
    """One ``max_model_len`` region per request, reserved whole at admission."""

    def __init__(self, num_slots: int, max_model_len: int) -> None:
        super().__init__()
        self.block_size = max_model_len
        self.pool = BlockPool(num_slots, enable_caching=False)

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        if request.request_id in self._blocks:
            return request.num_computed_tokens + num_new_tokens <= self.block_size
        region = self.pool.allocate(1)
        if region is None:
            return False
        self._hold(request.request_id, region)
        return True


def _extra_keys(request: Request) -> tuple:
    """What besides the tokens a block's KV depends on: the cache salt, and the LoRA adapter's
    load (the same prompt under two adapters has different KV, and so under a name loaded
    again from other weights)."""
    keys: tuple = (request.cache_salt,) if request.cache_salt else ()
    return keys + (("lora", request.lora_id),) if request.lora_id is not None else keys


def _block_keys(request: Request, extra: tuple, index: int, block_size: int) -> tuple:
    """Block ``index``'s keys: the request's, and the digests of the images whose placeholder
    tokens it holds (the same placeholders stand for any image: the KV is the image's)."""
    if not request.images:
        return extra
    return extra + block_image_keys(request.images, index * block_size, (index + 1) * block_size)
