"""Attention over a paged KV cache, in plain torch (CPU and CUDA).

Every model layer calls :meth:`AttentionContext.attend` with the step's fresh ``q, k, v``; the
context writes ``k, v`` into the cache slots of the scheduled tokens and attends each query
to its own sequence's context, read back through the block table.

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
import torch.nn.functional as F

from infer.core.messages import SequenceSlice
from infer.kv_cache.sizing import check_kv_cache_dtype
from infer.runner import hugepages, kv_quant
from infer.runner.kernels import PrefillChunks, cpu_kernels


class KVCache:
    """K and V for every layer: ``[2, num_layers, num_blocks * block_size, kv_heads, head_dim]``.

    With ``kv_dtype`` ``"int8"`` or ``"fp8"`` the values are one byte each and ``scales``
    ``[2, num_layers, num_slots, kv_heads]`` (bf16) holds each row's scale
    (:mod:`infer.runner.kv_quant`); ``dtype`` is then the dtype values are read back in.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_dtype: str = "auto",
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.kind = check_kv_cache_dtype(kv_dtype)
        num_slots = num_blocks * block_size
        storage = dtype if self.kind is None else kv_quant.STORAGE_DTYPES[self.kind]
        self.tensor = hugepages.zeros(
            2, num_layers, num_slots, num_kv_heads, head_dim, dtype=storage, device=device
        )
        self.scales: torch.Tensor | None = None
        if self.kind is not None:
            self.scales = torch.zeros(
                2, num_layers, num_slots, num_kv_heads, dtype=kv_quant.SCALE_DTYPE, device=device
            )

    @property
    def quantized(self) -> bool:
        return self.kind is not None

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K and V of one layer (one-byte values when quantized)."""
        return self.tensor[0, layer_idx], self.tensor[1, layer_idx]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.scales is None:
            return None, None
        return self.scales[0, layer_idx], self.scales[1, layer_idx]

    def store(self, layer_idx: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v`` ``[T, kv_heads, head_dim]`` at ``slots`` (quantizing them if needed)."""
        k_cache, v_cache = self.layer(layer_idx)
        if self.kind is None:
            k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
            return
        k_scales, v_scales = self.layer_scales(layer_idx)
        assert k_scales is not None and v_scales is not None
        for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
            values, scale = kv_quant.quantize(x, self.kind)
            cache.index_copy_(0, slots, values)
            scales.index_copy_(0, slots, scale)

    def gather(self, layer_idx: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[len(slots), kv_heads, head_dim]`` at ``slots``, in ``dtype``."""
        k_cache, v_cache = self.layer(layer_idx)
        ks = k_cache.index_select(0, slots)
        vs = v_cache.index_select(0, slots)
        if self.kind is None:
            return ks.to(self.dtype), vs.to(self.dtype)
        k_scales, v_scales = self.layer_scales(layer_idx)
        assert k_scales is not None and v_scales is not None
        return (
            kv_quant.dequantize(ks, k_scales.index_select(0, slots), self.kind, self.dtype),
            kv_quant.dequantize(vs, v_scales.index_select(0, slots), self.kind, self.dtype),
        )

    def block_views(self) -> list[torch.Tensor]:
        """Every stored tensor as ``[2, num_layers, num_blocks, block_size, ...]`` views: what a
        block swap copies."""
        views = []
        for t in (self.tensor, self.scales):
            if t is not None:
                views.append(t.view(2, t.shape[1], self.num_blocks, self.block_size, *t.shape[3:]))
        return views


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
            self._gather = _table_slots(self.block_tables.long(), self.block_size)[:, :lmax]
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

    Decode rows on the CPU go to the C++ kernel (:mod:`infer.runner.kernels`), which reads K and V
    in place through the block tables; elsewhere (CUDA, other dtypes, ``INFER_CPU_KERNELS=0``)
    the contexts are gathered and attended with SDPA.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        sequences: list[SequenceSlice],
        device: torch.device | str,
    ) -> None:
        self.kv_cache = kv_cache
        self.sequences = sequences
        self.device = torch.device(device)
        bs = kv_cache.block_size
        num_seqs = len(sequences)

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
        self._kernels = cpu_kernels() if self.device.type == "cpu" else None
        self._chunks: PrefillChunks | None = None
        self._prefills: list[_PrefillSeq] = []
        if num_seqs and (new_tokens == 1).all():  # one new token each: all decode rows
            self._init_all_decode(block_tables, tables, computed)
            return

        # Every scheduled token's slot: its sequence's table entry for its position.
        seq_of_token = np.repeat(np.arange(num_seqs), new_tokens)
        starts = np.cumsum(new_tokens) - new_tokens
        positions = np.arange(self.num_tokens) - np.repeat(starts - computed, new_tokens)
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        self.slot_mapping = torch.from_numpy(slots).to(self.device)

        as_rows = np.array([s.as_decode_rows for s in sequences], dtype=bool)
        is_decode = (new_tokens == 1) | as_rows
        self._decode: _DecodeGroup | None = None
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
            self._decode = _DecodeGroup(
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
            self._prefills.append(
                _PrefillSeq(start, start + n, past, reads_cache, block_tables[i : i + 1], bs)
            )
        self._all_decode = self._decode is not None and not self._prefills
        # Prompt chunks for the C++ prefill kernel (CPU, AVX-512 BF16 or AVX2): one call per layer for
        # every chunk of the step, reading K and V in place through the block tables.
        if self._prefills and self._kernels is not None and self._kernels.has_prefill_attention:
            pidx = np.nonzero(~is_decode)[0]
            self._chunks = PrefillChunks(
                q_starts=torch.from_numpy(starts[pidx].astype(np.int64)),
                q_lens=torch.from_numpy(new_tokens[pidx].copy()),
                pasts=torch.from_numpy(computed[pidx].copy()),
                block_tables=torch.from_numpy(np.ascontiguousarray(tables[pidx])),
            )

    def _init_all_decode(
        self, block_tables: torch.Tensor, tables: np.ndarray, computed: np.ndarray
    ) -> None:
        """A step of decode rows only (the common one): row i is sequence i's token at position
        ``computed[i]``; the general path's repeats and gathers reduce to this. Python here runs
        with caches the kernels left cold, so every operation saved counts several times over."""
        bs = self.kv_cache.block_size
        seq = np.arange(len(computed), dtype=np.int64)
        slots = tables[seq, computed // bs].astype(np.int64) * bs + computed % bs
        self.slot_mapping = torch.from_numpy(slots).to(self.device)
        self._decode = _DecodeGroup(
            rows=torch.from_numpy(seq).to(self.device),
            block_tables=block_tables.to(self.device),
            context_lens=torch.from_numpy((computed + 1).astype(np.int32)).to(self.device),
            block_size=bs,
        )
        self._all_decode = True

    @property
    def all_decode(self) -> bool:
        """Every scheduled sequence decodes one token (no prefill chunk in this step)."""
        return self._all_decode

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows' ``[Bd, max_blocks]`` int32 block tables and ``[Bd]`` int32 context
        lengths, one per row (a sequence with several decode rows repeats its table), in the
        order of their rows in the batch."""
        assert self._decode is not None
        return self._decode.block_tables, self._decode.context_lens

    def can_store_rotated(self, qkv: torch.Tensor) -> bool:
        """Whether :meth:`rotate_and_store` can take this fused projection (CPU bf16 kernels)."""
        return (
            self._kernels is not None
            and qkv.dtype == torch.bfloat16
            and self.kv_cache.dtype == torch.bfloat16
            and qkv.dim() == 2
            and qkv.stride(1) == 1
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
        """Rope on q and k of ``qkv`` ``[T, (H + 2 Hkv) D]`` in place, k and v written to the
        cache, in one kernel; returns ``q, k, v`` views (then call :meth:`attend` with
        ``kv_stored=True``). ``cos, sin``: the step's rope rows, ``[T, 1, D]`` or ``[T, D]``."""
        assert self._kernels is not None
        self._kernels.rope_write_kv(
            qkv,
            cos.contiguous(),
            sin.contiguous(),
            self.kv_cache,
            layer_idx,
            self.slot_mapping,
            num_heads,
            num_kv_heads,
            head_dim,
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
        if not kv_stored:
            kernels = self._kernels
            if kernels is not None and kernels.can_store_kv(k, self.kv_cache):
                kernels.store_kv(k, v, self.kv_cache, layer_idx, self.slot_mapping)
            else:
                self.kv_cache.store(layer_idx, self.slot_mapping, k, v)
        gqa = q.shape[1] != k.shape[1]

        if self._all_decode:
            return self._attend_decode(layer_idx, q, scale, sliding_window, gqa)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self._decode is not None:
            rows = self._decode.rows
            out[rows] = self._attend_decode(layer_idx, q[rows], scale, sliding_window, gqa)
        kernels = self._kernels
        if (
            self._chunks is not None
            and kernels is not None
            and kernels.can_prefill(q, self.kv_cache)
        ):
            kernels.prefill_attention(
                q, out, self.kv_cache, layer_idx, self._chunks, scale, sliding_window
            )
            return out
        for pf in self._prefills:
            qs = q[pf.start : pf.end].transpose(0, 1)  # [H, n, D]
            slots = pf.slots(self.device)
            if slots is None:
                ks = k[pf.start : pf.end].transpose(0, 1)
                vs = v[pf.start : pf.end].transpose(0, 1)
            else:
                kg, vg = self.kv_cache.gather(layer_idx, slots)
                ks, vs = kg.transpose(0, 1), vg.transpose(0, 1)  # [Hkv, L, D]
            mask = pf.mask(sliding_window, self.device)
            # NOTE: 4-D inputs: with 3-D ones CPU SDPA falls back to its slow math kernel
            # (~8x slower for a 512-token bf16 prefill).
            o = F.scaled_dot_product_attention(
                qs[None],
                ks.to(qs.dtype)[None],
                vs.to(qs.dtype)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=gqa,
            )[0]
            out[pf.start : pf.end] = o.transpose(0, 1)
        return out

    def _attend_decode(
        self, layer_idx: int, q: torch.Tensor, scale: float, window: int | None, gqa: bool
    ) -> torch.Tensor:
        dg = self._decode
        assert dg is not None
        kernels = self._kernels
        cache = self.kv_cache
        if kernels is not None and q.dtype == cache.dtype and kernels.supports(q.dtype):
            return kernels.decode_attention(
                q,
                cache,
                layer_idx,
                dg.block_tables,
                dg.context_lens,
                scale,
                window,
            )
        # index_select on the flat slot list is ~2x faster on CPU than advanced indexing.
        bd, lmax = dg.gather.shape
        ks, vs = cache.gather(layer_idx, dg.gather.reshape(-1))
        ks = ks.view(bd, lmax, *ks.shape[1:]).transpose(1, 2)
        vs = vs.view(bd, lmax, *vs.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [Bd, H, 1, D]
            ks.to(q.dtype),
            vs.to(q.dtype),
            attn_mask=dg.mask(window),
            scale=scale,
            enable_gqa=gqa,
        )
        return o[:, :, 0, :]


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
