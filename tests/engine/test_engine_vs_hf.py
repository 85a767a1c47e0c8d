"""Exactness on a tiny random model: our greedy tokens and logprobs equal HF transformers'."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.layers import triton_attention
from tests.oracle import assert_matches_hf, assert_outputs_match_hf, hf_greedy

MAX_NEW = 24
SHARED = [5, 9, 17, 33, 65, 129, 200, 7] * 3  # 24 shared tokens: prefix-cache hits across prompts


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (5, 17, 33, 40)]
    prompts += [SHARED + torch.randint(3, 380, (n,), generator=g).tolist() for n in (1, 9, 16, 30)]
    return prompts


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return {i: hf_greedy(model, p, MAX_NEW) for i, p in enumerate(_prompts())}


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)

CONFIGS = {
    "one-batch": {},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-prefill": {"max_num_batched_tokens": 7},
    "block-size-1": {"block_size": 1},
    "preemption": {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 64},
    "torch-attention": {"attention_backend": "torch"},
    # the CUDA backend's kernel, here under Triton's interpreter (tests/conftest.py)
    "triton-attention": {"attention_backend": "triton", "max_num_batched_tokens": 7},
    # on a GPU: Triton attention with decode steps replayed from CUDA graphs, eager, and the torch backend
    # (a fixed cache: 90% of a big GPU's memory would be millions of blocks for this tiny model)
    "cuda-graphs": {"device": "cuda", "max_num_batched_tokens": 7, "num_kv_blocks": 256},
    "cuda-eager": {"device": "cuda", "enforce_eager": True, "num_kv_blocks": 256},
    "cuda-torch-attention": {"device": "cuda", "attention_backend": "torch", "enforce_eager": True,
                             "num_kv_blocks": 256},
}
NEEDS_TRITON = pytest.mark.skipif(not triton_attention.available(torch.device("cpu")), reason="triton is not installed")
NEEDS_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _marks(name: str) -> list:
    return NEEDS_CUDA if name.startswith("cuda") else [NEEDS_TRITON] if name.startswith("triton") else []


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n)) for n in CONFIGS])
def test_greedy_tokens_equal_hf(tiny_model_dir, hf_reference, name):
    llm = LLM(str(tiny_model_dir), dtype="float32", **CONFIGS[name])
    assert_outputs_match_hf(llm.generate(_prompts(), GREEDY, use_tqdm=False), hf_reference, name)
    stats = llm.stats()
    assert stats.num_blocks_used == 0, "every block must be released once requests finish"
    if name == "preemption":
        assert stats.num_preemptions > 0, "the tiny cache was meant to force preemption"
    if name == "cuda-graphs":
        assert llm.engine.runner.graphs.graphs, "decode steps should have replayed CUDA graphs"
    if name == "one-batch":
        assert stats.prefix_cache_hits >= 3 * 16, "prompts sharing 24 tokens should hit the cache"


def test_one_prompt_at_a_time_equals_hf(tiny_model_dir, hf_reference):
    llm = LLM(str(tiny_model_dir), dtype="float32")
    for i, prompt in enumerate(_prompts()[:3]):
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        theirs, their_lp = hf_reference[i]
        assert_matches_hf(out.outputs[0].token_ids, out.outputs[0].logprobs, theirs, their_lp, f"single/{i}")


@pytest.mark.parametrize("chunk", [2048, 5])
def test_prompt_logprobs_equal_hf_log_softmax(tiny_model_dir, chunk):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    llm = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=chunk)
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert out.prompt_logprobs[0] is None and out.prompt_logprob_ranks[0] is None
        assert len(out.prompt_logprobs) == len(out.prompt_logprob_ranks) == len(prompt)
        ranks = []
        for t in range(1, len(prompt)):
            entry = out.prompt_logprobs[t]
            assert abs(entry[prompt[t]] - ref[t - 1, prompt[t]].item()) < 1e-4
            top = ref[t - 1].topk(3).indices.tolist()
            assert set(top) <= set(entry)
            # its place among the vocabulary's logprobs (rows without a near-tie to it)
            gaps = (ref[t - 1] - ref[t - 1, prompt[t]]).abs()
            if not ((gaps < 1e-4) & (gaps > 0)).any():
                assert out.prompt_logprob_ranks[t] == int((ref[t - 1] > ref[t - 1, prompt[t]]).sum()) + 1
                ranks.append(out.prompt_logprob_ranks[t])
        assert len(set(ranks)) > 3  # random prompts: tokens from far down the ranking too


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 8, "block_size": 4}])
def test_score_full_logprobs_equals_hf(tiny_model_dir, kwargs):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    llm = LLM(str(tiny_model_dir), dtype="float32", **kwargs)
    prompt = _prompts()[3]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    torch.testing.assert_close(llm.score_full_logprobs(prompt), ref, atol=1e-4, rtol=0)
    assert not llm.engine.runner.block_rows  # scoring leaves no per-request state behind
    assert llm.stats().num_blocks_used == 0



def test_score_chunks_stream_the_rows_a_prefill_chunk_at_a_time(tiny_model_dir):
    """score_chunks yields score's rows in prefill chunks (what Tier 0 holds at once), one sequence
    at a time; an abandoned one gives its KV blocks and capture hooks back when closed."""
    llm = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=8, block_size=4)
    prompt = _prompts()[3]
    whole = llm.score_full_logprobs(prompt)
    chunks = list(llm.score_chunks(prompt, layer_states=True))
    assert [rows.shape[0] for rows, _ in chunks] == [min(8, len(prompt) - s) for s in range(0, len(prompt), 8)]
    assert torch.equal(torch.cat([rows for rows, _ in chunks]), whole)
    assert all(states.shape[:2] == (llm.engine.model.args.num_layers, rows.shape[0]) for rows, states in chunks)
    assert all(states is None for _, states in llm.score_chunks(prompt))

    first = llm.score_chunks(prompt, layer_states=True)
    next(first)
    assert llm.stats().num_blocks_used > 0
    with pytest.raises(RuntimeError, match="one sequence at a time"):
        next(llm.score_chunks(prompt))
    first.close()
    assert llm.stats().num_blocks_used == 0 and not llm.engine.runner.block_rows
    assert not llm.engine.model.model.layers[0]._forward_hooks
    assert torch.equal(llm.score_full_logprobs(prompt), whole)  # the engine scores again after the abandoned one

def test_max_logprobs_bounds_requests_and_minus_one_gives_every_token(tiny_model_dir):
    """vLLM's max_logprobs: 20 by default (more is a ValueError naming the field); -1 lets a request
    take the whole distribution, which is HF's log-softmax."""
    prompt = _prompts()[0]
    default = LLM(str(tiny_model_dir), dtype="float32")
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"^{field} must be at most 20 here"):
            default.generate([prompt], SamplingParams(max_tokens=1, **{field: 21}), use_tqdm=False)
    vocab = default.engine.model.args.vocab_size
    llm = LLM(str(tiny_model_dir), dtype="float32", max_logprobs=-1)
    assert llm.engine.max_logprobs == vocab
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=vocab, prompt_logprobs=vocab),
                       use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    given = out.outputs[0].logprobs[0]
    assert len(given) == vocab
    torch.testing.assert_close(torch.tensor([given[t] for t in range(vocab)]), ref[-1], atol=1e-4, rtol=0)
    assert len(out.prompt_logprobs[1]) == vocab
    with pytest.raises(ValueError, match="max_logprobs must be -1"):
        LLM(str(tiny_model_dir), max_logprobs=-2)


def test_prompt_logprobs_start_reuses_prefix_cache(tiny_model_dir):
    """A continuation scored after a shared context hits the cache and keeps exact logprobs."""
    llm = LLM(str(tiny_model_dir), dtype="float32")
    context = SHARED + [11, 12, 13]
    base = llm.generate([context + [20, 21]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=len(context))
    hits_before = llm.stats().prefix_cache_hits
    again = llm.generate([context + [20, 21]], params, use_tqdm=False)[0]
    assert llm.stats().prefix_cache_hits - hits_before == 16
    for t in (len(context), len(context) + 1):
        assert again.prompt_logprobs[t] == pytest.approx(base.prompt_logprobs[t], abs=1e-5)


@pytest.mark.parametrize("chunk", [2048, 5])
def test_prompt_logprobs_start_computes_only_the_asked_tail(tiny_model_dir, chunk):
    """Positions before prompt_logprobs_start are left out (no vocab-wide logits spent on them); the rest are exact."""
    llm = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=chunk, enable_prefix_caching=False)
    prompt = _prompts()[3]
    start = 29
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    tail = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0,
                                                 prompt_logprobs_start=start), use_tqdm=False)[0]
    assert tail.prompt_logprobs[:start] == [None] * start
    assert len(tail.prompt_logprobs) == len(prompt)
    for t in range(start, len(prompt)):
        assert tail.prompt_logprobs[t] == pytest.approx(full.prompt_logprobs[t], abs=1e-5)


def test_layer_states_equal_hf_hidden_states(tiny_model_dir):
    """score_with_layer_states: row i is decoder layer i's output, as HF's hidden_states[i + 1], across chunks."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    llm = LLM(str(tiny_model_dir), dtype="float32", max_num_batched_tokens=8, block_size=4)
    prompt = _prompts()[3]
    with torch.no_grad():
        ref = model(torch.tensor([prompt]), output_hidden_states=True)
    logprobs, states = llm.score_with_layer_states(prompt)
    num_layers = model.config.num_hidden_layers
    assert states.shape == (num_layers, len(prompt), model.config.hidden_size)
    torch.testing.assert_close(logprobs, ref.logits[0].log_softmax(-1), atol=1e-4, rtol=0)
    for i in range(num_layers - 1):  # HF's last entry has the final norm applied
        torch.testing.assert_close(states[i], ref.hidden_states[i + 1][0], atol=1e-4, rtol=1e-4)
    assert not llm.engine.model.model.layers[0]._forward_hooks, "capture hooks must be removed"


def test_prompts_holding_the_pad_id_are_seen_whole_by_the_oracle(tiny_model_dir):
    """The oracle's generate pads with id 0: without an attention mask, HF masked every prompt
    token equal to it, and a prompt holding one looked like a mismatch of ours."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = [5, 0, 7, 0, 9, 11, 0, 13]
    _, logprobs = hf_greedy(hf, prompt, 1)
    with torch.no_grad():
        plain = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    torch.testing.assert_close(logprobs[0], plain)
    out = LLM(str(tiny_model_dir), dtype="float32").generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert abs(out.logprobs[0][out.token_ids[0]] - plain.max().item()) < 1e-4
