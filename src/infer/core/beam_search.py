"""Beam search: the ``beam_width`` likeliest continuations of a prompt, as vLLM's
``use_beam_search`` (server) and ``LLM.beam_search`` (offline) give them.

It runs on any engine that gives a step's top-k log-probabilities: every round, each live beam
is one request of its prompt + tokens so far, for one token with ``logprobs=2k``. Its prefix
is in the prefix cache from the round before, so a round computes about one token a beam. Of
all the beams' candidates, the ``k`` with the highest cumulative log-probability live on::

    round t:  beam A (-1.2) ──► A+x (-1.5)  A+y (-2.9)  A+z (-3.0) ...
              beam B (-1.4) ──► B+x (-1.6)  B+w (-2.0)  ...           keep the best k of all
    round t+1: A+x (-1.5), B+x (-1.6), B+w (-2.0)                      (k = 3)

A candidate that is an EOS (unless ``ignore_eos``) finishes its beam. When no beam is left
alive, or after ``max_tokens`` rounds, the finished and the live beams are ranked by
``cumulative logprob / generated_tokens ** length_penalty`` (transformers' score) and the best
``k`` returned. Without an EOS this is transformers' beam search, token for token.
No torch here: the drivers (``LLM.beam_search``, the server's ``beam.py``) run the rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from infer.core.sampling_params import InvalidRequestError, SamplingParams

MAX_BEAM_WIDTH = 10  # the candidates a beam asks for (2k) are at most the 20 logprobs a step gives


@dataclass(frozen=True)
class BeamSearchParams:
    """``beam_width`` beams (the server's ``n``), up to ``max_tokens`` each."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    # Accepted as vLLM's; the beams are ranked by the model's own log-probabilities.
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidRequestError(
                f"beam search takes 1 to {MAX_BEAM_WIDTH} beams (n), got {self.beam_width}",
                param="n",
            )
        if self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens"
            )
        if not math.isfinite(self.length_penalty):
            raise InvalidRequestError("length_penalty must be a finite number",
                                      param="length_penalty")  # fmt: skip

    def round_params(self) -> SamplingParams:
        """Each round's request: one token, with the top 2k candidates' log-probabilities (so
        k stay alive even if k of them are EOS)."""
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                              logprobs=2 * self.beam_width)  # fmt: skip


@dataclass(frozen=True)
class Beam:
    """One continuation: its generated token ids and their summed log-probability."""

    token_ids: tuple[int, ...] = ()
    cum_logprob: float = 0.0
    ended_on_eos: bool = False

    def finish_reason(self, aborted: bool = False) -> str:
        """``stop`` (an EOS ended it), else ``abort`` (the search was cut) or ``length``."""
        if self.ended_on_eos:
            return "stop"
        return "abort" if aborted else "length"

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / max(1, len(self.token_ids)) ** length_penalty


def beam_text(tokenizer, token_ids: tuple[int, ...], skip_special_tokens: bool = True) -> str:
    """A beam's text, without the replacement character a multi-byte character cut at the end
    decodes to (the streamed path holds such bytes back; a beam's end is final)."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens).rstrip(
        "\ufffd"
    )


def rounds_for(
    params: BeamSearchParams, given: bool, prompt_len: int, context: int, kv_tokens: int | None
) -> int:
    """The rounds a prompt's search may run: ``max_tokens``, within the context and what the KV
    cache holds (a round's request needs prompt + tokens so far; the last token's KV is never
    written). Unset (``given`` False), fitted to them; asked for and out of reach, refused by
    name before any round runs."""
    room = context - prompt_len
    if kv_tokens is not None:
        room = min(room, kv_tokens + 1 - prompt_len)
    if given and params.max_tokens > room:
        raise InvalidRequestError(
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) is more than the "
            f"context ({context}) and the KV cache ({kv_tokens} tokens) leave a beam",
            param="max_tokens",
        )
    return max(0, min(params.max_tokens, room))


@dataclass
class BeamSearch:
    """One prompt's search: :meth:`advance` with each live beam's top candidates, one round at
    a time, until :attr:`live` is empty; then :meth:`best`."""

    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # the params', less what the context cannot hold after this prompt
    live: list[Beam] = field(default_factory=lambda: [Beam()])
    done: list[Beam] = field(default_factory=list)
    rounds: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            self.done, self.live = self.live, []

    def advance(self, tops: list[tuple[tuple[int, float], ...]]) -> None:
        """``tops[i]``: live beam ``i``'s candidates, ``(token_id, logprob)`` best first."""
        grown: list[Beam] = []
        for beam, top in zip(self.live, tops, strict=True):
            for token_id, logprob in top:
                new = Beam((*beam.token_ids, token_id), beam.cum_logprob + logprob)
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    self.done.append(Beam(new.token_ids, new.cum_logprob, ended_on_eos=True))
                else:
                    grown.append(new)
        # (one round's beams are all as long: the score's order is the log-probability's)
        grown.sort(key=lambda b: b.cum_logprob, reverse=True)
        self.live = grown[: self.params.beam_width]
        self.rounds += 1
        if self.rounds >= self.max_tokens:
            self.done.extend(self.live)
            self.live = []

    def best(self) -> list[Beam]:
        """The best ``beam_width`` beams, finished or cut by ``max_tokens``, best first."""
        penalty = self.params.length_penalty
        ranked = sorted(self.done + self.live, key=lambda b: b.score(penalty), reverse=True)
        return ranked[: self.params.beam_width]


def round_prompts(searches: list[BeamSearch], prompts: list[list[int]]) -> list[list[int]]:
    """A round's requests: every live beam's prompt + tokens so far, search by search."""
    return [p + list(b.token_ids) for s, p in zip(searches, prompts, strict=True) for b in s.live]


def advance_all(searches: list[BeamSearch], tops: list[tuple[tuple[int, float], ...]]) -> None:
    """Each search's :meth:`BeamSearch.advance` with its beams' candidates (``tops``: one per
    request of :func:`round_prompts`, in its order)."""
    start = 0
    for search in searches:
        if search.live:
            end = start + len(search.live)
            search.advance(tops[start:end])
            start = end
