"""FP8 KV cache without calibrated scales: e4m3 only as the explicit `kv_scales="dynamic"` choice;
e5m2, whose range needs none, at unit scale."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.cli import main as driftgate_main
from engine.config import EngineConfig

PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 31, 8, 77, 150, 19]


@pytest.mark.parametrize("kwargs,match", [({"kv_scales": "calibrated"}, "kv_scales must be one of"),
                                          ({"kv_scales": "dynamic"}, "only applies to an fp8 e4m3 KV cache"),
                                          ({"kv_scales": "dynamic", "kv_cache_dtype": "fp8_e5m2"}, "takes no scales"),
                                          ({"kv_cache_dtype": "fp8_e3m4"}, "kv_cache_dtype must be one of")])
def test_bad_kv_scales_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", **kwargs)


def test_missing_scales_error_names_the_dynamic_choice(tiny_model_dir):
    with pytest.raises(ValueError, match="--kv-scales dynamic"):
        LLM(str(tiny_model_dir), kv_cache_dtype="fp8")


def test_dynamic_scales_come_from_the_first_batch(tiny_model_dir, tmp_path):
    llm = LLM(str(tiny_model_dir), kv_cache_dtype="fp8", kv_scales="dynamic")
    attns = [layer.self_attn.attn for layer in llm.engine.model.model.layers]
    first_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(module, args) -> None:  # (q, k, v, ctx) of each layer's first call
        first_kv.setdefault(module.layer_idx, (args[1], args[2]))

    hooks = [a.register_forward_pre_hook(record) for a in attns]
    ours = llm.score_full_logprobs(PROMPT)
    for h in hooks:
        h.remove()
    for attn in attns:
        k, v = first_kv[attn.layer_idx]
        torch.testing.assert_close(attn.k_scale, k.abs().amax().float() * 2 / 448)  # 2× headroom
        torch.testing.assert_close(attn.v_scale, v.abs().amax().float() * 2 / 448)
    before = [(a.k_scale.clone(), a.v_scale.clone()) for a in attns]
    llm.generate([[p + 1 for p in PROMPT]], SamplingParams(max_tokens=2), use_tqdm=False)  # later batches keep them
    assert all(torch.equal(a.k_scale, k) and torch.equal(a.v_scale, v) for a, (k, v) in zip(attns, before, strict=True))
    # the same scales written into the checkpoint give the same model: dynamic differs only in where scales come from
    calibrated = tmp_path / "calibrated"
    shutil.copytree(tiny_model_dir, calibrated)
    tensors = load_file(str(calibrated / "model.safetensors"))
    for i, (k, v) in enumerate(before):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = k.reshape(1)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = v.reshape(1)
    save_file(tensors, str(calibrated / "model.safetensors"))
    assert torch.equal(LLM(str(calibrated), kv_cache_dtype="fp8").score_full_logprobs(PROMPT), ours)
    # and stays near the unquantized cache (0.13 measured on this random model's peaked distributions)
    reference = LLM(str(tiny_model_dir)).score_full_logprobs(PROMPT)
    assert (ours - reference).abs().max().item() < 0.5


@pytest.mark.parametrize("backend", ["torch", "c"])
def test_e5m2_cache_is_unscaled_and_ignores_calibrated_scales(tiny_model_dir, tmp_path, backend):
    """vLLM's fp8_e5m2: K and V rounded to e5m2 as they are, with no calibration, on the torch
    path and the C kernels alike; a checkpoint's (e4m3) scales change nothing."""
    llm = LLM(str(tiny_model_dir), kv_cache_dtype="fp8_e5m2", attention_backend=backend)
    assert llm.engine.kv_cache.dtype == torch.float8_e5m2
    ours = llm.score_full_logprobs(PROMPT)
    reference = LLM(str(tiny_model_dir), attention_backend=backend).score_full_logprobs(PROMPT)
    assert 0 < (ours - reference).abs().max().item() < 0.5  # rounded, and near the unquantized cache
    # the same K and V rounded by hand: each layer's attention sees exactly e5m2's values
    rounded = LLM(str(tiny_model_dir), attention_backend=backend)
    for layer in rounded.engine.model.model.layers:
        layer.self_attn.attn.register_forward_pre_hook(
            lambda _, args: (args[0], args[1].to(torch.float8_e5m2).float(), args[2].to(torch.float8_e5m2).float(),
                             args[3]))
    torch.testing.assert_close(rounded.score_full_logprobs(PROMPT), ours, atol=1e-5, rtol=1e-5)
    scaled = tmp_path / "scaled"
    shutil.copytree(tiny_model_dir, scaled)
    tensors = load_file(str(scaled / "model.safetensors"))
    for i in range(len(llm.engine.model.model.layers)):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([0.01])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.01])
    save_file(tensors, str(scaled / "model.safetensors"))
    again = LLM(str(scaled), kv_cache_dtype="fp8_e5m2", attention_backend=backend).score_full_logprobs(PROMPT)
    assert torch.equal(again, ours)


def test_generate_cli_says_when_scales_are_dynamic(tiny_model_dir, capsys):
    assert driftgate_main(["generate", str(tiny_model_dir), "The quick", "--max-tokens", "3",
                           "--kv-cache-dtype", "fp8", "--kv-scales", "dynamic"]) == 0
    assert "dynamic scales" in capsys.readouterr().err
    assert driftgate_main(["generate", str(tiny_model_dir), "The quick", "--device", "tpu"]) == 2
    assert "device must be cpu, cuda, cuda:N or auto, got 'tpu'" in capsys.readouterr().err


def test_serve_passes_dynamic_scales_to_the_engine(tiny_model_dir):
    import argparse

    from server.cli import add_serve_args, build_engine

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args([str(tiny_model_dir), "--kv-cache-dtype", "fp8", "--kv-scales", "dynamic"])
    engine = build_engine(args)
    assert engine.config.kv_scales == "dynamic"
    assert all(layer.self_attn.attn.scales_pending for layer in engine.engine.model.model.layers)


def test_auto_takes_the_fp8_cache_a_checkpoint_declares(tiny_model_dir, tmp_path):
    """As vLLM resolves `auto`: a checkpoint whose quantization_config declares a kv_cache_scheme
    serves (and is gated, and binds its verdict) with its calibrated fp8 cache unless a dtype is
    named; a folder declaring none keeps the model's dtype."""
    from engine.config import serving_setting
    from quant.checkpoint import write_checkpoint
    from quant.config import QuantizationConfig
    from quant.schemes import FP8_KV
    from tests.helpers import quantized_tensors

    tensors = quantized_tensors(tiny_model_dir, None, kv=True)
    declared = write_checkpoint(tmp_path / "kv-fp8", source_dir=tiny_model_dir, tensors=tensors,
                                quant_config=QuantizationConfig(kv_cache_scheme=FP8_KV))
    llm = LLM(str(declared))
    assert (llm.engine.config.kv_cache_dtype, llm.engine.kv_cache.dtype) == ("fp8", torch.float8_e4m3fn)
    assert torch.equal(llm.score_full_logprobs(PROMPT),
                       LLM(str(declared), kv_cache_dtype="fp8").score_full_logprobs(PROMPT))
    for named, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):  # a named dtype wins
        assert LLM(str(declared), kv_cache_dtype=named).engine.kv_cache.dtype == dtype
    with pytest.raises(ValueError, match="kv_cache_dtype=float32 needs float32 activations"):
        LLM(str(declared), dtype="bfloat16", kv_cache_dtype="float32")
    assert LLM(str(tiny_model_dir)).engine.kv_cache.dtype == torch.float32
    assert serving_setting(str(declared), "auto", "cpu", "auto", "checkpoint") == \
        {"dtype": "float32", "kv_cache_dtype": "fp8", "kv_scales": "checkpoint"}
    assert serving_setting(str(tiny_model_dir), "auto", "cpu", "auto", "checkpoint")["kv_cache_dtype"] == "auto"
