"""Which Linears a run quantizes, under their checkpoint names, and the group size that fits them all.

Decided from the model's structure alone (it can be built on the meta device), so a bad
``--ignore`` or ``--group-size`` fails before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from quant.config import QuantizationConfig


class TargetError(ValueError):
    """The requested ignore list or group size does not fit the model."""


@dataclass(frozen=True, slots=True)
class LinearTarget:
    """One (possibly fused) Linear inside a decoder layer."""

    layer_idx: int
    module_path: str  # relative to the decoder layer, e.g. "self_attn.qkv_proj"
    prefixes: tuple[str, ...]  # checkpoint names of its shards, e.g. model.layers.0.self_attn.q_proj
    input_size: int
    output_sizes: tuple[int, ...]
    quantizable: bool = True  # False: kept dense whatever is asked (a mixture-of-experts router)


def layer_linears(model: nn.Module) -> list[LinearTarget]:
    """Every Linear of every decoder layer, in execution order, with its checkpoint shard names."""
    targets = []
    for layer_idx, layer in enumerate(model.model.layers):
        for path, module in layer.named_modules():
            if hasattr(module, "output_sizes"):
                targets.append(LinearTarget(layer_idx=layer_idx, module_path=path, prefixes=module.prefixes,
                                            input_size=module.input_size, output_sizes=tuple(module.output_sizes),
                                            quantizable=module.quantizable))
    return targets


def select_targets(linears: list[LinearTarget], ignore: tuple[str, ...]) -> list[LinearTarget]:
    """The quantizable Linears not ignored; shards of a fused Linear must share the decision.

    Every ignore entry (exact checkpoint name or ``re:`` regex, as in compressed-tensors) other
    than ``lm_head``, which is outside the decoder layers, must match some Linear: a typo would
    otherwise quantize what the user meant to keep.
    """
    for pattern in ignore:
        if pattern == "lm_head":
            continue
        if not any(QuantizationConfig(ignore=(pattern,)).is_ignored(p) for t in linears for p in t.prefixes):
            raise TargetError(f"--ignore {pattern!r} matches no Linear of the model")
    config = QuantizationConfig(ignore=ignore)
    selected = []
    for target in linears:
        decisions = {config.is_ignored(p) for p in target.prefixes}
        if len(decisions) > 1:
            raise TargetError(f"--ignore must cover all or none of {', '.join(target.prefixes)}: "
                              "they are fused into one Linear and share one scheme")
        if decisions == {False} and target.quantizable:
            selected.append(target)
    return selected


def resolve_group_size(targets: list[LinearTarget], requested: int | None, candidates: tuple[int, ...]) -> int:
    """``requested`` if it divides every input size, else an error; ``None`` (auto) → the largest candidate that does."""
    sizes = sorted({t.input_size for t in targets})
    if requested is not None:
        bad = [t for t in targets if t.input_size % requested]
        if bad:
            raise TargetError(f"--group-size {requested} does not divide the input size {bad[0].input_size} of "
                              f"{bad[0].prefixes[0]}; input sizes here are {sizes}")
        return requested
    for size in candidates:
        if all(s % size == 0 for s in sizes):
            return size
    raise TargetError(f"no group size in {list(candidates)} divides every input size {sizes}")
