"""serve's flags from a YAML file (`--config`, vLLM's) and sizes with suffixes (`--max-model-len 8K`)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.cli import add_serve_args
from server.flags import apply_config_file, human_int
from tests.server.test_serve_cli import _free_port, _wait_until_healthy


@pytest.mark.parametrize(("text", "value"), [("8192", 8192), ("8K", 8192), ("8k", 8000), ("25.6k", 25600),
                                             ("1G", 2**30), ("2m", 2_000_000), (" 32K ", 32768)])
def test_human_int_reads_decimal_and_binary_suffixes(text, value):
    assert human_int(text) == value


@pytest.mark.parametrize(("text", "says"), [("1.5K", "whole number"), ("0.5", "not a whole number"),
                                            ("12x", "not an integer"), ("-4", "not an integer"), ("", "not"),
                                            ("0", "at least 1"), ("0k", "at least 1")])
def test_human_int_refuses_what_is_not_a_whole_size(text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        human_int(text)


@pytest.mark.parametrize("flag", ["--max-num-seqs", "--max-model-len", "--max-num-batched-tokens",
                                  "--kv-cache-memory-bytes"])
def test_a_zero_size_is_a_usage_error_before_anything_loads(flag):
    """It was refused only by the engine, after the weights loaded, as exit 1 blaming the model."""
    with pytest.raises(argparse.ArgumentError, match=f"argument {flag}: must be at least 1"):
        _parse(["model", flag, "0"])


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="driftgate serve", exit_on_error=False)
    add_serve_args(parser)
    apply_config_file(parser, argv)
    return parser.parse_args(argv)


def test_the_file_sets_defaults_and_the_command_line_wins(tmp_path: Path):
    config = tmp_path / "serve.yaml"
    config.write_text("""
model: /models/from-file
port: 9001
served_model_name: [smollm2, small]      # underscores or dashes, as vLLM's
max-model-len: 4K
kv-cache-dtype: bfloat16
enable-prefix-caching: false
hf-overrides: {rope_theta: 20000}
max-num-seqs: 8
""")
    args = _parse(["--config", str(config)])
    assert (args.model, args.port, args.served_model_name) == ("/models/from-file", 9001, ["smollm2", "small"])
    assert (args.max_model_len, args.kv_cache_dtype, args.max_num_seqs) == (4096, "bfloat16", 8)
    assert args.no_prefix_caching is True and args.hf_overrides == {"rope_theta": 20000}
    args = _parse(["/models/from-cli", f"--config={config}", "--port", "9002", "--max-model-len", "2048"])
    assert (args.model, args.port, args.max_model_len, args.max_num_seqs) == ("/models/from-cli", 9002, 2048, 8)
    assert args.port == 9002 and _parse(["--port", "9003", "--config", str(config)]).port == 9003  # either order


@pytest.mark.parametrize(("body", "says"), [
    ("max-num-seq: 8", "unknown option 'max-num-seq' (did you mean 'max-num-seqs'?)"),
    ("kv-cache-dtype: fp16", "kv-cache-dtype: 'fp16' is not one of"),
    ("port: 99999", "port: port must be 0-65535"),
    ("max-model-len: 1.5K", "max-model-len: '1.5K'"),
    ("require-gate: yes please", "require-gate: true or false"),
    ("port: [1, 2]", "port: one value, not a list"),
    ("- port", "should map flag names to values, not be a list"),
    ("port: : 1", "not valid YAML"),
])
def test_a_bad_file_is_exit_2_naming_the_file_and_the_key(tmp_path: Path, capsys, body, says):
    config = tmp_path / "serve.yaml"
    config.write_text(body)
    with pytest.raises(SystemExit) as exit_info:
        _parse(["--config", str(config)])
    assert exit_info.value.code == 2
    assert f"--config {config}: {says}" in capsys.readouterr().err


def test_a_file_saved_as_utf16_is_exit_2(tmp_path: Path, capsys):
    config = tmp_path / "serve.yaml"
    config.write_bytes("port: 8001\n".encode("utf-16"))  # what Windows' Notepad may save
    with pytest.raises(SystemExit) as exit_info:
        _parse(["--config", str(config)])
    assert exit_info.value.code == 2
    assert f"--config {config}: not UTF-8 text" in capsys.readouterr().err


def test_a_missing_file_or_a_missing_model_is_exit_2(tmp_path: Path, capsys):
    from engine.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--config", str(tmp_path / "absent.yaml")])
    assert exit_info.value.code == 2 and "No such file or directory" in capsys.readouterr().err
    (tmp_path / "empty.yaml").write_text("port: 0\n")
    assert main(["serve", "--config", str(tmp_path / "empty.yaml")]) == 2
    assert "no model: name its folder first" in capsys.readouterr().err
    (tmp_path / "batch.yaml").write_text(f"model: {tmp_path / 'no-such-model'}\n")  # run-batch takes serve's flags
    (tmp_path / "in.jsonl").write_text("")
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                 "--config", str(tmp_path / "batch.yaml")]) == 2
    assert f"model folder not found: {tmp_path / 'no-such-model'}" in capsys.readouterr().err


def test_driftgate_serve_runs_from_a_config_file(tiny_model_dir: Path, tmp_path: Path):
    """The console script, with nothing but the file and one override: the server answers as configured."""
    port = _free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {tiny_model_dir}\nport: {port}\nserved-model-name: from-file\nmax-model-len: 0.1k\n"
                      "device: cpu\n")
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--config", str(config),
                             "--served-model-name", "from-cli"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_until_healthy(proc, f"http://127.0.0.1:{port}")
        card = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]
        assert (card["id"], card["max_model_len"]) == ("from-cli", 100)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_server_wide_token_ids_and_usage_apply_to_requests_that_leave_them_off(engine):
    """--return-tokens-as-token-ids and --enable-force-include-usage, as vLLM's: defaults a request
    cannot miss; without them the same requests get text tokens and no usage chunk."""
    from tests.server.conftest import MODEL_NAME, serve

    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0}
    for forced in (True, False):
        with serve(engine, return_tokens_as_token_ids=forced, force_include_usage=forced) as url:
            done = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4,
                                                            "logprobs": 1, "temperature": 0}).json()
            named = done["choices"][0]["logprobs"]["tokens"]
            assert all(t.startswith("token_id:") for t in named) is forced and len(named) == 4
            answer = httpx.post(f"{url}/v1/chat/completions", json={**chat, "logprobs": True}).json()
            named = [e["token"] for e in answer["choices"][0]["logprobs"]["content"]]
            assert all(t.startswith("token_id:") for t in named) is forced
            with httpx.stream("POST", f"{url}/v1/chat/completions", json={**chat, "stream": True}) as stream:
                events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
            last = json.loads(events[-2])  # before [DONE]
            assert (last.get("usage") is not None) is forced
            if forced:
                assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4


def test_no_access_log_lines_still_counts_requests(engine, caplog):
    from tests.server.conftest import serve

    for access_log in (True, False):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="driftgate.server.access"), serve(engine, access_log=access_log) as url:
            assert httpx.get(f"{url}/v1/models").status_code == 200
            metrics = httpx.get(f"{url}/metrics").text
        lines = [r for r in caplog.records if r.name == "driftgate.server.access"]
        assert bool(lines) is access_log
        assert 'route="/v1/models",status="200"' in metrics


def test_behind_a_proxy_that_strips_the_root_path_routes_keys_and_metrics_see_the_plain_path(engine):
    """uvicorn puts --root-path in front of the path it hands on; the public /health, the route
    labels of /metrics and the routes themselves must still see the plain path."""
    from server.app import build_app
    from server.config import ServerConfig
    from server.middleware import route_path
    from tests.server.live import serve_in_thread

    assert route_path({"path": "/llm/v1/models", "root_path": "/llm"}) == "/v1/models"
    assert route_path({"path": "/llmx/health", "root_path": "/llm"}) == "/llmx/health"
    assert route_path({"path": "/health"}) == "/health"
    app = build_app(engine, ServerConfig(served_model_name="tiny", api_key="k", metrics_public=True))
    with serve_in_thread(app, root_path="/llm") as url:  # the proxy stripped /llm: requests come without it
        assert httpx.get(f"{url}/health").status_code == 200  # public without the key
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "tiny"
        assert 'route="/v1/models",status="200"' in httpx.get(f"{url}/metrics").text


def test_stats_report_gives_rates_over_each_interval_and_stays_quiet_while_idle():
    from engine.outputs import EngineStats
    from server.stats_log import StatsReport

    report = StatsReport(EngineStats(), now=0.0)
    busy = EngineStats(num_running=3, num_waiting=1, num_blocks_total=100, num_blocks_used=25, num_prompt_tokens=400,
                       num_generation_tokens=100, prefix_cache_queries=400, prefix_cache_hits=100, num_preemptions=2)
    assert report.line(busy, now=10.0) == (
        "prompt throughput 40.0 tokens/s, generation throughput 10.0 tokens/s, running 3 reqs, waiting 1 reqs, "
        "KV cache usage 25.0%, prefix cache hit rate 25.0%, preempted 2")
    finished = EngineStats(num_blocks_total=100, num_prompt_tokens=400, num_generation_tokens=150,
                           prefix_cache_queries=400, prefix_cache_hits=100, num_preemptions=2)
    assert report.line(finished, now=20.0).startswith("prompt throughput 0.0 tokens/s, generation throughput 5.0")
    assert report.line(finished, now=30.0) is None  # idle: nothing ran, waited or finished


def test_a_busy_server_logs_its_stats_line(engine, caplog):
    from tests.server.conftest import MODEL_NAME, serve

    with caplog.at_level(logging.INFO, logger="driftgate.server.stats"), serve(engine, log_stats_interval_s=0.2) as url:
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200
        deadline = time.monotonic() + 5
        while not any("generation throughput" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no stats line within 5 s of a request"
            time.sleep(0.05)
    line = next(r.getMessage() for r in caplog.records if "generation throughput" in r.getMessage())
    assert float(line.split("generation throughput ")[1].split()[0]) > 0
