"""Prefill/decode disaggregation over the replicas: the messages and the request rewrite.

With ``--prefill-replicas P --decode-replicas D`` the router runs each eligible generation
request in two phases::

    client ─► router ─► prefill-i.prefill(request with max_tokens=1)        (prefix-aware pick)
                          engine computes the prompt, holds its blocks,
                          exports them (KVPayload) ─► ray.put ─► KVTicket
              router ─► decode-j.receive(ticket)                             (least-loaded pick)
                          room for the prompt's blocks?  no ─► NoRoom (router tries another)
                          ray.get(ticket), kept under a key ─► KVReceived(key)
              router ─► decode-j.handle(request, key): the app runs the request with the
                          payload: the engine copies it in and computes only the last prompt
                          token, then streams as usual  ─► the client's one ordinary stream

The prefill side releases its blocks as soon as the payload is in Ray's object store (with
prefix caching on they stay cached there); the object store holds the payload until the router
and the decode side drop their references. Pure data and pure functions here (no ray import):
the replica and the router use them, and the unit tests check the rewrite.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from infer.cluster.asgi import ForwardedRequest, ResponseStart

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class KVTicket:
    """A prompt's KV in Ray's object store (``ref`` resolves to a ``KVPayload``)."""

    ref: Any  # ray.ObjectRef
    nbytes: int
    num_tokens: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        """Blocks the decode side needs for the prompt (its payload and its last token)."""
        return -(-(self.num_tokens + 1) // self.block_size)


@dataclass(frozen=True)
class PrefillResult:
    """A prefill replica's answer: the app's response to the one-token request (returned to
    the client as is when it is not a success), and the ticket when the KV was exported."""

    start: ResponseStart
    body: bytes
    ticket: KVTicket | None = None
    export_seconds: float = 0.0


@dataclass(frozen=True)
class KVReceived:
    """A decode replica fetched the payload (fetch time, size) and keeps it under ``key`` for
    the streaming call that follows."""

    seconds: float
    nbytes: int
    key: str


@dataclass(frozen=True)
class NoRoom:
    """A decode replica's answer to ``receive`` when its KV pool cannot take the prompt now:
    the router tries another decode replica, or waits."""

    free_blocks: int
    needed_blocks: int


# Fields the prefill request drops: they shape the decode, which happens elsewhere.
_DECODE_ONLY = ("stream_options", "min_tokens", "stop", "stop_token_ids", "logprobs",
                "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty")  # fmt: skip


def split_request(fwd: ForwardedRequest) -> ForwardedRequest | None:
    """The prefill half of a generation request (the same prompt, one token, no stream), or
    None when it is not split: not a JSON object, several prompts or choices, or prompt
    logprobs / echo (which need every prompt position's logits on the side that answers)."""
    try:
        data = json.loads(fwd.body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    for key in ("n", "best_of"):
        if data.get(key) not in (None, 1):
            return None
    if data.get("prompt_logprobs") is not None or data.get("echo"):
        return None
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        return None
    body = {k: v for k, v in data.items() if k not in _DECODE_ONLY}
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return ForwardedRequest(fwd.method, fwd.path, fwd.query_string,
                            _without_length(fwd.headers), json.dumps(body).encode(),
                            fwd.client)  # fmt: skip


def _without_length(headers: tuple[tuple[bytes, bytes], ...]) -> tuple[tuple[bytes, bytes], ...]:
    """The headers of a rewritten body: its old Content-Length no longer holds."""
    return tuple((k, v) for k, v in headers if k.lower() != b"content-length")
