"""The engine loop: ``step() = schedule -> run -> update``. Single-threaded, no network I/O.

``LLMEngine`` owns the model, the KV cache, the scheduler and per-request output state. The
offline API (``infer.LLM``) drives it in a loop; the server drives it from one background
thread (``infer.engine.async_engine``).
"""

from __future__ import annotations

import collections
import functools
import gc
import logging
import os
import time
import weakref
from concurrent import futures
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING

from infer.config import CHECKPOINT_QUANTIZATIONS, EngineConfig
from infer.core.kv_transfer import KVPayload
from infer.core.lora_request import LoRARequest
from infer.core.messages import ModelRunnerOutput, RunnerSetup, SchedulerOutput
from infer.core.multimodal import ImageInput
from infer.core.outputs import RequestOutput
from infer.core.pooling_params import POOLING_SAMPLING, PoolingParams
from infer.core.request import Request, RequestStatus
from infer.core.sampling_params import InvalidRequestError, SamplingParams
from infer.core.validation import check_prompt
from infer.distributed import EngineDeadError
from infer.distributed.executor import TensorParallelWorkers
from infer.engine.detokenizer import IncrementalDetokenizer, byte_table
from infer.engine.scheduler import Scheduler, step_output
from infer.engine.trace import VIEWER_IDLE_SECONDS, StepTrace, TracePoll, take_snapshot
from infer.kv_cache.manager import ContiguousKVManager, KVManager, PagedKVManager
from infer.kv_cache.sizing import kv_bytes_per_token, kv_value_bytes
from infer.model.generation_config import describe as describe_defaults
from infer.model.generation_config import sampling_defaults
from infer.model.images import ImagePrompts
from infer.model.late_interaction import LateInteractionTokens
from infer.model.moe import describe_experts, expert_load, sparse_layers
from infer.model.parallel import check_tensor_parallel, get_tensor_parallel
from infer.model.pooling import PoolerConfig, load_pooler_config
from infer.runner.backend import WeightsConfig, device_backend
from infer.runner.cpu.prepack import model_weight_bytes
from infer.runner.quant import check_quantization
from infer.runner.runner import InFlightStep, TokenFeed, TokenRows
from infer.spec_decode import NgramProposer, Proposer

if TYPE_CHECKING:
    import torch

    from infer.model.spec import ModelSpec
    from infer.runner.lora.manager import LoRAManager
    from infer.structured.manager import StructuredOutputManager

logger = logging.getLogger("infer.engine")

SPEC_LOG_ENV = "INFER_SPEC_LOG_INTERVAL"
"""Seconds between the log lines on speculative decoding's acceptance (default 10)."""


@dataclass
class StepTimeTotals:
    """Cumulative seconds per part of ``step()``: where the time goes."""

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0  # scheduler update + detokenization + outputs
    propose: float = 0.0  # speculative decoding proposals for the next step

    @property
    def total(self) -> float:
        return (
            self.schedule + self.prepare + self.forward + self.sample + self.update + self.propose
        )


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions_total: int
    num_preemptions_recompute_total: int
    num_preemptions_swap_total: int
    recomputed_tokens_total: int
    swapped_out_blocks_total: int
    swapped_in_blocks_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prefix_cache_evictions_total: int
    finished_total: dict[str, int] = field(default_factory=dict)
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    # LoRA (vLLM's lora_requests_info): slots, and the adapters of running / waiting requests.
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # A mixture of experts' load: (layer, rows each of its experts ran on) since start-up.
    moe_expert_rows: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # Prefill/decode disaggregation: prompt tokens whose KV arrived in a payload (decode side).
    kv_transferred_tokens_total: int = 0

    @property
    def spec_decode_mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verified proposal run (accepted + the one sampled), or None."""
        if not self.spec_decode_num_drafts_total:
            return None
        accepted = self.spec_decode_num_accepted_tokens_total
        return 1 + accepted / self.spec_decode_num_drafts_total


@dataclass(frozen=True)
class KVCapacity:
    """What the KV budget buys, logged at start-up."""

    bytes_per_token: int
    block_size: int
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token


class _OutputState:
    """What of a request has been turned into text and sent out.

    With ``--stream-interval N`` an output goes out every N tokens; the tokens between wait
    here (``num_sent_tokens`` stays behind), detokenized only when they go out, except for a
    request with stop strings: its text is made every step (a stop string must end it at the
    token that completed it) and held in ``text`` until it goes out::

        output_token_ids  t0 t1 t2 t3 t4 t5 t6
                          ^sent ...............^ num_output_tokens
                          ^text ...........^ num_text_tokens (stop strings: every step)
                          ^grammar ...........^ num_grammar_tokens (every step)
    """

    def __init__(self, detokenizer: IncrementalDetokenizer) -> None:
        self.detokenizer = detokenizer
        self.num_sent_tokens = 0
        self.num_sent_logprobs = 0
        self.sent_prompt_logprobs = False
        self.num_text_tokens = 0  # tokens turned into text (held in ``text`` until sent)
        self.text = ""
        self.num_grammar_tokens = 0  # tokens a structured-output matcher has taken


@dataclass(frozen=True)
class _AheadStep:
    """A step launched ahead (async scheduling) and the requests it was planned for."""

    step: InFlightStep
    requests: list[Request]


def _encoder_config(config: EngineConfig, spec: ModelSpec, device: torch.device) -> EngineConfig:
    """An encoder's engine options: every token of an input attends to every other, so an input
    runs whole in one step and nothing of it can be reused (prefix caching off), on the torch
    attention path (its per-input attention; the Triton step's kernels are causal). What
    cannot hold for an encoder is a ``ValueError`` naming the option."""
    mc, sc = config.model, config.scheduler
    name = spec.architecture
    for wanted, option in (
        (sc.prefill_chunk_size is not None, "chunked prefill (--prefill-chunk-size)"),
        (config.speculative is not None, "speculative decoding (--speculative-config)"),
        (config.parallel.tensor_parallel_size > 1, "tensor parallelism"),
        (config.lora is not None, "LoRA adapters (--enable-lora)"),
        (mc.attention_backend == "triton", "--attention-backend triton (causal kernels)"),
        (sc.preemption_mode == "swap", "--preemption-mode swap (it caches no KV to swap)"),
    ):
        if wanted:
            raise ValueError(f"{name} is an encoder (each input runs whole, every token seeing "
                             f"every other): {option} does not apply to it")  # fmt: skip
    backend = "torch" if device.type == "cuda" else mc.attention_backend
    out = replace(config, model=replace(mc, attention_backend=backend),
                  cache=replace(config.cache, enable_prefix_caching=False))  # fmt: skip
    object.__setattr__(out, "prefix_caching_off_reason",
                       "an encoder's every token sees its whole input: no prefix is reusable")  # fmt: skip
    return out


def _vision_config(config: EngineConfig, spec: ModelSpec, device: torch.device) -> EngineConfig:
    """A vision-language model's engine options: its image rows take the modules' path (the
    Triton step's buffers hold token ids only: CUDA takes the torch path); what is not built
    for images yet is a ``ValueError`` naming the option. (Under tensor parallelism each rank
    computes the images itself, from the pixels its batch carries.)"""
    mc = config.model
    for wanted, option in (
        (config.lora is not None, "LoRA adapters (--enable-lora)"),
        (mc.attention_backend == "triton", "--attention-backend triton"),
    ):
        if wanted:
            raise ValueError(f"{spec.architecture} reads images: {option} is not supported with "
                             "a vision-language model yet")  # fmt: skip
    if device.type != "cuda":
        return config
    return replace(config, model=replace(mc, attention_backend="torch"))


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.tp_workers: TensorParallelWorkers | None = None
        try:
            self._setup(config)
        except BaseException:
            self.close()  # tensor parallelism: do not leave workers waiting on us
            raise

    def _setup(self, config: EngineConfig) -> None:
        from infer.engine.model_source import resolve_model_path
        from infer.model.loader import load_model_spec, quantized_format
        from infer.model.tokenizer import load_tokenizer

        self.config = config
        mc, cc, sc = config.model, config.cache, config.scheduler
        # Everything that differs by device is the backend's (see infer.runner.backend); the
        # tensor-parallel ranks build theirs in the same steps.
        self.backend = device_backend(mc.device, mc.seed)
        self.device = self.backend.device

        self.model_path = resolve_model_path(mc.model, mc.hf_overrides)
        # With no --model the built-in small model is served, under that name.
        self.model_name = mc.model or "small"
        self.spec = load_model_spec(self.model_path)
        if self.spec.is_encoder:
            config = self.config = _encoder_config(config, self.spec, self.device)
            mc, cc, sc = config.model, config.cache, config.scheduler
        if self.spec.images is not None:
            config = self.config = _vision_config(config, self.spec, self.device)
            mc = config.model
        # What a request's unset sampling fields take (the model's generation_config.json).
        self.sampling_defaults = sampling_defaults(
            self.model_path, mc.generation_config, dict(mc.override_generation_config)
        )
        if self.sampling_defaults:
            logger.info("default sampling parameters from the model's generation config: %s "
                        "(a request's own values win; --generation-config none uses infer's)",
                        describe_defaults(self.sampling_defaults))  # fmt: skip
        # How embedding requests pool (the model's sentence-transformers files, --pooler-config).
        self.pooler_config = load_pooler_config(self.model_path, dict(mc.pooler_config),
                                                encoder=self.spec.is_encoder)  # fmt: skip
        pooler = self.pooler_config
        if self.spec.token_labels:
            logger.info("a token classifier (%s), labels %s: it labels every input token "
                        "(/pooling and LLM.encode with task token_classify) and generates "
                        "nothing; each input runs whole, prefix caching off",
                        self.spec.architecture, ", ".join(self.spec.token_labels))  # fmt: skip
        elif self.spec.is_encoder and not self.spec.is_classifier:
            logger.info("an encoder (%s): it embeds (/v1/embeddings, LLM.embed) by %s pooling, "
                        "%s (%s), and generates nothing; each input runs whole, prefix caching "
                        "off%s", self.spec.architecture, pooler.pooling_type,
                        "normalized" if pooler.normalize else "not normalized", pooler.source,
                        "" if pooler.supported else f"; refused: {pooler.problem}")  # fmt: skip
        elif self.spec.is_classifier:
            logger.info("a sequence classifier (%s), labels %s: it serves /classify, LLM.classify"
                        "%s", self.spec.architecture, ", ".join(self.spec.labels),
                        " and scores pairs as a cross-encoder (/score, /rerank, LLM.score)"
                        if len(self.spec.labels) == 1 else "")  # fmt: skip
        elif pooler.source != PoolerConfig.source:  # (files or a flag said something)
            logger.info("embeddings (/v1/embeddings, LLM.embed): %s pooling, %s (%s)%s",
                        pooler.pooling_type, "normalized" if pooler.normalize else "not normalized",
                        pooler.source, "" if pooler.supported else
                        f"; refused: {pooler.problem}")  # fmt: skip
        if (not self.spec.is_encoder and not self.spec.is_classifier and pooler.supported
                and pooler.pooling_type == "MEAN" and cc.enable_prefix_caching):  # fmt: skip
            # (a cached prefix computes no hidden states: its tokens would be missing from the
            # mean)
            config = self.config = replace(config, cache=replace(cc, enable_prefix_caching=False))
            object.__setattr__(config, "prefix_caching_off_reason", "the model's embeddings are "
                               "the mean of every prompt token's state")  # fmt: skip
            cc = config.cache
            logger.info("prefix caching off: %s", config.prefix_caching_off_reason)
        self.dtype = self.backend.resolve_dtype(mc.dtype, self.spec.torch_dtype)
        t0 = time.perf_counter()
        self.checkpoint_quantization = quantized_format(self.model_path)
        self.load_quantization = load_quantization = self._load_quantization()
        check_quantization(load_quantization, self.device)
        self.tp_workers = self._start_tensor_parallel()
        if (
            not load_quantization
            and not mc.quantize_lm_head
            and not self._checkpoint_int8(None)
            and not self._keep_checkpoint_int4()
        ):  # (a kept vocabulary projection: it says)
            logger.warning("--no-quantize-lm-head does nothing without --quantization")
        self.model = self.backend.load_model(
            WeightsConfig(
                self.model_path,
                self.dtype,
                load_quantization,
                mc.quantize_lm_head,
                keep_checkpoint_int4=self._keep_checkpoint_int4(),
                checkpoint_int8=self._checkpoint_int8(load_quantization),
                int8_activations=self._gguf_int8_activations(),
            )
        )
        if self.checkpoint_quantization is not None:
            self._log_checkpoint_layers(load_quantization)
        # LoRA wraps the projections as they now are (packed or quantized).
        self.lora = self._build_lora()
        self.load_seconds = time.perf_counter() - t0
        self.tokenizer = load_tokenizer(mc.tokenizer or self.model_path)
        if self.spec.is_encoder:  # (a BERT pair's second text is token type 1)
            self.model.sep_token_id = self.tokenizer.sep_token_id
        # A ColBERT model's query and document encoding, in its tokenizer's ids.
        self.late_interaction = None
        if self.pooler_config.late_interaction is not None:
            self.late_interaction = LateInteractionTokens.from_tokenizer(
                self.pooler_config.late_interaction, self.tokenizer
            )
            li = self.pooler_config.late_interaction
            logger.info("a ColBERT model: every token's vector (/pooling, LLM.encode) and "
                        "MaxSim scores (/score, /rerank, LLM.score); queries of %d tokens%s, "
                        "documents of up to %d", li.query_length, " (expanded)"
                        if li.query_expansion else "", li.document_length)  # fmt: skip
        byte_table(self.tokenizer)  # built now, not at the first request (~1 ms per 1k ids)
        # A vision-language model's images: how prompts take them (model/images.py).
        self.image_prompts: ImagePrompts | None = None
        layout = self.spec.images
        if layout is not None:
            self.image_prompts = ImagePrompts(self.model_path, self.spec, self.tokenizer)
            most = max((layout.tokens_for(p) for p in layout.pinpoints), default=0)
            tiles = (f" and its tiles: {layout.base_tokens}-{most} tokens by its size"
                     if layout.pinpoints else "")  # fmt: skip
            logger.info("a vision-language model (%s): an image is %d tokens%s (%s in the "
                        "prompt), read at %dx%d pixels", self.spec.architecture,
                        layout.base_tokens, tiles, self.image_prompts.token, layout.image_size,
                        layout.image_size)  # fmt: skip

        self.max_model_len = mc.max_model_len or self.spec.max_position_embeddings
        if self.max_model_len > self.spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.spec.max_position_embeddings}"
            )
        eos = self.spec.eos_token_ids
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_token_ids = tuple(eos)

        self.capacity = self._plan_kv()
        self.kv_manager: KVManager
        self.num_swap_blocks = 0
        if cc.kv_cache_backend == "contiguous":
            self.kv_manager = ContiguousKVManager(self.capacity.num_blocks, self.max_model_len)
        else:
            if sc.preemption_mode == "swap":
                block_bytes = self.capacity.bytes_per_token * self.capacity.block_size
                self.num_swap_blocks = cc.swap_space // block_bytes
            self.kv_manager = PagedKVManager(
                self.capacity.num_blocks,
                cc.block_size,
                cc.enable_prefix_caching,
                num_swap_blocks=self.num_swap_blocks,
            )
        setup = RunnerSetup(
            self.capacity.num_blocks,
            self.capacity.block_size,
            cc.kv_cache_dtype,
            self.num_swap_blocks,
            mc.attention_backend,
            sc.max_num_seqs,
            sc.max_num_batched_tokens,
            self.max_model_len,
            # NOTE: which adapters a step's rows use is host data a CUDA graph cannot replay.
            enforce_eager=mc.enforce_eager or self.lora is not None,
            num_spec_tokens=(
                config.speculative.num_speculative_tokens if config.speculative else 0
            ),
        )
        if self.tp_workers is not None:
            self.tp_workers.broadcast(setup)
        self.scheduler = Scheduler(
            sc, cc, self.kv_manager, max_loras=config.lora.max_loras if config.lora else 0
        )
        self.runner = self.backend.build_runner(setup)
        if self.spec.is_classifier:  # (what its head reads: a decoder's, its last token)
            self.runner.pooling_type = (
                self.model.classifier_pooling if self.spec.is_encoder else "LAST"
            )
        else:
            if self.pooler_config.supported:
                self.runner.pooling_type = self.pooler_config.pooling_type
            from infer.model.dense import EmbeddingProjection

            pooler, hidden, device = self.pooler_config, self.spec.hidden_size, self.runner.device
            if pooler.dense:  # (sentence-transformers' Dense modules: token embeddings take
                # them where only the pooling is refused)
                self.runner.embed_projection = EmbeddingProjection(pooler.dense, hidden, device)
            if pooler.token_dense:  # (BGE-M3's multi-vector projection, past the first row)
                self.runner.token_projection = EmbeddingProjection(pooler.token_dense, hidden,
                                                                   device)  # fmt: skip
            self.runner.token_rows = self._token_rows()
            if self.spec.token_labels:  # (a token classifier's own head)
                self.runner.token_classifier = self.model.token_classifier
            elif pooler.sparse is not None:  # (BGE-M3's sparse weights: float32, as its others)
                sparse = EmbeddingProjection((pooler.sparse,), hidden, device)
                self.runner.token_classifier = lambda rows: sparse(rows.float())
        self.kv_cache = self.runner.kv_cache
        self.runner.workers = self.tp_workers
        self.runner.lora = self.lora
        self.proposer = self._build_proposer()
        # Last: the graphs' memory comes out of what the weights, KV cache and draft left.
        self.runner.capture_graphs()
        # A mixture of experts' load statistics (get_stats), from the requests' steps only.
        self._moe_layers = sparse_layers(self.model)
        for _, layer in self._moe_layers:
            layer.expert_rows.zero_()
        # Constrained decoding: built on the first request that asks for it.
        self.structured: StructuredOutputManager | None = None
        self._compiling: dict[str, tuple[Request, futures.Future]] = {}
        self._spec_logged_at: tuple[float, int, int, int] = (time.perf_counter(), 0, 0, 0)
        self._spec_log_interval = float(os.environ.get(SPEC_LOG_ENV, "10"))
        self._states: dict[str, _OutputState] = {}
        self._pending: list[RequestOutput] = []
        # On the GPU step the outputs of a step's requests (detokenization, stop strings, the
        # RequestOutputs) are made during the next step's forward pass, which the host would
        # otherwise wait out: see step(). Not with speculative decoding (proposals read the
        # outputs at once) nor for steps with constrained requests (their grammars advance at
        # once).
        self._defer_outputs = self.runner.cuda_step is not None and self.proposer is None
        self._stream_interval = config.scheduler.stream_interval
        self._deferred: list[tuple[Request, _OutputState]] = []
        # Async scheduling (the Triton step, one device): a decode step launched while the step
        # before runs, with the requests it was planned for (see _launch_ahead).
        self._async = (
            config.model.async_scheduling
            and self.runner.cuda_step is not None
            and self.proposer is None
            and self.tp_workers is None
            and self.lora is None
        )
        self._ahead: _AheadStep | None = None
        self.step_times = StepTimeTotals()
        # Step records for the live view or a recorded run; None (and no cost) otherwise.
        self.trace: StepTrace | None = None
        self.weights_bytes = model_weight_bytes(self.model)
        self._log_startup()

    def _build_lora(self) -> LoRAManager | None:
        """``--enable-lora``: wrap the projections and read the start-up adapters."""
        if self.config.lora is None:
            return None
        from infer.runner.lora.manager import LoRAManager  # refuses what it cannot adapt

        lora = LoRAManager(self.model, self.config.lora)
        lora.in_use = self._lora_loads_in_use
        logger.info(
            "LoRA: %d slots of rank up to %d, %d adapters in host memory at most; loaded: %s",
            self.config.lora.max_loras,
            self.config.lora.max_lora_rank,
            self.config.lora.host_capacity,
            ", ".join(lora.registered) or "none yet",
        )
        return lora

    def _lora_loads_in_use(self) -> set[int]:
        """The adapter loads of the live requests (kept in host memory while they run)."""
        live = [*self.scheduler.requests.values(), *(r for r, _ in self._compiling.values())]
        return {r.lora_id for r in live if r.lora_id is not None}

    def _resolve_lora(self, lora_request: LoRARequest | str | None) -> tuple[str, int] | None:
        """The adapter a request runs with: its name and load id (its adapter in host memory);
        a new ``LoRARequest`` is read and checked now. Raises ``InvalidRequestError`` naming
        the problem."""
        if lora_request is None:
            return None
        from infer.runner.lora.adapter import LoRAError

        if self.lora is None:
            raise InvalidRequestError(
                "LoRA adapters need an engine started with --enable-lora (enable_lora=True)",
                param="model",
            )
        if isinstance(lora_request, str):
            if not self.lora.is_registered(lora_request):
                raise InvalidRequestError(
                    f"LoRA adapter {lora_request!r} is not loaded", param="model"
                )
            name, param = lora_request, "model"
        else:
            name, param = lora_request.lora_name, "lora_request"
        try:
            if isinstance(lora_request, str):
                return name, self.lora.acquire(name)
            return name, self.lora.register(lora_request)
        except (LoRAError, OSError) as e:
            raise InvalidRequestError(str(e), param=param) from None

    # ---- LoRA adapters (the server's /v1/load_lora_adapter, /v1/unload_lora_adapter) ---------
    def load_lora_adapter(self, name: str, path: str, replace: bool = False) -> None:
        """Read, check and register an adapter (``replace``: over one of that name);
        ``ValueError`` (``LoRAError``) says why not."""
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine started with --enable-lora")
        self.lora.register(LoRARequest(name, 0, path), replace=replace)

    def unload_lora_adapter(self, name: str) -> None:
        """Forget an adapter (``KeyError`` if it is not loaded); requests already queued or
        running with it finish with it."""
        if self.lora is None or not self.lora.is_registered(name):
            raise KeyError(name)
        self.lora.unregister(name)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """Registered adapters: name -> path."""
        if self.lora is None:
            return {}
        return {name: r.lora_path for name, r in self.lora.registered.items()}

    @property
    def lora_parents(self) -> dict[str, str]:
        """Adapters registered with a ``base_model_name`` (vLLM's JSON ``--lora-modules``): name
        -> that name, which ``/v1/models`` shows as the adapter's ``parent``."""
        if self.lora is None:
            return {}
        return {n: r.base_model_name for n, r in self.lora.registered.items() if r.base_model_name}

    def _log_checkpoint_layers(self, load_quantization: str | None) -> None:
        """A GPTQ / AWQ checkpoint or GGUF file: say what each layer became (its 4-bit layers
        are kept as they are unless ``--quantization`` requantizes the model)."""
        from infer.model.gguf_folder import gguf_source

        q = self.checkpoint_quantization
        assert q is not None
        kept = self.backend.kept_int4
        modes = sorted({m.mode + (" x int8 activations" if m.int8_activations else "")
                        for m in kept})  # fmt: skip
        dtype = str(self.dtype).removeprefix("torch.")
        if q.method == "gguf":
            gguf_file = gguf_source(self.model_path)
            counts = self.model.checkpoint_tensor_types.items()
            types = ", ".join(f"{n} {kind}" for kind, n in counts)
            int8 = len(self.backend.checkpoint_int8)
            widths = collections.Counter(m.bits for m in kept)
            bits = ", ".join(f"{n} in {b} bits" for b, n in sorted(widths.items())) or "none"
            logger.info("GGUF file %s (%s): linear layers kept as stored: %s (%s), %d held in "
                        "int8, the others dequantized to %s", gguf_file, types, bits,
                        ", ".join(modes) or "none", int8, dtype)  # fmt: skip
            return
        logger.info(
            "%s checkpoint (%d-bit, group %d%s): %d linear layers kept in 4 bits (%s), the "
            "others dequantized to %s",
            q.method.upper(),
            q.bits,
            q.group_size,
            ", act-order" if q.desc_act else "",
            len(kept),
            ", ".join(modes) or "none",
            dtype,
        )

    def _gguf_kernels(self) -> bool:
        """Whether a GGUF file's 4-bit layers are held as stored: where they have their CPU
        kernel (a bf16 model on a CPU with AVX-512 BF16 or AVX2) unless ``--gguf-dequantize``;
        elsewhere they are held dequantized in the model's dtype, which this device's own
        matmuls run faster than a per-product dequantization."""
        import torch

        from infer.runner.int4 import int4_kernel_available

        return (
            not self.config.model.gguf_dequantize
            and self.dtype == torch.bfloat16
            and int4_kernel_available(self.device)
        )

    def _keep_checkpoint_int4(self) -> bool:
        """Whether the checkpoint's 4-bit layers stay 4-bit: a GPTQ / AWQ folder's always (its
        memory), a GGUF file's where the kernel runs them (:meth:`_gguf_kernels`)."""
        q = self.checkpoint_quantization
        return q is not None and (q.method != "gguf" or self._gguf_kernels())

    def _gguf_held_by_kernels(self, load_quantization: str | None) -> bool:
        """Whether this is a GGUF file whose layers the CPU kernels hold as stored: where they
        run (:meth:`_gguf_kernels`; float32 keeps llama.cpp's exact values), on one rank (the
        tensor-parallel ranks load as they always do), not requantized at load."""
        q = self.checkpoint_quantization
        return (
            q is not None
            and q.method == "gguf"
            and load_quantization is None
            and self.tp_size == 1
            and self._gguf_kernels()
        )

    def _gguf_int8_activations(self) -> bool:
        """Whether a GGUF file's kept 4-bit layers take the w4a8 kernel and its 5-bit ones are
        kept too (``--gguf-int8-activations``, where the CPU has AVX-512 VNNI)."""
        from infer.runner.int4 import int4_kernel_available

        return (
            self.config.model.gguf_int8_activations
            and self._gguf_held_by_kernels(self.load_quantization)
            and int4_kernel_available(self.device, int8_activations=True)
        )

    def _checkpoint_int8(self, load_quantization: str | None) -> bool:
        """Whether a GGUF file's layers of types the 4-bit kernel cannot take are held in int8
        (``--gguf-int8``; unset: a decoder's are where the CPU has the int8 kernel, an
        encoder's not: :func:`~infer.runner.quant.gguf_int8_default`)."""
        from infer.runner.quant import gguf_int8_default

        wanted = self.config.model.gguf_int8
        if wanted is None:
            wanted = gguf_int8_default(self.spec.is_encoder, self.device)
        return wanted and self._gguf_held_by_kernels(load_quantization)

    def _load_quantization(self) -> str | None:
        """The method to quantize the weights with at load (None: none). ``--quantization
        gptq|awq|gguf`` names the checkpoint's own format: checked, nothing to do at load."""
        asked = self.config.model.quantization
        ckpt = self.checkpoint_quantization
        if asked in CHECKPOINT_QUANTIZATIONS:
            if ckpt is None or ckpt.method != asked:
                have = f"a {ckpt.method} checkpoint" if ckpt else "not a quantized checkpoint"
                raise ValueError(f"--quantization {asked}: {self.model_path} is {have}")
            return None
        return asked

    @property
    def tp_size(self) -> int:
        return self.config.parallel.tensor_parallel_size

    def _start_tensor_parallel(self) -> TensorParallelWorkers | None:
        """With ``tensor_parallel_size`` N > 1: spawn ranks 1..N-1 and join their group (this
        process is rank 0), after checking the model and options can be split."""
        size = self.tp_size
        if size == 1:
            return None
        check_tensor_parallel(size, self.spec)
        if self.config.speculative is not None:
            raise ValueError("speculative decoding does not run with tensor parallelism yet")
        if get_tensor_parallel().size > 1:
            gc.collect()  # an engine dropped but not yet collected: its finalizer closes it
        if get_tensor_parallel().size > 1:
            raise RuntimeError(
                "another tensor-parallel engine is running in this process: close it first "
                "(llm.close() or llm.shutdown(), or build it in a `with LLM(...) as llm:` block)"
            )
        workers = TensorParallelWorkers(
            size,
            self.model_path,
            self.dtype,
            self.device,
            self.load_quantization,
            self.config.model.quantize_lm_head,
            self.config.model.seed,
        )
        # Dropping the engine, or the interpreter's exit, stops the ranks and leaves the group,
        # so the next tensor-parallel engine in this process starts cleanly.
        self._tp_finalizer = weakref.finalize(self, workers.close)
        return workers

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and drop the CUDA graphs (the engine
        cannot step afterwards)."""
        if self.tp_workers is not None:
            self.tp_workers.close()
            self._tp_finalizer.detach()
        runner = getattr(self, "runner", None)
        if runner is not None:
            if getattr(self, "_ahead", None) is not None:  # a step still on the device
                self._ahead = None
                self.backend.synchronize()
            runner.close()

    def _build_proposer(self) -> Proposer | None:
        spec_cfg = self.config.speculative
        if spec_cfg is None:
            return None
        if not self.config.cache.use_kv_cache:
            raise ValueError("speculative decoding needs the KV cache (drop --no-kv-cache)")
        if self.spec.is_classifier:
            raise ValueError(f"speculative decoding drafts tokens to generate; this model "
                             f"({self.spec.architecture}) is a sequence classifier, which "
                             "generates none (drop --speculative-config)")  # fmt: skip
        k = spec_cfg.num_speculative_tokens
        if spec_cfg.method == "ngram":
            logger.info(
                "speculative decoding: n-gram proposals, %d tokens, lookup %d..%d",
                k,
                spec_cfg.prompt_lookup_min,
                spec_cfg.prompt_lookup_max,
            )
            return NgramProposer(
                k, spec_cfg.prompt_lookup_min, spec_cfg.prompt_lookup_max, spec_cfg.adaptive
            )
        from infer.spec_decode.draft import DraftProposer

        assert self._draft_path is not None
        return DraftProposer(
            self._draft_path,
            k,
            backend=self.backend,
            max_model_len=self.max_model_len,
            num_tokens=self.capacity.num_tokens,
            block_size=self.config.cache.block_size,
            target_vocab_size=self.spec.vocab_size,
            target_tokenizer=self.tokenizer,
            adaptive=spec_cfg.adaptive,
        )

    # ---- capacity -----------------------------------------------------------------------------
    def _plan_kv(self) -> KVCapacity:
        cc, sc = self.config.cache, self.config.scheduler
        s = self.spec
        value_bytes, scale_bytes = kv_value_bytes(cc.kv_cache_dtype, self.dtype.itemsize)
        # Per rank: each tensor-parallel rank caches only its share of the KV heads.
        kv_heads = s.num_kv_heads // self.tp_size
        bpt = kv_bytes_per_token(s.num_layers, kv_heads, s.head_dim, value_bytes, scale_bytes)
        block_size = self.max_model_len if cc.kv_cache_backend == "contiguous" else cc.block_size
        if cc.num_kv_blocks is not None:
            return KVCapacity(bpt, block_size, cc.num_kv_blocks)
        if s.is_encoder:  # blocks to count admissions by, no memory (build_runner: no layers)
            full = -(-self.max_model_len // block_size)
            return KVCapacity(0, block_size, max(sc.max_num_seqs, 1) * full)
        # A draft model's KV pool holds twice the target's tokens (its proposals on top): every
        # budget below is shared in proportion to the bytes each side spends per token.
        shared_bpt = bpt + 2 * self._draft_bytes_per_token()
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        else:
            # A draft model, loaded after this plan, takes its weights out of the same memory.
            # Every slot at full length, in whole blocks (a block size that does not divide
            # the context would otherwise leave one sequence a block short of it).
            full_len = -(-self.max_model_len // block_size) * block_size
            budget = self.backend.kv_budget(
                sc.max_num_seqs * full_len * shared_bpt,
                cc.gpu_memory_utilization,
                reserve=self._draft_weight_bytes(),
            )
        budget = budget * bpt // shared_bpt
        num_blocks = budget // (bpt * block_size)
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) is smaller than one block "
                f"({bpt * block_size} bytes: {block_size} tokens x {bpt} bytes per token)"
            )
        return KVCapacity(bpt, block_size, int(num_blocks))

    @functools.cached_property
    def _draft_path(self) -> Path | None:
        """The draft model's folder (speculative decoding with a draft model), else None."""
        spec_cfg = self.config.speculative
        if spec_cfg is None or spec_cfg.method != "draft_model" or spec_cfg.model is None:
            return None
        from infer.engine.model_source import resolve_model_path
        from infer.model.folders import ModelLoadError

        try:
            return resolve_model_path(spec_cfg.model)
        except ModelLoadError as e:  # (which model: the draft, not the one being served)
            raise ModelLoadError(f"the draft model of --speculative-config: {e}") from e

    def _draft_bytes_per_token(self) -> int:
        path = self._draft_path
        if path is None:
            return 0
        from infer.model.loader import load_model_spec

        d = load_model_spec(path)
        return kv_bytes_per_token(d.num_layers, d.num_kv_heads, d.head_dim, self.dtype.itemsize)

    def _draft_weight_bytes(self) -> int:
        """The draft checkpoint's weight files (an upper bound: they may hold float32)."""
        path = self._draft_path
        return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path else 0

    def _log_startup(self) -> None:
        cap = self.capacity
        logger.info(
            "loaded %s (%s, %d layers, %d kv heads x %d) in %.1fs: weights %.1f MiB %s on %s",
            self.model_path,
            self.spec.architecture,
            self.spec.num_layers,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            self.load_seconds,
            self.weights_bytes / 2**20,
            str(self.dtype).removeprefix("torch."),
            self.device,
        )
        experts = describe_experts(self.model, model_weight_bytes)
        if experts is not None:
            logger.info(experts)
        cc = self.config.cache
        logger.info(
            "KV cache (%s): %d bytes/token, %d blocks x %d tokens = %d tokens (%.1f MiB); "
            "max concurrency at %d tokens: %.1f; prefix caching %s",
            self.config.cache.kv_cache_dtype
            if self.config.cache.kv_cache_dtype != "auto"
            else str(self.dtype).removeprefix("torch."),
            cap.bytes_per_token,
            cap.num_blocks,
            cap.block_size,
            cap.num_tokens,
            cap.total_bytes / 2**20,
            self.max_model_len,
            cap.num_tokens / self.max_model_len,
            "on"
            if cc.enable_prefix_caching
            else f"off ({self.config.prefix_caching_off_reason or 'as asked'})",
        )
        if cap.num_tokens < self.max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than the context (%d): a request without "
                "max_tokens stops there and a longer one is refused (--kv-cache-memory for a "
                "bigger cache, --max-model-len for a shorter context)",
                cap.num_tokens,
                self.max_model_len,
            )

    # ---- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | str | None = None,
        export_kv: bool = False,
        kv_payload: KVPayload | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> None:
        """Queue one sequence. Raises ``InvalidRequestError`` naming the problem.

        ``images``: a vision-language model's images, each's placeholder run in the prompt
        (:meth:`infer.model.images.ImagePrompts.expand` makes both).

        ``lora_request``: the adapter to run with, a ``LoRARequest`` (read now if new) or the
        name of a loaded one. Prefill/decode disaggregation (``infer.core.kv_transfer``):
        ``export_kv``: when the request ends normally, its prompt KV is copied out in that same
        step (its final output's ``kv_payload``) before its blocks are freed; ``kv_payload`` is
        the prompt's KV computed by another engine (one that does not fit this prompt or this
        cache is set aside: the prompt is computed here).

        ``params`` a ``PoolingParams``: an embedding request (its final output's
        ``embedding``; see ``infer.core.pooling_params``)."""
        n = len(prompt_token_ids)
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            # (as vLLM: a priority the fcfs policy would ignore is refused, not dropped)
            raise InvalidRequestError(
                f"priority {priority} needs the priority scheduling policy "
                "(--scheduling-policy priority); this engine serves first come, first served",
                param="priority",
            )
        pooling = None
        if not isinstance(params, PoolingParams) and self.spec.is_classifier:
            raise InvalidRequestError(self._classifier_only(), param="prompt")
        if not isinstance(params, PoolingParams) and self.spec.is_encoder:
            raise InvalidRequestError(self.spec.encoder_only(), param="prompt")
        if isinstance(params, PoolingParams):
            pooling, params = self._pooling(params), POOLING_SAMPLING
            if pooling.attended_tokens is not None and (
                not self.spec.is_encoder or pooling.attended_tokens > n
            ):
                raise InvalidRequestError(f"attended_tokens ({pooling.attended_tokens}) must be "
                                          f"at most the input's {n} tokens, on an encoder",
                                          param="attended_tokens")  # fmt: skip
            if export_kv or kv_payload is not None:
                raise InvalidRequestError("an embedding request has no decode phase to hand "
                                          "its KV to", param="input")  # fmt: skip
        check_prompt(prompt_token_ids, self.max_model_len, vocab_size=self.spec.vocab_size,
                     param="input" if pooling else "prompt",
                     generates=pooling is None)  # fmt: skip
        self._check_images(prompt_token_ids, images, pooling is not None)
        params = params.with_bad_words_tokenized(
            lambda text: self.tokenizer.encode(text, add_special_tokens=False)
        )
        for param, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                           ("allowed_token_ids", params.allowed_token_ids or ()),
                           ("stop_token_ids", params.stop_token_ids),
                           ("bad_words_token_ids",
                            [t for seq in params.bad_words_token_ids for t in seq])):  # fmt: skip
            too_big = [t for t in ids if t >= self.spec.vocab_size]
            if too_big:
                raise InvalidRequestError(
                    f"{param} names token id {too_big[0]}, past the vocabulary "
                    f"({self.spec.vocab_size} tokens)",
                    param=param,
                )
        banned = {seq[0] for seq in params.bad_words_token_ids if len(seq) == 1}
        if params.allowed_token_ids and set(params.allowed_token_ids) <= banned:
            raise InvalidRequestError(
                "bad_words ban every one of allowed_token_ids: nothing could be sampled",
                param="bad_words",
            )
        if request_id in self.scheduler.requests or request_id in self._compiling:
            raise InvalidRequestError(
                f"request id {request_id!r} is already in use", param="request_id"
            )
        if request_id in self._states:  # ended, its last output still deferred: make it now
            self._pending.extend(self._drain_deferred())
        lora = self._resolve_lora(lora_request)
        request = Request(
            request_id,
            [int(t) for t in prompt_token_ids],
            params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt,
            arrival_time=arrival_time,
            max_model_len=self.max_model_len,
            default_len=self.capacity.num_tokens,
            default_max_tokens=self.sampling_defaults.get("max_tokens"),
            lora_name=lora[0] if lora else None,
            lora_id=lora[1] if lora else None,
            export_kv=export_kv,
            kv_payload=self._check_payload(request_id, prompt_token_ids, kv_payload, images),
            pooling=pooling,
            images=tuple(images),
        )
        longest = n + request.max_new_tokens
        # (the last output token is never fed back: its KV is never written)
        if not self.kv_manager.can_ever_fit(longest - 1):
            cap = self.capacity
            held = f"{cap.num_tokens} tokens in {cap.num_blocks} blocks"
            if pooling is not None:
                raise InvalidRequestError(
                    f"the input ({n} tokens) is more than the KV cache can ever hold ({held})",
                    param="input",
                )
            if params.max_tokens is None:  # (it ran up to what the cache holds: see Request)
                raise InvalidRequestError(
                    f"prompt ({n} tokens) leaves no room for an output token in the KV cache "
                    f"({held})",
                    param="prompt",
                )
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens can reach {longest} tokens, whose KV (all but "
                f"the last token's) is more than the KV cache can ever hold ({held})",
                param="max_tokens",
            )
        future = None
        if params.structured_outputs is not None:
            future = self._structured_manager().submit(request)
            if params.allowed_token_ids:
                self._check_first_token(request, future)
        self._states[request_id] = _OutputState(
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params)
        )
        if future is not None:
            # NOTE: the request joins the scheduler once its matcher is built (off this thread
            # for a new schema), at the start of a step.
            self._compiling[request_id] = (request, future)
            self._admit_compiled(wait=False)
            return
        self.scheduler.add_request(request)

    def _check_first_token(self, request: Request, future: futures.Future) -> None:
        """A constrained request with ``allowed_token_ids``: its matcher built now (on this
        thread), and ``InvalidRequestError`` if none of those ids may start the output (every
        token would be masked: the sampler would pick garbage the grammar then refuses). A
        grammar that fails to build is left to :meth:`_admit_compiled`."""
        from infer.structured.bitmask import allows

        assert self.structured is not None
        try:
            matcher = future.result()
        except Exception:  # noqa: BLE001 - reported as any failed build is
            return
        self.structured.attach(request.request_id, matcher)
        try:
            rows_mask = self.structured.bitmask([request])
        finally:
            self.structured.forget(request.request_id)
        assert rows_mask is not None
        words = rows_mask[1][0].tolist()
        if not any(allows(words, t) for t in request.sampling_params.allowed_token_ids):
            raise InvalidRequestError(
                "none of allowed_token_ids may start the structured output: nothing could be "
                "sampled",
                param="allowed_token_ids",
            )

    def _token_rows(self) -> TokenRows:
        """Which rows this model's per-token outputs cover: BGE-M3's token embeddings skip the
        first (``PoolerConfig.token_first``), its sparse weights the first and last where they
        are its tokenizer's ``<s>`` / ``</s>`` (FlagEmbedding leaves their weights out); a
        token classifier's logits cover every token, through a softmax over its labels (a
        sigmoid for one label), BGE-M3's through a ReLU."""
        pooler, tok = self.pooler_config, self.tokenizer
        if self.spec.token_labels:
            return TokenRows(pooler.token_first, None,
                             "sigmoid" if len(self.spec.token_labels) == 1 else "softmax")  # fmt: skip
        first = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
        last = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
        return TokenRows(pooler.token_first, (first, last), "relu")

    @property
    def token_classes(self) -> tuple[str, ...]:
        """What a token classification gives per token: the token classifier's labels,
        ``("weight",)`` for BGE-M3's sparse weights, ``()`` where this model gives none."""
        if self.spec.token_labels:
            return self.spec.token_labels
        # (a sequence classifier's head is the one it serves, whatever lies beside it)
        sparse = self.pooler_config.sparse is not None and not self.spec.is_classifier
        return ("weight",) if sparse else ()

    def _check_images(self, ids: list[int], images: tuple[ImageInput, ...], pooled: bool) -> None:
        """A prompt's images sit on placeholder runs of their size, in order, and every
        placeholder token has its image (an unfilled one would be read as a word)."""
        layout = self.spec.images
        if images and layout is None:
            raise InvalidRequestError(f"this model ({self.spec.architecture}) reads no images",
                                      param="images")  # fmt: skip
        if layout is None:
            return
        if images and pooled:
            raise InvalidRequestError("embeddings of prompts with images are not served",
                                      param="images")  # fmt: skip
        import numpy as np

        end = 0
        for i, image in enumerate(images):
            pixels = image.pixel_values
            if not isinstance(pixels, np.ndarray) or pixels.dtype != np.float32:
                raise InvalidRequestError(f"image {i}: pixels are a float32 numpy array "
                                          f"(ImagePrompts.pixels), not {type(pixels).__name__}",
                                          param="images")  # fmt: skip
            size = image.size
            if layout.pinpoints and not (isinstance(size, tuple) and len(size) == 2
                                         and all(isinstance(n, int) and n > 0 for n in size)):  # fmt: skip
                raise InvalidRequestError(f"image {i}: LLaVA-NeXT needs the image's size "
                                          f"(height, width), not {size!r}", param="images")  # fmt: skip
            want = layout.pixel_shape(image.size)
            if tuple(pixels.shape) != want:
                raise InvalidRequestError(f"image {i}: pixels of shape {tuple(pixels.shape)}, "
                                          f"the model reads {want}", param="images")  # fmt: skip
            length = layout.tokens_for(image.size)
            span = ids[image.offset : image.end]
            if (image.length != length or image.offset < end
                    or span != [layout.token_id] * length):  # fmt: skip
                raise InvalidRequestError(f"image {i}: its placeholders (from {image.offset}, "
                                          f"{image.length}) are not a run of {length} image "
                                          "tokens in the prompt after the image before it",
                                          param="images")  # fmt: skip
            end = image.end
        count = ids.count(layout.token_id)
        if count != sum(image.length for image in images):
            raise InvalidRequestError(f"the prompt holds {count} image placeholder tokens (id "
                                      f"{layout.token_id}) and {len(images)} image"
                                      f"{'s' * (len(images) != 1)} of "
                                      f"{sum(image.length for image in images)} tokens: every "
                                      "placeholder needs its image", param="prompt")  # fmt: skip

    def _pooling(self, params: PoolingParams) -> PoolingParams:
        """An embedding request's parameters with the model's ``normalize`` where it left it
        unset; ``InvalidRequestError`` where this model cannot give what it asks."""
        spec = self.spec
        if params.task == "token_classify" or spec.token_labels:
            return self._token_classification(params)
        if spec.is_classifier != (params.task == "classify"):
            if spec.is_classifier:
                raise InvalidRequestError(self._classifier_only(), param="input")
            gives = ("gives token embeddings (/pooling, LLM.encode)"
                     if self.late_interaction is not None else
                     "embeds (/v1/embeddings, LLM.embed)")  # fmt: skip
            raise InvalidRequestError(
                f"this model ({spec.architecture}) has no classification head: it {gives}; "
                "classifying needs a *ForSequenceClassification model",
                param="input",
            )
        if params.task == "classify":
            if params.dimensions is not None or params.normalize:
                raise InvalidRequestError(
                    "a classification is the model's logits, one per label: it takes neither "
                    "dimensions nor normalize",
                    param="dimensions" if params.dimensions is not None else "normalize",
                )
            return replace(params, normalize=False)
        pooler = self.pooler_config
        if params.task == "embed" and self.late_interaction is not None:
            raise InvalidRequestError(
                "this is a ColBERT model: it gives every token's vector (/pooling with task "
                "token_embed, LLM.encode) and scores by late interaction (/score, /rerank, "
                "LLM.score), not one vector per input",
                param="input",
            )
        if params.task == "token_embed" and not spec.is_encoder:
            raise InvalidRequestError(
                f"this model ({spec.architecture}) is a decoder: token embeddings (one vector "
                "per input token) are served for encoders (BERT-family models, ColBERT)",
                param="input",
            )
        if params.task == "token_embed" and pooler.tokens_problem is not None:
            raise InvalidRequestError(f"{pooler.tokens_problem}: infer cannot give its token "
                                      "embeddings", param="input")  # fmt: skip
        if not pooler.supported and params.task == "embed":
            pools, default = (("an encoder's CLS, MEAN or LAST token pooling", "CLS")
                              if spec.is_encoder else
                              ("the last token's final hidden state or the mean of every "
                               "token's", "LAST"))  # fmt: skip
            raise InvalidRequestError(
                f"{pooler.problem}; infer embeds with {pools} "
                f'(--pooler-config \'{{"pooling_type": "{default}"}}\' serves it so)',
                param="input",
            )
        size = self.embedding_size
        if params.task == "token_embed":
            size = self.token_embedding_size
        if params.dimensions is not None and params.dimensions > size:
            raise InvalidRequestError(
                f"dimensions ({params.dimensions}) is more than the model's embedding size "
                f"({size})",
                param="dimensions",
            )
        if params.normalize is None:
            params = replace(params, normalize=pooler.normalize)
        return params

    def _token_classification(self, params: PoolingParams) -> PoolingParams:
        """A ``token_classify`` request's parameters (or any request to a token classifier,
        which gives nothing else); ``InvalidRequestError`` naming what it cannot have."""
        spec, pooler = self.spec, self.pooler_config
        if params.task != "token_classify":  # (a *ForTokenClassification model)
            raise InvalidRequestError(
                f"this model ({spec.architecture}) is a token classifier: it gives every input "
                "token's label probabilities (/pooling with task token_classify, "
                "LLM.encode(pooling_task='token_classify')), not "
                f"{'a classification' if params.task == 'classify' else 'embeddings'}",
                param="input",
            )
        if not self.token_classes:
            why = f" ({pooler.sparse_problem})" if pooler.sparse_problem is not None else ""
            raise InvalidRequestError(
                f"this model ({spec.architecture}) has no token classification head{why}: "
                "token_classify needs a *ForTokenClassification model (an NER tagger) or "
                "BGE-M3's sparse_linear.pt",
                param="input",
            )
        if params.dimensions is not None or params.normalize:
            raise InvalidRequestError(
                "a token classification is each token's logits, one per label: it takes "
                "neither dimensions nor normalize",
                param="dimensions" if params.dimensions is not None else "normalize",
            )
        if params.attended_tokens is not None:
            raise InvalidRequestError("attended_tokens is for token embeddings (a ColBERT "
                                      "query's), not token classifications",
                                      param="attended_tokens")  # fmt: skip
        return replace(params, normalize=False)

    @property
    def token_embedding_size(self) -> int:
        """How many values a token embedding has (BGE-M3's multi-vector projection's, else
        as :attr:`embedding_size`)."""
        return self.pooler_config.token_size(self.spec.hidden_size)

    @property
    def embedding_size(self) -> int:
        """How many values an embedding has (the hidden size, or its Dense projection's)."""
        return self.pooler_config.embedding_size(self.spec.hidden_size)

    def _classifier_only(self) -> str:
        labels = self.spec.labels
        if len(labels) == 1:
            does = ("it classifies (/classify, LLM.classify) and scores pairs as a "
                    "cross-encoder (/score, /rerank, LLM.score)")  # fmt: skip
        else:
            does = "it classifies (/classify, LLM.classify)"
        return (f"this model ({self.spec.architecture}) is a sequence classifier with "
                f"{len(labels)} label{'' if len(labels) == 1 else 's'}: {does}; it neither "
                "generates nor embeds")  # fmt: skip

    def _check_payload(self, request_id: str, prompt: list[int], payload: KVPayload | None,
                       images: tuple[ImageInput, ...] = ()) -> KVPayload | None:  # fmt: skip
        """The payload if this engine can use it for this prompt, else None (logged)."""
        if payload is None:
            return None
        digests = tuple(im.digest for im in images)
        why = payload.usable_for(prompt, self.kv_manager.block_size, digests)
        if why is None and self.tp_workers is not None:
            why = "the cache is split over tensor-parallel ranks"
        if why is None and payload.layout != self.runner.kv_layout(payload.num_blocks):
            why = f"cache layout {payload.layout}, this cache's {self.runner.kv_layout(payload.num_blocks)}"
        if why is not None:
            logger.warning("request %s: transferred KV set aside (%s); computing the prompt",
                           request_id, why)  # fmt: skip
            return None
        return payload

    def _export_held(self) -> None:
        """Copy out the prompt KV of the ``export_kv`` requests that just finished (all but
        the last prompt token, whose logits the decode side computes; whole blocks in the
        cache's layout) onto the request for its final output, then free their blocks (kept
        as prefix cache when it is on)."""
        block_size = self.kv_manager.block_size
        for request_id, request in list(self.scheduler.held.items()):
            num_tokens = request.num_prompt_tokens - 1
            table = self.kv_manager.block_table(request)[: -(-num_tokens // block_size)]
            try:
                layout, arrays = self.runner.export_kv(table)
                request.exported_kv = KVPayload(tuple(request.prompt_token_ids[:num_tokens]),
                                                block_size, layout, arrays,
                                                tuple(im.digest for im in request.images))  # fmt: skip
            except Exception:  # noqa: BLE001 - the prefill stands; its KV does not travel
                logger.exception("exporting the KV of %s failed", request_id)
            self.scheduler.release_held(request_id)

    def _structured_manager(self) -> StructuredOutputManager:
        if self.structured is None:
            from infer.engine.affinity import leave_main_core
            from infer.structured.manager import StructuredOutputManager

            self.structured = StructuredOutputManager(
                self.tokenizer,
                self.spec.vocab_size,
                self.eos_token_ids,
                # Started from the engine's main thread: with --cpu-bind, off its core.
                thread_initializer=leave_main_core,
            )
            self.runner.structured = self.structured
        return self.structured

    def _admit_compiled(self, wait: bool) -> None:
        """Constrained requests whose matcher is built join the scheduler; a grammar that
        failed to build ends its request with the error."""
        if wait:  # nothing else to do this step: do not spin
            futures.wait([f for _, f in self._compiling.values()], timeout=0.01,
                         return_when=futures.FIRST_COMPLETED)  # fmt: skip
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                matcher = future.result()
            except Exception as e:  # noqa: BLE001 - the request fails, the engine goes on
                request.status = RequestStatus.FINISHED_ERROR
                request.error = str(e)
                request.timings.finished = time.perf_counter()
                self._pending.append(self._make_output(request))
                continue
            assert self.structured is not None
            self.structured.attach(request_id, matcher)
            self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            request, future = compiling
            future.cancel()
            request.status = RequestStatus.FINISHED_ABORTED
            request.timings.finished = time.perf_counter()
            self._pending.append(self._make_output(request))
            return
        self._finish(request_id, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request_id: str, status: RequestStatus, error: str | None = None) -> None:
        request = self.scheduler.finish_request(request_id, status)
        if request is None:
            return
        request.error = error
        self._pending.append(self._make_output(request))

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests) + list(self._compiling)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._pending)
            or bool(self._compiling)
            or bool(self._deferred)
        )

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule, run the batch, apply its tokens; the outputs to emit.

        With deferred outputs (the GPU step), a step's progressed requests get their outputs
        made while the next step's forward pass runs on the device::

            step N   : schedule N | launch N | outputs of N-1 (host) | wait N | update N
            step N+1 : schedule   | launch   | outputs of N          | wait   | update

        so a token reaches its stream one step later, and the host's per-request work (the
        detokenizer above all) costs no device time. A step with nothing to run emits what is
        still deferred at once."""
        if self._compiling:
            self._admit_compiled(wait=not self.scheduler.has_unfinished_requests())
        if self.scheduler.held:  # finished outside a step's update (a stop string)
            self._export_held()
        outputs, self._pending = self._pending, []
        t0 = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            sched = self._live_part(ahead)
        if ahead is None or sched.is_empty:
            if ahead is not None:  # every request it ran for ended meanwhile: tokens dropped
                self._discard_ahead(ahead)
            ahead = None
            sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        if sched.is_empty:
            outputs.extend(self._drain_deferred())
            return outputs
        defer = self._defer_outputs and (self.structured is None or not self.structured.matchers)
        drained: list[RequestOutput] = []
        drain_time = 0.0
        try:
            if ahead is not None:
                running = ahead.step
            else:
                running = self.runner.launch(sched, self.scheduler.requests)
            # While the device runs it: the next step (async scheduling), earlier outputs.
            self._ahead = self._launch_ahead(running)
            t = time.perf_counter()
            if self._deferred:
                drained.extend(self._drain_deferred())
            drain_time = time.perf_counter() - t
            result = self.runner.collect(running)
            if ahead is not None and sched is not ahead.step.out:
                self._forget_dropped_draws(ahead.step.out, sched)
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001 - one failed batch must not kill the engine
            self._discard_ahead(self._ahead)  # launched on this step's tokens
            if self.tp_workers is not None:
                # The other ranks may be inside a collective this rank never reached.
                raise self.tp_workers.dead(e) from e
            logger.exception(
                "forward pass failed; failing the %d requests in it", len(sched.chunks)
            )
            outputs.extend(drained)
            outputs.extend(self._drain_deferred())
            for chunk in sched.chunks:
                self._finish(
                    chunk.request_id, RequestStatus.FINISHED_ERROR, f"{type(e).__name__}: {e}"
                )
            outputs, self._pending = outputs + self._pending, []
            return outputs
        try:
            outputs = self._apply(sched, result, outputs, drained, drain_time, defer, t0, t1)
        except BaseException:
            self._discard_ahead(self._ahead)  # planned on the tokens this step failed to apply
            raise
        if self._ahead is not None and self._live_part(self._ahead).is_empty:
            self._discard_ahead(self._ahead)  # all its requests have ended (a stop string)
        return outputs

    def _discard_ahead(self, ahead: _AheadStep | None) -> None:
        """Drop a step launched ahead that will never be collected; its launch (inputs and
        queueing the forward pass) still counts in ``step_times``, as a collected step's
        does (not as a step: it produced nothing)."""
        if ahead is not None:
            self.step_times.prepare += ahead.step.t1 - ahead.step.t0
            self.step_times.forward += ahead.step.t2 - ahead.step.t1
        self._ahead = None

    def _apply(
        self,
        sched: SchedulerOutput,
        result: ModelRunnerOutput,
        outputs: list[RequestOutput],
        drained: list[RequestOutput],
        drain_time: float,
        defer: bool,
        t0: float,
        t1: float,
    ) -> list[RequestOutput]:
        """The second half of :meth:`step`: a collected step's tokens applied, its outputs
        made or deferred, the step's times and trace recorded."""
        outputs.extend(drained)
        if not defer:  # what an earlier step deferred goes first
            outputs.extend(self._drain_deferred())
        sampled, timings = result.sampled, result.timings
        for request_id in sampled:
            if request_id not in self._states:  # finished while this step ran (a stop string
                self.runner.sampler.forget(request_id)  # found meanwhile): its draw re-made it
        t2 = time.perf_counter()
        progressed = self.scheduler.update_from_output(sched, sampled, result.prompt_logprobs,
                                                       result.embeddings)  # fmt: skip
        if self.scheduler.held:  # before their outputs are made: the payload rides on them
            self._export_held()
        for request in progressed:
            if self.structured is not None and not request.is_finished:
                self._advance_grammar(request)
            if defer:
                self._deferred.append((request, self._states[request.request_id]))
            elif self._output_due(request, self._states[request.request_id]):
                outputs.append(self._make_output(request))
        outputs.extend(self._pending)
        self._pending = []
        t3 = time.perf_counter()
        if self.proposer is not None:
            self._propose()
            if t3 - self._spec_logged_at[0] >= self._spec_log_interval:
                self._log_spec_decode(t3)
        t4 = time.perf_counter()
        st = self.step_times
        st.steps += 1
        st.schedule += t1 - t0
        st.prepare += timings.prepare
        st.forward += timings.forward
        st.sample += timings.sample
        st.update += t3 - t2 + drain_time
        st.propose += t4 - t3
        trace = self.trace
        if trace is not None:
            if trace.sink is None and t4 - trace.last_poll > VIEWER_IDLE_SECONDS:
                self.trace = None  # the viewer has gone
            else:
                trace.record(self.scheduler, sched, st.steps, t4 - t0)
        return outputs

    def _launch_ahead(self, running: InFlightStep) -> _AheadStep | None:
        """Async scheduling: launch the step after ``running`` (a step whose tokens are still
        on the device) now, its decode rows' input ids taken from ``running``'s sampled ids on
        the device (prompt chunks, going on or admitted, bring their own), so the host's work
        for a step (collecting and applying the one before, detokenizing, scheduling) overlaps
        the device's::

            host   : plan+launch N+1 | outputs N-1 | wait N | apply N | plan+launch N+2 | ...
            device : ...N...............................| N+1 ....................| N+2

        None (the next step is scheduled once ``running``'s tokens are in) where the step
        would not be the regular schedule's (:meth:`Scheduler.schedule_ahead`), or the batch
        needs its tokens on the host first (logprobs, penalties, grammars, proposals)."""
        if not self._async or running.pending is None:
            return None
        try:
            return self._plan_and_launch(running)
        except Exception:  # noqa: BLE001 - the regular step after this one computes it
            logger.exception("launching a step ahead failed; scheduling it as usual")
            return None

    def _plan_and_launch(self, running: InFlightStep) -> _AheadStep | None:
        # (A step with grammars has no ``pending``: the runner samples it at collect.)
        assert running.pending is not None
        t0 = time.perf_counter()
        nxt = self.scheduler.schedule_ahead(running.out)
        self.step_times.schedule += time.perf_counter() - t0  # its launch: when it is collected
        if nxt is None:
            return None
        # The decodes' rows (the first chunks, one token each) take their input ids from
        # ``running``'s sampled ones on the device; prompt chunks after them (a prompt going on
        # samples nothing in ``running``; an admitted one is new, and ``running``'s ids are
        # all live) carry their prompt's ids.
        row_of = {r.request_id: i for i, r in enumerate(running.sample_reqs)}
        fed = [c for c in nxt.chunks if c.request_id in row_of]
        feed = TokenFeed(running.pending.tokens, list(range(len(fed))),
                         [row_of[c.request_id] for c in fed])  # fmt: skip
        planned = [self.scheduler.requests[c.request_id] for c in nxt.chunks]
        return _AheadStep(self.runner.launch(nxt, self.scheduler.requests, feed), planned)

    def _live_part(self, ahead: _AheadStep) -> SchedulerOutput:
        """The chunks of a step launched ahead whose requests are still the ones it was planned
        for: one that ended since (a stop token in the step before, an abort, a stop string)
        is dropped, even if a new request took its id."""
        out = ahead.step.out
        live = [
            chunk
            for chunk, request in zip(out.chunks, ahead.requests, strict=True)
            if self.scheduler.requests.get(chunk.request_id) is request
        ]
        if len(live) == len(out.chunks):
            return out
        return step_output(live, out.preempted, out.swap_out, out.swap_in, out.kv_imports)

    def _forget_dropped_draws(self, planned: SchedulerOutput, live: SchedulerOutput) -> None:
        """A step launched ahead that samples when collected (logprobs, penalties, ...) still
        draws for the rows ``_live_part`` dropped: a seeded row's draw makes its generator
        again, under an id that a new request may hold by now (an abort, then the id reused),
        which would then draw from the old seed, already advanced. Forgotten here: the new
        request's first draw (a later step: none is admitted ahead under a reused id) seeds its
        own."""
        kept = {id(chunk) for chunk in live.chunks}
        for chunk in planned.chunks:
            if id(chunk) not in kept:
                self.runner.sampler.forget(chunk.request_id)

    def _drain_deferred(self) -> list[RequestOutput]:
        """The outputs of the requests an earlier step deferred (see :meth:`step`). A request
        whose output went out meanwhile (aborted, failed: its state is gone, or is a new
        request's under the same id) is skipped; one whose output cannot be made ends with an
        error output instead of being lost."""
        deferred, self._deferred = self._deferred, []
        outputs = []
        for request, state in deferred:
            if self._states.get(request.request_id) is not state:
                continue
            try:
                if self._output_due(request, state):
                    outputs.append(self._make_output(request))
            except Exception as e:  # noqa: BLE001 - one request's output must not lose the rest
                logger.exception("making the output of %s failed", request.request_id)
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
                self._states.pop(request.request_id, None)
                self.runner.sampler.forget(request.request_id)
                outputs.append(
                    RequestOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        new_text="",
                        finished=True,
                        finish_reason="error",
                        error=f"{type(e).__name__}: {e}",
                    )
                )
        return outputs

    def _advance_grammar(self, request: Request) -> None:
        """Feed a constrained request's new tokens to its matcher; end it when the grammar has
        ended (``stop``) or refused a token (``error``, which the mask makes impossible)."""
        assert self.structured is not None
        state = self._states[request.request_id]
        new = request.output_token_ids[state.num_grammar_tokens :]
        state.num_grammar_tokens = request.num_output_tokens
        verdict = self.structured.advance(request, new)
        if verdict == "stop":
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        elif verdict is not None:
            logger.error("%s: %s", request.request_id, verdict)
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
            request.error = verdict

    def _log_spec_decode(self, now: float) -> None:
        """Every ``INFER_SPEC_LOG_INTERVAL`` seconds of speculation: the acceptance since the last line."""
        c = self.scheduler.counters
        _, drafts0, proposed0, accepted0 = self._spec_logged_at
        drafts, proposed = c.spec_drafts - drafts0, c.spec_draft_tokens - proposed0
        accepted = c.spec_accepted_tokens - accepted0
        self._spec_logged_at = (now, c.spec_drafts, c.spec_draft_tokens, c.spec_accepted_tokens)
        if drafts:
            per_position = "/".join(
                f"{n / c.spec_drafts:.0%}" for n in c.spec_accepted_per_position
            )
            logger.info(
                "speculative decoding: mean acceptance length %.2f, %d of %d proposed tokens "
                "accepted (%.0f%%); since start, acceptance by position %s",
                1 + accepted / drafts,
                accepted,
                proposed,
                100 * accepted / proposed,
                per_position,
            )

    def _propose(self) -> None:
        """Speculative decoding: proposals for the requests that decode next step."""
        assert self.proposer is not None
        decoding = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        try:
            proposals = self.proposer.propose(decoding)
        except Exception:  # noqa: BLE001 - without proposals every request still decodes
            logger.exception("speculative proposals failed; decoding without them this step")
            return
        self.scheduler.add_proposals(proposals)

    def _output_due(self, request: Request, state: _OutputState) -> bool:
        """Whether a request that progressed this step sends an output now: always, unless
        ``--stream-interval`` holds its tokens back (not its first, not its last). A request
        with stop strings held back still has its text made (:meth:`_advance_text`)."""
        interval = self._stream_interval
        if interval == 1 or request.is_finished or state.num_sent_tokens == 0:
            return True
        if request.num_output_tokens - state.num_sent_tokens >= interval:
            return True
        if state.detokenizer.stop:
            self._advance_text(request, state)
            return request.is_finished  # it has just met a stop string
        return False

    def _advance_text(self, request: Request, state: _OutputState) -> None:
        """Turn the tokens not yet made text into text (held in ``state.text``); a stop string
        among them ends the request there."""
        new_ids = request.output_token_ids[state.num_text_tokens :]
        if not new_ids:  # (made already: a held-back request whose output goes out now)
            return
        detok = state.detokenizer
        state.num_text_tokens = request.num_output_tokens
        # An EOS or stop id ends the output, its text left out (as a stop string's is) unless
        # include_stop_str_in_output; the token stays in the output's ids and counts.
        stop_text = request.sampling_params.include_stop_str_in_output
        if new_ids and request.stopped_on_token and not stop_text:
            new_ids = new_ids[:-1]
        try:
            state.text += detok.add_tokens(new_ids)
        except Exception as e:  # noqa: BLE001 - a decoding failure fails this request only
            logger.exception("detokenization failed for %s", request.request_id)
            request.error = f"detokenization failed: {e}"
            if not request.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
            else:  # (its last tokens, or tokens --stream-interval held back: text is missing)
                self.scheduler.refinish(request, RequestStatus.FINISHED_ERROR)
            return
        # A stop string wins over a finish on the same or a later token (max_tokens, a
        # grammar's end): the output ends with it, so it is why the output ended.
        if detok.stop_string is not None:
            request.stop_reason = detok.stop_string
            self.scheduler.stop_at_string(request, detok.num_output_tokens)
            state.num_text_tokens = request.num_output_tokens

    def _make_output(self, request: Request) -> RequestOutput:
        state = self._states[request.request_id]
        self._advance_text(request, state)
        text, state.text = state.text, ""
        finished = request.is_finished  # decided from here on
        if finished:
            text += state.detokenizer.finish()
            if request.request_id in self.scheduler.held:  # a stop string ended it just now
                self._export_held()  # (its payload rides on this output)
        new_ids = request.output_token_ids[state.num_sent_tokens :]  # after a stop string's cut
        state.num_sent_tokens = request.num_output_tokens
        new_logprobs = request.output_logprobs[state.num_sent_logprobs :]
        state.num_sent_logprobs = len(request.output_logprobs)
        prompt_logprobs = None
        if (
            request.sampling_params.prompt_logprobs is not None
            and not state.sent_prompt_logprobs
            and (new_ids or finished)
        ):
            prompt_logprobs = list(request.prompt_logprobs)
            state.sent_prompt_logprobs = True
        if finished:
            del self._states[request.request_id]
            self.runner.sampler.forget(request.request_id)
            if self.proposer is not None:
                self.proposer.forget(request.request_id)
            if self.structured is not None:
                self.structured.forget(request.request_id)
        # Positional, in the fields' order: keywords cost ~0.85 us more, every request a step.
        return RequestOutput(
            request.request_id,
            new_ids,
            text,
            new_logprobs,
            finished,
            request.status.finish_reason,
            request.stop_reason,
            len(request.prompt_token_ids),  # num_prompt_tokens
            len(request.output_token_ids),  # num_output_tokens
            request.num_cached_tokens,
            request.timings,
            request.error,
            prompt_logprobs,
            request.exported_kv if finished else None,  # kv_payload
            request.embedding,
        )

    # ---- introspection ------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        kv = self.kv_manager
        c = self.scheduler.counters
        p = kv.prefix_stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_total_blocks,
            prompt_tokens_total=c.prompt_tokens,
            generation_tokens_total=c.generation_tokens,
            num_preemptions_total=c.preemptions,
            num_preemptions_recompute_total=c.preemptions_recompute,
            num_preemptions_swap_total=c.preemptions_swap,
            recomputed_tokens_total=c.recomputed_tokens,
            swapped_out_blocks_total=c.swapped_out_blocks,
            swapped_in_blocks_total=c.swapped_in_blocks,
            prefix_cache_queries_total=p.queries,
            prefix_cache_hits_total=p.hits,
            prefix_cache_evictions_total=p.evictions,
            finished_total=dict(c.finished),
            spec_decode_num_drafts_total=c.spec_drafts,
            spec_decode_num_draft_tokens_total=c.spec_draft_tokens,
            spec_decode_num_accepted_tokens_total=c.spec_accepted_tokens,
            spec_decode_accepted_per_position=tuple(c.spec_accepted_per_position),
            **self._lora_stats(),
            moe_expert_rows=expert_load(self._moe_layers),
            kv_transferred_tokens_total=c.transferred_tokens,
        )

    def _lora_stats(self) -> dict:
        if self.config.lora is None:
            return {}
        sched = self.scheduler

        def names(requests) -> tuple[str, ...]:
            return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))

        return dict(
            max_lora=self.config.lora.max_loras,
            running_lora_adapters=names(sched.running),
            waiting_lora_adapters=names(sched.waiting),
        )

    def poll_trace(self, since_step: int = 0) -> TracePoll:
        """The live view's poll: the step records after ``since_step`` and a snapshot of the
        queues and blocks now. Steps are recorded from the first poll until polls stop for
        ``VIEWER_IDLE_SECONDS``."""
        if self.trace is None:
            self.trace = StepTrace()
        trace = self.trace
        trace.last_poll = time.perf_counter()
        steps = self.step_times.steps
        snapshot = take_snapshot(self.scheduler, steps, trace.last_poll - trace.started)
        return TracePoll(tuple(trace.since(since_step)), snapshot)

    def record_trace(self, sink: IO[str] | None) -> None:
        """Write every following step's record and snapshot to ``sink`` as JSON lines (see
        ``engine/trace.py``); ``None`` stops recording."""
        self.trace = StepTrace(sink=sink) if sink is not None else None

    def reset_prefix_cache(self) -> bool:
        return self.kv_manager.reset_prefix_cache()
