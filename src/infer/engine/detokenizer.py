"""Incremental detokenization and stop strings.

Token ids arrive one (or a few) at a time; text must go out as soon as it is certain::

    tokens  : ... p p p | r r r | n        (p: context, r: already read, n: new)
                  ^prefix_offset  ^read_offset
    new text = decode(tokens[prefix:]) minus decode(tokens[prefix:read])

If the decoded tail ends in U+FFFD the new token ends mid-character: emit nothing and wait
for the next token. Where the tokenizer is a fast one that does no clean-up of its own, the
``tokenizers`` library's ``DecodeStream`` runs this same algorithm in Rust (it keeps the
prefix's text: one call a token, ~1.5 vs ~3.0 us); the offsets above are kept either way, so a
stream that gives up (its text stopped starting with what it emitted, which byte-fallback
decoders can do) hands the request to the Python path at the token it failed on.

A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen: its decoder is ``ByteLevel`` alone) decodes
each token to fixed bytes and the text is their UTF-8, so there a token's text is a table
lookup and an incremental UTF-8 decoder's step (:func:`byte_table`, ~0.3 us): the table is
built once per tokenizer and checked against the tokenizer's own decode before it is trusted.

Stop strings: any suffix of the text that could still grow into a stop string is held back;
when a stop string completes, the text is cut before it (or after it with
``include_stop_str_in_output``) and the request is finished by the engine. Until the output
has ``min_tokens`` tokens no stop string counts (as for EOS and stop ids).
"""

from __future__ import annotations

import codecs
import contextlib
import random
import weakref
from collections.abc import Callable
from typing import Any

from infer.core.sampling_params import SamplingParams


def _decode_stream_class() -> Any | None:
    """tokenizers' ``DecodeStream`` where its ``step`` takes a list of ids (0.22 on; earlier
    releases take one id, and 0.20.4 - 0.21.0 misplace their read index), else None."""
    try:
        import tokenizers
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    try:
        version = tuple(int(part) for part in tokenizers.__version__.split(".")[:2])
    except ValueError:
        return None
    return DecodeStream if version >= (0, 22) else None


DecodeStream = _decode_stream_class()

_CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context (leading-space handling)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character that stands for each byte -> the
    byte (printable Latin-1 stands for itself; the other bytes for code points 256 on)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = dict(zip(keep, keep, strict=True))
    extra = 256
    for b in range(256):
        if b not in chars:
            chars[b] = extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_table(tokenizer) -> tuple[list[bytes], frozenset[int]] | None:
    """For a byte-level BPE tokenizer whose decode is the UTF-8 of its tokens' bytes: each
    id's bytes (an unknown id: none) and the special ids (skipped with
    ``skip_special_tokens``); None for any other tokenizer, or one whose decode of a sample of
    ids differs from the table's. Built once per tokenizer."""
    try:
        return _BYTE_TABLES[tokenizer]
    except (KeyError, TypeError):
        pass
    table = _build_byte_table(tokenizer)
    with contextlib.suppress(TypeError):  # not weak-referenceable: built again next time
        _BYTE_TABLES[tokenizer] = table
    return table


def _build_byte_table(tokenizer) -> tuple[list[bytes], frozenset[int]] | None:
    backend = rust_tokenizer(tokenizer)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    decoder = _byte_decoder()
    vocab = backend.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        try:
            table[i] = bytes(decoder[c] for c in token)
        except KeyError:  # a character outside the alphabet (an added token): its own UTF-8
            table[i] = token.encode()
    added = backend.get_added_tokens_decoder()
    special = frozenset(i for i, t in added.items() if t.special)
    # Trusted only if it decodes as the tokenizer does: every added token (special or not),
    # an id past the vocabulary, and random runs.
    rng = random.Random(0)
    samples = [[i] for i in added] + [[len(table)]]
    samples += [[rng.randrange(len(table)) for _ in range(rng.randrange(1, 9))]
                for _ in range(300)]  # fmt: skip
    for ids in samples:
        for skip in (False, True):
            data = b"".join(table[i] for i in ids if i < len(table) and not (skip and i in special))
            if data.decode(errors="replace") != backend.decode(ids, skip_special_tokens=skip):
                return None
    return table, special


def rust_tokenizer(tokenizer) -> Any | None:
    """The Rust tokenizer a fast tokenizer wraps, where its decode gives the same text as the
    tokenizer's own (no clean-up of transformers' on top); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


def fast_decode(tokenizer) -> Callable[..., str]:
    """``tokenizer.decode`` (ids, skip_special_tokens=...) or the Rust tokenizer's decode it
    wraps (:func:`rust_tokenizer`): the same text without transformers' Python layer (~1.2 vs
    ~3.7 us a call)."""
    backend = rust_tokenizer(tokenizer)
    return tokenizer.decode if backend is None else backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self._decode_ids = fast_decode(tokenizer)
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        # As with EOS and stop ids, a stop string ends the output only once it has min_tokens.
        self.min_tokens = params.min_tokens
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._held = ""  # the byte table's text that ends in U+FFFD, not emitted yet
        self._cut_first = False  # the byte table's first character is the context's
        self._bytes = self._primed_bytes()
        self._rust = None
        if self._bytes is None and DecodeStream is not None:
            self._rust = rust_tokenizer(tokenizer)
        self._stream = self._primed_stream() if self._rust is not None else None
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        # With stop strings: all output text decided so far (after a stop cut, final).
        self.text = ""
        self._sent = 0  # characters of `text` already emitted
        self.stop_string: str | None = None
        # Output tokens fed in before a stop string completed (the rest are cut off).
        self.num_output_tokens = 0

    def _primed_stream(self) -> Any | None:
        """A ``DecodeStream`` that has read the prompt context as :meth:`add_tokens` starts
        from (its text is the prefix the first output token's text is cut from); None where it
        cannot start there (a context whose text is empty or ends mid-character: the stream
        would not have moved past it), and the Python path runs instead."""
        assert DecodeStream is not None
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        try:
            if self._tokens and stream.step(self._rust, self._tokens) is None:
                return None
        except BaseException as e:  # noqa: BLE001 - see _step: the Python path instead
            _reraise_unless_stream_error(e)
            return None
        return stream

    def _primed_bytes(self) -> tuple[list[bytes], frozenset[int], Any] | None:
        """The byte table's path (:func:`byte_table`): the table, the ids to skip and a UTF-8
        decoder that has read the prompt context; None where there is no table. A context
        that ends mid-character leaves its bytes in the decoder, and the first character
        decoded after them (they complete it, or they become U+FFFD) is not emitted: the
        Python path cuts the output's text after the context's, which ends in that U+FFFD."""
        found = byte_table(self.tokenizer)
        if found is None:
            return None
        table, special = found
        skip = special if self.skip_special_tokens else frozenset()
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        for i in self._tokens:
            if i < len(table) and i not in skip:
                utf8.decode(table[i])
        self._cut_first = bool(utf8.getstate()[0])
        return table, skip, utf8

    def _decode(self, tokens: list[int]) -> str:
        return self._decode_ids(tokens, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the text that can be emitted now (possibly empty)."""
        if not self.stop:  # nothing held back: the text goes out as it comes
            out = ""
            for token_id in token_ids:
                self.num_output_tokens += 1
                piece = self._step(token_id)
                if piece:
                    out += piece
            return out  # (``text`` is kept for stop strings only: nothing is held here)
        for token_id in token_ids:
            if self.stop_string is not None:
                break
            self.num_output_tokens += 1
            piece = self._step(token_id)
            if piece:
                self._append(piece)
        return self._take(final=False)

    def _step(self, token_id: int) -> str | None:
        """One more token: the text it adds (None while it ends mid-character or renders as
        nothing yet), from the byte table, the Rust stream or else in Python; the offsets move
        either way (not on the table: it never hands over)."""
        if self._bytes is not None:  # (no hand-over from here: the ids need not be kept)
            table, skip, utf8 = self._bytes
            if token_id >= len(table) or token_id in skip:
                return None
            piece = self._held + utf8.decode(table[token_id])
            # As the other paths: a token that ends mid-character, or whose text ends in U+FFFD,
            # emits nothing until a token ends on a whole character.
            if utf8.getstate()[0] or piece.endswith("\ufffd"):
                self._held = piece
                return None
            self._held = ""
            if self._cut_first and piece:
                self._cut_first = False
                piece = piece[1:]
            return piece or None
        self._tokens.append(token_id)
        if self._stream is None:
            return self._step_python()
        try:
            piece = self._stream.step(self._rust, token_id)
        except BaseException as e:  # noqa: BLE001 - a Rust panic is a BaseException
            _reraise_unless_stream_error(e)
            self._stream = None  # from here on in Python, from this token on
            return self._step_python()
        if piece:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
        return piece

    def _step_python(self) -> str | None:
        """:meth:`_step` in Python: two decodes, the text with and without the new token."""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None  # mid-character, or a token that renders as nothing (yet)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return full_text[len(prefix_text) :]

    def finish(self) -> str:
        """The request ended: release any held-back text."""
        return self._take(final=True)

    def _append(self, piece: str) -> None:
        old_len = len(self.text)
        self.text += piece
        if not self.stop or self.num_output_tokens < self.min_tokens:
            return
        search_from = max(0, old_len - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            self.stop_string = s
            self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]

    def _take(self, final: bool) -> str:
        end = len(self.text)
        if not final and self.stop_string is None and self.stop:
            end -= self._held_back()
        end = max(end, self._sent)
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self.text
        for k in range(min(self._max_stop - 1, len(text)), 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self.stop):
                return k
        return 0


def _reraise_unless_stream_error(e: BaseException) -> None:
    """Raise ``e`` again unless the stream raised it (any ``Exception``, or the
    ``PanicException`` a Rust panic becomes, which derives from ``BaseException``)."""
    if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
        raise e
