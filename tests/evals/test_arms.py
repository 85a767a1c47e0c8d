"""Running one arm: greedy generations that share a few-shot prefix compute it once."""

from __future__ import annotations

from engine import LLM, SamplingParams
from evals import arms

SHARED = [5, 9, 17, 33, 65, 129, 200, 7] * 6  # 48 tokens of "exemplars"


def test_greedy_generations_share_the_prefix_and_match_one_at_a_time(tiny_model_dir):
    prompts = [SHARED + [11 + i, 40 + i, 90 + i] for i in range(4)]
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=16)
    together = arms.greedy_generations(llm, prompts, max_new_tokens=8)
    assert llm.stats().prefix_cache_hits >= 4 * 48  # the primed prompt and the other three reuse the prefix
    alone = LLM(str(tiny_model_dir), dtype="float32", enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert together == [list(alone.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
