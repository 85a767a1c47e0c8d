"""GPTQ and AWQ through the whole command: lower held-out layer error than RTN, checkpoints that reload."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from calibration.cli import main
from tests.calibration.factories import write_calib_file
from tests.helpers import make_tiny_model_dir


@pytest.fixture(scope="module")
def outlier_model_dir(tmp_path_factory):
    """A tiny Llama whose norms amplify a few channels ×10, the activation outliers AWQ exists for."""
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("outlier-llama"))
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith("layernorm.weight")]:
        weight = torch.ones_like(tensors[name])
        weight[torch.randperm(weight.numel(), generator=g)[:4]] = 10.0
        tensors[name] = weight
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def runs(outlier_model_dir, tmp_path_factory):
    """calibration.json of w4a16 with each algorithm, same data, seed and held-out samples."""
    root = tmp_path_factory.mktemp("algos")
    calib = write_calib_file(root / "calib.jsonl", 48)
    reports = {}
    for algo in ("rtn", "gptq", "awq"):
        out = root / algo
        assert main([str(outlier_model_dir), "--calib", str(calib), "-o", str(out), "--scheme", "w4a16",
                     "--algo", algo, "--num-samples", "32", "--num-heldout", "16"]) == 0
        reports[algo] = (out, json.loads((out / "calibration.json").read_text()))
    return reports


@pytest.mark.parametrize("algo", ["gptq", "awq"])
def test_layer_output_error_below_rtn_on_heldout_samples(runs, algo):
    rtn_errors = [layer["output_error"] for layer in runs["rtn"][1]["layers"]]
    errors = [layer["output_error"] for layer in runs[algo][1]["layers"]]
    assert runs[algo][1]["dataset"]["is_heldout_disjoint"]
    assert all(e < r for e, r in zip(errors, rtn_errors, strict=True)), (algo, errors, rtn_errors)


def test_awq_folds_scales_into_the_norms_it_writes(runs, outlier_model_dir):
    source = load_file(outlier_model_dir / "model.safetensors")
    awq = load_file(runs["awq"][0] / "model.safetensors")
    rtn = load_file(runs["rtn"][0] / "model.safetensors")
    name = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(awq[name], source[name])
    assert torch.equal(rtn[name], source[name])


@pytest.mark.parametrize("algo", ["gptq", "awq"])
def test_checkpoint_reloads_and_tracks_the_source_model(runs, outlier_model_dir, tiny_tokenizer, algo):
    from engine.loader import load_model

    text = "A scheduler stores keys in fixed-size blocks. What is the capital of France? Paris."
    ids = torch.tensor(tiny_tokenizer(text)["input_ids"])
    positions = torch.arange(ids.numel())
    logits = {}
    for key, folder in (("source", outlier_model_dir), ("rtn", runs["rtn"][0]), (algo, runs[algo][0])):
        model, _ = load_model(folder, dtype=torch.float32)
        with torch.no_grad():
            logits[key] = model.compute_logits(model(ids, positions))

    def error(key):
        return float((logits[key] - logits["source"]).norm() / logits["source"].norm())

    # on text like the calibration set's, but not in it, the served checkpoint beats RTN too
    assert error(algo) < error("rtn")


@pytest.fixture(scope="module")
def w8a8_runs(outlier_model_dir, tmp_path_factory):
    """calibration.json of w8a8-int8 plain, with SmoothQuant, and with SmoothQuant then GPTQ."""
    root = tmp_path_factory.mktemp("smoothquant")
    calib = write_calib_file(root / "calib.jsonl", 48)
    reports = {}
    for name, extra in (("plain", []), ("sq", ["--smoothquant", "0.5"]), ("sq-gptq", ["--smoothquant", "0.5",
                                                                                      "--algo", "gptq"])):
        out = root / name
        assert main([str(outlier_model_dir), "--calib", str(calib), "-o", str(out), "--scheme", "w8a8-int8",
                     "--num-samples", "32", "--num-heldout", "16", *extra]) == 0
        reports[name] = (out, json.loads((out / "calibration.json").read_text()))
    return reports


@pytest.mark.parametrize("name", ["sq", "sq-gptq"])
def test_smoothquant_lowers_w8a8_error_where_activations_have_outliers(w8a8_runs, outlier_model_dir, name):
    """Per-token int8 activations lose the small channels next to a ×10 outlier; smoothing moves it into the weights."""
    plain = [layer["output_error"] for layer in w8a8_runs["plain"][1]["layers"]]
    errors = [layer["output_error"] for layer in w8a8_runs[name][1]["layers"]]
    assert all(e < p for e, p in zip(errors, plain, strict=True)), (name, errors, plain)
    assert w8a8_runs[name][1]["smoothquant_alpha"] == 0.5 and w8a8_runs["plain"][1]["smoothquant_alpha"] is None
    norm = "model.layers.0.input_layernorm.weight"
    smoothed = load_file(w8a8_runs[name][0] / "model.safetensors")[norm]
    assert not torch.equal(smoothed, load_file(outlier_model_dir / "model.safetensors")[norm])


def test_smoothquant_is_refused_for_weight_only_schemes(outlier_model_dir, tmp_path, capsys):
    calib = write_calib_file(tmp_path / "calib.jsonl", 8)
    assert main([str(outlier_model_dir), "--calib", str(calib), "-o", str(tmp_path / "out"), "--scheme", "w4a16",
                 "--smoothquant", "0.5"]) == 2
    assert "--smoothquant applies to w8a8-int8" in capsys.readouterr().err


_MOE = {"num_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("architecture, options", [
    ("LlamaForCausalLM", {}),  # grouped-query: norm → q/k/v, norm → gate/up, up → down
    ("Qwen2ForCausalLM", {"num_kv_heads": 4}),  # a KV head per query head: v → o as well (v rows with a bias)
    ("Gemma2ForCausalLM", {"num_kv_heads": 4}),  # sandwich norms: the MLP's input norm is pre_feedforward
    ("Olmo2ForCausalLM", {"num_kv_heads": 4}),  # output-only norms: nothing before q/k/v or the MLP
    ("Qwen2MoeForCausalLM", {"extra_config": {**_MOE, "moe_intermediate_size": 32,
                                              "shared_expert_intermediate_size": 32}}),  # each expert's up → down
    # q/k/v clamped to ±clip_qkv (half of them, at this init): v → o would change what the clamp cuts
    ("OlmoeForCausalLM", {"num_kv_heads": 4, "extra_config": {**_MOE, "clip_qkv": 0.5}}),
])
def test_every_smoothing_fold_leaves_the_model_computing_the_same(tmp_path, architecture, options):
    """SmoothQuant and AWQ fold scales into pairs of modules; each pair the quantizer lists must
    compute what it did for any positive scales (found on an OLMoE with clip_qkv, whose v → o
    fold moved the clamp: KL 0.12 against 0.003 without smoothing)."""
    from calibration.quantizers import _smooth_mappings, fold_mapping
    from engine.loader import load_model

    model, _ = load_model(make_tiny_model_dir(tmp_path, architecture=architecture, **options), dtype=torch.float32)
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        before = model(ids, torch.arange(12))
        for layer in model.model.layers:
            for mapping in _smooth_mappings(layer):
                width = layer.get_submodule(mapping.balance).weight.shape[1]
                fold_mapping(layer, mapping, torch.rand(width, generator=g) * 3.75 + 0.25)
        after = model(ids, torch.arange(12))
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
