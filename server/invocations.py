"""Amazon SageMaker's serving contract, as vLLM serves it: `/ping` is the health check and `POST
/invocations` takes any inference request, answered by the route its fields name, so a driftgate
container runs as a SageMaker endpoint unchanged."""

from __future__ import annotations

import json

from fastapi import Request, Response
from pydantic import BaseModel, ValidationError

from server.chat import create_chat_completion
from server.completions import create_completion
from server.embeddings import create_embedding
from server.errors import APIError, invalid_body
from server.pooling import create_classification, create_rerank, create_score
from server.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)

# The field that tells each kind of request apart, in the order they are looked for.
_BY_FIELD = (
    ("messages", ChatCompletionRequest, create_chat_completion),
    ("prompt", CompletionRequest, create_completion),
    ("query", RerankRequest, create_rerank),
    ("text_1", ScoreRequest, create_score),
)


async def invocations(request: Request) -> Response:
    """Route the body to chat (`messages`), completions (`prompt`), rerank (`query`), score
    (`text_1`), or with `input` embeddings, or classification on a classifier."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    routes = list(_BY_FIELD)
    if request.app.state.driftgate.config.classifier is not None:
        routes.append(("input", ClassificationRequest, create_classification))
    else:
        routes.append(("input", EmbeddingRequest, create_embedding))
    for field, model, handler in routes:
        if field in body:
            return await handler(_validated(model, body), request)
    raise APIError(400, "an /invocations body names its kind by a field: messages (chat), prompt (completion), "
                        "input (embeddings or classification), text_1 (score) or query (rerank)")


def _validated(model: type[BaseModel], body: dict) -> BaseModel:
    """The body as `model`, its errors reported as the routes report theirs (400, the field named)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid_body(exc) from None
