"""Sequence classifiers and scoring: LLM.classify / LLM.score against HF transformers'
AutoModelForSequenceClassification and text-classification pipeline, and the /classify,
/score and /rerank routes against the offline engine."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import transformers

from engine import LLM
from tests.helpers import ON_CUDA, make_tiny_model_dir

PROMPTS = [[5 + (i * 7 + j) % 300 for j in range(n)] for i, n in enumerate((3, 18, 40))]
QUERY = "the quick brown fox"
DOCUMENTS = ["jumps over the lazy dog", "a tale of two cities", "the fox is quick and brown", "zebra"]


def score_values(outputs) -> list[float]:
    """LLM.score's outputs (vLLM's ScoringRequestOutput shape) as plain scores."""
    return [o.outputs.score for o in outputs]


def _classifier_dir(root, architecture: str, num_labels: int, **config):
    return make_tiny_model_dir(root / architecture, architecture=architecture, head_dim=32,
                               extra_config={"num_labels": num_labels, **config})


@pytest.fixture(scope="module")
def three_classes(tmp_path_factory):
    return _classifier_dir(tmp_path_factory.mktemp("cls"), "Qwen2ForSequenceClassification", 3)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return _classifier_dir(tmp_path_factory.mktemp("cls"), "LlamaForSequenceClassification", 1)


def _hf_logits(folder) -> list[torch.Tensor]:
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0] for p in PROMPTS]


@pytest.mark.parametrize("architecture", ["Qwen2ForSequenceClassification", "Gemma3TextForSequenceClassification",
                                          "Qwen3MoeForSequenceClassification"])
@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 7, "block_size": 4}, ON_CUDA])
def test_class_logits_equal_hf(tmp_path, architecture, config):
    """The last token's final hidden state through the score head equals HF's logits within 1e-5,
    in one batch and in 7-token chunks; a repeat served from the prefix cache too."""
    folder = _classifier_dir(tmp_path, architecture, 3)
    expected = _hf_logits(folder)
    llm = LLM(str(folder), dtype="float32", **config)
    for _ in range(2):
        outs = llm.classify(PROMPTS, use_tqdm=False)
        for out, reference in zip(outs, expected, strict=True):
            torch.testing.assert_close(torch.tensor(out.outputs.logits), reference, atol=1e-5, rtol=1e-5)
            assert out.outputs.labels == ("LABEL_0", "LABEL_1", "LABEL_2")
    assert llm.stats().prefix_cache_hits > 0 and llm.stats().num_blocks_used == 0


@pytest.mark.parametrize("labels", [3, 1, "multi"])
def test_probabilities_and_labels_are_the_text_classification_pipelines(tmp_path, labels):
    """Softmax over exclusive classes, a sigmoid for one class or for multi-label (HF's
    problem_type), the class names from id2label: as transformers' pipeline gives them."""
    config = {"id2label": {0: "negative", 1: "neutral", 2: "positive"}} if labels == 3 else {}
    if labels == "multi":
        config = {"problem_type": "multi_label_classification"}
    folder = _classifier_dir(tmp_path, "Qwen2ForSequenceClassification", 1 if labels == 1 else 3, **config)
    texts = ["The quick brown fox", "jumps over the lazy dog"]
    pipe = transformers.pipeline("text-classification", model=str(folder), top_k=None, device="cpu")
    outs = LLM(str(folder), dtype="float32").classify(texts, use_tqdm=False)
    for out, expected in zip(outs, pipe(texts), strict=True):
        by_label = {e["label"]: e["score"] for e in expected}
        assert out.outputs.probs == pytest.approx([by_label[label] for label in out.outputs.labels], abs=1e-5)
        assert out.outputs.label == max(by_label, key=by_label.get)
    if labels == 3:
        assert outs[0].outputs.labels == ("negative", "neutral", "positive")


def test_a_cross_encoder_scores_text_pairs_as_hf_does(cross_encoder, three_classes):
    """A one-class classifier reads each (query, document) pair as the tokenizer pairs them; its
    sigmoid is the score. One text_1 pairs with every text_2, equal lists pair in order."""
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(cross_encoder, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder)

    def hf_score(a: str, b: str) -> float:
        with torch.no_grad():
            return torch.sigmoid(hf(**tokenizer(a, b, return_tensors="pt")).logits[0, 0]).item()

    llm = LLM(str(cross_encoder), dtype="float32")
    scored = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert score_values(scored) == pytest.approx([hf_score(QUERY, d) for d in DOCUMENTS], abs=1e-6)
    assert [o.prompt_token_ids for o in scored] == [tokenizer(QUERY, d)["input_ids"] for d in DOCUMENTS]
    assert score_values(llm.score(DOCUMENTS[:2], DOCUMENTS[2:], use_tqdm=False)) == pytest.approx(
        [hf_score(DOCUMENTS[0], DOCUMENTS[2]), hf_score(DOCUMENTS[1], DOCUMENTS[3])], abs=1e-6)
    with pytest.raises(ValueError, match="give one text_1, or as many as text_2"):
        llm.score(DOCUMENTS[:2], DOCUMENTS, use_tqdm=False)
    with pytest.raises(ValueError, match="one-class classifier"):
        LLM(str(three_classes), dtype="float32").score(QUERY, DOCUMENTS, use_tqdm=False)


def test_an_embedding_model_scores_by_the_cosine_of_its_embeddings(tmp_path):
    folder = make_tiny_model_dir(tmp_path / "qwen3", architecture="Qwen3ForCausalLM", head_dim=32)
    hf = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)

    def last_hidden(text: str) -> torch.Tensor:
        with torch.no_grad():
            return hf(**tokenizer(text, return_tensors="pt")).last_hidden_state[0, -1]

    expected = [torch.cosine_similarity(last_hidden(QUERY), last_hidden(d), dim=0).item() for d in DOCUMENTS]
    assert score_values(LLM(str(folder), dtype="float32").score(QUERY, DOCUMENTS, use_tqdm=False)) == pytest.approx(expected,
                                                                                                   abs=1e-5)


def test_a_classifier_only_classifies_and_quantize_refuses_it(three_classes, tiny_model_dir, tmp_path, capsys):
    from calibration.cli import main as quantize
    from engine import SamplingParams
    from tests.calibration.factories import write_calib_file

    llm = LLM(str(three_classes), dtype="float32")
    with pytest.raises(ValueError, match="sequence classifier: it classifies and scores"):
        llm.generate(PROMPTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="no token logprobs"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=1, pooling="mean"), use_tqdm=False)
    with pytest.raises(ValueError, match="LLM.classify and LLM.score, not embed"):
        llm.embed(PROMPTS[0], use_tqdm=False)
    with pytest.raises(ValueError, match="needs a sequence classifier"):
        LLM(str(tiny_model_dir), dtype="float32").classify(PROMPTS[0], use_tqdm=False)
    calib = write_calib_file(tmp_path / "calib.jsonl", 8)
    assert quantize([str(three_classes), "--calib", str(calib), "-o", str(tmp_path / "q"), "--scheme", "w8a16"]) == 2
    assert "is a sequence classifier (Qwen2ForSequenceClassification)" in capsys.readouterr().err


def _live(folder, **config):
    from engine import AsyncEngine, EngineConfig
    from engine.loader import read_config
    from engine.pooling import classifier_config
    from server.app import build_app
    from server.config import ServerConfig
    from tests.server.live import serve_in_thread

    engine = AsyncEngine(EngineConfig(model=str(folder), num_kv_blocks=64))
    engine.start()
    app = build_app(engine, ServerConfig(served_model_name="m", classifier=classifier_config(read_config(folder)),
                                         **config))
    return engine, serve_in_thread(app)


def test_the_classify_score_and_rerank_routes_answer_as_vllm_does(cross_encoder, three_classes):
    """/classify gives each input's label and probabilities; /score and /rerank (and their /v1,
    /v2 paths) the cross-encoder's scores, rerank best first and cut to top_n; usage counts the
    pairs' tokens. Each equals the offline engine; /pooling gives a classifier's probabilities."""
    offline = LLM(str(cross_encoder), dtype="float32")
    scores = score_values(offline.score(QUERY, DOCUMENTS, use_tqdm=False))
    engine, serving = _live(cross_encoder)
    try:
        with serving as url:
            reply = httpx.post(url + "/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
            assert [d["index"] for d in reply["data"]] == [0, 1, 2, 3] and reply["model"] == "m"
            assert [d["score"] for d in reply["data"]] == pytest.approx(scores, abs=1e-5)
            pair_tokens = sum(len(offline.tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
            assert reply["usage"]["prompt_tokens"] == pair_tokens
            again = httpx.post(url + "/v1/score", json={"text_1": [QUERY], "text_2": DOCUMENTS}).json()
            assert again["data"] == reply["data"] and again["usage"] == reply["usage"]
            for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
                ranked = httpx.post(url + path, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
                best = sorted(range(4), key=lambda i: -scores[i])[:2]
                assert [r["index"] for r in ranked["results"]] == best
                assert [r["document"]["text"] for r in ranked["results"]] == [DOCUMENTS[i] for i in best]
                assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
                    [scores[i] for i in best], abs=1e-5)
                assert ranked["usage"]["total_tokens"] == pair_tokens
            everything = httpx.post(url + "/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
            assert len(everything["results"]) == 4
            for body, route in (({"query": QUERY, "documents": DOCUMENTS}, "/rerank"),
                                ({"text_1": QUERY, "text_2": DOCUMENTS}, "/score")):  # SageMaker's one route
                invoked = httpx.post(url + "/invocations", json=body).json()
                direct = httpx.post(url + route, json=body).json()
                assert invoked["results" if route == "/rerank" else "data"] == direct[
                    "results" if route == "/rerank" else "data"]
            one_class = httpx.post(url + "/classify", json={"input": DOCUMENTS[0]}).json()["data"][0]
            assert one_class["num_classes"] == 1 and one_class["label"] == "LABEL_0"
            for path, body, param, status in (
                    ("/score", {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS}, None, 400),
                    ("/rerank", {"query": QUERY, "documents": []}, "documents", 400),
                    ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "model": "other"}, "model", 404),
                    ("/v1/embeddings", {"input": QUERY}, "model", 400),
                    ("/v1/completions", {"prompt": QUERY, "max_tokens": 2}, None, 400)):
                refused = httpx.post(url + path, json=body)
                assert refused.status_code == status, (path, refused.text)
                error = refused.json()["error"]
                assert param is None or (error["param"] or "").startswith(param), (path, error)
    finally:
        engine.shutdown()

    offline = LLM(str(three_classes), dtype="float32")
    expected = offline.classify(DOCUMENTS, use_tqdm=False)
    engine, serving = _live(three_classes)
    try:
        with serving as url:
            reply = httpx.post(url + "/classify", json={"input": DOCUMENTS}).json()
            assert [d["label"] for d in reply["data"]] == [e.outputs.label for e in expected]
            for item, reference in zip(reply["data"], expected, strict=True):
                assert item["probs"] == pytest.approx(reference.outputs.probs, abs=1e-5) and item["num_classes"] == 3
            assert reply["usage"]["prompt_tokens"] == sum(len(e.prompt_token_ids) for e in expected)
            invoked = httpx.post(url + "/invocations", json={"input": DOCUMENTS}).json()  # a classifier classifies
            assert invoked["data"] == reply["data"]
            refused = httpx.post(url + "/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
            assert refused.status_code == 400 and "one-class classifier" in refused.json()["error"]["message"]
            pooled = httpx.post(url + "/pooling", json={"input": DOCUMENTS}).json()  # classify: the default here
            assert [d["object"] for d in pooled["data"]] == ["pooling"] * 4
            assert [d["data"] for d in pooled["data"]] == [d["probs"] for d in reply["data"]]
            for body in ({"input": QUERY, "task": "embed"}, {"input": QUERY, "dimensions": 2}):
                refused = httpx.post(url + "/pooling", json=body)
                assert refused.status_code == 400, body
    finally:
        engine.shutdown()


def test_score_and_rerank_on_an_embedding_model_use_cosines(tiny_model_dir):
    """On a generative model served for embeddings, /score and /rerank rank by the cosine of the
    embeddings (as LLM.score), and /classify is a 400 that says it needs a classifier."""
    scores = score_values(LLM(str(tiny_model_dir), dtype="float32").score(QUERY, DOCUMENTS, use_tqdm=False))
    engine, serving = _live(tiny_model_dir)
    try:
        with serving as url:
            reply = httpx.post(url + "/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
            assert [d["score"] for d in reply["data"]] == pytest.approx(scores, abs=1e-5)
            ranked = httpx.post(url + "/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
            assert [r["index"] for r in ranked["results"]] == sorted(range(4), key=lambda i: -scores[i])
            refused = httpx.post(url + "/classify", json={"input": QUERY})
            assert refused.status_code == 400 and "needs a sequence classifier" in json.dumps(refused.json())
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("tied", "dtype"), [(True, torch.float32), (False, torch.float32), (False, torch.bfloat16)])
def test_a_causal_lm_served_as_a_classifier_from_its_tokens_logits(tmp_path, tied, dtype):
    """vLLM's hf_overrides with classifier_from_token: the score head is the LM head's rows for
    those tokens (their logits, as HF's causal LM gives them), or for Qwen3-Reranker the "yes"
    row less the "no" row, whose sigmoid is the reranker card's softmax([no, yes])[yes]. (An
    untied BF16 table served in fp32 is held in bf16: the rows are taken as the model computes.)"""
    folder = make_tiny_model_dir(tmp_path / "qwen3", architecture="Qwen3ForCausalLM", head_dim=32,
                                 tie_word_embeddings=tied, dtype=dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokens = tokenizer.convert_ids_to_tokens([200, 201, 202])

    def last_logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1]

    as_classifier = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens}
    outs = LLM(str(folder), dtype="float32", hf_overrides=as_classifier).classify(PROMPTS, use_tqdm=False)
    for out, prompt in zip(outs, PROMPTS, strict=True):
        torch.testing.assert_close(torch.tensor(out.outputs.logits), last_logits(prompt)[[200, 201, 202]], atol=1e-5,
                                   rtol=1e-5)
        assert out.outputs.labels == tuple(tokens)
    reranker = {**as_classifier, "classifier_from_token": tokens[:2], "is_original_qwen3_reranker": True}
    scores = score_values(LLM(str(folder), dtype="float32", hf_overrides=json.dumps(reranker)).score(
        QUERY, DOCUMENTS, use_tqdm=False))
    expected = [torch.softmax(last_logits(tokenizer(QUERY, d)["input_ids"])[[200, 201]], dim=0)[1].item()
                for d in DOCUMENTS]
    assert scores == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="does not hold as tokens"):
        LLM(str(folder), dtype="float32", hf_overrides={**as_classifier, "classifier_from_token": ["no such token"]})
    with pytest.raises(ValueError, match="hf_overrides: expected a JSON object, got a JSON list"):
        LLM(str(folder), hf_overrides="[1]")


def test_classifier_from_token_on_a_checkpoint_with_its_own_score_head_is_an_error(tmp_path):
    folder = make_tiny_model_dir(tmp_path / "classifier", architecture="Qwen2ForSequenceClassification",
                                 extra_config={"num_labels": 2})
    with pytest.raises(ValueError, match="classifier_from_token makes the score head, but the checkpoint holds one"):
        LLM(str(folder), hf_overrides={"classifier_from_token": ["a", "b"]})
