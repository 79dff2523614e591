"""Workload generators: counts, length ranges, arrival processes, prompts, scaling, clipping."""

from __future__ import annotations

import random
import statistics

import pytest

from infer.bench.workloads import (
    WORKLOADS,
    LengthBand,
    TextSource,
    WorkloadSpec,
    arrival_times,
    build_requests,
    resolve_workloads,
    scale_workload,
)

# A synthetic word stream: every word distinct, so prompts can be located in it.
WORDS = [f"w{i}" for i in range(5000)]


def source(wpt: float = 1.0) -> TextSource:
    return TextSource(words=WORDS, words_per_token=wpt)


def test_workload_table():
    """The table of docs/benchmarks.md: names, counts, ranges, arrival patterns and rates."""
    assert list(WORKLOADS) == [
        "baseline",
        "continuous_batching",
        "paged_attention",
        "chunked_prefill",
        "prefix_caching",
    ]
    got = {
        n: (s.num_requests, s.arrival, s.rate, s.output_band.low, s.output_band.high)
        for n, s in WORKLOADS.items()
    }
    assert got == {
        "baseline": (10, "sequential", None, 256, 256),
        "continuous_batching": (32, "uniform", 4.0, 64, 256),
        "paged_attention": (48, "burst", None, 128, 256),
        "chunked_prefill": (48, "poisson", 6.0, 64, 256),
        "prefix_caching": (48, "uniform", 8.0, 256, 256),
    }
    cp = WORKLOADS["chunked_prefill"].prompt_bands
    assert [(b.low, b.high, b.weight) for b in cp] == [(1024, 2048, 0.75), (64, 128, 0.25)]
    assert WORKLOADS["prefix_caching"].shared_prefix_len == 1024
    assert resolve_workloads("all") == list(WORKLOADS.values())
    assert resolve_workloads("baseline") == [WORKLOADS["baseline"]]
    with pytest.raises(ValueError):
        resolve_workloads("nope")


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_requests_respect_counts_and_ranges(name):
    spec = WORKLOADS[name]
    wl = build_requests(spec, seed=42, source=source())
    assert len(wl.requests) == spec.num_requests
    assert [r.index for r in wl.requests] == list(range(spec.num_requests))
    lows = min(b.low for b in spec.prompt_bands) + spec.shared_prefix_len
    highs = max(b.high for b in spec.prompt_bands) + spec.shared_prefix_len
    for r in wl.requests:
        assert lows <= r.prompt_len <= highs
        assert spec.output_band.low <= r.max_tokens <= spec.output_band.high
        # words_per_token = 1: the prompt has exactly the targeted number of words
        assert len(r.prompt.split()) == r.prompt_len
        assert not r.clipped
    assert wl.notes == ()


def test_same_seed_same_requests_other_seed_differs():
    spec = WORKLOADS["continuous_batching"]
    a = build_requests(spec, seed=42, source=source())
    b = build_requests(spec, seed=42, source=source())
    c = build_requests(spec, seed=43, source=source())
    assert a.requests == b.requests
    assert [r.prompt for r in a.requests] != [r.prompt for r in c.requests]
    assert [r.prompt_len for r in a.requests] != [r.prompt_len for r in c.requests]


def test_one_workload_alone_equals_the_same_inside_all():
    # Seeding per workload name: running one workload never depends on which ran before.
    alone = build_requests(WORKLOADS["paged_attention"], seed=5, source=source())
    _ = build_requests(WORKLOADS["baseline"], seed=5, source=source())
    again = build_requests(WORKLOADS["paged_attention"], seed=5, source=source())
    assert alone.requests == again.requests


def test_uniform_arrivals_are_evenly_spaced():
    spec = WORKLOADS["continuous_batching"]
    times = arrival_times(spec, random.Random(0))
    assert times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert gaps == pytest.approx([0.25] * (spec.num_requests - 1))


def test_burst_and_sequential_all_at_zero():
    for name in ("paged_attention", "baseline"):
        assert set(arrival_times(WORKLOADS[name], random.Random(0))) == {0.0}


def test_poisson_arrivals_have_exponential_gaps_with_the_rate():
    spec = WorkloadSpec("p", 4000, (LengthBand(1, 1),), LengthBand(1, 1), "poisson", rate=6.0)
    times = arrival_times(spec, random.Random(42))
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 6.0, rel=0.06)  # 4000 samples: std error ~1.6%
    # exponential: the standard deviation equals the mean (coefficient of variation 1)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.08)
    assert times == arrival_times(spec, random.Random(42))
    assert times != arrival_times(spec, random.Random(43))


def test_chunked_prefill_mixture_is_about_three_quarters_long():
    spec = scale_workload(WORKLOADS["chunked_prefill"], 1.0)
    spec = WorkloadSpec(
        spec.name, 2000, spec.prompt_bands, spec.output_band, spec.arrival, rate=spec.rate
    )
    wl = build_requests(spec, seed=1, source=source(wpt=0.01))  # short texts: fast
    long = sum(r.prompt_len >= 1024 for r in wl.requests)
    short = sum(64 <= r.prompt_len <= 128 for r in wl.requests)
    assert long + short == 2000
    assert long / 2000 == pytest.approx(0.75, abs=0.04)


def test_prefix_caching_prompts_share_exactly_the_prefix():
    spec = WORKLOADS["prefix_caching"]
    wl = build_requests(spec, seed=42, source=source())
    heads = {tuple(r.prompt.split()[:1024]) for r in wl.requests}
    assert len(heads) == 1
    tails = [r.prompt.split()[1024:] for r in wl.requests]
    assert all(32 <= len(t) <= 128 for t in tails)
    assert len({tuple(t) for t in tails}) == len(tails)  # unique suffixes


def test_other_workloads_do_not_share_prompt_starts():
    wl = build_requests(WORKLOADS["paged_attention"], seed=42, source=source())
    starts = [r.prompt.split()[0] for r in wl.requests]
    assert len(set(starts)) > len(starts) * 0.9


def test_scale_shrinks_counts_and_lengths_proportionally():
    spec = scale_workload(WORKLOADS["chunked_prefill"], 0.5)
    assert spec.num_requests == 24
    assert [(b.low, b.high) for b in spec.prompt_bands] == [(512, 1024), (32, 64)]
    assert (spec.output_band.low, spec.output_band.high) == (32, 128)
    assert spec.rate == 6.0  # rates change only with rate_scale
    pc = scale_workload(WORKLOADS["prefix_caching"], 0.25, rate_scale=0.5)
    assert (pc.num_requests, pc.shared_prefix_len, pc.rate) == (12, 256, 4.0)
    tiny = scale_workload(WORKLOADS["baseline"], 0.01)
    assert tiny.num_requests == 2 and tiny.output_band.low >= 2 and tiny.prompt_bands[0].low >= 4
    assert scale_workload(WORKLOADS["baseline"], 1.0) is WORKLOADS["baseline"]
    with pytest.raises(ValueError):
        scale_workload(WORKLOADS["baseline"], 0)


def test_requests_are_clipped_to_the_context_window():
    spec = WORKLOADS["chunked_prefill"]
    wl = build_requests(spec, seed=42, source=source(), max_model_len=1024)
    for r in wl.requests:
        assert r.prompt_len + r.max_tokens <= 1024
    assert any(r.clipped for r in wl.requests) and any(not r.clipped for r in wl.requests)
    assert wl.notes and "max_model_len=1024" in wl.notes[0]
    # prefix + output larger than a small context: prefix and output shrink too
    pc = build_requests(WORKLOADS["prefix_caching"], seed=42, source=source(), max_model_len=256)
    for r in pc.requests:
        assert r.prompt_len + r.max_tokens <= 256 and r.clipped
    heads = {tuple(r.prompt.split("\n\n")[0].split()) for r in pc.requests}
    assert len(heads) == 1  # still one shared prefix


def test_text_source_with_a_tokenizer_hits_the_target_exactly():
    # a "tokenizer" that makes two tokens of every word
    counter = lambda text: 2 * len(text.split())  # noqa: E731
    src = TextSource(words=WORDS, count_tokens=counter, words_per_token=0.75)
    rng = random.Random(0)
    for n in (10, 64, 301):
        assert src.passage(n, rng) and counter(src.passage(n, rng)) in (n, n - 1)
    assert src.estimate_tokens("a b c") == 6


def test_text_source_default_is_real_english():
    src = TextSource()
    text = src.passage(200, random.Random(1))
    assert len(text.split()) == 150  # 0.75 words per token
    common = {"the", "of", "a", "is", "to", "and"}
    assert common & set(text.lower().split())


def test_spec_validation():
    with pytest.raises(ValueError):
        WorkloadSpec("x", 1, (LengthBand(1, 2),), LengthBand(1, 2), "uniform")  # no rate
    with pytest.raises(ValueError):
        WorkloadSpec("x", 0, (LengthBand(1, 2),), LengthBand(1, 2), "burst")
    with pytest.raises(ValueError):
        LengthBand(5, 4)
    d = WORKLOADS["chunked_prefill"].describe()
    assert d["prompt_bands"][0] == {"low": 1024, "high": 2048, "weight": 0.75}
