"""Speculative decoding: propose the next few tokens cheaply, verify them in one target pass.

A proposer looks at the requests about to decode and proposes up to ``num_speculative_tokens``
tokens for each (``Scheduler.add_proposals``). The next step runs each such request as a chunk
of ``1 + k`` tokens (its last token and the proposals), the sampler accepts the longest run the
target agrees with plus one token of its own (``Sampler.verify``), and the scheduler rolls back
the KV of the rejected tail (``Scheduler.update_from_output``).

- :class:`NgramProposer` (``method="ngram"``): finds the sequence's last n tokens earlier in its
  own prompt and output and proposes what followed. No model, no torch.
- :class:`DraftProposer` (``method="draft_model"``): a smaller model with the same tokenizer,
  run greedily with its own paged KV cache.

Constrained requests (structured outputs) are never given proposals (a grammar's mask for a
verify row would need the grammar advanced over the proposals before it); they decode one token
at a time. Penalties and bad words apply to each verify row as if the proposals before it were
accepted (``sampler._apply_penalties``), so requests with them are proposed to as any other.
"""

from __future__ import annotations

from typing import Protocol

from infer.core.request import Request


class Proposer(Protocol):
    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        """Proposed next tokens for the requests that are about to decode (may omit some)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request ended: drop whatever is kept for it."""
        ...


def wants_proposal(request: Request) -> bool:
    """Whether a request may be given proposals (see the module docstring): all but
    constrained ones (structured outputs), whose mask depends on the tokens before it."""
    return request.sampling_params.structured_outputs is None


def num_to_propose(request: Request, k: int) -> int:
    """At most ``k``, and never so many that the step could pass ``max_tokens``."""
    return max(0, min(k, request.max_new_tokens - request.num_output_tokens - 1))


class ProposalLengths:
    """How many tokens to propose to each request: ``k``, halved after every proposal that was
    rejected from its first token (down to 1), back to ``k`` after one that was not.

    Verifying a rejected proposal costs its rows in the forward pass; where proposals keep
    failing (sampled free text), this keeps that cost to about one extra row per step, while
    a request whose proposals are accepted keeps proposing ``k``. It never changes what is
    generated, only how much is proposed. ``adaptive=False`` always proposes ``k``.
    """

    def __init__(self, k: int, adaptive: bool = True) -> None:
        self.k = k
        self.adaptive = adaptive
        # request id -> (first proposed token, num_tokens when proposed, length in force)
        self._last: dict[str, tuple[int, int, int]] = {}

    def next(self, request: Request) -> int:
        """The most tokens to propose to ``request`` now (0: none)."""
        if not wants_proposal(request):
            return 0
        k = self.k
        last = self._last.get(request.request_id)
        if self.adaptive and last is not None:
            first, at, k = last
            if request.num_tokens > at:  # verified since: was the first proposal accepted?
                # (one token, not the whole prompt + output list built for it)
                k = self.k if request.token_ids(at, at + 1)[0] == first else max(1, k // 2)
        return num_to_propose(request, k)

    def record(self, request: Request, proposal: list[int], k: int) -> None:
        if proposal:
            self._last[request.request_id] = (proposal[0], request.num_tokens, k)

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)


from infer.spec_decode.ngram import NgramProposer  # noqa: E402

__all__ = ["NgramProposer", "ProposalLengths", "Proposer", "num_to_propose", "wants_proposal"]
