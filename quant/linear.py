"""Quantized Linear modules, one per scheme family, speaking the engine's Linear protocol.

Protocol (see ``engine/layers/linear.py``): ``load_shard(shard_id, tensors)`` takes the
checkpoint tensors of one HF Linear keyed by suffix and validates them; ``finalize()`` merges
fused shards (q/k/v, gate/up) into one canonical set of tensors and prepares the kernel for
the device; ``forward`` runs the fast kernel; ``reference_forward`` is the dequantize-then-matmul
oracle every kernel is tested against.

Canonical tensors after ``finalize`` (fused shards concatenated along output rows):
per-tensor shard scales become a per-row vector, which represents them exactly, so one kernel
covers every shard layout. The kernel is picked for the device the module sits on at
``finalize``: move the module before loading, not after.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import panel_matmul, triton_support
from engine.layers.linear import dense_matmul
from quant import fp4, triton_fp8
from quant.fp8 import FP8_DTYPE, fake_quantize_fp8, fp8_scale, quantize_fp8, spread_tiles
from quant.int_quant import dequantize_int, int_range, num_groups, unpack_int32
from quant.schemes import QuantScheme

_EPS = torch.finfo(torch.float32).eps
_INT4PACK_GROUPS = (32, 64, 128, 256)  # group sizes torch's int4pack kernels accept


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


class QuantLinearBase(nn.Module, abc.ABC):
    """Shared shard bookkeeping: tensor-name checks, bias rows, staging until ``finalize``."""

    def __init__(self, scheme: QuantScheme, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.scheme = scheme
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.dtype = dtype
        # Follows the module through ``.to()`` / ``to_empty()`` so finalize knows the target device.
        self.register_buffer("_device_probe", torch.empty(0), persistent=False)
        self.bias = nn.Parameter(torch.zeros(self.output_size, dtype=dtype), requires_grad=False) if bias else None
        self._staged: dict[int, dict[str, torch.Tensor]] = {}
        self._bias_loaded: set[int] = set()
        self._finalized = False
        # quantized tensors whose one copy is a CPU kernel's panels: name → (the panels' buffer, how
        # to read them back)
        self._in_panels: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {}

    @abc.abstractmethod
    def expected_tensors(self) -> tuple[set[str], set[str]]:
        """(required, optional) checkpoint suffixes of one shard, bias excluded."""
        ...

    @abc.abstractmethod
    def _read_shard(self, where: str, rows: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Validate one shard's tensors and return them in canonical form for ``_build``."""
        ...

    @abc.abstractmethod
    def _build(self, shards: list[dict[str, torch.Tensor]]) -> None:
        """Merge canonical shard tensors into buffers and prepare the kernel."""
        ...

    def load_shard(self, shard_id: int, tensors: dict[str, torch.Tensor]) -> None:
        if self._finalized:
            raise ValueError("load_shard after finalize")
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard {shard_id} out of range for {len(self.output_sizes)} shard(s)")
        if shard_id in self._staged:
            raise ValueError(f"shard {shard_id} loaded twice")
        required, optional = self.expected_tensors()
        names = set(tensors) - {"bias"}
        unknown, missing = names - required - optional, required - names
        if unknown:
            raise ValueError(f"shard {shard_id}: unexpected tensors {sorted(unknown)} for scheme {self.scheme}")
        if missing:
            raise ValueError(f"shard {shard_id}: missing tensors {sorted(missing)} for scheme {self.scheme}")
        rows = self.output_sizes[shard_id]
        if "bias" in tensors:
            if self.bias is None:
                raise ValueError(f"shard {shard_id} 'bias': checkpoint has a bias for a Linear built without one")
            if _shape(tensors["bias"]) != (rows,):
                raise ValueError(f"shard {shard_id} 'bias': shape {_shape(tensors['bias'])} != ({rows},)")
            start = sum(self.output_sizes[:shard_id])
            self.bias.data[start : start + rows].copy_(tensors["bias"])
            self._bias_loaded.add(shard_id)
        staged = {k: v for k, v in tensors.items() if k != "bias"}
        self._staged[shard_id] = self._read_shard(f"shard {shard_id}", rows, staged)

    def finalize(self) -> None:
        missing = set(range(len(self.output_sizes))) - set(self._staged)
        if missing:
            raise ValueError(f"shards {sorted(missing)} were never loaded")
        if self.bias is not None and len(self._bias_loaded) != len(self.output_sizes):
            unset = sorted(set(range(len(self.output_sizes))) - self._bias_loaded)
            raise ValueError(f"shards {unset}: 'bias' missing for a Linear built with a bias")
        device = self._device_probe.device
        shards = [{k: v.to(device) for k, v in self._staged[i].items()} for i in range(len(self.output_sizes))]
        self._build(shards)
        self._staged = {}
        self._finalized = True

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _hand_to_kernel(self, name: str, unpack: Callable[[torch.Tensor], torch.Tensor],
                        panels: str = "kernel_weight") -> None:
        """Drop buffer `name`: the kernel's buffer `panels` holds the same values, and is the one
        copy kept (the two together held an int4 weight in three times its packed bytes, an fp8
        one in twice, group scales twice); `stored` reads them back, for the oracle."""
        self._buffers.pop(name, None)
        self._in_panels[name] = (panels, unpack)

    def stored(self, name: str) -> torch.Tensor | None:
        """A quantized tensor as loaded (None: a zero point the scheme lacks): its buffer, or read
        back from the kernel's panels."""
        if name not in self._in_panels:
            return getattr(self, name)
        panels, unpack = self._in_panels[name]
        return unpack(getattr(self, panels))

    def prepack(self) -> int:
        """Lay a dequantized fallback weight out for CPU GEMMs, as the engine does for dense layers
        (returns the bytes of the plain weight freed, 0 if none)."""
        dense = getattr(self, "weight_dense", None)
        if dense is None or dense.dim() != 2 or (packed := panel_matmul.pack(dense)) is None:
            return 0
        self.weight_dense = packed
        return dense.numel() * dense.element_size()

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, kernel={getattr(self, 'kernel', None)}"


# ---------------------------------------------------------------- shard tensor checks


def _check(where: str, name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if _shape(t) != shape:
        raise ValueError(f"{where} '{name}': shape {_shape(t)} != expected {shape}")
    if t.dtype not in dtypes:
        raise ValueError(f"{where} '{name}': dtype {t.dtype} not in {[str(d) for d in dtypes]}")


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _read_scale(where: str, t: torch.Tensor, rows: int, n_groups: int, strategy: str,
                name: str = "weight_scale") -> torch.Tensor:
    """A weight scale of any strategy as fp32 [rows, n_groups] (block: [row tiles, column tiles])."""
    if t.dtype not in _FLOATS:
        raise ValueError(f"{where} '{name}': dtype {t.dtype} is not a float scale")
    if strategy == "tensor":
        if t.numel() != 1 or t.dim() > 1:
            raise ValueError(f"{where} '{name}': per-tensor scale must have shape [1] or [], got {_shape(t)}")
        scale = t.float().reshape(1, 1).expand(rows, 1)
    elif strategy == "channel":
        if _shape(t) not in ((rows, 1), (rows,)):
            raise ValueError(f"{where} '{name}': per-channel scale shape {_shape(t)} != ({rows}, 1)")
        scale = t.float().reshape(rows, 1)
    else:
        _check(where, name, t, (rows, n_groups), _FLOATS)
        scale = t.float()
    if not torch.isfinite(scale).all() or (scale <= 0).any():
        raise ValueError(f"{where} '{name}': scales must be finite and positive")
    return scale.contiguous()


def _read_scalar_scale(where: str, name: str, t: torch.Tensor,
                       dtypes: tuple[torch.dtype, ...] = _FLOATS) -> torch.Tensor:
    """A per-tensor scale stored as one number ([1] or []), as fp32 [1]; finite and positive."""
    if t.numel() != 1 or t.dim() > 1 or t.dtype not in dtypes:
        raise ValueError(f"{where} '{name}': expected one {'/'.join(str(d) for d in dtypes)}, got {t.dtype} {_shape(t)}")
    if not torch.isfinite(t).all() or t.item() <= 0:
        raise ValueError(f"{where} '{name}': must be finite and positive, got {t.item()}")
    return t.float().reshape(1)


def _read_int_weight(where: str, scheme: QuantScheme, rows: int, cols: int, tensors: dict) -> dict[str, torch.Tensor]:
    """int8 values [rows, cols], fp32 scale [rows, G], int8 zero point [rows, G] | None, g_idx [cols] | None."""
    w = scheme.weights
    n_groups = num_groups(cols, w.group_size)
    qmin, qmax = int_range(w.num_bits)
    if scheme.format == "pack-quantized":
        _check(where, "weight_shape", tensors["weight_shape"], (2,), (torch.int64, torch.int32))
        if tensors["weight_shape"].tolist() != [rows, cols]:
            raise ValueError(f"{where} 'weight_shape': {tensors['weight_shape'].tolist()} != [{rows}, {cols}]")
        words = -(-cols * w.num_bits // 32)
        _check(where, "weight_packed", tensors["weight_packed"], (rows, words), (torch.int32,))
        q = unpack_int32(tensors["weight_packed"], w.num_bits, (rows, cols))
    else:
        _check(where, "weight", tensors["weight"], (rows, cols), (torch.int8,))
        q = tensors["weight"]
        if w.num_bits < 8 and (q.min() < qmin or q.max() > qmax):
            raise ValueError(f"{where} 'weight': values outside [{qmin}, {qmax}] for int{w.num_bits}")
    out = {"q": q, "scale": _read_scale(where, tensors["weight_scale"], rows, n_groups, w.strategy)}
    if not w.symmetric:
        zp = tensors["weight_zero_point"]
        if scheme.format == "pack-quantized" and w.strategy in ("group", "channel"):
            zp_words = -(-rows * w.num_bits // 32)
            _check(where, "weight_zero_point", zp, (zp_words, n_groups), (torch.int32,))
            zp = unpack_int32(zp, w.num_bits, (rows, n_groups), dim=0)
        elif w.strategy == "tensor":
            if zp.numel() != 1:
                raise ValueError(f"{where} 'weight_zero_point': per-tensor zero point must have one element")
            zp = zp.reshape(1, 1).expand(rows, 1)
        else:
            _check(where, "weight_zero_point", zp, (rows, n_groups), (torch.int8,))
        zp = zp.to(torch.int8)
        if zp.min() < qmin or zp.max() > qmax:
            raise ValueError(f"{where} 'weight_zero_point': values outside [{qmin}, {qmax}]")
        out["zero_point"] = zp.contiguous()
    if "weight_g_idx" in tensors:
        g_idx = tensors["weight_g_idx"]
        _check(where, "weight_g_idx", g_idx, (cols,), (torch.int32, torch.int64))
        if g_idx.min() < 0 or g_idx.max() >= n_groups:
            raise ValueError(f"{where} 'weight_g_idx': group indices outside [0, {n_groups})")
        out["g_idx"] = g_idx.long()
    return out


def _int_weight_names(scheme: QuantScheme) -> tuple[set[str], set[str]]:
    w = scheme.weights
    required = {"weight_packed", "weight_shape"} if scheme.format == "pack-quantized" else {"weight"}
    required.add("weight_scale")
    if not w.symmetric:
        required.add("weight_zero_point")
    if w.actorder == "group":
        required.add("weight_g_idx")
    optional = {"weight_g_idx"} if w.strategy == "group" else set()
    return required, optional


def _merge_int_shards(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor | None]:
    g_idx = shards[0].get("g_idx")
    for s in shards[1:]:
        other = s.get("g_idx")
        if (g_idx is None) != (other is None) or (g_idx is not None and not torch.equal(g_idx, other)):
            # Fused shards share one input, so their activation order must agree (vLLM assumes it too).
            raise ValueError("fused shards have different weight_g_idx")
    has_zp = "zero_point" in shards[0]
    return {
        "q": torch.cat([s["q"] for s in shards]),
        "scale": torch.cat([s["scale"] for s in shards]),
        "zero_point": torch.cat([s["zero_point"] for s in shards]) if has_zp else None,
        "g_idx": g_idx,
    }


# ---------------------------------------------------------------- FP8 W8A8 / W8A16


class Fp8Linear(QuantLinearBase):
    """FP8 weights (per-tensor or per-channel scale), optional FP8 input activations.

    Input activations are dynamic per token, dynamic per tensor, or static per tensor
    (``input_scale``; fused shards use the max, as vLLM does).

    Kernels: CUDA runs ``torch._scaled_mm`` with row-wise scales (needs sm89+, in and out
    multiples of 16), activations quantized per token in one Triton pass, and for one row a
    Triton GEMV that streams the weight (quant/triton_fp8.py). CPUs (fp32 model) stream the fp8
    bytes as they are and widen them exactly in the kernel (torch's FP8 matmul is 6-48x slower
    than fp32 here): with FP8 activations and AVX-512 BF16, ``panel_matmul_fp8_dot``
    (engine/csrc/panel_matmul.c) rounds the rows through fp8 itself and multiplies fp8 values as
    bf16 (exact products, twice the fp32 FMA rate); otherwise ``panel_matmul_fp8_rounded`` rounds
    them in C too and widens the weight to fp32. Either way served numerics match an FP8 GPU
    kernel up to accumulation order. Elsewhere the weight is dequantized once at ``finalize``.
    """

    def expected_tensors(self) -> tuple[set[str], set[str]]:
        acts = self.scheme.input_activations
        required = {"weight", "weight_scale"}
        if acts is not None and not acts.dynamic:
            required.add("input_scale")
        return required, set()

    def _read_shard(self, where: str, rows: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        _check(where, "weight", tensors["weight"], (rows, self.input_size), (FP8_DTYPE,))
        out = {
            "weight": tensors["weight"],
            "scale": _read_scale(where, tensors["weight_scale"], rows, 1, self.scheme.weights.strategy),
        }
        if "input_scale" in tensors:
            out["input_scale"] = _read_scalar_scale(where, "input_scale", tensors["input_scale"])
        return out

    def _build(self, shards: list[dict[str, torch.Tensor]]) -> None:
        self.register_buffer("weight", torch.cat([s["weight"] for s in shards]), persistent=False)  # [out, in] fp8
        self.register_buffer("weight_scale", torch.cat([s["scale"] for s in shards]), persistent=False)  # [out, 1]
        input_scale = torch.stack([s["input_scale"] for s in shards]).amax().reshape(1) if "input_scale" in shards[0] else None
        self.register_buffer("input_scale", input_scale, persistent=False)  # [1] | None
        dims_ok = self.input_size % 16 == 0 and self.output_size % 16 == 0
        fp8_gpu = self.weight.is_cuda and torch.cuda.get_device_capability(self.weight.device) >= (8, 9)
        if fp8_gpu and self.scheme.input_activations is not None and dims_ok:
            self.kernel = "scaled_mm"
            self.register_buffer("scale_b", self.weight_scale.float().t().contiguous(), persistent=False)  # [1, out]
        elif (self.dtype == torch.float32 and self.weight.device.type == "cpu"
              and self.scheme.input_activations is not None and panel_matmul.fp8_dot_fits(self.output_size)):
            self.kernel = "fp8dot"
            panels, scales = panel_matmul.pack_fp8_pairs(self.weight, self.weight_scale)
            self.register_buffer("kernel_weight", panels, persistent=False)
            self.register_buffer("kernel_scales", scales, persistent=False)
            self._hand_to_kernel("weight", functools.partial(panel_matmul.unpack_fp8_pairs, k=self.input_size))
        elif (self.dtype == torch.float32 and self.weight.device.type == "cpu"
              and panel_matmul.int8_fits(self.output_size, self.input_size, 1)):
            self.kernel = "fp8panel"
            panels, scales = panel_matmul.pack_fp8(self.weight, self.weight_scale)
            self.register_buffer("kernel_weight", panels, persistent=False)
            self.register_buffer("kernel_scales", scales, persistent=False)
            self._hand_to_kernel("weight", panel_matmul.unpack_fp8)
        else:
            self.kernel = "dense"
            self.register_buffer("weight_dense", self.dequantized_weight(self.dtype), persistent=False)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.stored("weight").float() * self.weight_scale).to(dtype)  # [out, in]

    def _act_scale(self, x2d: torch.Tensor) -> torch.Tensor:
        acts = self.scheme.input_activations
        if not acts.dynamic:
            return self.input_scale
        return fp8_scale(x2d, acts.strategy)  # token: [M, 1]; tensor: [1]

    def input_rounding(self) -> tuple[int, float, int]:
        """How the C kernels round this Linear's inputs: (panel_matmul.ACT_*, the static scale or 0,
        columns per token scale or 0 for the whole row)."""
        acts = self.scheme.input_activations
        if acts is None:
            return panel_matmul.ACT_NONE, 0.0, 0
        if not acts.dynamic:
            return panel_matmul.ACT_FP8_STATIC, float(self.input_scale), 0
        return (panel_matmul.ACT_FP8_TENSOR if acts.strategy == "tensor" else panel_matmul.ACT_FP8_TOKEN), 0.0, 0

    def _quantize_input(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.scheme.input_activations is None:
            return x2d
        return fake_quantize_fp8(x2d, self._act_scale(x2d))

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.input_size).float()
        y = F.linear(self._quantize_input(x2d), self.dequantized_weight())
        return self._add_bias(y).to(x.dtype).reshape(*x.shape[:-1], self.output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.input_size)
        if self.kernel == "scaled_mm":
            acts = self.scheme.input_activations
            if acts.dynamic and acts.strategy == "token" and triton_support.available(x2d.device):
                x8, sx = triton_fp8.quantize_per_token(x2d)  # one fused pass
            else:
                sx = self._act_scale(x2d).float().expand(x2d.shape[0], 1).contiguous()  # [M, 1]
                x8 = quantize_fp8(x2d, sx)
            # mat2 must be column-major: weight is [out, in] row-major, so its transpose is.
            # Row-wise scaling only produces bf16.
            if x8.shape[0] == 1 and triton_support.available(x8.device):
                y = triton_fp8.scaled_gemv(x8, sx, self.weight, self.scale_b)  # batch-1 decode: a pass over W
            else:
                y = torch._scaled_mm(x8, self.weight.t(), scale_a=sx, scale_b=self.scale_b,
                                     out_dtype=torch.bfloat16)
        elif self.kernel in ("fp8dot", "fp8panel"):  # the C kernels round the inputs and add the bias
            act, static_scale, act_group = self.input_rounding()
            if self.kernel == "fp8dot":
                y = panel_matmul.matmul_fp8_dot(x2d, self.kernel_weight, self.kernel_scales, act, static_scale,
                                                bias=self.bias)
            else:
                y = panel_matmul.matmul_fp8(x2d, self.kernel_weight, self.kernel_scales, act, static_scale, act_group,
                                            bias=self.bias)
            return y.to(x.dtype).reshape(*x.shape[:-1], self.output_size)
        else:
            y = dense_matmul(self._quantize_input(x2d).to(self.dtype), self.weight_dense)
        return self._add_bias(y).to(x.dtype).reshape(*x.shape[:-1], self.output_size)


class Fp8BlockLinear(Fp8Linear):
    """FP8 weights in tiles of ``block_structure`` (rows, columns) with one scale each (the
    checkpoint's ``weight_scale``, or transformers' ``weight_scale_inv``: multiplied all the
    same), and with input activations, FP8 inputs scaled per token and group of the tile's width.

    Tile scales are spread to one per output channel and group of columns (the tile's width, or
    its divisor that also divides the input size where the last tile is partial), the layout of
    the CPU kernels, which stream the fp8 bytes and round the inputs per token and group
    themselves: with FP8 inputs and AVX-512 BF16 ``fp8dot-groups`` (fp8 products exact in bf16,
    each group summed on its own and scaled), else (weight-only, or no AVX-512 BF16) the grouped
    fp8 kernel (``fp8panel``, the weight widened to fp32). Either way the numerics of a block-FP8 GPU kernel up to accumulation order.
    Elsewhere the weight is dequantized once at ``finalize`` and the dense path multiplies it,
    the fp8 bytes kept on the CPU for the oracle.
    """

    def expected_tensors(self) -> tuple[set[str], set[str]]:
        return {"weight"}, {"weight_scale", "weight_scale_inv"}

    def _read_shard(self, where: str, rows: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = [n for n in ("weight_scale", "weight_scale_inv") if n in tensors]
        if len(names) != 1:
            raise ValueError(f"{where}: a block FP8 weight needs one of 'weight_scale' or 'weight_scale_inv', "
                             f"got {names or 'neither'}")
        _check(where, "weight", tensors["weight"], (rows, self.input_size), (FP8_DTYPE,))
        block_rows, block_cols = self.scheme.weights.block_structure
        scale = _read_scale(where, tensors[names[0]], -(-rows // block_rows), -(-self.input_size // block_cols),
                            "block", names[0])
        return {"weight": tensors["weight"], "scale": scale}

    def _build(self, shards: list[dict[str, torch.Tensor]]) -> None:
        block_rows, block_cols = self.scheme.weights.block_structure
        self.group = math.gcd(block_cols, self.input_size)
        columns = self.input_size // self.group
        # each shard's tiles to [its rows, groups of columns]: fused shards' last row tiles may be partial
        scale = torch.cat([spread_tiles(shard["scale"], (block_rows, block_cols // self.group),
                                        (shard["weight"].shape[0], columns)) for shard in shards])
        weight = torch.cat([shard["weight"] for shard in shards])
        cpu = self.dtype == torch.float32 and weight.device.type == "cpu"
        if cpu and self.scheme.input_activations is not None and panel_matmul.fp8_dot_groups_fits(
                self.output_size, self.input_size, self.group, block_cols):
            self.kernel = "fp8dot-groups"
            panels, scales = panel_matmul.pack_fp8_pair_groups(weight, scale)
            unpack, unpack_scales = (functools.partial(panel_matmul.unpack_fp8_pairs, k=self.input_size),
                                     panel_matmul.unpack_panels)
        elif cpu and panel_matmul.int8_fits(self.output_size, self.input_size, columns):
            self.kernel = "fp8panel"
            panels, scales = panel_matmul.pack_fp8(weight, scale)
            unpack, unpack_scales = panel_matmul.unpack_fp8, _unpack_fp8_scales
        else:
            panels = None
        if panels is not None:
            self.register_buffer("kernel_weight", panels, persistent=False)
            self.register_buffer("kernel_scales", scales, persistent=False)
            self._hand_to_kernel("weight", unpack)  # [out, in] fp8
            self._hand_to_kernel("weight_scale", unpack_scales, "kernel_scales")  # [out, in / group]
        else:
            self.kernel = "dense"
            # the fp8 bytes for the oracle stay on the CPU, not beside the dense weight on a GPU
            self.weight, self.weight_scale = weight.cpu(), scale.cpu()
            self.register_buffer("weight_dense", self.dequantized_weight(self.dtype), persistent=False)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        weight = self.stored("weight").float() * self.stored("weight_scale").repeat_interleave(self.group, 1)
        return weight.to(dtype=dtype, device=self._device_probe.device)

    def input_rounding(self) -> tuple[int, float, int]:
        act, static_scale, _ = super().input_rounding()
        return act, static_scale, self.scheme.weights.block_structure[1] if act != panel_matmul.ACT_NONE else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel != "fp8dot-groups":
            return super().forward(x)
        y = panel_matmul.matmul_fp8_dot_groups(x.reshape(-1, self.input_size), self.kernel_weight, self.kernel_scales,
                                               self.scheme.weights.block_structure[1], bias=self.bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.output_size)

    def _quantize_input(self, x2d: torch.Tensor) -> torch.Tensor:
        """Each token's groups of the tile's width rounded through FP8, each with its own scale."""
        if self.scheme.input_activations is None:
            return x2d
        width = self.scheme.input_activations.group_size
        rows, cols = x2d.shape
        groups = F.pad(x2d, (0, -cols % width)).reshape(rows, -(-cols // width), width)
        return fake_quantize_fp8(groups, fp8_scale(groups, "token")).reshape(rows, groups.shape[1] * width)[:, :cols]


def _unpack_fp8_scales(panels: torch.Tensor) -> torch.Tensor:
    """`pack_fp8`'s scale panels (stored times 256 for the kernel) → the scales [N, G]."""
    return panel_matmul.unpack_panels(panels) / 256


def _unpack_zero_points(panels: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s zero-point panels (floats) → the zero points [N, G] as loaded (int8)."""
    return panel_matmul.unpack_panels(panels).to(torch.int8)


# ---------------------------------------------------------------- INT4 / INT8 weight-only


class _IntWeightLinear(QuantLinearBase):
    """Shared loading for the schemes that store integer weights (weight-only and W8A8)."""

    def expected_tensors(self) -> tuple[set[str], set[str]]:
        return _int_weight_names(self.scheme)

    def _read_shard(self, where: str, rows: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return _read_int_weight(where, self.scheme, rows, self.input_size, tensors)


class WeightOnlyIntLinear(_IntWeightLinear):
    """W4A16 / W8A16: int weights (tensor/channel/group, sym or asym, optional g_idx), float activations.

    Kernels, chosen at ``finalize`` by device and model dtype:
    - CPU, fp32 model: ``panel_matmul_i4`` (engine/csrc/panel_matmul.c) for int4, two weights a
      byte with their group scales (and zero points, subtracted as each weight is widened), fp32
      arithmetic; ``panel_matmul_i8`` otherwise, int8 panels (zero points folded into q).
    - CPU, bf16 model: ``torch._weight_int4pack_mm_for_cpu`` (int4, consecutive groups of
      32/64/128/256 dividing in, out a multiple of 16) or ``torch._weight_int8pack_mm`` (symmetric per-channel int8).
      These beat fp32 only with bf16 activations (10-80x slower with fp32).
    - CUDA, bf16 model: ``torch._weight_int4pack_mm`` for the same int4 layouts.
    - Otherwise (fp32 model, g_idx, odd groups): the weight is dequantized once to the model
      dtype, trading memory for exactness.
    """

    def _build(self, shards: list[dict[str, torch.Tensor]]) -> None:
        merged = _merge_int_shards(shards)
        self.register_buffer("qweight", merged["q"], persistent=False)  # [out, in] int8
        self.register_buffer("weight_scale", merged["scale"], persistent=False)  # [out, G] fp32
        self.register_buffer("weight_zero_point", merged["zero_point"], persistent=False)  # [out, G] int8 | None
        self.register_buffer("g_idx", merged["g_idx"], persistent=False)  # [in] | None
        self.kernel = self._pick_kernel()
        if self.kernel == "int8pack":
            self.register_buffer("kernel_scales", self.weight_scale[:, 0].to(torch.bfloat16), persistent=False)
        elif self.kernel == "int4panel":
            panels, scales, zeros = panel_matmul.pack_int4(self.qweight, self.weight_scale, self.weight_zero_point)
            self.register_buffer("kernel_weight", panels, persistent=False)
            self.register_buffer("kernel_scales", scales, persistent=False)
            self.register_buffer("kernel_zeros", zeros, persistent=False)
            self._hand_to_kernel("qweight", panel_matmul.unpack_int4)
            self._hand_to_kernel("weight_scale", panel_matmul.unpack_panels, "kernel_scales")
            if zeros is not None:
                self._hand_to_kernel("weight_zero_point", _unpack_zero_points, "kernel_zeros")
        elif self.kernel == "int8panel":
            panels, scales = panel_matmul.pack_int8(self._zero_folded(), self.weight_scale)
            self.register_buffer("kernel_weight", panels, persistent=False)
            self.register_buffer("kernel_scales", scales, persistent=False)
            self._hand_to_kernel("weight_scale", panel_matmul.unpack_panels, "kernel_scales")
            if self.weight_zero_point is None:  # else the panels hold q − zero point
                self._hand_to_kernel("qweight", panel_matmul.unpack_panels)
        elif self.kernel.startswith("int4pack"):
            self._prepare_int4pack()
        else:
            self.register_buffer("weight_dense", self.dequantized_weight(self.dtype), persistent=False)

    def _zero_folded(self) -> torch.Tensor:
        """q − zero point per group (fits int8 for up to 7-bit schemes), or q when symmetric."""
        if self.weight_zero_point is None:
            return self.qweight
        group = self.input_size // self.weight_zero_point.shape[1]
        zp = self.weight_zero_point.to(torch.int16).repeat_interleave(group, dim=1)
        return (self.qweight.to(torch.int16) - zp).to(torch.int8)

    def _pick_kernel(self) -> str:
        w = self.scheme.weights
        group = w.group_size or self.input_size
        if (self.dtype == torch.float32 and self.g_idx is None and not self.qweight.is_cuda
                and (self.weight_zero_point is None or w.num_bits <= 7)
                and panel_matmul.int8_fits(self.output_size, self.input_size, self.weight_scale.shape[1])):
            if (w.is_int4
                    and panel_matmul.int4_fits(self.output_size, self.input_size, self.weight_scale.shape[1])):
                return "int4panel"
            return "int8panel"
        if self.dtype != torch.bfloat16 or self.g_idx is not None:
            return "dense"
        if w.is_int4 and group in _INT4PACK_GROUPS and self.input_size % group == 0:
            if self.qweight.is_cuda:
                return "int4pack_cuda" if self.output_size % 8 == 0 and self.input_size % 32 == 0 else "dense"
            return "int4pack_cpu" if self.output_size % 16 == 0 else "dense"
        if w.num_bits == 8 and w.symmetric and w.strategy != "group" and not self.qweight.is_cuda:
            return "int8pack"
        return "dense"

    def _prepare_int4pack(self) -> None:
        group = self.scheme.weights.group_size or self.input_size
        n_groups = self.input_size // group
        scale = self.weight_scale.expand(-1, n_groups)  # [out, K/G]
        # The int4pack kernels compute (u − 8)·scale + zero with u = q + 8, so zero = −zp·scale.
        zp = self.weight_zero_point
        zero = torch.zeros_like(scale) if zp is None else -zp.float().expand(-1, n_groups) * scale
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/G, out, 2]
        self.register_buffer("kernel_scales", scales_and_zeros, persistent=False)
        u = (self.qweight.to(torch.int32) + 8).contiguous()  # [out, in] in 0..15
        if self.kernel == "int4pack_cpu":
            packed = torch._convert_weight_to_int4pack_for_cpu(u, 1)
        else:
            # The CUDA layout tiles K by inner_k_tiles·16 columns.
            inner_k_tiles = 8 if self.input_size % 128 == 0 else 4 if self.input_size % 64 == 0 else 2
            u8 = ((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8)  # [out, in/2], even column in the high nibble
            packed = torch._convert_weight_to_int4pack(u8, inner_k_tiles)
        self.register_buffer("kernel_weight", packed, persistent=False)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int(
            self.stored("qweight"), self.stored("weight_scale"), self.stored("weight_zero_point"),
            group_size=self.scheme.weights.group_size, g_idx=self.g_idx, dtype=dtype,
        )  # [out, in]

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x.float(), self.dequantized_weight())
        return self._add_bias(y).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "dense":
            return self._add_bias(dense_matmul(x.to(self.dtype), self.weight_dense)).to(x.dtype)
        if self.kernel == "int4panel":
            return panel_matmul.matmul_int4(x, self.kernel_weight, self.kernel_scales, self.kernel_zeros,
                                            self.bias).to(x.dtype)
        if self.kernel == "int8panel":
            return panel_matmul.matmul_int8(x, self.kernel_weight, self.kernel_scales, self.bias).to(x.dtype)
        x2d = x.reshape(-1, self.input_size).to(torch.bfloat16)
        if self.kernel == "int8pack":
            y = torch._weight_int8pack_mm(x2d, self.qweight, self.kernel_scales)
        else:
            group = self.scheme.weights.group_size or self.input_size
            mm = torch._weight_int4pack_mm_for_cpu if self.kernel == "int4pack_cpu" else torch._weight_int4pack_mm
            y = mm(x2d, self.kernel_weight, group, self.kernel_scales)
        return self._add_bias(y).to(x.dtype).reshape(*x.shape[:-1], self.output_size)


class Fp4Linear(WeightOnlyIntLinear):
    """FP4 weights, NVFP4 or MXFP4 (quant/fp4.py). An E2M1 value times two is an integer of at most
    12 in magnitude, so each weight becomes that int8 and its group's scale half the group's
    effective scale: the same products, bit for bit, through the weight-only int8 kernels (on the
    CPU the int8 panel kernel; elsewhere the weight dequantized once). NVFP4's fused shards may
    each have their own global scale here; vLLM needs them equal, which is how `quantize` writes
    them.

    With FP4 activations (W4A4) each input row is first rounded to E2M1 in its groups (NVFP4:
    under the checkpoint's input global scale), as an FP4 GPU computes (emulated: the products
    then run as above), so the gate measures what that GPU would serve."""

    fake_quantizes_inputs = False  # the one-call C decode step runs only Linears whose inputs it need not touch

    @property
    def _nvfp4(self) -> bool:
        return self.scheme.weights.fp4_kind == "nvfp4"

    def expected_tensors(self) -> tuple[set[str], set[str]]:
        names = {"weight_packed", "weight_scale"} | ({"weight_global_scale"} if self._nvfp4 else set())
        return (names | {"input_global_scale"} if self._nvfp4 and self.scheme.input_activations else names), set()

    def _read_shard(self, where: str, rows: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cols = self.input_size
        kind = fp4.SCALINGS[self.scheme.weights.fp4_kind]
        if cols % kind.group_size:
            raise ValueError(f"{where}: {kind.name} needs an input size that is a multiple of {kind.group_size}, "
                             f"got {cols}")
        _check(where, "weight_packed", tensors["weight_packed"], (rows, cols // 2), (torch.uint8,))
        _check(where, "weight_scale", tensors["weight_scale"], (rows, cols // kind.group_size), (kind.scale_dtype,))
        if self._nvfp4:
            scaling = fp4.Nvfp4(_read_scalar_scale(where, "weight_global_scale", tensors["weight_global_scale"],
                                                   (torch.float32,)))
        else:
            scaling = fp4.Mxfp4()
        scale = scaling.effective(tensors["weight_scale"]) / 2
        if not torch.isfinite(scale).all():
            raise ValueError(f"{where} 'weight_scale': group scales must be finite")
        q = (fp4.values(fp4.unpack(tensors["weight_packed"])) * 2).to(torch.int8)
        shard = {"q": q, "scale": scale.contiguous()}
        if self._nvfp4 and self.scheme.input_activations:
            shard["input_global_scale"] = _read_scalar_scale(where, "input_global_scale",
                                                             tensors["input_global_scale"], (torch.float32,))
        return shard

    def _build(self, shards: list[dict[str, torch.Tensor]]) -> None:
        super()._build(shards)
        if not self.scheme.input_activations:
            return
        self.fake_quantizes_inputs = True
        if self._nvfp4:
            inputs = {s["input_global_scale"].item() for s in shards}
            if len(inputs) != 1:  # fused shards read one input: one scale for it
                raise ValueError(f"fused shards have different input_global_scale values {sorted(inputs)}")
            self.register_buffer("input_global_scale", shards[0]["input_global_scale"].float(), persistent=False)

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fake_quantizes_inputs:
            return x
        return fp4.fake_quantize(x, fp4.Nvfp4(self.input_global_scale) if self._nvfp4 else fp4.Mxfp4())

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().reference_forward(self._inputs(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self._inputs(x))


# ---------------------------------------------------------------- INT8 W8A8


def _token_scales(x2d: torch.Tensor) -> torch.Tensor:
    """[M, 1] per-token int8 scales, absmax / 127 (vLLM's dynamic int8 activations)."""
    return (x2d.abs().amax(-1, keepdim=True) / 127).clamp(min=_EPS)


class Int8Linear(_IntWeightLinear):
    """W8A8 / W4A8 INT (``int-quantized``): symmetric int8 weights per channel, or int4 weights per
    channel or group, dynamic per-token int8 inputs.

    The oracle quantizes each token with scale absmax/127 (vLLM's runtime kernel). Kernels:
    - CPU (AVX2 and up): ``panel_matmul_w8a8`` (engine/csrc/panel_matmul.c) quantizes each row
      exactly as the oracle does and multiplies in integers: the oracle up to fp32 rounding of
      the final scaling, the same floats with or without AVX-512 VNNI. Int4 weights run on
      ``panel_matmul_w4a8``: the same products on nibble panels, each group's integer dot scaled
      by its scale.
    - CUDA: per-token quantization and ``torch._int_mm`` (in and out multiples of 8).
    - Elsewhere (other shapes, other CPUs, act-order int4, int4 on CUDA) the oracle, over the weight
      dequantized once. (fbgemm's dynamic int8 GEMM, which torch offers on CPUs, quantizes its
      whole input to one 7-bit range: a loud token flattens its batch's other rows, and a row's
      floats depend on what shares its batch.)
    """

    def _build(self, shards: list[dict[str, torch.Tensor]]) -> None:
        merged = _merge_int_shards(shards)
        self.register_buffer("qweight", merged["q"], persistent=False)  # [out, in] int8
        self.register_buffer("weight_scale", merged["scale"], persistent=False)  # [out, G] fp32
        self.register_buffer("g_idx", merged["g_idx"], persistent=False)  # [in] | None
        if self.scheme.weights.is_int4:
            self._build_int4()
        elif self.qweight.is_cuda and self.input_size % 8 == 0 and self.output_size % 8 == 0:
            self.kernel = "int_mm"  # cuBLASLt's int8 GEMM needs in and out multiples of 8
        elif not self.qweight.is_cuda and panel_matmul.w8a8_fits(self.output_size, self.input_size):
            self.kernel = "w8a8panel"
            panels, sums = panel_matmul.pack_w8a8(self.qweight)
            self.register_buffer("kernel_weight", panels, persistent=False)
            self.register_buffer("kernel_sums", sums, persistent=False)
            self.register_buffer("kernel_scales", self.weight_scale[:, 0].contiguous(), persistent=False)
            self._hand_to_kernel("qweight", panel_matmul.unpack_panels)
        else:
            self._use_reference()

    def _build_int4(self) -> None:
        group = self.scheme.weights.group_size or self.input_size
        if self.g_idx is None and not self.qweight.is_cuda and panel_matmul.w4a8_fits(
                self.output_size, self.input_size, group):
            self.kernel = "w4a8panel"
            panels, sums, scales = panel_matmul.pack_w4a8(self.qweight, self.weight_scale.expand(
                -1, self.input_size // group))
            self.register_buffer("kernel_weight", panels, persistent=False)
            self.register_buffer("kernel_sums", sums, persistent=False)
            self.register_buffer("kernel_scales", scales, persistent=False)
            self._hand_to_kernel("qweight", panel_matmul.unpack_w4a8)
            if self.scheme.weights.strategy == "group":  # a channel's scale is spread to every group there
                self._hand_to_kernel("weight_scale", panel_matmul.unpack_panels, "kernel_scales")
        else:
            self._use_reference()

    def _use_reference(self) -> None:
        self.kernel = "reference"
        self.register_buffer("weight_dense", self.dequantized_weight(), persistent=False)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int(self.stored("qweight"), self.stored("weight_scale"), None,
                              group_size=self.scheme.weights.group_size,
                              g_idx=self.g_idx, dtype=dtype)  # [out, in]

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.input_size).float()
        s = _token_scales(x2d)
        xq = torch.round(x2d / s).clamp(-127, 127) * s
        weight = getattr(self, "weight_dense", None)
        y = dense_matmul(xq, self.dequantized_weight() if weight is None else weight)  # prepacked on CPU
        return self._add_bias(y).to(x.dtype).reshape(*x.shape[:-1], self.output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "reference":
            return self.reference_forward(x)
        if self.kernel == "w4a8panel":
            y = panel_matmul.matmul_w4a8(x, self.kernel_weight, self.kernel_sums, self.kernel_scales, self.bias)
            return y.to(x.dtype)
        if self.kernel == "w8a8panel":
            y = panel_matmul.matmul_w8a8(x, self.kernel_weight, self.kernel_sums, self.kernel_scales, self.bias)
            return y.to(x.dtype)
        x2d = x.reshape(-1, self.input_size).float()  # "int_mm": cuBLASLt's int8 GEMM on per-token rows
        s = _token_scales(x2d)
        xq = torch.round(x2d / s).clamp(-127, 127).to(torch.int8)
        m = xq.shape[0]
        if m <= 16:  # _int_mm on CUDA needs more than 16 rows
            xq = F.pad(xq, (0, 0, 0, 17 - m))
        acc = torch._int_mm(xq, self.qweight.t())[:m]  # [M, out] int32
        y = acc.float() * s * self.weight_scale.t()
        return self._add_bias(y).to(x.dtype).reshape(*x.shape[:-1], self.output_size)


def make_quantized_linear(
    scheme: QuantScheme, input_size: int, output_sizes: list[int], *, bias: bool, dtype: torch.dtype
) -> QuantLinearBase:
    """The module for ``scheme``; raises ValueError for combinations no kernel here runs."""
    w, acts = scheme.weights, scheme.input_activations
    if w.is_fp4:
        return Fp4Linear(scheme, input_size, output_sizes, bias, dtype)
    if w.type == "float" and w.strategy == "block":
        return Fp8BlockLinear(scheme, input_size, output_sizes, bias, dtype)
    if w.type == "float":
        if w.strategy == "group":
            raise ValueError("FP8 weights need per-tensor or per-channel scales, not groups")
        return Fp8Linear(scheme, input_size, output_sizes, bias, dtype)
    if acts is None:
        return WeightOnlyIntLinear(scheme, input_size, output_sizes, bias, dtype)
    return Int8Linear(scheme, input_size, output_sizes, bias, dtype)  # the scheme refused int8 weight groups
