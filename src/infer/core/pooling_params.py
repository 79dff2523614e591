"""What an embedding request asks for (``POST /v1/embeddings``, ``LLM.embed``).

An embedding request runs its prompt through the model like a prefill (chunked, prefix-cached,
batched with everyone else's decodes) and, in the step that reaches the prompt's end, takes the
final hidden state of its last token instead of sampling from it: the model's embedding of the
text (last-token pooling, what decoder-only embedding models such as Qwen3-Embedding,
gte-Qwen2 and e5-mistral are trained for). It then finishes, with no output tokens.

A sequence classifier (a cross-encoder reranker, a reward or label model) pools the same row
through its ``score`` head: a classify request's "embedding" is its logits, one per label.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from infer.core.sampling_params import InvalidRequestError, SamplingParams

TASKS = ("embed", "classify", "token_embed", "token_classify")


@dataclass(frozen=True)
class PoolingParams:
    """``normalize``: scale the embedding to unit length (None: as the model's configuration
    says: its sentence-transformers ``Normalize`` module, on where it has no such file).
    ``dimensions``: keep only the first ``dimensions`` values (Matryoshka embeddings; the
    normalization, if any, comes after the cut). ``task``: ``embed`` (the hidden state),
    ``classify`` (a sequence classifier's logits, one per label: neither cut nor
    normalized), ``token_embed`` (an encoder's every token's state, each cut and normalized as an
    embedding is: the vectors late-interaction models such as ColBERT score by) or
    ``token_classify`` (a token classifier's logits for every input token, one per label: an
    NER tagger's; BGE-M3's sparse weight of each token but its first and last).
    ``use_activation`` (``token_classify``): each token's logits through the model's
    activation (softmax over the labels, sigmoid for one label, BGE-M3's ReLU); false: the
    raw logits. A ``classify`` request's logits come back raw whatever it says (the server
    and ``LLM.encode`` apply it)."""

    normalize: bool | None = None
    dimensions: int | None = None
    task: str = "embed"
    # An encoder's input of which only the first n tokens are attended to (keys); the rest are
    # queries only: a ColBERT query's expansion tokens (model/late_interaction.py). None: all.
    attended_tokens: int | None = None
    use_activation: bool = True

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise InvalidRequestError(
                f"task must be one of {', '.join(TASKS)}, got {self.task!r}", param="task"
            )
        if not isinstance(self.use_activation, bool):
            raise InvalidRequestError(
                f"use_activation must be true or false, got {self.use_activation!r}",
                param="use_activation",
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(
                f"normalize must be true or false, got {self.normalize!r}", param="normalize"
            )
        a = self.attended_tokens
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a < 1):
            raise InvalidRequestError(
                f"attended_tokens must be a positive integer, got {a!r}", param="attended_tokens"
            )
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise InvalidRequestError(
                f"dimensions must be a positive integer, got {d!r}", param="dimensions"
            )


POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)
"""The sampling parameters an embedding request carries through the engine (nothing of them is
used: it samples nothing): one step past its prompt, so it ends in the step that pools it."""


def score_pairs(num_1: int, num_2: int) -> list[tuple[int, int]]:
    """Which texts a score request compares (vLLM's rule): one ``text_1`` against each of
    ``text_2``, or ``text_1[i]`` against ``text_2[i]`` when both hold as many."""
    if num_1 == 1:
        return [(0, j) for j in range(num_2)]
    if num_1 == num_2:
        return [(i, i) for i in range(num_1)]
    raise InvalidRequestError(
        f"text_1 has {num_1} texts and text_2 {num_2}: give one text_1 (scored against each "
        "text_2) or as many as text_2 (scored pair by pair)",
        param="text_2",
    )


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of two vectors in double precision, in [-1, 1] (float32 vectors
    are unit length only to float32's rounding: a text and itself score exactly 1; 0 for a
    zero vector)."""
    norms = math.sqrt(sum(map(operator.mul, a, a)) * sum(map(operator.mul, b, b)))
    if not norms:
        return 0.0
    return max(-1.0, min(1.0, sum(map(operator.mul, a, b)) / norms))


def class_probabilities(logits: Sequence[float]) -> list[float]:
    """A classification's probabilities from its logits: the softmax over the labels, or for
    a single-label model (a cross-encoder, a binary head) the sigmoid of its one logit, as
    transformers' and vLLM's classification pipelines compute them."""
    if len(logits) == 1:
        return [_sigmoid(logits[0])]
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    total = sum(exps)
    return [e / total for e in exps]


def relevance(logits: Sequence[float], activation: str = "sigmoid") -> float:
    """A cross-encoder's score for one pair: the sigmoid of its single logit, in (0, 1)
    (sentence-transformers' ``CrossEncoder`` and vLLM's score for a one-label model), or the
    logit itself (``activation`` ``identity``). A model with more labels does not say which of
    them means "relevant": ``InvalidRequestError``."""
    check_cross_encoder(len(logits))
    return _sigmoid(logits[0]) if activation == "sigmoid" else float(logits[0])


def check_cross_encoder(num_labels: int) -> None:
    """``InvalidRequestError`` unless a classifier of ``num_labels`` labels can score pairs."""
    if num_labels != 1:
        raise InvalidRequestError(
            f"this model is a sequence classifier with {num_labels} labels; scoring pairs "
            "(score, rerank) needs a cross-encoder with one (num_labels 1): classify gives each "
            "label's probability",
            param="model",
        )


def _sigmoid(x: float) -> float:
    # (both branches, so a large logit of either sign neither overflows nor loses precision)
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)
