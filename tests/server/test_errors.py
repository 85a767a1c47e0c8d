"""Error statuses and OpenAI's error body shape: 400, 401, 404, 503, 504; never a traceback."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from server.app import build_app
from server.config import ServerConfig
from tests.server.conftest import MODEL_NAME, serve, wait_until_idle
from tests.server.live import serve_in_thread


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and isinstance(error["message"], str)
    assert "Traceback" not in response.text
    return error


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": "hi " * 600, "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "n": 1000}, "n"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({}, "prompt"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"42": 101}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"1000000": 1}}, "logit_bias"),
    ({"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"prompt": "hi", "bad_words": [""]}, "bad_words"),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
    ({"prompt": "hi", "guided_choice": []}, "guided_choice"),
    ({"prompt": "hi", "guided_regex": "[0-9"}, "guided_regex"),
    ({"prompt": "hi", "guided_json": {"type": 5}}, "guided_json"),
    ({"prompt": "hi", "guided_grammar": "root ::= "}, "guided_grammar"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"prompt": "hi", "structured_outputs": {"pattern": "a"}}, "structured_outputs"),
    ({"prompt": "hi", "response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, "response_format"),
    ({"prompt": "hi", "structured_outputs": {"structural_tag": "{oops"}}, "structured_outputs"),
    ({"prompt": "hi", "guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": "hi", "use_beam_search": True, "stop": ["x"]}, "stop"),
    ({"prompt": "hi", "use_beam_search": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "hi", "use_beam_search": True, "n": 1000}, "n"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    # an id outside the vocabulary would fail the engine step of every request batched with it
    ({"prompt": "hi", "stop_token_ids": [1000000], "min_tokens": 2}, "stop_token_ids"),
    ({"prompt": "hi", "stop": ["a", ""]}, "stop"),
    ({"prompt": "hi", "seed": 2**63}, "seed"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": [-1]}, "prompt.0"),
    ({"prompt": []}, "prompt"),
])
def test_completion_400s(base_url, body, param):
    error = assert_openai_error(httpx.post(base_url + "/v1/completions", json=body, timeout=30), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404_as_openai_and_vllm_answer(base_url, client):
    """OpenAI's clients raise NotFoundError for it, which callers catch to fall back to another model."""
    for route, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        error = assert_openai_error(httpx.post(base_url + route, json={**body, "model": "no-such-model"}), 404)
        assert error["param"] == "model" and "is not served here" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)


def test_malformed_json_and_chat_400s(base_url):
    r = httpx.post(base_url + "/v1/chat/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    error = assert_openai_error(r, 400)
    assert error["param"] is None and error["message"].startswith("the body is not valid JSON (")
    # a field that takes several shapes names the value its shape refused, not the first shape tried
    for prompt, says in (([-1], "prompt.0: Input should be greater than or equal to 0"),
                         ([], "prompt: List should have at least 1 item")):
        error = assert_openai_error(httpx.post(base_url + "/v1/completions", json={"prompt": prompt}), 400)
        assert error["message"].startswith(says)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for bad in (21, -1):
        error = assert_openai_error(httpx.post(base_url + "/v1/chat/completions", timeout=10,
                                               json={**chat, "logprobs": True, "top_logprobs": bad}), 400)
        assert error["param"] == "top_logprobs" and error["message"].startswith("top_logprobs")
    long = {**chat, "messages": [{"role": "user", "content": "hi " * 2000}]}
    error = assert_openai_error(httpx.post(base_url + "/v1/chat/completions", json=long, timeout=10), 400)
    assert error["param"] == "messages"
    r = httpx.post(base_url + "/v1/chat/completions", json={"messages": []}, timeout=10)
    assert_openai_error(r, 400)
    r = httpx.post(base_url + "/v1/chat/completions", timeout=10,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0})
    assert_openai_error(r, 400)


@pytest.mark.parametrize(("extra", "param"), [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
    ({"chat_template": "{{ messages[0]['content'] }}"}, "chat_template"),
])
def test_chat_refuses_what_it_cannot_honour(base_url, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    error = assert_openai_error(httpx.post(base_url + "/v1/chat/completions", json=body, timeout=30), 400)
    assert error["param"] == param and "not" in error["message"]
    # plain text is what the server produces anyway
    for anyway in ({"response_format": {"type": "text"}}, {"modalities": ["text"]}):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **anyway}
        assert httpx.post(base_url + "/v1/chat/completions", json=body, timeout=30).status_code == 200


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ("/v1/completions", {"prompt": ["fine", "\udc00"]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["\ud800"]}, "bad_words[0]"),
    ("/v1/completions", {"prompt": "hi", "stop": "\ud800"}, "stop"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/v1/embeddings", {"input": "\ud800"}, "input"),
    ("/v1/responses", {"input": "\ud800"}, "input"),
])
def test_half_a_surrogate_pair_is_a_400_naming_the_field(base_url, route, body, param):
    """JSON may escape a lone UTF-16 surrogate, which is no character; it failed in the tokenizer
    (or inside the engine, for bad_words) as a 500."""
    escaped = json.dumps(body).encode()  # "\\ud800" in the body, as JSON allows (and httpx's json= cannot write)
    response = httpx.post(base_url + route, content=escaped, headers={"content-type": "application/json"}, timeout=30)
    error = assert_openai_error(response, 400)
    assert error["param"] == param and "lone UTF-16 surrogate" in error["message"]
    emoji = {"prompt": "\U0001f642", "max_tokens": 1}  # a pair, escaped by json.dumps: a character
    assert httpx.post(base_url + "/v1/completions", json=emoji, timeout=30).status_code == 200


def test_an_unforeseen_error_is_counted_as_500_not_as_a_client_that_left(engine, monkeypatch):
    import server.completions

    def fault(*args, **kwargs):
        raise RuntimeError("unforeseen")

    monkeypatch.setattr(server.completions, "tokenized_prompts", fault)
    with serve(engine) as url:
        assert_openai_error(httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10), 500)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    assert 'http_requests_total{route="/v1/completions",status="500"} 1.0' in metrics
    assert 'status="499"' not in metrics


def test_an_engine_failure_mid_stream_is_an_error_event_in_each_apis_shape(engine, monkeypatch):
    """Chat ends with OpenAI's error chunk and [DONE]; Responses with its own typed `error` event,
    numbered in sequence (clients dispatch on `type`)."""
    from engine.async_engine import EngineError

    generate = engine.generate

    async def fail_after_one(*args, **kwargs):
        async for out in generate(*args, **kwargs):
            yield out
            raise EngineError("engine step failed: injected")

    monkeypatch.setattr(engine, "generate", fail_after_one)
    with serve(engine) as url:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert json.loads(lines[-2][len("data: "):])["error"] == {
            "message": "internal server error", "type": "internal_server_error", "param": None, "code": 500}
        assert lines[-1] == "data: [DONE]"
        responses = {"input": "hi", "max_output_tokens": 8, "stream": True}
        with httpx.stream("POST", url + "/v1/responses", json=responses, timeout=30) as r:
            events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1]["type"] == "error" and events[-1]["code"] == "500"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    wait_until_idle(engine, timeout_s=5)


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=-5)
    assert "max_tokens" in str(info.value)


def test_unknown_route_is_404_in_openai_shape(base_url):
    assert_openai_error(httpx.get(base_url + "/v1/nothing", timeout=10), 404)


def test_api_key(engine):
    with serve(engine, api_key="sekrit") as url:
        assert_openai_error(httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10), 401)
        wrong = {"Authorization": "Bearer sekriT"}
        assert_openai_error(httpx.post(url + "/v1/completions", json={"prompt": "hi"}, headers=wrong), 401)
        for path in ("/health", "/ping", "/metrics"):
            assert_openai_error(httpx.get(url + path, timeout=10), 401)
        with openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0) as good:
            assert good.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices
        with openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0) as bad, \
                pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        # Anthropic's clients send the key as x-api-key
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "sekrit"}, timeout=10).status_code == 200
        assert_openai_error(httpx.get(url + "/v1/models", headers={"x-api-key": "sekriT"}, timeout=10), 401)
    with serve(engine, api_key="sekrit", metrics_public=True) as url:
        for path in ("/health", "/ping", "/metrics"):
            assert httpx.get(url + path, timeout=10).status_code == 200
        assert_openai_error(httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10), 401)


def test_timeout_is_504_and_frees_the_request(engine):
    # 8 × 400 tokens take ≥ 0.12 s on a fast machine (the tiny model's step is ~0.1 ms), and
    # their first tokens come within a few ms: a 0.05 s timeout falls between the two
    body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "n": 8}
    with serve(engine, request_timeout_s=0.05) as url:
        assert_openai_error(httpx.post(url + "/v1/completions", json=body, timeout=30), 504)
        wait_until_idle(engine, timeout_s=2)
        # a stream that times out after it started ends with an error event, then [DONE]
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert '"code": 504' in lines[-2] and lines[-1] == "data: [DONE]"
        wait_until_idle(engine, timeout_s=2)



def test_503_while_loading_then_ready(engine):
    app = build_app(None, ServerConfig(served_model_name=MODEL_NAME))
    with serve_in_thread(app) as url:
        assert_openai_error(httpx.get(url + "/health", timeout=10), 503)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert_openai_error(r, 503)
        assert r.headers["retry-after"]
        app.state.driftgate.attach(engine)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        app.state.driftgate.begin_drain()
        assert_openai_error(httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10), 503)
        assert_openai_error(httpx.get(url + "/health", timeout=10), 503)


def test_cors_only_for_named_origins_and_before_auth(engine):
    ui = "http://ui.example"
    preflight = {"Origin": ui, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with serve(engine, api_key="sekrit", allowed_origins=(ui,)) as url:
        r = httpx.options(url + "/v1/completions", headers=preflight, timeout=10)  # browsers send no key here
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ui
        denied = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, headers={"Origin": ui}, timeout=10)
        assert_openai_error(denied, 401)
        assert denied.headers["access-control-allow-origin"] == ui  # the page can read why
        other = httpx.options(url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    with serve(engine) as url:  # no origins named: no CORS headers at all
        r = httpx.get(url + "/v1/models", headers={"Origin": ui}, timeout=10)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
