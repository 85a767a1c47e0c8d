"""Every architecture the engine serves gives HF transformers' greedy tokens and logprobs."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.helpers import make_tiny_model_dir
from tests.oracle import assert_outputs_match_hf, assert_quantized_answers_as_hf, hf_greedy

_PHI3 = {"pad_token_id": 0}
_LONGROPE = {**_PHI3, "original_max_position_embeddings": 64, "rope_parameters": {
    "rope_type": "longrope", "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8], "long_factor": [1.0, 1.5, 2.4, 3.9, 6.0, 9.0, 13.0, 18.0]}}
# local (window 8, base 10k) and global (base 1M) layers, a query scale not head_dim's
_GEMMA3 = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 24,
           "pad_token_id": 0}
_GEMMA2 = {**_GEMMA3, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}
_EXPERTS = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
# case → (architecture, make_tiny_model_dir arguments, prompt lengths, LLM arguments)
CASES = {
    # sandwich norms scaling by (1 + w), GeGLU, scaled embeddings, per-head q/k norms
    "gemma3": ("Gemma3ForCausalLM", {"head_dim": 16, "extra_config": _GEMMA3}, (3, 18, 40), {}),
    # Gemma 2: the same block without q/k norms, attention scores and logits capped (small caps that bite)
    "gemma2": ("Gemma2ForCausalLM", {"head_dim": 16, "extra_config": _GEMMA2}, (3, 18, 40), {}),
    "qwen2": ("Qwen2ForCausalLM", {}, (3, 18, 40), {}),  # q/k/v biases
    "llama-attention-bias": ("LlamaForCausalLM", {"extra_config": {"attention_bias": True}}, (3, 18), {}),  # o too
    "mistral": ("MistralForCausalLM", {}, (3, 18, 40), {}),
    # per-head query/key RMSNorm, and a head_dim that is not hidden_size / heads (64 / 4)
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}, (3, 18, 40), {}),
    # q/k/v and gate/up fused in the checkpoint itself
    "phi3": ("Phi3ForCausalLM", {"extra_config": _PHI3}, (3, 18, 40), {}),
    # Phi-4-mini: only the leading 3/4 of each head rotates
    "phi3-partial-rotary": ("Phi3ForCausalLM", {"extra_config": {**_PHI3, "partial_rotary_factor": 0.75}},
                            (3, 18, 40), {}),
    # LongRoPE, served within the pretraining context (64): the short factors, as HF uses them there
    "phi3-longrope-short": ("Phi3ForCausalLM", {"extra_config": _LONGROPE}, (3, 18, 40), {"max_model_len": 64}),
    # ... and past it: the long factors, as HF uses them for sequences past 64 tokens
    "phi3-longrope-long": ("Phi3ForCausalLM", {"extra_config": _LONGROPE}, (65, 90), {}),
    # mixtures of experts: 2 of 6 (Mixtral: of 4) experts per token, picked by a router
    "mixtral": ("MixtralForCausalLM", {"extra_config": {"num_local_experts": 4, "num_experts_per_tok": 2}},
                (3, 18, 40), {}),
    # Qwen3-MoE: q/k norms, renormalized expert weights, a dense MLP in the second layer
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"head_dim": 32, "extra_config": {
        **_EXPERTS, "norm_topk_prob": True, "mlp_only_layers": [1]}}, (3, 18, 40), {}),
    # OLMoE: q and k normed over all heads at once, q/k/v clamped (a clamp that bites), 2 of 6 experts
    "olmoe": ("OlmoeForCausalLM", {"extra_config": {"num_experts": 6, "num_experts_per_tok": 2, "clip_qkv": 0.5}},
              (3, 18, 40), {}),
    # Granite: embeddings, attention scores, block outputs and logits each scaled by its own multiplier
    "granite": ("GraniteForCausalLM", {"extra_config": {"embedding_multiplier": 6.0, "attention_multiplier": 0.05,
                                                        "residual_multiplier": 0.3, "logits_scaling": 4.0}},
                (3, 18, 40), {}),
    # YaRN past a 32-token pretraining context (Qwen2.5 / Qwen3 long context): blended frequencies, scaled cos/sin
    "qwen3-yarn": ("Qwen3ForCausalLM", {"head_dim": 32, "extra_config": {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}}},
        (3, 18, 40), {}),
    # ... with DeepSeek's mscale terms and an untruncated ramp
    "llama-yarn-mscale": ("LlamaForCausalLM", {"extra_config": {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
        "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False, "beta_fast": 16}}}, (3, 18, 40), {}),
    # dynamic NTK within the pretraining context: the plain frequencies, as HF computes them there
    "llama-dynamic-ntk": ("LlamaForCausalLM", {"extra_config": {"rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}}}, (3, 18, 40), {}),
    # OLMo 2: norms on the attention and MLP outputs only, q and k normed over all heads
    "olmo2": ("Olmo2ForCausalLM", {"extra_config": {"pad_token_id": 0}}, (3, 18, 40), {}),
    # OLMo 3: the same, an 8-token window in its first layer, whose rotary base differs from the global one's
    "olmo3": ("Olmo3ForCausalLM", {"extra_config": {
        "pad_token_id": 0, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}}}, (3, 18, 40), {}),
    # SmolLM3: the second layer has no rotary positions (NoPE)
    "smollm3": ("SmolLM3ForCausalLM", {"extra_config": {"no_rope_layers": [1, 0], "pad_token_id": 0}}, (3, 18, 40), {}),
    # Qwen2-MoE: q/k/v biases, raw softmax weights, and a shared expert behind a sigmoid gate
    "qwen2-moe": ("Qwen2MoeForCausalLM", {"extra_config": {**_EXPERTS, "shared_expert_intermediate_size": 96}},
                  (3, 18, 40), {}),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_hf(tmp_path, case):
    architecture, model_kwargs, lengths, llm_kwargs = CASES[case]
    model_dir = make_tiny_model_dir(tmp_path, architecture=architecture, **model_kwargs)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in lengths]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = {i: hf_greedy(hf, p, 16) for i, p in enumerate(prompts)}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    for config in ({}, {"max_num_batched_tokens": 7, "block_size": 4}):  # one batch; chunked prompts
        llm = LLM(str(model_dir), dtype="float32", **llm_kwargs, **config)
        assert_outputs_match_hf(llm.generate(prompts, params, use_tqdm=False), reference, f"{case}{config}")


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_hf(tmp_path, case):
    """The whole-sequence (cacheless) forward's logits equal HF's within 1e-4: greedy tokens alone
    can agree on a tiny model even with a wrong scale somewhere."""
    from engine.loader import load_model

    architecture, model_kwargs, lengths, llm_kwargs = CASES[case]
    model_dir = make_tiny_model_dir(tmp_path, architecture=architecture, **model_kwargs)
    ids = torch.randint(3, 380, (max(lengths),), generator=torch.Generator().manual_seed(8))
    model, _ = load_model(model_dir, "float32", max_model_len=llm_kwargs.get("max_model_len"))
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(len(ids))))
        theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def _with_config(folder, drop: tuple[str, ...] = (), **extra):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in {**config, **extra}.items() if k not in drop}))
    return folder


# Qwen windows the layers from max_window_layers on (here the second of two), and its older
# configs do not list layer_types: the windows come from use_sliding_window and max_window_layers
_QWEN_WINDOW = {"use_sliding_window": True, "max_window_layers": 1}


@pytest.mark.parametrize("architecture, extra", [("MistralForCausalLM", {}), ("Phi3ForCausalLM", _PHI3),
                                                 ("Qwen2ForCausalLM", _QWEN_WINDOW),
                                                 ("Qwen3MoeForCausalLM", {**_EXPERTS, **_QWEN_WINDOW}),
                                                 ("Gemma3ForCausalLM", {**_GEMMA3, "head_dim": 16}),
                                                 ("Gemma2ForCausalLM", {**_GEMMA2, "head_dim": 16})])
def test_sliding_window_attention_equals_hf(tmp_path, monkeypatch, architecture, extra):
    """Each query sees its latest 8 keys only (Mistral v0.1's window in every layer, Phi-3-mini-4k's,
    Qwen's and Gemma 3's in some): prompts and decodes past the window, in one batch and chunked, through the C
    kernels (the fused decode step and the module path), the torch path and the Triton kernel
    (interpreted on a CPU), give HF's tokens and logprobs."""
    model_dir = _with_config(make_tiny_model_dir(tmp_path, architecture=architecture, extra_config=extra),
                             drop=() if "layer_types" in extra else ("layer_types",), sliding_window=8)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (3, 11, 40)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    reference = {i: hf_greedy(hf, p, 16) for i, p in enumerate(prompts)}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    from engine.layers import triton_attention

    triton = [{"attention_backend": "triton"}] if triton_attention.available(torch.device("cpu")) else []
    for config in ({}, {"max_num_batched_tokens": 7, "block_size": 4}, {"attention_backend": "torch"},
                   {"fused_decode": False}, *triton):
        monkeypatch.setenv("DRIFTGATE_FUSED_DECODE", "0" if config.pop("fused_decode", True) is False else "1")
        llm = LLM(str(model_dir), dtype="float32", **config)
        assert llm.engine.max_model_len == 512  # the window no longer caps the context
        assert_outputs_match_hf(llm.generate(prompts, params, use_tqdm=False), reference, f"{architecture}{config}")


def test_blocks_a_window_left_serve_other_sequences(tmp_path):
    """Blocks before every running sequence's window are let go: 4 sequences of 52 tokens fit in
    20 blocks of 4 (a whole context each would need 52) without a preemption, answering as with
    a roomy cache, and the blocks they reuse never reach a window still open."""
    model_dir = _with_config(make_tiny_model_dir(tmp_path, architecture="MistralForCausalLM"), sliding_window=8)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 380, (20,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    roomy = LLM(str(model_dir), dtype="float32").generate(prompts, params, use_tqdm=False)
    tight = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=20, max_model_len=64,
                max_num_batched_tokens=16)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    for ours, theirs in zip(outs, roomy, strict=True):
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)
    stats = tight.stats()
    assert stats.num_preemptions == 0 and stats.num_blocks_used == 0


def test_the_cacheless_path_keeps_the_window(tmp_path):
    """Calibration runs whole sequences without a cache (ctx None): past the window too, HF's logits."""
    from engine.loader import load_model

    model_dir = _with_config(make_tiny_model_dir(tmp_path, architecture="MistralForCausalLM"), sliding_window=8)
    model, _ = load_model(model_dir, "float32")
    ids = torch.randint(3, 380, (40,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(40)))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        theirs = hf(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_qwen_windows_only_under_use_sliding_window(tmp_path):
    """Qwen configs carry a sliding_window that only use_sliding_window turns on, from layer
    max_window_layers on; config.json's layer_types, where written, say the same per layer."""
    from engine.models.llama import LlamaArgs

    config = json.loads((make_tiny_model_dir(tmp_path, architecture="Qwen2ForCausalLM") / "config.json").read_text())
    config = {k: v for k, v in config.items() if k != "layer_types"}
    assert LlamaArgs.from_hf_config({**config, "sliding_window": 32}).layer_windows == (None, None)
    windowed = {**config, "sliding_window": 32, "use_sliding_window": True, "max_window_layers": 1}
    assert LlamaArgs.from_hf_config(windowed).layer_windows == (None, 32)
    listed = {**config, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]}
    assert LlamaArgs.from_hf_config(listed).layer_windows == (32, None)


def test_longrope_takes_the_short_factors_when_the_kv_cache_caps_the_context(tmp_path):
    """A KV cache that holds 64 tokens serves a 64-token context, within LongRoPE's pretraining
    one: the short factors, as HF uses them there (the long ones were chosen for the 512 the
    model could have served, before the cache capped it)."""
    model_dir = make_tiny_model_dir(tmp_path, architecture="Phi3ForCausalLM", extra_config=_LONGROPE)
    g = torch.Generator().manual_seed(10)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (3, 40)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = {i: hf_greedy(hf, p, 16) for i, p in enumerate(prompts)}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    llm = LLM(str(model_dir), dtype="float32", block_size=16, num_kv_blocks=4)
    assert llm.engine.max_model_len == 64
    assert_outputs_match_hf(llm.generate(prompts, params, use_tqdm=False), reference, "capped")


_GEMMA3_UNLISTED = {k: v for k, v in _GEMMA3.items() if k != "layer_types"}


@pytest.mark.parametrize("architecture, model_kwargs, drop", [
    # Gemma 2 configs (transformers 4.42's) list no layer_types and no tie_word_embeddings: its class
    # alternates local and global layers and ties the embeddings
    ("Gemma2ForCausalLM", {"head_dim": 16, "extra_config": _GEMMA2},
     ("layer_types", "tie_word_embeddings", "attn_logit_softcapping", "final_logit_softcapping")),
    ("Gemma3ForCausalLM", {"head_dim": 16, "num_layers": 6, "extra_config": _GEMMA3_UNLISTED},
     ("layer_types",)),  # 1 layer in 6 global
    ("Olmo3ForCausalLM", {"num_layers": 4, "extra_config": {"pad_token_id": 0, "sliding_window": 8}},
     ("layer_types", "rms_norm_eps")),  # 1 in 4 global; epsilon 1e-5
    # SmolLM3 carries a sliding_window that only use_sliding_window turns on
    ("SmolLM3ForCausalLM", {"extra_config": {"pad_token_id": 0, "sliding_window": 8, "use_sliding_window": False}},
     ("layer_types", "tie_word_embeddings")),
])
def test_keys_config_json_leaves_out_are_read_as_transformers_reads_them(tmp_path, architecture, model_kwargs, drop):
    """A key config.json lacks takes the default of the model's transformers config class, not
    the engine's own: every layer windowed, untied embeddings or another epsilon gave other tokens
    (or no model at all) where HF loads the same folder."""
    model_dir = _with_config(make_tiny_model_dir(tmp_path, architecture=architecture, **model_kwargs), drop=drop)
    assert not set(drop) & set(json.loads((model_dir / "config.json").read_text()))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (3, 30)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    reference = {i: hf_greedy(hf, p, 16) for i, p in enumerate(prompts)}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    llm = LLM(str(model_dir), dtype="float32", block_size=4)
    assert_outputs_match_hf(llm.generate(prompts, params, use_tqdm=False), reference, architecture)


@pytest.mark.parametrize("case, options", [
    ("gemma3", "w8a16 --algo awq"), ("gemma3", "w8a8-int8 --smoothquant 0.5"), ("gemma3", "fp8-dynamic"),
    ("gemma2", "w8a16 --algo awq"), ("granite", "w4a16 --algo gptq"), ("granite", "fp8-dynamic"),
    ("smollm3", "w8a16 --algo gptq"), ("olmo2", "w8a16 --algo awq"), ("olmo3", "fp8-dynamic")])
def test_quantized_models_with_their_own_scalings_answer_as_hf_on_them(tmp_path, case, options):
    """Gemma 3 (and 2) quantizes, AWQ and SmoothQuant folding scales into its (1 + w) norms (the MLP's
    input norm is pre_feedforward_layernorm); Granite with its multipliers. The checkpoint (Gemma's
    norms written back in its convention) loads in HF transformers, whose logits equal this engine's."""
    from calibration.cli import main
    from tests.calibration.factories import write_calib_file

    architecture, model_kwargs, _, _ = CASES[case]
    source = make_tiny_model_dir(tmp_path / case, architecture=architecture, **model_kwargs)
    calib = write_calib_file(tmp_path / "calib.jsonl", 12)
    out = tmp_path / "quantized"
    assert main([str(source), "--calib", str(calib), "-o", str(out), "--scheme", *options.split(),
                 "--num-samples", "8", "--num-heldout", "4"]) == 0
    # close to the model before quantization: a norm written back without Gemma's offset is far off
    assert_quantized_answers_as_hf(source, out, weights_only="a16" in options, max_drift=0.15)


@pytest.mark.parametrize("options", ["w4a16 --algo gptq", "w8a16 --algo awq", "fp8-dynamic",
                                     "w8a8-int8 --smoothquant 0.5"])
def test_quantized_phi3_keeps_the_fused_names_hf_loads(tmp_path, options):
    """Phi-3's checkpoint stores qkv_proj and gate_up_proj whole: quantize writes them so (as
    llm-compressor does, one scale set per fused matrix), and HF transformers with
    compressed-tensors loads the result and answers as this engine does."""
    from safetensors import safe_open

    from calibration.cli import main
    from tests.calibration.factories import write_calib_file

    source = make_tiny_model_dir(tmp_path / "phi3", architecture="Phi3ForCausalLM", extra_config=_PHI3)
    calib = write_calib_file(tmp_path / "calib.jsonl", 12)
    out = tmp_path / "quantized"
    assert main([str(source), "--calib", str(calib), "-o", str(out), "--scheme", *options.split(),
                 "--num-samples", "8", "--num-heldout", "4"]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    layer = {n.split(".")[4] for n in names if n.startswith("model.layers.0.") and "_proj" in n}
    assert layer == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    prompt = list(range(5, 30))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokens, _ = hf_greedy(hf, prompt, 12)
    ours = LLM(str(out), dtype="float32").generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                                           ignore_eos=True), use_tqdm=False)
    assert list(ours[0].outputs[0].token_ids) == tokens
