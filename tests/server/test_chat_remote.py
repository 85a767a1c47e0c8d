"""`driftgate chat --url`: the same conversation against a live server, streamed from its chat completions."""

from __future__ import annotations

import io

import pytest

from server.chat_client import RemoteChat
from tests.server.conftest import MODEL_NAME, serve, wait_until_idle


def test_each_turn_answers_the_whole_conversation_as_the_server_would(base_url, client, engine):
    chat = RemoteChat(base_url, None, {"temperature": 0, "max_tokens": 6}, system="be brief")
    assert chat.model == MODEL_NAME  # the first model the server lists
    streamed: list[str] = []
    first = chat.ask("hello there", streamed.append)
    assert "".join(streamed) == first.text and first.num_tokens > 0
    second = chat.ask("and again", lambda _: None)
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
                    {"role": "assistant", "content": first.text}, {"role": "user", "content": "and again"}]
    expected = client.chat.completions.create(model=MODEL_NAME, messages=conversation, temperature=0, max_tokens=6)
    assert second.text == expected.choices[0].message.content
    assert second.finish_reason == expected.choices[0].finish_reason
    assert chat.turns == conversation[1:] + [{"role": "assistant", "content": second.text}]
    wait_until_idle(engine)


def test_the_oldest_turns_leave_when_the_server_says_the_context_is_full(base_url, engine):
    chat = RemoteChat(base_url + "/v1/", MODEL_NAME, {"temperature": 0, "max_tokens": 4})
    long = "word " * 150
    chat.turns = [{"role": "user", "content": long}, {"role": "assistant", "content": long}] * 2
    reply = chat.ask("short question", lambda _: None)
    assert reply.dropped_turns >= 1 and reply.num_tokens > 0
    assert chat.turns[-2:] == [{"role": "user", "content": "short question"}, {"role": "assistant", "content": reply.text}]
    with pytest.raises(ValueError, match="maximum context length"):
        chat.ask(long * 4, lambda _: None)  # too long alone: refused, the conversation kept
    assert chat.turns[-1]["content"] == reply.text
    wait_until_idle(engine)


def test_ctrl_c_closes_the_stream_and_the_server_frees_the_request(base_url, engine):
    chat = RemoteChat(base_url, MODEL_NAME, {"temperature": 0, "max_tokens": 200, "ignore_eos": True})
    chunks: list[str] = []

    def write(text: str) -> None:
        chunks.append(text)
        if len(chunks) == 2:
            raise KeyboardInterrupt

    reply = chat.ask("tell me a long story", write)
    assert reply.finish_reason == "interrupted" and reply.text == "".join(chunks)
    assert chat.turns[-1] == {"role": "assistant", "content": reply.text}
    wait_until_idle(engine)


def test_a_server_out_of_reach_or_refusing_the_key_is_one_clear_error(engine):
    with pytest.raises(ValueError, match="cannot reach http://127.0.0.1:9/v1"):
        RemoteChat("http://127.0.0.1:9", None, {})
    with serve(engine, api_key="secret") as url:
        with pytest.raises(ValueError, match="answered HTTP 401: missing or invalid API key$"):
            RemoteChat(url, None, {})
        assert RemoteChat(url, None, {"max_tokens": 2}, api_key="secret").ask("hi", lambda _: None).num_tokens > 0


def test_the_command_talks_to_the_server_named_by_url(base_url, monkeypatch, capsys):
    import io

    from engine.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n"))
    assert main(["chat", "--url", base_url, "--max-tokens", "3", "--temperature", "0", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and err.count("tokens") == 2 and "Traceback" not in err
    assert main(["chat"]) == 2 and "name a model folder, or a server with --url" in capsys.readouterr().err


class _Stream(io.BytesIO):
    """A canned server-sent-event body, as urllib's response reads."""


def _canned(chat: RemoteChat, monkeypatch, events: list[str]) -> None:
    body = "".join(f"data: {event}\n\n" for event in events).encode()
    monkeypatch.setattr(chat, "_open", lambda *args: _Stream(body))


def test_a_stream_cut_short_is_an_error_and_ctrl_c_before_any_answer_keeps_the_session(base_url, monkeypatch):
    chat = RemoteChat(base_url, MODEL_NAME, {"max_tokens": 4})
    chat.ask("hi", lambda _: None)
    before = list(chat.turns)
    _canned(chat, monkeypatch, ['{"choices": [{"delta": {"content": "the"}}]}'])  # no finish, no [DONE]
    with pytest.raises(ValueError, match="before the server said \\[DONE\\]"):
        chat.ask("again", lambda _: None)
    assert chat.turns == before

    def interrupted(*_args):
        raise KeyboardInterrupt  # Ctrl-C while the server still prefills: no byte yet

    monkeypatch.setattr(chat, "_open", interrupted)
    reply = chat.ask("again", lambda _: None)
    assert reply.finish_reason == "interrupted" and chat.turns == before


def test_without_usage_the_stats_count_the_streamed_chunks(base_url, monkeypatch):
    chat = RemoteChat(base_url, MODEL_NAME, {})
    _canned(chat, monkeypatch, ['{"choices": [{"delta": {"content": "a"}}]}', '{"choices": [{"delta": {"content": "b"}}]}',
                                '{"choices": [{"delta": {}, "finish_reason": "stop"}]}', "[DONE]"])
    assert chat.ask("hi", lambda _: None).num_tokens == 2


def test_a_model_name_the_server_does_not_list_is_refused_at_start(base_url):
    with pytest.raises(ValueError, match="not 'nope'"):
        RemoteChat(base_url, "nope", {})


def test_engine_flags_with_url_are_refused(base_url, capsys):
    from engine.cli import main

    assert main(["chat", "--url", base_url, "--dtype", "bfloat16", "--max-model-len", "64"]) == 2
    assert "--dtype, --max-model-len set an in-process engine" in capsys.readouterr().err
