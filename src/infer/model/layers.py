"""Building blocks shared by the model families, and the :class:`CausalLM` base class.

Every model keeps its own parameter layout (fused ``qkv_proj`` and ``gate_up_proj``, GPT-2's
Conv1D weights transposed to ``nn.Linear``) and says, per parameter, which checkpoint tensors
it is made of (:class:`WeightSource`); the loader does the reading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from infer.model.ops import fused_ops
from infer.model.parallel import Shard, TensorParallel, get_tensor_parallel

if TYPE_CHECKING:
    from infer.model.attention import Attention
    from infer.model.spec import ModelSpec


@dataclass(frozen=True)
class WeightSource:
    """How one of our parameters is built from checkpoint tensors.

    ``names`` are read in order; with no ``transform`` one tensor is used as is and several are
    stacked along dim 0 (the fused projections). ``transform`` (float32 in, float32 out) covers
    the rest: Conv1D transposes, Gemma's ``1 + weight`` norms. ``shard`` says how the result
    is cut under tensor parallelism (None: every rank holds all of it).
    """

    names: tuple[str, ...]
    transform: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
    shard: Shard | None = None
    # Only these rows of each tensor are read (picked before anything is converted: a causal
    # reranker's head is 2 rows of a vocabulary projection of 150k).
    rows: tuple[int, ...] | None = None


class CausalLM(nn.Module):
    """A decoder-only language model over a flat batch of tokens.

    Subclasses are built on the meta device from a parsed config, then the loader fills every
    parameter named by :meth:`weight_sources` and calls :meth:`init_buffers`.
    """

    architecture: ClassVar[str]
    # A bidirectional encoder (model/bert.py): it embeds, never generates.
    is_encoder: ClassVar[bool] = False
    # (prefix, replacement) pairs tried when a checkpoint tensor name is not found as is.
    checkpoint_aliases: ClassVar[tuple[tuple[str, str], ...]] = ()
    # Checkpoint tensors read by something other than the model (a ColBERT's projection).
    side_tensors: ClassVar[tuple[str, ...]] = ()
    spec: ModelSpec
    # The tensor-parallel group the model was built under (its layers keep it too).
    tp: TensorParallel = TensorParallel()

    def __init__(self) -> None:
        super().__init__()
        # A sequence classifier's head (the loader adds it; None: a language model).
        self.classifier: ClassifierHead | None = None
        # A token classifier's head over every token's state (model/bert.py; None: none).
        self.token_classifier: nn.Module | None = None

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> Any:
        """Validate ``config.json`` and return this family's frozen config dataclass.

        The result exposes ``num_layers, num_heads, num_kv_heads, head_dim, hidden_size,
        vocab_size, max_position_embeddings``. Raises ``ValueError`` naming a bad field.
        """
        raise NotImplementedError

    def weight_sources(self) -> dict[str, WeightSource]:
        """Our parameter name -> the checkpoint tensors it is made of."""
        raise NotImplementedError

    def init_buffers(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Create non-checkpoint state (rope tables) once the parameters live on ``device``."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention
    ) -> torch.Tensor:
        """``input_ids, positions``: ``[T]`` long -> final hidden states ``[T, hidden]``."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 logits ``[N, vocab]``."""
        raise NotImplementedError

    def vocab_projection_weight(self) -> torch.Tensor:
        """The ``[vocab, hidden]`` weight of the output projection (tied or not)."""
        raise NotImplementedError

    def cuda_graph_safe(self) -> bool:
        """Whether a step's work is fixed by its shape, so a CUDA graph can replay it (False
        for a mixture of experts: which experts run depends on the tokens)."""
        return True

    def project_to_vocab(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden @ W_vocab^T`` in the model's dtype; pre-packed when the runner packed it.

        Under tensor parallelism each rank scores its slice of the vocabulary and the slices
        are gathered, so every rank returns all ``[N, vocab]`` scores."""
        packed = getattr(self, "packed_logits", None)
        if packed is not None:
            logits = packed(hidden)
        else:
            logits = F.linear(hidden, self.vocab_projection_weight())
        if self.tp.size == 1:
            return logits
        return self.tp.gather_vocab(logits, self.spec.vocab_size)


class ClassifierHead(nn.Module):
    """A sequence classifier's ``score`` head: ``[num_labels, hidden]``, no bias, applied to the
    final hidden state of a prompt's last token (transformers' ``*ForSequenceClassification``).

    Not an ``nn.Linear``, so weight quantization and packing pass it by: a few rows whose
    outputs are the answer, kept in the model's dtype. Every tensor-parallel rank holds all of
    it (the final hidden states are whole on each)."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> float32 ``[N, num_labels]`` logits (the product in the model's
        dtype, as transformers computes it)."""
        return F.linear(hidden, self.weight).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` in torch ops, the statistics in float32, rounded to ``x``'s dtype
    before the weight (what the fused kernels round like)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, the statistics in float32.

    Gemma's ``(1 + weight)`` variant is this module with ``1`` folded into the weight at load.
    On CPU bf16 one fused kernel does the whole norm (and the residual add before it, see
    :meth:`add_forward`); elsewhere torch ops round the same way.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x)
        if ops is not None and self.weight.dtype == x.dtype:
            return ops.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, h: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + h, norm(x + h))`` for ``[T, dim]`` activations (``h`` None: ``(x, norm(x))``).

        The decoder carries each layer's output unadded, so the residual add and the next norm
        are one pass over the activations."""
        if h is None:
            return x, self(x)
        ops = fused_ops(x)
        if ops is not None and self.weight.dtype == x.dtype:
            fused = ops.add_rms_norm(x, h, self.weight, self.eps)
            if fused is not None:
                return fused
        x = x + h
        return x, self(x)


def embedding(num_embeddings: int, dim: int, vocab_parallel: bool = False) -> nn.Embedding:
    """An uninitialised ``nn.Embedding`` (the loader fills it); ``vocab_parallel``: this rank's
    slice of the vocabulary under tensor parallelism.

    NOTE: the default init calls ``normal_``, whose first use on the meta device costs seconds
    (it imports torch's reference ops); passing the weight skips it.
    """
    if vocab_parallel:
        num_embeddings = get_tensor_parallel().vocab_rows(num_embeddings)
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function called ``name`` in configs (``ValueError`` if unknown)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


# Activation names -> the name of their fused act(gate) * up kernel.
FUSED_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul (and, on CPU bf16,
    ``act(gate) * up`` in one kernel).

    ``reduce=False`` leaves a tensor-parallel rank's partial sum unreduced (a mixture of
    experts sums its experts first and reduces once); ``width_field`` names the config field of
    ``intermediate`` in the error when the ranks cannot split it."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: str,
        bias: bool,
        *,
        reduce: bool = True,
        width_field: str = "intermediate_size",
    ) -> None:
        super().__init__()
        # Tensor parallelism: gate/up column-parallel, down row-parallel (+ all-reduce).
        self.tp = get_tensor_parallel()
        intermediate = self.tp.local(intermediate, width_field)
        self.intermediate = intermediate
        self.reduce = reduce
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)
        self.fused_act = FUSED_ACTIVATIONS.get(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = None
        if self.fused_act is not None:
            ops = fused_ops(gate_up)
            act = ops.act_mul(gate_up, self.fused_act) if ops is not None else None
        if act is None:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = self.act(gate) * up
        out = self.down_proj(act)
        return self.tp.all_reduce(out) if self.reduce else out


def plus_one(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Fold Gemma's ``(1 + weight)`` norm scale into the stored weight."""
    return tensors[0] + 1.0


def transposed(tensors: list[torch.Tensor]) -> torch.Tensor:
    """GPT-2's Conv1D stores ``[in, out]``; ``nn.Linear`` wants ``[out, in]``."""
    return tensors[0].t().contiguous()
