"""`POST /v1/embeddings`: OpenAI's embeddings, pooled as the served model's config says."""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from engine.pooling import finish_embedding
from server.completions import tokenized_prompts
from server.errors import APIError
from server.pooling import pooled_outputs
from server.protocol import EmbeddingRequest
from server.state import ServerState


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's "base64": the float32 values' little-endian bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


async def create_embedding(body: EmbeddingRequest, request: Request) -> JSONResponse:
    state: ServerState = request.app.state.driftgate
    config = state.config
    if config.classifier is not None:
        raise APIError(400, "the served model is a sequence classifier: it answers /classify, /score and "
                            "/rerank, not embeddings", param="model")
    prompts = [ids for _, ids in tokenized_prompts(body.input, state.ready_engine().tokenizer)]
    pooled = await pooled_outputs(request, body, prompts, config.pooling.pooling, id_prefix="embd")
    width = len(pooled.outputs[0].embedding)
    if body.dimensions is not None and body.dimensions > width:
        raise APIError(400, f"dimensions {body.dimensions} exceeds the model's {width}", param="dimensions")
    data = [{"object": "embedding", "index": i,
             "embedding": _encoded(finish_embedding(out.embedding, config.pooling.normalize, body.dimensions),
                                   body.encoding_format)}
            for i, out in enumerate(pooled.outputs)]
    usage = pooled.usage
    return JSONResponse({"id": pooled.request_id, "object": "list", "created": int(time.time()), "data": data,
                         "model": pooled.model,
                         "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]}})
