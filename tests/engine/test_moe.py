"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): which layers route, how calibration sees
the experts, and quantized checkpoints that HF transformers loads and answers as this engine does.
(Unquantized, every architecture's tokens and logits are held to HF's in test_architectures.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from engine.models.llama import LlamaArgs
from tests.helpers import ON_CUDA, make_tiny_model_dir
from tests.oracle import assert_quantized_answers_as_hf

_MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2}
_QWEN_EXPERTS = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
_CONFIGS = {"MixtralForCausalLM": _MIXTRAL, "Qwen3MoeForCausalLM": {**_QWEN_EXPERTS, "norm_topk_prob": True},
            "Qwen2MoeForCausalLM": {**_QWEN_EXPERTS, "shared_expert_intermediate_size": 96},
            "OlmoeForCausalLM": {"num_experts": 6, "num_experts_per_tok": 2, "clip_qkv": 0.5}}


def _tiny_moe(folder, architecture):
    return make_tiny_model_dir(folder, architecture=architecture, extra_config=_CONFIGS[architecture])


def test_which_layers_route_to_experts():
    """Qwen: every decoder_sparse_step-th layer not in mlp_only_layers; Mixtral: all of them."""
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 6, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 4}
    args = LlamaArgs.from_hf_config({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert args.moe_layers == (False, True, False, False, False, True)
    assert not args.renormalize_experts and args.shared_expert_intermediate_size == 0
    mixtral = LlamaArgs.from_hf_config({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4})
    assert mixtral.moe_layers == (True,) * 6 and mixtral.expert_intermediate_size == 16
    assert mixtral.renormalize_experts
    assert not LlamaArgs.from_hf_config({**base, "architectures": ["Qwen3ForCausalLM"]}).is_moe


def test_calibration_runs_every_expert_on_every_token(tmp_path):
    """While observed, each expert sees all tokens (so none is calibrated on a handful, or on
    none); the block's output is the routed one either way, and routing is back afterwards."""
    from calibration.observers import AbsMaxObserver
    from calibration.pipeline import LinearStats, _observing
    from engine.loader import load_model

    model, _ = load_model(_tiny_moe(tmp_path, "Qwen3MoeForCausalLM"), "float32")
    layer, x = model.model.layers[0], torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    rows: dict[int, int] = {}
    for e, expert in enumerate(layer.mlp.experts):
        expert.gate_up_proj.register_forward_pre_hook(lambda _m, a, e=e: rows.__setitem__(e, rows.get(e, 0) + len(a[0])))
    routed = layer.mlp(x)
    assert sum(rows.values()) == 10 * 2  # each token through its 2 experts
    rows.clear()
    stats = {"mlp.experts.0.gate_up_proj": LinearStats(input_absmax=AbsMaxObserver())}
    with _observing(layer, stats, None):
        observed = layer.mlp(x)
    assert rows == dict.fromkeys(range(6), 10)
    torch.testing.assert_close(observed, routed)
    rows.clear()
    layer.mlp(x)
    assert sum(rows.values()) == 20


@pytest.mark.parametrize("architecture, options", [
    ("MixtralForCausalLM", "w4a16 --algo gptq"), ("Qwen2MoeForCausalLM", "w8a16 --algo awq"),
    ("Qwen3MoeForCausalLM", "fp8-dynamic"), ("Qwen2MoeForCausalLM", "fp8-static"), ("OlmoeForCausalLM", "w8a16")])
def test_quantized_moe_answers_as_hf_on_it(tmp_path, architecture, options):
    """Every expert is quantized under its own checkpoint names (static input scales observed on
    every token), the routers are left dense and listed as ignored; HF transformers with
    compressed-tensors loads the checkpoint and greedily answers as this engine does."""
    from calibration.cli import main
    from tests.calibration.factories import write_calib_file

    source = _tiny_moe(tmp_path / "moe", architecture)
    out = tmp_path / "quantized"
    assert main([str(source), "--calib", str(write_calib_file(tmp_path / "calib.jsonl", 12)), "-o", str(out),
                 "--scheme", *options.split(), "--num-samples", "8", "--num-heldout", "4"]) == 0
    moe = "block_sparse_moe" if architecture == "MixtralForCausalLM" else "mlp"
    experts = _MIXTRAL["num_local_experts"] if architecture == "MixtralForCausalLM" else 6
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for e in range(experts):
            for linear in (("w1", "w2", "w3") if moe == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")):
                prefix = f"model.layers.1.{moe}.experts.{e}.{linear}"
                assert f"{prefix}.weight_scale" in names
                if options == "fp8-static":
                    assert float(f.get_tensor(f"{prefix}.input_scale")) > 0
    routers = [f"model.layers.{i}.{moe}.gate" for i in range(2)]
    assert {f"{r}.weight" for r in routers} <= names
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert set(routers) <= set(ignore)
    if architecture == "Qwen2MoeForCausalLM":
        assert "model.layers.0.mlp.shared_expert_gate" in ignore
        assert "model.layers.0.mlp.shared_expert.down_proj.weight_scale" in names

    assert_quantized_answers_as_hf(source, out, weights_only="a16" in options, max_drift=0.25)


@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "Qwen2MoeForCausalLM"])
@pytest.mark.parametrize("config", [ON_CUDA])
def test_moe_on_a_gpu_answers_as_hf(tmp_path, architecture, config):
    """The experts' gathers and index_add on CUDA (eager: a MoE step takes no graph), against HF on CPU."""
    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams
    from tests.oracle import assert_outputs_match_hf, hf_greedy

    source = _tiny_moe(tmp_path / "moe", architecture)
    prompts = [[5 + (i * 7 + j) % 300 for j in range(n)] for i, n in enumerate((3, 18, 40))]
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    reference = {i: hf_greedy(hf, p, 12) for i, p in enumerate(prompts)}
    llm = LLM(str(source), dtype="float32", **config)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    assert_outputs_match_hf(outs, reference, f"{architecture} on cuda")
    assert llm.engine.runner.graphs is None
