"""`driftgate bench matmul`: the engine's CPU matmul kernel against oneDNN and F.linear.

Every Linear of the model (its real shapes, one weight per layer so the working set is the
model's and the caches are cold, as in a decode step) is multiplied by an activation of R rows,
for each R in `--rows`, then the tied/untied lm_head on its own. Contenders, interleaved run by
run so the machine's noise lands on all of them:

- `panel`:  engine/csrc/panel_matmul.c on 16-column weight panels (what the engine serves with:
            the weights are bf16 values, as in a BF16 checkpoint, so the panels hold bf16);
- `panel-f32`: the same kernel on float32 panels (what a checkpoint with fp32 weights gets);
- `onednn`: torch's oneDNN linear on its blocked prepacked weight (the engine's previous layout);
- `linear`: `F.linear` on the plain row-major weight.

Each contender's output is checked against `F.linear` before it is timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.output import plot_kernels, save_result
from bench.steps import positive_ints
from engine.layers import panel_matmul
from engine.models.llama import LlamaArgs

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def add_matmul_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="model folder (only config.json is read: the shapes)")
    parser.add_argument("--rows", type=positive_ints, default=[1, 2, 4, 8, 16, 32, 64, 256])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)


def layer_shapes(args: LlamaArgs) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's fused Linears: qkv, o, gate_up, down."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    return [(q + 2 * kv, args.hidden_size), (args.hidden_size, q),
            (2 * args.intermediate_size, args.hidden_size), (args.hidden_size, args.intermediate_size)]


def _contenders() -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Matmul]]:
    """name → (weight layout, matmul on that layout)."""
    out: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Matmul]] = {}
    if panel_matmul.pack(torch.zeros(panel_matmul.PANEL, 1)) is not None:
        out["panel"] = (panel_matmul.pack, panel_matmul.matmul)
        out["panel-f32"] = (lambda w: panel_matmul.pack(w, narrow=False), panel_matmul.matmul)
    if torch.backends.mkldnn.is_available():
        out["onednn"] = (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 32),
                         lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    out["linear"] = (lambda w: w, F.linear)
    return out


def run_matmul(args: argparse.Namespace) -> int:
    model_args = LlamaArgs.from_hf_config(json.loads((args.model / "config.json").read_text()))
    shapes = layer_shapes(model_args) * model_args.num_layers
    lm_head = (model_args.vocab_size, model_args.hidden_size)
    g = torch.Generator().manual_seed(0)
    plain = [(torch.randn(n, k, generator=g) * 0.05).bfloat16().float() for n, k in [*shapes, lm_head]]
    contenders = _contenders()
    weights = {name: [layout(w) for w in plain] for name, (layout, _) in contenders.items()}
    layer_bytes = {name: sum(w.numel() * w.element_size() for w in ws[:-1]) for name, ws in weights.items()}
    rows_out = []
    for rows in args.rows:
        x = {k: torch.randn(rows, k, generator=g) for k in {k for _, k in [*shapes, lm_head]}}
        for name, (_, matmul) in contenders.items():  # every layout computes the same product
            for w, w_plain in zip(weights[name][:4], plain[:4], strict=True):
                torch.testing.assert_close(matmul(x[w_plain.shape[1]], w), F.linear(x[w_plain.shape[1]], w_plain),
                                           rtol=1e-4, atol=1e-4)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
        for _ in range(args.runs):
            for name, (_, matmul) in contenders.items():
                t0 = time.perf_counter()
                for w, (_, k) in zip(weights[name][:-1], shapes, strict=True):
                    matmul(x[k], w)
                t1 = time.perf_counter()
                matmul(x[lm_head[1]], weights[name][-1])
                samples[name].append((t1 - t0, time.perf_counter() - t1))
        for name, runs in samples.items():
            layers_s = statistics.median(r[0] for r in runs)
            rows_out.append({"rows": rows, "kernel": name, "layers_ms": layers_s * 1e3,
                             "lm_head_ms": statistics.median(r[1] for r in runs) * 1e3,
                             "layers_gb_s": layer_bytes[name] / layers_s / 1e9, "runs": runs})
            print(f"rows {rows:4d} {name:7s} layers {layers_s * 1e3:7.2f} ms ({rows_out[-1]['layers_gb_s']:5.1f} GB/s)"
                  f"  lm_head {rows_out[-1]['lm_head_ms']:6.2f} ms", flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "runs": args.runs,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "model": str(args.model), "num_layers": model_args.num_layers, "layer_shapes": layer_shapes(model_args),
              "lm_head": lm_head, "rows": rows_out}
    save_result(result, args.result_json, args.plot, _plot)
    return 0


def _plot(result: dict, path: Path) -> None:
    plot_kernels(result["rows"], "rows", lambda r: r["layers_ms"] + r["lm_head_ms"], path, log_y=True,
                 xlabel="activation rows (decode batch / prefill chunk)", ylabel="ms per forward (all Linears + lm_head)",
                 title=f"fp32 matmuls, {result['num_layers']} layers, {result['threads']} threads")
