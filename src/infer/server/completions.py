"""``POST /v1/completions``: prompts in, text out (streamed over SSE or in one body)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.core.outputs import RequestOutput
from infer.core.request import TokenLogprob
from infer.engine.async_engine import RequestStream
from infer.server.errors import bad_request
from infer.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    UsageInfo,
)
from infer.server.serving import (
    Choices,
    Serving,
    SSEResponse,
    cancel_on_disconnect,
    new_id,
    raise_if_failed,
    sse,
    stream_events,
    usage_totals,
)


def _prompt_list(prompt) -> list[str | list[int]]:
    """Normalise OpenAI's four prompt forms to a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def completion_logprobs(
    serving: Serving, lps: list[TokenLogprob], k: int, offset: int
) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy logprobs block; returns it and the text offset after its tokens."""
    out = CompletionLogprobs()
    for lp in lps:
        token = serving.token_str(lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        top = {serving.token_str(t): v for t, v in lp.top[:k]}
        top.setdefault(token, lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out, offset


async def create_completion(serving: Serving, req: CompletionRequest, raw: Request) -> Response:
    model = serving.check_model(req.model)
    serving.check_fields(req, "/v1/completions")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs needs prompt logprobs, which infer does not compute",
                          param="echo")  # fmt: skip
    prompts = _prompt_list(req.prompt)
    token_prompts: list[list[int]] = []
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise bad_request("the prompt is empty", param=param)
            ids = await serving.run_blocking(serving.encode, p, size=len(p))
        else:
            ids = list(p)
        serving.check_lengths(ids, req.max_tokens, param)
        token_prompts.append(ids)
    params = serving.sampling_params(req, req.max_tokens, req.logprobs)
    request_id = new_id("cmpl")
    raw.state.request_id = request_id
    stream = await serving.submit(request_id, token_prompts, params, req)
    echo: list[str] | None = None
    if req.echo:
        echo = [p if isinstance(p, str) else serving.tokenizer.decode(p) for p in prompts]
    if req.stream:
        return SSEResponse(_stream(serving, req, raw, stream, request_id, model, echo))
    return await cancel_on_disconnect(raw, _collect(serving, req, raw, stream, request_id, model,
                                                    echo))  # fmt: skip


async def _collect(serving: Serving, req: CompletionRequest, raw: Request, stream: RequestStream,
                   request_id: str, model: str, echo: list[str] | None) -> Response:  # fmt: skip
    n = req.n
    acc = Choices(len(stream.request_ids))
    async for index, out in stream:
        acc.add(index, out)
    choices = []
    for index, final in enumerate(acc.final):
        assert final is not None
        raise_if_failed(final)
        text = "".join(acc.text[index])
        if echo is not None:
            text = echo[index // n] + text
        logprobs = None
        if req.logprobs is not None:
            logprobs, _ = completion_logprobs(serving, acc.logprobs[index], req.logprobs, 0)
        choices.append(
            CompletionChoice(index=index, text=text, logprobs=logprobs,
                             finish_reason=final.finish_reason, stop_reason=final.stop_reason)
        )  # fmt: skip
    prompt, completion, cached = usage_totals(acc.final, n)
    raw.state.usage = (prompt, completion)
    body = CompletionResponse(id=request_id, model=model, choices=choices,
                              usage=serving.usage(prompt, completion, cached))  # fmt: skip
    return JSONResponse(body.model_dump(mode="json"))


def _stream(serving: Serving, req: CompletionRequest, raw: Request, stream: RequestStream,
            request_id: str, model: str, echo: list[str] | None) -> AsyncIterator[bytes]:  # fmt: skip
    created = int(time.time())
    started = [False] * len(stream.request_ids)
    offsets = [0] * len(stream.request_ids)

    def render(index: int, out: RequestOutput, usage: UsageInfo | None) -> bytes | None:
        text = out.new_text
        if echo is not None and not started[index]:
            text = echo[index // req.n] + text
        started[index] = True
        if not (text or out.new_token_ids or out.finished or out.new_logprobs):
            return None
        # NOTE: a step that made tokens but no text yet (mid-character, held back for a possible
        # stop string) still sends its chunk, with empty text: one event per generated token,
        # so clients timing inter-token latency see the engine's pace, not the text's.
        logprobs = None
        if req.logprobs is not None:
            logprobs, offsets[index] = completion_logprobs(
                serving, out.new_logprobs, req.logprobs, offsets[index]
            )
        chunk = CompletionStreamResponse(
            id=request_id, created=created, model=model, usage=usage,
            choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                      finish_reason=out.finish_reason if out.finished else None,
                                      stop_reason=out.stop_reason)],
        )  # fmt: skip
        return sse(chunk.model_dump_json())

    def render_usage(usage: UsageInfo) -> bytes:
        chunk = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                         usage=usage)  # fmt: skip
        return sse(chunk.model_dump_json())

    return stream_events(serving, req, raw, stream, render, render_usage)
