"""The seam between the engine and a device: one backend per device kind, built and driven the
same way by the engine (rank 0) and by every tensor-parallel rank.

::

    backend = device_backend(device, seed)       # the device made ready (checks, allocator, seed)
    dtype   = backend.resolve_dtype("auto", ckpt)   # what this device runs the checkpoint in
    model   = backend.load_model(WeightsConfig(...)) # loaded, then 4-bit kept / quantized / packed
    budget  = backend.kv_budget(wanted, utilization, reserve)   # bytes the KV cache may take
    runner  = backend.build_runner(RunnerSetup(...))  # KV cache allocated, ModelRunner built
    draft   = backend.load_draft(path)  ->  backend.build_runner(setup, model=draft)
    runner.capture_graphs()                      # last: the graphs' memory is what is left
    runner.launch(SchedulerOutput) -> InFlightStep;  runner.collect(step) -> ModelRunnerOutput

What differs by device lives in the backend's class, not in ``if device.type`` at the call
sites: :class:`CpuBackend` tunes glibc's malloc, refuses fp16 (bf16 instead) and sizes the KV
cache by a default; :class:`CudaBackend` checks that CUDA is there, probes the free memory for
the KV budget and can wait for the device. Inside the runner the device picks its step: the
Triton step (``runner/gpu/``: step buffers, paged attention kernels, CUDA graphs) on CUDA, the
C++ kernels' fused decode step (``runner/cpu/decode_fast.py``) and attention on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from infer.core.messages import RunnerSetup
from infer.runner.attention import KVCache
from infer.runner.cpu.prepack import prepack_linears
from infer.runner.int4 import Int4Linear, keep_checkpoint_int4
from infer.runner.quant import quantize_checkpoint_layers, quantize_linears
from infer.runner.runner import ModelRunner


@dataclass(frozen=True)
class WeightsConfig:
    """The weights a backend loads, and what is done to them once loaded."""

    model_path: Path
    dtype: torch.dtype
    quantization: str | None = None  # quantize the linear layers at load (None: pre-pack them)
    quantize_lm_head: bool = True
    # A GPTQ / AWQ checkpoint or GGUF file served as it is (not requantized): its 4-bit layers
    # stay 4-bit.
    keep_checkpoint_int4: bool = False
    # Its layers stored quantized in other types (GGUF's Q6_K, Q8_0, ...): held in int8.
    checkpoint_int8: bool = False
    # The kept 4-bit layers multiply int8 activations (the w4a8 kernel; GGUF files).
    int8_activations: bool = False


class DeviceBackend:
    """One device's part of the engine: its model, KV cache and runner (see the module doc).

    Subclasses say what differs by device; the steps and their order are the same for all.
    The class attributes and class methods are what a tensor-parallel driver asks before any
    rank has built its backend."""

    collectives = "gloo"
    """The torch.distributed backend of the model's collectives across ranks."""
    pins_cores = True
    """Whether each tensor-parallel rank takes a share of this process's cores (its compute)."""

    @classmethod
    def rank_device(cls, device: torch.device, rank: int) -> torch.device:
        """The device of tensor-parallel rank ``rank`` of an engine on ``device``."""
        return device

    def __init__(self, device: torch.device, seed: int, *, make_current: bool = False) -> None:
        self.device = device
        self._make_current = make_current  # a tensor-parallel rank's process: its one device
        self.seed = seed
        self._prepare()
        torch.manual_seed(seed)
        self.model: torch.nn.Module | None = None
        self.dtype = torch.float32  # the loaded model's (and the KV cache's values')
        self.kept_int4: list[Int4Linear] = []  # a 4-bit checkpoint's layers kept as they are
        self.checkpoint_int8: list[torch.nn.Module] = []  # its other quantized layers, in int8

    def _prepare(self) -> None:
        """Make the device ready before anything is loaded on it."""

    def resolve_dtype(self, name: str, checkpoint_dtype: str | None) -> torch.dtype:
        """``--dtype`` (``auto``: the checkpoint's own, float32 when it names none)."""
        if name != "auto":
            return getattr(torch, name)
        dtype = getattr(torch, checkpoint_dtype, None) if checkpoint_dtype else None
        return dtype if isinstance(dtype, torch.dtype) else torch.float32

    def load_model(self, weights: WeightsConfig) -> torch.nn.Module:
        """Load this rank's slice of the checkpoint, keep a 4-bit checkpoint's layers, then
        quantize the linear layers (``weights.quantization``) or pre-pack them for this
        device's kernels. The model is the one :meth:`build_runner` builds on."""
        from infer.model.loader import load_model

        model = load_model(weights.model_path, weights.dtype, self.device,
                           gguf_wide=weights.int8_activations)  # fmt: skip
        if weights.keep_checkpoint_int4 and not weights.quantization:
            self.kept_int4 = keep_checkpoint_int4(model, weights.int8_activations,
                                                  weights.quantize_lm_head)  # fmt: skip
        model.checkpoint_int4 = {}  # (the integers the loader unpacked: kept above, or not)
        self._prepare_weights(model, weights)
        self.model = model
        self.dtype = weights.dtype
        return model

    def load_draft(self, model_path: Path) -> torch.nn.Module:
        """A speculative-decoding draft model, in the engine model's dtype and prepared as it
        is (pre-packed for this device's kernels; speculative decoding runs on one rank). Not
        kept: ``build_runner(setup, model=draft)`` builds its runner."""
        from infer.model.loader import load_model

        assert self.model is not None, "load_model first (the draft takes its dtype)"
        model = load_model(model_path, self.dtype, self.device)
        model.checkpoint_int4 = {}  # a draft's layers are pre-packed as they are
        self._prepare_weights(model, WeightsConfig(model_path, self.dtype))
        return model

    def _prepare_weights(self, model: torch.nn.Module, weights: WeightsConfig) -> None:
        """Quantize the loaded linear layers, or pre-pack them for this device's kernels."""
        if weights.quantization:
            quantize_linears(model, weights.quantization, lm_head=weights.quantize_lm_head)
            return
        if weights.checkpoint_int8:
            self.checkpoint_int8 = quantize_checkpoint_layers(model, weights.quantize_lm_head)
        prepack_linears(model)

    def kv_budget(self, wanted: int, utilization: float, reserve: int = 0) -> int:
        """Bytes the KV cache may take when no size was given: ``wanted`` is what every
        sequence slot at full length would take, ``utilization`` the share of the device's
        memory the engine may use, ``reserve`` what will be loaded after the plan (a draft
        model's weights)."""
        raise NotImplementedError

    def build_runner(self, setup: RunnerSetup, model: torch.nn.Module | None = None) -> ModelRunner:
        """Allocate the KV cache this rank holds (its share of the KV heads) and build the
        runner over the loaded model (or over ``model``: a draft from :meth:`load_draft`)."""
        model = model if model is not None else self.model
        assert model is not None, "load_model first"
        spec = model.spec
        tp_size = model.tp.size
        kv_cache = KVCache(
            0 if spec.is_encoder else spec.num_layers,  # (an encoder attends within its input)
            setup.num_blocks,
            setup.block_size,
            spec.num_kv_heads // tp_size,
            spec.head_dim,
            self.dtype,
            self.device,
            kv_dtype=setup.kv_cache_dtype,
        )
        return ModelRunner(
            model,
            kv_cache,
            self.device,
            self.seed,
            num_swap_blocks=setup.num_swap_blocks,
            max_num_seqs=setup.max_num_seqs,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            attention_backend=setup.attention_backend,
            enforce_eager=setup.enforce_eager,
            max_model_len=setup.max_model_len,
            num_spec_tokens=setup.num_spec_tokens,
        )

    def synchronize(self) -> None:
        """Wait for the work queued on the device (nothing to wait for on a CPU)."""


def backend_class(device: torch.device | str) -> type[DeviceBackend]:
    """The backend class of ``device``'s kind (imports nothing of the other kinds)."""
    kind = torch.device(device).type
    if kind == "cuda":
        from infer.runner.gpu.backend import CudaBackend

        return CudaBackend
    if kind == "cpu":
        from infer.runner.cpu.backend import CpuBackend

        return CpuBackend
    raise ValueError(f"--device {device}: infer runs on cpu or cuda")


def device_backend(
    device: torch.device | str, seed: int = 0, *, make_current: bool = False
) -> DeviceBackend:
    """The backend of ``device`` (``make_current``: a tensor-parallel rank's CUDA device
    becomes the process's current one)."""
    device = torch.device(device)
    return backend_class(device)(device, seed, make_current=make_current)
