"""Layer-by-layer calibration: observe a layer, quantize it, feed its quantized output onward.

Per decoder layer, over every calibration sample (one sequence each, plain causal attention,
no KV cache):

1. run the layer with observers hooked on each Linear input (skipped when the algorithm
   needs no statistics: plain RTN with dynamic activations);
2. record the unquantized layer's output on the held-out samples;
3. let the quantizer replace the layer's weights (statistics in, checkpoint tensors out);
4. re-run the now-quantized layer on every sample with the post-RoPE K/V observers hooked:
   its outputs are the next layer's inputs, so later layers calibrate against the error
   earlier layers really make (GPTQ's sequential order), the KV scales cover the values the
   served model will cache, and the held-out outputs give the layer's relative output error.

Only one layer's activations (all samples) and statistics live at a time; the layer itself is
moved to the compute device only while it is processed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from calibration.observers import AbsMaxObserver, HessianObserver, MeanAbsObserver, TokenSampleObserver
from calibration.targets import LinearTarget


@dataclass(slots=True)
class LinearStats:
    """Whole-set statistics of one Linear's input; the optional ones exist only when the algorithm asks."""

    input_absmax: AbsMaxObserver
    hessian: HessianObserver | None = None
    mean_abs: MeanAbsObserver | None = None
    token_sample: TokenSampleObserver | None = None

    def update(self, x: torch.Tensor) -> None:
        for observer in (self.input_absmax, self.hessian, self.mean_abs, self.token_sample):
            if observer is not None:
                observer.update(x)


@dataclass(slots=True)
class LayerQuantization:
    """What quantizing one layer produced: checkpoint tensors per checkpoint prefix, and diagnostics."""

    tensors: dict[str, dict[str, torch.Tensor]]  # prefix → {"weight_scale": ..., ...}
    weight_errors: dict[str, float]  # prefix → ‖Ŵ − W‖_F / ‖W‖_F
    # Non-Linear tensors the quantizer changed (AWQ folds scales into norms), by checkpoint name.
    changed: dict[str, torch.Tensor] = field(default_factory=dict)


class LayerQuantizer(Protocol):
    """Turns one layer's statistics into quantized weights, in place, and its checkpoint tensors."""

    needs_statistics: bool  # False: quantizes from the weights alone, so observe after quantizing
    needs_hessian: bool
    needs_activations: bool

    def quantize_layer(self, layer_idx: int, layer: nn.Module, targets: list[LinearTarget],
                       stats: dict[str, LinearStats]) -> LayerQuantization: ...


@dataclass(slots=True)
class LayerReport:
    """Per-layer numbers for calibration.json."""

    layer_idx: int
    weight_errors: dict[str, float]
    output_error: float | None  # relative Frobenius error of the layer output on held-out samples
    input_absmax: dict[str, float]  # module path → per-tensor absmax of its input
    k_absmax: list[float] | None  # per KV head
    v_absmax: list[float] | None
    seconds: float


@dataclass(slots=True)
class CalibrationResult:
    """Everything the checkpoint writer and the report need."""

    tensors: dict[str, dict[str, torch.Tensor]]
    changed: dict[str, torch.Tensor]
    kv_absmax: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), each [num_kv_heads] fp32
    layers: list[LayerReport]


@dataclass(slots=True)
class _Stream:
    """The residual stream of a set of samples entering a layer (hidden, residual per sample)."""

    hidden: list[torch.Tensor]  # each [num_tokens, hidden_size]
    residual: list[torch.Tensor | None]

    def outputs(self) -> list[torch.Tensor]:
        """The block output each sample carries: hidden + residual (the layer folds the add into the next norm)."""
        return [h if r is None else h + r for h, r in zip(self.hidden, self.residual, strict=True)]


def _embed(model: nn.Module, samples: list[torch.Tensor], device: torch.device) -> _Stream:
    embed = model.model.embed_tokens
    with torch.no_grad():
        hidden = [embed(ids.to(embed.weight.device)).to(device) for ids in samples]
    return _Stream(hidden, [None] * len(samples))


def _run_layer(layer: nn.Module, stream: _Stream, progress: tqdm) -> _Stream:
    hidden, residual = [], []
    with torch.no_grad():
        for h, r in zip(stream.hidden, stream.residual, strict=True):
            positions = torch.arange(h.shape[0], device=h.device)
            h, r = layer(h, r, positions, None)
            hidden.append(h)
            residual.append(r)
            progress.update()
    return _Stream(hidden, residual)


@contextmanager
def _observing(layer: nn.Module, stats: dict[str, LinearStats],
               kv: tuple[AbsMaxObserver, AbsMaxObserver] | None) -> Iterator[None]:
    """Hook the observers onto the layer's Linear inputs and attention K/V for the duration."""
    handles = []
    for path, linear_stats in stats.items():
        module = layer.get_submodule(path)
        handles.append(module.register_forward_pre_hook(lambda _m, args, s=linear_stats: s.update(args[0])))
    if kv is not None:
        k_obs, v_obs = kv

        def observe_kv(_module: nn.Module, args: tuple) -> None:
            _q, k, v = args[:3]  # post-RoPE k/v: [num_tokens, num_kv_heads, head_dim]
            k_obs.update(k)
            v_obs.update(v)

        handles.append(layer.self_attn.attn.register_forward_pre_hook(observe_kv))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _relative_error(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float | None:
    if not expected:
        return None
    diff = sum(float((a.float() - e.float()).pow(2).sum()) for a, e in zip(actual, expected, strict=True))
    norm = sum(float(e.float().pow(2).sum()) for e in expected)
    return (diff / norm) ** 0.5 if norm > 0 else 0.0


def calibrate(
    model: nn.Module,
    samples: list[torch.Tensor],
    heldout: list[torch.Tensor],
    targets: list[LinearTarget],
    quantizer: LayerQuantizer | None,
    *,
    observe_kv: bool,
    device: torch.device | str = "cpu",
    show_progress: bool = True,
) -> CalibrationResult:
    """Run the sequential pipeline over every decoder layer of ``model`` (modified in place).

    ``quantizer`` None quantizes no weight (KV-scales-only runs). ``samples`` and ``heldout``
    are token-id tensors ``[num_tokens]``.
    """
    device = torch.device(device)
    layers = model.model.layers
    calib_stream, heldout_stream = _embed(model, samples, device), _embed(model, heldout, device)
    result = CalibrationResult(tensors={}, changed={}, kv_absmax=[], layers=[])
    needs_statistics = quantizer is not None and quantizer.needs_statistics
    num_calib_passes = 2 if needs_statistics else 1
    num_heldout_passes = 2 if quantizer is not None else 1
    num_passes = num_calib_passes * len(samples) + num_heldout_passes * len(heldout)
    for layer_idx, layer in enumerate(layers):
        start = time.perf_counter()
        layer_targets = [t for t in targets if t.layer_idx == layer_idx]
        stats = {t.module_path: _new_stats(t, quantizer, num_calls=len(samples)) for t in layer_targets}
        kv = (AbsMaxObserver(channel_dim=1), AbsMaxObserver(channel_dim=1)) if observe_kv else None
        source_device = next(layer.parameters()).device
        layer.to(device)
        with tqdm(total=num_passes, desc=f"layer {layer_idx + 1}/{len(layers)}", unit="pass",
                  disable=not show_progress, leave=False) as progress:
            if needs_statistics:
                with _observing(layer, stats, None):
                    _run_layer(layer, calib_stream, progress)
            heldout_ref = _run_layer(layer, heldout_stream, progress)
            weight_errors: dict[str, float] = {}
            if quantizer is not None:
                quantized = quantizer.quantize_layer(layer_idx, layer, layer_targets, stats)
                result.tensors.update(quantized.tensors)
                result.changed.update(quantized.changed)
                weight_errors = quantized.weight_errors
            # K/V (and, when quantization needed none, the Linear inputs) are observed on the
            # quantized layer: those are the values the served model will produce.
            with _observing(layer, {} if needs_statistics else stats, kv):
                calib_out = _run_layer(layer, calib_stream, progress)
            if quantizer is not None:
                heldout_out = _run_layer(layer, heldout_stream, progress)
                output_error = _relative_error(heldout_out.outputs(), heldout_ref.outputs())
            else:
                heldout_out, output_error = heldout_ref, 0.0 if heldout else None
            if show_progress and output_error is not None:
                progress.write(f"layer {layer_idx + 1}/{len(layers)}: held-out output error {output_error:.4f}")
        layer.to(source_device)
        calib_stream, heldout_stream = calib_out, heldout_out
        if kv is not None:
            result.kv_absmax.append((kv[0].per_channel, kv[1].per_channel))
        result.layers.append(LayerReport(
            layer_idx=layer_idx, weight_errors=weight_errors, output_error=output_error,
            input_absmax={path: float(s.input_absmax.per_tensor) for path, s in stats.items()},
            k_absmax=kv[0].per_channel.tolist() if kv else None,
            v_absmax=kv[1].per_channel.tolist() if kv else None,
            seconds=time.perf_counter() - start))
    return result


_AWQ_MAX_TOKENS = 1024  # activation rows kept per Linear for AWQ's grid search (21 candidates × matmul)


def _new_stats(target: LinearTarget, quantizer: LayerQuantizer | None, num_calls: int) -> LinearStats:
    needs_hessian = quantizer is not None and quantizer.needs_hessian
    needs_activations = quantizer is not None and quantizer.needs_activations
    return LinearStats(
        input_absmax=AbsMaxObserver(),
        hessian=HessianObserver(target.input_size) if needs_hessian else None,
        mean_abs=MeanAbsObserver(target.input_size) if needs_activations else None,
        token_sample=(TokenSampleObserver(target.input_size, max_tokens=_AWQ_MAX_TOKENS, num_calls=num_calls)
                      if needs_activations else None),
    )
