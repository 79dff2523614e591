"""Incremental detokenization never splits a character nor leaks part of a stop string."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from infer import SamplingParams
from infer.engine.detokenizer import IncrementalDetokenizer

TEXT = "Héllo wörld — 日本語のテキスト 🙂🎉 end."


@pytest.fixture(scope="module")
def tok(tiny_checkpoints):
    return AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])


def test_one_token_at_a_time_never_splits_characters(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 3  # multi-byte characters span several byte tokens
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    pieces = [d.add_tokens([i]) for i in ids] + [d.finish()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT


def test_stop_string_is_never_partially_emitted(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["テキスト"]))
    emitted = ""
    for i in ids:
        emitted += d.add_tokens([i])
        assert "テ" not in emitted  # the stop's first character is held until decided
        if d.stop_string:
            break
    emitted += d.finish()
    assert d.stop_string == "テキスト" and emitted == TEXT[: TEXT.index("テキスト")]


def test_held_back_prefix_is_released_when_it_does_not_complete(tok):
    ids = tok.encode("abc abd", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["abx"]))
    out = "".join(d.add_tokens([i]) for i in ids) + d.finish()
    assert out == "abc abd" and d.stop_string is None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_is_the_tokenizers_own_decode(tok, skip_special_tokens):
    """The incremental text (through the Rust decoder where the tokenizer allows) is exactly
    what ``tokenizer.decode`` gives for the whole output, special tokens kept or skipped."""
    special = [i for i in (tok.bos_token_id, tok.eos_token_id) if i is not None]
    assert special
    ids = tok.encode(TEXT, add_special_tokens=False)
    ids = ids[:5] + special + ids[5:] + special
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    d = IncrementalDetokenizer(tok, [], params)
    out = "".join(d.add_tokens([i]) for i in ids) + d.finish()
    assert out == tok.decode(ids, skip_special_tokens=skip_special_tokens)
