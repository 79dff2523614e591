"""``infer bench ablation``: the optimisation ladder, one ``infer serve`` per rung.

Rungs (each adds one optimisation to the previous): static + contiguous; continuous +
contiguous; continuous + paged; + chunked prefill; + prefix caching; and, only when asked for
with ``compile_flag``, a last rung with that server flag (e.g. a compiled decode step). Every rung
gets the same KV budget (``--num-kv-blocks``, by default 8 full-context sequences, e.g. 8 x 4096
tokens for a 4096-context model), so the paged rungs can admit more requests than the contiguous
ones in the same memory. For each rung the server is started on a free loopback port, the
workloads are run, the report saved, the server stopped; at the end one markdown log holds every
rung's tables, the phase-vs-phase deltas and the comparison plots.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from infer.bench import DEFAULT_OUT
from infer.bench.online import free_port, launch_server, stop_server
from infer.bench.report import render_markdown, slug


@dataclass(frozen=True)
class Rung:
    name: str
    flags: tuple[str, ...]


def ladder(chunk: int, compile_flag: str | None = None) -> list[Rung]:
    """The rungs in order; ``compile_flag`` (a server flag) adds a last ``+compiled_decode`` rung."""
    static = ("--batching-mode", "static", "--kv-cache-backend", "contiguous")
    cont = ("--batching-mode", "continuous", "--kv-cache-backend", "contiguous")
    # Prefix caching is on by default: the rungs before its own name it off.
    off = ("--no-enable-prefix-caching",)
    paged = ("--batching-mode", "continuous", "--kv-cache-backend", "paged")
    chunked = (*paged, "--prefill-chunk-size", str(chunk))
    prefix = (*chunked, "--enable-prefix-caching")
    paged, chunked = (*paged, *off), (*chunked, *off)
    rungs = [
        Rung("static+contiguous", static),
        Rung("continuous+contiguous", cont),
        Rung("continuous+paged", paged),
        Rung("+chunked_prefill", chunked),
        Rung("+prefix_caching", prefix),
    ]
    if compile_flag:
        rungs.append(Rung("+compiled_decode", (*prefix, compile_flag)))
    return rungs


def model_context(model: str) -> int | None:
    """``max_position_embeddings`` / ``n_positions`` of a local checkpoint folder, if readable."""
    path = Path(model) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    text = cfg.get("text_config") or {}
    return text.get("max_position_embeddings")


class ServerProcess:
    """``python -m infer.server`` with ``flags``, started and stopped as every online benchmark
    does it (:mod:`infer.bench.online`); a context manager."""

    def __init__(
        self,
        model: str,
        flags: list[str],
        log_path: Path,
        port: int | None = None,
        startup_timeout_s: float = 600.0,
    ):
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable, "-m", "infer.server", "--model", model,
            "--host", "127.0.0.1", "--port", str(self.port), "--no-access-log", *flags,
        ]  # fmt: skip
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float | None = None) -> None:
        self.proc, _ = launch_server(
            self.cmd, self.port, self.log_path, timeout_s=timeout_s or self.startup_timeout_s
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is not None:
            stop_server(self.proc, grace_s=timeout_s)
            self.proc = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_ablation(
    model: str,
    bench_cfg,
    out_dir: str | Path = DEFAULT_OUT,
    server_args: str = "",
    chunk: int | None = None,
    kv_tokens: int | None = None,
    block_size: int = 16,
    rungs: list[str] | None = None,
    startup_timeout_s: float = 600.0,
    compile_flag: str | None = None,
) -> tuple[Path, list[str]]:
    """Run the ladder; returns the combined markdown log's path and the rungs that failed.

    ``bench_cfg`` is a :class:`~infer.bench.serve.ServeBenchConfig` (its server and label are
    replaced per rung). ``compile_flag``: a server flag that gets its own last rung.
    """
    from infer.bench.compare import compare_markdown
    from infer.bench.plots import write_compare_plots, write_report_plots
    from infer.bench.report import save_json
    from infer.bench.serve import default_scale, run_serving_benchmark

    scale = bench_cfg.scale if bench_cfg.scale is not None else default_scale()
    chunk = chunk or max(16, int(round(512 * scale)))
    ctx = model_context(model)
    if kv_tokens is None and ctx:
        kv_tokens = 8 * ctx
    common = shlex.split(server_args)
    if kv_tokens:
        common += ["--block-size", str(block_size), "--num-kv-blocks", str(kv_tokens // block_size)]
    ladder_rungs = ladder(chunk, compile_flag)
    if rungs:
        unknown = [name for name in rungs if name not in {r.name for r in ladder_rungs}]
        if unknown:
            raise ValueError(f"unknown rung(s) {', '.join(unknown)} (the rungs: "
                             f"{', '.join(r.name for r in ladder_rungs)})")  # fmt: skip
        ladder_rungs = [r for r in ladder_rungs if r.name in rungs]
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = Path(out_dir) / f"ablation_{stamp}_{slug(model)}"
    root.mkdir(parents=True, exist_ok=True)
    reports, sections, failed = [], [], []
    for rung in ladder_rungs:
        flags = [*rung.flags, *common]
        folder = root / slug(rung.name)
        print(f"\n=== rung {rung.name}: infer serve {' '.join(flags)} ===", flush=True)
        try:
            with ServerProcess(model, flags, folder / "server.log", None, startup_timeout_s) as srv:
                cfg = replace(
                    bench_cfg,
                    server=srv.url,
                    label=rung.name,
                    server_flags=" ".join(flags),
                    scale=scale,
                )
                report = asyncio.run(run_serving_benchmark(cfg))
        except (RuntimeError, TimeoutError, ConnectionError, OSError) as e:
            # One rung that cannot start (a backend this build lacks) must not lose the others.
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"rung {rung.name} failed: {first}", flush=True)
            failed.append(rung.name)
            sections.append(
                f"## {rung.name}\n\n> **Rung failed**: `{first}` (server log: "
                f"{folder.name}/server.log)\n"
            )
            continue
        made = write_report_plots(report, folder)
        save_json(report, folder / "report.json")
        md = render_markdown(report, made)
        (folder / "report.md").write_text(md)
        reports.append(report)
        rel = folder.name
        sections.append(_shift_headings(md, rel))
    text = [
        f"# Ablation ladder: {model}",
        "",
        f"Scale {scale}, seed {bench_cfg.seed}, chunk {chunk}, KV budget "
        f"{kv_tokens or 'server default'} tokens, common server flags `{' '.join(common)}`.",
        "",
    ]
    if failed:
        text += [f"> **Rungs that failed**: {', '.join(failed)} (see their sections).", ""]
    if len(reports) > 1:
        cmp_md = compare_markdown(reports)
        made = write_compare_plots(reports, root / "compare")
        text += [cmp_md.replace("# Comparison", "## Comparison", 1), "", "### Comparison plots", ""]
        text += [f"![{n}](compare/{f})" for n, f in made.items()]
        text.append("")
    text += sections
    log = root / "ABLATION.md"
    log.write_text("\n".join(text).rstrip() + "\n")
    return log, failed


def _shift_headings(md: str, rel: str) -> str:
    """A rung's report inside the combined log: one level deeper, image paths into its folder."""
    out = []
    for line in md.splitlines():
        if line.startswith("#"):
            line = "#" + line
        if line.startswith("![") and "](" in line:
            name, path = line[2:].split("](", 1)
            line = f"![{name}]({rel}/{path}"
        out.append(line)
    return "\n".join(out)
