"""The step's messages between the scheduler (which decides) and the runner (which computes).

``SchedulerOutput`` says what one forward pass is spent on; ``SampledToken`` is what comes back
for each chunk that reached the end of its sequence. Both sides import this module and nothing
of each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.core.request import TokenLogprob


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: feed ``token_ids`` at positions from ``num_computed_tokens``.

    ::

        all tokens   : t0 t1 t2 t3 t4 t5 t6 t7 t8
        computed     : |<-- 5 -->|
        this chunk   :             t5 t6 t7        (positions 5, 6, 7)
        sample       : False (t8 still to come); True when the chunk ends the sequence
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample: bool  # the chunk reaches the end of the sequence: sample the next token from it
    # Speculative decoding: the chunk's last ``num_spec_tokens`` tokens are proposals to verify
    # (the runner samples at each of them and at the token before; see Sampler.verify).
    num_spec_tokens: int = 0
    # Score every row of this chunk whose next token is a prompt token (prompt logprobs).
    prompt_logprobs: bool = False

    @property
    def spec_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_spec_tokens :]

    @property
    def context_len(self) -> int:
        """Tokens of this sequence with KV after the step (past + this chunk)."""
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    preempted: list[str] = field(default_factory=list)
    # Block copies the runner performs before the forward pass, swap-outs first.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None


Sampled = SampledToken | list[SampledToken]
"""What the runner returns per sampled chunk: one token, or for a chunk with proposals the
accepted proposals followed by one more token (1 .. num_spec_tokens + 1 tokens)."""
