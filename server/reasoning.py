"""Reasoning models' thinking, split from the answer (vLLM's `--reasoning-parser`).

Models such as DeepSeek-R1 and Qwen3 think inside `<think> ... </think>` before answering.
With a parser the chat route returns the thinking as `reasoning_content` and only the rest as
`content` (where tool calls are looked for too). `deepseek_r1`: the chat template already opened
the block, so the output is thinking up to `</think>` (a leading `<think>` is dropped);
`qwen3`: only an output that opens with `<think>` thinks. A block that max_tokens cuts off is
all thinking. While streaming, text that may be the start of a tag waits until it is decided.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


def partial_tag_at_end(text: str, tag: str) -> int:
    """How many of text's last characters could begin `tag` (so must wait while streaming)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def split_reasoning(text: str, parser: str | None, final: bool) -> tuple[str | None, str]:
    """(thinking or None, answer) of an output so far; not `final`, each part is what may be sent.
    Without a parser all of it is answer."""
    if parser is None:
        return None, text
    opening = text.lstrip()
    if not final and THINK_START.startswith(opening) and opening != THINK_START:
        return None, ""  # "", "  " or "<thi": a tag or not, decided by the next characters
    if opening.startswith(THINK_START):
        body = opening[len(THINK_START):]
    elif parser == "deepseek_r1":
        body = text
    else:
        return None, text
    end = body.find(THINK_END)
    if end >= 0:
        return body[:end], body[end + len(THINK_END):]
    if final:
        return body, ""
    return body[:len(body) - partial_tag_at_end(body, THINK_END)], ""
