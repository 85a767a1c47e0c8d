"""Apply one weight scheme and algorithm to a calibrated decoder layer, through ``quant/``.

Every quantized Linear is replaced in the layer by the very module the engine will serve,
built from the checkpoint tensors we are about to write, so the next layer calibrates
against — and the error report measures — what serving computes, activation quantization
included, and a tensor the engine would reject fails here, before anything is written.
"""

from __future__ import annotations

import torch
from torch import nn

from calibration.pipeline import LayerQuantization, LinearStats
from calibration.targets import LinearTarget
from quant.checkpoint import quantize_weight
from quant.fp8 import fp8_scale
from quant.linear import make_quantized_linear
from quant.schemes import QuantScheme


def _relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    norm = exact.float().norm()
    return float((approx.float() - exact.float()).norm() / norm) if norm > 0 else 0.0


def _shard_rows(target: LinearTarget) -> list[slice]:
    starts = [sum(target.output_sizes[:i]) for i in range(len(target.output_sizes))]
    return [slice(s, s + n) for s, n in zip(starts, target.output_sizes, strict=True)]


class WeightQuantizer:
    """RTN / GPTQ / AWQ for one scheme; implements the pipeline's ``LayerQuantizer``."""

    def __init__(self, scheme: QuantScheme, algorithm: str):
        self.scheme = scheme
        self.algorithm = algorithm
        acts = scheme.input_activations
        self.needs_statistics = algorithm != "rtn" or (acts is not None and not acts.dynamic)
        self.needs_hessian = algorithm == "gptq"
        self.needs_activations = algorithm == "awq"

    def quantize_layer(self, layer_idx: int, layer: nn.Module, targets: list[LinearTarget],
                       stats: dict[str, LinearStats]) -> LayerQuantization:
        result = LayerQuantization(tensors={}, weight_errors={})
        for target in targets:
            module = layer.get_submodule(target.module_path)
            weight = module.weight.detach().float().cpu()  # [out, in], all shards
            input_scale = self._input_scale(stats[target.module_path])
            with torch.device(module.weight.device):  # the kernel is chosen for the device it is built on
                quantized = make_quantized_linear(self.scheme, target.input_size, list(target.output_sizes),
                                                  bias=module.bias is not None, dtype=module.weight.dtype)
            for shard_id, (prefix, rows) in enumerate(zip(target.prefixes, _shard_rows(target), strict=True)):
                tensors = self._quantize_shard(weight[rows], stats[target.module_path], input_scale)
                result.tensors[prefix] = tensors
                shard_tensors = dict(tensors)
                if module.bias is not None:
                    shard_tensors["bias"] = module.bias.detach()[rows].cpu()
                quantized.load_shard(shard_id, shard_tensors)
            quantized.finalize()
            dequantized = quantized.dequantized_weight()
            for prefix, rows in zip(target.prefixes, _shard_rows(target), strict=True):
                result.weight_errors[prefix] = _relative_error(dequantized[rows], weight[rows])
            parent_path, _, leaf = target.module_path.rpartition(".")
            setattr(layer.get_submodule(parent_path), leaf, quantized)
        return result

    def _input_scale(self, stats: LinearStats) -> torch.Tensor | None:
        acts = self.scheme.input_activations
        if acts is None or acts.dynamic:
            return None
        return fp8_scale(stats.input_absmax.per_channel, "tensor")  # absmax over the whole set / 448

    def _quantize_shard(self, weight: torch.Tensor, stats: LinearStats,
                        input_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        # A fresh input_scale per shard: safetensors refuses to save tensors that share memory.
        shard_input_scale = None if input_scale is None else input_scale.clone()
        return quantize_weight(weight, self.scheme, input_scale=shard_input_scale, scale_dtype=torch.float32)
