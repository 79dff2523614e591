"""``POST /v1/embeddings``: inputs in, one vector each out (see ``infer.core.pooling_params``).

Each input runs as its own engine request, batched with whatever else the engine is serving;
the answer comes when all of them have their vectors. With ``encoding_format: base64`` (what the
``openai`` SDK asks for by default) a vector is its little-endian float32 bytes in base64.
"""

from __future__ import annotations

import base64
import logging
import struct

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.core.outputs import RequestOutput
from infer.core.pooling_params import PoolingParams
from infer.core.sampling_params import InvalidRequestError
from infer.core.validation import check_prompt
from infer.server.completions import prompt_list
from infer.server.errors import APIError, from_invalid_request
from infer.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from infer.server.serving import Serving, cancel_on_disconnect, new_id, raise_if_failed

logger = logging.getLogger("infer.server")


async def create_embedding(serving: Serving, req: EmbeddingRequest, raw: Request) -> Response:
    model = serving.check_model(req.model)
    if req.model_extra:
        logger.info(
            "/v1/embeddings: ignoring unknown field(s) %s", ", ".join(sorted(req.model_extra))
        )
    inputs = prompt_list(req.input, param="input")
    token_inputs: list[list[int]] = []
    for i, text_or_ids in enumerate(inputs):
        param = "input" if len(inputs) == 1 else f"input[{i}]"
        if isinstance(text_or_ids, str):
            ids = await serving.run_blocking(serving.encode, text_or_ids, req.add_special_tokens,
                                             size=len(text_or_ids))  # fmt: skip
        else:
            ids = list(text_or_ids)
        ids = serving.truncated(ids, req)
        try:
            check_prompt(ids, serving.max_model_len, param=param, generates=False)
        except InvalidRequestError as e:
            raise from_invalid_request(e) from e
        token_inputs.append(ids)
    try:
        params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
    except InvalidRequestError as e:
        raise from_invalid_request(e) from e
    request_id = new_id("embd")
    raw.state.request_id = request_id
    stream = await serving.submit(request_id, token_inputs, params, req)
    return await cancel_on_disconnect(raw, _collect(stream, req, raw, request_id, model))


async def _collect(stream, req: EmbeddingRequest, raw: Request, request_id: str,
                   model: str) -> Response:  # fmt: skip
    finals: list[RequestOutput | None] = [None] * len(stream.request_ids)
    async for index, out in stream:
        if out.finished:
            finals[index] = out
    data = []
    prompt_tokens = 0
    for index, final in enumerate(finals):
        assert final is not None
        raise_if_failed(final)
        if final.embedding is None:  # aborted: a timeout, or the server shutting down
            raise APIError(503, f"the request ended before its embeddings were computed "
                           f"({final.error or final.finish_reason})", type="server_error",
                           code="aborted")  # fmt: skip
        vector: list[float] | str = final.embedding
        if req.encoding_format == "base64":
            vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        data.append(EmbeddingData(index=index, embedding=vector))
        prompt_tokens += final.num_prompt_tokens
    raw.state.usage = (prompt_tokens, 0)
    usage = EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
    body = EmbeddingResponse(id=request_id, model=model, data=data, usage=usage)
    return JSONResponse(body.model_dump(mode="json"))
