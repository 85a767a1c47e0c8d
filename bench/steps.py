"""`driftgate bench steps`: the real engine's step time by step shape, for cluster-sim's cost model.

`driftgate cluster-sim` prices a step as a + b·num_batched_tokens + c·num_decode_seqs. This
times `LLMEngine.step` on the two shapes that separate the constants:

- prefill: one request of P prompt tokens and nothing else (tokens = P, decode seqs = 0);
- decode: B requests of `--decode-context` prompt tokens, all past their prefill
  (tokens = B, decode seqs = B); each timed step is checked to have computed no prompt token.

Every shape is timed `--repeats` times (after one warm-up step) in each of `--rounds` rounds
that visit all shapes in turn, so a slow spell on a shared machine lands on every shape rather
than on one; prefix caching is off so no prompt is served from the cache. The median over all
samples is what the fit uses, and every sample is recorded. The result carries the non-negative least-squares fit of a, b, c
(`CostModel.fit`); `cluster-sim --calibrate-from RESULT.json` refits the same medians.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.output import save_result
from engine.cluster.sim import CostModel
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def positive_ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive comma-separated integers, got {text!r}")
    return values


def add_steps_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prefill-lens", type=positive_ints, default=[32, 64, 128, 256, 512])
    parser.add_argument("--decode-batches", type=positive_ints, default=[1, 2, 4, 8, 16])
    parser.add_argument("--decode-context", type=int, default=256, help="prompt tokens of each decoding request")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per shape per round")
    parser.add_argument("--rounds", type=int, default=3, help="passes over all shapes (medians over all samples)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)


def _prompt(rng: random.Random, vocab_size: int, num_tokens: int) -> list[int]:
    # random ids away from the special tokens at the start of the vocabulary
    return [rng.randrange(100, vocab_size) for _ in range(num_tokens)]


def _step_row(kind: str, num_batched_tokens: int, num_decode_seqs: int, samples_s: list[float]) -> dict:
    samples_ms = [1000.0 * s for s in samples_s]
    return {"kind": kind, "num_batched_tokens": num_batched_tokens, "num_decode_seqs": num_decode_seqs,
            "step_ms": statistics.median(samples_ms), "samples_ms": samples_ms}


def time_prefill(engine: LLMEngine, num_tokens: int, repeats: int, rng: random.Random) -> list[float]:
    """Seconds per step of one P-token prompt, a fresh one each time (one warm-up first)."""
    vocab = engine.model.args.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    samples = []
    for i in range(repeats + 1):
        engine.add_request(None, _prompt(rng, vocab, num_tokens), params)
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        if engine.has_unfinished():
            raise RuntimeError(f"a {num_tokens}-token prefill took more than one step; raise max_num_batched_tokens")
        if i:
            samples.append(elapsed)
    return samples


def time_decode(engine: LLMEngine, batch: int, context: int, repeats: int, rng: random.Random) -> list[float]:
    """Seconds per decode step of B requests, prefilled first (untimed); one warm-up step.

    The requests could run much longer; they are aborted once timed.
    """
    vocab = engine.model.args.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - context, ignore_eos=True)
    request_ids = [engine.add_request(None, _prompt(rng, vocab, context), params) for _ in range(batch)]
    # prefill until every request has its first token (the scheduler chunks big batches)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    samples = []
    for i in range(repeats + 1):
        computed, generated = engine.num_prompt_tokens_computed, engine.num_generation_tokens
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        if engine.num_prompt_tokens_computed != computed or engine.num_generation_tokens - generated != batch:
            raise RuntimeError(f"a decode step at batch {batch} was not {batch} decodes and nothing else")
        if i:
            samples.append(elapsed)
    for request_id in request_ids:
        engine.abort_request(request_id)
    return samples


def measure_steps(config: EngineConfig, prefill_lens: list[int], decode_batches: list[int], decode_context: int,
                  repeats: int, rounds: int, seed: int = 0) -> dict:
    """Time every shape on one engine, round by round; returns the result with the fitted cost model."""
    engine = LLMEngine(config)
    rng = random.Random(seed)
    load_before = os.getloadavg()
    started = time.perf_counter()
    prefill: dict[int, list[float]] = {p: [] for p in prefill_lens}
    decode: dict[int, list[float]] = {b: [] for b in decode_batches}
    for _ in range(rounds):
        for p in prefill_lens:
            prefill[p] += time_prefill(engine, p, repeats, rng)
        for b in decode_batches:
            decode[b] += time_decode(engine, b, decode_context, repeats, rng)
    steps = [_step_row("prefill", p, 0, samples) for p, samples in prefill.items()]
    steps += [_step_row("decode", b, b, samples) for b, samples in decode.items()]
    fit = CostModel.fit(steps, f"`bench steps` on {Path(config.model).name} ({config.device})")
    return {
        "model": config.model, "device": config.device, "dtype": str(engine.model.dtype),
        "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
        "decode_context": decode_context, "repeats": repeats, "rounds": rounds,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "wall_s": time.perf_counter() - started,
        "steps": steps,
        "fit": {"a_ms": fit.a_ms, "b_ms_per_token": fit.b_ms_per_token,
                "c_ms_per_decode_seq": fit.c_ms_per_decode_seq, "calibration": fit.calibration},
    }


def plot_steps(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fit = CostModel(**result["fit"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, kind, label in ((axes[0], "prefill", "prompt tokens (one request)"),
                            (axes[1], "decode", "decoding sequences (one token each)")):
        rows = [s for s in result["steps"] if s["kind"] == kind]
        xs = [s["num_batched_tokens"] for s in rows]
        for s in rows:
            ax.scatter([s["num_batched_tokens"]] * len(s["samples_ms"]), s["samples_ms"], s=8, color="0.7")
        ax.plot(xs, [s["step_ms"] for s in rows], "o", label="median")
        ax.plot(xs, [1000 * fit.step_s(x, x if kind == "decode" else 0) for x in xs], "-", label="fit")
        ax.set_xlabel(label)
        ax.set_ylabel("step (ms)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"engine step time · {Path(result['model']).name} · {result['device']} · "
                 f"a={fit.a_ms:.1f} ms, b={fit.b_ms_per_token:.3f} ms/tok, c={fit.c_ms_per_decode_seq:.3f} ms/seq")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_steps(args: argparse.Namespace) -> int:
    biggest = max(max(args.prefill_lens), max(args.decode_batches))
    try:
        config = EngineConfig(args.model, dtype=args.dtype, device=args.device, enable_prefix_caching=False,
                              max_num_seqs=max(args.decode_batches), max_num_batched_tokens=max(2048, biggest))
        result = measure_steps(config, args.prefill_lens, args.decode_batches, args.decode_context,
                               args.repeats, args.rounds, args.seed)
    except RuntimeError as e:  # a timed step that was not the shape it should time
        print(f"error: {e}", file=sys.stderr)
        return 2
    for s in result["steps"]:
        print(f"{s['kind']:<8} tokens {s['num_batched_tokens']:>5}  decode seqs {s['num_decode_seqs']:>3}  "
              f"median {s['step_ms']:8.2f} ms  (min {min(s['samples_ms']):.2f}, max {max(s['samples_ms']):.2f})")
    print(f"fit: a = {result['fit']['a_ms']:.3f} ms, b = {result['fit']['b_ms_per_token']:.4f} ms/token, "
          f"c = {result['fit']['c_ms_per_decode_seq']:.4f} ms/seq; {result['fit']['calibration']}")
    save_result(result, args.result_json, args.plot, plot_steps)
    return 0
