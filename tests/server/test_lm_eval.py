"""lm-eval's `local-completions` against the live server scores exactly like the engine in-process.

This is the path the gate's users take with an external harness: echo + logprobs on the
completions route. A server that returned generated-token logprobs only would still "work"
and silently score at chance; comparing per-item log-likelihoods catches that.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.sampling_params import SamplingParams
from tests.server.conftest import MODEL_NAME

DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "London", "Rome"], "answer": 0},
    {"question": "The quick brown fox jumps over the", "choices": ["lazy dog.", "moon", "scheduler"], "answer": 0},
    {"question": "Paged attention stores keys and values in", "choices": ["blocks", "fixed-size blocks."], "answer": 1},
    {"question": "0 1 2 3 4 5 6", "choices": ["7", "8 9", "+ - * /"], "answer": 0},
    {"question": "A scheduler admits waiting requests while", "choices": ["running ones decode.", "Paris"], "answer": 0},
]
TASK = """task: dg_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def _in_process_loglikelihood(llm, tokenizer, context: str, continuation: str) -> float:
    """Sum of log p(continuation | context), split into tokens exactly as lm-eval splits them."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_len = len(tokenizer.encode(context, add_special_tokens=False))
    out = llm.generate([whole], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
    return sum(out.prompt_logprobs[i][whole[i]] for i in range(context_len, len(whole)))


def test_local_completions_matches_engine(tmp_path: Path, base_url: str, tiny_model_dir: Path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "")
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from engine import LLM

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "dg_tiny_mc.yaml").write_text(TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL_NAME, "base_url": f"{base_url}/v1/completions", "tokenizer": str(tiny_model_dir),
                    "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1},
        tasks=["dg_tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
    )
    samples = results["samples"]["dg_tiny_mc"]
    assert len(samples) == len(DOCS)
    llm = LLM(str(tiny_model_dir), seed=0)
    tokenizer = llm.tokenizer
    compared = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            served = resp[0][0]
            expected = _in_process_loglikelihood(llm, tokenizer, context, continuation)
            assert served == pytest.approx(expected, abs=1e-3), (context, continuation)
            compared += 1
    assert compared == sum(len(d["choices"]) for d in DOCS)
