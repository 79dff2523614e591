"""Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE): route each token to its top-k
experts and run only the experts some token chose.

One step's rows through a sparse layer::

    x [T, hidden] ── router ── softmax (float32) ── top-k ── (renormalise over the k)
                                                       │
        experts [T, k] ─ flatten ─ stable sort by expert ─┐   (row, slot) pairs by expert:
                                                          │   e0: rows 2 5   e3: rows 0 2 7 ...
        for each expert with rows (ascending ids):        ▼
            y = expert(x[rows])                   one gated MLP over its rows only
            out.index_add_(rows, y * weight)      in the model's dtype, as transformers adds
        (+ sigmoid(shared_gate(x)) * shared_expert(x))            Qwen2-MoE's shared expert
        ── all-reduce ── out

An expert nobody chose costs nothing, so a batch-1 decode step reads only its k experts'
weights. Each expert is a :class:`GatedMLP` (a fused ``gate_up_proj`` and a ``down_proj``, both
``nn.Linear``), so the CPU's packed bf16 kernels and ``--quantization int8|w8a8`` apply to
experts as to any projection. The router (and the shared expert's gate) are not ``nn.Linear``:
routing stays in the model's dtype, as the reference computes it, whatever the projections are
packed or quantized to.

Routing matches transformers exactly: the softmax over all experts in float32, ``torch.topk``
on those probabilities (so ties go where transformers sends them), the renormalisation in
float32; Mixtral multiplies the expert outputs by the float32 weights, the Qwen models cast the
weights to the model's dtype first. Tokens sum their experts' outputs in ascending expert order,
each product rounded to the model's dtype first (what transformers' loop does).

Tensor parallelism cuts every expert as the dense MLP is cut (gate/up by output rows, down by
input columns; the router and the shared expert's gate replicated), and the layer reduces once,
after all of its experts. On CUDA the grouping reads the per-expert counts back to the host, so
a sparse model's decode steps run without CUDA graphs (:meth:`CausalLM.cuda_graph_safe`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.model.layers import GatedMLP, WeightSource
from infer.model.ops import FusedOps, fused_ops
from infer.model.parallel import COLUMN, ROW, get_tensor_parallel


@dataclass(frozen=True)
class MoEConfig:
    """The experts of a decoder: how many, how routed, which layers have them, and how the
    checkpoint names their tensors (``{layer}.{block}.experts.{e}.{gate|up|down}.weight``)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    float32_weights: bool  # Mixtral: routing weights stay float32 into the product
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP (False)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on gated expert
    checkpoint_block: str = "mlp"  # Mixtral: "block_sparse_moe"
    checkpoint_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    width_field: str = "moe_intermediate_size"  # the config field, for error messages


def _positive_int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def parse_moe(
    config: dict[str, Any],
    num_layers: int,
    *,
    experts_fields: tuple[str, ...],
    width_field: str,
    float32_weights: bool,
    norm_topk_prob: bool | None = None,
    shared_expert: bool = False,
    checkpoint_block: str = "mlp",
    checkpoint_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> MoEConfig:
    """The :class:`MoEConfig` of a ``config.json``; ``ValueError`` naming a bad field.

    The number of experts is the first of ``experts_fields`` the config has (transformers
    writes Qwen3-MoE's as ``num_local_experts``, the published configs ``num_experts``).
    ``norm_topk_prob`` None reads the config's flag (default False); layers are sparse unless
    listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` (Qwen's rule; Mixtral's
    configs have neither, so every layer is sparse)."""
    experts_field = next(
        (f for f in experts_fields if config.get(f) is not None), experts_fields[0]
    )
    num_experts = _positive_int(config, experts_field)
    top_k = _positive_int(config, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(
            f"config.json: num_experts_per_tok={top_k} is larger than "
            f"{experts_field}={num_experts} (a token cannot be routed to more experts than exist)"
        )
    step = config.get("decoder_sparse_step") or 1
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"config.json: decoder_sparse_step must be >= 1, got {step!r}")
    dense = set(config.get("mlp_only_layers") or ())
    if any(not isinstance(i, int) or not 0 <= i < num_layers for i in dense):
        raise ValueError(
            f"config.json: mlp_only_layers {sorted(dense, key=str)} names layers outside "
            f"0..{num_layers - 1}"
        )
    if norm_topk_prob is None:
        norm_topk_prob = bool(config.get("norm_topk_prob", False))
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=_positive_int(config, width_field),
        norm_topk_prob=norm_topk_prob,
        float32_weights=float32_weights,
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        shared_expert_intermediate_size=(
            _positive_int(config, "shared_expert_intermediate_size") if shared_expert else 0
        ),
        checkpoint_block=checkpoint_block,
        checkpoint_projs=checkpoint_projs,
        width_field=width_field,
    )


class GateLinear(nn.Module):
    """``x @ weight^T`` for the router and the shared expert's gate. Deliberately not an
    ``nn.Linear``: packing and quantization replace every ``nn.Linear``, and routing must stay
    in the model's dtype (a router quantized to int8 would send tokens elsewhere)."""

    def __init__(self, hidden: int, out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` router logits -> ``(weights [T, k] float32, experts [T, k] long)``.

    The softmax is over all experts in float32 and ``torch.topk`` picks from those
    probabilities, as transformers does, so ties (equal probabilities) resolve the same way."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class SparseMoE(nn.Module):
    """A sparse layer's MLP: routed experts (plus Qwen2-MoE's gated shared expert); see the
    module doc. Input and output ``[T, hidden]``; the output is reduced over the ranks."""

    def __init__(self, hidden: int, moe: MoEConfig, act: str) -> None:
        super().__init__()
        self.tp = get_tensor_parallel()
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.float32_weights = moe.float32_weights
        self.router = GateLinear(hidden, moe.num_experts)
        self.experts = nn.ModuleList(
            GatedMLP(
                hidden,
                moe.expert_intermediate_size,
                act,
                False,
                reduce=False,
                width_field=moe.width_field,
            )
            for _ in range(moe.num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: GateLinear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(
                hidden, moe.shared_expert_intermediate_size, act, False, reduce=False,
                width_field="shared_expert_intermediate_size",
            )  # fmt: skip
            self.shared_expert_gate = GateLinear(hidden, 1)
        # Rows each expert has run on since load (the load statistics /metrics exports).
        self.expert_rows = torch.zeros(moe.num_experts, dtype=torch.long, device="cpu")
        self._kernel: Any = None  # the device's whole-layer kernel (fused_kernel), or None
        self._kernel_key: tuple | None = None

    def fused_kernel(self, ops: FusedOps) -> Any:
        """The device's whole-layer kernel (``ops.moe_kernel``: on a CPU the C++ layer,
        runner/cpu/moe_kernel.py) for these weights as they are now (packed or quantized at
        load), or None where the torch code runs; built once per set of weights."""
        w = self.router.weight
        key = (ops, self.experts[0].gate_up_proj, self.experts[-1].down_proj, w.dtype,
               w.data_ptr())  # fmt: skip
        if self._kernel_key is None or any(
            a is not b if isinstance(a, nn.Module | FusedOps) else a != b
            for a, b in zip(key, self._kernel_key, strict=True)
        ):
            self._kernel = ops.moe_kernel(self)
            self._kernel_key = key
        return self._kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x) if x.dim() == 2 else None
        if ops is not None:
            kernel = self.fused_kernel(ops)
            if kernel is not None:  # one rank: nothing to reduce
                return kernel(x)
        return self.torch_forward(x)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer in torch ops (any device and dtype; what :meth:`forward` runs unless the
        C++ layer takes the step)."""
        weights, experts = route(self.router(x), self.top_k, self.norm_topk_prob)
        if not self.float32_weights:
            weights = weights.to(x.dtype)
        out = self.experts_forward(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)

    def experts_forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """``sum_j weights[t, j] * expert[experts[t, j]](x[t])`` for every row ``t``, each
        active expert run once over all of its rows."""
        out = torch.zeros_like(x)
        # (row, slot) pairs flattened slot-major and sorted stably by expert: an expert's rows
        # come in transformers' order (by slot, then row), so its matmul sees the same matrix.
        flat = experts.t().reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = order % x.shape[0]
        pair_weights = weights.t().reshape(-1)[order]
        bins = torch.bincount(flat, minlength=self.num_experts)
        counts = bins.tolist()  # one host read
        self.expert_rows += bins.cpu()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = rows[start : start + n]
            y = self.experts[e](x.index_select(0, idx))
            out.index_add_(0, idx, (y * pair_weights[start : start + n, None]).to(out.dtype))
            start += n
        return out


def moe_weight_sources(ours: str, hf_layer: str, moe: MoEConfig) -> dict[str, WeightSource]:
    """Our parameters of one sparse layer's :class:`SparseMoE` (``ours``: its module path) ->
    the checkpoint tensors under ``hf_layer`` (``model.layers.{i}``)."""
    block = f"{hf_layer}.{moe.checkpoint_block}"
    gate, up, down = moe.checkpoint_projs
    src = {f"{ours}.router.weight": WeightSource((f"{block}.gate.weight",))}
    for e in range(moe.num_experts):
        ex = f"{block}.experts.{e}"
        src[f"{ours}.experts.{e}.gate_up_proj.weight"] = WeightSource(
            (f"{ex}.{gate}.weight", f"{ex}.{up}.weight"), shard=COLUMN
        )
        src[f"{ours}.experts.{e}.down_proj.weight"] = WeightSource(
            (f"{ex}.{down}.weight",), shard=ROW
        )
    if moe.shared_expert_intermediate_size:
        sh = f"{block}.shared_expert"
        src[f"{ours}.shared_expert.gate_up_proj.weight"] = WeightSource(
            (f"{sh}.gate_proj.weight", f"{sh}.up_proj.weight"), shard=COLUMN
        )
        src[f"{ours}.shared_expert.down_proj.weight"] = WeightSource(
            (f"{sh}.down_proj.weight",), shard=ROW
        )
        src[f"{ours}.shared_expert_gate.weight"] = WeightSource(
            (f"{block}.shared_expert_gate.weight",)
        )
    return src


def sparse_layers(model: nn.Module) -> list[tuple[int, SparseMoE]]:
    """``(decoder layer index, its SparseMoE)`` for each sparse layer of ``model`` (none for a
    dense model)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, SparseMoE):
            index = next((p for p in name.split(".") if p.isdigit()), "0")
            out.append((int(index), m))
    return out


def expert_load(layers: list[tuple[int, SparseMoE]]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``(layer, rows each expert ran on)`` for each of ``layers`` (:func:`sparse_layers`):
    the counts since load (or since the engine zeroed them), as the steps left them."""
    if not layers:
        return ()
    counts = torch.stack([m.expert_rows for _, m in layers]).tolist()
    return tuple((i, tuple(c)) for (i, _), c in zip(layers, counts, strict=True))


def describe_experts(model: nn.Module, nbytes: Callable[[nn.Module], int]) -> str | None:
    """A start-up log line: sparse layers, experts, and the bytes of the routed experts (all of
    them, and what one token reads: its k experts per layer) as ``nbytes`` counts a module's
    weights (packed or quantized); None for a dense model."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers:
        return None
    total = sum(nbytes(e) for m in layers for e in m.experts)
    per_token = sum(nbytes(m.experts[0]) * m.top_k for m in layers)
    first = layers[0]
    shared = " + a shared expert" if first.shared_expert is not None else ""
    return (
        f"mixture of experts: {len(layers)} sparse layers x {first.num_experts} experts, "
        f"top {first.top_k}{shared}; routed experts {total / 2**20:.1f} MiB, "
        f"{per_token / 2**20:.1f} MiB of them read per token"
    )
