"""`driftgate bench offline` end to end on the tiny model, HF transformers side by side."""

import json

from bench import offline
from bench.offline import kv_utilization
from engine.cli import main as driftgate_main


def test_kv_utilization_counts_padding_in_the_last_block():
    assert kv_utilization([16, 17], block_sizes=(16,)) == {16: 33 / 48}
    assert kv_utilization([8], block_sizes=(8, 32)) == {8: 1.0, 32: 0.25}


def test_bench_offline_writes_ratios_against_hf(tiny_model_dir, tmp_path):
    out = tmp_path / "offline.json"
    rc = driftgate_main(["bench", "offline", str(tiny_model_dir), "--runs", "2", "--num-requests", "4",
                         "--prompt-len", "16", "--output-len", "4", "--result-json", str(out),
                         "--plot", str(tmp_path / "offline.png")])
    assert rc == 0
    result = json.loads(out.read_text())
    assert len(result["batch1"]["ours_runs"]) == len(result["batch1"]["hf_runs"]) == 2
    assert result["batch1"]["ours"]["decode_tok_s"] > 0 and result["throughput"]["ours"]["output_tok_s"] > 0
    ratios = result["ratios"]
    assert ratios["batch1_decode_vs_hf"] == result["batch1"]["ours"]["decode_tok_s"] / result["batch1"]["hf"]["decode_tok_s"]
    assert set(result["kv_utilization"]) == {"8", "16", "32"}
    assert (tmp_path / "offline.png").stat().st_size > 0


def test_throughput_runs_start_with_a_cold_prefix_cache(tiny_model_dir):
    """The runs repeat the same prompts; a warm cache would skip their prefill and inflate the figure."""
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), seed=0, block_size=4)
    prompts = [[5 + i] + [6, 7, 8] * 10 for i in range(3)]  # distinct first tokens: nothing shared within a run
    offline.ours_throughput(llm, prompts, [4, 4, 4])
    hits = llm.stats().prefix_cache_hits
    offline.ours_throughput(llm, prompts, [4, 4, 4])
    assert llm.stats().prefix_cache_hits == hits
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # without the reset they would hit
    assert llm.stats().prefix_cache_hits > hits
