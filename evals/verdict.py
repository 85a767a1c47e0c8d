"""verdict.json: the gate's decision bound to the exact weight files it judged, the files beside
them that decide what those weights output (config, tokenizer, chat template, generation and
adapter settings), and the activation dtype and KV cache they ran with.

The server's `--require-gate` calls `check_verdict`; any edit to one of those files after the
gate ran changes its sha256 and voids the verdict (a new chat template or lora_alpha changes the
answers as surely as new weights), and serving with other activations or another KV cache than
the gate judged (bf16 on a GPU for a checkpoint gated in fp32 on a CPU, an fp8_e5m2 cache for one
gated with its calibrated fp8 one) is refused.
A LoRA adapter gated over a checkpoint (`gate --lora`) gets its own verdict, in the adapter's
folder, bound to its weights and to the checkpoint's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.atomic_write import write_text_atomic
from engine.file_hash import file_sha256

VERDICT_FILE = "verdict.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# besides the weights, what decides a checkpoint's (or an adapter's) outputs for a request (a shard
# index decides which weight files load)
BEHAVIOUR_FILES = ("config.json", "generation_config.json", "adapter_config.json",
                   "model.safetensors.index.json", "pytorch_model.bin.index.json", "tokenizer.json",
                   "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
# 2: records `serving`, the KV cache setting the candidate was judged with; 3: `config_sha256`
FORMAT_VERSION = 3


class VerdictError(RuntimeError):
    """The checkpoint has no valid passing verdict; the message says which check failed."""


def weight_files(model_dir: Path) -> list[Path]:
    """Every weight file in the folder, sorted by name."""
    return sorted(p for p in Path(model_dir).iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def weight_hashes(model_dir: Path) -> dict[str, str]:
    """{file name: sha256} for every weight file; a folder with none is an error."""
    files = weight_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {model_dir}")
    return {p.name: file_sha256(p) for p in files}


def config_hashes(model_dir: Path) -> dict[str, str]:
    """{file name: sha256} for the BEHAVIOUR_FILES the folder has."""
    present = [Path(model_dir) / name for name in BEHAVIOUR_FILES]
    return {path.name: file_sha256(path) for path in present if path.is_file()}


def write_verdict(
    candidate_dir: Path,
    *,
    passed: bool,
    policy: dict[str, Any],
    metrics: dict[str, Any],
    baseline_hashes: dict[str, str],
    candidate_hashes: dict[str, str] | None = None,
    candidate_config_hashes: dict[str, str] | None = None,
    serving: dict[str, Any] | None = None,
    base_hashes: dict[str, str] | None = None,
) -> Path:
    """Write CANDIDATE/verdict.json (whole or not at all) and return its path. The gate passes the
    candidate's weight and config hashes as they were when its arm loaded them (None: hashed now).
    `serving` is engine.config.serving_setting of the candidate arm; None when the gate judged a
    live server (as it ran, which it cannot see). For an adapter, `candidate_dir` is its folder and
    `base_hashes` the checkpoint it ran over."""
    candidate_dir = Path(candidate_dir)
    body = {
        "format_version": FORMAT_VERSION,
        "verdict": "pass" if passed else "fail",
        "weights_sha256": candidate_hashes if candidate_hashes is not None else weight_hashes(candidate_dir),
        "config_sha256": candidate_config_hashes if candidate_config_hashes is not None else config_hashes(candidate_dir),
        "base_weights_sha256": base_hashes,
        "baseline_weights_sha256": baseline_hashes,
        "serving": serving,
        "policy": policy,
        "metrics": metrics,
    }
    path = candidate_dir / VERDICT_FILE
    write_text_atomic(path, json.dumps(body, indent=2, sort_keys=True, default=str) + "\n")
    return path


def check_verdict(model_dir: str | Path, serving: dict[str, Any] | None = None,
                  base_hashes: dict[str, str] | None = None) -> dict[str, str]:
    """Raise VerdictError unless a passing verdict matches every current weight file and, given
    `serving` (engine.config.serving_setting), the activation dtype and KV cache the gate judged; for an
    adapter's folder, `base_hashes` are those of the checkpoint it is served over, which must be
    the one gated. Returns the folder's weight hashes (an adapter's check takes its checkpoint's)."""
    model_dir = Path(model_dir)
    path = model_dir / VERDICT_FILE
    if not path.is_file():
        raise VerdictError(f"{model_dir} has no {VERDICT_FILE}; run `driftgate gate` on it first")
    try:
        body = json.loads(path.read_text())
        recorded = body["weights_sha256"]
        verdict = body["verdict"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise VerdictError(f"{path} is unreadable or incomplete ({exc}); re-run the gate") from exc
    if verdict != "pass":
        raise VerdictError(f"{path} records a failing gate verdict ({verdict!r}); this checkpoint drifted")
    try:
        current = weight_hashes(model_dir)
    except FileNotFoundError as exc:
        raise VerdictError(str(exc)) from exc
    _check_unchanged("weight", current, recorded)
    if body.get("format_version", 1) < 3:
        raise VerdictError(f"{path} predates verdicts that bind the config, tokenizer and chat template; re-run the gate")
    _check_unchanged("configuration", config_hashes(model_dir), body.get("config_sha256", {}))
    if serving is not None:
        _check_serving(body, serving, path)
    judged_base = body.get("base_weights_sha256")
    if base_hashes is not None and (judged_base is None or judged_base != base_hashes):
        raise VerdictError(f"{path} judged this adapter over another checkpoint than the one served (or as a "
                           f"checkpoint of its own); gate it with `driftgate gate --candidate CHECKPOINT --lora "
                           f"{model_dir}`")
    return current


def _recorded(model_dir: str | Path) -> dict[str, Any]:
    """The folder's verdict as written, or {} when there is none to read (check_verdict says why)."""
    try:
        body = json.loads((Path(model_dir) / VERDICT_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return body if isinstance(body, dict) else {}


def judged_context_len(model_dir: str | Path) -> int | None:
    """The longest context (prompt and output, in tokens) the folder's verdict judged: its policy's
    max_model_len; None when the verdict does not say."""
    try:
        length = _recorded(model_dir)["policy"]["engine"]["max_model_len"]
    except (KeyError, TypeError):
        return None
    return length if isinstance(length, int) else None


def marginal_checks(model_dir: str | Path) -> list[str]:
    """The verdict's checks whose threshold lay inside their value's interval (see
    gate.Check.marginal), each as 'name value against threshold (interval [low, high])'."""
    try:
        return [f"{c['name']} {c['value']:.4g} against {c['threshold']:.4g} "
                f"(interval [{c['interval'][0]:.4g}, {c['interval'][1]:.4g}])"
                for c in _recorded(model_dir)["metrics"]["checks"] if c.get("marginal")]
    except (KeyError, TypeError, IndexError, AttributeError):
        return []


def _check_unchanged(kind: str, current: dict[str, str], recorded: dict[str, str]) -> None:
    if current.keys() != recorded.keys():
        raise VerdictError(
            f"{kind} files changed since the gate ran: now {sorted(current)}, verdict covers {sorted(recorded)}")
    changed = sorted(name for name in current if current[name] != recorded[name])
    if changed:
        raise VerdictError(f"{kind} files changed since the gate ran (sha256 mismatch: {', '.join(changed)})")


def _check_serving(body: dict[str, Any], serving: dict[str, Any], path: Path) -> None:
    judged = body.get("serving")
    if judged is None:  # gated as a live server: the deployment as it ran
        return
    judged = {"dtype": "float32", **judged}  # verdicts that predate the field: the gate then always ran fp32
    if judged != serving:
        raise VerdictError(f"the gate judged this checkpoint with {describe_setting(judged)}, not {describe_setting(serving)}; "
                           f"gate it so (driftgate gate ... --dtype {serving['dtype']} --kv-cache-dtype "
                           f"{serving['kv_cache_dtype']}) before serving it so")


def describe_setting(setting: dict[str, Any]) -> str:
    """A `serving_setting` in words, as the gate's report and `serve --require-gate` say it."""
    scales = f" ({setting['kv_scales']} scales)" if setting.get("kv_scales") else ""
    return f"{setting['dtype']} activations and KV cache {setting['kv_cache_dtype']}{scales}"
