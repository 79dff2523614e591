"""Prefill/decode disaggregation vs ordinary replicas on Ray Serve (needs the ray and bench
extras).

    infer bench disagg [--model DIR] [--modes pd,dp[,single]] [--runs 3] [--window 20]
                       [--out bench-results/disagg]

Modes, each a fresh ``infer serve`` on a free port, run in turn within every round (``--runs``
rounds; medians over rounds are reported):

- ``pd``: ``--prefill-replicas 1 --decode-replicas 1``: the router sends a prompt to the
  prefill replica, its KV blocks move through Ray's object store to the decode replica, which
  streams the tokens;
- ``dp``: ``--data-parallel-size 2``: two ordinary replicas, each doing both phases;
- ``single`` (optional): one plain ``infer serve`` (no Ray) with ``--torch-threads 2``.

Every replica reserves ``--replica-cpus`` (1) Ray CPUs and runs ``--torch-threads`` (1)
threads, so the Ray modes use the same two cores; every mode gets the same engine flags
(``--enable-prefix-caching``, chunked prefill, ``--dtype``).

The workload of one run: ``--short-streams`` (16) streams with distinct ~32-token prompts
start first and keep decoding (``ignore_eos``, a ``max_tokens`` that outlasts the window; they
are cancelled once the window's long requests have finished). When each has streamed its first
token (plus ``--settle`` seconds), a window of ``--window`` seconds opens, during which a
long-prompt request (``--long-prompt-tokens`` 1024 distinct random tokens, so no prefix hits,
``--long-max-tokens`` 16) arrives every ``--long-interval`` seconds. Measured at the client
from the SSE events' arrival times (``stream_options.continuous_usage_stats`` gives each
event's token count): the short streams' inter-token latencies inside the window (gaps whose
both ends fall in it: p50, p99, max), the output tokens/s of all requests inside the window,
the long requests' TTFT (p50, p99). The router's ``/metrics`` is read when the window opens and
when its long requests have finished: the difference of ``infer:kv_transfers_total``,
``infer:kv_transfer_bytes_total`` and ``infer:kv_transfer_seconds_{sum,count}`` (pd only;
absent elsewhere) gives MB and ms per transferred long prompt.

Before the workload, on the idle server, ``--idle-requests`` lone long-prompt requests (one at a
time, 2 output tokens) give the TTFT of a 1024-token prompt on an idle replica: in ``dp`` mode,
the prefill time that a KV transfer saves the decode side; in ``pd`` mode, the same requests'
transfers give the idle transfer cost. A transport micro-benchmark (``--transport-reps``, 0
skips it) moves a buffer the size of one long prompt's KV (``2 * layers * kv_heads * head_dim *
dtype bytes * tokens``) between two processes, through Ray's object store (``ray.put`` in one
actor, ``ray.get`` plus a copy into a preallocated buffer in another, on a local 2-CPU Ray) and
through ``torch.distributed`` gloo send/recv (two spawned processes on 127.0.0.1).

Run it alone on the machine (under ``flock /tmp/infer-cpu.lock`` where the cores are shared):
the comparison is only meaningful when nothing else competes for the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from infer.bench.metrics import percentile
from infer.bench.online import free_port, serving
from infer.bench.report import md_table, num, save_report

MODES = ("pd", "dp", "single")
TRANSFER_METRICS = (
    "infer:kv_transfers_total",
    "infer:kv_transfer_bytes_total",
    "infer:kv_transfer_seconds_sum",
    "infer:kv_transfer_seconds_count",
)
TARGET_RATIO = 0.5  # pd's short-stream ITL p99 at most this share of dp's
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


def add_parser(sub: Any) -> None:
    """Register ``infer bench disagg``."""
    p = sub.add_parser(
        "disagg",
        help="prefill/decode disaggregation vs 2 ordinary replicas on Ray Serve: decode ITL "
        "under long prompts, KV transfer cost",
    )
    p.add_argument("--model", default=None,
                   help="model folder (default: a random-init ~100M Llama, built once)")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", default="pd,dp",
                   help="comma-separated, run in this order each round: pd, dp, single")  # fmt: skip
    p.add_argument("--runs", type=int, default=3, help="rounds; medians over rounds")
    p.add_argument("--window", type=float, default=20.0, help="measured window (s)")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds after every short stream's first token before the window")  # fmt: skip
    p.add_argument("--short-streams", type=int, default=16)
    p.add_argument("--short-prompt-tokens", type=int, default=32)
    p.add_argument("--short-max-tokens", type=int, default=None,
                   help="default: as many as the context allows (the streams are cancelled "
                   "after the window)")  # fmt: skip
    p.add_argument("--long-prompt-tokens", type=int, default=1024)
    p.add_argument("--long-max-tokens", type=int, default=16)
    p.add_argument("--long-interval", type=float, default=1.5,
                   help="seconds between long-prompt arrivals in the window")  # fmt: skip
    p.add_argument("--idle-requests", type=int, default=3,
                   help="lone long-prompt requests on the idle server per run (0: skip)")  # fmt: skip
    p.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    p.add_argument("--torch-threads", type=int, default=1, help="per replica (pd, dp)")
    p.add_argument("--single-threads", type=int, default=2, help="torch threads of `single`")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="passed to every mode when given (default: the server's)")  # fmt: skip
    p.add_argument("--prefill-chunk-size", type=int, default=None,
                   help="chunk prompts to N tokens (default: --chunked-prefill, chunks of the "
                   "token budget)")  # fmt: skip
    p.add_argument("--serve-args", default="",
                   help="more `infer serve` flags for every mode, one shell-quoted string")  # fmt: skip
    p.add_argument("--transport-reps", type=int, default=10,
                   help="repetitions of the transport micro-benchmark (0: skip it)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/disagg", help="report folder")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from infer.bench import require_ray_and_bench_extras

    require_ray_and_bench_extras("infer bench disagg")
    return run(args)


# --------------------------------------------------------------------------------------------
# Servers


def _mode_flags(mode: str, args: argparse.Namespace) -> tuple[list[str], int]:
    """The mode's own ``infer serve`` flags and its torch threads."""
    if mode == "single":
        return [], args.single_threads
    ray = ["--replica-cpus", f"{args.replica_cpus:g}"]
    if mode == "pd":
        return ["--prefill-replicas", "1", "--decode-replicas", "1", *ray], args.torch_threads
    return ["--data-parallel-size", "2", *ray], args.torch_threads


def _serve_cmd(
    model: Path, mode: str, args: argparse.Namespace, port: int
) -> tuple[list[str], int]:
    flags, threads = _mode_flags(mode, args)
    cmd = [sys.executable, "-m", "infer.server", "--model", str(model), "--served-model-name",
           "m", "--port", str(port), "--dtype", args.dtype, "--enable-prefix-caching",
           "--torch-threads", str(threads), "--no-dashboard"]  # fmt: skip
    if args.prefill_chunk_size:
        cmd += ["--prefill-chunk-size", str(args.prefill_chunk_size)]
    else:
        cmd += ["--chunked-prefill"]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return cmd + flags + shlex.split(args.serve_args), threads


def _display_cmd(model: Path, mode: str, args: argparse.Namespace) -> str:
    """The mode's server command as a person would type it (the port left out)."""
    cmd = _serve_cmd(model, mode, args, 0)[0][3:]
    i = cmd.index("--port")
    return shlex.join(["infer", "serve", *cmd[:i], *cmd[i + 2 :]])


def _parse_transfer_metrics(text: str) -> dict[str, float]:
    """The KV-transfer counters of a Prometheus text (summed over labels; missing: absent)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{")[0]
        if name in TRANSFER_METRICS:
            out[name] = out.get(name, 0.0) + float(value)
    return out


async def _scrape(client: Any, url: str) -> dict[str, float]:
    r = await client.get(url + "/metrics", timeout=60)
    return _parse_transfer_metrics(r.text) if r.status_code == 200 else {}


def _transfer_cost(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """Transfers between two scrapes: count, MB and ms per transfer (None when the server has
    no such metrics or made no transfer)."""
    if "infer:kv_transfers_total" not in after:
        return None
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    n = d.get("infer:kv_transfers_total", 0.0)
    if n <= 0:
        return {"transfers": 0}
    count = d.get("infer:kv_transfer_seconds_count") or n
    seconds = d.get("infer:kv_transfer_seconds_sum")
    nbytes = d.get("infer:kv_transfer_bytes_total")
    return {
        "transfers": int(n),
        "mb_per_transfer": nbytes / n / 1e6 if nbytes is not None else None,
        "ms_per_transfer": seconds / count * 1e3 if seconds is not None else None,
        "gb_per_s": nbytes / seconds / 1e9 if nbytes and seconds else None,
    }


# --------------------------------------------------------------------------------------------
# Client


class _Stream:
    """One streamed completion: send time, and each event's arrival and new-token count.

    Not :func:`infer.bench.client.stream_request`'s record: that one times the chunks with
    text (a token mid-character sends an empty one) and keeps no per-event token counts; this
    benchmark times every event that brings tokens (``continuous_usage_stats``), at absolute
    times, to count the gaps and tokens inside the window."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.sent = 0.0
        self.events: list[tuple[float, int]] = []  # (perf_counter, tokens in the event)
        self.tokens = 0
        self.done = False
        self.error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.events[0][0] - self.sent if self.events else None


def _body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy ``ignore_eos`` stream of token ids, each event with its running usage."""
    from infer.bench.client import build_payload

    usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    return build_payload("m", prompt, max_tokens, extra_body=usage)


async def _stream(client: Any, url: str, body: dict[str, Any], rec: _Stream) -> _Stream:
    """Send ``body`` and fill ``rec`` as events arrive (cancellable: ``rec`` keeps what came)."""
    rec.sent = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    rec.done = True
                    break
                t = time.perf_counter()
                event = json.loads(data)
                if "error" in event and not event.get("choices"):
                    rec.error = str(event["error"])[:300]
                    return rec
                if not event.get("choices"):
                    continue  # the final usage-only event
                usage = event.get("usage") or {}
                total = usage.get("completion_tokens", rec.tokens + 1)
                if total > rec.tokens:
                    rec.events.append((t, total - rec.tokens))
                    rec.tokens = total
    except Exception as e:  # noqa: BLE001 - one failed request, reported, not a crashed run
        rec.error = f"{type(e).__name__}: {e}"
    return rec


def _ms(xs: list[float], p: float | None = None) -> float | None:
    """The ``p``-th percentile of ``xs`` (seconds) in ms, their maximum when ``p`` is None;
    None for no data."""
    if not xs:
        return None
    return (max(xs) if p is None else percentile(xs, p)) * 1e3


async def _idle(url: str, prompts: list[list[int]]) -> dict[str, Any]:
    """Lone long-prompt requests, one at a time: TTFTs and their transfers."""
    from infer.bench.client import new_client

    async with new_client() as client:
        before = await _scrape(client, url)
        ttfts = []
        for p in prompts:
            rec = await _stream(client, url, _body(p, 2), _Stream("idle"))
            if rec.error or rec.ttft is None:
                raise RuntimeError(f"idle request failed: {rec.error}")
            ttfts.append(rec.ttft)
        after = await _scrape(client, url)
    return {"ttft_ms": [t * 1e3 for t in ttfts], "transfer": _transfer_cost(before, after)}


async def _warm_up(url: str, short: list[int], long: list[int]) -> None:
    from infer.bench.client import new_client

    async with new_client() as client:
        for prompt, n in ((short, 8), (long, 4), (short[::-1], 8)):
            rec = await _stream(client, url, _body(prompt, n), _Stream("warm"))
            if rec.error:
                raise RuntimeError(f"warm-up request failed: {rec.error}")


async def _workload(url: str, shorts: list[list[int]], longs: list[list[int]],
                    args: argparse.Namespace, short_max: int) -> dict[str, Any]:  # fmt: skip
    """One run of the workload (see the module's docstring); its measurements."""
    from infer.bench.client import new_client

    async with new_client() as client:
        short_recs = [_Stream("short") for _ in shorts]
        tasks = [asyncio.create_task(_stream(client, url, _body(p, short_max), r))
                 for p, r in zip(shorts, short_recs, strict=True)]  # fmt: skip
        try:
            t0 = time.perf_counter()
            while not all(r.events for r in short_recs):
                failed = [r.error for r, t in zip(short_recs, tasks, strict=True) if t.done()]
                if failed:
                    raise RuntimeError(f"a short stream ended before its first token: {failed[0]}")
                if time.perf_counter() - t0 > 600:
                    raise RuntimeError("the short streams did not all start within 600 s")
                await asyncio.sleep(0.01)
            warm_s = time.perf_counter() - t0
            await asyncio.sleep(args.settle)
            before = await _scrape(client, url)
            ws = time.perf_counter()
            we = ws + args.window
            long_recs: list[_Stream] = []
            long_tasks = []
            for k, prompt in enumerate(longs):
                at = ws + k * args.long_interval
                if at >= we:
                    break
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                rec = _Stream("long")
                long_recs.append(rec)
                body = _body(prompt, args.long_max_tokens)
                long_tasks.append(asyncio.create_task(_stream(client, url, body, rec)))
            await asyncio.sleep(max(0.0, we - time.perf_counter()))
            ended_early = sum(t.done() for t in tasks)
            await asyncio.gather(*long_tasks)
            after = await _scrape(client, url)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    itls = []
    coalesced = 0
    for r in short_recs:
        for (a, _), (b, k) in zip(r.events, r.events[1:], strict=False):
            if a >= ws and b <= we:
                itls.append(b - a)
                coalesced += k > 1
    tokens = sum(k for r in short_recs + long_recs for t, k in r.events if ws <= t <= we)
    short_tokens = sum(k for r in short_recs for t, k in r.events if ws <= t <= we)
    ttfts = [r.ttft for r in long_recs if r.ttft is not None and not r.error]
    return {
        "warm_s": warm_s,
        "itl_ms": {
            "p50": _ms(itls, 50),
            "p99": _ms(itls, 99),
            "max": _ms(itls),
            "samples": len(itls),
        },
        "coalesced_events": coalesced,
        "tokens_per_s": tokens / args.window,
        "short_tokens_per_s": short_tokens / args.window,
        "long_ttft_ms": {"p50": _ms(ttfts, 50), "p99": _ms(ttfts, 99)},
        "long_requests": len(long_recs),
        "long_failed": sum(1 for r in long_recs if r.error or not r.done),
        "long_errors": sorted({r.error for r in long_recs if r.error})[:3],
        "short_failed": sum(1 for r in short_recs if r.error),
        "short_errors": sorted({r.error for r in short_recs if r.error})[:3],
        "short_ended_in_window": ended_early,
        "transfer": _transfer_cost(before, after),
    }


# --------------------------------------------------------------------------------------------
# Transport micro-benchmark


def _clock() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # one clock for every process here


class _Producer:
    """Ray actor: puts a KV-sized buffer in the object store."""

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        self.buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)

    def put(self) -> tuple[list[Any], float, float]:
        import ray

        t0 = _clock()
        ref = ray.put(self.buf)
        return [ref], t0, _clock()  # in a list: the caller gets the reference, not the value


class _Consumer:
    """Ray actor: gets the buffer and copies it into a preallocated one (as into a KV cache)."""

    def __init__(self, nbytes: int) -> None:
        import numpy as np
        import torch

        torch.set_num_threads(1)
        self.dst = torch.empty(nbytes, dtype=torch.uint8)
        self.view = self.dst.numpy()
        self.np = np

    def get(self, refs: list[Any]) -> tuple[float, float]:
        import ray

        t0 = _clock()
        self.np.copyto(self.view, ray.get(refs[0]))
        return t0, _clock()


def _ray_transport(nbytes: int, reps: int, warm: int = 2) -> dict[str, Any]:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)  # fmt: skip
    try:
        prod = ray.remote(num_cpus=1)(_Producer).remote(nbytes)
        cons = ray.remote(num_cpus=1)(_Consumer).remote(nbytes)
        put, get, e2e = [], [], []
        for i in range(reps + warm):
            refs, p0, p1 = ray.get(prod.put.remote())
            c0, c1 = ray.get(cons.get.remote(refs))
            del refs
            if i >= warm:
                put.append(p1 - p0)
                get.append(c1 - c0)
                e2e.append(c1 - p0)
    finally:
        ray.shutdown()
    med = statistics.median(e2e)
    return {"put_ms": statistics.median(put) * 1e3, "get_copy_ms": statistics.median(get) * 1e3,
            "ms": med * 1e3, "gb_per_s": nbytes / med / 1e9, "reps": reps}  # fmt: skip


def _gloo_worker(rank: int, port: int, nbytes: int, reps: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    if rank == 0:
        buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(reps):
        dist.barrier()
        t = _clock()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
            t = _clock()
        times.append(t)
    dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(times))


def _gloo_transport(nbytes: int, reps: int, warm: int = 2) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_gloo_worker, args=(free_port(), nbytes, reps + warm, d), nprocs=2, join=True)
        sent = json.loads(Path(d, "rank0.json").read_text())
        got = json.loads(Path(d, "rank1.json").read_text())
    xs = [b - a for a, b in zip(sent, got, strict=True)][warm:]
    med = statistics.median(xs)
    return {"ms": med * 1e3, "gb_per_s": nbytes / med / 1e9, "reps": reps}


def transport(nbytes: int, reps: int) -> dict[str, Any]:
    """Median ms and GB/s of moving ``nbytes`` between two processes: Ray's object store, gloo."""
    out: dict[str, Any] = {"bytes": nbytes, "reps": reps}
    for name, fn in (("ray", _ray_transport), ("gloo", _gloo_transport)):
        try:
            out[name] = fn(nbytes, reps)
        except Exception as e:  # noqa: BLE001 - reported; the rest of the benchmark stands
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"transport {name}: {out[name]}", flush=True)
    return out


# --------------------------------------------------------------------------------------------
# The benchmark


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """``2 * layers * kv_heads * head_dim * dtype bytes`` from a Hugging Face config."""
    c = config.get("text_config", config)
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    kv_heads = c.get("num_key_value_heads") or heads
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    """``n`` distinct random token-id prompts (ids 10.. : clear of the usual special ids)."""
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def _one(model: Path, mode: str, rnd: int, args: argparse.Namespace, out: Path,
         vocab: int, short_max: int) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(args.seed * 1000 + rnd)  # the same prompts for every mode of a round
    shorts = _prompts(rng, args.short_streams, args.short_prompt_tokens, vocab)
    n_long = int(args.window / args.long_interval) + 2
    longs = _prompts(rng, n_long, args.long_prompt_tokens, vocab)
    idle = _prompts(rng, args.idle_requests, args.long_prompt_tokens, vocab)
    warm = _prompts(rng, 2, args.long_prompt_tokens, vocab)
    log = out / f"server-{mode}-{rnd}.log"
    port = free_port()
    cmd, threads = _serve_cmd(model, mode, args, port)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with serving(cmd, env, log, port, grace_s=120) as (proc, url, started_s):
        phase = "warm-up"
        try:
            asyncio.run(_warm_up(url, warm[0][: args.short_prompt_tokens], warm[1]))
            result: dict[str, Any] = {"start_s": started_s}
            if idle:
                phase = "idle requests"
                result["idle"] = asyncio.run(_idle(url, idle))
            phase = "workload"
            result.update(asyncio.run(_workload(url, shorts, longs, args, short_max)))
        except Exception as e:  # noted before the server is stopped: did it go away?
            note = _stopped_note(proc, log)
            raise RuntimeError(f"{phase}: {type(e).__name__}: {e!s:.300}{note}") from e
    return result


def _stopped_note(proc: subprocess.Popen, log: Path) -> str:
    """Why the server may have gone away under the benchmark (before it stopped it)."""
    notes = []
    if proc.poll() is not None:
        notes.append(f"the server exited ({proc.returncode})")
    try:
        text = log.read_text(errors="replace").lower()
    except OSError:
        text = ""
    if any(s in text for s in ("stopped by a signal", "shutting down", "raylet is terminated")):
        notes.append("its log says it was stopped from outside this benchmark (a signal, "
                     "`ray stop`?)")  # fmt: skip
    return f" ({'; '.join(notes)}; see {log})" if notes else f" (see {log})"


def _median(runs: list[dict[str, Any]], *path: str) -> float | None:
    xs = []
    for r in runs:
        x: Any = r
        for k in path:
            x = x.get(k) if isinstance(x, dict) else None
        if isinstance(x, (int, float)):
            xs.append(float(x))
    return statistics.median(xs) if xs else None


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    idle = [statistics.median(r["idle"]["ttft_ms"]) for r in runs if r.get("idle")]
    return {
        "runs": len(runs),
        "itl_p50_ms": _median(runs, "itl_ms", "p50"),
        "itl_p99_ms": _median(runs, "itl_ms", "p99"),
        "itl_max_ms": _median(runs, "itl_ms", "max"),
        "tokens_per_s": _median(runs, "tokens_per_s"),
        "short_tokens_per_s": _median(runs, "short_tokens_per_s"),
        "long_ttft_p50_ms": _median(runs, "long_ttft_ms", "p50"),
        "long_ttft_p99_ms": _median(runs, "long_ttft_ms", "p99"),
        "idle_ttft_ms": statistics.median(idle) if idle else None,
        "transfer_mb": _median(runs, "transfer", "mb_per_transfer"),
        "transfer_ms": _median(runs, "transfer", "ms_per_transfer"),
        "idle_transfer_mb": _median(runs, "idle", "transfer", "mb_per_transfer"),
        "idle_transfer_ms": _median(runs, "idle", "transfer", "ms_per_transfer"),
        "failed": sum(r["long_failed"] + r["short_failed"] for r in runs),
        "short_ended_in_window": sum(r["short_ended_in_window"] for r in runs),
    }


def run(args: argparse.Namespace) -> int:
    """``infer bench disagg``: writes ``disagg.json`` and ``disagg.md`` under ``--out``."""
    from infer.bench.report import collect_environment
    from infer.testing.bench_models import llama_100m

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    model = Path(args.model) if args.model else llama_100m(None)
    config = json.loads((model / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    max_len = config.get("text_config", config).get("max_position_embeddings", 2048)
    short_max = args.short_max_tokens or max_len - args.short_prompt_tokens - 1
    payload = kv_bytes_per_token(config, args.dtype) * args.long_prompt_tokens
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = collect_environment()
    results: dict[str, Any] = {
        "config": {
            **{k: v for k, v in vars(args).items() if k != "func"},
            "modes": modes,
            "model": str(model),
            "short_max_tokens": short_max,
            "serve_commands": {m: _display_cmd(model, m, args) for m in modes},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
        "machine": {
            "cpu": env["cpu"],  # report.cpu_model()
            "cpus": os.cpu_count(),
            "torch": env["torch"],
            "git_commit": env["git_commit"],
        },  # fmt: skip
        "kv_payload_bytes": payload,
        "runs": {m: [] for m in modes},
        "errors": {},
    }
    for rnd in range(args.runs):
        for mode in modes:
            print(f"{mode} round {rnd}: starting the server", flush=True)
            try:
                r = _one(model, mode, rnd, args, out, vocab, short_max)
            except Exception as e:  # noqa: BLE001 - reported; the other modes still run
                msg = f"round {rnd}: {type(e).__name__}: {e}"
                results["errors"].setdefault(mode, []).append(msg)
                print(f"{mode} {msg}", file=sys.stderr, flush=True)
                continue
            r["round"] = rnd
            results["runs"][mode].append(r)
            i, t = r["itl_ms"], r["transfer"] or {}
            print(f"{mode} round {rnd}: ITL p50 {i['p50']:.1f} p99 {i['p99']:.1f} max "
                  f"{i['max']:.1f} ms, {r['tokens_per_s']:.0f} tok/s, long TTFT p50 "
                  f"{r['long_ttft_ms']['p50'] or float('nan'):.0f} ms ({r['long_requests']} "
                  f"long, {r['long_failed']} failed), transfers {t.get('transfers', '-')}",
                  flush=True)  # fmt: skip
    results["modes"] = {m: _summary(rs) for m, rs in results["runs"].items() if rs}
    if args.transport_reps > 0:
        results["transport"] = transport(payload, args.transport_reps)
    save_report(results, render(results), out, "disagg")
    lost = any(s["failed"] for s in results["modes"].values())
    return 1 if results["errors"] or lost else 0


# --------------------------------------------------------------------------------------------
# Markdown


def render(results: dict[str, Any]) -> str:
    """The markdown report."""
    c, m = results["config"], results["machine"]
    modes = results.get("modes", {})
    chunk = (f"prefill chunks of {c['prefill_chunk_size']} tokens" if c.get("prefill_chunk_size")
             else "chunked prefill by the token budget")  # fmt: skip
    budget = c.get("max_num_batched_tokens") or "the default"
    lines = [
        "# Prefill/decode disaggregation vs ordinary replicas",
        "",
        f"{c['date']}. Generated by `infer bench disagg` on {m['cpus']} cores of {m['cpu']} "
        f"(torch {m['torch']}, commit {m['git_commit']}): `{Path(c['model']).name}` in "
        f"{c['dtype']}, prefix caching on, {chunk}, token budget {budget}. `pd`: 1 prefill + 1 "
        f"decode replica; `dp`: 2 ordinary replicas; each replica {c['replica_cpus']:g} Ray CPU, "
        f"{c['torch_threads']} torch thread(s); `single`: one plain `infer serve` with "
        f"{c['single_threads']} torch threads. Workload per run: {c['short_streams']} "
        f"streams of {c['short_prompt_tokens']}-token prompts decode throughout; once all have "
        f"streamed (+{c['settle']:g} s), a {c['window']:g} s window in which a "
        f"{c['long_prompt_tokens']}-token prompt (random tokens, no prefix hits; "
        f"{c['long_max_tokens']} output tokens) arrives every {c['long_interval']:g} s. Medians "
        f"over {c['runs']} rounds (modes alternate within a round, each on a fresh server).",
        "",
    ]
    rows = []
    for name, s in modes.items():
        tr = "-"
        if s["transfer_mb"] is not None or s["transfer_ms"] is not None:
            tr = f"{num(s['transfer_mb'])} / {num(s['transfer_ms'])}"
        rows.append([name, num(s["itl_p50_ms"]), num(s["itl_p99_ms"]), num(s["itl_max_ms"]),
                     *(num(s[k], ".0f") for k in ("tokens_per_s", "short_tokens_per_s",
                       "long_ttft_p50_ms", "long_ttft_p99_ms", "idle_ttft_ms")), tr, s["runs"]])  # fmt: skip
    lines += md_table("mode | short ITL p50 (ms) | p99 (ms) | max (ms) | tok/s (all) | tok/s (short) "
                      "| long TTFT p50 (ms) | p99 (ms) | idle 1024-token TTFT (ms) "
                      "| MB / ms per transfer | runs", rows)  # fmt: skip
    pd, dp = modes.get("pd"), modes.get("dp")
    if pd and dp and pd["itl_p99_ms"] and dp["itl_p99_ms"]:
        ratio = pd["itl_p99_ms"] / dp["itl_p99_ms"]
        verdict = "PASS" if ratio <= TARGET_RATIO else "MISS"
        lines += ["", f"Target: short-stream ITL p99 of pd <= {TARGET_RATIO}x dp's: "
                  f"{pd['itl_p99_ms']:.1f} / {dp['itl_p99_ms']:.1f} ms = {ratio:.2f}x, "
                  f"**{verdict}**."]  # fmt: skip
    for name, s in modes.items():
        notes = []
        if s["failed"]:
            notes.append(f"{s['failed']} requests failed")
        if s["short_ended_in_window"]:
            notes.append(f"{s['short_ended_in_window']} short streams ended inside the window "
                         "(raise --short-max-tokens)")  # fmt: skip
        if notes:
            lines += ["", f"**{name}**: " + "; ".join(notes) + "."]
    payload_mb = results["kv_payload_bytes"] / 1e6
    lines += ["", "## Transfer cost", "",
              f"One {c['long_prompt_tokens']}-token prompt's KV is {payload_mb:.1f} MB by the "
              "model's shape (2 x layers x kv heads x head dim x dtype bytes x tokens)."]  # fmt: skip
    if pd:
        lines += [
            "",
            "The router's `infer:kv_transfer_*` metrics (per hand-off: export on the prefill side "
            "into the object store + fetch on the decode side), read before and after:",
            "",
            *md_table("pd | MB per transfer | ms per transfer", [
                ["long prompts in the window", num(pd["transfer_mb"]), num(pd["transfer_ms"])],
                ["lone long prompts, idle server", num(pd["idle_transfer_mb"]),
                 num(pd["idle_transfer_ms"])]]),
        ]  # fmt: skip
    saved = (dp or {}).get("idle_ttft_ms")
    if saved:
        line = (f"The prefill a transfer saves the decode side: a lone {c['long_prompt_tokens']}"
                f"-token request's TTFT on an idle ordinary replica (dp) is {saved:.0f} ms")  # fmt: skip
        if pd and pd["idle_transfer_ms"] is not None:
            line += f"; an idle transfer costs {pd['idle_transfer_ms'] / saved:.0%} of it"
        if pd and pd["transfer_ms"] is not None:
            line += f", one in the window {pd['transfer_ms'] / saved:.0%}"
        if pd and pd["idle_ttft_ms"] is not None:
            line += f". The same lone request's TTFT through pd: {pd['idle_ttft_ms']:.0f} ms"
        lines += ["", line + "."]
    t = results.get("transport")
    if t:
        lines += ["", "## Transport micro-benchmark", "",
                  f"{t['bytes'] / 1e6:.1f} MB (one {c['long_prompt_tokens']}-token payload) "
                  "from one process to another, medians of "
                  f"{t['reps']} repetitions:", ""]  # fmt: skip
        rows = []
        r = t.get("ray", {})
        if "error" in r:
            rows.append(["Ray object store", "-", "-", r["error"]])
        elif r:
            rows.append(["Ray object store (`ray.put` in one actor, `ray.get` + copy in another)",
                         f"{r['ms']:.1f}", f"{r['gb_per_s']:.2f}",
                         f"put {r['put_ms']:.1f} ms, get + copy {r['get_copy_ms']:.1f} ms, the "
                         "rest actor calls"])  # fmt: skip
        g = t.get("gloo", {})
        if "error" in g:
            rows.append(["gloo send/recv", "-", "-", g["error"]])
        elif g:
            rows.append(["torch.distributed gloo send/recv (127.0.0.1)", f"{g['ms']:.1f}",
                         f"{g['gb_per_s']:.2f}", "into a preallocated tensor"])  # fmt: skip
        lines += md_table("path | ms | GB/s | detail", rows)
    rows = []
    for name, runs in results["runs"].items():
        for r in runs:
            it, lt = r["itl_ms"], r["long_ttft_ms"]
            rows.append([name, r["round"], f"{num(it['p50'])} / {num(it['p99'])} / {num(it['max'])}",
                         f"{r['tokens_per_s']:.0f}", f"{num(lt['p50'], '.0f')} / {num(lt['p99'], '.0f')}",
                         f"{r['long_requests']} ({r['long_failed']})",
                         (r.get("transfer") or {}).get("transfers", "-"), f"{r['start_s']:.0f}"])  # fmt: skip
    lines += ["", "## Runs", ""]
    lines += md_table("mode | round | ITL p50 / p99 / max (ms) | tok/s | long TTFT p50 / p99 (ms) "
                      "| long requests (failed) | transfers | server start (s)", rows)  # fmt: skip
    if results["errors"]:
        lines += ["", "## Errors", ""]
        for name, errs in results["errors"].items():
            lines += [f"- {name}: {e}" for e in errs]
    lines += ["", "Server commands:", ""]
    lines += [f"- {name}: `{cmd}`" for name, cmd in c["serve_commands"].items()]
    return "\n".join(lines) + "\n"
