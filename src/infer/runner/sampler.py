"""Pick each request's next token from its logits row, applying that request's own parameters.

One batched pass over ``[B, vocab]`` float32 logits:

    allowed_token_ids -> logit_bias -> bad words -> penalties (repetition over prompt+output; presence/frequency over output)
    -> min_tokens (EOS and stop ids masked until the minimum is reached)
    -> greedy rows: argmax
    -> other rows: temperature, min-p, top-k, top-p (vLLM's order), then a draw

Draws are batched (inverse CDF at a uniform draw per row, :meth:`Sampler._draw`). A seeded request draws its
noise from its own ``torch.Generator`` (created at its first sample), so its tokens do not depend
on what else is in the batch. Unseeded requests share the engine's generator. Logprobs are of the model's raw distribution (before penalties and temperature),
as vLLM reports them.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from infer.core.messages import SampledToken
from infer.core.request import Request, TokenLogprob
from infer.runner.cpu.kernels import cpu_kernels
from infer.structured.bitmask import apply_bitmask


class PendingSample:
    """A batch's sampled tokens on their way to the host: the device tensor (the next step's
    inputs can be fed from it without the host, :meth:`Sampler.launch`) and its copy."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready: torch.cuda.Event | None = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(tokens.device))  # the copy's stream
        else:
            self._host, self._ready = tokens, None

    def result(self) -> list[SampledToken]:
        """The tokens (waits for the copy: the step's one wait on the device)."""
        if self._ready is not None:
            self._ready.synchronize()
        return [SampledToken(t, None) for t in self._host.tolist()]


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self._shared = torch.Generator(device=self.device)
        self._shared.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self.history = TokenHistory()

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.history.forget(request_id)

    def _generator(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self._shared
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[request.request_id] = gen
        return gen

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        allowed: tuple[list[int], torch.Tensor] | None = None,
    ) -> list[SampledToken]:
        """One token per row. ``allowed``: constrained rows and their token bitmasks
        (structured outputs), applied after the penalties and before greedy or sampling."""
        logits = raw = logits.float()
        params = [r.sampling_params for r in requests]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if any(p.edits_logits for p in params) or any(
            r.num_output_tokens < r.sampling_params.min_tokens for r in requests
        ):
            logits = logits.clone()
            _apply_penalties(logits, requests, [NONE_BEFORE] * len(requests), self.history)
        if allowed is not None:
            if logits.data_ptr() == raw.data_ptr():
                logits = logits.clone()
            apply_bitmask(logits, *allowed)

        token_list = self._pick(logits, requests).tolist()
        out = []
        for row, token_id in enumerate(token_list):
            k = params[row].logprobs
            lp = None
            if k is not None and raw_logprobs is not None:
                lp = token_logprob(raw_logprobs[row], token_id, k)
            out.append(SampledToken(token_id, lp))
        return out

    @staticmethod
    def can_launch(requests: list[Request]) -> bool:
        """Whether :meth:`launch` samples this batch: no logprobs, penalties, logit bias or
        pending ``min_tokens`` (what reads the host's request state or needs more copies)."""
        for r in requests:
            p = r.sampling_params
            if p.logprobs is not None or p.edits_logits or r.num_output_tokens < p.min_tokens:
                return False
        return True

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, requests: list[Request]) -> PendingSample:
        """:meth:`sample` for a batch :meth:`can_launch` takes, without waiting for the device:
        the same kernels and draws (so the same tokens), queued, and their copy to the host
        started. The next step can be launched on ``tokens`` before they reach the host."""
        if logits.device.type == "cuda" and all(r.sampling_params.greedy for r in requests):
            # The argmax of the model's own logits (bf16): the same token as of their float32
            # copy, without writing that copy (256 rows x 128k vocab: ~0.1 ms a step). (On a
            # CPU the C++ argmax wants float32: there the copy stays.)
            return PendingSample(_argmax(logits))
        return PendingSample(self._pick(logits.float(), requests))

    def _pick(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row's token on the device: the argmax of a greedy row, a draw from the
        filtered distribution of the others (logits already biased, penalized, masked)."""
        params = [r.sampling_params for r in requests]
        tokens = _argmax(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            if len(random_rows) == len(requests):
                rows, picked = None, logits
            else:  # a device index: indexing by a list would copy it blocking (a wait)
                rows = _to_device(random_rows, torch.long, tokens.device)
                picked = logits.index_select(0, rows)
            probs = _filtered_probs(picked, [params[i] for i in random_rows])
            drawn = self._draw(probs, [requests[i] for i in random_rows])
            if rows is None:
                return drawn
            tokens[rows] = drawn
        return tokens

    def _draw(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token per row of ``probs`` in a few batched kernels, by inverting each row's
        CDF at a uniform draw: the first token whose running sum reaches ``u * total``, which is
        token i with probability ``p_i`` (zero-probability tokens add nothing to the sum and are
        never picked). Unseeded rows take their ``u`` from the engine's generator in one call;
        a seeded request's from its own generator, so its draws do not depend on its batch.
        (A row-by-row ``torch.multinomial`` cost ~0.7 ms a row of 32,000 on a CPU and a launch
        or two per row on a GPU; this is ~0.03 ms a row.)"""
        u = torch.rand(len(requests), 1, generator=self._shared, device=probs.device)
        for row, request in enumerate(requests):
            if request.sampling_params.seed is not None:
                u[row].uniform_(generator=self._generator(request))
        return _invert_cdf(probs, u)

    @torch.inference_mode()
    def verify(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        proposals: list[list[int]],
        allowed: tuple[list[int], torch.Tensor] | None = None,
    ) -> list[list[SampledToken]]:
        """Speculative decoding: accept each request's longest acceptable run of proposals.

        ``logits`` holds ``len(proposals[i]) + 1`` consecutive rows per request: row ``j``
        scores the token after proposal ``j - 1`` (row 0: after the request's last token).
        Walking the proposals in order, a greedy request accepts proposal ``d_j`` while it is
        the argmax of row ``j``; a sampling request accepts it with probability ``p_j(d_j)``
        (the filtered target distribution; proposals are deterministic, so this is rejection
        sampling against a one-hot draft) and at the first rejection draws from ``p_j`` with
        ``d_j`` removed. If every proposal is accepted, one more token is drawn from the last
        row. Either way each emitted token has exactly the target's distribution, and greedy
        requests emit exactly the tokens plain decoding would.

        Returns, per request, the accepted proposals followed by one token.
        """
        logits = logits.float()
        rows_of: list[range] = []
        start = 0
        for p in proposals:
            rows_of.append(range(start, start + len(p) + 1))
            start += len(p) + 1
        row_requests = [r for r, rows in zip(requests, rows_of, strict=True) for _ in rows]
        params = [r.sampling_params for r in row_requests]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if any(p.edits_logits or p.min_tokens for p in params):
            logits = logits.clone()
            # row j of a request scores the token after its first j proposals: they count as
            # output for that row's penalties, bans and min_tokens
            before = [tuple(p[:j]) for p, rows in zip(proposals, rows_of, strict=True)
                      for j in range(len(rows))]  # fmt: skip
            _apply_penalties(logits, row_requests, before, self.history)
        if allowed is not None:  # constrained requests have no proposals: one row each
            request_rows, mask = allowed
            logits = logits.clone()
            apply_bitmask(logits, [rows_of[i][0] for i in request_rows], mask)
        argmax = _argmax(logits).tolist()
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        probs_of: dict[int, torch.Tensor] = {}
        if random_rows:
            probs = _filtered_probs(logits[random_rows], [params[i] for i in random_rows])
            probs_of = {row: probs[j] for j, row in enumerate(random_rows)}

        out: list[list[SampledToken]] = []
        for request, rows, proposal in zip(requests, rows_of, proposals, strict=True):
            k = request.sampling_params.logprobs
            greedy = request.sampling_params.greedy
            gen = None if greedy else self._generator(request)
            emitted: list[SampledToken] = []
            for j, row in enumerate(rows):
                if j < len(proposal):
                    draft = proposal[j]
                    if greedy:
                        token, accepted = argmax[row], argmax[row] == draft
                    else:
                        p = probs_of[row]
                        u = torch.rand((), generator=gen, device=p.device)
                        accepted = bool(u < p[draft])
                        token = draft
                        if not accepted:
                            residual = p.clone()
                            residual[draft] = 0.0
                            token = _draw_one(residual, gen)
                else:  # every proposal accepted: one more token from the last row
                    accepted = False
                    token = argmax[row] if greedy else _draw_one(probs_of[row], gen)
                lp = None
                if k is not None and raw_logprobs is not None:
                    lp = token_logprob(raw_logprobs[row], token, k)
                emitted.append(SampledToken(token, lp))
                if not accepted:
                    break
            out.append(emitted)
        return out


class TokenHistory:
    """Each request's prompt and output ids as one numpy array, grown as its tokens come.

    Penalties read a request's whole history every step; rebuilt from its Python lists (a set of
    prompt + output, the lists joined and made a tensor) that cost O(context) Python work per row
    and step. Here a step appends the row's new tokens and the batch's histories are joined in
    C. A request whose output shrank (a stop string's cut) or whose id now names another
    request is rebuilt."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[Request, np.ndarray, int]] = {}

    def ids(self, request: Request) -> np.ndarray:
        """``prompt_token_ids + output_token_ids`` (a view valid until the next call)."""
        prompt, output = request.prompt_token_ids, request.output_token_ids
        n = len(prompt) + len(output)
        entry = self._entries.get(request.request_id)
        if entry is None or entry[0] is not request or entry[2] > n:
            buf = np.empty(max(2 * n, 64), dtype=np.int64)
            buf[: len(prompt)] = prompt
            have = len(prompt)
        else:
            _, buf, have = entry
            if n > len(buf):
                buf = np.concatenate([buf[:have], np.empty(max(n, len(buf)), dtype=np.int64)])
        if n > have:
            buf[have:n] = output[have - len(prompt) :]
        self._entries[request.request_id] = (request, buf, n)
        return buf[:n]

    def forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)


def _invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` probabilities and ``[R, 1]`` uniforms in [0, 1) -> ``[R]`` tokens: the first
    whose running sum reaches ``(1 - u) * total``. ``1 - u`` is in (0, 1], so the target is
    positive and at most the total: the token picked always has positive probability, however
    the float32 sums round."""
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (1 - u) * cdf[:, -1:])
    return picked.clamp_max_(probs.shape[-1] - 1)[:, 0]


def _draw_one(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from a ``[V]`` row, consuming ``gen`` as :meth:`Sampler._draw` does for a
    seeded row (one uniform), so a request draws alike on the sample and verify paths."""
    u = torch.empty(1, 1, device=probs.device).uniform_(generator=gen)
    return int(_invert_cdf(probs[None], u)[0])


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``; on CPU by the C++ kernel (torch's takes ~2 ms for 64 x 32000),
    a few rows on a GPU in two passes (:func:`argmax_in_parts`)."""
    if logits.device.type == "cuda" and logits.dim() == 2 and logits.shape[0] <= SPLIT_ARGMAX_ROWS:
        return argmax_in_parts(logits)
    kernels = cpu_kernels() if logits.device.type == "cpu" else None
    if kernels is None or logits.dtype != torch.float32 or logits.dim() != 2:
        return logits.argmax(dim=-1)
    return kernels.argmax_rows(logits.contiguous())


SPLIT_ARGMAX_ROWS = 8
"""Up to this many rows, a GPU's argmax goes in two passes: torch reduces a row in one thread
block (28 us for 1 x 128,256 on an H100, longer than the step's attention)."""


@functools.cache
def _vocab_parts(vocab: int) -> int | None:
    """The most parts (<= 1024) that cut ``vocab`` evenly into runs of >= 64: the first pass's
    rows; None where there is no such cut (a prime vocabulary)."""
    return next((p for p in range(min(1024, vocab // 64), 1, -1) if vocab % p == 0), None)


def argmax_in_parts(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[rows, vocab]`` logits in two passes: the maximum of each of
    ``parts`` even runs of every row (many thread blocks), then the first run holding the
    row's maximum. Ties go to the first index, as ``argmax`` (its first maximal value)::

        [rows, vocab] -view-> [rows, parts, run] -max-> best [rows, parts], at [rows, parts]
        part = best.argmax(-1);  token = part * run + at[row, part]
    """
    rows, vocab = logits.shape
    parts = _vocab_parts(vocab)
    if parts is None:
        return logits.argmax(dim=-1)
    run = vocab // parts
    best, at = logits.reshape(rows, parts, run).max(dim=-1)
    part = best.argmax(dim=-1, keepdim=True)
    return (at.gather(1, part) + part * run).squeeze(1)


NONE_BEFORE: tuple[int, ...] = ()
"""A row with no proposals before its token (every row of a step that verifies nothing)."""


def _apply_penalties(
    logits: torch.Tensor,
    requests: list[Request],
    before: list[tuple[int, ...]],
    history: TokenHistory,
) -> None:
    """In place on ``[B, V]`` logits: row ``i`` keeps only its ``allowed_token_ids`` (when it
    has them), gets its request's logit bias, then its bad words' and ``min_tokens``' bans
    (EOS and stop ids banned until the output is long enough), then the repetition penalty
    (over prompt and output), then presence and frequency penalties (over the output).

    Speculative decoding: ``before[i]`` are the proposals ahead of row ``i``'s token (a verify
    row ``j`` scores the token after the first ``j``); they are that row's output's tail, as they
    will be if accepted, so a verified run gets the penalties and bans plain decoding gives it::

        output : o1 o2 o3 | d1 d2          row 0: o1..o3    row 1: o1..o3 d1    row 2: ... d1 d2

    Batched: the rows' ids are gathered on the host into a few flat arrays (the histories'
    from ``history``, joined in C) and applied with a few indexed kernels, each array one
    host-to-device copy for the whole batch (a loop over rows made a copy, a wait for the GPU,
    and several kernels per row).
    """
    device = logits.device
    allow_rows, allow_ids = [], []
    bias_rows, bias_ids, bias_vals = [], [], []
    ban_rows, ban_ids = [], []
    rep_rows, rep_ids, rep_pen = [], [], [1.0] * len(requests)
    out_rows, out_ids, presence, frequency = [], [], [0.0] * len(requests), [0.0] * len(requests)
    for row, (request, ahead) in enumerate(zip(requests, before, strict=True)):
        p = request.sampling_params
        if p.allowed_token_ids:
            allow_rows += [row] * len(p.allowed_token_ids)
            allow_ids += p.allowed_token_ids
        for token_id, bias in p.logit_bias:
            bias_rows.append(row)
            bias_ids.append(token_id)
            bias_vals.append(bias)
        for sequence in p.bad_words_token_ids:  # its last id, where the output ends with the rest
            n = len(sequence) - 1
            if n <= request.num_output_tokens + len(ahead) and (
                n == 0 or _output_tail(request.output_token_ids, ahead, n) == sequence[:-1]
            ):
                ban_rows.append(row)
                ban_ids.append(sequence[-1])
        if request.num_output_tokens + len(ahead) < p.min_tokens:
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(request.eos_token_ids)
            ban_rows += [row] * len(banned)
            ban_ids += banned
        penalize_output = (p.presence_penalty or p.frequency_penalty) and (
            request.output_token_ids or ahead
        )
        if p.repetition_penalty != 1.0 or penalize_output:
            ids = history.ids(request)
            if ahead:
                ids = np.concatenate([ids, np.asarray(ahead, dtype=np.int64)])
            if p.repetition_penalty != 1.0:  # every id seen, repeats included: a mask
                rep_rows.append(row)
                rep_ids.append(ids)
                rep_pen[row] = p.repetition_penalty
            if penalize_output:  # every output id, repeats counted
                out_rows.append(row)
                out_ids.append(ids[len(request.prompt_token_ids) :])
                presence[row], frequency[row] = p.presence_penalty, p.frequency_penalty

    def index(rows: list[int], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        both = _to_device([rows, ids], torch.long, device)
        return both[0], both[1]

    def joined(rows: list[int], arrays: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``rows[j]`` once for each id of ``arrays[j]``, and the ids, as one copy."""
        both = np.stack([np.repeat(rows, [len(a) for a in arrays]), np.concatenate(arrays)])
        on_device = torch.from_numpy(both).to(device, non_blocking=True)
        return on_device[0], on_device[1]

    if allow_rows:  # every other id of those rows to -inf
        rows, ids = index(allow_rows, allow_ids)
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[rows, ids] = True
        keep[~torch.isin(torch.arange(len(requests), device=device), rows)] = True
        logits.masked_fill_(~keep, float("-inf"))
    if bias_rows:
        values = _to_device(bias_vals, logits.dtype, device)
        logits.index_put_(index(bias_rows, bias_ids), values, accumulate=True)
    if ban_rows:
        logits.index_put_(index(ban_rows, ban_ids), torch.full((), float("-inf"), device=device))
    if rep_rows:
        # Only the seen entries are read and written (an id seen twice is written twice, with
        # the same value): the work is the histories' length, not rows x vocabulary.
        rows, ids = joined(rep_rows, rep_ids)
        pen = _to_device(rep_pen, logits.dtype, device)[rows]
        seen = logits[rows, ids]
        vals = torch.where(seen > 0, seen / pen, seen * pen)
        # A penalty near 0 makes infinities (and -inf * 0 = nan): keep the row samplable.
        big = torch.finfo(logits.dtype).max
        vals = torch.nan_to_num(vals, nan=float("-inf"), posinf=big, neginf=float("-inf"))
        logits.index_put_((rows, ids), vals)
    if out_rows:
        counts = torch.zeros_like(logits)
        rows, ids = joined(out_rows, out_ids)
        counts.index_put_((rows, ids), torch.ones(len(ids), device=device), accumulate=True)
        freq = _to_device(frequency, logits.dtype, device)[:, None]
        pres = _to_device(presence, logits.dtype, device)[:, None]
        logits -= freq * counts + pres * (counts > 0).to(logits.dtype)


def _output_tail(output: list[int], ahead: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The last ``n`` (>= 1) ids of ``output + ahead``."""
    if len(ahead) >= n:
        return ahead[len(ahead) - n :]
    return tuple(output[len(output) - (n - len(ahead)) :]) + ahead


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A few host values as a device tensor without waiting for the device: a blocking copy
    (``torch.tensor(values, device=...)``) synchronizes the stream, i.e. waits for the forward
    pass queued before it, which would undo the host work meant to overlap that pass."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """The distribution a sampled row draws from, in vLLM's order: temperature, min-p (against
    the most likely token's probability), then top-k and top-p over what min-p kept."""
    device = logits.device
    temps = _to_device([p.temperature for p in params], torch.float32, device)[:, None]
    logits = logits / temps
    if any(p.min_p > 0 for p in params):
        min_p = _to_device([p.min_p for p in params], torch.float32, device)[:, None]
        probs = torch.softmax(logits, dim=-1)
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        vocab = logits.shape[-1]
        ks = _to_device([k if 0 < k < vocab else vocab for k in top_k], torch.long, device)
        kth = logits.sort(dim=-1, descending=True).values.gather(-1, (ks - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):  # decided on the host: a device test would wait
        top_p = _to_device([p.top_p for p in params], torch.float32, device)[:, None]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop_sorted[:, 0] = False  # even when top_p rounds to 0 in float32
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def token_logprob(logprobs: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    chosen = logprobs[token_id].item()
    rank = int((logprobs > chosen).sum().item()) + 1
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        vals, ids = logprobs.topk(k)
        top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprob(token_id, chosen, rank, top)
