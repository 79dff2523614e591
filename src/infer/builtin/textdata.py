"""Tokenizers for the built-in models and the corpus as token streams.

The toy is character-level, as the tiny NanoGPT benchmark model is: a fixed vocabulary of
printable ASCII and a few typographic characters, expressed as a ``tokenizers`` BPE model with
no merges so that transformers' ``AutoTokenizer`` loads and decodes it like any other. The
small model uses the project's byte-level BPE (:func:`infer.data.train_tokenizer.train_bpe_tokenizer`).
Both put ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` at ids 0, 1, 2 and carry the
ChatML chat template.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from infer.builtin.presets import Preset
from infer.data.train_tokenizer import (
    EOS_TOKEN,
    SPECIAL_TOKENS,
    save_hf_tokenizer,
    train_bpe_tokenizer,
)

UNK_TOKEN = "<|unk|>"

# Newline, tab, printable ASCII, then the non-ASCII characters of Python's docs (curly quotes,
# dashes, ellipsis) and a few common symbols and letters: 116 characters, 120 ids with specials.
CHAR_ALPHABET = (
    "\n\t"
    + "".join(chr(i) for i in range(32, 127))
    + "\u2018\u2019\u201c\u201d\u2013\u2014\u2026"  # ‘ ’ “ ” – — …
    + "\u2022\u2192\u00d7\u00b0\u00b1\u2264\u2265"  # • → × ° ± ≤ ≥
    + "\u00e4\u00f6\u00fc\u00e9\u00df"  # ä ö ü é ß
)

# Every tenth document (from the fourth) is held out to report a validation loss.
VAL_EVERY = 10
VAL_OFFSET = 3


def char_vocab() -> dict[str, int]:
    """Token -> id for the character tokenizer: specials first, then :data:`CHAR_ALPHABET`."""
    tokens = [*SPECIAL_TOKENS, UNK_TOKEN, *CHAR_ALPHABET]
    assert len(set(tokens)) == len(tokens), "duplicate character in the alphabet"
    return {t: i for i, t in enumerate(tokens)}


def build_char_tokenizer(out_dir: str | Path, model_max_length: int):
    """Save a character-level tokenizer (``tokenizer.json`` + config + chat template)."""
    from tokenizers import Tokenizer, decoders, models

    # No pre-tokenizer and no merges: every character is its own token; others become <|unk|>.
    tok = Tokenizer(models.BPE(vocab=char_vocab(), merges=[], unk_token=UNK_TOKEN))
    tok.decoder = decoders.Fuse()  # concatenate, no spaces between characters
    return save_hf_tokenizer(tok, out_dir, model_max_length, unk_token=UNK_TOKEN)


def build_tokenizer(preset: Preset, out_dir: str | Path, docs: list[str]):
    """Build and save the preset's tokenizer into ``out_dir``; returns it."""
    if preset.tokenizer == "char":
        tok = build_char_tokenizer(out_dir, preset.context_len)
    else:
        # Trained on the training documents only, so validation text stays unseen.
        tok = train_bpe_tokenizer(out_dir, docs, preset.vocab_size, preset.context_len)
    if len(tok) != preset.vocab_size:
        raise RuntimeError(
            f"{preset.name}: tokenizer has {len(tok)} ids, expected {preset.vocab_size}"
        )
    return tok


def split_docs(docs: list[str]) -> tuple[list[str], list[str]]:
    """(train, val) documents: a fixed, order-preserving split."""
    train = [d for i, d in enumerate(docs) if i % VAL_EVERY != VAL_OFFSET]
    val = [d for i, d in enumerate(docs) if i % VAL_EVERY == VAL_OFFSET]
    return train, val


# Word n-gram length of the overlap check between extra training text and held-out text
# (13, as in the contamination checks of large language model evaluations).
OVERLAP_NGRAM = 13


def _word_ngrams(text: str, n: int = OVERLAP_NGRAM) -> set[str]:
    words = re.findall(r"\w+", text.lower())
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


def training_docs(val_docs: list[str]) -> list[str]:
    """Extra training documents that keep the held-out documents unseen.

    The API docstrings of the standard library (:func:`infer.data.corpus.stdlib_api_docstrings`),
    one document per module, minus (a) every module whose own docstring is held out and
    (b) any docstring sharing a run of :data:`OVERLAP_NGRAM` words with a held-out document.
    So the held-out loss is measured on the same text, equally unseen, as without them.
    """
    from infer.data.corpus import stdlib_api_docstrings

    held_out = set(val_docs)
    held_out_ngrams: set[str] = set()
    for doc in val_docs:
        held_out_ngrams |= _word_ngrams(doc)
    out = []
    for _, module_doc, docs in stdlib_api_docstrings():
        if module_doc in held_out:
            continue
        kept = [d for d in docs if not (_word_ngrams(d) & held_out_ngrams)]
        if kept:
            out.append("\n\n".join(kept))
    return out


def encode_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    """Concatenate the documents' ids with ``<|endoftext|>`` after each one."""
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids: list[int] = []
    for doc in docs:
        # Long documents exceed model_max_length; we cut windows ourselves, so no warning.
        ids.extend(tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def batch_windows(stream: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[len(starts), seq_len + 1]`` windows of ``stream`` (inputs and shifted targets)."""
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    return stream[idx]
