"""``infer bench client``: a client-side benchmark suite of two measurements through the
``openai`` SDK, as an application would see the server.

1. **Caching** — one cold request on a long prefix made unique by a cache buster
   (``[UNIQUE-ID-nnnnn]`` in front), then ``num_warm + 1`` warm requests on the same prefix without
   it: the first warm one builds the cache, the rest are measured. Each asks for one token, so the
   TTFT is the prefill. Speed-up = ``1 - avg_warm_ttft / cold_ttft``.
2. **Batching** — a short fixed prompt with a unique ``ID: nnnnn`` suffix (no accidental cache
   hits), ``max_tokens=50``: sequential batches (one request after another) and concurrent
   batches (all at once, each in its own thread, as a simple threaded client sends them) at sizes
   1, 2, 4, 8, 12. Reported: average TTFT, aggregate TPS (tokens / wall time from first send to
   last end), success rate.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from infer.bench.report import fmt, markdown_table

SHORT_PROMPT = "The quick brown fox jumps over the lazy dog."
BATCH_SIZES = (1, 2, 4, 8, 12)


@dataclass
class SingleResult:
    ttft_ms: float | None = None
    total_time_s: float | None = None
    generated_tokens: int = 0
    error: str | None = None


def single_request(
    client, model: str, prompt: str, max_tokens: int, endpoint: str = "chat"
) -> SingleResult:
    """One streamed request through the openai SDK: TTFT, total time, generated tokens."""
    res = SingleResult()
    t0 = time.perf_counter()
    chunks = 0
    usage_tokens = None
    try:
        common = dict(
            model=model,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0.0,
        )
        if endpoint == "chat":
            stream = client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **common
            )
        else:
            stream = client.completions.create(prompt=prompt, **common)
        finish_ms = None
        finish_reason = None
        for chunk in stream:
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            text = c.delta.content if endpoint == "chat" else c.text
            if text:
                chunks += 1
                if res.ttft_ms is None:
                    res.ttft_ms = (time.perf_counter() - t0) * 1000.0
            if c.finish_reason and finish_ms is None:
                finish_ms = (time.perf_counter() - t0) * 1000.0
                finish_reason = c.finish_reason
        if res.ttft_ms is None and finish_ms is not None and usage_tokens:
            # The only token decoded to no visible text (a partial character, a special token):
            # the chunk that closed the choice still marks when it was generated.
            res.ttft_ms = finish_ms
    except Exception as e:  # noqa: BLE001 - a failure is counted (success rate), never fatal
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.total_time_s = time.perf_counter() - t0
    res.generated_tokens = usage_tokens if usage_tokens is not None else chunks
    if res.ttft_ms is None:
        res.error = "no output text"
    elif finish_reason in (None, "abort", "error"):  # cut short, or ended by the server
        res.error = f"the stream ended with finish_reason {finish_reason}"
    return res


@dataclass
class CachingResult:
    prefix_words: int
    cache_buster: str
    cold_ttft_ms: float | None
    warm_ttfts_ms: list[float] = field(default_factory=list)
    avg_warm_ttft_ms: float | None = None
    speedup: float | None = None  # 1 - warm / cold
    status: str = "ok"


def long_prefix(num_tokens: int, seed: int, words_per_token: float = 0.75) -> str:
    """~``num_tokens`` of real English text (the bundled Python docs) as the shared prefix."""
    from infer.bench.workloads import TextSource

    return TextSource(words_per_token=words_per_token).passage(num_tokens, random.Random(seed))


def caching_test(
    client, model: str, base_prompt: str, num_warm: int = 3, endpoint: str = "chat", seed: int = 0
) -> CachingResult:
    """Cold (cache-busted) vs warm TTFT on a long shared prefix, one token each."""
    rng = random.Random(seed)
    buster = f"[UNIQUE-ID-{rng.randint(10000, 99999)}]"
    cold_prompt = f"{buster} {base_prompt} Now, state the single word conclusion for the cold run:"
    cold = single_request(client, model, cold_prompt, 1, endpoint)
    result = CachingResult(len(base_prompt.split()), buster, cold.ttft_ms)
    if cold.error:
        result.status = f"cold run failed: {cold.error}"
        return result
    failed: list[str] = []
    for i in range(num_warm + 1):
        prompt = f"{base_prompt} Now, state the single word conclusion for iteration {i + 1}:"
        warm = single_request(client, model, prompt, 1, endpoint)
        if warm.error:
            failed.append(warm.error)
            continue
        if i > 0:  # i == 0 builds the cache for the un-busted prefix
            assert warm.ttft_ms is not None
            result.warm_ttfts_ms.append(warm.ttft_ms)
    if not result.warm_ttfts_ms:
        result.status = "warm runs failed"
        return result
    if failed:  # (measured on the rest; the run still counts as failed)
        result.status = f"{len(failed)} of {num_warm + 1} warm runs failed: {failed[0]}"
    result.avg_warm_ttft_ms = statistics.mean(result.warm_ttfts_ms)
    assert cold.ttft_ms is not None
    result.speedup = 1.0 - result.avg_warm_ttft_ms / cold.ttft_ms
    return result


@dataclass
class BatchResult:
    kind: str  # "sequential" | "concurrent"
    batch_size: int
    avg_ttft_ms: float | None
    tps: float | None  # sequential: tokens / summed latency; concurrent: tokens / wall time
    success_rate: float
    errors: list[str] = field(default_factory=list)


def _unique(prompt: str, rng: random.Random) -> str:
    return f"{prompt} ID: {rng.randint(10000, 99999)}"


def sequential_batch(
    client, model: str, prompt: str, batch_size: int, max_tokens: int, endpoint: str, rng
) -> BatchResult:
    results = [
        single_request(client, model, _unique(prompt, rng), max_tokens, endpoint)
        for _ in range(batch_size)
    ]
    ok = [r for r in results if not r.error]
    total_latency = sum(r.total_time_s or 0.0 for r in ok)
    return BatchResult(
        "sequential",
        batch_size,
        statistics.mean(r.ttft_ms for r in ok) if ok else None,  # type: ignore[misc]
        sum(r.generated_tokens for r in ok) / total_latency if total_latency else None,
        len(ok) / batch_size,
        [r.error for r in results if r.error],  # type: ignore[misc]
    )


def _concurrent(client, model, prompts, max_tokens, endpoint):
    """Every prompt in flight at once: a thread each (asyncio's default pool has
    min(32, cores + 4) threads, which would run a batch of 8 on 2 cores 6 at a time)."""
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        t0 = time.perf_counter()
        futures = [pool.submit(single_request, client, model, p, max_tokens, endpoint)
                   for p in prompts]  # fmt: skip
        results = [f.result() for f in futures]
    return results, time.perf_counter() - t0


def concurrent_batch(
    client, model: str, prompt: str, batch_size: int, max_tokens: int, endpoint: str, rng
) -> BatchResult:
    prompts = [_unique(prompt, rng) for _ in range(batch_size)]
    results, wall = _concurrent(client, model, prompts, max_tokens, endpoint)
    ok = [r for r in results if not r.error]
    return BatchResult(
        "concurrent",
        batch_size,
        statistics.mean(r.ttft_ms for r in ok) if ok else None,  # type: ignore[misc]
        sum(r.generated_tokens for r in ok) / wall if ok else None,
        len(ok) / batch_size,
        [r.error for r in results if r.error],  # type: ignore[misc]
    )


def batching_test(
    client,
    model: str,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    max_tokens: int = 50,
    endpoint: str = "chat",
    seed: int = 0,
    prompt: str = SHORT_PROMPT,
) -> list[BatchResult]:
    """Sequential batches first (no queuing), then concurrent ones (the queuing tax)."""
    rng = random.Random(seed)
    out = [
        sequential_batch(client, model, prompt, bs, max_tokens, endpoint, rng) for bs in batch_sizes
    ]
    out += [
        concurrent_batch(client, model, prompt, bs, max_tokens, endpoint, rng) for bs in batch_sizes
    ]
    return out


def caching_markdown(r: CachingResult) -> str:
    rows = [
        ["Prefix (words)", str(r.prefix_words)],
        ["Cold TTFT (ms)", fmt(r.cold_ttft_ms, 2)],
        *([f"Warm run {i + 1} TTFT (ms)", fmt(t, 2)] for i, t in enumerate(r.warm_ttfts_ms)),
        ["Avg warm TTFT (ms)", fmt(r.avg_warm_ttft_ms, 2)],
        ["Cache speed-up", "—" if r.speedup is None else f"{r.speedup * 100:.1f}%"],
        ["Status", r.status],
    ]
    return markdown_table(["Caching test", "Value"], rows)


def batching_markdown(results: Sequence[BatchResult]) -> str:
    rows = [
        [
            r.kind,
            str(r.batch_size),
            fmt(r.avg_ttft_ms, 2),
            fmt(r.tps, 2),
            f"{r.success_rate * 100:.1f}%",
        ]
        for r in results
    ]
    table = markdown_table(["Batch", "Size", "Avg TTFT (ms)", "TPS", "Success"], rows)
    reading = batching_reading(results)
    return table + ("\n\n" + reading if reading else "")


def batching_reading(results: Sequence[BatchResult]) -> str | None:
    """One sentence on the concurrent rows: does TPS grow with the batch, or only the queue?"""
    conc = [r for r in results if r.kind == "concurrent" and r.tps and r.avg_ttft_ms]
    if len(conc) < 2:
        return None
    lo, hi = conc[0], conc[-1]
    assert lo.tps and hi.tps and lo.avg_ttft_ms and hi.avg_ttft_ms
    tps_x, ttft_x = hi.tps / lo.tps, hi.avg_ttft_ms / lo.avg_ttft_ms
    shape = (
        "throughput plateaus: the extra requests mostly wait in the queue"
        if tps_x < 1.5
        else "batching raises throughput"
    )
    return (
        f"From {lo.batch_size} to {hi.batch_size} concurrent requests, aggregate TPS changes "
        f"x{tps_x:.2f} while average TTFT changes x{ttft_x:.2f}: {shape}."
    )


def run_client_suite(
    server: str,
    model: str | None,
    endpoint: str = "chat",
    prefix_tokens: int = 1024,
    num_warm: int = 3,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    max_tokens: int = 50,
    seed: int = 0,
    timeout_s: float = 600.0,
    tests: Sequence[str] = ("caching", "batching"),
) -> dict:
    """Both measurements (``tests``: "caching", "batching"); returns a JSON-friendly dict with
    the results and their markdown. Needs ``openai`` (the ``bench`` extra)."""
    import openai

    from infer.bench.client import api_base

    client = openai.OpenAI(base_url=api_base(server), api_key="not-needed", timeout=timeout_s)
    if model is None:
        model = client.models.list().data[0].id
    out: dict = {"schema": "infer.bench.client/1", "server": server, "model": model}
    md = [f"# Client-side tests: {model}", ""]
    if "caching" in tests:
        prefix = long_prefix(prefix_tokens, seed)
        cache = caching_test(client, model, prefix, num_warm, endpoint, seed)
        out["caching"] = asdict(cache)
        md += ["## Cold vs warm long prefix", "", caching_markdown(cache), ""]
    if "batching" in tests:
        batches = batching_test(client, model, batch_sizes, max_tokens, endpoint, seed)
        out["batching"] = [asdict(b) for b in batches]
        md += ["## Sequential vs concurrent batches", "", batching_markdown(batches), ""]
    out["markdown"] = "\n".join(md)
    return out
