"""`driftgate bench router`: how many routing decisions the coordinated router makes per second.

The router runs in the API process and decides every request of the cluster, so its cost per
decision bounds the cluster's request rate (the published workload at 64 GPU nodes asks about
370 requests/s, cluster-sim's estimate). This drives the real `Router` on fabricated replica
states, no engine: each replica holds `--in-flight` requests (prompts 512–2048 tokens, outputs
128–512, each part way through). A round reports one decode step's progress for every
in-flight request, then submits `--arrivals` new requests; each one dispatched replaces a
random request that finishes on its replica, so the load stays put. Decision time is the time
spent in `submit` and `on_complete` (their dispatching included) per arrival; progress time is
per progress report. A second, overloaded run keeps `--queued` requests waiting in the router
and times events (one request finishes, one arrives), each of which looks at the queue again.
Medians of `--runs` runs.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from bench.output import save_result
from bench.steps import positive_ints
from engine.cluster.index import ReplicaState
from engine.cluster.router import Policy, Router, RouterConfig, RouteRequest

BLOCK_SIZE = 16
VOCAB = 32000


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=positive_ints, default=[4, 16, 64])
    parser.add_argument("--in-flight", type=int, default=48, help="requests in flight per replica")
    parser.add_argument("--arrivals", type=int, default=8, help="new requests per round (per decode step)")
    parser.add_argument("--rounds", type=int, default=40, help="rounds (and events of the overload run)")
    parser.add_argument("--queued", type=int, default=200, help="requests waiting in the router in the overload run")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--result-json", type=Path, default=None)


def _request(rid: str, rng: random.Random) -> RouteRequest:
    return RouteRequest(rid, [rng.randrange(VOCAB) for _ in range(rng.randint(512, 2048))], rng.randint(128, 512))


def one_run(num_replicas: int, in_flight: int, arrivals: int, rounds: int, seed: int) -> dict:
    """Milliseconds per decision and microseconds per progress report, in one run."""
    rng = random.Random(seed)
    # room for every request at its longest, so only the policy's choice is timed, not queueing
    blocks = in_flight * (2048 + 512) // BLOCK_SIZE * 2
    router = Router(RouterConfig(policy=Policy.COORDINATED, block_size=BLOCK_SIZE),
                    [ReplicaState(i, blocks, in_flight * 2) for i in range(num_replicas)])
    generated: dict[str, int] = {}  # request id → tokens generated
    on_replica: list[list[str]] = [[] for _ in range(num_replicas)]
    for replica in range(num_replicas):
        for j in range(in_flight):
            request = _request(f"r{replica}-{j}", rng)
            router.replicas[replica].on_dispatch(request.request_id, [], len(request.token_ids), request.max_tokens,
                                                 len(request.token_ids))
            generated[request.request_id] = rng.randint(1, 100)
            on_replica[replica].append(request.request_id)
    new = [_request(f"new{i}", rng) for i in range(rounds * arrivals)]
    decide_s = progress_s = 0.0
    num_reports = 0
    for r in range(rounds):
        start = time.perf_counter()
        for replica, rids in enumerate(on_replica):
            for rid in rids:
                generated[rid] += 1
                router.on_progress(replica, rid, generated[rid])
        progress_s += time.perf_counter() - start
        num_reports += len(generated)
        for request in new[r * arrivals:(r + 1) * arrivals]:
            start = time.perf_counter()
            dispatches = router.submit(request)
            decide_s += time.perf_counter() - start
            assert len(dispatches) == 1, "the replicas have room for every arrival"
            replica = dispatches[0].replica_id
            done = on_replica[replica].pop(rng.randrange(len(on_replica[replica])))
            del generated[done]
            on_replica[replica].append(request.request_id)
            generated[request.request_id] = 0
            start = time.perf_counter()
            router.on_complete(replica, done, finished=True)
            decide_s += time.perf_counter() - start
    return {"decision_ms": 1e3 * decide_s / (rounds * arrivals), "progress_us": 1e6 * progress_s / num_reports}


def overload_run(num_replicas: int, in_flight: int, queued: int, events: int, seed: int) -> float:
    """Milliseconds per event (one request finishes, one arrives) while `queued` wait in the router.

    Replicas hold about `in_flight` requests each at their longest, so arrivals beyond that
    queue; each event's dispatching looks at queued requests again (up to the overtake limit).
    """
    rng = random.Random(seed)
    router = Router(RouterConfig(policy=Policy.COORDINATED, block_size=BLOCK_SIZE),
                    [ReplicaState(i, in_flight * 1600 // BLOCK_SIZE, in_flight * 2) for i in range(num_replicas)])
    on_replica: list[list[str]] = [[] for _ in range(num_replicas)]

    def place(dispatches: list) -> None:
        for d in dispatches:
            on_replica[d.replica_id].append(d.request_id)

    count = 0
    while len(router.queue) < queued:
        place(router.submit(_request(f"q{count}", rng)))
        count += 1
    arrivals = [_request(f"q{count + i}", rng) for i in range(events)]
    start = time.perf_counter()
    for request in arrivals:
        replica = rng.choice([i for i, rids in enumerate(on_replica) if rids])
        done = on_replica[replica].pop(rng.randrange(len(on_replica[replica])))
        place(router.on_complete(replica, done, finished=True))
        place(router.submit(request))
    return 1e3 * (time.perf_counter() - start) / events


def run_router(args: argparse.Namespace) -> int:
    if min(args.in_flight, args.arrivals, args.rounds, args.runs, args.queued) < 1:
        print("error: --in-flight, --arrivals, --rounds, --runs and --queued must be positive", file=sys.stderr)
        return 2
    rows = []
    for num_replicas in args.replicas:
        runs = [one_run(num_replicas, args.in_flight, args.arrivals, args.rounds, seed) for seed in range(args.runs)]
        decision_ms = statistics.median(r["decision_ms"] for r in runs)
        overload = [overload_run(num_replicas, args.in_flight, args.queued, args.rounds, seed) for seed in range(args.runs)]
        rows.append({"replicas": num_replicas, "in_flight_per_replica": args.in_flight,
                     "decision_ms": decision_ms, "decisions_per_s": 1e3 / decision_ms,
                     "progress_us": statistics.median(r["progress_us"] for r in runs), "runs": runs,
                     "queued": args.queued, "event_ms_with_queue": statistics.median(overload),
                     "overload_runs_ms": overload})
        print(f"{num_replicas:>4} replicas × {args.in_flight} in flight: {decision_ms:.3f} ms a decision "
              f"({1e3 / decision_ms:.0f}/s), {rows[-1]['progress_us']:.2f} µs a progress report; "
              f"{args.queued} queued: {rows[-1]['event_ms_with_queue']:.2f} ms an event", flush=True)
    result = {"bench": "router", "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "arrivals_per_round": args.arrivals, "rounds": args.rounds, "rows": rows}
    save_result(result, args.result_json, None, lambda *_: None)
    return 0
