"""Incremental detokenization never splits a character nor leaks part of a stop string."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from infer import SamplingParams
from infer.engine import detokenizer
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
    d._stream = d._bytes = None  # the two-decodes-a-token Python path the others stand in for
    return d


def _byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama 2, Mistral, Gemma): "▁" for spaces, unknown
    characters as <0xNN> byte tokens, whose decoder (ByteFallback) can turn text already
    emitted into U+FFFD when a later byte does not complete a character."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special, limit_alphabet=60)
    tok.train_from_iterator([TEXT.replace("日本語", "abc")] * 50 + ["hello world"] * 50, trainer)
    tok.add_tokens([AddedToken("<tool>", special=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, bos_token="<s>",
        eos_token="</s>", unk_token="<unk>",
    )  # fmt: skip


@pytest.mark.parametrize("path", ["stream", "bytes"])
@pytest.mark.parametrize("kind", [*KINDS, "byte-fallback"])
def test_the_fast_paths_emit_what_the_python_path_emits(tiny_checkpoints, kind, path, monkeypatch):
    """Random output ids (special tokens, bytes that end mid-character or are no character,
    stop strings, several tokens a call as speculative decoding feeds them) after a random
    prompt context: the same piece from every call, the same stop, on every model's tokenizer
    and a byte-fallback one, through the Rust stream and through the byte table."""
    if kind == "byte-fallback":
        tok = _byte_fallback_tokenizer()
    else:
        tok = AutoTokenizer.from_pretrained(tiny_checkpoints[kind])
    if path == "stream":
        monkeypatch.setattr(detokenizer, "byte_table", lambda tok: None)
    elif kind == "byte-fallback":
        assert detokenizer.byte_table(tok) is None  # not a byte-level decoder: no table
        return
    else:
        assert detokenizer.byte_table(tok) is not None  # every tiny checkpoint's: byte-level
    rng = random.Random(kind)
    text_ids = tok.encode(TEXT * 2, add_special_tokens=False)
    streamed = handed_over = 0
    for _ in range(40 if kind != "byte-fallback" else 400):
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 9))]
        if rng.random() < 0.5:
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        else:
            ids = text_ids[: rng.randrange(1, len(text_ids))]
        calls = []
        while len(ids) > sum(map(len, calls)):
            start = sum(map(len, calls))
            calls.append(ids[start : start + rng.choice([1, 1, 1, 3])])
        params = SamplingParams(
            skip_special_tokens=rng.random() < 0.5,
            stop=rng.choice([[], ["e"], [" w"], ["テキ"]]),
            min_tokens=rng.choice([0, 0, 3]),
        )
        new = IncrementalDetokenizer(tok, prompt, params)
        old = _python_path(IncrementalDetokenizer(tok, prompt, params))
        started = (new._stream if path == "stream" else new._bytes) is not None
        a = [new.add_tokens(c) for c in calls] + [new.finish()]
        b = [old.add_tokens(c) for c in calls] + [old.finish()]
        streamed += started
        handed_over += started and new._stream is None
        assert a == b, (prompt, ids)
        assert (new.stop_string, new.num_output_tokens) == (old.stop_string, old.num_output_tokens)
    assert streamed >= 20  # the stream ran (without the table, a context ending mid-character
    # takes the Python path)
    if kind == "byte-fallback":
        assert handed_over >= 10  # streams that gave up mid-way, and matched anyway


def test_a_context_ending_mid_character(tok, monkeypatch):
    """The stream cannot start cut from a context whose text ends mid-character (it would not
    move past it): without the byte table those requests detokenize in Python. The table
    takes them, and emits what the Python path does: the context's partial character is not
    the output's (the output's bytes that complete it are not emitted)."""
    ids = tok.encode("日本 and more", add_special_tokens=False)
    assert len(ids) > 2 and tok.decode(ids[:1]).endswith("\ufffd")  # byte tokens
    table = IncrementalDetokenizer(tok, ids[:1], SamplingParams())
    python = _python_path(IncrementalDetokenizer(tok, ids[:1], SamplingParams()))
    assert table._bytes is not None and table._cut_first
    pieces = [table.add_tokens([i]) for i in ids[1:]] + [table.finish()]
    assert pieces == [python.add_tokens([i]) for i in ids[1:]] + [python.finish()]
    assert "".join(pieces) == tok.decode(ids)[1:].replace("\ufffd", "")  # "本 and more"

    monkeypatch.setattr(detokenizer, "byte_table", lambda tok: None)

    def streams(context):
        return IncrementalDetokenizer(tok, context, SamplingParams())._stream is not None

    assert not streams(ids[:1]) and streams(ids) and streams([])


@pytest.mark.parametrize(
    ("version", "streams"), [("0.21.4", False), ("0.22.0", True), ("1.0", True)]
)
def test_the_stream_needs_a_tokenizers_whose_step_takes_a_list(monkeypatch, version, streams):
    import tokenizers

    from infer.engine.detokenizer import _decode_stream_class

    monkeypatch.setattr(tokenizers, "__version__", version)
    assert (_decode_stream_class() is not None) == streams
