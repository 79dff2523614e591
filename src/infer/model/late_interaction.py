"""Late interaction (ColBERT): queries and documents as a PyLate ColBERT model encodes them, and
their MaxSim score.

A ColBERT model gives every token of its input a vector (its encoder's final hidden states,
projected by its Dense module and normalized: ``token_embed`` requests). A query and a document
are encoded differently (:class:`infer.model.pooling.LateInteraction` holds how)::

    query     [CLS] [Q] what is a list [SEP] [MASK] [MASK] ... [MASK]    query_length tokens
              |<------- attended to ------->| queries only (unless attend_to_expansion)
    document  [CLS] [D] A list is a sequence . [SEP]                    at most document_length
                                             ^ a skiplist word: no vector kept

(the prefix token inserted after the first; the text cut first, keeping its last token, so
that the prefixed input fits) and a (query, document) pair scores::

    MaxSim(q, d) = sum over query vectors q_i of  max over document vectors d_j of  q_i . d_j
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from infer.model.folders import ModelLoadError
from infer.model.pooling import LateInteraction


@dataclass(frozen=True)
class LateInteractionTokens:
    """:class:`LateInteraction` in a tokenizer's ids: each prefix's (None: no prefix), the
    token queries are padded with, and the tokens a document's vectors leave out."""

    settings: LateInteraction
    query_prefix: int | None
    document_prefix: int | None
    expansion: int
    skiplist: frozenset[int]

    @classmethod
    def from_tokenizer(cls, settings: LateInteraction, tokenizer: Any) -> LateInteractionTokens:
        """The ids in ``tokenizer`` (a transformers tokenizer), as PyLate looks them up: each
        prefix a token of its own (PyLate adds it to the vocabulary before training: a model
        whose tokenizer lacks it is a :class:`ModelLoadError`), queries padded with the mask
        token (else the eos, else the pad token), every skiplist word's id (an unknown word's
        is the unknown token's, as PyLate's lookup gives)."""

        def prefix(text: str, what: str) -> int | None:
            if text == "":
                return None
            token = tokenizer.convert_tokens_to_ids(text)
            if token is None or token == tokenizer.unk_token_id:
                raise ModelLoadError(f"this ColBERT model's {what} prefix {text!r} is not a "
                                     "token of its tokenizer")  # fmt: skip
            return int(token)

        pad = next((t for t in (tokenizer.mask_token_id, tokenizer.eos_token_id,
                                tokenizer.pad_token_id) if t is not None), None)  # fmt: skip
        if pad is None and settings.query_expansion:
            raise ModelLoadError("this ColBERT model pads queries, but its tokenizer has no "
                                 "mask, eos or pad token to pad them with")  # fmt: skip
        skip = {tokenizer.convert_tokens_to_ids(w) for w in settings.skiplist_words}
        return cls(settings, prefix(settings.query_prefix, "query"),
                   prefix(settings.document_prefix, "document"), int(pad or 0),
                   frozenset(int(t) for t in skip if t is not None))  # fmt: skip

    def query(self, ids: list[int]) -> tuple[list[int], int | None]:
        """A query's input from its tokens (the tokenizer's, special tokens included), and how
        many of its first tokens are attended to (None: all)."""
        ids = _with_prefix(ids, self.query_prefix, self.settings.query_length)
        real = len(ids)
        if self.settings.query_expansion:
            ids = ids + [self.expansion] * (self.settings.query_length - real)
        attended = None if self.settings.attend_to_expansion or real == len(ids) else real
        return ids, attended

    def document(self, ids: list[int]) -> list[int]:
        """A document's input from its tokens."""
        return _with_prefix(ids, self.document_prefix, self.settings.document_length)

    def document_vectors(self, ids: list[int], vectors: list) -> list:
        """The vectors a document keeps of its input ``ids``' (one per token): its skiplist
        words' left out."""
        return [v for token, v in zip(ids, vectors, strict=True) if token not in self.skiplist]


def _with_prefix(ids: list[int], prefix: int | None, length: int) -> list[int]:
    """``ids`` cut to ``length`` tokens with ``prefix`` inserted after the first (the cut
    keeps the last token: ``[CLS] ... [SEP]``, as the tokenizer truncates)."""
    room = length - (prefix is not None)
    if len(ids) > room:
        ids = ids[: room - 1] + ids[-1:]
    return ids[:1] + [prefix] + ids[1:] if prefix is not None else list(ids)


def maxsim(query: torch.Tensor, document: torch.Tensor) -> float:
    """The MaxSim score of a query's vectors ``[m, d]`` against a document's ``[n, d]``, in
    float64: the sum over query vectors of the best dot product with a document vector."""
    if len(document) == 0:
        return 0.0
    return float((query.double() @ document.double().T).max(dim=1).values.sum())
