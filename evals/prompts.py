"""Tier 2 prompts from the deployment's own traffic (`driftgate gate --prompts FILE`).

A checkpoint can keep its benchmark scores and still drift on the prompts it will actually
serve: a long system prompt, a tool schema, another language. The file holds request bodies
as clients send them, one JSON object a line, and each becomes the token ids the server would
build for it:

- a chat request (`{"messages": [...], "tools": ...}`), rendered by the model's chat template
  exactly as `/v1/chat/completions` renders it;
- a completion request (`{"prompt": "..."}`, or a list of token ids);
- an OpenAI batch line (`{"custom_id": ..., "body": {...}}`, as `run-batch` reads), by its body.

A line may also say what a right answer contains (`"expected": "Paris"`, or a list of accepted
answers): each arm's greedy answer (up to its end of sequence) is then right when it contains one
as a whole word, case and spacing aside ("42" is not found in "142", nor "Paris" in "Parisian"),
a number as any number of its value ("1000" in "1,000.0"), and the two arms' right and wrong
answers are compared as Tier 1's items are.

Every line is checked before either model loads, and a bad one is named by its line number.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from engine.json_object import numbered_lines, parse_json_object
from evals.drift import ItemResult
from server.chat import render_chat
from server.errors import APIError, invalid_body
from server.protocol import ChatCompletionRequest

_EXPECTED = ('a chat request ("messages"), a completion request ("prompt": text or token ids) or a batch line '
             'with one of those as its "body"')


class PromptFileError(ValueError):
    """The prompt file cannot be used; the message names the file and, where it applies, the line."""


@dataclass(frozen=True, slots=True)
class OwnPrompt:
    token_ids: list[int]
    expected: tuple[str, ...] = ()  # what a right answer contains (any one of them); empty: not said


def read_prompt_file(path: Path, tokenizer) -> list[OwnPrompt]:
    """Every line's prompt as token ids, with its expected answers, in file order (blank lines skipped)."""
    path = Path(path)
    prompts = []
    for line_no, raw in numbered_lines(path, "prompt file", PromptFileError):
        try:
            line = parse_json_object(raw)
            ids = _prompt_ids(line, tokenizer)
        except ValidationError as exc:
            raise PromptFileError(f"{path}:{line_no}: {invalid_body(exc).message}") from None
        except APIError as exc:  # the chat template refused the conversation
            raise PromptFileError(f"{path}:{line_no}: {exc.message}") from None
        except ValueError as exc:
            raise PromptFileError(f"{path}:{line_no}: {exc}; expected {_EXPECTED}") from None
        try:
            prompts.append(OwnPrompt(ids, _expected(line)))
        except ValueError as exc:
            raise PromptFileError(f"{path}:{line_no}: {exc}") from None
    if not prompts:
        raise PromptFileError(f"{path}: no prompts (the file is empty)")
    return prompts


def _expected(line: dict) -> tuple[str, ...]:
    """The line's "expected" answers (beside a batch line's body or inside it); a number stands for
    its text. None said: ()."""
    body = line.get("body")
    value = line.get("expected", body.get("expected") if isinstance(body, dict) else None)
    if value is None:
        return ()

    def answer(a: object) -> bool:
        return (isinstance(a, str) and bool(a.strip())) or (isinstance(a, int | float) and not isinstance(a, bool))

    answers = value if isinstance(value, list) else [value]
    if not answers or not all(answer(a) for a in answers):
        raise ValueError('"expected" must be a non-empty string or number, or a non-empty list of them')
    return tuple(str(a) for a in answers)


def _normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().casefold()


_NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?!\w|\.\d)")


def _number(text: str) -> float | None:
    """The value of a number written with optional sign, thousands commas and decimals, or None."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _contains_answer(answer: str, expected: str) -> bool:
    """`expected` in `answer` with no letter or digit run on either side: a drifted "142" is not
    "42". A numeric expected answer matches any number of the same value ("1,000", "1000.0")."""
    value = _number(expected.strip()) if _NUMBER.fullmatch(expected.strip()) else None
    if value is not None:
        return any(_number(m.group()) == value for m in _NUMBER.finditer(answer))
    return re.search(rf"(?<!\w){re.escape(_normalized(expected))}(?!\w)", _normalized(answer)) is not None


def answer_items(prompts: Sequence[OwnPrompt], generations: Sequence[Sequence[int]],
                 decode: Callable[[Sequence[int]], str], end_ids: Sequence[int]) -> dict[int, ItemResult]:
    """One arm's right or wrong answer to each prompt that says what it expects (by prompt index):
    its generation up to the first end-of-sequence id, right when it holds an expected answer."""
    items = {}
    for index, (prompt, generation) in enumerate(zip(prompts, generations, strict=True)):
        if not prompt.expected:
            continue
        ends = [i for i, token in enumerate(generation) if token in end_ids]
        answer = decode(generation[:ends[0]] if ends else generation)
        right = any(_contains_answer(answer, expected) for expected in prompt.expected)
        items[index] = ItemResult(doc_id=index, prompt_hash=hashlib.sha256(str(prompt.token_ids).encode()).hexdigest(),
                                  correct=right, response=answer, hit_max_tokens=not ends)
    return items


def _prompt_ids(line: dict, tokenizer) -> list[int]:
    body = line["body"] if isinstance(line.get("body"), dict) else line
    if "messages" in body:
        return render_chat(tokenizer, ChatCompletionRequest.model_validate(body))
    if "prompt" not in body:
        raise ValueError(f"no \"messages\" or \"prompt\" among {sorted(body)}")
    prompt = body["prompt"]
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    vocab_size = len(tokenizer)
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt)):
        return prompt
    raise ValueError(f'"prompt" must be non-empty text or a list of token ids below {vocab_size}')
