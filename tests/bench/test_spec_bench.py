"""`driftgate bench spec` end to end on the tiny model: every workload, both arms, same tokens."""

import json

from bench.datasets import find_data_dir
from bench.spec_decode import workload_messages
from engine.cli import main as driftgate_main


def test_bench_spec_compares_both_arms_on_every_workload(tiny_model_dir, tmp_path):
    out = tmp_path / "spec.json"
    rc = driftgate_main(["bench", "spec", str(tiny_model_dir), "--num-prompts", "2", "--max-tokens", "12",
                         "--runs", "1", "--concurrency", "1,2", "--result-json", str(out),
                         "--speculative-config", '{"num_speculative_tokens": 3, "prompt_lookup_min": 1}',
                         "--plot", str(tmp_path / "spec.png")])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [(r["workload"], r["concurrency"]) for r in result["rows"]] == \
           [(w, c) for w in ("rewrite", "gsm8k", "chat") for c in (1, 2)]
    for row in result["rows"]:  # an fp32 model's greedy outputs do not change with drafts
        assert row["identical_outputs"] and row["plain_tok_s"] > 0 and row["speedup"] == \
               row["spec_tok_s"] / row["plain_tok_s"]
    assert result["speculative_config"]["num_speculative_tokens"] == 3
    assert (tmp_path / "spec.png").stat().st_size > 0


def test_rewrite_prompts_carry_the_paragraph_to_copy(tiny_model_dir):
    from engine.tokenizer import load_tokenizer

    messages = workload_messages("rewrite", find_data_dir(None), load_tokenizer(tiny_model_dir), 3, 0)
    assert len(messages) == 3 and all(60 <= len(m.split("\n\n", 1)[1].split()) <= 200 for m in messages)
