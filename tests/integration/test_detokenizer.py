"""Incremental detokenization never splits a character nor leaks part of a stop string."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from infer import SamplingParams
from infer.engine.detokenizer import IncrementalDetokenizer
from infer.testing.checkpoints import KINDS

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


def _python_path(d: IncrementalDetokenizer) -> IncrementalDetokenizer:
    d._stream = None  # the two-decodes-a-token Python path the Rust stream stands in for
    return d


@pytest.mark.parametrize("kind", KINDS)
def test_the_rust_stream_emits_what_the_python_path_emits(tiny_checkpoints, kind):
    """Random output ids (special tokens, bytes that end mid-character, stop strings) after a
    random prompt context: the same piece from every call, the same stop, on every model's
    tokenizer."""
    tok = AutoTokenizer.from_pretrained(tiny_checkpoints[kind])
    rng = random.Random(kind)
    text_ids = tok.encode(TEXT * 2, add_special_tokens=False)
    streamed = 0
    for _ in range(40):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 9))]
        if rng.random() < 0.5:
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        else:
            ids = text_ids[: rng.randrange(1, len(text_ids))]
        params = SamplingParams(
            skip_special_tokens=rng.random() < 0.5, stop=rng.choice([[], ["e"], [" w"], ["テキ"]])
        )
        new = IncrementalDetokenizer(tok, prompt, params)
        old = _python_path(IncrementalDetokenizer(tok, prompt, params))
        streamed += new._stream is not None
        a = [new.add_tokens([i]) for i in ids] + [new.finish()]
        b = [old.add_tokens([i]) for i in ids] + [old.finish()]
        assert a == b, (prompt, ids)
        assert (new.stop_string, new.num_output_tokens) == (old.stop_string, old.num_output_tokens)
    assert streamed >= 20  # the stream ran (a context ending mid-character takes the Python path)


def test_a_context_ending_mid_character_takes_the_python_path(tok):
    """The stream cannot start cut from a context whose text ends mid-character (it would not
    move past it): those requests detokenize in Python; the others through the stream."""
    ids = tok.encode("日本", add_special_tokens=False)
    assert len(ids) > 2 and tok.decode(ids[:1]).endswith("\ufffd")  # byte tokens
    assert IncrementalDetokenizer(tok, ids[:1], SamplingParams())._stream is None
    assert IncrementalDetokenizer(tok, ids, SamplingParams())._stream is not None
    assert IncrementalDetokenizer(tok, [], SamplingParams())._stream is not None
