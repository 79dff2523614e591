"""The benchmarks' shared model: a random-init ~110M bf16 Llama with a BPE tokenizer trained
here, built once into ``~/.cache/infer/bench`` (no hub download works on the machines this
project runs on). ``infer bench engine``, ``quant``, ``prefix``, ``vs-vllm`` and the
others measure on it unless given ``--model``."""

from __future__ import annotations

from pathlib import Path

import torch

LLAMA_100M_DIR = Path.home() / ".cache/infer/bench/llama-100m"


def llama_100m(model: str | None = None) -> Path:
    """``model`` when given, else the ~100M Llama (built once into ``LLAMA_100M_DIR``)."""
    return Path(model) if model else build_llama_100m(LLAMA_100M_DIR)


BERT_BASE_DIR = Path.home() / ".cache/infer/bench"


def bert_base(model: str | None = None, kind: str = "bert") -> Path:
    """``model`` when given, else a random BERT of BGE-base's shape (built once): 12 layers,
    hidden 768, 12 heads, MLP 3072, vocabulary 30,522, 512 positions, CLS pooling (~110M);
    ``kind`` ``mpnet``: an MPNet of all-mpnet-base-v2's shape (the same sizes, 514 positions
    counted from 2, a relative position bias)."""
    if model:
        return Path(model)
    from infer.testing.encoders import build_encoder

    positions = 514 if kind == "mpnet" else 512
    return build_encoder(kind, BERT_BASE_DIR, "cls", name=f"{kind}-base", hidden_size=768,
                         num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                         vocab_size=30522, max_position_embeddings=positions)  # fmt: skip


def build_llama_100m(out: Path) -> Path:
    """Random-init Llama: hidden 768, 12 layers, 12 heads, vocab 32000, tied embeddings (~110M)."""
    return build_random_llama(
        out, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, initializer_range=0.05,
    )  # fmt: skip


def build_random_llama(out: Path, **shape) -> Path:
    """A random-init bf16 Llama of ``shape`` (LlamaConfig fields) with a 32,000-token BPE
    tokenizer trained here, saved once into ``out`` (tied embeddings, 2,048 positions)."""
    if (out / "config.json").exists():
        return out
    from transformers import LlamaConfig, LlamaForCausalLM

    from infer.data.train_tokenizer import train_bpe_tokenizer

    tmp = out.with_name(out.name + ".tmp")
    tok = train_bpe_tokenizer(tmp, vocab_size=32000)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        dtype="bfloat16",
        **shape,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out
