"""The FastAPI application: routes, middleware, engine lifecycle.

``build_app(engine, settings)`` wraps an already-loaded ``LLMEngine``; the engine thread starts
with the app (lifespan) and stops after the in-flight requests drained.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from infer.core.outputs import RequestOutput
from infer.engine.async_engine import AsyncEngine
from infer.server import metrics as metrics_mod
from infer.server.chat import create_chat_completion, render_request, with_images
from infer.server.classify import create_classification
from infer.server.completions import create_completion
from infer.server.dashboard import Dashboard, install_dashboard
from infer.server.embeddings import create_embedding, create_pooling
from infer.server.errors import APIError, install_error_handlers
from infer.server.fim import fim_tokens
from infer.server.lora_routes import install_lora_routes, runtime_lora_updating
from infer.server.messages import count_tokens, create_message
from infer.server.messages_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    MessagesStreamEvent,
)
from infer.server.middleware import (
    AccessLogMiddleware,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    OverloadMiddleware,
    UnexpectedErrorMiddleware,
)
from infer.server.protocol import (
    VOCAB_BOUND,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ClassificationRequest,
    ClassificationResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from infer.server.responses import ResponseStore, create_response
from infer.server.responses_protocol import (
    DeletedResponse,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from infer.server.scoring import create_rerank, create_score
from infer.server.serving import ServerSettings, Serving

logger = logging.getLogger("infer.server")

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": why}
    for status, why in [
        (400, "invalid request (the error names the field)"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "body over --max-request-bytes"),
        (409, "the server's set-up does not allow it (e.g. prefix caching is off)"),
        (429, "waiting queue full"),
        (500, "the engine failed on this request"),
        (503, "shutting down"),
    ]
}


def _streamed(model: type) -> dict[int | str, dict[str, Any]]:
    # One SSE event (OpenAPI before 3.2: `schema` of an event stream describes each event): its
    # data is the JSON chunk, an error object, or the closing [DONE].
    chunk = {"anyOf": [{"$ref": f"#/components/schemas/{model.__name__}"},
                       {"$ref": "#/components/schemas/ErrorResponse"}]}  # fmt: skip
    schema = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": chunk,
                    },  # fmt: skip
                ]
            },
        },
    }
    return {
        200: {
            "description": "JSON body, or with stream=true an SSE stream of "
            f"`data: <{model.__name__}>` events ending with `data: [DONE]`",
            "content": {"text/event-stream": {"schema": schema}},
        },
        **_ERRORS,
    }


def _no_fastapi_telemetry() -> dict[str, Any]:
    """FastAPI's own OpenTelemetry hooks off, where it has them (0.16x): per request they asked
    whether a tracer or meter provider was set up (~6% of the server's CPU for a one-token
    streamed completion on a 2-core VM). infer exports Prometheus metrics (/metrics), no
    OpenTelemetry."""
    import inspect

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    off = {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}
    return {"telemetry": off}


def build_app(engine: Any, settings: ServerSettings) -> FastAPI:
    """The HTTP app over ``engine`` (an ``LLMEngine``, already loaded)."""
    served = settings.served_model_names
    metrics = metrics_mod.ServerMetrics(served[0], engine.max_model_len, lambda: async_engine.stats,
                                        counts_requests=settings.role != "prefill")  # fmt: skip
    dashboard: Dashboard | None = None

    def on_finished(out: RequestOutput) -> None:
        metrics.observe_finished(out)
        if dashboard is not None:
            dashboard.observe_finished(out)

    async_engine = AsyncEngine(
        engine,
        max_queued_requests=engine.config.scheduler.max_queued_requests,
        request_timeout=settings.request_timeout,
        on_finished=on_finished,
    )
    if settings.dashboard:
        dashboard = Dashboard(async_engine, served[0], settings.role)
    serving = Serving(async_engine, engine.tokenizer, settings, engine.max_model_len,
                      str(engine.model_path))  # fmt: skip
    serving.lora_adapters = dict(getattr(engine, "lora_adapters", None) or {})
    serving.sampling_defaults = dict(getattr(engine, "sampling_defaults", None) or {})
    serving.eos_token_ids = tuple(engine.eos_token_ids)
    serving.kv_tokens = engine.capacity.num_tokens
    serving.labels = tuple(engine.spec.labels)
    serving.encoder_only = engine.spec.encoder_only() if engine.spec.is_encoder else None
    serving.score_activation = engine.spec.score_activation
    serving.rerank_template = engine.spec.rerank_template
    serving.late_interaction = getattr(engine, "late_interaction", None)
    if engine.spec.images is not None:  # (the server process reads and expands images)
        from infer.model.images import ImagePrompts

        serving.image_prompts = ImagePrompts(engine.model_path, engine.spec, engine.tokenizer)
    lora_parents = dict(getattr(engine, "lora_parents", None) or {})
    prefix_caching = engine.config.cache.enable_prefix_caching

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.drain(settings.drain_timeout)
        await async_engine.shutdown()

    app = FastAPI(
        title="infer",
        summary="OpenAI-compatible LLM serving",
        version=_version(),
        lifespan=lifespan,
        strict_content_type=False,
        **_no_fastapi_telemetry(),
    )
    app.state.serving = serving
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    install_error_handlers(app)

    # HEAD too: load balancers' and orchestrators' probes often send it.
    @app.api_route("/health", methods=["GET", "HEAD"], response_model=HealthResponse,
                   tags=["ops"])  # fmt: skip
    async def health() -> HealthResponse:
        """200 while the engine thread is alive (no API key needed); GET or HEAD."""
        if async_engine.dead is not None:
            raise APIError(503, f"the engine has stopped: {async_engine.dead}")
        return HealthResponse()

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS, tags=["openai"])
    async def models() -> ModelList:
        """The served model names, then the loaded LoRA adapters (``parent``: the base)."""
        return ModelList(data=[model_card(name) for name in (*served, *serving.lora_adapters)])

    def model_card(name: str) -> ModelCard:
        path = serving.lora_adapters.get(name) if name not in served else None
        if path is not None:
            return ModelCard(id=name, root=path, parent=lora_parents.get(name, served[0]),
                             max_model_len=engine.max_model_len)  # fmt: skip
        return ModelCard(id=name, root=str(engine.model_path), max_model_len=engine.max_model_len)

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS,
             tags=["openai"])  # fmt: skip
    async def model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return model_card(model_id)

    if engine.config.lora is not None and runtime_lora_updating():
        install_lora_routes(app, serving, served)

    @app.get("/version", tags=["ops"])
    async def version() -> dict[str, str]:
        return {"version": _version()}

    # (an encoder generates nothing: the generation routes answer it 400, out of its schema)
    generates = not engine.spec.is_encoder

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses=_streamed(CompletionStreamResponse), tags=["openai"],
              include_in_schema=generates)  # fmt: skip
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(serving, body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=_streamed(ChatCompletionStreamResponse), tags=["openai"],
              include_in_schema=generates)  # fmt: skip
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(serving, body, request)

    responses_store = ResponseStore(api_servers=settings.api_server_count)

    @app.post("/v1/responses", response_model=ResponseObject,
              responses=_streamed(ResponseStreamEvent), tags=["openai"],
              include_in_schema=generates)  # fmt: skip
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API: ``input`` items in, output items (reasoning, message,
        function calls) out, streamed as typed events with ``stream``; kept in memory for
        ``previous_response_id`` unless ``store`` is false."""
        return await create_response(serving, responses_store, body, request)

    @app.post("/v1/messages", response_model=MessagesResponse,
              responses=_streamed(MessagesStreamEvent), tags=["anthropic"],
              include_in_schema=generates)  # fmt: skip
    async def messages(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API: content blocks in and out (text, tool use, thinking),
        streamed as Anthropic's events with ``stream``."""
        return await create_message(serving, body, request)

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse,
              responses=_ERRORS, tags=["anthropic"], include_in_schema=generates)  # fmt: skip
    async def messages_count_tokens(body: CountTokensRequest) -> Response:
        """How many tokens a Messages request's prompt holds (its system, messages, tools)."""
        return await count_tokens(serving, body)

    # (one route for both methods: a 405's Allow header then names both)
    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"],
                   response_model=ResponseObject | DeletedResponse, responses=_ERRORS,
                   tags=["openai"])  # fmt: skip
    async def stored_response(response_id: str, request: Request) -> Response:
        """GET: a stored response; DELETE: forget it (404 where none is kept under this id)."""
        if request.method == "DELETE":
            responses_store.delete(response_id)
            return JSONResponse(DeletedResponse(id=response_id).model_dump(mode="json"))
        return JSONResponse(responses_store.get(response_id).response)

    # (a token classifier serves none of the routes of one vector an input: out of its schema)
    vectors = not engine.spec.token_labels

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS,
              tags=["openai"], include_in_schema=vectors)  # fmt: skip
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        """Each input's embedding: the final hidden state of its last token (normalized as the
        model's sentence-transformers files say; ``--pooler-config`` overrides)."""
        return await create_embedding(serving, body, request)

    # (in the schema only where it is served: a language model answers 404 naming why)
    classifier = bool(serving.labels)

    @app.post("/pooling", response_model=PoolingResponse, responses=_ERRORS, tags=["pooling"])
    async def pooling(body: PoolingRequest, request: Request) -> Response:
        """Each input's pooled data (vLLM's): an encoder's vector per input token
        (``task: token_embed``: what late-interaction models such as ColBERT score by), a
        token classifier's label probabilities per input token (``token_classify``), the
        embedding, or a classifier's label probabilities."""
        default = ("classify" if classifier else
                   "token_classify" if engine.spec.token_labels else
                   "token_embed" if serving.late_interaction is not None else "embed")  # fmt: skip
        return await create_pooling(serving, body, request, default)

    @app.post("/classify", response_model=ClassificationResponse, responses=_ERRORS,
              tags=["pooling"], include_in_schema=classifier)  # fmt: skip
    @app.post("/v1/classify", response_model=ClassificationResponse, responses=_ERRORS,
              tags=["pooling"], include_in_schema=classifier)  # fmt: skip
    async def classify(body: ClassificationRequest, request: Request) -> Response:
        """Each input's label probabilities by a sequence classifier (vLLM's)."""
        if not classifier:
            raise APIError(404, f"this model ({engine.spec.architecture}) has no classification "
                           "head: /classify serves sequence classifiers "
                           "(*ForSequenceClassification)", param="model",
                           code="not_a_classifier")  # fmt: skip
        return await create_classification(serving, body, request)

    @app.post("/score", response_model=ScoreResponse, responses=_ERRORS, tags=["pooling"],
              include_in_schema=vectors)  # fmt: skip
    @app.post("/v1/score", response_model=ScoreResponse, responses=_ERRORS, tags=["pooling"],
              include_in_schema=vectors)  # fmt: skip
    async def score(body: ScoreRequest, request: Request) -> Response:
        """How alike ``text_1`` and each ``text_2`` are: the cosine similarity of their
        embeddings, or a cross-encoder's relevance of each pair (vLLM's)."""
        return await create_score(serving, body, request)

    @app.post("/rerank", response_model=RerankResponse, responses=_ERRORS, tags=["pooling"],
              include_in_schema=vectors)  # fmt: skip
    @app.post("/v1/rerank", response_model=RerankResponse, responses=_ERRORS, tags=["pooling"],
              include_in_schema=vectors)  # fmt: skip
    @app.post("/v2/rerank", response_model=RerankResponse, responses=_ERRORS, tags=["pooling"],
              include_in_schema=vectors)  # fmt: skip
    async def rerank(body: RerankRequest, request: Request) -> Response:
        """``documents`` by their relevance to ``query`` (a cross-encoder's score, or the cosine
        similarity of embeddings), best first (Jina's and Cohere's shape)."""
        return await create_rerank(serving, body, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS, tags=["tokens"])
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages is empty", param="messages")
            ids, _ = await serving.run_blocking(  # (images: their placeholders widened)
                lambda: with_images(serving, body.messages, render_request(serving, body)),
                size=4096 if serving.image_prompts is None else 1 << 20,
            )
        else:
            text = body.prompt or ""
            special = body.add_special_tokens is not False
            ids = await serving.run_blocking(serving.encode, text, special, size=len(text))
        strs = serving.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_model_len,
                                token_strs=strs)  # fmt: skip

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS, tags=["tokens"])
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        vocab = len(serving.tokenizer)
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                           param="tokens")  # fmt: skip
        return DetokenizeResponse(prompt=serving.tokenizer.decode(body.tokens))

    @app.get("/metrics", tags=["ops"], response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}})  # fmt: skip
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics_mod.CONTENT_TYPE)

    @app.post("/reset_prefix_cache", tags=["ops"], responses=_ERRORS)
    async def reset_prefix_cache() -> dict[str, bool]:
        """Drop every cached prefix block (409 when prefix caching is off)."""
        if not prefix_caching:
            raise APIError(
                409,
                "prefix caching is off (it is on unless --no-enable-prefix-caching, the "
                "contiguous KV backend, --no-kv-cache or static batching)",
            )
        ok = await async_engine.call("reset_prefix_cache")
        return {"reset": bool(ok)}

    @app.get("/debug/engine", tags=["ops"])
    async def debug_engine() -> dict[str, Any]:
        """The engine's latest stats snapshot plus the server's in-flight count."""
        stats = dataclasses.asdict(async_engine.stats)
        out = {**stats, "in_flight": async_engine.num_in_flight, "steps": async_engine.num_steps,
               "step_failures": async_engine.num_step_failures}  # fmt: skip
        # NOTE: finished counts as clients saw them (the /metrics counter): a request aborted by
        # its client or a timeout may still have finished in the engine before the abort landed.
        out["finished_total"] = dict(metrics.finished)
        step_times = getattr(engine, "step_times", None)  # where step time goes (thread mode)
        if step_times is not None:
            out["step_seconds"] = {**dataclasses.asdict(step_times), "total": step_times.total}
        return out

    if dashboard is not None:
        install_dashboard(app, dashboard)

    @app.get("/", include_in_schema=False)
    async def root() -> JSONResponse:
        links = {"docs": "/docs"} | ({"dashboard": "/dashboard"} if dashboard else {})
        return JSONResponse({"service": "infer", "models": list(served), **links})

    def openapi() -> dict[str, Any]:
        """FastAPI's schema plus what it cannot see: the SSE event bodies (referenced by the
        streaming routes), the vocabulary's bound on every token id the model reads, and the
        embedding size's on an embedding's ``dimensions``."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, summary=app.summary,
                                 routes=app.routes)  # fmt: skip
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (
                CompletionStreamResponse,
                ChatCompletionStreamResponse,
                ResponseStreamEvent,
                MessagesStreamEvent,
            ):  # (the SSE events' bodies)
                extra = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub_schema in extra.pop("$defs", {}).items():
                    schemas.setdefault(name, sub_schema)
                schemas.setdefault(model.__name__, extra)
            _bound_token_ids(schema, min(len(serving.tokenizer), engine.spec.vocab_size) - 1)
            # an embedding's dimensions: at most the model's embedding size
            sizes = {"EmbeddingRequest": engine.embedding_size,  # (a token's may differ)
                     "PoolingRequest": max(engine.embedding_size,
                                           getattr(engine, "token_embedding_size", 0))}  # fmt: skip
            for request, size in sizes.items():
                if request not in schemas:  # (a route left out of this model's schema)
                    continue
                dims = schemas[request]["properties"]["dimensions"]
                for option in dims.get("anyOf", [dims]):
                    if option.get("type") == "integer":
                        option["maximum"] = size
            # /pooling's tasks: those this model serves (a classifier's logits are neither cut
            # nor normalized)
            tasks = (["classify"] if classifier else ["token_classify"]
                     if engine.spec.token_labels else ["token_embed"]
                     if serving.late_interaction is not None else
                     ["token_embed", "embed"] if engine.spec.is_encoder else ["embed"])  # fmt: skip
            if getattr(engine, "token_classes", ()) and "embed" in tasks:  # (BGE-M3's sparse)
                tasks.append("token_classify")  # (its weights: neither cut nor normalized)
                schemas["PoolingRequest"]["if"] = {
                    "required": ["task"],
                    "properties": {"task": {"const": "token_classify"}},
                }
                schemas["PoolingRequest"]["then"] = {"properties": {
                    "dimensions": {"type": "null"},
                    "normalize": {"anyOf": [{"const": False}, {"type": "null"}]}}}  # fmt: skip
            props = schemas["PoolingRequest"]["properties"]
            for option in props["task"].get("anyOf", []):
                if "enum" in option:
                    option["enum"] = tasks
            if serving.late_interaction is None:
                props["input_type"] = {"type": "null", "description": "(a ColBERT model's)"}
            if classifier or engine.spec.token_labels:
                props["dimensions"] = {"type": "null", "description": "(logits: not cut)"}
                props["normalize"] = {"anyOf": [{"const": False}, {"type": "null"}],
                                      "description": "(logits: not normalized)"}  # fmt: skip
            if not (serving.settings.chat_template
                    or getattr(serving.tokenizer, "chat_template", None)):  # fmt: skip
                for request in ("EmbeddingRequest", "PoolingRequest", "ClassificationRequest",
                                "TokenizeRequest"):  # fmt: skip
                    if request in schemas:  # (messages would be a 400: no template)
                        schemas[request]["properties"]["messages"] = {
                            "type": "null",
                            "description": "(this model has no chat template)",
                        }
            if serving.image_prompts is None:  # a model that reads no images: no image parts
                for holder, part in (("ChatMessage", "ImageUrlContentPart"),
                                     ("InputMessage", "InputImagePart"),
                                     ("AnthropicMessage", "ImageBlock")):  # fmt: skip
                    if holder in schemas:
                        _drop_ref(schemas[holder], part)
                        schemas.pop(part, None)
            if fim_tokens(serving.tokenizer) is None and "CompletionRequest" in schemas:
                # no fill-in-the-middle: suffix stays empty
                props = schemas["CompletionRequest"]["properties"]
                props["suffix"] = {
                    "anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}],
                    "description": "this model has no fill-in-the-middle tokens",
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    # Outermost first on the way in: log everything, then authenticate, then bound the body,
    # then refuse generation at once while the queue is full, then answer a route's unexpected
    # failure with a 500.
    app.add_middleware(UnexpectedErrorMiddleware)
    app.add_middleware(OverloadMiddleware, queue_is_full=async_engine.queue_is_full)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(AccessLogMiddleware)
    return app


def _bound_token_ids(node: Any, max_id: int) -> None:
    """Give every schema marked ``VOCAB_BOUND`` (an input token id, or the token-id keys of
    ``logit_bias``) the vocabulary's bound, in place."""
    if isinstance(node, list):
        for item in node:
            _bound_token_ids(item, max_id)
        return
    if not isinstance(node, dict):
        return
    if node.pop(VOCAB_BOUND, False):
        node["maximum"] = max_id
    names = node.get("propertyNames")
    if isinstance(names, dict) and names.pop(VOCAB_BOUND, False):
        node["propertyNames"] = {"type": "string", "pattern": uint_at_most_regex(max_id)}
    for value in node.values():
        _bound_token_ids(value, max_id)


def uint_at_most_regex(n: int) -> str:
    """A regex matching exactly the decimal integers 0..n (no sign, no leading zeros)::

    n = 1023 -> ^(0|[1-9][0-9]{0,2}|10[0-1][0-9]{1}|102[0-2]|1023)$
                  |  shorter numbers  | n's width, smaller than n at one digit | n |
    """
    digits = str(n)
    width = len(digits)
    alts = ["0"]
    if width >= 2:
        alts.append(f"[1-9][0-9]{{0,{width - 2}}}")  # every shorter number
    for i, d in enumerate(digits):  # same width: equal to n up to i, then smaller at i
        low = 1 if i == 0 else 0
        high = int(d) - 1
        if high >= low:
            rest = width - i - 1
            tail = f"[0-9]{{{rest}}}" if rest else ""
            alts.append(f"{digits[:i]}[{low}-{high}]{tail}")
    if n > 0:
        alts.append(digits)
    return "^(" + "|".join(alts) + ")$"


def _version() -> str:
    from infer import __version__

    return __version__


def _drop_ref(node: Any, name: str) -> None:
    """Take the option that references schema ``name`` out of every ``anyOf`` / ``oneOf``
    under ``node``."""
    if isinstance(node, dict):
        for key in ("anyOf", "oneOf"):
            options = node.get(key)
            if isinstance(options, list):
                node[key] = [o for o in options
                             if o.get("$ref") != f"#/components/schemas/{name}"]  # fmt: skip
        for value in node.values():
            _drop_ref(value, name)
    elif isinstance(node, list):
        for value in node:
            _drop_ref(value, name)
