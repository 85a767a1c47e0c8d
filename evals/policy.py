"""The gate policy: which tasks, how many items, and every threshold, read from TOML.

One dataclass per section, validated on construction; an unknown key or a value of the
wrong type anywhere raises an error that names it, because a misspelt threshold silently
falling back to a default (or a "false" string that is truthy) is exactly the failure a
gate must not have. Thresholds are fractions (0.01 = 1 point) and
are compared unrounded.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from engine.config import check_gpu_memory_utilization
from evals.stats import two_sided_level

POLICY_DIR = Path(__file__).resolve().parent / "policies"
ENDPOINTS = ("pooled", "separate", "report")
MAX_RESAMPLES = 100_000  # bootstrap resamples: beyond this the intervals move in the fourth digit, the run for hours


class PolicyError(ValueError):
    """The policy file is malformed; the message names the offending key."""


def _build(cls: type, raw: Any, where: str) -> Any:
    """One policy dataclass from its TOML table, `where` naming it in errors.

    Every value is checked against its field's declared type before the dataclass sees it: a
    string "false" would otherwise be truthy and run the tier, and a string threshold would pass
    here and crash minutes into the gate.
    """
    if not isinstance(raw, dict):
        raise PolicyError(f"{where} must be a table, got {raw!r}")
    declared = _field_types(cls)
    unknown = sorted(set(raw) - set(declared))
    if unknown:
        raise PolicyError(f"unknown policy key {where}.{unknown[0]} (allowed: {', '.join(sorted(declared))})")
    for key, value in raw.items():
        if not _fits(value, declared[key]):
            raise PolicyError(f"{where}.{key} must be {_describe(declared[key])}, got {value!r}")
    try:
        return cls(**raw)
    except PolicyError:
        raise  # a nested table's error already names its key in full
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"{where}: {exc}") from exc


@cache
def _field_types(cls: type) -> dict[str, Any]:
    """{field name: declared type}; get_type_hints resolves the string annotations of this module."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _options(hint: Any) -> tuple[Any, ...]:
    """The members of a union (`int | str` -> (int, str)), or the type alone."""
    return get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)


def _fits(value: Any, hint: Any) -> bool:
    """Whether a TOML value has a field's declared type.

    A boolean is no number here (TOML's `true` would otherwise count as 1); an integer is a float;
    a generic such as list[TaskSpec] is checked as its container, the field building its items.
    """
    if isinstance(value, bool):
        return bool in _options(hint)
    for option in _options(hint):
        runtime = (int, float) if option is float else get_origin(option) or option
        if isinstance(value, runtime):
            return True
    return False


_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array"}


def _describe(hint: Any) -> str:
    """What a field takes, in TOML's terms: "a number", "an integer or a string" (an optional one may be left out)."""
    return " or ".join(_KIND_NAMES.get(get_origin(option) or option, "a table")
                       for option in _options(hint) if option is not NoneType)


def _check_fraction(name: str, value: float) -> None:
    if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}")


def _check_nonnegative(name: str, value: float) -> None:
    """A threshold that is a finite number >= 0 (TOML has nan and inf)."""
    if not 0.0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(slots=True)
class TaskSpec:
    """One lm-eval task in the gate; `items` is a count (spread evenly over the set) or "all"."""

    name: str
    metric: str
    items: int | str = "all"
    endpoint: str = "pooled"  # pooled: part of the primary MC endpoint; separate: its own; report: no gating
    max_drop: float | None = None  # required for endpoint = "separate"
    chance: float | None = None  # accuracy of guessing, for the above-chance hard fail

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.items != "all" and (not isinstance(self.items, int) or self.items < 2):
            raise ValueError(f"items must be 'all' or an integer >= 2, got {self.items!r}")
        if "," not in self.metric:
            raise ValueError(f"metric must be 'name,filter' as lm-eval reports it, got {self.metric!r}")
        if self.endpoint == "separate" and self.max_drop is None:
            raise ValueError(f"task {self.name} is a separate endpoint and needs max_drop")
        if self.max_drop is not None:
            _check_fraction("max_drop", self.max_drop)
        if self.chance is not None and not 0.0 <= self.chance < 1.0:
            raise ValueError(f"chance (the accuracy of guessing) must be in [0, 1), got {self.chance!r}")


@dataclass(slots=True)
class EnginePolicy:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    # KV block size. The prefix cache shares whole blocks, so smaller blocks let more of an MC
    # item's context (often 20-100 tokens) be shared by its choices.
    block_size: int = 16
    # CUDA: each arm's engine's share of the GPU's memory (vLLM's gpu_memory_utilization); None:
    # 0.9 split among the engines alive at once (candidate, baseline, noise floor)
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.gpu_memory_utilization is not None:
            check_gpu_memory_utilization(self.gpu_memory_utilization)


@dataclass(slots=True)
class Tier0Policy:
    """Logit parity on WikiText-2 articles and the baseline's own greedy generations."""

    enabled: bool = True
    num_documents: int = 4
    max_tokens_per_sequence: int = 1024
    max_kl_mean: float = 0.05
    max_kl_p99: float = 1.0
    min_top1_agreement: float = 0.9
    max_kl_growth: float = 2.0  # p99 KL of the last position bucket over the first

    def __post_init__(self) -> None:
        _check_fraction("min_top1_agreement", self.min_top1_agreement)
        for name in ("max_kl_mean", "max_kl_p99", "max_kl_growth"):
            _check_nonnegative(name, getattr(self, name))
        if self.num_documents < 1 or self.max_tokens_per_sequence < 2:
            raise ValueError("num_documents must be >= 1 and max_tokens_per_sequence >= 2")


@dataclass(slots=True)
class Tier1Policy:
    tasks: list[TaskSpec] = field(default_factory=list)
    max_pooled_drop: float = 0.01
    max_flip_rate_above_floor: float = 0.02
    confident_margin: float = 0.2
    max_confident_flip_rate: float = 0.01
    chance_sigma: float = 2.0
    max_invalid_rate_rise: float = 0.02
    max_runaway_rate_rise: float = 0.02

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("at least one task is required")
        self.tasks = [t if isinstance(t, TaskSpec) else _build(TaskSpec, t, f"tier1.tasks[{i}]")
                      for i, t in enumerate(self.tasks)]
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate task names in {names}")
        for name in ("max_pooled_drop", "max_flip_rate_above_floor", "confident_margin",
                     "max_confident_flip_rate", "max_invalid_rate_rise", "max_runaway_rate_rise"):
            _check_fraction(name, getattr(self, name))
        _check_nonnegative("chance_sigma", self.chance_sigma)


@dataclass(slots=True)
class Tier2Policy:
    """Greedy long generations from GSM8K few-shot prompts, compared token by token."""

    enabled: bool = True
    num_prompts: int = 8
    max_new_tokens: int = 256
    min_mean_agreed_prefix: float = 32.0  # tokens

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.max_new_tokens < 1:
            raise ValueError("num_prompts and max_new_tokens must be positive")
        if not 0.0 <= self.min_mean_agreed_prefix <= self.max_new_tokens:
            raise ValueError(f"min_mean_agreed_prefix must be in [0, max_new_tokens={self.max_new_tokens}] "
                             f"(identical generations agree on max_new_tokens), got {self.min_mean_agreed_prefix!r}")


@dataclass(slots=True)
class NoiseFloorPolicy:
    """The baseline run a second time with a different token budget (different batching)."""

    enabled: bool = True
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")


@dataclass(slots=True)
class GatePolicy:
    """The whole policy; build with `load_policy`."""

    name: str = "custom"
    inconclusive: str = "fail"  # what an undecided endpoint does: "fail" (closed) or "pass"
    # what decides a point check (Tier 0's KL figures, Tier 1's flip rates, Tier 2's prefix): "value",
    # its interval only marking it marginal; or "interval", a threshold inside it leaving the check
    # undecided (then `inconclusive` rules), as Tier 1's endpoints are held to their bounds
    point_checks: str = "value"
    confidence: float = 0.95  # one-sided level of the drop bound
    seed: int = 0
    bootstrap_resamples: int = 2000
    engine: EnginePolicy = field(default_factory=EnginePolicy)
    tier0: Tier0Policy = field(default_factory=Tier0Policy)
    tier1: Tier1Policy = field(default_factory=Tier1Policy)
    tier2: Tier2Policy = field(default_factory=Tier2Policy)
    noise_floor: NoiseFloorPolicy = field(default_factory=NoiseFloorPolicy)

    def __post_init__(self) -> None:
        if self.inconclusive not in ("fail", "pass"):
            raise ValueError(f"inconclusive must be 'fail' or 'pass', got {self.inconclusive!r}")
        if self.point_checks not in ("value", "interval"):
            raise ValueError(f"point_checks must be 'value' or 'interval', got {self.point_checks!r}")
        if not 0.5 < self.confidence < 1.0:
            raise ValueError(f"confidence must be in (0.5, 1), got {self.confidence}")
        if not 100 <= self.bootstrap_resamples <= MAX_RESAMPLES:
            raise ValueError(f"bootstrap_resamples must be in [100, {MAX_RESAMPLES}], got {self.bootstrap_resamples}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.tier2.enabled and self.tier2.max_new_tokens >= self.engine.max_model_len:
            raise ValueError(f"tier2.max_new_tokens ({self.tier2.max_new_tokens}) leaves no room for a prompt in "
                             f"engine.max_model_len ({self.engine.max_model_len})")

    @property
    def interval_level(self) -> float:
        """The two-sided level whose interval ends are the one-sided `confidence` bounds (0.95 -> 0.9)."""
        return two_sided_level(self.confidence)


_SECTIONS = {"engine": EnginePolicy, "tier0": Tier0Policy, "tier1": Tier1Policy, "tier2": Tier2Policy,
             "noise_floor": NoiseFloorPolicy}


def policy_from_dict(raw: dict[str, Any]) -> GatePolicy:
    raw = dict(raw)
    sections = {key: _build(cls, raw.pop(key), key) for key, cls in _SECTIONS.items() if key in raw}
    if "tier1" not in sections:
        raise PolicyError("policy needs a [tier1] section with at least one task")
    return _build(GatePolicy, {**raw, **sections}, "policy")


def load_policy(name_or_path: str | Path) -> GatePolicy:
    """Load a shipped policy by name ("default", "quick") or a TOML file by path."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = POLICY_DIR / f"{name_or_path}.toml"
    if path.is_dir():
        raise PolicyError(f"policy {path} is a folder; give a TOML file, or a policy's name (quick, default, ...)")
    if not path.is_file():
        raise PolicyError(f"policy file {path} does not exist")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise PolicyError(f"policy file {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{path}: {exc}") from exc
    raw.setdefault("name", path.stem)
    return policy_from_dict(raw)
