"""The engine's side of constrained decoding: matchers, their compilation, and bitmasks.

A constrained request waits outside the scheduler while its matcher is built in a worker
thread (llguidance drops the GIL while it builds one), so a slow schema never stalls the
requests already decoding. Each step the runner asks for the bitmask rows of the constrained
requests it samples; after the step the engine advances each matcher with its sampled tokens
and finishes a request whose grammar has ended (``stop``) or cannot go on (``error``).

::

    add_request ──> compiling (thread pool) ──> scheduler.add_request
                                   │ error: the request ends with an error
    step: forward ─> bitmask rows ─> masked sampling ─> advance(tokens) ─> grammar ended? stop
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from infer.core.request import Request
from infer.structured.grammar import GrammarError, compile_grammar


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        thread_initializer: Callable[[], None] | None = None,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._llg_tokenizer = None
        self._lock = threading.Lock()
        # The engine's ``thread_initializer`` keeps the compile threads off its main thread's
        # core under --cpu-bind (engine/affinity.py).
        self._pool = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="grammar", initializer=thread_initializer
        )
        self.matchers: dict[str, object] = {}  # request id -> llguidance.LLMatcher
        self._built: set[tuple] = set()  # cache keys of grammars built before

    # ---- compilation --------------------------------------------------------------------------
    def submit(self, request: Request) -> Future:
        """Build the request's matcher; the future gives the matcher or raises
        :class:`GrammarError`. A schema seen before is built at once, here (a fraction of a
        millisecond: its grammar is cached and the engine's tokenizer wrapper exists), so the
        request can join this very step; a new one in a worker thread."""
        spec = request.sampling_params.structured_outputs
        if spec.cache_key in self._built:
            done: Future = Future()
            try:
                done.set_result(self._build(spec))
            except GrammarError as e:
                done.set_exception(e)
            return done
        return self._pool.submit(self._build, spec)

    def _tokenizer(self, param: str):
        with self._lock:  # NOTE: built once (~1 s for a large vocabulary), on first use
            if self._llg_tokenizer is None:
                eos = self._eos[0] if self._eos else None
                try:
                    self._llg_tokenizer = llguidance_tokenizer(
                        self._hf_tokenizer, self.vocab_size, eos
                    )
                except ValueError as e:  # (remembered: every later request gets it at once)
                    self._llg_tokenizer = e
            if isinstance(self._llg_tokenizer, ValueError):
                raise GrammarError(
                    f"structured outputs are not available for this model: {self._llg_tokenizer}",
                    param=param,
                )
            return self._llg_tokenizer

    def _build(self, spec):
        from llguidance import LLMatcher

        grammar = compile_grammar(spec)
        matcher = LLMatcher(self._tokenizer(spec.param), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind}: {matcher.get_error()}", param=spec.param)
        self._built.add(spec.cache_key)
        return matcher

    def attach(self, request_id: str, matcher) -> None:
        self.matchers[request_id] = matcher

    def forget(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    # ---- the step -----------------------------------------------------------------------------
    def bitmask(self, requests: list[Request]) -> tuple[list[int], torch.Tensor] | None:
        """For the constrained ones among ``requests`` (a step's sampled rows, in order): their
        row indices and a ``[n, ceil(vocab / 32)]`` int32 bitmask of the tokens allowed next.

        The masks are computed one after another on this thread. llguidance's parallel
        executor is slower here: its worker threads compete with torch's for two cores
        (measured, half of C=16 constrained: 15% throughput lost with it, 12% without).
        """
        rows = [i for i, r in enumerate(requests) if r.request_id in self.matchers]
        if not rows:
            return None
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        mask = allocate_token_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            fill_next_token_bitmask(self.matchers[requests[i].request_id], mask, j)
        return rows, mask

    def advance(self, request: Request, token_ids: list[int]) -> str | None:
        """Feed the request's newly sampled tokens to its matcher. Returns ``"stop"`` when the
        grammar has ended, ``"error: ..."`` when a token could not be consumed, else None."""
        matcher = self.matchers.get(request.request_id)
        if matcher is None:
            return None
        for token in token_ids:
            if matcher.is_stopped():
                return "stop"
            if not matcher.consume_token(token):
                return f"error: the grammar could not take token {token}: {matcher.get_error()}"
        return "stop" if matcher.is_stopped() else None


# Text a tokenizer's token texts must spell out exactly, token by token, to be used as written.
_SPELLING_CHECK = 'Hello, world! {"a": [1, 2.5e-3, null]}\n\tdef f(x):  return x  # héllo → ok'


def llguidance_tokenizer(hf_tokenizer, n_vocab: int, eos: int | None):
    """llguidance's view of the model's tokenizer: the bytes each token id stands for.

    llguidance reads a fast tokenizer's own description (byte-level BPE, SentencePiece byte
    fallback, ...). Where it cannot (a decoder it does not know, such as the ``Fuse`` of a
    character-level BPE like the built-in models' ``toy``), each id's bytes are its text as
    the tokenizer decodes it alone, checked first to spell a sample text exactly; a ValueError
    when they do not.
    """
    import llguidance
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos)
    except ValueError as e:
        reason = str(e)
    specials = set(hf_tokenizer.all_special_ids)
    texts = [hf_tokenizer.decode([i], skip_special_tokens=False) for i in range(n_vocab)]
    ids = hf_tokenizer.encode(_SPELLING_CHECK, add_special_tokens=False)
    spelled = "".join(texts[i] if i < n_vocab else "\ufffd" for i in ids)
    if spelled != _SPELLING_CHECK or any(
        "\ufffd" in texts[i] for i in range(n_vocab) if i not in specials
    ):
        raise ValueError(f"llguidance cannot read its tokenizer ({reason})")

    class _Tokens:  # the interface llguidance.TokenizerWrapper wraps
        eos_token_id = eos
        bos_token_id = hf_tokenizer.bos_token_id
        tokens = [text.encode() for text in texts]
        special_token_ids = sorted(specials)

        def __call__(self, text: str) -> list[int]:
            return hf_tokenizer.encode(text, add_special_tokens=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens()), n_vocab=n_vocab)
