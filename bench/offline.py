"""`driftgate bench offline`: engine throughput and batch-1 latency, HF transformers side by side.

Three measurements on one model, in one run (this machine is shared and noisy, so every
number is a median of `--runs` repetitions and the headline figures are ratios to HF measured
in the same process):

1. batch 1: TTFT for a `--prompt-len`-token prompt and decode tokens/s over `--output-len` tokens;
2. offline throughput: `--num-requests` ShareGPT prompts (output lengths drawn as in
   `bench serve`), or with `--dataset random` random prompts of `--prompt-len` tokens each
   generating `--output-len`, submitted at once, input and output tokens/s;
3. KV-cache utilization per block size on the same length mix: tokens stored ÷ slots allocated.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from bench.datasets import find_data_dir, random_prompts, sharegpt
from bench.output import medians, save_result
from engine import LLM, LoRARequest, SamplingParams
from engine.config import KV_CACHE_DTYPES
from engine.layers import panel_matmul
from engine.layers.linear import matmul_kernels


def add_offline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--dataset", choices=("sharegpt", "random"), default="sharegpt",
                        help="the throughput requests: ShareGPT prompts, or random ones of --prompt-len / --output-len")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3, help="repetitions per measurement (medians reported)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--lora", default=None, nargs="+", metavar="ADAPTER_DIR",
                        help="requests through these PEFT LoRA adapters: batch 1 and the HF side (PEFT's unmerged "
                             "model) through the first, the throughput requests cycling through all")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)


def fixed_length_prompt(tokenizer, data_dir: Path, num_tokens: int) -> list[int]:
    """Real text (ShareGPT prompts concatenated) cut to exactly `num_tokens` tokens."""
    records = json.loads((data_dir / "sharegpt" / "ShareGPT_V3_filtered_1000.json").read_text())
    ids: list[int] = []
    for record in records:
        ids += tokenizer.encode(record["conversations"][0]["value"] + "\n\n", add_special_tokens=False)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise ValueError("not enough ShareGPT text for the requested prompt length")


def _cold_prefix_cache(llm: LLM) -> None:
    """Runs repeat the same prompts: a warm prefix cache would skip their prefill and flatter us."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("prefix cache still in use before a measured run")


def ours_batch1(llm: LLM, prompt: list[int], output_len: int) -> dict[str, float]:
    """TTFT = the prefill step (prefix cache empty); decode = the remaining steps, one token each."""
    _cold_prefix_cache(llm)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request("b1", prompt, params)
    t0 = time.perf_counter()
    engine.step()
    t1 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    t2 = time.perf_counter()
    return {"ttft_s": t1 - t0, "decode_tok_s": (output_len - 1) / (t2 - t1)}


def hf_batch1(model, prompt: list[int], output_len: int) -> dict[str, float]:
    ids = torch.tensor([prompt])
    kwargs = {"do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        t2 = time.perf_counter()
    ttft = t1 - t0
    return {"ttft_s": ttft, "decode_tok_s": (output_len - 1) / ((t2 - t1) - ttft)}


def ours_throughput(llm: LLM, prompts: list[str], output_lens: list[int],
                    loras: list[LoRARequest] | None = None) -> dict[str, float]:
    """Output tokens per second over the batch; with ``loras``, request i through loras[i % len]."""
    _cold_prefix_cache(llm)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    per_request = None if not loras else [loras[i % len(loras)] for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_request)
    elapsed = time.perf_counter() - t0
    num_in = sum(len(o.prompt_token_ids) for o in outs)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": elapsed, "input_tok_s": num_in / elapsed, "output_tok_s": num_out / elapsed,
            "total_tok_s": (num_in + num_out) / elapsed}


def kv_utilization(lengths: list[int], block_sizes=(8, 16, 32)) -> dict[int, float]:
    """Fraction of allocated KV slots that hold a token when each sequence rounds up to whole blocks."""
    return {bs: sum(lengths) / sum(-(-n // bs) * bs for n in lengths) for bs in block_sizes}


def run_offline(args: argparse.Namespace) -> int:
    data_dir = find_data_dir(args.data_dir)
    loras = [LoRARequest(f"bench{i}", i + 1, path) for i, path in enumerate(args.lora or [])]
    adapter = {} if not loras else {"lora_modules": {r.lora_name: r.lora_path for r in loras},
                                    "default_lora": loras[0].lora_name}
    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, **adapter)
    tokenizer = llm.tokenizer
    prompt = fixed_length_prompt(tokenizer, data_dir, args.prompt_len)
    rng = np.random.default_rng(args.seed)
    if args.dataset == "random":
        samples = random_prompts(tokenizer, args.num_requests, args.prompt_len, args.output_len, rng)
    else:
        samples = sharegpt(tokenizer, data_dir, args.num_requests, args.output_len, False, rng)
    prompts, output_lens = [s.prompt for s in samples], [s.output_len for s in samples]

    hf_model = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=llm.engine.model.dtype)
        if args.lora is not None:
            from peft import PeftModel

            hf_model = PeftModel.from_pretrained(hf_model, args.lora[0]).eval()
    ours_runs, hf_runs, tput_runs = [], [], []
    ours_batch1(llm, prompt[:32], 4)  # warm-up: first-call allocations and kernel selection
    for _ in range(args.runs):  # interleaved so machine noise hits both sides alike
        ours_runs.append(ours_batch1(llm, prompt, args.output_len))
        if hf_model is not None:
            hf_runs.append(hf_batch1(hf_model, prompt, args.output_len))
        tput_runs.append(ours_throughput(llm, prompts, output_lens, loras))
    ours, tput = medians(ours_runs), medians(tput_runs)
    result = {
        "model": str(args.model),
        "dtype": str(llm.engine.model.dtype),
        "kv_cache_dtype": args.kv_cache_dtype,
        "lora": args.lora,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "matmul_kernels": matmul_kernels(llm.engine.model), "amx": panel_matmul.use_amx(),
        "date": time.strftime("%Y-%m-%d"),
        "runs": args.runs,
        "batch1": {"prompt_len": args.prompt_len, "output_len": args.output_len, "ours": ours, "ours_runs": ours_runs},
        "throughput": {"dataset": args.dataset, "num_requests": args.num_requests, "mean_prompt_len": float(np.mean([s.prompt_len for s in samples])),
                       "mean_output_len": float(np.mean(output_lens)), "ours": tput, "ours_runs": tput_runs},
        "kv_utilization": kv_utilization([s.prompt_len + s.output_len for s in samples]),
    }
    if hf_runs:
        hf = medians(hf_runs)
        result["batch1"]["hf"], result["batch1"]["hf_runs"] = hf, hf_runs
        result["ratios"] = {
            "batch1_decode_vs_hf": ours["decode_tok_s"] / hf["decode_tok_s"],
            "ttft_vs_hf": ours["ttft_s"] / hf["ttft_s"],
            "throughput_output_vs_hf_batch1": tput["output_tok_s"] / hf["decode_tok_s"],
        }
    _print(result)
    save_result(result, args.result_json, args.plot, _plot)
    return 0


def _print(result: dict) -> None:
    b1, tp = result["batch1"], result["throughput"]
    print(f"batch 1 ({b1['prompt_len']} in / {b1['output_len']} out): ours TTFT {b1['ours']['ttft_s'] * 1e3:.0f} ms, "
          f"decode {b1['ours']['decode_tok_s']:.1f} tok/s")
    if "hf" in b1:
        print(f"                       HF   TTFT {b1['hf']['ttft_s'] * 1e3:.0f} ms, decode {b1['hf']['decode_tok_s']:.1f} tok/s")
        r = result["ratios"]
        print(f"ratios: decode {r['batch1_decode_vs_hf']:.2f}x HF, TTFT {r['ttft_vs_hf']:.2f}x HF, "
              f"throughput {r['throughput_output_vs_hf_batch1']:.1f}x HF batch-1")
    dataset = {"sharegpt": "ShareGPT", "random": "random"}[tp["dataset"]]
    print(f"throughput ({tp['num_requests']} {dataset} requests): {tp['ours']['output_tok_s']:.1f} out tok/s, "
          f"{tp['ours']['input_tok_s']:.1f} in tok/s")
    print("KV utilization: " + ", ".join(f"block {k}: {v:.1%}" for k, v in result["kv_utilization"].items()))


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    b1 = result["batch1"]
    names = ["driftgate"] + (["HF transformers"] if "hf" in b1 else [])
    sides = [b1["ours"]] + ([b1["hf"]] if "hf" in b1 else [])
    axes[0].bar(names, [s["decode_tok_s"] for s in sides], color=["tab:blue", "tab:gray"][: len(sides)])
    axes[0].set_title("batch-1 decode (tok/s)")
    axes[1].bar(names, [s["ttft_s"] * 1e3 for s in sides], color=["tab:blue", "tab:gray"][: len(sides)])
    axes[1].set_title(f"TTFT, {b1['prompt_len']}-token prompt (ms)")
    kv = result["kv_utilization"]
    axes[2].bar([str(k) for k in kv], [v * 100 for v in kv.values()], color="tab:green")
    axes[2].set_ylim(80, 100)
    axes[2].set_title("KV slots holding tokens (%) by block size")
    fig.suptitle(f"{Path(result['model']).name} · {result['dtype']} · offline throughput "
                 f"{result['throughput']['ours']['output_tok_s']:.0f} out tok/s "
                 f"({result['throughput']['num_requests']} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
