"""What one ``quantize`` run was asked to do, validated once, before any work starts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from quant.schemes import PRESETS, preset

SCHEMES = (*PRESETS, "none")
ALGORITHMS = ("rtn", "gptq", "awq")
GROUP_SIZES = (128, 64, 32)  # largest first: `auto` takes the first that divides every input size
KV_CACHE_DTYPES = ("fp8",)
KV_STRATEGIES = ("tensor", "head")
_FP4_SCHEMES = ("nvfp4a16", "nvfp4", "mxfp4a16", "mxfp4")
# The schemes each weight algorithm applies to (FP4 codes included).
_ALGORITHM_SCHEMES = {"gptq": ("w4a16", "w4a16-asym", "w4a8", "w8a16", "w8a8-int8", *_FP4_SCHEMES),
                      "awq": ("w4a16", "w4a16-asym", "w4a8", "w8a16", *_FP4_SCHEMES)}
_SMOOTHQUANT_SCHEMES = ("w8a8-int8", "w4a8")  # int8 activations: what SmoothQuant's scales protect
# Integer groups take --group-size; FP4's group sizes are the format's own.
_GROUPED_SCHEMES = tuple(name for name in PRESETS
                         if preset(name).weights.strategy == "group" and not preset(name).weights.is_fp4)


@dataclass(slots=True)
class QuantizeOptions:
    """The arguments of one run; ``group_size`` None means auto, ``scheme`` "none" means KV scales only."""

    model_dir: Path
    calib_path: Path
    output_dir: Path
    scheme: str
    algorithm: str = "rtn"
    smoothquant: float | None = None  # SmoothQuant migration strength α (w8a8-int8 only); None: off
    group_size: int | None = None
    kv_cache: str | None = None
    kv_strategy: str = "tensor"
    num_samples: int = 256
    max_seq_len: int = 2048
    ignore: tuple[str, ...] = ("lm_head",)
    device: str = "cpu"
    seed: int = 0
    allow_few: bool = False
    overwrite: bool = False
    num_heldout: int = 16

    def __post_init__(self) -> None:
        self.model_dir, self.calib_path, self.output_dir = (
            Path(self.model_dir), Path(self.calib_path), Path(self.output_dir))
        self.ignore = tuple(self.ignore)
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {self.scheme!r}; choose from {', '.join(SCHEMES)}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; choose from {', '.join(ALGORITHMS)}")
        if self.scheme == "none" and self.kv_cache is None:
            raise ValueError("--scheme none quantizes nothing; add --kv-cache fp8 for a KV-scales-only checkpoint")
        if self.algorithm != "rtn" and self.scheme not in _ALGORITHM_SCHEMES[self.algorithm]:
            raise ValueError(f"--algo {self.algorithm} applies to {', '.join(_ALGORITHM_SCHEMES[self.algorithm])}, "
                             f"not --scheme {self.scheme}")
        if self.smoothquant is not None:
            if self.scheme not in _SMOOTHQUANT_SCHEMES:
                raise ValueError(f"--smoothquant applies to {', '.join(_SMOOTHQUANT_SCHEMES)} (their activations are "
                                 f"quantized), not {self.scheme}")
            if not 0.0 < self.smoothquant <= 1.0:
                raise ValueError(f"--smoothquant α must be in (0, 1], got {self.smoothquant}")
        if self.group_size is not None:
            if self.scheme not in _GROUPED_SCHEMES:
                raise ValueError(f"--group-size applies to {', '.join(_GROUPED_SCHEMES)}; "
                                 f"{self.scheme} does not quantize by group")
            if self.group_size not in GROUP_SIZES:
                raise ValueError(f"--group-size must be auto or one of {', '.join(map(str, GROUP_SIZES))}")
        if self.kv_cache is not None and self.kv_cache not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown --kv-cache {self.kv_cache!r}; choose from {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_strategy not in KV_STRATEGIES:
            raise ValueError(f"unknown KV scale strategy {self.kv_strategy!r}")
        if self.num_samples < 1 or self.max_seq_len < 1:
            raise ValueError("--num-samples and --max-seq-len must be at least 1")
        if self.num_heldout < 0:
            raise ValueError("the held-out sample count cannot be negative")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}; choose cpu or cuda")
        if "lm_head" not in self.ignore:
            raise ValueError("quantizing lm_head is not supported; keep lm_head in --ignore")
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern[3:])
                except re.error as exc:
                    raise ValueError(f"--ignore {pattern!r} is not a regular expression: {exc}") from None

    @property
    def is_grouped(self) -> bool:
        """True when the weight scheme needs a group size (given or resolved by auto)."""
        return self.scheme in _GROUPED_SCHEMES
