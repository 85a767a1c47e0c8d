"""Cluster simulator on tiny configs: real router + block managers + schedulers, seconds to run."""

from __future__ import annotations

import json
import math
import random

import pytest

from engine.cli import build_parser
from engine.cluster.router import Policy
from engine.cluster.sim import (
    GPU_ESTIMATE,
    CostModel,
    Goodput,
    NodeConfig,
    WorkItem,
    make_workload,
    poisson_arrivals,
    run_sim,
    simulate,
    slo_attainment,
    summarize,
    with_max_tokens,
)
from engine.slo import parse_slo

TINY = NodeConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256)


def shared_prefix_items(num: int, num_systems: int = 4, seed: int = 0) -> list[WorkItem]:
    """System prompts of 128 tokens (8 blocks each) + 32-token questions, 8 output tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(128)] for _ in range(num_systems)]
    return [WorkItem(rng.choice(systems) + [rng.randrange(1000) for _ in range(32)], 8) for _ in range(num)]


@pytest.mark.parametrize("policy", list(Policy))
def test_every_request_completes_with_every_policy(policy):
    items = shared_prefix_items(40)
    result = simulate(items, poisson_arrivals(40, 200.0, random.Random(0)), policy, 2, TINY, CostModel())
    assert result.num_output_tokens == 40 * 8
    assert len(result.ttft_s) == 40 and min(result.ttft_s) > 0
    assert len(result.itl_s) == 40 * 7


def test_coordinated_keeps_system_prompts_where_they_are_cached():
    # 16 prompts × 8 blocks: one node (64) cannot hold them all, and 8 slots a node force spills,
    # so single runs depend on the order; three workloads summed compare the policies
    burst = poisson_arrivals(90, math.inf, random.Random(0))
    hits, makespan = {}, {}
    for policy in (Policy.ROUND_ROBIN, Policy.COORDINATED):
        runs = [simulate(shared_prefix_items(90, num_systems=16, seed=s), burst, policy, 3, TINY, CostModel())
                for s in range(3)]
        hits[policy] = sum(r.num_prefix_hit_tokens for r in runs)
        makespan[policy] = sum(r.makespan_s for r in runs)
    assert hits[Policy.COORDINATED] > 1.5 * hits[Policy.ROUND_ROBIN]
    assert makespan[Policy.COORDINATED] < makespan[Policy.ROUND_ROBIN]


def test_a_burst_computes_each_system_prompt_once_under_coordinated():
    # sent at once, before any KV event: only pending blocks can keep each prompt's requests together
    items = shared_prefix_items(18, num_systems=3)
    burst = poisson_arrivals(18, math.inf, random.Random(0))
    rr, co = (simulate(items, burst, p, 3, TINY, CostModel()) for p in (Policy.ROUND_ROBIN, Policy.COORDINATED))
    assert co.num_prefix_hit_tokens == (18 - 3) * 128  # one cold prefill per system prompt
    assert rr.num_prefix_hit_tokens < co.num_prefix_hit_tokens and co.makespan_s < rr.makespan_s


def test_coordinated_admits_only_what_fits_so_nothing_is_preempted():
    rng = random.Random(1)
    items = [WorkItem([rng.randrange(1000) for _ in range(rng.randint(64, 256))], 64) for _ in range(30)]
    burst = poisson_arrivals(30, math.inf, rng)
    assert simulate(items, burst, Policy.LEAST_LOADED, 2, TINY, CostModel()).num_preemptions > 0
    assert simulate(items, burst, Policy.COORDINATED, 2, TINY, CostModel()).num_preemptions == 0


def test_without_prefix_caching_preemption_recomputes_and_coordinated_still_fits():
    rng = random.Random(1)
    items = [WorkItem([rng.randrange(1000) for _ in range(rng.randint(64, 256))], 64) for _ in range(30)]
    burst = poisson_arrivals(30, math.inf, rng)
    no_cache = NodeConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                          enable_prefix_caching=False)
    cached, recomputed = (simulate(items, burst, Policy.LEAST_LOADED, 2, node, CostModel()) for node in (TINY, no_cache))
    # the same preemptions cost more when resumed requests cannot re-hit the blocks they left
    assert cached.num_preemptions > 0 and recomputed.num_preemptions > 0
    assert recomputed.makespan_s > cached.makespan_s
    # shared system prompts are no longer shared, and the router must not count them as if they were
    shared = simulate(shared_prefix_items(40), poisson_arrivals(40, math.inf, random.Random(0)),
                      Policy.COORDINATED, 2, no_cache, CostModel())
    assert shared.num_preemptions == 0 and shared.num_prefix_hit_tokens == 0
    assert shared.num_output_tokens == 40 * 8


def test_generous_max_tokens_do_not_starve_coordinated():
    """Clients send max_tokens 512 but outputs stop at 8–32 tokens. Planned in full, a 64-block
    node takes one request at a time (about 6× least-loaded's makespan here); learned from
    finishes, coordinated runs full batches once its first eight requests have finished."""
    rng = random.Random(2)
    items = with_max_tokens([WorkItem([rng.randrange(1000) for _ in range(rng.randint(32, 96))],
                                      rng.randint(8, 32)) for _ in range(120)], 512)
    assert all(w.budget == 512 and w.num_output_tokens <= 32 for w in items)
    burst = poisson_arrivals(120, math.inf, rng)
    ll, co = (simulate(items, burst, p, 2, TINY, CostModel()) for p in (Policy.LEAST_LOADED, Policy.COORDINATED))
    assert co.num_output_tokens == ll.num_output_tokens == sum(w.num_output_tokens for w in items)
    assert co.makespan_s < 1.5 * ll.makespan_s and co.num_preemptions == 0


def test_migration_in_the_loop_loses_no_request():
    # node 0 is nearly full with work the router never saw, so what it sends there waits; the
    # router withdraws those unstarted requests and node 1 serves them
    rng = random.Random(3)
    unseen = [(0, WorkItem([rng.randrange(1000) for _ in range(400)], 64)) for _ in range(2)]
    items = shared_prefix_items(30, num_systems=3)
    result = simulate(items, poisson_arrivals(30, 400.0, random.Random(0)), Policy.COORDINATED, 2, TINY,
                      CostModel(), unseen=unseen)
    assert result.num_migrated > 0
    assert result.num_output_tokens == 30 * 8


def test_lost_kv_events_are_recovered_by_resync():
    items = shared_prefix_items(60)
    arrivals = poisson_arrivals(60, 100.0, random.Random(0))
    clean = simulate(items, arrivals, Policy.COORDINATED, 3, TINY, CostModel())
    lossy = simulate(items, arrivals, Policy.COORDINATED, 3, TINY, CostModel(), drop_event_every=5)
    assert clean.num_resyncs == 0 and lossy.num_resyncs > 0
    assert lossy.num_output_tokens == clean.num_output_tokens
    assert lossy.num_prefix_hit_tokens > 0.8 * clean.num_prefix_hit_tokens


def test_capping_prompt_chunks_beside_decodes_evens_out_token_gaps():
    """Long prompts arriving while others decode: with the cap, no gap carries a whole prompt."""
    rng = random.Random(0)
    items = [WorkItem([rng.randrange(1000) for _ in range(240)], 24) for _ in range(40)]
    arrivals = poisson_arrivals(40, 20.0, random.Random(1))
    capped = NodeConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=256,
                        max_prefill_tokens_with_decodes=32)
    rows = {}
    for name, node in (("uncapped", TINY), ("capped", capped)):
        result = simulate(items, arrivals, Policy.LEAST_LOADED, 2, node, CostModel())
        assert result.num_output_tokens == 40 * 24
        rows[name] = summarize(result, 2)
    assert rows["capped"]["itl_p99_ms"] < 0.5 * rows["uncapped"]["itl_p99_ms"]
    assert rows["capped"]["itl_p99_over_p50"] < rows["uncapped"]["itl_p99_over_p50"]


def test_workloads_have_the_documented_shapes():
    published = make_workload("published", 50, random.Random(0))
    assert all(512 <= len(w.prompt_token_ids) <= 2048 and 128 <= w.num_output_tokens <= 512 for w in published)
    assert {(len(w.prompt_token_ids), w.num_output_tokens) for w in make_workload("uniform", 5, random.Random(0))} \
        == {(512, 256)}
    shared = make_workload("shared-prefix", 100, random.Random(0))
    assert len({tuple(w.prompt_token_ids[:1536]) for w in shared}) <= 48
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("sharegpt", 1, random.Random(0))


def test_cli_writes_rows_with_the_required_fields(tmp_path):
    out, plot = tmp_path / "sim.json", tmp_path / "sim.png"
    args = build_parser("cluster-sim").parse_args([
        "cluster-sim", "--workload", "uniform", "--nodes", "2", "--num-requests", "12", "--load", "0.5,0.9",
        "--num-blocks", "128", "--max-tokens", "300", "--result-json", str(out), "--plot", str(plot)])
    assert args.enable_prefix_caching
    assert run_sim(args) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 3
    required = {"policy", "load", "throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                "preemptions", "prefix_hit_rate", "cost_model"}
    assert all(required <= row.keys() and row["throughput_tok_s"] > 0 for row in rows)
    assert "not measured" in rows[0]["cost_model"]["calibration"] and rows[0]["max_tokens"] == 300
    assert all(row["peak_throughput_tok_s"] > 0 and row["peak_preemptions"] >= 0 for row in rows)
    assert plot.stat().st_size > 0


def test_the_saturated_peak_leaves_out_the_drain():
    rng = random.Random(2)
    items = [WorkItem([rng.randrange(1000) for _ in range(rng.randint(32, 128))], rng.randint(8, 48))
             for _ in range(80)]
    result = simulate(items, poisson_arrivals(80, math.inf, rng), Policy.LEAST_LOADED, 2, TINY, CostModel())
    # the tail, where nodes run out of queued work and batches shrink, is slower than the middle
    assert result.saturated_tok_s > result.num_output_tokens / result.makespan_s


def synthetic_steps(a: float, b: float, c: float) -> list[dict]:
    shapes = [(p, 0) for p in (32, 64, 128, 256)] + [(n, n) for n in (1, 2, 4, 8, 16)]
    return [{"num_batched_tokens": t, "num_decode_seqs": d, "step_ms": a + b * t + c * d} for t, d in shapes]


def test_cost_model_fit_recovers_the_constants_and_stays_non_negative():
    fit = CostModel.fit(synthetic_steps(12.0, 0.5, 0.25), "synthetic")
    assert (fit.a_ms, fit.b_ms_per_token, fit.c_ms_per_decode_seq) == pytest.approx((12.0, 0.5, 0.25))
    assert "over 9 measured step medians from synthetic" in fit.calibration
    # decode steps cheaper per sequence than prefill tokens would need c < 0: held at 0 instead
    fit = CostModel.fit(synthetic_steps(12.0, 0.5, -0.2), "noisy")
    assert fit.c_ms_per_decode_seq == 0.0 and min(fit.a_ms, fit.b_ms_per_token) > 0
    with pytest.raises(ValueError, match="at least 3"):
        CostModel.fit(synthetic_steps(1, 1, 1)[:2], "short")


def test_cli_calibrates_from_a_steps_file(tmp_path, capsys):
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"model": "synthetic", "steps": synthetic_steps(20.0, 0.3, 0.1)}))
    out = tmp_path / "sim.json"
    args = build_parser("cluster-sim").parse_args([
        "cluster-sim", "--workload", "uniform", "--nodes", "2", "--num-requests", "8", "--load", "0.5",
        "--num-blocks", "128", "--policies", "least-loaded", "--calibrate-from", str(steps),
        "--result-json", str(out)])
    assert run_sim(args) == 0
    (row,) = json.loads(out.read_text())
    assert row["cost_model"]["a_ms"] == pytest.approx(20.0) and str(steps) in row["cost_model"]["calibration"]
    assert GPU_ESTIMATE not in row["cost_model"]["calibration"]
    steps.write_text(json.dumps([{"num_batched_tokens": 1}]))
    assert run_sim(args) == 2 and "step_ms" in capsys.readouterr().err


def test_goodput_search_finds_the_highest_load_within_the_slo():
    tried = []

    def attainment(load: float) -> float:
        tried.append(load)
        return 0.95 if load <= 1.37 else 0.5

    found = Goodput({"ttft": 1.0}, attainment=0.9, resolution=0.01).highest_load(attainment)
    assert 1.36 <= found <= 1.37 and len(tried) < 12
    assert Goodput({"ttft": 1.0}, attainment=0.96).highest_load(attainment) == 0.0  # never enough
    assert Goodput({"ttft": 1.0}, max_load=4.0).highest_load(lambda load: 1.0) == 4.0  # never short of it


def test_slo_attainment_counts_requests_within_every_objective():
    items = shared_prefix_items(30)
    result = simulate(items, poisson_arrivals(30, 400.0, random.Random(0)), Policy.LEAST_LOADED, 2, TINY,
                      CostModel())
    median_ttft = sorted(result.ttft_s)[15]
    by_ttft = sum(t <= median_ttft for t in result.ttft_s) / 30
    assert slo_attainment(result, {"ttft": median_ttft}) == pytest.approx(by_ttft) and 0 < by_ttft < 1
    assert slo_attainment(result, {"ttft": 60.0, "e2el": 60.0}) == 1.0
    # a request must meet all of them: adding a TPOT nobody meets leaves none
    assert slo_attainment(result, {"ttft": 60.0, "tpot": min(result.tpot_s) / 2}) == 0.0
    assert result.e2el_s == pytest.approx([t + (n - 1) * g for t, n, g in
                                           zip(result.ttft_s, result.output_lens, result.tpot_s, strict=True)])


def test_cli_reports_each_policys_goodput_load(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["cluster-sim", "--workload", "uniform", "--nodes", "2", "--num-requests", "24", "--load", "0.5",
            "--num-blocks", "128", "--slo", "ttft:2000,tpot:100", "--result-json", str(out)]
    assert run_sim(build_parser("cluster-sim").parse_args(argv)) == 0
    rows = json.loads(out.read_text())
    assert {r["policy"] for r in rows} == {p.value for p in Policy}
    for row in rows:
        assert row["slo_ms"] == {"ttft": 2000.0, "tpot": 100.0} and row["goodput_target"] == 0.9
        assert row["goodput_load"] > 0 and row["goodput_req_s"] == pytest.approx(
            row["goodput_load"] * row["offered_req_s"] / row["load"])
        assert 0 <= row["slo_attainment"] <= 1
    # the load it reports is one where 90% of requests were within the SLO
    items = make_workload("uniform", 24, random.Random(0))
    row = next(r for r in rows if r["policy"] == "coordinated")
    rate = row["goodput_req_s"]
    result = simulate(items, poisson_arrivals(24, rate, random.Random(1)), Policy.COORDINATED, 2,
                      NodeConfig(num_blocks=128), CostModel())
    assert slo_attainment(result, parse_slo("ttft:2000,tpot:100")) >= 0.9
    assert "goodput coordinated: load" in capsys.readouterr().out
    for bad in (["--slo", "latency:5"], ["--slo", "ttft:0"], ["--slo", "ttft:500", "--slo-attainment", "1.5"]):
        assert run_sim(build_parser("cluster-sim").parse_args(argv + bad)) == 2
    assert "SLO" in capsys.readouterr().err
