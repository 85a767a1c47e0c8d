"""`driftgate bench schemes`: every quantization scheme side by side, llama.cpp in the same run.

For each checkpoint: batch-1 decode tokens/s after a `--prompt-len` prompt, output tokens/s with
`--concurrency` requests of that shape submitted at once, and the checkpoint's size on disk.
llama.cpp's `llama-bench` runs on its GGUFs between our runs (decode at the same context depth),
so machine noise hits every side alike; medians of `--runs` repetitions.

A checkpoint is `NAME=DIR` or `NAME=DIR@DTYPE`: the int4/int8 weight-only kernels need bf16
activations on CPU (`w4a16=ckpt@bfloat16`); other schemes run fp32 activations here.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.datasets import find_data_dir
from bench.offline import fixed_length_prompt, ours_batch1, ours_throughput
from bench.output import medians, save_result
from engine import LLM


@dataclass(frozen=True)
class Checkpoint:
    name: str
    path: Path
    dtype: str = "auto"

    @classmethod
    def parse(cls, spec: str) -> Checkpoint:
        name, sep, rest = spec.partition("=")
        if not sep or not name or not rest:
            raise argparse.ArgumentTypeError(f"expected NAME=DIR[@DTYPE], got {spec!r}")
        path, _, dtype = rest.partition("@")
        if not Path(path).is_dir():
            raise argparse.ArgumentTypeError(f"{name}: checkpoint folder not found: {path}")
        return cls(name, Path(path), dtype or "auto")


def size_on_disk(folder: Path) -> int:
    """Bytes of the weight files (what a deployment ships and loads)."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def resident_weight_bytes(llm: LLM) -> int:
    """Bytes of the model's tensors as the engine holds them after load (parameters, buffers and
    tensors its modules keep as plain attributes, such as the tied lm_head's panels, in their
    kernels' layouts, anything kept beside them included, shared ones once; no KV cache)."""
    model = llm.engine.model
    attributes = (t for m in model.modules() for t in vars(m).values() if isinstance(t, torch.Tensor))
    tensors = {t.data_ptr(): t.numel() * t.element_size()
               for t in itertools.chain(model.parameters(), model.buffers(), attributes)}
    return sum(tensors.values())


def add_schemes_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", nargs="+", type=Checkpoint.parse, metavar="NAME=DIR[@DTYPE]")
    parser.add_argument("--llama-cpp", default="Q8_0,Q4_1",
                        help="comma-separated GGUF quantizations to run with llama-bench ('' skips llama.cpp)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's thread count")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)


def _measure(llm: LLM, prompt: list[int], args: argparse.Namespace) -> dict[str, float]:
    batch1 = ours_batch1(llm, prompt, args.output_len)
    tput = ours_throughput(llm, [prompt] * args.concurrency, [args.output_len] * args.concurrency)
    return {"batch1_decode_tok_s": batch1["decode_tok_s"], "ttft_s": batch1["ttft_s"],
            "concurrent_output_tok_s": tput["output_tok_s"]}


def _llama_cpp_runs(quants: list[str], args: argparse.Namespace, threads: int) -> dict[str, dict]:
    from bench.llama_cpp import find_gguf, run_llama_bench

    out = {}
    for quant in quants:
        gguf = find_gguf(quant)
        # decode measured after a prompt of the same length as ours (-d: context depth)
        result = run_llama_bench(gguf, prompt_len=args.prompt_len, gen_len=args.output_len, threads=threads,
                                 reps=1, extra_args=["-d", str(args.prompt_len)])
        out[quant] = {"batch1_decode_tok_s": result["gen_tok_s"], "prompt_tok_s": result["prompt_tok_s"],
                      "size_bytes": gguf.stat().st_size, "command": result["command"]}
    return out


def run_schemes(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    quants = [q for q in args.llama_cpp.split(",") if q]
    data_dir = find_data_dir(args.data_dir)
    engines = {}
    for ckpt in args.checkpoints:
        # prefix caching off: the concurrent requests share one prompt and must each prefill it
        engines[ckpt.name] = LLM(str(ckpt.path), dtype=ckpt.dtype, max_num_seqs=max(args.concurrency, 1),
                                 enable_prefix_caching=False)
    prompt = fixed_length_prompt(next(iter(engines.values())).tokenizer, data_dir, args.prompt_len)
    for llm in engines.values():
        ours_batch1(llm, prompt[:32], 4)  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name in [*engines, *(f"llama.cpp {q}" for q in quants)]}
    for i in range(args.runs):  # interleaved: noise hits every side alike
        for name, llm in engines.items():
            runs[name].append(_measure(llm, prompt, args))
            print(f"run {i + 1}/{args.runs} {name}: {runs[name][-1]}", flush=True)
        for quant, row in _llama_cpp_runs(quants, args, threads).items():
            runs[f"llama.cpp {quant}"].append(row)
            print(f"run {i + 1}/{args.runs} llama.cpp {quant}: {row['batch1_decode_tok_s']:.1f} tok/s", flush=True)
    rows = []
    for ckpt in args.checkpoints:
        rows.append({"name": ckpt.name, "engine": "driftgate", "path": str(ckpt.path),
                     "dtype": str(engines[ckpt.name].engine.model.dtype),
                     "size_bytes": size_on_disk(ckpt.path), "resident_weight_bytes": resident_weight_bytes(engines[ckpt.name]),
                     **medians(runs[ckpt.name]), "runs": runs[ckpt.name]})
    for quant in quants:
        r = runs[f"llama.cpp {quant}"]
        rows.append({"name": f"llama.cpp {quant}", "engine": "llama.cpp", "size_bytes": r[0]["size_bytes"],
                     "command": r[0]["command"], **medians([{k: v for k, v in x.items() if isinstance(v, float)}
                                                             for x in r]), "runs": r})
    result = {"date": time.strftime("%Y-%m-%d"), "threads": threads, "runs": args.runs,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "concurrency": args.concurrency,
              "rows": rows}
    _print(result)
    save_result(result, args.result_json, args.plot, _plot)
    return 0


def _print(result: dict) -> None:
    print(f"\n{'':24s} {'size MB':>8s} {'held MB':>8s} {'b1 tok/s':>9s} "
          f"{'c' + str(result['concurrency']) + ' tok/s':>10s}")
    for row in result["rows"]:
        conc, held = row.get("concurrent_output_tok_s"), row.get("resident_weight_bytes")
        print(f"{row['name']:24s} {row['size_bytes'] / 1e6:8.0f} {'' if held is None else f'{held / 1e6:8.0f}':>8s} "
              f"{row['batch1_decode_tok_s']:9.1f} {'' if conc is None else f'{conc:10.1f}'}")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["name"] for r in rows]
    colors = ["tab:blue" if r["engine"] == "driftgate" else "tab:gray" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    axes[0].barh(names, [r["batch1_decode_tok_s"] for r in rows], color=colors)
    axes[0].set_title(f"batch-1 decode tok/s ({result['prompt_len']}-token context)")
    ours = [r for r in rows if "concurrent_output_tok_s" in r]
    axes[1].barh([r["name"] for r in ours], [r["concurrent_output_tok_s"] for r in ours], color="tab:blue")
    axes[1].set_title(f"output tok/s, {result['concurrency']} concurrent")
    fig.suptitle(f"quantization schemes on CPU, {result['threads']} threads, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
