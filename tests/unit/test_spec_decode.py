"""Speculative decoding without a model: proposals, scheduling, rollback, and the sampler's
verification rule (greedy exactness and rejection sampling's distribution)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from infer.config import EngineConfig, SpeculativeConfig
from infer.core.messages import SampledToken
from infer.core.request import Request, RequestStatus
from infer.core.sampling_params import SamplingParams
from infer.runner.sampler import Sampler
from infer.spec_decode import ProposalLengths
from infer.spec_decode.ngram import NgramProposer, propose_ngram

from ._factories import fake_sample, make_request, make_scheduler

# ---- n-gram proposals --------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_matching_suffix():
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 1, 2, 6, 7, 3, 6, 7]
    # suffix "6 7": latest earlier match at 7 -> what followed: 3 6 7
    assert propose_ngram(tokens, 3, 1, 2) == [3, 6, 7]
    # suffix "3 6 7" has no earlier match; "6 7" does
    assert propose_ngram(tokens, 2, 2, 3) == [3, 6]
    # the latest match with k tokens after it wins over a later one with fewer
    assert propose_ngram([4, 1, 2, 3, 9, 4], 3, 1, 1) == [1, 2, 3]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([8], 3, 1, 3) == []


def test_ngram_proposer_respects_max_tokens_and_skips_constrained_requests():
    from infer.core.structured import StructuredOutputs

    proposer = NgramProposer(4, 1, 3)
    r = make_request("a", prompt=[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], max_tokens=3)
    assert proposer.propose([r]) == {"a": [3, 4]}  # room for 3 tokens: 2 proposals + 1
    # penalties apply to verify rows (the sampler's business): proposed to as any other
    penalized = Request("p", [1, 2, 1, 2], SamplingParams(max_tokens=9, repetition_penalty=1.2))
    assert proposer.propose([penalized]) == {"p": [1, 2]}
    constrained = Request("c", [1, 2, 1, 2], SamplingParams(
        max_tokens=9, structured_outputs=StructuredOutputs(regex="[0-9]+")))  # fmt: skip
    assert proposer.propose([constrained]) == {}


# ---- scheduling and rollback -------------------------------------------------------------------


def _verify_as(accept: int):
    """A fake runner that accepts the first ``accept`` proposals and then samples token 50."""

    def sample(out):
        result = {}
        for c in out.chunks:
            if not c.sample:
                continue
            if c.num_spec_tokens:
                kept = c.spec_token_ids[:accept]
                result[c.request_id] = [SampledToken(t) for t in kept] + [SampledToken(50)]
            else:
                result[c.request_id] = SampledToken(50)
        return result

    return sample


@pytest.mark.parametrize("accept", [0, 1, 3])
def test_a_proposal_runs_as_one_chunk_and_rejected_kv_is_rolled_back(accept):
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    r = make_request("r", prompt_len=6, max_tokens=20)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))  # prefill: 6 computed, 7 tokens
    assert (r.num_computed_tokens, r.num_tokens) == (6, 7)
    s.add_proposals({"r": [11, 12, 13]})
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.token_ids == [r.all_token_ids[-1], 11, 12, 13]
    assert chunk.num_spec_tokens == 3 and chunk.sample
    assert out.num_decode_tokens == 4 and out.num_prefill_tokens == 0
    assert len(s.kv.block_table(r)) == 3  # 10 tokens' worth allocated
    s.update_from_output(out, _verify_as(accept)(out))
    assert r.output_token_ids[1:] == [11, 12, 13][:accept] + [50]
    # The last token and the accepted proposals have KV; the sampled one is next to run.
    assert r.num_computed_tokens == 7 + accept
    assert r.num_tokens == r.num_computed_tokens + 1
    assert len(s.kv.block_table(r)) == -(-r.num_computed_tokens // 4)  # surplus freed
    c = s.counters
    assert (c.spec_drafts, c.spec_draft_tokens, c.spec_accepted_tokens) == (1, 3, accept)
    assert c.spec_accepted_per_position == [1 if i < accept else 0 for i in range(3)]
    assert r.spec_token_ids == []  # proposals are for one step
    s.finish_request("r", RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 32


def test_proposals_are_clipped_by_max_tokens_and_the_token_budget():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=3)
    r = make_request("r", prompt_len=3, max_tokens=4)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    s.add_proposals({"r": [11, 12, 13, 14, 15]})
    assert r.spec_token_ids == [11, 12]  # 1 token out, 3 to go: 2 proposals + 1 sampled
    out = s.schedule()
    assert out.chunks[0].num_spec_tokens == 2 and out.num_batched_tokens == 3
    s.update_from_output(out, _verify_as(2)(out))
    assert r.num_output_tokens == 4 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.kv.num_free_blocks == 32


def test_a_stop_token_among_accepted_proposals_ends_the_output_there():
    s = make_scheduler(num_blocks=32, block_size=4)
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[12]))
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    s.add_proposals({"r": [11, 12, 13]})
    out = s.schedule()
    s.update_from_output(out, _verify_as(3)(out))
    assert r.output_token_ids[1:] == [11, 12] and r.stop_reason == 12
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert s.counters.generation_tokens == 3
    assert s.kv.num_free_blocks == 32


def test_finish_with_a_cut_drops_tokens_past_a_stop_string():
    s = make_scheduler()
    r = make_request("r", prompt_len=3, max_tokens=10)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))
    s.add_proposals({"r": [11, 12]})
    out = s.schedule()
    s.update_from_output(out, _verify_as(2)(out))
    assert r.num_output_tokens == 4
    s.stop_at_string(r, num_output_tokens=2)
    assert r.output_token_ids[1:] == [11] and len(r.timings.token_times) == 2
    assert s.counters.generation_tokens == 2


# ---- verification --------------------------------------------------------------------------------


def _request(rid: str, **params) -> Request:
    return Request(rid, [1, 2], SamplingParams(max_tokens=50, **params))


def test_greedy_verification_accepts_exactly_the_argmax_run():
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 4, 6, 7]):
        logits[row, best] = 5.0
    sampler = Sampler()
    req = _request("g", temperature=0.0)
    (all_in,) = sampler.verify(logits, [req], [[3, 4, 6]])
    assert [t.token_id for t in all_in] == [3, 4, 6, 7]  # all accepted + the bonus
    (cut,) = sampler.verify(logits, [req], [[3, 5, 6]])
    assert [t.token_id for t in cut] == [3, 4]  # 5 rejected: the argmax replaces it


def test_rejection_sampling_keeps_the_target_distribution():
    """The first emitted token follows the target's (filtered) distribution whatever is proposed:
    a chi-square test on a 5-token vocabulary, 4000 draws per case."""
    torch.manual_seed(0)
    target_logits = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.5])
    n = 4000
    cases = [
        (dict(temperature=1.0), 0),  # proposal is a likely token
        (dict(temperature=1.0), 4),  # an unlikely one
        (dict(temperature=0.7, top_k=3), 2),  # one the filter removes
    ]
    for params, proposal in cases:
        probs = torch.softmax(target_logits / params["temperature"], dim=-1)
        if "top_k" in params:
            keep = probs.topk(params["top_k"]).indices
            probs = torch.zeros_like(probs).index_fill(0, keep, 1.0) * probs
            probs = probs / probs.sum()
        requests = [_request(f"r{i}", seed=i, **params) for i in range(n)]
        logits = target_logits.repeat(2 * n, 1)  # 2 rows each: proposal row and bonus row
        results = Sampler().verify(logits, requests, [[proposal]] * n)
        first = torch.tensor([r[0].token_id for r in results])
        counts = torch.bincount(first, minlength=5).double()
        expected = probs.double() * n
        assert counts[expected == 0].sum() == 0, "drew a token the target gives no mass"
        mask = expected > 0
        chi2 = float((((counts - expected) ** 2)[mask] / expected[mask]).sum())
        assert chi2 < 20.5, (params, proposal, counts.tolist(), expected.tolist())  # p ~ 0.0004
        accepted = sum(len(r) == 2 for r in results)
        assert abs(accepted / n - float(probs[proposal])) < 0.04


def test_verification_with_min_tokens_masks_stop_ids_per_position():
    logits = torch.zeros(3, 6)
    logits[:, 0] = 9.0  # the stop id is every row's argmax
    logits[:, 2] = 8.0
    req = Request("m", [1], SamplingParams(max_tokens=9, temperature=0, min_tokens=3),
                  eos_token_ids=(0,))  # fmt: skip
    req.output_token_ids = [4]
    (tokens,) = Sampler().verify(logits, [req], [[2, 0]])
    # position 0 (2nd token) and 1 (3rd) are still under min_tokens: 0 is masked, 2 wins;
    # the proposal 0 at position 1 is therefore rejected for 2.
    assert [t.token_id for t in tokens] == [2, 2]


# ---- configuration ---------------------------------------------------------------------------------


def test_speculative_config_parses_vllm_json_and_names_what_is_wrong():
    cfg = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, '
        '"prompt_lookup_min": 2}'
    )
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 4, 5)
    draft = SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2})
    assert draft.method == "draft_model" and draft.model == "/m"
    bad = {
        "{not json": "not valid JSON",
        "[1, 2]": "must be a JSON object",
        json.dumps({"method": "medusa", "num_speculative_tokens": 2}): "'medusa' is unknown",
        json.dumps({"method": "ngram", "num_speculative_tokens": 0}): ">= 1",
        json.dumps({"method": "ngram"}): "needs num_speculative_tokens",
        json.dumps({"num_speculative_tokens": 2, "lookahead": 3}): "'lookahead'",
        json.dumps(
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 5,
                "prompt_lookup_max": 2,
            }
        ): "prompt_lookup_min",  # fmt: skip
        json.dumps({"method": "draft_model", "num_speculative_tokens": 2}): '"model"',
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            SpeculativeConfig.parse(text)
    assert EngineConfig.from_kwargs(speculative_config=draft).speculative == draft


def test_incremental_ngram_index_gives_the_same_proposals_as_a_full_search():
    gen = random.Random(0)
    proposer = NgramProposer(3, 2, 4, adaptive=False)
    for trial in range(20):
        prompt = [gen.randrange(6) for _ in range(gen.randrange(1, 40))]
        r = Request(f"r{trial}", prompt, SamplingParams(max_tokens=500, temperature=0))
        for _ in range(60):
            got = proposer.propose([r]).get(r.request_id, [])
            assert got == propose_ngram(r.all_token_ids, 3, 2, 4)
            r.output_token_ids.extend(gen.randrange(6) for _ in range(gen.randrange(1, 4)))
        proposer.forget(r.request_id)
    assert proposer._indexes == {}


def test_proposal_length_halves_after_rejections_and_recovers_after_an_acceptance():
    lengths = ProposalLengths(4)
    r = make_request("r", prompt_len=4, max_tokens=100)
    assert lengths.next(r) == 4
    for expected, accepted in [(2, False), (1, False), (1, False), (4, True), (2, False)]:
        lengths.record(r, [7, 8], lengths.next(r))
        r.output_token_ids.append(7 if accepted else 9)  # the verified token
        assert lengths.next(r) == expected
    assert ProposalLengths(4, adaptive=False).next(r) == 4


def test_blocks_completed_by_accepted_proposals_are_cached_under_their_tokens():
    """A block filled by accepted proposals is hashed over its own four tokens: a later
    request with the same leading tokens hits it (and the block before)."""
    s = make_scheduler(num_blocks=32, block_size=4, prefix=True)
    r = make_request("r", prompt=[5, 6, 7], max_tokens=20)
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {"r": SampledToken(8)})  # 4 tokens: block 0 is full
    s.add_proposals({"r": [9, 10, 11, 12]})
    out = s.schedule()
    s.update_from_output(out, _verify_as(4)(out))  # 8, 9..12 in cache; 50 sampled
    assert r.all_token_ids == [5, 6, 7, 8, 9, 10, 11, 12, 50]
    twin = make_request("t", prompt=[5, 6, 7, 8, 9, 10, 11, 12, 1], max_tokens=2)
    s.add_request(twin)
    out = s.schedule()
    assert twin.num_cached_tokens == 8  # both full blocks found
    s.finish_request("r", RequestStatus.FINISHED_ABORTED)
    s.finish_request("t", RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 32


def test_proposals_never_cost_a_preemption():
    """With room for one more token each but not for proposals, both requests decode plainly
    instead of one preempting the other."""
    s = make_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=64)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, prompt_len=2, max_tokens=10))
    out = s.schedule()
    s.update_from_output(out, fake_sample(out))  # each: 2 computed, 3 tokens, 1 block
    s.add_proposals({"a": [1, 2, 3], "b": [1, 2, 3]})
    out = s.schedule()
    assert {c.request_id: c.num_spec_tokens for c in out.chunks} == {"a": 0, "b": 0}
    assert s.counters.preemptions == 0
