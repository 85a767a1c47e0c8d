"""A cap on a reasoning model's thinking (vLLM's `thinking_token_budget`, Anthropic's
`thinking.budget_tokens`).

A model that thinks without bound can spend all of max_tokens inside `<think> ... </think>` and
leave no answer. With a budget, once that many tokens have been generated inside a thinking
block, the block's end marker is the only token allowed, one token per step, and the model
answers after it. A block opens at its start marker, or, for models whose chat template opens it
(DeepSeek-R1), at the first output token unless the prompt already closed it; only output tokens
count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    """What a request asks: at most `max_tokens` inside a block delimited by these token ids."""

    max_tokens: int
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    open_at_start: bool = False  # the template opened the block: the output thinks from its first token

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"the thinking budget must be at least 0 tokens, got {self.max_tokens}")
        if not self.start_ids or not self.end_ids:
            raise ValueError("a thinking budget needs the block's start and end marker token ids")


def last_marker_end(backwards: list[int], marker: tuple[int, ...]) -> int:
    """The index just past the last occurrence of `marker` in the token list whose reverse is
    `backwards`, or -1 (its last id looked for by list.index, at C speed: a long prompt is
    scanned once)."""
    at = 0
    while True:
        try:
            at = backwards.index(marker[-1], at)
        except ValueError:
            return -1
        end = len(backwards) - at
        if end >= len(marker) and tuple(backwards[at:at + len(marker)][::-1]) == marker:
            return end
        at += 1


class BlockWatch:
    """Whether a block (`start` … `end`, a reasoning model's thinking) is closed after a request's
    tokens: its end marker seen after its last start marker; neither seen, it is not. Without a
    start marker the block closes at the first end marker for good. Committed tokens are folded
    in as they come, so a step looks only at what is new and a long prompt is scanned once."""

    def __init__(self, start_ids: Sequence[int] | None, end_ids: Sequence[int], prompt_token_ids: Sequence[int]):
        self._start, self._end = tuple(start_ids or ()), tuple(end_ids)
        backwards = list(prompt_token_ids)[::-1]
        ended = last_marker_end(backwards, self._end)
        self.closed = ended >= 0 and (not self._start or last_marker_end(backwards, self._start) < ended)
        self._keep = max(len(self._start), len(self._end)) - 1  # tokens a marker ending later may begin with
        self._tail = tuple(prompt_token_ids[len(prompt_token_ids) - self._keep:]) if self._keep else ()
        self._num_folded = 0

    def commit(self, output_token_ids: Sequence[int]) -> None:
        """Fold in the request's output up to now (its tokens are final)."""
        for token in output_token_ids[self._num_folded:]:
            window = self._tail + (token,)
            if self._start and window[-len(self._start):] == self._start:
                self.closed = False  # a marker ending here as both opens, as the last start decides
            elif window[-len(self._end):] == self._end:
                self.closed = True
            self._tail = window[len(window) - self._keep:] if self._keep else ()
        self._num_folded = len(output_token_ids)


class ThinkingCounter:
    """One request's walk over its output: whether a thinking block is open and how many tokens it
    has had, folded in as tokens are committed, so a step looks only at what is new."""

    def __init__(self, budget: ThinkingBudget, prompt_token_ids: Sequence[int]):
        self.budget = budget
        self._width = max(len(budget.start_ids), len(budget.end_ids))
        backwards = list(prompt_token_ids)[::-1]
        opened, closed = last_marker_end(backwards, budget.start_ids), last_marker_end(backwards, budget.end_ids)
        is_open = opened > closed if max(opened, closed) >= 0 else budget.open_at_start
        self._state = (is_open, 0, self._tail(tuple(prompt_token_ids[-self._width:])))
        self._num_folded = 0  # output tokens in _state

    def _tail(self, window: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens a marker that ends at the next token could begin with."""
        return window[len(window) - self._width + 1:] if self._width > 1 else ()

    def _fold(self, state: tuple[bool, int, tuple[int, ...]], tokens: Sequence[int]) -> tuple[bool, int, tuple[int, ...]]:
        is_open, count, tail = state
        start, end = self.budget.start_ids, self.budget.end_ids
        for token in tokens:
            window = tail + (token,)
            if window[-len(end):] == end:
                is_open, count = False, 0
            elif window[-len(start):] == start:
                is_open, count = True, 0
            elif is_open:
                count += 1
            tail = self._tail(window)
        return is_open, count, tail

    def commit(self, output_token_ids: Sequence[int]) -> None:
        """Fold in the request's output up to now (its tokens are final)."""
        self._state = self._fold(self._state, output_token_ids[self._num_folded:])
        self._num_folded = len(output_token_ids)

    def is_open(self) -> bool:
        """Whether a thinking block is open after the committed output."""
        return self._state[0]

    def forced_token(self, output_token_ids: Sequence[int]) -> int | None:
        """The only token allowed next for an output that extends the committed one, or None."""
        is_open, count, _ = self._fold(self._state, output_token_ids[self._num_folded:])
        over = count - self.budget.max_tokens
        return self.budget.end_ids[over] if is_open and 0 <= over < len(self.budget.end_ids) else None
