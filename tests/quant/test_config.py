"""quantization_config parsing, emission and per-layer scheme lookup."""

import pytest
from compressed_tensors.quantization import QuantizationConfig as CTQuantizationConfig

from quant.config import ConfigGroup, QuantizationConfig
from quant.schemes import PRESETS, QuantArgs, preset

ALLOWED_ARGS_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                     "actorder", "observer", "observer_kwargs"}
ALLOWED_SCHEME_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}


def configs():
    yield "kv-only", QuantizationConfig.for_scheme(None, kv_cache=True)
    for name in PRESETS:
        yield name, QuantizationConfig.for_scheme(preset(name, group_size=64), kv_cache=name == "fp8-static")


@pytest.mark.parametrize("name,config", list(configs()), ids=[n for n, _ in configs()])
def test_emitted_config_parses_in_compressed_tensors_and_round_trips(name, config):
    d = config.to_dict()
    assert d["quant_method"] == "compressed-tensors" and d["quantization_status"] == "compressed"
    for group in d["config_groups"].values():
        assert set(group) <= ALLOWED_SCHEME_KEYS
        for args in (group["weights"], group["input_activations"]):
            assert args is None or set(args) <= ALLOWED_ARGS_KEYS
    ct = CTQuantizationConfig.model_validate(d)
    assert set(ct.config_groups) == set(d["config_groups"])
    assert QuantizationConfig.from_dict(d) == config
    if name == "kv-only":
        assert d["format"] == "dense" and d["config_groups"] == {}


def test_preset_contents_match_the_spec():
    d = QuantizationConfig.for_scheme(preset("fp8-dynamic")).to_dict()
    assert d["format"] == "float-quantized" and d["ignore"] == ["lm_head"]
    g = d["config_groups"]["group_0"]
    assert g["targets"] == ["Linear"]
    assert (g["weights"]["strategy"], g["input_activations"]["strategy"], g["input_activations"]["dynamic"]) == (
        "channel", "token", True)
    w4 = QuantizationConfig.for_scheme(preset("w4a16")).to_dict()
    assert w4["format"] == "pack-quantized"
    assert w4["config_groups"]["group_0"]["weights"]["group_size"] == 128
    assert w4["config_groups"]["group_0"]["input_activations"] is None
    static = preset("fp8-static").input_activations
    assert static.observer == "static_minmax" and not static.dynamic


def test_scheme_for_follows_vllm_matching_order():
    w4, fp8 = preset("w4a16"), preset("fp8-dynamic")
    config = QuantizationConfig(
        groups=(ConfigGroup("a", ("Linear",), w4), ConfigGroup("b", ("re:.*mlp\\.down_proj$",), fp8)),
        ignore=("lm_head", "re:.*layers\\.1\\..*"),
    )
    assert config.scheme_for("model.layers.0.self_attn.q_proj") == w4
    assert config.scheme_for("model.layers.0.mlp.down_proj") == fp8  # a name match beats the class match
    assert config.scheme_for("model.layers.1.mlp.down_proj") is None  # ignored by regex
    assert config.scheme_for("lm_head") is None
    assert QuantizationConfig(groups=(ConfigGroup("x", ("model.layers.0.mlp.up_proj",), fp8),)).scheme_for(
        "model.layers.0.mlp.gate_proj") is None


def test_mixed_formats_emit_per_group_format():
    config = QuantizationConfig(groups=(ConfigGroup("a", ("re:.*mlp.*",), preset("w4a16")),
                                        ConfigGroup("b", ("re:.*self_attn.*",), preset("fp8-dynamic"))))
    d = config.to_dict()
    assert d["format"] == "mixed-precision"
    assert d["config_groups"]["a"]["format"] == "pack-quantized"
    CTQuantizationConfig.model_validate(d)
    assert QuantizationConfig.from_dict(d) == config


def test_llmcompressor_style_config_is_accepted():
    d = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "version": "0.12.2",
        "quantization_status": "compressed", "global_compression_ratio": None, "sparsity_config": {},
        "transform_config": {}, "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None, "input_activations": None, "format": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group",
                        "block_structure": None, "dynamic": False, "actorder": "static", "observer": "minmax",
                        "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None}}},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "attn_head",
                            "dynamic": False, "group_size": None, "observer": "static_minmax"},
    }
    config = QuantizationConfig.from_dict(d)
    scheme = config.scheme_for("model.layers.0.mlp.up_proj")
    assert scheme.weights.actorder == "weight" and scheme.format == "pack-quantized"
    assert config.kv_cache_scheme.strategy == "attn_head"
    preset_group = QuantizationConfig.from_dict({"quant_method": "compressed-tensors", "format": "float-quantized",
                                                  "config_groups": {"FP8_DYNAMIC": ["Linear"]}})
    assert preset_group.scheme_for("x") == preset("fp8-dynamic")


@pytest.mark.parametrize("patch,match", [
    ({"format": "nvfp4-pack-quantized"}, r"nvfp4-pack-quantized \(NVFP4\) or mxfp4"),  # int weights
    ({"format": "mxfp4-pack-quantized"}, r"mxfp4-pack-quantized \(MXFP4\), and only they are"),
    ({"format": "marlin-24"}, "'marlin-24'"),
    ({"quant_method": "gptq"}, "'gptq'"),
    ({"transform_config": {"hadamard": {}}}, "transform"),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "scale_dtype": None, "foo": 1}}}},
     r"config_groups\.g\.weights.*\['foo'\]"),
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                 "strategy": "block", "block_structure": [128, 128]}}}},
     "block quantization is FP8 weights"),  # FP8 tiles load (tests/quant/test_llmc_checkpoint.py); int ones do not
    ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group"}}}},
     "positive group_size"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "int"}}, "kv_cache_scheme"),
])
def test_unsupported_configs_are_rejected_by_name(patch, match):
    d = {**QuantizationConfig.for_scheme(preset("w4a16")).to_dict(), **patch}
    with pytest.raises(ValueError, match=match):
        QuantizationConfig.from_dict(d)


def test_args_validation():
    with pytest.raises(ValueError, match="token strategy must be dynamic"):
        QuantArgs(type="float", strategy="token")
    with pytest.raises(ValueError, match="only valid with a group strategy"):
        QuantArgs(strategy="channel", group_size=128)
    with pytest.raises(ValueError, match="unknown scheme preset"):
        preset("w2a16")
    assert QuantArgs.from_dict({"group_size": -1}, what="w").strategy == "channel"
    assert QuantArgs.from_dict({"group_size": 32}, what="w").strategy == "group"
