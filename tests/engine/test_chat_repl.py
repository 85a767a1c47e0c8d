"""`driftgate chat`: each turn answers the whole conversation, as LLM.chat would; the oldest turns
leave when the context fills; Ctrl-C stops an answer between steps and frees its blocks."""

from __future__ import annotations

import io
import signal

import pytest

from engine import LLM, SamplingParams
from engine.chat_repl import ChatSession, _ask_with_ctrl_c, read_message
from engine.cli import main
from tests.engine.test_llm_api import assert_idle, greedy


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=160, num_kv_blocks=64)


def test_each_turn_answers_the_whole_conversation_as_llm_chat_does(llm):
    session = ChatSession(llm, greedy(max_tokens=6), system="be brief")
    streamed: list[str] = []
    first = session.ask("hello there", streamed.append)
    assert "".join(streamed) == first.text and first.num_tokens > 0 and first.finish_reason in ("stop", "length")
    second = session.ask("and again", lambda _: None)
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
                    {"role": "assistant", "content": first.text}, {"role": "user", "content": "and again"}]
    expected = llm.chat(conversation, greedy(max_tokens=6), use_tqdm=False)[0].outputs[0].text
    assert second.text == expected
    assert session.turns == conversation[1:] + [{"role": "assistant", "content": second.text}]
    session.clear()
    assert session.ask("and again", lambda _: None).text == llm.chat(
        [conversation[0], conversation[3]], greedy(max_tokens=6), use_tqdm=False)[0].outputs[0].text
    assert_idle(llm)


def test_the_oldest_turns_leave_when_the_context_fills_and_the_system_prompt_stays(llm):
    session = ChatSession(llm, greedy(max_tokens=8), system="be brief")
    dropped = []
    for i in range(12):
        dropped.append(session.ask(f"message {i} " + "word " * 12, lambda _: None).dropped_turns)
    assert dropped[0] == 0 and sum(dropped) > 0
    assert session.turns[0]["role"] == "user" and "message 11" in session.turns[-2]["content"]
    prompt, _ = session._fit(session.turns + [{"role": "user", "content": "next"}])
    assert len(prompt) <= llm.engine.max_model_len - session.answer_room
    assert "be brief" in llm.tokenizer.decode(prompt)


def test_a_message_too_long_alone_is_refused_and_the_conversation_kept(llm):
    session = ChatSession(llm, greedy(max_tokens=4))
    session.ask("hi", lambda _: None)
    before = list(session.turns)
    with pytest.raises(ValueError, match="send a shorter one"):
        session.ask("word " * 400, lambda _: None)
    assert session.turns == before
    assert_idle(llm)


def test_ctrl_c_stops_the_answer_between_steps_and_frees_its_blocks(llm):
    session = ChatSession(llm, greedy(max_tokens=60, ignore_eos=True))
    chunks = []
    handler = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN when run in the background

    def write(text: str) -> None:
        chunks.append(text)
        if len(chunks) == 3:
            signal.raise_signal(signal.SIGINT)  # the handler only sets a flag: the step finishes

    reply = _ask_with_ctrl_c(session, "tell me a long story", write)
    assert reply.finish_reason == "interrupted" and 0 < reply.num_tokens < 60
    assert session.turns[-1] == {"role": "assistant", "content": reply.text}
    assert signal.getsignal(signal.SIGINT) is handler  # restored
    assert_idle(llm)
    assert session.ask("and then?", lambda _: None).finish_reason == "length"  # the engine still serves


def test_a_line_ending_in_a_backslash_goes_on(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("first\\\nsecond\nthird\n"))
    assert read_message(False) == "first\nsecond"
    assert read_message(False) == "third"
    assert read_message(False) is None


def test_the_command_reads_turns_until_exit(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\n/clear\nhi again\n/exit\nnever read\n"))
    assert main(["chat", str(tiny_model_dir), "--max-tokens", "3", "--temperature", "0", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and err.count("tokens") == 2 and "Traceback" not in err


def test_the_command_refuses_a_model_without_a_chat_template(tiny_model_dir, tmp_path, capsys):
    import json
    import shutil

    folder = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["chat", str(folder)]) == 2
    assert "no chat template" in capsys.readouterr().err


def test_a_message_alone_may_take_more_than_the_answers_room(llm):
    """Earlier turns leave to keep room for an answer, but a lone message that fits is answered
    with what is left (it was refused past half the context)."""
    session = ChatSession(llm, greedy(max_tokens=None))  # answer_room: half the context
    long = "word " * 30
    prompt, dropped = session._fit([{"role": "user", "content": long}])
    assert session.answer_room < len(prompt) < llm.engine.max_model_len - 1 and dropped == 0
    reply = session.ask(long, lambda _: None)
    assert reply.num_tokens > 0
    assert_idle(llm)


def test_a_seed_moves_on_with_each_turn_so_a_session_replays_but_turns_differ(llm):
    def session_answers() -> list[str]:
        session = ChatSession(llm, SamplingParams(temperature=1.0, max_tokens=8, seed=7))
        return [session.ask("same question", lambda _: None).text for _ in range(2)]

    first = session_answers()
    assert first == session_answers()  # the same session again: the same answers
    session = ChatSession(llm, SamplingParams(seed=7))
    assert session.turn_seed(7) == 7
    session.record([{"role": "user", "content": "q"}], 0, "a", "stop")
    assert session.turn_seed(7) == 8 and session.turn_seed(None) is None


def test_ctrl_c_before_any_answer_leaves_the_conversation_as_it_was(llm):
    session = ChatSession(llm, greedy(max_tokens=8))
    session.ask("hi", lambda _: None)
    before = list(session.turns)
    reply = session.ask("again", lambda _: None, interrupted=lambda: True)
    assert reply.finish_reason == "interrupted" and reply.text == "" and session.turns == before
    assert_idle(llm)


def test_input_that_is_not_utf8_and_ctrl_c_while_continuing_a_message(monkeypatch):
    import builtins

    monkeypatch.setattr("sys.stdin", io.StringIO("ab\udcff\udcfecd\n"))  # stdin's surrogateescape of \xff\xfe
    assert read_message(False) == "ab\ufffd\ufffdcd"
    typed = iter(["first \\", KeyboardInterrupt, "second"])

    def fake_input(_prompt: str) -> str:
        value = next(typed)
        if value is KeyboardInterrupt:
            raise KeyboardInterrupt
        return value

    monkeypatch.setattr(builtins, "input", fake_input)
    assert read_message(True) == "second"  # Ctrl-C dropped the unfinished message, not the session


def test_a_failed_turn_makes_a_piped_session_exit_1(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(("word " * 200) + "\nhello\n"))
    assert main(["chat", str(tiny_model_dir), "--max-model-len", "64", "--max-tokens", "2"]) == 1
    out, err = capsys.readouterr()
    assert "the context holds 64: send a shorter one" in err and "Traceback" not in err


def test_the_kv_cache_size_and_context_take_sizes_as_serve_does(tiny_model_dir, capsys):
    """`--kv-cache-memory-bytes` (chat and generate, as serve): a cache twice the size holds twice
    the blocks; one too small for a single context is one clear error, exit 2."""
    import argparse

    from engine.cli import add_engine_args, llm_from_args

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_args(parser)
    blocks = []
    for size in ("1M", "2M"):
        llm, _ = llm_from_args(parser.parse_args([str(tiny_model_dir), "--kv-cache-memory-bytes", size,
                                                  "--max-model-len", "0.5k"]))
        assert llm.engine.max_model_len == 500
        blocks.append(llm.engine.block_manager.num_blocks)
    assert blocks[1] == 2 * blocks[0]
    assert main(["chat", str(tiny_model_dir), "--kv-cache-memory-bytes", "1K"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "kv_cache_memory_bytes" in err and "Traceback" not in err
