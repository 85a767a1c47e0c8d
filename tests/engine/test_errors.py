"""Foreseeable mistakes are ValueErrors that say what to change; the engine keeps serving others."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.layers import triton_support
from engine.loader import load_model


def test_prompt_longer_than_context(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=4), use_tqdm=False)
    out = llm.generate([[5] * 10], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1, "the engine must keep working after a rejected request"
    assert llm.stats().num_blocks_used == 0 and llm.stats().num_waiting == 0


def test_bad_request_in_a_batch_rejects_batch_without_leaking(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=32)
    with pytest.raises(ValueError):
        llm.generate([[5] * 4, [6] * 50], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished() and not llm.engine.requests


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n must be"),
    ({"logprobs": -2}, "logprobs must be at least 0, or -1"),  # the upper bound is the engine's max_logprobs
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_out_of_vocabulary_token_ids(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32")
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 2, 10**6]], SamplingParams(max_tokens=1), use_tqdm=False)


def test_unknown_model_folder(tmp_path):
    with pytest.raises(ValueError, match="import-model"):
        LLM(str(tmp_path / "nope"))


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    bad = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(bad)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda c: c.pop("num_attention_heads"), "config.json lacks 'num_attention_heads'"),
    (lambda c: c.update(hidden_size="64"), "config.json's hidden_size must be a positive integer, not '64'"),
    (lambda c: c.update(num_hidden_layers=0), "config.json's num_hidden_layers must be a positive integer, not 0"),
])
def test_a_config_missing_a_size_or_holding_a_bad_one_names_it(tiny_model_dir, tmp_path, edit, message):
    """A KeyError, or a TypeError from deep in torch, said nothing about which file was wrong."""
    bad = tmp_path / "bad-config"
    shutil.copytree(tiny_model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    edit(config)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(bad)


def test_a_config_that_is_not_a_json_object_is_refused(tiny_model_dir, tmp_path):
    bad = tmp_path / "list-config"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not the object"):
        load_model(bad)
    (bad / "config.json").write_bytes("{}".encode("utf-16"))
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        load_model(bad)


def test_missing_tensor_is_named(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "missing"
    shutil.copytree(tiny_model_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate_up_proj"):
        load_model(bad)


def test_corrupt_safetensors(tiny_model_dir, tmp_path):
    bad = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="cannot read"):
        load_model(bad)


def test_unknown_engine_argument(tiny_model_dir):
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(str(tiny_model_dir), max_num_seq=4)


def test_fp8_kv_without_scales_says_how_to_calibrate(tiny_model_dir):
    with pytest.raises(ValueError, match="--kv-cache fp8"):
        LLM(str(tiny_model_dir), kv_cache_dtype="fp8")


@pytest.mark.parametrize("kwargs,match", [({"device": "gpu"}, "device must be cpu, cuda, cuda:N or auto"),
                                          ({"attention_backend": "flash"}, "attention_backend must be one of")])
def test_bad_device_or_backend(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", **kwargs)


def test_auto_device_is_the_cpu_without_a_gpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineConfig(model="m", device="auto").device == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_cuda_says_so(tiny_model_dir):
    with pytest.raises(ValueError, match="'cuda': torch .* sees no CUDA device"):
        LLM(str(tiny_model_dir), device="cuda")


def test_unavailable_attention_backend_is_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(triton_support, "triton", None)  # as where triton is not installed
    with pytest.raises(ValueError, match="attention_backend='triton' needs triton and a CUDA device"):
        LLM(str(tiny_model_dir), attention_backend="triton")


def test_generate_chat_on_a_model_without_a_chat_template_says_to_drop_chat(tiny_model_dir, tmp_path, capsys):
    import json

    from engine.cli import main as driftgate_main

    plain = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    assert driftgate_main(["generate", str(plain), "hi", "--chat", "--max-tokens", "2"]) == 2
    assert "has no chat template; leave out --chat" in capsys.readouterr().err
    assert driftgate_main(["generate", str(plain), "hi", "--max-tokens", "2"]) == 0


@pytest.mark.parametrize("bench", ["matmul", "attention"])
def test_shape_benches_on_a_missing_model_say_which_folder(bench, tmp_path, capsys):
    from engine.cli import main as driftgate_main

    assert driftgate_main(["bench", bench, str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert f"model folder not found: {tmp_path / 'missing'}" in err and "Errno" not in err


@pytest.mark.parametrize("bench", ["offline", "schemes", "steps", "ppl"])
def test_bench_on_a_missing_or_corrupt_model_is_one_line(bench, tiny_model_dir, tmp_path, capsys):
    from engine.cli import main as driftgate_main

    bad = tmp_path / "corrupt"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage")
    cases = [(bad, "cannot read")]
    if bench != "schemes":  # which checks its folders while parsing its arguments
        cases.append((tmp_path / "missing", "model folder not found"))
    for model, says in cases:
        assert driftgate_main(["bench", bench, f"m={model}" if bench == "schemes" else str(model)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and "Traceback" not in err


def test_a_damaged_tokenizer_names_its_folder(tiny_model_dir, tmp_path):
    """transformers' own error was the bare JSON message ("Expecting value: line 2 ..."): no file."""
    from engine.tokenizer import load_tokenizer

    bad = tmp_path / "bad-tokenizer"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "tokenizer.json").write_text("{\n oops")
    with pytest.raises(ValueError, match=f"cannot load the tokenizer in {re.escape(str(bad))}: Expecting"):
        load_tokenizer(bad)


def test_a_max_model_len_beyond_the_models_warns_and_serves_the_models(tiny_model_dir, caplog):
    """vLLM refuses it; we serve what the model was trained for, but say so rather than silently."""
    llm = LLM(str(tiny_model_dir), max_model_len=10**6, num_kv_blocks=256, block_size=4)
    assert llm.engine.max_model_len == 512
    assert "max_model_len 1000000 is beyond what" in caplog.text and "serving 512" in caplog.text
