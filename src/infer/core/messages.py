"""The step's messages between the scheduler (which decides) and the runner (which computes).

``SchedulerOutput`` says what one forward pass is spent on; the runner turns it into a
``StepBatch`` (plain data: what every tensor-parallel rank needs to run the pass, sent to the
others each step) and answers with a ``ModelRunnerOutput``: a ``SampledToken`` (or a run of
them) for each chunk that reached the end of its sequence. Both sides import this module and
nothing of each other.

Messages made once per request per step (``SequenceSlice``, ``ScheduledChunk``,
``SampledToken``, and ``core.outputs.RequestOutput``) are slotted dataclasses, not frozen ones,
and are read-only by convention: a frozen dataclass's ``__init__`` sets every field through
``object.__setattr__``, ~4x the cost of a plain one, which at 256 rows a step was ~1.5 ms of a
~5 ms GPU decode step's host time. The others stay frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.core.kv_transfer import KVPayload
from infer.core.multimodal import ImageSlice
from infer.core.request import TokenLogprob


@dataclass(slots=True)  # per row: see the module doc
class SequenceSlice:
    """One sequence's share of a step: ``num_new_tokens`` queries after ``num_computed_tokens``."""

    num_computed_tokens: int
    num_new_tokens: int
    block_table: list[int]
    # Attend each new token as its own decode row (context = the tokens up to it), through
    # the decode path: for a few queries after a long context (speculative verification)
    # that is the decode kernel instead of a gathered, masked prefill.
    as_decode_rows: bool = False
    # An encoder's input whose first num_keys tokens alone are attended to (the rest are
    # queries only: a ColBERT query's expansion tokens); None: every token.
    num_keys: int | None = None

    @property
    def context_len(self) -> int:
        return self.num_computed_tokens + self.num_new_tokens


@dataclass(slots=True)  # per row: see the module doc
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
class KVImport:
    """A transferred prompt KV to copy into a newly admitted request's blocks before the pass:
    ``payload``'s blocks ``first_block ..`` go to ``block_ids`` (its earlier blocks were prefix
    cache hits on this side)."""

    request_id: str
    payload: KVPayload
    first_block: int
    block_ids: list[int]


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
    # Transferred prompt KV to copy in (prefill/decode disaggregation), after the swaps.
    kv_imports: list[KVImport] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)  # per row: see the module doc
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None


Sampled = SampledToken | list[SampledToken]
"""What the runner returns per sampled chunk: one token, or for a chunk with proposals the
accepted proposals followed by one more token (1 .. num_spec_tokens + 1 tokens)."""


@dataclass(frozen=True)
class StepBatch:
    """One step's model inputs as plain data: all a tensor-parallel rank needs to run it (the
    driver sends it to the others each step; sampling stays with the driver)."""

    token_ids: list[int]
    positions: list[int]
    seqs: list[SequenceSlice]
    sample_rows: list[int]  # rows whose logits are sampled
    prompt_rows: list[int]  # rows whose logits give prompt logprobs
    swap_out: list[tuple[int, int]]  # (device block, host block)
    swap_in: list[tuple[int, int]]  # (host block, device block)
    # LoRA: each row's adapter slot (-1: the base model); None when no row has an adapter.
    row_lora_slots: list[int] | None = None
    # Transferred prompt KV to copy in after the swaps (never under tensor parallelism).
    kv_imports: list[KVImport] = field(default_factory=list)
    # Rows whose final hidden states are embeddings (an embedding request's prompt ends there),
    # and the first row of each one's chunk (an encoder's CLS pooling reads it).
    pool_rows: list[int] = field(default_factory=list)
    pool_starts: list[int] = field(default_factory=list)
    # A model that pools by the mean: every chunk of a pooled request's prompt, as (request id,
    # first row, end row, the chunk's first position); the rows are summed, and the sum carried
    # to the request's next chunk (its last chunk's rows are in pool_rows).
    pool_sums: list[tuple[str, int, int, int]] = field(default_factory=list)
    # Requests whose running sums to forget (they ended before their last chunk: aborted).
    pool_drop: list[str] = field(default_factory=list)
    # Token embeddings (an encoder's ``token_embed`` requests): each one's rows, first and end;
    # they follow the pooled rows' vectors, in order, in the step's output.
    pool_tokens: list[tuple[int, int]] = field(default_factory=list)
    # Token classifications (``token_classify`` requests): each one's rows, first and end;
    # their logits follow the token embeddings', in order.
    classify_tokens: list[tuple[int, int]] = field(default_factory=list)
    # A vision-language model's rows that take image features instead of their placeholder
    # tokens' embeddings (core/multimodal.py).
    images: list[ImageSlice] = field(default_factory=list)

    @property
    def samples_every_row(self) -> bool:
        """Every row is sampled, in order (a decode step): the hidden states go to the LM head
        as they are, with no gather. (prepare() lists sample rows strictly increasing, so n of
        n rows ending at n - 1 are 0 .. n - 1.)"""
        n = len(self.sample_rows)
        return n == len(self.token_ids) and self.sample_rows[-1] == n - 1


@dataclass(frozen=True)
class StepTimings:
    """Seconds spent in one step's parts (for the engine-overhead split in benchmarks)."""

    prepare: float
    forward: float
    sample: float


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one step computed: the sampled tokens of each chunk that reached the end of its
    sequence (by request id), where the time went, and prompt logprobs by request id as
    ``(position, logprob)`` pairs."""

    sampled: dict[str, Sampled]
    timings: StepTimings
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)
    # Embedding requests whose prompt this step ended: their embeddings (core/pooling_params.py).
    embeddings: dict[str, list[float] | list[list[float]]] = field(default_factory=dict)


@dataclass(frozen=True)
class RunnerSetup:
    """How a runner is built once the engine has planned the KV cache: the same for every
    tensor-parallel rank (the driver sends it to the others), each of which allocates the
    blocks for its own share of the KV heads."""

    num_blocks: int
    block_size: int
    kv_cache_dtype: str = "auto"
    num_swap_blocks: int = 0  # host blocks for preemption by swapping
    attention_backend: str = "auto"
    # The step sizes the device step's buffers are made for (the GPU step).
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    max_model_len: int = 0
    enforce_eager: bool = False  # no CUDA graphs
    num_spec_tokens: int = 0  # proposals verified per request and step
