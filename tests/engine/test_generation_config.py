"""generation_config.json: its stop tokens end sequences, its sampling fields are defaults, bad files are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.generation_config import eos_token_ids, read_generation_config, sampling_defaults


def _copy_with(tiny_model_dir: Path, tmp_path: Path, generation_config: str) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text(generation_config)
    return folder


def test_eos_token_id_is_one_id_or_several():
    assert eos_token_ids({"eos_token_id": 7}) == [7]
    assert eos_token_ids({"eos_token_id": [7, 9]}) == [7, 9]
    assert eos_token_ids({}) == [] and eos_token_ids({"eos_token_id": None}) == []


def test_sampling_defaults_keep_only_sampling_fields(tiny_model_dir, tmp_path):
    folder = _copy_with(tiny_model_dir, tmp_path, json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": None, "max_length": 4096, "eos_token_id": 3}))
    assert sampling_defaults(folder) == {"temperature": 0.6, "top_p": 0.9}
    assert sampling_defaults(tmp_path) == {}  # a folder without the file asks nothing


def test_generation_config_source_and_override_as_vllm_takes_them(tiny_model_dir, tmp_path):
    """--generation-config auto (the model's), vllm/none (nothing) or a folder, with
    --override-generation-config laid over it; max_new_tokens becomes the max_tokens cap."""
    folder = _copy_with(tiny_model_dir, tmp_path, json.dumps({"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 20}))
    assert sampling_defaults(folder) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    assert sampling_defaults(folder, "vllm") == sampling_defaults(folder, "none") == {}
    assert sampling_defaults(folder, str(other)) == {"top_k": 20}
    assert sampling_defaults(folder, "auto", {"temperature": 0.0, "max_new_tokens": 8}) == {
        "temperature": 0.0, "top_p": 0.9, "max_tokens": 8}
    assert sampling_defaults(folder, "vllm", {"min_p": 0.05}) == {"min_p": 0.05}
    for source, override, says in (
            (str(tmp_path / "nowhere"), None, "--generation-config .*nowhere: no generation_config.json there"),
            ("auto", {"temperature": 0.5, "do_sample": True}, "sets do_sample; the fields it can set are temperature"),
            ("auto", {"max_new_tokens": 0}, "generation_config.json with --override-generation-config: max_tokens"),
            ("vllm", {"max_new_tokens": 2.5}, "^--override-generation-config: max_new_tokens must be a whole number"),
            ("vllm", {"top_p": "high"}, "--override-generation-config: ")):
        with pytest.raises(ValueError, match=says):
            sampling_defaults(folder, source, override)
    assert LLM(str(folder)).default_sampling_params.max_tokens == 64  # offline defaults, as vLLM's LLM


@pytest.mark.parametrize(("text", "says"), [("{not json", "cannot read"), ("[1, 2]", "not a JSON object"),
                                            ('{"temperature": -1}', "temperature")])
def test_bad_generation_config_is_refused_by_name(tiny_model_dir, tmp_path, text, says):
    folder = _copy_with(tiny_model_dir, tmp_path, text)
    with pytest.raises(ValueError, match=says) as info:
        sampling_defaults(folder)
    assert "generation_config.json" in str(info.value)


def test_its_eos_ids_end_generation(tiny_model_dir, tmp_path):
    base = LLM(str(tiny_model_dir))
    tokens = base.generate(["hello there"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    tokens = tokens.outputs[0].token_ids
    stop_at = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])  # first appearance of an id
    assert not set(tokens[:stop_at + 1]) & set(base.engine.eos_token_ids)  # nothing else would stop it
    folder = _copy_with(tiny_model_dir, tmp_path, json.dumps({"eos_token_id": [tokens[stop_at]]}))
    llm = LLM(str(folder))
    assert tokens[stop_at] in llm.engine.eos_token_ids
    out = llm.generate(["hello there"], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    assert out.finish_reason == "stop" and list(out.token_ids[:stop_at]) == list(tokens[:stop_at])
    assert len(out.token_ids) <= stop_at + 1
    assert read_generation_config(folder) == {"eos_token_id": [tokens[stop_at]]}


def test_generate_without_params_samples_as_the_config_says(tiny_model_dir, tmp_path):
    llm = LLM(str(_copy_with(tiny_model_dir, tmp_path, json.dumps({"temperature": 0.0, "top_k": 5}))))
    assert (llm.default_sampling_params.temperature, llm.default_sampling_params.top_k) == (0.0, 5)
    greedy = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0].token_ids
    assert llm.generate(["hello"])[0].outputs[0].token_ids == greedy  # the default max_tokens is 16 too
