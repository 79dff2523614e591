"""Engine configuration: small frozen dataclasses, validated at construction.

Derived values (the number of KV blocks, EOS ids, the model's context length) are computed by
the engine from these and the checkpoint, never written back into them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from infer.core.field_types import wrong_number_type
from infer.core.lora_request import LoRARequest
from infer.kv_cache.sizing import check_kv_cache_dtype

QUANTIZATIONS = ("int8", "w8a8", "fp8", "int4", "w4a8")
# Quantized checkpoints (read as they are stored): --quantization names them to assert it.
CHECKPOINT_QUANTIZATIONS = ("gptq", "awq", "gguf")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
BatchingMode = Literal["continuous", "static"]
KVBackend = Literal["paged", "contiguous"]
SchedulingPolicy = Literal["fcfs", "priority"]
PreemptionMode = Literal["recompute", "swap"]

_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
          "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4}  # fmt: skip


def parse_bytes(value: str | int | float) -> int:
    """``"2GiB"`` -> 2147483648, ``"1.5GB"`` -> 1500000000, ``4096`` -> 4096."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse a byte size from {value!r} (examples: 512MiB, 2GiB, 1e9)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def json_object(value: str | dict, flag: str) -> dict:
    """A flag's JSON object (its text, or a dict given directly), or a ValueError naming it."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return dict(value)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # local folder, HF cache id, or a built-in name ("toy", "small")
    tokenizer: str | None = None  # defaults to the model folder
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0
    # None | int8 | w8a8 | fp8 | int4 | w4a8: weights quantized at load; gptq | awq | gguf: the
    # checkpoint is one (read as such anyway; naming it checks that it is)
    quantization: str | None = None
    # With a quantization: the vocabulary projection too (False keeps it in the model's dtype).
    quantize_lm_head: bool = True
    # A GGUF file's layers stored in a quantized type the 4-bit kernel cannot take (Q6_K, Q5_K,
    # Q8_0, ...): held in int8 per channel (False: dequantized to the model's dtype). None: a
    # decoder's are (half the bytes each decode step reads), an encoder's are not (every input
    # runs as one compute-bound pass, which int8 weights do not speed up, and requantizing a
    # Q8_0 block's values per channel adds its own rounding).
    gguf_int8: bool | None = None
    # A GGUF file's 4- and 5-bit layers (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K) multiply int8
    # activations (each row's groups of 32 quantized as the layer runs, as llama.cpp does): the
    # w4a8 kernel, ~1.7x the bf16 one's multiplies where they bind (prefill, batches), reading
    # the 5-bit types and the K-quants' own scales as they are. False: activations stay bf16
    # (the 5-bit types then in int8).
    gguf_int8_activations: bool = True
    # A GGUF file's layers all dequantized to the model's dtype at load, as without the CPU
    # kernels: more memory, and on AVX2 CPUs (where the 4-bit kernel widens every weight to
    # float32 and runs batches and prefill at about half the bf16 kernel's rate) faster
    # batches; slower batch-1 decode everywhere.
    gguf_dequantize: bool = False
    # Attention on CUDA: "triton" (paged kernels that read the block tables), "torch" (gather +
    # SDPA, the reference); "auto" is triton where it is installed. The CPU has its own kernels.
    attention_backend: str = "auto"
    # CUDA: run every step eagerly (no CUDA graphs for decode steps), as vLLM's --enforce-eager.
    enforce_eager: bool = False
    # The Triton step: launch a decode step while the one before is still on the device (its
    # input ids taken there), so the host's per-step work overlaps the device's. False: every
    # step waits for the one before (vLLM's --async-scheduling, on here where it applies).
    async_scheduling: bool = True
    # Where a request's unset sampling fields come from (infer.model.generation_config):
    # "auto" (the model's generation_config.json), "none"/"vllm" (infer's own defaults), or a
    # folder holding a generation_config.json; the override sets or replaces fields
    # (a dict, or its JSON), as vLLM's --generation-config / --override-generation-config.
    generation_config: str = "auto"
    override_generation_config: Any = None
    # How embedding requests pool (infer.model.pooling): ``pooling_type`` / ``normalize`` over
    # the model's sentence-transformers files (a dict, or its JSON), as vLLM's --pooler-config.
    pooler_config: Any = None
    # config.json fields set or replaced before the model is read (a dict, or its JSON; kept as
    # canonical JSON), as vLLM's --hf-overrides (infer.model.overrides).
    hf_overrides: Any = None

    def __post_init__(self) -> None:
        from infer.model.overrides import parse_hf_overrides

        object.__setattr__(self, "hf_overrides", parse_hf_overrides(self.hf_overrides))
        from infer.model.generation_config import parse_override
        from infer.model.pooling import parse_pooler_config

        # (frozen: kept as sorted items, so the config stays hashable)
        override = parse_override(self.override_generation_config)
        object.__setattr__(self, "override_generation_config", tuple(sorted(override.items())))
        pooler = parse_pooler_config(
            dict(self.pooler_config)
            if isinstance(self.pooler_config, tuple)
            else self.pooler_config
        )
        object.__setattr__(self, "pooler_config", tuple(sorted(pooler.items())))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend {self.attention_backend!r} is not supported "
                f"(choices: {', '.join(ATTENTION_BACKENDS)})"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        choices = QUANTIZATIONS + CHECKPOINT_QUANTIZATIONS
        if self.quantization is not None and self.quantization not in choices:
            raise ValueError(
                f"--quantization {self.quantization!r} is not supported "
                f"(choices: {', '.join(choices)})"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_backend: KVBackend = "paged"
    use_kv_cache: bool = True  # False: recompute the whole sequence every step (comparison mode)
    num_kv_blocks: int | None = None  # explicit pool size; overrides the memory budget
    kv_cache_memory: int | None = None  # bytes for KV; None: a default budget (see engine)
    gpu_memory_utilization: float = 0.9
    # None: on wherever it applies (EngineConfig decides, and says why where it does not);
    # True / False: what the user asked for (True where it cannot work is an error).
    enable_prefix_caching: bool | None = None
    swap_space: int = 1 << 30  # bytes of host memory for swapped-out KV blocks
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 | fp8: one byte per value

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_backend not in ("paged", "contiguous"):
            raise ValueError(
                f"kv_cache_backend must be paged|contiguous, got {self.kv_cache_backend!r}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.enable_prefix_caching and self.kv_cache_backend != "paged":
            raise ValueError(
                "prefix caching needs the paged KV cache backend "
                "(drop --enable-prefix-caching or --kv-cache-backend contiguous)"
            )
        if self.enable_prefix_caching and not self.use_kv_cache:
            raise ValueError(
                "prefix caching needs the KV cache (drop --enable-prefix-caching or --no-kv-cache)"
            )
        check_kv_cache_dtype(self.kv_cache_dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int | None = None  # None: chunked prefill off (whole prompts)
    batching_mode: BatchingMode = "continuous"
    scheduling_policy: SchedulingPolicy = "fcfs"
    preemption_mode: PreemptionMode = "recompute"
    max_wait_steps: int | None = None  # priority aging: promote after this many waiting steps
    max_queued_requests: int | None = None  # bound on waiting requests (None: unbounded)
    # A request's output goes out every this many tokens (its first token and its end at once):
    # fewer, larger stream events, for less host work a token (vLLM's --stream-interval).
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be positive, got {self.prefill_chunk_size}")
        if self.batching_mode not in ("continuous", "static"):
            raise ValueError(f"batching_mode must be continuous|static, got {self.batching_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be fcfs|priority, got {self.scheduling_policy!r}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be recompute|swap, got {self.preemption_mode!r}"
            )
        if self.max_wait_steps is not None and self.max_wait_steps < 0:
            raise ValueError(f"max_wait_steps must be >= 0, got {self.max_wait_steps}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be positive, got {self.stream_interval}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(  # (0 would refuse every request: nothing could ever wait)
                f"max_queued_requests must be positive, got {self.max_queued_requests}"
            )


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: propose ``num_speculative_tokens`` tokens, verify them in one pass.

    ``method="ngram"`` looks the sequence's last ``prompt_lookup_max`` .. ``prompt_lookup_min``
    tokens up earlier in its own prompt and output and proposes what followed; ``"draft_model"``
    runs the smaller ``model`` (same tokenizer) greedily. Built from vLLM's JSON shape by
    :meth:`parse`.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model (method "draft_model")
    # Propose fewer tokens to a request whose proposals keep failing (spec_decode.ProposalLengths)
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is unknown "
                f"(choices: {', '.join(SPECULATIVE_METHODS)})"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(
                    "prompt_lookup_min and prompt_lookup_max must be integers with "
                    f"1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}"
                )
        elif not self.model:
            raise ValueError('the draft_model method needs "model": the draft checkpoint')

    @staticmethod
    def parse(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From ``--speculative-config``'s JSON text or a dict, as vLLM takes it."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        options = json_object(value, "--speculative-config")
        method = options.pop("method", None)
        if method is None:
            method = "draft_model" if options.get("model") else "ngram"
        if method == "draft":
            method = "draft_model"
        if method == "ngram" and options.get("model"):
            raise ValueError('the ngram method takes no "model"')
        known = set(SpeculativeConfig.__dataclass_fields__) - {"method"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative option(s) {', '.join(map(repr, unknown))} "
                f"(known: method, {', '.join(sorted(known))})"
            )
        if "num_speculative_tokens" not in options:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        return SpeculativeConfig(method=method, **options)


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes run the model: ``tensor_parallel_size`` ranks each hold a slice of
    every layer (torch.distributed: gloo on CPU, NCCL on CUDA)."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class LoRAConfig:
    """``--enable-lora`` and its limits (vLLM's names and defaults); see ``infer.runner.lora`` and docs/lora.md."""

    max_loras: int = 1  # adapters in slots at once (the most distinct adapters in one step)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory (default: max_loras)
    lora_modules: tuple[LoRARequest, ...] = ()  # registered at start-up

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras})"
            )
        names = [m.lora_name for m in self.lora_modules]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"--lora-modules names {duplicated[0]!r} twice")

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @staticmethod
    def from_options(enable_lora: bool, **options) -> LoRAConfig | None:
        """From the flat options (``max_loras``, ``max_lora_rank``, ``max_cpu_loras``,
        ``lora_modules``: ``LoRARequest``s or their CLI strings); None without ``enable_lora``
        (and an error if LoRA options are given without it)."""
        given = {k: v for k, v in options.items() if v is not None and v != () and v != []}
        if not enable_lora:
            if given:
                raise ValueError(f"--{next(iter(given)).replace('_', '-')} needs --enable-lora")
            return None
        modules = tuple(parse_lora_module(m) for m in given.pop("lora_modules", ()))
        return LoRAConfig(lora_modules=modules, **given)


LORA_OPTIONS = ("max_loras", "max_lora_rank", "max_cpu_loras", "lora_modules")


def parse_lora_module(value: str | LoRARequest) -> LoRARequest:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    if isinstance(value, LoRARequest):
        return value
    text = value.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {value!r} is not valid JSON: {e}") from None
        if not isinstance(obj, dict) or not obj.get("name") or not obj.get("path"):
            raise ValueError(f'--lora-modules: {value!r} needs "name" and "path"')
        return LoRARequest(str(obj["name"]), 0, str(obj["path"]), obj.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {value!r} is not name=path")
    return LoRARequest(name, 0, path)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig | None = None  # None: LoRA adapters off (no --enable-lora)
    # Why prefix caching is off though nobody turned it off (None: it is on, or was asked off).
    prefix_caching_off_reason: str | None = field(default=None, init=False, compare=False)

    def __post_init__(self) -> None:
        # Prefix caching is on by default, as in vLLM, except where it cannot apply.
        cache = self.cache
        reason = None
        if cache.enable_prefix_caching is None:
            if cache.kv_cache_backend != "paged":
                reason = "the contiguous KV backend shares no blocks"
            elif not cache.use_kv_cache:
                reason = "--no-kv-cache keeps no KV between steps"
            elif self.scheduler.batching_mode == "static":
                reason = "static batching is a comparison mode (--enable-prefix-caching adds it)"
            object.__setattr__(self, "cache", replace(cache, enable_prefix_caching=reason is None))
        object.__setattr__(self, "prefix_caching_off_reason", reason)
        if self.scheduler.preemption_mode == "swap" and (
            cache.kv_cache_backend != "paged" or not cache.use_kv_cache
        ):
            kind = "--no-kv-cache" if not cache.use_kv_cache else "the contiguous KV backend"
            raise ValueError(
                f"--preemption-mode swap needs the paged KV cache ({kind} has no blocks to swap)"
            )

    @staticmethod
    def from_kwargs(**kwargs) -> EngineConfig:
        """Build from flat keyword options (``LLM(model=..., block_size=8, ...)``)."""
        speculative = SpeculativeConfig.parse(kwargs.pop("speculative_config", None))
        lora = LoRAConfig.from_options(
            kwargs.pop("enable_lora", False),
            **{k: kwargs.pop(k) for k in LORA_OPTIONS if k in kwargs},
        )
        parts: dict[type, dict] = {
            ModelConfig: {},
            CacheConfig: {},
            SchedulerConfig: {},
            ParallelConfig: {},
        }
        fields = {cls: set(cls.__dataclass_fields__) for cls in parts}
        for key, value in kwargs.items():
            for cls, names in fields.items():
                if key in names:
                    parts[cls][key] = value
                    break
            else:
                raise TypeError(f"unknown engine option {key!r}")
        if (
            "kv_cache_memory" in parts[CacheConfig]
            and parts[CacheConfig]["kv_cache_memory"] is not None
        ):
            parts[CacheConfig]["kv_cache_memory"] = parse_bytes(
                parts[CacheConfig]["kv_cache_memory"]
            )
        if "swap_space" in parts[CacheConfig]:
            parts[CacheConfig]["swap_space"] = parse_bytes(parts[CacheConfig]["swap_space"])
        for cls, options in parts.items():
            wrong = wrong_number_type(cls, options)
            if wrong is not None:  # (max_num_seqs="4" failed as str < int, 7.5 inside torch)
                raise TypeError(f"engine option {wrong[1]}")
        return EngineConfig(
            model=ModelConfig(**parts[ModelConfig]),
            cache=CacheConfig(**parts[CacheConfig]),
            scheduler=SchedulerConfig(**parts[SchedulerConfig]),
            speculative=speculative,
            parallel=ParallelConfig(**parts[ParallelConfig]),
            lora=lora,
        )
