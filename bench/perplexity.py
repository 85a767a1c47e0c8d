"""`driftgate bench ppl`: WikiText-2 token perplexity of one or more checkpoints on a fixed token budget.

Quantization quality is compared as perplexity on the same tokens: the raw test file is
tokenized, cut to the first `--max-tokens` tokens, and split into windows of `--context`
tokens starting every `--stride` tokens. Each token is scored once, by the first window that
gives it at least one token of context, so every model scores exactly the same positions with
the same left context and the numbers are comparable run to run (not to published figures,
which use other splits and budgets).

Scoring goes through the engine's prompt logprobs (`DriftgateLM.score_sequences`, the same
path the gate's lm-eval tasks use), so the figure measures what the engine serves: its
quantized kernels and, with `--kv-cache-dtype fp8` (or `fp8_e5m2`), its FP8 KV cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.output import save_result
from bench.schemes import size_on_disk
from engine import LLM
from engine.config import KV_CACHE_DTYPES, KV_SCALES, kv_cache_setting
from engine.loader import read_config

WIKITEXT_FILE = "wikitext/wiki.test.raw"


@dataclass(frozen=True)
class Window:
    """Tokens [start, end) run through the model; the last `num_scored` of them are scored."""

    start: int
    end: int
    num_scored: int


@dataclass
class PerplexityResult:
    label: str
    model: str
    kv_cache_dtype: str
    kv_scales: str | None  # fp8 KV only: "checkpoint" (calibrated) or "dynamic"
    ppl: float
    mean_nll: float
    scored_tokens: int
    windows: int
    tokens_sha256: str
    seconds: float
    size_bytes: int
    quantization: dict | None


def plan_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """Windows of at most `context` tokens whose scored tails cover positions 1..num_tokens-1 once.

    Window k ends at min(k·stride + context, num_tokens) and scores the positions no earlier
    window scored; stride == context gives non-overlapping windows (the first token of each has
    no context inside it, so it is not scored), a smaller stride gives every scored token more
    left context at the cost of recomputing the overlap.
    """
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be between 1 and the context ({context}), got {stride}")
    if num_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {num_tokens}")
    windows, scored_until = [], 1  # position 0 never has context
    for start in range(0, num_tokens - 1, stride):
        end = min(start + context, num_tokens)
        first = max(scored_until, start + 1)
        if end > first:
            windows.append(Window(start, end, end - first))
            scored_until = end
        if end == num_tokens:
            break
    return windows


def load_tokens(tokenizer, path: Path, max_tokens: int) -> list[int]:
    """The first `max_tokens` tokens of the file (no special tokens); too short a file is an error."""
    ids = tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
    if len(ids) < max_tokens:
        raise ValueError(f"{path} has only {len(ids)} tokens, fewer than --max-tokens {max_tokens}")
    return list(ids[:max_tokens])


def score_windows(llm: LLM, token_ids: list[int], windows: list[Window]) -> tuple[float, int]:
    """(sum of log p of every scored token, number scored) through the engine's prompt logprobs."""
    from evals.lm_eval_model import DriftgateLM

    scorer = DriftgateLM(llm=llm)
    if max(w.end - w.start for w in windows) > scorer.max_score_len:
        raise ValueError(f"a {max(w.end - w.start for w in windows)}-token window does not fit the engine's "
                         f"max_model_len {llm.engine.max_model_len} (scoring needs one free slot)")
    sequences = [(token_ids[w.start:w.end], w.num_scored) for w in windows]
    scores = scorer.score_sequences(sequences, desc="perplexity", disable_tqdm=True)
    return sum(logprob for logprob, _ in scores), sum(w.num_scored for w in windows)


def quantization_summary(model_dir: Path) -> dict | None:
    """The checkpoint's `quantization_config` (None for an unquantized folder), recorded with the result."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("quantization_config")


def measure(model_dir: Path, data_path: Path, *, max_tokens: int, context: int, stride: int,
            dtype: str = "auto", kv_cache_dtype: str = "auto", kv_scales: str = "checkpoint",
            label: str | None = None) -> PerplexityResult:
    """Load one checkpoint, score the planned windows, return its perplexity and provenance."""
    llm = LLM(str(model_dir), dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales,
              max_model_len=context + 1)
    token_ids = load_tokens(llm.tokenizer, data_path, max_tokens)
    windows = plan_windows(len(token_ids), context, stride)
    start = time.perf_counter()
    total_logprob, scored = score_windows(llm, token_ids, windows)
    seconds = time.perf_counter() - start
    mean_nll = -total_logprob / scored
    kv_cache_dtype = llm.engine.config.kv_cache_dtype  # `auto` resolved on the checkpoint
    return PerplexityResult(
        label=label or Path(model_dir).name, model=str(model_dir), kv_cache_dtype=kv_cache_dtype,
        kv_scales=kv_cache_setting(kv_cache_dtype, kv_scales)["kv_scales"],
        ppl=math.exp(mean_nll), mean_nll=mean_nll, scored_tokens=scored, windows=len(windows),
        tokens_sha256=hashlib.sha256(json.dumps(token_ids).encode()).hexdigest(), seconds=seconds,
        size_bytes=size_on_disk(Path(model_dir)), quantization=quantization_summary(model_dir))


def add_ppl_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", type=Path, help="model folders (BF16 source and/or checkpoints)")
    parser.add_argument("--data", type=Path, default=None,
                        help=f"text file (default: {WIKITEXT_FILE} in the data folder)")
    parser.add_argument("--data-dir", default=None, help="data folder for the default --data")
    parser.add_argument("--max-tokens", type=int, default=16384, help="token budget: the first N tokens of the file")
    parser.add_argument("--context", type=int, default=512, help="window length in tokens")
    parser.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: --context)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="applies to every model of this run")
    parser.add_argument("--kv-scales", choices=KV_SCALES, default="checkpoint",
                        help="fp8 KV scales: calibrated from the checkpoint, or dynamic (from the first batch)")
    parser.add_argument("--labels", nargs="+", default=None, help="one name per model (default: folder names)")
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG: perplexity and size per model")
    parser.add_argument("--append", action="store_true",
                        help="add to an existing --result-json made with the same data, budget and windows")


def _settings(args: argparse.Namespace, data_path: Path) -> dict:
    from engine.file_hash import file_sha256

    return {"data": str(data_path), "data_sha256": file_sha256(data_path), "max_tokens": args.max_tokens,
            "context": args.context, "stride": args.stride or args.context, "dtype": args.dtype}


def _merge(path: Path, settings: dict, results: list[dict]) -> list[dict]:
    """Earlier results of a compatible run, then this run's (a label measured again replaces the old row)."""
    previous = json.loads(path.read_text())
    if previous["settings"] != settings:
        raise ValueError(f"{path} was measured with {previous['settings']}, not {settings}; cannot --append")
    labels = {r["label"] for r in results}
    return [r for r in previous["results"] if r["label"] not in labels] + results


def run_ppl(args: argparse.Namespace) -> int:
    from evals.data import resolve_data_dir, task_file

    if args.labels is not None and len(args.labels) != len(args.models):
        print(f"error: {len(args.labels)} labels for {len(args.models)} models", file=sys.stderr)
        return 2
    for model in args.models:  # every folder checked before the first is measured
        read_config(model)
    data_path = args.data or task_file(resolve_data_dir(args.data_dir), WIKITEXT_FILE)
    settings = _settings(args, data_path)
    results = []
    for i, model in enumerate(args.models):
        result = measure(model, data_path, max_tokens=args.max_tokens, context=args.context,
                         stride=settings["stride"], dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                         kv_scales=args.kv_scales,
                         label=args.labels[i] if args.labels else None)
        print(f"{result.label}: ppl {result.ppl:.4f} over {result.scored_tokens} tokens "
              f"({result.windows} windows, {result.seconds:.0f} s, {result.size_bytes / 2**20:.1f} MiB)", flush=True)
        results.append(asdict(result))
    if args.result_json and args.append and args.result_json.exists():
        results = _merge(args.result_json, settings, results)
    if len({r["tokens_sha256"] for r in results}) > 1:
        print("warning: the models tokenize the text differently; their perplexities are not comparable",
              file=sys.stderr)
    report = {"settings": settings, "date": time.strftime("%Y-%m-%d"),
              "machine": {"cpu": platform.processor() or platform.machine(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__},
              "results": results}
    save_result(report, args.result_json, args.plot, _plot)
    return 0


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [r["label"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.4 * len(rows) + 1.5))
    axes[0].barh(labels, [r["ppl"] for r in rows], color="tab:blue")
    axes[0].axvline(rows[0]["ppl"], color="black", linestyle="--", linewidth=1, label=f"{labels[0]} (first row)")
    axes[0].set_xlim(min(r["ppl"] for r in rows) * 0.95, max(r["ppl"] for r in rows) * 1.02)
    axes[0].legend(loc="lower right")
    axes[0].set_title("perplexity (lower is better)")
    axes[1].barh(labels, [r["size_bytes"] / 2**20 for r in rows], color="tab:gray")
    axes[1].set_title("weights on disk (MiB)")
    for ax in axes:
        ax.invert_yaxis()
    s = report["settings"]
    fig.suptitle(f"{Path(s['data']).name}: {s['max_tokens']} tokens, context {s['context']}, stride {s['stride']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
