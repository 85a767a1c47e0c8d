"""compressed-tensors checkpoints: turn weights into checkpoint tensors, write the folder, read it back.

The writer produces what llm-compressor produces (HF unfused tensor names, ``quantization_config``
per our spec), so vLLM serves our checkpoints and we serve theirs. The folder is written next
to its destination and renamed into place, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from quant import fp4
from quant.config import QuantizationConfig
from quant.fp8 import fp8_scale, quantize_fp8, spread_tiles, tile_scales
from quant.int_quant import compute_qparams, pack_int32, quantize_int
from quant.kv_cache import validate_kv_scale
from quant.schemes import QuantScheme

WEIGHTS_NAME = "model.safetensors"
# Source files that travel with a checkpoint unchanged (tokenizer, generation defaults, chat template).
_COPIED_FILES = re.compile(
    r"^(tokenizer.*|generation_config\.json|special_tokens_map\.json|chat_template\..*|"
    r"added_tokens\.json|vocab\.json|merges\.txt)$"
)


# ---------------------------------------------------------------- weights → checkpoint tensors


def _scale_dtype(weight: torch.Tensor, scale: torch.Tensor | None, scale_dtype: torch.dtype | None) -> torch.dtype:
    if scale_dtype is not None:
        return scale_dtype
    if scale is not None:
        return scale.dtype
    return weight.dtype if weight.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def _weight_scale_shape(scale: torch.Tensor, strategy: str, out: int) -> torch.Tensor:
    # CT shapes: tensor [1], channel [out, 1], group [out, n_groups].
    return scale.reshape(1) if strategy == "tensor" else scale.reshape(out, -1)


def quantize_weight(
    weight: torch.Tensor,
    scheme: QuantScheme,
    *,
    q: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    input_scale: torch.Tensor | float | None = None,
    scale_dtype: torch.dtype | None = None,
    global_scale: torch.Tensor | None = None,
    input_global_scale: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one Linear, keyed by suffix (``weight_packed``, ``weight_scale``, ...).

    weight: [out, in] float. Without ``q`` the weight is rounded to nearest with min-max scales
    (RTN). With ``q`` (int8 values from GPTQ) ``scale`` (and ``zero_point`` when asymmetric,
    ``g_idx`` for actorder group) come from the algorithm. ``input_scale`` (absmax/448 over the
    calibration set) is required for static FP8 activations. NVFP4 weights take the fused Linear's
    ``global_scale`` (shards of one Linear share it, as vLLM requires; default: this weight's own)
    and store FP8 group scales; NVFP4 activations need ``input_global_scale`` (from the calibration
    set's input absmax); MXFP4 stores power-of-two group scales as bytes and no global scale.
    Other scales are stored in ``scale_dtype``
    (default: the given scale's dtype, else the weight's) and RTN values are computed from the stored scales, so the
    checkpoint dequantizes to exactly what we measured.
    """
    w = scheme.weights
    out, cols = weight.shape
    sdtype = _scale_dtype(weight, scale, scale_dtype)
    tensors: dict[str, torch.Tensor] = {}
    acts = scheme.input_activations
    static_input = acts is not None and not acts.dynamic
    if static_input != (input_scale is not None):
        raise ValueError(f"input_scale is {'required' if static_input else 'not allowed'} for scheme {scheme}")
    if static_input:
        s = torch.as_tensor(input_scale, dtype=torch.float32).reshape(1)
        if not torch.isfinite(s).all() or s.item() <= 0:
            raise ValueError(f"input_scale must be positive and finite, got {s.item()}")
        tensors["input_scale"] = s.to(sdtype)

    if w.is_fp4:
        nvfp4 = w.fp4_kind == "nvfp4"
        if zero_point is not None or g_idx is not None or (q is None) != (scale is None) or (
                q is not None and nvfp4 and global_scale is None) or (not nvfp4 and global_scale is not None):
            raise ValueError("FP4 takes precomputed codes (GPTQ) with their group scales (and NVFP4's global scale), "
                             "or none")
        if nvfp4:
            scaling = fp4.Nvfp4.of(weight) if global_scale is None else fp4.Nvfp4(global_scale)
            tensors["weight_global_scale"] = scaling.global_scale.clone()
        else:
            scaling = fp4.Mxfp4()
        scales = scaling.group_scales(weight) if scale is None else scale.to(scaling.scale_dtype)
        codes = fp4.quantize(weight, scaling, scales) if q is None else q.to(torch.uint8)
        tensors.update(weight_packed=fp4.pack(codes), weight_scale=scales)
        needs_input_global = acts is not None and nvfp4  # MXFP4 activations have no global scale
        if needs_input_global != (input_global_scale is not None):
            raise ValueError(f"input_global_scale is {'required' if needs_input_global else 'not allowed'} "
                             f"for scheme {scheme}")
        if input_global_scale is not None:
            tensors["input_global_scale"] = input_global_scale.float().reshape(1).clone()
        return tensors

    if w.type == "float":
        if q is not None or zero_point is not None or g_idx is not None:
            raise ValueError("FP8 weights take no precomputed q/zero_point/g_idx")
        if w.strategy == "block":  # a scale per tile, stored [row tiles, column tiles]
            scale = (tile_scales(weight, w.block_structure) if scale is None else scale).to(sdtype)
            tensors["weight"] = quantize_fp8(weight, spread_tiles(scale, w.block_structure, (out, cols)))
            tensors["weight_scale"] = scale
            return tensors
        scale = fp8_scale(weight, w.strategy) if scale is None else scale
        scale = _weight_scale_shape(scale.to(sdtype), w.strategy, out)
        tensors["weight"] = quantize_fp8(weight, scale.float().reshape(-1, 1))  # [out, in] fp8
        tensors["weight_scale"] = scale
        return tensors

    if q is None:
        if g_idx is not None:
            raise ValueError("g_idx comes from GPTQ with actorder 'group'; pass it with the q it produced")
        w2d = weight.reshape(1, -1) if w.strategy == "tensor" else weight
        scale, zero_point = compute_qparams(w2d, w.num_bits, group_size=w.group_size, symmetric=w.symmetric)
        scale = scale.to(sdtype)
        per_row = (lambda t: t.expand(out, 1)) if w.strategy == "tensor" else (lambda t: t)
        q = quantize_int(
            weight, per_row(scale), None if zero_point is None else per_row(zero_point), w.num_bits,
            group_size=w.group_size,
        )
    elif scale is None or (zero_point is None) != w.symmetric:
        raise ValueError("precomputed q needs scale, and zero_point exactly when the scheme is asymmetric")
    if tuple(q.shape) != (out, cols):
        raise ValueError(f"q shape {tuple(q.shape)} != weight shape {(out, cols)}")
    scale = _weight_scale_shape(scale.to(sdtype), w.strategy, out)
    tensors["weight_scale"] = scale
    if scheme.format == "pack-quantized":
        tensors["weight_packed"] = pack_int32(q.to(torch.int8), w.num_bits)  # [out, ceil(in·b/32)] int32
        tensors["weight_shape"] = torch.tensor([out, cols], dtype=torch.int64)
    else:
        tensors["weight"] = q.to(torch.int8).contiguous()
    if zero_point is not None:
        zp = zero_point.to(torch.int8).reshape(scale.shape)
        packed_zp = scheme.format == "pack-quantized" and w.strategy in ("group", "channel")
        tensors["weight_zero_point"] = pack_int32(zp, w.num_bits, dim=0) if packed_zp else zp
    if g_idx is not None:
        if w.actorder != "group":
            raise ValueError("weight_g_idx is only written for actorder 'group'")
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    return tensors


# ---------------------------------------------------------------- writer


def share_by_umask(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes a plain mkdir/open would get under the umask.

    ``tempfile.mkdtemp`` makes 0700 folders and safetensors writes 0600 files, so without this a
    checkpoint is private to its writer and a server running as another user cannot read it.
    """
    umask = os.umask(0)  # the only way to read it; set it straight back
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)


def publish_folder(tmp: Path, out: Path) -> None:
    """Rename the complete folder ``tmp`` (beside ``out``) to ``out``, replacing any ``out``.

    The old ``out`` is moved aside first (rename cannot replace a non-empty folder) and deleted
    only once ``tmp`` is in place; if that rename fails it is put back, so ``out`` is always whole.
    """
    share_by_umask(tmp)
    if not out.exists():
        os.replace(tmp, out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    os.replace(out, aside / out.name)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(aside / out.name, out)
        aside.rmdir()
        raise
    shutil.rmtree(aside)


def write_checkpoint(
    out_dir: str | os.PathLike,
    *,
    source_dir: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    quant_config: QuantizationConfig,
    extra_files: Mapping[str, dict] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a compressed-tensors checkpoint folder and return its path.

    tensors: full HF names (``model.layers.0.self_attn.q_proj.weight_scale``, ...). config.json is
    the source's with ``quantization_config`` replaced; tokenizer and generation files are copied;
    ``extra_files`` are JSON files by name (e.g. ``calibration.json``).
    """
    out = Path(out_dir)
    source = Path(source_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quant_config.to_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in sorted(source.iterdir()):
            if f.is_file() and _COPIED_FILES.match(f.name):
                shutil.copy2(f, tmp / f.name)
        for name, payload in (extra_files or {}).items():
            if Path(name).name != name or name in (WEIGHTS_NAME, "config.json"):
                raise ValueError(f"extra file name {name!r} must be a plain new file name")
            (tmp / name).write_text(json.dumps(payload, indent=2) + "\n")
        publish_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------- reader


def read_quantization_config(model_dir: str | os.PathLike) -> QuantizationConfig | None:
    """The parsed ``quantization_config`` of a model folder, or None for an unquantized model."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    qc = config.get("quantization_config")
    return None if qc is None else QuantizationConfig.from_dict(qc)


_KV_TENSOR = re.compile(
    r"\.self_attn\.(?:[kvq]_scale|kv_scale|[kvq]_zero_point|"
    r"[kv]_proj\.(?:output_scale|output_zero_point)|k_proj\.k_scale|v_proj\.v_scale)$"
)


def is_kv_cache_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the KV cache (route it to :func:`load_kv_scales`, not a Linear).

    Covers CT (``self_attn.k_scale``), legacy CT (``k_proj.output_scale``), ModelOpt
    (``k_proj.k_scale``), the old single ``kv_scale``, ``q_scale`` (unused: our attention does not
    run in FP8) and zero points, which symmetric FP8 never needs.
    """
    return _KV_TENSOR.search(name) is not None


def kv_scale_names(layer_idx: int) -> dict[str, tuple[str, ...]]:
    """Accepted checkpoint names of layer ``layer_idx``'s K and V scales, most preferred first."""
    a = f"model.layers.{layer_idx}.self_attn"
    return {
        "k": (f"{a}.k_scale", f"{a}.k_proj.output_scale", f"{a}.k_proj.k_scale", f"{a}.kv_scale"),
        "v": (f"{a}.v_scale", f"{a}.v_proj.output_scale", f"{a}.v_proj.v_scale", f"{a}.kv_scale"),
    }


@dataclass(frozen=True)
class KVScales:
    """One layer's FP8 KV scales, fp32 [num_kv_heads, 1] each (dequantize: x = x8 · scale)."""

    k: torch.Tensor
    v: torch.Tensor


def load_kv_scales(tensors: Mapping[str, torch.Tensor], num_layers: int, num_kv_heads: int) -> list[KVScales]:
    """Find and validate every layer's K/V scales; raise ValueError naming the first bad or missing one."""
    layers = []
    for i in range(num_layers):
        found = {}
        for kind, names in kv_scale_names(i).items():
            name = next((n for n in names if n in tensors), names[0])
            found[kind] = validate_kv_scale(name, tensors[name] if name in tensors else None, num_kv_heads)
        layers.append(KVScales(k=found["k"], v=found["v"]))
    return layers
