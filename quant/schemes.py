"""What a quantized tensor means: compressed-tensors ``QuantizationArgs`` / ``QuantizationScheme`` as frozen dataclasses.

We parse and emit the CT JSON ourselves instead of importing compressed-tensors at serve time:
vLLM validates these dicts with pydantic ``extra="forbid"``, so the writer must emit only the
long-standing keys, and the reader must reject what our kernels cannot run instead of guessing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

TYPES = ("int", "float")
# tensor_group: NVFP4's groups under a global scale; block: FP8 tiles of [rows, columns] sharing a scale
WEIGHT_STRATEGIES = ("tensor", "channel", "group", "tensor_group", "block")
# tensor_group: NVFP4 activations, scaled per 16 at run time; group: MXFP4's, per 32, and block FP8's
# per token and group of the weight tile's width
INPUT_STRATEGIES = ("tensor", "token", "tensor_group", "group")
# 4-bit floats: NVFP4 groups 16 columns under a global scale, MXFP4 32 under powers of two
FP4_KINDS = {("tensor_group", 16): "nvfp4", ("group", 32): "mxfp4"}
ACTORDERS = ("group", "weight")
# CT aliases: "dynamic" → "group" (g_idx stored), "static" → "weight" (calibration order only).
_ACTORDER_ALIASES = {"dynamic": "group", "static": "weight", True: "group", False: None}

# Keys CT's QuantizationArgs knows (0.13 and later). Anything else is a foreign format.
_ARGS_KEYS = {
    "num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
    "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype",
}
_SCHEME_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}

FORMATS = ("dense", "float-quantized", "naive-quantized", "int-quantized", "pack-quantized", "nvfp4-pack-quantized",
           "mxfp4-pack-quantized", "mixed-precision")


@dataclass(frozen=True)
class QuantArgs:
    """How one tensor (weights, input activations or KV) is quantized.

    ``group_size`` is set only for the group strategies, ``block_structure`` (rows, columns) only
    for the block strategy (FP8 weights, DeepSeek-V3's and llm-compressor's ``FP8_BLOCK``).
    ``dynamic`` means the scale is computed at run time (no ``*_scale`` tensor in the checkpoint);
    ``"local"`` (NVFP4 activations) that the group scales are, under a calibrated global scale
    (MXFP4's activations, with no global scale, are plainly dynamic).
    """

    type: str = "int"
    num_bits: int = 8
    strategy: str = "tensor"
    group_size: int | None = None
    symmetric: bool = True
    dynamic: bool | str = False  # or "local"
    actorder: str | None = None
    observer: str | None = None
    block_structure: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.type not in TYPES:
            raise ValueError(f"quantization type {self.type!r} is not one of {TYPES}")
        if self.type == "float" and self.num_bits not in (4, 8):
            raise ValueError(f"float quantization supports 8 bits (float8_e4m3fn) or 4 (NVFP4, MXFP4), got {self.num_bits}")
        if self.is_fp4 and (self.strategy, self.group_size) not in FP4_KINDS:
            raise ValueError("4-bit floats are NVFP4 (tensor_group strategy, group_size 16) or MXFP4 (group strategy, "
                             f"group_size 32), got {self.strategy} strategy, group_size {self.group_size}")
        if self.strategy == "tensor_group" and not self.is_fp4:
            raise ValueError("the tensor_group strategy is NVFP4's, and only its")
        nvfp4_dynamic = self.fp4_kind == "nvfp4" and bool(self.dynamic)
        if self.dynamic not in (False, True, "local") or (self.dynamic == "local") != nvfp4_dynamic:
            raise ValueError(f"dynamic {self.dynamic!r}: NVFP4's run-time scales are 'local', and only they")
        if self.type == "int" and self.num_bits not in (4, 8):
            raise ValueError(f"int quantization supports 4 or 8 bits, got {self.num_bits}")
        if self.strategy not in WEIGHT_STRATEGIES + INPUT_STRATEGIES + ("attn_head",):
            raise ValueError(f"unsupported quantization strategy {self.strategy!r}")
        if self.strategy in ("group", "tensor_group"):
            if self.group_size is None or self.group_size <= 0:
                raise ValueError(f"group strategy needs a positive group_size, got {self.group_size}")
        elif self.group_size is not None:
            raise ValueError(f"group_size={self.group_size} is only valid with a group strategy")
        if (self.strategy == "block") != (self.block_structure is not None):
            raise ValueError("the block strategy needs a block_structure [rows, columns], and only it takes one")
        if self.block_structure is not None and (
                len(self.block_structure) != 2 or not all(isinstance(b, int) and b > 0 for b in self.block_structure)
                or self.type != "float" or self.num_bits != 8):
            raise ValueError(f"block quantization is FP8 weights in tiles of two positive sizes, got "
                             f"{self.type}{self.num_bits} block_structure {self.block_structure}")
        if self.strategy == "token" and not self.dynamic:
            raise ValueError("token strategy must be dynamic")
        if self.type == "float" and not self.symmetric:
            raise ValueError("float8 quantization must be symmetric")
        if self.actorder not in (None,) + ACTORDERS:
            raise ValueError(f"actorder {self.actorder!r} is not one of {ACTORDERS}")
        if self.actorder == "group" and self.strategy != "group":
            raise ValueError("actorder 'group' needs the group strategy")

    @property
    def is_int4(self) -> bool:
        return self.type == "int" and self.num_bits == 4

    @property
    def is_fp4(self) -> bool:
        return self.type == "float" and self.num_bits == 4

    @property
    def fp4_kind(self) -> str | None:
        """"nvfp4" or "mxfp4" for 4-bit floats (quant/fp4.py), else None."""
        return FP4_KINDS.get((self.strategy, self.group_size)) if self.is_fp4 else None

    def to_dict(self) -> dict[str, Any]:
        """The CT ``QuantizationArgs`` JSON, restricted to keys every vLLM-pinned CT accepts."""
        d: dict[str, Any] = {
            "num_bits": self.num_bits,
            "type": self.type,
            "symmetric": self.symmetric,
            "group_size": self.group_size,
            "strategy": self.strategy,
            "block_structure": list(self.block_structure) if self.block_structure else None,
            "dynamic": self.dynamic,
            "actorder": self.actorder,
        }
        if self.observer is not None:
            d["observer"] = self.observer
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, what: str) -> QuantArgs:
        """Parse CT ``QuantizationArgs`` JSON; ``what`` names the field in errors."""
        unknown = set(d) - _ARGS_KEYS
        if unknown:
            raise ValueError(f"{what}: unknown QuantizationArgs keys {sorted(unknown)}")
        block = d.get("block_structure")
        if isinstance(block, str) and re.fullmatch(r"\d+x\d+", block):  # compressed-tensors' older "128x128"
            block = [int(b) for b in block.split("x")]
        if block is not None and not (isinstance(block, list) and all(isinstance(b, int) for b in block)):
            raise ValueError(f"{what}: block_structure must be a list of two integers, got {block!r}")
        group_size = d.get("group_size")
        strategy = d.get("strategy")
        if strategy is None:
            # CT inference: a positive group size means group, -1 means channel, none means tensor.
            strategy = "group" if group_size and group_size > 0 else "channel" if group_size == -1 else "tensor"
        if strategy != "group" and group_size == -1:
            group_size = None
        actorder = d.get("actorder")
        actorder = _ACTORDER_ALIASES.get(actorder, actorder)
        try:
            return cls(
                type=d.get("type", "int"),
                num_bits=int(d.get("num_bits", 8)),
                strategy=strategy,
                group_size=group_size,
                symmetric=bool(d.get("symmetric", True)),
                dynamic="local" if d.get("dynamic") == "local" else bool(d.get("dynamic", False)),
                actorder=actorder,
                observer=d.get("observer"),
                block_structure=tuple(block) if block is not None else None,
            )
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from e


@dataclass(frozen=True)
class QuantScheme:
    """The quantization of one Linear: weights, optional input activations, and the on-disk format."""

    weights: QuantArgs
    input_activations: QuantArgs | None = None
    format: str = "naive-quantized"

    def __post_init__(self) -> None:
        if self.format not in FORMATS or self.format in ("dense", "mixed-precision"):
            raise ValueError(f"a quantized Linear cannot use format {self.format!r}")
        w, a = self.weights, self.input_activations
        if w.strategy not in WEIGHT_STRATEGIES or w.dynamic:
            raise ValueError(f"weights must be static tensor/channel/group, got {w.strategy} dynamic={w.dynamic}")
        if self.format == "pack-quantized" and w.type != "int":
            raise ValueError("pack-quantized holds int weights only")
        if (w.is_fp4 or self.format.endswith("fp4-pack-quantized")) and self.format != f"{w.fp4_kind}-pack-quantized":
            raise ValueError("4-bit float weights are stored as nvfp4-pack-quantized (NVFP4) or mxfp4-pack-quantized "
                             "(MXFP4), and only they are")
        if a is not None:
            block_groups = w.strategy == "block" and a.strategy == "group"
            if a.strategy not in INPUT_STRATEGIES or (a.strategy in ("group", "tensor_group")) != (a.is_fp4 or block_groups):
                raise ValueError(f"input activations must use token or tensor strategy (groups: FP4's, and block "
                                 f"FP8's), got {a.strategy!r}")
            if w.strategy == "block" and not (a.strategy == "group" and a.dynamic
                                              and a.group_size == w.block_structure[1]):
                raise ValueError(f"block FP8 weights take dynamic per-token activation groups as wide as their "
                                 f"tiles ({w.block_structure[1]}), got {a.strategy} group_size {a.group_size}")
            if a.actorder is not None:
                raise ValueError("actorder is not allowed on input activations")
            if not a.symmetric:
                raise ValueError("asymmetric input activations are not supported")
            if a.type != w.type or a.fp4_kind != w.fp4_kind or not (a.num_bits == 8 or a.is_fp4):
                raise ValueError(f"input activations {a.type}{a.num_bits} ({a.strategy}) do not pair with weights "
                                 f"{w.type}{w.num_bits} ({w.strategy})")
            if a.is_fp4 and not a.dynamic:
                raise ValueError("FP4 activations are scaled per group at run time (dynamic)")
            if w.type == "int" and (not a.dynamic or not w.symmetric):
                raise ValueError("int8 activations need dynamic per-token quantization and symmetric int8 or int4 "
                                 "weights")
            if w.type == "int" and w.num_bits == 8 and w.strategy == "group":
                raise ValueError("W8A8 int8 needs per-channel or per-tensor weight scales, not groups")

    def to_dict(self, targets: list[str], *, with_format: bool) -> dict[str, Any]:
        """The CT ``QuantizationScheme`` JSON for a config group."""
        d: dict[str, Any] = {
            "targets": list(targets),
            "weights": self.weights.to_dict(),
            "input_activations": self.input_activations.to_dict() if self.input_activations else None,
            "output_activations": None,
        }
        if with_format:
            d["format"] = self.format
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, fmt: str | None, what: str) -> QuantScheme | None:
        """Parse a CT scheme; ``fmt`` is the global format (used when the group has none).

        Returns None for groups without weight quantization (attention-only groups that exist
        to calibrate ``q_scale``): they quantize no Linear.
        """
        unknown = set(d) - _SCHEME_KEYS
        if unknown:
            raise ValueError(f"{what}: unknown QuantizationScheme keys {sorted(unknown)}")
        if d.get("output_activations") is not None:
            raise ValueError(f"{what}: output activation quantization is not supported")
        if d.get("weights") is None:
            return None
        weights = QuantArgs.from_dict(d["weights"], what=f"{what}.weights")
        acts = d.get("input_activations")
        acts = QuantArgs.from_dict(acts, what=f"{what}.input_activations") if acts is not None else None
        group_fmt = d.get("format") or fmt
        if group_fmt in (None, "mixed-precision"):
            group_fmt = infer_format(weights, acts)
        if group_fmt not in FORMATS:
            raise ValueError(f"{what}: unsupported compression format {group_fmt!r}; supported: {FORMATS}")
        try:
            return cls(weights=weights, input_activations=acts, format=group_fmt)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from e


def infer_format(weights: QuantArgs, acts: QuantArgs | None) -> str:
    """CT's format choice for a scheme (first match wins, as in CT's ``format.py``)."""
    if weights.is_fp4:
        return f"{weights.fp4_kind}-pack-quantized"
    if weights.type == "int" and acts is not None:
        return "int-quantized"
    if weights.type == "int":
        return "pack-quantized"
    if acts is not None:
        return "float-quantized"
    return "naive-quantized"


def _fp8(strategy: str, **kw: Any) -> QuantArgs:
    return QuantArgs(type="float", num_bits=8, strategy=strategy, **kw)


FP8_KV = _fp8("tensor")
PRESETS = ("fp8-dynamic", "fp8-static", "fp8-block", "w8a8-int8", "w4a16", "w4a16-asym", "w4a8", "w8a16", "nvfp4a16",
           "nvfp4", "mxfp4a16", "mxfp4")


def preset(name: str, *, group_size: int = 128, actorder: str | None = None) -> QuantScheme:
    """Our named schemes (LLMC ``FP8_DYNAMIC``, ``FP8``, ``FP8_BLOCK``, ``W8A8``, ``W4A16``, ``W4A16_ASYM``; w8a16
    is per-channel; nvfp4a16 is NVFP4 weights (LLMC ``NVFP4A16``: FP4 in groups of 16, FP8 group
    scales under a global scale), nvfp4 (LLMC ``NVFP4``) quantizes activations so as well; mxfp4a16 and
    mxfp4 likewise in MXFP4 (``MXFP4A16``, ``MXFP4``: FP4 in groups of 32, power-of-two scales).
    w4a8 (LLMC ``W4A8``) is w4a16's weights with w8a8-int8's per-token int8 activations.
    w4a16-asym gives each group a zero point as well as a scale, so its 16 levels
    span the group's [min, max] rather than ±absmax (AWQ's and most GPTQ exports' choice).

    ``group_size`` applies to w4a16, w4a16-asym and w4a8 only (it must divide each Linear's input size for the fast
    CPU kernel: 32 or 64 for hidden 576). w8a16 is per-channel because the CPU int8 kernel takes
    one scale per output row.
    """
    if name == "fp8-dynamic":
        return QuantScheme(_fp8("channel"), _fp8("token", dynamic=True), "float-quantized")
    if name == "fp8-static":
        return QuantScheme(_fp8("tensor"), _fp8("tensor", observer="static_minmax"), "float-quantized")
    if name == "fp8-block":
        return fp8_block((128, 128))
    if name == "w8a8-int8":
        return QuantScheme(QuantArgs(strategy="channel"), QuantArgs(strategy="token", dynamic=True), "int-quantized")
    if name in ("w4a16", "w4a16-asym", "w4a8"):
        weights = QuantArgs(num_bits=4, strategy="group", group_size=group_size, actorder=actorder,
                            symmetric=name != "w4a16-asym")
        if name == "w4a8":
            return QuantScheme(weights, QuantArgs(strategy="token", dynamic=True), "int-quantized")
        return QuantScheme(weights, None, "pack-quantized")
    if name == "w8a16":
        return QuantScheme(QuantArgs(strategy="channel", actorder=actorder), None, "pack-quantized")
    if name in ("nvfp4a16", "nvfp4", "mxfp4a16", "mxfp4"):
        kind = name.removesuffix("a16")
        strategy, group_size = next(k for k, v in FP4_KINDS.items() if v == kind)
        fp4 = QuantArgs(type="float", num_bits=4, strategy=strategy, group_size=group_size)
        acts = replace(fp4, dynamic="local" if kind == "nvfp4" else True) if name == kind else None
        return QuantScheme(fp4, acts, f"{kind}-pack-quantized")
    raise ValueError(f"unknown scheme preset {name!r}; choose one of {PRESETS}")


def fp8_block(block: tuple[int, int]) -> QuantScheme:
    """FP8 weights in tiles of ``block`` (rows, columns) with a scale each, and FP8 inputs scaled
    per token and group of the tile's width at run time: llm-compressor's ``FP8_BLOCK``, and
    transformers' ``fp8`` checkpoints (DeepSeek-V3's format: Qwen3 ``-FP8``)."""
    return QuantScheme(_fp8("block", block_structure=tuple(block)), _fp8("group", group_size=block[1], dynamic=True),
                       "float-quantized")


def with_group_size(scheme: QuantScheme, group_size: int) -> QuantScheme:
    """The same scheme with another weight group size (for ``--group-size``)."""
    return replace(scheme, weights=replace(scheme.weights, strategy="group", group_size=group_size))


# CT preset names that may appear as config-group names with a bare target list.
CT_PRESETS = {
    "FP8_DYNAMIC": lambda: preset("fp8-dynamic"),
    "FP8": lambda: preset("fp8-static"),
    "W8A8": lambda: preset("w8a8-int8"),
    "INT8": lambda: preset("w8a8-int8"),
    "W4A16": lambda: preset("w4a16"),
    "W4A8": lambda: preset("w4a8"),
    "W4A16_ASYM": lambda: preset("w4a16-asym"),
    "W8A16": lambda: QuantScheme(QuantArgs(strategy="group", group_size=128), None, "pack-quantized"),
    "NVFP4A16": lambda: preset("nvfp4a16"),
    "NVFP4": lambda: preset("nvfp4"),
    "MXFP4A16": lambda: preset("mxfp4a16"),
    "MXFP4": lambda: preset("mxfp4"),
    "FP8_BLOCK": lambda: preset("fp8-block"),
}
