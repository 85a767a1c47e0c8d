"""How a model's embeddings are pooled: from its sentence-transformers files, as vLLM reads them.

An embedding checkpoint saved by sentence-transformers lists its modules in `modules.json`
(a Pooling module with its `config.json`, often a Normalize module); a model without them is
pooled as vLLM pools decoder models by default: the last token's final hidden state, L2-normalized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

_MODES = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"))


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    pooling: str = "last"  # "last", "mean" or "cls"
    normalize: bool = True


def _read_json(path: Path, what: str) -> dict | list:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} ({what}) is not valid JSON: {exc}") from None


def pooling_config(model_dir: str | Path) -> PoolingConfig:
    """The model's pooling (sentence-transformers' modules.json and Pooling config), else last-token + normalize."""
    model_dir = Path(model_dir)
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return PoolingConfig()
    modules = _read_json(modules_path, "sentence-transformers modules")
    types = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    pooling = "last"
    if "Pooling" in types:
        config = _read_json(model_dir / types["Pooling"] / "config.json", "sentence-transformers pooling")
        chosen = [name for key, name in _MODES if config.get(key)]
        if len(chosen) != 1:
            raise ValueError(f"{model_dir}: pooling config asks for {chosen or 'no mode'}; driftgate pools by "
                             "exactly one of lasttoken, mean_tokens, cls_token")
        pooling = chosen[0]
    return PoolingConfig(pooling, normalize="Normalize" in types)


def finish_embedding(pooled: list[float], normalize: bool, dimensions: int | None = None) -> list[float]:
    """The embedding a client gets: the first `dimensions` values (Matryoshka models), then L2-normalized."""
    vector = torch.tensor(pooled[:dimensions] if dimensions else pooled, dtype=torch.float32)
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()
