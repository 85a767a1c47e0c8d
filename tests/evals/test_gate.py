"""Policy validation, decision rules on fabricated comparisons, and the verdict file."""

from __future__ import annotations

import json
import re

import pytest

from evals import drift, gate, stats, verdict
from evals.policy import PolicyError, load_policy, policy_from_dict

BASE_POLICY = {"tier1": {"tasks": [{"name": "t", "metric": "acc,none", "chance": 0.5}], "max_pooled_drop": 0.02}}


def test_shipped_policies_load():
    assert load_policy("quick").tier1.tasks[0].items == 200
    assert load_policy("default").tier1.max_pooled_drop == 0.015
    long = load_policy("long-context")  # Tier 0 reaches the 4096+ position bucket, within the engine's context
    assert long.tier0.max_tokens_per_sequence == long.engine.max_model_len == 8192
    assert long.tier1 == load_policy("quick").tier1
    assert load_policy("quick").interval_level == pytest.approx(0.9)  # ends: one-sided 95% bounds


@pytest.mark.parametrize(("raw", "named"), [
    ({**BASE_POLICY, "max_drop_typo": 1}, "policy.max_drop_typo"),
    ({**BASE_POLICY, "tier0": {"max_kl": 1}}, "tier0.max_kl"),
    ({"tier1": {"tasks": [{"name": "t", "metric": "acc,none", "itmes": 3}]}}, "tier1.tasks[0].itmes"),
])
def test_unknown_keys_are_named(raw, named):
    with pytest.raises(PolicyError, match=named.replace("[", r"\[").replace("]", r"\]")):
        policy_from_dict(raw)


def test_invalid_values_are_rejected():
    with pytest.raises(PolicyError, match="block_size"):
        policy_from_dict({**BASE_POLICY, "engine": {"block_size": 12}})
    with pytest.raises(PolicyError, match="inconclusive"):
        policy_from_dict({**BASE_POLICY, "inconclusive": "maybe"})
    with pytest.raises(PolicyError, match="max_drop"):
        policy_from_dict({"tier1": {"tasks": [{"name": "g", "metric": "exact_match,strict-match",
                                               "endpoint": "separate"}]}})


@pytest.mark.parametrize(("raw", "message"), [
    ({**BASE_POLICY, "tier2": {"enabled": "false"}}, "tier2.enabled must be a boolean, got 'false'"),
    ({**BASE_POLICY, "noise_floor": {"enabled": "no"}}, "noise_floor.enabled must be a boolean, got 'no'"),
    ({**BASE_POLICY, "tier0": {"max_kl_mean": "high"}}, "tier0.max_kl_mean must be a number, got 'high'"),
    ({**BASE_POLICY, "tier0": {"max_kl_p99": "1.0"}}, "tier0.max_kl_p99 must be a number"),
    ({**BASE_POLICY, "tier0": {"max_kl_growth": [2]}}, "tier0.max_kl_growth must be a number"),
    ({**BASE_POLICY, "tier0": {"num_documents": True}}, "tier0.num_documents must be an integer, got True"),
    ({**BASE_POLICY, "tier0": {"max_kl_mean": True}}, "tier0.max_kl_mean must be a number, got True"),
    ({**BASE_POLICY, "tier2": {"min_mean_agreed_prefix": "32"}}, "tier2.min_mean_agreed_prefix must be a number"),
    ({**BASE_POLICY, "tier2": {"num_prompts": 2.0}}, "tier2.num_prompts must be an integer, got 2.0"),
    ({**BASE_POLICY, "seed": "abc"}, "policy.seed must be an integer, got 'abc'"),
    ({**BASE_POLICY, "name": 3}, "policy.name must be a string, got 3"),
    ({**BASE_POLICY, "engine": {"max_num_seqs": "64"}}, "engine.max_num_seqs must be an integer, got '64'"),
    ({**BASE_POLICY, "engine": 64}, "engine must be a table, got 64"),
    ({"tier1": {"tasks": {"name": "t"}}}, "tier1.tasks must be an array"),
    ({"tier1": {"tasks": ["driftgate_arc_easy"]}}, "tier1.tasks[0] must be a table"),
    ({"tier1": {"tasks": [{"name": "t", "metric": "acc,none", "items": True}]}},
     "tier1.tasks[0].items must be an integer or a string, got True"),
    ({"tier1": {"tasks": [{"name": "t", "metric": "acc,none", "max_drop": "0.1"}]}},
     "tier1.tasks[0].max_drop must be a number, got '0.1'"),
])
def test_values_of_the_wrong_type_are_named(raw, message):
    """A string "false" is truthy and a string threshold crashes minutes in: the loader refuses both."""
    with pytest.raises(PolicyError, match=re.escape(message)):
        policy_from_dict(raw)


def test_declared_types_still_take_what_toml_writes():
    """Integers stand for floats; "all" and integers for a task's items; booleans for switches."""
    policy = policy_from_dict({"tier1": {"tasks": [{"name": "t", "metric": "acc,none", "items": 8, "max_drop": 0}],
                                         "max_pooled_drop": 0},
                               "tier0": {"enabled": False, "max_kl_growth": 4}, "tier2": {"min_mean_agreed_prefix": 1},
                               "engine": {"gpu_memory_utilization": 0.5}, "noise_floor": {"enabled": False}})
    assert (policy.tier0.enabled, policy.noise_floor.enabled, policy.tier0.max_kl_growth) == (False, False, 4)
    assert policy.tier1.tasks[0].items == 8 and policy_from_dict(BASE_POLICY).tier1.tasks[0].items == "all"


def test_a_policy_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "binary.toml"
    path.write_bytes(b"name = \"caf\xe9\"\n")  # Latin-1
    with pytest.raises(PolicyError, match=f"policy file {re.escape(str(path))} is not UTF-8 text"):
        load_policy(path)


def _arm(correct, margin_high=False):
    lls = (-0.01, -9.0) if margin_high else (-0.69, -0.70)
    return {i: drift.ItemResult(doc_id=i, prompt_hash=str(i), correct=bool(c), choice_scores=lls,
                                choice_logprobs=lls) for i, c in enumerate(correct)}


def _policy(**tier1):
    return policy_from_dict({"tier1": {**BASE_POLICY["tier1"], **tier1}, "tier0": {"enabled": False},
                             "tier2": {"enabled": False}})


def _statuses(checks):
    return {c.name: c.status for c in checks}


def test_identical_arms_pass_with_enough_items():
    policy = _policy()
    base = _arm([i % 3 != 0 for i in range(4000)])
    per_task, pooled = gate.compare_arms(policy, {"t": base}, {"t": base})
    checks = gate.decide(policy, per_task, pooled)
    assert gate.outcome(checks, comparisons=per_task, pooled=pooled).passed
    assert _statuses(checks)["tier1.pooled_drop"] == gate.PASS


def test_clear_drop_fails_on_the_point_estimate():
    policy = _policy()
    base = _arm([True] * 900 + [False] * 100)
    cand = _arm([False] * 100 + [True] * 800 + [False] * 100)  # 100 right->wrong: 10-point drop
    per_task, pooled = gate.compare_arms(policy, {"t": base}, {"t": cand})
    checks = gate.decide(policy, per_task, pooled)
    assert _statuses(checks)["tier1.pooled_drop"] == gate.FAIL
    assert not gate.outcome(checks, comparisons=per_task, pooled=pooled).passed


def test_small_sample_is_inconclusive_and_fails_closed_unless_policy_says_pass():
    base = _arm([True, False] * 10)
    strict = _policy()
    per_task, pooled = gate.compare_arms(strict, {"t": base}, {"t": base})
    checks = gate.decide(strict, per_task, pooled)
    assert _statuses(checks)["tier1.pooled_drop"] == gate.INCONCLUSIVE
    assert not gate.outcome(checks, comparisons=per_task, pooled=pooled).passed
    no_chance_check = {"tasks": [{"name": "t", "metric": "acc,none"}], "max_pooled_drop": 0.02}
    lenient = policy_from_dict({"inconclusive": "pass", "tier1": no_chance_check, "tier0": {"enabled": False}})
    checks = gate.decide(lenient, per_task, pooled)
    assert _statuses(checks)["tier1.pooled_drop"] == gate.WARN
    assert gate.outcome(checks, comparisons=per_task, pooled=pooled).passed


def test_an_undecided_endpoint_says_how_many_items_would_decide_it():
    """600 items, a 2-point drop, 10% flips against a 4-point margin: the bound straddles the
    margin, and the rule names the items that would settle it (stats.items_needed)."""
    base = [True] * 300 + [False] * 300
    cand = list(base)
    for i in range(36):  # 36 right -> wrong, 24 wrong -> right
        cand[i] = False
    for i in range(300, 324):
        cand[i] = True
    policy = _policy(max_pooled_drop=0.04)
    per_task, pooled = gate.compare_arms(policy, {"t": _arm(base)}, {"t": _arm(cand)})
    status, rule = gate.endpoint_status(pooled, 0.04, policy.confidence)
    needed = stats.items_needed(0.02, 0.10, margin=0.04)
    assert status == gate.INCONCLUSIVE and 1500 < needed < 1600
    assert f"about {needed} paired items, against 600 here" in rule
    # a candidate that scored better is planned as no drop: fewer items settle it
    few = [True] * 20 + [False] * 20
    better = [False] * 6 + [True] * 14 + [True] * 7 + [False] * 13  # 6 right -> wrong, 7 wrong -> right
    per_task, pooled = gate.compare_arms(policy, {"t": _arm(few)}, {"t": _arm(better)})
    status, rule = gate.endpoint_status(pooled, 0.04, policy.confidence)
    needed = stats.items_needed(0.0, 13 / 40, margin=0.04)
    assert status == gate.INCONCLUSIVE and f"about {needed} paired items, against 40 here" in rule
    assert "drop of 0.0000 (none, as this run's gain is not counted on)" in rule


def test_chance_level_scorer_is_a_hard_fail():
    policy = _policy(max_pooled_drop=1.0)
    coin = _arm([i % 2 == 0 for i in range(400)])  # exactly 50% on a 2-way task
    per_task, pooled = gate.compare_arms(policy, {"t": coin}, {"t": coin})
    statuses = _statuses(gate.decide(policy, per_task, pooled))
    assert statuses["hard.t.baseline_above_chance"] == gate.FAIL


def test_confident_flips_and_flip_excess_over_the_noise_floor():
    policy = _policy(max_pooled_drop=1.0, max_confident_flip_rate=0.01, max_flip_rate_above_floor=0.02)
    base = _arm([True] * 950 + [False] * 50, margin_high=True)
    flipped = [False] * 30 + [True] * 920 + [True] * 30 + [False] * 20  # 30 each way: zero net delta
    cand = _arm(flipped)
    per_task, pooled = gate.compare_arms(policy, {"t": base}, {"t": cand})
    noise_cmp, noise_pooled = gate.compare_arms(policy, {"t": base}, {"t": base})
    checks = {c.name: c for c in gate.decide(policy, per_task, pooled, noise_pooled=noise_pooled)}
    assert checks["tier1.confident_flips"].status == gate.FAIL  # 3% of items flipped despite a confident baseline
    assert checks["tier1.flip_rate_above_floor"].status == gate.FAIL  # 6% flips vs a 0% floor
    # Wilson intervals over the 1000 items at the policy's two-sided level; 60 flips is far from 2%
    assert checks["tier1.flip_rate_above_floor"].interval == pytest.approx(stats.wilson_interval(60, 1000, 0.9))
    assert checks["tier1.confident_flips"].interval == pytest.approx(stats.wilson_interval(30, 1000, 0.9))
    assert not checks["tier1.flip_rate_above_floor"].marginal


def test_tier0_and_tier2_rules():
    policy = policy_from_dict({**BASE_POLICY, "tier0": {"max_kl_mean": 0.01, "max_kl_growth": 2.0},
                               "tier2": {"min_mean_agreed_prefix": 10}})
    flat = drift.ParityStats(num_tokens=100, kl_mean=0.001, kl_p99=0.01, top1_agreement=0.99, nll_delta_mean=0.0)
    late = drift.ParityStats(num_tokens=100, kl_mean=0.05, kl_p99=0.5, top1_agreement=0.8, nll_delta_mean=0.1)
    parity = drift.LogitParity(overall=late, by_position={"0-256": flat, "256-1024": late})
    agreement = drift.generation_agreement([[1, 2, 3]], [[1, 9, 3]])
    per_task, pooled = gate.compare_arms(policy, {"t": _arm([1, 0])}, {"t": _arm([1, 0])})
    statuses = _statuses(gate.decide(policy, per_task, pooled, parity=parity, agreement=agreement))
    assert statuses["tier0.kl_mean"] == gate.FAIL and statuses["tier0.kl_growth"] == gate.FAIL
    assert statuses["tier2.mean_agreed_prefix"] == gate.FAIL
    skipped = _statuses(gate.decide(policy, per_task, pooled, parity_skip_reason="no scorer"))
    assert skipped["tier0"] == gate.SKIPPED


def test_verdict_round_trip_and_tamper_detection(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights-v1")
    with pytest.raises(verdict.VerdictError, match="no verdict.json"):
        verdict.check_verdict(tmp_path)
    verdict.write_verdict(tmp_path, passed=True, policy={"name": "p"}, metrics={}, baseline_hashes={"b": "x"})
    verdict.check_verdict(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"weights-v2")
    with pytest.raises(verdict.VerdictError, match="sha256 mismatch: model.safetensors"):
        verdict.check_verdict(tmp_path)
    verdict.write_verdict(tmp_path, passed=False, policy={}, metrics={}, baseline_hashes={})
    with pytest.raises(verdict.VerdictError, match="failing"):
        verdict.check_verdict(tmp_path)
    (tmp_path / "verdict.json").write_text("{not json")
    with pytest.raises(verdict.VerdictError, match="unreadable"):
        verdict.check_verdict(tmp_path)


def test_verdict_binds_the_activation_dtype_and_kv_cache_it_judged(tmp_path):
    """A checkpoint gated with one KV cache is refused for another (e5m2 for the calibrated fp8
    it passed with), and one gated with fp32 activations (a CPU's auto) for bf16 ones (a GPU's
    auto); fp8_e4m3 is fp8; a verdict written before the dtype was recorded was judged in fp32;
    a verdict from a live server's gate binds only the weights; older formats are refused."""
    from engine.config import serving_setting

    def setting(kv_cache_dtype: str, kv_scales: str = "checkpoint", dtype: str = "auto") -> dict:
        return serving_setting(str(tmp_path), dtype, "cpu", kv_cache_dtype, kv_scales)

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    fp8 = setting("fp8")
    assert fp8 == {"dtype": "float32", "kv_cache_dtype": "fp8", "kv_scales": "checkpoint"}
    verdict.write_verdict(tmp_path, passed=True, policy={}, metrics={}, baseline_hashes={}, serving=fp8)
    verdict.check_verdict(tmp_path, setting("fp8_e4m3"))
    verdict.check_verdict(tmp_path, setting("fp8", dtype="float32"))
    verdict.check_verdict(tmp_path)  # the weights alone
    for other, named in ((setting("fp8_e5m2"), "not float32 activations and KV cache fp8_e5m2"),
                         (setting("fp8", "dynamic"), "not float32 activations and KV cache fp8 (dynamic scales)"),
                         (setting("auto"), "KV cache auto"),
                         (setting("fp8", dtype="bfloat16"), "not bfloat16 activations and KV cache fp8 "
                                                            "(checkpoint scales); gate it so (driftgate gate ... "
                                                            "--dtype bfloat16 --kv-cache-dtype fp8)")):
        with pytest.raises(verdict.VerdictError, match=re.escape(named)):
            verdict.check_verdict(tmp_path, other)
    before_dtype = json.loads((tmp_path / "verdict.json").read_text())
    del before_dtype["serving"]["dtype"]
    (tmp_path / "verdict.json").write_text(json.dumps(before_dtype))
    verdict.check_verdict(tmp_path, fp8)
    with pytest.raises(verdict.VerdictError, match="not bfloat16 activations"):
        verdict.check_verdict(tmp_path, setting("fp8", dtype="bfloat16"))
    verdict.write_verdict(tmp_path, passed=True, policy={}, metrics={}, baseline_hashes={}, serving=None)
    verdict.check_verdict(tmp_path, setting("fp8_e5m2", dtype="float16"))
    old = json.loads((tmp_path / "verdict.json").read_text()) | {"format_version": 1}
    del old["serving"]
    (tmp_path / "verdict.json").write_text(json.dumps(old))
    with pytest.raises(verdict.VerdictError, match="predates"):
        verdict.check_verdict(tmp_path, setting("auto"))


def test_verdict_binds_config_tokenizer_chat_template_and_adapter_settings(tmp_path):
    """What decides the outputs besides the weights: an edited, added or removed file voids the
    verdict, naming it; a verdict from before this binding is refused."""
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text('{"rope_theta": 10000}')
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (tmp_path / "notes.txt").write_text("anything else in the folder is not bound")
    verdict.write_verdict(tmp_path, passed=True, policy={}, metrics={}, baseline_hashes={})
    assert set(json.loads((tmp_path / "verdict.json").read_text())["config_sha256"]) == {
        "config.json", "tokenizer_config.json"}
    (tmp_path / "notes.txt").write_text("edited")
    verdict.check_verdict(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages | reverse }}"}')
    with pytest.raises(verdict.VerdictError, match=re.escape("sha256 mismatch: tokenizer_config.json")):
        verdict.check_verdict(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    verdict.check_verdict(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")  # overrides tokenizer_config's
    with pytest.raises(verdict.VerdictError, match="configuration files changed.*chat_template.jinja"):
        verdict.check_verdict(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "config.json").unlink()
    with pytest.raises(verdict.VerdictError, match="configuration files changed"):
        verdict.check_verdict(tmp_path)
    (tmp_path / "config.json").write_text('{"rope_theta": 10000}')
    verdict.check_verdict(tmp_path)
    older = json.loads((tmp_path / "verdict.json").read_text()) | {"format_version": 2}
    del older["config_sha256"]
    (tmp_path / "verdict.json").write_text(json.dumps(older))
    with pytest.raises(verdict.VerdictError, match="predates verdicts that bind the config"):
        verdict.check_verdict(tmp_path)

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"lora")
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    base = verdict.weight_hashes(tmp_path)
    verdict.write_verdict(adapter, passed=True, policy={}, metrics={}, baseline_hashes={}, base_hashes=base)
    verdict.check_verdict(adapter, base_hashes=base)
    (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 32}')  # twice the adapter's weight
    with pytest.raises(verdict.VerdictError, match="adapter_config.json"):
        verdict.check_verdict(adapter, base_hashes=base)


def test_verdict_notices_added_weight_files(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"a")
    verdict.write_verdict(tmp_path, passed=True, policy={}, metrics={}, baseline_hashes={})
    (tmp_path / "b.safetensors").write_bytes(b"b")
    with pytest.raises(verdict.VerdictError, match="weight files changed"):
        verdict.check_verdict(tmp_path)
    body = json.loads((tmp_path / "verdict.json").read_text())
    assert set(body) >= {"verdict", "weights_sha256", "policy", "metrics", "baseline_weights_sha256"}


def test_failed_report_names_the_layer_where_drift_enters(tmp_path):
    """A Tier 0 failure with layer states: the verdict line and the Tier 0 section point at the layer."""
    from evals import report

    policy = policy_from_dict({**BASE_POLICY, "tier0": {"max_kl_mean": 0.01}, "tier2": {"enabled": False}})
    stats = drift.ParityStats(num_tokens=10, kl_mean=0.5, kl_p99=2.0, top1_agreement=0.5, nll_delta_mean=0.3)
    layers = drift.LayerDrift.from_drift([0.0, 0.0, 0.0, 0.4, 0.45])
    parity = drift.LogitParity(overall=stats, by_position={"0-256": stats}, by_layer=layers)
    per_task, pooled = gate.compare_arms(policy, {"t": _arm([1, 0])}, {"t": _arm([1, 0])})
    checks = gate.decide(policy, per_task, pooled, parity=parity)
    result = gate.outcome(checks, comparisons=per_task, pooled=pooled, parity=parity)
    full = report.build_report(result, {"baseline_scores": {}}, {})
    paths = report.write_reports(full, tmp_path)
    verdict_line = paths["md"].read_text().splitlines()[0]
    assert "FAIL" in verdict_line and "decoder layer 3 (model.layers.3)" in verdict_line
    assert json.loads(paths["json"].read_text())["tier0"]["by_layer"]["largest_step_layer"] == 3
    assert "Hidden-state drift by layer" in paths["html"].read_text()
    only_tier1 = [c for c in checks if not c.name.startswith("tier0.")] + [gate.Check("tier1.x", gate.FAIL, "x")]
    other = report.build_report(gate.outcome(only_tier1, comparisons=per_task, pooled=pooled, parity=parity),
                                {"baseline_scores": {}}, {})
    assert "decoder layer" not in report.render_markdown(other).splitlines()[0]  # Tier 0 did not fail: no blame


def test_report_shows_generative_accuracy_by_length(tmp_path):
    from evals import report

    policy = policy_from_dict({**BASE_POLICY, "tier2": {"enabled": False}})
    per_task, pooled = gate.compare_arms(policy, {"t": _arm([1, 0])}, {"t": _arm([1, 0])})
    buckets = [drift.LengthBucket(min_chars=12, max_chars=300, num_items=5, baseline_accuracy=0.6,
                                  candidate_accuracy=0.4)]
    result = gate.outcome(gate.decide(policy, per_task, pooled), comparisons=per_task, pooled=pooled,
                          length_accuracy={"gsm8k": buckets})
    full = report.build_report(result, {"baseline_scores": {}}, {})
    paths = report.write_reports(full, tmp_path)
    assert json.loads(paths["json"].read_text())["tier2_accuracy_by_length"]["gsm8k"][0]["num_items"] == 5
    assert "| 12–300 | 5 | 60.0 | 40.0 | -20.0 |" in paths["md"].read_text()


def test_a_threshold_inside_the_interval_marks_the_check_marginal_in_every_report(tmp_path):
    from xml.etree import ElementTree

    from evals import report

    assert gate.Check("a", gate.PASS, "d", 1.9, 2.0, (1.5, 2.4)).marginal
    assert not gate.Check("a", gate.PASS, "d", 1.6, 2.0, (1.5, 1.8)).marginal
    assert not gate.Check("a", gate.PASS, "d", 1.6, 2.0).marginal  # no interval, no claim

    policy = policy_from_dict({**BASE_POLICY, "tier0": {"max_kl_growth": 2.0}, "tier2": {"enabled": False}})
    early = drift.ParityStats(num_tokens=256, kl_mean=0.006, kl_p99=0.05, top1_agreement=0.95, nll_delta_mean=0.0)
    late = drift.ParityStats(num_tokens=512, kl_mean=0.013, kl_p99=0.095, top1_agreement=0.93, nll_delta_mean=0.0)
    parity = drift.LogitParity(overall=late, by_position={"0-256": early, "4096+": late},
                               intervals={"kl_mean": (0.01, 0.016), "kl_p99": (0.08, 0.11),
                                          "top1_agreement": (0.92, 0.94), "kl_growth": (1.5, 2.5)})
    steady = _arm([1, 0] * 200)  # no flips in 400 items: Tier 1's rate intervals stay under their limits
    per_task, pooled = gate.compare_arms(policy, {"t": steady}, {"t": steady})
    checks = gate.decide(policy, per_task, pooled, parity=parity)
    growth = next(c for c in checks if c.name == "tier0.kl_growth")
    assert growth.status == gate.PASS and growth.interval == (1.5, 2.5) and growth.marginal
    assert [c.name for c in checks if c.marginal] == ["tier0.kl_growth"]

    full = report.build_report(gate.outcome(checks, comparisons=per_task, pooled=pooled, parity=parity),
                               {"baseline_scores": {}}, {})
    paths = report.write_reports(full, tmp_path)
    saved = {c["name"]: c for c in json.loads(paths["json"].read_text())["checks"]}
    assert saved["tier0.kl_growth"]["marginal"] and saved["tier0.kl_growth"]["interval"] == [1.5, 2.5]
    assert not saved["tier0.kl_mean"]["marginal"]
    markdown = paths["md"].read_text()
    assert "| tier0.kl_growth | PASS (marginal) | 1.9 | [1.5, 2.5] | 2 |" in markdown
    assert "Marginal: tier0.kl_growth." in markdown and "| 90% interval |" in markdown
    case = ElementTree.parse(paths["junit"]).getroot().find("testcase[@name='tier0.kl_growth']")
    assert "marginal: interval [1.5, 2.5] holds the threshold" in case.find("system-out").text


def test_marginal_checks_reads_only_what_a_verdict_recorded(tmp_path):
    assert verdict.marginal_checks(tmp_path) == []  # no verdict: check_verdict is the one to complain
    (tmp_path / "model.safetensors").write_bytes(b"w")
    old = [{"name": "tier0.kl_mean", "status": "pass", "value": 0.01, "threshold": 0.05}]  # before intervals
    verdict.write_verdict(tmp_path, passed=True, policy={}, metrics={"checks": old}, baseline_hashes={})
    assert verdict.marginal_checks(tmp_path) == []
    (tmp_path / verdict.VERDICT_FILE).write_text("[1, 2]")
    assert verdict.marginal_checks(tmp_path) == [] and verdict.judged_context_len(tmp_path) is None


@pytest.mark.parametrize(("inconclusive", "status"), [("fail", gate.INCONCLUSIVE), ("pass", gate.WARN)])
def test_point_checks_by_interval_leave_a_marginal_check_undecided(inconclusive, status):
    """point_checks = "interval": a threshold inside a check's interval is no pass (nor fail), as
    Tier 1's endpoints are held to their bounds; the default lets the value decide."""
    raw = {**BASE_POLICY, "tier0": {"max_kl_growth": 2.0}, "tier2": {"enabled": False}, "inconclusive": inconclusive}
    early = drift.ParityStats(num_tokens=256, kl_mean=0.006, kl_p99=0.05, top1_agreement=0.95, nll_delta_mean=0.0)
    late = drift.ParityStats(num_tokens=512, kl_mean=0.013, kl_p99=0.095, top1_agreement=0.93, nll_delta_mean=0.0)
    parity = drift.LogitParity(overall=late, by_position={"0-256": early, "4096+": late},
                               intervals={"kl_growth": (1.5, 2.5), "kl_mean": (0.01, 0.016)})
    steady = _arm([1] * 300 + [0] * 100)  # well above chance: only the point checks can fail
    decided = {}
    for point_checks in ("value", "interval"):
        policy = policy_from_dict({**raw, "point_checks": point_checks})
        per_task, pooled = gate.compare_arms(policy, {"t": steady}, {"t": steady})
        decided[point_checks] = {c.name: c for c in gate.decide(policy, per_task, pooled, parity=parity)}
    assert decided["value"]["tier0.kl_growth"].status == gate.PASS
    growth = decided["interval"]["tier0.kl_growth"]
    assert growth.status == status and "point_checks = interval" in growth.detail and growth.marginal
    assert decided["interval"]["tier0.kl_mean"].status == gate.PASS  # its interval clears the threshold
    assert gate.outcome(list(decided["interval"].values()), comparisons={}, pooled=None).passed is (
        inconclusive == "pass")
    with pytest.raises(PolicyError, match="point_checks"):
        policy_from_dict({**raw, "point_checks": "bound"})


@pytest.mark.parametrize(("raw", "message"), [
    ({**BASE_POLICY, "seed": -1}, "seed must be in [0, 2**32)"),
    ({"tier1": {"tasks": [{"name": "t", "metric": "acc,none", "chance": 1.5}]}}, "chance (the accuracy of guessing)"),
    ({**BASE_POLICY, "tier2": {"max_new_tokens": 2048}}, "leaves no room for a prompt"),
    ({**BASE_POLICY, "noise_floor": {"max_num_batched_tokens": 0}}, "max_num_batched_tokens must be positive"),
    ({**BASE_POLICY, "tier2": {"max_new_tokens": 64, "min_mean_agreed_prefix": 100}}, "min_mean_agreed_prefix must be"),
    ({**BASE_POLICY, "tier0": {"max_kl_mean": float("nan")}}, "max_kl_mean must be a finite number >= 0"),
    ({**BASE_POLICY, "tier0": {"max_kl_p99": -1}}, "max_kl_p99 must be a finite number >= 0"),
    ({"tier1": {**BASE_POLICY["tier1"], "chance_sigma": -2}}, "chance_sigma must be a finite number >= 0"),
    ({**BASE_POLICY, "bootstrap_resamples": 10**9}, "bootstrap_resamples must be in [100, 100000]"),
])
def test_values_that_would_fail_after_the_arms_ran_are_refused_at_load(raw, message):
    with pytest.raises(PolicyError, match=re.escape(message)):
        policy_from_dict(raw)


def test_a_drop_exactly_at_the_margin_is_undecided_not_a_crash():
    """600 items, 24 net right->wrong flips: a 4-point drop against a 4-point margin (the quick
    policy's), where no number of items could bound the drop under the margin."""
    policy = _policy(max_pooled_drop=0.04)
    base = _arm([True] * 400 + [False] * 200)
    cand = _arm([False] * 100 + [True] * 300 + [True] * 76 + [False] * 124)  # 100 R->W, 76 W->R
    per_task, pooled = gate.compare_arms(policy, {"t": base}, {"t": cand})
    assert -pooled.table.delta == pytest.approx(0.04)
    status, rule = gate.endpoint_status(pooled, 0.04, policy.confidence)
    assert status == gate.INCONCLUSIVE and "is at the margin" in rule


def test_nan_scores_are_wrong_invalid_answers_and_nan_logits_fail_tier0():
    sample = {"doc_id": 0, "prompt_hash": "h", "filtered_resps": [(float("nan"), False), (float("nan"), False)],
              "acc": 1.0, "arguments": [("ctx", " a"), ("ctx", " b")]}  # lm-eval graded argmax(NaN) = 0 = gold
    (item,) = drift.items_from_samples([sample], "acc,none").values()
    assert not item.correct and item.is_invalid and item.answer == drift.INVALID_ANSWER
    import torch

    good = torch.log_softmax(torch.randn(5, 11), -1)
    broken = good.clone()
    broken[2, 3] = float("nan")
    with pytest.raises(drift.NonFiniteLogitsError, match="candidate gave NaN"):
        drift.logit_parity([list(range(5))], lambda t: [(good, None)], lambda t: [(broken, None)])
    policy = policy_from_dict({"tier1": BASE_POLICY["tier1"], "tier2": {"enabled": False}})
    base = _arm([True, False] * 50)
    per_task, pooled = gate.compare_arms(policy, {"t": base}, {"t": base})
    checks = gate.decide(policy, per_task, pooled, parity_failure="the candidate gave NaN or infinite logits")
    assert _statuses(checks)["tier0.finite_logits"] == gate.FAIL
    assert not gate.outcome(checks, comparisons=per_task, pooled=pooled).passed


def test_an_interval_of_no_width_leaves_nothing_marginal():
    assert not gate.Check("c", gate.PASS, "", 0.0, 0.0, (0.0, 0.0)).marginal
    assert gate.Check("c", gate.PASS, "", 0.0, 0.0, (-0.1, 0.1)).marginal


def test_the_verdict_binds_the_shard_index_that_picks_the_weight_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "alt.safetensors").write_bytes(b"other weights")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    verdict.write_verdict(tmp_path, passed=True, policy={}, metrics={}, baseline_hashes={})
    verdict.check_verdict(tmp_path)
    index.write_text(json.dumps({"weight_map": {"w": "alt.safetensors"}}))
    with pytest.raises(verdict.VerdictError, match="model.safetensors.index.json"):
        verdict.check_verdict(tmp_path)
