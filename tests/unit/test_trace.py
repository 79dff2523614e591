"""Step records and snapshots (the live view's data) from a scheduler driven by fake outputs."""

from __future__ import annotations

import io
import json

from infer.engine.trace import StepTrace, read_trace, take_snapshot

from ._factories import fake_sample, make_request, make_scheduler


def _run(s, trace: StepTrace) -> list:
    step = 0
    snapshots = []
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, fake_sample(out))
        step += 1
        trace.record(s, out, step, 0.001)
        snapshots.append(take_snapshot(s, step, 0.0))
    return snapshots


def test_snapshot_block_map_and_queues_match_the_scheduler():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                       prefix=True, scheduling_policy="priority")  # fmt: skip
    shared = [5] * 8
    for rid, prio in (("a", 1), ("b", 0), ("c", 2)):
        s.add_request(make_request(rid, prompt=shared + [9, 9], max_tokens=3, priority=prio))
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    snap = take_snapshot(s, 1, 0.5)
    assert len(snap.blocks) == len(snap.block_owner) == 16
    assert [(v.request_id, v.state) for v in snap.requests] == [
        ("b", "running"), ("a", "running"), ("c", "waiting")]  # fmt: skip
    # Every block a running request holds is 'u' and owned by a running request; no other is.
    held = {b for r in s.running for b in s.kv.block_table(r)}
    assert {i for i, c in enumerate(snap.blocks) if c == "u"} == held
    assert all((snap.block_owner[i] >= 0) == (i in held) for i in range(16))
    assert snap.requests[0].num_blocks == len(s.kv.block_table(s.running[0]))
    assert snap.requests[2].num_computed_tokens == 0 and snap.requests[2].waited_s >= 0
    # Once everything finishes, the prefix blocks stay cached ('c') and the rest are empty.
    trace = StepTrace()
    _run(s, trace)
    final = take_snapshot(s, 99, 1.0)
    assert final.requests == () and "u" not in final.blocks
    assert final.blocks.count("c") == len(s.kv.pool._cached) > 0
    assert final.prefix_cache_hits > 0


def test_step_records_count_tokens_preemptions_and_swaps():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                       preemption_mode="swap", swap_blocks=8)  # fmt: skip
    s.add_request(make_request("a", prompt_len=8, max_tokens=8, arrival=1.0))
    s.add_request(make_request("b", prompt_len=8, max_tokens=8, arrival=2.0))
    sink = io.StringIO()
    trace = StepTrace(sink=sink)
    snapshots = _run(s, trace)
    recs = list(trace.records)
    assert [r.step for r in recs] == list(range(1, len(recs) + 1))
    assert recs[0].num_prefill_tokens == 16 and recs[0].num_decode_tokens == 0
    assert sum(r.num_prefill_tokens + r.num_decode_tokens for r in recs) == 16 + 2 * 7
    assert all(r.num_prefill_tokens + r.num_decode_tokens <= r.token_budget for r in recs)
    out_steps = [r for r in recs if r.swapped_out_blocks]
    assert out_steps and out_steps[0].preempted == ("b",)
    assert sum(r.swapped_out_blocks for r in recs) == sum(r.swapped_in_blocks for r in recs)
    # While b is swapped out the snapshot says so and counts its host slots.
    swapped = [snap for snap in snapshots if any(v.state == "swapped" for v in snap.requests)]
    assert swapped and all(snap.num_swapped_blocks > 0 for snap in swapped)
    assert trace.since(recs[-3].step) == recs[-2:]
    # The sink got one JSON line per step with both parts.
    lines = [json.loads(x) for x in sink.getvalue().splitlines()]
    assert [x["step"]["step"] for x in lines] == [r.step for r in recs]
    assert len(lines[0]["snapshot"]["blocks"]) == 6


def test_read_trace_round_trips(tmp_path):
    s = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=2)
    s.add_request(make_request("a", prompt_len=5, max_tokens=2))
    path = tmp_path / "t.jsonl"
    with path.open("w") as f:
        _run(s, StepTrace(sink=f))
    lines = read_trace(path)
    assert [x["step"]["step"] for x in lines] == [1, 2]
    assert lines[0]["snapshot"]["requests"][0]["request_id"] == "a"
