"""A prompt's KV cache moving between engines (prefill/decode disaggregation). No torch.

A *prefill* engine computes a prompt (``add_request(..., export_kv=True)``, with
``max_tokens=1``): in the step the request finishes, the engine copies its prompt KV out (a
:class:`KVPayload`, on the final ``RequestOutput.kv_payload``), then frees the blocks. A *decode*
engine takes the payload with the same prompt (``add_request(..., kv_payload=payload)``): at
admission its scheduler counts the payload's tokens as computed, allocates the blocks, and the
runner copies the payload into them before that step's forward pass. Only the prompt's last
token is then computed, whose logits give the first output token, exactly as after a prefix
cache hit (the cache never serves a prompt's last token either)::

    prompt      t0 t1 ... t(L-2) t(L-1)
    payload     [ KV of L-1 tokens ]           blocks 0 .. ceil((L-1)/B)-1, whole blocks
    decode side  hit blocks | imported blocks | computes t(L-1) -> first output token

Whole blocks travel in the cache's own layout (the values, and the scales of a quantized
cache); a block's positions past the payload's tokens are masked by attention and overwritten
when the decode side computes them. ``layout`` names the cache's dtype and shapes, so a decode
engine with another cache layout refuses the payload instead of reading garbage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KVPayload:
    """The KV of a prompt's first ``len(token_ids)`` tokens, as whole cache blocks.

    ``arrays[k]`` holds stored tensor ``k`` of the cache (values, then scales if quantized) for
    the payload's blocks as a C-contiguous uint8 numpy array (so any dtype, bf16 and fp8
    included, pickles and travels through Ray's object store without a copy on the reading
    side); ``layout[k]`` is ``(dtype name, shape)`` of that block range, to view it back.
    """

    token_ids: tuple[int, ...]
    block_size: int
    layout: tuple[tuple[str, tuple[int, ...]], ...]
    arrays: tuple[Any, ...]
    # The digests of the prompt's images (a vision-language model's): the same placeholder
    # tokens with other images are another prompt.
    image_digests: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)

    def usable_for(self, prompt_token_ids: list[int], block_size: int,
                   image_digests: tuple[str, ...] = ()) -> str | None:  # fmt: skip
        """None when this payload can seed a request with that prompt (and those images),
        else why not."""
        if image_digests != self.image_digests:
            return "the payload's images are not this prompt's"
        if block_size != self.block_size:
            return f"block size {self.block_size}, the cache's is {block_size}"
        n = self.num_tokens
        if n == 0 or n >= len(prompt_token_ids):
            return f"{n} tokens for a prompt of {len(prompt_token_ids)}"
        if tuple(prompt_token_ids[:n]) != self.token_ids:
            return "the payload's tokens are not this prompt's"
        return None


KV_TRANSFER_SCOPE_KEY = "infer.kv_transfer"
"""The ASGI scope key under which a disaggregated replica hands its app a :class:`KVHandoff`."""


@dataclass
class KVHandoff:
    """What a disaggregated replica asks of one HTTP request it runs through infer's app.

    ``role="prefill"``: the request's sequence exports its KV when it finishes (``export_kv``);
    the app records the engine request ids here, for the replica to collect the payloads. (The
    router already asked for one token.) ``role="decode"``: the request's first sequence
    starts from ``payload``.
    """

    role: str  # "prefill" | "decode"
    payload: KVPayload | None = None
    request_ids: list[str] = field(default_factory=list)
