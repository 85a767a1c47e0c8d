"""`driftgate bench matmul`: the engine's CPU matmul kernel against oneDNN and F.linear.

Every Linear of the model (its real shapes, one weight per layer so the working set is the
model's and the caches are cold, as in a decode step) is multiplied by an activation of R rows,
for each R in `--rows`, then the tied/untied lm_head on its own. Contenders, interleaved run by
run so the machine's noise lands on all of them:

- `panel`:  engine/csrc/panel_matmul.c on 16-column weight panels (what the engine serves with:
            the weights are bf16 values, as in a BF16 checkpoint, so the panels hold bf16);
- `panel-f32`: the same kernel on float32 panels (what a checkpoint with fp32 weights gets);
- `onednn`: torch's oneDNN linear on its blocked prepacked weight (the engine's previous layout);
- `linear`: `F.linear` on the plain row-major weight;
- `w8a8` (CPUs with AVX2): the weight quantized to int8 per channel, each row to int8 per token
            (engine/csrc/panel_matmul.c's W8A8 kernel: vpdpbusd with AVX-512 VNNI, else
            pmaddubsw); where the CPU has AMX, `w8a8` takes its tiles from 16 rows and
            `w8a8-vnni` keeps to vpdpbusd (the two give equal floats);
- `w4a8` / `w4a8-vnni`: the same with int4 weights in groups of 64 columns (the W4A8 kernel);
- `fbgemm`: torch's dynamic int8 linear (what `torch.ao.quantization.quantize_dynamic` gives) on
            the same int8 weight, its input quantized per tensor to 7 bits;
- `fp8` / `fp8-avx512` (CPUs with AVX-512 BF16): FP8 W8A8, e4m3 weights per channel times rows
            rounded to fp8 per token, multiplied as bf16 values on AMX-BF16 tiles (every row
            count) where the CPU has them, and kept to vdpbf16ps;
- `bf16-dot` / `bf16-dot-avx512`: bf16 weights times rows rounded to bf16 (a quantized
            checkpoint's unquantized Linears), on the same two routes.

Each contender's output is checked against `F.linear` before it is timed (to 1e-4, or to the
rounding's 3% for W8A8, 5% for fbgemm, 15% for W4A8, 10% for FP8 and 2% for bf16 rows).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.output import plot_kernels, save_result
from bench.steps import positive_ints
from engine.layers import panel_matmul
from engine.loader import read_config
from engine.models.llama import LlamaArgs
from quant.fp8 import fp8_scale, quantize_fp8
from quant.int_quant import compute_qparams, quantize_int

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


def _rtn_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RTN symmetric int8 weights per channel and their scales [N]."""
    scale, _ = compute_qparams(w, 8, group_size=None, symmetric=True)
    return quantize_int(w, scale, None, 8, group_size=None), scale[:, 0].contiguous()


def _w8a8_layout(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """RTN int8 weights per channel packed for the W8A8 kernel: (panels, 128 · row sums, scales)."""
    q, scale = _rtn_int8(w)
    return (*panel_matmul.pack_w8a8(q), scale)


def _fbgemm_layout(w: torch.Tensor) -> torch.Tensor:
    """The same RTN int8 weights per channel, prepacked for fbgemm."""
    q, scale = _rtn_int8(w)
    with warnings.catch_warnings():  # the quantized-tensor API is deprecated upstream, still fbgemm's door
        warnings.simplefilter("ignore")
        packed = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros(len(q), dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(packed, None)


def _fbgemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(x, packed, True)


def _w4a8_layout(w: torch.Tensor, group: int = 64) -> tuple[torch.Tensor, ...]:
    """RTN symmetric int4 weights per group of `group` input columns, packed for the W4A8 kernel."""
    scale, _ = compute_qparams(w, 4, group_size=group, symmetric=True)
    return panel_matmul.pack_w4a8(quantize_int(w, scale, None, 4, group_size=group), scale)


def _fp8_layout(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """e4m3 weights with a scale per channel, packed for the FP8 product kernel."""
    scale = fp8_scale(w, "channel")
    return panel_matmul.pack_fp8_pairs(quantize_fp8(w, scale), scale)


def _fp8_per_token(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return panel_matmul.matmul_fp8_dot(x, panels, scales, panel_matmul.ACT_FP8_TOKEN)


def _on_route(kernel: Callable[..., torch.Tensor], amx: bool) -> Matmul:
    def matmul(x: torch.Tensor, packed: tuple[torch.Tensor, ...]) -> torch.Tensor:
        panel_matmul.use_amx(amx)
        return kernel(x, *packed)
    return matmul


# the rounding of weights (int8, int4) and rows (int8); the rest 1e-4
TOLERANCE = {"w8a8": 3e-2, "w8a8-vnni": 3e-2, "fbgemm": 5e-2, "w4a8": 0.15, "w4a8-vnni": 0.15, "fp8": 0.1, "fp8-avx512": 0.1,
             "bf16-dot": 2e-2, "bf16-dot-avx512": 2e-2}


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
    if panel_matmul.w8a8_available():
        for name, layout, kernel in (("w8a8", _w8a8_layout, panel_matmul.matmul_w8a8),
                                     ("w4a8", _w4a8_layout, panel_matmul.matmul_w4a8)):
            if panel_matmul.use_amx():
                out[name] = (layout, _on_route(kernel, amx=True))
                out[f"{name}-vnni"] = (layout, _on_route(kernel, amx=False))
            else:
                out[name] = (layout, lambda x, packed, kernel=kernel: kernel(x, *packed))
    if "fbgemm" in torch.backends.quantized.supported_engines:
        out["fbgemm"] = (_fbgemm_layout, _fbgemm)
    if panel_matmul.bf16_dot_available():
        for name, layout, kernel in (("fp8", _fp8_layout, _fp8_per_token),
                                     ("bf16-dot", lambda w: (panel_matmul.pack_bf16_pairs(w),), panel_matmul.matmul)):
            if panel_matmul.use_amx():
                out[name] = (layout, _on_route(kernel, amx=True))
            out[f"{name}-avx512"] = (layout, _on_route(kernel, amx=False))
    return out


def run_matmul(args: argparse.Namespace) -> int:
    model_args = LlamaArgs.from_hf_config(read_config(args.model))
    shapes = layer_shapes(model_args) * model_args.num_layers
    lm_head = (model_args.vocab_size, model_args.hidden_size)
    g = torch.Generator().manual_seed(0)
    plain = [(torch.randn(n, k, generator=g) * 0.05).bfloat16().float() for n, k in [*shapes, lm_head]]
    contenders = _contenders()
    amx = panel_matmul.use_amx()
    try:
        rows_out = _time_contenders(args, contenders, plain, shapes, lm_head, g)
    finally:
        panel_matmul.use_amx(amx)  # the AMX contenders switch it
    result = {"date": time.strftime("%Y-%m-%d"), "threads": torch.get_num_threads(), "runs": args.runs,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "model": str(args.model), "num_layers": model_args.num_layers, "layer_shapes": layer_shapes(model_args),
              "lm_head": lm_head, "rows": rows_out}
    save_result(result, args.result_json, args.plot, _plot)
    return 0


def _time_contenders(args: argparse.Namespace, contenders: dict, plain: list[torch.Tensor],
                     shapes: list[tuple[int, int]], lm_head: tuple[int, int], g: torch.Generator) -> list[dict]:
    weights = {name: [layout(w) for w in plain] for name, (layout, _) in contenders.items()}
    layer_bytes = {name: sum(_nbytes(w) for w in ws[:-1]) for name, ws in weights.items()}
    rows_out = []
    for rows in args.rows:
        x = {k: torch.randn(rows, k, generator=g) for k in {k for _, k in [*shapes, lm_head]}}
        for name, (_, matmul) in contenders.items():  # every layout computes the same product
            for w, w_plain in zip(weights[name][:4], plain[:4], strict=True):
                y, reference = matmul(x[w_plain.shape[1]], w), F.linear(x[w_plain.shape[1]], w_plain)
                tolerance = TOLERANCE.get(name, 1e-4)
                torch.testing.assert_close(y, reference, rtol=tolerance, atol=tolerance * reference.abs().max().item())
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
            print(f"rows {rows:4d} {name:9s} layers {layers_s * 1e3:7.2f} ms ({rows_out[-1]['layers_gb_s']:5.1f} GB/s)"
                  f"  lm_head {rows_out[-1]['lm_head_ms']:6.2f} ms", flush=True)
    return rows_out


def _nbytes(weight: torch.Tensor | tuple[torch.Tensor, ...] | torch.ScriptObject) -> int:
    if isinstance(weight, torch.ScriptObject):  # fbgemm's packed weight: its int8 values
        weight = torch.ops.quantized.linear_unpack(weight)[0].int_repr()
    parts = weight if isinstance(weight, tuple) else (weight,)
    return sum(t.numel() * t.element_size() for t in parts)


def _plot(result: dict, path: Path) -> None:
    plot_kernels(result["rows"], "rows", lambda r: r["layers_ms"] + r["lm_head_ms"], path, log_y=True,
                 xlabel="activation rows (decode batch / prefill chunk)", ylabel="ms per forward (all Linears + lm_head)",
                 title=f"matmuls, {result['num_layers']} layers, {result['threads']} threads")
