"""The beam search's bookkeeping with made-up candidates: the best k of all beams' candidates
live on, an EOS finishes its beam, the context and max_tokens end the rest, and the ranking
divides by the generated length to the length penalty."""

from __future__ import annotations

import pytest

from infer.core.beam_search import Beam, BeamSearch, BeamSearchParams
from infer.core.sampling_params import InvalidRequestError

EOS = 0


def test_the_best_k_candidates_of_all_beams_live_on():
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=3), frozenset({EOS}), 3)
    search.advance([((5, -0.1), (6, -0.5), (7, -2.0))])
    assert [b.token_ids for b in search.live] == [(5,), (6,)]
    # beam (5,) at -0.1, beam (6,) at -0.5: the best two of all four candidates
    search.advance([((8, -1.0), (9, -3.0)), ((8, -0.2), (9, -0.3))])
    assert [(b.token_ids, round(b.cum_logprob, 3)) for b in search.live] == [
        ((6, 8), -0.7), ((6, 9), -0.8)]  # fmt: skip


def test_an_eos_finishes_its_beam_and_the_rest_end_at_max_tokens():
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=2), frozenset({EOS}), 2)
    search.advance([((EOS, -0.1), (5, -0.2), (6, -0.3))])
    assert search.done == [Beam((EOS,), -0.1, ended_on_eos=True)]
    assert [b.token_ids for b in search.live] == [(5,), (6,)]  # k stay alive beside it
    search.advance([((7, -0.1),), ((7, -0.1),)])
    assert search.live == []  # max_tokens
    best = search.best()
    assert [b.token_ids for b in best] == [(EOS,), (5, 7)]  # -0.1 vs -0.15 a token


def test_ignore_eos_and_the_context():
    params = BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True)
    search = BeamSearch(params, frozenset({EOS}), 5)
    search.advance([((EOS, -0.1),)])
    assert search.live == [Beam((EOS,), -0.1)] and not search.done
    full = BeamSearch(params, frozenset({EOS}), 0)  # a prompt that fills the context
    assert full.live == [] and full.best() == [Beam()]


def test_the_length_penalty_divides_by_the_generated_length():
    long, short = Beam((1, 2, 3, 4), -4.0), Beam((1,), -1.5)
    assert long.score(1.0) == -1.0 and short.score(1.0) == -1.5  # long wins per token
    assert long.score(0.0) == -4.0  # no penalty: the sum


@pytest.mark.parametrize(("field", "kwargs"), [("n", {"beam_width": 0}),
                                                ("n", {"beam_width": 11}),
                                                ("max_tokens", {"max_tokens": 0}),
                                                ("length_penalty", {"length_penalty": float("inf")})])  # fmt: skip
def test_bad_params_are_refused_by_name(field, kwargs):
    with pytest.raises(InvalidRequestError) as e:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
    assert e.value.param == field


def test_the_rounds_fit_the_context_and_the_kv_cache():
    """A beam's last round needs prompt + max_tokens - 1 tokens of KV: an unset max_tokens is
    fitted to that, one asked for and out of reach is refused before any round (it ran rounds,
    then failed naming lengths nobody sent)."""
    from infer.core.beam_search import rounds_for

    params = BeamSearchParams(beam_width=2, max_tokens=30)
    assert rounds_for(params, False, 10, context=1024, kv_tokens=32) == 23
    assert rounds_for(params, False, 10, context=20, kv_tokens=None) == 10
    assert rounds_for(BeamSearchParams(2, 23), True, 10, context=1024, kv_tokens=32) == 23
    with pytest.raises(InvalidRequestError, match="max_tokens \\(30\\)") as e:
        rounds_for(params, True, 10, context=1024, kv_tokens=32)
    assert e.value.param == "max_tokens"


def test_a_beams_text_never_ends_in_half_a_character():
    class Bytes:  # a byte-level tokenizer: "é" is two tokens
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    from infer.core.beam_search import beam_text

    assert beam_text(Bytes(), tuple("é".encode())) == "é"
    assert beam_text(Bytes(), tuple(b"a" + "é".encode()[:1])) == "a"
