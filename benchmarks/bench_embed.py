"""What embeddings cost, and what the engine buys over a plain batched forward pass:
``infer bench embed``.

    infer bench embed [--model FOLDER] [--runs 3] [--out bench-results/embed]
    infer bench embed --encoder [--dtype float32] [--model FOLDER]

(``python benchmarks/bench_embed.py`` runs the same.) The ~110M Llama of ``infer bench engine``
(random weights, bf16) unless ``--model``; N inputs of L random token ids each, L = 128 and 512:

- **transformers**: ``AutoModel`` (the base model, no LM head) in batches of B inputs (the
  sentence-transformers default, 32), ``last_hidden_state[:, -1]`` normalized: what a user
  embeds with when they have no serving engine.
- **infer, cold**: ``LLM.embed`` of the N inputs (prefix cache empty): the engine batches them
  under its token budget (``max_num_batched_tokens``).
- **infer, again**: the same N inputs once more (a document embedded again, a query repeated):
  every full block of each input comes from the prefix cache, only its last block runs.

Inputs per second, medians of ``--runs``, and how far each bf16 path's vectors are from
transformers' in float32 (the worst cosine similarity over the first 8 inputs of each run):
bf16 rounds differently in each, so neither matches the other exactly.

``--encoder``: a BERT encoder of BGE-base's shape (12 layers, hidden 768, 12 heads, MLP 3072,
vocabulary 30,522, 512 positions; random weights, CLS pooling) unless ``--model``, in
``--dtype`` (BGE's checkpoints are float32, what infer serves them in by default);
transformers pools ``last_hidden_state[:, 0]`` and L is 128 and 510 (512 with [CLS] / [SEP]).
Nothing is prefix-cached for an encoder, so "again" is a second cold run. ``--encoder-kind
mpnet``: an MPNet of all-mpnet-base-v2's shape instead (the same sizes, a relative position
bias added to every layer's attention scores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from infer.bench.cli import add_common
from infer.bench.report import machine_line, md_table, offline_machine, save_report

NEEDS_BENCH_EXTRA = False


def _inputs(vocab: int, n: int, length: int, seed: int, low: int = 3) -> list[list[int]]:
    """``n`` inputs of ``length`` random ids in ``[low, vocab)`` (past the special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n, length), generator=gen).tolist()


def hf_embed(model, inputs: list[list[int]], batch: int, row: int = -1) -> torch.Tensor:
    """transformers' vectors: the hidden state at ``row`` (the last token; an encoder's CLS:
    0), normalized."""
    out = []
    with torch.inference_mode():
        for i in range(0, len(inputs), batch):
            ids = torch.tensor(inputs[i : i + batch])
            hidden = model(input_ids=ids).last_hidden_state[:, row].float()
            out.append(torch.nn.functional.normalize(hidden, dim=-1))
    return torch.cat(out)


def infer_embed(llm, inputs: list[list[int]]) -> torch.Tensor:
    return torch.tensor([r.outputs.embedding for r in llm.embed(inputs)])


def timed(fn, *args) -> tuple[float, object]:
    t0 = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - t0, value


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModel

    from infer import LLM
    from infer.testing.bench_models import bert_base, llama_100m

    dtype = args.dtype
    if args.encoder:
        path, row, lengths = bert_base(args.model, args.encoder_kind), 0, (128, 510)
        llm = LLM(str(path), dtype=dtype, max_num_seqs=args.num_inputs,
                  max_num_batched_tokens=max(8192, 512 * 8))  # fmt: skip
    else:
        path, row, lengths = llama_100m(args.model), -1, (128, 512)
        llm = LLM(str(path), dtype=dtype, enable_prefix_caching=True,
                  max_num_seqs=args.num_inputs)  # fmt: skip
    hf = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    hf32 = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    vocab = min(llm.engine.spec.vocab_size, len(llm.tokenizer))
    report: dict = {"machine": offline_machine(), "runs": args.runs, "model": str(path),
                    "num_inputs": args.num_inputs, "batch": args.batch, "cases": {},
                    "dtype": dtype, "encoder": args.encoder}  # fmt: skip

    def wrap(ids: list[list[int]]) -> list[list[int]]:  # an encoder's [CLS] ... [SEP]
        if not args.encoder:
            return ids
        cls, sep = llm.tokenizer.cls_token_id, llm.tokenizer.sep_token_id
        return [[cls, *x, sep] for x in ids]

    for length in lengths:
        # (an encoder's texts hold no [CLS] / [SEP]: ids past its special tokens)
        low = max(llm.tokenizer.all_special_ids) + 1 if args.encoder else 3
        warm = wrap(_inputs(vocab, 4, length, seed=10_000 + length, low=low))
        hf_embed(hf, warm, args.batch, row)
        infer_embed(llm, warm)
        times: dict[str, list[float]] = {"transformers": [], "infer, cold": [], "infer, again": []}
        worst = {"transformers": 1.0, "infer": 1.0}
        for r in range(args.runs):
            inputs = wrap(_inputs(vocab, args.num_inputs, length, seed=100 * r + length, low=low))
            t, want = timed(hf_embed, hf, inputs, args.batch, row)
            times["transformers"].append(t)
            llm.reset_prefix_cache()
            t, got = timed(infer_embed, llm, inputs)
            times["infer, cold"].append(t)
            t, again = timed(infer_embed, llm, inputs)
            times["infer, again"].append(t)
            exact = hf_embed(hf32, inputs[:8], 8, row)
            for name, vectors in (("transformers", want), ("infer", got), ("infer", again)):
                cos = torch.nn.functional.cosine_similarity(vectors[:8], exact, dim=-1)
                worst[name] = min(worst[name], float(cos.min()))
        case = {name: args.num_inputs / statistics.median(ts) for name, ts in times.items()}
        case["worst_cosine_vs_fp32"] = worst
        case["seconds"] = times
        report["cases"][length] = case
        print(length, {k: v for k, v in case.items() if k != "seconds"}, flush=True)
    save_report(report, render(report), args.out, "embed")
    return 0


def render(r: dict) -> str:
    rows = []
    for length, c in r["cases"].items():
        base = c["transformers"]
        rows.append([length, f"{base:.1f}", f"{c['infer, cold']:.1f}",
                     f"{c['infer, cold'] / base:.2f}x", f"{c['infer, again']:.1f}",
                     f"{c['infer, again'] / base:.2f}x",
                     f"{c['worst_cosine_vs_fp32']['transformers']:.5f}",
                     f"{c['worst_cosine_vs_fp32']['infer']:.5f}"])  # fmt: skip
    lines = [
        "# Embeddings: infer vs a batched transformers forward pass",
        "",
        machine_line(r["machine"])
        + f" Model `{r['model']}` ({r.get('dtype', 'bfloat16')}), {r['num_inputs']} inputs of "
        "L random token ids"
        + (" between [CLS] and [SEP], CLS pooling" if r.get("encoder") else "")
        + ", "
        f"transformers in batches of {r['batch']}. Inputs per second, medians of {r['runs']} "
        "runs; 'again': the same inputs embedded a second time (prefix-cached; an encoder "
        "caches nothing).",
        "",
        *md_table(
            "L | transformers /s | infer cold /s | ratio | infer again /s | ratio | "
            "worst cosine vs fp32: transformers | infer",
            rows,
            "rrrrrrrr",
        ),  # fmt: skip
    ]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer bench embed",
        description="embeddings: infer's LLM.embed vs transformers' batched forward pass",
    )
    add_common(p, model=True, dtype=True, runs=3, out="embed")
    p.add_argument("--num-inputs", type=int, default=64, help="inputs per run")
    p.add_argument("--batch", type=int, default=32, help="transformers' batch size")
    p.add_argument("--encoder", action="store_true",
                   help="a BERT encoder of BGE-base's shape (CLS pooling) in place of the Llama")  # fmt: skip
    p.add_argument("--encoder-kind", choices=("bert", "mpnet"), default="bert",
                   help="with --encoder: BERT, or MPNet (all-mpnet-base-v2's shape: a relative "
                        "position bias in every layer's attention)")  # fmt: skip
    return p


if __name__ == "__main__":
    from infer.bench.cli import main as infer_main

    sys.exit(infer_main(["bench", "embed", *sys.argv[1:]]))
