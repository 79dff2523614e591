"""``use_beam_search`` on /v1/completions and /v1/chat/completions (vLLM's): the ``n`` likeliest
continuations of each prompt, ranked by ``length_penalty``.

The rounds of ``infer.core.beam_search`` run as groups of one-token requests through the same
``Serving.submit`` every request takes (priority, cache salt, LoRA adapter, queue bounds), so a
round's beams share the prefix cache and batch with whatever else runs. Not streamed (the best
beams are known only at the end), and refused with what needs sampled tokens: logprobs,
structured outputs, tool calls, stop strings and ids, ``best_of``.
"""

from __future__ import annotations

import time
from typing import Any

from infer.core.beam_search import (
    Beam,
    BeamSearch,
    BeamSearchParams,
    advance_all,
    round_prompts,
    rounds_for,
)
from infer.core.sampling_params import InvalidRequestError
from infer.server.errors import bad_request, from_invalid_request
from infer.server.serving import Choices, Serving, raise_if_failed
from infer.server.structured_outputs import STRUCTURED_FIELDS, structured_outputs_of

# Fields a beam search cannot honour, and the value that asks nothing of it.
_REFUSED = {
    "stream": False,
    "logprobs": None,
    "top_logprobs": None,
    "prompt_logprobs": None,
    "best_of": None,
    "stop": None,
    "stop_token_ids": None,
    "tools": None,
    "bad_words": None,
    "allowed_token_ids": None,
    "logit_bias": None,
}


def check_beam_request(req: Any) -> None:
    """400 naming the first field a beam search cannot serve."""
    for name, unset in _REFUSED.items():
        value = getattr(req, name, unset)
        if name == "logprobs" and value is False:  # (chat's logprobs: a bool)
            continue
        if value not in (unset, [], {}):
            raise bad_request(f"{name} cannot be combined with use_beam_search", param=name)
    extra = req.model_extra or {}
    given = [k for k in STRUCTURED_FIELDS if extra.get(k) is not None]
    try:
        constrained = bool(given) and structured_outputs_of(extra) is not None
    except InvalidRequestError as e:
        raise from_invalid_request(e) from e
    if constrained:
        raise bad_request(f"{given[0]} cannot be combined with use_beam_search", param=given[0])


async def search(serving: Serving, req: Any, prompts: list[list[int]], max_tokens: int | None,
                 request_id: str) -> tuple[list[list[Beam]], bool]:  # fmt: skip
    """Each prompt's best ``req.n`` beams, best first; and whether the search was cut short
    (the request timed out, or the server is shutting down)."""
    given = max_tokens is not None
    if max_tokens is None:  # the model's length, else the context's (fitted below)
        max_tokens = serving.sampling_defaults.get("max_tokens", serving.max_model_len)
    try:
        params = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens,
                                  ignore_eos=req.ignore_eos, length_penalty=req.length_penalty,
                                  temperature=req.temperature or 0.0)  # fmt: skip
        rounds = [rounds_for(params, given, len(p), serving.max_model_len, serving.kv_tokens)
                  for p in prompts]  # fmt: skip
    except InvalidRequestError as e:
        raise from_invalid_request(e) from e
    eos, step = frozenset(serving.eos_token_ids), params.round_params()
    searches = [BeamSearch(params, eos, n) for n in rounds]
    # --request-timeout bounds the whole search (each round's requests are short): past it,
    # or when a round is aborted (shutdown), the beams end where they are, as "abort".
    timeout = serving.settings.request_timeout
    deadline = None if timeout is None else time.monotonic() + timeout
    round_ = 0
    while any(s.live for s in searches):
        if deadline is not None and time.monotonic() > deadline:
            return [s.best() for s in searches], True
        rows = round_prompts(searches, prompts)
        stream = await serving.submit(f"{request_id}-r{round_}", rows, step, req)
        acc = Choices(len(rows))
        try:
            async for index, out in stream:
                acc.add(index, out)
        finally:
            stream.abort()  # (a cancelled round: its requests end with it)
        for final in acc.final:
            assert final is not None
            raise_if_failed(final)
        if any(final.finish_reason == "abort" for final in acc.final):  # type: ignore[union-attr]
            return [s.best() for s in searches], True
        advance_all(searches, [lps[0].top for lps in acc.logprobs])
        round_ += 1
    return [s.best() for s in searches], False


def usage_of(prompts: list[list[int]], beams: list[list[Beam]]) -> tuple[int, int]:
    """(prompt, completion) tokens: each prompt once, every returned beam's tokens."""
    return sum(map(len, prompts)), sum(len(b.token_ids) for found in beams for b in found)
