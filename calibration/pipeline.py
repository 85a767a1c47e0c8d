"""Layer-by-layer calibration: observe a layer, quantize it, feed its quantized output onward.

Per decoder layer, over every calibration sample (each its own causal sequence; samples are
batched through the engine's multi-sequence attention path with a scratch KV cache):

1. run the layer with observers hooked on each Linear input (skipped when the algorithm
   needs no statistics: plain RTN with dynamic activations);
2. record the unquantized layer's output on the held-out samples;
3. let the quantizer replace the layer's weights (statistics in, checkpoint tensors out);
4. re-run the now-quantized layer on every sample with the post-RoPE K/V observers hooked:
   its outputs are the next layer's inputs, so later layers calibrate against the error
   earlier layers really make (GPTQ's sequential order), the KV scales cover the values the
   served model will cache, and the held-out outputs give the layer's relative output error.

Only one layer's activations (all samples) and statistics live at a time; the layer itself is
upcast and moved to the compute device only while it is processed, then released.
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
from engine.layers.attention import AttentionMetadata, ForwardContext, KVCache, PrefillSpan


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
    input_absmax: dict[str, float]  # module path → per-tensor absmax of its input (when observed)
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
    num_tokens_observed: int  # calibration tokens run through the model (0 when nothing needed them)


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
        hidden = [embed(ids.to(embed.weight.device)).to(device=device, dtype=torch.float32) for ids in samples]
    return _Stream(hidden, [None] * len(samples))


class _BatchedRunner:
    """Runs a layer over many samples at once, each still its own causal sequence.

    Samples are packed into batches of up to ``max_batch_tokens`` and sent through the
    engine's multi-sequence attention path (one prefill span per sample, a scratch KV cache),
    so the Linears see one large matmul instead of one small one per sample: on a busy
    two-core CPU a 130-token layer call costs as much as a 1000-token one.
    """

    def __init__(self, lengths: list[int], max_batch_tokens: int, cache: KVCache, device: torch.device):
        self.batches: list[list[int]] = []
        for i, n in enumerate(lengths):
            if self.batches and sum(lengths[j] for j in self.batches[-1]) + n <= max_batch_tokens:
                self.batches[-1].append(i)
            else:
                self.batches.append([i])
        self.lengths = lengths
        self.cache = cache  # scratch: every batch overwrites slots 0..batch_tokens of the running layer
        self.device = device

    def _context(self, batch: list[int]) -> tuple[ForwardContext, torch.Tensor]:
        spans, positions, start = [], [], 0
        for i in batch:
            n = self.lengths[i]
            spans.append(PrefillSpan(token_start=start, num_query_tokens=n,
                                     context_slots=torch.arange(start, start + n, device=self.device), mask=None))
            positions.append(torch.arange(n, device=self.device))
            start += n
        metadata = AttentionMetadata(slot_mapping=torch.arange(start, device=self.device), num_decode_tokens=0,
                                     decode_groups=[], prefills=spans)
        return ForwardContext(metadata=metadata, kv_cache=self.cache), torch.cat(positions)

    def run(self, layer: nn.Module, stream: _Stream, progress: tqdm) -> _Stream:
        hidden: list[torch.Tensor] = []
        residual: list[torch.Tensor | None] = []
        with torch.no_grad():
            for batch in self.batches:
                ctx, positions = self._context(batch)
                h = torch.cat([stream.hidden[i] for i in batch])  # [batch_tokens, hidden_size]
                r = None if stream.residual[batch[0]] is None else torch.cat([stream.residual[i] for i in batch])
                h, r = layer(h, r, positions, ctx)
                sizes = [self.lengths[i] for i in batch]
                hidden.extend(h.split(sizes))
                residual.extend(r.split(sizes))
                progress.update(len(batch))
        return _Stream(hidden, residual)


@contextmanager
def _observing(layer: nn.Module, stats: dict[str, LinearStats],
               kv: tuple[AbsMaxObserver, AbsMaxObserver] | None) -> Iterator[None]:
    """Hook the observers onto the layer's Linear inputs and attention K/V for the duration.
    While Linears are observed, every expert of a mixture runs on every token (its outputs for
    tokens not routed to it unused), so each is calibrated on the whole set, as llm-compressor
    does, rather than on the few tokens a router happens to send it."""
    handles = []
    mixtures = [m for m in layer.modules() if hasattr(m, "calibrate_all_experts")]
    for mixture in mixtures:
        mixture.calibrate_all_experts = bool(stats)
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
        for mixture in mixtures:
            mixture.calibrate_all_experts = False


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
    max_batch_tokens: int = 2048,
    show_progress: bool = True,
) -> CalibrationResult:
    """Run the sequential pipeline over every decoder layer of ``model``, consuming it.

    Each layer is cast to fp32 on ``device`` while it is processed and released (moved to the
    meta device) afterwards, so peak memory is the model at its stored precision plus one fp32
    layer and the activations. ``quantizer`` None quantizes no weight (KV-scales-only runs). ``samples`` and ``heldout``
    are token-id tensors ``[num_tokens]``; up to ``max_batch_tokens`` of them run per call.
    """
    device = torch.device(device)
    layers = model.model.layers
    needs_statistics = quantizer is not None and quantizer.needs_statistics
    if not (needs_statistics or observe_kv):
        # Nothing reads the calibration activations (RTN on weights alone, no KV scales): only
        # the held-out samples run, for the error report. A full pass would cost a whole forward.
        samples = []
    calib_stream, heldout_stream = _embed(model, samples, device), _embed(model, heldout, device)
    lengths = [int(s.numel()) for s in samples], [int(s.numel()) for s in heldout]
    attn = layers[0].self_attn
    num_slots = max([min(max_batch_tokens, sum(lengths[0]) + sum(lengths[1])), *lengths[0], *lengths[1]])
    cache = KVCache(len(layers), num_slots, attn.num_kv_heads, attn.head_dim, torch.float32, device)
    calib_runner = _BatchedRunner(lengths[0], max_batch_tokens, cache, device)
    heldout_runner = _BatchedRunner(lengths[1], max_batch_tokens, cache, device)
    result = CalibrationResult(tensors={}, changed={}, kv_absmax=[], layers=[],
                               num_tokens_observed=sum(int(s.numel()) for s in samples))
    num_calib_passes = 2 if needs_statistics else 1
    num_heldout_passes = 2 if quantizer is not None else 1
    num_passes = num_calib_passes * len(samples) + num_heldout_passes * len(heldout)
    for layer_idx, layer in enumerate(layers):
        start = time.perf_counter()
        layer_targets = [t for t in targets if t.layer_idx == layer_idx]
        stats = {t.module_path: _new_stats(t, quantizer, num_calls=len(calib_runner.batches), device=device)
                 for t in layer_targets}
        kv = (AbsMaxObserver(channel_dim=1), AbsMaxObserver(channel_dim=1)) if observe_kv else None
        layer.to(device=device, dtype=torch.float32)  # stored at checkpoint precision, calibrated in fp32
        with tqdm(total=num_passes, desc=f"layer {layer_idx + 1}/{len(layers)}", unit="sample",
                  disable=not show_progress, leave=False) as progress:
            if needs_statistics:
                with _observing(layer, stats, None):
                    calib_runner.run(layer, calib_stream, progress)
            heldout_ref = heldout_runner.run(layer, heldout_stream, progress)
            weight_errors: dict[str, float] = {}
            if quantizer is not None:
                quantized = quantizer.quantize_layer(layer_idx, layer, layer_targets, stats)
                result.tensors.update(quantized.tensors)
                result.changed.update(quantized.changed)
                weight_errors = quantized.weight_errors
            # K/V (and, when quantization needed none, the Linear inputs) are observed on the
            # quantized layer: those are the values the served model will produce.
            with _observing(layer, {} if needs_statistics else stats, kv):
                calib_out = calib_runner.run(layer, calib_stream, progress)
            if quantizer is not None:
                heldout_out = heldout_runner.run(layer, heldout_stream, progress)
                output_error = _relative_error(heldout_out.outputs(), heldout_ref.outputs())
            else:
                heldout_out, output_error = heldout_ref, 0.0 if heldout else None
            if show_progress and output_error is not None:
                progress.write(f"layer {layer_idx + 1}/{len(layers)}: held-out output error {output_error:.4f}")
        layer.to("meta")  # done with it: its quantized tensors are in `result`, free the memory
        calib_stream, heldout_stream = calib_out, heldout_out
        if kv is not None:
            result.kv_absmax.append((kv[0].per_channel, kv[1].per_channel))
        result.layers.append(LayerReport(
            layer_idx=layer_idx, weight_errors=weight_errors, output_error=output_error,
            input_absmax={path: float(s.input_absmax.per_tensor) for path, s in stats.items()
                          if s.input_absmax.per_channel is not None},
            k_absmax=kv[0].per_channel.tolist() if kv else None,
            v_absmax=kv[1].per_channel.tolist() if kv else None,
            seconds=time.perf_counter() - start))
    return result


_AWQ_MAX_TOKENS = 1024  # activation rows kept per Linear for AWQ's grid search (21 candidates × matmul)


def _new_stats(target: LinearTarget, quantizer: LayerQuantizer | None, num_calls: int,
               device: torch.device) -> LinearStats:
    needs_hessian = quantizer is not None and quantizer.needs_hessian
    needs_activations = quantizer is not None and quantizer.needs_activations
    return LinearStats(
        input_absmax=AbsMaxObserver(),
        hessian=HessianObserver(target.input_size, device=device) if needs_hessian else None,
        mean_abs=MeanAbsObserver(target.input_size) if needs_activations else None,
        token_sample=(TokenSampleObserver(target.input_size, max_tokens=_AWQ_MAX_TOKENS, num_calls=num_calls)
                      if needs_activations else None),
    )
