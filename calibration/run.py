"""One ``quantize`` run end to end: check inputs, calibrate, write the checkpoint and its report.

Everything that can be checked without reading weights (model folder, output folder, ignore
list, group size, the whole calibration file) is checked first, so a user error costs
seconds and leaves nothing behind; the checkpoint itself is written to a temporary folder
and renamed into place by ``quant.checkpoint``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch
from safetensors import safe_open

from calibration.data import CalibrationDataError, load_calibration_set
from calibration.options import GROUP_SIZES, QuantizeOptions
from calibration.pipeline import CalibrationResult, calibrate
from calibration.quantizers import WeightQuantizer
from calibration.report import build_report
from calibration.targets import LinearTarget, TargetError, layer_linears, resolve_group_size, select_targets
from engine.output_paths import check_output_path
from quant import fp4
from quant.checkpoint import write_checkpoint
from quant.config import QuantizationConfig
from quant.fp8 import fp8_scale
from quant.schemes import FP8_KV, QuantScheme, preset

_STORED_DTYPES = ("float32", "bfloat16", "float16")


class QuantizeError(Exception):
    """A problem with the user's inputs, reported as one line and exit code 2."""


def _read_model_config(model_dir: Path) -> dict:
    from engine.loader import read_config

    try:
        return read_config(model_dir)
    except ValueError as exc:
        raise QuantizeError(str(exc)) from None


def _check_output(options: QuantizeOptions) -> None:
    """Before calibrating: the output folder must be writable, not replace what exists unasked,
    and never be (or hold) the model being read."""
    out, model = options.output_dir.resolve(), options.model_dir.resolve()
    if model.is_relative_to(out):
        raise QuantizeError(f"output folder {options.output_dir} is (or holds) the model folder {options.model_dir}; "
                            "write the checkpoint elsewhere")
    try:
        check_output_path(options.output_dir, folder=True)
    except ValueError as exc:
        raise QuantizeError(str(exc)) from None
    if not options.output_dir.exists():
        return
    if not options.overwrite:
        raise QuantizeError(f"output folder {options.output_dir} exists; pass --overwrite to replace it")
    # --overwrite replaces the whole folder: only a checkpoint this tool wrote, and nothing in use
    if Path.cwd().is_relative_to(out):
        raise QuantizeError(f"output folder {options.output_dir} is (or holds) the current folder; "
                            "--overwrite replaces the whole folder, so write the checkpoint elsewhere")
    if options.calib_path.resolve().is_relative_to(out):
        raise QuantizeError(f"output folder {options.output_dir} holds the calibration file {options.calib_path}; "
                            "--overwrite would delete it, so write the checkpoint elsewhere")
    if any(out.iterdir()) and not _is_quantized_checkpoint(out):
        raise QuantizeError(f"output folder {options.output_dir} holds files but no quantized checkpoint (a config.json "
                            "with a quantization_config); --overwrite replaces only a checkpoint, so give a new or "
                            "empty folder")


def _is_quantized_checkpoint(folder: Path) -> bool:
    from engine.loader import read_config

    try:
        return "quantization_config" in read_config(folder)
    except ValueError:  # no config.json, or not a model's
        return False


def _plan(options: QuantizeOptions, config: dict) -> tuple[list[LinearTarget], list[str], int | None]:
    """(quantized Linears, the checkpoint's ignore list, group size), from the model's structure only."""
    from engine.models.llama import BASE_MODELS, CLASSIFIERS, LlamaArgs, LlamaForCausalLM

    arch = (config.get("architectures") or [None])[0]
    if arch in BASE_MODELS or arch in CLASSIFIERS:
        kind = "a headless checkpoint, as embedding models are saved" if arch in BASE_MODELS else "a sequence classifier"
        raise QuantizeError(f"{options.model_dir} is {kind} ({arch}); quantize takes causal LMs, which the gate "
                            "can evaluate")
    try:
        args = LlamaArgs.from_hf_config(config)
    except (ValueError, KeyError) as exc:
        raise QuantizeError(f"{options.model_dir}: {exc}") from None
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(args)
    linears = layer_linears(skeleton)
    try:
        targets = select_targets(linears, options.ignore)
        if options.scheme == "none":
            return [], list(options.ignore), None
        group_size = resolve_group_size(targets, options.group_size, GROUP_SIZES) if options.is_grouped else None
    except TargetError as exc:
        raise QuantizeError(str(exc)) from None
    fp4_group = fp4.SCALINGS[kind].group_size if (kind := preset(options.scheme).weights.fp4_kind) else None
    if fp4_group and (odd := [t.prefixes[0] for t in targets if t.input_size % fp4_group]):
        raise QuantizeError(f"{options.scheme} groups input columns by {fp4_group}; {', '.join(odd[:3])} "
                            f"{'has' if len(odd) == 1 else 'have'} other input sizes (add them to --ignore)")
    quantized = {p for t in targets for p in t.prefixes}
    ignored = [p for t in linears for p in t.prefixes if p not in quantized]
    return targets, ["lm_head", *ignored], group_size


def _scheme(options: QuantizeOptions, group_size: int | None) -> QuantScheme | None:
    if options.scheme == "none":
        return None
    return preset(options.scheme, group_size=group_size) if group_size else preset(options.scheme)


def _quant_config(scheme: QuantScheme | None, ignore: list[str], options: QuantizeOptions) -> QuantizationConfig:
    config = QuantizationConfig.for_scheme(scheme, ignore=tuple(ignore), kv_cache=options.kv_cache is not None)
    if options.kv_cache is not None and options.kv_strategy == "head":
        config = dataclasses.replace(config, kv_cache_scheme=dataclasses.replace(FP8_KV, strategy="attn_head"))
    return config


def _checkpoint_tensors(model_dir: Path, result: CalibrationResult, kv_strategy: str | None,
                        norm_offset: float) -> dict[str, torch.Tensor]:
    """Source tensors with each quantized Linear's ``weight`` swapped for its quantized tensors, plus KV scales.
    A norm the quantizer changed is written back in the checkpoint's convention (Gemma's less the
    `norm_offset` the loader added)."""
    files = sorted(model_dir.glob("*.safetensors"))
    replaced = {f"{prefix}.weight" for prefix in result.tensors}
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in replaced:
                    continue
                tensor = f.get_tensor(name)
                if name in result.changed:  # e.g. a norm that absorbed AWQ scales; keep the source dtype
                    tensor = (result.changed[name] - norm_offset).to(tensor.dtype)
                tensors[name] = tensor
    for prefix, quantized in result.tensors.items():
        tensors.update({f"{prefix}.{suffix}": t for suffix, t in quantized.items()})
    for layer_idx, (k_absmax, v_absmax) in enumerate(result.kv_absmax):
        for kind, absmax in (("k", k_absmax), ("v", v_absmax)):
            if kv_strategy == "head":
                scale = fp8_scale(absmax.unsqueeze(-1), "channel").reshape(-1, 1, 1)  # [num_kv_heads, 1, 1]
            else:
                scale = fp8_scale(absmax, "tensor")  # [1]: absmax over every head and token / 448
            tensors[f"model.layers.{layer_idx}.self_attn.{kind}_scale"] = scale
    return tensors


def quantize(options: QuantizeOptions) -> Path:
    """Run the whole command; returns the written checkpoint folder."""
    from engine.loader import load_model
    from engine.tokenizer import load_tokenizer

    started = time.perf_counter()
    config = _read_model_config(options.model_dir)
    _check_output(options)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("format") or config["quantization_config"].get("quant_method")
        raise QuantizeError(f"{options.model_dir} is already quantized ({method}); quantize the model it came from")
    if options.device == "cuda" and not torch.cuda.is_available():
        raise QuantizeError("--device cuda was asked for, but no CUDA device is available")
    targets, ignore, group_size = _plan(options, config)
    if group_size is not None:
        print(f"group size {group_size}" + (" (auto)" if options.group_size is None else ""))
    try:
        tokenizer = load_tokenizer(options.model_dir)
    except ValueError as exc:  # no tokenizer files (transformers blamed a missing sentencepiece), or damaged ones
        raise QuantizeError(str(exc)) from None
    try:
        calib = load_calibration_set(options.calib_path, tokenizer, num_samples=options.num_samples,
                                     max_seq_len=options.max_seq_len, seed=options.seed,
                                     allow_few=options.allow_few, num_heldout=options.num_heldout)
    except CalibrationDataError as exc:
        raise QuantizeError(str(exc)) from None
    print(f"calibrating on {len(calib.samples)} samples ({calib.num_tokens} tokens), "
          f"{len(calib.heldout)} held out")
    # Held at the checkpoint's own precision; the pipeline upcasts one layer at a time.
    stored = config.get("torch_dtype") or config.get("dtype")
    try:
        model, _ = load_model(options.model_dir, dtype=stored if stored in _STORED_DTYPES else "float32", device="cpu")
    except (ValueError, OSError) as exc:  # a truncated or missing weight file, a tensor of the wrong shape
        raise QuantizeError(f"{options.model_dir}: {exc}") from None
    scheme = _scheme(options, group_size)
    quantizer = (WeightQuantizer(scheme, options.algorithm, smoothquant_alpha=options.smoothquant)
                 if scheme is not None else None)
    result = calibrate(model, calib.samples, calib.heldout, targets, quantizer,
                       observe_kv=options.kv_cache is not None, device=options.device)
    norm_offset = model.args.norm_offset
    del model
    tensors = _checkpoint_tensors(options.model_dir, result, options.kv_strategy if options.kv_cache else None,
                                  norm_offset)
    report = build_report(options, calib, result, group_size=group_size, ignore=ignore,
                          wall_seconds=time.perf_counter() - started)
    return write_checkpoint(options.output_dir, source_dir=options.model_dir, tensors=tensors,
                            quant_config=_quant_config(scheme, ignore, options),
                            extra_files={"calibration.json": report}, overwrite=options.overwrite)
