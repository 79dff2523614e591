"""Per-request sampling parameters (validated at construction, immutable afterwards)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from infer.core.field_types import wrong_number_type

MAX_BAD_WORDS = 256


class InvalidRequestError(ValueError):
    """A request the engine refuses. ``param`` names the offending field (OpenAI's error shape)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    The defaults follow vLLM/OpenAI: ``temperature=1.0`` samples from the full distribution;
    ``temperature=0`` is greedy. ``seed`` makes a request's samples reproducible whatever else
    shares its batch (each request draws from its own generator).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # None: the length the model recommends (its generation_config.json's max_new_tokens), else
    # up to the context; either way no more than the KV cache holds
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token + top-k alternatives
    # Logprob of each prompt token given the ones before it, + top-k (None: not computed). The
    # prompt then runs whole through the model (no prefix-cache hits: cached tokens have no logits).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Constrained decoding: the output must match this (infer.core.structured.StructuredOutputs)
    structured_outputs: Any = None
    # Added to the logits of these token ids before sampling: ((token_id, bias), ...), bias in
    # [-100, 100] as OpenAI takes it (a dict {token_id: bias} is accepted too).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Only these token ids may be sampled (vLLM's allowed_token_ids; None: any).
    allowed_token_ids: tuple[int, ...] | None = None
    # Words never generated (vLLM's bad_words): tokenized, alone and after a space, into
    # ``bad_words_token_ids`` (with_bad_words_tokenized); a sequence's last token is banned wherever the output
    # ends with the rest of it. Sequences of ids may be given directly too.
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Normalise list-typed inputs so the params stay hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        elif not isinstance(self.logit_bias, tuple):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias or ()))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, tuple):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        elif not isinstance(self.bad_words, tuple):
            object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        try:
            words = tuple(tuple(ids) for ids in self.bad_words_token_ids or ())
        except TypeError:
            raise InvalidRequestError(
                "bad_words_token_ids must be sequences of token ids", param="bad_words_token_ids"
            ) from None
        object.__setattr__(self, "bad_words_token_ids", words)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        # Types first: a string or float where a number or integer belongs would otherwise fail
        # (or pass) far from here, naming nothing.
        wrong = wrong_number_type(SamplingParams, self.__dict__)
        if wrong is not None:
            raise bad(*wrong)
        if self.n < 1:
            raise bad("n", f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise bad("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad(
                "prompt_logprobs", f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"
            )
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "stop_token_ids must be non-negative integers")
        for token_id, bias in self.logit_bias:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise bad("logit_bias", f"logit_bias keys must be token ids, got {token_id!r}")
            if not -100 <= bias <= 100:
                raise bad("logit_bias", f"logit_bias values must be in [-100, 100], got {bias}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad(
                    "allowed_token_ids", "allowed_token_ids is empty: nothing could be sampled"
                )
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0
                   for t in self.allowed_token_ids):  # fmt: skip
                raise bad("allowed_token_ids", "allowed_token_ids must be non-negative integers")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", "bad_words must be strings with a non-blank character")
        if len(self.bad_words) > MAX_BAD_WORDS or len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            # (each is checked against the output at every step, on the engine's thread)
            raise bad("bad_words", f"at most {MAX_BAD_WORDS} bad_words, got {len(self.bad_words)}"
                      f" words and {len(self.bad_words_token_ids)} token sequences")  # fmt: skip
        for ids in self.bad_words_token_ids:
            if not ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                raise bad(
                    "bad_words_token_ids",
                    "bad_words_token_ids must be non-empty sequences of token ids",
                )

    @property
    def greedy(self) -> bool:
        # A temperature this small divides the logits into infinities: it is greedy in all but
        # name (vLLM draws the same line).
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def edits_logits(self) -> bool:
        """Whether the sampler changes this request's logits before it picks (penalties, bias,
        allowed ids, bad words; ``min_tokens`` is the request's state, not only these)."""
        return bool(
            self.needs_penalties
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words_token_ids
        )

    def with_bad_words_tokenized(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """These parameters with each of ``bad_words`` moved into ``bad_words_token_ids`` as
        ``encode`` (the tokenizer, no special tokens) writes it, at the start of a text and
        after a space (a byte-level BPE spells the two differently); each sequence once. The
        words are tokenized once: the server and the offline API do it before the request
        fans out into its ``n`` choices, and the engine's call is then a no-op."""
        if not self.bad_words:
            return self
        sequences = list(self.bad_words_token_ids)
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(encode(text))
                if ids:
                    sequences.append(ids)
        return replace(self, bad_words=(), bad_words_token_ids=tuple(dict.fromkeys(sequences)))

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of the ``index``-th of ``n`` sequences generated for one prompt.

        A seeded request gives its choices ``seed + index`` (wrapped into a signed 64-bit
        integer), so they differ from each other yet are reproducible; the offline API and the
        server fan out the same way.
        """
        seed = None if self.seed is None else (self.seed + index + 2**63) % 2**64 - 2**63
        return replace(self, n=1, seed=seed)
