"""``calibration.json``: how a checkpoint was made, so a drifted result can be traced to its inputs."""

from __future__ import annotations

import platform
import resource
from importlib import metadata
from typing import Any

from calibration.data import CalibrationSet
from calibration.options import QuantizeOptions
from calibration.pipeline import CalibrationResult

_DEFINITIONS = {
    "output_error": "‖y_q − y‖_F / ‖y‖_F of one decoder layer's output (hidden + residual) on the held-out "
                    "samples, quantized vs unquantized layer given the same input (the quantized stream so far)",
    "weight_errors": "‖Ŵ − W‖_F / ‖W‖_F per checkpoint Linear, W as handed to the quantizer "
                     "(after AWQ smoothing for --algo awq), Ŵ as the served module dequantizes it",
    "input_absmax": "max |x| over every observed token of the Linear's input",
    "k_absmax": "max |K| after RoPE per KV head over the whole calibration set; k_scale = max / 448",
}
_TOOLS = ("driftgate", "torch", "transformers", "safetensors", "compressed-tensors")


def _tool_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _TOOLS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def build_report(options: QuantizeOptions, calib: CalibrationSet, result: CalibrationResult, *,
                 group_size: int | None, ignore: list[str], wall_seconds: float) -> dict[str, Any]:
    """The JSON payload; errors are relative Frobenius norms (‖approx − exact‖ / ‖exact‖)."""
    output_errors = [r.output_error for r in result.layers if r.output_error is not None]
    weight_errors = [e for r in result.layers for e in r.weight_errors.values()]
    return {
        "definitions": _DEFINITIONS,
        "model_dir": str(options.model_dir.resolve()),
        "scheme": options.scheme,
        "algorithm": options.algorithm if options.scheme != "none" else None,
        "smoothquant_alpha": options.smoothquant,
        "group_size": group_size,
        "group_size_requested": options.group_size if options.group_size is not None else "auto",
        "kv_cache": options.kv_cache,
        "kv_scale_strategy": options.kv_strategy if options.kv_cache else None,
        "ignore": ignore,
        "dataset": {
            "path": str(calib.path.resolve()),
            "sha256": calib.sha256,
            "num_records": calib.num_records,
            "num_samples": len(calib.samples),
            "num_heldout": len(calib.heldout),
            "is_heldout_disjoint": calib.is_heldout_disjoint,
            "num_tokens": calib.num_tokens,
            "num_tokens_observed": result.num_tokens_observed,
            "max_seq_len": options.max_seq_len,
            "seed": options.seed,
        },
        "summary": {
            "mean_layer_output_error": _mean(output_errors),
            "max_layer_output_error": max(output_errors, default=None),
            "mean_weight_error": _mean(weight_errors),
        },
        "layers": [
            {
                "layer": r.layer_idx,
                "output_error": r.output_error,
                "weight_errors": r.weight_errors,
                "input_absmax": r.input_absmax,
                "k_absmax": r.k_absmax,
                "v_absmax": r.v_absmax,
                "seconds": round(r.seconds, 3),
            }
            for r in result.layers
        ],
        "wall_seconds": round(wall_seconds, 3),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "device": options.device,
        "tools": _tool_versions(),
    }
