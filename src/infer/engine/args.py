"""Command-line options for the engine, shared by `infer serve`, `infer generate` and benches.

Flag names follow vLLM where one exists; short names (--max-batch-size, ...) are aliases.
"""

from __future__ import annotations

import argparse

from infer.config import (
    LORA_OPTIONS,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_bytes,
)


def byte_size(text: str) -> int:
    """An argparse type for a byte size (``2GiB``, ``512MB``, ``1e9``): parse_bytes' own
    message on a bad one (argparse would otherwise say only 'invalid value')."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    m, c, s = ModelConfig(), CacheConfig(), SchedulerConfig()
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model",
        default=None,
        help="local HF folder, a .gguf file (llama.cpp's format), a model id in the local HF "
        "cache, or a built-in: toy|small|small-draft (default: small)",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    g.add_argument("--dtype", default=m.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=m.device, help="cpu | cuda | cuda:N")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--seed", type=int, default=m.seed)
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="quantize the weights at load: int8 (per-output-channel scales, CPU and CUDA) | "
        "w8a8 (int8 weights and per-row int8 activations, CPUs with AVX-512 VNNI) | "
        "fp8 (e4m3, CUDA with fp8 matmuls) | int4 (4 bits in groups of 32, a scale and zero "
        "per group; vocabulary projection in int8) | w4a8 (the same 4-bit weights, int8 "
        "activations per group, CPUs with AVX-512 VNNI) | gptq | awq | gguf (the checkpoint is "
        "one: checked; GPTQ / AWQ folders and GGUF files are read as such either way)",
    )
    g.add_argument(
        "--quantize-lm-head",
        action=argparse.BooleanOptionalAction,
        default=m.quantize_lm_head,
        help="with --quantization, quantize the vocabulary projection too (default); "
        "--no-quantize-lm-head keeps it in the model's dtype, as vLLM does",
    )
    g.add_argument(
        "--gguf-int8",
        action=argparse.BooleanOptionalAction,
        default=m.gguf_int8,
        help="a GGUF file in bf16 / fp16: hold its layers stored as Q8_0, Q3_K, ... (a type "
        "the 4-bit kernel does not take; Q5 and Q6_K too without int8 activations; the "
        "vocabulary projection too, unless --no-quantize-lm-head) in int8 per channel "
        "(default for a decoder where the CPU has the int8 kernel: AMX, or AVX-512 BF16 and "
        "VBMI; elsewhere, and an encoder's, they are dequantized: no faster in int8); "
        "--no-gguf-int8 dequantizes them to the model's dtype",
    )
    g.add_argument(
        "--gguf-int8-activations",
        action=argparse.BooleanOptionalAction,
        default=m.gguf_int8_activations,
        help="a GGUF file in bf16: its 4-, 5- and 6-bit layers (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, "
        "Q5_K, Q6_K: held in their bits, K-quants and Q6_K with their own scales; a vocabulary "
        "projection of those types too) quantize each activation row's groups of 32 (Q6_K: "
        "256) to int8 and multiply bytes by bytes (AVX-512 VNNI; default, as llama.cpp does); "
        "--no-gguf-int8-activations keeps the activations bf16 (4-bit types in the int4 "
        "kernel, 5- and 6-bit ones in int8 or bf16 as --gguf-int8 says)",
    )
    g.add_argument(
        "--gguf-dequantize",
        action=argparse.BooleanOptionalAction,
        default=m.gguf_dequantize,
        help="a GGUF file: dequantize every layer to the model's dtype at load instead of "
        "holding its 4-bit (and int8) layers as stored: more memory and slower batch-1 "
        "decode, faster batches and prefill on AVX2 CPUs (no AVX-512 BF16), where the 4-bit "
        "kernel runs them at about half the bf16 kernel's rate",
    )

    g.add_argument(
        "--generation-config",
        default=m.generation_config,
        help="where a request's unset sampling fields (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_tokens) come from: auto (the model's generation_config.json, "
        "as vLLM) | none (infer's own: temperature 1, nothing else; 'vllm' is the same) | a "
        "folder holding a generation_config.json",
    )
    g.add_argument(
        "--override-generation-config",
        default=None,
        help="JSON of generation_config.json fields that set or replace the model's, e.g. "
        '\'{"temperature": 0.5, "max_new_tokens": 256}\'',
    )
    g.add_argument(
        "--pooler-config",
        default=None,
        help="JSON that sets or replaces how embedding requests (/v1/embeddings) pool, over the "
        "model's sentence-transformers files: pooling_type (LAST, the only one served) and "
        "normalize, e.g. '{\"normalize\": false}'",
    )
    g.add_argument(
        "--hf-overrides",
        default=None,
        help="JSON of config.json fields that set or replace the model's before it is read "
        "(vLLM's flag), e.g. a causal reranker as a classifier: '{\"architectures\": "
        '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", '
        '"yes"], "is_original_qwen3_reranker": true}\'',
    )
    g.add_argument(
        "--attention-backend",
        default=m.attention_backend,
        choices=["auto", "torch", "triton"],
        help="attention on CUDA: triton (paged kernels that read the block tables) | torch "
        "(gather + SDPA, the reference) | auto (triton where installed)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run every step eagerly, without CUDA graphs for decode steps",
    )
    g.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="CUDA (Triton step): wait for each decode step before scheduling the next, instead "
        "of launching it while the one before runs",
    )

    g = parser.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=c.block_size)
    g.add_argument(
        "--kv-cache-backend", default=c.kv_cache_backend, choices=["paged", "contiguous"]
    )
    g.add_argument(
        "--no-kv-cache",
        dest="use_kv_cache",
        action="store_false",
        help="recompute the whole sequence every step (comparison mode)",
    )
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        default=None,
        help="bytes for the KV cache, e.g. 2GiB",
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=c.gpu_memory_utilization)
    g.add_argument(
        "--enable-prefix-caching",
        "--prefix-caching",
        dest="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV of identical prompt prefixes (default: on, except with the "
        "contiguous backend, --no-kv-cache and static batching); --no-enable-prefix-caching "
        "turns it off",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=c.kv_cache_dtype,
        help="auto (the model dtype) | int8 | fp8: one byte per cached value plus a bf16 scale "
        "per token and head (about twice the tokens in the same memory)",
    )
    g.add_argument(
        "--swap-space",
        type=byte_size,
        default=c.swap_space,
        help="host memory for swapped-out KV blocks, e.g. 4GiB",
    )

    g = parser.add_argument_group("scheduler")
    g.add_argument(
        "--max-num-seqs", "--max-batch-size", dest="max_num_seqs", type=int, default=s.max_num_seqs
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=s.max_num_batched_tokens)
    g.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=None,
        help="cap on one request's prefill chunk per step (enables chunked prefill)",
    )
    g.add_argument(
        "--chunked-prefill",
        "--enable-chunked-prefill",
        dest="chunked_prefill",
        action="store_true",
        help="chunk prompts by the token budget",
    )
    g.add_argument("--batching-mode", default=s.batching_mode, choices=["continuous", "static"])
    g.add_argument("--scheduling-policy", default=s.scheduling_policy, choices=["fcfs", "priority"])
    g.add_argument("--preemption-mode", default=s.preemption_mode, choices=["recompute", "swap"])
    g.add_argument("--max-wait-steps", type=int, default=None)
    g.add_argument("--max-queued-requests", type=int, default=None)
    g.add_argument(
        "--stream-interval",
        type=int,
        default=s.stream_interval,
        help="send a request's new tokens every N tokens (its first token and its end at once): "
        "fewer, larger stream events and less host work per token at high token rates "
        "(default 1: every token)",
    )

    g = parser.add_argument_group("parallelism")
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split every layer over N processes (torch.distributed: gloo on CPU, NCCL on "
        "CUDA, one GPU per rank); on CPU each rank gets its share of the cores",
    )

    g = parser.add_argument_group("LoRA adapters")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT folders) over the base model; a request picks one by "
        "its model field",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help='adapters to load at start-up: name=path, or JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}',
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="adapters resident at once (the most distinct adapters in one step; default 1)",
    )
    g.add_argument(
        "--max-lora-rank", type=int, default=None, help="the largest adapter rank (default 16)"
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept read in host memory (default: --max-loras)",
    )

    g = parser.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"model": PATH, '
        '"num_speculative_tokens": 4} (a draft model with the same tokenizer)',
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    chunk = args.prefill_chunk_size
    if chunk is None and getattr(args, "chunked_prefill", False):
        chunk = args.max_num_batched_tokens
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            seed=args.seed,
            quantization=args.quantization,
            quantize_lm_head=args.quantize_lm_head,
            gguf_int8=args.gguf_int8,
            gguf_int8_activations=args.gguf_int8_activations,
            gguf_dequantize=args.gguf_dequantize,
            attention_backend=getattr(args, "attention_backend", "auto"),
            enforce_eager=getattr(args, "enforce_eager", False),
            async_scheduling=getattr(args, "async_scheduling", True),
            generation_config=getattr(args, "generation_config", "auto"),
            override_generation_config=getattr(args, "override_generation_config", None),
            pooler_config=getattr(args, "pooler_config", None),
            hf_overrides=getattr(args, "hf_overrides", None),
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_backend=args.kv_cache_backend,
            use_kv_cache=args.use_kv_cache,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            swap_space=args.swap_space,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prefill_chunk_size=chunk,
            batching_mode=args.batching_mode,
            scheduling_policy=args.scheduling_policy,
            preemption_mode=args.preemption_mode,
            max_wait_steps=args.max_wait_steps,
            max_queued_requests=args.max_queued_requests,
            stream_interval=getattr(args, "stream_interval", 1),
        ),
        speculative=SpeculativeConfig.parse(getattr(args, "speculative_config", None)),
        parallel=ParallelConfig(tensor_parallel_size=getattr(args, "tensor_parallel_size", 1)),
        lora=LoRAConfig.from_options(
            getattr(args, "enable_lora", False),
            **{k: getattr(args, k, None) for k in LORA_OPTIONS},
        ),
    )
