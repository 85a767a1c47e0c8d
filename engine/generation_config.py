"""What a model folder's `generation_config.json` asks of generation: stop tokens and sampling defaults.

Hugging Face keeps a model's intended stop tokens there (Llama-3 Instruct ends a turn with
`<|eot_id|>`, which its config.json may not list) and the sampling its authors recommend
(temperature, top_p, ...). vLLM honours both by default: a client that sends no temperature gets
the model's, not 1.0. A folder without the file asks nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.sampling_params import SamplingParams

FILE = "generation_config.json"
# the keys that are default sampling fields (as vLLM reads them); do_sample and the rest are HF's own
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(model_dir: str | Path) -> dict:
    """The folder's generation config ({} without one); ValueError when it is not a JSON object."""
    path = Path(model_dir) / FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def eos_token_ids(config: dict) -> list[int]:
    """`eos_token_id` as a list (HF allows one id or several)."""
    value = config.get("eos_token_id")
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def sequence_end_ids(hf_config: dict, model_dir: str | Path, tokenizer) -> list[int]:
    """Every id that ends a sequence: config.json's, generation_config.json's and the tokenizer's."""
    ids = set(eos_token_ids(hf_config)) | set(eos_token_ids(read_generation_config(model_dir)))
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def sampling_defaults(model_dir: str | Path, source: str = "auto",
                      override: dict[str, Any] | None = None) -> dict[str, float | int]:
    """What a request that leaves a sampling field out gets, as vLLM's `--generation-config` and
    `--override-generation-config` decide it: the sampling fields of the model's generation config
    (`source` "auto"), of another folder's (a path), or none ("vllm"/"none"), with `override` laid
    over them. `max_new_tokens` becomes `max_tokens`, a cap on every request's output. Checked as
    `SamplingParams` checks them."""
    if source in ("vllm", "none"):
        folder, config = None, {}
    else:
        folder = Path(model_dir) if source == "auto" else Path(source)
        if source != "auto" and not (folder / FILE).is_file():
            raise ValueError(f"--generation-config {source}: no {FILE} there")
        config = read_generation_config(folder)
    if unknown := sorted(set(override or {}) - {*SAMPLING_KEYS, "max_new_tokens"}):
        raise ValueError(f"--override-generation-config sets {', '.join(unknown)}; the fields it can set are "
                         f"{', '.join((*SAMPLING_KEYS, 'max_new_tokens'))}")
    merged = {**config, **(override or {})}
    defaults = {k: v for k, v in merged.items() if k in SAMPLING_KEYS and v is not None}
    if (cap := merged.get("max_new_tokens")) is not None:
        defaults["max_tokens"] = cap
    sources = [str(folder / FILE)] if config else []
    sources += ["--override-generation-config"] if override else []
    try:
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool)):
            raise ValueError(f"max_new_tokens must be a whole number, got {cap!r}")
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{' with '.join(sources)}: {e}") from e
    return defaults
