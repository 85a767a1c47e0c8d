"""Every architecture the engine serves gives HF transformers' greedy tokens and logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.helpers import make_tiny_model_dir
from tests.oracle import assert_outputs_match_hf, hf_greedy

ARCHITECTURES = {
    "Qwen2ForCausalLM": {},  # q/k/v biases
    "MistralForCausalLM": {},
    # per-head query/key RMSNorm, and a head_dim that is not hidden_size / heads (64 / 4)
    "Qwen3ForCausalLM": {"head_dim": 32},
}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_tokens_equal_hf(tmp_path, architecture):
    model_dir = make_tiny_model_dir(tmp_path, architecture=architecture, **ARCHITECTURES[architecture])
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (3, 18, 40)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = {i: hf_greedy(hf, p, 16) for i, p in enumerate(prompts)}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    for config in ({}, {"max_num_batched_tokens": 7, "block_size": 4}):  # one batch; chunked prompts
        llm = LLM(str(model_dir), dtype="float32", **config)
        assert_outputs_match_hf(llm.generate(prompts, params, use_tqdm=False), reference, f"{architecture}{config}")


def test_a_sliding_window_caps_the_context(tmp_path):
    """Attention over a window (Mistral v0.1) is not implemented: contexts stay within it, so
    answers never part from the model's. Qwen configs carry a window only use_sliding_window turns on."""
    import json

    from engine import LLM

    mistral = make_tiny_model_dir(tmp_path / "mistral", architecture="MistralForCausalLM")
    qwen = make_tiny_model_dir(tmp_path / "qwen", architecture="Qwen2ForCausalLM")
    for folder, extra in ((mistral, {"sliding_window": 32}), (qwen, {"sliding_window": 32, "use_sliding_window": False})):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
    llm = LLM(str(mistral), dtype="float32")
    assert llm.engine.max_model_len == 32
    with pytest.raises(ValueError, match="maximum context length|32"):
        llm.generate([list(range(3, 43))], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="sliding attention window of 32 tokens"):
        LLM(str(mistral), dtype="float32", max_model_len=64)
    assert LLM(str(qwen), dtype="float32").engine.max_model_len == 512
