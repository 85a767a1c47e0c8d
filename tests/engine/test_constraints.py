"""Logit constraints through the whole engine: min_tokens, bad_words, allowed_token_ids, logit_bias."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)


def _greedy(llm, **kw) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **kw)
    return list(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_min_tokens_keeps_stop_tokens_out_of_the_first_tokens(llm):
    first = _greedy(llm)[0]
    assert _greedy(llm, stop_token_ids=[first])[:1] == [first]  # stops at once without min_tokens
    out = _greedy(llm, stop_token_ids=[first], min_tokens=3)
    assert first not in out[:3] and len(out) >= 3


def test_min_tokens_keeps_eos_out_even_with_ignore_eos(llm):
    """vLLM bans the model's EOS before min_tokens whether or not it ends the output: with
    ignore_eos a biased EOS comes only from the token after the first min_tokens, then repeats."""
    eos = llm.engine.eos_token_ids[0]
    assert _greedy(llm, logit_bias={eos: 100.0})[:1] == [eos]
    out = _greedy(llm, logit_bias={eos: 100.0}, min_tokens=3)
    assert eos not in out[:3] and out[3:] == [eos] * 3


def _one_token_word(llm) -> tuple[str, int]:
    encode = llm.engine.tokenizer.encode
    word = next(w for w in ("the", "a", "is", "of") if len(encode(w, add_special_tokens=False)) == 1)
    return word, encode(word, add_special_tokens=False)[0]


def test_min_tokens_defers_stop_strings(llm):
    """As stop tokens (and as vLLM's v1 engine), a stop string first ends the output on the token
    after the first min_tokens: min_tokens=3 keeps three words and stops at the fourth."""
    word, token = _one_token_word(llm)
    def run(**kw):
        params = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={token: 100.0}, stop=[word], **kw)
        return llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert run().text == ""
    out = run(min_tokens=3)
    assert (out.text, len(out.token_ids), out.finish_reason) == (word * 3, 4, "stop")


def test_bad_words_outweigh_any_bias(llm):
    word, token = _one_token_word(llm)
    forms = llm.engine._bad_words_token_ids([word])
    assert sorted(forms) == sorted(llm.engine.tokenizer.encode(f, add_special_tokens=False) for f in (word, " " + word))
    assert _greedy(llm, logit_bias={token: 100.0}) == [token] * 6
    assert token not in _greedy(llm, logit_bias={token: 100.0}, bad_words=[word])


def test_allowed_token_ids_and_logit_bias(llm):
    assert set(_greedy(llm, allowed_token_ids=[40, 41])) <= {40, 41}
    assert _greedy(llm, logit_bias={42: 100.0}) == [42] * 6


def test_token_ids_outside_the_vocabulary_are_refused_and_nothing_leaks(llm):
    with pytest.raises(ValueError, match="logit_bias token id 1000000"):
        llm.generate([[5, 6]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.stats().num_blocks_used == 0
