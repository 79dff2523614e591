"""Adapters known, adapters in host memory, adapters in slots: the engine's LoRA bookkeeping.

Three levels, as in vLLM::

    registered  name -> load id         (--lora-modules, /v1/load_lora_adapter, a LoRARequest)
    host cache  load id -> LoRAAdapter  (read and checked; --max-cpu-loras, LRU)
    slots       slot -> load id         (weights in the model's LoRA buffers; --max-loras, LRU)

Each registration is a *load* with its own id (vLLM's ``lora_int_id``, assigned here): a name
unloaded and loaded again, even from the same folder, is a new load. A request runs with the
load its adapter name stood for when it arrived, whatever happens to the name meanwhile; the
prefix cache keys blocks by load id, so a new load never reads an old one's KV.

A request's adapter is put in the host cache when it arrives (read from disk again if it was
evicted, so a folder gone meanwhile fails that request alone) and stays there while any request
of that load is alive: the cache grows past --max-cpu-loras rather than drop an adapter in use.
A step's adapters get slots in :meth:`LoRAManager.activate`: an adapter already in a slot costs
nothing; another takes a free slot or the least recently used one that this step does not need
(the scheduler never runs more distinct adapters in a step than there are slots) and is copied
in from the host cache. Registering reads and checks the adapter at once, so a bad adapter is
refused when it is named, not mid-step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

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
        self._load_ids: dict[str, int] = {}  # registered name -> its load
        # Every load ever made, unloaded ones too: requests queued with an adapter that is
        # unloaded meanwhile still finish with it.
        self._loads: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.slots: list[int | None] = [None] * config.max_loras
        self._slot_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(config.max_loras))
        self.num_loads = 0  # adapters copied into a slot
        # The loads of the engine's live requests (set by the engine): never evicted from host.
        self.in_use: Callable[[], set[int]] = set
        for request in config.lora_modules:
            self.register(request)

    # ---- registry -------------------------------------------------------------------------
    def register(self, request: LoRARequest, replace: bool = False) -> int:
        """Read, check and remember an adapter; its load id. The same name again with the same
        path is that load; with another path an error (unload it first). ``replace``: a new
        load of the name whatever it holds now (vLLM's ``load_inplace``; the old one stays
        until its requests finish, and stays registered if the new one is refused)."""
        known = self.registered.get(request.lora_name)
        if known is not None and replace:
            adapter = self._read(request)
            self.unregister(request.lora_name)
            return self._remember(request, adapter)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise LoRAError(
                    f"LoRA adapter {request.lora_name!r} is already loaded from "
                    f"{known.lora_path}; unload it first"
                )
            return self.acquire(request.lora_name)
        return self._remember(request, self._read(request))

    def _remember(self, request: LoRARequest, adapter: LoRAAdapter) -> int:
        load_id = len(self._loads) + 1
        self.registered[request.lora_name] = request
        self._load_ids[request.lora_name] = load_id
        self._loads[load_id] = request
        self._cache(load_id, adapter)
        logger.info(
            "LoRA adapter %r from %s: rank %d, %d projections, %.1f MiB",
            request.lora_name, request.lora_path, adapter.rank, len(adapter.modules),
            adapter.nbytes / 2**20,
        )  # fmt: skip
        return load_id

    def unregister(self, name: str) -> None:
        """Forget an adapter (``KeyError`` if unknown): new requests cannot name it; those
        already queued or running with it still finish with it."""
        del self.registered[name]
        del self._load_ids[name]

    def is_registered(self, name: str) -> bool:
        return name in self.registered

    def acquire(self, name: str) -> int:
        """The load a new request with adapter ``name`` runs with, its adapter in host memory
        (read again if it was evicted: ``LoRAError`` / ``OSError`` if that fails now)."""
        load_id = self._load_ids[name]
        self._host_adapter(load_id)
        return load_id

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        if not request.lora_path:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} has no path")
        return load_adapter(request.lora_name, request.lora_path, self.shapes, self.num_layers,
                            self.config.max_lora_rank)  # fmt: skip

    def _cache(self, load_id: int, adapter: LoRAAdapter) -> None:
        self.host[load_id] = adapter
        self.host.move_to_end(load_id)
        if len(self.host) > self.config.host_capacity:
            keep = self.in_use() | {load_id}
            for old in [i for i in self.host if i not in keep]:
                if len(self.host) <= self.config.host_capacity:
                    break
                del self.host[old]

    def _host_adapter(self, load_id: int) -> LoRAAdapter:
        adapter = self.host.get(load_id)
        if adapter is None:  # evicted from host memory: read it again
            adapter = self._read(self._loads[load_id])
            self._cache(load_id, adapter)
        self.host.move_to_end(load_id)
        return adapter

    # ---- slots ----------------------------------------------------------------------------
    def activate(self, load_ids: set[int]) -> dict[int, int]:
        """Slots for this step's adapters (load ids), loading those not in one."""
        if len(load_ids) > len(self.slots):
            raise RuntimeError(f"{len(load_ids)} adapters in one step, {len(self.slots)} slots")
        where = {load_id: i for i, load_id in enumerate(self.slots) if load_id is not None}
        out: dict[int, int] = {}
        for load_id in load_ids:
            if load_id in where:
                out[load_id] = where[load_id]
        for load_id in sorted(load_ids - set(out)):
            # A free slot first, else the least recently used one this step does not need.
            free = [s for s in self._slot_lru if self.slots[s] is None]
            slot = (
                free[0]
                if free
                else next(s for s in self._slot_lru if self.slots[s] not in load_ids)
            )
            self._load(slot, load_id, self._host_adapter(load_id))
            out[load_id] = slot
        for slot in out.values():
            self._slot_lru.move_to_end(slot)
        return out

    @torch.inference_mode()
    def _load(self, slot: int, load_id: int, adapter: LoRAAdapter) -> None:
        for (layer, module_name), wrapper in self.layers.items():
            parts = [adapter.modules.get((layer, proj)) for proj in FUSED_PARTS[module_name]]
            if any(p is not None for p in parts):
                wrapper.load_slot(slot, parts)
            else:
                wrapper.clear_slot(slot)
        self.slots[slot] = load_id
        self.num_loads += 1

    def set_step(self, row_slots: list[int] | None, device: torch.device) -> None:
        """The step's grouping for every wrapper (None or all -1: no adapter rows)."""
        self.state.batch = None if row_slots is None else LoRABatch.build(row_slots, device)


__all__ = ["PROJECTIONS", "LoRAConfig", "LoRAManager", "check_lora_model"]
