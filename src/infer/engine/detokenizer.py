"""Incremental detokenization and stop strings.

Token ids arrive one (or a few) at a time; text must go out as soon as it is certain::

    tokens  : ... p p p | r r r | n        (p: context, r: already read, n: new)
                  ^prefix_offset  ^read_offset
    new text = decode(tokens[prefix:]) minus decode(tokens[prefix:read])

If the decoded tail ends in U+FFFD the new token ends mid-character: emit nothing and wait
for the next token. Where the tokenizer is a fast one that does no clean-up of its own, the
``tokenizers`` library's ``DecodeStream`` runs this same algorithm in Rust, one call per token
and one decode (it keeps the prefix's text) instead of two (~1.1 vs ~3.0 us a token). Stop strings: any suffix of the text that could still grow into a stop
string is held back; when a stop string completes, the text is cut before it (or after it with
``include_stop_str_in_output``) and the request is finished by the engine. Until the output
has ``min_tokens`` tokens no stop string counts (as for EOS and stop ids).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from infer.core.sampling_params import SamplingParams

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

_CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context (leading-space handling)


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
        self._rust = rust_tokenizer(tokenizer) if DecodeStream is not None else None
        self._stream = self._primed_stream() if self._rust is not None else None
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""  # all output text decided so far (after a stop cut, final)
        self._sent = 0  # characters of `text` already emitted
        self.stop_string: str | None = None
        # Output tokens fed in before a stop string completed (the rest are cut off).
        self.num_output_tokens = 0

    def _primed_stream(self) -> Any | None:
        """A ``DecodeStream`` that has read the prompt context as :meth:`add_tokens` starts
        from (its text is the prefix the first output token's text is cut from); None where it
        cannot start there (a context whose text is empty or ends mid-character: the stream
        would not have moved past it), and the Python path runs instead."""
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        if self._tokens and stream.step(self._rust, self._tokens) is None:
            return None
        return stream

    def _decode(self, tokens: list[int]) -> str:
        return self._decode_ids(tokens, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the text that can be emitted now (possibly empty)."""
        if self._stream is not None and not self.stop:  # nothing held back: out as it comes
            out = ""
            for token_id in token_ids:
                self.num_output_tokens += 1
                piece = self._stream.step(self._rust, token_id)
                if piece:
                    out += piece
            if out:
                self.text += out
                self._sent = len(self.text)
            return out
        if self._stream is not None:
            for token_id in token_ids:
                if self.stop_string is not None:
                    break
                self.num_output_tokens += 1
                piece = self._stream.step(self._rust, token_id)
                if piece:
                    self._append(piece)
            return self._take(final=False)
        for token_id in token_ids:
            if self.stop_string is not None:
                break
            self._tokens.append(token_id)
            self.num_output_tokens += 1
            prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
            full_text = self._decode(self._tokens[self._prefix_offset :])
            if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
                continue  # mid-character, or a token that renders as nothing (yet)
            self._append(full_text[len(prefix_text) :])
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
        return self._take(final=False)

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
