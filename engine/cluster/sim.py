"""`driftgate cluster-sim`: compare routing policies on N simulated nodes, without N GPUs.

Every node runs the real `BlockManager` and `Scheduler`; the router is the real `Router` fed by
the nodes' real KV events. Only the model is replaced: sampled tokens are fabricated (random ids,
each request runs to its workload output length: its max_tokens, like `ignore_eos`, or with
`--max-tokens N` a stop before the budget N the router sees, like an end-of-sequence token) and
a step takes

    step_s = a + b · num_batched_tokens + c · num_decode_seqs

- a: fixed cost of a forward (weights read once per step, launch overhead);
- b: marginal cost of one more token in the batch (prefill GEMM throughput);
- c: marginal cost of one more decoding sequence (its KV read in attention).

Default constants (`CostModel`) are first-principles estimates for Llama-3-8B BF16 on one
H100-class GPU, NOT measured here: a = 6 ms (16 GB of weights at ~3 TB/s plus overhead),
b = 0.04 ms/token (~25k prefill tok/s), c = 0.06 ms/seq (~1.5k tokens × 128 KiB KV per token).
Calibrated constants: `driftgate bench steps MODEL --result-json F` times the real engine's
`LLMEngine.step` at several prefill lengths and decode batch sizes (medians of repeats), and
`--calibrate-from F` fits a, b, c to those medians by non-negative least squares in
relative error (`CostModel.fit`). Every result row records the constants it used and where
they came from.

`load` is the offered Poisson rate as a fraction of the peak request rate of `least-loaded` on
the same workload. The peak comes from a run with every request submitted at t = 0: output
tokens per second in its saturated window (from the first completion, when the synchronized
start is over, to the first moment some node has nothing left to queue, when the drain
begins), divided by the mean output length. Requests ÷ makespan would count the drain, when
nodes run half-empty batches, and put "load 0.9" near 0.75 of what the cluster sustains.

`--slo ttft:MS,tpot:MS` adds DistServe's goodput: the highest load at which `--slo-attainment`
(0.9) of requests meet every objective, found per policy by bisection over one arrival trace,
time-scaled. A finite trace lets a load a little over 1 pass (the backlog builds only towards
its end); more requests make it stationary.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, astuple, dataclass
from pathlib import Path

import numpy as np

from engine.block_manager import BlockManager
from engine.cluster.index import ReplicaState
from engine.cluster.router import Dispatch, Policy, Router, RouterConfig, RouteRequest
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Request
from engine.slo import meets_slo, parse_slo, time_per_output_token

WORKLOADS = ("published", "uniform", "shared-prefix")
VOCAB = 32000
GPU_ESTIMATE = ("first-principles Llama-3-8B BF16 / H100-class estimates, not measured; calibrate with "
                "`driftgate bench steps` on the target and `--calibrate-from`")


@dataclass(slots=True)
class CostModel:
    """Seconds per engine step from its shape (see the module docstring for the constants)."""

    a_ms: float = 6.0
    b_ms_per_token: float = 0.04
    c_ms_per_decode_seq: float = 0.06
    calibration: str = GPU_ESTIMATE  # where the constants came from, recorded in every result row

    def step_s(self, num_batched_tokens: int, num_decode_seqs: int) -> float:
        return (self.a_ms + self.b_ms_per_token * num_batched_tokens
                + self.c_ms_per_decode_seq * num_decode_seqs) / 1000.0

    @classmethod
    def fit(cls, steps: list[dict], source: str) -> CostModel:
        """Least squares of step_ms on (1, num_batched_tokens, num_decode_seqs), in relative error.

        Relative, because steps span 100× (a long prefill against a batch-1 decode) and the sim
        needs both right; absolute residuals would let the prefills alone decide a. A negative
        constant would make a bigger step cheaper, so the fit takes the best non-negative one:
        least squares on every subset of the three terms (the others held at 0), keeping the
        feasible solution with the smallest residual.
        """
        if len(steps) < 3:
            raise ValueError(f"{source}: a fit of a, b, c needs at least 3 measured steps, got {len(steps)}")
        y = np.array([float(s["step_ms"]) for s in steps])
        if (y <= 0).any():
            raise ValueError(f"{source}: step times must be positive")
        x = np.array([[1.0, s["num_batched_tokens"], s["num_decode_seqs"]] for s in steps]) / y[:, None]
        best, best_err = np.zeros(3), float(len(y))  # all zeros: every relative residual is −1
        for mask in range(1, 8):
            cols = [i for i in range(3) if mask >> i & 1]
            coef, *_ = np.linalg.lstsq(x[:, cols], np.ones(len(y)), rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[cols] = coef
            err = float(np.sum((x @ full - 1.0) ** 2))
            if err < best_err:
                best, best_err = full, err
        relative = np.abs(x @ best - 1.0)
        return cls(float(best[0]), float(best[1]), float(best[2]),
                   f"non-negative least squares in relative error over {len(y)} measured step medians from "
                   f"{source} (median relative error {100 * float(np.median(relative)):.1f}%, "
                   f"max {100 * float(relative.max()):.1f}%)")

    @classmethod
    def from_file(cls, path: Path) -> CostModel:
        """Fit to a `bench steps` result (its `steps` list; a bare list of steps works too)."""
        data = json.loads(Path(path).read_text())
        steps = data["steps"] if isinstance(data, dict) else data
        if not all({"num_batched_tokens", "num_decode_seqs", "step_ms"} <= s.keys() for s in steps):
            raise ValueError(f"{path}: every step needs num_batched_tokens, num_decode_seqs and step_ms")
        return cls.fit(steps, str(path))


@dataclass(slots=True)
class NodeConfig:
    """One simulated replica: KV capacity and scheduler limits (engine defaults elsewhere)."""

    num_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_tokens_with_decodes: int = 0  # as in SchedulerConfig: 0 is no cap
    # off: a preempted request recomputes its whole context, as engines without a prefix cache
    # do (vLLM's default before v1); on: it re-hits the blocks it left behind
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if min(self.num_blocks, self.block_size, self.max_num_seqs, self.max_num_batched_tokens) < 1:
            raise ValueError("node sizes must be positive")


@dataclass(frozen=True, slots=True)
class WorkItem:
    prompt_token_ids: list[int]
    num_output_tokens: int  # where its output stops (max_tokens, or an end-of-sequence token before it)
    max_tokens: int = 0  # the budget the client sends; 0: num_output_tokens (benchmarks' ignore_eos)

    @property
    def budget(self) -> int:
        return self.max_tokens or self.num_output_tokens


def with_max_tokens(items: list[WorkItem], max_tokens: int) -> list[WorkItem]:
    """Every request sends `max_tokens`; outputs shorter than it stop there as at an EOS token."""
    return [WorkItem(w.prompt_token_ids, min(w.num_output_tokens, max_tokens), max_tokens) for w in items]


def make_workload(name: str, num_requests: int, rng: random.Random) -> list[WorkItem]:
    """published: inputs 512–2048, outputs 128–512 · uniform: 512/256 · shared-prefix: see below.

    shared-prefix: 48 system prompts of 1536 tokens (about 56% of the default 4-node KV), each
    request one of them picked uniformly plus its own 256-token question, outputs 64–128.
    """
    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    if name == "published":
        return [WorkItem(tokens(rng.randint(512, 2048)), rng.randint(128, 512)) for _ in range(num_requests)]
    if name == "uniform":
        return [WorkItem(tokens(512), 256) for _ in range(num_requests)]
    if name == "shared-prefix":
        systems = [tokens(1536) for _ in range(48)]
        return [WorkItem(rng.choice(systems) + tokens(256), rng.randint(64, 128)) for _ in range(num_requests)]
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


class SimNode:
    """One replica: real block manager and scheduler, the model replaced by the cost model."""

    def __init__(self, node_id: int, config: NodeConfig):
        self.node_id = node_id
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                          record_events=True)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   max_model_len=1 << 20,
                                                   max_prefill_tokens_with_decodes=config.max_prefill_tokens_with_decodes),
                                   self.block_manager)
        self.step: SchedulerOutput | None = None  # the step in progress, None when idle
        self.last_event_seq = 0

    def start_step(self, cost: CostModel) -> float | None:
        """Schedule a step; returns its duration, or None when there is nothing to run."""
        out = self.scheduler.schedule()
        if out.is_empty and out.preempted:
            out = self.scheduler.schedule()  # everything running was preempted: readmit now
        if out.is_empty:
            return None
        self.step = out
        num_decode = sum(1 for c in out.chunks if c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens)
        return cost.step_s(out.num_batched_tokens, num_decode)

    def withdraw(self, request_ids: list[str]) -> list[Request]:
        """Take back waiting requests this node has never admitted; started ones stay."""
        wanted = set(request_ids)
        return [r for r in list(self.scheduler.waiting)
                if r.request_id in wanted and self.scheduler.withdraw([r])]


@dataclass(slots=True)
class RunResult:
    """Raw per-run measurements; `summarize` turns them into a result row."""

    ttft_s: list[float]
    e2el_s: list[float]  # per request, in ttft_s's order: arrival to its last token
    output_lens: list[int]  # per request, in ttft_s's order
    itl_s: list[float]  # every gap between two tokens of a request
    tpot_s: list[float]  # per request: its mean gap (vLLM's TPOT), for requests with 2+ tokens
    num_output_tokens: int
    makespan_s: float
    num_preemptions: int
    num_prefix_hit_tokens: int
    num_prefix_query_tokens: int
    num_migrated: int
    num_resyncs: int
    saturated_tok_s: float  # output rate while every node had work queued (see `simulate`)


def simulate(items: list[WorkItem], arrivals_s: list[float], policy: Policy, num_nodes: int,
             node_config: NodeConfig, cost: CostModel, seed: int = 0, drop_event_every: int = 0,
             unseen: Sequence[tuple[int, WorkItem]] = ()) -> RunResult:
    """Run one workload through one policy until every request finishes.

    `drop_event_every` > 0 loses every n-th KV event batch in transit, to exercise resync.
    `unseen` are (node, item) requests given straight to a node at t = 0, which the router
    learns of only through that node's reports (another router's traffic); they are not measured.
    """
    rng = random.Random(seed)
    nodes = [SimNode(i, node_config) for i in range(num_nodes)]
    router = Router(RouterConfig(policy=policy, block_size=node_config.block_size,
                                 prefix_caching=node_config.enable_prefix_caching),
                    [ReplicaState(i, node_config.num_blocks, node_config.max_num_seqs) for i in range(num_nodes)])
    requests: dict[str, Request] = {}
    route_requests: dict[str, RouteRequest] = {}
    token_times: dict[str, list[float]] = {}
    events: list[tuple[float, int, int]] = []  # (time, tiebreak, node id or −1 − arrival index)
    counter = 0
    num_batches = num_resyncs = 0
    backlog_end_s: float | None = None

    def push(t: float, what: int) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, what))

    def start(node: SimNode, now: float) -> None:
        if node.step is None:
            duration = node.start_step(cost)
            if duration is not None:
                push(now + duration, node.node_id)

    def apply(dispatches: list[Dispatch], now: float) -> None:
        for d in dispatches:
            nodes[d.replica_id].scheduler.add_request(requests[d.request_id])
        for node_id in {d.replica_id for d in dispatches}:
            start(nodes[node_id], now)

    for i, t in enumerate(arrivals_s):
        push(t, -1 - i)
    for k, (node_id, item) in enumerate(unseen):
        nodes[node_id].scheduler.add_request(Request(
            f"unseen-{k}", item.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=item.num_output_tokens)))
        start(nodes[node_id], 0.0)
    while events:
        now, _, what = heapq.heappop(events)
        if what < 0:
            item, rid = items[-1 - what], f"req-{-1 - what}"
            requests[rid] = Request(rid, item.prompt_token_ids,
                                    SamplingParams(temperature=0.0, max_tokens=item.num_output_tokens), now)
            route_requests[rid] = RouteRequest(rid, item.prompt_token_ids, item.budget)
            token_times[rid] = []
            apply(router.submit(route_requests[rid]), now)
            continue
        node = nodes[what]
        out, node.step = node.step, None
        sampled = {c.request.request_id: [rng.randrange(VOCAB)] for c in out.chunks if c.completes_sequence}
        finished = node.scheduler.update_from_output(out, sampled)
        replica = router.replicas[node.node_id]
        kv_events = node.block_manager.drain_events()
        if kv_events:
            node.last_event_seq = kv_events[-1].seq
            num_batches += 1
            lost = drop_event_every > 0 and num_batches % drop_event_every == 0
            if not lost and not replica.prefix.apply(kv_events):
                replica.prefix.resync(set(node.block_manager.cached), node.last_event_seq)
                num_resyncs += 1
        sched = node.scheduler
        replica.report(node.block_manager.num_free_blocks, len(sched.running), len(sched.waiting))
        for rid in sampled.keys() & token_times.keys():
            token_times[rid].append(now)
            router.on_progress(node.node_id, rid, len(token_times[rid]))
        dispatches = []
        for request in finished:
            dispatches += router.on_complete(node.node_id, request.request_id, finished=True)
        withdrawn = node.withdraw(router.migration_candidates(node.node_id))
        if withdrawn:
            dispatches += router.withdrawn(node.node_id, [route_requests[r.request_id] for r in withdrawn])
        apply(dispatches, now)
        start(node, now)
        if (backlog_end_s is None and len(requests) == len(arrivals_s) and not router.queue
                and any(not n.scheduler.waiting for n in nodes)):
            backlog_end_s = now  # from here on some node could take more work than is left

    unfinished = [rid for rid, r in requests.items() if not r.status.is_finished]
    if unfinished or router.queue:
        raise RuntimeError(f"simulation ended with {len(unfinished)} unfinished requests")
    ttft = [times[0] - requests[rid].arrival_time for rid, times in token_times.items()]
    e2el = [times[-1] - requests[rid].arrival_time for rid, times in token_times.items()]
    itl = [float(d) for times in token_times.values() for d in np.diff(times)]
    end = max(times[-1] for times in token_times.values())
    # the saturated window: from the first completion (the synchronized start is over) to the
    # end of the backlog (the drain begins); only meaningful when every request came at once
    num_output_tokens = sum(len(t) for t in token_times.values())
    window_start = min(times[-1] for times in token_times.values())
    window_end = backlog_end_s if backlog_end_s is not None else end
    if window_end > window_start:
        in_window = sum(1 for times in token_times.values() for t in times if window_start < t <= window_end)
        saturated = in_window / (window_end - window_start)
    else:  # too few requests to saturate past the start: fall back to the whole run
        saturated = num_output_tokens / (end - min(arrivals_s))
    output_lens = [len(times) for times in token_times.values()]
    tpot = [time_per_output_token(first, last, n) for first, last, n in zip(ttft, e2el, output_lens, strict=True) if n > 1]
    return RunResult(
        ttft_s=ttft, e2el_s=e2el, output_lens=output_lens, itl_s=itl, tpot_s=tpot, num_output_tokens=num_output_tokens,
        makespan_s=end - min(arrivals_s), num_preemptions=sum(n.scheduler.num_preemptions for n in nodes),
        num_prefix_hit_tokens=sum(n.scheduler.prefix_hits for n in nodes),
        num_prefix_query_tokens=sum(n.scheduler.prefix_queries for n in nodes),
        num_migrated=router.num_migrated, num_resyncs=num_resyncs, saturated_tok_s=saturated,
    )


def poisson_arrivals(num_requests: int, rate_per_s: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process; rate inf puts every request at t = 0."""
    if math.isinf(rate_per_s):
        return [0.0] * num_requests
    return list(np.cumsum([rng.expovariate(rate_per_s) for _ in range(num_requests)]))


def summarize(result: RunResult, num_nodes: int) -> dict:
    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) * 1000.0 if values else 0.0

    throughput = result.num_output_tokens / result.makespan_s
    itl_p50, itl_p99 = pct(result.itl_s, 50), pct(result.itl_s, 99)
    tpot_p50, tpot_p99 = pct(result.tpot_s, 50), pct(result.tpot_s, 99)
    return {
        "throughput_tok_s": throughput,  # output tokens / s, whole cluster
        "throughput_per_node_tok_s": throughput / num_nodes,
        "ttft_p50_ms": pct(result.ttft_s, 50), "ttft_p99_ms": pct(result.ttft_s, 99),
        "itl_p50_ms": itl_p50, "itl_p99_ms": itl_p99,
        "itl_p99_over_p50": itl_p99 / itl_p50 if itl_p50 else 0.0,
        "tpot_p50_ms": tpot_p50, "tpot_p99_ms": tpot_p99,
        "tpot_p99_over_p50": tpot_p99 / tpot_p50 if tpot_p50 else 0.0,
        "preemptions": result.num_preemptions,
        "prefix_hit_rate": (result.num_prefix_hit_tokens / result.num_prefix_query_tokens
                            if result.num_prefix_query_tokens else 0.0),
        "migrated": result.num_migrated,
        "kv_resyncs": result.num_resyncs,
    }


def slo_attainment(result: RunResult, slo: dict[str, float]) -> float:
    """Fraction of the run's requests within every objective."""
    met = sum(meets_slo(slo, ttft=ttft, e2el=e2el, output_len=n)
              for ttft, e2el, n in zip(result.ttft_s, result.e2el_s, result.output_lens, strict=True))
    return met / len(result.ttft_s)


@dataclass(slots=True)
class Goodput:
    """What `--slo` asks: the highest offered load a policy serves with enough requests in SLO."""

    slo: dict[str, float]  # seconds, as parse_slo gives them
    attainment: float = 0.9  # DistServe's goodput counts a rate as served when 90% of requests meet the SLO
    resolution: float = 0.01  # of load
    max_load: float = 4.0

    def highest_load(self, within: Callable[[float], float]) -> float:
        """Bisection on load; `within(load)` is the attainment of a run at that load (0 if even
        the lowest load tried misses). Every load replays one arrival trace, time-scaled, so
        attainment falls with load up to noise, and policies are compared on the same requests."""
        lo, hi = 0.0, 1.0
        while within(hi) >= self.attainment:
            lo, hi = hi, hi * 2
            if hi > self.max_load:
                return lo
        while hi - lo > self.resolution:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if within(mid) >= self.attainment else (lo, mid)
        return lo


def run_sweep(workload: str, num_nodes: int, loads: list[float], policies: list[Policy], num_requests: int,
              node_config: NodeConfig, cost: CostModel, seed: int = 0, max_tokens: int = 0,
              goodput: Goodput | None = None) -> list[dict]:
    """Peak of every policy (all requests at t = 0), then each policy at each load level, and with
    `goodput` each policy's highest load within the SLO."""
    items = make_workload(workload, num_requests, random.Random(seed))
    if max_tokens:
        items = with_max_tokens(items, max_tokens)
    burst = poisson_arrivals(num_requests, math.inf, random.Random(seed))
    peaks = {p: simulate(items, burst, p, num_nodes, node_config, cost, seed) for p in set(policies) | {Policy.LEAST_LOADED}}
    mean_output = sum(w.num_output_tokens for w in items) / len(items)
    peak_rate = peaks[Policy.LEAST_LOADED].saturated_tok_s / mean_output

    def run(policy: Policy, load: float) -> RunResult:
        arrivals = poisson_arrivals(num_requests, load * peak_rate, random.Random(seed + 1))
        return simulate(items, arrivals, policy, num_nodes, node_config, cost, seed)

    goodput_loads = {p: goodput.highest_load(lambda load, p=p: slo_attainment(run(p, load), goodput.slo))
                     for p in policies} if goodput else {}
    rows = []
    for load in loads:
        for policy in policies:
            result = run(policy, load)
            rows.append({
                "workload": workload, "nodes": num_nodes, "policy": policy.value, "load": load,
                "offered_req_s": load * peak_rate, "num_requests": num_requests, "max_tokens": max_tokens or None,
                **summarize(result, num_nodes),
                # this policy saturated (every request at t = 0): its sustained output rate and what it cost
                "peak_throughput_tok_s": peaks[policy].saturated_tok_s,
                "peak_whole_run_tok_s": peaks[policy].num_output_tokens / peaks[policy].makespan_s,  # drain included
                "peak_preemptions": peaks[policy].num_preemptions,
                "peak_prefix_hit_rate": summarize(peaks[policy], num_nodes)["prefix_hit_rate"],
                "peak_migrated": peaks[policy].num_migrated,
                **({"slo_ms": {k: v * 1000.0 for k, v in goodput.slo.items()},
                    "slo_attainment": slo_attainment(result, goodput.slo),
                    "goodput_target": goodput.attainment,
                    # the highest load (same trace, time-scaled) where goodput_target of requests meet the SLO
                    "goodput_load": goodput_loads[policy],
                    "goodput_req_s": goodput_loads[policy] * peak_rate,
                    "goodput_tok_s": goodput_loads[policy] * peak_rate * mean_output} if goodput else {}),
                "node": asdict(node_config), "cost_model": asdict(cost),
            })
    return rows


def plot_rows(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("throughput_tok_s", "output tok/s"), ("ttft_p99_ms", "TTFT p99 (ms)"),
              ("itl_p99_over_p50", "ITL p99 / p50 (per token)"), ("tpot_p99_over_p50", "TPOT p99 / p50 (per request)"),
              ("preemptions", "preemptions"), ("prefix_hit_rate", "prefix hit rate")]
    fig, axes = plt.subplots(2, len(panels) // 2, figsize=(4.2 * (len(panels) // 2), 7.0))
    for ax, (key, label) in zip(axes.flat, panels, strict=True):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            mine = [r for r in rows if r["policy"] == policy]
            ax.plot([r["load"] for r in mine], [r[key] for r in mine], marker="o", label=policy)
        ax.set_xlabel("load (fraction of least-loaded peak)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    first = rows[0]
    options = [f"max_tokens {first['max_tokens']}"] if first.get("max_tokens") else []
    options += [] if first["node"].get("enable_prefix_caching", True) else ["no prefix caching"]
    fig.suptitle(" · ".join([f"cluster-sim · {first['workload']} · {first['nodes']} nodes", *options,
                             f"a={first['cost_model']['a_ms']:.3g} ms, b={first['cost_model']['b_ms_per_token']:.3g} "
                             f"ms/tok, c={first['cost_model']['c_ms_per_decode_seq']:.3g} ms/seq"]))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_sim_args(parser: argparse.ArgumentParser) -> None:
    node, cost = NodeConfig(), CostModel()
    parser.add_argument("--workload", choices=WORKLOADS, default="published")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--load", default="0.3,0.6,0.9", help="comma-separated fractions of least-loaded's peak")
    parser.add_argument("--policies", default=",".join(p.value for p in Policy))
    parser.add_argument("--num-requests", type=int, default=None, help="default: 200 per node")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-blocks", type=int, default=node.num_blocks, help="KV blocks per node")
    parser.add_argument("--block-size", type=int, default=node.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=node.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=node.max_num_batched_tokens)
    parser.add_argument("--max-prefill-tokens-with-decodes", type=int, default=node.max_prefill_tokens_with_decodes,
                        help="cap on prompt-chunk tokens in a step that also decodes (0: none)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="max_tokens every request sends; outputs still stop at the workload's lengths, as at "
                             "an EOS token (default: each request's own output length, as with ignore_eos)")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="nodes without a prefix cache: preemption recomputes, shared prompts are prefilled each time")
    parser.add_argument("--step-a-ms", type=float, default=cost.a_ms, help="fixed ms per step")
    parser.add_argument("--step-b-ms", type=float, default=cost.b_ms_per_token, help="ms per batched token")
    parser.add_argument("--step-c-ms", type=float, default=cost.c_ms_per_decode_seq, help="ms per decoding sequence")
    parser.add_argument("--calibrate-from", type=Path, default=None,
                        help="fit a, b, c to the step times in this `bench steps` result (overrides --step-*)")
    parser.add_argument("--slo", default=None,
                        help="also find each policy's goodput: the highest load at which --slo-attainment of requests "
                             "meet every objective, e.g. ttft:500,tpot:50 (ms; ttft, tpot, e2el)")
    parser.add_argument("--slo-attainment", type=float, default=0.9, help="fraction of requests within --slo")
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)


def run_sim(args: argparse.Namespace) -> int:
    from bench.output import check_result_paths

    try:
        check_result_paths(args)
        loads = [float(x) for x in args.load.split(",")]
        policies = [Policy(p) for p in args.policies.split(",")]
        node = NodeConfig(args.num_blocks, args.block_size, args.max_num_seqs, args.max_num_batched_tokens,
                          args.max_prefill_tokens_with_decodes, args.enable_prefix_caching)
        if args.nodes < 1 or any(x <= 0 for x in loads):
            raise ValueError("--nodes and every --load must be positive")
        if args.max_tokens < 0:
            raise ValueError("--max-tokens must be positive (or 0: each request's output length)")
        if not 0 < args.slo_attainment <= 1:
            raise ValueError("--slo-attainment must be in (0, 1]")
        goodput = Goodput(parse_slo(args.slo), args.slo_attainment) if args.slo else None
        if args.calibrate_from is not None:
            cost = CostModel.from_file(args.calibrate_from)
        else:
            cost = CostModel(args.step_a_ms, args.step_b_ms, args.step_c_ms, calibration=(
                GPU_ESTIMATE if (args.step_a_ms, args.step_b_ms, args.step_c_ms) == astuple(CostModel())[:3]
                else "given on the command line (--step-a-ms/--step-b-ms/--step-c-ms)"))
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"cost model: a = {cost.a_ms:.3f} ms, b = {cost.b_ms_per_token:.4f} ms/token, "
          f"c = {cost.c_ms_per_decode_seq:.4f} ms/decode seq ({cost.calibration})")
    rows = run_sweep(args.workload, args.nodes, loads, policies, args.num_requests or 200 * args.nodes,
                     node, cost, args.seed, args.max_tokens, goodput)
    print(f"{'policy':<14}{'load':>6}{'tok/s':>10}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>9}{'p99':>8}"
          f"{'p99/p50':>8}{'TPOT p99/p50':>13}{'preempt':>8}{'hit':>6}{'migr':>6}")
    for r in rows:
        print(f"{r['policy']:<14}{r['load']:>6.2f}{r['throughput_tok_s']:>10.0f}{r['ttft_p50_ms']:>10.0f}"
              f"{r['ttft_p99_ms']:>9.0f}{r['itl_p50_ms']:>9.1f}{r['itl_p99_ms']:>8.1f}{r['itl_p99_over_p50']:>8.2f}"
              f"{r['tpot_p99_over_p50']:>13.2f}{r['preemptions']:>8}{r['prefix_hit_rate']:>6.2f}{r['migrated']:>6}")
    for policy in policies:
        r = next(r for r in rows if r["policy"] == policy.value)
        print(f"peak {policy.value}: {r['peak_throughput_tok_s']:.0f} tok/s saturated, "
              f"{r['peak_preemptions']} preemptions, prefix hit rate {r['peak_prefix_hit_rate']:.2f}, "
              f"{r['peak_migrated']} migrated")
    if goodput:
        by_policy = {r["policy"]: r for r in rows}
        baseline = max(r["goodput_load"] for p, r in by_policy.items() if p != Policy.COORDINATED.value) \
            if len(by_policy) > 1 else 0.0
        for policy, r in by_policy.items():
            ratio = f", {r['goodput_load'] / baseline:.2f}× the best other policy" \
                if policy == Policy.COORDINATED.value and baseline else ""
            print(f"goodput {policy}: load {r['goodput_load']:.2f} ({r['goodput_req_s']:.2f} req/s, "
                  f"{r['goodput_tok_s']:.0f} output tok/s) with {goodput.attainment:.0%} of requests within {args.slo}"
                  f"{ratio}")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(rows, indent=2))
    if args.plot:
        plot_rows(rows, args.plot)
    return 0
