"""The sampler on hand-built logits: each parameter's exact effect on what can be drawn."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from infer.core.request import Request
from infer.core.sampling_params import SamplingParams
from infer.runner.sampler import Sampler

from ._factories import EOS

# Logits whose softmax is exactly these probabilities (log p, and softmax(log p) = p).
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor(PROBS).log()


def req(
    rid: str = "r",
    *,
    prompt: tuple[int, ...] = (3,),
    output: tuple[int, ...] = (),
    **params,
) -> Request:
    params.setdefault("max_tokens", 16)
    r = Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=(EOS,))
    r.output_token_ids = list(output)
    return r


def draw(logits: torch.Tensor, n: int = 2000, seed: int = 0, **params) -> Counter:
    """Token counts of ``n`` independent draws from one logits row under ``params``."""
    requests = [req(f"r{i}", **params) for i in range(n)]
    out = Sampler(seed=seed).sample(logits.expand(n, -1), requests)
    return Counter(t.token_id for t in out)


def greedy_choice(logits: list[float], **kwargs) -> int:
    return Sampler().sample(torch.tensor([logits]), [req(temperature=0.0, **kwargs)])[0].token_id


# ---- temperature 0 / top-k ------------------------------------------------------------------


def test_temperature_zero_is_argmax():
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(0))
    requests = [req(f"r{i}", temperature=0.0, top_k=5, top_p=0.5, seed=i) for i in range(32)]
    out = Sampler(seed=1).sample(logits, requests)
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()


def test_top_k_draws_only_the_k_best():
    logits = torch.linspace(0.0, 1.0, 10)[
        torch.randperm(10, generator=torch.Generator().manual_seed(0))
    ]
    best3 = set(logits.topk(3).indices.tolist())
    assert set(draw(logits, top_k=3)) == best3


def test_top_k_one_is_greedy():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    requests = [req(f"r{i}", temperature=1.5, top_k=1) for i in range(64)]
    out = Sampler().sample(logits, requests)
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()


def test_top_k_larger_than_vocab_keeps_everything():
    assert set(draw(LOGITS, top_k=100)) == {0, 1, 2, 3}


# ---- top-p ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.45, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}), (0.97, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    # Probabilities 0.5, 0.3, 0.15, 0.05: cumulative 0.5, 0.8, 0.95, 1.0.
    assert set(draw(LOGITS, top_p=top_p)) == kept


def test_top_p_renormalises_what_it_keeps():
    counts = draw(LOGITS, n=4000, top_p=0.7)
    assert counts[0] / 4000 == pytest.approx(0.5 / 0.8, abs=0.04)
    assert counts[1] / 4000 == pytest.approx(0.3 / 0.8, abs=0.04)


def test_top_p_applies_after_temperature():
    # T=0.5 squares the probabilities: 0.685, 0.247, 0.062, 0.007, so 0.6 is reached by token 0.
    assert set(draw(LOGITS, top_p=0.6)) == {0, 1}
    assert set(draw(LOGITS, top_p=0.6, temperature=0.5)) == {0}


def test_top_p_applies_after_top_k():
    # top_k=2 renormalises to 0.625, 0.375, so top_p=0.6 then keeps token 0 only.
    assert set(draw(LOGITS, top_p=0.6, top_k=2)) == {0}


# ---- min-p ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("min_p", "kept"), [(0.2, {0, 1, 2}), (0.35, {0, 1}), (0.7, {0})])
def test_min_p_drops_tokens_below_min_p_times_the_best(min_p, kept):
    # Thresholds 0.1, 0.175 and 0.35 against probabilities 0.5, 0.3, 0.15, 0.05.
    assert set(draw(LOGITS, min_p=min_p)) == kept


def test_min_p_applies_after_temperature():
    # At T=0.5 the probabilities are 0.685, 0.247, 0.062, 0.007: threshold 0.137 drops token 2.
    assert set(draw(LOGITS, min_p=0.2, temperature=0.5)) == {0, 1}


def test_min_p_applies_before_top_p_as_in_vllm():
    # min_p 0.35 keeps tokens 0 and 1 (renormalised: 0.625, 0.375); top_p 0.6 then keeps token
    # 0 only. (top-p first, transformers' order, would keep both.)
    assert set(draw(LOGITS, min_p=0.35, top_p=0.6)) == {0}


# ---- allowed_token_ids ----------------------------------------------------------------------


def test_allowed_token_ids_are_the_only_ones_drawn_in_their_proportions():
    counts = draw(LOGITS, allowed_token_ids=[1, 3])
    assert set(counts) == {1, 3}
    assert abs(counts[1] / 2000 - 0.3 / 0.35) < 0.05  # renormalised: 0.857, 0.143
    assert greedy_choice([2.0, 1.5, 0.0, 0.5], allowed_token_ids=[2, 3]) == 3
    # a batch: a row without the list is untouched
    out = Sampler().sample(LOGITS.expand(2, -1), [req("a", temperature=0.0, allowed_token_ids=[3]),
                                                   req("b", temperature=0.0)])  # fmt: skip
    assert [t.token_id for t in out] == [3, 0]


# ---- penalties ------------------------------------------------------------------------------
# Logits [2.0, 1.5, 0, 0]: token 0 wins unless its penalty brings it below 1.5.


@pytest.mark.parametrize(("penalty", "choice"), [(0.4, 0), (0.6, 1)])
def test_presence_penalty_subtracts_once_whatever_the_count(penalty, choice):
    # Token 0 generated three times: 2.0 - penalty (not 3 * penalty).
    assert greedy_choice([2.0, 1.5, 0, 0], output=(0, 0, 0), presence_penalty=penalty) == choice


@pytest.mark.parametrize(("penalty", "choice"), [(0.15, 0), (0.2, 1)])
def test_frequency_penalty_subtracts_count_times_penalty(penalty, choice):
    # Token 0 generated three times: 2.0 - 3 * penalty = 1.55 or 1.4.
    assert greedy_choice([2.0, 1.5, 0, 0], output=(0, 2, 0, 0), frequency_penalty=penalty) == choice


def test_presence_and_frequency_penalties_add_up():
    # 2.0 - 2 * 0.1 - 0.2 = 1.6 keeps token 0; with presence 0.35: 1.45 loses to 1.5.
    kw = {"output": (0, 0), "frequency_penalty": 0.1}
    assert greedy_choice([2.0, 1.5, 0, 0], presence_penalty=0.2, **kw) == 0
    assert greedy_choice([2.0, 1.5, 0, 0], presence_penalty=0.35, **kw) == 1


def test_presence_and_frequency_ignore_prompt_tokens():
    kw = {"prompt": (0, 0, 0), "output": (2,), "presence_penalty": 2.0, "frequency_penalty": 2.0}
    assert greedy_choice([2.0, 1.5, 0, 0], **kw) == 0


def test_negative_presence_penalty_encourages_repeats():
    assert greedy_choice([2.0, 1.5, 0, 0], output=(1,), presence_penalty=-0.6) == 1


@pytest.mark.parametrize(
    ("where", "penalty", "choice"),
    [
        ("prompt", 1.25, 0),
        ("prompt", 1.5, 1),
        ("output", 1.25, 0),
        ("output", 1.5, 1),
    ],
)
def test_repetition_penalty_divides_a_positive_logit(where, penalty, choice):
    # Token 0 seen in the prompt or the output: 2.0 / 1.25 = 1.6 keeps it; 2.0 / 1.5 = 1.33 not.
    assert greedy_choice([2.0, 1.5, 0, 0], **{where: (0,)}, repetition_penalty=penalty) == choice


@pytest.mark.parametrize(("penalty", "choice"), [(1.1, 0), (1.3, 1)])
def test_repetition_penalty_multiplies_a_negative_logit(penalty, choice):
    # -1.0 * 1.1 = -1.1 still beats -1.2; -1.0 * 1.3 = -1.3 does not (dividing would never lose).
    logits = [-1.0, -1.2, -5.0, -5.0]
    assert greedy_choice(logits, prompt=(0,), repetition_penalty=penalty) == choice


def test_repetition_penalty_counts_a_token_once():
    # Token 0 appears three times, yet 2.0 / 1.25 = 1.6 (not 2.0 / 1.25**3 = 1.02).
    assert greedy_choice([2.0, 1.5, 0, 0], prompt=(0, 0), output=(0,), repetition_penalty=1.25) == 0


def test_repetition_penalty_below_one_boosts_seen_tokens():
    assert greedy_choice([2.0, 1.5, 0, 0], prompt=(1,), repetition_penalty=0.7) == 1


def test_penalties_apply_to_sampled_rows_too():
    # top_k=1 after the penalty: always the penalised winner.
    assert set(
        draw(torch.tensor([2.0, 1.5, 0, 0]), n=50, output=(0,), presence_penalty=0.6, top_k=1)
    ) == {1}


def test_penalties_are_per_request_and_leave_the_logits_untouched():
    logits = torch.tensor([[2.0, 1.5, 0, 0], [2.0, 1.5, 0, 0]])
    before = logits.clone()
    requests = [
        req("a", output=(0,), temperature=0.0, presence_penalty=1.0),
        req("b", output=(0,), temperature=0.0),
    ]
    assert [t.token_id for t in Sampler().sample(logits, requests)] == [1, 0]
    assert torch.equal(logits, before)


# ---- min_tokens -----------------------------------------------------------------------------


def test_min_tokens_masks_eos_until_reached():
    logits = [0.0, 0.0, 0.0, 0.0]
    logits[EOS] = 5.0
    logits[2] = 1.0
    assert greedy_choice(logits, output=(1, 1), min_tokens=3) == 2
    assert greedy_choice(logits, output=(1, 1, 1), min_tokens=3) == EOS


def test_min_tokens_masks_stop_token_ids_and_ignore_eos_unmasks_eos():
    logits = [5.0 if i == EOS else 0.0 for i in range(4)]
    logits[3], logits[2] = 4.0, 1.0
    assert greedy_choice(logits, min_tokens=1, stop_token_ids=[3]) == 2
    assert greedy_choice(logits, min_tokens=1, stop_token_ids=[3], ignore_eos=True) == EOS


def test_min_tokens_holds_eos_back_from_sampling():
    logits = torch.zeros(4)
    logits[EOS] = 3.0
    assert EOS not in draw(logits, min_tokens=1, stop_token_ids=[1])
    assert 1 not in draw(logits, min_tokens=1, stop_token_ids=[1])
    assert EOS in draw(logits, n=50, min_tokens=0)


# ---- seeds ----------------------------------------------------------------------------------


def _sequence(sampler: Sampler, request: Request, batch_before: int = 0, steps: int = 20):
    """The request's draws over ``steps`` calls, with unseeded requests before it in the batch."""
    logits = torch.zeros(batch_before + 1, 50)
    others = [req(f"o{i}") for i in range(batch_before)]
    return [sampler.sample(logits, [*others, request])[-1].token_id for _ in range(steps)]


def test_same_seed_same_draws_whatever_the_batch():
    a = _sequence(Sampler(seed=1), req("x", seed=1234))
    b = _sequence(Sampler(seed=2), req("y", seed=1234), batch_before=3)
    assert a == b
    assert a != _sequence(Sampler(seed=1), req("x", seed=1235))


def test_unseeded_draws_follow_the_engine_seed():
    assert _sequence(Sampler(seed=5), req()) == _sequence(Sampler(seed=5), req())
    assert _sequence(Sampler(seed=5), req()) != _sequence(Sampler(seed=6), req())


def test_forget_restarts_a_seeded_request():
    sampler = Sampler()
    first = _sequence(sampler, req("x", seed=9))
    assert _sequence(sampler, req("x", seed=9)) != first  # same id: its generator carries on
    sampler.forget("x")
    assert _sequence(sampler, req("x", seed=9)) == first


# ---- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits():
    raw = torch.tensor([[2.0, 1.5, 0.5, -1.0]])
    ref = torch.log_softmax(raw[0], dim=-1)
    # The penalty makes token 1 the choice; its logprob and rank are still the raw model's.
    r = req(output=(0,), temperature=0.0, presence_penalty=1.0, logprobs=2)
    lp = Sampler().sample(raw, [r])[0].logprob
    assert lp.token_id == 1 and lp.rank == 2
    assert math.isclose(lp.logprob, ref[1].item(), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [0, 1]
    assert [v for _, v in lp.top] == pytest.approx(ref[:2].tolist(), rel=1e-6)


def test_logprobs_ignore_temperature():
    raw = torch.tensor([[2.0, 1.5, 0.5, -1.0]])
    ref = torch.log_softmax(raw[0], dim=-1)
    tok = Sampler().sample(raw, [req(temperature=0.3, seed=0, logprobs=0)])[0]
    assert tok.logprob.logprob == pytest.approx(ref[tok.token_id].item(), rel=1e-6)
    assert tok.logprob.top == ()


def test_logprobs_only_for_requests_that_ask():
    out = Sampler().sample(LOGITS.expand(2, -1), [req("a", logprobs=1), req("b")])
    assert out[0].logprob is not None and len(out[0].logprob.top) == 1
    assert out[1].logprob is None


# ---- extreme values (found by fuzzing the API: each used to fail its whole batch) ------------


def test_tiny_temperature_is_greedy():
    assert draw(LOGITS, n=50, temperature=5e-324) == Counter({0: 50})


def test_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    assert draw(LOGITS, n=50, temperature=1.0, top_p=5e-324) == Counter({0: 50})


def test_repetition_penalty_near_zero_still_samples_a_token():
    # Token 1 was seen: dividing its positive logit by ~0 makes it (finitely) the only choice.
    logits = torch.tensor([0.5, 1.0, 0.2, -3.0])
    got = draw(logits, n=50, temperature=1.0, repetition_penalty=5e-324, prompt=(1, 3))
    assert got == Counter({1: 50})


def vars_of(r: Request) -> dict:
    p = r.sampling_params
    return dict(repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty)  # fmt: skip


def _penalized_by_hand(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The penalties' definition, row by row from the requests' own lists."""
    out = logits.clone()
    for row, r in enumerate(requests):
        p = r.sampling_params
        if p.repetition_penalty != 1.0:
            for i in set(r.prompt_token_ids + r.output_token_ids):
                x = out[row, i]
                out[row, i] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        counts = Counter(r.output_token_ids)
        for i, c in counts.items():  # in float32, as the kernels compute it
            f, pr = torch.tensor(p.frequency_penalty), torch.tensor(p.presence_penalty)
            out[row, i] -= f * float(c) + pr
    return out


def test_penalties_read_histories_kept_step_by_step():
    """The sampler keeps each request's ids as an array grown a step at a time: the penalties
    it applies equal the definition on the requests' lists, step after step, also after an
    output is cut short and when a finished request's id is taken by a new one."""
    from infer.runner.sampler import TokenHistory, _apply_penalties

    rng = torch.Generator().manual_seed(0)
    vocab = 50
    params = [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.4, presence_penalty=0.2),
        dict(repetition_penalty=0.7, frequency_penalty=0.1),
        dict(),
    ]
    requests = [
        req(f"r{i}", prompt=tuple(torch.randint(0, vocab, (5 + 40 * i,), generator=rng).tolist()),
            **p)
        for i, p in enumerate(params)
    ]  # fmt: skip
    history = TokenHistory()
    for step in range(80):
        logits = torch.randn(len(requests), vocab, generator=rng)
        got = logits.clone()
        _apply_penalties(got, requests, [()] * len(requests), history)
        assert torch.equal(got, _penalized_by_hand(logits, requests)), step
        # verify rows: the proposals before a row count as its output's tail
        before = [tuple(torch.randint(0, vocab, (step % 4,), generator=rng).tolist())
                  for _ in requests]  # fmt: skip
        got = logits.clone()
        _apply_penalties(got, requests, before, history)
        accepted = [req(r.request_id, prompt=tuple(r.prompt_token_ids),
                        output=tuple(r.output_token_ids) + ahead, **vars_of(r))
                    for r, ahead in zip(requests, before, strict=True)]  # fmt: skip
        assert torch.equal(got, _penalized_by_hand(logits, accepted)), step
        for r in requests:
            r.output_token_ids.append(int(torch.randint(0, vocab, (1,), generator=rng)))
        if step == 30:
            del requests[0].output_token_ids[3:]  # a stop string's cut
        if step == 50:  # r1 finished; a new request under its id
            requests[1] = req("r1", prompt=(7, 7, 8), frequency_penalty=0.5)
    history.forget("r0")
    assert "r0" not in history._entries


@pytest.mark.parametrize("vocab", [128256, 32000, 1000, 997])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_in_parts_is_argmax_ties_included(vocab, dtype):
    """The GPU's two-pass argmax of a few rows picks what argmax picks: the first of equal
    maxima, whether they share a run or not (a prime vocabulary takes one pass)."""
    from infer.runner.sampler import argmax_in_parts

    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    x[1] = 0
    x[1, [7, vocab // 2, vocab - 1]] = 3  # ties in different runs
    x[2] = 1  # every token ties
    x[3, vocab - 1] = 100  # the last token
    x[4, :2] = 50  # two ties in the first run
    assert torch.equal(argmax_in_parts(x), x.argmax(dim=-1))


def test_bad_words_and_min_tokens_see_the_proposals_before_a_verify_row():
    """A verify row after proposals ``d1 d2``: a bad word whose start is ``o3 d1 d2`` is banned
    there, and ``min_tokens`` counts the proposals as output."""
    from infer.runner.sampler import NONE_BEFORE, TokenHistory, _apply_penalties

    r = req(output=(4, 5), bad_words_token_ids=((5, 6, 7, 9),), min_tokens=4, stop_token_ids=[2])
    logits = torch.zeros(3, 12)
    _apply_penalties(logits, [r, r, r], [NONE_BEFORE, (6,), (6, 7)], TokenHistory())
    banned = [set(torch.nonzero(row == float("-inf")).flatten().tolist()) for row in logits]
    # row 0: 2 outputs < 4 (EOS, stop id 2 banned); row 1: 3 < 4; row 2: 4 outputs: allowed,
    # and the output ends "5 6 7": the bad word's last token 9 banned
    assert banned == [{EOS, 2}, {EOS, 2}, {9}]
