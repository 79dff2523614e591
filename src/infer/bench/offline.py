"""The offline driver of the in-process benchmarks: one engine factory, one closed loop.

Every ``infer bench`` command that measures the engine without HTTP (engine, prefix, quant,
int4, moe, lora, spec, structured, decode-curve, kernels, gpu, micro) builds its engine with
:func:`make_engine`, draws its random prompts with :func:`random_prompts` and serves them with
:func:`serve_closed_loop` (C requests in flight, a new one joining as one finishes), so a figure
called "output tok/s" or "TTFT" is timed the same way in each of their reports::

    engine = make_engine(model, dtype="bfloat16", max_num_seqs=16)
    row = run_load(engine, concurrency=16, num_requests=32, prompt_len=64, output_len=64, seed=0)

Imports torch and the engine only when called, so the CLI's parser never loads them.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from infer.bench.metrics import percentile

if TYPE_CHECKING:
    import torch

    from infer.core.outputs import RequestOutput
    from infer.core.sampling_params import SamplingParams
    from infer.engine.engine import LLMEngine

Request = tuple[str, list[int], "SamplingParams"] | tuple[str, list[int], "SamplingParams", dict]
"""``(request id, prompt ids, params[, add_request keyword options])``."""

T = TypeVar("T")

STEP_PARTS = ("steps", "schedule", "prepare", "forward", "sample", "update")
"""The engine's step-time counters (``engine.step_times``) that :func:`run_load` splits."""


@contextlib.contextmanager
def patched_environ(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` set inside the block, as it was again after it (a switch
    the engine reads when it is built, e.g. ``INFER_FAST_DECODE``)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_engine(model: str | Path, **options: Any) -> LLMEngine:
    """An ``LLMEngine`` for ``model`` (a folder or a built-in name) with ``options``: the
    fields of :class:`infer.config.EngineConfig` the benchmark sets, nothing implied."""
    from infer.config import EngineConfig
    from infer.engine.engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(model=str(model), **options))


def prompt_vocab(engine: LLMEngine) -> int:
    """The ids a random prompt may use: below both the model's and the tokenizer's vocabulary."""
    return min(engine.spec.vocab_size, len(engine.tokenizer))


def random_prompts(
    vocab: int, n: int, prompt_len: int, seed: int | torch.Generator
) -> list[list[int]]:
    """``n`` prompts of ``prompt_len`` random ids in ``[3, vocab)``, drawn in order from
    ``seed`` (or from a generator the caller goes on drawing from)."""
    import torch

    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored): the benchmarks' load."""
    from infer.core.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def serve_closed_loop(
    engine: LLMEngine, requests: Sequence[Request], concurrency: int
) -> tuple[list[RequestOutput], float]:
    """Serve ``(request id, prompt, params[, add_request options])`` in order, keeping
    ``concurrency`` in flight (a new one joins as one finishes); the finished outputs and the
    wall time in seconds."""
    next_id = in_flight = 0
    done: list[RequestOutput] = []
    t0 = time.perf_counter()
    while next_id < len(requests) or engine.has_unfinished_requests():
        while in_flight < concurrency and next_id < len(requests):
            rid, prompt, params, *options = requests[next_id]
            engine.add_request(rid, prompt, params, **(options[0] if options else {}))
            next_id += 1
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                done.append(out)
    return done, time.perf_counter() - t0


def output_tok_s(
    engine: LLMEngine, requests: Sequence[Request], concurrency: int
) -> tuple[float, list[RequestOutput]]:
    """:func:`serve_closed_loop`'s output tokens per second of wall time, and its outputs."""
    done, wall = serve_closed_loop(engine, requests, concurrency)
    return sum(o.num_output_tokens for o in done) / wall, done


def step_times(engine: LLMEngine) -> dict[str, float]:
    """A copy of the engine's step-time counters (:data:`STEP_PARTS`)."""
    st = engine.step_times
    return {k: getattr(st, k) for k in STEP_PARTS}


def run_load(
    engine: LLMEngine,
    concurrency: int,
    num_requests: int,
    prompt_len: int,
    output_len: int,
    seed: int,
) -> dict:
    """The closed loop on ``num_requests`` random prompts (``seed``), greedy, ``output_len``
    tokens each: output tok/s, TTFT and ITL percentiles, and the split of the step time
    between forward, sampling and the engine's own overhead."""
    prompts = random_prompts(prompt_vocab(engine), num_requests, prompt_len, seed)
    params = greedy(output_len)
    st0 = step_times(engine)
    done, wall = serve_closed_loop(
        engine, [(f"r{i}", prompts[i], params) for i in range(num_requests)], concurrency
    )
    st1 = step_times(engine)
    ttft = [o.timings.ttft * 1000 for o in done]
    itl = [
        (b - a) * 1000
        for o in done
        for a, b in zip(o.timings.token_times, o.timings.token_times[1:], strict=False)
    ]
    steps = {k: st1[k] - st0[k] for k in st1}
    total = sum(v for k, v in steps.items() if k != "steps")
    overhead = steps["schedule"] + steps["prepare"] + steps["update"]
    return {
        "concurrency": concurrency,
        "requests": num_requests,
        "completed": len(done),
        "output_tokens": sum(o.num_output_tokens for o in done),
        "wall_s": wall,
        "output_tok_s": sum(o.num_output_tokens for o in done) / wall,
        "ttft_ms": {f"p{p}": percentile(ttft, p) for p in (50, 95, 99)},
        "itl_ms": {f"p{p}": percentile(itl, p) for p in (50, 95, 99)},
        "steps": steps["steps"],
        "step_split": {
            "forward": steps["forward"] / total,
            "sample": steps["sample"] / total,
            "engine_overhead": overhead / total,
        },
        "mean_step_ms": 1000 * total / max(steps["steps"], 1),
    }


def first_token(
    engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams
) -> tuple[float | None, int]:
    """One request on an idle engine, served to the end: seconds from ``add_request`` to its
    first token (None if it produced none) and the prompt tokens it found in the prefix cache."""
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft, cached = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - t0
                cached = out.num_cached_tokens
    return ttft, cached


def serve_one(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> float:
    """Seconds to serve one request on an idle engine, from ``add_request`` to the last step."""
    t = time.perf_counter()
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t


def decode_step_ms(
    engine: LLMEngine,
    requests: Sequence[Request],
    steps: int,
    *,
    warm_steps: int = 0,
    abort: bool = False,
) -> float:
    """Median wall time (ms) of one decode step with ``requests`` in the batch: they are added,
    one step prefills them, ``warm_steps`` more go untimed, then ``steps`` are timed; after
    that they are aborted (``abort``) or served to their end."""
    for rid, prompt, params, *options in requests:
        engine.add_request(rid, prompt, params, **(options[0] if options else {}))
    engine.step()  # the prefill
    for _ in range(warm_steps):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    if abort:
        for rid, *_ in requests:
            engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * statistics.median(times)


def random_decode_step_ms(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    """:func:`decode_step_ms` of ``batch`` random ``prompt_len``-token prompts (seed 0),
    served to their end afterwards."""
    prompts = random_prompts(prompt_vocab(engine), batch, prompt_len, 0)
    params = greedy(steps + 8)
    return decode_step_ms(engine, [(f"d{i}", p, params) for i, p in enumerate(prompts)], steps)


def median_seconds(fn: Callable[[], T], runs: int) -> tuple[float, T]:
    """``fn`` run once to warm up, then ``runs`` times: the median of those runs' wall seconds
    and the last run's result (the peer comparisons' timing)."""
    fn()
    times, result = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result  # type: ignore[return-value]


def timed_generate(llm: Any, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    """``llm.generate`` (an :class:`infer.LLM`) on every prompt at once: the output tokens and
    the wall seconds it took."""
    t0 = time.perf_counter()
    out = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in out), seconds


def decode_read_bytes(engine: LLMEngine) -> int:
    """Bytes one decode step reads: every weight as held (packed and quantized copies
    included), less the embedding table (a step reads one row of it), counting the vocabulary
    projection once (as packed when it is)."""
    model = engine.runner.model
    total = 0
    for module in model.modules():
        total += getattr(module, "weight_bytes", 0)
        for name, p in module.named_parameters(recurse=False):
            if module is getattr(model, "embed_tokens", None) and name == "weight":
                continue
            total += p.numel() * p.element_size()
    packed = getattr(model, "packed_logits", None)
    embed = getattr(model, "embed_tokens", None)
    if packed is None and embed is not None:
        total += embed.weight.numel() * embed.weight.element_size()  # read as the vocab matrix
    return total


def held_out_windows(model_dir: Path, max_windows: int = 20, context: int = 1024) -> torch.Tensor:
    """``[n, context + 1]`` non-overlapping windows of ``small``'s held-out text (the windows
    its training reports a held-out loss on)."""
    import torch

    from infer.builtin.textdata import encode_stream, split_docs
    from infer.data.corpus import load_corpus
    from infer.model import load_tokenizer

    _, val_docs = split_docs(load_corpus())
    stream = encode_stream(load_tokenizer(model_dir), val_docs)
    n = min((len(stream) - 1) // context, max_windows)
    return torch.stack([stream[i * context : i * context + context + 1] for i in range(n)])


def perplexity(model_dir: Path, windows: torch.Tensor, quantization: str | None, kv: str) -> float:
    """Perplexity of ``model_dir`` (bf16, its linears quantized by ``quantization`` or
    pre-packed) on ``windows``, each one prefill that reads its keys and values back from a
    cache of ``kv`` dtype: a quantized cache costs here what it costs a decode."""
    import math

    import torch

    from infer.model import load_model
    from infer.runner.attention import AttentionContext, KVCache, SequenceSlice
    from infer.runner.cpu.prepack import prepack_linears
    from infer.runner.quant import quantize_linears

    with torch.inference_mode():
        model = load_model(model_dir, torch.bfloat16)
        if quantization:
            quantize_linears(model, quantization)
        else:
            prepack_linears(model)
        spec = model.spec
        n = windows.shape[1] - 1
        blocks = (n + 15) // 16
        total = 0.0
        for window in windows:
            cache = KVCache(spec.num_layers, blocks, 16, spec.num_kv_heads, spec.head_dim,
                            torch.bfloat16, "cpu", kv_dtype=kv)  # fmt: skip
            ctx = AttentionContext(cache, [SequenceSlice(0, n, list(range(blocks)))], "cpu")
            logits = model.compute_logits(model(window[:-1], torch.arange(n), ctx))
            total += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
    return math.exp(total / (len(windows) * n))
