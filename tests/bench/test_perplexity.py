"""`driftgate bench ppl`: window plan, perplexity against HF transformers, and the CLI's JSON."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from bench.perplexity import load_tokens, measure, plan_windows
from engine.cli import main as driftgate_main

WORDS = ("the quick brown fox jumps over lazy dog paged attention stores keys and values in blocks "
         "scheduler admits waiting requests quantization maps weights to fewer bits Paris France 0 1 2 3 , . ?").split()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """A few hundred tokens of seeded word salad, so the test needs no shared data."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("ppl") / "text.raw"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(40)), encoding="utf-8")
    return path


@pytest.mark.parametrize("num_tokens,context,stride", [(300, 64, 64), (300, 64, 40), (129, 64, 1), (64, 64, 64),
                                                       (10, 64, 64)])
def test_windows_score_every_token_once_with_context(num_tokens, context, stride):
    windows = plan_windows(num_tokens, context, stride)
    scored = [p for w in windows for p in range(w.end - w.num_scored, w.end)]
    # disjoint windows cannot score their own first token; overlapping ones score every token after the first
    assert scored == [p for p in range(1, num_tokens) if stride < context or p % context]
    for w in windows:
        assert w.end - w.start <= context and w.end - w.num_scored > w.start  # ≥ 1 token of context
    if stride == context:
        assert all(w.start == i * context for i, w in enumerate(windows))  # non-overlapping


@pytest.mark.parametrize("args,match", [((100, 1, 1), "context"), ((100, 8, 9), "stride"), ((100, 8, 0), "stride"),
                                        ((1, 8, 8), "at least 2 tokens")])
def test_bad_window_settings_are_errors(args, match):
    with pytest.raises(ValueError, match=match):
        plan_windows(*args)


def hf_perplexity(model_dir: Path, token_ids: list[int], context: int, stride: int) -> float:
    """exp(mean NLL) straight from HF logits on the same windows: the oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total_nll, count = 0.0, 0
    for w in plan_windows(len(token_ids), context, stride):
        ids = torch.tensor([token_ids[w.start:w.end]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        targets = ids[0, 1:]
        nll = -logprobs[:-1].gather(1, targets[:, None])[:, 0]
        total_nll += nll[-w.num_scored:].sum().item()
        count += w.num_scored
    return math.exp(total_nll / count)


@pytest.mark.parametrize("stride", [64, 40])
def test_perplexity_equals_hf_on_the_same_windows(tiny_model_dir, text_file, stride):
    ours = measure(tiny_model_dir, text_file, max_tokens=300, context=64, stride=stride)
    from engine.tokenizer import load_tokenizer

    token_ids = load_tokens(load_tokenizer(tiny_model_dir), text_file, 300)
    assert ours.scored_tokens == (299 if stride < 64 else 299 - 4)  # disjoint: positions 64, 128, 192, 256 unscored
    assert ours.ppl == pytest.approx(hf_perplexity(tiny_model_dir, token_ids, 64, stride), rel=1e-4)


def test_cli_writes_json_and_appends_compatible_runs(tiny_model_dir, text_file, tmp_path, capsys):
    out = tmp_path / "ppl.json"
    common = ["bench", "ppl", "--data", str(text_file), "--max-tokens", "200", "--context", "64",
              "--result-json", str(out)]
    assert driftgate_main([*common, str(tiny_model_dir), "--labels", "fp32"]) == 0
    assert driftgate_main([*common, str(tiny_model_dir), "--labels", "again", "--append",
                           "--plot", str(tmp_path / "ppl.png")]) == 0
    assert (tmp_path / "ppl.png").stat().st_size > 0
    report = json.loads(out.read_text())
    assert report["settings"]["max_tokens"] == 200 and report["settings"]["stride"] == 64
    rows = {r["label"]: r for r in report["results"]}
    assert set(rows) == {"fp32", "again"}
    assert rows["fp32"]["ppl"] == pytest.approx(rows["again"]["ppl"], rel=1e-6)
    assert rows["fp32"]["size_bytes"] > 0 and rows["fp32"]["quantization"] is None
    assert "fp32: ppl" in capsys.readouterr().out
    # a different budget cannot be appended to the same table
    assert driftgate_main([*common[:5], "100", *common[6:], str(tiny_model_dir), "--append"]) == 2
    assert "cannot --append" in capsys.readouterr().err


def test_every_model_folder_is_checked_before_the_first_is_measured(tiny_model_dir, text_file, tmp_path, capsys,
                                                                       monkeypatch):
    import bench.perplexity

    def must_not_measure(*args, **kwargs):
        raise AssertionError("a model was measured although a later folder is missing")

    monkeypatch.setattr(bench.perplexity, "measure", must_not_measure)
    config = tiny_model_dir / "config.json"
    for bad, says in ((tmp_path / "missing", "model folder not found"), (config, "is a file; give the model's folder")):
        assert driftgate_main(["bench", "ppl", "--data", str(text_file), str(tiny_model_dir), str(bad)]) == 2
        assert says in capsys.readouterr().err


def test_the_kv_cache_recorded_is_the_one_measured(tiny_model_dir, text_file, tmp_path):
    """A checkpoint declaring an fp8 KV cache is measured with it under `auto` (engine.config's
    rule, vLLM's), and the result says fp8 with checkpoint scales, not `auto`."""
    from quant.checkpoint import write_checkpoint
    from quant.config import QuantizationConfig
    from quant.schemes import FP8_KV
    from tests.helpers import quantized_tensors

    declared = write_checkpoint(tmp_path / "kv-fp8", source_dir=tiny_model_dir,
                                tensors=quantized_tensors(tiny_model_dir, None, kv=True),
                                quant_config=QuantizationConfig(kv_cache_scheme=FP8_KV))
    auto = measure(declared, text_file, max_tokens=300, context=64, stride=64)
    named = measure(declared, text_file, max_tokens=300, context=64, stride=64, kv_cache_dtype="fp8")
    assert (auto.kv_cache_dtype, auto.kv_scales, auto.ppl) == ("fp8", "checkpoint", named.ppl)
    plain = measure(tiny_model_dir, text_file, max_tokens=300, context=64, stride=64)
    assert (plain.kv_cache_dtype, plain.kv_scales) == ("auto", None) and plain.ppl != auto.ppl
