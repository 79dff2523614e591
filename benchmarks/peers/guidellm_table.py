"""The table of ``gguf_vs_llama_server.sh``'s guidellm results: per server, round and
concurrency, output tokens per second over the run (all requests' output tokens over its
duration), median time to first token and median inter-token latency; then each server's
median over the rounds and infer's ratio.

    python benchmarks/peers/guidellm_table.py OUT_DIR [--machine "..."] > table.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

NAMES = {"llamacpp": "llama.cpp (llama-server)", "infer": "infer serve"}


def read(out: Path) -> dict[tuple[str, int, int], dict[str, float]]:
    rows = {}
    for f in sorted(out.glob("*-r*-c*.json")):
        engine, rnd, conc = f.stem.rsplit("-", 2)
        bench = json.loads(f.read_text())["benchmarks"][0]
        m = bench["metrics"]
        ok = m["output_token_count"]["successful"]
        rows[(engine, int(rnd[1:]), int(conc[1:]))] = {
            "tok_s": ok["total_sum"] / bench["duration"],
            "ttft_ms": m["time_to_first_token_ms"]["successful"]["median"],
            "itl_ms": m["inter_token_latency_ms"]["successful"]["median"],
            "tokens": ok["median"],
            "errors": m["request_totals"]["errored"],
        }
    return rows


def render(rows: dict, machine: str) -> str:
    lines = [machine, "", "| concurrency | round | server | output tok/s | TTFT ms (median) | "
             "ITL ms (median) | tokens / request | errors |", "|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for (engine, rnd, conc), v in sorted(
        rows.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0] != "llamacpp")
    ):
        lines.append(f"| {conc} | {rnd} | {NAMES.get(engine, engine)} | {v['tok_s']:.1f} | "
                     f"{v['ttft_ms']:.0f} | {v['itl_ms']:.1f} | {v['tokens']:.0f} | {v['errors']} |")  # fmt: skip
    lines += ["", "| concurrency | llama.cpp tok/s | infer tok/s | infer / llama.cpp | llama.cpp TTFT ms | "
              "infer TTFT ms |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for conc in sorted({k[2] for k in rows}):
        med = {
            e: {f: statistics.median(v[f] for k, v in rows.items() if k[0] == e and k[2] == conc)
                for f in ("tok_s", "ttft_ms")}
            for e in ("llamacpp", "infer")
        }  # fmt: skip
        lines.append(f"| {conc} | {med['llamacpp']['tok_s']:.1f} | {med['infer']['tok_s']:.1f} | "
                     f"{med['infer']['tok_s'] / med['llamacpp']['tok_s']:.2f}x | "
                     f"{med['llamacpp']['ttft_ms']:.0f} | {med['infer']['ttft_ms']:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--machine", default="")
    args = p.parse_args()
    print(render(read(args.out), args.machine), end="")


if __name__ == "__main__":
    main()
