"""GPU benchmarks of the CUDA backends: decode against the HBM roofline, FP8 and INT4 weights,
prefill GEMMs, FP8 KV capacity and long-context latency, the KV-cache write.

Models are random weights in Llama-3-8B's real shapes (and Llama-3-70B's layer shapes for the
GEMMs), generated on the device: speed does not depend on the values, and the GPU machine has
no hub access. Decode runs through the engine's own runner (Triton attention, CUDA graphs,
greedy sampling with its one host sync per step), one batch of sequences at a fixed context.
Times are medians; ceilings (copy bandwidth, bf16 matmul rate) are measured in the same run.

    python -m bench.gpu --out bench/results/h200-DATE.json      (bench/gpu_check.sh runs it)
    python -m bench.gpu --tiny --device cpu --out /tmp/x.json   (a smoke run of the harness)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.layers.attention import KVCache, _store
from engine.models.llama import LlamaArgs, LlamaForCausalLM
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.sequence import Request
from quant.checkpoint import quantize_weight
from quant.config import QuantizationConfig
from quant.linear import QuantLinearBase, make_quantized_linear
from quant.schemes import preset

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
}
LLAMA3_70B_LAYER = {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                    "num_key_value_heads": 8}
TINY = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
WEIGHTS = {"bf16": None, "fp8": "fp8-dynamic", "int4": "w4a16"}  # name → quant preset
PAGE = 16


def median_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn() in ms, synchronizing around each call (events would hide host work)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def ceilings(device: str, tiny: bool) -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate."""
    n = (1 << 20) if tiny else (1 << 30)  # 2 GiB of bf16 per buffer on a GPU
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    size = 256 if tiny else 8192
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    mm_ms = median_ms(lambda: a @ b)
    return {"copy_GBps": 2 * src.nbytes / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * size**3 / mm_ms / 1e9}


def random_model(hf_config: dict, weights: str, device: str) -> LlamaForCausalLM:
    """A bf16 Llama with N(0, 0.02) weights, quantized by the `weights` preset as a checkpoint would be."""
    scheme = preset(WEIGHTS[weights]) if WEIGHTS[weights] else None
    quant_config = QuantizationConfig.for_scheme(scheme) if scheme else None
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaArgs.from_hf_config(hf_config), quant_config, torch.bfloat16)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
        if hasattr(module, "load_shard"):
            for i, rows in enumerate(module.output_sizes):
                w = torch.randn(rows, module.input_size, generator=g, device=device, dtype=torch.bfloat16) * 0.02
                module.load_shard(i, quantize_weight(w, module.scheme) if isinstance(module, QuantLinearBase)
                                  else {"weight": w})
            module.finalize()
    model.model.embed_tokens.weight.normal_(0, 0.02, generator=g)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
    return model


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes one decode step must read: every Linear's weights as its kernel holds them (plus scales)."""
    total = 0
    for module in model.modules():
        if not hasattr(module, "load_shard"):
            continue
        names = {"linear": ("weight",), "dense": ("weight_dense",), "scaled_mm": ("weight", "scale_b"),
                 "int4pack_cuda": ("kernel_weight", "kernel_scales")}[module.kernel]
        total += sum(getattr(module, n).nbytes for n in names)
    return total


def decode(model: LlamaForCausalLM, batch: int, context: int, kv_dtype: torch.dtype, steps: int = 30,
           graphs: bool = True, drafts: int = 0) -> dict:
    """Median decode step (ms) of `batch` sequences at `context` tokens, and output tokens/s.

    With `drafts`, each sequence also verifies that many draft tokens a step (speculative
    decoding's query rows; random weights reject them, so tokens/s counts one a sequence)."""
    from engine.cuda_graphs import DecodeGraphs

    args = model.args
    rows = batch * (1 + drafts)
    blocks_per_seq = -(-(context + 1 + drafts) // PAGE)
    slots = batch * blocks_per_seq * PAGE
    device = next(model.parameters()).device
    cache = KVCache(args.num_layers, slots + 1, args.num_kv_heads, args.head_dim, kv_dtype, device)
    for layer in cache.k + cache.v:  # random values: never time on zeros
        layer.copy_(torch.randn(layer.shape, device=device).to(kv_dtype))
    runner = ModelRunner(model, cache, PAGE)
    if graphs and device.type == "cuda":
        runner.graphs = DecodeGraphs(model, cache, PAGE, rows, blocks_per_seq * PAGE, pad_slot=slots)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    chunks = []
    for i in range(batch):
        request = Request(f"r{i}", [(7 * i + t) % 500 for t in range(context + 1)], greedy)
        request.block_ids = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        # the same position each step
        chunks.append(ScheduledChunk(request, context, 1 + drafts, [3 + t for t in range(drafts)]))
    step_ms = median_ms(lambda: runner.execute(SchedulerOutput(chunks)), reps=steps)
    result = {"batch": batch, "context": context, "kv_dtype": str(kv_dtype).removeprefix("torch."),
              "drafts": drafts, "step_ms": step_ms, "tokens_per_s": batch * 1e3 / step_ms,
              "kv_cache_bytes": 2 * sum(t.nbytes for t in cache.k)}
    if runner.graphs is not None:  # the model's GPU time alone; the rest of a step is host work + lm_head
        graph, _ = runner.graphs.graphs[runner.graphs.padded_size(rows)]
        result["graph_replay_ms"] = median_ms(graph.replay, reps=steps)
    return result


def gemm(out_features: int, in_features: int, tokens: int, device: str) -> dict:
    """Prefill GEMM TFLOP/s: bf16, raw FP8 _scaled_mm, and the FP8 Linear (its activation quantization included)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, in_features, generator=g, device=device, dtype=torch.bfloat16)
    w = torch.randn(out_features, in_features, generator=g, device=device, dtype=torch.bfloat16) * 0.02
    flops = 2 * tokens * in_features * out_features
    result = {"out": out_features, "in": in_features, "tokens": tokens,
              "bf16_TFLOPs": flops / median_ms(lambda: F.linear(x, w)) / 1e9}
    if device != "cuda":
        return result
    from quant import triton_fp8

    scheme = preset("fp8-dynamic")
    with torch.device(device):  # finalize builds the kernel for the module's device
        module = make_quantized_linear(scheme, in_features, [out_features], bias=False, dtype=torch.bfloat16)
    module.load_shard(0, quantize_weight(w, scheme))
    module.finalize()
    x8, sx = triton_fp8.quantize_per_token(x)

    def raw() -> torch.Tensor:  # the GEMM alone, activations quantized beforehand
        return torch._scaled_mm(x8, module.weight.t(), scale_a=sx, scale_b=module.scale_b, out_dtype=torch.bfloat16)

    result["fp8_scaled_mm_TFLOPs"] = flops / median_ms(raw) / 1e9
    result["fp8_linear_TFLOPs"] = flops / median_ms(lambda: module(x)) / 1e9
    result["fp8_linear_vs_bf16"] = result["fp8_linear_TFLOPs"] / result["bf16_TFLOPs"]
    return result


def sweep(device: str) -> dict:
    """Tile choices of the decode kernels, timed alone: the FP8 GEMV beside bf16 F.linear and
    cuBLASLt's FP8 (GB/s of weight read), and paged attention at 32k context (GB/s of KV read)."""
    from engine.layers import triton_attention
    from quant import triton_fp8
    from quant.fp8 import quantize_fp8

    result = {"gemv": [], "attention": []}
    for n, k in ((4096, 14336), (28672, 4096)):
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        w8, ws = quantize_fp8(w, torch.ones(n, 1, device=device)), torch.ones(1, n, device=device)
        for rows in (1, 8):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            x8, xs = triton_fp8.quantize_per_token(x)
            timed = {"bf16 F.linear": (w.nbytes, partial(F.linear, x, w)),
                     "cublas fp8": (w8.nbytes, partial(torch._scaled_mm, x8, w8.t(), scale_a=xs, scale_b=ws,
                                                       out_dtype=torch.bfloat16))}
            variants = [(8, 512, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 8, 3)] if rows == 1 else []
            for bn, bk, warps, stages in variants:
                timed[f"gemv bn{bn} bk{bk} w{warps} s{stages}"] = (w8.nbytes, partial(
                    triton_fp8.scaled_gemv, x8, xs, w8, ws, block_n=bn, block_k=bk,
                    num_warps=warps, num_stages=stages))
            for name, (nbytes, fn) in timed.items():
                result["gemv"].append({"n": n, "k": k, "rows": rows, "kernel": name,
                                       "GBps": nbytes / median_ms(fn) / 1e6})
    args = LlamaArgs.from_hf_config(LLAMA3_8B)
    context, heads, kv_heads, dim = 32768, args.num_heads, args.num_kv_heads, args.head_dim
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for batch in (1, 8):
        blocks = batch * context // PAGE
        tables = torch.randperm(blocks, device=device, dtype=torch.int32).view(batch, -1)
        q = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)
        starts = torch.arange(batch + 1, device=device, dtype=torch.int32)
        lens = torch.full((batch,), context, device=device, dtype=torch.int32)
        one = torch.ones((), device=device)
        splits = triton_attention.decode_splits(batch, kv_heads, sms)
        for dtype, f16 in ((torch.bfloat16, False), (torch.float8_e4m3fn, False), (torch.float8_e4m3fn, True)):
            k_cache, v_cache = (torch.randn(blocks * PAGE, kv_heads, dim, device=device).to(dtype) for _ in range(2))
            for bn, warps in ((32, 4), (64, 4), (64, 8), (128, 8)):
                ms = median_ms(partial(triton_attention.paged_attention, q, k_cache, v_cache, tables, starts,
                                       lens, 1, PAGE, dim**-0.5, one, one, splits, block_n=bn, num_warps=warps,
                                       fp8_dot_f16=f16))
                result["attention"].append({"batch": batch, "kv_dtype": str(dtype).removeprefix("torch."),
                                            "fp8_dot_f16": f16, "splits": splits, "block_n": bn, "warps": warps,
                                            "ms": ms, "GBps": 2 * k_cache.nbytes / ms / 1e6})
    return result


def kv_capacity(args: LlamaArgs, budget_bytes: int, context: int) -> dict:
    """Sequences of `context` tokens that fit `budget_bytes` of KV cache, bf16 vs fp8."""
    fits = {}
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        per_block = KVCache.bytes_per_slot(args.num_layers, args.num_kv_heads, args.head_dim, dtype) * PAGE
        fits[str(dtype).removeprefix("torch.")] = (budget_bytes // per_block) // -(-context // PAGE)
    return {"budget_bytes": budget_bytes, "context": context, "sequences": fits}


def _torch_store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, scale: torch.Tensor) -> None:
    _store(k_cache, slots, k, scale)
    _store(v_cache, slots, v, scale)


def kv_store(args: LlamaArgs, device: str, layers: int = 32) -> list[dict]:
    """One decode step's K/V writes, `layers` of them captured in a CUDA graph as the step is:
    torch's (attention._store for K and for V) against the fused Triton kernel, µs a layer."""
    from engine.layers import triton_fused

    def graph_us(fn) -> float:
        fn()  # compiles the Triton kernel before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(layers):
                fn()
        return median_ms(graph.replay) * 1e3 / layers

    heads, kv_heads, dim, num_slots = args.num_heads, args.num_kv_heads, args.head_dim, 4096
    rows = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        k_cache, v_cache = (torch.zeros(num_slots, kv_heads, dim, device=device, dtype=dtype) for _ in range(2))
        for tokens in (1, 8):
            qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=device, dtype=torch.bfloat16)
            k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
            v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
            slots, scale = torch.randperm(num_slots, device=device)[:tokens], torch.tensor(0.02, device=device)
            rows.append({"kv_dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                         "torch_us": graph_us(partial(_torch_store_kv, k_cache, v_cache, slots, k, v, scale)),
                         "fused_us": graph_us(partial(triton_fused.store_kv, k_cache, v_cache, slots, k, v, scale,
                                                      scale))})
    return rows


def _decode_section(report: dict, config: dict, weights: str, device: str, tiny: bool) -> None:
    """Decode at batch 1 and 8 against the roofline; with bf16 weights also eager and FP8 KV runs."""
    model = random_model(config, weights, device)
    step_bytes = weight_bytes(model)
    for batch in (1, 8):
        row = {"weights": weights, "weight_bytes": step_bytes, **decode(model, batch, 512, torch.bfloat16)}
        row["roofline_tokens_per_s"] = batch * report["ceilings"]["copy_GBps"] * 1e9 / step_bytes
        row["fraction_of_roofline"] = row["tokens_per_s"] / row["roofline_tokens_per_s"]
        report["decode"].append(row)
    if weights != "bf16":
        return
    report["decode_bf16_eager_batch1"] = decode(model, 1, 512, torch.bfloat16, graphs=False)
    # what speculative decoding's drafts cost a lone sequence: the step with 2 and 4 draft rows
    report["spec_verify_batch1"] = [decode(model, 1, 512, torch.bfloat16, drafts=d) for d in (2, 4)]
    long_context = 1024 if tiny else 32768
    budget = 4 << 20 if tiny else 32 << 30  # 32 GiB: 8 sequences of 32k tokens in bf16
    capacity = kv_capacity(model.args, budget, long_context)
    report["fp8_kv"] = {"capacity": capacity, "long_context": []}
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for batch in (1, capacity["sequences"]["bfloat16"]):
            report["fp8_kv"]["long_context"].append(decode(model, batch, long_context, dtype, steps=15))
    # twice the sequences in the same bytes, all decoding at once
    report["fp8_kv"]["full_fp8_cache"] = decode(model, capacity["sequences"]["float8_e4m3fn"], long_context,
                                                torch.float8_e4m3fn, steps=10)


def _gemm_section(report: dict, config: dict, device: str, tiny: bool) -> None:
    tokens = 256 if tiny else 8192
    for name, c in {"8b": config, "70b": {**config, **LLAMA3_70B_LAYER}}.items():
        h, inter = c["hidden_size"], c["intermediate_size"]
        kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
        for layer, (n, k) in {"qkv": (h + 2 * kv, h), "o": (h, h), "gate_up": (2 * inter, h),
                              "down": (h, inter)}.items():
            report["prefill_gemm"].append({"model": name, "layer": layer, **gemm(n, k, tokens, device)})


def run(device: str, tiny: bool) -> dict:
    """Every section; one that fails records its error and the rest still run (one GPU lease, one try)."""
    config = TINY if tiny else LLAMA3_8B
    report = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device == "cuda" else device,
              "model": "tiny" if tiny else "llama-3-8b shapes", "decode": [], "prefill_gemm": [], "errors": {}}
    report["ceilings"] = ceilings(device, tiny)
    sections = {f"decode {w}": (lambda w=w: _decode_section(report, config, w, device, tiny))
                for w in WEIGHTS if w == "bf16" or device == "cuda"}  # FP8/INT4 kernels are CUDA's
    sections["prefill gemm"] = lambda: _gemm_section(report, config, device, tiny)
    if device == "cuda":
        sections["kv store"] = lambda: report.__setitem__("kv_store", kv_store(LlamaArgs.from_hf_config(config), device))
    for name, section in sections.items():
        print(f"{name} ...", flush=True)
        try:
            section()
        except Exception as e:  # noqa: BLE001 - recorded in the report, which says what failed
            report["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
            print(report["errors"][name], flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    base = {r["batch"]: r["tokens_per_s"] for r in report["decode"] if r["weights"] == "bf16"}
    for r in report["decode"]:
        r["speedup_vs_bf16"] = r["tokens_per_s"] / base[r["batch"]] if r["batch"] in base else None
    return report


def summary(report: dict) -> str:
    lines = [f"{report['device']}  copy {report['ceilings']['copy_GBps']:.0f} GB/s  "
             f"bf16 mm {report['ceilings']['bf16_matmul_TFLOPs']:.0f} TFLOP/s"]
    for r in report["decode"]:
        lines.append(f"decode {r['weights']:5s} b{r['batch']}: {r['tokens_per_s']:8.1f} tok/s  "
                     f"{r['fraction_of_roofline']:.0%} of roofline  {r['speedup_vs_bf16'] or 0:.2f}x bf16  "
                     f"step {r['step_ms']:.2f} ms, graph {r.get('graph_replay_ms', 0):.2f} ms")
    if "decode_bf16_eager_batch1" in report:
        lines.append(f"decode bf16 b1 eager (no graphs): {report['decode_bf16_eager_batch1']['tokens_per_s']:.1f} tok/s")
    for row in report.get("spec_verify_batch1", []):
        lines.append(f"decode bf16 b1 with {row['drafts']} draft rows: step {row['step_ms']:.2f} ms")
    kv = report.get("fp8_kv", {"long_context": [], "capacity": {"sequences": {}}})
    for r in kv["long_context"]:
        lines.append(f"ctx {r['context']} b{r['batch']} kv {r['kv_dtype']:14s}: {r['step_ms']:.2f} ms/step")
    lines.append(f"kv capacity {kv['capacity']['sequences']}")
    if "full_fp8_cache" in kv:
        r = kv["full_fp8_cache"]
        lines.append(f"full fp8 cache: b{r['batch']} ctx {r['context']}: {r['step_ms']:.2f} ms/step")
    for r in report["prefill_gemm"]:
        fp8 = f"  fp8 linear {r['fp8_linear_TFLOPs']:.0f} ({r['fp8_linear_vs_bf16']:.2f}x), raw " \
              f"{r['fp8_scaled_mm_TFLOPs']:.0f}" if "fp8_linear_TFLOPs" in r else ""
        lines.append(f"gemm {r['model']} {r['layer']:7s} bf16 {r['bf16_TFLOPs']:.0f}{fp8}")
    for r in report.get("kv_store", []):
        lines.append(f"kv store {r['kv_dtype']:14s} {r['tokens']} tokens: torch {r['torch_us']:.1f} us/layer, "
                     f"fused {r['fused_us']:.1f}")
    lines += [f"ERROR in {name}: {err.splitlines()[0]}" for name, err in report["errors"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run of the harness")
    parser.add_argument("--sweep", action="store_true",
                        help="instead: time tile choices of the decode kernels")
    args = parser.parse_args(argv)
    if args.sweep:
        result = sweep(args.device)
        args.out.write_text(json.dumps(result, indent=2))
        for row in result["gemv"] + result["attention"]:
            print(row)
        return
    report = run(args.device, args.tiny)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(summary(report))


if __name__ == "__main__":
    main()
