"""One step's attention metadata over the paged KV cache, built once per step.

Every model layer calls :meth:`AttentionContext.attend` with the step's fresh ``q, k, v``; the
context's backend (``backend.py``: the C++ kernels, the torch reference, or none) writes ``k, v``
into the cache slots of the scheduled tokens and attends each query to its own sequence's
context, read back through the block table.

Slots and blocks (block_size = 4 in the picture)::

    block_table of a request = [7, 2, 9]          (logical block i -> physical block)
    token position p lives in physical block block_table[p // 4] at offset p % 4
    slot(p) = block_table[p // 4] * 4 + p % 4      e.g. p = 5 -> 2 * 4 + 1 = 9

    cache[layer] : [num_blocks * block_size, kv_heads, head_dim]   (one row per slot)

The batch is flat: all scheduled tokens of all sequences, concatenated, ``T`` rows::

    tokens : | seq0 chunk (prefill, 5 tokens) | seq1 (1 decode) | seq2 (1 decode) |
    query_start_loc = [0, 5, 6, 7]

Single-token (decode) sequences are attended in one padded batch; multi-token sequences
(prefill chunks) one at a time, with a causal mask offset by their already-computed tokens.
The contiguous KV backend is this same code with ``block_size = max_model_len`` and one block
per sequence. Gather indices and masks are built once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from infer.core.messages import SequenceSlice
from infer.runner.attention.backend import AttentionBackend, default_backend
from infer.runner.attention.cache import KVCache
from infer.runner.cpu.kernels import PrefillChunks
from infer.runner.cpu.step_inputs import HostStepInputs


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [Bd] rows of the flat batch attended as decode rows (one per token)
    block_tables: torch.Tensor  # [Bd, max_blocks] int32
    context_lens: torch.Tensor  # [Bd] int32, keys per sequence (including the new token)
    block_size: int
    _gather: torch.Tensor | None = None
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @property
    def gather(self) -> torch.Tensor:
        """[Bd, Lmax] slot of each context position (padded with slot 0): the torch path only."""
        if self._gather is None:
            lmax = int(self.context_lens.max())
            width = -(-lmax // self.block_size)  # the blocks that hold the longest context
            tables = self.block_tables[:, :width].long()
            self._gather = _table_slots(tables, self.block_size)[:, :lmax]
        return self._gather

    def mask(self, window: int | None) -> torch.Tensor:
        """[Bd, 1, 1, Lmax] True where the key may be attended."""
        if window not in self.masks:
            lens = self.context_lens.long()[:, None]
            key_pos = torch.arange(self.gather.shape[1], device=lens.device)[None, :]
            ok = key_pos < lens
            if window is not None:
                ok = ok & (key_pos > lens - 1 - window)
            self.masks[window] = ok[:, None, None, :]
        return self.masks[window]


@dataclass
class _PrefillSeq:
    start: int
    end: int
    num_computed: int
    reads_cache: bool  # attends to K/V read back from the cache (a past, or a quantized cache)
    block_table: torch.Tensor  # [1, max_blocks] int32, this sequence's row of the step's tables
    block_size: int
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    _slots: torch.Tensor | None = None

    def slots(self, device: torch.device) -> torch.Tensor | None:
        """[context_len] slots of the context, or None when the chunk's own K/V are attended
        (the SDPA path only: the prefill kernel reads the block table itself)."""
        if self.reads_cache and self._slots is None:
            context = _table_slots(self.block_table.long(), self.block_size)
            self._slots = context[0, : self.num_computed + self.end - self.start].to(device)
        return self._slots

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[n, L] True where query i (position num_computed + i) may see key j; None = causal."""
        if window not in self.masks:
            n = self.end - self.start
            if self.num_computed == 0 and window is None:
                self.masks[window] = None  # plain causal: SDPA's is_causal path
            else:
                L = self.num_computed + n
                q_pos = torch.arange(self.num_computed, L, device=device)[:, None]
                k_pos = torch.arange(L, device=device)[None, :]
                ok = k_pos <= q_pos
                if window is not None:
                    ok = ok & (k_pos > q_pos - window)
                self.masks[window] = ok
        return self.masks[window]


class AttentionContext:
    """Everything attention layers need for one forward pass; built once per step.

    Step preparation is a few tensor operations, not per-token Python: the block tables of the
    step's sequences become one ``[S, max_blocks]`` int32 tensor, and every token's cache slot is
    gathered from it (``slot = table[seq, pos // bs] * bs + pos % bs``).

    ``backend`` computes the attention (default: :func:`default_backend` of the device): decode
    rows on the CPU go to the C++ kernel (:mod:`infer.runner.cpu.kernels`), which reads K and V in
    place through the block tables; elsewhere (CUDA, other dtypes, ``INFER_CPU_KERNELS=0``) the
    contexts are gathered and attended with SDPA.

    ``inputs`` (the runner's, on a CPU): a decode step's metadata is written into those
    fixed buffers (:class:`~infer.runner.cpu.step_inputs.HostStepInputs`) instead of new arrays.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        sequences: list[SequenceSlice],
        device: torch.device | str,
        backend: AttentionBackend | None = None,
        inputs: HostStepInputs | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.sequences = sequences
        self.device = torch.device(device)
        # An encoder's gather index and key mask (None: inputs of one length), or each
        # sequence's rows (attended one by one)
        self._bidirectional: (
            tuple[torch.Tensor, torch.Tensor | None] | list[tuple[int, int]] | None
        ) = None
        self._encoder_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._encoder_keys: torch.Tensor | bool | None = None  # (True: every row is a key)
        self.backend = backend if backend is not None else default_backend(self.device)
        self.prefill_chunks: PrefillChunks | None = None
        self.prefills: list[_PrefillSeq] = []
        bs = kv_cache.block_size
        num_seqs = len(sequences)
        if inputs is None and sequences and all(s.num_new_tokens == 1 for s in sequences):
            # A step of decode rows only (the common one) without the runner's buffers (a
            # draft model, a CUDA torch step, tests): the same arithmetic in arrays of its own.
            widest = max(len(s.block_table) for s in sequences) or 1
            inputs = HostStepInputs(num_seqs, num_seqs, widest)
        if inputs is not None and inputs.decode(sequences, bs):
            # Row i is sequence i's token at position num_computed_tokens: the general path's
            # repeats and gathers reduce to the buffers' few array operations.
            self.num_tokens = num_seqs
            self.slot_mapping = inputs.slots[:num_seqs].to(self.device)
            self.decode_group = _DecodeGroup(
                rows=inputs.rows[:num_seqs].to(self.device),
                block_tables=inputs.tables[:num_seqs].to(self.device),
                context_lens=inputs.context_lens[:num_seqs].to(self.device),
                block_size=bs,
            )
            self._all_decode = True
            return

        max_blocks = max((len(s.block_table) for s in sequences), default=1) or 1
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        new_tokens = np.empty(num_seqs, dtype=np.int64)
        computed = np.empty(num_seqs, dtype=np.int64)
        for i, seq in enumerate(sequences):
            tables[i, : len(seq.block_table)] = seq.block_table
            new_tokens[i] = seq.num_new_tokens
            computed[i] = seq.num_computed_tokens
        block_tables = torch.from_numpy(tables)
        self.num_tokens = int(new_tokens.sum())

        # Every scheduled token's slot: its sequence's table entry for its position.
        seq_of_token = np.repeat(np.arange(num_seqs), new_tokens)
        starts = np.cumsum(new_tokens) - new_tokens
        positions = np.arange(self.num_tokens) - np.repeat(starts - computed, new_tokens)
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        self.slot_mapping = torch.from_numpy(slots).to(self.device)

        as_rows = np.array([s.as_decode_rows for s in sequences], dtype=bool)
        is_decode = (new_tokens == 1) | as_rows
        self.decode_group: _DecodeGroup | None = None
        if is_decode.any():
            # One row per token of the decoding sequences; token j of a sequence sees its
            # context up to and including itself (its K and V are stored before attention).
            idx = np.nonzero(is_decode)[0]
            per_seq = new_tokens[idx]
            seq_rows = np.repeat(idx, per_seq)
            within = np.arange(int(per_seq.sum())) - np.repeat(
                np.cumsum(per_seq) - per_seq, per_seq
            )
            lens = computed[seq_rows] + 1 + within
            self.decode_group = _DecodeGroup(
                rows=torch.from_numpy(starts[seq_rows] + within).to(self.device),
                block_tables=block_tables[torch.from_numpy(seq_rows)].to(self.device),
                context_lens=torch.from_numpy(lens.astype(np.int32)).to(self.device),
                block_size=bs,
            )
        for i in np.nonzero(~is_decode)[0]:
            start, n, past = int(starts[i]), int(new_tokens[i]), int(computed[i])
            # A quantized cache is read back even for a fresh prompt, so a prompt attends to the
            # same (rounded) keys and values however it is chunked.
            reads_cache = past > 0 or kv_cache.quantized
            self.prefills.append(
                _PrefillSeq(start, start + n, past, reads_cache, block_tables[i : i + 1], bs)
            )
        self._all_decode = self.decode_group is not None and not self.prefills
        # Prompt chunks for the C++ prefill kernel (CPU, AVX-512 BF16 or AVX2): one call per layer for
        # every chunk of the step, reading K and V in place through the block tables.
        if self.prefills and self.backend.wants_prefill_chunks:
            pidx = np.nonzero(~is_decode)[0]
            self.prefill_chunks = PrefillChunks(
                q_starts=torch.from_numpy(starts[pidx].astype(np.int64)),
                q_lens=torch.from_numpy(new_tokens[pidx].copy()),
                pasts=torch.from_numpy(computed[pidx].copy()),
                block_tables=torch.from_numpy(np.ascontiguousarray(tables[pidx])),
            )

    @property
    def all_decode(self) -> bool:
        """Every scheduled sequence decodes one token (no prefill chunk in this step)."""
        return self._all_decode

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows' ``[Bd, max_blocks]`` int32 block tables and ``[Bd]`` int32 context
        lengths, one per row (a sequence with several decode rows repeats its table), in the
        order of their rows in the batch."""
        assert self.decode_group is not None
        return self.decode_group.block_tables, self.decode_group.context_lens

    def can_store_rotated(self, qkv: torch.Tensor) -> bool:
        """Whether :meth:`rotate_and_store` can take this fused projection (CPU bf16 kernels)."""
        return self.backend.can_store_rotated(self, qkv)

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
        """Rope on q and k of ``qkv`` ``[T, (H + 2 Hkv) D]`` in place, k and v written to the
        cache, in one kernel; returns ``q, k, v`` views (then call :meth:`attend` with
        ``kv_stored=True``). ``cos, sin``: the step's rope rows, ``[T, 1, D]`` or ``[T, D]``."""
        self.backend.rotate_and_store(
            self, layer_idx, qkv, cos, sin, num_heads, num_kv_heads, head_dim
        )
        return split_qkv(qkv, num_heads, num_kv_heads, head_dim)

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
        """Write ``k, v`` to the cache (unless ``kv_stored``) and return attention output.

        Args:
            q: ``[T, num_heads, head_dim]``; k, v: ``[T, num_kv_heads, head_dim]``.
            scale: multiplier of ``q @ k^T`` (``head_dim ** -0.5`` for most models).
            sliding_window: if set, a query at position p sees keys at positions
                ``p - sliding_window < j <= p``.
            kv_stored: :meth:`rotate_and_store` already wrote this step's k and v.

        Returns:
            ``[T, num_heads, head_dim]``.
        """
        return self.backend.attend(self, layer_idx, q, k, v, scale, sliding_window, kv_stored)

    def attend_bidirectional(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        window: int | None = None,
        distance_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """An encoder's attention: each sequence's tokens attend to all of its tokens (with
        ``window``: those at most that many positions away on either side), none read from or
        written to the cache (every sequence is a whole input: no past). ``q, k, v``
        ``[T, H, D]`` -> ``[T, H, D]``; the backend computes it
        (:meth:`AttentionBackend.bidirectional`).

        ``distance_bias`` ``[H, 2R + 1]`` (R at least the longest input's length - 1): a score
        added by how far a key sits from its query (MPNet's relative position buckets, ALiBi's
        slopes)::

            score(h, i, j) = scale * q_i . k_j + distance_bias[h, (j - i) + R]

            j - i :  -R ... -1   0   1 ... R
            column:   0 ... R-1  R  R+1 ... 2R
        """
        return self.backend.bidirectional(self, q, k, v, scale, window, distance_bias)

    def encoder_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's first row and row count, int64 on the host (an encoder's step:
        whole inputs only; made once a step)."""
        if self._encoder_rows is None:
            if any(s.num_computed_tokens for s in self.sequences):
                raise RuntimeError("an encoder's input ran in pieces: it must run whole")
            lens = torch.tensor([s.num_new_tokens for s in self.sequences], dtype=torch.int64)
            self._encoder_rows = (torch.cumsum(lens, 0) - lens, lens)
        return self._encoder_rows

    def encoder_keys(self) -> torch.Tensor | None:
        """Each sequence's count of rows that are keys (int64 on the host: its first ones;
        :attr:`SequenceSlice.num_keys`), None where every row of every sequence is one."""
        if self._encoder_keys is None:  # (made once a step)
            self._encoder_keys = all(s.num_keys is None for s in self.sequences) or torch.tensor(
                [s.num_new_tokens if s.num_keys is None else s.num_keys for s in self.sequences],
                dtype=torch.int64)  # fmt: skip
        return None if self._encoder_keys is True else self._encoder_keys

    def padded_layout(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | list[tuple[int, int, int]]:
        """How the torch reference batches an encoder's step (made once a step): sequences
        padded to the longest into one SDPA call, padded keys masked out::

            rows   | a0 a1 a2 | b0 b1 |        index  [[0, 1, 2],     valid [[1, 1, 1],
                                                       [3, 4, 0]]            [1, 1, 0]]

        (the gather index, the rows' mask and the keys' mask: None for inputs of one length;
        the keys' differs where a sequence's last rows are no keys, :meth:`encoder_keys`),
        unless padding would more than double the rows (one long input beside many short
        ones): then each sequence's rows ``(start, end, keys)``, one SDPA call each."""
        if self._bidirectional is None:
            starts, lens = (t.numpy() for t in self.encoder_rows())
            key_lens = self.encoder_keys()
            keys = lens if key_lens is None else key_lens.numpy()
            width = int(lens.max())
            if width * len(lens) > 2 * int(lens.sum()):
                self._bidirectional = [(int(a), int(a + n), int(k)) for a, n, k in
                                       zip(starts, lens, keys, strict=True)]  # fmt: skip
            else:
                pos = np.arange(width)[None, :]
                valid = pos < lens[:, None]
                index = np.where(valid, starts[:, None] + pos, 0)
                mask = None if valid.all() else torch.from_numpy(valid).to(self.device)
                seen = pos < keys[:, None]
                key_mask = mask if key_lens is None else torch.from_numpy(seen).to(self.device)
                self._bidirectional = (torch.from_numpy(index).to(self.device), mask, key_mask)
        return self._bidirectional


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[T, (H + 2 Hkv) D]`` fused projection -> ``q [T, H, D], k, v [T, Hkv, D]`` views."""
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(t, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(t, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(t, num_kv_heads, head_dim)
    return q, k, v


def _table_slots(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[S, max_blocks]`` block ids -> ``[S, max_blocks * block_size]`` slot of each position."""
    offsets = torch.arange(block_size, device=block_tables.device)
    return (block_tables[:, :, None] * block_size + offsets).flatten(1)


def dense_context(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    num_tokens: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> AttentionContext:
    """A context for one fresh sequence of ``num_tokens`` (no past): full causal attention.

    Convenience for tests and training-free forward passes outside the engine.
    """
    cache = KVCache(num_layers, 1, max(num_tokens, 1), num_kv_heads, head_dim, dtype, device)
    return AttentionContext(cache, [SequenceSlice(0, num_tokens, [0])], device)
