"""The forward pass of a step on a GPU: step buffers, Triton attention, CUDA graphs.

::

    StepBatch ─ StepInputs.fill (pinned host -> fixed device buffers, non-blocking)
        decode rows, fits a row bucket         ─► graphs.replay(bucket)[:n]
        mixed, fits a token bucket (opt-in)    ─► mixed_graphs.replay(bucket)[:n]
        otherwise                              ─► model(ids, positions, context) eagerly

A mixed step (prompt chunks beside decodes) is what a server runs whenever a request arrives:
eagerly, its forward pass is some ten kernel launches from Python per layer. With
``INFER_MIXED_GRAPHS=1`` those of up to ``MAX_MIXED_TOKENS`` tokens run padded to a token
bucket and attend through the fixed-grid prefill kernel (the step's query tiles read from a
buffer), so a CUDA graph per bucket replays any of them. Opt-in until a GPU run measures it.
Padded or not, a mixed step's one-token chunks (its decodes) attend through the decode kernel
first and the prefill kernel skips them (``INFER_MIXED_DECODE_ROWS=0``: all through the
prefill kernel).

No step synchronises here: the sampler's one device-to-host copy of the sampled ids is the
step's only wait on the GPU.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from infer.runner.gpu import triton_attention as ta
from infer.runner.gpu import triton_gemv as tg
from infer.runner.gpu.graphs import StepGraphs, bucket, capture_sizes, mixed_capture_sizes
from infer.runner.gpu.step import (
    DecodeRows,
    GpuAttentionContext,
    StepInputs,
    StepShape,
    TileList,
    is_decode_rows,
)

if TYPE_CHECKING:
    from infer.runner.attention import KVCache
    from infer.runner.runner import StepBatch, TokenFeed

logger = logging.getLogger(__name__)

MAX_GRAPH_ROWS = 512
"""Decode steps of more rows than this run eagerly (vLLM's default capture limit)."""

MIXED_GRAPHS_ENV = "INFER_MIXED_GRAPHS"
"""``1``: mixed steps run padded to token buckets and replay CUDA graphs (see the module doc)."""

MIXED_DECODE_ROWS_ENV = "INFER_MIXED_DECODE_ROWS"
"""``0``: a mixed step's one-token chunks go through the prefill kernel too, not the decode
kernel (``step.py``'s module doc; to measure the two)."""

MAX_MIXED_TOKENS = 512
"""Mixed steps of more tokens than this run eagerly (their launches are a small share)."""

MAX_SPLITS = 32
"""The most parts the decode kernel cuts one row's keys into (batch 1 at a long context)."""


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def mixed_graphs_enabled() -> bool:
    """Whether mixed steps are padded to token buckets and replayed (``INFER_MIXED_GRAPHS=1``)."""
    return os.environ.get(MIXED_GRAPHS_ENV, "0") == "1"


def mixed_decode_rows_enabled() -> bool:
    """Whether a mixed step attends its one-token chunks with the decode kernel (default;
    ``INFER_MIXED_DECODE_ROWS=0``: through the prefill kernel with the rest)."""
    return os.environ.get(MIXED_DECODE_ROWS_ENV, "1") != "0"


def tile_programs(units: int, device: torch.device) -> int:
    """Programs of the fixed-grid prefill kernel for a bucket of at most ``units`` (tile, head)
    units: four per multiprocessor (each walks its share of the step's units), fewer when the
    bucket cannot have that many; under the interpreter a few, so that programs loop."""
    if device.type != "cuda":
        return min(units, 5)
    return max(1, min(units, 4 * _multiprocessors(device)))


def decode_splits(rows: int, num_kv_heads: int, device: torch.device) -> int:
    """How many parts the decode kernel cuts each row's keys into for a step of ``rows`` rows:
    enough programs (rows x kv heads x splits) for two per multiprocessor, so a small batch at
    a long context still fills the GPU. A function of the rows only (a graph bucket's size,
    eager steps included), so graphs and eager steps attend with the same sums; a short row
    leaves its extra splits empty (they exit at once)."""
    if device.type != "cuda":
        return 2 if rows <= 2 else 1  # the interpreter: exercise both passes
    sms = _multiprocessors(device)
    return max(1, min(MAX_SPLITS, -(-2 * sms // (rows * num_kv_heads))))


class CudaStep:
    """Runs a step's forward pass on the Triton backend; see the module doc."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        device: torch.device,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int = 8192,
        num_spec_tokens: int = 0,
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        bs = kv_cache.block_size
        decode_rows = max_num_seqs * (1 + num_spec_tokens)
        spec = model.spec
        tp_size = getattr(model, "tp", None)
        tp_size = tp_size.size if tp_size is not None else 1
        self._heads = spec.num_heads // tp_size
        self._kv_heads = spec.num_kv_heads // tp_size
        self._head_dim = spec.head_dim
        self._tp_size = tp_size
        # Decode steps are sized by bucket whether or not graphs replay them (see _splits);
        # so are mixed steps where they are padded at all (the same kernels either way).
        self.sizes = capture_sizes(min(decode_rows, MAX_GRAPH_ROWS))
        self.mixed_sizes: list[int] = []
        self._mixed_decode_rows = mixed_decode_rows_enabled()
        self._tile_size = ta.prefill_block_m(spec.head_dim, kv_cache.dtype)
        max_tiles = 0
        graph_safe = getattr(model, "cuda_graph_safe", lambda: True)()
        # Padding a mixed step buys nothing where no graph could replay it (a mixture of
        # experts would route the padding rows too); under --enforce-eager it still pads, so
        # its tokens are the graphs'.
        if mixed_graphs_enabled() and tp_size == 1 and graph_safe:
            self.mixed_sizes = mixed_capture_sizes(min(max_num_batched_tokens, MAX_MIXED_TOKENS))
            max_tiles = self._max_tiles(self.mixed_sizes[-1], max_num_seqs)
        self.shape = StepShape(
            max_rows=max(max_num_batched_tokens + max_model_len, decode_rows),
            max_table_rows=max(decode_rows, max_num_seqs),
            max_seqs=max_num_seqs,
            max_blocks=-(-max_model_len // bs),
            max_tiles=max_tiles,
        )
        self.inputs = StepInputs(self.shape, device)
        # The last step's LM-head row indices on the device (see forward).
        self._staged: dict[str, torch.Tensor] = {}
        self.graphs: StepGraphs | None = None
        self.mixed_graphs: StepGraphs | None = None
        # Steps by how they ran ("decode replayed", "mixed padded", "eager", ...): what share
        # of a load's steps the graphs cover (the bench reports it; close() logs it).
        self.step_kinds: collections.Counter[str] = collections.Counter()
        self.warm_up_seconds = 0.0  # what warm_up took, and its forward passes (the bench's)
        self.warm_up_passes = 0
        if not enforce_eager and tp_size == 1 and graph_safe:
            self.graphs = StepGraphs(self.sizes, device)
            if self.mixed_sizes:
                self.mixed_graphs = StepGraphs(self.mixed_sizes, device, "mixed steps")
        elif not graph_safe and not enforce_eager:
            logger.info("no CUDA graphs: the model's experts are chosen per step (eager decode)")
        # Skinny matmuls for the small decode buckets, picked by timing (opt-in: triton_gemv).
        self.gemv_picks: list[str] = []
        if tg.enabled() and device.type == "cuda" and tp_size == 1:
            t = time.perf_counter()
            self.gemv_picks = tg.install(model, [s for s in self.sizes if s <= tg.MAX_ROWS])
            logger.info("skinny matmuls picked in %.1fs: %s", time.perf_counter() - t,
                        "; ".join(self.gemv_picks))  # fmt: skip
        # Split-K buffers per number of splits, each sized for the most rows that use it.
        rows_for: dict[int, int] = {}
        for rows in range(1, self.shape.max_table_rows + 1):
            rows_for[self._splits(rows)] = rows
        self._workspaces = {
            splits: ta.decode_workspace(rows, self._heads, self._head_dim, splits, device)
            for splits, rows in rows_for.items()
            if splits > 1
        }

    def _max_tiles(self, tokens: int, max_seqs: int) -> int:
        """The most query tiles a mixed step of ``tokens`` tokens can have: a tile per
        ``_tile_size`` queries, plus one part-filled tile per sequence."""
        return tokens // self._tile_size + min(tokens, max_seqs)

    def _splits(self, rows: int) -> int:
        """Decode splits for a step of ``rows`` rows: by its graph bucket's size when it has one
        (so an eager step attends as its padded replay would)."""
        return decode_splits(bucket(self.sizes, rows) or rows, self._kv_heads, self.device)

    def _decode_args(self, rows: int) -> dict:
        splits = self._splits(rows)
        workspace = self._workspaces.get(splits) if splits > 1 else None
        if splits > 1 and (workspace is None or workspace.acc.shape[0] < rows):
            workspace = ta.decode_workspace(rows, self._heads, self._head_dim, splits, self.device)
        return dict(num_splits=splits, workspace=workspace)

    def _bucket_forward(self, rows: int) -> torch.Tensor:
        """The model on the buffers' first ``rows`` decode rows (what a graph captures)."""
        ctx = GpuAttentionContext(
            self.kv_cache,
            num_tokens=rows,
            **self._decode_args(rows),
            **self.inputs.decode_context_views(rows),
        )
        return self.model(self.inputs.ids[1][:rows], self.inputs.positions[1][:rows], ctx)

    def _decode_entries(self, tokens: int) -> int:
        """Entries of a padded mixed step's decode list: the most decodes ``tokens`` rows of
        ``max_num_seqs`` sequences can hold."""
        return min(tokens, self.shape.max_seqs)

    def _decode_rows(self, inputs: StepInputs, entries: int | None) -> DecodeRows | None:
        """A mixed step's decode list of ``entries`` entries for the decode kernel, split over
        the key axis as a decode step of that many rows would be (None: no list)."""
        if not entries or not self._mixed_decode_rows:
            return None
        return DecodeRows(*inputs.decode_row_views(entries), **self._decode_args(entries))

    def _mixed_forward(self, tokens: int) -> torch.Tensor:
        """The model on the buffers' first ``tokens`` rows as a mixed step, attending through
        the tile list and (by default) its decodes through the decode kernel's list (what a
        mixed graph captures)."""
        inputs, seqs = self.inputs, self.shape.max_seqs
        tiles = TileList(
            *inputs.tile_views(),
            tile_programs(self._max_tiles(tokens, seqs) * self._heads, self.device),
            self._tile_size,
        )
        ctx = GpuAttentionContext(
            self.kv_cache,
            num_tokens=tokens,
            slots=inputs.slots[1][:tokens],
            tables=inputs.tables[1][:seqs],
            query_start=inputs.query_start[1][: seqs + 1],
            num_computed=inputs.num_computed[1][:seqs],
            tiles=tiles,
            decode_rows=self._decode_rows(inputs, self._decode_entries(tokens)),
        )
        return self.model(inputs.ids[1][:tokens], inputs.positions[1][:tokens], ctx)

    def _pad_buffers(self) -> None:
        """Every step buffer as padding: slots -1 (no KV written), contexts 0 (nothing
        attended), empty tile and decode lists."""
        self.inputs.slots[1].fill_(-1)
        self.inputs.context_lens[1].zero_()
        self.inputs.tiles[1].zero_()
        self.inputs.decode_list[1].zero_()  # every entry unused: row 0, context 0

    def capture(self) -> None:
        """Capture the graphs (start-up; after the KV cache exists)."""
        self._pad_buffers()  # capture-time inputs: padding rows only
        if self.graphs is not None:
            self.graphs.capture(self._bucket_forward)
        if self.mixed_graphs is not None:
            pool = self.graphs.pool if self.graphs is not None else None
            self.mixed_graphs.capture(self._mixed_forward, pool=pool)

    @torch.inference_mode()
    def warm_up(self) -> int:
        """Launch, once, each kernel variant a step can run outside the captured graphs, so
        that Triton compiles it at start-up rather than in the middle of the first request
        that needs it (a second or so a variant on a machine whose Triton cache lacks it).

        The variants: the decode kernel's per number of key splits, over a mixed step's
        decode list (eager mixed steps), and over decode buckets and padded mixed steps when
        no graph was captured (``--enforce-eager``); the prefill kernel of mixed steps. Every
        run is padding (no KV written, unused decode entries, a one-token chunk at position 0
        whose output is dropped). A variant that cannot compile fails start-up, not the first
        request that needs it. Not under tensor parallelism: every rank would have to run the
        same collectives. Returns the forward passes run.
        """
        if self._tp_size > 1:
            return 0
        t0 = time.perf_counter()
        runs: list[functools.partial[torch.Tensor]] = []
        if not (self.graphs is not None and self.graphs.graphs):
            runs += [functools.partial(self._bucket_forward, rows)
                     for rows in self._one_per_split(self.sizes)]  # fmt: skip
        if self.mixed_sizes and not (self.mixed_graphs is not None and self.mixed_graphs.graphs):
            padded = (self._one_per_split(self.mixed_sizes, self._decode_entries)
                      if self._mixed_decode_rows else self.mixed_sizes[:1])  # fmt: skip
            runs += [functools.partial(self._mixed_forward, tokens) for tokens in padded]
        listed = self._one_per_split(range(1, self.shape.max_seqs + 1))
        runs += [functools.partial(self._eager_mixed_forward, entries)
                 for entries in (listed if self._mixed_decode_rows else [0])]  # fmt: skip
        self._pad_buffers()
        for run in runs:
            try:
                run()
            except RuntimeError:
                raise
            except Exception as e:  # Triton's CompilationError, OutOfResources, ...
                # (a RuntimeError: what start-up reports in one line, as a bad option)
                raise RuntimeError(f"a Triton kernel of eager steps did not compile: {e}") from e
        self._pad_buffers()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warm_up_seconds, self.warm_up_passes = time.perf_counter() - t0, len(runs)
        logger.info("warmed up the kernels of eager steps (%d forward passes) in %.1fs",
                    len(runs), self.warm_up_seconds)  # fmt: skip
        return len(runs)

    def _one_per_split(
        self, sizes: Iterable[int], entries: Callable[[int], int] | None = None
    ) -> list[int]:
        """The smallest of ``sizes`` for each number of key splits their decodes use
        (``entries``: a size's decode entries, when not the size itself)."""
        first: dict[int, int] = {}
        for size in sizes:
            first.setdefault(self._splits(entries(size) if entries else size), size)
        return sorted(first.values())

    def _eager_mixed_forward(self, entries: int) -> torch.Tensor:
        """An eager mixed step of padding (what :meth:`warm_up` runs): one one-token chunk
        at position 0 (no KV written; the prefill kernel launches, and reads at most table
        row 0's first block) and a decode list of ``entries`` unused entries."""
        inputs = self.inputs
        inputs.ids[1][:1].zero_()
        inputs.positions[1][:1].zero_()
        inputs.tables[1][:1].zero_()
        inputs.query_start[1][:2].copy_(torch.tensor([0, 1]))
        inputs.num_computed[1][:1].zero_()
        ctx = GpuAttentionContext(
            self.kv_cache,
            num_tokens=1,
            slots=inputs.slots[1][:1],
            tables=inputs.tables[1][:1],
            query_start=inputs.query_start[1][:2],
            num_computed=inputs.num_computed[1][:1],
            max_query_len=1,
            decode_rows=self._decode_rows(inputs, entries),
            min_query_len=self._min_query_len,
        )
        return self.model(inputs.ids[1][:1], inputs.positions[1][:1], ctx)

    @property
    def _min_query_len(self) -> int:
        """The shortest chunk the prefill kernel attends in a mixed step (2 where the decode
        kernel takes the one-token chunks: then a step without any compiles no other variant)."""
        return 2 if self._mixed_decode_rows else 1

    def close(self) -> None:
        """Drop the graphs (and their memory pool) now rather than when collected."""
        if self.step_kinds:
            logger.info("steps run: %s", ", ".join(f"{n} {k}" for k, n in self.step_kinds.items()))
        self.graphs = None
        self.mixed_graphs = None

    @property
    def graph_bytes(self) -> int:
        """GPU memory the captures took (their pool, and what their warm-ups first loaded)."""
        return sum(g.capture_bytes for g in (self.graphs, self.mixed_graphs) if g is not None)

    def staged_rows(self, name: str, rows: list[int]) -> torch.Tensor:
        """The device index of the last step's ``rows`` (``"sample_rows"``, ``"prompt_rows"``,
        ``"pool_rows"``),
        as :meth:`forward` copied them before the pass (from the buffers the step used)."""
        staged = self._staged.get(name)
        if staged is None or staged.shape[0] != len(rows):  # (not staged: copy now)
            return torch.tensor(rows, dtype=torch.long, device=self.device)
        return staged

    def _fill_decode_rows(self, decode: bool, size: int | None) -> int | None:
        """``StepInputs.fill``'s ``decode_rows`` for a step: a mixed step's list (a padded
        one's fixed size), none for decode rows or with the switch off."""
        if decode or not self._mixed_decode_rows:
            return None
        return self._decode_entries(size) if size is not None else 0

    def forward(self, batch: StepBatch, feed: TokenFeed | None = None) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the step's ``T`` rows; ``feed``: rows whose
        input ids are taken on the device from the step before's sampled ids."""
        n = len(batch.token_ids)
        seqs = batch.seqs
        decode = is_decode_rows(seqs)
        # A decode step runs padded to its bucket, replayed or not: graphs and eager steps then
        # run the same kernels on the same shapes (cuBLAS picks by shape), so their tokens are
        # the same. Not under tensor parallelism: every rank must reduce the same shapes.
        size = None
        if decode and self._tp_size == 1:
            size = bucket(self.sizes, n)
        elif not decode:  # mixed: padded only with INFER_MIXED_GRAPHS=1
            size = bucket(self.mixed_sizes, n)
        inputs = self.inputs
        width = max(len(s.block_table) for s in seqs)
        rows = size or n
        if not self.shape.covers(rows, len(seqs), rows if decode else len(seqs), width):
            # Larger than planned (a tensor-parallel rank's defaults): buffers for this step.
            table_rows = n if decode else len(seqs)
            inputs = StepInputs(StepShape(n, table_rows, len(seqs), width), self.device)
            size = None
        tile_size = self._tile_size if size is not None and not decode else None
        try:
            ids, positions, fields = inputs.fill(
                batch.token_ids,
                batch.positions,
                seqs,
                self.kv_cache.block_size,
                size,
                tile_size,
                decode_rows=self._fill_decode_rows(decode, size),
                upload=False,
            )
            entries = fields.pop("decode_entries", None)
            if tile_size is not None and self._mixed_decode_rows:
                # the list a padded mixed step's graph reads, all of it written for this step
                assert entries == self._decode_entries(size), (entries, size)
            if feed is not None:
                feed_rows = inputs.stage("feed_rows", feed.rows)
                feed_sources = inputs.stage("feed_sources", feed.sources)
            # The LM head's row indices, copied with the step's inputs, before the forward pass
            # is queued: a copy queued after it would end after it, and the next step's fill
            # (which waits for the last copy out of these pinned buffers) would wait for this
            # whole step.
            self._staged = {}
            if batch.sample_rows and not batch.samples_every_row:
                self._staged["sample_rows"] = inputs.stage("sample_rows", batch.sample_rows)
            if batch.prompt_rows:
                self._staged["prompt_rows"] = inputs.stage("prompt_rows", batch.prompt_rows)
            if batch.pool_rows:
                self._staged["pool_rows"] = inputs.stage("pool_rows", batch.pool_rows)
            inputs.upload()  # two copies: every field above
        except BaseException:
            inputs.discard()  # the step fails; the next one's fill must not find its writes
            raise
        if feed is not None:  # queued after the step before's sampler and the copies above
            ids.index_copy_(0, feed_rows, feed.tokens.index_select(0, feed_sources))
        kind = "decode" if decode else "mixed"
        if size is not None:
            graphs = self.graphs if decode else self.mixed_graphs
            forward = self._bucket_forward if decode else self._mixed_forward
            if graphs is not None and size in graphs.graphs:
                self.step_kinds[f"{kind} replayed"] += 1
                return graphs.replay(size, forward)[:n]
            self.step_kinds[f"{kind} padded"] += 1
            return forward(size)[:n]
        self.step_kinds[f"{kind} eager"] += 1
        ctx = GpuAttentionContext(
            self.kv_cache,
            num_tokens=n,
            **(self._decode_args(n) if decode else {}),
            decode_rows=self._decode_rows(inputs, entries),
            min_query_len=self._min_query_len,
            **fields,
        )
        return self.model(ids, positions, ctx)
