"""``POST /v1/embeddings``: inputs in, one vector each out (see ``infer.core.pooling_params``);
and the routes built on it: ``/score`` and ``/rerank`` (``scoring.py``).

Each input runs as its own engine request, batched with whatever else the engine is serving;
the answer comes when all of them have their vectors. With ``encoding_format: base64`` (what the
``openai`` SDK asks for by default) a vector is its little-endian float32 bytes in base64.
"""

from __future__ import annotations

import base64
import logging
import struct
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.core.outputs import RequestOutput
from infer.core.pooling_params import PoolingParams, class_probabilities
from infer.core.sampling_params import InvalidRequestError
from infer.core.validation import check_prompt
from infer.server.chat import has_images, render_chat
from infer.server.completions import prompt_list
from infer.server.errors import APIError, bad_request, from_invalid_request
from infer.server.protocol import (
    ClassificationRequest,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
)
from infer.server.serving import Serving, cancel_on_disconnect, new_id, raise_if_failed

logger = logging.getLogger("infer.server")


def log_unknown_fields(req: Any, route: str) -> None:
    if req.model_extra:
        logger.info("%s: ignoring unknown field(s) %s", route, ", ".join(sorted(req.model_extra)))


async def tokenize_inputs(serving: Serving, inputs: list[str | list[int]], req: Any,
                          params: list[str]) -> list[list[int]]:  # fmt: skip
    """Each input's token ids (a text with the tokenizer's special tokens unless the request's
    ``add_special_tokens`` is false), cut by ``truncate_prompt_tokens``; a 400 naming
    ``params[i]`` for an input that cannot be embedded."""
    special = getattr(req, "add_special_tokens", True)
    out = []
    for text_or_ids, param in zip(inputs, params, strict=True):
        if isinstance(text_or_ids, str):
            ids = await serving.run_blocking(serving.encode, text_or_ids, special,
                                             size=len(text_or_ids))  # fmt: skip
        else:
            ids = list(text_or_ids)
        ids = serving.truncated(ids, req)
        try:
            check_prompt(ids, serving.max_model_len, param=param, generates=False)
        except InvalidRequestError as e:
            raise from_invalid_request(e) from e
        out.append(ids)
    return out


async def embed(serving: Serving, token_inputs: list[list[int]],
                params: PoolingParams | list[PoolingParams], req: Any, raw: Request,
                prefix: str) -> tuple[str, list[RequestOutput], EmbeddingUsage]:  # fmt: skip
    """Run ``token_inputs`` as embedding requests (``params`` for all, or one per input): the
    request id, each input's final output (its ``embedding`` set) and the usage; a 500 / 503
    when one failed or was aborted."""
    request_id = new_id(prefix)
    raw.state.request_id = request_id
    stream = await serving.submit(request_id, token_inputs, params, req)

    async def collect() -> tuple[list[RequestOutput], EmbeddingUsage]:
        finals: list[RequestOutput | None] = [None] * len(stream.request_ids)
        async for index, out in stream:
            if out.finished:
                finals[index] = out
        for final in finals:
            assert final is not None
            raise_if_failed(final)
            if final.embedding is None:  # aborted: a timeout, or the server shutting down
                raise APIError(503, f"the request ended before its embeddings were computed "
                               f"({final.error or final.finish_reason})", type="server_error",
                               code="aborted")  # fmt: skip
        prompt_tokens = sum(f.num_prompt_tokens for f in finals if f is not None)
        raw.state.usage = (prompt_tokens, 0)
        usage = EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
        return finals, usage  # type: ignore[return-value]

    finals, usage = await cancel_on_disconnect(raw, collect())
    return request_id, finals, usage


def pooling_params(**fields: Any) -> PoolingParams:
    try:
        return PoolingParams(**fields)
    except InvalidRequestError as e:
        raise from_invalid_request(e) from e


_Pooled = EmbeddingRequest | ClassificationRequest | PoolingRequest


async def _render_messages(serving: Serving, req: _Pooled) -> list[int]:
    """A conversation's ids as the chat template writes it (the template's own special tokens;
    the tokenizer's too only when the request sets ``add_special_tokens``), cut and checked as
    any input is."""
    special = req.add_special_tokens if "add_special_tokens" in req.model_fields_set else False
    if has_images(req.messages):
        raise bad_request("embeddings of prompts with images are not served", param="messages")

    def render() -> list[int]:
        return render_chat(serving, req.messages or [],
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message,
                           kwargs=req.chat_template_kwargs, add_special_tokens=special)  # fmt: skip

    ids = await serving.run_blocking(render, size=4096)
    return (await tokenize_inputs(serving, [ids], req, ["messages"]))[0]


async def pooling_inputs(serving: Serving, req: _Pooled) -> list[list[int]]:
    """The token ids of a request's ``input`` (each one checked and named), or of its one
    conversation (``messages``); a 400 unless it gives exactly one of the two."""
    if (req.input is None) == (req.messages is None):
        raise bad_request("give exactly one of 'input' and 'messages'", param="input")
    if req.messages is not None:
        return [await _render_messages(serving, req)]
    inputs = prompt_list(req.input, param="input")
    params = ["input"] if len(inputs) == 1 else [f"input[{i}]" for i in range(len(inputs))]
    return await tokenize_inputs(serving, inputs, req, params)


async def create_embedding(serving: Serving, req: EmbeddingRequest, raw: Request) -> Response:
    model = serving.check_model(req.model)
    log_unknown_fields(req, "/v1/embeddings")
    token_inputs = await pooling_inputs(serving, req)
    pooling = pooling_params(normalize=req.normalize, dimensions=req.dimensions)
    request_id, finals, usage = await embed(serving, token_inputs, pooling, req, raw, "embd")
    data = [EmbeddingData(index=index, embedding=_encoded(final.embedding, req.encoding_format))  # type: ignore[arg-type]
            for index, final in enumerate(finals)]  # fmt: skip
    body = EmbeddingResponse(id=request_id, model=model, data=data, usage=usage)
    return JSONResponse(body.model_dump(mode="json"))


def _encoded(values: list[float] | list[list[float]], encoding_format: str
             ) -> list[float] | list[list[float]] | str:  # fmt: skip
    """``values`` as the request's ``encoding_format`` asks: as they are, or (base64) their
    little-endian float32 bytes, rows in order."""
    if encoding_format != "base64":
        return values
    flat = [v for row in values for v in row] if values and isinstance(values[0], list) else values
    return base64.b64encode(struct.pack(f"<{len(flat)}f", *flat)).decode("ascii")


async def late_interaction_inputs(
    serving: Serving, items: list[tuple[str | list[int], str]], req: Any, **fields: Any
) -> tuple[list[list[int]], list[PoolingParams]]:
    """A ColBERT model's inputs for ``items`` (``(text or token ids, "query" or
    "document")``), encoded as the model encodes each role (model/late_interaction.py: cut to
    its lengths, never a 400 for a long text), and each one's token-embedding parameters
    (``fields``: normalize, dimensions)."""
    li = serving.late_interaction
    special = getattr(req, "add_special_tokens", True)
    inputs, params = [], []
    for text, role in items:
        if isinstance(text, str):
            ids = await serving.run_blocking(serving.encode, text, special, size=len(text))
        else:
            ids = list(text)
        ids = serving.truncated(ids, req)
        ids, attended = li.query(ids) if role == "query" else (li.document(ids), None)
        inputs.append(ids)
        params.append(pooling_params(task="token_embed", attended_tokens=attended, **fields))
    return inputs, params


async def create_pooling(serving: Serving, req: PoolingRequest, raw: Request,
                         default_task: str) -> Response:  # fmt: skip
    """``POST /pooling``: each input's pooled data as ``req.task`` (else ``default_task``)
    asks (:class:`PoolingRequest`); a ColBERT model's ``input_type`` encodes every input as
    a query or a document."""
    model = serving.check_model(req.model)
    log_unknown_fields(req, "/pooling")
    task = req.task or default_task
    if req.input_type is not None:
        if serving.late_interaction is None or task != "token_embed":
            raise bad_request("input_type is for a ColBERT model's token embeddings (its "
                              "queries and documents are encoded differently)",
                              param="input_type")  # fmt: skip
        if req.input is None:
            raise bad_request("input_type takes 'input', not 'messages'", param="input")
        inputs = prompt_list(req.input, param="input")
        token_inputs, pooling = await late_interaction_inputs(
            serving, [(text, req.input_type) for text in inputs], req,
            normalize=req.normalize, dimensions=req.dimensions)  # fmt: skip
    else:
        token_inputs = await pooling_inputs(serving, req)
        fields: dict[str, Any] = {"task": task, "use_activation": req.wants_activation}
        classifies = task in ("classify", "token_classify")
        if not classifies or req.normalize is not None or req.dimensions is not None:
            fields |= {"normalize": req.normalize, "dimensions": req.dimensions}
        pooling = pooling_params(**fields)
    request_id, finals, usage = await embed(serving, token_inputs, pooling, req, raw, "pool")
    if req.input_type == "document":  # (its skiplist words' vectors left out)
        li = serving.late_interaction
        for final, ids in zip(finals, token_inputs, strict=True):
            final.embedding = li.document_vectors(ids, final.embedding)  # type: ignore[arg-type]
    if task == "classify" and req.wants_activation:  # (token_classify's: the engine's)
        for final in finals:
            final.embedding = class_probabilities(final.embedding)  # type: ignore[arg-type]
    data = [PoolingData(index=index, data=_encoded(final.embedding, req.encoding_format))  # type: ignore[arg-type]
            for index, final in enumerate(finals)]  # fmt: skip
    body = PoolingResponse(id=request_id, model=model, data=data, usage=usage)
    return JSONResponse(body.model_dump(mode="json"))
