"""`POST /v1/embeddings`: OpenAI's embeddings, pooled as the served model's config says."""

from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from engine.pooling import finish_embedding
from engine.sampling_params import SamplingParams
from server.completions import tokenized_prompts
from server.errors import APIError
from server.generation import EngineRequest, Generation, collect, until_disconnect
from server.params import check_prompt_ids, requested_adapter, truncate_prompt
from server.protocol import EmbeddingRequest
from server.state import RequestRecord, ServerState


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's "base64": the float32 values' little-endian bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


async def create_embedding(body: EmbeddingRequest, request: Request) -> JSONResponse:
    state: ServerState = request.app.state.driftgate
    engine = state.ready_engine()
    config = state.config
    lora = requested_adapter(body.model, config)
    params = SamplingParams(max_tokens=1, pooling=config.pooling.pooling)
    request_id = f"embd-{uuid.uuid4().hex}"
    engine_requests = []
    for i, (_, ids) in enumerate(tokenized_prompts(body.input, engine.tokenizer)):
        ids = truncate_prompt(ids, body.truncate_prompt_tokens, engine.max_model_len)
        check_prompt_ids(ids, vocab_size=len(engine.tokenizer), max_model_len=engine.max_model_len, max_tokens=1,
                         param="input")
        engine_requests.append(EngineRequest(f"{request_id}-{i}", ids, params, body.priority, lora))
    record = RequestRecord(request_id)
    request.state.record = record
    generation = Generation(state, engine, engine_requests, record)
    try:
        finals = await until_disconnect(collect(generation), request.receive, record)
    finally:
        await generation.aclose()
    width = len(finals[0].embedding)
    if body.dimensions is not None and body.dimensions > width:
        raise APIError(400, f"dimensions {body.dimensions} exceeds the model's {width}", param="dimensions")
    data = [{"object": "embedding", "index": i,
             "embedding": _encoded(finish_embedding(finals[i].embedding, config.pooling.normalize, body.dimensions),
                                   body.encoding_format)}
            for i in range(len(engine_requests))]
    num_tokens = sum(len(r.prompt_token_ids) for r in engine_requests)
    return JSONResponse({"object": "list", "data": data, "model": lora or config.served_model_name,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
