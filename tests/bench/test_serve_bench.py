"""`driftgate bench serve`: metric definitions on hand-made results, arrivals, datasets, and a live run."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from bench import datasets
from bench.serve import (
    RequestResult,
    add_bench_serve_args,
    arrival_gaps,
    check_server,
    compute_metrics,
    parse_counters,
    run_bench_serve,
    server_side,
)
from engine.slo import parse_slo


def test_tpot_excludes_first_token_and_goodput_needs_every_slo():
    fast = RequestResult(prompt_len=10, output_len=5, ttft=0.1, latency=0.5, itl=[0.1] * 4)
    slow_first = RequestResult(prompt_len=10, output_len=5, ttft=1.0, latency=1.4, itl=[0.1] * 4)
    single = RequestResult(prompt_len=10, output_len=1, ttft=0.2, latency=0.2)
    failed = RequestResult(prompt_len=10, error="HTTP 429")
    assert fast.tpot == pytest.approx(0.1) and single.tpot == 0.0
    m = compute_metrics([fast, slow_first, single, failed], duration_s=2.0, slo=parse_slo("ttft:500,tpot:150"))
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["goodput"] == pytest.approx(2 / 2.0)  # slow_first misses the TTFT SLO
    assert m["output_throughput"] == pytest.approx(11 / 2.0)
    assert m["total_token_throughput"] == pytest.approx((30 + 11) / 2.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)  # the single-token request has no TPOT
    assert m["itl_ms"]["median"] == pytest.approx(100.0)
    assert m["ttft_ms"]["p99"] <= 1000.0
    assert compute_metrics([fast], 1.0, {})["goodput"] is None


def test_parse_slo_rejects_unknown_metrics_and_bad_limits():
    assert parse_slo("ttft:2000, tpot:50") == {"ttft": 2.0, "tpot": 0.05}
    for bad in ("latency:5", "ttft:", "ttft:abc", "tpot:-5", "e2el:0"):
        with pytest.raises(ValueError, match="bad SLO entry"):
            parse_slo(bad)


def test_arrivals_are_gamma_with_the_requested_rate():
    rng = np.random.default_rng(0)
    poisson = arrival_gaps(20_000, rate=4.0, burstiness=1.0, rng=rng)
    assert poisson.mean() == pytest.approx(0.25, rel=0.03)
    assert poisson.std() == pytest.approx(0.25, rel=0.05)  # exponential: std == mean
    regular = arrival_gaps(20_000, rate=4.0, burstiness=8.0, rng=rng)
    assert regular.mean() == pytest.approx(0.25, rel=0.03) and regular.std() < 0.5 * poisson.std()
    assert not arrival_gaps(5, math.inf, 1.0, rng).any()


def test_data_dir_resolution_order(tmp_path, monkeypatch):
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    monkeypatch.setenv("DRIFTGATE_DATA", str(env_dir))
    assert datasets.find_data_dir(str(tmp_path)) == tmp_path
    assert datasets.find_data_dir(None) == env_dir


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.helpers import write_tiny_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_prefix_shared_prompts_share_the_prefix(tokenizer):
    samples = datasets.prefix_shared(tokenizer, 4, prefix_len=64, input_len=8, output_len=5,
                                     rng=np.random.default_rng(0))
    prefix = samples[0].prompt.split("\n")[0]
    assert len({s.prompt for s in samples}) == 4
    assert all(s.prompt.startswith(prefix) and s.output_len == 5 and s.prompt_len > 64 for s in samples)
    several = datasets.prefix_shared(tokenizer, 40, prefix_len=64, input_len=8, output_len=5,
                                     rng=np.random.default_rng(0), num_prefixes=3)
    assert len({s.prompt.split("\n")[0] for s in several}) == 3


def test_sharegpt_samples_are_pruned_and_reproducible(tokenizer, data_dir):
    draw = [datasets.sharegpt(tokenizer, data_dir, 30, 64, False, np.random.default_rng(3)) for _ in range(2)]
    assert [s.prompt for s in draw[0]] == [s.prompt for s in draw[1]]
    assert all(4 <= s.prompt_len <= 1024 and 4 <= s.output_len <= 1024 for s in draw[0])
    assert len({s.output_len for s in draw[0]}) > 5  # drawn, not fixed


def test_server_side_counts_only_the_run_from_metrics_counters():
    exposition = """# HELP driftgate:prefix_cache_hits Prompt tokens found in the prefix cache.
# TYPE driftgate:prefix_cache_hits counter
driftgate:prefix_cache_hits_total 300.0
driftgate:prefix_cache_queries_total 1000.0
driftgate:num_requests_running 2.0
driftgate:replica_requests_dispatched_total{replica="1"} 7.0
driftgate:replica_requests_dispatched_total{replica="0"} 3.0
"""
    after = parse_counters(exposition)
    assert after["prefix_cache_hits_total"] == 300 and "num_requests_running" not in after
    before = {"prefix_cache_hits_total": 100.0, "prefix_cache_queries_total": 600.0,
              'replica_requests_dispatched_total{replica="0"}': 3.0}
    assert server_side(before, after) == {"prefix_cache_hit_rate": 0.5, "replica_requests_dispatched": [0, 7]}
    vllm = parse_counters("vllm:prefix_cache_hits_total 5.0\nvllm:prefix_cache_queries_total 10.0\n")
    assert server_side({}, vllm) == {"prefix_cache_hit_rate": 0.5}
    labelled = parse_counters(  # as vLLM exports them: per engine and model, summed here
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 3.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 2.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 10.0\n')
    assert server_side({}, labelled) == {"prefix_cache_hit_rate": 0.5}
    assert server_side({}, {}) == {"prefix_cache_hit_rate": None}


def test_live_run_writes_json_and_plots(engine, tiny_model_dir: Path, tmp_path: Path, capsys):
    from tests.server.conftest import MODEL_NAME, serve

    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    with serve(engine) as url:
        args = parser.parse_args([
            # vLLM's bench spellings (--dataset-name, --random-input-len, --goodput) name the same settings
            "--base-url", url, "--model", MODEL_NAME, "--tokenizer", str(tiny_model_dir), "--dataset-name", "random",
            "--num-prompts", "6", "--random-input-len", "40", "--random-output-len", "8", "--ignore-eos",
            "--sweep", "4,inf", "--max-concurrency", "4",
            "--temperature", "1.0",  # greedy on random weights can settle on special tokens (no text)
            "--goodput", "ttft:60000", "tpot:60000", "--result-json", str(tmp_path / "r.json"),
            "--plot", str(tmp_path / "p.png"), "--no-progress", "--max-duration", "120",
        ])
        assert run_bench_serve(args) == 0
        check_server(parser.parse_args(["--base-url", url, "--model", "other"]))
        assert f"warning: {url}/v1/models lists ['{MODEL_NAME}'], not --model 'other'" in capsys.readouterr().err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["slo"] == "ttft:60000,tpot:60000" and result["input_len"] == 40
    assert [run["request_rate"] for run in result["runs"]] == [4.0, "inf"]  # strict JSON, as vLLM writes it
    for run in result["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        # the server generated exactly 8 each; re-tokenizing a random model's text need not give 8 back
        assert [r["server_output_len"] for r in run["requests"]] == [8] * 6
        assert [r["output_len"] for r in run["requests"]] == [8] * 6  # the server's count, as vLLM's bench reads it
        assert run["total_output_tokens"] > 0
        assert run["goodput"] == pytest.approx(run["request_throughput"])
        assert 0 < run["ttft_ms"]["median"] <= run["e2el_ms"]["median"]
        assert 0.0 <= run["server"]["prefix_cache_hit_rate"] <= 1.0  # read from /metrics
    assert result["runs"][1]["server"]["prefix_cache_hit_rate"] > 0  # the same prompts again
    assert (tmp_path / "p.png").stat().st_size > 0 and (tmp_path / "p_sweep.png").stat().st_size > 0


def test_unreachable_server_exits_2_saying_why(tiny_model_dir: Path, capsys):
    import socket

    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    args = parser.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer",
                              str(tiny_model_dir), "--dataset", "random", "--num-prompts", "2", "--input-len", "8",
                              "--output-len", "4", "--no-progress"])
    assert run_bench_serve(args) == 2  # before any load, as vLLM's bench stops when its test request fails
    assert f"error: cannot reach http://127.0.0.1:{port}/v1/models" in capsys.readouterr().err
    args.slo, args.goodput = "ttft:100", ["tpot:5"]
    assert run_bench_serve(args) == 2
    assert "give the SLOs once: --slo or --goodput" in capsys.readouterr().err


def test_chosen_percentiles_are_computed_printed_and_checked(capsys):
    from bench.serve import metric_percentiles, percentile_metrics, print_summary

    results = [RequestResult(prompt_len=10, output_len=3, ttft=t / 1000, latency=t / 100, itl=[0.01, 0.02])
               for t in range(1, 101)]
    m = compute_metrics(results, duration_s=1.0, slo={}, percentiles=metric_percentiles("99.9,25")) | {"request_rate": 2.0}
    assert set(m["ttft_ms"]) == {"mean", "median", "std", "p25", "p50", "p90", "p99", "p99.9"}  # 50/90/99 kept
    assert m["ttft_ms"]["p25"] == pytest.approx(np.percentile(np.arange(1, 101), 25))
    print_summary(m, percentile_metrics("ttft,e2el"), (25, 99.9))
    out = capsys.readouterr().out
    assert "TTFT ms" in out and "E2EL ms" in out and "ITL ms" not in out and "p99.9" in out and "p90" not in out
    for bad, says in ((metric_percentiles, "0,50"), (metric_percentiles, "fifty"), (percentile_metrics, "ttft,latency")):
        with pytest.raises(argparse.ArgumentTypeError):
            bad(says)


def test_the_tokenizer_defaults_to_the_folder_the_server_names(engine, tiny_model_dir: Path, tmp_path: Path):
    """`bench serve --model NAME` without --tokenizer, as the README writes it: the model card's root."""
    from bench.serve import tokenizer_folder
    from tests.server.conftest import MODEL_NAME, serve

    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    with serve(engine, model_root=str(tiny_model_dir)) as url:
        args = parser.parse_args(["--base-url", url, "--model", MODEL_NAME])
        assert tokenizer_folder(args, check_server(args)) == str(tiny_model_dir)
        args.tokenizer = str(tmp_path / "missing")
        with pytest.raises(ValueError, match="tokenizer folder not found: .*missing \\(pass --tokenizer\\)"):
            tokenizer_folder(args, check_server(args))


def _measure(tokenizer, events: list[str], chat: bool) -> RequestResult:
    """What bench serve measures of one request whose server streams `events` (each a `data:` line)."""
    import asyncio

    import httpx

    from bench.serve import send_request

    def reply(_request):
        return httpx.Response(200, text="".join(f"data: {e}\n\n" for e in events),
                              headers={"content-type": "text/event-stream"})

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as client:
            result = RequestResult(prompt_len=1)
            url = "http://server/v1/" + ("chat/completions" if chat else "completions")
            await send_request(client, url, {}, chat, tokenizer, result)
            return result

    return asyncio.run(run())


@pytest.mark.parametrize(("events", "error", "output_len"), [
    (['{"choices": [{"text": "a b"}]}', '{"choices": [{"text": " c"}]}',
      '{"choices": [], "usage": {"completion_tokens": 7}}', "[DONE]"], None, 7),  # the server's count
    (['{"choices": [{"text": "a"}]}', '{"error": "plain text"}'], "plain text", 0),
    (['{"choices": [{"text": "a"}]}', '["not", "an", "event"]'], "AttributeError", 0),
    # an empty completion is a success with no tokens, as in vLLM's bench; no choices at all is not
    (['{"choices": [{"text": "", "finish_reason": "stop"}]}', '{"choices": [], "usage": {"completion_tokens": 0}}'],
     None, 0),
    (['{"choices": [], "usage": {"completion_tokens": 0}}', "[DONE]"], "no chunk with choices", 0),
])
def test_each_request_ends_with_a_result_whatever_the_stream_holds(tokenizer, events, error, output_len):
    result = _measure(tokenizer, events, chat=False)
    assert (error is None and result.error is None) or error in result.error
    assert result.output_len == output_len and (result.latency > 0) == (error is None)


def test_chat_timings_start_at_the_role_chunk_and_count_reasoning_text(tokenizer):
    """vLLM's bench: every chunk with choices is a timing event (TTFT at the role-only first chunk,
    one ITL gap per later chunk); the tokens counted without usage include reasoning_content."""
    events = ['{"choices": [{"delta": {"role": "assistant", "content": ""}}]}',
              '{"choices": [{"delta": {"reasoning_content": "Let me think"}}]}',
              '{"choices": [{"delta": {"content": " Paris"}, "finish_reason": "stop"}]}', "[DONE]"]
    result = _measure(tokenizer, events, chat=True)
    assert result.error is None and len(result.itl) == 2
    assert 0 < result.ttft <= result.latency
    assert result.output_len == len(tokenizer.encode("Let me think Paris", add_special_tokens=False))


def test_random_prompts_have_the_asked_length(tokenizer):
    """Decoded random ids re-encode to other lengths (~5% longer on SmolLM2's BPE); the prompts are
    adjusted until they encode to --input-len, as vLLM's random dataset does."""
    samples = datasets.random_prompts(tokenizer, 16, 96, 8, np.random.default_rng(0))
    assert [s.prompt_len for s in samples] == [96] * 16
    assert all(len(tokenizer.encode(s.prompt, add_special_tokens=False)) == 96 for s in samples)


def test_max_duration_holds_at_a_finite_rate_and_bad_limits_are_refused(engine, tiny_model_dir: Path, capsys):
    import time

    from tests.server.conftest import MODEL_NAME, serve

    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    with serve(engine) as url:
        base = ["--base-url", url, "--model", MODEL_NAME, "--tokenizer", str(tiny_model_dir), "--dataset", "random",
                "--input-len", "8", "--output-len", "4", "--no-progress"]
        started = time.perf_counter()  # 6 requests at 0.5/s would take ~10 s; the run stops at 2
        assert run_bench_serve(parser.parse_args([*base, "--num-prompts", "6", "--request-rate", "0.5",
                                                  "--max-duration", "2"])) == 1
        assert time.perf_counter() - started < 6
        assert "not sent: --max-duration reached" in capsys.readouterr().out
        for flags, message in ((["--max-concurrency", "-1"], "--max-concurrency must be at least 1"),
                               (["--request-rate", "nan"], "request rates (a number, or inf)"),
                               (["--timeout", "0"], "--timeout and --max-duration must be positive")):
            assert run_bench_serve(parser.parse_args([*base, "--num-prompts", "2", *flags])) == 2
            assert message in capsys.readouterr().err
