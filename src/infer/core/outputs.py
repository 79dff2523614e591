"""Messages the engine emits: one ``RequestOutput`` per request that progressed in a step."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from infer.core.request import RequestTimings, TokenLogprob


@dataclass(slots=True)  # one per request per step: see core/messages.py's doc
class RequestOutput:
    """What one request gained in one engine step (a delta), plus its running totals.

    ``new_text`` never ends inside a multi-byte character and never contains a partial stop
    string: text that might still turn into a stop string is held back until it is decided.

    The engine builds one per request per step with positional arguments (``_make_output``):
    a change to the fields' order changes that call too.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None
    error: str | None = None
    # With prompt_logprobs: every prompt token's (None for the first), in the request's first
    # output that carries a generated token (or its last, if it ends without one).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # An ``export_kv`` request's final output: its prompt KV (a ``core.kv_transfer.KVPayload``).
    kv_payload: Any = None
    # An embedding request's final output: its embedding (core/pooling_params.py; a
    # token_embed request's: one vector per input token).
    embedding: list[float] | list[list[float]] | None = None

    def __reduce__(self) -> tuple:
        # Pickled as the class and its fields in order, not the default slots-state dict: the
        # engine process pickles one per running request per step for the API server (64
        # outputs: 0.28 -> 0.08 ms to pickle, 0.28 -> 0.05 ms to unpickle, on one Zen 4 core).
        return (RequestOutput, output_fields(self))


output_fields = operator.attrgetter(*(f.name for f in fields(RequestOutput)))
"""An output's fields as a tuple, in order: ``RequestOutput(*output_fields(out))`` is a copy."""


@dataclass(frozen=True)
class CompletionOutput:
    """One finished sequence of the offline API (``LLM.generate``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class GenerationResult:
    """The offline API's result for one prompt: ``n`` completions and the request's timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    timings: list[RequestTimings]
    # With SamplingParams.prompt_logprobs: each prompt token's log-probability (None first).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class EmbeddingOutput:
    """One prompt's embedding (``LLM.embed``): the final hidden state of its last token."""

    embedding: list[float]


@dataclass(frozen=True)
class EmbeddingResult:
    """The offline API's result for one prompt of ``LLM.embed`` (vLLM's field names:
    ``result.outputs.embedding``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    num_cached_tokens: int
    timings: RequestTimings | None


@dataclass(frozen=True)
class PoolingOutput:
    """One prompt's pooled data (``LLM.encode``): a ``torch.Tensor``, ``[tokens, size]`` for
    ``token_embed`` (one vector per input token), ``[size]`` for ``embed``, the logits
    ``[labels]`` for ``classify``."""

    data: Any


@dataclass(frozen=True)
class PoolingResult:
    """The offline API's result for one prompt of ``LLM.encode`` (vLLM's field names:
    ``result.outputs.data``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    num_cached_tokens: int
    timings: RequestTimings | None


@dataclass(frozen=True)
class ClassificationOutput:
    """One prompt's classification (``LLM.classify``): the ``score`` head's ``logits``, one
    per label, their ``probs`` (softmax; sigmoid for a single label) and the likeliest
    ``label``'s name."""

    logits: list[float]
    probs: list[float]
    label: str

    @property
    def num_classes(self) -> int:
        return len(self.logits)

    @classmethod
    def from_logits(cls, logits: list[float], labels: Sequence[str]) -> ClassificationOutput:
        """The answer of a classifier whose labels are ``labels`` (in output order)."""
        from infer.core.pooling_params import class_probabilities

        best = max(range(len(logits)), key=logits.__getitem__)
        return cls(logits, class_probabilities(logits), labels[best])


@dataclass(frozen=True)
class ClassificationResult:
    """The offline API's result for one prompt of ``LLM.classify`` (vLLM's field names:
    ``result.outputs.probs``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    num_cached_tokens: int
    timings: RequestTimings | None


@dataclass(frozen=True)
class ScoreOutput:
    """How alike two texts are (``LLM.score``): the cosine similarity of their embeddings, or
    for a cross-encoder (a one-label sequence classifier) the sigmoid of its logit for the pair."""

    score: float


@dataclass(frozen=True)
class ScoreResult:
    """One pair of ``LLM.score`` (vLLM's field names: ``result.outputs.score``)."""

    text_1: str | Sequence[int]
    text_2: str | Sequence[int]
    outputs: ScoreOutput


@dataclass(frozen=True)
class BeamSequence:
    """One beam of ``LLM.beam_search``: its generated tokens, their text, their summed
    log-probability, and how it ended (``stop``: an EOS; ``length``: ``max_tokens``)."""

    token_ids: list[int]
    text: str
    cum_logprob: float
    finish_reason: str


@dataclass(frozen=True)
class BeamSearchOutput:
    """``LLM.beam_search``'s result for one prompt: its beams, best first."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]


def merge_deltas(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One delta saying what two consecutive deltas of one request say.

    Tokens, text and logprobs are joined in order; the running totals, the finish, the timings
    and the error are the later one's (they are the newest); prompt logprobs come with whichever
    carried them (only a request's first output that has a token does). A consumer that fell
    behind the engine takes what has queued up as one delta (``RequestStream``).
    """
    return RequestOutput(
        later.request_id,
        first.new_token_ids + later.new_token_ids,
        first.new_text + later.new_text,
        first.new_logprobs + later.new_logprobs,
        later.finished,
        later.finish_reason,
        later.stop_reason,
        later.num_prompt_tokens,
        later.num_output_tokens,
        later.num_cached_tokens,
        later.timings,
        later.error,
        first.prompt_logprobs if first.prompt_logprobs is not None else later.prompt_logprobs,
        later.kv_payload,
        later.embedding,
    )
