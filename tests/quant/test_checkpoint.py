"""Checkpoint writer and reader, checked against compressed-tensors' own decompressor."""

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
from compressed_tensors.quantization import QuantizationConfig as CTQuantizationConfig
from safetensors.torch import load_file, save_file

from quant.checkpoint import (
    WEIGHTS_NAME,
    is_kv_cache_tensor,
    kv_scale_names,
    load_kv_scales,
    publish_folder,
    quantize_weight,
    read_quantization_config,
    write_checkpoint,
)
from quant.config import QuantizationConfig
from quant.linear import make_quantized_linear
from quant.schemes import QuantArgs, QuantScheme, preset
from tests.helpers import LINEARS, quantized_tensors

NUM_LAYERS, NUM_KV_HEADS = 2, 2
W4A16_ASYM = QuantScheme(QuantArgs(num_bits=4, strategy="group", group_size=32, symmetric=False), None,
                         "pack-quantized")


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    """A tiny HF folder: config, tokenizer files, generation config, fp32 weights (hidden 64)."""
    from tests.helpers import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("src") / "model", num_layers=NUM_LAYERS,
                               num_kv_heads=NUM_KV_HEADS)


def our_dequantized(out: Path, scheme: QuantScheme, prefix: str) -> torch.Tensor:
    tensors = load_file(str(out / WEIGHTS_NAME))
    shard = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    w = shard["weight_shape"].tolist() if "weight_shape" in shard else list(shard["weight"].shape)
    module = make_quantized_linear(scheme, w[1], [w[0]], bias=False, dtype=torch.float32)
    module.load_shard(0, shard)
    module.finalize()
    return module.dequantized_weight()


@pytest.mark.parametrize("name,scheme", [
    ("fp8-dynamic", preset("fp8-dynamic")),
    ("fp8-static", preset("fp8-static")),
    ("fp8-block", preset("fp8-block")),  # 128x128 tiles over Linears of 64-256 rows and columns: partial ones
    ("w4a16-g64", preset("w4a16", group_size=64)),
    ("w4a16-asym", W4A16_ASYM),
    ("w8a16", preset("w8a16")),
    ("w8a8-int8", preset("w8a8-int8")),
    ("w4a8-g32", preset("w4a8", group_size=32)),
])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_compressed_tensors_decompresses_to_our_weights(tmp_path, source_dir, name, scheme, scale_dtype):
    config = QuantizationConfig.for_scheme(scheme, kv_cache=True)
    out = write_checkpoint(tmp_path / "out", source_dir=source_dir, quant_config=config,
                           tensors=quantized_tensors(source_dir, scheme, scale_dtype))
    # CT's model-free path matches "Linear" by tensor name, so name the non-Linear weights for it.
    not_linear = ["re:.*embed_tokens$", "re:.*norm$"]
    dequantizer = CompressedTensorsDequantizer(out, ignore=not_linear, dtype=torch.float32)
    ct = dequantizer.process(load_file(str(out / WEIGHTS_NAME)))
    source = load_file(str(source_dir / WEIGHTS_NAME))
    for i in range(NUM_LAYERS):
        for linear in LINEARS:
            prefix = f"model.layers.{i}.{linear}"
            ours = our_dequantized(out, scheme, prefix)
            # CT multiplies in the scale dtype; ours always in fp32.
            tol = {} if scale_dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-6}
            torch.testing.assert_close(ct[f"{prefix}.weight"], ours, **({"rtol": 0, "atol": 0} | tol))
            err = (ours - source[f"{prefix}.weight"]).norm() / source[f"{prefix}.weight"].norm()
            assert err < (0.12 if scheme.weights.num_bits == 4 else 0.03)
    # every weight qparam was consumed by CT's decompressor (input_scale is an activation qparam)
    assert not [k for k in ct if k.endswith(("weight_scale", "weight_packed", "weight_shape", "weight_zero_point"))]


def test_writer_output_folder(tmp_path, source_dir):
    config = QuantizationConfig.for_scheme(preset("w4a16", group_size=64), kv_cache=True)
    tensors = quantized_tensors(source_dir, preset("w4a16", group_size=64))
    out = write_checkpoint(tmp_path / "ck", source_dir=source_dir, tensors=tensors, quant_config=config,
                           extra_files={"calibration.json": {"samples": 3}})
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "calibration.json"} <= files
    written = json.loads((out / "config.json").read_text())
    source = json.loads((source_dir / "config.json").read_text())
    assert {k: v for k, v in written.items() if k != "quantization_config"} == source
    assert written["quantization_config"] == config.to_dict()
    CTQuantizationConfig.model_validate(written["quantization_config"])
    assert read_quantization_config(out) == config
    assert read_quantization_config(source_dir) is None
    assert json.loads((out / "calibration.json").read_text()) == {"samples": 3}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left behind

    with pytest.raises(FileExistsError):
        write_checkpoint(out, source_dir=source_dir, tensors=tensors, quant_config=config)
    kv_only = QuantizationConfig.for_scheme(None, kv_cache=True)
    write_checkpoint(out, source_dir=source_dir, tensors=quantized_tensors(source_dir, None), quant_config=kv_only,
                     overwrite=True)
    assert read_quantization_config(out) == kv_only
    assert "calibration.json" not in {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_failed_write_leaves_nothing(tmp_path, source_dir):
    config = QuantizationConfig.for_scheme(None, kv_cache=True)
    with pytest.raises(ValueError, match="plain new file name"):
        write_checkpoint(tmp_path / "ck", source_dir=source_dir, tensors={"x": torch.zeros(1)}, quant_config=config,
                         extra_files={"../escape.json": {}})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask,folder_mode,file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_checkpoint_modes_follow_the_umask(tmp_path, source_dir, umask, folder_mode, file_mode):
    """Not mkdtemp's 0700 and safetensors' 0600, which keep a server running as another user out."""
    config = QuantizationConfig.for_scheme(None, kv_cache=True)
    old = os.umask(umask)
    try:
        out = write_checkpoint(tmp_path / "ck", source_dir=source_dir, tensors=quantized_tensors(source_dir, None),
                               quant_config=config)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == folder_mode
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {p.name: file_mode for p in out.iterdir()}


def test_a_failed_publish_keeps_the_old_folder(tmp_path, monkeypatch):
    out, new = tmp_path / "ck", tmp_path / ".ck.tmp"
    out.mkdir()
    (out / "old.txt").write_text("old")
    new.mkdir()
    (new / "new.txt").write_text("new")
    replace = os.replace

    def failing_replace(src, dst):
        if Path(src) == new:
            raise OSError(28, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space"):
        publish_folder(new, out)
    monkeypatch.undo()
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ck.tmp", "ck"]  # the caller removes its tmp
    publish_folder(new, out)
    assert [p.name for p in out.iterdir()] == ["new.txt"] and [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_llmcompressor_layout_is_accepted(tmp_path):
    """A checkpoint as LLMC writes it: bf16 scales, [] KV scales with zero points, W4A16 group 128 + actorder."""
    k = 256
    scheme = QuantizationConfig.from_dict({
        "quant_method": "compressed-tensors", "format": "pack-quantized", "version": "0.12.2",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group",
            "actorder": "static", "observer": "minmax", "observer_kwargs": {}}}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                            "dynamic": False}}).scheme_for("model.layers.0.mlp.up_proj")
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (32, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(32, 2, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    from quant.int_quant import pack_int32

    tensors = {
        "model.layers.0.mlp.up_proj.weight_packed": pack_int32(q, 4),
        "model.layers.0.mlp.up_proj.weight_scale": scale,
        "model.layers.0.mlp.up_proj.weight_shape": torch.tensor([32, k]),
        "model.layers.0.self_attn.k_scale": torch.tensor(0.05, dtype=torch.bfloat16),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.03, dtype=torch.bfloat16),
        "model.layers.0.self_attn.k_zero_point": torch.tensor(0, dtype=torch.int8),
        "model.layers.0.self_attn.v_zero_point": torch.tensor(0, dtype=torch.int8),
    }
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    loaded = load_file(str(tmp_path / WEIGHTS_NAME))
    module = make_quantized_linear(scheme, k, [32], bias=False, dtype=torch.bfloat16)
    module.load_shard(0, {n.rsplit(".", 1)[1]: t for n, t in loaded.items() if ".up_proj." in n})
    module.finalize()
    expected = q.float() * scale.float().repeat_interleave(128, 1)
    torch.testing.assert_close(module.dequantized_weight(), expected)
    x = torch.randn(3, k, dtype=torch.bfloat16)
    assert ((module(x).float() - module.reference_forward(x).float()).norm() / module.reference_forward(x).float().norm()) < 2e-2
    assert all(is_kv_cache_tensor(n) for n in loaded if "self_attn" in n)
    (scales,) = load_kv_scales(loaded, 1, NUM_KV_HEADS)
    torch.testing.assert_close(scales.k, torch.full((NUM_KV_HEADS, 1), 0.05, dtype=torch.bfloat16).float())


def test_legacy_and_modelopt_kv_names():
    assert kv_scale_names(3)["k"][0] == "model.layers.3.self_attn.k_scale"
    legacy = {"model.layers.0.self_attn.k_proj.output_scale": torch.tensor([0.5]),
              "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([0.25])}
    (s,) = load_kv_scales(legacy, 1, 2)
    assert s.k.tolist() == [[0.5], [0.5]] and s.v.tolist() == [[0.25], [0.25]]
    (single,) = load_kv_scales({"model.layers.0.self_attn.kv_scale": torch.tensor(2.0)}, 1, 2)
    assert single.k.tolist() == single.v.tolist() == [[2.0], [2.0]]
    per_head = {"model.layers.0.self_attn.k_scale": torch.tensor([[[1.0]], [[2.0]]]),
                "model.layers.0.self_attn.v_scale": torch.tensor([[[3.0]], [[4.0]]])}
    (h,) = load_kv_scales(per_head, 1, 2)
    assert h.v.tolist() == [[3.0], [4.0]]
    assert is_kv_cache_tensor("model.layers.0.self_attn.q_scale")
    assert not is_kv_cache_tensor("model.layers.0.self_attn.k_proj.weight_scale")
    assert not is_kv_cache_tensor("model.layers.0.self_attn.k_proj.input_scale")


@pytest.mark.parametrize("value,match", [(0.0, "zero or negative"), (-0.1, "zero or negative"),
                                         (float("nan"), "non-finite")])
def test_bad_kv_scales_fail_with_the_tensor_name(value, match):
    tensors = {"model.layers.0.self_attn.k_scale": torch.tensor([0.1]),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.1]),
               "model.layers.1.self_attn.k_scale": torch.tensor([0.1]),
               "model.layers.1.self_attn.v_scale": torch.tensor([value])}
    with pytest.raises(ValueError, match=rf"model\.layers\.1\.self_attn\.v_scale: .*{match}"):
        load_kv_scales(tensors, 2, 2)


def test_missing_kv_scale_names_the_expected_tensor():
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_scale: missing"):
        load_kv_scales({"model.layers.0.self_attn.k_scale": torch.tensor([0.1]),
                        "model.layers.0.self_attn.v_scale": torch.tensor([0.1])}, 2, 2)


def test_quantize_weight_contract():
    w = torch.randn(16, 64)
    fp8 = quantize_weight(w, preset("fp8-static"), input_scale=0.5)
    assert fp8["weight"].dtype == torch.float8_e4m3fn and fp8["weight_scale"].shape == (1,)
    assert fp8["input_scale"].shape == (1,)
    with pytest.raises(ValueError, match="input_scale is required"):
        quantize_weight(w, preset("fp8-static"))
    with pytest.raises(ValueError, match="input_scale is not allowed"):
        quantize_weight(w, preset("fp8-dynamic"), input_scale=0.5)
    w4 = quantize_weight(w.bfloat16(), preset("w4a16", group_size=32))
    assert set(w4) == {"weight_packed", "weight_scale", "weight_shape"}
    assert w4["weight_packed"].shape == (16, 8) and w4["weight_scale"].dtype == torch.bfloat16
    assert w4["weight_scale"].shape == (16, 2) and w4["weight_shape"].tolist() == [16, 64]
    asym = quantize_weight(w, W4A16_ASYM)
    assert asym["weight_zero_point"].shape == (2, 2) and asym["weight_zero_point"].dtype == torch.int32
    int8 = quantize_weight(w, preset("w8a8-int8"))
    assert int8["weight"].dtype == torch.int8 and int8["weight_scale"].shape == (16, 1)
