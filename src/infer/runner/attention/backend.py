"""The attention backends' one small interface, and the order a step's attention runs in.

A backend is chosen once per runner (:func:`default_backend`, or set: the null backend of the
attention-off measurements) and lent to every step's :class:`AttentionContext`, which holds
the step's metadata (slots, block tables, decode rows, prefill chunks); the backend computes::

    attend(layer, q, k, v)
      store k, v at the step's slots          (unless rotate_and_store already did)
      decode rows  -> decode(...)             one padded batch, one new token each
      prefill rows -> prefill(...)            each chunk against its context, causal

Backends, one per file: ``torch_ref.py`` (gather + SDPA: any device and dtype, the reference),
``cpu.py`` (the C++ kernels, falling back to the reference per call where a kernel does not
take the tensors), ``null.py`` (no attention at all: returns the query). The Triton step has
its own context (``runner/gpu/step.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infer.runner.attention.context import AttentionContext


# The most values of a float mask the torch reference makes for one SDPA call (64 MiB in
# float32): an encoder's bias by distance is made for a block of queries at a time.
MASK_ELEMENTS = 1 << 24


class AttentionBackend:
    """How one step's attention is computed; subclasses say how each part runs."""

    name = "base"
    wants_prefill_chunks = False  # AttentionContext builds PrefillChunks for :meth:`prefill`

    def attend(
        self,
        ctx: AttentionContext,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        kv_stored: bool,
    ) -> torch.Tensor:
        """See :meth:`AttentionContext.attend`."""
        if not kv_stored:
            self.store(ctx, layer_idx, k, v)
        gqa = q.shape[1] != k.shape[1]
        if ctx.all_decode:
            return self.decode(ctx, layer_idx, q, scale, sliding_window, gqa)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        decode = ctx.decode_group
        if decode is not None:
            rows = decode.rows
            out[rows] = self.decode(ctx, layer_idx, q[rows], scale, sliding_window, gqa)
        self.prefill(ctx, layer_idx, q, k, v, out, scale, sliding_window, gqa)
        return out

    def store(
        self, ctx: AttentionContext, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write the step's ``k, v`` ``[T, Hkv, D]`` at its slots."""
        raise NotImplementedError

    def bidirectional(
        self, ctx: AttentionContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        scale: float, window: int | None = None, distance_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """An encoder's attention (:meth:`AttentionContext.attend_bidirectional`), here with
        torch's SDPA on any device and dtype, batched as :meth:`AttentionContext.padded_layout`
        says; ``window``: a query sees the keys at most that many rows away;
        ``distance_bias``: added to the scores by distance, as a float mask made for a block of
        queries at a time (at most :data:`MASK_ELEMENTS` values: a whole one for an 8,192-token
        input would be gigabytes)."""
        sdpa = torch.nn.functional.scaled_dot_product_attention
        layout = ctx.padded_layout()

        def mask_of(width: int, valid: torch.Tensor | None, q0: int, q1: int
                    ) -> torch.Tensor | None:  # fmt: skip
            """SDPA's mask of query rows ``q0 .. q1 - 1`` of ``width`` (``valid`` ``[S, width]``:
            the real keys): True where a key is seen, or the float bias there and -inf where
            not; None: all."""
            pos = torch.arange(width, device=q.device)
            apart = pos[None, :] - pos[q0:q1, None]  # [query, key]: j - i
            seen = None if window is None else (apart.abs() <= window)[None, None]
            if valid is not None:
                keys = valid[:, None, None, :]
                seen = keys if seen is None else seen & keys
                if window is not None:  # (a query past the window from every key: the last)
                    last = pos[None, :] == valid.sum(1, keepdim=True) - 1
                    seen = seen | (~seen.any(-1, keepdim=True) & last[:, None, None, :])
            if distance_bias is None:
                return seen
            reach = distance_bias.shape[1] // 2
            bias = distance_bias.to(q.dtype)[:, apart + reach][None]  # [1, H, rows, width]
            return bias if seen is None else bias.masked_fill(~seen, float("-inf"))

        def attend(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
                   valid: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
            """SDPA of ``[(S,) H, W, D]`` (a 3-D one: one sequence), a block of queries at a
            time where the mask is a float bias."""
            width, heads = qs.shape[-2], qs.shape[-3]
            rows = width
            if distance_bias is not None:
                seqs = qs.shape[0] if qs.dim() == 4 else 1
                rows = max(1, MASK_ELEMENTS // (seqs * heads * width))
            out = torch.empty_like(qs) if rows < width else None
            gqa = ks.shape[-3] != qs.shape[-3]
            if gqa and qs.is_cuda and (valid is not None or window is not None
                                       or distance_bias is not None):  # fmt: skip
                # (CUDA's SDPA kernels that take a mask do not take enable_gqa: it would fall
                # to the math kernel; the kv heads repeated are what it computes)
                group = qs.shape[-3] // ks.shape[-3]
                ks, vs = (t.repeat_interleave(group, dim=-3) for t in (ks, vs))
                gqa = False
            for q0 in range(0, width, rows):
                q1 = min(width, q0 + rows)
                mask = mask_of(width, valid, q0, q1)
                if mask is not None and qs.dim() == 3:
                    mask = mask[0]  # (one sequence: its own [H or 1, rows, width])
                part = sdpa(qs[..., q0:q1, :], ks, vs, attn_mask=mask, scale=scale,
                            enable_gqa=gqa)  # fmt: skip
                if out is None:
                    return part
                out[..., q0:q1, :] = part
            assert out is not None
            return out

        if isinstance(layout, list):  # [H, n, D] per sequence
            out = torch.empty_like(q)
            for a, b, keys in layout:
                rows = [t[a:b].transpose(0, 1) for t in (q, k, v)]
                seen = None if keys == b - a else (torch.arange(b - a, device=q.device) < keys)
                out[a:b] = attend(*rows, None if seen is None else seen[None]).transpose(0, 1)
            return out
        index, valid, keys_valid = layout
        # [S, W, H, D] -> [S, H, W, D]; (inputs of one length, no window or bias: no mask,
        # SDPA's fused kernel)
        qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))
        out = attend(qs, ks, vs, keys_valid).transpose(1, 2)
        return out.reshape(q.shape) if valid is None else out[valid]

    def decode(
        self,
        ctx: AttentionContext,
        layer_idx: int,
        q: torch.Tensor,
        scale: float,
        window: int | None,
        gqa: bool,
    ) -> torch.Tensor:
        """The decode rows' ``q`` ``[Bd, H, D]`` against their contexts -> ``[Bd, H, D]``."""
        raise NotImplementedError

    def prefill(
        self,
        ctx: AttentionContext,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None,
        gqa: bool,
    ) -> None:
        """Each prefill chunk's rows of ``q`` against its context, written into ``out``."""
        raise NotImplementedError

    def can_store_rotated(self, ctx: AttentionContext, qkv: torch.Tensor) -> bool:
        """Whether :meth:`rotate_and_store` takes this fused projection."""
        return False

    def rotate_and_store(
        self,
        ctx: AttentionContext,
        layer_idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        """Rope on q and k of ``qkv`` in place, k and v written to the cache."""
        raise NotImplementedError


def default_backend(device: torch.device) -> AttentionBackend:
    """The C++ kernels on a CPU that has them (a g++, not ``INFER_CPU_KERNELS=0``), else the
    torch reference."""
    from infer.runner.attention.torch_ref import TORCH_ATTENTION

    if device.type == "cpu":
        from infer.runner.attention.cpu import cpu_attention

        backend = cpu_attention()
        if backend is not None:
            return backend
    return TORCH_ATTENTION
