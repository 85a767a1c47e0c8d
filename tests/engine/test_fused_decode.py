"""The one-call decode step (engine/csrc/decode_step.c) gives the module path's floats exactly."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.layers import fused_decode, panel_matmul
from engine.layers.fused_decode import FusedDecode
from quant.checkpoint import write_checkpoint
from quant.config import QuantizationConfig
from quant.schemes import FP8_KV, QuantArgs, QuantScheme, fp8_block, preset
from tests.helpers import make_tiny_model_dir, quantized_tensors, write_lora_adapter

needs_kernel = pytest.mark.skipif(fused_decode._kernel() is None, reason="no C compiler here")
needs_w8a8_kernel = pytest.mark.skipif(not panel_matmul.w8a8_available(), reason="the W8A8 kernel needs AVX2")

_FUSED_CALL = FusedDecode.__call__  # the real one: each _run wraps this, never an earlier wrapper
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in (1, 6, 19, 40)]


def _run(model_dir: Path, enabled: bool, monkeypatch, lora_request=None, **engine_kwargs) -> tuple[list, int]:
    """Greedy outputs (tokens and top logprobs) and the number of steps the C path ran."""
    calls = []
    monkeypatch.setattr(FusedDecode, "__call__", lambda self, *a: calls.append(1) or _FUSED_CALL(self, *a))
    monkeypatch.setenv("DRIFTGATE_FUSED_DECODE", "1" if enabled else "0")  # read when the engine is built
    llm = LLM(str(model_dir), dtype="float32", **engine_kwargs)
    assert (llm.engine.model.fused_decode is not None) == enabled
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False, lora_request=lora_request)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], len(calls)


def _fp8(strategy: str, **kw) -> QuantArgs:
    return QuantArgs(type="float", num_bits=8, strategy=strategy, **kw)


SCHEMES = {name: preset(name) for name in ("w8a16", "w4a16", "w4a16-asym", "w8a8-int8", "fp8-dynamic", "fp8-static",
                                           "nvfp4a16", "mxfp4a16")} | {
    "w4a8": preset("w4a8", group_size=32),
    "fp8-tensor-dynamic": QuantScheme(_fp8("channel"), _fp8("tensor", dynamic=True), "float-quantized"),
    "fp8-weight-only": QuantScheme(_fp8("channel"), None, "naive-quantized"),
    "fp8-block": preset("fp8-block"),
    # tiles smaller than the tiny model: scale groups of 8 columns, inputs scaled per 24 (the last 16)
    "fp8-block-16x24": fp8_block((16, 24)),
}


def _quantized_dir(tmp_path: Path, source: Path, name: str) -> Path:
    scheme = SCHEMES[name]
    return write_checkpoint(tmp_path / name, source_dir=source, quant_config=QuantizationConfig.for_scheme(scheme),
                            tensors=quantized_tensors(source, scheme, kv=False))


MODELS = {
    "llama-gqa": {},
    "bf16-valued": {"dtype": torch.bfloat16},  # served in fp32 from bf16 panels
    "qwen2-qkv-bias": {"architecture": "Qwen2ForCausalLM"},
    "qwen3-qk-norm": {"architecture": "Qwen3ForCausalLM", "head_dim": 32},
    "mha-untied": {"num_kv_heads": 4, "tie_word_embeddings": False},
    # Gemma 3: sandwich norms, GeGLU, scaled embeddings, a local layer with its own window and rotary base
    "gemma3": {"architecture": "Gemma3ForCausalLM", "head_dim": 16, "extra_config": {
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 24,
        "pad_token_id": 0}},
    # Gemma 2: attention scores capped in the decode kernel
    "gemma2": {"architecture": "Gemma2ForCausalLM", "head_dim": 16, "extra_config": {
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 24,
        "pad_token_id": 0, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}},
    # Granite: attention and MLP outputs scaled before their residual adds
    "granite": {"architecture": "GraniteForCausalLM", "extra_config": {
        "embedding_multiplier": 6.0, "attention_multiplier": 0.05, "residual_multiplier": 0.3, "logits_scaling": 4.0}},
    # SmolLM3: a layer without rotary positions
    "smollm3-nope": {"architecture": "SmolLM3ForCausalLM", "extra_config": {"no_rope_layers": [0, 1], "pad_token_id": 0}},
    # OLMo 2: no input norms, the attention and MLP outputs normed before their adds, q and k normed whole
    "olmo2": {"architecture": "Olmo2ForCausalLM", "extra_config": {"pad_token_id": 0}},
    # OLMo 3: the same, with a windowed first layer on its own rotary base
    "olmo3": {"architecture": "Olmo3ForCausalLM", "extra_config": {
        "pad_token_id": 0, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}}},
    # Phi-4-mini's partial rotation: 3/4 of each head
    "phi3-partial-rotary": {"architecture": "Phi3ForCausalLM",
                            "extra_config": {"pad_token_id": 0, "partial_rotary_factor": 0.75}},
    # fused q/k/v and gate/up in the checkpoint; LongRoPE's scaled cos/sin tables
    "phi3-longrope": {"architecture": "Phi3ForCausalLM", "extra_config": {
        "pad_token_id": 0, "original_max_position_embeddings": 16, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [1.0, 1.5, 2.4, 3.9, 6.0, 9.0, 13.0, 18.0]}}},
}


CASES = [(name, {}) for name in MODELS] + [
    ("llama-gqa", {"block_size": 1}),
    ("llama-gqa", {"block_size": 4, "num_kv_blocks": 20}),  # preempts: recomputed prompts, then decode again
    ("llama-gqa", {"kv_cache_dtype": "bfloat16"}),  # K/V rounded to bf16 in C exactly as torch's cast
    # K/V divided by the scales the first prefill set, saturated and rounded to e4m3 in C as torch's cast
    ("llama-gqa", {"kv_cache_dtype": "fp8", "kv_scales": "dynamic"}),
    ("llama-gqa", {"kv_cache_dtype": "fp8_e5m2"}),  # K/V rounded to e5m2 in C as torch's cast, unscaled
]


@needs_kernel
@pytest.mark.parametrize("name,engine_kwargs", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_fused_step_equals_module_path(tmp_path, monkeypatch, name, engine_kwargs):
    model_dir = make_tiny_model_dir(tmp_path / name, **MODELS[name])
    fused, fused_calls = _run(model_dir, True, monkeypatch, **engine_kwargs)
    modules, module_calls = _run(model_dir, False, monkeypatch, **engine_kwargs)
    assert fused_calls > 0 and module_calls == 0
    assert fused == modules  # tokens and logprobs, bit for bit


@needs_kernel
@pytest.mark.parametrize("name,scheme", [("llama-gqa", None), ("qwen2-qkv-bias", None), ("llama-gqa", "fp8-dynamic"),
                                         ("llama-gqa", "w4a16")])
def test_fused_step_with_lora_adapters_equals_module_path(tmp_path, monkeypatch, name, scheme):
    """Decode steps run in C with each adapter's factors on its rows (added from the unrounded
    input, as the modules add them, also over FP8 activations): the module path's floats, with
    one adapter on every row, and with two adapters of different ranks and targets mixed with base
    rows in one batch."""
    pytest.importorskip("peft")
    model_dir = make_tiny_model_dir(tmp_path / name, **MODELS[name])
    first = write_lora_adapter(model_dir, tmp_path / "a", ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                               rank=4, seed=1)
    second = write_lora_adapter(model_dir, tmp_path / "b", ["k_proj", "gate_proj"], rank=20, seed=2)
    if scheme is not None:
        model_dir = _quantized_dir(tmp_path, model_dir, scheme)
    a, b = LoRARequest("a", 1, str(first)), LoRARequest("b", 2, str(second))
    runs = {}
    for lora in (a, [a, None, b, a], [b, b, None, None]):
        fused, fused_calls = _run(model_dir, True, monkeypatch, lora, enable_lora=True)
        modules, _ = _run(model_dir, False, monkeypatch, lora, enable_lora=True)
        assert fused == modules  # tokens and logprobs, bit for bit
        assert fused_calls > 0  # the C path ran the decode steps
        runs[str(lora)] = fused
    without, _ = _run(model_dir, True, monkeypatch, enable_lora=True)
    assert without != runs[str(a)]  # the adapters changed the answers
    assert runs[str(a)] != runs[str([a, None, b, a])]


# FP8 W8A8 also on the fp32 kernel the bf16-product one replaces where AVX-512 BF16 is missing
QUANTIZED = [pytest.param(n, True, marks=needs_w8a8_kernel) if n in ("w8a8-int8", "w4a8") else (n, True) for n in SCHEMES] + [
    (n, False) for n in ("fp8-dynamic", "fp8-static", "fp8-tensor-dynamic", "fp8-block-16x24")]


@needs_kernel
@pytest.mark.parametrize("scheme,bf16_products", QUANTIZED)
def test_fused_step_equals_module_path_on_quantized_weights(tmp_path, monkeypatch, scheme, bf16_products):
    """FP8 inputs are rounded in C exactly as quant.fp8 does: per token, per tensor, static, or not at all."""
    if not bf16_products:
        monkeypatch.setattr(panel_matmul, "fp8_dot_fits", lambda n: False)
    model_dir = _quantized_dir(tmp_path, make_tiny_model_dir(tmp_path / "source"), scheme)
    fused, fused_calls = _run(model_dir, True, monkeypatch)
    modules, _ = _run(model_dir, False, monkeypatch)
    assert fused_calls > 0
    assert fused == modules


@needs_kernel
def test_fused_step_equals_module_path_with_a_scale_per_kv_head(tmp_path, monkeypatch):
    """A checkpoint's fp8 KV scales, one per KV head (compressed-tensors' ``attn_head``, what
    `quantize --kv-scale-strategy head` writes): each head's K/V stored and decoded with its own scale."""
    source = make_tiny_model_dir(tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    tensors = quantized_tensors(source, None, kv=False)
    heads = torch.arange(1, config["num_key_value_heads"] + 1, dtype=torch.float32).reshape(-1, 1, 1)
    for i in range(config["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = 0.004 * heads * (i + 1)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = 0.002 * heads.flip(0)
    model_dir = write_checkpoint(tmp_path / "kv-head", source_dir=source, tensors=tensors, quant_config=(
        QuantizationConfig(kv_cache_scheme=replace(FP8_KV, strategy="attn_head"))))
    fused, fused_calls = _run(model_dir, True, monkeypatch, kv_cache_dtype="fp8")
    modules, _ = _run(model_dir, False, monkeypatch, kv_cache_dtype="fp8")
    assert fused_calls > 0
    assert fused == modules


@needs_kernel
def test_steps_with_a_prompt_chunk_go_through_the_modules(tiny_model_dir, monkeypatch):
    """Only decode-only steps take the C path: a step that also prefills a new request runs the modules."""
    monkeypatch.setenv("DRIFTGATE_FUSED_DECODE", "1")
    llm = LLM(str(tiny_model_dir), dtype="float32")
    calls = []
    monkeypatch.setattr(FusedDecode, "__call__", lambda self, *a: calls.append(1) or _FUSED_CALL(self, *a))
    engine, first, second = llm.engine, *_prompts()[2:]
    engine.add_request(None, first, GREEDY)
    engine.step()  # the first prompt
    engine.step()  # its first decode: the C path
    engine.add_request(None, second, GREEDY)
    engine.step()  # the second prompt beside the first's decode: modules
    engine.step()  # both decode: the C path
    assert calls == [1, 1]


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_layer_states_see_every_row_when_a_chunk_is_one_token(tiny_model_dir, num_tokens):
    """score() feeds a one-token tail chunk (here with an 8-token budget) as a decode row; hooks on
    the layers must see it, so the C path stands aside while a module is watched."""
    llm = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=8)
    assert llm.engine.model.fused_decode is not None
    tokens = list(range(5, 5 + num_tokens))
    logprobs, states = llm.score_with_layer_states(tokens)
    assert states.shape[:2] == (2, num_tokens)
    torch.testing.assert_close(logprobs, llm.score_full_logprobs(tokens), rtol=0, atol=0)


def test_a_bf16_cache_stays_near_the_fp32_one(tiny_model_dir):
    """bfloat16 K/V (half the bytes) move this model's token log-probabilities by little."""
    prompt = _prompts()[3]
    fp32 = LLM(str(tiny_model_dir), dtype="float32").score_full_logprobs(prompt)
    bf16 = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype="bfloat16").score_full_logprobs(prompt)
    assert 0 < (bf16 - fp32).abs().max().item() < 0.05
