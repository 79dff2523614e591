"""Async streaming client for any OpenAI-compatible server, with per-token timestamps.

One :func:`stream_request` sends one streaming completion (``/v1/completions`` or
``/v1/chat/completions``) and records when each non-empty text chunk arrived. Token counts come
from the server's ``usage`` (requested with ``stream_options.include_usage``); a server that does
not report usage gets its output counted as one token per text chunk, and the record says so.

Streams that end without ``data: [DONE]`` (transformers serve does that) finish normally;
an ``{"error": ...}`` event, a non-200 status, or a transport failure marks the request failed.
:func:`run_workload` replays a :class:`~infer.bench.workloads.Workload` with its arrival process.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from infer.bench.workloads import BenchRequest, Workload

if TYPE_CHECKING:  # httpx comes with the bench extra; imported where a request is sent
    import httpx

Endpoint = Literal["completions", "chat"]


def api_base(server: str) -> str:
    """``http://host:8000`` or ``http://host:8000/v1`` -> ``http://host:8000/v1``."""
    base = server.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds; ``*_s`` offsets are from its send."""

    index: int
    prompt_len_target: int
    max_tokens: int
    scheduled_s: float  # planned send offset from the workload start
    start_s: float = 0.0  # actual send offset from the workload start
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each non-empty chunk
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    usage_reported: bool = False
    finish_reason: str | None = None
    success: bool = False
    error: str | None = None
    output_chars: int = 0
    clipped: bool = False

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive chunks (inter-token latencies when one token per chunk)."""
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: ``(e2e - ttft) / (output_tokens - 1)``."""
        if not self.success or self.ttft_s is None or self.e2e_s is None:
            return None
        if not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["chunk_times_s"] = [round(t, 6) for t in self.chunk_times_s]
        return d

    @staticmethod
    def from_dict(d: dict) -> RequestRecord:
        names = RequestRecord.__dataclass_fields__
        return RequestRecord(**{k: v for k, v in d.items() if k in names})


def build_payload(
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    endpoint: Endpoint = "completions",
    ignore_eos: bool = True,
    temperature: float = 0.0,
    extra_body: dict | None = None,
) -> dict:
    """The JSON body of one streaming request (``prompt``: text, or token ids for
    ``completions``)."""
    body: dict = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": temperature,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM / ours / llama.cpp: always generate max_tokens
    body.update(extra_body or {})
    return body


def _chunk_text(event: dict) -> tuple[str, str | None]:
    """(text, finish_reason) of one streamed event for either endpoint."""
    choices = event.get("choices") or []
    if not choices:
        return "", None
    c = choices[0]
    if "delta" in c:
        delta = c.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or ""
    else:
        text = c.get("text") or ""
    return text, c.get("finish_reason")


async def stream_request(
    client: httpx.AsyncClient,
    base: str,
    payload: dict,
    record: RequestRecord,
    endpoint: Endpoint = "completions",
    clock: Callable[[], float] = time.perf_counter,
) -> RequestRecord:
    """Send ``payload`` and fill ``record`` (times relative to the send) from the SSE stream."""
    url = f"{base}/chat/completions" if endpoint == "chat" else f"{base}/completions"
    t0 = clock()
    n_chunks = 0
    finish_time: float | None = None
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {resp.status_code}: {body[:300]}"
                return record
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank keep-alives, comments, "event:" lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    record.error = f"unparseable event: {data[:200]}"
                    return record
                if "error" in event and not event.get("choices"):
                    err = event["error"]
                    record.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    return record
                now = clock() - t0
                text, finish = _chunk_text(event)
                if text:
                    n_chunks += 1
                    record.output_chars += len(text)
                    record.chunk_times_s.append(now)
                    if record.ttft_s is None:
                        record.ttft_s = now
                if finish and record.finish_reason is None:
                    record.finish_reason = finish
                    finish_time = now
                usage = event.get("usage")
                if usage:
                    record.prompt_tokens = usage.get("prompt_tokens")
                    record.output_tokens = usage.get("completion_tokens")
                    record.usage_reported = True
    except Exception as e:  # noqa: BLE001 - any failure is one lost request, not a crashed run
        record.error = f"{type(e).__name__}: {e}".rstrip(": ")
        return record
    record.e2e_s = clock() - t0
    if not record.usage_reported:
        record.output_tokens = n_chunks
    if record.ttft_s is None and finish_time is not None and record.output_tokens:
        # Tokens were generated but none decoded to visible text (partial characters, special
        # tokens): the chunk that closed the choice marks when the first one was ready.
        record.ttft_s = finish_time
        record.chunk_times_s.append(finish_time)
    if record.ttft_s is None:
        record.error = "stream ended without any output text"
        return record
    # Lost, not done: a stream the server ended itself (a timeout's abort, an engine error),
    # or one cut short before its choice ended (its tokens would count as a whole reply's).
    if record.finish_reason in ("abort", "error"):
        record.error = f"the server ended the request: finish_reason {record.finish_reason}"
        return record
    if record.finish_reason is None:
        record.error = "stream ended before a finish_reason"
        return record
    record.success = True
    return record


def new_client(timeout_s: float = 600.0) -> httpx.AsyncClient:
    """An HTTP client without a connection cap (a burst must reach the server all at once)."""
    import httpx

    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


@dataclass
class WorkloadRun:
    """The records of one workload run and its wall time (first send to last completion)."""

    records: list[RequestRecord]
    duration_s: float
    warmup: list[RequestRecord] = field(default_factory=list)


def _record_for(req: BenchRequest) -> RequestRecord:
    return RequestRecord(
        index=req.index,
        prompt_len_target=req.prompt_len,
        max_tokens=req.max_tokens,
        scheduled_s=req.arrival_s,
        clipped=req.clipped,
    )


async def run_workload(
    workload: Workload,
    server: str,
    model: str,
    endpoint: Endpoint = "completions",
    ignore_eos: bool = True,
    warmup_prompts: tuple[str, ...] = (),
    warmup_max_tokens: int = 8,
    timeout_s: float = 600.0,
    progress: bool = True,
    extra_body: dict | None = None,
) -> WorkloadRun:
    """Send the workload's requests with its arrival process; return every record.

    ``warmup_prompts`` are sent one at a time first and kept apart from the measurement.
    """
    base = api_base(server)
    reqs = workload.requests
    async with new_client(timeout_s) as client:
        warm = []
        for i, prompt in enumerate(warmup_prompts):
            payload = build_payload(model, prompt, warmup_max_tokens, endpoint, ignore_eos)
            rec = RequestRecord(-1 - i, 0, warmup_max_tokens, 0.0)
            warm.append(await stream_request(client, base, payload, rec, endpoint))

        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc=workload.name, unit="req", leave=True)
        records = [_record_for(r) for r in reqs]
        t_start = time.perf_counter()

        async def one(req: BenchRequest, rec: RequestRecord) -> None:
            payload = build_payload(
                model, req.prompt, req.max_tokens, endpoint, ignore_eos, extra_body=extra_body
            )
            rec.start_s = time.perf_counter() - t_start
            await stream_request(client, base, payload, rec, endpoint)
            if bar is not None:
                bar.update(1)

        try:
            if workload.spec.arrival == "sequential":
                for req, rec in zip(reqs, records, strict=True):
                    await one(req, rec)
            else:
                tasks = []
                for req, rec in zip(reqs, records, strict=True):
                    delay = req.arrival_s - (time.perf_counter() - t_start)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(one(req, rec)))
                await asyncio.gather(*tasks)
        finally:
            if bar is not None:
                bar.close()
        ends = [r.start_s + r.e2e_s for r in records if r.e2e_s is not None]
        duration = (max(ends) if ends else time.perf_counter() - t_start) - min(
            (r.start_s for r in records), default=0.0
        )
    return WorkloadRun(records, max(duration, 1e-9), warm)


async def reachable(server: str, timeout_s: float = 10.0) -> str | None:
    """``None`` when something answers HTTP at ``server``, else why not (a one-line reason)."""
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        try:
            await client.get(f"{api_base(server)}/models")
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"
    return None


async def fetch_models(server: str, timeout_s: float = 10.0) -> list[dict]:
    """``GET /v1/models`` -> its ``data`` list ([] when the server has no such route)."""
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        try:
            resp = await client.get(f"{api_base(server)}/models")
        except httpx.HTTPError:
            return []
        if resp.status_code != 200:
            return []
        try:
            return list(resp.json().get("data") or [])
        except (ValueError, AttributeError):
            return []


async def fetch_engine_stats(server: str, timeout_s: float = 10.0) -> dict | None:
    """``GET /debug/engine`` of an infer server (counters such as preemptions and prefix-cache
    hits); ``None`` for servers without it."""
    base = server.rstrip("/").removesuffix("/v1")
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        try:
            resp = await client.get(f"{base}/debug/engine")
            return resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None


def stats_delta(before: dict | None, after: dict | None) -> dict | None:
    """Numeric counters of ``after`` minus ``before`` (``*_total`` fields and steps)."""
    if not before or not after:
        return None
    keys = [k for k, v in after.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {
        k: after[k] - before.get(k, 0)
        for k in keys
        if k.endswith("_total") or k in ("steps", "step_failures")
    }


async def reset_prefix_cache(server: str, timeout_s: float = 30.0) -> bool:
    """``POST /reset_prefix_cache`` (infer serve, vLLM): start a workload with a cold cache.
    ``False`` when the server has no such route or no prefix cache."""
    base = server.rstrip("/").removesuffix("/v1")
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        try:
            resp = await client.post(f"{base}/reset_prefix_cache")
        except httpx.HTTPError:
            return False
    return resp.status_code == 200
