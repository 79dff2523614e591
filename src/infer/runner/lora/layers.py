"""LoRA in the forward pass: every adapted projection adds its rows' low-rank updates.

:func:`wrap_projections` puts a :class:`LoRALinear` around each of a decoder's projections
(after quantization and packing: the base layer is whatever kernel the weights got). The wrapper
holds the adapter slots' weights for its projection and, each step, reads the step's grouping
from the shared :class:`LoRAState`::

    rows of the step : r0(sql) r1(-) r2(chat) r3(sql) r4(-)
    slots            :   0      -1    1        0      -1
    groups           : slot 0 -> rows [r0, r3]; slot 1 -> rows [r2]     (rows without: none)
    y = base(x);  y[r] += scale * B_slot (A_slot x[r])   for each group, each of its rows

On CPU with bfloat16 weights one C++ call does a projection's update for every group
(``csrc/lora.cpp``); elsewhere a loop over the groups in torch, rounding as PEFT does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from infer.runner.cpu.kernels import CpuKernels, LoRAArgs, LoRAStepArgs, cpu_kernels
from infer.runner.lora.adapter import PROJECTIONS, LoRAModule


@dataclass(frozen=True)
class LoRABatch:
    """One step's rows grouped by adapter slot.

    ``rows``: int64, the rows with an adapter, grouped by slot (ascending) and in row order
    within a group; ``groups``: int64 ``[3, G]``, each group's slot, first index into ``rows``
    and number of rows; ``slots``: the same groups as host data."""

    rows: torch.Tensor
    groups: torch.Tensor
    slots: tuple[tuple[int, int, int], ...]

    @functools.cached_property
    def c_step(self) -> LoRAStepArgs:
        """The same for the C++ kernels (CPU tensors only)."""
        g = self.groups
        return LoRAStepArgs(self.rows.data_ptr(), g[0].data_ptr(), g[1].data_ptr(),
                            g[2].data_ptr(), g.shape[1])  # fmt: skip

    @staticmethod
    def build(row_slots: list[int], device: torch.device) -> LoRABatch | None:
        """From each row's slot (-1: no adapter); None when no row has an adapter."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        if not by_slot:
            return None
        rows: list[int] = []
        groups: list[tuple[int, int, int]] = []
        for slot in sorted(by_slot):
            groups.append((slot, len(rows), len(by_slot[slot])))
            rows.extend(by_slot[slot])
        table = torch.tensor(groups, dtype=torch.long).t().contiguous()
        return LoRABatch(
            torch.tensor(rows, dtype=torch.long, device=device),
            table if device.type == "cpu" else table.to(device),
            tuple(groups),
        )


class LoRAState:
    """What every :class:`LoRALinear` of a model reads: the current step's batch (None: no
    adapter rows this step)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    """``base(x)`` plus each row's adapter update; ``parts``: the output widths of the fused
    projections (q|k|v, gate|up), one entry for a plain one."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        parts: tuple[int, ...],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        state: LoRAState,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.out_features = sum(parts)
        self.parts = parts
        self.state = state
        num_parts, n = len(parts), self.out_features
        # The kernel's layouts (csrc/lora.cpp): A as (k, k+1) pairs per output, the rank
        # rounded up to a vector of 16; B transposed.
        max_rank = -(-max_rank // 16) * 16
        self.register_buffer("a", torch.zeros(num_slots, num_parts, (in_features + 1) // 2,
                                              max_rank, 2, dtype=dtype, device=device),
                             persistent=False)  # fmt: skip
        self.register_buffer("bt", torch.zeros(num_slots, -(-n // 16), max_rank, 16,
                                               dtype=dtype, device=device),
                             persistent=False)  # fmt: skip
        self.register_buffer("scale", torch.zeros(num_slots, num_parts), persistent=False)
        self.register_buffer("rank", torch.zeros(num_slots, num_parts, dtype=torch.int32),
                             persistent=False)  # fmt: skip
        offsets = [0]
        for width in parts:
            offsets.append(offsets[-1] + width)
        self.offsets = offsets
        self.register_buffer("part_off", torch.tensor(offsets, dtype=torch.long),
                             persistent=False)  # fmt: skip
        self._kernels: CpuKernels | None = (
            cpu_kernels() if dtype == torch.bfloat16 and device.type == "cpu" else None
        )
        # rank and scale as host data too, for the torch path.
        self._host_rank = [[0] * num_parts for _ in range(num_slots)]
        self._host_scale = [[0.0] * num_parts for _ in range(num_slots)]
        # The same buffers for the fused decode loop (runner/cpu/decode_fast.py).
        self.c_args = LoRAArgs(
            *(t.data_ptr() for t in (self.a, self.bt, self.scale, self.rank, self.part_off)),
            num_parts, max_rank,
        )  # fmt: skip

    @property
    def weight_bytes(self) -> int:
        """The base layer's weights (what a step reads without adapters)."""
        base_bytes = getattr(self.base, "weight_bytes", None)
        if base_bytes is not None:
            return base_bytes
        return sum(p.numel() * p.element_size() for p in self.base.parameters())

    def load_slot(self, slot: int, modules: list[LoRAModule | None]) -> None:
        """Put one adapter's pairs (one per part; None: the part is not adapted) in ``slot``."""
        self.a[slot].zero_()
        self.scale[slot].zero_()
        self.rank[slot].zero_()
        blocks, rank_cap = self.bt.shape[1], self.bt.shape[2]
        b_full = torch.zeros(blocks * 16, rank_cap, dtype=self.bt.dtype, device=self.bt.device)
        for p, module in enumerate(modules):
            if module is None:
                continue
            r, lo, hi = module.rank, self.offsets[p], self.offsets[p + 1]
            a = module.a
            if a.shape[1] % 2:  # K odd: the last pair's second element is 0
                a = torch.cat([a, a.new_zeros(r, 1)], dim=1)
            self.a[slot, p, :, :r].copy_(a.view(r, -1, 2).transpose(0, 1))
            b_full[lo:hi, :r] = module.b
            self.scale[slot, p] = module.scale
            self.rank[slot, p] = r
        self.bt[slot].copy_(b_full.view(blocks, 16, rank_cap).transpose(1, 2))
        self._host_rank[slot] = [0 if m is None else m.rank for m in modules]
        self._host_scale[slot] = [0.0 if m is None else m.scale for m in modules]

    def lora_b(self, slot: int) -> torch.Tensor:
        """``[N, R]``: row ``o`` is the ``lora_B`` row of output column ``o`` (of the part that
        owns it), from the kernel's blocks of 16 columns."""
        blocks = self.bt[slot]  # [ceil(N / 16), R, 16]
        return blocks.transpose(1, 2).reshape(-1, blocks.shape[1])[: self.out_features]

    def lora_a(self, slot: int, part: int, rank: int) -> torch.Tensor:
        """``lora_A`` ``[rank, in]`` of one part of the adapter in ``slot`` (from the kernel's
        pair layout)."""
        a = self.a[slot, part, :, :rank].transpose(0, 1).reshape(rank, -1)
        return a[:, : self.in_features]

    def clear_slot(self, slot: int) -> None:
        self.rank[slot].zero_()
        self.scale[slot].zero_()
        self._host_rank[slot] = [0] * len(self.parts)
        self._host_scale[slot] = [0.0] * len(self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if batch is None:
            return y
        if self._kernels is not None and x.dim() == 2 and x.stride(-1) == 1 and y.is_contiguous():
            self._kernels.lora_apply(x, y, self.a, self.bt, self.scale, self.rank, self.part_off,
                                     batch.rows, batch.groups)  # fmt: skip
            return y
        return self._reference(x.reshape(-1, self.in_features), y.view(-1, self.out_features),
                               batch).view(y.shape)  # fmt: skip

    def _reference(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """torch ops per group, in the model's dtype: ``(x A^T) B^T * scale`` as PEFT rounds."""
        rank, scale = self._host_rank, self._host_scale  # no device read-back (CUDA)
        for slot, start, count in batch.slots:
            rows = batch.rows[start : start + count]
            xs = x.index_select(0, rows)
            delta = torch.zeros(count, self.out_features, dtype=y.dtype, device=y.device)
            b = self.lora_b(slot)
            for p, r in enumerate(rank[slot]):
                if not r:
                    continue
                lo, hi = self.offsets[p], self.offsets[p + 1]
                xa = xs @ self.lora_a(slot, p, r).t()
                delta[:, lo:hi] = (xa @ b[lo:hi, :r].t()) * scale[slot][p]
            y.index_add_(0, rows, delta)
        return y


# Our fused projections and the PEFT projections each is made of, in part order.
FUSED_PARTS: dict[str, tuple[str, ...]] = {}
for _proj, (_module, _part) in PROJECTIONS.items():
    FUSED_PARTS.setdefault(_module, ())
    FUSED_PARTS[_module] = (*FUSED_PARTS[_module], _proj)


def projection_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """PEFT projection name -> ``(out, in)`` in the base model (layer 0 speaks for all)."""
    layer = model.layers[0]
    attn = layer.attn
    inter = layer.mlp.intermediate
    hidden = attn.qkv_proj.in_features
    return {
        "q_proj": (attn.q_size, hidden),
        "k_proj": (attn.kv_size, hidden),
        "v_proj": (attn.kv_size, hidden),
        "o_proj": (hidden, attn.q_size),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def wrap_projections(
    model: nn.Module, num_slots: int, max_rank: int, state: LoRAState
) -> dict[tuple[int, str], LoRALinear]:
    """Wrap every adaptable projection of a decoder; returns ``(layer, our module name) ->
    wrapper``."""
    shapes = projection_shapes(model)
    embed = model.embed_tokens.weight  # the model's dtype, whatever its linears became
    dtype, device = embed.dtype, embed.device
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for i, layer in enumerate(model.layers):
        for module_name, projs in FUSED_PARTS.items():
            owner_name, attr = module_name.split(".")
            owner = getattr(layer, owner_name)
            base = getattr(owner, attr)
            parts = tuple(shapes[p][0] for p in projs)
            wrapper = LoRALinear(base, shapes[projs[0]][1], parts, num_slots, max_rank, dtype,
                                 device, state)  # fmt: skip
            setattr(owner, attr, wrapper)
            wrapped[(i, module_name)] = wrapper
    return wrapped
