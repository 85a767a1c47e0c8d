"""Beam search: HF transformers' beam search as the oracle, and the bookkeeping on made-up steps."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers

from engine import LLM
from engine.beam_search import BeamSearch, BeamSearchParams

PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 3], list(range(100, 140))]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=96)


def _hf_beams(model, prompt: list[int], width: int, max_new_tokens: int) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search with EOS disabled: the width best sequences and their scores."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None  # no stopping
    config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
    config.num_beams = config.num_return_sequences = width
    config.max_new_tokens, config.pad_token_id, config.length_penalty = max_new_tokens, 0, 1.0
    config.output_scores, config.return_dict_in_generate = True, True
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()


@pytest.mark.parametrize("width", [2, 3])
def test_beams_equal_transformers_beam_search(llm, tiny_model_dir, width):
    """The same hypotheses in the same order with the same length-normalized scores; all
    prompts' beams share each step's batch."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        sequences, scores = _hf_beams(model, prompt, width, 10)
        # vLLM's shape: each sequence's tokens and text carry the prompt in front
        assert all(seq.tokens[:len(prompt)] == prompt for seq in out.sequences)
        assert [seq.tokens[len(prompt):] for seq in out.sequences] == sequences
        for seq, score in zip(out.sequences, scores, strict=True):
            generated = seq.tokens[len(prompt):]
            assert math.isclose(seq.cum_logprob / 10, score, abs_tol=1e-4)
            # each token's logprobs: its step's 2 × width candidates, it among them
            assert all(len(lp) == 2 * width and token in lp for token, lp in zip(generated, seq.logprobs, strict=True))
            assert math.isclose(sum(lp[t] for t, lp in zip(generated, seq.logprobs, strict=True)), seq.cum_logprob,
                                abs_tol=1e-4)
            assert seq.finish_reason == "length" and seq.text == llm.tokenizer.decode(seq.tokens)
    assert llm.stats().num_blocks_used == 0


def test_width_one_is_greedy_decoding(llm):
    from engine import SamplingParams

    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    assert [b.sequences[0].tokens for b in beams] == [g.prompt_token_ids + g.outputs[0].token_ids for g in greedy]


EOS = 2


def _search(width: int = 2, max_tokens: int = 5, **kw) -> BeamSearch:
    return BeamSearch([1, 1], BeamSearchParams(beam_width=width, max_tokens=max_tokens, **kw), [EOS], max_model_len=64)


def test_eos_among_the_best_finishes_a_hypothesis_and_the_beams_refill():
    search = _search()
    search.advance([{EOS: -0.1, 7: -0.5, 8: -0.7, 9: -3.0}])
    assert [b.tokens for b in search.hypotheses] == [[EOS]]
    assert [b.tokens for b in search.beams] == [[7], [8]]  # still two live beams
    search.advance([{EOS: -4.0, 5: -0.1}, {EOS: -4.0, 6: -0.2}])
    assert len(search.hypotheses) == 1  # EOS outside the best two extensions is dropped
    assert [b.tokens for b in search.beams] == [[7, 5], [8, 6]]
    assert search.best()[0].tokens == [EOS]  # -0.1 over 0 generated tokens (EOS not counted) beats -0.6 / 2


def test_vllms_shape_puts_the_prompt_in_front_and_leaves_the_eos_out(llm):
    search = _search()
    search.advance([{EOS: -0.1, 7: -0.5, 8: -0.7}])
    search.advance([{9: -0.1, EOS: -4.0}, {10: -0.2, EOS: -4.0}])
    best = search.vllm_output(llm.tokenizer).sequences
    assert [(s.tokens, s.finish_reason, s.stop_reason) for s in best] == [([1, 1], "stop", EOS),
                                                                          ([1, 1, 7, 9], "length", None)]
    assert len(best[0].logprobs) == 1 and EOS in best[0].logprobs[0]  # its step's alternatives stay
    assert best[1].text == llm.tokenizer.decode([1, 1, 7, 9]) and best[1].cum_logprob == pytest.approx(-0.6)


def test_ignore_eos_keeps_extending():
    search = _search(ignore_eos=True)
    search.advance([{EOS: -0.1, 7: -0.5}])
    assert not search.hypotheses and [b.tokens for b in search.beams] == [[EOS], [7]]


def test_length_penalty_ranks_the_final_hypotheses():
    short, long = _search(length_penalty=2.0), _search(length_penalty=0.0)
    for search in (short, long):
        search.advance([{7: -0.2, EOS: -0.25, 8: -0.3}])
        search.advance([{EOS: -5.0, 9: -0.6}, {EOS: -5.0, 10: -1.6}])
    # the hypothesis [EOS] has -0.25 over no generated token (EOS not counted, length taken as 1);
    # the beams [7, 9] -0.8 and [8, 10] -1.9 over 2 tokens
    assert long.best()[0].tokens == [EOS]  # penalty 0: the plain sum decides
    assert short.best()[0].tokens == [7, 9]  # -0.8 / 2² beats -0.25 / 1


def test_search_ends_at_max_tokens_the_context_or_when_no_beam_is_left():
    search = _search(max_tokens=2)
    for _ in range(2):
        assert not search.done
        search.advance([{7: -0.1, 8: -0.2}] * len(search.beams))
    assert search.done and all(len(b.tokens) == 2 for b in search.best())
    near_the_end = BeamSearch(list(range(62)), BeamSearchParams(beam_width=2, max_tokens=10), [EOS], max_model_len=64)
    assert near_the_end.max_steps == 2
    only_eos = _search(width=1)
    only_eos.advance([{EOS: -0.1}])
    assert only_eos.done and only_eos.best()[0].finished
    with pytest.raises(ValueError, match="expansions"):
        _search().advance([])
    for width in (0, 11):  # a step asks for 2 x width logprobs, at most 20
        with pytest.raises(ValueError, match="beam_width"):
            BeamSearchParams(beam_width=width, max_tokens=4)
