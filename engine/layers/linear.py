"""The one Linear factory the model uses; quantized schemes plug in here.

Every Linear built here speaks the same small protocol, so the loader never needs to know
the scheme:

- ``output_sizes`` lists the shards fused into the layer (q/k/v → 3 shards, gate/up → 2,
  anything else → 1); shard ``i`` fills rows ``sum(output_sizes[:i]) : sum(output_sizes[:i+1])``.
- ``prefixes`` names each shard's HF Linear in the checkpoint (``model.layers.0.self_attn.q_proj``),
  so the loader and the quantizer map tensors to it without knowing the model's naming;
  ``quantizable`` says whether the quantizer may touch it.
- ``load_shard(shard_id, tensors)`` receives the checkpoint tensors of one HF Linear, keyed by
  suffix (``"weight"``, ``"bias"``, ``"weight_scale"``, ``"weight_packed"``, ...).
- ``finalize()`` runs once after every shard is loaded (merge shard scales, prepack for a fast
  kernel, free staging copies).

On CPU the serving engine then re-lays fp32 weights out in 16-column panels for its C matmul
kernel (`engine/layers/panel_matmul.py`; decode runs 1.3–1.4× faster than on oneDNN's blocked
layout). Calibration edits weights in place, so only the engine packs, after loading.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import panel_matmul

if TYPE_CHECKING:
    from quant.config import QuantizationConfig


def dense_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b`` for a plain weight [N, K] or CPU panels (`panel_matmul.pack`, `pack_bf16_pairs`)."""
    if weight.dim() > 2:
        return panel_matmul.matmul(x, weight, bias)
    return F.linear(x, weight, bias)


class DenseLinear(nn.Module):
    """Unquantized ``y = x Wᵀ + b`` with fused shards."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        out = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        self._loaded: set[int] = set()

    def _rows(self, shard_id: int) -> slice:
        start = sum(self.output_sizes[:shard_id])
        return slice(start, start + self.output_sizes[shard_id])

    def load_shard(self, shard_id: int, tensors: dict[str, torch.Tensor]) -> None:
        unknown = set(tensors) - {"weight", "bias"}
        if unknown:
            raise ValueError(f"unexpected tensors {sorted(unknown)} for an unquantized Linear")
        if "weight" not in tensors:
            raise ValueError("no 'weight' tensor for this shard")
        rows = self._rows(shard_id)
        weight = tensors["weight"]
        if tuple(weight.shape) != (rows.stop - rows.start, self.input_size):
            raise ValueError(f"weight shape {tuple(weight.shape)} does not match "
                             f"({rows.stop - rows.start}, {self.input_size})")
        self.weight.data[rows].copy_(weight)
        if "bias" in tensors:
            if self.bias is None:
                raise ValueError("checkpoint has a bias for a Linear built without one")
            self.bias.data[rows].copy_(tensors["bias"])
        self._loaded.add(shard_id)

    def finalize(self) -> None:
        missing = set(range(len(self.output_sizes))) - self._loaded
        if missing:
            raise ValueError(f"shards {sorted(missing)} were never loaded")

    def prepack(self, bf16_activations: bool = False) -> int:
        """Swap the weight for its CPU panel layout (fp32 only); the plain copy is freed (returns
        its bytes, 0 if none). With `bf16_activations`, a weight of bf16 values multiplies inputs
        rounded to bf16, where the CPU can."""
        if self.weight.dim() != 2:  # in panels already
            return 0
        packed = panel_matmul.pack(self.weight, bf16_activations=bf16_activations)
        if packed is None:
            return 0
        freed = self.weight.numel() * self.weight.element_size()
        del self.weight
        self.register_buffer("weight", packed, persistent=False)
        return freed

    @property
    def kernel(self) -> str:
        """The matmul this Linear runs on, by its weight's layout (as a quantized Linear's `kernel`)."""
        if self.weight.dim() == 4:
            return "bf16dot"  # bf16 pairs: inputs rounded to bf16
        if self.weight.dim() == 3:
            return "panel-bf16" if self.weight.dtype == torch.bfloat16 else "panel-f32"
        return "linear"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_matmul(x, self.weight, self.bias)


# the CPU kernels that run on AMX tiles where the CPU has them (the int8 ones from 16 or 32 rows)
AMX_KERNELS = frozenset({"w8a8panel", "w4a8panel", "fp8dot", "bf16dot"})


def matmul_kernels(model: nn.Module) -> dict[str, int]:
    """How many of the model's Linears run on each kernel (every Linear names its own `kernel`)."""
    return dict(Counter(kernel for module in model.modules()
                        if isinstance(kernel := getattr(module, "kernel", None), str)))


def describe_kernels(kernels: dict[str, int]) -> str:
    """`matmul_kernels` as a start-up line: "fp8dot x120, bf16dot x1; on AMX tiles ..."."""
    text = ", ".join(f"{name} x{count}" for name, count in sorted(kernels.items(), key=lambda kv: -kv[1]))
    if AMX_KERNELS & kernels.keys() and panel_matmul.use_amx():
        text += "; on AMX tiles (DRIFTGATE_AMX=0: off)"
    return text


def make_linear(
    input_size: int,
    output_sizes: list[int],
    *,
    bias: bool,
    prefixes: list[str],
    quant_config: QuantizationConfig | None,
    dtype: torch.dtype,
    quantizable: bool = True,
) -> nn.Module:
    """Build the Linear for checkpoint layers ``prefixes`` (one per shard).

    Fused shards must share a scheme (q/k/v, gate/up): the quantization config decides per
    prefix, and a mismatch is a checkpoint error. A Linear that is not ``quantizable`` (a
    mixture-of-experts router) stays dense whatever the config says, and the quantizer skips it.
    """
    if len(prefixes) != len(output_sizes):
        raise ValueError(f"{len(output_sizes)} shards but {len(prefixes)} checkpoint names {prefixes}")
    config = quant_config if quantizable else None
    schemes = [None if config is None else config.scheme_for(prefix) for prefix in prefixes]
    if any(s != schemes[0] for s in schemes):
        raise ValueError(f"fused layers {prefixes} have different quantization schemes")
    if schemes[0] is None:
        linear = DenseLinear(input_size, output_sizes, bias, dtype)
    else:
        from quant.linear import make_quantized_linear

        linear = make_quantized_linear(schemes[0], input_size, output_sizes, bias=bias, dtype=dtype)
    linear.prefixes, linear.quantizable = tuple(prefixes), quantizable
    return linear
