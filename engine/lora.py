"""LoRA adapters served over one base model (vLLM's multi-LoRA serving, in torch).

Every Linear of the decoder layers is wrapped once (`LoRALayers.wrap`); each loaded adapter
puts its low-rank factors on the wrappers it targets. A step's rows are grouped by adapter, and
each wrapper adds, for the rows of each adapter, ``scale · (x Aᵀ) Bᵀ`` to the base output:

    y = x Wᵀ (+ b)  →  y[rows] += (x[rows] A_catᵀ) B_fullᵀ

A_cat stacks the A of every shard the adapter targets in a fused Linear (q, k, v → qkv_proj),
B_full places each shard's B at its output rows with the scale folded in, so one adapter costs
two small matmuls per Linear whatever it targets there. The base weights stay as loaded
(quantized ones included), so adapters serve over an FP8 / INT4 checkpoint unchanged, and a
step without adapter rows runs exactly as without LoRA. Decode steps run in the one-call C
decode step with each adapter's factors on its rows (same arithmetic, same floats).

Adapters come in PEFT's format (adapter_config.json + adapter_model.safetensors).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from engine.layers import panel_matmul


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's shape: an adapter's name (what requests ask for), an id (kept for vLLM's callers;
    the name identifies it here), and its folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class LoRAStep:
    """The current step's rows per adapter, shared by every wrapper; empty outside LoRA steps."""

    def __init__(self) -> None:
        # (adapter index, its row indices, or None when it has every row of the step)
        self.groups: list[tuple[int, torch.Tensor | None]] = []


@dataclass(frozen=True, slots=True)
class LoRAFactors:
    """One adapter's factors on one Linear, A_cat [R, in] and B_full [out, R]: on the CPU in fp32
    as panels (`panel_matmul.pack`, R padded with zero rows to whole panels), which the module
    path and the one-call C decode step (engine/csrc/decode_step.c) multiply by in the same
    order, so both give the same floats; elsewhere as they are, for torch's matmuls."""

    a: torch.Tensor
    b: torch.Tensor
    packed: bool

    @classmethod
    def build(cls, a: torch.Tensor, b: torch.Tensor) -> LoRAFactors:
        pad = -a.shape[0] % panel_matmul.PANEL
        a_panels = panel_matmul.pack(F.pad(a, (0, 0, 0, pad)), narrow=False, lasting=False)
        b_panels = panel_matmul.pack(F.pad(b, (0, pad)), narrow=False, lasting=False)
        if a_panels is None or b_panels is None:
            return cls(a, b, False)
        return cls(a_panels, b_panels, True)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] → its low-rank update [rows, out] (scale folded into B)."""
        if self.packed:
            return panel_matmul.matmul(panel_matmul.matmul(x, self.a), self.b)
        return x.to(self.a.dtype) @ self.a.T @ self.b.T


class LoRALinear(nn.Module):
    """A Linear plus the low-rank updates of the adapters that target it."""

    def __init__(self, base: nn.Module, step: LoRAStep):
        super().__init__()
        self.base = base
        self.step = step
        self.prefixes: tuple[str, ...] = base.prefixes
        self.input_size: int = base.input_size
        self.output_sizes: list[int] = list(base.output_sizes)
        self.factors: dict[int, LoRAFactors] = {}  # adapter index → its factors here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for index, rows in self.step.groups:
            factors = self.factors.get(index)
            if factors is None:
                continue
            if rows is None:  # one adapter for the whole step: no gather
                y += factors.delta(x).to(y.dtype)
            else:
                y.index_add_(0, rows, factors.delta(x[rows]).to(y.dtype))
        return y


def _adapter_config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no adapter_config.json; is it a PEFT LoRA adapter folder?")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder}: peft_type {config.get('peft_type')!r} is not LORA")
    # what would change the model in ways these two matmuls do not express
    unsupported = {"use_dora": config.get("use_dora"), "modules_to_save": config.get("modules_to_save"),
                   "alpha_pattern": config.get("alpha_pattern"), "fan_in_fan_out": config.get("fan_in_fan_out"),
                   "bias": config.get("bias", "none") != "none" and config.get("bias")}
    named = [name for name, value in unsupported.items() if value]
    if named:
        raise ValueError(f"{folder}: LoRA with {', '.join(named)} is not supported")
    return config


def _adapter_tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint Linear name → {"A": [r, in], "B": [out, r]}."""
    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise ValueError(f"{folder} has no adapter_model.safetensors")
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors' own errors for a corrupt header
        raise ValueError(f"cannot read {path}: {exc}") from None
    factors: dict[str, dict[str, torch.Tensor]] = {}
    with handle as f:
        for name in f.keys():
            prefix, _, kind = name.removeprefix("base_model.model.").rpartition(".lora_")
            if kind not in ("A.weight", "B.weight"):
                raise ValueError(f"{path.name}: tensor {name!r} is not a LoRA A or B of a Linear")
            factors.setdefault(prefix, {})[kind[0]] = f.get_tensor(name)
    return factors


class LoRALayers:
    """The model's wrapped Linears and the adapters loaded onto them."""

    def __init__(self, model: nn.Module, max_lora_rank: int, max_resident: int | None = None):
        self.step = LoRAStep()
        self.max_lora_rank = max_lora_rank
        self.paths: dict[str, str] = {}  # every adapter requests may name → its folder
        # the adapters whose factors are in memory → index (never reused, so a stale index finds
        # nothing), least recently used first; past max_resident (vLLM's max_cpu_loras) the least
        # recently used one no request holds is evicted, and loaded again when next asked for
        self.adapters: dict[str, int] = {}
        self.max_resident = max_resident
        self.num_loads = 0
        self._indices = itertools.count()
        self.by_prefix: dict[str, tuple[LoRALinear, int]] = {}  # checkpoint Linear name → (wrapper, shard)
        for layer in model.model.layers:
            for path, module in list(layer.named_modules()):
                # not a mixture's routed experts: each sees a gather of the step's rows, not the rows
                if getattr(module, "quantizable", False) and ".experts." not in f".{path}":
                    parent, _, leaf = path.rpartition(".")
                    wrapper = LoRALinear(module, self.step)
                    setattr(layer.get_submodule(parent), leaf, wrapper)
                    self.by_prefix.update({p: (wrapper, i) for i, p in enumerate(wrapper.prefixes)})
        # the model's dtype (its embedding table may be held narrower) and device
        self._dtype, self._device = model.model.dtype, model.model.embed_tokens.weight.device

    def add(self, request: LoRARequest, in_use: frozenset[str] = frozenset()) -> None:
        """Register an adapter and load it (once per name; the same name with another folder is
        an error), evicting idle ones past max_resident (`in_use`: the adapters requests hold)."""
        known = self.paths.get(request.lora_name)
        if known is not None:
            if known != str(request.lora_path):
                raise ValueError(f"LoRA adapter {request.lora_name!r} is already loaded from {known}")
            return
        self._load(request.lora_name, str(request.lora_path))
        self.paths[request.lora_name] = str(request.lora_path)
        self._evict(in_use | {request.lora_name})

    def resident_index(self, name: str, in_use: frozenset[str]) -> int:
        """The index of a registered adapter, loaded again from its folder if it was evicted, and
        now the most recently used (engine thread, between steps)."""
        self.check(name)
        index = self.adapters.pop(name, None)
        self.adapters[name] = self._load(name, self.paths[name]) if index is None else index
        self._evict(in_use | {name})
        return self.adapters[name]

    def _evict(self, keep: frozenset[str]) -> None:
        """Drop least recently used adapters outside `keep` until max_resident are left (if it can)."""
        for name in list(self.adapters):
            if self.max_resident is None or len(self.adapters) <= self.max_resident:
                return
            if name not in keep:
                self._drop(name)

    def _drop(self, name: str) -> None:
        index = self.adapters.pop(name)
        for wrapper, _ in self.by_prefix.values():
            wrapper.factors.pop(index, None)

    def _load(self, name: str, path: str) -> int:
        """Read an adapter's factors onto the wrappers; returns its new index."""
        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(f"LoRA adapter folder not found: {folder}")
        config = _adapter_config(folder)
        staged: dict[LoRALinear, list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}
        for prefix, pair in sorted(_adapter_tensors(folder).items()):
            if prefix not in self.by_prefix:
                raise ValueError(f"{folder}: LoRA target {prefix!r} is none of the attention and MLP projections "
                                 "adapters can target here")
            if set(pair) != {"A", "B"}:
                raise ValueError(f"{folder}: {prefix} lacks its lora_{'B' if 'A' in pair else 'A'}")
            wrapper, shard = self.by_prefix[prefix]
            a, b = pair["A"], pair["B"]
            rank = a.shape[0]
            if rank > self.max_lora_rank:
                raise ValueError(f"{folder}: rank {rank} of {prefix} exceeds max_lora_rank={self.max_lora_rank}")
            if tuple(a.shape) != (rank, wrapper.input_size) or tuple(b.shape) != (wrapper.output_sizes[shard], rank):
                raise ValueError(f"{folder}: {prefix} has A {tuple(a.shape)} and B {tuple(b.shape)}; expected "
                                 f"({rank}, {wrapper.input_size}) and ({wrapper.output_sizes[shard]}, {rank})")
            alpha = config.get("lora_alpha", 8)  # PEFT's default, where a config leaves it out
            scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
            staged.setdefault(wrapper, []).append((shard, a, b, scale))
        if not staged:
            raise ValueError(f"{folder}: the adapter holds no LoRA weights")
        index = next(self._indices)
        for wrapper, shards in staged.items():
            wrapper.factors[index] = self._fuse(wrapper, shards)
        self.adapters[name] = index
        self.num_loads += 1
        return index

    def _fuse(self, wrapper: LoRALinear, shards: list[tuple[int, torch.Tensor, torch.Tensor, float]],
              ) -> LoRAFactors:
        """A_cat [Σr, in] and B_full [out, Σr]: each shard's B, scaled, at its rows and its A's columns."""
        device = self._device
        a_cat = torch.cat([a for _, a, _, _ in shards]).to(device, self._dtype)
        b_full = torch.zeros(sum(wrapper.output_sizes), a_cat.shape[0], dtype=self._dtype, device=device)
        column = 0
        for shard, a, b, scale in shards:
            start = sum(wrapper.output_sizes[:shard])
            b_full[start:start + b.shape[0], column:column + a.shape[0]] = b.to(device, self._dtype) * scale
            column += a.shape[0]
        return LoRAFactors.build(a_cat, b_full)

    def remove(self, name: str) -> None:
        """Unload and forget an adapter (the engine checks no request uses it)."""
        self.check(name)
        if name in self.adapters:
            self._drop(name)
        del self.paths[name]

    def check(self, name: str) -> None:
        if name not in self.paths:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {', '.join(sorted(self.paths)) or 'none'}")

    def begin_step(self, row_adapters: list[tuple[int | None, int]]) -> bool:
        """Group this step's rows ((adapter index or None, number of rows) per chunk, in row
        order) by adapter; True when some row has one."""
        rows: dict[int, list[int]] = {}
        start = 0
        for index, count in row_adapters:
            if index is not None:
                rows.setdefault(index, []).extend(range(start, start + count))
            start += count
        self.step.groups = [(index, None if len(r) == start else torch.tensor(r, device=self._device))
                            for index, r in rows.items()]
        return bool(rows)

    def end_step(self) -> None:
        self.step.groups = []
