"""Turn a ``SchedulerOutput`` into tensors, run the model once, sample.

The flat batch for a step with a prefill chunk and two decodes::

    chunks        : A: 5 tokens from position 3 (prefill) | B: 1 token at 17 | C: 1 token at 9
    input_ids     : a3 a4 a5 a6 a7                         | b17              | c9
    positions     : 3  4  5  6  7                          | 17               | 9
    sample rows   :              ^ (if A's chunk ends its prompt)  ^                 ^

Only the last row of each chunk that reaches the end of its sequence goes through the LM head
and the sampler, so a long prefill costs one vocab projection, not one per token.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from infer.core.messages import (
    KVImport,
    ModelRunnerOutput,
    Sampled,
    SchedulerOutput,
    SequenceSlice,
    StepBatch,
    StepTimings,
)
from infer.core.multimodal import ImageInput, ImageSlice, image_slices
from infer.core.request import Request, TokenLogprob
from infer.model.parallel import TensorParallel
from infer.runner.attention import AttentionContext, KVCache, default_backend
from infer.runner.cpu.decode_fast import FastDecoder
from infer.runner.cpu.step_inputs import HostStepInputs
from infer.runner.gpu.select import resolve_attention_backend
from infer.runner.lora.manager import LoRAManager
from infer.runner.sampler import PendingSample, Sampler, token_logprob

if TYPE_CHECKING:
    from infer.runner.gpu.cuda_step import CudaStep

# Attention on CUDA without cuDNN's: it plans each (batch, longest context) shape it has not
# seen, ~40 ms of CPU time on an H200, and a decode batch's longest context grows by one token
# every step, so nearly every step paid it (a batch of 16 at 512 tokens: 43.5 ms a step, 87% of
# it in that planning). The memory-efficient kernel takes the masks and plans nothing.
CUDA_SDPA_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


class BatchSender(Protocol):
    def send(self, batch: StepBatch) -> None: ...


NO_PROPOSALS: list[int] = []  # a decode chunk's proposals (read only, shared)

FAST_DECODE_ENV = "INFER_FAST_DECODE"
"""Set to 0 to run every step through the model's modules (for measuring the fast path)."""


Pooled = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
"""A step's pooled rows (float32 ``[pooled requests, size]``, None: none), its
token-embedding rows (each such request's input rows in turn, after its first ``token_first``:
BGE-M3's skip its CLS; None: none) and its token-classification rows (each such request's
:func:`classified_span` in turn, the token head's logits): three tensors, as each may have
its own width."""


@dataclass(frozen=True)
class TokenRows:
    """Which of an input's rows its per-token outputs cover, and the token head's activation
    (the engine sets them from the model): token embeddings skip the first ``token_first``
    (BGE-M3's multi-vector output skips its CLS); token classifications skip a first token
    equal to ``skip[0]`` and a last equal to ``skip[1]`` (BGE-M3's sparse weights: its
    ``<s>`` and ``</s>``; None: every token) and take ``activation`` (``softmax`` over the
    labels, ``sigmoid``, ``relu``) unless a request asks for the raw logits."""

    token_first: int = 0
    skip: tuple[int | None, int | None] | None = None
    activation: str = "softmax"

    def classified_span(self, ids: list[int]) -> tuple[int, int]:
        """The first and end index of ``ids`` whose rows a token classification gives."""
        if self.skip is None:
            return 0, len(ids)
        first = 1 if ids and ids[0] == self.skip[0] else 0
        end = len(ids) - (1 if len(ids) > first and ids[-1] == self.skip[1] else 0)
        return first, end


@dataclass(frozen=True)
class TokenFeed:
    """Input ids of a step launched before the step it follows has reached the host: row
    ``rows[i]`` of the new step takes ``tokens[sources[i]]`` (the earlier step's sampled ids, on
    the device)."""

    tokens: torch.Tensor
    rows: list[int]
    sources: list[int]


@dataclass
class InFlightStep:
    """A launched step (:meth:`ModelRunner.launch`) until :meth:`ModelRunner.collect`."""

    out: SchedulerOutput
    sample_reqs: list[Request]
    proposals: list[list[int]]
    prompt_targets: list[tuple[Request, int]]
    logits: torch.Tensor | None  # None once sampled at launch (``pending``)
    prompt_logits: torch.Tensor | None
    pending: PendingSample | None  # the sampler's kernels queued at launch
    t0: float  # launch began
    t1: float  # inputs prepared
    t2: float  # launched
    # Embedding requests whose prompt this step ends, and their rows (ModelRunner.run's).
    pool_reqs: list[Request] = field(default_factory=list)
    pooled: Pooled | None = None


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        device: torch.device,
        seed: int = 0,
        num_swap_blocks: int = 0,
        max_num_seqs: int = 0,
        max_num_batched_tokens: int = 0,
        *,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        max_model_len: int = 0,
        num_spec_tokens: int = 0,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        # The one place the device's backend is chosen: on CUDA the Triton step (step buffers,
        # paged attention kernels, CUDA graphs for decode), or torch's (gather + SDPA, eager).
        self.attention_backend = resolve_attention_backend(attention_backend, device)
        # The torch path's attention (runner/attention/backend.py): the C++ kernels on a CPU,
        # else gather + SDPA; a measurement may swap in another (the null backend).
        self.attention = default_backend(device)
        self.cuda_step: CudaStep | None = None
        if self.attention_backend == "triton":
            sizes = {}
            if max_num_seqs:
                sizes = dict(
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
                )
            if max_model_len:
                sizes["max_model_len"] = max_model_len
            from infer.runner.gpu.cuda_step import CudaStep

            self.cuda_step = CudaStep(
                model,
                kv_cache,
                device,
                num_spec_tokens=num_spec_tokens,
                enforce_eager=enforce_eager,
                **sizes,
            )
        # Steps skip the module code where every kernel is there (decode_fast.py).
        self.fast_decoder: FastDecoder | None = None
        # The fast path calls its kernels straight on whole weights: no tensor parallelism.
        tp_size = getattr(model, "tp", TensorParallel()).size
        if (
            max_num_seqs
            and self.attention_backend == "cpu"
            and tp_size == 1
            and os.environ.get(FAST_DECODE_ENV, "1") != "0"
        ):
            rows = max(max_num_seqs, max_num_batched_tokens)
            self.fast_decoder = FastDecoder.build(model, kv_cache, rows)
        # A CPU step's inputs at fixed addresses (cpu/step_inputs.py); CUDA's are the Triton
        # step's buffers (gpu/step.py).
        self.step_inputs: HostStepInputs | None = None
        if device.type == "cpu" and max_num_seqs and max_model_len:
            self.step_inputs = HostStepInputs(
                max_rows=max(max_num_seqs, max_num_batched_tokens),
                max_seqs=max_num_seqs,
                max_blocks=-(-max_model_len // kv_cache.block_size),
            )
        self.sampler = Sampler(device, seed)
        # How embedding requests pool (the engine's PoolerConfig): LAST, or an encoder's CLS
        # or MEAN (the chunk of an encoder's input is the whole input).
        self.pooling_type = "LAST"
        # The model's Dense projections of a pooled embedding (model/dense.py; None: none).
        self.embed_projection: Callable[[torch.Tensor], torch.Tensor] | None = None
        # A token embedding's own projection (None: embed_projection) and how many of an
        # input's first rows have none (BGE-M3's multi-vector output skips its CLS).
        self.token_projection: Callable[[torch.Tensor], torch.Tensor] | None = None
        # A token classifier's head over rows of the model's dtype (float32 logits; BGE-M3's
        # sparse layer), and which rows the per-token outputs cover.
        self.token_classifier: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.token_rows = TokenRows()
        # A decoder pooling by the mean: each embedding request's float32 sum of its prompt's
        # final hidden states so far (its prompt runs in chunks, over several steps).
        self._mean_sums: dict[str, torch.Tensor] = {}
        # A vision-language model's image features by the image's digest, the newest last: an
        # image whose prompt runs in several chunks (or is sent again) is computed once.
        self._image_features: OrderedDict[str, torch.Tensor] = OrderedDict()
        # (a draft model runs the same requests as text: their placeholders' own embeddings)
        self.reads_images = hasattr(model, "embed_images")
        # Constrained decoding (infer.structured): set by the engine on first use.
        self.structured = None
        # The torch path waits for the GPU at the end of the forward pass (its timings); the
        # Triton step never does: the sampled ids' copy to the host is the step's one wait.
        self._sync = device.type == "cuda" and self.cuda_step is None
        # Tensor parallelism: the driver's link to the other ranks (set by the engine).
        self.workers: BatchSender | None = None
        # LoRA adapters (--enable-lora): slots for each step's adapters (set by the engine).
        self.lora: LoRAManager | None = None
        # Host memory for swapped-out KV blocks: same layout as the device cache's blocks (the
        # values, and their scales when the cache is quantized).
        self.swap_space: list[torch.Tensor] = []
        for view in kv_cache.block_views() if num_swap_blocks else []:
            shape = list(view.shape)
            shape[2] = num_swap_blocks
            self.swap_space.append(
                torch.zeros(shape, dtype=view.dtype, pin_memory=device.type == "cuda")
            )

    def swap_blocks(self, batch: StepBatch) -> None:
        """Copy swap-outs (device -> host) first, then swap-ins (host -> device)."""
        if not batch.swap_out and not batch.swap_in:
            return
        assert self.swap_space, "swap requested without swap space"
        for device_blocks, host_blocks in zip(
            self.kv_cache.block_views(), self.swap_space, strict=True
        ):
            if batch.swap_out:
                src, dst = zip(*batch.swap_out, strict=True)
                host_blocks[:, :, list(dst)] = device_blocks[:, :, list(src)].to("cpu")
            if batch.swap_in:
                src, dst = zip(*batch.swap_in, strict=True)
                device_blocks[:, :, list(dst)] = host_blocks[:, :, list(src)].to(self.device)

    # ---- prefill/decode disaggregation: whole blocks in the cache's layout -------------------
    def kv_layout(self, num_blocks: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``(dtype, shape)`` of each stored tensor's range of ``num_blocks`` blocks."""
        out = []
        for view in self.kv_cache.block_views():
            shape = list(view.shape)
            shape[2] = num_blocks
            out.append((str(view.dtype).removeprefix("torch."), tuple(shape)))
        return tuple(out)

    @torch.inference_mode()
    def export_kv(self, block_ids: list[int]) -> tuple[tuple, tuple]:
        """These blocks of every stored tensor, copied to host memory: ``(layout, arrays)``
        with each array the raw bytes (uint8 numpy) of a ``[2, layers, len(block_ids), ...]``
        range."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        arrays = []
        for view in self.kv_cache.block_views():
            if self.device.type == "cpu":
                # NOTE: one gather of every layer: gathering layer by layer from the strided
                # per-layer views took 450 ms for a 1024-token payload instead of 7 ms.
                blocks = view.index_select(2, index)
            else:  # one layer's device copy at a time (see import_kv)
                shape = list(view.shape)
                shape[2] = len(block_ids)
                blocks = torch.empty(shape, dtype=view.dtype, pin_memory=True)
                for layer in range(shape[1]):
                    blocks[:, layer] = view[:, layer].index_select(1, index).to("cpu")
            arrays.append(blocks.view(torch.uint8).numpy())
        return self.kv_layout(len(block_ids)), tuple(arrays)

    def import_kv(self, imports: list[KVImport]) -> None:
        """Copy each transferred payload's blocks (from ``first_block`` on) into the blocks
        the scheduler allocated for them."""
        for imp in imports:
            if not imp.block_ids:
                continue
            dst = torch.tensor(imp.block_ids, dtype=torch.long, device=self.device)
            first, last = imp.first_block, imp.first_block + len(imp.block_ids)
            views = self.kv_cache.block_views()
            for view, array, (dtype, shape) in zip(
                views, imp.payload.arrays, imp.payload.layout, strict=True
            ):
                with warnings.catch_warnings():  # read-only (Ray's object store): only read
                    warnings.simplefilter("ignore", UserWarning)
                    raw = torch.from_numpy(array)
                src = raw.view(getattr(torch, dtype)).view(shape)
                # NOTE: layer by layer: a device copy of one layer's blocks at a time, not of
                # the whole payload (on a GPU the cache leaves little memory beside it).
                for layer in range(shape[1]):
                    part = src[:, layer, first:last].to(self.device, non_blocking=True)
                    view[:, layer].index_copy_(1, dst, part)

    def _row_index(self, name: str, rows: list[int]) -> torch.Tensor:
        if self.cuda_step is not None:  # copied before the forward pass (CudaStep.forward)
            return self.cuda_step.staged_rows(name, rows)
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def capture_graphs(self) -> None:
        """Capture the CUDA graphs of decode steps (CUDA with the Triton backend, not eager),
        then launch once each kernel variant an eager step can use (``CudaStep.warm_up``:
        Triton compiles at start-up, not during a request)."""
        if self.cuda_step is not None:
            self.cuda_step.capture()
            if self.device.type == "cuda":  # (the interpreter compiles nothing)
                self.cuda_step.warm_up()

    def close(self) -> None:
        """Release what the device step holds beyond tensors (the CUDA graphs)."""
        if self.cuda_step is not None:
            self.cuda_step.close()

    def model_inputs(
        self, token_ids: list[int], positions: list[int], seqs: list[SequenceSlice]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """A torch-path pass's input ids, positions and attention context: in the runner's
        fixed buffers where it has them (:attr:`step_inputs`, a CPU), else new tensors."""
        inputs = self.step_inputs
        fixed = inputs and inputs.tokens(token_ids, positions)
        if fixed:
            ids_t, pos_t = fixed
        else:
            ids_t = torch.tensor(token_ids, dtype=torch.long, device=self.device)
            pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        ctx = AttentionContext(self.kv_cache, seqs, self.device, self.attention, inputs)
        return ids_t, pos_t, ctx

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final hidden states of one pass: the fast path where it covers the step, else the
        model's modules (``embeds``: rows' vectors in place of their tokens' embeddings, a
        prompt's image features)."""
        if embeds is None and self.fast_decoder is not None and self.fast_decoder.covers(ctx):
            return self.fast_decoder.forward(input_ids, positions, ctx)
        args = (
            (input_ids, positions, ctx) if embeds is None else (input_ids, positions, ctx, embeds)
        )
        if self.device.type == "cuda":
            with sdpa_kernel(CUDA_SDPA_BACKENDS):
                return self.model(*args)
        return self.model(*args)

    # Image features kept (by digest, the least recent out first) for the chunks and requests
    # that read them again, in vectors (LLaVA 1.5's image is 576, LLaVA-NeXT's up to ~2,900);
    # tiles the vision tower takes at once.
    MAX_CACHED_VECTORS = 16_384
    IMAGE_TILES = 8

    def _image_embeds(self, slices: list[ImageSlice]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's image rows and their features: ``(rows [K], vectors [K, hidden])``, the
        images not computed yet run through the vision tower together."""
        cache = self._image_features
        missing = list({s.image.digest: s.image for s in slices
                        if s.image.digest not in cache}.values())  # fmt: skip
        while missing:  # (a few tiles at a time: the tower's activations)
            batch, tiles = [], 0
            while missing and (not batch or tiles + _tiles(missing[0]) <= self.IMAGE_TILES):
                tiles += _tiles(missing[0])
                batch.append(missing.pop(0))
            pixels = [torch.from_numpy(im.pixel_values).to(self.device) for im in batch]
            features = self.model.embed_images(pixels, [im.size for im in batch])
            for image, vectors in zip(batch, features, strict=True):
                cache[image.digest] = vectors.clone()  # (its own memory: evicted alone)
        rows, parts = [], []
        for s in slices:
            cache.move_to_end(s.image.digest)
            rows.extend(range(s.row, s.row + s.end - s.first))
            parts.append(cache[s.image.digest][s.first : s.end])
        needed = {s.image.digest for s in slices}
        held = sum(len(v) for v in cache.values())
        while held > self.MAX_CACHED_VECTORS and next(iter(cache)) not in needed:
            held -= len(cache.popitem(last=False)[1])
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return index, torch.cat(parts)

    def prepare(
        self, out: SchedulerOutput, requests: dict[str, Request]
    ) -> tuple[StepBatch, list[Request], list[list[int]], list[tuple[Request, int]], list[Request]]:
        """The step's model inputs, and what sampling needs: the sampled requests, their
        proposals (speculative decoding), ``(request, position)`` of each prompt row, and the
        embedding requests whose prompt ends here (their rows are the batch's ``pool_rows``).
        ``requests`` (the scheduler's, by id) is read here only: nothing of a launched step
        looks a request up again, so a request that ends meanwhile (its id perhaps taken by a
        new one) changes nothing the step collects."""
        token_ids: list[int] = []
        positions: list[int] = []
        seqs: list[SequenceSlice] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        prompt_rows: list[int] = []
        prompt_targets: list[tuple[Request, int]] = []  # the prompt token each row predicts
        proposals: list[list[int]] = []  # per sampled chunk (speculative decoding)
        pool_rows: list[int] = []
        pool_starts: list[int] = []
        pool_reqs: list[Request] = []
        pool_sums: list[tuple[str, int, int, int]] = []
        pool_tokens: list[tuple[int, int]] = []  # (token_embed: every row of its input)
        token_reqs: list[Request] = []
        classify_tokens: list[tuple[int, int]] = []  # (token_classify)
        classify_reqs: list[Request] = []
        images: list[ImageSlice] = []
        by_mean = self.pooling_type == "MEAN"  # (an encoder's input or a decoder's prompt)
        # (a request that ended before its last chunk, aborted: its sum is dropped in run(),
        # on every tensor-parallel rank)
        pool_drop = [r for r in self._mean_sums if r not in requests] if self._mean_sums else []
        for chunk in out.chunks:
            n = len(chunk.token_ids)
            start = chunk.num_computed_tokens
            if n == 1 and chunk.sample:
                request = requests[chunk.request_id]
                # a decode (most rows of most steps): the short way
                if request.pooling is None and not (
                    self.reads_images and _in_image(request, start)
                ):
                    token_ids.append(chunk.token_ids[0])
                    positions.append(start)
                    seqs.append(SequenceSlice(start, 1, chunk.block_table))
                    sample_rows.append(len(token_ids) - 1)
                    sample_reqs.append(request)
                    proposals.append(NO_PROPOSALS)
                    continue
            token_ids.extend(chunk.token_ids)
            positions.extend(range(start, start + n))
            request = requests[chunk.request_id]
            if request.images and self.reads_images:
                images.extend(image_slices(request.images, start, start + n, len(token_ids) - n))
            pooling = request.pooling
            keys = None if pooling is None else pooling.attended_tokens
            seqs.append(SequenceSlice(start, n, chunk.block_table, chunk.num_spec_tokens > 0, keys))
            if by_mean and pooling is not None and not pooling.task.startswith("token_"):
                pool_sums.append((chunk.request_id, len(token_ids) - n, len(token_ids), start))
            if chunk.prompt_logprobs:
                first_row = len(token_ids) - n
                for i in range(n):
                    target = chunk.num_computed_tokens + i + 1
                    if target < request.num_prompt_tokens:
                        prompt_rows.append(first_row + i)
                        prompt_targets.append((request, target))
            if chunk.sample:
                end = len(token_ids)
                if pooling is not None and pooling.task == "token_embed":
                    pool_tokens.append((end - n + self.token_rows.token_first, end))  # (whole)
                    token_reqs.append(request)
                    continue
                if pooling is not None and pooling.task == "token_classify":
                    first, last = self.token_rows.classified_span(request.prompt_token_ids)
                    classify_tokens.append((end - n + first, end - n + last))  # (input: whole)
                    classify_reqs.append(request)
                    continue
                if pooling is not None:  # its embedding: the prompt's last row
                    pool_rows.append(end - 1)
                    pool_starts.append(end - n)  # (an encoder's: its whole input)
                    pool_reqs.append(request)
                    continue
                # A chunk with k proposals is scored at its last k + 1 rows.
                sample_rows.extend(range(end - 1 - chunk.num_spec_tokens, end))
                sample_reqs.append(request)
                proposals.append(chunk.spec_token_ids)
        batch = StepBatch(
            token_ids, positions, seqs, sample_rows, prompt_rows, out.swap_out, out.swap_in,
            self._lora_slots(out, requests), out.kv_imports, pool_rows, pool_starts, pool_sums,
            pool_drop, pool_tokens, classify_tokens, images,
        )  # fmt: skip
        return (batch, sample_reqs, proposals, prompt_targets,
                pool_reqs + token_reqs + classify_reqs)  # fmt: skip

    def _lora_slots(self, out: SchedulerOutput, requests: dict[str, Request]) -> list[int] | None:
        """Each row's adapter slot, the step's adapters put in slots first (None: no row has
        an adapter)."""
        if self.lora is None:
            return None
        loads = [requests[c.request_id].lora_id for c in out.chunks]
        wanted = {load for load in loads if load is not None}
        if not wanted:
            return None
        slot_of = self.lora.activate(wanted)
        rows: list[int] = []
        for chunk, load in zip(out.chunks, loads, strict=True):
            rows.extend([-1 if load is None else slot_of[load]] * len(chunk.token_ids))
        return rows

    @torch.inference_mode()
    def run(
        self, batch: StepBatch, feed: TokenFeed | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, Pooled | None]:
        """The model's part of a step, the same on every tensor-parallel rank: swap blocks,
        one forward pass, float32 logits of the sampled rows and of the prompt rows, and the
        float32 final hidden states of the pooled rows (embeddings; a copy, so a CUDA graph's
        next replay cannot overwrite it; a sequence classifier's: its head's logits) and of
        the token-embedding and token-classification rows (:data:`Pooled`).
        ``feed``: see :meth:`launch` (the Triton step only)."""
        self.swap_blocks(batch)
        if batch.kv_imports:  # after the swap-outs: a block freed by one may be a target
            self.import_kv(batch.kv_imports)
        if self.lora is not None:
            self.lora.set_step(batch.row_lora_slots, self.device)
        if self.cuda_step is not None:
            hidden = self.cuda_step.forward(batch, feed)
        else:
            if feed is not None:
                raise ValueError("a token feed needs the Triton step (its input buffers)")
            inputs = self.model_inputs(batch.token_ids, batch.positions, batch.seqs)
            if batch.images:  # (a prompt's image rows: their features in place of the tokens')
                hidden = self.forward(*inputs, embeds=self._image_embeds(batch.images))
            else:
                hidden = self.forward(*inputs)
        logits = prompt_logits = pooled = None
        for request_id in batch.pool_drop:
            self._mean_sums.pop(request_id, None)
        if batch.pool_sums:  # (the mean: each chunk summed, then each last one's)
            pooled = self._means(hidden, batch)
        elif batch.pool_rows:
            rows = batch.pool_starts if self.pooling_type == "CLS" else batch.pool_rows
            pooled = hidden[self._row_index("pool_rows", rows)]
        if pooled is not None:
            head = self.model.classifier  # (a sequence classifier: its logits, not the state)
            pooled = pooled.float() if head is None else head(pooled.to(hidden.dtype))
            if head is None and self.embed_projection is not None:
                pooled = self.embed_projection(pooled)
        tokens = None
        if batch.pool_tokens:  # (every row of each input, projected as a pooled vector is)
            tokens = torch.cat([hidden[a:b] for a, b in batch.pool_tokens]).float()
            project = self.token_projection or self.embed_projection
            if project is not None:
                tokens = project(tokens)
        classes = None
        if batch.classify_tokens:  # (every row of each input's span, through the token head)
            classes = torch.cat([hidden[a:b] for a, b in batch.classify_tokens])
            head = self.token_classifier
            classes = classes.float() if head is None else head(classes)
        if batch.sample_rows:
            if batch.samples_every_row:
                sampled = hidden  # (decode): no gather
            else:
                sampled = hidden[self._row_index("sample_rows", batch.sample_rows)]
            logits = self.model.compute_logits(sampled)
        if batch.prompt_rows:
            rows = self._row_index("prompt_rows", batch.prompt_rows)
            prompt_logits = self.model.compute_logits(hidden[rows]).float()
        if self._sync:
            torch.cuda.synchronize(self.device)
        parts = (pooled, tokens, classes)
        return logits, prompt_logits, None if parts == (None, None, None) else parts

    def _means(self, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor | None:
        """A mean-pooling step: each pooled request's chunk rows of ``hidden`` added to its
        running sum (a decoder's prompt runs in chunks; an encoder's input whole, in one; a
        chunk at position 0 starts it: the prompt ran again after a preemption); the float32
        means ``[len(pool_rows), hidden]`` of the prompts that end here, in ``pool_rows`` order
        (None: none ends)."""
        ends = {}
        for request_id, first, end, start in batch.pool_sums:
            part = hidden[first:end].float().sum(dim=0)
            before = self._mean_sums.pop(request_id, None)
            if start == 0:  # (its first chunk, or its prompt again after a preemption)
                before = None
            elif before is None:
                raise RuntimeError(f"embedding request {request_id}: its prompt's first "
                                   f"{start} tokens were never summed (a mean needs them all)")  # fmt: skip
            total = part if before is None else before + part
            if end - 1 in batch.pool_rows:
                ends[end - 1] = total / (start + end - first)
            else:
                self._mean_sums[request_id] = total
        if not batch.pool_rows:
            return None
        return torch.stack([ends[row] for row in batch.pool_rows])

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        requests: dict[str, Request],
        while_running: Callable[[], None] | None = None,
    ) -> ModelRunnerOutput:
        """Run one step: its sampled tokens, timings, and prompt logprobs by request.

        ``while_running`` is called once the forward pass is launched and before anything waits
        for it: on a GPU (asynchronous) the host's work there overlaps the device's."""
        step = self.launch(out, requests)
        if while_running is not None:
            while_running()
        return self.collect(step)

    @torch.inference_mode()
    def launch(
        self, out: SchedulerOutput, requests: dict[str, Request], feed: TokenFeed | None = None
    ) -> InFlightStep:
        """Queue a step's work without waiting for the device: inputs, forward pass, logits and,
        where :meth:`Sampler.can_launch` takes the batch, the sampler's kernels and the copy of
        the sampled ids (the rest of sampling is :meth:`collect`'s). ``feed`` (the Triton step
        only): input ids that the step before samples, taken on the device."""
        t0 = time.perf_counter()
        batch, sample_reqs, proposals, prompt_targets, pool_reqs = self.prepare(out, requests)
        if self.workers is not None:  # the other tensor-parallel ranks run the same batch
            self.workers.send(batch)
        t1 = time.perf_counter()
        logits, prompt_logits, pooled = self.run(batch, feed)
        pending = None
        if (
            logits is not None
            and not any(proposals)
            and (self.structured is None or not self.structured.matchers)
            and Sampler.can_launch(sample_reqs)
        ):
            pending = self.sampler.launch(logits, sample_reqs)
            logits = None  # sampled: not kept alive beside the next step's
        return InFlightStep(out, sample_reqs, proposals, prompt_targets, logits,
                            prompt_logits, pending, t0, t1, time.perf_counter(), pool_reqs,
                            pooled)  # fmt: skip

    @torch.inference_mode()
    def collect(self, step: InFlightStep) -> ModelRunnerOutput:
        """A launched step's sampled tokens (waiting for them), timings and prompt logprobs."""
        t_collect = time.perf_counter()
        prompt_lps = {}
        if step.prompt_logits is not None:
            prompt_lps = self._prompt_logprobs(step.prompt_logits, step.prompt_targets)
        results: list[Sampled] = []
        if step.pending is not None:
            results = list(step.pending.result())
        elif step.logits is not None:
            # NOTE: computed here, not on a thread during the forward pass: on two cores that
            # thread slowed the forward pass by about what it saved (measured).
            allowed = None if self.structured is None else self.structured.bitmask(step.sample_reqs)
            if any(step.proposals):
                results = list(
                    self.sampler.verify(step.logits, step.sample_reqs, step.proposals, allowed)
                )
            else:
                results = list(self.sampler.sample(step.logits, step.sample_reqs, allowed))
        sampled: dict[str, Sampled] = {}
        for request, result in zip(step.sample_reqs, results, strict=True):
            sampled[request.request_id] = result
        embeddings = {}
        if step.pooled is not None:
            embeddings = pool(step.pooled, step.pool_reqs, self.token_rows)
        t3 = time.perf_counter()
        # forward: queueing the pass (on a GPU; the whole pass on a CPU); sample: from the
        # collect on, the wait for the device included
        timings = StepTimings(step.t1 - step.t0, step.t2 - step.t1, t3 - t_collect)
        return ModelRunnerOutput(sampled, timings, prompt_lps, embeddings)

    def _prompt_logprobs(
        self, logits: torch.Tensor, targets: list[tuple[Request, int]]
    ) -> dict[str, list[tuple[int, TokenLogprob]]]:
        """Each prompt row's log-probability of the prompt token it predicts, + top-k."""
        logprobs = torch.log_softmax(logits, dim=-1)
        out: dict[str, list[tuple[int, TokenLogprob]]] = {}
        for j, (request, position) in enumerate(targets):
            k = request.sampling_params.prompt_logprobs or 0
            token = request.prompt_token_ids[position]
            lp = token_logprob(logprobs[j], token, k)
            out.setdefault(request.request_id, []).append((position, lp))
        return out


def _tiles(image: ImageInput) -> int:
    """The vision tower's inputs an image is (LLaVA-NeXT's: the whole image and its tiles)."""
    shape = image.pixel_values.shape
    return shape[0] if len(shape) == 4 else 1


def _in_image(request: Request, position: int) -> bool:
    """Whether prompt ``position`` may be an image's (before the end of its last one)."""
    return bool(request.images) and position < request.images[-1].end


def pool(
    pooled: Pooled, requests: list[Request], token_rows: TokenRows = TokenRows()
) -> dict[str, list[float] | list[list[float]]]:
    """Each embedding request's data from its rows of ``pooled`` (the pooled requests first,
    then the ``token_embed`` ones, then the ``token_classify`` ones, whose rows are a list
    each): a vector cut to its ``dimensions``, then scaled to unit length if it normalizes
    (the engine has resolved ``normalize`` from the model's configuration); a token
    classification's logits through ``token_rows.activation`` unless it asks for them raw."""
    out: dict[str, list[float] | list[list[float]]] = {}
    at = [0, 0, 0]
    for request in requests:
        params = request.pooling
        assert params is not None
        kind = {"token_embed": 1, "token_classify": 2}.get(params.task, 0)
        if kind == 1:
            n = max(0, request.num_prompt_tokens - token_rows.token_first)
        elif kind == 2:
            first, end = token_rows.classified_span(request.prompt_token_ids)
            n = end - first
        else:
            n = 1
        rows = pooled[kind]
        assert rows is not None
        rows = rows[at[kind] : at[kind] + n]
        at[kind] += n
        if kind == 2:
            if params.use_activation:
                rows = _activate(rows, token_rows.activation)
            out[request.request_id] = rows.tolist()
            continue
        if params.dimensions is not None:
            rows = rows[:, : params.dimensions]
        if params.normalize:
            rows = torch.nn.functional.normalize(rows, dim=1)
        out[request.request_id] = rows.tolist() if kind == 1 else rows[0].tolist()
    for kind, rows in enumerate(pooled):
        assert at[kind] == (0 if rows is None else len(rows)), f"{at} of {pooled} rows used"
    return out


def _activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """``[T, labels]`` logits through a token head's activation (softmax over the labels)."""
    if activation == "softmax":
        return torch.softmax(logits, dim=1)
    return torch.sigmoid(logits) if activation == "sigmoid" else torch.relu(logits)
