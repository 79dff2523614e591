"""``POST /score`` and ``POST /rerank``, scored as the model can:

- an embedding model (a bi-encoder): the cosine of the texts' embeddings. Every distinct text
  runs once as an embedding request (``embeddings.embed``: a query scored against many
  documents is embedded once), normalized, and each pair's score is the dot product of its two
  vectors, in [-1, 1];
- a cross-encoder (a sequence classifier with one label: a reranker): each pair runs through
  the model as one input, the tokenizer's pair encoding of the two texts (or the model's
  ``rerank_template`` with them written in), and its score is the sigmoid of the head's logit,
  in (0, 1) (sentence-transformers' ``CrossEncoder``, vLLM), or the logit itself where the
  model's saved activation is ``Identity`` or the request's ``use_activation`` is false.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.core.pooling_params import check_cross_encoder, cosine, relevance, score_pairs
from infer.core.sampling_params import InvalidRequestError
from infer.model.tokenizer import encode_pair
from infer.server.classify import CLASSIFY
from infer.server.embeddings import (
    embed,
    late_interaction_inputs,
    log_unknown_fields,
    pooling_params,
    tokenize_inputs,
)
from infer.server.errors import APIError, bad_request, from_invalid_request
from infer.server.protocol import (
    EmbeddingUsage,
    RerankDocumentOut,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from infer.server.serving import MAX_SEQUENCES, Serving


async def _similarities(
    serving: Serving, texts: list[tuple[str, str]], pairs: list[tuple[int, int]], req: Any,
    raw: Request, prefix: str,
) -> tuple[str, list[float], EmbeddingUsage]:  # fmt: skip
    """Embed each distinct text of ``texts`` (``(text, the field it came from)``) once; the
    request id, each pair's cosine similarity (indices into ``texts``) and the usage."""
    first_field: dict[str, str] = {}  # each distinct text, in order, and where it first came
    for text, field in texts:
        first_field.setdefault(text, field)
    last_list = texts[-1][1].split("[")[0]  # (the field that errors about the whole list name)
    if len(first_field) > MAX_SEQUENCES:
        raise bad_request(f"{len(first_field)} distinct texts is more than the {MAX_SEQUENCES} "
                          "one request may give", param=last_list)  # fmt: skip
    distinct = list(first_field)
    token_inputs = await tokenize_inputs(serving, distinct, req, list(first_field.values()))
    try:
        unit = pooling_params(normalize=True)
        request_id, finals, usage = await embed(serving, token_inputs, unit, req, raw, prefix)
    except APIError as e:  # the engine's refusals name /v1/embeddings' field: name this route's
        if e.param == "input":
            e.param = last_list
        raise
    vector = {text: f.embedding for text, f in zip(distinct, finals, strict=True)}
    work = [(vector[texts[i][0]], vector[texts[j][0]]) for i, j in pairs]
    # (off the event loop when there is much of it: 1,000 pairs of 1,024 values is ~60 ms)
    size = len(work) * len(work[0][0]) // 64
    scores = await serving.run_blocking(_cosines, work, size=size)
    return request_id, scores, usage


async def _cross_scores(
    serving: Serving, texts: list[tuple[str, str]], pairs: list[tuple[int, int]], req: Any,
    raw: Request, prefix: str,
) -> tuple[str, list[float], EmbeddingUsage]:  # fmt: skip
    """A cross-encoder's score for each pair (indices into ``texts``): each pair one input;
    the request id, the scores and the usage."""
    try:
        check_cross_encoder(len(serving.labels))
    except InvalidRequestError as e:
        raise from_invalid_request(e) from e
    special = getattr(req, "add_special_tokens", True)
    # truncate_prompt_tokens cuts a pair as the tokenizer cuts pairs (the longer text first),
    # not by keeping its last k tokens, which would drop the query (0: tokenize_inputs' 400)
    k = req.truncate_prompt_tokens
    limit = None if not k else serving.max_model_len if k == -1 else k

    def encode_all() -> list[list[int]]:
        return [encode_pair(serving.tokenizer, texts[i][0], texts[j][0], special, limit,
                            serving.rerank_template) for i, j in pairs]  # fmt: skip

    size = sum(len(texts[i][0]) + len(texts[j][0]) for i, j in pairs)
    try:
        encoded = await serving.run_blocking(encode_all, size=size)
    except InvalidRequestError as e:
        raise from_invalid_request(e) from e
    fields = [texts[j][1] for _, j in pairs]  # (a pair is named by its second text)
    token_inputs = await tokenize_inputs(serving, encoded, req, fields)  # type: ignore[arg-type]
    request_id, finals, usage = await embed(serving, token_inputs, CLASSIFY, req, raw, prefix)
    activation = serving.score_activation if req.wants_activation else "identity"
    scores = [relevance(f.embedding, activation) for f in finals]  # type: ignore[arg-type]
    return request_id, scores, usage


async def _late_interaction_scores(
    serving: Serving, texts: list[tuple[str, str]], pairs: list[tuple[int, int]], req: Any,
    raw: Request, prefix: str,
) -> tuple[str, list[float], EmbeddingUsage]:  # fmt: skip
    """A ColBERT model's MaxSim score of each pair (indices into ``texts``): the first text
    of a pair encoded as a query, the second as a document (model/late_interaction.py), each
    such text once; the request id, the scores and the usage."""
    import torch

    from infer.model.late_interaction import maxsim

    li = serving.late_interaction
    roles = list(
        dict.fromkeys([(i, "query") for i, _ in pairs] + [(j, "document") for _, j in pairs])
    )
    if len(roles) > MAX_SEQUENCES:
        raise bad_request(f"{len(roles)} texts to encode is more than the {MAX_SEQUENCES} one "
                          "request may give", param=texts[-1][1].split("[")[0])  # fmt: skip
    token_inputs, params = await late_interaction_inputs(
        serving, [(texts[i][0], role) for i, role in roles], req, normalize=True
    )
    try:
        request_id, finals, usage = await embed(serving, token_inputs, params, req, raw, prefix)
    except APIError as e:  # the engine's refusals name /v1/embeddings' field: name this route's
        if e.param == "input":
            e.param = texts[-1][1].split("[")[0]
        raise

    def score_all() -> list[float]:
        vectors = {}
        for (i, role), ids, final in zip(roles, token_inputs, finals, strict=True):
            rows = final.embedding
            vectors[i, role] = torch.tensor(li.document_vectors(ids, rows) if role == "document"
                                            else rows)  # fmt: skip
        return [maxsim(vectors[i, "query"], vectors[j, "document"]) for i, j in pairs]

    # (off the event loop: a thousand documents' vectors are millions of floats)
    size = sum(len(ids) for ids in token_inputs) * 64
    return request_id, await serving.run_blocking(score_all, size=size), usage


def _scorer(serving: Serving):
    """How this model scores pairs: a cross-encoder's head, a ColBERT model's late interaction,
    or the cosine of embeddings (which has no activation: a request's ``use_activation`` there
    changes nothing)."""
    if serving.labels:
        return _cross_scores
    return _similarities if serving.late_interaction is None else _late_interaction_scores


def _cosines(pairs: list[tuple[list[float], list[float]]]) -> list[float]:
    return [cosine(a, b) for a, b in pairs]


def _listed(value: str | list[str], field: str) -> list[tuple[str, str]]:
    if isinstance(value, str):
        return [(value, field)]
    return [(text, f"{field}[{i}]") for i, text in enumerate(value)]


async def create_score(serving: Serving, req: ScoreRequest, raw: Request) -> Response:
    model = serving.check_model(req.model)
    log_unknown_fields(req, "/score")
    first, second = _listed(req.text_1, "text_1"), _listed(req.text_2, "text_2")
    try:
        pairs = score_pairs(len(first), len(second))
    except InvalidRequestError as e:
        raise from_invalid_request(e) from e
    n = len(first)
    index_pairs = [(i, n + j) for i, j in pairs]
    request_id, scores, usage = await _scorer(serving)(serving, first + second, index_pairs,
                                                           req, raw, "score")  # fmt: skip
    data = [ScoreData(index=k, score=s) for k, s in enumerate(scores)]
    body = ScoreResponse(id=request_id, model=model, data=data, usage=usage)
    return JSONResponse(body.model_dump(mode="json"))


async def create_rerank(serving: Serving, req: RerankRequest, raw: Request) -> Response:
    model = serving.check_model(req.model)
    log_unknown_fields(req, "/rerank")
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    texts = [(req.query, "query"), *_listed(docs, "documents")]
    pairs = [(0, 1 + j) for j in range(len(docs))]
    request_id, scores, usage = await _scorer(serving)(serving, texts, pairs, req, raw,
                                                           "rerank")  # fmt: skip
    order = sorted(range(len(docs)), key=lambda j: -scores[j])
    if req.top_n:
        order = order[: req.top_n]
    results = [
        RerankResult(index=j, relevance_score=scores[j],
                     document=RerankDocumentOut(text=docs[j]) if req.return_documents else None)
        for j in order
    ]  # fmt: skip
    body = RerankResponse(id=request_id, model=model, results=results, usage=usage)
    return JSONResponse(body.model_dump(mode="json"))
