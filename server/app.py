"""The FastAPI app: routes wired to handlers, middleware, and error handlers.

`build_app` takes an engine that is already running (or `None`: the app then answers 503
until `app.state.driftgate.attach(engine)`); it never owns the engine's lifetime, so tests
and the CLI decide when to start and stop it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.chat import create_chat_completion, render_chat
from server.completions import create_completion
from server.config import ServerConfig
from server.embeddings import create_embedding, create_pooling
from server.errors import APIError, error_response, install_error_handlers
from server.invocations import invocations
from server.lora import load_lora_adapter, unload_lora_adapter
from server.messages import count_message_tokens, create_message
from server.metrics import cluster_health
from server.middleware import AccessLogMiddleware, AuthMiddleware
from server.params import requested_adapter
from server.pooling import create_classification, create_rerank, create_score
from server.protocol import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest
from server.responses import cancel_response, create_response, delete_response, retrieve_response
from server.state import Phase, ServerState
from server.stats_log import log_stats_every

if TYPE_CHECKING:
    from engine.serving import ServingEngine


def _package_version() -> str:
    try:
        return version("driftgate")
    except PackageNotFoundError:
        return "unknown"


def build_app(engine: ServingEngine | None, config: ServerConfig) -> FastAPI:
    """An OpenAI-compatible app serving `engine` under `config.served_model_name`."""
    state = ServerState(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = None if config.log_stats_interval_s is None else asyncio.create_task(
            log_stats_every(config.log_stats_interval_s, state.engine_stats))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()

    app = FastAPI(title="driftgate", version=_package_version(), docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.driftgate = state
    install_error_handlers(app)

    app.post("/v1/completions")(create_completion)
    app.post("/v1/chat/completions")(create_chat_completion)
    app.post("/v1/embeddings")(create_embedding)
    app.post("/pooling")(create_pooling)
    for path in ("/classify", "/v1/classify"):
        app.post(path)(create_classification)
    for path in ("/score", "/v1/score"):
        app.post(path)(create_score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(create_rerank)
    app.post("/v1/responses")(create_response)
    app.get("/v1/responses/{response_id}")(retrieve_response)
    app.delete("/v1/responses/{response_id}")(delete_response)
    app.post("/v1/responses/{response_id}/cancel")(cancel_response)
    app.post("/v1/messages")(create_message)
    app.post("/v1/messages/count_tokens")(count_message_tokens)
    app.post("/v1/load_lora_adapter")(load_lora_adapter)
    app.post("/v1/unload_lora_adapter")(unload_lora_adapter)

    def model_cards() -> list[ModelCard]:
        engine = state.ready_engine()
        return ([ModelCard(id=name, root=config.model_root, max_model_len=engine.max_model_len)
                 for name in config.model_names]
                + [ModelCard(id=name, root=path, parent=config.served_model_name, max_model_len=engine.max_model_len)
                   for name, path in config.lora_modules.items()])

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=model_cards())

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve; `path`: served names may hold slashes
    async def retrieve_model(model: str) -> ModelCard:
        if (card := next((c for c in model_cards() if c.id == model), None)) is None:
            raise APIError(404, f"model {model!r} is not served here", param="model")
        return card

    @app.get("/health")
    async def health() -> Response:
        if state.phase is Phase.READY and state.engine is not None and state.engine.is_alive:
            return JSONResponse({"status": "ok", **cluster_health(state.engine.stats())})
        reason = "engine loop is not running" if state.phase is Phase.READY else f"server is {state.phase.value}"
        return error_response(503, reason)

    app.get("/ping")(health)  # SageMaker's health check (GET or POST), with its inference route
    app.post("/ping")(health)
    app.post("/invocations")(invocations)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def server_version() -> dict:
        return {"version": _package_version()}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        engine = state.ready_engine()
        requested_adapter(body.model, config)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            ids = render_chat(engine.tokenizer, body, config)
        else:
            ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        engine = state.ready_engine()
        requested_adapter(body.model, config)
        vocab_size = len(engine.tokenizer)
        bad = next((t for t in body.tokens if t >= vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (size {vocab_size})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        """What lm-eval's remote tokenizer probes for (it needs `eos_token`)."""
        tokenizer = state.ready_engine().tokenizer
        return {"eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token,
                "pad_token": tokenizer.pad_token, "chat_template": config.chat_template or tokenizer.chat_template,
                "model_max_length": state.engine.max_model_len}

    routes = frozenset(route.path for route in app.routes)
    app.add_middleware(AuthMiddleware, state=state)
    app.add_middleware(AccessLogMiddleware, state=state, routes=routes)
    if config.allowed_origins:
        # outermost: a browser's preflight carries no API key, and its 401s and 429s need the headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app
