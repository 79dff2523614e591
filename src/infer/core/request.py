"""Request state as the engine sees it.

A request's progress is two numbers, not a phase::

    all_token_ids = prompt_token_ids + output_token_ids
                    |<------------- num_tokens ------------->|
                    |<-- num_computed_tokens -->|            |
                     KV for these is in cache    still to run (a prefill chunk, or the one
                                                 decode token sampled last step)

The scheduler only ever asks "how many of the remaining tokens fit this step's budget"; prefill,
chunked prefill and decode all fall out of that. Request state changes in exactly one place:
``Scheduler.update_from_output`` (and ``Scheduler.finish_request`` for aborts).
"""

from __future__ import annotations

import enum
import operator
import time
from dataclasses import dataclass, field, fields

from infer.core.kv_transfer import KVPayload
from infer.core.multimodal import ImageInput
from infer.core.pooling_params import PoolingParams
from infer.core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status above ``PREEMPTED`` is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` for a finished status."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestTimings:
    """Wall-clock timestamps (``time.perf_counter`` seconds) of one request's life."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    def __reduce__(self) -> tuple:
        # Pickled by value as a tuple (see RequestOutput.__reduce__): ~4x faster both ways.
        return (RequestTimings, timings_fields(self))

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


timings_fields = operator.attrgetter(*(f.name for f in fields(RequestTimings)))
"""A request's timings as a tuple, in order: ``RequestTimings(*timings_fields(t))``."""


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives at that position."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), best first


class Request:
    """One sequence being generated. Mutated only by the scheduler (see module docstring)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        max_model_len: int | None = None,
        default_len: int | None = None,
        default_max_tokens: int | None = None,
        lora_name: str | None = None,
        lora_id: int | None = None,
        export_kv: bool = False,
        kv_payload: KVPayload | None = None,
        pooling: PoolingParams | None = None,
        images: tuple[ImageInput, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.priority = priority
        self.cache_salt = cache_salt
        # The LoRA adapter the request runs with (None: the base model): its name, and the
        # load of that name it runs with (what slots and the prefix cache key by: a name
        # unloaded and loaded again is another load).
        self.lora_name = lora_name
        self.lora_id = lora_id
        # Prefill/decode disaggregation: copy the prompt KV out when finishing (prefill side,
        # into ``exported_kv``); the prompt KV computed elsewhere, copied in at admission
        # (decode side).
        self.export_kv = export_kv
        self.exported_kv: KVPayload | None = None
        self.kv_payload = kv_payload
        # Prompt tokens whose KV came from a payload at admission.
        self.num_transferred_tokens = 0
        self.timings = RequestTimings()
        if arrival_time is not None:
            self.timings.arrival = arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob] = []
        # With sampling_params.prompt_logprobs: entry i is prompt token i's (None for the first).
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.num_computed_tokens = 0
        # Tokens whose KV came from the prefix cache at (last) admission.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.aged = False  # promoted by the priority queue's aging (max_wait_steps)
        self.num_recomputed_tokens = 0
        self.num_swapped_blocks = 0
        # Proposed next tokens (speculative decoding), set after a step and used by the next.
        self.spec_token_ids: list[int] = []
        self.stop_reason: int | str | None = None
        # Finished by its last output token: an EOS or a stop id (the scheduler's verdict).
        self.stopped_on_token = False
        self.error: str | None = None
        # An embedding request (core/pooling_params.py): it pools the hidden state of its
        # prompt's last token in the step that reaches it, into ``embedding``, and finishes.
        self.pooling = pooling
        self.embedding: list[float] | list[list[float]] | None = None
        # A vision-language model's images: their pixels and where their placeholder tokens
        # sit in the prompt (core/multimodal.py), in prompt order.
        self.images = images
        max_new = sampling_params.max_tokens
        if max_new is None and default_max_tokens is not None:
            # Unset max_tokens: the model's recommended length (its generation config's
            # max_new_tokens), fitted below to the context and the cache as an unset one is.
            max_new, fitted = default_max_tokens, True
        else:
            fitted = max_new is None
        if max_model_len is not None:
            room = max_model_len - len(self.prompt_token_ids)
            if fitted and default_len is not None:
                # Unset max_tokens: up to the context, or to what a KV cache of ``default_len``
                # tokens holds where that is shorter (the last token's KV is never written: one
                # more; see LLMEngine.add_request); one token at least, so a prompt too long
                # for it is refused, not run for nothing.
                room = min(room, max(1, default_len + 1 - len(self.prompt_token_ids)))
            max_new = room if max_new is None else min(max_new, room)
        self.max_new_tokens: int = max_new if max_new is not None else 2**31
        if pooling is not None:  # (one step past the prompt, which pools instead of sampling)
            self.max_new_tokens = 1

    # ---- derived ----------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` (``0 <= start <= end``) without building the whole
        list (a step's decode chunk is one token of a context that may be thousands long)."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return prompt[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
