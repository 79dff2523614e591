from __future__ import annotations

import pytest

from infer.core.request import Request, RequestStatus
from infer.core.sampling_params import SamplingParams
from infer.engine.scheduler import AHEAD_TOKEN

from ._factories import EOS, fake_sample, make_request, make_scheduler, run_to_completion


def test_every_request_completes_and_every_block_returns():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    reqs = [make_request(f"r{i}", prompt_len=5 + i, max_tokens=3 + i % 4) for i in range(10)]
    for r in reqs:
        s.add_request(r)
    run_to_completion(s)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert [r.num_output_tokens for r in reqs] == [r.sampling_params.max_tokens for r in reqs]
    assert s.kv.num_free_blocks == 64


@pytest.mark.parametrize("chunk", [None, 1, 3, 7])
def test_token_budget_and_seq_limit_never_exceeded(chunk):
    s = make_scheduler(
        num_blocks=256,
        block_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=10,
        prefill_chunk_size=chunk,
    )
    for i in range(8):
        s.add_request(make_request(f"r{i}", prompt_len=9, max_tokens=5))
    for out in run_to_completion(s):
        assert len(out.chunks) <= 3
        if chunk is not None:
            assert out.num_batched_tokens <= 10
            assert all(
                len(c.token_ids) <= chunk or c.sample and len(c.token_ids) == 1 for c in out.chunks
            )


def test_chunked_prefill_mixes_with_decode_in_one_step():
    s = make_scheduler(max_num_seqs=4, max_num_batched_tokens=6, prefill_chunk_size=4)
    s.add_request(make_request("short", prompt_len=2, max_tokens=10))
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    s.add_request(make_request("long", prompt_len=20, max_tokens=2))
    out = s.schedule()
    kinds = {c.request_id: len(c.token_ids) for c in out.chunks}
    assert kinds == {"short": 1, "long": 4}  # a decode and a prefill chunk, one pass
    assert out.chunks[1].sample is False  # a middle chunk samples nothing


def test_unchunked_prompt_larger_than_budget_still_runs():
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(make_request("big", prompt_len=10, max_tokens=1))
    out = s.schedule()
    assert len(out.chunks[0].token_ids) == 10
    s.update_from_output(out, fake_sample(out))
    assert not s.has_unfinished_requests()


def test_kv_pressure_preempts_newest_under_fcfs_and_output_continues():
    # 6 blocks of 4 tokens; two requests of 8 prompt + 8 output tokens need 4 blocks each.
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    a = make_request("a", prompt_len=8, max_tokens=8, arrival=1.0)
    b = make_request("b", prompt_len=8, max_tokens=8, arrival=2.0)
    s.add_request(a)
    s.add_request(b)
    outs = run_to_completion(s)
    preempted = [rid for o in outs for rid in o.preempted]
    assert preempted and set(preempted) == {"b"}  # the newest is the victim
    assert b.num_preemptions >= 1 and b.num_recomputed_tokens > 0
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert s.counters.preemptions == len(preempted)
    assert s.kv.num_free_blocks == 6


def test_priority_policy_orders_waiting_and_preempts_for_urgent():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    low = make_request("low", prompt_len=4, max_tokens=20, priority=5, arrival=1.0)
    s.add_request(low)
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    s.add_request(make_request("mid", prompt_len=4, max_tokens=2, priority=3, arrival=2.0))
    s.add_request(make_request("urgent", prompt_len=4, max_tokens=2, priority=0, arrival=3.0))
    out = s.schedule()
    assert out.preempted == ["low"]
    assert [c.request_id for c in out.chunks] == ["urgent"]
    finished_order = []
    while s.has_unfinished_requests():
        out = s.schedule()
        before = set(s.requests)
        s.update_from_output(out, fake_sample(out))
        finished_order += sorted(before - set(s.requests))
    assert finished_order == ["urgent", "mid", "low"]
    assert low.num_output_tokens == 20


def test_fcfs_ignores_priorities():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="fcfs")
    s.add_request(make_request("first", priority=9, arrival=1.0))
    s.add_request(make_request("second", priority=0, arrival=2.0))
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["first"] and not out.preempted


def test_priority_aging_prevents_starvation():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority", max_wait_steps=5)
    s.add_request(make_request("low", prompt_len=2, max_tokens=1, priority=10, arrival=0.0))
    served_low_at = None
    for step in range(60):
        s.add_request(
            make_request(f"hi{step}", prompt_len=2, max_tokens=1, priority=0, arrival=step + 1)
        )
        out = s.schedule()
        s.update_from_output(out, fake_sample(out))
        if "low" not in s.requests:
            served_low_at = step
            break
    assert served_low_at is not None and served_low_at <= 6


def test_static_batching_admits_only_when_batch_drained():
    s = make_scheduler(max_num_seqs=8, batching_mode="static")
    s.add_request(make_request("a", max_tokens=3))
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    s.add_request(make_request("b", max_tokens=3))
    for _ in range(2):
        out = s.schedule()
        assert [c.request_id for c in out.chunks] == ["a"]
        s.update_from_output(out, fake_sample(out))
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["b"]


def test_no_kv_cache_mode_recomputes_whole_sequence_each_step():
    s = make_scheduler(use_kv_cache=False)
    s.add_request(make_request("a", prompt_len=5, max_tokens=3))
    lengths = []
    while s.has_unfinished_requests():
        out = s.schedule()
        lengths.append(len(out.chunks[0].token_ids))
        assert out.chunks[0].num_computed_tokens == 0
        s.update_from_output(out, fake_sample(out))
    assert lengths == [5, 6, 7]
    assert s.kv.num_free_blocks == 64


def test_contiguous_backend_reserves_one_region_per_request():
    s = make_scheduler(num_blocks=2, contiguous_len=32, max_num_seqs=8)
    for i in range(4):
        s.add_request(make_request(f"r{i}", prompt_len=4, max_tokens=2))
    out = s.schedule()
    assert len(out.chunks) == 2  # only two regions
    run_to_completion(s)
    assert s.kv.num_free_blocks == 2


def test_abort_frees_blocks_immediately():
    s = make_scheduler(num_blocks=16)
    r = make_request("a", prompt_len=8, max_tokens=50)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    assert s.kv.num_free_blocks < 16
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 16 and r.status.finish_reason == "abort"


def test_eos_stops_unless_ignored_and_min_tokens_respected():
    s = make_scheduler()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2), eos_token_ids=(0,))
    s.add_request(r)
    for _ in range(3):
        out = s.schedule()
        s.update_from_output(out, fake_sample(out, token=0))
    assert r.status == RequestStatus.FINISHED_STOPPED and r.num_output_tokens == 2


def test_prefix_cache_hits_skip_prefill_tokens():
    s = make_scheduler(num_blocks=64, block_size=4, prefix=True)
    shared = list(range(1, 17))
    s.add_request(make_request("a", prompt=shared + [50, 51], max_tokens=2))
    run_to_completion(s)
    s.add_request(make_request("b", prompt=shared + [60, 61], max_tokens=2))
    out = s.schedule()
    assert out.chunks[0].num_computed_tokens == 16 and len(out.chunks[0].token_ids) == 2
    run_to_completion(s)
    stats = s.kv.prefix_stats
    assert stats.hits == 16 and stats.queries == 36
    assert s.kv.num_free_blocks == 64


def test_swap_preemption_keeps_computed_tokens_and_returns_everything():
    s = make_scheduler(
        num_blocks=6,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        swap_blocks=8,
    )
    a = make_request("a", prompt_len=8, max_tokens=8, arrival=1.0)
    b = make_request("b", prompt_len=8, max_tokens=8, arrival=2.0)
    s.add_request(a)
    s.add_request(b)
    outs = run_to_completion(s)
    outs_with_swap_out = [o for o in outs if o.swap_out]
    assert outs_with_swap_out and all(
        o.swap_in == [] or o.swap_out == [] for o in outs_with_swap_out
    )
    assert sum(len(o.swap_out) for o in outs) == sum(len(o.swap_in) for o in outs) > 0
    # A swapped request resumes where it stopped: nothing is recomputed.
    assert s.counters.preemptions_swap > 0 and s.counters.recomputed_tokens == 0
    assert b.num_swapped_blocks > 0 and b.num_output_tokens == 8
    resumed = next(o for o in outs if o.swap_in)
    assert [len(c.token_ids) for c in resumed.chunks if c.request_id == "b"] == [1]
    s.kv.end_step()
    assert s.kv.num_free_blocks == 6 and s.kv.num_free_swap_blocks == 8


def test_swap_falls_back_to_recompute_when_swap_space_is_full():
    s = make_scheduler(
        num_blocks=6,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        swap_blocks=1,
    )
    s.add_request(make_request("a", prompt_len=8, max_tokens=8, arrival=1.0))
    s.add_request(make_request("b", prompt_len=8, max_tokens=8, arrival=2.0))
    run_to_completion(s)
    assert s.counters.preemptions_recompute > 0 and s.counters.preemptions_swap == 0
    assert s.kv.num_free_blocks == 6


def test_host_slots_freed_by_swap_in_are_not_reused_in_the_same_step():
    from infer.kv_cache.manager import PagedKVManager

    kv = PagedKVManager(8, 4, num_swap_blocks=2)
    a = make_request("a", prompt_len=8)
    assert kv.allocate(a, 8)
    out = kv.swap_out(a)
    assert [h for _, h in out] == [0, 1]
    kv.swap_in(a, 1)
    assert kv.num_free_swap_blocks == 0  # released only at the next step
    kv.end_step()
    assert kv.num_free_swap_blocks == 2
    kv.free(a)


def test_token_ids_is_the_slice_of_all_token_ids_for_every_range():
    r = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=10))
    r.output_token_ids.extend([5, 6, 7])
    n = r.num_tokens
    for start in range(n + 2):
        for end in range(start, n + 3):
            assert r.token_ids(start, end) == r.all_token_ids[start:end], (start, end)


# ---- schedule_ahead (async scheduling) ----------------------------------------------------------
def _token_for(step: int, rid: str, eos_at: dict[str, int]) -> int:
    """The fake runner's token for ``rid`` at output index ``step``: EOS where asked."""
    return EOS if eos_at.get(rid) == step else 10 + step


def _drive(s, requests: dict[str, Request], eos_at: dict[str, int], ahead: bool,
           admitted: list[str] | None = None) -> tuple:  # fmt: skip
    """Run to completion as the engine does, planning each decode step ahead when it can: the
    step planned ahead is applied after the one it follows, and rows of requests that ended
    meanwhile are dropped by update_from_output. Returns the outputs and the steps planned
    ahead; ``admitted`` gets the requests a planned step admitted."""
    from infer.core.messages import SampledToken

    def sample(out):
        return {c.request_id: SampledToken(_token_for(s.requests[c.request_id].num_output_tokens,
                                                      c.request_id, eos_at))
                for c in out.chunks if c.sample and c.request_id in s.requests}  # fmt: skip

    pending, planned = None, 0
    admitted_ahead = admitted if admitted is not None else []
    for _ in range(1000):
        if pending is None:
            if not s.has_unfinished_requests():
                break
            pending = s.schedule()
        nxt = s.schedule_ahead(pending) if ahead else None
        if nxt is not None:
            planned += 1
            before = {c.request_id: c for c in pending.chunks}
            fed = [c for c in nxt.chunks if c.request_id in before and before[c.request_id].sample]
            assert nxt.chunks[: len(fed)] == fed  # the rows fed on the device come first
            for c in nxt.chunks:
                request = s.requests[c.request_id]
                prev = before.get(c.request_id)
                if prev is None:  # admitted ahead
                    assert c.num_computed_tokens == request.num_computed_tokens
                    admitted_ahead.append(c.request_id)
                    continue
                after = prev.num_computed_tokens + len(prev.token_ids)  # where ``pending`` ends
                assert c.num_computed_tokens == after
                if prev.sample:  # decodes the token ``pending`` samples
                    assert c.token_ids == [AHEAD_TOKEN] and c.sample
                else:  # the prompt's next chunk
                    assert c.token_ids == request.token_ids(after, after + len(c.token_ids))
                # room for what ``pending`` writes and what this step writes
                assert len(c.block_table) * s.kv.block_size >= after + len(c.token_ids)
        s.update_from_output(pending, sample(pending))
        pending = nxt
    return {rid: r.output_token_ids for rid, r in requests.items()}, planned


def _fresh(**sched) -> tuple:
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, **sched)
    requests = {f"r{i}": make_request(f"r{i}", prompt_len=3 + i, max_tokens=3 + 2 * i,
                                      ignore_eos=False) for i in range(4)}  # fmt: skip
    for r in requests.values():
        s.add_request(r)
    return s, requests


@pytest.mark.parametrize("prefix", [False, True])
def test_steps_planned_ahead_give_the_regular_schedules_tokens(prefix):
    eos_at = {"r2": 2}  # r2 meets EOS while its next step is already planned
    want, _ = _drive(*_fresh(prefix=prefix), eos_at, ahead=False)
    s, requests = _fresh(prefix=prefix)
    got, planned = _drive(s, requests, eos_at, ahead=True)
    assert got == want and planned >= 5
    assert len(want["r2"]) == 3 and want["r2"][-1] == EOS
    assert [len(t) for t in (want["r0"], want["r1"], want["r3"])] == [3, 5, 9]
    assert s.kv.num_free_blocks == 64


def test_nothing_is_planned_ahead_where_the_regular_schedule_would_differ():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2)
    for i in range(3):  # one waits for a slot: the running two may still decode ahead
        s.add_request(make_request(f"r{i}", prompt_len=4, max_tokens=6))
    out = s.schedule()  # the two prompts
    s.update_from_output(out, fake_sample(out))
    decode = s.schedule()
    assert s.schedule_ahead(decode) is not None

    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4)
    s.add_request(make_request("a", prompt_len=4, max_tokens=6))
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    decode = s.schedule()
    s.add_request(make_request("b", prompt_len=4, max_tokens=6))  # a free slot: admitted ahead
    ahead = s.schedule_ahead(decode)
    assert [(c.request_id, len(c.token_ids)) for c in ahead.chunks] == [("a", 1), ("b", 4)]
    assert (ahead.num_decode_tokens, ahead.num_prefill_tokens) == (1, 4)
    s.update_from_output(decode, fake_sample(decode))
    after = s.schedule_ahead(ahead)  # b's prompt samples its first token: b decodes it next
    assert [(c.request_id, c.token_ids, c.num_computed_tokens) for c in after.chunks] == [
        ("a", [AHEAD_TOKEN], 6), ("b", [AHEAD_TOKEN], 4)
    ]  # fmt: skip

    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    s.add_request(make_request("low", prompt_len=4, max_tokens=6, priority=5))
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    decode = s.schedule()
    s.add_request(make_request("high", prompt_len=4, max_tokens=6, priority=0))  # may preempt
    assert s.schedule_ahead(decode) is None

    s = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2)  # no block for position c+1
    s.add_request(make_request("x", prompt_len=7, max_tokens=8))
    s.add_request(make_request("y", prompt_len=3, max_tokens=8))
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    decode = s.schedule()
    assert s.schedule_ahead(decode) is None


def test_a_slot_a_length_finish_frees_is_admitted_into_ahead():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2)
    s.add_request(make_request("a", prompt_len=4, max_tokens=2))
    s.add_request(make_request("b", prompt_len=4, max_tokens=6))
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    s.add_request(make_request("w", prompt_len=4, max_tokens=6))  # waits: both slots taken
    decode = s.schedule()  # "a" samples its last token here: its slot is free next step
    ahead = s.schedule_ahead(decode)
    assert [(c.request_id, len(c.token_ids)) for c in ahead.chunks] == [("b", 1), ("w", 4)]
    s.update_from_output(decode, fake_sample(decode))
    assert "a" not in s.requests and len(s.running) == 2  # b and w
    s.update_from_output(ahead, fake_sample(ahead))
    assert {c.request_id for c in s.schedule().chunks} == {"b", "w"}


@pytest.mark.parametrize("chunk", [None, 3])
def test_requests_admitted_ahead_get_the_regular_schedules_tokens(chunk):
    """More requests than slots: the waiting ones are admitted into steps planned ahead as
    slots free up (length), whole or in chunks, and every request gets the tokens it gets
    without planning ahead, every block back."""

    def fresh():
        s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2, prefill_chunk_size=chunk)
        requests = {f"r{i}": make_request(f"r{i}", prompt_len=3 + 2 * i, max_tokens=2 + i,
                                          ignore_eos=False) for i in range(6)}  # fmt: skip
        for r in requests.values():
            s.add_request(r)
        return s, requests

    eos_at = {"r3": 1}
    want, _ = _drive(*fresh(), eos_at, ahead=False)
    s, requests = fresh()
    admitted: list[str] = []
    got, planned = _drive(s, requests, eos_at, ahead=True, admitted=admitted)
    assert got == want and planned >= 3
    assert admitted  # some arrivals went into a step planned ahead
    assert s.kv.num_free_blocks == 64


def test_a_waiting_request_that_needs_the_regular_schedule_stops_planning_ahead():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4)
    s.add_request(make_request("a", prompt_len=4, max_tokens=6))
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    decode = s.schedule()
    b = make_request("b", prompt_len=4, max_tokens=6)
    b.sampling_params = SamplingParams(max_tokens=6, prompt_logprobs=1)  # its whole prompt runs
    s.add_request(b)
    assert s.schedule_ahead(decode) is None


def test_an_embedding_request_finishes_in_the_step_that_ends_its_prompt():
    """An embedding request runs its prompt in chunks like any prefill; the chunk that reaches
    the end takes the runner's embedding instead of a token, the request finishes with no output
    token, its full blocks go to the prefix cache and every block is freed. A decode beside it
    goes on."""
    from infer.core.pooling_params import POOLING_SAMPLING, PoolingParams

    s = make_scheduler(num_blocks=16, block_size=4, prefix=True, max_num_seqs=4,
                       max_num_batched_tokens=6, prefill_chunk_size=4)  # fmt: skip
    s.add_request(make_request("gen", prompt_len=2, max_tokens=6))
    embed = Request("emb", [3 + i for i in range(10)], POOLING_SAMPLING, pooling=PoolingParams())
    s.add_request(embed)
    steps = 0
    while embed.status != RequestStatus.FINISHED_STOPPED:
        out = s.schedule()
        steps += 1
        chunk = next((c for c in out.chunks if c.request_id == "emb"), None)
        sampled = fake_sample(out)
        pooled = {}
        if chunk is not None and chunk.sample:
            pooled = {"emb": [0.25, 0.5]}
            del sampled["emb"]
        progressed = s.update_from_output(out, sampled, None, pooled)
        if pooled:
            assert embed in progressed
        assert steps < 10
    assert embed.embedding == [0.25, 0.5]
    assert embed.num_output_tokens == 0 and embed.num_computed_tokens == 10
    assert s.counters.finished == {"stop": 1}
    gen = s.requests["gen"]
    assert gen.num_output_tokens >= 2 and not gen.is_finished
    # its two full blocks were cached: a same-prompt request hits them
    again = Request("again", list(embed.prompt_token_ids), POOLING_SAMPLING,
                    pooling=PoolingParams())  # fmt: skip
    assert s.kv.lookup_prefix(again).num_blocks == 2
    run_to_completion(s)
    assert s.kv.num_free_blocks == 16
