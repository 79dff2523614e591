"""The micro-benchmark harness on a real engine (tiny GPT-2) and the suites' case builders."""

from __future__ import annotations

import random

import pytest

from infer.bench.cli import checkout_benchmark

micro = checkout_benchmark("micro")  # benchmarks/micro/: outside the package
SUITES, run_suite = micro.SUITES, micro.run_suite
common = checkout_benchmark("micro.common")
MicroRequest, make_engine, median_run, run_engine = (
    common.MicroRequest,
    common.make_engine,
    common.median_run,
    common.run_engine,
)

WORDS = [f"word{i}" for i in range(500)]


class CharTok:
    """Stand-in tokenizer for the case builders: one id per character."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + (ord(c) % 90) for c in text]


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    return make_engine(str(tiny_checkpoints["gpt2"]), max_num_seqs=4, block_size=4)


def test_run_engine_times_every_token(engine):
    reqs = [
        MicroRequest(tuple(range(5, 13)), 6, tag="a"),
        MicroRequest(tuple(range(20, 30)), 4, tag="b"),
    ]
    run = run_engine(engine, reqs)
    assert (run.configured, run.completed, run.tokens) == (2, 2, 10)
    for rec, req in zip(run.records, reqs, strict=True):
        assert rec.num_output_tokens == req.max_tokens == len(rec.token_times)
        assert rec.finish_reason == "length" and rec.completed
        assert 0 < rec.ttft_s <= rec.latency_s
        assert rec.token_times == sorted(rec.token_times)
    assert run.tokens_per_s == pytest.approx(10 / run.wall_time_s)
    assert run.max_gap_ms("a") >= run.avg_gap_ms("a") > 0
    assert run.steps >= 6
    s = run.summary()
    assert s["completed"] == 2 and s["stats"]["generation_tokens_total"] == 10


def test_late_arrivals_and_sequential_requests(engine):
    reqs = [
        MicroRequest(tuple(range(5, 9)), 8, tag="early"),
        MicroRequest(tuple(range(9, 13)), 2, arrive_step=5, tag="late"),
    ]
    run = run_engine(engine, reqs)
    early, late = run.records
    # the late request was added after five steps had produced tokens for the early one
    assert sum(t < late.arrival for t in early.token_times) >= 4
    seq = [MicroRequest(tuple(range(5 + i, 10 + i)), 3, after_previous=True) for i in range(3)]
    run = run_engine(engine, seq)
    for a, b in zip(run.records, run.records[1:], strict=False):
        assert b.arrival >= a.finished


def test_median_run_is_a_real_run(engine):
    runs = [run_engine(engine, [MicroRequest((5, 6, 7), 2)]) for _ in range(3)]
    m = median_run(runs)
    assert m in runs
    assert sorted(r.wall_time_s for r in runs)[1] == m.wall_time_s


def test_case_builders_fit_the_toy_context():
    from benchmarks.micro import batching, chunked_prefill, kv_cache, scheduling

    rng = random.Random(0)
    tok = CharTok()
    assert [c[0] for c in kv_cache.CASES] == [
        "small_smoke_test",
        "medium_generation",
        "longer_generation",
        "heavier_prompt",
        "near_context_limit",
    ]
    assert all(p + n <= 64 for _, p, n in kv_cache.CASES)
    assert all(p + n <= 64 for *_, p, n in batching.CASES)
    assert [(c[1], c[2]) for c in batching.CASES] == [
        (8, 4),
        (16, 4),
        (16, 8),
        (16, 8),
        (16, 8),
        (32, 8),
    ]
    for c in chunked_prefill.CASES:
        reqs = chunked_prefill.requests_for(c, tok, rng, WORDS)
        assert all(len(r.prompt_ids) + r.max_tokens <= 64 for r in reqs)
        assert sorted({r.tag for r in reqs}) == ["decode", "long"]
    knobs = {c.name: (c.chunk, c.budget) for c in chunked_prefill.CASES}
    assert knobs["smaller_chunks_smoother_decode"] == (4, 16)
    assert knobs["larger_chunks_less_overhead"] == (16, 32)
    params = {c.name: (c.max_batch, c.budget, c.chunk, c.kv_tokens) for c in scheduling.CASES}
    assert params["priority_inversion_serial"] == (1, 12, 10, 40)
    assert params["priority_mix_small_batch"] == (4, 16, 8, 64)
    assert params["memory_pressure_preemption"] == (3, 12, 8, 32)
    for c in scheduling.CASES:
        reqs = scheduling.requests_for(c, tok, rng, WORDS)
        assert all(len(r.prompt_ids) + r.max_tokens <= c.kv_tokens for r in reqs)
        assert {r.priority for r in reqs} == ({0} if c.equal else {0, 1})


def test_prefix_cases_keep_their_token_totals():
    from benchmarks.micro import prefix_cache

    tok = CharTok()
    totals = {}
    for c in prefix_cache.CASES:
        reqs = prefix_cache.requests_for(c, tok, random.Random(1), WORDS)
        totals[c.name] = (len(reqs), sum(len(r.prompt_ids) for r in reqs))
        heads = {r.prompt_ids[: c.prefix or 16] for r in reqs}
        assert len(heads) == (c.groups if c.groups else len(reqs))
        assert all(r.after_previous for r in reqs)
    assert totals == {
        "shared_prefix_basic": (8, 192),
        "high_reuse_many_requests": (24, 672),
        "multi_prefix_groups": (24, 576),
        "low_reuse_control": (8, 192),
        "eviction_pressure": (24, 576),
    }


def test_unknown_suite_is_refused():
    assert set(SUITES) == {"kv-cache", "batching", "chunked-prefill", "scheduling", "prefix-cache"}
    with pytest.raises(ValueError):
        run_suite("nope", "m")


def test_requests_with_priorities_run_under_both_policies(engine, tiny_checkpoints):
    """The scheduling suite runs each case's requests (some of them urgent) under fcfs too: an
    fcfs engine refuses a priority, so there they run without theirs."""
    reqs = [MicroRequest(tuple(range(5, 9)), 3, priority=1),
            MicroRequest(tuple(range(9, 13)), 2, priority=-2)]  # fmt: skip
    assert run_engine(engine, reqs).completed == 2
    urgent = make_engine(str(tiny_checkpoints["gpt2"]), max_num_seqs=4, block_size=4,
                         scheduling_policy="priority")  # fmt: skip
    assert run_engine(urgent, reqs).completed == 2
