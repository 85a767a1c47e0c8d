"""Speculative decoding by prompt lookup: same tokens as plain decoding, fewer forwards.

The oracle is the engine without drafts (itself checked against HF transformers): greedy and
seeded sampling must give identical tokens, logprobs the same values, with every sampling
feature that looks at earlier tokens (penalties, bans, stop strings, grammars).
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.sampler import SamplingRow, verify
from engine.spec_decode import SpeculativeConfig, propose_ngram, speculative_config_arg
from tests.helpers import make_requests, make_scheduler

# repetitive prompts, so lookups find matches; a tiny random model then often continues the pattern
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 11, 12, 11, 12, 11], [20, 21, 22, 23, 24, 25, 26]]
SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "disable_by_batch_size": 0}


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=96)


@pytest.fixture(scope="module")
def spec(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=96, speculative_config=SPEC)


def _outputs(llm, params):
    return [o.outputs for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _assert_same(plain, spec, params) -> None:
    for ours, theirs in zip(_outputs(spec, params), _outputs(plain, params), strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
                   (b.token_ids, b.text, b.finish_reason, b.stop_reason)
            if b.logprobs is not None:
                assert len(a.logprobs) == len(b.logprobs)
                for x, y in zip(a.logprobs, b.logprobs, strict=True):
                    assert x.keys() == y.keys()
                    assert all(math.isclose(x[t], y[t], abs_tol=1e-4) for t in x)
    assert spec.stats().num_blocks_used == 0 and not spec.engine.has_unfinished()


def _run_counting(plain, spec, params) -> tuple[int, int]:
    """_assert_same, returning (drafts verified, drafts accepted) on the way."""
    before = spec.stats()
    _assert_same(plain, spec, params)
    after = spec.stats()
    return (after.num_draft_tokens - before.num_draft_tokens,
            after.num_accepted_draft_tokens - before.num_accepted_draft_tokens)


def test_greedy_drafts_are_accepted_and_every_token_counted(plain, spec):
    before = spec.stats().num_generation_tokens
    drafted, accepted = _run_counting(plain, spec, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert 0 < accepted <= drafted
    assert spec.stats().num_generation_tokens - before == 3 * 40


@pytest.mark.parametrize("kw", [
    {"logprobs": 2},
    {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3},
    {"max_tokens": 1}, {"max_tokens": 2}, {"max_tokens": 5},
    {"min_tokens": 6, "stop_token_ids": [7, 12]},
    {"bad_words": ["a"]},
    {"logit_bias": {30: 2.0}, "allowed_token_ids": list(range(5, 40))},
], ids=lambda kw: ",".join(kw))
def test_greedy_tokens_match_plain_decoding(plain, spec, kw):
    kw = {"max_tokens": 24, **kw}
    _assert_same(plain, spec, SamplingParams(temperature=0.0, ignore_eos=True, **kw))


def test_seeded_sampling_draws_the_same_tokens(plain, spec):
    # one generator draw per output token with or without drafts, so seeded outputs agree
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=3, n=2, max_tokens=30, ignore_eos=True,
                            logprobs=2)
    drafted, accepted = _run_counting(plain, spec, params)
    assert 0 < accepted < drafted  # both outcomes of the verification ran


def _step_tokens(llm, prompt, params) -> list[list[int]]:
    """The tokens each step gave the one sequence of `prompt`."""
    steps, execute = [], llm.engine.runner.execute

    def recording(out):
        result = execute(out)
        steps.extend(list(t) for t in result.sampled.values())
        return result

    llm.engine.runner.execute = recording
    try:
        llm.generate([prompt], params, use_tqdm=False)
    finally:
        del llm.engine.runner.execute
    return steps


def test_stop_string_inside_accepted_drafts_cuts_the_output_there(plain, spec):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    steps = _step_tokens(spec, PROMPTS[0], greedy)
    decode = spec.engine.tokenizer.decode
    # a stop string that first completes at a token with more tokens after it in the same step
    tokens, stop = [], None
    for step in steps:
        for i, token in enumerate(step):
            tokens.append(token)
            text = decode(tokens)
            if stop is None and i < len(step) - 1:
                stop = next(text[-n:] for n in range(2, len(text) + 1) if text.find(text[-n:]) == len(text) - n)
    assert stop is not None, f"no step kept drafts here: {steps}"
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        _assert_same(plain, spec, params)
    out = spec.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text.endswith(stop) and len(out.token_ids) < 40


def test_eos_inside_accepted_drafts_ends_the_sequence(plain, spec):
    greedy = plain.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    stop_id = greedy[-5]  # a token the model emits late, probably inside a run of accepted drafts
    _assert_same(plain, spec, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_id]))


def test_structured_output_with_drafts(plain, spec):
    pytest.importorskip("xgrammar")
    from engine import StructuredOutputs

    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputs(regex="(ab|cd)+"))
    _assert_same(plain, spec, params)


@pytest.mark.parametrize("config", [
    {"num_kv_blocks": 12, "block_size": 8},  # sequences preempted and recomputed, drafts or not
    {"max_num_batched_tokens": 6},  # prompts in chunks; drafts cut to what the step has left
    {"enable_prefix_caching": False},
], ids=["preemption", "chunked-prefill", "no-prefix-cache"])
def test_drafts_under_memory_and_budget_pressure(tiny_model_dir, config):
    plain, spec = (LLM(str(tiny_model_dir), dtype="float32", max_model_len=96, speculative_config=spec_config,
                       **config) for spec_config in (None, SPEC))
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    _assert_same(plain, spec, greedy)
    _assert_same(plain, spec, greedy)  # again, over whatever the first run left in the prefix cache
    stats = spec.stats()
    assert stats.num_accepted_draft_tokens > 0
    if "num_kv_blocks" in config:
        assert stats.num_preemptions > 0


def test_big_batches_decode_without_drafts(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=96,
              speculative_config={**SPEC, "disable_by_batch_size": 2})
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert llm.stats().num_draft_tokens == 0  # three sequences ran, more than 2
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert llm.stats().num_draft_tokens > 0


@pytest.mark.parametrize("device,backend", [
    ("cpu", "torch"),
    pytest.param("cuda", "triton", marks=[pytest.mark.cuda,
                                          pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_other_attention_backends_agree(tiny_model_dir, device, backend):
    """Drafts as single-token queries of one sequence on each decode path (CUDA: graphs too)."""
    plain, spec = (LLM(str(tiny_model_dir), dtype="float32", max_model_len=96, device=device,
                       attention_backend=backend, speculative_config=config) for config in (None, SPEC))
    _assert_same(plain, spec, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert spec.stats().num_accepted_draft_tokens > 0


# ---- the parts on their own ---------------------------------------------------------------


def test_propose_ngram_takes_the_longest_suffix_at_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [4, 5]  # "3" last seen before 4, 5
    assert propose_ngram(tokens + [4], 3, 1, 3) == [5, 7, 3]  # "3 4" matched, longer than "4"
    assert propose_ngram([1, 2, 3, 1, 2], 5, 2, 2) == [3, 1, 2]  # stops at the end of the text
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([1, 2, 1, 3], 3, 2, 3) == []  # "1" alone is under prompt_lookup_min
    assert propose_ngram([1, 2, 1], 0, 1, 3) == []


def _lookup_oracle(tokens: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """propose_ngram's rule, spelled out: longest suffix first, every earlier occurrence of it."""
    if num_drafts < 1:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
        if starts:
            full = [i for i in starts if i + n + num_drafts <= len(tokens)]
            start = (full[-1] if full else starts[0]) + n
            return tokens[start:start + num_drafts]
    return []


def test_propose_ngram_matches_a_plain_search():
    import random

    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.randint(1, 5)) for _ in range(rng.randint(0, 30))]
        num_drafts, min_n = rng.randint(0, 5), rng.randint(1, 3)
        max_n = rng.randint(min_n, 6)
        assert propose_ngram(tokens, num_drafts, min_n, max_n) == _lookup_oracle(tokens, num_drafts, min_n, max_n)


def test_speculative_config_refuses_what_it_cannot_do():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}').num_speculative_tokens == 2
    for bad, match in [('{"method": "eagle"}', "not supported"), ('{"num_speculative_tokens": 0}', "at least 1"),
                       ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
                       ('{"model": "x"}', "unknown speculative config key"), ('{"num_speculative_tokens": "4"',
                                                                               "not valid JSON"),
                       ('{"num_speculative_tokens": "4"}', "must be an integer"), ("[4]", "JSON object")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.parse(bad)
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            speculative_config_arg(bad)


def test_draft_slots_are_allocated_but_never_cached():
    bm = BlockManager(num_blocks=8, block_size=4)
    (request,) = make_requests(1, 4)
    assert bm.allocate(request, 4)
    request.num_computed_tokens = 4
    request.append_token(9)
    assert bm.allocate(request, 1, num_lookahead_tokens=4)  # slots for 9 tokens: 3 blocks
    assert len(request.block_ids) == 3 and len(bm.cached) == 1  # only the block of known tokens


def test_scheduler_feeds_drafts_and_keeps_what_was_accepted():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=64)
    (request,) = make_requests(1, 6, max_tokens=10)
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, {request.request_id: [40]})
    request.spec_token_ids = [41, 42, 43]
    out = sched.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, list(chunk.draft_token_ids), chunk.is_decode) == (6, 4, [41, 42, 43], True)
    assert chunk.completes_sequence and request.spec_token_ids == []
    sched.update_from_output(out, {request.request_id: [41, 42, 50]})  # two kept, then the model's own
    assert request.output_token_ids == [40, 41, 42, 50] and request.num_computed_tokens == 9
    request.spec_token_ids = [51, 52]
    out = sched.schedule()
    request.params.stop_token_ids = [51]
    tokens = [51, 52, 53]
    sched.update_from_output(out, {request.request_id: tokens})
    assert request.output_token_ids[-1] == 51 and tokens == [51] and request.status.is_finished


def test_scheduler_trims_drafts_to_the_budget_and_drops_them_without_room():
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=3)
    (request,) = make_requests(1, 3, max_tokens=10)
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), {request.request_id: [40]})
    request.spec_token_ids = [1, 2, 3, 4]
    (chunk,) = sched.schedule().chunks
    assert list(chunk.draft_token_ids) == [1, 2]  # 1 + 2 tokens fill the budget of 3
    sched = make_scheduler(num_blocks=1, block_size=4, max_num_batched_tokens=16)
    (request,) = make_requests(1, 3, max_tokens=10)
    sched.add_request(request)
    sched.update_from_output(sched.schedule(), {request.request_id: [40]})
    request.spec_token_ids = [1, 2]
    (chunk,) = sched.schedule().chunks  # the block holds the decode, not the drafts
    assert (chunk.num_tokens, tuple(chunk.draft_token_ids)) == (1, ())
    # two sequences, one free block: it is kept for the second one's next token, not spent on drafts
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=16)
    first, second = make_requests(2, [3, 4], max_tokens=10)  # the second's next token needs a new block
    for request in (first, second):
        sched.add_request(request)
    sched.update_from_output(sched.schedule(), {first.request_id: [40], second.request_id: [41]})
    first.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert [c.num_tokens for c in out.chunks] == [1, 1] and not out.preempted


def test_verify_keeps_the_agreeing_prefix_then_the_models_token():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 7, 1]):
        logits[row, best] = 5.0
    logits[1, 3] = 6.0  # row 1 prefers 3, by less than a penalty of 2, then 4
    greedy = SamplingRow(SamplingParams(temperature=0.0), [0], [], None)
    assert verify(logits, greedy, [3, 3, 5]) == ([3, 3, 7], [None] * 3)
    assert verify(logits, greedy, [3, 3, 7]) == ([3, 3, 7, 1], [None] * 4)
    assert verify(logits, greedy, [9, 4, 7])[0] == [3]
    # row 1 sees draft 0 as an earlier token: its penalty turns row 1 away from repeating it
    penalized = SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=2.0), [0], [], None)
    assert verify(logits, penalized, [3, 3]) == ([3, 4], [None] * 2)
    with_logprobs = SamplingRow(SamplingParams(temperature=0.0, logprobs=0), [0], [], None)
    tokens, entries = verify(logits, with_logprobs, [3, 9])
    assert tokens == [3, 3] and [list(e) for e in entries] == [[3], [3]]


def test_batched_sequences_draft_about_as_many_tokens_as_they_keep(tiny_model_dir, monkeypatch):
    """A lone sequence always gets num_speculative_tokens drafts; in a batch, where each row costs
    compute, drafts that keep being rejected shrink to one per step."""
    import engine.llm_engine

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=96, speculative_config=SPEC)
    monkeypatch.setattr(engine.llm_engine, "propose_ngram", lambda tokens, n, lo, hi: [0] * n)
    lengths, execute = [], llm.engine.runner.execute

    def recording(out):
        lengths.append([len(c.draft_token_ids) for c in out.chunks])
        return execute(out)

    monkeypatch.setattr(llm.engine.runner, "execute", recording)
    never = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={0: -100.0})
    llm.generate(PROMPTS[:1], never, use_tqdm=False)
    # after the prompt step, every step drafts 3 (all rejected), then fewer as max_tokens nears
    assert lengths[1:] == [[3]] * 8 + [[2], [1], [0]]
    lengths.clear()
    llm.generate(PROMPTS[:2], never, use_tqdm=False)
    assert lengths[1:6] == [[3, 3], [2, 2], [1, 1], [1, 1], [1, 1]]
