"""`driftgate bench spec`: what prompt-lookup speculative decoding buys, per kind of text.

The same greedy requests run on two engines in one process, one without drafts and one with
`--speculative-config`, runs interleaved so machine noise hits both alike. The figures are output
tokens/s (medians of `--runs`), their ratio, and the share of drafts the sampler kept. Requests
stop at EOS or `--max-tokens`, as a user's would: text forced past EOS tends to repeat and
flatters lookup.

The JSON records whether the greedy outputs were identical; for fp32 and weight-only checkpoints
they were in every run here. Draft rows make a step several rows wide, and the CPU attention
kernel then splits each context across threads differently, which moves fp32 sums in the last
bits: too little to flip those models' choices, but schemes that quantize activations (W8A8,
FP8) can round such a value the other way and part at a near-tie, exactly as those checkpoints
do when a request shares a batch with others without drafts.

Workloads: `rewrite` (copy a WikiText paragraph with small edits: lookup's best case),
`gsm8k` (step-by-step arithmetic, the gate's task: numbers and phrases recur), `chat`
(ShareGPT first turns: open-ended answers, little to look up).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.datasets import find_data_dir, sharegpt
from bench.output import save_result
from engine import LLM, SamplingParams
from engine.spec_decode import SPECULATIVE_CONFIG_HELP, speculative_config_arg
from evals.data import load_gsm8k, load_wikitext

WORKLOADS = ("rewrite", "gsm8k", "chat")


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder (bf16/fp32 or a quantized checkpoint)")
    parser.add_argument("--speculative-config", type=speculative_config_arg,
                        default=speculative_config_arg('{"method": "ngram", "num_speculative_tokens": 4}'),
                        help=SPECULATIVE_CONFIG_HELP)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--concurrency", default="1,4", help="comma-separated numbers of requests run at once")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--runs", type=int, default=3, help="repetitions per measurement (medians reported)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)


def _paragraphs(data_dir: Path, count: int) -> list[str]:
    """The first paragraph of 60–200 words of each WikiText-2 test article."""
    found = []
    for article in load_wikitext(data_dir):
        para = next((p for p in article["page"].split("\n") if 60 <= len(p.split()) <= 200), None)
        if para:
            found.append(para)
        if len(found) == count:
            return found
    raise ValueError(f"only {len(found)} WikiText-2 paragraphs of 60-200 words; asked for {count}")


def workload_messages(name: str, data_dir: Path, tokenizer, count: int, seed: int) -> list[str]:
    """`count` user messages of one workload."""
    if name == "rewrite":
        return ["Rewrite the following paragraph, correcting any spelling mistakes and changing nothing "
                f"else:\n\n{p}" for p in _paragraphs(data_dir, count)]
    if name == "gsm8k":
        return [f"{row['question']}\nThink step by step, then give the answer." for row in load_gsm8k(data_dir)[:count]]
    if name == "chat":
        return [s.prompt for s in sharegpt(tokenizer, data_dir, count, 128, True, np.random.default_rng(seed))]
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def _fitting_prompts(llm: LLM, workload: str, data_dir: Path, args: argparse.Namespace) -> list[list[int]]:
    """The first --num-prompts chat prompts of the workload that leave room for --max-tokens."""
    room = llm.engine.max_model_len - args.max_tokens
    candidates = workload_messages(workload, data_dir, llm.tokenizer, 4 * args.num_prompts, args.seed)
    prompts = [p for p in (llm.apply_chat_template([{"role": "user", "content": m}]) for m in candidates)
               if len(p) <= room]
    if len(prompts) < args.num_prompts:
        raise ValueError(f"only {len(prompts)} of {len(candidates)} {workload} prompts leave {args.max_tokens} "
                         f"tokens within max_model_len={llm.engine.max_model_len}; lower --num-prompts or --max-tokens")
    return prompts[:args.num_prompts]


def _timed_run(llm: LLM, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[float, list]:
    """Output tokens/s with `concurrency` requests in flight at a time, and the token ids."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if not llm.reset_prefix_cache():
        raise RuntimeError("prefix cache still in use before a measured run")
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outputs += llm.generate(prompts[i:i + concurrency], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return sum(map(len, tokens)) / elapsed, tokens


def measure(plain: LLM, spec: LLM, prompts: list[list[int]], concurrency: int, max_tokens: int,
            runs: int) -> dict:
    plain_rates, spec_rates = [], []
    before = spec.stats()
    identical = True
    for _ in range(runs):
        rate, plain_tokens = _timed_run(plain, prompts, concurrency, max_tokens)
        plain_rates.append(rate)
        rate, spec_tokens = _timed_run(spec, prompts, concurrency, max_tokens)
        spec_rates.append(rate)
        identical &= plain_tokens == spec_tokens
    after = spec.stats()
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
    plain_tok_s, spec_tok_s = statistics.median(plain_rates), statistics.median(spec_rates)
    return {"plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s, "speedup": spec_tok_s / plain_tok_s,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "output_tokens": sum(map(len, plain_tokens)), "identical_outputs": identical,
            "plain_runs": plain_rates, "spec_runs": spec_rates}


def run_spec(args: argparse.Namespace) -> int:
    data_dir = find_data_dir(args.data_dir)
    levels = [int(c) for c in args.concurrency.split(",")]
    if min(levels) < 1:
        raise ValueError("--concurrency levels must be at least 1")
    plain = LLM(args.model, seed=args.seed)
    spec = LLM(args.model, seed=args.seed, speculative_config=args.speculative_config)
    rows = []
    for workload in args.workloads.split(","):
        prompts = _fitting_prompts(plain, workload, data_dir, args)
        _timed_run(plain, prompts[:1], 1, 8)  # warm-up: first-call allocations
        _timed_run(spec, prompts[:1], 1, 8)
        for concurrency in levels:
            row = {"workload": workload, "concurrency": concurrency,
                   **measure(plain, spec, prompts, concurrency, args.max_tokens, args.runs)}
            rows.append(row)
            print(f"{workload:8s} c={concurrency:<3d} plain {row['plain_tok_s']:7.1f} tok/s  spec "
                  f"{row['spec_tok_s']:7.1f} tok/s  x{row['speedup']:.2f}  accepted {row['acceptance_rate']:.0%} "
                  f"of drafts{'' if row['identical_outputs'] else '  (greedy outputs differ: see the module doc)'}")
    result = {"model": args.model, "speculative_config": {k: getattr(args.speculative_config, k)
                                                          for k in args.speculative_config.__slots__},
              "max_tokens": args.max_tokens, "num_prompts": args.num_prompts, "runs": args.runs,
              "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
              "rows": rows}
    save_result(result, args.result_json, args.plot, plot_spec)
    if args.result_json is None:
        print(json.dumps(rows, indent=2))
    return 0


def plot_spec(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['workload']}\nc={r['concurrency']}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.1), 4))
    ax.bar(x - 0.2, [r["plain_tok_s"] for r in rows], 0.4, label="plain decoding")
    ax.bar(x + 0.2, [r["spec_tok_s"] for r in rows], 0.4, label="prompt-lookup drafts")
    for i, r in enumerate(rows):
        ax.annotate(f"x{r['speedup']:.2f}", (i + 0.2, r["spec_tok_s"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels)
    ax.set_ylabel("output tokens/s (median)")
    ax.set_title(f"Speculative decoding by prompt lookup: {Path(result['model']).name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
