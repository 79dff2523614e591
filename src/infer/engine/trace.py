"""What the engine did, step by step, for the live view and for recorded traces. No torch.

Two kinds of record, both plain frozen dataclasses that become JSON with ``dataclasses.asdict``:

- ``StepRecord``: one per step — tokens spent on prefill and on decode against the token budget,
  the step's time, who was preempted, how many blocks were swapped;
- ``EngineSnapshot``: the state after a step — every KV block's state and holder, and every
  request in the queues with its progress.

Recording costs nothing unless something asked for it. ``StepTrace`` is attached to an
``LLMEngine`` only while a viewer polls (``LLMEngine.poll_trace``; it detaches itself when the
polls stop) or while a run is being recorded to a file (``LLMEngine.record_trace``).

The block map is one character per device block::

    '.'  empty and free
    'c'  free but holding a cached prefix (revivable, evicted when its slot is needed)
    'u'  held by a request (``block_owner`` names the first holder; shared prefix blocks
         have more than one)
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from infer.core.messages import SchedulerOutput
from infer.core.request import Request, RequestStatus

VIEWER_IDLE_SECONDS = 5.0
"""A live trace is dropped this long after the last poll: nobody is watching."""


@dataclass(frozen=True)
class StepRecord:
    step: int
    time: float  # seconds since the trace started, at the step's end
    duration_ms: float
    num_prefill_tokens: int
    num_decode_tokens: int
    token_budget: int
    num_running: int
    num_waiting: int
    num_swapped: int  # waiting requests whose KV is in host memory
    preempted: tuple[str, ...]
    swapped_out_blocks: int
    swapped_in_blocks: int
    kv_usage: float


@dataclass(frozen=True)
class RequestView:
    request_id: str
    state: str  # running | waiting | swapped | preempted (waiting to recompute)
    priority: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    max_tokens: int | None
    num_blocks: int
    waited_s: float  # arrival to first scheduled, or to now while still waiting
    ttft_s: float | None
    num_preemptions: int


@dataclass(frozen=True)
class EngineSnapshot:
    step: int
    time: float
    policy: str
    token_budget: int
    max_num_seqs: int
    block_size: int
    blocks: str  # one character per device block (see the module docstring)
    block_owner: tuple[int, ...]  # per block: index into ``requests`` of its holder, or -1
    num_swap_blocks: int
    num_swapped_blocks: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    requests: tuple[RequestView, ...]  # running (most urgent first), then waiting in order


def _request_view(request: Request, state: str, num_blocks: int, now: float) -> RequestView:
    t = request.timings
    started = t.first_scheduled if t.first_scheduled is not None else now
    return RequestView(
        request_id=request.request_id,
        state=state,
        priority=request.priority,
        num_prompt_tokens=request.num_prompt_tokens,
        num_computed_tokens=request.num_computed_tokens,
        num_output_tokens=request.num_output_tokens,
        max_tokens=request.max_new_tokens,  # (as fitted: an unset max_tokens is None)
        num_blocks=num_blocks,
        waited_s=max(0.0, started - t.arrival),
        ttft_s=None if t.first_token is None else max(0.0, t.first_token - t.arrival),
        num_preemptions=request.num_preemptions,
    )


def take_snapshot(scheduler: Any, step: int, elapsed: float) -> EngineSnapshot:
    """The queues and the block map of ``scheduler`` (a ``Scheduler``) as they are now."""
    kv = scheduler.kv
    now = time.perf_counter()
    views: list[RequestView] = []
    owner = [-1] * kv.pool.num_blocks
    for request in scheduler.running:
        held = kv.block_table(request)
        for block_id in held:
            if owner[block_id] < 0:
                owner[block_id] = len(views)
        views.append(_request_view(request, "running", len(held), now))
    for request in scheduler.waiting:
        if kv.is_swapped(request):
            state, n = "swapped", kv.num_swapped_blocks_of(request)
        else:
            preempted = request.status == RequestStatus.PREEMPTED
            state, n = ("preempted" if preempted else "waiting"), 0
        views.append(_request_view(request, state, n, now))
    cfg = scheduler.config
    prefix = kv.prefix_stats
    return EngineSnapshot(
        step=step,
        time=elapsed,
        policy=cfg.scheduling_policy,
        token_budget=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        block_size=kv.block_size,
        blocks=kv.pool.block_states(),
        block_owner=tuple(owner),
        num_swap_blocks=kv.num_swap_blocks,
        num_swapped_blocks=kv.num_swapped_blocks,
        kv_usage=kv.usage,
        prefix_cache_queries=prefix.queries,
        prefix_cache_hits=prefix.hits,
        requests=tuple(views),
    )


class StepTrace:
    """Step records (the latest ``max_records``) and, when ``sink`` is given, every step's
    record and snapshot written to it as one JSON line: ``{"step": {...}, "snapshot": {...}}``.
    """

    def __init__(self, max_records: int = 4096, sink: IO[str] | None = None) -> None:
        self.records: deque[StepRecord] = deque(maxlen=max_records)
        self.sink = sink
        self.started = time.perf_counter()
        self.last_poll = self.started

    def record(self, scheduler: Any, sched: SchedulerOutput, step: int, duration: float) -> None:
        elapsed = time.perf_counter() - self.started
        rec = StepRecord(
            step=step,
            time=elapsed,
            duration_ms=1000 * duration,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            token_budget=scheduler.config.max_num_batched_tokens,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_swapped=scheduler.kv.num_swapped_requests,
            preempted=tuple(sched.preempted),
            swapped_out_blocks=len(sched.swap_out),
            swapped_in_blocks=len(sched.swap_in),
            kv_usage=scheduler.kv.usage,
        )
        self.records.append(rec)
        if self.sink is not None:
            snap = take_snapshot(scheduler, step, elapsed)
            self.sink.write(json.dumps({"step": asdict(rec), "snapshot": asdict(snap)}) + "\n")

    def since(self, step: int) -> list[StepRecord]:
        """Records of steps after ``step`` (oldest first)."""
        out: list[StepRecord] = []
        for rec in reversed(self.records):
            if rec.step <= step:
                break
            out.append(rec)
        out.reverse()
        return out


@dataclass(frozen=True)
class TracePoll:
    """One poll of the live view: the steps since the last poll and the state now."""

    steps: tuple[StepRecord, ...]
    snapshot: EngineSnapshot

    def to_json(self) -> dict[str, Any]:
        return {"steps": [asdict(s) for s in self.steps], "snapshot": asdict(self.snapshot)}


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """A recorded trace's lines (``{"step": ..., "snapshot": ...}`` dicts), in step order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
