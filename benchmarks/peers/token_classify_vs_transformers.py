"""Token classification (an NER tagger) beside transformers, what a user tags text with when
they have no serving engine: ``AutoModelForTokenClassification`` in batches (padded to the
batch's longest, as its ``token-classification`` pipeline feeds the model), offline on the same
machine.

    python benchmarks/peers/token_classify_vs_transformers.py [--texts 64] [--runs 3]

The model: a random ``BertForTokenClassification`` of dslim/bert-base-NER's shape (768 wide,
12 layers, 12 heads, 9 labels), texts of the corpus a few lines each (~60-200 tokens).

- **transformers**: batches of 8 (the pipeline's batching), float32, softmax per token.
- **infer**: ``LLM.encode(texts, pooling_task="token_classify")`` in float32 and in bf16.

Texts per second, medians of ``--runs`` (a warm-up run first), and each infer path's largest
probability difference from transformers' over the first 8 texts.
"""

from __future__ import annotations

import argparse

import torch

from infer.bench.offline import median_seconds
from infer.bench.report import machine_line, offline_machine

LABELS = ("O", "B-MISC", "I-MISC", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from infer import LLM
    from infer.data.corpus import load_corpus
    from infer.testing.encoders import build_token_classifier, default_encoder_root

    shape = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512)  # fmt: skip
    folder = build_token_classifier("bert", default_encoder_root(), labels=LABELS, **shape)
    lines = [ln for doc in load_corpus(include_docstrings=False) for ln in doc.splitlines()
             if len(ln) > 40]  # fmt: skip
    texts = [" ".join(lines[i * 5 : i * 5 + 2 + i % 6]) for i in range(a.texts)]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32).eval()
    lengths = [len(tok(t)["input_ids"]) for t in texts]

    def hf() -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), 8):
                batch = tok(texts[i : i + 8], return_tensors="pt", padding=True)
                probs = model(**batch).logits.softmax(-1)
                out += [probs[j, : int(m.sum())] for j, m in enumerate(batch["attention_mask"])]
        return out

    def timed(fn) -> tuple[float, list]:
        seconds, result = median_seconds(fn, a.runs)
        return len(texts) / seconds, result

    rate_hf, want = timed(hf)
    print(machine_line(offline_machine()))
    print(f"{len(texts)} texts of {min(lengths)}-{max(lengths)} tokens "
          f"(mean {sum(lengths) / len(lengths):.0f}); medians of {a.runs} runs")  # fmt: skip
    print(f"transformers float32, batches of 8: {rate_hf:.1f} texts/s")
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(folder), dtype=dtype)

        def ours(llm=llm) -> list[torch.Tensor]:
            return [r.outputs.data for r in llm.encode(texts, pooling_task="token_classify")]

        rate, got = timed(ours)
        worst = max(float((g - w).abs().max()) for g, w in zip(got[:8], want[:8], strict=True))
        print(f"infer {dtype}: {rate:.1f} texts/s ({rate / rate_hf:.2f}x), largest probability "
              f"difference {worst:.1e}")  # fmt: skip
        llm.shutdown()


if __name__ == "__main__":
    main()
