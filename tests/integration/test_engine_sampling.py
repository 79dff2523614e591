"""Sampling parameters, stop conditions, logprobs and n, through the real engine."""

from __future__ import annotations

import math

import pytest
import torch

from infer import SamplingParams
from infer.core.sampling_params import InvalidRequestError

from .conftest import PROMPTS


def test_seeded_request_is_independent_of_its_batch(make_llm):
    llm = make_llm("llama", max_num_seqs=16)
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids
    noise = SamplingParams(max_tokens=20, temperature=1.2, ignore_eos=True)
    mixed = llm.generate(PROMPTS[:6], [noise, noise, params, noise, noise, noise][:6])
    in_batch = llm.generate(PROMPTS[1:4] + [PROMPTS[0]], [noise] * 3 + [params])
    assert in_batch[-1].outputs[0].token_ids == alone
    assert len(mixed) == 6


def test_n_children_differ_and_reproduce(make_llm):
    llm = make_llm("llama")
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate(PROMPTS[2], params)[0]
    b = llm.generate(PROMPTS[2], params)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_stop_string_cuts_text_and_finishes(make_llm):
    llm = make_llm("llama")
    base = llm.generate(PROMPTS[1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[
        0
    ]
    text = base.outputs[0].text
    stop = text[8:12]
    assert stop and stop in text
    out = llm.generate(
        PROMPTS[1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    inc = llm.generate(
        PROMPTS[1],
        SamplingParams(
            max_tokens=30,
            temperature=0,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=True,
        ),
    )[0].outputs[0]
    assert inc.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_length(make_llm):
    llm = make_llm("llama")
    base = llm.generate(PROMPTS[3], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    ids = base[0].outputs[0].token_ids
    assert base[0].outputs[0].finish_reason == "length" and len(ids) == 10
    out = llm.generate(
        PROMPTS[3],
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[ids[4]]),
    )[0].outputs[0]
    cut = ids.index(ids[4]) + 1
    assert out.finish_reason == "stop" and out.stop_reason == ids[4] and out.token_ids == ids[:cut]
    # The stop id is counted and listed, but its text is not part of the output (as vLLM
    # does), unless include_stop_str_in_output asks for it.
    tok = llm.engine.tokenizer
    assert out.text == tok.decode(ids[: cut - 1])
    inc = llm.generate(
        PROMPTS[3],
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[ids[4]],
                       include_stop_str_in_output=True),
    )[0].outputs[0]  # fmt: skip
    assert inc.token_ids == ids[:cut] and inc.text == tok.decode(ids[:cut])


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(make_llm):
    """max_tokens and a stop string end the output on the same token: the stop string is why
    (finish_reason stop, its stop_reason), not the length."""
    llm = make_llm("llama")
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    base = llm.generate(PROMPTS[1], greedy)[0].outputs[0]
    tok = llm.engine.tokenizer
    before = tok.decode(base.token_ids[:5])
    assert base.text.startswith(before) and len(base.text) > len(before)
    stop = base.text[len(before) - 2 :]  # ends with the sixth token's text, starts before it
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                  stop=[stop]))[0].outputs[0]  # fmt: skip
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == base.text[: base.text.index(stop)]
    assert llm.engine.scheduler.counters.finished.get("length", 0) == 1  # the base run's


def test_logprobs_match_transformers(make_llm, tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    llm = make_llm("llama")
    out = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)
    )[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32)
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    n = len(out.prompt_token_ids)
    for i, lp in enumerate(out.outputs[0].logprobs):
        assert lp.rank == 1 and len(lp.top) == 3 and lp.top[0][0] == lp.token_id
        assert math.isclose(lp.logprob, ref[n - 1 + i, lp.token_id].item(), abs_tol=1e-4)


def test_min_tokens_holds_back_eos(make_llm):
    llm = make_llm("llama")
    # The token the model greedily emits first: made the EOS / stop id, it ends generation at once.
    first = (
        llm.generate(PROMPTS[4], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
        .outputs[0]
        .token_ids[0]
    )
    n = 5

    def run(**extra):
        params = SamplingParams(max_tokens=8, temperature=0, **extra)
        return llm.generate(PROMPTS[4], params)[0].outputs[0]

    # As a stop token id: without min_tokens it stops after that one token.
    out = run(stop_token_ids=[first])
    assert out.token_ids == [first] and out.finish_reason == "stop"
    # With min_tokens it is held back for the first n tokens.
    out = run(stop_token_ids=[first], min_tokens=n)
    assert len(out.token_ids) >= n and first not in out.token_ids[:n]

    # As the model's EOS (what every request gets from the engine): the same.
    llm.engine.eos_token_ids = (first,)
    out = run()
    assert out.token_ids == [first] and out.finish_reason == "stop"
    assert out.text == ""  # the EOS's text is not output, special token or not
    out = run(min_tokens=n)
    assert len(out.token_ids) >= n and first not in out.token_ids[:n]
    # ignore_eos: EOS is neither a stop nor masked, so greedy emits it right away and goes on.
    out = run(min_tokens=n, ignore_eos=True)
    assert out.token_ids[0] == first and len(out.token_ids) == 8


def test_penalties_change_greedy_choice(make_llm):
    llm = make_llm("llama")
    plain = llm.generate(PROMPTS[7], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    pen = llm.generate(
        PROMPTS[7],
        SamplingParams(
            max_tokens=30,
            temperature=0,
            ignore_eos=True,
            repetition_penalty=2.0,
            frequency_penalty=1.5,
            presence_penalty=1.0,
        ),
    )
    a, b = plain[0].outputs[0].token_ids, pen[0].outputs[0].token_ids
    assert a != b
    assert len(set(b)) >= len(set(a))  # penalised text repeats itself less


def test_timings_are_recorded(make_llm):
    res = make_llm("llama").generate(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    t = res.timings[0]
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
    assert len(t.token_times) == 6 and t.token_times == sorted(t.token_times)


def test_min_tokens_holds_back_stop_strings(make_llm):
    llm = make_llm("llama")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = llm.generate(PROMPTS[2], greedy)[0].outputs[0]
    stop = ref.text[:2]  # the output's own start: a stop string at once without min_tokens
    assert stop
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                  stop=[stop]))[0].outputs[0]  # fmt: skip
    assert out.finish_reason == "stop" and len(out.token_ids) <= 2
    held = llm.generate(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                   stop=[stop], min_tokens=6))[0].outputs[0]  # fmt: skip
    assert len(held.token_ids) >= 6 and held.token_ids[:6] == ref.token_ids[:6]


def test_logit_bias_steers_greedy_and_sampling(make_llm):
    llm = make_llm("llama")
    greedy = dict(max_tokens=6, temperature=0, ignore_eos=True)
    plain = llm.generate(PROMPTS[0], SamplingParams(**greedy))[0].outputs[0]
    target = 42 if plain.token_ids[0] != 42 else 43
    forced = llm.generate(PROMPTS[0], SamplingParams(**greedy, logit_bias={target: 100},
                                                     logprobs=0))[0].outputs[0]  # fmt: skip
    assert forced.token_ids == [target] * 6
    # Logprobs are of the model's own distribution, not the biased one.
    assert forced.logprobs[0].logprob < -0.5
    banned = llm.generate(PROMPTS[0], SamplingParams(**greedy, logit_bias={
        plain.token_ids[0]: -100}))[0].outputs[0]  # fmt: skip
    assert banned.token_ids[0] != plain.token_ids[0]
    sampled = llm.generate([PROMPTS[1]] * 8, [SamplingParams(max_tokens=4, seed=s, ignore_eos=True,
                                                             logit_bias={7: 100})
                                              for s in range(8)])  # fmt: skip
    assert all(o.outputs[0].token_ids == [7] * 4 for o in sampled)
    with pytest.raises(InvalidRequestError, match="past the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(InvalidRequestError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={5: 101})


@pytest.mark.parametrize(
    "options",
    [{}, {"prefill_chunk_size": 5, "block_size": 4, "enable_prefix_caching": True},
     {"num_kv_blocks": 24, "block_size": 4, "max_num_seqs": 12}],
)  # fmt: skip
def test_prompt_logprobs_match_transformers(options, make_llm, tiny_checkpoints):
    """Chunked, prefix-cached (the prompt is computed whole anyway) or preempted and
    recomputed: every prompt token's logprob is transformers' and is reported once."""
    from transformers import AutoModelForCausalLM

    llm = make_llm("llama", **options)
    llm.generate(PROMPTS, SamplingParams(max_tokens=2))  # warm the prefix cache
    params = SamplingParams(max_tokens=12, prompt_logprobs=2, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32)
    for out in outs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        lps = out.prompt_logprobs
        assert len(lps) == len(ids) and lps[0] is None
        for i, lp in enumerate(lps[1:], start=1):
            assert lp.token_id == ids[i] and len(lp.top) == 2
            assert math.isclose(lp.logprob, ref[i - 1, ids[i]].item(), abs_tol=1e-4)


def _has_run(tokens: list[int], run: list[int]) -> bool:
    return any(tokens[i : i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


def test_bad_words_are_never_generated(make_llm):
    """vLLM's ``bad_words``: a word the greedy output holds (two tokens, as the tokenizer spells
    it) is cut at its last token — the output is the same up to there, then differs — and never
    appears, sampled or greedy, with or without speculation; a single-token sequence never
    appears at all; others in the batch are untouched; ids past the vocabulary are refused."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
            "prompt_lookup_min": 1}  # fmt: skip
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm = make_llm("llama")
    tok = llm.tokenizer
    want = llm.generate(PROMPTS[:2], plain)
    first = want[0].outputs[0].token_ids
    for i in range(len(first) - 1):
        word = tok.decode(first[i : i + 2])
        spelled = [
            tok.encode(t, add_special_tokens=False) for t in (word.lstrip(), " " + word.lstrip())
        ]
        if word.strip() and first[i : i + 2] in spelled:
            break
    else:
        pytest.fail("no two-token word in the greedy output")
    run = first[i : i + 2]
    for options in ({}, {"speculative_config": spec}):
        llm = make_llm("llama", **options)
        banned = [SamplingParams(max_tokens=16, temperature=t, seed=3, ignore_eos=True,
                                 bad_words=[word], bad_words_token_ids=[[first[0]]])
                  for t in (0, 1.0)]  # fmt: skip
        outs = llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1]], banned + [plain])
        greedy = outs[0].outputs[0].token_ids
        assert first[0] not in greedy[:1] and greedy != first
        for out in outs[:2]:
            assert not _has_run(out.outputs[0].token_ids, run)
            assert first[0] not in out.outputs[0].token_ids
        assert outs[2].outputs[0].token_ids == want[1].outputs[0].token_ids
    # Only the word: the greedy output is the same up to its last token.
    only = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, bad_words=[word])
    cut = llm.generate(PROMPTS[:1], only)[0].outputs[0].token_ids
    assert cut[: i + 1] == first[: i + 1] and cut[i + 1] != first[i + 1]
    with pytest.raises(InvalidRequestError, match="bad_words_token_ids names token id 5000"):
        llm.generate(["x"], SamplingParams(bad_words_token_ids=[[5, 5000]]))
    with pytest.raises(InvalidRequestError, match="non-blank"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(InvalidRequestError, match="at most 256 bad_words"):
        SamplingParams(bad_words=[f"w{i}" for i in range(257)])
    # every allowed id banned: nothing could be sampled (it sampled an id outside the list)
    with pytest.raises(InvalidRequestError, match="ban every one of allowed_token_ids"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[5, 6],
                                           bad_words_token_ids=[[5], [6], [7, 8]]))  # fmt: skip


def test_allowed_token_ids_bound_every_token_in_every_kind_of_step(make_llm):
    """vLLM's ``allowed_token_ids``: greedy and sampled, with and without speculation (verify
    rows), only those ids come out; other requests in the batch are untouched; an id past the
    vocabulary is refused by name."""
    allowed = [5, 17, 300, 301, 999]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
            "prompt_lookup_min": 1}  # fmt: skip
    for options in ({}, {"speculative_config": spec}):
        llm = make_llm("llama", **options)
        plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        alone = llm.generate(PROMPTS[:2], plain)
        params = [SamplingParams(max_tokens=12, temperature=t, seed=1, ignore_eos=True,
                                 allowed_token_ids=allowed) for t in (0, 1.0)]  # fmt: skip
        outs = llm.generate(PROMPTS[:2] * 2, params + [plain, plain])
        for out in outs[:2]:
            assert set(out.outputs[0].token_ids) <= set(allowed)
        assert [o.outputs[0].token_ids for o in outs[2:]] == [o.outputs[0].token_ids for o in alone]
    with pytest.raises(InvalidRequestError, match="allowed_token_ids names token id 5000"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[5, 5000]))
    with pytest.raises(InvalidRequestError, match="allowed_token_ids is empty"):
        SamplingParams(allowed_token_ids=[])


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_beam_search_gives_transformers_beams(kind, make_llm, tiny_checkpoints):
    """``LLM.beam_search`` (vLLM's): with the EOS ignored, transformers' beam search, token for
    token, every beam in its order, with its score; several prompts searched in one batch."""
    from transformers import AutoModelForCausalLM

    from infer import BeamSearchParams

    llm = make_llm(kind, enable_prefix_caching=True)
    prompts = [[5, 17, 300, 42, 8], [9, 9, 120, 7]]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    got = llm.beam_search(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[kind], dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt], device=hf.device), num_beams=3,
                               num_return_sequences=3, max_new_tokens=6, do_sample=False,
                               length_penalty=1.0, pad_token_id=0, output_scores=True,
                               return_dict_in_generate=True)  # fmt: skip
        assert out.prompt_token_ids == prompt
        assert [s.token_ids for s in out.sequences] == [
            t[len(prompt) :].tolist() for t in want.sequences]  # fmt: skip
        scores = [s.cum_logprob / 6 for s in out.sequences]  # (transformers' score)
        assert scores == pytest.approx(want.sequences_scores.tolist(), abs=1e-4)
        assert all(s.finish_reason == "length" for s in out.sequences)
        text = llm.tokenizer.decode(out.sequences[0].token_ids, skip_special_tokens=True)
        assert out.sequences[0].text == text.rstrip("\ufffd")  # (no half character at the end)


def test_beam_search_fits_the_kv_cache_or_is_refused_before_it_runs(make_llm):
    from infer import BeamSearchParams

    llm = make_llm("llama", num_kv_blocks=4, block_size=8)  # 32 tokens
    prompt = list(range(5, 15))
    with pytest.raises(InvalidRequestError, match="KV cache") as e:
        llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=24, ignore_eos=True))
    assert e.value.param == "max_tokens"
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=23,
                                                        ignore_eos=True))  # fmt: skip
    assert [len(s.token_ids) for s in out.sequences] == [23, 23]
