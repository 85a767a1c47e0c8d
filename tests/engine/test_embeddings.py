"""Embeddings: the engine's pooled final hidden states against HF's base model, the model's own
pooling config, headless checkpoints, and the OpenAI /v1/embeddings route."""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModel

from engine import LLM, SamplingParams
from engine.pooling import PoolingConfig, pooling_config
from tests.helpers import ON_CUDA, make_tiny_model_dir

PROMPTS = [[5 + (i * 7 + j) % 300 for j in range(n)] for i, n in enumerate((3, 18, 40))]


def _hf_pooled(model, prompt: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    return {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("embed") / "qwen3", architecture="Qwen3ForCausalLM", head_dim=32)


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 7, "block_size": 4}, ON_CUDA])
def test_every_pooling_equals_hf_base_models_hidden_states(qwen3_dir, config):
    """Last-token, mean and first-token pooling of the final norm's output, in one batch and in
    7-token chunks, equal HF's AutoModel within 1e-5; a repeat served from the prefix cache too."""
    hf = AutoModel.from_pretrained(qwen3_dir, dtype=torch.float32)
    llm = LLM(str(qwen3_dir), dtype="float32", **config)
    for pooling in ("last", "mean", "cls", "last", "mean"):
        outs = llm.embed(PROMPTS, pooling=pooling, normalize=False, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), _hf_pooled(hf, prompt, pooling),
                                       atol=1e-5, rtol=1e-5)
            assert out.finished and out.prompt_token_ids == prompt
    assert llm.stats().prefix_cache_hits > 0  # the repeated last-token run hit; mean pooling never does
    assert llm.stats().num_blocks_used == 0


def test_embeddings_and_generations_share_a_batch(qwen3_dir):
    """Embedding requests finish with their prompt while generations beside them decode on."""
    llm = LLM(str(qwen3_dir), dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    embedded = llm.embed(PROMPTS, pooling="mean", use_tqdm=False)
    mixed = llm.generate(PROMPTS * 2, [greedy] * 3 + [SamplingParams(max_tokens=1, pooling="mean")] * 3,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for out, reference in zip(mixed[3:], embedded, strict=True):
        normalized = torch.nn.functional.normalize(torch.tensor(out.embedding), dim=0)
        torch.testing.assert_close(normalized, torch.tensor(reference.outputs.embedding), atol=1e-5, rtol=1e-5)


def test_a_headless_checkpoint_embeds_with_its_sentence_transformers_pooling(qwen3_dir, tmp_path):
    """An AutoModel checkpoint (keys without "model.", no head), pooled as its modules.json and
    Pooling config say (mean, normalized), as embedding models ship."""
    hf = AutoModel.from_pretrained(qwen3_dir, dtype=torch.float32)
    folder = tmp_path / "embedder"
    hf.save_pretrained(folder)
    for tokenizer_file in qwen3_dir.glob("tokenizer*"):
        shutil.copy(tokenizer_file, folder)
    assert pooling_config(folder) == PoolingConfig("last", True)  # no sentence-transformers files
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True,
                                                                  "pooling_mode_lasttoken": False}))
    assert pooling_config(folder) == PoolingConfig("mean", True)
    out = LLM(str(folder), dtype="float32").embed(PROMPTS[1:], use_tqdm=False)[0]
    expected = torch.nn.functional.normalize(_hf_pooled(hf, PROMPTS[1], "mean"), dim=0)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-5, rtol=1e-5)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True,
                                                                  "pooling_mode_cls_token": True}))
    with pytest.raises(ValueError, match="exactly one of"):
        pooling_config(folder)


def _sentence_transformers_folder(qwen3_dir, folder, modules: list[tuple[str, str]]):
    """A headless checkpoint with these (type, path) sentence-transformers modules after its Transformer."""
    hf = AutoModel.from_pretrained(qwen3_dir, dtype=torch.float32)
    hf.save_pretrained(folder)
    for tokenizer_file in qwen3_dir.glob("tokenizer*"):
        shutil.copy(tokenizer_file, folder)
    listed = [("Transformer", ""), *modules]
    (folder / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate(listed)]))
    return hf


def test_dense_projections_after_the_pooling_are_applied(qwen3_dir, tmp_path):
    """EmbeddingGemma's and LaBSE's layout: Pooling, Dense modules (here 64 → 48 with tanh, then
    48 → 32), Normalize. Their projections were skipped: 64 values, not the model's 32."""
    from safetensors.torch import save_file

    folder = tmp_path / "dense"
    hf = _sentence_transformers_folder(qwen3_dir, folder, [("Pooling", "1_Pooling"), ("Dense", "2_Dense"),
                                                           ("Dense", "3_Dense"), ("Normalize", "4_Normalize")])
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    g = torch.Generator().manual_seed(0)
    layers = [(64, 48, "torch.nn.modules.activation.Tanh", True), (48, 32, "torch.nn.modules.linear.Identity", False)]
    expected = _hf_pooled(hf, PROMPTS[1], "mean")
    for (n_in, n_out, activation, bias), path in zip(layers, ("2_Dense", "3_Dense"), strict=True):
        (folder / path).mkdir()
        (folder / path / "config.json").write_text(json.dumps({"in_features": n_in, "out_features": n_out,
                                                               "bias": bias, "activation_function": activation}))
        weights = {"linear.weight": torch.randn(n_out, n_in, generator=g)}
        if bias:
            weights["linear.bias"] = torch.randn(n_out, generator=g)
        save_file(weights, str(folder / path / "model.safetensors"))
        expected = torch.nn.functional.linear(expected, weights["linear.weight"], weights.get("linear.bias"))
        expected = torch.tanh(expected) if activation.endswith("Tanh") else expected
    llm = LLM(str(folder), dtype="float32")
    out = llm.embed(PROMPTS[1:2], use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(out), torch.nn.functional.normalize(expected, dim=0), atol=1e-5, rtol=1e-5)
    first, second = (torch.tensor(o.outputs.embedding) for o in llm.embed(["a b", "a b c"], use_tqdm=False))
    (score,) = llm.score("a b", "a b c", use_tqdm=False)  # the cosine of the projected embeddings
    assert score.outputs.score == pytest.approx(float(first @ second), abs=1e-5)
    save_file({"linear.weight": torch.randn(32, 40, generator=g)}, str(folder / "3_Dense" / "model.safetensors"))
    with pytest.raises(ValueError, match="3_Dense: a Dense module taking 40 values where 48 come"):
        pooling_config(folder)  # refused at load, not a 500 on every request


@pytest.mark.parametrize(("modules", "pooling", "says"), [
    ([("Pooling", "1_Pooling"), ("LayerNorm", "2_LayerNorm")], {"pooling_mode_mean_tokens": True},
     "lists a LayerNorm module"),
    ([("Pooling", "1_Pooling")], {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True},
     "exactly one of"),
    ([("Pooling", "1_Pooling")], {"pooling_mode_mean_tokens": True, "include_prompt": False}, "include_prompt"),
])
def test_modules_and_modes_it_would_not_apply_are_refused(qwen3_dir, tmp_path, modules, pooling, says):
    """An embedding answered without one of its modules (or with another pooling) is a wrong
    answer that looks right; the folder is refused, saying what."""
    _sentence_transformers_folder(qwen3_dir, tmp_path, modules)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with pytest.raises(ValueError, match=says):
        pooling_config(tmp_path)


def test_the_embeddings_route_answers_as_openai_does(qwen3_dir):
    """Text, token ids and lists of either; float or base64; Matryoshka `dimensions`
    (truncated, then normalized); usage; 400s for a bad input or too many dimensions. vLLM's
    /pooling gives the same vectors."""
    import openai

    from engine import AsyncEngine, EngineConfig
    from server.app import build_app
    from server.config import ServerConfig
    from tests.server.live import serve_in_thread

    engine = AsyncEngine(EngineConfig(model=str(qwen3_dir), num_kv_blocks=64))
    engine.start()
    offline = LLM(str(qwen3_dir), dtype="float32")
    try:
        with serve_in_thread(build_app(engine, ServerConfig(served_model_name="embedder"))) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            texts = ["The quick brown fox", "jumps over the lazy dog"]
            reply = client.embeddings.create(model="embedder", input=texts)
            expected = offline.embed(texts, use_tqdm=False)
            assert [d.index for d in reply.data] == [0, 1]
            for item, reference in zip(reply.data, expected, strict=True):
                assert item.embedding == pytest.approx(reference.outputs.embedding, abs=1e-5)
            assert reply.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
            ids = client.embeddings.create(model="embedder", input=PROMPTS[1]).data[0].embedding
            assert ids == pytest.approx(offline.embed([PROMPTS[1]], use_tqdm=False)[0].outputs.embedding, abs=1e-5)
            short = httpx.post(url + "/v1/embeddings", json={"input": texts[0], "dimensions": 16,
                                                             "encoding_format": "base64"}).json()
            vector = np.frombuffer(base64.b64decode(short["data"][0]["embedding"]), dtype="<f4")
            truncated = torch.tensor(expected[0].outputs.embedding[:16])  # normalized whole, then cut ...
            assert vector == pytest.approx((truncated / truncated.norm()).tolist(), abs=1e-5)  # ... and renormed
            for body, param, status in (({"input": texts[0], "dimensions": 4096}, "dimensions", 400),
                                        ({"input": []}, "input", 400), ({"input": [10**9]}, "input", 400),
                                        ({"input": "x", "model": "other"}, "model", 404)):
                refused = httpx.post(url + "/v1/embeddings", json=body)
                assert refused.status_code == status and (refused.json()["error"]["param"] or "").startswith(param), body
            # vLLM's /pooling: the same vectors in its pooling shape (the embed task is the default here)
            pooled = httpx.post(url + "/pooling", json={"input": texts, "dimensions": 16}).json()
            assert pooled["object"] == "list" and pooled["id"].startswith("pool-") and pooled["model"] == "embedder"
            assert [(d["index"], d["object"]) for d in pooled["data"]] == [(0, "pooling"), (1, "pooling")]
            assert pooled["data"][0]["data"] == pytest.approx(vector.tolist(), abs=1e-5)
            assert pooled["usage"]["prompt_tokens"] == reply.usage.prompt_tokens
            embed = httpx.post(url + "/pooling", json={"input": texts[1], "task": "embed"}).json()["data"][0]["data"]
            assert embed == pytest.approx(expected[1].outputs.embedding, abs=1e-5)
            for body, param in (({"input": texts[0], "task": "classify"}, "model"),
                                ({"input": texts[0], "task": "token_embed"}, "task")):
                refused = httpx.post(url + "/pooling", json=body)
                assert refused.status_code == 400 and (refused.json()["error"]["param"] or "").startswith(param), body
    finally:
        engine.shutdown()
