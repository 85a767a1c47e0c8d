"""`serve --reasoning-parser`: thinking returned apart from the answer, whole or streamed."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.reasoning import split_reasoning
from tests.server.conftest import serve
from tests.server.test_openai_api import MESSAGES


@pytest.mark.parametrize(("parser", "text", "expected"), [
    ("deepseek_r1", "hmm</think>\n\nParis", ("hmm", "\n\nParis")),
    ("deepseek_r1", "<think>hmm</think>Paris", ("hmm", "Paris")),  # a template that leaves the tag to the model
    ("deepseek_r1", "still thinking", ("still thinking", "")),  # cut off by max_tokens
    ("deepseek_r1", "</think>", ("", "")),
    ("qwen3", "<think>\nhmm\n</think>\n\nParis", ("\nhmm\n", "\n\nParis")),
    ("qwen3", "Paris", (None, "Paris")),  # thinking off (enable_thinking=false): all answer
    ("qwen3", "a </think> b", (None, "a </think> b")),
    ("qwen3", "<think>cut off", ("cut off", "")),
])
def test_final_split(parser, text, expected):
    assert split_reasoning(text, parser, final=True) == expected


PIECES = ["<think>", "</think>", "<", "</", "</th", "<thi", "think>", "abc", " ", "\n", ">"]


@given(st.sampled_from(["deepseek_r1", "qwen3"]), st.lists(st.sampled_from(PIECES), max_size=8))
def test_what_is_streamed_is_a_prefix_of_the_final_parts(parser, pieces):
    """Every streamed prefix of thinking and answer is a prefix of the final ones, so deltas never
    have to be taken back, and no fragment of a tag is sent as text."""
    text = "".join(pieces)
    final_thinking, final_answer = split_reasoning(text, parser, final=True)
    sent_thinking = sent_answer = ""
    for end in range(len(text) + 1):
        thinking, answer = split_reasoning(text[:end], parser, final=False)
        assert (thinking or "").startswith(sent_thinking) and answer.startswith(sent_answer)
        sent_thinking, sent_answer = thinking or "", answer
        assert (final_thinking or "").startswith(sent_thinking) and final_answer.startswith(sent_answer)


def _forced(said: str, **body) -> dict:
    """A chat request that makes the tiny model (which cannot think) write `said`: a regex of it,
    held from the first token because the prompt already closes a thinking block (a constraint
    under a reasoning parser starts after </think>)."""
    closed = {"role": "assistant", "content": "<think></think>"}
    return {"messages": [*MESSAGES, closed], "add_generation_prompt": False, "continue_final_message": True,
            "temperature": 0, "guided_regex": "".join(f"[{ch}]" for ch in said), **body}


def test_chat_returns_the_thinking_as_reasoning_content(engine):
    """The tiny model cannot think; a regex makes it write what a reasoning model writes."""
    said = "<think>hmm, France.</think>Paris"
    body = _forced(said, max_tokens=60)
    with serve(engine, reasoning_parser="qwen3") as url:
        message = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("hmm, France.", "Paris")
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in s.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "hmm, France."
        assert "".join(d.get("content") or "" for d in deltas) == "Paris"
        # the thinking streams before the answer is known
        assert any(d.get("reasoning_content") for d in deltas[:-1])
    with serve(engine) as url:  # without a parser the thinking stays in the content
        message = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (None, said)


def test_tool_calls_are_read_from_the_answer_after_the_thinking(engine):
    from tests.server.test_tools import FLAG

    said = '<think>set it</think><tool_call>{"name": "set_flag", "arguments": {"on": true}}</tool_call>'
    body = _forced(said, tools=[FLAG], max_tokens=90)
    with serve(engine, reasoning_parser="qwen3", tool_call_parser="hermes") as url:
        choice = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "set it"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["set_flag"]


def test_an_unknown_reasoning_parser_is_refused():
    from server.config import ServerConfig

    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'; known: deepseek_r1, qwen3"):
        ServerConfig(served_model_name="x", reasoning_parser="o1")


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_constraint_holds_the_answer_not_the_thinking(engine, parser):
    """The constraint starts after </think> (the engine's structured_outputs_after), so the model
    thinks freely: the tiny model never writes it, so its output comes back as without a
    constraint. With thinking turned off the prompt holds the closed block, and the constraint
    holds from the first token."""
    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}}
    plain = {k: v for k, v in body.items() if k != "response_format"}
    no_thinking = {**body, "messages": [*MESSAGES, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
                   "add_generation_prompt": False, "continue_final_message": True}
    # an earlier turn's closed block, then a new one opened: the last marker decides, the thinking is free
    reopened = {**no_thinking, "messages": [*no_thinking["messages"][:-1],
                                            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nok"},
                                            {"role": "user", "content": "Again."},
                                            {"role": "assistant", "content": "<think>\n"}]}
    reopened_plain = {k: v for k, v in reopened.items() if k != "response_format"}
    with serve(engine, reasoning_parser=parser) as url:
        held, free, answered, held_again, free_again = (
            httpx.post(url + "/v1/chat/completions", json=b, timeout=60).json()["choices"][0]["message"]
            for b in (body, plain, no_thinking, reopened, reopened_plain))
        assert held == free and held_again == free_again
        # deepseek_r1's parser reads an output with no </think> as thinking (vLLM's does too)
        assert answered["content" if parser == "qwen3" else "reasoning_content"].lstrip().startswith("{")


def test_thinking_token_budget_ends_the_thinking_and_the_answer_follows(engine):
    """deepseek_r1: the output thinks from its first token; the tiny model never writes </think>,
    so without a budget it thinks to max_tokens. With a budget of 6 the end marker's tokens come
    right after 6 tokens, and the JSON constraint, which starts after </think>, holds the answer."""
    end_ids = engine.tokenizer.encode("</think>", add_special_tokens=False)
    body = {"messages": MESSAGES, "max_tokens": 30, "temperature": 0, "return_token_ids": True,
            "response_format": {"type": "json_object"}}
    with serve(engine, reasoning_parser="deepseek_r1") as url:
        free = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        capped = httpx.post(url + "/v1/chat/completions", json={**body, "thinking_token_budget": 6},
                            timeout=60).json()["choices"][0]
        assert free["message"]["content"] in ("", None) and free["message"]["reasoning_content"]
        assert capped["token_ids"][:6] == free["token_ids"][:6]
        assert capped["token_ids"][6:6 + len(end_ids)] == end_ids
        assert capped["message"]["content"].lstrip().startswith("{")
        bad = httpx.post(url + "/v1/chat/completions", json={**body, "thinking_token_budget": -1}, timeout=60)
        assert bad.status_code == 400 and "thinking_token_budget" in bad.text
        beams = {"messages": MESSAGES, "max_tokens": 8, "use_beam_search": True, "n": 2, "thinking_token_budget": 4}
        bad = httpx.post(url + "/v1/chat/completions", json=beams, timeout=60)
        assert bad.status_code == 400 and "beam search" in bad.json()["error"]["message"]
    with serve(engine) as url:  # no parser: nothing names the block's markers
        reply = httpx.post(url + "/v1/chat/completions", json={**body, "thinking_token_budget": 6}, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "thinking_token_budget"
        assert "--reasoning-parser" in reply.json()["error"]["message"]
