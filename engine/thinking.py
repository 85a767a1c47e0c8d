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


class BlockWalk:
    """One request's walk over its tokens: whether a block (`start` … `end`, a reasoning model's
    thinking) is open, and how many tokens it has had, folded in as tokens are committed, so a
    step looks only at what is new and a long prompt is scanned once. The last marker decides (a
    token that ends both closes); with neither in the prompt the block is open as
    `open_at_start` says; without a start marker, the first end closes it for good."""

    def __init__(self, start_ids: Sequence[int], end_ids: Sequence[int], prompt_token_ids: Sequence[int],
                 open_at_start: bool):
        self._start, self._end = tuple(start_ids), tuple(end_ids)
        self._width = max(len(self._start), len(self._end))
        backwards = list(prompt_token_ids)[::-1]
        closed = last_marker_end(backwards, self._end)
        opened = last_marker_end(backwards, self._start) if self._start else -1
        is_open = opened > closed if max(opened, closed) >= 0 else open_at_start
        self._state = (is_open, 0, self._tail(tuple(prompt_token_ids[-self._width:])))
        self._num_folded = 0  # output tokens in _state

    def _tail(self, window: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens a marker that ends at the next token could begin with."""
        return window[len(window) - self._width + 1:] if self._width > 1 else ()

    def _fold(self, state: tuple[bool, int, tuple[int, ...]], tokens: Sequence[int]) -> tuple[bool, int, tuple[int, ...]]:
        is_open, count, tail = state
        for token in tokens:
            window = tail + (token,)
            if window[-len(self._end):] == self._end:
                is_open, count = False, 0
            elif self._start and window[-len(self._start):] == self._start:
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
        """Whether the block is open after the committed output."""
        return self._state[0]


class ThinkingCounter(BlockWalk):
    """A thinking budget's walk: the block's state, and the end marker it forces once the block
    has had its budget."""

    def __init__(self, budget: ThinkingBudget, prompt_token_ids: Sequence[int]):
        super().__init__(budget.start_ids, budget.end_ids, prompt_token_ids, budget.open_at_start)
        self.budget = budget

    def forced_token(self, output_token_ids: Sequence[int]) -> int | None:
        """The only token allowed next for an output that extends the committed one, or None."""
        is_open, count, _ = self._fold(self._state, output_token_ids[self._num_folded:])
        over = count - self.budget.max_tokens
        return self.budget.end_ids[over] if is_open and 0 <= over < len(self.budget.end_ids) else None
