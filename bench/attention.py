"""`driftgate bench attention`: prompt attention, the CPU prefill kernel against torch SDPA.

One layer of causal self-attention over `--prompts` fresh prompts of each length in
`--prompt-lens` (one call, as a prefill step batches them), on the model's head shape (query
heads, KV heads, head dim from config.json). Contenders, interleaved run by run so the machine's
noise lands on both:

- `c-kernel`: engine/csrc/paged_prefill.c reading K/V in place from a paged cache whose blocks
  are scattered, as the engine's are;
- `sdpa`: torch's `scaled_dot_product_attention` on contiguous K/V, prompt by prompt (the
  engine's torch path for a fresh prompt, which skips the gather), GQA through `enable_gqa`.

Both outputs are checked against each other before timing. GFLOP/s counts the causal half of
the score and value products (4 · L² / 2 · head_dim · query heads).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.output import plot_kernels, save_result
from bench.steps import positive_ints
from engine.layers import cpu_attention
from engine.loader import read_config
from engine.models.llama import LlamaArgs


def add_attention_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="model folder (only config.json is read: the head shape)")
    parser.add_argument("--prompt-lens", type=positive_ints, default=[128, 256, 512, 1024])
    parser.add_argument("--prompts", type=int, default=1, help="prompts of each length in one call")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)


def _contenders(q, k, v, block_size: int, g: torch.Generator) -> dict:
    """name → a call computing one layer's prompt attention for n prompts: q [n, L, H, D] over k/v [n, L, KV, D]."""
    prompts, length, _, head_dim = q.shape
    blocks_each = -(-length // block_size)
    order = torch.randperm(prompts * blocks_each, generator=g).to(torch.int32)  # scattered blocks
    tables = order.reshape(prompts, blocks_each)
    slots = (tables.long().repeat_interleave(block_size, dim=1) * block_size
             + torch.arange(block_size).repeat(blocks_each))[:, :length].reshape(-1)
    k_cache, v_cache = (torch.zeros(prompts * blocks_each * block_size, *k.shape[2:]) for _ in range(2))
    k_cache[slots], v_cache[slots] = k.flatten(0, 1), v.flatten(0, 1)
    query_start = torch.arange(prompts + 1, dtype=torch.int32) * length
    context_lens = torch.full((prompts,), length, dtype=torch.int32)
    scale, one, rows = head_dim**-0.5, torch.tensor(1.0), q.flatten(0, 1)

    heads_first = [tuple(x[i].transpose(0, 1).unsqueeze(0) for x in (q, k, v)) for i in range(prompts)]

    def sdpa():
        return torch.cat([F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
                          .squeeze(0).transpose(0, 1) for qi, ki, vi in heads_first])

    return {
        "c-kernel": lambda: cpu_attention.paged_prefill_attention(rows, k_cache, v_cache, tables, query_start,
                                                                  context_lens, block_size, scale, one, one),
        "sdpa": sdpa,
    }


def run_attention(args: argparse.Namespace) -> int:
    if not cpu_attention.available(torch.float32, torch.device("cpu"), "prefill"):
        raise SystemExit("the C prefill kernel is not available here (no C compiler, or DRIFTGATE_CPU_KERNELS=0)")
    model_args = LlamaArgs.from_hf_config(read_config(args.model))
    heads, kv_heads, head_dim = model_args.num_heads, model_args.num_kv_heads, model_args.head_dim
    g = torch.Generator().manual_seed(0)
    rows = []
    for length in args.prompt_lens:
        q = torch.randn(args.prompts, length, heads, head_dim, generator=g)
        k, v = (torch.randn(args.prompts, length, kv_heads, head_dim, generator=g) for _ in range(2))
        contenders = _contenders(q, k, v, args.block_size, g)
        outputs = [call() for call in contenders.values()]
        torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
        samples: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.runs):
            for name, call in contenders.items():
                t0 = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - t0)
        flops = 4 * length * length / 2 * head_dim * heads * args.prompts
        for name, runs in samples.items():
            ms = statistics.median(runs) * 1e3
            rows.append({"prompt_len": length, "kernel": name, "ms": ms, "gflop_s": flops / ms / 1e6, "runs": runs})
            print(f"prompt {length:5d} {name:8s} {ms:7.3f} ms ({rows[-1]['gflop_s']:5.0f} GFLOP/s)", flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "runs": args.runs,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "model": str(args.model), "prompts": args.prompts, "num_heads": heads, "num_kv_heads": kv_heads,
              "head_dim": head_dim, "block_size": args.block_size, "rows": rows}
    save_result(result, args.result_json, args.plot, _plot)
    return 0


def _plot(result: dict, path: Path) -> None:
    plot_kernels(result["rows"], "prompt_len", lambda r: r["gflop_s"], path, xlabel="prompt tokens",
                 ylabel="GFLOP/s (causal)",
                 title=f"prompt attention, one layer, {result['prompts']} prompt(s) a call: "
                       f"{result['num_heads']} query / {result['num_kv_heads']} KV heads of {result['head_dim']}, "
                       f"{result['threads']} threads")
