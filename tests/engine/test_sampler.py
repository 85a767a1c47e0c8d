"""Sampler: exact greedy, filters keep the right support, seeds reproduce, penalties follow OpenAI."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import SamplingRow, apply_penalties, sample
from engine.sampling_params import SamplingParams


def _row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), [1, 2], [3, 3], None)


def test_greedy_is_argmax():
    logits = torch.randn(5, 100)
    tokens, _ = sample(logits.clone(), [_row(temperature=0.0) for _ in range(5)])
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    for kw, allowed in [({"top_k": 2}, {0, 1}), ({"top_p": 0.7}, {0, 1}), ({"min_p": 0.35}, {0, 1}),
                        ({"top_p": 0.5}, {0})]:
        seen = {sample(logits.clone(), [_row(temperature=1.0, **kw)], g)[0][0] for _ in range(300)}
        assert seen == allowed, kw


def test_top_k_past_the_vocabulary_keeps_every_token():
    """A client's top_k may exceed the vocabulary, even int64 (2**64 crashed the step, failing every
    request in the batch): it filters nothing, beside a row with a real top_k."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(2, 1)
    g = torch.Generator().manual_seed(0)
    rows = [_row(temperature=1.0, top_k=2**64), _row(temperature=1.0, top_k=1)]
    draws = [sample(logits.clone(), rows, g)[0] for _ in range(300)]
    assert {d[0] for d in draws} == {0, 1, 2, 3} and {d[1] for d in draws} == {0}


def test_sampling_follows_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(probs.log().unsqueeze(0), [_row(temperature=1.0)], g)[0][0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_per_request_seed_reproduces():
    logits = torch.randn(1, 1000)
    def draw():
        row = SamplingRow(SamplingParams(temperature=1.0, seed=7), [], [], torch.Generator().manual_seed(7))
        return [sample(logits.clone(), [row])[0][0] for _ in range(5)]
    assert draw() == draw()


def test_penalties_follow_vllms_order():
    """Repetition first (prompt and output tokens), then frequency and presence (output only),
    as vLLM applies them: a seen token's logit 0.5 seen twice in the output with repetition 2,
    frequency 1, presence 0.5 ends at 0.5 / 2 − 2 − 0.5 = −2.25 (the other order gave −4.0)."""
    logits = torch.zeros(1, 6)
    logits[0, 4], logits[0, 5] = 2.0, 0.5
    row = SamplingRow(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
                      [4], [3, 3], None)
    out = apply_penalties(logits.clone(), [row])
    assert out[0, 3].item() == 0.0 * 2.0 - 2 * 0.25 - 0.5  # a zero logit is not scaled; then the OpenAI penalties
    assert out[0, 4].item() == 1.0  # positive logit of a prompt token divided by the repetition penalty
    assert out[0, 0].item() == 0.0
    row = SamplingRow(SamplingParams(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=2.0),
                      [], [5, 5], None)
    assert apply_penalties(logits.clone(), [row])[0, 5].item() == -2.25


def _support(logits: torch.Tensor, draws: int = 400, **kw) -> set[int]:
    g = torch.Generator().manual_seed(0)
    return {sample(logits.clone(), [_row(temperature=1.0, **kw)], g)[0][0] for _ in range(draws)}


def test_top_p_applies_to_what_top_k_and_min_p_left():
    """vLLM's order: min_p, then top_k, then top_p over the renormalized rest. With [.4, .3, .2, .1],
    top_k 2 leaves [.57, .43], whose top_p 0.5 keeps one token (over the whole row, two)."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert _support(logits, top_k=2, top_p=0.5) == {0}
    assert _support(logits, top_p=0.5) == {0, 1}
    # min_p 0.3 keeps [.4, .3, .2] (≥ 0.12), renormalized [.44, .33, .22]: top_p 0.7 keeps two of them
    assert _support(logits, min_p=0.3, top_p=0.7) == {0, 1}
    assert _support(logits, min_p=0.3) == {0, 1, 2}


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    assert _support(logits, top_k=2) == {0, 1, 2, 3}
    assert _support(logits, top_k=1) == {0}


def test_top_p_1_keeps_a_rows_whole_tail_beside_rows_that_filter():
    """A row asking for no filter draws from its whole distribution even when a batch-mate's
    top_p or top_k sends the batch through the filter: tokens of mass ~1e-9 stay possible."""
    logits = torch.full((2, 4000), -20.0)
    logits[:, 0] = 0.0
    from engine.sampler import _filter

    kept = _filter(logits, torch.tensor([0, 1]), torch.tensor([1.0, 0.9]), torch.tensor([0.0, 0.0]))
    assert torch.isfinite(kept[0]).all() and torch.isfinite(kept[1]).sum() == 1


def test_a_tiny_temperature_samples_at_vllms_floor_not_nan(caplog):
    """Below 0.01 the scaled logits overflowed (1e-38: softmax NaN, always token 0); vLLM raises
    such a temperature to 0.01 with a warning, and so does this."""
    import logging

    with caplog.at_level(logging.WARNING):
        params = SamplingParams(temperature=1e-38)
    assert params.temperature == 0.01 and "0.01" in caplog.text
    logits = torch.zeros(1, 10)
    logits[0, 7] = 1.0
    assert sample(logits.clone(), [SamplingRow(params, [1], [], None)])[0] == [7]


def test_seed_minus_1_is_no_seed_and_logprobs_minus_1_the_whole_vocabulary():
    assert SamplingParams(seed=-1).seed is None
    params = SamplingParams(logprobs=-1, prompt_logprobs=-1)
    params.check_logprobs(50, 50)
    assert params.logprob_counts(50) == {"logprobs": 50, "prompt_logprobs": 50} and params.logprobs == -1
    with pytest.raises(ValueError, match=r"logprobs must be at most 20 here .* got -1 \(the whole vocabulary, 50\)"):
        SamplingParams(logprobs=-1).check_logprobs(20, 50)
    with pytest.raises(ValueError, match=r"got 50$"):
        SamplingParams(logprobs=50).check_logprobs(20, 50)
    with pytest.raises(ValueError, match="logprobs must be at least 0, or -1"):
        SamplingParams(logprobs=-2)
    tokens, lps = sample(torch.randn(1, 50), [_row(temperature=0.0, logprobs=50)])
    assert len(lps[0]) == 50


def test_a_tied_tokens_rank_counts_the_tokens_at_least_as_likely():
    """vLLM's rank: how many tokens have a logprob ≥ the token's, so a token tied for first is 2;
    among the top-n asked for, a token's place there wins (vLLM's output processor keeps it)."""
    logits = torch.tensor([[3.0, 3.0, 1.0]])
    _, lps = sample(logits.clone(), [_row(temperature=0.0, logprobs=0)])
    assert lps[0][0].rank == 2
    _, lps = sample(logits.clone(), [_row(temperature=0.0, logprobs=2)])
    assert sorted(lp.rank for lp in lps[0].values()) == [1, 2]


def test_logprobs_are_raw_and_include_chosen():
    logits = torch.randn(1, 50)
    tokens, lps = sample(logits.clone(), [_row(temperature=0.0, logprobs=3)])
    ref = logits.log_softmax(-1)[0]
    assert set(ref.topk(3).indices.tolist()) <= set(lps[0])
    assert abs(lps[0][tokens[0]] - ref[tokens[0]].item()) < 1e-6


def test_cpu_argmax_is_torchs_first_maximum():
    from engine.sampler import _argmax

    logits = torch.randn(8, 1000)
    logits[3, [7, 500]] = 100.0  # a tie: the first index wins, as in torch
    assert torch.equal(_argmax(logits), logits.argmax(dim=-1)) and _argmax(logits)[3] == 7
    half = logits.to(torch.bfloat16)  # numpy has no bfloat16: torch's own argmax
    assert torch.equal(_argmax(half), half.argmax(dim=-1))


def test_allowed_token_ids_limit_greedy_and_sampled_choices():
    logits = torch.randn(2, 50)
    allowed = [3, 17, 41]
    g = torch.Generator().manual_seed(0)
    rows = [_row(temperature=0.0, allowed_token_ids=allowed), _row(temperature=1.0, allowed_token_ids=allowed)]
    seen = {t for _ in range(200) for t in sample(logits.clone(), rows, g)[0]}
    assert seen <= set(allowed) and len(seen) > 1
    assert sample(logits[:1].clone(), rows[:1])[0] == [allowed[int(logits[0, allowed].argmax())]]


def test_logit_bias_is_added_before_sampling():
    logits = torch.zeros(1, 10)
    logits[0, 2] = 5.0
    assert sample(logits.clone(), [_row(temperature=0.0, logit_bias={7: 6.0})])[0] == [7]
    assert sample(logits.clone(), [_row(temperature=0.0, logit_bias={2: -100.0})])[0] != [2]


def test_min_tokens_bans_stop_tokens_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, 9] = 50.0  # the stop token is by far the likeliest
    def pick(num_output: int) -> int:
        row = SamplingRow(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9]), [1], [4] * num_output, None)
        return sample(logits.clone(), [row])[0][0]
    assert [pick(n) for n in range(5)] == [0, 0, 0, 9, 9]


def test_bad_words_ban_the_token_that_would_complete_them():
    logits = torch.zeros(1, 10)
    logits[0, 5] = 10.0
    def pick(output: list[int], words: list[list[int]]) -> int:
        row = SamplingRow(SamplingParams(temperature=0.0), [1], output, None)
        row.params.bad_words_token_ids = words
        return sample(logits.clone(), [row])[0][0]
    assert pick([], [[5]]) != 5  # a one-token word is never sampled
    assert pick([2, 3], [[3, 5]]) != 5  # the output ends with the word's head
    assert pick([3, 2], [[3, 5]]) == 5  # it does not
    assert pick([], [[3, 5]]) == 5


def test_constraints_leave_unconstrained_rows_and_raw_logprobs_alone():
    logits = torch.randn(2, 30)
    rows = [_row(temperature=0.0, logprobs=1, logit_bias={0: 100.0}), _row(temperature=0.0)]
    tokens, lps = sample(logits.clone(), rows)
    assert tokens == [0, int(logits[1].argmax())]
    assert abs(lps[0][0] - logits.log_softmax(-1)[0, 0].item()) < 1e-6  # logprobs describe the model


def test_constraint_params_are_validated():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])
    with pytest.raises(ValueError, match="allowed_token_ids token id 99"):
        SamplingParams(allowed_token_ids=[1, 99]).check_vocabulary(50)
    with pytest.raises(ValueError, match="logit_bias token id -1"):
        SamplingParams(logit_bias={-1: 1.0}).check_vocabulary(50)
