"""`driftgate bench router` on a few small runs: the harness keeps its load steady and reports."""

from __future__ import annotations

import json

from bench.router import one_run, overload_run, run_router
from engine.cli import build_parser


def test_a_run_times_decisions_and_progress_reports():
    row = one_run(num_replicas=3, in_flight=4, arrivals=2, rounds=3, seed=0)
    assert row["decision_ms"] > 0 and row["progress_us"] > 0
    assert overload_run(num_replicas=3, in_flight=4, queued=5, events=4, seed=0) > 0


def test_cli_writes_one_row_per_cluster_size(tmp_path):
    out = tmp_path / "router.json"
    args = build_parser("bench").parse_args(["bench", "router", "--replicas", "2,5", "--in-flight", "3",
                                            "--arrivals", "2", "--rounds", "2", "--runs", "2", "--queued", "3",
                                            "--result-json", str(out)])
    assert run_router(args) == 0
    result = json.loads(out.read_text())
    assert [r["replicas"] for r in result["rows"]] == [2, 5]
    assert all(len(r["runs"]) == 2 and r["decisions_per_s"] > 0 and r["event_ms_with_queue"] > 0
               for r in result["rows"])


def test_bad_sizes_are_refused(capsys):
    args = build_parser("bench").parse_args(["bench", "router", "--runs", "0"])
    assert run_router(args) == 2 and "must be positive" in capsys.readouterr().err
