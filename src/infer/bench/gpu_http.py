"""``infer bench gpu``'s HTTP section: one of the offline engine's loads sent to ``infer serve``.

The same prompts (token ids, :func:`infer.bench.offline.random_prompts`), the same engine
settings and the same closed loop as the offline cell it is compared with — ``C`` streamed
completions in flight, greedy, ``ignore_eos`` — so the ratio of the two is what the HTTP server, its engine
process and the client's streams cost::

    offline : serve_closed_loop(engine)            -> output tok/s
    http    : C clients -> infer serve (engine process) -> output tok/s (usage counts)

The client is the online driver's closed loop, spread over ``--http-clients`` processes
(:func:`infer.bench.online.closed_loop_processes`) so that it is not what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import re
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infer.bench.online import ClientSpan, CpuPoller, MetricsPoller

WARMUP_TOKENS = 4


def server_command(
    model: Path, args: argparse.Namespace, port: int, mode: str = "graphs"
) -> list[str]:
    """``infer serve`` with the offline ``mode`` engine's settings (see ``make_engine``)."""
    from infer.bench.gpu import mode_server_flags

    cmd = [sys.executable, "-m", "infer.server", "--model", str(model), "--served-model-name",
           "m", "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
           "--dtype", "bfloat16", "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-model-len", str(args.max_model_len), "--seed", str(args.seed),
           "--no-dashboard", "--no-access-log", *mode_server_flags(mode)]  # fmt: skip
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", args.kv_cache_memory]
    return cmd + shlex.split(getattr(args, "http_server_args", "") or "")


def http_section(
    model: Path,
    args: argparse.Namespace,
    load: tuple[int, int, int],
    vocab: int,
    offline: dict | None,
    out: Path,
    log: Callable[[str], None],
    res: dict,
    mode: str = "graphs",
    tag: str | None = None,
) -> dict:
    """Start ``infer serve`` with the engine settings (and environment) of ``mode``, warm it,
    run ``load`` (prompt len, output len, C) over HTTP with the offline cell's prompts, stop
    it; ``res`` gets the figures and the ratio to ``offline`` (that cell's row from the same
    run, if it ran). ``tag`` names the server's log and profiles (default: the mode)."""
    tag = tag or mode
    from infer.bench import pyspy
    from infer.bench.gpu import load_key, mode_environ
    from infer.bench.offline import random_prompts
    from infer.bench.online import (
        ClientSpan,
        CpuPoller,
        GpuUtilPoller,
        MetricsPoller,
        closed_loop,
        closed_loop_processes,
        free_port,
        launch_server,
        stop_server,
        summarize,
    )

    prompt_len, output_len, c = load
    n = max(args.requests_per_c * c, 2 if c == 1 else c)
    res.update(load=load_key(prompt_len, output_len, c), concurrency=c, mode=mode,
               client_processes=args.http_clients, server_args=args.http_server_args)  # fmt: skip
    port = free_port()
    t = time.perf_counter()
    env = {**os.environ, **mode_environ(mode)}
    proc, url = launch_server(
        server_command(model, args, port, mode), port, out / f"http_server_{tag}.log", env=env
    )
    try:
        res["server_start_s"] = time.perf_counter() - t
        log(f"http: infer serve up in {res['server_start_s']:.1f}s")
        warm = random_prompts(vocab, c, prompt_len, seed=97)
        asyncio.run(closed_loop(url + "/v1", warm, c, WARMUP_TOKENS))
        prompts = random_prompts(vocab, n, prompt_len, args.seed)
        span = ClientSpan()
        pids = {"engine": pyspy.engine_pid(proc.pid)}
        for i, pid in enumerate(pyspy.api_server_pids(proc.pid)):  # (--api-server-count)
            pids["api_server" if i == 0 else f"api_server_{i + 1}"] = pid
        with (
            CpuPoller({k: v for k, v in pids.items() if v is not None}) as poller,
            MetricsPoller(url) as server,
            GpuUtilPoller() as gpu_util,
            concurrent.futures.ThreadPoolExecutor(1) as pool,
        ):
            load_done = pool.submit(closed_loop_processes, url + "/v1", prompts, c, output_len,
                                    args.http_clients, span=span)  # fmt: skip
            if args.http_profile:
                res["profile"] = profile_server(proc.pid, args.http_profile, out, log, tag)
            records, wall = load_done.result()
        res["cpu_cores"] = cpu_cores(poller, span)
        res["server_view"] = server_view(server, span, records)
        res.update(gpu_util.report(span.start, span.end, log))
    finally:
        stop_server(proc)
    res["step_kinds"] = server_step_kinds(Path(proc.log_file.name).read_text(errors="replace"))
    row = summarize(records, wall)
    tokens = sum(r.output_tokens or 0 for r in records)
    if row["completed"] != n or tokens != n * output_len:
        raise RuntimeError(
            f"over HTTP {row['completed']} of {n} requests completed, {tokens} output tokens "
            f"of {n * output_len}: {row['errors']}"
        )
    events = sum(len(r.chunk_times_s) for r in records)
    res.update(requests=n, output_tokens=tokens, wall_s=wall, output_tok_s=row["output_tok_s"],
               ttft_ms_p50=row["ttft_ms"]["p50"], itl_ms_p50=row["itl_ms"]["p50"],
               tokens_per_event=tokens / events if events else None)  # fmt: skip
    offline_toks = (offline or {}).get("output_tok_s")
    res["offline_tok_s"] = offline_toks
    res["ratio"] = res["output_tok_s"] / offline_toks if offline_toks else None
    view = res["server_view"]
    running = view["running_mean"]
    log(
        f"http {res['load']}: {res['output_tok_s']:,.0f} tok/s, TTFT p50 "
        f"{res['ttft_ms_p50']:.0f} ms, ITL p50 {res['itl_ms_p50']:.2f} ms"
        + (f"; offline {offline_toks:,.0f} tok/s = {res['ratio']:.2f}x" if offline_toks else "")
        + "; cores busy: "
        + ", ".join(
            f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in res["cpu_cores"].items()
        )
        + (f"; running at the server {running:.1f} of {c}" if running is not None else "")
    )
    return res


def server_view(server: MetricsPoller, span: ClientSpan, records: list) -> dict:
    """The load as the server saw it beside the clients: the mean running and waiting requests
    over the clients' window (a batch short of C means requests spent part of their cycle
    outside the engine), and the mean time to first token and request latency at each end."""
    ok = [r for r in records if r.success]

    def mean_ms(values: list[float]) -> float | None:
        return 1000 * sum(values) / len(values) if values else None

    gauges = server.gauge_means(span.start, span.end)
    at_server = server.histogram_means_ms()
    return {
        "running_mean": gauges["running"],
        "waiting_mean": gauges["waiting"],
        "server_ttft_ms_mean": at_server["ttft"],
        "server_queue_ms_mean": at_server["queue"],
        "server_e2e_ms_mean": at_server["e2e"],
        "client_ttft_ms_mean": mean_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "client_e2e_ms_mean": mean_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "samples": len(server.samples),
        "scrape_errors": server.errors,
    }


def cpu_cores(poller: CpuPoller, span: ClientSpan) -> dict[str, float | None]:
    """The cores each side kept busy while the load ran: the API server's process, its engine
    process (a GPU engine's host side: near 1.0 means its thread, not the GPU, sets the pace)
    and the client processes together (py-spy, when it samples, adds its own pauses)."""
    wall = span.end - span.start
    cores = poller.cores(span.start, span.end)
    more = [cores.pop(name) for name in list(cores) if name.startswith("api_server_")]
    if more:  # several API server processes: their sum (api_servers: how many)
        cores["api_server"] = sum(c or 0.0 for c in [cores.get("api_server"), *more])
        cores["api_servers"] = 1 + len(more)
    cores["clients"] = sum(span.cpu_s) / wall if wall > 0 and span.cpu_s else None
    return cores


def server_step_kinds(log_text: str) -> dict[str, int]:
    """The engine's count of steps by how they ran, from the line its GPU step logs when the
    server stops (``steps run: 812 decode replayed, 95 mixed eager``); {} without one."""
    found = re.findall(r"steps run: (.*)", log_text)
    if not found:
        return {}
    kinds = {}
    for part in found[-1].split(","):
        count, _, kind = part.strip().partition(" ")
        if count.isdigit() and kind:
            kinds[kind] = int(count)
    return kinds


PROFILE_DELAY_S = 1.0  # into the load before sampling starts: past the first prefills


def profile_server(
    server_pid: int, seconds: float, out: Path, log: Callable[[str], None], mode: str = "graphs"
) -> dict:
    """``py-spy`` on the API server and its engine process while the load runs: the raw
    profiles in ``out`` (``pyspy_<mode>_<process>.txt``) and each process's top functions
    (:func:`infer.bench.pyspy.top_frames`). Without py-spy (``$INFER_PY_SPY`` or the PATH),
    says so and measures nothing."""
    from infer.bench import pyspy

    py_spy = pyspy.find_py_spy()
    if py_spy is None:
        log("http: no py-spy (set $INFER_PY_SPY or put it on the PATH): not profiled")
        return {"error": "no py-spy"}
    time.sleep(PROFILE_DELAY_S)
    pids = {"api_server": server_pid, "engine": pyspy.engine_pid(server_pid)}
    running = {}
    for name, pid in pids.items():
        if pid is not None:
            running[name] = pyspy.record(py_spy, pid, seconds, out / f"pyspy_{mode}_{name}.txt")
    found: dict = {}
    for name, spy in running.items():
        _, err = spy.communicate(timeout=seconds + 60)
        raw = out / f"pyspy_{mode}_{name}.txt"
        if spy.returncode != 0 or not raw.exists():
            found[name] = {"error": f"py-spy exited {spy.returncode}: {err.strip()[-300:]}"}
            continue
        found[name] = pyspy.top_frames(raw)
        top = found[name]["self"][:3]
        log(f"http profile {name}: " + "; ".join(f"{100 * s:.0f}% {f}" for s, f in top))
    return found
