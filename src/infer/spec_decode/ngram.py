"""N-gram (prompt lookup) proposals: what followed the last time this text appeared. No torch.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, look for the sequence's
last ``n`` tokens earlier in its own prompt and output; at the latest earlier match propose
the (up to) ``k`` tokens that followed it::

    tokens   : a b c d e f g h . . . c d e       (n = 3: the suffix "c d e")
    match    :     ^^^^^                          latest earlier "c d e"
    proposal :           f g h                    (k = 3)

Longer suffixes are tried first: a longer match is better evidence that what followed will
follow again. Workloads that quote or edit their input (code, documents, extraction) accept
most proposals; free-form text accepts few, and then a step only costs the extra query rows.
"""

from __future__ import annotations

import numpy as np

from infer.core.request import Request
from infer.spec_decode import ProposalLengths


class NgramProposer:
    """Proposals from an index of each request's n-grams, kept up to date as tokens arrive.

    Searching the whole sequence every step costs ~50 us per n-gram length at 768 tokens,
    which on a small model is a tenth of a step; the index makes a step's lookup a few dict
    operations (and the first one, over the prompt, one pass). Same answers as
    :func:`propose_ngram` (tested).
    """

    def __init__(
        self, num_speculative_tokens: int, lookup_min: int, lookup_max: int, adaptive: bool = True
    ) -> None:
        self.lengths = ProposalLengths(num_speculative_tokens, adaptive)
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for request in requests:
            k = self.lengths.next(request)
            if not k:
                continue
            index = self._indexes.get(request.request_id)
            if index is None:
                index = self._indexes[request.request_id] = _NgramIndex(
                    self.lookup_min, self.lookup_max
                )
            tokens = request.all_token_ids
            index.extend(tokens)
            proposal = index.propose(tokens, k)
            if proposal:
                out[request.request_id] = proposal
                self.lengths.record(request, proposal, k)
        return out

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
        self.lengths.forget(request_id)


class _NgramIndex:
    """Start positions of every n-gram (``lookup_min <= n <= lookup_max``) of one sequence."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lengths = range(lookup_max, lookup_min - 1, -1)
        self.starts: dict[tuple[int, ...], list[int]] = {}
        self.num_indexed = 0  # tokens whose n-grams ending at them are indexed

    def extend(self, tokens: list[int]) -> None:
        starts = self.starts
        for end in range(self.num_indexed + 1, len(tokens) + 1):
            for n in self.lengths:
                if n <= end:
                    starts.setdefault(tuple(tokens[end - n : end]), []).append(end - n)
        self.num_indexed = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        total = len(tokens)
        for n in self.lengths:
            if n >= total:
                continue
            positions = self.starts.get(tuple(tokens[total - n :]))
            if not positions or len(positions) < 2:  # only the suffix itself
                continue
            # Latest earlier start with k tokens after it, else the latest earlier one.
            chosen = positions[-2]
            for i in reversed(positions[:-1]):
                if i + n + k <= total:
                    chosen = i
                    break
            return tokens[chosen + n : chosen + n + k]
        return []


def propose_ngram(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching
    suffix of ``tokens`` (``lookup_min`` <= length <= ``lookup_max``) that has ``k`` tokens
    after it (else the latest occurrence); ``[]`` if there is none."""
    total = len(tokens)
    if total < lookup_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(lookup_max, total - 1), lookup_min - 1, -1):
        suffix = arr[total - n :]
        # Windows starting at 0 .. total - n - 1: every occurrence but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(arr[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            # The latest match with k tokens after it; else the latest (a repeat close to
            # the end, e.g. a run of one token, has fewer tokens after it).
            whole = hits[hits + n + k <= total]
            start = int(whole[-1] if whole.size else hits[-1]) + n
            return tokens[start : start + k]
    return []
