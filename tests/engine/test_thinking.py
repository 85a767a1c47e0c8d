"""Thinking budgets: the counter over token sequences, the sampler's forced end, and the engine's
outputs on a tiny model (with and without speculative decoding)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampler import SamplingRow, sample, verify
from engine.sampling_params import SamplingParams
from engine.thinking import BlockWalk, ThinkingBudget, ThinkingCounter

START, END = (7,), (8, 9)  # a one-token start marker and a two-token end marker


def forced_run(budget: ThinkingBudget, prompt: list[int], wanted: list[int]) -> list[int]:
    """Generate `wanted` token by token, except where the budget forces one; commit as the engine does."""
    counter, output = ThinkingCounter(budget, prompt), []
    for token in wanted:
        counter.commit(output)
        forced = counter.forced_token(output)
        output.append(token if forced is None else forced)
    return output


def test_a_block_opened_in_the_output_is_closed_after_its_budget():
    budget = ThinkingBudget(3, START, END)
    assert forced_run(budget, [1, 2], [5, 7, 1, 2, 3, 4, 4, 4, 4]) == [5, 7, 1, 2, 3, 8, 9, 4, 4]
    # closing on its own within the budget forces nothing; a second block gets its own budget
    assert forced_run(budget, [1], [7, 1, 8, 9, 7, 2, 2, 2, 2, 2, 2]) == [7, 1, 8, 9, 7, 2, 2, 2, 8, 9, 2]


def test_where_the_prompt_leaves_the_block():
    # opened by the template: thinking from the first output token
    assert forced_run(ThinkingBudget(2, START, END), [1, 7], [4, 4, 4, 4, 4]) == [4, 4, 8, 9, 4]
    # closed by the template (thinking turned off): nothing to cap
    assert forced_run(ThinkingBudget(0, START, END, open_at_start=True), [7, 8, 9], [4, 4]) == [4, 4]
    # no marker in the prompt: open only where the parser says the output starts thinking
    assert forced_run(ThinkingBudget(1, START, END, open_at_start=True), [1], [4, 4, 4, 4]) == [4, 8, 9, 4]
    assert forced_run(ThinkingBudget(1, START, END), [1], [4, 4, 4, 4]) == [4, 4, 4, 4]
    # budget 0: a block the model opens is closed at once
    assert forced_run(ThinkingBudget(0, START, END), [1], [7, 4, 4, 4]) == [7, 8, 9, 4]


def test_a_long_prompt_is_read_from_its_last_marker():
    prompt = [7, 1, 8, 9] * 5000 + [3] * 20000 + [7] + [3] * 10
    counter = ThinkingCounter(ThinkingBudget(1, START, END), prompt)
    assert counter.forced_token([5]) == 8 and counter.forced_token([]) is None
    with pytest.raises(ValueError, match="at least 0"):
        ThinkingBudget(-1, START, END)
    with pytest.raises(ValueError, match="marker"):
        ThinkingBudget(1, (), END)


def _row(params: SamplingParams, output: list[int], counter: ThinkingCounter) -> SamplingRow:
    counter.commit(output)
    return SamplingRow(params, [1], list(output), None, thinking=counter)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_takes_the_forced_token_whatever_the_logits(temperature):
    budget = ThinkingBudget(1, START, END, open_at_start=True)
    params = SamplingParams(temperature=temperature, max_tokens=8, thinking_budget=budget)
    logits = torch.zeros(2, 16)
    logits[:, 3] = 50.0  # the model's clear favourite
    free, capped = ThinkingCounter(budget, [1]), ThinkingCounter(budget, [1])
    tokens, _ = sample(logits, [_row(params, [], free), _row(params, [3], capped)], torch.Generator().manual_seed(0))
    assert tokens == [3, 8]
    # speculative decoding: drafts 3, 3 → the first is kept, the second is where the budget forces 8, then 9
    logits = torch.zeros(3, 16)
    logits[:, 3] = 50.0
    kept, _ = verify(logits, _row(params, [], ThinkingCounter(budget, [1])), [3, 3], torch.Generator().manual_seed(0))
    assert kept == [3, 8]
    params.check_vocabulary(16)
    with pytest.raises(ValueError, match="thinking_budget token id 99"):
        SamplingParams(thinking_budget=ThinkingBudget(1, (99,), END)).check_vocabulary(16)


@pytest.mark.parametrize("spec", [False, True])
def test_the_engine_forces_the_end_after_the_budget(tiny_model_dir, spec):
    """A tiny model 'thinking' from its first token (open_at_start): its output has the end marker
    exactly at the budget, and is otherwise what it generates without one."""
    from engine.llm import LLM

    kwargs = {"speculative_config": {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                     "disable_by_batch_size": 0}} if spec else {}
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, **kwargs)
    prompt = [5, 6, 7, 8] * 6
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    free_ids = free.outputs[0].token_ids
    end = tuple(t for t in (101, 102) if t not in free_ids[:12]) or (101, 102)
    budget = ThinkingBudget(5, (100,), end, open_at_start=True)
    capped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                   thinking_budget=budget))[0].outputs[0].token_ids
    assert capped[:5] == free_ids[:5] and tuple(capped[5:5 + len(end)]) == end


def _closed_by_rule(tokens: list[int], start: tuple[int, ...], end: tuple[int, ...]) -> bool:
    """The rule read off the whole sequence: the last end marker ends no earlier than the last
    start marker (a token that ends both closes)."""
    def last_end(marker: tuple[int, ...]) -> int:
        ends = [i + len(marker) for i in range(len(tokens) - len(marker) + 1) if tuple(tokens[i:i + len(marker)]) == marker]
        return max(ends, default=-1)
    ended = last_end(end)
    return ended >= 0 and (not start or last_end(start) <= ended)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=16),
       st.lists(st.integers(0, 3), max_size=3), st.lists(st.integers(0, 3), min_size=1, max_size=3),
       st.lists(st.integers(1, 4), max_size=6))
def test_a_block_walk_folds_output_as_the_whole_sequence_reads(prompt, output, start, end, chunks):
    """A grammar's wait (structured_outputs_after / _reopened_by) and a thinking budget's block are
    decided by the last marker; the walk folds in the output a few tokens at a time and agrees
    with a scan of everything at every point, markers straddling the prompt's end and each other
    included (no start marker: the first end closes the block for good)."""
    walk, committed = BlockWalk(start, end, prompt, open_at_start=True), 0
    assert walk.is_open() != _closed_by_rule(prompt, tuple(start), tuple(end))
    for size in [*chunks, len(output)]:
        committed = min(committed + size, len(output))
        walk.commit(output[:committed])
        assert walk.is_open() != _closed_by_rule(prompt + output[:committed], tuple(start), tuple(end))
