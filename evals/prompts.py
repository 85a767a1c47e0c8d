"""Tier 2 prompts from the deployment's own traffic (`driftgate gate --prompts FILE`).

A checkpoint can keep its benchmark scores and still drift on the prompts it will actually
serve: a long system prompt, a tool schema, another language. The file holds request bodies
as clients send them, one JSON object a line, and each becomes the token ids the server would
build for it:

- a chat request (`{"messages": [...], "tools": ...}`), rendered by the model's chat template
  exactly as `/v1/chat/completions` renders it;
- a completion request (`{"prompt": "..."}`, or a list of token ids);
- an OpenAI batch line (`{"custom_id": ..., "body": {...}}`, as `run-batch` reads), by its body.

Every line is checked before either model loads, and a bad one is named by its line number.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from engine.json_object import numbered_lines, parse_json_object
from server.chat import render_chat
from server.errors import APIError, invalid_body
from server.protocol import ChatCompletionRequest

_EXPECTED = ('a chat request ("messages"), a completion request ("prompt": text or token ids) or a batch line '
             'with one of those as its "body"')


class PromptFileError(ValueError):
    """The prompt file cannot be used; the message names the file and, where it applies, the line."""


def read_prompt_file(path: Path, tokenizer) -> list[list[int]]:
    """Every line's prompt as token ids, in file order (blank lines skipped)."""
    path = Path(path)
    prompts = []
    for line_no, raw in numbered_lines(path, "prompt file", PromptFileError):
        try:
            prompts.append(_prompt_ids(parse_json_object(raw), tokenizer))
        except ValidationError as exc:
            raise PromptFileError(f"{path}:{line_no}: {invalid_body(exc).message}") from None
        except APIError as exc:  # the chat template refused the conversation
            raise PromptFileError(f"{path}:{line_no}: {exc.message}") from None
        except ValueError as exc:
            raise PromptFileError(f"{path}:{line_no}: {exc}; expected {_EXPECTED}") from None
    if not prompts:
        raise PromptFileError(f"{path}: no prompts (the file is empty)")
    return prompts


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
