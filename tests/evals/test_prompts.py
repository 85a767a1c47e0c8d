"""`gate --prompts`: request bodies become the token ids the server would build for them."""

from __future__ import annotations

import json
import re

import pytest

from engine.tokenizer import load_tokenizer
from evals.prompts import OwnPrompt, PromptFileError, answer_items, read_prompt_file
from tests.helpers import write_tiny_tokenizer

MESSAGES = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder)
    return load_tokenizer(folder)


def _write(path, lines) -> None:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")


def test_chat_completion_and_batch_lines_become_the_servers_prompts(tokenizer, tmp_path):
    chat = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    path = tmp_path / "traffic.jsonl"
    _write(path, [{"messages": MESSAGES, "temperature": 0.7}, "",
                  {"prompt": "a b c"}, {"prompt": [5, 6, 7]},
                  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": MESSAGES}}])
    assert [p.token_ids for p in read_prompt_file(path, tokenizer)] == [chat, tokenizer.encode("a b c"), [5, 6, 7], chat]


@pytest.mark.parametrize("line, message", [
    ("{not json", ":2: not valid JSON"),
    ({"messages": "hello"}, ":2: messages: "),
    ({"messages": [{"content": "hi"}]}, ":2: messages.0"),
    ({"prompt": ""}, ':2: "prompt" must be non-empty text'),
    ({"prompt": [1, 10**6]}, ":2: \"prompt\" must be non-empty text or a list of token ids below"),
    ({"input": "x"}, ':2: no "messages" or "prompt" among [\'input\']'),
    ({"prompt": "x", "expected": ""}, ':2: "expected" must be a non-empty string or number'),
    ({"prompt": "x", "expected": ["a", True]}, ':2: "expected" must be a non-empty string or number'),
    ({"prompt": "x", "expected": []}, ':2: "expected" must be a non-empty string or number'),
])
def test_a_bad_line_is_named_by_its_number(tokenizer, tmp_path, line, message):
    path = tmp_path / "traffic.jsonl"
    _write(path, [{"prompt": "fine"}, line])
    with pytest.raises(PromptFileError, match=re.escape("traffic.jsonl" + message)):
        read_prompt_file(path, tokenizer)


def test_missing_or_empty_files_say_so(tokenizer, tmp_path):
    with pytest.raises(PromptFileError, match="not found"):
        read_prompt_file(tmp_path / "none.jsonl", tokenizer)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(PromptFileError, match="no prompts"):
        read_prompt_file(tmp_path / "empty.jsonl", tokenizer)


def test_expected_answers_are_read_and_judged_up_to_the_end_of_sequence(tokenizer, tmp_path):
    path = tmp_path / "labelled.jsonl"
    _write(path, [{"prompt": "capital of France?", "expected": "Paris"},
                  {"prompt": "2+2?", "expected": ["4", "four"]}, {"prompt": "no label"}])
    prompts = read_prompt_file(path, tokenizer)
    assert [p.expected for p in prompts] == [("Paris",), ("4", "four")] + [()]
    _write(tmp_path / "other.jsonl", [  # a number for its text; a batch line's label beside or inside its body
        {"prompt": "2+2?", "expected": 4},
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "3+3?", "expected": [6, "six"]}}])
    assert [p.expected for p in read_prompt_file(tmp_path / "other.jsonl", tokenizer)] == [("4",), ("6", "six")]
    words = {1: "It is", 2: " PARIS.", 3: "<eos>", 4: " Four", 5: " five"}

    def decode(ids):
        return "".join(words[i] for i in ids)

    items = answer_items(prompts, [[1, 2, 3, 4], [1, 5, 3, 4], [1]], decode, end_ids=[3])
    assert sorted(items) == [0, 1]  # the unlabelled prompt is not judged
    assert items[0].correct and items[0].response == "It is PARIS." and not items[0].hit_max_tokens
    assert not items[1].correct  # " Four" comes after the end of sequence: not part of the answer
    assert answer_items([OwnPrompt([7], ("four",))], [[1, 4]], decode, [3])[0].correct  # case aside, no end


def test_expected_answers_match_whole_words_only():
    """A drifted number or a longer word that merely contains the expected text is wrong."""
    cases = [("The answer is 42.", "42", True), ("The answer is 142.", "42", False), ("4200 apples", "42", False),
             ("Parisian food", "Paris", False), ("it's Paris, France", "paris, france", True),
             ("costs $5 today", "$5", True), ("costs $50", "$5", False), ("x = 3.14", "3.14", True),
             ("New\n  York", "new york", True),
             # a number matches any number of its value, and no longer or signed other one
             ("It costs 1,000 dollars", "1000", True), ("1000.0 in total", "1,000", True), ("is 42", "42.0", True),
             ("3.145", "3.14", False), ("v2.0", "2", False), ("5 degrees", "-5", False), ("-5 degrees", "-5", True),
             ("5-3=2", "3", True)]
    for answer, expected, right in cases:
        items = answer_items([OwnPrompt([7], (expected,))], [[0]], lambda ids, a=answer: a, end_ids=[])
        assert items[0].correct is right, (answer, expected)
