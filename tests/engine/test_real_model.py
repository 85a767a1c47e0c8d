"""The engine on the imported SmolLM2-135M-Instruct (fp32) against HF transformers, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.oracle import assert_outputs_match_hf, hf_greedy

pytestmark = pytest.mark.real_model
MAX_NEW = 64
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 20.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Think step by step.",
    "Give me a short tip for writing clear Python code.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
CONFIGS = {
    "batch-prefix-cache": {},
    "batch-no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-prefill": {"max_num_batched_tokens": 24},
    "preemption": {"num_kv_blocks": 24, "max_num_batched_tokens": 256},
    "speculative": {"speculative_config": {"num_speculative_tokens": 4, "disable_by_batch_size": 0}},
}


@pytest.fixture(scope="module")
def prompts(real_model_dir):
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(real_model_dir)
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)) for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_reference(real_model_dir, prompts):
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    return [hf_greedy(model, p, MAX_NEW) for p in prompts]


def test_one_at_a_time_equals_hf(real_model_dir, prompts, hf_reference):
    llm = LLM(str(real_model_dir), dtype="float32")
    assert_outputs_match_hf([llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts], hf_reference, "single")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_equals_hf(real_model_dir, prompts, hf_reference, name):
    llm = LLM(str(real_model_dir), dtype="float32", **CONFIGS[name])
    assert_outputs_match_hf(llm.generate(prompts, GREEDY, use_tqdm=False), hf_reference, name)
    stats = llm.stats()
    assert stats.num_blocks_used == 0
    if name == "preemption":
        assert stats.num_preemptions > 0
    if name == "speculative":  # the same tokens and logprobs, with drafts kept along the way
        assert stats.num_accepted_draft_tokens > 0
    if name == "batch-prefix-cache":  # the chat template's system prompt is shared by all 8
        assert stats.prefix_cache_hits >= 7 * 16


def test_prompt_logprobs_equal_hf(real_model_dir, prompts):
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    llm = LLM(str(real_model_dir), dtype="float32")
    out = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for p, o in zip(prompts[:2], out, strict=True):
        with torch.no_grad():
            ref = model(torch.tensor([p])).logits[0].log_softmax(-1)
        got = torch.tensor([o.prompt_logprobs[t][p[t]] for t in range(1, len(p))])
        want = ref[torch.arange(len(p) - 1), torch.tensor(p[1:])]
        assert (got - want).abs().max().item() < 1e-4


def test_chat_generates_coherent_text(real_model_dir):
    llm = LLM(str(real_model_dir))
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_structured_outputs_on_the_real_model(real_model_dir):
    """JSON by schema and a choice from SmolLM2 itself: parseable, on schema, and still on topic."""
    import json

    from engine.structured_output import StructuredOutputs

    llm = LLM(str(real_model_dir))
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    question = [{"role": "user", "content": "What is the capital of France? Answer in JSON with city and country."}]
    constrained = [StructuredOutputs(json=schema), StructuredOutputs(choice=["Paris", "London", "Berlin"])]
    outs = [llm.chat(question, SamplingParams(temperature=0, max_tokens=48, structured_outputs=c), use_tqdm=False)[0]
            for c in constrained]
    answer = json.loads(outs[0].outputs[0].text)
    assert set(answer) == {"city", "country"} and "Paris" in answer["city"]
    assert outs[1].outputs[0].text == "Paris" and outs[1].outputs[0].finish_reason == "stop"
