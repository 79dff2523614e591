"""A step's inputs in persistent device buffers, and the attention context that reads them.

The host fills pinned buffers (numpy views, no tensors built from lists) and copies what it
wrote, non-blocking, to device buffers whose addresses never change (each dtype's fields end to
end in one buffer, a step's parts in a few copies: :class:`StepInputs`), so a CUDA graph
captured on these buffers replays any later step of its size::

    host (pinned)                                  device (fixed addresses)
    input_ids    [max_rows] int64   ── copy [:n] ─►  input_ids
    positions    [max_rows] int64                     positions
    slots        [max_rows] int32                     slots          -1: padding, stored nowhere
    context_lens [max_rows] int32                     context_lens   decode rows; 0: padding
    tables       [max_table_rows, max_blocks] int32   tables         one row per decode row,
                                                                     or per sequence (prefill)
    query_start  [max_seqs + 1] int32                 query_start    prefill steps
    num_computed [max_seqs] int32                     num_computed   prefill steps
    tiles [1 + 2 max_tiles] int32                     a padded mixed step's tile list:
                                                      count | sequences | tile indices
    decode_list [3 max_seqs] int32                    a mixed step's one-token chunks, a
                                                      list: query rows | sequences | contexts

Two shapes of step:

- **decode rows**: every token is its own query with its own context (a decode, or a token of a
  speculative verify chunk: token j of a chunk after c cached tokens sees c + j + 1 keys). Row r
  reads ``tables[r]`` and ``context_lens[r]``; one decode-kernel launch per layer. This is the
  step CUDA graphs replay, padded to a bucket with rows of context 0 and slot -1.
- **mixed** (any prefill chunk): sequence s owns rows ``query_start[s] .. query_start[s+1]``, at
  positions ``num_computed[s] + i``, causal over its cached past and itself; one prefill-kernel
  launch per layer for every sequence of the step (a decode is a chunk of one). Padded to a
  token bucket (a mixed step's CUDA graph), the padding rows come after every chunk and the
  fixed-grid kernel walks the step's list of query tiles instead (:func:`prefill_tiles`).
  Either way the one-token chunks (the decodes beside the prompts) are decode rows: the decode
  kernel attends them first from a list of (query row, sequence, context) entries (an exact
  step's as many as its decodes; a padded step's a fixed number, the unused ones of context 0,
  which write nothing), split over the key axis as a decode step of that many rows is, and the
  prefill kernel only the longer chunks (the tile list holds only theirs; the grid-per-step
  kernel skips the others). A 64-query tile holding one query loads every key once per query
  head; the decode kernel loads it once per kv head (``decode_rows=None``,
  ``INFER_MIXED_DECODE_ROWS=0``: every chunk through the prefill kernel, to measure the two).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from infer.runner import kv_quant
from infer.runner.attention import split_qkv
from infer.runner.gpu import triton_attention as ta
from infer.runner.gpu import triton_fused

if TYPE_CHECKING:
    from infer.runner.attention import KVCache, SequenceSlice


def _interpreted(x: torch.Tensor) -> bool:
    """Triton's interpreter on CPU tensors (tests): the fused rope + store runs there too."""
    return (
        x.device.type == "cpu"
        and triton_fused.triton is not None
        and (os.environ.get("TRITON_INTERPRET") == "1")
    )


def is_decode_rows(seqs: list[SequenceSlice]) -> bool:
    """Whether every query of the step can be attended as a decode row."""
    return bool(seqs) and all(s.num_new_tokens == 1 or s.as_decode_rows for s in seqs)


@dataclass(frozen=True)
class StepShape:
    """The most a step can hold: rows (tokens), decode rows' tables, sequences."""

    max_rows: int
    max_table_rows: int
    max_seqs: int
    max_blocks: int  # blocks of one sequence's table (max_model_len / block_size, rounded up)
    max_tiles: int = 0  # query tiles of a padded mixed step (0: no mixed step is padded)

    def covers(self, num_rows: int, num_seqs: int, table_rows: int, width: int) -> bool:
        return (
            num_rows <= self.max_rows
            and num_seqs <= self.max_seqs
            and table_rows <= self.max_table_rows
            and width <= self.max_blocks
        )


@dataclass(frozen=True)
class DecodeRows:
    """What the decode kernel attends: entry e is query row ``ids[e]`` of sequence ``seq[e]``
    (its table row) with ``lens[e]`` keys (0: an unused entry), attended in ``num_splits``
    parts (``workspace``: their buffers when more than one). ``ids`` and ``seq`` None: every
    row of a decode-rows step, row r with table row r (a mixed step's decodes: a list)."""

    ids: torch.Tensor | None
    seq: torch.Tensor | None
    lens: torch.Tensor
    num_splits: int = 1
    workspace: object | None = None


@dataclass(frozen=True)
class TileList:
    """A padded mixed step's query tiles in the step buffers, for the fixed-grid kernel:
    pairs ``(seq[i], index[i])`` for ``i < count[0]``, each ``size`` queries, walked by
    ``num_programs`` programs (a function of the token bucket only)."""

    seq: torch.Tensor
    index: torch.Tensor
    count: torch.Tensor
    num_programs: int
    size: int


class GpuAttentionContext:
    """What the model's attention layers call for one forward pass on the Triton backend.

    Same interface as :class:`infer.runner.attention.AttentionContext` (``attend``,
    ``can_store_rotated``, ``all_decode``, ``num_tokens``); every tensor is a view of the step
    buffers, so a context built for a graph bucket at capture stays valid for every replay.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        *,
        num_tokens: int,
        slots: torch.Tensor,
        tables: torch.Tensor,
        context_lens: torch.Tensor | None = None,
        query_start: torch.Tensor | None = None,
        num_computed: torch.Tensor | None = None,
        max_query_len: int = 1,
        num_splits: int = 1,
        workspace: object | None = None,
        tiles: TileList | None = None,
        decode_rows: DecodeRows | None = None,
        min_query_len: int = 1,
    ) -> None:
        self.kv_cache = kv_cache
        self.num_tokens = num_tokens
        self.slot_mapping = slots
        self.tables = tables
        self.context_lens = context_lens
        self.query_start = query_start
        self.num_computed = num_computed
        self.max_query_len = max_query_len
        self.tiles = tiles
        if context_lens is not None:  # a decode-rows step: every row through the decode kernel
            assert decode_rows is None and query_start is None
            decode_rows = DecodeRows(None, None, context_lens, num_splits, workspace)
        # the decode kernel's rows: every row, or a mixed step's decodes (which its prefill
        # kernel skips); None: none
        self.decode_rows = decode_rows
        # 2 where decodes are always listed (then a step with none compiles no other kernel)
        self.min_query_len = min_query_len

    @property
    def all_decode(self) -> bool:
        return self.context_lens is not None

    def can_store_rotated(self, qkv: torch.Tensor) -> bool:
        """Whether :meth:`rotate_and_store` takes this fused projection: one kernel for rope
        on q and k and the KV store (a cache in the activations' dtype)."""
        return (
            self.kv_cache.kind is None
            and qkv.dtype == self.kv_cache.dtype
            and qkv.dim() == 2
            and qkv.stride(1) == 1
            and (triton_fused.fused_enabled(qkv) or _interpreted(qkv))
        )

    def rotate_and_store(
        self,
        layer_idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rope on q and k of ``qkv`` in place and k, v stored, in one kernel; ``q, k, v``
        views (then :meth:`attend` with ``kv_stored=True``)."""
        k_cache, v_cache = self.kv_cache.layer(layer_idx)
        triton_fused.rope_and_store(
            qkv, cos, sin, k_cache, v_cache, self.slot_mapping, num_heads, num_kv_heads, head_dim
        )
        return split_qkv(qkv, num_heads, num_kv_heads, head_dim)

    def _store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        cache = self.kv_cache
        k_cache, v_cache = cache.layer(layer_idx)
        if cache.kind is None:
            ta.store_kv(k, v, k_cache, v_cache, self.slot_mapping)
            return
        kq, ks = kv_quant.quantize(k, cache.kind)
        vq, vs = kv_quant.quantize(v, cache.kind)
        ta.store_kv(kq, vq, k_cache, v_cache, self.slot_mapping)
        k_scales, v_scales = cache.layer_scales(layer_idx)
        assert k_scales is not None and v_scales is not None
        ta.store_kv(
            ks[..., None],
            vs[..., None],
            k_scales[..., None],
            v_scales[..., None],
            self.slot_mapping,
        )

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """Store ``k, v`` at the step's slots, then attend ``q`` ``[T, H, D]`` through the block
        tables; ``[T, H, D]``."""
        if not kv_stored:
            self._store(layer_idx, k, v)
        cache = self.kv_cache
        k_cache, v_cache = cache.layer(layer_idx)
        k_scales, v_scales = cache.layer_scales(layer_idx)
        common = dict(
            block_size=cache.block_size,
            scale=scale,
            sliding_window=sliding_window,
            k_scales=k_scales,
            v_scales=v_scales,
            kv_kind=cache.kind,
        )
        out, rows = None, self.decode_rows
        if rows is not None:  # the decodes first (a mixed step's prefill kernel skips them)
            out = ta.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                self.tables,
                rows.lens,
                row_ids=rows.ids,
                row_tables=rows.seq,
                num_splits=rows.num_splits,
                workspace=rows.workspace,
                **common,
            )
            if self.all_decode:
                return out
        assert self.query_start is not None and self.num_computed is not None
        if self.tiles is not None:
            tiles = self.tiles
            return ta.paged_prefill_attention_tiles(
                q,
                k_cache,
                v_cache,
                self.tables,
                self.query_start,
                self.num_computed,
                tiles.seq,
                tiles.index,
                tiles.count,
                tiles.num_programs,
                tile_size=tiles.size,
                out=out,
                **common,
            )
        return ta.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            self.tables,
            self.query_start,
            self.num_computed,
            self.max_query_len,
            out=out,
            min_query_len=self.min_query_len,
            **common,
        )


def _ragged(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups of ``lens`` items laid end to end: each item's group and its index in the group::

    lens  : 2 1 3
    group : 0 0 1 2 2 2
    index : 0 1 0 0 1 2             (item - where its group starts)
    """
    group = np.repeat(np.arange(len(lens)), lens)
    return group, np.arange(len(group)) - np.repeat(np.cumsum(lens) - lens, lens)


def _write_rows(array: np.ndarray, rows: list[list[int]]) -> None:
    """``array[i, :len(rows[i])] = rows[i]`` for every row, in one scatter (a numpy assignment
    per row cost ~1 us: ~0.3 ms a step at 256 rows)::

        rows  : [7 3] [9] [4 5 6]       flat 7 3 9 4 5 6 goes to (row, col) = _ragged(2 1 3)
    """
    lens = np.fromiter(map(len, rows), np.int64, len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), array.dtype, int(lens.sum()))
    array[_ragged(lens)] = flat


def prefill_tiles(query_lens: np.ndarray, tile_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The (sequence, query tile) pairs of a step's chunks for
    ``ta.paged_prefill_attention_tiles``, sequence by sequence::

        query_lens  3  1  130      (tile_size 64)
        sequence    0  1  2  2  2
        tile        0  0  0  1  2

    At most ``sum(query_lens) // tile_size + len(query_lens)`` pairs."""
    return _ragged(-(-np.asarray(query_lens, dtype=np.int64) // tile_size))


# Each dtype's fields laid end to end in one buffer, in this order (the tables last: a step
# writes their first rows). A step copies the parts it wrote, parts closer than _MERGE_GAP
# elements in one copy (a copy's host cost, ~11 us, buys ~50 KB of PCIe time).
_INT64_FIELDS = ("ids", "positions", "feed_rows", "feed_sources", "sample_rows", "prompt_rows",
                 "pool_rows")  # fmt: skip
_INT32_FIELDS = ("slots", "context_lens", "query_start", "num_computed", "tiles", "decode_list",
                 "tables")  # fmt: skip
_ALIGN = 32  # elements: every field starts 128-byte aligned (Triton's pointer specializations)
_MERGE_GAP = 4096  # elements (16 or 32 KB): a gap copied rather than a copy more


def merged_ranges(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges sorted, those less than ``gap`` apart (or overlapping) joined::

    (0,4) (100,104) (9000,9004)  gap 4096  ->  (0,104) (9000,9004)
    """
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start - out[-1][1] < gap:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


class StepInputs:
    """Pinned host buffers and their device twins for the step's model inputs (see module doc).

    ``fill`` writes a step on the host; :meth:`stage` writes more index rows beside it; then
    :meth:`upload` copies what was written, non-blocking, parts of a buffer less than
    ``_MERGE_GAP`` apart in one copy (a copy per field cost ~11 us of host time, up to ten a
    step), and records an event. Before it writes the host buffers again, ``fill`` waits for
    that event, so a step with nothing sampled (no synchronisation of its own) cannot have its
    inputs overwritten in flight. The copies of a decode step of r rows fed by the step
    before (``max_rows`` apart: ids, positions and slots hold a step of prompt chunks)::

        int64: ids | positions | feed_rows | feed_sources | sample_rows | prompt_rows | pool_rows
               └1┘   └─2─┘       └────────3─────────┘
        int32: slots | context_lens | query_start | num_computed | tiles | decode_list | tables
               └4┘     └──────────────────────────5────────────────────────────────── [:r] ┘

    Five copies (one per field was seven; a step with prompt chunks also five, was up to ten).
    """

    def __init__(self, shape: StepShape, device: torch.device) -> None:
        self.shape = shape
        self.device = device
        pin = device.type == "cuda"
        sizes = {
            "ids": (shape.max_rows,),
            "positions": (shape.max_rows,),
            "slots": (shape.max_rows,),
            "context_lens": (shape.max_table_rows,),
            "tables": (shape.max_table_rows, shape.max_blocks),
            "query_start": (shape.max_seqs + 1,),
            "num_computed": (shape.max_seqs,),
            # count | sequences | tile indices
            "tiles": (1 + 2 * shape.max_tiles,),
            # query rows | sequences | contexts (a step has at most max_seqs decodes)
            "decode_list": (3 * shape.max_seqs,),
            # rows of the hidden states that go to the LM head (sampled, prompt-logprob rows)
            "sample_rows": (shape.max_rows,),
            "prompt_rows": (shape.max_rows,),
            "pool_rows": (shape.max_rows,),  # (embeddings)
            # a step launched ahead: its rows fed the step before's sampled ids, and from where
            "feed_rows": (shape.max_table_rows,),
            "feed_sources": (shape.max_table_rows,),
        }
        # name -> (dtype, offset in its buffer, elements a row)
        self._where: dict[str, tuple[torch.dtype, int, int]] = {}
        self._buffers: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._written: dict[torch.dtype, list[tuple[int, int]]] = {}
        for dtype, names in ((torch.long, _INT64_FIELDS), (torch.int32, _INT32_FIELDS)):
            offset = 0
            for name in names:
                self._where[name] = (dtype, offset, int(np.prod(sizes[name][1:], dtype=np.int64)))
                offset += -(-int(np.prod(sizes[name], dtype=np.int64)) // _ALIGN) * _ALIGN
            host = torch.zeros(offset, dtype=dtype, pin_memory=pin)
            self._buffers[dtype] = (host, torch.zeros(offset, dtype=dtype, device=device))
            self._written[dtype] = []
        for name, size in sizes.items():
            dtype, offset, _ = self._where[name]
            count = int(np.prod(size, dtype=np.int64))
            host, dev = self._buffers[dtype]
            pair = (
                host[offset : offset + count].view(size),
                dev[offset : offset + count].view(size),
            )
            setattr(self, name, pair)
        # numpy views of the host halves: filled without building tensors
        self._np = {name: getattr(self, name)[0].numpy() for name in sizes}
        self._copied = torch.cuda.Event() if pin else None

    def _wait_for_last_copy(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def _device_rows(self, name: str, n: int) -> torch.Tensor:
        """The device view of ``name``'s first ``n`` rows; their range is marked written, for
        :meth:`upload` to copy (nothing is copied here)."""
        dtype, offset, per_row = self._where[name]
        if n:
            self._written[dtype].append((offset, offset + n * per_row))
        return getattr(self, name)[1][:n]

    def upload(self) -> None:
        """Copy what the step wrote (:meth:`fill`, :meth:`stage`), non-blocking, then record
        the event ``fill`` waits for."""
        for dtype, written in self._written.items():
            host, dev = self._buffers[dtype]
            for start, end in merged_ranges(written, _MERGE_GAP):
                dev[start:end].copy_(host[start:end], non_blocking=True)
            written.clear()
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))

    def discard(self) -> None:
        """Forget what a step that failed before its :meth:`upload` wrote (nothing of it is
        copied): the next step's :meth:`fill` starts clean."""
        for written in self._written.values():
            written.clear()

    def stage(self, name: str, rows: list[int]) -> torch.Tensor:
        """``rows`` (``name``: ``"sample_rows"``, ``"prompt_rows"``, ``"pool_rows"``,
        ``"feed_rows"`` or ``"feed_sources"``) as a device index that the next :meth:`upload`
        copies (a tensor built from a list would be a pageable copy, which waits for the
        forward pass queued before it, and so for the host work meant to overlap it)."""
        n = len(rows)
        if n > getattr(self, name)[0].shape[0]:
            return torch.tensor(rows, dtype=torch.long, device=self.device)
        self._np[name][:n] = rows
        return self._device_rows(name, n)

    def tile_views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The device tile list's parts: sequences ``[max_tiles]``, tile indices
        ``[max_tiles]``, count ``[1]`` (fixed addresses: a mixed graph's inputs)."""
        m, tiles = self.shape.max_tiles, self.tiles[1]
        return tiles[1 : 1 + m], tiles[1 + m :], tiles[:1]

    def decode_row_views(self, entries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A mixed step's decode list: its query rows, sequences and contexts ``[entries]``,
        device views (fixed addresses: a mixed graph's inputs; see :class:`DecodeRows`)."""
        m, dev = self.shape.max_seqs, self.decode_list[1]
        return dev[:entries], dev[m : m + entries], dev[2 * m : 2 * m + entries]

    def decode_context_views(self, rows: int) -> dict[str, torch.Tensor]:
        """The device views a decode-rows step of ``rows`` rows reads (a graph's inputs)."""
        return dict(
            slots=self.slots[1][:rows],
            tables=self.tables[1][:rows],
            context_lens=self.context_lens[1][:rows],
        )

    def fill(
        self,
        token_ids: list[int],
        positions: list[int],
        seqs: list[SequenceSlice],
        block_size: int,
        padded_rows: int | None = None,
        tile_size: int | None = None,
        decode_rows: int | None = None,
        upload: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Write one step; returns ``(input_ids, positions, context fields)`` device views,
        copied to the device at the end (``upload=False``: by the caller's :meth:`upload`,
        after it staged more rows).

        ``padded_rows``: pad to this many rows (a graph bucket) with rows that store nothing
        and attend to nothing. ``tile_size`` (a mixed step): also write its list of query
        tiles of that many queries (:class:`TileList`). ``decode_rows`` (a mixed step): list
        its one-token chunks for the decode kernel (:meth:`decode_row_views`), in no tile;
        0: as many entries as it has (an exact step), n > 0: n entries (a padded step's
        graph), the unused ones of context 0; ``fields["decode_entries"]``: how many (none:
        no list)."""
        assert not any(self._written.values()), "the step before was never uploaded"
        self._wait_for_last_copy()
        n = len(token_ids)
        rows = padded_rows or n
        a = self._np
        a["ids"][:n] = token_ids
        a["positions"][:n] = positions
        # padding rows (a graph bucket's): token 0 at position 0, stored nowhere
        a["ids"][n:rows] = 0
        a["positions"][n:rows] = 0
        a["slots"][n:rows] = -1
        computed = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))
        new = np.fromiter((s.num_new_tokens for s in seqs), np.int64, len(seqs))
        pos = a["positions"][:n]
        seq_of_token = np.repeat(np.arange(len(seqs)), new)
        tables = a["tables"]
        fields: dict
        if is_decode_rows(seqs):
            # one table row per token (a verify chunk repeats its sequence's table)
            _write_rows(tables, [s.block_table for s, k in zip(seqs, new, strict=True)
                                 for _ in range(k)])  # fmt: skip
            blocks = tables[np.arange(n), pos // block_size]
            a["slots"][:n] = blocks * block_size + pos % block_size
            a["context_lens"][:n] = pos + 1
            a["context_lens"][n:rows] = 0
            self._device_rows("tables", rows)
            fields = dict(
                slots=self._device_rows("slots", rows),
                tables=self.tables[1][:rows],
                context_lens=self._device_rows("context_lens", rows),
            )
        else:
            _write_rows(tables, [s.block_table for s in seqs])
            blocks = tables[seq_of_token, pos // block_size]
            a["slots"][:n] = blocks * block_size + pos % block_size
            a["query_start"][0] = 0
            a["query_start"][1 : len(seqs) + 1] = np.cumsum(new)
            a["num_computed"][: len(seqs)] = computed
            fields = {}
            chunks = new
            one = np.flatnonzero(new[seq_of_token] == 1)  # the decodes' rows
            entries = decode_rows or len(one)
            if decode_rows is not None and entries:
                m, k = self.shape.max_seqs, len(one)
                assert k <= entries <= m
                chunks = np.where(new == 1, 0, new)  # the prefill kernel skips them
                for start, values in ((0, one), (m, seq_of_token[one]), (2 * m, pos[one] + 1)):
                    a["decode_list"][start : start + k] = values
                    a["decode_list"][start + k : start + entries] = 0  # unused: writes nothing
                self._device_rows("decode_list", 2 * m + entries)
                fields["decode_entries"] = entries
            if tile_size is not None:
                seq, tile = prefill_tiles(chunks, tile_size)
                k, m, t = len(seq), self.shape.max_tiles, a["tiles"]
                t[0], t[1 : 1 + k], t[1 + m : 1 + m + k] = k, seq, tile
                self._device_rows("tiles", 1 + m + k)
            self._device_rows("tables", len(seqs))
            fields |= dict(
                slots=self._device_rows("slots", rows),
                tables=self.tables[1][: len(seqs)],
                query_start=self._device_rows("query_start", len(seqs) + 1),
                num_computed=self._device_rows("num_computed", len(seqs)),
                max_query_len=int(new.max()),
            )
        ids = self._device_rows("ids", rows)
        positions_t = self._device_rows("positions", rows)
        if upload:
            self.upload()
        return ids, positions_t, fields
