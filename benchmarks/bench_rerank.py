"""What reranking costs with a cross-encoder, and what the engine buys over a plain batched
forward pass: ``infer bench rerank``.

    infer bench rerank [--model FOLDER] [--runs 3] [--out bench-results/rerank]

(``python benchmarks/bench_rerank.py`` runs the same.) The ~110M Llama of ``infer bench
engine`` as a one-label ``LlamaForSequenceClassification`` (its decoder, a random ``score``
head; bf16) unless ``--model`` names a classifier folder. One query of Q random token ids
against N documents of D each, each pair one input (query then document), for
(Q, D) = (32, 224) and (128, 384):

- **transformers**: ``AutoModelForSequenceClassification`` in batches of B pairs (the
  sentence-transformers ``CrossEncoder`` default, 32; every pair the same length: no padding),
  the sigmoid of the logit: what a user reranks with when they have no serving engine.
- **infer**: ``LLM.score(query, documents)`` with prefix caching (the default): the query's
  full KV blocks are computed once and shared by every pair after the first.
- **infer, no prefix caching** (``enable_prefix_caching=False``): every pair computed whole,
  what the sharing buys.

Pairs per second, medians of ``--runs``, and each bf16 path's largest distance from
transformers' scores in float32 over the first 8 pairs of each run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from infer.bench.cli import add_common
from infer.bench.report import machine_line, md_table, offline_machine, save_report

NEEDS_BENCH_EXTRA = False
CASES = ((32, 224), (128, 384))


def reranker_100m(model: str | None) -> Path:
    """``model`` when given, else the ~110M Llama with a one-label score head (built once)."""
    if model:
        return Path(model)
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from infer.testing.bench_models import LLAMA_100M_DIR, llama_100m

    out = LLAMA_100M_DIR.with_name("llama-100m-reranker")
    if (out / "config.json").exists():
        return out
    source = llama_100m(None)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification.from_pretrained(source, num_labels=1,
                                                           dtype=torch.bfloat16)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(source)
    model.config.pad_token_id = tokenizer.eos_token_id  # (batches of pairs need one named)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def _ids(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()


def hf_scores(model, query: list[int], docs: list[list[int]], batch: int) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for i in range(0, len(docs), batch):
            ids = torch.tensor([query + d for d in docs[i : i + batch]])
            out.append(torch.sigmoid(model(input_ids=ids).logits[:, 0].float()))
    return torch.cat(out)


def infer_scores(llm, query: list[int], docs: list[list[int]]) -> torch.Tensor:
    return torch.tensor([r.outputs.score for r in llm.score([query], docs)])


def timed(fn, *args) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - t0, value


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForSequenceClassification

    from infer import LLM

    path = reranker_100m(args.model)
    options = dict(dtype="bfloat16", max_num_seqs=args.num_docs)
    engines = {"infer": LLM(str(path), enable_prefix_caching=True, **options),
               "infer, no prefix caching": LLM(str(path), enable_prefix_caching=False,
                                               **options)}  # fmt: skip
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.bfloat16).eval()
    hf32 = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    vocab = min(engines["infer"].engine.spec.vocab_size, len(engines["infer"].tokenizer))
    report: dict = {"machine": offline_machine(), "runs": args.runs, "model": str(path),
                    "num_docs": args.num_docs, "batch": args.batch, "cases": {}}  # fmt: skip
    for q_len, d_len in CASES:
        warm = _ids(vocab, 5, q_len + d_len, seed=7)
        hf_scores(hf, warm[0][:q_len], warm[1:], args.batch)
        for llm in engines.values():
            infer_scores(llm, warm[0][:q_len], warm[1:])
        times: dict[str, list[float]] = {"transformers": [], **{k: [] for k in engines}}
        worst = dict.fromkeys(times, 0.0)
        for r in range(args.runs):
            query = _ids(vocab, 1, q_len, seed=1000 * r + q_len)[0]
            docs = _ids(vocab, args.num_docs, d_len, seed=1000 * r + d_len + 1)
            exact = hf_scores(hf32, query, docs[:8], 8)
            got = {}
            t, got["transformers"] = timed(hf_scores, hf, query, docs, args.batch)
            times["transformers"].append(t)
            for name, llm in engines.items():
                llm.reset_prefix_cache()
                t, got[name] = timed(infer_scores, llm, query, docs)
                times[name].append(t)
            for name, scores in got.items():
                worst[name] = max(worst[name], float((scores[:8] - exact).abs().max()))
        case = {name: args.num_docs / statistics.median(ts) for name, ts in times.items()}
        case["worst_vs_fp32"] = worst
        case["seconds"] = times
        report["cases"][f"{q_len}+{d_len}"] = case
        print(q_len, d_len, {k: v for k, v in case.items() if k != "seconds"}, flush=True)
    for llm in engines.values():
        llm.close()
    save_report(report, render(report), args.out, "rerank")
    return 0


def render(r: dict) -> str:
    rows = []
    for lengths, c in r["cases"].items():
        base = c["transformers"]
        cached, plain = c["infer"], c["infer, no prefix caching"]
        w = c["worst_vs_fp32"]
        rows.append([lengths, f"{base:.1f}", f"{cached:.1f}", f"{cached / base:.2f}x",
                     f"{plain:.1f}", f"{plain / base:.2f}x",
                     f"{w['transformers']:.4f} / {w['infer']:.4f}"])  # fmt: skip
    lines = [
        "# Reranking with a cross-encoder: infer vs a batched transformers forward pass",
        "",
        machine_line(r["machine"])
        + f" Model `{r['model']}` (bf16, one label). One query of Q random token ids against "
        f"{r['num_docs']} documents of D, each pair one input; transformers in batches of "
        f"{r['batch']}. Pairs per second, medians of {r['runs']} runs (prefix cache emptied "
        "before each).",
        "",
        *md_table(
            "Q+D | transformers /s | infer /s | ratio | infer, no prefix caching /s | ratio | "
            "largest score error vs fp32: transformers / infer",
            rows,
            "lrrrrrr",
        ),
    ]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer bench rerank",
        description="reranking: infer's LLM.score with a cross-encoder vs transformers' "
        "batched forward pass",
    )
    add_common(p, model=True, runs=3, out="rerank")
    p.add_argument("--num-docs", type=int, default=64, help="documents per query")
    p.add_argument("--batch", type=int, default=32, help="transformers' batch size")
    return p


if __name__ == "__main__":
    from infer.bench.cli import main as infer_main

    sys.exit(infer_main(["bench", "rerank", *sys.argv[1:]]))
