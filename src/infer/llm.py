"""The offline API: ``LLM(model=...).generate(prompts, params)``.

Drives an ``LLMEngine`` in a loop until every request finishes. ``n > 1`` fans out into child
sequences (seeded children use ``seed + i`` so they differ yet stay reproducible).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import threading
from collections.abc import Sequence
from typing import Any

from infer.config import EngineConfig
from infer.core.beam_search import (
    BeamSearch,
    BeamSearchParams,
    advance_all,
    beam_text,
    round_prompts,
    rounds_for,
)
from infer.core.lora_request import LoRARequest
from infer.core.multimodal import ImageInput
from infer.core.outputs import (
    BeamSearchOutput,
    BeamSequence,
    ClassificationOutput,
    ClassificationResult,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingResult,
    GenerationResult,
    PoolingOutput,
    PoolingResult,
    RequestOutput,
    ScoreOutput,
    ScoreResult,
)
from infer.core.pooling_params import (
    PoolingParams,
    check_cross_encoder,
    class_probabilities,
    cosine,
    relevance,
    score_pairs,
)
from infer.core.sampling_params import InvalidRequestError, SamplingParams
from infer.engine.engine import LLMEngine
from infer.model.chat_template import message_images, render_chat_ids
from infer.model.images import Pixels
from infer.model.tokenizer import encode_pair

PromptInput = str | Sequence[int] | dict[str, Any]


class LLM:
    """Generate text offline, many prompts at once, with continuous batching.

    ``engine_options`` are the fields of ``ModelConfig``, ``CacheConfig``,
    ``SchedulerConfig`` and ``ParallelConfig`` (``max_num_seqs=16``,
    ``enable_prefix_caching=True``, ``tensor_parallel_size=2``, ...). With tensor parallelism,
    :meth:`close` (or a ``with`` block) stops the worker processes.
    """

    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
        self._ids = itertools.count()
        # One call drives the engine at a time: two threads stepping it at once would each
        # drop the other's outputs (and race inside the forward pass), so they take turns.
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism) and drop its CUDA graphs."""
        self.engine.close()

    shutdown = close  # vLLM's name

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion; results come back in prompt order.

        ``lora_request``: one adapter for every prompt, or one per prompt (None: the base
        model; a name: an adapter loaded before, e.g. by ``--lora-modules``); needs
        ``LLM(..., enable_lora=True)``. Safe to call from several threads (the
        calls take turns). If the call fails or is interrupted (Ctrl-C), its requests are
        aborted: nothing of it is left in the engine."""
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        # Bad words tokenized once per params, not per prompt and choice (the engine's own
        # call is then a no-op).
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        tokenized = {id(p): p.with_bad_words_tokenized(encode) for p in params_list}
        params_list = [tokenized[id(p)] for p in params_list]
        loras = self._loras(lora_request, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"{len(priority)} priorities for {len(prompt_list)} prompts")
        prompts_in = [self._multimodal(p, i, len(prompt_list)) for i, p in enumerate(prompt_list)]
        encoded = [ids for ids, _ in prompts_in]
        images = [ims for _, ims in prompts_in]
        for params in params_list:
            if params.structured_outputs is not None:  # a bad grammar raises here, naming it
                from infer.structured import compile_grammar

                compile_grammar(params.structured_outputs)

        with self._lock:
            children, collected = self._run(encoded, params_list, priority, cache_salt, loras,
                                            images)  # fmt: skip
        results = []
        for i, token_ids in enumerate(encoded):
            rids = [rid for rid, (pi, _) in children.items() if pi == i]
            outputs = [_merge(j, collected[rid]) for j, rid in enumerate(rids)]
            last = [collected[rid][-1] for rid in rids]
            results.append(
                GenerationResult(
                    request_id=rids[0].rsplit("-", 1)[0],
                    prompt=_prompt_text(prompt_list[i]),
                    prompt_token_ids=list(token_ids),
                    outputs=outputs,
                    num_cached_tokens=last[0].num_cached_tokens,
                    timings=[o.timings for o in last if o.timings is not None],
                    prompt_logprobs=next(
                        (o.prompt_logprobs for o in collected[rids[0]] if o.prompt_logprobs),
                        None,
                    ),
                )
            )
        return results

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        lora_request: LoRARequest | str | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        **template_kwargs: Any,
    ) -> GenerationResult | list[GenerationResult]:
        """Render ``messages`` with the model's chat template (or ``chat_template``) and
        generate a reply: one conversation (a list of ``{"role", "content"}`` dicts; content a
        string or a list of text parts) gives one result, a list of conversations a list of
        results, generated together. The options are vLLM's ``LLM.chat``'s; template variables
        go in ``chat_template_kwargs`` or as keywords (``enable_thinking=False``). A template
        that cannot render them raises ``InvalidRequestError`` naming ``messages``."""
        batch = bool(messages) and isinstance(messages[0], (list, tuple))
        conversations = messages if batch else [messages]
        kwargs = {**(chat_template_kwargs or {}), **template_kwargs}
        vision = self.engine.image_prompts
        prompts: list[Any] = []
        for c in conversations:
            ids = render_chat_ids(self.tokenizer, list(c), chat_template=chat_template,
                                  add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message, tools=tools,
                                  documents=documents, template_kwargs=kwargs,
                                  image_token=None if vision is None else vision.token)  # fmt: skip
            found = message_images(list(c))
            if found and vision is not None:  # (read here: an error names the message's part)
                pixels = [vision.pixels(image, place, local_files=True) for image, place in found]
                prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": pixels}})
            else:
                prompts.append(ids)
        results = self.generate(prompts, sampling_params, lora_request=lora_request)
        return results if batch else results[0]

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        lora_request: LoRARequest | str | None = None,
    ) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` likeliest continuations of each prompt (vLLM's
        ``LLM.beam_search``; the search itself: ``infer.core.beam_search``). Every round runs
        each live beam as a one-token request, all prompts' beams in one batch;
        ``lora_request``: the adapter every round runs with (as in :meth:`generate`)."""
        prompt_list = _normalize_prompts(prompts)
        encoded = [self._encode(p, i, len(prompt_list)) for i, p in enumerate(prompt_list)]
        eos = frozenset(self.engine.eos_token_ids)
        context, kv_tokens = self.engine.max_model_len, self.engine.capacity.num_tokens
        searches = [BeamSearch(params, eos, rounds_for(params, True, len(ids), context, kv_tokens))
                    for ids in encoded]  # fmt: skip
        step = params.round_params()
        while any(s.live for s in searches):
            rows = round_prompts(searches, encoded)
            results = self.generate(rows, step, lora_request=lora_request)
            advance_all(searches, [r.outputs[0].logprobs[0].top for r in results])  # type: ignore[index]
        return [
            BeamSearchOutput(
                prompt=p if isinstance(p, str) else None,
                prompt_token_ids=ids,
                sequences=[
                    BeamSequence(
                        list(b.token_ids),
                        beam_text(self.tokenizer, b.token_ids),
                        b.cum_logprob,
                        b.finish_reason(),
                    )
                    for b in search.best()
                ],  # fmt: skip
            )
            for p, ids, search in zip(prompt_list, encoded, searches, strict=True)
        ]

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        *,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[EmbeddingResult]:
        """Each prompt's embedding (vLLM's ``LLM.embed``): the final hidden state of its last
        token, cut to ``pooling_params.dimensions`` and normalized as the model's
        sentence-transformers files say (or as ``pooling_params.normalize`` asks). The prompts
        run as prefills (batched, chunked, prefix-cached); results in prompt order."""
        prompt_list = _normalize_prompts(prompts)
        encoded = [self._encode(p, i, len(prompt_list)) for i, p in enumerate(prompt_list)]
        pooled = self._pool(encoded, pooling_params or PoolingParams(), lora_request, "embedding")
        return [
            EmbeddingResult(
                request_id=rid,
                prompt=prompt_list[i] if isinstance(prompt_list[i], str) else None,
                prompt_token_ids=list(encoded[i]),
                outputs=EmbeddingOutput(last.embedding),  # type: ignore[arg-type]
                num_cached_tokens=last.num_cached_tokens,
                timings=last.timings,
            )
            for i, rid, last in pooled
        ]

    def encode(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        *,
        pooling_task: str = "token_embed",
        input_type: str | None = None,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[PoolingResult]:
        """Each prompt's pooled data as a tensor (vLLM's ``LLM.encode``): with ``pooling_task``
        ``token_embed`` (an encoder's) one vector per input token, ``[tokens, size]`` (cut
        and normalized per token as ``pooling_params`` or the model's files say: a ColBERT
        model's late-interaction vectors); ``token_classify`` (a ``*ForTokenClassification``
        model's) each input token's label probabilities, ``[tokens, labels]`` (BGE-M3's sparse
        weight of each token but ``<s>`` and ``</s>``: ``[tokens - 2, 1]``); ``embed`` the
        embedding :meth:`embed` gives; ``classify`` a sequence classifier's label
        probabilities (``pooling_params.use_activation`` false: the raw logits, for either
        classification; ``pooling_task`` decides the task: that of ``pooling_params`` is not
        read). ``input_type`` (a ColBERT model's token embeddings):
        ``query`` or ``document``, each prompt encoded as one (:mod:`infer.model.late_interaction`;
        a document's skiplist words' vectors left out). Results in prompt order."""
        params = pooling_params or PoolingParams()
        if params.task != pooling_task:
            params = dataclasses.replace(params, task=pooling_task)
        prompt_list = _normalize_prompts(prompts)
        encoded = [self._encode(p, i, len(prompt_list)) for i, p in enumerate(prompt_list)]
        each: PoolingParams | list[PoolingParams] = params
        li = self.engine.late_interaction
        if input_type is not None:
            if li is None or pooling_task != "token_embed" or input_type not in ("query",
                                                                                 "document"):  # fmt: skip
                raise InvalidRequestError(
                    "input_type ('query' or 'document') is for a ColBERT model's token "
                    f"embeddings, got {input_type!r}", param="input_type")  # fmt: skip
            roles = [li.query(ids) if input_type == "query" else (li.document(ids), None)
                     for ids in encoded]  # fmt: skip
            encoded = [ids for ids, _ in roles]
            each = [dataclasses.replace(params, attended_tokens=n) for _, n in roles]
        pooled = self._pool(encoded, each, lora_request, pooling_task)
        if input_type == "document":  # (its skiplist words' vectors left out)
            for i, _, last in pooled:
                last.embedding = li.document_vectors(encoded[i], last.embedding)  # type: ignore[union-attr,arg-type]
        if pooling_task == "classify" and params.use_activation:
            for _, _, last in pooled:
                last.embedding = class_probabilities(last.embedding)  # type: ignore[arg-type]
        widths = {"token_embed": self.engine.token_embedding_size,
                  "token_classify": len(self.engine.token_classes)}  # fmt: skip
        return [
            PoolingResult(
                request_id=rid,
                prompt=prompt_list[i] if isinstance(prompt_list[i], str) else None,
                prompt_token_ids=list(encoded[i]),
                outputs=PoolingOutput(_as_tensor(last.embedding, widths.get(pooling_task))),
                num_cached_tokens=last.num_cached_tokens,
                timings=last.timings,
            )
            for i, rid, last in pooled
        ]

    def classify(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        *,
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
    ) -> list[ClassificationResult]:
        """Each prompt's classification by a sequence classifier (vLLM's ``LLM.classify``;
        ``*ForSequenceClassification`` models): its ``score`` head's logits over the final
        hidden state of the last token, their probabilities and the likeliest label. The
        prompts run as prefills (batched, chunked, prefix-cached); results in prompt order."""
        prompt_list = _normalize_prompts(prompts)
        encoded = [self._encode(p, i, len(prompt_list)) for i, p in enumerate(prompt_list)]
        pooled = self._pool(encoded, PoolingParams(task="classify"), lora_request, "classify")
        labels = self.engine.spec.labels
        return [
            ClassificationResult(
                request_id=rid,
                prompt=prompt_list[i] if isinstance(prompt_list[i], str) else None,
                prompt_token_ids=list(encoded[i]),
                outputs=ClassificationOutput.from_logits(last.embedding, labels),  # type: ignore[arg-type]
                num_cached_tokens=last.num_cached_tokens,
                timings=last.timings,
            )
            for i, rid, last in pooled
        ]

    def _pool(
        self,
        encoded: list[list[int]],
        params: PoolingParams | list[PoolingParams],
        lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None,
        what: str,
    ) -> list[tuple[int, str, RequestOutput]]:
        """Run ``encoded`` as pooling requests (``params`` for all, or one per input):
        ``(prompt index, request id, final output)`` for each, in prompt order."""
        loras = self._loras(lora_request, len(encoded))
        each = params if isinstance(params, list) else [params] * len(encoded)
        with self._lock:
            children, collected = self._run(encoded, each, None, None, loras)
        out = []
        for rid, (i, _) in children.items():
            last = collected[rid][-1]
            if last.embedding is None:  # (failed: the engine says why)
                raise RuntimeError(f"{what} prompt {i} failed: {last.error or last.finish_reason}")
            out.append((i, rid.rsplit("-", 1)[0], last))
        return out

    def score(
        self,
        text_1: PromptInput | Sequence[PromptInput],
        text_2: PromptInput | Sequence[PromptInput],
        *,
        lora_request: LoRARequest | str | None = None,
    ) -> list[ScoreResult]:
        """How alike texts are (vLLM's ``LLM.score``), for one ``text_1`` against each
        ``text_2``, or pair by pair when both give as many. An embedding model: the cosine
        similarity of their embeddings (:meth:`embed`; each distinct text embedded once). A
        cross-encoder (a one-label sequence classifier): each pair runs through the model as
        one input (the tokenizer's pair encoding, or the model's ``rerank_template`` with the
        two written in; two token-id lists are joined as they are), scored by the sigmoid of its
        logit (the logit itself where the model's saved activation is ``Identity``)."""
        first, second = _normalize_prompts(text_1), _normalize_prompts(text_2)
        pairs = score_pairs(len(first), len(second))
        if self.engine.spec.is_classifier:
            return self._cross_encode(first, second, pairs, lora_request)
        if self.engine.late_interaction is not None:
            return self._late_interaction(first, second, pairs, lora_request)
        texts = [*first, *second]
        keys = [t if isinstance(t, str) else tuple(t) for t in texts]
        distinct = list(dict.fromkeys(keys))
        try:
            results = self.embed([k if isinstance(k, str) else list(k) for k in distinct],
                                 PoolingParams(normalize=True), lora_request=lora_request)  # fmt: skip
        except InvalidRequestError as e:  # name the text as the call gave it, not its embed's
            if e.param is not None and e.param.startswith("prompt"):
                k = int(e.param[8:-1]) if e.param.startswith("prompts[") else 0
                at = keys.index(distinct[k])
                e.param = f"text_1[{at}]" if at < len(first) else f"text_2[{at - len(first)}]"
            raise
        vector = {k: r.outputs.embedding for k, r in zip(distinct, results, strict=True)}
        out = []
        for i, j in pairs:
            score = cosine(vector[keys[i]], vector[keys[len(first) + j]])
            out.append(ScoreResult(first[i], second[j], ScoreOutput(score)))
        return out

    def _late_interaction(
        self,
        first: list[PromptInput],
        second: list[PromptInput],
        pairs: list[tuple[int, int]],
        lora_request: LoRARequest | str | None,
    ) -> list[ScoreResult]:
        """A ColBERT model's MaxSim score of each pair: ``text_1`` encoded as queries,
        ``text_2`` as documents (:mod:`infer.model.late_interaction`), each once."""

        from infer.model.late_interaction import maxsim

        unit = PoolingParams(normalize=True)
        queries = self.encode(first, unit, input_type="query", lora_request=lora_request)
        docs = self.encode(second, unit, input_type="document", lora_request=lora_request)
        return [ScoreResult(first[i], second[j],
                            ScoreOutput(maxsim(queries[i].outputs.data, docs[j].outputs.data)))
                for i, j in pairs]  # fmt: skip

    def _cross_encode(
        self,
        first: list[PromptInput],
        second: list[PromptInput],
        pairs: list[tuple[int, int]],
        lora_request: LoRARequest | str | None,
    ) -> list[ScoreResult]:
        check_cross_encoder(len(self.engine.spec.labels))
        activation = self.engine.spec.score_activation
        encoded = []
        for k, (i, j) in enumerate(pairs):
            a, b = first[i], second[j]
            if isinstance(a, str) and isinstance(b, str):
                encoded.append(encode_pair(self.tokenizer, a, b,
                                           template=self.engine.spec.rerank_template))  # fmt: skip
            elif not isinstance(a, str) and not isinstance(b, str):
                ids = self._encode(a, i, 2), self._encode(b, j, 2)
                encoded.append(ids[0] + ids[1])
            else:
                raise InvalidRequestError(
                    f"pair {k} joins a text and token ids: give both as texts or both as ids",
                    param="text_2",
                )
            if not encoded[-1]:
                raise InvalidRequestError(f"pair {k} is empty", param="text_2")
        pooled = self._pool(encoded, PoolingParams(task="classify"), lora_request, "score")
        return [
            ScoreResult(first[pairs[k][0]], second[pairs[k][1]],
                        ScoreOutput(relevance(last.embedding, activation)))  # type: ignore[arg-type]
            for k, _, last in pooled
        ]  # fmt: skip

    def _loras(
        self, lora_request: LoRARequest | str | Sequence[LoRARequest | str | None] | None, n: int
    ) -> list[LoRARequest | str | None]:
        """One adapter for each of ``n`` prompts (one for all, or one per prompt)."""
        if lora_request is None or isinstance(lora_request, (LoRARequest, str)):
            return [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"{len(loras)} LoRA requests for {n} prompts")
        return loras

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` sample with when given no ``SamplingParams``:
        infer's defaults with the model's recommended ones (its generation_config.json:
        temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) over them, as
        vLLM's method of this name (``generation_config="none"`` leaves infer's). Where the
        model recommends a length, ``max_tokens`` is None: the engine gives each prompt that
        length, or what the context and the KV cache leave it."""
        defaults = dict(self.engine.sampling_defaults)
        if "max_tokens" in defaults:  # None: the engine fits the model's length to each prompt
            defaults["max_tokens"] = None
        return SamplingParams(**defaults)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def _run(
        self,
        encoded: list[list[int]],
        params_list: Sequence[SamplingParams | PoolingParams],
        priority: Sequence[int] | None,
        cache_salt: str | None,
        loras: Sequence[LoRARequest | str | None],
        images: Sequence[tuple[ImageInput, ...]] | None = None,
    ) -> tuple[dict[str, tuple[int, int]], dict[str, list[RequestOutput]]]:
        """Add every (prompt, choice) as a request and step the engine until all finish: the
        request ids (-> prompt index, choice index) and each one's outputs. Whatever stops it
        (a refused request, an error, Ctrl-C) aborts the requests it added first."""
        children: dict[str, tuple[int, int]] = {}
        collected: dict[str, list[RequestOutput]] = {}
        try:
            for i, (token_ids, params) in enumerate(zip(encoded, params_list, strict=True)):
                base = str(next(self._ids))
                sampling = isinstance(params, SamplingParams)
                for j in range(params.n if sampling else 1):
                    rid = f"{base}-{j}"
                    self.engine.add_request(
                        rid,
                        token_ids,
                        params.for_choice(j) if sampling else params,
                        priority=priority[i] if priority else 0,
                        cache_salt=cache_salt,
                        lora_request=loras[i],
                        images=images[i] if images else (),
                    )
                    children[rid] = (i, j)
                    collected[rid] = []
            while any(not outs or not outs[-1].finished for outs in collected.values()):
                for out in self.engine.step():
                    if out.request_id in collected:
                        collected[out.request_id].append(out)
        except BaseException:
            for rid, outs in collected.items():
                if not outs or not outs[-1].finished:
                    self.engine.abort_request(rid)
            self._drain()
            raise
        return children, collected

    def _multimodal(
        self, prompt: PromptInput | dict[str, Any], index: int, count: int
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """A prompt's ids and images: a string or ids as :meth:`_encode`, or vLLM's dict form,
        ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` with ``"multi_modal_data":
        {"image": an image or a list}`` (one placeholder in the prompt for each, in order)."""
        if not isinstance(prompt, dict):
            return self._encode(prompt, index, count), ()
        param = "prompt" if count == 1 else f"prompts[{index}]"
        text = prompt.get("prompt", prompt.get("prompt_token_ids"))
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
        if text is None or unknown:
            raise InvalidRequestError(f"{param}: a prompt dict has 'prompt' or 'prompt_token_ids' "
                                      "and 'multi_modal_data'"
                                      + (f" (not {', '.join(unknown)})" if unknown else ""),
                                      param=param)  # fmt: skip
        ids = self._encode(text, index, count)
        data = prompt.get("multi_modal_data") or {}
        other = sorted(set(data) - {"image"})
        if other:
            raise InvalidRequestError(f"{param}: multi_modal_data takes images ('image'), not "
                                      f"{', '.join(other)}", param=param)  # fmt: skip
        found = data.get("image")
        if found is None:
            return ids, ()
        found = list(found) if isinstance(found, list | tuple) else [found]
        vision = self.engine.image_prompts
        if vision is None:
            raise InvalidRequestError(f"this model ({self.engine.spec.architecture}) reads no "
                                      "images", param=param)  # fmt: skip
        pixels = [im if isinstance(im, Pixels)  # (LLM.chat's, read already)
                  else vision.pixels(im, f"{param}.multi_modal_data.image[{k}]", local_files=True)
                  for k, im in enumerate(found)]  # fmt: skip
        return vision.expand(ids, pixels, param)

    def _encode(self, prompt: PromptInput, index: int, count: int) -> list[int]:
        param = "prompt" if count == 1 else f"prompts[{index}]"
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", param=param)
            # (with the tokenizer's special tokens, e.g. Llama's BOS, as vLLM's LLM adds them)
            return self.tokenizer.encode(prompt)
        try:  # (token ids of any integer type: Python's, numpy's, a tensor's elements)
            return [operator.index(t) for t in prompt]
        except TypeError:
            raise InvalidRequestError(
                f"a prompt is a string or a list of token ids, got {type(prompt).__name__}: "
                f"{prompt!r:.60}",
                param=param,
            ) from None

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def _prompt_text(prompt: Any) -> str | None:
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt")
    return prompt if isinstance(prompt, str) else None


def _normalize_prompts(prompts) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _merge(index: int, outs: list[RequestOutput]) -> CompletionOutput:
    last = outs[-1]
    logprobs = [lp for o in outs for lp in o.new_logprobs]
    return CompletionOutput(
        index=index,
        text="".join(o.new_text for o in outs),
        token_ids=[t for o in outs for t in o.new_token_ids],
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        logprobs=logprobs or None,
    )


def _as_tensor(data: list, row_width: int | None) -> Any:
    """A pooling result as a float32 tensor (rows of ``row_width`` values, a per-token task's:
    ``[0, row_width]`` where it covers no token)."""
    import torch

    if row_width is not None and not data:
        return torch.zeros(0, row_width)
    return torch.tensor(data, dtype=torch.float32)
