"""``POST /v1/completions``: prompts in, text out (streamed over SSE or in one body)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.core.beam_search import beam_text
from infer.core.kv_transfer import KV_TRANSFER_SCOPE_KEY
from infer.core.outputs import RequestOutput
from infer.core.request import TokenLogprob
from infer.engine.async_engine import RequestStream
from infer.server import beam
from infer.server.errors import bad_request
from infer.server.fim import fim_prompt, fim_tokens
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
from infer.server.stream_json import EventTemplate, completion_choice


def prompt_list(prompt, param: str = "prompt") -> list[str | list[int]]:
    """Normalise OpenAI's four prompt forms (``param``: the field) to a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request(f"the {param} is empty", param=param)
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def completion_logprobs(
    serving: Serving, lps: list[TokenLogprob], k: int, offset: int
) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy logprobs block; returns it and the text offset after its tokens."""
    return _logprobs_block(serving, [(lp.token_id, lp) for lp in lps], k, offset)


def echo_logprobs(serving: Serving, prompt_ids: list[int], lps: list[TokenLogprob | None] | None,
                  k: int) -> tuple[CompletionLogprobs, int]:  # fmt: skip
    """The echoed prompt's part of the logprobs block (the first token has none)."""
    return _logprobs_block(serving, list(zip(prompt_ids, lps or [], strict=False)), k, 0)


def _logprobs_block(serving: Serving, entries: list[tuple[int, TokenLogprob | None]], k: int,
                    offset: int) -> tuple[CompletionLogprobs, int]:  # fmt: skip
    out = CompletionLogprobs()
    for token_id, lp in entries:
        token = serving.token_str(token_id)
        out.tokens.append(token)
        out.token_logprobs.append(None if lp is None else lp.logprob)
        top = None
        if lp is not None:
            top = {serving.token_str(t): v for t, v in lp.top[:k]}
            top.setdefault(token, lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out, offset


def _join(a: CompletionLogprobs | None, b: CompletionLogprobs) -> CompletionLogprobs:
    if a is None:
        return b
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens,
                              top_logprobs=a.top_logprobs + b.top_logprobs)  # fmt: skip


async def create_completion(serving: Serving, req: CompletionRequest, raw: Request) -> Response:
    model = serving.check_model(req.model)
    serving.check_fields(req, "/v1/completions")
    prompts = prompt_list(req.prompt)
    fim = None
    if req.suffix:
        fim = fim_tokens(serving.tokenizer)
        if fim is None:
            raise bad_request("suffix needs a fill-in-the-middle model: this model's tokenizer "
                              "has no FIM tokens (<|fim_prefix|>, <fim_prefix>, ...)",
                              param="suffix")  # fmt: skip
        if req.echo:
            raise bad_request("echo cannot be combined with suffix", param="echo")
    token_prompts: list[list[int]] = []
    # No max_tokens in the request: the model's default where it has one (None: the engine
    # fits it to each prompt's room), else OpenAI's 16; null is the model's default too.
    max_tokens = req.max_tokens
    if "max_tokens" not in req.model_fields_set and "max_tokens" in serving.sampling_defaults:
        max_tokens = None
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise bad_request("the prompt is empty", param=param)
            # (a fill-in-the-middle prompt is its tokens: no BOS in the middle of it)
            special = req.add_special_tokens and fim is None
            ids = await serving.run_blocking(serving.encode, p, special, size=len(p))
        else:
            ids = list(p)
        if fim is not None:
            assert req.suffix is not None
            ids = fim_prompt(fim, ids, serving.encode(req.suffix))
        ids = serving.truncated(ids, req)
        serving.check_lengths(ids, max_tokens, param)
        token_prompts.append(ids)
    best_of = req.best_of or req.n
    if best_of < req.n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({req.n})", param="best_of")
    if best_of > req.n and req.stream:
        raise bad_request("best_of > n cannot stream: the best are known only at the end",
                          param="best_of")  # fmt: skip
    echo: list[str] | None = None
    if req.echo:
        echo = [p if isinstance(p, str) else serving.tokenizer.decode(p) for p in prompts]
    if req.use_beam_search:
        return await cancel_on_disconnect(
            raw, _beam_search(serving, req, raw, token_prompts, echo, max_tokens, model)
        )
    params = serving.sampling_params(req, max_tokens, req.logprobs)
    if req.echo and req.logprobs is not None:  # the echoed prompt's tokens get logprobs too
        params = replace(params, prompt_logprobs=max(req.logprobs, req.prompt_logprobs or 0))
    if best_of > req.n:  # every candidate's logprobs rank them
        params = replace(params, n=best_of, logprobs=params.logprobs or 0)
    request_id = new_id("cmpl")
    raw.state.request_id = request_id
    stream = await serving.submit(
        request_id, token_prompts, params, req, raw.scope.get(KV_TRANSFER_SCOPE_KEY)
    )
    if req.stream:
        return SSEResponse(_stream(serving, req, raw, stream, request_id, model, echo,
                                   token_prompts), on_close=stream.abort)  # fmt: skip
    return await cancel_on_disconnect(raw, _collect(serving, req, raw, stream, request_id, model,
                                                    echo, token_prompts))  # fmt: skip


async def _beam_search(serving: Serving, req: CompletionRequest, raw: Request,
                       token_prompts: list[list[int]], echo: list[str] | None,
                       max_tokens: int | None, model: str) -> Response:  # fmt: skip
    """``use_beam_search``: prompt ``i``'s beams are choices ``i * n ...``, best first."""
    beam.check_beam_request(req)
    request_id = new_id("cmpl")
    raw.state.request_id = request_id
    found, aborted = await beam.search(serving, req, token_prompts, max_tokens, request_id)
    choices = []
    for i, beams in enumerate(found):
        for b in beams:
            text = beam_text(serving.tokenizer, b.token_ids, req.skip_special_tokens)
            choices.append(CompletionChoice(index=len(choices),
                                            text=(echo[i] if echo else "") + text,
                                            finish_reason=b.finish_reason(aborted)))  # fmt: skip
    prompt, completion = beam.usage_of(token_prompts, found)
    raw.state.usage = (prompt, completion)
    body = CompletionResponse(id=request_id, model=model, choices=choices,
                              usage=serving.usage(prompt, completion, 0))  # fmt: skip
    return JSONResponse(body.model_dump(mode="json"))


async def _collect(serving: Serving, req: CompletionRequest, raw: Request, stream: RequestStream,
                   request_id: str, model: str, echo: list[str] | None,
                   token_prompts: list[list[int]]) -> Response:  # fmt: skip
    best_of = req.best_of or req.n
    acc = Choices(len(stream.request_ids))
    async for index, out in stream:
        acc.add(index, out)
    for final in acc.final:
        assert final is not None
        raise_if_failed(final)
    # Per prompt, its best_of candidates ranked by cumulative logprob (all of them, in order,
    # when best_of == n), the first n kept.
    picked: list[int] = []
    for first in range(0, len(acc.final), best_of):
        candidates = list(range(first, first + best_of))
        if best_of > req.n:
            candidates.sort(key=lambda i: -sum(lp.logprob for lp in acc.logprobs[i]))
        picked.extend(candidates[: req.n])
    choices = []
    for index, source in enumerate(picked):
        final = acc.final[source]
        assert final is not None
        text = "".join(acc.text[source])
        if echo is not None:
            text = echo[source // best_of] + text
        logprobs = None
        prompt_lps = acc.prompt_logprobs[source]
        if req.logprobs is not None:
            offset = 0
            lps = acc.logprobs[source]
            if echo is not None:
                prompt_ids = token_prompts[source // best_of]
                logprobs, offset = echo_logprobs(serving, prompt_ids, prompt_lps, req.logprobs)
            more, _ = completion_logprobs(serving, lps, req.logprobs, offset)
            logprobs = _join(logprobs, more)
        choices.append(
            CompletionChoice(index=index, text=text, logprobs=logprobs,
                             finish_reason=final.finish_reason, stop_reason=final.stop_reason,
                             prompt_logprobs=serving.prompt_logprobs(prompt_lps,
                                                                     req.prompt_logprobs or 0)
                             if req.prompt_logprobs is not None else None)
        )  # fmt: skip
    # Usage counts every candidate generated, as OpenAI bills best_of.
    prompt, completion, cached = usage_totals(acc.final, best_of)
    raw.state.usage = (prompt, completion)
    body = CompletionResponse(id=request_id, model=model, choices=choices,
                              usage=serving.usage(prompt, completion, cached))  # fmt: skip
    return JSONResponse(body.model_dump(mode="json"))


def _stream(serving: Serving, req: CompletionRequest, raw: Request, stream: RequestStream,
            request_id: str, model: str, echo: list[str] | None,
            token_prompts: list[list[int]]) -> AsyncIterator[bytes]:  # fmt: skip
    created = int(time.time())
    started = [False] * len(stream.request_ids)
    offsets = [0] * len(stream.request_ids)
    template = EventTemplate(
        CompletionStreamResponse(id=request_id, created=created, model=model, choices=[])
    )

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
            if echo is not None and out.prompt_logprobs is not None:
                logprobs, offsets[index] = echo_logprobs(
                    serving, token_prompts[index // req.n], out.prompt_logprobs, req.logprobs
                )
            more, offsets[index] = completion_logprobs(
                serving, out.new_logprobs, req.logprobs, offsets[index]
            )
            logprobs = _join(logprobs, more)
        prompt_lps = None
        if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
            prompt_lps = serving.prompt_logprobs(out.prompt_logprobs, req.prompt_logprobs)
        if logprobs is None and prompt_lps is None and usage is None:  # most events
            finish = out.finish_reason if out.finished else None
            return template.event(completion_choice(index, text, finish, out.stop_reason))
        chunk = CompletionStreamResponse(
            id=request_id, created=created, model=model, usage=usage,
            choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                      finish_reason=out.finish_reason if out.finished else None,
                                      stop_reason=out.stop_reason, prompt_logprobs=prompt_lps)],
        )  # fmt: skip
        return sse(chunk.model_dump_json())

    def render_usage(usage: UsageInfo) -> bytes:
        chunk = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[],
                                         usage=usage)  # fmt: skip
        return sse(chunk.model_dump_json())

    return stream_events(serving, req, raw, stream, render, render_usage)
