"""ColBERT reranking beside PyLate (the library ColBERT models are trained and published with):
one query against N documents, scored by MaxSim, offline on the same machine.

    PYTHONPATH=DIR python benchmarks/peers/colbert_vs_pylate.py [--docs 64] [--runs 3]

DIR holds PyLate and sentence-transformers (``pip install --target DIR --no-deps pylate
sentence-transformers==5.3.0 scikit-learn ujson``; an empty ``datasets`` module there
satisfies an import PyLate never uses here). The model: a random ColBERT of
answerai-colbert-small-v1's shape (BERT, 384 wide, 12 layers, 12 heads; 96-value vectors) as
Stanford's library saves it, which both read; queries of 32 tokens (expanded), documents cut
at 180. Each document is a few corpus lines (~150-180 tokens).

- **PyLate**: ``ColBERT.encode`` of the query and of the documents (batch 32, its default),
  then ``colbert_scores``: float32, as its users run it.
- **infer**: ``LLM.score(query, documents)`` in float32 and in bf16.

Documents per second, medians of ``--runs`` (a warm-up run first), and the largest distance of
each infer path's scores from PyLate's.
"""

from __future__ import annotations

import argparse

import torch

from infer.bench.offline import median_seconds
from infer.bench.report import machine_line, offline_machine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    from pylate import scores as pylate_scores
    from pylate.models import ColBERT

    from infer import LLM
    from infer.data.corpus import load_corpus
    from infer.testing.encoders import build_colbert, default_encoder_root

    shape = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=1536, max_position_embeddings=512)  # fmt: skip
    folder = build_colbert("bert", default_encoder_root(), name="colbert-small-shape", dim=96,
                           stanford=True, shape=shape, query_maxlen=32, doc_maxlen=180)  # fmt: skip
    lines = [ln for doc in load_corpus(include_docstrings=False) for ln in doc.splitlines()
             if len(ln) > 40]  # fmt: skip
    docs = [" ".join(lines[i * 12 : i * 12 + 12]) for i in range(a.docs)]
    query = "how do I read a file line by line and count the words in it"
    torch.manual_seed(0)

    def timed(fn) -> tuple[float, list[float]]:
        seconds, scores = median_seconds(fn, a.runs)
        return a.docs / seconds, scores

    model = ColBERT(str(folder), device="cpu")

    def pylate() -> list[float]:
        q = model.encode([query], is_query=True, convert_to_tensor=True)
        d = model.encode(docs, is_query=False, batch_size=32)
        return [float(pylate_scores.colbert_scores(q, torch.as_tensor(x)[None])[0, 0])
                for x in d]  # fmt: skip

    rows = [("PyLate (float32)", *timed(pylate))]
    for dtype in ("float32", "bfloat16"):
        with LLM(str(folder), dtype=dtype) as llm:
            rows.append((f"infer ({dtype})",
                         *timed(lambda: [r.outputs.score for r in llm.score(query, docs)])))  # fmt: skip
    want = rows[0][2]
    print(f"# ColBERT rerank, 1 query x {a.docs} documents ({machine_line(offline_machine())})\n")
    print("| path | docs/s | vs PyLate | max score distance |\n|---|---:|---:|---:|")
    for name, rate, scores in rows:
        gap = max(abs(x - y) for x, y in zip(scores, want, strict=True))
        print(f"| {name} | {rate:.1f} | {rate / rows[0][1]:.2f}x | {gap:.2e} |")


if __name__ == "__main__":
    main()
