"""`POST /v1/responses` through the official `openai` client: the chat route's answers, shaped
as responses, whole or as the API's typed event stream."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, serve, wait_until_idle
from tests.server.test_tools import FLAG, PICK

INSTRUCTIONS = "You are terse."
QUESTION = "What is the capital of France?"


def _chat_text(client, **kw) -> tuple[str, str]:
    chat = client.chat.completions.create(model=MODEL_NAME, temperature=0, messages=[
        {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], **kw)
    return chat.choices[0].message.content, chat.choices[0].finish_reason


def test_a_response_is_the_chat_answer(client, engine):
    text, finish = _chat_text(client, max_tokens=12)
    response = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=QUESTION,
                                       max_output_tokens=12, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == text
    assert response.status == ("incomplete" if finish == "length" else "completed")
    assert response.usage.output_tokens <= 12 and response.usage.input_tokens > 0
    # the same conversation as input items, content as parts
    items = client.responses.create(model=MODEL_NAME, max_output_tokens=12, temperature=0, input=[
        {"role": "system", "content": INSTRUCTIONS},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert items.output_text == text
    wait_until_idle(engine)


def test_the_event_stream_builds_the_same_response(client):
    """The client's stream helper checks the event order and assembles the response from the deltas."""
    whole = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=16, temperature=0)
    with client.responses.stream(model=MODEL_NAME, input=QUESTION, max_output_tokens=16, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and final.status == whole.status
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_json_schema_format_is_the_chat_routes_response_format(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    response = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input=QUESTION,
                                       max_output_tokens=200, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    text, _ = _chat_text(client, max_tokens=200, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert response.output_text == text and text.lstrip().startswith("{")


def test_reasoning_comes_as_its_own_output_item(engine):
    """The tiny model cannot think; vLLM's structured_outputs extension makes it write as if (held
    from the first token because an earlier turn in the prompt closes a thinking block)."""
    import openai

    said = "<think>hmm, France.</think>Paris"
    regex = {"structured_outputs": {"regex": "".join(f"[{ch}]" for ch in said)}}
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "<think></think>"},
                    {"role": "user", "content": QUESTION}]
    with serve(engine, reasoning_parser="qwen3") as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        whole = client.responses.create(model=MODEL_NAME, input=conversation, max_output_tokens=60, extra_body=regex)
        with client.responses.stream(model=MODEL_NAME, input=conversation, max_output_tokens=60,
                                     extra_body=regex) as stream:
            events = list(stream)
            final = stream.get_final_response()
    assert whole.output_text == "Paris" and whole.output[0].content[0].text == "hmm, France."
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "hmm, France." and final.output_text == "Paris"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "hmm, France."


@pytest.mark.parametrize(("body", "param"), [
    ({"input": QUESTION, "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tool_choice"),  # auto
    ({"input": QUESTION, "background": True, "stream": True}, "background"),
    ({"input": QUESTION, "background": True, "store": False}, "background"),
    ({"input": QUESTION, "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning"}]}, "input"),  # found by fuzzing: was a 500 (no message left to answer)
])
def test_what_it_cannot_honour_is_a_400(base_url, body, param):
    r = httpx.post(base_url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text


def test_an_unknown_model_is_a_404(base_url):
    r = httpx.post(base_url + "/v1/responses", json={"input": QUESTION, "model": "other"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


def _flat(tool: dict) -> dict:
    """A chat tool in the Responses API's flat shape."""
    return {"type": "function", **tool["function"]}


def test_function_tools_give_function_call_items_as_the_chat_route_gives_tool_calls(client):
    turn = [{"role": "user", "content": "Turn the flag on."}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=turn, tools=[FLAG, PICK], max_tokens=400,
                                          tool_choice="required", parallel_tool_calls=False, temperature=0)
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls]
    assert expected  # "required": at least one call
    body = dict(model=MODEL_NAME, input=turn, tools=[_flat(FLAG), _flat(PICK)], tool_choice="required",
                parallel_tool_calls=False, max_output_tokens=400, temperature=0)  # the tiny model pads with spaces
    response = client.responses.create(**body)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    with client.responses.stream(**body) as stream:
        streamed = stream.get_final_response()
    assert [(i.name, i.arguments) for i in streamed.output if i.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]
    named = client.responses.create(**{**body, "tool_choice": {"type": "function", "name": "pick"}})
    assert [item.name for item in named.output if item.type == "function_call"] == ["pick"]


def test_calls_and_their_outputs_sent_back_are_the_conversation(client):
    """A function_call item and its function_call_output become the chat's assistant tool turn and
    tool turn: the same answer as those chat messages."""
    call = {"id": "call_1", "type": "function", "function": {"name": "set_flag", "arguments": '{"on": true}'}}
    messages = [{"role": "user", "content": "Turn the flag on."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[FLAG], tool_choice="none",
                                          max_tokens=10, temperature=0)
    response = client.responses.create(model=MODEL_NAME, tools=[_flat(FLAG)], tool_choice="none", max_output_tokens=10,
                                       temperature=0, input=[
        messages[0], {"type": "function_call", "call_id": "call_1", "name": "set_flag", "arguments": '{"on": true}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "done"}])
    assert response.output_text == chat.choices[0].message.content


def test_previous_response_id_continues_the_conversation(client, base_url):
    """Its input and answer come before the new input (its instructions do not carry over), as the
    chat route answers the same turns; stored responses can be fetched and deleted."""
    first = client.responses.create(model=MODEL_NAME, instructions=INSTRUCTIONS, input="My name is Ana.",
                                    max_output_tokens=8, temperature=0)
    second = client.responses.create(model=MODEL_NAME, previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "My name is Ana."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id and second.store
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    for r in (httpx.get(f"{base_url}/v1/responses/{first.id}", timeout=10),
              httpx.post(base_url + "/v1/responses", json={"input": "hi", "previous_response_id": first.id})):
        assert r.status_code == 404 and "was not found" in r.json()["error"]["message"]
    # the same turns sent back whole, as clients that keep their own history do (output items as
    # input, a reasoning item among them), answer the same
    replayed = client.responses.create(model=MODEL_NAME, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "My name is Ana."},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "What is my name?"}])
    assert replayed.output_text == second.output_text
    unstored = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, store=False)
    assert not unstored.store and httpx.get(f"{base_url}/v1/responses/{unstored.id}").status_code == 404


def test_the_store_keeps_only_the_newest(engine):
    import openai

    with serve(engine, responses_store_size=1) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        with client.responses.stream(model=MODEL_NAME, input="a", max_output_tokens=2) as stream:
            older = stream.get_final_response()  # a streamed response is stored too
        assert client.responses.retrieve(older.id).id == older.id
        newer = client.responses.create(model=MODEL_NAME, input="b", max_output_tokens=2)
        assert client.responses.retrieve(newer.id).id == newer.id
        assert httpx.get(f"{url}/v1/responses/{older.id}", timeout=10).status_code == 404


def _until_done(client, response_id: str, timeout_s: float = 30.0):
    import time

    deadline = time.monotonic() + timeout_s
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.05)
    return response


def test_a_background_response_returns_at_once_and_finishes_as_a_plain_one(client, engine):
    plain = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=12, temperature=0)
    queued = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=12, temperature=0,
                                     background=True)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = _until_done(client, queued.id)
    assert done.status == plain.status and done.output_text == plain.output_text and done.usage is not None
    # once finished it continues a conversation like any stored response
    follow = client.responses.create(model=MODEL_NAME, input="And Spain?", previous_response_id=done.id,
                                     max_output_tokens=4)
    assert follow.status in ("completed", "incomplete")
    # cancelling a finished one changes nothing
    assert client.responses.cancel(done.id).status == done.status
    wait_until_idle(engine)


def test_a_background_response_can_be_cancelled_and_frees_its_blocks(client, engine):
    # a regex that only 450 characters complete: the response cannot end early
    running = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=450, temperature=0,
                                      background=True, extra_body={"structured_outputs": {"regex": "a{450}"}})
    with pytest.raises(Exception, match="has not finished yet"):  # nothing to continue from yet
        client.responses.create(model=MODEL_NAME, input="more", previous_response_id=running.id)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(running.id).status == "cancelled"
    wait_until_idle(engine)
    assert engine.stats().num_blocks_used == 0
    plain = client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=2)
    with pytest.raises(Exception, match="only those can be cancelled"):
        client.responses.cancel(plain.id)


def test_output_text_logprobs_are_the_chat_routes(client, base_url, engine):
    """include message.output_text.logprobs: the answer's tokens with their top_logprobs, as the
    chat route gives them for the same conversation, whole and spread over the text deltas."""
    chat = client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=10, logprobs=True,
                                          top_logprobs=3, messages=[{"role": "user", "content": QUESTION}])
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    asked = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 10, "temperature": 0, "top_logprobs": 3,
             "include": ["message.output_text.logprobs"]}
    whole = httpx.post(base_url + "/v1/responses", json=asked, timeout=60).json()
    assert whole["output"][0]["content"][0]["logprobs"] == expected
    with httpx.stream("POST", base_url + "/v1/responses", json={**asked, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [lp for e in deltas for lp in e["logprobs"]] == expected
    done = next(e for e in events if e["type"] == "response.completed")["response"]
    assert done["output"][0]["content"][0]["logprobs"] == expected
    # not asked for: none
    plain = httpx.post(base_url + "/v1/responses", json={k: v for k, v in asked.items() if k != "include"},
                       timeout=60).json()
    assert plain["output"][0]["content"][0]["logprobs"] == []
    unknown = httpx.post(base_url + "/v1/responses", json={**asked, "include": ["reasoning.encrypted_content"]},
                         timeout=30)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "include"
    with serve(engine, reasoning_parser="qwen3") as url:
        r = httpx.post(url + "/v1/responses", json=asked, timeout=30)
        assert r.status_code == 400 and "reasoning-parser" in r.json()["error"]["message"]


def test_truncation_auto_drops_the_oldest_turns_to_fit(base_url, engine):
    """OpenAI's truncation: "disabled" (the default) leaves a conversation longer than the context a
    400; "auto" drops its oldest turns until it fits, keeping as many of the newest as fit."""
    max_len = httpx.get(base_url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    words = " ".join(["lorem"] * 60)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {words}"} for i in range(80)]
    turns.append({"role": "user", "content": QUESTION})
    body = {"input": turns, "max_output_tokens": 4, "temperature": 0}

    def prompt_len(messages: list[dict]) -> int:
        return len(httpx.post(base_url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"])

    assert prompt_len(turns) + 4 > max_len  # the whole conversation does not fit
    refused = httpx.post(base_url + "/v1/responses", json=body, timeout=60)
    assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]["message"]
    reply = httpx.post(base_url + "/v1/responses", json={**body, "truncation": "auto"}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["truncation"] == "auto"
    kept = next(k for k in range(len(turns), 0, -1) if prompt_len(turns[-k:]) + 4 <= max_len)
    assert 1 < kept < len(turns)
    usage = reply.json()["usage"]
    assert usage["input_tokens"] == prompt_len(turns[-kept:])  # the newest turns that fit, no fewer
    wait_until_idle(engine)
