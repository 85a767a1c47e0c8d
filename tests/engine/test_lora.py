"""LoRA adapters over one base model, against PEFT's own model as the oracle."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, LoRARequest, SamplingParams, host_memory
from tests.helpers import ON_CUDA, make_tiny_model_dir, write_lora_adapter
from tests.oracle import assert_outputs_match_hf, hf_greedy

peft = pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
PROMPTS = [[5 + (i * 7 + j) % 300 for j in range(n)] for i, n in enumerate((3, 18, 40))]
# adapter → (target modules, rank, rsLoRA): between them every projection, q/k/v and gate/up split
ADAPTERS = {"a": (["q_proj", "v_proj", "gate_proj", "down_proj"], 4, False),
            "b": (["k_proj", "o_proj", "up_proj"], 8, True)}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model_dir(root / "base")
    folders = {name: write_lora_adapter(base, root / name, targets, rank, rslora=rslora, seed=i)
               for i, (name, (targets, rank, rslora)) in enumerate(ADAPTERS.items())}
    return base, folders


def _peft_reference(base, folder, prompts, **load):
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **load)
    if folder is not None:
        model = peft.PeftModel.from_pretrained(model, folder)
    return [hf_greedy(model.eval(), p, GREEDY.max_tokens) for p in prompts]


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 7, "block_size": 4}, ON_CUDA])
def test_one_batch_of_several_adapters_answers_as_peft(adapters, config):
    """Every prompt under adapter a, adapter b and none, all in one batch (and chunked), gives
    PEFT's greedy tokens and logprobs."""
    base, folders = adapters
    choices = [None, *folders]
    reference = {name: _peft_reference(base, folders.get(name), PROMPTS) for name in choices}
    llm = LLM(str(base), dtype="float32", enable_lora=True, **config)
    requests = {name: LoRARequest(name, i + 1, str(folder)) for i, (name, folder) in enumerate(folders.items())}
    prompts = [p for _ in choices for p in PROMPTS]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[requests.get(name) for name in choices for _ in PROMPTS])
    for k, name in enumerate(choices):
        mine = outs[k * len(PROMPTS):(k + 1) * len(PROMPTS)]
        assert_outputs_match_hf(mine, reference[name], f"adapter {name}{config}")
        for out, (tokens, logprobs) in zip(mine, reference[name], strict=True):
            ours = [lp[t] for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids, strict=True)]
            theirs = [row[t].item() for row, t in zip(logprobs, tokens, strict=True)]
            assert ours == pytest.approx(theirs, abs=1e-4)
    assert llm.engine.model.fused_decode is not None  # steps without adapter rows keep the C decode step


def test_adapters_never_share_cached_prompt_blocks(adapters):
    """The KV of a prompt under one adapter is not the base model's, nor another adapter's."""
    base, folders = adapters
    llm = LLM(str(base), dtype="float32", lora_modules={name: str(f) for name, f in folders.items()})
    prompt = PROMPTS[2]  # two full 16-token blocks
    cached = []
    for lora in (None, "a", "b", "a"):
        request = None if lora is None else LoRARequest(lora, 0, str(folders[lora]))
        cached.append(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request)[0].num_cached_tokens)
    assert cached == [0, 0, 0, 32]


def test_an_adapter_serves_over_a_quantized_base(adapters, tmp_path):
    """LoRA over a w8a16 checkpoint: HF with compressed-tensors under PEFT answers the same."""
    from calibration.cli import main
    from tests.calibration.factories import write_calib_file

    base, folders = adapters
    quantized = tmp_path / "w8a16"
    assert main([str(base), "--calib", str(write_calib_file(tmp_path / "calib.jsonl", 8)), "-o", str(quantized),
                 "--scheme", "w8a16", "--num-samples", "4", "--num-heldout", "2"]) == 0
    from transformers import CompressedTensorsConfig

    # decompressed into plain Linears, which PEFT can wrap
    reference = _peft_reference(quantized, folders["a"], PROMPTS,
                                quantization_config=CompressedTensorsConfig(run_compressed=False))
    llm = LLM(str(quantized), dtype="float32", lora_modules={"a": str(folders["a"])})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(folders["a"])))
    assert_outputs_match_hf(outs, reference, "a over w8a16")


def test_an_adapter_over_a_mixture_of_experts(tmp_path):
    """Attention and the shared expert take adapters in a MoE model too (PEFT's answers); its
    routed experts see gathered rows, and an adapter naming them is refused."""
    base = make_tiny_model_dir(tmp_path / "moe", architecture="Qwen2MoeForCausalLM", extra_config={
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "shared_expert_intermediate_size": 96})
    folder = write_lora_adapter(base, tmp_path / "adapter", ["q_proj", "o_proj", "shared_expert.up_proj"], seed=4)
    llm = LLM(str(base), dtype="float32", lora_modules={"a": str(folder)})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(folder)))
    assert_outputs_match_hf(outs, _peft_reference(base, folder, PROMPTS), "moe adapter")
    shutil.copytree(folder, tmp_path / "experts")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    renamed = {k.replace("shared_expert.", "experts.0."): v for k, v in tensors.items()}
    save_file(renamed, str(tmp_path / "experts" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="experts.0.up_proj' is none of the attention and MLP projections"):
        llm.engine.add_lora(LoRARequest("experts", 2, str(tmp_path / "experts")))


def _edit_config(folder, **changes):
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))


def test_bad_adapters_and_requests_are_clear_errors(adapters, tmp_path):
    base, folders = adapters
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        llm.engine.add_request(None, PROMPTS[0], GREEDY, lora="nope")
    with pytest.raises(ValueError, match="rank 8 .* exceeds max_lora_rank=4"):
        llm.engine.add_lora(LoRARequest("b", 2, str(folders["b"])))
    with pytest.raises(ValueError, match="LoRA adapter folder not found"):
        llm.engine.add_lora(LoRARequest("gone", 3, str(tmp_path / "gone")))
    dora = shutil.copytree(folders["a"], tmp_path / "dora")
    _edit_config(dora, use_dora=True)
    with pytest.raises(ValueError, match="use_dora is not supported"):
        llm.engine.add_lora(LoRARequest("dora", 4, str(dora)))
    embed = write_lora_adapter(base, tmp_path / "embed", ["embed_tokens"], seed=3)
    with pytest.raises(ValueError, match="embed_tokens"):
        llm.engine.add_lora(LoRARequest("embed", 5, str(embed)))
    llm.engine.add_lora(LoRARequest("a", 1, str(folders["a"])))
    with pytest.raises(ValueError, match="already loaded from"):
        llm.engine.add_lora(LoRARequest("a", 1, str(folders["b"])))
    assert llm.engine.lora.adapters == {"a": 0}  # the refused ones left nothing behind
    plain = LLM(str(base), dtype="float32")
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, str(folders["a"])))


def test_an_adapter_unloads_only_when_no_request_uses_it(adapters):
    """Unloading waits for the adapter's requests (refused while one is in flight); a request
    made before the unload but queued after it is refused too, not served by the base model."""
    base, folders = adapters
    engine = LLM(str(base), dtype="float32", lora_modules={"a": str(folders["a"])}).engine
    engine.add_request("busy", PROMPTS[0], GREEDY, lora="a")
    with pytest.raises(ValueError, match="serves 1 request"):
        engine.remove_lora("a")
    engine.abort_request("busy")
    late = engine.make_request("late", PROMPTS[0], GREEDY, lora="a")
    engine.remove_lora("a")
    with pytest.raises(ValueError, match="'a' was unloaded"):
        engine.submit(late)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        engine.add_request(None, PROMPTS[0], GREEDY, lora="a")
    engine.add_lora(LoRARequest("a", 1, str(folders["a"])))  # loads again, under a fresh index
    assert engine.lora.adapters == {"a": 1}


def test_stats_name_the_adapters_running_and_waiting(adapters):
    """What vLLM's lora_requests_info reports: the adapters of the running batch and of the queue."""
    base, folders = adapters
    engine = LLM(str(base), dtype="float32", max_num_seqs=1,
                 lora_modules={name: str(folder) for name, folder in folders.items()}).engine
    assert (engine.stats().running_loras, engine.stats().max_loras) == ((), 2)
    for i, lora in enumerate(("a", "b", None)):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY, lora=lora)
    engine.step()  # one sequence at a time: the first runs, the others wait
    stats = engine.stats()
    assert (stats.running_loras, stats.waiting_loras) == (("a",), ("b",))
    assert LLM(str(base), dtype="float32").engine.stats().max_loras == 0  # LoRA off


def test_an_adapter_loaded_again_under_its_name_gets_no_stale_prefix_hits(adapters):
    """Prefix hashes know adapters by name: unloading one drops the blocks cached under it, so
    another adapter loaded under the same name computes its own KV."""
    base, folders = adapters
    reference = {name: _peft_reference(base, folders[name], PROMPTS[2:]) for name in folders}
    llm = LLM(str(base), dtype="float32", lora_modules={"x": str(folders["a"])}, max_lora_rank=8)
    assert_outputs_match_hf(llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False, lora_request=LoRARequest(
        "x", 1, str(folders["a"]))), reference["a"], "adapter a as x")
    llm.engine.remove_lora("x")
    outs = llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 2, str(folders["b"])))
    assert outs[0].num_cached_tokens == 0
    assert_outputs_match_hf(outs, reference["b"], "adapter b as x")


def test_past_max_cpu_loras_the_least_recently_used_idle_adapter_is_evicted_and_reloaded(adapters):
    """With room for one adapter, asking for a, b, a loads three times and keeps one resident;
    adapters requests hold are never evicted (both stay while one batch uses them); answers stay
    PEFT's, and an evicted adapter's cached prompt blocks still serve hits once it is back."""
    base, folders = adapters
    reference = {name: _peft_reference(base, folders[name], PROMPTS[2:]) for name in folders}
    llm = LLM(str(base), dtype="float32", lora_modules={n: str(f) for n, f in folders.items()}, max_lora_rank=8,
              max_cpu_loras=1)
    lora = llm.engine.lora
    assert list(lora.adapters) == ["b"] and lora.num_loads == 2  # each read once at start, a then evicted
    requests = {name: LoRARequest(name, i + 1, str(folder)) for i, (name, folder) in enumerate(folders.items())}
    llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False, lora_request=requests["b"])  # anything packed on first use
    chunk, offset = host_memory.WEIGHTS._chunk, host_memory.WEIGHTS._offset
    for step, name in enumerate(["a", "b", "a"]):
        outs = llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False, lora_request=requests[name])
        assert_outputs_match_hf(outs, reference[name], f"adapter {name}")
        assert list(lora.adapters) == [name] and lora.num_loads == 3 + step
    # a reloaded adapter's panels are its own memory, freed when it is evicted: they took each
    # reload's size from the engine's weight arena for good (a soak audit saw it grow per reload)
    assert host_memory.WEIGHTS._chunk is chunk and host_memory.WEIGHTS._offset == offset
    assert outs[0].num_cached_tokens > 0  # a's blocks from its first visit
    both = llm.generate(PROMPTS[2:] * 2, GREEDY, use_tqdm=False, lora_request=[requests["a"], requests["b"]])
    for out, name in zip(both, ["a", "b"], strict=True):
        assert_outputs_match_hf([out], reference[name], f"adapter {name} beside the other")
    with pytest.raises(ValueError, match="max_cpu_loras must be at least 1"):
        LLM(str(base), enable_lora=True, max_cpu_loras=0)


def test_generate_cli_answers_through_an_adapter(tiny_model_dir, tiny_lora_dir, tmp_path, capsys):
    from engine.cli import main as driftgate_main

    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    expected = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True).generate(
        ["The quick"], greedy, use_tqdm=False, lora_request=LoRARequest("x", 1, str(tiny_lora_dir)))[0].outputs[0].text
    assert driftgate_main(["generate", str(tiny_model_dir), "The quick", "--max-tokens", "5",
                           "--lora", str(tiny_lora_dir)]) == 0
    assert capsys.readouterr().out == f"### The quick\n{expected}\n\n"
    assert driftgate_main(["generate", str(tiny_model_dir), "The quick", "--lora", str(tmp_path / "none")]) == 2
    assert "LoRA adapter folder not found" in capsys.readouterr().err


def test_a_default_adapter_serves_requests_and_scoring_that_name_none(adapters):
    """default_lora (what `driftgate gate --lora` builds each arm with): generate and
    score_full_logprobs go through it, as PEFT's model scores."""
    base, folders = adapters
    llm = LLM(str(base), dtype="float32", lora_modules={"a": str(folders["a"])}, default_lora="a")
    reference = _peft_reference(base, folders["a"], PROMPTS)
    assert_outputs_match_hf(llm.generate(PROMPTS, GREEDY, use_tqdm=False), reference, "default adapter")
    peft_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                                folders["a"]).eval()
    with torch.no_grad():
        expected = peft_model(torch.tensor([PROMPTS[2]])).logits[0].log_softmax(-1)
    torch.testing.assert_close(llm.score_full_logprobs(PROMPTS[2]), expected, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="default_lora 'b' is not one of lora_modules"):
        LLM(str(base), lora_modules={"a": str(folders["a"])}, default_lora="b")
