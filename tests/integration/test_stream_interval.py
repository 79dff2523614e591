"""``--stream-interval N``: a request's output goes out every N tokens (its first token and its
end at once), and what the deltas add up to is exactly what every-token streaming gives."""

from __future__ import annotations

import re

import pytest

from infer import SamplingParams
from infer.core.outputs import RequestOutput
from infer.core.structured import StructuredOutputs
from infer.engine.detokenizer import IncrementalDetokenizer

from .conftest import PROMPTS


def _deltas(
    llm, params: list[SamplingParams], prompts: list[str] = PROMPTS
) -> dict[str, list[RequestOutput]]:
    """Every output the engine emitted, per request, stepping it by hand."""
    engine = llm.engine
    tokenizer = engine.tokenizer
    out: dict[str, list[RequestOutput]] = {}
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", tokenizer.encode(prompts[i % len(prompts)]), p)
        out[f"r{i}"] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].append(o)
    return out


def _joined(deltas: list[RequestOutput]) -> tuple:
    last = deltas[-1]
    return (
        [t for d in deltas for t in d.new_token_ids],
        "".join(d.new_text for d in deltas),
        [lp for d in deltas for lp in (d.new_logprobs or [])],
        last.finish_reason,
        last.stop_reason,
        last.num_output_tokens,
        len(last.timings.token_times),
    )


def test_outputs_go_out_every_n_tokens_and_add_up_to_every_token_streaming(make_llm):
    greedy = SamplingParams(max_tokens=23, temperature=0, ignore_eos=True, logprobs=2)
    every = _deltas(make_llm("llama"), [greedy] * 3)
    llm = make_llm("llama", stream_interval=5)
    held = _deltas(llm, [greedy] * 3)
    for rid, deltas in held.items():
        # The first token at once, then 5 at a time; the end (23 = 1 + 4 * 5 + 2) at once.
        assert [len(d.new_token_ids) for d in deltas] == [1, 5, 5, 5, 5, 2], rid
        assert [d.finished for d in deltas] == [False] * 5 + [True]
        assert [d.num_output_tokens for d in deltas] == [1, 6, 11, 16, 21, 23]
        assert _joined(deltas) == _joined(every[rid])
        assert len(every[rid]) == 23


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_string_ends_a_held_back_request_at_the_token_that_completed_it(
    make_llm, include_stop
):
    plain = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    text = _joined(_deltas(make_llm("llama"), [plain], [PROMPTS[1]])["r0"])[1]
    stop = text[8:12]
    assert stop and stop in text
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=include_stop)  # fmt: skip
    every = _deltas(make_llm("llama"), [params] * 2, [PROMPTS[1]])
    llm = make_llm("llama", stream_interval=8)
    held = _deltas(llm, [params] * 2, [PROMPTS[1]])
    for rid, deltas in held.items():
        assert _joined(deltas) == _joined(every[rid])
        assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
        assert len(deltas) < len(every[rid])
    # Not one token past the stop string was computed (it ended when it met it).
    counters = llm.engine.scheduler.counters
    assert counters.generation_tokens == sum(d[-1].num_output_tokens for d in every.values())


def test_aborting_a_held_back_request_sends_what_it_held(make_llm):
    llm = make_llm("llama", stream_interval=100)
    engine = llm.engine
    engine.add_request("a", engine.tokenizer.encode(PROMPTS[0]),
                       SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))  # fmt: skip
    seen: list[RequestOutput] = []
    while not seen:
        seen.extend(engine.step())
    for _ in range(6):  # six more tokens, held back
        seen.extend(engine.step())
    assert [len(o.new_token_ids) for o in seen] == [1]
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    final = seen[-1]
    assert len(seen) == 2 and final.finished and final.finish_reason == "abort"
    assert len(final.new_token_ids) == final.num_output_tokens - 1 >= 6


def test_a_constrained_request_held_back_follows_its_grammar(make_llm):
    spec = StructuredOutputs(regex=r"(\+|-)?[0-9]{1,3}\.[0-9]{2} (EUR|USD)")
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=spec)
              for s in range(4)]  # fmt: skip
    every = _deltas(make_llm("llama"), params)
    held = _deltas(make_llm("llama", stream_interval=3), params)
    for rid, deltas in held.items():
        assert _joined(deltas) == _joined(every[rid])
        assert re.fullmatch(spec.regex, _joined(deltas)[1]), _joined(deltas)[1]


@pytest.mark.parametrize("interval", [1, 100])
def test_text_that_cannot_be_made_at_the_end_ends_the_request_with_an_error(
    make_llm, monkeypatch, interval
):
    """A detokenization failure on a request's last tokens (at an interval, all it held back)
    is the request's error, not text silently missing from an answer that ends as usual."""
    real = IncrementalDetokenizer.add_tokens

    def failing_at_the_end(self, token_ids):
        if self.num_output_tokens + len(token_ids) >= 10:
            raise ValueError("undecodable")
        return real(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", failing_at_the_end)
    llm = make_llm("llama", stream_interval=interval)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    deltas = _deltas(llm, [params])["r0"]
    final = deltas[-1]
    assert final.finished and final.finish_reason == "error"
    assert final.error == "detokenization failed: undecodable"
    assert llm.engine.scheduler.counters.finished == {"error": 1}


def test_the_stream_interval_is_checked(make_llm):
    with pytest.raises(ValueError, match="stream_interval must be positive"):
        make_llm("llama", stream_interval=0)
