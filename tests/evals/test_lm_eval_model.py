"""The lm-eval adapter on the tiny random model, checked against HF transformers as the oracle."""

from __future__ import annotations

import os

import pytest
import torch
from lm_eval.api.instance import Instance

from tests.helpers import make_tiny_model_dir

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def lm(model_dir):
    from evals.lm_eval_model import DriftgateLM

    return DriftgateLM(str(model_dir), max_model_len=128)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_logprobs(hf_model, tokens):
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)  # [T, V]; row t predicts token t + 1


def _instance(kind, args, idx=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=idx, metadata=("t", idx, 1))


def test_loglikelihood_matches_transformers(lm, hf_model):
    pairs = [("The quick brown", " fox jumps"), ("The quick brown", " dog"), ("Paged attention stores", " keys")]
    results = lm.loglikelihood([_instance("loglikelihood", p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    for (context, continuation), (logprob, is_greedy) in zip(pairs, results, strict=True):
        ctx = lm.tok_encode(context)
        cont = lm.tok_encode(context + continuation)[len(ctx):]
        ref = _hf_logprobs(hf_model, ctx + cont)
        expected = sum(ref[len(ctx) + j - 1, tok].item() for j, tok in enumerate(cont))
        greedy = all(ref[len(ctx) + j - 1].argmax().item() == tok for j, tok in enumerate(cont))
        assert logprob == pytest.approx(expected, abs=1e-3)
        assert is_greedy == greedy


def test_is_greedy_true_for_the_models_own_argmax(lm, hf_model):
    # Use the first context whose argmax token re-encodes to itself after the context (BPE merges
    # across the boundary can change it); the fixed tiny model has several such contexts.
    for context in ("The quick brown", "Paged attention stores", "A scheduler admits", "What is the capital"):
        ctx = lm.tok_encode(context)
        best = int(_hf_logprobs(hf_model, ctx)[-1].argmax())
        continuation = lm.tok_decode([best])
        if lm.tok_encode(context + continuation)[len(ctx):] == [best]:
            break
    else:
        raise AssertionError("no test context whose argmax token round-trips through the tokenizer")
    [(_, is_greedy)] = lm.loglikelihood([_instance("loglikelihood", (context, continuation))], disable_tqdm=True)
    assert is_greedy


def test_loglikelihood_rolling_scores_every_token_once(lm, hf_model):
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)  # longer than one window
    tokens = lm.tok_encode(text)
    assert len(tokens) > lm.max_score_len
    [total] = lm.loglikelihood_rolling([_instance("loglikelihood_rolling", (text,))], disable_tqdm=True)
    # Oracle: the same disjoint windows, each scored by transformers.
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    expected = 0.0
    windows = get_rolling_token_windows(tokens, lm.prefix_token_id, lm.max_score_len - 1, 1)
    for context, predicted in map(make_disjoint_window, windows):
        ref = _hf_logprobs(hf_model, context + predicted)
        start = len(context)
        expected += sum(ref[start + j - 1, tok].item() for j, tok in enumerate(predicted))
    assert total == pytest.approx(expected, rel=1e-4)


def test_generate_until_is_greedy_and_cut_at_stop(lm, hf_model):
    context = "What is the capital"
    [free] = lm.generate_until([_instance("generate_until", (context, {"until": [], "max_gen_toks": 12}))],
                               disable_tqdm=True)
    ctx = lm.tok_encode(context)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ctx]), max_new_tokens=12, do_sample=False)[0, len(ctx):]
    expected = lm.tok_decode(ref.tolist())
    assert expected.startswith(free)  # the engine may stop early at EOS
    record = lm.generations[context]
    assert record.hit_max_tokens == (record.finish_reason == "length")
    if len(free) > 3:
        stop = free[2:4]
        [cut] = lm.generate_until(
            [_instance("generate_until", (context, {"until": [stop], "max_gen_toks": 12}))], disable_tqdm=True)
        assert cut == free[: free.find(stop)]


def test_registered_under_the_driftgate_name(model_dir):
    from lm_eval.api.registry import get_model

    import evals.lm_eval_model  # noqa: F401  (registers the class)

    cls = get_model("driftgate")
    lm = cls.create_from_arg_string(f"pretrained={model_dir},max_model_len=64", {"batch_size": 8})
    assert lm.chunk_size == 8 and lm.max_length == 64
