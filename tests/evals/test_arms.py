"""Running one arm (greedy generations that share a few-shot prefix compute it once) and the baseline cache key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from evals import arms, drift
from evals.lm_eval_model import DriftgateLM
from evals.policy import load_policy
from tests.helpers import ON_CUDA

SHARED = [5, 9, 17, 33, 65, 129, 200, 7] * 6  # 48 tokens of "exemplars"


def test_greedy_generations_share_the_prefix_and_match_one_at_a_time(tiny_model_dir):
    prompts = [SHARED + [11 + i, 40 + i, 90 + i] for i in range(4)]
    llm = LLM(str(tiny_model_dir), dtype="float32", block_size=16)
    together = arms.greedy_generations(llm, prompts, max_new_tokens=8)
    assert llm.stats().prefix_cache_hits >= 4 * 48  # the primed prompt and the other three reuse the prefix
    alone = LLM(str(tiny_model_dir), dtype="float32", enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert together == [list(alone.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]



@pytest.mark.parametrize("kwargs", [{}, ON_CUDA])
def test_tier0_compares_two_engines_chunk_by_chunk_where_they_run(tiny_model_dir, kwargs):
    """Tier 0 between engines that chunk a sequence differently (one through a bf16 KV cache) equals
    the parity of their whole score tensors, on the device they run on (a GPU's rows stay there)."""
    tokens = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    base = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=16, **kwargs)
    cand = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=40, kv_cache_dtype="bfloat16", **kwargs)
    parity = drift.logit_parity([tokens], arms.tier0_scorer(base), arms.tier0_scorer(cand))

    def whole(llm):
        return lambda ids: [(llm.score_full_logprobs(ids).cpu(), None)]

    expected = drift.logit_parity([tokens], whole(base), whole(cand))
    assert dataclasses.asdict(parity.overall) == pytest.approx(dataclasses.asdict(expected.overall))
    assert 0 < parity.overall.kl_mean < 1e-3 and parity.overall.top1_agreement > 0.9  # bf16 KV: small drift
    assert parity.by_layer is not None and len(parity.by_layer.relative_drift) == base.engine.model.args.num_layers
    assert base.stats().num_blocks_used == cand.stats().num_blocks_used == 0

def test_task_answers_agree_with_lm_evals_own_scoring(tiny_model_dir, data_dir):
    """The answer drift metrics use (argmax of choice scores) is the one lm-eval graded, acc_norm included."""
    from evals import data
    from evals.policy import policy_from_dict

    tasks = [{"name": "driftgate_arc_easy", "metric": "acc_norm,none", "items": 24},
             {"name": "driftgate_piqa", "metric": "acc_norm,none", "items": 24}]
    policy = policy_from_dict({"tier1": {"tasks": tasks}})
    llm = LLM(str(tiny_model_dir), dtype="float32")
    items, _ = arms.run_tasks(DriftgateLM(llm=llm), policy, data_dir, arms.selected_ids(policy, data_dir), "test")
    gold = {"driftgate_arc_easy": [d["gold"] for d in data.load_arc(data_dir, "easy")],
            "driftgate_piqa": [d["label"] for d in data.load_piqa(data_dir)]}
    for task, results in items.items():
        for doc_id, item in results.items():
            assert item.correct == (int(item.answer) == gold[task][doc_id]), (task, doc_id, item.choice_scores)


def test_the_baseline_cache_key_changes_with_the_code_and_libraries(tmp_path, monkeypatch):
    """A baseline computed by other kernels (edited, or another device's), another scorer or other
    libraries is recomputed, not reused: their last-bit differences move greedy divergence points,
    and fp8/int8 activation rounding amplifies them."""
    code = tmp_path / "engine"
    (code / "csrc").mkdir(parents=True)
    (code / "runner.py").write_text("STEP = 1\n")
    (code / "csrc" / "kernel.c").write_text("int kernel;\n")
    (code / "NOTES.md").write_text("not code\n")
    assert Path(arms.evals.__file__).resolve().parent in arms.ARM_SOURCES  # the gate's scoring code is keyed too
    monkeypatch.setattr(arms, "ARM_SOURCES", [code])
    machines = {"cpu": "CPU A, AVX2", "cuda": "GPU A"}
    monkeypatch.setattr(arms, "machine", lambda device: machines[device.split(":")[0]])
    policy = load_policy("quick")

    def key(prompts=((1, 2, 3),), device: str = "cpu") -> str:
        return arms.BaselineCache.key({"model.safetensors": "abc"}, policy, {}, {}, "baseline",
                                      [list(p) for p in prompts], device)

    before = key()
    assert key() == before
    assert key(((1, 2, 4),)) != before  # other Tier 2 prompts (gate --prompts): another baseline
    assert key(device="cuda:1") == key(device="cuda") != before  # GPU kernels and auto's dtype there
    (code / "NOTES.md").write_text("edited, still not code\n")
    assert key() == before
    (code / "csrc" / "kernel.c").write_text("int kernel = 1;\n")
    assert key() != before
    edited = key()
    machines["cpu"] = "CPU B, AVX512"  # another CPU: torch's and the C kernels' instructions differ
    assert key() != edited
    moved = key()
    monkeypatch.setattr(arms.transformers, "__version__", "0.0.1")  # another tokenizer or model library
    assert key() != moved


def test_a_damaged_or_partial_cache_entry_is_recomputed_and_stores_do_not_collide(tmp_path):
    import json
    import threading

    cache = arms.BaselineCache(tmp_path)
    item = drift.ItemResult(doc_id=0, prompt_hash="h", correct=True, choice_scores=(-1.0, -2.0),
                            choice_logprobs=(-1.0, -2.0), answer="0")
    arm = arms.ArmResults(items={"task": {0: item}}, scores={})
    cache.store("k", arm)
    assert cache.load("k", {"task": [0]}).items == arm.items
    assert cache.load("k", {"task": [0, 1]}) is None  # holds fewer items than asked for
    path = tmp_path / "k.json"
    for damaged in (b"\xff\xfe not text", json.dumps({"items": {"task": [{"doc_id": "x"}]}}).encode()):
        path.write_bytes(damaged)
        assert cache.load("k", {"task": [0]}) is None
    threads = [threading.Thread(target=cache.store, args=("k", arm)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert cache.load("k", {"task": [0]}).items == arm.items and not list(tmp_path.glob("*.tmp"))


def test_the_machine_names_the_cpu_and_the_instructions_its_kernels_use():
    import torch

    name = arms.machine("cpu")
    assert torch.backends.cpu.get_cpu_capability() in name and name == arms.machine("cpu")


def test_tier0_articles_shorter_than_the_policy_run_on_into_the_next(tiny_model_dir, data_dir):
    """Every WikiText sequence fills the policy's length, so a long-context policy measures every
    position bucket it asks for: a short article continues with the next ones, one stream."""
    from types import SimpleNamespace

    from engine.tokenizer import load_tokenizer
    from evals import data
    from evals.policy import policy_from_dict

    tokenizer = load_tokenizer(tiny_model_dir)
    pages = [doc["page"] for doc in data.load_wikitext(data_dir)]
    limit = 4096
    policy = policy_from_dict({"tier0": {"num_documents": len(pages), "max_tokens_per_sequence": limit},
                               "tier1": {"tasks": [{"name": "driftgate_piqa", "metric": "acc,none"}]}})

    llm = SimpleNamespace(tokenizer=tokenizer)  # tier0_sequences needs only the engine's tokenizer
    generation = [[5, 6, 7] * 2000]
    sequences = arms.tier0_sequences(llm, data_dir, policy, generation, [[1, 2]])
    assert len(sequences) == len(pages) + 1 and all(len(s) == limit for s in sequences)
    short = min(range(len(pages)), key=lambda i: len(tokenizer.encode(pages[i])))
    head = tokenizer.encode(pages[short])
    assert len(head) < limit and sequences[short][:len(head)] == head
    follow = tokenizer.encode("\n\n" + pages[short + 1], add_special_tokens=False)
    assert sequences[short][len(head):len(head) + len(follow)] == follow[:limit - len(head)]
    assert sequences[-1] == ([1, 2] + generation[0])[-limit:]  # the generation's tail, as before


def test_each_arm_takes_its_part_of_a_gpu(tiny_model_dir):
    """The candidate's, baseline's and noise floor's engines are alive at once on one device."""
    from evals.policy import policy_from_dict

    assert arms.gpu_share(load_policy("quick")) == pytest.approx(0.3)
    assert arms.build_engine(tiny_model_dir, load_policy("quick")).engine.config.gpu_memory_utilization \
        == pytest.approx(0.3)
    tasks = [{"name": "driftgate_piqa", "metric": "acc_norm,none", "items": 8}]
    no_noise_floor = policy_from_dict({"tier1": {"tasks": tasks}, "noise_floor": {"enabled": False}})
    assert arms.gpu_share(no_noise_floor) == pytest.approx(0.45)
    chosen = policy_from_dict({"tier1": {"tasks": tasks}, "engine": {"gpu_memory_utilization": 0.2}})
    assert arms.gpu_share(chosen) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        policy_from_dict({"tier1": {"tasks": tasks}, "engine": {"gpu_memory_utilization": 1.5}})
