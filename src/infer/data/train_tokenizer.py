"""Train a byte-level BPE tokenizer on the offline corpus and save it as a Hugging Face folder."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

# ChatML, as Qwen and many others use it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_bpe_tokenizer(
    out_dir: str | Path,
    texts: Iterable[str] | None = None,
    vocab_size: int = 2048,
    model_max_length: int = 2048,
):
    """Train a byte-level BPE tokenizer and save ``tokenizer.json`` + config (with chat template).

    Deterministic for the same texts and vocab size. Token ids 0..2 are the special tokens
    ``<|endoftext|>`` (bos/eos/pad), ``<|im_start|>`` and ``<|im_end|>``.
    Returns the ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from infer.data.corpus import load_corpus

    if texts is None:
        texts = load_corpus(include_docstrings=False)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return save_hf_tokenizer(tok, out_dir, model_max_length)


def save_hf_tokenizer(tok, out_dir: str | Path, model_max_length: int, **special_tokens):
    """Wrap a ``tokenizers.Tokenizer`` with our special tokens and ChatML template; save it as a
    Hugging Face tokenizer folder. Returns the ``PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        **special_tokens,
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast
