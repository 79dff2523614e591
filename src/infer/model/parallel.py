"""This process's place in a tensor-parallel group, and the collectives the model layers call.

With ``--tensor-parallel-size N`` every rank holds a slice of each weight matrix::

    column-parallel (qkv, gate/up):  W [out, in] -> rows    out/N per rank  (no communication)
    row-parallel (o_proj, down):     W [out, in] -> columns in/N  per rank  -> all-reduce (sum)
    vocab-parallel (embed, LM head): W [V, h]    -> rows    ceil(V/N) per rank
        embed: each rank looks up the ids it owns, zeros the rest  -> all-reduce (sum)
        head:  each rank scores its ids                            -> all-gather, cut to V

So a layer costs two all-reduces of ``[tokens, hidden]`` (after attention, after the MLP) and
the KV cache of a rank holds only its ``num_kv_heads / N`` heads. The group is set for the
process (:func:`set_tensor_parallel`) before the model is built; each layer keeps the one it
was built under, to size its slices and to reduce at run time (so a one-rank model can run in
the same process as a tensor-parallel one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallel:
    """``rank`` of ``size``; ``group`` is the torch.distributed group of the model's
    collectives (gloo on CPU, NCCL on CUDA), None when ``size`` is 1."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def local(self, n: int, what: str) -> int:
        """``n / size``, or a ``ValueError`` naming ``what`` when it does not divide."""
        if n % self.size:
            raise ValueError(
                f"tensor_parallel_size {self.size} does not divide {what}={n}: choose a size "
                f"that divides the number of attention heads, KV heads and MLP width"
            )
        return n // self.size

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of the vocabulary each rank holds (the last rank's tail is padding)."""
        return -(-vocab_size // self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (a no-op without tensor parallelism)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of a vocab-parallel embedding: ``weight`` is this rank's ``[V/N, h]`` slice."""
        if self.size == 1:
            return torch.nn.functional.embedding(ids, weight)
        rows = weight.shape[0]
        local = ids - self.rank * rows
        foreign = (local < 0) | (local >= rows)
        out = torch.nn.functional.embedding(local.masked_fill(foreign, 0), weight)
        out.masked_fill_(foreign.unsqueeze(-1), 0)
        return self.all_reduce(out)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[N, V/N]`` scores of this rank's ids -> ``[N, V]`` on every rank."""
        if self.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        torch.distributed.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]


_CURRENT = TensorParallel()


def get_tensor_parallel() -> TensorParallel:
    """The group this process belongs to (size 1 unless :func:`set_tensor_parallel` ran)."""
    return _CURRENT


def set_tensor_parallel(tp: TensorParallel) -> None:
    global _CURRENT
    _CURRENT = tp


def check_tensor_parallel(size: int, spec: Any) -> None:
    """A ``ValueError`` naming the first shape of ``spec`` (a ModelSpec) ``size`` cannot split."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    tp = TensorParallel(size=size)
    tp.local(spec.num_heads, "num_attention_heads")
    tp.local(spec.num_kv_heads, "num_key_value_heads")


@dataclass(frozen=True)
class Shard:
    """How a parameter is cut across ranks at load (see the module docstring).

    ``dim`` 0 cuts output rows (column- and vocab-parallel), 1 input columns (row-parallel).
    A parameter fused from several checkpoint tensors (q, k, v) has each piece cut on its own;
    ``parts`` splits a single checkpoint tensor that is itself such a fusion (GPT-2's
    ``c_attn``) into equal pieces first. ``pad`` rounds rows up to a multiple of the size
    (the vocabulary). ``first_rank_only`` keeps a row-parallel bias on rank 0 and zeros it
    elsewhere, so the all-reduce adds it once.
    """

    dim: int = 0
    parts: int = 1
    pad: bool = False
    first_rank_only: bool = False

    def cut(self, pieces: list[torch.Tensor], tp: TensorParallel) -> list[torch.Tensor]:
        """This rank's share of each piece, in order."""
        if tp.size == 1:
            return pieces
        if self.first_rank_only:
            return pieces if tp.rank == 0 else [torch.zeros_like(p) for p in pieces]
        if self.parts > 1:
            pieces = [q for p in pieces for q in p.chunk(self.parts, dim=self.dim)]
        out = []
        for p in pieces:
            n = p.shape[self.dim]
            rows = tp.vocab_rows(n) if self.pad else tp.local(n, f"a weight dimension ({n})")
            start = tp.rank * rows
            piece = p.narrow(self.dim, min(start, n), max(min(rows, n - start), 0))
            if piece.shape[self.dim] < rows:  # the vocabulary's padding rows
                shape = list(piece.shape)
                shape[self.dim] = rows - piece.shape[self.dim]
                piece = torch.cat([piece, piece.new_zeros(shape)], dim=self.dim)
            out.append(piece)
        return out


COLUMN = Shard(dim=0)
ROW = Shard(dim=1)
VOCAB = Shard(dim=0, pad=True)
ROW_BIAS = Shard(first_rank_only=True)
