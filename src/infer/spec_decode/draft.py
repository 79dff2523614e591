"""Draft-model proposals: a smaller model with the same tokenizer, run greedily.

The draft keeps its own paged KV cache. Each call brings every request's draft cache up to
date in one batched pass (the tokens accepted since the last call; a whole prompt the first
time) and then decodes ``k - 1`` more single-token passes::

    sequence (target)  : p p p p t               t: the token sampled last step
    draft cache before : p p p p d1' d2'          d': last call's proposals
                                 ^ kept only where they match the sequence (rolled back here)
    pass 1 (catch-up)  : the tokens from the first mismatch to t       -> d1 (argmax)
    pass 2 .. k        : d1, d2, ...                                   -> d2 .. dk

Proposals are the draft's argmax, so they are deterministic and the target's rejection
sampling (``Sampler.verify``) keeps each request's own distribution.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infer.core.messages import RunnerSetup
from infer.core.request import Request
from infer.kv_cache.manager import PagedKVManager
from infer.kv_cache.sizing import kv_bytes_per_token
from infer.runner.attention import SequenceSlice
from infer.runner.backend import DeviceBackend
from infer.spec_decode import ProposalLengths

logger = logging.getLogger("infer.engine")


@dataclass
class _DraftSeq:
    """One request's state in the draft cache (what ``PagedKVManager`` needs of a request)."""

    request_id: str
    tokens: list[int] = field(default_factory=list)  # the tokens whose KV the draft cache holds
    num_verified: int = 0  # leading tokens known to be the sequence's (not proposals)

    @property
    def num_computed_tokens(self) -> int:
        return len(self.tokens)


class DraftProposer:
    def __init__(
        self,
        model_path: Path,
        num_speculative_tokens: int,
        *,
        backend: DeviceBackend,
        max_model_len: int,
        num_tokens: int,
        block_size: int,
        target_vocab_size: int,
        target_tokenizer=None,
        adaptive: bool = True,
    ) -> None:
        """The draft is loaded and its runner built by the engine's device ``backend`` (the
        target loaded first: the draft takes its dtype)."""
        from infer.model.loader import load_model_spec

        self.lengths = ProposalLengths(num_speculative_tokens, adaptive)
        self.device = backend.device
        spec = load_model_spec(model_path)
        if spec.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model {model_path} has a vocabulary of {spec.vocab_size} tokens, "
                f"the target {target_vocab_size}: speculative decoding needs the same tokenizer"
            )
        _check_same_tokenizer(model_path, target_tokenizer)
        self.model = backend.load_draft(model_path)
        self.max_len = min(max_model_len, spec.max_position_embeddings)
        # Room for every token the target can hold, plus each request's proposals.
        num_blocks = -(-num_tokens // block_size) * 2
        self.kv = PagedKVManager(num_blocks, block_size)
        # The draft runs k passes per step: the runner's fast path (no per-layer module
        # Python, where the model allows it) makes them cost a fraction.
        rows = max(2048, 64 * (num_speculative_tokens + 1))
        # NOTE: the draft builds its own torch AttentionContext per pass (CPU kernels on a CPU,
        # gather + SDPA on CUDA: "torch" is the C++ kernels' path on a CPU); it does not go
        # through the Triton step.
        setup = RunnerSetup(num_blocks, block_size, attention_backend="torch",
                            max_num_seqs=rows, max_num_batched_tokens=rows)  # fmt: skip
        self.runner = backend.build_runner(setup, model=self.model)
        self.kv_cache = self.runner.kv_cache
        self._seqs: dict[str, _DraftSeq] = {}
        bpt = kv_bytes_per_token(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, self.kv_cache.dtype.itemsize
        )
        logger.info(
            "draft model %s (%s, %d layers): %d proposals per step, KV %d blocks (%.1f MiB)",
            model_path,
            spec.architecture,
            spec.num_layers,
            num_speculative_tokens,
            num_blocks,
            num_blocks * block_size * bpt / 2**20,
        )

    def forget(self, request_id: str) -> None:
        self.lengths.forget(request_id)
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)  # type: ignore[arg-type]

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        # 1. Roll each draft cache back to where it agrees with the sequence; plan catch-up.
        batch: list[tuple[_DraftSeq, list[int], int]] = []  # (seq, tokens to run, proposals)
        requests_of: dict[str, tuple[Request, int]] = {}
        for request in requests:
            k = min(self.lengths.next(request), self.max_len - request.num_tokens)
            if k <= 0:
                continue
            seq = self._seqs.setdefault(request.request_id, _DraftSeq(request.request_id))
            tokens = request.all_token_ids
            keep = _common_prefix(seq.tokens, tokens, seq.num_verified)
            keep = min(keep, len(tokens) - 1)  # the last token's logits are what we need
            del seq.tokens[keep:]
            seq.num_verified = len(tokens)  # after this pass: every sequence token is in
            self.kv.trim(seq)  # type: ignore[arg-type]
            new = tokens[keep:]
            if not self.kv.allocate(seq, len(new)):  # type: ignore[arg-type]
                self.forget(request.request_id)  # out of draft memory: no proposals this time
                continue
            batch.append((seq, new, k))
            requests_of[seq.request_id] = (request, k)
        if not batch:
            return {}
        # 2. One catch-up pass, then single-token passes for the rest of the proposals.
        proposals: dict[str, list[int]] = {seq.request_id: [] for seq, _, _ in batch}
        active = batch
        while active:
            next_tokens = self._forward([(seq, new) for seq, new, _ in active])
            still = []
            for (seq, _, k), token in zip(active, next_tokens, strict=True):
                got = proposals[seq.request_id]
                got.append(token)
                if len(got) < k and self.kv.allocate(seq, 1):  # type: ignore[arg-type]
                    still.append((seq, [token], k))
            active = still
        for request_id, (request, k) in requests_of.items():
            self.lengths.record(request, proposals[request_id], k)
        return proposals

    def _forward(self, chunks: list[tuple[_DraftSeq, list[int]]]) -> list[int]:
        """Run each sequence's new tokens; returns each one's argmax next token."""
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SequenceSlice] = []
        rows: list[int] = []
        for seq, new in chunks:
            start = seq.num_computed_tokens
            ids.extend(new)
            positions.extend(range(start, start + len(new)))
            # A short catch-up after a long context attends through the decode path.
            as_rows = start > 0 and len(new) <= 16
            table = self.kv.block_table(seq)  # type: ignore[arg-type]
            slices.append(SequenceSlice(start, len(new), table, as_decode_rows=as_rows))
            rows.append(len(ids) - 1)
        hidden = self.runner.forward(*self.runner.model_inputs(ids, positions, slices))
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        next_tokens = self.model.compute_logits(hidden[rows_t]).argmax(dim=-1).tolist()
        # NOTE: only now: a pass that raised has not put these tokens in the draft cache.
        for seq, new in chunks:
            seq.tokens.extend(new)
        return next_tokens


def _common_prefix(a: list[int], b: list[int], known: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, whose first ``known`` items agree."""
    n = min(len(a), len(b))
    i = min(known, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _check_same_tokenizer(model_path: Path, target_tokenizer) -> None:
    """A draft folder with a tokenizer of its own must have the target's vocabulary."""
    if target_tokenizer is None or not (
        (model_path / "tokenizer.json").exists() or (model_path / "tokenizer_config.json").exists()
    ):
        return
    from infer.model.tokenizer import load_tokenizer

    draft = load_tokenizer(model_path)
    if draft.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(
            f"the draft model {model_path} has another tokenizer than the target "
            "(their vocabularies differ): speculative decoding needs the same tokenizer"
        )
