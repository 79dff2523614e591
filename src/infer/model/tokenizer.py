"""The tokenizer (and its chat template) from a model folder, offline."""

from __future__ import annotations

from pathlib import Path

from infer.core.sampling_params import InvalidRequestError
from infer.model.folders import ModelLoadError

VERY_LONG = int(1e30)  # transformers' own "no limit" value


def load_tokenizer(path: Path):
    """``AutoTokenizer`` of the folder ``path``; never downloads. Raises :class:`ModelLoadError`."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        text = str(path)
        if not Path(path).exists() and (
            Path(path).is_absolute() or text.startswith((".", "~")) or text.count("/") > 1
        ):
            # (a path, not a hub id: transformers' own words are about repo id characters)
            raise ModelLoadError(f"tokenizer folder {path} does not exist") from exc
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc
    # The engine checks every prompt against its own context (max_model_len); the tokenizer's
    # model_max_length, often not the model's, only made transformers warn ("Token indices
    # sequence length is longer than ...") about prompts the engine then served or refused.
    tokenizer.model_max_length = VERY_LONG
    return tokenizer


def encode_pair(
    tokenizer,
    text_1: str,
    text_2: str,
    add_special_tokens: bool = True,
    max_length: int | None = None,
    template: str | None = None,
) -> list[int]:
    """A cross-encoder's input for a pair of texts: the tokenizer's own pair encoding (its
    special tokens around and between them, as sentence-transformers' ``CrossEncoder`` and
    vLLM tokenize a pair; a tokenizer with no pair template joins the two). ``max_length``:
    at most that many tokens, the longer text cut first (the tokenizer's ``longest_first``),
    so a long document never pushes the query out.

    ``template`` (a reranker's prompt, ``{query}`` and ``{document}`` in it): the prompt with
    the two texts written in, tokenized as text whose special tokens are parsed and nothing is
    added (what llama-server does with a GGUF reranker's ``rerank`` template); past
    ``max_length``, the document's last tokens are dropped. ``InvalidRequestError`` where
    ``max_length`` cannot hold what must stay (the prompt and query, the special tokens)."""
    if template is not None:
        return _templated_pair(tokenizer, template, text_1, text_2, max_length)
    cut = {} if max_length is None else {"truncation": "longest_first", "max_length": max_length}
    encoded = tokenizer(text_1, text_pair=text_2, add_special_tokens=add_special_tokens, **cut)
    ids = list(encoded["input_ids"])
    if max_length is not None and len(ids) > max_length:  # (the special tokens alone are more)
        raise InvalidRequestError(
            f"truncate_prompt_tokens ({max_length}) leaves no room for the pair's texts beside "
            "the tokenizer's special tokens",
            param="truncate_prompt_tokens",
        )
    return ids


def _templated_pair(tokenizer, template: str, query: str, document: str,
                    max_length: int | None) -> list[int]:  # fmt: skip
    # (split first, so a query that itself holds "{document}" is written in as it is)
    before, after = (part.replace("{query}", query) for part in template.split("{document}"))
    text = before + document + after
    if max_length is None:
        return list(tokenizer.encode(text, add_special_tokens=False))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    if len(ids) <= max_length:
        return ids
    # The document's tokens are those inside its characters; the last of them are dropped,
    # so the prompt around it, the query in it, keeps its tokens.
    start, end = len(before), len(before) + len(document)
    inside = [i for i, (a, b) in enumerate(offsets) if a >= start and b <= end]
    excess = len(ids) - max_length
    if excess > len(inside):
        raise InvalidRequestError(
            f"the reranker's prompt without the document is {len(ids) - len(inside)} tokens, more "
            f"than truncate_prompt_tokens ({max_length})",
            param="truncate_prompt_tokens",
        )
    dropped = set(inside[len(inside) - excess :])
    return [t for i, t in enumerate(ids) if i not in dropped]
