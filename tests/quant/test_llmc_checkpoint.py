"""A checkpoint laid out the way llm-compressor writes it loads in our engine and computes what it says.

The checkpoints here are built in the test straight from the compressed-tensors spec
(`shared/reference/quant-formats.md`, sections 1.3-1.5 and "Spec for our writer/loader"),
without our writer or packing code, so a shared misreading of the spec cannot hide: the
quantization config is the JSON llm-compressor emits (checked against compressed-tensors'
own pydantic models), the tensors are bf16 scales, e4m3 weights or uint4b8 nibbles packed by
hand, and the KV scales are 0-d with the zero points old llm-compressor releases still wrote.
The oracle is HF transformers on the dequantized weights (dequantize, then dense), with
FP8's dynamic per-token activation rounding applied as forward hooks for the W8A8 scheme.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig as CTQuantizationConfig
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.layers import cpu_kernels, panel_matmul
from tests.helpers import make_tiny_model_dir

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NUM_LAYERS = 2
GROUP = 128  # llm-compressor's W4A16 preset
E4M3_MAX = 448.0
K_SCALE, V_SCALE = 0.05, 0.03

_COMMON_ARGS = {"block_structure": None, "actorder": None, "observer_kwargs": {}}
FP8_DYNAMIC_GROUP = {  # llm-compressor FP8_DYNAMIC
    "targets": ["Linear"], "format": "float-quantized", "output_activations": None,
    "weights": {**_COMMON_ARGS, "num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                "strategy": "channel", "dynamic": False, "observer": "minmax"},
    "input_activations": {**_COMMON_ARGS, "num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                          "strategy": "token", "dynamic": True, "observer": None},
}
W4A16_GROUP = {  # llm-compressor W4A16
    "targets": ["Linear"], "format": "pack-quantized", "output_activations": None, "input_activations": None,
    "weights": {**_COMMON_ARGS, "num_bits": 4, "type": "int", "symmetric": True, "group_size": GROUP,
                "strategy": "group", "dynamic": False, "observer": "minmax"},
}
W4A8_GROUP = {  # llm-compressor W4A8: W4A16's weights, unpacked (int-quantized), and per-token int8 inputs
    "targets": ["Linear"], "format": "int-quantized", "output_activations": None,
    "weights": W4A16_GROUP["weights"],
    "input_activations": {**_COMMON_ARGS, "num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
                          "strategy": "token", "dynamic": True, "observer": None},
}
FP8_BLOCK_GROUP = {  # llm-compressor FP8_BLOCK: 128x128 weight tiles, inputs per token and 128 columns
    "targets": ["Linear"], "format": "float-quantized", "output_activations": None,
    **{k: {**_COMMON_ARGS, **v.model_dump(mode="json", exclude={"scale_dtype", "zp_dtype"})}
       for k, v in PRESET_SCHEMES["FP8_BLOCK"].items()},
}
KV_SCHEME = {**_COMMON_ARGS, "num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
             "strategy": "tensor", "dynamic": False, "observer": "minmax"}


def quantization_config(group: dict, kv: bool) -> dict:
    return {"quant_method": "compressed-tensors", "version": "0.12.2", "format": group["format"],
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": KV_SCHEME if kv else None,
            "quantization_status": "compressed", "global_compression_ratio": None, "sparsity_config": {},
            "transform_config": {}}


def fp8_channel(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """e4m3 weight + [out, 1] bf16 scale = row absmax / 448; no input_scale (dynamic)."""
    scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).to(torch.bfloat16)
    q = (w / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale.float()


def pack_uint4b8(q: torch.Tensor) -> torch.Tensor:
    """int4 values (−8..7) → int32 [out, in/8]: value+8 as a nibble, column c at bits 4·(c % 8), LSB first."""
    u = q.to(torch.int64) + 8
    words = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for j in range(8):
        words |= u[:, j::8] << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # reinterpret as signed


def int4_group(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Symmetric group-128 INT4 as compressed-tensors computes it: scale = group absmax / 7.5."""
    out, cols = w.shape
    groups = w.reshape(out, cols // GROUP, GROUP)
    scale = (groups.abs().amax(dim=2) / 7.5).to(torch.bfloat16)  # [out, in/128]
    q = (groups / scale.float()[..., None]).round().clamp(-8, 7).reshape(out, cols)
    dequantized = (q.reshape(out, cols // GROUP, GROUP) * scale.float()[..., None]).reshape(out, cols)
    tensors = {"weight_packed": pack_uint4b8(q), "weight_scale": scale,
               "weight_shape": torch.tensor([out, cols], dtype=torch.int64)}
    return tensors, dequantized


def int4_group_unpacked(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The same int4 values as int4_group, one int8 each (``weight``), as int-quantized stores them."""
    tensors, dequantized = int4_group(w)
    q = (dequantized.reshape(w.shape[0], -1, GROUP) / tensors["weight_scale"].float()[..., None]).round()
    return {"weight": q.reshape(w.shape).to(torch.int8), "weight_scale": tensors["weight_scale"]}, dequantized


def fp8_block(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """e4m3 weight + fp32 [row tiles, column tiles] scale, each tile's from compressed-tensors'
    calculate_qparams, values and dequantized weight from its quantize / dequantize (partial
    tiles where a Linear has fewer rows than a tile: k_proj and v_proj here)."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = PRESET_SCHEMES["FP8_BLOCK"]["weights"]
    (block_rows, block_cols), (rows, cols) = args.block_structure, w.shape
    tiles = torch.nn.functional.pad(w, (0, -cols % block_cols, 0, -rows % block_rows)).reshape(
        -(-rows // block_rows), block_rows, -(-cols // block_cols), block_cols)
    scale, zero_point = calculate_qparams(tiles.amin((1, 3)), tiles.amax((1, 3)), args)
    q = quantize(w, scale, zero_point, args)
    return {"weight": q.to(torch.float8_e4m3fn), "weight_scale": scale}, dequantize(q, scale, zero_point, args)


SCHEMES = {"fp8-dynamic": (FP8_DYNAMIC_GROUP, fp8_channel), "w4a16": (W4A16_GROUP, int4_group),
           "w4a8": (W4A8_GROUP, int4_group_unpacked), "fp8-block": (FP8_BLOCK_GROUP, fp8_block)}


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    """A tiny bf16 Llama whose input sizes (128, 256) are multiples of the group size 128."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("llmc-src") / "model", hidden_size=128, intermediate_size=256,
                               num_layers=NUM_LAYERS, num_heads=4, num_kv_heads=2, dtype=torch.bfloat16)


def write_llmc_checkpoint(source: Path, dest: Path, scheme: str, kv: bool) -> dict[str, torch.Tensor]:
    """Copy the folder, replace each layer Linear's weight by its quantized tensors; return the dequantized weights."""
    group, quantize = SCHEMES[scheme]
    shutil.copytree(source, dest)
    tensors = load_file(str(source / "model.safetensors"))
    dequantized = {}
    for i in range(NUM_LAYERS):
        for linear in LINEARS:
            prefix = f"model.layers.{i}.{linear}"
            quantized, dequantized[prefix] = quantize(tensors.pop(f"{prefix}.weight").float())
            tensors.update({f"{prefix}.{name}": t for name, t in quantized.items()})
        if kv:
            for name, value in (("k", K_SCALE), ("v", V_SCALE)):
                tensors[f"model.layers.{i}.self_attn.{name}_scale"] = torch.tensor(value, dtype=torch.bfloat16)
                tensors[f"model.layers.{i}.self_attn.{name}_zero_point"] = torch.tensor(0, dtype=torch.int8)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(group, kv)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized


FP4_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
             ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
NVFP4_INPUT_RANGE = 4.0  # the calibrated input absmax behind every Linear's input_global_scale
FP4_SCHEMES = ("nvfp4a16", "nvfp4", "mxfp4a16", "mxfp4")


def _ct_fp4(scheme: str):
    from compressed_tensors.quantization import quant_scheme

    return getattr(quant_scheme, scheme.upper())


def _nvfp4_input_global() -> torch.Tensor:
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    return generate_gparam(torch.tensor(-NVFP4_INPUT_RANGE), torch.tensor(NVFP4_INPUT_RANGE)).reshape(1)


def write_llmc_fp4_checkpoint(source: Path, dest: Path, scheme: str) -> dict[str, torch.Tensor]:
    """NVFP4 / MXFP4 (A16 or W4A4) as llm-compressor writes it, every tensor from compressed-tensors'
    own code: NVFP4's global scales from generate_gparam over each fused group (llm-compressor fuses
    q/k/v's and gate/up's), group scales from calculate_qparams, codes from the format's compressor;
    the dequantized weights from CT's unpacking and the spec's value · scale (/ global)."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    preset = _ct_fp4(scheme)
    nvfp4 = scheme.startswith("nvfp4")
    compressor, group_size = (NVFP4PackedCompressor, 16) if nvfp4 else (MXFP4PackedCompressor, 32)
    ct_scheme = QuantizationScheme(targets=["Linear"], **preset)
    shutil.copytree(source, dest)
    tensors = load_file(str(source / "model.safetensors"))
    dequantized = {}
    for i in range(NUM_LAYERS):
        for fused in FP4_FUSED:
            weights = {f"model.layers.{i}.{name}": tensors.pop(f"model.layers.{i}.{name}.weight").float()
                       for name in fused}
            whole = torch.cat(list(weights.values()))
            global_ = generate_gparam(whole.min(), whole.max()).reshape(1).float() if nvfp4 else None
            for prefix, w in weights.items():
                groups = w.reshape(w.shape[0], -1, group_size)
                scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), preset["weights"], global_scale=global_)
                state = {"weight": w, "weight_scale": scale.reshape(w.shape[0], -1)}
                packed = compressor.compress(state | ({"weight_global_scale": global_.clone()} if nvfp4 else {}),
                                             ct_scheme)
                tensors.update({f"{prefix}.{name}": t for name, t in packed.items()})
                if scheme == "nvfp4":
                    tensors[f"{prefix}.input_global_scale"] = _nvfp4_input_global().clone()
                values = unpack_fp4_from_uint8(packed["weight_packed"], *w.shape, dtype=torch.float32)
                effective = scale.reshape(w.shape[0], -1).float() / (global_ if nvfp4 else 1.0)
                dequantized[prefix] = values * effective.repeat_interleave(group_size, dim=1)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    group = {"targets": ["Linear"], "format": f"{scheme.removesuffix('a16')}-pack-quantized", "output_activations": None,
             **{k: None if v is None else {**_COMMON_ARGS, **v.model_dump(mode="json")}
                for k, v in (("weights", preset["weights"]), ("input_activations", preset.get("input_activations")))}}
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(group, kv=False)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized


def fake_quantize_tokens_fp8(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token FP8 activations: scale = token absmax / 448, round through e4m3."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).eps)
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def fake_quantize_tokens_int8(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token int8 activations (vLLM's): scale = token absmax / 127, rounded half to even."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).eps)
    return (x / scale).round().clamp(-127, 127) * scale


def fake_quantize_block_inputs(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' own run-time rounding of FP8_BLOCK's inputs (per token and 128 columns)."""
    from compressed_tensors.quantization.lifecycle.forward import compute_dynamic_scales_and_zp, fake_quantize

    args = PRESET_SCHEMES["FP8_BLOCK"]["input_activations"]
    scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Module())
    return fake_quantize(x=x, scale=scale, zero_point=zp, args=args)


def fake_quantize_fp4_inputs(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """compressed-tensors' own run-time rounding of FP4 activations (dynamic group scales; NVFP4's
    under the input global scale)."""
    from compressed_tensors.quantization.lifecycle.forward import compute_dynamic_scales_and_zp, fake_quantize

    args = _ct_fp4(scheme)["input_activations"]
    global_ = _nvfp4_input_global() if scheme == "nvfp4" else None
    scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Module(), global_scale=global_)
    return fake_quantize(x=x, scale=scale, zero_point=zp, args=args, global_scale=global_)


def hf_reference(source: Path, dequantized: dict[str, torch.Tensor], scheme: str, tokens: list[int],
                 bf16_lm_head_inputs: bool = False) -> torch.Tensor:
    """Log-probs [T, vocab] of HF transformers (fp32) with the dequantized weights swapped in, and
    the lm_head's inputs rounded to bf16 where the engine's CPU kernel does that."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for prefix, weight in dequantized.items():
        linear = model.get_submodule(prefix)
        linear.weight.data.copy_(weight)
        if scheme == "fp8-dynamic":
            linear.register_forward_pre_hook(lambda _, args: (fake_quantize_tokens_fp8(args[0]),))
        elif scheme == "w4a8":
            linear.register_forward_pre_hook(lambda _, args: (fake_quantize_tokens_int8(args[0]),))
        elif scheme == "fp8-block":
            linear.register_forward_pre_hook(lambda _, args: (fake_quantize_block_inputs(args[0]),))
        elif scheme in ("nvfp4", "mxfp4"):
            linear.register_forward_pre_hook(lambda _, args: (fake_quantize_fp4_inputs(args[0], scheme),))
    if bf16_lm_head_inputs:
        model.lm_head.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 31, 8, 77, 150, 19, 240, 4, 60, 90]

# Max |Δ log-prob| over 20 positions × vocab. Both sides compute the same dequantized fp32 model (0.0 measured
# on this CPU); the bound leaves room for another summation order, and is far below the 0.6-1.3 that separates
# the quantized models from the dense source.
TOLERANCE = 1e-4


@pytest.mark.parametrize("scheme", [*sorted(SCHEMES), *FP4_SCHEMES])
def test_llmcompressor_checkpoint_serves_its_dequantized_model(tmp_path, source_dir, scheme, monkeypatch, request):
    if scheme in ("fp8-dynamic", "w4a8", "nvfp4", "mxfp4", "fp8-block"):
        # Rounding activations to fp8 / int8 / fp4 is discontinuous: the C kernels' other summation order
        # moves an activation by an ulp, flips its rounding and moves log-probs by ~0.3. Compare with
        # torch's arithmetic on both sides; the kernels equal torch in tests/engine.
        monkeypatch.setenv("DRIFTGATE_CPU_KERNELS", "0")
        cpu_kernels.kernel.cache_clear()
        request.addfinalizer(cpu_kernels.kernel.cache_clear)
    ckpt = tmp_path / scheme
    if scheme in FP4_SCHEMES:
        dequantized = write_llmc_fp4_checkpoint(source_dir, ckpt, scheme)
    else:
        dequantized = write_llmc_checkpoint(source_dir, ckpt, scheme, kv=True)
    config = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    CTQuantizationConfig.model_validate(config)  # the config is one compressed-tensors itself accepts

    ours = LLM(str(ckpt), kv_cache_dtype="float32").score_full_logprobs(TOKENS)  # the weights alone: no fp8 cache
    # the unquantized lm_head of a quantized checkpoint meets bf16 inputs on CPUs with AVX-512 BF16
    reference = hf_reference(source_dir, dequantized, scheme, TOKENS, panel_matmul.bf16_dot_available())
    diff = (ours - reference).abs().max().item()
    assert diff < TOLERANCE, f"{scheme}: max |Δ logprob| {diff:.2e}"
    # the quantized weights did change the model: the comparison is not dense vs dense
    plain = LLM(str(source_dir)).score_full_logprobs(TOKENS)
    assert (plain - reference).abs().max().item() > 100 * TOLERANCE


def test_llmcompressor_kv_scales_reach_the_fp8_cache(tmp_path, source_dir):
    """0-d bf16 k/v scales with zero points: zero points dropped, scales on every layer's attention."""
    ckpt = tmp_path / "w4a16-kv"
    write_llmc_checkpoint(source_dir, ckpt, "w4a16", kv=True)
    llm = LLM(str(ckpt), kv_cache_dtype="fp8")
    for layer in llm.engine.model.model.layers:
        attn = layer.self_attn.attn
        assert attn.k_scale.flatten().tolist() == pytest.approx([K_SCALE] * 2, rel=4e-3)  # bf16 storage
        assert attn.v_scale.flatten().tolist() == pytest.approx([V_SCALE] * 2, rel=4e-3)
    assert llm.score_full_logprobs(TOKENS).isfinite().all()


def test_a_transformers_fp8_checkpoint_reads_as_transformers_and_its_compressed_tensors_twin(tmp_path, source_dir):
    """transformers' own block-FP8 layout (DeepSeek-V3, Qwen3 -FP8: `quant_method: fp8`,
    `weight_block_size`, scales named `weight_scale_inv`, lm_head left out) is the FP8_BLOCK
    scheme: our Linears hold the weights transformers itself dequantizes from it (partial tiles
    included: k/v have 64 rows of a 128-row tile), and the model answers as its compressed-tensors
    twin made of the same tensors."""
    from transformers import AutoModelForCausalLM

    twin = tmp_path / "ct"
    write_llmc_checkpoint(source_dir, twin, "fp8-block", kv=False)
    ckpt = tmp_path / "hf-fp8"
    shutil.copytree(twin, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    save_file({name + "_inv" if name.endswith(".weight_scale") else name: t for name, t in tensors.items()},
              str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    (ckpt / "config.json").write_text(json.dumps(config))

    llm = LLM(str(ckpt), kv_cache_dtype="float32")
    assert torch.equal(llm.score_full_logprobs(TOKENS), LLM(str(twin), kv_cache_dtype="float32").score_full_logprobs(TOKENS))
    theirs = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)  # dequantized on a CPU
    for i, (ours, layer) in enumerate(zip(llm.engine.model.model.layers, theirs.model.layers, strict=True)):
        qkv = torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight])
        assert torch.equal(ours.self_attn.qkv_proj.dequantized_weight(), qkv.detach()), f"layer {i} q/k/v"
        assert torch.equal(ours.mlp.down_proj.dequantized_weight(), layer.mlp.down_proj.weight.detach()), f"layer {i}"
    from quant.config import QuantizationConfig

    read = QuantizationConfig.from_dict(config["quantization_config"] | {"modules_to_not_convert": ["mlp.up_proj"]})
    assert read.scheme_for("lm_head") is None and read.scheme_for("model.layers.1.mlp.up_proj") is None  # left out
    assert read.scheme_for("model.layers.1.mlp.down_proj").weights.block_structure == (128, 128)


def test_modules_to_not_convert_match_as_transformers_matches_them():
    """transformers' rule, its own function the oracle: a regex from the name's start to a module
    boundary, or a suffix ("mlp.gate" keeps the router, not gate_proj; "layers.1" not layers.11)."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    from quant.config import QuantizationConfig

    names = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.gate", "model.layers.11.self_attn.q_proj",
             "model.layers.1.self_attn.q_proj", "model.layers.12.mlp.up_proj", "model.decoder.layers.23.fc1", "lm_head"]
    for key in ["mlp.gate", "layers.1", "model.layers.1", "model.layers.*.mlp.gate", "fc1", "q_proj"]:
        config = QuantizationConfig.from_dict({"quant_method": "fp8", "weight_block_size": [128, 128],
                                               "modules_to_not_convert": [key]})
        for name in names:
            assert (config.scheme_for(name) is not None) == should_convert_module(name, [key, "lm_head"]), (key, name)


def test_block_fp8_configs_that_mean_something_else_are_refused():
    from quant.config import QuantizationConfig

    for bad, message in [
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "dynamic activations"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "e4m3"),
    ]:
        with pytest.raises(ValueError, match=message):
            QuantizationConfig.from_dict(bad)
    group = json.loads(json.dumps(FP8_BLOCK_GROUP))
    group["input_activations"]["group_size"] = 64  # narrower than the tiles
    with pytest.raises(ValueError, match="as wide as their tiles"):
        QuantizationConfig.from_dict(quantization_config(group, kv=False))
    group = json.loads(json.dumps(FP8_BLOCK_GROUP))
    group["weights"]["block_structure"] = "128x128"  # compressed-tensors' older spelling reads the same
    assert QuantizationConfig.from_dict(quantization_config(group, kv=False)).groups[0].scheme.weights.block_structure \
        == (128, 128)
    group["weights"].update(type="int", block_structure=[128, 128])
    with pytest.raises(ValueError, match="block quantization is FP8 weights"):
        QuantizationConfig.from_dict(quantization_config(group, kv=False))
