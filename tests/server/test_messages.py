"""Anthropic's Messages API through Anthropic's own SDK: answers equal the chat route's for the
same conversation, streamed and not; tools; stop sequences; token counting; errors in Anthropic's
shape."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

anthropic = pytest.importorskip("anthropic")

SYSTEM = "You are terse."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = [{"role": "system", "content": SYSTEM}, *MESSAGES]
GREEDY = {"temperature": 0}  # Anthropic's current SDK sends no sampling fields; older ones and raw bodies do
PICK = {"name": "pick", "description": "Pick a size", "input_schema": {
    "type": "object", "properties": {"size": {"enum": ["s", "m"]}}, "required": ["size"],
    "additionalProperties": False}}


@pytest.fixture
def claude(base_url):
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _chat(client, **fields):
    return client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=0, **fields)


def test_a_message_is_the_chat_routes_answer(claude, client):
    chat = _chat(client, max_tokens=12)
    message = claude.messages.create(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES, max_tokens=12,
                                     extra_body=GREEDY)
    assert message.role == "assistant" and message.id.startswith("msg_") and message.model == MODEL_NAME
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.cache_read_input_tokens > 0  # the same prompt again: the prefix cache served it
    assert usage.output_tokens == chat.usage.completion_tokens


def test_the_stream_sends_anthropics_events_and_the_same_answer(claude, base_url):
    whole = claude.messages.create(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES, max_tokens=16,
                                   extra_body=GREEDY)
    with claude.messages.stream(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES, max_tokens=16,
                                extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "stream": True, **GREEDY}
    with httpx.stream("POST", base_url + "/v1/messages", json=body, timeout=30) as r:
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_stop_sequence_ends_the_message_and_is_named(claude):
    free = claude.messages.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, extra_body=GREEDY).content[0].text
    stop = free.strip()[len(free.strip()) // 2:][:3]  # three characters from the middle of the greedy answer
    message = claude.messages.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, extra_body=GREEDY,
                                     stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text and free.startswith(message.content[0].text)


def test_a_forced_tool_is_a_tool_use_block_and_its_result_goes_back(claude):
    forced = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=400, tools=[PICK],
                  tool_choice={"type": "tool", "name": "pick"}, extra_body={"seed": 0})
    message = claude.messages.create(**forced)
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and call.name == "pick" and call.input["size"] in ("s", "m")
    with claude.messages.stream(**forced) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["tool_use"] and streamed.content[0].input["size"] in ("s", "m")
    follow_up = [*MESSAGES, {"role": "assistant", "content": [call.model_dump()]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "done"},
                                              {"type": "text", "text": "Thanks."}]}]
    answer = claude.messages.create(model=MODEL_NAME, messages=follow_up, max_tokens=4, tools=[PICK],
                                    tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.stop_reason in ("max_tokens", "end_turn")


def test_an_output_format_holds_the_answer_to_its_schema(claude):
    for seed in range(3):  # sampled: a few different answers, each held to the schema
        message = claude.messages.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=400,
                                         output_config={"format": {"type": "json_schema",
                                                                   "schema": PICK["input_schema"]}},
                                         extra_body={"seed": seed})
        assert message.stop_reason == "end_turn" and json.loads(message.content[0].text)["size"] in ("s", "m")


def test_count_tokens_counts_the_rendered_prompt(claude, base_url):
    counted = claude.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES)
    ids = httpx.post(base_url + "/tokenize", json={"messages": CHAT}, timeout=10).json()["tokens"]
    assert counted.input_tokens == len(ids)
    with_tools = claude.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES, tools=[PICK])
    usage = claude.messages.create(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES, tools=[PICK], max_tokens=1,
                                   tool_choice={"type": "none"}).usage
    assert with_tools.input_tokens == usage.input_tokens + usage.cache_read_input_tokens  # what the request took


@pytest.mark.parametrize("body, message", [
    ({"messages": MESSAGES}, "max_tokens"),
    ({"messages": [{"role": "robot", "content": "hi"}], "max_tokens": 4}, "messages.0.role"),
    ({"messages": MESSAGES, "max_tokens": 4, "tool_choice": {"type": "sometimes"}}, "tool_choice type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}],
      "max_tokens": 4}, "tool_use blocks belong in assistant messages"),
    ({"messages": MESSAGES, "max_tokens": 4, "output_config": {"effort": "extreme"}}, "output_config.effort"),
])
def test_bad_requests_are_400s_in_anthropics_shape(claude, base_url, body, message):
    reply = httpx.post(base_url + "/v1/messages", json={"model": MODEL_NAME, **body}, timeout=10)
    assert reply.status_code == 400
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]
    if "max_tokens" in body:  # the SDK itself refuses a body without it
        with pytest.raises(anthropic.BadRequestError, match=message.split(".")[0]):
            claude.messages.create(**{"model": MODEL_NAME, **body})


def test_an_unknown_model_is_anthropics_404(claude):
    with pytest.raises(anthropic.NotFoundError, match="'other' is not served here"):
        claude.messages.create(model="other", messages=MESSAGES, max_tokens=4)


@pytest.mark.parametrize("extra, message", [
    ({"mcp_servers": [{"type": "url", "url": "https://example.com/sse", "name": "x"}]}, "mcp_servers: MCP connectors"),
    ({"container": "container_011"}, "container: code-execution containers"),
])
def test_server_side_tools_are_refused_not_ignored(claude, extra, message):
    """Anthropic's beta server-side features (sent by the SDK as extra fields) ask for tools this server lacks."""
    with pytest.raises(anthropic.BadRequestError, match=message):
        claude.messages.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, extra_body=extra)


def test_not_json_is_a_400_too(base_url):
    reply = httpx.post(base_url + "/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and json.loads(reply.text)["type"] == "error"


def test_thinking_comes_as_its_own_block_before_the_text():
    """With --reasoning-parser the thinking is a `thinking` block, streamed before the text block
    (a tiny random model cannot think: the renderer gets a thinking model's outputs directly)."""
    from engine.outputs import CompletionOutput, RequestOutput
    from server.messages import MessagesRequest, _Renderer, as_chat
    from server.tools import ToolCallReader

    body = MessagesRequest(model=MODEL_NAME, messages=MESSAGES, max_tokens=20)
    renderer = _Renderer(body, "msg_1", MODEL_NAME, 7, "qwen3", ToolCallReader(as_chat(body), None))
    texts = ["<think>hm", "<think>hmm</think>Pa", "<think>hmm</think>Paris"]
    events = []
    for i, text in enumerate(texts):
        done = i == len(texts) - 1
        out = RequestOutput("r", None, [1] * 7, [CompletionOutput(0, text, [1] * (i + 1), finish_reason="stop" if done
                                                                  else None)], finished=done)
        events += renderer.delta(0, out)
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "hmm" and "".join(d.get("text", "") for d in deltas) == "Paris"
    assert renderer.message(out)["content"] == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                                                 {"type": "text", "text": "Paris"}]
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


def test_thinking_budget_tokens_caps_the_thinking_block(engine):
    """`thinking: {type: enabled, budget_tokens}` is the chat route's thinking_token_budget: under
    deepseek_r1 the tiny model's thinking ends after that many tokens and text follows; `disabled`
    closes the block at once; enabled without a budget is a 400 in Anthropic's shape."""
    from tests.server.conftest import serve

    with serve(engine, reasoning_parser="deepseek_r1") as url, \
            anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60) as claude:
        ask = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 24, "extra_body": GREEDY}
        free = claude.messages.create(**ask)
        assert [b.type for b in free.content] == ["thinking", "text"]
        assert free.content[0].thinking and free.content[1].text == ""  # the tiny model never ends its thinking
        capped = claude.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 5})
        # what it thought is the free run's first 5 tokens (whose text alone is shorter)
        assert len(capped.content[0].thinking) < len(free.content[0].thinking)
        assert free.content[0].thinking.startswith(capped.content[0].thinking)
        off = claude.messages.create(**ask, thinking={"type": "disabled"})
        assert off.content[0].thinking == "" and off.usage.output_tokens == 24
        reply = httpx.post(url + "/v1/messages", json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4,
                                                       "thinking": {"type": "enabled"}}, timeout=10)
        assert reply.status_code == 400 and "budget_tokens" in reply.json()["error"]["message"]
