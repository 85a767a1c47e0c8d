"""Drift metrics on fabricated per-item results and hand-made distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from evals import drift


def _mc_sample(doc_id, lls, gold, prompt="p", choices=("a", "bb")):
    pred = int(np.argmax(lls))
    return {
        "doc_id": doc_id,
        "filter": "none",
        "prompt_hash": f"h{doc_id}{prompt}",
        "arguments": [("ctx", f" {c}") for c in choices],
        "filtered_resps": [[ll, False] for ll in lls],
        "resps": [[[ll, False]] for ll in lls],
        "acc": float(pred == gold),
        "acc_norm": float(pred == gold),
    }


def test_items_from_mc_samples_keeps_scores_and_correctness():
    items = drift.items_from_samples([_mc_sample(0, [-1.0, -2.0], 0), _mc_sample(1, [-3.0, -2.0], 0)], "acc,none")
    assert items[0].correct and not items[1].correct
    assert items[1].answer == "1"
    assert items[0].choice_logprobs == (-1.0, -2.0)


def test_acc_norm_scores_divide_by_choice_character_length():
    """As lm-eval's acc_norm: the choice's length without the delimiter put before it ("a" vs " a"),
    scaled to the choices' mean length, so the baseline's confidence reads on a whole choice's scale."""
    sample = _mc_sample(0, [-2.0, -4.5], 1, choices=("a", "bbbbb"))
    items = drift.items_from_samples([sample], "acc_norm,none")
    assert items[0].choice_scores == pytest.approx((-2.0 / 1 * 3, -4.5 / 5 * 3))
    assert items[0].answer == "1"  # with the delimiter counted (-2/2 vs -4.5/6) it would have been 0


def test_the_baselines_confidence_on_acc_norm_items_reads_as_on_acc_ones():
    """Two 30-character choices, one 6 nats likelier: as sure under acc_norm as under acc (per
    character, 0.2 nats apart, the softmax margin was 0.1 and no item counted as confident)."""
    sample = _mc_sample(0, [-30.0, -36.0], 0, choices=("x" * 30, "y" * 30))
    margins = {metric: drift.top_margin(drift.items_from_samples([sample], metric)[0].choice_scores)
               for metric in ("acc,none", "acc_norm,none")}
    assert margins["acc_norm,none"] == pytest.approx(margins["acc,none"]) and margins["acc,none"] > 0.99


def test_generative_samples_mark_invalid_and_runaway():
    sample = {
        "doc_id": 3, "filter": "strict-match", "prompt_hash": "x", "arguments": [("Q: q\nA:", {})],
        "resps": [["no answer here"]], "filtered_resps": ["[invalid]"], "exact_match": 0.0,
    }
    other_filter = {**sample, "filter": "flexible-extract", "filtered_resps": ["7"], "exact_match": 1.0}
    items = drift.items_from_samples([sample, other_filter], "exact_match,strict-match", frozenset({"Q: q\nA:"}))
    assert items[3].is_invalid and items[3].hit_max_tokens and not items[3].correct
    flexible = drift.items_from_samples([sample, other_filter], "exact_match,flexible-extract")
    assert flexible[3].correct and not flexible[3].hit_max_tokens


def _items(correct, margins_high=None):
    out = {}
    for i, ok in enumerate(correct):
        high = margins_high is not None and margins_high[i]
        lls = (-0.01, -9.0) if high else (-0.69, -0.70)
        out[i] = drift.ItemResult(doc_id=i, prompt_hash=f"h{i}", correct=bool(ok), choice_scores=lls,
                                  choice_logprobs=lls, answer="0" if ok else "1")
    return out


def test_compare_items_counts_flips_by_direction_and_confidence():
    base = _items([1, 1, 1, 0, 0, 1], margins_high=[1, 0, 1, 0, 0, 1])
    cand = _items([1, 0, 0, 1, 0, 1])
    cmp = drift.compare_items("t", "acc,none", base, cand)
    assert cmp.table.num_right_to_wrong == 2 and cmp.table.num_wrong_to_right == 1
    assert cmp.num_confident_items == 3
    assert cmp.num_confident_flips == 1  # doc 2: confident and right -> wrong
    assert cmp.worst_flips[0].doc_id == 2  # highest baseline margin first
    lo, hi = cmp.delta_interval
    assert lo < cmp.table.delta < hi
    assert cmp.drop_upper_bound == pytest.approx(-lo)


def test_compare_items_refuses_mismatched_prompts():
    base = _items([1, 0])
    cand = dict(_items([1, 0]))
    cand[1] = drift.ItemResult(doc_id=1, prompt_hash="other", correct=False)
    with pytest.raises(drift.PromptMismatchError, match="prompt hashes differ"):
        drift.compare_items("t", "acc,none", base, cand)
    with pytest.raises(drift.PromptMismatchError, match="different items"):
        drift.compare_items("t", "acc,none", base, {0: base[0]})


def test_identical_arms_have_zero_delta_and_zero_choice_kl():
    base = _items([1, 0, 1, 1])
    cmp = drift.compare_items("t", "acc,none", base, base)
    assert cmp.table.num_flips == 0 and cmp.choice_kl_mean == 0.0 and cmp.answer_change_rate == 0.0


def test_pool_items_relabels_and_records_strata():
    pooled, strata = drift.pool_items({"b": _items([1, 0]), "a": _items([1])})
    assert sorted(pooled) == [0, 1, 2]
    assert [strata[i] for i in range(3)] == ["a", "b", "b"]


def test_top_margin_and_choice_kl():
    assert drift.top_margin([0.0, -math.inf]) == pytest.approx(1.0)
    assert drift.top_margin([math.log(0.6), math.log(0.4)]) == pytest.approx(0.2)
    p, q = [math.log(0.5), math.log(0.5)], [math.log(0.9), math.log(0.1)]
    assert drift.choice_kl(p, q) == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1))


def test_token_parity_matches_hand_computation():
    base = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]))
    cand = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]]))
    kl, top1, nll = drift.token_parity(base, cand, torch.tensor([1]))
    assert kl[0] == pytest.approx(0.7 * math.log(0.7 / 0.6) + 0.2 * math.log(0.2 / 0.3))
    assert list(top1) == [True, False]
    assert nll[0] == pytest.approx(math.log(0.2) - math.log(0.3))


def test_token_parity_in_row_chunks_equals_the_whole_at_once(monkeypatch):
    """Long sequences are compared a few rows at a time (memory); the numbers are the same."""
    torch.manual_seed(0)
    base, cand = torch.randn(37, 50), torch.randn(37, 50)
    following = torch.randint(0, 50, (36,))
    whole = drift.token_parity(base, cand, following)
    monkeypatch.setattr(drift, "PARITY_CHUNK_VALUES", 50 * 8)  # 8 rows a chunk: 5 chunks, the last short
    chunked = drift.token_parity(base, cand, following)
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(chunked[0]) == 37 and len(chunked[2]) == 36


def test_logit_parity_buckets_by_position_and_flags_length_growth():
    torch.manual_seed(0)
    vocab, length = 11, 300
    tokens = torch.randint(0, vocab, (length,)).tolist()
    logits = torch.randn(length, vocab)

    def baseline(ids):
        return [(logits[: len(ids)], None)]

    def candidate(ids):
        noise = torch.zeros(len(ids), vocab)
        noise[256:] = torch.randn(len(ids) - 256, vocab)  # drift only late in the sequence
        return [(logits[: len(ids)] + noise, None)]

    same = drift.logit_parity([tokens], baseline, baseline)
    assert same.overall.kl_mean == pytest.approx(0.0, abs=1e-12) and same.overall.top1_agreement == 1.0
    parity = drift.logit_parity([tokens], baseline, candidate)
    assert set(parity.by_position) == {"0-256", "256-1024"}
    assert parity.by_position["0-256"].num_tokens == 256
    assert parity.by_position["0-256"].kl_mean == pytest.approx(0.0, abs=1e-12)
    assert parity.by_position["256-1024"].kl_mean > 0.05
    assert drift.kl_growth(parity) == math.inf
    assert parity.intervals["kl_growth"] == (math.inf, math.inf)  # no resample of the first 256 sees drift


def test_logit_parity_intervals_bracket_the_checked_figures():
    """Each checked figure gets a block-bootstrap interval around it; more text narrows it."""
    torch.manual_seed(1)
    vocab = 13

    def parity_over(num_sequences):
        sequences = [torch.randint(0, vocab, (1100,)).tolist() for _ in range(num_sequences)]
        logits = {tuple(s): torch.randn(len(s), vocab) for s in sequences}
        noise = {key: torch.randn_like(value) * torch.linspace(0.2, 0.6, len(key))[:, None]
                 for key, value in logits.items()}  # drift that grows with position
        return drift.logit_parity(sequences, lambda ids: [(logits[tuple(ids)], None)],
                                  lambda ids: [(logits[tuple(ids)] + noise[tuple(ids)], None)])

    few, many = parity_over(2), parity_over(8)
    figures = {"kl_mean": many.overall.kl_mean, "kl_p99": many.overall.kl_p99,
               "top1_agreement": many.overall.top1_agreement, "kl_growth": drift.kl_growth(many)}
    assert set(many.intervals) == set(figures)
    for name, value in figures.items():
        low, high = many.intervals[name]
        assert low <= value <= high, name
        assert high - low < few.intervals[name][1] - few.intervals[name][0], name
    assert many.intervals["kl_growth"][0] > 1  # the growth is real at this sample size


def test_logit_parity_rejects_nan_rows():
    def broken(ids):
        return [(torch.full((len(ids), 4), float("nan")), None)]

    with pytest.raises(FloatingPointError):
        drift.logit_parity([[0, 1, 2]], broken, broken)



def test_logit_parity_pairs_arms_that_chunk_differently_and_closes_them_on_error():
    """Arms stream their rows in chunks of their own sizes: the parity equals the whole-at-once one;
    an arm scoring fewer positions is an error, and both streams are closed (KV blocks given back)."""
    torch.manual_seed(0)
    tokens = [i % 7 for i in range(10)]
    base, cand = torch.randn(10, 7), torch.randn(10, 7)

    def chunked(logits, sizes):
        def score(ids):
            start = 0
            for size in sizes:
                yield logits[start:start + size], None
                start += size
        return score

    whole = drift.logit_parity([tokens], chunked(base, [10]), chunked(cand, [10]))
    split = drift.logit_parity([tokens], chunked(base, [4, 4, 2]), chunked(cand, [3, 7]))
    assert split == whole

    closed = []

    def short(ids):
        try:
            yield base[:6], None
        finally:
            closed.append("candidate")

    def full(ids):
        try:
            yield base[:5], None
            yield base[5:], None
        finally:
            closed.append("baseline")

    with pytest.raises(ValueError, match="different numbers of positions"):
        drift.logit_parity([tokens], full, short)
    assert sorted(closed) == ["baseline", "candidate"]

def test_first_divergence_and_agreement_summary():
    assert drift.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert drift.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert drift.first_divergence([1, 2], [1, 2, 3]) == 2
    summary = drift.generation_agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 0, 6]])
    assert summary.num_identical == 1 and summary.divergence_positions == (1,)
    assert summary.mean_agreed_prefix == pytest.approx(2.0) and summary.min_agreed_prefix == 1
    assert summary.mean_agreed_prefix_interval == (1.0, 3.0)  # resampling two prompts: both 1s .. both 3s


def test_logit_parity_names_the_layer_that_adds_the_drift():
    """Layer states that agree until layer 2 and part there: layer 2 is named, drift per layer is exact."""
    torch.manual_seed(0)
    layers, length, hidden, vocab = 5, 7, 4, 6
    tokens = [i % vocab for i in range(length)]
    logits = torch.randn(length, vocab)
    states = torch.randn(layers, length, hidden)
    damaged = states.clone()
    damaged[2:] += 0.5 * states[2:]  # layer 2 and everything after it: |dh| / |h| = 0.5

    def baseline(ids):
        return [(logits, states)]

    def candidate(ids):
        return [(logits[:3] + 0.1, damaged[:, :3]), (logits[3:] + 0.1, damaged[:, 3:])]  # chunked differently

    parity = drift.logit_parity([tokens, tokens], baseline, candidate)
    assert parity.by_layer.relative_drift == pytest.approx((0.0, 0.0, 0.5, 0.5, 0.5), abs=1e-6)
    assert parity.by_layer.steps == pytest.approx((0.0, 0.0, 0.5, 0.0, 0.0), abs=1e-6)
    assert parity.by_layer.largest_step_layer == 2
    assert parity.overall.kl_mean == pytest.approx(0.0, abs=1e-12)  # a constant shift keeps the distribution
    assert drift.logit_parity([tokens], baseline, baseline).by_layer.largest_step_layer is None  # no drift anywhere
    logits_only = drift.logit_parity([tokens], lambda ids: [(logits, None)], candidate)
    assert logits_only.by_layer is None  # one arm without layer states: nothing to compare per layer


def test_accuracy_by_generation_length_pairs_items_in_equal_buckets():
    """A candidate right on short answers and wrong on long ones: the gap shows only in the long buckets."""
    from evals.drift import ItemResult, accuracy_by_generation_length

    baseline = {i: ItemResult(doc_id=i, prompt_hash="h", correct=True, response="x" * (10 * i + 1))
                for i in range(8)}
    candidate = {i: ItemResult(doc_id=i, prompt_hash="h", correct=i < 4, response="y") for i in range(8)}
    candidate[99] = ItemResult(doc_id=99, prompt_hash="h", correct=False)  # unpaired: ignored
    buckets = accuracy_by_generation_length(baseline, candidate, num_buckets=4)
    assert [(b.min_chars, b.max_chars, b.num_items) for b in buckets] == [(1, 11, 2), (21, 31, 2), (41, 51, 2),
                                                                           (61, 71, 2)]
    assert [b.baseline_accuracy for b in buckets] == [1.0] * 4
    assert [b.candidate_accuracy for b in buckets] == [1.0, 1.0, 0.0, 0.0]
    assert len(accuracy_by_generation_length(baseline, {0: candidate[0]})) == 1
    assert accuracy_by_generation_length({}, candidate) == []


def test_earliest_divergences_show_where_generations_part_as_text():
    def decode(ids):
        return " ".join(map(str, ids))

    prompts = [[1, 2, 3], [4, 5], [6], [7]]
    baseline = [[10, 11, 12, 13], [20, 21], [30, 31, 32], [40]]
    candidate = [[10, 11, 99, 98], [20, 21], [77], [40, 41]]  # part at 2; identical; at 0; a prefix, parts at 1
    found = drift.earliest_divergences(prompts, baseline, candidate, decode, limit=2, context=2, after=3)
    assert [(d.prompt_index, d.position) for d in found] == [(2, 0), (3, 1)]
    assert found[0] == drift.Divergence(2, 0, "6", "", "30 31 32", "77")
    (at_two,) = drift.earliest_divergences(prompts, baseline, candidate, decode, limit=3, context=2, after=3)[2:]
    assert (at_two.prompt_tail, at_two.agreed, at_two.baseline_next, at_two.candidate_next) == (
        "2 3", "10 11", "12 13", "99 98")
    assert drift.earliest_divergences(prompts, baseline, baseline, decode) == []
