"""Schema-based fuzzing: bodies drawn from the request models' JSON schemas, and arbitrary JSON.

Whatever arrives, the server answers without a 5xx (504 aside: a fuzzed request may ask for
a lot of work, and the fuzz server times out fast), within a bound, in OpenAI's error shape
(Anthropic's on its Messages route).
"""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from server.messages import MessagesRequest
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from server.responses import ResponsesRequest
from tests.server.conftest import serve, wait_until_idle
from tests.server.schema_strategy import ANY_JSON, from_model_schema

ROUTES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/messages": MessagesRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/embeddings": EmbeddingRequest,
}
ANY_BODY_ROUTES = [*ROUTES, "/invocations"]  # SageMaker's: any body, routed by its fields
_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                            HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])


def _bounded(body: dict) -> dict:
    """Keep generation short (the fuzz targets validation, not throughput)."""
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(key)
        if isinstance(value, int) and 8 < value < 10**6:
            body[key] = value % 8 + 1
    return body


@pytest.fixture(scope="module")
def fuzz_url(engine):
    with serve(engine, request_timeout_s=3, max_n=4) as url:
        yield url


def _check(http: httpx.Client, route: str, body) -> None:
    r = http.post(route, json=body)
    assert r.status_code < 500 or r.status_code == 504, (route, body, r.status_code, r.text)
    if r.status_code != 200 and route == "/v1/messages":
        reply = r.json()
        assert reply["type"] == "error" and set(reply["error"]) == {"type", "message"}
    elif r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == r.status_code
    elif route == "/v1/messages" and body.get("stream") is not True:
        usage = r.json()["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    elif route.startswith("/v1") and body.get("stream") is not True:
        assert r.json()["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("route", list(ROUTES))
def test_schema_bodies_never_5xx(fuzz_url, engine, route):
    @_SETTINGS
    @given(from_model_schema(ROUTES[route].model_json_schema()).map(_bounded))
    def run(body: dict) -> None:
        with httpx.Client(base_url=fuzz_url, timeout=30) as http:
            _check(http, route, body)

    run()
    wait_until_idle(engine)


@pytest.mark.parametrize("route", ANY_BODY_ROUTES)
def test_arbitrary_json_never_5xx(fuzz_url, route):
    @_SETTINGS
    @given(ANY_JSON)
    def run(body) -> None:
        with httpx.Client(base_url=fuzz_url, timeout=30) as http:
            _check(http, route, body)

    run()
