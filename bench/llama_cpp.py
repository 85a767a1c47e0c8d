"""llama.cpp as a peer in our benchmarks: find its binaries and GGUFs, run `llama-bench`, run `llama-server`.

Peers must be measured on the same machine in the same session as driftgate (run-to-run noise here
is about ±30%), so benchmarks drive llama.cpp from Python instead of from notes. The binaries and
GGUFs come from `scripts/build_llama_cpp.sh`; `DRIFTGATE_LLAMA_CPP` points at another llama.cpp
(a folder holding the binaries, or one with a `bin/` inside).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.model_import import driftgate_home

ENV_ROOT = "DRIFTGATE_LLAMA_CPP"
BUILD_HINT = "build it with scripts/build_llama_cpp.sh, or set DRIFTGATE_LLAMA_CPP to a llama.cpp bin folder"

# GGUF file names per quantization, first match wins. For Q4_1 the wheel's original file (the one
# `driftgate import-model` starts from, and the one peers.md was measured with) comes before our
# re-quantization of it.
GGUF_NAMES: dict[str, tuple[str, ...]] = {
    "Q4_1": ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct.Q4_1.gguf"),
    "Q8_0": ("smollm2-135m-instruct.Q8_0.gguf",),
    "BF16": ("smollm2-135m-instruct.bf16.gguf",),
    "F16": ("smollm2-135m-instruct.f16.gguf",),
}


class LlamaCppNotFound(FileNotFoundError):
    """A llama.cpp binary or GGUF is missing; the message says how to get it."""


def llama_cpp_root() -> Path:
    """Where llama.cpp lives: `$DRIFTGATE_LLAMA_CPP`, else `$DRIFTGATE_HOME/llama.cpp`."""
    env = os.environ.get(ENV_ROOT)
    return Path(env).expanduser() if env else driftgate_home() / "llama.cpp"


def gguf_dir() -> Path:
    return driftgate_home() / "gguf"


def find_binary(name: str) -> Path:
    """Path of a llama.cpp tool (`llama-server`, `llama-bench`, ...); PATH is the last resort."""
    root = llama_cpp_root()
    for cand in (root / "bin" / name, root / name):
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    if os.environ.get(ENV_ROOT) is None and (found := shutil.which(name)):
        return Path(found)
    raise LlamaCppNotFound(f"{name} not found under {root}; {BUILD_HINT}")


def find_gguf(quant: str = "Q8_0", folder: Path | None = None) -> Path:
    """The SmolLM2-135M-Instruct GGUF for `quant` (Q4_1, Q8_0, BF16, F16; case-insensitive)."""
    key = quant.upper()
    if key not in GGUF_NAMES:
        raise ValueError(f"unknown GGUF quantization {quant!r}; known: {', '.join(GGUF_NAMES)}")
    folder = Path(folder) if folder is not None else gguf_dir()
    for name in GGUF_NAMES[key]:
        if (folder / name).is_file():
            return folder / name
    raise LlamaCppNotFound(f"no {key} GGUF in {folder} (looked for {', '.join(GGUF_NAMES[key])}); "
                           "run scripts/build_llama_cpp.sh")


# ---- llama-bench ----------------------------------------------------------------------------------

def build_bench_command(binary: Path | str, gguf: Path | str, prompt_len: int, gen_len: int,
                        threads: int = 2, reps: int = 5, extra_args: Sequence[str] = ()) -> list[str]:
    """`llama-bench` argv with JSON on stdout; a length of 0 skips that test (llama-bench's rule)."""
    if prompt_len < 0 or gen_len < 0 or (prompt_len == 0 and gen_len == 0):
        raise ValueError(f"need prompt_len >= 0, gen_len >= 0, not both 0 (got {prompt_len}, {gen_len})")
    if threads < 1 or reps < 1:
        raise ValueError(f"threads and reps must be >= 1 (got {threads}, {reps})")
    return [str(binary), "-m", str(gguf), "-p", str(prompt_len), "-n", str(gen_len),
            "-t", str(threads), "-r", str(reps), "-o", "json", *extra_args]


def _test_summary(test: dict) -> dict:
    samples = [float(x) for x in test.get("samples_ts") or []]
    return {
        "n_prompt": int(test.get("n_prompt", 0)),
        "n_gen": int(test.get("n_gen", 0)),
        "n_depth": int(test.get("n_depth", 0)),
        "tok_s": float(test["avg_ts"]),
        "stddev_tok_s": float(test.get("stddev_ts", 0.0)),
        "samples_tok_s": samples,
        "avg_ms": float(test.get("avg_ns", 0)) / 1e6,
    }


def parse_llama_bench_json(text: str) -> dict:
    """Turn `llama-bench -o json` output into prompt/decode tokens/s plus what identifies the run.

    llama-bench prints one object per test: `-p P` gives a prompt test (n_gen == 0), `-n N` a
    generation test (n_prompt == 0), `-pg` a combined one. Anything before the JSON array (a stray
    log line) is ignored.
    """
    start = text.find("[")
    if start < 0:
        raise ValueError("no JSON array in llama-bench output: " + text.strip()[:200])
    try:
        tests = json.loads(text[start:])
    except json.JSONDecodeError as exc:
        raise ValueError(f"llama-bench output is not valid JSON: {exc}") from exc
    if not isinstance(tests, list) or not tests:
        raise ValueError("llama-bench returned no tests")
    prompt = gen = combined = None
    for test in tests:
        summary = _test_summary(test)
        if summary["n_gen"] == 0:
            prompt = summary
        elif summary["n_prompt"] == 0:
            gen = summary
        else:
            combined = summary
    first = tests[0]
    return {
        "prompt_tok_s": prompt["tok_s"] if prompt else None,
        "gen_tok_s": gen["tok_s"] if gen else None,
        "prompt": prompt,
        "gen": gen,
        "prompt_gen": combined,
        "model_filename": first.get("model_filename"),
        "model_type": first.get("model_type"),
        "model_size": first.get("model_size"),
        "model_n_params": first.get("model_n_params"),
        "n_threads": first.get("n_threads"),
        "n_batch": first.get("n_batch"),
        "n_ubatch": first.get("n_ubatch"),
        "flash_attn": first.get("flash_attn"),
        "backends": first.get("backends"),
        "cpu_info": first.get("cpu_info"),
        "build_commit": first.get("build_commit"),
        "build_number": first.get("build_number"),
        "tests": tests,
    }


def run_llama_bench(gguf: Path | str, prompt_len: int = 256, gen_len: int = 128, threads: int = 2,
                    reps: int = 5, *, extra_args: Sequence[str] = (), binary: Path | str | None = None,
                    timeout: float = 1800.0) -> dict:
    """Run `llama-bench` once and return `parse_llama_bench_json`'s dict plus the exact command."""
    binary = binary or find_binary("llama-bench")
    cmd = build_bench_command(binary, gguf, prompt_len, gen_len, threads, reps, extra_args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"llama-bench exited {proc.returncode}: {' '.join(cmd)}\n{tail}")
    result = parse_llama_bench_json(proc.stdout)
    result["command"] = cmd
    return result


# ---- llama-server ---------------------------------------------------------------------------------

def build_server_command(binary: Path | str, gguf: Path | str, port: int, *, host: str = "127.0.0.1",
                         parallel: int = 32, ctx: int = 16384, threads: int = 2, alias: str | None = None,
                         extra_args: Sequence[str] = ()) -> list[str]:
    """`llama-server` argv: N slots sharing CTX tokens of KV (ctx/parallel per slot), continuous batching.

    The defaults match how peers.md measured it (`-t 2 -c 16384 -np 32`): 512 tokens per slot,
    enough for 256-token prompts with 128 generated.
    """
    if parallel < 1 or threads < 1 or not 0 < port < 65536:
        raise ValueError(f"bad llama-server settings: parallel={parallel}, threads={threads}, port={port}")
    if ctx < parallel:
        raise ValueError(f"ctx ({ctx}) must give every one of the {parallel} slots at least one token")
    cmd = [str(binary), "-m", str(gguf), "--host", host, "--port", str(port),
           "-np", str(parallel), "-c", str(ctx), "-t", str(threads), "-tb", str(threads),
           "--cont-batching", "--no-webui"]
    if alias:
        cmd += ["--alias", alias]
    return [*cmd, *extra_args]


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just handed out (for tests; another process could still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (our own localhost URL)
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code  # 503 while the model loads
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


@dataclass(slots=True)
class LlamaServer:
    """A running `llama-server`: where to send requests and where its log goes."""

    process: subprocess.Popen
    host: str
    port: int
    command: list[str]
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM (llama-server shuts down its slots and HTTP threads), SIGKILL after `grace` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextlib.contextmanager
def llama_server(gguf: Path | str, port: int | None = None, parallel: int = 32, ctx: int = 16384,
                 threads: int = 2, *, host: str = "127.0.0.1", alias: str | None = None,
                 extra_args: Sequence[str] = (), binary: Path | str | None = None,
                 startup_timeout: float = 120.0, stop_timeout: float = 15.0,
                 log_path: Path | str | None = None) -> Iterator[LlamaServer]:
    """Start `llama-server`, yield once `/health` says 200 (model loaded), stop it on exit.

    `port=None` picks a free port. The server's output goes to `log_path` (a temp file if not
    given) so a full pipe can never stall it; a server that dies or never gets healthy raises with
    the log's tail.
    """
    binary = binary or find_binary("llama-server")
    if not Path(gguf).is_file():
        raise LlamaCppNotFound(f"GGUF not found: {gguf}")
    port = port or free_port(host)
    cmd = build_server_command(binary, gguf, port, host=host, parallel=parallel, ctx=ctx, threads=threads,
                               alias=alias, extra_args=extra_args)
    own_log = log_path is None
    if own_log:
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # Ctrl-C in the benchmark goes through _stop
    server = LlamaServer(process=proc, host=host, port=port, command=cmd, log_path=log_path)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode} before it was healthy: "
                                   f"{' '.join(cmd)}\n{server.log_tail()}")
            if _http_status(server.base_url + "/health") == 200:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not healthy after {startup_timeout:.0f}s: "
                                   f"{' '.join(cmd)}\n{server.log_tail()}")
            time.sleep(0.2)
        yield server
    finally:
        _stop(proc, stop_timeout)
        if own_log:
            with contextlib.suppress(OSError):
                log_path.unlink()


def main() -> None:
    """`python -m bench.llama_cpp`: show what the benchmarks would use."""
    for name in ("llama-server", "llama-bench", "llama-quantize", "llama-cli", "llama-batched-bench"):
        try:
            print(f"{name:20s} {find_binary(name)}")
        except LlamaCppNotFound:
            print(f"{name:20s} (missing)")
    for quant in GGUF_NAMES:
        try:
            print(f"{quant:20s} {find_gguf(quant)}")
        except LlamaCppNotFound:
            print(f"{quant:20s} (missing)")


if __name__ == "__main__":
    main()
