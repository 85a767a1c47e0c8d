"""A checkpoint's ``quantization_config``: which Linear gets which scheme, and the KV-cache scheme.

Matching follows vLLM so a checkpoint means the same thing here and there: an ignored name
wins; then a group whose target names the layer (exact or ``re:`` regex, ``re.match``
semantics) beats a group targeting the ``Linear`` class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from quant.schemes import CT_PRESETS, FORMATS, FP8_KV, QuantArgs, QuantScheme, fp8_block

QUANT_METHOD = "compressed-tensors"
HF_FP8_METHOD = "fp8"  # transformers' FineGrainedFP8 checkpoints: block FP8 weights, `weight_scale_inv`
_CLASS_TARGETS = ("Linear", "LinearBase")


@dataclass(frozen=True)
class ConfigGroup:
    """One ``config_groups`` entry: a scheme and the layers it targets."""

    name: str
    targets: tuple[str, ...]
    scheme: QuantScheme


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


@dataclass(frozen=True)
class QuantizationConfig:
    """Parsed ``quantization_config`` (compressed-tensors)."""

    groups: tuple[ConfigGroup, ...] = ()
    ignore: tuple[str, ...] = ("lm_head",)
    kv_cache_scheme: QuantArgs | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_scheme is not None:
            kv = self.kv_cache_scheme
            if kv.type != "float" or kv.num_bits != 8 or not kv.symmetric or kv.dynamic:
                raise ValueError(f"kv_cache_scheme must be static symmetric float8, got {kv}")
            if kv.strategy not in ("tensor", "attn_head"):
                raise ValueError(f"kv_cache_scheme strategy must be tensor or attn_head, got {kv.strategy!r}")

    @classmethod
    def for_scheme(
        cls, scheme: QuantScheme | None, *, ignore: tuple[str, ...] = ("lm_head",), kv_cache: bool = False
    ) -> QuantizationConfig:
        """The config our writer emits: one group targeting every Linear (``scheme=None``: KV only)."""
        groups = (ConfigGroup("group_0", ("Linear",), scheme),) if scheme is not None else ()
        return cls(groups=groups, ignore=tuple(ignore), kv_cache_scheme=FP8_KV if kv_cache else None)

    @property
    def format(self) -> str:
        formats = {g.scheme.format for g in self.groups}
        if not formats:
            return "dense"
        return formats.pop() if len(formats) == 1 else "mixed-precision"

    def is_ignored(self, prefix: str) -> bool:
        return any(_matches(p, prefix) for p in self.ignore)

    def scheme_for(self, prefix: str) -> QuantScheme | None:
        """The scheme for the Linear at checkpoint prefix ``prefix`` (None: keep it dense)."""
        if self.is_ignored(prefix):
            return None
        for group in self.groups:
            if any(_matches(t, prefix) for t in group.targets if t not in _CLASS_TARGETS):
                return group.scheme
        for group in self.groups:
            if any(t in _CLASS_TARGETS for t in group.targets):
                return group.scheme
        return None

    def to_dict(self) -> dict[str, Any]:
        """The ``quantization_config`` JSON exactly per our spec (no keys CT 0.13 would reject)."""
        fmt = self.format
        groups = {g.name: g.scheme.to_dict(list(g.targets), with_format=fmt == "mixed-precision") for g in self.groups}
        return {
            "quant_method": QUANT_METHOD,
            "format": fmt,
            "quantization_status": "compressed",
            "config_groups": groups,
            "ignore": list(self.ignore),
            "kv_cache_scheme": self.kv_cache_scheme.to_dict() if self.kv_cache_scheme else None,
            "global_compression_ratio": None,
            "sparsity_config": {},
            "transform_config": {},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantizationConfig:
        """Parse a config.json ``quantization_config``; raise ValueError on anything we cannot serve."""
        method = d.get("quant_method")
        if method == HF_FP8_METHOD:
            return cls._from_hf_fp8(d)
        if method != QUANT_METHOD:
            raise ValueError(f"quant_method {method!r} is not supported; {QUANT_METHOD!r} and block "
                             f"{HF_FP8_METHOD!r} checkpoints load")
        fmt = d.get("format") or None
        if fmt is not None and fmt not in FORMATS:
            raise ValueError(f"unsupported compression format {fmt!r}; supported: {FORMATS}")
        if d.get("sparsity_config") and d["sparsity_config"].get("format", "dense") != "dense":
            raise ValueError(f"sparse checkpoints are not supported (sparsity_config {d['sparsity_config']})")
        if d.get("transform_config"):
            raise ValueError("checkpoints with transforms (transform_config) are not supported")
        groups: list[ConfigGroup] = []
        for name, value in (d.get("config_groups") or {}).items():
            what = f"config_groups.{name}"
            if isinstance(value, list):
                if name not in CT_PRESETS:
                    raise ValueError(f"{what}: a target list needs a preset group name, one of {sorted(CT_PRESETS)}")
                groups.append(ConfigGroup(name, tuple(value), CT_PRESETS[name]()))
                continue
            scheme = QuantScheme.from_dict(value, fmt=fmt, what=what)
            targets = tuple(value.get("targets") or ())
            if not targets:
                raise ValueError(f"{what}: no targets")
            if scheme is None:
                # Attention-module groups (they calibrate q_scale) quantize no Linear.
                continue
            groups.append(ConfigGroup(name, targets, scheme))
        kv = d.get("kv_cache_scheme")
        kv_args = QuantArgs.from_dict(kv, what="kv_cache_scheme") if kv is not None else None
        return cls(
            groups=tuple(groups),
            ignore=tuple(d.get("ignore") or ()),
            kv_cache_scheme=kv_args,
        )

    @classmethod
    def _from_hf_fp8(cls, d: dict[str, Any]) -> QuantizationConfig:
        """transformers' ``fp8`` config (DeepSeek-V3's format, Qwen3's ``-FP8`` releases) as the
        compressed-tensors scheme it means: every Linear but ``lm_head`` and
        ``modules_to_not_convert`` in FP8 tiles of ``weight_block_size``, inputs rounded to FP8
        per token and group of the tile's width (``activation_scheme: dynamic``)."""
        block = d.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"an {HF_FP8_METHOD!r} checkpoint without weight_block_size [rows, columns] "
                             f"(got {block!r}) is not supported: only block FP8 loads")
        if d.get("activation_scheme", "dynamic") != "dynamic" or d.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"an {HF_FP8_METHOD!r} checkpoint must be e4m3 with dynamic activations, got fmt "
                             f"{d.get('fmt')!r}, activation_scheme {d.get('activation_scheme')!r}")
        keep = ["lm_head", *(d.get("modules_to_not_convert") or [])]
        return cls(groups=(ConfigGroup("fp8_block", ("Linear",), fp8_block(tuple(block))),),
                   ignore=tuple(_not_converted(name) for name in dict.fromkeys(keep)))


def _not_converted(key: str) -> str:
    """A ``modules_to_not_convert`` entry as an ignore pattern, matched as transformers matches it:
    a regex from the name's start up to a module boundary ("layers.1" takes "layers.1.mlp", not
    "layers.11.mlp"; "mlp.gate" not "mlp.gate_proj"), or the name's suffix."""
    return rf"re:(?:{key})(?:(?<=\.)|(?=\.|$))|.*{re.escape(key)}$"
