"""`POST /v1/embeddings` (OpenAI's embeddings, pooled as the served model's config says) and vLLM's
`POST /pooling` (the same vectors, or a classifier's class probabilities, in vLLM's pooling shape)."""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from server.completions import tokenized_prompts
from server.errors import APIError
from server.pooling import Pooled, classified, pooled_outputs
from server.protocol import EmbeddingRequest, PoolingRequest
from server.state import ServerState


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's "base64": the float32 values' little-endian bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


async def _embeddings(body: EmbeddingRequest, request: Request, id_prefix: str) -> tuple[Pooled, list]:
    """Each input's embedding (normalized and cut to `dimensions` as asked), encoded as asked."""
    state: ServerState = request.app.state.driftgate
    config = state.config
    if config.classifier is not None:
        raise APIError(400, "the served model is a sequence classifier: it answers /classify, /score and "
                            "/rerank, not embeddings", param="model")
    prompts = [ids for _, ids in tokenized_prompts(body.input, state.ready_engine().tokenizer)]
    pooled = await pooled_outputs(request, body, prompts, config.pooling.pooling, id_prefix=id_prefix)
    width = config.pooling.width(len(pooled.outputs[0].embedding))
    if body.dimensions is not None and body.dimensions > width:
        raise APIError(400, f"dimensions {body.dimensions} exceeds the model's {width}", param="dimensions")
    return pooled, [_encoded(config.pooling.embedding(out.embedding, dimensions=body.dimensions), body.encoding_format)
                    for out in pooled.outputs]


async def create_embedding(body: EmbeddingRequest, request: Request) -> JSONResponse:
    pooled, vectors = await _embeddings(body, request, "embd")
    data = [{"object": "embedding", "index": i, "embedding": vector} for i, vector in enumerate(vectors)]
    usage = pooled.usage
    return JSONResponse({"id": pooled.request_id, "object": "list", "created": int(time.time()), "data": data,
                         "model": pooled.model,
                         "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]}})


async def create_pooling(body: PoolingRequest, request: Request) -> JSONResponse:
    """vLLM's /pooling: "embed" gives /v1/embeddings' vectors, "classify" /classify's probabilities."""
    classifier = request.app.state.driftgate.config.classifier
    task = body.task or ("classify" if classifier is not None else "embed")
    if task == "classify":
        if body.dimensions is not None or body.encoding_format != "float":
            raise APIError(400, "dimensions and encoding_format apply to the embed task", param="task")
        pooled, labelled = await classified(body, request, "/pooling", "pool")
        results = [probs for probs, _ in labelled]
    else:
        pooled, results = await _embeddings(body, request, "pool")
    return JSONResponse({"id": pooled.request_id, "object": "list", "created": int(time.time()),
                         "model": pooled.model, "data": [{"index": i, "object": "pooling", "data": result}
                                                         for i, result in enumerate(results)],
                         "usage": pooled.usage})
