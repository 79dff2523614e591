"""``suffix`` on /v1/completions: fill-in-the-middle prompts for models trained with FIM tokens.

A FIM-trained code model (Qwen2.5-Coder, StarCoder, DeepSeek-Coder, Code Llama) writes the
middle of a file given what comes before and after it, with special tokens saying which is
which. The prompt is laid out prefix-suffix-middle::

    <fim_prefix> prompt <fim_suffix> suffix <fim_middle>   -> the model writes the middle

A model whose tokenizer has none of these token sets cannot do it, and ``suffix`` is then a
400 saying so rather than text appended somewhere the model does not expect.
"""

from __future__ import annotations

# (prefix, suffix, middle) special tokens of the FIM formats in use, by model family.
FIM_TOKEN_SETS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("<PRE>", "<SUF>", "<MID>"),  # Code Llama
)


def fim_tokens(tokenizer) -> tuple[int, int, int] | None:
    """Ids of the tokenizer's (prefix, suffix, middle) FIM tokens, or None if it has none."""
    vocab = tokenizer.get_vocab()
    for names in FIM_TOKEN_SETS:
        if all(name in vocab for name in names):
            return vocab[names[0]], vocab[names[1]], vocab[names[2]]
    return None


def fim_prompt(tokens: tuple[int, int, int], prefix: list[int], suffix: list[int]) -> list[int]:
    """The prefix-suffix-middle prompt (the model's output is the middle)."""
    pre, suf, mid = tokens
    return [pre, *prefix, suf, *suffix, mid]
