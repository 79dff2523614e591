"""``POST /classify`` (and ``/v1/classify``): a sequence classifier's answer for each input
(vLLM's classification API).

A ``*ForSequenceClassification`` model (a label, reward or reranking model) ends in a ``score``
head over the final hidden state of the prompt's last token; each input runs as one engine
request (a prefill batched with everything else) and comes back as its labels' probabilities
(softmax; the sigmoid for a one-label model; the raw logits with ``use_activation: false``)
and the likeliest label's name. ``messages`` in place of ``input`` classifies one conversation
as the chat template writes it: what a reward model scores.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from infer.core.outputs import ClassificationOutput
from infer.core.pooling_params import PoolingParams
from infer.server.embeddings import embed, log_unknown_fields, pooling_inputs
from infer.server.protocol import ClassificationData, ClassificationRequest, ClassificationResponse
from infer.server.serving import Serving

CLASSIFY = PoolingParams(task="classify")


async def create_classification(
    serving: Serving, req: ClassificationRequest, raw: Request
) -> Response:
    model = serving.check_model(req.model)
    log_unknown_fields(req, "/classify")
    token_inputs = await pooling_inputs(serving, req)
    request_id, finals, usage = await embed(serving, token_inputs, CLASSIFY, req, raw, "classify")
    data = []
    for index, final in enumerate(finals):
        out = ClassificationOutput.from_logits(final.embedding, serving.labels)  # type: ignore[arg-type]
        data.append(ClassificationData(index=index, label=out.label, num_classes=out.num_classes,
                                       probs=out.probs if req.wants_activation else out.logits))  # fmt: skip
    body = ClassificationResponse(id=request_id, model=model, data=data, usage=usage)
    return JSONResponse(body.model_dump(mode="json"))
