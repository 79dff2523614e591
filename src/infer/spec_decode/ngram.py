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
from infer.spec_decode import num_to_propose, wants_proposal


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for request in requests:
            k = num_to_propose(request, self.k) if wants_proposal(request) else 0
            if k:
                tokens = propose_ngram(request.all_token_ids, k, self.lookup_min, self.lookup_max)
                if tokens:
                    out[request.request_id] = tokens
        return out

    def forget(self, request_id: str) -> None:
        pass


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
