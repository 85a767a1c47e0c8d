"""Apply one weight scheme and algorithm to a calibrated decoder layer, through ``quant/``.

Every quantized Linear is replaced in the layer by the very module the engine will serve,
built from the checkpoint tensors we are about to write, so the next layer calibrates
against — and the error report measures — what serving computes, activation quantization
included, and a tensor the engine would reject fails here, before anything is written.

The math (RTN, the GPTQ solve, the AWQ grid search, folding scales) is ``quant/``'s; this
module only knows the Llama block's wiring: which Linears share an input and which op
produces that input.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from calibration.pipeline import LayerQuantization, LinearStats
from calibration.targets import LinearTarget
from quant import fp4
from quant.awq import awq_search_scales
from quant.checkpoint import quantize_weight
from quant.fp8 import fp8_scale
from quant.gptq import gptq_quantize
from quant.linear import make_quantized_linear
from quant.schemes import QuantScheme
from quant.smoothing import fold_smoothing_scales
from quant.smoothquant import smoothquant_scales


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    norm = exact.float().norm()
    return float((approx.float() - exact.float()).norm() / norm) if norm > 0 else 0.0


def _shard_rows(output_sizes: tuple[int, ...]) -> list[slice]:
    starts = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
    return [slice(s, s + n) for s, n in zip(starts, output_sizes, strict=True)]


@dataclass(frozen=True, slots=True)
class _SmoothMapping:
    """AWQ / SmoothQuant pair: the balance Linear at ``balance`` reads channels produced by ``smooth``.

    ``smooth`` is an RMSNorm (whole weight) or rows ``rows`` of a fused Linear's weight.
    """

    balance: str
    smooth: str
    rows: slice | None = None


def _smooth_mappings(layer: nn.Module) -> list[_SmoothMapping]:
    """The Llama block's smoothable pairs.

    v_proj → o_proj is left out under grouped-query attention: its scales would have to be
    shared by the query heads reading one KV head, which the search does not model; and where
    q/k/v are clamped (OLMoE's clip_qkv), since clamp(v / s) · s is not clamp(v). In a
    mixture of experts each expert's down_proj is smoothed against its own up rows; the norm
    before the experts is not, as its scales would have to be shared by every expert and folded
    into the (unquantized) router.
    """
    attn = layer.self_attn
    # OLMo 2 norms only block outputs: no norm produces the q/k/v or MLP inputs to fold scales into
    mappings = [] if layer.post_norms else [_SmoothMapping("self_attn.qkv_proj", "input_layernorm")]
    if attn.num_heads == attn.num_kv_heads and attn.clip_qkv is None:
        v_size = attn.num_kv_heads * attn.head_dim  # the v rows, last in the fused q/k/v output
        mappings.append(_SmoothMapping("self_attn.o_proj", "self_attn.qkv_proj",
                                       slice(attn.qk_size, attn.qk_size + v_size)))
    experts = getattr(layer.mlp, "experts", None)
    if experts is None:
        # the MLP's input norm (Gemma's sandwich block norms the attention output with post_attention_layernorm)
        mlps = {"mlp": layer.mlp}
        if not layer.post_norms:
            mappings.append(_SmoothMapping(
                "mlp.gate_up_proj", "pre_feedforward_layernorm" if layer.sandwich_norms else "post_attention_layernorm"))
    else:
        mlps = {f"mlp.experts.{e}": expert for e, expert in enumerate(experts)}
        if layer.mlp.shared_expert is not None:
            mlps["mlp.shared_expert"] = layer.mlp.shared_expert
    for path, mlp in mlps.items():
        inter = mlp.down_proj.input_size
        mappings.append(_SmoothMapping(f"{path}.down_proj", f"{path}.gate_up_proj", slice(inter, 2 * inter)))  # up rows
    return mappings


def fold_mapping(layer: nn.Module, mapping: _SmoothMapping, scales: torch.Tensor) -> None:
    """Fold smoothing scales into the layer in place: the smoothed side (a norm's weight, or a
    Linear's rows and their bias) divided by them, the balanced Linear's input columns multiplied
    by them, so the layer computes what it did (every mapping `_smooth_mappings` lists keeps this)."""
    balance = layer.get_submodule(mapping.balance)
    smooth = layer.get_submodule(mapping.smooth)
    smooth_weight = smooth.weight.data if mapping.rows is None else smooth.weight.data[mapping.rows]
    smooth_bias = None
    if mapping.rows is not None and getattr(smooth, "bias", None) is not None:
        smooth_bias = smooth.bias.data[mapping.rows]
    [balanced], smoothed, bias = fold_smoothing_scales(scales.to(balance.weight.device),
                                                       balance_weights=[balance.weight.data],
                                                       smooth_weight=smooth_weight, smooth_bias=smooth_bias)
    balance.weight.data.copy_(balanced)
    smooth_weight.copy_(smoothed)  # a view: writes into the norm or the fused Linear's rows
    if bias is not None:
        smooth_bias.copy_(bias)


class WeightQuantizer:
    """RTN / GPTQ / AWQ for one scheme, optionally after SmoothQuant; the pipeline's ``LayerQuantizer``."""

    def __init__(self, scheme: QuantScheme, algorithm: str, smoothquant_alpha: float | None = None):
        self.scheme = scheme
        self.algorithm = algorithm
        self.smoothquant_alpha = smoothquant_alpha
        acts = scheme.input_activations
        self.needs_statistics = (algorithm != "rtn" or smoothquant_alpha is not None
                                 or (acts is not None and acts.dynamic is not True))
        self.needs_hessian = algorithm == "gptq"
        self.needs_activations = algorithm == "awq"

    def quantize_layer(self, layer_idx: int, layer: nn.Module, targets: list[LinearTarget],
                       stats: dict[str, LinearStats]) -> LayerQuantization:
        result = LayerQuantization(tensors={}, weight_errors={})
        if self.algorithm == "awq" or self.smoothquant_alpha is not None:
            result.changed = self._smooth(layer_idx, layer, targets, stats)
        for target in targets:
            self._quantize_target(layer, target, stats[target.module_path], result)
        return result

    def _quantize_target(self, layer: nn.Module, target: LinearTarget, stats: LinearStats,
                         result: LayerQuantization) -> None:
        module = layer.get_submodule(target.module_path)
        weight = module.weight.detach().float().cpu()  # [out, in], all shards
        shard_tensors = self._quantize_weight(weight, target, stats)
        with torch.device(module.weight.device):  # the kernel is chosen for the device it is built on
            quantized = make_quantized_linear(self.scheme, target.input_size, list(target.output_sizes),
                                              bias=module.bias is not None, dtype=module.weight.dtype)
        rows = _shard_rows(target.output_sizes)
        for shard_id, (prefix, tensors) in enumerate(zip(target.prefixes, shard_tensors, strict=True)):
            result.tensors[prefix] = tensors
            bias = {} if module.bias is None else {"bias": module.bias.detach()[rows[shard_id]].cpu()}
            quantized.load_shard(shard_id, {**tensors, **bias})
        quantized.finalize()
        dequantized = quantized.dequantized_weight()
        for prefix, shard in zip(target.prefixes, rows, strict=True):
            result.weight_errors[prefix] = _relative_error(dequantized[shard], weight[shard])
        parent_path, _, leaf = target.module_path.rpartition(".")
        setattr(layer.get_submodule(parent_path), leaf, quantized)

    def _quantize_weight(self, weight: torch.Tensor, target: LinearTarget,
                         stats: LinearStats) -> list[dict[str, torch.Tensor]]:
        """Checkpoint tensors of each shard of ``weight`` [sum(output_sizes), in]."""
        rows = _shard_rows(target.output_sizes)
        if self.scheme.weights.is_fp4:
            return self._quantize_fp4(weight, rows, stats)
        input_scale = self._input_scale(stats)
        # A fresh input_scale per shard: safetensors refuses to save tensors that share memory.
        fresh_scale = (lambda: None) if input_scale is None else input_scale.clone
        if self.algorithm != "gptq":
            return [quantize_weight(weight[r], self.scheme, input_scale=fresh_scale(), scale_dtype=torch.float32)
                    for r in rows]
        w = self.scheme.weights
        try:
            # Rows are solved independently given H, so a fused weight is solved in one call
            # unless its shards each need their own per-tensor scale.
            blocks = rows if w.strategy == "tensor" else [slice(0, weight.shape[0])]
            hessian = stats.hessian.hessian.cpu()  # the solve runs where the weight copy is: CPU
            solved = [gptq_quantize(weight[b], hessian, num_bits=w.num_bits,
                                    group_size=w.group_size, symmetric=w.symmetric, actorder=w.actorder)
                      for b in blocks]
        except ValueError as exc:
            warnings.warn(f"{target.prefixes[0]}: {exc}; falling back to RTN for this Linear", stacklevel=2)
            return [quantize_weight(weight[r], self.scheme, input_scale=fresh_scale(), scale_dtype=torch.float32)
                    for r in rows]
        if len(solved) == 1:
            whole = solved[0]
            pick = [(whole, r) for r in rows]
        else:
            pick = [(s, slice(0, r.stop - r.start)) for s, r in zip(solved, rows, strict=True)]
        return [
            quantize_weight(
                weight[r], self.scheme, q=s.q[local], scale=s.scale[local],
                zero_point=None if s.zero_point is None else s.zero_point[local], g_idx=s.g_idx,
                input_scale=fresh_scale(), scale_dtype=torch.float32)
            for (s, local), r in zip(pick, rows, strict=True)
        ]

    def _quantize_fp4(self, weight: torch.Tensor, rows: list[slice], stats: LinearStats) -> list[dict[str, torch.Tensor]]:
        """FP4. NVFP4: one global scale across the fused shards, as vLLM loads them; under W4A4 an
        input global scale from the calibration inputs' absmax (the run-time group scales' base).
        GPTQ solves the fused weight at once (its rows are independent given H)."""
        nvfp4 = self.scheme.weights.fp4_kind == "nvfp4"
        scaling = fp4.SCALINGS[self.scheme.weights.fp4_kind].of(weight)
        inputs = None
        if nvfp4 and self.scheme.input_activations:
            inputs = fp4.global_scale(stats.input_absmax.per_channel)
        solved = None
        if self.algorithm == "gptq":
            try:
                solved = gptq_quantize(weight, stats.hessian.hessian.cpu(), num_bits=4, group_size=scaling.group_size,
                                       fp4_scaling=scaling)
            except ValueError as exc:
                warnings.warn(f"{exc}; falling back to RTN for this Linear", stacklevel=2)
        return [quantize_weight(weight[r], self.scheme, global_scale=scaling.global_scale if nvfp4 else None,
                                input_global_scale=inputs, q=None if solved is None else solved.q[r],
                                scale=None if solved is None else solved.scale[r])
                for r in rows]

    def _input_scale(self, stats: LinearStats) -> torch.Tensor | None:
        acts = self.scheme.input_activations
        if acts is None or acts.dynamic:
            return None
        return fp8_scale(stats.input_absmax.per_channel, "tensor")  # absmax over the whole set / 448

    def _smooth(self, layer_idx: int, layer: nn.Module, targets: list[LinearTarget],
                stats: dict[str, LinearStats]) -> dict[str, torch.Tensor]:
        """Find every mapping's scales on the unsmoothed layer, then fold them all in place.

        Scales come from AWQ's search or SmoothQuant's closed form. Finding them all first keeps
        each on the statistics it was observed with; folding is output-preserving, so the order
        of the folds does not matter. Returns the norm weights that absorbed scales, by
        checkpoint name (smoothed Linear rows are quantized next). A GPTQ solve that follows
        gets the Hessian of the smoothed input, X / s.
        """
        quantized = {t.module_path: t for t in targets}
        w = self.scheme.weights
        searched = []
        for mapping in _smooth_mappings(layer):
            if mapping.balance not in quantized or (mapping.rows is not None and mapping.smooth not in quantized):
                continue  # nothing to protect, or the scales would land in a Linear kept dense
            balance_stats = stats[mapping.balance]
            balance_weight = layer.get_submodule(mapping.balance).weight.detach().float().cpu()
            if self.smoothquant_alpha is not None:
                scales = smoothquant_scales(balance_stats.input_absmax.per_channel.cpu(), [balance_weight],
                                            self.smoothquant_alpha)
            else:
                scales = awq_search_scales(  # on CPU, where the token sample is kept
                    balance_weight, balance_stats.token_sample.rows, num_bits=w.num_bits, group_size=w.group_size,
                    symmetric=w.symmetric, act_mean_abs=balance_stats.mean_abs.mean,
                    fp4_scaling=fp4.SCALINGS.get(w.fp4_kind)).scales
            searched.append((mapping, scales))
        changed: dict[str, torch.Tensor] = {}
        for mapping, scales in searched:
            fold_mapping(layer, mapping, scales)
            if self.needs_hessian:
                stats[mapping.balance].hessian.rescale_inputs(scales)
            if mapping.rows is None:  # a norm: written from here; smoothed Linear rows are quantized next
                smooth = layer.get_submodule(mapping.smooth)
                changed[f"model.layers.{layer_idx}.{mapping.smooth}.weight"] = smooth.weight.detach().cpu().clone()
        return changed
