"""vLLM's pooling routes: `/classify` (a sequence classifier's classes), `/score` and `/rerank`
(how well texts match: a cross-encoder's relevance, or an embedding model's cosine); `/pooling`
lives beside `/v1/embeddings` (server/embeddings.py).

Each runs its inputs as pooling requests (one prompt's final hidden state, or a classifier's
logits) batched with whatever else the engine is serving; `pooled_outputs` is the part
`/v1/embeddings` shares.
"""

from __future__ import annotations

import time
import uuid
from typing import NamedTuple

from fastapi import Request
from fastapi.responses import JSONResponse

from engine.outputs import RequestOutput
from engine.pooling import ClassifierConfig, ScorePlan, score_pairs
from engine.sampling_params import SamplingParams
from server.completions import tokenized_prompts
from server.errors import APIError
from server.generation import EngineRequest, Generation, collect_while_connected
from server.params import check_prompt_ids, requested_adapter, truncate_prompt
from server.protocol import ClassificationRequest, PoolingFields, RerankRequest, ScoreRequest
from server.state import RequestRecord, ServerState


class Pooled(NamedTuple):
    model: str  # the name to report: the adapter's, else the served model's
    request_id: str
    outputs: list[RequestOutput]  # in prompt order

    @property
    def usage(self) -> dict[str, int]:
        num_tokens = sum(len(out.prompt_token_ids) for out in self.outputs)
        return {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}


async def pooled_outputs(request: Request, body: PoolingFields, prompts: list[list[int]], pooling: str, *,
                         id_prefix: str, param: str = "input") -> Pooled:
    """Pool each prompt (truncated, checked: a 400 names `param`) through the adapter `body.model` names."""
    state: ServerState = request.app.state.driftgate
    engine = state.ready_engine()
    lora = requested_adapter(body.model, state.config)
    params = SamplingParams(max_tokens=1, pooling=pooling)
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    engine_requests = []
    for i, ids in enumerate(prompts):
        ids = truncate_prompt(ids, body.truncate_prompt_tokens, engine.max_model_len)
        check_prompt_ids(ids, vocab_size=len(engine.tokenizer), max_model_len=engine.max_model_len, max_tokens=1,
                         param=param)
        engine_requests.append(EngineRequest(f"{request_id}-{i}", ids, params, body.priority, lora))
    record = RequestRecord(request_id)
    request.state.record = record
    generation = Generation(state, engine, engine_requests, record)
    finals = await collect_while_connected(generation, request.receive, record)
    return Pooled(lora or state.config.served_model_name, request_id,
                  [finals[i] for i in range(len(engine_requests))])


def _classifier(request: Request, route: str) -> ClassifierConfig:
    classifier = request.app.state.driftgate.config.classifier
    if classifier is None:
        raise APIError(400, f"{route} needs a sequence classifier (*ForSequenceClassification); "
                            "the served model is not one", param="model")
    return classifier


async def classified(body: ClassificationRequest, request: Request, route: str,
                     id_prefix: str) -> tuple[Pooled, list[tuple[list[float], str]]]:
    """Each input's class probabilities and most probable label (a 400 unless a classifier is served)."""
    classifier = _classifier(request, route)
    tokenizer = request.app.state.driftgate.ready_engine().tokenizer
    prompts = [ids for _, ids in tokenized_prompts(body.input, tokenizer)]
    pooled = await pooled_outputs(request, body, prompts, "last", id_prefix=id_prefix)
    probabilities = [classifier.probabilities(out.embedding) for out in pooled.outputs]
    return pooled, [(probs, classifier.most_probable(probs)) for probs in probabilities]


async def create_classification(body: ClassificationRequest, request: Request) -> JSONResponse:
    pooled, results = await classified(body, request, "/classify", "classify")
    data = [{"index": i, "label": label, "probs": probs, "num_classes": len(probs)}
            for i, (probs, label) in enumerate(results)]
    return JSONResponse({"id": pooled.request_id, "object": "list", "created": int(time.time()),
                         "model": pooled.model, "data": data, "usage": pooled.usage})


async def _scores(request: Request, body: PoolingFields, text_1: str | list[str],
                  text_2: str | list[str], id_prefix: str) -> tuple[Pooled, list[float]]:
    state: ServerState = request.app.state.driftgate
    try:
        plan = ScorePlan.build(score_pairs(text_1, text_2), state.ready_engine().tokenizer, state.config.classifier,
                               state.config.pooling)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    pooled = await pooled_outputs(request, body, plan.prompts, plan.pooling, id_prefix=id_prefix)
    return pooled, plan.scores([out.embedding for out in pooled.outputs])


async def create_score(body: ScoreRequest, request: Request) -> JSONResponse:
    pooled, scores = await _scores(request, body, body.text_1, body.text_2, "score")
    return JSONResponse({"id": pooled.request_id, "object": "list", "created": int(time.time()),
                         "model": pooled.model, "data": [{"index": i, "object": "score", "score": score}
                                                         for i, score in enumerate(scores)],
                         "usage": pooled.usage})


async def create_rerank(body: RerankRequest, request: Request) -> JSONResponse:
    """Jina's and Cohere's rerank shape (vLLM's /rerank): documents by relevance to the query, best first."""
    pooled, scores = await _scores(request, body, body.query, body.documents, "rerank")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
    return JSONResponse({"id": pooled.request_id, "model": pooled.model,
                         "usage": {"total_tokens": pooled.usage["total_tokens"]},
                         "results": [{"index": i, "document": {"text": body.documents[i]},
                                      "relevance_score": scores[i]} for i in order]})
