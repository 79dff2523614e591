"""The step scheduler: what the next forward pass is spent on. No torch.

Each step has a token budget (``max_num_batched_tokens``). Running requests are served first
(a decode token each, or the next chunk of an unfinished prefill), then waiting requests in
policy order, each clipped to what is left of the budget. Continuous batching, chunked prefill
and prefill/decode mixing all fall out of that one rule; static batching and "no KV cache" are
comparison modes of it.

Memory is the other budget: ``KVManager.allocate`` is the only gate. When it says no, the
scheduler preempts (fcfs: newest running; priority: worst ``(priority, arrival)``), frees the
victim's blocks and puts it back in the waiting queue to be re-prefilled later (recompute).

Request state changes only here: in ``schedule`` (admission, preemption), ``update_from_output``
(tokens computed and sampled, stop conditions) and ``finish_request`` (stops, aborts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from infer.config import CacheConfig, SchedulerConfig
from infer.core.messages import KVImport, Sampled, ScheduledChunk, SchedulerOutput
from infer.core.request import Request, RequestStatus, TokenLogprob
from infer.engine.queue import make_queue
from infer.kv_cache.manager import NO_HIT, KVManager, PrefixHit

AHEAD_TOKEN = 0
"""The input id a step planned ahead carries for a token not sampled yet (the runner replaces it
on the device, :class:`infer.runner.runner.TokenFeed`)."""


@dataclass
class SchedulerCounters:
    """Monotone engine-wide counters."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    recomputed_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    transferred_tokens: int = 0  # prompt tokens whose KV a payload brought (decode side)
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> count
    # Speculative decoding (vLLM's spec_decode metric names): verified proposal runs, proposed
    # tokens, accepted tokens, and accepted tokens by position in the proposal.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)


# A finished ``export_kv`` request keeps its blocks for export only when it ended normally.
_KEEPS_KV = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, cache: CacheConfig, kv: KVManager, max_loras: int = 0
    ) -> None:
        self.config = config
        self.kv = kv
        # LoRA: the most distinct adapters the running requests may use (the runner's slots).
        self.max_loras = max_loras
        self.recompute_every_step = not cache.use_kv_cache
        self.waiting = make_queue(config.scheduling_policy, config.max_wait_steps)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Finished ``export_kv`` requests whose blocks are kept until the engine has copied
        # their KV out (prefill/decode disaggregation), in the step they finished.
        self.held: dict[str, Request] = {}
        self.counters = SchedulerCounters()

    # ---- intake -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (stop string, abort, error): free its slot and KV blocks now."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.kv_payload = None
        if request.export_kv and status in _KEEPS_KV:
            self.held[request_id] = request  # its blocks stay allocated until release_held
        else:
            self.kv.free(request)
        request.spec_token_ids = []
        request.status = status
        request.timings.finished = time.perf_counter()
        reason = status.finish_reason or "unknown"
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        return request

    def release_held(self, request_id: str) -> bool:
        """Free the blocks of a finished ``export_kv`` request; False if none are held."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.kv.free(request)
        return True

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[str, ScheduledChunk] = {}
        preempted: list[str] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        kv_imports: list[KVImport] = []
        # Prefill chunks in `scheduled`, kept as chunks come and go (an admission asks whether
        # there is one: asked of every chunk, a burst of admissions was quadratic).
        num_prefills = 0
        self.kv.end_step()
        self.waiting.tick()
        sort_key = self.waiting.sort_key
        self.running.sort(key=sort_key)
        batch_was_empty = not self.running

        def preempt(victim: Request) -> None:
            nonlocal budget, num_prefills
            chunk = scheduled.pop(victim.request_id, None)
            if chunk is not None:
                budget += len(chunk.token_ids)
                num_prefills -= _is_prefill(chunk)
            self.running.remove(victim)
            victim.spec_token_ids = []  # proposals are for the step they were made for
            imported = [k for k in kv_imports if k.request_id == victim.request_id]
            for imp in imported:
                kv_imports.remove(imp)  # not copied into blocks it no longer holds
                victim.kv_payload = imp.payload  # used again when it is admitted again
            self.counters.preemptions += 1
            victim.num_preemptions += 1
            # NOTE: blocks whose import was just called off hold nothing yet: never swap them.
            swap = cfg.preemption_mode == "swap" and not imported
            pairs = self.kv.swap_out(victim) if swap else None
            if pairs is not None:
                swap_out.extend(pairs)
                self.counters.preemptions_swap += 1
                self.counters.swapped_out_blocks += len(pairs)
                victim.num_swapped_blocks += len(pairs)
            else:  # recompute (also the fallback when the swap space is full)
                self.kv.free(victim)
                self.counters.preemptions_recompute += 1
                self.counters.recomputed_tokens += victim.num_computed_tokens
                victim.num_recomputed_tokens += victim.num_computed_tokens
                victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            self.waiting.add_preempted(victim)
            preempted.append(victim.request_id)

        # 1. Running requests, most urgent first.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._num_tokens_to_run(request, budget, any_prefill=False)
            if n == 0:
                i += 1
                continue
            while not self.kv.allocate(request, n):
                if (
                    n > 1
                    and request.spec_token_ids
                    and request.num_tokens - 1 == (request.num_computed_tokens)
                ):
                    # Proposals never cost a preemption: decode plainly when they do not fit.
                    request.spec_token_ids = []
                    n = 1
                    continue
                # NOTE: only requests not yet served this step are candidates, so a step never
                # undoes work it has already planned for more urgent requests.
                victim = max(self.running[i:], key=sort_key)
                preempt(victim)
                if victim is request:
                    break
            else:
                chunk = scheduled[request.request_id] = self._chunk(request, n)
                num_prefills += _is_prefill(chunk)
                budget -= n
                i += 1
        for request in self.running:  # proposals are for this step only
            if request.spec_token_ids:
                request.spec_token_ids = []

        # 2. Waiting requests, in policy order.
        admit = not preempted and (cfg.batching_mode == "continuous" or batch_was_empty)
        adapters = {r.lora_id for r in self.running if r.lora_id is not None}
        skipped: list[Request] = []  # their adapter would need a slot the running ones hold
        while admit and len(self.waiting) and budget > 0:
            request = self.waiting.peek()
            load = request.lora_id
            if load is not None and load not in adapters and len(adapters) >= self.max_loras:
                skipped.append(self.waiting.pop())
                continue
            if len(self.running) >= cfg.max_num_seqs and not self._preempt_for(request, preempt):
                break
            swapped = self.kv.is_swapped(request)
            # NOTE: prompt logprobs need logits at every prompt position: no cached prefix.
            fresh = (
                request.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None
            )
            hit = self.kv.lookup_prefix(request) if fresh else NO_HIT
            payload = request.kv_payload if fresh else None
            if payload is not None and payload.num_tokens > hit.num_tokens(self.kv.block_size):
                # Transferred KV covers the prompt past the cached blocks: computed, too.
                extra = payload.num_tokens - hit.num_tokens(self.kv.block_size)
                hit = PrefixHit(hit.blocks, hit.hashes, extra)
            num_cached = hit.num_tokens(self.kv.block_size)
            n = self._num_tokens_to_run(request, budget, num_prefills > 0, num_cached)
            if n == 0:
                break
            if swapped:
                pairs = self.kv.swap_in(request, n)
                if pairs is None:
                    break
                swap_in.extend(pairs)
                self.counters.swapped_in_blocks += len(pairs)
            elif not self.kv.allocate(request, n, hit) and not (
                self._preempt_for(request, preempt) and self.kv.allocate(request, n, hit)
            ):
                break
            if not swapped and hit.num_transferred_tokens:
                assert payload is not None
                table = self.kv.block_table(request)
                kv_imports.append(KVImport(request.request_id, payload, hit.num_blocks,
                                           table[hit.num_blocks : payload.num_blocks]))  # fmt: skip
            if load is not None:
                adapters.add(load)
            chunk = scheduled[request.request_id] = self._admit(
                request, n, None if swapped else hit
            )
            num_prefills += _is_prefill(chunk)
            budget -= n
        for request in reversed(skipped):  # back where they were, ahead of the rest
            self.waiting.add_preempted(request)

        return step_output(list(scheduled.values()), preempted, swap_out, swap_in, kv_imports)

    def schedule_ahead(self, running: SchedulerOutput) -> SchedulerOutput | None:
        """The step after ``running`` (a step still on the device), planned before its tokens
        are known: each request ``running`` samples for decodes that token (input ids the
        runner takes on the device), each prompt ``running`` ran a chunk of goes on with its
        next chunk, and waiting requests are admitted into the slots and budget left, as the
        regular schedule would (:meth:`_admit_ahead`). None where the regular schedule must
        decide — ``running`` with proposals, prompt logprobs, swaps or imports, a waiting
        request that may preempt (priority) or needs what only the regular schedule does
        (:meth:`_admits_ahead`), a request not in ``running``, no room without preemption —
        so the caller waits for ``running`` and schedules as usual.

        Positions count what ``running`` feeds (not yet in ``num_computed_tokens``)::

            computed : ... c-1 | c .. c+r-1     c: where ``running``'s r tokens start
            ahead    :                 c+r      the token it samples (fed), or the prompt's
                                                next chunk from c + r

        The decodes come first (one row each: the rows fed on the device), prompt chunks after
        them. A request that ``running`` finishes (a stop token) is in the step anyway: its row
        is computed and dropped (:meth:`update_from_output` skips requests that are gone), and
        it writes only its own last, never-cached block, before any later step reuses it; its
        slot is not admitted into until a step planned after ``running``'s tokens are applied.
        Which requests share a step changes no request's tokens where a row's sums do not
        depend on its batch (the CPU's kernels; on a GPU a decode row in a step with a prefill
        chunk runs the eager path's kernels, as in the regular schedule's mixed steps, which
        fall on other steps).
        """
        cfg = self.config
        waiting = len(self.waiting)
        if (
            self.recompute_every_step
            or cfg.batching_mode != "continuous"
            or (waiting and cfg.scheduling_policy == "priority")  # may preempt
            or (waiting and not self._admits_ahead(self.waiting.peek()))
            or len(running.chunks) != len(self.running)
            or len(running.chunks) > cfg.max_num_batched_tokens
            or running.swap_in
            or running.swap_out
            or running.kv_imports
            or any(c.num_spec_tokens or c.prompt_logprobs for c in running.chunks)
        ):
            return None
        decoding: list[tuple[Request, int]] = []  # sampled in ``running``, decoding after it
        prefilling: list[tuple[Request, int]] = []  # a prompt chunk that samples nothing yet
        for chunk in running.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING or request.spec_token_ids:
                return None
            if not chunk.sample:
                prefilling.append((request, len(chunk.token_ids)))
            elif request.num_output_tokens + 1 < request.max_new_tokens:  # not ended by length
                decoding.append((request, len(chunk.token_ids)))
        chunks: list[ScheduledChunk] = []
        for request, ran in decoding:
            # Its token from ``running`` goes at c + ran: room for ``running``'s and for it.
            if not self.kv.allocate(request, ran + 1):
                return None  # preemption's business: the regular schedule's
            chunks.append(ScheduledChunk(request.request_id, [AHEAD_TOKEN],
                                         request.num_computed_tokens + ran,
                                         self.kv.block_table(request), True))  # fmt: skip
        budget = cfg.max_num_batched_tokens - len(chunks)
        for request, ran in prefilling:  # the prompt's next chunk: its ids are known here
            start = request.num_computed_tokens + ran
            # Sized as step 1 of schedule() sizes a running prompt, counting ``start`` as computed.
            n = self._num_tokens_to_run(request, budget, False, start)
            if n <= 0 or not self.kv.allocate(request, ran + n):
                return None
            chunks.append(self._chunk(request, n, start))
            budget -= n
        if not chunks:
            return None
        self.kv.end_step()
        self.waiting.tick()
        if waiting:
            chunks += self._admit_ahead(budget, cfg.max_num_seqs - len(chunks))
        return step_output(chunks)

    def stop_at_string(self, request: Request, num_output_tokens: int) -> None:
        """The detokenizer found a stop string ending after ``num_output_tokens`` tokens: the
        output ends there and the request finishes with ``stop``. With speculation a step can
        add tokens past it, and one of them may already have finished the request another way
        (length, EOS, a stop id): the stop string came first, so it wins."""
        extra = request.num_output_tokens - num_output_tokens
        if extra > 0:
            request.stopped_on_token = False  # (that token is cut off)
            self.counters.generation_tokens -= extra
            del request.output_token_ids[num_output_tokens:]
            del request.output_logprobs[num_output_tokens:]
            del request.timings.token_times[num_output_tokens:]
        if not request.is_finished:
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            return
        self.refinish(request, RequestStatus.FINISHED_STOPPED)

    def refinish(self, request: Request, status: RequestStatus) -> None:
        """A finished request ends another way after all (a stop string found after a finish
        on length, a failure found while its output was made): its finish is counted anew."""
        finished = self.counters.finished
        old = request.status.finish_reason or "unknown"
        finished[old] -= 1
        if not finished[old]:
            del finished[old]
        new = status.finish_reason or "unknown"
        finished[new] = finished.get(new, 0) + 1
        request.status = status

    def add_proposals(self, proposals: dict[str, list[int]]) -> None:
        """Speculative decoding: tokens proposed to follow each request, verified next step.

        A proposal is clipped so that a step can never produce more than ``max_tokens``.
        """
        for request_id, tokens in proposals.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            room = request.max_new_tokens - request.num_output_tokens - 1
            request.spec_token_ids = list(tokens[: max(room, 0)])

    def _admit(self, request: Request, n: int, hit: PrefixHit | None) -> ScheduledChunk:
        """Move the waiting queue's head ``request`` (its blocks allocated) to the running ones
        with a chunk of ``n`` tokens; ``hit``: its cached prefix (None: swapped back in, its
        computed tokens kept)."""
        self.waiting.pop()
        if request.status == RequestStatus.WAITING:
            self.counters.prompt_tokens += request.num_prompt_tokens
        if hit is not None:
            num_hit = hit.num_blocks * self.kv.block_size
            self.kv.record_prefix_query(request.num_tokens, num_hit)
            request.num_computed_tokens = hit.num_tokens(self.kv.block_size)
            request.num_cached_tokens = num_hit
            request.num_transferred_tokens = hit.num_transferred_tokens
            self.counters.transferred_tokens += hit.num_transferred_tokens
            request.kv_payload = None  # the import (if any) holds it for this step
        request.status = RequestStatus.RUNNING
        if request.timings.first_scheduled is None:
            request.timings.first_scheduled = time.perf_counter()
        self.running.append(request)
        return self._chunk(request, n)

    def _admits_ahead(self, request: Request) -> bool:
        """Whether a step planned ahead may admit ``request``: a new request that needs nothing
        the regular schedule alone does (a swap-in, transferred KV, an adapter slot, prompt
        logprobs' uncached prefill, a grammar)."""
        p = request.sampling_params
        return (
            request.status == RequestStatus.WAITING
            and request.num_computed_tokens == 0
            and request.kv_payload is None
            and request.lora_id is None
            and p.prompt_logprobs is None
            and p.structured_outputs is None
            and not self.kv.is_swapped(request)
        )

    def _admit_ahead(self, budget: int, slots: int) -> list[ScheduledChunk]:
        """Admissions for a step planned ahead, as the regular schedule makes them (policy
        order, prefix lookup, chunking by ``budget``) while they fit ``slots`` and the free
        blocks; what does not fit waits for a later step. Until the step before is applied,
        ``running`` also holds the requests it ends by length: more than ``max_num_seqs`` for
        that moment, nothing decided on it."""
        chunks: list[ScheduledChunk] = []
        num_prefills = 0
        while len(self.waiting) and budget > 0 and slots > 0:
            request = self.waiting.peek()
            if not self._admits_ahead(request):
                break
            hit = self.kv.lookup_prefix(request)
            n = self._num_tokens_to_run(request, budget, num_prefills > 0,
                                        hit.num_tokens(self.kv.block_size))  # fmt: skip
            if n == 0 or not self.kv.allocate(request, n, hit):
                break
            chunks.append(chunk := self._admit(request, n, hit))
            num_prefills += _is_prefill(chunk)
            budget -= n
            slots -= 1
        return chunks

    def _num_tokens_to_run(
        self, request: Request, budget: int, any_prefill: bool, num_cached: int = 0
    ) -> int:
        remaining = request.num_tokens - max(request.num_computed_tokens, num_cached)
        if remaining == 1 and request.spec_token_ids:
            return min(1 + len(request.spec_token_ids), budget)
        if remaining <= 1:
            return min(remaining, budget)
        chunk = self.config.prefill_chunk_size
        if chunk is not None and not self.recompute_every_step:
            return min(remaining, chunk, budget)
        # NOTE: without chunked prefill a prompt runs whole. One that exceeds what is left of
        # the budget still runs if it is the step's first prefill, so no prompt waits forever.
        if remaining <= budget or not any_prefill:
            return remaining
        return 0

    def _preempt_for(self, request: Request, preempt) -> bool:
        """Priority policy: make room for ``request`` by preempting a less urgent running one."""
        if self.config.scheduling_policy != "priority" or not self.running:
            return False
        key = self.waiting.sort_key
        victim = max(self.running, key=key)
        if key(victim) <= key(request):
            return False
        preempt(victim)
        return True

    def _chunk(self, request: Request, n: int, start: int | None = None) -> ScheduledChunk:
        """``n`` tokens of ``request`` from ``start`` (default: its computed tokens; a step
        planned ahead passes the position after the step still on the device)."""
        if start is None:
            start = request.num_computed_tokens
        tokens = request.token_ids(start, start + n)
        num_spec = 0
        if start + 1 == request.num_tokens and n > 1:  # the last token + n - 1 proposals
            num_spec = n - 1
            tokens = tokens + request.spec_token_ids[:num_spec]
        wants = request.sampling_params.prompt_logprobs is not None
        # Positional (the fields' order): keywords cost ~0.27 us a chunk, every request a step.
        return ScheduledChunk(
            request.request_id,
            tokens,
            start,
            self.kv.block_table(request),
            start + len(tokens) - num_spec == request.num_tokens,  # sample
            num_spec,
            wants and len(request.prompt_logprobs) < request.num_prompt_tokens,
        )

    # ---- results ------------------------------------------------------------------------------
    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, Sampled],
        prompt_logprobs: dict[str, list[tuple[int, TokenLogprob]]] | None = None,
        embeddings: dict[str, list[float] | list[list[float]]] | None = None,
    ) -> list[Request]:
        """Apply a step's results; returns the requests that progressed (finished ones included).
        An embedding request whose prompt the step ended takes its embedding and finishes.

        A chunk with ``k`` proposals ran ``k + 1`` tokens; when ``a`` of the proposals were
        accepted, the sampler returned ``a + 1`` tokens and the KV of the ``k - a`` rejected
        ones is rolled back::

            before : ... t | d1 d2 d3         (t: last token, d: proposals, k = 3)
            ran    : t d1 d2 d3                -> num_computed_tokens += 4
            tokens : d1 d2 x                   (a = 2 accepted, x sampled in place of d3)
            after  : ... t d1 d2 | x           -> num_computed_tokens -= 1 (d3's KV is void)
        """
        now = time.perf_counter()
        progressed: list[Request] = []
        counters = self.counters
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None:  # aborted while the step ran
                continue
            request.num_computed_tokens += len(chunk.token_ids)
            if chunk.prompt_logprobs and not request.prompt_logprobs:
                request.prompt_logprobs.append(None)  # the first token has no context
            if prompt_logprobs:
                for position, lp in prompt_logprobs.get(chunk.request_id, ()):
                    if position == len(request.prompt_logprobs):  # not again after a recompute
                        request.prompt_logprobs.append(lp)
            if not chunk.sample:
                self.kv.commit_full_blocks(request)
                continue
            if request.pooling is not None:
                assert embeddings is not None, "an embedding request's step pooled nothing"
                request.embedding = embeddings[chunk.request_id]
                request.timings.first_token = now
                progressed.append(request)
                self.kv.commit_full_blocks(request)
                self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                continue
            result = sampled[chunk.request_id]
            tokens = result if isinstance(result, list) else [result]
            if chunk.num_spec_tokens:
                accepted = len(tokens) - 1
                request.num_computed_tokens -= chunk.num_spec_tokens - accepted
                self.kv.trim(request)
                counters.spec_drafts += 1
                counters.spec_draft_tokens += chunk.num_spec_tokens
                counters.spec_accepted_tokens += accepted
                per_position = counters.spec_accepted_per_position
                per_position.extend([0] * (chunk.num_spec_tokens - len(per_position)))
                for position in range(accepted):
                    per_position[position] += 1
            if request.timings.first_token is None:
                request.timings.first_token = now
            progressed.append(request)
            for token in tokens:
                request.output_token_ids.append(token.token_id)
                if token.logprob is not None:
                    request.output_logprobs.append(token.logprob)
                request.timings.token_times.append(now)
                counters.generation_tokens += 1
                status = self._check_stop(request, token.token_id)
                if status is not None:
                    # Its blocks go to the prefix cache before they are freed, even when the
                    # request ends in the step that computed them (max_tokens=1).
                    self.kv.commit_full_blocks(request)
                    self.finish_request(request.request_id, status)
                    break
            else:
                # NOTE: after the tokens are appended: a block's hash covers its tokens, and
                # num_computed_tokens already counts the accepted proposals.
                self.kv.commit_full_blocks(request)
        if self.recompute_every_step:
            for request in self.running:
                self.kv.free(request)
                request.num_computed_tokens = 0
        return progressed

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.stopped_on_token = True
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                request.stopped_on_token = True
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_new_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None


def step_output(chunks: list[ScheduledChunk], *moves: list) -> SchedulerOutput:
    """A step of ``chunks`` (and ``moves``: preempted ids, swaps, imports), its tokens counted:
    a decode is a chunk of one new token that samples (its proposals aside)."""
    num_decode = sum(
        len(c.token_ids) for c in chunks if len(c.token_ids) - c.num_spec_tokens == 1 and c.sample
    )
    num_tokens = sum(len(c.token_ids) for c in chunks)
    return SchedulerOutput(chunks, num_tokens, num_tokens - num_decode, num_decode, *moves)


def _is_prefill(chunk: ScheduledChunk) -> bool:
    """A chunk of more than one token that is not a decode with proposals."""
    return len(chunk.token_ids) - chunk.num_spec_tokens > 1
