"""bench.llama_cpp: locating llama.cpp, llama-bench JSON parsing, command lines, and the server lifecycle.

Everything but the last test runs without llama.cpp: fake binaries (small Python scripts) stand in
for llama-bench and llama-server. The last test starts the real llama-server when
scripts/build_llama_cpp.sh has been run, and is skipped otherwise.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import urllib.request
from pathlib import Path

import pytest

from bench import llama_cpp
from bench.llama_cpp import (
    LlamaCppNotFound,
    build_bench_command,
    build_server_command,
    find_binary,
    find_gguf,
    llama_server,
    parse_llama_bench_json,
    run_llama_bench,
)

# Two tests of `llama-bench -p 32 -n 16 -r 2 -o json`, trimmed to the fields we read plus a few others.
BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/cache/gguf/smollm2-135m-instruct.Q8_0.gguf",
    "model_type": "llama 256M Q8_0",
    "model_size": 144806400,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "flash_attn": -1,
    "n_prompt": 32,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-02T18:30:00Z",
    "avg_ns": 40000000,
    "stddev_ns": 1000000,
    "avg_ts": 800.5,
    "stddev_ts": 20.0,
    "samples_ns": [ 39000000, 41000000 ],
    "samples_ts": [ 820.5, 780.5 ]
  },
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/cache/gguf/smollm2-135m-instruct.Q8_0.gguf",
    "model_type": "llama 256M Q8_0",
    "model_size": 144806400,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "flash_attn": -1,
    "n_prompt": 0,
    "n_gen": 16,
    "n_depth": 0,
    "test_time": "2026-12-02T18:30:01Z",
    "avg_ns": 250000000,
    "stddev_ns": 5000000,
    "avg_ts": 64.0,
    "stddev_ts": 1.5,
    "samples_ns": [ 245000000, 255000000 ],
    "samples_ts": [ 65.3, 62.7 ]
  }
]
"""


def _executable(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# ---- locating ---------------------------------------------------------------------------------------

def test_env_var_points_at_a_bin_folder_or_its_parent(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    tool = _executable(tmp_path / "bin" / "llama-bench", "")
    monkeypatch.setenv("DRIFTGATE_LLAMA_CPP", str(tmp_path))
    assert find_binary("llama-bench") == tool
    monkeypatch.setenv("DRIFTGATE_LLAMA_CPP", str(tmp_path / "bin"))
    assert find_binary("llama-bench") == tool


def test_missing_binary_says_how_to_build_and_never_falls_back_to_path_when_overridden(tmp_path, monkeypatch):
    monkeypatch.setenv("DRIFTGATE_LLAMA_CPP", str(tmp_path))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_text("not executable")
    (tmp_path / "elsewhere").mkdir()
    _executable(tmp_path / "elsewhere" / "llama-server", "")
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere") + os.pathsep + os.environ.get("PATH", ""))
    with pytest.raises(LlamaCppNotFound, match="build_llama_cpp.sh"):
        find_binary("llama-server")


def test_default_root_follows_driftgate_home(tmp_path, monkeypatch):
    monkeypatch.delenv("DRIFTGATE_LLAMA_CPP", raising=False)
    monkeypatch.setenv("DRIFTGATE_HOME", str(tmp_path))
    assert llama_cpp.llama_cpp_root() == tmp_path / "llama.cpp"
    assert llama_cpp.gguf_dir() == tmp_path / "gguf"


def test_find_gguf_prefers_the_wheels_q4_1_and_is_case_insensitive(tmp_path):
    requant = tmp_path / "smollm2-135m-instruct.Q4_1.gguf"
    requant.write_bytes(b"GGUF")
    assert find_gguf("q4_1", tmp_path) == requant
    original = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    original.write_bytes(b"GGUF")
    assert find_gguf("Q4_1", tmp_path) == original
    (tmp_path / "smollm2-135m-instruct.bf16.gguf").write_bytes(b"GGUF")
    assert find_gguf("bf16", tmp_path).name == "smollm2-135m-instruct.bf16.gguf"
    with pytest.raises(LlamaCppNotFound, match="Q8_0"):
        find_gguf("Q8_0", tmp_path)
    with pytest.raises(ValueError, match="unknown GGUF"):
        find_gguf("Q3_K", tmp_path)


# ---- llama-bench ------------------------------------------------------------------------------------

def test_parse_llama_bench_json_splits_prompt_and_decode_tests():
    r = parse_llama_bench_json(BENCH_JSON)
    assert r["prompt_tok_s"] == pytest.approx(800.5) and r["gen_tok_s"] == pytest.approx(64.0)
    assert r["prompt"]["n_prompt"] == 32 and r["prompt"]["samples_tok_s"] == [820.5, 780.5]
    assert r["gen"]["n_gen"] == 16 and r["gen"]["avg_ms"] == pytest.approx(250.0)
    assert r["gen"]["stddev_tok_s"] == pytest.approx(1.5)
    assert r["prompt_gen"] is None
    assert r["model_type"] == "llama 256M Q8_0" and r["n_threads"] == 2 and r["build_commit"] == "0c1e570"
    assert len(r["tests"]) == 2


def test_parse_llama_bench_json_handles_combined_tests_and_leading_noise():
    tests = json.loads(BENCH_JSON)
    tests[0].update(n_prompt=256, n_gen=128, avg_ts=90.0)
    r = parse_llama_bench_json("warming up\n" + json.dumps(tests[:1]))
    assert r["prompt_gen"]["tok_s"] == pytest.approx(90.0)
    assert r["prompt_tok_s"] is None and r["gen_tok_s"] is None


@pytest.mark.parametrize("text", ["", "error: failed to load model", "[]", "[{\"n_prompt\": 1"])
def test_parse_llama_bench_json_rejects_what_is_not_a_result(text):
    with pytest.raises(ValueError):
        parse_llama_bench_json(text)


def test_bench_command_asks_for_json_and_validates():
    cmd = build_bench_command("/x/llama-bench", "/m.gguf", 256, 128, threads=2, reps=3, extra_args=["-fa", "1"])
    assert cmd == ["/x/llama-bench", "-m", "/m.gguf", "-p", "256", "-n", "128", "-t", "2", "-r", "3",
                   "-o", "json", "-fa", "1"]
    assert build_bench_command("b", "m", 0, 16)[3:5] == ["-p", "0"]  # decode-only run
    for bad in [(0, 0, 2, 1), (-1, 8, 2, 1), (8, 8, 0, 1), (8, 8, 2, 0)]:
        with pytest.raises(ValueError):
            build_bench_command("b", "m", *bad)


def test_run_llama_bench_runs_the_binary_and_parses_stdout(tmp_path):
    out = tmp_path / "out.json"
    out.write_text(BENCH_JSON)
    args_file = tmp_path / "args.json"
    fake = _executable(tmp_path / "llama-bench", f"""
import json, sys
json.dump(sys.argv[1:], open({str(args_file)!r}, "w"))
print("log line on stderr", file=sys.stderr)
sys.stdout.write(open({str(out)!r}).read())
""")
    r = run_llama_bench(tmp_path / "m.gguf", 32, 16, threads=2, reps=2, binary=fake)
    assert r["gen_tok_s"] == pytest.approx(64.0)
    assert r["command"][0] == str(fake)
    assert json.loads(args_file.read_text())[-2:] == ["-o", "json"]


def test_run_llama_bench_failure_carries_stderr(tmp_path):
    fake = _executable(tmp_path / "llama-bench", """
import sys
print("error: failed to load model 'm.gguf'", file=sys.stderr)
sys.exit(1)
""")
    with pytest.raises(RuntimeError, match="failed to load model"):
        run_llama_bench(tmp_path / "m.gguf", 32, 16, binary=fake)


# ---- llama-server -----------------------------------------------------------------------------------

def test_server_command_has_slots_context_threads_and_continuous_batching():
    cmd = build_server_command("/x/llama-server", "/m.gguf", 8123, parallel=32, ctx=16384, threads=2,
                               alias="smollm2", extra_args=["--metrics"])
    assert cmd[:3] == ["/x/llama-server", "-m", "/m.gguf"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--port"] == "8123" and flags["--host"] == "127.0.0.1"
    assert flags["-np"] == "32" and flags["-c"] == "16384" and flags["-t"] == "2" and flags["-tb"] == "2"
    assert "--cont-batching" in cmd and cmd[-1] == "--metrics"
    assert cmd[cmd.index("--alias") + 1] == "smollm2"
    for kwargs in [dict(parallel=0), dict(threads=0), dict(ctx=8, parallel=32)]:
        with pytest.raises(ValueError):
            build_server_command("b", "m", 8000, **kwargs)
    with pytest.raises(ValueError):
        build_server_command("b", "m", 0)


FAKE_SERVER = """
import sys, http.server
port = int(sys.argv[sys.argv.index("--port") + 1])
hits = {"n": 0}
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        hits["n"] += 1
        code = 503 if hits["n"] < 3 else 200  # "loading model" first, like llama-server
        self.send_response(code); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a):
        pass
print("fake llama-server listening", flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_llama_server_waits_for_health_then_stops_the_process(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    fake = _executable(tmp_path / "llama-server", FAKE_SERVER)
    log = tmp_path / "server.log"
    with llama_server(gguf, None, parallel=4, ctx=64, binary=fake, startup_timeout=30, log_path=log) as srv:
        assert srv.process.poll() is None
        with urllib.request.urlopen(srv.base_url + "/health", timeout=5) as resp:
            assert resp.status == 200
        assert srv.command[srv.command.index("-np") + 1] == "4"
    assert srv.process.poll() is not None
    assert "fake llama-server listening" in log.read_text()


def test_llama_server_that_dies_raises_with_its_log(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    fake = _executable(tmp_path / "llama-server", "print('error: unknown model architecture'); raise SystemExit(1)")
    with pytest.raises(RuntimeError, match="unknown model architecture"):
        with llama_server(gguf, None, binary=fake, startup_timeout=30):
            pass


def test_llama_server_refuses_a_missing_gguf(tmp_path):
    fake = _executable(tmp_path / "llama-server", "")
    with pytest.raises(LlamaCppNotFound):
        with llama_server(tmp_path / "absent.gguf", None, binary=fake):
            pass


# ---- the real thing, when built ---------------------------------------------------------------------

def _real_server_and_q4_1() -> tuple[Path, Path]:
    try:
        return find_binary("llama-server"), find_gguf("Q4_1")
    except LlamaCppNotFound as exc:
        pytest.skip(f"llama.cpp not built: {exc}")


@pytest.mark.slow
def test_real_llama_server_answers_one_completion():
    binary, gguf = _real_server_and_q4_1()
    with llama_server(gguf, None, parallel=2, ctx=512, threads=2, alias="smollm2", binary=binary,
                      startup_timeout=120) as srv:
        body = json.dumps({"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4,
                           "temperature": 0}).encode()
        req = urllib.request.Request(srv.base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            out = json.loads(resp.read())
    choice = out["choices"][0]
    assert isinstance(choice["text"], str) and choice["text"]
    assert out["usage"]["completion_tokens"] <= 4 and out["usage"]["prompt_tokens"] > 0
