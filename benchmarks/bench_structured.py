"""What constrained decoding costs: ``infer bench structured``.

    infer bench structured [--runs 3] [--out bench-results/structured]

(``python benchmarks/bench_structured.py`` runs the same.) Three parts, one run:

1. **The grammar engine** (llguidance, with the ``small`` model's tokenizer): the time to build
   a matcher for a new moderate JSON schema (a 10-field object with nested arrays, enums and
   bounded strings) and for the same schema again (the grammar cached), and the time to fill
   the token bitmasks of 64 constrained requests, in mid-object states (per step). The same
   with xgrammar when it is installed (not a dependency: the comparison that chose llguidance).
2. **Throughput**, offline engine, the built-in ``small`` model and the ~110M Llama of
   ``infer bench engine`` (random weights: the grammar shapes its output all the same), bf16:
   C requests in flight
   (C = 16, 64), 4 x C requests, 256-token prompts, up to 128 output tokens, EOS ignored:
   every other request constrained by the schema vs none, the unconstrained run stopping each
   of those requests at the length its JSON had (same prompts, same number of tokens). Output
   tok/s, medians of ``--runs``.
3. **Time to first token** of one request with a schema never seen before (the matcher built
   while it waits) vs one with a cached schema, on an idle engine (medians of 10).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from infer.bench.cli import add_common
from infer.bench.offline import first_token, make_engine, output_tok_s, serve_one
from infer.bench.report import machine_line, md_table, offline_machine, save_report
from infer.core.sampling_params import SamplingParams
from infer.core.structured import StructuredOutputs
from infer.engine.engine import LLMEngine


def moderate_schema(tag: str = "") -> dict:
    """A 10-field object: strings, bounded numbers, enums, a nested array of objects."""
    return {
        "title": f"Order{tag}",
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "customer": {"type": "string", "maxLength": 16},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
            "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
            "priority": {"type": "boolean"},
            "total": {"type": "number", "minimum": 0, "maximum": 1000},
            "currency": {"enum": ["EUR", "USD", "GBP"]},
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 8},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "quantity"],
                    "additionalProperties": False,
                },
            },
            "notes": {"type": "string", "maxLength": 24},
            "gift": {"type": "boolean"},
        },
        "required": ["order_id", "customer", "status", "total", "currency", "items"],
        "additionalProperties": False,
    }


def _engine(concurrency: int, model: str = "small") -> LLMEngine:
    return make_engine(model, dtype="bfloat16", max_num_seqs=concurrency,
                       max_num_batched_tokens=4096)  # fmt: skip


def grammar_engine(tokenizer, runs: int) -> dict:
    import llguidance.hf
    from llguidance import LLMatcher
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    from infer.structured import compile_grammar

    t0 = time.perf_counter()
    llg_tok = llguidance.hf.from_tokenizer(tokenizer)
    tokenizer_s = time.perf_counter() - t0
    new, cached = [], []
    for i in range(runs * 3):
        spec = StructuredOutputs(json=moderate_schema(f"{time.time_ns()}-{i}"))
        t0 = time.perf_counter()
        matcher = LLMatcher(llg_tok, compile_grammar(spec), log_level=0)
        matcher.compute_bitmask()  # the first mask is where a lazy grammar does its work
        new.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        again = LLMatcher(llg_tok, compile_grammar(spec), log_level=0)
        again.compute_bitmask()
        cached.append(time.perf_counter() - t0)
    # 64 matchers part-way into an object, one bitmask fill for all of them per step.
    grammar = compile_grammar(StructuredOutputs(json=moderate_schema()))
    prefix = tokenizer.encode('{"order_id":12,"customer":"ann', add_special_tokens=False)
    matchers = []
    for _ in range(64):
        m = LLMatcher(llg_tok, grammar, log_level=0)
        assert m.consume_tokens(prefix), m.get_error()
        matchers.append(m)
    mask = allocate_token_bitmask(64, len(tokenizer))
    fills = []
    for _ in range(50):  # one after another, as the engine does (see StructuredOutputManager)
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            fill_next_token_bitmask(m, mask, i)
        fills.append(time.perf_counter() - t0)
    return _grammar_figures(tokenizer_s, new, cached, fills)


def _grammar_figures(
    tokenizer_s: float, new: list[float], cached: list[float], fills: list[float]
) -> dict:
    """A grammar engine's row, in ms: its tokenizer wrapper's build, then the medians of a new
    schema's matcher, a cached one's and the 64 requests' bitmask fill."""
    return {
        "tokenizer_build_ms": 1000 * tokenizer_s,
        "new_schema_ms": 1000 * statistics.median(new),
        "cached_schema_ms": 1000 * statistics.median(cached),
        "mask_batch64_ms": 1000 * statistics.median(fills),
    }


def xgrammar_engine(tokenizer, runs: int) -> dict | None:
    """The same measures with xgrammar, when it is installed (it is not a dependency: it
    brings triton, ~1 GB); None otherwise. Its compact JSON puts a space after ``:`` and
    ``,``, so its mid-object state is reached with that spelling."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
    tokenizer_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    new, cached = [], []
    for i in range(runs * 3):
        schema = json.dumps(moderate_schema(f"{time.time_ns()}-{i}"))
        for times in (new, cached):
            t0 = time.perf_counter()
            grammar = compiler.compile_json_schema(schema, any_whitespace=False)
            xgr.GrammarMatcher(grammar).fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t0)
    grammar = compiler.compile_json_schema(json.dumps(moderate_schema()), any_whitespace=False)
    prefix = tokenizer.encode('{"order_id": 12, "customer": "ann', add_special_tokens=False)
    matchers = []
    for _ in range(64):
        m = xgr.GrammarMatcher(grammar)
        assert all(m.accept_token(t) for t in prefix)
        matchers.append(m)
    masks = xgr.allocate_token_bitmask(64, info.vocab_size)
    fills = []
    for _ in range(50):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(masks, i)
        fills.append(time.perf_counter() - t0)
    return _grammar_figures(tokenizer_s, new, cached, fills)


def _prompts(tokenizer, n: int) -> list[list[int]]:
    from infer.builtin.textdata import split_docs
    from infer.data.corpus import load_corpus

    _, val = split_docs(load_corpus())
    ids = tokenizer.encode("\n\n".join(val), add_special_tokens=False)
    starts = range(0, len(ids) - 256, 97)  # overlapping windows: the held-out text is short
    return [ids[starts[i % len(starts)] :][:256] for i in range(n)]


def throughput(engine: LLMEngine, prompts: list[list[int]], concurrency: int, seed: int,
               lengths: dict[int, int] | None = None) -> tuple[float, dict[int, int]]:  # fmt: skip
    """Output tok/s serving ``prompts`` with ``concurrency`` in flight. Without ``lengths``,
    every other request is constrained; returns their output lengths too. With ``lengths``
    nothing is constrained and those requests stop at the same lengths, so both runs generate
    the same tokens from the same prompts (a constrained request ends with its JSON, and
    shorter outputs alone would lower tok/s)."""
    schema = StructuredOutputs(json=moderate_schema())
    run = time.perf_counter_ns()
    requests = []
    for i, prompt in enumerate(prompts):
        constrained = lengths is None and i % 2 == 0
        params = SamplingParams(max_tokens=(lengths or {}).get(i, 128), temperature=1.0,
                                seed=seed * 1000 + i, ignore_eos=True,
                                structured_outputs=schema if constrained else None)  # fmt: skip
        requests.append((f"s{seed}-{run}-{i}", prompt, params))
    tok_s, done = output_tok_s(engine, requests, concurrency)
    index = {rid: i for i, (rid, _, _) in enumerate(requests)}
    got = {index[o.request_id]: o.num_output_tokens for o in done if index[o.request_id] % 2 == 0}
    return tok_s, got


def ttft(engine: LLMEngine, prompt: list[int], fresh: bool, i: int) -> float:
    tag = f"-{time.time_ns()}" if fresh else ""
    spec = StructuredOutputs(json=moderate_schema(tag))
    first, _ = first_token(engine, f"t{i}-{time.perf_counter_ns()}", prompt,
                           SamplingParams(max_tokens=1, structured_outputs=spec))  # fmt: skip
    assert first is not None
    return first


def run(args: argparse.Namespace) -> int:
    report: dict = {
        "machine": offline_machine(),
        "runs": args.runs, "model": "small (bf16)",
    }  # fmt: skip
    probe = _engine(1)
    tokenizer = probe.tokenizer
    report["grammar_engine"] = grammar_engine(tokenizer, args.runs)
    print("grammar engine", report["grammar_engine"], flush=True)
    report["xgrammar"] = xgrammar_engine(tokenizer, args.runs)
    print("xgrammar", report["xgrammar"], flush=True)
    from infer.testing.bench_models import llama_100m

    models = {"small": "small", "llama-110m": str(llama_100m(None))}
    rows = {}
    for (name, model), c in [(m, c) for m in models.items() for c in (16, 64)]:
        engine = _engine(c, model)
        prompts = _prompts(engine.tokenizer, 4 * c)
        throughput(engine, prompts[:c], c, seed=99)  # warm-up (tokenizer, kernels)
        results: dict[str, list[float]] = {"none": [], "half": []}
        for r in range(args.runs):
            tok_s, lengths = throughput(engine, prompts, c, r)
            results["half"].append(tok_s)
            results["none"].append(throughput(engine, prompts, c, r, lengths)[0])
        row: dict = {k: statistics.median(v) for k, v in results.items()}
        row.update(runs=results, loss=1 - row["half"] / row["none"], model=name, c=c)
        rows[f"{name}/c{c}"] = row
        print("throughput", name, c, row, flush=True)
        del engine
    report["throughput"] = rows
    engine = _engine(4)
    prompt = _prompts(tokenizer, 1)[0]
    ttft(engine, prompt, False, -1)  # the cached one's first build
    new = [ttft(engine, prompt, True, i) for i in range(10)]
    cached = [ttft(engine, prompt, False, i) for i in range(10)]
    plain = [serve_one(engine, f"p{i}", prompt, SamplingParams(max_tokens=1)) for i in range(10)]
    report["ttft_ms"] = {"new_schema": 1000 * statistics.median(new),
                         "cached_schema": 1000 * statistics.median(cached),
                         "unconstrained": 1000 * statistics.median(plain)}  # fmt: skip
    print("ttft", report["ttft_ms"], flush=True)
    save_report(report, render(report), args.out, "structured")
    return 0


def render(r: dict) -> str:
    """The markdown report."""
    g, t, tt, x = r["grammar_engine"], r["throughput"], r["ttft_ms"], r.get("xgrammar")
    lines = [
        "# Structured outputs: what constraints cost",
        "",
        machine_line(r["machine"])
        + f" Model `{r['model']}`; grammar engine llguidance; a moderate "
        f"JSON schema (10 fields: bounded strings, a pattern, enums, number ranges, a nested "
        f"array of objects). Medians of {r['runs']} runs.",
        "",
        "## Grammar engine",
        "",
        *md_table("measure (ms) | llguidance | xgrammar", [
            [label, f"{g[key]:.2f}", f"{x[key]:.2f}" if x else "not installed"]
            for key, label in [("tokenizer_build_ms", "tokenizer wrapper, built once per engine"),
                               ("new_schema_ms", "matcher for a new schema (compile + first mask)"),
                               ("cached_schema_ms", "matcher for a cached schema (+ first mask)"),
                               ("mask_batch64_ms", "bitmasks of 64 requests mid-object, one step")]
        ], "lrr"),
        "",
        "## Throughput: half the requests constrained vs none (offline, 256 in / <= 128 out, "
        "the same output lengths in both)",
        "",
        *md_table("model | C | none tok/s | half constrained tok/s | loss", [
            [row["model"], row["c"], f"{row['none']:.1f}", f"{row['half']:.1f}",
             f"{100 * row['loss']:.1f}%"] for row in t.values()], "lrrrr"),
        "",
        "## Time to first token (idle engine, 256-token prompt)",
        "",
        f"new schema {tt['new_schema']:.1f} ms, cached schema {tt['cached_schema']:.1f} ms, "
        f"unconstrained {tt['unconstrained']:.1f} ms.",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer bench structured",
        description="structured outputs: grammar compile / mask cost, throughput, TTFT",
    )
    add_common(p, runs=3, out="structured")
    return p


if __name__ == "__main__":
    from infer.bench.cli import main as infer_main

    sys.exit(infer_main(["bench", "structured", *sys.argv[1:]]))
