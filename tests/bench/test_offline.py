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


def test_bench_offline_cycles_random_requests_through_several_adapters(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """--dataset random: every request --prompt-len tokens in, --output-len out, and the summary
    line says so; --lora A B: the requests alternate between the adapters (each one's requests
    counted at submit)."""
    import pytest

    pytest.importorskip("peft")
    from engine.llm_engine import LLMEngine
    from tests.helpers import write_lora_adapter

    adapters = [write_lora_adapter(tiny_model_dir, tmp_path / name, ["q_proj", "down_proj"], seed=i)
                for i, name in enumerate(("a", "b"))]
    asked = []
    add_request = LLMEngine.add_request
    monkeypatch.setattr(LLMEngine, "add_request", lambda self, request_id, prompt, params, priority=0, lora=None:
                        asked.append(lora) or add_request(self, request_id, prompt, params, priority, lora))
    out = tmp_path / "offline.json"
    assert driftgate_main(["bench", "offline", str(tiny_model_dir), "--runs", "1", "--num-requests", "4",
                           "--prompt-len", "12", "--output-len", "3", "--no-hf", "--dataset", "random",
                           "--lora", *map(str, adapters), "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["throughput"]["dataset"] == "random" and result["throughput"]["mean_output_len"] == 3
    assert "throughput (4 random requests)" in capsys.readouterr().out
    assert sum(result["matmul_kernels"].values()) >= 8 and isinstance(result["amx"], bool)  # provenance
    assert result["throughput"]["mean_prompt_len"] > 0  # re-measured: decode/encode need not round-trip
    assert result["lora"] == list(map(str, adapters))
    assert asked[-4:] == ["bench0", "bench1", "bench0", "bench1"]  # the throughput run's requests
