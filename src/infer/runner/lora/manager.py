"""Adapters known, adapters in host memory, adapters in slots: the engine's LoRA bookkeeping.

Three levels, as in vLLM::

    registered  name -> path            (--lora-modules, /v1/load_lora_adapter, a LoRARequest)
    host cache  name -> LoRAAdapter     (read and checked; at most --max-cpu-loras, LRU)
    slots       slot -> name            (weights in the model's LoRA buffers; --max-loras, LRU)

A step's adapters get slots in :meth:`LoRAManager.activate`: an adapter already in a slot costs
nothing; another takes a free slot or the least recently used one that this step does not need
(the scheduler never runs more distinct adapters in a step than there are slots) and is copied
in from the host cache (read from disk first if it was evicted there). Registering reads and
checks the adapter at once, so a bad adapter is refused when it is named, not mid-step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from infer.config import LoRAConfig
from infer.core.lora_request import LoRARequest
from infer.runner.lora.adapter import PROJECTIONS, LoRAAdapter, LoRAError, load_adapter
from infer.runner.lora.layers import (
    FUSED_PARTS,
    LoRABatch,
    LoRALinear,
    LoRAState,
    projection_shapes,
    wrap_projections,
)

logger = logging.getLogger("infer.runner")


def check_lora_model(model: nn.Module) -> None:
    """Refuse models whose projections infer cannot adapt, naming why."""
    from infer.model.layers import GatedMLP
    from infer.model.llama import DecoderLM

    if not isinstance(model, DecoderLM):
        raise ValueError(
            f"--enable-lora: {type(model).__name__} is not supported (LoRA adapters run on the "
            "Llama-family decoders: Llama, Mistral, Qwen 2/3, Gemma 3)"
        )
    if not all(isinstance(layer.mlp, GatedMLP) for layer in model.layers):
        raise ValueError("--enable-lora: mixture-of-experts models are not supported yet")
    if model.tp.size > 1:
        raise ValueError("--enable-lora does not run with tensor parallelism yet")


class LoRAManager:
    """The engine's adapters (see the module docstring); owns the model's LoRA wrappers."""

    def __init__(self, model: nn.Module, config: LoRAConfig) -> None:
        check_lora_model(model)
        self.config = config
        self.model = model
        self.num_layers = len(model.layers)
        self.shapes = projection_shapes(model)
        self.state = LoRAState()
        self.layers: dict[tuple[int, str], LoRALinear] = wrap_projections(
            model, config.max_loras, config.max_lora_rank, self.state
        )
        self.registered: dict[str, LoRARequest] = {}
        # Every adapter ever registered, unloaded ones too: requests queued with an adapter
        # that is unloaded meanwhile still finish with it.
        self._paths: dict[str, LoRARequest] = {}
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slots: list[str | None] = [None] * config.max_loras
        self._slot_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(config.max_loras))
        self.num_loads = 0  # adapters copied into a slot
        for request in config.lora_modules:
            self.register(request)

    # ---- registry -------------------------------------------------------------------------
    def register(self, request: LoRARequest) -> LoRAAdapter:
        """Read, check and remember an adapter; the same name again with the same path is a
        no-op, with another path an error (unload it first)."""
        known = self.registered.get(request.lora_name)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise LoRAError(
                    f"LoRA adapter {request.lora_name!r} is already loaded from "
                    f"{known.lora_path}; unload it first"
                )
            return self._host_adapter(request.lora_name)
        adapter = self._read(request)
        self.registered[request.lora_name] = request
        self._paths[request.lora_name] = request
        for slot, name in enumerate(self.slots):  # an earlier adapter of that name
            if name == request.lora_name:
                self.slots[slot] = None
        self._cache(adapter)
        logger.info(
            "LoRA adapter %r from %s: rank %d, %d projections, %.1f MiB",
            request.lora_name, request.lora_path, adapter.rank, len(adapter.modules),
            adapter.nbytes / 2**20,
        )  # fmt: skip
        return adapter

    def unregister(self, name: str) -> None:
        """Forget an adapter (``KeyError`` if unknown): new requests cannot name it; those
        already queued or running with it still finish with it."""
        del self.registered[name]

    def is_registered(self, name: str) -> bool:
        return name in self.registered

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        if not request.lora_path:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} has no path")
        return load_adapter(request.lora_name, request.lora_path, self.shapes, self.num_layers,
                            self.config.max_lora_rank)  # fmt: skip

    def _cache(self, adapter: LoRAAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.config.host_capacity:
            self.host.popitem(last=False)

    def _host_adapter(self, name: str) -> LoRAAdapter:
        adapter = self.host.get(name)
        if adapter is None:  # evicted from host memory: read it again
            adapter = self._read(self._paths[name])
            self._cache(adapter)
        self.host.move_to_end(name)
        return adapter

    # ---- slots ----------------------------------------------------------------------------
    def activate(self, names: set[str]) -> dict[str, int]:
        """Slots for this step's adapters, loading those not in one."""
        if len(names) > len(self.slots):
            raise RuntimeError(f"{len(names)} adapters in one step, {len(self.slots)} slots")
        where = {name: i for i, name in enumerate(self.slots) if name is not None}
        out: dict[str, int] = {}
        for name in names:
            if name in where:
                out[name] = where[name]
        for name in sorted(names - set(out)):
            # A free slot first, else the least recently used one this step does not need.
            free = [s for s in self._slot_lru if self.slots[s] is None]
            slot = (
                free[0] if free else next(s for s in self._slot_lru if self.slots[s] not in names)
            )
            self._load(slot, self._host_adapter(name))
            out[name] = slot
        for slot in out.values():
            self._slot_lru.move_to_end(slot)
        return out

    @torch.inference_mode()
    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        for (layer, module_name), wrapper in self.layers.items():
            parts = [adapter.modules.get((layer, proj)) for proj in FUSED_PARTS[module_name]]
            if any(p is not None for p in parts):
                wrapper.load_slot(slot, parts)
            else:
                wrapper.clear_slot(slot)
        self.slots[slot] = adapter.name
        self.num_loads += 1

    def set_step(self, row_slots: list[int] | None, device: torch.device) -> None:
        """The step's grouping for every wrapper (None or all -1: no adapter rows)."""
        self.state.batch = None if row_slots is None else LoRABatch.build(row_slots, device)

    @property
    def resident(self) -> list[str]:
        return [n for n in self.slots if n is not None]


__all__ = ["PROJECTIONS", "LoRAConfig", "LoRAManager", "check_lora_model"]
